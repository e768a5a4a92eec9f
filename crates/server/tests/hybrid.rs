//! A hybrid model (Qwen3.5's gated delta-net layers beside gated attention) behind the server:
//! with `-np 2` the batched multi-sequence forward keeps each sequence's recurrent state apart,
//! so requests running together — and a request whose prompt shares a prefix with the slot's
//! previous one (a recurrent state cannot be cut back to the prefix: the slot starts over) —
//! answer with the token ids and log-probabilities of a fresh one-slot server, bit for bit, also
//! while speculating with a draft model (itself, recurrent too) or n-gram lookup.

mod common;

use common::{Draft, post, server_on};
use serde_json::{Value, json};
use specula_server::ServerConfig;

fn model(arch: &str) -> Vec<u8> {
    specula_testkit::tiny::target(arch).to_bytes().unwrap()
}

fn cfg(n_parallel: usize) -> ServerConfig {
    ServerConfig {
        n_parallel,
        n_ctx: 256 * n_parallel,
        ..ServerConfig::default()
    }
}

/// Token ids and per-step log-probabilities of a greedy completion.
fn complete(addr: std::net::SocketAddr, prompt: &str, n: u64) -> (Vec<u64>, Vec<Value>) {
    let body = json!({"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": true,
                      "stream": true, "logprobs": 2});
    let r = post(addr, "/v1/completions", &body);
    assert_eq!(r.status, 200, "{}", r.text());
    let (mut ids, mut lps) = (Vec::new(), Vec::new());
    for d in r.sse() {
        if d == "[DONE]" {
            continue;
        }
        let v: Value = serde_json::from_str(&d).unwrap();
        if let Some(ts) = v["tokens"].as_array() {
            ids.extend(ts.iter().map(|t| t.as_u64().unwrap()));
        }
        let lp = &v["choices"][0]["logprobs"];
        if !lp.is_null() {
            lps.push(lp.clone());
        }
    }
    assert_eq!(ids.len() as u64, n, "{prompt}: one id per token");
    (ids, lps)
}

const A: &str = "a b c d e f g h i j k l m n o p";
const B: &str = "z y x w v";
/// Shares `A`'s first four words.
const C: &str = "a b c d q r s";

#[test]
fn hybrid_slots_answer_as_a_fresh_server() {
    for arch in ["qwen35", "qwen35moe", "qwen3next"] {
        let bytes = model(arch);
        let fresh = |prompt: &str| {
            let s = server_on(bytes.clone(), cfg(1), Draft::None, 512);
            complete(s.addr(), prompt, 20)
        };
        let (want_b, want_c) = (fresh(B), fresh(C));
        for draft in [Draft::None, Draft::SelfModel, Draft::Ngram] {
            let what = format!("{arch}, {draft:?}");
            let s = server_on(bytes.clone(), cfg(2), draft, 8);
            let addr = s.addr();
            complete(addr, A, 24);
            let (got_b, got_c) = std::thread::scope(|sc| {
                let hb = sc.spawn(|| complete(addr, B, 20));
                let hc = sc.spawn(|| complete(addr, C, 20));
                (hb.join().unwrap(), hc.join().unwrap())
            });
            assert_eq!(got_b, want_b, "{what}: B beside C");
            assert_eq!(got_c, want_c, "{what}: C beside B, after A on its slot");
        }
    }
}
