//! `specula run`: generate text from a prompt, like llama.cpp's `llama-cli` / `llama-simple`.

use std::io::Write as _;

use anyhow::{Context, Result, bail};
use serde::Serialize;
use specula_engine::{GenerateOptions, Timings};
use specula_sampling::SamplerParams;
use specula_tokenizer::{ChatMessage, EncodeOptions};

use crate::load;

/// Arguments of `specula run` (llama.cpp flag names).
#[derive(Debug, clap::Args)]
pub struct Args {
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
    /// Tokens per prefill batch.
    #[arg(short = 'b', long = "batch-size", default_value_t = 512)]
    pub batch_size: usize,
    /// K cache type.
    #[arg(long = "cache-type-k", visible_alias = "ctk", default_value = "f16")]
    pub cache_type_k: String,
    /// V cache type.
    #[arg(long = "cache-type-v", visible_alias = "ctv", default_value = "f16")]
    pub cache_type_v: String,
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
}

#[derive(Serialize)]
struct JsonTimings {
    prompt_n: usize,
    prompt_ms: f64,
    predicted_n: usize,
    predicted_ms: f64,
}

impl From<Timings> for JsonTimings {
    fn from(t: Timings) -> Self {
        Self {
            prompt_n: t.prompt_n,
            prompt_ms: t.prompt_ms,
            predicted_n: t.predicted_n,
            predicted_ms: t.predicted_ms,
        }
    }
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
    let path = load::model_path(args.model.as_deref())?;
    let mut engine = load::cpu_engine(&path, args.threads)?;
    engine.n_batch = args.batch_size;

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
    load::check_cache(&engine, args.ctx_size, k_type, v_type)?;
    let mut session = engine.session(args.ctx_size, k_type, v_type)?;

    let stream = !args.json;
    let mut stdout = std::io::stdout();
    let mut pending: Vec<u8> = Vec::new();
    let tokenizer = &engine.tokenizer;
    let out = engine.generate(&mut session, &prompt_ids, &opts, |id| {
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
    })?;
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
        return Ok(String::from("\n"));
    }
    let json = JsonOut {
        model: path.display().to_string(),
        prompt_ids: out.prompt_ids,
        generated_ids: out.generated_ids,
        text: out.text,
        timings: out.timings.into(),
        top_logits: (args.top_logits > 0).then_some(out.top_logits),
    };
    let mut s = serde_json::to_string(&json)?;
    s.push('\n');
    Ok(s)
}

#[allow(clippy::cast_precision_loss, reason = "token counts are small")]
fn per_second(n: usize, ms: f64) -> f64 {
    if ms > 0.0 { n as f64 * 1e3 / ms } else { 0.0 }
}
