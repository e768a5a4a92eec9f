//! `specula-server` end to end on loopback, around a tiny random llama built in memory: the
//! OpenAI endpoints streamed and not, stop strings, seeds, limits and their 4xx messages, the
//! API key, metrics that add up to the responses' timings, greedy output that speculation and
//! concurrency do not change, and slots freed when a client goes away.

mod common;

use std::time::{Duration, Instant};

use common::{Draft, get, metric, post, request, server, server_with, streamed};
use serde_json::{Value, json};
use specula_engine::BatchEntry;
use specula_quant::QType;
use specula_server::ServerConfig;

fn cfg(n_parallel: usize) -> ServerConfig {
    ServerConfig {
        n_parallel,
        n_ctx: 512 * n_parallel,
        ..ServerConfig::default()
    }
}

fn greedy_chat(content: &str, max_tokens: u64) -> Value {
    json!({
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": true,
    })
}

fn greedy_completion(prompt: &str, max_tokens: u64) -> Value {
    json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true})
}

fn content(v: &Value) -> String {
    let c = &v["choices"][0];
    c["message"]["content"]
        .as_str()
        .or_else(|| c["text"].as_str())
        .unwrap_or_else(|| panic!("no text in {v}"))
        .to_owned()
}

#[test]
fn chat_streamed_and_not_give_the_same_text_usage_and_timings() {
    let s = server(cfg(1), Draft::None);
    let body = greedy_chat("Hello there, tiny model", 24);
    let r = post(s.addr(), "/v1/chat/completions", &body);
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["completion_tokens"], 24);
    let prompt_tokens = v["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(
        v["usage"]["total_tokens"].as_u64().unwrap(),
        prompt_tokens + 24
    );
    assert_eq!(v["timings"]["predicted_n"], 24);
    assert!(
        v["timings"].get("draft_n").is_none(),
        "no drafter, no draft_n"
    );

    let mut sb = body.clone();
    sb["stream"] = json!(true);
    let r = post(s.addr(), "/v1/chat/completions", &sb);
    assert!(
        r.head.to_ascii_lowercase().contains("text/event-stream"),
        "{}",
        r.head
    );
    let st = streamed(&r);
    assert!(st.done, "the stream ends with [DONE]");
    assert_eq!(st.text, content(&v));
    assert_eq!(st.tokens.len(), 24, "one chunk per token, none lost");
    assert_eq!(st.last["object"], "chat.completion.chunk");
    assert_eq!(st.last["choices"][0]["finish_reason"], "length");
    assert_eq!(st.last["usage"]["completion_tokens"], 24);
    // The second request reuses the first one's prompt from the slot's cache.
    assert_eq!(
        st.last["timings"]["cache_n"].as_u64().unwrap(),
        prompt_tokens - 1
    );
    assert_eq!(st.last["timings"]["prompt_n"], 1);

    // Token ids of the stream decode to its text (/detokenize), and /tokenize reads back.
    let ids: Vec<u64> = st.tokens.clone();
    let d = post(s.addr(), "/detokenize", &json!({"tokens": ids}));
    assert_eq!(d.status, 200);
    let t = post(s.addr(), "/tokenize", &json!({"content": "abc"})).json();
    assert_eq!(t["tokens"].as_array().unwrap().len(), 3);
}

#[test]
fn completions_stop_where_a_stop_string_begins() {
    let s = server(cfg(1), Draft::None);
    let full = content(
        &post(
            s.addr(),
            "/v1/completions",
            &greedy_completion("Once upon", 40),
        )
        .json(),
    );
    let chars: Vec<char> = full.chars().collect();
    // A two-character stop from the middle of the unstopped text (no replacement chars).
    let at = (6..chars.len() - 2)
        .find(|&i| chars[i..i + 2].iter().all(|&c| c != '\u{FFFD}'))
        .expect("a plain pair of characters");
    let stop: String = chars[at..at + 2].iter().collect();
    let want = &full[..full.find(&stop).unwrap()];
    let mut body = greedy_completion("Once upon", 40);
    body["stop"] = json!(["never-appears-here", stop]);
    let v = post(s.addr(), "/v1/completions", &body).json();
    assert_eq!(v["object"], "text_completion");
    assert_eq!(content(&v), want, "stop {stop:?} in {full:?}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    // Streamed, the held-back text comes out the same.
    body["stream"] = json!(true);
    let st = streamed(&post(s.addr(), "/v1/completions", &body));
    assert_eq!(st.text, want);
    assert_eq!(st.last["choices"][0]["finish_reason"], "stop");
}

#[test]
fn a_seed_repeats_a_sampled_answer_and_logprobs_are_reported() {
    let s = server(cfg(1), Draft::None);
    let body = |seed: u64| {
        json!({"prompt": "Sampling test", "max_tokens": 32, "temperature": 1.0, "top_k": 0,
               "top_p": 1.0, "min_p": 0.0, "seed": seed, "ignore_eos": true,
               "logprobs": 3})
    };
    let a = post(s.addr(), "/v1/completions", &body(42)).json();
    let b = post(s.addr(), "/v1/completions", &body(42)).json();
    assert_eq!(content(&a), content(&b));
    let others: Vec<String> = [43, 44, 45]
        .iter()
        .map(|&seed| content(&post(s.addr(), "/v1/completions", &body(seed)).json()))
        .collect();
    assert!(
        others.iter().any(|o| *o != content(&a)),
        "different seeds give different samples"
    );
    let lp = &a["choices"][0]["logprobs"];
    assert_eq!(lp["tokens"].as_array().unwrap().len(), 32);
    assert_eq!(lp["token_logprobs"].as_array().unwrap().len(), 32);
    // Chat's format: per token, the chosen token's log-probability and the 3 most likely.
    let chat = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
                      "temperature": 0, "ignore_eos": true, "logprobs": true, "top_logprobs": 3});
    let v = post(s.addr(), "/v1/chat/completions", &chat).json();
    let entries = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(entries.len(), 8);
    for e in entries {
        let top = e["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3);
        let lps: Vec<f64> = top.iter().map(|t| t["logprob"].as_f64().unwrap()).collect();
        assert!(
            lps.windows(2).all(|w| w[0] >= w[1]) && lps[0] <= 0.0,
            "{lps:?}"
        );
        // Greedy: the chosen token is the most likely one.
        assert_eq!(e["logprob"].as_f64().unwrap(), lps[0]);
    }
}

#[test]
fn metrics_add_up_to_the_timings_of_the_responses() {
    let s = server(cfg(2), Draft::Ngram);
    let mut sums = [0u64; 5];
    for (i, p) in ["abcabcabcabcabc", "xyzxyzxyzxyz", "abcabcabcabcabc"]
        .iter()
        .enumerate()
    {
        let mut body = greedy_completion(p, 20 + i as u64);
        if i == 1 {
            body["stream"] = json!(true);
        }
        let r = post(s.addr(), "/v1/completions", &body);
        let t = if i == 1 {
            streamed(&r).last["timings"].clone()
        } else {
            r.json()["timings"].clone()
        };
        for (k, key) in [
            "prompt_n",
            "predicted_n",
            "draft_n",
            "draft_n_accepted",
            "cache_n",
        ]
        .iter()
        .enumerate()
        {
            sums[k] += t[key].as_u64().unwrap_or_else(|| panic!("{key} in {t}"));
        }
    }
    let m = get(s.addr(), "/metrics");
    assert_eq!(m.status, 200);
    let m = m.text();
    assert_eq!(metric(&m, "specula:prompt_tokens_total"), sums[0] as f64);
    assert_eq!(metric(&m, "specula:tokens_predicted_total"), sums[1] as f64);
    assert_eq!(
        metric(&m, "specula:spec_decode_num_draft_tokens_total"),
        sums[2] as f64
    );
    assert_eq!(
        metric(&m, "specula:spec_decode_num_accepted_tokens_total"),
        sums[3] as f64
    );
    assert_eq!(
        metric(&m, "specula:prompt_tokens_cached_total"),
        sums[4] as f64
    );
    assert!(sums[2] > 0, "the repetitive prompts were drafted for");
    assert_eq!(metric(&m, "specula:requests_success_total"), 3.0);
    assert_eq!(metric(&m, "specula:slots_total"), 2.0);
    assert!(m.contains("specula:request_duration_seconds_count 3"));
}

#[test]
fn health_is_public_and_a_wrong_key_is_refused() {
    let s = server(
        ServerConfig {
            api_key: Some("sesame".into()),
            ..cfg(1)
        },
        Draft::None,
    );
    assert_eq!(get(s.addr(), "/health").json()["status"], "ok");
    assert_eq!(
        get(s.addr(), "/v1/models").json()["data"][0]["object"],
        "model"
    );
    let body = greedy_completion("hi", 4).to_string();
    let none = request(s.addr(), "POST", "/v1/completions", &[], body.as_bytes());
    assert_eq!(none.status, 401);
    assert!(
        none.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("--api-key")
    );
    let wrong = request(
        s.addr(),
        "POST",
        "/v1/completions",
        &[("Authorization", "Bearer sesamE")],
        body.as_bytes(),
    );
    assert_eq!(wrong.status, 401);
    assert_eq!(
        request(
            s.addr(),
            "GET",
            "/metrics",
            &[("Authorization", "Bearer nope")],
            b""
        )
        .status,
        401
    );
    let right = request(
        s.addr(),
        "POST",
        "/v1/completions",
        &[("Authorization", "Bearer sesame")],
        body.as_bytes(),
    );
    assert_eq!(right.status, 200, "{}", right.text());
}

#[test]
fn bad_requests_get_a_4xx_that_says_what_to_change_and_the_server_keeps_serving() {
    let s = server(
        ServerConfig {
            body_limit: 2048,
            ..cfg(1)
        },
        Draft::None,
    );
    let a = s.addr();
    let msg = |r: &common::Resp| r.json()["error"]["message"].as_str().unwrap().to_owned();
    let r = request(a, "POST", "/v1/chat/completions", &[], b"{\"messages\": [");
    assert_eq!(r.status, 400);
    assert!(msg(&r).contains("invalid JSON"), "{}", msg(&r));
    let r = post(a, "/v1/chat/completions", &json!({"messages": "hi"}));
    assert_eq!(r.status, 400);
    let big = json!({"prompt": "x".repeat(10_000)});
    let r = post(a, "/v1/completions", &big);
    assert_eq!(r.status, 413);
    assert!(msg(&r).contains("2048 bytes"), "{}", msg(&r));
    let r = post(a, "/v1/completions", &greedy_completion("hello", 100_000));
    assert_eq!(r.status, 400);
    assert!(msg(&r).contains("lower max_tokens"), "{}", msg(&r));
    let r = post(a, "/v1/completions", &json!({"prompt": "x".repeat(600)}));
    assert_eq!(r.status, 400);
    assert!(msg(&r).contains("larger -c"), "{}", msg(&r));
    let r = post(
        a,
        "/v1/completions",
        &json!({"prompt": "hi", "temperature": -1}),
    );
    assert_eq!(r.status, 400);
    assert!(msg(&r).contains("temperature"), "{}", msg(&r));
    let r = post(a, "/v1/completions", &json!({"prompt": "hi", "n": 0}));
    assert_eq!(r.status, 400);
    let r = post(a, "/v1/completions", &json!({"prompt": [1, 99999]}));
    assert_eq!(r.status, 400);
    assert_eq!(get(a, "/nope").status, 404);
    let r = post(a, "/v1/completions", &greedy_completion("still here", 5));
    assert_eq!(r.status, 200, "{}", r.text());
    let m = get(a, "/metrics").text();
    assert_eq!(metric(&m, "specula:requests_success_total"), 1.0);
}

#[test]
fn greedy_output_with_a_drafter_equals_the_output_without_one() {
    let plain = server(cfg(2), Draft::None);
    let ngram = server(cfg(2), Draft::Ngram);
    let selfd = server(cfg(2), Draft::SelfModel);
    let prompts = [
        "abcabcabcabcabcabc",
        "The quick brown fox",
        "1 2 3 1 2 3 1 2 3",
    ];
    let mut drafted = [0u64; 2];
    for p in prompts {
        let want =
            content(&post(plain.addr(), "/v1/completions", &greedy_completion(p, 40)).json());
        for (k, s) in [&ngram, &selfd].iter().enumerate() {
            let v = post(s.addr(), "/v1/completions", &greedy_completion(p, 40)).json();
            assert_eq!(content(&v), want, "prompt {p:?}, drafter {k}");
            drafted[k] += v["timings"]["draft_n"].as_u64().unwrap();
            if k == 1 {
                // The target drafting for itself: everything drafted is accepted.
                assert_eq!(v["timings"]["draft_n"], v["timings"]["draft_n_accepted"]);
            }
        }
        // A request may turn speculation off.
        let mut off = greedy_completion(p, 40);
        off["speculative.n_max"] = json!(0);
        let v = post(selfd.addr(), "/v1/completions", &off).json();
        assert_eq!(content(&v), want);
        assert_eq!(v["timings"]["draft_n"], 0);
    }
    assert!(drafted[0] > 0 && drafted[1] > 0, "{drafted:?}");
    let slots = get(selfd.addr(), "/slots").json();
    assert_eq!(slots[0]["speculative"]["type"], "draft-simple");
    assert_eq!(slots[0]["rollback"], "trim");
    // Without a drafter the slots report no speculation, but still the rollback capability.
    let slots = get(plain.addr(), "/slots").json();
    assert!(slots[0]["speculative"].is_null());
    assert_eq!(slots[0]["rollback"], "trim");
}

/// Slots whose caches roll back by checkpoint and replay (forced; the path of memories that
/// cannot trim) answer what a server without speculation answers, report `replay` in
/// `/slots`, count their replays, and reprocess a prompt instead of trimming to its cached
/// prefix (the second round of requests shares prefixes with the first).
#[test]
fn forced_replay_slots_give_the_plain_output() {
    let plain = server(cfg(2), Draft::None);
    let replay = server(
        ServerConfig {
            force_replay: true,
            ..cfg(2)
        },
        Draft::Ngram,
    );
    let prompts = [
        "abcabcabcabcabcabc",
        "1 2 3 1 2 3 1 2 3",
        "abcabcabcabcabcabc and more",
    ];
    let (mut drafted, mut accepted, mut replays) = (0, 0, 0);
    for p in prompts {
        let want =
            content(&post(plain.addr(), "/v1/completions", &greedy_completion(p, 48)).json());
        let v = post(replay.addr(), "/v1/completions", &greedy_completion(p, 48)).json();
        assert_eq!(content(&v), want, "prompt {p:?}");
        drafted += v["timings"]["draft_n"].as_u64().unwrap();
        accepted += v["timings"]["draft_n_accepted"].as_u64().unwrap();
        replays += v["timings"]["draft_replays"].as_u64().unwrap();
    }
    assert!(
        accepted < drafted,
        "some drafts must be rejected: {drafted} {accepted}"
    );
    assert!(replays > 0, "{replays}");
    let slots = get(replay.addr(), "/slots").json();
    assert_eq!(slots[0]["rollback"], "replay");
    let m = get(replay.addr(), "/metrics").text();
    assert_eq!(
        metric(&m, "specula:spec_decode_num_replays_total"),
        replays as f64
    );
}

#[test]
fn concurrent_requests_get_the_answers_they_get_alone() {
    let prompts: Vec<(String, u64)> = (0..6)
        .map(|i| {
            (
                format!("prompt number {i}: {}", "ab".repeat(i * 7)),
                200 + 100 * i as u64,
            )
        })
        .collect();
    // Long enough answers that the six requests surely overlap on the server.
    let cfg = |n_parallel: usize| ServerConfig {
        n_parallel,
        n_ctx: 1024 * n_parallel,
        ..ServerConfig::default()
    };
    let alone = server_with(cfg(1), Draft::Ngram, 8);
    let want: Vec<String> = prompts
        .iter()
        .map(|(p, n)| {
            content(&post(alone.addr(), "/v1/completions", &greedy_completion(p, *n)).json())
        })
        .collect();
    let s = server_with(cfg(4), Draft::Ngram, 8);
    let addr = s.addr();
    let got: Vec<(String, u64)> = std::thread::scope(|sc| {
        let hs: Vec<_> = prompts
            .iter()
            .enumerate()
            .map(|(i, (p, n))| {
                sc.spawn(move || {
                    let mut body = greedy_completion(p, *n);
                    if i % 2 == 0 {
                        body["stream"] = json!(true);
                        let st = streamed(&post(addr, "/v1/completions", &body));
                        (st.text, st.tokens.len() as u64)
                    } else {
                        let v = post(addr, "/v1/completions", &body).json();
                        (
                            content(&v),
                            v["usage"]["completion_tokens"].as_u64().unwrap(),
                        )
                    }
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (i, ((text, n), w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(text, w, "request {i}");
        assert_eq!(*n, prompts[i].1, "request {i}: tokens");
    }
    let m = get(addr, "/metrics").text();
    assert!(
        metric(&m, "specula:n_busy_slots_per_decode") > 1.0,
        "requests ran together:\n{m}"
    );
}

#[test]
fn a_client_that_goes_away_frees_its_slot() {
    // A budget far longer than the time it takes to notice the client is gone.
    let s = server(
        ServerConfig {
            n_ctx: 32_768,
            ..cfg(1)
        },
        Draft::None,
    );
    let mut body = greedy_completion("a long answer", 32_000);
    body["stream"] = json!(true);
    {
        use std::io::Read as _;
        let mut c = common::send(
            s.addr(),
            "POST",
            "/v1/completions",
            &[],
            body.to_string().as_bytes(),
        );
        let mut buf = [0u8; 512];
        let n = c.read(&mut buf).unwrap();
        assert!(n > 0);
        // Dropped here: the connection closes mid-stream.
    }
    // The stream's first bytes (the headers) can come before the request reaches its slot,
    // so an idle slot alone does not yet say the request was seen and cancelled.
    let cancelled = |n: f64| {
        let t0 = Instant::now();
        loop {
            let slots = get(s.addr(), "/slots").json();
            let m = get(s.addr(), "/metrics").text();
            if slots[0]["is_processing"] == false
                && metric(&m, "specula:requests_cancelled_total") >= n
            {
                return m;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(120),
                "slot still busy or the request not cancelled: {slots}\n{m}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    let m = cancelled(1.0);
    assert_eq!(metric(&m, "specula:requests_cancelled_total"), 1.0);
    assert!(metric(&m, "specula:tokens_predicted_total") == 0.0);
    // Not streamed: the client gives up waiting for the whole answer.
    body["stream"] = json!(false);
    {
        let c = common::send(
            s.addr(),
            "POST",
            "/v1/completions",
            &[],
            body.to_string().as_bytes(),
        );
        let t0 = Instant::now();
        while get(s.addr(), "/slots").json()[0]["is_processing"] != true {
            assert!(t0.elapsed() < Duration::from_secs(60));
            std::thread::sleep(Duration::from_millis(2));
        }
        drop(c);
    }
    let m = cancelled(2.0);
    assert_eq!(metric(&m, "specula:requests_cancelled_total"), 2.0);
    let r = post(s.addr(), "/v1/completions", &greedy_completion("next", 4));
    assert_eq!(r.status, 200);
}

#[test]
fn shutdown_finishes_the_request_in_flight() {
    let s = server(
        ServerConfig {
            n_ctx: 4096,
            ..cfg(1)
        },
        Draft::None,
    );
    let addr = s.addr();
    let h =
        std::thread::spawn(move || post(addr, "/v1/completions", &greedy_completion("bye", 3000)));
    // Wait until the request holds the slot, then stop the server.
    let t0 = Instant::now();
    while get(addr, "/slots").json()[0]["is_processing"] != true {
        assert!(t0.elapsed() < Duration::from_secs(60));
        std::thread::sleep(Duration::from_millis(5));
    }
    s.shutdown().unwrap();
    let r = h.join().unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["usage"]["completion_tokens"], 3000);
    assert!(
        std::net::TcpStream::connect(addr).is_err(),
        "no longer listening"
    );
}

/// Batch invariance of the batched forward: each session's logits from `decode_multi` with
/// other sessions beside it are bit for bit those of the session run alone.
#[test]
fn a_batched_decode_gives_each_session_its_own_logits_bit_for_bit() {
    let e = common::engine(common::tiny(common::SEED, 0, false));
    let prompts: [&[u32]; 3] = [&[72, 101, 108], &[1, 2, 3, 4, 5, 6, 7, 8, 9], &[200]];
    let next: [&[u32]; 3] = [&[33], &[10, 11, 12, 13], &[5, 6]];
    let mut alone = Vec::new();
    for (p, n) in prompts.iter().zip(&next) {
        let mut s = e.session(64, QType::F16, QType::F16).unwrap();
        e.prefill(&mut s, p, false).unwrap();
        alone.push(e.prefill(&mut s, n, true).unwrap());
    }
    let mut sessions: Vec<_> = prompts
        .iter()
        .map(|p| {
            let mut s = e.session(64, QType::F16, QType::F16).unwrap();
            e.prefill(&mut s, p, false).unwrap();
            s
        })
        .collect();
    let mut entries: Vec<BatchEntry<'_, _>> = sessions
        .iter_mut()
        .zip(&next)
        .map(|(s, n)| BatchEntry {
            session: s,
            tokens: n,
            logits_from: 0,
            capture: None,
        })
        .collect();
    let mut scratch = e.scratch();
    let mut out = specula_engine::Readout::default();
    e.decode_multi(&mut entries, &mut scratch, &mut out)
        .unwrap();
    let want: Vec<f32> = alone.concat();
    assert_eq!(out.logits.len(), want.len());
    assert!(
        out.logits
            .iter()
            .zip(&want)
            .all(|(a, b)| a.to_bits() == b.to_bits()),
        "batched logits differ from the sessions' own"
    );
    for (s, (p, n)) in sessions.iter().zip(prompts.iter().zip(&next)) {
        assert_eq!(s.n_past(), p.len() + n.len());
    }
}
