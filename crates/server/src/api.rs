//! The request bodies the server accepts (OpenAI's and llama-server's field names) and the
//! JSON it answers with.

use serde::Deserialize;
use serde_json::{Value, json};

use crate::worker::{Summary, TokenLogprob};

/// `stop`: one string or several.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub(crate) enum Stop {
    One(String),
    Many(Vec<String>),
}

/// Nested speculative overrides: `"speculative": {"n_max": 4}` (or `false` to disable).
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub(crate) enum SpecField {
    Enabled(bool),
    Options {
        n_max: Option<usize>,
        n_min: Option<usize>,
        p_min: Option<f32>,
    },
}

/// Fields shared by chat and text completions.
#[derive(Clone, Debug, Default, Deserialize)]
pub(crate) struct Common {
    pub model: Option<String>,
    #[serde(default)]
    pub stream: bool,
    pub max_tokens: Option<i64>,
    pub max_completion_tokens: Option<i64>,
    pub n_predict: Option<i64>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub seed: Option<i64>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub repeat_penalty: Option<f32>,
    pub repeat_last_n: Option<i64>,
    pub stop: Option<Stop>,
    pub n: Option<i64>,
    pub logprobs: Option<Value>,
    pub top_logprobs: Option<i64>,
    #[serde(default)]
    pub ignore_eos: bool,
    #[serde(rename = "speculative.n_max")]
    pub spec_n_max: Option<usize>,
    #[serde(rename = "speculative.n_min")]
    pub spec_n_min: Option<usize>,
    #[serde(rename = "speculative.p_min")]
    pub spec_p_min: Option<f32>,
    pub speculative: Option<SpecField>,
    /// `response_format`, `json_schema`, `grammar`, `logit_bias`.
    #[serde(flatten)]
    pub structured: crate::structured::Fields,
}

/// `POST /v1/chat/completions`.
#[derive(Debug, Deserialize)]
pub(crate) struct ChatRequest {
    /// Read (with `tools`, in their key order) by `tools::Conversation::from_openai`.
    pub messages: Vec<Value>,
    #[serde(flatten)]
    pub common: Common,
}

/// A prompt: text or token ids.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub(crate) enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
    /// A list of one prompt (OpenAI allows batches; one is served per request).
    Texts(Vec<String>),
}

/// `POST /v1/completions`.
#[derive(Debug, Deserialize)]
pub(crate) struct CompletionRequest {
    pub prompt: Prompt,
    #[serde(flatten)]
    pub common: Common,
}

/// `POST /tokenize`.
#[derive(Debug, Deserialize)]
pub(crate) struct TokenizeRequest {
    pub content: String,
    #[serde(default)]
    pub add_special: bool,
    #[serde(default = "yes")]
    pub parse_special: bool,
    #[serde(default)]
    pub with_pieces: bool,
}

fn yes() -> bool {
    true
}

/// `POST /detokenize`.
#[derive(Debug, Deserialize)]
pub(crate) struct DetokenizeRequest {
    pub tokens: Vec<u32>,
}

/// Which endpoint a generation answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    Chat,
    Completion,
}

/// The `usage` object.
pub(crate) fn usage(s: &Summary) -> Value {
    json!({
        "prompt_tokens": s.prompt_tokens,
        "completion_tokens": s.completion_tokens,
        "total_tokens": s.prompt_tokens + s.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": s.cached_tokens},
    })
}

#[allow(clippy::cast_precision_loss, reason = "token counts for rates")]
fn per_token(n: usize, ms: f64) -> (f64, f64) {
    if n == 0 || ms <= 0.0 {
        return (0.0, 0.0);
    }
    (ms / n as f64, n as f64 * 1e3 / ms)
}

/// llama-server's `timings` object (`prompt_n` counts the prompt tokens processed, without
/// the ones reused from the slot's cache, which are `cache_n`).
pub(crate) fn timings(s: &Summary) -> Value {
    let prompt_n = s.prompt_tokens - s.cached_tokens;
    let (pp_tok, pp_s) = per_token(prompt_n, s.prompt_ms);
    let (tg_tok, tg_s) = per_token(s.completion_tokens, s.predicted_ms);
    let mut t = json!({
        "cache_n": s.cached_tokens,
        "prompt_n": prompt_n,
        "prompt_ms": s.prompt_ms,
        "prompt_per_token_ms": pp_tok,
        "prompt_per_second": pp_s,
        "predicted_n": s.completion_tokens,
        "predicted_ms": s.predicted_ms,
        "predicted_per_token_ms": tg_tok,
        "predicted_per_second": tg_s,
    });
    if let Some(spec) = &s.spec {
        t["draft_n"] = json!(spec.drafted);
        t["draft_n_accepted"] = json!(spec.accepted);
        t["draft_rounds"] = json!(spec.rounds);
        t["draft_mean_accept_len"] = json!(spec.mean_accept_len());
        t["draft_accept_by_position"] = json!(spec.acceptance_by_position());
        t["draft_replays"] = json!(spec.replays);
    }
    if let Some(g) = &s.grammar {
        t["grammar_masks"] = json!(g.n);
        t["grammar_mask_ms"] = json!(g.total_ms);
        t["grammar_mask_median_ms"] = json!(g.median_ms);
    }
    t
}

/// One token's entry in a chat `logprobs.content` list.
pub(crate) fn chat_logprob(l: &TokenLogprob) -> Value {
    json!({
        "token": l.token,
        "logprob": l.logprob,
        "bytes": l.bytes,
        "top_logprobs": l.top.iter().map(|(t, b, lp)| json!({
            "token": t, "logprob": lp, "bytes": b,
        })).collect::<Vec<_>>(),
    })
}

/// Legacy completions `logprobs` for a list of tokens.
pub(crate) fn completion_logprobs(ls: &[TokenLogprob], text_offset0: usize) -> Value {
    let mut offset = text_offset0;
    let mut offsets = Vec::with_capacity(ls.len());
    for l in ls {
        offsets.push(offset);
        offset += l.token.len();
    }
    json!({
        "tokens": ls.iter().map(|l| l.token.clone()).collect::<Vec<_>>(),
        "token_logprobs": ls.iter().map(|l| l.logprob).collect::<Vec<_>>(),
        "top_logprobs": ls.iter().map(|l| {
            let m: serde_json::Map<String, Value> =
                l.top.iter().map(|(t, _, lp)| (t.clone(), json!(lp))).collect();
            Value::Object(m)
        }).collect::<Vec<_>>(),
        "text_offset": offsets,
    })
}

/// An OpenAI-style error body.
pub(crate) fn error_body(status: u16, message: &str) -> Value {
    let kind = match status {
        401 | 403 => "authentication_error",
        404 => "not_found_error",
        400 | 413 | 422 => "invalid_request_error",
        501 => "not_supported_error",
        503 => "unavailable_error",
        504 => "timeout_error",
        _ => "server_error",
    };
    json!({"error": {"code": status, "message": message, "type": kind}})
}
