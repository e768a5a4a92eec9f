//! Dot-product throughput per weight format and SIMD level (GB/s of weight bytes read), single
//! thread: one 4096-value row (in L1), and a matrix-vector product of 256 such rows against one
//! activation row (0.3–4 MB of weights, in L2/L3), the shape of a decode-time matmul.
//!
//! `cargo bench -p specula-quant --bench dot` (add a filter such as `dot/q4_k` to narrow it).

use std::hint::black_box;
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use specula_quant::dot::{Kernels, SimdLevel};
use specula_quant::{QType, quantize_row};

/// Values per row: a typical hidden size, a multiple of every block size.
const N: usize = 4096;
/// Rows of the matrix-vector product.
const ROWS: usize = 256;

/// Every weight format with a dot product.
const TYPES: &[QType] = &[
    QType::Q4_0,
    QType::Q4_1,
    QType::Q5_0,
    QType::Q5_1,
    QType::Q8_0,
    QType::IQ4_NL,
    QType::MXFP4,
    QType::NVFP4,
    QType::Q2_K,
    QType::Q3_K,
    QType::Q4_K,
    QType::Q5_K,
    QType::Q6_K,
    QType::IQ4_XS,
    QType::F32,
    QType::F16,
    QType::BF16,
];

/// Smooth pseudo-random values in [−2, 2).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let top = u16::try_from(s >> 48).unwrap_or(0);
            (f32::from(top) / 65_536.0 - 0.5) * 4.0
        })
        .collect()
}

fn quantize(ty: QType, x: &[f32]) -> Vec<u8> {
    let row = ty
        .row_bytes(N)
        .expect("N is a multiple of every block size");
    let mut q = vec![0u8; x.len() / N * row];
    for (xr, qr) in x.chunks_exact(N).zip(q.chunks_exact_mut(row)) {
        quantize_row(ty, xr, qr).expect("valid row");
    }
    q
}

fn dot(c: &mut Criterion) {
    let w_f32 = values(N * ROWS, 0x9e37_79b9_7f4a_7c15);
    let a_f32 = values(N, 0x2545_f491_4f6c_dd1d);
    let levels = SimdLevel::supported();
    for &ty in TYPES {
        let row = ty.row_bytes(N).expect("whole blocks");
        let w = quantize(ty, &w_f32);
        let a = quantize(ty.vec_dot_type(), &a_f32);
        let mut group = c.benchmark_group(format!("dot/{ty}"));
        group.sample_size(20);
        group.warm_up_time(Duration::from_millis(150));
        group.measurement_time(Duration::from_millis(600));
        for &level in &levels {
            let k = Kernels::for_level(level).expect("supported");
            group.throughput(Throughput::BytesDecimal(row as u64));
            group.bench_function(BenchmarkId::new("row4096", level), |b| {
                b.iter(|| k.vec_dot(ty, N, black_box(&w[..row]), black_box(&a)));
            });
            group.throughput(Throughput::BytesDecimal((row * ROWS) as u64));
            group.bench_function(BenchmarkId::new("matvec256x4096", level), |b| {
                b.iter(|| {
                    for wr in w.chunks_exact(row) {
                        black_box(k.vec_dot(ty, N, black_box(wr), &a).expect("valid rows"));
                    }
                });
            });
        }
        group.finish();
    }
}

criterion_group!(benches, dot);
criterion_main!(benches);
