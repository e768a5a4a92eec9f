//! Tool calling and reasoning in chat completions, as llama-server does them
//! (`tools/server/server-common.cpp` `oaicompat_chat_params_parse`, `common/chat.cpp`):
//!
//! - The request's `messages` (assistant `tool_calls`, `role: "tool"` results, reasoning) and
//!   `tools` become the variables of the model's Jinja chat template in llama.cpp's shape:
//!   each message `{role, content, reasoning_content?, name?, tool_call_id?, tool_calls?}`
//!   with `content` a string (text parts joined by newlines) and tool-call `arguments` parsed
//!   into an object; each tool `{type: "function", function: {name, description,
//!   parameters}}`. JSON objects keep the key order of the request (the body is read into
//!   order-keeping minijinja values), so `tojson` prints tool schemas as llama.cpp does.
//! - The model's output is parsed back: a leading `<think>…</think>` becomes
//!   `reasoning_content` (`reasoning_format` `deepseek`, or `auto` for templates that think),
//!   Hermes / Qwen-style `<tool_call>{"name": …, "arguments": …}</tool_call>` blocks become
//!   `tool_calls`, their `arguments` the JSON text as written; the text before the first
//!   call is the content as written, whitespace between and after calls is dropped (a block
//!   whose JSON does not parse stays in the content: llama-server answers such output with a
//!   500).
//! - Streamed, the output so far is parsed after every token and the difference to the
//!   previous parse is sent, as llama-server's `compute_diffs` does: reasoning and content
//!   deltas, a tool call's first delta with its `index`, `id`, `type` and `name`, then its
//!   `arguments` in pieces.

use minijinja::Value as JValue;
use minijinja::value::ValueKind;
use serde::Serialize;
use serde_json::{Value, json};
use specula_tokenizer::ChatTemplate;

use crate::http::ApiError;

/// What becomes of `<think>…</think>` in a chat answer (`--reasoning-format`, or the
/// request's `reasoning_format`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ReasoningFormat {
    /// Left in the content.
    None,
    /// Split into `reasoning_content` (`deepseek`, `deepseek-legacy`).
    Deepseek,
    /// `deepseek` for chat templates that think (whose source holds `<think>`), else `none`.
    #[default]
    Auto,
}

impl ReasoningFormat {
    /// llama.cpp's names: `none`, `deepseek`, `deepseek-legacy`, `auto`.
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "none" => Some(Self::None),
            "deepseek" | "deepseek-legacy" => Some(Self::Deepseek),
            "auto" => Some(Self::Auto),
            _ => None,
        }
    }
}

/// `tool_choice` (a string, as llama-server reads it; an object counts as `auto`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ToolChoice {
    Auto,
    None,
    Required,
}

/// A message as the chat template sees it (llama.cpp's `to_json_oaicompat` field order).
#[derive(Debug, Serialize)]
pub(crate) struct TmplMessage {
    pub role: String,
    pub content: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<TmplToolCall>,
}

impl TmplMessage {
    pub(crate) fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
            reasoning_content: None,
            name: None,
            tool_call_id: None,
            tool_calls: Vec::new(),
        }
    }
}

/// A tool call of an assistant message.
#[derive(Debug, Serialize)]
pub(crate) struct TmplToolCall {
    #[serde(rename = "type")]
    kind: &'static str,
    function: TmplFunction,
    #[serde(skip_serializing_if = "Option::is_none")]
    id: Option<String>,
}

impl TmplToolCall {
    pub(crate) fn new(id: Option<String>, name: String, arguments: JValue) -> Self {
        Self {
            kind: "function",
            function: TmplFunction { name, arguments },
            id,
        }
    }
}

#[derive(Debug, Serialize)]
struct TmplFunction {
    name: String,
    arguments: JValue,
}

/// A tool as the chat template sees it.
#[derive(Debug, Serialize)]
pub(crate) struct TmplTool {
    #[serde(rename = "type")]
    kind: &'static str,
    function: TmplToolFn,
}

impl TmplTool {
    pub(crate) fn new(name: String, description: String, parameters: JValue) -> Self {
        Self {
            kind: "function",
            function: TmplToolFn {
                name,
                description,
                parameters,
            },
        }
    }

    /// The function's name.
    pub(crate) fn name(&self) -> &str {
        &self.function.name
    }
}

#[derive(Debug, Serialize)]
struct TmplToolFn {
    name: String,
    description: String,
    parameters: JValue,
}

#[derive(Serialize)]
struct Extra<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    tools: Option<&'a [TmplTool]>,
}

/// A chat request's conversation, ready for the template, and how to read the answer.
#[derive(Debug)]
pub(crate) struct Conversation {
    pub messages: Vec<TmplMessage>,
    pub tools: Vec<TmplTool>,
    pub tool_choice: ToolChoice,
    /// The one tool a required call must be (OpenAI's `{"type": "function", "function":
    /// {"name": …}}`, Anthropic's `{"type": "tool", "name": …}`); `None`: any of them.
    pub forced: Option<String>,
    pub parallel_tool_calls: bool,
    /// The request's `reasoning_format`, if it set one.
    pub reasoning: Option<ReasoningFormat>,
}

/// A field that is present and not null.
pub(crate) fn field(v: &JValue, key: &str) -> Option<JValue> {
    v.get_attr(key)
        .ok()
        .filter(|x| !x.is_undefined() && !x.is_none())
}

/// A string field (`None` when absent, null or not a string).
pub(crate) fn str_field(v: &JValue, key: &str) -> Option<String> {
    field(v, key).and_then(|x| x.as_str().map(str::to_owned))
}

/// The elements of a list value (nothing for a value that is not a list).
pub(crate) fn items(v: &JValue) -> Vec<JValue> {
    if v.kind() == ValueKind::Seq {
        v.try_iter().map(Iterator::collect).unwrap_or_default()
    } else {
        Vec::new()
    }
}

/// The body of a request read into order-keeping values.
pub(crate) fn ordered(body: &[u8]) -> Result<JValue, ApiError> {
    serde_json::from_slice(body).map_err(|e| ApiError::bad(format!("invalid JSON body: {e}")))
}

/// Text parts joined as llama.cpp joins them for templates without typed content: with a
/// newline between parts, none before the first non-empty text.
pub(crate) fn join_text_parts(parts: &[JValue]) -> String {
    let mut text = String::new();
    for p in parts {
        if str_field(p, "type").as_deref() != Some("text") {
            continue;
        }
        if !text.is_empty() {
            text.push('\n');
        }
        text.push_str(&str_field(p, "text").unwrap_or_default());
    }
    text
}

/// A JSON text read into an order-keeping value.
pub(crate) fn parse_ordered(text: &str) -> Result<JValue, serde_json::Error> {
    serde_json::from_str(text)
}

/// An order-keeping value written as compact JSON.
pub(crate) fn to_json_text(v: &JValue) -> String {
    serde_json::to_string(v).unwrap_or_else(|_| "{}".into())
}

impl Conversation {
    /// The conversation of an OpenAI chat request (`messages`, `tools`, `tool_choice`,
    /// `parallel_tool_calls`, `reasoning_format`), checked as llama-server checks it.
    pub(crate) fn from_openai(body: &JValue) -> Result<Self, ApiError> {
        let msgs =
            field(body, "messages").ok_or_else(|| ApiError::bad("'messages' is required"))?;
        if msgs.kind() != ValueKind::Seq {
            return Err(ApiError::bad("Expected 'messages' to be an array"));
        }
        let mut messages = Vec::new();
        for m in items(&msgs) {
            let mut role = str_field(&m, "role").unwrap_or_default();
            let content = field(&m, "content");
            let calls = field(&m, "tool_calls");
            if role != "assistant" && m.get_attr("content").is_ok_and(|c| c.is_undefined()) {
                return Err(ApiError::bad(
                    "All non-assistant messages must contain 'content'",
                ));
            }
            if role == "assistant" && content.is_none() && calls.is_none() {
                return Err(ApiError::bad(
                    "Assistant message must contain either 'content' or 'tool_calls'!",
                ));
            }
            let text = match &content {
                None => String::new(),
                Some(c) if c.kind() == ValueKind::String => c.as_str().unwrap_or("").to_owned(),
                Some(c) if c.kind() == ValueKind::Seq => join_text_parts(&items(c)),
                Some(_) => {
                    return Err(ApiError::bad(
                        "Expected 'content' to be a string or an array",
                    ));
                }
            };
            if role == "developer" {
                role = "system".into();
            }
            let mut msg = TmplMessage::new(role, text);
            msg.reasoning_content = str_field(&m, "reasoning_content").filter(|s| !s.is_empty());
            msg.name = str_field(&m, "name").filter(|s| !s.is_empty());
            msg.tool_call_id = str_field(&m, "tool_call_id").filter(|s| !s.is_empty());
            for c in calls.as_ref().map(items).unwrap_or_default() {
                let f = field(&c, "function").unwrap_or_default();
                let name = str_field(&f, "name").unwrap_or_default();
                let arguments = match field(&f, "arguments") {
                    None => JValue::from_iter(std::iter::empty::<(String, JValue)>()),
                    Some(a) if a.kind() == ValueKind::String => {
                        parse_ordered(a.as_str().unwrap_or("")).map_err(|e| {
                            ApiError::bad(format!(
                                "Failed to parse tool call arguments as JSON: {e}"
                            ))
                        })?
                    }
                    Some(a) => a,
                };
                let id = str_field(&c, "id").filter(|s| !s.is_empty());
                msg.tool_calls.push(TmplToolCall::new(id, name, arguments));
            }
            messages.push(msg);
        }
        let mut tools = Vec::new();
        for t in field(body, "tools").as_ref().map(items).unwrap_or_default() {
            let f = field(&t, "function").unwrap_or_default();
            let name = str_field(&f, "name")
                .ok_or_else(|| ApiError::bad("each tool needs `function.name` (a string)"))?;
            tools.push(TmplTool::new(
                name,
                str_field(&f, "description").unwrap_or_default(),
                field(&f, "parameters").unwrap_or_else(empty_object),
            ));
        }
        let mut forced = None;
        let tool_choice = match field(body, "tool_choice") {
            Some(c) if c.kind() == ValueKind::String => match c.as_str().unwrap_or("") {
                "auto" => ToolChoice::Auto,
                "none" => ToolChoice::None,
                "required" => ToolChoice::Required,
                other => return Err(ApiError::bad(format!("Invalid tool_choice: {other}"))),
            },
            // OpenAI's named function: that call is required (llama-server reads any object
            // as `auto`).
            Some(c) if c.kind() == ValueKind::Map => {
                match field(&c, "function").and_then(|f| str_field(&f, "name")) {
                    Some(name) => {
                        if !tools.iter().any(|t| t.name() == name) {
                            return Err(ApiError::bad(format!(
                                "tool_choice names the function `{name}`, which is not among the request's tools"
                            )));
                        }
                        forced = Some(name);
                        ToolChoice::Required
                    }
                    None => ToolChoice::Auto,
                }
            }
            _ => ToolChoice::Auto,
        };
        let parallel_tool_calls = field(body, "parallel_tool_calls").is_none_or(|v| v.is_true());
        let reasoning = match str_field(body, "reasoning_format") {
            None => None,
            Some(name) => Some(ReasoningFormat::from_name(&name).ok_or_else(|| {
                ApiError::bad(format!(
                    "Unknown reasoning format: {name} (use none, deepseek, deepseek-legacy or auto)"
                ))
            })?),
        };
        Ok(Self {
            messages,
            tools,
            tool_choice,
            forced,
            parallel_tool_calls,
            reasoning,
        })
    }

    /// The prompt text: the conversation through the template, with the generation prompt.
    pub(crate) fn render(&self, template: &ChatTemplate) -> Result<String, ApiError> {
        let extra = Extra {
            tools: (!self.tools.is_empty()).then_some(self.tools.as_slice()),
        };
        template
            .render_with(&self.messages, true, extra)
            .map_err(|e| ApiError::bad(format!("the chat template failed on these messages: {e}")))
    }

    /// The grammar of the call the conversation requires: `tool_choice` `required` with
    /// tools (llama-server constrains such an answer to end in a call of one of them, with
    /// arguments that follow its parameter schema).
    pub(crate) fn required_call(&self) -> Option<specula_grammar::Spec> {
        if self.tool_choice != ToolChoice::Required || self.tools.is_empty() {
            return None;
        }
        let tools = self
            .tools
            .iter()
            .filter(|t| self.forced.as_ref().is_none_or(|f| *f == t.function.name))
            .map(|t| {
                let params = serde_json::to_value(&t.function.parameters).unwrap_or(Value::Null);
                (t.function.name.clone(), params)
            })
            .collect();
        Some(specula_grammar::Spec::ToolCalls(
            specula_grammar::ToolCalls {
                tools,
                parallel: self.parallel_tool_calls,
            },
        ))
    }

    /// How the answer to this conversation is read: tool calls parsed when tools were given
    /// (and `tool_choice` is not `none`), thoughts split per `server_default` unless the
    /// request chose.
    pub(crate) fn output_format(
        &self,
        server_default: ReasoningFormat,
        template_thinks: bool,
        prompt: &str,
    ) -> OutputFormat {
        let think = match self.reasoning.unwrap_or(server_default) {
            ReasoningFormat::None => false,
            ReasoningFormat::Deepseek => true,
            ReasoningFormat::Auto => template_thinks,
        };
        OutputFormat {
            tools: !self.tools.is_empty() && self.tool_choice != ToolChoice::None,
            parallel: self.parallel_tool_calls,
            think,
            think_open: think && prompt.trim_end().ends_with("<think>"),
        }
    }
}

fn empty_object() -> JValue {
    JValue::from_iter(std::iter::empty::<(String, JValue)>())
}

/// How a chat answer's text is read back.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct OutputFormat {
    /// Parse `<tool_call>` blocks.
    pub tools: bool,
    /// More than one call (`parallel_tool_calls`); without, blocks after the first stay text.
    pub parallel: bool,
    /// Split a leading `<think>…</think>` into reasoning.
    pub think: bool,
    /// The prompt opened the thought (`<think>` ends the generation prompt), so the answer
    /// starts inside it.
    pub think_open: bool,
}

impl OutputFormat {
    /// Whether the text needs reading at all (else it is all content).
    pub(crate) fn parses(self) -> bool {
        self.tools || self.think
    }
}

/// One parsed tool call.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct ToolCall {
    pub id: String,
    pub name: String,
    /// The arguments as JSON text (as the model wrote them).
    pub arguments: String,
}

/// An answer read back: thoughts, content and tool calls.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct ParsedMessage {
    pub reasoning: String,
    pub content: String,
    pub tool_calls: Vec<ToolCall>,
}

const THINK_OPEN: &str = "<think>";
const THINK_CLOSE: &str = "</think>";
const CALL_OPEN: &str = "<tool_call>";
const CALL_CLOSE: &str = "</tool_call>";

/// The length of the longest ending of `s` that begins `tag` (text that could still become
/// `tag`, held back while streaming).
fn partial_tag_len(s: &str, tag: &str) -> usize {
    (1..tag.len().min(s.len() + 1))
        .rev()
        .find(|&k| s.ends_with(&tag[..k]))
        .unwrap_or(0)
}

/// `s` without an ending that could still become `tag`.
fn hold_tag<'a>(s: &'a str, tag: &str) -> &'a str {
    &s[..s.len() - partial_tag_len(s, tag)]
}

/// A `<tool_call>` block's inner text as a call: a JSON object with a string `name` and
/// `arguments` (an object or a JSON string); `None` for anything else.
fn parse_call(inner: &str) -> Option<ToolCall> {
    let v: JValue = parse_ordered(inner.trim()).ok()?;
    if v.kind() != ValueKind::Map {
        return None;
    }
    let name = str_field(&v, "name")?;
    let args = field(&v, "arguments").unwrap_or_else(empty_object);
    let arguments = match args.kind() {
        ValueKind::String => args.as_str().unwrap_or("").to_owned(),
        _ => raw_arguments(inner).unwrap_or_else(|| to_json_text(&args)),
    };
    Some(ToolCall {
        id: String::new(),
        name,
        arguments,
    })
}

/// Where the value of `"arguments"` begins in a call's text.
fn arguments_start(inner: &str) -> Option<usize> {
    let k = inner.find("\"arguments\"")?;
    let rest = &inner[k + "\"arguments\"".len()..];
    let colon = rest.find(':')?;
    if !rest[..colon].trim().is_empty() {
        return None;
    }
    let after = &rest[colon + 1..];
    let ws = after.len() - after.trim_start().len();
    Some(k + "\"arguments\"".len() + colon + 1 + ws)
}

/// The text of the `arguments` object as the model wrote it (the span of one JSON value).
fn raw_arguments(inner: &str) -> Option<String> {
    let start = arguments_start(inner)?;
    let mut de = serde_json::Deserializer::from_str(&inner[start..]).into_iter::<Value>();
    de.next()?.ok()?;
    let end = start + de.byte_offset();
    Some(inner[start..end].to_owned())
}

/// A call whose block is still open (streaming): its name once written, and the arguments
/// written so far without an ending that may still be the block's close.
fn parse_partial_call(inner: &str) -> Option<ToolCall> {
    let t = inner.trim_start();
    let name_key = t.find("\"name\"")?;
    let after = &t[name_key + "\"name\"".len()..];
    let after = after.trim_start().strip_prefix(':')?.trim_start();
    let after = after.strip_prefix('"')?;
    let end = after.find('"')?;
    let name = after[..end].to_owned();
    let arguments = match arguments_start(inner) {
        Some(s) => {
            let raw = hold_tag(&inner[s..], CALL_CLOSE);
            raw.trim_end_matches(|c: char| c.is_whitespace() || c == '}')
                .to_owned()
        }
        None => String::new(),
    };
    Some(ToolCall {
        id: String::new(),
        name,
        arguments,
    })
}

/// Reads `text` (the answer so far, or all of it when `!partial`) per `f`. While partial,
/// text that may still turn into a tag, a call or trimmed whitespace is held back, so each
/// later parse extends the earlier one.
pub(crate) fn parse_output(text: &str, f: OutputFormat, partial: bool) -> ParsedMessage {
    let mut out = ParsedMessage::default();
    let mut rest = text;
    if f.think {
        let lead = rest.trim_start();
        let opened = if f.think_open {
            Some(lead.strip_prefix(THINK_OPEN).unwrap_or(lead))
        } else if let Some(r) = lead.strip_prefix(THINK_OPEN) {
            Some(r)
        } else if partial && !lead.is_empty() && THINK_OPEN.starts_with(lead) {
            // `<thi`: may still open a thought.
            return out;
        } else {
            None
        };
        if let Some(inside) = opened {
            match inside.find(THINK_CLOSE) {
                Some(end) => {
                    out.reasoning = inside[..end].trim().to_owned();
                    rest = inside[end + THINK_CLOSE.len()..].trim_start();
                }
                None => {
                    let r = if partial {
                        hold_tag(inside, THINK_CLOSE).trim_end()
                    } else {
                        inside.trim_end()
                    };
                    out.reasoning = r.trim_start().to_owned();
                    return out;
                }
            }
        }
    }
    if !f.tools {
        rest.clone_into(&mut out.content);
        return out;
    }
    let mut content = String::new();
    loop {
        let open = rest.find(CALL_OPEN);
        let Some(open) = open.filter(|_| f.parallel || out.tool_calls.is_empty()) else {
            content.push_str(rest);
            break;
        };
        let body = &rest[open + CALL_OPEN.len()..];
        match body.find(CALL_CLOSE) {
            Some(close) => match parse_call(&body[..close]) {
                Some(call) => {
                    content.push_str(&rest[..open]);
                    out.tool_calls.push(call);
                    // Whitespace between and after calls is not content (llama-server).
                    rest = body[close + CALL_CLOSE.len()..].trim_start();
                }
                None => {
                    // Not a call: the block stays text.
                    let end = open + CALL_OPEN.len() + close + CALL_CLOSE.len();
                    content.push_str(&rest[..end]);
                    rest = &rest[end..];
                }
            },
            None if partial => {
                content.push_str(&rest[..open]);
                if let Some(call) = parse_partial_call(body) {
                    out.tool_calls.push(call);
                }
                break;
            }
            None => match parse_call(body) {
                // The block was cut (no close): a complete call still counts.
                Some(call) => {
                    content.push_str(&rest[..open]);
                    out.tool_calls.push(call);
                    break;
                }
                None => {
                    content.push_str(rest);
                    break;
                }
            },
        }
    }
    if partial {
        let held = hold_tag(&content, CALL_OPEN).len();
        content.truncate(held);
        let trimmed = content.trim_end().len();
        content.truncate(trimmed);
    }
    out.content = content;
    out
}

/// A fresh tool-call id (llama-server's `gen_tool_call_id`: 32 random letters and digits).
pub(crate) fn tool_call_id() -> String {
    const ALNUM: &[u8] = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
    let mut x = specula_sampling::entropy_seed() | 1;
    (0..32)
        .map(|_| {
            // xorshift64
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ALNUM[usize::try_from(x % 62).unwrap_or(0)] as char
        })
        .collect()
}

/// One difference between two parses of a streamed answer (llama.cpp's
/// `common_chat_msg_diff`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Diff {
    pub reasoning: String,
    pub content: String,
    /// A tool call's index and what changed: `id` and `name` on its first diff, then
    /// `arguments` text.
    pub tool_call: Option<(usize, ToolCall)>,
}

impl Diff {
    /// The OpenAI `delta` object of this difference.
    pub(crate) fn openai_delta(&self) -> Value {
        let mut d = serde_json::Map::new();
        if !self.reasoning.is_empty() {
            d.insert("reasoning_content".into(), json!(self.reasoning));
        }
        if !self.content.is_empty() {
            d.insert("content".into(), json!(self.content));
        }
        if let Some((i, c)) = &self.tool_call {
            let mut tc = json!({"index": i});
            if !c.id.is_empty() {
                tc["id"] = json!(c.id);
                tc["type"] = json!("function");
            }
            if !c.name.is_empty() || !c.arguments.is_empty() {
                let mut f = serde_json::Map::new();
                if !c.name.is_empty() {
                    f.insert("name".into(), json!(c.name));
                }
                if !c.arguments.is_empty() {
                    f.insert("arguments".into(), json!(c.arguments));
                }
                tc["function"] = Value::Object(f);
            }
            d.insert("tool_calls".into(), json!([tc]));
        }
        Value::Object(d)
    }
}

/// The text added to `old` to make `new` (empty when `new` does not extend `old`).
fn string_diff(old: &str, new: &str) -> String {
    new.strip_prefix(old).unwrap_or_default().to_owned()
}

/// A streamed answer, parsed again after every piece.
#[derive(Debug)]
pub(crate) struct StreamParser {
    format: OutputFormat,
    text: String,
    prev: ParsedMessage,
    ids: Vec<String>,
}

impl StreamParser {
    pub(crate) fn new(format: OutputFormat) -> Self {
        Self {
            format,
            text: String::new(),
            prev: ParsedMessage::default(),
            ids: Vec::new(),
        }
    }

    /// Adds generated text; returns the differences to send.
    pub(crate) fn push(&mut self, piece: &str) -> Vec<Diff> {
        self.text.push_str(piece);
        let new = parse_output(&self.text, self.format, true);
        self.advance(new)
    }

    /// The end of the answer: the last differences and the whole message.
    pub(crate) fn finish(&mut self, tail: &str) -> (Vec<Diff>, ParsedMessage) {
        self.text.push_str(tail);
        let new = parse_output(&self.text, self.format, false);
        let diffs = self.advance(new);
        (diffs, self.prev.clone())
    }

    fn advance(&mut self, mut new: ParsedMessage) -> Vec<Diff> {
        for (i, c) in new.tool_calls.iter_mut().enumerate() {
            if self.ids.len() <= i {
                self.ids.push(tool_call_id());
            }
            c.id.clone_from(&self.ids[i]);
        }
        let mut diffs = Vec::new();
        let old = &self.prev;
        if old.reasoning != new.reasoning {
            diffs.push(Diff {
                reasoning: string_diff(&old.reasoning, &new.reasoning),
                ..Diff::default()
            });
        }
        if old.content != new.content {
            diffs.push(Diff {
                content: string_diff(&old.content, &new.content),
                ..Diff::default()
            });
        }
        if let Some(last) = old.tool_calls.len().checked_sub(1)
            && let Some(now) = new.tool_calls.get(last)
        {
            let was = &old.tool_calls[last];
            let args = string_diff(&was.arguments, &now.arguments);
            if !args.is_empty() || was.name != now.name {
                let mut c = ToolCall {
                    arguments: args,
                    ..ToolCall::default()
                };
                if was.name != now.name {
                    c.id.clone_from(&now.id);
                    c.name.clone_from(&now.name);
                }
                diffs.push(Diff {
                    tool_call: Some((last, c)),
                    ..Diff::default()
                });
            }
        }
        for (i, c) in new.tool_calls.iter().enumerate().skip(old.tool_calls.len()) {
            diffs.push(Diff {
                tool_call: Some((i, c.clone())),
                ..Diff::default()
            });
        }
        // Never take back what was sent: fewer calls or a shorter text keep the old parse.
        if new.tool_calls.len() >= self.prev.tool_calls.len() {
            self.prev = new;
        }
        diffs
            .retain(|d| !(d.reasoning.is_empty() && d.content.is_empty() && d.tool_call.is_none()));
        diffs
    }
}

/// The OpenAI `message` of a parsed answer as llama-server writes it (`content` a string,
/// empty beside tool calls when there is no text).
pub(crate) fn openai_message(m: &ParsedMessage) -> Value {
    let mut msg = json!({"role": "assistant", "content": m.content});
    if !m.reasoning.is_empty() {
        msg["reasoning_content"] = json!(m.reasoning);
    }
    if !m.tool_calls.is_empty() {
        msg["tool_calls"] = m
            .tool_calls
            .iter()
            .map(|c| {
                json!({
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                    "id": c.id,
                })
            })
            .collect();
    }
    msg
}

/// A whole answer read at once, with fresh tool-call ids.
pub(crate) fn parse_final(text: &str, f: OutputFormat) -> ParsedMessage {
    let mut m = parse_output(text, f, false);
    for c in &mut m.tool_calls {
        c.id = tool_call_id();
    }
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    const TOOLS: OutputFormat = OutputFormat {
        tools: true,
        parallel: true,
        think: false,
        think_open: false,
    };
    const THINK: OutputFormat = OutputFormat {
        tools: false,
        parallel: true,
        think: true,
        think_open: false,
    };

    #[test]
    fn a_hermes_block_becomes_a_tool_call_with_its_arguments_as_written() {
        let m = parse_output(
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"c\"}}\n</tool_call>",
            TOOLS,
            false,
        );
        assert_eq!(m.content, "");
        assert_eq!(m.tool_calls.len(), 1);
        assert_eq!(m.tool_calls[0].name, "get_weather");
        assert_eq!(
            m.tool_calls[0].arguments,
            "{\"city\": \"Paris\", \"unit\": \"c\"}"
        );
    }

    #[test]
    fn several_calls_and_the_text_around_them() {
        let m = parse_output(
            "Let me check.\n<tool_call>\n{\"name\": \"a\", \"arguments\": {\"x\": 1}}\n</tool_call>\n<tool_call>\n{\"name\": \"b\", \"arguments\": {}}\n</tool_call>\nDone.",
            TOOLS,
            false,
        );
        let names: Vec<&str> = m.tool_calls.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names, ["a", "b"]);
        assert_eq!(m.tool_calls[1].arguments, "{}");
        // Text before the calls stays as written; whitespace between and after them is not
        // content (llama-server keeps "Let me check.\n" and drops the rest).
        assert_eq!(m.content, "Let me check.\nDone.");
        // Without parallel calls the second block stays text.
        let one = parse_output(
            "<tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call><tool_call>{\"name\": \"b\", \"arguments\": {}}</tool_call>",
            OutputFormat {
                parallel: false,
                ..TOOLS
            },
            false,
        );
        assert_eq!(one.tool_calls.len(), 1);
        assert!(one.content.contains("\"b\""), "{}", one.content);
    }

    #[test]
    fn malformed_json_stays_in_the_content() {
        let text = "<tool_call>\n{\"name\": \"a\", \"arguments\": {\"x\": }\n</tool_call>";
        let m = parse_output(text, TOOLS, false);
        assert!(m.tool_calls.is_empty());
        assert_eq!(m.content, text);
        // No name: not a call either.
        let m = parse_output("<tool_call>{\"arguments\": {}}</tool_call>", TOOLS, false);
        assert!(m.tool_calls.is_empty());
        // Without tools nothing is parsed.
        let plain = "<tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call>";
        assert_eq!(
            parse_output(plain, OutputFormat::default(), false).content,
            plain
        );
    }

    #[test]
    fn string_arguments_are_kept_as_the_json_text_they_hold() {
        let m = parse_output(
            "<tool_call>{\"name\": \"a\", \"arguments\": \"{\\\"x\\\":1}\"}</tool_call>",
            TOOLS,
            false,
        );
        assert_eq!(m.tool_calls[0].arguments, "{\"x\":1}");
    }

    #[test]
    fn think_is_split_into_reasoning_or_left_in_place() {
        let text = "<think>\nLet me add.\n</think>\n\n4";
        let m = parse_output(text, THINK, false);
        assert_eq!(
            (m.reasoning.as_str(), m.content.as_str()),
            ("Let me add.", "4")
        );
        let none = parse_output(text, OutputFormat::default(), false);
        assert_eq!((none.reasoning.as_str(), none.content.as_str()), ("", text));
        // Unclosed at the end: all reasoning.
        let m = parse_output("<think>still going", THINK, false);
        assert_eq!(
            (m.reasoning.as_str(), m.content.as_str()),
            ("still going", "")
        );
        // Opened by the prompt: the answer starts inside.
        let m = parse_output(
            "plan\n</think>\nok",
            OutputFormat {
                think_open: true,
                ..THINK
            },
            false,
        );
        assert_eq!((m.reasoning.as_str(), m.content.as_str()), ("plan", "ok"));
        // No thought: all content.
        assert_eq!(parse_output("4", THINK, false).content, "4");
    }

    fn stream(pieces: &[&str], f: OutputFormat) -> (Vec<Diff>, ParsedMessage) {
        let mut p = StreamParser::new(f);
        let mut diffs = Vec::new();
        for piece in pieces {
            diffs.extend(p.push(piece));
        }
        let (last, msg) = p.finish("");
        diffs.extend(last);
        (diffs, msg)
    }

    #[test]
    fn streamed_think_comes_as_reasoning_then_content_deltas() {
        let (diffs, msg) = stream(
            &["<th", "ink>", "Add", " them", "</thi", "nk>", "\n4"],
            THINK,
        );
        let reasoning: String = diffs.iter().map(|d| d.reasoning.as_str()).collect();
        let content: String = diffs.iter().map(|d| d.content.as_str()).collect();
        assert_eq!(reasoning, "Add them");
        assert_eq!(content, "4");
        assert_eq!(msg.reasoning, "Add them");
        assert!(diffs.iter().all(|d| !d.content.contains('<')));
    }

    #[test]
    fn a_streamed_call_sends_its_name_first_then_its_arguments_in_pieces() {
        let pieces = [
            "Sure",
            ".\n",
            "<tool",
            "_call>\n{\"name\": \"get_",
            "weather\", \"arguments\": {\"city\"",
            ": \"Paris\"}",
            "}\n</tool_call>",
        ];
        let (diffs, msg) = stream(&pieces, TOOLS);
        let content: String = diffs.iter().map(|d| d.content.as_str()).collect();
        assert_eq!(content, "Sure.\n", "the text before the call as written");
        let calls: Vec<&(usize, ToolCall)> =
            diffs.iter().filter_map(|d| d.tool_call.as_ref()).collect();
        assert_eq!(calls[0].1.name, "get_weather", "{calls:?}");
        assert!(!calls[0].1.id.is_empty());
        assert!(calls.len() >= 2, "{calls:?}");
        assert!(
            calls[1..]
                .iter()
                .all(|(i, c)| *i == 0 && c.name.is_empty() && c.id.is_empty())
        );
        let args: String = calls.iter().map(|(_, c)| c.arguments.as_str()).collect();
        assert_eq!(args, "{\"city\": \"Paris\"}");
        assert_eq!(msg.tool_calls[0].arguments, args);
        assert_eq!(msg.tool_calls[0].id, calls[0].1.id);
        let delta = calls[0].1.clone();
        let d = Diff {
            tool_call: Some((0, delta)),
            ..Diff::default()
        }
        .openai_delta();
        assert_eq!(d["tool_calls"][0]["type"], "function");
        assert_eq!(d["tool_calls"][0]["function"]["name"], "get_weather");
    }

    /// llama-server's own parse of the same text (golden/llama_server_tools/parser_*.json:
    /// an assistant message holding the calls, continued by llama-server, which parsed it):
    /// the same content, names, arguments and finish reason.
    #[test]
    fn a_required_or_named_tool_choice_becomes_the_grammar_of_its_call() {
        let conv = |choice: &str, parallel: bool| {
            let body = format!(
                r#"{{"messages": [{{"role": "user", "content": "hi"}}],
                    "tools": [{{"type": "function", "function": {{"name": "a", "parameters": {{"type": "object", "properties": {{"x": {{"type": "integer"}}}}}}}}}},
                              {{"type": "function", "function": {{"name": "b"}}}}],
                    "parallel_tool_calls": {parallel}, "tool_choice": {choice}}}"#
            );
            Conversation::from_openai(&ordered(body.as_bytes()).unwrap())
        };
        let spec = |c: &Conversation| match c.required_call() {
            Some(specula_grammar::Spec::ToolCalls(t)) => Some(t),
            _ => None,
        };
        let all = spec(&conv(r#""required""#, true).unwrap()).unwrap();
        assert!(all.parallel);
        assert_eq!(all.tools[0].0, "a");
        // The parameters as sent; a tool without them is any object.
        assert_eq!(
            all.tools[0].1,
            json!({"type": "object", "properties": {"x": {"type": "integer"}}})
        );
        assert_eq!(all.tools[1], ("b".into(), json!({})));
        let named = conv(r#"{"type": "function", "function": {"name": "b"}}"#, false).unwrap();
        let b = spec(&named).unwrap();
        assert_eq!(
            (b.tools.len(), b.tools[0].0.as_str(), b.parallel),
            (1, "b", false)
        );
        for c in [r#""auto""#, r#""none""#, r#"{"type": "function"}"#] {
            assert!(spec(&conv(c, true).unwrap()).is_none(), "{c}");
        }
        let e = conv(r#"{"type": "function", "function": {"name": "zz"}}"#, true).unwrap_err();
        assert_eq!(e.status, 400);
        assert!(e.msg.contains("`zz`"), "{}", e.msg);
    }

    #[test]
    fn calls_are_read_as_llama_server_reads_them() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../golden/llama_server_tools");
        for name in ["one", "text_before", "two"] {
            let path = dir.join(format!("parser_{name}.json"));
            let g: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
            let text = g["request"]["body"]["messages"][1]["content"]
                .as_str()
                .unwrap();
            let choice = &g["response"]["choices"][0];
            let blank = |mut v: Value| {
                for c in v["tool_calls"].as_array_mut().into_iter().flatten() {
                    assert_eq!(c["id"].as_str().map(str::len), Some(32), "{name}: id");
                    c["id"] = Value::Null;
                }
                v
            };
            let ours = parse_final(text, TOOLS);
            assert_eq!(
                blank(openai_message(&ours)),
                blank(choice["message"].clone()),
                "{name}"
            );
            assert_eq!(choice["finish_reason"], "tool_calls", "{name}");
            // Streamed token by token, the same message.
            let pieces: Vec<String> = text.chars().map(String::from).collect();
            let refs: Vec<&str> = pieces.iter().map(String::as_str).collect();
            let (_, streamed) = stream(&refs, TOOLS);
            assert_eq!(
                blank(openai_message(&streamed)),
                blank(choice["message"].clone()),
                "{name}: streamed"
            );
        }
    }

    #[test]
    fn the_message_has_empty_content_beside_tool_calls() {
        let m = parse_final(
            "<tool_call>\n{\"name\": \"a\", \"arguments\": {}}\n</tool_call>\n",
            TOOLS,
        );
        let v = openai_message(&m);
        assert_eq!(v["content"], "");
        assert_eq!(v["tool_calls"][0]["function"]["arguments"], "{}");
        assert_eq!(v["tool_calls"][0]["id"].as_str().unwrap().len(), 32);
    }
}
