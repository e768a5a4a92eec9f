//! `specula extract`: the target's hidden states over a corpus, for drafter training.
//!
//! The corpus (files, or directories walked recursively, in sorted path order; files named
//! by `--held-out` left out for evaluation) is tokenized file by file and cut into sequences
//! of at most `--seq-len` tokens. [`Engine::extract`](specula_engine::Engine::extract) runs `--batch` sequences per forward and
//! gives each row's taps side by side (and the top-k target logits with `--top-k`). Every
//! `--shard-seqs` sequences become one shard file, written to a temporary name and renamed,
//! then recorded in `manifest.json` (also replaced whole): a run that is stopped — killed, or
//! by `--max-shards` — resumes at the first shard the manifest does not have, and a finished
//! directory is the same bytes however many runs made it. A directory holding another run's
//! features (other target, taps, corpus, …) is refused with the field that differs.
//!
//! With `--generate N` each sequence keeps only its first `--seq-len − N` corpus tokens, and
//! the target continues them greedily for up to N tokens
//! ([`Engine::continue_greedy`](specula_engine::Engine::continue_greedy), ending early after an
//! end-of-generation token) before its features are taken: the text a drafter for greedy
//! decoding should learn, where every next token is the target's own top-1.
//!
//! # Shard layout (little-endian)
//! `SPECFEAT`, u32 version (1), u32 sequences, u64 tokens, u32 width (taps × n_embd), u32 k;
//! then per sequence its u32 length; every token's u32 id; every token's `width` f16
//! features; every token's `k` pairs (u32 id, f32 logit), largest first.

use std::fmt::Write as _;
use std::io::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use indicatif::{ProgressBar, ProgressStyle};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use specula_engine::{ExtractOptions, SeqFeatures};
use specula_quant::blocks::Half;
use specula_tokenizer::EncodeOptions;

use crate::load;

/// Arguments of `specula extract`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The target: a GGUF file, or the name of a model from the manifest.
    #[arg(short = 'm', long = "model")]
    pub model: Option<String>,
    /// Corpus files or directories (walked recursively).
    #[arg(long = "corpus", required = true, num_args = 1..)]
    pub corpus: Vec<PathBuf>,
    /// Only files with these extensions (comma-separated, e.g. `py,txt`); default every file.
    #[arg(long = "ext", value_delimiter = ',')]
    pub ext: Vec<String>,
    /// File names (not paths) kept out of the features, for evaluation; repeatable.
    #[arg(long = "held-out")]
    pub held_out: Vec<String>,
    /// Output directory (created; resumed if it holds this run's manifest).
    #[arg(short = 'o', long = "out")]
    pub out: PathBuf,
    /// Taps, comma-separated, in the layer-input convention (0 = embeddings, `l` = output of
    /// layer `l − 1`, `n_layer` = the pre-final-norm state). Default: DFlash's choice for a
    /// five-layer drafter, HF layers evenly spaced from 1 to `n_layer − 3`, each plus one.
    #[arg(long = "taps", value_delimiter = ',')]
    pub taps: Vec<usize>,
    /// Tokens per sequence at most.
    #[arg(long = "seq-len", default_value_t = 512)]
    pub seq_len: usize,
    /// Keep the `K` largest target logits of every token (EAGLE-3 distillation); 0: none,
    /// and the output head does not run.
    #[arg(long = "top-k", default_value_t = 0)]
    pub top_k: usize,
    /// Sequences per forward.
    #[arg(long = "batch", default_value_t = 4)]
    pub batch: usize,
    /// Replace the last `N` tokens of every sequence by the target's greedy continuation of
    /// the tokens before them (ending early after an end-of-generation token); 0: the corpus
    /// as it is.
    #[arg(long = "generate", default_value_t = 0)]
    pub generate: usize,
    /// Sequences per forward while generating (each forward is one token of each: larger
    /// batches read the weights once for more rows).
    #[arg(long = "gen-batch", default_value_t = 16)]
    pub gen_batch: usize,
    /// Sequences per shard file.
    #[arg(long = "shard-seqs", default_value_t = 64)]
    pub shard_seqs: usize,
    /// Stop after writing this many new shards (a later run resumes).
    #[arg(long = "max-shards")]
    pub max_shards: Option<usize>,
    /// Threads (0 = all cores).
    #[arg(short = 't', long = "threads", default_value_t = 0)]
    pub threads: usize,
}

/// `manifest.json`: what the features are of, and the shards written so far.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Manifest {
    pub format: String,
    pub version: u32,
    pub target: Target,
    pub taps: Vec<usize>,
    pub seq_len: usize,
    pub top_k: usize,
    pub shard_seqs: usize,
    /// Tokens of each sequence the target generated (`--generate`; absent in manifests
    /// written before it existed: 0).
    #[serde(default)]
    pub generate: usize,
    pub corpus: Vec<Doc>,
    pub held_out: Vec<String>,
    /// Files of the corpus that are not UTF-8 text (left out).
    pub skipped: Vec<String>,
    /// Sequences and tokens of the whole corpus (with `--generate`, the most tokens: a
    /// continuation may end early).
    pub n_seqs: usize,
    pub n_tokens: usize,
    pub shards: Vec<Shard>,
}

/// The target model.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Target {
    pub file: String,
    pub sha256: String,
    pub arch: String,
    pub n_layer: usize,
    pub n_embd: usize,
    pub n_vocab: usize,
}

/// One corpus file.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Doc {
    pub path: String,
    pub sha256: String,
    pub tokens: usize,
}

/// One shard file.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Shard {
    pub file: String,
    pub first_seq: usize,
    pub seqs: usize,
    pub tokens: usize,
    pub sha256: String,
}

const FORMAT: &str = "specula-features";
const MAGIC: &[u8; 8] = b"SPECFEAT";

fn hex(d: impl AsRef<[u8]>) -> String {
    d.as_ref().iter().fold(String::new(), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

fn sha256_file(p: &Path) -> Result<String> {
    let mut f = std::fs::File::open(p).with_context(|| format!("cannot read {}", p.display()))?;
    let mut h = Sha256::new();
    std::io::copy(&mut f, &mut h).with_context(|| format!("cannot read {}", p.display()))?;
    Ok(hex(h.finalize()))
}

/// DFlash's default taps for a five-layer drafter (z-lab's `build_target_layer_ids`: HF layers
/// `round(1 + i·(n_layer − 4)/4)`, Python's round half to even), as layer inputs (each + 1).
fn default_taps(n_layer: usize) -> Vec<usize> {
    const D: usize = 4; // draft layers − 1
    if n_layer < 4 {
        return vec![n_layer / 2 + 1];
    }
    let span = n_layer - 4;
    (0..=D)
        .map(|i| {
            let v = D + i * span; // (1 + i·span/D)·D
            let (q, r) = (v / D, v % D);
            let hf = match (2 * r).cmp(&D) {
                std::cmp::Ordering::Greater => q + 1,
                std::cmp::Ordering::Equal => q + q % 2,
                std::cmp::Ordering::Less => q,
            };
            hf + 1
        })
        .collect()
}

/// The corpus files in sorted order, `--ext` applied, held-out names left out.
fn corpus_files(args: &Args) -> Result<Vec<PathBuf>> {
    fn walk(p: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
        let meta = std::fs::metadata(p).with_context(|| format!("corpus {}", p.display()))?;
        if meta.is_dir() {
            let mut entries: Vec<PathBuf> = std::fs::read_dir(p)
                .with_context(|| format!("corpus {}", p.display()))?
                .map(|e| e.map(|e| e.path()))
                .collect::<std::io::Result<_>>()
                .with_context(|| format!("corpus {}", p.display()))?;
            entries.sort();
            for e in entries {
                walk(&e, out)?;
            }
        } else {
            out.push(p.to_path_buf());
        }
        Ok(())
    }
    let mut files = Vec::new();
    for c in &args.corpus {
        walk(c, &mut files)?;
    }
    files.retain(|f| {
        let name = f.file_name().and_then(|n| n.to_str()).unwrap_or("");
        let ext_ok = args.ext.is_empty()
            || f.extension()
                .and_then(|e| e.to_str())
                .is_some_and(|e| args.ext.iter().any(|x| x == e));
        ext_ok && !args.held_out.iter().any(|h| h == name)
    });
    if files.is_empty() {
        bail!("the corpus has no files to extract from");
    }
    Ok(files)
}

/// Writes `bytes` to `path` through a temporary file in the same directory and a rename, so
/// `path` is either absent, the old file or the whole new one.
fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = path.with_extension("tmp");
    let mut f =
        std::fs::File::create(&tmp).with_context(|| format!("cannot write {}", tmp.display()))?;
    f.write_all(bytes)
        .and_then(|()| f.sync_all())
        .with_context(|| format!("cannot write {}", tmp.display()))?;
    drop(f);
    std::fs::rename(&tmp, path).with_context(|| format!("cannot write {}", path.display()))
}

fn u32_of(n: usize, what: &str) -> Result<u32> {
    u32::try_from(n).with_context(|| format!("{what} {n} does not fit a shard header"))
}

/// The bytes of one shard.
fn shard_bytes(seqs: &[&[u32]], feats: &[SeqFeatures], width: usize, k: usize) -> Result<Vec<u8>> {
    let tokens: usize = seqs.iter().map(|s| s.len()).sum();
    let mut b = Vec::with_capacity(40 + tokens * (4 + 2 * width + 8 * k));
    b.extend_from_slice(MAGIC);
    b.extend_from_slice(&1u32.to_le_bytes());
    b.extend_from_slice(&u32_of(seqs.len(), "sequences")?.to_le_bytes());
    b.extend_from_slice(&(tokens as u64).to_le_bytes());
    b.extend_from_slice(&u32_of(width, "width")?.to_le_bytes());
    b.extend_from_slice(&u32_of(k, "top-k")?.to_le_bytes());
    for s in seqs {
        b.extend_from_slice(&u32_of(s.len(), "sequence length")?.to_le_bytes());
    }
    for &id in seqs.iter().flat_map(|s| s.iter()) {
        b.extend_from_slice(&id.to_le_bytes());
    }
    for f in feats {
        for &x in &f.features {
            b.extend_from_slice(&Half::from_f32(x).to_bits().to_le_bytes());
        }
    }
    for f in feats {
        for &(id, logit) in f.top_k.iter().flatten() {
            b.extend_from_slice(&id.to_le_bytes());
            b.extend_from_slice(&logit.to_le_bytes());
        }
    }
    Ok(b)
}

/// The first field in which `old` (a directory's manifest) is not this run.
fn differs(old: &Manifest, new: &Manifest) -> Option<String> {
    let pairs: [(&str, String, String); 8] = [
        (
            "format",
            format!("{} {}", old.format, old.version),
            format!("{} {}", new.format, new.version),
        ),
        (
            "target",
            old.target.sha256.clone(),
            new.target.sha256.clone(),
        ),
        ("taps", format!("{:?}", old.taps), format!("{:?}", new.taps)),
        ("seq-len", old.seq_len.to_string(), new.seq_len.to_string()),
        ("top-k", old.top_k.to_string(), new.top_k.to_string()),
        (
            "generate",
            old.generate.to_string(),
            new.generate.to_string(),
        ),
        (
            "shard-seqs",
            old.shard_seqs.to_string(),
            new.shard_seqs.to_string(),
        ),
        (
            "held-out",
            format!("{:?}", old.held_out),
            format!("{:?}", new.held_out),
        ),
    ];
    if let Some((name, a, b)) = pairs.into_iter().find(|(_, a, b)| a != b) {
        return Some(format!("{name}: {a} there, {b} here"));
    }
    if old.corpus != new.corpus {
        return Some(format!(
            "corpus: {} files ({} tokens) there, {} files ({} tokens) here, or their contents",
            old.corpus.len(),
            old.n_tokens,
            new.corpus.len(),
            new.n_tokens
        ));
    }
    None
}

/// `specula extract`.
pub fn run(args: &Args) -> Result<String> {
    if args.seq_len < 2 || args.batch == 0 || args.gen_batch == 0 || args.shard_seqs == 0 {
        bail!("--seq-len must be at least 2, --batch, --gen-batch and --shard-seqs at least 1");
    }
    if args.generate >= args.seq_len {
        bail!(
            "--generate {} leaves no prompt in a sequence of --seq-len {}",
            args.generate,
            args.seq_len
        );
    }
    let path = load::model_path(args.model.as_deref())?;
    let engine = load::cpu_engine(&path, args.threads)?;
    let hp = engine.model.hparams();
    let taps = if args.taps.is_empty() {
        default_taps(hp.n_layer)
    } else {
        args.taps.clone()
    };
    if let Some(&t) = taps.iter().find(|&&t| t > hp.n_layer) {
        bail!(
            "tap {t} is past the target's {} layers (want at most {})",
            hp.n_layer,
            hp.n_layer
        );
    }

    // Tokenize the corpus, file by file, into sequences.
    let files = corpus_files(args)?;
    let mut corpus = Vec::new();
    let mut skipped = Vec::new();
    let mut seqs: Vec<Vec<u32>> = Vec::new();
    let enc = EncodeOptions {
        add_special: true,
        parse_special: false,
    };
    for f in &files {
        let bytes = std::fs::read(f).with_context(|| format!("cannot read {}", f.display()))?;
        let Ok(text) = std::str::from_utf8(&bytes) else {
            skipped.push(f.display().to_string());
            continue;
        };
        let ids = engine.tokenizer.encode_with(text, enc);
        corpus.push(Doc {
            path: f.display().to_string(),
            sha256: hex(Sha256::digest(&bytes)),
            tokens: ids.len(),
        });
        let prompt = args.seq_len - args.generate;
        seqs.extend(
            ids.chunks(args.seq_len)
                .filter(|c| c.len() >= 2)
                .map(|c| c[..c.len().min(prompt)].to_vec()),
        );
    }
    if seqs.is_empty() {
        bail!("the corpus gives no sequence of 2 tokens or more");
    }
    let mut manifest = Manifest {
        format: FORMAT.into(),
        version: 1,
        target: Target {
            file: path.display().to_string(),
            sha256: sha256_file(&path)?,
            arch: hp.arch.name().to_string(),
            n_layer: hp.n_layer,
            n_embd: hp.n_embd,
            n_vocab: hp.n_vocab,
        },
        taps: taps.clone(),
        seq_len: args.seq_len,
        top_k: args.top_k,
        shard_seqs: args.shard_seqs,
        generate: args.generate,
        corpus,
        held_out: args.held_out.clone(),
        skipped,
        n_seqs: seqs.len(),
        n_tokens: seqs.iter().map(|s| s.len() + args.generate).sum(),
        shards: Vec::new(),
    };

    // Resume what the directory holds.
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("cannot create {}", args.out.display()))?;
    let mpath = args.out.join("manifest.json");
    if mpath.exists() {
        let old: Manifest = serde_json::from_slice(
            &std::fs::read(&mpath).with_context(|| format!("cannot read {}", mpath.display()))?,
        )
        .with_context(|| format!("{} is not a features manifest", mpath.display()))?;
        if let Some(d) = differs(&old, &manifest) {
            bail!(
                "{} holds the features of another run ({d}); use another --out directory",
                args.out.display()
            );
        }
        for s in &old.shards {
            let p = args.out.join(&s.file);
            if sha256_file(&p)? != s.sha256 {
                bail!(
                    "{}: its sha256 is not the manifest's (a damaged shard); remove it and its entry, or the directory",
                    p.display()
                );
            }
        }
        manifest.shards = old.shards;
    }

    let n_shards = seqs.len().div_ceil(args.shard_seqs);
    let done = manifest.shards.len();
    let width = taps.len() * hp.n_embd;
    let opts = ExtractOptions {
        taps,
        top_k: args.top_k,
        batch: args.batch,
    };
    let bar = ProgressBar::new(manifest.n_tokens as u64).with_style(
        ProgressStyle::with_template(
            "{spinner} [{bar:30}] {pos}/{len} tokens {per_sec} {eta} {wide_msg}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> "),
    );
    let before: usize = manifest.shards.iter().map(|s| s.tokens).sum();
    bar.set_position(before as u64);
    let mut written = 0;
    for i in done..n_shards {
        if args.max_shards.is_some_and(|m| written >= m) {
            break;
        }
        let first = i * args.shard_seqs;
        let corpus_seqs: Vec<&[u32]> = seqs[first..(first + args.shard_seqs).min(seqs.len())]
            .iter()
            .map(Vec::as_slice)
            .collect();
        let generated = if args.generate > 0 {
            bar.set_message(format!("shard {}/{n_shards}: generating", i + 1));
            bar.inc(corpus_seqs.iter().map(|s| s.len() as u64).sum());
            let out = engine.continue_greedy(&corpus_seqs, args.generate, args.gen_batch, |k| {
                bar.inc(k as u64);
            })?;
            // Ended early: the tokens it did not generate count as done.
            let short: usize = out.iter().map(|s| s.len()).sum::<usize>();
            let full: usize = corpus_seqs.iter().map(|s| s.len() + args.generate).sum();
            bar.inc((full - short) as u64);
            out
        } else {
            Vec::new()
        };
        let group: Vec<&[u32]> = if args.generate > 0 {
            generated.iter().map(Vec::as_slice).collect()
        } else {
            corpus_seqs
        };
        bar.set_message(format!("shard {}/{n_shards}", i + 1));
        let mut feats = Vec::with_capacity(group.len());
        engine.extract(&group, &opts, |j, f| {
            if args.generate == 0 {
                bar.inc(group[j].len() as u64);
            }
            feats.push(f);
            Ok(())
        })?;
        let bytes = shard_bytes(&group, &feats, width, args.top_k)?;
        let file = format!("shard-{i:05}.bin");
        write_atomic(&args.out.join(&file), &bytes)?;
        manifest.shards.push(Shard {
            file,
            first_seq: first,
            seqs: group.len(),
            tokens: group.iter().map(|s| s.len()).sum(),
            sha256: hex(Sha256::digest(&bytes)),
        });
        write_atomic(&mpath, serde_json::to_string_pretty(&manifest)?.as_bytes())?;
        written += 1;
    }
    bar.finish_and_clear();
    let have: usize = manifest.shards.iter().map(|s| s.tokens).sum();
    Ok(format!(
        "{}: {} of {n_shards} shards, {have} of {} tokens ({} sequences, taps {:?}, width {width}, top-k {}); {written} written now{}\n",
        args.out.display(),
        manifest.shards.len(),
        manifest.n_tokens,
        manifest.n_seqs,
        opts.taps,
        args.top_k,
        if manifest.shards.len() < n_shards {
            "; run again to resume"
        } else {
            ""
        }
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// DFlash's `build_target_layer_ids` for 36 and 32 layers ([1, 9, 17, 25, 33] and
    /// [1, 8, 15, 22, 29], `speculative.md`) and 30 (Python: [1, 8, 14, 20, 27], 7.5 and
    /// 20.5 rounded to even), as layer inputs.
    #[test]
    fn default_taps_are_dflashs_plus_one() {
        assert_eq!(default_taps(36), vec![2, 10, 18, 26, 34]);
        assert_eq!(default_taps(32), vec![2, 9, 16, 23, 30]);
        assert_eq!(default_taps(30), vec![2, 9, 15, 21, 28]);
    }
}
