//! Row-wise and element-wise ops: embedding rows, bias, RMS norms, gated activations, sums.
//!
//! Each output value depends only on its own row, reduced in one fixed order, so none of these
//! can depend on the batch or the thread count. The formulas follow ggml-cpu (`ops.cpp`,
//! `vec.h`), so results track llama.cpp's.

use specula_tensor::GateAct;

use crate::CpuBackend;
use crate::tensor::{CpuTensor, CpuWeight};

/// `out[i] = src[rows[i]]`.
pub(crate) fn copy_rows(src: &CpuTensor, rows: &[usize], out: &mut CpuTensor) {
    let cols = src.cols();
    out.resize(rows.len(), cols);
    for (i, &r) in rows.iter().enumerate() {
        assert!(
            r < src.rows(),
            "copy_rows: row {r} of a {}-row tensor",
            src.rows()
        );
        out.row_mut(i).copy_from_slice(src.row(r));
    }
}

/// `dst[rows[i]] = src[i]`.
pub(crate) fn put_rows(src: &CpuTensor, rows: &[usize], dst: &mut CpuTensor) {
    assert!(
        src.rows() == rows.len() && src.cols() == dst.cols(),
        "put_rows: {} rows of {} values into rows of {}",
        src.rows(),
        src.cols(),
        dst.cols()
    );
    for (i, &r) in rows.iter().enumerate() {
        assert!(
            r < dst.rows(),
            "put_rows: row {r} of a {}-row tensor",
            dst.rows()
        );
        dst.row_mut(r).copy_from_slice(src.row(i));
    }
}

/// `dst[r][col0..col0 + src.cols] = src[r]`.
pub(crate) fn put_cols(src: &CpuTensor, col0: usize, dst: &mut CpuTensor) {
    let w = src.cols();
    assert!(
        src.rows() == dst.rows() && col0 + w <= dst.cols(),
        "put_cols: {} rows of {w} values at column {col0} of {} rows of {}",
        src.rows(),
        dst.rows(),
        dst.cols()
    );
    for r in 0..src.rows() {
        dst.row_mut(r)[col0..col0 + w].copy_from_slice(src.row(r));
    }
}

/// `x = 0` where NaN, else `x` clamped to `[−limit, limit]`.
pub(crate) fn clamp_finite(be: &CpuBackend, x: &mut CpuTensor, limit: f32) {
    let cols = x.cols();
    be.par_rows(x.as_mut_slice(), cols, |_, o| {
        for v in o {
            *v = if v.is_nan() {
                0.0
            } else {
                v.clamp(-limit, limit)
            };
        }
    });
}

/// `out[r] = dequantize(table row ids[r])`.
pub(crate) fn get_rows(be: &CpuBackend, table: &CpuWeight, ids: &[u32], out: &mut CpuTensor) {
    let n = table.row_len();
    let n_rows = table.n_rows();
    out.resize(ids.len(), n);
    be.par_rows(out.as_mut_slice(), n, |r, o| {
        let id = usize::try_from(ids[r]).unwrap_or(usize::MAX);
        assert!(
            id < n_rows,
            "get_rows: id {} is past the {n_rows} rows of `{}`",
            ids[r],
            table.name()
        );
        specula_quant::dequantize_row(table.ty(), table.row(id), o)
            .expect("a weight row has the length of its type and shape");
    });
}

/// `x[r] += b`.
pub(crate) fn add_vector(be: &CpuBackend, x: &mut CpuTensor, b: &CpuWeight) {
    let cols = x.cols();
    let b = b.vector(cols, "add_vector");
    be.par_rows(x.as_mut_slice(), cols, |_, o| {
        for (o, &b) in o.iter_mut().zip(b) {
            *o += b;
        }
    });
}

/// `1 / sqrt(mean(x²) + eps)` as ggml's `rms_norm`: each square rounded to f32, summed in f64
/// in element order, the mean rounded to f32.
#[inline]
fn rms_scale(x: &[f32], eps: f32) -> f32 {
    let mut sum = 0.0f64;
    for &v in x {
        sum += f64::from(v * v);
    }
    #[allow(
        clippy::cast_precision_loss,
        clippy::cast_possible_truncation,
        reason = "row lengths are far below 2^52; the f32 mean is ggml's `const float mean`"
    )]
    let mean = (sum / x.len() as f64) as f32;
    1.0 / (mean + eps).sqrt()
}

/// `out[r] = x[r] · scale · w`.
#[inline]
fn norm_row(x: &[f32], w: Option<&[f32]>, eps: f32, out: &mut [f32]) {
    let scale = rms_scale(x, eps);
    match w {
        Some(w) => {
            for ((o, &x), &w) in out.iter_mut().zip(x).zip(w) {
                *o = x * scale * w;
            }
        }
        None => {
            for (o, &x) in out.iter_mut().zip(x) {
                *o = x * scale;
            }
        }
    }
}

/// `out[r] = x[r] / rms(x[r]) · w`.
pub(crate) fn rms_norm(
    be: &CpuBackend,
    x: &CpuTensor,
    w: Option<&CpuWeight>,
    eps: f32,
    out: &mut CpuTensor,
) {
    let cols = x.cols();
    let w = w.map(|w| w.vector(cols, "rms_norm"));
    out.resize(x.rows(), cols);
    be.par_rows(out.as_mut_slice(), cols, |r, o| {
        norm_row(x.row(r), w, eps, o)
    });
}

/// RMS norm of every `group`-sized slice of every row, in place.
pub(crate) fn rms_norm_groups(
    be: &CpuBackend,
    x: &mut CpuTensor,
    group: usize,
    w: &CpuWeight,
    eps: f32,
) {
    let cols = x.cols();
    assert!(
        group > 0 && cols.is_multiple_of(group),
        "rms_norm_groups: rows of {cols} values are not whole groups of {group}"
    );
    let w = w.vector(group, "rms_norm_groups");
    be.par_rows(x.as_mut_slice(), cols, |_, row| {
        for g in row.chunks_exact_mut(group) {
            let scale = rms_scale(g, eps);
            for (v, &w) in g.iter_mut().zip(w) {
                *v = *v * scale * w;
            }
        }
    });
}

/// `silu(x) = x / (1 + e^−x)` (ggml's `ggml_silu_f32`).
#[inline]
#[must_use]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// The tanh approximation of GELU, `0.5·x·(1 + tanh(√(2/π)·x·(1 + 0.044715·x²)))`
/// (ggml's `ggml_gelu_f32`). The backend's `geglu` uses [`gelu_tanh_f16`], ggml-cpu's f16
/// table: on Gemma-3 270m the exact formula moves perplexity 0.7 % from llama.cpp's, the table
/// 0.18 %.
#[inline]
#[must_use]
pub fn gelu_tanh(x: f32) -> f32 {
    const GELU_COEF_A: f32 = 0.044_715;
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * x * (1.0 + GELU_COEF_A * x * x)).tanh())
}

/// `out = act(gate) ⊙ up` for one row, with `act` one value at a time.
fn gated_row(act: fn(f32) -> f32, o: &mut [f32], gate: &[f32], up: &[f32]) {
    for ((o, &g), &u) in o.iter_mut().zip(gate).zip(up) {
        *o = act(g) * u;
    }
}

/// The vector path of the element-wise activations, if any.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ActSimd {
    /// Scalar, with the C library's `expf`.
    None,
    /// AVX2 with FMA: [`vexp`]'s exponential in eight lanes, the bits of the AVX-512 one.
    Avx2,
    /// AVX-512 F: [`vexp`]'s exponential in sixteen lanes.
    Avx512,
}

/// `out = silu(gate) ⊙ up` for one row: the vector path on the first whole multiple of sixteen
/// values (an exponential accurate to about one ulp instead of libm's, the same bits on AVX2
/// and AVX-512), [`silu`] on the rest.
fn swiglu_row(simd: ActSimd, o: &mut [f32], gate: &[f32], up: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    if simd != ActSimd::None {
        let n = o.len() / 16 * 16;
        if simd == ActSimd::Avx512 {
            // SAFETY: `Avx512` is only chosen when this CPU has AVX-512 F
            // (`CpuBackend::simd_act`).
            unsafe { vexp::swiglu16(&mut o[..n], &gate[..n], &up[..n]) };
        } else {
            // SAFETY: `Avx2` is only chosen when this CPU has AVX2 and FMA.
            unsafe { vexp::swiglu8(&mut o[..n], &gate[..n], &up[..n]) };
        }
        gated_row(silu, &mut o[n..], &gate[n..], &up[n..]);
        return;
    }
    let _ = simd;
    gated_row(silu, o, gate, up);
}

/// Vectorised `silu` on AVX-512 and AVX2: the same operations in the same order on both, so
/// the same bits.
#[cfg(target_arch = "x86_64")]
mod vexp {
    use std::arch::x86_64::*;

    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    /// `1/k!` for the Taylor terms, highest first.
    const TAYLOR: [f32; 7] = [720.0, 120.0, 24.0, 6.0, 2.0, 1.0, 1.0];

    /// `e^x` in every lane: `x` clamped to [−150, 128], `x = n·ln 2 + r` with `|r| ≤ ln 2 / 2`
    /// (Cody–Waite, two-part `ln 2`), `e^r` by its degree-7 Taylor polynomial (truncation
    /// below 2⁻²⁶ relative), times `2^n` with `vscalefps` (which takes care of overflow to ∞
    /// and underflow through the subnormals to 0, with one rounding).
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn exp16(x: __m512) -> __m512 {
        let c = |v: f32| _mm512_set1_ps(v);
        let x = _mm512_min_ps(_mm512_max_ps(x, c(-150.0)), c(128.0));
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm512_mul_ps(x, c(std::f32::consts::LOG2_E)),
        );
        let r = _mm512_fnmadd_ps(n, c(LN2_HI), x);
        let r = _mm512_fnmadd_ps(n, c(LN2_LO), r);
        let mut p = c(1.0 / 5040.0);
        for k in TAYLOR {
            p = _mm512_fmadd_ps(p, r, c(1.0 / k));
        }
        _mm512_scalef_ps(p, n)
    }

    /// [`exp16`] in eight lanes with AVX2 and FMA, the same bits: every step is the same
    /// operation, and `vscalefps` becomes `(p·2^a)·2^b` with `a = ⌊n/2⌋`, `b = n − a`. For
    /// the clamped inputs `n` lies in [−217, 185], so `2^a` and `2^b` are normal floats and
    /// `p·2^a` (`p` ∈ [0.7, 1.5]) is an exact normal float: the product is rounded once, as
    /// `vscalefps` rounds it (to ∞ on overflow, through the subnormals on underflow).
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn exp8(x: __m256) -> __m256 {
        let c = |v: f32| _mm256_set1_ps(v);
        let x = _mm256_min_ps(_mm256_max_ps(x, c(-150.0)), c(128.0));
        let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm256_mul_ps(x, c(std::f32::consts::LOG2_E)),
        );
        let r = _mm256_fnmadd_ps(n, c(LN2_HI), x);
        let r = _mm256_fnmadd_ps(n, c(LN2_LO), r);
        let mut p = c(1.0 / 5040.0);
        for k in TAYLOR {
            p = _mm256_fmadd_ps(p, r, c(1.0 / k));
        }
        let ni = _mm256_cvtps_epi32(n);
        let a = _mm256_srai_epi32::<1>(ni);
        let b = _mm256_sub_epi32(ni, a);
        let pow2 = |e: __m256i| {
            _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(
                e,
                _mm256_set1_epi32(127),
            )))
        };
        _mm256_mul_ps(_mm256_mul_ps(p, pow2(a)), pow2(b))
    }

    /// `o = silu(g) ⊙ u`, 16 values at a time (the lengths are whole vectors).
    ///
    /// # Safety
    /// The CPU must support AVX-512 F.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn swiglu16(o: &mut [f32], g: &[f32], u: &[f32]) {
        let one = _mm512_set1_ps(1.0);
        let (oc, _) = o.as_chunks_mut::<16>();
        let (gc, _) = g.as_chunks::<16>();
        let (uc, _) = u.as_chunks::<16>();
        for ((o, g), u) in oc.iter_mut().zip(gc).zip(uc) {
            // SAFETY: reads the 16 values of `g` and `u`.
            let (x, y) = unsafe { (_mm512_loadu_ps(g.as_ptr()), _mm512_loadu_ps(u.as_ptr())) };
            let e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), x));
            let v = _mm512_mul_ps(_mm512_div_ps(x, _mm512_add_ps(one, e)), y);
            // SAFETY: writes the 16 values of `o`.
            unsafe { _mm512_storeu_ps(o.as_mut_ptr(), v) };
        }
    }

    /// [`swiglu16`] eight values at a time with AVX2 and FMA, the same bits.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn swiglu8(o: &mut [f32], g: &[f32], u: &[f32]) {
        let one = _mm256_set1_ps(1.0);
        let (oc, _) = o.as_chunks_mut::<8>();
        let (gc, _) = g.as_chunks::<8>();
        let (uc, _) = u.as_chunks::<8>();
        for ((o, g), u) in oc.iter_mut().zip(gc).zip(uc) {
            // SAFETY: reads the 8 values of `g` and `u`.
            let (x, y) = unsafe { (_mm256_loadu_ps(g.as_ptr()), _mm256_loadu_ps(u.as_ptr())) };
            let e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), x));
            let v = _mm256_mul_ps(_mm256_div_ps(x, _mm256_add_ps(one, e)), y);
            // SAFETY: writes the 8 values of `o`.
            unsafe { _mm256_storeu_ps(o.as_mut_ptr(), v) };
        }
    }

    #[cfg(test)]
    mod tests {
        /// AVX2's SwiGLU gives AVX-512's bits on inputs across the whole range: large
        /// positive and negative (overflow of `e^−x`, the subnormal range), tiny, zero, ∞ and
        /// NaN.
        #[test]
        fn avx2_swiglu_has_the_avx512_bits() {
            if !(is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma"))
            {
                return;
            }
            let mut g: Vec<f32> = (0..200_000u32)
                .map(|i| {
                    let t = f64::from(i) / 200_000.0;
                    #[allow(
                        clippy::cast_possible_truncation,
                        reason = "test inputs, any rounding will do"
                    )]
                    let v = ((t * 2.0 - 1.0) * 240.0) as f32;
                    v
                })
                .collect();
            g.extend([
                0.0,
                -0.0,
                1e-30,
                -1e-30,
                f32::INFINITY,
                f32::NEG_INFINITY,
                f32::NAN,
            ]);
            g.extend((0..4096u32).map(|i| f32::from_bits(0x4280_0000 + i * 977)));
            g.extend((0..4096u32).map(|i| -f32::from_bits(0x4280_0000 + i * 977)));
            g.truncate(g.len() / 16 * 16);
            let u: Vec<f32> = g.iter().map(|x| 1.0 + x.abs().min(3.0)).collect();
            let (mut a, mut b) = (vec![0.0; g.len()], vec![0.0; g.len()]);
            // SAFETY: the features are checked above.
            unsafe {
                super::swiglu16(&mut a, &g, &u);
                super::swiglu8(&mut b, &g, &u);
            }
            for ((x, y), gi) in a.iter().zip(&b).zip(&g) {
                assert_eq!(x.to_bits(), y.to_bits(), "silu({gi})·u: {x} vs {y}");
            }
        }
    }
}

/// `out = act(gate) ⊙ up`, one row at a time with `row`.
fn gated(
    be: &CpuBackend,
    gate: &CpuTensor,
    up: &CpuTensor,
    out: &mut CpuTensor,
    op: &str,
    row: impl Fn(&mut [f32], &[f32], &[f32]) + Sync,
) {
    assert_eq!(
        (gate.rows(), gate.cols()),
        (up.rows(), up.cols()),
        "{op}: gate and up have different shapes"
    );
    let cols = gate.cols();
    out.resize(gate.rows(), cols);
    be.par_rows(out.as_mut_slice(), cols, |r, o| {
        row(o, gate.row(r), up.row(r))
    });
}

/// `out = silu(gate) ⊙ up`.
pub(crate) fn swiglu(be: &CpuBackend, gate: &CpuTensor, up: &CpuTensor, out: &mut CpuTensor) {
    let simd = be.simd_act();
    gated(be, gate, up, out, "swiglu", |o, g, u| {
        swiglu_row(simd, o, g, u)
    });
}

/// `out = gelu_tanh(gate) ⊙ up`.
pub(crate) fn geglu(be: &CpuBackend, gate: &CpuTensor, up: &CpuTensor, out: &mut CpuTensor) {
    gated(be, gate, up, out, "geglu", |o, g, u| {
        gated_row(gelu_tanh_f16, o, g, u)
    });
}

/// GELU as ggml-cpu computes it for f32 rows (`ggml_vec_geglu_f32` under `GGML_GELU_FP16`):
/// 0 at or below −10, the identity at or above 10, else the input rounded to f16 and looked
/// up in a table of f16 values (`ggml_table_gelu_f16[i] = fp16(ggml_gelu_f32(fp16_to_f32(i)))`).
/// The table also makes it cheap: one conversion and one load instead of a `tanh`.
#[inline]
#[must_use]
pub fn gelu_tanh_f16(x: f32) -> f32 {
    use specula_quant::blocks::Half;
    static TABLE: std::sync::LazyLock<Box<[f32]>> = std::sync::LazyLock::new(|| {
        (0..=u16::MAX)
            .map(|bits| Half::from_f32(gelu_tanh(Half(bits.to_le_bytes()).to_f32())).to_f32())
            .collect()
    });
    if x <= -10.0 {
        0.0
    } else if x >= 10.0 {
        x
    } else {
        TABLE[usize::from(Half::from_f32(x).to_bits())]
    }
}

/// `a += b`.
pub(crate) fn add(be: &CpuBackend, a: &mut CpuTensor, b: &CpuTensor) {
    assert_eq!(
        (a.rows(), a.cols()),
        (b.rows(), b.cols()),
        "add: operands have different shapes"
    );
    let cols = a.cols();
    be.par_rows(a.as_mut_slice(), cols, |r, o| {
        for (o, &b) in o.iter_mut().zip(b.row(r)) {
            *o += b;
        }
    });
}

/// `x = c · tanh(x / c)`, as ggml computes it (scale by `1/c`, tanh, scale by `c`).
pub(crate) fn softcap(be: &CpuBackend, x: &mut CpuTensor, c: f32) {
    let cols = x.cols();
    let inv = 1.0 / c;
    be.par_rows(x.as_mut_slice(), cols, |_, o| {
        for v in o {
            *v = (*v * inv).tanh() * c;
        }
    });
}

/// `x = silu(x)`.
pub(crate) fn silu_rows(be: &CpuBackend, x: &mut CpuTensor) {
    let cols = x.cols();
    be.par_rows(x.as_mut_slice(), cols, |_, o| {
        for v in o {
            *v = silu(*v);
        }
    });
}

/// `x ⊙= act(gate)`, gate column `j` scaling columns `j·g .. (j+1)·g` of `x`
/// (`g = x.cols / gate.cols`).
pub(crate) fn gate_mul(be: &CpuBackend, x: &mut CpuTensor, gate: &CpuTensor, act: GateAct) {
    let cols = x.cols();
    assert!(
        gate.rows() == x.rows() && gate.cols() > 0 && cols.is_multiple_of(gate.cols()),
        "gate_mul: gate must be [{}, a divisor of {cols}]",
        x.rows()
    );
    let group = cols / gate.cols();
    let f = match act {
        GateAct::Sigmoid => |g: f32| 1.0 / (1.0 + (-g).exp()),
        GateAct::Softplus => |g: f32| if g > 20.0 { g } else { g.exp().ln_1p() },
    };
    be.par_rows(x.as_mut_slice(), cols, |r, o| {
        for (chunk, &g) in o.chunks_exact_mut(group).zip(gate.row(r)) {
            let s = f(g);
            for v in chunk {
                *v *= s;
            }
        }
    });
}

/// `out[r]` = the concatenation of `src[r][g·stride + range]` over the groups `g`.
pub(crate) fn gather_cols(
    src: &CpuTensor,
    stride: usize,
    range: std::ops::Range<usize>,
    out: &mut CpuTensor,
) {
    let cols = src.cols();
    assert!(
        stride > 0
            && cols.is_multiple_of(stride)
            && range.start <= range.end
            && range.end <= stride,
        "gather_cols: {range:?} of groups of {stride} in rows of {cols}"
    );
    let groups = cols / stride;
    let w = range.len();
    out.resize(src.rows(), groups * w);
    for r in 0..src.rows() {
        let (s, o) = (src.row(r), out.row_mut(r));
        for g in 0..groups {
            o[g * w..(g + 1) * w]
                .copy_from_slice(&s[g * stride + range.start..g * stride + range.end]);
        }
    }
}

/// `a *= s`.
pub(crate) fn scale(be: &CpuBackend, a: &mut CpuTensor, s: f32) {
    let cols = a.cols();
    be.par_rows(a.as_mut_slice(), cols, |_, o| {
        for o in o {
            *o *= s;
        }
    });
}
