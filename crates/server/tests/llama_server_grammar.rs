//! Constrained greedy output against llama-server's (golden/llama_server_grammar/, recorded by
//! reference/llama_server_grammar_fixtures.py from the reference build on SmolLM2-135M Q4_1
//! with `-t 2 -c 2048 -np 1`): the same /completion requests with a GBNF `grammar` or a
//! `json_schema` give the same `content` and `tokens`. llama-server masks with its own GBNF
//! sampler (a schema through json-schema-to-grammar), specula with llguidance (GBNF through
//! the bridge of `specula-grammar`), so equal output says the two constrain alike. Skips when
//! the model is not fetched.

use std::path::PathBuf;
use std::sync::Arc;

mod common;

use common::post;
use serde_json::Value;
use specula_cpu::CpuBackend;
use specula_engine::Engine;
use specula_gguf::Gguf;
use specula_models::Model;
use specula_server::ServerConfig;
use specula_tokenizer::Tokenizer;

fn fixtures() -> Vec<(String, Value)> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../golden/llama_server_grammar");
    let mut out: Vec<(String, Value)> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", dir.display()))
        .filter_map(|e| {
            let p = e.ok()?.path();
            (p.extension()? == "json").then(|| {
                let text = std::fs::read_to_string(&p).unwrap();
                (
                    p.file_stem().unwrap().to_string_lossy().into_owned(),
                    serde_json::from_str(&text).unwrap(),
                )
            })
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

#[test]
fn grammars_and_schemas_constrain_greedy_output_as_llama_server_does() {
    let Some(path) = specula_testkit::real_model("smollm2-135m") else {
        return;
    };
    let file = Arc::new(Gguf::open(&path).unwrap());
    let be = CpuBackend::new(2);
    let model = Model::load(&be, Arc::clone(&file)).unwrap();
    let engine = Engine::new(be, model, Tokenizer::from_gguf(&file).unwrap());
    let tok = Tokenizer::from_gguf(&file).unwrap();
    let cfg = ServerConfig {
        port: 0,
        n_parallel: 1,
        n_ctx: 2048,
        ..ServerConfig::default()
    };
    let s = specula_server::start(cfg, engine, tok, None).unwrap();
    let fx = fixtures();
    assert!(
        fx.len() >= 6,
        "golden/llama_server_grammar/ holds {} fixtures",
        fx.len()
    );
    for (name, g) in fx {
        let body = &g["request"]["body"];
        let r = post(s.addr(), "/completion", body);
        assert_eq!(
            u64::from(r.status),
            g["status"].as_u64().unwrap(),
            "{name}: {}",
            r.text()
        );
        let got = r.json();
        let want = &g["response"];
        assert_eq!(got["content"], want["content"], "{name}: content");
        assert_eq!(got["tokens"], want["tokens"], "{name}: tokens");
        assert_eq!(got["stop_type"], want["stop_type"], "{name}: stop_type");
    }
}
