//! TurboQuant KV-cache types turbo2 / turbo3 / turbo4 ("PolarQuant-only", no QJL).
//!
//! A 128-value group `x` is stored as the Lloyd–Max codes of the rotated unit vector
//! `r = wht::forward(x/‖x‖)` (coordinates ≈ N(0, 1/128)) and a *corrected* fp16 norm
//! `‖x‖ / ‖c[idx]‖`, so the dequantized vector has exactly the original length. Dequantization
//! is `c[idx] · norm` and stays in the rotated domain: queries are rotated forward and the
//! output of a turbo V cache is rotated back in the attention graph ([`crate::wht`]).
//!
//! Layouts, centroids (the corrected post-PR #197 tables: exact Lloyd–Max centroids of
//! N(0, 1/128) for 3 and 4 bits) and the quantization steps follow the TurboQuant fork's
//! `quantize_row_turbo*_0_ref` as described in research note `quant.md` §5.2–5.5.

use crate::blocks::{BlockTurbo2, BlockTurbo3, BlockTurbo4, Half, QK_TURBO};
use crate::wht;

/// turbo2 centroids, code order (ascending).
pub const CENTROIDS_2: [f32; 4] = [-0.133_462, -0.039_994, 0.039_994, 0.133_462];
/// turbo2 decision thresholds (a value equal to a threshold takes the upper code).
pub const THRESHOLDS_2: [f32; 3] = [-0.086_728, 0.0, 0.086_728];
/// turbo3 centroids.
pub const CENTROIDS_3: [f32; 8] = [
    -0.190_207, -0.118_786, -0.066_822, -0.021_663, 0.021_663, 0.066_822, 0.118_786, 0.190_207,
];
/// turbo3 thresholds.
pub const THRESHOLDS_3: [f32; 7] = [
    -0.154_496, -0.092_804, -0.044_243, 0.0, 0.044_243, 0.092_804, 0.154_496,
];
/// turbo4 centroids.
pub const CENTROIDS_4: [f32; 16] = [
    -0.241_529, -0.182_877, -0.143_016, -0.111_036, -0.083_292, -0.058_050, -0.034_299, -0.011_349,
    0.011_349, 0.034_299, 0.058_050, 0.083_292, 0.111_036, 0.143_016, 0.182_877, 0.241_529,
];
/// turbo4 thresholds.
pub const THRESHOLDS_4: [f32; 15] = [
    -0.212_203, -0.162_947, -0.127_026, -0.097_164, -0.070_671, -0.046_174, -0.022_824, 0.0,
    0.022_824, 0.046_174, 0.070_671, 0.097_164, 0.127_026, 0.162_947, 0.212_203,
];

/// The code of `r`: how many thresholds lie at or below it.
#[inline]
fn code_of(r: f32, thresholds: &[f32]) -> u8 {
    // Thresholds ascend, so the count of those ≤ r is the code (branch-free).
    thresholds.iter().map(|&t| u8::from(r >= t)).sum()
}

/// Steps 2–5 of the reference quantizer for one group: returns the codes and the stored norm.
fn encode(x: &[f32], centroids: &[f32], thresholds: &[f32]) -> ([u8; QK_TURBO], Half) {
    let mut norm2 = 0.0f32;
    for &v in x {
        norm2 += v * v;
    }
    let norm = norm2.sqrt();
    let inv = if norm > 1e-10 { 1.0 / norm } else { 0.0 };
    let mut r: [f32; QK_TURBO] = std::array::from_fn(|i| x[i] * inv);
    wht::forward(&mut r);
    let mut codes = [0u8; QK_TURBO];
    let mut recon2 = 0.0f32;
    for (c, &v) in codes.iter_mut().zip(&r) {
        *c = code_of(v, thresholds);
        let cv = centroids[usize::from(*c)];
        recon2 += cv * cv;
    }
    let recon = recon2.sqrt();
    let stored = if recon > 1e-10 { norm / recon } else { norm };
    (codes, Half::from_f32(stored))
}

/// Quantizes 128-value groups to turbo2 (2-bit codes, code j at bits `2·(j%4)` of `qs[j/4]`).
pub fn quantize_row_turbo2(x: &[f32], y: &mut [BlockTurbo2]) {
    debug_assert_eq!(x.len(), y.len() * QK_TURBO);
    for (x, b) in x.chunks_exact(QK_TURBO).zip(y) {
        let (codes, norm) = encode(x, &CENTROIDS_2, &THRESHOLDS_2);
        b.norm = norm;
        b.qs = [0; 32];
        for (j, &c) in codes.iter().enumerate() {
            b.qs[j / 4] |= c << (2 * (j % 4));
        }
    }
}

/// `y = c[idx] · norm`, in the rotated domain.
pub fn dequantize_row_turbo2(x: &[BlockTurbo2], y: &mut [f32]) {
    debug_assert_eq!(y.len(), x.len() * QK_TURBO);
    for (b, y) in x.iter().zip(y.chunks_exact_mut(QK_TURBO)) {
        let norm = b.norm.to_f32();
        for (j, o) in y.iter_mut().enumerate() {
            let c = (b.qs[j / 4] >> (2 * (j % 4))) & 3;
            *o = CENTROIDS_2[usize::from(c)] * norm;
        }
    }
}

/// Quantizes to turbo3: low two bits of code j in `qs` as turbo2, the third bit at bit `j%8`
/// of `signs[j/8]`.
pub fn quantize_row_turbo3(x: &[f32], y: &mut [BlockTurbo3]) {
    debug_assert_eq!(x.len(), y.len() * QK_TURBO);
    for (x, b) in x.chunks_exact(QK_TURBO).zip(y) {
        let (codes, norm) = encode(x, &CENTROIDS_3, &THRESHOLDS_3);
        b.norm = norm;
        b.qs = [0; 32];
        b.signs = [0; 16];
        for (j, &c) in codes.iter().enumerate() {
            b.qs[j / 4] |= (c & 3) << (2 * (j % 4));
            b.signs[j / 8] |= ((c >> 2) & 1) << (j % 8);
        }
    }
}

/// `y = c[idx] · norm`, in the rotated domain.
pub fn dequantize_row_turbo3(x: &[BlockTurbo3], y: &mut [f32]) {
    debug_assert_eq!(y.len(), x.len() * QK_TURBO);
    for (b, y) in x.iter().zip(y.chunks_exact_mut(QK_TURBO)) {
        let norm = b.norm.to_f32();
        for (j, o) in y.iter_mut().enumerate() {
            let lo = (b.qs[j / 4] >> (2 * (j % 4))) & 3;
            let hi = (b.signs[j / 8] >> (j % 8)) & 1;
            *o = CENTROIDS_3[usize::from(lo | (hi << 2))] * norm;
        }
    }
}

/// Quantizes to turbo4 (4-bit codes; element 2c in the low nibble of `qs[c]`).
pub fn quantize_row_turbo4(x: &[f32], y: &mut [BlockTurbo4]) {
    debug_assert_eq!(x.len(), y.len() * QK_TURBO);
    for (x, b) in x.chunks_exact(QK_TURBO).zip(y) {
        let (codes, norm) = encode(x, &CENTROIDS_4, &THRESHOLDS_4);
        b.norm = norm;
        for (q, pair) in b.qs.iter_mut().zip(codes.chunks_exact(2)) {
            *q = pair[0] | (pair[1] << 4);
        }
    }
}

/// `y = c[idx] · norm`, in the rotated domain.
pub fn dequantize_row_turbo4(x: &[BlockTurbo4], y: &mut [f32]) {
    debug_assert_eq!(y.len(), x.len() * QK_TURBO);
    for (b, y) in x.iter().zip(y.chunks_exact_mut(QK_TURBO)) {
        let norm = b.norm.to_f32();
        for (pair, &q) in y.chunks_exact_mut(2).zip(&b.qs) {
            pair[0] = CENTROIDS_4[usize::from(q & 0x0f)] * norm;
            pair[1] = CENTROIDS_4[usize::from(q >> 4)] * norm;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{QType, dequantize_row, quantize_row};

    /// Thresholds are the midpoints of neighbouring centroids (to the table's 6 digits).
    #[test]
    fn thresholds_are_midpoints() {
        for (c, t) in [
            (&CENTROIDS_2[..], &THRESHOLDS_2[..]),
            (&CENTROIDS_3[..], &THRESHOLDS_3[..]),
            (&CENTROIDS_4[..], &THRESHOLDS_4[..]),
        ] {
            for (i, &th) in t.iter().enumerate() {
                let mid = (c[i] + c[i + 1]) / 2.0;
                assert!((mid - th).abs() < 1.5e-6, "{mid} vs {th}");
            }
        }
    }

    /// The worked example of quant.md §8: x[0:128] of `(j − 127.5)/32 · (1 + 0.5·sin j)`.
    #[test]
    fn worked_example_first_bytes() {
        let x: Vec<f32> = (0..128u16)
            .map(|j| {
                let j = f64::from(j);
                #[allow(
                    clippy::cast_possible_truncation,
                    reason = "test input, as in the note"
                )]
                let v = ((j - 127.5) / 32.0 * (1.0 + 0.5 * j.sin())) as f32;
                v
            })
            .collect();
        let expect: [(QType, &[u8], f32); 3] = [
            (
                QType::Turbo2,
                &[0xcb, 0x4f, 0xa9, 0x25, 0x6a, 0x29, 0x0d, 0x2f, 0xa5, 0xae],
                31.171_875,
            ),
            (
                QType::Turbo3,
                &[0x24, 0x4f, 0x52, 0x1b, 0x95, 0x16, 0x0b, 0x47, 0x1a, 0x49],
                28.5625,
            ),
            (
                QType::Turbo4,
                &[0x11, 0x4f, 0x95, 0xaa, 0x57, 0x1a, 0xbb, 0x49, 0xb5, 0x1a],
                28.265_625,
            ),
        ];
        for (ty, head, norm) in expect {
            let mut q = vec![0u8; ty.type_size()];
            quantize_row(ty, &x, &mut q).unwrap();
            assert_eq!(&q[..head.len()], head, "{ty}");
            assert_eq!(Half([q[0], q[1]]).to_f32(), norm, "{ty}");
        }
    }

    /// Round trip through dequantize and the inverse rotation keeps the norm (to fp16) and a
    /// zero vector stays zero.
    #[test]
    fn norm_is_preserved_and_zero_stays_zero() {
        let x: Vec<f32> = (0..256u16).map(|i| f32::from(i % 17) - 8.0).collect();
        for ty in [QType::Turbo2, QType::Turbo3, QType::Turbo4] {
            let mut q = vec![0u8; ty.row_bytes(256).unwrap()];
            quantize_row(ty, &x, &mut q).unwrap();
            let mut y = vec![0.0; 256];
            dequantize_row(ty, &q, &mut y).unwrap();
            crate::wht::inverse_row(&mut y);
            for (a, b) in x.chunks(128).zip(y.chunks(128)) {
                let na: f32 = a.iter().map(|v| v * v).sum::<f32>().sqrt();
                let nb: f32 = b.iter().map(|v| v * v).sum::<f32>().sqrt();
                assert!((na - nb).abs() <= na * 2f32.powi(-10), "{ty}: {na} vs {nb}");
            }
            let zeros = vec![0.0; 128];
            let mut q = vec![0u8; ty.type_size()];
            quantize_row(ty, &zeros, &mut q).unwrap();
            let mut y = vec![1.0; 128];
            dequantize_row(ty, &q, &mut y).unwrap();
            assert!(y.iter().all(|&v| v == 0.0), "{ty}");
        }
    }
}
