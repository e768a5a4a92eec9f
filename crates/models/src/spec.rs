//! What each layer of a model computes, described per layer (llama.cpp's `src/models/<arch>.cpp`
//! graphs, as data).
//!
//! A [`LayerSpec`] is a mixer — today attention with its own head counts, head sizes, RoPE,
//! mask, score scale and options — followed by an FFN — dense (a gated MLP) or a mixture of
//! experts — and the norms around them. Each architecture's file in `arch/` turns GGUF
//! metadata into one spec per layer; the loader reads the tensors a spec names, and the forward
//! pass runs a layer from its spec alone, so architectures differ in data, not in branches of
//! the forward. [`LayerSpec::memory`] is what the layer keeps between forwards.

use specula_tensor::{Mask, RopeConfig};

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
}

/// The token mixer of a layer.
#[derive(Clone, Debug, PartialEq)]
pub enum MixerSpec {
    /// Softmax attention over a KV cache.
    Attention(AttnSpec),
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
}

/// How router logits become expert scores (llama.cpp `expert_gating_func`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gating {
    /// Softmax over all experts (qwen3moe, qwen35moe).
    Softmax,
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
}

impl LayerSpec {
    /// The layer's attention, if its mixer is one.
    #[must_use]
    pub fn attention(&self) -> Option<&AttnSpec> {
        match &self.mixer {
            MixerSpec::Attention(a) => Some(a),
        }
    }

    /// What the layer keeps between forwards.
    #[must_use]
    pub fn memory(&self) -> Memory {
        match &self.mixer {
            MixerSpec::Attention(a) => Memory::Kv {
                n_head_kv: a.n_head_kv,
                head_dim_k: a.head_dim_k,
                head_dim_v: a.head_dim_v,
                window: match a.mask {
                    Mask::SlidingWindow(w) => Some(w),
                    Mask::Causal | Mask::None => None,
                },
            },
        }
    }
}
