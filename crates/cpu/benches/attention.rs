//! Attention over a deep cache on SmolLM2-135M's shape (9 query heads over 3 K/V heads of 64):
//! prefill (64 query rows at the end of the cache) and decode (one row), per cache format, at
//! 1 and 2 threads. Decode is reported as GB/s of K and V bytes read (`Throughput::Bytes`),
//! prefill as query rows per second.
//!
//! `cargo bench -p specula-cpu --bench attention` (a filter such as `decode/f16` narrows it;
//! `SPECULA_ATTN_DEPTH` sets the depth, default 16384).

mod common;

use std::hint::black_box;
use std::time::Duration;

use common::values;
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use specula_cpu::{CpuBackend, CpuKv};
use specula_tensor::{AttentionParams, Backend, KvShape, Mask, QType};

const N_KV_HEAD: usize = 3;
const N_HEAD: usize = 9;
const HD: usize = 64;
const PREFILL_ROWS: usize = 64;
const TYPES: &[QType] = &[QType::F16, QType::Q8_0, QType::Q4_0, QType::Turbo4];

fn depth() -> usize {
    std::env::var("SPECULA_ATTN_DEPTH")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(16_384)
}

fn cache(be: &CpuBackend, ty: QType, n: usize) -> CpuKv {
    let shape = KvShape {
        n_layer: 1,
        n_ctx: n,
        n_kv_head: N_KV_HEAD,
        head_dim_k: HD,
        head_dim_v: HD,
        k_type: ty,
        v_type: ty,
        overrides: Vec::new(),
        swa: None,
        recurrent: None,
        heads: Vec::new(),
    };
    let mut kv = be.kv_new(shape).expect("cache");
    let w = N_KV_HEAD * HD;
    let step = 1024;
    for c0 in (0..n).step_by(step) {
        let m = step.min(n - c0);
        let cells: Vec<usize> = (c0..c0 + m).collect();
        let k = be.from_host(m, w, &values(m * w, 1 + u64::try_from(c0).unwrap_or(0)));
        let v = be.from_host(m, w, &values(m * w, 2 + u64::try_from(c0).unwrap_or(0)));
        be.kv_write(&mut kv, 0, &cells, &k, &v);
    }
    kv
}

fn bench(c: &mut Criterion) {
    let d = depth();
    let kv_pos: Vec<u32> = (0..u32::try_from(d).expect("depth")).collect();
    for &ty in TYPES {
        for nth in [1, 2] {
            let be = CpuBackend::with_simd(nth, None);
            let kv = cache(&be, ty, d);
            // The cache holds exactly `d` cells: its K and V planes are what a step reads.
            let kv_bytes = kv.plane_bytes(0, false).len() + kv.plane_bytes(0, true).len();
            for (name, rows) in [("decode", 1), ("prefill", PREFILL_ROWS)] {
                let q_pos: Vec<u32> = (d - rows..d)
                    .map(|p| u32::try_from(p).expect("depth"))
                    .collect();
                let q = be.from_host(rows, N_HEAD * HD, &values(rows * N_HEAD * HD, 3));
                let p = AttentionParams {
                    layer: 0,
                    n_head: N_HEAD,
                    q_pos: &q_pos,
                    kv_pos: &kv_pos,
                    scale: 0.125,
                    mask: Mask::Causal,
                    softcap: None,
                };
                let mut out = be.zeros(0, 0);
                let mut g = c.benchmark_group(format!("{name}/{ty}/d{d}"));
                g.throughput(if rows == 1 {
                    Throughput::Bytes(u64::try_from(kv_bytes).unwrap_or(0))
                } else {
                    Throughput::Elements(u64::try_from(rows).unwrap_or(0))
                });
                g.measurement_time(Duration::from_secs(3));
                g.warm_up_time(Duration::from_millis(500));
                g.sample_size(10);
                g.bench_function(BenchmarkId::new("threads", nth), |b| {
                    b.iter(|| be.attention(black_box(&q), &kv, &p, &mut out));
                });
                g.finish();
            }
        }
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
