//! Hyperparameters read from GGUF metadata (`<arch>.*` keys as llama.cpp writes them).

use specula_gguf::Metadata;
use specula_tensor::RopeKind;

use crate::ModelError;

/// The architectures this crate runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    /// llama (SmolLM2, Llama 2/3): RoPE on adjacent pairs.
    Llama,
    /// qwen2 (Qwen2.5): NeoX RoPE, biases on Q/K/V.
    Qwen2,
    /// qwen3: NeoX RoPE, RMS QK-norm per head, no biases.
    Qwen3,
    /// gemma3 (Gemma 3 text): embeddings scaled by `√n_embd`, RMS QK-norm per head,
    /// post-attention and post-FFN norms, GELU-gated FFN, sliding-window layers with their own
    /// RoPE base (llama.cpp `src/models/gemma3.cpp`).
    Gemma3,
}

impl Arch {
    /// The `general.architecture` string.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::Llama => "llama",
            Self::Qwen2 => "qwen2",
            Self::Qwen3 => "qwen3",
            Self::Gemma3 => "gemma3",
        }
    }

    fn from_name(name: &str) -> Option<Self> {
        match name {
            "llama" => Some(Self::Llama),
            "qwen2" => Some(Self::Qwen2),
            "qwen3" => Some(Self::Qwen3),
            "gemma3" => Some(Self::Gemma3),
            _ => None,
        }
    }

    /// How RoPE pairs dimensions (llama.cpp `llama_model_rope_type`).
    #[must_use]
    pub fn rope_kind(self) -> RopeKind {
        match self {
            Self::Llama => RopeKind::Normal,
            Self::Qwen2 | Self::Qwen3 | Self::Gemma3 => RopeKind::Neox,
        }
    }
}

/// Everything the forward pass needs to know about the shapes of a model.
#[derive(Clone, Debug, PartialEq)]
pub struct Hparams {
    /// Architecture.
    pub arch: Arch,
    /// Transformer blocks.
    pub n_layer: usize,
    /// Hidden size.
    pub n_embd: usize,
    /// Feed-forward size.
    pub n_ff: usize,
    /// Query heads.
    pub n_head: usize,
    /// K/V heads.
    pub n_head_kv: usize,
    /// Values per K head.
    pub head_dim_k: usize,
    /// Values per V head.
    pub head_dim_v: usize,
    /// Rotated dimensions per head.
    pub n_rot: usize,
    /// RoPE θ.
    pub rope_freq_base: f32,
    /// RoPE linear scale (`1/factor`).
    pub rope_freq_scale: f32,
    /// RMSNorm epsilon.
    pub rms_eps: f32,
    /// Context length the model was trained with.
    pub n_ctx_train: usize,
    /// Vocabulary size (rows of the output matrix).
    pub n_vocab: usize,
    /// Scale of the queries' scores (`1/√head_dim` for every architecture but Gemma-3 27B,
    /// llama.cpp's `f_attention_scale`: `1/√(n_embd/n_head)` there).
    pub attn_scale: f32,
    /// Factor applied to the token embeddings before the first layer (Gemma: `√n_embd`).
    pub embd_scale: Option<f32>,
    /// Sliding-window attention: the window and which layers use it.
    pub swa: Option<SlidingWindow>,
}

/// The sliding-window layers of a model and their attention window (llama.cpp
/// `LLAMA_SWA_TYPE_STANDARD`: a query at position `p` sees keys at `p − window + 1 ..= p`,
/// `llama_hparams::is_masked_swa`).
#[derive(Clone, Debug, PartialEq)]
pub struct SlidingWindow {
    /// Positions a query sees, its own included.
    pub window: usize,
    /// Per layer: does it use the window (else it attends to the whole causal context).
    pub layers: Vec<bool>,
    /// RoPE θ of the sliding-window layers (`<arch>.rope.freq_base_swa`, default 10 000).
    pub rope_freq_base: f32,
}

impl Hparams {
    /// Whether layer `il` attends through the sliding window.
    #[must_use]
    pub fn is_swa(&self, il: usize) -> bool {
        self.swa
            .as_ref()
            .is_some_and(|s| s.layers.get(il).copied().unwrap_or(false))
    }
}

pub(crate) fn get_usize(md: &Metadata, key: &str) -> Result<usize, ModelError> {
    let v = md.get_u64(key).ok_or_else(|| ModelError::MissingKey {
        key: key.to_owned(),
    })?;
    usize::try_from(v).map_err(|_| ModelError::BadValue {
        key: key.to_owned(),
        detail: format!("{v} does not fit in usize"),
    })
}

pub(crate) fn get_f32(md: &Metadata, key: &str) -> Option<f32> {
    match md.get(key)? {
        specula_gguf::Value::F32(v) => Some(*v),
        other => {
            #[allow(
                clippy::cast_possible_truncation,
                reason = "hyperparameters fit in f32"
            )]
            let v = other.as_f64().map(|v| v as f32);
            v
        }
    }
}

impl Hparams {
    /// Reads the hyperparameters; `n_vocab` comes from the token embedding's shape.
    ///
    /// # Errors
    /// [`ModelError::UnsupportedArch`] for an architecture this crate does not run, or a
    /// missing/invalid key.
    pub fn from_metadata(md: &Metadata, n_vocab: usize) -> Result<Self, ModelError> {
        let arch_name =
            md.get_str("general.architecture")
                .ok_or_else(|| ModelError::MissingKey {
                    key: "general.architecture".into(),
                })?;
        let arch = Arch::from_name(arch_name).ok_or_else(|| ModelError::UnsupportedArch {
            arch: arch_name.to_owned(),
        })?;
        let a = arch.name();
        let k = |s: &str| format!("{a}.{s}");
        let n_embd = get_usize(md, &k("embedding_length"))?;
        let n_head = get_usize(md, &k("attention.head_count"))?;
        let n_head_kv = md
            .get_u64(&k("attention.head_count_kv"))
            .map_or(Ok(n_head), usize::try_from)
            .map_err(|_| ModelError::BadValue {
                key: k("attention.head_count_kv"),
                detail: "too large".into(),
            })?;
        if n_head == 0 || n_head_kv == 0 || n_head % n_head_kv != 0 {
            return Err(ModelError::BadValue {
                key: k("attention.head_count_kv"),
                detail: format!("{n_head} query heads cannot share {n_head_kv} K/V heads"),
            });
        }
        let default_head = n_embd / n_head;
        let head_dim_k = md
            .get_u64(&k("attention.key_length"))
            .and_then(|v| usize::try_from(v).ok())
            .unwrap_or(default_head);
        let head_dim_v = md
            .get_u64(&k("attention.value_length"))
            .and_then(|v| usize::try_from(v).ok())
            .unwrap_or(default_head);
        let n_rot = md
            .get_u64(&k("rope.dimension_count"))
            .and_then(|v| usize::try_from(v).ok())
            .unwrap_or(head_dim_k);
        let rope_freq_scale = match get_f32(md, &k("rope.scaling.factor")) {
            Some(f) if f > 0.0 => 1.0 / f,
            _ => 1.0,
        };
        let n_layer = get_usize(md, &k("block_count"))?;
        #[allow(
            clippy::cast_precision_loss,
            reason = "head and embedding sizes are small"
        )]
        let (attn_scale, embd_scale) = match arch {
            // llama.cpp `llama_model_gemma3::load_arch_hparams`: 27B (62 layers) scales by
            // the embedding per head, the others by the head size.
            Arch::Gemma3 if n_layer == 62 => (
                1.0 / ((n_embd / n_head) as f32).sqrt(),
                Some((n_embd as f32).sqrt()),
            ),
            Arch::Gemma3 => (
                1.0 / (head_dim_k as f32).sqrt(),
                Some((n_embd as f32).sqrt()),
            ),
            _ => (1.0 / (head_dim_k as f32).sqrt(), None),
        };
        let swa = match arch {
            Arch::Gemma3 => sliding_window(md, a, n_layer, 6)?,
            _ => None,
        };
        Ok(Self {
            arch,
            n_layer,
            n_embd,
            n_ff: get_usize(md, &k("feed_forward_length"))?,
            n_head,
            n_head_kv,
            head_dim_k,
            head_dim_v,
            n_rot,
            rope_freq_base: get_f32(md, &k("rope.freq_base")).unwrap_or(10_000.0),
            rope_freq_scale,
            rms_eps: get_f32(md, &k("attention.layer_norm_rms_epsilon")).unwrap_or(1e-5),
            n_ctx_train: get_usize(md, &k("context_length"))?,
            n_vocab,
            attn_scale,
            embd_scale,
            swa,
        })
    }
}

/// The sliding window of `arch` as llama.cpp reads it: `attention.sliding_window` (absent or
/// 0: none), then `attention.sliding_window_pattern` — a bool per layer, or `n` meaning every
/// `n`-th layer attends globally (`n − 1` sliding layers, then one global; `default_pattern`
/// when the key is absent; 0: every layer slides) — and `rope.freq_base_swa`
/// (`llama_model_base::load_swa_pattern`, `llama_hparams::set_swa_pattern`).
fn sliding_window(
    md: &Metadata,
    arch: &str,
    n_layer: usize,
    default_pattern: usize,
) -> Result<Option<SlidingWindow>, ModelError> {
    let key = format!("{arch}.attention.sliding_window");
    let window = match md.get_u64(&key) {
        None | Some(0) => return Ok(None),
        Some(w) => usize::try_from(w).map_err(|_| ModelError::BadValue {
            key,
            detail: format!("{w} does not fit in usize"),
        })?,
    };
    let pkey = format!("{arch}.attention.sliding_window_pattern");
    let layers = match md.get(&pkey) {
        Some(specula_gguf::Value::Array(specula_gguf::Array::Bool(per_layer))) => {
            if per_layer.len() != n_layer {
                return Err(ModelError::BadValue {
                    key: pkey,
                    detail: format!(
                        "{} entries for a model of {n_layer} layers",
                        per_layer.len()
                    ),
                });
            }
            per_layer.clone()
        }
        Some(v) => {
            let n = v
                .as_u64()
                .and_then(|n| usize::try_from(n).ok())
                .ok_or_else(|| ModelError::BadValue {
                    key: pkey.clone(),
                    detail: format!(
                        "expected an unsigned integer or an array of bools, found {:?}",
                        v.value_type()
                    ),
                })?;
            swa_pattern(n, n_layer)
        }
        None => swa_pattern(default_pattern, n_layer),
    };
    Ok(Some(SlidingWindow {
        window,
        layers,
        rope_freq_base: get_f32(md, &format!("{arch}.rope.freq_base_swa")).unwrap_or(10_000.0),
    }))
}

/// `llama_hparams::set_swa_pattern(n, dense_first = false)`: layer `il` slides unless it is
/// the last of each group of `n`.
fn swa_pattern(n: usize, n_layer: usize) -> Vec<bool> {
    (0..n_layer).map(|il| n == 0 || il % n < n - 1).collect()
}

#[cfg(test)]
mod tests {
    use super::swa_pattern;

    /// llama.cpp `set_swa_pattern(6, dense_first = false)` on Gemma-3 270m (18 layers): layers
    /// 5, 11 and 17 attend globally, the others through the window; pattern 0 slides
    /// everywhere, pattern 1 nowhere.
    #[test]
    fn pattern_n_makes_the_last_layer_of_each_group_global() {
        let global: Vec<usize> = swa_pattern(6, 18)
            .iter()
            .enumerate()
            .filter(|(_, s)| !**s)
            .map(|(i, _)| i)
            .collect();
        assert_eq!(global, [5, 11, 17]);
        assert!(swa_pattern(0, 4).iter().all(|&s| s));
        assert!(swa_pattern(1, 4).iter().all(|&s| !s));
    }
}
