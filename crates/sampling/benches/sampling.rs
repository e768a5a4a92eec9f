//! Time per sampled token from a 152k-entry logits row (Qwen2.5's vocabulary size), single
//! thread: llama.cpp's default chain, greedy, the default chain with a full penalty window,
//! no truncation at all (softmax over the whole vocabulary), top-p alone (the adaptive partial
//! sort), and the default chain with 5 top logprobs.
//!
//! `cargo bench -p specula-sampling --bench sampling` (add a filter such as `greedy` to narrow it).

use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use specula_sampling::{Rng, Sampler, SamplerParams};

/// Qwen2.5 / Qwen3 vocabulary size.
const VOCAB: usize = 151_936;

/// Roughly Gaussian logits (sum of four uniforms, σ ≈ 2.3) with a handful of peaks, the shape of
/// a real next-token row: a few plausible tokens well above a broad floor.
fn logits(seed: u64) -> Vec<f32> {
    let mut rng = Rng::seed_from_u64(seed);
    let mut uniform = || {
        #[allow(
            clippy::cast_possible_truncation,
            reason = "benchmark data; f32 precision is plenty"
        )]
        let u = rng.next_f64() as f32;
        u
    };
    let mut v: Vec<f32> = (0..VOCAB)
        .map(|_| (uniform() + uniform() + uniform() + uniform() - 2.0) * 8.0)
        .collect();
    for i in 0..8 {
        v[(i * 7919 + 13) % VOCAB] = 14.0 - 0.5 * f32::from(u8::try_from(i).unwrap_or(0));
    }
    v
}

fn bench(c: &mut Criterion) {
    let row = logits(1);
    let d = SamplerParams {
        seed: 7,
        ..SamplerParams::default()
    };
    let cases: [(&str, SamplerParams); 5] = [
        ("default", d),
        ("greedy", SamplerParams::greedy()),
        (
            "default+penalties",
            SamplerParams {
                repeat_penalty: 1.1,
                frequency_penalty: 0.1,
                presence_penalty: 0.1,
                ..d
            },
        ),
        (
            "no-truncation",
            SamplerParams {
                seed: 7,
                ..SamplerParams::unmodified()
            },
        ),
        (
            "top_p-only",
            SamplerParams {
                top_k: 0,
                min_p: 0.0,
                ..d
            },
        ),
    ];
    let mut group = c.benchmark_group("sample");
    for (name, params) in cases {
        let mut s = Sampler::new(params, VOCAB).expect("valid params");
        for t in 0..64u32 {
            s.accept(t * 101).expect("in vocabulary");
        }
        group.bench_function(name, |b| b.iter(|| s.sample(black_box(&row))));
    }
    let mut s = Sampler::new(d, VOCAB).expect("valid params");
    group.bench_function("default+logprobs5", |b| {
        b.iter(|| s.sample_with_logprobs(black_box(&row), 5))
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
