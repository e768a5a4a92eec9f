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
//! `previous_response_id` (stored conversations), tools and reasoning items are not served:
//! they answer 400 naming what is missing.

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
use specula_tokenizer::ChatMessage;
use tokio::sync::mpsc;

use crate::api::{Common, Kind, error_body, timings};
use crate::http::{
    ApiError, AppState, body_bytes, collect, encode, fail, job, model_name, now_secs, parse, submit,
};
use crate::metrics::Outcome;
use crate::worker::{Event, Summary};

/// The routes (merged into the application by `http::router`).
pub(crate) fn routes() -> Router<AppState> {
    Router::new()
        .route("/v1/responses", post(responses))
        .route("/responses", post(responses))
}

/// A message item's text: a string, or the text of its `input_text` / `output_text` parts.
fn item_text(role: &str, content: &Value) -> Result<String, ApiError> {
    match content {
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => {
            let mut texts = Vec::with_capacity(parts.len());
            for p in parts {
                let kind = p.get("type").and_then(Value::as_str).unwrap_or("");
                match (kind, role) {
                    ("input_text", "user" | "system" | "developer") => texts.push(
                        p.get("text")
                            .and_then(Value::as_str)
                            .ok_or_else(|| ApiError::bad("'Input text' requires 'text'"))?,
                    ),
                    ("output_text", "assistant") => texts.push(
                        p.get("text")
                            .and_then(Value::as_str)
                            .ok_or_else(|| ApiError::bad("'Output text' requires 'text'"))?,
                    ),
                    ("input_image" | "input_file", _) => {
                        return Err(ApiError::bad(format!(
                            "'{kind}' is not supported: this server reads text only"
                        )));
                    }
                    (_, "assistant") => {
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
            Ok(texts.join("\n"))
        }
        _ => Err(ApiError::bad(
            "'input' must be a string or array of objects",
        )),
    }
}

/// The chat messages of a Responses request, as llama-server converts them.
fn messages(body: &Value) -> Result<Vec<ChatMessage>, ApiError> {
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
    let mut out = Vec::new();
    if let Some(i) = body.get("instructions") {
        out.push(ChatMessage::new(
            "system",
            i.as_str().unwrap_or_default().to_owned(),
        ));
    }
    match input {
        Value::String(s) => out.push(ChatMessage::new("user", s.clone())),
        Value::Array(items) => {
            for item in items {
                let role = item.get("role").and_then(Value::as_str);
                let kind = item
                    .get("type")
                    .and_then(Value::as_str)
                    .unwrap_or("message");
                match (role, item.get("content"), kind) {
                    (
                        Some(r @ ("user" | "system" | "developer" | "assistant")),
                        Some(c),
                        "message",
                    ) => {
                        out.push(ChatMessage::new(r.to_owned(), item_text(r, c)?));
                    }
                    (_, _, k @ ("function_call" | "function_call_output" | "reasoning")) => {
                        return Err(ApiError::bad(format!(
                            "'{k}' input items are not supported by /v1/responses here"
                        )));
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
    if body
        .get("tools")
        .is_some_and(|t| t.as_array().is_some_and(|a| !a.is_empty()))
    {
        return Err(ApiError::bad(
            "'tools' are not supported by /v1/responses here; use /v1/chat/completions",
        ));
    }
    Ok(out)
}

/// A fresh id with a prefix (`resp_…`, `msg_…`).
fn new_id(prefix: &str) -> String {
    format!("{prefix}{:016x}", specula_sampling::entropy_seed())
}

/// What a response is named with.
struct Ids {
    resp: String,
    msg: String,
    model: String,
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

/// The `output` list: one message, when there is text.
fn output(ids: &Ids, text: &str) -> Vec<Value> {
    if text.is_empty() {
        return Vec::new();
    }
    vec![json!({
        "content": [text_part(text)],
        "id": ids.msg,
        "role": "assistant",
        "status": "completed",
        "type": "message",
    })]
}

async fn responses(State(st): State<AppState>, body: Result<Bytes, BytesRejection>) -> Response {
    let t0 = Instant::now();
    let prepared = (|| {
        let body: Value = parse(&body_bytes(&st, body)?)?;
        let msgs = messages(&body)?;
        let template = st.template.as_ref().ok_or_else(|| {
            ApiError::bad(
                "this model has no usable chat template; use /completion with a formatted prompt",
            )
        })?;
        let text = template.render(&msgs, true).map_err(|e| {
            ApiError::bad(format!("the chat template failed on these messages: {e}"))
        })?;
        let prompt = encode(&st.tokenizer, &text)?;
        let mut c: Common = serde_json::from_value(body.clone())
            .map_err(|e| ApiError::bad(format!("invalid request: {e}")))?;
        if let Some(n) = body.get("max_output_tokens") {
            c.max_tokens =
                Some(n.as_i64().ok_or_else(|| {
                    ApiError::bad(format!("max_output_tokens = {n}: send a number"))
                })?);
        }
        c.logprobs = None;
        Ok((c, prompt))
    })();
    let (c, prompt) = match prepared {
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
        model: model_name(&st, c.model.as_ref()),
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
            axum::Json(json!({
                "completed_at": t,
                "created_at": t,
                "id": ids.resp,
                "model": ids.model,
                "object": "response",
                "output": output(&ids, &text),
                "status": "completed",
                "usage": usage(&s),
            }))
            .into_response()
        }
        Err(e) => e.into_response(),
    }
}

/// One typed event: `event: TYPE` and its data, numbered (`sequence_number`) and placed
/// (`output_index`, `content_index`: one message of one text part) as OpenAI's events are, so
/// that the official clients' stream helpers can accumulate them; llama-server's events are
/// the same without those three fields.
fn typed(mut data: Value, seq: &mut u64) -> SseEvent {
    let kind = data["type"].as_str().unwrap_or("error").to_owned();
    if let Some(m) = data.as_object_mut() {
        m.insert("sequence_number".into(), json!(*seq));
        if kind.starts_with("response.output_item.") {
            m.insert("output_index".into(), json!(0));
        }
        if kind.starts_with("response.content_part.") || kind.starts_with("response.output_text.") {
            m.insert("output_index".into(), json!(0));
            m.insert("content_index".into(), json!(0));
        }
    }
    *seq += 1;
    SseEvent::default().event(kind).data(data.to_string())
}

/// The streamed answer, event for event as llama-server's.
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
        text_started: bool,
        text: String,
        done: bool,
    }
    let ids = std::sync::Arc::new(ids);
    let init = S {
        rx,
        pending: std::collections::VecDeque::new(),
        seq: 0,
        created: false,
        text_started: false,
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
                let delta = |s: &mut S, text: &str| {
                    if text.is_empty() {
                        return;
                    }
                    if !s.text_started {
                        s.text_started = true;
                        s.pending.push_back(json!({
                            "type": "response.output_item.added",
                            "item": {"content": [], "id": ids.msg, "role": "assistant", "status": "in_progress", "type": "message"},
                        }));
                        s.pending.push_back(json!({
                            "type": "response.content_part.added",
                            "item_id": ids.msg,
                            "part": {"type": "output_text", "text": ""},
                        }));
                    }
                    s.text.push_str(text);
                    s.pending.push_back(json!({
                        "type": "response.output_text.delta", "item_id": ids.msg, "delta": text,
                    }));
                };
                match ev {
                    Event::Delta(d) => delta(&mut s, &d.text),
                    Event::Done(sum) => {
                        delta(&mut s, &sum.tail);
                        s.done = true;
                        st.metrics
                            .request_done(Outcome::Success, t0.elapsed().as_secs_f64());
                        let out = output(&ids, &s.text);
                        if !s.text.is_empty() {
                            s.pending.push_back(json!({
                                "type": "response.output_text.done", "item_id": ids.msg, "text": s.text,
                            }));
                            s.pending.push_back(json!({
                                "type": "response.content_part.done", "item_id": ids.msg, "part": text_part(&s.text),
                            }));
                            s.pending.push_back(json!({
                                "type": "response.output_item.done", "item": out[0],
                            }));
                        }
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
