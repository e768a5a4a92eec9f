//! The Anthropic Messages API: `POST /v1/messages` and `POST /v1/messages/count_tokens`, as
//! llama-server serves them (`tools/server/server-chat.cpp`
//! `server_chat_convert_anthropic_to_oai`, `server-task.cpp` `to_json_anthropic*`).
//!
//! A request is converted to the chat-completions conversation llama-server builds from it
//! (`system` as a system message, `text` blocks as content parts, `thinking` blocks as
//! `reasoning_content`, `tool_use` blocks as tool calls, `tool_result` blocks as `tool`
//! messages, `tools[].input_schema` as function parameters, `tool_choice` `any`/`tool` as
//! `required`, `stop_sequences` as `stop`, `max_tokens` 4096 when absent), so the same
//! request renders the same prompt through the model's chat template. The answer is read
//! back as in chat completions (thoughts, `<tool_call>` blocks) and written as Anthropic
//! content blocks: `thinking`, `text`, `tool_use`. Streamed, it is Anthropic's event
//! sequence: `message_start`, per block `content_block_start` / `content_block_delta`
//! (`thinking_delta`, `text_delta`, `input_json_delta`) / `content_block_stop`, then
//! `message_delta` (stop reason, output tokens) and `message_stop`.
//!
//! `stop_reason` is llama-server's: `max_tokens` when the limit ended the answer, else
//! `tool_use` with tool calls and `end_turn` without (a stop sequence also ends the turn,
//! named in `stop_sequence`). Errors are llama-server's bodies (`error.code`, `.message`,
//! `.type`) with Anthropic's `"type": "error"` beside them, so both kinds of client read them.

use std::convert::Infallible;
use std::time::Instant;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::StatusCode;
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use minijinja::Value as JValue;
use minijinja::value::ValueKind;
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::sync::mpsc;

use crate::api::{Common, Kind, Stop, error_body};
use crate::http::{
    ApiError, AppState, body_bytes, collect, encode, job, model_name, parse, submit,
};
use crate::metrics::Outcome;
use crate::tools::{
    Conversation, Diff, OutputFormat, ParsedMessage, StreamParser, TmplMessage, TmplTool,
    TmplToolCall, ToolChoice, field, items, join_text_parts, ordered, parse_final, str_field,
    to_json_text,
};
use crate::worker::{Event, Summary};

/// The Anthropic routes (merged into the application by `http::router`).
pub(crate) fn routes() -> Router<AppState> {
    Router::new()
        .route("/v1/messages", post(messages))
        .route("/v1/messages/count_tokens", post(count_tokens))
}

/// The sampling fields of a Messages request (the rest is read by [`conversation`]).
#[derive(Debug, Default, Deserialize)]
struct MessagesRequest {
    model: Option<String>,
    max_tokens: Option<i64>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<i64>,
    stop_sequences: Option<Vec<String>>,
    #[serde(default)]
    stream: bool,
}

impl MessagesRequest {
    /// The chat-completions fields llama-server turns these into.
    fn common(&self) -> Common {
        Common {
            model: self.model.clone(),
            stream: self.stream,
            max_tokens: Some(self.max_tokens.unwrap_or(4096)),
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            stop: self.stop_sequences.clone().map(Stop::Many),
            ..Common::default()
        }
    }
}

/// An error as the Messages API answers it: llama-server's body with `"type": "error"`.
fn error_response(e: &ApiError) -> Response {
    let status = StatusCode::from_u16(e.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut body = error_value(e.status, &e.msg);
    if let Some((n_prompt, n_ctx)) = e.exceed {
        body["error"]["type"] = json!("exceed_context_size_error");
        body["error"]["n_prompt_tokens"] = json!(n_prompt);
        body["error"]["n_ctx"] = json!(n_ctx);
    }
    (status, axum::Json(body)).into_response()
}

fn error_value(status: u16, msg: &str) -> Value {
    let mut body = error_body(status, msg);
    body["type"] = json!("error");
    body
}

fn fail(st: &AppState, t0: Instant, e: &ApiError) -> Response {
    st.metrics
        .request_done(Outcome::Error, t0.elapsed().as_secs_f64());
    tracing::info!(status = e.status, "request refused: {}", e.msg);
    error_response(e)
}

/// The text of a `system` value: a string, or its `text` blocks run together.
fn system_text(v: &JValue) -> String {
    match v.kind() {
        ValueKind::String => v.as_str().unwrap_or("").to_owned(),
        ValueKind::Seq => items(v)
            .iter()
            .filter(|b| str_field(b, "type").as_deref() == Some("text"))
            .filter_map(|b| str_field(b, "text"))
            .collect(),
        _ => String::new(),
    }
}

/// The conversation llama-server builds from a Messages request.
fn conversation(body: &JValue) -> Result<Conversation, ApiError> {
    let mut messages = Vec::new();
    if let Some(system) = field(body, "system") {
        messages.push(TmplMessage::new("system", system_text(&system)));
    }
    let list = field(body, "messages").ok_or_else(|| ApiError::bad("'messages' is required"))?;
    for m in items(&list) {
        let role = str_field(&m, "role").unwrap_or_default();
        let content = match m.get_attr("content") {
            Ok(c) if !c.is_undefined() => c,
            _ if role == "assistant" => continue,
            _ => {
                return Err(ApiError::bad(
                    "All non-assistant messages must contain 'content'",
                ));
            }
        };
        match content.kind() {
            ValueKind::String => {
                messages.push(TmplMessage::new(role, content.as_str().unwrap_or("")));
                continue;
            }
            ValueKind::Seq => {}
            ValueKind::None => {
                messages.push(TmplMessage::new(role, ""));
                continue;
            }
            _ => {
                return Err(ApiError::bad(
                    "Expected 'content' to be a string or an array",
                ));
            }
        }
        let mut parts = Vec::new();
        let mut reasoning = String::new();
        let mut calls = Vec::new();
        let mut results = Vec::new();
        for block in items(&content) {
            match str_field(&block, "type").as_deref().unwrap_or("") {
                "text" => parts.push(block),
                "thinking" => {
                    reasoning.push_str(&str_field(&block, "thinking").unwrap_or_default())
                }
                "tool_use" => calls.push(TmplToolCall::new(
                    str_field(&block, "id").filter(|s| !s.is_empty()),
                    str_field(&block, "name").unwrap_or_default(),
                    field(&block, "input").unwrap_or_else(|| {
                        JValue::from_iter(std::iter::empty::<(String, JValue)>())
                    }),
                )),
                "tool_result" => {
                    let text = match field(&block, "content") {
                        Some(c) if c.kind() == ValueKind::String => {
                            c.as_str().unwrap_or("").to_owned()
                        }
                        Some(c) if c.kind() == ValueKind::Seq => items(&c)
                            .iter()
                            .filter(|b| str_field(b, "type").as_deref() == Some("text"))
                            .filter_map(|b| str_field(b, "text"))
                            .collect(),
                        _ => String::new(),
                    };
                    let mut msg = TmplMessage::new("tool", text);
                    msg.tool_call_id = str_field(&block, "tool_use_id").filter(|s| !s.is_empty());
                    results.push(msg);
                }
                // Images need a multimodal model; other blocks carry nothing to render.
                _ => {}
            }
        }
        if !parts.is_empty() || !calls.is_empty() || !reasoning.is_empty() {
            let mut msg = TmplMessage::new(role, join_text_parts(&parts));
            msg.tool_calls = calls;
            msg.reasoning_content = (!reasoning.is_empty()).then_some(reasoning);
            messages.push(msg);
        }
        messages.extend(results);
    }
    let mut tools = Vec::new();
    for t in field(body, "tools").as_ref().map(items).unwrap_or_default() {
        tools.push(TmplTool::new(
            str_field(&t, "name").unwrap_or_default(),
            str_field(&t, "description").unwrap_or_default(),
            field(&t, "input_schema")
                .unwrap_or_else(|| JValue::from_iter(std::iter::empty::<(String, JValue)>())),
        ));
    }
    let choice = field(body, "tool_choice");
    let (tool_choice, forced) = match choice
        .as_ref()
        .and_then(|c| str_field(c, "type"))
        .as_deref()
    {
        Some("any") => (ToolChoice::Required, None),
        Some("tool") => (
            ToolChoice::Required,
            choice.as_ref().and_then(|c| str_field(c, "name")),
        ),
        Some("none") => (ToolChoice::None, None),
        _ => (ToolChoice::Auto, None),
    };
    if let Some(name) = &forced
        && !tools.iter().any(|t| t.name() == name)
    {
        return Err(ApiError::bad(format!(
            "tool_choice names the tool `{name}`, which is not among the request's tools"
        )));
    }
    // Anthropic's `disable_parallel_tool_use`.
    let parallel_tool_calls = !choice
        .as_ref()
        .and_then(|c| field(c, "disable_parallel_tool_use"))
        .is_some_and(|v| v.is_true());
    Ok(Conversation {
        messages,
        tools,
        tool_choice,
        forced,
        parallel_tool_calls,
        reasoning: None,
    })
}

/// A request read: its fields as the other endpoints', the prompt's tokens and how to read
/// the answer.
type Prepared = (Common, Vec<u32>, OutputFormat);

/// The request read: sampling fields (and the call a `tool_choice` requires), the prompt's
/// tokens and how to read the answer.
fn prepare(st: &AppState, bytes: &[u8]) -> Result<Prepared, ApiError> {
    let req: MessagesRequest = parse(bytes)?;
    let template = st
        .template
        .as_ref()
        .ok_or_else(|| ApiError::bad("this model has no usable chat template"))?;
    let conv = conversation(&ordered(bytes)?)?;
    let text = conv.render(template)?;
    let format = conv.output_format(st.limits.reasoning_format, st.limits.template_thinks, &text);
    let prompt = encode(&st.tokenizer, &text)?;
    let mut common = req.common();
    common.structured.tools = conv.required_call();
    Ok((common, prompt, format))
}

/// `POST /v1/messages/count_tokens`: the prompt's length, `{"input_tokens": n}`.
async fn count_tokens(State(st): State<AppState>, body: Result<Bytes, BytesRejection>) -> Response {
    let t0 = Instant::now();
    match body_bytes(&st, body).and_then(|b| prepare(&st, &b)) {
        Ok((_, prompt, _)) => axum::Json(json!({"input_tokens": prompt.len()})).into_response(),
        Err(e) => fail(&st, t0, &e),
    }
}

/// `stop_reason` as llama-server writes it.
fn stop_reason(s: &Summary, tool_calls: bool) -> &'static str {
    match (s.finish_reason, tool_calls) {
        ("length", _) => "max_tokens",
        (_, true) => "tool_use",
        _ => "end_turn",
    }
}

fn stop_sequence(s: &Summary) -> Value {
    if s.stopping_word.is_empty() {
        Value::Null
    } else {
        json!(s.stopping_word)
    }
}

fn usage(s: &Summary) -> Value {
    json!({
        "cache_read_input_tokens": s.cached_tokens,
        "input_tokens": s.prompt_tokens - s.cached_tokens,
        "output_tokens": s.completion_tokens,
    })
}

/// A tool call's arguments as the `input` object (`{}` when they are not JSON).
fn input_of(arguments: &str) -> JValue {
    crate::tools::parse_ordered(arguments)
        .unwrap_or_else(|_| JValue::from_iter(std::iter::empty::<(String, JValue)>()))
}

/// The content blocks of an answer: thinking, text, then one `tool_use` per call.
fn content_blocks(m: &ParsedMessage) -> Vec<Value> {
    let mut blocks = Vec::new();
    if !m.reasoning.is_empty() {
        blocks.push(json!({"type": "thinking", "thinking": m.reasoning, "signature": ""}));
    }
    if !m.content.is_empty() {
        blocks.push(json!({"type": "text", "text": m.content}));
    }
    for c in &m.tool_calls {
        let input: Value =
            serde_json::from_str(&to_json_text(&input_of(&c.arguments))).unwrap_or(json!({}));
        blocks.push(json!({"type": "tool_use", "id": c.id, "name": c.name, "input": input}));
    }
    blocks
}

/// What a streamed answer is named and stamped with.
#[derive(Clone)]
struct Head {
    id: String,
    model: String,
    format: OutputFormat,
    /// Prompt tokens (`message_start` is sent before the slot reports its cache reuse).
    n_prompt: usize,
}

async fn messages(State(st): State<AppState>, body: Result<Bytes, BytesRejection>) -> Response {
    let t0 = Instant::now();
    let (common, prompt, format) = match body_bytes(&st, body).and_then(|b| prepare(&st, &b)) {
        Ok(p) => p,
        Err(e) => return fail(&st, t0, &e),
    };
    let (tx, mut rx) = mpsc::unbounded_channel();
    let n_prompt = prompt.len();
    let job = match job(&st, &common, prompt, Kind::Chat, tx) {
        Ok(j) => j,
        Err(e) => return fail(&st, t0, &e),
    };
    let head = Head {
        id: job.id.clone(),
        model: model_name(&st, common.model.as_ref()),
        format,
        n_prompt,
    };
    if let Err(e) = submit(&st, job) {
        return fail(&st, t0, &e);
    }
    if common.stream {
        return stream(st, head, rx, t0).into_response();
    }
    match collect(&st, &mut rx, t0, |_| {}).await {
        Ok((text, s)) => {
            st.metrics
                .request_done(Outcome::Success, t0.elapsed().as_secs_f64());
            let m = parse_final(&text, head.format);
            axum::Json(json!({
                "id": head.id,
                "type": "message",
                "role": "assistant",
                "content": content_blocks(&m),
                "model": head.model,
                "stop_reason": stop_reason(&s, !m.tool_calls.is_empty()),
                "stop_sequence": stop_sequence(&s),
                "usage": usage(&s),
            }))
            .into_response()
        }
        Err(e) => error_response(&e),
    }
}

/// Which content blocks a stream has opened, and where they are.
#[derive(Debug, Default)]
struct Blocks {
    thinking: bool,
    text: bool,
    /// Tool calls whose block has started.
    tools: usize,
}

impl Blocks {
    fn text_index(&self) -> usize {
        usize::from(self.thinking)
    }

    fn tool_index(&self, call: usize) -> usize {
        usize::from(self.thinking) + usize::from(self.text) + call
    }

    /// The events of one difference of the parsed answer.
    fn events(&mut self, d: &Diff, out: &mut Vec<(&'static str, Value)>) {
        if !d.reasoning.is_empty() {
            if !self.thinking {
                self.thinking = true;
                out.push((
                    "content_block_start",
                    json!({
                        "type": "content_block_start", "index": 0,
                        "content_block": {"type": "thinking", "thinking": ""},
                    }),
                ));
            }
            out.push((
                "content_block_delta",
                json!({
                    "type": "content_block_delta", "index": 0,
                    "delta": {"type": "thinking_delta", "thinking": d.reasoning},
                }),
            ));
        }
        if !d.content.is_empty() {
            if !self.text {
                self.text = true;
                out.push((
                    "content_block_start",
                    json!({
                        "type": "content_block_start", "index": self.text_index(),
                        "content_block": {"type": "text", "text": ""},
                    }),
                ));
            }
            out.push((
                "content_block_delta",
                json!({
                    "type": "content_block_delta", "index": self.text_index(),
                    "delta": {"type": "text_delta", "text": d.content},
                }),
            ));
        }
        if let Some((i, c)) = &d.tool_call {
            let index = self.tool_index(*i);
            if !c.name.is_empty() {
                self.tools = self.tools.max(i + 1);
                out.push((
                    "content_block_start",
                    json!({
                        "type": "content_block_start", "index": index,
                        "content_block": {"type": "tool_use", "id": c.id, "name": c.name},
                    }),
                ));
            }
            if !c.arguments.is_empty() {
                out.push((
                    "content_block_delta",
                    json!({
                        "type": "content_block_delta", "index": index,
                        "delta": {"type": "input_json_delta", "partial_json": c.arguments},
                    }),
                ));
            }
        }
    }

    /// The closing events: each block stopped (a thought first gets its empty signature).
    fn close(&self, m: &ParsedMessage, out: &mut Vec<(&'static str, Value)>) {
        if self.thinking {
            out.push((
                "content_block_delta",
                json!({
                    "type": "content_block_delta", "index": 0,
                    "delta": {"type": "signature_delta", "signature": ""},
                }),
            ));
            out.push((
                "content_block_stop",
                json!({"type": "content_block_stop", "index": 0}),
            ));
        }
        if self.text {
            out.push((
                "content_block_stop",
                json!({
                    "type": "content_block_stop", "index": self.text_index(),
                }),
            ));
        }
        for i in 0..m.tool_calls.len().max(self.tools) {
            out.push((
                "content_block_stop",
                json!({
                    "type": "content_block_stop", "index": self.tool_index(i),
                }),
            ));
        }
    }
}

/// The SSE answer: Anthropic's named events.
fn stream(
    st: AppState,
    head: Head,
    rx: mpsc::UnboundedReceiver<Event>,
    t0: Instant,
) -> Sse<impl futures_util::Stream<Item = Result<SseEvent, Infallible>>> {
    struct S {
        rx: mpsc::UnboundedReceiver<Event>,
        pending: std::collections::VecDeque<SseEvent>,
        done: bool,
        started: bool,
        parser: StreamParser,
        blocks: Blocks,
    }
    let init = S {
        rx,
        pending: std::collections::VecDeque::new(),
        done: false,
        started: false,
        parser: StreamParser::new(head.format),
        blocks: Blocks::default(),
    };
    let ev = |name: &str, v: &Value| SseEvent::default().event(name).data(v.to_string());
    let s = futures_util::stream::unfold(init, move |mut s| {
        let head = head.clone();
        let st = st.clone();
        async move {
            loop {
                if let Some(e) = s.pending.pop_front() {
                    return Some((Ok(e), s));
                }
                if s.done {
                    return None;
                }
                let mut out = Vec::new();
                match s.rx.recv().await {
                    Some(Event::Delta(d)) => {
                        for diff in s.parser.push(&d.text) {
                            s.blocks.events(&diff, &mut out);
                        }
                        s.pending.extend(out.iter().map(|(n, v)| ev(n, v)));
                    }
                    Some(Event::Done(sum)) => {
                        if !s.started {
                            // An answer of no tokens still opens the message.
                            s.started = true;
                            s.pending
                                .push_front(ev("message_start", &message_start(&head, &sum)));
                        }
                        let (diffs, m) = s.parser.finish(&sum.tail);
                        for diff in &diffs {
                            s.blocks.events(diff, &mut out);
                        }
                        s.blocks.close(&m, &mut out);
                        out.push((
                            "message_delta",
                            json!({
                                "type": "message_delta",
                                "delta": {
                                    "stop_reason": stop_reason(&sum, !m.tool_calls.is_empty()),
                                    "stop_sequence": stop_sequence(&sum),
                                },
                                "usage": {"output_tokens": sum.completion_tokens},
                            }),
                        ));
                        out.push(("message_stop", json!({"type": "message_stop"})));
                        s.pending.extend(out.iter().map(|(n, v)| ev(n, v)));
                        s.done = true;
                        st.metrics
                            .request_done(Outcome::Success, t0.elapsed().as_secs_f64());
                    }
                    Some(Event::Error(status, msg)) => {
                        s.pending.push_back(ev("error", &error_value(status, &msg)));
                        s.done = true;
                        if status != 504 {
                            st.metrics
                                .request_done(Outcome::Error, t0.elapsed().as_secs_f64());
                        }
                    }
                    None => return None,
                }
                if !s.started && !s.pending.is_empty() {
                    s.started = true;
                    s.pending
                        .push_front(ev("message_start", &message_start_early(&head)));
                }
            }
        }
    });
    Sse::new(s)
}

/// `message_start`, sent with the first events: the prompt's tokens all count as input (the
/// slot's cache reuse is known only at the end).
fn message_start_early(head: &Head) -> Value {
    json!({
        "type": "message_start",
        "message": {
            "id": head.id, "type": "message", "role": "assistant", "content": [],
            "model": head.model, "stop_reason": null, "stop_sequence": null,
            "usage": {"cache_read_input_tokens": 0, "input_tokens": head.n_prompt, "output_tokens": 0},
        },
    })
}

fn message_start(head: &Head, s: &Summary) -> Value {
    let mut v = message_start_early(head);
    v["message"]["usage"] = json!({
        "cache_read_input_tokens": s.cached_tokens,
        "input_tokens": s.prompt_tokens - s.cached_tokens,
        "output_tokens": 0,
    });
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conv(body: &str) -> Conversation {
        conversation(&ordered(body.as_bytes()).unwrap()).unwrap()
    }

    #[test]
    fn a_request_becomes_llama_servers_conversation() {
        let c = conv(
            r#"{"system": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
                "messages": [
                  {"role": "user", "content": "Weather?"},
                  {"role": "assistant", "content": [
                     {"type": "thinking", "thinking": "use the tool"},
                     {"type": "text", "text": "Checking."},
                     {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"z": 1, "a": 2}}]},
                  {"role": "user", "content": [
                     {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "sunny"}]},
                     {"type": "text", "text": "Thanks"}]}],
                "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}],
                "tool_choice": {"type": "any"}}"#,
        );
        let roles: Vec<&str> = c.messages.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ["system", "user", "assistant", "user", "tool"]);
        assert_eq!(c.messages[0].content, "Be brief.");
        let a = &c.messages[2];
        assert_eq!(a.content, "Checking.");
        assert_eq!(a.reasoning_content.as_deref(), Some("use the tool"));
        let call = serde_json::to_value(&a.tool_calls[0]).unwrap();
        assert_eq!(call["id"], "t1");
        assert_eq!(call["function"]["name"], "get_weather");
        // The input object keeps the request's key order for the template.
        let args = serde_json::to_string(&a.tool_calls[0]).unwrap();
        assert!(args.contains(r#"{"z":1,"a":2}"#), "{args}");
        assert_eq!(c.messages[3].content, "Thanks");
        assert_eq!(c.messages[4].content, "sunny");
        assert_eq!(c.messages[4].tool_call_id.as_deref(), Some("t1"));
        assert_eq!(c.tools.len(), 1);
        assert_eq!(c.tool_choice, ToolChoice::Required);
    }

    #[test]
    fn tool_choice_any_tool_and_none_become_the_required_call() {
        let body = |choice: &str| {
            format!(
                r#"{{"messages": [{{"role": "user", "content": "hi"}}],
                    "tools": [{{"name": "a", "input_schema": {{"type": "object"}}}},
                              {{"name": "b", "input_schema": {{"type": "object"}}}}],
                    "tool_choice": {choice}}}"#
            )
        };
        let names = |c: &Conversation| match c.required_call() {
            Some(specula_grammar::Spec::ToolCalls(t)) => Some((
                t.tools.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>(),
                t.parallel,
            )),
            _ => None,
        };
        let any = conv(&body(r#"{"type": "any"}"#));
        assert_eq!(names(&any), Some((vec!["a".into(), "b".into()], true)));
        let one = conv(&body(
            r#"{"type": "tool", "name": "b", "disable_parallel_tool_use": true}"#,
        ));
        assert_eq!(names(&one), Some((vec!["b".into()], false)));
        assert_eq!(names(&conv(&body(r#"{"type": "auto"}"#))), None);
        let none = conv(&body(r#"{"type": "none"}"#));
        assert_eq!((none.tool_choice, names(&none)), (ToolChoice::None, None));
        let e =
            conversation(&ordered(body(r#"{"type": "tool", "name": "c"}"#).as_bytes()).unwrap())
                .unwrap_err();
        assert_eq!(e.status, 400);
        assert!(e.msg.contains("`c`"), "{}", e.msg);
    }

    #[test]
    fn messages_are_required_and_content_must_be_there() {
        let e = conversation(&ordered(br#"{"max_tokens": 4}"#).unwrap()).unwrap_err();
        assert_eq!((e.status, e.msg.as_str()), (400, "'messages' is required"));
        let e =
            conversation(&ordered(br#"{"messages": [{"role": "user"}]}"#).unwrap()).unwrap_err();
        assert_eq!(e.status, 400);
        // An assistant turn without content is skipped.
        let c = conv(r#"{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant"}]}"#);
        assert_eq!(c.messages.len(), 1);
    }

    #[test]
    fn blocks_come_thinking_text_then_tool_use() {
        let m = ParsedMessage {
            reasoning: "r".into(),
            content: "c".into(),
            tool_calls: vec![crate::tools::ToolCall {
                id: "x".into(),
                name: "f".into(),
                arguments: r#"{"a": 1}"#.into(),
            }],
        };
        let b = content_blocks(&m);
        let kinds: Vec<&str> = b.iter().map(|v| v["type"].as_str().unwrap()).collect();
        assert_eq!(kinds, ["thinking", "text", "tool_use"]);
        assert_eq!(b[2]["input"], json!({"a": 1}));
        let mut blocks = Blocks::default();
        let mut out = Vec::new();
        blocks.events(
            &Diff {
                reasoning: "r".into(),
                ..Diff::default()
            },
            &mut out,
        );
        blocks.events(
            &Diff {
                content: "c".into(),
                ..Diff::default()
            },
            &mut out,
        );
        blocks.events(
            &Diff {
                tool_call: Some((0, m.tool_calls[0].clone())),
                ..Diff::default()
            },
            &mut out,
        );
        blocks.close(&m, &mut out);
        let idx: Vec<(&str, i64)> = out
            .iter()
            .map(|(n, v)| (*n, v["index"].as_i64().unwrap_or(-1)))
            .collect();
        assert_eq!(
            idx,
            [
                ("content_block_start", 0),
                ("content_block_delta", 0),
                ("content_block_start", 1),
                ("content_block_delta", 1),
                ("content_block_start", 2),
                ("content_block_delta", 2),
                ("content_block_delta", 0),
                ("content_block_stop", 0),
                ("content_block_stop", 1),
                ("content_block_stop", 2),
            ]
        );
    }
}
