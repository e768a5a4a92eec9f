//! Every drafter on every architecture: on the tiny target of each of
//! `specula_testkit::tiny::ARCHS` (dense llama / qwen2 / qwen3, gemma3's sliding window,
//! qwen3moe's mixture of experts), greedy speculative output with a DFlash, DFlash2 or EAGLE-3
//! drafter (random, so nearly every draft is rejected, at every position), a draft model (the
//! target itself, so every draft is accepted) and n-gram lookup equals plain greedy output —
//! with the target rolling back by truncation and by checkpoint and replay.

use std::sync::Arc;

use specula_cpu::CpuBackend;
use specula_engine::{
    DflashDrafter, DraftModel, Eagle3Drafter, Engine, GenerateOptions, Injection, SpecOptions,
};
use specula_gguf::Gguf;
use specula_models::Model;
use specula_quant::QType;
use specula_spec::Drafter;
use specula_spec::ngram::NgramSimple;
use specula_testkit::tiny;
use specula_tokenizer::Tokenizer;

const N_CTX: usize = 256;
const PROMPT: &[u32] = &[1, 5, 9, 12, 5, 9, 12, 5, 9, 30, 7, 7];

fn file(g: &tiny::TinyGguf) -> Arc<Gguf> {
    Arc::new(Gguf::from_bytes(g.to_bytes().expect("a tiny model writes")).expect("valid GGUF"))
}

fn engine(g: &tiny::TinyGguf) -> Engine<CpuBackend> {
    let f = file(g);
    let tokenizer = Tokenizer::from_gguf(&f).expect("tokenizer");
    let be = CpuBackend::new(1);
    let model = Model::load(&be, f).expect("the tiny model loads");
    Engine::new(be, model, tokenizer)
}

fn greedy(n: usize) -> GenerateOptions {
    GenerateOptions::greedy(n)
}

/// The drafters of one run, built for target `e`.
fn drafters(arch: &str, e: &Engine<CpuBackend>) -> Vec<(&'static str, Box<dyn Drafter>)> {
    // The target's own backend instance, as `specula run` shares it.
    let be = || Arc::clone(&e.backend);
    let dflash = |two: bool| {
        DflashDrafter::new(
            be(),
            file(&tiny::dflash(two)),
            e,
            N_CTX,
            QType::F32,
            QType::F32,
            Injection::Eager,
        )
        .expect("a tiny DFlash drafter loads")
    };
    vec![
        ("dflash", Box::new(dflash(false)) as Box<dyn Drafter>),
        ("dflash2", Box::new(dflash(true))),
        (
            "eagle3",
            Box::new(
                Eagle3Drafter::new(
                    be(),
                    file(&tiny::eagle3()),
                    e,
                    N_CTX,
                    QType::F32,
                    QType::F32,
                )
                .expect("a tiny EAGLE-3 head loads"),
            ),
        ),
        (
            "draft model (itself)",
            Box::new(
                DraftModel::new(
                    engine(&tiny::target(arch)),
                    &e.tokenizer,
                    N_CTX,
                    QType::F32,
                    QType::F32,
                )
                .expect("a draft model of the same vocabulary"),
            ),
        ),
        ("n-gram", Box::new(NgramSimple::new(1, 3))),
    ]
}

#[test]
fn every_drafter_is_lossless_on_every_architecture() {
    let opts = greedy(24);
    let so = SpecOptions {
        n_max: 4,
        n_min: 0,
        p_min: 0.0,
        adaptive: false,
    };
    for arch in tiny::ARCHS {
        let e = engine(&tiny::target(arch));
        let mut s = e.session(N_CTX, QType::F32, QType::F32).expect("session");
        let want = e
            .generate(&mut s, PROMPT, &opts, |_| {})
            .expect("plain greedy")
            .generated_ids;
        for replay in [false, true] {
            for (name, mut d) in drafters(arch, &e) {
                let mut s = e.session(N_CTX, QType::F32, QType::F32).expect("session");
                if replay {
                    s.force_replay();
                }
                let got = e
                    .generate_speculative(&mut s, PROMPT, &opts, d.as_mut(), &so, |_| {})
                    .unwrap_or_else(|err| panic!("{arch} {name}: {err}"));
                assert_eq!(
                    got.generated_ids, want,
                    "{arch}, {name}, replay {replay}: speculative output differs from plain"
                );
                let st = got.spec.expect("speculative stats");
                assert!(
                    st.drafted > 0,
                    "{arch} {name}: nothing was drafted ({st:?})"
                );
                if name.starts_with("draft model") {
                    assert_eq!(st.accepted, st.drafted, "{arch}: a self-draft is accepted");
                }
            }
        }
    }
}

/// A drafter that knows the plain greedy continuation `want` of `prompt` and, in round `r`,
/// drafts its next `r % (n_max + 1)` tokens right and then wrong ones up to `n_max`: over the
/// rounds, the first rejection falls at every position `0..=n_max` of a draft, taking back
/// every number of rows.
struct Oracle {
    prompt_len: usize,
    want: Vec<u32>,
    round: usize,
}

impl Drafter for Oracle {
    fn name(&self) -> &'static str {
        "oracle"
    }
    fn begin(&mut self, _prompt: &[u32]) -> Result<(), specula_spec::SpecError> {
        self.round = 0;
        Ok(())
    }
    fn draft(
        &mut self,
        p: &specula_spec::DraftParams<'_>,
    ) -> Result<Vec<u32>, specula_spec::SpecError> {
        let right = self.round % (p.n_max + 1);
        self.round += 1;
        // history = prompt + generated; the anchor (last) is generated[done - 1].
        let done = p.history.len() - self.prompt_len;
        let mut d: Vec<u32> = self.want[done.min(self.want.len())..]
            .iter()
            .take(right.min(p.n_max))
            .copied()
            .collect();
        let n_vocab = u32::try_from(tiny::N_VOCAB).expect("fits");
        while d.len() < p.n_max {
            let next = self.want.get(done + d.len()).copied().unwrap_or(0);
            d.push((next + 1) % n_vocab);
        }
        Ok(d)
    }
    fn state(&self) -> specula_spec::DrafterState {
        Box::new(self.round)
    }
    fn restore(&mut self, s: &specula_spec::DrafterState) -> Result<(), specula_spec::SpecError> {
        self.round = *s
            .downcast_ref::<usize>()
            .ok_or(specula_spec::SpecError::ForeignState("oracle"))?;
        Ok(())
    }
}

/// The hybrid (gated delta-net) models roll back by selecting a recurrent snapshot: a draft
/// rejected at each position `0..=n_max` gives the plain greedy output, with snapshots (no
/// replay at all while the draft fits them), with replay forced, and with fewer snapshots than
/// the draft (the rejections past them replayed from the checkpoint).
#[test]
fn hybrid_rollback_at_every_position_keeps_the_output() {
    let n_max = 6;
    let opts = greedy(40);
    let so = SpecOptions {
        n_max,
        n_min: 0,
        p_min: 0.0,
        adaptive: false,
    };
    for (arch, snapshots) in [
        ("qwen35", 16),
        ("qwen35moe", 16),
        ("qwen3next", 16),
        ("qwen35", 2),
    ] {
        let mut e = engine(&tiny::target(arch));
        e.recurrent_snapshots = snapshots;
        let mut s = e.session(N_CTX, QType::F32, QType::F32).expect("session");
        assert_eq!(s.rollback(), specula_kv::Rollback::Snapshot, "{arch}");
        let want = e
            .generate(&mut s, PROMPT, &opts, |_| {})
            .expect("plain greedy")
            .generated_ids;
        for mode in ["snapshot", "replay"] {
            let mut d = Oracle {
                prompt_len: PROMPT.len(),
                want: want.clone(),
                round: 0,
            };
            let mut s = e.session(N_CTX, QType::F32, QType::F32).expect("session");
            if mode == "replay" {
                s.force_replay();
            }
            let got = e
                .generate_speculative(&mut s, PROMPT, &opts, &mut d, &so, |_| {})
                .unwrap_or_else(|err| panic!("{arch} {mode}: {err}"));
            assert_eq!(got.generated_ids, want, "{arch} {mode}");
            let st = got.spec.expect("stats");
            // Every rejection position occurred.
            assert!(st.rounds > n_max + 1, "{arch} {mode}: {st:?}");
            assert!(
                st.accepted > 0 && st.accepted < st.drafted,
                "{arch} {mode}: {st:?}"
            );
            if mode == "snapshot" && snapshots >= n_max {
                assert_eq!(st.replays, 0, "{arch}: a snapshot was selected every time");
            } else {
                assert!(st.replays > 0, "{arch}: replay forced: {st:?}");
            }
        }
    }
}
