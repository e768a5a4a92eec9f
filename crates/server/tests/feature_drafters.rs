//! `specula-server` with feature drafters (DFlash, DFlash2, EAGLE-3) on loopback, around the
//! tiny random llama and tiny random drafters built in memory:
//!
//! - the batched forward captures each slot's own hidden states, bit for bit those of the
//!   slot run alone, and only for the entries that ask;
//! - greedy output with each drafter equals the output without one;
//! - a prompt-cache hit drafts exactly as a cold request: the same request twice, a request
//!   sharing only a prefix with the previous one, and a request whose prefix was written by a
//!   request that did not draft (its drafter never saw those positions: llama.cpp fork bug
//!   TheTom#231 left such hits without draft context, and they drafted nothing);
//! - two slots drafting side by side give each request the answer and the drafts it gets
//!   alone.
//!
//! Draft lengths are fixed (no timing-driven policy) and `p_min` cuts drafts where the drafter
//! is unsure, so `draft_n` follows the drafter's outputs round by round: two runs with
//! different draft context would draft different lengths.

mod common;

use common::{Draft, fixed, get, metric, post, server, streamed};
use serde_json::{Value, json};
use specula_engine::{BatchEntry, Capture};
use specula_quant::QType;
use specula_server::ServerConfig;
use specula_tensor::Backend;

fn cfg(n_parallel: usize) -> ServerConfig {
    ServerConfig {
        n_parallel,
        n_ctx: 512 * n_parallel,
        ..ServerConfig::default()
    }
}

/// The drafters' `p_min`: high enough that the random drafters stop many drafts early, low
/// enough that they draft in most rounds (checked by [`Run::check_varied`]).
const P_MIN: f32 = 0.3;

fn drafters() -> Vec<(&'static str, Draft)> {
    let opts = fixed(5, P_MIN);
    vec![
        (
            "dflash deferred",
            Draft::Dflash {
                deferred: true,
                dflash2: false,
                options: opts,
            },
        ),
        (
            "dflash eager",
            Draft::Dflash {
                deferred: false,
                dflash2: false,
                options: opts,
            },
        ),
        (
            "dflash2",
            Draft::Dflash {
                deferred: true,
                dflash2: true,
                // The selector is surer of itself.
                options: fixed(5, 0.5),
            },
        ),
        ("eagle3", Draft::Eagle3 { options: opts }),
    ]
}

fn chat(messages: &[&str], max_tokens: u64) -> Value {
    let msgs: Vec<Value> = messages
        .iter()
        .enumerate()
        .map(|(i, m)| json!({"role": if i % 2 == 0 { "user" } else { "assistant" }, "content": m}))
        .collect();
    json!({"messages": msgs, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true,
           "stream": true})
}

/// What a streamed greedy request gave.
#[derive(Debug, PartialEq)]
struct Run {
    ids: Vec<u64>,
    draft_n: u64,
    accepted: u64,
    rounds: u64,
}

impl Run {
    /// Drafts were made, and `p_min` cut some of them short (by more than the end of the
    /// budget does: at most 1 + 2 + 3 + 4 tokens): the draft lengths follow what the drafter
    /// computed.
    fn check_varied(&self, what: &str) {
        assert!(
            self.draft_n > 0 && self.draft_n + 10 < 5 * self.rounds,
            "{what}: {self:?}"
        );
    }
}

/// Sends a streamed request; returns the run and `timings.cache_n`.
fn send(addr: std::net::SocketAddr, body: &Value) -> (Run, u64) {
    let (run, cache_n, _) = send_full(addr, body);
    (run, cache_n)
}

/// [`send`], and the prompt's length in tokens.
fn send_full(addr: std::net::SocketAddr, body: &Value) -> (Run, u64, u64) {
    let st = streamed(&post(addr, "/v1/chat/completions", body));
    let t = &st.last["timings"];
    let n = |k: &str| t[k].as_u64().unwrap_or_else(|| panic!("{k} in {t}"));
    // A server without a drafter reports no draft counters.
    let d = |k: &str| t.get(k).map_or(0, |_| n(k));
    (
        Run {
            ids: st.tokens,
            draft_n: d("draft_n"),
            accepted: d("draft_n_accepted"),
            rounds: d("draft_rounds"),
        },
        n("cache_n"),
        st.last["usage"]["prompt_tokens"].as_u64().unwrap(),
    )
}

/// Batch invariance with capture: the features `decode_multi` gives an entry with other
/// sessions beside it (one of them capturing nothing) are bit for bit those of the session
/// run alone (`prefill_with_features`), and so are the logits.
#[test]
fn a_batched_decode_captures_each_session_its_own_features_bit_for_bit() {
    let e = common::engine(common::tiny(common::SEED, 0, false));
    let prompts: [&[u32]; 3] = [&[72, 101, 108], &[1, 2, 3, 4, 5, 6, 7, 8, 9], &[200]];
    let next: [&[u32]; 3] = [&[33, 34], &[10, 11, 12, 13], &[5, 6]];
    let layers: [&[usize]; 3] = [&[2, 0], &[], &[1]];
    let mut alone = Vec::new();
    let mut alone_logits = Vec::new();
    for ((p, n), l) in prompts.iter().zip(&next).zip(&layers) {
        let mut s = e.session(64, QType::F16, QType::F16).unwrap();
        e.prefill(&mut s, p, false).unwrap();
        let mut taps = specula_models::Taps {
            layers: l.to_vec(),
            rows: Vec::new(),
        };
        let (mut logits, mut feats) = (Vec::new(), Vec::new());
        e.prefill_with_features(&mut s, n, 0, &mut logits, &mut taps, &mut feats)
            .unwrap();
        alone.push(feats);
        alone_logits.extend(logits);
    }
    let mut sessions: Vec<_> = prompts
        .iter()
        .map(|p| {
            let mut s = e.session(64, QType::F16, QType::F16).unwrap();
            e.prefill(&mut s, p, false).unwrap();
            s
        })
        .collect();
    let mut taps: Vec<specula_models::Taps> = layers
        .iter()
        .map(|l| specula_models::Taps {
            layers: l.to_vec(),
            rows: Vec::new(),
        })
        .collect();
    let mut feats = vec![vec![-1.0f32]; 3];
    let mut entries: Vec<BatchEntry<'_, _>> = sessions
        .iter_mut()
        .zip(&next)
        .zip(taps.iter_mut().zip(feats.iter_mut()))
        .map(|((s, n), (t, f))| BatchEntry {
            session: s,
            tokens: n,
            logits_from: 0,
            capture: (!t.layers.is_empty()).then_some(Capture {
                taps: t,
                features: f,
                device: None,
            }),
        })
        .collect();
    let mut scratch = e.scratch();
    let mut out = specula_engine::Readout::default();
    e.decode_multi(&mut entries, &mut scratch, &mut out)
        .unwrap();
    drop(entries);
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
    assert_eq!(bits(&out.logits), bits(&alone_logits), "logits");
    for (i, (got, want)) in feats.iter().zip(&alone).enumerate() {
        if layers[i].is_empty() {
            assert_eq!(got, &vec![-1.0], "entry {i} asked for nothing: untouched");
        } else {
            assert_eq!(got.len(), next[i].len() * layers[i].len() * 64);
            assert_eq!(bits(got), bits(want), "features of entry {i}");
        }
    }

    // The same batch capturing into backend tensors: the same bits there, nothing on the host.
    let mut sessions: Vec<_> = prompts
        .iter()
        .map(|p| {
            let mut s = e.session(64, QType::F16, QType::F16).unwrap();
            e.prefill(&mut s, p, false).unwrap();
            s
        })
        .collect();
    let mut feats = vec![Vec::new(); 3];
    let mut dev: Vec<_> = (0..3).map(|_| e.backend.zeros(0, 0)).collect();
    let mut entries: Vec<BatchEntry<'_, _>> = sessions
        .iter_mut()
        .zip(&next)
        .zip(taps.iter_mut().zip(feats.iter_mut()).zip(dev.iter_mut()))
        .map(|((s, n), ((t, f), d))| BatchEntry {
            session: s,
            tokens: n,
            logits_from: 0,
            capture: (!t.layers.is_empty()).then_some(Capture {
                taps: t,
                features: f,
                device: Some(d),
            }),
        })
        .collect();
    e.decode_multi(&mut entries, &mut scratch, &mut out)
        .unwrap();
    drop(entries);
    assert_eq!(
        bits(&out.logits),
        bits(&alone_logits),
        "logits (device capture)"
    );
    for (i, want) in alone.iter().enumerate() {
        if layers[i].is_empty() {
            continue;
        }
        assert!(feats[i].is_empty(), "entry {i}: no host features");
        let mut got = Vec::new();
        e.backend.to_host(&dev[i], &mut got);
        assert_eq!(bits(&got), bits(want), "device features of entry {i}");
    }
}

#[test]
fn greedy_output_with_a_feature_drafter_equals_the_output_without_one() {
    let plain = server(cfg(1), Draft::None);
    let prompts = [
        vec!["Tell me about foxes"],
        vec!["abcabcabcabc", "abcabc", "and again?"],
    ];
    let want: Vec<Vec<u64>> = prompts
        .iter()
        .map(|p| send(plain.addr(), &chat(p, 40)).0.ids)
        .collect();
    // A one-token prompt: the first draft has no target context at all.
    let one = json!({"prompt": "x", "max_tokens": 12, "temperature": 0, "ignore_eos": true});
    let want_one = post(plain.addr(), "/v1/completions", &one).json();
    assert_eq!(want_one["usage"]["prompt_tokens"], 1);
    for (name, d) in drafters() {
        let s = server(cfg(1), d);
        let got = post(s.addr(), "/v1/completions", &one).json();
        assert_eq!(
            got["choices"][0]["text"], want_one["choices"][0]["text"],
            "{name}: {got}"
        );
        for (p, w) in prompts.iter().zip(&want) {
            let (run, _) = send(s.addr(), &chat(p, 40));
            assert_eq!(&run.ids, w, "{name}, {p:?}");
            assert!(run.accepted <= run.draft_n, "{name}: {run:?}");
            run.check_varied(name);
        }
        if name != "eagle3" {
            // A request may ask for more than a block holds: clamped, still lossless.
            let mut body = chat(&prompts[0], 40);
            body["speculative.n_max"] = json!(16);
            let (run, _) = send(s.addr(), &body);
            assert_eq!(run.ids, want[0], "{name}, n_max 16");
            assert!(run.draft_n <= 5 * run.rounds, "{name}: {run:?}");
        }
        let slots = get(s.addr(), "/slots").json();
        let kind = if name == "eagle3" {
            "draft-eagle3"
        } else {
            "draft-dflash"
        };
        assert_eq!(slots[0]["speculative"]["type"], kind);
    }
}

#[test]
fn a_prompt_cache_hit_drafts_exactly_as_a_cold_request() {
    let first = ["Once upon a time there was a tiny model"];
    let longer = [
        "Once upon a time there was a tiny model",
        "It drafted.",
        "What next?",
    ];
    let other = ["Once upon a time, far away"];
    for (name, d) in drafters() {
        // Cold answers, each on a fresh 1-slot server.
        let cold = |body: &Value| {
            let s = server(cfg(1), d);
            let (run, cache_n) = send(s.addr(), body);
            assert_eq!(cache_n, 0);
            run
        };
        let a = cold(&chat(&first, 32));
        a.check_varied(name);
        let b = cold(&chat(&longer, 32));
        let c = cold(&chat(&other, 32));

        let s = server(cfg(1), d);
        assert_eq!(send(s.addr(), &chat(&first, 32)).0, a, "{name}: first");
        // The same request again: everything but the anchor comes from the prompt cache.
        let (again, cache_n, prompt_n) = send_full(s.addr(), &chat(&first, 32));
        assert_eq!(cache_n, prompt_n - 1, "{name}: a cache hit");
        assert_eq!(again, a, "{name}: the same request from the prompt cache");
        // A request sharing the first one's prompt and part of its answer.
        let (run, cache_n) = send(s.addr(), &chat(&longer, 32));
        assert!(cache_n > 0, "{name}: a partial hit");
        assert_eq!(run, b, "{name}: a longer conversation");
        // A request sharing only a few tokens.
        let (run, cache_n) = send(s.addr(), &chat(&other, 32));
        assert!(cache_n > 0, "{name}: a short shared prefix");
        assert_eq!(run, c, "{name}: a request sharing a prefix");

        // A request that does not draft writes the slot's cache without the drafter; the
        // next request reusing those positions must not find its drafter without context.
        let s = server(cfg(1), d);
        let mut off = chat(&first, 32);
        off["speculative.n_max"] = json!(0);
        let (run, _) = send(s.addr(), &off);
        assert_eq!(run.ids, a.ids);
        assert_eq!(run.draft_n, 0);
        let (run, _) = send(s.addr(), &chat(&first, 32));
        assert_eq!(run, a, "{name}: after a request that did not draft");
    }
}

#[test]
fn two_slots_drafting_side_by_side_give_the_answers_and_drafts_of_each_alone() {
    let d = Draft::Dflash {
        deferred: true,
        dflash2: false,
        options: fixed(5, P_MIN),
    };
    let bodies = [
        chat(&["The first of two requests"], 160),
        chat(&["A second, different request that runs beside it"], 200),
    ];
    let alone: Vec<Run> = bodies
        .iter()
        .map(|b| send(server(cfg(1), d).addr(), b).0)
        .collect();
    let s = server(cfg(2), d);
    let addr = s.addr();
    let got: Vec<Run> = std::thread::scope(|sc| {
        let hs: Vec<_> = bodies
            .iter()
            .map(|b| sc.spawn(move || send(addr, b).0))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (i, (g, w)) in got.iter().zip(&alone).enumerate() {
        assert_eq!(g, w, "request {i}");
        w.check_varied("alone");
    }
    let m = get(addr, "/metrics").text();
    assert!(
        metric(&m, "specula:n_busy_slots_per_decode") > 1.0,
        "the requests ran together:\n{m}"
    );
}
