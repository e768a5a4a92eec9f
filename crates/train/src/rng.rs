//! The trainer's deterministic random numbers: splitmix64, so a run's draws depend only on its
//! seed and the step (a resumed run draws what an uninterrupted one would).

/// A splitmix64 stream.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    /// The stream of `seed`, offset by `stream` (e.g. the step), so that streams differ.
    #[must_use]
    pub fn new(seed: u64, stream: u64) -> Self {
        let mut r = Self(seed ^ stream.wrapping_mul(0xD1B5_4A32_D192_ED03));
        r.next_u64();
        r
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: usize) -> usize {
        // 128-bit multiply: unbiased enough for sampling and free of a modulo's skew at small n.
        let n = n as u128;
        #[allow(
            clippy::cast_possible_truncation,
            reason = "the product's high half is below n, which came from a usize"
        )]
        let v = ((u128::from(self.next_u64()) * n) >> 64) as usize;
        v
    }

    /// Uniform in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        #[allow(
            clippy::cast_precision_loss,
            reason = "53 random bits fit an f64 exactly"
        )]
        let v = (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        v
    }

    /// A standard normal draw (Box–Muller).
    pub fn normal(&mut self) -> f64 {
        let u1 = self.unit().max(f64::MIN_POSITIVE);
        let u2 = self.unit();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streams_are_reproducible_and_distinct() {
        let a: Vec<u64> = (0..4).map(|_| Rng::new(7, 3).next_u64()).collect();
        assert!(a.windows(2).all(|w| w[0] == w[1]));
        assert_ne!(Rng::new(7, 3).next_u64(), Rng::new(7, 4).next_u64());
        let mut r = Rng::new(1, 0);
        let n = 20_000;
        let draws: Vec<f64> = (0..n).map(|_| r.normal()).collect();
        #[allow(clippy::cast_precision_loss, reason = "small count")]
        let mean = draws.iter().sum::<f64>() / n as f64;
        #[allow(clippy::cast_precision_loss, reason = "small count")]
        let var = draws.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n as f64;
        assert!(mean.abs() < 0.03, "mean {mean}");
        assert!((var - 1.0).abs() < 0.05, "variance {var}");
        assert!((0..1000).all(|_| r.below(7) < 7));
    }
}
