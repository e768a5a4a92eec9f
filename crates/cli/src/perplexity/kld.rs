//! The base-distribution file of `--kl-divergence-base` and the KL-divergence statistics.
//!
//! File layout (little-endian): the magic `SPKLD001`; `u32` n_ctx, n_vocab, n_chunk and the
//! first scored position; then per window its `n_ctx` token ids (`u32`) followed by one record
//! per scored token (positions `first .. n_ctx − 1`): `f32 lo`, `f32 step` and `n_vocab` `u16`
//! codes, the log-probability of token `t` being `lo + code[t] · step` (`lo` the row's smallest
//! log-probability, floored at −100; 65 536 levels, so the error is below 1e-3 nats for every
//! token and far smaller where the probability mass is). The file is written to a temporary
//! name beside the target and renamed into place when complete.

use std::fmt::Write as _;
use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use serde::Serialize;

const MAGIC: &[u8; 8] = b"SPKLD001";
const LO_FLOOR: f32 = -100.0;

/// The windows a run scores.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    /// Window size.
    pub n_ctx: usize,
    /// Vocabulary size.
    pub n_vocab: usize,
    /// Windows.
    pub n_chunk: usize,
    /// First scored position of a window.
    pub first: usize,
}

impl Geometry {
    fn rows_per_chunk(&self) -> usize {
        self.n_ctx - 1 - self.first
    }

    fn file_len(&self) -> u64 {
        let row = 8 + 2 * self.n_vocab;
        let chunk = 4 * self.n_ctx + self.rows_per_chunk() * row;
        (24 + self.n_chunk * chunk) as u64
    }
}

/// `out = log_softmax(logits)` (f32 max, f64 sum of `e^(l − max)`, as `log_prob`).
pub fn log_softmax(logits: &[f32], out: &mut Vec<f32>) {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&l| f64::from((l - max).exp())).sum();
    #[allow(
        clippy::cast_possible_truncation,
        reason = "log of a sum ≥ 1, back to f32"
    )]
    let lse = sum.ln() as f32;
    out.clear();
    out.extend(logits.iter().map(|&l| l - max - lse));
}

fn u32_of(x: usize, what: &str) -> Result<u32> {
    u32::try_from(x).with_context(|| format!("{what} {x} does not fit the KLD file format"))
}

/// Writes a base file.
pub struct Writer {
    out: BufWriter<File>,
    tmp: PathBuf,
    dst: PathBuf,
    codes: Vec<u8>,
    done: bool,
}

impl Writer {
    /// Starts `path` (as a temporary file beside it).
    pub fn create(path: &Path, g: Geometry) -> Result<Self> {
        let name = path
            .file_name()
            .with_context(|| format!("{}: not a file name", path.display()))?;
        let mut tmp_name = std::ffi::OsString::from(".");
        tmp_name.push(name);
        tmp_name.push(format!(".tmp{}", std::process::id()));
        let tmp = path.with_file_name(tmp_name);
        let f = File::create(&tmp).with_context(|| format!("cannot create {}", tmp.display()))?;
        let mut out = BufWriter::new(f);
        out.write_all(MAGIC)?;
        for (x, what) in [
            (g.n_ctx, "context"),
            (g.n_vocab, "vocabulary"),
            (g.n_chunk, "chunk count"),
            (g.first, "first position"),
        ] {
            out.write_all(&u32_of(x, what)?.to_le_bytes())?;
        }
        Ok(Self {
            out,
            tmp,
            dst: path.to_path_buf(),
            codes: Vec::new(),
            done: false,
        })
    }

    /// The token ids of the next window.
    pub fn window(&mut self, ids: &[u32]) -> Result<()> {
        for id in ids {
            self.out.write_all(&id.to_le_bytes())?;
        }
        Ok(())
    }

    /// The log-probabilities of the next scored token.
    pub fn row(&mut self, logp: &[f32]) -> Result<()> {
        let lo = logp.iter().copied().fold(0.0f32, f32::min).max(LO_FLOOR);
        let step = -lo / 65535.0;
        self.codes.clear();
        for &x in logp {
            let c = if step > 0.0 {
                ((x.max(lo) - lo) / step).round().min(65535.0)
            } else {
                0.0
            };
            #[allow(
                clippy::cast_possible_truncation,
                clippy::cast_sign_loss,
                reason = "c is rounded and clamped to 0..=65535"
            )]
            let c = c as u16;
            self.codes.extend_from_slice(&c.to_le_bytes());
        }
        self.out.write_all(&lo.to_le_bytes())?;
        self.out.write_all(&step.to_le_bytes())?;
        self.out.write_all(&self.codes)?;
        Ok(())
    }

    /// Flushes, syncs and renames the file into place.
    pub fn finish(mut self) -> Result<PathBuf> {
        self.out.flush()?;
        self.out.get_ref().sync_all()?;
        std::fs::rename(&self.tmp, &self.dst).with_context(|| {
            format!(
                "cannot rename {} to {}",
                self.tmp.display(),
                self.dst.display()
            )
        })?;
        self.done = true;
        Ok(self.dst.clone())
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        if !self.done {
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

/// Reads a base file written for the same windows.
pub struct Reader {
    inp: BufReader<File>,
    path: PathBuf,
    n_vocab: usize,
    bytes: Vec<u8>,
    logp: Vec<f32>,
}

impl Reader {
    /// Opens `path` and checks that it was saved for `g`.
    pub fn open(path: &Path, g: Geometry) -> Result<Self> {
        let f = File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
        let len = f.metadata()?.len();
        let mut inp = BufReader::new(f);
        let mut head = [0u8; 24];
        inp.read_exact(&mut head)
            .ok()
            .filter(|()| &head[..8] == MAGIC)
            .with_context(|| {
                format!(
                    "{}: not a specula KL-divergence base file (run with --kl-divergence-base alone to make one)",
                    path.display()
                )
            })?;
        let field = |i: usize| u32::from_le_bytes([head[i], head[i + 1], head[i + 2], head[i + 3]]);
        let saved = Geometry {
            n_ctx: field(8) as usize,
            n_vocab: field(12) as usize,
            n_chunk: field(16) as usize,
            first: field(20) as usize,
        };
        if saved != g {
            bail!(
                "{} was saved for {} windows of {} tokens and a {}-token vocabulary; this run has {} windows of {} and {} (use the same model family, -c and --chunks)",
                path.display(),
                saved.n_chunk,
                saved.n_ctx,
                saved.n_vocab,
                g.n_chunk,
                g.n_ctx,
                g.n_vocab
            );
        }
        if len != g.file_len() {
            bail!(
                "{}: {len} bytes, but its header needs {} (truncated or corrupt)",
                path.display(),
                g.file_len()
            );
        }
        Ok(Self {
            inp,
            path: path.to_path_buf(),
            n_vocab: g.n_vocab,
            bytes: vec![0; 8 + 2 * g.n_vocab],
            logp: vec![0.0; g.n_vocab],
        })
    }

    /// Reads the next window's ids and checks they are the ones this run scores.
    pub fn window(&mut self, ids: &[u32]) -> Result<()> {
        let mut b = vec![0u8; 4 * ids.len()];
        self.inp.read_exact(&mut b)?;
        let same = b
            .chunks_exact(4)
            .zip(ids)
            .all(|(c, &id)| u32::from_le_bytes([c[0], c[1], c[2], c[3]]) == id);
        if !same {
            bail!(
                "{}: the base was computed on other tokens (another text or tokenizer)",
                self.path.display()
            );
        }
        Ok(())
    }

    /// The next scored token's base log-probabilities.
    pub fn row(&mut self) -> Result<&[f32]> {
        self.inp.read_exact(&mut self.bytes)?;
        let b = &self.bytes;
        let lo = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        let step = f32::from_le_bytes([b[4], b[5], b[6], b[7]]);
        for (o, c) in self.logp.iter_mut().zip(b[8..].chunks_exact(2)) {
            *o = lo + f32::from(u16::from_le_bytes([c[0], c[1]])) * step;
        }
        Ok(&self.logp[..self.n_vocab])
    }
}

/// Per-token statistics against the base.
#[derive(Debug, Default)]
pub struct Comparison {
    kld: Vec<f64>,
    same_top: usize,
    base_nll: f64,
}

fn argmax(v: &[f32]) -> usize {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best
}

/// `KL(base ‖ ours) = Σ p_base · (log p_base − log p_ours)`, in f64.
#[must_use]
pub fn kl_divergence(base: &[f32], ours: &[f32]) -> f64 {
    base.iter()
        .zip(ours)
        .map(|(&b, &o)| {
            let p = f64::from(b).exp();
            p * (f64::from(b) - f64::from(o))
        })
        .sum()
}

impl Comparison {
    /// Adds one scored token (`tok` the true next token).
    pub fn add(&mut self, base: &[f32], ours: &[f32], tok: usize) {
        self.kld.push(kl_divergence(base, ours));
        self.same_top += usize::from(argmax(base) == argmax(ours));
        self.base_nll -= f64::from(base[tok]);
    }

    /// The statistics, with this run's perplexity `ppl`.
    #[must_use]
    #[allow(clippy::cast_precision_loss, reason = "token counts are small")]
    pub fn summary(mut self, ppl: f64) -> Summary {
        let n = self.kld.len().max(1);
        let nf = n as f64;
        self.kld.sort_by(f64::total_cmp);
        let at = |q: f64| -> f64 {
            if self.kld.is_empty() {
                return 0.0;
            }
            #[allow(
                clippy::cast_possible_truncation,
                clippy::cast_sign_loss,
                reason = "a rank between 1 and n"
            )]
            let rank = ((q * nf).ceil() as usize).clamp(1, n);
            self.kld[rank - 1]
        };
        let mean = self.kld.iter().sum::<f64>() / nf;
        let var = self.kld.iter().map(|k| (k - mean).powi(2)).sum::<f64>() / nf;
        let median = if self.kld.is_empty() {
            0.0
        } else if n % 2 == 1 {
            self.kld[n / 2]
        } else {
            f64::midpoint(self.kld[n / 2 - 1], self.kld[n / 2])
        };
        let top1 = self.same_top as f64 / nf;
        let ppl_base = (self.base_nll / nf).exp();
        Summary {
            kld_mean: mean,
            kld_mean_stderr: (var / (nf - 1.0).max(1.0)).sqrt(),
            kld_median: median,
            kld_p99: at(0.99),
            kld_max: self.kld.last().copied().unwrap_or(0.0),
            top1_agree: top1,
            top1_agree_stderr: (top1 * (1.0 - top1) / (nf - 1.0).max(1.0)).sqrt(),
            ppl_base,
            ppl_ratio: ppl / ppl_base,
        }
    }
}

/// What `--kl-divergence` reports (also the JSON fields).
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Summary {
    /// Mean KLD over the scored tokens.
    pub kld_mean: f64,
    /// Its standard error.
    pub kld_mean_stderr: f64,
    /// Median KLD.
    pub kld_median: f64,
    /// 99th percentile (nearest rank).
    pub kld_p99: f64,
    /// Largest KLD.
    pub kld_max: f64,
    /// Fraction of tokens whose most likely next token is the base's.
    pub top1_agree: f64,
    /// Its standard error.
    pub top1_agree_stderr: f64,
    /// Perplexity of the base distribution on the same tokens.
    pub ppl_base: f64,
    /// PPL(Q) / PPL(base).
    pub ppl_ratio: f64,
}

impl Summary {
    /// llama-perplexity's statistics block.
    #[must_use]
    pub fn render(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "\n====== Perplexity statistics ======");
        let _ = writeln!(s, "Mean PPL(base)                : {:10.6}", self.ppl_base);
        let _ = writeln!(s, "Mean PPL(Q)/PPL(base)         : {:10.6}", self.ppl_ratio);
        let _ = writeln!(s, "\n====== KL divergence statistics ======");
        let _ = writeln!(
            s,
            "Mean    KLD: {:10.6} ± {:10.6}",
            self.kld_mean, self.kld_mean_stderr
        );
        let _ = writeln!(s, "Maximum KLD: {:10.6}", self.kld_max);
        let _ = writeln!(s, "99.0%   KLD: {:10.6}", self.kld_p99);
        let _ = writeln!(s, "Median  KLD: {:10.6}", self.kld_median);
        let _ = writeln!(
            s,
            "Same top p: {:6.3} ± {:5.3} %",
            100.0 * self.top1_agree,
            100.0 * self.top1_agree_stderr
        );
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base_file_round_trip_and_statistics() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("base.kld");
        let g = Geometry {
            n_ctx: 6,
            n_vocab: 5,
            n_chunk: 2,
            first: 3,
        };
        let rows: Vec<Vec<f32>> = (0..4)
            .map(|i| {
                let l: Vec<f32> = (0..5u8).map(|t| f32::from(t * (i + 1)) * 0.3).collect();
                let mut o = Vec::new();
                log_softmax(&l, &mut o);
                o
            })
            .collect();
        let mut w = Writer::create(&path, g).unwrap();
        for c in 0..2 {
            w.window(&[1, 2, 3, 4, 5, 6]).unwrap();
            for r in &rows[2 * c..2 * c + 2] {
                w.row(r).unwrap();
            }
        }
        assert!(!path.exists(), "written under a temporary name first");
        w.finish().unwrap();
        let mut r = Reader::open(&path, g).unwrap();
        let mut cmp = Comparison::default();
        for c in 0..2 {
            r.window(&[1, 2, 3, 4, 5, 6]).unwrap();
            for want in &rows[2 * c..2 * c + 2] {
                let got = r.row().unwrap().to_vec();
                for (a, b) in got.iter().zip(want) {
                    assert!((a - b).abs() < 1e-3, "{a} vs {b}");
                }
                cmp.add(&got, want, 4);
            }
        }
        let s = cmp.summary(1.0);
        assert!(s.kld_mean.abs() < 1e-3, "{s:?}");
        assert!((s.top1_agree - 1.0).abs() < 1e-12);
        // Another geometry or other tokens are refused.
        assert!(Reader::open(&path, Geometry { n_chunk: 3, ..g }).is_err());
        let mut r = Reader::open(&path, g).unwrap();
        assert!(r.window(&[1, 2, 3, 4, 5, 7]).is_err());
        std::fs::write(&path, b"garbage").unwrap();
        assert!(Reader::open(&path, g).is_err());
    }

    #[test]
    fn kld_of_known_distributions() {
        let p = [0.5f32.ln(), 0.5f32.ln()];
        let q = [0.25f32.ln(), 0.75f32.ln()];
        let want = 0.5 * (0.5f64 / 0.25).ln() + 0.5 * (0.5f64 / 0.75).ln();
        assert!((kl_divergence(&p, &q) - want).abs() < 1e-6);
        assert!(kl_divergence(&p, &p).abs() < 1e-12);
        let mut c = Comparison::default();
        for k in [0.0, 1.0, 2.0, 3.0] {
            c.kld.push(k);
        }
        c.same_top = 3;
        let s = c.summary(2.0);
        assert!((s.kld_mean - 1.5).abs() < 1e-12);
        assert!((s.kld_median - 1.5).abs() < 1e-12);
        assert!((s.kld_p99 - 3.0).abs() < 1e-12);
        assert!((s.top1_agree - 0.75).abs() < 1e-12);
    }
}
