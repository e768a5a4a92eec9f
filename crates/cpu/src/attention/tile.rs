//! Tile loops of attention on AVX-512 and AVX2: the scores of a block of queries against a
//! block of keys, and `acc += p·v` for a block of queries with the accumulators in registers.
//! f32 and f16 rows are read in place. One generic body per loop, written over the `Isa`
//! vector operations, is compiled once per instruction set.
//!
//! Each result is computed by the operations, in the order, of the per-key loops they replace
//! ([`super::simd::AttnKernels`]): a score is `dot_f32`'s fused multiply-add chain over the
//! head in sixteen lanes (two halves on AVX2) and its lane sum, the same bits on both; an accumulator gets `acc + p·v` with the
//! multiply and the add rounded separately, key after key, skipping zero weights. So the tiles
//! change no bit of attention's output, and greedy tokens stay those of the per-key loops —
//! several tests hold greedy output to llama.cpp's fixtures where real models sit on near-ties.
//! The softmax weights keep the C library's `expf` for the same reason (a vectorized `exp`,
//! correctly rounded, differs from it by one ulp on about one input in two thousand).

/// Rows of keys or values read in place: row `j < n` starts at `bytes[j · stride]` and holds
/// `dim` f32 or f16 values.
#[derive(Clone, Copy)]
pub(crate) struct Rows<'a> {
    pub(crate) bytes: &'a [u8],
    pub(crate) stride: usize,
    pub(crate) n: usize,
    pub(crate) dim: usize,
    pub(crate) f16: bool,
}

impl<'a> Rows<'a> {
    /// The first `n` rows of `dim` f32 values packed in `buf`.
    pub(crate) fn f32(buf: &'a [f32], n: usize, dim: usize) -> Self {
        Rows {
            bytes: bytemuck::cast_slice(&buf[..n * dim]),
            stride: 4 * dim,
            n,
            dim,
            f16: false,
        }
    }

    /// Panics unless every row lies inside `bytes`.
    fn check(&self) {
        let esz = if self.f16 { 2 } else { 4 };
        assert!(
            self.n == 0 || (self.n - 1) * self.stride + self.dim * esz <= self.bytes.len(),
            "attention: {} rows of {} values with stride {} past {} bytes",
            self.n,
            self.dim,
            self.stride,
            self.bytes.len()
        );
    }
}

/// Rows of Q8_0 blocks read in place: row `j < n` starts at `bytes[j · stride]` and holds
/// `blocks` blocks of 34 bytes (an f16 scale, 32 signed bytes).
#[derive(Clone, Copy)]
pub(crate) struct Q8Rows<'a> {
    pub(crate) bytes: &'a [u8],
    pub(crate) stride: usize,
    pub(crate) n: usize,
    pub(crate) blocks: usize,
}

/// The largest head a Q8_0 tile takes (blocks of 32 values): 256 values.
pub(crate) const Q8_MAX_BLOCKS: usize = 8;
const Q8_BLOCK: usize = 34;

/// The tile loops of one instruction set.
#[derive(Clone, Copy)]
pub(crate) struct TileKernels {
    /// `out[a·os + j] = Σ_d q[a·qs + d] · k_j[d]` for `a < nq`, `j < k.n`, `d < k.dim`.
    pub(crate) scores: fn(q: &[f32], qs: usize, nq: usize, k: Rows<'_>, out: &mut [f32], os: usize),
    /// `acc[a·as + d] += w[a·ws + j] · v_j[d]` for `a < nq`, keys `j < v.n` in order (zero
    /// weights skipped), `d < v.dim`.
    pub(crate) pv: fn(w: &[f32], ws: usize, nq: usize, v: Rows<'_>, acc: &mut [f32], as_: usize),
    /// Q8_0 keys against queries quantized to Q8_0 (`nq` rows of `k.blocks` blocks at
    /// `q[a · qs..]`): `out[a·os + j]` = the Q8_0 · Q8_0 dot product of the block kernels
    /// (`Σ_b f32(isum_b) · (d_k · d_q)`, block after block from 0), for `j < k.n`.
    pub(crate) scores_q8_0:
        fn(q: &[u8], qs: usize, nq: usize, k: Q8Rows<'_>, out: &mut [f32], os: usize),
    /// Q8_0 rows to f32: `out[j·os + i] = q_i · d` of row `j < v.n` (the dequantizer's bits).
    pub(crate) widen_q8_0: fn(v: Q8Rows<'_>, out: &mut [f32], os: usize),
}

impl std::fmt::Debug for TileKernels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TileKernels").finish_non_exhaustive()
    }
}

/// The tile loops for `level` where it has them (AVX-512, AVX2 with F16C and FMA).
pub(crate) fn for_level(level: specula_quant::dot::SimdLevel) -> Option<TileKernels> {
    #[cfg(target_arch = "x86_64")]
    {
        use super::simd::x86::{avx2_supported, avx512_supported};
        use specula_quant::dot::SimdLevel;
        if level == SimdLevel::Avx512 && avx512_supported() && avx2_supported() {
            return Some(x86::AVX512);
        }
        if matches!(level, SimdLevel::Avx512 | SimdLevel::Avx2) && avx2_supported() {
            return Some(x86::AVX2);
        }
    }
    let _ = level;
    None
}

/// Whether a head of `dim` values goes through the tile loops: whole vectors only (every
/// head dim in use — 64, 80, 96, 112, 128, 256 — is a multiple of 16), so that no loop has a
/// partial last chunk whose order the per-key loops define differently per path.
pub(crate) fn fits(dim: usize) -> bool {
    dim.is_multiple_of(16) && dim > 0
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{Q8_BLOCK, Q8_MAX_BLOCKS, Q8Rows, Rows, TileKernels, fits};

    /// The vector operations the loops are written in, for one instruction set. Every
    /// method is `#[inline(always)]` and only called from a function compiled with that
    /// instruction set's features.
    trait Isa {
        /// `LANES` f32.
        type F: Copy;
        const LANES: usize;
        /// Queries per block: as many as keep a block's accumulators and operands in the
        /// vector registers (AVX2 has 16, AVX-512 32).
        const MAX_Q: usize;
        unsafe fn zero() -> Self::F;
        unsafe fn load(p: *const f32) -> Self::F;
        /// `LANES` f16 at `p`, widened (exactly).
        unsafe fn load_h(p: *const u8) -> Self::F;
        unsafe fn store(p: *mut f32, v: Self::F);
        unsafe fn splat(x: f32) -> Self::F;
        unsafe fn fmadd(a: Self::F, b: Self::F, c: Self::F) -> Self::F;
        unsafe fn add(a: Self::F, b: Self::F) -> Self::F;
        unsafe fn mul(a: Self::F, b: Self::F) -> Self::F;
        /// The lane sum of the path's `dot_f32`.
        unsafe fn reduce(v: Self::F) -> f32;
    }

    #[derive(Clone, Copy)]
    struct V512;
    #[derive(Clone, Copy)]
    struct V256;

    impl Isa for V512 {
        type F = __m512;
        const LANES: usize = 16;
        const MAX_Q: usize = 4;
        #[inline(always)]
        unsafe fn zero() -> __m512 {
            // SAFETY: only called with the AVX-512 features (see the trait).
            unsafe { _mm512_setzero_ps() }
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> __m512 {
            // SAFETY: the caller's sixteen values at p.
            unsafe { _mm512_loadu_ps(p) }
        }
        #[inline(always)]
        unsafe fn load_h(p: *const u8) -> __m512 {
            // SAFETY: the caller's sixteen f16 at p.
            unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())) }
        }
        #[inline(always)]
        unsafe fn store(p: *mut f32, v: __m512) {
            // SAFETY: the caller's sixteen values at p.
            unsafe { _mm512_storeu_ps(p, v) }
        }
        #[inline(always)]
        unsafe fn splat(x: f32) -> __m512 {
            // SAFETY: as `zero`.
            unsafe { _mm512_set1_ps(x) }
        }
        #[inline(always)]
        unsafe fn fmadd(a: __m512, b: __m512, c: __m512) -> __m512 {
            // SAFETY: as `zero`.
            unsafe { _mm512_fmadd_ps(a, b, c) }
        }
        #[inline(always)]
        unsafe fn add(a: __m512, b: __m512) -> __m512 {
            // SAFETY: as `zero`.
            unsafe { _mm512_add_ps(a, b) }
        }
        #[inline(always)]
        unsafe fn mul(a: __m512, b: __m512) -> __m512 {
            // SAFETY: as `zero`.
            unsafe { _mm512_mul_ps(a, b) }
        }
        #[inline(always)]
        unsafe fn reduce(v: __m512) -> f32 {
            // SAFETY: as `zero`.
            unsafe { _mm512_reduce_add_ps(v) }
        }
    }

    impl Isa for V256 {
        type F = __m256;
        const LANES: usize = 8;
        const MAX_Q: usize = 2;
        #[inline(always)]
        unsafe fn zero() -> __m256 {
            // SAFETY: only called with the AVX2 features (see the trait).
            unsafe { _mm256_setzero_ps() }
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> __m256 {
            // SAFETY: the caller's eight values at p.
            unsafe { _mm256_loadu_ps(p) }
        }
        #[inline(always)]
        unsafe fn load_h(p: *const u8) -> __m256 {
            // SAFETY: the caller's eight f16 at p.
            unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p.cast())) }
        }
        #[inline(always)]
        unsafe fn store(p: *mut f32, v: __m256) {
            // SAFETY: the caller's eight values at p.
            unsafe { _mm256_storeu_ps(p, v) }
        }
        #[inline(always)]
        unsafe fn splat(x: f32) -> __m256 {
            // SAFETY: as `zero`.
            unsafe { _mm256_set1_ps(x) }
        }
        #[inline(always)]
        unsafe fn fmadd(a: __m256, b: __m256, c: __m256) -> __m256 {
            // SAFETY: as `zero`.
            unsafe { _mm256_fmadd_ps(a, b, c) }
        }
        #[inline(always)]
        unsafe fn add(a: __m256, b: __m256) -> __m256 {
            // SAFETY: as `zero`.
            unsafe { _mm256_add_ps(a, b) }
        }
        #[inline(always)]
        unsafe fn mul(a: __m256, b: __m256) -> __m256 {
            // SAFETY: as `zero`.
            unsafe { _mm256_mul_ps(a, b) }
        }
        #[inline(always)]
        unsafe fn reduce(v: __m256) -> f32 {
            // The pairwise sum of `simd::x86::hsum256`.
            // SAFETY: as `zero`.
            unsafe {
                let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
                let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
                _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
            }
        }
    }

    /// AVX2 with AVX-512's sixteen lanes as two halves, for the scores: a score's fused
    /// multiply-add chain and lane sum are then those of AVX-512 (the value tiles, which do
    /// not sum across lanes, give the same bits at any width and use [`V256`]).
    #[derive(Clone, Copy)]
    struct V256x2;

    impl Isa for V256x2 {
        type F = [__m256; 2];
        const LANES: usize = 16;
        const MAX_Q: usize = 1;
        #[inline(always)]
        unsafe fn zero() -> [__m256; 2] {
            // SAFETY: only called with the AVX2 features (see the trait).
            unsafe { [V256::zero(); 2] }
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> [__m256; 2] {
            // SAFETY: the caller's sixteen values at p.
            unsafe { [V256::load(p), V256::load(p.add(8))] }
        }
        #[inline(always)]
        unsafe fn load_h(p: *const u8) -> [__m256; 2] {
            // SAFETY: the caller's sixteen f16 at p.
            unsafe { [V256::load_h(p), V256::load_h(p.add(16))] }
        }
        #[inline(always)]
        unsafe fn store(p: *mut f32, v: [__m256; 2]) {
            // SAFETY: the caller's sixteen values at p.
            unsafe {
                V256::store(p, v[0]);
                V256::store(p.add(8), v[1]);
            }
        }
        #[inline(always)]
        unsafe fn splat(x: f32) -> [__m256; 2] {
            // SAFETY: as `zero`.
            unsafe { [V256::splat(x); 2] }
        }
        #[inline(always)]
        unsafe fn fmadd(a: [__m256; 2], b: [__m256; 2], c: [__m256; 2]) -> [__m256; 2] {
            // SAFETY: as `zero`.
            unsafe { [V256::fmadd(a[0], b[0], c[0]), V256::fmadd(a[1], b[1], c[1])] }
        }
        #[inline(always)]
        unsafe fn add(a: [__m256; 2], b: [__m256; 2]) -> [__m256; 2] {
            // SAFETY: as `zero`.
            unsafe { [V256::add(a[0], b[0]), V256::add(a[1], b[1])] }
        }
        #[inline(always)]
        unsafe fn mul(a: [__m256; 2], b: [__m256; 2]) -> [__m256; 2] {
            // SAFETY: as `zero`.
            unsafe { [V256::mul(a[0], b[0]), V256::mul(a[1], b[1])] }
        }
        #[inline(always)]
        unsafe fn reduce(v: [__m256; 2]) -> f32 {
            // `_mm512_reduce_add_ps`'s order: the halves added, then `V256::reduce`.
            // SAFETY: as `zero`.
            unsafe { V256::reduce(V256::add(v[0], v[1])) }
        }
    }

    /// Builds the table of one instruction set: entries check their slices, then call the
    /// loops compiled with its features. Only handed out by [`super::for_level`] after the
    /// matching `simd::x86::*_supported` check.
    macro_rules! table {
        ($scores:ty, $pv:ty, $features:literal) => {{
            #[target_feature(enable = $features)]
            unsafe fn scores_f(
                q: *const f32,
                qs: usize,
                nq: usize,
                k: Rows<'_>,
                out: *mut f32,
                os: usize,
            ) {
                // SAFETY: the caller's bounds and features.
                unsafe { scores::<$scores>(q, qs, nq, k, out, os) }
            }
            #[target_feature(enable = $features)]
            unsafe fn pv_f(
                w: *const f32,
                ws: usize,
                nq: usize,
                v: Rows<'_>,
                acc: *mut f32,
                as_: usize,
            ) {
                // SAFETY: the caller's bounds and features.
                unsafe { pv::<$pv>(w, ws, nq, v, acc, as_) }
            }
            TileKernels {
                scores: |q, qs, nq, k, out, os| {
                    k.check();
                    if nq == 0 || k.n == 0 {
                        return;
                    }
                    assert!(
                        fits(k.dim)
                            && (nq - 1) * qs + k.dim <= q.len()
                            && (nq - 1) * os + k.n <= out.len(),
                        "attention: score tile bounds"
                    );
                    // SAFETY: the CPU has the features (see `table!`); every query, key and
                    // output touched lies inside its slice (checked above).
                    unsafe { scores_f(q.as_ptr(), qs, nq, k, out.as_mut_ptr(), os) }
                },
                pv: |w, ws, nq, v, acc, as_| {
                    v.check();
                    if nq == 0 || v.n == 0 {
                        return;
                    }
                    assert!(
                        fits(v.dim)
                            && (nq - 1) * ws + v.n <= w.len()
                            && (nq - 1) * as_ + v.dim <= acc.len(),
                        "attention: value tile bounds"
                    );
                    // SAFETY: as above.
                    unsafe { pv_f(w.as_ptr(), ws, nq, v, acc.as_mut_ptr(), as_) }
                },
                scores_q8_0: |q, qs, nq, k, out, os| {
                    if nq == 0 || k.n == 0 {
                        return;
                    }
                    assert!(
                        k.blocks > 0
                            && k.blocks <= Q8_MAX_BLOCKS
                            && (k.n - 1) * k.stride + k.blocks * Q8_BLOCK <= k.bytes.len()
                            && (nq - 1) * qs + k.blocks * Q8_BLOCK <= q.len()
                            && (nq - 1) * os + k.n <= out.len(),
                        "attention: Q8_0 score tile bounds"
                    );
                    // SAFETY: every CPU given a table has AVX2, FMA and F16C (`for_level`);
                    // every block read and score written lies inside its slice (checked above).
                    unsafe { scores_q8_0_256(q.as_ptr(), qs, nq, k, out.as_mut_ptr(), os) }
                },
                widen_q8_0: |v, out, os| {
                    if v.n == 0 {
                        return;
                    }
                    assert!(
                        v.blocks > 0
                            && (v.n - 1) * v.stride + v.blocks * Q8_BLOCK <= v.bytes.len()
                            && (v.n - 1) * os + v.blocks * 32 <= out.len(),
                        "attention: Q8_0 value tile bounds"
                    );
                    // SAFETY: as above.
                    unsafe { widen_q8_0_256(v, out.as_mut_ptr(), os) }
                },
            }
        }};
    }

    pub(super) const AVX512: TileKernels =
        table!(V512, V512, "avx512f,avx512bw,avx512vl,avx2,f16c,fma");
    pub(super) const AVX2: TileKernels = table!(V256x2, V256, "avx2,f16c,fma");

    /// One vector of a row at `p`: f32, or f16 widened.
    ///
    /// # Safety
    /// `I::LANES` values at `p`; the caller has `I`'s features.
    #[inline(always)]
    unsafe fn load<I: Isa, const H: bool>(p: *const u8) -> I::F {
        // SAFETY: the caller's promise.
        unsafe { if H { I::load_h(p) } else { I::load(p.cast()) } }
    }

    /// # Safety
    /// As the table's `scores` checks; `I`'s features.
    #[inline(always)]
    unsafe fn scores<I: Isa>(
        q: *const f32,
        qs: usize,
        nq: usize,
        k: Rows<'_>,
        out: *mut f32,
        os: usize,
    ) {
        let mut a = 0;
        while a < nq {
            let na = (nq - a).min(I::MAX_Q);
            let mut j = 0;
            while j < k.n {
                let nj = if k.n - j >= 4 { 4 } else { 1 };
                // SAFETY: queries a..a+na and keys j..j+nj are inside the checked bounds.
                unsafe {
                    let (qp, op) = (q.add(a * qs), out.add(a * os + j));
                    let kp = k.bytes.as_ptr().add(j * k.stride);
                    macro_rules! go {
                        ($nq:literal, $nk:literal, $h:literal) => {
                            block::<I, $nq, $nk, $h>(qp, qs, kp, k, op, os)
                        };
                    }
                    match (na, nj, k.f16) {
                        (4, 4, true) => go!(4, 4, true),
                        (3, 4, true) => go!(3, 4, true),
                        (2, 4, true) => go!(2, 4, true),
                        (1, 4, true) => go!(1, 4, true),
                        (4, _, true) => go!(4, 1, true),
                        (3, _, true) => go!(3, 1, true),
                        (2, _, true) => go!(2, 1, true),
                        (_, _, true) => go!(1, 1, true),
                        (4, 4, false) => go!(4, 4, false),
                        (3, 4, false) => go!(3, 4, false),
                        (2, 4, false) => go!(2, 4, false),
                        (1, 4, false) => go!(1, 4, false),
                        (4, _, false) => go!(4, 1, false),
                        (3, _, false) => go!(3, 1, false),
                        (2, _, false) => go!(2, 1, false),
                        (_, _, false) => go!(1, 1, false),
                    }
                }
                j += nj;
            }
            a += na;
        }
    }

    /// `NQ` queries × `NK` keys: one fused multiply-add chain per score over the head, then
    /// the path's lane sum — `dot_f32`'s operations.
    ///
    /// # Safety
    /// `NQ` query rows of `k.dim` values at `q` (stride `qs`), `NK` key rows at `kp`
    /// (stride `k.stride`), `NQ` output rows of `NK` values at `out` (stride `os`).
    #[inline(always)]
    unsafe fn block<I: Isa, const NQ: usize, const NK: usize, const H: bool>(
        q: *const f32,
        qs: usize,
        kp: *const u8,
        k: Rows<'_>,
        out: *mut f32,
        os: usize,
    ) {
        let esz = if H { 2 } else { 4 };
        // SAFETY: the caller's bounds and features; `k.dim` is a multiple of the lanes.
        unsafe {
            let mut acc = [[I::zero(); NK]; NQ];
            let mut d = 0;
            while d < k.dim {
                let mut qv = [I::zero(); NQ];
                for (a, v) in qv.iter_mut().enumerate() {
                    *v = I::load(q.add(a * qs + d));
                }
                let mut kv = [I::zero(); NK];
                for (b, v) in kv.iter_mut().enumerate() {
                    *v = load::<I, H>(kp.add(b * k.stride + d * esz));
                }
                for (row, &qa) in acc.iter_mut().zip(&qv) {
                    for (x, &kb) in row.iter_mut().zip(&kv) {
                        *x = I::fmadd(qa, kb, *x);
                    }
                }
                d += I::LANES;
            }
            for (a, row) in acc.iter().enumerate() {
                for (b, &v) in row.iter().enumerate() {
                    *out.add(a * os + b) = I::reduce(v);
                }
            }
        }
    }

    /// # Safety
    /// As the table's `pv` checks; `I`'s features.
    #[inline(always)]
    unsafe fn pv<I: Isa>(
        w: *const f32,
        ws: usize,
        nq: usize,
        v: Rows<'_>,
        acc: *mut f32,
        as_: usize,
    ) {
        let mut a = 0;
        while a < nq {
            let na = (nq - a).min(I::MAX_Q);
            let mut d = 0;
            while d < v.dim {
                let wide = v.dim - d >= 4 * I::LANES;
                // SAFETY: queries a..a+na and outputs d.. are inside the checked bounds.
                unsafe {
                    let (wp, ap) = (w.add(a * ws), acc.add(a * as_));
                    macro_rules! go {
                        ($nq:literal, $nv:literal, $h:literal) => {
                            pv_block::<I, $nq, $nv, $h>(wp, ws, v, d, ap, as_)
                        };
                    }
                    match (na, wide, v.f16) {
                        (4, true, true) => go!(4, 4, true),
                        (3, true, true) => go!(3, 4, true),
                        (2, true, true) => go!(2, 4, true),
                        (_, true, true) => go!(1, 4, true),
                        (4, false, true) => go!(4, 1, true),
                        (3, false, true) => go!(3, 1, true),
                        (2, false, true) => go!(2, 1, true),
                        (_, false, true) => go!(1, 1, true),
                        (4, true, false) => go!(4, 4, false),
                        (3, true, false) => go!(3, 4, false),
                        (2, true, false) => go!(2, 4, false),
                        (_, true, false) => go!(1, 4, false),
                        (4, false, false) => go!(4, 1, false),
                        (3, false, false) => go!(3, 1, false),
                        (2, false, false) => go!(2, 1, false),
                        (_, false, false) => go!(1, 1, false),
                    }
                }
                d += if wide { 4 * I::LANES } else { I::LANES };
            }
            a += na;
        }
    }

    /// `NQ` queries × `NV` vectors of outputs from `d`, in registers over every key:
    /// `acc + w·v`, multiply and add rounded separately, key after key, zero weights skipped
    /// (`axpy`'s operations for each output).
    ///
    /// # Safety
    /// `NQ` weight rows of `v.n` values at `w` (stride `ws`), `NQ` accumulator rows of `v.dim`
    /// at `acc` (stride `as_`), `d + NV·LANES ≤ v.dim`.
    #[inline(always)]
    unsafe fn pv_block<I: Isa, const NQ: usize, const NV: usize, const H: bool>(
        w: *const f32,
        ws: usize,
        v: Rows<'_>,
        d: usize,
        acc: *mut f32,
        as_: usize,
    ) {
        let esz = if H { 2 } else { 4 };
        // SAFETY: the caller's bounds and features.
        unsafe {
            let mut r = [[I::zero(); NV]; NQ];
            for (a, row) in r.iter_mut().enumerate() {
                for (c, x) in row.iter_mut().enumerate() {
                    *x = I::load(acc.add(a * as_ + d + I::LANES * c));
                }
            }
            for j in 0..v.n {
                let vp = v.bytes.as_ptr().add(j * v.stride + d * esz);
                let mut vv = [I::zero(); NV];
                for (c, x) in vv.iter_mut().enumerate() {
                    *x = load::<I, H>(vp.add(I::LANES * c * esz));
                }
                for (a, row) in r.iter_mut().enumerate() {
                    let p = *w.add(a * ws + j);
                    if p != 0.0 {
                        let pb = I::splat(p);
                        for (x, &y) in row.iter_mut().zip(&vv) {
                            *x = I::add(*x, I::mul(pb, y));
                        }
                    }
                }
            }
            for (a, row) in r.iter().enumerate() {
                for (c, &x) in row.iter().enumerate() {
                    I::store(acc.add(a * as_ + d + I::LANES * c), x);
                }
            }
        }
    }

    /// The f16 scale at the start of a Q8_0 block.
    ///
    /// # Safety
    /// Two bytes at `p`.
    #[inline(always)]
    unsafe fn scale(p: *const u8) -> f32 {
        // SAFETY: the caller's two bytes.
        let b = unsafe { [*p, *p.add(1)] };
        specula_quant::blocks::Half(b).to_f32()
    }

    /// Q8_0 rows to f32, eight values per conversion: `q · d` with one rounding, as the
    /// dequantizer.
    ///
    /// # Safety
    /// As the table's `widen_q8_0` checks; AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn widen_q8_0_256(v: Q8Rows<'_>, out: *mut f32, os: usize) {
        for j in 0..v.n {
            for b in 0..v.blocks {
                // SAFETY: row j < v.n, block b < v.blocks, 32 outputs from j·os + 32·b:
                // inside the checked slices.
                unsafe {
                    let p = v.bytes.as_ptr().add(j * v.stride + b * Q8_BLOCK);
                    let d = _mm256_set1_ps(scale(p));
                    let o = out.add(j * os + 32 * b);
                    for c in 0..4 {
                        let x = _mm_loadl_epi64(p.add(2 + 8 * c).cast());
                        let f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(x));
                        _mm256_storeu_ps(o.add(8 * c), _mm256_mul_ps(f, d));
                    }
                }
            }
        }
    }

    /// The lane sums of eight i32 vectors: lane `j` of the result is the sum of `v[j]`
    /// (integer sums are exact, so the order is free).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn hsum8_epi32(v: [__m256i; 8]) -> __m256i {
        let a01 = _mm256_hadd_epi32(v[0], v[1]);
        let a23 = _mm256_hadd_epi32(v[2], v[3]);
        let a45 = _mm256_hadd_epi32(v[4], v[5]);
        let a67 = _mm256_hadd_epi32(v[6], v[7]);
        let b03 = _mm256_hadd_epi32(a01, a23);
        let b47 = _mm256_hadd_epi32(a45, a67);
        let lo = _mm256_permute2x128_si256::<0x20>(b03, b47);
        let hi = _mm256_permute2x128_si256::<0x31>(b03, b47);
        _mm256_add_epi32(lo, hi)
    }

    /// Q8_0 scores of a tile, eight keys at a time: the keys' bytes widened to i16 once per
    /// group and shared by every query; per query and block, the eight integer sums at once,
    /// then `f32(isum) · (d_k · d_q)` added block after block in eight f32 lanes — each lane
    /// the operations of the Q8_0 · Q8_0 block kernel for its key.
    ///
    /// # Safety
    /// As the table's `scores_q8_0` checks; AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn scores_q8_0_256(
        q: *const u8,
        qs: usize,
        nq: usize,
        k: Q8Rows<'_>,
        out: *mut f32,
        os: usize,
    ) {
        let nb = k.blocks;
        let mut kw = [_mm256_setzero_si256(); 2 * 8 * Q8_MAX_BLOCKS];
        let mut kd = [[0.0f32; 8]; Q8_MAX_BLOCKS];
        let mut g = 0;
        while g < k.n {
            let m = (k.n - g).min(8);
            for (b, kd) in kd.iter_mut().enumerate().take(nb) {
                for (j, d) in kd.iter_mut().enumerate() {
                    let i = (b * 8 + j) * 2;
                    if j < m {
                        // SAFETY: key g + j < k.n, block b < k.blocks: inside the checked
                        // bytes.
                        unsafe {
                            let p = k.bytes.as_ptr().add((g + j) * k.stride + b * Q8_BLOCK);
                            *d = scale(p);
                            kw[i] = _mm256_cvtepi8_epi16(_mm_loadu_si128(p.add(2).cast()));
                            kw[i + 1] = _mm256_cvtepi8_epi16(_mm_loadu_si128(p.add(18).cast()));
                        }
                    } else {
                        *d = 0.0;
                        kw[i] = _mm256_setzero_si256();
                        kw[i + 1] = _mm256_setzero_si256();
                    }
                }
            }
            for a in 0..nq {
                let mut acc = _mm256_setzero_ps();
                for (b, kd) in kd.iter().enumerate().take(nb) {
                    // SAFETY: query a < nq, block b < k.blocks: inside the checked bytes.
                    let (q0, q1, dq) = unsafe {
                        let p = q.add(a * qs + b * Q8_BLOCK);
                        (
                            _mm256_cvtepi8_epi16(_mm_loadu_si128(p.add(2).cast())),
                            _mm256_cvtepi8_epi16(_mm_loadu_si128(p.add(18).cast())),
                            scale(p),
                        )
                    };
                    let mut v = [_mm256_setzero_si256(); 8];
                    for (j, v) in v.iter_mut().enumerate() {
                        let i = (b * 8 + j) * 2;
                        *v = _mm256_add_epi32(
                            _mm256_madd_epi16(q0, kw[i]),
                            _mm256_madd_epi16(q1, kw[i + 1]),
                        );
                    }
                    let isum = _mm256_cvtepi32_ps(hsum8_epi32(v));
                    // SAFETY: eight f32 of the array.
                    let d =
                        _mm256_mul_ps(unsafe { _mm256_loadu_ps(kd.as_ptr()) }, _mm256_set1_ps(dq));
                    acc = _mm256_add_ps(acc, _mm256_mul_ps(isum, d));
                }
                let mut t = [0.0f32; 8];
                // SAFETY: eight f32 of the array.
                unsafe { _mm256_storeu_ps(t.as_mut_ptr(), acc) };
                for (j, &x) in t.iter().enumerate().take(m) {
                    // SAFETY: output row a < nq, key g + j < k.n: inside the checked slice.
                    unsafe { *out.add(a * os + g + j) = x };
                }
            }
            g += 8;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attention::simd::AttnKernels;
    use specula_quant::blocks::Half;
    use specula_quant::dot::SimdLevel;

    fn values(n: usize, seed: u8) -> Vec<f32> {
        (0..n)
            .map(|i| {
                let t = f32::from(u16::try_from((i * 7 + usize::from(seed)) % 65_521).unwrap());
                (t * 0.731).sin() * (1.0 + (t * 0.113).cos())
            })
            .collect()
    }

    fn bits(x: &[f32]) -> Vec<u32> {
        x.iter().map(|v| v.to_bits()).collect()
    }

    /// Scores are `dot_f32`'s bits for every block shape, odd head dims, f32 and f16 keys.
    #[test]
    fn scores_are_the_per_key_dot_products() {
        for level in [SimdLevel::Avx512, SimdLevel::Avx2] {
            let Some(t) = for_level(level) else { continue };
            let dot = AttnKernels::for_level(level).dot_f32;
            for dim in [64, 80, 128, 16, 256] {
                for (nq, nk) in [(1, 1), (3, 8), (4, 5), (7, 32), (9, 3)] {
                    let q = values(nq * dim, 1);
                    let kf = values(nk * dim, 2);
                    let kh: Vec<Half> = kf.iter().map(|&x| Half::from_f32(x)).collect();
                    for f16 in [false, true] {
                        let bytes: Vec<u8> = if f16 {
                            bytemuck::cast_slice(&kh).to_vec()
                        } else {
                            bytemuck::cast_slice(&kf).to_vec()
                        };
                        let k = Rows {
                            bytes: &bytes,
                            stride: dim * if f16 { 2 } else { 4 },
                            n: nk,
                            dim,
                            f16,
                        };
                        let mut got = vec![0.0; nq * 40];
                        (t.scores)(&q, dim, nq, k, &mut got, 40);
                        for a in 0..nq {
                            for j in 0..nk {
                                let key: Vec<f32> = if f16 {
                                    kh[j * dim..(j + 1) * dim]
                                        .iter()
                                        .map(|h| h.to_f32())
                                        .collect()
                                } else {
                                    kf[j * dim..(j + 1) * dim].to_vec()
                                };
                                let want = dot(&q[a * dim..(a + 1) * dim], &key);
                                assert_eq!(
                                    got[a * 40 + j].to_bits(),
                                    want.to_bits(),
                                    "{dim} {a} {j}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    /// Widened Q8_0 rows are the dequantizer's.
    #[test]
    fn widened_q8_0_rows_are_the_dequantizers() {
        use specula_quant::QType;
        for level in [SimdLevel::Avx512, SimdLevel::Avx2] {
            let Some(t) = for_level(level) else { continue };
            for dim in [32, 64, 128] {
                let rb = QType::Q8_0.row_bytes(dim).unwrap();
                let x = values(5 * dim, 9);
                let mut b = vec![0u8; 5 * rb];
                for (x, b) in x.chunks_exact(dim).zip(b.chunks_exact_mut(rb)) {
                    specula_quant::quantize_row(QType::Q8_0, x, b).unwrap();
                }
                let mut want = vec![0.0; 5 * dim];
                specula_quant::dequantize_row(QType::Q8_0, &b, &mut want).unwrap();
                let mut got = vec![0.0; 5 * (dim + 3)];
                let v = Q8Rows {
                    bytes: &b,
                    stride: rb,
                    n: 5,
                    blocks: dim / 32,
                };
                (t.widen_q8_0)(v, &mut got, dim + 3);
                for j in 0..5 {
                    assert_eq!(
                        bits(&got[j * (dim + 3)..j * (dim + 3) + dim]),
                        bits(&want[j * dim..(j + 1) * dim])
                    );
                }
            }
        }
    }

    /// Q8_0 score tiles are the block kernel's `q8_0_q8_0` bits for every head size and
    /// block shape.
    #[test]
    fn q8_0_score_tiles_are_the_block_dot_products() {
        use specula_quant::QType;
        for level in [SimdLevel::Avx512, SimdLevel::Avx2] {
            let Some(t) = for_level(level) else { continue };
            let Some(kernels) = specula_quant::dot::Kernels::for_level(level) else {
                continue;
            };
            for dim in [32, 64, 128, 96, 256] {
                let rb = QType::Q8_0.row_bytes(dim).unwrap();
                for (nq, nk) in [(1, 1), (3, 8), (4, 5), (7, 32), (9, 3), (2, 17)] {
                    let quant = |x: &[f32]| {
                        let mut b = vec![0u8; x.len() / dim * rb];
                        for (x, b) in x.chunks_exact(dim).zip(b.chunks_exact_mut(rb)) {
                            specula_quant::quantize_row(QType::Q8_0, x, b).unwrap();
                        }
                        b
                    };
                    let q = quant(&values(nq * dim, 7));
                    // Keys with a stride past the head (the other heads of a cell).
                    let stride = rb + 34;
                    let mut kb = vec![0u8; nk * stride];
                    let keys = quant(
                        &values(nk * dim, 8)
                            .iter()
                            .map(|x| x * 3.0)
                            .collect::<Vec<_>>(),
                    );
                    for j in 0..nk {
                        kb[j * stride..j * stride + rb]
                            .copy_from_slice(&keys[j * rb..(j + 1) * rb]);
                    }
                    let k = Q8Rows {
                        bytes: &kb,
                        stride,
                        n: nk,
                        blocks: dim / 32,
                    };
                    let mut got = vec![0.0; nq * 40];
                    (t.scores_q8_0)(&q, rb, nq, k, &mut got, 40);
                    for a in 0..nq {
                        for j in 0..nk {
                            let want = kernels.q8_0_q8_0(
                                bytemuck::cast_slice(&keys[j * rb..(j + 1) * rb]),
                                bytemuck::cast_slice(&q[a * rb..(a + 1) * rb]),
                            );
                            assert_eq!(
                                got[a * 40 + j].to_bits(),
                                want.to_bits(),
                                "{level:?} {dim} {a} {j}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// AVX2's and AVX-512's `dot_f32` give the same bits at every length, partial chunks
    /// included.
    #[test]
    fn avx2_and_avx512_dot_products_agree() {
        let (a, b) = (
            AttnKernels::for_level(SimdLevel::Avx512),
            AttnKernels::for_level(SimdLevel::Avx2),
        );
        if for_level(SimdLevel::Avx512).is_none() {
            return;
        }
        for n in 1..300 {
            let q = values(n, 5);
            let k: Vec<f32> = values(n + 3, 6)[3..].iter().map(|x| x * 1e3).collect();
            assert_eq!(
                (a.dot_f32)(&q, &k).to_bits(),
                (b.dot_f32)(&q, &k).to_bits(),
                "n = {n}"
            );
        }
    }

    /// `acc += p·v` per key in order, zero weights skipped: `axpy`'s bits.
    #[test]
    fn value_tiles_are_the_per_key_axpys() {
        for level in [SimdLevel::Avx512, SimdLevel::Avx2] {
            let Some(t) = for_level(level) else { continue };
            let axpy = AttnKernels::for_level(level).axpy;
            for dim in [64, 128, 80, 16, 208] {
                for (nq, nk) in [(1, 1), (3, 32), (4, 7), (6, 9)] {
                    let mut w = values(nq * nk, 3);
                    w[0] = 0.0;
                    let vf = values(nk * dim, 4);
                    let vh: Vec<Half> = vf.iter().map(|&x| Half::from_f32(x)).collect();
                    for f16 in [false, true] {
                        let bytes: Vec<u8> = if f16 {
                            bytemuck::cast_slice(&vh).to_vec()
                        } else {
                            bytemuck::cast_slice(&vf).to_vec()
                        };
                        let v = Rows {
                            bytes: &bytes,
                            stride: dim * if f16 { 2 } else { 4 },
                            n: nk,
                            dim,
                            f16,
                        };
                        let start = values(nq * dim, 5);
                        let mut got = start.clone();
                        (t.pv)(&w, nk, nq, v, &mut got, dim);
                        let mut want = start;
                        for j in 0..nk {
                            let row: Vec<f32> = if f16 {
                                vh[j * dim..(j + 1) * dim]
                                    .iter()
                                    .map(|h| h.to_f32())
                                    .collect()
                            } else {
                                vf[j * dim..(j + 1) * dim].to_vec()
                            };
                            for a in 0..nq {
                                let p = w[a * nk + j];
                                if p != 0.0 {
                                    axpy(&mut want[a * dim..(a + 1) * dim], p, &row);
                                }
                            }
                        }
                        assert_eq!(bits(&got), bits(&want), "{dim} {nq} {nk} {f16}");
                    }
                }
            }
        }
    }
}
