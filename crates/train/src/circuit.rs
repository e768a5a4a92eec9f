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
//! - **`fc` lays the context out in three parts.** For K/V head `h`, `nc` columns hold a random
//!   orthonormal projection of the token's embedding (tap 0) with the embeddings' mean
//!   direction removed; then `n_kv · nv` columns hold the target's final hidden state (the
//!   last tap, the target's output) projected on its `n_kv · nv` principal directions — what the
//!   target predicts next, compressed; then one column holds a feature column of constant sign
//!   (a *flag*: "this value came from the context").
//! - **Layer 1: the anchor row looks its token up.** Queries and keys live on the `nc` most
//!   slowly rotating RoPE dimensions (over a few thousand positions they barely turn), so a
//!   score is the cosine of two embedding projections: the anchor row's query meets the
//!   context positions holding the same token. The values are the compressed predictions and
//!   the flag; the output projection expands them back into the residual. MASK rows, whose
//!   query is the MASK embedding, meet each other instead and read a zero value with a
//!   negative flag.
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
    let (Some(s_emb), Some(s_out)) = (slot(0), slot(n_layer)) else {
        return Err(bad(format!(
            "taps {:?} must include 0 (the embedding) and {n_layer} (the target's output)",
            shape.taps
        )));
    };
    let pairs = PAIRS.min(hd / 2);
    let nc = 2 * pairs;
    let nv = hd.saturating_sub(SPARE);
    let (kpart, vpart) = (nkv * nc, nkv * nv);
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
    let fcoord = (flag_at + 1..e)
        .min_by(|&a, &b| m2[a * e + a].total_cmp(&m2[b * e + b]))
        .unwrap_or(e - 1);
    for k in 0..e {
        m2[fcoord * e + k] = 0.0;
        m2[k * e + fcoord] = 0.0;
    }
    let (_, vecs) = sym_eig(m2, e);
    let pcs: Vec<Vec<f64>> = vecs.into_iter().take(vpart).collect();

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
                    for (i, &d) in content.iter().enumerate() {
                        let a = &proj[h * nc + i];
                        // The query: the anchor's projection with the MASK direction taken
                        // out, plus a pull of the MASK rows towards their own keys.
                        let a_um = dot(a, &um);
                        let b = sqrt_e * um[h * nc + i];
                        for hq in h * g..(h + 1) * g {
                            let row = &mut wq[(hq * hd + d) * e..(hq * hd + d + 1) * e];
                            for (k, x) in row.iter_mut().enumerate() {
                                *x =
                                    f(a[k] - a_um * um[k] + f64::from(GAINS.mask_pull) * b * um[k]);
                            }
                        }
                        wk[(h * hd + d) * e + h * nc + i] = 1.0;
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
                        wo[fcoord * q_w + hq * hd + nv] = f(per_q);
                    }
                }
                set(&n("attn_q_norm"), vec![GAINS.lookup; hd]);
                set(&n("attn_k_norm"), vec![GAINS.lookup; hd]);
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
