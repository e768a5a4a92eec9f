//! `qwen2` (Qwen2.5): llama's block with NeoX RoPE and biases on Q, K and V (llama.cpp
//! `src/models/qwen2.cpp`).

use super::{attention, block, dense};
use crate::Hparams;
use crate::spec::{Act, AttnSpec, LayerSpec};

pub(super) fn layers(hp: &Hparams) -> Vec<LayerSpec> {
    (0..hp.n_layer)
        .map(|il| {
            let attn = AttnSpec {
                qkv_bias: true,
                ..attention(hp, il)
            };
            block(attn, dense(hp, Act::Silu))
        })
        .collect()
}
