//! An OpenAI-compatible HTTP server on top of [`specula_engine`], with speculative decoding,
//! parallel slots and Prometheus metrics — the shapes llama-server users know.
//!
//! - [`start`] loads nothing itself: it takes an [`Engine`], a second [`Tokenizer`] of the
//!   same model (for the HTTP side: chat templates, `/tokenize`), and optionally a
//!   [`DrafterFactory`] making one drafter per slot, binds the address and returns a
//!   [`ServerHandle`].
//! - The model runs on one dedicated engine thread that owns the slots: `-np N` sequences,
//!   each with its own KV cache and drafter. Each engine step runs one batched forward over
//!   every generating slot (its anchor token plus its draft when it speculates): continuous
//!   batching, with batch-invariant kernels so that a request's output does not depend on
//!   what runs beside it. A new request's prompt is read in chunks that ride in the same
//!   batched forward, reusing the longest prefix its slot already holds.
//! - Any [`Drafter`] works per slot, feature drafters (DFlash, DFlash2, EAGLE-3) included: the
//!   batched forward captures target hidden states for the slots whose drafter asks
//!   ([`Drafter::target_taps`]) and hands each its own rows, prompt chunks and verify batches
//!   alike; on a prompt-cache hit the drafter's context is cut to exactly the reused positions
//!   ([`Drafter::begin_reusing`]), so a hit drafts as a cold request does.
//! - Endpoints: `POST /v1/chat/completions`, `POST /v1/completions` (SSE streaming or not),
//!   `GET /v1/models`, `GET /health`, `GET /metrics`, `GET /slots`, `GET /props`,
//!   `POST /tokenize`, `POST /detokenize`. Responses carry OpenAI `usage` and llama-server
//!   `timings` (`prompt_n`, `prompt_ms`, `predicted_n`, `predicted_ms`, `draft_n`,
//!   `draft_n_accepted`; ours: `draft_replays`, the verify steps rolled back by checkpoint and
//!   replay instead of a trim).
//! - Hardening: `--api-key` (Bearer, constant-time compare), a body size limit, limits that
//!   answer 400 with what to change, a per-request timeout, cancellation when the client goes
//!   away, graceful shutdown on SIGTERM / Ctrl-C.
//!
//! ```no_run
//! # fn demo(engine: specula_engine::Engine<specula_cpu::CpuBackend>, tok: specula_tokenizer::Tokenizer) -> Result<(), specula_server::ServerError> {
//! let cfg = specula_server::ServerConfig::default();
//! let server = specula_server::start(cfg, engine, tok, None)?;
//! println!("listening on http://{}", server.addr());
//! server.wait()
//! # }
//! ```

mod anthropic;
mod api;
mod choices;
mod http;
mod infill;
mod metrics;
mod native;
mod responses;
mod slots;
mod structured;
mod text;
mod tools;
mod worker;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use specula_engine::{Engine, EngineError, SpecOptions};
use specula_quant::QType;
use specula_spec::Drafter;
use specula_tensor::Backend;
use specula_tokenizer::Tokenizer;

pub use tools::ReasoningFormat;

/// Errors starting or running the server.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServerError {
    /// The address cannot be bound.
    #[error("cannot listen on {addr}")]
    Bind {
        /// The address.
        addr: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// `-np 0`.
    #[error("-np must be at least 1")]
    NoSlots,
    /// A context too small to give each slot room.
    #[error(
        "-c {n_ctx} over -np {n_parallel} leaves {n_ctx_slot} positions per slot (want at least 2); raise -c or lower -np"
    )]
    SlotContext {
        /// `-c`.
        n_ctx: usize,
        /// `-np`.
        n_parallel: usize,
        /// `n_ctx / n_parallel`.
        n_ctx_slot: usize,
    },
    /// A slot's cache cannot be allocated.
    #[error("cannot allocate the cache of slot {slot}")]
    SlotCache {
        /// The slot.
        slot: usize,
        /// Why.
        #[source]
        source: EngineError,
    },
    /// A slot's drafter cannot be made (the [`DrafterFactory`] failed).
    #[error("cannot make the drafter of slot {slot}")]
    SlotDrafter {
        /// The slot.
        slot: usize,
        /// The factory's error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The slots' drafters cannot serve one batch (they ask for different target taps).
    #[error("the slots' drafters cannot share one batch")]
    SlotDrafters(#[source] specula_spec::SpecError),
    /// The engine thread ended before it was ready.
    #[error("the engine thread stopped while starting")]
    EngineStopped,
    /// The engine failed.
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// The async runtime or a server thread failed.
    #[error("server runtime: {what}")]
    Runtime {
        /// What was being done.
        what: &'static str,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The chat template given in place of the model's does not compile.
    #[error("cannot use the given chat template")]
    ChatTemplate(#[source] specula_tokenizer::TokenizerError),
    /// The HTTP thread panicked.
    #[error("server runtime: the HTTP thread panicked")]
    HttpPanicked,
}

/// An error and its causes, outermost first, joined by `: ` (what a 500 response and a log
/// line carry: `decoding failed: the draft-simple drafter failed: KV cache full: …`).
pub(crate) fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

/// The name of the engine thread.
const ENGINE_THREAD: &str = "specula-engine";

/// A panic on the engine thread is a bug that the worker catches and turns into a failed
/// request (a 500 naming it): the log gets one error line for it, not the default hook's
/// message and backtrace on stderr. Panics on other threads keep the previous hook.
fn quiet_engine_panics() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if std::thread::current().name() == Some(ENGINE_THREAD) {
                let location = info
                    .location()
                    .map_or_else(String::new, |l| format!("{}:{}", l.file(), l.line()));
                tracing::error!(
                    location,
                    "panic on the engine thread (caught; the request fails): {}",
                    specula_spec::batch::panic_message(info.payload())
                );
            } else {
                previous(info);
            }
        }));
    });
}

/// Makes one drafter (called once per slot, on the engine thread).
pub type DrafterFactory =
    Box<dyn FnMut() -> Result<Box<dyn Drafter>, Box<dyn std::error::Error + Send + Sync>> + Send>;

/// Speculative decoding of the server: a drafter per slot and the default options that a
/// request may override (`speculative.n_max`, `speculative.n_min`, `speculative.p_min`).
pub struct Speculative {
    /// The method's name (`--spec-type`), reported in `/slots` and `/props`.
    pub kind: String,
    /// Defaults.
    pub options: SpecOptions,
    /// Makes the drafters.
    pub factory: DrafterFactory,
}

impl std::fmt::Debug for Speculative {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Speculative")
            .field("kind", &self.kind)
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

/// Settings of [`start`] (llama-server's flags in the CLI).
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// Address to bind (`--host`).
    pub host: String,
    /// Port (`--port`; 0 picks a free one).
    pub port: u16,
    /// Slots (`-np`).
    pub n_parallel: usize,
    /// Context of all slots together (`-c`); each slot gets `n_ctx / n_parallel`.
    pub n_ctx: usize,
    /// K cache format (`-ctk`).
    pub k_type: QType,
    /// V cache format (`-ctv`).
    pub v_type: QType,
    /// Required Bearer key (`--api-key`).
    pub api_key: Option<String>,
    /// Further keys accepted beside `api_key` (llama-server's comma-separated `--api-key`
    /// and `--api-key-file`); read only when `api_key` is set.
    pub extra_api_keys: Vec<String>,
    /// Longest a request may run (`--timeout`).
    pub timeout: Duration,
    /// Largest request body in bytes.
    pub body_limit: usize,
    /// The model's name in responses and `/v1/models` (`--alias`: the first of its names).
    pub model_name: String,
    /// Every name of `--alias` (llama-server's comma-separated list, sorted), listed as the
    /// model's `aliases` in `/v1/models`.
    pub model_aliases: Vec<String>,
    /// The model file, as `/props` reports it (`model_path`); empty when not from a file.
    pub model_path: String,
    /// Threads of the HTTP runtime.
    pub http_threads: usize,
    /// Stop on SIGTERM / Ctrl-C.
    pub handle_signals: bool,
    /// Roll the slots' caches (and draft models' caches) back by checkpoint and replay even
    /// where they could trim (`--spec-rollback replay`): slower, for testing that path.
    pub force_replay: bool,
    /// Sampling defaults of a request that does not set a field (`--temp`, `--top-k`,
    /// `--top-p`, `--min-p`, `--repeat-penalty`, `--repeat-last-n`, `--presence-penalty`,
    /// `--frequency-penalty`); the `seed` field is not read: see `seed`.
    pub sampling: specula_sampling::SamplerParams,
    /// Seed of a request without `seed` (`--seed`); `None` (`--seed -1`): a fresh random seed
    /// per request.
    pub seed: Option<u64>,
    /// Tokens a request without `max_tokens` / `n_predict` may generate (`-n`); `None`: until
    /// the slot's context is full.
    pub n_predict: Option<usize>,
    /// Serve `GET /metrics` (`--metrics`); off, it answers 501 as llama-server does. On by
    /// default here; the CLI follows llama-server (off unless `--metrics`).
    pub metrics: bool,
    /// Serve `GET /slots` (`--slots` / `--no-slots`); off, it answers 501.
    pub slots: bool,
    /// A chat template (Jinja source) used instead of the model's
    /// (`--chat-template`, `--chat-template-file`).
    pub chat_template: Option<String>,
    /// The directory of `POST /slots/{id}?action=save|restore` (`--slot-save-path`); `None`:
    /// slot actions answer 501, as llama-server's without the flag.
    pub slot_save_path: Option<std::path::PathBuf>,
    /// The logical batch (`-b`): only the budgets of `/infill`'s prompt read it, as
    /// llama-server's `format_prompt_infill` (the engine's forward size is its own `n_batch`).
    pub n_batch: usize,
    /// `/infill` builds Suffix/Prefix/Middle prompts instead of Prefix/Suffix/Middle
    /// (llama-server's `--spm-infill`, for models trained that way).
    pub spm_infill: bool,
    /// What becomes of `<think>…</think>` in chat answers (`--reasoning-format`); a request's
    /// `reasoning_format` overrides it.
    pub reasoning_format: ReasoningFormat,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            host: "127.0.0.1".into(),
            port: 8080,
            n_parallel: 1,
            n_ctx: 4096,
            k_type: QType::F16,
            v_type: QType::F16,
            api_key: None,
            extra_api_keys: Vec::new(),
            timeout: Duration::from_secs(600),
            body_limit: 8 << 20,
            model_name: "specula".into(),
            model_aliases: Vec::new(),
            model_path: String::new(),
            http_threads: 2,
            handle_signals: false,
            force_replay: false,
            sampling: specula_sampling::SamplerParams::default(),
            seed: None,
            n_predict: None,
            metrics: true,
            slots: true,
            chat_template: None,
            slot_save_path: None,
            n_batch: 2048,
            spm_infill: false,
            reasoning_format: ReasoningFormat::Auto,
        }
    }
}

/// A running server.
#[derive(Debug)]
pub struct ServerHandle {
    addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<Result<(), ServerError>>>,
}

impl ServerHandle {
    /// The bound address.
    #[must_use]
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops accepting connections, lets the requests in flight finish, stops the engine.
    ///
    /// # Errors
    /// A failure of the runtime.
    pub fn shutdown(mut self) -> Result<(), ServerError> {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        self.join()
    }

    /// Runs until a signal (with `handle_signals`) or [`ServerHandle::shutdown`].
    ///
    /// # Errors
    /// A failure of the runtime.
    pub fn wait(mut self) -> Result<(), ServerError> {
        self.join()
    }

    fn join(&mut self) -> Result<(), ServerError> {
        match self.thread.take() {
            Some(t) => t.join().map_err(|_| ServerError::HttpPanicked)?,
            None => Ok(()),
        }
    }
}

impl Drop for ServerHandle {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        let _ = self.join();
    }
}

/// Starts the engine thread (allocating every slot's cache and drafter) and the HTTP server.
///
/// # Errors
/// Bad settings, a cache or drafter that cannot be made, an address that cannot be bound.
pub fn start<B>(
    cfg: ServerConfig,
    engine: Engine<B>,
    tokenizer: Tokenizer,
    spec: Option<Speculative>,
) -> Result<ServerHandle, ServerError>
where
    B: Backend + 'static,
    Engine<B>: Send,
{
    if cfg.n_parallel == 0 {
        return Err(ServerError::NoSlots);
    }
    quiet_engine_panics();
    let n_ctx_slot = cfg.n_ctx / cfg.n_parallel;
    if n_ctx_slot < 2 {
        return Err(ServerError::SlotContext {
            n_ctx: cfg.n_ctx,
            n_parallel: cfg.n_parallel,
            n_ctx_slot,
        });
    }
    let addr = format!("{}:{}", cfg.host, cfg.port);
    let listener = std::net::TcpListener::bind(&addr).map_err(|source| ServerError::Bind {
        addr: addr.clone(),
        source,
    })?;
    let local = listener.local_addr().map_err(|source| ServerError::Bind {
        addr: addr.clone(),
        source,
    })?;
    listener
        .set_nonblocking(true)
        .map_err(|source| ServerError::Runtime {
            what: "cannot make the listener non-blocking",
            source,
        })?;

    // The template before the engine starts: a bad --chat-template-file fails at once.
    let template = match &cfg.chat_template {
        Some(source) => Some(Arc::new(
            tokenizer
                .chat_template_from(source)
                .map_err(ServerError::ChatTemplate)?,
        )),
        None => match tokenizer.chat_template() {
            Ok(t) => Some(Arc::new(t)),
            Err(e) => {
                tracing::warn!(
                    "no usable chat template ({e}); /v1/chat/completions will answer 400"
                );
                None
            }
        },
    };
    let template_thinks = cfg
        .chat_template
        .as_deref()
        .or_else(|| tokenizer.chat_template_source())
        .is_some_and(|t| t.contains("<think>"));
    let hp = engine.model.hparams().clone();
    let file = Arc::clone(engine.model.file());
    let metrics = Arc::new(metrics::Metrics::default());
    let (tx, rx) = std::sync::mpsc::channel();
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let slot_cfg = worker::SlotConfig {
        n_parallel: cfg.n_parallel,
        n_ctx_slot,
        k_type: cfg.k_type,
        v_type: cfg.v_type,
        force_replay: cfg.force_replay,
    };
    let spec_kind = spec.as_ref().map(|s| (s.kind.clone(), s.options));
    let wm = Arc::clone(&metrics);
    let engine_thread = std::thread::Builder::new()
        .name(ENGINE_THREAD.into())
        .spawn(move || {
            let spec = spec.map(|s| {
                (
                    worker::SpecSetup {
                        kind: s.kind,
                        options: s.options,
                    },
                    s.factory,
                )
            });
            match worker::Worker::new(engine, &slot_cfg, spec, rx, wm) {
                Ok(w) => {
                    let _ = ready_tx.send(Ok(w.rollback()));
                    w.run();
                }
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                }
            }
        })
        .map_err(|source| ServerError::Runtime {
            what: "cannot start the engine thread",
            source,
        })?;
    let rollback = match ready_rx.recv() {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => {
            let _ = engine_thread.join();
            return Err(e);
        }
        Err(_) => {
            let _ = engine_thread.join();
            return Err(ServerError::EngineStopped);
        }
    };

    let state = http::AppState {
        tx: tx.clone(),
        tokenizer: Arc::new(tokenizer),
        template,
        metrics,
        limits: Arc::new(http::Limits {
            n_ctx_slot,
            n_parallel: cfg.n_parallel,
            api_key: cfg.api_key.clone(),
            extra_api_keys: cfg.extra_api_keys.clone(),
            timeout: cfg.timeout,
            body_limit: cfg.body_limit,
            model_name: cfg.model_name.clone(),
            model_aliases: cfg.model_aliases.clone(),
            n_embd: hp.n_embd,
            model_path: cfg.model_path.clone(),
            n_vocab: hp.n_vocab,
            n_ctx_train: hp.n_ctx_train,
            n_params: file.n_params(),
            model_size: file.tensor_bytes(),
            ftype: file.file_type_name(),
            spec: spec_kind,
            rollback: rollback.name(),
            sampling: cfg.sampling,
            seed: cfg.seed,
            n_predict: cfg.n_predict,
            metrics: cfg.metrics,
            slots: cfg.slots,
            slot_save_path: cfg.slot_save_path.clone(),
            n_batch: cfg.n_batch,
            spm_infill: cfg.spm_infill,
            reasoning_format: cfg.reasoning_format,
            template_thinks,
        }),
        grammars: Arc::default(),
        started: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
    };
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let http_threads = cfg.http_threads.max(1);
    let handle_signals = cfg.handle_signals;
    let thread = std::thread::Builder::new()
        .name("specula-http".into())
        .spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(http_threads)
                .thread_name("specula-http-worker")
                .enable_all()
                .build()
                .map_err(|source| ServerError::Runtime {
                    what: "cannot build the HTTP runtime",
                    source,
                })?;
            let served = rt.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(listener).map_err(|source| {
                    ServerError::Runtime {
                        what: "cannot register the listener",
                        source,
                    }
                })?;
                let app = http::router(state);
                axum::serve(listener, app)
                    .with_graceful_shutdown(shutdown_signal(stop_rx, handle_signals))
                    .await
                    .map_err(|source| ServerError::Runtime {
                        what: "the HTTP server failed",
                        source,
                    })
            });
            tracing::info!("HTTP server stopped; stopping the engine");
            let _ = tx.send(worker::Command::Shutdown);
            let _ = engine_thread.join();
            served
        })
        .map_err(|source| ServerError::Runtime {
            what: "cannot start the HTTP thread",
            source,
        })?;
    tracing::info!("listening on http://{local}");
    Ok(ServerHandle {
        addr: local,
        stop: Some(stop_tx),
        thread: Some(thread),
    })
}

/// Resolves when the handle asks to stop, or on SIGTERM / Ctrl-C when `signals`.
async fn shutdown_signal(stop: tokio::sync::oneshot::Receiver<()>, signals: bool) {
    let ctrl_c = async {
        if signals {
            let _ = tokio::signal::ctrl_c().await;
        } else {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        if signals {
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(mut s) => {
                    s.recv().await;
                }
                Err(_) => std::future::pending::<()>().await,
            }
        } else {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = stop => {}
        () = ctrl_c => tracing::info!("Ctrl-C: finishing the requests in flight, then stopping"),
        () = term => tracing::info!("SIGTERM: finishing the requests in flight, then stopping"),
    }
}
