//! `gemma4` (Gemma 4: 31B dense, 26B-A4B MoE): sliding-window and global layers
//! (`sliding_window_pattern`), each with its own head size (`key_length_swa` / `key_length`),
//! K/V heads (`head_count_kv` per layer) and RoPE (`rope.dimension_count_swa` with
//! `rope.freq_base_swa` on the sliding layers; on the global ones NeoX over the whole head with
//! the per-pair divisors `rope_freqs` — `1e30` for the pairs Gemma's "proportional" RoPE leaves
//! alone); QK-norm, an RMS norm without weight on V, V taken from the K projection on the
//! layers without `attn_v`, score scale 1; sandwich norms; a GELU MLP beside a mixture of
//! experts (softmax, renormalized, per-expert output scales) whose router reads the residual
//! stream; a learned scalar on each layer's output (`layer_output_scale`); embeddings ×√n_embd,
//! final logits soft-capped (llama.cpp `src/models/gemma4.cpp`). Norm weights are stored as
//! multipliers (unlike Gemma 3, not shifted by one).
//!
//! E2B / E4B add per-layer inputs (`embedding_length_per_layer_input`: a second embedding
//! and a projection of the first give each layer a small input it gates in after its FFN;
//! the forward in `lib.rs`) and KV-shared layers: the last `attention.shared_kv_layers`
//! layers attend over the K/V of the last earlier layer of their kind (sliding or global) and
//! own no cache (transformers' `kv_sharing_modes`; llama.cpp's `layer_reuse_cb`), and with
//! `use_double_wide_mlp` their MLPs are twice as wide (`feed_forward_length` per layer).

use specula_gguf::{Gguf, Metadata};
use specula_tensor::RopeConfig;

use super::{attention, mask, rope};
use crate::hparams::per_layer;
use crate::spec::{Act, AttnSpec, FfnSpec, Gating, LayerSpec, MixerSpec};
use crate::{Hparams, ModelError, Result, int_bound, moe, opt_usize};

pub(super) fn layers(hp: &Hparams, md: &Metadata) -> Result<Vec<LayerSpec>> {
    let a = hp.arch.name();
    let k = |s: &str| format!("{a}.{s}");
    let n_shared = opt_usize(md, &k("attention.shared_kv_layers"))?.unwrap_or(0);
    if n_shared >= hp.n_layer {
        return Err(int_bound(
            &k("attention.shared_kv_layers"),
            n_shared,
            format!(
                "fewer than the {} layers (a shared layer reads an earlier layer's K/V)",
                hp.n_layer
            ),
        ));
    }
    let first_shared = hp.n_layer - n_shared;
    // The layer whose K/V a shared layer reads: the last one of its kind before the shared ones.
    let source = |il: usize| -> Result<Option<usize>> {
        if il < first_shared {
            return Ok(None);
        }
        (0..first_shared)
            .rev()
            .find(|&j| hp.is_swa(j) == hp.is_swa(il))
            .map(Some)
            .ok_or_else(|| {
                int_bound(
                    &k("attention.shared_kv_layers"),
                    n_shared,
                    format!(
                        "a count that leaves a {} layer before layer {il} to share K/V with",
                        if hp.is_swa(il) { "sliding" } else { "global" }
                    ),
                )
            })
    };
    let n_ff = per_layer(md, &k("feed_forward_length"), hp.n_layer)?
        .unwrap_or_else(|| vec![hp.n_ff; hp.n_layer]);
    if let Some(il) = n_ff.iter().position(|&n| n == 0) {
        return Err(int_bound(
            &k("feed_forward_length"),
            0,
            format!("at least 1 in every layer (layer {il})"),
        ));
    }
    let kv_heads = per_layer(md, &k("attention.head_count_kv"), hp.n_layer)?
        .unwrap_or_else(|| vec![hp.n_head_kv; hp.n_layer]);
    let hd_swa = opt_usize(md, &k("attention.key_length_swa"))?.unwrap_or(hp.head_dim_k);
    let hd_swa_v = opt_usize(md, &k("attention.value_length_swa"))?.unwrap_or(hd_swa);
    if hd_swa != hd_swa_v || hp.head_dim_k != hp.head_dim_v || hd_swa == 0 {
        return Err(int_bound(
            &k("attention.value_length_swa"),
            hd_swa_v,
            format!(
                "K and V heads of one size (llama.cpp: Gemma 4 requires it): {hd_swa} / {}",
                hp.head_dim_k
            ),
        ));
    }
    let n_rot_swa = opt_usize(md, &k("rope.dimension_count_swa"))?.unwrap_or(hd_swa);
    if n_rot_swa == 0 || !n_rot_swa.is_multiple_of(2) || n_rot_swa > hd_swa {
        return Err(int_bound(
            &k("rope.dimension_count_swa"),
            n_rot_swa,
            format!("an even number in 2..={hd_swa} (the sliding layers' head size)"),
        ));
    }
    let experts = match opt_usize(md, &k("expert_count"))? {
        Some(n) if n > 0 => Some(moe::ExpertKeys::read(md, hp)?),
        _ => None,
    };
    (0..hp.n_layer)
        .map(|il| {
            let swa = hp.is_swa(il);
            let hd = if swa { hd_swa } else { hp.head_dim_k };
            let kvh = kv_heads[il];
            if kvh == 0 || !hp.n_head.is_multiple_of(kvh) {
                return Err(int_bound(
                    &k("attention.head_count_kv"),
                    kvh,
                    format!("a divisor of the {} query heads in every layer", hp.n_head),
                ));
            }
            let kv_source = source(il)?;
            if let Some(src) = kv_source
                && kv_heads[src] != kvh
            {
                return Err(int_bound(
                    &k("attention.head_count_kv"),
                    kvh,
                    format!(
                        "{} in layer {il}, as in layer {src} whose K/V it reads",
                        kv_heads[src]
                    ),
                ));
            }
            let attn = AttnSpec {
                n_head_kv: kvh,
                head_dim_k: hd,
                head_dim_v: hd,
                rope: RopeConfig {
                    n_rot: if swa { n_rot_swa } else { hp.n_rot },
                    ..rope(hp, il)
                },
                mask: mask(hp, il),
                scale: 1.0,
                qk_norm: true,
                v_norm: true,
                kv_source,
                ..attention(hp, il)
            };
            let ffn = match &experts {
                Some(e) => FfnSpec::Parallel {
                    n_ff: n_ff[il],
                    act: Act::GeluTanh,
                    moe: e.spec(il, Gating::Softmax, true, Act::GeluTanh),
                },
                None => FfnSpec::Dense {
                    n_ff: n_ff[il],
                    act: Act::GeluTanh,
                },
            };
            Ok(LayerSpec {
                mixer: MixerSpec::Attention(attn),
                ffn,
                post_norms: true,
                ffn_norm: "ffn_norm",
                out_scale: false,
            })
        })
        .collect()
}

/// What the tensors decide, as llama.cpp's loader reads them: V from K where a layer has no
/// `attn_v`, a layer output scale where it has `layer_output_scale`, and the global layers'
/// RoPE divisors `rope_freqs` (`n_rot / 2` values, required).
pub(super) fn finish(hp: &mut Hparams, file: &Gguf) -> Result<()> {
    let n_rot = hp.n_rot;
    let mut factors: Option<std::sync::Arc<[f32]>> = None;
    for il in 0..hp.n_layer {
        let swa = hp.is_swa(il);
        let has = |s: &str| file.tensor(&format!("blk.{il}.{s}")).is_some();
        let (v_from_k, out_scale) = (!has("attn_v.weight"), has("layer_output_scale.weight"));
        let l = &mut hp.layers[il];
        l.out_scale = out_scale;
        let MixerSpec::Attention(a) = &mut l.mixer else {
            continue;
        };
        // A KV-shared layer has neither K nor V projection: it reads its source's cache.
        a.v_from_k = v_from_k && a.kv_source.is_none();
        if a.v_from_k && a.head_dim_k != a.head_dim_v {
            return Err(ModelError::MissingTensor {
                name: format!("blk.{il}.attn_v.weight"),
            });
        }
        if !swa {
            if factors.is_none() {
                factors = Some(rope_freqs(file, n_rot)?.into());
            }
            a.rope.freq_factors.clone_from(&factors);
        }
    }
    Ok(())
}

/// `rope_freqs.weight`: one F32 divisor per rotated pair, each finite and positive.
fn rope_freqs(file: &Gguf, n_rot: usize) -> Result<Vec<f32>> {
    const NAME: &str = "rope_freqs.weight";
    let info = file.tensor(NAME).ok_or_else(|| ModelError::MissingTensor {
        name: NAME.to_owned(),
    })?;
    let dims: Vec<usize> = crate::dims_of(info);
    if info.ty != specula_gguf::GgmlType::F32 || dims != [n_rot / 2] {
        return Err(ModelError::BadShape {
            name: NAME.to_owned(),
            expected: vec![n_rot / 2],
            got: dims,
        });
    }
    let data = file.tensor_data_by_name(NAME).unwrap_or(&[]);
    let v: Vec<f32> = data
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    if let Some(&bad) = v.iter().find(|x| !(x.is_finite() && **x > 0.0)) {
        return Err(ModelError::BadScale {
            name: NAME.to_owned(),
            value: bad,
        });
    }
    Ok(v)
}
