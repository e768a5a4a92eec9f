//! Scalar reference dot products: slow, obviously right, and the definition every SIMD kernel is
//! tested against.
//!
//! Each quantized dot product follows `ggml_vec_dot_<w>_<a>_generic` in ggml-cpu's `quants.c`:
//! an exact integer sum over each block (`isum`), then one f32 term per block, added to `sumf` in
//! block order. The term's formula (which scale is multiplied first, where the min enters) is
//! written once, in the `*_term` functions below; the SIMD kernels call them for single blocks
//! and repeat their operations lane by lane for groups of blocks, so a SIMD kernel that produces
//! the same integer sums produces the same bits (the tests check this bit for bit). For Q3_K …
//! Q6_K ggml's generic C spreads a super-block over eight f32 partial sums; here each super-block
//! is one term, `d·isum` (minus `dmin·summs` where there are mins) — the same value up to the
//! last bit.
//!
//! The float dot products (`f32`/`f16`/`bf16` weights against f32 activations) follow
//! ggml-cpu's `vec.cpp` generic paths: each product is rounded to f32 and the sum is kept in f64
//! (`ggml_float`), rounded to f32 once at the end. SIMD kernels keep f32 lanes instead and agree
//! to within the rounding of a sum of `n` terms (see the tests).
//!
//! Every function here panics if the activation row does not have the length the weight row
//! needs (the same number of blocks; twice as many Q8_0 blocks for NVFP4).

use crate::blocks::{
    BlockIq4Nl, BlockIq4Xs, BlockMxfp4, BlockNvfp4, BlockQ2K, BlockQ3K, BlockQ4_0, BlockQ4_1,
    BlockQ4K, BlockQ5_0, BlockQ5_1, BlockQ5K, BlockQ6K, BlockQ8_0, BlockQ8_1, BlockQ8K, Half,
};

// The codebooks and scale decoders are the format modules' own, so a dot product and a
// dequantized row can never disagree about a value.
pub(crate) use crate::fp4::{KVALUES_FP4, e8m0_to_fp32_half, ue4m3_to_fp32_half};
pub(crate) use crate::iq4::KVALUES_IQ4NL;

/// The eight 6-bit sub-block scales and mins of a Q4_K / Q5_K super-block
/// (`get_scale_min_k4` in `ggml-quants.c`).
#[must_use]
#[inline]
pub(crate) fn k4_scales_mins(s: &[u8; 12]) -> ([u8; 8], [u8; 8]) {
    let mut sc = [0u8; 8];
    let mut m = [0u8; 8];
    for j in 0..4 {
        sc[j] = s[j] & 63;
        m[j] = s[j + 4] & 63;
    }
    for j in 4..8 {
        sc[j] = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
        m[j] = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
    (sc, m)
}

/// The sixteen signed sub-block scales (`6-bit − 32`) of a Q3_K super-block: low four bits from
/// `scales[0..8]` (low nibble for j < 8, high nibble for j ≥ 8), high two bits from
/// `scales[8 + j % 4]` at bit `2·(j / 4)` — the `kmask` shuffle of ggml's `q3_K` kernels.
#[must_use]
#[inline]
pub(crate) fn q3k_scales(s: &[u8; 12]) -> [i32; 16] {
    let mut out = [0i32; 16];
    for (j, o) in out.iter_mut().enumerate() {
        let lo = if j < 8 { s[j] & 0xF } else { s[j - 8] >> 4 };
        let hi = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
        *o = i32::from(lo | (hi << 4)) - 32;
    }
    out
}

/// The eight signed sub-block scales (`6-bit − 32`) of an IQ4_XS super-block.
#[must_use]
#[inline]
pub(crate) fn iq4xs_scales(b: &BlockIq4Xs) -> [i32; 8] {
    let h = u16::from_le_bytes(b.scales_h);
    let mut out = [0i32; 8];
    for (ib, o) in out.iter_mut().enumerate() {
        let lo = (b.scales_l[ib / 2] >> (4 * (ib % 2))) & 0xF;
        let hi = (h >> (2 * ib)) & 3;
        *o = i32::from(u16::from(lo) | (hi << 4)) - 32;
    }
    out
}

/// The sixteen 16-value partial sums of a Q8_K block.
#[must_use]
#[inline]
pub(crate) fn q8k_bsums(a: &BlockQ8K) -> [i16; 16] {
    a.bsums.map(i16::from_le_bytes)
}

/// `Σ bsums[j] · mins[j / 2]`: the min correction of Q4_K / Q5_K.
#[must_use]
#[inline]
pub(crate) fn k4_summs(a: &BlockQ8K, mins: &[u8; 8]) -> i32 {
    q8k_bsums(a)
        .iter()
        .enumerate()
        .map(|(j, &b)| i32::from(b) * i32::from(mins[j / 2]))
        .sum()
}

// The per-block terms. `sumf += term` in block order is the whole accumulation; the SIMD kernels
// call these same functions with the same integer sums.

/// Q4_0 · Q8_0: `isum · d_w · d_a`.
#[must_use]
#[inline(always)]
pub(crate) fn q4_0_term(isum: i32, dw: f32, da: f32) -> f32 {
    isum as f32 * dw * da
}

/// Q4_1 / Q5_1 · Q8_1: `d_w·d_a · isum + m_w · s_a`.
#[must_use]
#[inline(always)]
pub(crate) fn q_1_term(isum: i32, dw: f32, mw: f32, da: f32, sa: f32) -> f32 {
    dw * da * isum as f32 + mw * sa
}

/// Q5_0 · Q8_0: `d_w·d_a · isum`.
#[must_use]
#[inline(always)]
pub(crate) fn q5_0_term(isum: i32, dw: f32, da: f32) -> f32 {
    dw * da * isum as f32
}

/// Q8_0 · Q8_0: `isum · (d_w·d_a)`.
#[must_use]
#[inline(always)]
pub(crate) fn q8_0_term(isum: i32, dw: f32, da: f32) -> f32 {
    isum as f32 * (dw * da)
}

/// IQ4_NL · Q8_0: `(d_a·d_w) · isum`.
#[must_use]
#[inline(always)]
pub(crate) fn iq4_nl_term(isum: i32, dw: f32, da: f32) -> f32 {
    da * dw * isum as f32
}

/// MXFP4 · Q8_0: `(d_a · e8m0_half(e)) · isum`.
#[must_use]
#[inline(always)]
pub(crate) fn mxfp4_term(isum: i32, e: u8, da: f32) -> f32 {
    da * e8m0_to_fp32_half(e) * isum as f32
}

/// NVFP4 · Q8_0, per 16-value sub-block: `(d_a · ue4m3_half(d_s)) · isum_s`.
#[must_use]
#[inline(always)]
pub(crate) fn nvfp4_term(isum: i32, ds: u8, da: f32) -> f32 {
    da * ue4m3_to_fp32_half(ds) * isum as f32
}

/// Q2_K / Q4_K / Q5_K · Q8_K: `d_w·d_a · isum − dmin_w·d_a · summs`.
#[must_use]
#[inline(always)]
pub(crate) fn kmin_term(isum: i32, summs: i32, dw: f32, dminw: f32, da: f32) -> f32 {
    let d = dw * da;
    let dmin = dminw * da;
    d * isum as f32 - dmin * summs as f32
}

/// Q3_K / Q6_K / IQ4_XS · Q8_K: `d_w·d_a · isum`.
#[must_use]
#[inline(always)]
pub(crate) fn k_term(isum: i32, dw: f32, da: f32) -> f32 {
    dw * da * isum as f32
}

/// f64 → f32 at the end of a float dot product.
#[inline]
#[allow(
    clippy::cast_possible_truncation,
    reason = "rounding the f64 accumulator to the f32 result is the intended last step"
)]
fn round_f32(x: f64) -> f32 {
    x as f32
}

fn check(w: usize, a: usize, per: usize) {
    assert_eq!(
        w * per,
        a,
        "dot product: {w} weight blocks need {} activation blocks, got {a}",
        w * per
    );
}

/// Q4_0 · Q8_0.
#[must_use]
pub fn q4_0_q8_0(w: &[BlockQ4_0], a: &[BlockQ8_0]) -> f32 {
    check(w.len(), a.len(), 1);
    let mut sumf = 0.0f32;
    for (x, y) in w.iter().zip(a) {
        let mut isum = 0i32;
        for j in 0..16 {
            let v0 = i32::from(x.qs[j] & 0xF) - 8;
            let v1 = i32::from(x.qs[j] >> 4) - 8;
            isum += v0 * i32::from(y.qs[j]) + v1 * i32::from(y.qs[j + 16]);
        }
        sumf += q4_0_term(isum, x.d.to_f32(), y.d.to_f32());
    }
    sumf
}

/// Q4_1 · Q8_1 (uses the activation's stored `s = d·Σq` for the min, as ggml does).
#[must_use]
pub fn q4_1_q8_1(w: &[BlockQ4_1], a: &[BlockQ8_1]) -> f32 {
    check(w.len(), a.len(), 1);
    let mut sumf = 0.0f32;
    for (x, y) in w.iter().zip(a) {
        let mut isum = 0i32;
        for j in 0..16 {
            let v0 = i32::from(x.qs[j] & 0xF);
            let v1 = i32::from(x.qs[j] >> 4);
            isum += v0 * i32::from(y.qs[j]) + v1 * i32::from(y.qs[j + 16]);
        }
        sumf += q_1_term(isum, x.d.to_f32(), x.m.to_f32(), y.d.to_f32(), y.s.to_f32());
    }
    sumf
}

/// The 5-bit codes (0..32) of a Q5_0 / Q5_1 block in element order.
#[inline]
fn q5_codes(qs: &[u8; 16], qh: [u8; 4]) -> [i32; 32] {
    let qh = u32::from_le_bytes(qh);
    let mut v = [0i32; 32];
    for j in 0..16 {
        let h0 = i32::from((qh >> j) & 1 == 1) << 4;
        let h1 = i32::from((qh >> (j + 16)) & 1 == 1) << 4;
        v[j] = i32::from(qs[j] & 0xF) | h0;
        v[j + 16] = i32::from(qs[j] >> 4) | h1;
    }
    v
}

/// Q5_0 · Q8_0.
#[must_use]
pub fn q5_0_q8_0(w: &[BlockQ5_0], a: &[BlockQ8_0]) -> f32 {
    check(w.len(), a.len(), 1);
    let mut sumf = 0.0f32;
    for (x, y) in w.iter().zip(a) {
        let v = q5_codes(&x.qs, x.qh);
        let isum: i32 = v
            .iter()
            .zip(&y.qs)
            .map(|(&q, &b)| (q - 16) * i32::from(b))
            .sum();
        sumf += q5_0_term(isum, x.d.to_f32(), y.d.to_f32());
    }
    sumf
}

/// Q5_1 · Q8_1.
#[must_use]
pub fn q5_1_q8_1(w: &[BlockQ5_1], a: &[BlockQ8_1]) -> f32 {
    check(w.len(), a.len(), 1);
    let mut sumf = 0.0f32;
    for (x, y) in w.iter().zip(a) {
        let v = q5_codes(&x.qs, x.qh);
        let isum: i32 = v.iter().zip(&y.qs).map(|(&q, &b)| q * i32::from(b)).sum();
        sumf += q_1_term(isum, x.d.to_f32(), x.m.to_f32(), y.d.to_f32(), y.s.to_f32());
    }
    sumf
}

/// Q8_0 · Q8_0.
#[must_use]
pub fn q8_0_q8_0(w: &[BlockQ8_0], a: &[BlockQ8_0]) -> f32 {
    check(w.len(), a.len(), 1);
    let mut sumf = 0.0f32;
    for (x, y) in w.iter().zip(a) {
        let isum: i32 =
            x.qs.iter()
                .zip(&y.qs)
                .map(|(&p, &q)| i32::from(p) * i32::from(q))
                .sum();
        sumf += q8_0_term(isum, x.d.to_f32(), y.d.to_f32());
    }
    sumf
}

/// `Σ table[nibble] · y` over one 32-value block laid out as Q4_0 (low nibbles first).
#[inline]
fn table_isum(table: &[i8; 16], qs: &[u8; 16], y: &[i8]) -> i32 {
    let mut isum = 0i32;
    for j in 0..16 {
        isum += i32::from(table[usize::from(qs[j] & 0xF)]) * i32::from(y[j]);
        isum += i32::from(table[usize::from(qs[j] >> 4)]) * i32::from(y[j + 16]);
    }
    isum
}

/// IQ4_NL · Q8_0.
#[must_use]
pub fn iq4_nl_q8_0(w: &[BlockIq4Nl], a: &[BlockQ8_0]) -> f32 {
    check(w.len(), a.len(), 1);
    let mut sumf = 0.0f32;
    for (x, y) in w.iter().zip(a) {
        let isum = table_isum(&KVALUES_IQ4NL, &x.qs, &y.qs);
        sumf += iq4_nl_term(isum, x.d.to_f32(), y.d.to_f32());
    }
    sumf
}

/// MXFP4 · Q8_0.
#[must_use]
pub fn mxfp4_q8_0(w: &[BlockMxfp4], a: &[BlockQ8_0]) -> f32 {
    check(w.len(), a.len(), 1);
    let mut sumf = 0.0f32;
    for (x, y) in w.iter().zip(a) {
        let isum = table_isum(&KVALUES_FP4, &x.qs, &y.qs);
        sumf += mxfp4_term(isum, x.e, y.d.to_f32());
    }
    sumf
}

/// NVFP4 · Q8_0: each 64-value weight block meets two Q8_0 blocks; each 16-value sub-block has
/// its own UE4M3 scale, and adds its own term (`ggml_vec_dot_nvfp4_q8_0_generic`). The
/// per-tensor scale of NVFP4 weights is not part of the row; the caller applies it.
#[must_use]
pub fn nvfp4_q8_0(w: &[BlockNvfp4], a: &[BlockQ8_0]) -> f32 {
    check(w.len(), a.len(), 2);
    let mut sumf = 0.0f32;
    for (x, y) in w.iter().zip(a.chunks_exact(2)) {
        for s in 0..4 {
            let yb = &y[s / 2];
            let off = (s % 2) * 16;
            let mut isum = 0i32;
            for j in 0..8 {
                let q = x.qs[s * 8 + j];
                isum += i32::from(KVALUES_FP4[usize::from(q & 0xF)]) * i32::from(yb.qs[off + j]);
                isum += i32::from(KVALUES_FP4[usize::from(q >> 4)]) * i32::from(yb.qs[off + 8 + j]);
            }
            sumf += nvfp4_term(isum, x.d[s], yb.d.to_f32());
        }
    }
    sumf
}

/// Q2_K · Q8_K.
#[must_use]
pub fn q2_k_q8_k(w: &[BlockQ2K], a: &[BlockQ8K]) -> f32 {
    check(w.len(), a.len(), 1);
    let mut sumf = 0.0f32;
    for (x, y) in w.iter().zip(a) {
        let summs: i32 = q8k_bsums(y)
            .iter()
            .zip(&x.scales)
            .map(|(&b, &sc)| i32::from(b) * i32::from(sc >> 4))
            .sum();
        let mut isum = 0i32;
        for half in 0..2 {
            let q2 = &x.qs[32 * half..32 * half + 32];
            for j in 0..4 {
                let shift = 2 * j;
                let base = 128 * half + 32 * j;
                for (g, l0) in [(0usize, 0usize), (1, 16)] {
                    let d = i32::from(x.scales[8 * half + 2 * j + g] & 0xF);
                    let isuml: i32 = q2[l0..l0 + 16]
                        .iter()
                        .zip(&y.qs[base + l0..base + l0 + 16])
                        .map(|(&q, &b)| i32::from(b) * i32::from((q >> shift) & 3))
                        .sum();
                    isum += d * isuml;
                }
            }
        }
        sumf += kmin_term(isum, summs, x.d.to_f32(), x.dmin.to_f32(), y.d.get());
    }
    sumf
}

/// Q3_K · Q8_K.
#[must_use]
pub fn q3_k_q8_k(w: &[BlockQ3K], a: &[BlockQ8K]) -> f32 {
    check(w.len(), a.len(), 1);
    let mut sumf = 0.0f32;
    for (x, y) in w.iter().zip(a) {
        let scales = q3k_scales(&x.scales);
        let mut isum = 0i32;
        for half in 0..2 {
            let q3 = &x.qs[32 * half..32 * half + 32];
            for g in 0..4 {
                let m = 1u8 << (4 * half + g);
                let base = 128 * half + 32 * g;
                for l in 0..32 {
                    let lo = i32::from((q3[l] >> (2 * g)) & 3);
                    let q = lo - if x.hmask[l] & m == 0 { 4 } else { 0 };
                    isum += scales[(base + l) / 16] * q * i32::from(y.qs[base + l]);
                }
            }
        }
        sumf += k_term(isum, x.d.to_f32(), y.d.get());
    }
    sumf
}

/// Σ sc_j · Σ q·y over the eight 32-value sub-blocks of a Q4_K / Q5_K super-block, the code of
/// element `e` being `code(e)`.
#[inline]
fn k4_isum(sc: &[u8; 8], y: &BlockQ8K, code: impl Fn(usize) -> i32) -> i32 {
    let mut isum = 0i32;
    for (j, &s) in sc.iter().enumerate() {
        let mut sub = 0i32;
        for l in 0..32 {
            let e = 32 * j + l;
            sub += code(e) * i32::from(y.qs[e]);
        }
        isum += i32::from(s) * sub;
    }
    isum
}

/// Q4_K · Q8_K.
#[must_use]
pub fn q4_k_q8_k(w: &[BlockQ4K], a: &[BlockQ8K]) -> f32 {
    check(w.len(), a.len(), 1);
    let mut sumf = 0.0f32;
    for (x, y) in w.iter().zip(a) {
        let (sc, m) = k4_scales_mins(&x.scales);
        // Element 64c + l is the low nibble of qs[32c + l], element 64c + 32 + l the high one.
        let isum = k4_isum(&sc, y, |e| {
            let (c, r) = (e / 64, e % 64);
            let b = x.qs[32 * c + r % 32];
            i32::from(if r < 32 { b & 0xF } else { b >> 4 })
        });
        let summs = k4_summs(y, &m);
        sumf += kmin_term(isum, summs, x.d.to_f32(), x.dmin.to_f32(), y.d.get());
    }
    sumf
}

/// Q5_K · Q8_K.
#[must_use]
pub fn q5_k_q8_k(w: &[BlockQ5K], a: &[BlockQ8K]) -> f32 {
    check(w.len(), a.len(), 1);
    let mut sumf = 0.0f32;
    for (x, y) in w.iter().zip(a) {
        let (sc, m) = k4_scales_mins(&x.scales);
        // As Q4_K for the low four bits; the fifth bit of element 64c + l is bit 2c of qh[l],
        // that of element 64c + 32 + l bit 2c + 1.
        let isum = k4_isum(&sc, y, |e| {
            let (c, r) = (e / 64, e % 64);
            let b = x.qs[32 * c + r % 32];
            let lo = if r < 32 { b & 0xF } else { b >> 4 };
            let hi = (x.qh[r % 32] >> (2 * c + r / 32)) & 1;
            i32::from(lo | (hi << 4))
        });
        let summs = k4_summs(y, &m);
        sumf += kmin_term(isum, summs, x.d.to_f32(), x.dmin.to_f32(), y.d.get());
    }
    sumf
}

/// Q6_K · Q8_K.
#[must_use]
pub fn q6_k_q8_k(w: &[BlockQ6K], a: &[BlockQ8K]) -> f32 {
    check(w.len(), a.len(), 1);
    let mut sumf = 0.0f32;
    for (x, y) in w.iter().zip(a) {
        let mut isum = 0i32;
        for half in 0..2 {
            let ql = &x.ql[64 * half..64 * half + 64];
            let qh = &x.qh[32 * half..32 * half + 32];
            for l in 0..32 {
                let codes = [
                    (ql[l] & 0xF) | ((qh[l] & 3) << 4),
                    (ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4),
                    (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4),
                    (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4),
                ];
                for (g, &q) in codes.iter().enumerate() {
                    let e = 128 * half + 32 * g + l;
                    let v = i32::from(q) - 32;
                    isum += i32::from(x.scales[e / 16]) * v * i32::from(y.qs[e]);
                }
            }
        }
        sumf += k_term(isum, x.d.to_f32(), y.d.get());
    }
    sumf
}

/// IQ4_XS · Q8_K: one integer sum per super-block, `Σ (ls_j − 32) · Σ kvalues[q]·y`.
#[must_use]
pub fn iq4_xs_q8_k(w: &[BlockIq4Xs], a: &[BlockQ8K]) -> f32 {
    check(w.len(), a.len(), 1);
    let mut sumf = 0.0f32;
    for (x, y) in w.iter().zip(a) {
        let ls = iq4xs_scales(x);
        let (qs, _) = x.qs.as_chunks::<16>();
        let mut isum = 0i32;
        for (ib, (&s, q)) in ls.iter().zip(qs).enumerate() {
            isum += s * table_isum(&KVALUES_IQ4NL, q, &y.qs[32 * ib..32 * ib + 32]);
        }
        sumf += k_term(isum, x.d.to_f32(), y.d.get());
    }
    sumf
}

/// f32 · f32: products rounded to f32, summed in f64 (`ggml_vec_dot_f32`'s generic path).
#[must_use]
pub fn f32_f32(w: &[f32], a: &[f32]) -> f32 {
    check(w.len(), a.len(), 1);
    let s: f64 = w.iter().zip(a).map(|(&x, &y)| f64::from(x * y)).sum();
    round_f32(s)
}

/// f16 · f32: products rounded to f32, summed in f64.
#[must_use]
pub fn f16_f32(w: &[Half], a: &[f32]) -> f32 {
    check(w.len(), a.len(), 1);
    let s: f64 = w
        .iter()
        .zip(a)
        .map(|(&x, &y)| f64::from(x.to_f32() * y))
        .sum();
    round_f32(s)
}

/// The f32 value of a little-endian bf16.
#[must_use]
#[inline]
pub(crate) fn bf16_to_f32(b: [u8; 2]) -> f32 {
    f32::from_bits(u32::from(u16::from_le_bytes(b)) << 16)
}

/// bf16 · f32: products rounded to f32, summed in f64.
#[must_use]
pub fn bf16_f32(w: &[[u8; 2]], a: &[f32]) -> f32 {
    check(w.len(), a.len(), 1);
    let s: f64 = w
        .iter()
        .zip(a)
        .map(|(&x, &y)| f64::from(bf16_to_f32(x) * y))
        .sum();
    round_f32(s)
}
