//! What a greedy generation moves from the backend to the host, counted by
//! `specula_testkit::counting::Counting` around the CPU backend on the tiny llama:
//!
//! - plain greedy decoding downloads one id per step (the argmax of its logits row) and no
//!   float at all;
//! - a greedy speculative round downloads the ids of its verify rows (the draft, plus one) and
//!   no float: no logits row and, with a drafter that reads no taps, no hidden state;
//! - the tokens are those of the path that downloads the logits (asked for with
//!   `top_logits`), which downloads a row of the vocabulary per step.
//!
//! - a feature drafter (DFlash, EAGLE-3) reads the target's taps where the target computed
//!   them: a greedy generation with one downloads the same ids and no float, and the drafter
//!   uploads no feature and reads its draft rows out as ids with their probabilities, not as
//!   logits;
//! - the server's batched forward capturing taps into backend tensors moves nothing more.
//!
//! Targets with a mixture of experts (qwen3moe, laguna's sigmoid router with its correction
//! bias, gemma4's) route on the backend: their greedy steps and rounds download the same ids
//! and nothing else — no router logits, no routing.

use std::sync::Arc;

use specula_cpu::CpuBackend;
use specula_engine::{Engine, GenerateOptions, SpecOptions};
use specula_gguf::Gguf;
use specula_models::Model;
use specula_quant::QType;
use specula_spec::{DraftParams, Drafter, DrafterState, SpecError};
use specula_tensor::Backend;
use specula_testkit::counting::{Counting, Tally};
use specula_tokenizer::Tokenizer;

fn engine(arch: &str) -> Engine<Counting<CpuBackend>> {
    let g = specula_testkit::tiny::target(arch);
    let file = Arc::new(Gguf::from_bytes(g.to_bytes().unwrap()).unwrap());
    let tokenizer = Tokenizer::from_gguf(&file).unwrap();
    let be = Counting::new(CpuBackend::new(2));
    let model = Model::load(&be, file).unwrap();
    Engine::new(be, model, tokenizer)
}

fn since(e: &Engine<Counting<CpuBackend>>, before: Tally) -> Tally {
    let now = e.backend.tally();
    Tally {
        downloads: now.downloads - before.downloads,
        floats_down: now.floats_down - before.floats_down,
        argmax_calls: now.argmax_calls - before.argmax_calls,
        ids_down: now.ids_down - before.ids_down,
        probs_down: now.probs_down - before.probs_down,
        floats_up: now.floats_up - before.floats_up,
        index_uploads: now.index_uploads - before.index_uploads,
        indices_up: now.indices_up - before.indices_up,
    }
}

/// A forward builds its index tensors once (tokens, logits rows, and each sequence's
/// positions and the cells its queries read; a batch of several sequences adds its rows and
/// positions) and every layer reads them: what it uploads does not grow with the layers.
#[test]
fn a_forward_uploads_its_indices_once_for_every_layer() {
    use specula_models::SeqRows;
    let e = engine("llama");
    let (be, model) = (&*e.backend, &e.model);
    assert!(model.hparams().n_layer >= 2);
    let shape = || model.kv_shape(64, QType::F16, QType::F16);
    let mut s = model.scratch(be);
    let mut kv = be.kv_new(shape()).unwrap();
    let tokens = [3u32, 7, 11, 2, 5];
    let pos: Vec<u32> = (0..5).collect();

    let before = be.tally();
    model
        .forward(be, &mut kv, &mut s, &tokens, &pos, &[4], None)
        .unwrap();
    let t = since(&e, before);
    assert_eq!(
        t.index_uploads, 4,
        "tokens, logits rows, positions, cells read: {t:?}"
    );
    assert_eq!(t.indices_up, 5 + 1 + 5 + 5, "{t:?}");

    // A decode step on top of the prompt.
    let before = be.tally();
    model
        .forward(be, &mut kv, &mut s, &[9], &[5], &[0], None)
        .unwrap();
    let t = since(&e, before);
    assert_eq!(t.index_uploads, 4, "{t:?}");
    assert_eq!(t.indices_up, 1 + 1 + 1 + 6, "{t:?}");

    // Three sequences in one batch: the batch's tokens, logits rows and positions, then each
    // sequence's rows, positions and cells read.
    let mut kvs: Vec<_> = (0..3).map(|_| be.kv_new(shape()).unwrap()).collect();
    let p3: Vec<u32> = (0..3).collect();
    let before = be.tally();
    let mut seqs: Vec<SeqRows<'_, _>> = kvs
        .iter_mut()
        .map(|kv| SeqRows {
            kv,
            tokens: &tokens[..3],
            pos: &p3,
            logits_rows: &[2],
            taps: None,
            ring: None,
        })
        .collect();
    model.forward_multi(be, &mut seqs, &mut s).unwrap();
    let t = since(&e, before);
    assert_eq!(t.index_uploads, 3 + 3 * 3, "{t:?}");
}

/// Proposes the true continuation, with every third round's second token wrong.
struct Truth {
    prompt_len: usize,
    truth: Vec<u32>,
    round: usize,
}

impl Drafter for Truth {
    fn name(&self) -> &'static str {
        "truth"
    }
    fn begin(&mut self, _prompt: &[u32]) -> Result<(), SpecError> {
        self.round = 0;
        Ok(())
    }
    fn draft(&mut self, p: &DraftParams<'_>) -> Result<Vec<u32>, SpecError> {
        self.round += 1;
        let at = p.history.len() - self.prompt_len;
        let mut d: Vec<u32> = self.truth.iter().skip(at).take(p.n_max).copied().collect();
        if self.round.is_multiple_of(3) && d.len() > 1 {
            d[1] = (d[1] + 1) % 32;
        }
        Ok(d)
    }
    fn state(&self) -> DrafterState {
        Box::new(self.round)
    }
    fn restore(&mut self, s: &DrafterState) -> Result<(), SpecError> {
        self.round = *s
            .downcast_ref::<usize>()
            .ok_or(SpecError::ForeignState("truth"))?;
        Ok(())
    }
}

/// The tiny targets these tests run: a dense one, and each kind of mixture of experts.
const ARCHS: [&str; 4] = ["llama", "qwen3moe", "laguna", "gemma4"];

#[test]
fn greedy_decoding_downloads_one_id_per_step_and_no_logits() {
    for arch in ARCHS {
        greedy_decoding_downloads(arch);
    }
}

fn greedy_decoding_downloads(arch: &str) {
    let e = engine(arch);
    let n_vocab = e.model.hparams().n_vocab;
    let prompt: Vec<u32> = (0..9u32).map(|i| (i * 5 + 2) % 32).collect();
    let n = 12;
    let opts = GenerateOptions::greedy(n);

    let mut s = e.session(64, QType::F16, QType::F16).unwrap();
    let before = e.backend.tally();
    let fast = e.generate(&mut s, &prompt, &opts, |_| {}).unwrap();
    let t = since(&e, before);
    assert_eq!(fast.generated_ids.len(), n);
    assert_eq!(t.floats_down, 0, "{arch}: {t:?}");
    assert_eq!(t.downloads, 0, "{arch}: {t:?}");
    assert_eq!(t.ids_down, n as u64, "{arch}: one id per step: {t:?}");

    // Asking for top logits takes the logits path: the same tokens, a row per step.
    let mut s = e.session(64, QType::F16, QType::F16).unwrap();
    let before = e.backend.tally();
    let with_logits = GenerateOptions {
        top_logits: 1,
        ..opts.clone()
    };
    let slow = e.generate(&mut s, &prompt, &with_logits, |_| {}).unwrap();
    let t = since(&e, before);
    assert_eq!(slow.generated_ids, fast.generated_ids);
    assert_eq!(t.floats_down, (n * n_vocab) as u64, "{t:?}");
    assert_eq!(t.ids_down, 0, "{t:?}");
    // The session keeps returning logits after a greedy generation.
    assert_eq!(e.decode(&mut s, 3).unwrap().len(), n_vocab);
}

#[test]
fn a_greedy_speculative_round_downloads_only_its_verify_rows_ids() {
    for arch in ARCHS {
        speculative_round_downloads(arch);
    }
}

fn speculative_round_downloads(arch: &str) {
    let e = engine(arch);
    let prompt: Vec<u32> = (0..9u32).map(|i| (i * 5 + 2) % 32).collect();
    let n = 20;
    let opts = GenerateOptions::greedy(n);
    let truth = {
        let mut s = e.session(64, QType::F16, QType::F16).unwrap();
        e.generate(&mut s, &prompt, &opts, |_| {})
            .unwrap()
            .generated_ids
    };
    let spec = SpecOptions {
        n_max: 4,
        adaptive: false,
        ..SpecOptions::default()
    };
    let mut d = Truth {
        prompt_len: prompt.len(),
        truth: truth.clone(),
        round: 0,
    };
    let mut s = e.session(64, QType::F16, QType::F16).unwrap();
    let before = e.backend.tally();
    let g = e
        .generate_speculative(&mut s, &prompt, &opts, &mut d, &spec, |_| {})
        .unwrap();
    let t = since(&e, before);
    assert_eq!(g.generated_ids, truth, "{arch}: lossless");
    let stats = g.spec.unwrap();
    assert!(
        stats.drafted > stats.accepted,
        "some drafts rejected: {stats:?}"
    );
    assert_eq!(t.floats_down, 0, "{arch}: no logits, no features: {t:?}");
    assert_eq!(t.downloads, 0, "{arch}: {t:?}");
    // Every round's verify rows: its draft and the anchor.
    let rows = stats.drafted + stats.rounds;
    assert_eq!(t.ids_down, rows as u64, "{arch}: {t:?} for {stats:?}");
    assert_eq!(t.argmax_calls, stats.rounds as u64, "{t:?}");
}

/// The server's batched forward over several sessions (`decode_multi`) in argmax mode: one
/// id per logits row and no float, the ids the argmaxes of the rows the logits mode reads —
/// and the same when entries capture their hidden states into backend tensors.
#[test]
fn a_batched_greedy_forward_downloads_one_id_per_row() {
    use specula_engine::{BatchEntry, Readout};
    let e = engine("llama");
    let prompts: [&[u32]; 3] = [&[1, 5, 9, 14], &[1, 7], &[1, 3, 3, 8, 2, 6]];
    // Rows asked for: the last of the first, every row of the second, the last two of the
    // third.
    let from = [3, 0, 4];
    // With `capture`, the first and the last entry capture taps 1 and 2 into backend tensors
    // (a feature drafter that reads them there, as the server's slots do).
    let run = |argmax: bool, capture: bool| {
        let mut sessions: Vec<_> = prompts
            .iter()
            .map(|_| e.session(64, QType::F16, QType::F16).unwrap())
            .collect();
        let mut scratch = e.scratch();
        scratch.set_argmax(argmax);
        let mut taps: Vec<_> = (0..3)
            .map(|_| specula_models::Taps {
                layers: vec![1, 2],
                rows: Vec::new(),
            })
            .collect();
        let mut host = vec![Vec::new(); 3];
        let mut dev: Vec<_> = (0..3).map(|_| e.backend.zeros(0, 0)).collect();
        let mut entries: Vec<BatchEntry<'_, _>> = sessions
            .iter_mut()
            .zip(prompts)
            .zip(from)
            .zip(taps.iter_mut().zip(host.iter_mut()).zip(dev.iter_mut()))
            .enumerate()
            .map(
                |(i, (((session, tokens), logits_from), ((t, f), d)))| BatchEntry {
                    session,
                    tokens,
                    logits_from,
                    capture: (capture && i != 1).then_some(specula_engine::Capture {
                        taps: t,
                        features: f,
                        device: Some(d),
                    }),
                },
            )
            .collect();
        let before = e.backend.tally();
        let mut out = Readout::default();
        e.decode_multi(&mut entries, &mut scratch, &mut out)
            .unwrap();
        drop(entries);
        let shapes: Vec<(usize, usize)> = dev.iter().map(|d| e.backend.shape(d)).collect();
        (out, since(&e, before), shapes)
    };
    let (logits, _, _) = run(false, false);
    let (ids, t, _) = run(true, false);
    let (captured, tc, shapes) = run(true, true);
    assert_eq!(captured.ids, ids.ids, "capturing changes no id");
    assert_eq!(tc, t, "features captured on the backend move nothing more");
    let width = 2 * e.model.hparams().n_embd;
    assert_eq!(shapes, [(4, width), (0, 0), (6, width)]);
    let n_vocab = e.model.hparams().n_vocab;
    let rows: usize = 1 + 2 + 2;
    assert_eq!(logits.logits.len(), rows * n_vocab);
    let want: Vec<u32> = logits
        .logits
        .chunks_exact(n_vocab)
        .map(|r| specula_sampling::steps::argmax(r).unwrap())
        .collect();
    assert!(ids.logits.is_empty());
    assert_eq!(ids.ids, want);
    assert_eq!(
        (t.floats_down, t.ids_down, t.argmax_calls),
        (0, rows as u64, 1),
        "{t:?}"
    );
}

/// Records the drafts of the drafter it wraps; with `device` false it hides that the drafter
/// reads features on the backend, so the loop captures them on the host.
struct Rec<D> {
    inner: D,
    device: bool,
    drafts: Vec<Vec<u32>>,
}

impl<D: Drafter> Drafter for Rec<D> {
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn begin(&mut self, prompt: &[u32]) -> Result<(), SpecError> {
        self.inner.begin(prompt)
    }
    fn max_draft(&self) -> Option<usize> {
        self.inner.max_draft()
    }
    fn target_taps(&self) -> &[usize] {
        self.inner.target_taps()
    }
    fn process(&mut self, tokens: &[u32], pos0: usize) -> Result<(), SpecError> {
        self.inner.process(tokens, pos0)
    }
    fn process_features(
        &mut self,
        tokens: &[u32],
        pos0: usize,
        features: &[f32],
    ) -> Result<(), SpecError> {
        self.inner.process_features(tokens, pos0, features)
    }
    fn takes_device_features(&self) -> bool {
        self.device && self.inner.takes_device_features()
    }
    fn process_device_features(
        &mut self,
        tokens: &[u32],
        pos0: usize,
        features: &(dyn std::any::Any + Send + Sync),
        rows: std::ops::Range<usize>,
    ) -> Result<(), SpecError> {
        self.inner
            .process_device_features(tokens, pos0, features, rows)
    }
    fn draft(&mut self, p: &DraftParams<'_>) -> Result<Vec<u32>, SpecError> {
        let d = self.inner.draft(p)?;
        self.drafts.push(d.clone());
        Ok(d)
    }
    fn accept(&mut self, n: usize) {
        self.inner.accept(n);
    }
    fn stops_when_unsure(&self) -> bool {
        self.inner.stops_when_unsure()
    }
    fn state(&self) -> DrafterState {
        self.inner.state()
    }
    fn restore(&mut self, s: &DrafterState) -> Result<(), SpecError> {
        self.inner.restore(s)
    }
}

/// A drafter on the counting backend, and its tallies.
trait Counted: Drafter {
    fn tally(&self) -> Tally;
}

impl Counted for specula_engine::DflashDrafter<Counting<CpuBackend>> {
    fn tally(&self) -> Tally {
        self.backend().tally()
    }
}

impl Counted for specula_engine::Eagle3Drafter<Counting<CpuBackend>> {
    fn tally(&self) -> Tally {
        self.backend().tally()
    }
}

/// A greedy generation with a feature drafter: the target's taps go to the drafter as a
/// backend tensor, so neither side moves a feature through the host — the target downloads
/// only its verify rows' ids, the drafter uploads nothing and reads its draft rows out as ids
/// with their probabilities — and the drafts, the counts and the tokens are those of the same
/// drafter fed through the host (which downloads every tap row there and uploads it again).
fn features_stay_on_the_backend<D: Counted>(
    label: &str,
    e: &Engine<Counting<CpuBackend>>,
    make: impl Fn() -> D,
) {
    let prompt: Vec<u32> = (0..13u32).map(|i| (i * 7 + 3) % 32).collect();
    let opts = GenerateOptions::greedy(24);
    let spec = SpecOptions {
        n_max: 4,
        p_min: 0.0,
        adaptive: false,
        ..SpecOptions::default()
    };
    // Through the host.
    let mut host = Rec {
        inner: make(),
        device: false,
        drafts: Vec::new(),
    };
    let mut s = e.session(64, QType::F16, QType::F16).unwrap();
    let before = e.backend.tally();
    let via_host = e
        .generate_speculative(&mut s, &prompt, &opts, &mut host, &spec, |_| {})
        .unwrap();
    let target_host = since(e, before);
    let drafter_host = host.inner.tally();
    // On the backend.
    let mut dev = Rec {
        inner: make(),
        device: true,
        drafts: Vec::new(),
    };
    assert!(dev.takes_device_features(), "{label}");
    let mut s = e.session(64, QType::F16, QType::F16).unwrap();
    let before = e.backend.tally();
    let g = e
        .generate_speculative(&mut s, &prompt, &opts, &mut dev, &spec, |_| {})
        .unwrap();
    let target = since(e, before);
    let drafted = dev.inner.tally();

    assert_eq!(g.generated_ids, via_host.generated_ids, "{label}");
    assert_eq!(dev.drafts, host.drafts, "{label}: the same drafts");
    let (st, sh) = (g.spec.unwrap(), via_host.spec.unwrap());
    assert_eq!(
        (st.rounds, st.drafted, st.accepted),
        (sh.rounds, sh.drafted, sh.accepted),
        "{label}: the same counts"
    );
    assert!(st.drafted > 0, "{label}: {st:?}");
    // The target: only the verify rows' ids, on the backend path. (A step with no draft
    // left in the budget verifies its anchor alone.)
    assert_eq!(target.floats_down, 0, "{label}: {target:?}");
    assert_eq!(
        target.ids_down,
        st.drafted as u64 + target.argmax_calls,
        "{label}: {target:?} for {st:?}"
    );
    assert!(target.argmax_calls >= st.rounds as u64, "{target:?}");
    assert!(target_host.floats_down > 0, "the host path downloads taps");
    // The drafter: no feature uploaded, and its draft rows read out as ids and their
    // probabilities — no logits row comes down.
    assert_eq!(drafted.floats_up, 0, "{label}: {drafted:?}");
    assert!(drafter_host.floats_up > 0, "the host path uploads them");
    assert_eq!(drafted.floats_down, 0, "{label}: {drafted:?}");
    assert_eq!(drafted.downloads, 0, "{label}: {drafted:?}");
    assert_eq!(drafted.ids_down, drafted.probs_down);
    assert!(
        drafted.ids_down >= st.drafted as u64,
        "{drafted:?} for {st:?}"
    );
}

#[test]
fn a_greedy_dflash_round_keeps_the_target_features_on_the_backend() {
    use specula_engine::{DflashDrafter, Injection};
    let e = engine("llama");
    let file = Arc::new(
        Gguf::from_bytes(specula_testkit::tiny::dflash(false).to_bytes().unwrap()).unwrap(),
    );
    for policy in [Injection::Deferred, Injection::Eager] {
        features_stay_on_the_backend(&format!("dflash {policy:?}"), &e, || {
            DflashDrafter::new(
                Arc::new(Counting::new(CpuBackend::new(1))),
                Arc::clone(&file),
                &e,
                64,
                QType::F16,
                QType::F16,
                policy,
            )
            .unwrap()
        });
    }
}

#[test]
fn a_greedy_eagle3_round_keeps_the_target_features_on_the_backend() {
    use specula_engine::Eagle3Drafter;
    let e = engine("llama");
    let file =
        Arc::new(Gguf::from_bytes(specula_testkit::tiny::eagle3().to_bytes().unwrap()).unwrap());
    features_stay_on_the_backend("eagle3", &e, || {
        Eagle3Drafter::new(
            Arc::new(Counting::new(CpuBackend::new(1))),
            Arc::clone(&file),
            &e,
            64,
            QType::F16,
            QType::F16,
        )
        .unwrap()
    });
}

/// DFlash2's selector reads each block row's candidates as `K + 1` ids and logits
/// (`topk_rows`), and its convolutions run on the backend: what the drafter downloads besides
/// is the selector's own codes — `P·h` of each row, the predecessor's code and the `K`
/// candidates' codes — never a logits row.
#[test]
fn a_dflash2_draft_reads_its_candidates_not_its_logits() {
    use specula_engine::{DflashDrafter, Injection};
    let e = engine("llama");
    let file = Arc::new(
        Gguf::from_bytes(specula_testkit::tiny::dflash(true).to_bytes().unwrap()).unwrap(),
    );
    let mut d = DflashDrafter::new(
        Arc::new(Counting::new(CpuBackend::new(1))),
        file,
        &e,
        64,
        QType::F16,
        QType::F16,
        Injection::Eager,
    )
    .unwrap();
    let h2 = d.net().hparams().dflash2.clone().expect("a DFlash2 draft");
    let prompt: Vec<u32> = (0..13u32).map(|i| (i * 7 + 3) % 32).collect();
    let opts = GenerateOptions::greedy(24);
    let plain = {
        let mut s = e.session(64, QType::F16, QType::F16).unwrap();
        e.generate(&mut s, &prompt, &opts, |_| {}).unwrap()
    };
    let spec = SpecOptions {
        n_max: 4,
        p_min: 0.0,
        adaptive: false,
        ..SpecOptions::default()
    };
    let mut s = e.session(64, QType::F16, QType::F16).unwrap();
    let g = e
        .generate_speculative(&mut s, &prompt, &opts, &mut d, &spec, |_| {})
        .unwrap();
    assert_eq!(g.generated_ids, plain.generated_ids);
    let t = d.backend().tally();
    let k = h2.top_k.min(e.model.hparams().n_vocab);
    assert!(t.ids_down > 0 && t.ids_down == t.probs_down, "{t:?}");
    assert_eq!(
        t.ids_down % (k as u64 + 1),
        0,
        "K + 1 candidates a row: {t:?}"
    );
    let rows = t.ids_down / (k as u64 + 1);
    assert_eq!(
        t.floats_down,
        rows * (h2.rank * (k + 2)) as u64,
        "the selector's codes and nothing else: {t:?}"
    );
}
