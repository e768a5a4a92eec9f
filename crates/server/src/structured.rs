//! Structured output and logit biases of a request: `response_format` (`json_object`,
//! `json_schema`), llama-server's `json_schema` and GBNF `grammar`, and `logit_bias` in
//! OpenAI's map form and llama-server's list form, resolved before any decoding (a bad one is a
//! 400 naming it). The grammar becomes a [`specula_grammar::Constraint`] that the engine thread
//! applies to every logits row it samples or verifies (see `worker::commit_slot`).
//!
//! As llama-server (`server-common.cpp`): `json_schema` and `grammar` together are refused; a
//! `json_object` without a schema, or an empty schema, means any JSON object.

use std::sync::{Arc, OnceLock};

use serde_json::Value;
use specula_grammar::{Constraint, Grammars, Spec};
use specula_tokenizer::{EncodeOptions, Tokenizer};

use crate::http::{ApiError, AppState};

/// The grammar compiler of the server's tokenizer, built on the first request that asks for
/// structured output (a server that never sees one never pays for the token trie).
#[derive(Default)]
pub(crate) struct LazyGrammars(OnceLock<Result<Grammars, String>>);

impl LazyGrammars {
    fn get(&self, tok: &Arc<Tokenizer>) -> Result<&Grammars, ApiError> {
        self.0
            .get_or_init(|| Grammars::new(Arc::clone(tok)).map_err(|e| e.to_string()))
            .as_ref()
            .map_err(|e| ApiError::bad(e.clone()))
    }
}

/// The request fields this module reads (flattened into `api::Common`).
#[derive(Clone, Debug, Default, serde::Deserialize)]
pub(crate) struct Fields {
    pub response_format: Option<Value>,
    pub json_schema: Option<Value>,
    pub grammar: Option<Value>,
    pub logit_bias: Option<Value>,
    /// A tool call the conversation requires (`tool_choice` `required`, Anthropic's `any` /
    /// `tool`), set from the chat request's tools; a response format or grammar of the
    /// request takes precedence, as in llama-server.
    #[serde(skip)]
    pub tools: Option<Spec>,
}

/// What the fields ask for.
pub(crate) fn spec(f: &Fields) -> Result<Option<Spec>, ApiError> {
    let grammar = match &f.grammar {
        None | Some(Value::Null) => None,
        Some(Value::String(g)) if g.is_empty() => None,
        Some(Value::String(g)) => Some(g.clone()),
        Some(v) => {
            return Err(ApiError::bad(format!(
                "`grammar` = {v}: send a GBNF grammar as a string"
            )));
        }
    };
    let mut schema = f.json_schema.clone().filter(|v| !v.is_null());
    if schema.is_some() && grammar.is_some() {
        return Err(ApiError::bad("Cannot use both json_schema and grammar"));
    }
    if let Some(rf) = f.response_format.as_ref().filter(|v| !v.is_null()) {
        let kind = rf.get("type").and_then(Value::as_str).unwrap_or("");
        match kind {
            "json_object" => {
                if rf.get("schema").is_some() || schema.is_none() {
                    schema = Some(rf.get("schema").cloned().unwrap_or(Value::Null));
                }
            }
            "json_schema" => {
                let s = rf
                    .get("json_schema")
                    .and_then(|w| w.get("schema"))
                    .cloned()
                    .unwrap_or(Value::Null);
                schema = Some(s);
            }
            "" | "text" => {}
            other => {
                return Err(ApiError::bad(format!(
                    "response_format type must be one of \"text\", \"json_object\" or \"json_schema\", but got: {other}"
                )));
            }
        }
    }
    Ok(match (schema, grammar) {
        (Some(s), _) if is_any_object(&s) => Some(Spec::JsonObject),
        (Some(Value::String(s)), _) => {
            // A schema sent as a JSON string (some clients stringify it).
            let v: Value = serde_json::from_str(&s).map_err(|e| {
                ApiError::bad(format!("invalid JSON schema: the string is not JSON: {e}"))
            })?;
            Some(Spec::JsonSchema(v))
        }
        (Some(s), _) => Some(Spec::JsonSchema(s)),
        (None, Some(g)) => Some(Spec::Gbnf(g)),
        (None, None) => None,
    })
}

/// llama-server's rule: an absent or empty schema means any object.
fn is_any_object(s: &Value) -> bool {
    s.is_null() || s.as_object().is_some_and(serde_json::Map::is_empty)
}

/// Compiles the request's constraint, if it has one.
pub(crate) fn constraint(st: &AppState, f: &Fields) -> Result<Option<Box<Constraint>>, ApiError> {
    let Some(spec) = spec(f)?.or_else(|| f.tools.clone()) else {
        return Ok(None);
    };
    // Building the token trie (the first time) and compiling a large schema take from
    // milliseconds to seconds: the worker thread hands its other tasks on meanwhile, so the
    // requests it serves are not held up.
    tokio::task::block_in_place(|| {
        let grammars = st.grammars.get(&st.tokenizer)?;
        grammars
            .compile(&spec)
            .map(|c| Some(Box::new(c)))
            .map_err(|e| ApiError::bad(e.to_string()))
    })
}

/// The request's `logit_bias` as `(token, bias)` pairs (`false`: −∞, the token banned):
/// OpenAI's `{"id": bias}` map (llama-server also takes a text key, whose tokens all get the
/// bias) or llama-server's `[[id or text, bias or false], …]`.
pub(crate) fn logit_bias(
    tok: &Tokenizer,
    n_vocab: usize,
    v: Option<&Value>,
) -> Result<Vec<(u32, f32)>, ApiError> {
    let mut out = Vec::new();
    let bias_of = |key: &str, b: &Value| -> Result<f32, ApiError> {
        match b {
            #[allow(
                clippy::cast_possible_truncation,
                reason = "a bias is a logit offset, f32 as the logits"
            )]
            Value::Number(n) => n.as_f64().map(|x| x as f32).ok_or_else(|| {
                ApiError::bad(format!("logit_bias[{key}] = {n}: not a finite number"))
            }),
            Value::Bool(false) => Ok(f32::NEG_INFINITY),
            other => Err(ApiError::bad(format!(
                "logit_bias[{key}] = {other}: a bias is a number, or false to ban the token"
            ))),
        }
    };
    let push_key = |key: &Value, bias: f32, out: &mut Vec<(u32, f32)>| -> Result<(), ApiError> {
        let id_text = match key {
            Value::Number(n) => Some(n.to_string()),
            Value::String(s) if !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) => {
                Some(s.clone())
            }
            _ => None,
        };
        if let Some(t) = id_text {
            let id = t
                .parse::<u32>()
                .ok()
                .filter(|&id| (id as usize) < n_vocab)
                .ok_or_else(|| {
                    ApiError::bad(format!(
                        "logit_bias: token id {t} is outside the vocabulary of {n_vocab} tokens"
                    ))
                })?;
            out.push((id, bias));
            return Ok(());
        }
        match key {
            Value::String(s) => {
                let ids = tok.encode_with(
                    s,
                    EncodeOptions {
                        add_special: false,
                        parse_special: false,
                    },
                );
                out.extend(ids.into_iter().map(|id| (id, bias)));
                Ok(())
            }
            other => Err(ApiError::bad(format!(
                "logit_bias key {other}: use a token id or a text"
            ))),
        }
    };
    match v {
        None | Some(Value::Null) => {}
        Some(Value::Object(m)) => {
            for (k, b) in m {
                let bias = bias_of(k, b)?;
                push_key(&Value::String(k.clone()), bias, &mut out)?;
            }
        }
        Some(Value::Array(items)) => {
            for (i, item) in items.iter().enumerate() {
                let Some([key, b]) = item.as_array().map(Vec::as_slice) else {
                    return Err(ApiError::bad(format!(
                        "logit_bias[{i}] = {item}: each entry is [token id or text, bias or false]"
                    )));
                };
                let bias = bias_of(&i.to_string(), b)?;
                push_key(key, bias, &mut out)?;
            }
        }
        Some(other) => {
            return Err(ApiError::bad(format!(
                "logit_bias = {other}: send {{\"token id\": bias}} or [[token id or text, bias]]"
            )));
        }
    }
    Ok(out)
}

/// What a request's grammar masks cost: how many were computed (one per verify row), their
/// total and median milliseconds (reported in `timings` as `grammar_masks`,
/// `grammar_mask_ms`, `grammar_mask_median_ms`).
#[derive(Clone, Debug)]
pub(crate) struct MaskCost {
    pub n: usize,
    pub total_ms: f64,
    pub median_ms: f64,
}

impl MaskCost {
    pub(crate) fn of(seconds: &[f64]) -> Self {
        let mut s = seconds.to_vec();
        s.sort_by(f64::total_cmp);
        Self {
            n: s.len(),
            total_ms: s.iter().sum::<f64>() * 1e3,
            median_ms: s.get(s.len() / 2).map_or(0.0, |m| m * 1e3),
        }
    }
}

/// Adds the biases to a logits row (llama.cpp's logit-bias sampler, before the chain).
pub(crate) fn apply_bias(bias: &[(u32, f32)], row: &mut [f32]) {
    for &(id, b) in bias {
        if let Some(x) = row.get_mut(id as usize) {
            *x += b;
        }
    }
}
