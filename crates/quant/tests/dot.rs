//! Dot products: every SIMD level against the scalar reference, and the scalar reference
//! against an f64 sum of dequantized values written here from the block layouts
//! (research note `quant.md` §3–4, ggml's `dequantize_row_*`), so a wrong reference cannot hide
//! behind identical SIMD kernels.
//!
//! Blocks are random bytes with their scales forced to finite moderate values (real scales are
//! never NaN or huge), and the rows start at odd byte offsets inside their buffers: blocks have
//! alignment 1, and a row inside a memory-mapped file starts wherever it starts.

use proptest::prelude::*;
use specula_quant::QType;
use specula_quant::blocks::{
    BlockIq4Nl, BlockIq4Xs, BlockMxfp4, BlockNvfp4, BlockQ2K, BlockQ3K, BlockQ4_0, BlockQ4_1,
    BlockQ4K, BlockQ5_0, BlockQ5_1, BlockQ5K, BlockQ6K, BlockQ8_0, BlockQ8_1, BlockQ8K, F32Le,
    Half,
};
use specula_quant::dot::{Kernels, SimdLevel};

/// Every weight format with a dot product.
const WEIGHT_TYPES: &[QType] = &[
    QType::Q4_0,
    QType::Q4_1,
    QType::Q5_0,
    QType::Q5_1,
    QType::Q8_0,
    QType::IQ4_NL,
    QType::MXFP4,
    QType::NVFP4,
    QType::Q2_K,
    QType::Q3_K,
    QType::Q4_K,
    QType::Q5_K,
    QType::Q6_K,
    QType::IQ4_XS,
    QType::F32,
    QType::F16,
    QType::BF16,
];

/// SIMD float dot products keep f32 lanes (and FMA) where the reference sums f32 products in
/// f64; any two summation orders of `n` terms differ by at most `(n − 1)·ε·Σ|terms|` (ε the f32
/// machine epsilon, twice the unit roundoff), and rounding the products adds `ε` per term. The
/// bound used is `(n + FLOAT_SLACK)·ε·Σ|w·a|`.
const FLOAT_SLACK: f64 = 2.0;

/// The scalar reference rounds each block term a few times (scale products, the i32 → f32
/// conversion, the multiply, a subtraction for the min formats) before the f32 running sum;
/// against an exact f64 sum the error is below `(terms + SCALAR_SLACK)·ε·Σ|w_i·a_i|`.
const SCALAR_SLACK: f64 = 6.0;

/// Values per block of the row buffers the test builds, and how many bytes each takes.
fn geometry(ty: QType) -> (usize, usize) {
    (ty.block_size(), ty.type_size())
}

/// A finite f16 of moderate size (2⁻⁸ … 2⁵) from random bits.
fn moderate_half(r: u16) -> Half {
    let exp = 7 + (r >> 10) % 13;
    Half::from_f32(half::f16::from_bits((r & 0x83FF) | (exp << 10)).to_f32())
}

/// A finite f32 of moderate size (2⁻¹⁰ … 2³) from random bits.
fn moderate_f32(r: u32) -> f32 {
    let exp = 117 + (r >> 23) % 14;
    f32::from_bits((r & 0x807F_FFFF) | (exp << 23))
}

fn r16(b: [u8; 2]) -> u16 {
    u16::from_le_bytes(b)
}

fn r32(b: [u8; 4]) -> u32 {
    u32::from_le_bytes(b)
}

/// Forces the scale fields of the weight blocks in `bytes` to moderate values.
fn fix_weights(ty: QType, bytes: &mut [u8]) {
    fn each<B: bytemuck::Pod>(bytes: &mut [u8], f: impl Fn(&mut B)) {
        bytemuck::cast_slice_mut::<u8, B>(bytes)
            .iter_mut()
            .for_each(f);
    }
    match ty {
        QType::Q4_0 => each(bytes, |b: &mut BlockQ4_0| b.d = moderate_half(r16(b.d.0))),
        QType::Q4_1 => each(bytes, |b: &mut BlockQ4_1| {
            b.d = moderate_half(r16(b.d.0));
            b.m = moderate_half(r16(b.m.0));
        }),
        QType::Q5_0 => each(bytes, |b: &mut BlockQ5_0| b.d = moderate_half(r16(b.d.0))),
        QType::Q5_1 => each(bytes, |b: &mut BlockQ5_1| {
            b.d = moderate_half(r16(b.d.0));
            b.m = moderate_half(r16(b.m.0));
        }),
        QType::Q8_0 => each(bytes, |b: &mut BlockQ8_0| b.d = moderate_half(r16(b.d.0))),
        QType::IQ4_NL => each(bytes, |b: &mut BlockIq4Nl| b.d = moderate_half(r16(b.d.0))),
        QType::MXFP4 => each(bytes, |b: &mut BlockMxfp4| b.e = 100 + b.e % 51),
        QType::NVFP4 => each(bytes, |b: &mut BlockNvfp4| {
            for d in &mut b.d {
                *d &= 0x7F;
                if *d == 0x7F {
                    *d = 0x7E;
                }
            }
        }),
        QType::Q2_K => each(bytes, |b: &mut BlockQ2K| {
            b.d = moderate_half(r16(b.d.0));
            b.dmin = moderate_half(r16(b.dmin.0));
        }),
        QType::Q3_K => each(bytes, |b: &mut BlockQ3K| b.d = moderate_half(r16(b.d.0))),
        QType::Q4_K => each(bytes, |b: &mut BlockQ4K| {
            b.d = moderate_half(r16(b.d.0));
            b.dmin = moderate_half(r16(b.dmin.0));
        }),
        QType::Q5_K => each(bytes, |b: &mut BlockQ5K| {
            b.d = moderate_half(r16(b.d.0));
            b.dmin = moderate_half(r16(b.dmin.0));
        }),
        QType::Q6_K => each(bytes, |b: &mut BlockQ6K| b.d = moderate_half(r16(b.d.0))),
        QType::IQ4_XS => each(bytes, |b: &mut BlockIq4Xs| b.d = moderate_half(r16(b.d.0))),
        QType::F32 => each(bytes, |b: &mut [u8; 4]| {
            *b = moderate_f32(r32(*b)).to_le_bytes();
        }),
        QType::F16 => each(bytes, |b: &mut Half| *b = moderate_half(r16(b.0))),
        QType::BF16 => each(bytes, |b: &mut [u8; 2]| {
            let f = moderate_f32(u32::from(r16(*b)) << 16);
            *b = r16_of(f.to_bits()).to_le_bytes();
        }),
        _ => unreachable!("{ty} is not a weight type"),
    }
}

/// The high half of an f32's bits (a bf16 that is exactly `f` when `f`'s low half is zero).
fn r16_of(bits: u32) -> u16 {
    u16::try_from(bits >> 16).expect("16 bits")
}

/// Forces the activation blocks in `bytes` to be well-formed: moderate scales, and the derived
/// fields (Q8_1's `s`, Q8_K's `bsums`) consistent with the codes, as the quantizers make them.
fn fix_activations(ty: QType, bytes: &mut [u8]) {
    match ty {
        QType::Q8_0 => bytemuck::cast_slice_mut::<u8, BlockQ8_0>(bytes)
            .iter_mut()
            .for_each(|b| b.d = moderate_half(r16(b.d.0))),
        QType::Q8_1 => bytemuck::cast_slice_mut::<u8, BlockQ8_1>(bytes)
            .iter_mut()
            .for_each(|b| {
                b.d = moderate_half(r16(b.d.0));
                let sum: i32 = b.qs.iter().map(|&q| i32::from(q)).sum();
                b.s = Half::from_f32(b.d.to_f32() * f32::from(i16::try_from(sum).expect("small")));
            }),
        QType::Q8_K => bytemuck::cast_slice_mut::<u8, BlockQ8K>(bytes)
            .iter_mut()
            .for_each(|b| {
                b.d = F32Le::new(moderate_f32(r32(b.d.0)));
                for (j, s) in b.bsums.iter_mut().enumerate() {
                    let sum: i32 = b.qs[16 * j..16 * j + 16]
                        .iter()
                        .map(|&q| i32::from(q))
                        .sum();
                    *s = i16::try_from(sum).expect("small").to_le_bytes();
                }
            }),
        QType::F32 => bytemuck::cast_slice_mut::<u8, [u8; 4]>(bytes)
            .iter_mut()
            .for_each(|b| *b = moderate_f32(r32(*b)).to_le_bytes()),
        _ => unreachable!("{ty} is not an activation type"),
    }
}

// Independent f64 dequantization, from the layouts.

/// One weight value and a bound on the magnitude of what the kernels multiply for it
/// (`|d·sc·q| + |dmin·m|` for the formats with a min, where the two parts are summed apart).
#[derive(Clone, Copy)]
struct Val {
    v: f64,
    mag: f64,
}

fn val(v: f64) -> Val {
    Val { v, mag: v.abs() }
}

fn h(x: Half) -> f64 {
    f64::from(x.to_f32())
}

const E2M1: [f64; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];
const IQ4NL: [f64; 16] = [
    -127.0, -104.0, -83.0, -65.0, -49.0, -35.0, -22.0, -10.0, 1.0, 13.0, 25.0, 38.0, 53.0, 69.0,
    89.0, 113.0,
];

/// Unsigned E4M3 (bias 7, subnormals below exponent 1), the true value.
fn ue4m3(x: u8) -> f64 {
    let exp = i32::from((x >> 3) & 0xF);
    let man = f64::from(x & 7);
    if exp == 0 {
        man / 8.0 * 2f64.powi(-6)
    } else {
        (1.0 + man / 8.0) * 2f64.powi(exp - 7)
    }
}

/// Low nibble of byte j is element j, high nibble element j + 16.
fn split32(qs: &[u8; 16]) -> [u8; 32] {
    let mut e = [0u8; 32];
    for j in 0..16 {
        e[j] = qs[j] & 0xF;
        e[j + 16] = qs[j] >> 4;
    }
    e
}

/// `d`, `dmin`, `scales`, `qh` (Q5_K only), `qs` of a Q4_K / Q5_K block.
type K4Fields = (Half, Half, [u8; 12], Option<[u8; 32]>, [u8; 128]);

fn deq_weights(ty: QType, bytes: &[u8]) -> Vec<Val> {
    let mut out = Vec::new();
    match ty {
        QType::Q4_0 => {
            for b in bytemuck::cast_slice::<u8, BlockQ4_0>(bytes) {
                out.extend(split32(&b.qs).map(|q| val(h(b.d) * (f64::from(q) - 8.0))));
            }
        }
        QType::Q4_1 => {
            // The min enters through Q8_1's `s` (see `min_terms`); only d·q here.
            for b in bytemuck::cast_slice::<u8, BlockQ4_1>(bytes) {
                out.extend(split32(&b.qs).map(|q| val(h(b.d) * f64::from(q))));
            }
        }
        QType::Q5_0 | QType::Q5_1 => {
            let (d, qs, qh) = if ty == QType::Q5_0 {
                let b = bytemuck::cast_slice::<u8, BlockQ5_0>(bytes);
                (
                    b.iter().map(|b| (h(b.d), -16.0)).collect::<Vec<_>>(),
                    b.iter().map(|b| b.qs).collect::<Vec<_>>(),
                    b.iter().map(|b| b.qh).collect::<Vec<_>>(),
                )
            } else {
                let b = bytemuck::cast_slice::<u8, BlockQ5_1>(bytes);
                (
                    b.iter().map(|b| (h(b.d), 0.0)).collect(),
                    b.iter().map(|b| b.qs).collect(),
                    b.iter().map(|b| b.qh).collect(),
                )
            };
            for ((&(d, zero), qs), qh) in d.iter().zip(&qs).zip(&qh) {
                let qh = u32::from_le_bytes(*qh);
                for (j, q) in split32(qs).iter().enumerate() {
                    let hi = f64::from((qh >> j) & 1) * 16.0;
                    out.push(val(d * (f64::from(*q) + hi + zero)));
                }
            }
        }
        QType::Q8_0 => {
            for b in bytemuck::cast_slice::<u8, BlockQ8_0>(bytes) {
                out.extend(b.qs.map(|q| val(h(b.d) * f64::from(q))));
            }
        }
        QType::IQ4_NL => {
            for b in bytemuck::cast_slice::<u8, BlockIq4Nl>(bytes) {
                out.extend(split32(&b.qs).map(|q| val(h(b.d) * IQ4NL[usize::from(q)])));
            }
        }
        QType::MXFP4 => {
            for b in bytemuck::cast_slice::<u8, BlockMxfp4>(bytes) {
                let d = 2f64.powi(i32::from(b.e) - 127);
                out.extend(split32(&b.qs).map(|q| val(d * E2M1[usize::from(q)])));
            }
        }
        QType::NVFP4 => {
            for b in bytemuck::cast_slice::<u8, BlockNvfp4>(bytes) {
                for s in 0..4 {
                    let d = ue4m3(b.d[s]);
                    let bytes = &b.qs[8 * s..8 * s + 8];
                    out.extend(bytes.iter().map(|&q| val(d * E2M1[usize::from(q & 0xF)])));
                    out.extend(bytes.iter().map(|&q| val(d * E2M1[usize::from(q >> 4)])));
                }
            }
        }
        QType::Q2_K => {
            for b in bytemuck::cast_slice::<u8, BlockQ2K>(bytes) {
                let mut e = [Val { v: 0.0, mag: 0.0 }; 256];
                for half in 0..2 {
                    for j in 0..4 {
                        for l in 0..32 {
                            let sc = b.scales[8 * half + 2 * j + l / 16];
                            let q = (b.qs[32 * half + l] >> (2 * j)) & 3;
                            let a = h(b.d) * f64::from(sc & 0xF) * f64::from(q);
                            let m = h(b.dmin) * f64::from(sc >> 4);
                            e[128 * half + 32 * j + l] = Val {
                                v: a - m,
                                mag: a.abs() + m.abs(),
                            };
                        }
                    }
                }
                out.extend(e);
            }
        }
        QType::Q3_K => {
            for b in bytemuck::cast_slice::<u8, BlockQ3K>(bytes) {
                // ggml's kmask shuffle of the twelve scale bytes into sixteen 6-bit scales.
                let mut aux = [0u32; 4];
                for (k, a) in aux.iter_mut().take(3).enumerate() {
                    *a = u32::from_le_bytes(b.scales[4 * k..4 * k + 4].try_into().expect("4"));
                }
                let (k1, k2) = (0x0303_0303_u32, 0x0f0f_0f0f_u32);
                let tmp = aux[2];
                aux[2] = ((aux[0] >> 4) & k2) | (((tmp >> 4) & k1) << 4);
                aux[3] = ((aux[1] >> 4) & k2) | (((tmp >> 6) & k1) << 4);
                aux[0] = (aux[0] & k2) | ((tmp & k1) << 4);
                aux[1] = (aux[1] & k2) | (((tmp >> 2) & k1) << 4);
                let scales: Vec<f64> = aux
                    .iter()
                    .flat_map(|a| a.to_le_bytes())
                    .map(|s| f64::from(s.cast_signed()) - 32.0)
                    .collect();
                let mut e = [val(0.0); 256];
                for half in 0..2 {
                    for j in 0..4 {
                        let m = 1u8 << (4 * half + j);
                        for l in 0..32 {
                            let lo = f64::from((b.qs[32 * half + l] >> (2 * j)) & 3);
                            let q = lo - if b.hmask[l] & m != 0 { 0.0 } else { 4.0 };
                            let idx = 128 * half + 32 * j + l;
                            e[idx] = val(h(b.d) * scales[idx / 16] * q);
                        }
                    }
                }
                out.extend(e);
            }
        }
        QType::Q4_K | QType::Q5_K => {
            let blocks: Vec<K4Fields> = if ty == QType::Q4_K {
                bytemuck::cast_slice::<u8, BlockQ4K>(bytes)
                    .iter()
                    .map(|b| (b.d, b.dmin, b.scales, None, b.qs))
                    .collect()
            } else {
                bytemuck::cast_slice::<u8, BlockQ5K>(bytes)
                    .iter()
                    .map(|b| (b.d, b.dmin, b.scales, Some(b.qh), b.qs))
                    .collect()
            };
            for (d, dmin, s, qh, qs) in blocks {
                let scale_min = |j: usize| -> (u8, u8) {
                    if j < 4 {
                        (s[j] & 63, s[j + 4] & 63)
                    } else {
                        (
                            (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4),
                            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
                        )
                    }
                };
                for c in 0..4 {
                    for (half, shift) in [(0usize, 0u32), (1, 4)] {
                        let (sc, m) = scale_min(2 * c + half);
                        for l in 0..32 {
                            let lo = (qs[32 * c + l] >> shift) & 0xF;
                            let hi = qh.map_or(0, |qh| (qh[l] >> (2 * c + half)) & 1);
                            let q = f64::from(lo) + 16.0 * f64::from(hi);
                            let a = h(d) * f64::from(sc) * q;
                            let mm = h(dmin) * f64::from(m);
                            out.push(Val {
                                v: a - mm,
                                mag: a.abs() + mm.abs(),
                            });
                        }
                    }
                }
            }
        }
        QType::Q6_K => {
            for b in bytemuck::cast_slice::<u8, BlockQ6K>(bytes) {
                let mut e = [val(0.0); 256];
                for half in 0..2 {
                    let (ql, qh) = (&b.ql[64 * half..], &b.qh[32 * half..]);
                    for l in 0..32 {
                        let q = [
                            (ql[l] & 0xF) | ((qh[l] & 3) << 4),
                            (ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4),
                            (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4),
                            (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4),
                        ];
                        for (g, q) in q.iter().enumerate() {
                            let idx = 128 * half + 32 * g + l;
                            let sc = f64::from(b.scales[idx / 16]);
                            e[idx] = val(h(b.d) * sc * (f64::from(*q) - 32.0));
                        }
                    }
                }
                out.extend(e);
            }
        }
        QType::IQ4_XS => {
            for b in bytemuck::cast_slice::<u8, BlockIq4Xs>(bytes) {
                let sh = u16::from_le_bytes(b.scales_h);
                for ib in 0..8 {
                    let lo = (b.scales_l[ib / 2] >> (4 * (ib % 2))) & 0xF;
                    let hi = (sh >> (2 * ib)) & 3;
                    let ls = f64::from(u16::from(lo) | (hi << 4)) - 32.0;
                    let qs: &[u8; 16] = b.qs[16 * ib..16 * ib + 16].try_into().expect("16");
                    out.extend(split32(qs).map(|q| val(h(b.d) * ls * IQ4NL[usize::from(q)])));
                }
            }
        }
        QType::F32 => {
            for b in bytemuck::cast_slice::<u8, [u8; 4]>(bytes) {
                out.push(val(f64::from(f32::from_le_bytes(*b))));
            }
        }
        QType::F16 => {
            for b in bytemuck::cast_slice::<u8, Half>(bytes) {
                out.push(val(h(*b)));
            }
        }
        QType::BF16 => {
            for b in bytemuck::cast_slice::<u8, [u8; 2]>(bytes) {
                out.push(val(f64::from(f32::from_bits(u32::from(r16(*b)) << 16))));
            }
        }
        _ => unreachable!(),
    }
    out
}

fn deq_activations(ty: QType, bytes: &[u8]) -> Vec<f64> {
    match ty {
        QType::Q8_0 => bytemuck::cast_slice::<u8, BlockQ8_0>(bytes)
            .iter()
            .flat_map(|b| b.qs.map(|q| h(b.d) * f64::from(q)))
            .collect(),
        QType::Q8_1 => bytemuck::cast_slice::<u8, BlockQ8_1>(bytes)
            .iter()
            .flat_map(|b| b.qs.map(|q| h(b.d) * f64::from(q)))
            .collect(),
        QType::Q8_K => bytemuck::cast_slice::<u8, BlockQ8K>(bytes)
            .iter()
            .flat_map(|b| b.qs.map(|q| f64::from(b.d.get()) * f64::from(q)))
            .collect(),
        QType::F32 => bytemuck::cast_slice::<u8, [u8; 4]>(bytes)
            .iter()
            .map(|b| f64::from(f32::from_le_bytes(*b)))
            .collect(),
        _ => unreachable!(),
    }
}

/// Σ m_w · s_a for the formats whose min meets Q8_1's stored `s = d·Σq` (ggml's formula).
fn min_terms(ty: QType, w: &[u8], a: &[u8]) -> f64 {
    let mins: Vec<f64> = match ty {
        QType::Q4_1 => bytemuck::cast_slice::<u8, BlockQ4_1>(w)
            .iter()
            .map(|b| h(b.m))
            .collect(),
        QType::Q5_1 => bytemuck::cast_slice::<u8, BlockQ5_1>(w)
            .iter()
            .map(|b| h(b.m))
            .collect(),
        _ => return 0.0,
    };
    mins.iter()
        .zip(bytemuck::cast_slice::<u8, BlockQ8_1>(a))
        .map(|(m, b)| m * h(b.s))
        .sum()
}

/// The f64 dot product and the bound `Σ mag·|a|` its rounding is measured against.
fn reference(ty: QType, w: &[u8], a: &[u8]) -> (f64, f64) {
    let wv = deq_weights(ty, w);
    let av = deq_activations(ty.vec_dot_type(), a);
    assert_eq!(wv.len(), av.len());
    let extra = min_terms(ty, w, a);
    let dot: f64 = wv.iter().zip(&av).map(|(w, a)| w.v * a).sum::<f64>() + extra;
    let mag: f64 = wv
        .iter()
        .zip(&av)
        .map(|(w, a)| w.mag * a.abs())
        .sum::<f64>()
        + extra.abs();
    (dot, mag)
}

/// How many f32 terms the scalar reference adds for a row of `n` values.
fn terms(ty: QType, n: usize) -> usize {
    match ty {
        QType::NVFP4 => n / 16,
        QType::F32 | QType::F16 | QType::BF16 => n,
        _ => n / ty.block_size(),
    }
}

fn is_float(ty: QType) -> bool {
    matches!(ty, QType::F32 | QType::F16 | QType::BF16)
}

fn f32_eps() -> f64 {
    f64::from(f32::EPSILON)
}

/// A row case: the type, the row length in values, and both rows' bytes placed at an offset
/// inside a larger buffer.
#[derive(Debug, Clone)]
struct Case {
    ty: QType,
    n: usize,
    w_buf: Vec<u8>,
    w_off: usize,
    a_buf: Vec<u8>,
    a_off: usize,
}

impl Case {
    fn w(&self) -> &[u8] {
        &self.w_buf[self.w_off..]
    }
    fn a(&self) -> &[u8] {
        &self.a_buf[self.a_off..]
    }
}

/// Random rows of `ty`: 1..=16 blocks (1..=300 values for float rows, to reach every vector
/// width and tail), at byte offsets 1..=3.
fn case(ty: QType) -> impl Strategy<Value = Case> {
    let (bs, _) = geometry(ty);
    let count = if is_float(ty) {
        1..=300usize
    } else {
        1..=16usize
    };
    (count, 1..=3usize, 1..=3usize, any::<u64>()).prop_map(move |(k, w_off, a_off, seed)| {
        let n = k * bs;
        let at = ty.vec_dot_type();
        let wb = ty.row_bytes(n).expect("whole blocks");
        let ab = at.row_bytes(n).expect("whole blocks");
        let mut rng = SplitMix(seed);
        let mut w_buf: Vec<u8> = (0..w_off + wb).map(|_| rng.byte()).collect();
        let mut a_buf: Vec<u8> = (0..a_off + ab).map(|_| rng.byte()).collect();
        fix_weights(ty, &mut w_buf[w_off..]);
        fix_activations(at, &mut a_buf[a_off..]);
        Case {
            ty,
            n,
            w_buf,
            w_off,
            a_buf,
            a_off,
        }
    })
}

/// A small deterministic generator (proptest shrinks the seed).
struct SplitMix(u64);

impl SplitMix {
    fn byte(&mut self) -> u8 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        (z ^ (z >> 31)).to_le_bytes()[0]
    }
}

fn any_case() -> impl Strategy<Value = Case> {
    proptest::sample::select(WEIGHT_TYPES).prop_flat_map(case)
}

fn scalar() -> &'static Kernels {
    Kernels::for_level(SimdLevel::Scalar).expect("scalar is always supported")
}

/// Every level this CPU has agrees with the scalar reference: bit for bit for the quantized
/// formats, within summation rounding for the float ones.
fn check_levels(c: &Case) -> Result<(), TestCaseError> {
    let reference = scalar().vec_dot(c.ty, c.n, c.w(), c.a()).expect("scalar");
    for level in SimdLevel::supported() {
        let k = Kernels::for_level(level).expect("supported");
        let got = k.vec_dot(c.ty, c.n, c.w(), c.a()).expect("simd");
        if is_float(c.ty) {
            let (_, mag) = reference_f64(c);
            let tol = (c.n as f64 + FLOAT_SLACK) * f32_eps() * mag;
            let err = (f64::from(got) - f64::from(reference)).abs();
            prop_assert!(
                err <= tol,
                "{} at {level}: {got} vs scalar {reference} (|diff| {err:e} > {tol:e}, n = {})",
                c.ty,
                c.n
            );
        } else {
            prop_assert_eq!(
                got.to_bits(),
                reference.to_bits(),
                "{} at {}: {} vs scalar {} (n = {})",
                c.ty,
                level,
                got,
                reference,
                c.n
            );
        }
    }
    Ok(())
}

/// The x86 SIMD levels agree with each other bit for bit on every format, the float ones
/// included (AVX2 runs AVX-512's sixteen lanes as two halves), so a model's output does not
/// depend on which of them the machine has.
fn check_x86_levels_agree(c: &Case) -> Result<(), TestCaseError> {
    let simd: Vec<_> = SimdLevel::supported()
        .into_iter()
        .filter(|l| matches!(l, SimdLevel::Avx2 | SimdLevel::Avx512))
        .map(|l| {
            let k = Kernels::for_level(l).expect("supported");
            (l, k.vec_dot(c.ty, c.n, c.w(), c.a()).expect("simd"))
        })
        .collect();
    for pair in simd.windows(2) {
        prop_assert_eq!(
            pair[0].1.to_bits(),
            pair[1].1.to_bits(),
            "{}: {} gives {}, {} gives {} (n = {})",
            c.ty,
            pair[0].0,
            pair[0].1,
            pair[1].0,
            pair[1].1,
            c.n
        );
    }
    Ok(())
}

fn reference_f64(c: &Case) -> (f64, f64) {
    reference(c.ty, c.w(), c.a())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    /// Every SIMD level equals the scalar reference, on unaligned rows of every format.
    #[test]
    fn simd_levels_match_scalar(c in any_case()) {
        check_levels(&c)?;
    }

    /// AVX2 and AVX-512 give the same bits, for every format.
    #[test]
    fn x86_simd_levels_agree_bit_for_bit(c in any_case()) {
        check_x86_levels_agree(&c)?;
    }

    /// The scalar reference is the f64 dot product of the dequantized rows, to within the
    /// rounding of its f32 terms.
    #[test]
    fn scalar_matches_f64_dequantized(c in any_case()) {
        let got = f64::from(scalar().vec_dot(c.ty, c.n, c.w(), c.a()).expect("scalar"));
        let (want, mag) = reference_f64(&c);
        let tol = (terms(c.ty, c.n) as f64 + SCALAR_SLACK) * f32_eps() * mag;
        prop_assert!(
            (got - want).abs() <= tol,
            "{}: scalar {got} vs f64 {want} (|diff| {:e} > {tol:e}, n = {})",
            c.ty, (got - want).abs(), c.n
        );
    }
}

/// Guards the exactness of the SIMD integer sums at the extremes: codes of −128 on both sides
/// (where ggml's `maddubs(|x|, sign(y, x))` trick returns −128·128 for (−128)·(−128)) and
/// runs of the largest codes (where i16 pair sums saturate if a kernel is careless), for
/// every format, level and fill pattern.
#[test]
fn extreme_codes_are_exact() {
    for &ty in WEIGHT_TYPES.iter().filter(|&&t| !is_float(t)) {
        let n = 8 * ty.block_size().max(QType::Q8_K.block_size());
        let at = ty.vec_dot_type();
        for w_fill in [0x00u8, 0x77, 0x80, 0x88, 0xFF] {
            for a_fill in [0x80u8, 0x7F, 0x81] {
                let mut w_buf = vec![w_fill; 1 + ty.row_bytes(n).unwrap()];
                let mut a_buf = vec![a_fill; 3 + at.row_bytes(n).unwrap()];
                fix_weights(ty, &mut w_buf[1..]);
                fix_activations(at, &mut a_buf[3..]);
                let c = Case {
                    ty,
                    n,
                    w_buf,
                    w_off: 1,
                    a_buf,
                    a_off: 3,
                };
                check_levels(&c).unwrap_or_else(|e| panic!("{ty} {w_fill:#x}/{a_fill:#x}: {e}"));
                let got = f64::from(scalar().vec_dot(ty, n, c.w(), c.a()).unwrap());
                let (want, mag) = reference_f64(&c);
                let tol = (terms(ty, n) as f64 + SCALAR_SLACK) * f32_eps() * mag;
                assert!(
                    (got - want).abs() <= tol,
                    "{ty} {w_fill:#x}/{a_fill:#x}: scalar {got} vs f64 {want}"
                );
            }
        }
    }
}

/// The typed entry points, the byte-level `vec_dot` and the active table agree.
#[test]
fn typed_and_byte_entry_points_agree() {
    let mut rng = SplitMix(7);
    let n = 8 * 256;
    let mut w: Vec<u8> = (0..QType::Q4_K.row_bytes(n).unwrap())
        .map(|_| rng.byte())
        .collect();
    let mut a: Vec<u8> = (0..QType::Q8_K.row_bytes(n).unwrap())
        .map(|_| rng.byte())
        .collect();
    fix_weights(QType::Q4_K, &mut w);
    fix_activations(QType::Q8_K, &mut a);
    let typed = specula_quant::dot::q4_k_q8_k(bytemuck::cast_slice(&w), bytemuck::cast_slice(&a));
    let bytes = specula_quant::vec_dot(QType::Q4_K, n, &w, &a).unwrap();
    let table = Kernels::active().q4_k_q8_k(bytemuck::cast_slice(&w), bytemuck::cast_slice(&a));
    assert_eq!(typed.to_bits(), bytes.to_bits());
    assert_eq!(typed.to_bits(), table.to_bits());

    let x: Vec<f32> = (0..100u8).map(|i| f32::from(i) * 0.25 - 10.0).collect();
    let y: Vec<f32> = (0..100u8).map(|i| 1.0 - f32::from(i) * 0.125).collect();
    let want: f32 = x.iter().zip(&y).map(|(a, b)| a * b).sum();
    let got = specula_quant::dot::f32_f32(&x, &y);
    assert!((got - want).abs() <= 1e-3, "{got} vs {want}");
}

/// Formats without a weight dot product are refused, and lengths are checked.
#[test]
fn unsupported_types_and_bad_lengths_are_errors() {
    for ty in [
        QType::Q8_1,
        QType::Q8_K,
        QType::Turbo2,
        QType::Turbo3,
        QType::Turbo4,
    ] {
        let n = ty.block_size();
        let w = vec![0u8; ty.row_bytes(n).unwrap()];
        let a = vec![0u8; ty.vec_dot_type().row_bytes(n).unwrap()];
        assert_eq!(
            specula_quant::vec_dot(ty, n, &w, &a),
            Err(specula_quant::QuantError::Unsupported { ty, op: "vec_dot" })
        );
    }
    let w = vec![0u8; 18];
    assert!(specula_quant::vec_dot(QType::Q4_0, 32, &w, &[0u8; 33]).is_err());
    assert!(specula_quant::vec_dot(QType::Q4_0, 31, &w, &[0u8; 34]).is_err());
}

/// `SPECULA_SIMD` names and the supported levels.
#[test]
fn levels_are_named_and_detected() {
    for &l in SimdLevel::ALL {
        assert_eq!(SimdLevel::from_name(l.name()), Some(l));
    }
    assert_eq!(SimdLevel::from_name("AVX512"), Some(SimdLevel::Avx512));
    assert_eq!(SimdLevel::from_name("sse9"), None);
    let supported = SimdLevel::supported();
    assert_eq!(supported.first(), Some(&SimdLevel::Scalar));
    assert!(supported.contains(&SimdLevel::best()));
    assert!(SimdLevel::active().is_supported());
    for l in supported {
        assert_eq!(Kernels::for_level(l).map(Kernels::level), Some(l));
    }
    eprintln!(
        "dot product levels on this CPU: {:?}",
        SimdLevel::supported()
    );
}
