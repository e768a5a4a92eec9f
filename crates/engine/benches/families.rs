//! Benchmarks of the model families' two costs that their layer kinds bring, on the tiny test
//! architectures scaled up to a hidden size of 1024 (F32 weights, random values):
//!
//! - **MoE prefill**: tokens/s of one 512-token forward against tokens/s of one-token decodes,
//!   for every mixture-of-experts architecture. Experts run grouped by expert (one matmul per
//!   used expert and projection for the whole batch), so a prefill token costs a fraction of a
//!   decode token; a per-token expert loop would put the ratio near 1. Goal: ≥ 8×.
//! - **Hybrid rollback** (qwen35, qwen35moe): after a 9-row verify (`n_max` 8) with `keep` rows
//!   kept, the cost of taking the rest back — selecting the recurrent snapshot (the next forward
//!   starts at the kept position) against restoring the checkpoint and replaying the kept rows —
//!   measured as the next one-token forward's time minus a plain one-token forward's.
//!   Goal: replay ≥ 3× the snapshot's cost.
//!
//! `cargo bench -p specula-engine --bench families [-- --threads N] [--only ARCH[:TYPE]]`:
//! prints Markdown tables (medians of several repetitions) for `docs/perf.md`; `--only` keeps
//! the MoE prefill rows of one architecture (and weight type), for timing one side by side.

use std::sync::Arc;
use std::time::Instant;

use specula_cpu::CpuBackend;
use specula_engine::{Engine, Session};
use specula_gguf::Gguf;
use specula_models::Model;
use specula_quant::QType;
use specula_testkit::tiny::{self, Dims};
use specula_tokenizer::Tokenizer;

/// The tiny architectures at a hidden size of 1024.
const DIMS: Dims = Dims::HIDDEN_1024;

/// `arch` at [`DIMS`], its matrices in `ty` (F32 as generated, else quantized).
fn engine(arch: &str, ty: specula_gguf::GgmlType, threads: usize) -> Engine<CpuBackend> {
    let mut g = tiny::target_sized(arch, &DIMS);
    for t in &mut g.tensors {
        if t.dims.len() >= 2 && t.dims[0] % 32 == 0 && t.name != "token_embd.weight" {
            t.ty = ty;
        }
    }
    let bytes = g.to_bytes_large().expect("the model writes");
    let file = Arc::new(Gguf::from_bytes(bytes).expect("valid GGUF"));
    let tokenizer = Tokenizer::from_gguf(&file).expect("tokenizer");
    let be = CpuBackend::new(threads);
    let model = Model::load(&be, file).expect("the model loads");
    Engine::new(be, model, tokenizer)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Seconds `f` takes, median of `reps`.
fn time(reps: usize, mut f: impl FnMut()) -> f64 {
    median(
        (0..reps)
            .map(|_| {
                let t = Instant::now();
                f();
                t.elapsed().as_secs_f64()
            })
            .collect(),
    )
}

fn ids(n: usize, salt: usize) -> Vec<u32> {
    (0..n)
        .map(|i| u32::try_from(3 + (i * 7 + salt) % (tiny::N_VOCAB - 3)).expect("tiny"))
        .collect()
}

fn session(e: &Engine<CpuBackend>, n_ctx: usize) -> Session<CpuBackend> {
    e.session(n_ctx, QType::F16, QType::F16).expect("session")
}

#[allow(clippy::cast_precision_loss, reason = "token counts")]
fn moe_prefill(threads: usize, only: Option<&str>) {
    use specula_gguf::GgmlType;
    println!(
        "\n### MoE prefill: one 512-token forward vs one-token decodes (hidden 1024, {threads} threads)\n"
    );
    println!("| arch | weights | experts (used) | pp512 t/s | tg t/s | ratio |");
    println!("|---|---|---|---|---|---|");
    let runs = [
        ("qwen3", GgmlType::F32),
        ("qwen3moe", GgmlType::F32),
        ("qwen3", GgmlType::Q8_0),
        ("qwen3moe", GgmlType::Q8_0),
        ("qwen35moe", GgmlType::Q8_0),
        ("laguna", GgmlType::Q8_0),
        ("gemma4", GgmlType::Q8_0),
    ];
    for (arch, ty) in runs {
        if only.is_some_and(|o| o != arch && o != format!("{arch}:{ty:?}")) {
            continue;
        }
        let e = engine(arch, ty, threads);
        let prompt = ids(512, 1);
        let mut out = Vec::new();
        let pp = time(3, || {
            let mut s = session(&e, 1024);
            e.prefill_into(&mut s, &prompt, prompt.len() - 1, &mut out)
                .expect("prefill");
        });
        let steps = ids(32, 5);
        let tg = median(
            (0..3)
                .map(|_| {
                    let mut s = session(&e, 1024);
                    e.prefill_into(&mut s, &prompt[..16], 15, &mut out)
                        .expect("prefill");
                    let t = Instant::now();
                    for &id in &steps {
                        e.decode(&mut s, id).expect("decode");
                    }
                    t.elapsed().as_secs_f64()
                })
                .collect(),
        ) / steps.len() as f64;
        let (pp_tps, tg_tps) = (512.0 / pp, 1.0 / tg);
        let experts = if arch.ends_with("moe") || matches!(arch, "laguna" | "gemma4") {
            format!("{} ({})", DIMS.n_expert, DIMS.n_expert_used)
        } else {
            "dense".to_owned()
        };
        println!(
            "| {arch} | {ty:?} | {experts} | {pp_tps:.0} | {tg_tps:.1} | {:.1}× |",
            pp_tps / tg_tps
        );
    }
}

fn hybrid_rollback(threads: usize) {
    println!(
        "\n### Hybrid rollback after a 9-row verify (n_max 8, hidden 1024, {threads} threads)\n"
    );
    println!("| arch | rows kept | snapshot: extra ms | replay: extra ms | replay / snapshot |");
    println!("|---|---|---|---|---|");
    for arch in ["qwen35", "qwen35moe"] {
        let e = engine(arch, specula_gguf::GgmlType::Q8_0, threads);
        let prompt = ids(64, 2);
        let verify = ids(9, 3);
        let reps = 7;
        let mut out = Vec::new();
        // A fresh session holding the prompt (forced to replay, or not).
        let fresh = |replay: bool, out: &mut Vec<f32>| {
            let mut s = session(&e, 512);
            if replay {
                s.force_replay();
            }
            e.prefill_into(&mut s, &prompt, prompt.len() - 1, out)
                .expect("prefill");
            s
        };
        // A plain one-token forward after the prompt: the baseline.
        let base = median(
            (0..reps)
                .map(|_| {
                    let mut s = fresh(false, &mut out);
                    let t = Instant::now();
                    e.decode(&mut s, 7).expect("decode");
                    t.elapsed().as_secs_f64()
                })
                .collect(),
        );
        for keep in [1, 5, 8] {
            let mut cost = |replay: bool| {
                median(
                    (0..reps)
                        .map(|_| {
                            let mut s = fresh(replay, &mut out);
                            let ck = s.checkpoint();
                            e.prefill_into(&mut s, &verify, 0, &mut out)
                                .expect("verify");
                            let n = prompt.len() + keep;
                            let t = Instant::now();
                            e.rewind(&mut s, n, Some(&ck), &verify[..keep])
                                .expect("rewind");
                            e.decode(&mut s, 7).expect("decode");
                            t.elapsed().as_secs_f64() - base
                        })
                        .collect(),
                )
            };
            let (snap, replay) = (cost(false), cost(true));
            println!(
                "| {arch} | {keep} of 9 | {:.3} | {:.3} | {:.1}× |",
                snap * 1e3,
                replay * 1e3,
                replay / snap.max(1e-6)
            );
        }
        println!(
            "| {arch} | (plain one-token forward: {:.3} ms) | | | |",
            base * 1e3
        );
    }
}

fn main() {
    let mut threads = 2;
    let args: Vec<String> = std::env::args().collect();
    if let Some(i) = args.iter().position(|a| a == "--threads") {
        threads = args
            .get(i + 1)
            .and_then(|t| t.parse().ok())
            .unwrap_or(threads);
    }
    // `cargo test --benches` runs this with `--bench` absent: keep that quick.
    if !args.iter().any(|a| a == "--bench") {
        println!("families: run with `cargo bench` to measure");
        return;
    }
    let only = args
        .iter()
        .position(|a| a == "--only")
        .and_then(|i| args.get(i + 1))
        .map(String::as_str);
    moe_prefill(threads, only);
    if only.is_none() {
        hybrid_rollback(threads);
    }
}
