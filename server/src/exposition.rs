//! The Prometheus text exposition: the one place metric families are written, for the
//! metrics of every part of the server (executors, ingest, the replicas' log), so each
//! part only says what it counts.

use std::fmt::{Display, Write};

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
        let text = e.into_text();
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
        assert!(text.ends_with("c_us_sum 30\nc_us_count 2\n"), "{text}");
    }
}
