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

/// A Responses request with function tools and the items of an earlier call (`function_call`,
/// `function_call_output`): the template sees the same conversation as the chat request it
/// converts to, and an answer holding a `<tool_call>` block (forced here by a GBNF grammar,
/// so the tiny model writes it) comes back as a `message` item and a `function_call` item —
/// the same call as chat completions reads from the same text — and, streamed, as
/// llama-server's events: the call's `output_item.added` with its name, its arguments in
/// `function_call_arguments.delta` pieces, each item's `…done`, every event placed by its
/// item's `output_index`.
#[test]
fn responses_take_function_tools_and_answer_function_call_items() {
    let s = server(cfg(), Draft::None);
    let call = "Sure.<tool_call>\n{\"name\": \"get\", \"arguments\": {\"z\": 1}}\n</tool_call>";
    let grammar = format!("root ::= {}", serde_json::to_string(call).unwrap());
    let tools_resp = json!([
        {"type": "function", "name": "get", "description": "d",
         "parameters": {"type": "object", "properties": {"z": {"type": "integer"}}}},
        {"type": "web_search"}
    ]);
    let resp = json!({
        "instructions": "be brief",
        "input": [
            {"role": "user", "content": "weather?"},
            {"type": "function_call", "call_id": "c0", "name": "get", "arguments": "{\"z\": 0}"},
            {"type": "function_call_output", "call_id": "c0", "output": "sunny"},
            {"role": "user", "content": [{"type": "input_text", "text": "again"}]}
        ],
        "tools": tools_resp, "grammar": grammar, "max_output_tokens": 160, "temperature": 0
    });
    let chat = json!({
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "tool_calls": [{"function": {"arguments": "{\"z\": 0}", "name": "get"}, "id": "c0", "type": "function"}]},
            {"role": "tool", "tool_call_id": "c0", "content": "sunny"},
            {"role": "user", "content": [{"type": "text", "text": "again"}]}
        ],
        "tools": [{"type": "function", "function": {"name": "get", "description": "d",
            "parameters": {"type": "object", "properties": {"z": {"type": "integer"}}}, "strict": true}}],
        "grammar": grammar, "max_tokens": 160, "temperature": 0
    });
    let c = post(s.addr(), "/v1/chat/completions", &chat).json();
    let msg = &c["choices"][0]["message"];
    assert_eq!(c["choices"][0]["finish_reason"], "tool_calls", "{c}");
    assert_eq!(msg["tool_calls"][0]["function"]["name"], "get");
    let r = post(s.addr(), "/v1/responses", &resp);
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(
        v["usage"]["input_tokens"], c["usage"]["prompt_tokens"],
        "the same prompt as the chat request"
    );
    let out = v["output"].as_array().unwrap();
    assert_eq!(out.len(), 2, "{v}");
    assert_eq!(out[0]["type"], "message");
    assert_eq!(out[0]["content"][0]["text"], msg["content"]);
    assert_eq!(out[0]["content"][0]["text"], "Sure.");
    let fc = &out[1];
    assert_eq!(
        (
            fc["type"].as_str(),
            fc["status"].as_str(),
            fc["name"].as_str()
        ),
        (Some("function_call"), Some("completed"), Some("get"))
    );
    assert_eq!(
        fc["arguments"],
        msg["tool_calls"][0]["function"]["arguments"]
    );
    assert_eq!(fc["arguments"], "{\"z\": 1}");
    let id = fc["id"].as_str().unwrap().strip_prefix("fc_").unwrap();
    assert_eq!(fc["call_id"], format!("call_{id}"));

    let mut streamed = resp.clone();
    streamed["stream"] = json!(true);
    let r = post(s.addr(), "/v1/responses", &streamed);
    let events: Vec<Value> = r
        .sse()
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let kinds: Vec<&str> = events.iter().map(|e| e["type"].as_str().unwrap()).collect();
    let first = |k: &str| kinds.iter().position(|&x| x == k).unwrap_or(usize::MAX);
    assert_eq!(
        kinds[..2],
        ["response.created", "response.in_progress"],
        "{kinds:?}"
    );
    assert_eq!(kinds.last(), Some(&"response.completed"));
    for (i, e) in events.iter().enumerate() {
        assert_eq!(e["sequence_number"], i, "{e}");
    }
    let added: Vec<&Value> = events
        .iter()
        .filter(|e| e["type"] == "response.output_item.added")
        .collect();
    assert_eq!(added.len(), 2, "{kinds:?}");
    assert_eq!(
        (
            added[0]["output_index"].as_u64(),
            added[0]["item"]["type"].as_str()
        ),
        (Some(0), Some("message"))
    );
    let call = &added[1];
    assert_eq!(
        (
            call["output_index"].as_u64(),
            call["item"]["name"].as_str(),
            call["item"]["arguments"].as_str()
        ),
        (Some(1), Some("get"), Some(""))
    );
    let fc_id = call["item"]["id"].as_str().unwrap();
    let text: String = events
        .iter()
        .filter(|e| e["type"] == "response.output_text.delta")
        .map(|e| e["delta"].as_str().unwrap())
        .collect();
    assert_eq!(text, "Sure.");
    let args: Vec<&Value> = events
        .iter()
        .filter(|e| e["type"] == "response.function_call_arguments.delta")
        .collect();
    assert!(!args.is_empty(), "{kinds:?}");
    assert!(
        args.iter()
            .all(|e| e["item_id"] == fc_id && e["output_index"] == 1)
    );
    let joined: String = args.iter().map(|e| e["delta"].as_str().unwrap()).collect();
    assert_eq!(joined, "{\"z\": 1}");
    assert!(first("response.output_item.added") < first("response.output_text.delta"));
    let done: Vec<&Value> = events
        .iter()
        .filter(|e| e["type"] == "response.output_item.done")
        .collect();
    assert_eq!(done.len(), 2);
    assert_eq!(done[1]["item"]["arguments"], "{\"z\": 1}");
    assert_eq!(done[1]["item"]["status"], "completed");
    let completed = &events.last().unwrap()["response"];
    let strip = |items: &Value| -> Vec<Value> {
        items
            .as_array()
            .unwrap()
            .iter()
            .map(|i| {
                let mut i = i.clone();
                for k in ["id", "call_id"] {
                    if i.get(k).is_some() {
                        i[k] = Value::Null;
                    }
                }
                i
            })
            .collect()
    };
    assert_eq!(strip(&completed["output"]), strip(&v["output"]));

    // What llama-server refuses, refused alike.
    for (bad, want) in [
        (
            json!({"input": [{"type": "function_call", "name": "get"}]}),
            "'function_call' item needs",
        ),
        (
            json!({"input": "hi", "tools": {"a": 1}}),
            "'tools' must be an array",
        ),
        (
            json!({"input": "hi", "previous_response_id": "resp_1"}),
            "previous_response_id",
        ),
    ] {
        let r = post(s.addr(), "/v1/responses", &bad);
        assert_eq!(r.status, 400, "{bad}: {}", r.text());
        assert!(r.text().contains(want), "{bad}: {}", r.text());
    }
    s.shutdown().unwrap();
}
