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
//! multipliers (unlike Gemma 3, not shifted by one). Per-layer inputs and shared KV layers
//! (E2B / E4B) are refused by name.

use specula_gguf::{Gguf, Metadata};
use specula_tensor::RopeConfig;

use super::{attention, mask, rope};
use crate::hparams::per_layer;
use crate::spec::{Act, AttnSpec, FfnSpec, Gating, LayerSpec, MixerSpec};
use crate::{Hparams, ModelError, Result, int_bound, moe, opt_usize};

pub(super) fn layers(hp: &Hparams, md: &Metadata) -> Result<Vec<LayerSpec>> {
    let a = hp.arch.name();
    let k = |s: &str| format!("{a}.{s}");
    for key in [
        "embedding_length_per_layer_input",
        "attention.shared_kv_layers",
    ] {
        if let Some(n) = opt_usize(md, &k(key))?
            && n > 0
        {
            return Err(int_bound(
                &k(key),
                n,
                "0 (per-layer inputs and shared KV layers, Gemma 4 E2B / E4B, are not implemented)",
            ));
        }
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
                ..attention(hp, il)
            };
            let ffn = match &experts {
                Some(e) => FfnSpec::Parallel {
                    n_ff: hp.n_ff,
                    act: Act::GeluTanh,
                    moe: e.spec(il, Gating::Softmax, true, Act::GeluTanh),
                },
                None => FfnSpec::Dense {
                    n_ff: hp.n_ff,
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
        a.v_from_k = v_from_k;
        if v_from_k && a.head_dim_k != a.head_dim_v {
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
