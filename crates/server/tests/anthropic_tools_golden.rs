//! The Anthropic Messages API and tool calling against llama-server's own answers
//! (golden/llama_server_tools/, recorded by reference/llama_server_tools_fixtures.py from the
//! reference build with `--jinja -t 2 -c 4096 -np 1` on Qwen2.5-Coder-0.5B-Instruct Q4_K_M):
//! the same requests on the same model must give the same greedy text, the same Anthropic
//! content blocks, stop reasons, usage and streamed event sequence, the same token counts, the
//! same tool calls (name and arguments, `finish_reason`, the streamed tool-call deltas) and the
//! same prompt through the chat template with tools, tool calls and tool results, and under
//! `tool_choice` `required` / Anthropic `any` the same constrained answer (the grammar of a
//! required call, `specula_grammar::ToolCalls`). Skips when the model is not fetched.
//!
//! Not compared: ids (`id`, tool-call ids: random in both), `created`, `system_fingerprint`,
//! `timings`.
//!
//! On these prompts Qwen2.5-Coder writes its call as bare JSON, without the template's
//! `<tool_call>` block, and llama-server (like specula) answers it as content with
//! `finish_reason` `stop`: the tool-call parser itself is tested by the unit tests of
//! `tools.rs` (calls, text around them, malformed JSON, streamed deltas).
//!
//! Deliberate differences (checked as such below):
//! - Error bodies of `/v1/messages` carry Anthropic's `"type": "error"` beside llama-server's
//!   `error` object (whose `code`, `type` and `message` are compared).
//! - `message_start.usage` of a stream counts the whole prompt as `input_tokens` (llama-server
//!   splits off the cache reuse it knows at the first token; the sum is compared), and the
//!   cache split of `usage` depends on what a slot still holds (llama-server also restores
//!   saved prompts): input plus cache-read tokens are compared.
//! - `model`: llama-server names the model by its path.

use std::path::Path;

mod common;

use common::{keys, request};
use serde_json::Value;
use specula_server::{ServerConfig, ServerHandle};

fn golden(name: &str) -> Value {
    common::golden("llama_server_tools", name)
}

fn start(path: &Path) -> ServerHandle {
    let cfg = ServerConfig {
        n_parallel: 1,
        n_ctx: 4096,
        model_name: path.file_name().unwrap().to_string_lossy().into_owned(),
        model_path: path.display().to_string(),
        ..ServerConfig::default()
    };
    common::real_server(path, cfg, None)
}

/// Replays a fixture's request (its exact text: tool schemas keep their key order in the
/// prompt): (status, body text).
fn replay(s: &ServerHandle, g: &Value) -> (u16, String) {
    let req = &g["request"];
    let body = req["raw"].as_str().unwrap().as_bytes().to_vec();
    let r = request(
        s.addr(),
        "POST",
        req["path"].as_str().unwrap(),
        &[("Content-Type", "application/json")],
        &body,
    );
    (r.status, String::from_utf8_lossy(&r.body).into_owned())
}

fn json(text: &str) -> Value {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"))
}

/// The events of an SSE body: (`event:` name, `data:` payload).
fn events(text: &str) -> Vec<(Option<String>, Value)> {
    text.split("\n\n")
        .filter_map(|ev| {
            let mut name = None;
            let mut data = None;
            for l in ev.lines() {
                if let Some(n) = l.strip_prefix("event:") {
                    name = Some(n.trim().to_owned());
                } else if let Some(d) = l.strip_prefix("data:") {
                    let d = d.trim();
                    data =
                        Some(serde_json::from_str(d).unwrap_or_else(|_| Value::String(d.into())));
                }
            }
            data.map(|d| (name, d))
        })
        .collect()
}

fn golden_events(g: &Value) -> Vec<(Option<String>, Value)> {
    g["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| (e["event"].as_str().map(str::to_owned), e["data"].clone()))
        .collect()
}

/// A Messages answer equal to llama-server's: blocks (tool-use ids aside), stop reason and
/// sequence, token counts, keys.
fn check_message(name: &str, ours: &Value, theirs: &Value) {
    assert_eq!(keys(ours), keys(theirs), "{name}: keys");
    for k in ["type", "role", "stop_reason", "stop_sequence"] {
        assert_eq!(ours[k], theirs[k], "{name}: {k}");
    }
    // The prompt's tokens (input plus those read from the cache: which prefix a slot still
    // holds depends on the requests before, and llama-server also restores saved prompts)
    // and the answer's.
    let prompt = |v: &Value| {
        v["usage"]["input_tokens"].as_u64().unwrap()
            + v["usage"]["cache_read_input_tokens"].as_u64().unwrap()
    };
    assert_eq!(prompt(ours), prompt(theirs), "{name}: prompt tokens");
    assert_eq!(
        ours["usage"]["output_tokens"], theirs["usage"]["output_tokens"],
        "{name}: output tokens"
    );
    assert_eq!(
        keys(&ours["usage"]),
        keys(&theirs["usage"]),
        "{name}: usage keys"
    );
    let blocks = |v: &Value| -> Vec<Value> {
        v["content"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| {
                let mut b = b.clone();
                if b["type"] == "tool_use" {
                    assert!(
                        b["id"].as_str().is_some_and(|s| !s.is_empty()),
                        "{name}: a tool_use id"
                    );
                    b["id"] = Value::Null;
                }
                b
            })
            .collect()
    };
    assert_eq!(blocks(ours), blocks(theirs), "{name}: content blocks");
}

type Events = Vec<(Option<String>, Value)>;

/// Consecutive deltas of one block as one (their text or JSON pieces joined): how a call's
/// arguments are cut into pieces is not compared (the parsers hold back differently).
fn collapse(ev: &[(Option<String>, Value)]) -> Events {
    let mut out: Events = Vec::new();
    for (n, v) in ev {
        if n.as_deref() == Some("content_block_delta")
            && let Some((pn, pv)) = out.last_mut()
            && pn.as_deref() == Some("content_block_delta")
            && pv["index"] == v["index"]
            && pv["delta"]["type"] == v["delta"]["type"]
        {
            for k in ["text", "partial_json", "thinking"] {
                if let (Some(a), Some(b)) = (pv["delta"][k].as_str(), v["delta"][k].as_str()) {
                    pv["delta"][k] = Value::String(format!("{a}{b}"));
                }
            }
            continue;
        }
        out.push((n.clone(), v.clone()));
    }
    out
}

/// A streamed Messages answer: the same event names in the same order, the same payloads
/// (ids, `model` and the split of `message_start`'s prompt tokens aside).
fn check_message_stream(
    name: &str,
    ours: &[(Option<String>, Value)],
    theirs: &[(Option<String>, Value)],
) {
    let names = |e: &[(Option<String>, Value)]| -> Vec<Option<String>> {
        e.iter().map(|(n, _)| n.clone()).collect()
    };
    assert_eq!(names(ours), names(theirs), "{name}: event sequence");
    for (i, ((n, o), (_, t))) in ours.iter().zip(theirs).enumerate() {
        let mut o = o.clone();
        let mut t = t.clone();
        match n.as_deref() {
            Some("message_start") => {
                let sum = |v: &Value| {
                    let u = &v["message"]["usage"];
                    u["input_tokens"].as_u64().unwrap()
                        + u["cache_read_input_tokens"].as_u64().unwrap()
                };
                assert_eq!(sum(&o), sum(&t), "{name}: message_start prompt tokens");
                for v in [&mut o, &mut t] {
                    v["message"]["id"] = Value::Null;
                    v["message"]["usage"] = Value::Null;
                    // Listed: llama-server names the model by its path.
                    v["message"]["model"] = Value::Null;
                }
            }
            Some("content_block_start") if t["content_block"]["type"] == "tool_use" => {
                for v in [&mut o, &mut t] {
                    v["content_block"]["id"] = Value::Null;
                }
            }
            _ => {}
        }
        assert_eq!(o, t, "{name}: event {i} ({n:?})");
    }
}

/// A chat answer (tool calls included) equal to llama-server's, and its token counts.
fn check_chat(name: &str, ours: &Value, theirs: &Value) {
    let (o, t) = (&ours["choices"][0], &theirs["choices"][0]);
    assert_eq!(
        o["finish_reason"], t["finish_reason"],
        "{name}: finish_reason"
    );
    let strip = |m: &Value| -> Value {
        let mut m = m.clone();
        if let Some(calls) = m["tool_calls"].as_array_mut() {
            for c in calls {
                assert!(
                    c["id"].as_str().is_some_and(|s| !s.is_empty()),
                    "{name}: a tool-call id"
                );
                c["id"] = Value::Null;
            }
        }
        m
    };
    assert_eq!(
        strip(&o["message"]),
        strip(&t["message"]),
        "{name}: message"
    );
    for k in ["prompt_tokens", "completion_tokens"] {
        assert_eq!(ours["usage"][k], theirs["usage"][k], "{name}: usage.{k}");
    }
}

/// The non-empty deltas of a streamed chat answer (tool-call ids blanked) and its last
/// `finish_reason`.
fn chat_deltas(ev: &[(Option<String>, Value)]) -> (Vec<Value>, Value) {
    let mut deltas = Vec::new();
    let mut finish = Value::Null;
    for (_, v) in ev {
        let Some(c) = v["choices"].as_array().and_then(|c| c.first()) else {
            continue;
        };
        if !c["finish_reason"].is_null() {
            finish = c["finish_reason"].clone();
        }
        let mut d = c["delta"].clone();
        if let Some(calls) = d["tool_calls"].as_array_mut() {
            for call in calls {
                if let Some(id) = call.get_mut("id") {
                    assert!(id.as_str().is_some_and(|s| !s.is_empty()), "a tool-call id");
                    *id = Value::Null;
                }
            }
        }
        if d.as_object().is_some_and(|o| !o.is_empty()) {
            deltas.push(d);
        }
    }
    (deltas, finish)
}

/// A streamed chat answer with tool calls: the same `finish_reason` and content, a call's
/// first delta (index, id, type, name) equal, its arguments adding up to llama-server's.
fn check_chat_stream(
    name: &str,
    ours: &[(Option<String>, Value)],
    theirs: &[(Option<String>, Value)],
) {
    let (ours, our_finish) = chat_deltas(ours);
    let (theirs, their_finish) = chat_deltas(theirs);
    assert_eq!(our_finish, their_finish, "{name}: finish_reason");
    let content =
        |d: &[Value]| -> String { d.iter().filter_map(|d| d["content"].as_str()).collect() };
    assert_eq!(content(&ours), content(&theirs), "{name}: content");
    let calls = |d: &[Value]| -> Vec<Value> {
        d.iter()
            .filter_map(|d| d["tool_calls"].as_array().map(|c| c[0].clone()))
            .collect()
    };
    let (oc, tc) = (calls(&ours), calls(&theirs));
    assert_eq!(oc.is_empty(), tc.is_empty(), "{name}: tool-call deltas");
    if tc.is_empty() {
        return;
    }
    let first = |c: &Value| {
        let mut c = c.clone();
        c["function"]["arguments"] = Value::Null;
        c
    };
    assert_eq!(
        first(&oc[0]),
        first(&tc[0]),
        "{name}: the first tool-call delta"
    );
    let args = |c: &[Value]| -> String {
        c.iter()
            .filter_map(|c| c["function"]["arguments"].as_str())
            .collect()
    };
    assert_eq!(args(&oc), args(&tc), "{name}: arguments");
}

/// The widest gap between the two best log-probabilities still taken as a tie (the kernels'
/// rounding differs: llama.cpp's quantized dot products quantize activations to Q8_1, and its
/// results depend on the batch a row ran in).
const TIE: f64 = 0.05;
/// The same at a flat step, where the best token has under [`FLAT`] probability: the
/// required-call answers run on past where the model would end, and there the logits of
/// the two engines drift apart by more than at a confident step.
const FLAT_TIE: f64 = 0.15;
const FLAT: f64 = 0.25;

/// Greedy texts `ours` and `theirs` are equal (false), or part where the model's two best
/// tokens are a near tie (true): `probe`, the same conversation as a chat request, is asked
/// again with log-probabilities; at the token where the texts part, llama-server's text
/// goes on with specula's runner-up, within [`TIE`] nats of the best ([`FLAT_TIE`] at a flat
/// step).
fn near_tie(s: &ServerHandle, probe: &Value, name: &str, ours: &str, theirs: &str) -> bool {
    let Some(d) = ours.bytes().zip(theirs.bytes()).position(|(a, b)| a != b) else {
        assert_eq!(ours, theirs, "{name}: one text ends first");
        return false;
    };
    let mut body = probe.clone();
    body["logprobs"] = true.into();
    body["top_logprobs"] = 2.into();
    body["stream"] = false.into();
    let v = common::post(s.addr(), "/v1/chat/completions", &body).json();
    let steps = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    let mut at = 0;
    for step in steps {
        let token = step["token"].as_str().unwrap();
        if at + token.len() > d {
            let top = step["top_logprobs"].as_array().unwrap();
            let lp = |i: usize| top[i]["logprob"].as_f64().unwrap();
            let gap = lp(0) - lp(1);
            let tie = if lp(0).exp() < FLAT { FLAT_TIE } else { TIE };
            let runner_up = top[1]["token"].as_str().unwrap();
            assert!(
                gap < tie && theirs[at..].starts_with(runner_up),
                "{name}: the texts part at byte {d} ({:?} here, {:?} in llama-server) and the top two logprobs there are {gap} nats apart: {step}",
                &ours[at..],
                &theirs[at..]
            );
            eprintln!("{name}: greedy text equal for {at} bytes, then a near tie ({gap:.4} nats)");
            return true;
        }
        at += token.len();
    }
    panic!("{name}: the texts part at byte {d}, past the probe's answer");
}

#[test]
fn qwen_messages_and_tool_calls_answer_as_llama_server() {
    let Some(path) = specula_testkit::real_model("qwen2.5-coder-0.5b") else {
        return;
    };
    let s = start(&path);
    let ok = |name: &str| -> (Value, String) {
        let g = golden(name);
        let (status, body) = replay(&s, &g);
        assert_eq!(status, 200, "{name}: {body}");
        (g, body)
    };

    for name in [
        "messages_text",
        "messages_system",
        "messages_stop",
        "messages_tools",
        "messages_tool_result",
    ] {
        let (g, body) = ok(name);
        check_message(name, &json(&body), &g["response"]);
    }
    let (g, body) = ok("messages_stream");
    check_message_stream("messages_stream", &events(&body), &golden_events(&g));
    let (g, body) = ok("messages_tools_stream");
    check_message_stream(
        "messages_tools_stream",
        &collapse(&events(&body)),
        &collapse(&golden_events(&g)),
    );

    // `tool_choice` any / required: the answer is constrained to end in a call, as
    // llama-server's grammar constrains it; where the model writes no `<tool_call>` block it
    // cannot end, and both write on to max_tokens. The greedy text is llama-server's, up to
    // a near tie of the model's two best tokens (`near_tie`), where the two may part.
    let probe = golden("chat_tools_required")["request"]["body"].clone();
    let text_of = |v: &Value| -> String {
        v["content"][0]["text"]
            .as_str()
            .unwrap_or_default()
            .to_owned()
    };
    let (g, body) = ok("messages_tools_any");
    let mut ours = json(&body);
    let theirs = &g["response"];
    if near_tie(
        &s,
        &probe,
        "messages_tools_any",
        &text_of(&ours),
        &text_of(theirs),
    ) {
        ours["content"][0]["text"] = theirs["content"][0]["text"].clone();
    }
    check_message("messages_tools_any", &ours, theirs);
    assert_eq!(theirs["stop_reason"], "max_tokens");
    let (g, body) = ok("messages_tools_any_stream");
    let (mut ours, theirs) = (collapse(&events(&body)), collapse(&golden_events(&g)));
    let delta = |e: &Events| {
        e.iter()
            .position(|(_, v)| v["delta"]["type"] == "text_delta")
    };
    if let (Some(o), Some(t)) = (delta(&ours), delta(&theirs)) {
        let text = |e: &Events, i: usize| e[i].1["delta"]["text"].as_str().unwrap().to_owned();
        if near_tie(
            &s,
            &probe,
            "messages_tools_any_stream",
            &text(&ours, o),
            &text(&theirs, t),
        ) {
            ours[o].1["delta"]["text"] = theirs[t].1["delta"]["text"].clone();
        }
    }
    check_message_stream("messages_tools_any_stream", &ours, &theirs);
    let (g, body) = ok("chat_tools_required");
    let mut ours = json(&body);
    let theirs = &g["response"];
    let content = |v: &Value| -> String {
        v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap_or_default()
            .to_owned()
    };
    if near_tie(
        &s,
        &probe,
        "chat_tools_required",
        &content(&ours),
        &content(theirs),
    ) {
        ours["choices"][0]["message"]["content"] =
            theirs["choices"][0]["message"]["content"].clone();
    }
    check_chat("chat_tools_required", &ours, theirs);
    assert_eq!(theirs["choices"][0]["finish_reason"], "length");

    for name in ["count_tokens", "count_tokens_tools"] {
        let (g, body) = ok(name);
        assert_eq!(json(&body), g["response"], "{name}");
    }

    for name in [
        "messages_error_no_content",
        "messages_error_context",
        "chat_error_tool_choice",
    ] {
        let g = golden(name);
        let (status, body) = replay(&s, &g);
        let ours = json(&body);
        let theirs = &g["response"];
        assert_eq!(
            u64::from(status),
            g["status"].as_u64().unwrap(),
            "{name}: status"
        );
        for k in ["code", "type"] {
            assert_eq!(ours["error"][k], theirs["error"][k], "{name}: error.{k}");
        }
        if name.starts_with("messages_") {
            assert_eq!(
                ours["type"], "error",
                "{name}: Anthropic's error type (a listed difference)"
            );
        }
        if name == "messages_error_context" {
            for k in ["n_prompt_tokens", "n_ctx"] {
                assert_eq!(ours["error"][k], theirs["error"][k], "{name}: error.{k}");
            }
        } else {
            assert_eq!(
                ours["error"]["message"], theirs["error"]["message"],
                "{name}: message"
            );
        }
    }

    for name in ["chat_tools", "chat_tool_result", "chat_tools_none"] {
        let (g, body) = ok(name);
        check_chat(name, &json(&body), &g["response"]);
    }
    let (g, body) = ok("chat_tools_stream");
    check_chat_stream("chat_tools_stream", &events(&body), &golden_events(&g));
    let (g, body) = ok("chat_tools_required_stream");
    let (ours, our_finish) = chat_deltas(&events(&body));
    let (theirs, their_finish) = chat_deltas(&golden_events(&g));
    assert_eq!(
        our_finish, their_finish,
        "chat_tools_required_stream: finish_reason"
    );
    let content =
        |d: &[Value]| -> String { d.iter().filter_map(|d| d["content"].as_str()).collect() };
    near_tie(
        &s,
        &probe,
        "chat_tools_required_stream",
        &content(&ours),
        &content(&theirs),
    );

    let (g, body) = ok("apply_template_tools");
    assert_eq!(
        json(&body)["prompt"],
        g["response"]["prompt"],
        "apply_template_tools"
    );
    s.shutdown().unwrap();
}
