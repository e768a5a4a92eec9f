//! Attention over a deep cache on SmolLM2-135M's shape (9 query heads over 3 K/V heads of 64):
//! prefill (64 query rows at the end of the cache) and decode (one row), per cache format, at
//! 1 and 2 threads. Decode is reported as GB/s of K and V bytes read (`Throughput::Bytes`),
//! prefill as query rows per second.
//!
//! `cargo bench -p specula-cpu --bench attention` (a filter such as `decode/f16` narrows it;
//! `SPECULA_ATTN_DEPTH` sets the depth, default 16384; `SPECULA_ATTN_HEADS=H/KVH/D` another
//! model's heads, e.g. `14/2/64` for Qwen2.5-Coder-0.5B or `4/1/256` for Gemma-3-270M;
//! `SPECULA_ATTN_TYPES=f16,q8_0` those cache types (any of them; default f16, q8_0, q4_0,
//! turbo4); `SPECULA_ATTN_LAYERS=30` a step
//! through that many layers' caches, which at depth no longer fit in the last-level cache).

mod common;

use std::hint::black_box;
use std::time::Duration;

use common::values;
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use specula_cpu::{CpuBackend, CpuIndex, CpuKv};
use specula_tensor::{AttentionParams, Backend, KvShape, Mask, QType};

/// Cells (or rows) as an index tensor of `be`.
fn ix(be: &CpuBackend, c: &[usize]) -> specula_cpu::CpuIndex {
    let v: Vec<u32> = c.iter().map(|&i| u32::try_from(i).unwrap()).collect();
    be.index(&v)
}

const PREFILL_ROWS: usize = 64;
/// The cache types measured by default.
const TYPES: &[QType] = &[QType::F16, QType::Q8_0, QType::Q4_0, QType::Turbo4];
/// Every cache type `SPECULA_ATTN_TYPES` may name.
const ALL_TYPES: &[QType] = &[
    QType::F16,
    QType::BF16,
    QType::Q8_0,
    QType::Q4_0,
    QType::Q4_1,
    QType::Q5_0,
    QType::Q5_1,
    QType::IQ4_NL,
    QType::Turbo2,
    QType::Turbo3,
    QType::Turbo4,
];

fn depth() -> usize {
    std::env::var("SPECULA_ATTN_DEPTH")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(16_384)
}

/// Query heads, K/V heads and head dim: SmolLM2-135M's unless `SPECULA_ATTN_HEADS` names others.
#[derive(Clone, Copy)]
struct Heads {
    n_head: usize,
    n_kv_head: usize,
    hd: usize,
}

fn heads() -> Heads {
    let smollm2 = Heads {
        n_head: 9,
        n_kv_head: 3,
        hd: 64,
    };
    let Ok(v) = std::env::var("SPECULA_ATTN_HEADS") else {
        return smollm2;
    };
    let n: Vec<usize> = v.split('/').filter_map(|x| x.parse().ok()).collect();
    match n[..] {
        [n_head, n_kv_head, hd] if n_kv_head > 0 && n_head.is_multiple_of(n_kv_head) && hd > 0 => {
            Heads {
                n_head,
                n_kv_head,
                hd,
            }
        }
        _ => panic!("SPECULA_ATTN_HEADS={v}: expected H/KVH/D with H a multiple of KVH"),
    }
}

/// Layers a step goes through (`SPECULA_ATTN_LAYERS`, default 1): with a model's count, the
/// caches of a step no longer fit in the last-level cache and decode reads them from memory,
/// as a real step at that depth does.
fn layers() -> usize {
    std::env::var("SPECULA_ATTN_LAYERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&n| n > 0)
        .unwrap_or(1)
}

fn cache(be: &CpuBackend, ty: QType, n: usize, h: Heads, n_layer: usize) -> CpuKv {
    let shape = KvShape {
        n_layer,
        n_ctx: n,
        n_kv_head: h.n_kv_head,
        head_dim_k: h.hd,
        head_dim_v: h.hd,
        k_type: ty,
        v_type: ty,
        overrides: Vec::new(),
        swa: None,
        recurrent: None,
        heads: Vec::new(),
        shared: Vec::new(),
    };
    let mut kv = be.kv_new(shape).expect("cache");
    let w = h.n_kv_head * h.hd;
    let step = 1024;
    for layer in 0..n_layer {
        for c0 in (0..n).step_by(step) {
            let m = step.min(n - c0);
            let cells: Vec<usize> = (c0..c0 + m).collect();
            let seed = u64::try_from(c0 + layer * n).unwrap_or(0);
            let k = be.from_host(m, w, &values(m * w, 1 + seed));
            let v = be.from_host(m, w, &values(m * w, 2 + seed));
            be.kv_write(&mut kv, layer, &ix(be, &cells), &k, &v);
        }
    }
    kv
}

fn bench(c: &mut Criterion) {
    let d = depth();
    let h = heads();
    let n_layer = layers();
    let kv_pos: Vec<u32> = (0..u32::try_from(d).expect("depth")).collect();
    // `SPECULA_ATTN_TYPES=f16,q8_0` builds only those caches (turbo's take a while to fill).
    let only = std::env::var("SPECULA_ATTN_TYPES").ok();
    let types: Vec<QType> = match only.as_deref() {
        None => TYPES.to_vec(),
        Some(o) => ALL_TYPES
            .iter()
            .copied()
            .filter(|ty| o.split(',').any(|t| t == ty.to_string()))
            .collect(),
    };
    for ty in types {
        for nth in [1, 2] {
            let be = CpuBackend::with_simd(nth, None);
            let kv = cache(&be, ty, d, h, n_layer);
            // The cache holds exactly `d` cells: its K and V planes are what a step reads.
            let kv_bytes: usize = (0..n_layer)
                .map(|l| kv.plane_bytes(l, false).len() + kv.plane_bytes(l, true).len())
                .sum();
            for (name, rows) in [("decode", 1), ("prefill", PREFILL_ROWS)] {
                let q_pos: Vec<u32> = (d - rows..d)
                    .map(|p| u32::try_from(p).expect("depth"))
                    .collect();
                let w = h.n_head * h.hd;
                let q = be.from_host(rows, w, &values(rows * w, 3));
                let (q_pos, kv_pos) = (be.index(&q_pos), be.index(&kv_pos));
                let params: Vec<AttentionParams<'_, CpuIndex>> = (0..n_layer)
                    .map(|layer| AttentionParams {
                        layer,
                        n_head: h.n_head,
                        q_pos: &q_pos,
                        kv_pos: &kv_pos,
                        scale: 0.125,
                        mask: Mask::Causal,
                        softcap: None,
                    })
                    .collect();
                let mut out = be.zeros(0, 0);
                let tag = if n_layer > 1 {
                    format!("/l{n_layer}")
                } else {
                    String::new()
                };
                let mut g = c.benchmark_group(format!("{name}/{ty}/d{d}{tag}"));
                g.throughput(if rows == 1 {
                    Throughput::Bytes(u64::try_from(kv_bytes).unwrap_or(0))
                } else {
                    Throughput::Elements(u64::try_from(rows).unwrap_or(0))
                });
                g.measurement_time(Duration::from_secs(3));
                g.warm_up_time(Duration::from_millis(500));
                g.sample_size(10);
                g.bench_function(BenchmarkId::new("threads", nth), |b| {
                    b.iter(|| {
                        for p in &params {
                            be.attention(black_box(&q), &kv, p, &mut out);
                        }
                    });
                });
                g.finish();
            }
        }
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
