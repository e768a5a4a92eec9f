//! `llama` (SmolLM2, Llama 2/3): pre-norm attention with RoPE on adjacent pairs, optional Q/K/V
//! biases, a SwiGLU MLP (llama.cpp `src/models/llama.cpp`).

use super::{attention, block, dense};
use crate::Hparams;
use crate::spec::{Act, LayerSpec};

pub(super) fn layers(hp: &Hparams) -> Vec<LayerSpec> {
    (0..hp.n_layer)
        .map(|il| block(attention(hp, il), dense(hp, Act::Silu)))
        .collect()
}
