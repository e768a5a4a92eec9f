//! `cargo xtask gpu`: the prepared script for a lent GPU machine.
//!
//! Such a machine has CUDA but no Rust toolchain and no network, so the bench is built here
//! with the `cuda` feature (CubeCL's CUDA runtime loads the driver at run time: no toolkit is
//! needed to build) and bundled: the `gpu_bench` example of `specula-kernels`, stripped and
//! xz-compressed, the shared libraries its static LLVM links that the machine may lack, and
//! `xtask/gpu/run.sh`. On the machine, `bash <bundle>/run.sh` runs the conformance suite on
//! CUDA, then the benches (peak bandwidth, GEMV per weight format, prefill matmul, attention
//! per cache format and depth, a synthetic Qwen3-8B-shaped model's pp512/tg128) and prints
//! one table. Without `--bundle-only` the bundle is run here too (a machine with both).

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::util::{cargo, rel, repo_root, run_cmd};

/// Options of `cargo xtask gpu`.
#[derive(Debug, clap::Args)]
pub struct GpuArgs {
    /// Where to write the bundle (default `target/gpu-bundle`).
    #[arg(long)]
    pub bundle: Option<PathBuf>,
    /// Only build the bundle (to carry it to a GPU machine); do not run it.
    #[arg(long)]
    pub bundle_only: bool,
}

/// Libraries of the bench's dynamic section that the GPU machine's image may not have.
const CARRY_LIBS: [&str; 5] = [
    "libz3.so",
    "libxml2.so",
    "libicu",
    "liblzma.so",
    "libzstd.so",
];

pub fn run(args: &GpuArgs) -> Result<()> {
    let dir = args
        .bundle
        .clone()
        .unwrap_or_else(|| repo_root().join("target/gpu-bundle"));
    let mut build = cargo([
        "build",
        "--release",
        "--locked",
        "-p",
        "specula-kernels",
        "--features",
        "cpu,cuda",
        "--example",
        "gpu_bench",
    ]);
    // cudarc's bindings: the CUDA 13.0 API, which the lent machines' driver (580) serves.
    if std::env::var_os("CUDARC_CUDA_VERSION").is_none() {
        build.env("CUDARC_CUDA_VERSION", "13000");
    }
    run_cmd(&mut build)?;
    let bin = repo_root().join("target/release/examples/gpu_bench");
    if dir.exists() {
        std::fs::remove_dir_all(&dir).with_context(|| format!("cannot clear {}", dir.display()))?;
    }
    std::fs::create_dir_all(dir.join("lib"))?;
    let out = dir.join("gpu_bench");
    run_cmd(Command::new("strip").arg("-o").arg(&out).arg(&bin))?;
    run_cmd(Command::new("xz").args(["-6", "-T0", "-f"]).arg(&out))?;
    for lib in needed_libs(&bin)? {
        let name = lib.file_name().context("a library path")?;
        std::fs::copy(&lib, dir.join("lib").join(name))
            .with_context(|| format!("cannot copy {}", lib.display()))?;
    }
    std::fs::copy(repo_root().join("xtask/gpu/run.sh"), dir.join("run.sh"))?;
    let size: u64 = std::fs::read_dir(&dir)?
        .chain(std::fs::read_dir(dir.join("lib"))?)
        .filter_map(|e| e.ok()?.metadata().ok())
        .filter(std::fs::Metadata::is_file)
        .map(|m| m.len())
        .sum();
    println!(
        "bundle: {} ({:.1} MiB)",
        rel(&dir).display(),
        size as f64 / 1048576.0
    );
    if args.bundle_only {
        return Ok(());
    }
    run_cmd(Command::new("bash").arg(dir.join("run.sh")))
}

/// The libraries `ldd` resolves for `bin` whose names match [`CARRY_LIBS`].
fn needed_libs(bin: &Path) -> Result<Vec<PathBuf>> {
    let out = Command::new("ldd")
        .arg(bin)
        .output()
        .context("cannot run ldd")?;
    if !out.status.success() {
        bail!("ldd {} failed", bin.display());
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            let (name, rest) = l.trim().split_once(" => ")?;
            let path = rest.split_whitespace().next()?;
            CARRY_LIBS
                .iter()
                .any(|c| name.starts_with(c))
                .then(|| PathBuf::from(path))
        })
        .collect())
}
