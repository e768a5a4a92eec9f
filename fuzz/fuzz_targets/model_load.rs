//! Fuzz target: whole-model loading. The first byte picks a tiny seed model — a llama, qwen2,
//! qwen3 or gemma3 target, or a DFlash, DFlash2 or EAGLE-3 drafter for a tiny qwen3 target
//! (`specula_testkit::tiny`) — and the KV cache format; every following 4 bytes are one
//! structured mutation of its metadata or tensors (`specula_testkit::mutate::Mutation`). The
//! mutated file is loaded and run for a prefill and a decode step (a drafter: its passes on
//! the target's features). It must be refused with an error or run with logits free of NaN
//! and +∞; a panic or a violation is a crash.
//!
//! Built and run on stable Rust by `cargo xtask fuzz --target model_load`.

#![no_main]

use libfuzzer_sys::fuzz_target;
use specula_testkit::mutate::{Mutation, Subject, check};

/// Mutations per input: enough to combine a few, few enough that each input runs in
/// milliseconds.
const MAX_MUTATIONS: usize = 8;

fuzz_target!(|data: &[u8]| {
    let Some((&first, rest)) = data.split_first() else {
        return;
    };
    let subject = Subject::ALL[usize::from(first) % Subject::ALL.len()];
    let cache = usize::from(first) / Subject::ALL.len();
    let muts: Vec<Mutation> = rest
        .chunks_exact(4)
        .take(MAX_MUTATIONS)
        .map(|c| Mutation::from_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    if let Err(violation) = check(subject, &muts, cache) {
        panic!("{subject:?} with {muts:?}, cache {cache}: {violation}");
    }
});
