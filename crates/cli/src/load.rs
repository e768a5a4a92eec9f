//! Finding and loading a model for the commands that run one (`run`, `bench`, `perplexity`).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result};
use specula_cpu::CpuBackend;
use specula_engine::Engine;
use specula_gguf::Gguf;
use specula_models::Model;
use specula_quant::QType;
use specula_tokenizer::Tokenizer;

/// A path that exists is used as is; otherwise a manifest model name is fetched (verified,
/// cached); no argument means the default model (fetched and verified on first use, with a
/// progress bar).
pub fn model_path(arg: Option<&str>) -> Result<PathBuf> {
    model_path_with(arg, false)
}

/// [`model_path`]; `offline` (llama-server's `--offline`): a model name must already be in
/// the cache, nothing is downloaded.
pub fn model_path_with(arg: Option<&str>, offline: bool) -> Result<PathBuf> {
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
    if offline {
        return cache.path_if_present(name).ok_or_else(|| {
            anyhow::anyhow!(
                "--offline: model {name} is not in the cache {}; fetch it first (without --offline) or give a GGUF file",
                cache.root().display()
            )
        });
    }
    Ok(cache.fetch(name, true)?)
}

/// Opens the model file and builds the CPU engine with `threads` threads (0 = all cores).
pub fn cpu_engine(path: &Path, threads: usize) -> Result<Engine<CpuBackend>> {
    engine_on(CpuBackend::new(self::threads(threads)), path)
}

/// A `-t` value: itself, or every core for 0.
#[must_use]
pub fn threads(threads: usize) -> usize {
    if threads == 0 {
        std::thread::available_parallelism().map_or(1, std::num::NonZero::get)
    } else {
        threads
    }
}

/// Opens the model file and builds its engine on `backend`.
pub fn engine_on<B: specula_tensor::Backend>(
    backend: impl Into<Arc<B>>,
    path: &Path,
) -> Result<Engine<B>> {
    let backend = backend.into();
    let file =
        Arc::new(Gguf::open(path).with_context(|| format!("cannot load {}", path.display()))?);
    let tokenizer = Tokenizer::from_gguf(&file)
        .with_context(|| format!("cannot build the tokenizer of {}", path.display()))?;
    let model = Model::load(&*backend, file)
        .with_context(|| format!("cannot load the model in {}", path.display()))?;
    Ok(Engine::shared(backend, model, tokenizer))
}

/// Parses a KV cache type flag (`f16`, `q8_0`, `turbo4`, …).
pub fn cache_type(s: &str) -> Result<QType> {
    Ok(specula_kv::parse_cache_type(s)?)
}

/// GQA ratio (query heads per K/V head) from which a turbo K is known to hurt a model: the
/// TurboQuant fork switches K to q8_0 there (`TURBO_AUTO_ASYMMETRIC`, ratio ≥ 6, after Qwen2.5
/// at 7:1 went from PPL 7.4 to 2887 with turbo3 K). Measured here on Qwen2.5-Coder-0.5B (7:1,
/// textwrap.py, 2 × 512, KLD vs the f16 cache): with the fork's zero padding turbo3 K + q8_0 V
/// collapsed (3.37, PPL 151); with 64-value heads stored in two stages turbo2/turbo2 is 0.110,
/// 17 × the 0.0065 of q8_0 K / turbo2 V, turbo3/turbo3 0.0066 (3.3 × q8_0 K's 0.0020) and
/// turbo4/turbo4 0.0016, as good as q8_0 K (`docs/perf.md`). The limit stays for heads of 128
/// (Qwen2.5-1.5B is 6:1), which keep the fork's encoding. SmolLM2-135M (3:1) takes turbo K
/// well.
pub const TURBO_K_GQA_LIMIT: usize = 6;

/// The start-up warning for a turbo K on a model whose GQA ratio makes it harmful, naming the
/// asymmetric setting that fixes it; `None` when the formats are fine for the model.
#[must_use]
pub fn turbo_k_warning(n_head: usize, n_head_kv: usize, k: QType, v: QType) -> Option<String> {
    let ratio = n_head / n_head_kv.max(1);
    (specula_kv::is_turbo(k) && ratio >= TURBO_K_GQA_LIMIT).then(|| {
        let fix_v = if specula_kv::is_turbo(v) { v } else { k };
        format!(
            "-ctk {k} is known to degrade models with {n_head}:{n_head_kv} grouped-query attention (each K head serves {ratio} query heads, so its error reaches {ratio} heads; on Qwen2.5-0.5B turbo2 K has 17 × the KL divergence of q8_0 K); use -ctk q8_0 -ctv {fix_v} to keep a compact V with an accurate K"
        )
    })
}

/// Per-layer cache formats (`run`, `perplexity`, `bench`).
#[derive(clap::Args, Clone, Debug, Default)]
pub struct LayerTypeArgs {
    /// K cache type of some layers, overriding -ctk there: comma-separated `LAYERS:TYPE`, LAYERS
    /// one 0-based layer `N` or a range `A-B` (inclusive), e.g. `0-3:q8_0,28-29:q8_0`.
    #[arg(long = "cache-type-k-layers", value_name = "SPEC")]
    pub cache_type_k_layers: Option<String>,
    /// V cache type of some layers, overriding -ctv there (same syntax).
    #[arg(long = "cache-type-v-layers", value_name = "SPEC")]
    pub cache_type_v_layers: Option<String>,
}

/// The per-layer cache formats of the flags (whether the layers exist is checked against the
/// model by [`check_cache`]).
pub fn layer_types(args: &LayerTypeArgs) -> Result<Vec<specula_kv::LayerOverride>> {
    let mut o = Vec::new();
    for (spec, v) in [
        (&args.cache_type_k_layers, false),
        (&args.cache_type_v_layers, true),
    ] {
        if let Some(spec) = spec {
            o.extend(specula_kv::parse_layer_types(spec, v)?);
        }
    }
    Ok(o)
}

/// Checks that the model's heads can be stored in `k` / `v` (a clear error at start, before
/// any work) and prints the turbo-K warning when it applies. Returns the cache layout.
pub fn check_cache<B: specula_tensor::Backend>(
    engine: &Engine<B>,
    n_ctx: usize,
    k: QType,
    v: QType,
) -> Result<specula_kv::KvLayout> {
    let hp = engine.model.hparams();
    let layout = engine
        .kv_layout(n_ctx, k, v)
        .with_context(|| format!("cannot use -ctk {k} -ctv {v} with this model"))?;
    let turbo_k = layout
        .layers
        .iter()
        .find(|l| specula_kv::is_turbo(l.types.k));
    if let Some(w) = turbo_k.and_then(|l| turbo_k_warning(hp.n_head, hp.n_head_kv, l.types.k, v)) {
        eprintln!("warning: {w}");
    }
    Ok(layout)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A turbo K at GQA ≥ 6 (Qwen2.5-0.5B: 14 query heads on 2 K/V heads) is warned about, with
    /// the asymmetric setting that fixes it; SmolLM2's 9:3 and a q8_0 K are not.
    #[test]
    fn the_turbo_k_warning_names_the_fix() {
        let w = turbo_k_warning(14, 2, QType::Turbo3, QType::Turbo3).unwrap();
        assert!(w.contains("-ctk q8_0 -ctv turbo3"), "{w}");
        let w = turbo_k_warning(14, 2, QType::Turbo4, QType::F16).unwrap();
        assert!(w.contains("-ctk q8_0 -ctv turbo4"), "{w}");
        assert!(turbo_k_warning(9, 3, QType::Turbo3, QType::Turbo3).is_none());
        assert!(turbo_k_warning(14, 2, QType::Q8_0, QType::Turbo3).is_none());
    }
}
