//! Dequantize throughput per format (GB/s of quantized bytes read), single thread, plus a
//! plain read of the same amount of f32 memory as the machine's bandwidth yardstick.
//!
//! `cargo bench -p specula-quant --bench dequant`

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use specula_quant::{QType, dequantize_row, quantize_row};

/// Values per row: a typical hidden size, a multiple of every block size.
const N: usize = 4096;
/// Rows per iteration: 16 MiB of f32 output, past the L2 cache, so memory traffic counts.
const ROWS: usize = 1024;

fn input() -> Vec<f32> {
    let mut s = 0x9e37_79b9_7f4a_7c15u64;
    (0..N * ROWS)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let top = u16::try_from(s >> 48).unwrap_or(0);
            (f32::from(top) / 65_536.0 - 0.5) * 4.0
        })
        .collect()
}

fn dequantize(c: &mut Criterion) {
    let x = input();
    let mut group = c.benchmark_group("dequantize");
    group.sample_size(20);
    group.measurement_time(std::time::Duration::from_secs(1));
    group.warm_up_time(std::time::Duration::from_millis(300));
    let mut out = vec![0f32; N];

    // Bandwidth yardstick: a vectorisable read of 512 MiB (far past the last-level cache): a
    // wrapping integer sum, since an f32 sum would be bound by the add latency, not by memory.
    let big = vec![1u32; 128 << 20];
    group.throughput(Throughput::Bytes((big.len() * 4) as u64));
    group.bench_function("dram_read_512mib", |b| {
        b.iter(|| black_box(big.iter().fold(0u32, |a, &v| a.wrapping_add(v))));
    });
    drop(big);

    for &ty in QType::ALL {
        if matches!(ty, QType::Q8_1 | QType::Q8_K) {
            continue; // activation formats, never dequantized in inference
        }
        let row = ty
            .row_bytes(N)
            .expect("N is a multiple of every block size");
        let mut q = vec![0u8; row * ROWS];
        for (xr, qr) in x.chunks_exact(N).zip(q.chunks_exact_mut(row)) {
            quantize_row(ty, xr, qr).expect("valid row");
        }
        group.throughput(Throughput::Bytes((row * ROWS) as u64));
        group.bench_function(ty.name(), |b| {
            b.iter(|| {
                for qr in q.chunks_exact(row) {
                    dequantize_row(ty, qr, &mut out).expect("valid row");
                    black_box(&out);
                }
            });
        });
    }
    group.finish();
}

criterion_group!(benches, dequantize);
criterion_main!(benches);
