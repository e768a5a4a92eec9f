//! Routes, authentication, request checking and the answers (JSON or SSE).

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Value, json};
use specula_engine::SpecOptions;
use specula_sampling::SamplerParams;
use specula_tokenizer::{ChatTemplate, DecodeOptions, EncodeOptions, Tokenizer};
use tokio::sync::mpsc;

use crate::api::{
    ChatRequest, Common, CompletionRequest, DetokenizeRequest, Kind, Prompt, SpecField, Stop,
    TokenizeRequest, chat_logprob, completion_logprobs, error_body, timings, usage,
};
use crate::metrics::{Metrics, Outcome};
use crate::tools::{Conversation, Diff, OutputFormat, StreamParser};
use crate::worker::{Command, Delta, Event, Job, SpecRequest, Summary, TokenLogprob};

/// Fixed facts and limits the handlers check requests against.
#[derive(Debug)]
pub(crate) struct Limits {
    pub n_ctx_slot: usize,
    pub n_parallel: usize,
    pub api_key: Option<String>,
    pub extra_api_keys: Vec<String>,
    pub timeout: Duration,
    pub body_limit: usize,
    pub model_name: String,
    pub model_aliases: Vec<String>,
    pub n_embd: usize,
    pub model_path: String,
    pub n_vocab: usize,
    pub n_ctx_train: usize,
    /// The model file's values, tensor bytes and type name, as llama.cpp counts them
    /// (`n_params`, `size`, `ftype` of `/v1/models`).
    pub n_params: u64,
    pub model_size: u64,
    pub ftype: String,
    pub spec: Option<(String, SpecOptions)>,
    pub rollback: &'static str,
    /// Sampling defaults (`--temp` …; the seed is `seed`).
    pub sampling: SamplerParams,
    /// Default seed (`--seed`); `None`: random per request.
    pub seed: Option<u64>,
    /// Default max tokens (`-n`).
    pub n_predict: Option<usize>,
    /// `/metrics` served (`--metrics`).
    pub metrics: bool,
    /// `/slots` served (`--slots`).
    pub slots: bool,
    /// Where slot files go (`--slot-save-path`); `None`: slot actions answer 501.
    pub slot_save_path: Option<std::path::PathBuf>,
    /// The logical batch (`-b`), which `/infill` budgets its prompt with.
    pub n_batch: usize,
    /// `/infill` in Suffix/Prefix/Middle order (`--spm-infill`).
    pub spm_infill: bool,
    /// `--reasoning-format`.
    pub reasoning_format: crate::tools::ReasoningFormat,
    /// The chat template thinks (holds `<think>`): `auto` splits thoughts.
    pub template_thinks: bool,
}

/// What every handler shares.
#[derive(Clone)]
pub(crate) struct AppState {
    pub tx: std::sync::mpsc::Sender<Command>,
    pub tokenizer: Arc<Tokenizer>,
    pub template: Option<Arc<ChatTemplate>>,
    pub metrics: Arc<Metrics>,
    pub limits: Arc<Limits>,
    pub started: u64,
    /// Compiles requests' JSON schemas and grammars (built on first use).
    pub grammars: Arc<crate::structured::LazyGrammars>,
}

/// The application.
pub(crate) fn router(state: AppState) -> Router {
    let body_limit = state.limits.body_limit;
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/models", get(models))
        .route("/health", get(health))
        .route("/v1/health", get(health))
        .route("/metrics", get(metrics))
        .route("/slots", get(slots))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .merge(crate::native::routes())
        .merge(crate::slots::routes())
        .merge(crate::infill::routes())
        .merge(crate::responses::routes())
        .merge(crate::anthropic::routes())
        .fallback(not_found)
        .method_not_allowed_fallback(not_found)
        .layer(middleware::from_fn_with_state(state.clone(), auth))
        .layer(middleware::from_fn(crate::native::cors))
        .layer(DefaultBodyLimit::max(body_limit))
        .with_state(state)
}

/// An error answer.
#[derive(Debug)]
pub(crate) struct ApiError {
    pub status: u16,
    pub msg: String,
    /// `(n_prompt_tokens, n_ctx)` of llama-server's `exceed_context_size_error`.
    pub exceed: Option<(usize, usize)>,
}

impl ApiError {
    pub(crate) fn new(status: u16, msg: impl Into<String>) -> Self {
        Self {
            status,
            msg: msg.into(),
            exceed: None,
        }
    }

    pub(crate) fn bad(msg: impl Into<String>) -> Self {
        Self::new(400, msg)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let mut body = error_body(self.status, &self.msg);
        if let Some((n_prompt, n_ctx)) = self.exceed {
            body["error"]["type"] = json!("exceed_context_size_error");
            body["error"]["n_prompt_tokens"] = json!(n_prompt);
            body["error"]["n_ctx"] = json!(n_ctx);
        }
        (status, axum::Json(body)).into_response()
    }
}

/// Equal keys, in time that depends only on their lengths.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = a.len() ^ b.len();
    for i in 0..a.len().max(b.len()) {
        let x = a.get(i).copied().unwrap_or(0);
        let y = b.get(i).copied().unwrap_or(0);
        diff |= usize::from(x ^ y);
    }
    std::hint::black_box(diff) == 0
}

/// Endpoints answered without a key (as llama-server does).
const PUBLIC: &[&str] = &["/health", "/v1/health", "/v1/models", "/models"];

async fn auth(State(st): State<AppState>, req: Request, next: Next) -> Response {
    let Some(key) = st.limits.api_key.as_deref() else {
        return next.run(req).await;
    };
    if PUBLIC.contains(&req.uri().path()) {
        return next.run(req).await;
    }
    let given = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .or_else(|| req.headers().get("x-api-key").and_then(|v| v.to_str().ok()));
    match given {
        Some(g)
            if std::iter::once(key)
                .chain(st.limits.extra_api_keys.iter().map(String::as_str))
                .any(|k| constant_time_eq(g.trim().as_bytes(), k.as_bytes())) =>
        {
            next.run(req).await
        }
        _ => {
            tracing::warn!(path = %req.uri().path(), "rejected a request without a valid API key");
            ApiError::new(401,
                "invalid or missing API key: send `Authorization: Bearer <key>` with the key given to --api-key",
            )
            .into_response()
        }
    }
}

async fn not_found(req: Request) -> ApiError {
    ApiError::new(
        404,
        format!(
            "no endpoint {} {}; the server answers /v1/chat/completions, /v1/completions, /v1/responses, /completion, /infill, /apply-template, /v1/models, /health, /metrics, /slots, /slots/{{id}}?action=, /props, /tokenize, /detokenize",
            req.method(),
            req.uri().path()
        ),
    )
}

pub(crate) fn body_bytes(
    st: &AppState,
    body: Result<Bytes, BytesRejection>,
) -> Result<Bytes, ApiError> {
    body.map_err(|e| {
        let status = e.status().as_u16();
        if status == 413 {
            ApiError::new(413,
                format!(
                    "the request body is larger than the server's limit of {} bytes; send a shorter request or start the server with a larger --body-limit",
                    st.limits.body_limit
                ),
            )
        } else {
            ApiError::new(status, format!("cannot read the request body: {e}"))
        }
    })
}

pub(crate) fn parse<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(bytes).map_err(|e| ApiError::bad(format!("invalid JSON body: {e}")))
}

async fn health() -> axum::Json<Value> {
    axum::Json(json!({"status": "ok"}))
}

/// `GET /v1/models` as llama-server's `get_res_models`: the OpenAI list (`object`, `data`)
/// and the Ollama-style `models` list beside it.
async fn models(State(st): State<AppState>) -> axum::Json<Value> {
    let l = &st.limits;
    // llama.cpp's `llama_vocab_type`: 1 SPM, 2 BPE.
    let vocab_type = match st.tokenizer.kind() {
        specula_tokenizer::VocabKind::Spm => 1,
        specula_tokenizer::VocabKind::Bpe => 2,
    };
    axum::Json(json!({
        "models": [{
            "name": l.model_name,
            "model": l.model_name,
            "modified_at": "",
            "size": "",
            "digest": "",
            "type": "model",
            "description": "",
            "tags": [""],
            "capabilities": ["completion"],
            "parameters": "",
            "details": {
                "parent_model": "",
                "format": "gguf",
                "family": "",
                "families": [""],
                "parameter_size": "",
                "quantization_level": "",
            },
        }],
        "object": "list",
        "data": [{
            "id": l.model_name,
            "aliases": l.model_aliases,
            "tags": [],
            "object": "model",
            "created": st.started,
            "owned_by": "specula",
            "meta": {
                "vocab_type": vocab_type,
                "n_vocab": l.n_vocab,
                "n_ctx": l.n_ctx_slot,
                "n_ctx_train": l.n_ctx_train,
                "n_embd": l.n_embd,
                "n_params": l.n_params,
                "size": l.model_size,
                "ftype": l.ftype,
                "n_ctx_slot": l.n_ctx_slot,
            },
        }],
    }))
}

/// llama-server's answer to an endpoint turned off by a flag (its `not_supported_error`).
fn not_supported(endpoint: &str, flag: &str) -> Response {
    (
        StatusCode::NOT_IMPLEMENTED,
        axum::Json(json!({"error": {
            "code": 501,
            "message": format!("This server does not support {endpoint} endpoint. Start it with `{flag}`"),
            "type": "not_supported_error",
        }})),
    )
        .into_response()
}

async fn metrics(State(st): State<AppState>) -> Response {
    if !st.limits.metrics {
        return not_supported("metrics", "--metrics");
    }
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        st.metrics.render(),
    )
        .into_response()
}

async fn slots(State(st): State<AppState>) -> Response {
    if !st.limits.slots {
        return not_supported("slots", "--slots");
    }
    let (tx, rx) = tokio::sync::oneshot::channel();
    if st.tx.send(Command::Slots(tx)).is_err() {
        return ApiError::new(503, "the engine has stopped").into_response();
    }
    match rx.await {
        Ok(v) => axum::Json(v).into_response(),
        Err(_) => ApiError::new(503, "the engine has stopped").into_response(),
    }
}

async fn tokenize(
    State(st): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Result<axum::Json<Value>, ApiError> {
    let req: TokenizeRequest = parse(&body_bytes(&st, body)?)?;
    let ids = st.tokenizer.encode_with(
        &req.content,
        EncodeOptions {
            add_special: req.add_special,
            parse_special: req.parse_special,
        },
    );
    let tokens: Vec<Value> = if req.with_pieces {
        ids.iter()
            .map(|&id| {
                let b = st.tokenizer.token_to_piece(id, true);
                match std::str::from_utf8(b) {
                    Ok(s) => json!({"id": id, "piece": s}),
                    Err(_) => json!({"id": id, "piece": b}),
                }
            })
            .collect()
    } else {
        ids.iter().map(|&id| json!(id)).collect()
    };
    Ok(axum::Json(json!({"tokens": tokens})))
}

async fn detokenize(
    State(st): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Result<axum::Json<Value>, ApiError> {
    let req: DetokenizeRequest = parse(&body_bytes(&st, body)?)?;
    if let Some(&bad) = req
        .tokens
        .iter()
        .find(|&&t| t as usize >= st.limits.n_vocab)
    {
        return Err(ApiError::bad(format!(
            "token id {bad} is outside the vocabulary of {} tokens",
            st.limits.n_vocab
        )));
    }
    let content = st.tokenizer.decode(
        &req.tokens,
        DecodeOptions {
            remove_special: false,
            render_special: true,
        },
    );
    Ok(axum::Json(json!({"content": content})))
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

pub(crate) fn encode(tok: &Tokenizer, text: &str) -> Result<Vec<u32>, ApiError> {
    let mut ids = tok.encode_with(
        text,
        EncodeOptions {
            add_special: true,
            parse_special: true,
        },
    );
    if ids.is_empty() {
        match tok.special_tokens().bos {
            Some(bos) => ids.push(bos),
            None => {
                return Err(ApiError::bad(
                    "the prompt is empty and the model has no BOS token to start from",
                ));
            }
        }
    }
    Ok(ids)
}

async fn chat(State(st): State<AppState>, body: Result<Bytes, BytesRejection>) -> Response {
    let t0 = Instant::now();
    let prepared = (|| {
        let bytes = body_bytes(&st, body)?;
        let req: ChatRequest = parse(&bytes)?;
        let template = st.template.as_ref().ok_or_else(|| {
            ApiError::bad("this model has no usable chat template; use /v1/completions with a formatted prompt")
        })?;
        if req.messages.is_empty() {
            return Err(ApiError::bad(
                "`messages` is empty: send at least one message",
            ));
        }
        // Messages, tools and their JSON key order as llama.cpp hands them to the template.
        let conv = Conversation::from_openai(&crate::tools::ordered(&bytes)?)?;
        let text = conv.render(template)?;
        let format =
            conv.output_format(st.limits.reasoning_format, st.limits.template_thinks, &text);
        let prompt = encode(&st.tokenizer, &text)?;
        let mut common = req.common;
        common.structured.tools = conv.required_call();
        Ok((common, prompt, format))
    })();
    match prepared {
        Ok((common, prompt, format)) => generate(st, common, prompt, Kind::Chat, format, t0).await,
        Err(e) => fail(&st, t0, e),
    }
}

async fn completions(State(st): State<AppState>, body: Result<Bytes, BytesRejection>) -> Response {
    let t0 = Instant::now();
    let prepared = (|| {
        let req: CompletionRequest = parse(&body_bytes(&st, body)?)?;
        let prompt = match &req.prompt {
            Prompt::Text(t) => encode(&st.tokenizer, t)?,
            Prompt::Texts(ts) if ts.len() == 1 => encode(&st.tokenizer, &ts[0])?,
            Prompt::Texts(ts) => {
                return Err(ApiError::bad(format!(
                    "`prompt` holds {} prompts; send one prompt per request",
                    ts.len()
                )));
            }
            Prompt::Tokens(ids) => {
                if ids.is_empty() {
                    return Err(ApiError::bad("`prompt` is an empty token list"));
                }
                if let Some(&bad) = ids.iter().find(|&&t| t as usize >= st.limits.n_vocab) {
                    return Err(ApiError::bad(format!(
                        "prompt token id {bad} is outside the vocabulary of {} tokens",
                        st.limits.n_vocab
                    )));
                }
                ids.clone()
            }
        };
        Ok((req.common, prompt))
    })();
    match prepared {
        Ok((common, prompt)) => {
            generate(
                st,
                common,
                prompt,
                Kind::Completion,
                OutputFormat::default(),
                t0,
            )
            .await
        }
        Err(e) => fail(&st, t0, e),
    }
}

pub(crate) fn fail(st: &AppState, t0: Instant, e: ApiError) -> Response {
    st.metrics
        .request_done(Outcome::Error, t0.elapsed().as_secs_f64());
    tracing::info!(status = e.status, "request refused: {}", e.msg);
    e.into_response()
}

/// The model name an answer carries: the one the request asked for, or the server's.
pub(crate) fn model_name(st: &AppState, asked: Option<&String>) -> String {
    asked
        .cloned()
        .unwrap_or_else(|| st.limits.model_name.clone())
}

/// Hands a job to the engine; refused (503) when the engine has stopped.
pub(crate) fn submit(st: &AppState, job: Job) -> Result<(), ApiError> {
    st.tx
        .send(Command::Generate(Box::new(job)))
        .map_err(|_| ApiError::new(503, "the engine has stopped; the server is shutting down"))
}

/// A non-streamed answer as the engine sends it: each token's delta goes to `on_delta`, the
/// text (held-back tail included) and summary come back. An engine error is counted (a 504
/// timeout the worker has counted already) and returned; success is for the caller to count.
pub(crate) async fn collect(
    st: &AppState,
    rx: &mut mpsc::UnboundedReceiver<Event>,
    t0: Instant,
    mut on_delta: impl FnMut(Delta),
) -> Result<(String, Box<Summary>), ApiError> {
    let mut text = String::new();
    while let Some(ev) = rx.recv().await {
        match ev {
            Event::Delta(d) => {
                text.push_str(&d.text);
                on_delta(d);
            }
            Event::Done(s) => {
                text.push_str(&s.tail);
                return Ok((text, s));
            }
            Event::Error(status, msg) => {
                if status != 504 {
                    st.metrics
                        .request_done(Outcome::Error, t0.elapsed().as_secs_f64());
                }
                return Err(ApiError::new(status, msg));
            }
        }
    }
    Err(ApiError::new(500, "the engine dropped the request"))
}

/// The job of a request: limits checked, sampling and speculative settings resolved.
pub(crate) fn job(
    st: &AppState,
    c: &Common,
    prompt: Vec<u32>,
    kind: Kind,
    events: mpsc::UnboundedSender<Event>,
) -> Result<Job, ApiError> {
    let l = &st.limits;
    match c.n {
        Some(n) if n < 1 => {
            return Err(ApiError::bad(format!("n = {n}: ask for at least 1 choice")));
        }
        Some(n) if n > 1 => {
            return Err(ApiError::bad(format!(
                "n = {n}: this endpoint serves one choice per request; /v1/chat/completions and /v1/completions take n up to {}",
                crate::choices::MAX_CHOICES
            )));
        }
        _ => {}
    }
    let asked = c
        .max_completion_tokens
        .or(c.max_tokens)
        .or(c.n_predict.filter(|&n| n >= 0));
    let n_prompt = prompt.len();
    if n_prompt >= l.n_ctx_slot {
        return Err(ApiError {
            exceed: Some((n_prompt, l.n_ctx_slot)),
            ..ApiError::bad(format!(
                "the prompt has {n_prompt} tokens but a slot holds {} (-c {} over -np {}); shorten the prompt or start the server with a larger -c (or fewer slots)",
                l.n_ctx_slot,
                l.n_ctx_slot * l.n_parallel,
                l.n_parallel
            ))
        });
    }
    let n_predict = match asked {
        Some(n) if n < 1 => {
            return Err(ApiError::bad(format!(
                "max_tokens = {n}: ask for at least 1 token"
            )));
        }
        Some(n) => {
            let n = usize::try_from(n).unwrap_or(usize::MAX);
            if n_prompt.saturating_add(n) > l.n_ctx_slot {
                return Err(ApiError::bad(format!(
                    "the request needs {} positions ({n_prompt} prompt tokens + max_tokens {n}) but a slot holds {}; lower max_tokens to at most {}, shorten the prompt, or start the server with a larger -c (or fewer slots, -np)",
                    n_prompt.saturating_add(n),
                    l.n_ctx_slot,
                    l.n_ctx_slot - n_prompt
                )));
            }
            n
        }
        // `-n` is a default, not a promise: it stops where the slot's context ends.
        None => l
            .n_predict
            .map_or(l.n_ctx_slot - n_prompt, |n| n.min(l.n_ctx_slot - n_prompt)),
    };
    let d = l.sampling;
    let seed = match c.seed {
        Some(s) if s >= 0 => s.cast_unsigned(),
        Some(_) => specula_sampling::entropy_seed(),
        None => l.seed.unwrap_or_else(specula_sampling::entropy_seed),
    };
    let sampler = SamplerParams {
        temperature: c.temperature.unwrap_or(d.temperature),
        top_k: c
            .top_k
            .map_or(d.top_k, |k| u32::try_from(k.max(0)).unwrap_or(u32::MAX)),
        top_p: c.top_p.unwrap_or(d.top_p),
        min_p: c.min_p.unwrap_or(d.min_p),
        repeat_penalty: c.repeat_penalty.unwrap_or(d.repeat_penalty),
        repeat_last_n: match c.repeat_last_n {
            Some(-1) => u32::try_from(l.n_ctx_slot).unwrap_or(u32::MAX),
            Some(n) => u32::try_from(n.max(0)).unwrap_or(u32::MAX),
            None => d.repeat_last_n,
        },
        presence_penalty: c.presence_penalty.unwrap_or(d.presence_penalty),
        frequency_penalty: c.frequency_penalty.unwrap_or(d.frequency_penalty),
        seed,
        n_probs: 0,
    };
    sampler
        .validate()
        .map_err(|e| ApiError::bad(format!("bad sampling parameter: {e}")))?;
    let top = c.top_logprobs.unwrap_or(0);
    if !(0..=20).contains(&top) {
        return Err(ApiError::bad(format!(
            "top_logprobs = {top}: ask for 0 to 20"
        )));
    }
    let logprobs = match (kind, &c.logprobs) {
        (_, None | Some(Value::Null) | Some(Value::Bool(false))) => None,
        (Kind::Chat, Some(Value::Bool(true))) => Some(usize::try_from(top).unwrap_or(0)),
        (Kind::Completion, Some(Value::Number(n))) => match n.as_u64() {
            Some(n) if n <= 20 => Some(usize::try_from(n).unwrap_or(0)),
            _ => {
                return Err(ApiError::bad(format!(
                    "logprobs = {n}: ask for 0 to 20 alternatives"
                )));
            }
        },
        (Kind::Chat, Some(v)) => {
            return Err(ApiError::bad(format!(
                "logprobs = {v}: chat completions take true or false (and top_logprobs)"
            )));
        }
        (Kind::Completion, Some(v)) => {
            return Err(ApiError::bad(format!(
                "logprobs = {v}: completions take a number of alternatives (0 to 20)"
            )));
        }
    };
    let stop = match &c.stop {
        None => Vec::new(),
        Some(Stop::One(s)) => vec![s.clone()],
        Some(Stop::Many(v)) => v.clone(),
    };
    let mut spec = SpecRequest {
        n_max: c.spec_n_max,
        n_min: c.spec_n_min,
        p_min: c.spec_p_min,
    };
    match &c.speculative {
        None | Some(SpecField::Enabled(true)) => {}
        Some(SpecField::Enabled(false)) => spec.n_max = Some(0),
        Some(SpecField::Options {
            n_max,
            n_min,
            p_min,
        }) => {
            spec.n_max = n_max.or(spec.n_max);
            spec.n_min = n_min.or(spec.n_min);
            spec.p_min = p_min.or(spec.p_min);
        }
    }
    if let Some(p) = spec.p_min
        && !(0.0..=1.0).contains(&p)
    {
        return Err(ApiError::bad(format!(
            "speculative.p_min = {p}: use a probability in [0, 1]"
        )));
    }
    let constraint = crate::structured::constraint(st, &c.structured)?;
    let logit_bias =
        crate::structured::logit_bias(&st.tokenizer, l.n_vocab, c.structured.logit_bias.as_ref())?;
    let prefix = match kind {
        Kind::Chat => "chatcmpl",
        Kind::Completion => "cmpl",
    };
    Ok(Job {
        id: format!("{prefix}-{}", NEXT_ID.fetch_add(1, Ordering::Relaxed)),
        prompt,
        n_predict,
        sampler,
        stop,
        logprobs,
        spec,
        ignore_eos: c.ignore_eos,
        constraint,
        logit_bias,
        slot: None,
        events,
        deadline: Instant::now() + l.timeout,
    })
}

pub(crate) fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The `system_fingerprint` of OpenAI responses (llama-server's build: `b<N>-<commit>`).
const SYSTEM_FINGERPRINT: &str = concat!("specula-", env!("CARGO_PKG_VERSION"));

/// What a response is named and stamped with.
#[derive(Clone)]
pub(crate) struct Head {
    pub id: String,
    pub created: u64,
    pub model: String,
    pub kind: Kind,
    /// How a chat answer is read back (tool calls, thoughts).
    pub format: OutputFormat,
}

impl Head {
    fn object(&self, chunk: bool) -> &'static str {
        match (self.kind, chunk) {
            (Kind::Chat, false) => "chat.completion",
            (Kind::Chat, true) => "chat.completion.chunk",
            (Kind::Completion, _) => "text_completion",
        }
    }

    /// A streamed chunk carrying `text` (and its token and log-probability).
    fn chunk(
        &self,
        text: &str,
        token: Option<u32>,
        lp: Option<&TokenLogprob>,
        text_offset: usize,
    ) -> Value {
        let mut choice = match self.kind {
            Kind::Chat => json!({"index": 0, "delta": {"content": text}, "finish_reason": null}),
            Kind::Completion => json!({"index": 0, "text": text, "finish_reason": null}),
        };
        if let Some(l) = lp {
            choice["logprobs"] = match self.kind {
                Kind::Chat => json!({"content": [chat_logprob(l)]}),
                Kind::Completion => completion_logprobs(std::slice::from_ref(l), text_offset),
            };
        }
        let mut v = json!({
            "id": self.id, "object": self.object(true), "created": self.created,
            "model": self.model, "choices": [choice], "system_fingerprint": SYSTEM_FINGERPRINT,
        });
        if let Some(t) = token {
            v["tokens"] = json!([t]);
        }
        v
    }

    fn role_chunk(&self) -> Value {
        json!({
            "id": self.id, "object": self.object(true), "created": self.created, "model": self.model,
            "system_fingerprint": SYSTEM_FINGERPRINT,
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": null}, "finish_reason": null}],
        })
    }

    /// A streamed chunk carrying one difference of the parsed answer.
    fn diff_chunk(&self, d: &Diff) -> Value {
        json!({
            "id": self.id, "object": self.object(true), "created": self.created, "model": self.model,
            "choices": [{"index": 0, "delta": d.openai_delta(), "finish_reason": null}],
        })
    }

    /// `tool_calls`: the answer held tool calls (a natural end then reports `tool_calls`).
    fn final_chunk(&self, s: &Summary, tool_calls: bool) -> Value {
        let finish = finish_reason(s, tool_calls);
        let choice = match self.kind {
            Kind::Chat => json!({"index": 0, "delta": {}, "finish_reason": finish}),
            Kind::Completion => json!({"index": 0, "text": "", "finish_reason": s.finish_reason}),
        };
        json!({
            "id": self.id, "object": self.object(true), "created": self.created, "model": self.model,
            "system_fingerprint": SYSTEM_FINGERPRINT,
            "choices": [choice], "usage": usage(s), "timings": timings(s),
        })
    }

    pub(crate) fn full(&self, text: &str, lps: &[TokenLogprob], s: &Summary) -> Value {
        let mut choice = match self.kind {
            Kind::Chat if self.format.parses() => {
                let m = crate::tools::parse_final(text, self.format);
                json!({
                    "index": 0,
                    "message": crate::tools::openai_message(&m),
                    "finish_reason": finish_reason(s, !m.tool_calls.is_empty()),
                    "logprobs": null,
                })
            }
            Kind::Chat => json!({
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": s.finish_reason,
                "logprobs": null,
            }),
            Kind::Completion => json!({
                "index": 0, "text": text, "finish_reason": s.finish_reason, "logprobs": null,
            }),
        };
        if !lps.is_empty() {
            choice["logprobs"] = match self.kind {
                Kind::Chat => json!({"content": lps.iter().map(chat_logprob).collect::<Vec<_>>()}),
                Kind::Completion => completion_logprobs(lps, 0),
            };
        }
        json!({
            "id": self.id, "object": self.object(false), "created": self.created,
            "model": self.model, "choices": [choice], "system_fingerprint": SYSTEM_FINGERPRINT,
            "usage": usage(s), "timings": timings(s), "id_slot": s.slot,
        })
    }
}

/// llama-server's `finish_reason`: `tool_calls` for an answer with tool calls that ended by
/// itself (not by `max_tokens`).
fn finish_reason(s: &Summary, tool_calls: bool) -> &'static str {
    if tool_calls && s.finish_reason == "stop" {
        "tool_calls"
    } else {
        s.finish_reason
    }
}

async fn generate(
    st: AppState,
    c: Common,
    prompt: Vec<u32>,
    kind: Kind,
    format: OutputFormat,
    t0: Instant,
) -> Response {
    if c.n.is_some_and(|n| n > 1) {
        return crate::choices::generate_n(st, c, prompt, kind, format, t0).await;
    }
    let (tx, mut rx) = mpsc::unbounded_channel();
    let job = match job(&st, &c, prompt, kind, tx) {
        Ok(j) => j,
        Err(e) => return fail(&st, t0, e),
    };
    let head = Head {
        id: job.id.clone(),
        created: now_secs(),
        model: model_name(&st, c.model.as_ref()),
        kind,
        format,
    };
    let with_logprobs = job.logprobs.is_some();
    if let Err(e) = submit(&st, job) {
        return fail(&st, t0, e);
    }
    if c.stream {
        return stream(st, head, rx, t0).into_response();
    }
    let mut lps = Vec::new();
    let on_delta = |d: Delta| {
        if with_logprobs && let Some(l) = d.logprob {
            lps.push(l);
        }
    };
    match collect(&st, &mut rx, t0, on_delta).await {
        Ok((text, s)) => {
            st.metrics
                .request_done(Outcome::Success, t0.elapsed().as_secs_f64());
            axum::Json(head.full(&text, &lps, &s)).into_response()
        }
        Err(e) => e.into_response(),
    }
}

/// The SSE answer: one event per token, a final event with `usage` and `timings`, `[DONE]`.
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
        offset: usize,
        /// The chat answer parsed as it streams (when tools or thoughts are read).
        parser: Option<StreamParser>,
        tool_calls: bool,
    }
    let data = |v: &Value| SseEvent::default().data(v.to_string());
    let mut first = std::collections::VecDeque::new();
    if head.kind == Kind::Chat {
        first.push_back(data(&head.role_chunk()));
    }
    let init = S {
        rx,
        pending: first,
        done: false,
        offset: 0,
        parser: (head.kind == Kind::Chat && head.format.parses())
            .then(|| StreamParser::new(head.format)),
        tool_calls: false,
    };
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
                match s.rx.recv().await {
                    Some(Event::Delta(d)) if s.parser.is_some() => {
                        let diffs = s
                            .parser
                            .as_mut()
                            .map(|p| p.push(&d.text))
                            .unwrap_or_default();
                        for diff in diffs {
                            s.tool_calls |= diff.tool_call.is_some();
                            s.pending.push_back(data(&head.diff_chunk(&diff)));
                        }
                    }
                    Some(Event::Delta(d)) => {
                        let v = head.chunk(&d.text, Some(d.token), d.logprob.as_ref(), s.offset);
                        s.offset += d.text.len();
                        s.pending.push_back(data(&v));
                    }
                    Some(Event::Done(sum)) if s.parser.is_some() => {
                        let (diffs, msg) = s
                            .parser
                            .as_mut()
                            .map(|p| p.finish(&sum.tail))
                            .unwrap_or_default();
                        for diff in diffs {
                            s.pending.push_back(data(&head.diff_chunk(&diff)));
                        }
                        let calls = s.tool_calls || !msg.tool_calls.is_empty();
                        s.pending.push_back(data(&head.final_chunk(&sum, calls)));
                        s.pending.push_back(SseEvent::default().data("[DONE]"));
                        s.done = true;
                        st.metrics
                            .request_done(Outcome::Success, t0.elapsed().as_secs_f64());
                    }
                    Some(Event::Done(sum)) => {
                        if !sum.tail.is_empty() {
                            s.pending
                                .push_back(data(&head.chunk(&sum.tail, None, None, s.offset)));
                        }
                        s.pending.push_back(data(&head.final_chunk(&sum, false)));
                        s.pending.push_back(SseEvent::default().data("[DONE]"));
                        s.done = true;
                        st.metrics
                            .request_done(Outcome::Success, t0.elapsed().as_secs_f64());
                    }
                    Some(Event::Error(status, msg)) => {
                        s.pending.push_back(data(&error_body(status, &msg)));
                        s.done = true;
                        if status != 504 {
                            st.metrics
                                .request_done(Outcome::Error, t0.elapsed().as_secs_f64());
                        }
                    }
                    None => return None,
                }
            }
        }
    });
    Sse::new(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_compare_equal_only_when_identical() {
        assert!(constant_time_eq(b"secret", b"secret"));
        assert!(!constant_time_eq(b"secret", b"secreT"));
        assert!(!constant_time_eq(b"secret", b"secret2"));
        assert!(!constant_time_eq(b"", b"x"));
        assert!(constant_time_eq(b"", b""));
    }
}
