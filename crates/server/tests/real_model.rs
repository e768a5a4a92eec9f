//! The server on SmolLM2-135M (Q4_1, the packed quantized kernels), when it has been fetched:
//! four chat requests decoded together in one batched forward per step give each the text it
//! gets alone, and an n-gram drafter does not change greedy output. Skips with a note when the
//! model is not in the cache (`cargo xtask fetch-models smollm2-135m`).

mod common;

use std::sync::Arc;

use common::{post, streamed};
use serde_json::{Value, json};
use specula_cpu::CpuBackend;
use specula_engine::{Engine, SpecOptions};
use specula_gguf::Gguf;
use specula_models::Model;
use specula_server::{ServerConfig, ServerHandle, Speculative};
use specula_spec::ngram::NgramSimple;
use specula_tokenizer::Tokenizer;

fn smollm(n_parallel: usize, ngram: bool) -> Option<ServerHandle> {
    let Some(path) = specula_fetch::cached_model_path("smollm2-135m") else {
        eprintln!("skipped: smollm2-135m not fetched (cargo xtask fetch-models smollm2-135m)");
        return None;
    };
    let file = Arc::new(Gguf::open(&path).unwrap());
    let be = CpuBackend::new(2);
    let model = Model::load(&be, Arc::clone(&file)).unwrap();
    let engine = Engine::new(be, model, Tokenizer::from_gguf(&file).unwrap());
    let tok = Tokenizer::from_gguf(&file).unwrap();
    let spec = ngram.then(|| Speculative {
        kind: "ngram-simple".into(),
        options: SpecOptions::default(),
        factory: Box::new(|| Ok(Box::new(NgramSimple::default()) as _)),
    });
    let cfg = ServerConfig {
        port: 0,
        n_parallel,
        n_ctx: 1024 * n_parallel,
        ..ServerConfig::default()
    };
    Some(specula_server::start(cfg, engine, tok, spec).unwrap())
}

fn chat(q: &str) -> Value {
    json!({"messages": [{"role": "user", "content": q}], "max_tokens": 24, "temperature": 0})
}

const QUESTIONS: [&str; 4] = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain what a CPU does in one sentence.",
];

#[test]
fn smollm2_batched_slots_and_ngram_drafts_keep_greedy_answers() {
    let Some(alone) = smollm(1, false) else {
        return;
    };
    let want: Vec<String> = QUESTIONS
        .iter()
        .map(|q| {
            let v = post(alone.addr(), "/v1/chat/completions", &chat(q)).json();
            v["choices"][0]["message"]["content"]
                .as_str()
                .unwrap()
                .to_owned()
        })
        .collect();
    drop(alone);
    let Some(s) = smollm(4, true) else { return };
    let addr = s.addr();
    let got: Vec<String> = std::thread::scope(|sc| {
        let hs: Vec<_> = QUESTIONS
            .iter()
            .map(|q| {
                sc.spawn(move || {
                    let mut body = chat(q);
                    body["stream"] = json!(true);
                    streamed(&post(addr, "/v1/chat/completions", &body)).text
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(got, want);
}
