//! The kernels, one module per op family. Each is written once against CubeCL and compiled
//! for the runtime the client belongs to (CUDA, or CubeCL's CPU runtime in CI); sizes that
//! shape the code (unit counts, tile rows, formats) are compile-time parameters, so one
//! source yields every specialisation.

pub mod attention;
pub mod elementwise;
pub mod kv;
pub mod matmul;
pub mod moe;
pub mod recurrent;
