//! `specula run`: generate text from a prompt, like llama.cpp's `llama-cli` / `llama-simple`.

use std::io::Write as _;
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use serde::Serialize;
use specula_engine::{
    DflashDrafter, DraftModel, Eagle3Drafter, GenerateOptions, Injection, SpecOptions, Timings,
};
use specula_grammar::{Grammars, Spec};
use specula_sampling::SamplerParams;
use specula_spec::ngram::{NgramCache, NgramSimple};
use specula_spec::{Drafter, SpecStats};
use specula_tokenizer::{ChatMessage, EncodeOptions};

use crate::device::{BackendFor, OnDevice};
use crate::load;

/// Arguments of `specula run` (llama.cpp flag names).
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Flash attention (llama.cpp's `-fa`): on, off or auto; accepted so llama.cpp command lines
    /// run unchanged (the CPU attention is one fused kernel either way).
    #[arg(long = "flash-attn", visible_alias = "fa", default_value = "auto", value_parser = ["on", "off", "auto", "1", "0", "true", "false", "enabled", "disabled"])]
    pub flash_attn: String,
    /// GGUF file or manifest model name; default: the default model (fetched on first use).
    #[arg(short = 'm', long = "model")]
    pub model: Option<String>,
    /// Prompt text.
    #[arg(short = 'p', long = "prompt", conflicts_with = "file")]
    pub prompt: Option<String>,
    /// Read the prompt from a file.
    #[arg(short = 'f', long = "file")]
    pub file: Option<std::path::PathBuf>,
    /// Tokens to generate.
    #[arg(short = 'n', long = "n-predict", default_value_t = 128)]
    pub n_predict: usize,
    /// Temperature (0 = greedy).
    #[arg(long, default_value_t = 0.8, allow_negative_numbers = true)]
    pub temp: f32,
    /// Top-k (0 = off).
    #[arg(long = "top-k", default_value_t = 40)]
    pub top_k: u32,
    /// Top-p (1 = off).
    #[arg(long = "top-p", default_value_t = 0.95)]
    pub top_p: f32,
    /// Min-p (0 = off).
    #[arg(long = "min-p", default_value_t = 0.05)]
    pub min_p: f32,
    /// Repetition penalty (1 = off).
    #[arg(long = "repeat-penalty", default_value_t = 1.0)]
    pub repeat_penalty: f32,
    /// RNG seed.
    #[arg(short = 's', long, default_value_t = specula_sampling::DEFAULT_SEED)]
    pub seed: u64,
    /// Context size.
    #[arg(short = 'c', long = "ctx-size", default_value_t = 4096)]
    pub ctx_size: usize,
    /// Threads (0 = all cores).
    #[arg(short = 't', long, default_value_t = 0)]
    pub threads: usize,
    /// Device: `cpu`, or `cuda[:N]` (the CubeCL backend; a build with `--features cuda`). A
    /// DFlash / EAGLE-3 drafter or a draft model runs on the same device.
    #[arg(long = "device", default_value = "cpu")]
    pub device: String,
    /// Tokens per prefill batch.
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
    /// Per-layer K/V cache types.
    #[command(flatten)]
    pub layer_types: load::LayerTypeArgs,
    /// Apply the model's chat template to the prompt as one user message.
    #[arg(long)]
    pub chat: bool,
    /// Print one JSON object instead of the text.
    #[arg(long)]
    pub json: bool,
    /// Add the top-K `[id, logit]` pairs of every generated position to the JSON.
    #[arg(long = "top-logits", default_value_t = 0)]
    pub top_logits: usize,
    /// Feed these comma-separated ids after the prompt instead of sampling (teacher forcing).
    #[arg(long = "force-ids", value_delimiter = ',')]
    pub force_ids: Option<Vec<u32>>,
    /// Do not stop at end-of-generation tokens.
    #[arg(long = "ignore-eos")]
    pub ignore_eos: bool,
    /// Constrain the output to this GBNF grammar (llama.cpp's `--grammar`).
    #[arg(long, group = "structured")]
    pub grammar: Option<String>,
    /// Constrain the output to the GBNF grammar in this file.
    #[arg(long = "grammar-file", group = "structured")]
    pub grammar_file: Option<std::path::PathBuf>,
    /// Constrain the output to JSON that follows this JSON schema (`{}`: any JSON object).
    #[arg(short = 'j', long = "json-schema", group = "structured")]
    pub json_schema: Option<String>,
    /// Constrain the output to JSON that follows the JSON schema in this file (`-jf`).
    #[arg(long = "json-schema-file", group = "structured")]
    pub json_schema_file: Option<std::path::PathBuf>,
    /// Draft model (GGUF file or manifest name) for speculative decoding.
    #[arg(long = "model-draft", visible_alias = "md")]
    pub model_draft: Option<String>,
    /// Speculative method; default with `-md`: from the draft GGUF's architecture (`dflash` →
    /// `draft-dflash`, `eagle3` → `draft-eagle3`, else `draft-simple`); without: `ngram-simple`.
    #[arg(long = "spec-type", value_enum)]
    pub spec_type: Option<SpecType>,
    /// `--dflash` / `--eagle3`.
    #[command(flatten)]
    pub kind: crate::draft_args::DraftKind,
    /// The draft-model and draft-length flags shared with `specula serve`.
    #[command(flatten)]
    pub draft: crate::draft_args::DraftArgs,
}

/// `--spec-type` (llama.cpp's names).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum SpecType {
    /// No speculation.
    None,
    /// A draft model (`-md`).
    DraftSimple,
    /// Prompt lookup: continue the most recent earlier match of the last tokens.
    NgramSimple,
    /// Frequent continuations of the last tokens seen so far.
    NgramCache,
    /// An EAGLE-3 head (`-md`).
    DraftEagle3,
    /// A DFlash block drafter (`-md`).
    DraftDflash,
}

#[derive(Serialize)]
struct JsonTimings {
    prompt_n: usize,
    prompt_ms: f64,
    predicted_n: usize,
    predicted_ms: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    draft_n: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    draft_n_accepted: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    draft_rounds: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    draft_replays: Option<usize>,
}

impl JsonTimings {
    fn new(t: Timings, spec: Option<&SpecStats>) -> Self {
        Self {
            prompt_n: t.prompt_n,
            prompt_ms: t.prompt_ms,
            predicted_n: t.predicted_n,
            predicted_ms: t.predicted_ms,
            draft_n: spec.map(|s| s.drafted),
            draft_n_accepted: spec.map(|s| s.accepted),
            draft_rounds: spec.map(|s| s.rounds),
            draft_replays: spec.map(|s| s.replays),
        }
    }
}

/// The speculative details of a run.
#[derive(Serialize)]
struct JsonSpec {
    #[serde(rename = "type")]
    kind: String,
    mean_accept_len: f64,
    acceptance: f64,
    accept_by_position: Vec<f64>,
    /// How the target's cache took back rejected rows (`trim` / `replay`).
    rollback: &'static str,
    /// Rows the replays ran again.
    replayed: usize,
}

#[derive(Serialize)]
struct JsonOut {
    model: String,
    prompt_ids: Vec<u32>,
    generated_ids: Vec<u32>,
    text: String,
    timings: JsonTimings,
    #[serde(skip_serializing_if = "Option::is_none")]
    top_logits: Option<Vec<Vec<(u32, f32)>>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    spec: Option<JsonSpec>,
    kv: JsonKv,
}

/// The KV cache the run allocated.
#[derive(Serialize)]
struct JsonKv {
    /// Bytes of the whole cache (every layer's cells, K and V).
    bytes: usize,
    /// Cells of the global layers (the context size).
    n_ctx: usize,
    /// Cells of the sliding-window layers' ring, when they keep one.
    #[serde(skip_serializing_if = "Option::is_none")]
    swa_ring: Option<usize>,
}

/// Runs `specula run`; streams text to stdout (or returns the JSON).
pub fn run(args: &Args) -> Result<String> {
    if args.temp.is_nan() || args.temp < 0.0 {
        bail!("--temp must be >= 0, got {}", args.temp);
    }
    if args.ctx_size == 0 || args.batch_size == 0 {
        bail!("-c and -b must be positive");
    }
    let prompt = match (&args.prompt, &args.file) {
        (Some(p), None) => p.clone(),
        (None, Some(f)) => std::fs::read_to_string(f)
            .with_context(|| format!("cannot read the prompt file {}", f.display()))?,
        (None, None) => String::new(),
        (Some(_), Some(_)) => bail!("give either -p or -f, not both"),
    };
    let (k_type, v_type) = (
        load::cache_type(&args.cache_type_k)?,
        load::cache_type(&args.cache_type_v)?,
    );
    let overrides = load::layer_types(&args.layer_types)?;
    // The speculative method before the model: a flag error should not wait for a load.
    let spec_kind = args
        .kind
        .resolve(args.spec_type, args.model_draft.as_deref())?
        .unwrap_or(SpecType::NgramSimple);
    let structured = structured_spec(args)?;
    let device = crate::device::Device::parse(&args.device)?;
    let path = load::model_path(args.model.as_deref())?;
    let ready = Ready {
        args,
        path: path.clone(),
        prompt,
        k_type,
        v_type,
        overrides,
        spec_kind,
        structured,
    };
    crate::device::on_device(device, &path, args.threads, ready)
}

/// What `run` read from its flags before the model loads.
struct Ready<'a> {
    args: &'a Args,
    path: std::path::PathBuf,
    prompt: String,
    k_type: specula_quant::QType,
    v_type: specula_quant::QType,
    overrides: Vec<specula_tensor::LayerOverride>,
    spec_kind: SpecType,
    structured: Option<Spec>,
}

impl OnDevice for Ready<'_> {
    type Out = String;

    fn run<B>(self, engine: specula_engine::Engine<B>, backend: BackendFor<'_, B>) -> Result<String>
    where
        B: specula_tensor::Backend + Send + Sync + 'static,
        specula_engine::Engine<B>: Send + Sync,
    {
        run_on(engine, self, backend)
    }
}

/// `specula run` on an engine of any backend; drafters get a backend from `backend`.
#[allow(
    clippy::too_many_lines,
    reason = "one generation, from the prompt to the report"
)]
fn run_on<B: specula_tensor::Backend + 'static>(
    mut engine: specula_engine::Engine<B>,
    ready: Ready<'_>,
    backend: BackendFor<'_, B>,
) -> Result<String> {
    let Ready {
        args,
        path,
        prompt,
        k_type,
        v_type,
        overrides,
        spec_kind,
        structured,
    } = ready;
    engine.n_batch = args.batch_size;
    engine.swa_full = args.swa_full;

    let text = if args.chat {
        let template = engine
            .tokenizer
            .chat_template()
            .context("--chat needs a chat template")?;
        template.render(
            &[ChatMessage {
                role: "user".into(),
                content: prompt,
            }],
            true,
        )?
    } else {
        prompt
    };
    let mut prompt_ids = engine.tokenizer.encode_with(
        &text,
        EncodeOptions {
            add_special: true,
            parse_special: true,
        },
    );
    if prompt_ids.is_empty() {
        // An empty prompt without BOS: start from BOS if the model has one, as llama.cpp does.
        match engine.tokenizer.special_tokens().bos {
            Some(bos) => prompt_ids.push(bos),
            None => bail!("the prompt is empty and the model has no BOS token to start from"),
        }
    }

    let sampler = SamplerParams {
        temperature: args.temp,
        top_k: args.top_k,
        top_p: args.top_p,
        min_p: args.min_p,
        repeat_penalty: args.repeat_penalty,
        seed: args.seed,
        ..SamplerParams::default()
    };
    sampler
        .validate()
        .map_err(|e| anyhow::anyhow!("bad sampling flag: {e}"))?;
    let opts = GenerateOptions {
        n_predict: args.force_ids.as_ref().map_or(args.n_predict, Vec::len),
        sampler,
        force_ids: args.force_ids.clone(),
        top_logits: args.top_logits,
        stop_at_eog: !args.ignore_eos,
    };
    engine.kv_overrides = overrides;
    let (kind, mut drafter, n_max) = drafter(args, spec_kind, &engine, backend)?;
    // A hybrid model's recurrent layers keep a state after each row a rejection can take
    // back: at most the draft length, none without drafts.
    engine.recurrent_snapshots = if drafter.is_some() { n_max } else { 0 };
    load::check_cache(&engine, args.ctx_size, k_type, v_type)?;
    let mut session = engine.session(args.ctx_size, k_type, v_type)?;
    if args.draft.force_replay() {
        session.force_replay();
    }
    let spec = SpecOptions {
        n_max,
        n_min: args.draft.spec_n_min,
        p_min: args.draft.spec_p_min,
        adaptive: !args.draft.spec_fixed,
    };

    let stream = !args.json;
    let mut stdout = std::io::stdout();
    let mut pending: Vec<u8> = Vec::new();
    let tokenizer = &engine.tokenizer;
    let on_token = |id| {
        if stream {
            // Print each token's bytes as soon as they form whole UTF-8 characters; a
            // character split across tokens waits for its last byte.
            pending.extend_from_slice(tokenizer.token_to_piece(id, false));
            let valid = match std::str::from_utf8(&pending) {
                Ok(s) => s.len(),
                Err(e) => e.valid_up_to(),
            };
            let _ = stdout.write_all(&pending[..valid]);
            let _ = stdout.flush();
            pending.drain(..valid);
        }
    };
    let mut constraint = match &structured {
        Some(st) => Some(compile(&path, st)?),
        None => None,
    };
    let mask = constraint
        .as_mut()
        .map(|c| c as &mut dyn specula_sampling::LogitsMask);
    let out = match drafter.as_deref_mut() {
        Some(d) => engine.generate_speculative_masked(
            &mut session,
            &prompt_ids,
            &opts,
            d,
            &spec,
            mask,
            on_token,
        )?,
        None => engine.generate_masked(&mut session, &prompt_ids, &opts, mask, on_token)?,
    };
    if stream {
        let t = out.timings;
        eprintln!(
            "\n\nprompt: {} tokens in {:.1} ms ({:.2} t/s); generation: {} tokens in {:.1} ms ({:.2} t/s)",
            t.prompt_n,
            t.prompt_ms,
            per_second(t.prompt_n, t.prompt_ms),
            t.predicted_n,
            t.predicted_ms,
            per_second(t.predicted_n, t.predicted_ms)
        );
        if let Some(st) = &out.spec {
            eprintln!(
                "speculative ({kind}): {} drafted, {} accepted ({:.1} %), {} rounds, mean accepted length {:.2}",
                st.drafted,
                st.accepted,
                100.0 * st.acceptance(),
                st.rounds,
                st.mean_accept_len()
            );
            if st.replays > 0 {
                eprintln!(
                    "rollback by replay: {} rounds, {} rows run again",
                    st.replays, st.replayed
                );
            }
        }
        #[allow(clippy::cast_precision_loss, reason = "display")]
        let mib = session.kv_layout().total_bytes() as f64 / f64::from(1u32 << 20);
        match session.swa_ring() {
            Some(r) => eprintln!(
                "kv cache: {mib:.1} MiB ({} cells; sliding-window layers: a ring of {r} cells)",
                session.n_ctx()
            ),
            None => eprintln!("kv cache: {mib:.1} MiB ({} cells)", session.n_ctx()),
        }
        return Ok(String::from("\n"));
    }
    let json = JsonOut {
        model: path.display().to_string(),
        prompt_ids: out.prompt_ids,
        generated_ids: out.generated_ids,
        text: out.text,
        timings: JsonTimings::new(out.timings, out.spec.as_ref()),
        top_logits: (args.top_logits > 0).then_some(out.top_logits),
        spec: out.spec.as_ref().map(|st| JsonSpec {
            kind: kind.clone(),
            mean_accept_len: st.mean_accept_len(),
            acceptance: st.acceptance(),
            accept_by_position: st.acceptance_by_position(),
            rollback: session.rollback().name(),
            replayed: st.replayed,
        }),
        kv: JsonKv {
            bytes: session.kv_layout().total_bytes(),
            n_ctx: session.n_ctx(),
            swa_ring: session.swa_ring(),
        },
    };
    let mut s = serde_json::to_string(&json)?;
    s.push('\n');
    Ok(s)
}

/// The output constraint the flags ask for (`--grammar`, `--grammar-file`, `-j`, `-jf`),
/// read before the model loads so a bad flag fails at once.
fn structured_spec(args: &Args) -> Result<Option<Spec>> {
    let read = |p: &std::path::Path, what: &str| {
        std::fs::read_to_string(p)
            .with_context(|| format!("cannot read the {what} file {}", p.display()))
    };
    let schema = |text: &str, from: &str| -> Result<Spec> {
        let v: serde_json::Value =
            serde_json::from_str(text).with_context(|| format!("{from} is not JSON"))?;
        // As llama.cpp: `{}` is any JSON object.
        Ok(if v.as_object().is_some_and(serde_json::Map::is_empty) {
            Spec::JsonObject
        } else {
            Spec::JsonSchema(v)
        })
    };
    let spec = match (
        &args.grammar,
        &args.grammar_file,
        &args.json_schema,
        &args.json_schema_file,
    ) {
        (Some(g), ..) => Some(Spec::Gbnf(g.clone())),
        (_, Some(f), ..) => Some(Spec::Gbnf(read(f, "grammar")?)),
        (_, _, Some(j), _) => Some(schema(j, "the --json-schema value")?),
        (.., Some(f)) => Some(schema(
            &read(f, "JSON schema")?,
            &format!("the JSON schema file {}", f.display()),
        )?),
        _ => None,
    };
    if spec.is_some() && args.force_ids.is_some() {
        bail!(
            "--force-ids feeds fixed tokens: it cannot be combined with a grammar or JSON schema"
        );
    }
    Ok(spec)
}

/// The constraint of `spec` over the vocabulary of the model at `path`.
fn compile(path: &std::path::Path, spec: &Spec) -> Result<specula_grammar::Constraint> {
    let file = specula_gguf::Gguf::open(path)
        .with_context(|| format!("cannot open {}", path.display()))?;
    let tok = Arc::new(specula_tokenizer::Tokenizer::from_gguf(&file)?);
    let grammars = Grammars::new(tok)?;
    Ok(grammars.compile(spec)?)
}

/// A drafter chosen by the flags: its `--spec-type` name, the drafter (`None`: no speculation)
/// and the draft length per round.
type Chosen = (String, Option<Box<dyn Drafter>>, usize);

/// The drafter the flags ask for (`None`: no speculation), with its `--spec-type` name and the
/// draft length per round (`--spec-draft-n-max`, clamped to what the drafter can make).
fn drafter<B: specula_tensor::Backend + 'static>(
    args: &Args,
    kind: SpecType,
    target: &specula_engine::Engine<B>,
    backend: BackendFor<'_, B>,
) -> Result<Chosen> {
    if args.draft.spec_n_max == 0 && args.spec_type.is_some_and(|t| t != SpecType::None) {
        bail!("--spec-draft-n-max must be at least 1 for speculative decoding");
    }
    if !(0.0..=1.0).contains(&args.draft.spec_p_min) {
        bail!(
            "--spec-draft-p-min must be in [0, 1], got {}",
            args.draft.spec_p_min
        );
    }
    let name = crate::draft_args::spec_name(kind);
    let threads = load::threads(args.draft.threads(args.threads));
    let draft_ctx = if args.draft.ctx_size_draft == 0 {
        args.ctx_size
    } else {
        args.draft.ctx_size_draft
    };
    let mut n_max = args.draft.spec_n_max;
    let drafter: Option<Box<dyn Drafter>> = match kind {
        SpecType::None => None,
        SpecType::NgramSimple => Some(Box::new(NgramSimple::default())),
        SpecType::NgramCache => Some(Box::new(NgramCache::default())),
        SpecType::DraftEagle3 => {
            let path = load::model_path(args.model_draft.as_deref())?;
            let file = Arc::new(
                specula_gguf::Gguf::open(&path)
                    .with_context(|| format!("cannot load the draft {}", path.display()))?,
            );
            let d = Eagle3Drafter::new(
                backend(threads)?,
                file,
                target,
                draft_ctx.max(args.ctx_size),
                load::cache_type(&args.draft.cache_type_k_draft)?,
                load::cache_type(&args.draft.cache_type_v_draft)?,
            )
            .with_context(|| format!("cannot use {} as an EAGLE-3 head", path.display()))?;
            Some(Box::new(d))
        }
        SpecType::DraftDflash => {
            let path = load::model_path(args.model_draft.as_deref())?;
            let file = Arc::new(
                specula_gguf::Gguf::open(&path)
                    .with_context(|| format!("cannot load the draft {}", path.display()))?,
            );
            let policy = if args.draft.dflash_defer_injection == 1 {
                Injection::Deferred
            } else {
                Injection::Eager
            };
            let d = DflashDrafter::new(
                backend(threads)?,
                file,
                target,
                draft_ctx.max(args.ctx_size),
                load::cache_type(&args.draft.cache_type_k_draft)?,
                load::cache_type(&args.draft.cache_type_v_draft)?,
                policy,
            )
            .with_context(|| format!("cannot use {} as a DFlash drafter", path.display()))?;
            let block = d.net().hparams().block_size;
            if n_max > block - 1 {
                eprintln!(
                    "--spec-draft-n-max {n_max} clamped to {} (the DFlash block size {block} minus the anchor)",
                    block - 1
                );
                n_max = block - 1;
            }
            Some(Box::new(d))
        }
        SpecType::DraftSimple => {
            let path = load::model_path(args.model_draft.as_deref())?;
            let mut draft = load::engine_on::<B>(backend(threads)?, &path)?;
            draft.n_batch = args.batch_size;
            draft.swa_full = args.swa_full;
            if let Some(msg) = crate::draft_args::restrict_draft_vocab(&mut draft, &args.draft)? {
                eprintln!("{msg}");
            }
            let arch = draft.model.hparams().arch;
            let mut d = DraftModel::new(
                draft,
                &target.tokenizer,
                draft_ctx,
                load::cache_type(&args.draft.cache_type_k_draft)?,
                load::cache_type(&args.draft.cache_type_v_draft)?,
            )
            .with_context(|| {
                format!(
                    "cannot use {} ({arch:?}) as the draft model",
                    path.display()
                )
            })?;
            if args.draft.force_replay() {
                d.force_replay();
            }
            Some(Box::new(d))
        }
    };
    Ok((name, drafter, n_max))
}

#[allow(clippy::cast_precision_loss, reason = "token counts are small")]
fn per_second(n: usize, ms: f64) -> f64 {
    if ms > 0.0 { n as f64 * 1e3 / ms } else { 0.0 }
}
