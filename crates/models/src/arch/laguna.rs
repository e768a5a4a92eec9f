//! `laguna` (Poolside Laguna XS.2 / XS 2.1 / S 2.1 / M.1): Qwen3-style attention (QK-norm,
//! NeoX RoPE) with per-layer query-head counts (`attention.head_count` per layer, K/V heads
//! fixed) and a softplus output gate (`attn_gate`, per head or per element); global layers use
//! YaRN over `rope.dimension_count` dimensions, sliding-window layers (`sliding_window`; one
//! global then three sliding unless `sliding_window_pattern` says otherwise) plain RoPE over
//! `rope.dimension_count_swa` with `rope.freq_base_swa`. The first `leading_dense_block_count`
//! layers have a dense MLP, the others a mixture of experts — a sigmoid router whose top-k is
//! chosen on the scores plus `exp_probs_b.bias`, weights renormalized
//! (`expert_weights_norm`) and scaled (`expert_weights_scale`) — plus an ungated shared expert
//! (llama.cpp `src/models/laguna.cpp`).
//!
//! YaRN reads `rope.scaling.yarn_beta_fast` / `yarn_beta_slow` and the magnitude
//! `rope.scaling.yarn_attn_factor` from the file, as Hugging Face's Laguna applies them
//! (`attention_factor`, default `1 + 0.1·ln(factor)`). Upstream llama.cpp at 0c1e570 reads
//! neither beta (it runs 32 / 1) and recomputes the magnitude, so its Laguna differs from the
//! reference where a config sets them otherwise.

use specula_gguf::Metadata;
use specula_tensor::{RopeConfig, Yarn};

use super::{attention, dense, rope};
use crate::hparams::{MAX_SCALE, float_bound, per_layer, positive_f32};
use crate::spec::{Act, AttnGate, AttnSpec, FfnSpec, Gating, LayerSpec, MixerSpec, SharedExpert};
use crate::{Hparams, ModelError, Result, int_bound, moe, opt_usize};

pub(super) fn layers(hp: &Hparams, md: &Metadata) -> Result<Vec<LayerSpec>> {
    let a = hp.arch.name();
    let k = |s: &str| format!("{a}.{s}");
    let heads = per_layer(md, &k("attention.head_count"), hp.n_layer)?
        .unwrap_or_else(|| vec![hp.n_head; hp.n_layer]);
    if let Some(&bad) = heads
        .iter()
        .find(|&&h| h == 0 || !h.is_multiple_of(hp.n_head_kv))
    {
        return Err(int_bound(
            &k("attention.head_count"),
            bad,
            format!(
                "a multiple of the {} K/V heads in every layer",
                hp.n_head_kv
            ),
        ));
    }
    let n_dense = opt_usize(md, &k("leading_dense_block_count"))?.unwrap_or(0);
    if n_dense > 0 && hp.n_ff == 0 {
        return Err(ModelError::MissingKey {
            key: k("feed_forward_length"),
        });
    }
    let experts = if n_dense < hp.n_layer {
        let e = moe::ExpertKeys::read(md, hp)?;
        let shared = opt_usize(md, &k("expert_shared_feed_forward_length"))?
            .filter(|&n| n > 0)
            .ok_or_else(|| ModelError::MissingKey {
                key: k("expert_shared_feed_forward_length"),
            })?;
        Some((e, shared))
    } else {
        None
    };
    let global = global_rope(hp, md)?;
    let n_rot_swa = opt_usize(md, &k("rope.dimension_count_swa"))?.unwrap_or(hp.head_dim_k);
    if n_rot_swa == 0 || !n_rot_swa.is_multiple_of(2) || n_rot_swa > hp.head_dim_k {
        return Err(int_bound(
            &k("rope.dimension_count_swa"),
            n_rot_swa,
            format!("an even number in 2..={} (the K head size)", hp.head_dim_k),
        ));
    }
    Ok((0..hp.n_layer)
        .map(|il| {
            let rope = if hp.is_swa(il) {
                RopeConfig {
                    n_rot: n_rot_swa,
                    ..rope(hp, il)
                }
            } else {
                global.clone()
            };
            let attn = AttnSpec {
                n_head: heads[il],
                rope,
                qk_norm: true,
                gate: Some(AttnGate::Softplus),
                ..attention(hp, il)
            };
            let ffn = match &experts {
                Some((e, shared)) if il >= n_dense => {
                    let gating = match e.gating_func {
                        Some(1) => Gating::Softmax,
                        _ => Gating::Sigmoid { bias: true },
                    };
                    let mut m = e.spec(il, gating, e.weights_norm.unwrap_or(false), Act::Silu);
                    m.shared = Some(SharedExpert {
                        n_ff: *shared,
                        gated: false,
                    });
                    FfnSpec::Moe(m)
                }
                _ => dense(hp, Act::Silu),
            };
            LayerSpec {
                mixer: MixerSpec::Attention(attn),
                ffn,
                post_norms: false,
                ffn_norm: "ffn_norm",
                out_scale: false,
            }
        })
        .collect())
}

/// The global layers' RoPE: YaRN when `rope.scaling.type` says so, with the file's betas and
/// magnitude; else linear scaling (as `rope(hp, il)` of a global layer).
fn global_rope(hp: &Hparams, md: &Metadata) -> Result<RopeConfig> {
    let a = hp.arch.name();
    let k = |s: &str| format!("{a}.rope.scaling.{s}");
    let mut r = rope(hp, usize::MAX);
    if md.get_str(&k("type")) != Some("yarn") {
        return Ok(r);
    }
    let factor = 1.0 / hp.rope_freq_scale;
    let orig_ctx = opt_usize(md, &k("original_context_length"))?.unwrap_or(hp.n_ctx_train);
    // ggml's YaRN multiplies the magnitude by 1 + 0.1·ln(factor) itself: divided out here so
    // that the net factor is the file's (Hugging Face's `attention_factor`).
    let mscale = 1.0 + 0.1 * factor.ln();
    // The magnitude multiplies both the rotated queries and keys, so the scores pick up its
    // square, and the cache holds the scaled keys: bounded so that the square stays within
    // the f16 range other activation factors are held to (a factor of 2^40 overflows a q8_0
    // block's f16 scale and turns the scores to NaN).
    let key = k("yarn_attn_factor");
    let max = MAX_SCALE.sqrt().floor();
    let magnitude = match positive_f32(md, &key, mscale)? {
        m if m <= max => m,
        m => {
            return Err(float_bound(
                &key,
                m,
                format!("a finite number in (0, {max}]"),
            ));
        }
    };
    r.yarn = Some(Yarn {
        orig_ctx,
        ext_factor: 1.0,
        attn_factor: magnitude / mscale,
        beta_fast: positive_f32(md, &k("yarn_beta_fast"), 32.0)?,
        beta_slow: positive_f32(md, &k("yarn_beta_slow"), 1.0)?,
    });
    Ok(r)
}
