//! The Prometheus text exposition: the one place metric families are written, for the
//! metrics of every part of the server (executors, ingest, the replicas' log), so each
//! part only says what it counts.

use std::fmt::{Display, Write};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use hdrhistogram::Histogram;

/// A family's type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
        }
    }
}

/// The upper bounds of a [`Buckets`] histogram: small counts, doubling.
pub const BUCKET_BOUNDS: [u64; 12] = [0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024];

/// A histogram of counts, kept by one executor and read at scrape.
#[derive(Debug, Default)]
pub struct Buckets {
    /// Per bound of [`BUCKET_BOUNDS`], then past the last.
    counts: [AtomicU64; BUCKET_BOUNDS.len() + 1],
    sum: AtomicU64,
}

impl Buckets {
    pub fn observe(&self, value: u64) {
        let i = BUCKET_BOUNDS.partition_point(|&b| b < value);
        self.counts[i].fetch_add(1, Relaxed);
        self.sum.fetch_add(value, Relaxed);
    }
}

/// The text of one scrape, family by family.
#[derive(Debug, Default)]
pub struct Exposition {
    text: String,
}

impl Exposition {
    pub fn new() -> Self {
        Exposition {
            text: String::with_capacity(16 << 10),
        }
    }

    fn header(&mut self, name: &str, help: &str, kind: &str) {
        let _ = writeln!(self.text, "# HELP {name} {help}\n# TYPE {name} {kind}");
    }

    /// A family of one unlabelled sample.
    pub fn one(&mut self, name: &str, help: &str, kind: Kind, value: u64) {
        self.header(name, help, kind.name());
        let _ = writeln!(self.text, "{name} {value}");
    }

    /// A family of one sample per value of `label`.
    pub fn by<L: Display>(
        &mut self,
        name: &str,
        help: &str,
        kind: Kind,
        label: &str,
        samples: impl IntoIterator<Item = (L, u64)>,
    ) {
        self.header(name, help, kind.name());
        for (value_of_label, v) in samples {
            let _ = writeln!(self.text, "{name}{{{label}=\"{value_of_label}\"}} {v}");
        }
    }

    /// A histogram as a summary: quantiles 0.5, 0.9, 0.99 and 0.999, sum and count.
    pub fn summary(&mut self, name: &str, help: &str, h: &Histogram<u64>) {
        self.header(name, help, "summary");
        for q in [0.5, 0.9, 0.99, 0.999] {
            let _ = writeln!(
                self.text,
                "{name}{{quantile=\"{q}\"}} {}",
                h.value_at_quantile(q)
            );
        }
        let total: u64 = h
            .iter_recorded()
            .map(|v| v.value_iterated_to() * v.count_at_value())
            .sum();
        let _ = writeln!(self.text, "{name}_sum {total}\n{name}_count {}", h.len());
    }

    /// A histogram of counts, one per value of `label`: its buckets cumulative, as
    /// Prometheus wants them.
    pub fn histogram_by<'b, L: Display>(
        &mut self,
        name: &str,
        help: &str,
        label: &str,
        samples: impl IntoIterator<Item = (L, &'b Buckets)>,
    ) {
        self.header(name, help, "histogram");
        for (value_of_label, b) in samples {
            let mut cumulative = 0;
            for (i, bound) in BUCKET_BOUNDS.iter().enumerate() {
                cumulative += b.counts[i].load(Relaxed);
                let _ = writeln!(
                    self.text,
                    "{name}_bucket{{{label}=\"{value_of_label}\",le=\"{bound}\"}} {cumulative}"
                );
            }
            cumulative += b.counts[BUCKET_BOUNDS.len()].load(Relaxed);
            let _ = writeln!(
                self.text,
                "{name}_bucket{{{label}=\"{value_of_label}\",le=\"+Inf\"}} {cumulative}\n\
                 {name}_sum{{{label}=\"{value_of_label}\"}} {}\n\
                 {name}_count{{{label}=\"{value_of_label}\"}} {cumulative}",
                b.sum.load(Relaxed)
            );
        }
    }

    pub fn into_text(self) -> String {
        self.text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn families_are_written_in_the_text_format() {
        let mut e = Exposition::new();
        e.one("a_total", "As.", Kind::Counter, 3);
        e.by("b", "Bs.", Kind::Gauge, "why", [("x", 1), ("y", 2)]);
        let mut h = Histogram::<u64>::new_with_bounds(1, 1000, 2).unwrap();
        h.record(10).unwrap();
        h.record(20).unwrap();
        e.summary("c_us", "Cs.", &h);
        let b = Buckets::default();
        for v in [0, 3, 2000] {
            b.observe(v);
        }
        e.histogram_by("d", "Ds.", "executor", [(0, &b)]);
        let text = e.into_text();
        for line in [
            "d_bucket{executor=\"0\",le=\"0\"} 1",
            "d_bucket{executor=\"0\",le=\"2\"} 1",
            "d_bucket{executor=\"0\",le=\"4\"} 2",
            "d_bucket{executor=\"0\",le=\"1024\"} 2",
            "d_bucket{executor=\"0\",le=\"+Inf\"} 3",
            "d_sum{executor=\"0\"} 2003",
            "d_count{executor=\"0\"} 3",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} not in {text}");
        }
        assert_eq!(
            text.lines().take(8).collect::<Vec<_>>(),
            [
                "# HELP a_total As.",
                "# TYPE a_total counter",
                "a_total 3",
                "# HELP b Bs.",
                "# TYPE b gauge",
                "b{why=\"x\"} 1",
                "b{why=\"y\"} 2",
                "# HELP c_us Cs.",
            ]
        );
        assert!(text.contains("# TYPE c_us summary\nc_us{quantile=\"0.5\"} 10\n"));
        assert!(
            text.contains("c_us_sum 30\nc_us_count 2\n# HELP d"),
            "{text}"
        );
    }
}
