//! `gemma3` (Gemma 3 text): embeddings scaled by `√n_embd` (model-wide, [`Hparams`]), QK-norm,
//! sandwich norms around attention and FFN, a GELU-gated MLP, sliding-window layers with their
//! own RoPE base (llama.cpp `src/models/gemma3.cpp`).

use super::{attention, dense};
use crate::Hparams;
use crate::spec::{Act, AttnSpec, LayerSpec, MixerSpec};

pub(super) fn layers(hp: &Hparams) -> Vec<LayerSpec> {
    (0..hp.n_layer)
        .map(|il| LayerSpec {
            mixer: MixerSpec::Attention(AttnSpec {
                qk_norm: true,
                ..attention(hp, il)
            }),
            ffn: dense(hp, Act::GeluTanh),
            post_norms: true,
            ffn_norm: "ffn_norm",
            out_scale: false,
        })
        .collect()
}
