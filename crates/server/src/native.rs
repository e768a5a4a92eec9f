//! llama-server's native endpoints: `POST /completion` (and `/completions`) with its request
//! and response fields, `POST /apply-template` and `GET /props`, named as
//! `tools/server/server-task.cpp` and `server-context.cpp` of the reference llama.cpp name them.

use std::convert::Infallible;
use std::time::Instant;

use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Request, State};
use axum::http::{HeaderValue, Method, header};
use axum::middleware::Next;
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::Deserialize;
use serde_json::{Value, json};
use specula_sampling::SamplerParams;
use specula_tokenizer::{DecodeOptions, EncodeOptions};
use tokio::sync::mpsc;

use crate::api::{Common, Kind, Stop, error_body, timings};
use crate::http::{
    self, ApiError, AppState, body_bytes, encode, fail, job, model_name, parse, submit,
};
use crate::metrics::Outcome;
use crate::worker::{Delta, Event, Summary, TokenLogprob};

/// The native routes (merged into the application by `http::router`).
pub(crate) fn routes() -> Router<AppState> {
    Router::new()
        .route("/completion", post(completion))
        .route("/completions", post(completion))
        .route("/apply-template", post(apply_template))
        .route("/props", get(props))
}

/// CORS as llama-server does it with its defaults (`--cors-origins *`, credentials on): every
/// answer allows the request's `Origin`; an `OPTIONS` preflight is answered at once, before the
/// API key is checked (browsers send none), with llama-server's methods and headers.
pub(crate) async fn cors(req: Request, next: Next) -> Response {
    let origin = req.headers().get(header::ORIGIN).cloned();
    let mut res = if req.method() == Method::OPTIONS {
        let mut r = ([(header::CONTENT_TYPE, "text/html")], "").into_response();
        let h = r.headers_mut();
        h.insert(
            header::ACCESS_CONTROL_ALLOW_CREDENTIALS,
            HeaderValue::from_static("true"),
        );
        h.insert(
            header::ACCESS_CONTROL_ALLOW_METHODS,
            HeaderValue::from_static("GET, POST, DELETE, OPTIONS"),
        );
        h.insert(
            header::ACCESS_CONTROL_ALLOW_HEADERS,
            HeaderValue::from_static("*"),
        );
        r
    } else {
        next.run(req).await
    };
    if let Some(o) = origin {
        res.headers_mut()
            .insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, o);
    }
    res
}

/// `POST /completion`.
#[derive(Debug, Deserialize)]
struct NativeRequest {
    prompt: Option<Value>,
    /// Accepted for compatibility: a slot always reuses the prefix its cache shares with the
    /// prompt, which (decoding being lossless) changes the speed, never the output.
    #[serde(default)]
    #[allow(dead_code, reason = "accepted, see above")]
    cache_prompt: Option<bool>,
    id_slot: Option<i64>,
    #[serde(default)]
    n_probs: i64,
    #[serde(default)]
    return_tokens: bool,
    #[serde(flatten)]
    common: Common,
}

/// A prompt in llama-server's forms: text, token ids, or a mix of both (`[12, "text", 34]`);
/// text is tokenized with BOS (and special tokens parsed) only where it opens the prompt.
fn prompt_ids(st: &AppState, v: &Value) -> Result<Vec<u32>, ApiError> {
    let n_vocab = st.limits.n_vocab;
    let id_of = |n: &serde_json::Number| -> Result<u32, ApiError> {
        n.as_u64()
            .and_then(|t| u32::try_from(t).ok())
            .filter(|&t| (t as usize) < n_vocab)
            .ok_or_else(|| {
                ApiError::bad(format!(
                    "prompt token id {n} is outside the vocabulary of {n_vocab} tokens"
                ))
            })
    };
    match v {
        Value::String(s) => encode(&st.tokenizer, s),
        Value::Array(items) => {
            if let [one @ Value::Array(_)] = items.as_slice() {
                return prompt_ids(st, one);
            }
            if items.iter().any(Value::is_array)
                || (items.len() > 1 && items.iter().all(Value::is_string))
            {
                return Err(ApiError::bad(format!(
                    "`prompt` holds {} prompts; send one prompt per request",
                    items.len()
                )));
            }
            let mut ids = Vec::new();
            for (i, item) in items.iter().enumerate() {
                match item {
                    Value::Number(n) => ids.push(id_of(n)?),
                    Value::String(s) => ids.extend(st.tokenizer.encode_with(
                        s,
                        EncodeOptions {
                            add_special: i == 0,
                            parse_special: true,
                        },
                    )),
                    other => {
                        return Err(ApiError::bad(format!(
                            "`prompt[{i}]` = {other}: a prompt element is a token id or a string"
                        )));
                    }
                }
            }
            if ids.is_empty() {
                return Err(ApiError::bad("`prompt` is empty"));
            }
            Ok(ids)
        }
        other => Err(ApiError::bad(format!(
            "`prompt` = {other}: send a string, a list of token ids, or a mix of both"
        ))),
    }
}

/// llama-server's `generation_settings` (the keys specula has a meaning for).
fn generation_settings(
    s: &SamplerParams,
    n_predict: i64,
    stop: &[String],
    c: &Common,
    n_probs: i64,
) -> Value {
    json!({
        "n_predict": n_predict,
        "max_tokens": n_predict,
        "seed": s.seed,
        "temperature": s.temperature,
        "top_k": s.top_k,
        "top_p": s.top_p,
        "min_p": s.min_p,
        "repeat_last_n": s.repeat_last_n,
        "repeat_penalty": s.repeat_penalty,
        "presence_penalty": s.presence_penalty,
        "frequency_penalty": s.frequency_penalty,
        "stop": stop,
        "ignore_eos": c.ignore_eos,
        "stream": c.stream,
        "n_probs": n_probs,
    })
}

fn stop_type(s: &Summary) -> &'static str {
    match (s.finish_reason, s.stopping_word.is_empty()) {
        ("length", _) => "limit",
        (_, false) => "word",
        _ => "eos",
    }
}

/// One token's `completion_probabilities` entry.
fn probability(id: u32, l: &TokenLogprob) -> Value {
    json!({
        "id": id,
        "token": l.token,
        "bytes": l.bytes,
        "logprob": l.logprob,
        "top_logprobs": l.top.iter().map(|(t, b, lp)| json!({"token": t, "bytes": b, "logprob": lp})).collect::<Vec<_>>(),
    })
}

/// What the final answer is stamped with.
struct Final {
    model: String,
    prompt_text: String,
    settings: Value,
    /// The positions left in the slot, when they (not `n_predict`) bound the generation.
    room: Option<usize>,
}

impl Final {
    /// `has_new_line`: whether the whole generation (streamed or not) holds a newline.
    fn body(&self, content: &str, tokens: &[u32], s: &Summary, has_new_line: bool) -> Value {
        json!({
            "index": 0,
            "content": content,
            "tokens": tokens,
            "id_slot": s.slot,
            "stop": true,
            "model": self.model,
            "tokens_predicted": s.completion_tokens,
            "tokens_evaluated": s.prompt_tokens,
            "generation_settings": self.settings,
            "prompt": self.prompt_text,
            "has_new_line": has_new_line,
            "truncated": self.room.is_some_and(|r| s.finish_reason == "length" && s.completion_tokens >= r),
            "stop_type": stop_type(s),
            "stopping_word": s.stopping_word,
            "tokens_cached": s.prompt_tokens + s.completion_tokens.saturating_sub(1),
            "timings": timings(s),
        })
    }
}

async fn completion(State(st): State<AppState>, body: Result<Bytes, BytesRejection>) -> Response {
    let t0 = Instant::now();
    match body_bytes(&st, body).and_then(|b| parse::<Value>(&b)) {
        Ok(v) => complete(st, v, t0).await,
        Err(e) => fail(&st, t0, e),
    }
}

/// `/completion` of a parsed body (also what `/infill` runs, its prompt built).
pub(crate) async fn complete(st: AppState, body: Value, t0: Instant) -> Response {
    let prepared = (|| {
        let req: NativeRequest = serde_json::from_value(body)
            .map_err(|e| ApiError::bad(format!("invalid request: {e}")))?;
        let prompt = req
            .prompt
            .as_ref()
            .ok_or_else(|| ApiError::bad("\"prompt\" must be provided"))?;
        let ids = prompt_ids(&st, prompt)?;
        let slot = match req.id_slot {
            None | Some(-1) => None,
            Some(i) => match usize::try_from(i) {
                Ok(i) if i < st.limits.n_parallel => Some(i),
                _ => {
                    return Err(ApiError::bad(format!(
                        "id_slot = {i}: the server has slots 0 to {} (or -1 for any)",
                        st.limits.n_parallel - 1
                    )));
                }
            },
        };
        if !(0..=20).contains(&req.n_probs) {
            return Err(ApiError::bad(format!(
                "n_probs = {}: ask for 0 to 20",
                req.n_probs
            )));
        }
        Ok((req, ids, slot))
    })();
    let (req, ids, slot) = match prepared {
        Ok(p) => p,
        Err(e) => return fail(&st, t0, e),
    };
    let prompt_text = st.tokenizer.decode(
        &ids,
        DecodeOptions {
            remove_special: false,
            render_special: true,
        },
    );
    let (tx, rx) = mpsc::unbounded_channel();
    // llama-server's `logprobs` of /completion is `n_probs`; the OpenAI field is not read here.
    let mut c = Common {
        logprobs: None,
        ..req.common
    };
    // As llama-server (without context shift): a generation longer than the slot has room
    // for is not refused but stops where the slot is full, with `truncated: true`.
    let asked = c.n_predict.or(c.max_tokens);
    let room = st.limits.n_ctx_slot.saturating_sub(ids.len());
    let to_room = match asked.filter(|&n| n >= 0) {
        None => true,
        Some(n) => usize::try_from(n).is_ok_and(|n| n > room),
    };
    if to_room && room > 0 {
        c.n_predict = Some(i64::try_from(room).unwrap_or(i64::MAX));
        c.max_tokens = None;
    }
    let mut job = match job(&st, &c, ids, Kind::Completion, tx) {
        Ok(j) => j,
        Err(e) => return fail(&st, t0, e),
    };
    job.slot = slot;
    let n_probs = usize::try_from(req.n_probs).unwrap_or(0);
    if n_probs > 0 {
        job.logprobs = Some(n_probs);
    }
    let stop = match &c.stop {
        None => Vec::new(),
        Some(Stop::One(s)) => vec![s.clone()],
        Some(Stop::Many(v)) => v.clone(),
    };
    let fin = Final {
        model: model_name(&st, c.model.as_ref()),
        prompt_text,
        settings: generation_settings(&job.sampler, asked.unwrap_or(-1), &stop, &c, req.n_probs),
        room: to_room.then_some(room),
    };
    let n_prompt = job.prompt.len();
    if let Err(e) = submit(&st, job) {
        return fail(&st, t0, e);
    }
    if c.stream {
        return stream(st, fin, rx, t0, req.return_tokens, n_prompt, slot).into_response();
    }
    collect(st, fin, rx, t0, req.return_tokens).await
}

async fn collect(
    st: AppState,
    fin: Final,
    mut rx: mpsc::UnboundedReceiver<Event>,
    t0: Instant,
    return_tokens: bool,
) -> Response {
    let mut tokens = Vec::new();
    let mut probs = Vec::new();
    let on_delta = |d: Delta| {
        if return_tokens {
            tokens.push(d.token);
        }
        if let Some(l) = &d.logprob {
            probs.push(probability(d.token, l));
        }
    };
    match http::collect(&st, &mut rx, t0, on_delta).await {
        Ok((text, s)) => {
            st.metrics
                .request_done(Outcome::Success, t0.elapsed().as_secs_f64());
            let mut v = fin.body(&text, &tokens, &s, text.contains('\n'));
            if !probs.is_empty() {
                v["completion_probabilities"] = Value::Array(probs);
            }
            axum::Json(v).into_response()
        }
        Err(e) => e.into_response(),
    }
}

/// llama-server's native stream: a `data:` event per token (`content`, `tokens`, `stop:
/// false`), then one with `stop: true` and the summary fields; no `[DONE]`.
fn stream(
    st: AppState,
    fin: Final,
    rx: mpsc::UnboundedReceiver<Event>,
    t0: Instant,
    return_tokens: bool,
    n_prompt: usize,
    slot: Option<usize>,
) -> Sse<impl futures_util::Stream<Item = Result<SseEvent, Infallible>>> {
    struct S {
        rx: mpsc::UnboundedReceiver<Event>,
        done: bool,
        n: usize,
        has_new_line: bool,
    }
    let id_slot = slot.map_or(-1, |s| i64::try_from(s).unwrap_or(-1));
    let fin = std::sync::Arc::new(fin);
    let init = S {
        rx,
        done: false,
        n: 0,
        has_new_line: false,
    };
    let s = futures_util::stream::unfold(init, move |mut s| {
        let st = st.clone();
        let fin = fin.clone();
        async move {
            if s.done {
                return None;
            }
            let data = |v: &Value| SseEvent::default().data(v.to_string());
            let v = match s.rx.recv().await? {
                Event::Delta(d) => {
                    s.n += 1;
                    s.has_new_line |= d.text.contains('\n');
                    let mut v = json!({
                        "index": 0,
                        "content": d.text,
                        "tokens": if return_tokens { vec![d.token] } else { Vec::new() },
                        "stop": false,
                        "id_slot": id_slot,
                        "tokens_predicted": s.n,
                        "tokens_evaluated": n_prompt,
                    });
                    if let Some(l) = &d.logprob {
                        v["completion_probabilities"] = json!([probability(d.token, l)]);
                    }
                    v
                }
                Event::Done(sum) => {
                    s.done = true;
                    st.metrics
                        .request_done(Outcome::Success, t0.elapsed().as_secs_f64());
                    // Held-back text that was no stop string goes out with the summary.
                    fin.body(
                        &sum.tail,
                        &[],
                        &sum,
                        s.has_new_line || sum.tail.contains('\n'),
                    )
                }
                Event::Error(status, msg) => {
                    s.done = true;
                    if status != 504 {
                        st.metrics
                            .request_done(Outcome::Error, t0.elapsed().as_secs_f64());
                    }
                    error_body(status, &msg)
                }
            };
            Some((Ok(data(&v)), s))
        }
    });
    Sse::new(s)
}

/// `POST /apply-template`: the chat template applied to `messages` (with the generation
/// prompt), as `{"prompt": ...}`.
async fn apply_template(
    State(st): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Result<axum::Json<Value>, ApiError> {
    let bytes = body_bytes(&st, body)?;
    let v: Value = parse(&bytes)?;
    if !v.get("messages").is_some_and(Value::is_array) {
        return Err(ApiError::bad("'messages' is required and must be an array"));
    }
    let template = st
        .template
        .as_ref()
        .ok_or_else(|| ApiError::bad("this model has no usable chat template"))?;
    // The same conversation (tools, tool calls, key order) as a chat completion renders.
    let prompt = crate::tools::Conversation::from_openai(&crate::tools::ordered(&bytes)?)?
        .render(template)?;
    Ok(axum::Json(json!({"prompt": prompt})))
}

async fn props(State(st): State<AppState>) -> axum::Json<Value> {
    let l = &st.limits;
    let s = SamplerParams::default();
    let tok = &st.tokenizer;
    let piece = |id: Option<u32>| {
        id.map_or_else(String::new, |t| {
            String::from_utf8_lossy(tok.token_to_piece(t, true)).into_owned()
        })
    };
    let special = tok.special_tokens();
    let mut params = generation_settings(&s, -1, &[], &Common::default(), 0);
    if let Some(m) = params.as_object_mut() {
        // llama-server's props list no `stop`, and seed 4294967295 (LLAMA_DEFAULT_SEED):
        // a fresh random seed per request, which is what a request without `seed` gets here.
        m.remove("stop");
        m.insert("seed".into(), json!(u32::MAX));
    }
    axum::Json(json!({
        "default_generation_settings": {
            "n_ctx": l.n_ctx_slot,
            "params": params,
        },
        "total_slots": l.n_parallel,
        "model_alias": l.model_name,
        "model_path": l.model_path,
        "chat_template": tok.chat_template_source().unwrap_or_default(),
        "bos_token": piece(special.bos),
        "eos_token": piece(special.eos),
        "build_info": concat!("specula ", env!("CARGO_PKG_VERSION")),
        "is_sleeping": false,
        "n_ctx": l.n_ctx_slot,
        "rollback": l.rollback,
        "speculative": l.spec.as_ref().map(|(kind, o)| json!({
            "type": kind, "n_max": o.n_max, "n_min": o.n_min, "p_min": o.p_min, "adaptive": o.adaptive,
        })),
    }))
}
