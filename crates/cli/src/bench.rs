//! `specula bench`: llama-bench's pp/tg tests and output formats.
//!
//! `pp N` processes an N-token prompt from an empty cache in batches of `-b` (first token BOS
//! when the model adds one, the rest pseudo-random ids); `tg N` decodes N single tokens after
//! BOS. Each test runs once as warm-up, then `-r` times; `avg_ts`/`stddev_ts` are tokens per
//! second over the repetitions, as llama-bench reports them.

use std::fmt::Write as _;
use std::time::Instant;

use anyhow::{Result, bail};
use serde::Serialize;
use specula_cpu::CpuBackend;
use specula_engine::{Engine, Session};

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
    /// Threads.
    #[arg(short = 't', long, default_value_t = 2)]
    pub threads: usize,
    /// Repetitions.
    #[arg(short = 'r', long = "repetitions", default_value_t = 5)]
    pub repetitions: usize,
    /// Batch size of prompt processing.
    #[arg(short = 'b', long = "batch-size", default_value_t = 2048)]
    pub batch_size: usize,
    /// K cache type.
    #[arg(long = "cache-type-k", visible_alias = "ctk", default_value = "f16")]
    pub cache_type_k: String,
    /// V cache type.
    #[arg(long = "cache-type-v", visible_alias = "ctv", default_value = "f16")]
    pub cache_type_v: String,
    /// Output format.
    #[arg(short = 'o', long = "output", value_enum, default_value = "md")]
    pub output: Output,
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
    test_time: String,
    avg_ns: u64,
    stddev_ns: u64,
    avg_ts: f64,
    stddev_ts: f64,
    samples_ns: Vec<u64>,
    samples_ts: Vec<f64>,
}

/// Deterministic pseudo-random ids (llama-bench uses `rand() % n_vocab`).
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

fn run_pp(
    e: &Engine<CpuBackend>,
    s: &mut Session<CpuBackend>,
    n: usize,
    seed: &mut u64,
) -> Result<()> {
    let mut toks = ids(n, e.model.hparams().n_vocab, seed);
    if let (true, Some(bos)) = (e.tokenizer.add_bos(), e.tokenizer.special_tokens().bos) {
        toks[0] = bos;
    }
    s.truncate(0);
    e.prefill(s, &toks, false)?;
    Ok(())
}

fn run_tg(
    e: &Engine<CpuBackend>,
    s: &mut Session<CpuBackend>,
    n: usize,
    seed: &mut u64,
) -> Result<()> {
    s.truncate(0);
    let mut tok = e
        .tokenizer
        .special_tokens()
        .bos
        .unwrap_or_else(|| ids(1, e.model.hparams().n_vocab, seed)[0]);
    for _ in 0..n {
        e.decode(s, tok)?;
        tok = ids(1, e.model.hparams().n_vocab, seed)[0];
    }
    Ok(())
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
    let path = load::model_path(args.model.as_deref())?;
    let mut engine = load::cpu_engine(&path, args.threads)?;
    engine.n_batch = args.batch_size;
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
        .max(1);
    let mut session = engine.session(n_ctx, k_type, v_type)?;
    let mut seed = 0x2545_f491_4f6c_dd1du64;

    let mut records = Vec::new();
    let tests = args
        .n_prompt
        .iter()
        .filter(|&&n| n > 0)
        .map(|&n| (n, 0))
        .chain(args.n_gen.iter().filter(|&&n| n > 0).map(|&n| (0, n)));
    for (pp, tg) in tests {
        let one = |s: &mut Session<CpuBackend>, seed: &mut u64| -> Result<()> {
            if pp > 0 {
                run_pp(&engine, s, pp, seed)
            } else {
                run_tg(&engine, s, tg, seed)
            }
        };
        one(&mut session, &mut seed)?; // warm-up
        let mut samples_ns = Vec::with_capacity(args.repetitions);
        for _ in 0..args.repetitions {
            let t = Instant::now();
            one(&mut session, &mut seed)?;
            samples_ns.push(u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX));
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
            test_time: format!("{:?}", std::time::SystemTime::now()),
            avg_ns,
            stddev_ns,
            avg_ts,
            stddev_ts,
            samples_ns,
            samples_ts,
        });
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
                "| model | size | params | backend | threads | test | t/s |"
            );
            let _ = writeln!(s, "| --- | ---: | ---: | --- | ---: | ---: | ---: |");
            for r in records {
                let test = if r.n_prompt > 0 {
                    format!("pp{}", r.n_prompt)
                } else {
                    format!("tg{}", r.n_gen)
                };
                #[allow(clippy::cast_precision_loss, reason = "display")]
                let (gib, m) = (
                    r.model_size as f64 / (1u64 << 30) as f64,
                    r.model_n_params as f64 / 1e6,
                );
                let _ = writeln!(
                    s,
                    "| {} | {gib:.2} GiB | {m:.2} M | {} | {} | {test} | {:.2} ± {:.2} |",
                    r.model_type, r.backends, r.n_threads, r.avg_ts, r.stddev_ts
                );
            }
        }
    }
    Ok(s)
}
