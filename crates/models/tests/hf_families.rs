//! The model families beyond llama / qwen2 / qwen3 / gemma3 against Hugging Face transformers:
//! golden logits and hidden states of tiny random models (`golden/hf_families/`, written by
//! `reference/hf_families_golden.py`, which also ran llama.cpp's converter on the checkpoint to
//! check the GGUF).
//!
//! For each model the GGUF is rebuilt here with specula's `GgufWriter` from the golden file:
//! its metadata as listed, every tensor from the file's formula (splitmix64 of tensor and
//! element number, by the tensor's kind); its sha256 must be that of the file gguf-py wrote, so
//! the model is exactly the one transformers ran. On the CPU backend with an F32 cache, each
//! sequence then runs
//! - as one batch (logits of every row),
//! - token by token (one-token decodes),
//! - as a prefill followed by multi-token steps (a verify batch's shape),
//! - next to another sequence in one multi-sequence batch ([`Model::forward_multi`]),
//!
//! and every run must be within NMSE `Σ(ours − hf)² / Σhf²` ≤ 1e-5 of transformers' float32
//! logits and bit-identical to the others (batch invariance: what speculation and continuous
//! batching rely on). The taps (the input of each layer, and the state before the final norm)
//! are compared with transformers' hidden states the same way.

mod common;

use std::sync::Arc;

use serde_json::Value as Json;
use specula_cpu::CpuBackend;
use specula_gguf::{Array, GgmlType, Gguf, GgufWriter, Value};
use specula_models::{Arch, Model, SeqRows, Taps};
use specula_quant::QType;
use specula_testkit::splitmix64;

use common::{f32_base64, first_difference, max_abs_diff, nmse, sha256_hex};

/// The acceptance bound on the NMSE against transformers' float32 values.
const NMSE_MAX: f64 = 1e-5;
const N_CTX: usize = 128;

/// A metadata value as the golden file lists it (gguf-py's `GGUFValueType` names).
fn value(ty: &str, v: &Json) -> Value {
    let u = || v.as_u64().expect("an unsigned integer");
    let i = || v.as_i64().expect("an integer");
    #[allow(
        clippy::cast_possible_truncation,
        reason = "the file holds the f32 value exactly, written as a double"
    )]
    match ty {
        "UINT8" => Value::U8(u8::try_from(u()).expect("u8")),
        "INT8" => Value::I8(i8::try_from(i()).expect("i8")),
        "UINT16" => Value::U16(u16::try_from(u()).expect("u16")),
        "INT16" => Value::I16(i16::try_from(i()).expect("i16")),
        "UINT32" => Value::U32(u32::try_from(u()).expect("u32")),
        "INT32" => Value::I32(i32::try_from(i()).expect("i32")),
        "UINT64" => Value::U64(u()),
        "INT64" => Value::I64(i()),
        "FLOAT32" => Value::F32(v.as_f64().expect("a number") as f32),
        "FLOAT64" => Value::F64(v.as_f64().expect("a number")),
        "BOOL" => Value::Bool(v.as_bool().expect("a bool")),
        "STRING" => Value::String(v.as_str().expect("a string").to_owned()),
        "ARRAY" => Value::Array(array(
            v["type"].as_str().expect("element type"),
            v["values"].as_array().expect("values"),
        )),
        other => panic!("metadata type {other}"),
    }
}

fn array(ty: &str, vs: &[Json]) -> Array {
    let each = |f: &dyn Fn(&Json) -> Value| vs.iter().map(f).collect::<Vec<_>>();
    let items = each(&|v| value(ty, v));
    macro_rules! collect {
        ($variant:ident) => {
            Array::$variant(
                items
                    .into_iter()
                    .map(|x| match x {
                        Value::$variant(x) => x,
                        _ => unreachable!(),
                    })
                    .collect(),
            )
        };
    }
    match ty {
        "UINT8" => collect!(U8),
        "INT8" => collect!(I8),
        "UINT16" => collect!(U16),
        "INT16" => collect!(I16),
        "UINT32" => collect!(U32),
        "INT32" => collect!(I32),
        "UINT64" => collect!(U64),
        "INT64" => collect!(I64),
        "FLOAT32" => collect!(F32),
        "FLOAT64" => collect!(F64),
        "BOOL" => collect!(Bool),
        "STRING" => collect!(String),
        other => panic!("array element type {other}"),
    }
}

/// The values of GGUF tensor number `t` (`n` elements, row-major over the reversed ggml
/// dims) of kind `kind`, as the script's formula defines them.
fn tensor_values(t: usize, n: usize, kind: &str, scale_log2: Option<i32>) -> Vec<f32> {
    let t = u64::try_from(t).expect("fits");
    (0..n)
        .map(|i| {
            let z = splitmix64((t << 32) | u64::try_from(i).expect("fits"));
            let v = f64::from(i32::try_from(z >> 40).expect("24 bits") - (1 << 23));
            let x = match kind {
                "norm" => 1.0 + v / f64::from(1u32 << 26),
                "uniform" => v * 2f64.powi(scale_log2.expect("a uniform tensor's scale") - 23),
                // A negative value (Qwen3.5's `ssm_a = −e^{A_log}`).
                "neg" => -(1.0 + v / f64::from(1u32 << 24)),
                other => panic!("tensor kind {other} (see reference/hf_families_golden.py)"),
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

/// The GGUF the golden file describes, written by specula's writer.
fn rebuild(g: &Json) -> Vec<u8> {
    let mut w = GgufWriter::new();
    for kv in g["metadata"].as_array().expect("metadata") {
        let key = kv[0].as_str().expect("key");
        w.add(key.to_owned(), value(kv[1].as_str().expect("type"), &kv[2]))
            .expect("metadata");
    }
    let mut data = Vec::new();
    for (t, d) in g["tensors"].as_array().expect("tensors").iter().enumerate() {
        assert_eq!(d["type"], "F32", "{}: F32 tensors", d["name"]);
        let dims: Vec<u64> = d["dims"]
            .as_array()
            .expect("dims")
            .iter()
            .map(|x| x.as_u64().expect("dim"))
            .collect();
        let n = dims
            .iter()
            .map(|&x| usize::try_from(x).expect("fits"))
            .product();
        let scale = d["scale_log2"]
            .as_i64()
            .map(|s| i32::try_from(s).expect("small"));
        let kind = d["kind"].as_str().expect("kind");
        let values = if kind == "derived" {
            // Computed from the config by the converter (Gemma 4's `rope_freqs`), listed.
            d["values"]
                .as_array()
                .expect("a derived tensor's values")
                .iter()
                .map(|x| {
                    #[allow(
                        clippy::cast_possible_truncation,
                        reason = "f32 values written as doubles"
                    )]
                    let v = x.as_f64().expect("a number") as f32;
                    v
                })
                .collect()
        } else {
            tensor_values(t, n, kind, scale)
        };
        w.add_tensor(d["name"].as_str().expect("name"), GgmlType::F32, &dims)
            .expect("tensor");
        data.push(
            values
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect::<Vec<u8>>(),
        );
    }
    let slices: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
    w.to_vec(&slices).expect("write")
}

/// One sequence of the golden file.
struct Sequence {
    name: String,
    tokens: Vec<u32>,
    /// `[n, n_vocab]`.
    logits: Vec<f32>,
    /// Transformers' hidden states, entry `j` the input of layer `j`, entry `n_layer` the
    /// state before the final norm (`[n, n_embd]` each), when the file has them.
    hidden: Option<Vec<f32>>,
}

fn sequences(g: &Json) -> Vec<Sequence> {
    g["sequences"]
        .as_array()
        .expect("sequences")
        .iter()
        .map(|s| Sequence {
            name: s["name"].as_str().expect("name").to_owned(),
            tokens: s["tokens"]
                .as_array()
                .expect("tokens")
                .iter()
                .map(|t| u32::try_from(t.as_u64().expect("token")).expect("fits"))
                .collect(),
            logits: f32_base64(&s["logits_f32le_base64"]),
            hidden: s.get("hidden_states_f32le_base64").map(|h| {
                h.as_array()
                    .expect("one base64 string per hidden state")
                    .iter()
                    .flat_map(f32_base64)
                    .collect()
            }),
        })
        .collect()
}

/// Runs `tokens` through `model` in forwards of `chunks` tokens each (logits of every row).
fn run_chunked(
    be: &CpuBackend,
    model: &Model<CpuBackend>,
    tokens: &[u32],
    chunks: &[usize],
) -> Vec<f32> {
    assert_eq!(chunks.iter().sum::<usize>(), tokens.len());
    let mut kv = model
        .new_kv(be, N_CTX, QType::F32, QType::F32)
        .expect("F32 KV cache");
    let mut scratch = model.scratch(be);
    let mut out = Vec::new();
    let mut at = 0;
    for &c in chunks {
        let pos: Vec<u32> = (at..at + c)
            .map(|p| u32::try_from(p).expect("fits"))
            .collect();
        let rows: Vec<usize> = (0..c).collect();
        let logits = model
            .forward(
                be,
                &mut kv,
                &mut scratch,
                &tokens[at..at + c],
                &pos,
                &rows,
                None,
            )
            .expect("forward");
        out.extend_from_slice(logits);
        at += c;
    }
    out
}

fn assert_close(what: &str, ours: &[f32], hf: &[f32]) {
    let e = nmse(ours, hf);
    eprintln!(
        "{what}: NMSE {e:.3e} (max |Δ| {:.3e})",
        max_abs_diff(ours, hf)
    );
    assert!(e <= NMSE_MAX, "{what}: NMSE {e:.3e} > {NMSE_MAX:e}");
}

fn assert_same_bits(what: &str, a: &[f32], b: &[f32], width: usize) {
    if let Some(i) = first_difference(a, b) {
        panic!(
            "{what}: first differs at row {}, column {} ({} vs {}; batch invariance)",
            i / width,
            i % width,
            a[i],
            b[i]
        );
    }
}

fn check(name: &str, arch: Arch) {
    let g = common::golden("hf_families", name, "hf_families_golden.py");
    let bytes = rebuild(&g["gguf"]);
    assert_eq!(
        u64::try_from(bytes.len()).expect("fits"),
        g["gguf"]["size"].as_u64().expect("size"),
        "{name}: the rebuilt GGUF has gguf-py's size"
    );
    assert_eq!(
        sha256_hex(&bytes),
        g["gguf"]["sha256"].as_str().expect("sha256"),
        "{name}: the rebuilt GGUF is gguf-py's file byte for byte"
    );
    let be = CpuBackend::new(2);
    let model = Model::load(
        &be,
        Arc::new(Gguf::from_bytes(bytes).expect("a valid GGUF")),
    )
    .expect("the model loads");
    let hp = model.hparams();
    assert_eq!(hp.arch, arch);
    let (n_vocab, n_embd, n_layer) = (hp.n_vocab, hp.n_embd, hp.n_layer);

    let seqs = sequences(&g);
    let mut batches = Vec::new();
    for s in &seqs {
        let n = s.tokens.len();
        let what = format!("{name} {} ({n} tokens)", s.name);
        assert_eq!(s.logits.len(), n * n_vocab, "{what}: golden logits shape");
        let batch = run_chunked(&be, &model, &s.tokens, &[n]);
        assert_close(&format!("{what}, one batch"), &batch, &s.logits);
        let decode = run_chunked(&be, &model, &s.tokens, &vec![1; n]);
        assert_same_bits(
            &format!("{what}: decode vs batch"),
            &decode,
            &batch,
            n_vocab,
        );
        // A prefill, then steps of one and several tokens (as verify batches come).
        let mut chunks = vec![n.saturating_sub(7).max(1)];
        let mut left = n - chunks[0];
        for step in [1, 3, 2, 1, 4] {
            let c = step.min(left);
            if c > 0 {
                chunks.push(c);
                left -= c;
            }
        }
        if left > 0 {
            chunks.push(left);
        }
        let stepped = run_chunked(&be, &model, &s.tokens, &chunks);
        assert_same_bits(
            &format!("{what}: steps {chunks:?} vs batch"),
            &stepped,
            &batch,
            n_vocab,
        );

        if model.is_recurrent() && n >= 32 {
            // A verify batch of 9 rows after a 20-token prefill, then `keep` of them kept and the
            // next forward started there: the recurrent layers continue from the state they kept
            // for that position (a snapshot, or the state before the batch) — every row after
            // that has the bits of the one batch.
            for keep in 0..=9 {
                let mut kv = model
                    .new_kv(&be, N_CTX, QType::F32, QType::F32)
                    .expect("F32 KV cache");
                let mut scratch = model.scratch(&be);
                let mut fwd = |from: usize, to: usize| -> Vec<f32> {
                    let pos: Vec<u32> = (from..to).map(|p| u32::try_from(p).unwrap()).collect();
                    let rows: Vec<usize> = (0..to - from).collect();
                    model
                        .forward(
                            &be,
                            &mut kv,
                            &mut scratch,
                            &s.tokens[from..to],
                            &pos,
                            &rows,
                            None,
                        )
                        .unwrap_or_else(|e| panic!("{what}: forward {from}..{to}: {e}"))
                        .to_vec()
                };
                fwd(0, 20);
                fwd(20, 29);
                let next = fwd(20 + keep, 32);
                assert_same_bits(
                    &format!("{what}: 9-row verify, {keep} kept, continued"),
                    &next,
                    &batch[(20 + keep) * n_vocab..32 * n_vocab],
                    n_vocab,
                );
            }
        }

        if let Some(hidden) = &s.hidden {
            assert_eq!(
                hidden.len(),
                (n_layer + 1) * n * n_embd,
                "{what}: hidden shape"
            );
            let mut kv = model
                .new_kv(&be, N_CTX, QType::F32, QType::F32)
                .expect("F32 KV cache");
            let mut scratch = model.scratch(&be);
            let mut taps = Taps {
                layers: (0..=n_layer).collect(),
                rows: Vec::new(),
            };
            let pos: Vec<u32> = (0..u32::try_from(n).expect("fits")).collect();
            model
                .forward(
                    &be,
                    &mut kv,
                    &mut scratch,
                    &s.tokens,
                    &pos,
                    &[],
                    Some(&mut taps),
                )
                .expect("tapped forward");
            for (j, rows) in taps.rows.iter().enumerate() {
                let want = &hidden[j * n * n_embd..(j + 1) * n * n_embd];
                assert_close(&format!("{what}, tap {j}"), rows, want);
            }
        }
        batches.push(batch);
    }

    // Every sequence at once, each on its own cache: each gets its own batch's bits.
    let mut kvs: Vec<_> = seqs
        .iter()
        .map(|_| {
            model
                .new_kv(&be, N_CTX, QType::F32, QType::F32)
                .expect("F32 KV cache")
        })
        .collect();
    let pos: Vec<Vec<u32>> = seqs
        .iter()
        .map(|s| (0..u32::try_from(s.tokens.len()).expect("fits")).collect())
        .collect();
    let rows: Vec<Vec<usize>> = seqs.iter().map(|s| (0..s.tokens.len()).collect()).collect();
    let mut multi: Vec<SeqRows<'_, CpuBackend>> = kvs
        .iter_mut()
        .zip(&seqs)
        .zip(pos.iter().zip(&rows))
        .map(|((kv, s), (p, r))| SeqRows {
            kv,
            tokens: &s.tokens,
            pos: p,
            logits_rows: r,
            taps: None,
            ring: None,
        })
        .collect();
    let mut scratch = model.scratch(&be);
    let all = model
        .forward_multi(&be, &mut multi, &mut scratch)
        .expect("multi-sequence forward")
        .to_vec();
    let mut at = 0;
    for (s, batch) in seqs.iter().zip(&batches) {
        let len = batch.len();
        assert_same_bits(
            &format!("{name} {}: in a multi-sequence batch vs alone", s.name),
            &all[at..at + len],
            batch,
            n_vocab,
        );
        at += len;
    }
}

/// qwen3moe: qwen3's attention with a softmax top-2-of-8 mixture of experts, renormalized.
#[test]
fn qwen3moe_matches_transformers() {
    check("qwen3moe", Arch::Qwen3Moe);
}

/// qwen35: three gated delta-net layers (2 key heads, 4 value heads — the tiled value-head
/// order matters — conv kernel 4) and one gated full-attention layer with partial RoPE.
#[test]
fn qwen35_matches_transformers() {
    check("qwen35", Arch::Qwen35);
}

/// qwen35moe: qwen35 with a top-2-of-8 mixture of experts and a sigmoid-gated shared expert.
#[test]
fn qwen35moe_matches_transformers() {
    check("qwen35moe", Arch::Qwen35Moe);
}

/// laguna (XS / S-like): layers [global, sliding×3] with [4, 8, 8, 8] query heads, a per-head
/// softplus gate, YaRN (beta_fast 64, attention factor 1.0, from the file) on the global layer
/// and plain RoPE on the others, a dense first layer, sigmoid routing with a correction bias,
/// weights renormalized ×2.5, a shared expert.
#[test]
fn laguna_matches_transformers() {
    check("laguna", Arch::Laguna);
    // The YaRN parameters come from the file, not llama.cpp's defaults (32 / 1, magnitude
    // recomputed): this tiny config's correction range is the same for beta_fast 32 and 64,
    // so the logits alone would not tell.
    let g = common::golden("hf_families", "laguna", "hf_families_golden.py");
    let be = CpuBackend::new(1);
    let model = Model::load(
        &be,
        Arc::new(Gguf::from_bytes(rebuild(&g["gguf"])).unwrap()),
    )
    .unwrap();
    let attn = model.hparams().layers[0]
        .attention()
        .expect("layer 0 attends");
    let yarn = attn.rope.yarn.expect("YaRN on the global layer");
    assert_eq!(
        (yarn.beta_fast, yarn.beta_slow, yarn.orig_ctx),
        (64.0, 1.0, 256)
    );
    assert!((yarn.attn_factor * (1.0 + 0.1 * 32f32.ln()) - 1.0).abs() < 1e-6);
    let swa = model.hparams().layers[1]
        .attention()
        .expect("layer 1 attends");
    assert_eq!((swa.rope.yarn, swa.rope.n_rot, swa.n_head), (None, 16, 8));
}

/// laguna (M-like): every layer global, a per-element softplus gate, no sliding window.
#[test]
fn laguna_per_element_gate_matches_transformers() {
    check("laguna_perelem", Arch::Laguna);
}

/// gemma4 (26B-A4B-like): layers [sliding, global]×2 with head sizes 16 / 32 and K/V heads
/// 2 / 1, proportional RoPE through `rope_freqs` on the global layers, V from K there, the V
/// norm, a GELU MLP beside a top-2-of-4 mixture of experts with per-expert scales and a
/// router on the residual stream, layer output scalars, logits soft-capped at 30, tied head.
#[test]
fn gemma4_matches_transformers() {
    check("gemma4", Arch::Gemma4);
}

/// gemma4 (E2B / E4B-like): layers [sliding, sliding, global]×2, one K/V head, per-layer inputs
/// of 8 values gated in after each FFN, the last three layers reading the K/V of layers 1
/// (sliding) and 2 (global) with no cache of their own and MLPs twice as wide.
#[test]
fn gemma4_per_layer_inputs_and_shared_kv_match_transformers() {
    check("gemma4_ple", Arch::Gemma4);
    // The shared layers keep no cells: the cache is the first three layers' alone.
    let g = common::golden("hf_families", "gemma4_ple", "hf_families_golden.py");
    let be = CpuBackend::new(1);
    let model = Model::load(
        &be,
        Arc::new(Gguf::from_bytes(rebuild(&g["gguf"])).unwrap()),
    )
    .unwrap();
    let shape = model.kv_shape(N_CTX, QType::F16, QType::F16);
    assert_eq!(shape.shared, [None, None, None, Some(1), Some(1), Some(2)]);
    let layout = specula_kv::KvLayout::new(&shape).unwrap();
    let per_layer: Vec<usize> = (0..6).map(|l| layout.bytes_per_token_layer(l)).collect();
    // One K/V head of 16 (sliding) or 32 (global) f16 values, K and V.
    assert_eq!(per_layer, [64, 64, 128, 0, 0, 0]);
    let widths: Vec<usize> = model
        .hparams()
        .layers
        .iter()
        .map(|l| match l.ffn {
            specula_models::spec::FfnSpec::Dense { n_ff, .. } => n_ff,
            _ => 0,
        })
        .collect();
    assert_eq!(widths, [64, 64, 64, 128, 128, 128]);
}

/// qwen3next (Qwen3-Next-like): qwen35moe's layers with the delta-net's value heads grouped by
/// key head (2 key heads, 4 value heads: value head h reads key head h / 2, not h % 2), β and
/// α split from the fused `ssm_ba` (per key head [β, β, α, α]), plain partial RoPE.
#[test]
fn qwen3next_matches_transformers() {
    check("qwen3next", Arch::Qwen3Next);
}

/// A Qwen3-Next GGUF of the first converters keeps Hugging Face's fused `ssm_in` (per key head
/// its Q, K, V and Z rows) instead of `attn_qkv` and `attn_gate`: loaded from the same weights
/// so laid out, the model gives the same logits bit for bit.
#[test]
fn qwen3next_legacy_fused_ssm_in_gives_the_same_bits() {
    let g = common::golden("hf_families", "qwen3next", "hf_families_golden.py");
    let file = Gguf::from_bytes(rebuild(&g["gguf"])).unwrap();
    let md = file.metadata();
    let int = |k: &str| usize::try_from(md.get(k).unwrap().as_u64().unwrap()).unwrap();
    let (dk, hk, hv) = (
        int("qwen3next.ssm.state_size"),
        int("qwen3next.ssm.group_count"),
        int("qwen3next.ssm.time_step_rank"),
    );
    let dv = hv / hk * dk;
    let mut w = GgufWriter::new();
    for (k, v) in md.iter() {
        w.add(k.to_owned(), v.clone()).unwrap();
    }
    let mut data: Vec<Vec<u8>> = Vec::new();
    for (i, t) in file.tensors().iter().enumerate() {
        let bytes = file.tensor_data(i);
        if t.name.ends_with("attn_gate.weight") && t.name.starts_with("blk.0") {
            continue;
        }
        if let Some(blk) = t.name.strip_suffix(".attn_qkv.weight")
            && blk == "blk.0"
        {
            // Rows of `n_embd` f32 values: per key head [q, k, v, z].
            let row = usize::try_from(t.dims[0]).unwrap() * 4;
            let z = file
                .tensor_data_by_name(&format!("{blk}.attn_gate.weight"))
                .unwrap();
            let rows = |b: &[u8], from: usize, n: usize| b[from * row..(from + n) * row].to_vec();
            let mut fused = Vec::new();
            for h in 0..hk {
                fused.extend(rows(bytes, h * dk, dk));
                fused.extend(rows(bytes, hk * dk + h * dk, dk));
                fused.extend(rows(bytes, 2 * hk * dk + h * dv, dv));
                fused.extend(rows(z, h * dv, dv));
            }
            let n = u64::try_from(fused.len() / row).unwrap();
            w.add_tensor(
                format!("{blk}.ssm_in.weight"),
                GgmlType::F32,
                &[t.dims[0], n],
            )
            .unwrap();
            data.push(fused);
            continue;
        }
        w.add_tensor(&t.name, t.ty, &t.dims).unwrap();
        data.push(bytes.to_vec());
    }
    let slices: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
    let legacy = w.to_vec(&slices).unwrap();
    let be = CpuBackend::new(1);
    let tokens = &sequences(&g)[0].tokens;
    let n = tokens.len();
    let logits = |bytes: Vec<u8>| {
        let model = Model::load(&be, Arc::new(Gguf::from_bytes(bytes).unwrap())).unwrap();
        let mut kv = model.new_kv(&be, N_CTX, QType::F32, QType::F32).unwrap();
        let mut s = model.scratch(&be);
        let pos: Vec<u32> = (0..u32::try_from(n).unwrap()).collect();
        let rows: Vec<usize> = (0..n).collect();
        model
            .forward(&be, &mut kv, &mut s, tokens, &pos, &rows, None)
            .unwrap()
            .to_vec()
    };
    let a = logits(rebuild(&g["gguf"]));
    let b = logits(legacy);
    assert_same_bits(
        "qwen3next: fused ssm_in vs attn_qkv + attn_gate",
        &b,
        &a,
        256,
    );
}
