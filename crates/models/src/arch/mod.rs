//! One file per architecture: its GGUF metadata turned into a [`LayerSpec`] per layer, over the
//! builders below (llama.cpp's `src/models/<arch>.cpp` are the models; what they share lives
//! here, what they do differently lives in their file).

mod gemma3;
mod gemma4;
mod laguna;
mod llama;
mod qwen2;
mod qwen3;
mod qwen35;
mod qwen3moe;

use specula_gguf::Metadata;
use specula_tensor::{Mask, RopeConfig};

use crate::spec::{Act, AttnSpec, FfnSpec, LayerSpec, MixerSpec};
use crate::{Arch, Hparams, Result};

/// The layers of the model `hp` describes (its model-wide hyperparameters already read).
pub(crate) fn layers(hp: &Hparams, md: &Metadata) -> Result<Vec<LayerSpec>> {
    Ok(match hp.arch {
        Arch::Llama => llama::layers(hp),
        Arch::Qwen2 => qwen2::layers(hp),
        Arch::Qwen3 => qwen3::layers(hp),
        Arch::Gemma3 => gemma3::layers(hp),
        Arch::Qwen3Moe => qwen3moe::layers(hp, md)?,
        Arch::Qwen35 | Arch::Qwen35Moe | Arch::Qwen3Next => qwen35::layers(hp, md)?,
        Arch::Laguna => laguna::layers(hp, md)?,
        Arch::Gemma4 => gemma4::layers(hp, md)?,
    })
}

/// What an architecture reads from the tensors themselves once the metadata is read (which
/// layers have a tensor, values of small tensors the forward uses as parameters).
pub(crate) fn finish(hp: &mut Hparams, file: &specula_gguf::Gguf) -> Result<()> {
    match hp.arch {
        Arch::Gemma4 => gemma4::finish(hp, file),
        _ => Ok(()),
    }
}

/// A pre-norm block: `mixer`, then `ffn`, no sandwich norms.
fn block(mixer: AttnSpec, ffn: FfnSpec) -> LayerSpec {
    LayerSpec {
        mixer: MixerSpec::Attention(mixer),
        ffn,
        post_norms: false,
        ffn_norm: "ffn_norm",
        out_scale: false,
    }
}

/// Layer `il`'s attention with the model-wide heads and sizes: causal (through the sliding
/// window on the layers that have one), the model's RoPE, no biases, no QK-norm.
fn attention(hp: &Hparams, il: usize) -> AttnSpec {
    AttnSpec {
        n_head: hp.n_head,
        n_head_kv: hp.n_head_kv,
        head_dim_k: hp.head_dim_k,
        head_dim_v: hp.head_dim_v,
        rope: rope(hp, il),
        mask: mask(hp, il),
        scale: hp.attn_scale,
        qkv_bias: false,
        qk_norm: false,
        gate: None,
        v_from_k: false,
        v_norm: false,
        kv_source: None,
    }
}

/// The model-wide dense gated MLP.
fn dense(hp: &Hparams, act: Act) -> FfnSpec {
    FfnSpec::Dense { n_ff: hp.n_ff, act }
}

/// RoPE of layer `il`: sliding-window layers have their own base and no frequency scaling
/// (llama.cpp `get_rope_freq_base` / `get_rope_freq_scale`: `rope_freq_scale_train_swa` is 1).
fn rope(hp: &Hparams, il: usize) -> RopeConfig {
    match &hp.swa {
        Some(w) if hp.is_swa(il) => {
            RopeConfig::new(hp.arch.rope_kind(), hp.n_rot, w.rope_freq_base)
        }
        _ => {
            let mut r = RopeConfig::new(hp.arch.rope_kind(), hp.n_rot, hp.rope_freq_base);
            r.freq_scale = hp.rope_freq_scale;
            r
        }
    }
}

/// The attention mask of layer `il`: causal, limited to the sliding window on the layers that
/// have one. Every forward (prefill chunks, decode, verify rows of several positions, several
/// sequences) masks through this, per query position, so they agree.
fn mask(hp: &Hparams, il: usize) -> Mask {
    match &hp.swa {
        Some(w) if hp.is_swa(il) => Mask::SlidingWindow(w.window),
        _ => Mask::Causal,
    }
}
