//! FP4 formats with E2M1 elements: MXFP4 (OCP MX, E8M0 shared scale per 32 values) and NVFP4
//! (UE4M3 scale per 16 values, 64-value blocks).
//!
//! ggml stores *doubled* E2M1 values as int8 (`KVALUES_FP4`) and its scale decoders return
//! half the true scale, so `code · scale_half` is the true value (`ggml-common.h`,
//! `ggml-impl.h`). NVFP4's per-tensor FP32 second-level scale is a separate GGUF tensor
//! (`<name>.scale`) that the matmul caller applies; it is not part of the block.

use crate::blocks::{BlockMxfp4, BlockNvfp4, QK, QK_NVFP4};

/// Doubled E2M1 values: bit 3 of a code is the sign, bits 0–2 the magnitude
/// (0, 0.5, 1, 1.5, 2, 3, 4, 6) × 2.
pub const KVALUES_FP4: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// Values per NVFP4 sub-block (one UE4M3 scale each).
pub(crate) const QK_NVFP4_SUB: usize = 16;

/// `2^k` for k in the normal f32 exponent range.
#[inline]
fn pow2(k: i32) -> f32 {
    debug_assert!((-126..=127).contains(&k));
    f32::from_bits(u32::try_from(k + 127).unwrap_or(0) << 23)
}

/// Half of the E8M0 scale `2^(e − 127)`, i.e. `2^(e − 128)`, built from bits as ggml does
/// (the two smallest are f32 denormals).
#[must_use]
#[inline]
pub fn e8m0_to_fp32_half(e: u8) -> f32 {
    let bits = if e < 2 {
        0x0020_0000u32 << e
    } else {
        u32::from(e - 1) << 23
    };
    f32::from_bits(bits)
}

/// Half of a UE4M3 scale (`ggml_ue4m3_to_fp32`): 0x00 and 0x7F decode to 0; exponent bias 7,
/// three mantissa bits, subnormals `man · 2⁻⁹`.
#[must_use]
#[inline]
pub fn ue4m3_to_fp32_half(x: u8) -> f32 {
    if x == 0 || x == 0x7f {
        return 0.0;
    }
    let exp = i32::from((x >> 3) & 0x0f);
    let man = f32::from(x & 0x07);
    let raw = if exp == 0 {
        man * pow2(-9)
    } else {
        (1.0 + man / 8.0) * pow2(exp - 7)
    };
    raw * 0.5
}

/// f32 → UE4M3 as `ggml_fp32_to_ue4m3`: non-positive or NaN → 0, clamp to 448, mantissa
/// rounded half *up* on fp32 bit 19, and any result needing exponent 15 saturates to 0x7E
/// (448) — so 255.9 encodes as 448, and codes 0x78–0x7D never occur.
#[must_use]
pub(crate) fn fp32_to_ue4m3(x: f32) -> u8 {
    if x.is_nan() || x <= 0.0 {
        return 0;
    }
    let x = x.min(448.0);
    let bits = x.to_bits();
    let fp32_exp = i32::try_from((bits >> 23) & 0xff).unwrap_or(0) - 127;
    let fp32_man = (bits >> 20) & 0x7;
    let mut exp = fp32_exp + 7;
    if exp <= 0 {
        // Subnormal: man = (int)(x · 512 + 0.5), clamped to 7; below 1 → 0.
        #[allow(
            clippy::cast_possible_truncation,
            reason = "x < 2^-6 here, so x·512 + 0.5 < 8.5"
        )]
        let man = (x * 512.0 + 0.5) as i32;
        return u8::try_from(man.min(7)).unwrap_or(0);
    }
    if exp >= 15 {
        return 0x7e;
    }
    let mut man = fp32_man + ((bits >> 19) & 1);
    if man > 7 {
        man = 0;
        exp += 1;
        if exp >= 15 {
            return 0x7e;
        }
    }
    u8::try_from((u32::try_from(exp).unwrap_or(0) << 3) | man).unwrap_or(0x7e)
}

/// The first code minimising `|kvalues[i]·d − x|` (strict `<`, so 0 gets +0, code 0).
#[inline]
pub(crate) fn best_index_fp4(x: f32, d: f32) -> u8 {
    let mut best = 0u8;
    let mut best_err = (f32::from(KVALUES_FP4[0]) * d - x).abs();
    for (i, &k) in (1u8..).zip(&KVALUES_FP4[1..]) {
        let err = (f32::from(k) * d - x).abs();
        if err < best_err {
            best = i;
            best_err = err;
        }
    }
    best
}

/// MXFP4 reference quantizer: `e = floor(log2(amax)) − 2 + 127` (0 for an all-zero block),
/// nearest code for each value.
pub fn quantize_row_mxfp4(x: &[f32], y: &mut [BlockMxfp4]) {
    debug_assert_eq!(x.len(), y.len() * QK);
    for (x, b) in x.chunks_exact(QK).zip(y) {
        let amax = x
            .iter()
            .fold(0.0f32, |m, v| if m < v.abs() { v.abs() } else { m });
        // ggml: (uint8_t)(floorf(log2f(amax)) - 2 + 127). log2 goes through the platform libm
        // like ggml's log2f; the conversion wraps like the C cast for in-range exponents.
        let e = if amax > 0.0 {
            #[allow(
                clippy::cast_possible_truncation,
                reason = "floor(log2) of a finite f32 is within ±150"
            )]
            let l = (amax.log2().floor() - 2.0 + 127.0) as i32;
            u8::try_from(l.rem_euclid(256)).unwrap_or(0)
        } else {
            0
        };
        let d = e8m0_to_fp32_half(e);
        b.e = e;
        for j in 0..QK / 2 {
            b.qs[j] = best_index_fp4(x[j], d) | (best_index_fp4(x[QK / 2 + j], d) << 4);
        }
    }
}

/// `y = kvalues[q] · 2^(e − 128)`.
pub fn dequantize_row_mxfp4(x: &[BlockMxfp4], y: &mut [f32]) {
    debug_assert_eq!(y.len(), x.len() * QK);
    for (b, y) in x.iter().zip(y.chunks_exact_mut(QK)) {
        let d = e8m0_to_fp32_half(b.e);
        for j in 0..QK / 2 {
            y[j] = f32::from(KVALUES_FP4[usize::from(b.qs[j] & 0x0f)]) * d;
            y[j + QK / 2] = f32::from(KVALUES_FP4[usize::from(b.qs[j] >> 4)]) * d;
        }
    }
}

/// NVFP4 reference quantizer: per 16-value sub-block `ue = fp32_to_ue4m3(amax / 6)`, nearest
/// code against the decoded scale. No per-tensor scale is involved.
pub fn quantize_row_nvfp4(x: &[f32], y: &mut [BlockNvfp4]) {
    debug_assert_eq!(x.len(), y.len() * QK_NVFP4);
    for (x, b) in x.chunks_exact(QK_NVFP4).zip(y) {
        for (s, xb) in x.chunks_exact(QK_NVFP4_SUB).enumerate() {
            let amax = xb
                .iter()
                .fold(0.0f32, |m, v| if m < v.abs() { v.abs() } else { m });
            let ue = fp32_to_ue4m3(amax / 6.0);
            b.d[s] = ue;
            let d = ue4m3_to_fp32_half(ue);
            for j in 0..QK_NVFP4_SUB / 2 {
                b.qs[s * 8 + j] =
                    best_index_fp4(xb[j], d) | (best_index_fp4(xb[QK_NVFP4_SUB / 2 + j], d) << 4);
            }
        }
    }
}

/// `y = kvalues[q] · ue4m3_half(d[s])` (without the per-tensor scale).
pub fn dequantize_row_nvfp4(x: &[BlockNvfp4], y: &mut [f32]) {
    debug_assert_eq!(y.len(), x.len() * QK_NVFP4);
    for (b, y) in x.iter().zip(y.chunks_exact_mut(QK_NVFP4)) {
        for (s, yb) in y.chunks_exact_mut(QK_NVFP4_SUB).enumerate() {
            let d = ue4m3_to_fp32_half(b.d[s]);
            for j in 0..QK_NVFP4_SUB / 2 {
                let q = b.qs[s * 8 + j];
                yb[j] = f32::from(KVALUES_FP4[usize::from(q & 0x0f)]) * d;
                yb[j + QK_NVFP4_SUB / 2] = f32::from(KVALUES_FP4[usize::from(q >> 4)]) * d;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Values measured with gguf-py's `NVFP4.fp32_to_ue4m3` (research note quant.md §4.4).
    #[test]
    fn ue4m3_encoding_edge_cases() {
        assert_eq!(fp32_to_ue4m3(239.0), 0x77);
        assert_eq!(fp32_to_ue4m3(255.9), 0x7e);
        assert_eq!(fp32_to_ue4m3(300.0), 0x7e);
        assert_eq!(fp32_to_ue4m3(0.0019), 0x01);
        assert_eq!(fp32_to_ue4m3(-1.0), 0);
        assert_eq!(fp32_to_ue4m3(f32::NAN), 0);
        assert_eq!(ue4m3_to_fp32_half(0x77), 120.0);
        assert_eq!(ue4m3_to_fp32_half(0x7e), 224.0);
        assert_eq!(ue4m3_to_fp32_half(0x7f), 0.0);
        assert_eq!(ue4m3_to_fp32_half(0x01), 2f32.powi(-10));
    }

    #[test]
    fn e8m0_half_scale() {
        assert_eq!(e8m0_to_fp32_half(127), 0.5);
        assert_eq!(e8m0_to_fp32_half(128), 1.0);
        assert_eq!(e8m0_to_fp32_half(0), 2f32.powi(-128));
        assert_eq!(e8m0_to_fp32_half(1), 2f32.powi(-127));
        assert_eq!(e8m0_to_fp32_half(254), 2f32.powi(126));
    }

    /// First block of ggml C on the worked example of quant.md §8: mxfp4 `7f de cf cf ee`,
    /// nvfp4 `37 35 34 31 fe ef df ce`.
    #[test]
    fn worked_example_first_blocks() {
        let x: Vec<f32> = (0..256u16)
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
        let mut m = vec![bytemuck::Zeroable::zeroed(); 8];
        quantize_row_mxfp4(&x, &mut m);
        assert_eq!(
            bytemuck::bytes_of(&m[0])[..5],
            [0x7f, 0xde, 0xcf, 0xcf, 0xee]
        );
        let mut n = vec![bytemuck::Zeroable::zeroed(); 4];
        quantize_row_nvfp4(&x, &mut n);
        assert_eq!(
            bytemuck::bytes_of(&n[0])[..8],
            [0x37, 0x35, 0x34, 0x31, 0xfe, 0xef, 0xdf, 0xce]
        );
        let mut y = vec![0.0; 256];
        dequantize_row_nvfp4(&n, &mut y);
        assert_eq!(y[..2], [-3.75, -5.625]);
    }
}
