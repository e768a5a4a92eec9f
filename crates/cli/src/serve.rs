//! `specula serve`: the OpenAI-compatible server (`specula-server`) with llama-server's flags.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use specula_cpu::CpuBackend;
use specula_engine::{DflashDrafter, DraftModel, Eagle3Drafter, Engine, Injection, SpecOptions};
use specula_models::dflash::Dflash;
use specula_models::eagle3::Eagle3;
use specula_server::{ServerConfig, Speculative};
use specula_spec::ngram::{NgramCache, NgramSimple};
use specula_tokenizer::Tokenizer;

use crate::load;
use crate::run::SpecType;

/// Arguments of `specula serve` (llama-server's flag names).
#[derive(Debug, clap::Args)]
pub struct Args {
    /// GGUF file or manifest model name; default: the default model (fetched on first use).
    #[arg(short = 'm', long = "model")]
    pub model: Option<String>,
    /// Model name in responses and /v1/models (default: the file name).
    #[arg(short = 'a', long = "alias")]
    pub alias: Option<String>,
    /// Address to listen on.
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
    /// Tokens per prompt chunk.
    #[arg(short = 'b', long = "batch-size", default_value_t = 512)]
    pub batch_size: usize,
    /// Full-size cache for sliding-window layers (a cell per position, as the other layers),
    /// instead of a ring of window + batch-size cells (llama.cpp's `--swa-full`).
    #[arg(long = "swa-full")]
    pub swa_full: bool,
    /// K cache type.
    #[arg(long = "cache-type-k", visible_alias = "ctk", default_value = "f16")]
    pub cache_type_k: String,
    /// V cache type.
    #[arg(long = "cache-type-v", visible_alias = "ctv", default_value = "f16")]
    pub cache_type_v: String,
    /// Require this key (`Authorization: Bearer KEY`) on every endpoint but /health and
    /// /v1/models.
    #[arg(long = "api-key")]
    pub api_key: Option<String>,
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
    #[arg(short = 'v', long)]
    pub verbose: bool,
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

/// Runs the server until SIGTERM / Ctrl-C.
pub fn run(args: &Args) -> Result<String> {
    let level = if args.verbose {
        tracing::Level::DEBUG
    } else {
        tracing::Level::INFO
    };
    let _ = tracing_subscriber::fmt()
        .with_max_level(level)
        .with_target(false)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .try_init();
    if args.parallel == 0 || args.ctx_size == 0 || args.batch_size == 0 {
        bail!("-np, -c and -b must be positive");
    }
    let (k_type, v_type) = (
        load::cache_type(&args.cache_type_k)?,
        load::cache_type(&args.cache_type_v)?,
    );
    // The speculative method before the model: a flag error should not wait for a load.
    let spec_kind = args
        .kind
        .resolve(args.spec_type, args.model_draft.as_deref())?;
    let path = load::model_path(args.model.as_deref())?;
    let mut engine = load::cpu_engine(&path, args.threads)?;
    engine.n_batch = args.batch_size;
    engine.swa_full = args.swa_full;
    let n_ctx_slot = args.ctx_size / args.parallel;
    load::check_cache(&engine, n_ctx_slot, k_type, v_type)?;
    let file = specula_gguf::Gguf::open(&path)
        .with_context(|| format!("cannot load {}", path.display()))?;
    let tokenizer = Tokenizer::from_gguf(&file)
        .with_context(|| format!("cannot build the tokenizer of {}", path.display()))?;
    let spec = speculative(args, spec_kind, &engine, n_ctx_slot)?;
    let name = args.alias.clone().unwrap_or_else(|| {
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
        api_key: args.api_key.clone().filter(|k| !k.is_empty()),
        timeout: Duration::from_secs(args.timeout.max(1)),
        body_limit: args.body_limit,
        model_name: name,
        model_path: path.display().to_string(),
        http_threads: args.threads_http,
        handle_signals: true,
        force_replay: args.draft.force_replay(),
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
fn speculative(
    args: &Args,
    kind: Option<SpecType>,
    target: &Engine<CpuBackend>,
    n_ctx_slot: usize,
) -> Result<Option<Speculative>> {
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
            let backend = CpuBackend::new(args.draft.threads(args.threads));
            let net = Dflash::load(&backend, file, &target.model)
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
            let (backend, net) = (Arc::new(backend), Arc::new(net));
            let (n_ctx, k, v) = feature_cache(args, n_ctx_slot)?;
            Box::new(move || {
                DflashDrafter::shared(Arc::clone(&backend), Arc::clone(&net), n_ctx, k, v, policy)
                    .map(|d| Box::new(d) as _)
                    .map_err(Into::into)
            })
        }
        SpecType::DraftEagle3 => {
            let (path, file) = draft_file(args)?;
            let backend = CpuBackend::new(args.draft.threads(args.threads));
            let net = Eagle3::load(&backend, file, &target.model)
                .with_context(|| format!("cannot use {} as an EAGLE-3 head", path.display()))?;
            let (backend, net) = (Arc::new(backend), Arc::new(net));
            let (n_ctx, k, v) = feature_cache(args, n_ctx_slot)?;
            Box::new(move || {
                Eagle3Drafter::shared(Arc::clone(&backend), Arc::clone(&net), n_ctx, k, v)
                    .map(|d| Box::new(d) as _)
                    .map_err(Into::into)
            })
        }
        SpecType::DraftSimple => {
            let path = load::model_path(args.model_draft.as_deref())?;
            let threads = args.draft.threads(args.threads);
            let mut draft = load::cpu_engine(&path, threads)?;
            draft.n_batch = args.batch_size;
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
