//! Seeded random numbers: SplitMix64 expands a 64-bit seed, xoshiro256** produces the stream.
//!
//! Both generators are written out here (about twenty lines) rather than taken from a crate, so
//! that a seed maps to the same stream in every version of specula: a sampled completion is
//! reproducible from `(model, prompt, params, seed)` for as long as this file does not change.
//! The algorithms are David Blackman and Sebastiano Vigna's public-domain reference code
//! (<https://prng.di.unimi.it/xoshiro256starstar.c>, <https://prng.di.unimi.it/splitmix64.c>);
//! the tests pin the first outputs against that C code.

use std::hash::{BuildHasher, Hasher};

/// SplitMix64: a 64-bit counter passed through a bijective mixer. Used only to expand a seed
/// into the 256-bit state of [`Rng`] (the seeding Vigna recommends), never as the stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    /// A generator whose first output mixes `seed + 0x9e3779b97f4a7c15`.
    #[must_use]
    pub const fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

/// xoshiro256**: the sampler's random stream. 256 bits of state, period 2^256 − 1, passes
/// BigCrush; a copy of the value is a complete snapshot of the stream (which is what
/// speculative rollback needs), so the type is `Copy`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Rng {
    s: [u64; 4],
}

impl Rng {
    /// The stream for `seed`: the state is four consecutive SplitMix64 outputs. Never all-zero
    /// (SplitMix64 is a bijection of a counter, so four consecutive outputs cannot all be 0).
    #[must_use]
    pub fn seed_from_u64(seed: u64) -> Self {
        let mut sm = SplitMix64::new(seed);
        Self {
            s: [sm.next_u64(), sm.next_u64(), sm.next_u64(), sm.next_u64()],
        }
    }

    /// A generator with the given raw state, or `None` for the all-zero state (a fixed point
    /// of xoshiro that would output zeros forever).
    #[must_use]
    pub fn from_state(s: [u64; 4]) -> Option<Self> {
        (s != [0; 4]).then_some(Self { s })
    }

    /// The raw 256-bit state (for serialising a [`crate::SamplerState`]).
    #[must_use]
    pub const fn state(&self) -> [u64; 4] {
        self.s
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let s = &mut self.s;
        let result = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }

    /// A uniform double in `[0, 1)`: the top 53 bits scaled by 2^-53, so every value is an
    /// exact multiple of 2^-53 and 1.0 is never returned.
    pub fn next_f64(&mut self) -> f64 {
        const SCALE: f64 = 1.0 / (1u64 << 53) as f64;
        (self.next_u64() >> 11) as f64 * SCALE
    }
}

/// A seed that differs from run to run, for callers that want llama.cpp's "random seed"
/// behaviour (its `LLAMA_DEFAULT_SEED`). Taken from the standard library's per-process random
/// hasher keys mixed with the clock, so this crate needs no OS-entropy dependency; it is not
/// suitable for cryptography, only for choosing a sampling stream.
#[must_use]
pub fn entropy_seed() -> u64 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    if let Ok(d) = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
        h.write_u128(d.as_nanos());
    }
    SplitMix64::new(h.finish()).next_u64()
}

#[cfg(test)]
mod tests {
    use super::*;

    // Expected values come from Vigna's reference C code (splitmix64.c and
    // xoshiro256starstar.c, compiled with gcc), not from this implementation.

    const SPLITMIX_SEED0: [u64; 4] = [
        16_294_208_416_658_607_535,
        7_960_286_522_194_355_700,
        487_617_019_471_545_679,
        17_909_611_376_780_542_444,
    ];
    const SPLITMIX_SEED1234567: [u64; 3] = [
        6_457_827_717_110_365_317,
        3_203_168_211_198_807_973,
        9_817_491_932_198_370_423,
    ];
    const XOSHIRO_1234: [u64; 6] = [
        11_520,
        0,
        1_509_978_240,
        1_215_971_899_390_074_240,
        1_216_172_134_540_287_360,
        607_988_272_756_665_600,
    ];
    const XOSHIRO_SEED42: [u64; 3] = [
        1_546_998_764_402_558_742,
        6_990_951_692_964_543_102,
        12_544_586_762_248_559_009,
    ];

    #[test]
    fn splitmix64_matches_reference_c() {
        let mut sm = SplitMix64::new(0);
        let got: Vec<u64> = (0..4).map(|_| sm.next_u64()).collect();
        assert_eq!(got, SPLITMIX_SEED0);
        let mut sm = SplitMix64::new(1_234_567);
        let got: Vec<u64> = (0..3).map(|_| sm.next_u64()).collect();
        assert_eq!(got, SPLITMIX_SEED1234567);
    }

    #[test]
    fn xoshiro_matches_reference_c() {
        let mut r = Rng::from_state([1, 2, 3, 4]).expect("non-zero state");
        let got: Vec<u64> = (0..6).map(|_| r.next_u64()).collect();
        assert_eq!(got, XOSHIRO_1234);
        let mut r = Rng::seed_from_u64(42);
        let got: Vec<u64> = (0..3).map(|_| r.next_u64()).collect();
        assert_eq!(got, XOSHIRO_SEED42);
    }

    #[test]
    fn next_f64_is_in_unit_interval() {
        let mut r = Rng::seed_from_u64(7);
        for _ in 0..10_000 {
            let u = r.next_f64();
            assert!((0.0..1.0).contains(&u), "{u}");
        }
        // The extreme outputs map to 0 and to the largest double below 1.
        assert!(((u64::MAX >> 11) as f64 / (1u64 << 53) as f64) < 1.0);
    }

    #[test]
    fn entropy_seeds_differ_between_calls() {
        // Each `RandomState::new` in a process gets fresh hasher keys, so two calls differ
        // even within the same clock tick.
        assert_ne!(entropy_seed(), entropy_seed());
    }

    #[test]
    fn zero_state_is_rejected() {
        assert_eq!(Rng::from_state([0; 4]), None);
        let r = Rng::seed_from_u64(0);
        assert_ne!(r.state(), [0; 4]);
        assert_eq!(Rng::from_state(r.state()), Some(r));
    }
}
