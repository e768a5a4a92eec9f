//! Encoding throughput on CPython standard-library text for every cached model
//! (`cargo bench -p specula-tokenizer`). Models that are not fetched are skipped.

use std::hint::black_box;
use std::path::Path;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use specula_tokenizer::{EncodeOptions, Tokenizer};

const STDLIB: &str = "/root/.pyenv/versions/3.11.7/lib/python3.11";
const FILES: [&str; 4] = [
    "difflib.py",
    "argparse.py",
    "html/entities.py",
    "test/test_unicode.py",
];

fn corpus() -> Option<String> {
    let mut text = String::new();
    for f in FILES {
        text.push_str(&std::fs::read_to_string(Path::new(STDLIB).join(f)).ok()?);
    }
    Some(text)
}

fn encode(c: &mut Criterion) {
    let Some(text) = corpus() else {
        eprintln!("skipped: no CPython 3.11.7 standard library at {STDLIB}");
        return;
    };
    let mut group = c.benchmark_group("encode");
    group.throughput(Throughput::Bytes(text.len() as u64));
    group.sample_size(10);
    for name in ["smollm2-135m", "qwen2.5-coder-0.5b", "gemma3-270m"] {
        let Some(path) = specula_fetch::cached_model_path(name) else {
            eprintln!("skipped: {name} not fetched (cargo xtask fetch-models {name})");
            continue;
        };
        let tok = Tokenizer::open(&path).expect("tokenizer loads");
        group.bench_function(name, |b| {
            b.iter(|| tok.encode_with(black_box(&text), EncodeOptions::default()));
        });
    }
    group.finish();
}

criterion_group!(benches, encode);
criterion_main!(benches);
