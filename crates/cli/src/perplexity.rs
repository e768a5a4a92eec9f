//! `specula perplexity`: perplexity of a text as `llama-perplexity` computes it.
//!
//! The text is tokenized once (BOS per the model); it is cut into windows of `-c` tokens; each
//! window starts from an empty cache, its first token replaced by BOS when the model adds
//! one; only the second half of each window is scored (every scored token has at least
//! `n_ctx/2` tokens of context). PPL = exp(mean NLL), with llama.cpp's standard error.
//!
//! **KL divergence** (llama-perplexity's `--kl-divergence-base` / `--kl-divergence`): a first
//! run with `--kl-divergence-base FILE` saves the log-probabilities of every scored token
//! ([`kld`] describes the file); a second run (another cache type, another quantization) with
//! `--kl-divergence-base FILE --kl-divergence` scores the same windows and reports, against the
//! saved distribution, mean/median/p99/max KLD, how often the top token agrees, and the
//! perplexity ratio.

mod kld;

use std::fmt::Write as _;

use anyhow::{Context, Result, bail};
use serde::Serialize;
use specula_tokenizer::EncodeOptions;

use crate::load;

/// Arguments of `specula perplexity`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Flash attention (llama.cpp's `-fa`): on, off or auto; accepted so llama.cpp command lines
    /// run unchanged (the CPU attention is one fused kernel either way).
    #[arg(long = "flash-attn", visible_alias = "fa", default_value = "auto", value_parser = ["on", "off", "auto", "1", "0", "true", "false", "enabled", "disabled"])]
    pub flash_attn: String,
    /// GGUF file or manifest model name; default: the default model.
    #[arg(short = 'm', long = "model")]
    pub model: Option<String>,
    /// Text file to score.
    #[arg(short = 'f', long = "file")]
    pub file: std::path::PathBuf,
    /// Window (context) size.
    #[arg(short = 'c', long = "ctx-size", default_value_t = 512)]
    pub ctx_size: usize,
    /// Windows to score (default: all that fit).
    #[arg(long)]
    pub chunks: Option<usize>,
    /// Threads (0 = all cores).
    #[arg(short = 't', long, default_value_t = 0)]
    pub threads: usize,
    /// Device: `cpu`, or `cuda[:N]` (the CubeCL backend; a build with `--features cuda`).
    #[arg(long = "device", default_value = "cpu")]
    pub device: String,
    /// Tokens per forward batch.
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
    /// Save the scored log-probabilities to FILE (alone), or read them from FILE (with
    /// `--kl-divergence`).
    #[arg(long = "kl-divergence-base", value_name = "FILE")]
    pub kl_divergence_base: Option<std::path::PathBuf>,
    /// Compare against the distribution saved with `--kl-divergence-base`.
    #[arg(long = "kl-divergence", requires = "kl_divergence_base")]
    pub kl_divergence: bool,
    /// End with one JSON line `{"ppl", "ppl_stderr", "chunks", "ctx", "tokens"}` (plus
    /// `"kld_mean"`, `"kld_median"`, `"kld_p99"`, `"kld_max"`, `"top1_agree"`, `"ppl_base"` with
    /// `--kl-divergence`).
    #[arg(long)]
    pub json: bool,
}

#[derive(Serialize)]
struct JsonOut {
    ppl: f64,
    ppl_stderr: f64,
    chunks: usize,
    ctx: usize,
    tokens: usize,
    type_k: String,
    type_v: String,
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    kld: Option<kld::Summary>,
}

/// `log p(tok)` under `softmax(logits)`, as llama-perplexity's `log_softmax`: f32 max and
/// `expf` terms, summed in f64.
fn log_prob(logits: &[f32], tok: usize) -> f64 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&l| f64::from((l - max).exp())).sum();
    f64::from(logits[tok] - max) - sum.ln()
}

/// Runs `specula perplexity`.
pub fn run(args: &Args) -> Result<String> {
    if args.ctx_size < 4 {
        bail!("-c must be at least 4, got {}", args.ctx_size);
    }
    if args.chunks == Some(0) {
        bail!("--chunks must be positive");
    }
    let (k_type, v_type) = (
        load::cache_type(&args.cache_type_k)?,
        load::cache_type(&args.cache_type_v)?,
    );
    let overrides = load::layer_types(&args.layer_types)?;
    let text = std::fs::read_to_string(&args.file)
        .with_context(|| format!("cannot read {}", args.file.display()))?;
    let device = crate::device::Device::parse(&args.device)?;
    let path = load::model_path(args.model.as_deref())?;
    let work = Scoring {
        args,
        text,
        k_type,
        v_type,
        overrides,
    };
    crate::device::on_device(device, &path, args.threads, work)
}

/// What `perplexity` read before the model loads.
struct Scoring<'a> {
    args: &'a Args,
    text: String,
    k_type: specula_quant::QType,
    v_type: specula_quant::QType,
    overrides: Vec<specula_tensor::LayerOverride>,
}

impl crate::device::OnDevice for Scoring<'_> {
    type Out = String;

    fn run<B>(
        self,
        engine: specula_engine::Engine<B>,
        _: crate::device::BackendFor<'_, B>,
    ) -> Result<String>
    where
        B: specula_tensor::Backend + Send + Sync + 'static,
        specula_engine::Engine<B>: Send + Sync,
    {
        score(engine, self)
    }
}

/// Scores the text with the engine of any backend.
#[allow(
    clippy::too_many_lines,
    reason = "the windows, the KL comparison and the report in one pass"
)]
fn score<B: specula_tensor::Backend>(
    mut engine: specula_engine::Engine<B>,
    work: Scoring<'_>,
) -> Result<String> {
    let Scoring {
        args,
        text,
        k_type,
        v_type,
        overrides,
    } = work;
    engine.kv_overrides = overrides;
    engine.swa_full = args.swa_full;
    engine.n_batch = args.batch_size.max(1);
    load::check_cache(&engine, args.ctx_size, k_type, v_type)?;
    let n_ctx = args.ctx_size;
    let tokens = engine
        .tokenizer
        .encode_with(&text, EncodeOptions::default());
    if tokens.len() < 2 * n_ctx {
        bail!(
            "{} tokenizes to {} tokens; perplexity with a context of {n_ctx} needs at least {}",
            args.file.display(),
            tokens.len(),
            2 * n_ctx
        );
    }
    let n_chunk_max = tokens.len() / n_ctx;
    let n_chunk = args.chunks.map_or(n_chunk_max, |c| c.min(n_chunk_max));
    let bos = engine.tokenizer.special_tokens().bos;
    let add_bos = engine.tokenizer.add_bos();
    let n_vocab = engine.model.hparams().n_vocab;
    let first = n_ctx / 2;

    let mut out = String::new();
    let (mut nll, mut nll2, mut count) = (0.0f64, 0.0f64, 0usize);
    let mut session = engine.session(n_ctx, k_type, v_type)?;
    let geometry = kld::Geometry {
        n_ctx,
        n_vocab,
        n_chunk,
        first,
    };
    let mut base_out = match (&args.kl_divergence_base, args.kl_divergence) {
        (Some(p), false) => Some(kld::Writer::create(p, geometry)?),
        _ => None,
    };
    let mut base_in = match (&args.kl_divergence_base, args.kl_divergence) {
        (Some(p), true) => Some(kld::Reader::open(p, geometry)?),
        _ => None,
    };
    let mut cmp = kld::Comparison::default();
    let mut logp = Vec::with_capacity(n_vocab);
    for i in 0..n_chunk {
        let start = i * n_ctx;
        let mut window = tokens[start..start + n_ctx].to_vec();
        if add_bos && let Some(b) = bos {
            window[0] = b;
        }
        if let Some(w) = &mut base_out {
            w.window(&window)?;
        }
        if let Some(r) = &mut base_in {
            r.window(&window)?;
        }
        session.truncate(0);
        let logits = engine.prefill_from(&mut session, &window, first)?;
        for j in first..n_ctx - 1 {
            let row = &logits[(j - first) * n_vocab..(j - first + 1) * n_vocab];
            let tok = tokens[start + j + 1] as usize;
            let v = log_prob(row, tok);
            nll -= v;
            nll2 += v * v;
            if base_out.is_some() || base_in.is_some() {
                kld::log_softmax(row, &mut logp);
            }
            if let Some(w) = &mut base_out {
                w.row(&logp)?;
            }
            if let Some(r) = &mut base_in {
                let base = r.row()?;
                cmp.add(base, &logp, tok);
            }
        }
        count += n_ctx - first - 1;
        #[allow(clippy::cast_precision_loss, reason = "token counts are small")]
        let ppl_so_far = (nll / count as f64).exp();
        let _ = write!(out, "[{}]{ppl_so_far:.4},", i + 1);
        if !args.json {
            eprint!("[{}]{ppl_so_far:.4},", i + 1);
        }
    }
    #[allow(clippy::cast_precision_loss, reason = "token counts are small")]
    let (mean, n) = (nll / count as f64, count as f64);
    let ppl = mean.exp();
    let var = nll2 / n - mean * mean;
    let stderr = if var > 0.0 {
        (var / (n - 1.0)).sqrt() * ppl
    } else {
        0.0
    };
    out.push('\n');
    let _ = writeln!(out, "Final estimate: PPL = {ppl:.4} +/- {stderr:.5}");
    if let Some(w) = base_out {
        let p = w.finish()?;
        let _ = writeln!(out, "saved the base log-probabilities to {}", p.display());
    }
    let summary = base_in.map(|_| cmp.summary(ppl));
    if let Some(sm) = &summary {
        out.push_str(&sm.render());
    }
    if args.json {
        let j = JsonOut {
            ppl,
            ppl_stderr: stderr,
            chunks: n_chunk,
            ctx: n_ctx,
            tokens: tokens.len(),
            type_k: k_type.name().to_owned(),
            type_v: v_type.name().to_owned(),
            kld: summary,
        };
        let _ = writeln!(out, "{}", serde_json::to_string(&j)?);
    } else {
        eprintln!();
    }
    Ok(out)
}
