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

/// How the values several writers (executors) keep become one sample.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Merge {
    /// Their sum: each counts its own share.
    Sum,
    /// The first one's: each keeps the same value (a copy of the index's size).
    First,
}

/// One metric family of a set declared with [`metric_set!`]: where its value is kept.
pub struct Family<T: 'static> {
    pub name: &'static str,
    pub help: &'static str,
    pub kind: Kind,
    pub merge: Merge,
    pub read: Read<T>,
}

/// Where a family's samples are kept in its set.
pub enum Read<T: 'static> {
    One(fn(&T) -> &AtomicU64),
    /// One sample per value of `label`, in that order.
    By {
        label: &'static str,
        values: &'static [&'static str],
        read: fn(&T) -> &[AtomicU64],
    },
}

/// Declares a struct of counters and gauges, each field once with its family: its help
/// (the one-line doc comment), kind (`Counter`, `Gauge`), how writers' values merge
/// (`Sum`, `First`) and name, and for a labelled family its label and values (a const
/// `&[&str]`). Fields that are not families follow in `extra { ... }`. `FAMILIES` lists
/// the families for [`Exposition::families`]; a set without extras has a `const fn
/// new()` too (for a `static`).
#[macro_export]
macro_rules! metric_set {
    (
        $(#[$attr:meta])*
        pub struct $name:ident { $($families:tt)* }
        extra { $($extra:tt)* }
    ) => {
        $crate::metric_set!(@set $(#[$attr])* $name [$($families)*] [$($extra)*]);
    };
    (
        $(#[$attr:meta])*
        pub struct $name:ident {
            $(
                #[doc = $help:literal]
                $field:ident : $kind:ident $merge:ident $family:literal
                $( by $label:literal ($values:expr) )? ,
            )*
        }
    ) => {
        $crate::metric_set!(@set $(#[$attr])* $name [$(
            #[doc = $help] $field : $kind $merge $family $( by $label ($values) )? ,
        )*] []);
        impl $name {
            /// Every value zero, in a const context (a `static`).
            #[allow(clippy::declare_interior_mutable_const)]
            pub const fn new() -> Self {
                const ZERO: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
                $name { $( $field: $crate::metric_set!(@zero ZERO $( ($values) )?), )* }
            }
        }
    };
    (@set $(#[$attr:meta])* $name:ident [
        $(
            #[doc = $help:literal]
            $field:ident : $kind:ident $merge:ident $family:literal
            $( by $label:literal ($values:expr) )? ,
        )*
    ] [ $( $(#[$xattr:meta])* $xvis:vis $xfield:ident : $xty:ty ),* $(,)? ]) => {
        $(#[$attr])*
        #[derive(Default)]
        pub struct $name {
            $( #[doc = $help] pub $field: $crate::metric_set!(@ty $( ($values) )?), )*
            $( $(#[$xattr])* $xvis $xfield: $xty, )*
        }

        impl $name {
            pub const FAMILIES: &'static [$crate::exposition::Family<$name>] = &[
                $(
                    $crate::exposition::Family {
                        name: $family,
                        help: $help,
                        kind: $crate::exposition::Kind::$kind,
                        merge: $crate::exposition::Merge::$merge,
                        read: $crate::metric_set!(@read $name $field $( $label ($values) )?),
                    },
                )*
            ];
        }
    };
    (@ty) => { std::sync::atomic::AtomicU64 };
    (@ty ($values:expr)) => { [std::sync::atomic::AtomicU64; $values.len()] };
    (@zero $zero:ident) => { $zero };
    (@zero $zero:ident ($values:expr)) => { [$zero; $values.len()] };
    (@read $name:ident $field:ident) => { $crate::exposition::Read::One(|s: &$name| &s.$field) };
    (@read $name:ident $field:ident $label:literal ($values:expr)) => {
        $crate::exposition::Read::By { label: $label, values: $values, read: |s: &$name| &s.$field[..] }
    };
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

    /// Every family of a [`metric_set!`] set, merged over `parts` (each writer's set).
    pub fn families<T>(&mut self, families: &[Family<T>], parts: &[T]) {
        let merged = |f: &Family<T>, at: &dyn Fn(&T) -> u64| match f.merge {
            Merge::Sum => parts.iter().map(at).sum(),
            Merge::First => parts.first().map_or(0, at),
        };
        for f in families {
            match f.read {
                Read::One(read) => {
                    let v = merged(f, &|p| read(p).load(Relaxed));
                    self.one(f.name, f.help.trim(), f.kind, v);
                }
                Read::By {
                    label,
                    values,
                    read,
                } => {
                    let samples = values
                        .iter()
                        .enumerate()
                        .map(|(i, v)| (v, merged(f, &|p| read(p)[i].load(Relaxed))));
                    let samples: Vec<_> = samples.collect();
                    self.by(f.name, f.help.trim(), f.kind, label, samples);
                }
            }
        }
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
