//! `matmul` throughput of the CPU backend on the shapes of a small model's FFN (Qwen2.5-0.5B's
//! FFN is 896 × 4864; 896 is not a whole number of 256-value K-quant blocks, so the hidden size
//! here is 1024): GEMV (one row, decode) reported as GB/s of weight bytes read, and
//! GEMM (64 rows, prefill) reported as GFLOP/s (`2 · rows · n_in · n_out` per call; criterion
//! prints it as elem/s), at 1 and 2 threads.
//!
//! `cargo bench -p specula-cpu --bench matmul` (add a filter such as `gemv/q4_k` to narrow it).

mod common;

use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;

use common::values;
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use specula_cpu::{CpuBackend, CpuWeight};
use specula_tensor::{Backend, QType, WeightDesc};

/// `(name, n_in, n_out)`: the FFN up/gate projection and the down projection.
const SHAPES: &[(&str, usize, usize)] = &[("1024x4864", 1024, 4864), ("4864x1024", 4864, 1024)];
const TYPES: &[QType] = &[QType::Q4_K, QType::Q8_0, QType::Q4_1];
const THREADS: &[usize] = &[1, 2];
const GEMM_ROWS: usize = 64;
/// Row counts of a speculative verify batch (a draft of 4 or 7 tokens and its anchor).
const SMALL_ROWS: &[usize] = &[5, 8];

fn weight(be: &CpuBackend, ty: QType, n_in: usize, n_out: usize) -> (CpuWeight, usize) {
    let rb = ty.row_bytes(n_in).expect("whole blocks");
    let x = values(n_in * n_out, 1);
    let mut bytes = vec![0u8; rb * n_out];
    for (x, q) in x.chunks_exact(n_in).zip(bytes.chunks_exact_mut(rb)) {
        specula_quant::quantize_row(ty, x, q).expect("valid row");
    }
    let len = bytes.len();
    let owner = Arc::new(bytes);
    let mut w = be
        .weight(WeightDesc {
            name: "w",
            ty,
            dims: &[n_in, n_out],
            data: &owner[..],
            owner: owner.clone(),
        })
        .expect("valid weight");
    // Packed for the matmul's kernels, as a model's matrices are at load.
    be.prepare_matmul(&mut w);
    (w, len)
}

fn bench(c: &mut Criterion) {
    for &threads in THREADS {
        let be = CpuBackend::new(threads);
        for &ty in TYPES {
            for &(shape, n_in, n_out) in SHAPES {
                let (w, bytes) = weight(&be, ty, n_in, n_out);
                let id = format!("{}/{shape}/t{threads}", ty.name());

                let mut g = c.benchmark_group("gemv");
                g.throughput(Throughput::BytesDecimal(
                    u64::try_from(bytes).expect("fits"),
                ));
                let x = be.from_host(1, n_in, &values(n_in, 2));
                let mut out = be.zeros(1, n_out);
                g.bench_function(BenchmarkId::from_parameter(&id), |b| {
                    b.iter(|| be.matmul(black_box(&x), &w, &mut out));
                });
                g.finish();

                for rows in SMALL_ROWS.iter().copied().chain([GEMM_ROWS]) {
                    let mut g = c.benchmark_group(format!("gemm{rows}"));
                    let flops = 2 * rows * n_in * n_out;
                    g.throughput(Throughput::Elements(u64::try_from(flops).expect("fits")));
                    let x = be.from_host(rows, n_in, &values(rows * n_in, 3));
                    let mut out = be.zeros(rows, n_out);
                    g.bench_function(BenchmarkId::from_parameter(&id), |b| {
                        b.iter(|| be.matmul(black_box(&x), &w, &mut out));
                    });
                    g.finish();
                }
            }
        }
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1));
    targets = bench
}
criterion_main!(benches);
