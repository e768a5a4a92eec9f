//! What each layer of a model computes, described per layer (llama.cpp's `src/models/<arch>.cpp`
//! graphs, as data).
//!
//! A [`LayerSpec`] is a mixer — today attention with its own head counts, head sizes, RoPE,
//! mask, score scale and options — followed by an FFN — dense (a gated MLP) or a mixture of
//! experts — and the norms around them. Each architecture's file in `arch/` turns GGUF
//! metadata into one spec per layer; the loader reads the tensors a spec names, and the forward
//! pass runs a layer from its spec alone, so architectures differ in data, not in branches of
//! the forward. [`LayerSpec::memory`] is what the layer keeps between forwards.

use specula_tensor::{Mask, RecurrentShape, RopeConfig};

/// One layer: mixer, then FFN, each behind a pre-norm and a residual add.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerSpec {
    /// The token mixer.
    pub mixer: MixerSpec,
    /// The feed-forward block.
    pub ffn: FfnSpec,
    /// Gemma's sandwich norms: an RMS norm on the mixer output and on the FFN output, each
    /// before its residual add (`post_attention_norm`, `post_ffw_norm`).
    pub post_norms: bool,
    /// The tensor of the norm before the FFN (`ffn_norm`; Qwen3.5 names it
    /// `post_attention_norm`).
    pub ffn_norm: &'static str,
    /// The layer's output is multiplied by a learned scalar (`layer_output_scale`, Gemma 4).
    pub out_scale: bool,
}

/// The token mixer of a layer.
#[derive(Clone, Debug, PartialEq)]
pub enum MixerSpec {
    /// Softmax attention over a KV cache.
    Attention(AttnSpec),
    /// Gated delta-net linear attention over a recurrent state (Qwen3.5, Qwen3-Next).
    DeltaNet(DeltaNetSpec),
}

/// A gated delta-net mixer (llama.cpp `qwen35.cpp` `build_layer_attn_linear`): `attn_qkv`
/// projects Q, K and V side by side, a causal depthwise convolution (`ssm_conv1d`) and SiLU run
/// over them, Q and K are L2-normalized, and the gated delta rule folds each row into a state
/// per value head with decay `e^{ssm_a · softplus(alpha + dt_bias)}` and strength `σ(beta)`;
/// the output is RMS-normed per head (`ssm_norm`), gated by `silu(attn_gate · x)` and projected
/// by `ssm_out`.
#[derive(Clone, Debug, PartialEq)]
pub struct DeltaNetSpec {
    /// Key heads (`ssm.group_count`).
    pub n_head_k: usize,
    /// Value heads (`ssm.time_step_rank`); value head `h` reads key head `h % n_head_k`, or
    /// `h / (n_head_v / n_head_k)` when [`DeltaNetSpec::grouped`].
    pub n_head_v: usize,
    /// Values per key and value head (`ssm.state_size`).
    pub head_dim: usize,
    /// Taps of the convolution (`ssm.conv_kernel`).
    pub conv_kernel: usize,
    /// The value heads are grouped by key head (Qwen3-Next, Hugging Face's order) rather than
    /// tiled over them (Qwen3.5's converter reorders them).
    pub grouped: bool,
    /// β and α come from one projection `ssm_ba` (per key head, its value heads' β then their
    /// α: Qwen3-Next) rather than `ssm_beta` and `ssm_alpha`.
    pub fused_beta_alpha: bool,
}

impl DeltaNetSpec {
    /// Channels of the convolution: Q, K and V side by side.
    #[must_use]
    pub fn conv_channels(&self) -> usize {
        (2 * self.n_head_k + self.n_head_v) * self.head_dim
    }
}

/// One attention mixer.
#[derive(Clone, Debug, PartialEq)]
pub struct AttnSpec {
    /// Query heads.
    pub n_head: usize,
    /// K/V heads (a divisor of `n_head`: grouped-query attention).
    pub n_head_kv: usize,
    /// Values per query / K head.
    pub head_dim_k: usize,
    /// Values per V head.
    pub head_dim_v: usize,
    /// Rotary embedding of Q and K (kind, rotated dimensions, base, scaling).
    pub rope: RopeConfig,
    /// Which keys a query sees.
    pub mask: Mask,
    /// Score scale.
    pub scale: f32,
    /// Biases on the Q, K and V projections (`attn_q.bias`, …; qwen2).
    pub qkv_bias: bool,
    /// RMS norm per head on Q and K before RoPE (`attn_q_norm`, `attn_k_norm`).
    pub qk_norm: bool,
    /// A gate on the attention output, before `attn_output`.
    pub gate: Option<AttnGate>,
    /// V is the K projection (before K's norm and RoPE) — Gemma 4's global layers have no
    /// `attn_v`.
    pub v_from_k: bool,
    /// An RMS norm without weight on each V head (Gemma 4).
    pub v_norm: bool,
    /// The earlier layer whose K/V this one attends over (Gemma 4's KV-shared layers, E2B /
    /// E4B): it has no K/V projections and writes nothing; `None`: its own.
    pub kv_source: Option<usize>,
}

/// How an attention output is gated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttnGate {
    /// Qwen3.5: `attn_q` projects each head's query followed by its gate; the output is
    /// multiplied by `σ(gate)` element by element.
    QuerySigmoid,
    /// Laguna: `attn_gate` projects the layer's normed input to one value per head or per
    /// element (as the tensor's width says, like llama.cpp: XS / S per head, M per element);
    /// the output is multiplied by `softplus(gate)`.
    Softplus,
}

/// The activation of a gated MLP: `down(act(gate(x)) ⊙ up(x))`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Act {
    /// SiLU (SwiGLU).
    Silu,
    /// tanh-approximated GELU (GeGLU), as ggml computes it.
    GeluTanh,
}

/// The feed-forward block of a layer.
#[derive(Clone, Debug, PartialEq)]
pub enum FfnSpec {
    /// A gated MLP of `n_ff` hidden units (`ffn_gate`, `ffn_up`, `ffn_down`).
    Dense {
        /// Hidden units.
        n_ff: usize,
        /// Activation.
        act: Act,
    },
    /// A mixture of experts.
    Moe(MoeSpec),
    /// Gemma 4: a dense MLP (`ffn_norm` before it, `post_ffw_norm_1` after) and a mixture of
    /// experts (`pre_ffw_norm_2` before, `post_ffw_norm_2` after) side by side, summed; the
    /// router reads the residual stream, RMS-normed without weight, scaled by
    /// `ffn_gate_inp.scale / √n_embd`.
    Parallel {
        /// Hidden units of the dense MLP.
        n_ff: usize,
        /// Activation of both.
        act: Act,
        /// The experts.
        moe: MoeSpec,
    },
}

/// How router logits become expert scores (llama.cpp `expert_gating_func`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gating {
    /// Softmax over all experts (qwen3moe, qwen35moe).
    Softmax,
    /// A sigmoid per expert; with `bias`, the top-k is chosen on the scores plus a learned
    /// correction (`exp_probs_b.bias`) while the weights are the scores themselves (Laguna).
    Sigmoid {
        /// Selection by score plus `exp_probs_b.bias`.
        bias: bool,
    },
}

/// A mixture-of-experts FFN: a router picks `n_used` of `n_expert` gated MLPs per token and sums
/// their outputs weighted by the routing scores (llama.cpp `build_moe_ffn`).
#[derive(Clone, Debug, PartialEq)]
pub struct MoeSpec {
    /// Experts.
    pub n_expert: usize,
    /// Experts each token uses (top-k).
    pub n_used: usize,
    /// Hidden units of each expert.
    pub n_ff: usize,
    /// Router scores.
    pub gating: Gating,
    /// Renormalize the chosen experts' weights to sum to one.
    pub norm_weights: bool,
    /// Factor on the weights after renormalization (`expert_weights_scale`, 1 when absent).
    pub weights_scale: f32,
    /// Expert activation.
    pub act: Act,
    /// An expert every token uses besides the routed ones.
    pub shared: Option<SharedExpert>,
}

/// A shared expert (`ffn_{gate,up,down}_shexp`): a gated MLP added to the routed experts'
/// sum, scaled by `σ(ffn_gate_inp_shexp · x)` when gated (Qwen3.5 MoE).
#[derive(Clone, Debug, PartialEq)]
pub struct SharedExpert {
    /// Hidden units.
    pub n_ff: usize,
    /// Scaled by a sigmoid gate of its own.
    pub gated: bool,
}

/// What a layer keeps between forwards.
#[derive(Clone, Debug, PartialEq)]
pub enum Memory {
    /// K and V of every position it has seen (all of them, or the last ones of a sliding
    /// window when the cache keeps a ring).
    Kv {
        /// K/V heads.
        n_head_kv: usize,
        /// Values per K head.
        head_dim_k: usize,
        /// Values per V head.
        head_dim_v: usize,
        /// The sliding window, when the layer has one (its cache may keep only a ring).
        window: Option<usize>,
    },
    /// A recurrent state of fixed size.
    Recurrent(RecurrentShape),
    /// Nothing: the layer attends over the K/V of an earlier layer (`source`).
    Shared {
        /// The layer that keeps the K/V.
        source: usize,
    },
}

impl LayerSpec {
    /// The layer's attention, if its mixer is one.
    #[must_use]
    pub fn attention(&self) -> Option<&AttnSpec> {
        match &self.mixer {
            MixerSpec::Attention(a) => Some(a),
            MixerSpec::DeltaNet(_) => None,
        }
    }

    /// What the layer keeps between forwards.
    #[must_use]
    pub fn memory(&self) -> Memory {
        match &self.mixer {
            MixerSpec::Attention(AttnSpec {
                kv_source: Some(source),
                ..
            }) => Memory::Shared { source: *source },
            MixerSpec::Attention(a) => Memory::Kv {
                n_head_kv: a.n_head_kv,
                head_dim_k: a.head_dim_k,
                head_dim_v: a.head_dim_v,
                window: match a.mask {
                    Mask::SlidingWindow(w) => Some(w),
                    Mask::Causal | Mask::None => None,
                },
            },
            MixerSpec::DeltaNet(d) => Memory::Recurrent(RecurrentShape {
                conv_kernel: d.conv_kernel,
                conv_channels: d.conv_channels(),
                n_head_k: d.n_head_k,
                n_head_v: d.n_head_v,
                head_dim: d.head_dim,
                grouped: d.grouped,
            }),
        }
    }
}
