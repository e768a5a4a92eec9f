//! Checkpoints: everything a run needs to continue as if it had not stopped.
//!
//! One format for every drafter: [`RunCheckpoint`] is generic over the run's configuration
//! and shape (DFlash's [`Checkpoint`], EAGLE-3's [`crate::eagle3::Eagle3Checkpoint`]); reading one
//! kind as another fails on the header's fields.
//!
//! Layout: `SPECTRN1`, u64 length of a JSON header (configuration, shape, target sha256, draft
//! vocabulary, step, the step and validation logs, each parameter's length), the header, then
//! every parameter, every first moment and every second moment as little-endian f32. Written to
//! a temporary name and renamed, so a run killed while saving leaves the previous checkpoint.

use std::io::Write as _;
use std::path::Path;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::dflash::{DflashConfig, StepLog, ValLog};
use crate::net::DraftShape;
use crate::optim::Moments;
use crate::{Result, TrainError};

/// The checkpoint's file name inside a run's directory.
pub const FILE: &str = "checkpoint.bin";
const MAGIC: &[u8; 8] = b"SPECTRN1";

/// A saved DFlash run.
pub type Checkpoint = RunCheckpoint<DflashConfig, DraftShape>;

/// A saved run of configuration `C` and drafter shape `S`.
#[derive(Clone, Debug, PartialEq)]
pub struct RunCheckpoint<C, S> {
    /// The run's configuration.
    pub config: C,
    /// The drafter's shape.
    pub shape: S,
    /// sha256 of the target.
    pub target_sha256: String,
    /// The draft vocabulary (target ids).
    pub d2t: Vec<u32>,
    /// Steps done.
    pub step: usize,
    /// Parameters.
    pub params: Vec<Vec<f32>>,
    /// AdamW moments.
    pub moments: Vec<Moments>,
    /// Step logs.
    pub steps: Vec<StepLog>,
    /// Validations.
    pub vals: Vec<ValLog>,
    /// Per-column scales the features are divided by before the drafter's `fc` sees them
    /// (empty: none); see [`crate::features::FeatureSet::column_scales`].
    pub feat_scale: Vec<f32>,
}

#[derive(Serialize, Deserialize)]
struct Header<C, S> {
    config: C,
    shape: S,
    target_sha256: String,
    d2t: Vec<u32>,
    step: usize,
    steps: Vec<StepLog>,
    vals: Vec<ValLog>,
    #[serde(default)]
    feat_scale: Vec<f32>,
    lens: Vec<usize>,
}

fn io(path: &Path) -> impl Fn(std::io::Error) -> TrainError + '_ {
    move |e| TrainError::Io {
        path: path.to_owned(),
        source: e,
    }
}

fn bad(path: &Path, detail: impl Into<String>) -> TrainError {
    TrainError::Config(format!("{}: {}", path.display(), detail.into()))
}

/// Writes `c` to `path` atomically.
///
/// # Errors
/// The file could not be written.
pub fn write<C: Serialize + Clone, S: Serialize + Clone>(
    path: &Path,
    c: &RunCheckpoint<C, S>,
) -> Result<()> {
    let header = Header {
        config: c.config.clone(),
        shape: c.shape.clone(),
        target_sha256: c.target_sha256.clone(),
        d2t: c.d2t.clone(),
        step: c.step,
        steps: c.steps.clone(),
        vals: c.vals.clone(),
        feat_scale: c.feat_scale.clone(),
        lens: c.params.iter().map(Vec::len).collect(),
    };
    let json = serde_json::to_vec(&header).map_err(|e| bad(path, e.to_string()))?;
    let n: usize = c.params.iter().map(Vec::len).sum();
    let mut buf = Vec::with_capacity(16 + json.len() + 12 * n);
    buf.extend_from_slice(MAGIC);
    buf.extend_from_slice(&(json.len() as u64).to_le_bytes());
    buf.extend_from_slice(&json);
    let zero = Moments::default();
    for part in 0..3 {
        for (i, p) in c.params.iter().enumerate() {
            let m = c.moments.get(i).unwrap_or(&zero);
            let src: &[f32] = match part {
                0 => p,
                1 => &m.m,
                _ => &m.v,
            };
            if src.is_empty() {
                buf.extend(std::iter::repeat_n(0u8, 4 * p.len()));
            } else {
                buf.extend(src.iter().flat_map(|x| x.to_le_bytes()));
            }
        }
    }
    let tmp = path.with_extension("bin.tmp");
    let mut f = std::fs::File::create(&tmp).map_err(io(&tmp))?;
    f.write_all(&buf).map_err(io(&tmp))?;
    f.sync_all().map_err(io(&tmp))?;
    drop(f);
    std::fs::rename(&tmp, path).map_err(io(path))
}

impl<C: Serialize + DeserializeOwned, S: Serialize + DeserializeOwned> RunCheckpoint<C, S> {
    /// Reads a checkpoint.
    ///
    /// # Errors
    /// The file is missing, not a checkpoint, or truncated.
    pub fn read(path: &Path) -> Result<Self> {
        let b = std::fs::read(path).map_err(io(path))?;
        if b.len() < 16 || &b[..8] != MAGIC {
            return Err(bad(path, "not a specula training checkpoint"));
        }
        let hl = u64::from_le_bytes(b[8..16].try_into().unwrap_or([0; 8]));
        let hl = usize::try_from(hl).map_err(|_| bad(path, "header too large"))?;
        let json = b
            .get(16..16usize.saturating_add(hl))
            .ok_or_else(|| bad(path, "truncated header"))?;
        let h: Header<C, S> =
            serde_json::from_slice(json).map_err(|e| bad(path, format!("header: {e}")))?;
        let n: usize = h.lens.iter().sum();
        let body = &b[16 + hl..];
        if body.len() != 12 * n {
            return Err(bad(
                path,
                format!(
                    "{} bytes of values, the header describes {}",
                    body.len(),
                    12 * n
                ),
            ));
        }
        let mut vals = body
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]));
        let mut take = || -> Vec<Vec<f32>> {
            h.lens
                .iter()
                .map(|&l| vals.by_ref().take(l).collect())
                .collect()
        };
        let params = take();
        let m = take();
        let v = take();
        Ok(Self {
            config: h.config,
            shape: h.shape,
            target_sha256: h.target_sha256,
            d2t: h.d2t,
            step: h.step,
            params,
            moments: m
                .into_iter()
                .zip(v)
                .map(|(m, v)| Moments { m, v })
                .collect(),
            steps: h.steps,
            vals: h.vals,
            feat_scale: h.feat_scale,
        })
    }

    /// Refuses to continue a run of another configuration, shape or target, naming the first
    /// field that differs.
    ///
    /// # Errors
    /// A field differs.
    pub fn check(&self, cfg: &C, shape: &S, target_sha256: &str) -> Result<()> {
        if self.target_sha256 != target_sha256 {
            return Err(TrainError::Config(format!(
                "the checkpoint is of target sha256 {}, this target is {target_sha256}",
                self.target_sha256
            )));
        }
        let diff = |a: serde_json::Value, b: serde_json::Value, what: &str| -> Result<()> {
            if let (Some(a), Some(b)) = (a.as_object(), b.as_object()) {
                for (k, va) in a {
                    // How often a run saves changes nothing it computes.
                    if k == "checkpoint_every" {
                        continue;
                    }
                    let vb = b.get(k).cloned().unwrap_or(serde_json::Value::Null);
                    if *va != vb {
                        return Err(TrainError::Config(format!(
                            "the checkpoint's {what} `{k}` is {va}, this run's is {vb}: \
                             resume with the same settings or choose another --out"
                        )));
                    }
                }
            }
            Ok(())
        };
        diff(json(&self.config), json(cfg), "setting")?;
        diff(json(&self.shape), json(shape), "shape")
    }
}

/// A value as JSON (for naming the field that differs).
fn json<T: Serialize>(v: &T) -> serde_json::Value {
    serde_json::to_value(v).unwrap_or(serde_json::Value::Null)
}
