//! A small deterministic PRNG (SplitMix64): the same seed gives the same workload on every
//! platform and every build, with no dependency whose stream could change.

/// SplitMix64.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    /// An independent stream for `(seed, a, b)`: per-session streams keep the workload
    /// identical whatever the routing did.
    pub fn derive(seed: u64, a: u64, b: u64) -> Self {
        let mut r = Rng(seed ^ mix(a.wrapping_add(0x9E37_79B9_7F4A_7C15)));
        r.0 ^= mix(b.wrapping_add(0xD1B5_4A32_D192_ED03));
        r
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        mix(self.0)
    }

    /// Uniform in `[0, n)` (`n > 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        ((self.next_u64() as u128 * n as u128) >> 64) as u64
    }

    /// Uniform in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Exponential with the given mean.
    pub fn exp(&mut self, mean: f64) -> f64 {
        -mean * (1.0 - self.unit()).ln()
    }

    /// Uniform integer in `[mean/2, 3·mean/2]`.
    pub fn around(&mut self, mean: u32) -> u32 {
        if mean == 0 {
            return 0;
        }
        let lo = mean / 2;
        lo + self.below(mean as u64 + 1) as u32
    }
}

/// The SplitMix64 finaliser.
pub fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}
