//! What the CPU backend's benches share.

/// `n` values in `[-2, 2)` from a xorshift of `seed` (a pure function of both).
pub fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let top = u16::try_from(s >> 48).unwrap_or(0);
            (f32::from(top) / 65_536.0 - 0.5) * 4.0
        })
        .collect()
}
