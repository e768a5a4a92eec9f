//! IQ4_NL and IQ4_XS: 4-bit codes into the non-linear 16-entry codebook `kvalues_iq4nl`, with
//! one f16 scale per 32 values (IQ4_NL) or 6-bit scales per 32 values under an f16 super-scale
//! per 256 values (IQ4_XS).
//!
//! Reproduced from upstream `ggml/src/ggml-quants.c`: `quantize_row_iq4_nl_impl` (shared by both
//! formats), its callers `quantize_iq4_nl`, `quantize_row_iq4_nl_ref` and `quantize_iq4_xs`,
//! `best_index_int8`, and `dequantize_row_iq4_nl` / `dequantize_row_iq4_xs`; the codebook is
//! `kvalues_iq4nl` of `ggml/src/ggml-common.h`.
//!
//! IQ4_NL has two reference quantizers that give different bytes:
//!
//! - [`quantize_row_iq4_nl`] is what `ggml_quantize_chunk` (and so `llama-quantize`) runs:
//!   `quantize_iq4_nl`, i.e. the search with `ntry = 7`, followed by re-encoding every value with
//!   the final scale.
//! - [`quantize_row_iq4_nl_ref`] is ggml-cpu's `from_float` for IQ4_NL, used when a KV cache of
//!   that type is written: `ntry = −1`, a single least-squares refit of the first guess, and the
//!   codes of the first guess kept.
//!
//! Without an importance matrix both weigh each value by `x²`. Every f32 expression is evaluated
//! in the C order (see the [`kquants`](crate::kquants) module docs for why that matters).

use crate::blocks::{BlockIq4Nl, BlockIq4Xs, Half, QK, QK_K};
use crate::kquants::nearest_int;

/// The IQ4_NL / IQ4_XS codebook (`kvalues_iq4nl`), ascending.
pub const KVALUES_IQ4NL: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// `GROUP_MAX_EPS`: below this largest magnitude a block counts as all zero.
const GROUP_MAX_EPS: f32 = 1e-15;

/// `best_index_int8`: the index of the entry of the ascending table `values` nearest to `x`, by
/// binary search. Values beyond either end clamp to it; a tie between two neighbours goes to the
/// upper one (the C test is `x − val[mu−1] < val[mu] − x`); NaN gives the last index.
#[inline]
pub(crate) fn best_index_int8(values: &[i8], x: f32) -> usize {
    let v = |i: usize| f32::from(values[i]);
    let n = values.len();
    if x <= v(0) {
        return 0;
    }
    if x >= v(n - 1) {
        return n - 1;
    }
    let (mut ml, mut mu) = (0, n - 1);
    while mu - ml > 1 {
        let mav = usize::midpoint(ml, mu);
        if x < v(mav) {
            mu = mav;
        } else {
            ml = mav;
        }
    }
    if x - v(mu - 1) < v(mu) - x {
        mu - 1
    } else {
        mu
    }
}

/// A codebook index as a nibble.
#[inline]
fn nibble(i: usize) -> u8 {
    debug_assert!(i < 16);
    u8::try_from(i & 0xF).unwrap_or(0)
}

/// The codebook value of index `i` as f32.
#[inline]
fn kv(i: usize) -> f32 {
    f32::from(KVALUES_IQ4NL[i])
}

/// The per-32-value scale search of `quantize_row_iq4_nl_impl` with weights `x²` (no importance
/// matrix).
///
/// Returns `None` for a block whose largest magnitude is below `GROUP_MAX_EPS`: ggml records
/// scale 0 and leaves the codes `lb` untouched. Otherwise writes the codes of the first guess
/// (`d = ±max/−127`; the sign is flipped when `ntry > 0`) to `lb` and returns the best scale:
/// the least-squares refit of that guess, then of the `2·ntry + 1` tries
/// `1/d = (itry − 127)/max`, each kept when it improves `(Σw·q·x)² / Σw·q²`.
fn block_scale(xb: &[f32], lb: &mut [u8], ntry: i32) -> Option<f32> {
    debug_assert!(xb.len() == QK && lb.len() == QK);
    let weight: [f32; QK] = std::array::from_fn(|j| xb[j] * xb[j]);
    let (mut amax, mut max) = (0.0f32, 0.0f32);
    for &v in xb {
        let ax = v.abs();
        if ax > amax {
            amax = ax;
            max = v;
        }
    }
    if amax < GROUP_MAX_EPS {
        return None;
    }
    let v0 = f32::from(KVALUES_IQ4NL[0]);
    let mut d = if ntry > 0 { -max / v0 } else { max / v0 };
    let id = 1.0 / d;
    let (mut sumqx, mut sumq2) = (0.0f32, 0.0f32);
    for ((&x, &w), l) in xb.iter().zip(&weight).zip(lb.iter_mut()) {
        let idx = best_index_int8(&KVALUES_IQ4NL, id * x);
        *l = nibble(idx);
        let q = kv(idx);
        sumqx += w * q * x;
        sumq2 += w * q * q;
    }
    d = if sumq2 > 0.0 { sumqx / sumq2 } else { 0.0 };
    let mut best = d * sumqx;
    for itry in -ntry..=ntry {
        #[allow(
            clippy::cast_precision_loss,
            reason = "itry − 127 is a small integer, exact in f32"
        )]
        let id = (itry + i32::from(KVALUES_IQ4NL[0])) as f32 / max;
        let (mut sumqx, mut sumq2) = (0.0f32, 0.0f32);
        for (&x, &w) in xb.iter().zip(&weight) {
            let q = kv(best_index_int8(&KVALUES_IQ4NL, id * x));
            sumqx += w * q * x;
            sumq2 += w * q * q;
        }
        if sumq2 > 0.0 && sumqx * sumqx > best * sumq2 {
            d = sumqx / sumq2;
            best = d * sumqx;
        }
    }
    Some(d)
}

/// Packs 32 codes as ggml does: low nibble of byte j is element j, high nibble element j + 16.
#[inline]
fn pack_nibbles(l: &[u8], qs: &mut [u8]) {
    for (j, q) in qs.iter_mut().enumerate() {
        *q = l[j] | (l[j + 16] << 4);
    }
}

/// The 32-value form of `quantize_row_iq4_nl_impl` (`super_block_size == block_size == 32`).
/// `l` carries over from the previous block of the row, because ggml's does: an all-zero block
/// with `ntry ≤ 0` re-emits it.
fn quantize_nl(x: &[f32], y: &mut [BlockIq4Nl], ntry: i32) {
    debug_assert_eq!(x.len(), y.len() * QK);
    // ggml's buffer is uninitialised before the first block; the only way it is read unwritten is
    // an all-zero first block under `ntry ≤ 0`, where code 8 (value +1, times d = 0) is written —
    // the code the `ntry = 7` path writes for such a block.
    let mut l = [8u8; QK];
    for (xb, b) in x.chunks_exact(QK).zip(y) {
        let scale = block_scale(xb, &mut l, ntry).unwrap_or(0.0);
        b.d = Half::from_f32(scale);
        if ntry > 0 {
            // Re-encode with the final (unrounded) scale. C tests `scales[0] ? … : 0`, so NaN
            // takes the reciprocal, as with `!= 0.0`.
            let id = if scale != 0.0 { 1.0 / scale } else { 0.0 };
            for (li, &v) in l.iter_mut().zip(xb) {
                *li = nibble(best_index_int8(&KVALUES_IQ4NL, id * v));
            }
        }
        pack_nibbles(&l, &mut b.qs);
    }
}

/// IQ4_NL as `llama-quantize` writes it (`quantize_iq4_nl`, `ntry = 7`, no importance matrix).
pub fn quantize_row_iq4_nl(x: &[f32], y: &mut [BlockIq4Nl]) {
    quantize_nl(x, y, 7);
}

/// IQ4_NL as ggml-cpu writes a KV cache (`quantize_row_iq4_nl_ref`, `ntry = −1`): the scale is
/// the least-squares refit of `d = max/−127`, the codes those of `d = max/−127`.
///
/// An all-zero block (largest magnitude below 1e-15) gets `d = 0` and, as in ggml, the codes of
/// the previous block of the same call; for the first block of a call ggml reads uninitialised
/// memory, where this function writes code 8 (`0x88` bytes). Every such block dequantizes to
/// (signed) zeros either way.
pub fn quantize_row_iq4_nl_ref(x: &[f32], y: &mut [BlockIq4Nl]) {
    quantize_nl(x, y, -1);
}

/// IQ4_NL dequantization (`dequantize_row_iq4_nl`): `y = d · kvalues_iq4nl[q]`.
pub fn dequantize_row_iq4_nl(x: &[BlockIq4Nl], y: &mut [f32]) {
    debug_assert_eq!(y.len(), x.len() * QK);
    for (b, y) in x.iter().zip(y.chunks_exact_mut(QK)) {
        let d = b.d.to_f32();
        let (lo, hi) = y.split_at_mut(QK / 2);
        for ((&q, lo), hi) in b.qs.iter().zip(lo).zip(hi) {
            *lo = d * kv(usize::from(q & 0xF));
            *hi = d * kv(usize::from(q >> 4));
        }
    }
}

/// IQ4_XS as `llama-quantize` writes it (`quantize_iq4_xs`, `ntry = 7`, no importance matrix):
/// the IQ4_NL search per 32 values, then 6-bit signed sub-block scales under `d = −max/32`
/// (`max` the signed sub-block scale of largest magnitude), and every value re-encoded with its
/// quantized sub-block scale.
pub fn quantize_row_iq4_xs(x: &[f32], y: &mut [BlockIq4Xs]) {
    debug_assert_eq!(x.len(), y.len() * QK_K);
    const NB: usize = QK_K / QK;
    for (x, b) in x.chunks_exact(QK_K).zip(y) {
        let mut l = [0u8; QK_K];
        let mut scales = [0f32; NB];
        let (mut max_scale, mut amax_scale) = (0.0f32, 0.0f32);
        for (ib, (xb, lb)) in x.chunks_exact(QK).zip(l.chunks_exact_mut(QK)).enumerate() {
            let Some(d) = block_scale(xb, lb, 7) else {
                scales[ib] = 0.0;
                continue;
            };
            scales[ib] = d;
            let abs_d = d.abs();
            if abs_d > amax_scale {
                amax_scale = abs_d;
                max_scale = d;
            }
        }

        // An all-zero super-block gives d = −0.0, stored as such (f16 0x8000), as in ggml.
        let d = -max_scale / 32.0;
        b.d = Half::from_f32(d);
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut scales_h = 0u16;
        b.scales_l = [0; 4];
        for (ib, ((xb, lb), &scale)) in x
            .chunks_exact(QK)
            .zip(l.chunks_exact_mut(QK))
            .zip(&scales)
            .enumerate()
        {
            let ls = nearest_int(id * scale).clamp(-32, 31);
            #[allow(
                clippy::cast_precision_loss,
                reason = "ls is in −32..=31, exact in f32"
            )]
            let dl = d * ls as f32;
            let idl = if dl != 0.0 { 1.0 / dl } else { 0.0 };
            for (li, &v) in lb.iter_mut().zip(xb) {
                *li = nibble(best_index_int8(&KVALUES_IQ4NL, idl * v));
            }
            // ls + 32 is 0..=63: low 4 bits in scales_l, high 2 bits in scales_h.
            let biased = u16::try_from(ls + 32).unwrap_or(0);
            let l_l = nibble(usize::from(biased & 0xF));
            if ib % 2 == 0 {
                b.scales_l[ib / 2] = l_l;
            } else {
                b.scales_l[ib / 2] |= l_l << 4;
            }
            scales_h |= (biased >> 4) << (2 * ib);
        }
        b.scales_h = scales_h.to_le_bytes();
        for (qs, l) in b.qs.chunks_exact_mut(16).zip(l.chunks_exact(QK)) {
            pack_nibbles(l, qs);
        }
    }
}

/// IQ4_XS dequantization (`dequantize_row_iq4_xs`): `y = d·(ls − 32)·kvalues_iq4nl[q]`, with
/// `ls` the 6-bit scale of the 32-value sub-block.
pub fn dequantize_row_iq4_xs(x: &[BlockIq4Xs], y: &mut [f32]) {
    debug_assert_eq!(y.len(), x.len() * QK_K);
    for (b, y) in x.iter().zip(y.chunks_exact_mut(QK_K)) {
        let d = b.d.to_f32();
        let scales_h = u16::from_le_bytes(b.scales_h);
        for (ib, (qs, y)) in
            b.qs.chunks_exact(16)
                .zip(y.chunks_exact_mut(QK))
                .enumerate()
        {
            let lo = u16::from((b.scales_l[ib / 2] >> (4 * (ib % 2))) & 0xF);
            let ls = i32::from(lo | (((scales_h >> (2 * ib)) & 3) << 4));
            #[allow(
                clippy::cast_precision_loss,
                reason = "ls − 32 is in −32..=31, exact in f32"
            )]
            let dl = d * (ls - 32) as f32;
            let (lo, hi) = y.split_at_mut(16);
            for ((&q, lo), hi) in qs.iter().zip(lo).zip(hi) {
                *lo = dl * kv(usize::from(q & 0xF));
                *hi = dl * kv(usize::from(q >> 4));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn best_index_int8_clamps_and_breaks_ties_upward() {
        let v = &KVALUES_IQ4NL;
        assert_eq!(best_index_int8(v, -1000.0), 0);
        assert_eq!(best_index_int8(v, -127.0), 0);
        assert_eq!(best_index_int8(v, 113.0), 15);
        assert_eq!(best_index_int8(v, 1e9), 15);
        // Midpoints go to the upper neighbour.
        assert_eq!(best_index_int8(v, -4.5), 8);
        assert_eq!(best_index_int8(v, 101.0), 15);
        assert_eq!(best_index_int8(v, -115.5), 1);
        // Just below a midpoint goes down.
        assert_eq!(best_index_int8(v, -4.6), 7);
        assert_eq!(best_index_int8(v, 0.0), 8);
        assert_eq!(best_index_int8(v, f32::NAN), 15);
        for (i, &k) in v.iter().enumerate() {
            assert_eq!(best_index_int8(v, f32::from(k)), i);
        }
    }
}
