//! llama-server's `POST /infill`: fill-in-the-middle for models with FIM tokens (Qwen2.5-Coder's
//! `<|fim_prefix|>` … found as llama.cpp's vocabulary finds them, by GGUF key or by name:
//! [`specula_tokenizer::SpecialTokens`]). The prompt is built as `format_prompt_infill` of
//! `tools/server/server-common.cpp` builds it, then runs as a `/completion` with the request's
//! other fields:
//!
//! ```text
//! [FIM_REP]myproject\n [FIM_SEP]{filename}\n{text} … [FIM_SEP]filename\n      (the extra context)
//! [FIM_PRE]{prefix}{prompt}[FIM_SUF]{suffix}[FIM_MID]
//! ```
//!
//! Without `<|repo_name|>` / `<|file_sep|>` tokens an extra chunk is preceded by the text
//! `\n\n--- snippet ---\n\n`. Budgets as llama-server's: the prefix keeps its last
//! `3·n_batch/4` tokens, the suffix its first `n_batch/4 − 2 − len(prompt)`, the extra context
//! its last `n_ctx − n_batch − 2·n_predict` (`n_predict` the server's `-n`, −1 without it).
//! The BOS token opens the FIM part where the vocabulary adds one.

use std::time::Instant;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::response::Response;
use axum::routing::post;
use serde_json::{Value, json};
use specula_tokenizer::{EncodeOptions, Tokenizer};

use crate::http::{ApiError, AppState, body_bytes, fail, parse};

/// The route (merged into the application by `http::router`).
pub(crate) fn routes() -> Router<AppState> {
    Router::new().route("/infill", post(infill))
}

/// The text between extra chunks of a model without `<|file_sep|>` (llama-server's
/// `k_chunk_prefix_str`).
const CHUNK_PREFIX: &str = "\n\n--- snippet ---\n\n";

async fn infill(State(st): State<AppState>, body: Result<Bytes, BytesRejection>) -> Response {
    let t0 = Instant::now();
    match prepare(&st, body) {
        Ok(v) => crate::native::complete(st, v, t0).await,
        Err(e) => fail(&st, t0, e),
    }
}

/// Plain text (no special tokens parsed, no BOS) as token ids.
fn plain(tok: &Tokenizer, text: &str) -> Vec<u32> {
    tok.encode_with(
        text,
        EncodeOptions {
            add_special: false,
            parse_special: false,
        },
    )
}

/// llama-server's `tokenize_mixed` without special tokens: a string, or a list of token ids
/// and strings.
fn mixed(st: &AppState, field: &str, v: &Value) -> Result<Vec<u32>, ApiError> {
    match v {
        Value::String(s) => Ok(plain(&st.tokenizer, s)),
        Value::Array(items) => {
            let mut ids = Vec::new();
            for item in items {
                match item {
                    Value::String(s) => ids.extend(plain(&st.tokenizer, s)),
                    Value::Number(n) => ids.push(
                        n.as_u64()
                            .and_then(|t| u32::try_from(t).ok())
                            .filter(|&t| (t as usize) < st.limits.n_vocab)
                            .ok_or_else(|| {
                                ApiError::bad(format!(
                                    "\"{field}\": token id {n} is outside the vocabulary of {} tokens",
                                    st.limits.n_vocab
                                ))
                            })?,
                    ),
                    other => {
                        return Err(ApiError::bad(format!(
                            "\"{field}\": {other} is neither a token id nor a string"
                        )));
                    }
                }
            }
            Ok(ids)
        }
        other => Err(ApiError::bad(format!(
            "\"{field}\" = {other}: send a string (or token ids and strings)"
        ))),
    }
}

/// The `/completion` body of an `/infill` request: its fields, with `prompt` the FIM prompt's
/// token ids.
fn prepare(st: &AppState, body: Result<Bytes, BytesRejection>) -> Result<Value, ApiError> {
    let sp = st.tokenizer.special_tokens();
    let mut missing = String::new();
    for (id, what) in [
        (sp.fim_pre, "prefix"),
        (sp.fim_suf, "suffix"),
        (sp.fim_mid, "middle"),
    ] {
        if id.is_none() {
            missing.push_str(&format!("{what} token is missing. "));
        }
    }
    let (Some(pre), Some(suf), Some(mid)) = (sp.fim_pre, sp.fim_suf, sp.fim_mid) else {
        return Err(ApiError::new(
            501,
            format!("Infill is not supported by this model: {missing}"),
        ));
    };
    let mut data: Value = parse(&body_bytes(st, body)?)?;
    let obj = data
        .as_object_mut()
        .ok_or_else(|| ApiError::bad("the request body must be a JSON object"))?;
    let prompt = match obj.get("prompt") {
        None => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(_) => return Err(ApiError::bad("\"prompt\" must be a string")),
    };
    let prefix = obj
        .get("input_prefix")
        .ok_or_else(|| ApiError::bad("\"input_prefix\" is required"))?;
    let suffix = obj
        .get("input_suffix")
        .ok_or_else(|| ApiError::bad("\"input_suffix\" is required"))?;
    let extra = match obj.get("input_extra") {
        None => Vec::new(),
        Some(Value::Array(chunks)) => {
            let mut out = Vec::with_capacity(chunks.len());
            for c in chunks {
                let text = c.get("text").and_then(Value::as_str).ok_or_else(|| {
                    ApiError::bad(
                        "extra_context chunk must contain a \"text\" field with a string value",
                    )
                })?;
                let filename = match c.get("filename") {
                    None => "tmp",
                    Some(Value::String(f)) => f.as_str(),
                    Some(_) => {
                        return Err(ApiError::bad(
                            "extra_context chunk's \"filename\" field must be a string",
                        ));
                    }
                };
                out.push((filename.to_owned(), text.to_owned()));
            }
            out
        }
        Some(_) => {
            return Err(ApiError::bad(
                "\"input_extra\" must be an array of {\"filename\": string, \"text\": string}",
            ));
        }
    };
    let tok = &st.tokenizer;
    let mut prefix = mixed(st, "input_prefix", prefix)?;
    let mut suffix = mixed(st, "input_suffix", suffix)?;
    let prompt = tok.encode_with(
        &prompt,
        EncodeOptions {
            add_special: false,
            parse_special: true,
        },
    );

    // The repo-level extra context.
    let mut extra_ids = Vec::new();
    if let Some(rep) = sp.fim_rep {
        extra_ids.push(rep);
        extra_ids.extend(plain(tok, "myproject\n"));
    }
    for (filename, text) in &extra {
        match sp.fim_sep {
            Some(sep) => {
                extra_ids.push(sep);
                extra_ids.extend(plain(tok, &format!("{filename}\n")));
            }
            None => extra_ids.extend(plain(tok, CHUNK_PREFIX)),
        }
        extra_ids.extend(plain(tok, text));
    }
    if let Some(sep) = sp.fim_sep {
        extra_ids.push(sep);
        extra_ids.extend(plain(tok, "filename\n"));
    }

    // llama-server's budgets (its integer arithmetic, in i64).
    let l = &st.limits;
    let as_i64 = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
    let n_batch = as_i64(l.n_batch);
    let n_ctx = as_i64(l.n_ctx_slot);
    let n_predict = l.n_predict.map_or(-1, as_i64);
    let n_prefix_take = as_i64(prefix.len()).min(3 * (n_batch / 4));
    let n_suffix_take = as_i64(suffix.len()).min((n_batch / 4 - (2 + as_i64(prompt.len()))).max(0));
    let n_extra_take = (n_ctx - n_batch - 2 * n_predict)
        .max(0)
        .min(as_i64(extra_ids.len()));
    let take = |n: i64| usize::try_from(n).unwrap_or(0);
    prefix.drain(..prefix.len() - take(n_prefix_take));
    suffix.truncate(take(n_suffix_take));

    let mut ids = Vec::with_capacity(extra_ids.len() + prefix.len() + suffix.len() + 4);
    ids.extend_from_slice(&extra_ids[extra_ids.len() - take(n_extra_take)..]);
    if tok.add_bos()
        && let Some(bos) = sp.bos
    {
        ids.push(bos);
    }
    // Prefix/Suffix/Middle, or with `--spm-infill` Suffix/Prefix/Middle.
    let mut head = vec![pre];
    head.extend(prefix);
    head.extend(prompt);
    let mut tail = vec![suf];
    tail.extend(suffix);
    if l.spm_infill {
        std::mem::swap(&mut head, &mut tail);
    }
    ids.extend(head);
    ids.extend(tail);
    ids.push(mid);

    for k in ["input_prefix", "input_suffix", "input_extra"] {
        obj.remove(k);
    }
    obj.insert("prompt".into(), json!(ids));
    Ok(data)
}
