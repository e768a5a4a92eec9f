//! `qwen3moe` (Qwen3-30B-A3B, Qwen3-235B-A22B): qwen3's attention and, in every layer, a
//! mixture of experts — softmax over the router logits, the top `expert_used_count`, their
//! weights renormalized to sum to one (always: llama.cpp's graph hard-wires it, whatever the
//! HF config's `norm_topk_prob` says), no shared expert (llama.cpp `src/models/qwen3moe.cpp`).

use specula_gguf::Metadata;

use super::{block, qwen3::qk_normed};
use crate::spec::{Act, FfnSpec, Gating, LayerSpec};
use crate::{Hparams, Result, moe};

pub(super) fn layers(hp: &Hparams, md: &Metadata) -> Result<Vec<LayerSpec>> {
    let e = moe::ExpertKeys::read(md, hp)?;
    Ok((0..hp.n_layer)
        .map(|il| {
            block(
                qk_normed(hp, il),
                FfnSpec::Moe(e.spec(il, Gating::Softmax, true, Act::Silu)),
            )
        })
        .collect())
}
