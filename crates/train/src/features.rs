//! Reading what `specula extract` wrote: `manifest.json` and its shards.
//!
//! Shard layout (little-endian, as `crates/cli/src/extract.rs` writes it): `SPECFEAT`, u32
//! version (1), u32 sequences, u64 tokens, u32 width (taps × n_embd), u32 k; per sequence its
//! u32 length; every token's u32 id; every token's `width` f16 features; every token's `k`
//! pairs (u32 id, f32 logit). Every shard's sha256 is checked against the manifest when the
//! set is opened; a sequence's rows are then read straight from its file.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::Deserialize;
use sha2::{Digest, Sha256};

use crate::{Result, TrainError};

const MAGIC: &[u8; 8] = b"SPECFEAT";
/// Rows [`FeatureSet::column_scales`] reads at most.
pub const SCALE_ROWS: usize = 16_384;
const HEADER: u64 = 8 + 4 + 4 + 8 + 4 + 4;

/// Divides every row of `rows` (rows of `scale.len()` columns) by `scale`, column by
/// column; nothing when `scale` is empty.
pub fn divide_columns(rows: &mut [f32], scale: &[f32]) {
    if scale.is_empty() {
        return;
    }
    for row in rows.chunks_exact_mut(scale.len()) {
        for (x, &s) in row.iter_mut().zip(scale) {
            *x /= s;
        }
    }
}

/// `params` (in `spec` order) with the column scales folded into `fc.weight`: a drafter
/// trained on features divided by `scale` is the drafter whose `fc` columns are divided by
/// it, fed raw features. `params` unchanged when `scale` is empty.
#[must_use]
pub fn fold_scales(
    spec: &[(String, Vec<usize>)],
    params: &[Vec<f32>],
    scale: &[f32],
) -> Vec<Vec<f32>> {
    let mut out = params.to_vec();
    if scale.is_empty() {
        return out;
    }
    if let Some(fc) = spec
        .iter()
        .position(|(n, _)| n == "fc.weight")
        .and_then(|i| out.get_mut(i))
    {
        divide_columns(fc, scale);
    }
    out
}

/// The fields of `manifest.json` the trainer needs.
#[derive(Clone, Debug, Deserialize)]
pub struct Manifest {
    /// `specula-features`.
    pub format: String,
    /// The target the features are of.
    pub target: ManifestTarget,
    /// Taps in the layer-input convention (DFlash's `target_layers`).
    pub taps: Vec<usize>,
    /// Files left out for evaluation.
    pub held_out: Vec<String>,
    /// The shards written so far.
    pub shards: Vec<ManifestShard>,
}

/// The target recorded in the manifest.
#[derive(Clone, Debug, Deserialize)]
pub struct ManifestTarget {
    /// sha256 of the target GGUF.
    pub sha256: String,
    /// Hidden size.
    pub n_embd: usize,
    /// Vocabulary size.
    pub n_vocab: usize,
}

/// One shard entry.
#[derive(Clone, Debug, Deserialize)]
pub struct ManifestShard {
    /// File name inside the directory.
    pub file: String,
    /// sha256 of the file.
    pub sha256: String,
}

#[derive(Debug)]
struct Shard {
    path: PathBuf,
    /// Per sequence: (token offset in the shard, length).
    seqs: Vec<(u64, usize)>,
    tokens: u64,
    width: usize,
    /// Top-k pairs per token.
    k: usize,
    ids_at: u64,
    feats_at: u64,
}

/// Where one sequence lives.
#[derive(Clone, Copy, Debug)]
struct SeqRef {
    shard: usize,
    index: usize,
}

/// Where a tap's rows come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Col {
    /// Stored in the shards, at this index of the manifest's taps.
    Stored(usize),
    /// Tap 0, the token embedding the target's first layer reads, derived from the ids.
    Embedding,
}

/// The features of a directory, every shard checked.
#[derive(Debug)]
pub struct FeatureSet {
    /// The directory's manifest.
    pub manifest: Manifest,
    /// Width of one feature row as read (`taps × n_embd` of the selected taps).
    pub width: usize,
    /// The taps read, in the order their rows are laid side by side.
    pub taps: Vec<usize>,
    /// Where each tap read comes from.
    cols: Vec<Col>,
    /// The target's layer-0 input per token, for tap 0 when it was not extracted
    /// ([`FeatureSet::derive_tap0`]): the embedding table and the factor its rows are scaled by.
    embedding: Option<(Arc<Vec<f32>>, f32)>,
    shards: Vec<Shard>,
    seqs: Vec<SeqRef>,
}

fn bad(path: &Path, detail: impl Into<String>) -> TrainError {
    TrainError::Features {
        path: path.to_owned(),
        detail: detail.into(),
    }
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

fn usize_of(v: u64, path: &Path) -> Result<usize> {
    usize::try_from(v).map_err(|_| bad(path, format!("size {v} does not fit this machine")))
}

impl FeatureSet {
    /// Opens `dir`, checking its manifest and every shard (sha256, header, sizes).
    ///
    /// # Errors
    /// A missing or malformed manifest, a shard whose bytes are not the manifest's, or whose
    /// header disagrees with the manifest or with its own size.
    pub fn open(dir: &Path) -> Result<Self> {
        let mpath = dir.join("manifest.json");
        let text = std::fs::read(&mpath).map_err(|e| TrainError::Io {
            path: mpath.clone(),
            source: e,
        })?;
        let manifest: Manifest = serde_json::from_slice(&text)
            .map_err(|e| bad(&mpath, format!("not a features manifest: {e}")))?;
        if manifest.format != "specula-features" {
            return Err(bad(
                &mpath,
                format!("format `{}`, not specula-features", manifest.format),
            ));
        }
        if manifest.shards.is_empty() {
            return Err(bad(&mpath, "no shards yet (run `specula extract` first)"));
        }
        let width = manifest.taps.len() * manifest.target.n_embd;
        let mut shards = Vec::with_capacity(manifest.shards.len());
        let mut seqs = Vec::new();
        for entry in &manifest.shards {
            let path = dir.join(&entry.file);
            let io = |e| TrainError::Io {
                path: path.clone(),
                source: e,
            };
            let mut f = File::open(&path).map_err(io)?;
            let mut h = Sha256::new();
            std::io::copy(&mut f, &mut h).map_err(io)?;
            let got: String = h.finalize().iter().map(|b| format!("{b:02x}")).collect();
            if got != entry.sha256 {
                return Err(bad(
                    &path,
                    "its sha256 is not the manifest's (a damaged or replaced shard)",
                ));
            }
            let len = f.metadata().map_err(io)?.len();
            f.seek(SeekFrom::Start(0)).map_err(io)?;
            let mut head = [0u8; 32];
            f.read_exact(&mut head)
                .map_err(|_| bad(&path, "shorter than a shard header"))?;
            if &head[..8] != MAGIC || u32_at(&head, 8) != 1 {
                return Err(bad(&path, "not a version-1 SPECFEAT shard"));
            }
            let n = u32_at(&head, 12) as usize;
            let tokens = u64::from_le_bytes(head[16..24].try_into().unwrap_or([0; 8]));
            let w = u32_at(&head, 24) as usize;
            let k = u64::from(u32_at(&head, 28));
            if w != width {
                return Err(bad(
                    &path,
                    format!("rows of {w} values, the manifest's taps give {width}"),
                ));
            }
            let mut lens = vec![0u8; n * 4];
            f.read_exact(&mut lens)
                .map_err(|_| bad(&path, "truncated sequence lengths"))?;
            let ids_at = HEADER + 4 * n as u64;
            let feats_at = ids_at + 4 * tokens;
            let want = feats_at + tokens * (2 * w as u64 + 8 * k);
            if want != len {
                return Err(bad(
                    &path,
                    format!("{len} bytes, its header describes {want}"),
                ));
            }
            let mut off = 0u64;
            let mut these = Vec::with_capacity(n);
            for i in 0..n {
                let l = u32_at(&lens, 4 * i) as usize;
                these.push((off, l));
                off += l as u64;
            }
            if off != tokens {
                return Err(bad(
                    &path,
                    format!("sequence lengths sum to {off}, the header says {tokens}"),
                ));
            }
            let k_pairs = usize_of(k, &path)?;
            let shard = shards.len();
            seqs.extend((0..n).map(|index| SeqRef { shard, index }));
            shards.push(Shard {
                path,
                seqs: these,
                tokens,
                width: w,
                k: k_pairs,
                ids_at,
                feats_at,
            });
        }
        let taps = manifest.taps.clone();
        Ok(Self {
            cols: (0..taps.len()).map(Col::Stored).collect(),
            embedding: None,
            taps,
            manifest,
            width,
            shards,
            seqs,
        })
    }

    /// Lets [`FeatureSet::select_taps`] take tap 0 when the shards do not hold it: the input
    /// of the target's first layer is the token's embedding row times `scale` (the model's
    /// embedding scale, 1 for most), so it follows from the ids. Layer-0 input carries what
    /// no deeper tap carries plainly — which token stands at a position (SmolLM2-135M's tap 2
    /// already has an RMS 20× its embedding's) — and that is what a drafter matches its anchor
    /// against to find where the same token stood before. Rows are rounded to f16 as stored
    /// taps are.
    pub fn derive_tap0(&mut self, embd: Arc<Vec<f32>>, scale: f32) {
        self.embedding = Some((embd, scale));
    }

    /// Reads only `taps` (each one the manifest has, or tap 0 once
    /// [`FeatureSet::derive_tap0`] was called), side by side in this order.
    ///
    /// # Errors
    /// A tap the features do not hold, or none.
    pub fn select_taps(&mut self, taps: &[usize]) -> Result<()> {
        let mpath = PathBuf::from("manifest.json");
        if taps.is_empty() {
            return Err(bad(&mpath, "no taps asked for"));
        }
        let cols = taps
            .iter()
            .map(|t| {
                if let Some(c) = self.manifest.taps.iter().position(|m| m == t) {
                    return Ok(Col::Stored(c));
                }
                if *t == 0 && self.embedding.is_some() {
                    return Ok(Col::Embedding);
                }
                Err(bad(
                    &mpath,
                    format!(
                        "tap {t} was not extracted (the features hold {:?})",
                        self.manifest.taps
                    ),
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        self.width = cols.len() * self.manifest.target.n_embd;
        self.cols = cols;
        self.taps = taps.to_vec();
        Ok(())
    }

    /// Number of sequences.
    #[must_use]
    pub fn len(&self) -> usize {
        self.seqs.len()
    }

    /// Whether there is no sequence.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.seqs.is_empty()
    }

    /// Tokens of sequence `i`.
    #[must_use]
    pub fn seq_len(&self, i: usize) -> usize {
        let r = self.seqs[i];
        self.shards[r.shard].seqs[r.index].1
    }

    /// Total tokens.
    #[must_use]
    pub fn n_tokens(&self) -> u64 {
        self.shards.iter().map(|s| s.tokens).sum()
    }

    /// Token ids of sequence `i`.
    ///
    /// # Errors
    /// The shard could not be read.
    pub fn ids(&self, i: usize) -> Result<Vec<u32>> {
        let r = self.seqs[i];
        let s = &self.shards[r.shard];
        let (off, len) = s.seqs[r.index];
        let bytes = read_at(&s.path, s.ids_at + 4 * off, 4 * len)?;
        Ok(bytes.chunks_exact(4).map(|c| u32_at(c, 0)).collect())
    }

    /// Feature rows of sequence `i` (`len × width` values of the selected taps, f32 of the
    /// stored f16).
    ///
    /// # Errors
    /// The shard could not be read.
    pub fn features(&self, i: usize) -> Result<Vec<f32>> {
        let r = self.seqs[i];
        let s = &self.shards[r.shard];
        let (off, len) = s.seqs[r.index];
        let row = 2 * s.width as u64;
        let bytes = read_at(&s.path, s.feats_at + row * off, len * s.width * 2)?;
        let e = self.manifest.target.n_embd;
        let ids = if self.cols.contains(&Col::Embedding) {
            self.ids(i)?
        } else {
            Vec::new()
        };
        let mut out = Vec::with_capacity(len * self.width);
        for (j, r) in bytes.chunks_exact(2 * s.width).enumerate() {
            for &c in &self.cols {
                match c {
                    Col::Stored(c) => out.extend(
                        r[2 * c * e..2 * (c + 1) * e]
                            .chunks_exact(2)
                            .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()),
                    ),
                    Col::Embedding => {
                        let (embd, scale) = self.embedding.as_ref().ok_or_else(|| {
                            bad(&s.path, "tap 0 is derived, but no embedding was given")
                        })?;
                        let t = ids.get(j).copied().unwrap_or(0) as usize;
                        let row = embd.get(t * e..(t + 1) * e).ok_or_else(|| {
                            bad(
                                &s.path,
                                format!("token {t} is outside the target's embedding table"),
                            )
                        })?;
                        out.extend(row.iter().map(|&x| half::f16::from_f32(x * scale).to_f32()));
                    }
                }
            }
        }
        Ok(out)
    }

    /// Each feature column's root mean square over the rows of sequences `seqs` (at most
    /// [`SCALE_ROWS`] rows), floored at `1e-6` (a column that is always zero keeps scale 1).
    ///
    /// A drafter's `fc` sees the features divided by these: the residual streams of deep
    /// layers carry a few columns hundreds of times larger than the rest (SmolLM2-135M's tap
    /// 28: one column's RMS ≈ 1100 against a median of 15), and Adam moves every weight by
    /// about the learning rate whatever its input's size, so in raw coordinates those columns'
    /// weights swing the projection while the small columns' barely move it. Dividing a column
    /// by a constant is folded into `fc`'s columns at export, so the drafter's file and graph
    /// are unchanged.
    ///
    /// # Errors
    /// A shard could not be read.
    pub fn column_scales(&self, seqs: &[usize]) -> Result<Vec<f32>> {
        let w = self.width;
        let mut sum = vec![0f64; w];
        let mut rows = 0usize;
        for &i in seqs {
            if rows >= SCALE_ROWS {
                break;
            }
            let f = self.features(i)?;
            for row in f.chunks_exact(w).take(SCALE_ROWS - rows) {
                for (s, &x) in sum.iter_mut().zip(row) {
                    let x = if x.is_finite() { f64::from(x) } else { 0.0 };
                    *s += x * x;
                }
                rows += 1;
            }
        }
        #[allow(
            clippy::cast_precision_loss,
            clippy::cast_possible_truncation,
            reason = "row counts are far below 2^52; scales as f32"
        )]
        Ok(sum
            .into_iter()
            .map(|s| {
                let r = (s / rows.max(1) as f64).sqrt() as f32;
                if r > 1e-6 { r } else { 1.0 }
            })
            .collect())
    }

    /// Whether every shard holds the target's top logits.
    #[must_use]
    pub fn has_top_k(&self) -> bool {
        self.shards.iter().all(|s| s.k > 0)
    }

    /// The target's most likely next token after each token of sequence `i` (its top-1 of the
    /// stored top-k), or `None` when the shards hold no logits.
    ///
    /// # Errors
    /// The shard could not be read.
    pub fn target_top1(&self, i: usize) -> Result<Option<Vec<u32>>> {
        let r = self.seqs[i];
        let s = &self.shards[r.shard];
        if s.k == 0 {
            return Ok(None);
        }
        let (off, len) = s.seqs[r.index];
        let pair = 8 * s.k as u64;
        let at = s.feats_at + s.tokens * 2 * s.width as u64 + pair * off;
        let bytes = read_at(&s.path, at, len * 8 * s.k)?;
        Ok(Some(
            bytes.chunks_exact(8 * s.k).map(|c| u32_at(c, 0)).collect(),
        ))
    }

    /// Every token id of every sequence (for the draft vocabulary).
    ///
    /// # Errors
    /// A shard could not be read.
    pub fn all_ids(&self) -> Result<Vec<u32>> {
        let mut out = Vec::new();
        for s in &self.shards {
            let n = usize_of(s.tokens, &s.path)?;
            let bytes = read_at(&s.path, s.ids_at, 4 * n)?;
            out.extend(bytes.chunks_exact(4).map(|c| u32_at(c, 0)));
        }
        Ok(out)
    }
}

fn read_at(path: &Path, at: u64, n: usize) -> Result<Vec<u8>> {
    let io = |e| TrainError::Io {
        path: path.to_owned(),
        source: e,
    };
    let mut f = File::open(path).map_err(io)?;
    f.seek(SeekFrom::Start(at)).map_err(io)?;
    let mut buf = vec![0u8; n];
    f.read_exact(&mut buf).map_err(io)?;
    Ok(buf)
}

/// A features directory as `specula extract` writes it, for tests: one shard of `seqs`, their
/// feature rows (`tokens × taps.len() · n_embd`, stored as f16) and the target's top-1 per
/// token, and a manifest naming `target`'s file.
///
/// # Panics
/// When the files cannot be written.
#[cfg(test)]
#[allow(
    clippy::too_many_arguments,
    reason = "a test helper laid out as the shard is"
)]
pub(crate) fn write_test_features(
    dir: &Path,
    target: &Path,
    n_embd: usize,
    n_vocab: usize,
    taps: &[usize],
    seqs: &[Vec<u32>],
    rows: &[f32],
    top1: &[u32],
) {
    let u32_of = |v: usize| u32::try_from(v).expect("small");
    std::fs::create_dir_all(dir).expect("a features directory");
    let tokens: usize = seqs.iter().map(Vec::len).sum();
    let width = taps.len() * n_embd;
    assert_eq!((rows.len(), top1.len()), (tokens * width, tokens));
    let mut b = Vec::new();
    b.extend_from_slice(b"SPECFEAT");
    b.extend_from_slice(&1u32.to_le_bytes());
    b.extend_from_slice(&u32_of(seqs.len()).to_le_bytes());
    b.extend_from_slice(&(tokens as u64).to_le_bytes());
    b.extend_from_slice(&u32_of(width).to_le_bytes());
    b.extend_from_slice(&1u32.to_le_bytes());
    for s in seqs {
        b.extend_from_slice(&u32_of(s.len()).to_le_bytes());
    }
    for &t in seqs.iter().flatten() {
        b.extend_from_slice(&t.to_le_bytes());
    }
    for &x in rows {
        b.extend_from_slice(&half::f16::from_f32(x).to_le_bytes());
    }
    for &t in top1 {
        b.extend_from_slice(&t.to_le_bytes());
        b.extend_from_slice(&1.0f32.to_le_bytes());
    }
    let shard = dir.join("shard-00000.bin");
    std::fs::write(&shard, &b).expect("a shard");
    let manifest = serde_json::json!({
        "format": "specula-features",
        "target": {
            "sha256": crate::sha256_file(target).expect("hashed"),
            "n_embd": n_embd,
            "n_vocab": n_vocab,
        },
        "taps": taps,
        "held_out": [],
        "shards": [{
            "file": "shard-00000.bin",
            "sha256": crate::sha256_file(&shard).expect("hashed"),
        }],
    });
    std::fs::write(dir.join("manifest.json"), manifest.to_string()).expect("a manifest");
}
