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
}

impl Arch {
    /// The `general.architecture` string.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::Llama => "llama",
            Self::Qwen2 => "qwen2",
            Self::Qwen3 => "qwen3",
        }
    }

    fn from_name(name: &str) -> Option<Self> {
        match name {
            "llama" => Some(Self::Llama),
            "qwen2" => Some(Self::Qwen2),
            "qwen3" => Some(Self::Qwen3),
            _ => None,
        }
    }

    /// How RoPE pairs dimensions (llama.cpp `llama_model_rope_type`).
    #[must_use]
    pub fn rope_kind(self) -> RopeKind {
        match self {
            Self::Llama => RopeKind::Normal,
            Self::Qwen2 | Self::Qwen3 => RopeKind::Neox,
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
        Ok(Self {
            arch,
            n_layer: get_usize(md, &k("block_count"))?,
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
        })
    }
}
