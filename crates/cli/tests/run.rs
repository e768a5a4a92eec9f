//! `specula run / bench / perplexity` end to end on the default model, and their answers to
//! bad input: each a one-line error with a non-zero exit, never a panic.

use std::path::{Path, PathBuf};
use std::process::Output;

mod common;
use common::specula;

fn golden(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../golden")
        .join(name)
}

/// Asserts a failure with a one-line message containing `needle` and no panic.
fn assert_clean_error(out: &Output, needle: &str) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains(needle), "expected `{needle}` in: {err}");
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "one line: {err}");
}

#[test]
fn bad_files_are_one_line_errors() {
    let dir = tempfile::tempdir().unwrap();
    let text = dir.path().join("notes.txt");
    std::fs::write(&text, "hello, not a model").unwrap();
    let out = specula(&["run", "-m", text.to_str().unwrap(), "-p", "x", "-n", "1"]);
    assert_clean_error(&out, "not a GGUF file");

    let out = specula(&["run", "-m", "/nonexistent/model.gguf", "-p", "x"]);
    assert_clean_error(&out, "no such file");

    // A valid GGUF that is not a complete llama model names the missing tensor.
    let synthetic = golden("gguf/synthetic.gguf");
    let out = specula(&["run", "-m", synthetic.to_str().unwrap(), "-p", "x"]);
    assert_clean_error(&out, "missing");
}

#[test]
fn bad_flags_are_one_line_errors() {
    let synthetic = golden("gguf/synthetic.gguf");
    let m = synthetic.to_str().unwrap();
    assert_clean_error(&specula(&["run", "-m", m, "--temp", "-1"]), "--temp");
    assert_clean_error(&specula(&["run", "-m", m, "-c", "0"]), "must be positive");
    assert_clean_error(
        &specula(&["run", "-m", m, "--cache-type-k", "q9_9"]),
        "unknown KV cache type `q9_9`",
    );
    // llama.cpp's one-dash spellings, on every command that takes them; weight-only formats
    // are no cache formats.
    assert_clean_error(
        &specula(&["run", "-m", m, "-ctv", "q4_k"]),
        "unknown KV cache type `q4_k`",
    );
    assert_clean_error(
        &specula(&["bench", "-m", m, "-ctk=turbo5"]),
        "unknown KV cache type `turbo5`",
    );
    assert_clean_error(
        &specula(&["perplexity", "-m", m, "-f", m, "-ctk", "x"]),
        "unknown KV cache type `x`",
    );

    // Per-layer formats: malformed specs before the model is read.
    assert_clean_error(
        &specula(&["run", "-m", m, "--cache-type-k-layers", "3-1:q8_0"]),
        "runs backwards",
    );
    assert_clean_error(
        &specula(&["bench", "-m", m, "--cache-type-v-layers", "0-3"]),
        "expected LAYERS:TYPE",
    );
    assert_clean_error(
        &specula(&[
            "perplexity",
            "-m",
            m,
            "-f",
            m,
            "--cache-type-k-layers",
            "2:q9",
        ]),
        "unknown KV cache type `q9`",
    );
    assert_clean_error(&specula(&["bench", "-m", m, "-r", "0"]), "must be positive");
    // clap's own errors exit with 2 and name the flag.
    let out = specula(&["run", "-n", "many"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--n-predict"));
    let out = specula(&["perplexity", "-m", m, "-f", m, "--kl-divergence"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--kl-divergence-base"));
}

/// The architecture check: a small, otherwise loadable GGUF (a SentencePiece vocabulary of
/// four tokens and a token embedding) of an architecture specula does not run — `falcon-h1`,
/// which llama.cpp runs — is refused with the name and the list of the supported ones.
#[test]
fn unsupported_architecture_is_named() {
    use specula_gguf::{Array, GgmlType, GgufWriter, Value};
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("falcon-h1.gguf");
    let mut w = GgufWriter::new();
    let tokens = ["<unk>", "<s>", "</s>", "\u{2581}a"]
        .map(String::from)
        .to_vec();
    for (k, v) in [
        ("general.architecture", Value::String("falcon-h1".into())),
        ("falcon-h1.block_count", Value::U32(1)),
        ("falcon-h1.embedding_length", Value::U32(8)),
        ("tokenizer.ggml.model", Value::String("llama".into())),
        ("tokenizer.ggml.tokens", Value::Array(Array::String(tokens))),
        (
            "tokenizer.ggml.scores",
            Value::Array(Array::F32(vec![0.0, 0.0, 0.0, -1.0])),
        ),
        (
            "tokenizer.ggml.token_type",
            Value::Array(Array::I32(vec![2, 3, 3, 1])),
        ),
        ("tokenizer.ggml.bos_token_id", Value::U32(1)),
        ("tokenizer.ggml.eos_token_id", Value::U32(2)),
    ] {
        w.add(k, v).unwrap();
    }
    w.add_tensor("token_embd.weight", GgmlType::F32, &[8, 4])
        .unwrap();
    w.write_file(&path, |_, spec, sink| {
        let n: u64 = spec.dims.iter().product();
        let bytes: Vec<u8> = (0..n).flat_map(|_| 0.5f32.to_le_bytes()).collect();
        sink.write_all(&bytes)
    })
    .unwrap();
    let out = specula(&["run", "-m", path.to_str().unwrap(), "-p", "a", "-n", "1"]);
    assert_clean_error(
        &out,
        "unsupported architecture `falcon-h1` (supported: llama, qwen2, qwen3, gemma3, qwen3moe, qwen35, qwen35moe, qwen3next, laguna, gemma4)",
    );
}

#[test]
fn default_model_generates_and_respects_the_context() {
    let Some(smollm) = specula_testkit::real_model("smollm2-135m") else {
        return;
    };
    let m = smollm.to_str().unwrap();
    let out = specula(&[
        "run",
        "-m",
        m,
        "-p",
        "def fibonacci(n):",
        "-n",
        "12",
        "--temp",
        "0",
        "-t",
        "2",
        "--json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(j["prompt_ids"].as_array().unwrap().len(), 6);
    assert_eq!(j["generated_ids"].as_array().unwrap().len(), 12);
    assert_eq!(j["timings"]["predicted_n"], 12);
    assert!(
        j["text"].as_str().unwrap().contains("if n"),
        "{}",
        j["text"]
    );

    // Seeded sampling is reproducible.
    let sampled = |seed: &str| {
        let o = specula(&[
            "run",
            "-m",
            m,
            "-p",
            "Once upon a time",
            "-n",
            "8",
            "-s",
            seed,
            "--json",
        ]);
        let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        j["generated_ids"].clone()
    };
    assert_eq!(sampled("7"), sampled("7"));

    // A prompt that does not fit the context is refused before any work.
    let long = "word ".repeat(64);
    let out = specula(&["run", "-m", m, "-p", &long, "-c", "16", "-n", "4"]);
    assert_clean_error(&out, "raise the context size");
}

/// Per-layer formats reach the cache: a layer the model does not have is refused at start,
/// and a mixed layout runs.
#[test]
fn per_layer_cache_types_reach_the_cache() {
    let Some(smollm) = specula_testkit::real_model("smollm2-135m") else {
        return;
    };
    let m = smollm.to_str().unwrap();
    let out = specula(&[
        "run",
        "-m",
        m,
        "-p",
        "x",
        "-n",
        "1",
        "--cache-type-k-layers",
        "28-30:q8_0",
    ]);
    assert_clean_error(&out, "layers 28-30 of a 30-layer model");
    let out = specula(&[
        "run",
        "-m",
        m,
        "-p",
        "def f(x):",
        "-n",
        "4",
        "--temp",
        "0",
        "-ctk",
        "turbo4",
        "-ctv",
        "turbo4",
        "--cache-type-k-layers",
        "0-3:q8_0,29:f16",
        "--cache-type-v-layers",
        "5:q4_0",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Hyperparameters the forward pass cannot use are refused at load, in one line naming the
/// key: an odd `rope.dimension_count` (before the check: a panic in the CPU backend's RoPE at
/// the first forward, with a backtrace), one past the head size, a zero K head size, and heads
/// of zero values (`n_embd / n_head` = 0 without an explicit key length).
#[test]
fn invalid_hyperparameters_are_one_line_errors_naming_the_key() {
    use specula_gguf::Value;
    let dir = tempfile::tempdir().unwrap();
    use specula_testkit::tiny::TinyGguf;
    type Edit = fn(&mut TinyGguf);
    let cases: [(&str, Edit, &str); 4] = [
        (
            "odd_rope",
            |g| g.set("llama.rope.dimension_count", Value::U32(7)),
            "metadata key `llama.rope.dimension_count` = 7: expected an even number in 2..=32",
        ),
        (
            "wide_rope",
            |g| g.set("llama.rope.dimension_count", Value::U32(64)),
            "metadata key `llama.rope.dimension_count` = 64",
        ),
        (
            "zero_key_length",
            |g| g.set("llama.attention.key_length", Value::U32(0)),
            "metadata key `llama.attention.key_length` = 0: expected at least 1",
        ),
        (
            "zero_head",
            |g| {
                g.remove("llama.attention.key_length");
                g.set("llama.attention.head_count", Value::U32(128));
                g.set("llama.attention.head_count_kv", Value::U32(128));
            },
            "metadata key `llama.embedding_length` = 64: expected at least the 128 heads",
        ),
    ];
    for (name, mutate, needle) in cases {
        let mut g = specula_testkit::tiny::target("llama");
        mutate(&mut g);
        let path = dir.path().join(format!("{name}.gguf"));
        std::fs::write(&path, g.to_bytes().unwrap()).unwrap();
        let out = specula(&["run", "-m", path.to_str().unwrap(), "-p", "a", "-n", "2"]);
        assert_clean_error(&out, needle);
    }
    // The unmutated tiny model runs: the errors above are the mutation's.
    let g = specula_testkit::tiny::target("llama");
    let path = dir.path().join("clean.gguf");
    std::fs::write(&path, g.to_bytes().unwrap()).unwrap();
    let out = specula(&["run", "-m", path.to_str().unwrap(), "-p", "a", "-n", "2"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Every architecture a user can point `specula run` at generates, and speculation on it (a
/// random DFlash drafter; the model as its own draft) keeps the greedy output: the tiny target
/// of each of `tiny::ARCHS`, qwen3moe's mixture of experts included.
#[test]
fn every_architecture_runs_from_the_cli_with_and_without_a_drafter() {
    let dir = tempfile::tempdir().unwrap();
    let dflash = dir.path().join("dflash.gguf");
    std::fs::write(
        &dflash,
        specula_testkit::tiny::dflash(false).to_bytes().unwrap(),
    )
    .unwrap();
    let dflash = dflash.to_str().unwrap();
    for arch in specula_testkit::tiny::ARCHS {
        let path = dir.path().join(format!("{arch}.gguf"));
        std::fs::write(
            &path,
            specula_testkit::tiny::target(arch).to_bytes().unwrap(),
        )
        .unwrap();
        let m = path.to_str().unwrap();
        let base = [
            "run",
            "-m",
            m,
            "-p",
            "a b c a b c",
            "-n",
            "12",
            "--temp",
            "0",
            "--json",
            "-t",
            "1",
            "--ignore-eos",
        ];
        let plain = common::json_of(&base);
        let want = &plain["generated_ids"];
        assert_eq!(want.as_array().map(Vec::len), Some(12), "{arch}: {plain}");
        for extra in [
            vec!["-md", dflash, "--dflash"],
            vec!["-md", m, "--spec-type", "draft-simple"],
        ] {
            let mut args = base.to_vec();
            args.extend(&extra);
            let got = common::json_of(&args);
            assert_eq!(&got["generated_ids"], want, "{arch} {extra:?}");
        }
    }
}

/// `--device` on every subcommand that runs a model: a bad value, and CUDA in a build without
/// the `cuda` feature, are one-line errors before any model loads (the model path here does
/// not exist, so reaching the load would say so instead).
#[test]
fn device_flags_are_checked_before_the_model_loads() {
    let dir = tempfile::tempdir().unwrap();
    let text = dir.path().join("text.txt");
    std::fs::write(&text, "some text to score").unwrap();
    let text = text.to_str().unwrap();
    let missing = dir.path().join("missing.gguf");
    let m = missing.to_str().unwrap();
    let commands: [Vec<&str>; 4] = [
        vec!["run", "-m", m, "-p", "a", "-n", "1"],
        vec!["bench", "-m", m, "-p", "8", "-n", "0"],
        vec!["perplexity", "-m", m, "-f", text],
        vec!["serve", "-m", m, "--port", "0"],
    ];
    for cmd in &commands {
        let mut bad = cmd.clone();
        bad.extend(["--device", "gpu"]);
        assert_clean_error(&specula(&bad), "--device gpu: expected cpu, cuda or cuda:N");
        let mut cuda = cmd.clone();
        cuda.extend(["--device", "cuda:1"]);
        let out = specula(&cuda);
        if cfg!(feature = "cuda") {
            continue;
        }
        assert_clean_error(
            &out,
            "--device cuda:1: this specula was built without CUDA (cargo build --release -p specula-cli --features cuda)",
        );
    }
}

/// A hybrid model's recurrent layers keep one state per row a rejection can take back: as
/// many as the draft length, none without drafts (the cache `--json` reports grows by one
/// recurrent state per draft token), and the output does not depend on it.
#[test]
fn recurrent_snapshots_follow_the_draft_length() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("qwen35.gguf");
    std::fs::write(
        &path,
        specula_testkit::tiny::target("qwen35").to_bytes().unwrap(),
    )
    .unwrap();
    let m = path.to_str().unwrap();
    let run = |extra: &[&str]| {
        let mut args = vec![
            "run",
            "-m",
            m,
            "-p",
            "a b c a b c a b c",
            "-n",
            "10",
            "--temp",
            "0",
            "--json",
            "-t",
            "1",
            "--ignore-eos",
        ];
        args.extend(extra);
        let j = common::json_of(&args);
        (
            j["kv"]["bytes"].as_u64().unwrap(),
            j["generated_ids"].clone(),
        )
    };
    let (none, want) = run(&["--spec-type", "none"]);
    let (three, got3) = run(&["--spec-type", "ngram-simple", "--spec-draft-n-max", "3"]);
    let (twelve, got12) = run(&["--spec-type", "ngram-simple", "--spec-draft-n-max", "12"]);
    assert_eq!((&got3, &got12), (&want, &want));
    assert!(none < three && three < twelve, "{none} {three} {twelve}");
    // One recurrent state per draft token.
    assert_eq!((twelve - three) * 3, (three - none) * 9);
}
