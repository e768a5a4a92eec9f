//! `specula serve`: the OpenAI-compatible server (`specula-server`) with llama-server's flags.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use specula_engine::{DflashDrafter, DraftModel, Eagle3Drafter, Engine, Injection, SpecOptions};
use specula_models::dflash::Dflash;
use specula_models::eagle3::Eagle3;
use specula_server::{ServerConfig, Speculative};
use specula_spec::ngram::{NgramCache, NgramSimple};
use specula_tokenizer::Tokenizer;

use crate::device::{BackendFor, OnDevice};
use crate::load;
use crate::run::SpecType;

/// Arguments of `specula serve` (llama-server's flag names).
#[derive(Debug, clap::Args)]
pub struct Args {
    /// GGUF file or manifest model name; default: the default model (fetched on first use).
    #[arg(short = 'm', long = "model")]
    pub model: Option<String>,
    /// Model names in responses and /v1/models, comma-separated (the first in sorted order names
    /// the model; default: the file name).
    #[arg(short = 'a', long = "alias")]
    pub alias: Option<String>,
    /// Address to listen on (llama-server's comma-separated list: one address here).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0: any free port).
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Context size of all slots together; each slot gets -c / -np.
    #[arg(short = 'c', long = "ctx-size", default_value_t = 4096)]
    pub ctx_size: usize,
    /// Parallel slots (sequences decoded together in one batched forward).
    #[arg(long = "parallel", visible_alias = "np", default_value_t = 1)]
    pub parallel: usize,
    /// Threads (0 = all cores).
    #[arg(short = 't', long, default_value_t = 0)]
    pub threads: usize,
    /// Device: `cpu`, or `cuda[:N]` (the CubeCL backend; a build with `--features cuda`);
    /// drafters run on the same device.
    #[arg(long = "device", default_value = "cpu")]
    pub device: String,
    /// Logical batch (llama-server's default 2048): the `/infill` budgets read it; a prompt
    /// chunk is min(-b, -ub).
    #[arg(short = 'b', long = "batch-size", default_value_t = 2048)]
    pub batch_size: usize,
    /// Physical batch: at most this many tokens per forward (a chunk is min(-b, -ub)).
    #[arg(long = "ubatch-size", visible_alias = "ub", default_value_t = 512)]
    pub ubatch_size: usize,
    /// Full-size cache for sliding-window layers (a cell per position, as the other layers),
    /// instead of a ring of window + batch-size cells (llama.cpp's `--swa-full`).
    #[arg(long = "swa-full")]
    pub swa_full: bool,
    /// `/infill` prompts in Suffix/Prefix/Middle order instead of Prefix/Suffix/Middle (some
    /// models are trained that way).
    #[arg(long = "spm-infill")]
    pub spm_infill: bool,
    /// K cache type.
    #[arg(long = "cache-type-k", visible_alias = "ctk", default_value = "f16")]
    pub cache_type_k: String,
    /// V cache type.
    #[arg(long = "cache-type-v", visible_alias = "ctv", default_value = "f16")]
    pub cache_type_v: String,
    /// Require one of these keys (comma-separated; `Authorization: Bearer KEY`) on every
    /// endpoint but /health and /v1/models.
    #[arg(long = "api-key")]
    pub api_key: Option<String>,
    /// File of API keys, one per line (`#` lines are comments).
    #[arg(long = "api-key-file")]
    pub api_key_file: Option<std::path::PathBuf>,
    /// Longest a request may run, in seconds.
    #[arg(long = "timeout", visible_alias = "to", default_value_t = 600)]
    pub timeout: u64,
    /// Largest request body, in bytes.
    #[arg(long = "body-limit", default_value_t = 8 << 20)]
    pub body_limit: usize,
    /// Threads of the HTTP side.
    #[arg(long = "threads-http", default_value_t = 2)]
    pub threads_http: usize,
    /// Log debug details too.
    #[arg(short = 'v', long, visible_alias = "log-verbose")]
    pub verbose: bool,
    /// No log output.
    #[arg(long = "log-disable")]
    pub log_disable: bool,
    /// The sampling defaults and llama-server's other flags.
    #[command(flatten)]
    pub llama: LlamaFlags,
    /// Draft model (GGUF file or manifest name) for speculative decoding.
    #[arg(long = "model-draft", visible_alias = "md")]
    pub model_draft: Option<String>,
    /// Speculative method; default with `-md`: from the draft GGUF's architecture (`dflash` →
    /// `draft-dflash`, `eagle3` → `draft-eagle3`, else `draft-simple`); without: none.
    #[arg(long = "spec-type", value_enum)]
    pub spec_type: Option<SpecType>,
    /// `--dflash` / `--eagle3`.
    #[command(flatten)]
    pub kind: crate::draft_args::DraftKind,
    /// The draft-model and draft-length flags shared with `specula run` (a request may change
    /// `--spec-draft-n-max`: `speculative.n_max`; `-cd` 0 is a slot's context; a DFlash or
    /// EAGLE-3 drafter's cache holds at least a slot's context).
    #[command(flatten)]
    pub draft: crate::draft_args::DraftArgs,
}

/// llama-server flags besides the loading and speculative ones: request defaults and
/// switches. Those that cannot apply here are accepted with a notice (see [`notices`]).
#[derive(Debug, clap::Args)]
#[allow(
    clippy::struct_excessive_bools,
    reason = "llama-server's on/off flags, one field each"
)]
pub struct LlamaFlags {
    /// Default temperature of a request that does not set one.
    #[arg(long = "temp", visible_alias = "temperature", default_value_t = 0.8)]
    pub temp: f32,
    /// Default seed (-1: random per request).
    #[arg(short = 's', long = "seed", default_value_t = -1, allow_negative_numbers = true)]
    pub seed: i64,
    /// Default top-k (0: off).
    #[arg(long = "top-k", default_value_t = 40)]
    pub top_k: u32,
    /// Default top-p (1.0: off).
    #[arg(long = "top-p", default_value_t = 0.95)]
    pub top_p: f32,
    /// Default min-p (0.0: off).
    #[arg(long = "min-p", default_value_t = 0.05)]
    pub min_p: f32,
    /// Default repetition penalty (1.0: off).
    #[arg(long = "repeat-penalty", default_value_t = 1.0)]
    pub repeat_penalty: f32,
    /// Default window of the penalties (0: off, -1: the slot's context).
    #[arg(
        long = "repeat-last-n",
        default_value_t = 64,
        allow_negative_numbers = true
    )]
    pub repeat_last_n: i64,
    /// Default presence penalty (0.0: off).
    #[arg(
        long = "presence-penalty",
        default_value_t = 0.0,
        allow_negative_numbers = true
    )]
    pub presence_penalty: f32,
    /// Default frequency penalty (0.0: off).
    #[arg(
        long = "frequency-penalty",
        default_value_t = 0.0,
        allow_negative_numbers = true
    )]
    pub frequency_penalty: f32,
    /// Default tokens to generate when a request sets no max_tokens (-1: until the slot's
    /// context is full).
    #[arg(
        short = 'n',
        long = "n-predict",
        visible_alias = "predict",
        default_value_t = -1,
        allow_negative_numbers = true
    )]
    pub n_predict: i64,
    /// Flash attention: on, off or auto (the CPU attention is one fused kernel either way).
    #[arg(long = "flash-attn", visible_alias = "fa", default_value = "auto", value_parser = ["on", "off", "auto", "1", "0", "true", "false", "enabled", "disabled"])]
    pub flash_attn: String,
    /// Continuous batching (always on here).
    #[arg(
        long = "cont-batching",
        visible_alias = "cb",
        overrides_with = "no_cont_batching"
    )]
    pub cont_batching: bool,
    /// Ignored with a notice: batching is always continuous.
    #[arg(long = "no-cont-batching", visible_alias = "nocb")]
    pub no_cont_batching: bool,
    /// One KV buffer shared by the slots (ignored with a notice: each slot has its own cache).
    #[arg(
        long = "kv-unified",
        visible_alias = "kvu",
        overrides_with = "no_kv_unified"
    )]
    pub kv_unified: bool,
    /// Per-slot KV caches (what this server does).
    #[arg(long = "no-kv-unified", visible_alias = "no-kvu")]
    pub no_kv_unified: bool,
    /// Shift the context when it fills (ignored with a notice: a request stops at the slot's
    /// context).
    #[arg(long = "context-shift", overrides_with = "no_context_shift")]
    pub context_shift: bool,
    /// No context shift (what this server does).
    #[arg(long = "no-context-shift")]
    pub no_context_shift: bool,
    /// Serve GET /metrics (Prometheus); without it /metrics answers 501.
    #[arg(long = "metrics")]
    pub metrics: bool,
    /// Serve GET /slots (the default).
    #[arg(long = "slots", overrides_with = "no_slots")]
    pub slots: bool,
    /// GET /slots answers 501.
    #[arg(long = "no-slots")]
    pub no_slots: bool,
    /// Directory of slot files: enables POST /slots/{id}?action=save|restore (a slot's tokens and
    /// KV cache); without it slot actions answer 501.
    #[arg(long = "slot-save-path")]
    pub slot_save_path: Option<std::path::PathBuf>,
    /// Jinja chat templates (always).
    #[arg(long = "jinja", overrides_with = "no_jinja")]
    pub jinja: bool,
    /// Ignored with a notice: templates are always rendered with Jinja.
    #[arg(long = "no-jinja")]
    pub no_jinja: bool,
    /// Chat template: a llama.cpp built-in name (chatml, llama3, zephyr) or Jinja source.
    #[arg(long = "chat-template", overrides_with = "chat_template_file")]
    pub chat_template: Option<String>,
    /// Chat template from a Jinja file (the later of this and --chat-template wins).
    #[arg(long = "chat-template-file", overrides_with = "chat_template")]
    pub chat_template_file: Option<std::path::PathBuf>,
    /// Reasoning format: none, deepseek, deepseek-legacy or auto (`<think>` stays in the
    /// content: `none`; split into `reasoning_content`: `deepseek`, or `auto` for thinking
    /// templates).
    #[arg(long = "reasoning-format", default_value = "auto", value_parser = ["none", "deepseek", "deepseek-legacy", "auto"])]
    pub reasoning_format: String,
    /// CORS origins (accepted with a notice: no CORS headers are sent).
    #[arg(long = "cors-origins")]
    pub cors_origins: Option<String>,
    /// Download nothing: a model name must already be in the cache.
    #[arg(long = "offline")]
    pub offline: bool,
    /// The built-in web UI (there is none here: accepted with a notice).
    #[arg(long = "webui", visible_alias = "ui", overrides_with = "no_webui")]
    pub webui: bool,
    /// No web UI (what this server does).
    #[arg(long = "no-webui", visible_alias = "no-ui")]
    pub no_webui: bool,
    /// Layers on the GPU (ignored with a notice: no GPU backend in this build).
    #[arg(long = "n-gpu-layers", visible_aliases = ["ngl", "gpu-layers"])]
    pub n_gpu_layers: Option<String>,
    /// Lock the model in memory (ignored with a notice).
    #[arg(long = "mlock")]
    pub mlock: bool,
    /// Read the model instead of mapping it (ignored with a notice: the model is mapped).
    #[arg(long = "no-mmap")]
    pub no_mmap: bool,
    /// Serve embeddings (refused: embeddings are not served).
    #[arg(long = "embedding", visible_alias = "embeddings")]
    pub embedding: bool,
}

/// llama.cpp's built-in chat templates this server renders (llama-chat.cpp's formats, as Jinja).
const BUILTIN_TEMPLATES: &[(&str, &str)] = &[
    (
        "chatml",
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    ),
    (
        "llama3",
        "{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content | trim }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}",
    ),
    (
        "zephyr",
        "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}<|endoftext|>\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}",
    ),
];

/// The chat template the flags ask for: `--chat-template-file` read, `--chat-template` a
/// built-in name or (with `{{` / `{%`) Jinja source; `None`: the model's.
fn chat_template(f: &LlamaFlags) -> Result<Option<String>> {
    if let Some(path) = &f.chat_template_file {
        return std::fs::read_to_string(path)
            .map(Some)
            .with_context(|| format!("cannot read --chat-template-file {}", path.display()));
    }
    let Some(name) = &f.chat_template else {
        return Ok(None);
    };
    if let Some((_, src)) = BUILTIN_TEMPLATES.iter().find(|(n, _)| n == name) {
        return Ok(Some((*src).to_string()));
    }
    if name.contains("{{") || name.contains("{%") {
        return Ok(Some(name.clone()));
    }
    let names: Vec<&str> = BUILTIN_TEMPLATES.iter().map(|(n, _)| *n).collect();
    bail!(
        "--chat-template {name}: not a built-in template this server renders ({}); give Jinja source or --chat-template-file",
        names.join(", ")
    )
}

/// The API keys of `--api-key` (comma-separated) and `--api-key-file` (one per line, `#`
/// comments), in order.
fn api_keys(args: &Args) -> Result<Vec<String>> {
    let mut keys: Vec<String> = args
        .api_key
        .iter()
        .flat_map(|k| k.split(','))
        .map(str::trim)
        .filter(|k| !k.is_empty())
        .map(String::from)
        .collect();
    if let Some(path) = &args.api_key_file {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read --api-key-file {}", path.display()))?;
        keys.extend(
            text.lines()
                .filter(|l| !l.is_empty() && !l.starts_with('#'))
                .map(String::from),
        );
    }
    Ok(keys)
}

/// One line per flag that is accepted but cannot apply here; an error for one that cannot be
/// accepted.
fn notices(args: &Args) -> Result<Vec<String>> {
    let f = &args.llama;
    if f.embedding {
        bail!("--embedding: embeddings are not served by specula serve (no /embedding endpoint)");
    }
    if args
        .host
        .split(',')
        .filter(|h| !h.trim().is_empty())
        .count()
        > 1
    {
        bail!(
            "--host {}: one address only (specula serve binds a single listener)",
            args.host
        );
    }
    let mut out = Vec::new();
    let mut ignored = |on: bool, flag: &str, why: &str| {
        if on {
            out.push(format!("ignored: {flag} ({why})"));
        }
    };
    ignored(
        f.n_gpu_layers.is_some(),
        "-ngl",
        "no GPU backend in this build",
    );
    ignored(
        f.no_cont_batching,
        "--no-cont-batching",
        "batching is always continuous; outputs do not depend on it",
    );
    ignored(
        f.kv_unified,
        "--kv-unified",
        "each slot has its own KV cache",
    );
    ignored(
        f.context_shift,
        "--context-shift",
        "no context shift; a request stops at the slot's context",
    );
    ignored(
        f.no_jinja,
        "--no-jinja",
        "chat templates are always rendered with Jinja",
    );
    ignored(
        f.cors_origins.is_some(),
        "--cors-origins",
        "no CORS headers are sent",
    );
    ignored(f.webui, "--webui", "there is no web UI");
    ignored(f.mlock, "--mlock", "the model is mapped, not locked");
    ignored(f.no_mmap, "--no-mmap", "the model is always mapped");
    Ok(out)
}

/// The server's request defaults from the sampling flags; `n_ctx_slot` for `--repeat-last-n -1`.
fn sampling(f: &LlamaFlags, n_ctx_slot: usize) -> Result<specula_sampling::SamplerParams> {
    let p = specula_sampling::SamplerParams {
        temperature: f.temp,
        top_k: f.top_k,
        top_p: f.top_p,
        min_p: f.min_p,
        repeat_penalty: f.repeat_penalty,
        repeat_last_n: match f.repeat_last_n {
            -1 => u32::try_from(n_ctx_slot).unwrap_or(u32::MAX),
            n => u32::try_from(n)
                .map_err(|_| anyhow::anyhow!("--repeat-last-n {n}: give 0 or more, or -1"))?,
        },
        presence_penalty: f.presence_penalty,
        frequency_penalty: f.frequency_penalty,
        ..specula_sampling::SamplerParams::default()
    };
    p.validate().context("bad sampling flag")?;
    Ok(p)
}

/// The names of `--alias` as llama-server reads them: comma-separated, trimmed, empty ones
/// dropped, sorted and deduplicated (a `std::set`); the first names the model.
fn model_aliases(alias: Option<&str>) -> Vec<String> {
    let set: std::collections::BTreeSet<String> = alias
        .unwrap_or("")
        .split(',')
        .map(str::trim)
        .filter(|a| !a.is_empty())
        .map(str::to_owned)
        .collect();
    set.into_iter().collect()
}

/// Runs the server until SIGTERM / Ctrl-C.
pub fn run(args: &Args) -> Result<String> {
    let level = if args.log_disable {
        tracing::level_filters::LevelFilter::OFF
    } else if args.verbose {
        tracing::level_filters::LevelFilter::DEBUG
    } else {
        tracing::level_filters::LevelFilter::INFO
    };
    let _ = tracing_subscriber::fmt()
        .with_max_level(level)
        .with_target(false)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .try_init();
    if args.parallel == 0 || args.ctx_size == 0 || args.batch_size == 0 || args.ubatch_size == 0 {
        bail!("-np, -c, -b and -ub must be positive");
    }
    for line in notices(args)? {
        eprintln!("specula serve: {line}");
    }
    if let Some(dir) = &args.llama.slot_save_path
        && !dir.is_dir()
    {
        bail!("--slot-save-path {}: not a directory", dir.display());
    }
    let template = chat_template(&args.llama)?;
    let keys = api_keys(args)?;
    let sampler = sampling(&args.llama, args.ctx_size / args.parallel)?;
    let (k_type, v_type) = (
        load::cache_type(&args.cache_type_k)?,
        load::cache_type(&args.cache_type_v)?,
    );
    // The speculative method before the model: a flag error should not wait for a load.
    let spec_kind = args
        .kind
        .resolve(args.spec_type, args.model_draft.as_deref())?;
    let device = crate::device::Device::parse(&args.device)?;
    let path = load::model_path_with(args.model.as_deref(), args.llama.offline)?;
    let ready = Ready {
        args,
        path: path.clone(),
        template,
        keys,
        sampler,
        k_type,
        v_type,
        spec_kind,
    };
    crate::device::on_device(device, &path, args.threads, ready)
}

/// What `serve` read from its flags before the model loads.
struct Ready<'a> {
    args: &'a Args,
    path: std::path::PathBuf,
    template: Option<String>,
    keys: Vec<String>,
    sampler: specula_sampling::SamplerParams,
    k_type: specula_quant::QType,
    v_type: specula_quant::QType,
    spec_kind: Option<SpecType>,
}

impl OnDevice for Ready<'_> {
    type Out = String;

    fn run<B>(self, engine: Engine<B>, backend: BackendFor<'_, B>) -> Result<String>
    where
        B: specula_tensor::Backend + Send + Sync + 'static,
        Engine<B>: Send + Sync,
    {
        serve_on(engine, self, backend)
    }
}

/// `specula serve` on an engine of any backend; drafters get a backend from `backend`.
#[allow(
    clippy::too_many_lines,
    reason = "the server's whole configuration, field by field"
)]
fn serve_on<B>(
    mut engine: Engine<B>,
    ready: Ready<'_>,
    backend: BackendFor<'_, B>,
) -> Result<String>
where
    B: specula_tensor::Backend + Send + Sync + 'static,
    Engine<B>: Send + Sync,
{
    let Ready {
        args,
        path,
        template,
        keys,
        sampler,
        k_type,
        v_type,
        spec_kind,
    } = ready;
    engine.n_batch = args.batch_size.min(args.ubatch_size);
    engine.swa_full = args.swa_full;
    let n_ctx_slot = args.ctx_size / args.parallel;
    let file = specula_gguf::Gguf::open(&path)
        .with_context(|| format!("cannot load {}", path.display()))?;
    let tokenizer = Tokenizer::from_gguf(&file)
        .with_context(|| format!("cannot build the tokenizer of {}", path.display()))?;
    let spec = speculative(args, spec_kind, &engine, n_ctx_slot, backend)?;
    // A hybrid model's recurrent layers keep a state after each row a rejection can take
    // back: the default draft length's (a request asking for more rolls back by replay),
    // none without drafts.
    engine.recurrent_snapshots = spec.as_ref().map_or(0, |s| s.options.n_max);
    load::check_cache(&engine, n_ctx_slot, k_type, v_type)?;
    let aliases = model_aliases(args.alias.as_deref());
    let name = aliases.first().cloned().unwrap_or_else(|| {
        path.file_name()
            .map_or_else(|| "specula".into(), |n| n.to_string_lossy().into_owned())
    });
    tracing::info!(
        model = %path.display(),
        slots = args.parallel,
        n_ctx_slot,
        "loaded"
    );
    let cfg = ServerConfig {
        host: args.host.clone(),
        port: args.port,
        n_parallel: args.parallel,
        n_ctx: args.ctx_size,
        k_type,
        v_type,
        api_key: keys.first().cloned(),
        extra_api_keys: keys.get(1..).unwrap_or_default().to_vec(),
        timeout: Duration::from_secs(args.timeout.max(1)),
        body_limit: args.body_limit,
        model_name: name,
        model_aliases: aliases,
        model_path: path.display().to_string(),
        http_threads: args.threads_http,
        handle_signals: true,
        force_replay: args.draft.force_replay(),
        sampling: sampler,
        seed: u64::try_from(args.llama.seed).ok(),
        n_predict: usize::try_from(args.llama.n_predict).ok(),
        metrics: args.llama.metrics,
        slots: !args.llama.no_slots,
        chat_template: template,
        slot_save_path: args.llama.slot_save_path.clone(),
        n_batch: args.batch_size,
        spm_infill: args.spm_infill,
        reasoning_format: specula_server::ReasoningFormat::from_name(&args.llama.reasoning_format)
            .unwrap_or_default(),
    };
    let server = specula_server::start(cfg, engine, tokenizer, spec)?;
    eprintln!("specula serve: listening on http://{}", server.addr());
    server.wait()?;
    Ok(String::new())
}

/// The drafters the flags ask for. Without `-md` or `--spec-type` there is none, and
/// nothing speculative is set up or logged.
/// Model drafters are loaded once and shared by the slots' drafters, each with its own cache
/// and state.
fn speculative<B>(
    args: &Args,
    kind: Option<SpecType>,
    target: &Engine<B>,
    n_ctx_slot: usize,
    backend: BackendFor<'_, B>,
) -> Result<Option<Speculative>>
where
    B: specula_tensor::Backend + Send + Sync + 'static,
    Engine<B>: Send + Sync,
{
    let kind = match kind {
        None | Some(SpecType::None) => return Ok(None),
        Some(kind) => kind,
    };
    args.draft.check()?;
    let name = crate::draft_args::spec_name(kind);
    let mut options = SpecOptions {
        n_max: args.draft.spec_n_max,
        n_min: args.draft.spec_n_min,
        p_min: args.draft.spec_p_min,
        adaptive: !args.draft.spec_fixed,
    };
    let factory: specula_server::DrafterFactory = match kind {
        SpecType::None => return Ok(None),
        SpecType::NgramSimple => Box::new(|| Ok(Box::new(NgramSimple::default()) as _)),
        SpecType::NgramCache => Box::new(|| Ok(Box::new(NgramCache::default()) as _)),
        SpecType::DraftDflash => {
            let (path, file) = draft_file(args)?;
            let backend = backend(load::threads(args.draft.threads(args.threads)))?;
            let net = Dflash::load(&*backend, file, &target.model)
                .with_context(|| format!("cannot use {} as a DFlash drafter", path.display()))?;
            let block = net.hparams().block_size;
            if options.n_max > block - 1 {
                tracing::info!(
                    "--spec-draft-n-max {} clamped to {} (the DFlash block size {block} minus the anchor)",
                    options.n_max,
                    block - 1
                );
                options.n_max = block - 1;
            }
            let policy = if args.draft.dflash_defer_injection == 1 {
                Injection::Deferred
            } else {
                Injection::Eager
            };
            let net = Arc::new(net);
            let (n_ctx, k, v) = feature_cache(args, n_ctx_slot)?;
            Box::new(move || {
                DflashDrafter::shared(Arc::clone(&backend), Arc::clone(&net), n_ctx, k, v, policy)
                    .map(|d| Box::new(d) as _)
                    .map_err(Into::into)
            })
        }
        SpecType::DraftEagle3 => {
            let (path, file) = draft_file(args)?;
            let backend = backend(load::threads(args.draft.threads(args.threads)))?;
            let net = Eagle3::load(&*backend, file, &target.model)
                .with_context(|| format!("cannot use {} as an EAGLE-3 head", path.display()))?;
            let net = Arc::new(net);
            let (n_ctx, k, v) = feature_cache(args, n_ctx_slot)?;
            Box::new(move || {
                Eagle3Drafter::shared(Arc::clone(&backend), Arc::clone(&net), n_ctx, k, v)
                    .map(|d| Box::new(d) as _)
                    .map_err(Into::into)
            })
        }
        SpecType::DraftSimple => {
            let path = load::model_path(args.model_draft.as_deref())?;
            let threads = load::threads(args.draft.threads(args.threads));
            let mut draft = load::engine_on::<B>(backend(threads)?, &path)?;
            draft.n_batch = args.batch_size.min(args.ubatch_size);
            draft.swa_full = args.swa_full;
            if let Some(msg) = crate::draft_args::restrict_draft_vocab(&mut draft, &args.draft)? {
                tracing::info!("{msg}");
            }
            specula_engine::check_vocab(&target.tokenizer, &draft.tokenizer)
                .with_context(|| format!("cannot use {} as the draft model", path.display()))?;
            let draft = Arc::new(draft);
            let target_file = target_tokenizer_copy(args)?;
            let n_ctx = if args.draft.ctx_size_draft == 0 {
                n_ctx_slot
            } else {
                args.draft.ctx_size_draft
            };
            let (k, v) = (
                load::cache_type(&args.draft.cache_type_k_draft)?,
                load::cache_type(&args.draft.cache_type_v_draft)?,
            );
            let replay = args.draft.force_replay();
            Box::new(move || {
                let mut d = DraftModel::shared(Arc::clone(&draft), &target_file, n_ctx, k, v)
                    .map_err(Box::<dyn std::error::Error + Send + Sync>::from)?;
                if replay {
                    d.force_replay();
                }
                Ok(Box::new(d) as _)
            })
        }
    };
    Ok(Some(Speculative {
        kind: name,
        options,
        factory,
    }))
}

/// The feature drafter's file (`-md`), mapped.
fn draft_file(args: &Args) -> Result<(std::path::PathBuf, Arc<specula_gguf::Gguf>)> {
    let path = load::model_path(args.model_draft.as_deref())?;
    let file = specula_gguf::Gguf::open(&path)
        .with_context(|| format!("cannot load the draft {}", path.display()))?;
    Ok((path, Arc::new(file)))
}

/// Cells and formats of a feature drafter's cache: it holds context for every position of
/// its slot, so at least a slot's context (`-cd` may ask for more).
fn feature_cache(
    args: &Args,
    n_ctx_slot: usize,
) -> Result<(usize, specula_quant::QType, specula_quant::QType)> {
    Ok((
        n_ctx_slot.max(args.draft.ctx_size_draft),
        load::cache_type(&args.draft.cache_type_k_draft)?,
        load::cache_type(&args.draft.cache_type_v_draft)?,
    ))
}

/// The target's tokenizer once more, owned by the draft factory (it checks each drafter's
/// vocabulary against it).
fn target_tokenizer_copy(args: &Args) -> Result<Tokenizer> {
    let path = load::model_path(args.model.as_deref())?;
    let file = specula_gguf::Gguf::open(&path)
        .with_context(|| format!("cannot load {}", path.display()))?;
    Ok(Tokenizer::from_gguf(&file)?)
}
