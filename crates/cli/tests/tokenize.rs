//! `specula tokenize` end to end: on a tiny vocabulary written here, and on the real models
//! (when cached) against llama.cpp's ids in `golden/tokenizer/<model>.json`.

use std::path::{Path, PathBuf};
use std::process::Output;

use serde_json::Value as Json;
use specula_gguf::{Array, GgufWriter, Value};

mod common;
use common::specula;

fn stdout(out: &Output) -> String {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout.clone()).unwrap()
}

/// A Qwen2-style byte-level vocabulary: "hi" merges, " hi" merges, one control token.
fn tiny_model(dir: &Path, pre: &str) -> PathBuf {
    let mut w = GgufWriter::new();
    w.add("tokenizer.ggml.model", Value::String("gpt2".into()))
        .unwrap();
    w.add("tokenizer.ggml.pre", Value::String(pre.into()))
        .unwrap();
    let tokens = [
        "h",
        "i",
        "Ġ",
        "hi",
        "Ġhi",
        "<|im_end|>",
        "<",
        "|",
        "m",
        "_",
        "e",
        "n",
        "d",
        ">",
    ];
    w.add(
        "tokenizer.ggml.tokens",
        Value::Array(Array::String(tokens.map(String::from).to_vec())),
    )
    .unwrap();
    let mut types = vec![1; tokens.len()];
    types[5] = 3;
    w.add("tokenizer.ggml.token_type", Value::Array(Array::I32(types)))
        .unwrap();
    w.add(
        "tokenizer.ggml.merges",
        Value::Array(Array::String(vec!["h i".into(), "Ġ hi".into()])),
    )
    .unwrap();
    w.add("tokenizer.ggml.eos_token_id", Value::U32(5)).unwrap();
    let path = dir.join(format!("tiny-{pre}.gguf"));
    w.write_file(&path, |_, _, _| Ok(())).unwrap();
    path
}

#[test]
fn prints_ids_pieces_and_json() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path(), "qwen2");
    let m = model.to_str().unwrap();

    let ids = stdout(&specula(&[
        "tokenize",
        "-m",
        m,
        "-p",
        "hi hi<|im_end|>",
        "--ids",
    ]));
    assert_eq!(ids, "[3, 4, 5]\n");

    let text = stdout(&specula(&["tokenize", "-m", m, "-p", "hi hi<|im_end|>"]));
    assert_eq!(
        text,
        "     3 -> 'hi'\n     4 -> ' hi'\n     5 -> '<|im_end|>'\n"
    );

    // Without special parsing the control token is spelled out character by character.
    let plain = stdout(&specula(&[
        "tokenize",
        "-m",
        m,
        "-p",
        "<|im_end|>",
        "--ids",
        "--no-parse-special",
    ]));
    assert_eq!(plain, "[6, 7, 1, 8, 9, 10, 11, 12, 7, 13]\n");

    let json: Json = serde_json::from_str(&stdout(&specula(&[
        "tokenize", "-m", m, "-p", "hi", "--json",
    ])))
    .unwrap();
    assert_eq!(json["ids"], serde_json::json!([3]));
    assert_eq!(json["pieces"], serde_json::json!(["hi"]));
    assert_eq!(json["n_tokens"], 1);
    assert_eq!(json["parse_special"], true);
}

#[test]
fn errors_are_one_line_with_a_failure_status() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.gguf");
    let out = specula(&["tokenize", "-m", missing.to_str().unwrap(), "-p", "x"]);
    assert!(!out.status.success());
    let err = String::from_utf8(out.stderr).unwrap();
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.contains("missing.gguf") && err.contains("no such file"),
        "{err}"
    );

    let model = tiny_model(dir.path(), "not-a-pre-tokenizer");
    let out = specula(&["tokenize", "-m", model.to_str().unwrap(), "-p", "x"]);
    assert!(!out.status.success());
    let err = String::from_utf8(out.stderr).unwrap();
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.contains("unknown pre-tokenizer 'not-a-pre-tokenizer'"),
        "{err}"
    );
}

#[test]
fn real_models_give_llama_cpps_ids() {
    for model in ["smollm2-135m", "qwen2.5-coder-0.5b", "gemma3-270m"] {
        let Some(path) = specula_testkit::real_model(model) else {
            continue;
        };
        let golden = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../golden/tokenizer")
            .join(format!("{model}.json"));
        let g: Json = serde_json::from_str(&std::fs::read_to_string(golden).unwrap()).unwrap();
        let mut checked = 0;
        for s in g["strings"].as_array().unwrap() {
            let text = s["text"].as_str().unwrap();
            // Arguments cannot carry NUL; everything else goes through the command line.
            if text.contains('\0') || text.is_empty() {
                continue;
            }
            let mode = &s["modes"][0];
            assert_eq!(mode["add_special"], true);
            assert_eq!(mode["parse_special"], true);
            let ids = stdout(&specula(&[
                "tokenize",
                "-m",
                path.to_str().unwrap(),
                "-p",
                text,
                "--ids",
            ]));
            let theirs: Vec<String> = mode["ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(ToString::to_string)
                .collect();
            assert_eq!(
                ids,
                format!("[{}]\n", theirs.join(", ")),
                "{model} {text:?}"
            );
            checked += 1;
            if checked == 6 {
                break;
            }
        }
    }
}
