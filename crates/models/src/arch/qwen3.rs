//! `qwen3` (Qwen3 dense): NeoX RoPE, an RMS norm per head on Q and K before it, no biases
//! (llama.cpp `src/models/qwen3.cpp`).

use super::{attention, block, dense};
use crate::Hparams;
use crate::spec::{Act, AttnSpec, LayerSpec};

pub(super) fn layers(hp: &Hparams) -> Vec<LayerSpec> {
    (0..hp.n_layer)
        .map(|il| block(qk_normed(hp, il), dense(hp, Act::Silu)))
        .collect()
}

/// Qwen3's attention (shared with `qwen3moe`).
pub(super) fn qk_normed(hp: &Hparams, il: usize) -> AttnSpec {
    AttnSpec {
        qk_norm: true,
        ..attention(hp, il)
    }
}
