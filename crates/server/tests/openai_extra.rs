//! `/v1/models` with `--alias`, the streamed chat deltas and the Responses API
//! (`/v1/responses`) against llama-server's own answers (golden/llama_server_endpoints/,
//! recorded by reference/llama_server_endpoints.py on SmolLM2-135M Q4_1 with `-c 4096 -np 2
//! --alias smollm2-alias`). Skips without the model.
//!
//! Compared: every key of llama-server's answers and the values that do not depend on the
//! moment or on llama.cpp's internals (ids, `created`, timings); `/v1/models`' `meta` adds
//! `n_ctx_slot`; `owned_by` is `specula`.

mod common;

use common::{get, keys, post};
use serde_json::Value;
use specula_server::{ServerConfig, ServerHandle};

fn golden(name: &str) -> Value {
    common::golden("llama_server_endpoints", name)
}

fn smollm() -> Option<ServerHandle> {
    let cfg = ServerConfig {
        n_parallel: 2,
        n_ctx: 4096,
        model_name: "smollm2-alias".into(),
        model_aliases: vec!["smollm2-alias".into()],
        ..ServerConfig::default()
    };
    common::real("smollm2-135m", cfg, None)
}

/// The `data:` payloads and `event:` names of a streamed answer.
fn sse(body: &[u8]) -> (Vec<Value>, Vec<String>) {
    let text = String::from_utf8_lossy(body);
    let mut data = Vec::new();
    let mut names = Vec::new();
    for line in text.lines() {
        if let Some(d) = line
            .strip_prefix("data: ")
            .or_else(|| line.strip_prefix("data:"))
        {
            if d.trim() != "[DONE]" {
                data.push(serde_json::from_str(d.trim()).unwrap());
            }
        } else if let Some(e) = line
            .strip_prefix("event: ")
            .or_else(|| line.strip_prefix("event:"))
        {
            names.push(e.trim().to_owned());
        }
    }
    (data, names)
}

/// A greedy answer that differs from llama-server's (`theirs`) is equal up to a step where
/// specula's two best tokens are within 0.05 nats and llama-server's text goes on with the
/// runner-up (the kernels' rounding differs, as in the golden test of `/completion`): checked
/// on the same request as a chat completion with `top_logprobs`.
fn near_tie(s: &ServerHandle, name: &str, body: &Value, theirs: &str) {
    const TIE: f64 = 0.05;
    let mut messages = Vec::new();
    if let Some(i) = body.get("instructions") {
        messages.push(serde_json::json!({"role": "system", "content": i}));
    }
    match &body["input"] {
        Value::String(t) => messages.push(serde_json::json!({"role": "user", "content": t})),
        Value::Array(items) => messages.extend(items.iter().cloned()),
        other => panic!("{other}"),
    }
    let chat = serde_json::json!({"messages": messages, "temperature": 0, "logprobs": true,
        "top_logprobs": 2, "max_tokens": body["max_output_tokens"]});
    let v = post(s.addr(), "/v1/chat/completions", &chat).json();
    let steps = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    let mut acc = String::new();
    for (i, step) in steps.iter().enumerate() {
        let tok = step["token"].as_str().unwrap();
        if theirs[acc.len()..].starts_with(tok) {
            acc.push_str(tok);
            continue;
        }
        let top = step["top_logprobs"].as_array().unwrap();
        let lp = |j: usize| top[j]["logprob"].as_f64().unwrap();
        let runner_up = top[1]["token"].as_str().unwrap();
        assert!(
            lp(0) - lp(1) < TIE && theirs[acc.len()..].starts_with(runner_up),
            "{name}: the answers part at step {i} ({tok:?} here, llama-server goes on with {:?}), top two {} nats apart: {step}",
            &theirs[acc.len()..],
            lp(0) - lp(1)
        );
        eprintln!(
            "{name}: equal for {i} tokens, then a near tie ({:.4} nats)",
            lp(0) - lp(1)
        );
        return;
    }
}

#[test]
fn smollm2_models_props_chat_stream_and_responses_match_llama_server() {
    let Some(s) = smollm() else { return };

    // /v1/models: llama-server's two lists, named by the alias.
    let theirs = &golden("models_alias")["response"];
    let ours = get(s.addr(), "/v1/models").json();
    assert_eq!(keys(&ours), keys(theirs), "/v1/models keys");
    assert_eq!(ours["object"], "list");
    assert_eq!(ours["models"], theirs["models"], "the models list");
    let (o, t) = (&ours["data"][0], &theirs["data"][0]);
    assert_eq!(keys(o), keys(t), "data[0] keys");
    for k in ["id", "aliases", "tags", "object"] {
        assert_eq!(o[k], t[k], "data[0].{k}");
    }
    for k in [
        "vocab_type",
        "n_vocab",
        "n_ctx",
        "n_ctx_train",
        "n_embd",
        "n_params",
        "size",
        "ftype",
    ] {
        assert_eq!(o["meta"][k], t["meta"][k], "data[0].meta.{k}");
    }
    // /props names the model by its alias too.
    let props = get(s.addr(), "/props").json();
    assert_eq!(
        props["model_alias"],
        golden("props_alias")["response"]["model_alias"]
    );

    // A streamed chat: the first delta carries the role and `content: null`; the text is
    // llama-server's; every chunk has llama-server's keys.
    let g = golden("chat_stream");
    let r = post(s.addr(), "/v1/chat/completions", &g["request"]["body"]);
    assert_eq!(r.status, 200);
    let (ours, _) = sse(&r.body);
    let theirs = g["events"].as_array().unwrap();
    let first = |evs: &[Value]| evs[0]["choices"][0]["delta"].clone();
    assert_eq!(first(&ours), first(theirs), "the first delta");
    assert!(first(&ours)["content"].is_null());
    let text = |evs: &[Value]| -> String {
        evs.iter()
            .filter_map(|e| e["choices"][0]["delta"]["content"].as_str())
            .collect()
    };
    assert_eq!(text(&ours), text(theirs), "streamed chat text");
    // llama-server's keys are all there (specula adds `tokens` to a content chunk, `usage`
    // to the last one).
    for (i, t) in theirs.iter().filter(|e| e.is_object()).enumerate() {
        let o = &ours[i];
        for k in keys(t) {
            assert!(
                o.get(&k).is_some(),
                "chunk {i}: llama-server's key {k} missing: {o}"
            );
        }
    }
    let finish = |evs: &[Value]| {
        evs.iter()
            .filter_map(|e| e["choices"][0]["finish_reason"].as_str().map(str::to_owned))
            .collect::<Vec<_>>()
    };
    assert_eq!(finish(&ours), finish(theirs), "finish_reason");

    // /v1/responses, not streamed: a string input, and instructions with message items.
    for name in ["responses_text", "responses_items"] {
        let g = golden(name);
        let r = post(s.addr(), "/v1/responses", &g["request"]["body"]);
        assert_eq!(r.status, 200, "{name}: {}", r.text());
        let (o, t) = (r.json(), g["response"].clone());
        assert_eq!(keys(&o), keys(&t), "{name}: keys");
        for k in ["object", "status", "model"] {
            assert_eq!(o[k], t[k], "{name}.{k}");
        }
        assert!(o["id"].as_str().unwrap().starts_with("resp_"));
        assert_eq!(
            keys(&o["output"][0]),
            keys(&t["output"][0]),
            "{name}: item keys"
        );
        assert_eq!(
            keys(&o["output"][0]["content"][0]),
            keys(&t["output"][0]["content"][0])
        );
        assert_eq!(o["output"][0]["type"], "message");
        assert_eq!(o["output"][0]["role"], "assistant");
        let ours_text = o["output"][0]["content"][0]["text"].as_str().unwrap();
        let theirs_text = t["output"][0]["content"][0]["text"].as_str().unwrap();
        if ours_text != theirs_text {
            near_tie(&s, name, &g["request"]["body"], theirs_text);
        }
        assert_eq!(keys(&o["usage"]), keys(&t["usage"]));
        for k in ["input_tokens", "output_tokens", "total_tokens"] {
            assert_eq!(o["usage"][k], t["usage"][k], "{name}: usage.{k}");
        }
    }

    // Streamed: llama-server's typed events, in its order, with its keys.
    let g = golden("responses_stream");
    let r = post(s.addr(), "/v1/responses", &g["request"]["body"]);
    assert_eq!(r.status, 200);
    let (ours, names) = sse(&r.body);
    let theirs = g["events"].as_array().unwrap();
    let their_names: Vec<String> = g["event_names"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n.as_str().unwrap().to_owned())
        .collect();
    assert_eq!(names, their_names, "event names");
    // llama-server's keys, plus OpenAI's `sequence_number`, `output_index` and
    // `content_index` (which the official clients' stream helpers read), and OpenAI's
    // `created_at`, `model`, `output` in the in-progress response.
    let extra = ["sequence_number", "output_index", "content_index"];
    for (i, (o, t)) in ours.iter().zip(theirs).enumerate() {
        assert_eq!(o["type"], t["type"], "event {i}");
        assert_eq!(o["sequence_number"], i, "event {i}");
        let ko: Vec<String> = keys(o)
            .into_iter()
            .filter(|k| !extra.contains(&k.as_str()))
            .collect();
        assert_eq!(ko, keys(t), "event {i} ({}) keys", t["type"]);
        if let Some(r) = t.get("response") {
            for k in keys(r) {
                assert!(o["response"].get(&k).is_some(), "event {i}: response.{k}");
            }
        }
    }
    assert_eq!(ours.len(), theirs.len(), "events");
    let deltas = |evs: &[Value]| -> String {
        evs.iter()
            .filter(|e| e["type"] == "response.output_text.delta")
            .filter_map(|e| e["delta"].as_str())
            .collect()
    };
    assert_eq!(deltas(&ours), deltas(theirs));
    let done = ours.last().unwrap();
    assert_eq!(done["type"], "response.completed");
    assert_eq!(
        done["response"]["output"][0]["content"][0]["text"],
        deltas(&ours)
    );
}
