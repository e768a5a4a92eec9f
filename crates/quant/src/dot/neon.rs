//! aarch64 Advanced SIMD kernels (baseline NEON, no `dotprod`): Q4_0, Q8_0 and f32 rows.
//!
//! Products of two i8 values are widened with `vmull_s8` (exact, −128·−128 included) and
//! summed pairwise into i32 lanes, so each block's integer sum equals the scalar one and the
//! same f32 term is added in block order: results are bit-identical to [`super::scalar`].
//! The other formats run the scalar kernels on aarch64.
//!
//! Every kernel is an `unsafe fn` whose only requirement is that the CPU has NEON; the helpers
//! are safe `#[target_feature]` functions that read only through references.

use std::arch::aarch64::*;

use super::scalar::{q4_0_term, q8_0_term};
use crate::blocks::{BlockQ4_0, BlockQ8_0};

#[inline]
#[target_feature(enable = "neon")]
fn ld_s8(b: &[i8; 16]) -> int8x16_t {
    // SAFETY: reads the 16 bytes of `b`; `vld1q_s8` has no alignment requirement beyond i8's.
    unsafe { vld1q_s8(b.as_ptr()) }
}

#[inline]
#[target_feature(enable = "neon")]
fn ld_u8(b: &[u8; 16]) -> uint8x16_t {
    // SAFETY: reads the 16 bytes of `b`; `vld1q_u8` has no alignment requirement beyond u8's.
    unsafe { vld1q_u8(b.as_ptr()) }
}

#[inline]
#[target_feature(enable = "neon")]
fn ld_f32(b: &[f32; 4]) -> float32x4_t {
    // SAFETY: reads the 4 floats of `b`, which a reference keeps f32-aligned.
    unsafe { vld1q_f32(b.as_ptr()) }
}

/// Σ x·y over 16 signed bytes each, added into four i32 lanes.
#[inline]
#[target_feature(enable = "neon")]
fn dot16(acc: int32x4_t, x: int8x16_t, y: int8x16_t) -> int32x4_t {
    let lo = vmull_s8(vget_low_s8(x), vget_low_s8(y));
    let hi = vmull_high_s8(x, y);
    vpadalq_s16(vpadalq_s16(acc, lo), hi)
}

/// Q4_0 · Q8_0.
///
/// # Safety
/// The CPU must support NEON.
#[target_feature(enable = "neon")]
pub(super) unsafe fn q4_0_q8_0(w: &[BlockQ4_0], a: &[BlockQ8_0]) -> f32 {
    let m4 = vdupq_n_u8(0x0F);
    let eight = vdupq_n_s8(8);
    let mut sumf = 0.0f32;
    for (x, y) in w.iter().zip(a) {
        let v = ld_u8(&x.qs);
        let lo = vsubq_s8(vreinterpretq_s8_u8(vandq_u8(v, m4)), eight);
        let hi = vsubq_s8(vreinterpretq_s8_u8(vshrq_n_u8::<4>(v)), eight);
        let (ys, _) = y.qs.as_chunks::<16>();
        let acc = dot16(vdupq_n_s32(0), lo, ld_s8(&ys[0]));
        let acc = dot16(acc, hi, ld_s8(&ys[1]));
        sumf += q4_0_term(vaddvq_s32(acc), x.d.to_f32(), y.d.to_f32());
    }
    sumf
}

/// Q8_0 · Q8_0.
///
/// # Safety
/// The CPU must support NEON.
#[target_feature(enable = "neon")]
pub(super) unsafe fn q8_0_q8_0(w: &[BlockQ8_0], a: &[BlockQ8_0]) -> f32 {
    let mut sumf = 0.0f32;
    for (x, y) in w.iter().zip(a) {
        let (xs, _) = x.qs.as_chunks::<16>();
        let (ys, _) = y.qs.as_chunks::<16>();
        let acc = dot16(vdupq_n_s32(0), ld_s8(&xs[0]), ld_s8(&ys[0]));
        let acc = dot16(acc, ld_s8(&xs[1]), ld_s8(&ys[1]));
        sumf += q8_0_term(vaddvq_s32(acc), x.d.to_f32(), y.d.to_f32());
    }
    sumf
}

/// f32 · f32, four accumulators of four lanes with FMA, the tail padded with zeros.
///
/// # Safety
/// The CPU must support NEON.
#[target_feature(enable = "neon")]
pub(super) unsafe fn f32_f32(w: &[f32], a: &[f32]) -> f32 {
    let (w16, wr) = w.as_chunks::<16>();
    let (a16, ar) = a.as_chunks::<16>();
    let mut acc = [vdupq_n_f32(0.0); 4];
    for (wc, ac) in w16.iter().zip(a16) {
        let (wc, _) = wc.as_chunks::<4>();
        let (ac, _) = ac.as_chunks::<4>();
        for k in 0..4 {
            acc[k] = vfmaq_f32(acc[k], ld_f32(&wc[k]), ld_f32(&ac[k]));
        }
    }
    let (w4, wt) = wr.as_chunks::<4>();
    let (a4, at) = ar.as_chunks::<4>();
    for (wc, ac) in w4.iter().zip(a4) {
        acc[0] = vfmaq_f32(acc[0], ld_f32(wc), ld_f32(ac));
    }
    if !wt.is_empty() {
        let mut wp = [0.0f32; 4];
        let mut ap = [0.0f32; 4];
        wp[..wt.len()].copy_from_slice(wt);
        ap[..at.len()].copy_from_slice(at);
        acc[1] = vfmaq_f32(acc[1], ld_f32(&wp), ld_f32(&ap));
    }
    vaddvq_f32(vaddq_f32(
        vaddq_f32(acc[0], acc[1]),
        vaddq_f32(acc[2], acc[3]),
    ))
}
