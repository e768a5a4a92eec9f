//! The server on SmolLM2-135M (Q4_1, the packed quantized kernels), when it has been fetched:
//! four chat requests decoded together in one batched forward per step give each the text it
//! gets alone, and an n-gram drafter does not change greedy output. Skips with a note when the
//! model is not in the cache (`cargo xtask fetch-models smollm2-135m`). Gemma-3 270m with a
//! sliding-window ring smaller than a slot: the same, past the ring.

mod common;

use common::{post, streamed};
use serde_json::{Value, json};
use specula_server::{ServerConfig, ServerHandle};

fn smollm(n_parallel: usize, ngram: bool) -> Option<ServerHandle> {
    let cfg = ServerConfig {
        n_parallel,
        n_ctx: 1024 * n_parallel,
        ..ServerConfig::default()
    };
    common::real("smollm2-135m", cfg, ngram.then(common::ngram))
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

/// Gemma-3 270m with forwards of 16 rows, so its sliding-window layers keep a ring of
/// 512 + 16 cells of a 1024-cell slot.
fn gemma(n_parallel: usize, ngram: bool) -> Option<ServerHandle> {
    let path = specula_testkit::real_model("gemma3-270m")?;
    let cfg = ServerConfig {
        n_parallel,
        n_ctx: 1024 * n_parallel,
        ..ServerConfig::default()
    };
    let spec = ngram.then(common::ngram);
    Some(common::real_server_tuned(&path, cfg, spec, |engine| {
        engine.n_batch = 16;
        assert_eq!(engine.swa_ring(), Some(528));
    }))
}

/// Slots whose sliding-window layers wrap their ring: prompts of over 600 tokens decoded
/// together, with n-gram drafts (verify batches over 16 rows are split), give each the text it
/// gets alone on one slot without drafts; a second request sharing most of a cached prompt
/// reuses only a prefix the ring can trim to exactly, else reprocesses the prompt.
#[test]
fn gemma3_ring_slots_and_ngram_drafts_keep_greedy_answers() {
    let prompts: Vec<String> = (0..3)
        .map(|k| {
            (0..45)
                .map(|i| format!("row {i}: acc = acc * {} + data[{}]\n", k + 2, i % 5))
                .collect()
        })
        .collect();
    let body = |p: &str| json!({"prompt": p, "max_tokens": 40, "temperature": 0});
    let text = |v: &Value| {
        v["choices"][0]["text"]
            .as_str()
            .unwrap_or_else(|| panic!("{v}"))
            .to_owned()
    };
    let Some(alone) = gemma(1, false) else {
        return;
    };
    let want: Vec<String> = prompts
        .iter()
        .map(|p| text(&post(alone.addr(), "/v1/completions", &body(p)).json()))
        .collect();
    let first = post(alone.addr(), "/v1/completions", &body(&prompts[0])).json();
    assert!(
        first["usage"]["prompt_tokens"].as_u64().unwrap() > 600,
        "{first}"
    );
    drop(alone);
    let Some(s) = gemma(2, true) else { return };
    let addr = s.addr();
    let got: Vec<String> = std::thread::scope(|sc| {
        let hs: Vec<_> = prompts
            .iter()
            .map(|p| sc.spawn(move || text(&post(addr, "/v1/completions", &body(p)).json())))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(got, want);
    // The same prompts again, one by one: cached prefixes are reused where exact.
    for (p, w) in prompts.iter().zip(&want) {
        assert_eq!(&text(&post(addr, "/v1/completions", &body(p)).json()), w);
    }
}
