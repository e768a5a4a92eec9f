//! AVX2 kernels (with FMA and F16C), after ggml-cpu's `arch/x86/quants.c`, changed so that the
//! per-block integer sums are exact for any block bytes:
//!
//! - unsigned codes (Q4_x, Q5_x, Q2_K … Q6_K) go into the unsigned side of
//!   `maddubs`, and a zero point `z` is taken off as `maddubs(z, y)` — pair sums stay far below
//!   the i16 saturation point even for y = −128;
//! - signed table values that never reach −128 (IQ4_NL, IQ4_XS, FP4) use
//!   `maddubs(|y|, sign(t, y))`,
//!   which ggml uses the other way round (`|t|`, `sign(y, t)`), where y = −128 goes wrong;
//! - Q8_0 × Q8_0, where both sides can be −128, widens to i16 and uses `madd`.
//!
//! Each block's (or super-block's) sum is then turned into the same f32 term as in
//! [`super::scalar`] and added in block order, so results are bit-identical to the scalar
//! reference. Four blocks' sums are reduced together (`hadd` tree) and their terms computed in
//! one vector, to keep the horizontal and scale work small.
//!
//! Every kernel is an `unsafe fn` whose only requirement is that the CPU has AVX2, FMA and
//! F16C; the helpers are safe `#[target_feature]` functions that read only through references.

use std::arch::x86_64::*;

use super::scalar::{
    KVALUES_FP4, KVALUES_IQ4NL, e8m0_to_fp32_half, iq4_nl_term, iq4xs_scales, k_term, kmin_term,
    mxfp4_term, nvfp4_term, q_1_term, q4_0_term, q5_0_term, q8_0_term,
};
use crate::blocks::{
    BlockIq4Nl, BlockIq4Xs, BlockMxfp4, BlockNvfp4, BlockQ2K, BlockQ3K, BlockQ4_0, BlockQ4_1,
    BlockQ4K, BlockQ5_0, BlockQ5_1, BlockQ5K, BlockQ6K, BlockQ8_0, BlockQ8_1, BlockQ8K, Half,
};

// Loads. Each reads exactly the array it is given; `loadu` has no alignment requirement.

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn ld128(b: &[u8; 16]) -> __m128i {
    // SAFETY: reads the 16 bytes of `b`; an unaligned load.
    unsafe { _mm_loadu_si128(b.as_ptr().cast()) }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn ld128i(b: &[i8; 16]) -> __m128i {
    // SAFETY: reads the 16 bytes of `b`; an unaligned load.
    unsafe { _mm_loadu_si128(b.as_ptr().cast()) }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn ld256(b: &[u8; 32]) -> __m256i {
    // SAFETY: reads the 32 bytes of `b`; an unaligned load.
    unsafe { _mm256_loadu_si256(b.as_ptr().cast()) }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn ld256i(b: &[i8; 32]) -> __m256i {
    // SAFETY: reads the 32 bytes of `b`; an unaligned load.
    unsafe { _mm256_loadu_si256(b.as_ptr().cast()) }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn ld_ps(b: &[f32; 8]) -> __m256 {
    // SAFETY: reads the 8 floats of `b`; an unaligned load.
    unsafe { _mm256_loadu_ps(b.as_ptr()) }
}

/// An f16 scale as f32 with F16C (exact, like [`Half::to_f32`]), its bits moved in from a
/// general register (see [`opaque`]).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn h2f(h: Half) -> f32 {
    let bits = opaque(u64::from(h.to_bits())).cast_signed();
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi64_si128(bits)))
}

/// Four f16 scales as f32 lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn halves4(h: [Half; 4]) -> __m128 {
    _mm_cvtph_ps(_mm_cvtsi64_si128(opaque(pack4(h)).cast_signed()))
}

/// Eight f16 scales as f32 lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn halves8(h: [Half; 8]) -> __m256 {
    let lo = opaque(pack4([h[0], h[1], h[2], h[3]])).cast_signed();
    let hi = opaque(pack4([h[4], h[5], h[6], h[7]])).cast_signed();
    _mm256_cvtph_ps(_mm_set_epi64x(hi, lo))
}

/// `x`, hidden from the optimizer by an empty `asm!` that keeps it in a general register.
///
/// Without it, LLVM sees through the packing of scale bits in [`halves4`] / [`halves8`] /
/// [`h2f`] and builds the vector with `vpinsrw` whose "don't care" input is whatever register
/// comes to hand — often the running sum, which puts every scale conversion behind the last
/// add (a false dependency on the one serial chain of the kernel). From a general register
/// the bits go in with `vmovq`, which depends on nothing else.
#[inline]
pub(super) fn opaque(x: u64) -> u64 {
    let mut x = x;
    // SAFETY: the assembly is empty; it reads and writes only the register that holds `x`.
    unsafe {
        std::arch::asm!("/* {0} */", inout(reg) x, options(pure, nomem, nostack, preserves_flags));
    }
    x
}

/// Four f16 bit patterns in one u64, first in the low bits.
#[inline]
fn pack4(h: [Half; 4]) -> u64 {
    h.iter()
        .rev()
        .fold(0u64, |acc, x| (acc << 16) | u64::from(x.to_bits()))
}

/// A byte broadcast, for constants written as unsigned bytes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn splat(b: u8) -> __m256i {
    _mm256_set1_epi8(b.cast_signed())
}

/// The sum of the eight i32 lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn hsum_i32(v: __m256i) -> i32 {
    let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
    _mm_cvtsi128_si32(s)
}

/// The lane sums of four vectors: `[Σa, Σb, Σc, Σd]`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn hsum4(a: __m256i, b: __m256i, c: __m256i, d: __m256i) -> __m128i {
    // Per 128-bit half: [a01 a23 b01 b23], then [a0123 b0123 c0123 d0123]; add the halves.
    let abcd = _mm256_hadd_epi32(_mm256_hadd_epi32(a, b), _mm256_hadd_epi32(c, d));
    _mm_add_epi32(
        _mm256_castsi256_si128(abcd),
        _mm256_extracti128_si256::<1>(abcd),
    )
}

/// The sum of the eight f32 lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn hsum_ps(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// The lane sum of a 16-lane vector held as its low and high halves, in the order of
/// `_mm512_reduce_add_ps`: the halves added, then the 128-bit halves, then lanes 0 + 2 and
/// 1 + 3, then those two (`hsum_ps` of `lo + hi`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn hsum16(lo: __m256, hi: __m256) -> f32 {
    hsum_ps(_mm256_add_ps(lo, hi))
}

/// The 32 nibbles of a Q4-style block in element order: low nibbles (elements 0..16), then high.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn nibbles(qs: &[u8; 16]) -> __m256i {
    let v = ld128(qs);
    let m = _mm_set1_epi8(0x0F);
    let lo = _mm_and_si128(v, m);
    let hi = _mm_and_si128(_mm_srli_epi16::<4>(v), m);
    _mm256_set_m128i(hi, lo)
}

/// Byte j is 0xFF where bit j of `qh` is set (Q5 high bits; `bytes_from_bits_32` in ggml).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn bits32(qh: [u8; 4]) -> __m256i {
    let t = _mm256_set1_epi32(i32::from_le_bytes(qh));
    // Byte j takes byte j / 8 of qh, then tests bit j % 8.
    let spread = _mm256_set_epi64x(
        0x0303_0303_0303_0303,
        0x0202_0202_0202_0202,
        0x0101_0101_0101_0101,
        0,
    );
    let b = _mm256_shuffle_epi8(t, spread);
    let sel = _mm256_set1_epi64x(i64::from_le_bytes([1, 2, 4, 8, 16, 32, 64, 128]));
    _mm256_cmpeq_epi8(_mm256_and_si256(b, sel), sel)
}

/// Σ u·y over 32 bytes, u unsigned (< 64 here), y signed: eight i32 partial sums.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn dot_u8_i8(u: __m256i, y: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(u, y), _mm256_set1_epi16(1))
}

/// Σ (u − z)·y over 32 bytes, u and z unsigned (< 64), y signed: eight i32 partial sums.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn dot_u8z_i8(u: __m256i, z: u8, y: __m256i) -> __m256i {
    // |u·y + u'·y'| ≤ 2·63·128 < 2¹⁵, so neither maddubs saturates and the difference is exact.
    let p = _mm256_sub_epi16(
        _mm256_maddubs_epi16(u, y),
        _mm256_maddubs_epi16(splat(z), y),
    );
    _mm256_madd_epi16(p, _mm256_set1_epi16(1))
}

/// Σ t·y over 32 bytes, t signed but never −128, y signed.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn dot_t_i8(t: __m256i, y: __m256i) -> __m256i {
    // |y| is exact as an unsigned byte (128 included), sign(t, y) = ±t stays in i8 because
    // t ≠ −128, and a pair sum is at most 2·128·127 < 2¹⁵.
    _mm256_madd_epi16(
        _mm256_maddubs_epi16(_mm256_abs_epi8(y), _mm256_sign_epi8(t, y)),
        _mm256_set1_epi16(1),
    )
}

/// A 16-entry i8 table in both 128-bit halves, for `shuffle_epi8` lookups.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn table256(t: &[i8; 16]) -> __m256i {
    _mm256_broadcastsi128_si256(ld128i(t))
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn q4_0_isum(x: &BlockQ4_0, y: &BlockQ8_0) -> __m256i {
    dot_u8z_i8(nibbles(&x.qs), 8, ld256i(&y.qs))
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn q4_1_isum(x: &BlockQ4_1, y: &BlockQ8_1) -> __m256i {
    dot_u8_i8(nibbles(&x.qs), ld256i(&y.qs))
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn q5_codes(qs: &[u8; 16], qh: [u8; 4]) -> __m256i {
    _mm256_or_si256(nibbles(qs), _mm256_and_si256(bits32(qh), splat(0x10)))
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn q5_0_isum(x: &BlockQ5_0, y: &BlockQ8_0) -> __m256i {
    dot_u8z_i8(q5_codes(&x.qs, x.qh), 16, ld256i(&y.qs))
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn q5_1_isum(x: &BlockQ5_1, y: &BlockQ8_1) -> __m256i {
    dot_u8_i8(q5_codes(&x.qs, x.qh), ld256i(&y.qs))
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn q8_0_isum(x: &BlockQ8_0, y: &BlockQ8_0) -> __m256i {
    // Both sides may be −128, so widen to i16: madd then sums two products ≤ 2¹⁴ exactly.
    let (xs, _) = x.qs.as_chunks::<16>();
    let (ys, _) = y.qs.as_chunks::<16>();
    let p0 = _mm256_madd_epi16(
        _mm256_cvtepi8_epi16(ld128i(&xs[0])),
        _mm256_cvtepi8_epi16(ld128i(&ys[0])),
    );
    let p1 = _mm256_madd_epi16(
        _mm256_cvtepi8_epi16(ld128i(&xs[1])),
        _mm256_cvtepi8_epi16(ld128i(&ys[1])),
    );
    _mm256_add_epi32(p0, p1)
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn table_isum(table: __m256i, qs: &[u8; 16], y: &[i8; 32]) -> __m256i {
    dot_t_i8(_mm256_shuffle_epi8(table, nibbles(qs)), ld256i(y))
}

/// Runs `$isum` over blocks in groups of four; `$terms` turns the four sums (as f32 lanes)
/// into the four block terms, each computed as its scalar `*_term` function does, and they are
/// added in block order. Blocks past the last group of four use `$term`, the scalar formula.
macro_rules! sum_blocks {
    (
        $w:expr, $a:expr,
        |$x:ident, $y:ident| $isum:expr,
        |$xs:ident, $ys:ident, $s4:ident| $terms:expr,
        |$s:ident| $term:expr
    ) => {{
        let mut sumf = 0.0f32;
        let (w4, wr) = $w.as_chunks::<4>();
        let (a4, ar) = $a.as_chunks::<4>();
        for ($xs, $ys) in w4.iter().zip(a4) {
            let v0 = {
                let ($x, $y) = (&$xs[0], &$ys[0]);
                $isum
            };
            let v1 = {
                let ($x, $y) = (&$xs[1], &$ys[1]);
                $isum
            };
            let v2 = {
                let ($x, $y) = (&$xs[2], &$ys[2]);
                $isum
            };
            let v3 = {
                let ($x, $y) = (&$xs[3], &$ys[3]);
                $isum
            };
            let $s4 = _mm_cvtepi32_ps(hsum4(v0, v1, v2, v3));
            let t: [f32; 4] = bytemuck::cast($terms);
            for v in t {
                sumf += v;
            }
        }
        for ($x, $y) in wr.iter().zip(ar) {
            let $s = hsum_i32($isum);
            sumf += $term;
        }
        sumf
    }};
}

/// `d` of each block of a group.
macro_rules! field4 {
    ($b:expr, $f:ident) => {
        halves4([$b[0].$f, $b[1].$f, $b[2].$f, $b[3].$f])
    };
}

/// The E8M0 half-scales of four MXFP4 blocks.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn e8m0_4(xs: &[BlockMxfp4; 4]) -> __m128 {
    let b = xs.map(|x| u64::from(e8m0_to_fp32_half(x.e).to_bits()));
    _mm_castsi128_ps(_mm_set_epi64x(
        opaque(b[2] | (b[3] << 32)).cast_signed(),
        opaque(b[0] | (b[1] << 32)).cast_signed(),
    ))
}

/// Q4_0 · Q8_0.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn q4_0_q8_0(w: &[BlockQ4_0], a: &[BlockQ8_0]) -> f32 {
    sum_blocks!(
        w,
        a,
        |x, y| q4_0_isum(x, y),
        |xs, ys, s4| _mm_mul_ps(_mm_mul_ps(s4, field4!(xs, d)), field4!(ys, d)),
        |s| q4_0_term(s, h2f(x.d), h2f(y.d))
    )
}

/// Q4_1 · Q8_1.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn q4_1_q8_1(w: &[BlockQ4_1], a: &[BlockQ8_1]) -> f32 {
    sum_blocks!(
        w,
        a,
        |x, y| q4_1_isum(x, y),
        |xs, ys, s4| _mm_add_ps(
            _mm_mul_ps(_mm_mul_ps(field4!(xs, d), field4!(ys, d)), s4),
            _mm_mul_ps(field4!(xs, m), field4!(ys, s))
        ),
        |s| q_1_term(s, h2f(x.d), h2f(x.m), h2f(y.d), h2f(y.s))
    )
}

/// Q5_0 · Q8_0.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn q5_0_q8_0(w: &[BlockQ5_0], a: &[BlockQ8_0]) -> f32 {
    sum_blocks!(
        w,
        a,
        |x, y| q5_0_isum(x, y),
        |xs, ys, s4| _mm_mul_ps(_mm_mul_ps(field4!(xs, d), field4!(ys, d)), s4),
        |s| q5_0_term(s, h2f(x.d), h2f(y.d))
    )
}

/// Q5_1 · Q8_1.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn q5_1_q8_1(w: &[BlockQ5_1], a: &[BlockQ8_1]) -> f32 {
    sum_blocks!(
        w,
        a,
        |x, y| q5_1_isum(x, y),
        |xs, ys, s4| _mm_add_ps(
            _mm_mul_ps(_mm_mul_ps(field4!(xs, d), field4!(ys, d)), s4),
            _mm_mul_ps(field4!(xs, m), field4!(ys, s))
        ),
        |s| q_1_term(s, h2f(x.d), h2f(x.m), h2f(y.d), h2f(y.s))
    )
}

/// Q8_0 · Q8_0.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn q8_0_q8_0(w: &[BlockQ8_0], a: &[BlockQ8_0]) -> f32 {
    sum_blocks!(
        w,
        a,
        |x, y| q8_0_isum(x, y),
        |xs, ys, s4| _mm_mul_ps(s4, _mm_mul_ps(field4!(xs, d), field4!(ys, d))),
        |s| q8_0_term(s, h2f(x.d), h2f(y.d))
    )
}

/// IQ4_NL · Q8_0.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn iq4_nl_q8_0(w: &[BlockIq4Nl], a: &[BlockQ8_0]) -> f32 {
    let t = table256(&KVALUES_IQ4NL);
    sum_blocks!(
        w,
        a,
        |x, y| table_isum(t, &x.qs, &y.qs),
        |xs, ys, s4| _mm_mul_ps(_mm_mul_ps(field4!(ys, d), field4!(xs, d)), s4),
        |s| iq4_nl_term(s, h2f(x.d), h2f(y.d))
    )
}

/// MXFP4 · Q8_0.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn mxfp4_q8_0(w: &[BlockMxfp4], a: &[BlockQ8_0]) -> f32 {
    let t = table256(&KVALUES_FP4);
    sum_blocks!(
        w,
        a,
        |x, y| table_isum(t, &x.qs, &y.qs),
        |xs, ys, s4| _mm_mul_ps(_mm_mul_ps(field4!(ys, d), e8m0_4(xs)), s4),
        |s| mxfp4_term(s, x.e, h2f(y.d))
    )
}

/// NVFP4 · Q8_0: four 16-value sub-block sums per 64-value block, each its own term.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn nvfp4_q8_0(w: &[BlockNvfp4], a: &[BlockQ8_0]) -> f32 {
    let t = ld128i(&KVALUES_FP4);
    let m4 = _mm_set1_epi8(0x0F);
    let mut sumf = 0.0f32;
    let (ys, _) = a.as_chunks::<2>();
    for (x, y) in w.iter().zip(ys) {
        let (qs, _) = x.qs.as_chunks::<16>();
        // For the Q8_0 block b, bytes qs[16b..16b+16] hold sub-blocks 2b (bytes 0..8: low
        // nibbles are elements 0..8, high nibbles 8..16) and 2b + 1 (bytes 8..16).
        let mut p = [_mm256_setzero_si256(); 2];
        for (b, pb) in p.iter_mut().enumerate() {
            let v = ld128(&qs[b]);
            let lo = _mm_shuffle_epi8(t, _mm_and_si128(v, m4));
            let hi = _mm_shuffle_epi8(t, _mm_and_si128(_mm_srli_epi16::<4>(v), m4));
            let tv = _mm256_set_m128i(_mm_unpackhi_epi64(lo, hi), _mm_unpacklo_epi64(lo, hi));
            *pb = dot_t_i8(tv, ld256i(&y[b].qs));
        }
        // Lanes 0..4 of p[b] belong to sub-block 2b, lanes 4..8 to 2b + 1. Two hadds leave,
        // per 128-bit half, [Σ p0 quarter, Σ p1 quarter, …].
        let h = _mm256_hadd_epi32(p[0], p[1]);
        let h: [i32; 8] = bytemuck::cast(_mm256_hadd_epi32(h, h));
        let sums = [h[0], h[4], h[1], h[5]];
        for (s, &isum) in sums.iter().enumerate() {
            sumf += nvfp4_term(isum, x.d[s], h2f(y[s / 2].d));
        }
    }
    sumf
}

/// The scales and mins of a Q4_K / Q5_K super-block with ggml's `kmask` word operations: the
/// values of [`super::scalar::k4_scales_mins`] (the bit-exact tests against the scalar kernels
/// check it) in a dozen integer instructions instead of a byte loop.
#[inline]
pub(super) fn k4_scales_mins_u32(s: &[u8; 12]) -> ([u8; 8], [u8; 8]) {
    const K1: u32 = 0x3f3f_3f3f;
    const K2: u32 = 0x0f0f_0f0f;
    const K3: u32 = 0x0303_0303;
    let (w, _) = s.as_chunks::<4>();
    let [u0, u1, u2] = [0, 1, 2].map(|i| u32::from_le_bytes(w[i]));
    let sc_lo = u0 & K1;
    let sc_hi = (u2 & K2) | (((u0 >> 6) & K3) << 4);
    let m_lo = u1 & K1;
    let m_hi = ((u2 >> 4) & K2) | (((u1 >> 6) & K3) << 4);
    let pack = |lo: u32, hi: u32| (u64::from(lo) | (u64::from(hi) << 32)).to_le_bytes();
    (pack(sc_lo, sc_hi), pack(m_lo, m_hi))
}

/// `Σ bsums[j] · mins[j / 2]` (the min correction of Q4_K / Q5_K).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn k4_summs(y: &BlockQ8K, mins: &[u8; 8]) -> i32 {
    let bs = ld256(bytemuck::cast_ref::<[[u8; 2]; 16], [u8; 32]>(&y.bsums));
    let m = _mm_cvtepu8_epi16(_mm_set_epi64x(0, i64::from_le_bytes(*mins)));
    // [m0, 0, m1, 0, …] as i16 → [m0, m0, m1, m1, …].
    let m = _mm256_cvtepu16_epi32(m);
    let m = _mm256_or_si256(m, _mm256_slli_epi32::<16>(m));
    hsum_i32(_mm256_madd_epi16(bs, m))
}

/// A 16-bit scale in every lane of the low 128 bits and another in the high 128 bits.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn scales2(lo: i16, hi: i16) -> __m256i {
    _mm256_set_m128i(_mm_set1_epi16(hi), _mm_set1_epi16(lo))
}

/// From eight i16 scales in both 128-bit halves of `sv`, scale `2j` in every lane of the low
/// half and scale `2j + 1` in every lane of the high half (one `vpshufb`): the scales of two
/// 16-value sub-blocks that share a 32-byte register.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn scale_pair(sv: __m256i, j: usize) -> __m256i {
    let b = u8::try_from(4 * j).unwrap_or(0);
    let lo = i16::from_le_bytes([b, b + 1]);
    let hi = i16::from_le_bytes([b + 2, b + 3]);
    _mm256_shuffle_epi8(sv, scales2(lo, hi))
}

/// Sixteen i16 scales in `v` → those of half `h` (0 or 1) in both 128-bit halves.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn half_scales(v: __m256i, h: usize) -> __m256i {
    if h == 0 {
        _mm256_permute2x128_si256::<0x00>(v, v)
    } else {
        _mm256_permute2x128_si256::<0x11>(v, v)
    }
}

/// The integer sum of a Q4_K / Q5_K super-block; `qh` holds the fifth bits of Q5_K.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn k4_isum(qs: &[u8; 128], qh: Option<&[u8; 32]>, sc: &[u8; 8], y: &BlockQ8K) -> i32 {
    let (qs, _) = qs.as_chunks::<32>();
    let (ys, _) = y.qs.as_chunks::<32>();
    let m4 = splat(0x0F);
    let mut acc = _mm256_setzero_si256();
    for c in 0..4 {
        let q = ld256(&qs[c]);
        let mut lo = _mm256_and_si256(q, m4);
        let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(q), m4);
        if let Some(h) = qh {
            let h = ld256(h);
            // The fifth bit of element 64c + l is bit 2c of qh[l], that of 64c + 32 + l bit 2c + 1.
            let b0 = splat(1 << (2 * c));
            let b1 = splat(1 << (2 * c + 1));
            let x10 = splat(0x10);
            let h0 = _mm256_cmpeq_epi8(_mm256_and_si256(h, b0), b0);
            let h1 = _mm256_cmpeq_epi8(_mm256_and_si256(h, b1), b1);
            lo = _mm256_or_si256(lo, _mm256_and_si256(h0, x10));
            hi = _mm256_or_si256(hi, _mm256_and_si256(h1, x10));
        }
        // Codes < 32, scales < 64: maddubs pairs < 2¹³, madd pairs < 2²⁰, the lane sums < 2²³.
        let plo = _mm256_maddubs_epi16(lo, ld256i(&ys[2 * c]));
        let phi = _mm256_maddubs_epi16(hi, ld256i(&ys[2 * c + 1]));
        let slo = _mm256_set1_epi16(i16::from(sc[2 * c]));
        let shi = _mm256_set1_epi16(i16::from(sc[2 * c + 1]));
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(plo, slo));
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(phi, shi));
    }
    hsum_i32(acc)
}

/// Q4_K · Q8_K.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn q4_k_q8_k(w: &[BlockQ4K], a: &[BlockQ8K]) -> f32 {
    let mut sumf = 0.0f32;
    for (x, y) in w.iter().zip(a) {
        let (sc, m) = k4_scales_mins_u32(&x.scales);
        let isum = k4_isum(&x.qs, None, &sc, y);
        let summs = k4_summs(y, &m);
        sumf += kmin_term(isum, summs, h2f(x.d), h2f(x.dmin), y.d.get());
    }
    sumf
}

/// Q5_K · Q8_K.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn q5_k_q8_k(w: &[BlockQ5K], a: &[BlockQ8K]) -> f32 {
    let mut sumf = 0.0f32;
    for (x, y) in w.iter().zip(a) {
        let (sc, m) = k4_scales_mins_u32(&x.scales);
        let isum = k4_isum(&x.qs, Some(&x.qh), &sc, y);
        let summs = k4_summs(y, &m);
        sumf += kmin_term(isum, summs, h2f(x.d), h2f(x.dmin), y.d.get());
    }
    sumf
}

/// Q6_K · Q8_K.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn q6_k_q8_k(w: &[BlockQ6K], a: &[BlockQ8K]) -> f32 {
    let m4 = splat(0x0F);
    let m30 = splat(0x30);
    let mut sumf = 0.0f32;
    for (x, y) in w.iter().zip(a) {
        let (ql, _) = x.ql.as_chunks::<32>();
        let (qh, _) = x.qh.as_chunks::<32>();
        let (ys, _) = y.qs.as_chunks::<32>();
        let scales = _mm256_cvtepi8_epi16(ld128i(&x.scales));
        let mut acc = _mm256_setzero_si256();
        for h in 0..2 {
            let sv = half_scales(scales, h);
            let qa = ld256(&ql[2 * h]);
            let qb = ld256(&ql[2 * h + 1]);
            let qhv = ld256(&qh[h]);
            // Bits 4 and 5 of each byte after a 16-bit shift come from the same byte, so the
            // shifts put qh's bit pairs 0, 1, 2, 3 into place for groups 0, 1, 2, 3.
            let codes = [
                _mm256_or_si256(
                    _mm256_and_si256(qa, m4),
                    _mm256_and_si256(_mm256_slli_epi16::<4>(qhv), m30),
                ),
                _mm256_or_si256(
                    _mm256_and_si256(qb, m4),
                    _mm256_and_si256(_mm256_slli_epi16::<2>(qhv), m30),
                ),
                _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16::<4>(qa), m4),
                    _mm256_and_si256(qhv, m30),
                ),
                _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16::<4>(qb), m4),
                    _mm256_and_si256(_mm256_srli_epi16::<2>(qhv), m30),
                ),
            ];
            for (g, &u) in codes.iter().enumerate() {
                let yv = ld256i(&ys[4 * h + g]);
                // (u − 32)·y pairs are at most 2·32·128 = 2¹³; times a scale ≥ −128, 2²¹.
                let p = _mm256_sub_epi16(
                    _mm256_maddubs_epi16(u, yv),
                    _mm256_maddubs_epi16(splat(32), yv),
                );
                acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, scale_pair(sv, g)));
            }
        }
        sumf += k_term(hsum_i32(acc), h2f(x.d), y.d.get());
    }
    sumf
}

/// Q2_K · Q8_K.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn q2_k_q8_k(w: &[BlockQ2K], a: &[BlockQ8K]) -> f32 {
    let m3 = splat(3);
    let m4 = _mm_set1_epi8(0x0F);
    let mut sumf = 0.0f32;
    for (x, y) in w.iter().zip(a) {
        let sc = ld128(&x.scales);
        // Σ bsums[j]·min_j, the mins being the high nibbles of the sixteen scale bytes.
        let bs = ld256(bytemuck::cast_ref::<[[u8; 2]; 16], [u8; 32]>(&y.bsums));
        let mins = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16::<4>(sc), m4));
        let summs = hsum_i32(_mm256_madd_epi16(bs, mins));
        let scales = _mm256_cvtepu8_epi16(_mm_and_si128(sc, m4));
        let (qs, _) = x.qs.as_chunks::<32>();
        let (ys, _) = y.qs.as_chunks::<32>();
        let mut acc = _mm256_setzero_si256();
        for (h, q) in qs.iter().enumerate() {
            let q = ld256(q);
            let sv = half_scales(scales, h);
            for j in 0..4 {
                // Element 128h + 32j + l is bits 2j..2j+2 of qs[32h + l]; elements 16 apart
                // share a scale (low nibble of scales[8h + 2j], then [8h + 2j + 1]).
                let shift = _mm_cvtsi32_si128(i32::try_from(2 * j).unwrap_or(0));
                let u = _mm256_and_si256(_mm256_srl_epi16(q, shift), m3);
                let p = _mm256_maddubs_epi16(u, ld256i(&ys[4 * h + j]));
                acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, scale_pair(sv, j)));
            }
        }
        sumf += kmin_term(hsum_i32(acc), summs, h2f(x.d), h2f(x.dmin), y.d.get());
    }
    sumf
}

/// The sixteen 6-bit Q3_K scales (before the −32) with ggml's `kmask` word operations: the
/// values of [`super::scalar::q3k_scales`] (the bit-exact tests against the scalar kernels
/// check it).
#[inline]
fn q3k_scale_bytes(s: &[u8; 12]) -> [u8; 16] {
    const K1: u32 = 0x0303_0303;
    const K2: u32 = 0x0f0f_0f0f;
    let (w, _) = s.as_chunks::<4>();
    let [a0, a1, t] = [0, 1, 2].map(|i| u32::from_le_bytes(w[i]));
    let out = [
        (a0 & K2) | ((t & K1) << 4),
        (a1 & K2) | (((t >> 2) & K1) << 4),
        ((a0 >> 4) & K2) | (((t >> 4) & K1) << 4),
        ((a1 >> 4) & K2) | (((t >> 6) & K1) << 4),
    ];
    bytemuck::cast(out.map(u32::to_le_bytes))
}

/// Q3_K · Q8_K.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn q3_k_q8_k(w: &[BlockQ3K], a: &[BlockQ8K]) -> f32 {
    let m3 = splat(3);
    let one = splat(1);
    let mut sumf = 0.0f32;
    for (x, y) in w.iter().zip(a) {
        let scales = _mm256_sub_epi16(
            _mm256_cvtepu8_epi16(ld128(&q3k_scale_bytes(&x.scales))),
            _mm256_set1_epi16(32),
        );
        let (qs, _) = x.qs.as_chunks::<32>();
        let (ys, _) = y.qs.as_chunks::<32>();
        let hm = ld256(&x.hmask);
        let mut acc = _mm256_setzero_si256();
        for (h, q) in qs.iter().enumerate() {
            let q = ld256(q);
            let sv = half_scales(scales, h);
            for j in 0..4 {
                // Element 128h + 32j + l: two low bits from qs[32h + l] at 2j, the third from
                // hmask[l] at 4h + j; the code is (low | third << 2) − 4, in −4..4.
                let lo_shift = _mm_cvtsi32_si128(i32::try_from(2 * j).unwrap_or(0));
                let hi_shift = _mm_cvtsi32_si128(i32::try_from(4 * h + j).unwrap_or(0));
                let lo = _mm256_and_si256(_mm256_srl_epi16(q, lo_shift), m3);
                let hi = _mm256_and_si256(_mm256_srl_epi16(hm, hi_shift), one);
                let u = _mm256_or_si256(lo, _mm256_slli_epi16::<2>(hi));
                let yv = ld256i(&ys[4 * h + j]);
                // (u − 4)·y pairs ≤ 2·4·128; times a scale in −32..32, far inside i32.
                let p = _mm256_sub_epi16(
                    _mm256_maddubs_epi16(u, yv),
                    _mm256_maddubs_epi16(splat(4), yv),
                );
                acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, scale_pair(sv, j)));
            }
        }
        sumf += k_term(hsum_i32(acc), h2f(x.d), y.d.get());
    }
    sumf
}

/// IQ4_XS · Q8_K.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn iq4_xs_q8_k(w: &[BlockIq4Xs], a: &[BlockQ8K]) -> f32 {
    let t = table256(&KVALUES_IQ4NL);
    let mut sumf = 0.0f32;
    for (x, y) in w.iter().zip(a) {
        let ls = iq4xs_scales(x).map(|v| i16::try_from(v).unwrap_or(0));
        let (qs, _) = x.qs.as_chunks::<16>();
        let (ys, _) = y.qs.as_chunks::<32>();
        let mut acc = _mm256_setzero_si256();
        for ((q, yb), &s) in qs.iter().zip(ys).zip(&ls) {
            // Sub-block ib is laid out as an IQ4_NL block; pairs ≤ 2·128·127, scales in −32..32.
            let tv = _mm256_shuffle_epi8(t, nibbles(q));
            let yv = ld256i(yb);
            let p = _mm256_maddubs_epi16(_mm256_abs_epi8(yv), _mm256_sign_epi8(tv, yv));
            acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(s)));
        }
        sumf += k_term(hsum_i32(acc), h2f(x.d), y.d.get());
    }
    sumf
}

/// Runs a float dot product with the lanes and the order of the AVX-512 kernel
/// (`avx512::float_dot`), so both levels give the same bits: each 16-lane accumulator of that
/// kernel is two 8-lane halves here. `$load` turns a chunk of 8 weights into f32 lanes; four
/// accumulators over 64-value chunks, one over the 16-value chunks left, the last few values
/// padded with zeros into one more 16-value chunk, and the lane sum of `hsum16`.
macro_rules! float_dot {
    ($w:expr, $a:expr, $wty:ty, $zero:expr, |$c:ident| $load:expr) => {{
        let (w64, wr) = $w.as_chunks::<64>();
        let (a64, ar) = $a.as_chunks::<64>();
        let mut acc = [[_mm256_setzero_ps(); 2]; 4];
        for (wc, ac) in w64.iter().zip(a64) {
            let (wc, _) = wc.as_chunks::<8>();
            let (ac, _) = ac.as_chunks::<8>();
            for k in 0..8 {
                let $c = &wc[k];
                acc[k / 2][k % 2] = _mm256_fmadd_ps($load, ld_ps(&ac[k]), acc[k / 2][k % 2]);
            }
        }
        let (w16, wt) = wr.as_chunks::<16>();
        let (a16, at) = ar.as_chunks::<16>();
        for (wc, ac) in w16.iter().zip(a16) {
            let (wc, _) = wc.as_chunks::<8>();
            let (ac, _) = ac.as_chunks::<8>();
            for h in 0..2 {
                let $c = &wc[h];
                acc[0][h] = _mm256_fmadd_ps($load, ld_ps(&ac[h]), acc[0][h]);
            }
        }
        if !wt.is_empty() {
            let mut wp: [$wty; 16] = [$zero; 16];
            let mut ap = [0.0f32; 16];
            wp[..wt.len()].copy_from_slice(wt);
            ap[..at.len()].copy_from_slice(at);
            let (wc, _) = wp.as_chunks::<8>();
            let (ac, _) = ap.as_chunks::<8>();
            for h in 0..2 {
                let $c = &wc[h];
                acc[1][h] = _mm256_fmadd_ps($load, ld_ps(&ac[h]), acc[1][h]);
            }
        }
        let half = |h: usize| {
            _mm256_add_ps(
                _mm256_add_ps(acc[0][h], acc[1][h]),
                _mm256_add_ps(acc[2][h], acc[3][h]),
            )
        };
        hsum16(half(0), half(1))
    }};
}

/// f32 · f32, in f32 lanes with FMA.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn f32_f32(w: &[f32], a: &[f32]) -> f32 {
    float_dot!(w, a, f32, 0.0, |c| ld_ps(c))
}

/// f16 · f32, in f32 lanes with FMA.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn f16_f32(w: &[Half], a: &[f32]) -> f32 {
    float_dot!(w, a, Half, Half::default(), |c| _mm256_cvtph_ps(ld128(
        bytemuck::cast_ref::<[Half; 8], [u8; 16]>(c)
    )))
}

/// bf16 · f32, in f32 lanes with FMA.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn bf16_f32(w: &[[u8; 2]], a: &[f32]) -> f32 {
    float_dot!(w, a, [u8; 2], [0, 0], |c| _mm256_castsi256_ps(
        _mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(ld128(bytemuck::cast_ref::<
            [[u8; 2]; 8],
            [u8; 16],
        >(c))))
    ))
}
