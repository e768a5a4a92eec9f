//! A request's output does not depend on what ran before it (issue 14, item 3): with every
//! quantized KV cache type, request B served after an unrelated request A on the same slot —
//! and B reusing part of A's prompt from the slot's cache, a prefix whose length is not a
//! multiple of the prompt chunk — gives B's token ids and log-probabilities of a fresh server,
//! bit for bit; and so on `-np 2` with requests running together.
//!
//! Guards the per-head offsets of quantized planes (`specula_kv::Plane::calibrate`): fixed at a
//! plane's first write, they made a reused slot quantize every later request with the offsets
//! of the first one it ever ran.

mod common;

use common::{Draft, post, server_on, tiny_heads};
use serde_json::{Value, json};
use specula_quant::QType;
use specula_server::ServerConfig;

/// The prompt chunk: the shared prefix below is shorter than one and not a multiple of it, so
/// a fresh run of `C` writes its own tokens into the first chunk that `A` wrote before it.
const N_BATCH: usize = 16;

/// The tiny target with 64-value heads (block formats need 32, their Hadamard rotation 64).
fn model() -> Vec<u8> {
    tiny_heads(common::SEED, 0, false, 64)
}

fn cfg(n_parallel: usize, k: QType, v: QType) -> ServerConfig {
    ServerConfig {
        n_parallel,
        n_ctx: 512 * n_parallel,
        k_type: k,
        v_type: v,
        ..ServerConfig::default()
    }
}

/// What a greedy completion gave: its token ids, the log-probabilities of each step (the
/// chosen token's and the top 3, as the server prints them) and the prompt tokens it reused.
#[derive(Debug, PartialEq)]
struct Answer {
    ids: Vec<u64>,
    logprobs: Vec<Value>,
    cache_n: u64,
}

fn complete(addr: std::net::SocketAddr, prompt: &str, n: u64) -> Answer {
    let body = json!({"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": true,
                      "stream": true, "logprobs": 3});
    let r = post(addr, "/v1/completions", &body);
    assert_eq!(r.status, 200, "{}", r.text());
    let mut a = Answer {
        ids: Vec::new(),
        logprobs: Vec::new(),
        cache_n: 0,
    };
    for d in r.sse() {
        if d == "[DONE]" {
            continue;
        }
        let v: Value = serde_json::from_str(&d).unwrap();
        if let Some(ts) = v["tokens"].as_array() {
            a.ids.extend(ts.iter().map(|t| t.as_u64().unwrap()));
        }
        let lp = &v["choices"][0]["logprobs"];
        if !lp.is_null() {
            a.logprobs.push(lp.clone());
        }
        if let Some(c) = v["timings"]["cache_n"].as_u64() {
            a.cache_n = c;
        }
    }
    assert_eq!(a.ids.len() as u64, n, "{prompt}: one id per token");
    assert_eq!(a.logprobs.len() as u64, n, "{prompt}: logprobs per token");
    a
}

/// The same answer, whatever the cache reuse was.
fn same(got: &Answer, want: &Answer, what: &str) {
    assert_eq!(got.ids, want.ids, "{what}: ids");
    assert_eq!(got.logprobs, want.logprobs, "{what}: logprobs");
}

/// A long request, unrelated to [`B`] but sharing [`SHARED`]'s 13 characters with [`C`].
const A: &str = "zq, an unrelated and rather long request about the weather, the sea and the \
                 harbour, with numbers 12345 67890 and more words so that it fills many cells";
/// Unrelated to `A` from its first character.
const B: &str = "def merge_sort(xs):";
/// `A`'s first 13 characters (one token each in the tiny byte vocabulary), then its own tail.
const SHARED: usize = 13;
fn c_prompt() -> String {
    format!("{}: and now something else entirely", &A[..SHARED])
}

#[test]
fn every_quantized_cache_answers_as_a_fresh_server_after_other_requests() {
    use QType::*;
    let bytes = model();
    let settings = [
        (Q8_0, Q8_0),
        (Q4_0, Q4_0),
        (Q4_1, Q4_1),
        (Q5_0, Q5_0),
        (Q5_1, Q5_1),
        (IQ4_NL, IQ4_NL),
        (Turbo2, Turbo2),
        (Turbo3, Turbo3),
        (Turbo4, Turbo4),
        (Q8_0, Turbo4),
        (Turbo3, Q4_0),
        (F16, Q4_1),
    ];
    let c = c_prompt();
    assert_ne!(
        SHARED % N_BATCH,
        0,
        "the shared prefix is not a whole chunk"
    );
    for (k, v) in settings {
        let what = format!("-ctk {k} -ctv {v}");
        let fresh = |prompt: &str, n: u64| {
            let s = server_on(bytes.clone(), cfg(1, k, v), Draft::None, N_BATCH);
            complete(s.addr(), prompt, n)
        };
        let (want_b, want_c) = (fresh(B, 24), fresh(&c, 24));
        assert_eq!(want_c.cache_n, 0);

        // One slot: A, then C reusing A's first 13 positions, then B reusing nothing.
        let s = server_on(bytes.clone(), cfg(1, k, v), Draft::None, N_BATCH);
        complete(s.addr(), A, 40);
        let got_c = complete(s.addr(), &c, 24);
        assert_eq!(
            got_c.cache_n, SHARED as u64,
            "{what}: C reuses A's prefix from the slot's cache"
        );
        same(
            &got_c,
            &want_c,
            &format!("{what}: C after A (prompt-cache hit)"),
        );
        let got_b = complete(s.addr(), B, 24);
        same(&got_b, &want_b, &format!("{what}: B after A and C"));
        drop(s);

        // Two slots: A on one, then B and C together (C takes A's slot, with its prefix).
        let s = server_on(bytes.clone(), cfg(2, k, v), Draft::None, N_BATCH);
        let addr = s.addr();
        complete(addr, A, 40);
        let (got_b, got_c) = std::thread::scope(|sc| {
            let hb = sc.spawn(|| complete(addr, B, 24));
            let hc = sc.spawn(|| complete(addr, &c, 24));
            (hb.join().unwrap(), hc.join().unwrap())
        });
        same(&got_b, &want_b, &format!("{what}: -np 2, B with C"));
        same(&got_c, &want_c, &format!("{what}: -np 2, C with B"));
    }
}
