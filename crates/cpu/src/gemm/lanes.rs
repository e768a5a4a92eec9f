//! AVX-512 "lane" kernels for the 32-value block formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) on
//! weights packed in groups of [`ROWS`] rows, one weight row per 32-bit lane.
//!
//! The row-major kernels of `avx512` compute each block's integer sum in a vector and then
//! reduce it across lanes — once per output and block, which costs more than the products
//! themselves when many activation rows share a weight row (prefill). Here the packed group
//! puts four code bytes of each of its 16 rows side by side (one 64-byte vector = the same four
//! values of 16 rows), so one `vpdpbusd` against four activation bytes broadcast to every lane
//! adds four products to each row's own lane: after the block's 32 values every lane holds its
//! row's exact integer block sum, with no reduction at all. The block's f32 term is then formed
//! for the 16 rows at once with the scalar formula's operations in its order and added to the
//! rows' running sums in block order — the semantics and the bits of the single-row kernels of
//! `specula_quant::dot`, so batching stays bit-invariant.
//!
//! # Packed layout
//! Per block `b`, the group's `16 × block bytes` hold, in order: the 16 rows' `d` (f16); for
//! Q4_1 / Q5_1 their `m`; for Q5_0 / Q5_1 the fifth bits as two 64-bit lane masks per
//! four-value unit `t` (bit `4k + i` = the fifth bit of value `4t + i`, then of value
//! `16 + 4t + i`, of row `k`); then the codes, unit by unit: 64 bytes holding bytes
//! `4t..4t + 4` of each row's `qs` (Q4/Q5: values `4t..4t + 4` in the low nibbles and
//! `16 + 4t..` in the high nibbles; Q8_0: values `4t..4t + 4`, eight units). Same bytes as the
//! file, rearranged.

use std::arch::x86_64::*;

use specula_quant::QType;

/// Rows per packed group (one per 32-bit lane of a 512-bit vector).
pub(crate) const ROWS: usize = 16;

/// A format the lane kernels run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Fmt {
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    /// Super-blocks of 256 with packed 6-bit scales: its own packer and kernel
    /// ([`pack_group_q4k`], [`run_q4k`]).
    Q4K,
    /// Super-blocks of 256 in sixteen scaled sub-blocks of 16: [`pack_group_q6k`],
    /// [`run_q6k`].
    Q6K,
}

impl Fmt {
    /// The lane format for weights of `ty`, if there is one.
    pub(crate) fn of(ty: QType) -> Option<Self> {
        Some(match ty {
            QType::Q4_0 => Self::Q4_0,
            QType::Q4_1 => Self::Q4_1,
            QType::Q5_0 => Self::Q5_0,
            QType::Q5_1 => Self::Q5_1,
            QType::Q8_0 => Self::Q8_0,
            QType::Q4_K => Self::Q4K,
            QType::Q6_K => Self::Q6K,
            _ => return None,
        })
    }

    /// Bytes of one block of one row.
    const fn block_bytes(self) -> usize {
        match self {
            Self::Q4_0 => 18,
            Self::Q4_1 => 20,
            Self::Q5_0 => 22,
            Self::Q5_1 => 24,
            Self::Q8_0 => 34,
            Self::Q4K => Q4K_BYTES,
            Self::Q6K => Q6K_BYTES,
        }
    }

    const fn has_min(self) -> bool {
        matches!(self, Self::Q4_1 | Self::Q5_1)
    }

    const fn has_qh(self) -> bool {
        matches!(self, Self::Q5_0 | Self::Q5_1)
    }

    /// Four-byte units of codes per row and block.
    const fn units(self) -> usize {
        match self {
            Self::Q8_0 => 8,
            _ => 4,
        }
    }

    /// The codes' zero point: `isum = Σ (u − zero)·y`.
    const fn zero(self) -> i32 {
        match self {
            Self::Q4_0 => 8,
            Self::Q5_0 => 16,
            Self::Q8_0 => 128,
            Self::Q4_1 | Self::Q5_1 | Self::Q4K | Self::Q6K => 0,
        }
    }

    /// Whether the kernels need the activation blocks' value sums `Σy` (zero point ≠ 0).
    pub(crate) const fn needs_sums(self) -> bool {
        self.zero() != 0
    }

    /// Offset of the fifth-bit masks in a packed group block.
    const fn off_qh(self) -> usize {
        2 * ROWS + if self.has_min() { 2 * ROWS } else { 0 }
    }

    /// Offset of the codes in a packed group block.
    const fn off_codes(self) -> usize {
        self.off_qh() + if self.has_qh() { 16 * 4 } else { 0 }
    }

    /// Where the codes (`qs`) begin in a plain block.
    const fn qs_at(self) -> usize {
        match self {
            Self::Q8_0 => 2,
            _ => self.block_bytes() - 16,
        }
    }

    /// Where the fifth bits (`qh`) are in a plain block.
    const fn qh_at(self) -> usize {
        if self.has_min() { 4 } else { 2 }
    }
}

/// Packs `ROWS` plain rows (`src`, `rb` bytes each) into `dst` (same length) in the layout of
/// the module docs.
///
/// # Panics
/// If the lengths are not `ROWS` rows of whole blocks.
pub(crate) fn pack_group(fmt: Fmt, src: &[u8], dst: &mut [u8], rb: usize) {
    let bb = fmt.block_bytes();
    assert!(
        rb.is_multiple_of(bb) && src.len() == ROWS * rb && dst.len() == src.len(),
        "lane packing: {} bytes into {} in rows of {rb}",
        src.len(),
        dst.len()
    );
    let gb = ROWS * bb;
    let (qh_at, qs_at, units) = (fmt.qh_at(), fmt.qs_at(), fmt.units());
    let (off_qh, off_codes) = (fmt.off_qh(), fmt.off_codes());
    for (b, d) in dst.chunks_exact_mut(gb).enumerate() {
        let mut masks = [0u64; 8];
        for k in 0..ROWS {
            let blk = &src[k * rb + b * bb..][..bb];
            d[2 * k..2 * k + 2].copy_from_slice(&blk[..2]);
            if fmt.has_min() {
                d[2 * ROWS + 2 * k..2 * ROWS + 2 * k + 2].copy_from_slice(&blk[2..4]);
            }
            if fmt.has_qh() {
                let q = &blk[qh_at..qh_at + 4];
                let qh = u32::from_le_bytes([q[0], q[1], q[2], q[3]]);
                for t in 0..4 {
                    masks[2 * t] |= u64::from((qh >> (4 * t)) & 0xF) << (4 * k);
                    masks[2 * t + 1] |= u64::from((qh >> (16 + 4 * t)) & 0xF) << (4 * k);
                }
            }
            let (qs, _) = blk[qs_at..].as_chunks::<4>();
            let codes = &mut d[off_codes..];
            for (t, q) in qs.iter().take(units).enumerate() {
                codes[64 * t + 4 * k..64 * t + 4 * k + 4].copy_from_slice(q);
            }
        }
        if fmt.has_qh() {
            for (m, o) in masks.iter().zip(d[off_qh..off_qh + 64].chunks_exact_mut(8)) {
                o.copy_from_slice(&m.to_le_bytes());
            }
        }
    }
}

/// The value sums `Σy` of each 32-value block of an activation row of `at` (Q8_0 or Q8_1),
/// into `out` as little-endian i32 (four bytes per block).
pub(crate) fn block_sums(at: QType, row: &[u8], out: &mut [u8]) {
    let (bb, qs) = if at == QType::Q8_1 { (36, 4) } else { (34, 2) };
    for (blk, o) in row.chunks_exact(bb).zip(out.chunks_exact_mut(4)) {
        let s: i32 = blk[qs..].iter().map(|&v| i32::from(v.cast_signed())).sum();
        o.copy_from_slice(&s.to_le_bytes());
    }
}

/// The four bytes at `at` as one i32 (little-endian).
#[inline(always)]
fn word(b: &[u8], at: usize) -> i32 {
    i32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// An f16 at `at` as f32.
#[inline(always)]
fn half(b: &[u8], at: usize) -> f32 {
    specula_quant::blocks::Half([b[at], b[at + 1]]).to_f32()
}

/// `ROWS` weight rows (the packed group `group`, `nb` blocks per row) against `NR` activation
/// rows `a` (blocks of `ab` bytes: Q8_0 34, Q8_1 36) with their block sums `sums` (see
/// [`block_sums`]; empty when the format has no zero point): for each activation row, the 16
/// dot products as f32 lanes.
///
/// # Safety
/// The CPU must support AVX-512 F, BW, VL and VNNI and F16C.
///
/// # Panics
/// If the rows do not all hold `nb` blocks.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(crate) unsafe fn run<const NR: usize>(
    fmt: Fmt,
    group: &[u8],
    nb: usize,
    a: [&[u8]; NR],
    sums: [&[u8]; NR],
) -> [[f32; ROWS]; NR] {
    // One row (decode): each block sum in four independent accumulators, so that its dot
    // products overlap instead of waiting on each other; several rows already overlap.
    macro_rules! k {
        ($f:literal) => {
            if NR == 1 {
                kernel::<NR, $f, 4>(group, nb, a, sums)
            } else {
                kernel::<NR, $f, 1>(group, nb, a, sums)
            }
        };
    }
    match fmt {
        Fmt::Q4_0 => k!(0),
        Fmt::Q4_1 => k!(1),
        Fmt::Q5_0 => k!(2),
        Fmt::Q5_1 => k!(3),
        Fmt::Q8_0 => k!(4),
        // SAFETY: the caller's CPU runs these kernels.
        Fmt::Q4K => unsafe { run_q4k::<NR>(group, nb, a) },
        // SAFETY: as above.
        Fmt::Q6K => unsafe { run_q6k::<NR>(group, nb, a) },
    }
}

/// [`run`] for the format numbered `F` (the order of [`Fmt`]), so that every format test
/// folds away, with each row's block sum in `C` accumulators: products `2t` and `2t + 1` of
/// the nibble formats, or unit `t` of Q8_0, go to accumulator `(2t or t) mod C`, and they are
/// added at the end — exact integers, so the sum is the same for every `C`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn kernel<const NR: usize, const F: u8, const C: usize>(
    group: &[u8],
    nb: usize,
    a: [&[u8]; NR],
    sums: [&[u8]; NR],
) -> [[f32; ROWS]; NR] {
    let fmt = [Fmt::Q4_0, Fmt::Q4_1, Fmt::Q5_0, Fmt::Q5_1, Fmt::Q8_0][usize::from(F)];
    let gb = ROWS * fmt.block_bytes();
    let ab = if fmt.has_min() { 36 } else { 34 };
    let a_qs = ab - 32;
    assert!(
        group.len() == nb * gb
            && a.iter().all(|r| r.len() == nb * ab)
            && (!fmt.needs_sums() || sums.iter().all(|s| s.len() == nb * 4)),
        "lane kernel: rows of unequal block counts"
    );
    let m4 = _mm512_set1_epi8(0x0F);
    let x10 = _mm512_set1_epi8(0x10);
    let x80 = _mm512_set1_epi8(-128);
    let mut sumf = [_mm512_setzero_ps(); NR];
    for b in 0..nb {
        let g = &group[b * gb..(b + 1) * gb];
        let gp = g.as_ptr();
        let ap: [*const u8; NR] = std::array::from_fn(|j| a[j][b * ab + a_qs..][..32].as_ptr());
        // SAFETY (the reads below): `g` is the group's block, `gb` bytes: the codes' units
        // end at `off_codes + 64·units = gb` and the fifth-bit masks lie below the codes;
        // each `ap[j]` points at the 32 code bytes of activation block `b` (sliced above) and
        // the reads stay inside them (`4t + 4 ≤ 16` for the low and `16 + 4t + 4 ≤ 32` for the
        // high half of the nibble formats, `4t + 4 ≤ 32` for Q8_0). Unaligned reads.
        let y = |j: usize, at: usize| {
            // SAFETY: see above.
            unsafe { ap[j].add(at).cast::<i32>().read_unaligned() }
        };
        let mut acc = [[_mm512_setzero_si512(); C]; NR];
        for t in 0..fmt.units() {
            // SAFETY: see above.
            let w = unsafe { _mm512_loadu_si512(gp.add(fmt.off_codes() + 64 * t).cast()) };
            if fmt == Fmt::Q8_0 {
                // Signed codes as unsigned `w + 128` (zero point 128).
                let u = _mm512_xor_si512(w, x80);
                let c = t % C;
                for (j, acc) in acc.iter_mut().enumerate() {
                    acc[c] = _mm512_dpbusd_epi32(acc[c], u, _mm512_set1_epi32(y(j, 4 * t)));
                }
                continue;
            }
            let mut lo = _mm512_and_si512(w, m4);
            let mut hi = _mm512_and_si512(_mm512_srli_epi16::<4>(w), m4);
            if fmt.has_qh() {
                let at = fmt.off_qh() + 16 * t;
                // SAFETY: see above.
                let (ml, mh) = unsafe {
                    (
                        gp.add(at).cast::<u64>().read_unaligned(),
                        gp.add(at + 8).cast::<u64>().read_unaligned(),
                    )
                };
                lo = _mm512_or_si512(lo, _mm512_maskz_mov_epi8(ml, x10));
                hi = _mm512_or_si512(hi, _mm512_maskz_mov_epi8(mh, x10));
            }
            let (cl, ch) = ((2 * t) % C, (2 * t + 1) % C);
            for (j, acc) in acc.iter_mut().enumerate() {
                acc[cl] = _mm512_dpbusd_epi32(acc[cl], lo, _mm512_set1_epi32(y(j, 4 * t)));
                acc[ch] = _mm512_dpbusd_epi32(acc[ch], hi, _mm512_set1_epi32(y(j, 16 + 4 * t)));
            }
        }
        // SAFETY: reads the 32 bytes of the group's d (16 f16).
        let dw = _mm512_cvtph_ps(unsafe { _mm256_loadu_si256(g.as_ptr().cast()) });
        let mw = if fmt.has_min() {
            // SAFETY: reads the 32 bytes of the group's m (16 f16).
            _mm512_cvtph_ps(unsafe { _mm256_loadu_si256(g[2 * ROWS..].as_ptr().cast()) })
        } else {
            _mm512_setzero_ps()
        };
        for j in 0..NR {
            let mut isum = acc[j][0];
            for &c in &acc[j][1..] {
                isum = _mm512_add_epi32(isum, c);
            }
            if fmt.needs_sums() {
                let zy = fmt.zero() * word(sums[j], 4 * b);
                isum = _mm512_sub_epi32(isum, _mm512_set1_epi32(zy));
            }
            let s = _mm512_cvtepi32_ps(isum);
            let da = _mm512_set1_ps(half(a[j], b * ab));
            // The scalar formulas' operations in their order (no fused multiply-add).
            let t = match fmt {
                Fmt::Q8_0 => _mm512_mul_ps(s, _mm512_mul_ps(dw, da)),
                Fmt::Q4_0 => _mm512_mul_ps(_mm512_mul_ps(s, dw), da),
                Fmt::Q5_0 => _mm512_mul_ps(_mm512_mul_ps(dw, da), s),
                Fmt::Q4_1 | Fmt::Q5_1 | Fmt::Q4K | Fmt::Q6K => {
                    let sa = _mm512_set1_ps(half(a[j], b * ab + 2));
                    _mm512_add_ps(
                        _mm512_mul_ps(_mm512_mul_ps(dw, da), s),
                        _mm512_mul_ps(mw, sa),
                    )
                }
            };
            sumf[j] = _mm512_add_ps(sumf[j], t);
        }
    }
    lanes_out(sumf)
}

/// The running sums of `NR` activation rows as 16 outputs each.
#[inline]
#[target_feature(enable = "avx512f")]
fn lanes_out<const NR: usize>(sumf: [__m512; NR]) -> [[f32; ROWS]; NR] {
    let mut out = [[0.0f32; ROWS]; NR];
    for (o, v) in out.iter_mut().zip(sumf) {
        // SAFETY: writes the 64 bytes of `o`.
        unsafe { _mm512_storeu_ps(o.as_mut_ptr(), v) };
    }
    out
}

/// Bytes of a Q8_K activation block (`d: f32`, 256 values, 16 bsums).
const AB: usize = 292;

/// Checks that a K-quant lane group holds `ROWS` rows of `nb` super-blocks of `bb` bytes and
/// every activation row `nb` Q8_K blocks; returns the bytes of one group block.
///
/// # Panics
/// If they do not.
fn check_k_rows<const NR: usize>(group: &[u8], nb: usize, bb: usize, a: &[&[u8]; NR]) -> usize {
    let gb = ROWS * bb;
    assert!(
        group.len() == nb * gb && a.iter().all(|r| r.len() == nb * AB),
        "K-quant lane kernel: rows of unequal block counts"
    );
    gb
}

/// The scale `d` of Q8_K block `b` of an activation row.
fn q8k_d(row: &[u8], b: usize) -> f32 {
    let at = b * AB;
    f32::from_le_bytes([row[at], row[at + 1], row[at + 2], row[at + 3]])
}

/// Bytes of a Q4_K super-block of one row.
const Q4K_BYTES: usize = 144;
/// Offsets in a packed Q4_K group block: the 16 rows' `d`, `dmin`, the three 32-bit words of
/// their packed scales (word `w` of every row, then the next word), then the codes unit by unit
/// (chunk `c` of 64 values, unit `t`: bytes `32c + 4t..32c + 4t + 4` of each row's `qs`).
const Q4K_DMIN: usize = 2 * ROWS;
const Q4K_SCALES: usize = 4 * ROWS;
const Q4K_CODES: usize = Q4K_SCALES + 12 * ROWS;

/// Packs `ROWS` plain Q4_K rows (`src`, `rb` bytes each) into `dst` (same length).
///
/// # Panics
/// If the lengths are not `ROWS` rows of whole super-blocks.
pub(crate) fn pack_group_q4k(src: &[u8], dst: &mut [u8], rb: usize) {
    assert!(
        rb.is_multiple_of(Q4K_BYTES) && src.len() == ROWS * rb && dst.len() == src.len(),
        "Q4_K lane packing: {} bytes into {} in rows of {rb}",
        src.len(),
        dst.len()
    );
    for (b, d) in dst.chunks_exact_mut(ROWS * Q4K_BYTES).enumerate() {
        for k in 0..ROWS {
            let blk = &src[k * rb + b * Q4K_BYTES..][..Q4K_BYTES];
            d[2 * k..2 * k + 2].copy_from_slice(&blk[..2]);
            d[Q4K_DMIN + 2 * k..Q4K_DMIN + 2 * k + 2].copy_from_slice(&blk[2..4]);
            for w in 0..3 {
                let at = Q4K_SCALES + 4 * ROWS * w + 4 * k;
                d[at..at + 4].copy_from_slice(&blk[4 + 4 * w..8 + 4 * w]);
            }
            let (qs, _) = blk[16..].as_chunks::<4>();
            for (u, q) in qs.iter().enumerate() {
                // Unit u = 8c + t covers bytes 4u..4u + 4 of qs.
                let at = Q4K_CODES + 64 * u + 4 * k;
                d[at..at + 4].copy_from_slice(q);
            }
        }
    }
}

/// Q4_K lane kernel: `ROWS` weight rows (the packed group, `nb` super-blocks per row) against
/// `NR` Q8_K activation rows; per super-block and row the quant crate's `kmin_term` of the
/// exact integer sums `isum = Σ_j sc_j · Σ q·y` and `summs = Σ_j m_j · (bsum_2j + bsum_2j+1)`,
/// added in super-block order.
///
/// # Safety
/// The CPU must support AVX-512 F, BW, VL and VNNI and F16C.
///
/// # Panics
/// If the rows do not all hold `nb` super-blocks.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(crate) unsafe fn run_q4k<const NR: usize>(
    group: &[u8],
    nb: usize,
    a: [&[u8]; NR],
) -> [[f32; ROWS]; NR] {
    let gb = check_k_rows(group, nb, Q4K_BYTES, &a);
    let m4 = _mm512_set1_epi8(0x0F);
    let k1 = _mm512_set1_epi32(0x3f3f_3f3f);
    let k2 = _mm512_set1_epi32(0x0f0f_0f0f);
    let k3 = _mm512_set1_epi32(0x0303_0303);
    let xff = _mm512_set1_epi32(0xFF);
    let mut sumf = [_mm512_setzero_ps(); NR];
    for b in 0..nb {
        let g = &group[b * gb..(b + 1) * gb];
        let gp = g.as_ptr();
        let ld = |at: usize| {
            // SAFETY: the offsets used stay inside the group block of `gb` bytes (the scales
            // end at `Q4K_CODES`, the 32 code units at `Q4K_CODES + 2048 = gb`).
            unsafe { _mm512_loadu_si512(gp.add(at).cast()) }
        };
        // The eight 6-bit scales and mins of every row (`get_scale_min_k4` on 16 lanes).
        let (u0, u1, u2) = (
            ld(Q4K_SCALES),
            ld(Q4K_SCALES + 4 * ROWS),
            ld(Q4K_SCALES + 8 * ROWS),
        );
        let sc_lo = _mm512_and_si512(u0, k1);
        let sc_hi = _mm512_or_si512(
            _mm512_and_si512(u2, k2),
            _mm512_slli_epi32::<4>(_mm512_and_si512(_mm512_srli_epi32::<6>(u0), k3)),
        );
        let m_lo = _mm512_and_si512(u1, k1);
        let m_hi = _mm512_or_si512(
            _mm512_and_si512(_mm512_srli_epi32::<4>(u2), k2),
            _mm512_slli_epi32::<4>(_mm512_and_si512(_mm512_srli_epi32::<6>(u1), k3)),
        );
        // Byte j of a word, as i32 lanes.
        let byte = |v: __m512i, j: u32| {
            _mm512_and_si512(
                _mm512_srlv_epi32(v, _mm512_set1_epi32(8 * j.cast_signed())),
                xff,
            )
        };
        // Mins as i16 pairs (m_2i, m_2i+1) per 32-bit lane, for `vpdpwssd` with bsum pairs.
        let pairs = |v: __m512i| {
            let lo = _mm512_or_si512(
                _mm512_and_si512(v, xff),
                _mm512_slli_epi32::<16>(_mm512_and_si512(_mm512_srli_epi32::<8>(v), xff)),
            );
            let hi = _mm512_or_si512(
                _mm512_and_si512(_mm512_srli_epi32::<16>(v), xff),
                _mm512_slli_epi32::<16>(_mm512_srli_epi32::<24>(v)),
            );
            (lo, hi)
        };
        let (mp0, mp1) = pairs(m_lo);
        let (mp2, mp3) = pairs(m_hi);
        let mp = [mp0, mp1, mp2, mp3];
        let ap: [*const u8; NR] = std::array::from_fn(|j| a[j][b * AB..][..AB].as_ptr());
        let y = |j: usize, at: usize| {
            // SAFETY: `at + 4 ≤ 260` for the values (`4 + 256`) and `≤ 292` for the bsums:
            // inside activation block `b` of `AB` bytes (sliced above).
            unsafe { ap[j].add(at).cast::<i32>().read_unaligned() }
        };
        let mut isum = [_mm512_setzero_si512(); NR];
        for c in 0..4 {
            let mut s_lo = [_mm512_setzero_si512(); NR];
            let mut s_hi = [_mm512_setzero_si512(); NR];
            for t in 0..8 {
                let w = ld(Q4K_CODES + 64 * (8 * c + t));
                let lo = _mm512_and_si512(w, m4);
                let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(w), m4);
                for j in 0..NR {
                    let qa = 4 + 64 * c + 4 * t;
                    s_lo[j] = _mm512_dpbusd_epi32(s_lo[j], lo, _mm512_set1_epi32(y(j, qa)));
                    s_hi[j] = _mm512_dpbusd_epi32(s_hi[j], hi, _mm512_set1_epi32(y(j, qa + 32)));
                }
            }
            let (src, jj) = if c < 2 {
                (sc_lo, 2 * c)
            } else {
                (sc_hi, 2 * c - 4)
            };
            let jj = u32::try_from(jj).unwrap_or(0);
            let (sa, sb) = (byte(src, jj), byte(src, jj + 1));
            for j in 0..NR {
                isum[j] = _mm512_add_epi32(isum[j], _mm512_mullo_epi32(sa, s_lo[j]));
                isum[j] = _mm512_add_epi32(isum[j], _mm512_mullo_epi32(sb, s_hi[j]));
            }
        }
        // SAFETY: reads the 32 bytes of the group's d and dmin (16 f16 each).
        let (dw, dminw) = unsafe {
            (
                _mm512_cvtph_ps(_mm256_loadu_si256(gp.cast())),
                _mm512_cvtph_ps(_mm256_loadu_si256(gp.add(Q4K_DMIN).cast())),
            )
        };
        for j in 0..NR {
            // Pairs (bsum_2j + bsum_2j+1) for sub-blocks (2i, 2i + 1) as two i16 in an i32.
            // The two i16 bsums of 32-value sub-block k, summed.
            let bs = |k: usize| {
                let [b0, b1, b2, b3] = y(j, 260 + 4 * k).to_le_bytes();
                i32::from(i16::from_le_bytes([b0, b1])) + i32::from(i16::from_le_bytes([b2, b3]))
            };
            let mut summs = _mm512_setzero_si512();
            for (i, mp) in mp.iter().enumerate() {
                let (s0, s1) = (bs(2 * i), bs(2 * i + 1));
                let pair = (s0 & 0xFFFF) | (s1 << 16);
                summs = _mm512_dpwssd_epi32(summs, *mp, _mm512_set1_epi32(pair));
            }
            let da = _mm512_set1_ps(q8k_d(a[j], b));
            let d = _mm512_mul_ps(dw, da);
            let dmin = _mm512_mul_ps(dminw, da);
            let t = _mm512_sub_ps(
                _mm512_mul_ps(d, _mm512_cvtepi32_ps(isum[j])),
                _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(summs)),
            );
            sumf[j] = _mm512_add_ps(sumf[j], t);
        }
    }
    lanes_out(sumf)
}

/// Bytes of a Q6_K super-block of one row (`ql[128]`, `qh[64]`, `scales[16]`, `d`).
const Q6K_BYTES: usize = 210;
/// Offsets in a packed Q6_K group block: the 16 rows' `d`, their sixteen i8 scales (scale `s`
/// of every row, then the next), then 16 units (half `n` of 128 values, `l = 4u` for unit
/// `8n + u`), each three 64-byte vectors: `ql[64n + l..+4]`, `ql[64n + 32 + l..+4]` and
/// `qh[32n + l..+4]` of every row.
const Q6K_SCALES: usize = 2 * ROWS;
const Q6K_CODES: usize = Q6K_SCALES + 16 * ROWS;

/// Packs `ROWS` plain Q6_K rows (`src`, `rb` bytes each) into `dst` (same length).
///
/// # Panics
/// If the lengths are not `ROWS` rows of whole super-blocks.
pub(crate) fn pack_group_q6k(src: &[u8], dst: &mut [u8], rb: usize) {
    assert!(
        rb.is_multiple_of(Q6K_BYTES) && src.len() == ROWS * rb && dst.len() == src.len(),
        "Q6_K lane packing: {} bytes into {} in rows of {rb}",
        src.len(),
        dst.len()
    );
    for (b, d) in dst.chunks_exact_mut(ROWS * Q6K_BYTES).enumerate() {
        for k in 0..ROWS {
            let blk = &src[k * rb + b * Q6K_BYTES..][..Q6K_BYTES];
            let (ql, rest) = blk.split_at(128);
            let (qh, rest) = rest.split_at(64);
            let (sc, dd) = rest.split_at(16);
            d[2 * k..2 * k + 2].copy_from_slice(dd);
            for (s, &v) in sc.iter().enumerate() {
                d[Q6K_SCALES + ROWS * s + k] = v;
            }
            for n in 0..2 {
                for u in 0..8 {
                    let l = 4 * u;
                    let at = Q6K_CODES + 192 * (8 * n + u) + 4 * k;
                    d[at..at + 4].copy_from_slice(&ql[64 * n + l..64 * n + l + 4]);
                    d[at + 64..at + 68].copy_from_slice(&ql[64 * n + 32 + l..64 * n + 36 + l]);
                    d[at + 128..at + 132].copy_from_slice(&qh[32 * n + l..32 * n + l + 4]);
                }
            }
        }
    }
}

/// Q6_K lane kernel: `ROWS` weight rows (the packed group, `nb` super-blocks per row) against
/// `NR` Q8_K activation rows; per super-block and row the quant crate's `k_term` of the exact
/// `isum = Σ_s scale_s · (Σ q·y − 32·bsum_s)` over the sixteen 16-value sub-blocks, added in
/// super-block order.
///
/// # Safety
/// The CPU must support AVX-512 F, BW, VL and VNNI and F16C.
///
/// # Panics
/// If the rows do not all hold `nb` super-blocks.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(crate) unsafe fn run_q6k<const NR: usize>(
    group: &[u8],
    nb: usize,
    a: [&[u8]; NR],
) -> [[f32; ROWS]; NR] {
    let gb = check_k_rows(group, nb, Q6K_BYTES, &a);
    let m4 = _mm512_set1_epi8(0x0F);
    let m03 = _mm512_set1_epi8(0x03);
    let m0c = _mm512_set1_epi8(0x0C);
    let m30 = _mm512_set1_epi8(0x30);
    let mut sumf = [_mm512_setzero_ps(); NR];
    for b in 0..nb {
        let g = &group[b * gb..(b + 1) * gb];
        let gp = g.as_ptr();
        let ld = |at: usize| {
            // SAFETY: the code vectors end at `Q6K_CODES + 16·192 = gb`, inside the group
            // block.
            unsafe { _mm512_loadu_si512(gp.add(at).cast()) }
        };
        let scale = |s: usize| {
            // SAFETY: the 16 scales of sub-block `s < 16` lie below `Q6K_CODES`.
            _mm512_cvtepi8_epi32(unsafe { _mm_loadu_si128(gp.add(Q6K_SCALES + ROWS * s).cast()) })
        };
        let ap: [*const u8; NR] = std::array::from_fn(|j| a[j][b * AB..][..AB].as_ptr());
        let y = |j: usize, at: usize| {
            // SAFETY: `at + 4 ≤ 260`: inside activation block `b` (sliced above).
            unsafe { ap[j].add(at).cast::<i32>().read_unaligned() }
        };
        let bsum = |j: usize, s: usize| {
            let at = b * AB + 260 + 2 * s;
            i32::from(i16::from_le_bytes([a[j][at], a[j][at + 1]]))
        };
        let mut isum = [_mm512_setzero_si512(); NR];
        for n in 0..2 {
            for h in 0..2 {
                // Units l = 16h..16h + 16 of half n: sub-blocks 8n + h + {0, 2, 4, 6}.
                let mut acc = [[_mm512_setzero_si512(); 4]; NR];
                for u in 4 * h..4 * h + 4 {
                    let base = Q6K_CODES + 192 * (8 * n + u);
                    let (qa, qb, qh) = (ld(base), ld(base + 64), ld(base + 128));
                    let q = [
                        _mm512_or_si512(
                            _mm512_and_si512(qa, m4),
                            _mm512_slli_epi16::<4>(_mm512_and_si512(qh, m03)),
                        ),
                        _mm512_or_si512(
                            _mm512_and_si512(qb, m4),
                            _mm512_slli_epi16::<2>(_mm512_and_si512(qh, m0c)),
                        ),
                        _mm512_or_si512(
                            _mm512_and_si512(_mm512_srli_epi16::<4>(qa), m4),
                            _mm512_and_si512(qh, m30),
                        ),
                        _mm512_or_si512(
                            _mm512_and_si512(_mm512_srli_epi16::<4>(qb), m4),
                            _mm512_and_si512(_mm512_srli_epi16::<2>(qh), m30),
                        ),
                    ];
                    let at = 4 + 128 * n + 4 * u;
                    #[allow(
                        clippy::needless_range_loop,
                        reason = "`j` picks the activation row and its accumulators alike"
                    )]
                    for j in 0..NR {
                        for (g, q) in q.iter().enumerate() {
                            acc[j][g] = _mm512_dpbusd_epi32(
                                acc[j][g],
                                *q,
                                _mm512_set1_epi32(y(j, at + 32 * g)),
                            );
                        }
                    }
                }
                #[allow(
                    clippy::needless_range_loop,
                    reason = "`g` picks the sub-block and its accumulators alike"
                )]
                for g in 0..4 {
                    let s = 8 * n + h + 2 * g;
                    let sc = scale(s);
                    for j in 0..NR {
                        let v = _mm512_sub_epi32(acc[j][g], _mm512_set1_epi32(32 * bsum(j, s)));
                        isum[j] = _mm512_add_epi32(isum[j], _mm512_mullo_epi32(sc, v));
                    }
                }
            }
        }
        // SAFETY: reads the 32 bytes of the group's d (16 f16).
        let dw = _mm512_cvtph_ps(unsafe { _mm256_loadu_si256(gp.cast()) });
        for j in 0..NR {
            let da = _mm512_set1_ps(q8k_d(a[j], b));
            let t = _mm512_mul_ps(_mm512_mul_ps(dw, da), _mm512_cvtepi32_ps(isum[j]));
            sumf[j] = _mm512_add_ps(sumf[j], t);
        }
    }
    lanes_out(sumf)
}
