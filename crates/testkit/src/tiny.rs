//! Tiny GGUF models of every architecture specula loads (llama, qwen2, qwen3, gemma3) and of
//! the DFlash / DFlash2 / EAGLE-3 drafters for a tiny target, as editable metadata and tensor
//! lists: the tests that mutate models (`crates/models/tests/load_mutations.rs`, the
//! `model_load` fuzz target) change keys and shapes here, then write the file.
//!
//! Tensor values are not stored: each tensor has a seed and its values are drawn at write
//! time for whatever shape and type it has then, so a shape or type mutation still writes a
//! well-formed file whose weights are small finite numbers.

use specula_gguf::{Array, GgmlType, GgufWriter, Value};
use specula_quant::QType;

use crate::values;

/// Vocabulary of the tiny models (rows of the embedding and the head).
pub const N_VOCAB: usize = 32;
/// Hidden size.
pub const N_EMBD: usize = 64;
/// Query heads.
pub const N_HEAD: usize = 2;
/// K/V heads.
pub const N_HEAD_KV: usize = 1;
/// Values per head (K and V).
pub const HEAD_DIM: usize = 32;
/// Feed-forward size.
pub const N_FF: usize = 64;
/// Target layers.
pub const N_LAYER: usize = 2;
/// Experts of the tiny qwen3moe.
pub const N_EXPERT: usize = 4;
/// Experts each token uses.
pub const N_EXPERT_USED: usize = 2;
/// Hidden units of each expert.
pub const N_FF_EXP: usize = 32;
/// Key heads of the tiny qwen35's delta-net layer.
pub const SSM_HEADS_K: usize = 1;
/// Its value heads.
pub const SSM_HEADS_V: usize = 2;
/// Values per key / value head of the delta-net.
pub const SSM_HEAD_DIM: usize = 16;
/// Taps of its convolution.
pub const SSM_CONV: usize = 4;
/// The DFlash draft's MASK token.
pub const MASK_TOKEN: u32 = 3;

/// One tensor: name, dimensions in ggml order (`dims[0]` is the row length), type, and the
/// seed of its values (`norm`: values near 1, as a norm weight).
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    /// Name.
    pub name: String,
    /// Dimensions, ggml order.
    pub dims: Vec<u64>,
    /// Type in the file.
    pub ty: GgmlType,
    /// Seed of the values.
    pub seed: u64,
    /// A norm weight (values near 1) rather than a matrix (values near 0).
    pub norm: bool,
    /// Explicit values (an I64 `d2t` map, say), used as they are instead of drawn ones.
    pub raw: Option<Vec<u8>>,
}

/// A model file before it is written: metadata in order and tensors.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TinyGguf {
    /// Metadata, in file order.
    pub metadata: Vec<(String, Value)>,
    /// Tensors, in file order.
    pub tensors: Vec<Tensor>,
}

fn u(v: usize) -> Value {
    Value::U32(u32::try_from(v).expect("tiny sizes fit u32"))
}

fn d(v: &[usize]) -> Vec<u64> {
    v.iter().map(|&x| u64::try_from(x).expect("fits")).collect()
}

impl TinyGguf {
    /// Sets `key` (replacing its value in place, or appending it).
    pub fn set(&mut self, key: &str, value: Value) {
        match self.metadata.iter_mut().find(|(k, _)| k == key) {
            Some((_, v)) => *v = value,
            None => self.metadata.push((key.to_owned(), value)),
        }
    }

    /// Removes `key` if present.
    pub fn remove(&mut self, key: &str) {
        self.metadata.retain(|(k, _)| k != key);
    }

    /// The value under `key`.
    #[must_use]
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    /// Adds an F32 tensor of `dims` (ggml order).
    pub fn tensor(&mut self, name: &str, dims: &[usize], norm: bool) {
        let seed = crate::splitmix64(self.tensors.len() as u64 ^ 0x5eed);
        self.tensors.push(Tensor {
            name: name.to_owned(),
            dims: d(dims),
            ty: GgmlType::F32,
            seed,
            norm,
            raw: None,
        });
    }

    /// The tensor called `name`.
    pub fn tensor_mut(&mut self, name: &str) -> Option<&mut Tensor> {
        self.tensors.iter_mut().find(|t| t.name == name)
    }

    /// The file's bytes, or `None` when the writer refuses the metadata or a tensor (a
    /// mutation gave a shape no GGUF can hold: a dimension that is not whole blocks of its
    /// type, too many dimensions, a duplicate).
    #[must_use]
    pub fn to_bytes(&self) -> Option<Vec<u8>> {
        self.write(MAX_ELEMENTS)
    }

    /// [`TinyGguf::to_bytes`] without the bound on a tensor's size (the benchmarks' larger
    /// models, [`target_sized`]).
    #[must_use]
    pub fn to_bytes_large(&self) -> Option<Vec<u8>> {
        self.write(u64::MAX)
    }

    fn write(&self, max_elements: u64) -> Option<Vec<u8>> {
        let mut w = GgufWriter::new();
        for (k, v) in &self.metadata {
            w.add(k.clone(), v.clone()).ok()?;
        }
        let mut data = Vec::with_capacity(self.tensors.len());
        for t in &self.tensors {
            w.add_tensor(&t.name, t.ty, &t.dims).ok()?;
            data.push(tensor_bytes(t, max_elements)?);
        }
        let slices: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
        w.to_vec(&slices).ok()
    }
}

/// Elements above which a mutated tensor is not written (a mutation that multiplies a dim by a
/// huge factor would otherwise ask for gigabytes).
const MAX_ELEMENTS: u64 = 1 << 20;

/// The bytes of `t`: its values encoded in its type; zero bytes for integer types; `None`
/// for a shape that is not whole blocks or too large to write.
fn tensor_bytes(t: &Tensor, max_elements: u64) -> Option<Vec<u8>> {
    let n: u64 = t.dims.iter().try_fold(1u64, |acc, &x| acc.checked_mul(x))?;
    if n > max_elements {
        return None;
    }
    let row = usize::try_from(*t.dims.first().unwrap_or(&1)).ok()?;
    let n = usize::try_from(n).ok()?;
    let bytes = usize::try_from(t.ty.row_bytes(u64::try_from(n).ok()?)?).ok()?;
    if let Some(raw) = &t.raw {
        // Explicit values of another shape (a mutated `d2t`): zeros of the new size.
        return Some(if raw.len() == bytes {
            raw.clone()
        } else {
            vec![0; bytes]
        });
    }
    let vals: Vec<f32> = if t.norm {
        values(t.seed, n, 0.25).iter().map(|v| 1.0 + v).collect()
    } else {
        values(t.seed, n, 0.25)
    };
    let Some(q) = QType::from_ggml_id(t.ty.id()) else {
        return Some(vec![0; bytes]);
    };
    if row == 0 {
        return Some(Vec::new());
    }
    let rb = q.row_bytes(row).ok()?;
    let mut out = vec![0u8; rb * (n / row)];
    for (src, dst) in vals.chunks_exact(row).zip(out.chunks_exact_mut(rb)) {
        if specula_quant::quantize_row(q, src, dst).is_err() {
            // Activation-only and KV-only formats have no weight quantizer: any bytes do, the
            // loader must refuse the type.
            return Some(vec![0; bytes]);
        }
    }
    (out.len() == bytes).then_some(out)
}

/// The tiny targets: one per architecture, and `gemma4-e`, Gemma 4 as E2B / E4B lay it out
/// ([`arch_of`] gives a target's architecture).
pub const ARCHS: [&str; 11] = [
    "llama",
    "qwen2",
    "qwen3",
    "gemma3",
    "qwen3moe",
    "qwen35",
    "qwen35moe",
    "qwen3next",
    "laguna",
    "gemma4",
    "gemma4-e",
];

/// The architecture of the tiny target `label` (one of [`ARCHS`]): `gemma4-e` is a `gemma4`.
#[must_use]
pub fn arch_of(label: &str) -> &str {
    label.strip_suffix("-e").unwrap_or(label)
}

/// Values of each layer's per-layer input in the tiny `gemma4-e`.
pub const PER_LAYER_INPUT: usize = 8;

/// The sizes of a generated target ([`target_sized`]): [`Dims::TINY`] for [`target`], larger
/// ones for benchmarks of the same architectures.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dims {
    /// Hidden size.
    pub n_embd: usize,
    /// Query heads (Laguna's second layer has twice as many).
    pub n_head: usize,
    /// K/V heads.
    pub n_head_kv: usize,
    /// Values per head (Gemma 4's global layer has twice as many).
    pub head_dim: usize,
    /// Dense feed-forward size.
    pub n_ff: usize,
    /// Experts.
    pub n_expert: usize,
    /// Experts each token uses.
    pub n_expert_used: usize,
    /// Hidden units of each expert (and of a shared expert).
    pub n_ff_exp: usize,
    /// Layers.
    pub n_layer: usize,
    /// Delta-net key heads.
    pub ssm_heads_k: usize,
    /// Delta-net value heads.
    pub ssm_heads_v: usize,
    /// Values per delta-net head.
    pub ssm_head_dim: usize,
    /// Taps of the delta-net convolution.
    pub ssm_conv: usize,
}

impl Dims {
    /// The tiny models' sizes (the module's constants).
    pub const TINY: Self = Self {
        n_embd: N_EMBD,
        n_head: N_HEAD,
        n_head_kv: N_HEAD_KV,
        head_dim: HEAD_DIM,
        n_ff: N_FF,
        n_expert: N_EXPERT,
        n_expert_used: N_EXPERT_USED,
        n_ff_exp: N_FF_EXP,
        n_layer: N_LAYER,
        ssm_heads_k: SSM_HEADS_K,
        ssm_heads_v: SSM_HEADS_V,
        ssm_head_dim: SSM_HEAD_DIM,
        ssm_conv: SSM_CONV,
    };

    /// The tiny architectures scaled up to a hidden size of 1024 — 4 layers, 8 query and 2
    /// K/V heads of 128, a dense FFN of 2816, 8 experts of 512 with 2 used, delta-net layers
    /// of 4 key and 8 value heads of 128 — where prefill and decode cost what they cost in
    /// a model (the MoE prefill benches of issue 15, on the CPU and on the device).
    pub const HIDDEN_1024: Self = Self {
        n_embd: 1024,
        n_head: 8,
        n_head_kv: 2,
        head_dim: 128,
        n_ff: 2816,
        n_expert: 8,
        n_expert_used: 2,
        n_ff_exp: 512,
        n_layer: 4,
        ssm_heads_k: 4,
        ssm_heads_v: 8,
        ssm_head_dim: 128,
        ssm_conv: 4,
    };
}

/// A tiny target of `arch` (one of [`ARCHS`]): [`N_LAYER`] layers of the tensors llama.cpp
/// names for it (Q/K/V biases for qwen2, QK-norm for qwen3, gemma3 and qwen3moe, Gemma's
/// sandwich norms and sliding window, qwen3moe's [`N_EXPERT`] experts of which each token uses
/// [`N_EXPERT_USED`]; qwen35 / qwen35moe: layer 0 a gated delta-net of [`SSM_HEADS_K`] key and
/// [`SSM_HEADS_V`] value heads, layer 1 gated attention with partial RoPE, qwen35moe's experts
/// with a gated shared expert; laguna: a global dense layer of [`N_HEAD`] query heads with
/// YaRN, then a sliding-window MoE layer of twice as many with a correction bias and a shared
/// expert, both softplus-gated per head; gemma4: a sliding layer of [`HEAD_DIM`]-value heads,
/// then a global one of twice as wide heads with V from K and `rope_freqs`, each with a GELU
/// MLP beside experts; gemma4-e: twice as many layers, [sliding, global]×[`N_LAYER`], dense
/// GELU MLPs, per-layer inputs of [`PER_LAYER_INPUT`] values, and the second half of the
/// layers sharing the K/V of the last earlier layer of their kind, with MLPs twice as wide),
/// F32, with a byte-level vocabulary of [`N_VOCAB`] tokens.
///
/// # Panics
/// For an architecture not in [`ARCHS`].
#[must_use]
pub fn target(arch: &str) -> TinyGguf {
    target_sized(arch, &Dims::TINY)
}

/// [`target`] with the sizes `d`.
///
/// # Panics
/// For an architecture not in [`ARCHS`].
#[must_use]
pub fn target_sized(arch: &str, d: &Dims) -> TinyGguf {
    assert!(ARCHS.contains(&arch), "no tiny {arch}");
    let edge = arch == "gemma4-e";
    let arch = arch_of(arch);
    let d = &Dims {
        n_layer: if edge { 2 * d.n_layer } else { d.n_layer },
        ..*d
    };
    // Gemma 4 E: the layers from `first_shared` on read an earlier layer's K/V.
    let first_shared = if edge { d.n_layer / 2 } else { d.n_layer };
    let shared = |i: usize| i >= first_shared;
    let ff = |i: usize| if shared(i) { 2 * d.n_ff } else { d.n_ff };
    let mut g = TinyGguf::default();
    let k = |s: &str| format!("{arch}.{s}");
    g.set("general.architecture", Value::String(arch.into()));
    g.set(&k("block_count"), u(d.n_layer));
    g.set(&k("context_length"), u(256));
    g.set(&k("embedding_length"), u(d.n_embd));
    g.set(&k("feed_forward_length"), u(d.n_ff));
    g.set(&k("attention.head_count"), u(d.n_head));
    g.set(&k("attention.head_count_kv"), u(d.n_head_kv));
    g.set(&k("attention.key_length"), u(d.head_dim));
    g.set(&k("attention.value_length"), u(d.head_dim));
    g.set(&k("rope.dimension_count"), u(d.head_dim));
    g.set(&k("rope.freq_base"), Value::F32(10_000.0));
    g.set(&k("attention.layer_norm_rms_epsilon"), Value::F32(1e-6));
    if arch == "gemma3" {
        g.set(&k("attention.sliding_window"), u(2));
        g.set(&k("attention.sliding_window_pattern"), u(2));
        g.set(&k("rope.freq_base_swa"), Value::F32(10_000.0));
    }
    let moe = matches!(arch, "qwen3moe" | "qwen35moe" | "qwen3next" | "laguna")
        || (arch == "gemma4" && !edge);
    let gemma4 = arch == "gemma4";
    // Values per head of each layer (Gemma 4's global layer is wider).
    let hd = |i: usize| {
        if gemma4 && i % 2 == 1 {
            2 * d.head_dim
        } else {
            d.head_dim
        }
    };
    if gemma4 {
        g.set(&k("attention.key_length"), u(2 * d.head_dim));
        g.set(&k("attention.value_length"), u(2 * d.head_dim));
        g.set(&k("attention.key_length_swa"), u(d.head_dim));
        g.set(&k("attention.value_length_swa"), u(d.head_dim));
        g.set(&k("rope.dimension_count"), u(2 * d.head_dim));
        g.set(&k("rope.dimension_count_swa"), u(d.head_dim));
        g.set(&k("attention.sliding_window"), u(2));
        g.set(
            &k("attention.sliding_window_pattern"),
            Value::Array(Array::Bool((0..d.n_layer).map(|i| i % 2 == 0).collect())),
        );
        g.set(&k("rope.freq_base_swa"), Value::F32(10_000.0));
        g.set(&k("final_logit_softcapping"), Value::F32(30.0));
    }
    if edge {
        g.set(&k("embedding_length_per_layer_input"), u(PER_LAYER_INPUT));
        g.set(
            &k("attention.shared_kv_layers"),
            u(d.n_layer - first_shared),
        );
        let widths: Vec<i32> = (0..d.n_layer)
            .map(|i| i32::try_from(ff(i)).expect("tiny"))
            .collect();
        g.set(&k("feed_forward_length"), Value::Array(Array::I32(widths)));
    }
    let laguna = arch == "laguna";
    // Query heads of each layer (Laguna's differ).
    let heads = |i: usize| if laguna { d.n_head << i } else { d.n_head };
    if laguna {
        let h: Vec<i32> = (0..d.n_layer)
            .map(|i| i32::try_from(heads(i)).expect("tiny"))
            .collect();
        g.set(&k("attention.head_count"), Value::Array(Array::I32(h)));
        g.set(&k("attention.sliding_window"), u(2));
        g.set(&k("rope.freq_base_swa"), Value::F32(10_000.0));
        g.set(&k("rope.dimension_count"), u(16));
        g.set(&k("rope.dimension_count_swa"), u(d.head_dim));
        g.set(&k("rope.scaling.type"), Value::String("yarn".into()));
        g.set(&k("rope.scaling.factor"), Value::F32(4.0));
        g.set(&k("rope.scaling.original_context_length"), u(64));
        g.set(&k("rope.scaling.yarn_attn_factor"), Value::F32(1.0));
        g.set(&k("rope.scaling.yarn_beta_fast"), Value::F32(32.0));
        g.set(&k("rope.scaling.yarn_beta_slow"), Value::F32(1.0));
        g.set(&k("leading_dense_block_count"), u(1));
        g.set(&k("expert_shared_feed_forward_length"), u(d.n_ff_exp));
        g.set(&k("expert_weights_norm"), Value::Bool(true));
        g.set(&k("expert_weights_scale"), Value::F32(2.5));
        g.set(&k("expert_gating_func"), u(2));
    }
    let hybrid = matches!(arch, "qwen35" | "qwen35moe" | "qwen3next");
    // Qwen3-Next: β and α in one projection, its experts with a gated shared expert.
    let next = arch == "qwen3next";
    if moe {
        g.set(&k("expert_count"), u(d.n_expert));
        g.set(&k("expert_used_count"), u(d.n_expert_used));
        g.set(&k("expert_feed_forward_length"), u(d.n_ff_exp));
    }
    if matches!(arch, "qwen35moe" | "qwen3next") {
        g.set(&k("expert_shared_feed_forward_length"), u(d.n_ff_exp));
    }
    if hybrid {
        g.set(&k("rope.dimension_count"), u(8));
        g.set(&k("ssm.conv_kernel"), u(d.ssm_conv));
        g.set(&k("ssm.state_size"), u(d.ssm_head_dim));
        g.set(&k("ssm.group_count"), u(d.ssm_heads_k));
        g.set(&k("ssm.time_step_rank"), u(d.ssm_heads_v));
        g.set(&k("ssm.inner_size"), u(d.ssm_heads_v * d.ssm_head_dim));
        g.set(&k("full_attention_interval"), u(2));
    }
    tokenizer(&mut g);
    let (e, q, kv) = (d.n_embd, d.n_head * d.head_dim, d.n_head_kv * d.head_dim);
    if gemma4 {
        // Proportional RoPE's divisors: near 1 for every pair of the global layer's heads.
        g.tensor("rope_freqs.weight", &[d.head_dim], true);
    }
    g.tensor("token_embd.weight", &[e, N_VOCAB], false);
    g.tensor("output_norm.weight", &[e], true);
    if edge {
        let all = PER_LAYER_INPUT * d.n_layer;
        g.tensor("per_layer_token_embd.weight", &[all, N_VOCAB], false);
        g.tensor("per_layer_model_proj.weight", &[e, all], false);
        g.tensor("per_layer_proj_norm.weight", &[PER_LAYER_INPUT], true);
    }
    if matches!(
        arch,
        "llama" | "qwen3" | "qwen3moe" | "qwen35moe" | "qwen3next" | "laguna"
    ) {
        g.tensor("output.weight", &[e, N_VOCAB], false);
    }
    for i in 0..d.n_layer {
        let n = |s: &str| format!("blk.{i}.{s}");
        g.tensor(&n("attn_norm.weight"), &[e], true);
        if hybrid && i % 2 == 0 {
            // The gated delta-net (llama.cpp `qwen35.cpp` `load_block_trunk`).
            let (kd, vd) = (
                d.ssm_heads_k * d.ssm_head_dim,
                d.ssm_heads_v * d.ssm_head_dim,
            );
            let ch = 2 * kd + vd;
            g.tensor(&n("attn_qkv.weight"), &[e, ch], false);
            g.tensor(&n("attn_gate.weight"), &[e, vd], false);
            g.tensor(&n("ssm_conv1d.weight"), &[d.ssm_conv, ch], false);
            g.tensor(&n("ssm_dt.bias"), &[d.ssm_heads_v], false);
            g.tensor(&n("ssm_a"), &[d.ssm_heads_v], false);
            if next {
                g.tensor(&n("ssm_ba.weight"), &[e, 2 * d.ssm_heads_v], false);
            } else {
                g.tensor(&n("ssm_beta.weight"), &[e, d.ssm_heads_v], false);
                g.tensor(&n("ssm_alpha.weight"), &[e, d.ssm_heads_v], false);
            }
            g.tensor(&n("ssm_norm.weight"), &[d.ssm_head_dim], true);
            g.tensor(&n("ssm_out.weight"), &[vd, e], false);
        } else {
            // A gated attention's Q projection holds each head's query and its gate.
            let (q, kv) = (heads(i) * hd(i), d.n_head_kv * hd(i));
            let q_out = if hybrid { 2 * q } else { q };
            g.tensor(&n("attn_q.weight"), &[e, q_out], false);
            // Gemma 4's KV-shared layers have no K/V projections.
            if !shared(i) {
                g.tensor(&n("attn_k.weight"), &[e, kv], false);
            }
            // Gemma 4's global layers take V from K.
            if !(shared(i) || gemma4 && i % 2 == 1) {
                g.tensor(&n("attn_v.weight"), &[e, kv], false);
            }
            g.tensor(&n("attn_output.weight"), &[q, e], false);
            if laguna {
                g.tensor(&n("attn_gate.weight"), &[e, heads(i)], false);
            }
        }
        if arch == "qwen2" {
            g.tensor(&n("attn_q.bias"), &[q], false);
            g.tensor(&n("attn_k.bias"), &[kv], false);
            g.tensor(&n("attn_v.bias"), &[kv], false);
        }
        if matches!(arch, "qwen3" | "gemma3" | "qwen3moe" | "laguna" | "gemma4")
            || (hybrid && i % 2 == 1)
        {
            g.tensor(&n("attn_q_norm.weight"), &[hd(i)], true);
            if !shared(i) {
                g.tensor(&n("attn_k_norm.weight"), &[hd(i)], true);
            }
        }
        if matches!(arch, "gemma3" | "gemma4") {
            g.tensor(&n("post_attention_norm.weight"), &[e], true);
            g.tensor(&n("post_ffw_norm.weight"), &[e], true);
        }
        if edge {
            g.tensor(&n("inp_gate.weight"), &[e, PER_LAYER_INPUT], false);
            g.tensor(&n("proj.weight"), &[PER_LAYER_INPUT, e], false);
            g.tensor(&n("post_norm.weight"), &[e], true);
        }
        if gemma4 {
            g.tensor(&n("layer_output_scale.weight"), &[1], true);
        }
        if gemma4 && moe {
            g.tensor(&n("post_ffw_norm_1.weight"), &[e], true);
            g.tensor(&n("pre_ffw_norm_2.weight"), &[e], true);
            g.tensor(&n("post_ffw_norm_2.weight"), &[e], true);
            g.tensor(&n("ffn_gate_inp.scale"), &[e], true);
        }
        // Qwen3.5 names the norm before its FFN `post_attention_norm`.
        let ffn_norm = if hybrid {
            "post_attention_norm.weight"
        } else {
            "ffn_norm.weight"
        };
        g.tensor(&n(ffn_norm), &[e], true);
        // Laguna's first layer is dense.
        if moe && !(laguna && i == 0) {
            g.tensor(&n("ffn_gate_inp.weight"), &[e, d.n_expert], false);
            if gemma4 {
                // Fused, gate rows first, as the converter writes Gemma 4's experts.
                g.tensor(
                    &n("ffn_gate_up_exps.weight"),
                    &[e, 2 * d.n_ff_exp, d.n_expert],
                    false,
                );
                g.tensor(&n("ffn_down_exps.scale"), &[d.n_expert], true);
            } else {
                g.tensor(
                    &n("ffn_gate_exps.weight"),
                    &[e, d.n_ff_exp, d.n_expert],
                    false,
                );
                g.tensor(
                    &n("ffn_up_exps.weight"),
                    &[e, d.n_ff_exp, d.n_expert],
                    false,
                );
            }
            g.tensor(
                &n("ffn_down_exps.weight"),
                &[d.n_ff_exp, e, d.n_expert],
                false,
            );
            if matches!(arch, "qwen35moe" | "qwen3next" | "laguna") {
                g.tensor(&n("ffn_gate_shexp.weight"), &[e, d.n_ff_exp], false);
                g.tensor(&n("ffn_up_shexp.weight"), &[e, d.n_ff_exp], false);
                g.tensor(&n("ffn_down_shexp.weight"), &[d.n_ff_exp, e], false);
            }
            if matches!(arch, "qwen35moe" | "qwen3next") {
                g.tensor(&n("ffn_gate_inp_shexp.weight"), &[e], false);
            }
            if laguna {
                g.tensor(&n("exp_probs_b.bias"), &[d.n_expert], false);
            }
        }
        if !moe || (laguna && i == 0) || gemma4 {
            g.tensor(&n("ffn_gate.weight"), &[e, ff(i)], false);
            g.tensor(&n("ffn_up.weight"), &[e, ff(i)], false);
            g.tensor(&n("ffn_down.weight"), &[ff(i), e], false);
        }
    }
    g
}

/// A SentencePiece vocabulary of [`N_VOCAB`] tokens (`<unk>`, `<s>`, `</s>`, then `▁a`, `▁b`,
/// …), enough for `specula run` to tokenize a prompt.
fn tokenizer(g: &mut TinyGguf) {
    let mut tokens: Vec<String> = ["<unk>", "<s>", "</s>"].map(String::from).to_vec();
    let mut types = vec![2, 3, 3];
    let mut i = 0u32;
    while tokens.len() < N_VOCAB {
        let c = char::from_u32(u32::from('a') + i % 26).expect("a letter");
        tokens.push(format!("\u{2581}{c}{}", i / 26));
        types.push(1);
        i += 1;
    }
    tokens[3] = "\u{2581}a".into();
    let scores: Vec<f32> = (0..N_VOCAB)
        .map(|i| -f32::from(u8::try_from(i).expect("tiny")))
        .collect();
    g.set("tokenizer.ggml.model", Value::String("llama".into()));
    g.set("tokenizer.ggml.tokens", Value::Array(Array::String(tokens)));
    g.set("tokenizer.ggml.scores", Value::Array(Array::F32(scores)));
    g.set("tokenizer.ggml.token_type", Value::Array(Array::I32(types)));
    g.set("tokenizer.ggml.bos_token_id", Value::U32(1));
    g.set("tokenizer.ggml.eos_token_id", Value::U32(2));
}

/// The drafters a tiny target takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Drafter {
    /// DFlash (one Qwen3-style layer, taps `[1, 2]`).
    Dflash,
    /// DFlash2: DFlash with the dynamic convolutions and the candidate selector.
    Dflash2,
    /// EAGLE-3 (taps `[0, 1, 2]`, a reduced vocabulary with `d2t` and its own head).
    Eagle3,
}

/// A DFlash (or DFlash2) draft for a tiny target: the target's embedding and head borrowed.
#[must_use]
pub fn dflash(dflash2: bool) -> TinyGguf {
    let mut g = TinyGguf::default();
    let k = |s: &str| format!("dflash.{s}");
    g.set("general.architecture", Value::String("dflash".into()));
    g.set(&k("block_count"), u(1));
    g.set(&k("embedding_length"), u(N_EMBD));
    g.set(&k("feed_forward_length"), u(N_FF));
    g.set(&k("attention.head_count"), u(N_HEAD));
    g.set(&k("attention.head_count_kv"), u(N_HEAD_KV));
    g.set(&k("attention.key_length"), u(HEAD_DIM));
    g.set(&k("attention.value_length"), u(HEAD_DIM));
    g.set(&k("rope.freq_base"), Value::F32(10_000.0));
    g.set(&k("attention.layer_norm_rms_epsilon"), Value::F32(1e-6));
    g.set(&k("target_layers"), Value::Array(Array::U32(vec![1, 2])));
    g.set(&k("block_size"), u(4));
    g.set("tokenizer.ggml.mask_token_id", Value::U32(MASK_TOKEN));
    let (e, q, kv) = (N_EMBD, N_HEAD * HEAD_DIM, N_HEAD_KV * HEAD_DIM);
    let (kernel, group, rank, top_k) = (2, 16, 4, 2);
    if dflash2 {
        g.set(&k("selector_top_k"), u(top_k));
        g.set(&k("conv_kernel_size"), u(kernel));
        g.set(&k("conv_group_size"), u(group));
        g.set(&k("selector_rank"), u(rank));
    }
    g.tensor("fc.weight", &[2 * e, e], false);
    g.tensor("enc.output_norm.weight", &[e], true);
    g.tensor("output_norm.weight", &[e], true);
    let n = |s: &str| format!("blk.0.{s}");
    g.tensor(&n("attn_norm.weight"), &[e], true);
    g.tensor(&n("attn_q.weight"), &[e, q], false);
    g.tensor(&n("attn_k.weight"), &[e, kv], false);
    g.tensor(&n("attn_v.weight"), &[e, kv], false);
    g.tensor(&n("attn_output.weight"), &[q, e], false);
    g.tensor(&n("attn_q_norm.weight"), &[HEAD_DIM], true);
    g.tensor(&n("attn_k_norm.weight"), &[HEAD_DIM], true);
    g.tensor(&n("ffn_norm.weight"), &[e], true);
    g.tensor(&n("ffn_gate.weight"), &[e, N_FF], false);
    g.tensor(&n("ffn_up.weight"), &[e, N_FF], false);
    g.tensor(&n("ffn_down.weight"), &[N_FF, e], false);
    if dflash2 {
        for which in ["attn", "ffn"] {
            g.tensor(&n(&format!("{which}_conv_base")), &[e, kernel, 2], false);
            g.tensor(
                &n(&format!("{which}_conv_proj.weight")),
                &[e, 2 * kernel * (e / group)],
                false,
            );
        }
        g.tensor("selector_hidden.weight", &[e, rank], false);
        g.tensor("selector_predecessor.weight", &[rank, N_VOCAB], false);
        g.tensor("selector_successor.weight", &[rank, N_VOCAB], false);
    }
    g
}

/// An EAGLE-3 head for a tiny target, with a reduced vocabulary (every other token, `d2t`)
/// and its own head over it; the embedding borrowed.
#[must_use]
pub fn eagle3() -> TinyGguf {
    let mut g = TinyGguf::default();
    let k = |s: &str| format!("eagle3.{s}");
    g.set("general.architecture", Value::String("eagle3".into()));
    g.set(&k("block_count"), u(1));
    g.set(&k("embedding_length"), u(N_EMBD));
    g.set(&k("feed_forward_length"), u(N_FF));
    g.set(&k("attention.head_count"), u(N_HEAD));
    g.set(&k("attention.head_count_kv"), u(N_HEAD_KV));
    g.set(&k("attention.key_length"), u(HEAD_DIM));
    g.set(&k("rope.freq_base"), Value::F32(10_000.0));
    g.set(&k("attention.layer_norm_rms_epsilon"), Value::F32(1e-6));
    g.set(&k("target_layers"), Value::Array(Array::U32(vec![0, 1, 2])));
    g.set(&k("target_hidden_size"), u(N_EMBD));
    let (e, q, kv) = (N_EMBD, N_HEAD * HEAD_DIM, N_HEAD_KV * HEAD_DIM);
    let n_draft = N_VOCAB / 2;
    g.tensor("fc.weight", &[3 * e, e], false);
    let n = |s: &str| format!("blk.0.{s}");
    g.tensor(&n("attn_norm.weight"), &[e], true);
    g.tensor(&n("attn_norm_2.weight"), &[e], true);
    g.tensor(&n("attn_q.weight"), &[2 * e, q], false);
    g.tensor(&n("attn_k.weight"), &[2 * e, kv], false);
    g.tensor(&n("attn_v.weight"), &[2 * e, kv], false);
    g.tensor(&n("attn_output.weight"), &[q, e], false);
    g.tensor(&n("ffn_norm.weight"), &[e], true);
    g.tensor(&n("ffn_gate.weight"), &[e, N_FF], false);
    g.tensor(&n("ffn_up.weight"), &[e, N_FF], false);
    g.tensor(&n("ffn_down.weight"), &[N_FF, e], false);
    g.tensor("output_norm.weight", &[e], true);
    g.tensor("output.weight", &[e, n_draft], false);
    let ids: Vec<u8> = (0..n_draft)
        .flat_map(|i| (2 * i64::try_from(i).expect("fits")).to_le_bytes())
        .collect();
    g.tensors.push(Tensor {
        name: "d2t".into(),
        dims: d(&[n_draft]),
        ty: GgmlType::I64,
        seed: 0,
        norm: false,
        raw: Some(ids),
    });
    g
}
