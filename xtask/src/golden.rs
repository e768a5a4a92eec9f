//! `cargo xtask golden`: regenerate `golden/` with the Python oracles of `reference/`.
//!
//! Each `reference/*.py` script is run with `--out golden --models-dir DIR` from a virtual
//! environment holding the pinned `reference/requirements.txt`. CI never runs this: the
//! outputs are committed, described in `golden/MANIFEST.md`, and read by the tests.

use std::fs;
use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context, Result, bail};
use specula_fetch::ModelCache;

use crate::GoldenArgs;
use crate::util::{rel, repo_root, run_cmd};

pub fn run(args: &GoldenArgs) -> Result<()> {
    let root = repo_root();
    let reference = root.join("reference");
    let venv = reference.join(".venv");
    let python = venv.join("bin").join("python");
    if !python.exists() {
        run_cmd(
            Command::new("python3")
                .args(["-m", "venv"])
                .arg(&venv)
                .current_dir(root),
        )
        .context("creating reference/.venv (is python3-venv installed?)")?;
    }
    run_cmd(
        Command::new(&python)
            .args(["-m", "pip", "install", "--quiet", "-r"])
            .arg(reference.join("requirements.txt"))
            .current_dir(root),
    )
    .context("installing reference/requirements.txt")?;

    let models_dir = match &args.models_dir {
        Some(dir) => dir.clone(),
        None => ModelCache::from_env()
            .context("locating the model cache (or pass --models-dir)")?
            .root()
            .to_path_buf(),
    };
    let mut scripts: Vec<PathBuf> = fs::read_dir(&reference)
        .context("listing reference/")?
        .map(|e| e.map(|e| e.path()))
        .collect::<Result<_, _>>()?;
    scripts.retain(|p| p.extension().is_some_and(|e| e == "py"));
    scripts.sort();
    if scripts.is_empty() {
        bail!("no reference/*.py script");
    }
    for script in &scripts {
        run_cmd(
            Command::new(&python)
                .arg(script)
                .args(["--out", "golden", "--models-dir"])
                .arg(&models_dir)
                .current_dir(root),
        )
        .with_context(|| format!("running {}", rel(script).display()))?;
    }
    println!(
        "regenerated golden/ with {} script(s); review `git diff golden/` and update \
         golden/MANIFEST.md (versions, date) before committing",
        scripts.len()
    );
    Ok(())
}
