//! The K-quants Q2_K … Q6_K and their activation format Q8_K: 256-value super-blocks of 16- or
//! 32-value sub-blocks with quantized sub-block scales.
//!
//! Reference code reproduced from upstream `ggml/src/ggml-quants.c`:
//!
//! - quantizers: `quantize_row_q2_K_ref` … `quantize_row_q6_K_ref` and `quantize_row_q8_K_ref`,
//!   which is what `ggml_quantize_chunk` (and so `llama-quantize`) runs when there is no
//!   importance matrix (`quantize_q*_K` with `quant_weights == NULL`);
//! - their helpers `nearest_int`, `make_qx_quants` (Q6_K: `rmse_type = 1`, no weights),
//!   `make_q3_quants` (Q3_K: `do_rmse = true`), `make_qkx2_quants` (Q2_K, Q4_K, Q5_K) and
//!   `get_scale_min_k4`;
//! - the dequantizers `dequantize_row_q2_K` … `dequantize_row_q6_K`, `dequantize_row_q8_K`.
//!
//! The output is meant to be bit-identical to ggml's, so every f32 expression is evaluated in the
//! order the C source writes it (C evaluates `a*b*c` as `(a*b)*c` and `a + b - c` as
//! `(a + b) - c`; Rust does the same, and never contracts `a*b + c` into a fused multiply-add,
//! which matches ggml-base being built without FMA code generation). Integer-to-integer
//! conversions that C performs implicitly (`int` into `uint8_t`/`int8_t`, keeping the low byte)
//! are done with explicit wrapping helpers, so that even inputs outside the normal range (huge,
//! tiny, NaN-producing) give the bytes ggml gives. Reorganising an expression "harmlessly"
//! (hoisting a product, summing in another order) changes the last bit of scales and therefore
//! codes, so please keep the order when editing.

use crate::blocks::{
    BlockQ2K, BlockQ3K, BlockQ4K, BlockQ5K, BlockQ6K, BlockQ8K, F32Le, Half, QK_K,
};

/// `GROUP_MAX_EPS`: below this largest magnitude a group counts as all zero.
const GROUP_MAX_EPS: f32 = 1e-15;

/// ggml's `nearest_int`: adds 1.5·2²³ in f32 and reads the low 23 bits of the sum.
///
/// For |f| ≤ 2²² this is round-half-to-even (`f.round_ties_even()`); outside that range (and for
/// NaN) it wraps exactly as the C code does, which is why the bit trick is kept rather than
/// `round_ties_even`: the reference quantizers do reach such values on extreme inputs.
#[inline]
pub(crate) fn nearest_int(f: f32) -> i32 {
    let bits = (f + 12_582_912.0).to_bits() & 0x007f_ffff;
    bits.cast_signed() - 0x0040_0000
}

/// C's implicit conversion of an `int` to `uint8_t`: the low byte (value modulo 256).
#[inline]
fn low_u8(v: i32) -> u8 {
    v.to_le_bytes()[0]
}

/// C's implicit conversion of an `int` to `int8_t`: the low byte, reinterpreted as signed.
#[inline]
fn low_i8(v: i32) -> i8 {
    i8::from_le_bytes([v.to_le_bytes()[0]])
}

/// An `int` as `float`, as C converts it in mixed arithmetic. The values here are small (codes,
/// scales, loop counters), so the conversion is exact.
#[allow(
    clippy::cast_precision_loss,
    reason = "small integers (codes, scales, loop counters) are exact in f32"
)]
#[inline]
fn fl(v: i32) -> f32 {
    v as f32
}

/// `get_scale_min_k4`: the 6-bit scale and min of sub-block `j` (0..8) of a Q4_K / Q5_K block.
#[inline]
pub(crate) fn scale_min_k4(j: usize, q: &[u8; 12]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// The sixteen 6-bit Q3_K sub-block scales, unpacked and re-centred (`scale − 32`), in the order
/// `dequantize_row_q3_K` uses them: the low nibbles come from `scales[0..8]` (sub-blocks 0..8
/// the low nibble, 8..16 the high nibble), the two high bits of sub-block `j` from bits
/// `2·(j/4)` of `scales[8 + j%4]`.
#[inline]
pub(crate) fn q3_k_scales(s: &[u8; 12]) -> [i8; 16] {
    std::array::from_fn(|j| {
        let lo = if j < 8 { s[j] & 0xF } else { s[j - 8] >> 4 };
        let hi = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
        // (lo | hi << 4) is 0..=63, so the difference is −32..=31.
        low_i8(i32::from(lo | (hi << 4)) - 32)
    })
}

/// `make_qkx2_quants` (asymmetric, scale and min): a grid search over `nstep + 1` inverse
/// scales, each followed by a weighted least-squares fit of (scale, min); the try with the
/// strictly smallest weighted error (squared, or absolute with `use_mad`) wins.
///
/// Writes the codes (0..=`nmax`) to `l` and returns `(scale, the_min)` with `the_min = −min ≥ 0`.
#[allow(
    clippy::too_many_arguments,
    reason = "mirrors make_qkx2_quants' parameters one for one"
)]
fn make_qkx2_quants(
    nmax: i32,
    x: &[f32],
    weights: &[f32],
    l: &mut [u8],
    rmin: f32,
    rdelta: f32,
    nstep: i32,
    use_mad: bool,
) -> (f32, f32) {
    let n = x.len();
    debug_assert!(n <= 32 && weights.len() == n && l.len() == n);
    let mut laux = [0u8; 32];
    let mut min = x[0];
    let mut max = x[0];
    let mut sum_w = weights[0];
    let mut sum_x = sum_w * x[0];
    for i in 1..n {
        if x[i] < min {
            min = x[i];
        }
        if x[i] > max {
            max = x[i];
        }
        let w = weights[i];
        sum_w += w;
        sum_x += w * x[i];
    }
    if min > 0.0 {
        min = 0.0;
    }
    if max == min {
        l.fill(0);
        return (0.0, -min);
    }
    let error = |diff: f32| if use_mad { diff.abs() } else { diff * diff };
    let mut iscale = fl(nmax) / (max - min);
    let mut scale = 1.0 / iscale;
    let mut best_error = 0.0f32;
    for i in 0..n {
        let q = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
        l[i] = low_u8(q);
        let diff = scale * fl(q) + min - x[i];
        best_error += weights[i] * error(diff);
    }
    if nstep < 1 {
        return (scale, -min);
    }
    for is in 0..=nstep {
        iscale = (rmin + rdelta * fl(is) + fl(nmax)) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0.0f32, 0.0f32, 0.0f32);
        for i in 0..n {
            let q = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
            laux[i] = low_u8(q);
            let w = weights[i];
            let q = fl(q);
            sum_l += w * q;
            sum_l2 += w * q * q;
            sum_xl += w * q * x[i];
        }
        let det = sum_w * sum_l2 - sum_l * sum_l;
        if det > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let mut cur_error = 0.0f32;
            for i in 0..n {
                let diff = this_scale * f32::from(laux[i]) + this_min - x[i];
                cur_error += weights[i] * error(diff);
            }
            if cur_error < best_error {
                l.copy_from_slice(&laux[..n]);
                best_error = cur_error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    (scale, -min)
}

/// `make_qx_quants` with `rmse_type = 1` and no quantization weights (weights `x²`), the only
/// form the reference quantizers call (Q6_K, `nmax = 32`): symmetric codes in
/// `−nmax..nmax`, stored offset by `nmax`, and the best of 19 least-squares scales.
fn make_qx_quants(nmax: i32, x: &[f32], l: &mut [u8]) -> f32 {
    let (mut amax, mut max) = (0.0f32, 0.0f32);
    for &v in x {
        let ax = v.abs();
        if ax > amax {
            amax = ax;
            max = v;
        }
    }
    if amax < GROUP_MAX_EPS {
        l.fill(0);
        return 0.0;
    }
    // One pass at inverse scale `iscale`: (Σ w·x·l, Σ w·l²) with w = x², the codes clamped to
    // −nmax..nmax−1. Used for the first guess and for every try.
    let fit = |iscale: f32, mut store: Option<&mut [u8]>| {
        let (mut sumlx, mut suml2) = (0.0f32, 0.0f32);
        for (i, &v) in x.iter().enumerate() {
            let q = nearest_int(iscale * v).clamp(-nmax, nmax - 1);
            if let Some(l) = store.as_deref_mut() {
                l[i] = low_u8(q + nmax);
            }
            let w = v * v;
            let q = fl(q);
            sumlx += w * v * q;
            suml2 += w * q * q;
        }
        (sumlx, suml2)
    };
    let (sumlx, suml2) = fit(-fl(nmax) / max, Some(&mut *l));
    let mut scale = if suml2 == 0.0 { 0.0 } else { sumlx / suml2 };
    let mut best = scale * sumlx;
    for is in -9..=9 {
        if is == 0 {
            continue;
        }
        let iscale = -(fl(nmax) + 0.1 * fl(is)) / max;
        let (sumlx, suml2) = fit(iscale, None);
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            fit(iscale, Some(&mut *l));
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    scale
}

/// `make_q3_quants` with `do_rmse = true` (Q3_K, `nmax = 4`): a first guess from the largest
/// magnitude, then up to five rounds of coordinate descent on the weighted (w = x²)
/// least-squares objective. Codes are stored offset by `nmax` (0..2·nmax).
fn make_q3_quants(nmax: i32, x: &[f32], l: &mut [i8]) -> f32 {
    let (mut amax, mut max) = (0.0f32, 0.0f32);
    for &v in x {
        let ax = v.abs();
        if ax > amax {
            amax = ax;
            max = v;
        }
    }
    if amax < GROUP_MAX_EPS {
        l.fill(0);
        return 0.0;
    }
    let iscale = -fl(nmax) / max;
    let (mut sumlx, mut suml2) = (0.0f32, 0.0f32);
    for (li, &v) in l.iter_mut().zip(x) {
        let q = nearest_int(iscale * v).clamp(-nmax, nmax - 1);
        *li = low_i8(q);
        let w = v * v;
        let q = fl(q);
        sumlx += w * v * q;
        suml2 += w * q * q;
    }
    for _ in 0..5 {
        let mut n_changed = 0;
        for (li, &v) in l.iter_mut().zip(x) {
            let w = v * v;
            let old = f32::from(*li);
            let mut slx = sumlx - w * v * old;
            if slx > 0.0 {
                let mut sl2 = suml2 - w * old * old;
                let new_l = nearest_int(v * sl2 / slx).clamp(-nmax, nmax - 1);
                if new_l != i32::from(*li) {
                    let q = fl(new_l);
                    slx += w * v * q;
                    sl2 += w * q * q;
                    if sl2 > 0.0 && slx * slx * suml2 > sumlx * sumlx * sl2 {
                        *li = low_i8(new_l);
                        sumlx = slx;
                        suml2 = sl2;
                        n_changed += 1;
                    }
                }
            }
        }
        if n_changed == 0 {
            break;
        }
    }
    for li in l.iter_mut() {
        *li = low_i8(i32::from(*li) + nmax);
    }
    if suml2 > 0.0 { sumlx / suml2 } else { 0.0 }
}

/// Packs 2-bit codes (`quantize_row_q2_K_ref` / `q3_K` layout): byte `32h + l` of `qs` holds
/// elements `128h + l + 32s` in bits `2s..2s+2`.
fn pack_2bit(l: &[u8; QK_K], qs: &mut [u8; 64]) {
    for (qs, l) in qs.chunks_exact_mut(32).zip(l.chunks_exact(128)) {
        for (j, q) in qs.iter_mut().enumerate() {
            *q = l[j] | (l[j + 32] << 2) | (l[j + 64] << 4) | (l[j + 96] << 6);
        }
    }
}

/// Q2_K (`quantize_row_q2_K_ref`): per 16 values `make_qkx2_quants(nmax = 3, weights |x|,
/// rmin −0.5, rdelta 0.1, 15 steps, absolute error)`, 4-bit scale and min relative to the
/// super-block maxima, then every value re-quantized with the stored scales.
pub fn quantize_row_q2_k(x: &[f32], y: &mut [BlockQ2K]) {
    debug_assert_eq!(x.len(), y.len() * QK_K);
    const Q4SCALE: f32 = 15.0;
    for (x, b) in x.chunks_exact(QK_K).zip(y) {
        let mut l = [0u8; QK_K];
        let mut scales = [0f32; QK_K / 16];
        let mut mins = [0f32; QK_K / 16];
        let mut max_scale = 0.0f32;
        let mut max_min = 0.0f32;
        for j in 0..QK_K / 16 {
            let xs = &x[16 * j..16 * j + 16];
            let weights: [f32; 16] = std::array::from_fn(|i| xs[i].abs());
            let (scale, min) = make_qkx2_quants(
                3,
                xs,
                &weights,
                &mut l[16 * j..16 * j + 16],
                -0.5,
                0.1,
                15,
                true,
            );
            scales[j] = scale;
            mins[j] = min;
            if scale > max_scale {
                max_scale = scale;
            }
            if min > max_min {
                max_min = min;
            }
        }

        if max_scale > 0.0 {
            let iscale = Q4SCALE / max_scale;
            for (s, &scale) in b.scales.iter_mut().zip(&scales) {
                *s = low_u8(nearest_int(iscale * scale));
            }
            b.d = Half::from_f32(max_scale / Q4SCALE);
        } else {
            b.scales = [0; 16];
            b.d = Half::from_f32(0.0);
        }
        if max_min > 0.0 {
            let iscale = Q4SCALE / max_min;
            for (s, &min) in b.scales.iter_mut().zip(&mins) {
                *s |= low_u8(nearest_int(iscale * min) << 4);
            }
            b.dmin = Half::from_f32(max_min / Q4SCALE);
        } else {
            b.dmin = Half::from_f32(0.0);
        }

        // Re-quantize with the scales as stored (f16 super-scale times 4-bit sub-scale), so that
        // the codes fit what dequantization will compute. A sub-block whose stored scale is 0
        // keeps the codes of the search.
        for j in 0..QK_K / 16 {
            let d = b.d.to_f32() * f32::from(b.scales[j] & 0xF);
            if d == 0.0 {
                continue;
            }
            let dm = b.dmin.to_f32() * f32::from(b.scales[j] >> 4);
            for ii in 0..16 {
                let q = nearest_int((x[16 * j + ii] + dm) / d).clamp(0, 3);
                l[16 * j + ii] = low_u8(q);
            }
        }
        pack_2bit(&l, &mut b.qs);
    }
}

/// Q2_K dequantization (`dequantize_row_q2_K`): `y = d·sc·q − dmin·m`.
pub fn dequantize_row_q2_k(x: &[BlockQ2K], y: &mut [f32]) {
    debug_assert_eq!(y.len(), x.len() * QK_K);
    for (b, y) in x.iter().zip(y.chunks_exact_mut(QK_K)) {
        let d = b.d.to_f32();
        let min = b.dmin.to_f32();
        let mut out = y.iter_mut();
        let mut is = 0;
        for q in b.qs.chunks_exact(32) {
            for shift in [0, 2, 4, 6] {
                for half in [&q[..16], &q[16..]] {
                    let sc = b.scales[is];
                    is += 1;
                    let dl = d * f32::from(sc & 0xF);
                    let ml = min * f32::from(sc >> 4);
                    for (&qv, o) in half.iter().zip(out.by_ref()) {
                        *o = dl * f32::from((qv >> shift) & 3) - ml;
                    }
                }
            }
        }
    }
}

/// Q3_K (`quantize_row_q3_K_ref`): per 16 values `make_q3_quants(nmax = 4, rmse)`, 6-bit signed
/// sub-block scales relative to the scale of largest magnitude, then every value re-quantized
/// with the stored scales; the third bit of each code goes to `hmask`.
pub fn quantize_row_q3_k(x: &[f32], y: &mut [BlockQ3K]) {
    debug_assert_eq!(x.len(), y.len() * QK_K);
    for (x, b) in x.chunks_exact(QK_K).zip(y) {
        let mut l = [0i8; QK_K];
        let mut scales = [0f32; QK_K / 16];
        let mut max_scale = 0.0f32;
        let mut amax = 0.0f32;
        for j in 0..QK_K / 16 {
            scales[j] = make_q3_quants(4, &x[16 * j..16 * j + 16], &mut l[16 * j..16 * j + 16]);
            let scale = scales[j].abs();
            if scale > amax {
                amax = scale;
                max_scale = scales[j];
            }
        }

        b.scales = [0; 12];
        // C tests `if (max_scale)`: NaN counts as true, as it does for `!= 0.0`.
        if max_scale != 0.0 {
            let iscale = -32.0 / max_scale;
            for (j, &scale) in scales.iter().enumerate() {
                // `int8_t l = nearest_int(...)` first truncates to 8 bits, then clamps.
                let lv = i32::from(low_i8(nearest_int(iscale * scale))).clamp(-32, 31) + 32;
                if j < 8 {
                    b.scales[j] = low_u8(lv & 0xF);
                } else {
                    b.scales[j - 8] |= low_u8((lv & 0xF) << 4);
                }
                b.scales[j % 4 + 8] |= low_u8((lv >> 4) << (2 * (j / 4)));
            }
            b.d = Half::from_f32(1.0 / iscale);
        } else {
            b.d = Half::from_f32(0.0);
        }

        let sc = q3_k_scales(&b.scales);
        for j in 0..QK_K / 16 {
            let d = b.d.to_f32() * f32::from(sc[j]);
            if d == 0.0 {
                continue;
            }
            for ii in 0..16 {
                let q = nearest_int(x[16 * j + ii] / d).clamp(-4, 3);
                l[16 * j + ii] = low_i8(q + 4);
            }
        }

        // Codes are 0..8 here; the high bit of the code of element j goes to bit j / 32 of
        // hmask[j % 32].
        b.hmask = [0; 32];
        let mut low = [0u8; QK_K];
        for (j, (&lj, lo)) in l.iter().zip(low.iter_mut()).enumerate() {
            let code = low_u8(i32::from(lj));
            if code > 3 {
                b.hmask[j % 32] |= 1 << (j / 32);
                *lo = code - 4;
            } else {
                *lo = code;
            }
        }
        pack_2bit(&low, &mut b.qs);
    }
}

/// Q3_K dequantization (`dequantize_row_q3_K`): `y = d·(sc − 32)·(q − (hbit ? 0 : 4))`.
pub fn dequantize_row_q3_k(x: &[BlockQ3K], y: &mut [f32]) {
    debug_assert_eq!(y.len(), x.len() * QK_K);
    for (b, y) in x.iter().zip(y.chunks_exact_mut(QK_K)) {
        let d_all = b.d.to_f32();
        let scales = q3_k_scales(&b.scales);
        let mut out = y.iter_mut();
        let mut is = 0;
        let mut m = 1u8;
        for q in b.qs.chunks_exact(32) {
            for shift in [0, 2, 4, 6] {
                for off in [0, 16] {
                    let dl = d_all * f32::from(scales[is]);
                    is += 1;
                    for ((&qv, &hm), o) in q[off..off + 16]
                        .iter()
                        .zip(&b.hmask[off..off + 16])
                        .zip(out.by_ref())
                    {
                        let sub = if hm & m == 0 { 4 } else { 0 };
                        *o = dl * f32::from(low_i8(i32::from((qv >> shift) & 3)) - sub);
                    }
                }
                m <<= 1;
            }
        }
    }
}

/// The shared search of Q4_K and Q5_K (`quantize_row_q4_K_ref`, `quantize_row_q5_K_ref`): per
/// 32 values, weights `sqrt(Σx²/32) + |x|` and `make_qkx2_quants`; 6-bit scales and mins
/// relative to the super-block maxima packed as `get_scale_min_k4` reads them; then every value
/// re-quantized with the stored scales. Returns the codes (0..=`nmax`).
fn quantize_q45_k(
    x: &[f32],
    nmax: i32,
    rmin: f32,
    nstep: i32,
    d_out: &mut Half,
    dmin_out: &mut Half,
    scales_out: &mut [u8; 12],
) -> [u8; QK_K] {
    let mut l = [0u8; QK_K];
    let mut scales = [0f32; QK_K / 32];
    let mut mins = [0f32; QK_K / 32];
    let mut max_scale = 0.0f32;
    let mut max_min = 0.0f32;
    for j in 0..QK_K / 32 {
        let xs = &x[32 * j..32 * j + 32];
        let mut sum_x2 = 0.0f32;
        for &v in xs {
            sum_x2 += v * v;
        }
        let av_x = (sum_x2 / 32.0).sqrt();
        let weights: [f32; 32] = std::array::from_fn(|i| av_x + xs[i].abs());
        let (scale, min) = make_qkx2_quants(
            nmax,
            xs,
            &weights,
            &mut l[32 * j..32 * j + 32],
            rmin,
            0.1,
            nstep,
            false,
        );
        scales[j] = scale;
        mins[j] = min;
        if scale > max_scale {
            max_scale = scale;
        }
        if min > max_min {
            max_min = min;
        }
    }

    let inv_scale = if max_scale > 0.0 {
        63.0 / max_scale
    } else {
        0.0
    };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    for j in 0..QK_K / 32 {
        // `uint8_t ls = nearest_int(...)` keeps the low byte before the clamp to 63.
        let ls = low_u8(nearest_int(inv_scale * scales[j])).min(63);
        let lm = low_u8(nearest_int(inv_min * mins[j])).min(63);
        if j < 4 {
            scales_out[j] = ls;
            scales_out[j + 4] = lm;
        } else {
            scales_out[j + 4] = (ls & 0xF) | ((lm & 0xF) << 4);
            scales_out[j - 4] |= (ls >> 4) << 6;
            scales_out[j] |= (lm >> 4) << 6;
        }
    }
    *d_out = Half::from_f32(max_scale / 63.0);
    *dmin_out = Half::from_f32(max_min / 63.0);

    for j in 0..QK_K / 32 {
        let (sc, m) = scale_min_k4(j, scales_out);
        let d = d_out.to_f32() * f32::from(sc);
        if d == 0.0 {
            continue;
        }
        let dm = dmin_out.to_f32() * f32::from(m);
        for ii in 0..32 {
            let q = nearest_int((x[32 * j + ii] + dm) / d).clamp(0, nmax);
            l[32 * j + ii] = low_u8(q);
        }
    }
    l
}

/// Q4_K (`quantize_row_q4_K_ref`): `make_qkx2_quants(nmax = 15, rmin −1, rdelta 0.1, 20 steps)`
/// per 32 values; see [`dequantize_row_q4_k`] for the layout.
pub fn quantize_row_q4_k(x: &[f32], y: &mut [BlockQ4K]) {
    debug_assert_eq!(x.len(), y.len() * QK_K);
    for (x, b) in x.chunks_exact(QK_K).zip(y) {
        let mut scales = [0u8; 12];
        let l = quantize_q45_k(x, 15, -1.0, 20, &mut b.d, &mut b.dmin, &mut scales);
        b.scales = scales;
        for (q, l) in b.qs.chunks_exact_mut(32).zip(l.chunks_exact(64)) {
            for (j, qv) in q.iter_mut().enumerate() {
                *qv = l[j] | (l[j + 32] << 4);
            }
        }
    }
}

/// Q4_K dequantization (`dequantize_row_q4_K`): chunk c of 32 bytes holds sub-block 2c in the
/// low nibbles and 2c+1 in the high nibbles; `y = d·sc·q − dmin·m`.
pub fn dequantize_row_q4_k(x: &[BlockQ4K], y: &mut [f32]) {
    debug_assert_eq!(y.len(), x.len() * QK_K);
    for (b, y) in x.iter().zip(y.chunks_exact_mut(QK_K)) {
        let d = b.d.to_f32();
        let min = b.dmin.to_f32();
        for (c, (q, y)) in
            b.qs.chunks_exact(32)
                .zip(y.chunks_exact_mut(64))
                .enumerate()
        {
            let (sc, m) = scale_min_k4(2 * c, &b.scales);
            let (d1, m1) = (d * f32::from(sc), min * f32::from(m));
            let (sc, m) = scale_min_k4(2 * c + 1, &b.scales);
            let (d2, m2) = (d * f32::from(sc), min * f32::from(m));
            let (lo, hi) = y.split_at_mut(32);
            for ((&qv, lo), hi) in q.iter().zip(lo).zip(hi) {
                *lo = d1 * f32::from(qv & 0xF) - m1;
                *hi = d2 * f32::from(qv >> 4) - m2;
            }
        }
    }
}

/// Q5_K (`quantize_row_q5_K_ref`): as Q4_K with `nmax = 31, rmin −0.5, 15 steps`; the fifth bit
/// of element `64c + l` is bit 2c of `qh[l]`, of element `64c + 32 + l` bit 2c+1.
pub fn quantize_row_q5_k(x: &[f32], y: &mut [BlockQ5K]) {
    debug_assert_eq!(x.len(), y.len() * QK_K);
    for (x, b) in x.chunks_exact(QK_K).zip(y) {
        let mut scales = [0u8; 12];
        let l = quantize_q45_k(x, 31, -0.5, 15, &mut b.d, &mut b.dmin, &mut scales);
        b.scales = scales;
        b.qh = [0; 32];
        for (c, (ql, l)) in
            b.qs.chunks_exact_mut(32)
                .zip(l.chunks_exact(64))
                .enumerate()
        {
            let (m1, m2) = (1u8 << (2 * c), 2u8 << (2 * c));
            for (j, q) in ql.iter_mut().enumerate() {
                let mut l1 = l[j];
                if l1 > 15 {
                    l1 -= 16;
                    b.qh[j] |= m1;
                }
                let mut l2 = l[j + 32];
                if l2 > 15 {
                    l2 -= 16;
                    b.qh[j] |= m2;
                }
                *q = l1 | (l2 << 4);
            }
        }
    }
}

/// Q5_K dequantization (`dequantize_row_q5_K`): `y = d·sc·(q + 16·hbit) − dmin·m`.
pub fn dequantize_row_q5_k(x: &[BlockQ5K], y: &mut [f32]) {
    debug_assert_eq!(y.len(), x.len() * QK_K);
    for (b, y) in x.iter().zip(y.chunks_exact_mut(QK_K)) {
        let d = b.d.to_f32();
        let min = b.dmin.to_f32();
        for (c, (ql, y)) in
            b.qs.chunks_exact(32)
                .zip(y.chunks_exact_mut(64))
                .enumerate()
        {
            let (u1, u2) = (1u8 << (2 * c), 2u8 << (2 * c));
            let (sc, m) = scale_min_k4(2 * c, &b.scales);
            let (d1, m1) = (d * f32::from(sc), min * f32::from(m));
            let (sc, m) = scale_min_k4(2 * c + 1, &b.scales);
            let (d2, m2) = (d * f32::from(sc), min * f32::from(m));
            let (lo, hi) = y.split_at_mut(32);
            for (((&qv, &qh), lo), hi) in ql.iter().zip(&b.qh).zip(lo).zip(hi) {
                let h1 = if qh & u1 == 0 { 0 } else { 16 };
                let h2 = if qh & u2 == 0 { 0 } else { 16 };
                *lo = d1 * f32::from((qv & 0xF) + h1) - m1;
                *hi = d2 * f32::from((qv >> 4) + h2) - m2;
            }
        }
    }
}

/// Q6_K (`quantize_row_q6_K_ref`): per 16 values `make_qx_quants(nmax = 32, rmse_type = 1)`,
/// signed 8-bit sub-block scales relative to the scale of largest magnitude (mapped to −128),
/// then every value re-quantized with the stored scales.
pub fn quantize_row_q6_k(x: &[f32], y: &mut [BlockQ6K]) {
    debug_assert_eq!(x.len(), y.len() * QK_K);
    for (x, b) in x.chunks_exact(QK_K).zip(y) {
        let mut l = [0u8; QK_K];
        let mut scales = [0f32; QK_K / 16];
        let mut max_scale = 0.0f32;
        let mut max_abs_scale = 0.0f32;
        for ib in 0..QK_K / 16 {
            let scale =
                make_qx_quants(32, &x[16 * ib..16 * ib + 16], &mut l[16 * ib..16 * ib + 16]);
            scales[ib] = scale;
            let abs_scale = scale.abs();
            if abs_scale > max_abs_scale {
                max_abs_scale = abs_scale;
                max_scale = scale;
            }
        }

        if max_abs_scale < GROUP_MAX_EPS {
            *b = bytemuck::Zeroable::zeroed();
            b.d = Half::from_f32(0.0);
            continue;
        }

        let iscale = -128.0 / max_scale;
        b.d = Half::from_f32(1.0 / iscale);
        for (s, &scale) in b.scales.iter_mut().zip(&scales) {
            *s = low_i8(nearest_int(iscale * scale).min(127));
        }

        for j in 0..QK_K / 16 {
            let d = b.d.to_f32() * f32::from(b.scales[j]);
            if d == 0.0 {
                continue;
            }
            for ii in 0..16 {
                let q = nearest_int(x[16 * j + ii] / d).clamp(-32, 31);
                l[16 * j + ii] = low_u8(q + 32);
            }
        }

        for ((ql, qh), l) in
            b.ql.chunks_exact_mut(64)
                .zip(b.qh.chunks_exact_mut(32))
                .zip(l.chunks_exact(128))
        {
            for j in 0..32 {
                let (q1, q2, q3, q4) = (l[j], l[j + 32], l[j + 64], l[j + 96]);
                ql[j] = (q1 & 0xF) | ((q3 & 0xF) << 4);
                ql[j + 32] = (q2 & 0xF) | ((q4 & 0xF) << 4);
                qh[j] = (q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6);
            }
        }
    }
}

/// Q6_K dequantization (`dequantize_row_q6_K`): `y = d·scale·(q − 32)`, evaluated as
/// `(d·scale)·(q − 32)` like the C.
pub fn dequantize_row_q6_k(x: &[BlockQ6K], y: &mut [f32]) {
    debug_assert_eq!(y.len(), x.len() * QK_K);
    for (b, y) in x.iter().zip(y.chunks_exact_mut(QK_K)) {
        let d = b.d.to_f32();
        for (((ql, qh), sc), y) in
            b.ql.chunks_exact(64)
                .zip(b.qh.chunks_exact(32))
                .zip(b.scales.chunks_exact(8))
                .zip(y.chunks_exact_mut(128))
        {
            for l in 0..32 {
                let is = l / 16;
                let q1 = i16::from((ql[l] & 0xF) | (qh[l] & 3) << 4) - 32;
                let q2 = i16::from((ql[l + 32] & 0xF) | ((qh[l] >> 2) & 3) << 4) - 32;
                let q3 = i16::from((ql[l] >> 4) | ((qh[l] >> 4) & 3) << 4) - 32;
                let q4 = i16::from((ql[l + 32] >> 4) | ((qh[l] >> 6) & 3) << 4) - 32;
                y[l] = d * f32::from(sc[is]) * f32::from(q1);
                y[l + 32] = d * f32::from(sc[is + 2]) * f32::from(q2);
                y[l + 64] = d * f32::from(sc[is + 4]) * f32::from(q3);
                y[l + 96] = d * f32::from(sc[is + 6]) * f32::from(q4);
            }
        }
    }
}

/// Q8_K (`quantize_row_q8_K_ref`): `d = max / −127` with `max` the signed element of largest
/// magnitude (first one wins), codes `min(127, nearest_int(−127/max · x))`, and the sums of
/// each 16 codes in `bsums` (i16, little-endian); `d` stays f32.
///
/// For an all-zero block ggml writes `d = 0` and zero codes but leaves `bsums` as they were;
/// this function writes zero sums there (what they are), so the whole block is defined.
pub fn quantize_row_q8_k(x: &[f32], y: &mut [BlockQ8K]) {
    debug_assert_eq!(x.len(), y.len() * QK_K);
    for (x, b) in x.chunks_exact(QK_K).zip(y) {
        let (mut amax, mut max) = (0.0f32, 0.0f32);
        for &v in x {
            let ax = v.abs();
            if ax > amax {
                amax = ax;
                max = v;
            }
        }
        if amax == 0.0 {
            b.d = F32Le::new(0.0);
            b.qs = [0; QK_K];
            b.bsums = [[0; 2]; 16];
            continue;
        }
        // −127, not −128: the AVX IQ2_XXS dot product relies on codes staying in ±127.
        let iscale = -127.0 / max;
        for (q, &v) in b.qs.iter_mut().zip(x) {
            *q = low_i8(nearest_int(iscale * v).min(127));
        }
        for (s, q) in b.bsums.iter_mut().zip(b.qs.chunks_exact(16)) {
            let sum: i32 = q.iter().map(|&v| i32::from(v)).sum();
            // |sum| ≤ 16·128, so the C conversion to int16_t keeps the value.
            let [lo, hi, ..] = sum.to_le_bytes();
            *s = [lo, hi];
        }
        b.d = F32Le::new(1.0 / iscale);
    }
}

/// Q8_K dequantization (`dequantize_row_q8_K`): `y = d·q`.
pub fn dequantize_row_q8_k(x: &[BlockQ8K], y: &mut [f32]) {
    debug_assert_eq!(y.len(), x.len() * QK_K);
    for (b, y) in x.iter().zip(y.chunks_exact_mut(QK_K)) {
        let d = b.d.get();
        for (o, &q) in y.iter_mut().zip(&b.qs) {
            *o = d * f32::from(q);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_int_is_ties_to_even_in_range() {
        let cases = [
            0.5f32,
            1.5,
            2.5,
            -0.5,
            -1.5,
            -2.5,
            0.49999997,
            -0.49999997,
            3.0,
            -7.25,
            4_194_303.0,
            -4_194_303.0,
            4_194_302.5,
            0.0,
            -0.0,
            1e-30,
            -1e-30,
        ];
        for f in cases {
            #[allow(clippy::cast_possible_truncation, reason = "|f| ≤ 2^22")]
            let expected = f.round_ties_even() as i32;
            assert_eq!(nearest_int(f), expected, "{f}");
        }
        let mut f = -5000.0f32;
        while f < 5000.0 {
            #[allow(clippy::cast_possible_truncation, reason = "|f| ≤ 5000")]
            let expected = f.round_ties_even() as i32;
            assert_eq!(nearest_int(f), expected, "{f}");
            f += 0.125;
        }
    }

    #[test]
    fn nearest_int_wraps_like_ggml_out_of_range() {
        // 2^23 + 1.5·2^23 = 1.25·2^24: mantissa bits 0x200000, so 0x200000 − 0x400000 = −2^21
        // (round_ties_even would give 2^23).
        assert_eq!(nearest_int(8_388_608.0), -2_097_152);
        // NaN: a quiet NaN's mantissa is 0x400000 → 0.
        assert_eq!(nearest_int(f32::NAN), 0);
    }

    #[test]
    fn q3_k_scales_unpack_like_the_aux_trick() {
        // dequantize_row_q3_K rebuilds the scales through four u32 masks; check the per-index
        // formula against it on all-ones-in-one-place patterns.
        for bit in 0..96 {
            let mut s = [0u8; 12];
            s[bit / 8] = 1 << (bit % 8);
            let mut aux = [
                u32::from_le_bytes([s[0], s[1], s[2], s[3]]),
                u32::from_le_bytes([s[4], s[5], s[6], s[7]]),
                u32::from_le_bytes([s[8], s[9], s[10], s[11]]),
                0,
            ];
            let (kmask1, kmask2) = (0x0303_0303u32, 0x0f0f_0f0fu32);
            let tmp = aux[2];
            aux[2] = ((aux[0] >> 4) & kmask2) | (((tmp >> 4) & kmask1) << 4);
            aux[3] = ((aux[1] >> 4) & kmask2) | (((tmp >> 6) & kmask1) << 4);
            aux[0] = (aux[0] & kmask2) | ((tmp & kmask1) << 4);
            aux[1] = (aux[1] & kmask2) | (((tmp >> 2) & kmask1) << 4);
            let bytes: Vec<u8> = aux.iter().flat_map(|w| w.to_le_bytes()).collect();
            let got = q3_k_scales(&s);
            for j in 0..16 {
                assert_eq!(
                    i32::from(got[j]),
                    i32::from(bytes[j]) - 32,
                    "bit {bit}, j {j}"
                );
            }
        }
    }
}
