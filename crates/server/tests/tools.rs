//! Tool calling and the Anthropic Messages API on the tiny model (no real model needed): what
//! the chat template is handed (tools, tool calls, tool results, in the request's key order),
//! the request checks with llama-server's messages, and the shape of `/v1/messages` answers,
//! streamed and not.

mod common;

use common::{Draft, post, server};
use serde_json::{Value, json};
use specula_server::ServerConfig;

/// Prints what a tool-using template sees: each tool as JSON, each message with its calls.
const TOOL_TEMPLATE: &str = "{% for t in tools %}T{{ t | tojson }}\n{% endfor %}{% for m in messages %}{{ m.role }}:{{ m.content }}{% if m.tool_call_id %}#{{ m.tool_call_id }}{% endif %}{% for c in m.tool_calls %}[{{ c.id }} {{ c.function.name }} {{ c.function.arguments | tojson }}]{% endfor %}{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}A:{% endif %}";

fn cfg() -> ServerConfig {
    ServerConfig {
        port: 0,
        n_parallel: 1,
        n_ctx: 512,
        chat_template: Some(TOOL_TEMPLATE.into()),
        ..ServerConfig::default()
    }
}

/// A request as raw text (its key order is what the template must keep).
fn raw(s: &specula_server::ServerHandle, path: &str, body: &str) -> common::Resp {
    common::request(
        s.addr(),
        "POST",
        path,
        &[("Content-Type", "application/json")],
        body.as_bytes(),
    )
}

#[test]
fn the_template_sees_tools_calls_and_results_in_the_requests_key_order() {
    let s = server(cfg(), Draft::None);
    let body = r#"{"messages": [
        {"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": null, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get", "arguments": "{\"z\": 1, \"a\": \"<&>\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}],
      "tools": [{"type": "function", "function": {"name": "get",
        "parameters": {"type": "object", "properties": {"z": {"type": "integer"}, "a": {"type": "string"}}}}}]}"#;
    let r = raw(&s, "/apply-template", body);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(
        r.json()["prompt"],
        concat!(
            "T{\"type\": \"function\", \"function\": {\"name\": \"get\", \"description\": \"\", ",
            "\"parameters\": {\"type\": \"object\", \"properties\": {\"z\": {\"type\": \"integer\"}, \"a\": {\"type\": \"string\"}}}}}\n",
            "system:a\nb\n",
            "user:weather?\n",
            "assistant:[c1 get {\"z\": 1, \"a\": \"<&>\"}]\n",
            "tool:sunny#c1\n",
            "A:"
        )
    );
    // The same conversation from the Messages API (tool_use input, tool_result blocks).
    let anthropic = r#"{"max_tokens": 4, "system": "s", "messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "c1", "name": "get", "input": {"z": 1, "a": "x"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1", "content": "sunny"}]}],
      "tools": [{"name": "get", "description": "d", "input_schema": {"type": "object"}}]}"#;
    let n = raw(&s, "/v1/messages/count_tokens", anthropic);
    assert_eq!(n.status, 200, "{}", n.text());
    let chat = json!({"messages": [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get", "arguments": "{\"z\": 1, \"a\": \"x\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}],
      "tools": [{"type": "function", "function": {"name": "get", "description": "d", "parameters": {"type": "object"}}}]});
    let p = post(s.addr(), "/apply-template", &chat).json()["prompt"].clone();
    let ids = post(
        s.addr(),
        "/tokenize",
        &json!({"content": p, "add_special": true}),
    )
    .json();
    assert_eq!(
        n.json()["input_tokens"],
        json!(ids["tokens"].as_array().unwrap().len()),
        "count_tokens of the Messages request = tokens of the equivalent chat prompt"
    );
    s.shutdown().unwrap();
}

#[test]
fn bad_tool_requests_are_refused_as_llama_server_refuses_them() {
    let s = server(cfg(), Draft::None);
    let user = json!([{"role": "user", "content": "hi"}]);
    let cases = [
        (
            json!({"messages": user, "tool_choice": "sometimes"}),
            "Invalid tool_choice: sometimes",
        ),
        (
            json!({"messages": [{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{bad"}}]}]}),
            "Failed to parse tool call arguments as JSON",
        ),
        (
            json!({"messages": [{"role": "user"}]}),
            "All non-assistant messages must contain 'content'",
        ),
        (
            json!({"messages": user, "reasoning_format": "loud"}),
            "Unknown reasoning format: loud",
        ),
    ];
    for (body, msg) in cases {
        let r = post(s.addr(), "/v1/chat/completions", &body);
        assert_eq!(r.status, 400, "{body}: {}", r.text());
        let e = &r.json()["error"];
        assert_eq!(e["type"], "invalid_request_error");
        assert!(e["message"].as_str().unwrap().contains(msg), "{e}");
    }
    // The Messages API answers in Anthropic's error shape too.
    let r = post(
        s.addr(),
        "/v1/messages",
        &json!({"max_tokens": 4, "messages": [{"role": "user"}]}),
    );
    assert_eq!(r.status, 400);
    let v = r.json();
    assert_eq!(v["type"], "error");
    assert_eq!(v["error"]["type"], "invalid_request_error");
    // A well-formed request on the same server still works.
    let ok = post(
        s.addr(),
        "/v1/chat/completions",
        &json!({"messages": user, "max_tokens": 2, "tools": []}),
    );
    assert_eq!(ok.status, 200, "{}", ok.text());
    s.shutdown().unwrap();
}

#[test]
fn messages_answer_with_anthropic_blocks_and_events() {
    let s = server(cfg(), Draft::None);
    let body =
        json!({"max_tokens": 5, "temperature": 0, "messages": [{"role": "user", "content": "hi"}]});
    let v = post(s.addr(), "/v1/messages", &body).json();
    assert_eq!(
        (v["type"].as_str(), v["role"].as_str()),
        (Some("message"), Some("assistant"))
    );
    let stop = v["stop_reason"].as_str().unwrap();
    assert!(["end_turn", "max_tokens"].contains(&stop), "{v}");
    let text: String = v["content"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| {
            assert_eq!(b["type"], "text");
            b["text"].as_str().unwrap().to_owned()
        })
        .collect();
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let r = post(s.addr(), "/v1/messages", &streamed);
    let text_body = r.text();
    let names: Vec<&str> = text_body
        .lines()
        .filter_map(|l| l.strip_prefix("event: "))
        .collect();
    assert_eq!(names.first(), Some(&"message_start"), "{text_body}");
    assert_eq!(names.last(), Some(&"message_stop"));
    assert_eq!(names[names.len() - 2], "message_delta");
    let events: Vec<Value> = r
        .sse()
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let deltas: String = events
        .iter()
        .filter_map(|e| e["delta"]["text"].as_str())
        .collect();
    assert_eq!(deltas, text, "streamed text = the non-streamed answer");
    let last = &events[events.len() - 2];
    assert_eq!(last["delta"]["stop_reason"], stop);
    assert_eq!(last["usage"]["output_tokens"], v["usage"]["output_tokens"]);
    s.shutdown().unwrap();
}
