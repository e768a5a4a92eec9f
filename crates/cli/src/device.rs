//! `--device cpu|cuda[:N]`: which backend a command runs on.
//!
//! `cpu` is the CPU backend (`specula-cpu`). `cuda[:N]` is the CubeCL backend
//! (`specula-kernels`) on CUDA device `N` (0 by default); it exists in builds with the `cuda`
//! feature, and asking for it elsewhere, or on a machine without a CUDA driver or device, is a
//! clear error before any work.

use std::path::Path;
use std::sync::Arc;

use anyhow::{Result, bail};

/// A device flag's value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Device {
    /// The CPU backend.
    Cpu,
    /// CUDA device `N`.
    Cuda(usize),
}

impl Device {
    /// Parses `cpu`, `cuda` or `cuda:N`.
    ///
    /// # Errors
    /// Any other value, and CUDA in a build without the `cuda` feature (before any work).
    pub fn parse(s: &str) -> Result<Self> {
        let d = match s {
            "cpu" => Self::Cpu,
            "cuda" => Self::Cuda(0),
            _ => match s.strip_prefix("cuda:").map(str::parse) {
                Some(Ok(n)) => Self::Cuda(n),
                _ => bail!("--device {s}: expected cpu, cuda or cuda:N"),
            },
        };
        #[cfg(not(feature = "cuda"))]
        if let Self::Cuda(i) = d {
            return Err(no_cuda(i));
        }
        Ok(d)
    }
}

/// The backend a drafter runs on, given its thread count (`-td`; the CPU's): the target's own
/// instance wherever it can be (always on a device; on the CPU when the thread counts agree),
/// so that a target and its drafters share one backend.
pub type BackendFor<'a, B> = &'a dyn Fn(usize) -> Result<Arc<B>>;

/// A command's work on an engine of whichever backend `--device` picks: written once, run on
/// the CPU backend or the CubeCL one ([`on_device`]).
pub trait OnDevice {
    /// What the command returns.
    type Out;

    /// Runs on `engine`; `backend` makes a drafter's backend on the same device.
    ///
    /// # Errors
    /// The command's.
    fn run<B>(
        self,
        engine: specula_engine::Engine<B>,
        backend: BackendFor<'_, B>,
    ) -> Result<Self::Out>
    where
        B: specula_tensor::Backend + Send + Sync + 'static,
        specula_engine::Engine<B>: Send + Sync;
}

/// Loads the model at `path` on `device` (the CPU backend with `threads`, 0 = every core) and
/// runs `work` on it.
///
/// # Errors
/// The load's, and `work`'s.
pub fn on_device<W: OnDevice>(
    device: Device,
    path: &Path,
    threads: usize,
    work: W,
) -> Result<W::Out> {
    match device {
        Device::Cpu => {
            let engine = crate::load::cpu_engine(path, threads)?;
            let shared = Arc::clone(&engine.backend);
            let n = crate::load::threads(threads);
            work.run(engine, &|t| {
                let t = crate::load::threads(t);
                Ok(if t == n {
                    Arc::clone(&shared)
                } else {
                    Arc::new(specula_cpu::CpuBackend::new(t))
                })
            })
        }
        Device::Cuda(i) => {
            let engine = cuda_engine(path, i)?;
            let shared = Arc::clone(&engine.backend);
            work.run(engine, &|_| Ok(Arc::clone(&shared)))
        }
    }
}

/// The CubeCL backend on CUDA device `index`.
///
/// # Errors
/// A build without the `cuda` feature, or no such device.
#[cfg(feature = "cuda")]
pub fn cuda_backend(index: usize) -> Result<specula_kernels::CubeBackend> {
    Ok(specula_kernels::CubeBackend::cuda(index)?)
}

/// The model at `path` on CUDA device `index`.
///
/// # Errors
/// As [`cuda_backend`], and the model's load errors.
#[cfg(feature = "cuda")]
pub fn cuda_engine(
    path: &Path,
    index: usize,
) -> Result<specula_engine::Engine<specula_kernels::CubeBackend>> {
    crate::load::engine_on(cuda_backend(index)?, path)
}

#[cfg(not(feature = "cuda"))]
fn no_cuda(index: usize) -> anyhow::Error {
    anyhow::anyhow!(
        "--device cuda:{index}: this specula was built without CUDA (cargo build --release -p specula-cli --features cuda)"
    )
}

/// Without the `cuda` feature: the error that says how to build with it.
///
/// # Errors
/// Always.
#[cfg(not(feature = "cuda"))]
pub fn cuda_engine(
    path: &Path,
    index: usize,
) -> Result<specula_engine::Engine<specula_cpu::CpuBackend>> {
    let _ = path;
    Err(no_cuda(index))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_flags_parse_and_bad_ones_are_named() {
        assert_eq!(Device::parse("cpu").unwrap(), Device::Cpu);
        // Without the `cuda` feature a CUDA device is refused at parse time (next test).
        if cfg!(feature = "cuda") {
            assert_eq!(Device::parse("cuda").unwrap(), Device::Cuda(0));
            assert_eq!(Device::parse("cuda:3").unwrap(), Device::Cuda(3));
        }
        for bad in ["gpu", "cuda:", "cuda:x", "CUDA"] {
            let e = Device::parse(bad).unwrap_err().to_string();
            assert!(e.contains(bad) && e.contains("cuda:N"), "{e}");
        }
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn cuda_without_the_feature_says_how_to_build_it() {
        let e = cuda_engine(Path::new("model.gguf"), 0)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("--features cuda"), "{e}");
        for (flag, n) in [("cuda", 0), ("cuda:3", 3)] {
            let e = Device::parse(flag).unwrap_err().to_string();
            assert!(
                e.contains(&format!("--device cuda:{n}")) && e.contains("--features cuda"),
                "{e}"
            );
        }
    }

    /// Whether the drafter backend for `threads` (and for one thread more) is the target's
    /// own instance.
    struct Shares {
        threads: usize,
    }

    impl OnDevice for Shares {
        type Out = (bool, bool);

        fn run<B>(
            self,
            engine: specula_engine::Engine<B>,
            backend: BackendFor<'_, B>,
        ) -> Result<(bool, bool)>
        where
            B: specula_tensor::Backend + Send + Sync + 'static,
            specula_engine::Engine<B>: Send + Sync,
        {
            Ok((
                Arc::ptr_eq(&engine.backend, &backend(self.threads)?),
                Arc::ptr_eq(&engine.backend, &backend(self.threads + 1)?),
            ))
        }
    }

    #[test]
    fn a_drafter_runs_on_the_target_s_backend_instance() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tiny.gguf");
        let g = specula_testkit::tiny::target("llama");
        std::fs::write(&path, g.to_bytes().unwrap()).unwrap();
        // Same thread count: one instance; another count (`-td`): a CPU backend of its own.
        let (same, other) = on_device(Device::Cpu, &path, 2, Shares { threads: 2 }).unwrap();
        assert!(same && !other);
    }
}
