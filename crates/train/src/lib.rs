//! Drafter training on the target's own hidden states.

pub mod accel;
pub mod checkpoint;
pub mod circuit;
pub mod dflash;
pub mod eagle3;
pub mod export;
pub mod features;
pub mod net;
pub mod optim;
pub mod plot;
pub mod rng;
pub mod target;
pub mod vocab;

use std::path::{Path, PathBuf};

/// What can go wrong while training.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The features directory is not what `specula extract` writes.
    #[error("{path}: {detail}")]
    Features {
        /// The file at fault.
        path: PathBuf,
        /// What is wrong.
        detail: String,
    },
    /// The target cannot lend what a drafter borrows.
    #[error("target: {0}")]
    Target(String),
    /// A configuration, checkpoint or request that cannot be honoured.
    #[error("{0}")]
    Config(String),
}

/// Result of this crate.
pub type Result<T> = std::result::Result<T, TrainError>;

/// Lower-case hex sha256 of a file.
///
/// # Errors
/// The file could not be read.
pub fn sha256_file(path: &Path) -> Result<String> {
    use sha2::{Digest, Sha256};
    let io = |e| TrainError::Io {
        path: path.to_owned(),
        source: e,
    };
    let mut f = std::fs::File::open(path).map_err(io)?;
    let mut h = Sha256::new();
    std::io::copy(&mut f, &mut h).map_err(io)?;
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}
