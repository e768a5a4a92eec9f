//! AVX-512 (F, BW, VL, VNNI) micro-kernels: four or eight dot products at once, as `MR`
//! weight rows against `NR` activation rows — 4 × 1 and 8 × 1 for decode, 1 × 4 and 2 × 4 for
//! prefill.
//!
//! Each output is reduced exactly as the single-row kernels of [`specula_quant::dot`] reduce
//! it — and so as its scalar reference: an exact integer sum per block (integer arithmetic; any
//! order gives the same value), then the format's f32 term (the same multiplications in the
//! same order, no fused multiply-add), added to the output's running f32 sum in block order.
//! Working on several outputs lets them share the loads and the unpacking of a row, reduce
//! their block sums four at a time, compute their terms in one vector, and keep independent
//! running sums instead of one serial chain.
//!
//! Every kernel is an `unsafe fn` whose only requirement is that the CPU has the features
//! above; rows are whole blocks of equal count (checked by the caller).

use std::arch::x86_64::*;

use super::Rows;

use specula_quant::blocks::{
    BlockQ4_0, BlockQ4_1, BlockQ4K, BlockQ5_0, BlockQ5_1, BlockQ6K, BlockQ8_0, BlockQ8_1, BlockQ8K,
    Half,
};

/// The kernels' target features.
macro_rules! kernel {
    ($(#[$m:meta])* fn $name:ident $($rest:tt)*) => {
        $(#[$m])*
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
        fn $name $($rest)*
    };
}

kernel! {
    /// 64 bytes, unaligned.
    fn ld512(b: &[u8; 64]) -> __m512i {
        // SAFETY: reads the 64 bytes of `b`.
        unsafe { _mm512_loadu_si512(b.as_ptr().cast()) }
    }
}

kernel! {
    /// 64 signed bytes, unaligned.
    fn ld512i(b: &[i8; 64]) -> __m512i {
        // SAFETY: reads the 64 bytes of `b`.
        unsafe { _mm512_loadu_si512(b.as_ptr().cast()) }
    }
}

kernel! {
    /// 32 bytes, unaligned.
    fn ld256(b: &[u8; 32]) -> __m256i {
        // SAFETY: reads the 32 bytes of `b`.
        unsafe { _mm256_loadu_si256(b.as_ptr().cast()) }
    }
}

kernel! {
    /// 32 signed bytes, unaligned.
    fn ld256i(b: &[i8; 32]) -> __m256i {
        // SAFETY: reads the 32 bytes of `b`.
        unsafe { _mm256_loadu_si256(b.as_ptr().cast()) }
    }
}

kernel! {
    /// 16 signed bytes, unaligned.
    fn ld128i(b: &[i8; 16]) -> __m128i {
        // SAFETY: reads the 16 bytes of `b`.
        unsafe { _mm_loadu_si128(b.as_ptr().cast()) }
    }
}

kernel! {
    /// The four lanes of a vector.
    fn st4(v: __m128) -> [f32; 4] {
        let mut out = [0.0f32; 4];
        // SAFETY: writes the 16 bytes of `out`.
        unsafe { _mm_storeu_ps(out.as_mut_ptr(), v) };
        out
    }
}

kernel! {
    /// `[lo | hi]`.
    fn join(lo: __m256i, hi: __m256i) -> __m512i {
        _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
    }
}

kernel! {
    /// The sum of the two 256-bit halves.
    fn fold(v: __m512i) -> __m256i {
        _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64::<1>(v))
    }
}

kernel! {
    /// The lane sums of four vectors: `[Σa, Σb, Σc, Σd]`.
    fn hsum4(v: [__m256i; 4]) -> __m128i {
        let abcd = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
        _mm_add_epi32(_mm256_castsi256_si128(abcd), _mm256_extracti128_si256::<1>(abcd))
    }
}

/// One weight row of a micro-kernel: row `k` of a group of `R` rows stored block-interleaved
/// (block 0 of rows 0, 1, …, `R − 1`, then block 1 of each, …), as `data` starting at the
/// row's first block; a row as it lies in the file is the group `R = 1`. The kernels read
/// their rows block by block, so a packed group is read from memory in order (see
/// `Packing`).
#[derive(Clone, Copy)]
pub(super) struct WRow<'a, B, const R: usize> {
    data: &'a [B],
    /// Blocks per row.
    nb: usize,
}

impl<'a, B, const R: usize> WRow<'a, B, R> {
    /// Row `k` of the group of `R` rows of `nb` blocks in `group`.
    ///
    /// # Panics
    /// If `group` does not hold `R` rows of `nb` blocks or `k ≥ R`.
    fn new(group: &'a [B], k: usize, nb: usize) -> Self {
        assert!(
            k < R && group.len() == R * nb,
            "weight group: {} blocks for row {k} of {R} rows of {nb}",
            group.len()
        );
        Self {
            data: &group[k..],
            nb,
        }
    }

    /// Block `b` of the row.
    ///
    /// # Safety
    /// `b` must be below the row's block count `nb`.
    #[inline(always)]
    unsafe fn at(&self, b: usize) -> &'a B {
        debug_assert!(b < self.nb, "block {b} of a row of {}", self.nb);
        // SAFETY: `b < nb` (the caller's contract), and `data` holds `R·nb − k ≥ (nb − 1)·R
        // + 1` blocks (`new`: the group's `R·nb` blocks from the row's first, `k < R`), so
        // `b·R` is inside it.
        unsafe { self.data.get_unchecked(b * R) }
    }
}

/// Block access shared by weight rows ([`WRow`]) and activation rows (slices).
trait At<B> {
    /// Block `b`.
    ///
    /// # Safety
    /// `b` must be below the row's block count.
    unsafe fn at(&self, b: usize) -> &B;
}

impl<B> At<B> for &[B] {
    #[inline(always)]
    unsafe fn at(&self, b: usize) -> &B {
        &self[b]
    }
}

impl<B, const R: usize> At<B> for WRow<'_, B, R> {
    #[inline(always)]
    unsafe fn at(&self, b: usize) -> &B {
        // SAFETY: the caller's contract is `WRow::at`'s.
        unsafe { WRow::at(self, b) }
    }
}

/// Whether `(MR, NR)` is one of the shapes the kernels are written for: the outputs come in
/// groups of four pairs, and in each group one side has four rows and the other one.
const fn shape_ok(mr: usize, nr: usize) -> bool {
    matches!((mr, nr), (4 | 8, 1) | (1 | 2, 4))
}

/// Which weight row and which activation row output `p` of an `MR × NR` kernel pairs.
const fn pair<const NR: usize>(p: usize) -> (usize, usize) {
    (p / NR, p % NR)
}

/// Four f32 values, one per pair of group `g`: `w[i]` or `a[j]` of the pair.
macro_rules! per_pair {
    ($g:expr, |$i:ident, $j:ident| $v:expr) => {{
        let f = |k: usize| {
            let ($i, $j) = pair::<NR>(4 * $g + k);
            $v
        };
        _mm_setr_ps(f(0), f(1), f(2), f(3))
    }};
}

/// The eight 6-bit scales and mins of a Q4_K super-block (`get_scale_min_k4`), with 32-bit
/// word operations.
fn k4_scales_mins(s: &[u8; 12]) -> ([u8; 8], [u8; 8]) {
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

/// Sub-block (0 or 1) of each 16-bit lane of a 64-value Q4_K chunk.
const K4_HALF: [u8; 32] = [
    0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,
];

kernel! {
    /// The exact f32 value of an f16 (one `vcvtph2ps` from a general register).
    fn h2f(h: Half) -> f32 {
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(h.to_bits()))))
    }
}

kernel! {
    /// The four lane sums of four 512-bit vectors.
    fn hsum4x512(v: &[__m512i]) -> __m128i {
        hsum4([fold(v[0]), fold(v[1]), fold(v[2]), fold(v[3])])
    }
}

kernel! {
    /// The two groups' running sums as eight outputs.
    fn outputs(sumf: [__m128; 2]) -> [f32; 8] {
        let [a, b, c, d] = st4(sumf[0]);
        let [e, f, g, h] = st4(sumf[1]);
        [a, b, c, d, e, f, g, h]
    }
}

kernel! {
    /// Q4_K · Q8_K for `MR × NR` pairs of rows.
    ///
    /// Per super-block and pair: `isum = Σ_j sc_j · Σ q·y` (sub-block j), `summs = Σ bsums ·
    /// mins`, term `(d_w·d_a)·isum − (dmin_w·d_a)·summs` (the quant crate's `kmin_term`).
    fn q4_k<const MR: usize, const NR: usize, const R: usize>(w: [WRow<'_, BlockQ4K, R>; MR], a: [&[BlockQ8K]; NR]) -> [f32; 8] {
        const { assert!(shape_ok(MR, NR)) };
        let nb = a[0].len();
        assert!(w.iter().all(|r| r.nb == nb) && a.iter().all(|r| r.len() == nb));
        let m4 = _mm512_set1_epi8(0x0F);
        let half = _mm512_cvtepu8_epi16(ld256(&K4_HALF));
        // Per chunk c, the lanes [2c ×16 | 2c + 1 ×16]: which scale each 16-bit lane takes.
        let idx: [__m512i; 4] = std::array::from_fn(|c| {
            _mm512_add_epi16(half, _mm512_set1_epi16(i16::try_from(2 * c).unwrap_or(0)))
        });
        let mut sumf = [_mm_setzero_ps(); 2];
        #[allow(clippy::needless_range_loop, reason = "`b` indexes the blocks of the weight rows (through `WRow`) and of the activation rows alike")]
        for b in 0..nb {
            // Per weight row: the eight scales as i16 lanes, the mins matched to the sixteen
            // 16-value bsums, and the f16 scales.
            let mut s16 = [_mm512_setzero_si512(); 8];
            let mut mins = [_mm256_setzero_si256(); 8];
            let mut dw = [0.0f32; 8];
            let mut dminw = [0.0f32; 8];
            for i in 0..MR {
                // SAFETY: `b < nb`, the rows' block count (checked on entry).
                let x = unsafe { w[i].at(b) };
                let (s, m) = k4_scales_mins(&x.scales);
                s16[i] = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(i64::from_le_bytes(s))));
                // [m0, m0, m1, m1, …] as i16.
                let m = _mm256_cvtepu16_epi32(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(i64::from_le_bytes(m))));
                mins[i] = _mm256_or_si256(m, _mm256_slli_epi32::<16>(m));
                dw[i] = h2f(x.d);
                dminw[i] = h2f(x.dmin);
            }
            let mut da = [0.0f32; 4];
            for j in 0..NR {
                da[j] = a[j][b].d.get();
            }
            let mut acc = [_mm512_setzero_si512(); 8];
            for c in 0..4 {
                let mut ys = [_mm512_setzero_si512(); 4];
                for j in 0..NR {
                    let (yc, _) = a[j][b].qs.as_chunks::<64>();
                    ys[j] = ld512i(&yc[c]);
                }
                for i in 0..MR {
                    // SAFETY: `b < nb`, the rows' block count (checked on entry).
                    let (qc, _) = unsafe { w[i].at(b) }.qs.as_chunks::<32>();
                    // Chunk c's 32 bytes in both halves; the high half shifted down a nibble
                    // gives elements 64c..64c + 64 in order.
                    let q = _mm512_broadcast_i64x4(ld256(&qc[c]));
                    let q = _mm512_mask_srli_epi16::<4>(q, 0xFFFF_0000, q);
                    let u = _mm512_and_si512(q, m4);
                    let sc = _mm512_permutexvar_epi16(idx[c], s16[i]);
                    for j in 0..NR {
                        // Codes < 16, |y| ≤ 128: maddubs pairs < 2¹³; scales < 64.
                        let p = _mm512_maddubs_epi16(u, ys[j]);
                        acc[i * NR + j] = _mm512_dpwssd_epi32(acc[i * NR + j], p, sc);
                    }
                }
            }
            for (g, sumf) in sumf.iter_mut().enumerate().take(MR * NR / 4) {
                let mut sm = [_mm256_setzero_si256(); 4];
                for (k, smk) in sm.iter_mut().enumerate() {
                    let (i, j) = pair::<NR>(4 * g + k);
                    let bs = ld256(bytemuck::cast_ref::<[[u8; 2]; 16], [u8; 32]>(&a[j][b].bsums));
                    *smk = _mm256_madd_epi16(bs, mins[i]);
                }
                let isum = _mm_cvtepi32_ps(hsum4x512(&acc[4 * g..4 * g + 4]));
                let summs = _mm_cvtepi32_ps(hsum4(sm));
                let da4 = per_pair!(g, |_i, j| da[j]);
                let d = _mm_mul_ps(per_pair!(g, |i, _j| dw[i]), da4);
                let dmin = _mm_mul_ps(per_pair!(g, |i, _j| dminw[i]), da4);
                let t = _mm_sub_ps(_mm_mul_ps(d, isum), _mm_mul_ps(dmin, summs));
                *sumf = _mm_add_ps(*sumf, t);
            }
        }
        outputs(sumf)
    }
}

/// Sub-block index (0..4) of each 16-bit lane of a 64-value Q6_K group.
const Q6_SUB: [u8; 32] = [
    0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3,
];

kernel! {
    /// Q6_K · Q8_K for `MR × NR` pairs: `isum = Σ scale_s · Σ (q − 32)·y` over the sixteen
    /// 16-value sub-blocks, term `(d_w·d_a)·isum` (the quant crate's `k_term`).
    fn q6_k<const MR: usize, const NR: usize, const R: usize>(w: [WRow<'_, BlockQ6K, R>; MR], a: [&[BlockQ8K]; NR]) -> [f32; 8] {
        const { assert!(shape_ok(MR, NR)) };
        let nb = a[0].len();
        assert!(w.iter().all(|r| r.nb == nb) && a.iter().all(|r| r.len() == nb));
        let m4 = _mm512_set1_epi8(0x0F);
        let m30 = _mm512_set1_epi8(0x30);
        let z32 = _mm512_set1_epi8(32);
        // Shifts that bring qh's bit pairs 0, 1 (groups 0, 1) and 2, 3 (groups 2, 3) to bits 4–5.
        let shl = join(_mm256_set1_epi16(4), _mm256_set1_epi16(2));
        let shr = join(_mm256_set1_epi16(0), _mm256_set1_epi16(2));
        let sub = _mm512_cvtepu8_epi16(ld256(&Q6_SUB));
        let idx: [__m512i; 4] = std::array::from_fn(|g| {
            _mm512_add_epi16(sub, _mm512_set1_epi16(i16::try_from(4 * g).unwrap_or(0)))
        });
        let mut sumf = [_mm_setzero_ps(); 2];
        #[allow(clippy::needless_range_loop, reason = "`b` indexes the blocks of the weight rows (through `WRow`) and of the activation rows alike")]
        for b in 0..nb {
            let mut dw = [0.0f32; 8];
            let mut sc = [_mm512_setzero_si512(); 8];
            for i in 0..MR {
                // SAFETY: `b < nb`, the rows' block count (checked on entry).
                let x = unsafe { w[i].at(b) };
                dw[i] = h2f(x.d);
                sc[i] = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(ld128i(&x.scales)));
            }
            let mut da = [0.0f32; 4];
            for j in 0..NR {
                da[j] = a[j][b].d.get();
            }
            let mut acc = [_mm512_setzero_si512(); 8];
            for h in 0..2 {
                // Σ 32·y per group, shared by the weight rows.
                let mut ys = [[_mm512_setzero_si512(); 2]; 4];
                let mut zs = [[_mm512_setzero_si512(); 2]; 4];
                for j in 0..NR {
                    let (yc, _) = a[j][b].qs.as_chunks::<64>();
                    for k in 0..2 {
                        ys[j][k] = ld512i(&yc[2 * h + k]);
                        zs[j][k] = _mm512_maddubs_epi16(z32, ys[j][k]);
                    }
                }
                for i in 0..MR {
                    // SAFETY: `b < nb`, the rows' block count (checked on entry).
                    let x = unsafe { w[i].at(b) };
                    let (ql, _) = x.ql.as_chunks::<64>();
                    let (qh, _) = x.qh.as_chunks::<32>();
                    let zql = ld512(&ql[h]);
                    let zqh = _mm512_broadcast_i64x4(ld256(&qh[h]));
                    let lo = _mm512_or_si512(
                        _mm512_and_si512(zql, m4),
                        _mm512_and_si512(_mm512_sllv_epi16(zqh, shl), m30),
                    );
                    let hi = _mm512_or_si512(
                        _mm512_and_si512(_mm512_srli_epi16::<4>(zql), m4),
                        _mm512_and_si512(_mm512_srlv_epi16(zqh, shr), m30),
                    );
                    for (k, u) in [lo, hi].into_iter().enumerate() {
                        let s = _mm512_permutexvar_epi16(idx[2 * h + k], sc[i]);
                        for j in 0..NR {
                            // (u − 32)·y pairs ≤ 2¹³ in magnitude; times a scale ≥ −128, 2²¹.
                            let p = _mm512_sub_epi16(_mm512_maddubs_epi16(u, ys[j][k]), zs[j][k]);
                            acc[i * NR + j] = _mm512_dpwssd_epi32(acc[i * NR + j], p, s);
                        }
                    }
                }
            }
            for (g, sumf) in sumf.iter_mut().enumerate().take(MR * NR / 4) {
                let isum = _mm_cvtepi32_ps(hsum4x512(&acc[4 * g..4 * g + 4]));
                let d = _mm_mul_ps(per_pair!(g, |i, _j| dw[i]), per_pair!(g, |_i, j| da[j]));
                *sumf = _mm_add_ps(*sumf, _mm_mul_ps(d, isum));
            }
        }
        outputs(sumf)
    }
}

/// Four f16 bit patterns in one u64, first in the low bits.
///
/// The result goes through [`opaque`]: otherwise LLVM sees through the packing and builds the
/// vector with `vpinsrw`, whose "don't care" input can be any register — often a running sum,
/// which puts every scale conversion behind the last add. From a general register the bits go
/// in with `vmovq`, which depends on nothing else.
#[inline]
fn pack4(h: [Half; 4]) -> i64 {
    let bits = h
        .iter()
        .rev()
        .fold(0u64, |acc, x| (acc << 16) | u64::from(x.to_bits()));
    opaque(bits).cast_signed()
}

/// `x`, hidden from the optimizer by an empty `asm!` that keeps it in a general register.
#[inline]
fn opaque(x: u64) -> u64 {
    let mut x = x;
    // SAFETY: the assembly is empty; it reads and writes only the register that holds `x`.
    unsafe {
        std::arch::asm!("/* {0} */", inout(reg) x, options(pure, nomem, nostack, preserves_flags));
    }
    x
}

kernel! {
    /// The f32 values of eight f16 scales, packed in general registers and converted at once.
    fn halves8(h: [Half; 8]) -> __m256 {
        let lo = pack4([h[0], h[1], h[2], h[3]]);
        let hi = pack4([h[4], h[5], h[6], h[7]]);
        _mm256_cvtph_ps(_mm_set_epi64x(hi, lo))
    }
}

kernel! {
    /// 16 bytes, unaligned, into the low 128 bits.
    fn ld128(b: &[u8; 16]) -> __m128i {
        // SAFETY: reads the 16 bytes of `b`.
        unsafe { _mm_loadu_si128(b.as_ptr().cast()) }
    }
}

kernel! {
    /// The Q8 values of blocks `b` and, if present, `b + 1` of an activation row (zeros in
    /// the high half otherwise).
    fn q8_pair(lo: &[i8; 32], hi: Option<&[i8; 32]>) -> __m512i {
        let lo = ld256i(lo);
        match hi {
            Some(hi) => join(lo, ld256i(hi)),
            None => _mm512_zextsi256_si512(lo),
        }
    }
}

kernel! {
    /// The nibbles of one or two Q4-style blocks, each in element order (low nibbles, then
    /// high nibbles): `[block b | block b + 1]`, zeros for a missing second block.
    fn nibbles2(lo: &[u8; 16], hi: Option<&[u8; 16]>) -> __m512i {
        let z = _mm512_broadcast_i32x4(ld128(lo));
        let z = match hi {
            Some(hi) => _mm512_mask_broadcast_i32x4(z, 0xFF00, ld128(hi)),
            None => _mm512_maskz_mov_epi64(0x0F, z),
        };
        let z = _mm512_mask_srli_epi16::<4>(z, 0xFF00_FF00, z);
        _mm512_and_si512(z, _mm512_set1_epi8(0x0F))
    }
}

kernel! {
    /// The fifth bits of one or two Q5 blocks as 0x10 bytes, in the layout of [`nibbles2`].
    fn high_bits2(lo: [u8; 4], hi: Option<[u8; 4]>) -> __m512i {
        let hi = hi.map_or(0, u32::from_le_bytes);
        let k = u64::from(u32::from_le_bytes(lo)) | (u64::from(hi) << 32);
        _mm512_maskz_mov_epi8(k, _mm512_set1_epi8(0x10))
    }
}

/// An f16 field of blocks `b` and (if `two`) `b + 1` of the rows of one side of a group of four
/// pairs, as f32 lanes in pair order `[pairs at b | pairs at b + 1]` (zeros for a missing
/// `b + 1`). In a group one side has four rows (pair k uses row k) and the other one (every
/// pair uses it).
macro_rules! side8 {
    ($rows:expr, $b:expr, $two:expr, |$x:ident| $field:expr) => {{
        let rows = $rows;
        if rows.len() == 4 {
            let mut h = [Half::default(); 8];
            for k in 0..4 {
                // SAFETY: the kernels pass `b < nb` and set `two` only when `b + 1 < nb`.
                let $x = unsafe { rows[k].at($b) };
                h[k] = $field;
                if $two {
                    // SAFETY: as above.
                    let $x = unsafe { rows[k].at($b + 1) };
                    h[k + 4] = $field;
                }
            }
            halves8(h)
        } else {
            let lo = {
                // SAFETY: as above.
                let $x = unsafe { rows[0].at($b) };
                $field
            };
            let hi = if $two {
                // SAFETY: as above.
                let $x = unsafe { rows[0].at($b + 1) };
                $field
            } else {
                Half::default()
            };
            let bits = opaque(u64::from(lo.to_bits()) | (u64::from(hi.to_bits()) << 16));
            let v = _mm_cvtph_ps(_mm_cvtsi64_si128(bits.cast_signed()));
            _mm256_permutexvar_ps(
                _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1),
                _mm256_castps128_ps256(v),
            )
        }
    }};
}

/// Defines a kernel for a format of 32-value blocks against 32-value Q8 blocks, two blocks per
/// step. `codes` gives the unsigned codes of blocks `b` and `b + 1` (`Option` for the second)
/// of a weight row; `zero` is the codes' zero point (`isum = Σ (u − zero)·y`, computed as
/// `Σ u·y − zero·Σy` with `vpdpbusd`, exact for any bytes); `terms` turns a group's eight
/// block sums (as f32, lanes `[pairs at b | pairs at b + 1]`) into its eight terms with the
/// scalar formula's operations in its order, from the group's weight rows `w` and activation
/// rows `a`.
macro_rules! legacy_kernel {
    (
        $(#[$m:meta])* $name:ident($wb:ty, $ab:ty), zero: $zero:expr,
        codes: |$x0:ident, $x1:ident| $codes:expr,
        terms: |$w:ident, $a:ident, $b:ident, $two:ident, $s:ident| $terms:expr $(,)?
    ) => {
        kernel! {
            $(#[$m])*
            fn $name<const MR: usize, const NR: usize, const R: usize>(w: [WRow<'_, $wb, R>; MR], a: [&[$ab]; NR]) -> [f32; 8] {
                const { assert!(shape_ok(MR, NR)) };
                let nb = a[0].len();
                assert!(w.iter().all(|r| r.nb == nb) && a.iter().all(|r| r.len() == nb));
                let zero: u8 = $zero;
                let zv = _mm512_set1_epi8(zero.cast_signed());
                let mut sumf = [_mm_setzero_ps(); 2];
                let mut $b = 0;
                while $b < nb {
                    let $two = $b + 1 < nb;
                    let mut ys = [_mm512_setzero_si512(); 4];
                    let mut zs = [_mm512_setzero_si512(); 4];
                    for j in 0..NR {
                        let hi = if $two { Some(&a[j][$b + 1].qs) } else { None };
                        ys[j] = q8_pair(&a[j][$b].qs, hi);
                        if zero != 0 {
                            zs[j] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), zv, ys[j]);
                        }
                    }
                    let mut z = [_mm512_setzero_si512(); 8];
                    for i in 0..MR {
                        let row = w[i];
                        // SAFETY: `b < nb`, and `two` only when `b + 1 < nb` (the rows' block
                        // count, checked on entry).
                        let ($x0, $x1) = unsafe { (row.at($b), if $two { Some(row.at($b + 1)) } else { None }) };
                        let u: __m512i = $codes;
                        for j in 0..NR {
                            let s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, ys[j]);
                            z[i * NR + j] = if zero != 0 { _mm512_sub_epi32(s, zs[j]) } else { s };
                        }
                    }
                    for (g, sumf) in sumf.iter_mut().enumerate().take(MR * NR / 4) {
                        // Lanes 0..8 of z[p] are block b of pair p, lanes 8..16 block b + 1.
                        let zg = &z[4 * g..4 * g + 4];
                        let lo = hsum4([
                            _mm512_castsi512_si256(zg[0]),
                            _mm512_castsi512_si256(zg[1]),
                            _mm512_castsi512_si256(zg[2]),
                            _mm512_castsi512_si256(zg[3]),
                        ]);
                        let hi = hsum4([
                            _mm512_extracti64x4_epi64::<1>(zg[0]),
                            _mm512_extracti64x4_epi64::<1>(zg[1]),
                            _mm512_extracti64x4_epi64::<1>(zg[2]),
                            _mm512_extracti64x4_epi64::<1>(zg[3]),
                        ]);
                        let $s = _mm256_cvtepi32_ps(_mm256_set_m128i(hi, lo));
                        // The group's rows: four weight rows and one activation row, or the
                        // other way round.
                        let $w: &[WRow<'_, $wb, R>] = if NR == 1 { &w[4 * g..4 * g + 4] } else { &w[g..=g] };
                        let $a: &[&[$ab]] = if NR == 1 { &a[..1] } else { &a[..4] };
                        let t: __m256 = $terms;
                        *sumf = _mm_add_ps(*sumf, _mm256_castps256_ps128(t));
                        if $two {
                            *sumf = _mm_add_ps(*sumf, _mm256_extractf128_ps::<1>(t));
                        }
                    }
                    $b += 2;
                }
                outputs(sumf)
            }
        }
    };
}

legacy_kernel! {
    /// Q8_0 · Q8_0: codes `w + 128`, term `isum · (d_w·d_a)` (`q8_0_term`).
    q8_0(BlockQ8_0, BlockQ8_0), zero: 0x80,
    codes: |x0, x1| _mm512_xor_si512(q8_pair(&x0.qs, x1.map(|x| &x.qs)), _mm512_set1_epi8(-128)),
    terms: |w, a, b, two, s| {
        let dw = side8!(w, b, two, |x| x.d);
        let da = side8!(a, b, two, |x| x.d);
        _mm256_mul_ps(s, _mm256_mul_ps(dw, da))
    },
}

legacy_kernel! {
    /// Q4_0 · Q8_0: codes `q`, zero point 8, term `isum · d_w · d_a` (`q4_0_term`).
    q4_0(BlockQ4_0, BlockQ8_0), zero: 8,
    codes: |x0, x1| nibbles2(&x0.qs, x1.map(|x| &x.qs)),
    terms: |w, a, b, two, s| {
        let dw = side8!(w, b, two, |x| x.d);
        let da = side8!(a, b, two, |x| x.d);
        _mm256_mul_ps(_mm256_mul_ps(s, dw), da)
    },
}

legacy_kernel! {
    /// Q5_0 · Q8_0: codes `q` with the fifth bit, zero point 16, term `(d_w·d_a) · isum`
    /// (`q5_0_term`).
    q5_0(BlockQ5_0, BlockQ8_0), zero: 16,
    codes: |x0, x1| _mm512_or_si512(
        nibbles2(&x0.qs, x1.map(|x| &x.qs)),
        high_bits2(x0.qh, x1.map(|x| x.qh)),
    ),
    terms: |w, a, b, two, s| {
        let dw = side8!(w, b, two, |x| x.d);
        let da = side8!(a, b, two, |x| x.d);
        _mm256_mul_ps(_mm256_mul_ps(dw, da), s)
    },
}

legacy_kernel! {
    /// Q4_1 · Q8_1: codes `q`, no zero point, term `(d_w·d_a)·isum + m_w·s_a` (`q_1_term`).
    q4_1(BlockQ4_1, BlockQ8_1), zero: 0,
    codes: |x0, x1| nibbles2(&x0.qs, x1.map(|x| &x.qs)),
    terms: |w, a, b, two, s| {
        let dw = side8!(w, b, two, |x| x.d);
        let mw = side8!(w, b, two, |x| x.m);
        let da = side8!(a, b, two, |x| x.d);
        let sa = side8!(a, b, two, |x| x.s);
        _mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(dw, da), s), _mm256_mul_ps(mw, sa))
    },
}

legacy_kernel! {
    /// Q5_1 · Q8_1: codes `q` with the fifth bit, no zero point, term
    /// `(d_w·d_a)·isum + m_w·s_a` (`q_1_term`).
    q5_1(BlockQ5_1, BlockQ8_1), zero: 0,
    codes: |x0, x1| _mm512_or_si512(
        nibbles2(&x0.qs, x1.map(|x| &x.qs)),
        high_bits2(x0.qh, x1.map(|x| x.qh)),
    ),
    terms: |w, a, b, two, s| {
        let dw = side8!(w, b, two, |x| x.d);
        let mw = side8!(w, b, two, |x| x.m);
        let da = side8!(a, b, two, |x| x.d);
        let sa = side8!(a, b, two, |x| x.s);
        _mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(dw, da), s), _mm256_mul_ps(mw, sa))
    },
}

/// Builds the `unsafe` entry points of one format on byte rows: 8 × 1 and 4 × 1 (weight rows ×
/// activation rows) for decode, 2 × 4 and 1 × 4 for prefill. Outputs are in pair order
/// (weight-row-major); unused lanes are zero.
macro_rules! entries {
    ($kernel:ident, $wb:ty, $ab:ty) => {
        pub(super) mod $kernel {
            use super::*;

            /// `MR` weight rows · `NR` activation rows.
            ///
            /// # Safety
            /// The CPU must support AVX2, FMA, F16C and AVX-512 F/BW/VL/VNNI.
            ///
            /// # Panics
            /// If the rows are not whole blocks of one count, or a packed group does not hold
            /// `r` rows of that count.
            #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
            pub(in super::super) unsafe fn run<const MR: usize, const NR: usize>(
                w: Rows<'_, MR>,
                a: [&[u8]; NR],
            ) -> [f32; 8] {
                let mut at: [&[$ab]; NR] = [&[]; NR];
                for (t, r) in at.iter_mut().zip(a) {
                    *t = bytemuck::cast_slice(r);
                }
                let nb = at[0].len();
                match w {
                    Rows::Plain(rows) => {
                        let wt = rows.map(|r| WRow::<$wb, 1>::new(bytemuck::cast_slice(r), 0, nb));
                        super::$kernel::<MR, NR, 1>(wt, at)
                    }
                    Rows::Packed { group, r, k0 } => {
                        let data: &[$wb] = bytemuck::cast_slice(group);
                        match r {
                            8 => super::$kernel::<MR, NR, 8>(
                                std::array::from_fn(|i| WRow::new(data, k0 + i, nb)),
                                at,
                            ),
                            4 => super::$kernel::<MR, NR, 4>(
                                std::array::from_fn(|i| WRow::new(data, k0 + i, nb)),
                                at,
                            ),
                            _ => panic!("weight groups of {r} rows are not packed for kernels"),
                        }
                    }
                }
            }
        }
    };
}

entries!(q4_k, BlockQ4K, BlockQ8K);
entries!(q6_k, BlockQ6K, BlockQ8K);
entries!(q8_0, BlockQ8_0, BlockQ8_0);
entries!(q4_0, BlockQ4_0, BlockQ8_0);
entries!(q5_0, BlockQ5_0, BlockQ8_0);
entries!(q4_1, BlockQ4_1, BlockQ8_1);
entries!(q5_1, BlockQ5_1, BlockQ8_1);

/// Whether this CPU can run these kernels.
pub(super) fn supported() -> bool {
    is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
        && is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("avx512vnni")
}
