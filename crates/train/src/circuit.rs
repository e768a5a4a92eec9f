//! A DFlash draft that starts as a copy circuit: "find where the anchor's token stood before in
//! the context, and draft what the target predicted after it".
//!
//! The target's greedy continuations are loops, and that rule alone drafts them well (a numpy
//! copy rule reached τ 6.2 over the first 96 generated tokens of the training sequences), yet
//! four randomly initialised runs never found it: an induction lookup needs a token-matching
//! query/key pair and a value path to the head at once, and neither half gets a gradient
//! until the other exists. This initialisation writes both halves into the draft's own
//! parameters — nothing new at inference, the file is an ordinary DFlash drafter — and
//! training continues from there:
//!
//! - **`fc` lays the context out in three parts.** For K/V head `h` (up to three; more heads
//!   share those three), `nc` columns hold a random orthonormal projection of the token's
//!   embedding (tap 0) with the embeddings' mean direction removed; then `n_kv · nv` columns
//!   hold the target's final hidden state (tap `n_layer`, or the last layer's input where
//!   the drafter must load in llama.cpp, which captures layer inputs only) projected on its
//!   `n_kv · nv` principal directions — what the target predicts next, compressed; then one
//!   column holds a feature column of constant sign (a *flag*: "this value came from the
//!   context").
//! - **Layer 1: the anchor row looks its token up.** Queries and keys live on the `nc` most
//!   slowly rotating RoPE dimensions (over a few thousand positions they barely turn), so a
//!   score is the cosine of two embedding projections: the anchor row's query meets the
//!   context positions holding the same token. The values are the compressed predictions and
//!   the flag; the output projection expands them back into the residual. MASK rows, whose
//!   query is the MASK embedding, meet each other instead (through a pull along the
//!   embeddings' quietest direction through MASK's, which anchors barely see) and read a zero
//!   value with a negative flag. A mid-frequency rotary pair adds a bias towards recent positions (see
//!   `recency`): a code prompt holds `(` or `self` many times over, and what followed the
//!   latest one is the better draft.
//! - **The value path is `K/V heads × head_dim` wide** (less a few spare dimensions), and it is
//!   what limits the circuit on real prompts: a lookup that blends a few positions keeps the
//!   target's argmax far better through more principal directions. A draft may have more K/V
//!   heads than its target (`--kv-heads`); beyond three they share the key projections and
//!   spend their width on values.
//! - **Layer 2: every block row reads the anchor row.** Its key is the flag coordinate of the
//!   residual (positive only where layer 1 found the token; zero for the context), its value
//!   the compressed prediction again, so row 1 drafts what followed the anchor's token last
//!   time. Later rows draft the same token — a second hop would need a layer per row — and
//!   training may do better there.
//! - Feed-forward outputs, later layers' outputs and the flag's coordinate in the final norm
//!   start at zero, so nothing else moves the residual until training does.

use crate::features::FeatureSet;
use crate::net::DraftShape;
use crate::rng::Rng;
use crate::target::Target;
use crate::{Result, TrainError};

/// Feature rows the initialisation's statistics read at most.
const ROWS: usize = 8192;
/// Rotary pairs the lookup's queries and keys use (the most slowly turning ones).
const PAIRS: usize = 12;
/// The widest target the eigendecomposition is written for (its cost grows with the cube).
const MAX_WIDTH: usize = 1024;
/// Value dimensions of a K/V head left out of the compressed prediction (one carries the flag).
const SPARE: usize = 4;
/// Score amplitude of the lookup's recency bias `ρ · cos(θ·Δ)` at the median anchor.
const REC_RHO: f64 = 6.0;
/// Positions over which the recency pair turns half a circle (its bias falls from `+ρ` at the
/// anchor to `−ρ` this far back).
const REC_SPAN: f64 = 256.0;
/// Floor of the embedding covariance's eigenvalues, relative to the largest, where
/// [`quiet_direction`] inverts it.
const EMB_FLOOR: f64 = 0.01;
/// Embedding rows [`quiet_direction`] reads at most (every `n/EMB_ROWS`-th row).
const EMB_ROWS: usize = 12_288;
/// Distinct key projections of the lookup at most; K/V head `h` uses projection
/// `h mod KEY_GROUPS`, so a draft with more K/V heads spends its extra width on values.
const KEY_GROUPS: usize = 3;

/// Gains of the circuit, in the units the construction notes give.
#[derive(Clone, Copy, Debug)]
struct Gains {
    /// Query/key norm gain of layer 1 (a score is `8 · g² · cos` over heads of 64).
    lookup: f32,
    /// Query/key norm gain of layer 2.
    read: f32,
    /// Residual gain of the copied prediction, in layer 1 and in layer 2.
    copy: f32,
    /// The flag's share of the context row's RMS (before the encoder's norm).
    flag: f64,
    /// How negative a MASK row's flag is, per unit of its normalised embedding.
    mask_flag: f32,
    /// The MASK rows' pull to each other in layer 1.
    mask_pull: f32,
}

const GAINS: Gains = Gains {
    lookup: 1.732,
    read: 2.0,
    copy: 40.0,
    flag: 2.5,
    mask_flag: 0.15,
    mask_pull: 0.05,
};

fn bad(detail: String) -> TrainError {
    TrainError::Config(format!("--init copy: {detail}"))
}

/// Eigenvalues and eigenvectors (rows) of the symmetric `n × n` matrix `a`, largest first
/// (cyclic Jacobi rotations until the off-diagonal mass is negligible).
fn sym_eig(mut a: Vec<f64>, n: usize) -> (Vec<f64>, Vec<Vec<f64>>) {
    let mut v = vec![0f64; n * n];
    for i in 0..n {
        v[i * n + i] = 1.0;
    }
    let total: f64 = a.iter().map(|x| x * x).sum();
    for _sweep in 0..30 {
        let mut off = 0f64;
        for p in 0..n {
            for q in p + 1..n {
                off += a[p * n + q] * a[p * n + q];
            }
        }
        if off <= 1e-22 * total.max(1e-300) {
            break;
        }
        for p in 0..n {
            for q in p + 1..n {
                let apq = a[p * n + q];
                if apq.abs() < 1e-300 {
                    continue;
                }
                let theta = (a[q * n + q] - a[p * n + p]) / (2.0 * apq);
                let t = theta.signum() / (theta.abs() + (theta * theta + 1.0).sqrt());
                let t = if theta == 0.0 { 1.0 } else { t };
                let c = 1.0 / (t * t + 1.0).sqrt();
                let s = t * c;
                for k in 0..n {
                    let (akp, akq) = (a[k * n + p], a[k * n + q]);
                    a[k * n + p] = c * akp - s * akq;
                    a[k * n + q] = s * akp + c * akq;
                }
                for k in 0..n {
                    let (apk, aqk) = (a[p * n + k], a[q * n + k]);
                    a[p * n + k] = c * apk - s * aqk;
                    a[q * n + k] = s * apk + c * aqk;
                }
                for k in 0..n {
                    let (vkp, vkq) = (v[k * n + p], v[k * n + q]);
                    v[k * n + p] = c * vkp - s * vkq;
                    v[k * n + q] = s * vkp + c * vkq;
                }
            }
        }
    }
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&i, &j| a[j * n + j].total_cmp(&a[i * n + i]));
    let vals = order.iter().map(|&i| a[i * n + i]).collect();
    let vecs = order
        .iter()
        .map(|&i| (0..n).map(|k| v[k * n + i]).collect())
        .collect();
    (vals, vecs)
}

/// The direction `p` with `p·u = 1` that is quietest over the token embeddings: `M⁻¹u`
/// normalised, `M = C + μμᵀ` their uncentred second moment (`C` their covariance over every
/// `n/EMB_ROWS`-th row, eigenvalues floored at [`EMB_FLOOR`] of the largest; the mean
/// folded in by Sherman–Morrison). Every embedding has a large component along `u` when `u`
/// is itself an embedding — they share the mean direction — while along `p` only `u`'s own
/// token is large.
fn quiet_direction(embd: &[f32], e: usize, u: &[f64]) -> Vec<f64> {
    let n = embd.len() / e.max(1);
    let stride = n.div_ceil(EMB_ROWS).max(1);
    let rows: Vec<&[f32]> = embd.chunks_exact(e).step_by(stride).collect();
    #[allow(clippy::cast_precision_loss, reason = "row counts are small")]
    let m = rows.len().max(1) as f64;
    let mut mean = vec![0f64; e];
    for r in &rows {
        for (a, &x) in mean.iter_mut().zip(*r) {
            *a += f64::from(x) / m;
        }
    }
    let mut cov = vec![0f64; e * e];
    let mut c = vec![0f64; e];
    for r in &rows {
        for ((ci, &x), mu) in c.iter_mut().zip(*r).zip(&mean) {
            *ci = f64::from(x) - mu;
        }
        for i in 0..e {
            let ci = c[i];
            for (o, &cj) in cov[i * e + i..(i + 1) * e].iter_mut().zip(&c[i..]) {
                *o += ci * cj;
            }
        }
    }
    for i in 0..e {
        for j in i..e {
            cov[i * e + j] /= m;
            cov[j * e + i] = cov[i * e + j];
        }
    }
    let (vals, vecs) = sym_eig(cov, e);
    let floor = EMB_FLOOR * vals.first().copied().unwrap_or(0.0).max(1e-300);
    // `C⁻¹x = Σ v (v·x) / λ`.
    let inv = |x: &[f64]| -> Vec<f64> {
        let mut out = vec![0f64; e];
        for (v, &l) in vecs.iter().zip(&vals) {
            let s = dot(v, x) / l.max(floor);
            for (o, &vi) in out.iter_mut().zip(v) {
                *o += s * vi;
            }
        }
        out
    };
    let a = inv(u);
    let b = inv(&mean);
    let k = dot(&mean, &a) / (1.0 + dot(&mean, &b));
    let p: Vec<f64> = a.iter().zip(&b).map(|(x, y)| x - k * y).collect();
    let pu = dot(&p, u);
    let pu = if pu.abs() < 1e-300 { 1e-300 } else { pu };
    p.iter().map(|x| x / pu).collect()
}

/// `count` orthonormal vectors of `n` values, Gaussian then Gram–Schmidt.
fn orthonormal(rng: &mut Rng, n: usize, count: usize) -> Vec<Vec<f64>> {
    let mut out: Vec<Vec<f64>> = Vec::with_capacity(count);
    while out.len() < count {
        let mut v: Vec<f64> = (0..n).map(|_| rng.normal()).collect();
        for u in &out {
            let d: f64 = v.iter().zip(u).map(|(a, b)| a * b).sum();
            for (x, y) in v.iter_mut().zip(u) {
                *x -= d * y;
            }
        }
        let norm = v.iter().map(|x| x * x).sum::<f64>().sqrt();
        if norm > 1e-6 {
            out.push(v.into_iter().map(|x| x / norm).collect());
        }
    }
    out
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

fn unit(v: Vec<f64>) -> Vec<f64> {
    let n = dot(&v, &v).sqrt().max(1e-300);
    v.into_iter().map(|x| x / n).collect()
}

fn rms(v: &[f32]) -> f64 {
    #[allow(clippy::cast_precision_loss, reason = "row widths are small")]
    let n = v.len().max(1) as f64;
    (v.iter().map(|&x| f64::from(x) * f64::from(x)).sum::<f64>() / n).sqrt()
}

#[allow(clippy::cast_possible_truncation, reason = "f32 weights")]
fn f(x: f64) -> f32 {
    x as f32
}

/// What the recency bias is computed from (see [`recency`]).
struct Recency<'a> {
    shape: &'a DraftShape,
    rows: &'a [Vec<f32>],
    s_emb: usize,
    s_out: usize,
    flag_col: usize,
    /// The first key group's projections.
    proj: &'a [Vec<f64>],
    pcs: &'a [Vec<f64>],
    out_norm: &'a [f64],
    um: &'a [f64],
    ke: f64,
    kf: f64,
    pairs: usize,
}

/// The lookup's recency bias, as layer 1 holds it.
struct RecencyBias {
    /// The rotary pair (its first dimension) that carries it.
    pair: usize,
    /// The query's direction (the anchors' mean normalised embedding, orthogonal to MASK's).
    dir: Vec<f64>,
    lambda: f64,
    kappa: f64,
    /// The query/key norm gain that keeps the content scores where they were.
    gain: f32,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// A bias `ρ · cos(θ·Δ)` towards recent context positions in the anchor row's lookup: when a
/// token stood at several earlier positions, what followed it most recently is the better
/// draft (a code prompt repeats `(`, `self` or `return` with every continuation). A rotary
/// pair turning half a circle over [`REC_SPAN`] positions carries it: the query's part is a
/// near-constant of the anchor's embedding (its component along the mean embedding of the
/// training tokens, taken orthogonal to MASK's so MASK rows get none), the key's the
/// context's flag. Both share their head's norm with the content, so the gain grows to keep
/// the content scores as they were. `None` when the lookup leaves no free pair, or when the
/// embeddings share no direction (fewer than nine anchors in ten on its positive side).
fn recency(c: &Recency<'_>) -> Option<RecencyBias> {
    let (e, hd) = (c.shape.n_embd, c.shape.head_dim);
    let et = c.shape.n_embd_target;
    #[allow(clippy::cast_precision_loss, reason = "head dims are small")]
    let span = |i: usize| {
        std::f64::consts::PI / f64::from(c.shape.rope_base).powf(-2.0 * i as f64 / hd as f64)
    };
    let pair = (0..(hd / 2).saturating_sub(c.pairs)).min_by(|&a, &b| {
        (span(a) / REC_SPAN)
            .ln()
            .abs()
            .total_cmp(&(span(b) / REC_SPAN).ln().abs())
    })?;
    #[allow(clippy::cast_precision_loss, reason = "widths are small")]
    let sqrt_e = (e as f64).sqrt();
    let normed = |v: &[f32]| -> Vec<f64> {
        let k = 1.0 / rms(v).max(1e-12);
        v.iter().map(|&x| f64::from(x) * k).collect()
    };
    let sample = &c.rows[..c.rows.len().min(2048)];
    let mut mean = vec![0f64; e];
    for r in sample {
        for (m, x) in mean
            .iter_mut()
            .zip(normed(&r[c.s_emb * et..(c.s_emb + 1) * et]))
        {
            *m += x;
        }
    }
    let d_um = dot(&mean, c.um);
    let dir = unit(mean.iter().zip(c.um).map(|(m, u)| m - d_um * u).collect());
    let (mut cq, mut rq, mut ck, mut rk) = (vec![], vec![], vec![], vec![]);
    for r in sample {
        let emb = &r[c.s_emb * et..(c.s_emb + 1) * et];
        let h = normed(emb);
        let h_um = dot(&h, c.um);
        let hm: Vec<f64> = h.iter().zip(c.um).map(|(x, u)| x - h_um * u).collect();
        cq.push(
            c.proj
                .iter()
                .map(|a| dot(a, &hm).powi(2))
                .sum::<f64>()
                .sqrt(),
        );
        rq.push(dot(&dir, &h));
        // The context row as `fc` lays it out, then the encoder's norm.
        let keys: Vec<f64> = c
            .proj
            .iter()
            .map(|a| {
                c.ke * a
                    .iter()
                    .zip(emb)
                    .map(|(x, &y)| x * f64::from(y))
                    .sum::<f64>()
            })
            .collect();
        let out = &r[c.s_out * et..(c.s_out + 1) * et];
        let vals: f64 = c
            .pcs
            .iter()
            .map(|pc| {
                pc.iter()
                    .zip(out)
                    .zip(c.out_norm)
                    .map(|((x, &y), wn)| x * f64::from(y) * wn)
                    .sum::<f64>()
                    .powi(2)
            })
            .sum();
        let flag = c.kf * f64::from(r[c.flag_col]);
        // Every key group holds about as much as the first.
        #[allow(clippy::cast_precision_loss, reason = "group counts are small")]
        let groups = (c.shape.n_head_kv.clamp(1, KEY_GROUPS)) as f64;
        let kss: f64 = keys.iter().map(|k| k * k).sum();
        let row_rms = ((groups * kss + vals + flag * flag) / (sqrt_e * sqrt_e)).sqrt();
        ck.push(kss.sqrt() / row_rms.max(1e-300));
        rk.push(flag / row_rms.max(1e-300));
    }
    // The embeddings must share a direction: nine anchors in ten on its positive side.
    let mut sorted = rq.clone();
    sorted.sort_by(f64::total_cmp);
    if sorted.get(sorted.len() / 10).is_none_or(|&x| x <= 0.0) {
        return None;
    }
    let (cq, rq, ck, rk) = (median(cq), median(rq), median(ck), median(rk));
    if rk <= 0.0 {
        return None;
    }
    let g0 = f64::from(GAINS.lookup);
    // Equal shares on both sides: α·β·8·g0² = ρ.
    let ab = (REC_RHO / (8.0 * g0 * g0)).sqrt();
    Some(RecencyBias {
        pair,
        dir,
        lambda: ab * cq / rq,
        kappa: ab * ck / rk,
        gain: f(g0 * (1.0 + ab * ab).sqrt()),
    })
}

/// Writes the copy circuit into `params` (in [`DraftShape::params`] order, already holding a
/// random initialisation): see the module notes. `feat_scale` is what the trainer divides
/// feature columns by (empty: nothing); `train` the training sequences its statistics read.
///
/// # Errors
/// The drafter cannot hold the circuit: fewer than two layers, taps without 0 (the
/// embedding) and the target's last layer, heads too small, or no feature column of
/// constant sign.
#[allow(
    clippy::too_many_lines,
    reason = "one construction, written out part by part"
)]
pub fn copy_init(
    shape: &DraftShape,
    target: &Target,
    feats: &FeatureSet,
    train: &[usize],
    feat_scale: &[f32],
    seed: u64,
    params: &mut [Vec<f32>],
) -> Result<()> {
    let (e, hd, nh, nkv) = (shape.n_embd, shape.head_dim, shape.n_head, shape.n_head_kv);
    let et = shape.n_embd_target;
    let n_layer = target.hp.n_layer;
    let g = nh / nkv.max(1);
    if shape.n_layer < 2 {
        return Err(bad(format!(
            "{} draft layers; the circuit needs 2",
            shape.n_layer
        )));
    }
    if e != et {
        return Err(bad(format!("draft width {e} is not the target's {et}")));
    }
    if e > MAX_WIDTH {
        return Err(bad(format!(
            "width {e}: the principal directions come from a full eigendecomposition of an \
             {e} × {e} matrix (cyclic Jacobi), written for targets up to {MAX_WIDTH} wide"
        )));
    }
    let slot = |t: usize| shape.taps.iter().position(|&x| x == t);
    // The prediction: the target's output (tap `n_layer`), else its last layer's input (tap
    // `n_layer − 1`, the deepest one llama.cpp's DFlash captures — it records layer inputs).
    let s_out = slot(n_layer).or_else(|| slot(n_layer.saturating_sub(1)).filter(|_| n_layer > 1));
    let (Some(s_emb), Some(s_out)) = (slot(0), s_out) else {
        return Err(bad(format!(
            "taps {:?} must include 0 (the embedding) and {n_layer} (the target's output) or \
             {} (its last layer's input)",
            shape.taps,
            n_layer.saturating_sub(1)
        )));
    };
    let pairs = PAIRS.min(hd / 2);
    let nc = 2 * pairs;
    let kg = nkv.clamp(1, KEY_GROUPS);
    let kpart = kg * nc;
    // Value dimensions per K/V head: what a head holds, or what the context row has room for.
    let nv = hd
        .saturating_sub(SPARE)
        .min(e.saturating_sub(kpart + 2) / nkv.max(1));
    let vpart = nkv * nv;
    let flag_at = kpart + vpart;
    if nv == 0 || flag_at + 2 > e || nh % nkv != 0 {
        return Err(bad(format!(
            "heads of {hd} × {nkv} K/V heads do not fit the circuit in {e} columns"
        )));
    }
    // The slowest rotary pairs (NeoX halves: dims i and i + hd/2).
    let content: Vec<usize> = (hd / 2 - pairs..hd / 2)
        .flat_map(|i| [i, i + hd / 2])
        .collect();
    let slow = hd / 2 - 1;

    // Statistics over training rows: the flag column, the prediction's principal directions.
    let w = shape.width();
    let out_norm: Vec<f64> = target.output_norm.as_ref().map_or_else(
        || vec![1.0; et],
        |v| v.iter().map(|&x| f64::from(x)).collect(),
    );
    let mut rows: Vec<Vec<f32>> = Vec::new();
    for &i in train {
        if rows.len() >= ROWS {
            break;
        }
        let fs = feats.features(i)?;
        for r in fs.chunks_exact(w).take(ROWS - rows.len()) {
            rows.push(r.to_vec());
        }
    }
    if rows.len() < 2 * e {
        return Err(bad(format!(
            "{} feature rows; the statistics need {}",
            rows.len(),
            2 * e
        )));
    }
    #[allow(clippy::cast_precision_loss, reason = "row counts are small")]
    let n_rows = rows.len() as f64;
    // The flag: the column (of a tap other than the embedding) whose sign never changes and
    // whose spread is smallest against its mean.
    let mut flag: Option<(usize, f64, f64)> = None;
    for c in 0..w {
        if c / et == s_emb {
            continue;
        }
        let (mut s, mut s2, mut pos, mut neg) = (0f64, 0f64, 0usize, 0usize);
        for r in &rows {
            let x = f64::from(r[c]);
            s += x;
            s2 += x * x;
            pos += usize::from(x > 0.0);
            neg += usize::from(x < 0.0);
        }
        if pos != 0 && neg != 0 {
            continue;
        }
        let mean = s / n_rows;
        let sd = (s2 / n_rows - mean * mean).max(0.0).sqrt();
        let merit = mean.abs() / sd.max(1e-9);
        if flag.is_none_or(|(_, _, m)| merit > m) {
            flag = Some((c, mean, merit));
        }
    }
    let Some((flag_col, flag_mean, _)) = flag else {
        return Err(bad(
            "no feature column keeps one sign over the training rows".into(),
        ));
    };
    // The target's prediction as its head reads it: rms-normalised last tap times the output
    // norm.
    let preds: Vec<Vec<f64>> = rows
        .iter()
        .map(|r| {
            let h = &r[s_out * et..(s_out + 1) * et];
            let k = 1.0 / rms(h).max(1e-12);
            h.iter()
                .zip(&out_norm)
                .map(|(&x, &wn)| f64::from(x) * k * wn)
                .collect()
        })
        .collect();
    let embd_all = &target.embd;
    // The flag's residual coordinate: past the context layout, where the prediction varies least.
    let mut m2 = vec![0f64; e * e];
    for p in &preds {
        for i in 0..e {
            for j in i..e {
                m2[i * e + j] += p[i] * p[j];
            }
        }
    }
    for i in 0..e {
        for j in i..e {
            m2[i * e + j] /= n_rows;
            m2[j * e + i] = m2[i * e + j];
        }
    }
    // … and where the block rows' embeddings are quiet: a MASK or anchor row carries its
    // embedding there, and layer 2 reads only the coordinate's sign (a one-dimensional key
    // under the head's norm), so the flag has to outweigh every embedding's value.
    let mut emb_max = vec![0f64; e];
    let mask_row = &embd_all[shape.mask as usize * e..(shape.mask as usize + 1) * e];
    for r in rows
        .iter()
        .map(|r| &r[s_emb * et..(s_emb + 1) * et])
        .chain([mask_row])
    {
        for (m, &x) in emb_max.iter_mut().zip(r) {
            *m = m.max(f64::from(x).abs());
        }
    }
    let fcoord = (flag_at + 1..e)
        .min_by(|&a, &b| {
            emb_max[a]
                .total_cmp(&emb_max[b])
                .then(m2[a * e + a].total_cmp(&m2[b * e + b]))
        })
        .unwrap_or(e - 1);
    // The flag's weight into that coordinate: a context flag (≈ `GAINS.flag` under the
    // encoder's norm) lands there at four times the largest embedding value, at least once.
    let flag_w = (4.0 * emb_max[fcoord] / GAINS.flag).max(1.0);
    for k in 0..e {
        m2[fcoord * e + k] = 0.0;
        m2[k * e + fcoord] = 0.0;
    }
    let (vals, vecs) = sym_eig(m2, e);
    // Directions the prediction does not vary along carry nothing of it, only what else the
    // residual holds there (layer 2 reads the anchor row's residual through them): left out.
    let top = vals.first().copied().unwrap_or(0.0);
    let pcs: Vec<Vec<f64>> = vecs
        .into_iter()
        .zip(vals)
        .take(vpart)
        .map(|(v, l)| if l > 1e-6 * top { v } else { vec![0.0; e] })
        .collect();

    // The lookup's projections: random, orthonormal, blind to the embeddings' mean direction.
    let embd = &target.embd;
    let mut mean = vec![0f64; e];
    for row in embd.chunks_exact(e) {
        for (m, &x) in mean.iter_mut().zip(row) {
            *m += f64::from(x);
        }
    }
    let ubar = unit(mean);
    let mut rng = Rng::new(seed, 0xC0_91);
    let proj: Vec<Vec<f64>> = orthonormal(&mut rng, e, kpart)
        .into_iter()
        .map(|a| {
            let d = dot(&a, &ubar);
            a.iter().zip(&ubar).map(|(x, u)| x - d * u).collect()
        })
        .collect();
    let um = unit(
        embd[shape.mask as usize * e..(shape.mask as usize + 1) * e]
            .iter()
            .map(|&x| f64::from(x))
            .collect(),
    );
    // The MASK rows' pull towards their own keys reads `p·x` along the embeddings' quietest
    // direction with `p·u_M = 1`: one on MASK's embedding, as `u_M` is, but near zero on
    // other tokens', where `u_M·x` is about a third of `|x|` and would tilt every anchor's
    // query off its own key (a third of row 1's drafts were lost to that).
    let pull_dir = quiet_direction(embd, e, &um);

    // Scales: the key part as large as the value part in the context row, the flag a few
    // times its RMS.
    let (mut key_ss, mut val_ss) = (0f64, 0f64);
    for (r, _) in rows.iter().zip(&preds).take(2048) {
        let emb = &r[s_emb * et..(s_emb + 1) * et];
        let out = &r[s_out * et..(s_out + 1) * et];
        for a in &proj {
            let k: f64 = a.iter().zip(emb).map(|(x, &y)| x * f64::from(y)).sum();
            key_ss += k * k;
        }
        for pc in &pcs {
            let v: f64 = pc
                .iter()
                .zip(out)
                .zip(&out_norm)
                .map(|((x, &y), wn)| x * f64::from(y) * wn)
                .sum();
            val_ss += v * v;
        }
    }
    let ke = (val_ss / key_ss.max(1e-300)).sqrt();
    #[allow(clippy::cast_precision_loss, reason = "widths are small")]
    let rms_y = (2.0 * val_ss / (2048f64.min(n_rows) * e as f64)).sqrt();
    let kf = GAINS.flag * rms_y / flag_mean.abs().max(1e-12) * flag_mean.signum();
    let rec = recency(&Recency {
        shape,
        rows: &rows,
        s_emb,
        s_out,
        flag_col,
        proj: &proj[..nc],
        pcs: &pcs,
        out_norm: &out_norm,
        um: &um,
        ke,
        kf,
        pairs,
    });

    let names: Vec<String> = shape.params().into_iter().map(|(n, _)| n).collect();
    let at = |name: &str| names.iter().position(|n| n == name);
    let mut set = |name: &str, v: Vec<f32>| {
        if let Some(i) = at(name) {
            params[i] = v;
        }
    };

    // fc: [width → e], `e` rows of `width`, on the trainer's (scaled) features.
    let mut fc = vec![0f32; e * w];
    for (r, a) in proj.iter().enumerate() {
        for (i, &x) in a.iter().enumerate() {
            fc[r * w + s_emb * et + i] = f(ke * x);
        }
    }
    for (m, pc) in pcs.iter().enumerate() {
        for (i, (&x, wn)) in pc.iter().zip(&out_norm).enumerate() {
            fc[(kpart + m) * w + s_out * et + i] = f(x * wn);
        }
    }
    fc[flag_at * w + flag_col] = f(kf);
    if !feat_scale.is_empty() {
        for row in fc.chunks_exact_mut(w) {
            for (x, &s) in row.iter_mut().zip(feat_scale) {
                *x *= s;
            }
        }
    }
    set("fc.weight", fc);
    set("enc.output_norm.weight", vec![1.0; e]);
    let mut out_w = vec![1.0f32; e];
    out_w[fcoord] = 0.0;
    set("output_norm.weight", out_w);

    #[allow(clippy::cast_precision_loss, reason = "widths are small")]
    let sqrt_e = (e as f64).sqrt();
    let (q_w, kv_w) = (nh * hd, nkv * hd);
    for l in 0..shape.n_layer {
        let n = |s: &str| format!("blk.{l}.{s}.weight");
        set(&n("attn_norm"), vec![1.0; e]);
        set(&n("ffn_norm"), vec![1.0; e]);
        set(&n("ffn_down"), vec![0.0; shape.n_ff * e]);
        let mut wq = vec![0f32; q_w * e];
        let mut wk = vec![0f32; kv_w * e];
        let mut wv = vec![0f32; kv_w * e];
        let mut wo = vec![0f32; e * q_w];
        #[allow(clippy::cast_precision_loss, reason = "head counts are small")]
        let per_q = 1.0 / g as f64;
        match l {
            0 => {
                for h in 0..nkv {
                    let kc0 = (h % kg) * nc;
                    for (i, &d) in content.iter().enumerate() {
                        let a = &proj[kc0 + i];
                        // The query: the anchor's projection with the MASK direction taken
                        // out, plus a pull of the MASK rows towards their own keys.
                        let a_um = dot(a, &um);
                        let b = sqrt_e * um[kc0 + i];
                        for hq in h * g..(h + 1) * g {
                            let row = &mut wq[(hq * hd + d) * e..(hq * hd + d + 1) * e];
                            for (k, x) in row.iter_mut().enumerate() {
                                *x = f(a[k] - a_um * um[k]
                                    + f64::from(GAINS.mask_pull) * b * pull_dir[k]);
                            }
                        }
                        wk[(h * hd + d) * e + kc0 + i] = 1.0;
                    }
                    for dv in 0..nv {
                        let c = kpart + h * nv + dv;
                        let row = &mut wv[(h * hd + dv) * e..(h * hd + dv + 1) * e];
                        for (k, x) in row.iter_mut().enumerate() {
                            *x = f(-um[c] * um[k]);
                        }
                        row[c] += 1.0;
                        let pc = &pcs[h * nv + dv];
                        for hq in h * g..(h + 1) * g {
                            for (o, &p) in pc.iter().enumerate() {
                                wo[o * q_w + hq * hd + dv] = f(f64::from(GAINS.copy) * p * per_q);
                            }
                        }
                    }
                    let row = &mut wv[(h * hd + nv) * e..(h * hd + nv + 1) * e];
                    for (k, x) in row.iter_mut().enumerate() {
                        *x = f(-f64::from(GAINS.mask_flag) * um[k]);
                    }
                    row[flag_at] += 1.0;
                    for hq in h * g..(h + 1) * g {
                        wo[fcoord * q_w + hq * hd + nv] = f(per_q * flag_w);
                    }
                }
                let mut gain = GAINS.lookup;
                if let Some(r) = &rec {
                    // The recency pair: a near-constant of the anchor's embedding against the
                    // context's flag (zero for MASK rows on both sides).
                    for hq in 0..nh {
                        let row = &mut wq[(hq * hd + r.pair) * e..(hq * hd + r.pair + 1) * e];
                        for (x, &v) in row.iter_mut().zip(&r.dir) {
                            *x = f(r.lambda * v);
                        }
                    }
                    for h in 0..nkv {
                        let row = &mut wk[(h * hd + r.pair) * e..(h * hd + r.pair + 1) * e];
                        for (k, x) in row.iter_mut().enumerate() {
                            *x = f(-r.kappa * um[flag_at] * um[k]);
                        }
                        row[flag_at] += f(r.kappa);
                    }
                    gain = r.gain;
                }
                set(&n("attn_q_norm"), vec![gain; hd]);
                set(&n("attn_k_norm"), vec![gain; hd]);
            }
            1 => {
                for hq in 0..nh {
                    for (k, &u) in um.iter().enumerate() {
                        wq[(hq * hd + slow) * e + k] = f(u);
                    }
                }
                for h in 0..nkv {
                    wk[(h * hd + slow) * e + fcoord] = 1.0;
                    for dv in 0..nv {
                        let pc = &pcs[h * nv + dv];
                        for (k, &p) in pc.iter().enumerate() {
                            wv[(h * hd + dv) * e + k] = f(p);
                        }
                        for hq in h * g..(h + 1) * g {
                            for (o, &p) in pc.iter().enumerate() {
                                wo[o * q_w + hq * hd + dv] = f(f64::from(GAINS.copy) * p * per_q);
                            }
                        }
                    }
                }
                set(&n("attn_q_norm"), vec![GAINS.read; hd]);
                set(&n("attn_k_norm"), vec![GAINS.read; hd]);
            }
            _ => {
                // Later layers start as identities: their outputs are zero.
                set(&n("attn_output"), wo);
                continue;
            }
        }
        set(&n("attn_q"), wq);
        set(&n("attn_k"), wk);
        set(&n("attn_v"), wv);
        set(&n("attn_output"), wo);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dflash::{DflashConfig, Init, Run};
    use crate::net;
    use burn::tensor::{Device, Tensor, TensorData};
    use specula_testkit::tiny;
    use std::path::Path;

    /// A features directory as `specula extract` writes it, taps `[0, 1, last]`: tap 0 the
    /// token's embedding, tap 1 noise but one column of constant sign, the last tap the
    /// target "predicting" the sequence's next token (its output head's row), top-1 that
    /// token.
    fn write_features(dir: &Path, target: &Path, t: &Target, last: usize, seqs: &[Vec<u32>]) {
        let e = t.hp.n_embd;
        let mut rng = Rng::new(11, 2);
        let next = |s: &[u32], i: usize| s[(i + 1) % s.len()];
        let (mut rows, mut top1) = (Vec::new(), Vec::new());
        for s in seqs {
            for (i, &tok) in s.iter().enumerate() {
                rows.extend_from_slice(&t.embd[tok as usize * e..(tok as usize + 1) * e]);
                rows.extend((0..e).map(|c| {
                    #[allow(clippy::cast_possible_truncation, reason = "f32 features")]
                    let x = rng.normal() as f32;
                    if c == 5 { 4.0 + 0.2 * x } else { x }
                }));
                rows.extend(t.head_rows(&[next(s, i)]).iter().map(|&x| 8.0 * x));
                top1.push(next(s, i));
            }
        }
        crate::features::write_test_features(
            dir,
            target,
            e,
            t.hp.n_vocab,
            &[0, 1, last],
            seqs,
            &rows,
            &top1,
        );
    }

    /// Sequences that repeat a cycle of distinct tokens: the copy circuit, untrained, drafts
    /// the token that followed the anchor's token in the cycle (row 1) once the cycle has been
    /// seen — with the target's K/V heads and with more of them.
    #[test]
    fn the_copy_circuit_drafts_what_followed_the_anchor_s_token_before() {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let dims = tiny::Dims {
            n_embd: 256,
            n_head: 4,
            n_head_kv: 2,
            head_dim: 64,
            ..tiny::Dims::TINY
        };
        let bytes = tiny::target_sized("llama", &dims)
            .to_bytes()
            .expect("a tiny target");
        let tpath = dir.path().join("target.gguf");
        std::fs::write(&tpath, &bytes).expect("written");
        let target = Target::load(&tpath).expect("the tiny target loads");
        let (e, n_vocab) = (target.hp.n_embd, target.hp.n_vocab);
        let last = target.hp.n_layer;
        let mut cfg = DflashConfig::new(1);
        cfg.n_layer = 2;
        cfg.block = 4;
        cfg.draft_vocab = 0;
        cfg.val_seqs = 1;
        cfg.init = Init::Copy;
        let mask = target.default_mask.expect("a MASK token");
        // Twenty sequences, each a cycle of 12 distinct tokens (not MASK) three times over.
        let mut rng = Rng::new(4, 4);
        let pool: Vec<u32> = (0..u32::try_from(n_vocab).expect("small"))
            .filter(|&t| t != mask)
            .collect();
        let seqs: Vec<Vec<u32>> = (0..20)
            .map(|_| {
                let mut p = pool.clone();
                for i in (1..p.len()).rev() {
                    p.swap(i, rng.below(i + 1));
                }
                p[..12].repeat(3)
            })
            .collect();
        let fdir = dir.path().join("features");
        write_features(&fdir, &tpath, &target, last, &seqs);
        let feats = crate::features::FeatureSet::open(&fdir).expect("the features open");
        cfg.kv_heads = Some(3);
        let Err(e3) = Run::start(&cfg, &target, &feats, dir.path(), false) else {
            panic!("3 K/V heads for 4 query heads were taken");
        };
        assert!(e3.to_string().contains("do not divide"), "{e3}");
        for kv in [None, Some(4)] {
            cfg.kv_heads = kv;
            let out = dir.path().join(format!("run-{kv:?}"));
            std::fs::create_dir_all(&out).expect("an output directory");
            let run = Run::start(&cfg, &target, &feats, &out, false).expect("a circuit");
            let shape = &run.shape;
            let d2t = run.vocab.ids();
            let dev = Device::flex();
            let w = net::Weights::new(shape, &run.export_params(), &dev, false);
            let head = Tensor::<2>::from_data(
                TensorData::new(target.head_rows(&d2t), [d2t.len(), e]),
                &dev,
            );
            let (mut right, mut n) = (0, 0);
            for (i, s) in seqs.iter().enumerate() {
                let ctx = feats.features(i).expect("features");
                // Anchors in the second and third cycle: their token stood 12 positions back.
                for a in 14..s.len() - 1 {
                    let mut block_embd = target.embd[s[a] as usize * e..][..e].to_vec();
                    for _ in 1..cfg.block {
                        block_embd.extend_from_slice(&target.embd[mask as usize * e..][..e]);
                    }
                    let ex = net::Example {
                        ctx: ctx[..a * shape.width()].to_vec(),
                        n_ctx: a,
                        anchors: vec![a],
                        window: None,
                        block_embd,
                        targets: Vec::new(),
                    };
                    let logits = net::logits(net::forward_hidden(shape, &w, &ex, &dev), &head)
                        .to_data()
                        .try_to_vec::<f32>()
                        .expect("logits");
                    let row1 = &logits[d2t.len()..2 * d2t.len()];
                    let best = (0..d2t.len())
                        .max_by(|&x, &y| row1[x].total_cmp(&row1[y]))
                        .expect("a vocabulary");
                    right += usize::from(d2t[best] == s[a + 1]);
                    n += 1;
                }
            }
            assert!(
                right * 10 >= n * 9,
                "K/V heads {kv:?}: row 1 right {right} of {n}"
            );
        }

        // No steps (`specula train --steps 0`): the circuit validated once, left as built.
        cfg.kv_heads = None;
        cfg.optim.steps = 0;
        let out = dir.path().join("untrained");
        std::fs::create_dir_all(&out).expect("an output directory");
        let mut run = Run::start(&cfg, &target, &feats, &out, false).expect("a circuit");
        let built = run.export_params();
        run.train(&target, &feats, &out, None, |_, _| panic!("a step ran"))
            .expect("validated");
        assert_eq!((run.step, run.vals.len()), (0, 1));
        assert_eq!(run.export_params(), built);
        let row1 = run.vals[0].accuracy[0];
        assert!(row1 > 0.5, "validation row 1 {row1}");
        assert!(out.join(crate::checkpoint::FILE).exists());
    }

    #[test]
    fn the_quiet_direction_is_large_on_its_token_only() {
        // Embeddings that share a large mean direction, as trained ones do: every token's
        // normalised embedding has a component of about 0.7 along any other's.
        let (e, n) = (32, 400);
        let mut rng = Rng::new(5, 9);
        let shared: Vec<f64> = (0..e).map(|_| rng.normal()).collect();
        #[allow(clippy::cast_possible_truncation, reason = "f32 embeddings")]
        let embd: Vec<f32> = (0..n * e)
            .map(|i| (shared[i % e] + 0.7 * rng.normal()) as f32)
            .collect();
        let row = |t: usize| {
            unit(
                embd[t * e..(t + 1) * e]
                    .iter()
                    .map(|&x| f64::from(x))
                    .collect(),
            )
        };
        let u = row(7);
        let p = quiet_direction(&embd, e, &u);
        assert!((dot(&p, &u) - 1.0).abs() < 1e-9);
        let (mut along_u, mut along_p) = (0f64, 0f64);
        for t in (0..n).filter(|&t| t != 7) {
            let x = row(t);
            along_u += dot(&u, &x).abs();
            along_p += dot(&p, &x).abs();
        }
        #[allow(clippy::cast_precision_loss, reason = "small counts")]
        let (along_u, along_p) = (along_u / (n - 1) as f64, along_p / (n - 1) as f64);
        assert!(
            along_u > 0.5,
            "the test's embeddings share too little: {along_u}"
        );
        assert!(
            along_p < 0.25 * along_u,
            "|p·x| {along_p} against |u·x| {along_u}"
        );
    }

    #[test]
    fn jacobi_recovers_a_known_spectrum() {
        // A = Q diag(5, 2, 1, 0.5) Qᵀ for an orthonormal Q.
        let mut rng = Rng::new(3, 1);
        let q = orthonormal(&mut rng, 4, 4);
        let lam = [5.0, 2.0, 1.0, 0.5];
        let mut a = vec![0f64; 16];
        for (l, v) in lam.iter().zip(&q) {
            for i in 0..4 {
                for j in 0..4 {
                    a[i * 4 + j] += l * v[i] * v[j];
                }
            }
        }
        let (vals, vecs) = sym_eig(a, 4);
        for (got, want) in vals.iter().zip(lam) {
            assert!((got - want).abs() < 1e-9, "{vals:?}");
        }
        for (got, want) in vecs.iter().zip(&q) {
            assert!((dot(got, want).abs() - 1.0).abs() < 1e-9);
        }
    }
}
