//! `n > 1` on `/v1/chat/completions` and `/v1/completions`: several choices for one prompt.
//! Each choice is a job of its own (its own slot, sampler and grammar state) with the seed
//! `seed + i` when the request gives one, so choices differ at temperature > 0 and are
//! reproducible; the answer lists them by `index`, `usage` counts the prompt once and the
//! completions of all. Streaming several choices is refused (400), as is `n` above
//! [`MAX_CHOICES`].

use std::time::Instant;

use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use tokio::sync::mpsc;

use crate::api::{Common, Kind};
use crate::http::{ApiError, AppState, Head, collect, fail, job, model_name, now_secs, submit};
use crate::metrics::Outcome;
use crate::tools::OutputFormat;
use crate::worker::Delta;

/// The most choices one request may ask for.
pub(crate) const MAX_CHOICES: i64 = 16;

pub(crate) async fn generate_n(
    st: AppState,
    c: Common,
    prompt: Vec<u32>,
    kind: Kind,
    format: OutputFormat,
    t0: Instant,
) -> Response {
    let n = c.n.unwrap_or(1);
    if n > MAX_CHOICES {
        return fail(
            &st,
            t0,
            ApiError::bad(format!(
                "n = {n}: ask for at most {MAX_CHOICES} choices per request"
            )),
        );
    }
    if c.stream {
        return fail(
            &st,
            t0,
            ApiError::bad(format!(
                "n = {n} with stream: streaming serves one choice; send n = 1 or stream = false"
            )),
        );
    }
    let mut rxs = Vec::new();
    let mut first_id = None;
    for i in 0..n {
        let mut ci = c.clone();
        ci.n = None;
        ci.seed = c.seed.filter(|&s| s >= 0).map(|s| s.wrapping_add(i));
        let (tx, rx) = mpsc::unbounded_channel();
        let j = match job(&st, &ci, prompt.clone(), kind, tx) {
            Ok(j) => j,
            Err(e) => return fail(&st, t0, e),
        };
        first_id.get_or_insert_with(|| j.id.clone());
        let with_logprobs = j.logprobs.is_some();
        if let Err(e) = submit(&st, j) {
            return fail(&st, t0, e);
        }
        rxs.push((rx, with_logprobs));
    }
    let head = Head {
        id: first_id.unwrap_or_default(),
        created: now_secs(),
        model: model_name(&st, c.model.as_ref()),
        kind,
        format,
    };
    let mut answer: Option<Value> = None;
    let mut choices = Vec::new();
    let mut completion_tokens = 0;
    for (i, (mut rx, with_logprobs)) in rxs.into_iter().enumerate() {
        let mut lps = Vec::new();
        let on_delta = |d: Delta| {
            if with_logprobs && let Some(l) = d.logprob {
                lps.push(l);
            }
        };
        let (text, summary) = match collect(&st, &mut rx, t0, on_delta).await {
            Ok(a) => a,
            Err(e) => return e.into_response(),
        };
        completion_tokens += summary.completion_tokens;
        let mut full = head.full(&text, &lps, &summary);
        let mut choice = full["choices"][0].take();
        choice["index"] = json!(i);
        choices.push(choice);
        answer.get_or_insert(full);
    }
    let Some(mut v) = answer else {
        return ApiError::new(500, "no choice was generated").into_response();
    };
    v["choices"] = Value::Array(choices);
    let prompt_tokens = v["usage"]["prompt_tokens"].as_u64().unwrap_or(0);
    v["usage"]["completion_tokens"] = json!(completion_tokens);
    v["usage"]["total_tokens"] = json!(prompt_tokens + completion_tokens as u64);
    st.metrics
        .request_done(Outcome::Success, t0.elapsed().as_secs_f64());
    axum::Json(v).into_response()
}
