//! Helpers shared by the test files: a seeded generator, weights made from random values, and
//! error measures.

#![allow(dead_code, reason = "each test file uses a different subset")]

use std::sync::Arc;

use specula_cpu::{CpuBackend, CpuIndex, CpuKv, CpuTensor, CpuWeight};
use specula_tensor::{AttentionParams, Backend, QType, WeightDesc};

/// xorshift64* — deterministic test inputs without a dependency.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in [−1, 1).
    pub fn uniform(&mut self) -> f32 {
        let top = u32::try_from(self.next_u64() >> 40).expect("24 bits");
        #[allow(clippy::cast_precision_loss, reason = "24-bit integer, exact")]
        let u = top as f32 / 16_777_216.0;
        2.0 * u - 1.0
    }

    /// `n` values uniform in [−scale, scale).
    pub fn values(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.uniform() * scale).collect()
    }

    pub fn below(&mut self, n: usize) -> usize {
        usize::try_from(self.next_u64() % u64::try_from(n).expect("fits")).expect("fits")
    }
}

/// The bytes of `values` (rows of `n_in`) in format `ty`.
pub fn encode(ty: QType, values: &[f32], n_in: usize) -> Vec<u8> {
    let rb = ty.row_bytes(n_in).expect("whole blocks");
    let mut bytes = vec![0u8; values.len() / n_in * rb];
    for (x, q) in values.chunks_exact(n_in).zip(bytes.chunks_exact_mut(rb)) {
        specula_quant::quantize_row(ty, x, q).expect("valid row");
    }
    bytes
}

/// The values of `bytes` (rows of `n_in` in format `ty`).
pub fn decode(ty: QType, bytes: &[u8], n_in: usize) -> Vec<f32> {
    let rb = ty.row_bytes(n_in).expect("whole blocks");
    let mut out = vec![0f32; bytes.len() / rb * n_in];
    for (q, x) in bytes.chunks_exact(rb).zip(out.chunks_exact_mut(n_in)) {
        specula_quant::dequantize_row(ty, q, x).expect("valid row");
    }
    out
}

/// A weight of format `ty` and shape `dims` holding `bytes`, borrowed from an `Arc<Vec<u8>>`.
pub fn weight_from_bytes(
    be: &CpuBackend,
    name: &str,
    ty: QType,
    dims: &[usize],
    bytes: Vec<u8>,
) -> CpuWeight {
    let owner = Arc::new(bytes);
    be.weight(WeightDesc {
        name,
        ty,
        dims,
        data: &owner[..],
        owner: owner.clone(),
    })
    .expect("valid weight")
}

/// A random `[n_out, n_in]` weight of format `ty`, with its bytes.
pub fn random_weight(
    be: &CpuBackend,
    rng: &mut Rng,
    ty: QType,
    n_in: usize,
    n_out: usize,
) -> (CpuWeight, Vec<u8>) {
    let bytes = encode(ty, &rng.values(n_in * n_out, 1.0), n_in);
    let w = weight_from_bytes(be, "w", ty, &[n_in, n_out], bytes.clone());
    (w, bytes)
}

/// An f32 vector weight.
pub fn vector(be: &CpuBackend, name: &str, v: &[f32]) -> CpuWeight {
    let bytes = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    weight_from_bytes(be, name, QType::F32, &[v.len()], bytes)
}

pub fn tensor(rows: usize, cols: usize, data: Vec<f32>) -> CpuTensor {
    CpuTensor::new(rows, cols, data)
}

/// Normalised mean squared error `Σ(a − b)² / Σb²` of `a` against the reference `b`.
pub fn nmse(a: &[f32], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len(), "lengths differ");
    let num: f64 = a
        .iter()
        .zip(b)
        .map(|(&a, &b)| (f64::from(a) - b).powi(2))
        .sum();
    let den: f64 = b.iter().map(|b| b * b).sum();
    if den == 0.0 { num } else { num / den }
}

/// The bits of every value.
pub fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// The thread counts every invariance test runs with.
pub const THREADS: [usize; 3] = [1, 2, 3];
/// The batch sizes every invariance test runs with.
pub const BATCHES: [usize; 4] = [1, 3, 8, 17];

/// Cells (or rows) as an index tensor of `be`.
pub fn ix(be: &CpuBackend, c: &[usize]) -> CpuIndex {
    let v: Vec<u32> = c.iter().map(|&i| u32::try_from(i).unwrap()).collect();
    be.index(&v)
}

/// `be.attention` of host-side parameters, their positions made index tensors of `be`.
pub fn attend(
    be: &CpuBackend,
    q: &CpuTensor,
    kv: &CpuKv,
    p: &AttentionParams<'_>,
    out: &mut CpuTensor,
) {
    let (qi, ki) = (be.index(p.q_pos), be.index(p.kv_pos));
    be.attention(q, kv, &p.with_positions(&qi, &ki), out);
}
