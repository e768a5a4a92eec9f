//! The CubeCL backend (`specula-kernels`): the [`specula_tensor::Backend`] op set written once
//! as CubeCL kernels, generic over the runtime — CUDA in production (feature `cuda`), CubeCL's
//! CPU runtime in CI (feature `cpu`, the default).
//!
//! - [`layout`]: integer weight formats unpacked at upload into one group layout that every
//!   kernel reads (`scale · (code − offset) + min`, bit for bit ggml's dequantizer).
//! - [`kernels`]: the kernels — activation quantization and group-format matmuls, norms,
//!   RoPE, element-wise ops, gathers, cache writes, attention, a mixture's routing.
//! - [`CubeBackend`]: the `Backend` implementation over a CubeCL client; [`CubeRoutes`], a
//!   mixture's routing kept on the device.
//! - `conformance` (feature `conformance`, on by default): the suite every backend must pass
//!   against the CPU backend.

mod backend;
#[cfg(feature = "conformance")]
pub mod conformance;
pub mod kernels;
pub mod layout;

pub use backend::{CubeBackend, CubeIndex, CubeKv, CubeRoutes, CubeTensor, CubeWeight};
