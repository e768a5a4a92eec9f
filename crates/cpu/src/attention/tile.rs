//! Tile loops of attention on AVX-512 and AVX2: the scores of a block of queries against a
//! block of keys, and `acc += p·v` for a block of queries with the accumulators in registers.
//! f32 and f16 rows are read in place. One generic body per loop, written over the `Isa`
//! vector operations, is compiled once per instruction set. Keys in a block format (Q8_0,
//! Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL) are scored in place against the quantized queries with
//! integer sums, and such values are widened to f32 once per tile ([`BlockFmt`]).
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

/// The block formats whose rows the tile loops read in place: each 32-value block holds an
/// f16 scale `d` (an f16 offset `m` for `_1`), and values that are small integers (`q − 8`,
/// `q`, `q − 16`, a table's entry) — a key's block dotted with a query's Q8_0 / Q8_1 block is
/// an exact integer sum times the scales, a value's block widens to `v · d (+ m)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum BlockFmt {
    Q8_0,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Iq4Nl,
}

impl BlockFmt {
    /// The format of a cache type, where the tile loops read it.
    pub(crate) fn of(ty: specula_quant::QType) -> Option<Self> {
        use specula_quant::QType;
        Some(match ty {
            QType::Q8_0 => Self::Q8_0,
            QType::Q4_0 => Self::Q4_0,
            QType::Q4_1 => Self::Q4_1,
            QType::Q5_0 => Self::Q5_0,
            QType::Q5_1 => Self::Q5_1,
            QType::IQ4_NL => Self::Iq4Nl,
            _ => return None,
        })
    }

    /// Bytes of one block.
    pub(crate) const fn bytes(self) -> usize {
        match self {
            Self::Q8_0 => 34,
            Self::Q4_0 | Self::Iq4Nl => 18,
            Self::Q4_1 => 20,
            Self::Q5_0 => 22,
            Self::Q5_1 => 24,
        }
    }

    /// Bytes of one block of the query a key block is dotted with: Q8_1 (`d`, `s = d·Σq`,
    /// 32 bytes) for the formats with an offset, else Q8_0.
    pub(crate) const fn query_bytes(self) -> usize {
        match self {
            Self::Q4_1 | Self::Q5_1 => 36,
            _ => 34,
        }
    }
}

/// Rows of blocks read in place: row `j < n` starts at `bytes[j · stride]` and holds `blocks`
/// blocks of `fmt`.
#[derive(Clone, Copy)]
pub(crate) struct BlockRows<'a> {
    pub(crate) bytes: &'a [u8],
    pub(crate) stride: usize,
    pub(crate) n: usize,
    pub(crate) blocks: usize,
    pub(crate) fmt: BlockFmt,
}

/// Rows of 64-value heads stored in two turbo4 stages, read in place: row `j < n` is the
/// 66-byte block at `bytes[j · stride]`, read as its 64 values `y_i + β·y_{64+i}` in
/// [`super::simd::read_order`] (`AttnKernels::turbo4_two`'s values).
#[derive(Clone, Copy)]
pub(crate) struct TurboRows<'a> {
    pub(crate) bytes: &'a [u8],
    pub(crate) stride: usize,
    pub(crate) n: usize,
    pub(crate) beta: f32,
}

impl TurboRows<'_> {
    /// Panics unless every row lies inside `bytes`.
    fn check(&self) {
        assert!(
            self.n == 0 || (self.n - 1) * self.stride + 66 <= self.bytes.len(),
            "attention: {} two-stage turbo4 rows with stride {} past {} bytes",
            self.n,
            self.stride,
            self.bytes.len()
        );
    }
}

/// Queries the fused two-stage turbo4 loops take at once (their accumulators stay in
/// registers); more go through decoded tiles, decoded once for all of them.
pub(crate) const TURBO_QUERIES: usize = 4;

/// The largest head a block tile takes (blocks of 32 values): 256 values.
pub(crate) const MAX_BLOCKS: usize = 8;

/// [`TileKernels::scores_turbo`]'s loop.
pub(crate) type ScoresTurbo =
    fn(q: &[f32], qs: usize, nq: usize, k: TurboRows<'_>, out: &mut [f32], os: usize);
/// [`TileKernels::pv_turbo`]'s loop.
pub(crate) type PvTurbo =
    fn(w: &[f32], ws: usize, nq: usize, v: TurboRows<'_>, acc: &mut [f32], as_: usize);

/// [`TileKernels::pv_blocks`]'s loop.
pub(crate) type PvBlocks =
    fn(w: &[f32], ws: usize, nq: usize, v: BlockRows<'_>, acc: &mut [f32], as_: usize);

/// Queries the fused block value loop ([`TileKernels::pv_blocks`]) is used for: it widens
/// each value block once per four queries (two for 128-value heads), so for more queries
/// widening the tile once ([`TileKernels::widen_blocks`]) is cheaper.
pub(crate) const PV_BLOCK_QUERIES: usize = 8;

/// Whether `t`'s fused block value loop takes `nq` queries over heads of `blocks` blocks:
/// heads of 64, 128 or 256 values, at most [`PV_BLOCK_QUERIES`] queries.
pub(crate) fn fused_blocks(t: TileKernels, nq: usize, blocks: usize) -> bool {
    t.pv_blocks.is_some() && nq <= PV_BLOCK_QUERIES && matches!(blocks, 2 | 4 | 8)
}

/// The tile loops of one instruction set.
#[derive(Clone, Copy)]
pub(crate) struct TileKernels {
    /// `out[a·os + j] = Σ_d q[a·qs + d] · k_j[d]` for `a < nq`, `j < k.n`, `d < k.dim`.
    pub(crate) scores: fn(q: &[f32], qs: usize, nq: usize, k: Rows<'_>, out: &mut [f32], os: usize),
    /// `acc[a·as + d] += w[a·ws + j] · v_j[d]` for `a < nq`, keys `j < v.n` in order (zero
    /// weights skipped), `d < v.dim`.
    pub(crate) pv: fn(w: &[f32], ws: usize, nq: usize, v: Rows<'_>, acc: &mut [f32], as_: usize),
    /// Block-format keys against queries quantized to the format's query type (`nq` rows of
    /// `k.blocks` blocks at `q[a · qs..]`): `out[a·os + j]` = the block kernel's dot product
    /// (`Σ_b term(isum_b, scales)`, block after block from 0, each term the kernel's
    /// operations in its order), for `j < k.n`.
    pub(crate) scores_blocks:
        fn(q: &[u8], qs: usize, nq: usize, k: BlockRows<'_>, out: &mut [f32], os: usize),
    /// Block rows to f32: `out[j·os + i]` = value `i` of row `j < v.n` (the dequantizer's bits).
    pub(crate) widen_blocks: fn(v: BlockRows<'_>, out: &mut [f32], os: usize),
    /// Two-stage turbo4 keys decoded in registers (AVX-512), for at most [`TURBO_QUERIES`]
    /// queries: `scores` over the keys' 64 read values, with its bits (`q` rows of 64 values
    /// in read order).
    pub(crate) scores_turbo: Option<ScoresTurbo>,
    /// Two-stage turbo4 values decoded in registers (AVX-512), for at most
    /// [`TURBO_QUERIES`] queries: `pv` over the rows' 64 read values, with its bits.
    pub(crate) pv_turbo: Option<PvTurbo>,
    /// Block-format values widened in registers (AVX-512): `pv` over the rows' values as
    /// `widen_blocks` gives them, with its bits, for heads of 64, 128 or 256 values.
    pub(crate) pv_blocks: Option<PvBlocks>,
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
            return Some(if is_x86_feature_detected!("avx512vnni") {
                x86::AVX512_VNNI
            } else {
                x86::AVX512
            });
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

    use super::super::simd::x86::turbo4_two_row_512;
    use super::{
        BlockFmt, BlockRows, MAX_BLOCKS, Rows, TURBO_QUERIES, TileKernels, TurboRows, fits,
    };

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
        /// `out[a·os + b] = reduce(acc[a][b])` for `a < NQ`, `b < NK`.
        #[inline(always)]
        unsafe fn reduce_store<const NQ: usize, const NK: usize>(
            acc: &[[Self::F; NK]; NQ],
            out: *mut f32,
            os: usize,
        ) {
            for (a, row) in acc.iter().enumerate() {
                for (b, &v) in row.iter().enumerate() {
                    // SAFETY: the caller's NQ rows of NK outputs at `out` (stride `os`).
                    unsafe { *out.add(a * os + b) = Self::reduce(v) };
                }
            }
        }
    }

    /// The lane sums of sixteen vectors at once, each with the pairing of
    /// `_mm512_reduce_add_ps` (lanes `i` and `i + 8`, then `i` and `i + 4`, `i` and `i + 2`,
    /// `i` and `i + 1`; float addition commutes, so each sum has the bits of `reduce`): 45
    /// shuffles and adds instead of 128. Lane `4g + t` of the result holds the sum of `v[4t + g]`.
    ///
    /// # Safety
    /// AVX-512 F.
    #[inline(always)]
    unsafe fn sums16(v: &[__m512; 16]) -> __m512 {
        // SAFETY: the caller's features.
        unsafe {
            // Lanes 0–7 of `l1[m]`: v[2m]'s halves added; lanes 8–15: v[2m + 1]'s.
            let l1: [__m512; 8] = std::array::from_fn(|m| {
                let (x, y) = (v[2 * m], v[2 * m + 1]);
                _mm512_add_ps(
                    _mm512_shuffle_f32x4::<0x44>(x, y),
                    _mm512_shuffle_f32x4::<0xEE>(x, y),
                )
            });
            // 128-bit lane g of `l2[p]`: v[4p + g]'s quarters added.
            let l2: [__m512; 4] = std::array::from_fn(|p| {
                let (x, y) = (l1[2 * p], l1[2 * p + 1]);
                _mm512_add_ps(
                    _mm512_shuffle_f32x4::<0x88>(x, y),
                    _mm512_shuffle_f32x4::<0xDD>(x, y),
                )
            });
            // Lane g, floats 0–1: v[8r + g]'s pairs; floats 2–3: v[8r + 4 + g]'s.
            let l3: [__m512; 2] = std::array::from_fn(|r| {
                let (x, y) = (_mm512_castps_pd(l2[2 * r]), _mm512_castps_pd(l2[2 * r + 1]));
                _mm512_add_ps(
                    _mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                    _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)),
                )
            });
            _mm512_add_ps(
                _mm512_shuffle_ps::<0x88>(l3[0], l3[1]),
                _mm512_shuffle_ps::<0xDD>(l3[0], l3[1]),
            )
        }
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
        /// Four keys: the sums of up to four queries' by one [`sums16`] (missing queries
        /// padded with zeros), query `a`'s four scores in 128-bit lane `a`.
        #[inline(always)]
        unsafe fn reduce_store<const NQ: usize, const NK: usize>(
            acc: &[[__m512; NK]; NQ],
            out: *mut f32,
            os: usize,
        ) {
            // SAFETY: as `zero`; the caller's NQ rows of NK outputs at `out`.
            unsafe {
                if NK == 4 && NQ <= 4 {
                    // v[4b + a] = acc[a][b]: its sum lands in lane 4a + b.
                    let mut v = [_mm512_setzero_ps(); 16];
                    for (a, row) in acc.iter().enumerate() {
                        for (b, &x) in row.iter().enumerate() {
                            v[4 * b + a] = x;
                        }
                    }
                    let s = sums16(&v);
                    let lanes = [
                        _mm512_castps512_ps128(s),
                        _mm512_extractf32x4_ps::<1>(s),
                        _mm512_extractf32x4_ps::<2>(s),
                        _mm512_extractf32x4_ps::<3>(s),
                    ];
                    for (a, &l) in lanes.iter().enumerate().take(NQ) {
                        _mm_storeu_ps(out.add(a * os), l);
                    }
                } else {
                    for (a, row) in acc.iter().enumerate() {
                        for (b, &v) in row.iter().enumerate() {
                            *out.add(a * os + b) = Self::reduce(v);
                        }
                    }
                }
            }
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
        ($scores:ty, $pv:ty, $features:literal, $scores_t:expr, $pv_t:expr) => {{
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
                scores_blocks: |q, qs, nq, k, out, os| {
                    if block_scores_bounds(q, qs, nq, k, out, os) {
                        // SAFETY: every CPU given a table has AVX2, FMA and F16C
                        // (`for_level`); every block read and score written lies inside its
                        // slice (checked).
                        unsafe { scores_blocks_256(q.as_ptr(), qs, nq, k, out.as_mut_ptr(), os) }
                    }
                },
                widen_blocks: |v, out, os| {
                    if widen_bounds(v, out, os) {
                        // SAFETY: as above.
                        unsafe { widen_blocks_256(v, out.as_mut_ptr(), os) }
                    }
                },
                scores_turbo: $scores_t,
                pv_turbo: $pv_t,
                pv_blocks: None,
            }
        }};
    }

    pub(super) const AVX512: TileKernels = table!(
        V512,
        V512,
        "avx512f,avx512bw,avx512vl,avx2,f16c,fma",
        Some(|q, qs, nq, k, out, os| {
            k.check();
            if nq == 0 || k.n == 0 {
                return;
            }
            assert!(
                nq <= TURBO_QUERIES
                    && (nq - 1) * qs + 64 <= q.len()
                    && (nq - 1) * os + k.n <= out.len(),
                "attention: turbo score tile bounds"
            );
            // SAFETY: the AVX-512 table is only handed out after the feature check
            // (`for_level`); every query, key and output touched lies inside its slice
            // (checked above).
            unsafe { scores_turbo_512(q.as_ptr(), qs, nq, k, out.as_mut_ptr(), os) }
        }),
        Some(|w, ws, nq, v, acc, as_| {
            v.check();
            if nq == 0 || v.n == 0 {
                return;
            }
            assert!(
                nq <= TURBO_QUERIES
                    && (nq - 1) * ws + v.n <= w.len()
                    && (nq - 1) * as_ + 64 <= acc.len(),
                "attention: turbo value tile bounds"
            );
            // SAFETY: as above.
            unsafe { pv_turbo_512(w.as_ptr(), ws, nq, v, acc.as_mut_ptr(), as_) }
        })
    );
    pub(super) const AVX2: TileKernels = table!(V256x2, V256, "avx2,f16c,fma", None, None);

    /// AVX-512's table with the block loops in sixteen lanes and VNNI's byte dot products.
    /// Only handed out after the AVX-512 and `avx512vnni` checks ([`super::for_level`]).
    pub(super) const AVX512_VNNI: TileKernels = TileKernels {
        scores_blocks: |q, qs, nq, k, out, os| {
            if block_scores_bounds(q, qs, nq, k, out, os) {
                // SAFETY: the table's features (see above); every block read and score
                // written lies inside its slice (checked).
                unsafe { scores_blocks_512(q.as_ptr(), qs, nq, k, out.as_mut_ptr(), os) }
            }
        },
        widen_blocks: |v, out, os| {
            if widen_bounds(v, out, os) {
                // SAFETY: as above.
                unsafe { widen_blocks_512(v, out.as_mut_ptr(), os) }
            }
        },
        pv_blocks: Some(|w, ws, nq, v, acc, as_| {
            if nq == 0 || v.n == 0 {
                return;
            }
            assert!(
                matches!(v.blocks, 2 | 4 | 8)
                    && (v.n - 1) * v.stride + v.blocks * v.fmt.bytes() <= v.bytes.len()
                    && (nq - 1) * ws + v.n <= w.len()
                    && (nq - 1) * as_ + 32 * v.blocks <= acc.len(),
                "attention: block value tile bounds"
            );
            // SAFETY: as above.
            unsafe { pv_blocks_512(w.as_ptr(), ws, nq, v, acc.as_mut_ptr(), as_) }
        }),
        ..AVX512
    };

    /// Checks a block score tile's slices (panics past them); false when it is empty.
    fn block_scores_bounds(
        q: &[u8],
        qs: usize,
        nq: usize,
        k: BlockRows<'_>,
        out: &[f32],
        os: usize,
    ) -> bool {
        if nq == 0 || k.n == 0 {
            return false;
        }
        let (kb, qb) = (k.fmt.bytes(), k.fmt.query_bytes());
        assert!(
            k.blocks > 0
                && k.blocks <= MAX_BLOCKS
                && (k.n - 1) * k.stride + k.blocks * kb <= k.bytes.len()
                && (nq - 1) * qs + k.blocks * qb <= q.len()
                && (nq - 1) * os + k.n <= out.len(),
            "attention: block score tile bounds"
        );
        true
    }

    /// Checks a block widening's slices (panics past them); false when it is empty.
    fn widen_bounds(v: BlockRows<'_>, out: &[f32], os: usize) -> bool {
        if v.n == 0 {
            return false;
        }
        assert!(
            v.blocks > 0
                && (v.n - 1) * v.stride + v.blocks * v.fmt.bytes() <= v.bytes.len()
                && (v.n - 1) * os + v.blocks * 32 <= out.len(),
            "attention: block value tile bounds"
        );
        true
    }

    /// [`TileKernels::scores_turbo`]: four keys' four vectors decoded at once
    /// ([`turbo4_two_row_512`]), then `block`'s chains — `fmadd(q, k, acc)` over the four
    /// vectors from zero — and lane sums; a last key or three one by one.
    ///
    /// # Safety
    /// As the table's `scores_turbo` checks; AVX-512 F/BW/VL, F16C and FMA.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,f16c,fma")]
    unsafe fn scores_turbo_512(
        q: *const f32,
        qs: usize,
        nq: usize,
        k: TurboRows<'_>,
        out: *mut f32,
        os: usize,
    ) {
        // SAFETY: the caller's bounds and features.
        unsafe {
            macro_rules! go {
                ($nq:literal, $nk:literal, $j:expr) => {{
                    let mut kv = [[V512::zero(); 4]; $nk];
                    for (b, x) in kv.iter_mut().enumerate() {
                        *x = turbo4_two_row_512(k.bytes.as_ptr().add(($j + b) * k.stride), k.beta);
                    }
                    let mut acc = [[V512::zero(); $nk]; $nq];
                    for d in 0..4 {
                        for (a, row) in acc.iter_mut().enumerate() {
                            let qv = V512::load(q.add(a * qs + 16 * d));
                            for (x, kb) in row.iter_mut().zip(&kv) {
                                *x = V512::fmadd(qv, kb[d], *x);
                            }
                        }
                    }
                    V512::reduce_store(&acc, out.add($j), os);
                }};
            }
            let mut j = 0;
            while j < k.n {
                let four = k.n - j >= 4;
                match (nq, four) {
                    (1, true) => go!(1, 4, j),
                    (2, true) => go!(2, 4, j),
                    (3, true) => go!(3, 4, j),
                    (_, true) => go!(4, 4, j),
                    (1, false) => go!(1, 1, j),
                    (2, false) => go!(2, 1, j),
                    (3, false) => go!(3, 1, j),
                    (_, false) => go!(4, 1, j),
                }
                j += if four { 4 } else { 1 };
            }
        }
    }

    /// [`TileKernels::pv_turbo`]: the accumulators of at most four queries in registers, each
    /// value row decoded once, then `pv_block`'s `acc + p·v` (zero weights skipped).
    ///
    /// # Safety
    /// As the table's `pv_turbo` checks; AVX-512 F/BW/VL, F16C and FMA.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,f16c,fma")]
    unsafe fn pv_turbo_512(
        w: *const f32,
        ws: usize,
        nq: usize,
        v: TurboRows<'_>,
        acc: *mut f32,
        as_: usize,
    ) {
        // SAFETY: the caller's bounds and features.
        unsafe {
            macro_rules! go {
                ($nq:literal) => {{
                    pv_rows::<V512, $nq, 4>(w, ws, v.n, acc, as_, |j| {
                        turbo4_two_row_512(v.bytes.as_ptr().add(j * v.stride), v.beta)
                    });
                }};
            }
            match nq {
                1 => go!(1),
                2 => go!(2),
                3 => go!(3),
                _ => go!(4),
            }
        }
    }

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
            I::reduce_store(&acc, out, os);
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
            pv_rows::<I, NQ, NV>(w, ws, v.n, acc.add(d), as_, |j| {
                let vp = v.bytes.as_ptr().add(j * v.stride + d * esz);
                let mut vv = [I::zero(); NV];
                for (c, x) in vv.iter_mut().enumerate() {
                    *x = load::<I, H>(vp.add(I::LANES * c * esz));
                }
                vv
            });
        }
    }

    /// The value loops' body: `NQ` queries' accumulators of `NV` vectors from `acc` in
    /// registers; for each row `j < n` its vectors from `row(j)`, then `acc + p·v` for every
    /// query whose weight `p` is not zero (multiply and add rounded apart: `axpy`'s
    /// operations); the accumulators stored back.
    ///
    /// # Safety
    /// `NQ` weight rows of `n` values at `w` (stride `ws`), `NQ` accumulator rows of
    /// `NV·LANES` values at `acc` (stride `as_`); `row` reads only what its caller may; `I`'s
    /// features.
    #[inline(always)]
    unsafe fn pv_rows<I: Isa, const NQ: usize, const NV: usize>(
        w: *const f32,
        ws: usize,
        n: usize,
        acc: *mut f32,
        as_: usize,
        row: impl Fn(usize) -> [I::F; NV],
    ) {
        // SAFETY: the caller's bounds and features.
        unsafe {
            let mut r = [[I::zero(); NV]; NQ];
            for (a, regs) in r.iter_mut().enumerate() {
                for (c, x) in regs.iter_mut().enumerate() {
                    *x = I::load(acc.add(a * as_ + I::LANES * c));
                }
            }
            for j in 0..n {
                let vv = row(j);
                for (a, regs) in r.iter_mut().enumerate() {
                    let p = *w.add(a * ws + j);
                    if p != 0.0 {
                        let pb = I::splat(p);
                        for (x, &y) in regs.iter_mut().zip(&vv) {
                            *x = I::add(*x, I::mul(pb, y));
                        }
                    }
                }
            }
            for (a, regs) in r.iter().enumerate() {
                for (c, &x) in regs.iter().enumerate() {
                    I::store(acc.add(a * as_ + I::LANES * c), x);
                }
            }
        }
    }

    /// The 32 values of a block as signed bytes (element `i` in byte `i`), its scale `d` and
    /// its offset `m` (0 without one).
    ///
    /// # Safety
    /// One block of `fmt` at `p`; AVX2.
    #[inline(always)]
    unsafe fn unpack(fmt: BlockFmt, p: *const u8) -> (__m256i, f32, f32) {
        // SAFETY: the caller's block at p.
        unsafe {
            let nibbles = |qs: *const u8| {
                let x = _mm_loadu_si128(qs.cast());
                let lo = _mm_and_si128(x, _mm_set1_epi8(0x0F));
                let hi = _mm_and_si128(_mm_srli_epi16::<4>(x), _mm_set1_epi8(0x0F));
                _mm256_set_m128i(hi, lo)
            };
            // Byte i all ones where bit i of the 32 bits at qh is set.
            let high_bits = |qh: *const u8| {
                let bits = u32::from_le_bytes([*qh, *qh.add(1), *qh.add(2), *qh.add(3)]);
                let spread = _mm256_shuffle_epi8(
                    _mm256_set1_epi32(i32::from_ne_bytes(bits.to_ne_bytes())),
                    _mm256_setr_epi64x(
                        0,
                        0x0101_0101_0101_0101,
                        0x0202_0202_0202_0202,
                        0x0303_0303_0303_0303,
                    ),
                );
                let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201_u64.cast_signed());
                _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit)
            };
            match fmt {
                BlockFmt::Q8_0 => (_mm256_loadu_si256(p.add(2).cast()), scale(p), 0.0),
                BlockFmt::Q4_0 => (
                    _mm256_sub_epi8(nibbles(p.add(2)), _mm256_set1_epi8(8)),
                    scale(p),
                    0.0,
                ),
                BlockFmt::Q4_1 => (nibbles(p.add(4)), scale(p), scale(p.add(2))),
                BlockFmt::Q5_0 => {
                    let hi = _mm256_and_si256(high_bits(p.add(2)), _mm256_set1_epi8(16));
                    let v = _mm256_or_si256(nibbles(p.add(6)), hi);
                    (_mm256_sub_epi8(v, _mm256_set1_epi8(16)), scale(p), 0.0)
                }
                BlockFmt::Q5_1 => {
                    let hi = _mm256_and_si256(high_bits(p.add(4)), _mm256_set1_epi8(16));
                    (
                        _mm256_or_si256(nibbles(p.add(8)), hi),
                        scale(p),
                        scale(p.add(2)),
                    )
                }
                BlockFmt::Iq4Nl => {
                    let table = _mm256_broadcastsi128_si256(_mm_loadu_si128(
                        specula_quant::iq4::KVALUES_IQ4NL.as_ptr().cast(),
                    ));
                    (_mm256_shuffle_epi8(table, nibbles(p.add(2))), scale(p), 0.0)
                }
            }
        }
    }

    /// Block rows to f32, eight values per conversion: `v · d`, or `v · d + m` with the
    /// multiply and the add rounded separately — the dequantizers' operations.
    ///
    /// # Safety
    /// As the table's `widen_blocks` checks; AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn widen_blocks_256(v: BlockRows<'_>, out: *mut f32, os: usize) {
        let offset = matches!(v.fmt, BlockFmt::Q4_1 | BlockFmt::Q5_1);
        for j in 0..v.n {
            for b in 0..v.blocks {
                // SAFETY: row j < v.n, block b < v.blocks, 32 outputs from j·os + 32·b:
                // inside the checked slices.
                unsafe {
                    let p = v.bytes.as_ptr().add(j * v.stride + b * v.fmt.bytes());
                    let (x, d, m) = unpack(v.fmt, p);
                    let (d, m) = (_mm256_set1_ps(d), _mm256_set1_ps(m));
                    let o = out.add(j * os + 32 * b);
                    let halves = [_mm256_castsi256_si128(x), _mm256_extracti128_si256::<1>(x)];
                    for (h, half) in halves.into_iter().enumerate() {
                        for c in 0..2 {
                            let bytes = if c == 0 {
                                half
                            } else {
                                _mm_srli_si128::<8>(half)
                            };
                            let f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
                            let y = _mm256_mul_ps(f, d);
                            let y = if offset { _mm256_add_ps(y, m) } else { y };
                            _mm256_storeu_ps(o.add(16 * h + 8 * c), y);
                        }
                    }
                }
            }
        }
    }

    /// The f16 scale at the start of a block (or at `p` in one).
    ///
    /// # Safety
    /// Two bytes at `p`.
    #[inline(always)]
    unsafe fn scale(p: *const u8) -> f32 {
        // SAFETY: the caller's two bytes; F16C (every caller's features).
        unsafe {
            let h = p.cast::<u16>().read_unaligned();
            _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(h))))
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

    /// One block's term of the dot products of a vector of keys, in the operations and
    /// order of the format's block kernel (`isum`: the integer sums; `dk`, `mk`: the keys'
    /// scales and offsets; `dq`, `sq`: the query block's scale and `d·Σq`).
    #[inline(always)]
    unsafe fn term<I: Isa>(
        fmt: BlockFmt,
        isum: I::F,
        dk: I::F,
        mk: I::F,
        dq: f32,
        sq: f32,
    ) -> I::F {
        // SAFETY: `I`'s features (the caller's).
        unsafe {
            let dq = I::splat(dq);
            match fmt {
                BlockFmt::Q8_0 => I::mul(isum, I::mul(dk, dq)),
                BlockFmt::Q4_0 => I::mul(I::mul(isum, dk), dq),
                BlockFmt::Q5_0 | BlockFmt::Iq4Nl => I::mul(I::mul(dk, dq), isum),
                BlockFmt::Q4_1 | BlockFmt::Q5_1 => {
                    I::add(I::mul(I::mul(dk, dq), isum), I::mul(mk, I::splat(sq)))
                }
            }
        }
    }

    /// Block-format scores of a tile, eight keys at a time: the keys' values unpacked and
    /// widened to i16 once per group and shared by every query; per query and block, the
    /// eight integer sums at once, then the format's term added block after block in eight
    /// f32 lanes — each lane the operations of the block kernel for its key.
    ///
    /// # Safety
    /// As the table's `scores_blocks` checks; AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn scores_blocks_256(
        q: *const u8,
        qs: usize,
        nq: usize,
        k: BlockRows<'_>,
        out: *mut f32,
        os: usize,
    ) {
        let (nb, fmt) = (k.blocks, k.fmt);
        // Query blocks: Q8_1 (`d`, `s`, values) or Q8_0 (`d`, values).
        let (qb, q_vals) = if fmt.query_bytes() == 36 {
            (36, 4)
        } else {
            (34, 2)
        };
        let mut kw = [_mm256_setzero_si256(); 2 * 8 * MAX_BLOCKS];
        let mut kd = [[0.0f32; 8]; MAX_BLOCKS];
        let mut km = [[0.0f32; 8]; MAX_BLOCKS];
        let mut g = 0;
        while g < k.n {
            let m = (k.n - g).min(8);
            for b in 0..nb {
                for j in 0..8 {
                    let i = (b * 8 + j) * 2;
                    if j < m {
                        // SAFETY: key g + j < k.n, block b < k.blocks: inside the checked
                        // bytes.
                        unsafe {
                            let p = k.bytes.as_ptr().add((g + j) * k.stride + b * fmt.bytes());
                            let (x, d, o) = unpack(fmt, p);
                            kd[b][j] = d;
                            km[b][j] = o;
                            kw[i] = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(x));
                            kw[i + 1] = _mm256_cvtepi8_epi16(_mm256_extracti128_si256::<1>(x));
                        }
                    } else {
                        kd[b][j] = 0.0;
                        km[b][j] = 0.0;
                        kw[i] = _mm256_setzero_si256();
                        kw[i + 1] = _mm256_setzero_si256();
                    }
                }
            }
            for a in 0..nq {
                let mut acc = _mm256_setzero_ps();
                for b in 0..nb {
                    // SAFETY: query a < nq, block b < k.blocks: inside the checked bytes.
                    let (q0, q1, dq, sq) = unsafe {
                        let p = q.add(a * qs + b * qb);
                        (
                            _mm256_cvtepi8_epi16(_mm_loadu_si128(p.add(q_vals).cast())),
                            _mm256_cvtepi8_epi16(_mm_loadu_si128(p.add(q_vals + 16).cast())),
                            scale(p),
                            if q_vals == 4 { scale(p.add(2)) } else { 0.0 },
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
                    // SAFETY: eight f32 of each array; AVX.
                    let t = unsafe {
                        term::<V256>(
                            fmt,
                            isum,
                            _mm256_loadu_ps(kd[b].as_ptr()),
                            _mm256_loadu_ps(km[b].as_ptr()),
                            dq,
                            sq,
                        )
                    };
                    acc = _mm256_add_ps(acc, t);
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

    /// A block's 32 values as bytes plus 128 (`k ^ 0x80`: unsigned, for `vpdpbusd`).
    ///
    /// # Safety
    /// As [`unpack`].
    #[inline(always)]
    unsafe fn unpack_biased(fmt: BlockFmt, p: *const u8) -> (__m256i, f32, f32) {
        // SAFETY: the caller's block.
        unsafe {
            let (x, d, m) = unpack(fmt, p);
            (_mm256_xor_si256(x, _mm256_set1_epi8(i8::MIN)), d, m)
        }
    }

    /// Lane `j` of the result is the sum of key `j`'s eight lanes, where vector `p` holds key
    /// `2p` in lanes 0–7 and key `2p + 1` in lanes 8–15 (integer sums: exact in any order).
    #[inline(always)]
    unsafe fn key_sums16(v: &[__m512i; 8]) -> __m512i {
        // SAFETY: AVX-512 F (the caller's features).
        unsafe {
            // Lanes 4c..4c+4 of `pair(a, b)` hold, per 128-bit chunk c, a and b's lanes
            // summed in pairs; of `quad`, lane 4c + i the chunk's four lanes of input i.
            let pair =
                |a, b| _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
            let quad =
                |a, b| _mm512_add_epi32(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b));
            let lo = quad(pair(v[0], v[1]), pair(v[2], v[3]));
            let hi = quad(pair(v[4], v[5]), pair(v[6], v[7]));
            // Key j = 2p + h sits in chunks 2h and 2h + 1, lane p mod 4, of `lo` (p < 4) or
            // `hi`.
            let first = _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 16, 24, 17, 25, 18, 26, 19, 27);
            let second = _mm512_add_epi32(first, _mm512_set1_epi32(4));
            _mm512_add_epi32(
                _mm512_permutex2var_epi32(lo, first, hi),
                _mm512_permutex2var_epi32(lo, second, hi),
            )
        }
    }

    /// [`TileKernels::scores_blocks`] on AVX-512 VNNI, sixteen keys at a time: block `b` of
    /// keys `2p` and `2p + 1` in one vector as unsigned bytes (`k + 128`), `vpdpbusd`
    /// against the query's block in both halves, the sixteen keys' sums by one shuffle tree
    /// less `128·Σq` (the integer sums of the block kernel, exactly), then the format's
    /// [`term`] in sixteen lanes, added block after block from zero into the scores.
    ///
    /// # Safety
    /// As the table's `scores_blocks` checks; AVX-512 F/BW/VL/VNNI, AVX2, FMA and F16C.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,f16c,fma")]
    unsafe fn scores_blocks_512(
        q: *const u8,
        qs: usize,
        nq: usize,
        k: BlockRows<'_>,
        out: *mut f32,
        os: usize,
    ) {
        // One body per format, so that `unpack` and `term` lose their `match`.
        macro_rules! each {
            ($($f:ident),*) => {
                match k.fmt {
                    // SAFETY: the caller's bounds and features.
                    $(BlockFmt::$f => unsafe { scores16(BlockFmt::$f, q, qs, nq, k, out, os) },)*
                }
            };
        }
        each!(Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Iq4Nl);
    }

    /// [`scores_blocks_512`]'s loop for the format `fmt`.
    ///
    /// # Safety
    /// As [`scores_blocks_512`]; `fmt` is `k.fmt`.
    #[inline(always)]
    unsafe fn scores16(
        fmt: BlockFmt,
        q: *const u8,
        qs: usize,
        nq: usize,
        k: BlockRows<'_>,
        out: *mut f32,
        os: usize,
    ) {
        // Query blocks: Q8_1 (`d`, `s`, values) or Q8_0 (`d`, values).
        let (qb, q_vals) = if fmt.query_bytes() == 36 {
            (36, 4)
        } else {
            (34, 2)
        };
        // SAFETY: the caller's bounds and features: keys g + j < k.n, blocks b < k.blocks,
        // queries a < nq, scores a·os + g + j for j < m.
        unsafe {
            let mut g = 0;
            while g < k.n {
                let m = (k.n - g).min(16);
                let mask: __mmask16 = u16::MAX >> (16 - m);
                for b in 0..k.blocks {
                    let mut kv = [_mm512_setzero_si512(); 8];
                    let (mut kd, mut km) = ([0.0f32; 16], [0.0f32; 16]);
                    for j in 0..m {
                        let p = k.bytes.as_ptr().add((g + j) * k.stride + b * fmt.bytes());
                        let (x, d, o) = unpack_biased(fmt, p);
                        (kd[j], km[j]) = (d, o);
                        kv[j / 2] = if j % 2 == 0 {
                            _mm512_zextsi256_si512(x)
                        } else {
                            _mm512_inserti64x4::<1>(kv[j / 2], x)
                        };
                    }
                    let (dk, mk) = (_mm512_loadu_ps(kd.as_ptr()), _mm512_loadu_ps(km.as_ptr()));
                    for a in 0..nq {
                        let p = q.add(a * qs + b * qb);
                        let qv = _mm256_loadu_si256(p.add(q_vals).cast());
                        let (dq, sq) = (scale(p), if q_vals == 4 { scale(p.add(2)) } else { 0.0 });
                        // Σ(k + 128)·q over the block, less 128·Σq.
                        let biased = _mm256_sad_epu8(
                            _mm256_xor_si256(qv, _mm256_set1_epi8(i8::MIN)),
                            _mm256_setzero_si256(),
                        );
                        let mut parts = [0i64; 4];
                        _mm256_storeu_si256(parts.as_mut_ptr().cast(), biased);
                        let sum_q = parts.iter().sum::<i64>() - 32 * 128;
                        let bias = i32::try_from(128 * sum_q).unwrap_or(0);
                        let q2 = _mm512_broadcast_i64x4(qv);
                        let mut v = [_mm512_setzero_si512(); 8];
                        for (x, &kx) in v.iter_mut().zip(&kv) {
                            *x = _mm512_dpbusd_epi32(_mm512_setzero_si512(), kx, q2);
                        }
                        let isum = _mm512_sub_epi32(key_sums16(&v), _mm512_set1_epi32(bias));
                        let t = term::<V512>(fmt, _mm512_cvtepi32_ps(isum), dk, mk, dq, sq);
                        let o = out.add(a * os + g);
                        let before = if b == 0 {
                            _mm512_setzero_ps()
                        } else {
                            _mm512_maskz_loadu_ps(mask, o)
                        };
                        _mm512_mask_storeu_ps(o, mask, _mm512_add_ps(before, t));
                    }
                }
                g += 16;
            }
        }
    }

    /// Block `b` of a value row widened into two vectors: `v · d`, or `v · d + m` with the
    /// multiply and the add rounded separately ([`widen_blocks_256`]'s operations).
    ///
    /// # Safety
    /// One block of `fmt` at `p`; AVX-512 F.
    #[inline(always)]
    unsafe fn widen16(fmt: BlockFmt, p: *const u8) -> [__m512; 2] {
        // SAFETY: the caller's block and features.
        unsafe {
            let (x, d, m) = unpack(fmt, p);
            let (d, m) = (_mm512_set1_ps(d), _mm512_set1_ps(m));
            let half = |h: __m128i| {
                let y = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(h)), d);
                if matches!(fmt, BlockFmt::Q4_1 | BlockFmt::Q5_1) {
                    _mm512_add_ps(y, m)
                } else {
                    y
                }
            };
            [
                half(_mm256_castsi256_si128(x)),
                half(_mm256_extracti128_si256::<1>(x)),
            ]
        }
    }

    /// [`TileKernels::widen_blocks`] in sixteen lanes.
    ///
    /// # Safety
    /// As the table's `widen_blocks` checks; AVX-512 F/BW/VL, AVX2, FMA and F16C.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,f16c,fma")]
    unsafe fn widen_blocks_512(v: BlockRows<'_>, out: *mut f32, os: usize) {
        for j in 0..v.n {
            for b in 0..v.blocks {
                // SAFETY: row j < v.n, block b < v.blocks, 32 outputs from j·os + 32·b:
                // inside the checked slices.
                unsafe {
                    let p = v.bytes.as_ptr().add(j * v.stride + b * v.fmt.bytes());
                    let y = widen16(v.fmt, p);
                    let o = out.add(j * os + 32 * b);
                    _mm512_storeu_ps(o, y[0]);
                    _mm512_storeu_ps(o.add(16), y[1]);
                }
            }
        }
    }

    /// [`TileKernels::pv_blocks`]: the accumulators of up to four queries (64-value heads;
    /// two of 128, one of 256) in registers, each value row widened once per such group
    /// ([`widen16`]), then `pv_block`'s `acc + p·v`, zero weights skipped.
    ///
    /// # Safety
    /// As the table's `pv_blocks` checks; AVX-512 F/BW/VL, AVX2, FMA and F16C.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,f16c,fma")]
    unsafe fn pv_blocks_512(
        w: *const f32,
        ws: usize,
        nq: usize,
        v: BlockRows<'_>,
        acc: *mut f32,
        as_: usize,
    ) {
        // SAFETY: the caller's bounds and features: queries a < nq, rows j < v.n, blocks
        // b < v.blocks, accumulators a·as_ + i for i < 32·v.blocks.
        unsafe {
            macro_rules! go {
                ($fmt:expr, $nq:literal, $nb:literal, $a:expr) => {{
                    // `pv_rows`'s body written out: through its row closure this loop ran 8 %
                    // slower (q8_0 decode at d16384, one thread).
                    let a0 = $a;
                    let mut r = [[_mm512_setzero_ps(); 2 * $nb]; $nq];
                    for (a, row) in r.iter_mut().enumerate() {
                        for (c, x) in row.iter_mut().enumerate() {
                            *x = _mm512_loadu_ps(acc.add((a0 + a) * as_ + 16 * c));
                        }
                    }
                    for j in 0..v.n {
                        let mut y = [_mm512_setzero_ps(); 2 * $nb];
                        for b in 0..$nb {
                            let p = v.bytes.as_ptr().add(j * v.stride + b * $fmt.bytes());
                            [y[2 * b], y[2 * b + 1]] = widen16($fmt, p);
                        }
                        for (a, row) in r.iter_mut().enumerate() {
                            let p = *w.add((a0 + a) * ws + j);
                            if p != 0.0 {
                                let pb = _mm512_set1_ps(p);
                                for (x, &yy) in row.iter_mut().zip(&y) {
                                    *x = _mm512_add_ps(*x, _mm512_mul_ps(pb, yy));
                                }
                            }
                        }
                    }
                    for (a, row) in r.iter().enumerate() {
                        for (c, &x) in row.iter().enumerate() {
                            _mm512_storeu_ps(acc.add((a0 + a) * as_ + 16 * c), x);
                        }
                    }
                }};
            }
            macro_rules! groups {
                ($fmt:expr) => {{
                    let mut a = 0;
                    while a < nq {
                        let left = nq - a;
                        let n = match (v.blocks, left) {
                            (2, 1) => {
                                go!($fmt, 1, 2, a);
                                1
                            }
                            (2, 2) => {
                                go!($fmt, 2, 2, a);
                                2
                            }
                            (2, 3) => {
                                go!($fmt, 3, 2, a);
                                3
                            }
                            (2, _) => {
                                go!($fmt, 4, 2, a);
                                4
                            }
                            (4, 1) => {
                                go!($fmt, 1, 4, a);
                                1
                            }
                            (4, _) => {
                                go!($fmt, 2, 4, a);
                                2
                            }
                            _ => {
                                go!($fmt, 1, 8, a);
                                1
                            }
                        };
                        a += n;
                    }
                }};
            }
            match v.fmt {
                BlockFmt::Q8_0 => groups!(BlockFmt::Q8_0),
                BlockFmt::Q4_0 => groups!(BlockFmt::Q4_0),
                BlockFmt::Q4_1 => groups!(BlockFmt::Q4_1),
                BlockFmt::Q5_0 => groups!(BlockFmt::Q5_0),
                BlockFmt::Q5_1 => groups!(BlockFmt::Q5_1),
                BlockFmt::Iq4Nl => groups!(BlockFmt::Iq4Nl),
            }
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

    /// The fused two-stage turbo4 loops give the bits of the f32 loops over the decoded rows
    /// (`AttnKernels::turbo4_two`), with zero weights among the values'.
    #[test]
    fn fused_turbo_tiles_are_the_decoded_tiles() {
        let Some(t) = for_level(SimdLevel::Avx512) else {
            return;
        };
        let (Some(scores_turbo), Some(pv_turbo)) = (t.scores_turbo, t.pv_turbo) else {
            panic!("the AVX-512 tiles have the fused turbo loops");
        };
        let two = AttnKernels::for_level(SimdLevel::Avx512).turbo4_two;
        let (nk, stride, beta) = (13, 70, 0.075);
        let x = values(nk * 128, 5);
        let coded = quantized(specula_quant::QType::Turbo4, &x, 128);
        let mut bytes = vec![0x5Au8; (nk - 1) * stride + 66];
        for (j, b) in coded.chunks_exact(66).enumerate() {
            bytes[j * stride..j * stride + 66].copy_from_slice(b);
        }
        let rows = TurboRows {
            bytes: &bytes,
            stride,
            n: nk,
            beta,
        };
        let mut dec = vec![0.0; nk * 64];
        two(&bytes, stride, nk, beta, &mut dec);
        let decoded = Rows::f32(&dec, nk, 64);
        for nq in 1..=TURBO_QUERIES {
            let q = values(nq * 64, 1);
            let (mut got, mut want) = (vec![0.0; nq * 16], vec![0.0; nq * 16]);
            scores_turbo(&q, 64, nq, rows, &mut got, 16);
            (t.scores)(&q, 64, nq, decoded, &mut want, 16);
            assert_eq!(bits(&got), bits(&want), "scores, {nq} queries");
            // Each score is the per-key dot product of the decoded row.
            let dot = AttnKernels::for_level(SimdLevel::Avx512).dot_f32;
            for a in 0..nq {
                for j in 0..nk {
                    let want = dot(&q[a * 64..(a + 1) * 64], &dec[j * 64..(j + 1) * 64]);
                    assert_eq!(got[a * 16 + j].to_bits(), want.to_bits(), "{a} {j}");
                }
            }
            let mut w = values(nq * nk, 3);
            w[1] = 0.0;
            w[(nq - 1) * nk + 4] = 0.0;
            let acc0 = values(nq * 64, 9);
            let (mut got, mut want) = (acc0.clone(), acc0);
            pv_turbo(&w, nk, nq, rows, &mut got, 64);
            (t.pv)(&w, nk, nq, decoded, &mut want, 64);
            assert_eq!(bits(&got), bits(&want), "values, {nq} queries");
        }
    }

    /// The cache types the block tiles read.
    const BLOCK_TYPES: [specula_quant::QType; 6] = {
        use specula_quant::QType;
        [
            QType::Q8_0,
            QType::Q4_0,
            QType::Q4_1,
            QType::Q5_0,
            QType::Q5_1,
            QType::IQ4_NL,
        ]
    };

    /// `n` rows of `dim` values quantized to `ty`, packed.
    fn quantized(ty: specula_quant::QType, x: &[f32], dim: usize) -> Vec<u8> {
        let rb = ty.row_bytes(dim).unwrap();
        let mut b = vec![0u8; x.len() / dim * rb];
        for (x, b) in x.chunks_exact(dim).zip(b.chunks_exact_mut(rb)) {
            specula_quant::quantize_row(ty, x, b).unwrap();
        }
        b
    }

    /// Widened block rows are the dequantizer's, for every block format.
    #[test]
    fn widened_block_rows_are_the_dequantizers() {
        for level in [SimdLevel::Avx512, SimdLevel::Avx2] {
            let Some(t) = for_level(level) else { continue };
            for ty in BLOCK_TYPES {
                let fmt = BlockFmt::of(ty).unwrap();
                for dim in [32, 64, 128] {
                    let rb = ty.row_bytes(dim).unwrap();
                    let b = quantized(ty, &values(5 * dim, 9), dim);
                    let mut want = vec![0.0; 5 * dim];
                    specula_quant::dequantize_row(ty, &b, &mut want).unwrap();
                    let mut got = vec![0.0; 5 * (dim + 3)];
                    let v = BlockRows {
                        bytes: &b,
                        stride: rb,
                        n: 5,
                        blocks: dim / 32,
                        fmt,
                    };
                    (t.widen_blocks)(v, &mut got, dim + 3);
                    for j in 0..5 {
                        assert_eq!(
                            bits(&got[j * (dim + 3)..j * (dim + 3) + dim]),
                            bits(&want[j * dim..(j + 1) * dim]),
                            "{level:?} {ty} {dim} row {j}"
                        );
                    }
                }
            }
        }
    }

    /// The fused block value loop is the widened rows through `pv`, bit for bit, for every
    /// format, head size and query count it takes (zero weights included).
    #[test]
    fn fused_block_values_are_the_widened_rows() {
        let Some(t) = for_level(SimdLevel::Avx512) else {
            return;
        };
        let Some(pv_blocks) = t.pv_blocks else {
            return;
        };
        for ty in BLOCK_TYPES {
            let fmt = BlockFmt::of(ty).unwrap();
            for dim in [64, 128, 256] {
                let rb = ty.row_bytes(dim).unwrap();
                for (nq, nk) in [(1, 1), (3, 32), (4, 7), (5, 9), (7, 32), (8, 3), (2, 31)] {
                    assert!(fused_blocks(t, nq, dim / 32));
                    let stride = rb + 34;
                    let rows = quantized(ty, &values(nk * dim, 12), dim);
                    let mut bytes = vec![0u8; nk * stride];
                    for j in 0..nk {
                        bytes[j * stride..j * stride + rb]
                            .copy_from_slice(&rows[j * rb..(j + 1) * rb]);
                    }
                    let v = BlockRows {
                        bytes: &bytes,
                        stride,
                        n: nk,
                        blocks: dim / 32,
                        fmt,
                    };
                    let mut w = values(nq * nk, 13);
                    w[0] = 0.0;
                    w[nq * nk - 1] = 0.0;
                    let start = values(nq * dim, 14);
                    let mut got = start.clone();
                    pv_blocks(&w, nk, nq, v, &mut got, dim);
                    let mut wide = vec![0.0; nk * dim];
                    (t.widen_blocks)(v, &mut wide, dim);
                    let mut want = start;
                    (t.pv)(&w, nk, nq, Rows::f32(&wide, nk, dim), &mut want, dim);
                    assert_eq!(bits(&got), bits(&want), "{ty} {dim} {nq} {nk}");
                }
            }
        }
    }

    /// Block score tiles are the block kernels' bits (`q4_0_q8_0`, `q4_1_q8_1`, …) for
    /// every format, head size and tile shape.
    #[test]
    fn block_score_tiles_are_the_block_dot_products() {
        use specula_quant::QType;
        for level in [SimdLevel::Avx512, SimdLevel::Avx2] {
            let Some(t) = for_level(level) else { continue };
            let Some(kernels) = specula_quant::dot::Kernels::for_level(level) else {
                continue;
            };
            for ty in BLOCK_TYPES {
                let fmt = BlockFmt::of(ty).unwrap();
                let qty = ty.vec_dot_type();
                let dot = |w: &[u8], a: &[u8]| {
                    use bytemuck::cast_slice as c;
                    match ty {
                        QType::Q8_0 => kernels.q8_0_q8_0(c(w), c(a)),
                        QType::Q4_0 => kernels.q4_0_q8_0(c(w), c(a)),
                        QType::Q4_1 => kernels.q4_1_q8_1(c(w), c(a)),
                        QType::Q5_0 => kernels.q5_0_q8_0(c(w), c(a)),
                        QType::Q5_1 => kernels.q5_1_q8_1(c(w), c(a)),
                        _ => kernels.iq4_nl_q8_0(c(w), c(a)),
                    }
                };
                for dim in [32, 64, 128, 96, 256] {
                    let (rb, qb) = (ty.row_bytes(dim).unwrap(), qty.row_bytes(dim).unwrap());
                    for (nq, nk) in [(1, 1), (3, 8), (4, 5), (7, 32), (9, 3), (2, 17)] {
                        // Queries along the keys (the same values), so that some integer
                        // sums are large enough for the order of the scale products to show.
                        // The first query and key are flat (every value near one number),
                        // so that their integer sums are large.
                        let flat = |x: &mut [f32]| {
                            for (i, v) in x[..dim].iter_mut().enumerate() {
                                *v = 0.37 * (0.6 + 0.2 * v.abs())
                                    + 0.001 * f32::from(u8::try_from(i % 7).unwrap());
                            }
                        };
                        let mut qx = values(nq * dim, 8);
                        flat(&mut qx);
                        let q = quantized(qty, &qx, dim);
                        // Keys with a stride past the head (the other heads of a cell).
                        let stride = rb + 34;
                        let mut kb = vec![0u8; nk * stride];
                        let mut x: Vec<f32> = values(nk * dim, 8).iter().map(|x| x * 3.0).collect();
                        flat(&mut x);
                        let keys = quantized(ty, &x, dim);
                        for j in 0..nk {
                            kb[j * stride..j * stride + rb]
                                .copy_from_slice(&keys[j * rb..(j + 1) * rb]);
                        }
                        let k = BlockRows {
                            bytes: &kb,
                            stride,
                            n: nk,
                            blocks: dim / 32,
                            fmt,
                        };
                        let mut got = vec![0.0; nq * 40];
                        (t.scores_blocks)(&q, qb, nq, k, &mut got, 40);
                        for a in 0..nq {
                            for j in 0..nk {
                                let want =
                                    dot(&keys[j * rb..(j + 1) * rb], &q[a * qb..(a + 1) * qb]);
                                assert_eq!(
                                    got[a * 40 + j].to_bits(),
                                    want.to_bits(),
                                    "{level:?} {ty} {dim} {a} {j}"
                                );
                            }
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
