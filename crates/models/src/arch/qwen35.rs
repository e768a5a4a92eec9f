//! `qwen35` / `qwen35moe` (Qwen3.5 and Qwen3.6): gated delta-net linear attention in the
//! layers `attention.recurrent_layers` marks (else three of every `full_attention_interval` = 4,
//! the fourth full), gated full attention (each head's query followed by its gate in `attn_q`,
//! the output times `σ(gate)`) with QK-norm and partial RoPE in the others; the norm before the
//! FFN is `post_attention_norm`. `qwen35moe` has a softmax top-k mixture of experts (always
//! renormalized, as llama.cpp's graph does) and a sigmoid-gated shared expert in every layer
//! (llama.cpp `src/models/qwen35.cpp`, `qwen35moe.cpp`, `delta-net-base.cpp`). The GGUF
//! stores the HF zero-centred norm weights `w` as `1 + w` and `A_log` as `ssm_a = −e^{A_log}`
//! (the converter's work); the text positions' RoPE sections are equal, so the interleaved
//! multi-section RoPE is NeoX RoPE over `rope.dimension_count` dimensions.
//!
//! `qwen3next` (Qwen3-Next) is the same block with two layouts of its own (llama.cpp
//! `src/models/qwen3next.cpp`): the delta-net's value heads stay grouped by key head as Hugging
//! Face stores them (Qwen3.5's converter tiles them), and β and α come from one projection
//! (`ssm_beta_alpha`, per key head `[β…, α…]`) that the loader splits by rows.

use specula_gguf::Metadata;

use super::{attention, dense};
use crate::hparams::per_layer_bools;
use crate::spec::{
    Act, AttnGate, AttnSpec, DeltaNetSpec, FfnSpec, Gating, LayerSpec, MixerSpec, SharedExpert,
};
use crate::{Arch, Hparams, Result, count, int_bound, moe, opt_usize};

pub(super) fn layers(hp: &Hparams, md: &Metadata) -> Result<Vec<LayerSpec>> {
    let a = hp.arch.name();
    let k = |s: &str| format!("{a}.{s}");
    let conv_kernel = count(md, &k("ssm.conv_kernel"))?;
    let head_dim = count(md, &k("ssm.state_size"))?;
    let n_head_k = count(md, &k("ssm.group_count"))?;
    let n_head_v = count(md, &k("ssm.time_step_rank"))?;
    if !n_head_v.is_multiple_of(n_head_k) {
        return Err(int_bound(
            &k("ssm.time_step_rank"),
            n_head_v,
            format!(
                "a multiple of the {n_head_k} key heads (`{}`)",
                k("ssm.group_count")
            ),
        ));
    }
    // llama.cpp's state is square: value heads of `ssm.state_size` values.
    let inner = count(md, &k("ssm.inner_size"))?;
    if Some(inner) != n_head_v.checked_mul(head_dim) {
        return Err(int_bound(
            &k("ssm.inner_size"),
            inner,
            format!(
                "{n_head_v} value heads × {head_dim} (`ssm.time_step_rank` × `ssm.state_size`)"
            ),
        ));
    }
    let next = hp.arch == Arch::Qwen3Next;
    let delta = DeltaNetSpec {
        n_head_k,
        n_head_v,
        head_dim,
        conv_kernel,
        grouped: next,
        fused_beta_alpha: next,
    };
    let recurrent = match per_layer_bools(md, &k("attention.recurrent_layers"), hp.n_layer)? {
        Some(v) => v,
        None => {
            let interval = opt_usize(md, &k("full_attention_interval"))?.unwrap_or(4);
            if interval == 0 {
                return Err(int_bound(&k("full_attention_interval"), 0, "at least 1"));
            }
            (0..hp.n_layer).map(|i| (i + 1) % interval != 0).collect()
        }
    };
    let ffn = match hp.arch {
        Arch::Qwen35Moe | Arch::Qwen3Next => {
            let e = moe::ExpertKeys::read(md, hp)?;
            let shared = opt_usize(md, &k("expert_shared_feed_forward_length"))?
                .filter(|&n| n > 0)
                .unwrap_or(hp.n_ff);
            if shared == 0 {
                return Err(int_bound(
                    &k("expert_shared_feed_forward_length"),
                    0,
                    "at least 1 (or a `feed_forward_length`)",
                ));
            }
            Some((e, shared))
        }
        _ => None,
    };
    Ok((0..hp.n_layer)
        .map(|il| {
            let mixer = if recurrent[il] {
                MixerSpec::DeltaNet(delta.clone())
            } else {
                MixerSpec::Attention(AttnSpec {
                    qk_norm: true,
                    gate: Some(AttnGate::QuerySigmoid),
                    ..attention(hp, il)
                })
            };
            let ffn = match &ffn {
                Some((e, shared)) => {
                    let mut m = e.spec(il, Gating::Softmax, true, Act::Silu);
                    m.shared = Some(SharedExpert {
                        n_ff: *shared,
                        gated: true,
                    });
                    FfnSpec::Moe(m)
                }
                None => dense(hp, Act::Silu),
            };
            LayerSpec {
                mixer,
                ffn,
                post_norms: false,
                ffn_norm: "post_attention_norm",
                out_scale: false,
            }
        })
        .collect())
}
