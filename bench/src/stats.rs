//! Latency summaries (hdrhistogram, recorded in nanoseconds, reported in microseconds)
//! and the small statistics the reports share.

use hdrhistogram::Histogram;
use serde::Serialize;

/// A histogram of nanoseconds: 1 ns .. 100 s, 3 significant digits.
pub fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 100_000_000_000, 3).expect("valid histogram bounds")
}

/// Records `ns`, clamped into the histogram's range.
pub fn record(h: &mut Histogram<u64>, ns: u64) {
    h.saturating_record(ns.max(1));
}

/// Percentiles of a latency histogram, in microseconds.
#[derive(Debug, Clone, Copy, Serialize, serde::Deserialize, PartialEq)]
pub struct Summary {
    pub count: u64,
    pub min_us: f64,
    pub mean_us: f64,
    pub p50_us: f64,
    pub p90_us: f64,
    pub p99_us: f64,
    pub p999_us: f64,
    pub max_us: f64,
}

impl Summary {
    pub fn of(h: &Histogram<u64>) -> Summary {
        let us = |ns: u64| ns as f64 / 1000.0;
        if h.is_empty() {
            return Summary {
                count: 0,
                min_us: 0.0,
                mean_us: 0.0,
                p50_us: 0.0,
                p90_us: 0.0,
                p99_us: 0.0,
                p999_us: 0.0,
                max_us: 0.0,
            };
        }
        Summary {
            count: h.len(),
            min_us: us(h.min()),
            mean_us: h.mean() / 1000.0,
            p50_us: us(h.value_at_quantile(0.50)),
            p90_us: us(h.value_at_quantile(0.90)),
            p99_us: us(h.value_at_quantile(0.99)),
            p999_us: us(h.value_at_quantile(0.999)),
            max_us: us(h.max()),
        }
    }

    /// `self / floor` per percentile (0 where the floor is 0).
    pub fn ratio(&self, floor: &Summary) -> Ratios {
        let r = |a: f64, b: f64| if b > 0.0 { a / b } else { 0.0 };
        Ratios {
            p50: r(self.p50_us, floor.p50_us),
            p90: r(self.p90_us, floor.p90_us),
            p99: r(self.p99_us, floor.p99_us),
            p999: r(self.p999_us, floor.p999_us),
        }
    }
}

/// Per-percentile ratios of one summary to another measured in the same run.
#[derive(Debug, Clone, Copy, Serialize, serde::Deserialize, PartialEq)]
pub struct Ratios {
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub p999: f64,
}

impl Summary {
    /// Table cells: p50, p90, p99, p99.9 (µs, one decimal), then the count.
    pub fn cells(&self) -> Vec<String> {
        let f = crate::table::f;
        vec![
            f(self.p50_us, 1),
            f(self.p90_us, 1),
            f(self.p99_us, 1),
            f(self.p999_us, 1),
            self.count.to_string(),
        ]
    }
}

impl Ratios {
    /// Table cells: the four percentile ratios, two decimals.
    pub fn cells(&self) -> Vec<String> {
        let f = crate::table::f;
        vec![
            f(self.p50, 2),
            f(self.p90, 2),
            f(self.p99, 2),
            f(self.p999, 2),
        ]
    }
}

/// Coefficient of variation (population std / mean); 0 for an empty or all-zero input.
pub fn cov(xs: &[f64]) -> f64 {
    if xs.is_empty() {
        return 0.0;
    }
    let n = xs.len() as f64;
    let mean = xs.iter().sum::<f64>() / n;
    if mean == 0.0 {
        return 0.0;
    }
    let var = xs.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / n;
    var.sqrt() / mean
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cov_of_flat_and_skewed() {
        assert_eq!(cov(&[3.0, 3.0, 3.0]), 0.0);
        assert!((cov(&[0.0, 2.0]) - 1.0).abs() < 1e-12);
        assert_eq!(cov(&[]), 0.0);
    }

    #[test]
    fn summary_percentiles_in_us() {
        let mut h = histogram();
        for i in 1..=1000u64 {
            record(&mut h, i * 1000);
        }
        let s = Summary::of(&h);
        assert_eq!(s.count, 1000);
        assert!((s.p50_us - 500.0).abs() < 1.0);
        assert!((s.p99_us - 990.0).abs() < 1.0);
        let r = s.ratio(&s);
        assert!((r.p50 - 1.0).abs() < 1e-12);
    }
}
