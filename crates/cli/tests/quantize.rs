//! `specula quantize` against `llama-quantize` (`golden/quantize/`, written by
//! `reference/quantize_golden.py`).
//!
//! - A tiny llama model, rebuilt here from the formula the script uses (its sha256 must match
//!   the script's file), quantized with every preset with and without `--pure`: the output must
//!   have llama-quantize's tensor types in its order and be byte-identical to its file.
//! - The tensor types llama-quantize picks on the real models (when they are in the cache),
//!   against `specula quantize --dry-run`.
//! - Thread-count independence and the error cases.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use serde_json::Value as Json;
use sha2::{Digest, Sha256};
use specula_gguf::{Array, GgmlType, Gguf, GgufWriter, Value};
use specula_testkit::splitmix64;

mod common;
use common::specula;

fn golden(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../golden/quantize")
        .join(name)
}

fn load(name: &str) -> Json {
    serde_json::from_str(&std::fs::read_to_string(golden(name)).unwrap()).unwrap()
}

fn sha256(path: &Path) -> String {
    let bytes = std::fs::read(path).unwrap();
    Sha256::digest(&bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

// ---------------------------------------------------------------------------------------------
// The tiny model: the formula of reference/quantize_golden.py, written with specula's writer.

const N_EMBD: u64 = 256;
const N_FF: u64 = 544;
const N_HEAD: u32 = 4;
const N_HEAD_KV: u32 = 2;
const N_LAYER: u32 = 2;
const N_VOCAB: u64 = 512;
const HEAD_DIM: u64 = N_EMBD / N_HEAD as u64;

/// Value `i` (ggml order) of tensor number `t` with dims `dims` (ggml order). Every integer is
/// below 2^31 and every division is by a power of two, so the f64 is exact and rounds once to
/// f32, as numpy's `astype(np.float32)` does.
#[allow(
    clippy::cast_possible_wrap,
    clippy::cast_precision_loss,
    clippy::cast_possible_truncation,
    reason = "24-bit integers and products below 2^31, exact in f64; one rounding to f32 intended"
)]
fn value(t: u64, i: u64, dims: &[u64]) -> f32 {
    let z = splitmix64((t << 32) | i);
    let v = (z >> 40) as i64 - (1 << 23);
    let x = if dims.len() == 1 {
        1.0 + v as f64 / f64::from(1u32 << 26)
    } else {
        let row = (i / dims[0]) as i64;
        let m = if row % 61 == 60 { 0 } else { 8 + row % 7 };
        let o = if z & 0xff == 0 { 16 } else { 1 };
        (v * m * o) as f64 / f64::from(1u32 << 30)
    };
    x as f32
}

/// (name, dims in ggml order) in file order.
fn tiny_tensors() -> Vec<(String, Vec<u64>)> {
    let mut out = vec![("token_embd.weight".to_owned(), vec![N_EMBD, N_VOCAB])];
    for l in 0..N_LAYER {
        let kv = u64::from(N_HEAD_KV) * HEAD_DIM;
        for (name, dims) in [
            ("attn_norm", vec![N_EMBD]),
            ("attn_q", vec![N_EMBD, N_EMBD]),
            ("attn_k", vec![N_EMBD, kv]),
            ("attn_v", vec![N_EMBD, kv]),
            ("attn_output", vec![N_EMBD, N_EMBD]),
            ("ffn_norm", vec![N_EMBD]),
            ("ffn_gate", vec![N_EMBD, N_FF]),
            ("ffn_up", vec![N_EMBD, N_FF]),
            ("ffn_down", vec![N_FF, N_EMBD]),
        ] {
            out.push((format!("blk.{l}.{name}.weight"), dims));
        }
    }
    out.push(("output_norm.weight".to_owned(), vec![N_EMBD]));
    out.push(("output.weight".to_owned(), vec![N_EMBD, N_VOCAB]));
    out
}

fn write_tiny(path: &Path) {
    let mut w = GgufWriter::new();
    let str_ = |v: &str| Value::String(v.to_owned());
    let tokens: Vec<String> = std::iter::once("<|endoftext|>".to_owned())
        .chain((1..N_VOCAB).map(|i| format!("tok{i}")))
        .collect();
    let token_types: Vec<i32> = std::iter::once(3)
        .chain(std::iter::repeat_n(1, tokens.len() - 1))
        .collect();
    let u32_ = |v: u64| Value::U32(u32::try_from(v).unwrap());
    for (key, value) in [
        ("general.architecture", str_("llama")),
        ("general.name", str_("specula-quantize-tiny")),
        ("general.file_type", Value::U32(0)),
        ("llama.context_length", Value::U32(512)),
        ("llama.embedding_length", u32_(N_EMBD)),
        ("llama.block_count", Value::U32(N_LAYER)),
        ("llama.feed_forward_length", u32_(N_FF)),
        ("llama.rope.dimension_count", u32_(HEAD_DIM)),
        ("llama.attention.head_count", Value::U32(N_HEAD)),
        ("llama.attention.head_count_kv", Value::U32(N_HEAD_KV)),
        ("llama.attention.layer_norm_rms_epsilon", Value::F32(1e-5)),
        ("llama.rope.freq_base", Value::F32(10000.0)),
        ("llama.vocab_size", u32_(N_VOCAB)),
        ("tokenizer.ggml.model", str_("gpt2")),
        ("tokenizer.ggml.pre", str_("default")),
        ("tokenizer.ggml.tokens", Value::Array(Array::String(tokens))),
        (
            "tokenizer.ggml.token_type",
            Value::Array(Array::I32(token_types)),
        ),
        (
            "tokenizer.ggml.merges",
            Value::Array(Array::String(vec!["t o".into(), "to k".into()])),
        ),
        ("tokenizer.ggml.bos_token_id", Value::U32(0)),
        ("tokenizer.ggml.eos_token_id", Value::U32(0)),
    ] {
        w.add(key, value).unwrap();
    }
    let tensors = tiny_tensors();
    for (name, dims) in &tensors {
        w.add_tensor(name, GgmlType::F32, dims).unwrap();
    }
    w.write_file(path, |t, _, sink| {
        let dims = &tensors[t].1;
        let n: u64 = dims.iter().product();
        let bytes: Vec<u8> = (0..n)
            .flat_map(|i| value(t as u64, i, dims).to_le_bytes())
            .collect();
        sink.write_all(&bytes)
    })
    .unwrap();
}

/// The tiny model, written once per test process (atomically, so concurrent processes are
/// fine) and checked against the sha256 of the file gguf-py wrote.
fn tiny_input() -> &'static Path {
    static INPUT: OnceLock<PathBuf> = OnceLock::new();
    INPUT.get_or_init(|| {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("quantize");
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("tiny-llama-f32.gguf");
        write_tiny(&path);
        let golden = &tiny_golden()["input"];
        assert_eq!(
            std::fs::metadata(&path).unwrap().len(),
            golden["size"].as_u64().unwrap(),
            "the rebuilt tiny model has gguf-py's size"
        );
        assert_eq!(
            sha256(&path),
            golden["sha256"].as_str().unwrap(),
            "the rebuilt tiny model is gguf-py's file byte for byte"
        );
        path
    })
}

fn tiny_golden() -> &'static Json {
    static GOLDEN: OnceLock<Json> = OnceLock::new();
    GOLDEN.get_or_init(|| load("tiny-llama.json"))
}

fn names_and_types(path: &Path) -> (Vec<String>, Vec<String>) {
    let g = Gguf::open(path).unwrap();
    g.tensors()
        .iter()
        .map(|t| (t.name.clone(), t.ty.name().to_owned()))
        .unzip()
}

fn strings(v: &Json) -> Vec<String> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_str().unwrap().to_owned())
        .collect()
}

/// Runs `specula quantize` on `input` and checks the result against the golden run `key`:
/// the same error, or the same tensor types in the same order and then the same bytes.
fn check_run(key: &str, input: &Path, preset: &str, flags: &[&str], dir: &Path) -> PathBuf {
    let run = &tiny_golden()["runs"][key];
    assert!(!run.is_null(), "no golden run {key:?}");
    let out = dir.join(format!(
        "{}.gguf",
        key.replace(|c: char| !c.is_alphanumeric(), "_")
    ));
    let mut args = vec!["quantize", s(input), s(&out), preset, "--threads", "2"];
    args.extend_from_slice(flags);
    let res = specula(&args);
    let stderr = String::from_utf8_lossy(&res.stderr);
    if let Some(err) = run["error"].as_str() {
        assert!(
            !res.status.success(),
            "{key}: llama-quantize fails ({err}), we succeeded"
        );
        assert!(!out.exists(), "{key}: nothing is written on failure");
        if err.contains("imatrix") {
            assert!(stderr.contains("importance matrix"), "{key}: {stderr}");
        }
        return out;
    }
    assert!(res.status.success(), "{key}: {stderr}");
    let (names, types) = names_and_types(&out);
    assert_eq!(
        names,
        strings(&tiny_golden()["names"]),
        "{key}: tensor order"
    );
    let expected = strings(&run["types"]);
    let differing: Vec<String> = names
        .iter()
        .zip(types.iter().zip(&expected))
        .filter(|(_, (a, b))| a != b)
        .map(|(n, (a, b))| format!("{n}: ours {a}, llama.cpp {b}"))
        .collect();
    assert!(
        differing.is_empty(),
        "{key}: tensor types differ:\n{}",
        differing.join("\n")
    );
    let stdout = String::from_utf8_lossy(&res.stdout);
    let n_fallback = run["n_fallback"].as_u64().unwrap();
    if n_fallback > 0 {
        assert!(
            stdout.contains(&format!(
                "{n_fallback} of {} tensors fell back",
                names.len()
            )),
            "{key}: {stdout}"
        );
    }
    assert_eq!(
        std::fs::metadata(&out).unwrap().len(),
        run["size"].as_u64().unwrap(),
        "{key}: file size"
    );
    assert_eq!(
        sha256(&out),
        run["sha256"].as_str().unwrap(),
        "{key}: the output is not llama-quantize's file byte for byte"
    );
    out
}

fn check_preset(preset: &str) {
    let dir = tempfile::tempdir().unwrap();
    check_run(preset, tiny_input(), preset, &[], dir.path());
    check_run(
        &format!("{preset} --pure"),
        tiny_input(),
        preset,
        &["--pure"],
        dir.path(),
    );
}

macro_rules! presets {
    ($($test:ident => $preset:literal,)*) => {$(
        /// The preset with and without `--pure` on the tiny model: llama-quantize's types,
        /// order and bytes.
        #[test]
        fn $test() {
            check_preset($preset);
        }
    )*};
}

presets! {
    tiny_q4_0 => "Q4_0",
    tiny_q4_1 => "Q4_1",
    tiny_q5_0 => "Q5_0",
    tiny_q5_1 => "Q5_1",
    tiny_q8_0 => "Q8_0",
    tiny_f16 => "F16",
    tiny_bf16 => "BF16",
    tiny_f32 => "F32",
    tiny_q2_k => "Q2_K",
    tiny_q2_k_s_needs_an_imatrix => "Q2_K_S",
    tiny_q3_k_s => "Q3_K_S",
    tiny_q3_k_m => "Q3_K_M",
    tiny_q3_k_l => "Q3_K_L",
    tiny_q4_k_s => "Q4_K_S",
    tiny_q4_k_m => "Q4_K_M",
    tiny_q5_k_s => "Q5_K_S",
    tiny_q5_k_m => "Q5_K_M",
    tiny_q6_k => "Q6_K",
    tiny_iq4_nl => "IQ4_NL",
    tiny_iq4_xs => "IQ4_XS",
    tiny_mxfp4_moe => "MXFP4_MOE",
}

/// Every preset the golden file has is tested above (a preset added to the script without a
/// test here would otherwise go unchecked).
#[test]
fn every_golden_preset_has_a_test() {
    let tested = [
        "Q4_0",
        "Q4_1",
        "Q5_0",
        "Q5_1",
        "Q8_0",
        "F16",
        "BF16",
        "F32",
        "Q2_K",
        "Q2_K_S",
        "Q3_K_S",
        "Q3_K_M",
        "Q3_K_L",
        "Q4_K_S",
        "Q4_K_M",
        "Q5_K_S",
        "Q5_K_M",
        "Q6_K",
        "IQ4_NL",
        "IQ4_XS",
        "MXFP4_MOE",
    ];
    for key in tiny_golden()["runs"].as_object().unwrap().keys() {
        if key.contains("->") || key.contains("-type") || key.contains("--leave") {
            continue;
        }
        let preset = key.split_whitespace().next().unwrap();
        assert!(tested.contains(&preset), "golden run {key:?} has no test");
    }
}

/// `--leave-output-tensor`, `--output-tensor-type` and `--token-embedding-type` (with and
/// without `--pure`) as llama-quantize applies them.
#[test]
fn override_flags_match_llama_quantize() {
    let dir = tempfile::tempdir().unwrap();
    let runs = [
        "Q4_K_M --leave-output-tensor",
        "Q5_K_S --output-tensor-type q8_0 --token-embedding-type q4_1",
        "IQ4_XS --pure --output-tensor-type bf16",
        "Q3_K_M --token-embedding-type q6_k",
    ];
    for key in runs {
        let mut words = key.split_whitespace();
        let preset = words.next().unwrap();
        let flags: Vec<&str> = words.collect();
        check_run(key, tiny_input(), preset, &flags, dir.path());
    }
}

/// Chains over our own outputs: an already quantized input is refused without
/// `--allow-requantize` (naming the tensor) and dequantized then requantized with it; an F16
/// input is converted without the flag. Each result is llama-quantize's file.
#[test]
fn requantize_and_f16_inputs_match_llama_quantize() {
    let dir = tempfile::tempdir().unwrap();
    let q8 = check_run("Q8_0", tiny_input(), "Q8_0", &[], dir.path());
    let f16 = check_run("F16", tiny_input(), "F16", &[], dir.path());

    let refused = dir.path().join("refused.gguf");
    let res = specula(&["quantize", s(&q8), s(&refused), "Q4_0"]);
    let err = String::from_utf8_lossy(&res.stderr);
    assert!(!res.status.success());
    assert!(
        err.contains("tensor output.weight is already quantized (Q8_0)")
            && err.contains("--allow-requantize"),
        "{err}"
    );
    assert!(!refused.exists());

    check_run(
        "Q8_0 -> Q4_0 --allow-requantize",
        &q8,
        "Q4_0",
        &["--allow-requantize"],
        dir.path(),
    );
    check_run(
        "Q8_0 -> Q5_K_M --allow-requantize",
        &q8,
        "Q5_K_M",
        &["--allow-requantize"],
        dir.path(),
    );
    check_run("F16 -> Q4_0", &f16, "Q4_0", &[], dir.path());
    check_run("F16 -> Q6_K --pure", &f16, "Q6_K", &["--pure"], dir.path());
}

/// Rows are split across threads; the bytes must not depend on how.
#[test]
fn output_does_not_depend_on_the_thread_count() {
    let dir = tempfile::tempdir().unwrap();
    let mut hashes = Vec::new();
    for threads in ["1", "4", "3"] {
        let out = dir.path().join(format!("t{threads}.gguf"));
        let res = specula(&[
            "quantize",
            s(tiny_input()),
            s(&out),
            "IQ4_NL",
            "--threads",
            threads,
        ]);
        assert!(
            res.status.success(),
            "{}",
            String::from_utf8_lossy(&res.stderr)
        );
        hashes.push(sha256(&out));
    }
    assert_eq!(hashes[0], hashes[1], "--threads 1 vs 4");
    assert_eq!(hashes[0], hashes[2], "--threads 1 vs 3");
    assert_eq!(
        hashes[0],
        tiny_golden()["runs"]["IQ4_NL"]["sha256"].as_str().unwrap()
    );
}

// ---------------------------------------------------------------------------------------------
// Real models: the planner against llama-quantize's choices.

/// `specula quantize --dry-run` picks llama-quantize's type for every tensor of the real models
/// (tied and untied embeddings, rows that force fallbacks, GQA ratios 3, 4 and 7).
#[test]
fn plans_match_llama_quantize_on_real_models() {
    for model in ["smollm2-135m", "qwen2.5-coder-0.5b", "gemma3-270m"] {
        let Some(path) = specula_testkit::real_model(model) else {
            continue;
        };
        let golden = load(&format!("{model}.json"));
        for (preset, expected) in golden["plans"].as_object().unwrap() {
            let res = specula(&[
                "quantize",
                "--dry-run",
                "--json",
                "--allow-requantize",
                s(&path),
                preset,
            ]);
            assert!(
                res.status.success(),
                "{}",
                String::from_utf8_lossy(&res.stderr)
            );
            let plan: Json = serde_json::from_slice(&res.stdout).unwrap();
            let tensors = plan["tensors"].as_array().unwrap();
            let names: Vec<&str> = tensors
                .iter()
                .map(|t| t["name"].as_str().unwrap())
                .collect();
            assert_eq!(names, strings(&golden["names"]), "{model} {preset}: order");
            let types: Vec<&str> = tensors.iter().map(|t| t["to"].as_str().unwrap()).collect();
            let differing: Vec<String> = names
                .iter()
                .zip(types.iter().zip(strings(&expected["types"])))
                .filter(|(_, (a, b))| *a != b)
                .map(|(n, (a, b))| format!("{n}: ours {a}, llama.cpp {b}"))
                .collect();
            assert!(
                differing.is_empty(),
                "{model} {preset}: tensor types differ:\n{}",
                differing.join("\n")
            );
            assert_eq!(
                plan["n_fallback"], expected["n_fallback"],
                "{model} {preset}"
            );
        }
        eprintln!("checked {model}'s plans against llama-quantize");
    }
}

// ---------------------------------------------------------------------------------------------
// Errors.

/// A small llama file with the given F32 tensors (name, ggml dims, values by index).
fn write_small(path: &Path, tensors: &[(&str, &[u64])], poison: Option<(&str, f32)>) {
    let mut w = GgufWriter::new();
    w.add("general.architecture", Value::String("llama".into()))
        .unwrap();
    w.add("llama.block_count", Value::U32(1)).unwrap();
    for (name, dims) in tensors {
        w.add_tensor(*name, GgmlType::F32, dims).unwrap();
    }
    w.write_file(path, |t, spec, sink| {
        let n: u64 = spec.dims.iter().product();
        let bytes: Vec<u8> = (0..n)
            .flat_map(|i| {
                let mut v = value(t as u64, i, &spec.dims);
                if let Some((name, bad)) = poison
                    && name == spec.name
                    && i == n - 1
                {
                    v = bad;
                }
                v.to_le_bytes()
            })
            .collect();
        sink.write_all(&bytes)
    })
    .unwrap();
}

fn dir_entries(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

#[test]
fn unknown_type_lists_the_valid_ones() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.gguf");
    let res = specula(&["quantize", s(tiny_input()), s(&out), "Q9_K"]);
    let err = String::from_utf8_lossy(&res.stderr);
    assert!(!res.status.success());
    assert!(err.contains("unknown quantization type 'Q9_K'"), "{err}");
    for valid in ["Q4_0", "Q4_K_M", "Q5_K_S", "IQ4_XS", "MXFP4_MOE", "BF16"] {
        assert!(err.contains(valid), "{valid} missing from: {err}");
    }
    let res = specula(&["quantize", s(tiny_input()), s(&out), "IQ2_XXS"]);
    let err = String::from_utf8_lossy(&res.stderr);
    assert!(
        err.contains("IQ2_XXS is a llama-quantize preset that specula does not implement"),
        "{err}"
    );
    let res = specula(&[
        "quantize",
        s(tiny_input()),
        s(&out),
        "q8_0",
        "--output-tensor-type",
        "q7",
    ]);
    let err = String::from_utf8_lossy(&res.stderr);
    assert!(
        err.contains("--output-tensor-type: unknown or unsupported ggml type 'q7'"),
        "{err}"
    );
    assert!(dir_entries(dir.path()).is_empty());
}

#[test]
fn same_input_and_output_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("m.gguf");
    std::fs::copy(tiny_input(), &input).unwrap();
    let before = sha256(&input);
    let twin = dir.path().join(".").join("m.gguf");
    let res = specula(&["quantize", s(&input), s(&twin), "Q4_0"]);
    let err = String::from_utf8_lossy(&res.stderr);
    assert!(!res.status.success());
    assert!(err.contains("input and output are the same file"), "{err}");
    assert_eq!(sha256(&input), before);
}

#[test]
fn missing_and_corrupt_inputs_are_gguf_errors() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.gguf");
    let missing = dir.path().join("missing.gguf");
    let res = specula(&["quantize", s(&missing), s(&out), "Q4_0"]);
    let err = String::from_utf8_lossy(&res.stderr);
    assert!(!res.status.success());
    assert!(
        err.contains("missing.gguf") && err.contains("No such file"),
        "{err}"
    );

    let corrupt = dir.path().join("corrupt.gguf");
    std::fs::write(&corrupt, b"GGML not a gguf file at all").unwrap();
    let res = specula(&["quantize", s(&corrupt), s(&out), "Q4_0"]);
    let err = String::from_utf8_lossy(&res.stderr);
    assert!(err.contains("not a GGUF file"), "{err}");
    assert!(!out.exists());
}

/// A row that no block of the forced type fits is an error naming the tensor (llama.cpp
/// aborts on an assertion there).
#[test]
fn incompatible_row_length_names_the_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("odd.gguf");
    write_small(
        &input,
        &[("output.weight", &[96, 8]), ("token_embd.weight", &[96, 8])],
        None,
    );
    let out = dir.path().join("out.gguf");
    let res = specula(&[
        "quantize",
        s(&input),
        s(&out),
        "Q8_0",
        "--output-tensor-type",
        "q4_k",
    ]);
    let err = String::from_utf8_lossy(&res.stderr);
    assert!(!res.status.success());
    assert!(
        err.contains(
            "tensor output.weight: its rows of 96 values are not a whole number of Q4_K blocks"
        ),
        "{err}"
    );
    assert!(!out.exists());
}

/// Writing fails: in a directory that cannot exist (its parent is a file), and midway through
/// (a non-finite value in the last tensor). Nothing is left behind; an existing OUT survives.
#[test]
fn failed_writes_leave_nothing_behind() {
    let dir = tempfile::tempdir().unwrap();
    let blocker = dir.path().join("not-a-dir");
    std::fs::write(&blocker, b"x").unwrap();
    let out = blocker.join("out.gguf");
    let res = specula(&["quantize", s(tiny_input()), s(&out), "Q4_0"]);
    let err = String::from_utf8_lossy(&res.stderr);
    assert!(!res.status.success());
    assert!(err.contains("out.gguf"), "{err}");
    assert_eq!(dir_entries(dir.path()), ["not-a-dir"]);

    let input = dir.path().join("poisoned.gguf");
    write_small(
        &input,
        &[
            ("blk.0.attn_q.weight", &[64, 4]),
            ("blk.0.ffn_up.weight", &[64, 4]),
        ],
        Some(("blk.0.ffn_up.weight", f32::INFINITY)),
    );
    let out = dir.path().join("out.gguf");
    std::fs::write(&out, b"previous contents").unwrap();
    let res = specula(&["quantize", s(&input), s(&out), "Q8_0"]);
    let err = String::from_utf8_lossy(&res.stderr);
    assert!(!res.status.success());
    assert!(
        err.contains("tensor blk.0.ffn_up.weight: row 3, column 63 holds inf"),
        "{err}"
    );
    assert_eq!(std::fs::read(&out).unwrap(), b"previous contents");
    assert_eq!(
        dir_entries(dir.path()),
        ["not-a-dir", "out.gguf", "poisoned.gguf"]
    );
}

#[test]
fn dry_run_writes_nothing_and_shows_fallbacks() {
    let res = specula(&["quantize", "--dry-run", s(tiny_input()), "q4_k_m"]);
    assert!(
        res.status.success(),
        "{}",
        String::from_utf8_lossy(&res.stderr)
    );
    let text = String::from_utf8(res.stdout).unwrap();
    assert!(
        text.contains("blk.1.ffn_down.weight") && text.contains("F32 -> Q8_0"),
        "{text}"
    );
    assert!(
        text.contains("(fallback: 544 values per row do not fit Q6_K blocks)"),
        "{text}"
    );
    assert!(text.contains("21 as Q4_K_M"), "{text}");
}
