//! `specula bench`: llama-bench's pp/tg tests and output formats.
//!
//! `pp N` processes an N-token prompt in batches of `-b` (first token BOS when the model adds
//! one, the rest pseudo-random ids); `tg N` decodes N single tokens after BOS. With `-d D`
//! (llama-bench's `--n-depth`) every test runs after a prefilled context of D tokens: the
//! depth is prefilled once per test, untimed, and each repetition trims the cache back to it.
//! Each test runs once as warm-up, then `-r` times; `avg_ts`/`stddev_ts` are tokens per
//! second over the repetitions, as llama-bench reports them. The KV cache formats (`-ctk`,
//! `-ctv`) and the cache's size are reported with each test.
//!
//! With `-md` a DFlash or EAGLE-3 drafter is attached: `pp` then includes capturing its taps
//! and injecting the prompt into its cache (the prefill penalty of speculative decoding), and
//! `tg N` becomes N speculative rounds (draft, one verify batch with taps, feed the drafter,
//! roll back), reported as rounds per second.

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde::Serialize;
use specula_engine::FeatureBuf;
use specula_engine::{
    DflashDrafter, Eagle3Drafter, Engine, Injection, PlanEntry, RoundCost, Session, SpecOptions,
    SpecSeq, plan,
};
use specula_quant::QType;
use specula_spec::verify::Verdict;
use specula_spec::{Drafter, One};
use specula_tensor::Backend;

use crate::load;
use crate::run::SpecType;

/// Output format.
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum Output {
    /// Markdown table.
    Md,
    /// One JSON array.
    Json,
    /// One JSON object per line.
    Jsonl,
}

/// Arguments of `specula bench` (llama-bench's names).
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Flash attention (llama.cpp's `-fa`): on, off or auto; accepted so llama.cpp command lines
    /// run unchanged (the CPU attention is one fused kernel either way).
    #[arg(long = "flash-attn", visible_alias = "fa", default_value = "auto", value_parser = ["on", "off", "auto", "1", "0", "true", "false", "enabled", "disabled"])]
    pub flash_attn: String,
    /// GGUF file or manifest model name; default: the default model.
    #[arg(short = 'm', long = "model")]
    pub model: Option<String>,
    /// Prompt lengths to test (0 = skip).
    #[arg(
        short = 'p',
        long = "n-prompt",
        value_delimiter = ',',
        default_value = "512"
    )]
    pub n_prompt: Vec<usize>,
    /// Generation lengths to test (0 = skip).
    #[arg(
        short = 'n',
        long = "n-gen",
        value_delimiter = ',',
        default_value = "128"
    )]
    pub n_gen: Vec<usize>,
    /// Context depths to run each test at (tokens prefilled before the timed part).
    #[arg(
        short = 'd',
        long = "n-depth",
        value_delimiter = ',',
        default_value = "0"
    )]
    pub n_depth: Vec<usize>,
    /// Threads.
    #[arg(short = 't', long, default_value_t = 2)]
    pub threads: usize,
    /// Repetitions.
    #[arg(short = 'r', long = "repetitions", default_value_t = 5)]
    pub repetitions: usize,
    /// Batch size of prompt processing.
    #[arg(short = 'b', long = "batch-size", default_value_t = 2048)]
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
    /// Output format.
    #[arg(short = 'o', long = "output", value_enum, default_value = "md")]
    pub output: Output,
    /// Device: `cpu`, or `cuda[:N]` (the CubeCL backend; a build with `--features cuda`).
    #[arg(long = "device", default_value = "cpu")]
    pub device: String,
    /// A DFlash or EAGLE-3 drafter (GGUF file or manifest name) attached to the target:
    /// `pp` tests then capture the drafter's taps and inject the prompt into its cache, and
    /// each `tg N` test runs N speculative rounds instead (draft `--spec-draft-n-max` tokens,
    /// verify them in one target batch with taps, feed the drafter, roll back), reported as
    /// rounds per second.
    #[arg(long = "model-draft", visible_alias = "md")]
    pub model_draft: Option<String>,
    /// `--dflash` / `--eagle3` (as in `specula run`; default: from the file's architecture).
    #[command(flatten)]
    pub kind: crate::draft_args::DraftKind,
    /// Draft tokens per round of the `tg` tests with `-md` (clamped to a DFlash block − 1).
    #[arg(
        long = "spec-draft-n-max",
        visible_alias = "draft-max",
        default_value_t = 16
    )]
    pub spec_n_max: usize,
    /// DFlash injection policy (1 deferred, 0 eager).
    #[arg(
        long = "dflash-defer-injection",
        default_value_t = 1,
        value_parser = clap::value_parser!(u8).range(0..=1)
    )]
    pub dflash_defer_injection: u8,
    /// Sequences run together (llama-batched-bench's `-npl`): with N > 1 a test runs N
    /// sequences, each with its own cache at the test's depth, as one batch per step — `pp P`
    /// the N prompts of P tokens together, `tg T` T steps of one token from each — as the
    /// server's continuous batching runs its slots; t/s counts the tokens of all N.
    #[arg(
        long = "parallel",
        visible_alias = "npl",
        value_delimiter = ',',
        default_value = "1"
    )]
    pub parallel: Vec<usize>,
    /// Before each `tg` test, measure this machine's memory read bandwidth on `-t` threads (a
    /// summing loop over 1 GiB) and report the test's bytes read per second as a share of it.
    #[arg(long = "bandwidth-probe")]
    pub bandwidth_probe: bool,
}

/// One test's result: llama-bench's JSON fields, in its order and with its value types
/// (`tools/llama-bench/llama-bench.cpp`: `test::get_fields`, `get_field_type`, then
/// `samples_ns`, `samples_ts`), so that tools reading llama-bench's `-o json|jsonl` read ours;
/// specula's own fields follow. Settings specula does not have carry the value that says what
/// specula does (no GPU layers, no split, the weights' memory map, …).
#[derive(Debug, Serialize)]
pub(crate) struct Record {
    /// Short commit of the build (`unknown` outside a git tree, as llama.cpp's build).
    build_commit: &'static str,
    /// Commits up to the build (0 outside a git tree, as llama.cpp's build).
    build_number: u64,
    /// The CPU's model name.
    cpu_info: String,
    /// GPUs used: none.
    gpu_info: &'static str,
    backends: &'static str,
    model_filename: String,
    model_type: String,
    model_size: u64,
    model_n_params: u64,
    n_batch: usize,
    /// specula runs a batch of `-b` tokens as one forward: the physical batch is `n_batch`.
    n_ubatch: usize,
    n_threads: usize,
    /// No affinity mask (llama-bench's `0x0`).
    cpu_mask: &'static str,
    cpu_strict: bool,
    /// llama.cpp's default polling level: specula's workers poll for the next op (200 µs)
    /// before they sleep.
    poll: u32,
    type_k: String,
    type_v: String,
    n_gpu_layers: u32,
    n_cpu_moe: u32,
    /// One device: no split.
    split_mode: &'static str,
    main_gpu: u32,
    no_kv_offload: bool,
    /// 1: flash attention (an online softmax over KV tiles) is always on.
    flash_attn: u32,
    devices: &'static str,
    tensor_split: &'static str,
    tensor_buft_overrides: &'static str,
    /// Weights are read from the file's memory map.
    load_mode: &'static str,
    /// Every tensor is read whole (no on-demand rows).
    lazy_mode: &'static str,
    embeddings: bool,
    no_op_offload: u32,
    no_host: bool,
    /// Matmul weights are repacked for the CPU's kernels where they have a packed layout.
    repack: bool,
    fit_target: u64,
    fit_min_ctx: u32,
    n_prompt: usize,
    n_gen: usize,
    n_depth: usize,
    /// When the test ran, RFC 3339 UTC (`2026-12-01T20:03:04Z`).
    test_time: String,
    avg_ns: u64,
    stddev_ns: u64,
    avg_ts: f64,
    stddev_ts: f64,
    samples_ns: Vec<u64>,
    samples_ts: Vec<f64>,
    /// Bytes of KV cache per token (one cell of every layer, K and V).
    kv_bytes_per_token: usize,
    /// Bytes of KV cache holding depth + test tokens (a sliding-window ring at most its
    /// size), of all the test's sequences.
    kv_bytes_used: usize,
    /// Bytes of weights a decode step reads ([`crate::bandwidth::weight_bytes_per_token`]).
    weight_bytes_per_token: u64,
    /// `tg` tests: the K/V bytes a decode step of the test reads, on average over its steps.
    #[serde(skip_serializing_if = "Option::is_none")]
    kv_read_bytes_per_token: Option<u64>,
    /// `tg` tests: (weight + K/V bytes per step) × steps per second, in GB/s (10⁹ B/s).
    #[serde(skip_serializing_if = "Option::is_none")]
    read_gbs: Option<f64>,
    /// With `--bandwidth-probe`, `tg` tests: this machine's read bandwidth on `-t` threads
    /// just before the test, GB/s.
    #[serde(skip_serializing_if = "Option::is_none")]
    bandwidth_probe_gbs: Option<f64>,
    /// Sequences run together (`--parallel`); t/s counts the tokens of all of them.
    n_parallel: usize,
    /// With `-md`: the drafter and the draft length of its rounds (`tg` counts rounds).
    #[serde(skip_serializing_if = "Option::is_none")]
    spec: Option<String>,
    /// With `-md`, `tg`: mean nanoseconds per round spent in the drafter (drafting, feeding
    /// it the verify batch's features); the rest is the target's verify.
    #[serde(skip_serializing_if = "Option::is_none")]
    draft_ns_per_round: Option<u64>,
}

/// The build's commit and number (`build.rs`).
fn build_info() -> (&'static str, u64) {
    (
        env!("SPECULA_BUILD_COMMIT"),
        env!("SPECULA_BUILD_NUMBER").parse().unwrap_or(0),
    )
}

/// The CPU's model name (`/proc/cpuinfo`'s first `model name`; the architecture elsewhere),
/// as ggml's CPU device describes itself.
fn cpu_info() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("model name"))
                .and_then(|rest| rest.split_once(':'))
                .map(|(_, name)| name.trim().to_owned())
        })
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| std::env::consts::ARCH.to_owned())
}

/// `t` as llama-bench's `test_time`: RFC 3339 UTC to the second (`strftime("%FT%TZ")`).
pub(crate) fn rfc3339(t: std::time::SystemTime) -> String {
    let secs = t
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Civil date of a day count (H. Hinnant's `civil_from_days`), for days since 1970.
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z % 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + u64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// A feature drafter attached to the benchmark.
struct Attached<B: Backend> {
    kind: &'static str,
    drafter: Box<dyn Drafter>,
    n_max: usize,
    feats: FeatureBuf<B>,
    logits: Vec<f32>,
    /// Nanoseconds spent in the drafter by the timed rounds so far.
    draft_ns: u128,
    rounds: u128,
}

fn attach<B: Backend + 'static>(
    args: &Args,
    spec: Option<SpecType>,
    target: &Engine<B>,
    n_ctx: usize,
    backend: impl FnOnce() -> Result<Arc<B>>,
) -> Result<Option<Attached<B>>> {
    let Some(spec) = spec else {
        return Ok(None);
    };
    let path = load::model_path(args.model_draft.as_deref())?;
    let file = Arc::new(
        specula_gguf::Gguf::open(&path)
            .with_context(|| format!("cannot load the draft {}", path.display()))?,
    );
    let be = backend()?;
    let (kind, drafter, n_max): (&'static str, Box<dyn Drafter>, usize) = match spec {
        SpecType::DraftDflash => {
            let policy = if args.dflash_defer_injection == 1 {
                Injection::Deferred
            } else {
                Injection::Eager
            };
            let d = DflashDrafter::new(be, file, target, n_ctx, QType::F16, QType::F16, policy)
                .with_context(|| format!("cannot use {} as a DFlash drafter", path.display()))?;
            let n = args.spec_n_max.min(d.net().hparams().block_size - 1);
            ("draft-dflash", Box::new(d), n)
        }
        SpecType::DraftEagle3 => {
            let d = Eagle3Drafter::new(be, file, target, n_ctx, QType::F16, QType::F16)
                .with_context(|| format!("cannot use {} as an EAGLE-3 head", path.display()))?;
            ("draft-eagle3", Box::new(d), args.spec_n_max)
        }
        other => bail!(
            "-md {}: `specula bench` attaches DFlash or EAGLE-3 drafters (architecture dflash or eagle3, or --dflash / --eagle3), not {} (architecture {})",
            path.display(),
            crate::draft_args::spec_name(other),
            file.header().architecture().unwrap_or("?")
        ),
    };
    let feats = FeatureBuf::new(drafter.target_taps());
    Ok(Some(Attached {
        kind,
        drafter,
        n_max,
        feats,
        logits: Vec::new(),
        draft_ns: 0,
        rounds: 0,
    }))
}

/// One timed repetition with a drafter attached: `pp` prefills with taps and feeds the
/// drafter; `tg` runs speculative rounds (every draft rejected, so each round has the same
/// shape) after a BOS-and-random-token context.
fn run_once_spec<B: Backend>(
    e: &Engine<B>,
    s: &mut Session<B>,
    a: &mut Attached<B>,
    (pp, tg): (usize, usize),
    seed: &mut u64,
) -> Result<u64> {
    s.truncate(0);
    let n_vocab = e.model.hparams().n_vocab;
    let bos = e.tokenizer.special_tokens().bos;
    let mut toks = ids(pp.max(16), n_vocab, seed);
    if let (true, Some(b)) = (e.tokenizer.add_bos(), bos) {
        toks[0] = b;
    }
    a.drafter.begin(&[])?;
    let mut drafter = One(&mut *a.drafter);
    if pp > 0 {
        let t = Instant::now();
        e.run_for(
            s,
            &toks,
            toks.len() - 1,
            &mut a.logits,
            &mut a.feats,
            &mut drafter,
            0,
        )?;
        return Ok(u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX));
    }
    // The context of the rounds (untimed).
    let head = &toks[..toks.len() - 1];
    e.run_for(
        s,
        head,
        head.len(),
        &mut a.logits,
        &mut a.feats,
        &mut drafter,
        0,
    )?;
    // Fixed rounds of `n_max` drafts (the context was sized for them).
    let options = SpecOptions {
        n_max: a.n_max,
        n_min: 0,
        p_min: 0.0,
        adaptive: false,
    };
    let mut seq = SpecSeq::new(0, options, Some(&drafter), &toks);
    let mut drafts = Vec::with_capacity(1);
    let t = Instant::now();
    for _ in 0..tg {
        let failed = plan(
            &mut [PlanEntry {
                seq: &mut seq,
                session: s,
                lead: 0,
                left: usize::MAX,
            }],
            Some(&mut drafter),
            n_vocab,
            &mut drafts,
        );
        if let Some((_, err)) = failed.into_iter().next() {
            return Err(err.into());
        }
        let tv = Instant::now();
        let in_drafter_s = e.run_for(
            s,
            seq.rows(),
            0,
            &mut a.logits,
            &mut a.feats,
            &mut drafter,
            0,
        )?;
        let verify_s = tv.elapsed().as_secs_f64() - in_drafter_s;
        // Every draft rejected, and the target's own token a random one: the benchmark
        // measures cost, not acceptance.
        let own = ids(1, n_vocab, seed)[0];
        seq.commit(
            e,
            s,
            Some(&mut drafter),
            &a.logits,
            |_, _| {
                Ok(Verdict {
                    tokens: vec![own],
                    accepted: 0,
                })
            },
            RoundCost {
                verify_s,
                in_drafter_s,
            },
        )?;
        a.draft_ns += Duration::from_secs_f64(seq.last_draft_s()).as_nanos();
        a.rounds += 1;
    }
    Ok(u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX))
}

fn ids(n: usize, n_vocab: usize, seed: &mut u64) -> Vec<u32> {
    (0..n)
        .map(|_| {
            *seed ^= *seed << 13;
            *seed ^= *seed >> 7;
            *seed ^= *seed << 17;
            u32::try_from(*seed % n_vocab as u64).unwrap_or(0)
        })
        .collect()
}

/// Fills the first `depth` positions of the session (untimed part of a `-d` test).
fn prefill_depth<B: Backend>(
    e: &Engine<B>,
    s: &mut Session<B>,
    depth: usize,
    seed: &mut u64,
) -> Result<()> {
    s.truncate(0);
    if depth == 0 {
        return Ok(());
    }
    let mut toks = ids(depth, e.model.hparams().n_vocab, seed);
    if let (true, Some(bos)) = (e.tokenizer.add_bos(), e.tokenizer.special_tokens().bos) {
        toks[0] = bos;
    }
    e.prefill(s, &toks, false)?;
    Ok(())
}

/// One timed repetition after `depth` positions: returns its nanoseconds.
fn run_once<B: Backend>(
    e: &Engine<B>,
    s: &mut Session<B>,
    (pp, tg, depth): (usize, usize, usize),
    seed: &mut u64,
) -> Result<u64> {
    s.truncate(depth);
    let n_vocab = e.model.hparams().n_vocab;
    let bos = e.tokenizer.special_tokens().bos;
    let t = Instant::now();
    if pp > 0 {
        let mut toks = ids(pp, n_vocab, seed);
        if let (0, true, Some(b)) = (depth, e.tokenizer.add_bos(), bos) {
            toks[0] = b;
        }
        e.prefill(s, &toks, false)?;
    } else {
        let mut tok = match (depth, bos) {
            (0, Some(b)) => b,
            _ => ids(1, n_vocab, seed)[0],
        };
        for _ in 0..tg {
            e.decode(s, tok)?;
            tok = ids(1, n_vocab, seed)[0];
        }
    }
    Ok(u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX))
}

/// One timed repetition of `n` sequences run together after `depth` positions each:
/// `pp` — their prompts as one batch (the last row's logits of each), `tg` — steps of one
/// token from each. Returns its nanoseconds.
fn run_once_multi<B: Backend>(
    e: &Engine<B>,
    sessions: &mut [Session<B>],
    scratch: &mut specula_models::Scratch<B>,
    (pp, tg, depth): (usize, usize, usize),
    seed: &mut u64,
) -> Result<u64> {
    let n_vocab = e.model.hparams().n_vocab;
    let bos = e.tokenizer.special_tokens().bos;
    for s in sessions.iter_mut() {
        s.truncate(depth);
    }
    let (rows, steps) = if pp > 0 { (pp, 1) } else { (1, tg) };
    let mut toks: Vec<Vec<u32>> = sessions
        .iter()
        .map(|_| {
            let mut t = ids(rows, n_vocab, seed);
            if let (0, Some(b), true) = (depth, bos, pp == 0 || e.tokenizer.add_bos()) {
                t[0] = b;
            }
            t
        })
        .collect();
    let mut out = specula_engine::Readout::default();
    let t = Instant::now();
    for _ in 0..steps {
        let mut entries: Vec<specula_engine::BatchEntry<'_, B>> = sessions
            .iter_mut()
            .zip(&toks)
            .map(|(s, t)| specula_engine::BatchEntry {
                session: s,
                tokens: t,
                logits_from: t.len() - 1,
                capture: None,
            })
            .collect();
        e.decode_multi(&mut entries, scratch, &mut out)?;
        for t in &mut toks {
            t[0] = ids(1, n_vocab, seed)[0];
        }
    }
    Ok(u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX))
}

#[allow(clippy::cast_precision_loss, reason = "timing statistics")]
fn stats(v: &[f64]) -> (f64, f64) {
    let n = v.len() as f64;
    let mean = v.iter().sum::<f64>() / n;
    let var = if v.len() > 1 {
        v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0)
    } else {
        0.0
    };
    (mean, var.sqrt())
}

/// Runs `specula bench`.
pub fn run(args: &Args) -> Result<String> {
    if args.repetitions == 0 || args.threads == 0 || args.batch_size == 0 {
        bail!("-r, -t and -b must be positive");
    }
    let (k_type, v_type) = (
        load::cache_type(&args.cache_type_k)?,
        load::cache_type(&args.cache_type_v)?,
    );
    let overrides = load::layer_types(&args.layer_types)?;
    // The drafter's kind before the model: a flag error should not wait for a load.
    let spec = args.kind.resolve(None, args.model_draft.as_deref())?;
    let device = crate::device::Device::parse(&args.device)?;
    let path = load::model_path(args.model.as_deref())?;
    let work = Benching {
        args,
        path: path.clone(),
        types: (k_type, v_type),
        overrides,
        spec,
    };
    crate::device::on_device(device, &path, args.threads, work)
}

/// What `bench` read before the model loads.
struct Benching<'a> {
    args: &'a Args,
    path: std::path::PathBuf,
    types: (QType, QType),
    overrides: Vec<specula_kv::LayerOverride>,
    spec: Option<SpecType>,
}

impl crate::device::OnDevice for Benching<'_> {
    type Out = String;

    fn run<B>(self, engine: Engine<B>, backend: crate::device::BackendFor<'_, B>) -> Result<String>
    where
        B: Backend + Send + Sync + 'static,
        Engine<B>: Send + Sync,
    {
        let threads = self.args.threads;
        run_on(
            self.args,
            engine,
            &self.path,
            self.types,
            self.overrides,
            self.spec,
            || backend(threads),
        )
    }
}

/// The tests of `specula bench` on an engine of any backend.
#[allow(
    clippy::too_many_lines,
    reason = "one table of tests, record after record"
)]
fn run_on<B: Backend + 'static>(
    args: &Args,
    mut engine: Engine<B>,
    path: &std::path::Path,
    (k_type, v_type): (QType, QType),
    overrides: Vec<specula_kv::LayerOverride>,
    spec: Option<SpecType>,
    drafter_backend: impl FnOnce() -> Result<Arc<B>>,
) -> Result<String> {
    engine.n_batch = args.batch_size;
    engine.swa_full = args.swa_full;
    let hp = engine.model.hparams().clone();
    let file = engine.model.file().clone();
    let size: u64 = file
        .tensors()
        .iter()
        .map(specula_gguf::TensorInfo::n_bytes)
        .sum();
    let params: u64 = file
        .tensors()
        .iter()
        .map(specula_gguf::TensorInfo::n_elements)
        .sum();
    let weight_bytes = crate::bandwidth::weight_bytes_per_token(file.tensors(), file.metadata());
    let model_type = format!(
        "{} {}",
        hp.arch.name(),
        file.metadata().get_str("general.size_label").unwrap_or("?")
    );
    let n_ctx = args
        .n_prompt
        .iter()
        .chain(&args.n_gen)
        .copied()
        .max()
        .unwrap_or(1)
        .max(1)
        + args.n_depth.iter().copied().max().unwrap_or(0);
    engine.kv_overrides = overrides;
    let mut attached = attach(args, spec, &engine, n_ctx + 64, drafter_backend)?;
    if args.parallel.contains(&0) {
        bail!("--parallel must be positive");
    }
    if let Some(a) = &attached {
        if args.n_depth.iter().any(|&d| d > 0) {
            bail!("-d is not supported with -md yet");
        }
        if args.parallel.iter().any(|&n| n > 1) {
            bail!("--parallel is not supported with -md yet");
        }
        // Rounds need room for their context, the verify batch and one token per round.
        let rounds = args.n_gen.iter().copied().max().unwrap_or(0);
        if rounds > 0 && 16 + rounds + a.n_max + 1 > n_ctx + 64 {
            bail!("-n {rounds} rounds do not fit the benchmark's context");
        }
    }
    let n_ctx = n_ctx + if attached.is_some() { 64 } else { 0 };
    // A hybrid model's recurrent snapshots: as many as a round's draft, none without one
    // (as `specula run` keeps them).
    engine.recurrent_snapshots = attached.as_ref().map_or(0, |a| a.n_max);
    let layout = load::check_cache(&engine, n_ctx, k_type, v_type)?;
    let mut session = engine.session(n_ctx, k_type, v_type)?;
    let mut seed = 0x2545_f491_4f6c_dd1du64;

    let cpu_info = cpu_info();
    let mut records = Vec::new();
    let tests: Vec<(usize, usize)> = args
        .n_prompt
        .iter()
        .filter(|&&n| n > 0)
        .map(|&n| (n, 0))
        .chain(args.n_gen.iter().filter(|&&n| n > 0).map(|&n| (0, n)))
        .collect();
    // The sequences of `--parallel` tests (made for the first such test, kept for the rest).
    let mut multi: Vec<Session<B>> = Vec::new();
    let mut scratch = engine.scratch();
    for &depth in &args.n_depth {
        for &n_par in &args.parallel {
            if n_par > 1 {
                while multi.len() < n_par {
                    multi.push(engine.session(n_ctx, k_type, v_type)?);
                }
            }
            for &(pp, tg) in &tests {
                let mut once =
                    |session: &mut Session<B>,
                     multi: &mut [Session<B>],
                     attached: &mut Option<Attached<B>>,
                     seed: &mut u64| match attached.as_mut() {
                        Some(a) => run_once_spec(&engine, session, a, (pp, tg), seed),
                        None if n_par > 1 => run_once_multi(
                            &engine,
                            &mut multi[..n_par],
                            &mut scratch,
                            (pp, tg, depth),
                            seed,
                        ),
                        None => run_once(&engine, session, (pp, tg, depth), seed),
                    };
                if n_par > 1 {
                    for s in &mut multi[..n_par] {
                        prefill_depth(&engine, s, depth, &mut seed)?;
                    }
                } else {
                    prefill_depth(&engine, &mut session, depth, &mut seed)?;
                }
                // llama-bench stamps a test when it is set up, before its warm-up.
                let test_time = rfc3339(std::time::SystemTime::now());
                once(&mut session, &mut multi, &mut attached, &mut seed)?; // warm-up
                if let Some(a) = attached.as_mut() {
                    (a.draft_ns, a.rounds) = (0, 0);
                }
                // The machine's bandwidth just before the timed part: it moves with what else
                // runs on the host.
                let probe_gbs = (args.bandwidth_probe && tg > 0 && attached.is_none())
                    .then(|| crate::bandwidth::probe(args.threads))
                    .transpose()?;
                let mut samples_ns = Vec::with_capacity(args.repetitions);
                for _ in 0..args.repetitions {
                    samples_ns.push(once(&mut session, &mut multi, &mut attached, &mut seed)?);
                }
                #[allow(clippy::cast_precision_loss, reason = "timing statistics")]
                let samples_ts: Vec<f64> = samples_ns
                    .iter()
                    .map(|&ns| ((pp + tg) * n_par) as f64 * 1e9 / ns as f64)
                    .collect();
                #[allow(clippy::cast_precision_loss, reason = "timing statistics")]
                let ns_f: Vec<f64> = samples_ns.iter().map(|&v| v as f64).collect();
                let (avg_ns, sd_ns) = stats(&ns_f);
                let (avg_ts, stddev_ts) = stats(&samples_ts);
                #[allow(
                    clippy::cast_possible_truncation,
                    clippy::cast_sign_loss,
                    reason = "non-negative nanosecond statistics"
                )]
                let (avg_ns, stddev_ns) = (avg_ns as u64, sd_ns as u64);
                // A decode step at position p attends to p + 1 cells (of each layer's ring at most).
                let kv_read = (tg > 0 && attached.is_none()).then(|| {
                    let total: usize = (0..tg).map(|i| layout.bytes_for(depth + i + 1)).sum();
                    (total / tg) as u64
                });
                // A step reads the weights once and every sequence's cells.
                #[allow(clippy::cast_precision_loss, reason = "a byte rate")]
                let read_gbs = kv_read.map(|kv| {
                    (weight_bytes + n_par as u64 * kv) as f64 * avg_ts / n_par as f64 / 1e9
                });
                let (build_commit, build_number) = build_info();
                records.push(Record {
                    build_commit,
                    build_number,
                    cpu_info: cpu_info.clone(),
                    gpu_info: if engine.backend.name() == "cpu" {
                        ""
                    } else {
                        engine.backend.name()
                    },
                    backends: if engine.backend.name() == "cpu" {
                        "CPU"
                    } else {
                        "CUDA"
                    },
                    model_filename: path.display().to_string(),
                    model_type: model_type.clone(),
                    model_size: size,
                    model_n_params: params,
                    n_batch: args.batch_size,
                    n_ubatch: args.batch_size,
                    n_threads: args.threads,
                    cpu_mask: "0x0",
                    cpu_strict: false,
                    poll: 50,
                    type_k: k_type.name().to_owned(),
                    type_v: v_type.name().to_owned(),
                    n_gpu_layers: 0,
                    n_cpu_moe: 0,
                    split_mode: "none",
                    main_gpu: 0,
                    no_kv_offload: false,
                    flash_attn: 1,
                    devices: "CPU",
                    tensor_split: "0.00",
                    tensor_buft_overrides: "none",
                    load_mode: "mmap",
                    lazy_mode: "off",
                    embeddings: false,
                    no_op_offload: 0,
                    no_host: false,
                    repack: true,
                    fit_target: 0,
                    fit_min_ctx: 0,
                    n_prompt: pp,
                    n_gen: tg,
                    n_depth: depth,
                    n_parallel: n_par,
                    test_time,
                    avg_ns,
                    stddev_ns,
                    avg_ts,
                    stddev_ts,
                    samples_ns,
                    samples_ts,
                    kv_bytes_per_token: layout.bytes_per_token(),
                    kv_bytes_used: n_par * layout.bytes_for(depth + pp + tg),
                    weight_bytes_per_token: weight_bytes,
                    kv_read_bytes_per_token: kv_read,
                    read_gbs,
                    bandwidth_probe_gbs: probe_gbs,
                    spec: attached
                        .as_ref()
                        .map(|a| format!("{} n_max {}", a.kind, a.n_max)),
                    draft_ns_per_round: attached
                        .as_ref()
                        .filter(|a| a.rounds > 0)
                        .map(|a| u64::try_from(a.draft_ns / a.rounds).unwrap_or(u64::MAX)),
                });
            }
        }
    }
    render(&records, args.output)
}

fn render(records: &[Record], output: Output) -> Result<String> {
    let mut s = String::new();
    match output {
        Output::Json => {
            s = serde_json::to_string_pretty(records)?;
            s.push('\n');
        }
        Output::Jsonl => {
            for r in records {
                let _ = writeln!(s, "{}", serde_json::to_string(r)?);
            }
        }
        Output::Md => {
            let _ = writeln!(
                s,
                "| model | size | params | backend | threads | type_k | type_v | kv MiB | test | t/s | read GB/s |"
            );
            let _ = writeln!(
                s,
                "| --- | ---: | ---: | --- | ---: | --- | --- | ---: | ---: | ---: | ---: |"
            );
            for r in records {
                let mut test = match (&r.spec, r.n_prompt > 0) {
                    (None, true) => format!("pp{}", r.n_prompt),
                    (None, false) => format!("tg{}", r.n_gen),
                    (Some(sp), true) => format!("pp{} + {sp}", r.n_prompt),
                    (Some(sp), false) => format!("{} rounds, {sp}", r.n_gen),
                };
                if let Some(ns) = r.draft_ns_per_round {
                    #[allow(clippy::cast_precision_loss, reason = "display")]
                    let ms = ns as f64 / 1e6;
                    let _ = write!(test, " (drafter {ms:.1} ms/round)");
                }
                if r.n_parallel > 1 {
                    let _ = write!(test, " ×{}", r.n_parallel);
                }
                if r.n_depth > 0 {
                    let _ = write!(test, " @ d{}", r.n_depth);
                }
                #[allow(clippy::cast_precision_loss, reason = "display")]
                let kv_mib = r.kv_bytes_used as f64 / f64::from(1u32 << 20);
                #[allow(clippy::cast_precision_loss, reason = "display")]
                let (gib, m) = (
                    r.model_size as f64 / (1u64 << 30) as f64,
                    r.model_n_params as f64 / 1e6,
                );
                let read = match (r.read_gbs, r.bandwidth_probe_gbs) {
                    (Some(g), Some(p)) => format!("{g:.1} ({:.0} % of {p:.1})", 100.0 * g / p),
                    (Some(g), None) => format!("{g:.1}"),
                    (None, _) => "—".to_owned(),
                };
                let _ = writeln!(
                    s,
                    "| {} | {gib:.2} GiB | {m:.2} M | {} | {} | {} | {} | {kv_mib:.2} | {test} | {:.2} ± {:.2} | {read} |",
                    r.model_type,
                    r.backends,
                    r.n_threads,
                    r.type_k,
                    r.type_v,
                    r.avg_ts,
                    r.stddev_ts
                );
            }
        }
    }
    Ok(s)
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, UNIX_EPOCH};

    use super::rfc3339;

    /// `test_time` is llama-bench's `strftime("%FT%TZ", gmtime(…))`: checked at the epoch, a
    /// leap day, the end of a leap year and a well-known timestamp.
    #[test]
    fn test_time_is_rfc3339_utc() {
        let at = |s: u64| rfc3339(UNIX_EPOCH + Duration::from_secs(s));
        assert_eq!(at(0), "1970-01-01T00:00:00Z");
        assert_eq!(at(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(at(1_483_228_799), "2016-12-31T23:59:59Z");
        assert_eq!(at(1_700_000_000), "2023-11-14T22:13:20Z");
        assert_eq!(at(4_102_444_800), "2100-01-01T00:00:00Z");
    }
}
