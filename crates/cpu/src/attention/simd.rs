//! The inner loops of attention: `q·k` for one f32 key, and `acc += p·v` for one
//! value row, with AVX-512 and AVX2 (+ F16C, FMA) paths chosen once per backend and a portable
//! fallback.
//!
//! A backend uses one path for every call, so results do not depend on the batch. The AVX2
//! and AVX-512 paths give the same bits (AVX2 runs the sixteen lanes of AVX-512 as two
//! halves); the portable one differs from them in the rounding of the dot products (eight
//! lanes, no fused multiply-add);
//! `axpy` multiplies and adds with separate roundings on every path (the compiler vectorizes the
//! same loop for each instruction set and does not contract it), so it gives the same bits
//! everywhere.

use specula_quant::QType;
use specula_quant::blocks::{BlockTurbo2, BlockTurbo3, BlockTurbo4, Half, QK_TURBO};
use specula_quant::dot::SimdLevel;
use specula_quant::turbo::CENTROIDS_4;

/// The loops of one instruction set.
#[derive(Clone, Copy)]
pub(crate) struct AttnKernels {
    /// `Σ q·k`, f32 keys.
    pub(crate) dot_f32: fn(&[f32], &[f32]) -> f32,
    /// `acc[i] += p·v[i]`.
    pub(crate) axpy: fn(&mut [f32], f32, &[f32]),
    /// `out[i] = f32(h[i])` (exact on every path).
    pub(crate) f16_to_f32: fn(&[Half], &mut [f32]),
    /// turbo4 blocks → `centroid · norm` values (the bits of the scalar decoder on every path).
    pub(crate) turbo4_decode: fn(&[BlockTurbo4], &mut [f32]),
    /// One turbo4 block of a head stored in two stages, with the fine stage's weight β → the
    /// 64 values attention reads, `y_i + β·y_{64+i}` of the decoded `y` (multiply and add
    /// rounded apart: the bits of decoding, then [`super::fold_stages`], on every path), in
    /// [`read_order`].
    /// Row `j < n` starts at `bytes[j · stride]` and holds one such block; its 64 values go
    /// to `out[64·j..]`.
    pub(crate) turbo4_two: fn(bytes: &[u8], stride: usize, n: usize, beta: f32, out: &mut [f32]),
    /// turbo2 and turbo3 blocks → `centroid · norm` (the scalar decoder's bits).
    pub(crate) turbo2_decode: fn(&[BlockTurbo2], &mut [f32]),
    pub(crate) turbo3_decode: fn(&[BlockTurbo3], &mut [f32]),
    /// bf16 values (little-endian byte pairs) → f32 (exact on every path).
    pub(crate) bf16_to_f32: fn(&[u8], &mut [f32]),
    /// `s[i] = e^(s[i] − m)`: the softmax weights (the bits of glibc's `expf` on FMA CPUs on
    /// the AVX paths, [`super::expf`]; the C library's `expf` on the portable one).
    pub(crate) exp_sub: fn(&mut [f32], f32),
    /// The largest of the values, −∞ for none (NaN-free input: the maximum is exact, so every
    /// path gives the same value).
    pub(crate) max: fn(&[f32]) -> f32,
    /// The tile loops (AVX-512 only), with the bits of the loops above.
    pub(crate) tile: Option<super::tile::TileKernels>,
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
                return AttnKernels {
                    tile: super::tile::for_level(level),
                    ..x86::AVX512
                };
            }
            if matches!(level, SimdLevel::Avx512 | SimdLevel::Avx2) && x86::avx2_supported() {
                return AttnKernels {
                    tile: super::tile::for_level(SimdLevel::Avx2),
                    ..x86::AVX2
                };
            }
        }
        let _ = level;
        PORTABLE
    }
}

const PORTABLE: AttnKernels = AttnKernels {
    dot_f32: |q, k| dot_portable(q, k, |x| x),
    axpy: axpy_portable,
    f16_to_f32: f16_to_f32_portable,
    turbo4_decode: turbo4_decode_portable,
    turbo4_two: turbo4_two_portable,
    turbo2_decode: |x, out| super::decode_head(QType::Turbo2, bytemuck::cast_slice(x), out),
    turbo3_decode: |x, out| super::decode_head(QType::Turbo3, bytemuck::cast_slice(x), out),
    bf16_to_f32: |x, out| super::decode_head(QType::BF16, x, out),
    exp_sub: super::expf::exp_sub_portable,
    max: max_portable,
    tile: None,
};

/// turbo4 blocks → `centroid · norm`, nibble by nibble (low nibble first).
pub(crate) fn turbo4_decode_portable(x: &[BlockTurbo4], out: &mut [f32]) {
    assert_eq!(
        x.len() * QK_TURBO,
        out.len(),
        "attention: turbo4 row length"
    );
    for (b, o) in x.iter().zip(out.chunks_exact_mut(QK_TURBO)) {
        let n = b.norm.to_f32();
        for (&q, o) in b.qs.iter().zip(o.chunks_exact_mut(2)) {
            o[0] = CENTROIDS_4[usize::from(q & 15)] * n;
            o[1] = CENTROIDS_4[usize::from(q >> 4)] * n;
        }
    }
}

/// The largest value, −∞ for none.
/// Panics unless `n` rows of one turbo4 block at `stride` fit in `bytes` and their 64
/// values each in `out`.
fn check_two(bytes: &[u8], stride: usize, n: usize, out: &[f32]) {
    assert!(
        n == 0 || ((n - 1) * stride + BLOCK_TURBO4 <= bytes.len() && 64 * n <= out.len()),
        "attention: {n} two-stage turbo4 rows of stride {stride} in {} bytes, {} outputs",
        bytes.len(),
        out.len()
    );
}

const BLOCK_TURBO4: usize = std::mem::size_of::<BlockTurbo4>();

/// The order in which a head stored in two turbo stages is read: within each 16 values,
/// slot `2k + h` holds value `k + 8h` (`out[16v + 2k + h] = x[16v + k + 8h]`), the order in
/// which one shift per 64-bit lane spreads 16 packed 4-bit codes. Queries are put in this
/// order, and the accumulated values taken back out of it ([`natural_order`]), so a score or
/// an output is the same sum whatever the order; the order only lets the AVX-512 decoder skip
/// a permutation per 16 codes.
pub(crate) fn read_order(x: &[f32], out: &mut [f32]) {
    for (o, x) in out.chunks_exact_mut(16).zip(x.chunks_exact(16)) {
        for k in 0..8 {
            o[2 * k] = x[k];
            o[2 * k + 1] = x[k + 8];
        }
    }
}

/// The inverse of [`read_order`].
pub(crate) fn natural_order(x: &[f32], out: &mut [f32]) {
    for (o, x) in out.chunks_exact_mut(16).zip(x.chunks_exact(16)) {
        for k in 0..8 {
            o[k] = x[2 * k];
            o[k + 8] = x[2 * k + 1];
        }
    }
}

/// [`AttnKernels::turbo4_two`], row by row: each block decoded, its stages folded, put in
/// [`read_order`].
pub(crate) fn turbo4_two_portable(
    bytes: &[u8],
    stride: usize,
    n: usize,
    beta: f32,
    out: &mut [f32],
) {
    check_two(bytes, stride, n, out);
    let mut y = [0.0f32; QK_TURBO];
    let mut f = [0.0f32; QK_TURBO / 2];
    for (j, o) in out.chunks_exact_mut(64).take(n).enumerate() {
        let b: &[BlockTurbo4] = bytemuck::cast_slice(&bytes[j * stride..j * stride + BLOCK_TURBO4]);
        turbo4_decode_portable(b, &mut y);
        super::fold_stages(&y, beta, &mut f);
        read_order(&f, o);
    }
}

fn max_portable(s: &[f32]) -> f32 {
    s.iter().copied().fold(f32::NEG_INFINITY, f32::max)
}

/// `out[i] = f32(h[i])`.
pub(crate) fn f16_to_f32_portable(h: &[Half], out: &mut [f32]) {
    assert_eq!(h.len(), out.len(), "attention: f16 row length");
    for (o, &x) in out.iter_mut().zip(h) {
        *o = x.to_f32();
    }
}

/// `acc[i] += p·v[i]`, multiply and add rounded separately.
#[inline]
pub(crate) fn axpy_portable(acc: &mut [f32], p: f32, v: &[f32]) {
    assert_eq!(acc.len(), v.len(), "attention: value row length");
    for (a, &x) in acc.iter_mut().zip(v) {
        *a += p * x;
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
pub(super) mod x86 {
    use std::arch::x86_64::*;

    use specula_quant::turbo::{CENTROIDS_2, CENTROIDS_3};

    use super::{
        AttnKernels, BlockTurbo2, BlockTurbo3, BlockTurbo4, CENTROIDS_4, Half, QK_TURBO,
        axpy_portable,
    };

    /// AVX-512 F/BW/VL with F16C and FMA (the tile loops check this too).
    pub(in crate::attention) fn avx512_supported() -> bool {
        is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512dq")
            && is_x86_feature_detected!("avx512vl")
            && is_x86_feature_detected!("f16c")
            && is_x86_feature_detected!("fma")
    }

    /// AVX2 with F16C and FMA (the tile loops check this too).
    pub(in crate::attention) fn avx2_supported() -> bool {
        is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("f16c")
            && is_x86_feature_detected!("fma")
    }

    /// Builds a table whose entries check the slices and call the `unsafe` kernels of one
    /// instruction set. Each table is only handed out by [`AttnKernels::for_level`] after the
    /// matching `*_supported` check.
    macro_rules! table {
        ($dot32:ident, $axpy:ident, $cvt:ident, $t4:ident, $t4two:ident, $exp:ident) => {
            AttnKernels {
                dot_f32: |q, k| {
                    assert_eq!(q.len(), k.len(), "attention: q and k lengths differ");
                    // SAFETY: the table is only handed out after the check that this CPU has
                    // the kernels' features (`AttnKernels::for_level`); lengths are equal
                    // (checked above).
                    unsafe { $dot32(q, k) }
                },
                axpy: |acc, p, v| {
                    assert_eq!(acc.len(), v.len(), "attention: value row length");
                    // SAFETY: as above.
                    unsafe { $axpy(acc, p, v) }
                },
                f16_to_f32: |h, out| {
                    assert_eq!(h.len(), out.len(), "attention: f16 row length");
                    // SAFETY: as above; both slices have one length.
                    unsafe { $cvt(h, out) }
                },
                turbo4_decode: |x, out| {
                    assert_eq!(
                        x.len() * QK_TURBO,
                        out.len(),
                        "attention: turbo4 row length"
                    );
                    // SAFETY: as above; `out` holds 128 values per block.
                    unsafe { $t4(x, out) }
                },
                turbo4_two: |bytes, stride, n, beta, out| {
                    super::check_two(bytes, stride, n, out);
                    // SAFETY: as above; every row read and value written lies inside its
                    // slice (checked above).
                    unsafe { $t4two(bytes.as_ptr(), stride, n, beta, out.as_mut_ptr()) }
                },
                turbo2_decode: |x, out| {
                    assert_eq!(
                        x.len() * QK_TURBO,
                        out.len(),
                        "attention: turbo2 row length"
                    );
                    // SAFETY: as above (both instruction sets include AVX2); `out` holds 128
                    // values per block.
                    unsafe { turbo2_256(x, out) }
                },
                turbo3_decode: |x, out| {
                    assert_eq!(
                        x.len() * QK_TURBO,
                        out.len(),
                        "attention: turbo3 row length"
                    );
                    // SAFETY: as above.
                    unsafe { turbo3_256(x, out) }
                },
                bf16_to_f32: |x, out| {
                    assert_eq!(x.len(), 2 * out.len(), "attention: bf16 row length");
                    // SAFETY: as above; two bytes per output.
                    unsafe { bf16_256(x, out) }
                },
                // SAFETY: as above.
                exp_sub: |s, m| unsafe { crate::attention::expf::x86::$exp(s, m) },
                // SAFETY: as above.
                max: |s| unsafe { max_256(s) },
                tile: None,
            }
        };
    }

    pub(super) const AVX512: AttnKernels = table!(
        dot_f32_512,
        axpy_512,
        cvt_f16_512,
        turbo4_512,
        turbo4_two_512,
        exp_sub_512
    );
    pub(super) const AVX2: AttnKernels = table!(
        dot_f32_256,
        axpy_256,
        cvt_f16_256,
        turbo4_256,
        turbo4_two_256,
        exp_sub_256
    );

    /// `out = f32(h)`, 16 values per conversion.
    ///
    /// # Safety
    /// The CPU must support AVX-512 F/BW/VL and F16C; `h` and `out` have one length.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c,fma")]
    unsafe fn cvt_f16_512(h: &[Half], out: &mut [f32]) {
        let n = h.len();
        let hp = h.as_ptr().cast::<u16>();
        let mut i = 0;
        while i + 16 <= n {
            // SAFETY: i + 16 ≤ n = h.len() = out.len(); `Half` is two bytes.
            unsafe {
                let v = _mm512_cvtph_ps(_mm256_loadu_si256(hp.add(i).cast()));
                _mm512_storeu_ps(out.as_mut_ptr().add(i), v);
            }
            i += 16;
        }
        for (o, x) in out[i..].iter_mut().zip(&h[i..]) {
            *o = x.to_f32();
        }
    }

    /// `out = f32(h)`, 8 values per conversion.
    ///
    /// # Safety
    /// The CPU must support AVX2 and F16C; `h` and `out` have one length.
    #[target_feature(enable = "avx2,f16c,fma")]
    unsafe fn cvt_f16_256(h: &[Half], out: &mut [f32]) {
        let n = h.len();
        let hp = h.as_ptr().cast::<u16>();
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: i + 8 ≤ n = h.len() = out.len(); `Half` is two bytes.
            unsafe {
                let v = _mm256_cvtph_ps(_mm_loadu_si128(hp.add(i).cast()));
                _mm256_storeu_ps(out.as_mut_ptr().add(i), v);
            }
            i += 8;
        }
        for (o, x) in out[i..].iter_mut().zip(&h[i..]) {
            *o = x.to_f32();
        }
    }

    /// The 32 nibbles of 16 code bytes as 32 bytes `[lo0, hi0, lo1, hi1, …]`: the code order.
    #[inline]
    #[target_feature(enable = "avx2,f16c,fma")]
    fn nibbles(b: __m128i) -> (__m128i, __m128i) {
        let m = _mm_set1_epi8(0x0F);
        let lo = _mm_and_si128(b, m);
        let hi = _mm_and_si128(_mm_srli_epi16::<4>(b), m);
        (_mm_unpacklo_epi8(lo, hi), _mm_unpackhi_epi8(lo, hi))
    }

    /// turbo4 decode, 16 codes per `permutexvar` lookup.
    ///
    /// # Safety
    /// The CPU must support AVX-512 F/BW/VL and F16C; `out.len() == 128 · x.len()`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c,fma")]
    unsafe fn turbo4_512(x: &[BlockTurbo4], out: &mut [f32]) {
        // SAFETY: CENTROIDS_4 holds 16 f32.
        let table = unsafe { _mm512_loadu_ps(CENTROIDS_4.as_ptr()) };
        for (bi, b) in x.iter().enumerate() {
            let n = _mm512_set1_ps(b.norm.to_f32());
            let o = &mut out[bi * QK_TURBO..(bi + 1) * QK_TURBO];
            for c in 0..4 {
                // SAFETY: 16 bytes at 16·c inside the 64-byte `qs`.
                let bytes = unsafe { _mm_loadu_si128(b.qs.as_ptr().add(16 * c).cast()) };
                let (a, z) = nibbles(bytes);
                for (k, v) in [a, z].into_iter().enumerate() {
                    let idx = _mm512_cvtepu8_epi32(v);
                    let y = _mm512_mul_ps(_mm512_permutexvar_ps(idx, table), n);
                    // SAFETY: 16 values at 32·c + 16·k inside the 128 of this block.
                    unsafe { _mm512_storeu_ps(o.as_mut_ptr().add(32 * c + 16 * k), y) };
                }
            }
        }
    }

    /// One two-stage turbo4 row at `p` (66 bytes: the f16 norm, then 64 code bytes) as four
    /// vectors of its 64 read values ([`super::read_order`]): the centroids times the norm
    /// `t₁ = c·n` and `t₂ = β·t₁` (16 values each, one vector), then per 16 codes (8 bytes,
    /// broadcast to every 64-bit lane) a shift per lane puts code `k` in the low bits of lane
    /// `2k` and code `k + 8` in those of lane `2k + 1` (`permutexvar` reads the low 4 bits),
    /// and `t₁[a] + t₂[b]` — the bits of decoding and then folding.
    ///
    /// # Safety
    /// 66 bytes at `p`; the CPU supports AVX-512 F/BW/VL and F16C.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c,fma")]
    pub(in crate::attention) unsafe fn turbo4_two_row_512(p: *const u8, beta: f32) -> [__m512; 4] {
        // SAFETY: CENTROIDS_4 holds 16 f32; the caller's 66 bytes at p.
        unsafe {
            let table = _mm512_loadu_ps(CENTROIDS_4.as_ptr());
            let shifts = _mm512_set_epi64(28, 24, 20, 16, 12, 8, 4, 0);
            let norm = _mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(
                p.cast::<u16>().read_unaligned(),
            )));
            let t1 = _mm512_mul_ps(table, _mm512_broadcastss_ps(norm));
            let t2 = _mm512_mul_ps(_mm512_set1_ps(beta), t1);
            let mut y = [_mm512_setzero_ps(); 4];
            for (v, y) in y.iter_mut().enumerate() {
                let a = p.add(2 + 8 * v).cast::<i64>().read_unaligned();
                let b = p.add(34 + 8 * v).cast::<i64>().read_unaligned();
                let a = _mm512_srlv_epi64(_mm512_set1_epi64(a), shifts);
                let b = _mm512_srlv_epi64(_mm512_set1_epi64(b), shifts);
                *y = _mm512_add_ps(_mm512_permutexvar_ps(a, t1), _mm512_permutexvar_ps(b, t2));
            }
            y
        }
    }

    /// Two-stage turbo4 rows, each by [`turbo4_two_row_512`].
    ///
    /// # Safety
    /// The CPU must support AVX-512 F/BW/VL and F16C; `n` rows of 66 bytes at `bytes`
    /// (stride `stride`), `64 · n` values at `out`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c,fma")]
    unsafe fn turbo4_two_512(bytes: *const u8, stride: usize, n: usize, beta: f32, out: *mut f32) {
        for j in 0..n {
            // SAFETY: row j's 66 bytes lie at `bytes + j·stride` and its 64 values at
            // `out + 64·j` (the caller's promise).
            unsafe {
                let y = turbo4_two_row_512(bytes.add(j * stride), beta);
                for (v, &y) in y.iter().enumerate() {
                    _mm512_storeu_ps(out.add(64 * j + 16 * v), y);
                }
            }
        }
    }

    /// Two-stage turbo4 rows, each decoded by [`turbo4_256`], folded and put in
    /// [`super::read_order`].
    ///
    /// # Safety
    /// The CPU must support AVX2, F16C and FMA; as [`turbo4_two_512`].
    #[target_feature(enable = "avx2,f16c,fma")]
    unsafe fn turbo4_two_256(bytes: *const u8, stride: usize, n: usize, beta: f32, out: *mut f32) {
        let mut y = [0.0f32; QK_TURBO];
        let mut f = [0.0f32; QK_TURBO / 2];
        for j in 0..n {
            // SAFETY: the caller's rows and outputs; the block is copied out (no alignment
            // is assumed).
            unsafe {
                let b: BlockTurbo4 = bytes.add(j * stride).cast::<BlockTurbo4>().read_unaligned();
                turbo4_256(std::slice::from_ref(&b), &mut y);
                crate::attention::fold_stages(&y, beta, &mut f);
                let o = std::slice::from_raw_parts_mut(out.add(64 * j), 64);
                super::read_order(&f, o);
            }
        }
    }

    /// turbo4 decode, 8 codes per pair of `permutevar8x32` lookups.
    ///
    /// # Safety
    /// The CPU must support AVX2, F16C and FMA; `out.len() == 128 · x.len()`.
    #[target_feature(enable = "avx2,f16c,fma")]
    unsafe fn turbo4_256(x: &[BlockTurbo4], out: &mut [f32]) {
        // SAFETY: CENTROIDS_4 holds 16 f32.
        let (t_lo, t_hi) = unsafe {
            (
                _mm256_loadu_ps(CENTROIDS_4.as_ptr()),
                _mm256_loadu_ps(CENTROIDS_4.as_ptr().add(8)),
            )
        };
        for (bi, b) in x.iter().enumerate() {
            let n = _mm256_set1_ps(b.norm.to_f32());
            let o = &mut out[bi * QK_TURBO..(bi + 1) * QK_TURBO];
            for c in 0..4 {
                // SAFETY: 16 bytes at 16·c inside the 64-byte `qs`.
                let bytes = unsafe { _mm_loadu_si128(b.qs.as_ptr().add(16 * c).cast()) };
                let (a, z) = nibbles(bytes);
                for (k, v) in [a, z].into_iter().enumerate() {
                    for h in 0..2 {
                        let v8 = if h == 0 { v } else { _mm_srli_si128::<8>(v) };
                        let idx = _mm256_cvtepu8_epi32(v8);
                        let lo = _mm256_permutevar8x32_ps(t_lo, idx);
                        let hi = _mm256_permutevar8x32_ps(t_hi, idx);
                        let sel = _mm256_castsi256_ps(_mm256_slli_epi32::<28>(idx));
                        let y = _mm256_mul_ps(_mm256_blendv_ps(lo, hi, sel), n);
                        // SAFETY: 8 values at 32·c + 16·k + 8·h inside this block's 128.
                        unsafe {
                            _mm256_storeu_ps(o.as_mut_ptr().add(32 * c + 16 * k + 8 * h), y);
                        };
                    }
                }
            }
        }
    }

    /// Sixteen codes (bytes, each below 8) of a turbo2 / turbo3 block looked up in `table`
    /// and scaled by the norm, into `o[..16]`: `table[c] · n`, the scalar decoder's product.
    ///
    /// # Safety
    /// AVX2; 16 values at `o`.
    #[inline]
    #[target_feature(enable = "avx2,f16c,fma")]
    unsafe fn lookup16(codes: __m128i, table: __m256, n: __m256, o: *mut f32) {
        for h in 0..2 {
            let c8 = if h == 0 {
                codes
            } else {
                _mm_srli_si128::<8>(codes)
            };
            let y = _mm256_mul_ps(_mm256_permutevar8x32_ps(table, _mm256_cvtepu8_epi32(c8)), n);
            // SAFETY: the caller's 16 values at o.
            unsafe { _mm256_storeu_ps(o.add(8 * h), y) };
        }
    }

    /// The 2-bit codes of 16 bytes (code `4i + k` at bits `2k` of byte `i`) as four vectors of
    /// sixteen codes in code order.
    #[inline]
    #[target_feature(enable = "avx2,f16c,fma")]
    fn crumbs(b: __m128i) -> [__m128i; 4] {
        let m = _mm_set1_epi8(3);
        let c0 = _mm_and_si128(b, m);
        let c1 = _mm_and_si128(_mm_srli_epi16::<2>(b), m);
        let c2 = _mm_and_si128(_mm_srli_epi16::<4>(b), m);
        let c3 = _mm_and_si128(_mm_srli_epi16::<6>(b), m);
        let (p01l, p01h) = (_mm_unpacklo_epi8(c0, c1), _mm_unpackhi_epi8(c0, c1));
        let (p23l, p23h) = (_mm_unpacklo_epi8(c2, c3), _mm_unpackhi_epi8(c2, c3));
        [
            _mm_unpacklo_epi16(p01l, p23l),
            _mm_unpackhi_epi16(p01l, p23l),
            _mm_unpacklo_epi16(p01h, p23h),
            _mm_unpackhi_epi16(p01h, p23h),
        ]
    }

    /// turbo2 decode, 8 codes per `permutevar8x32` lookup.
    ///
    /// # Safety
    /// The CPU must support AVX2, F16C and FMA; `out.len() == 128 · x.len()`.
    #[target_feature(enable = "avx2,f16c,fma")]
    unsafe fn turbo2_256(x: &[BlockTurbo2], out: &mut [f32]) {
        let t = CENTROIDS_2;
        let table = _mm256_setr_ps(t[0], t[1], t[2], t[3], t[0], t[1], t[2], t[3]);
        for (bi, b) in x.iter().enumerate() {
            let n = _mm256_set1_ps(b.norm.to_f32());
            for c in 0..2 {
                // SAFETY: 16 bytes at 16·c inside the 32-byte `qs`.
                let bytes = unsafe { _mm_loadu_si128(b.qs.as_ptr().add(16 * c).cast()) };
                for (k, codes) in crumbs(bytes).into_iter().enumerate() {
                    // SAFETY: 16 values at 64·c + 16·k inside this block's 128 of `out`.
                    unsafe {
                        lookup16(
                            codes,
                            table,
                            n,
                            out.as_mut_ptr().add(bi * QK_TURBO + 64 * c + 16 * k),
                        )
                    };
                }
            }
        }
    }

    /// turbo3 decode: the low two bits of each code as turbo2's, the third from `signs`
    /// (bit `j % 8` of byte `j / 8`), then one lookup per eight codes.
    ///
    /// # Safety
    /// The CPU must support AVX2, F16C and FMA; `out.len() == 128 · x.len()`.
    #[target_feature(enable = "avx2,f16c,fma")]
    unsafe fn turbo3_256(x: &[BlockTurbo3], out: &mut [f32]) {
        // SAFETY: CENTROIDS_3 holds 8 f32.
        let table = unsafe { _mm256_loadu_ps(CENTROIDS_3.as_ptr()) };
        let bit = _mm_set1_epi64x(0x8040_2010_0804_0201_u64.cast_signed());
        for (bi, b) in x.iter().enumerate() {
            let n = _mm256_set1_ps(b.norm.to_f32());
            for c in 0..2 {
                // SAFETY: 16 bytes at 16·c inside the 32-byte `qs`.
                let bytes = unsafe { _mm_loadu_si128(b.qs.as_ptr().add(16 * c).cast()) };
                for (k, codes) in crumbs(bytes).into_iter().enumerate() {
                    // Codes 64·c + 16·k + i take bit i % 8 of sign byte 8·c + 2·k + i / 8.
                    let g = 8 * c + 2 * k;
                    // Each sign byte repeated over eight bytes (u64: 0xFF · 0x0101… fits).
                    let spread = |x: u8| (u64::from(x) * 0x0101_0101_0101_0101).cast_signed();
                    let s = _mm_set_epi64x(spread(b.signs[g + 1]), spread(b.signs[g]));
                    let third =
                        _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(s, bit), bit), _mm_set1_epi8(4));
                    let codes = _mm_or_si128(codes, third);
                    // SAFETY: 16 values at 64·c + 16·k inside this block's 128 of `out`.
                    unsafe {
                        lookup16(
                            codes,
                            table,
                            n,
                            out.as_mut_ptr().add(bi * QK_TURBO + 64 * c + 16 * k),
                        )
                    };
                }
            }
        }
    }

    /// `out = f32(bf16)`: each value's two bytes as the high half of an f32, 8 at a time.
    ///
    /// # Safety
    /// The CPU must support AVX2; `x.len() == 2 · out.len()`.
    #[target_feature(enable = "avx2,f16c,fma")]
    unsafe fn bf16_256(x: &[u8], out: &mut [f32]) {
        let n = out.len();
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: i + 8 ≤ n: 16 bytes at 2·i inside `x`, 8 values at i inside `out`.
            unsafe {
                let h = _mm_loadu_si128(x.as_ptr().add(2 * i).cast());
                let v = _mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h));
                _mm256_storeu_ps(out.as_mut_ptr().add(i), _mm256_castsi256_ps(v));
            }
            i += 8;
        }
        for (o, b) in out[i..].iter_mut().zip(x[2 * i..].chunks_exact(2)) {
            *o = f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16);
        }
    }

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

    /// `Σ q·k` with the lanes and the order of [`dot_f32_512`], so that both paths give the
    /// same bits: its 16-lane accumulator is two 8-lane halves here, the last partial chunk is
    /// padded with zeros (as the masked loads there), and the lane sum is `_mm512_reduce_add_ps`'s
    /// order (`hsum256` of the halves' sum).
    ///
    /// # Safety
    /// The CPU must support AVX2, F16C and FMA; `q` and `k` have one length.
    #[target_feature(enable = "avx2,f16c,fma")]
    unsafe fn dot_f32_256(q: &[f32], k: &[f32]) -> f32 {
        let (qc, qt) = q.as_chunks::<16>();
        let (kc, kt) = k.as_chunks::<16>();
        let mut acc = [_mm256_setzero_ps(); 2];
        for (a, b) in qc.iter().zip(kc) {
            fma16(&mut acc, a, b);
        }
        if !qt.is_empty() {
            let (mut a, mut b) = ([0.0f32; 16], [0.0f32; 16]);
            a[..qt.len()].copy_from_slice(qt);
            b[..kt.len()].copy_from_slice(kt);
            fma16(&mut acc, &a, &b);
        }
        hsum256(_mm256_add_ps(acc[0], acc[1]))
    }

    /// `acc += a·b` over sixteen lanes held as two halves.
    #[inline]
    #[target_feature(enable = "avx2,f16c,fma")]
    fn fma16(acc: &mut [__m256; 2], a: &[f32; 16], b: &[f32; 16]) {
        for (h, acc) in acc.iter_mut().enumerate() {
            // SAFETY: reads eight of the sixteen values of `a` and of `b`.
            let (x, y) = unsafe {
                (
                    _mm256_loadu_ps(a.as_ptr().add(8 * h)),
                    _mm256_loadu_ps(b.as_ptr().add(8 * h)),
                )
            };
            *acc = _mm256_fmadd_ps(x, y, *acc);
        }
    }

    /// The sum of eight lanes, pairwise.
    #[inline]
    #[target_feature(enable = "avx2,f16c,fma")]
    fn hsum256(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
    }

    /// The largest value, eight lanes at a time (both instruction sets).
    ///
    /// # Safety
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn max_256(s: &[f32]) -> f32 {
        let (chunks, tail) = s.as_chunks::<8>();
        let mut m = _mm256_set1_ps(f32::NEG_INFINITY);
        for c in chunks {
            // SAFETY: eight values of the chunk.
            m = _mm256_max_ps(m, unsafe { _mm256_loadu_ps(c.as_ptr()) });
        }
        let h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
        let h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        let h = _mm_max_ss(h, _mm_movehdup_ps(h));
        tail.iter().copied().fold(_mm_cvtss_f32(h), f32::max)
    }

    /// `acc += p·v`, vectorized by the compiler for AVX-512.
    ///
    /// # Safety
    /// The CPU must support AVX-512 F/BW/VL.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c,fma")]
    unsafe fn axpy_512(acc: &mut [f32], p: f32, v: &[f32]) {
        axpy_portable(acc, p, v);
    }

    /// `acc += p·v`, vectorized by the compiler for AVX2.
    ///
    /// # Safety
    /// The CPU must support AVX2, F16C and FMA.
    #[target_feature(enable = "avx2,f16c,fma")]
    unsafe fn axpy_256(acc: &mut [f32], p: f32, v: &[f32]) {
        axpy_portable(acc, p, v);
    }
}
