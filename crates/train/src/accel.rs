//! Where a training run computes: burn's CPU backend (`flex`), or CUDA through burn's CubeCL
//! backend when the crate is built with the `cuda` feature and a GPU is there.
//!
//! The run's numbers are the same program on either; only the device (and so the floating
//! point order of burn's kernels) differs, so where a run computes is not one of its settings:
//! a checkpoint written on one continues on the other.

use std::fmt;

use burn::tensor::Device;

use crate::{Result, TrainError};

/// A training device.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Accel {
    /// burn's multi-threaded CPU backend.
    #[default]
    Cpu,
    /// The CUDA GPU of this index.
    Cuda(usize),
}

impl fmt::Display for Accel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Cpu => f.write_str("cpu"),
            Self::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

impl Accel {
    /// `cpu`, `cuda` (GPU 0) or `cuda:N`.
    ///
    /// # Errors
    /// Anything else.
    pub fn parse(s: &str) -> Result<Self> {
        let bad = || {
            TrainError::Config(format!(
                "training device `{s}`: expected cpu, cuda or cuda:N"
            ))
        };
        match s.to_ascii_lowercase().as_str() {
            "cpu" => Ok(Self::Cpu),
            "cuda" => Ok(Self::Cuda(0)),
            other => other
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(Self::Cuda)
                .ok_or_else(bad),
        }
    }

    /// Whether this build can train on CUDA.
    #[must_use]
    pub const fn cuda_built() -> bool {
        cfg!(feature = "cuda")
    }

    /// The device, with autodiff, after checking that it computes: a CUDA device is asked for
    /// one small sum first, so a missing driver or GPU is an error here rather than a panic
    /// inside burn at the first step.
    ///
    /// # Errors
    /// CUDA asked of a build without the `cuda` feature, or a CUDA device that does not run.
    pub fn device(self) -> Result<Device> {
        match self {
            Self::Cpu => Ok(Device::flex().autodiff()),
            Self::Cuda(i) => cuda(i).map(Device::autodiff),
        }
    }
}

#[cfg(feature = "cuda")]
fn cuda(i: usize) -> Result<Device> {
    use burn::tensor::{Tensor, TensorData};
    let probe = std::panic::catch_unwind(|| {
        let dev = Device::cuda(i);
        let t: Tensor<1> = Tensor::from_data(TensorData::new(vec![1f32, 2.0, 3.0], [3]), &dev);
        let s = t.sum().to_data().try_to_vec::<f32>().unwrap_or_default();
        (dev, s)
    });
    match probe {
        Ok((dev, s)) if s.first().copied() == Some(6.0) => Ok(dev),
        Ok((_, s)) => Err(TrainError::Config(format!(
            "CUDA device {i} computed 1 + 2 + 3 = {s:?}"
        ))),
        Err(e) => {
            let why = e
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| e.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                .unwrap_or_else(|| "it panicked".into());
            Err(TrainError::Config(format!(
                "CUDA device {i} is not usable (no driver or GPU?): {why}"
            )))
        }
    }
}

#[cfg(not(feature = "cuda"))]
fn cuda(_: usize) -> Result<Device> {
    Err(TrainError::Config(
        "this build trains on the CPU only: rebuild with the `cuda` feature \
         (`cargo build --release --features train,cuda`) to train on a GPU"
            .into(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_parse_and_print_back() {
        for (s, a) in [
            ("cpu", Accel::Cpu),
            ("CUDA", Accel::Cuda(0)),
            ("cuda:3", Accel::Cuda(3)),
        ] {
            assert_eq!(Accel::parse(s).expect("parses"), a);
            assert_eq!(Accel::parse(&a.to_string()).expect("round trip"), a);
        }
        for s in ["gpu", "cuda:", "cuda:-1", ""] {
            assert!(Accel::parse(s).is_err(), "{s}");
        }
        assert!(Accel::Cpu.device().is_ok());
    }

    /// Without the feature, CUDA is refused with what to do; with it but no GPU (CI), it is
    /// refused as unusable — an error either way, never a panic.
    #[test]
    fn cuda_without_a_gpu_or_the_feature_is_an_error() {
        if Accel::cuda_built() && std::env::var_os("SPECULA_TEST_CUDA").is_some() {
            return;
        }
        let e = Accel::Cuda(0).device().expect_err("no GPU here");
        let msg = e.to_string();
        assert!(
            msg.contains("`cuda` feature") || msg.contains("not usable"),
            "{msg}"
        );
    }
}
