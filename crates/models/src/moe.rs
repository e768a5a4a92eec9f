//! Mixture-of-experts FFN: the router, top-k selection, and the experts over each row's
//! choices, all on the backend.
//!
//! For a batch of `n` rows, the router's logits `[n, n_expert]` are routed where they are
//! ([`Backend::moe_route`]): each row's scores (softmax or sigmoid), its top `n_used` experts
//! and their weights (renormalized, scaled), in f32. The experts' MLPs then run over the
//! routing ([`Backend::moe_ffn`]): by default each projection over the `n · n_used` (row,
//! expert) pairs ([`Backend::matmul_id`]) and each row's expert outputs added, weighted, in
//! increasing expert order ([`Backend::moe_combine`]). A backend groups the pairs by expert so
//! a prefill batch costs one matmul per used expert and projection, not one per token (the
//! CPU backend runs each expert's whole MLP over its rows), and a device reads a decode
//! step's experts by id without the routing reaching the host.
//!
//! A row's result depends only on the row: its scores, its experts and their weights are its
//! own, the matmul kernels give a row the bits it would have alone, and its expert outputs are
//! added in expert order whatever else is in the batch (batch invariance, so speculation and
//! continuous batching stay lossless).

use specula_gguf::Metadata;
use specula_tensor::{Backend, MoeExperts, MoeRoute};

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

/// The weights of a mixture-of-experts FFN.
#[derive(Debug)]
pub(crate) struct MoeWeights<W> {
    /// `ffn_gate_inp`: `[n_embd] → [n_expert]` router logits.
    pub(crate) router: Linear<W>,
    /// `exp_probs_b.bias`: the selection's correction per expert ([`Gating::Sigmoid`]).
    pub(crate) bias: Option<W>,
    /// Each expert's projections, by expert id: views of the stacked tensors
    /// ([`Backend::weight_views`]), which [`Backend::matmul_id`] reads by id.
    pub(crate) gate: Experts<W>,
    pub(crate) up: Experts<W>,
    pub(crate) down: Experts<W>,
    pub(crate) shared: Option<SharedWeights<W>>,
}

/// One projection of every expert, and its per-expert scales where the file has them.
#[derive(Debug)]
pub(crate) struct Experts<W> {
    pub(crate) w: Vec<W>,
    pub(crate) scales: Option<Vec<f32>>,
}

/// A shared expert and its optional gate (`ffn_gate_inp_shexp`, `[n_embd] → [1]`).
#[derive(Debug)]
pub(crate) struct SharedWeights<W> {
    pub(crate) gate: Linear<W>,
    pub(crate) up: Linear<W>,
    pub(crate) down: Linear<W>,
    pub(crate) gate_inp: Option<W>,
}

/// Buffers of one MoE FFN call.
#[derive(Debug)]
pub(crate) struct MoeScratch<B: Backend> {
    logits: B::Tensor,
    routes: B::Routes,
    gate: B::Tensor,
    up: B::Tensor,
    act: B::Tensor,
    y: B::Tensor,
}

impl<B: Backend> MoeScratch<B> {
    pub(crate) fn new(be: &B) -> Self {
        let z = || be.zeros(0, 0);
        Self {
            logits: z(),
            routes: be.routes(),
            gate: z(),
            up: z(),
            act: z(),
            y: z(),
        }
    }
}

/// The routing a spec asks for.
fn route(spec: &MoeSpec) -> MoeRoute {
    MoeRoute {
        n_used: spec.n_used,
        sigmoid: matches!(spec.gating, Gating::Sigmoid { .. }),
        norm: spec.norm_weights,
        scale: spec.weights_scale,
    }
}

/// `out = MoE(x)` for every row of `x` (`[n, n_embd]`), routed on `router_in` (Gemma 4's
/// router reads another input than its experts), else on `x`. Everything stays on the
/// backend: the routing, the experts over each row's pairs, their weighted sum.
pub(crate) fn forward<B: Backend>(
    be: &B,
    spec: &MoeSpec,
    w: &MoeWeights<B::Weight>,
    x: &B::Tensor,
    router_in: Option<&B::Tensor>,
    s: &mut MoeScratch<B>,
    out: &mut B::Tensor,
) {
    w.router.matmul(be, router_in.unwrap_or(x), &mut s.logits);
    be.moe_route(&s.logits, &route(spec), w.bias.as_ref(), &mut s.routes);
    let experts = MoeExperts {
        gate: &w.gate.w,
        up: &w.up.w,
        down: &w.down.w,
        gate_scales: w.gate.scales.as_deref(),
        up_scales: w.up.scales.as_deref(),
        down_scales: w.down.scales.as_deref(),
        geglu: matches!(spec.act, Act::GeluTanh),
    };
    be.moe_ffn(x, &experts, &s.routes, out);
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
