//! AVX-512 kernels (F, BW, VL and VNNI, on top of the AVX2 set), after ggml-cpu's
//! `arch/x86/quants.c`, with the per-block integer sums exact for any block bytes:
//!
//! - `vpdpbusd` multiplies unsigned by signed bytes and adds groups of four into i32 lanes with
//!   no intermediate saturation, so a signed weight `t` goes in as `t + z` (unsigned) and
//!   `z·Σy = dpbusd(z, y)` comes off again: Q8_0 weights use `z = 128`, Q4_0 / Q5_0 codes are
//!   unsigned with `z = 8 / 16`, and Q4_1 / Q5_1 need no correction at all;
//! - the K-quants multiply codes by activations with `maddubs` (pair sums far below
//!   saturation) and weight them by their sub-block scales with `vpdpwssd`.
//!
//! The 32-value formats take two blocks per 512-bit register and eight blocks per step; the
//! eight sums are reduced together and each becomes the same f32 term as in
//! [`super::scalar`], added in block order, so results are bit-identical to the reference.
//! The few blocks left after the last group of eight use the AVX2 code.
//!
//! IQ4_NL and MXFP4 have no kernel here: the same scheme (a `vpshufb` lookup of the table
//! shifted by 128, then `vpdpbusd`) measured about 10 % slower than the AVX2 kernels on Zen 5,
//! so the AVX-512 table keeps those. NVFP4, Q2_K, Q3_K and IQ4_XS likewise run the AVX2
//! kernels.
//!
//! Every kernel is an `unsafe fn` whose only requirement is that the CPU has the features
//! above; the helpers are safe `#[target_feature]` functions that read only through references.

use std::arch::x86_64::*;

use super::avx2::{self as v2, h2f};
use super::scalar::{k_term, kmin_term, q_1_term, q4_0_term, q5_0_term, q8_0_term};
use crate::blocks::{
    BlockQ4_0, BlockQ4_1, BlockQ4K, BlockQ5_0, BlockQ5_1, BlockQ5K, BlockQ6K, BlockQ8_0, BlockQ8_1,
    BlockQ8K, Half,
};

#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn ld512(b: &[u8; 64]) -> __m512i {
    // SAFETY: reads the 64 bytes of `b`; an unaligned load.
    unsafe { _mm512_loadu_si512(b.as_ptr().cast()) }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn ld512i(b: &[i8; 64]) -> __m512i {
    // SAFETY: reads the 64 bytes of `b`; an unaligned load.
    unsafe { _mm512_loadu_si512(b.as_ptr().cast()) }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn ld_ps(b: &[f32; 16]) -> __m512 {
    // SAFETY: reads the 16 floats of `b`; an unaligned load.
    unsafe { _mm512_loadu_ps(b.as_ptr()) }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn splat(b: u8) -> __m512i {
    _mm512_set1_epi8(b.cast_signed())
}

/// `[lo | hi]`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn join(lo: __m256i, hi: __m256i) -> __m512i {
    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
}

/// Per 128-bit lane, `[x0+x1, x2+x3, y0+y1, y2+y3]` (`phaddd`, which AVX-512 lacks).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn hadd(x: __m512i, y: __m512i) -> __m512i {
    let (xf, yf) = (_mm512_castsi512_ps(x), _mm512_castsi512_ps(y));
    let even = _mm512_castps_si512(_mm512_shuffle_ps::<0b10_00_10_00>(xf, yf));
    let odd = _mm512_castps_si512(_mm512_shuffle_ps::<0b11_01_11_01>(xf, yf));
    _mm512_add_epi32(even, odd)
}

/// The block sums of eight blocks, `z[k]` holding blocks 2k (lanes 0..8) and 2k + 1
/// (lanes 8..16).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn reduce8(z: [__m512i; 4]) -> __m256i {
    // Per 128-bit lane L: [Σ quarter L of z0, … of z1, … of z2, … of z3].
    let h = hadd(hadd(z[0], z[1]), hadd(z[2], z[3]));
    // Lanes 0 + 1 are the even blocks, lanes 2 + 3 the odd ones.
    let even = _mm512_shuffle_i64x2::<0b10_00_10_00>(h, h);
    let odd = _mm512_shuffle_i64x2::<0b11_01_11_01>(h, h);
    let s = _mm512_castsi512_si256(_mm512_add_epi32(even, odd));
    // [b0 b2 b4 b6 b1 b3 b5 b7] → block order.
    _mm256_permutevar8x32_epi32(s, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7))
}

/// The nibbles of two Q4-style blocks, each in element order: `[lo0 hi0 | lo1 hi1]`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn nibbles2(q0: &[u8; 16], q1: &[u8; 16]) -> __m512i {
    // [q0 q0 q1 q1] straight from memory, then the odd 128-bit lanes shifted down a nibble.
    let z = _mm512_broadcast_i32x4(v2::ld128(q0));
    let z = _mm512_mask_broadcast_i32x4(z, 0xFF00, v2::ld128(q1));
    let z = _mm512_mask_srli_epi16::<4>(z, 0xFF00_FF00, z);
    _mm512_and_si512(z, splat(0x0F))
}

/// The activations of two Q8 blocks.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn y2(y0: &[i8; 32], y1: &[i8; 32]) -> __m512i {
    join(v2::ld256i(y0), v2::ld256i(y1))
}

/// Σ u·y in groups of four bytes, u unsigned.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn dot_u(u: __m512i, y: __m512i) -> __m512i {
    _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, y)
}

/// Σ (u − z)·y in groups of four bytes, u unsigned.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn dot_uz(u: __m512i, z: u8, y: __m512i) -> __m512i {
    _mm512_sub_epi32(dot_u(u, y), dot_u(splat(z), y))
}

/// The fifth bits of two Q5 blocks as 0x10 bytes, in the layout of [`nibbles2`].
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn high_bits2(qh0: [u8; 4], qh1: [u8; 4]) -> __m512i {
    let k = u64::from(u32::from_le_bytes(qh0)) | (u64::from(u32::from_le_bytes(qh1)) << 32);
    _mm512_maskz_mov_epi8(k, splat(0x10))
}

/// Runs `$pair` over blocks two at a time, eight per step; `$terms` turns the eight sums (as
/// f32 lanes) into the eight block terms, each computed as its scalar `*_term` function does,
/// and they are added in block order. Blocks past the last group of eight use `$one` (AVX2)
/// and `$term`, the scalar formula.
macro_rules! sum_blocks {
    (
        $w:expr, $a:expr,
        |$x0:ident, $x1:ident, $y0:ident, $y1:ident| $pair:expr,
        |$xs:ident, $ys:ident, $s8:ident| $terms:expr,
        |$x:ident, $y:ident| $one:expr,
        |$s:ident| $term:expr
    ) => {{
        let mut sumf = 0.0f32;
        let (w8, wr) = $w.as_chunks::<8>();
        let (a8, ar) = $a.as_chunks::<8>();
        for ($xs, $ys) in w8.iter().zip(a8) {
            let mut z = [_mm512_setzero_si512(); 4];
            for (k, zk) in z.iter_mut().enumerate() {
                let ($x0, $x1) = (&$xs[2 * k], &$xs[2 * k + 1]);
                let ($y0, $y1) = (&$ys[2 * k], &$ys[2 * k + 1]);
                *zk = $pair;
            }
            let $s8 = _mm256_cvtepi32_ps(reduce8(z));
            let t: [f32; 8] = bytemuck::cast($terms);
            for v in t {
                sumf += v;
            }
        }
        for ($x, $y) in wr.iter().zip(ar) {
            let $s = v2::hsum_i32($one);
            sumf += $term;
        }
        sumf
    }};
}

/// A field of each block of a group of eight, as f32 lanes.
macro_rules! field8 {
    ($b:expr, $f:ident) => {
        v2::halves8([
            $b[0].$f, $b[1].$f, $b[2].$f, $b[3].$f, $b[4].$f, $b[5].$f, $b[6].$f, $b[7].$f,
        ])
    };
}

/// Q4_0 · Q8_0.
///
/// # Safety
/// The CPU must support AVX2, FMA, F16C and AVX-512 F/BW/VL/VNNI.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn q4_0_q8_0(w: &[BlockQ4_0], a: &[BlockQ8_0]) -> f32 {
    sum_blocks!(
        w,
        a,
        |x0, x1, y0, y1| dot_uz(nibbles2(&x0.qs, &x1.qs), 8, y2(&y0.qs, &y1.qs)),
        |xs, ys, s8| _mm256_mul_ps(_mm256_mul_ps(s8, field8!(xs, d)), field8!(ys, d)),
        |x, y| v2::q4_0_isum(x, y),
        |s| q4_0_term(s, h2f(x.d), h2f(y.d))
    )
}

/// Q4_1 · Q8_1.
///
/// # Safety
/// The CPU must support AVX2, FMA, F16C and AVX-512 F/BW/VL/VNNI.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn q4_1_q8_1(w: &[BlockQ4_1], a: &[BlockQ8_1]) -> f32 {
    sum_blocks!(
        w,
        a,
        |x0, x1, y0, y1| dot_u(nibbles2(&x0.qs, &x1.qs), y2(&y0.qs, &y1.qs)),
        |xs, ys, s8| _mm256_add_ps(
            _mm256_mul_ps(_mm256_mul_ps(field8!(xs, d), field8!(ys, d)), s8),
            _mm256_mul_ps(field8!(xs, m), field8!(ys, s))
        ),
        |x, y| v2::q4_1_isum(x, y),
        |s| q_1_term(s, h2f(x.d), h2f(x.m), h2f(y.d), h2f(y.s))
    )
}

/// Q5_0 · Q8_0.
///
/// # Safety
/// The CPU must support AVX2, FMA, F16C and AVX-512 F/BW/VL/VNNI.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn q5_0_q8_0(w: &[BlockQ5_0], a: &[BlockQ8_0]) -> f32 {
    sum_blocks!(
        w,
        a,
        |x0, x1, y0, y1| dot_uz(
            _mm512_or_si512(nibbles2(&x0.qs, &x1.qs), high_bits2(x0.qh, x1.qh)),
            16,
            y2(&y0.qs, &y1.qs)
        ),
        |xs, ys, s8| _mm256_mul_ps(_mm256_mul_ps(field8!(xs, d), field8!(ys, d)), s8),
        |x, y| v2::q5_0_isum(x, y),
        |s| q5_0_term(s, h2f(x.d), h2f(y.d))
    )
}

/// Q5_1 · Q8_1.
///
/// # Safety
/// The CPU must support AVX2, FMA, F16C and AVX-512 F/BW/VL/VNNI.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn q5_1_q8_1(w: &[BlockQ5_1], a: &[BlockQ8_1]) -> f32 {
    sum_blocks!(
        w,
        a,
        |x0, x1, y0, y1| dot_u(
            _mm512_or_si512(nibbles2(&x0.qs, &x1.qs), high_bits2(x0.qh, x1.qh)),
            y2(&y0.qs, &y1.qs)
        ),
        |xs, ys, s8| _mm256_add_ps(
            _mm256_mul_ps(_mm256_mul_ps(field8!(xs, d), field8!(ys, d)), s8),
            _mm256_mul_ps(field8!(xs, m), field8!(ys, s))
        ),
        |x, y| v2::q5_1_isum(x, y),
        |s| q_1_term(s, h2f(x.d), h2f(x.m), h2f(y.d), h2f(y.s))
    )
}

/// Q8_0 · Q8_0: the weights go in as `x + 128` (unsigned), and `128·Σy` comes off.
///
/// # Safety
/// The CPU must support AVX2, FMA, F16C and AVX-512 F/BW/VL/VNNI.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn q8_0_q8_0(w: &[BlockQ8_0], a: &[BlockQ8_0]) -> f32 {
    sum_blocks!(
        w,
        a,
        |x0, x1, y0, y1| dot_uz(
            _mm512_xor_si512(y2(&x0.qs, &x1.qs), splat(0x80)),
            0x80,
            y2(&y0.qs, &y1.qs)
        ),
        |xs, ys, s8| _mm256_mul_ps(s8, _mm256_mul_ps(field8!(xs, d), field8!(ys, d))),
        |x, y| v2::q8_0_isum(x, y),
        |s| q8_0_term(s, h2f(x.d), h2f(y.d))
    )
}

/// 0 for the sixteen low 16-bit lanes, 1 for the sixteen high ones.
const K4_HALF: [u8; 32] = [
    0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,
];

/// The integer sum of a Q4_K / Q5_K super-block; `qh` holds the fifth bits of Q5_K.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn k4_isum(qs: &[u8; 128], qh: Option<&[u8; 32]>, sc: &[u8; 8], y: &BlockQ8K) -> i32 {
    let (qs, _) = qs.as_chunks::<32>();
    let (ys, _) = y.qs.as_chunks::<64>();
    let m4 = splat(0x0F);
    // The eight scales as i16, and per chunk c the lanes [sc[2c] ×16 | sc[2c + 1] ×16].
    let sc16 = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(i64::from_le_bytes(
        *sc,
    ))));
    let half = _mm512_cvtepu8_epi16(v2::ld256(&K4_HALF));
    let mut acc = _mm512_setzero_si512();
    for c in 0..4 {
        // Chunk c's 32 bytes in both halves; the high half shifted down a nibble gives
        // [sub-block 2c | sub-block 2c + 1], elements 64c..64c + 64 in order.
        let q = _mm512_broadcast_i64x4(v2::ld256(&qs[c]));
        let q = _mm512_mask_srli_epi16::<4>(q, 0xFFFF_0000, q);
        let mut u = _mm512_and_si512(q, m4);
        if let Some(h) = qh {
            let h = _mm512_broadcast_i64x4(v2::ld256(h));
            let sel = join(
                _mm256_set1_epi8((1u8 << (2 * c)).cast_signed()),
                _mm256_set1_epi8((1u8 << (2 * c + 1)).cast_signed()),
            );
            u = _mm512_mask_add_epi8(u, _mm512_test_epi8_mask(h, sel), u, splat(0x10));
        }
        // Codes < 32: maddubs pairs < 2¹³; scales < 64: each vpdpwssd pair < 2²⁰.
        let p = _mm512_maddubs_epi16(u, ld512i(&ys[c]));
        let first = i16::try_from(2 * c).unwrap_or(0);
        let s = _mm512_permutexvar_epi16(_mm512_add_epi16(half, _mm512_set1_epi16(first)), sc16);
        acc = _mm512_dpwssd_epi32(acc, p, s);
    }
    _mm512_reduce_add_epi32(acc)
}

/// Q4_K · Q8_K.
///
/// # Safety
/// The CPU must support AVX2, FMA, F16C and AVX-512 F/BW/VL/VNNI.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn q4_k_q8_k(w: &[BlockQ4K], a: &[BlockQ8K]) -> f32 {
    let mut sumf = 0.0f32;
    for (x, y) in w.iter().zip(a) {
        let (sc, m) = v2::k4_scales_mins_u32(&x.scales);
        let isum = k4_isum(&x.qs, None, &sc, y);
        let summs = v2::k4_summs(y, &m);
        sumf += kmin_term(isum, summs, h2f(x.d), h2f(x.dmin), y.d.get());
    }
    sumf
}

/// Q5_K · Q8_K.
///
/// # Safety
/// The CPU must support AVX2, FMA, F16C and AVX-512 F/BW/VL/VNNI.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn q5_k_q8_k(w: &[BlockQ5K], a: &[BlockQ8K]) -> f32 {
    let mut sumf = 0.0f32;
    for (x, y) in w.iter().zip(a) {
        let (sc, m) = v2::k4_scales_mins_u32(&x.scales);
        let isum = k4_isum(&x.qs, Some(&x.qh), &sc, y);
        let summs = v2::k4_summs(y, &m);
        sumf += kmin_term(isum, summs, h2f(x.d), h2f(x.dmin), y.d.get());
    }
    sumf
}

/// Sub-block index (0..4) of each 16-bit lane of a 64-value group: eight lanes per sub-block.
const Q6_SUB: [u8; 32] = [
    0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3,
];

/// Q6_K · Q8_K.
///
/// # Safety
/// The CPU must support AVX2, FMA, F16C and AVX-512 F/BW/VL/VNNI.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn q6_k_q8_k(w: &[BlockQ6K], a: &[BlockQ8K]) -> f32 {
    let m4 = splat(0x0F);
    let m30 = splat(0x30);
    let z32 = splat(32);
    // Shifts that bring qh's bit pairs 0, 1 (groups 0, 1) and 2, 3 (groups 2, 3) to bits 4–5.
    let shl = join(_mm256_set1_epi16(4), _mm256_set1_epi16(2));
    let shr = join(_mm256_set1_epi16(0), _mm256_set1_epi16(2));
    let sub = _mm512_cvtepu8_epi16(v2::ld256(&Q6_SUB));
    let mut sumf = 0.0f32;
    for (x, y) in w.iter().zip(a) {
        let (ql, _) = x.ql.as_chunks::<64>();
        let (qh, _) = x.qh.as_chunks::<32>();
        let (ys, _) = y.qs.as_chunks::<64>();
        let sc = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(v2::ld128i(&x.scales)));
        let mut acc = _mm512_setzero_si512();
        for h in 0..2 {
            // ql[64h..64h+64]: low nibbles are elements 128h + 0..64, high nibbles 64..128.
            let zql = ld512(&ql[h]);
            let zqh = _mm512_broadcast_i64x4(v2::ld256(&qh[h]));
            let lo = _mm512_or_si512(
                _mm512_and_si512(zql, m4),
                _mm512_and_si512(_mm512_sllv_epi16(zqh, shl), m30),
            );
            let hi = _mm512_or_si512(
                _mm512_and_si512(_mm512_srli_epi16::<4>(zql), m4),
                _mm512_and_si512(_mm512_srlv_epi16(zqh, shr), m30),
            );
            for (g, u) in [(2 * h, lo), (2 * h + 1, hi)] {
                let yv = ld512i(&ys[g]);
                // (u − 32)·y pairs ≤ 2¹³ in magnitude; times a scale ≥ −128, 2²¹ per lane.
                let p =
                    _mm512_sub_epi16(_mm512_maddubs_epi16(u, yv), _mm512_maddubs_epi16(z32, yv));
                let first = i16::try_from(4 * g).unwrap_or(0);
                let s =
                    _mm512_permutexvar_epi16(_mm512_add_epi16(sub, _mm512_set1_epi16(first)), sc);
                acc = _mm512_dpwssd_epi32(acc, p, s);
            }
        }
        sumf += k_term(_mm512_reduce_add_epi32(acc), h2f(x.d), y.d.get());
    }
    sumf
}

/// Runs a float dot product: `$load` turns a chunk of 16 weights into f32 lanes, four
/// accumulators over 64-value chunks, one over the 16-value chunks left, and the last few
/// values padded with zeros into one more 16-value chunk.
macro_rules! float_dot {
    ($w:expr, $a:expr, $wty:ty, $zero:expr, |$c:ident| $load:expr) => {{
        let (w64, wr) = $w.as_chunks::<64>();
        let (a64, ar) = $a.as_chunks::<64>();
        let mut acc = [_mm512_setzero_ps(); 4];
        for (wc, ac) in w64.iter().zip(a64) {
            let (wc, _) = wc.as_chunks::<16>();
            let (ac, _) = ac.as_chunks::<16>();
            for k in 0..4 {
                let $c = &wc[k];
                acc[k] = _mm512_fmadd_ps($load, ld_ps(&ac[k]), acc[k]);
            }
        }
        let (w16, wt) = wr.as_chunks::<16>();
        let (a16, at) = ar.as_chunks::<16>();
        for ($c, ac) in w16.iter().zip(a16) {
            acc[0] = _mm512_fmadd_ps($load, ld_ps(ac), acc[0]);
        }
        if !wt.is_empty() {
            let mut wp: [$wty; 16] = [$zero; 16];
            let mut ap = [0.0f32; 16];
            wp[..wt.len()].copy_from_slice(wt);
            ap[..at.len()].copy_from_slice(at);
            let $c = &wp;
            acc[1] = _mm512_fmadd_ps($load, ld_ps(&ap), acc[1]);
        }
        _mm512_reduce_add_ps(_mm512_add_ps(
            _mm512_add_ps(acc[0], acc[1]),
            _mm512_add_ps(acc[2], acc[3]),
        ))
    }};
}

/// f32 · f32, in f32 lanes with FMA.
///
/// # Safety
/// The CPU must support AVX2, FMA, F16C and AVX-512 F/BW/VL/VNNI.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn f32_f32(w: &[f32], a: &[f32]) -> f32 {
    float_dot!(w, a, f32, 0.0, |c| ld_ps(c))
}

/// f16 · f32, in f32 lanes with FMA.
///
/// # Safety
/// The CPU must support AVX2, FMA, F16C and AVX-512 F/BW/VL/VNNI.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn f16_f32(w: &[Half], a: &[f32]) -> f32 {
    float_dot!(w, a, Half, Half::default(), |c| _mm512_cvtph_ps(v2::ld256(
        bytemuck::cast_ref::<[Half; 16], [u8; 32]>(c)
    )))
}

/// bf16 · f32, in f32 lanes with FMA.
///
/// # Safety
/// The CPU must support AVX2, FMA, F16C and AVX-512 F/BW/VL/VNNI.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn bf16_f32(w: &[[u8; 2]], a: &[f32]) -> f32 {
    float_dot!(w, a, [u8; 2], [0, 0], |c| _mm512_castsi512_ps(
        _mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(v2::ld256(bytemuck::cast_ref::<
            [[u8; 2]; 16],
            [u8; 32],
        >(c))))
    ))
}
