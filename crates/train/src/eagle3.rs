//! Training an EAGLE-3 drafter (Li, Wei, Zhang, Zhang, arXiv 2503.01840) on the target's own
//! hidden states, with the training-time test (TTT) unroll; the network in burn is the graph
//! `specula-models`' `Eagle3` runs at inference.
//!
//! # The network and its convention
//!
//! `g = fc(features)` of three target taps (layer inputs, as the features store them); one
//! decoder layer over pairs `(token, g)`: `attn_norm` on the token's embedding (the target's,
//! frozen) and `attn_norm_2` (HF `hidden_norm`) on `g`, side by side (`2·H`) into Q/K/V;
//! RoPE on adjacent pairs (llama.cpp's `NORM` rope, every head dimension); attention; the
//! residual is `g`; post-attention norm, SwiGLU, residual give the *prenorm* state; the final
//! norm and the drafter's own head over the draft vocabulary give the logits. Trained: `fc`,
//! the layer, the final norm and the head (initialised from the target's head rows of the draft
//! vocabulary and its final norm).
//!
//! Row `P` of a sequence is the pair `(token[P + 1], g[P])` with RoPE at `P` and predicts the
//! token after `P + 1` (the label of position `P + 1`), which is what the engine writes: a
//! cell per committed position, then a chain seeded with `(anchor, g[N − 1])` at `N − 1`.
//!
//! # The training-time test
//!
//! Step 0 runs every row `i` of the sequence with `g = fc(features[i])`, causal attention over
//! the step-0 keys of rows `0..=i`. Step `j ≥ 1` continues, for every row `i` as an anchor,
//! the chain inference would draft from it: the pair `(token[i + j + 1], prenorm_{j−1}[i])`
//! (the corpus token a correct chain would have fed, and the previous step's prenorm of the
//! same anchor) at RoPE position `i + j`, whose query attends to the step-0 keys of rows
//! `0..=i` (causal) and to the keys of steps `1..=j` of the same anchor (its own chain,
//! positions `i + 1..=i + j`) — exactly the cells a chain step `j` from anchor `i` attends to
//! at inference, and EAGLE-3's TTT attention (step-0 causal block plus one "diagonal" key
//! per later step). Unlike the reference implementation, which keeps every unroll step at
//! position `i`, step `j` is rotated at `i + j` as inference rotates it. Gradients flow
//! through the whole unroll. Step `j`'s loss is the cross-entropy against the label of
//! position `i + j + 1`, weighted `step_decay^j`; rows whose label is outside the draft
//! vocabulary, or whose chain would run past the sequence, carry none.
//!
//! # Runs
//!
//! [`Eagle3Run`] has [`crate::dflash::Run`]'s life cycle: fresh or resumed from the
//! checkpoint (which must be of the same configuration, shape and target), steps of
//! `seqs_per_step` sequences drawn from the step's own random stream (each sequence's first
//! `max_len` positions), AdamW, and every `checkpoint_every` steps a validation and an atomic
//! checkpoint. The validation drafts greedy chains of `val_len` tokens from anchors every
//! `val_stride` positions of the held-back sequences, feeding each chain its own tokens and
//! prenorm states as inference does, and reports per chain position the accuracy against the
//! labels and `τ = 1 +` the mean run of correct tokens from the first.

use std::path::Path;
use std::time::Instant;

use burn::tensor::activation::{log_softmax, silu, softmax};
use burn::tensor::{Device, Int, Tensor, TensorData};
use serde::{Deserialize, Serialize};

use crate::accel::Accel;
use crate::checkpoint::{self, RunCheckpoint};
use crate::dflash::{self, Labels, StepLog, ValLog};
use crate::features::FeatureSet;
use crate::optim::{self, AdamW, Moments};
use crate::rng::Rng;
use crate::target::Target;
use crate::vocab::DraftVocab;
use crate::{Result, TrainError};

/// The number of target taps an EAGLE-3 head fuses (llama.cpp asserts exactly three).
pub const N_TAPS: usize = 3;

// Indices of the parameters in `Eagle3Shape::params` order.
const FC: usize = 0;
const ATTN_NORM: usize = 1;
const HIDDEN_NORM: usize = 2;
const WQ: usize = 3;
const WK: usize = 4;
const WV: usize = 5;
const WO: usize = 6;
const FFN_NORM: usize = 7;
const GATE: usize = 8;
const UP: usize = 9;
const DOWN: usize = 10;
const OUT_NORM: usize = 11;
const HEAD: usize = 12;

/// The EAGLE-3 head's shape.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Eagle3Shape {
    /// Hidden size (the target's: the embedding is borrowed).
    pub n_embd: usize,
    /// Feed-forward size.
    pub n_ff: usize,
    /// Query heads.
    pub n_head: usize,
    /// K/V heads.
    pub n_head_kv: usize,
    /// Head size (every dimension rotated, adjacent pairs).
    pub head_dim: usize,
    /// RoPE θ.
    pub rope_base: f32,
    /// RMSNorm ε.
    pub rms_eps: f32,
    /// The three target taps (layer-input convention, as the features manifest stores them).
    pub taps: Vec<usize>,
    /// The target's hidden size.
    pub n_embd_target: usize,
    /// Rows of the head: the draft vocabulary's size.
    pub n_vocab_draft: usize,
}

impl Eagle3Shape {
    /// Width of one feature row.
    #[must_use]
    pub fn width(&self) -> usize {
        self.taps.len() * self.n_embd_target
    }

    /// Every trained parameter: GGUF name and dims (`[ne0, ne1]` for matrices, `[n]` for
    /// norms), in the order of a loadable EAGLE-3 GGUF (`fc`, `blk.0.*`, `output_norm`, then
    /// the head over the draft vocabulary, `output.weight`).
    #[must_use]
    pub fn params(&self) -> Vec<(String, Vec<usize>)> {
        let (e, f, hd) = (self.n_embd, self.n_ff, self.head_dim);
        let (q, kv) = (self.n_head * hd, self.n_head_kv * hd);
        let n = |s: &str| format!("blk.0.{s}.weight");
        vec![
            ("fc.weight".to_owned(), vec![self.width(), e]),
            (n("attn_norm"), vec![e]),
            (n("attn_norm_2"), vec![e]),
            (n("attn_q"), vec![2 * e, q]),
            (n("attn_k"), vec![2 * e, kv]),
            (n("attn_v"), vec![2 * e, kv]),
            (n("attn_output"), vec![q, e]),
            (n("ffn_norm"), vec![e]),
            (n("ffn_gate"), vec![e, f]),
            (n("ffn_up"), vec![e, f]),
            (n("ffn_down"), vec![f, e]),
            ("output_norm.weight".to_owned(), vec![e]),
            ("output.weight".to_owned(), vec![e, self.n_vocab_draft]),
        ]
    }
}

/// Everything that decides an EAGLE-3 training run (saved in its checkpoint; a resume must
/// match it).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Eagle3Config {
    /// Feed-forward size of the head; 0: the target's.
    pub n_ff: usize,
    /// Draft vocabulary size (the most frequent labels of the training sequences); 0: the
    /// target's whole vocabulary.
    pub draft_vocab: usize,
    /// Training-time-test unroll steps (1: no unroll; the paper uses 7).
    pub ttt_steps: usize,
    /// Weight of unroll step `j`'s loss: `step_decay^j`.
    pub step_decay: f32,
    /// Positions of a sequence trained on (its first ones: context starts at 0 as at
    /// inference).
    pub max_len: usize,
    /// Sequences per step.
    pub seqs_per_step: usize,
    /// What the rows predict.
    pub labels: Labels,
    /// Whether `fc` trains on features divided by their columns' RMS (folded into `fc` at
    /// export; see [`crate::features::FeatureSet::column_scales`]).
    #[serde(default)]
    pub standardize: bool,
    /// Every random draw of the run (initialisation, sampling).
    pub seed: u64,
    /// Optimiser and schedule.
    pub optim: AdamW,
    /// Steps between checkpoints (and validations).
    pub checkpoint_every: usize,
    /// Validation sequences held back from training.
    pub val_seqs: usize,
    /// Length of the validation's chained drafts.
    pub val_len: usize,
    /// Positions between the validation's draft anchors.
    pub val_stride: usize,
}

impl Eagle3Config {
    /// The defaults `specula train eagle3` starts from, for `steps` steps.
    #[must_use]
    pub fn new(steps: usize) -> Self {
        Self {
            n_ff: 0,
            draft_vocab: 8192,
            ttt_steps: 3,
            step_decay: 0.8,
            max_len: 512,
            seqs_per_step: 2,
            labels: Labels::Target,
            standardize: true,
            seed: 42,
            optim: AdamW {
                lr: 1e-3,
                warmup: (steps / 20).max(1),
                steps,
                min_lr_ratio: 0.1,
                beta1: 0.9,
                beta2: 0.95,
                eps: 1e-8,
                weight_decay: 0.01,
                clip: 1.0,
            },
            checkpoint_every: 100,
            val_seqs: 16,
            val_len: 7,
            val_stride: 8,
        }
    }
}

/// The head's shape for `target` with features of `taps` and a draft vocabulary of
/// `n_vocab_draft` tokens (attention as the target's).
///
/// # Errors
/// Not exactly three taps, a tap past the target, an empty vocabulary, or a configuration
/// that trains nothing.
pub fn shape_for(
    target: &Target,
    taps: &[usize],
    n_vocab_draft: usize,
    cfg: &Eagle3Config,
) -> Result<Eagle3Shape> {
    let hp = &target.hp;
    let bad = |d: String| Err(TrainError::Config(d));
    if taps.len() != N_TAPS {
        return bad(format!(
            "an EAGLE-3 head fuses exactly {N_TAPS} target taps, the features give {taps:?}: \
             select three (e.g. [2, n/2, n − 3])"
        ));
    }
    if let Some(t) = taps.iter().find(|&&t| t > hp.n_layer) {
        return bad(format!(
            "tap {t} is past the target's {} layers",
            hp.n_layer
        ));
    }
    if n_vocab_draft == 0 || n_vocab_draft > hp.n_vocab {
        return bad(format!(
            "a draft vocabulary of {n_vocab_draft} tokens (the target has {})",
            hp.n_vocab
        ));
    }
    if cfg.ttt_steps == 0 || cfg.max_len < 2 || cfg.seqs_per_step == 0 {
        return bad(format!(
            "ttt_steps {}, max_len {}, seqs_per_step {}: each must be at least 1 (max_len 2)",
            cfg.ttt_steps, cfg.max_len, cfg.seqs_per_step
        ));
    }
    if !(cfg.step_decay.is_finite() && cfg.step_decay > 0.0) {
        return bad(format!(
            "step decay {}: the unroll steps' loss weights must be positive",
            cfg.step_decay
        ));
    }
    if !hp.head_dim_k.is_multiple_of(2)
        || hp.n_head_kv == 0
        || !hp.n_head.is_multiple_of(hp.n_head_kv)
    {
        return bad(format!(
            "the target's attention ({} heads, {} K/V heads of {}) is not one an EAGLE-3 head \
             can copy",
            hp.n_head, hp.n_head_kv, hp.head_dim_k
        ));
    }
    Ok(Eagle3Shape {
        n_embd: hp.n_embd,
        n_ff: if cfg.n_ff == 0 { hp.n_ff } else { cfg.n_ff },
        n_head: hp.n_head,
        n_head_kv: hp.n_head_kv,
        head_dim: hp.head_dim_k,
        rope_base: hp.rope_freq_base,
        rms_eps: hp.rms_eps,
        taps: taps.to_vec(),
        n_embd_target: hp.n_embd,
        n_vocab_draft,
    })
}

/// Fresh parameters: matrices `N(0, 0.02²)` (the attention and MLP output projections
/// `N(0, 0.02²/2)`), norms 1. [`Eagle3Run::start`] then puts the target's final norm and head
/// rows in place of `output_norm` and `output`.
#[must_use]
pub fn init_params(shape: &Eagle3Shape, seed: u64) -> Vec<Vec<f32>> {
    let mut rng = Rng::new(seed, u64::MAX);
    let out_std = 0.02 / 2f64.sqrt();
    shape
        .params()
        .iter()
        .map(|(name, dims)| {
            let n: usize = dims.iter().product();
            if dims.len() == 1 {
                return vec![1.0; n];
            }
            let std = if name.ends_with("attn_output.weight") || name.ends_with("ffn_down.weight") {
                out_std
            } else {
                0.02
            };
            #[allow(clippy::cast_possible_truncation, reason = "f32 weights")]
            (0..n).map(|_| (rng.normal() * std) as f32).collect()
        })
        .collect()
}

/// The parameters as burn tensors (`[out, in]` matrices, `[1, n]` norms).
#[derive(Debug, Clone)]
pub struct Weights {
    /// In [`Eagle3Shape::params`] order.
    pub t: Vec<Tensor<2>>,
}

impl Weights {
    /// Tensors of `host` (in [`Eagle3Shape::params`] order); tracked for gradients if `grad`.
    #[must_use]
    pub fn new(shape: &Eagle3Shape, host: &[Vec<f32>], dev: &Device, grad: bool) -> Self {
        Self {
            t: crate::net::param_tensors(&shape.params(), host, dev, grad),
        }
    }
}

/// One training sequence (its first positions).
#[derive(Clone, Debug)]
pub struct Example {
    /// Feature rows of positions `0..n`, `n × width`.
    pub feats: Vec<f32>,
    /// Rows: pairs `(token[P + 1], g[P])` for `P` in `0..n`.
    pub n: usize,
    /// Row `P`'s token embedding (of the token at `P + 1`), `n × n_embd`.
    pub emb: Vec<f32>,
    /// Loss rows: (unroll step `j`, anchor row `i`, draft-vocabulary label of position
    /// `i + j + 1`, weight).
    pub targets: Vec<(usize, usize, usize, f32)>,
}

fn tensor2(v: Vec<f32>, shape: [usize; 2], dev: &Device) -> Tensor<2> {
    Tensor::from_data(TensorData::new(v, shape), dev)
}

fn tensor3(v: Vec<f32>, shape: [usize; 3], dev: &Device) -> Tensor<3> {
    Tensor::from_data(TensorData::new(v, shape), dev)
}

fn tensor4(v: Vec<f32>, shape: [usize; 4], dev: &Device) -> Tensor<4> {
    Tensor::from_data(TensorData::new(v, shape), dev)
}

fn index(v: &[usize], dev: &Device) -> Tensor<1, Int> {
    let v: Vec<i64> = v.iter().map(|&x| to_i64(x)).collect();
    let n = v.len();
    Tensor::from_data(TensorData::new(v, [n]), dev)
}

fn to_i64(v: usize) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// `x · rsqrt(mean(x²) + ε) · w` over the last dimension.
fn rms_norm<const D: usize>(x: Tensor<D>, w: Tensor<D>, eps: f32) -> Tensor<D> {
    let ms = (x.clone() * x.clone()).mean_dim(D - 1);
    x * ms.add_scalar(eps).sqrt().recip() * w
}

/// Adjacent-pair RoPE tables `[rows, 1, hd/2, 1]` for `positions` (pair `i` turns by
/// `p · θ^(−2i/hd)`, llama.cpp's `NORM` rope).
fn rope_tables(positions: &[usize], hd: usize, base: f32, dev: &Device) -> (Tensor<4>, Tensor<4>) {
    let half = hd / 2;
    let mut cos = Vec::with_capacity(positions.len() * half);
    let mut sin = Vec::with_capacity(positions.len() * half);
    for &p in positions {
        for i in 0..half {
            #[allow(
                clippy::cast_precision_loss,
                reason = "positions and head dims are far below 2^24"
            )]
            let theta = (p as f64) * f64::from(base).powf(-2.0 * (i as f64) / hd as f64);
            #[allow(clippy::cast_possible_truncation, reason = "f32 tables")]
            {
                cos.push(theta.cos() as f32);
                sin.push(theta.sin() as f32);
            }
        }
    }
    let n = positions.len();
    (
        tensor4(cos, [n, 1, half, 1], dev),
        tensor4(sin, [n, 1, half, 1], dev),
    )
}

/// Rotates the pairs `(2i, 2i + 1)` of `[rows, heads, hd]`.
fn rope(x: Tensor<3>, cos: &Tensor<4>, sin: &Tensor<4>) -> Tensor<3> {
    let [rows, heads, hd] = x.dims();
    let x = x.reshape([rows, heads, hd / 2, 2]);
    let x0 = x.clone().narrow(3, 0, 1);
    let x1 = x.narrow(3, 1, 1);
    let r0 = x0.clone() * cos.clone() - x1.clone() * sin.clone();
    let r1 = x0 * sin.clone() + x1 * cos.clone();
    Tensor::cat(vec![r0, r1], 3).reshape([rows, heads, hd])
}

/// Keys and values an unroll has written, `[rows, kv heads, hd]` each: step 0's, of every
/// row of the sequence, and one pair per later step, of the rows that step ran.
#[derive(Debug, Default)]
struct Cache {
    ctx: Option<(Tensor<3>, Tensor<3>)>,
    chain: Vec<(Tensor<3>, Tensor<3>)>,
}

/// `g = fc(features)`, `[n, n_embd]`.
fn encode(shape: &Eagle3Shape, w: &Weights, ex: &Example, dev: &Device) -> Tensor<2> {
    let feats = tensor2(ex.feats.clone(), [ex.n, shape.width()], dev);
    feats.matmul(w.t[FC].clone().transpose())
}

/// One pass of the decoder layer over rows `(emb, g)` of unroll step `step` for the anchors
/// `rows` (RoPE at `row + step`); step 0 must run every row of the sequence, in order.
/// Writes the pass's keys into `cache` and returns the prenorm states `[rows, n_embd]`.
#[allow(
    clippy::too_many_arguments,
    reason = "the decoder's inputs are all needed"
)]
fn decoder(
    shape: &Eagle3Shape,
    w: &Weights,
    emb: Tensor<2>,
    g: Tensor<2>,
    rows: &[usize],
    step: usize,
    cache: &mut Cache,
    dev: &Device,
) -> Tensor<2> {
    let (hd, nh, nkv) = (shape.head_dim, shape.n_head, shape.n_head_kv);
    let gq = nh / nkv;
    let m = rows.len();
    let eps = shape.rms_eps;
    let lin = |x: Tensor<2>, i: usize| x.matmul(w.t[i].clone().transpose());

    let he = rms_norm(emb, w.t[ATTN_NORM].clone(), eps);
    let hg = rms_norm(g.clone(), w.t[HIDDEN_NORM].clone(), eps);
    let x = Tensor::cat(vec![he, hg], 1);
    let pos: Vec<usize> = rows.iter().map(|&r| r + step).collect();
    let (cos, sin) = rope_tables(&pos, hd, shape.rope_base, dev);
    let q = rope(lin(x.clone(), WQ).reshape([m, nh, hd]), &cos, &sin);
    let k = rope(lin(x.clone(), WK).reshape([m, nkv, hd]), &cos, &sin);
    let v = lin(x, WV).reshape([m, nkv, hd]);
    if step == 0 {
        cache.ctx = Some((k, v));
    } else {
        cache.chain.push((k, v));
    }
    let (k0, v0) = cache.ctx.as_ref().expect("step 0 writes the context first");
    let n = k0.dims()[0];

    // Step-0 keys: row r sees rows 0..=rows[r].
    let mut bias = vec![-1e9f32; gq * m * n];
    for j in 0..gq {
        for (r, &i) in rows.iter().enumerate() {
            bias[(j * m + r) * n..(j * m + r) * n + (i + 1).min(n)].fill(0.0);
        }
    }
    let bias = tensor3(bias, [1, gq * m, n], dev);
    #[allow(clippy::cast_precision_loss, reason = "head dims are small")]
    let scale = 1.0 / (hd as f32).sqrt();
    // Heads kv·gq .. kv·gq + gq − 1 share K/V head kv: stack their queries.
    let q = q.swap_dims(0, 1).reshape([nkv, gq * m, hd]);
    let s0 = q
        .clone()
        .matmul(k0.clone().swap_dims(0, 1).swap_dims(1, 2))
        .mul_scalar(scale)
        + bias;
    // Keys of later steps: each query sees those of its own anchor only.
    let q4 = q.reshape([nkv, gq, m, hd]);
    let mut parts = vec![s0];
    for (kc, _) in &cache.chain {
        let kc = kc.clone().swap_dims(0, 1).reshape([nkv, 1, m, hd]);
        let d = (q4.clone() * kc).sum_dim(3).mul_scalar(scale);
        parts.push(d.reshape([nkv, gq * m, 1]));
    }
    let p = softmax(Tensor::cat(parts, 2), 2);
    let mut o = p.clone().narrow(2, 0, n).matmul(v0.clone().swap_dims(0, 1));
    for (c, (_, vc)) in cache.chain.iter().enumerate() {
        let pc = p.clone().narrow(2, n + c, 1).reshape([nkv, gq, m, 1]);
        let vc = vc.clone().swap_dims(0, 1).reshape([nkv, 1, m, hd]);
        o = o + (pc * vc).reshape([nkv, gq * m, hd]);
    }
    let o = o.reshape([nh, m, hd]).swap_dims(0, 1).reshape([m, nh * hd]);
    let x = g + lin(o, WO);
    let h = rms_norm(x.clone(), w.t[FFN_NORM].clone(), eps);
    let act = silu(lin(h.clone(), GATE)) * lin(h, UP);
    x + lin(act, DOWN)
}

/// The teacher-forced TTT unroll of `steps` steps over every row of `ex`: the prenorm states
/// of each step, `[n, n_embd]` (row `i` of step `j` is the chain step `j` from anchor `i`, at
/// position `i + j`; rows whose chain runs past the sequence are computed on the last token
/// and carry no loss).
#[must_use]
pub fn forward(
    shape: &Eagle3Shape,
    w: &Weights,
    ex: &Example,
    steps: usize,
    dev: &Device,
) -> Vec<Tensor<2>> {
    let n = ex.n;
    let emb = tensor2(ex.emb.clone(), [n, shape.n_embd], dev);
    let rows: Vec<usize> = (0..n).collect();
    let mut cache = Cache::default();
    let mut g = encode(shape, w, ex, dev);
    let mut out = Vec::with_capacity(steps);
    for j in 0..steps {
        let e = if j == 0 {
            emb.clone()
        } else {
            let at: Vec<usize> = rows.iter().map(|&i| (i + j).min(n - 1)).collect();
            emb.clone().select(0, index(&at, dev))
        };
        let h = decoder(shape, w, e, g, &rows, j, &mut cache, dev);
        g = h.clone();
        out.push(h);
    }
    out
}

/// Draft-vocabulary logits of prenorm states: final norm, then the head.
#[must_use]
pub fn logits(shape: &Eagle3Shape, w: &Weights, prenorm: Tensor<2>) -> Tensor<2> {
    rms_norm(prenorm, w.t[OUT_NORM].clone(), shape.rms_eps).matmul(w.t[HEAD].clone().transpose())
}

/// The TTT loss of `steps` unroll steps: `Σ w·(−log p(label)) / Σ w` over the example's loss
/// rows (those of steps below `steps`).
#[must_use]
pub fn loss(
    shape: &Eagle3Shape,
    w: &Weights,
    ex: &Example,
    steps: usize,
    dev: &Device,
) -> Tensor<1> {
    let targets: Vec<_> = ex.targets.iter().filter(|t| t.0 < steps).collect();
    let m = targets.len();
    if m == 0 {
        return Tensor::zeros([1], dev);
    }
    let hs = forward(shape, w, ex, steps, dev);
    let all = Tensor::cat(hs, 0);
    let rows: Vec<usize> = targets.iter().map(|t| t.0 * ex.n + t.1).collect();
    let tgt: Vec<i64> = targets.iter().map(|t| to_i64(t.2)).collect();
    let wsum: f32 = targets.iter().map(|t| t.3).sum();
    let wts: Vec<f32> = targets.iter().map(|t| t.3 / wsum).collect();
    let tgt = Tensor::<2, Int>::from_data(TensorData::new(tgt, [m, 1]), dev);
    let wts = tensor2(wts, [m, 1], dev);
    let lp = log_softmax(logits(shape, w, all.select(0, index(&rows, dev))), 1);
    (lp.gather(1, tgt) * wts).sum().neg()
}

/// Greedy chained drafts of `len` tokens from each anchor row of `ex`, drafted as inference
/// drafts them: step 0 is the anchor's row (its pair and every earlier row as context), each
/// later step feeds the previous step's token (its target id through `d2t`, embedded with
/// `embd`, the target's `[n_vocab][n_embd]` embedding) and prenorm state. Returns the draft
/// vocabulary ids, `len` per anchor.
#[allow(
    clippy::too_many_arguments,
    reason = "the draft's inputs are all needed"
)]
#[must_use]
pub fn draft_chains(
    shape: &Eagle3Shape,
    w: &Weights,
    ex: &Example,
    embd: &[f32],
    d2t: &[u32],
    anchors: &[usize],
    len: usize,
    dev: &Device,
) -> Vec<Vec<usize>> {
    let (n, e) = (ex.n, shape.n_embd);
    let m = anchors.len();
    let mut out = vec![Vec::with_capacity(len); m];
    if m == 0 || len == 0 {
        return out;
    }
    let rows: Vec<usize> = (0..n).collect();
    let mut cache = Cache::default();
    let emb = tensor2(ex.emb.clone(), [n, e], dev);
    let h0 = decoder(
        shape,
        w,
        emb,
        encode(shape, w, ex, dev),
        &rows,
        0,
        &mut cache,
        dev,
    );
    let mut g = h0.select(0, index(anchors, dev));
    for j in 0..len {
        let lg = logits(shape, w, g.clone());
        let k = lg.dims()[1];
        let data = lg.to_data().try_to_vec::<f32>().unwrap_or_default();
        let mut emb = Vec::with_capacity(m * e);
        for (r, chain) in out.iter_mut().enumerate() {
            let d = argmax(&data[r * k..(r + 1) * k]);
            chain.push(d);
            let t = d2t[d] as usize;
            emb.extend_from_slice(&embd[t * e..(t + 1) * e]);
        }
        if j + 1 < len {
            g = decoder(
                shape,
                w,
                tensor2(emb, [m, e], dev),
                g,
                anchors,
                j + 1,
                &mut cache,
                dev,
            );
        }
    }
    out
}

/// A saved EAGLE-3 run.
pub type Eagle3Checkpoint = RunCheckpoint<Eagle3Config, Eagle3Shape>;

/// The state of an EAGLE-3 run, between steps.
#[derive(Debug)]
pub struct Eagle3Run {
    /// The run's configuration.
    pub config: Eagle3Config,
    /// The head's shape.
    pub shape: Eagle3Shape,
    /// The draft vocabulary.
    pub vocab: DraftVocab,
    /// Parameters in [`Eagle3Shape::params`] order.
    pub params: Vec<Vec<f32>>,
    /// AdamW moments per parameter.
    pub moments: Vec<Moments>,
    /// Steps done.
    pub step: usize,
    /// Every step's log.
    pub steps: Vec<StepLog>,
    /// Every validation (accuracy per chain position `1..=val_len`).
    pub vals: Vec<ValLog>,
    /// sha256 of the target.
    pub target_sha256: String,
    /// What each feature column is divided by before `fc` (empty: nothing).
    pub feat_scale: Vec<f32>,
    /// Where [`Eagle3Run::train`] computes (not a setting of the run: a checkpoint continues on
    /// either device).
    pub accel: Accel,
}

/// One sequence, read for training.
struct Seq {
    ids: Vec<u32>,
    /// `labels[p]`: the token position `p` should be followed by.
    labels: Vec<Option<u32>>,
}

fn read_seq(feats: &FeatureSet, i: usize, labels: Labels) -> Result<Seq> {
    let ids = feats.ids(i)?;
    let labels = match labels {
        Labels::Corpus => ids.iter().skip(1).map(|&t| Some(t)).chain([None]).collect(),
        Labels::Target | Labels::Greedy => feats
            .target_top1(i)?
            .ok_or_else(|| {
                TrainError::Config(
                    "labels from the target need features extracted with --top-k 1 or more".into(),
                )
            })?
            .into_iter()
            .map(Some)
            .collect(),
    };
    Ok(Seq { ids, labels })
}

/// Sequence `i`'s first `max_len` positions as an example, or `None` when it has no pair.
#[allow(clippy::too_many_arguments, reason = "one example's inputs")]
fn example(
    feats: &FeatureSet,
    i: usize,
    seq: &Seq,
    shape: &Eagle3Shape,
    target: &Target,
    vocab: &DraftVocab,
    cfg: &Eagle3Config,
    scale: &[f32],
) -> Result<Option<Example>> {
    let len = seq.ids.len().min(cfg.max_len);
    if len < 2 {
        return Ok(None);
    }
    let n = len - 1;
    let w = shape.width();
    let mut all = feats.features(i)?;
    all.truncate(n * w);
    // As the head's encoder guards its input at inference (llama.cpp's f16 staging guard).
    for x in &mut all {
        *x = if x.is_nan() {
            0.0
        } else {
            x.clamp(-65504.0, 65504.0)
        };
    }
    crate::features::divide_columns(&mut all, scale);
    let e = shape.n_embd;
    let mut emb = Vec::with_capacity(n * e);
    for &t in &seq.ids[1..=n] {
        emb.extend_from_slice(&target.embd[t as usize * e..(t as usize + 1) * e]);
    }
    let mut targets = Vec::new();
    let mut weight = 1.0f32;
    for j in 0..cfg.ttt_steps {
        // Anchor row i's step j feeds the token at i + j + 1 (row i + j) and predicts the
        // label of position i + j + 1.
        for row in 0..n.saturating_sub(j) {
            let Some(Some(label)) = seq.labels.get(row + j + 1) else {
                continue;
            };
            if let Some(d) = vocab.draft_id(*label) {
                targets.push((j, row, d, weight));
            }
        }
        weight *= cfg.step_decay;
    }
    Ok(Some(Example {
        feats: all,
        n,
        emb,
        targets,
    }))
}

fn host(t: &Tensor<2>) -> Vec<f32> {
    t.to_data().try_to_vec::<f32>().unwrap_or_default()
}

fn scalar(t: Tensor<1>) -> f32 {
    t.to_data()
        .try_to_vec::<f32>()
        .unwrap_or_default()
        .first()
        .copied()
        .unwrap_or(0.0)
}

fn argmax(row: &[f32]) -> usize {
    let mut best = 0;
    for (i, &x) in row.iter().enumerate() {
        if x > row[best] {
            best = i;
        }
    }
    best
}

/// Whether a parameter takes weight decay (matrices do, norms do not).
fn decays(shape: &Eagle3Shape) -> Vec<bool> {
    shape.params().iter().map(|(_, d)| d.len() == 2).collect()
}

impl Eagle3Run {
    /// A fresh run, or the one `out`'s checkpoint holds (`resume`: which must match `cfg`,
    /// the target and the features).
    ///
    /// # Errors
    /// A checkpoint of another run (or of another drafter), an unreadable one, features of
    /// another target or not of three taps, or a configuration the target cannot take.
    pub fn start(
        cfg: &Eagle3Config,
        target: &Target,
        feats: &FeatureSet,
        out: &Path,
        resume: bool,
    ) -> Result<Self> {
        if feats.manifest.target.sha256 != target.sha256 {
            return Err(TrainError::Config(format!(
                "the features are of target sha256 {}, this target is {}",
                feats.manifest.target.sha256, target.sha256
            )));
        }
        let ckpt = out.join(checkpoint::FILE);
        if resume && ckpt.exists() {
            let c = Eagle3Checkpoint::read(&ckpt).map_err(|e| match e {
                TrainError::Config(d) => {
                    TrainError::Config(format!("{d} (not an EAGLE-3 run's checkpoint?)"))
                }
                e => e,
            })?;
            let shape = shape_for(target, &feats.taps, c.d2t.len(), cfg)?;
            c.check(cfg, &shape, &target.sha256)?;
            if c.params.len() != shape.params().len() {
                return Err(TrainError::Config(format!(
                    "{}: {} parameters, an EAGLE-3 head has {}",
                    ckpt.display(),
                    c.params.len(),
                    shape.params().len()
                )));
            }
            return Ok(Self {
                config: cfg.clone(),
                shape,
                vocab: DraftVocab::from_ids(c.d2t.clone(), target.hp.n_vocab),
                moments: c.moments,
                params: c.params,
                step: c.step,
                steps: c.steps,
                vals: c.vals,
                target_sha256: target.sha256.clone(),
                feat_scale: c.feat_scale,
                accel: Accel::Cpu,
            });
        }
        if !resume && ckpt.exists() {
            return Err(TrainError::Config(format!(
                "{} holds a run already: pass --resume to continue it, or choose another --out",
                out.display()
            )));
        }
        // Checks the taps and the settings before the vocabulary pass reads every sequence.
        shape_for(target, &feats.taps, target.hp.n_vocab, cfg)?;
        let (train, _) = dflash::split(feats.len(), cfg.val_seqs);
        let mut counts = vec![0u64; target.hp.n_vocab];
        for &i in &train {
            for t in read_seq(feats, i, cfg.labels)?.labels.into_iter().flatten() {
                if let Some(c) = counts.get_mut(t as usize) {
                    *c += 1;
                }
            }
        }
        let vocab = DraftVocab::most_frequent(&counts, cfg.draft_vocab);
        let shape = shape_for(target, &feats.taps, vocab.len(), cfg)?;
        let feat_scale = if cfg.standardize {
            feats.column_scales(&train)?
        } else {
            Vec::new()
        };
        let mut params = init_params(&shape, cfg.seed);
        if let Some(norm) = &target.output_norm {
            params[OUT_NORM].clone_from(norm);
        }
        params[HEAD] = target.head_rows(&vocab.ids());
        let moments = vec![Moments::default(); params.len()];
        Ok(Self {
            config: cfg.clone(),
            shape,
            vocab,
            params,
            moments,
            step: 0,
            steps: Vec::new(),
            vals: Vec::new(),
            target_sha256: target.sha256.clone(),
            feat_scale,
            accel: Accel::Cpu,
        })
    }

    /// Runs steps until `self.config.optim.steps` (or, when given, until step `stop_at`, where
    /// it checkpoints: a later [`Eagle3Run::start`] with `resume` continues as if it had not
    /// stopped), checkpointing into `out`; `each` sees every step's log and every validation.
    ///
    /// # Errors
    /// A feature shard or the checkpoint could not be read or written.
    pub fn train(
        &mut self,
        target: &Target,
        feats: &FeatureSet,
        out: &Path,
        stop_at: Option<usize>,
        mut each: impl FnMut(&StepLog, Option<&ValLog>),
    ) -> Result<()> {
        let dev = self.accel.device()?;
        let (train, val) = dflash::split(feats.len(), self.config.val_seqs);
        if train.is_empty() {
            return Err(TrainError::Config("no training sequences".into()));
        }
        let decay = decays(&self.shape);
        let cfg = self.config.clone();
        let end = stop_at.map_or(cfg.optim.steps, |s| s.min(cfg.optim.steps));
        while self.step < end {
            let t0 = Instant::now();
            let mut rng = Rng::new(cfg.seed, self.step as u64);
            let mut examples = Vec::with_capacity(cfg.seqs_per_step);
            for _ in 0..cfg.seqs_per_step {
                let i = train[rng.below(train.len())];
                let seq = read_seq(feats, i, cfg.labels)?;
                let ex = example(
                    feats,
                    i,
                    &seq,
                    &self.shape,
                    target,
                    &self.vocab,
                    &cfg,
                    &self.feat_scale,
                )?;
                if let Some(ex) = ex.filter(|e| !e.targets.is_empty()) {
                    examples.push(ex);
                }
            }
            let rows: usize = examples.iter().map(|e| e.targets.len()).sum();
            let w = Weights::new(&self.shape, &self.params, &dev, true);
            let (loss, grad_norm) = if examples.is_empty() {
                (0.0, 0.0)
            } else {
                #[allow(clippy::cast_precision_loss, reason = "a handful of examples")]
                let inv = 1.0 / examples.len() as f32;
                let mut total: Option<Tensor<1>> = None;
                for ex in &examples {
                    let l = loss(&self.shape, &w, ex, cfg.ttt_steps, &dev).mul_scalar(inv);
                    total = Some(match total {
                        Some(t) => t + l,
                        None => l,
                    });
                }
                let total = total.unwrap_or_else(|| Tensor::zeros([1], &dev));
                let loss = scalar(total.clone());
                let grads = total.backward();
                let g: Vec<Vec<f32>> =
                    w.t.iter()
                        .zip(&self.params)
                        .map(|(t, p)| {
                            t.grad(&grads)
                                .map_or_else(|| vec![0.0; p.len()], |g| host(&g))
                        })
                        .collect();
                let norm = optim::step(
                    &cfg.optim,
                    self.step,
                    &mut self.params,
                    &g,
                    &mut self.moments,
                    &decay,
                );
                (loss, norm)
            };
            #[allow(clippy::cast_precision_loss, reason = "row counts are small")]
            let rows_per_s = rows as f32 / t0.elapsed().as_secs_f32().max(1e-6);
            let log = StepLog {
                step: self.step,
                loss,
                lr: cfg.optim.lr_at(self.step),
                grad_norm,
                rows_per_s,
            };
            self.steps.push(log.clone());
            self.step += 1;
            let due = self.step.is_multiple_of(cfg.checkpoint_every.max(1))
                || self.step == cfg.optim.steps;
            let val = if due {
                let v = self.validate(target, feats, &val, &dev)?;
                if let Some(v) = &v {
                    self.vals.push(v.clone());
                }
                v
            } else {
                None
            };
            if due || self.step == end {
                checkpoint::write(&out.join(checkpoint::FILE), &self.snapshot())?;
            }
            each(&log, val.as_ref());
        }
        Ok(())
    }

    fn snapshot(&self) -> Eagle3Checkpoint {
        RunCheckpoint {
            config: self.config.clone(),
            shape: self.shape.clone(),
            target_sha256: self.target_sha256.clone(),
            d2t: self.vocab.ids(),
            step: self.step,
            params: self.params.clone(),
            moments: self.moments.clone(),
            steps: self.steps.clone(),
            vals: self.vals.clone(),
            feat_scale: self.feat_scale.clone(),
        }
    }

    /// The parameters as the head's file holds them: `fc` takes raw features (the feature
    /// scales folded into its columns).
    #[must_use]
    pub fn export_params(&self) -> Vec<Vec<f32>> {
        crate::features::fold_scales(&self.shape.params(), &self.params, &self.feat_scale)
    }

    /// The head on the validation sequences: the TTT loss, and greedy chains of `val_len`
    /// from anchors every `val_stride` positions.
    fn validate(
        &self,
        target: &Target,
        feats: &FeatureSet,
        val: &[usize],
        dev: &Device,
    ) -> Result<Option<ValLog>> {
        if val.is_empty() {
            return Ok(None);
        }
        let inner = dev.clone().inner();
        let w = Weights::new(&self.shape, &self.params, &inner, false);
        let cfg = &self.config;
        let len = cfg.val_len.max(1);
        let d2t = self.vocab.ids();
        let mut hits = vec![0u64; len];
        let mut seen = vec![0u64; len];
        let (mut accepted, mut chains) = (0u64, 0u64);
        let (mut loss_sum, mut loss_n) = (0f64, 0u64);
        for &i in val {
            let seq = read_seq(feats, i, cfg.labels)?;
            let Some(ex) = example(
                feats,
                i,
                &seq,
                &self.shape,
                target,
                &self.vocab,
                cfg,
                &self.feat_scale,
            )?
            else {
                continue;
            };
            if !ex.targets.is_empty() {
                loss_sum += f64::from(scalar(loss(&self.shape, &w, &ex, cfg.ttt_steps, &inner)));
                loss_n += 1;
            }
            // Anchors whose first draft has a label.
            let anchors: Vec<usize> = (0..ex.n)
                .step_by(cfg.val_stride.max(1))
                .filter(|&a| matches!(seq.labels.get(a + 1), Some(Some(_))))
                .collect();
            let drafts = draft_chains(
                &self.shape,
                &w,
                &ex,
                &target.embd,
                &d2t,
                &anchors,
                len,
                &inner,
            );
            for (&a, chain) in anchors.iter().zip(&drafts) {
                let mut run = true;
                let mut got = 0u64;
                for (k, &d) in chain.iter().enumerate() {
                    // The k-th draft (0-based) stands at position a + k + 2.
                    let Some(Some(label)) = seq.labels.get(a + k + 1) else {
                        break;
                    };
                    let ok = self.vocab.draft_id(*label) == Some(d);
                    seen[k] += 1;
                    if ok {
                        hits[k] += 1;
                    }
                    if run && ok {
                        got += 1;
                    } else {
                        run = false;
                    }
                }
                accepted += got;
                chains += 1;
            }
        }
        #[allow(
            clippy::cast_precision_loss,
            clippy::cast_possible_truncation,
            reason = "ratios"
        )]
        let ratio = |a: u64, b: u64| {
            if b == 0 {
                0.0
            } else {
                (a as f64 / b as f64) as f32
            }
        };
        #[allow(
            clippy::cast_precision_loss,
            clippy::cast_possible_truncation,
            reason = "a mean"
        )]
        let mean_loss = if loss_n == 0 {
            0.0
        } else {
            (loss_sum / loss_n as f64) as f32
        };
        Ok(Some(ValLog {
            step: self.step,
            loss: mean_loss,
            accuracy: hits.iter().zip(&seen).map(|(&h, &s)| ratio(h, s)).collect(),
            tau: 1.0 + ratio(accepted, chains),
        }))
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;
    use std::sync::Arc;

    use specula_cpu::CpuBackend;
    use specula_gguf::Gguf;
    use specula_models::Model;
    use specula_models::eagle3::Eagle3;
    use specula_quant::QType;
    use specula_testkit::tiny;

    use super::*;
    use crate::export::{self, ExportType};

    fn f16(x: f32) -> f32 {
        half::f16::from_f32(x).to_f32()
    }

    fn normals(rng: &mut Rng, n: usize, std: f64) -> Vec<f32> {
        #[allow(clippy::cast_possible_truncation, reason = "f32 test values")]
        (0..n).map(|_| (rng.normal() * std) as f32).collect()
    }

    /// Parameters of a visibly non-trivial head, exact in f16 (so an F16 export holds them).
    fn random_params(shape: &Eagle3Shape, seed: u64) -> Vec<Vec<f32>> {
        let mut rng = Rng::new(seed, 1);
        shape
            .params()
            .iter()
            .map(|(name, dims)| {
                let n: usize = dims.iter().product();
                let v = if dims.len() == 1 {
                    normals(&mut rng, n, 0.1).iter().map(|x| 1.0 + x).collect()
                } else if name == "fc.weight" {
                    normals(&mut rng, n, 0.08)
                } else {
                    normals(&mut rng, n, 0.15)
                };
                v.into_iter().map(f16).collect()
            })
            .collect()
    }

    fn host(t: &Tensor<2>) -> Vec<f32> {
        super::host(t)
    }

    /// Σ(a − b)² / Σb².
    fn nmse(got: &[f32], want: &[f32]) -> f64 {
        assert_eq!(got.len(), want.len());
        let (mut num, mut den) = (0f64, 0f64);
        for (&a, &b) in got.iter().zip(want) {
            num += f64::from(a - b).powi(2);
            den += f64::from(b).powi(2);
        }
        num / den.max(1e-30)
    }

    /// A tiny llama target of 4 query heads on 2 K/V heads, as a file and loaded.
    fn tiny_target(dir: &Path) -> (PathBuf, Target, Model<CpuBackend>, CpuBackend) {
        let dims = tiny::Dims {
            n_head: 4,
            n_head_kv: 2,
            head_dim: 16,
            ..tiny::Dims::TINY
        };
        let bytes = tiny::target_sized("llama", &dims)
            .to_bytes()
            .expect("a tiny target");
        let path = dir.join("target.gguf");
        std::fs::write(&path, &bytes).expect("written");
        let target = Target::load(&path).expect("the tiny target loads for training");
        let be = CpuBackend::new(1);
        let model =
            Model::load(&be, Arc::new(Gguf::from_bytes(bytes).expect("GGUF"))).expect("loads");
        (path, target, model, be)
    }

    fn to_u32(v: usize) -> u32 {
        u32::try_from(v).expect("small")
    }

    /// The draft-vocabulary columns of full-vocabulary logit rows.
    fn draft_cols(full: &[f32], n_vocab: usize, d2t: &[u32]) -> Vec<f32> {
        full.chunks_exact(n_vocab)
            .flat_map(|row| d2t.iter().map(|&t| row[t as usize]))
            .collect()
    }

    #[test]
    fn gradients_reach_every_parameter_and_adamw_lowers_the_ttt_loss() {
        let shape = Eagle3Shape {
            n_embd: 16,
            n_ff: 24,
            n_head: 4,
            n_head_kv: 2,
            head_dim: 8,
            rope_base: 10_000.0,
            rms_eps: 1e-6,
            taps: vec![1, 2, 3],
            n_embd_target: 12,
            n_vocab_draft: 10,
        };
        let mut rng = Rng::new(9, 0);
        let n = 9;
        let steps = 3;
        let mut targets = Vec::new();
        for j in 0..steps {
            for row in 0..n - j {
                let w = 0.8f32.powi(i32::try_from(j).expect("small"));
                targets.push((j, row, rng.below(10), w));
            }
        }
        let ex = Example {
            feats: normals(&mut rng, n * shape.width(), 1.0),
            n,
            emb: normals(&mut rng, n * 16, 1.0),
            targets,
        };
        let dev = Device::flex().autodiff();
        let mut params = init_params(&shape, 3);
        params[HEAD] = normals(&mut rng, 16 * 10, 0.1);
        let w = Weights::new(&shape, &params, &dev, true);
        let l = loss(&shape, &w, &ex, steps, &dev);
        let grads = l.backward();
        for ((name, _), t) in shape.params().iter().zip(&w.t) {
            let g = t.grad(&grads).map(|g| host(&g)).unwrap_or_default();
            let norm: f32 = g.iter().map(|x| x * x).sum();
            assert!(
                norm > 0.0 && norm.is_finite(),
                "{name}: gradient norm² {norm}"
            );
        }

        let cfg = AdamW {
            lr: 1e-2,
            warmup: 1,
            steps: 40,
            min_lr_ratio: 0.1,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.0,
            clip: 1.0,
        };
        let mut moments = vec![Moments::default(); params.len()];
        let decay = decays(&shape);
        let mut losses = Vec::new();
        for t in 0..cfg.steps {
            let w = Weights::new(&shape, &params, &dev, true);
            let l = loss(&shape, &w, &ex, steps, &dev);
            losses.push(scalar(l.clone()));
            let grads = l.backward();
            let g: Vec<Vec<f32>> =
                w.t.iter()
                    .zip(&params)
                    .map(|(t, p)| {
                        t.grad(&grads)
                            .map_or_else(|| vec![0.0; p.len()], |g| host(&g))
                    })
                    .collect();
            optim::step(&cfg, t, &mut params, &g, &mut moments, &decay);
        }
        let (first, last) = (losses[0], losses[losses.len() - 1]);
        assert!(first.is_finite() && last < 0.5 * first, "losses {losses:?}");
    }

    #[test]
    fn the_burn_head_is_specula_s_eagle3_head_at_every_unroll_step() {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let (_, target, model, be) = tiny_target(dir.path());
        let n_vocab = target.hp.n_vocab;
        let vocab = DraftVocab::from_ids((0..16).map(|i| 2 * i + 1).collect(), n_vocab);
        let d2t = vocab.ids();
        let k = d2t.len();
        let shape = shape_for(&target, &[0, 1, 2], k, &Eagle3Config::new(1)).expect("a shape");
        let params = random_params(&shape, 5);
        let path = dir.path().join("eagle3.gguf");
        export::write_eagle3(
            &path,
            &shape,
            &params,
            &vocab,
            &target,
            ExportType::F16,
            "t",
        )
        .expect("exported");
        let file = Arc::new(Gguf::open(&path).expect("a GGUF"));
        let tgt = Gguf::open(dir.path().join("target.gguf")).expect("the target");
        for k in ["tokenizer.ggml.model", "tokenizer.ggml.tokens"] {
            let v = |g: &Gguf| g.metadata().get(k).cloned();
            assert!(v(&file).is_some() && v(&file) == v(&tgt), "{k}");
        }
        let net = Eagle3::load(&be, file, &model).expect("specula loads the exported head");
        assert_eq!(net.hparams().target_layers, vec![0, 1, 2]);

        // A sequence: random tokens and features.
        let (e, width) = (shape.n_embd, shape.width());
        let len = 16;
        let n = len - 1;
        let mut rng = Rng::new(11, 0);
        let tokens: Vec<u32> = (0..len).map(|_| to_u32(rng.below(n_vocab))).collect();
        let feats = normals(&mut rng, n * width, 1.0);
        let n_ctx = 64;

        // Inference: the pairs (token[P + 1], g[P]) at P = 0..n, as the engine writes them.
        let mut s = net.scratch(&be);
        let mut g = Vec::new();
        net.encode(&be, &mut s, &feats, &mut g).expect("encoded");
        let mut kv = model
            .new_kv(&be, n_ctx, QType::F32, QType::F32)
            .expect("a cache");
        let pos: Vec<u32> = (0..n).map(to_u32).collect();
        net.decode(&be, &mut kv, n_ctx, &mut s, &tokens[1..], &g, &pos, true)
            .expect("decoded");
        let want0 = draft_cols(&s.logits_host, n_vocab, &d2t);
        let prenorm0 = s.prenorm.clone();

        // Training: the same rows, teacher-forced unroll.
        let dev = Device::flex();
        let w = Weights::new(&shape, &params, &dev, false);
        let emb: Vec<f32> = tokens[1..]
            .iter()
            .flat_map(|&t| {
                target.embd[t as usize * e..(t as usize + 1) * e]
                    .iter()
                    .copied()
            })
            .collect();
        let ex = Example {
            feats,
            n,
            emb,
            targets: Vec::new(),
        };
        const J: usize = 3;
        let hs = forward(&shape, &w, &ex, J + 1, &dev);
        let got: Vec<Vec<f32>> = hs
            .iter()
            .map(|h| host(&logits(&shape, &w, h.clone())))
            .collect();
        let err0 = nmse(&got[0], &want0);
        assert!(err0 <= 1e-4, "step 0: relative MSE {err0}");
        assert!(nmse(&host(&hs[0]), &prenorm0) <= 1e-4, "step 0 prenorm");

        // Step j of anchor i is inference's chain step j from anchor i fed the corpus tokens:
        // at position i + j, over the pairs 0..=i and the chain's own cells (anchors from the
        // last, so that each chain finds the cells up to its anchor as step 0 wrote them).
        let mut want = vec![Vec::new(); J + 1];
        let mut have = vec![Vec::new(); J + 1];
        for i in (0..n - J).rev() {
            let mut gin = prenorm0[i * e..(i + 1) * e].to_vec();
            for j in 1..=J {
                net.decode(
                    &be,
                    &mut kv,
                    n_ctx,
                    &mut s,
                    &[tokens[i + j + 1]],
                    &gin,
                    &[to_u32(i + j)],
                    true,
                )
                .expect("a chain step");
                want[j].extend(draft_cols(&s.logits_host, n_vocab, &d2t));
                have[j].extend_from_slice(&got[j][i * k..(i + 1) * k]);
                gin.clone_from(&s.prenorm);
            }
        }
        for j in 1..=J {
            let err = nmse(&have[j], &want[j]);
            assert!(err <= 1e-4, "unroll step {j}: relative MSE {err}");
        }

        // Greedy chains (the validation's drafts) are inference's greedy chains.
        net.decode(&be, &mut kv, n_ctx, &mut s, &tokens[1..], &g, &pos, true)
            .expect("pairs rewritten");
        let anchors = [0, 4, 9, n - 1];
        let len = 5;
        let drafts = draft_chains(&shape, &w, &ex, &target.embd, &d2t, &anchors, len, &dev);
        for (&a, chain) in anchors.iter().zip(&drafts).rev() {
            let mut d = argmax(&want0[a * k..(a + 1) * k]);
            let mut mine = vec![d];
            let mut gin = prenorm0[a * e..(a + 1) * e].to_vec();
            for j in 1..len {
                let tok = d2t[d];
                net.decode(
                    &be,
                    &mut kv,
                    n_ctx,
                    &mut s,
                    &[tok],
                    &gin,
                    &[to_u32(a + j)],
                    true,
                )
                .expect("a chain step");
                d = argmax(&draft_cols(&s.logits_host, n_vocab, &d2t));
                mine.push(d);
                gin.clone_from(&s.prenorm);
            }
            assert_eq!(chain, &mine, "greedy chain from anchor {a}");
        }
    }

    /// The DFlash training graph (`net.rs`) is specula's `Dflash` draft: the same block logits
    /// for an anchor after injected context rows, from an F16 export of the same weights.
    #[test]
    fn the_burn_dflash_net_is_specula_s_dflash_draft() {
        use crate::dflash::{self, DflashConfig};
        use crate::net;
        use specula_models::dflash::Dflash;

        let dir = tempfile::tempdir().expect("a temporary directory");
        let (_, target, model, be) = tiny_target(dir.path());
        let n_vocab = target.hp.n_vocab;
        let vocab = DraftVocab::from_ids(
            (0..n_vocab / 2).map(|i| to_u32(2 * i + 1)).collect(),
            n_vocab,
        );
        let d2t = vocab.ids();
        let k = d2t.len();
        let mut cfg = DflashConfig::new(1);
        cfg.block = 4;
        cfg.n_layer = 2;
        let shape = dflash::shape_for(&target, &[1, 2], &cfg).expect("a shape");
        let mut rng = Rng::new(9, 2);
        let params: Vec<Vec<f32>> = shape
            .params()
            .iter()
            .map(|(name, dims)| {
                let n: usize = dims.iter().product();
                let v: Vec<f32> = if dims.len() == 1 {
                    normals(&mut rng, n, 0.1).iter().map(|x| 1.0 + x).collect()
                } else if name == "fc.weight" {
                    normals(&mut rng, n, 0.08)
                } else {
                    normals(&mut rng, n, 0.15)
                };
                v.into_iter().map(f16).collect()
            })
            .collect();
        let path = dir.path().join("dflash.gguf");
        export::write_dflash(
            &path,
            &shape,
            &params,
            &vocab,
            &target,
            ExportType::F16,
            "t",
        )
        .expect("exported");
        let file = Arc::new(Gguf::open(&path).expect("a GGUF"));
        // The target's vocabulary travels with the drafter (llama.cpp loads it from there).
        let tgt = Gguf::open(dir.path().join("target.gguf")).expect("the target");
        let tok = |g: &Gguf, k: &str| g.metadata().get(k).cloned();
        assert!(!target.tokenizer.is_empty());
        for (k, _) in &target.tokenizer {
            assert_eq!(tok(&file, k), tok(&tgt, k), "{k}");
        }
        assert!(tok(&file, "tokenizer.ggml.model").is_some());
        let draft = Dflash::load(&be, file, &model).expect("specula loads the exported drafter");

        let (e, width, b) = (shape.n_embd, shape.width(), shape.block);
        let a = 7;
        let mut rng = Rng::new(4, 4);
        let feats = normals(&mut rng, a * width, 1.0);
        let anchor = to_u32(rng.below(n_vocab));
        let tokens: Vec<u32> = std::iter::once(anchor)
            .chain(std::iter::repeat_n(shape.mask, b - 1))
            .collect();
        let n_ctx = 32;
        let mut kv =
            specula_tensor::Backend::kv_new(&be, draft.kv_shape(n_ctx, QType::F32, QType::F32))
                .expect("a cache");
        let mut s = draft.scratch(&be);
        let pos: Vec<u32> = (0..a).map(to_u32).collect();
        draft
            .inject(&be, &mut kv, n_ctx, &mut s, &feats, &pos)
            .expect("injected");
        let rows: Vec<usize> = (0..b).collect();
        let full = draft
            .block(&be, &mut kv, n_ctx, &mut s, &tokens, a, &rows)
            .expect("a block")
            .to_vec();
        let want = draft_cols(&full, n_vocab, &d2t);

        let dev = Device::flex();
        let w = net::Weights::new(&shape, &params, &dev, false);
        let ex = net::Example {
            ctx: feats,
            n_ctx: a,
            anchors: vec![a],
            window: None,
            block_embd: tokens
                .iter()
                .flat_map(|&t| {
                    target.embd[t as usize * e..(t as usize + 1) * e]
                        .iter()
                        .copied()
                })
                .collect(),
            targets: Vec::new(),
        };
        let head_rows = target.head_rows(&d2t);
        let head = Tensor::<2>::from_data(TensorData::new(head_rows, [k, e]), &dev);
        let got = host(&net::logits(
            net::forward_hidden(&shape, &w, &ex, &dev),
            &head,
        ));
        let err = nmse(&got, &want);
        assert!(err <= 1e-4, "relative MSE {err}");
    }

    /// A features directory as `specula extract` writes it: `seqs` with random features and
    /// the target's top-1 `next(token)`.
    fn write_features(dir: &Path, target: &Path, seqs: &[Vec<u32>], next: impl Fn(u32) -> u32) {
        let tokens: usize = seqs.iter().map(Vec::len).sum();
        let mut rng = Rng::new(5, 5);
        let rows = normals(&mut rng, tokens * N_TAPS * tiny::N_EMBD, 1.0);
        let top1: Vec<u32> = seqs.iter().flatten().map(|&t| next(t)).collect();
        crate::features::write_test_features(
            dir,
            target,
            tiny::N_EMBD,
            tiny::N_VOCAB,
            &[0, 1, 2],
            seqs,
            &rows,
            &top1,
        );
    }

    /// Tap 0 derived from the ids is, to f16, the layer-0 input the target's own forward
    /// captures, and it is refused when it was neither extracted nor derived.
    #[test]
    fn a_derived_tap_0_is_what_the_target_captures_at_layer_0() {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let (tpath, target, model, be) = tiny_target(dir.path());
        let seqs: Vec<Vec<u32>> = vec![vec![3, 9, 27, 8, 17], vec![31, 250, 2]];
        let fdir = dir.path().join("features");
        write_features(&fdir, &tpath, &seqs, |t| t + 1);
        let mut feats = FeatureSet::open(&fdir).expect("the features open");
        // The shards hold taps 0, 1, 2; read as if only 1 and 2 had been extracted.
        feats.manifest.taps = vec![7, 1, 2];
        let e = feats
            .select_taps(&[0, 2])
            .expect_err("tap 0 is not there yet");
        assert!(e.to_string().contains("tap 0 was not extracted"), "{e}");
        feats.derive_tap0(target.embd.clone(), target.hp.embd_scale.unwrap_or(1.0));
        feats.select_taps(&[0, 2]).expect("tap 0 derived");
        let n = tiny::N_EMBD;
        let mut kv = model
            .new_kv(&be, 16, QType::F32, QType::F32)
            .expect("a cache");
        let mut s = model.scratch(&be);
        let mut taps = specula_models::Taps {
            layers: vec![0],
            rows: Vec::new(),
        };
        let pos: Vec<u32> = (0..5).collect();
        model
            .forward(&be, &mut kv, &mut s, &seqs[0], &pos, &[], Some(&mut taps))
            .expect("a forward");
        let got = feats.features(0).expect("read");
        assert_eq!(got.len(), 5 * 2 * n);
        for (j, row) in got.chunks_exact(2 * n).enumerate() {
            let want: Vec<f32> = taps.rows[0][j * n..(j + 1) * n]
                .iter()
                .map(|&x| f16(x))
                .collect();
            assert_eq!(&row[..n], &want[..], "row {j}");
        }
        // An id past the embedding table is an error, not a panic.
        let e = feats.features(1).expect_err("token 250 of 32");
        assert!(
            e.to_string()
                .contains("outside the target's embedding table"),
            "{e}"
        );
    }

    /// A fresh DFlash run starts its query and key norms at the asked gain, keeps the feature
    /// scales it trains against (a checkpoint carries them), and exports `fc` with them folded.
    #[test]
    fn a_dflash_run_starts_from_its_settings_and_exports_fc_folded() {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let (tpath, target, _, _) = tiny_target(dir.path());
        let seqs: Vec<Vec<u32>> = (0..6u32)
            .map(|k| (0..12).map(|i| (k * 5 + i * 3) % 32).collect())
            .collect();
        let fdir = dir.path().join("features");
        write_features(&fdir, &tpath, &seqs, |t| (t + 1) % 32);
        let feats = FeatureSet::open(&fdir).expect("the features open");
        let mut cfg = dflash::DflashConfig::new(4);
        cfg.draft_vocab = 16;
        cfg.block = 4;
        cfg.anchors = 4;
        cfg.qk_norm_init = 2.5;
        cfg.val_seqs = 1;
        let out = dir.path().join("dflash");
        std::fs::create_dir_all(&out).expect("an output directory");
        let mut run = dflash::Run::start(&cfg, &target, &feats, &out, false).expect("a run");
        let spec = run.shape.params();
        for (p, (name, _)) in run.params.iter().zip(&spec) {
            if name.ends_with("attn_q_norm.weight") || name.ends_with("attn_k_norm.weight") {
                assert!(p.iter().all(|&g| g == 2.5), "{name}");
            }
        }
        assert_eq!(run.feat_scale.len(), run.shape.width());
        assert!(run.feat_scale.iter().all(|&s| s > 0.0 && s.is_finite()));
        let fc = spec.iter().position(|(n, _)| n == "fc.weight").expect("fc");
        let w = run.shape.width();
        let folded = run.export_params();
        for (row, frow) in run.params[fc]
            .chunks_exact(w)
            .zip(folded[fc].chunks_exact(w))
        {
            for ((&x, &f), &s) in row.iter().zip(frow).zip(&run.feat_scale) {
                assert_eq!(f, x / s);
            }
        }
        assert!(
            folded
                .iter()
                .zip(&run.params)
                .enumerate()
                .all(|(i, (a, b))| i == fc || a == b)
        );
        run.train(&target, &feats, &out, Some(2), |_, _| {})
            .expect("two steps");
        let resumed = dflash::Run::start(&cfg, &target, &feats, &out, true).expect("resumed");
        assert_eq!(resumed.feat_scale, run.feat_scale);
        assert_eq!(resumed.params, run.params);
    }

    #[test]
    fn a_run_trains_resumes_as_if_uninterrupted_refuses_other_settings_and_exports() {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let (tpath, target, model, be) = tiny_target(dir.path());
        let next = |t: u32| (5 * t + 3) % to_u32(tiny::N_VOCAB);
        let mut rng = Rng::new(2, 0);
        let seqs: Vec<Vec<u32>> = (0..10)
            .map(|_| {
                let mut t = to_u32(rng.below(tiny::N_VOCAB));
                (0..14 + rng.below(8))
                    .map(|_| {
                        let c = t;
                        t = next(t);
                        c
                    })
                    .collect()
            })
            .collect();
        let fdir = dir.path().join("features");
        write_features(&fdir, &tpath, &seqs, next);
        let feats = FeatureSet::open(&fdir).expect("the features open");

        let mut cfg = Eagle3Config::new(8);
        cfg.draft_vocab = 20;
        cfg.ttt_steps = 2;
        cfg.max_len = 16;
        cfg.checkpoint_every = 4;
        cfg.val_seqs = 2;
        cfg.val_len = 4;
        cfg.val_stride = 3;
        cfg.optim.lr = 1e-2;

        let full = dir.path().join("full");
        let split = dir.path().join("split");
        for d in [&full, &split] {
            std::fs::create_dir_all(d).expect("an output directory");
        }
        let mut a = Eagle3Run::start(&cfg, &target, &feats, &full, false).expect("a run");
        assert_eq!(a.vocab.len(), 20);
        assert_eq!(a.params[HEAD], target.head_rows(&a.vocab.ids()));
        let mut vals = Vec::new();
        a.train(&target, &feats, &full, None, |_, v| vals.extend(v.cloned()))
            .expect("trained");
        assert_eq!(a.step, 8);
        assert_eq!(vals.len(), 2);
        for v in &vals {
            assert_eq!(v.accuracy.len(), 4);
            assert!(v.loss.is_finite() && (1.0..=5.0).contains(&v.tau), "{v:?}");
        }
        assert!(a.steps.iter().all(|s| s.loss.is_finite() && s.loss > 0.0));

        // Stopped at step 3, resumed: the same losses and parameters.
        let mut b = Eagle3Run::start(&cfg, &target, &feats, &split, false).expect("a run");
        b.train(&target, &feats, &split, Some(3), |_, _| {})
            .expect("trained");
        assert_eq!(b.step, 3);
        drop(b);
        let mut b = Eagle3Run::start(&cfg, &target, &feats, &split, true).expect("resumed");
        assert_eq!(b.step, 3);
        b.train(&target, &feats, &split, None, |_, _| {})
            .expect("trained");
        let key = |r: &Eagle3Run| -> Vec<(usize, f32, f32, f32)> {
            r.steps
                .iter()
                .map(|s| (s.step, s.loss, s.lr, s.grad_norm))
                .collect()
        };
        assert_eq!(key(&b), key(&a));
        assert_eq!(b.params, a.params);
        assert_eq!(b.vals, a.vals);

        // Other settings, or a fresh start over a run, are refused.
        let mut other = cfg.clone();
        other.ttt_steps = 3;
        let e = Eagle3Run::start(&other, &target, &feats, &split, true).expect_err("refused");
        assert!(e.to_string().contains("ttt_steps"), "{e}");
        // How often it saves is not a setting of the run.
        let mut every = cfg.clone();
        every.checkpoint_every += 3;
        let c = Eagle3Run::start(&every, &target, &feats, &split, true).expect("resumed");
        assert_eq!(c.params, a.params);
        let e = Eagle3Run::start(&cfg, &target, &feats, &split, false).expect_err("refused");
        assert!(e.to_string().contains("--resume"), "{e}");

        // Every export type loads in specula.
        for ty in [ExportType::F16, ExportType::Q8_0, ExportType::Nvfp4] {
            let path = dir.path().join(format!("eagle3-{ty:?}.gguf"));
            export::write_eagle3(
                &path,
                &a.shape,
                &a.export_params(),
                &a.vocab,
                &target,
                ty,
                "t",
            )
            .expect("exported");
            let file = Arc::new(Gguf::open(&path).expect("a GGUF"));
            let net = Eagle3::load(&be, file, &model).expect("specula loads the trained head");
            assert_eq!(net.feature_width(), a.shape.width());
        }
    }
}
