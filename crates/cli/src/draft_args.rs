//! The speculative-decoding flags `specula run` and `specula serve` share (llama.cpp's names):
//! draft length per round, the draft model's own context, threads and cache types, and DFlash's
//! injection policy; and the `-md` file's kind (`--dflash`, `--eagle3`, else auto-detected),
//! which `specula bench` takes too.

use anyhow::{Context as _, Result, bail};
use clap::ValueEnum as _;

use crate::run::SpecType;

/// What kind of drafter the `-md` file is, for every subcommand that takes `-md`.
#[derive(Debug, Clone, Copy, Default, clap::Args)]
pub struct DraftKind {
    /// The `-md` file is a DFlash drafter (`--spec-type draft-dflash`).
    #[arg(long = "dflash", conflicts_with = "eagle3")]
    pub dflash: bool,
    /// The `-md` file is an EAGLE-3 head (`--spec-type draft-eagle3`).
    #[arg(long = "eagle3")]
    pub eagle3: bool,
}

impl DraftKind {
    /// The `--spec-type` these flags name, if any.
    #[must_use]
    pub fn flag(self) -> Option<SpecType> {
        if self.dflash {
            Some(SpecType::DraftDflash)
        } else if self.eagle3 {
            Some(SpecType::DraftEagle3)
        } else {
            None
        }
    }

    /// The speculative method of a subcommand: `--spec-type` if given, else `--dflash` /
    /// `--eagle3`, else the `-md` file's architecture ([`detect_spec_type`]); `None` without
    /// any of them (the caller's default). A method that needs a draft model without `-md`,
    /// or `-md` with a method that takes none, is refused.
    ///
    /// # Errors
    /// Contradicting flags, a missing or superfluous `-md`, or a `-md` file that cannot be
    /// read.
    pub fn resolve(
        self,
        spec_type: Option<SpecType>,
        model_draft: Option<&str>,
    ) -> Result<Option<SpecType>> {
        let kind = match (spec_type, self.flag(), model_draft) {
            (Some(t), Some(f), _) if t != f => bail!(
                "--spec-type {} contradicts --{}",
                spec_name(t),
                if self.dflash { "dflash" } else { "eagle3" }
            ),
            (Some(t), _, _) | (None, Some(t), _) => t,
            (None, None, Some(md)) => detect_spec_type(&crate::load::model_path(Some(md))?)?,
            (None, None, None) => return Ok(None),
        };
        let needs_model = matches!(
            kind,
            SpecType::DraftSimple | SpecType::DraftEagle3 | SpecType::DraftDflash
        );
        if needs_model != model_draft.is_some() {
            let flag = match (spec_type, self.dflash, self.eagle3) {
                (None, true, _) => "--dflash".to_owned(),
                (None, _, true) => "--eagle3".to_owned(),
                _ => format!("--spec-type {}", spec_name(kind)),
            };
            bail!(
                "{flag} {}",
                if needs_model {
                    "needs a draft model (-md FILE)"
                } else {
                    "takes no draft model (-md)"
                }
            );
        }
        Ok(Some(kind))
    }
}

/// A `--spec-type`'s name on the command line (`draft-dflash`, …).
pub fn spec_name(t: SpecType) -> String {
    t.to_possible_value()
        .map_or_else(String::new, |v| v.get_name().to_owned())
}

/// The `--spec-type` a draft GGUF asks for, from its `general.architecture` (llama.cpp's
/// auto-detection: `dflash` → DFlash, `eagle3` → EAGLE-3, anything else a draft model).
///
/// # Errors
/// The file cannot be read as GGUF.
pub fn detect_spec_type(path: &std::path::Path) -> Result<SpecType> {
    let file = specula_gguf::Gguf::open(path)
        .with_context(|| format!("cannot load the draft {}", path.display()))?;
    Ok(match file.header().architecture() {
        Some("dflash") => SpecType::DraftDflash,
        Some("eagle3") => SpecType::DraftEagle3,
        _ => SpecType::DraftSimple,
    })
}

/// Draft length and draft-model flags.
#[derive(Debug, Clone, clap::Args)]
pub struct DraftArgs {
    /// Most draft tokens per round.
    #[arg(
        long = "spec-draft-n-max",
        visible_alias = "draft-max",
        default_value_t = 16
    )]
    pub spec_n_max: usize,
    /// Drafts shorter than this are not verified.
    #[arg(
        long = "spec-draft-n-min",
        visible_alias = "draft-min",
        default_value_t = 0
    )]
    pub spec_n_min: usize,
    /// A draft model stops where its top-1 probability falls below this.
    #[arg(
        long = "spec-draft-p-min",
        visible_alias = "draft-p-min",
        default_value_t = 0.75
    )]
    pub spec_p_min: f32,
    /// Always ask for `--spec-draft-n-max` tokens instead of choosing each round's draft
    /// length from measured acceptance and costs.
    #[arg(long = "spec-fixed")]
    pub spec_fixed: bool,
    /// The draft model drafts only among this many of the most frequent tokens (plus the
    /// control and end-of-generation ones): its output head shrinks to those rows, which makes
    /// each draft step cheaper; 0 = the whole vocabulary. Default: 32768 for vocabularies
    /// over 65536 tokens (Qwen2.5's head is 37 % of its 0.5B model's decode step), else all.
    #[arg(long = "spec-draft-vocab")]
    pub spec_draft_vocab: Option<usize>,
    /// Context size of the draft model (0 = the target's context).
    #[arg(long = "ctx-size-draft", visible_alias = "cd", default_value_t = 0)]
    pub ctx_size_draft: usize,
    /// Threads of the draft model (0 = as -t).
    #[arg(long = "threads-draft", visible_alias = "td", default_value_t = 0)]
    pub threads_draft: usize,
    /// K cache type of the draft model.
    #[arg(
        long = "cache-type-k-draft",
        visible_alias = "ctkd",
        default_value = "f16"
    )]
    pub cache_type_k_draft: String,
    /// V cache type of the draft model.
    #[arg(
        long = "cache-type-v-draft",
        visible_alias = "ctvd",
        default_value = "f16"
    )]
    pub cache_type_v_draft: String,
    /// DFlash: inject a verify batch's features into the draft cache only for its committed
    /// rows, once acceptance is known (1), or every batch right after the target ran it (0).
    #[arg(
        long = "dflash-defer-injection",
        default_value_t = 1,
        value_parser = clap::value_parser!(u8).range(0..=1)
    )]
    pub dflash_defer_injection: u8,
    /// How the target's and the draft model's caches take back rejected draft rows: `auto`
    /// (what the cache supports: a trim for attention KV) or `replay` (a checkpoint before each
    /// verify, restored on a rejection, the accepted rows run again — the path of memories that
    /// cannot trim, slower; for checking that it gives the same output).
    #[arg(long = "spec-rollback", value_enum, default_value_t = SpecRollback::Auto)]
    pub spec_rollback: SpecRollback,
}

/// `--spec-rollback`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum SpecRollback {
    /// What the cache supports.
    Auto,
    /// Checkpoint and replay, even where the cache could trim.
    Replay,
}

impl DraftArgs {
    /// Checks the draft-length flags for a speculative run.
    ///
    /// # Errors
    /// `--spec-draft-n-max 0` or a `--spec-draft-p-min` outside `[0, 1]`.
    pub fn check(&self) -> Result<()> {
        if self.spec_n_max == 0 {
            bail!("--spec-draft-n-max must be at least 1 for speculative decoding");
        }
        if !(0.0..=1.0).contains(&self.spec_p_min) {
            bail!(
                "--spec-draft-p-min must be in [0, 1], got {}",
                self.spec_p_min
            );
        }
        Ok(())
    }

    /// Whether rollback by replay is forced.
    #[must_use]
    pub fn force_replay(&self) -> bool {
        self.spec_rollback == SpecRollback::Replay
    }

    /// Threads of the draft model: `-td`, or the target's `threads` when 0.
    #[must_use]
    pub fn threads(&self, target_threads: usize) -> usize {
        if self.threads_draft == 0 {
            target_threads
        } else {
            self.threads_draft
        }
    }
}

/// `--spec-draft-vocab` by default: the size of EAGLE-3's and FR-Spec's draft vocabularies…
const AUTO_DRAFT_VOCAB: usize = 32_768;
/// …for vocabularies larger than this.
const AUTO_DRAFT_VOCAB_OVER: usize = 65_536;

/// Applies `--spec-draft-vocab` to a loaded draft model; returns the message to log when it
/// cut the head.
///
/// # Errors
/// Errors cutting the head.
pub fn restrict_draft_vocab<B: specula_tensor::Backend>(
    draft: &mut specula_engine::Engine<B>,
    args: &DraftArgs,
) -> Result<Option<String>> {
    let n_vocab = draft.model.hparams().n_vocab;
    let n = args
        .spec_draft_vocab
        .unwrap_or(if n_vocab > AUTO_DRAFT_VOCAB_OVER {
            AUTO_DRAFT_VOCAB
        } else {
            0
        });
    if n == 0 || n >= n_vocab {
        return Ok(None);
    }
    let kept = draft.restrict_draft_vocab(n)?;
    Ok(Some(format!(
        "the draft model drafts among {kept} of its {n_vocab} tokens (--spec-draft-vocab {n})"
    )))
}
