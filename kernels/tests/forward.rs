//! Whole forwards on the CubeCL backend equal the CPU backend's: logits of a prefill and of
//! the decodes after it (logits NMSE ≤ 1e-5, and the same greedy token at every row), on a
//! tiny qwen3, on SmolLM2-135M (llama; Q4_1 matrices, a Q8_0 tied head) and on Gemma-3-270M
//! (Q4_K/Q5_0/Q6_K/Q8_0, GeGLU, QK-norm, sliding-window layers), on CubeCL's CPU runtime; also
//! over block-format and turbo caches, with IQ4_NL / MXFP4 / NVFP4 and Q2_K / Q3_K / IQ4_XS
//! matrices, and on the hybrid
//! targets (gated delta-net layers).
//!
//! Activation quantization makes a forward chaotic: one ulp of difference upstream flips an
//! 8-bit code somewhere and grows to ~1e-3 NMSE in the logits after a few layers (measured
//! while building this). The bound holds because the kernels reproduce the CPU backend's
//! operations in its order — integer dot products with its float terms, f64 norms, its
//! softmax `expf` and tile/chunk order, its vector `exp` in SwiGLU — so on this runtime the
//! logits come out with its bits (NMSE 0 on all three models when this was written).

use std::sync::Arc;

use specula_cpu::CpuBackend;
use specula_engine::Engine;
use specula_gguf::Gguf;
use specula_kernels::CubeBackend;
use specula_models::Model;
use specula_quant::QType;
use specula_tensor::Backend;
use specula_tokenizer::Tokenizer;

/// Logits of `ids[..n − decodes]` as one prefill (every row), then of each remaining id
/// decoded alone.
fn logits<B: Backend>(
    be: B,
    file: &Arc<Gguf>,
    ids: &[u32],
    decodes: usize,
    cache: (QType, QType),
) -> Vec<f32> {
    let tok = Tokenizer::from_gguf(file).unwrap();
    let model = Model::load(&be, file.clone()).unwrap();
    let engine = Engine::new(be, model, tok);
    let mut s = engine.session(ids.len() + 8, cache.0, cache.1).unwrap();
    let split = ids.len() - decodes;
    let mut all = engine.prefill(&mut s, &ids[..split], true).unwrap();
    for &id in &ids[split..] {
        all.extend(engine.decode(&mut s, id).unwrap());
    }
    all
}

fn nmse(got: &[f32], want: &[f32]) -> f64 {
    let (mut num, mut den) = (0f64, 0f64);
    for (&g, &w) in got.iter().zip(want) {
        num += (f64::from(g) - f64::from(w)).powi(2);
        den += f64::from(w).powi(2);
    }
    num / den
}

fn same_forward(what: &str, file: &Arc<Gguf>, ids: &[u32], cache: (QType, QType)) {
    let want = logits(CpuBackend::new(2), file, ids, 3, cache);
    let got = logits(CubeBackend::cpu().unwrap(), file, ids, 3, cache);
    assert_eq!(got.len(), want.len());
    assert!(
        got.iter().all(|x| x.is_finite()),
        "{what}: non-finite logits"
    );
    let e = nmse(&got, &want);
    eprintln!("{what}: logits NMSE {e:.3e} over {} tokens", ids.len());
    assert!(e <= 1e-5, "{what}: logits NMSE {e:.3e} > 1e-5");
    // The argmax of every row agrees too (what greedy decoding reads).
    let n_vocab = want.len() / ids.len();
    let argmax = |v: &[f32]| {
        v.chunks_exact(n_vocab)
            .map(|r| {
                r.iter()
                    .enumerate()
                    .max_by(|a, b| a.1.total_cmp(b.1))
                    .map(|(i, _)| i)
                    .unwrap()
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(argmax(&got), argmax(&want), "{what}: greedy tokens differ");
}

/// [`same_forward`] on a tiny model over F16 caches, 20 ids.
fn same_tiny(what: &str, g: &specula_testkit::tiny::TinyGguf) {
    let file = Arc::new(Gguf::from_bytes(g.to_bytes().unwrap()).unwrap());
    let ids: Vec<u32> = (0..20u32).map(|i| (i * 7 + 3) % 32).collect();
    same_forward(what, &file, &ids, (QType::F16, QType::F16));
}

#[test]
fn tiny_qwen3_forward_equals_the_cpu_backend() {
    let g = specula_testkit::tiny::target("qwen3");
    let file = Arc::new(Gguf::from_bytes(g.to_bytes().unwrap()).unwrap());
    let ids: Vec<u32> = (0..20u32).map(|i| (i * 7 + 3) % 32).collect();
    same_forward("tiny qwen3", &file, &ids, (QType::F16, QType::F16));
    // Block-format caches, K and V apart: each head less its offset, rotated, quantized on
    // the device as the CPU backend does it.
    same_forward(
        "tiny qwen3, q5_1 K / q8_0 V",
        &file,
        &ids,
        (QType::Q5_1, QType::Q8_0),
    );
}

/// The tiny qwen3 with its matrices in each codebook format (IQ4_NL, MXFP4, NVFP4's 16-value
/// UE4M3-scaled blocks): the device's table lookups and NVFP4's half activation blocks give
/// the CPU backend's logits.
#[test]
fn codebook_weight_formats_forward_equal_the_cpu_backend() {
    use specula_gguf::GgmlType;
    for ty in [GgmlType::IQ4_NL, GgmlType::MXFP4, GgmlType::NVFP4] {
        let mut g = specula_testkit::tiny::target("qwen3");
        for t in &mut g.tensors {
            if t.dims.len() >= 2 && t.dims[0] % 64 == 0 && t.name != "token_embd.weight" {
                t.ty = ty;
            }
        }
        same_tiny(&format!("tiny qwen3, {ty:?} matrices"), &g);
    }
}

/// The tiny qwen3 at a hidden size of 256 with its matrices in the 256-value formats the
/// other tests do not load (Q2_K, Q3_K, IQ4_XS): 16-value groups with a min, Q3_K's codes
/// with their high bit, IQ4_XS's codebook under sub-block scales give the CPU backend's
/// logits.
#[test]
fn low_bit_k_quant_forward_equals_the_cpu_backend() {
    use specula_gguf::GgmlType;
    let d = specula_testkit::tiny::Dims {
        n_embd: 256,
        n_ff: 512,
        ..specula_testkit::tiny::Dims::TINY
    };
    for ty in [GgmlType::Q2_K, GgmlType::Q3_K, GgmlType::IQ4_XS] {
        let mut g = specula_testkit::tiny::target_sized("qwen3", &d);
        let mut n = 0;
        for t in &mut g.tensors {
            if t.dims.len() >= 2 && t.dims[0] % 256 == 0 && t.name != "token_embd.weight" {
                t.ty = ty;
                n += 1;
            }
        }
        assert!(n >= 4, "{ty:?}: {n} matrices converted");
        same_tiny(&format!("tiny qwen3 (hidden 256), {ty:?} matrices"), &g);
    }
}

/// The tiny qwen3 with heads of 128 values over turbo caches (turbo4 K, turbo3 V; turbo2 K,
/// q8_0 V): norms, rotation and codes written on the device as the CPU backend writes them.
#[test]
fn turbo_caches_forward_equal_the_cpu_backend() {
    let d = specula_testkit::tiny::Dims {
        head_dim: 128,
        ..specula_testkit::tiny::Dims::TINY
    };
    let g = specula_testkit::tiny::target_sized("qwen3", &d);
    let file = Arc::new(Gguf::from_bytes(g.to_bytes().unwrap()).unwrap());
    let ids: Vec<u32> = (0..20u32).map(|i| (i * 7 + 3) % 32).collect();
    for cache in [(QType::Turbo4, QType::Turbo3), (QType::Turbo2, QType::Q8_0)] {
        same_forward(
            &format!("tiny qwen3 (heads of 128), {} K / {} V", cache.0, cache.1),
            &file,
            &ids,
            cache,
        );
    }
}

/// The hybrid targets (gated delta-net layers beside attention; Qwen3.5 dense and MoE,
/// Qwen3-Next's grouped heads): the causal convolution and the delta rule on the device.
#[test]
fn hybrid_forward_equals_the_cpu_backend() {
    for arch in ["qwen35", "qwen35moe", "qwen3next"] {
        let g = specula_testkit::tiny::target(arch);
        same_tiny(&format!("tiny {arch}"), &g);
    }
}

/// Every other tiny architecture (llama, qwen2, gemma3's sliding window and GeGLU, qwen3moe's
/// experts, Laguna's per-head gates and per-layer heads, Gemma 4's parallel experts, per-layer
/// inputs and KV-shared layers): the same logits as the CPU backend.
#[test]
fn every_tiny_architecture_forward_equals_the_cpu_backend() {
    for arch in [
        "llama", "qwen2", "gemma3", "qwen3moe", "laguna", "gemma4", "gemma4-e",
    ] {
        let g = specula_testkit::tiny::target(arch);
        same_tiny(&format!("tiny {arch}"), &g);
    }
}

fn real(name: &str, text: &str, cache: (QType, QType)) {
    let Some(path) = specula_testkit::real_model(name) else {
        return;
    };
    let file = Arc::new(Gguf::open(&path).unwrap());
    let tok = Tokenizer::from_gguf(&file).unwrap();
    let ids = tok.encode(text);
    same_forward(
        &format!("{name}, {} K / {} V", cache.0, cache.1),
        &file,
        &ids,
        cache,
    );
}

#[test]
fn smollm2_forward_equals_the_cpu_backend() {
    real(
        "smollm2-135m",
        "The quick brown fox jumps over the lazy dog, and then it runs into the forest to find",
        (QType::F16, QType::F16),
    );
}

#[test]
fn smollm2_forward_with_block_format_caches_equals_the_cpu_backend() {
    real(
        "smollm2-135m",
        "The quick brown fox jumps over the lazy dog, and then it runs into the forest to find",
        (QType::Q8_0, QType::Q4_0),
    );
}

#[test]
fn smollm2_forward_with_two_stage_turbo_caches_equals_the_cpu_backend() {
    // Heads of 64 values: each stored in two stages in one 128-code turbo group.
    real(
        "smollm2-135m",
        "The quick brown fox jumps over the lazy dog, and then it runs into the forest to find",
        (QType::Turbo4, QType::Turbo3),
    );
}

#[test]
fn gemma3_forward_with_turbo_caches_equals_the_cpu_backend() {
    // Heads of 256 values: two turbo groups each.
    real(
        "gemma3-270m",
        "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:\n        return n\n",
        (QType::Turbo4, QType::Turbo3),
    );
}

#[test]
fn gemma3_forward_equals_the_cpu_backend() {
    real(
        "gemma3-270m",
        "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:\n        return n\n",
        (QType::F16, QType::F16),
    );
}

/// The logits of three sessions of `file` stepped together ([`Engine::decode_multi`], the
/// server's continuous batching: every sequence's attention as one op over the batch's
/// rows) or each alone, row after row: prompts of 9, 4 and 13 ids, then steps of 1, 3 and 1
/// rows and of 1, 1 and 2.
fn sessions<B: Backend>(be: B, file: &Arc<Gguf>, together: bool) -> Vec<f32> {
    let tok = Tokenizer::from_gguf(file).unwrap();
    let model = Model::load(&be, file.clone()).unwrap();
    let engine = Engine::new(be, model, tok);
    let id = |i: u32| (i * 11 + 5) % 32;
    let prompts: [Vec<u32>; 3] = [
        (0..9).map(id).collect(),
        (20..24).map(id).collect(),
        (40..53).map(id).collect(),
    ];
    let mut ss: Vec<_> = prompts
        .iter()
        .map(|p| {
            let mut s = engine.session(64, QType::F16, QType::F16).unwrap();
            engine.prefill(&mut s, p, false).unwrap();
            s
        })
        .collect();
    let steps: [[Vec<u32>; 3]; 2] = [
        [vec![id(60)], (61..64).map(id).collect(), vec![id(64)]],
        [vec![id(70)], vec![id(71)], vec![id(72), id(73)]],
    ];
    let mut scratch = engine.scratch();
    let mut out = specula_engine::Readout::default();
    let mut all = Vec::new();
    for step in &steps {
        let entries = ss
            .iter_mut()
            .zip(step)
            .map(|(s, t)| specula_engine::BatchEntry {
                session: s,
                tokens: t,
                logits_from: 0,
                capture: None,
            });
        if together {
            let mut entries: Vec<_> = entries.collect();
            engine
                .decode_multi(&mut entries, &mut scratch, &mut out)
                .unwrap();
            all.extend_from_slice(&out.logits);
        } else {
            for e in entries {
                engine
                    .decode_multi(&mut [e], &mut scratch, &mut out)
                    .unwrap();
                all.extend_from_slice(&out.logits);
            }
        }
    }
    all
}

/// Sessions stepped together on the CubeCL backend give each session the bits it gets
/// stepped alone (batch invariance across sequences: the multi-sequence attention reads and
/// writes each sequence's rows in place), and the CPU backend's logits; on a tiny qwen3 and
/// on a tiny gemma3 (sliding-window layers).
#[test]
fn sessions_stepped_together_equal_each_alone() {
    for arch in ["qwen3", "gemma3"] {
        let g = specula_testkit::tiny::target(arch);
        let file = Arc::new(Gguf::from_bytes(g.to_bytes().unwrap()).unwrap());
        let together = sessions(CubeBackend::cpu().unwrap(), &file, true);
        let alone = sessions(CubeBackend::cpu().unwrap(), &file, false);
        assert_eq!(together.len(), alone.len());
        assert!(
            together
                .iter()
                .zip(&alone)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "tiny {arch}: sessions stepped together differ from each alone"
        );
        let cpu = sessions(CpuBackend::new(2), &file, true);
        let e = nmse(&together, &cpu);
        assert!(
            e <= 1e-5,
            "tiny {arch}: logits NMSE {e:.3e} > 1e-5 against the CPU backend"
        );
    }
}
