//! Speculative decoding on the CubeCL backend (its CPU runtime here; CUDA on a GPU machine):
//! target and drafters — DFlash, DFlash2 and EAGLE-3 heads reading the target's hidden states,
//! a draft model (the target itself), n-gram lookup — all on this backend, and greedy
//! speculative output equal to plain greedy output, with rollback by truncation and by
//! replay. The drafters are random, so nearly every draft is rejected, at every position.

use std::sync::Arc;

use specula_engine::{
    DflashDrafter, DraftModel, Eagle3Drafter, Engine, GenerateOptions, Injection, SpecOptions,
};
use specula_gguf::Gguf;
use specula_kernels::CubeBackend;
use specula_models::Model;
use specula_quant::QType;
use specula_spec::Drafter;
use specula_spec::ngram::NgramSimple;
use specula_testkit::tiny;
use specula_tokenizer::Tokenizer;

const N_CTX: usize = 128;
const PROMPT: &[u32] = &[1, 5, 9, 12, 5, 9, 12, 5, 9, 30, 7, 7];

fn file(g: &tiny::TinyGguf) -> Arc<Gguf> {
    Arc::new(Gguf::from_bytes(g.to_bytes().expect("a tiny model writes")).expect("valid GGUF"))
}

fn backend() -> CubeBackend {
    CubeBackend::cpu().expect("CubeCL's CPU runtime")
}

fn engine(g: &tiny::TinyGguf) -> Engine<CubeBackend> {
    let f = file(g);
    let tokenizer = Tokenizer::from_gguf(&f).expect("tokenizer");
    let be = backend();
    let model = Model::load(&be, f).expect("the tiny model loads");
    Engine::new(be, model, tokenizer)
}

#[test]
fn every_drafter_is_lossless_on_the_cubecl_backend() {
    let opts = GenerateOptions::greedy(10);
    let so = SpecOptions {
        n_max: 4,
        n_min: 0,
        p_min: 0.0,
        adaptive: false,
    };
    // The target's cache: f16, and block formats (K and V apart) on qwen3.
    for (arch, kt, vt) in [
        ("qwen3", QType::F16, QType::F16),
        ("gemma3", QType::F16, QType::F16),
        ("qwen3", QType::Q8_0, QType::Q4_1),
        // Recurrent layers: a rejected tail taken back by a kept state, or replayed.
        ("qwen35", QType::F16, QType::F16),
        // A mixture of experts: its prompt (over 64 routed pairs) grouped by expert after
        // the routing is read back, its verify rows reading the experts by id on the device.
        ("qwen3moe", QType::F16, QType::F16),
    ] {
        let long: Vec<u32> = PROMPT
            .iter()
            .cycle()
            .take(4 * PROMPT.len())
            .copied()
            .collect();
        let prompt: &[u32] = if arch == "qwen3moe" { &long } else { PROMPT };
        let e = engine(&tiny::target(arch));
        let mut s = e.session(N_CTX, kt, vt).expect("session");
        let want = e
            .generate(&mut s, prompt, &opts, |_| {})
            .expect("plain greedy")
            .generated_ids;
        let drafters = || -> Vec<(&str, Box<dyn Drafter>)> {
            let dflash = |two: bool| {
                DflashDrafter::new(
                    Arc::clone(&e.backend),
                    file(&tiny::dflash(two)),
                    &e,
                    N_CTX,
                    QType::F16,
                    QType::F16,
                    Injection::Eager,
                )
                .expect("a tiny DFlash drafter loads")
            };
            let eagle3 = Eagle3Drafter::new(
                Arc::clone(&e.backend),
                file(&tiny::eagle3()),
                &e,
                N_CTX,
                QType::F16,
                QType::F16,
            )
            .expect("a tiny EAGLE-3 head loads");
            let draft_model = DraftModel::new(
                engine(&tiny::target(arch)),
                &e.tokenizer,
                N_CTX,
                QType::F16,
                QType::F16,
            )
            .expect("the draft model");
            vec![
                ("dflash", Box::new(dflash(false))),
                ("dflash2", Box::new(dflash(true))),
                ("eagle3", Box::new(eagle3)),
                ("draft model (itself)", Box::new(draft_model)),
                ("n-gram", Box::new(NgramSimple::new(1, 3))),
            ]
        };
        for replay in [false, true] {
            for (name, mut d) in drafters() {
                let mut s = e.session(N_CTX, kt, vt).expect("session");
                if replay {
                    s.force_replay();
                }
                let got = e
                    .generate_speculative(&mut s, prompt, &opts, d.as_mut(), &so, |_| {})
                    .unwrap_or_else(|err| panic!("{arch} {name}: {err}"));
                assert_eq!(
                    got.generated_ids, want,
                    "{arch}, {name}, replay {replay}: speculative output differs from plain"
                );
                let st = got.spec.expect("speculative stats");
                assert!(st.drafted > 0, "{arch} {name}: nothing was drafted");
                if name.starts_with("draft model") {
                    assert_eq!(st.accepted, st.drafted, "{arch}: a self-draft is accepted");
                }
            }
        }
    }
}
