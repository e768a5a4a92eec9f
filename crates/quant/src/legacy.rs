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
pub fn quantize_row_q8_0(x: &[f32], y: &mut [BlockQ8_0]) {
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

/// Q8_1: Q8_0 plus `s = fp16(Σq · d)`.
pub fn quantize_row_q8_1(x: &[f32], y: &mut [BlockQ8_1]) {
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

#[cfg(test)]
mod tests {
    use super::*;

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
