//! The DFlash draft network against a PyTorch implementation of the published model
//! (`golden/dflash/tiny.json`, written by `reference/dflash_golden.py`), on a tiny random
//! Qwen3 target run by Hugging Face transformers.
//!
//! Both GGUFs are rebuilt here with specula's `GgufWriter` from the script's formula and must
//! hash to the files gguf-py wrote (the draft in llama.cpp's `dflash` layout: `fc`,
//! `enc.output_norm`, `dflash.target_layers` = HF ids + 1, `tokenizer.ggml.mask_token_id`, no
//! embedding or head of its own). Then:
//!
//! - the target's taps `dflash.target_layers` = `[3, 1]` (layer inputs) equal transformers'
//!   `hidden_states[id + 1]` for `target_layer_ids = [2, 0]`, side by side in that order;
//! - round 1 (empty draft cache: the prompt's features injected, then the block
//!   `[anchor, MASK × 7]`) and round 2 (after a verify with one accepted draft: the committed
//!   rows injected on top, the next block) give the draft logits of every block row within
//!   NMSE 1e-6 of the reference, with the same argmax — for deferred injection (only the
//!   committed rows) and for eager injection (the whole verify batch, rejected rows included,
//!   overwritten by the next block).
//!
//! And the EAGLE-3 head against a PyTorch implementation of `LlamaForCausalLMEagle3`
//! (`golden/eagle3/tiny.json`, `reference/eagle3_golden.py`), for `norm_before_residual` off
//! and on: the rebuilt GGUF (Q/K rows permuted as the converter does, `d2t` absolute I64 ids)
//! hashes to gguf-py's file; pairs `(token[P + 1], g[P])` for the prompt, then a greedy chain
//! of 5 from `(anchor, g[N − 1])`, and after a verify with one accepted token the committed
//! pairs and a second chain: every step's draft-vocabulary logits within NMSE 1e-6, the same
//! argmax, and −∞ outside `d2t`.

mod common;

use std::path::Path;
use std::sync::Arc;

use serde_json::Value as Json;
use specula_cpu::CpuBackend;
use specula_gguf::{Array, GgmlType, Gguf, GgufWriter, Value};
use specula_models::dflash::Dflash;
use specula_models::{Model, Taps};
use specula_quant::QType;
use specula_tensor::Backend;
use specula_testkit::{byte_symbols, splitmix64};

const N_VOCAB: usize = 256;
const N_EMBD: usize = 64;
const N_FF: usize = 128;
const N_HEAD: usize = 4;
const N_HEAD_KV: usize = 2;
const HEAD_DIM: usize = 16;
const N_CTX: usize = 128;
const RMS_EPS: f32 = 1e-6;
const N_LAYER_TARGET: usize = 4;
const D_LAYERS: usize = 2;
const NMSE_MAX: f64 = 1e-6;

/// `hf_tiny_golden.tensor_values`.
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
            #[allow(
                clippy::cast_possible_truncation,
                reason = "the one intended f64 → f32 rounding"
            )]
            let y = x as f32;
            y
        })
        .collect()
}

fn u32v(v: usize) -> Value {
    Value::U32(u32::try_from(v).expect("fits"))
}

fn tokenizer_md(mask: Option<u32>) -> Vec<(String, Value)> {
    let mut md = vec![
        (
            "tokenizer.ggml.model".to_owned(),
            Value::String("gpt2".into()),
        ),
        (
            "tokenizer.ggml.pre".to_owned(),
            Value::String("default".into()),
        ),
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
    ];
    if let Some(m) = mask {
        md.push(("tokenizer.ggml.mask_token_id".to_owned(), Value::U32(m)));
    }
    md.push(("general.quantization_version".to_owned(), Value::U32(2)));
    md
}

fn write(md: Vec<(String, Value)>, tensors: Vec<(String, Vec<usize>, Vec<f32>)>) -> Vec<u8> {
    write_raw(
        md,
        tensors
            .into_iter()
            .map(|(n, s, v)| {
                let bytes = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                (n, GgmlType::F32, s, bytes)
            })
            .collect(),
    )
}

/// Tensors as (name, type, shape in PyTorch order, bytes).
fn write_raw(
    md: Vec<(String, Value)>,
    tensors: Vec<(String, GgmlType, Vec<usize>, Vec<u8>)>,
) -> Vec<u8> {
    let mut w = GgufWriter::new();
    for (k, v) in md {
        w.add(k, v).expect("metadata");
    }
    let mut data = Vec::new();
    for (name, ty, shape, bytes) in tensors {
        let dims: Vec<u64> = shape
            .iter()
            .rev()
            .map(|&d| u64::try_from(d).expect("fits"))
            .collect();
        w.add_tensor(&name, ty, &dims).expect("tensor");
        data.push(bytes);
    }
    let slices: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
    w.to_vec(&slices).expect("write")
}

fn layer_gguf(name: &str) -> &'static str {
    match name {
        "input_layernorm.weight" => "attn_norm.weight",
        "mlp.down_proj.weight" => "ffn_down.weight",
        "mlp.gate_proj.weight" => "ffn_gate.weight",
        "mlp.up_proj.weight" => "ffn_up.weight",
        "post_attention_layernorm.weight" => "ffn_norm.weight",
        "self_attn.k_norm.weight" => "attn_k_norm.weight",
        "self_attn.k_proj.weight" => "attn_k.weight",
        "self_attn.o_proj.weight" => "attn_output.weight",
        "self_attn.q_norm.weight" => "attn_q_norm.weight",
        "self_attn.q_proj.weight" => "attn_q.weight",
        "self_attn.v_proj.weight" => "attn_v.weight",
        other => panic!("no llama.cpp name for {other}"),
    }
}

fn layer_shapes() -> Vec<(&'static str, Vec<usize>)> {
    let (q, kv) = (N_HEAD * HEAD_DIM, N_HEAD_KV * HEAD_DIM);
    vec![
        ("input_layernorm.weight", vec![N_EMBD]),
        ("mlp.down_proj.weight", vec![N_EMBD, N_FF]),
        ("mlp.gate_proj.weight", vec![N_FF, N_EMBD]),
        ("mlp.up_proj.weight", vec![N_FF, N_EMBD]),
        ("post_attention_layernorm.weight", vec![N_EMBD]),
        ("self_attn.k_norm.weight", vec![HEAD_DIM]),
        ("self_attn.k_proj.weight", vec![kv, N_EMBD]),
        ("self_attn.o_proj.weight", vec![N_EMBD, q]),
        ("self_attn.q_norm.weight", vec![HEAD_DIM]),
        ("self_attn.q_proj.weight", vec![q, N_EMBD]),
        ("self_attn.v_proj.weight", vec![kv, N_EMBD]),
    ]
}

/// The 4-layer variant of `reference/hf_tiny_golden.py`'s qwen3 model.
fn target_gguf() -> Vec<u8> {
    let a = "qwen3";
    let mut hf: Vec<(String, Vec<usize>)> = vec![
        ("lm_head.weight".into(), vec![N_VOCAB, N_EMBD]),
        ("model.embed_tokens.weight".into(), vec![N_VOCAB, N_EMBD]),
        ("model.norm.weight".into(), vec![N_EMBD]),
    ];
    for l in 0..N_LAYER_TARGET {
        for (n, s) in layer_shapes() {
            hf.push((format!("model.layers.{l}.{n}"), s));
        }
    }
    hf.sort_by(|x, y| x.0.cmp(&y.0));
    let tensors = hf
        .into_iter()
        .enumerate()
        .map(|(t, (name, shape))| {
            let scale = if name.ends_with("norm.weight") {
                None
            } else if name == "model.embed_tokens.weight" {
                Some(0)
            } else if name.ends_with("down_proj.weight") {
                Some(-3)
            } else if name.ends_with("q_proj.weight") {
                Some(-1)
            } else {
                Some(-2)
            };
            let values = tensor_values(t, shape.iter().product(), scale);
            let gguf = match name.as_str() {
                "lm_head.weight" => "output.weight".to_owned(),
                "model.embed_tokens.weight" => "token_embd.weight".to_owned(),
                "model.norm.weight" => "output_norm.weight".to_owned(),
                _ => {
                    let rest = name.strip_prefix("model.layers.").expect("layer");
                    let (l, n) = rest.split_once('.').expect("layer number");
                    format!("blk.{l}.{}", layer_gguf(n))
                }
            };
            (gguf, shape, values)
        })
        .collect();
    let k = |s: &str| format!("{a}.{s}");
    let mut md = vec![
        ("general.architecture".to_owned(), Value::String(a.into())),
        ("general.type".to_owned(), Value::String("model".into())),
        (
            "general.name".to_owned(),
            Value::String(format!("specula-hf-tiny-{a}")),
        ),
        (k("block_count"), u32v(N_LAYER_TARGET)),
        (k("context_length"), u32v(N_CTX)),
        (k("embedding_length"), u32v(N_EMBD)),
        (k("feed_forward_length"), u32v(N_FF)),
        (k("attention.head_count"), u32v(N_HEAD)),
        (k("attention.head_count_kv"), u32v(N_HEAD_KV)),
        (k("rope.freq_base"), Value::F32(1e6)),
        (k("attention.layer_norm_rms_epsilon"), Value::F32(RMS_EPS)),
        (k("attention.key_length"), u32v(HEAD_DIM)),
        (k("attention.value_length"), u32v(HEAD_DIM)),
        ("general.file_type".to_owned(), Value::U32(0)),
    ];
    md.extend(tokenizer_md(None));
    write(md, tensors)
}

/// The script's drafter, in llama.cpp's `dflash` layout.
fn draft_gguf() -> Vec<u8> {
    draft_gguf_with(false)
}

const D2_KERNEL: usize = 2;
const D2_GROUP: usize = 16;
const D2_RANK: usize = 8;
const D2_TOP_K: usize = 4;

/// DFlash2's extra tensors (HF name, GGUF name, shape, values): `dflash2_tensors` of the script.
fn dflash2_tensors() -> Vec<(String, String, Vec<usize>, Vec<f32>)> {
    let e = N_EMBD;
    let groups = e / D2_GROUP;
    let mut hf: Vec<(String, String, Vec<usize>)> = vec![
        (
            "candidate_selector.hidden_projection.weight".into(),
            "selector_hidden.weight".into(),
            vec![D2_RANK, e],
        ),
        (
            "candidate_selector.predecessor_codebook.weight".into(),
            "selector_predecessor.weight".into(),
            vec![N_VOCAB, D2_RANK],
        ),
        (
            "candidate_selector.successor_codebook.weight".into(),
            "selector_successor.weight".into(),
            vec![N_VOCAB, D2_RANK],
        ),
    ];
    for l in 0..D_LAYERS {
        for (c, ours) in [("attention_conv", "attn_conv"), ("mlp_conv", "ffn_conv")] {
            hf.push((
                format!("layers.{l}.{c}.base_kernel"),
                format!("blk.{l}.{ours}_base"),
                vec![2, D2_KERNEL, e],
            ));
            hf.push((
                format!("layers.{l}.{c}.kernel_projection.weight"),
                format!("blk.{l}.{ours}_proj.weight"),
                vec![2 * D2_KERNEL * groups, e],
            ));
        }
    }
    hf.sort_by(|a, b| a.0.cmp(&b.0));
    hf.into_iter()
        .enumerate()
        .map(|(t, (name, gguf, shape))| {
            let s = if name.ends_with("base_kernel") || name.ends_with("codebook.weight") {
                -1
            } else {
                -2
            };
            let v = tensor_values(t + 3000, shape.iter().product(), Some(s));
            (name, gguf, shape, v)
        })
        .collect()
}

fn draft_gguf_with(dflash2: bool) -> Vec<u8> {
    let e = N_EMBD;
    let mut hf: Vec<(String, Vec<usize>)> = vec![
        ("fc.weight".into(), vec![e, 2 * e]),
        ("hidden_norm.weight".into(), vec![e]),
        ("norm.weight".into(), vec![e]),
    ];
    for l in 0..D_LAYERS {
        for (n, s) in layer_shapes() {
            hf.push((format!("layers.{l}.{n}"), s));
        }
    }
    hf.sort_by(|x, y| x.0.cmp(&y.0));
    let base: Vec<(String, String, Vec<usize>, Vec<f32>)> = hf
        .into_iter()
        .enumerate()
        .map(|(t, (name, shape))| {
            let scale = if name.ends_with("norm.weight") {
                None
            } else if name == "fc.weight" || name.ends_with("down_proj.weight") {
                Some(-3)
            } else if name.ends_with("q_proj.weight") {
                Some(-1)
            } else {
                Some(-2)
            };
            let values = tensor_values(t + 1000, shape.iter().product(), scale);
            let gguf = match name.as_str() {
                "fc.weight" => "fc.weight".to_owned(),
                "hidden_norm.weight" => "enc.output_norm.weight".to_owned(),
                "norm.weight" => "output_norm.weight".to_owned(),
                _ => {
                    let rest = name.strip_prefix("layers.").expect("layer");
                    let (l, n) = rest.split_once('.').expect("layer number");
                    format!("blk.{l}.{}", layer_gguf(n))
                }
            };
            (name, gguf, shape, values)
        })
        .collect();
    let mut all = base;
    if dflash2 {
        all.extend(dflash2_tensors());
    }
    all.sort_by(|a, b| a.0.cmp(&b.0));
    let tensors = all
        .into_iter()
        .map(|(_, gguf, shape, values)| (gguf, shape, values))
        .collect();
    let k = |s: &str| format!("dflash.{s}");
    let mut md = vec![
        (
            "general.architecture".to_owned(),
            Value::String("dflash".into()),
        ),
        ("general.type".to_owned(), Value::String("model".into())),
        (
            "general.name".to_owned(),
            Value::String("specula-dflash-tiny".into()),
        ),
        (k("block_count"), u32v(D_LAYERS)),
        (k("context_length"), u32v(N_CTX)),
        (k("embedding_length"), u32v(N_EMBD)),
        (k("feed_forward_length"), u32v(N_FF)),
        (k("attention.head_count"), u32v(N_HEAD)),
        (k("attention.head_count_kv"), u32v(N_HEAD_KV)),
        (k("rope.freq_base"), Value::F32(1e6)),
        (k("attention.layer_norm_rms_epsilon"), Value::F32(RMS_EPS)),
        (k("attention.key_length"), u32v(HEAD_DIM)),
        (k("attention.value_length"), u32v(HEAD_DIM)),
        ("general.file_type".to_owned(), Value::U32(0)),
        (k("block_size"), u32v(8)),
        (k("target_layers"), Value::Array(Array::I32(vec![3, 1]))),
    ];
    if dflash2 {
        md[2].1 = Value::String("specula-dflash2-tiny".into());
        md.extend([
            (k("conv_kernel_size"), u32v(D2_KERNEL)),
            (k("conv_group_size"), u32v(D2_GROUP)),
            (k("selector_rank"), u32v(D2_RANK)),
            (k("selector_top_k"), u32v(D2_TOP_K)),
        ]);
    }
    md.extend(tokenizer_md(Some(250)));
    write(md, tensors)
}

fn base64_f32(s: &str) -> Vec<f32> {
    common::f32_le(&common::base64_decode(s))
}

fn nmse(ours: &[f32], reference: &[f32]) -> f64 {
    assert_eq!(ours.len(), reference.len());
    let (num, den) = ours
        .iter()
        .zip(reference)
        .fold((0.0, 0.0), |(n, d), (&o, &h)| {
            let (o, h) = (f64::from(o), f64::from(h));
            (n + (o - h) * (o - h), d + h * h)
        });
    num / den
}

fn argmax(row: &[f32]) -> usize {
    row.iter()
        .enumerate()
        .fold(
            (0, f32::NEG_INFINITY),
            |b, (i, &x)| if x > b.1 { (i, x) } else { b },
        )
        .0
}

fn ids(v: &Json) -> Vec<u32> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|x| u32::try_from(x.as_u64().expect("id")).expect("fits"))
        .collect()
}

fn usize_of(v: &Json) -> usize {
    usize::try_from(v.as_u64().expect("integer")).expect("fits")
}

fn positions(from: usize, n: usize) -> Vec<u32> {
    (from..from + n)
        .map(|p| u32::try_from(p).expect("fits"))
        .collect()
}

fn check_logits(what: &str, ours: &[f32], reference: &[f32]) {
    let e = nmse(ours, reference);
    assert!(e <= NMSE_MAX, "{what}: NMSE {e:.3e} > {NMSE_MAX:e}");
    for (r, (a, b)) in ours
        .chunks_exact(N_VOCAB)
        .zip(reference.chunks_exact(N_VOCAB))
        .enumerate()
    {
        assert_eq!(argmax(a), argmax(b), "{what}: argmax of block row {r}");
    }
}

#[test]
fn dflash_matches_the_pytorch_reference() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../golden/dflash/tiny.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (written by reference/dflash_golden.py)",
            path.display()
        )
    });
    let g: Json = serde_json::from_str(&text).expect("JSON");

    let (tb, db) = (target_gguf(), draft_gguf());
    assert_eq!(
        common::sha256_hex(&tb),
        g["target_gguf_sha256"].as_str().unwrap(),
        "the rebuilt target GGUF is not the file gguf-py wrote"
    );
    assert_eq!(
        common::sha256_hex(&db),
        g["draft_gguf_sha256"].as_str().unwrap(),
        "the rebuilt DFlash GGUF is not the file gguf-py wrote"
    );
    let be = CpuBackend::new(1);
    let target = Model::load(&be, Arc::new(Gguf::from_bytes(tb).unwrap())).unwrap();
    let net = Dflash::load(&be, Arc::new(Gguf::from_bytes(db).unwrap()), &target).unwrap();
    assert_eq!(net.hparams().target_layers, vec![3, 1]);
    assert_eq!(net.hparams().block_size, 8);
    assert_eq!(net.hparams().mask_token_id, 250);

    // Taps: the target's layer inputs [3, 1] are HF hidden_states[2 + 1], [0 + 1].
    let prompt = ids(&g["prompt"]);
    let r1 = &g["rounds"][0];
    let ctx1 = base64_f32(r1["ctx_features"].as_str().unwrap());
    let mut tkv = target.new_kv(&be, N_CTX, QType::F32, QType::F32).unwrap();
    let mut ts = target.scratch(&be);
    let mut taps = Taps {
        layers: net.hparams().target_layers.clone(),
        rows: Vec::new(),
    };
    target
        .forward(
            &be,
            &mut tkv,
            &mut ts,
            &prompt,
            &positions(0, prompt.len()),
            &[],
            Some(&mut taps),
        )
        .unwrap();
    let mut feats = Vec::new();
    for r in 0..prompt.len() {
        for t in &taps.rows {
            feats.extend_from_slice(&t[r * N_EMBD..(r + 1) * N_EMBD]);
        }
    }
    let e = nmse(&feats, &ctx1);
    assert!(
        e <= NMSE_MAX,
        "target taps vs transformers hidden states: NMSE {e:.3e}"
    );

    let r2 = &g["rounds"][1];
    let ctx2 = base64_f32(r2["ctx_features"].as_str().unwrap());
    let verify_feats = base64_f32(r2["verify_features"].as_str().unwrap());
    let (b1, b2) = (ids(&r1["block"]), ids(&r2["block"]));
    let (p1, p2) = (usize_of(&r1["block_pos0"]), usize_of(&r2["block_pos0"]));
    let (l1, l2) = (
        base64_f32(r1["logits"].as_str().unwrap()),
        base64_f32(r2["logits"].as_str().unwrap()),
    );
    let n1 = usize_of(&r1["ctx_rows"]);
    let (c2_pos0, c2_rows) = (usize_of(&r2["ctx_pos0"]), usize_of(&r2["ctx_rows"]));
    let all_rows: Vec<usize> = (0..b1.len()).collect();

    for eager in [false, true] {
        let mode = if eager { "eager" } else { "deferred" };
        let mut kv = be
            .kv_new(net.kv_shape(N_CTX, QType::F32, QType::F32))
            .unwrap();
        let mut s = net.scratch(&be);
        net.inject(&be, &mut kv, N_CTX, &mut s, &ctx1, &positions(0, n1))
            .unwrap();
        let got1 = net
            .block(&be, &mut kv, N_CTX, &mut s, &b1, p1, &all_rows)
            .unwrap()
            .to_vec();
        check_logits(&format!("{mode}: round 1"), &got1, &l1);
        if eager {
            // The whole verify batch, rejected rows included.
            let n = verify_feats.len() / (2 * N_EMBD);
            net.inject(
                &be,
                &mut kv,
                N_CTX,
                &mut s,
                &verify_feats,
                &positions(c2_pos0, n),
            )
            .unwrap();
        } else {
            net.inject(
                &be,
                &mut kv,
                N_CTX,
                &mut s,
                &ctx2,
                &positions(c2_pos0, c2_rows),
            )
            .unwrap();
        }
        let got2 = net
            .block(&be, &mut kv, N_CTX, &mut s, &b2, p2, &all_rows)
            .unwrap()
            .to_vec();
        check_logits(&format!("{mode}: round 2"), &got2, &l2);
    }
}

// ---------------------------------------------------------------------------------------------
// EAGLE-3 (`golden/eagle3/tiny.json`, written by `reference/eagle3_golden.py`).

const DRAFT_VOCAB: usize = 64;

/// `LlamaModel.permute`: within each head, row `2j + p` is row `p · half + j`.
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

fn eagle3_gguf(case: usize, name: &str, nbr: bool, d2t: &[i64]) -> Vec<u8> {
    let (e, f) = (N_EMBD, N_FF);
    let (q, kv) = (N_HEAD * HEAD_DIM, N_HEAD_KV * HEAD_DIM);
    let mut hf: Vec<(&str, &str, Vec<usize>)> = vec![
        ("fc.weight", "fc.weight", vec![e, 3 * e]),
        ("lm_head.weight", "output.weight", vec![DRAFT_VOCAB, e]),
        (
            "midlayer.hidden_norm.weight",
            "blk.0.attn_norm_2.weight",
            vec![e],
        ),
        (
            "midlayer.input_layernorm.weight",
            "blk.0.attn_norm.weight",
            vec![e],
        ),
        (
            "midlayer.mlp.down_proj.weight",
            "blk.0.ffn_down.weight",
            vec![e, f],
        ),
        (
            "midlayer.mlp.gate_proj.weight",
            "blk.0.ffn_gate.weight",
            vec![f, e],
        ),
        (
            "midlayer.mlp.up_proj.weight",
            "blk.0.ffn_up.weight",
            vec![f, e],
        ),
        (
            "midlayer.post_attention_layernorm.weight",
            "blk.0.ffn_norm.weight",
            vec![e],
        ),
        (
            "midlayer.self_attn.k_proj.weight",
            "blk.0.attn_k.weight",
            vec![kv, 2 * e],
        ),
        (
            "midlayer.self_attn.o_proj.weight",
            "blk.0.attn_output.weight",
            vec![e, q],
        ),
        (
            "midlayer.self_attn.q_proj.weight",
            "blk.0.attn_q.weight",
            vec![q, 2 * e],
        ),
        (
            "midlayer.self_attn.v_proj.weight",
            "blk.0.attn_v.weight",
            vec![kv, 2 * e],
        ),
        ("norm.weight", "output_norm.weight", vec![e]),
    ];
    hf.sort_by(|a, b| a.0.cmp(b.0));
    let mut tensors = Vec::new();
    for (t, (hf_name, gguf, shape)) in hf.into_iter().enumerate() {
        let scale = if hf_name.ends_with("norm.weight") {
            None
        } else if hf_name == "fc.weight" || hf_name.ends_with("down_proj.weight") {
            Some(-3)
        } else if hf_name.ends_with("q_proj.weight") {
            Some(-1)
        } else {
            Some(-2)
        };
        let mut v = tensor_values(t + 2000 + 100 * case, shape.iter().product(), scale);
        if hf_name.ends_with("q_proj.weight") {
            v = permute(&v, shape[0], shape[1], N_HEAD);
        } else if hf_name.ends_with("k_proj.weight") {
            v = permute(&v, shape[0], shape[1], N_HEAD_KV);
        }
        let bytes = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        tensors.push((gguf.to_owned(), GgmlType::F32, shape, bytes));
    }
    tensors.push((
        "d2t".to_owned(),
        GgmlType::I64,
        vec![d2t.len()],
        d2t.iter().flat_map(|x| x.to_le_bytes()).collect(),
    ));
    let k = |s: &str| format!("eagle3.{s}");
    let mut md = vec![
        (
            "general.architecture".to_owned(),
            Value::String("eagle3".into()),
        ),
        ("general.type".to_owned(), Value::String("model".into())),
        (
            "general.name".to_owned(),
            Value::String(format!("specula-eagle3-tiny-{name}")),
        ),
        (k("block_count"), u32v(1)),
        (k("context_length"), u32v(N_CTX)),
        (k("embedding_length"), u32v(N_EMBD)),
        (k("feed_forward_length"), u32v(N_FF)),
        (k("attention.head_count"), u32v(N_HEAD)),
        (k("attention.head_count_kv"), u32v(N_HEAD_KV)),
        (k("rope.freq_base"), Value::F32(10_000.0)),
        (k("attention.layer_norm_rms_epsilon"), Value::F32(RMS_EPS)),
        ("general.file_type".to_owned(), Value::U32(0)),
        (k("vocab_size"), u32v(N_VOCAB)),
        (k("rope.dimension_count"), u32v(HEAD_DIM)),
        (k("target_layers"), Value::Array(Array::I32(vec![1, 3, 2]))),
        (k("target_hidden_size"), u32v(N_EMBD)),
        (k("norm_before_residual"), Value::Bool(nbr)),
        (k("norm_before_fc"), Value::Bool(false)),
    ];
    md.extend(tokenizer_md(None));
    write_raw(md, tensors)
}

#[test]
fn eagle3_matches_the_pytorch_reference() {
    use specula_models::eagle3::Eagle3;
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../golden/eagle3/tiny.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (written by reference/eagle3_golden.py)",
            path.display()
        )
    });
    let g: Json = serde_json::from_str(&text).expect("JSON");
    let d2t: Vec<i64> = g["d2t"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_i64().unwrap())
        .collect();
    let be = CpuBackend::new(1);
    let target = Model::load(&be, Arc::new(Gguf::from_bytes(target_gguf()).unwrap())).unwrap();
    let prompt = ids(&g["prompt"]);
    for (ci, case) in g["cases"].as_array().unwrap().iter().enumerate() {
        let name = case["name"].as_str().unwrap();
        let nbr = case["norm_before_residual"].as_bool().unwrap();
        let bytes = eagle3_gguf(ci, name, nbr, &d2t);
        assert_eq!(
            common::sha256_hex(&bytes),
            case["gguf_sha256"].as_str().unwrap(),
            "{name}: the rebuilt EAGLE-3 GGUF is not the file gguf-py wrote"
        );
        let net = Eagle3::load(&be, Arc::new(Gguf::from_bytes(bytes).unwrap()), &target).unwrap();
        assert_eq!(net.hparams().target_layers, vec![1, 3, 2]);
        assert_eq!(net.hparams().norm_before_residual, nbr);
        let mut kv = be
            .kv_new(net.kv_shape(N_CTX, QType::F32, QType::F32))
            .unwrap();
        let mut s = net.scratch(&be);
        let mut gs: Vec<f32> = Vec::new();
        let mut history = prompt.clone();
        let e = N_EMBD;
        for (ri, round) in case["rounds"].as_array().unwrap().iter().enumerate() {
            let what = format!("{name}: round {}", ri + 1);
            let feats = base64_f32(round["ctx_features"].as_str().unwrap());
            net.encode(&be, &mut s, &feats, &mut gs).unwrap();
            let seed_pos = usize_of(&round["seed_pos"]);
            if ri == 1 {
                let verify = ids(&round["verify"]);
                let a = usize_of(&round["accepted"]);
                history.extend_from_slice(&verify[..=a]);
            }
            // Pairs (history[P + 1], g[P]) for the positions not written yet.
            let first = if ri == 0 {
                0
            } else {
                usize_of(&case["rounds"][0]["seed_pos"])
            };
            let toks: Vec<u32> = history[first + 1..=seed_pos].to_vec();
            net.decode(
                &be,
                &mut kv,
                N_CTX,
                &mut s,
                &toks,
                &gs[first * e..seed_pos * e],
                &positions(first, seed_pos - first),
                false,
            )
            .unwrap();
            let want = base64_f32(round["logits"].as_str().unwrap());
            let chain = ids(&round["chain"]);
            let mut tok = u32::try_from(round["seed"].as_u64().unwrap()).unwrap();
            let mut gcur = gs[seed_pos * e..(seed_pos + 1) * e].to_vec();
            let mut got = Vec::new();
            for (step, &next) in chain.iter().enumerate() {
                net.decode(
                    &be,
                    &mut kv,
                    N_CTX,
                    &mut s,
                    &[tok],
                    &gcur,
                    &positions(seed_pos + step, 1),
                    true,
                )
                .unwrap();
                let row = &s.logits_host;
                // Draft-vocabulary logits at their target ids; −∞ everywhere else.
                let mut draft_row = Vec::with_capacity(DRAFT_VOCAB);
                for (i, &x) in row.iter().enumerate() {
                    if d2t.contains(&i64::try_from(i).expect("fits")) {
                        draft_row.push(x);
                    } else {
                        assert_eq!(x, f32::NEG_INFINITY, "{what}: id {i} outside d2t");
                    }
                }
                assert_eq!(
                    u32::try_from(argmax(row)).expect("fits"),
                    next,
                    "{what}: chain step {step}"
                );
                got.extend(draft_row);
                tok = next;
                gcur.clone_from(&s.prenorm);
            }
            let err = nmse(&got, &want);
            assert!(err <= NMSE_MAX, "{what}: NMSE {err:.3e}");
        }
    }
}

#[test]
fn dflash2_matches_the_pytorch_reference() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../golden/dflash");
    let read = |f: &str| -> Json {
        let text = std::fs::read_to_string(dir.join(f))
            .unwrap_or_else(|e| panic!("{f}: {e} (written by reference/dflash_golden.py)"));
        serde_json::from_str(&text).expect("JSON")
    };
    let (g1, g2) = (read("tiny.json"), read("tiny2.json"));
    let bytes = draft_gguf_with(true);
    assert_eq!(
        common::sha256_hex(&bytes),
        g2["draft_gguf_sha256"].as_str().unwrap(),
        "the rebuilt DFlash2 GGUF is not the file gguf-py wrote"
    );
    let be = CpuBackend::new(1);
    let target = Model::load(&be, Arc::new(Gguf::from_bytes(target_gguf()).unwrap())).unwrap();
    let net = Dflash::load(&be, Arc::new(Gguf::from_bytes(bytes).unwrap()), &target).unwrap();
    assert!(net.is_dflash2());
    let mut kv = be
        .kv_new(net.kv_shape(N_CTX, QType::F32, QType::F32))
        .unwrap();
    let mut s = net.scratch(&be);
    let ctx = [
        base64_f32(g1["rounds"][0]["ctx_features"].as_str().unwrap()),
        base64_f32(g1["rounds"][1]["ctx_features"].as_str().unwrap()),
    ];
    for (ri, round) in g2["rounds"].as_array().unwrap().iter().enumerate() {
        let what = format!("DFlash2 round {}", ri + 1);
        let (c0, cn) = (usize_of(&round["ctx_pos0"]), usize_of(&round["ctx_rows"]));
        net.inject(&be, &mut kv, N_CTX, &mut s, &ctx[ri], &positions(c0, cn))
            .unwrap();
        let block = ids(&round["block"]);
        let all: Vec<usize> = (0..block.len()).collect();
        let got = net
            .block(
                &be,
                &mut kv,
                N_CTX,
                &mut s,
                &block,
                usize_of(&round["block_pos0"]),
                &all,
            )
            .unwrap()
            .to_vec();
        check_logits(&what, &got, &base64_f32(round["logits"].as_str().unwrap()));
        // The selector walks rows 1.. from the anchor.
        let rows: Vec<usize> = (1..block.len()).collect();
        net.block(
            &be,
            &mut kv,
            N_CTX,
            &mut s,
            &block,
            usize_of(&round["block_pos0"]),
            &rows,
        )
        .unwrap();
        let path = net.select(&be, &mut s, block[0], 0.0);
        assert_eq!(path, ids(&round["path"]), "{what}: selector path");
        // The same walk over candidates read out on the backend (top-K + 1 per row).
        let fast = net
            .block_select(
                &be,
                &mut kv,
                N_CTX,
                &mut s,
                &block,
                usize_of(&round["block_pos0"]),
                &rows,
                block[0],
                0.0,
            )
            .unwrap();
        assert_eq!(
            fast, path,
            "{what}: selector path from the backend's candidates"
        );
    }
}
