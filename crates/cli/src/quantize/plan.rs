//! Which type each tensor gets: the decision `llama-quantize` makes before it writes a byte.
//!
//! Mirrors `src/llama-quant.cpp` of the llama.cpp that llama-cpp-python 0.3.36 vendors
//! (`tensor_allows_quantization`, `llama_tensor_get_type`, `llama_tensor_get_type_impl`,
//! `tensor_type_fallback`, `llama_ftype_get_default_type`, `tensor_requires_imatrix`) and the
//! preset table of `tools/quantize/quantize.cpp`, for the presets whose block formats
//! `specula-quant` implements. Scope: no importance matrix, no `--tensor-type` patterns, no
//! layer pruning or split files; the per-architecture special cases are kept as llama.cpp has
//! them (Falcon, the 70B llama, 8-expert MoE) because they cost a comparison each.
//!
//! The decision is stateful: attention-V and FFN tensors are counted as they are met, and the
//! position in that count picks the "use more bits" layers. llama.cpp meets tensors in the
//! order of its `weights_map` — sorted by layer number, then by name — which is also the order
//! it writes them, so [`plan`] sorts first and decides in that order.

use anyhow::{Context, Result, bail, ensure};
use serde::Serialize;
use specula_gguf::{Array, GgmlType, Header, Value};
use specula_quant::QType;

/// A `llama-quantize` file type (`enum llama_ftype`) that specula can produce.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[allow(
    non_camel_case_types,
    reason = "names follow llama.cpp's LLAMA_FTYPE_MOSTLY_* spelling"
)]
pub enum Ftype {
    F32,
    F16,
    BF16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q2_K,
    Q2_K_S,
    Q3_K_S,
    Q3_K_M,
    Q3_K_L,
    Q4_K_S,
    Q4_K_M,
    Q5_K_S,
    Q5_K_M,
    Q6_K,
    IQ4_NL,
    IQ4_XS,
    MXFP4_MOE,
}

/// A name `llama-quantize` accepts for a file type, in its table's order (aliases included).
#[derive(Clone, Copy, Debug)]
pub struct Preset {
    /// The name as llama-quantize prints it (matched case-insensitively).
    pub name: &'static str,
    /// The file type it selects.
    pub ftype: Ftype,
}

const fn p(name: &'static str, ftype: Ftype) -> Preset {
    Preset { name, ftype }
}

/// `QUANT_OPTIONS` of `tools/quantize/quantize.cpp`, restricted to what specula implements, in
/// the same order (a numeric TYPE picks the first entry with that id, as there).
pub const PRESETS: &[Preset] = &[
    p("Q4_0", Ftype::Q4_0),
    p("Q4_1", Ftype::Q4_1),
    p("MXFP4_MOE", Ftype::MXFP4_MOE),
    p("Q5_0", Ftype::Q5_0),
    p("Q5_1", Ftype::Q5_1),
    p("Q2_K", Ftype::Q2_K),
    p("Q2_K_S", Ftype::Q2_K_S),
    p("Q3_K", Ftype::Q3_K_M),
    p("Q3_K_S", Ftype::Q3_K_S),
    p("Q3_K_M", Ftype::Q3_K_M),
    p("Q3_K_L", Ftype::Q3_K_L),
    p("IQ4_NL", Ftype::IQ4_NL),
    p("IQ4_XS", Ftype::IQ4_XS),
    p("Q4_K", Ftype::Q4_K_M),
    p("Q4_K_S", Ftype::Q4_K_S),
    p("Q4_K_M", Ftype::Q4_K_M),
    p("Q5_K", Ftype::Q5_K_M),
    p("Q5_K_S", Ftype::Q5_K_S),
    p("Q5_K_M", Ftype::Q5_K_M),
    p("Q6_K", Ftype::Q6_K),
    p("Q8_0", Ftype::Q8_0),
    p("F16", Ftype::F16),
    p("BF16", Ftype::BF16),
    p("F32", Ftype::F32),
];

/// Presets llama-quantize has and specula does not (their block formats are not implemented,
/// or they need an importance matrix for every tensor); named in the error for a clearer
/// message than "unknown".
const LLAMA_ONLY_PRESETS: &[&str] = &[
    "Q1_0", "Q2_0", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "IQ1_S", "IQ1_M", "TQ1_0", "TQ2_0",
    "IQ3_XXS", "IQ3_S", "IQ3_M", "IQ3_XS", "COPY",
];

impl Ftype {
    /// The `llama_ftype` id stored as `general.file_type`.
    #[must_use]
    pub fn id(self) -> u32 {
        match self {
            Self::F32 => 0,
            Self::F16 => 1,
            Self::Q4_0 => 2,
            Self::Q4_1 => 3,
            Self::Q8_0 => 7,
            Self::Q5_0 => 8,
            Self::Q5_1 => 9,
            Self::Q2_K => 10,
            Self::Q3_K_S => 11,
            Self::Q3_K_M => 12,
            Self::Q3_K_L => 13,
            Self::Q4_K_S => 14,
            Self::Q4_K_M => 15,
            Self::Q5_K_S => 16,
            Self::Q5_K_M => 17,
            Self::Q6_K => 18,
            Self::Q2_K_S => 21,
            Self::IQ4_NL => 25,
            Self::IQ4_XS => 30,
            Self::BF16 => 32,
            Self::MXFP4_MOE => 38,
        }
    }

    /// The canonical preset name (`Q4_K_M`, not the alias `Q4_K`).
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::Q3_K_M => "Q3_K_M",
            Self::Q4_K_M => "Q4_K_M",
            Self::Q5_K_M => "Q5_K_M",
            _ => PRESETS
                .iter()
                .find(|p| p.ftype == self)
                .map_or("?", |p| p.name),
        }
    }

    /// The type of every quantizable tensor before the mixture rules (`llama_ftype_get_default_type`).
    #[must_use]
    pub fn default_type(self) -> GgmlType {
        match self {
            Self::F32 => GgmlType::F32,
            Self::F16 => GgmlType::F16,
            Self::BF16 => GgmlType::BF16,
            Self::Q4_0 => GgmlType::Q4_0,
            Self::Q4_1 => GgmlType::Q4_1,
            Self::Q5_0 => GgmlType::Q5_0,
            Self::Q5_1 => GgmlType::Q5_1,
            Self::Q8_0 => GgmlType::Q8_0,
            Self::Q2_K | Self::Q2_K_S => GgmlType::Q2_K,
            Self::Q3_K_S | Self::Q3_K_M | Self::Q3_K_L => GgmlType::Q3_K,
            Self::Q4_K_S | Self::Q4_K_M => GgmlType::Q4_K,
            Self::Q5_K_S | Self::Q5_K_M => GgmlType::Q5_K,
            Self::Q6_K => GgmlType::Q6_K,
            Self::IQ4_NL => GgmlType::IQ4_NL,
            Self::IQ4_XS => GgmlType::IQ4_XS,
            Self::MXFP4_MOE => GgmlType::MXFP4,
        }
    }

    /// Parses a TYPE argument as llama-quantize does: a preset name in any case, or a
    /// `llama_ftype` id.
    ///
    /// # Errors
    /// An unknown or unsupported name, with the list of valid ones.
    pub fn parse(s: &str) -> Result<Self> {
        if let Some(p) = PRESETS.iter().find(|p| p.name.eq_ignore_ascii_case(s)) {
            return Ok(p.ftype);
        }
        if let Ok(id) = s.trim().parse::<u32>()
            && let Some(p) = PRESETS.iter().find(|p| p.ftype.id() == id)
        {
            return Ok(p.ftype);
        }
        let valid = PRESETS
            .iter()
            .map(|p| p.name)
            .collect::<Vec<_>>()
            .join(", ");
        if let Some(name) = LLAMA_ONLY_PRESETS
            .iter()
            .find(|n| n.eq_ignore_ascii_case(s))
        {
            bail!(
                "quantization type {name} is a llama-quantize preset that specula does not \
                 implement; valid types: {valid}"
            );
        }
        bail!("unknown quantization type '{s}'; valid types: {valid}")
    }
}

impl std::fmt::Display for Ftype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The ggml types a tensor can be converted to: those `ggml_quantize_chunk` writes and
/// `specula-quant` implements.
pub const TARGET_TYPES: &[GgmlType] = &[
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::IQ4_NL,
    GgmlType::IQ4_XS,
    GgmlType::MXFP4,
    GgmlType::NVFP4,
];

/// Parses the value of `--output-tensor-type` / `--token-embedding-type`: a ggml type name in
/// any case.
///
/// # Errors
/// A name that is not one of [`TARGET_TYPES`], with the list.
pub fn parse_target_type(flag: &str, s: &str) -> Result<GgmlType> {
    match GgmlType::from_name(s) {
        Some(t) if TARGET_TYPES.contains(&t) => Ok(t),
        _ => {
            let valid = TARGET_TYPES
                .iter()
                .map(|t| t.name())
                .collect::<Vec<_>>()
                .join(", ");
            bail!("{flag}: unknown or unsupported ggml type '{s}'; valid types: {valid}")
        }
    }
}

/// What the user asked for.
#[derive(Clone, Debug)]
pub struct Options {
    pub ftype: Ftype,
    /// `--pure`: no mixture rules, every quantizable tensor gets the preset's default type.
    pub pure: bool,
    /// `--leave-output-tensor`: `output.weight` is copied as it is.
    pub leave_output_tensor: bool,
    /// `--output-tensor-type`.
    pub output_tensor_type: Option<GgmlType>,
    /// `--token-embedding-type`.
    pub token_embedding_type: Option<GgmlType>,
    /// `--allow-requantize`: inputs already in a block format may be converted.
    pub allow_requantize: bool,
}

/// One tensor of the output, in output order.
#[derive(Clone, Debug, Serialize)]
pub struct TensorPlan {
    /// Position of the tensor in the input file.
    #[serde(skip)]
    pub input_index: usize,
    pub name: String,
    /// Dimensions as written (ggml order, trailing 1s dropped as `ggml_n_dims` does).
    pub shape: Vec<u64>,
    /// Type in the input.
    #[serde(serialize_with = "ser_type")]
    pub from: GgmlType,
    /// Type in the output.
    #[serde(serialize_with = "ser_type")]
    pub to: GgmlType,
    /// The type the rules chose before the row length forced a fallback, if it did.
    #[serde(
        serialize_with = "ser_opt_type",
        skip_serializing_if = "Option::is_none"
    )]
    pub fallback_from: Option<GgmlType>,
}

impl TensorPlan {
    /// Whether the data is converted (otherwise copied byte for byte).
    #[must_use]
    pub fn converts(&self) -> bool {
        self.from != self.to
    }
}

#[allow(
    clippy::trivially_copy_pass_by_ref,
    reason = "serde's serialize_with signature"
)]
fn ser_type<S: serde::Serializer>(t: &GgmlType, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(t.name())
}

#[allow(clippy::ref_option, reason = "serde's serialize_with signature")]
fn ser_opt_type<S: serde::Serializer>(t: &Option<GgmlType>, s: S) -> Result<S::Ok, S::Error> {
    match t {
        Some(t) => s.serialize_str(t.name()),
        None => s.serialize_none(),
    }
}

/// The whole decision.
#[derive(Clone, Debug)]
pub struct Plan {
    pub ftype: Ftype,
    /// Every tensor of the input, in output order.
    pub tensors: Vec<TensorPlan>,
    /// Tensors whose row length forced a fallback type (llama.cpp's `n_fallback`).
    pub n_fallback: usize,
}

/// The hyperparameters the rules read (`llama_hparams` as `load_hparams` fills it).
#[derive(Clone, Debug)]
struct Model {
    arch: String,
    n_layer: i64,
    n_gqa: u64,
    n_expert: u64,
    /// `LLM_TYPE_70B`: the one model size a rule depends on.
    is_70b: bool,
}

impl Model {
    fn from_header(h: &Header) -> Result<Self> {
        let md = &h.metadata;
        let arch = md
            .get_str("general.architecture")
            .context("the input has no general.architecture, which llama-quantize requires")?
            .to_owned();
        let key = |k: &str| format!("{arch}.{k}");
        let n_layer = md.get_u64(&key("block_count")).with_context(|| {
            format!("the input has no {} (the layer count)", key("block_count"))
        })?;
        ensure!(
            (1..=512).contains(&n_layer),
            "{} = {n_layer} is outside 1..=512 (llama.cpp's LLAMA_MAX_LAYERS)",
            key("block_count")
        );
        // Head counts may be per-layer arrays; the rules use layer 0 (`n_gqa()`).
        let first = |k: &str| -> Option<u64> {
            match md.get(k)? {
                Value::Array(a) => first_u64(a),
                v => v.as_u64(),
            }
        };
        let n_head = first(&key("attention.head_count")).unwrap_or(0);
        let n_head_kv = first(&key("attention.head_count_kv")).unwrap_or(n_head);
        let n_gqa = n_head.checked_div(n_head_kv).unwrap_or(0);
        let n_expert = md.get_u64(&key("expert_count")).unwrap_or(0);
        let is_70b = match arch.as_str() {
            "llama" => n_layer == 80 && n_head != n_head_kv,
            "qwen2" | "deci" | "olmo" => n_layer == 80,
            "jais2" => n_layer == 68,
            _ => false,
        };
        Ok(Self {
            arch,
            n_layer: i64::try_from(n_layer).unwrap_or(i64::MAX),
            n_gqa,
            n_expert,
            is_70b,
        })
    }

    fn is_falcon(&self) -> bool {
        self.arch == "falcon"
    }
}

/// The first element of an integer array, if it is a non-negative integer.
fn first_u64(a: &Array) -> Option<u64> {
    match a {
        Array::U8(v) => v.first().map(|&x| u64::from(x)),
        Array::U16(v) => v.first().map(|&x| u64::from(x)),
        Array::U32(v) => v.first().map(|&x| u64::from(x)),
        Array::U64(v) => v.first().copied(),
        Array::I8(v) => v.first().and_then(|&x| u64::try_from(x).ok()),
        Array::I16(v) => v.first().and_then(|&x| u64::try_from(x).ok()),
        Array::I32(v) => v.first().and_then(|&x| u64::try_from(x).ok()),
        Array::I64(v) => v.first().and_then(|&x| u64::try_from(x).ok()),
        _ => None,
    }
}

/// llama.cpp's broad tensor roles (`tensor_category`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Category {
    TokenEmbd,
    AttnQ,
    AttnV,
    AttnK,
    AttnQkv,
    AttnKvB,
    AttnOutput,
    FfnUp,
    FfnGate,
    FfnDown,
    Output,
    Other,
}

impl Category {
    fn of(name: &str) -> Self {
        // First match wins, in llama.cpp's order (`attn_qkv` before `attn_v`, …).
        const BY_SUBSTRING: &[(&str, Category)] = &[
            ("attn_qkv.weight", Category::AttnQkv),
            ("attn_kv_b.weight", Category::AttnKvB),
            ("attn_v.weight", Category::AttnV),
            ("attn_k.weight", Category::AttnK),
            ("attn_q.weight", Category::AttnQ),
            ("attn_output.weight", Category::AttnOutput),
            ("ffn_up", Category::FfnUp),
            ("ffn_gate", Category::FfnGate),
            ("ffn_down", Category::FfnDown),
        ];
        if name == "output.weight" {
            return Self::Output;
        }
        if is_token_embd(name) {
            return Self::TokenEmbd;
        }
        BY_SUBSTRING
            .iter()
            .find(|(s, _)| name.contains(s))
            .map_or(Self::Other, |&(_, c)| c)
    }

    /// Attention-V-like tensors, the ones most sensitive to quantization.
    fn is_attn_v(self) -> bool {
        matches!(self, Self::AttnV | Self::AttnQkv | Self::AttnKvB)
    }
}

fn is_token_embd(name: &str) -> bool {
    name == "token_embd.weight" || name == "per_layer_token_embd.weight"
}

/// `ggml_is_quantized`: a block format rather than a scalar type.
fn is_block_type(t: GgmlType) -> bool {
    t.block_size() > 1
}

/// `ggml_n_dims`: the dimensions up to the last one larger than 1 (at least one).
fn trimmed_dims(dims: &[u64]) -> Vec<u64> {
    let n = dims.iter().rposition(|&d| d > 1).map_or(1, |i| i + 1);
    (0..n).map(|i| dims.get(i).copied().unwrap_or(1)).collect()
}

/// The layer number `sscanf(name, "blk.%d.", &l)` reads, if any.
fn layer_of(name: &str) -> Option<i64> {
    let rest = name.strip_prefix("blk.")?.trim_start();
    let (sign, digits) = match rest.as_bytes().first()? {
        b'-' => (-1, &rest[1..]),
        b'+' => (1, &rest[1..]),
        _ => (1, rest),
    };
    let end = digits
        .bytes()
        .position(|b| !b.is_ascii_digit())
        .unwrap_or(digits.len());
    let n: i64 = digits[..end].parse().ok()?;
    Some(sign * n)
}

/// Output order: llama.cpp's `weight_name_comparer` (layer number, tensors outside any layer
/// first, then name).
fn output_order(a: &str, b: &str) -> std::cmp::Ordering {
    let la = layer_of(a).unwrap_or(-1);
    let lb = layer_of(b).unwrap_or(-1);
    la.cmp(&lb).then_with(|| a.cmp(b))
}

/// `tensor_allows_quantization`: whether the rules may change this tensor's type at all.
fn allows_quantization(name: &str, n_dims: usize, opts: &Options) -> bool {
    // Substrings that keep a tensor as it is (llama.cpp's list, architecture-specific entries
    // included since they cannot match other architectures' names). GLM5-next's extra list is
    // architecture-gated and left out: specula does not load that architecture.
    const NEVER: &[&str] = &[
        "_norm.weight",
        "ffn_gate_inp.weight",
        "ffn_gate_tid2eid.weight",
        "altup",
        "laurel",
        "per_layer_model_proj",
        "ssm_conv1d",
        "shortconv.conv.weight",
        "indexer.k_proj.weight",
        "indexer.q_proj.weight",
        "time_mix_first.weight",
        "time_mix_w0.weight",
        "time_mix_w1.weight",
        "time_mix_w2.weight",
        "time_mix_v0.weight",
        "time_mix_v1.weight",
        "time_mix_v2.weight",
        "time_mix_a0.weight",
        "time_mix_a1.weight",
        "time_mix_a2.weight",
        "time_mix_g1.weight",
        "time_mix_g2.weight",
        "time_mix_decay_w1.weight",
        "time_mix_decay_w2.weight",
        "time_mix_lerp_fused.weight",
        "attn_rel_b.weight",
        ".position_embd",
        "sam.pos_embd",
        "sam.neck.",
        "sam.net_",
        ".rel_pos",
        ".patch_embd",
        ".patch_merger",
        "a.rvq.codebook",
        "mm.a.code_embd",
    ];
    n_dims >= 2
        && name.ends_with("weight")
        && !(opts.leave_output_tensor && name == "output.weight")
        && name != "position_embd.weight"
        && name != "token_types.weight"
        && !NEVER.iter().any(|s| name.contains(s))
}

/// `use_more_bits`: the first and last eighth of the layers and every third one between.
fn use_more_bits(i_layer: i64, n_layers: i64) -> bool {
    i_layer < n_layers / 8 || i_layer >= 7 * n_layers / 8 || (i_layer - n_layers / 8) % 3 == 2
}

/// The mutable part of the decision (`quantize_state_impl`).
struct State<'a> {
    model: &'a Model,
    opts: &'a Options,
    n_attention_wv: i64,
    i_attention_wv: i64,
    i_ffn_down: i64,
    i_ffn_gate: i64,
    i_ffn_up: i64,
    n_fallback: usize,
    has_tied_embeddings: bool,
}

impl State<'_> {
    /// `layer_info`: the running count, or for MoE models the layer parsed from the name.
    fn layer(&self, counter: i64, name: &str) -> Result<(i64, i64)> {
        let n = self.model.n_layer;
        if self.model.n_expert > 1 {
            let l = layer_of(name)
                .with_context(|| format!("failed to determine the layer of tensor {name}"))?;
            ensure!(
                (0..n).contains(&l),
                "bad layer {l} for tensor {name}: must be in [0, {n})"
            );
            return Ok((l, n));
        }
        Ok((counter, n))
    }

    /// `llama_tensor_get_type_impl` for the file types specula supports.
    #[allow(
        clippy::too_many_lines,
        reason = "one rule table, kept in llama.cpp's order"
    )]
    fn mixture_type(
        &mut self,
        mut t: GgmlType,
        name: &str,
        dims: &[u64],
        cat: Category,
    ) -> Result<GgmlType> {
        use Ftype as F;
        use GgmlType as G;
        let ftype = self.opts.ftype;
        let m = self.model;
        if cat == Category::Output || (self.has_tied_embeddings && cat == Category::TokenEmbd) {
            if let Some(o) = self.opts.output_tensor_type {
                t = o;
            } else if ftype == F::MXFP4_MOE
                || m.is_falcon()
                || !dims[0].is_multiple_of(t.block_size())
            {
                t = G::Q8_0;
            } else if t != G::Q8_0 {
                t = G::Q6_K;
            }
        } else if ftype == F::MXFP4_MOE {
            // Expert tensors (3-D) to MXFP4, everything else to Q8_0.
            let expert_role =
                matches!(cat, Category::FfnUp | Category::FfnGate | Category::FfnDown);
            let is_expert =
                dims.get(2).is_some_and(|&n| n > 1) && (m.arch != "bailingmoe3" || expert_role);
            t = if is_expert { G::MXFP4 } else { G::Q8_0 };
        } else if cat == Category::TokenEmbd {
            // Only the IQ1/IQ2/IQ3/TQ presets change an untied token embedding.
            if let Some(e) = self.opts.token_embedding_type {
                t = e;
            }
        } else if cat.is_attn_v() {
            let (i, n) = (self.i_attention_wv, self.n_attention_wv);
            match ftype {
                F::Q2_K => t = if m.n_gqa >= 4 { G::Q4_K } else { G::Q3_K },
                F::Q2_K_S if m.n_gqa >= 4 => t = G::Q4_K,
                F::Q3_K_M => t = if i < 2 { G::Q5_K } else { G::Q4_K },
                F::Q3_K_L => t = G::Q5_K,
                F::IQ4_NL | F::IQ4_XS if m.n_gqa >= 4 => t = G::Q5_K,
                F::Q4_K_M | F::Q5_K_M if use_more_bits(i, n) => t = G::Q6_K,
                F::Q4_K_S if i < 4 => t = G::Q5_K,
                _ => {}
            }
            if m.is_70b && matches!(t, G::Q3_K | G::Q4_K) {
                // 8 heads share each V row in the 70B: more bits cost almost nothing.
                t = G::Q5_K;
            }
            if m.n_expert == 8 {
                t = G::Q8_0;
            }
            self.i_attention_wv += 1;
        } else if cat == Category::AttnK {
            if m.n_expert == 8 {
                t = G::Q8_0;
            }
        } else if cat == Category::FfnDown {
            let (i, n) = self.layer(self.i_ffn_down, name)?;
            let falcon = m.is_falcon();
            match ftype {
                F::Q2_K => t = G::Q3_K,
                F::Q2_K_S if i < n / 8 => t = G::Q4_K,
                F::Q3_K_M => {
                    t = if i < n / 16 {
                        G::Q5_K
                    } else if !falcon || use_more_bits(i, n) {
                        G::Q4_K
                    } else {
                        G::Q3_K
                    };
                }
                F::Q3_K_L => t = if falcon { G::Q4_K } else { G::Q5_K },
                F::Q4_K_M => {
                    if falcon {
                        t = if i < n / 16 {
                            G::Q6_K
                        } else if use_more_bits(i, n) {
                            G::Q5_K
                        } else {
                            G::Q4_K
                        };
                    } else if use_more_bits(i, n) {
                        t = G::Q6_K;
                    }
                }
                // Without an importance matrix (specula never has one).
                F::IQ4_NL | F::IQ4_XS if i < n / 8 => t = G::Q5_K,
                F::Q5_K_M if use_more_bits(i, n) => t = G::Q6_K,
                F::Q4_K_S if !falcon && i < n / 8 => t = G::Q5_K,
                _ => {}
            }
            self.i_ffn_down += 1;
        } else if cat == Category::AttnOutput {
            if m.is_falcon() {
                if ftype == F::Q3_K_L {
                    t = G::Q4_K;
                }
            } else if m.n_expert == 8 {
                if matches!(
                    ftype,
                    F::Q2_K | F::Q3_K_S | F::Q3_K_M | F::IQ4_NL | F::Q4_K_S | F::Q4_K_M | F::IQ4_XS
                ) {
                    t = G::Q5_K;
                }
            } else {
                match ftype {
                    F::Q2_K => t = G::Q3_K,
                    F::Q3_K_M => t = G::Q4_K,
                    F::Q3_K_L => t = G::Q5_K,
                    _ => {}
                }
            }
        } else if cat == Category::AttnQkv {
            match ftype {
                F::Q3_K_M | F::Q3_K_L => t = G::Q4_K,
                F::Q4_K_M => t = G::Q5_K,
                F::Q5_K_M => t = G::Q6_K,
                _ => {}
            }
        } else if cat == Category::FfnGate {
            // Only IQ3_XS changes these; the layer lookup still validates MoE names.
            self.layer(self.i_ffn_gate, name)?;
            self.i_ffn_gate += 1;
        } else if cat == Category::FfnUp {
            self.layer(self.i_ffn_up, name)?;
            self.i_ffn_up += 1;
        }
        Ok(t)
    }

    /// `tensor_type_fallback`: a type whose blocks fit the row when the chosen one does not.
    fn fallback(&mut self, name: &str, ne0: u64, t: GgmlType) -> Result<GgmlType> {
        use GgmlType as G;
        if ne0.is_multiple_of(t.block_size()) {
            return Ok(t);
        }
        self.n_fallback += 1;
        let f = match t {
            G::IQ1_S
            | G::IQ1_M
            | G::IQ2_XXS
            | G::IQ2_XS
            | G::IQ2_S
            | G::IQ3_XXS
            | G::IQ3_S
            | G::IQ4_XS => G::IQ4_NL,
            G::Q2_K | G::Q3_K | G::TQ1_0 | G::TQ2_0 => G::Q4_0,
            G::Q4_K => G::Q5_0,
            G::Q5_K => G::Q5_1,
            G::Q6_K => G::Q8_0,
            _ if t.block_size() <= 32 => t,
            _ => bail!(
                "tensor {name}: rows of {ne0} values do not fit {t} blocks of {} and llama.cpp \
                 defines no fallback type for {t}",
                t.block_size()
            ),
        };
        // A row that is not even a multiple of 32 can only be stored as F16.
        Ok(if ne0.is_multiple_of(f.block_size()) {
            f
        } else {
            G::F16
        })
    }

    /// `llama_tensor_get_type` for a tensor the rules may change; returns the type and, when a
    /// fallback replaced it, the type chosen before.
    fn target_type(
        &mut self,
        name: &str,
        dims: &[u64],
        cat: Category,
    ) -> Result<(GgmlType, Option<GgmlType>)> {
        if let Some(t) = self.opts.token_embedding_type
            && cat == Category::TokenEmbd
        {
            return Ok((t, None));
        }
        if let Some(t) = self.opts.output_tensor_type
            && cat == Category::Output
        {
            return Ok((t, None));
        }
        let default = self.opts.ftype.default_type();
        if !is_block_type(default) {
            return Ok((default, None));
        }
        let chosen = if self.opts.pure {
            default
        } else {
            self.mixture_type(default, name, dims, cat)?
        };
        let t = self.fallback(name, dims[0], chosen)?;
        Ok((t, (t != chosen).then_some(chosen)))
    }
}

/// Decides every tensor's output type and the output order, and checks that the conversion
/// can be done: rows fit the target's blocks, the input types can be read, no importance
/// matrix is needed, and block-quantized inputs are only converted with `--allow-requantize`.
///
/// # Errors
/// The first problem, naming the tensor.
pub fn plan(header: &Header, opts: &Options) -> Result<Plan> {
    let model = Model::from_header(header)?;
    let mut order: Vec<usize> = (0..header.tensors.len()).collect();
    order.sort_by(|&a, &b| output_order(&header.tensors[a].name, &header.tensors[b].name));

    let cats: Vec<Category> = order
        .iter()
        .map(|&i| Category::of(&header.tensors[i].name))
        .collect();
    let mut st = State {
        model: &model,
        opts,
        n_attention_wv: i64::try_from(cats.iter().filter(|c| c.is_attn_v()).count())
            .unwrap_or(i64::MAX),
        i_attention_wv: 0,
        i_ffn_down: 0,
        i_ffn_gate: 0,
        i_ffn_up: 0,
        n_fallback: 0,
        has_tied_embeddings: !cats.contains(&Category::Output),
    };

    let mut tensors = Vec::with_capacity(order.len());
    for (&i, &cat) in order.iter().zip(&cats) {
        let info = &header.tensors[i];
        let shape = trimmed_dims(&info.dims);
        let allowed = allows_quantization(&info.name, shape.len(), opts);
        let (to, fallback_from) = if allowed {
            st.target_type(&info.name, &shape, cat)?
        } else {
            (info.ty, None)
        };
        if allowed && requires_imatrix(&info.name, to, opts.ftype) {
            bail!(
                "{} needs an importance matrix for tensor {} (type {to}), and specula quantize \
                 does not take one (llama-quantize: \"this quantization requires an imatrix!\")",
                opts.ftype,
                info.name
            );
        }
        tensors.push(TensorPlan {
            input_index: i,
            name: info.name.clone(),
            shape,
            from: info.ty,
            to,
            fallback_from,
        });
    }
    for t in &tensors {
        check_conversion(t, opts)?;
    }
    Ok(Plan {
        ftype: opts.ftype,
        tensors,
        n_fallback: st.n_fallback,
    })
}

/// `tensor_requires_imatrix` for the types specula can produce.
fn requires_imatrix(name: &str, to: GgmlType, ftype: Ftype) -> bool {
    !(is_token_embd(name) || name == "output.weight")
        && to == GgmlType::Q2_K
        && ftype == Ftype::Q2_K_S
}

fn check_conversion(t: &TensorPlan, opts: &Options) -> Result<()> {
    if !t.converts() {
        return Ok(());
    }
    let (name, from, to) = (&t.name, t.from, t.to);
    if is_block_type(from) && !opts.allow_requantize {
        bail!(
            "tensor {name} is already quantized ({from}); converting it to {to} would \
             requantize, which loses quality: pass --allow-requantize to do it anyway \
             (llama-quantize: \"requantizing from type {} is disabled\")",
            from.name().to_lowercase()
        );
    }
    if QType::from_ggml_id(from.id()).is_none() {
        bail!("tensor {name}: cannot read type {from} to convert it to {to}");
    }
    if !TARGET_TYPES.contains(&to) || QType::from_ggml_id(to.id()).is_none() {
        bail!("tensor {name}: cannot write type {to}");
    }
    let ne0 = t.shape[0];
    if !ne0.is_multiple_of(to.block_size()) {
        bail!(
            "tensor {name}: its rows of {ne0} values are not a whole number of {to} blocks \
             ({} values each); choose a type with blocks of {} or fewer",
            to.block_size(),
            largest_block_dividing(ne0)
        );
    }
    Ok(())
}

fn largest_block_dividing(ne0: u64) -> u64 {
    [256, 64, 32, 1]
        .into_iter()
        .find(|&b| ne0.is_multiple_of(b))
        .unwrap_or(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn use_more_bits_matches_llama_cpp_on_24_and_30_layers() {
        // Layers llama.cpp gives more bits in Q4_K_M's ffn_down, computed by hand from the C
        // expression for the layer counts of qwen2.5-0.5b (24) and SmolLM2-135M (30).
        let more = |n| (0..n).filter(|&i| use_more_bits(i, n)).collect::<Vec<_>>();
        assert_eq!(more(24), [0, 1, 2, 5, 8, 11, 14, 17, 20, 21, 22, 23]);
        assert_eq!(
            more(30),
            [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29]
        );
        assert_eq!(more(2), [1]);
    }

    #[test]
    fn output_order_is_layer_then_name() {
        let mut names = [
            "blk.10.attn_q.weight",
            "token_embd.weight",
            "blk.2.ffn_up.weight",
            "blk.2.attn_k.weight",
            "output.weight",
            "blk.x.weird",
        ];
        names.sort_by(|a, b| output_order(a, b));
        assert_eq!(
            names,
            [
                "blk.x.weird",
                "output.weight",
                "token_embd.weight",
                "blk.2.attn_k.weight",
                "blk.2.ffn_up.weight",
                "blk.10.attn_q.weight",
            ]
        );
    }

    #[test]
    fn categories_follow_llama_cpp_precedence() {
        assert_eq!(Category::of("blk.0.attn_qkv.weight"), Category::AttnQkv);
        assert_eq!(Category::of("blk.0.attn_v.weight"), Category::AttnV);
        assert_eq!(
            Category::of("blk.0.ffn_down_exps.weight"),
            Category::FfnDown
        );
        assert_eq!(Category::of("blk.0.ffn_gate_inp.weight"), Category::FfnGate);
        assert_eq!(
            Category::of("per_layer_token_embd.weight"),
            Category::TokenEmbd
        );
        assert_eq!(Category::of("blk.0.attn_q_norm.weight"), Category::Other);
    }

    #[test]
    fn trailing_unit_dims_are_dropped() {
        assert_eq!(trimmed_dims(&[256, 1]), [256]);
        assert_eq!(trimmed_dims(&[1]), [1]);
        assert_eq!(trimmed_dims(&[1, 1, 1]), [1]);
        assert_eq!(trimmed_dims(&[]), [1]);
        assert_eq!(trimmed_dims(&[64, 1, 8]), [64, 1, 8]);
    }

    #[test]
    fn fallback_table_and_f16_for_odd_rows() {
        let model = Model {
            arch: "llama".into(),
            n_layer: 2,
            n_gqa: 1,
            n_expert: 0,
            is_70b: false,
        };
        let opts = Options {
            ftype: Ftype::Q4_K_M,
            pure: false,
            leave_output_tensor: false,
            output_tensor_type: None,
            token_embedding_type: None,
            allow_requantize: false,
        };
        let mut st = State {
            model: &model,
            opts: &opts,
            n_attention_wv: 0,
            i_attention_wv: 0,
            i_ffn_down: 0,
            i_ffn_gate: 0,
            i_ffn_up: 0,
            n_fallback: 0,
            has_tied_embeddings: false,
        };
        let mut f = |ne0, t| st.fallback("t", ne0, t).unwrap();
        assert_eq!(f(512, GgmlType::Q4_K), GgmlType::Q4_K);
        assert_eq!(f(576, GgmlType::Q4_K), GgmlType::Q5_0);
        assert_eq!(f(576, GgmlType::Q5_K), GgmlType::Q5_1);
        assert_eq!(f(576, GgmlType::Q6_K), GgmlType::Q8_0);
        assert_eq!(f(576, GgmlType::Q2_K), GgmlType::Q4_0);
        assert_eq!(f(576, GgmlType::IQ4_XS), GgmlType::IQ4_NL);
        assert_eq!(f(100, GgmlType::Q6_K), GgmlType::F16);
        assert_eq!(f(100, GgmlType::Q8_0), GgmlType::F16);
        assert_eq!(st.n_fallback, 7);
    }

    #[test]
    fn presets_parse_by_name_alias_and_id() {
        assert_eq!(Ftype::parse("q4_k_m").unwrap(), Ftype::Q4_K_M);
        assert_eq!(Ftype::parse("Q4_K").unwrap(), Ftype::Q4_K_M);
        assert_eq!(Ftype::parse("15").unwrap(), Ftype::Q4_K_M);
        assert_eq!(Ftype::parse("7").unwrap(), Ftype::Q8_0);
        let e = Ftype::parse("Q9_K").unwrap_err().to_string();
        assert!(
            e.contains("unknown quantization type 'Q9_K'") && e.contains("Q4_K_M"),
            "{e}"
        );
        let e = Ftype::parse("iq2_xxs").unwrap_err().to_string();
        assert!(e.contains("IQ2_XXS is a llama-quantize preset"), "{e}");
        for p in PRESETS {
            assert_eq!(Ftype::parse(&p.ftype.id().to_string()).unwrap(), p.ftype);
        }
    }
}
