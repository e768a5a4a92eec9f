//! The 32-value "legacy" formats: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and the activation format Q8_1.
//!
//! Reference quantizers and dequantizers of `ggml/src/ggml-quants.c` (`quantize_row_*_ref`,
//! `dequantize_row_*`), reproduced operation for operation: the same f32 expressions in the
//! same order, `roundf` (ties away from zero, Rust's `f32::round`) for Q8, and the C
//! truncating casts `(int8_t)(x + 8.5f)` (Rust's saturating `as`, identical inside the range
//! these values can take) for Q4/Q5.

use crate::blocks::{BlockQ4_0, BlockQ4_1, BlockQ5_0, BlockQ5_1, BlockQ8_0, BlockQ8_1, Half, QK};

/// C's `(int8_t)f` for the values these quantizers produce (|f| ≤ 32.5, or NaN → 0).
#[allow(
    clippy::cast_possible_truncation,
    reason = "C's truncating float-to-int8 cast; inputs are within ±32.5 by construction"
)]
#[inline]
fn trunc_i8(f: f32) -> i8 {
    f as i8
}

/// `roundf` then the conversion to `int8_t` (|f| ≤ 127 by construction).
#[allow(
    clippy::cast_possible_truncation,
    reason = "roundf of a value within ±127 by construction"
)]
#[inline]
fn round_i8(f: f32) -> i8 {
    f.round() as i8
}

/// Low/high nibble into a byte; inputs are 0..=15 (or 0..=31 masked by the caller).
#[allow(clippy::cast_sign_loss, reason = "quantized codes are non-negative")]
#[inline]
fn code(v: i8) -> u8 {
    v as u8
}

/// The element of largest magnitude, with its sign; the first one wins ties (`amax < |v|`).
#[inline]
fn signed_absmax(x: &[f32]) -> f32 {
    let (mut amax, mut max) = (0.0f32, 0.0f32);
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    max
}

/// `min` and `max` as the C loop computes them (starting from ±FLT_MAX).
#[inline]
fn min_max(x: &[f32]) -> (f32, f32) {
    let (mut min, mut max) = (f32::MAX, -f32::MAX);
    for &v in x {
        if v < min {
            min = v;
        }
        if v > max {
            max = v;
        }
    }
    (min, max)
}

#[inline]
fn inverse(d: f32) -> f32 {
    if d == 0.0 { 0.0 } else { 1.0 / d }
}

/// Q4_0: `d = max / −8`, codes `min(15, trunc(x/d + 8.5))`.
pub fn quantize_row_q4_0(x: &[f32], y: &mut [BlockQ4_0]) {
    debug_assert_eq!(x.len(), y.len() * QK);
    for (x, b) in x.chunks_exact(QK).zip(y) {
        let d = signed_absmax(x) / -8.0;
        let id = inverse(d);
        b.d = Half::from_f32(d);
        for j in 0..QK / 2 {
            let x0 = trunc_i8(x[j] * id + 8.5).min(15);
            let x1 = trunc_i8(x[QK / 2 + j] * id + 8.5).min(15);
            b.qs[j] = code(x0) | (code(x1) << 4);
        }
    }
}

/// `y = (q − 8) · d`.
pub fn dequantize_row_q4_0(x: &[BlockQ4_0], y: &mut [f32]) {
    debug_assert_eq!(y.len(), x.len() * QK);
    for (b, y) in x.iter().zip(y.chunks_exact_mut(QK)) {
        let d = b.d.to_f32();
        for j in 0..QK / 2 {
            y[j] = f32::from(i16::from(b.qs[j] & 0x0f) - 8) * d;
            y[j + QK / 2] = f32::from(i16::from(b.qs[j] >> 4) - 8) * d;
        }
    }
}

/// Q4_1: `d = (max − min)/15`, `m = min`, codes `min(15, trunc((x − min)/d + 0.5))`.
pub fn quantize_row_q4_1(x: &[f32], y: &mut [BlockQ4_1]) {
    debug_assert_eq!(x.len(), y.len() * QK);
    for (x, b) in x.chunks_exact(QK).zip(y) {
        let (min, max) = min_max(x);
        let d = (max - min) / 15.0;
        let id = inverse(d);
        b.d = Half::from_f32(d);
        b.m = Half::from_f32(min);
        for j in 0..QK / 2 {
            let x0 = trunc_i8((x[j] - min) * id + 0.5).min(15);
            let x1 = trunc_i8((x[QK / 2 + j] - min) * id + 0.5).min(15);
            b.qs[j] = code(x0) | (code(x1) << 4);
        }
    }
}

/// `y = q · d + m`.
pub fn dequantize_row_q4_1(x: &[BlockQ4_1], y: &mut [f32]) {
    debug_assert_eq!(y.len(), x.len() * QK);
    for (b, y) in x.iter().zip(y.chunks_exact_mut(QK)) {
        let (d, m) = (b.d.to_f32(), b.m.to_f32());
        for j in 0..QK / 2 {
            y[j] = f32::from(b.qs[j] & 0x0f) * d + m;
            y[j + QK / 2] = f32::from(b.qs[j] >> 4) * d + m;
        }
    }
}

/// Q5_0: `d = max / −16`, codes `min(31, trunc(x/d + 16.5))`, fifth bits in `qh`.
pub fn quantize_row_q5_0(x: &[f32], y: &mut [BlockQ5_0]) {
    debug_assert_eq!(x.len(), y.len() * QK);
    for (x, b) in x.chunks_exact(QK).zip(y) {
        let d = signed_absmax(x) / -16.0;
        let id = inverse(d);
        b.d = Half::from_f32(d);
        let mut qh = 0u32;
        for j in 0..QK / 2 {
            let x0 = code(trunc_i8(x[j] * id + 16.5).min(31));
            let x1 = code(trunc_i8(x[QK / 2 + j] * id + 16.5).min(31));
            b.qs[j] = (x0 & 0x0f) | ((x1 & 0x0f) << 4);
            qh |= u32::from((x0 & 0x10) >> 4) << j;
            qh |= u32::from((x1 & 0x10) >> 4) << (j + QK / 2);
        }
        b.qh = qh.to_le_bytes();
    }
}

/// The two 5-bit codes of position `j` (elements `j` and `j + 16`).
#[inline]
fn q5_codes(qs: &[u8; 16], qh: [u8; 4], j: usize) -> (u8, u8) {
    let qh = u32::from_le_bytes(qh);
    let h0 = u8::from((qh >> j) & 1 == 1) << 4;
    let h1 = u8::from((qh >> (j + 16)) & 1 == 1) << 4;
    ((qs[j] & 0x0f) | h0, (qs[j] >> 4) | h1)
}

/// `y = (q − 16) · d`.
pub fn dequantize_row_q5_0(x: &[BlockQ5_0], y: &mut [f32]) {
    debug_assert_eq!(y.len(), x.len() * QK);
    for (b, y) in x.iter().zip(y.chunks_exact_mut(QK)) {
        let d = b.d.to_f32();
        for j in 0..QK / 2 {
            let (c0, c1) = q5_codes(&b.qs, b.qh, j);
            y[j] = f32::from(i16::from(c0) - 16) * d;
            y[j + QK / 2] = f32::from(i16::from(c1) - 16) * d;
        }
    }
}

/// Q5_1: `d = (max − min)/31`, `m = min`, codes `trunc((x − min)/d + 0.5)` (no clamp in ggml).
pub fn quantize_row_q5_1(x: &[f32], y: &mut [BlockQ5_1]) {
    debug_assert_eq!(x.len(), y.len() * QK);
    for (x, b) in x.chunks_exact(QK).zip(y) {
        let (min, max) = min_max(x);
        let d = (max - min) / 31.0;
        let id = inverse(d);
        b.d = Half::from_f32(d);
        b.m = Half::from_f32(min);
        let mut qh = 0u32;
        for j in 0..QK / 2 {
            let x0 = code(trunc_i8((x[j] - min) * id + 0.5));
            let x1 = code(trunc_i8((x[QK / 2 + j] - min) * id + 0.5));
            b.qs[j] = (x0 & 0x0f) | ((x1 & 0x0f) << 4);
            qh |= u32::from((x0 & 0x10) >> 4) << j;
            qh |= u32::from((x1 & 0x10) >> 4) << (j + QK / 2);
        }
        b.qh = qh.to_le_bytes();
    }
}

/// `y = q · d + m`.
pub fn dequantize_row_q5_1(x: &[BlockQ5_1], y: &mut [f32]) {
    debug_assert_eq!(y.len(), x.len() * QK);
    for (b, y) in x.iter().zip(y.chunks_exact_mut(QK)) {
        let (d, m) = (b.d.to_f32(), b.m.to_f32());
        for j in 0..QK / 2 {
            let (c0, c1) = q5_codes(&b.qs, b.qh, j);
            y[j] = f32::from(c0) * d + m;
            y[j + QK / 2] = f32::from(c1) * d + m;
        }
    }
}

#[inline]
fn absmax(x: &[f32]) -> f32 {
    x.iter().fold(0.0f32, |m, v| m.max(v.abs()))
}

/// Q8_0: `d = amax/127`, codes `roundf(x/d)` (computed with the f32 `d`, stored as f16).
/// On x86 CPUs with AVX2 the blocks are quantized eight values at a time by operations that
/// give the same bits (`q8_x86`).
pub fn quantize_row_q8_0(x: &[f32], y: &mut [BlockQ8_0]) {
    debug_assert_eq!(x.len(), y.len() * QK);
    #[cfg(target_arch = "x86_64")]
    if q8_x86::available() {
        for (x, b) in x.chunks_exact(QK).zip(y) {
            let (d, qs, _) = q8_x86::block(x);
            b.d = Half::from_f32(d);
            b.qs = qs;
        }
        return;
    }
    quantize_row_q8_0_scalar(x, y);
}

/// [`quantize_row_q8_0`] in scalar code: the reference.
pub fn quantize_row_q8_0_scalar(x: &[f32], y: &mut [BlockQ8_0]) {
    debug_assert_eq!(x.len(), y.len() * QK);
    for (x, b) in x.chunks_exact(QK).zip(y) {
        let d = absmax(x) / 127.0;
        let id = inverse(d);
        b.d = Half::from_f32(d);
        for (q, &v) in b.qs.iter_mut().zip(x) {
            *q = round_i8(v * id);
        }
    }
}

/// `y = q · d`.
pub fn dequantize_row_q8_0(x: &[BlockQ8_0], y: &mut [f32]) {
    debug_assert_eq!(y.len(), x.len() * QK);
    for (b, y) in x.iter().zip(y.chunks_exact_mut(QK)) {
        let d = b.d.to_f32();
        for (o, &q) in y.iter_mut().zip(&b.qs) {
            *o = f32::from(q) * d;
        }
    }
}

/// Q8_1: Q8_0 plus `s = fp16(Σq · d)` (on AVX2 CPUs eight values at a time, as
/// [`quantize_row_q8_0`]).
pub fn quantize_row_q8_1(x: &[f32], y: &mut [BlockQ8_1]) {
    debug_assert_eq!(x.len(), y.len() * QK);
    #[cfg(target_arch = "x86_64")]
    if q8_x86::available() {
        for (x, b) in x.chunks_exact(QK).zip(y) {
            let (d, qs, sum) = q8_x86::block(x);
            b.d = Half::from_f32(d);
            b.qs = qs;
            #[allow(clippy::cast_precision_loss, reason = "|sum| <= 4064 is exact in f32")]
            let s = sum as f32 * d;
            b.s = Half::from_f32(s);
        }
        return;
    }
    quantize_row_q8_1_scalar(x, y);
}

/// [`quantize_row_q8_1`] in scalar code: the reference.
pub fn quantize_row_q8_1_scalar(x: &[f32], y: &mut [BlockQ8_1]) {
    debug_assert_eq!(x.len(), y.len() * QK);
    for (x, b) in x.chunks_exact(QK).zip(y) {
        let d = absmax(x) / 127.0;
        let id = inverse(d);
        b.d = Half::from_f32(d);
        let mut sum = 0i32;
        for (q, &v) in b.qs.iter_mut().zip(x) {
            *q = round_i8(v * id);
            sum += i32::from(*q);
        }
        // |sum| ≤ 32 · 127, exact in f32.
        #[allow(clippy::cast_precision_loss, reason = "|sum| <= 4064 is exact in f32")]
        let s = sum as f32 * d;
        b.s = Half::from_f32(s);
    }
}

/// `y = q · d` (the stored sum is not needed to dequantize).
pub fn dequantize_row_q8_1(x: &[BlockQ8_1], y: &mut [f32]) {
    debug_assert_eq!(y.len(), x.len() * QK);
    for (b, y) in x.iter().zip(y.chunks_exact_mut(QK)) {
        let d = b.d.to_f32();
        for (o, &q) in y.iter_mut().zip(&b.qs) {
            *o = f32::from(q) * d;
        }
    }
}

/// Q8_0 / Q8_1 blocks on AVX2: `d = amax/127` and `id = 1/d` as the scalar code computes
/// them, `v = x·id` eight at a time (the same products), and `roundf(v)` — half away from
/// zero — as `t = trunc(v)`, plus `±1` where `|v − t| ≥ 0.5` (`v − t` is exact below 2^23),
/// then clamped as Rust's `as i8` clamps (NaN to 0), so every code has the scalar bits.
#[cfg(target_arch = "x86_64")]
mod q8_x86 {
    use std::arch::x86_64::*;

    use super::{QK, absmax, inverse};

    /// Whether this CPU has AVX2 (checked once by the standard library, then cached).
    pub(super) fn available() -> bool {
        is_x86_feature_detected!("avx2")
    }

    /// One block of 32 values: its scale `d`, its codes and their sum.
    pub(super) fn block(x: &[f32]) -> (f32, [i8; QK], i32) {
        assert!(
            x.len() == QK && available(),
            "q8 block: 32 values on an AVX2 CPU"
        );
        let d = absmax(x) / 127.0;
        let id = inverse(d);
        // SAFETY: the CPU has AVX2 and `x` holds 32 values (checked above).
        let (qs, sum) = unsafe { codes(x.as_ptr(), id) };
        (d, qs, sum)
    }

    /// `roundf(x[i] · id)` for 32 values, and their sum.
    ///
    /// # Safety
    /// AVX2; 32 values at `x`.
    #[target_feature(enable = "avx2")]
    unsafe fn codes(x: *const f32, id: f32) -> ([i8; QK], i32) {
        // SAFETY: the caller's features and 32 values at x.
        unsafe {
            let idv = _mm256_set1_ps(id);
            let half = _mm256_set1_ps(0.5);
            let one = _mm256_set1_ps(1.0);
            let sign = _mm256_set1_ps(-0.0);
            let (lo, hi) = (_mm256_set1_ps(-128.0), _mm256_set1_ps(127.0));
            let mut q = [_mm256_setzero_si256(); 4];
            let mut sum = _mm256_setzero_si256();
            for (i, q) in q.iter_mut().enumerate() {
                let v = _mm256_mul_ps(_mm256_loadu_ps(x.add(8 * i)), idv);
                let t = _mm256_round_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(v);
                let frac = _mm256_andnot_ps(sign, _mm256_sub_ps(v, t));
                let up = _mm256_and_ps(_mm256_cmp_ps::<_CMP_GE_OQ>(frac, half), one);
                let r = _mm256_add_ps(t, _mm256_or_ps(up, _mm256_and_ps(v, sign)));
                // Rust's `as i8` for what no finite block gives: NaN → 0, saturation.
                let r = _mm256_and_ps(r, _mm256_cmp_ps::<_CMP_ORD_Q>(r, r));
                let r = _mm256_min_ps(_mm256_max_ps(r, lo), hi);
                *q = _mm256_cvttps_epi32(r);
                sum = _mm256_add_epi32(sum, *q);
            }
            // i32 → i16 → i8 (no value saturates: |code| ≤ 127), then the lanes put back in
            // order (the packs work per 128-bit lane).
            let w01 = _mm256_packs_epi32(q[0], q[1]);
            let w23 = _mm256_packs_epi32(q[2], q[3]);
            let b = _mm256_packs_epi16(w01, w23);
            let b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            let mut out = [0i8; QK];
            _mm256_storeu_si256(out.as_mut_ptr().cast(), b);
            let s = _mm_add_epi32(
                _mm256_castsi256_si128(sum),
                _mm256_extracti128_si256::<1>(sum),
            );
            let s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
            let s = _mm_add_epi32(s, _mm_shuffle_epi32::<1>(s));
            (out, _mm_cvtsi128_si32(s))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The AVX2 Q8_0 / Q8_1 quantizers give the scalar reference's bytes: ties at ±k.5,
    /// values whose product lands just below or above a tie, zeros, the largest magnitudes,
    /// subnormals and random rows.
    #[test]
    fn simd_q8_quantizers_are_the_scalar_reference() {
        let mut rows: Vec<Vec<f32>> = Vec::new();
        // Ties: with amax 127 the scale is 1 and every x is its own product.
        rows.push(
            (0..32)
                .map(|i| f32::from(i16::try_from(i).unwrap()) - 15.5)
                .collect(),
        );
        let mut r: Vec<f32> = (0..32)
            .map(|i| 0.5 * f32::from(u8::try_from(i).unwrap()))
            .collect();
        r[0] = 127.0;
        rows.push(r.iter().map(|v| -v).collect());
        rows.push(r);
        // Just below and above the ties.
        let mut r: Vec<f32> = (0..32)
            .map(|i| {
                let t = f32::from(u8::try_from(i).unwrap()) + 0.5;
                if i % 2 == 0 {
                    t.next_down()
                } else {
                    t.next_up()
                }
            })
            .collect();
        r[31] = 127.0;
        rows.push(r);
        rows.push(vec![0.0; 32]);
        rows.push(
            (0..32)
                .map(|i| if i == 3 { f32::MAX } else { 1.0 })
                .collect(),
        );
        // A scale whose inverse overflows, infinities and NaN.
        rows.push(
            (0..32)
                .map(|i| f32::from(u8::try_from(i).unwrap()) * 1e-40)
                .collect(),
        );
        rows.push(
            (0..32)
                .map(|i| if i == 7 { f32::INFINITY } else { 2.0 })
                .collect(),
        );
        rows.push(
            (0..32)
                .map(|i| if i == 9 { f32::NAN } else { -3.0 })
                .collect(),
        );
        let mut seed = 0x9E37_79B9_u32;
        for _ in 0..2000 {
            rows.push(
                (0..32)
                    .map(|_| {
                        seed ^= seed << 13;
                        seed ^= seed >> 17;
                        seed ^= seed << 5;
                        #[allow(clippy::cast_precision_loss, reason = "a test's random values")]
                        let u = seed as f32 / u32::MAX as f32;
                        (u - 0.5) * 8.0
                    })
                    .collect(),
            );
        }
        for x in &rows {
            let (mut a, mut b) = (
                [bytemuck::Zeroable::zeroed()],
                [bytemuck::Zeroable::zeroed()],
            );
            let (a, b): (&mut [BlockQ8_0; 1], &mut [BlockQ8_0; 1]) = (&mut a, &mut b);
            quantize_row_q8_0(x, a);
            quantize_row_q8_0_scalar(x, b);
            assert_eq!(
                bytemuck::bytes_of(&a[0]),
                bytemuck::bytes_of(&b[0]),
                "q8_0 {x:?}"
            );
            let (mut a, mut b) = (
                [bytemuck::Zeroable::zeroed()],
                [bytemuck::Zeroable::zeroed()],
            );
            let (a, b): (&mut [BlockQ8_1; 1], &mut [BlockQ8_1; 1]) = (&mut a, &mut b);
            quantize_row_q8_1(x, a);
            quantize_row_q8_1_scalar(x, b);
            assert_eq!(
                bytemuck::bytes_of(&a[0]),
                bytemuck::bytes_of(&b[0]),
                "q8_1 {x:?}"
            );
        }
    }

    fn worked_input() -> Vec<f32> {
        // research note quant.md §8: x_j = (j − 127.5)/32 · (1 + 0.5·sin j).
        (0..256u16)
            .map(|j| {
                let j = f64::from(j);
                #[allow(
                    clippy::cast_possible_truncation,
                    reason = "test input, as in the note"
                )]
                let v = ((j - 127.5) / 32.0 * (1.0 + 0.5 * j.sin())) as f32;
                v
            })
            .collect()
    }

    /// First-block bytes of ggml C on the worked example (research note quant.md §8).
    #[test]
    fn worked_example_first_blocks() {
        let x = worked_input();
        let mut q8 = vec![bytemuck::Zeroable::zeroed(); 8];
        quantize_row_q8_0(&x, &mut q8);
        assert_eq!(q8[0].d.0, [0xc0, 0x29]);
        assert_eq!(bytemuck::bytes_of(&q8[0])[2..4], [0xa7, 0x83]);
        let mut q4 = vec![bytemuck::Zeroable::zeroed(); 8];
        quantize_row_q4_0(&x, &mut q4);
        assert_eq!(bytemuck::bytes_of(&q4[0])[..4], [0xb4, 0x39, 0x42, 0x50]);
        let mut y = vec![0.0; 256];
        dequantize_row_q4_0(&q4, &mut y);
        // The note prints six decimals.
        assert!(
            (y[0] + 4.277_344).abs() < 1e-6 && y[1] == -5.703_125,
            "{:?}",
            &y[..2]
        );
    }
}
