//! OpenAI's Responses API, `POST /v1/responses` (and `/responses`), as llama-server serves it:
//! the request is turned into a chat completion (`server_chat_convert_responses_to_chatcmpl`
//! of `tools/server/server-chat.cpp`: `instructions` a system message, `input` a user message
//! or a list of message items, `max_output_tokens` the `max_tokens`), and the answer is shaped
//! as `to_json_oaicompat_resp` / `_resp_stream` of `server-task.cpp` shape it:
//!
//! - not streamed: `{id, object: "response", status: "completed", created_at, completed_at,
//!   model, output: [{type: "message", id, role, status, content: [{type: "output_text", text,
//!   annotations, logprobs}]}], usage: {input_tokens, output_tokens, total_tokens,
//!   input_tokens_details}}`;
//! - streamed: typed SSE events (`event:` and `data:` with its `type`) — `response.created`,
//!   `response.in_progress`, `response.output_item.added`, `response.content_part.added`, one
//!   `response.output_text.delta` per piece of text, then `response.output_text.done`,
//!   `response.content_part.done`, `response.output_item.done` and `response.completed` with
//!   the whole response; no `[DONE]`. Beside llama-server's fields each event carries
//!   OpenAI's `sequence_number` (and `output_index` / `content_index` where OpenAI has them),
//!   and the in-progress response its `created_at`, `model` and empty `output`, which the
//!   official clients' stream helpers (`client.responses.stream`) read.
//!
//! Function tools, `function_call` / `function_call_output` / `reasoning` input items and
//! `tool_choice` go through the chat conversation (`tools::Conversation`) as in chat
//! completions; the answer's reasoning, text and tool calls become `reasoning`, `message` and
//! `function_call` output items (`fc_<id>`, `call_id` `call_<id>`), streamed with
//! `response.reasoning_text.delta` and `response.function_call_arguments.delta`. Each event
//! carries the `output_index` of its item. `previous_response_id` (stored conversations) is
//! not served: it answers 400 naming what is missing.

use std::convert::Infallible;
use std::time::Instant;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use serde_json::{Value, json};
use tokio::sync::mpsc;

use crate::api::{Common, Kind, error_body, timings};
use crate::http::{
    ApiError, AppState, body_bytes, collect, encode, fail, job, model_name, now_secs, parse, submit,
};
use crate::metrics::Outcome;
use crate::tools::{
    Conversation, Diff, OutputFormat, ParsedMessage, StreamParser, ToolCall, parse_final,
};
use crate::worker::{Event, Summary};

/// The routes (merged into the application by `http::router`).
pub(crate) fn routes() -> Router<AppState> {
    Router::new()
        .route("/v1/responses", post(responses))
        .route("/responses", post(responses))
}

/// The text parts of a message item as chat content parts (`{"type": "text", "text"}`):
/// `input_text` for user, system and developer messages, `output_text` (or `input_text`)
/// for assistant ones; a string is one part.
fn text_parts(role: &str, content: &Value) -> Result<Vec<Value>, ApiError> {
    let parts = match content {
        Value::String(s) => return Ok(vec![json!({"text": s, "type": "text"})]),
        Value::Array(parts) => parts,
        _ => {
            return Err(ApiError::bad(
                "'input' must be a string or array of objects",
            ));
        }
    };
    let assistant = role == "assistant";
    let mut out = Vec::with_capacity(parts.len());
    for p in parts {
        let kind = p.get("type").and_then(Value::as_str).unwrap_or("");
        let text = |what: &str| {
            p.get("text")
                .and_then(Value::as_str)
                .map(|t| json!({"text": t, "type": "text"}))
                .ok_or_else(|| ApiError::bad(format!("'{what}' requires 'text'")))
        };
        match kind {
            "input_text" if !assistant => out.push(text("Input text")?),
            "output_text" | "input_text" if assistant => out.push(text("Output text")?),
            "refusal" if assistant => {}
            "input_image" | "input_file" if !assistant => {
                return Err(ApiError::bad(format!(
                    "'{kind}' is not supported: this server reads text only"
                )));
            }
            _ if assistant => {
                return Err(ApiError::bad(
                    "'type' must be one of 'output_text' or 'refusal'",
                ));
            }
            _ => {
                return Err(ApiError::bad(
                    "'type' must be one of 'input_text', 'input_image', or 'input_file'",
                ));
            }
        }
    }
    Ok(out)
}

/// The chat-completions request of a Responses request, as llama-server converts it
/// (`server_chat_convert_responses_to_chatcmpl`): `instructions` a system message; `input` a
/// user message, or items — messages, `function_call` items (an assistant message's tool
/// calls, merged into the assistant message before them), `function_call_output` items
/// (`role: "tool"` results) and `reasoning` items (the assistant's `reasoning_content`);
/// function `tools` as chat tools (others skipped); `max_output_tokens` as `max_tokens`.
/// Every other field is kept (`tool_choice`, `parallel_tool_calls`, sampling).
fn chat_body(body: &Value) -> Result<Value, ApiError> {
    let input = body
        .get("input")
        .ok_or_else(|| ApiError::bad("'input' is required"))?;
    if body
        .get("previous_response_id")
        .and_then(Value::as_str)
        .is_some_and(|s| !s.is_empty())
    {
        return Err(ApiError::bad(
            "'previous_response_id' is not supported: responses are not stored; send the conversation in 'input'",
        ));
    }
    let mut msgs: Vec<Value> = Vec::new();
    if let Some(i) = body.get("instructions") {
        msgs.push(json!({"role": "system", "content": i.as_str().unwrap_or_default()}));
    }
    let str_of = |item: &Value, key: &str| item.get(key).and_then(Value::as_str).map(str::to_owned);
    match input {
        Value::String(s) => msgs.push(json!({"role": "user", "content": s})),
        Value::Array(items) => {
            for item in items {
                let merge = msgs.last().is_some_and(|m| m["role"] == "assistant");
                let role = str_of(item, "role");
                let kind = str_of(item, "type");
                match (role.as_deref(), kind.as_deref()) {
                    (Some(r @ ("user" | "system" | "developer")), None | Some("message"))
                        if item.get("content").is_some() =>
                    {
                        let parts = text_parts(r, &item["content"])?;
                        msgs.push(json!({"role": r, "content": parts}));
                    }
                    (Some("assistant"), Some("message") | None)
                        if item.get("content").is_some() =>
                    {
                        let parts = text_parts("assistant", &item["content"])?;
                        if merge {
                            let last = msgs.last_mut().expect("an assistant message");
                            match last["content"].as_array_mut() {
                                Some(c) => c.extend(parts),
                                None => last["content"] = Value::Array(parts),
                            }
                        } else {
                            msgs.push(json!({"role": "assistant", "content": parts}));
                        }
                    }
                    (_, Some("function_call")) => {
                        let (Some(args), Some(id), Some(name)) = (
                            str_of(item, "arguments"),
                            str_of(item, "call_id"),
                            str_of(item, "name"),
                        ) else {
                            return Err(ApiError::bad(
                                "a 'function_call' item needs 'arguments', 'call_id' and 'name' (strings)",
                            ));
                        };
                        let call = json!({
                            "function": {"arguments": args, "name": name},
                            "id": id,
                            "type": "function",
                        });
                        if merge {
                            let last = msgs.last_mut().expect("an assistant message");
                            match last["tool_calls"].as_array_mut() {
                                Some(c) => c.push(call),
                                None => last["tool_calls"] = json!([call]),
                            }
                        } else {
                            msgs.push(json!({"role": "assistant", "tool_calls": [call]}));
                        }
                    }
                    (_, Some("function_call_output")) => {
                        let id = str_of(item, "call_id").ok_or_else(|| {
                            ApiError::bad(
                                "a 'function_call_output' item needs 'call_id' (a string)",
                            )
                        })?;
                        let content = match item.get("output") {
                            Some(Value::String(s)) => json!(s),
                            Some(o @ Value::Array(_)) => Value::Array(text_parts("user", o)?),
                            _ => {
                                return Err(ApiError::bad(
                                    "a 'function_call_output' item needs 'output' (a string or an array)",
                                ));
                            }
                        };
                        msgs.push(json!({"content": content, "role": "tool", "tool_call_id": id}));
                    }
                    (_, Some("reasoning")) => {
                        let text = item
                            .get("content")
                            .and_then(Value::as_array)
                            .and_then(|c| c.first())
                            .and_then(|c| c.get("text"))
                            .and_then(Value::as_str)
                            .ok_or_else(|| {
                                ApiError::bad("item['content']['text'] is not a string")
                            })?;
                        if merge {
                            msgs.last_mut().expect("an assistant message")["reasoning_content"] =
                                json!(text);
                        } else {
                            msgs.push(json!({
                                "role": "assistant", "content": [], "reasoning_content": text,
                            }));
                        }
                    }
                    _ => return Err(ApiError::bad("Cannot determine type of 'item'")),
                }
            }
        }
        _ => {
            return Err(ApiError::bad(
                "'input' must be a string or array of objects",
            ));
        }
    }
    let mut chat = body.clone();
    let m = chat
        .as_object_mut()
        .ok_or_else(|| ApiError::bad("the request body must be a JSON object"))?;
    m.remove("input");
    m.remove("instructions");
    m.insert("messages".into(), Value::Array(msgs));
    if let Some(tools) = m.remove("tools") {
        let tools = tools
            .as_array()
            .ok_or_else(|| ApiError::bad("'tools' must be an array of objects"))?;
        let chat_tools: Vec<Value> = tools
            .iter()
            .filter(|t| t.get("type").and_then(Value::as_str) == Some("function"))
            .map(|t| {
                let mut f = t.clone();
                if let Some(o) = f.as_object_mut() {
                    o.remove("type");
                    o.entry("strict").or_insert(json!(true));
                }
                json!({"type": "function", "function": f})
            })
            .collect();
        if !chat_tools.is_empty() {
            m.insert("tools".into(), Value::Array(chat_tools));
        }
    }
    if let Some(n) = m.remove("max_output_tokens") {
        if !n.is_i64() && !n.is_u64() {
            return Err(ApiError::bad(format!(
                "max_output_tokens = {n}: send a number"
            )));
        }
        m.insert("max_tokens".into(), n);
    }
    Ok(chat)
}

/// A fresh id with a prefix (`resp_…`, `msg_…`).
fn new_id(prefix: &str) -> String {
    format!("{prefix}{:016x}", specula_sampling::entropy_seed())
}

/// What a response is named with, and how its text is read back.
struct Ids {
    resp: String,
    msg: String,
    reasoning: String,
    model: String,
    format: OutputFormat,
}

fn usage(s: &Summary) -> Value {
    json!({
        "input_tokens": s.prompt_tokens,
        "output_tokens": s.completion_tokens,
        "total_tokens": s.prompt_tokens + s.completion_tokens,
        "input_tokens_details": {"cached_tokens": s.cached_tokens},
    })
}

fn text_part(text: &str) -> Value {
    json!({"type": "output_text", "annotations": [], "logprobs": [], "text": text})
}

fn reasoning_item(ids: &Ids, text: &str, status: Option<&str>) -> Value {
    let mut v = json!({
        "id": ids.reasoning, "summary": [], "type": "reasoning",
        "content": [{"text": text, "type": "reasoning_text"}], "encrypted_content": "",
    });
    if let Some(st) = status {
        v["status"] = json!(st);
    }
    v
}

fn message_item(ids: &Ids, text: &str) -> Value {
    json!({
        "content": [text_part(text)],
        "id": ids.msg,
        "role": "assistant",
        "status": "completed",
        "type": "message",
    })
}

fn call_item(c: &ToolCall, status: &str) -> Value {
    json!({
        "id": format!("fc_{}", c.id), "type": "function_call", "status": status,
        "arguments": c.arguments, "call_id": format!("call_{}", c.id), "name": c.name,
    })
}

/// The `output` list, as llama-server's: the reasoning, the message (when there is text),
/// then one `function_call` item per call.
fn output(ids: &Ids, m: &ParsedMessage) -> Vec<Value> {
    let mut out = Vec::new();
    if !m.reasoning.is_empty() {
        out.push(reasoning_item(ids, &m.reasoning, Some("completed")));
    }
    if !m.content.is_empty() {
        out.push(message_item(ids, &m.content));
    }
    out.extend(m.tool_calls.iter().map(|c| call_item(c, "completed")));
    out
}

async fn responses(State(st): State<AppState>, body: Result<Bytes, BytesRejection>) -> Response {
    let t0 = Instant::now();
    let prepared = (|| {
        let body: Value = parse(&body_bytes(&st, body)?)?;
        let chat = chat_body(&body)?;
        let template = st.template.as_ref().ok_or_else(|| {
            ApiError::bad(
                "this model has no usable chat template; use /completion with a formatted prompt",
            )
        })?;
        let bytes = serde_json::to_vec(&chat)
            .map_err(|e| ApiError::bad(format!("invalid request: {e}")))?;
        let conv = Conversation::from_openai(&crate::tools::ordered(&bytes)?)?;
        let text = conv.render(template)?;
        let format =
            conv.output_format(st.limits.reasoning_format, st.limits.template_thinks, &text);
        let prompt = encode(&st.tokenizer, &text)?;
        let mut c: Common = serde_json::from_value(chat)
            .map_err(|e| ApiError::bad(format!("invalid request: {e}")))?;
        c.logprobs = None;
        c.structured.tools = conv.required_call();
        Ok((c, prompt, format))
    })();
    let (c, prompt, format) = match prepared {
        Ok(p) => p,
        Err(e) => return fail(&st, t0, e),
    };
    let (tx, mut rx) = mpsc::unbounded_channel();
    let job = match job(&st, &c, prompt, Kind::Chat, tx) {
        Ok(j) => j,
        Err(e) => return fail(&st, t0, e),
    };
    let ids = Ids {
        resp: new_id("resp_"),
        msg: new_id("msg_"),
        reasoning: new_id("rs_"),
        model: model_name(&st, c.model.as_ref()),
        format,
    };
    if let Err(e) = submit(&st, job) {
        return fail(&st, t0, e);
    }
    if c.stream {
        return stream(st, ids, rx, t0).into_response();
    }
    match collect(&st, &mut rx, t0, |_| {}).await {
        Ok((text, s)) => {
            st.metrics
                .request_done(Outcome::Success, t0.elapsed().as_secs_f64());
            let t = now_secs();
            let m = if format.parses() {
                parse_final(&text, format)
            } else {
                ParsedMessage {
                    content: text,
                    ..ParsedMessage::default()
                }
            };
            axum::Json(json!({
                "completed_at": t,
                "created_at": t,
                "id": ids.resp,
                "model": ids.model,
                "object": "response",
                "output": output(&ids, &m),
                "status": "completed",
                "usage": usage(&s),
            }))
            .into_response()
        }
        Err(e) => e.into_response(),
    }
}

/// One typed event: `event: TYPE` and its data, numbered (`sequence_number`) as OpenAI's
/// events are, with the `output_index` its item was given and, for a message's text, the
/// `content_index` of its one part, so that the official clients' stream helpers can
/// accumulate them; llama-server's events are the same without those three fields.
fn typed(mut data: Value, seq: &mut u64) -> SseEvent {
    let kind = data["type"].as_str().unwrap_or("error").to_owned();
    if let Some(m) = data.as_object_mut() {
        m.insert("sequence_number".into(), json!(*seq));
        if kind.starts_with("response.content_part.") || kind.starts_with("response.output_text.") {
            m.insert("content_index".into(), json!(0));
        }
    }
    *seq += 1;
    SseEvent::default().event(kind).data(data.to_string())
}

/// The streamed answer, event for event as llama-server's (`to_json_oaicompat_resp` of its
/// partial and final results): each difference of the parsed answer becomes the events of
/// its item — a reasoning item's `response.reasoning_text.delta`, the message's
/// `response.output_text.delta` (after `response.output_item.added` and
/// `response.content_part.added`), a call's `response.output_item.added` with its name and
/// then `response.function_call_arguments.delta` pieces — and the end the `…done` events of
/// every item and `response.completed`.
fn stream(
    st: AppState,
    ids: Ids,
    rx: mpsc::UnboundedReceiver<Event>,
    t0: Instant,
) -> Sse<impl futures_util::Stream<Item = Result<SseEvent, Infallible>>> {
    struct S {
        rx: mpsc::UnboundedReceiver<Event>,
        pending: std::collections::VecDeque<Value>,
        seq: u64,
        created: bool,
        parser: Option<StreamParser>,
        /// The output items opened so far (their ids), in order: an event's `output_index`.
        items: Vec<String>,
        /// The item id of each tool call, by its index.
        calls: Vec<String>,
        /// The answer so far, when it is not parsed (all content).
        text: String,
        done: bool,
    }
    let ids = std::sync::Arc::new(ids);
    let init = S {
        rx,
        pending: std::collections::VecDeque::new(),
        seq: 0,
        created: false,
        parser: ids.format.parses().then(|| StreamParser::new(ids.format)),
        items: Vec::new(),
        calls: Vec::new(),
        text: String::new(),
        done: false,
    };
    let s = futures_util::stream::unfold(init, move |mut s| {
        let st = st.clone();
        let ids = ids.clone();
        async move {
            loop {
                if let Some(v) = s.pending.pop_front() {
                    let e = typed(v, &mut s.seq);
                    return Some((Ok(e), s));
                }
                if s.done {
                    return None;
                }
                let in_progress = |kind: &str| {
                    json!({"type": kind, "response": {
                        "id": ids.resp, "object": "response", "status": "in_progress",
                        "created_at": now_secs(), "model": ids.model, "output": [],
                    }})
                };
                let ev = s.rx.recv().await?;
                if !s.created && matches!(ev, Event::Delta(_) | Event::Done(_)) {
                    s.created = true;
                    s.pending.push_back(in_progress("response.created"));
                    s.pending.push_back(in_progress("response.in_progress"));
                }
                // An item's place in `output`, opening it the first time.
                let index = |s: &mut S, id: &str| -> (usize, bool) {
                    match s.items.iter().position(|i| i == id) {
                        Some(i) => (i, false),
                        None => {
                            s.items.push(id.to_owned());
                            (s.items.len() - 1, true)
                        }
                    }
                };
                let emit = |s: &mut S, d: &Diff| {
                    if !d.reasoning.is_empty() {
                        let (i, new) = index(s, &ids.reasoning);
                        if new {
                            let mut item = reasoning_item(&ids, "", Some("in_progress"));
                            item["content"] = json!([]);
                            s.pending.push_back(json!({
                                "type": "response.output_item.added", "output_index": i, "item": item,
                            }));
                        }
                        s.pending.push_back(json!({
                            "type": "response.reasoning_text.delta", "output_index": i,
                            "delta": d.reasoning, "item_id": ids.reasoning,
                        }));
                    }
                    if !d.content.is_empty() {
                        let (i, new) = index(s, &ids.msg);
                        if new {
                            s.pending.push_back(json!({
                                "type": "response.output_item.added", "output_index": i,
                                "item": {"content": [], "id": ids.msg, "role": "assistant", "status": "in_progress", "type": "message"},
                            }));
                            s.pending.push_back(json!({
                                "type": "response.content_part.added", "output_index": i,
                                "item_id": ids.msg, "part": {"type": "output_text", "text": ""},
                            }));
                        }
                        s.pending.push_back(json!({
                            "type": "response.output_text.delta", "output_index": i,
                            "item_id": ids.msg, "delta": d.content,
                        }));
                    }
                    if let Some((k, c)) = &d.tool_call {
                        if !c.name.is_empty() {
                            let fc = format!("fc_{}", c.id);
                            let (i, _) = index(s, &fc);
                            let mut item = call_item(c, "in_progress");
                            item["arguments"] = json!("");
                            s.pending.push_back(json!({
                                "type": "response.output_item.added", "output_index": i, "item": item,
                            }));
                            if s.calls.len() <= *k {
                                s.calls.resize(*k + 1, String::new());
                            }
                            s.calls[*k].clone_from(&fc);
                        }
                        if !c.arguments.is_empty() {
                            let fc = s.calls.get(*k).cloned().unwrap_or_default();
                            let (i, _) = index(s, &fc);
                            s.pending.push_back(json!({
                                "type": "response.function_call_arguments.delta", "output_index": i,
                                "delta": c.arguments, "item_id": fc,
                            }));
                        }
                    }
                };
                let diffs =
                    |s: &mut S, text: &str, end: bool| -> (Vec<Diff>, Option<ParsedMessage>) {
                        match s.parser.as_mut() {
                            Some(p) if end => {
                                let (d, m) = p.finish(text);
                                (d, Some(m))
                            }
                            Some(p) => (p.push(text), None),
                            None => {
                                s.text.push_str(text);
                                (
                                    vec![Diff {
                                        content: text.to_owned(),
                                        ..Diff::default()
                                    }],
                                    None,
                                )
                            }
                        }
                    };
                match ev {
                    Event::Delta(d) => {
                        let (ds, _) = diffs(&mut s, &d.text, false);
                        for d in &ds {
                            emit(&mut s, d);
                        }
                    }
                    Event::Done(sum) => {
                        let (ds, parsed) = diffs(&mut s, &sum.tail, true);
                        for d in &ds {
                            emit(&mut s, d);
                        }
                        s.done = true;
                        st.metrics
                            .request_done(Outcome::Success, t0.elapsed().as_secs_f64());
                        let m = parsed.unwrap_or_else(|| ParsedMessage {
                            content: std::mem::take(&mut s.text),
                            ..ParsedMessage::default()
                        });
                        if !m.reasoning.is_empty() {
                            let (i, _) = index(&mut s, &ids.reasoning);
                            s.pending.push_back(json!({
                                "type": "response.output_item.done", "output_index": i,
                                "item": reasoning_item(&ids, &m.reasoning, None),
                            }));
                        }
                        if !m.content.is_empty() {
                            let (i, _) = index(&mut s, &ids.msg);
                            s.pending.push_back(json!({
                                "type": "response.output_text.done", "output_index": i,
                                "item_id": ids.msg, "text": m.content,
                            }));
                            s.pending.push_back(json!({
                                "type": "response.content_part.done", "output_index": i,
                                "item_id": ids.msg, "part": text_part(&m.content),
                            }));
                            s.pending.push_back(json!({
                                "type": "response.output_item.done", "output_index": i,
                                "item": message_item(&ids, &m.content),
                            }));
                        }
                        for c in &m.tool_calls {
                            let (i, _) = index(&mut s, &format!("fc_{}", c.id));
                            s.pending.push_back(json!({
                                "type": "response.output_item.done", "output_index": i,
                                "item": call_item(c, "completed"),
                            }));
                        }
                        let out = output(&ids, &m);
                        s.pending.push_back(json!({
                            "type": "response.completed",
                            "response": {
                                "id": ids.resp, "object": "response", "created_at": now_secs(),
                                "status": "completed", "model": ids.model, "output": out,
                                "usage": usage(&sum),
                            },
                            "timings": timings(&sum),
                        }));
                    }
                    Event::Error(status, msg) => {
                        s.done = true;
                        if status != 504 {
                            st.metrics
                                .request_done(Outcome::Error, t0.elapsed().as_secs_f64());
                        }
                        let mut e = error_body(status, &msg);
                        e["type"] = json!("error");
                        s.pending.push_back(e);
                    }
                }
            }
        }
    });
    Sse::new(s)
}
