//! The forward pass against Hugging Face transformers: golden logits of tiny random llama, qwen2
//! and qwen3 models (`golden/hf_tiny/`, written by `reference/hf_tiny_golden.py`).
//!
//! For each architecture the GGUF is rebuilt here with specula's `GgufWriter` from the formula
//! the script uses (weights from splitmix64 of tensor and element number, llama's Q/K rows
//! permuted as `convert_hf_to_gguf.py` does, the converter's metadata order); its sha256 must be
//! the one of the file gguf-py wrote, so the model is exactly the one transformers ran. It is
//! then loaded on the CPU backend and every sequence is run twice, with an F32 KV cache: as one
//! batch (logits of every row) and token by token (one-token decodes). Both must be within
//! NMSE `Σ(ours − hf)² / Σhf²` ≤ 1e-6 of transformers' float32 logits, and bit-identical to
//! each other (batch invariance).

mod common;

use std::sync::Arc;

use serde_json::Value as Json;
use specula_cpu::CpuBackend;
use specula_gguf::{Array, GgmlType, Gguf, GgufWriter, Value};
use specula_models::{Arch, Model};
use specula_quant::QType;
use specula_testkit::{byte_symbols, splitmix64};

use common::{base64_decode, f32_le, max_abs_diff, nmse, sha256_hex};

const N_VOCAB: usize = 256;
const N_EMBD: usize = 64;
const N_LAYER: usize = 2;
const N_FF: usize = 128;
const N_HEAD: usize = 4;
const N_HEAD_KV: usize = 2;
const HEAD_DIM: usize = 16;
const N_CTX: usize = 128;
const RMS_EPS: f32 = 1e-6;

/// The acceptance bound on the NMSE of our logits against transformers' float32 logits.
const NMSE_MAX: f64 = 1e-6;

/// One tiny model, as `ARCHS` of the script describes it.
struct Spec {
    arch: &'static str,
    rope_theta: f32,
    tied: bool,
    qkv_bias: bool,
    qk_norm: bool,
    permute_qk: bool,
}

const LLAMA: Spec = Spec {
    arch: "llama",
    rope_theta: 10_000.0,
    tied: false,
    qkv_bias: false,
    qk_norm: false,
    permute_qk: true,
};
const QWEN2: Spec = Spec {
    arch: "qwen2",
    rope_theta: 1_000_000.0,
    tied: true,
    qkv_bias: true,
    qk_norm: false,
    permute_qk: false,
};
const QWEN3: Spec = Spec {
    arch: "qwen3",
    rope_theta: 1_000_000.0,
    tied: false,
    qkv_bias: false,
    qk_norm: true,
    permute_qk: false,
};

// ---------------------------------------------------------------------------------------------
// The weights: the formula of reference/hf_tiny_golden.py.

/// The tensors `save_pretrained` stores, with their shapes (PyTorch order), sorted by name as
/// the safetensors file and hence `convert_hf_to_gguf.py` order them.
fn hf_tensors(spec: &Spec) -> Vec<(String, Vec<usize>)> {
    let (q, kv) = (N_HEAD * HEAD_DIM, N_HEAD_KV * HEAD_DIM);
    let mut out = vec![
        (
            "model.embed_tokens.weight".to_owned(),
            vec![N_VOCAB, N_EMBD],
        ),
        ("model.norm.weight".to_owned(), vec![N_EMBD]),
    ];
    if !spec.tied {
        out.push(("lm_head.weight".to_owned(), vec![N_VOCAB, N_EMBD]));
    }
    for l in 0..N_LAYER {
        let mut layer = vec![
            ("input_layernorm.weight", vec![N_EMBD]),
            ("post_attention_layernorm.weight", vec![N_EMBD]),
            ("mlp.gate_proj.weight", vec![N_FF, N_EMBD]),
            ("mlp.up_proj.weight", vec![N_FF, N_EMBD]),
            ("mlp.down_proj.weight", vec![N_EMBD, N_FF]),
            ("self_attn.q_proj.weight", vec![q, N_EMBD]),
            ("self_attn.k_proj.weight", vec![kv, N_EMBD]),
            ("self_attn.v_proj.weight", vec![kv, N_EMBD]),
            ("self_attn.o_proj.weight", vec![N_EMBD, q]),
        ];
        if spec.qkv_bias {
            layer.push(("self_attn.q_proj.bias", vec![q]));
            layer.push(("self_attn.k_proj.bias", vec![kv]));
            layer.push(("self_attn.v_proj.bias", vec![kv]));
        }
        if spec.qk_norm {
            layer.push(("self_attn.q_norm.weight", vec![HEAD_DIM]));
            layer.push(("self_attn.k_norm.weight", vec![HEAD_DIM]));
        }
        out.extend(
            layer
                .into_iter()
                .map(|(name, shape)| (format!("model.layers.{l}.{name}"), shape)),
        );
    }
    // Python sorts str by code point; for ASCII that is Rust's byte order.
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

fn gguf_name(hf: &str) -> String {
    match hf {
        "lm_head.weight" => return "output.weight".into(),
        "model.embed_tokens.weight" => return "token_embd.weight".into(),
        "model.norm.weight" => return "output_norm.weight".into(),
        _ => {}
    }
    let rest = hf.strip_prefix("model.layers.").expect("a layer tensor");
    let (l, name) = rest.split_once('.').expect("layer number");
    let ours = match name {
        "input_layernorm.weight" => "attn_norm.weight",
        "mlp.down_proj.weight" => "ffn_down.weight",
        "mlp.gate_proj.weight" => "ffn_gate.weight",
        "mlp.up_proj.weight" => "ffn_up.weight",
        "post_attention_layernorm.weight" => "ffn_norm.weight",
        "self_attn.k_norm.weight" => "attn_k_norm.weight",
        "self_attn.k_proj.bias" => "attn_k.bias",
        "self_attn.k_proj.weight" => "attn_k.weight",
        "self_attn.o_proj.weight" => "attn_output.weight",
        "self_attn.q_norm.weight" => "attn_q_norm.weight",
        "self_attn.q_proj.bias" => "attn_q.bias",
        "self_attn.q_proj.weight" => "attn_q.weight",
        "self_attn.v_proj.bias" => "attn_v.bias",
        "self_attn.v_proj.weight" => "attn_v.weight",
        other => panic!("no llama.cpp name for {other}"),
    };
    format!("blk.{l}.{ours}")
}

/// `None` for norm weights (values near 1), else the power of two scaling uniform [−1, 1).
fn scale_log2(hf: &str) -> Option<i32> {
    if hf.ends_with("layernorm.weight") || hf.ends_with("_norm.weight") || hf == "model.norm.weight"
    {
        None
    } else if hf == "model.embed_tokens.weight" {
        Some(0)
    } else if hf.ends_with("down_proj.weight") {
        Some(-3)
    } else if hf.ends_with("q_proj.weight") {
        Some(-1)
    } else {
        Some(-2)
    }
}

/// The values of tensor number `t` (`n` elements, row-major in the Hugging Face layout).
fn tensor_values(t: usize, n: usize, scale: Option<i32>) -> Vec<f32> {
    let t = u64::try_from(t).expect("fits");
    (0..n)
        .map(|i| {
            let z = splitmix64((t << 32) | u64::try_from(i).expect("fits"));
            let v = i32::try_from(z >> 40).expect("24 bits") - (1 << 23);
            let x = match scale {
                None => 1.0 + f64::from(v) / f64::from(1u32 << 26),
                Some(s) => f64::from(v) * 2f64.powi(s - 23),
            };
            // Exact in f64; one round-to-nearest-even to f32, as numpy's astype(float32).
            #[allow(
                clippy::cast_possible_truncation,
                reason = "the one intended f64 → f32 rounding"
            )]
            let y = x as f32;
            y
        })
        .collect()
}

/// `LlamaModel.permute` of `convert_hf_to_gguf.py`: within each of the `n_head` heads, output
/// row `2j + p` is input row `p · half + j` (rotate_half pairs → adjacent pairs).
fn permute(w: &[f32], rows: usize, cols: usize, n_head: usize) -> Vec<f32> {
    let head = rows / n_head;
    let half = head / 2;
    let mut out = Vec::with_capacity(w.len());
    for h in 0..n_head {
        for j in 0..half {
            for p in 0..2 {
                let src = h * head + p * half + j;
                out.extend_from_slice(&w[src * cols..(src + 1) * cols]);
            }
        }
    }
    out
}

/// A rebuilt model file: its bytes, metadata keys and tensor descriptions (for diagnostics).
struct Rebuilt {
    bytes: Vec<u8>,
    keys: Vec<String>,
    tensors: Vec<TensorDesc>,
}

/// What the golden file says of each tensor.
#[derive(Debug, PartialEq)]
struct TensorDesc {
    name: String,
    hf_name: String,
    /// ggml order.
    dims: Vec<u64>,
    scale_log2: Option<i32>,
    permuted: bool,
}

fn rebuild(spec: &Spec) -> Rebuilt {
    let a = spec.arch;
    let u32_ = |v: usize| Value::U32(u32::try_from(v).expect("fits"));
    let str_ = |v: &str| Value::String(v.to_owned());
    let mut md = vec![
        ("general.architecture".to_owned(), str_(a)),
        ("general.type".to_owned(), str_("model")),
        (
            "general.name".to_owned(),
            str_(&format!("specula-hf-tiny-{a}")),
        ),
        (format!("{a}.block_count"), u32_(N_LAYER)),
        (format!("{a}.context_length"), u32_(N_CTX)),
        (format!("{a}.embedding_length"), u32_(N_EMBD)),
        (format!("{a}.feed_forward_length"), u32_(N_FF)),
        (format!("{a}.attention.head_count"), u32_(N_HEAD)),
        (format!("{a}.attention.head_count_kv"), u32_(N_HEAD_KV)),
        (format!("{a}.rope.freq_base"), Value::F32(spec.rope_theta)),
        (
            format!("{a}.attention.layer_norm_rms_epsilon"),
            Value::F32(RMS_EPS),
        ),
        (format!("{a}.attention.key_length"), u32_(HEAD_DIM)),
        (format!("{a}.attention.value_length"), u32_(HEAD_DIM)),
        ("general.file_type".to_owned(), Value::U32(0)),
    ];
    if a == "llama" {
        md.push((format!("{a}.vocab_size"), u32_(N_VOCAB)));
        md.push((format!("{a}.rope.dimension_count"), u32_(HEAD_DIM)));
    }
    md.extend([
        ("tokenizer.ggml.model".to_owned(), str_("gpt2")),
        ("tokenizer.ggml.pre".to_owned(), str_("default")),
        (
            "tokenizer.ggml.tokens".to_owned(),
            Value::Array(Array::String(byte_symbols())),
        ),
        (
            "tokenizer.ggml.token_type".to_owned(),
            Value::Array(Array::I32(vec![1; N_VOCAB])),
        ),
        (
            "tokenizer.ggml.merges".to_owned(),
            Value::Array(Array::String(vec!["a 1".into()])),
        ),
        ("tokenizer.ggml.bos_token_id".to_owned(), Value::U32(0)),
        ("tokenizer.ggml.eos_token_id".to_owned(), Value::U32(0)),
        ("general.quantization_version".to_owned(), Value::U32(2)),
    ]);

    let mut w = GgufWriter::new();
    let keys = md.iter().map(|(k, _)| k.clone()).collect();
    for (k, v) in md {
        w.add(k, v).expect("metadata");
    }
    let mut data = Vec::new();
    let mut tensors = Vec::new();
    for (t, (hf, shape)) in hf_tensors(spec).into_iter().enumerate() {
        let n = shape.iter().product();
        let scale = scale_log2(&hf);
        let mut values = tensor_values(t, n, scale);
        // llama's Q and K rows are permuted by the converter (K with the K/V head count).
        let permute_heads = if !spec.permute_qk {
            None
        } else if hf.ends_with("self_attn.q_proj.weight") {
            Some(N_HEAD)
        } else if hf.ends_with("self_attn.k_proj.weight") {
            Some(N_HEAD_KV)
        } else {
            None
        };
        if let Some(heads) = permute_heads {
            values = permute(&values, shape[0], shape[1], heads);
        }
        let dims: Vec<u64> = shape
            .iter()
            .rev()
            .map(|&d| u64::try_from(d).expect("fits"))
            .collect();
        let name = gguf_name(&hf);
        w.add_tensor(&name, GgmlType::F32, &dims).expect("tensor");
        data.push(
            values
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect::<Vec<u8>>(),
        );
        tensors.push(TensorDesc {
            name,
            hf_name: hf,
            dims,
            scale_log2: scale,
            permuted: permute_heads.is_some(),
        });
    }
    let slices: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
    Rebuilt {
        bytes: w.to_vec(&slices).expect("write"),
        keys,
        tensors,
    }
}

// ---------------------------------------------------------------------------------------------
// The golden files.

fn golden(arch: &str) -> Json {
    common::golden("hf_tiny", arch, "hf_tiny_golden.py")
}

// ---------------------------------------------------------------------------------------------
// The test.

fn check(spec: &Spec, expected_arch: Arch) {
    let g = golden(spec.arch);
    let rebuilt = rebuild(spec);

    // The structure first, for a readable failure; then the bytes.
    let golden_keys: Vec<&str> = g["gguf"]["metadata"]
        .as_array()
        .expect("metadata")
        .iter()
        .map(|kv| kv[0].as_str().expect("key"))
        .collect();
    assert_eq!(
        rebuilt.keys, golden_keys,
        "{}: metadata keys and order",
        spec.arch
    );
    let golden_tensors = g["gguf"]["tensors"].as_array().expect("tensors");
    assert_eq!(
        rebuilt.tensors.len(),
        golden_tensors.len(),
        "{}: tensor count",
        spec.arch
    );
    for (ours, gt) in rebuilt.tensors.iter().zip(golden_tensors) {
        let theirs = TensorDesc {
            name: gt["name"].as_str().expect("name").to_owned(),
            hf_name: gt["hf_name"].as_str().expect("hf_name").to_owned(),
            dims: gt["dims"]
                .as_array()
                .expect("dims")
                .iter()
                .map(|d| d.as_u64().expect("dim"))
                .collect(),
            scale_log2: gt["scale_log2"]
                .as_i64()
                .map(|s| i32::try_from(s).expect("small")),
            permuted: gt["permuted"].as_bool().expect("permuted"),
        };
        assert_eq!(ours, &theirs, "{}: tensor description", spec.arch);
    }
    assert_eq!(
        u64::try_from(rebuilt.bytes.len()).expect("fits"),
        g["gguf"]["size"].as_u64().expect("size"),
        "{}: the rebuilt GGUF has gguf-py's size",
        spec.arch
    );
    assert_eq!(
        sha256_hex(&rebuilt.bytes),
        g["gguf"]["sha256"].as_str().expect("sha256"),
        "{}: the rebuilt GGUF is gguf-py's file byte for byte",
        spec.arch
    );

    let be = CpuBackend::new(2);
    let file = Arc::new(Gguf::from_bytes(rebuilt.bytes).expect("a valid GGUF"));
    let model = Model::load(&be, file).expect("the model loads");
    let hp = model.hparams();
    assert_eq!(hp.arch, expected_arch);
    assert_eq!(
        (
            hp.n_vocab,
            hp.n_embd,
            hp.n_layer,
            hp.n_ff,
            hp.n_head,
            hp.n_head_kv
        ),
        (N_VOCAB, N_EMBD, N_LAYER, N_FF, N_HEAD, N_HEAD_KV)
    );
    assert_eq!(
        (hp.head_dim_k, hp.head_dim_v, hp.n_rot),
        (HEAD_DIM, HEAD_DIM, HEAD_DIM)
    );
    assert_eq!((hp.rope_freq_base, hp.rms_eps), (spec.rope_theta, RMS_EPS));

    let mut scratch = model.scratch(&be);
    let sequences = g["sequences"].as_array().expect("sequences");
    assert!(!sequences.is_empty());
    for seq in sequences {
        let name = seq["name"].as_str().expect("name");
        let tokens: Vec<u32> = seq["tokens"]
            .as_array()
            .expect("tokens")
            .iter()
            .map(|t| u32::try_from(t.as_u64().expect("token")).expect("fits"))
            .collect();
        let n = tokens.len();
        let hf = f32_le(&base64_decode(
            seq["logits_f32le_base64"].as_str().expect("logits"),
        ));
        assert_eq!(
            hf.len(),
            n * N_VOCAB,
            "{} {name}: golden logits shape",
            spec.arch
        );
        let pos: Vec<u32> = (0..u32::try_from(n).expect("fits")).collect();

        // The whole sequence as one batch, logits of every row.
        let mut kv = model
            .new_kv(&be, N_CTX, QType::F32, QType::F32)
            .expect("F32 KV cache");
        let rows: Vec<usize> = (0..n).collect();
        let batch = model
            .forward(&be, &mut kv, &mut scratch, &tokens, &pos, &rows, None)
            .expect("batch forward")
            .to_vec();

        // Token by token.
        let mut kv = model
            .new_kv(&be, N_CTX, QType::F32, QType::F32)
            .expect("F32 KV cache");
        let mut decode = Vec::with_capacity(n * N_VOCAB);
        for i in 0..n {
            let row = model
                .forward(
                    &be,
                    &mut kv,
                    &mut scratch,
                    &tokens[i..=i],
                    &pos[i..=i],
                    &[0],
                    None,
                )
                .expect("decode forward");
            assert_eq!(row.len(), N_VOCAB);
            decode.extend_from_slice(row);
        }

        let (e_batch, e_decode) = (nmse(&batch, &hf), nmse(&decode, &hf));
        let oracle_noise = seq["nmse_f32_vs_f64"].as_f64().unwrap_or(f64::NAN);
        eprintln!(
            "{} {name} ({n} tokens): NMSE batch {e_batch:.3e}, decode {e_decode:.3e} \
             (max |Δ| {:.3e}; transformers f32 vs f64: {oracle_noise:.3e})",
            spec.arch,
            max_abs_diff(&batch, &hf),
        );
        assert!(
            e_batch <= NMSE_MAX,
            "{} {name}: batched logits NMSE {e_batch:.3e} > {NMSE_MAX:e}",
            spec.arch
        );
        assert!(
            e_decode <= NMSE_MAX,
            "{} {name}: decoded logits NMSE {e_decode:.3e} > {NMSE_MAX:e}",
            spec.arch
        );
        let differ = batch
            .iter()
            .zip(&decode)
            .position(|(a, b)| a.to_bits() != b.to_bits());
        assert!(
            differ.is_none(),
            "{} {name}: batch and one-by-one logits differ first at row {}, column {} \
             ({} vs {}; batch invariance)",
            spec.arch,
            differ.unwrap_or(0) / N_VOCAB,
            differ.unwrap_or(0) % N_VOCAB,
            batch[differ.unwrap_or(0)],
            decode[differ.unwrap_or(0)],
        );
    }
}

#[test]
fn llama_matches_transformers() {
    check(&LLAMA, Arch::Llama);
}

#[test]
fn qwen2_matches_transformers() {
    check(&QWEN2, Arch::Qwen2);
}

#[test]
fn qwen3_matches_transformers() {
    check(&QWEN3, Arch::Qwen3);
}

#[test]
fn base64_and_permutation_helpers() {
    assert_eq!(base64_decode("TWFu"), b"Man");
    assert_eq!(base64_decode("TWE="), b"Ma");
    assert_eq!(base64_decode("TQ=="), b"M");
    // One head of 4 rows: rotate_half pairs (0, 2), (1, 3) become adjacent.
    let w = [0.0, 1.0, 2.0, 3.0];
    assert_eq!(permute(&w, 4, 1, 1), [0.0, 2.0, 1.0, 3.0]);
    let symbols = byte_symbols();
    assert_eq!((symbols[0].as_str(), symbols[32].as_str()), ("Ā", "Ġ"));
    assert_eq!(
        (symbols[b'a' as usize].as_str(), symbols[255].as_str()),
        ("a", "ÿ")
    );
}
