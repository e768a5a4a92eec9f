//! Mixture-of-experts FFN: the router, top-k selection, and the experts run grouped by expert.
//!
//! For a batch of `n` rows, the router's logits `[n, n_expert]` come to the host, where each
//! row's scores (softmax), its top `n_used` experts and their weights (renormalized, scaled)
//! are computed in f32. The rows are then grouped by expert: each expert with at least one row
//! gathers its rows ([`Backend::copy_rows`]), runs its gated MLP over them as one matmul per
//! projection, and adds its output, weighted, to those rows ([`Backend::add_rows_scaled`]).
//! A prefill batch thus costs one matmul per used expert and projection, not one per token.
//!
//! A row's result depends only on the row: its scores, its experts and their weights are its
//! own, the matmul kernels give a row the bits it would have alone, and its expert outputs are
//! added in expert order whatever else is in the batch (batch invariance, so speculation and
//! continuous batching stay lossless).

use specula_gguf::Metadata;
use specula_tensor::Backend;

use crate::hparams::per_layer;
use crate::spec::{Act, Gating, MoeSpec};
use crate::{Hparams, Linear, ModelError, Result, count, int_bound, scale_f32};

/// llama.cpp's `LLAMA_MAX_EXPERTS`.
const MAX_EXPERTS: usize = 1024;

/// The expert keys of `<arch>.*`: `expert_count`, `expert_used_count` and
/// `expert_feed_forward_length` (each of the last two one value or one per layer, as
/// llama.cpp's `get_key_or_arr` reads them), `expert_weights_scale`.
pub(crate) struct ExpertKeys {
    n_expert: usize,
    n_used: Vec<usize>,
    n_ff: Vec<usize>,
    weights_scale: f32,
    /// `expert_weights_norm`, when the file has it.
    pub(crate) weights_norm: Option<bool>,
    /// `expert_gating_func` (1 softmax, 2 sigmoid), when the file has it.
    pub(crate) gating_func: Option<usize>,
}

impl ExpertKeys {
    pub(crate) fn read(md: &Metadata, hp: &Hparams) -> Result<Self> {
        let a = hp.arch.name();
        let k = |s: &str| format!("{a}.{s}");
        let n_expert = count(md, &k("expert_count"))?;
        if n_expert > MAX_EXPERTS {
            return Err(int_bound(
                &k("expert_count"),
                n_expert,
                format!("at most {MAX_EXPERTS} (llama.cpp's LLAMA_MAX_EXPERTS)"),
            ));
        }
        let n_used = per_layer(md, &k("expert_used_count"), hp.n_layer)?.ok_or_else(|| {
            ModelError::MissingKey {
                key: k("expert_used_count"),
            }
        })?;
        if let Some(&bad) = n_used.iter().find(|&&u| u == 0 || u > n_expert) {
            return Err(int_bound(
                &k("expert_used_count"),
                bad,
                format!("in 1..={n_expert} (`{}`)", k("expert_count")),
            ));
        }
        // Without the key, llama.cpp sizes an expert as `feed_forward_length / n_used`.
        let n_ff = match per_layer(md, &k("expert_feed_forward_length"), hp.n_layer)? {
            Some(v) => v,
            None => n_used.iter().map(|&u| hp.n_ff / u).collect(),
        };
        if let Some(&bad) = n_ff.iter().find(|&&f| f == 0) {
            return Err(int_bound(
                &k("expert_feed_forward_length"),
                bad,
                "at least 1",
            ));
        }
        let weights_scale = match scale_f32(md, &k("expert_weights_scale"))? {
            // 0 (and absent) mean no scaling, as in `build_moe_ffn`.
            None => 1.0,
            Some(0.0) => 1.0,
            Some(s) => s,
        };
        let norm_key = k("expert_weights_norm");
        let weights_norm = match md.get(&norm_key) {
            None => None,
            Some(specula_gguf::Value::Bool(b)) => Some(*b),
            Some(v) => {
                return Err(ModelError::HparamType {
                    key: norm_key,
                    found: format!("{:?}", v.value_type()),
                    expected: "a bool",
                });
            }
        };
        let gating_func = crate::opt_usize(md, &k("expert_gating_func"))?;
        if let Some(g) = gating_func
            && !(1..=2).contains(&g)
        {
            return Err(int_bound(
                &k("expert_gating_func"),
                g,
                "1 (softmax) or 2 (sigmoid)",
            ));
        }
        Ok(Self {
            n_expert,
            n_used,
            n_ff,
            weights_scale,
            weights_norm,
            gating_func,
        })
    }

    /// The MoE of layer `il`.
    pub(crate) fn spec(&self, il: usize, gating: Gating, norm_weights: bool, act: Act) -> MoeSpec {
        MoeSpec {
            n_expert: self.n_expert,
            n_used: self.n_used[il],
            n_ff: self.n_ff[il],
            gating,
            norm_weights,
            weights_scale: self.weights_scale,
            act,
            shared: None,
        }
    }
}

/// One expert's gated MLP.
#[derive(Debug)]
pub(crate) struct Expert<W> {
    pub(crate) gate: Linear<W>,
    pub(crate) up: Linear<W>,
    pub(crate) down: Linear<W>,
}

/// The weights of a mixture-of-experts FFN.
#[derive(Debug)]
pub(crate) struct MoeWeights<W> {
    /// `ffn_gate_inp`: `[n_embd] → [n_expert]` router logits.
    pub(crate) router: Linear<W>,
    /// `exp_probs_b.bias`: the selection's correction per expert ([`Gating::Sigmoid`]), on
    /// the host where the routing runs.
    pub(crate) bias: Option<Vec<f32>>,
    pub(crate) experts: Vec<Expert<W>>,
    pub(crate) shared: Option<SharedWeights<W>>,
}

/// A shared expert and its optional gate (`ffn_gate_inp_shexp`, `[n_embd] → [1]`).
#[derive(Debug)]
pub(crate) struct SharedWeights<W> {
    pub(crate) gate: Linear<W>,
    pub(crate) up: Linear<W>,
    pub(crate) down: Linear<W>,
    pub(crate) gate_inp: Option<W>,
}

/// The routing of one batch: for each expert, the rows that chose it and their weights, rows in
/// increasing order.
#[derive(Debug, Default)]
pub(crate) struct Routing {
    rows: Vec<Vec<usize>>,
    weights: Vec<Vec<f32>>,
    /// One row's scores, and its experts by decreasing score.
    probs: Vec<f32>,
    order: Vec<usize>,
}

impl Routing {
    /// Routes the `n = logits.len() / n_expert` rows of `logits` (row-major router logits).
    pub(crate) fn route(&mut self, spec: &MoeSpec, logits: &[f32], bias: Option<&[f32]>) {
        let ne = spec.n_expert;
        self.rows.resize_with(ne, Vec::new);
        self.weights.resize_with(ne, Vec::new);
        for (r, w) in self.rows.iter_mut().zip(&mut self.weights) {
            r.clear();
            w.clear();
        }
        for (row, x) in logits.chunks_exact(ne).enumerate() {
            self.probs.clear();
            match spec.gating {
                Gating::Softmax => {
                    let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    self.probs.extend(x.iter().map(|&v| (v - m).exp()));
                    let sum: f32 = self.probs.iter().sum();
                    let inv = 1.0 / sum;
                    for p in &mut self.probs {
                        *p *= inv;
                    }
                }
                Gating::Sigmoid { .. } => {
                    self.probs
                        .extend(x.iter().map(|&v| 1.0 / (1.0 + (-v).exp())));
                }
            }
            self.order.clear();
            self.order.extend(0..ne);
            // Decreasing selection score (the score, plus the correction where there is one);
            // equal ones keep the lower expert first.
            let probs = &self.probs;
            let sel = |e: usize| probs[e] + bias.map_or(0.0, |b| b[e]);
            self.order
                .sort_by(|&a, &b| sel(b).total_cmp(&sel(a)).then(a.cmp(&b)));
            let chosen = &self.order[..spec.n_used];
            let mut sum = 0.0f32;
            for &e in chosen {
                sum += probs[e];
            }
            for &e in chosen {
                let mut w = probs[e];
                if spec.norm_weights {
                    w /= sum;
                }
                w *= spec.weights_scale;
                self.rows[e].push(row);
                self.weights[e].push(w);
            }
        }
    }
}

/// Buffers of one MoE FFN call.
#[derive(Debug)]
pub(crate) struct MoeScratch<B: Backend> {
    logits: B::Tensor,
    host: Vec<f32>,
    x: B::Tensor,
    gate: B::Tensor,
    up: B::Tensor,
    act: B::Tensor,
    y: B::Tensor,
    routing: Routing,
    /// One expert's rows as an index tensor, and where it is staged.
    rows: B::Index,
    stage: Vec<u32>,
}

impl<B: Backend> MoeScratch<B> {
    pub(crate) fn new(be: &B) -> Self {
        let z = || be.zeros(0, 0);
        Self {
            logits: z(),
            host: Vec::new(),
            x: z(),
            gate: z(),
            up: z(),
            act: z(),
            y: z(),
            routing: Routing::default(),
            rows: be.index(&[]),
            stage: Vec::new(),
        }
    }
}

/// `out = MoE(x)` for every row of `x` (`[n, n_embd]`), routed on `router_in` (Gemma 4's
/// router reads another input than its experts), else on `x`.
pub(crate) fn forward<B: Backend>(
    be: &B,
    spec: &MoeSpec,
    w: &MoeWeights<B::Weight>,
    x: &B::Tensor,
    router_in: Option<&B::Tensor>,
    s: &mut MoeScratch<B>,
    out: &mut B::Tensor,
) {
    let (n, cols) = be.shape(x);
    w.router.matmul(be, router_in.unwrap_or(x), &mut s.logits);
    be.to_host(&s.logits, &mut s.host);
    s.routing.route(spec, &s.host, w.bias.as_deref());
    *out = be.zeros(n, cols);
    for (e, expert) in w.experts.iter().enumerate() {
        let rows = &s.routing.rows[e];
        if rows.is_empty() {
            continue;
        }
        let at = crate::index::index_of;
        crate::index::stage(be, &mut s.rows, &mut s.stage, rows.iter().map(|&r| at(r)));
        be.copy_rows(x, &s.rows, &mut s.x);
        expert.gate.matmul(be, &s.x, &mut s.gate);
        expert.up.matmul(be, &s.x, &mut s.up);
        match spec.act {
            Act::Silu => be.swiglu(&s.gate, &s.up, &mut s.act),
            Act::GeluTanh => be.geglu(&s.gate, &s.up, &mut s.act),
        }
        expert.down.matmul(be, &s.act, &mut s.y);
        be.add_rows_scaled(out, &s.rows, &s.y, &s.routing.weights[e]);
    }
    if let Some(sh) = &w.shared {
        sh.gate.matmul(be, x, &mut s.gate);
        sh.up.matmul(be, x, &mut s.up);
        match spec.act {
            Act::Silu => be.swiglu(&s.gate, &s.up, &mut s.act),
            Act::GeluTanh => be.geglu(&s.gate, &s.up, &mut s.act),
        }
        sh.down.matmul(be, &s.act, &mut s.y);
        if let Some(g) = &sh.gate_inp {
            be.matmul(x, g, &mut s.logits);
            be.gate_mul(&mut s.y, &s.logits, specula_tensor::GateAct::Sigmoid);
        }
        be.add(out, &s.y);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(n_used: usize, norm: bool) -> MoeSpec {
        MoeSpec {
            n_expert: 4,
            n_used,
            n_ff: 1,
            gating: Gating::Softmax,
            norm_weights: norm,
            weights_scale: 1.0,
            act: Act::Silu,
            shared: None,
        }
    }

    /// Top-2 of a softmax, renormalized: the two largest logits win, their weights are their
    /// softmax shares of the pair (`e^a / (e^a + e^b)`), and each row is routed on its own.
    #[test]
    fn top_k_softmax_renormalized() {
        let mut r = Routing::default();
        let logits = [0.0, 2.0, 1.0, -1.0, /* row 1 */ 3.0, 3.0, 0.0, 0.0];
        r.route(&spec(2, true), &logits, None);
        assert_eq!(r.rows, [vec![1], vec![0, 1], vec![0], vec![]]);
        let w1 = 1.0 / (1.0 + (-1.0f32).exp());
        assert!((r.weights[1][0] - w1).abs() < 1e-6);
        assert!((r.weights[2][0] - (1.0 - w1)).abs() < 1e-6);
        // Equal logits: equal weights, the lower expert first.
        assert!((r.weights[0][0] - 0.5).abs() < 1e-6 && (r.weights[1][1] - 0.5).abs() < 1e-6);
        // Without renormalization the weights are the softmax scores over all experts.
        r.route(&spec(1, false), &logits[..4], None);
        let z: f32 = logits[..4].iter().map(|v| v.exp()).sum();
        assert!((r.weights[1][0] - 2.0f32.exp() / z).abs() < 1e-6);
    }

    /// Sigmoid routing with a correction bias: the bias moves the choice, not the weights.
    #[test]
    fn a_correction_bias_chooses_but_does_not_weigh() {
        let mut r = Routing::default();
        let mut sp = spec(1, false);
        sp.gating = Gating::Sigmoid { bias: true };
        let logits = [2.0, 0.0, 1.0, -1.0];
        r.route(&sp, &logits, Some(&[0.0, 0.0, 0.0, 5.0]));
        assert_eq!(r.rows, [vec![], vec![], vec![], vec![0]]);
        let s = 1.0 / (1.0 + 1.0f32.exp());
        assert!((r.weights[3][0] - s).abs() < 1e-6);
        r.route(&sp, &logits, None);
        assert_eq!(r.rows[0], vec![0]);
    }
}
