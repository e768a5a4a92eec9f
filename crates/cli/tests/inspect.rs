//! `specula inspect` end to end: the binary's JSON report against what gguf-py's reader saw
//! (`golden/gguf/*.json`, written by `reference/gguf_golden.py`), on the synthetic files
//! always and on the real models when they are in the cache.

use std::path::{Path, PathBuf};

use serde_json::Value as Json;

mod common;
use common::specula;

fn golden(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../golden/gguf")
        .join(name)
}

fn inspect_json(path: &Path) -> Json {
    let out = specula(&["inspect", path.to_str().unwrap(), "--json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("inspect --json prints one JSON object")
}

fn load(name: &str) -> Json {
    serde_json::from_str(&std::fs::read_to_string(golden(name)).unwrap()).unwrap()
}

/// Same keys in the same order with the same types (and scalar values), and the same tensor
/// list (name, type, shape, offset, bytes) as gguf-py.
fn assert_same_as_gguf_py(ours: &Json, theirs: &Json) {
    let file = theirs["file"].as_str().unwrap();
    assert_eq!(ours["file_size"], theirs["file_size"], "{file}");
    assert_eq!(ours["data_offset"], theirs["data_offset"], "{file}");
    let (om, tm) = (
        ours["metadata"].as_array().unwrap(),
        theirs["metadata"].as_array().unwrap(),
    );
    let keys = |m: &[Json]| -> Vec<String> {
        m.iter()
            .map(|e| e["key"].as_str().unwrap().to_owned())
            .collect()
    };
    assert_eq!(keys(om), keys(tm), "{file}: metadata keys");
    for (o, t) in om.iter().zip(tm) {
        let key = t["key"].as_str().unwrap();
        assert_eq!(o["type"], t["type"], "{key}");
        if t["type"] == "ARRAY" {
            assert_eq!(o["value"]["elem_type"], t["elem_type"], "{key}");
            assert_eq!(o["value"]["len"], t["len"], "{key}");
            if let Some(head) = t["head"].as_array() {
                let ours_head = &o["value"]["head"].as_array().unwrap()[..head.len()];
                assert_eq!(ours_head, &head[..], "{key}");
            }
        } else {
            assert_eq!(o["value"], t["value"], "{key}");
        }
    }
    let (ot, tt) = (
        ours["tensors"].as_array().unwrap(),
        theirs["tensors"].as_array().unwrap(),
    );
    assert_eq!(ot.len(), tt.len(), "{file}: tensor count");
    for (o, t) in ot.iter().zip(tt) {
        let name = t["name"].as_str().unwrap();
        assert_eq!(o["name"], t["name"]);
        assert_eq!(o["type"], t["type"], "{name}");
        assert_eq!(o["shape"], t["dims"], "{name}");
        assert_eq!(o["offset"], t["offset"], "{name}");
        assert_eq!(o["bytes"], t["n_bytes"], "{name}");
    }
    let bytes: u64 = tt.iter().map(|t| t["n_bytes"].as_u64().unwrap()).sum();
    assert_eq!(ours["totals"]["bytes"].as_u64(), Some(bytes));
    assert_eq!(ours["totals"]["n_tensors"].as_u64(), Some(tt.len() as u64));
}

#[test]
fn synthetic_files_match_gguf_py() {
    for name in ["synthetic", "synthetic-align64"] {
        let ours = inspect_json(&golden(&format!("{name}.gguf")));
        assert_same_as_gguf_py(&ours, &load(&format!("{name}.json")));
        assert_eq!(ours["architecture"], "llama");
        assert_eq!(ours["hyperparameters"]["block_count"], 2);
    }
}

/// The acceptance check of the foundation issue: on the real SmolLM2-135M file `inspect`
/// reports architecture `llama`, 272 tensors and gguf-py's keys and tensors. The other real
/// models are checked the same way when cached.
#[test]
fn real_models_match_gguf_py_when_fetched() {
    for (model, golden_name) in [
        ("smollm2-135m", "smollm2-135m.json"),
        ("qwen2.5-coder-0.5b", "qwen2.5-coder-0.5b.json"),
        ("qwen2.5-coder-1.5b", "qwen2.5-coder-1.5b.json"),
        ("gemma3-270m", "gemma3-270m.json"),
    ] {
        let Some(path) = specula_testkit::real_model(model) else {
            continue;
        };
        let ours = inspect_json(&path);
        assert_same_as_gguf_py(&ours, &load(golden_name));
        if model == "smollm2-135m" {
            assert_eq!(ours["architecture"], "llama");
            assert_eq!(ours["totals"]["n_tensors"], 272);
            assert_eq!(ours["tokenizer"]["n_tokens"], 49152);
            assert_eq!(ours["tokenizer"]["eos"]["text"], "<|im_end|>");
        }
        eprintln!("checked {model} against gguf-py");
    }
}

#[test]
fn text_output_summarises_the_file() {
    let out = specula(&["inspect", golden("synthetic.gguf").to_str().unwrap()]);
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("architecture  llama"), "{text}");
    assert!(text.contains("t.nvfp4"), "{text}");
    assert!(text.contains("metadata (32 keys)"), "{text}");
}

/// A corrupt file is a one-line error with the offset and a failure exit code, not a panic.
#[test]
fn corrupt_and_missing_files_are_precise_errors() {
    let dir = tempfile::tempdir().unwrap();
    let bytes = std::fs::read(golden("synthetic.gguf")).unwrap();
    let cut = dir.path().join("cut.gguf");
    std::fs::write(&cut, &bytes[..bytes.len() - 100]).unwrap();
    let out = specula(&["inspect", cut.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("past the end of the file"), "{err}");
    assert!(!err.contains("panicked"), "{err}");

    let out = specula(&["inspect", "no-such-model-or-file"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("known models: smollm2-135m"), "{err}");
}
