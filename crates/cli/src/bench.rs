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
use specula_cpu::CpuBackend;
use specula_engine::{
    DflashDrafter, Eagle3Drafter, Engine, Injection, PlanEntry, RoundCost, Session, SpecOptions,
    SpecSeq, plan,
};
use specula_models::Taps;
use specula_quant::QType;
use specula_spec::verify::Verdict;
use specula_spec::{Drafter, One};

use crate::load;

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
    /// A DFlash or EAGLE-3 drafter (GGUF file or manifest name) attached to the target:
    /// `pp` tests then capture the drafter's taps and inject the prompt into its cache, and
    /// each `tg N` test runs N speculative rounds instead (draft `--spec-draft-n-max` tokens,
    /// verify them in one target batch with taps, feed the drafter, roll back), reported as
    /// rounds per second.
    #[arg(long = "model-draft", visible_alias = "md")]
    pub model_draft: Option<String>,
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
}

#[derive(Debug, Serialize)]
struct Record {
    build_commit: &'static str,
    model_filename: String,
    model_type: String,
    model_size: u64,
    model_n_params: u64,
    backends: &'static str,
    n_threads: usize,
    n_batch: usize,
    type_k: String,
    type_v: String,
    n_prompt: usize,
    n_gen: usize,
    n_depth: usize,
    /// Bytes of KV cache per token (one cell of every layer, K and V).
    kv_bytes_per_token: usize,
    /// Bytes of KV cache holding depth + test tokens (a sliding-window ring at most its
    /// size).
    kv_bytes_used: usize,
    test_time: String,
    avg_ns: u64,
    stddev_ns: u64,
    avg_ts: f64,
    stddev_ts: f64,
    samples_ns: Vec<u64>,
    samples_ts: Vec<f64>,
    /// With `-md`: the drafter and the draft length of its rounds (`tg` counts rounds).
    #[serde(skip_serializing_if = "Option::is_none")]
    spec: Option<String>,
    /// With `-md`, `tg`: mean nanoseconds per round spent in the drafter (drafting, feeding
    /// it the verify batch's features); the rest is the target's verify.
    #[serde(skip_serializing_if = "Option::is_none")]
    draft_ns_per_round: Option<u64>,
}

/// A feature drafter attached to the benchmark.
struct Attached {
    kind: &'static str,
    drafter: Box<dyn Drafter>,
    n_max: usize,
    taps: Taps,
    features: Vec<f32>,
    logits: Vec<f32>,
    /// Nanoseconds spent in the drafter by the timed rounds so far.
    draft_ns: u128,
    rounds: u128,
}

fn attach(args: &Args, target: &Engine<CpuBackend>, n_ctx: usize) -> Result<Option<Attached>> {
    let Some(md) = &args.model_draft else {
        return Ok(None);
    };
    let path = load::model_path(Some(md))?;
    let file = Arc::new(
        specula_gguf::Gguf::open(&path)
            .with_context(|| format!("cannot load the draft {}", path.display()))?,
    );
    let be = CpuBackend::new(args.threads);
    let (kind, drafter, n_max): (&'static str, Box<dyn Drafter>, usize) = match file
        .header()
        .architecture()
    {
        Some("dflash") => {
            let policy = if args.dflash_defer_injection == 1 {
                Injection::Deferred
            } else {
                Injection::Eager
            };
            let d = DflashDrafter::new(be, file, target, n_ctx, QType::F16, QType::F16, policy)?;
            let n = args.spec_n_max.min(d.net().hparams().block_size - 1);
            ("draft-dflash", Box::new(d), n)
        }
        Some("eagle3") => {
            let d = Eagle3Drafter::new(be, file, target, n_ctx, QType::F16, QType::F16)?;
            ("draft-eagle3", Box::new(d), args.spec_n_max)
        }
        other => bail!(
            "-md {}: `specula bench` attaches DFlash or EAGLE-3 drafters (architecture dflash or eagle3), not {}",
            path.display(),
            other.unwrap_or("?")
        ),
    };
    let taps = Taps {
        layers: drafter.target_taps().to_vec(),
        rows: Vec::new(),
    };
    Ok(Some(Attached {
        kind,
        drafter,
        n_max,
        taps,
        features: Vec::new(),
        logits: Vec::new(),
        draft_ns: 0,
        rounds: 0,
    }))
}

/// One timed repetition with a drafter attached: `pp` prefills with taps and feeds the
/// drafter; `tg` runs speculative rounds (every draft rejected, so each round has the same
/// shape) after a BOS-and-random-token context.
fn run_once_spec(
    e: &Engine<CpuBackend>,
    s: &mut Session<CpuBackend>,
    a: &mut Attached,
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
    let spec_err = |err: specula_spec::SpecError| anyhow::anyhow!("{err}");
    a.drafter.begin(&[]).map_err(spec_err)?;
    let mut drafter = One(&mut *a.drafter);
    if pp > 0 {
        let t = Instant::now();
        e.run_for(
            s,
            &toks,
            toks.len() - 1,
            &mut a.logits,
            &mut a.taps,
            &mut a.features,
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
        &mut a.taps,
        &mut a.features,
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
            return Err(spec_err(err));
        }
        let tv = Instant::now();
        let in_drafter_s = e.run_for(
            s,
            seq.rows(),
            0,
            &mut a.logits,
            &mut a.taps,
            &mut a.features,
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
fn prefill_depth(
    e: &Engine<CpuBackend>,
    s: &mut Session<CpuBackend>,
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
fn run_once(
    e: &Engine<CpuBackend>,
    s: &mut Session<CpuBackend>,
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
    let path = load::model_path(args.model.as_deref())?;
    let mut engine = load::cpu_engine(&path, args.threads)?;
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
    let mut attached = attach(args, &engine, n_ctx + 64)?;
    if let Some(a) = &attached {
        if args.n_depth.iter().any(|&d| d > 0) {
            bail!("-d is not supported with -md yet");
        }
        // Rounds need room for their context, the verify batch and one token per round.
        let rounds = args.n_gen.iter().copied().max().unwrap_or(0);
        if rounds > 0 && 16 + rounds + a.n_max + 1 > n_ctx + 64 {
            bail!("-n {rounds} rounds do not fit the benchmark's context");
        }
    }
    let n_ctx = n_ctx + if attached.is_some() { 64 } else { 0 };
    let layout = load::check_cache(&engine, n_ctx, k_type, v_type)?;
    let mut session = engine.session(n_ctx, k_type, v_type)?;
    let mut seed = 0x2545_f491_4f6c_dd1du64;

    let mut records = Vec::new();
    let tests: Vec<(usize, usize)> = args
        .n_prompt
        .iter()
        .filter(|&&n| n > 0)
        .map(|&n| (n, 0))
        .chain(args.n_gen.iter().filter(|&&n| n > 0).map(|&n| (0, n)))
        .collect();
    for &depth in &args.n_depth {
        for &(pp, tg) in &tests {
            let once = |session: &mut Session<CpuBackend>,
                        attached: &mut Option<Attached>,
                        seed: &mut u64| match attached.as_mut() {
                Some(a) => run_once_spec(&engine, session, a, (pp, tg), seed),
                None => run_once(&engine, session, (pp, tg, depth), seed),
            };
            prefill_depth(&engine, &mut session, depth, &mut seed)?;
            once(&mut session, &mut attached, &mut seed)?; // warm-up
            if let Some(a) = attached.as_mut() {
                (a.draft_ns, a.rounds) = (0, 0);
            }
            let mut samples_ns = Vec::with_capacity(args.repetitions);
            for _ in 0..args.repetitions {
                samples_ns.push(once(&mut session, &mut attached, &mut seed)?);
            }
            #[allow(clippy::cast_precision_loss, reason = "timing statistics")]
            let samples_ts: Vec<f64> = samples_ns
                .iter()
                .map(|&ns| (pp + tg) as f64 * 1e9 / ns as f64)
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
            records.push(Record {
                build_commit: env!("CARGO_PKG_VERSION"),
                model_filename: path.display().to_string(),
                model_type: model_type.clone(),
                model_size: size,
                model_n_params: params,
                backends: "CPU",
                n_threads: args.threads,
                n_batch: args.batch_size,
                type_k: k_type.name().to_owned(),
                type_v: v_type.name().to_owned(),
                n_prompt: pp,
                n_gen: tg,
                n_depth: depth,
                kv_bytes_per_token: layout.bytes_per_token(),
                kv_bytes_used: layout.bytes_for(depth + pp + tg),
                test_time: format!("{:?}", std::time::SystemTime::now()),
                avg_ns,
                stddev_ns,
                avg_ts,
                stddev_ts,
                samples_ns,
                samples_ts,
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
                "| model | size | params | backend | threads | type_k | type_v | kv MiB | test | t/s |"
            );
            let _ = writeln!(
                s,
                "| --- | ---: | ---: | --- | ---: | --- | --- | ---: | ---: | ---: |"
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
                let _ = writeln!(
                    s,
                    "| {} | {gib:.2} GiB | {m:.2} M | {} | {} | {} | {} | {kv_mib:.2} | {test} | {:.2} ± {:.2} |",
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
