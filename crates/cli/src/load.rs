//! Finding and loading a model for the commands that run one (`run`, `bench`, `perplexity`).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result};
use specula_cpu::CpuBackend;
use specula_engine::Engine;
use specula_gguf::Gguf;
use specula_models::Model;
use specula_tokenizer::Tokenizer;

/// A path that exists is used as is; otherwise a manifest model name is fetched (verified,
/// cached); no argument means the default model (fetched and verified on first use, with a
/// progress bar).
pub fn model_path(arg: Option<&str>) -> Result<PathBuf> {
    let name = match arg {
        Some(a) if Path::new(a).exists() => return Ok(PathBuf::from(a)),
        Some(a) => {
            if specula_fetch::model(a).is_err() {
                let known: Vec<&str> = specula_fetch::models()
                    .iter()
                    .map(|m| m.name.as_str())
                    .collect();
                anyhow::bail!(
                    "{a}: no such file, and not a model name (known models: {})",
                    known.join(", ")
                );
            }
            a
        }
        None => specula_fetch::default_model().name.as_str(),
    };
    let cache = specula_fetch::ModelCache::from_env()?;
    Ok(cache.fetch(name, true)?)
}

/// Opens the model file and builds the CPU engine with `threads` threads (0 = all cores).
pub fn cpu_engine(path: &Path, threads: usize) -> Result<Engine<CpuBackend>> {
    let threads = if threads == 0 {
        std::thread::available_parallelism().map_or(1, std::num::NonZero::get)
    } else {
        threads
    };
    let file =
        Arc::new(Gguf::open(path).with_context(|| format!("cannot load {}", path.display()))?);
    let tokenizer = Tokenizer::from_gguf(&file)
        .with_context(|| format!("cannot build the tokenizer of {}", path.display()))?;
    let backend = CpuBackend::new(threads);
    let model = Model::load(&backend, file)
        .with_context(|| format!("cannot load the model in {}", path.display()))?;
    Ok(Engine::new(backend, model, tokenizer))
}

/// Parses a KV cache type flag (`f16`, `f32`, …).
pub fn cache_type(s: &str) -> Result<specula_quant::QType> {
    specula_quant::QType::from_name(s)
        .with_context(|| format!("unknown cache type `{s}` (try f16 or f32)"))
}
