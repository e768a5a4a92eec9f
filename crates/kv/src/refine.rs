//! Encoders of padded turbo heads (head dim not a multiple of 128): the two-stage encoder of
//! 64-value heads ([`encode_two_stage`], [`crate::turbo_two_stage`]) and the refinement of the
//! codes of heads padded with signed copies (every other width).
//!
//! A two-stage head's rotated values each pick the nearest of the `levels²` values
//! `c_a + β·c_b` for the block's norm, which is fitted on a grid of scales and refined by two
//! Lloyd steps; that choice is exact for the stored norm, so no descent is needed.
//!
//! A padded head of `hd` values is stored as `dim` rotated codes (the head and its signed
//! copies, [`crate::turbo_pad`]); attention reads it back as `A·y`, where `y` is the decoded
//! rotated vector (`norm · centroid` per value) and `A` (`hd × dim`) is the inverse rotation
//! followed by the fold onto the head ([`crate::turbo_fold`]). The reference quantizer picks
//! each code as the centroid nearest to the rotated value, which minimizes the error in all
//! `dim` coordinates; but only the `hd`-dimensional image `A·y` is ever read, so the error
//! in the other `dim − hd` directions is free. Coordinate descent on `‖k − A·y‖²` uses that
//! freedom: each code in turn is moved to the centroid nearest the value that minimizes the
//! error given the other codes (never a worse choice, since the error is quadratic in one code
//! with the same curvature for every centroid), then each group's norm is refitted by least
//! squares, until no code changes. The blocks keep the fork's layout and decode exactly as
//! before (nothing on the read side changes).
//!
//! The descent keeps `g = Aᵀ(k − A·y)` up to date through the Gram matrix `G = AᵀA` (one column
//! per changed code), so a pass costs `dim` comparisons plus `dim` per change; `A·y` and `Aᵀ·u`
//! are a fast inverse rotation + fold and a query padding + fast forward rotation. The norms
//! are refitted after every pass.
//!
//! Measured on 64-value heads padded to 128 with signed copies (relative MSE): turbo4 0.0047
//! → 0.0011, turbo3 0.0176 → 0.0045, turbo2 0.061 → 0.019 (`tests.rs` gates the order of
//! these; the plane stores such heads in two stages now, at 0.00004 / 0.0006 / 0.0089). Starting also
//! from codes of the head scaled by 0.8 and 1.25 and keeping the best gives another 10–30 %
//! (turbo4 0.0008) at three times the cost; not done, the writes must stay cheap.

use std::sync::{Arc, Mutex, OnceLock};

use specula_quant::blocks::Half;
use specula_quant::{QType, turbo, wht};

use crate::layout::{turbo_fold, turbo_pad_query};

/// Passes over the codes at most (measured: three or four reach the plateau).
const MAX_PASSES: usize = 4;

/// `G = AᵀA` for heads of `hd` values stored in `dim` (row-major, symmetric).
fn gram(hd: usize, dim: usize) -> Arc<Vec<f32>> {
    type Cache = Mutex<Vec<((usize, usize), Arc<Vec<f32>>)>>;
    static CACHE: OnceLock<Cache> = OnceLock::new();
    let cache = CACHE.get_or_init(|| Mutex::new(Vec::new()));
    let mut c = cache
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some((_, m)) = c.iter().find(|(k, _)| *k == (hd, dim)) {
        return Arc::clone(m);
    }
    let mut g = Vec::with_capacity(dim * dim);
    let mut e = vec![0.0f32; dim];
    let mut u = vec![0.0f32; hd];
    for i in 0..dim {
        e.fill(0.0);
        e[i] = 1.0;
        apply_a(&mut e, hd, &mut u);
        apply_at(&u, &mut e);
        g.extend_from_slice(&e);
    }
    let m = Arc::new(g);
    c.push(((hd, dim), Arc::clone(&m)));
    m
}

/// `u = A·y` (`y` is clobbered).
fn apply_a(y: &mut [f32], hd: usize, u: &mut [f32]) {
    wht::inverse_row(y);
    turbo_fold(y, hd);
    u.copy_from_slice(&y[..hd]);
}

/// `out = Aᵀ·u` (`out.len()` = dim).
fn apply_at(u: &[f32], out: &mut [f32]) {
    let hd = u.len();
    out[..hd].copy_from_slice(u);
    turbo_pad_query(out, hd);
    wht::forward_row(out);
}

/// Code table, thresholds and block bytes of a turbo type.
fn tables(ty: QType) -> Option<(&'static [f32], &'static [f32], usize)> {
    match ty {
        QType::Turbo2 => Some((&turbo::CENTROIDS_2, &turbo::THRESHOLDS_2, 34)),
        QType::Turbo3 => Some((&turbo::CENTROIDS_3, &turbo::THRESHOLDS_3, 50)),
        QType::Turbo4 => Some((&turbo::CENTROIDS_4, &turbo::THRESHOLDS_4, 66)),
        _ => None,
    }
}

/// Code `j` of a block.
fn get(ty: QType, b: &[u8], j: usize) -> u8 {
    match ty {
        QType::Turbo2 => (b[2 + j / 4] >> (2 * (j % 4))) & 3,
        QType::Turbo3 => {
            ((b[2 + j / 4] >> (2 * (j % 4))) & 3) | (((b[34 + j / 8] >> (j % 8)) & 1) << 2)
        }
        _ => (b[2 + j / 2] >> (4 * (j % 2))) & 15,
    }
}

/// Sets code `j` of a block.
fn set(ty: QType, b: &mut [u8], j: usize, c: u8) {
    match ty {
        QType::Turbo2 => {
            let (i, s) = (2 + j / 4, 2 * (j % 4));
            b[i] = (b[i] & !(3 << s)) | ((c & 3) << s);
        }
        QType::Turbo3 => {
            let (i, s) = (2 + j / 4, 2 * (j % 4));
            b[i] = (b[i] & !(3 << s)) | ((c & 3) << s);
            let (i, s) = (34 + j / 8, j % 8);
            b[i] = (b[i] & !(1 << s)) | (((c >> 2) & 1) << s);
        }
        _ => {
            let (i, s) = (2 + j / 2, 4 * (j % 2));
            b[i] = (b[i] & !(15 << s)) | ((c & 15) << s);
        }
    }
}

fn code_of(t: f32, thresholds: &[f32]) -> u8 {
    thresholds.iter().map(|&x| u8::from(t >= x)).sum()
}

/// Working state of the descent for one head.
struct Work<'a> {
    cent: &'a [f32],
    thr: &'a [f32],
    hd: usize,
    dim: usize,
    target: &'a [f32],
    g: Arc<Vec<f32>>,
    y: Vec<f32>,
    u: Vec<f32>,
    grad: Vec<f32>,
}

impl Work<'_> {
    /// Decoded rotated vector of `codes` with group norms `s`, into `self.y`.
    fn decode(&mut self, codes: &[u8], s: &[f32]) {
        for (i, (y, &c)) in self.y.iter_mut().zip(codes).enumerate() {
            *y = s[i / wht::GROUP] * self.cent[usize::from(c)];
        }
    }

    /// `grad = Aᵀ(k − A·y)` for `self.y` (clobbers `y`).
    fn residual(&mut self) {
        let (hd, dim) = (self.hd, self.dim);
        apply_a(&mut self.y[..dim], hd, &mut self.u);
        for (u, &k) in self.u.iter_mut().zip(self.target) {
            *u = k - *u;
        }
        apply_at(&self.u, &mut self.grad);
    }

    fn descend(&mut self, codes: &mut [u8], s: &mut [f32]) {
        let dim = self.dim;
        let mut v = vec![0.0f32; dim];
        let mut vu = vec![0.0f32; self.hd];
        for _ in 0..MAX_PASSES {
            self.decode(codes, s);
            self.residual();
            let mut changed = false;
            for i in 0..dim {
                let sg = s[i / wht::GROUP];
                let gii = self.g[i * dim + i];
                if sg == 0.0 || gii <= 0.0 {
                    continue;
                }
                let c = usize::from(codes[i]);
                let old = self.cent[c];
                let t = old + self.grad[i] / (sg * gii);
                // Most codes stay: t is still inside the current code's cell.
                let lo = if c == 0 {
                    f32::NEG_INFINITY
                } else {
                    self.thr[c - 1]
                };
                let hi = self.thr.get(c).copied().unwrap_or(f32::INFINITY);
                if t >= lo && t < hi {
                    continue;
                }
                let new = code_of(t, self.thr);
                if new != codes[i] {
                    let delta = sg * (self.cent[usize::from(new)] - old);
                    for (gr, &gv) in self.grad.iter_mut().zip(&self.g[i * dim..(i + 1) * dim]) {
                        *gr -= delta * gv;
                    }
                    codes[i] = new;
                    changed = true;
                }
            }
            // Least-squares norm of each group given the others, as the fp16 it is stored as.
            for gi in 0..s.len() {
                if s[gi] == 0.0 {
                    continue;
                }
                let range = gi * wht::GROUP..(gi + 1) * wht::GROUP;
                v.fill(0.0);
                for i in range.clone() {
                    v[i] = self.cent[usize::from(codes[i])];
                }
                apply_a(&mut v, self.hd, &mut vu);
                let (mut num, mut den) = (0.0f32, 0.0f32);
                if s.len() == 1 {
                    for (&k, &w) in self.target.iter().zip(&vu) {
                        num += k * w;
                        den += w * w;
                    }
                } else {
                    self.decode(codes, s);
                    for i in range {
                        self.y[i] = 0.0;
                    }
                    apply_a(&mut self.y[..dim], self.hd, &mut self.u);
                    for ((&k, &o), &w) in self.target.iter().zip(&self.u).zip(&vu) {
                        num += (k - o) * w;
                        den += w * w;
                    }
                }
                if den > 0.0 {
                    let fitted = Half::from_f32(num / den).to_f32();
                    if fitted > 0.0 && fitted.is_finite() {
                        s[gi] = fitted;
                    }
                }
            }
            if !changed {
                break;
            }
        }
    }
}

/// Refines the turbo blocks `dst` (`dim / 128` blocks, already encoded by the reference
/// quantizer from the padded head) against `target`, the `hd` head values attention should
/// read back. Does nothing for a head that is not padded or a format that is not turbo.
pub(crate) fn refine_turbo(ty: QType, target: &[f32], dst: &mut [u8]) {
    let Some((cent, thr, bs)) = tables(ty) else {
        return;
    };
    let hd = target.len();
    let dim = dst.len() / bs * wht::GROUP;
    if dim <= hd || !dst.len().is_multiple_of(bs) {
        return;
    }
    let groups = dim / wht::GROUP;
    let mut codes: Vec<u8> = (0..dim)
        .map(|i| get(ty, &dst[(i / wht::GROUP) * bs..], i % wht::GROUP))
        .collect();
    let mut s: Vec<f32> = (0..groups)
        .map(|g| Half([dst[g * bs], dst[g * bs + 1]]).to_f32())
        .collect();
    let mut w = Work {
        cent,
        thr,
        hd,
        dim,
        target,
        g: gram(hd, dim),
        y: vec![0.0; dim],
        u: vec![0.0; hd],
        grad: vec![0.0; dim],
    };
    w.descend(&mut codes, &mut s);
    for (gi, &sg) in s.iter().enumerate() {
        dst[gi * bs..gi * bs + 2].copy_from_slice(&Half::from_f32(sg).0);
    }
    for (i, &c) in codes.iter().enumerate() {
        set(ty, &mut dst[(i / wht::GROUP) * bs..], i % wht::GROUP, c);
    }
}

/// The values `c_i + β·c_j` of a two-stage turbo head ([`crate::turbo_two_stage`]), sorted,
/// with their code pairs, the midpoints between neighbours, and a table over uniform bins of
/// the levels' range giving the number of midpoints below each bin (the nearest level is then
/// found by a short scan from there, exactly).
struct Levels {
    value: Vec<f32>,
    pair: Vec<(u8, u8)>,
    mid: Vec<f32>,
    lo: f32,
    inv_width: f32,
    last_bin: f32,
    below: Vec<u16>,
    /// `below` widened, for the vector gathers.
    below32: Vec<u32>,
}

/// Bins of the nearest-level table per level.
const BINS_PER_LEVEL: usize = 8;

impl Levels {
    fn new(cent: &[f32], beta: f32) -> Self {
        let mut all: Vec<(f32, (u8, u8))> = Vec::with_capacity(cent.len() * cent.len());
        for (i, &a) in cent.iter().enumerate() {
            for (j, &b) in cent.iter().enumerate() {
                let code = |k: usize| u8::try_from(k).expect("at most 16 centroids");
                all.push((a + beta * b, (code(i), code(j))));
            }
        }
        all.sort_by(|x, y| x.0.total_cmp(&y.0));
        let value: Vec<f32> = all.iter().map(|x| x.0).collect();
        let mid: Vec<f32> = value.windows(2).map(|w| 0.5 * (w[0] + w[1])).collect();
        let bins = BINS_PER_LEVEL * value.len();
        let (lo, hi) = (value[0], value[value.len() - 1]);
        #[allow(clippy::cast_precision_loss, reason = "at most 2048 bins")]
        let width = (hi - lo) / bins as f32;
        let below: Vec<u16> = (0..bins)
            .map(|b| {
                #[allow(clippy::cast_precision_loss, reason = "at most 2048 bins")]
                let start = lo + b as f32 * width;
                u16::try_from(mid.partition_point(|&m| m < start)).expect("at most 255 midpoints")
            })
            .collect();
        #[allow(clippy::cast_precision_loss, reason = "at most 2048 bins")]
        let last_bin = (bins - 1) as f32;
        Self {
            value,
            pair: all.iter().map(|x| x.1).collect(),
            mid,
            lo,
            inv_width: 1.0 / width,
            last_bin,
            below32: below.iter().map(|&b| u32::from(b)).collect(),
            below,
        }
    }

    /// Index of the level nearest `t` (the number of midpoints `≤ t`).
    #[inline]
    fn nearest(&self, t: f32) -> usize {
        let b = ((t - self.lo) * self.inv_width).clamp(0.0, self.last_bin);
        #[allow(
            clippy::cast_possible_truncation,
            clippy::cast_sign_loss,
            reason = "clamped to the bins (NaN becomes bin 0)"
        )]
        let mut i = usize::from(self.below[b as usize]);
        // Every midpoint below the bin's start is ≤ t (for t below the range, none is).
        while i < self.mid.len() && self.mid[i] <= t {
            i += 1;
        }
        i
    }

    /// `idx[j]` = the level nearest `z[j] · inv` ([`Levels::nearest`]) for a 64-value head;
    /// sixteen values at a time on AVX-512 CPUs (the same operations, so the same levels).
    fn nearest_all(&self, z: &[f32; wht::HALF], inv: f32, idx: &mut [u32; wht::HALF]) {
        #[cfg(target_arch = "x86_64")]
        if nearest_x86::available() {
            // SAFETY: the CPU has AVX-512 F (checked above); `below` holds valid midpoint
            // indices and the table lengths are the levels' own.
            unsafe { nearest_x86::nearest64(self, z, inv, idx) };
            return;
        }
        for (i, &v) in idx.iter_mut().zip(z) {
            *i = u32::try_from(self.nearest(v * inv)).expect("at most 256 levels");
        }
    }

    /// `Σ (z − s·level)²` with each value at its nearest level for the scale `s` (summed in
    /// order).
    fn error(&self, z: &[f32; wht::HALF], s: f32) -> f32 {
        let mut idx = [0u32; wht::HALF];
        self.nearest_all(z, 1.0 / s, &mut idx);
        let mut e = 0.0f32;
        for (&v, &i) in z.iter().zip(&idx) {
            let d = v - s * self.value[i as usize];
            e += d * d;
        }
        e
    }

    /// Lloyd steps from the scale `s` (codes given the scale, the least-squares scale given
    /// the codes), rounded to the fp16 it is stored as.
    fn refit(&self, z: &[f32; wht::HALF], mut s: f32) -> f32 {
        let mut idx = [0u32; wht::HALF];
        for _ in 0..SCALE_STEPS {
            self.nearest_all(z, 1.0 / s, &mut idx);
            let (mut num, mut den) = (0.0f32, 0.0f32);
            for (&v, &i) in z.iter().zip(&idx) {
                let l = self.value[i as usize];
                num += v * l;
                den += l * l;
            }
            if den <= 0.0 {
                break;
            }
            s = num / den;
        }
        Half::from_f32(s).to_f32()
    }
}

/// Lloyd steps from the best starting scale.
const SCALE_STEPS: usize = 2;

/// Starting scales, as multiples of `‖z‖·√2` (the norm that puts a 64-value head's rotated
/// values on the centroids' N(0, 1/128) scale): the error is not convex in the scale, so it is
/// evaluated on this grid first and refitted from the best point (relative error of Gaussian
/// heads as with Lloyd steps from every start, at half the cost).
const SCALE_STARTS: [f32; 12] = [
    0.6, 0.68, 0.76, 0.84, 0.92, 1.0, 1.08, 1.16, 1.24, 1.32, 1.41, 1.5,
];

/// The tables of a two-stage turbo head's encoder, for a backend that encodes on its own
/// device with these operations (`encode_two_stage`): the sorted levels `c_a + β·c_b`, the
/// code pair of each, the midpoints between neighbours, and the bins that start the search
/// for the nearest level (bin `⌊clamp((t − lo) · inv_width, 0, last_bin)⌋` starts at midpoint
/// `below[bin]`); the grid of starting scales and the Lloyd steps of the norm's fit.
#[derive(Clone, Debug)]
pub struct TwoStageTables {
    /// The levels, ascending.
    pub value: Vec<f32>,
    /// Per level, its codes `(a, b)`: `a` at value `j`, `b` at `64 + j`.
    pub pair: Vec<(u8, u8)>,
    /// Midpoints between neighbouring levels.
    pub mid: Vec<f32>,
    /// The lowest level.
    pub lo: f32,
    /// Bins per unit of `t − lo`.
    pub inv_width: f32,
    /// The last bin, as f32.
    pub last_bin: f32,
    /// Per bin, the first midpoint at or above its start.
    pub below: Vec<u16>,
    /// Starting scales, as multiples of `‖z‖·√2`.
    pub starts: [f32; 12],
    /// Lloyd steps of the fit.
    pub steps: usize,
}

/// The two-stage encoder's tables of format `ty` (`None` for a format not stored in two
/// stages).
#[must_use]
pub fn two_stage_tables(ty: QType) -> Option<TwoStageTables> {
    let l = levels(ty)?;
    Some(TwoStageTables {
        value: l.value.clone(),
        pair: l.pair.clone(),
        mid: l.mid.clone(),
        lo: l.lo,
        inv_width: l.inv_width,
        last_bin: l.last_bin,
        below: l.below.clone(),
        starts: SCALE_STARTS,
        steps: SCALE_STEPS,
    })
}

/// The levels of a two-stage head of format `ty`.
fn levels(ty: QType) -> Option<&'static Levels> {
    static L2: OnceLock<Levels> = OnceLock::new();
    static L3: OnceLock<Levels> = OnceLock::new();
    static L4: OnceLock<Levels> = OnceLock::new();
    let (cell, cent): (&OnceLock<Levels>, &[f32]) = match ty {
        QType::Turbo2 => (&L2, &turbo::CENTROIDS_2),
        QType::Turbo3 => (&L3, &turbo::CENTROIDS_3),
        QType::Turbo4 => (&L4, &turbo::CENTROIDS_4),
        _ => return None,
    };
    let beta = crate::layout::turbo_two_stage(ty, wht::HALF, wht::GROUP)?;
    Some(cell.get_or_init(|| Levels::new(cent, beta)))
}

/// Encodes a 64-value head `x` into one turbo block `dst` in two stages
/// ([`crate::turbo_two_stage`]): the head rotated by the fork's 64-value rotation, rotated
/// value `j` at the nearest level `s·(c_a + β·c_b)` (code `a` at position `j`, code `b` at
/// `64 + j`), the norm `s` fitted from several starts and stored as fp16, the levels picked
/// for that stored norm. The block decodes with the reference decoder; a zero head gets norm
/// 0. Does nothing for a head or format that is not stored in two stages.
pub(crate) fn encode_two_stage(ty: QType, x: &[f32], dst: &mut [u8]) {
    let (Some((_, _, bs)), Some(lv)) = (tables(ty), levels(ty)) else {
        return;
    };
    let half = wht::HALF;
    if x.len() != half || dst.len() != bs {
        return;
    }
    let mut z = [0.0f32; wht::HALF];
    z.copy_from_slice(x);
    wht::forward64(&mut z);
    let n2: f32 = z.iter().map(|v| v * v).sum();
    let base = (2.0 * n2).sqrt();
    let mut s = 0.0f32;
    if base > 0.0 && base.is_finite() {
        let mut best = (f32::INFINITY, 0.0f32);
        for f in SCALE_STARTS {
            let e = lv.error(&z, f * base);
            if e < best.0 {
                best = (e, f * base);
            }
        }
        // The refitted scale, unless rounding or a bad step made it worse than the grid's.
        let start = Half::from_f32(best.1).to_f32();
        let fitted = lv.refit(&z, best.1);
        s = if fitted > 0.0 && fitted.is_finite() && lv.error(&z, fitted) <= lv.error(&z, start) {
            fitted
        } else {
            start
        };
    }
    dst[..2].copy_from_slice(&Half::from_f32(s).0);
    let mut idx = [0u32; wht::HALF];
    if s > 0.0 {
        lv.nearest_all(&z, 1.0 / s, &mut idx);
    }
    for (j, &i) in idx.iter().enumerate() {
        let (a, b) = if s > 0.0 { lv.pair[i as usize] } else { (0, 0) };
        set(ty, dst, j, a);
        set(ty, dst, half + j, b);
    }
}

/// [`Levels::nearest`] for sixteen values at a time on AVX-512: the bin by the same float
/// operations (a NaN lands in bin 0, as the scalar cast puts it), its first midpoint from
/// `below`, then the midpoints at or below each value passed lane by lane.
#[cfg(target_arch = "x86_64")]
mod nearest_x86 {
    use std::arch::x86_64::*;

    use super::Levels;
    use specula_quant::wht;

    /// Whether this CPU has AVX-512 F (checked once by the standard library, then cached).
    pub(super) fn available() -> bool {
        is_x86_feature_detected!("avx512f")
    }

    /// # Safety
    /// AVX-512 F; `lv.below` holds indices of `lv.mid` or its length, and `lv.value` has one
    /// more entry than `lv.mid`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn nearest64(
        lv: &Levels,
        z: &[f32; wht::HALF],
        inv: f32,
        idx: &mut [u32; wht::HALF],
    ) {
        let n_mid = i32::try_from(lv.mid.len()).expect("at most 255 midpoints");
        // SAFETY: the caller's features; every gather reads `below` at a bin in
        // `0..=last_bin` (clamped) and `mid` only where the index is below its length.
        unsafe {
            let (lo, iw, last) = (
                _mm512_set1_ps(lv.lo),
                _mm512_set1_ps(lv.inv_width),
                _mm512_set1_ps(lv.last_bin),
            );
            let inv = _mm512_set1_ps(inv);
            let len = _mm512_set1_epi32(n_mid);
            let one = _mm512_set1_epi32(1);
            for (zc, oc) in z.chunks_exact(16).zip(idx.chunks_exact_mut(16)) {
                let t = _mm512_mul_ps(_mm512_loadu_ps(zc.as_ptr()), inv);
                // max(NaN, 0) is 0: a NaN's bin is 0, as `NaN as usize` is.
                let b = _mm512_min_ps(
                    _mm512_max_ps(_mm512_mul_ps(_mm512_sub_ps(t, lo), iw), _mm512_setzero_ps()),
                    last,
                );
                let bin = _mm512_cvttps_epi32(b);
                let mut i = _mm512_i32gather_epi32::<4>(bin, lv.below32.as_ptr().cast());
                loop {
                    let inside = _mm512_cmplt_epi32_mask(i, len);
                    let m = _mm512_mask_i32gather_ps::<4>(
                        _mm512_setzero_ps(),
                        inside,
                        i,
                        lv.mid.as_ptr().cast(),
                    );
                    let step = inside & _mm512_cmp_ps_mask::<_CMP_LE_OQ>(m, t);
                    if step == 0 {
                        break;
                    }
                    i = _mm512_mask_add_epi32(i, step, i, one);
                }
                _mm512_storeu_si512(oc.as_mut_ptr().cast(), i);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The vector search gives every value the scalar search's level: values across each
    /// format's range and past both ends, every midpoint and its neighbours, zeros, NaN.
    #[test]
    fn nearest_levels_are_the_scalar_search() {
        for ty in [QType::Turbo2, QType::Turbo3, QType::Turbo4] {
            let lv = levels(ty).expect("a two-stage format");
            let mut t: Vec<f32> = Vec::new();
            for &m in &lv.mid {
                t.extend([m, m.next_down(), m.next_up()]);
            }
            let (lo, hi) = (lv.value[0], lv.value[lv.value.len() - 1]);
            let mut seed = 0x2545_F491_u32;
            for _ in 0..4000 {
                seed ^= seed << 13;
                seed ^= seed >> 17;
                seed ^= seed << 5;
                #[allow(clippy::cast_precision_loss, reason = "a test's random values")]
                let u = seed as f32 / u32::MAX as f32;
                t.push(lo - 0.5 + u * (hi - lo + 1.0));
            }
            t.extend([
                0.0,
                -0.0,
                lo,
                hi,
                10.0 * lo,
                10.0 * hi,
                f32::NAN,
                f32::INFINITY,
            ]);
            t.resize(t.len().next_multiple_of(wht::HALF), 0.25);
            for (c, inv) in t
                .chunks_exact(wht::HALF)
                .zip([1.0f32, 0.37, 2.5].iter().cycle())
            {
                let z: [f32; wht::HALF] = c.try_into().expect("64 values");
                let mut got = [0u32; wht::HALF];
                lv.nearest_all(&z, *inv, &mut got);
                for (&v, &g) in z.iter().zip(&got) {
                    assert_eq!(g as usize, lv.nearest(v * inv), "{ty} {v} × {inv}");
                }
            }
        }
    }
}
