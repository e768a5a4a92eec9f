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
    /// qwen3moe (Qwen3-30B-A3B, 235B-A22B): qwen3's attention, a mixture of experts in every
    /// layer (softmax router, top-k renormalized; llama.cpp `src/models/qwen3moe.cpp`).
    Qwen3Moe,
    /// qwen35 (Qwen3.5 / Qwen3.6 dense): gated delta-net linear attention in three layers of
    /// four, gated full attention with partial RoPE in the fourth (llama.cpp
    /// `src/models/qwen35.cpp`).
    Qwen35,
    /// qwen35moe (Qwen3.5 / Qwen3.6 MoE, e.g. 35B-A3B): qwen35 with a mixture of experts and a
    /// sigmoid-gated shared expert in every layer (llama.cpp `src/models/qwen35moe.cpp`).
    Qwen35Moe,
    /// qwen3next (Qwen3-Next-80B-A3B, Qwen3.5's older sibling): qwen35moe's layers with the
    /// delta-net's value heads in Hugging Face's order — grouped by key head, so value head `h`
    /// reads key head `h / (n_head_v / n_head_k)` — and β and α in one fused projection
    /// (`ssm_ba`, per key head `[β…, α…]`); plain partial RoPE (llama.cpp
    /// `src/models/qwen3next.cpp`).
    Qwen3Next,
    /// laguna (Poolside Laguna XS / S / M): per-layer query-head counts, a softplus attention
    /// gate, YaRN on the global layers and plain RoPE on the sliding-window ones, a sigmoid
    /// router with a correction bias and a shared expert after leading dense layers (llama.cpp
    /// `src/models/laguna.cpp`).
    Laguna,
    /// gemma4 (Gemma 4 31B, 26B-A4B): per-layer head sizes and K/V heads, proportional RoPE,
    /// V from K, a dense MLP beside experts, layer output scales, soft-capped logits
    /// (llama.cpp `src/models/gemma4.cpp`).
    Gemma4,
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
            Self::Qwen3Moe => "qwen3moe",
            Self::Qwen35 => "qwen35",
            Self::Qwen35Moe => "qwen35moe",
            Self::Qwen3Next => "qwen3next",
            Self::Laguna => "laguna",
            Self::Gemma4 => "gemma4",
        }
    }

    fn from_name(name: &str) -> Option<Self> {
        match name {
            "llama" => Some(Self::Llama),
            "qwen2" => Some(Self::Qwen2),
            "qwen3" => Some(Self::Qwen3),
            "gemma3" => Some(Self::Gemma3),
            "qwen3moe" => Some(Self::Qwen3Moe),
            "qwen35" => Some(Self::Qwen35),
            "qwen35moe" => Some(Self::Qwen35Moe),
            "qwen3next" => Some(Self::Qwen3Next),
            "laguna" => Some(Self::Laguna),
            "gemma4" => Some(Self::Gemma4),
            _ => None,
        }
    }

    /// How RoPE pairs dimensions (llama.cpp `llama_model_rope_type`).
    #[must_use]
    pub fn rope_kind(self) -> RopeKind {
        match self {
            Self::Llama => RopeKind::Normal,
            // Qwen3.5's interleaved multi-section RoPE (IMROPE) is NeoX pairing when the
            // position's sections are equal, as they are for text.
            Self::Qwen2
            | Self::Qwen3
            | Self::Gemma3
            | Self::Qwen3Moe
            | Self::Qwen35
            | Self::Qwen35Moe
            | Self::Qwen3Next
            | Self::Laguna
            | Self::Gemma4 => RopeKind::Neox,
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
    /// Feed-forward size of the dense layers (`feed_forward_length`; 0 in a model whose every
    /// layer is a mixture of experts and that does not give it).
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
    /// What each layer computes (`arch/<arch>.rs` reads it from the metadata).
    pub layers: Vec<crate::spec::LayerSpec>,
    /// Final logits soft-capped to `c · tanh(x / c)` (`final_logit_softcapping`, Gemma 4).
    pub final_softcap: Option<f32>,
    /// Multi-token-prediction blocks stored after the `n_layer` trunk blocks
    /// (`nextn_predict_layers`): their tensors are in the file, unused here.
    pub n_mtp: usize,
    /// Values of each layer's per-layer input (Gemma 4 E2B / E4B,
    /// `embedding_length_per_layer_input`); `None` when the model has none.
    pub per_layer_input: Option<usize>,
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

/// A required non-negative integer key.
pub(crate) fn get_usize(md: &Metadata, key: &str) -> Result<usize, ModelError> {
    opt_usize(md, key)?.ok_or_else(|| ModelError::MissingKey {
        key: key.to_owned(),
    })
}

/// An optional non-negative integer key: absent is `None`; a value of another type, a
/// negative one or one past `usize` is an error naming the key.
pub(crate) fn opt_usize(md: &Metadata, key: &str) -> Result<Option<usize>, ModelError> {
    let Some(v) = md.get(key) else {
        return Ok(None);
    };
    match (v.as_u64(), v.as_i64()) {
        (Some(u), _) => usize::try_from(u)
            .map(Some)
            .map_err(|_| ModelError::BadValue {
                key: key.to_owned(),
                detail: format!("{u} does not fit in usize"),
            }),
        (None, Some(i)) => Err(ModelError::NegativeHparam {
            key: key.to_owned(),
            value: i,
        }),
        (None, None) => Err(ModelError::HparamType {
            key: key.to_owned(),
            found: format!("{:?}", v.value_type()),
            expected: "an unsigned integer",
        }),
    }
}

/// An optional number key as `f32`: absent is `None`; a value that is not a number is an error
/// naming the key.
pub(crate) fn get_f32(md: &Metadata, key: &str) -> Result<Option<f32>, ModelError> {
    let Some(v) = md.get(key) else {
        return Ok(None);
    };
    match v {
        specula_gguf::Value::F32(v) => Ok(Some(*v)),
        other => {
            #[allow(
                clippy::cast_possible_truncation,
                reason = "hyperparameters fit in f32 (a huge one becomes ±inf, refused as such)"
            )]
            let v = other.as_f64().map(|v| v as f32);
            v.map(Some).ok_or_else(|| ModelError::HparamType {
                key: key.to_owned(),
                found: format!("{:?}", other.value_type()),
                expected: "a number",
            })
        }
    }
}

/// An integer hyperparameter outside its bounds.
pub(crate) fn int_bound(key: &str, value: usize, expected: impl Into<String>) -> ModelError {
    ModelError::HparamRange {
        key: key.to_owned(),
        value: u64::try_from(value).unwrap_or(u64::MAX),
        expected: expected.into(),
    }
}

/// A float hyperparameter outside its bounds.
pub(crate) fn float_bound(key: &str, value: f32, expected: impl Into<String>) -> ModelError {
    ModelError::HparamFloat {
        key: key.to_owned(),
        value,
        expected: expected.into(),
    }
}

/// `key` read as a float that must be finite and positive, `default` when absent.
pub(crate) fn positive_f32(md: &Metadata, key: &str, default: f32) -> Result<f32, ModelError> {
    match get_f32(md, key)? {
        None => Ok(default),
        Some(v) if v.is_finite() && v > 0.0 => Ok(v),
        Some(v) => Err(float_bound(key, v, "a finite number > 0")),
    }
}

/// `key` read as a float that must be finite when present.
pub(crate) fn finite_f32(md: &Metadata, key: &str) -> Result<Option<f32>, ModelError> {
    match get_f32(md, key)? {
        Some(v) if !v.is_finite() => Err(float_bound(key, v, "a finite number")),
        v => Ok(v),
    }
}

/// The largest magnitude of a factor applied to activations (embedding, attention score,
/// attention value and logit scales): the f16 range (65504) llama.cpp stages activations
/// in. A larger factor overflows the squares of the next RMS norm or the logits to ±∞.
pub(crate) const MAX_SCALE: f32 = 65504.0;

/// `key` read as a factor on activations: finite, of magnitude at most [`MAX_SCALE`].
pub(crate) fn scale_f32(md: &Metadata, key: &str) -> Result<Option<f32>, ModelError> {
    match get_f32(md, key)? {
        Some(v) if !(v.is_finite() && v.abs() <= MAX_SCALE) => Err(float_bound(
            key,
            v,
            format!("a finite factor of magnitude at most {MAX_SCALE}"),
        )),
        v => Ok(v),
    }
}

/// `a · b`, or an error naming `key` when the product overflows.
pub(crate) fn mul(key: &str, a: usize, b: usize) -> Result<usize, ModelError> {
    a.checked_mul(b).ok_or_else(|| {
        int_bound(
            key,
            a,
            format!("a value whose product with {b} fits in usize"),
        )
    })
}

/// The attention and normalization hyperparameters every architecture and drafter reads
/// under its prefix (`<prefix>.embedding_length`, `attention.*`, `rope.*`), validated: at
/// least one head, query heads a multiple of the K/V heads, non-zero head sizes, rotated
/// dimensions even and at most the K head size, a finite positive RoPE base and RMS epsilon.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct AttnHparams {
    pub(crate) n_embd: usize,
    pub(crate) n_head: usize,
    pub(crate) n_head_kv: usize,
    pub(crate) head_dim_k: usize,
    pub(crate) head_dim_v: usize,
    pub(crate) n_rot: usize,
    pub(crate) rope_freq_base: f32,
    pub(crate) rope_freq_scale: f32,
    pub(crate) rms_eps: f32,
}

impl AttnHparams {
    /// Reads and checks the keys under `prefix`; `default_eps` when the epsilon is absent.
    pub(crate) fn read(md: &Metadata, prefix: &str, default_eps: f32) -> Result<Self, ModelError> {
        let k = |s: &str| format!("{prefix}.{s}");
        let n_embd = get_usize(md, &k("embedding_length"))?;
        if n_embd == 0 {
            return Err(int_bound(&k("embedding_length"), 0, "at least 1"));
        }
        // A per-layer array (Laguna's query heads, Gemma 4's K/V heads) gives its first
        // layer's count here; the architecture reads the rest.
        let n_head =
            first_count(md, &k("attention.head_count"))?.ok_or_else(|| ModelError::MissingKey {
                key: k("attention.head_count"),
            })?;
        if n_head == 0 {
            return Err(int_bound(&k("attention.head_count"), 0, "at least 1"));
        }
        let n_head_kv = first_count(md, &k("attention.head_count_kv"))?.unwrap_or(n_head);
        if n_head_kv == 0 || !n_head.is_multiple_of(n_head_kv) {
            return Err(int_bound(
                &k("attention.head_count_kv"),
                n_head_kv,
                format!(
                    "a divisor of the {n_head} query heads (`{}`)",
                    k("attention.head_count")
                ),
            ));
        }
        // Without explicit head sizes a head is `n_embd / n_head` values.
        let head_dim = |key: &str| -> Result<usize, ModelError> {
            match opt_usize(md, &k(key))? {
                Some(0) => Err(int_bound(&k(key), 0, "at least 1")),
                Some(d) => Ok(d),
                None if n_embd / n_head == 0 => Err(int_bound(
                    &k("embedding_length"),
                    n_embd,
                    format!(
                        "at least the {n_head} heads of `{}` (or an explicit `{}`)",
                        k("attention.head_count"),
                        k(key)
                    ),
                )),
                None => Ok(n_embd / n_head),
            }
        };
        let head_dim_k = head_dim("attention.key_length")?;
        let head_dim_v = head_dim("attention.value_length")?;
        let n_rot = opt_usize(md, &k("rope.dimension_count"))?.unwrap_or(head_dim_k);
        if n_rot == 0 || !n_rot.is_multiple_of(2) || n_rot > head_dim_k {
            return Err(int_bound(
                &k("rope.dimension_count"),
                n_rot,
                format!("an even number in 2..={head_dim_k} (the K head size)"),
            ));
        }
        let scale_key = k("rope.scaling.factor");
        let rope_freq_scale = match get_f32(md, &scale_key)? {
            // 0 (and absent) mean no scaling, as in llama.cpp.
            None => 1.0,
            Some(0.0) => 1.0,
            Some(f) if f.is_finite() && f > 0.0 => 1.0 / f,
            Some(f) => return Err(float_bound(&scale_key, f, "a finite number ≥ 0")),
        };
        let base_key = k("rope.freq_base");
        let rope_freq_base = positive_f32(md, &base_key, 10_000.0)?;
        rope_angles_finite(&base_key, rope_freq_base, &scale_key, rope_freq_scale)?;
        Ok(Self {
            n_embd,
            n_head,
            n_head_kv,
            head_dim_k,
            head_dim_v,
            n_rot,
            rope_freq_base,
            rope_freq_scale,
            rms_eps: positive_f32(md, &k("attention.layer_norm_rms_epsilon"), default_eps)?,
        })
    }
}

/// The largest RoPE angle, `position · freq_scale · max(1, 1/base)` over positions below
/// 2³², must be finite: a base below 1 makes the angles grow with the dimension, and a tiny
/// base or scaling factor makes them infinite, which turns every rotated value into NaN.
pub(crate) fn rope_angles_finite(
    base_key: &str,
    base: f32,
    scale_key: &str,
    freq_scale: f32,
) -> Result<(), ModelError> {
    const MAX_POS: f32 = 4_294_967_296.0;
    if (MAX_POS * (1.0 / base).max(1.0)).is_finite() {
        if (MAX_POS * (1.0 / base).max(1.0) * freq_scale).is_finite() {
            return Ok(());
        }
        return Err(float_bound(
            scale_key,
            1.0 / freq_scale,
            "a factor that keeps RoPE angles finite at every position",
        ));
    }
    Err(float_bound(
        base_key,
        base,
        "a base that keeps RoPE angles finite at every position",
    ))
}

/// A count given once for every layer or as an array of one per layer (llama.cpp
/// `get_key_or_arr`): `None` when absent.
pub(crate) fn per_layer(
    md: &Metadata,
    key: &str,
    n_layer: usize,
) -> Result<Option<Vec<usize>>, ModelError> {
    use specula_gguf::{Array, Value};
    let Some(Value::Array(a)) = md.get(key) else {
        return Ok(opt_usize(md, key)?.map(|n| vec![n; n_layer]));
    };
    let bad = |detail: String| ModelError::BadValue {
        key: key.to_owned(),
        detail,
    };
    let wide: Option<Vec<u64>> = match a {
        Array::U8(v) => Some(v.iter().map(|&x| u64::from(x)).collect()),
        Array::U16(v) => Some(v.iter().map(|&x| u64::from(x)).collect()),
        Array::U32(v) => Some(v.iter().map(|&x| u64::from(x)).collect()),
        Array::U64(v) => Some(v.clone()),
        Array::I8(v) => v.iter().map(|&x| u64::try_from(x).ok()).collect(),
        Array::I16(v) => v.iter().map(|&x| u64::try_from(x).ok()).collect(),
        Array::I32(v) => v.iter().map(|&x| u64::try_from(x).ok()).collect(),
        Array::I64(v) => v.iter().map(|&x| u64::try_from(x).ok()).collect(),
        _ => {
            return Err(bad(format!(
                "an array of {:?}, expected unsigned integers",
                a.element_type()
            )));
        }
    };
    let v = wide
        .ok_or_else(|| bad("a negative entry, expected unsigned integers".into()))?
        .into_iter()
        .map(|x| usize::try_from(x).map_err(|_| bad(format!("{x} does not fit in usize"))))
        .collect::<Result<Vec<usize>, _>>()?;
    if v.len() != n_layer {
        return Err(bad(format!(
            "{} entries for a model of {n_layer} layers",
            v.len()
        )));
    }
    Ok(Some(v))
}

/// A count given once or per layer: the value, or the first layer's; `None` when absent.
fn first_count(md: &Metadata, key: &str) -> Result<Option<usize>, ModelError> {
    match md.get(key) {
        Some(specula_gguf::Value::Array(a)) => {
            let v = per_layer(md, key, a.len())?.unwrap_or_default();
            match v.first() {
                Some(&n) => Ok(Some(n)),
                None => Err(ModelError::BadValue {
                    key: key.to_owned(),
                    detail: "an empty array".into(),
                }),
            }
        }
        _ => opt_usize(md, key),
    }
}

/// A flag per layer (`get_key_or_arr` of bools): an array of one bool per layer, or `None`
/// when absent.
pub(crate) fn per_layer_bools(
    md: &Metadata,
    key: &str,
    n_layer: usize,
) -> Result<Option<Vec<bool>>, ModelError> {
    match md.get(key) {
        None => Ok(None),
        Some(specula_gguf::Value::Array(specula_gguf::Array::Bool(v))) if v.len() == n_layer => {
            Ok(Some(v.clone()))
        }
        Some(v) => Err(ModelError::BadValue {
            key: key.to_owned(),
            detail: format!(
                "expected an array of {n_layer} bools (one per layer), found {:?}",
                v.value_type()
            ),
        }),
    }
}

/// A required layer or width count that must be at least 1.
pub(crate) fn count(md: &Metadata, key: &str) -> Result<usize, ModelError> {
    match get_usize(md, key)? {
        0 => Err(int_bound(key, 0, "at least 1")),
        n => Ok(n),
    }
}

impl Hparams {
    /// Reads the hyperparameters; `n_vocab` comes from the token embedding's shape. Every
    /// value the forward pass uses is checked here, so a file that loads cannot reach an
    /// assertion of a backend op.
    ///
    /// # Errors
    /// [`ModelError::UnsupportedArch`] for an architecture this crate does not run, or a
    /// missing/invalid key (naming the key, its value and the bound).
    pub fn from_metadata(md: &Metadata, n_vocab: usize) -> Result<Self, ModelError> {
        let arch_name =
            md.get_str("general.architecture")
                .ok_or_else(|| ModelError::MissingKey {
                    key: "general.architecture".into(),
                })?;
        if arch_name == "clip" {
            return Err(ModelError::Projector {
                arch: arch_name.to_owned(),
            });
        }
        let arch = Arch::from_name(arch_name).ok_or_else(|| ModelError::UnsupportedArch {
            arch: arch_name.to_owned(),
        })?;
        let a = arch.name();
        let k = |s: &str| format!("{a}.{s}");
        let at = AttnHparams::read(md, a, 1e-5)?;
        let (n_embd, n_head, head_dim_k) = (at.n_embd, at.n_head, at.head_dim_k);
        let n_blocks = count(md, &k("block_count"))?;
        // Multi-token-prediction blocks after the trunk (Qwen3.5 / 3.6 ship one): llama.cpp
        // runs them only as its MTP drafter; the trunk is the rest.
        let n_mtp = opt_usize(md, &k("nextn_predict_layers"))?.unwrap_or(0);
        if n_mtp >= n_blocks {
            return Err(int_bound(
                &k("nextn_predict_layers"),
                n_mtp,
                format!("fewer than the {n_blocks} blocks (`{}`)", k("block_count")),
            ));
        }
        let n_layer = n_blocks - n_mtp;
        #[allow(
            clippy::cast_precision_loss,
            reason = "head and embedding sizes are small"
        )]
        let (attn_scale, embd_scale) = match arch {
            // llama.cpp `llama_model_gemma3::load_arch_hparams`: 27B (62 layers) scales by
            // the embedding per head, the others by the head size.
            Arch::Gemma3 if n_layer == 62 => {
                if n_embd / n_head == 0 {
                    return Err(int_bound(
                        &k("embedding_length"),
                        n_embd,
                        format!("at least the {n_head} heads (62-layer Gemma 3 scales by it)"),
                    ));
                }
                (
                    1.0 / ((n_embd / n_head) as f32).sqrt(),
                    Some((n_embd as f32).sqrt()),
                )
            }
            Arch::Gemma3 => (
                1.0 / (head_dim_k as f32).sqrt(),
                Some((n_embd as f32).sqrt()),
            ),
            // Scores unscaled (the per-layer spec says 1); embeddings ×√n_embd.
            Arch::Gemma4 => (1.0, Some((n_embd as f32).sqrt())),
            _ => (1.0 / (head_dim_k as f32).sqrt(), None),
        };
        let swa = match arch {
            Arch::Gemma3 => sliding_window(md, a, n_layer, 6, false)?,
            // XS / S: a global layer, then three sliding ones.
            Arch::Laguna => sliding_window(md, a, n_layer, 4, true)?,
            Arch::Gemma4 => sliding_window(md, a, n_layer, 6, false)?,
            _ => None,
        };
        let n_ff = match arch {
            // Every layer is MoE: the dense width is optional (it sizes no tensor).
            Arch::Qwen3Moe | Arch::Qwen35Moe | Arch::Qwen3Next | Arch::Laguna => {
                opt_usize(md, &k("feed_forward_length"))?.unwrap_or(0)
            }
            // One width per layer where the KV-shared layers' MLPs are twice as wide
            // (`use_double_wide_mlp`): the first here, each layer's in its spec.
            Arch::Gemma4 => match first_count(md, &k("feed_forward_length"))? {
                Some(0) => return Err(int_bound(&k("feed_forward_length"), 0, "at least 1")),
                Some(n) => n,
                None => {
                    return Err(ModelError::MissingKey {
                        key: k("feed_forward_length"),
                    });
                }
            },
            _ => count(md, &k("feed_forward_length"))?,
        };
        let mut hp = Self {
            arch,
            n_layer,
            n_embd,
            n_ff,
            n_head,
            n_head_kv: at.n_head_kv,
            head_dim_k,
            head_dim_v: at.head_dim_v,
            n_rot: at.n_rot,
            rope_freq_base: at.rope_freq_base,
            rope_freq_scale: at.rope_freq_scale,
            rms_eps: at.rms_eps,
            n_ctx_train: count(md, &k("context_length"))?,
            n_vocab,
            attn_scale,
            embd_scale,
            swa,
            layers: Vec::new(),
            n_mtp,
            per_layer_input: match arch {
                Arch::Gemma4 => {
                    opt_usize(md, &k("embedding_length_per_layer_input"))?.filter(|&n| n > 0)
                }
                _ => None,
            },
            final_softcap: match arch {
                Arch::Gemma4 => scale_f32(md, &k("final_logit_softcapping"))?
                    .filter(|&c| c != 0.0)
                    .map(f32::abs),
                _ => None,
            },
        };
        hp.layers = crate::arch::layers(&hp, md)?;
        Ok(hp)
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
    dense_first: bool,
) -> Result<Option<SlidingWindow>, ModelError> {
    let key = format!("{arch}.attention.sliding_window");
    let window = match opt_usize(md, &key)? {
        None | Some(0) => return Ok(None),
        Some(w) => w,
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
            swa_pattern(n, n_layer, dense_first)
        }
        None => swa_pattern(default_pattern, n_layer, dense_first),
    };
    let base_key = format!("{arch}.rope.freq_base_swa");
    let rope_freq_base = positive_f32(md, &base_key, 10_000.0)?;
    // Sliding-window layers do not scale their frequencies.
    rope_angles_finite(&base_key, rope_freq_base, &base_key, 1.0)?;
    Ok(Some(SlidingWindow {
        window,
        layers,
        rope_freq_base,
    }))
}

/// `llama_hparams::set_swa_pattern(n, dense_first)`: layer `il` slides unless it is the last
/// (or with `dense_first` the first) of each group of `n`.
fn swa_pattern(n: usize, n_layer: usize, dense_first: bool) -> Vec<bool> {
    (0..n_layer)
        .map(|il| {
            n == 0
                || if dense_first {
                    il % n != 0
                } else {
                    il % n < n - 1
                }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::swa_pattern;

    /// llama.cpp `set_swa_pattern(6, dense_first = false)` on Gemma-3 270m (18 layers): layers
    /// 5, 11 and 17 attend globally, the others through the window; pattern 0 slides
    /// everywhere, pattern 1 nowhere.
    #[test]
    fn pattern_n_makes_the_last_layer_of_each_group_global() {
        let global: Vec<usize> = swa_pattern(6, 18, false)
            .iter()
            .enumerate()
            .filter(|(_, s)| !**s)
            .map(|(i, _)| i)
            .collect();
        assert_eq!(global, [5, 11, 17]);
        assert!(swa_pattern(0, 4, false).iter().all(|&s| s));
        assert!(swa_pattern(1, 4, false).iter().all(|&s| !s));
        // Laguna: the first layer of each group of 4 is global.
        assert_eq!(
            swa_pattern(4, 6, true),
            [false, true, true, true, false, true]
        );
    }
}
