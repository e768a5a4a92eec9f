//! Training a DFlash drafter: random anchors, the position-decayed block loss, AdamW.
//!
//! One step takes `seqs_per_step` training sequences at random (the step's own random stream,
//! so a resumed run draws what an uninterrupted one would), puts `anchors` blocks at random
//! positions of each, and minimises DFlash's block loss (`w_k = exp(−(k−1)/γ)` for block row
//! `k ≥ 1`; the anchor row carries no loss) through [`net::loss`]. The labels are the
//! corpus's next tokens, or — when the features carry the target's top logits and
//! [`Labels::Target`] is asked — the target's own greedy choices, which is what a greedy
//! verification accepts.
//!
//! Every `checkpoint_every` steps (and at the end) the run writes `checkpoint.bin` (atomically)
//! and measures the drafter on its validation sequences: per block position, how often its
//! argmax equals the label, and the acceptance length a greedy verify of those blocks would
//! give (`1 +` the run of correct positions from the first, averaged over blocks).

use std::path::Path;
use std::time::Instant;

use burn::tensor::{Device, Tensor, TensorData};
use serde::{Deserialize, Serialize};

use crate::accel::Accel;
use crate::checkpoint::{self, Checkpoint};
use crate::features::FeatureSet;
use crate::net::{self, DraftShape, Example, Weights};
use crate::optim::{self, AdamW, Moments};
use crate::rng::Rng;
use crate::target::Target;
use crate::vocab::DraftVocab;
use crate::{Result, TrainError};

/// What a block row learns to predict.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Labels {
    /// The corpus's next token.
    Corpus,
    /// The target's top-1 next token (needs features extracted with `--top-k`).
    Target,
    /// The target's top-1 next token, on block rows whose prefix from the anchor is the
    /// target's greedy path: row `k` carries a loss only while the corpus tokens after the
    /// anchor equal the target's greedy choices (rows past the first divergence have no
    /// defined label — the target's choice there continues a prefix greedy decoding never
    /// produces, which [`Labels::Target`] trains on anyway). DFlash only; EAGLE-3 reads it as
    /// [`Labels::Target`].
    Greedy,
}

fn one() -> f32 {
    1.0
}

/// Where a DFlash run's parameters start.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum Init {
    /// Small random matrices, unit norms (the DFlash recipe).
    #[default]
    Random,
    /// The copy circuit of [`crate::circuit`]: the anchor row looks its token up in the
    /// context, the block rows draft what the target predicted after it.
    Copy,
}

/// Everything that decides a DFlash training run (saved in its checkpoint; a resume must
/// match it).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DflashConfig {
    /// Draft layers.
    pub n_layer: usize,
    /// Block size `B` (the anchor and `B − 1` MASK rows).
    pub block: usize,
    /// Draft vocabulary size (the most frequent training tokens); 0: the target's whole
    /// vocabulary.
    pub draft_vocab: usize,
    /// Blocks per sequence per step.
    pub anchors: usize,
    /// Sequences per step.
    pub seqs_per_step: usize,
    /// γ of the position decay.
    pub gamma: f32,
    /// The context curriculum: for the first [`DflashConfig::window_steps`] steps a block
    /// sees only the last `window` context positions before its anchor, then every one.
    /// Attention that finds the positions just before the anchor among hundreds of keys is
    /// learnt far faster over a short context first (`net::tests` shows it on a task that
    /// needs exactly that); the drafter then keeps that attention over the full context it
    /// sees at inference. 0: no curriculum.
    #[serde(default)]
    pub window: usize,
    /// Steps of the context curriculum.
    #[serde(default)]
    pub window_steps: usize,
    /// Weight of the anchor row's own loss, relative to block row 1's: the anchor row learns
    /// to predict row 1's token too. At inference the anchor row's logits are never read, but
    /// it is the only block row whose first-layer query carries content (the MASK rows'
    /// queries are one embedding at different positions), so it is where a lookup in the
    /// context by the anchor's token ("what followed this token before") has to happen; the
    /// MASK rows then read it from the anchor row in the next layer. Without a loss of its
    /// own the anchor row learns that lookup only through the next layer's attention to it,
    /// which is near uniform at the start — the two halves of the circuit wait on each other.
    /// 0: no anchor loss (the DFlash recipe).
    #[serde(default)]
    pub anchor_loss: f32,
    /// Initial gain of the per-head query and key norms. With both at `g`, a score is at most
    /// `g² · √head_dim` (unit-RMS heads, perfectly aligned), so at 1 a query cannot put much
    /// more than a tenth of its attention on one key among hundreds unless the gains grow —
    /// and Adam moves them by about the learning rate per step. A lookup of the anchor's
    /// token in the context needs sharp attention from the start.
    #[serde(default = "one")]
    pub qk_norm_init: f32,
    /// Whether `fc` trains on features divided by their columns' RMS (folded into `fc` at
    /// export; see [`crate::features::FeatureSet::column_scales`]).
    #[serde(default)]
    pub standardize: bool,
    /// What the block rows predict.
    pub labels: Labels,
    /// Where the parameters start.
    #[serde(default)]
    pub init: Init,
    /// K/V heads of the draft (a divisor of the target's query heads); `None`: the target's.
    /// More K/V heads widen what one attention layer can carry from the context — the copy
    /// circuit's value path is `K/V heads × head_dim` wide, and the target's prediction needs
    /// more than SmolLM2's 3 × 64 to keep its argmax once a lookup blends a few positions.
    #[serde(default)]
    pub kv_heads: Option<usize>,
    /// The MASK token (default: the target's padding token, else its end of sequence).
    pub mask: Option<u32>,
    /// Every random draw of the run (initialisation, sampling).
    pub seed: u64,
    /// Optimiser and schedule.
    pub optim: AdamW,
    /// Steps between checkpoints (and validations).
    pub checkpoint_every: usize,
    /// Validation sequences held back from training.
    pub val_seqs: usize,
}

impl DflashConfig {
    /// The defaults `specula train dflash` starts from, for `steps` steps.
    #[must_use]
    pub fn new(steps: usize) -> Self {
        Self {
            n_layer: 1,
            block: 16,
            draft_vocab: 8192,
            anchors: 64,
            seqs_per_step: 2,
            gamma: 7.0,
            window: 32,
            window_steps: steps * 3 / 5,
            anchor_loss: 0.0,
            qk_norm_init: 1.0,
            standardize: true,
            labels: Labels::Greedy,
            init: Init::Random,
            kv_heads: None,
            mask: None,
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
        }
    }
}

/// What one step reports.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StepLog {
    /// 0-based step.
    pub step: usize,
    /// Mean block loss of the step.
    pub loss: f32,
    /// Learning rate used.
    pub lr: f32,
    /// Gradient norm before clipping.
    pub grad_norm: f32,
    /// Block rows with a loss per second of this step.
    pub rows_per_s: f32,
}

/// A validation of the drafter.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ValLog {
    /// Steps done when it was taken.
    pub step: usize,
    /// Mean block loss.
    pub loss: f32,
    /// Top-1 accuracy per block position `1..B`.
    pub accuracy: Vec<f32>,
    /// Mean acceptance length of a greedy verify of the validation blocks (bonus included).
    pub tau: f32,
}

/// The state of a run, between steps.
#[derive(Debug)]
pub struct Run {
    /// The run's configuration.
    pub config: DflashConfig,
    /// The drafter's shape.
    pub shape: DraftShape,
    /// The draft vocabulary.
    pub vocab: DraftVocab,
    /// Parameters in [`DraftShape::params`] order.
    pub params: Vec<Vec<f32>>,
    /// AdamW moments per parameter.
    pub moments: Vec<Moments>,
    /// Steps done.
    pub step: usize,
    /// Every step's log.
    pub steps: Vec<StepLog>,
    /// Every validation.
    pub vals: Vec<ValLog>,
    /// sha256 of the target.
    pub target_sha256: String,
    /// What each feature column is divided by before `fc` (empty: nothing).
    pub feat_scale: Vec<f32>,
    /// Where [`Run::train`] computes (not a setting of the run: a checkpoint continues on
    /// either device).
    pub accel: Accel,
}

/// The drafter's shape for `target` under `cfg` (attention as the target's, every dimension
/// rotated).
///
/// # Errors
/// The target's attention is not one a DFlash draft can copy, or there is no MASK token.
pub fn shape_for(target: &Target, taps: &[usize], cfg: &DflashConfig) -> Result<DraftShape> {
    let hp = &target.hp;
    let bad = |d: String| TrainError::Config(d);
    if cfg.n_layer == 0 || cfg.block < 2 {
        return Err(bad(format!(
            "{} layers, block {}: a drafter needs a layer and a block of at least 2",
            cfg.n_layer, cfg.block
        )));
    }
    let mask = cfg.mask.or(target.default_mask).ok_or_else(|| {
        bad("the target names no padding or end-of-sequence token: give --mask-token".into())
    })?;
    if mask as usize >= hp.n_vocab {
        return Err(bad(format!(
            "MASK token {mask} is outside the vocabulary of {}",
            hp.n_vocab
        )));
    }
    let n_head_kv = cfg.kv_heads.unwrap_or(hp.n_head_kv);
    if n_head_kv == 0 || !hp.n_head.is_multiple_of(n_head_kv) {
        return Err(bad(format!(
            "{n_head_kv} K/V heads do not divide the target's {} query heads",
            hp.n_head
        )));
    }
    Ok(DraftShape {
        n_layer: cfg.n_layer,
        n_embd: hp.n_embd,
        n_ff: hp.n_ff,
        n_head: hp.n_head,
        n_head_kv,
        head_dim: hp.head_dim_k,
        rope_base: hp.rope_freq_base,
        rms_eps: hp.rms_eps,
        taps: taps.to_vec(),
        n_embd_target: hp.n_embd,
        block: cfg.block,
        mask,
    })
}

/// Fresh parameters: matrices `N(0, 0.02²)` (output projections scaled by `1/√(2L)`), norms 1.
#[must_use]
pub fn init_params(shape: &DraftShape, seed: u64) -> Vec<Vec<f32>> {
    let mut rng = Rng::new(seed, u64::MAX);
    #[allow(clippy::cast_precision_loss, reason = "layer counts are small")]
    let out_std = 0.02 / (2.0 * shape.n_layer as f64).sqrt();
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

/// Whether a parameter takes weight decay (matrices do, norms do not).
fn decays(shape: &DraftShape) -> Vec<bool> {
    shape.params().iter().map(|(_, d)| d.len() == 2).collect()
}

/// The training and validation sequence indices: every `stride`-th sequence is held back.
#[must_use]
pub fn split(n: usize, val: usize) -> (Vec<usize>, Vec<usize>) {
    if val == 0 || n < 2 {
        return ((0..n).collect(), Vec::new());
    }
    let val = val.min(n / 2).max(1);
    let stride = n / val;
    (0..n).partition(|i| i % stride != stride - 1)
}

/// One sequence, read for training.
struct Seq {
    ids: Vec<u32>,
    /// `labels[p]`: the token position `p` should be followed by.
    labels: Vec<Option<u32>>,
}

impl Seq {
    /// Whether the corpus tokens after anchor `a` up to row `k − 1` are the target's greedy
    /// choices (row `k`'s label then continues the greedy path).
    fn greedy_at(&self, a: usize, k: usize) -> bool {
        (1..k)
            .all(|j| self.labels.get(a + j - 1).copied().flatten() == self.ids.get(a + j).copied())
    }
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

/// The blocks at `anchors` of sequence `i` as one example.
#[allow(clippy::too_many_arguments, reason = "one example's inputs")]
fn example(
    feats: &FeatureSet,
    i: usize,
    anchors: Vec<usize>,
    window: Option<usize>,
    shape: &DraftShape,
    target: &Target,
    vocab: &DraftVocab,
    cfg: &DflashConfig,
    scale: &[f32],
) -> Result<Example> {
    let seq = read_seq(feats, i, cfg.labels)?;
    let all = feats.features(i)?;
    let n_ctx = anchors.iter().copied().max().unwrap_or(0).max(1);
    let w = shape.width();
    let mut ctx = all[..n_ctx * w].to_vec();
    crate::features::divide_columns(&mut ctx, scale);
    let e = shape.n_embd;
    let b = shape.block;
    let row = |t: u32| &target.embd[t as usize * e..(t as usize + 1) * e];
    let mut block_embd = Vec::with_capacity(anchors.len() * b * e);
    for &a in &anchors {
        block_embd.extend_from_slice(row(seq.ids[a]));
        for _ in 1..b {
            block_embd.extend_from_slice(row(shape.mask));
        }
    }
    let targets = block_targets(&seq, &anchors, b, vocab, cfg);
    Ok(Example {
        ctx,
        n_ctx,
        anchors,
        window,
        block_embd,
        targets,
    })
}

/// The loss rows of blocks of `b` rows at `anchors`: (row in the blocks, draft-vocabulary
/// target, weight).
fn block_targets(
    seq: &Seq,
    anchors: &[usize],
    b: usize,
    vocab: &DraftVocab,
    cfg: &DflashConfig,
) -> Vec<(usize, usize, f32)> {
    let mut targets = Vec::new();
    for (bi, &a) in anchors.iter().enumerate() {
        for k in 1..b {
            // Row k stands at position a + k and predicts that position's token: the label
            // of position a + k − 1.
            let Some(Some(label)) = seq.labels.get(a + k - 1) else {
                break;
            };
            if cfg.labels == Labels::Greedy && !seq.greedy_at(a, k) {
                break;
            }
            if let Some(d) = vocab.draft_id(*label) {
                #[allow(clippy::cast_precision_loss, reason = "block positions are small")]
                let weight = (-((k - 1) as f32) / cfg.gamma).exp();
                targets.push((bi * b + k, d, weight));
                if k == 1 && cfg.anchor_loss > 0.0 {
                    targets.push((bi * b, d, cfg.anchor_loss));
                }
            }
        }
    }
    targets
}

/// `count` distinct random anchors in `1..len − 1`, sorted.
fn random_anchors(rng: &mut Rng, len: usize, count: usize) -> Vec<usize> {
    if len < 3 {
        return Vec::new();
    }
    let span = len - 2;
    let mut picked: Vec<usize> = Vec::with_capacity(count.min(span));
    if count >= span {
        picked.extend(1..=span);
    } else {
        while picked.len() < count {
            let a = 1 + rng.below(span);
            if !picked.contains(&a) {
                picked.push(a);
            }
        }
        picked.sort_unstable();
    }
    picked
}

fn host(t: &Tensor<2>) -> Vec<f32> {
    t.to_data().try_to_vec::<f32>().unwrap_or_default()
}

impl Run {
    /// A fresh run, or the one `out`'s checkpoint holds (`resume`: which must match `cfg`,
    /// the target and the features).
    ///
    /// # Errors
    /// A checkpoint of another run, an unreadable one, or a configuration the target cannot
    /// take.
    pub fn start(
        cfg: &DflashConfig,
        target: &Target,
        feats: &FeatureSet,
        out: &Path,
        resume: bool,
    ) -> Result<Self> {
        let shape = shape_for(target, &feats.taps, cfg)?;
        if feats.manifest.target.sha256 != target.sha256 {
            return Err(TrainError::Config(format!(
                "the features are of target sha256 {}, this target is {}",
                feats.manifest.target.sha256, target.sha256
            )));
        }
        let ckpt = out.join(checkpoint::FILE);
        if resume && ckpt.exists() {
            let c = Checkpoint::read(&ckpt)?;
            c.check(cfg, &shape, &target.sha256)?;
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
        let (train, _) = split(feats.len(), cfg.val_seqs);
        let mut counts = vec![0u64; target.hp.n_vocab];
        for &i in &train {
            for t in read_seq(feats, i, cfg.labels)?.labels.into_iter().flatten() {
                if let Some(c) = counts.get_mut(t as usize) {
                    *c += 1;
                }
            }
        }
        let vocab = DraftVocab::most_frequent(&counts, cfg.draft_vocab);
        let feat_scale = if cfg.standardize {
            feats.column_scales(&train)?
        } else {
            Vec::new()
        };
        let mut params = init_params(&shape, cfg.seed);
        for (p, (name, _)) in params.iter_mut().zip(shape.params()) {
            if name.ends_with("attn_q_norm.weight") || name.ends_with("attn_k_norm.weight") {
                p.fill(cfg.qk_norm_init);
            }
        }
        if let Some(norm) = &target.output_norm {
            let at = shape
                .params()
                .iter()
                .position(|(n, _)| n == "output_norm.weight");
            if let Some(p) = at.and_then(|i| params.get_mut(i)) {
                p.clone_from(norm);
            }
        }
        if cfg.init == Init::Copy {
            crate::circuit::copy_init(
                &shape,
                target,
                feats,
                &train,
                &feat_scale,
                cfg.seed,
                &mut params,
            )?;
        }
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

    /// The frozen head rows of the draft vocabulary.
    fn head(&self, target: &Target, dev: &Device) -> Tensor<2> {
        let ids = self.vocab.ids();
        let rows = target.head_rows(&ids);
        Tensor::from_data(TensorData::new(rows, [ids.len(), self.shape.n_embd]), dev)
    }

    /// Runs steps until `self.config.optim.steps` (or, when given, until step `stop_at`, where
    /// it checkpoints: a later [`Run::start`] with `resume` continues as if it had not
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
        let head = self.head(target, &dev);
        let (train, val) = split(feats.len(), self.config.val_seqs);
        if train.is_empty() {
            return Err(TrainError::Config("no training sequences".into()));
        }
        let decay = decays(&self.shape);
        let cfg = self.config.clone();
        let end = stop_at.map_or(cfg.optim.steps, |s| s.min(cfg.optim.steps));
        if cfg.optim.steps == 0 && self.vals.is_empty() {
            // No steps: the draft as its initialisation built it, validated once.
            if let Some(v) = self.validate(target, feats, &val, &dev)? {
                self.vals.push(v);
            }
            checkpoint::write(&out.join(checkpoint::FILE), &self.snapshot())?;
        }
        while self.step < end {
            let t0 = Instant::now();
            let mut rng = Rng::new(cfg.seed, self.step as u64);
            let mut examples = Vec::with_capacity(cfg.seqs_per_step);
            for _ in 0..cfg.seqs_per_step {
                let i = train[rng.below(train.len())];
                let anchors = random_anchors(&mut rng, feats.seq_len(i), cfg.anchors);
                if anchors.is_empty() {
                    continue;
                }
                let window = (self.step < cfg.window_steps && cfg.window > 0).then_some(cfg.window);
                let ex = example(
                    feats,
                    i,
                    anchors,
                    window,
                    &self.shape,
                    target,
                    &self.vocab,
                    &cfg,
                    &self.feat_scale,
                )?;
                if !ex.targets.is_empty() {
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
                    let l = net::loss(&self.shape, &w, &head, ex, &dev).mul_scalar(inv);
                    total = Some(match total {
                        Some(t) => t + l,
                        None => l,
                    });
                }
                let total = total.unwrap_or_else(|| Tensor::zeros([1], &dev));
                let loss = total
                    .to_data()
                    .try_to_vec::<f32>()
                    .ok()
                    .and_then(|v| v.first().copied())
                    .unwrap_or(f32::NAN);
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

    fn snapshot(&self) -> Checkpoint {
        Checkpoint {
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

    /// The parameters as the drafter's file holds them: `fc` takes raw features (the
    /// feature scales folded into its columns).
    #[must_use]
    pub fn export_params(&self) -> Vec<Vec<f32>> {
        crate::features::fold_scales(&self.shape.params(), &self.params, &self.feat_scale)
    }

    /// The drafter on the validation sequences: blocks every `B` positions.
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
        let head = self.head(target, &inner);
        let b = self.shape.block;
        let mut hits = vec![0u64; b - 1];
        let mut seen = vec![0u64; b - 1];
        let (mut accepted, mut blocks) = (0u64, 0u64);
        let (mut loss_sum, mut loss_n) = (0f64, 0u64);
        for &i in val {
            let len = feats.seq_len(i);
            if len < 3 {
                continue;
            }
            let anchors: Vec<usize> = (1..len - 1).step_by(b).collect();
            let ex = example(
                feats,
                i,
                anchors.clone(),
                None,
                &self.shape,
                target,
                &self.vocab,
                &self.config,
                &self.feat_scale,
            )?;
            let seq = read_seq(feats, i, self.config.labels)?;
            let hidden = net::forward_hidden(&self.shape, &w, &ex, &inner);
            let logits = net::logits(hidden, &head);
            let [rows, k] = logits.dims();
            let data = logits.to_data().try_to_vec::<f32>().unwrap_or_default();
            for (bi, &a) in anchors.iter().enumerate() {
                let mut run = true;
                let mut got = 0u64;
                for kk in 1..b {
                    let Some(Some(label)) = seq.labels.get(a + kk - 1) else {
                        break;
                    };
                    if self.config.labels == Labels::Greedy && !seq.greedy_at(a, kk) {
                        break;
                    }
                    let r = bi * b + kk;
                    if r >= rows {
                        break;
                    }
                    let row = &data[r * k..(r + 1) * k];
                    let arg = argmax(row);
                    let ok = self.vocab.draft_id(*label) == Some(arg);
                    seen[kk - 1] += 1;
                    if ok {
                        hits[kk - 1] += 1;
                    }
                    if run && ok {
                        got += 1;
                    } else {
                        run = false;
                    }
                    if let Some(d) = self.vocab.draft_id(*label) {
                        loss_sum += f64::from(log_sum_exp(row) - row[d]);
                        loss_n += 1;
                    }
                }
                accepted += got;
                blocks += 1;
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
            tau: 1.0 + ratio(accepted, blocks),
        }))
    }
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

fn log_sum_exp(row: &[f32]) -> f32 {
    let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    m + row.iter().map(|&x| (x - m).exp()).sum::<f32>().ln()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn anchors_are_distinct_sorted_and_leave_room_for_a_label() {
        let mut rng = Rng::new(3, 0);
        for len in [3, 5, 40, 512] {
            let a = random_anchors(&mut rng, len, 16);
            assert!(a.windows(2).all(|w| w[0] < w[1]), "{a:?}");
            assert!(a.iter().all(|&x| x >= 1 && x + 1 < len), "{len}: {a:?}");
            assert_eq!(a.len(), 16.min(len - 2));
        }
        assert!(random_anchors(&mut rng, 2, 4).is_empty());
    }

    #[test]
    fn greedy_rows_stop_where_the_corpus_leaves_the_greedy_path() {
        // Corpus 5 6 7 8 9; the target's choices after each: 6 7 1 9 2.
        let seq = Seq {
            ids: vec![5, 6, 7, 8, 9],
            labels: [6, 7, 1, 9, 2].map(Some).to_vec(),
        };
        // From anchor 0: rows 1 and 2 follow 6, 7 (greedy); row 3 would follow 8, not 1.
        assert!(seq.greedy_at(0, 1) && seq.greedy_at(0, 2) && seq.greedy_at(0, 3));
        assert!(!seq.greedy_at(0, 4));
        // From anchor 2: its first row is always on the path, the second follows 8 ≠ 1.
        assert!(seq.greedy_at(2, 1) && !seq.greedy_at(2, 2));
    }

    #[test]
    fn the_anchor_row_learns_row_one_s_token_when_asked() {
        // Corpus 5 6 7 8 9 on the greedy path; blocks of 4 at anchors 0 and 2.
        let seq = Seq {
            ids: vec![5, 6, 7, 8, 9],
            labels: [6, 7, 8, 9, 2].map(Some).to_vec(),
        };
        let vocab = DraftVocab::from_ids((0..10).collect(), 10);
        let mut cfg = DflashConfig::new(10);
        cfg.gamma = 1.0;
        let plain = block_targets(&seq, &[0, 2], 4, &vocab, &cfg);
        let (d2, d3) = ((-1f32).exp(), (-2f32).exp());
        assert_eq!(
            plain,
            vec![
                (1, 6, 1.0),
                (2, 7, d2),
                (3, 8, d3),
                (5, 8, 1.0),
                (6, 9, d2),
                (7, 2, d3),
            ]
        );
        cfg.anchor_loss = 0.5;
        let with = block_targets(&seq, &[0, 2], 4, &vocab, &cfg);
        assert_eq!(with.len(), plain.len() + 2);
        // Rows 0 and 4 are the anchors: each learns its row 1's token, at the given weight.
        assert!(with.contains(&(0, 6, 0.5)) && with.contains(&(4, 8, 0.5)));
        assert!(plain.iter().all(|t| with.contains(t)));
    }

    #[test]
    fn validation_sequences_are_spread_and_disjoint() {
        let (t, v) = split(100, 10);
        assert_eq!(v, (0..10).map(|i| 10 * i + 9).collect::<Vec<_>>());
        assert_eq!(t.len(), 90);
        assert!(t.iter().all(|i| !v.contains(i)));
        let (t, v) = split(3, 16);
        assert_eq!((t.len(), v.len()), (2, 1));
        assert_eq!(split(1, 4), (vec![0], vec![]));
    }
}
