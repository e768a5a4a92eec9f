//! Every model file is validated at load: tiny models of every architecture (llama, qwen2,
//! qwen3, gemma3) and the DFlash, DFlash2 and EAGLE-3 drafters for a tiny target
//! (`specula_testkit::tiny`), with metadata values and tensor shapes mutated
//! (`specula_testkit::mutate`: integers to 0/1/odd/huge/negative, floats to NaN/±∞/0/negative,
//! arrays shortened, keys dropped or retyped, dimensions swapped or changed, tensors dropped,
//! types changed), are loaded and run for a prefill and a decode step. The property: a clean
//! `Err`, or `Ok` with logits free of NaN and +∞ — never a panic.
//!
//! - `every_single_mutation_…` sweeps every single mutation of every key and tensor of every
//!   subject (deterministic, tens of thousands of cases; the value mutations with every KV
//!   cache format);
//! - `random_mutation_lists_…` is the proptest over lists of up to four mutations and the KV
//!   cache formats (`PROPTEST_CASES` sets its case count);
//! - the named tests pin the errors of the hyperparameters that used to panic or produce NaN.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;

use proptest::prelude::*;
use specula_cpu::CpuBackend;
use specula_gguf::{Gguf, Value};
use specula_models::{Model, ModelError};
use specula_testkit::mutate::{EXTRA_KEYS, FLOATS, INTS, Mutation, Outcome, Subject, TYPES, check};
use specula_testkit::tiny;

/// Runs one case, turning a panic or a violation into a message naming the case.
fn run_case(subject: Subject, muts: &[Mutation], cache: usize) -> Result<Outcome, String> {
    match catch_unwind(AssertUnwindSafe(|| check(subject, muts, cache))) {
        Ok(Ok(o)) => Ok(o),
        Ok(Err(v)) => Err(format!("{subject:?} {muts:?} cache {cache}: {v}")),
        Err(p) => {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                .unwrap_or_default();
            Err(format!(
                "{subject:?} {muts:?} cache {cache}: panicked: {msg}"
            ))
        }
    }
}

/// The seeds themselves run (with every cache format that stores their heads), so the
/// mutation tests start from working models and a refusal is the mutation's.
#[test]
fn every_seed_model_runs() {
    for subject in Subject::ALL {
        let o = run_case(subject, &[], 0).unwrap();
        assert!(matches!(o, Outcome::Ran), "{subject:?}: {o:?}");
        // Q8_0 and Q4_0 store heads of 32 values.
        for cache in 1..3 {
            let o = run_case(subject, &[], cache).unwrap();
            assert!(
                matches!(o, Outcome::Ran),
                "{subject:?} cache {cache}: {o:?}"
            );
        }
    }
}

/// Every single mutation of every subject: each integer and float value under every key (the
/// file's and the extra ones), each array cut, each key dropped or retyped, and every tensor's
/// dimensions swapped, set to each value, its rank changed, dropped, or given each type.
#[test]
fn every_single_mutation_is_a_clean_error_or_a_finite_run() {
    let mut failures = Vec::new();
    let (mut ran, mut refused, mut total) = (0, 0, 0);
    for subject in Subject::ALL {
        let g = subject.seed();
        let n_keys = g.metadata.len() + EXTRA_KEYS.len();
        let n_t = g.tensors.len();
        let mut muts = Vec::new();
        // Values run with every cache format as well: a value that only overflows a
        // quantized cache's block scale (a YaRN magnitude of 2^40 did) shows there alone.
        let mut valued = Vec::new();
        for key in 0..n_keys {
            valued.extend((0..INTS.len()).map(|v| Mutation::Int { key, v }));
            valued.extend((0..FLOATS.len()).map(|v| Mutation::Float { key, v }));
            muts.extend((0..2).map(|len| Mutation::Shorten { key, len }));
            muts.push(Mutation::Retype { key });
            muts.push(Mutation::Drop { key });
        }
        for tensor in 0..n_t {
            muts.push(Mutation::SwapDims { tensor });
            for dim in 0..3 {
                muts.extend((0..INTS.len()).map(|v| Mutation::SetDim { tensor, dim, v }));
            }
            muts.push(Mutation::Rank {
                tensor,
                remove: false,
            });
            muts.push(Mutation::Rank {
                tensor,
                remove: true,
            });
            muts.push(Mutation::DropTensor { tensor });
            muts.extend((0..TYPES.len()).map(|ty| Mutation::Type { tensor, ty }));
        }
        let cases = muts
            .into_iter()
            .map(|m| (m, 0))
            .chain(valued.into_iter().flat_map(|m| (0..4).map(move |c| (m, c))));
        for (m, cache) in cases {
            total += 1;
            match run_case(subject, &[m], cache) {
                Ok(Outcome::Ran) => ran += 1,
                Ok(_) => refused += 1,
                Err(e) => failures.push(e),
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {total} cases broke the property:\n{}",
        failures.len(),
        failures.join("\n")
    );
    // Both outcomes occur: mutations that keep the model valid run, the others are refused.
    assert!(ran > 100 && refused > 100, "{ran} ran, {refused} refused");
}

fn mutation() -> impl Strategy<Value = Mutation> {
    any::<[u8; 4]>().prop_map(Mutation::from_bytes)
}

proptest! {
    // The default config reads PROPTEST_CASES; without it, 256 cases (well under a second
    // each at the test profile's opt-level).
    #![proptest_config(ProptestConfig {
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn random_mutation_lists_are_clean_errors_or_finite_runs(
        s in 0..Subject::ALL.len(),
        muts in prop::collection::vec(mutation(), 1..5),
        cache in 0..4usize,
    ) {
        if let Err(e) = run_case(Subject::ALL[s], &muts, cache) {
            prop_assert!(false, "{}", e);
        }
    }
}

fn load(g: &tiny::TinyGguf) -> Result<Model<CpuBackend>, ModelError> {
    let be = CpuBackend::new(1);
    Model::load(
        &be,
        Arc::new(Gguf::from_bytes(g.to_bytes().unwrap()).unwrap()),
    )
}

/// An edit of a tiny model's file.
type Edit = dyn Fn(&mut tiny::TinyGguf);

fn error_of(arch: &str, edit: impl FnOnce(&mut tiny::TinyGguf)) -> String {
    let mut g = tiny::target(arch);
    edit(&mut g);
    load(&g).err().map(|e| e.to_string()).unwrap_or_default()
}

/// The hyperparameters that reached a backend assertion or produced NaN logits before they
/// were checked at load, each refused naming the key, its value and the bound.
#[test]
fn invalid_hyperparameters_name_the_key_and_the_bound() {
    let cases: Vec<(&str, Box<Edit>, &str)> = vec![
        (
            "llama",
            Box::new(|g| g.set("llama.rope.dimension_count", Value::U32(7))),
            "metadata key `llama.rope.dimension_count` = 7: expected an even number in 2..=32",
        ),
        (
            "qwen2",
            Box::new(|g| g.set("qwen2.rope.dimension_count", Value::U32(34))),
            "`qwen2.rope.dimension_count` = 34: expected an even number in 2..=32",
        ),
        (
            "qwen3",
            Box::new(|g| g.set("qwen3.attention.key_length", Value::U32(0))),
            "`qwen3.attention.key_length` = 0: expected at least 1",
        ),
        (
            "llama",
            Box::new(|g| g.set("llama.attention.head_count_kv", Value::U32(0))),
            "`llama.attention.head_count_kv` = 0: expected a divisor of the 2 query heads",
        ),
        (
            "gemma3",
            Box::new(|g| {
                g.set(
                    "gemma3.attention.layer_norm_rms_epsilon",
                    Value::F32(f32::NAN),
                )
            }),
            "`gemma3.attention.layer_norm_rms_epsilon` = NaN: expected a finite number > 0",
        ),
        (
            "gemma3",
            Box::new(|g| g.set("gemma3.rope.freq_base_swa", Value::F32(0.0))),
            "`gemma3.rope.freq_base_swa` = 0",
        ),
        (
            "llama",
            Box::new(|g| g.set("llama.rope.freq_base", Value::F32(1e-45))),
            "`llama.rope.freq_base`",
        ),
        (
            "llama",
            Box::new(|g| g.set("llama.rope.scaling.factor", Value::F32(1e-45))),
            "`llama.rope.scaling.factor`",
        ),
        (
            "qwen3",
            Box::new(|g| g.set("qwen3.block_count", Value::U32(1))),
            "tensor `blk.1.attn_norm.weight` belongs to layer 1, but `qwen3.block_count` = 1",
        ),
        (
            "qwen3",
            Box::new(|g| g.set("qwen3.block_count", Value::U64(1 << 40))),
            "`qwen3.block_count` = 1099511627776: expected at most the 25 tensors of the file",
        ),
        (
            "laguna",
            Box::new(|g| {
                g.set(
                    "laguna.rope.scaling.yarn_attn_factor",
                    Value::F32(1_099_511_627_776.0),
                );
            }),
            "`laguna.rope.scaling.yarn_attn_factor` = 1099511600000.0: expected a finite number in (0, 255]",
        ),
        (
            "llama",
            Box::new(|g| g.set("llama.embedding_length", Value::I32(-1))),
            "metadata key `llama.embedding_length` = -1: expected an unsigned integer",
        ),
        (
            "llama",
            Box::new(|g| g.set("llama.attention.key_length", Value::String("x".into()))),
            "metadata key `llama.attention.key_length` holds String, expected an unsigned integer",
        ),
        (
            "qwen2",
            Box::new(|g| {
                let tokens: Vec<String> = (0..40).map(|i| format!("t{i}")).collect();
                g.set(
                    "tokenizer.ggml.tokens",
                    Value::Array(specula_gguf::Array::String(tokens)),
                );
            }),
            "metadata key `tokenizer.ggml.tokens` = 40: expected at most the 32 rows",
        ),
    ];
    for (arch, edit, needle) in cases {
        let e = error_of(arch, edit);
        assert!(e.contains(needle), "{arch}: expected `{needle}` in `{e}`");
    }
}

/// A drafter's hyperparameters are checked against the target at load: a MASK token past the
/// target's vocabulary, taps past its layers, an odd rotary size.
#[test]
fn invalid_drafter_hyperparameters_name_the_key() {
    let be = CpuBackend::new(1);
    let target = load(&tiny::target("qwen3")).unwrap();
    let dflash = |edit: &dyn Fn(&mut tiny::TinyGguf)| {
        let mut g = tiny::dflash(false);
        edit(&mut g);
        let file = Arc::new(Gguf::from_bytes(g.to_bytes().unwrap()).unwrap());
        specula_models::dflash::Dflash::load(&be, file, &target)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default()
    };
    let e = dflash(&|g| g.set("tokenizer.ggml.mask_token_id", Value::U32(32)));
    assert!(
        e.contains(
            "`tokenizer.ggml.mask_token_id` = 32: expected a token of the target's vocabulary of 32"
        ),
        "{e}"
    );
    // A factor that overflowed the block's activations to NaN before it was bounded.
    let e = dflash(&|g| g.set("dflash.embedding_scale", Value::F32(3e38)));
    assert!(
        e.contains(
            "`dflash.embedding_scale` = 3e38: expected a finite factor of magnitude at most 65504"
        ),
        "{e}"
    );
    let e = dflash(&|g| g.set("dflash.rope.dimension_count", Value::U32(3)));
    assert!(e.contains("`dflash.rope.dimension_count` = 3"), "{e}");
    let e = dflash(&|g| {
        g.set(
            "dflash.target_layers",
            Value::Array(specula_gguf::Array::U32(vec![1, 3])),
        );
    });
    assert!(e.contains("dflash.target_layers"), "{e}");
    let mut g = tiny::eagle3();
    g.set("eagle3.attention.head_count", Value::U32(0));
    let file = Arc::new(Gguf::from_bytes(g.to_bytes().unwrap()).unwrap());
    let e = specula_models::eagle3::Eagle3::load(&be, file, &target)
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(
        e.contains("`eagle3.attention.head_count` = 0: expected at least 1"),
        "{e}"
    );
}

/// Variants specula does not run are refused by name, not half-run: a multimodal projector file,
/// vision-tower tensors in a text model, a Laguna attention gate of neither width llama.cpp
/// knows, an unknown expert gating function, Gemma 4 per-layer inputs without their tensors or
/// KV sharing with no earlier layer of the kind to share with. A Qwen3.5 file with a
/// multi-token-prediction block after its trunk (as Qwen3.6 ships) loads and runs the trunk:
/// the same logits as the file without the block.
#[test]
fn unsupported_variants_are_refused_by_name() {
    let cases: Vec<(&str, Box<Edit>, &str)> = vec![
        (
            "llama",
            Box::new(|g| g.set("general.architecture", Value::String("clip".into()))),
            "`clip` is a multimodal projector (mmproj) file",
        ),
        (
            "llama",
            Box::new(|g| g.tensor("v.blk.0.attn_q.weight", &[64, 64], false)),
            "tensor `v.blk.0.attn_q.weight` belongs to a vision tower",
        ),
        (
            "laguna",
            Box::new(|g| {
                g.tensor_mut("blk.1.attn_gate.weight").unwrap().dims = vec![64, 3];
            }),
            "tensor `blk.1.attn_gate.weight` has shape [64, 3], expected [64, 4]",
        ),
        (
            "laguna",
            Box::new(|g| g.set("laguna.expert_gating_func", Value::U32(3))),
            "`laguna.expert_gating_func` = 3: expected 1 (softmax) or 2 (sigmoid)",
        ),
        (
            "gemma4",
            Box::new(|g| g.set("gemma4.embedding_length_per_layer_input", Value::U32(8))),
            "per_layer_token_embd.weight",
        ),
        (
            // Layer 1 (global) would share K/V, but no global layer comes before it.
            "gemma4",
            Box::new(|g| g.set("gemma4.attention.shared_kv_layers", Value::U32(1))),
            "`gemma4.attention.shared_kv_layers` = 1: expected a count that leaves a global layer before layer 1 to share K/V with",
        ),
        (
            "gemma4",
            Box::new(|g| g.set("gemma4.attention.shared_kv_layers", Value::U32(2))),
            "`gemma4.attention.shared_kv_layers` = 2: expected fewer than the 2 layers",
        ),
    ];
    for (arch, edit, needle) in cases {
        let e = error_of(arch, edit);
        assert!(e.contains(needle), "{arch}: expected `{needle}` in `{e}`");
    }

    // An MTP block: one more block's tensors, `nextn_predict_layers` = 1.
    let plain = tiny::target("qwen35");
    let mut mtp = plain.clone();
    let n = tiny::N_LAYER;
    mtp.set(
        "qwen35.block_count",
        Value::U32(u32::try_from(n + 1).unwrap()),
    );
    mtp.set("qwen35.nextn_predict_layers", Value::U32(1));
    for name in ["attn_norm", "nextn.enorm", "nextn.hnorm"] {
        mtp.tensor(&format!("blk.{n}.{name}.weight"), &[tiny::N_EMBD], true);
    }
    mtp.tensor(
        &format!("blk.{n}.nextn.eh_proj.weight"),
        &[2 * tiny::N_EMBD, tiny::N_EMBD],
        false,
    );
    let be = CpuBackend::new(1);
    let logits = |g: &tiny::TinyGguf| {
        let m = load(g).unwrap_or_else(|e| panic!("loads: {e}"));
        assert_eq!(m.hparams().n_layer, n);
        let mut kv = m
            .new_kv(
                &be,
                16,
                specula_quant::QType::F32,
                specula_quant::QType::F32,
            )
            .unwrap();
        let mut s = m.scratch(&be);
        m.forward(&be, &mut kv, &mut s, &[3, 4, 5], &[0, 1, 2], &[2], None)
            .unwrap()
            .to_vec()
    };
    assert_eq!(logits(&plain), logits(&mtp));
}

/// Inputs the `model_load` fuzz target found crashing, decoded the way it decodes them (the
/// first byte picks the subject and cache, each following 4 bytes one mutation).
#[test]
fn fuzz_found_inputs_are_clean_errors_or_finite_runs() {
    let inputs: [&[u8]; 1] = [&[0xf6, 0x0a, 0x46, 0x16, 0x04, 0x00]];
    for data in inputs {
        let (&first, rest) = data.split_first().unwrap();
        let subject = Subject::ALL[usize::from(first) % Subject::ALL.len()];
        let cache = usize::from(first) / Subject::ALL.len();
        let muts: Vec<Mutation> = rest
            .chunks_exact(4)
            .map(|c| Mutation::from_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        run_case(subject, &muts, cache).unwrap();
    }
}
