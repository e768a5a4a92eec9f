//! The inner loops of attention: `q·k` for one key, and `acc = Σ_j p_j·v_j` over the value rows
//! of a head, for f32 and f16 caches, with AVX-512 and AVX2 (+ F16C, FMA) paths chosen once per
//! backend and a portable fallback.
//!
//! A backend uses one path for every call, so results do not depend on the batch. The paths
//! differ from each other in the rounding of the dot products (lane counts, fused multiply-add);
//! the weighted sum adds `p_j·v_j` (multiply and add rounded separately) to each output value in
//! key order, skipping `p_j = 0`, on every path, so it gives the same bits everywhere. It keeps
//! a 64-value slice of the output in registers while it runs over the keys.

use specula_quant::blocks::Half;
use specula_quant::dot::SimdLevel;

/// The loops of one instruction set.
#[derive(Clone, Copy)]
pub(crate) struct AttnKernels {
    /// `Σ q·k`, f32 keys.
    pub(crate) dot_f32: fn(&[f32], &[f32]) -> f32,
    /// `Σ q·k`, f16 keys.
    pub(crate) dot_f16: fn(&[f32], &[Half]) -> f32,
    /// `acc = Σ_j p[j]·v[off + j·stride ..][..acc.len()]`, f32 values.
    pub(crate) wsum_f32: fn(&mut [f32], &[f32], &[f32], usize, usize),
    /// The same for f16 values.
    pub(crate) wsum_f16: fn(&mut [f32], &[f32], &[Half], usize, usize),
}

impl std::fmt::Debug for AttnKernels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AttnKernels").finish_non_exhaustive()
    }
}

impl AttnKernels {
    /// The loops for `level` (AVX-512 and AVX2 levels get their own; others the portable ones).
    pub(crate) fn for_level(level: SimdLevel) -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            if level == SimdLevel::Avx512 && x86::avx512_supported() {
                return x86::AVX512;
            }
            if matches!(level, SimdLevel::Avx512 | SimdLevel::Avx2) && x86::avx2_supported() {
                return x86::AVX2;
            }
        }
        let _ = level;
        PORTABLE
    }
}

const PORTABLE: AttnKernels = AttnKernels {
    dot_f32: |q, k| dot_portable(q, k, |x| x),
    dot_f16: |q, k| dot_portable(q, k, Half::to_f32),
    wsum_f32: |acc, p, v, off, stride| wsum_portable(acc, p, v, off, stride, |x| x),
    wsum_f16: |acc, p, v, off, stride| wsum_portable(acc, p, v, off, stride, Half::to_f32),
};

/// Checks the shapes of a weighted sum: every row `off + j·stride .. + acc.len()` is inside `v`.
fn check_wsum<V>(acc: &[f32], p: &[f32], v: &[V], off: usize, stride: usize) {
    if let Some(last) = p.len().checked_sub(1) {
        assert!(
            off + last * stride + acc.len() <= v.len(),
            "attention: value rows past the end of the cache"
        );
    }
}

/// `acc = Σ_j p_j·v_j`, value by value in key order.
fn wsum_portable<V: Copy>(
    acc: &mut [f32],
    p: &[f32],
    v: &[V],
    off: usize,
    stride: usize,
    f: impl Fn(V) -> f32,
) {
    check_wsum(acc, p, v, off, stride);
    acc.fill(0.0);
    for (j, &pj) in p.iter().enumerate() {
        if pj == 0.0 {
            continue;
        }
        let row = &v[off + j * stride..][..acc.len()];
        for (o, &x) in acc.iter_mut().zip(row) {
            *o += pj * f(x);
        }
    }
}

/// `Σ q·k` in eight f32 lanes (element `i` in lane `i % 8`), the lanes summed pairwise.
fn dot_portable<K: Copy>(q: &[f32], k: &[K], f: impl Fn(K) -> f32) -> f32 {
    assert_eq!(q.len(), k.len(), "attention: q and k lengths differ");
    let mut acc = [0.0f32; 8];
    let (qc, qt) = q.as_chunks::<8>();
    let (kc, kt) = k.as_chunks::<8>();
    for (qc, kc) in qc.iter().zip(kc) {
        for l in 0..8 {
            acc[l] += qc[l] * f(kc[l]);
        }
    }
    for (l, (&q, &k)) in qt.iter().zip(kt).enumerate() {
        acc[l] += q * f(k);
    }
    let s4 = [
        acc[0] + acc[4],
        acc[1] + acc[5],
        acc[2] + acc[6],
        acc[3] + acc[7],
    ];
    (s4[0] + s4[2]) + (s4[1] + s4[3])
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{AttnKernels, Half, check_wsum};

    pub(super) fn avx512_supported() -> bool {
        is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vl")
            && is_x86_feature_detected!("f16c")
            && is_x86_feature_detected!("fma")
    }

    pub(super) fn avx2_supported() -> bool {
        is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("f16c")
            && is_x86_feature_detected!("fma")
    }

    /// Builds a table whose entries check the slices and call the `unsafe` kernels of one
    /// instruction set. Each table is only handed out by [`AttnKernels::for_level`] after the
    /// matching `*_supported` check.
    macro_rules! table {
        ($dot32:ident, $dot16:ident, $ws32:ident, $ws16:ident) => {
            AttnKernels {
                dot_f32: |q, k| {
                    assert_eq!(q.len(), k.len(), "attention: q and k lengths differ");
                    // SAFETY: the table is only handed out after the check that this CPU has
                    // the kernels' features (`AttnKernels::for_level`); lengths are equal
                    // (checked above).
                    unsafe { $dot32(q, k) }
                },
                dot_f16: |q, k| {
                    assert_eq!(q.len(), k.len(), "attention: q and k lengths differ");
                    // SAFETY: as above.
                    unsafe { $dot16(q, k) }
                },
                wsum_f32: |acc, p, v, off, stride| {
                    check_wsum(acc, p, v, off, stride);
                    // SAFETY: as above; every value row read is inside `v` (checked above).
                    unsafe { $ws32(acc, p, v, off, stride) }
                },
                wsum_f16: |acc, p, v, off, stride| {
                    check_wsum(acc, p, v, off, stride);
                    // SAFETY: as above.
                    unsafe { $ws16(acc, p, v, off, stride) }
                },
            }
        };
    }

    pub(super) const AVX512: AttnKernels =
        table!(dot_f32_512, dot_f16_512, wsum_f32_512, wsum_f16_512);
    pub(super) const AVX2: AttnKernels =
        table!(dot_f32_256, dot_f16_256, wsum_f32_256, wsum_f16_256);

    /// The mask of the first `n` (< 16) lanes.
    fn tail16(n: usize) -> __mmask16 {
        (1u16 << n) - 1
    }

    /// `Σ q·k`, 16 lanes with FMA; the last partial chunk through masked loads.
    ///
    /// # Safety
    /// The CPU must support AVX-512 F/BW/VL, F16C and FMA; `q` and `k` have one length.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c,fma")]
    unsafe fn dot_f32_512(q: &[f32], k: &[f32]) -> f32 {
        let n = q.len();
        let mut acc = _mm512_setzero_ps();
        let mut i = 0;
        while i + 16 <= n {
            // SAFETY: i + 16 ≤ n = q.len() = k.len().
            let (a, b) = unsafe {
                (
                    _mm512_loadu_ps(q.as_ptr().add(i)),
                    _mm512_loadu_ps(k.as_ptr().add(i)),
                )
            };
            acc = _mm512_fmadd_ps(a, b, acc);
            i += 16;
        }
        if i < n {
            let m = tail16(n - i);
            // SAFETY: the mask covers only the n − i < 16 elements left in both slices.
            let (a, b) = unsafe {
                (
                    _mm512_maskz_loadu_ps(m, q.as_ptr().add(i)),
                    _mm512_maskz_loadu_ps(m, k.as_ptr().add(i)),
                )
            };
            acc = _mm512_fmadd_ps(a, b, acc);
        }
        _mm512_reduce_add_ps(acc)
    }

    /// `Σ q·k` for f16 keys.
    ///
    /// # Safety
    /// As [`dot_f32_512`].
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c,fma")]
    unsafe fn dot_f16_512(q: &[f32], k: &[Half]) -> f32 {
        let n = q.len();
        let kp = k.as_ptr().cast::<u16>();
        let mut acc = _mm512_setzero_ps();
        let mut i = 0;
        while i + 16 <= n {
            // SAFETY: i + 16 ≤ n; `Half` is two bytes (repr(transparent) over [u8; 2]).
            let (a, b) = unsafe {
                (
                    _mm512_loadu_ps(q.as_ptr().add(i)),
                    _mm512_cvtph_ps(_mm256_loadu_si256(kp.add(i).cast())),
                )
            };
            acc = _mm512_fmadd_ps(a, b, acc);
            i += 16;
        }
        if i < n {
            let m = tail16(n - i);
            // SAFETY: the masks cover only the n − i < 16 elements left in both slices.
            let (a, b) = unsafe {
                (
                    _mm512_maskz_loadu_ps(m, q.as_ptr().add(i)),
                    _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, kp.add(i).cast())),
                )
            };
            acc = _mm512_fmadd_ps(a, b, acc);
        }
        _mm512_reduce_add_ps(acc)
    }

    /// `Σ q·k`, 8 lanes with FMA, the last partial chunk in order.
    ///
    /// # Safety
    /// The CPU must support AVX2, F16C and FMA; `q` and `k` have one length.
    #[target_feature(enable = "avx2,f16c,fma")]
    unsafe fn dot_f32_256(q: &[f32], k: &[f32]) -> f32 {
        let n = q.len();
        let mut acc = _mm256_setzero_ps();
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: i + 8 ≤ n = q.len() = k.len().
            let (a, b) = unsafe {
                (
                    _mm256_loadu_ps(q.as_ptr().add(i)),
                    _mm256_loadu_ps(k.as_ptr().add(i)),
                )
            };
            acc = _mm256_fmadd_ps(a, b, acc);
            i += 8;
        }
        hsum256(acc) + tail_dot(&q[i..], &k[i..], |x| x)
    }

    /// `Σ q·k` for f16 keys.
    ///
    /// # Safety
    /// As [`dot_f32_256`].
    #[target_feature(enable = "avx2,f16c,fma")]
    unsafe fn dot_f16_256(q: &[f32], k: &[Half]) -> f32 {
        let n = q.len();
        let kp = k.as_ptr().cast::<u16>();
        let mut acc = _mm256_setzero_ps();
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: i + 8 ≤ n; `Half` is two bytes.
            let (a, b) = unsafe {
                (
                    _mm256_loadu_ps(q.as_ptr().add(i)),
                    _mm256_cvtph_ps(_mm_loadu_si128(kp.add(i).cast())),
                )
            };
            acc = _mm256_fmadd_ps(a, b, acc);
            i += 8;
        }
        hsum256(acc) + tail_dot(&q[i..], &k[i..], Half::to_f32)
    }

    /// The sum of eight lanes, pairwise.
    #[inline]
    #[target_feature(enable = "avx2,f16c,fma")]
    fn hsum256(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
    }

    /// `Σ q·k` of a short tail, in order.
    fn tail_dot<K: Copy>(q: &[f32], k: &[K], f: impl Fn(K) -> f32) -> f32 {
        q.iter().zip(k).map(|(&q, &k)| q * f(k)).sum()
    }

    /// Defines a weighted sum over value rows: the output in slices of four vectors kept in
    /// registers across the keys; values past the last whole vector one at a time.
    macro_rules! wsum {
        (
            $name:ident, $feat:literal, $v:ty, $lanes:literal, $vec:ty,
            $zero:ident, $set1:ident, $mul:ident, $add:ident, $loadps:ident, $storeps:ident,
            |$ptr:ident| $load:expr, |$x:ident| $scalar:expr
        ) => {
            /// `acc = Σ_j p_j·v_j` (see the module docs).
            ///
            /// # Safety
            /// The CPU must have the features of the function; every row
            /// `off + j·stride .. + acc.len()` for `j < p.len()` is inside `v`.
            #[target_feature(enable = $feat)]
            unsafe fn $name(acc: &mut [f32], p: &[f32], v: &[$v], off: usize, stride: usize) {
                let n = acc.len();
                let base = v.as_ptr();
                let mut d = 0;
                // Four vectors of the output at a time, then one, then single values.
                while d < n {
                    let width = if d + 4 * $lanes <= n {
                        4
                    } else if d + $lanes <= n {
                        1
                    } else {
                        0
                    };
                    if width == 0 {
                        for o in d..n {
                            let mut a = 0.0f32;
                            for (j, &pj) in p.iter().enumerate() {
                                if pj != 0.0 {
                                    let $x = v[off + j * stride + o];
                                    a += pj * $scalar;
                                }
                            }
                            acc[o] = a;
                        }
                        break;
                    }
                    let mut r: [$vec; 4] = [$zero(); 4];
                    for (j, &pj) in p.iter().enumerate() {
                        if pj == 0.0 {
                            continue;
                        }
                        let pv = $set1(pj);
                        for (k, rk) in r.iter_mut().enumerate().take(width) {
                            // SAFETY: element off + j·stride + d + (k + 1)·lanes − 1 < off +
                            // j·stride + n, inside `v` by the caller's contract.
                            let $ptr = unsafe { base.add(off + j * stride + d + k * $lanes) };
                            let x = $load;
                            *rk = $add(*rk, $mul(pv, x));
                        }
                    }
                    for (k, rk) in r.iter().enumerate().take(width) {
                        // SAFETY: d + (k + 1)·lanes ≤ n = acc.len().
                        unsafe { $storeps(acc.as_mut_ptr().add(d + k * $lanes), *rk) };
                    }
                    d += width * $lanes;
                }
            }
        };
    }

    wsum!(
        wsum_f32_512,
        "avx512f,avx512bw,avx512vl,f16c,fma",
        f32,
        16,
        __m512,
        _mm512_setzero_ps,
        _mm512_set1_ps,
        _mm512_mul_ps,
        _mm512_add_ps,
        _mm512_loadu_ps,
        _mm512_storeu_ps,
        // SAFETY: `ptr` points at 16 values inside `v` (see the caller).
        |ptr| unsafe { _mm512_loadu_ps(ptr) },
        |x| x
    );
    wsum!(
        wsum_f16_512,
        "avx512f,avx512bw,avx512vl,f16c,fma",
        Half,
        16,
        __m512,
        _mm512_setzero_ps,
        _mm512_set1_ps,
        _mm512_mul_ps,
        _mm512_add_ps,
        _mm512_loadu_ps,
        _mm512_storeu_ps,
        // SAFETY: `ptr` points at 16 values (32 bytes) inside `v` (see the caller).
        |ptr| _mm512_cvtph_ps(unsafe { _mm256_loadu_si256(ptr.cast()) }),
        |x| x.to_f32()
    );
    wsum!(
        wsum_f32_256,
        "avx2,f16c,fma",
        f32,
        8,
        __m256,
        _mm256_setzero_ps,
        _mm256_set1_ps,
        _mm256_mul_ps,
        _mm256_add_ps,
        _mm256_loadu_ps,
        _mm256_storeu_ps,
        // SAFETY: `ptr` points at 8 values inside `v` (see the caller).
        |ptr| unsafe { _mm256_loadu_ps(ptr) },
        |x| x
    );
    wsum!(
        wsum_f16_256,
        "avx2,f16c,fma",
        Half,
        8,
        __m256,
        _mm256_setzero_ps,
        _mm256_set1_ps,
        _mm256_mul_ps,
        _mm256_add_ps,
        _mm256_loadu_ps,
        _mm256_storeu_ps,
        // SAFETY: `ptr` points at 8 values (16 bytes) inside `v` (see the caller).
        |ptr| _mm256_cvtph_ps(unsafe { _mm_loadu_si128(ptr.cast()) }),
        |x| x.to_f32()
    );
}
