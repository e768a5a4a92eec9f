//! Speculative decoding is lossless: on a tiny random llama with quantized weights (Q8_0 and
//! Q4_0, so the packed micro-kernels and lane kernels run), greedy speculative output equals
//! plain greedy output token for token for any drafter — random, adversarial, the target itself
//! as a draft model, truncated — across draft lengths 1..16, `p_min`, a context that is exactly
//! full, a one-token prompt, and an end-of-generation token inside an accepted block. Sampled
//! runs repeat with the same seed. Also: the first round is anchored at the last prompt token
//! (llama-speculative-simple's rounds, pinned by hand-computed counts), the statistics add up,
//! and mismatched vocabularies are refused by name.

use std::sync::Arc;

use proptest::prelude::*;
use specula_cpu::CpuBackend;
use specula_engine::{
    DraftModel, Engine, EngineError, GenerateOptions, SpecOptions, VocabMismatch, check_vocab,
};
use specula_gguf::{Array, GgmlType, Gguf, GgufWriter, Value};
use specula_models::Model;
use specula_quant::QType;
use specula_sampling::SamplerParams;
use specula_spec::{DraftParams, Drafter, DrafterState, SpecError};
use specula_testkit::{byte_symbols, pick, splitmix64, values};
use specula_tokenizer::Tokenizer;

const N_VOCAB: usize = 256;
const N_EMBD: usize = 64;
const N_FF: usize = 128;
const N_HEAD: usize = 4;
const N_HEAD_KV: usize = 2;
const HEAD_DIM: usize = 16;
const N_LAYER: usize = 2;

/// A tiny llama GGUF with random weights (`seed`), its end-of-generation token `eos` and,
/// when `rename` is set, token 7 renamed (to test the vocabulary check).
fn tiny(seed: u64, eos: u32, rename: bool) -> Vec<u8> {
    let u = |v: usize| Value::U32(u32::try_from(v).unwrap());
    let mut w = GgufWriter::new();
    let mut tokens = byte_symbols();
    if rename {
        tokens[7] = "renamed".into();
    }
    let md: Vec<(&str, Value)> = vec![
        ("general.architecture", Value::String("llama".into())),
        ("llama.block_count", u(N_LAYER)),
        ("llama.context_length", u(512)),
        ("llama.embedding_length", u(N_EMBD)),
        ("llama.feed_forward_length", u(N_FF)),
        ("llama.attention.head_count", u(N_HEAD)),
        ("llama.attention.head_count_kv", u(N_HEAD_KV)),
        ("llama.rope.freq_base", Value::F32(10_000.0)),
        ("llama.attention.layer_norm_rms_epsilon", Value::F32(1e-5)),
        ("llama.rope.dimension_count", u(HEAD_DIM)),
        ("llama.vocab_size", u(N_VOCAB)),
        ("tokenizer.ggml.model", Value::String("gpt2".into())),
        ("tokenizer.ggml.pre", Value::String("default".into())),
        ("tokenizer.ggml.tokens", Value::Array(Array::String(tokens))),
        (
            "tokenizer.ggml.token_type",
            Value::Array(Array::I32(vec![1; N_VOCAB])),
        ),
        (
            "tokenizer.ggml.merges",
            Value::Array(Array::String(vec!["a b".into()])),
        ),
        ("tokenizer.ggml.bos_token_id", Value::U32(1)),
        ("tokenizer.ggml.eos_token_id", Value::U32(eos)),
        ("tokenizer.ggml.add_bos_token", Value::Bool(false)),
    ];
    for (k, v) in md {
        w.add(k, v).unwrap();
    }
    let (q, kv) = (N_HEAD * HEAD_DIM, N_HEAD_KV * HEAD_DIM);
    let mut t: Vec<(String, QType, usize, usize)> = vec![
        ("token_embd.weight".into(), QType::Q8_0, N_EMBD, N_VOCAB),
        ("output_norm.weight".into(), QType::F32, N_EMBD, 1),
        ("output.weight".into(), QType::Q8_0, N_EMBD, N_VOCAB),
    ];
    for l in 0..N_LAYER {
        let n = |s: &str| format!("blk.{l}.{s}");
        t.extend([
            (n("attn_norm.weight"), QType::F32, N_EMBD, 1),
            (n("ffn_norm.weight"), QType::F32, N_EMBD, 1),
            (n("attn_q.weight"), QType::Q8_0, N_EMBD, q),
            (n("attn_k.weight"), QType::Q4_0, N_EMBD, kv),
            (n("attn_v.weight"), QType::Q8_0, N_EMBD, kv),
            (n("attn_output.weight"), QType::Q4_0, q, N_EMBD),
            (n("ffn_gate.weight"), QType::Q4_0, N_EMBD, N_FF),
            (n("ffn_up.weight"), QType::Q8_0, N_EMBD, N_FF),
            (n("ffn_down.weight"), QType::Q4_0, N_FF, N_EMBD),
        ]);
    }
    let mut data = Vec::new();
    for (i, (name, ty, n_in, n_out)) in t.iter().enumerate() {
        let vector = *n_out == 1;
        let dims: Vec<u64> = if vector {
            vec![*n_in as u64]
        } else {
            vec![*n_in as u64, *n_out as u64]
        };
        let ggml = GgmlType::from_id(ty.ggml_id().unwrap()).unwrap();
        w.add_tensor(name.as_str(), ggml, &dims).unwrap();
        let x = if vector {
            values(seed + i as u64, *n_in, 0.2)
                .iter()
                .map(|v| 1.0 + v)
                .collect()
        } else {
            values(seed + i as u64, n_in * n_out, 0.6)
        };
        let rb = ty.row_bytes(*n_in).unwrap();
        let mut bytes = vec![0u8; rb * n_out];
        for (row, b) in x.chunks_exact(*n_in).zip(bytes.chunks_exact_mut(rb)) {
            specula_quant::quantize_row(*ty, row, b).unwrap();
        }
        data.push(bytes);
    }
    let refs: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
    w.to_vec(&refs).unwrap()
}

fn engine(bytes: Vec<u8>) -> Engine<CpuBackend> {
    let file = Arc::new(Gguf::from_bytes(bytes).unwrap());
    let tokenizer = Tokenizer::from_gguf(&file).unwrap();
    let be = CpuBackend::new(2);
    let model = Model::load(&be, file).unwrap();
    Engine::new(be, model, tokenizer)
}

fn greedy(n_predict: usize, stop_at_eog: bool) -> GenerateOptions {
    GenerateOptions {
        n_predict,
        sampler: SamplerParams::greedy(),
        force_ids: None,
        top_logits: 0,
        stop_at_eog,
    }
}

/// A drafter driven by a closure of (history, n_max, round).
struct Scripted<F: FnMut(&[u32], usize, usize) -> Vec<u32>> {
    f: F,
    round: usize,
}

impl<F: FnMut(&[u32], usize, usize) -> Vec<u32>> Drafter for Scripted<F> {
    fn name(&self) -> &'static str {
        "scripted"
    }
    fn begin(&mut self, _prompt: &[u32]) -> Result<(), SpecError> {
        self.round = 0;
        Ok(())
    }
    fn draft(&mut self, p: &DraftParams<'_>) -> Result<Vec<u32>, SpecError> {
        self.round += 1;
        Ok((self.f)(p.history, p.n_max, self.round))
    }
    fn state(&self) -> DrafterState {
        Box::new(self.round)
    }
    fn restore(&mut self, s: &DrafterState) -> Result<(), SpecError> {
        self.round = *s
            .downcast_ref::<usize>()
            .ok_or(SpecError::ForeignState("scripted"))?;
        Ok(())
    }
}

fn plain(e: &Engine<CpuBackend>, prompt: &[u32], opts: &GenerateOptions, n_ctx: usize) -> Vec<u32> {
    let mut s = e.session(n_ctx, QType::F16, QType::F16).unwrap();
    e.generate(&mut s, prompt, opts, |_| {})
        .unwrap()
        .generated_ids
}

fn speculative(
    e: &Engine<CpuBackend>,
    prompt: &[u32],
    opts: &GenerateOptions,
    n_ctx: usize,
    drafter: &mut dyn Drafter,
    spec: &SpecOptions,
) -> specula_engine::Generation {
    speculative_with(e, prompt, opts, n_ctx, drafter, spec, false)
}

/// [`speculative`], the target rolling back by checkpoint and replay when `replay`.
fn speculative_with(
    e: &Engine<CpuBackend>,
    prompt: &[u32],
    opts: &GenerateOptions,
    n_ctx: usize,
    drafter: &mut dyn Drafter,
    spec: &SpecOptions,
    replay: bool,
) -> specula_engine::Generation {
    let mut s = e.session(n_ctx, QType::F16, QType::F16).unwrap();
    if replay {
        s.force_replay();
    }
    e.generate_speculative(&mut s, prompt, opts, drafter, spec, |_| {})
        .unwrap()
}

/// A draft model whose cache rolls back by replay when `replay`.
fn draft_model(
    seed: u64,
    target: &Engine<CpuBackend>,
    n_ctx: usize,
    replay: bool,
) -> DraftModel<CpuBackend> {
    let mut d = DraftModel::new(
        engine(tiny(seed, 0, false)),
        &target.tokenizer,
        n_ctx,
        QType::F16,
        QType::F16,
    )
    .unwrap();
    if replay {
        d.force_replay();
    }
    d
}

const PROMPT: &[u32] = &[72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100];

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn greedy_speculation_equals_plain_greedy_for_any_drafter(
        kind in 0usize..4,
        n_max in 1usize..=16,
        seed in any::<u64>(),
        adaptive in any::<bool>(),
        p_min in prop::sample::select(vec![0.0f32, 0.5, 0.9]),
        short in any::<bool>(),
        replay in any::<bool>(),
    ) {
        let e = engine(tiny(11, 0, false));
        let n = 40;
        let opts = greedy(n, false);
        // A one-token prompt: nothing to prefill, the first round's anchor is the prompt.
        let prompt = if short { &PROMPT[..1] } else { PROMPT };
        // A context exactly as large as prompt + budget: the draft length must shrink to 0.
        let n_ctx = prompt.len() + n;
        let want = plain(&e, prompt, &opts, n_ctx);
        let spec = SpecOptions { n_max, n_min: 0, p_min, adaptive };
        let got = match kind {
            // Random tokens.
            0 => {
                let mut d = Scripted { f: |_: &[u32], k: usize, r: usize| {
                    (0..k).map(|i| (splitmix64(seed ^ (r * 64 + i) as u64) % 256) as u32).collect()
                }, round: 0 };
                speculative_with(&e, prompt, &opts, n_ctx, &mut d, &spec, replay)
            }
            // Adversarial: the true continuation, with one token changed at a random place.
            1 => {
                let truth = want.clone();
                let mut d = Scripted { f: move |h: &[u32], k: usize, r: usize| {
                    let at = h.len() - prompt.len();
                    let mut v: Vec<u32> = truth.iter().skip(at).take(k).copied().collect();
                    if !v.is_empty() {
                        let i = pick(splitmix64(seed ^ r as u64), v.len());
                        v[i] = (v[i] + 1) % 256;
                    }
                    v
                }, round: 0 };
                speculative_with(&e, prompt, &opts, n_ctx, &mut d, &spec, replay)
            }
            // The target itself as the draft model (accepts everything it drafts).
            2 => {
                let mut d = draft_model(11, &e, n_ctx, replay);
                speculative_with(&e, prompt, &opts, n_ctx, &mut d, &spec, replay)
            }
            // Another random model as draft, its drafts truncated at random.
            _ => {
                let mut inner = draft_model(99, &e, n_ctx, replay);
                let mut d = Scripted { f: move |h: &[u32], k: usize, r: usize| {
                    let mut v = inner.draft(&DraftParams { history: h, n_max: k, p_min: 0.0, window: None }).unwrap();
                    v.truncate(pick(splitmix64(seed ^ r as u64), k + 1));
                    v
                }, round: 0 };
                speculative_with(&e, prompt, &opts, n_ctx, &mut d, &spec, replay)
            }
        };
        prop_assert_eq!(&got.generated_ids, &want);
        let st = got.spec.unwrap();
        prop_assert!(st.accepted <= st.drafted);
        prop_assert_eq!(st.accepted_at.iter().sum::<usize>(), st.accepted);
        // Every round that rejected part of its draft replayed, and only those.
        if replay {
            prop_assert!(st.replays <= st.rounds);
            prop_assert_eq!(st.accepted < st.drafted, st.replays > 0);
            prop_assert!(st.replayed >= st.replays);
        } else {
            prop_assert_eq!((st.replays, st.replayed), (0, 0));
        }
    }
}

/// Proposes the true continuation `truth` of `prompt`, and records what it is asked for and
/// what the target ran.
struct Oracle<'a> {
    prompt: &'a [u32],
    truth: &'a [u32],
    asked: Vec<Vec<u32>>,
    ran: Vec<(Vec<u32>, usize)>,
}

impl Drafter for Oracle<'_> {
    fn name(&self) -> &'static str {
        "oracle"
    }
    fn begin(&mut self, _prompt: &[u32]) -> Result<(), SpecError> {
        Ok(())
    }
    fn process(&mut self, tokens: &[u32], pos0: usize) -> Result<(), SpecError> {
        self.ran.push((tokens.to_vec(), pos0));
        Ok(())
    }
    fn draft(&mut self, p: &DraftParams<'_>) -> Result<Vec<u32>, SpecError> {
        self.asked.push(p.history.to_vec());
        let at = p.history.len() - self.prompt.len();
        Ok(self.truth.iter().skip(at).take(p.n_max).copied().collect())
    }
    fn state(&self) -> DrafterState {
        Box::new(())
    }
    fn restore(&mut self, _s: &DrafterState) -> Result<(), SpecError> {
        Ok(())
    }
}

/// The first round opens as llama-speculative-simple's: the prompt's last token is its anchor,
/// so the first generated token is drafted and verified. A drafter that always proposes the
/// true continuation, 4 tokens a round, over a budget of 10: round 1 drafts 4 (the budget
/// leaves 9 after the target's own token) and commits 5, round 2 drafts 4 (10 − 5 − 1) and
/// commits the last 5 — 2 rounds, 8 drafted, 8 accepted. (Sampling the first token from the
/// prompt instead would draft 4 + 3 = 7.) A drafter without target taps drafts round 1 from
/// the prompt alone, so the prompt runs in the same forward as that round's verify rows: two
/// target forwards in all.
#[test]
fn the_first_generated_token_is_drafted_and_verified() {
    let e = engine(tiny(11, 0, false));
    let opts = greedy(10, false);
    let spec = SpecOptions {
        n_max: 4,
        n_min: 0,
        p_min: 0.0,
        adaptive: false,
    };
    for prompt in [PROMPT, &PROMPT[..1]] {
        let truth = plain(&e, prompt, &opts, 64);
        assert_eq!(truth.len(), 10);
        let mut d = Oracle {
            prompt,
            truth: &truth,
            asked: Vec::new(),
            ran: Vec::new(),
        };
        let got = speculative(&e, prompt, &opts, 64, &mut d, &spec);
        assert_eq!(got.generated_ids, truth);
        let st = got.spec.unwrap();
        assert_eq!(
            (st.rounds, st.drafted, st.accepted),
            (2, 8, 8),
            "prompt of {}",
            prompt.len()
        );
        assert_eq!(st.accepted_at, vec![2; 4]);
        let n = prompt.len();
        let with = |a: &[u32], b: &[u32]| [a, b].concat();
        assert_eq!(d.asked, vec![prompt.to_vec(), with(prompt, &truth[..5])]);
        assert_eq!(
            d.ran,
            vec![
                (with(prompt, &truth[..4]), 0),
                (truth[4..9].to_vec(), n + 4)
            ]
        );

        // The target drafting for itself does the same, from a draft cache that starts with
        // the prompt but its last token.
        let mut d = DraftModel::new(
            engine(tiny(11, 0, false)),
            &e.tokenizer,
            64,
            QType::F16,
            QType::F16,
        )
        .unwrap();
        let got = speculative(&e, prompt, &opts, 64, &mut d, &spec);
        assert_eq!(got.generated_ids, truth);
        let st = got.spec.unwrap();
        assert_eq!((st.rounds, st.drafted, st.accepted), (2, 8, 8));
    }
}

/// Rollback by checkpoint and replay (the path of memories that cannot trim, forced here on a
/// cache that could): an adversarial drafter that is wrong at a different place every round,
/// on the target and on a draft model of another vocabulary's weights, gives the plain
/// greedy output; every round that rejected something replayed the accepted rows.
#[test]
fn forced_replay_gives_the_plain_greedy_output() {
    let e = engine(tiny(11, 0, false));
    let n = 48;
    let opts = greedy(n, false);
    let n_ctx = PROMPT.len() + n;
    let want = plain(&e, PROMPT, &opts, n_ctx);
    let spec = SpecOptions {
        n_max: 6,
        n_min: 0,
        p_min: 0.0,
        adaptive: false,
    };
    // Wrong at draft position `round % (k + 1)` (never wrong when that is k).
    let truth = want.clone();
    let mut d = Scripted {
        f: move |h: &[u32], k: usize, r: usize| {
            let at = h.len() - PROMPT.len();
            let mut v: Vec<u32> = truth.iter().skip(at).take(k).copied().collect();
            if let Some(x) = v.get_mut(r % (k + 1)) {
                *x = (*x + 1) % 256;
            }
            v
        },
        round: 0,
    };
    let got = speculative_with(&e, PROMPT, &opts, n_ctx, &mut d, &spec, true);
    assert_eq!(got.generated_ids, want);
    let st = got.spec.unwrap();
    assert!(st.replays >= 4 && st.replays < st.rounds, "{st:?}");
    // A replay runs the anchor and the accepted drafts of its round again (the first round's
    // also the prompt rows that rode in front of its anchor, in the same forward).
    assert!(
        st.replayed >= st.replays && st.replayed - st.replays < st.accepted + PROMPT.len(),
        "{st:?}"
    );

    // The draft model rolls its own cache back by replay too.
    let mut inner = draft_model(99, &e, n_ctx, true);
    let got = speculative_with(&e, PROMPT, &opts, n_ctx, &mut inner, &spec, true);
    assert_eq!(got.generated_ids, want);
    // Its draft tokens after a rejected one are taken back out of its cache.
    let (replays, _) = inner.replays();
    assert!(replays > 0, "{replays}");
}

#[test]
fn a_self_draft_is_accepted_whole_and_eos_inside_a_block_stops_there() {
    let e = engine(tiny(11, 0, false));
    let want = plain(&e, PROMPT, &greedy(40, false), 256);
    // Make the 9th generated token the end-of-generation token.
    let eos = want[8];
    let first = want.iter().position(|&t| t == eos).unwrap();
    let e = engine(tiny(11, eos, false));
    let opts = greedy(40, true);
    let want = plain(&e, PROMPT, &opts, 256);
    assert_eq!(want.len(), first + 1);
    let mut d = DraftModel::new(
        engine(tiny(11, eos, false)),
        &e.tokenizer,
        256,
        QType::F16,
        QType::F16,
    )
    .unwrap();
    let spec = SpecOptions {
        n_max: 8,
        n_min: 0,
        p_min: 0.0,
        adaptive: false,
    };
    let got = speculative(&e, PROMPT, &opts, 256, &mut d, &spec);
    assert_eq!(got.generated_ids, want);
    assert!(got.stopped_at_eog);
    let st = got.spec.unwrap();
    // The target drafting for itself: every drafted token accepted.
    assert_eq!(st.accepted, st.drafted);
    assert!(st.rounds >= 1 && st.mean_accept_len() > 2.0, "{st:?}");
}

#[test]
fn seeded_sampled_speculation_repeats() {
    let e = engine(tiny(11, 0, false));
    let opts = GenerateOptions {
        n_predict: 30,
        sampler: SamplerParams {
            temperature: 0.9,
            seed: 5,
            ..SamplerParams::default()
        },
        force_ids: None,
        top_logits: 0,
        stop_at_eog: false,
    };
    let spec = SpecOptions {
        n_max: 4,
        n_min: 0,
        p_min: 0.0,
        adaptive: false,
    };
    let run = || {
        let mut d = DraftModel::new(
            engine(tiny(99, 0, false)),
            &e.tokenizer,
            256,
            QType::F16,
            QType::F16,
        )
        .unwrap();
        speculative(&e, PROMPT, &opts, 256, &mut d, &spec).generated_ids
    };
    assert_eq!(run(), run());
}

#[test]
fn a_draft_model_of_another_vocabulary_is_refused_by_name() {
    let e = engine(tiny(11, 0, false));
    let other = engine(tiny(11, 0, true));
    assert_eq!(
        check_vocab(&e.tokenizer, &other.tokenizer),
        Err(VocabMismatch::Token {
            id: 7,
            target: byte_symbols()[7].clone(),
            draft: "renamed".into(),
        })
    );
    let other = engine(tiny(11, 3, false));
    assert!(matches!(
        check_vocab(&e.tokenizer, &other.tokenizer),
        Err(VocabMismatch::Special { what: "EOS", .. })
    ));
    // The refusal says what it refuses, and keeps the mismatch as its source.
    let err = DraftModel::new(other, &e.tokenizer, 64, QType::F16, QType::F16).unwrap_err();
    assert!(
        matches!(
            &err,
            EngineError::Vocab(VocabMismatch::Special { what: "EOS", .. })
        ),
        "{err}"
    );
    let cause = std::error::Error::source(&err).map(ToString::to_string);
    assert!(cause.is_some_and(|c| c.contains("EOS")), "{err}");
}

/// `--spec-draft-vocab`: a draft model whose head is cut to the most frequent tokens keeps the
/// full head's logit for every kept token (the rows are copied, not requantized), drafts only
/// kept tokens, and the output stays the plain output.
#[test]
fn a_draft_head_cut_to_frequent_tokens_keeps_their_logits_and_the_output() {
    let full = engine(tiny(11, 0, false));
    let mut cut = engine(tiny(11, 0, false));
    let kept = cut.restrict_draft_vocab(100).unwrap();
    let ids = specula_engine::frequent_tokens(&cut.tokenizer, 100);
    // The end-of-generation token 0, then the 100 lowest ordinary ids (merge ranks).
    assert_eq!(kept, 101);
    assert_eq!(ids, (0..=100).collect::<Vec<u32>>());
    assert_eq!(cut.model.head_ids(), Some(ids.as_slice()));

    let mut sf = full.session(64, QType::F16, QType::F16).unwrap();
    let mut sc = cut.session(64, QType::F16, QType::F16).unwrap();
    let (mut lf, mut lc) = (Vec::new(), Vec::new());
    full.prefill_into(&mut sf, PROMPT, PROMPT.len() - 1, &mut lf)
        .unwrap();
    cut.prefill_into(&mut sc, PROMPT, PROMPT.len() - 1, &mut lc)
        .unwrap();
    assert_eq!((lf.len(), lc.len()), (N_VOCAB, ids.len()));
    for (i, &t) in ids.iter().enumerate() {
        assert_eq!(lc[i].to_bits(), lf[t as usize].to_bits(), "token {t}");
    }

    // The target as its own draft, cut: lossless, and it cannot propose the tokens it lost.
    let opts = greedy(60, false);
    let want = plain(&full, PROMPT, &opts, 256);
    let outside = want.iter().filter(|&&t| t > 100).count();
    assert!(
        outside > 0,
        "the output never leaves the kept tokens: {want:?}"
    );
    let spec = SpecOptions {
        n_max: 8,
        n_min: 0,
        p_min: 0.0,
        adaptive: false,
    };
    let mut d = DraftModel::new(cut, &full.tokenizer, 256, QType::F16, QType::F16).unwrap();
    let got = speculative(&full, PROMPT, &opts, 256, &mut d, &spec);
    assert_eq!(got.generated_ids, want);
    let st = got.spec.unwrap();
    assert!(st.accepted < st.drafted, "{st:?}");
}

/// A draft model that serves one request after another (a server slot's) keeps the part of its
/// cache the new prompt shares with what it holds and runs only the rest; it then drafts
/// exactly what a fresh draft model drafts: same ids, rounds, drafts and acceptances — with a
/// cache that trims and with one that rolls back by replay.
#[test]
fn a_draft_model_reuses_the_shared_prompt_prefix() {
    let e = engine(tiny(11, 0, false));
    let n = 24;
    let opts = greedy(n, false);
    let n_ctx = 96;
    let spec = SpecOptions {
        n_max: 5,
        n_min: 0,
        p_min: 0.0,
        adaptive: false,
    };
    // The second request shares its first 8 tokens with the first.
    let second: Vec<u32> = [&PROMPT[..8], &[33, 63, 10, 72, 105][..]].concat();
    for replay in [false, true] {
        let mut reused = draft_model(99, &e, n_ctx, replay);
        let first = speculative(&e, PROMPT, &opts, n_ctx, &mut reused, &spec);
        assert_eq!(first.generated_ids, plain(&e, PROMPT, &opts, n_ctx));
        assert_eq!(reused.reused(), 0, "a fresh cache has nothing to keep");
        let got = speculative(&e, &second, &opts, n_ctx, &mut reused, &spec);
        assert_eq!(reused.reused(), 8, "replay {replay}");

        let mut fresh = draft_model(99, &e, n_ctx, replay);
        let want = speculative(&e, &second, &opts, n_ctx, &mut fresh, &spec);
        assert_eq!(got.generated_ids, want.generated_ids, "replay {replay}");
        assert_eq!(got.generated_ids, plain(&e, &second, &opts, n_ctx));
        let (g, w) = (got.spec.unwrap(), want.spec.unwrap());
        assert_eq!(
            (g.rounds, g.drafted, &g.accepted_at),
            (w.rounds, w.drafted, &w.accepted_at),
            "replay {replay}"
        );
        assert!(w.drafted > w.accepted, "the drafts are not all kept: {w:?}");

        // The same prompt again: everything but the anchor is kept.
        let again = speculative(&e, &second, &opts, n_ctx, &mut reused, &spec);
        assert_eq!(reused.reused(), second.len() - 1);
        assert_eq!(again.generated_ids, want.generated_ids);
    }
}

/// A batched forward in which one entry fails (a token outside the vocabulary) fails that
/// entry alone: the others' sessions advance and their logits are the bits each gets running
/// alone, the failing entry's session stays where it was, and `decode_multi` itself refuses
/// the whole batch (so the fallback is what isolates the entry).
#[test]
fn a_batched_forward_fails_only_the_entry_at_fault() {
    use specula_engine::BatchEntry;
    let e = engine(tiny(3, 0, false));
    let prompts: [&[u32]; 3] = [&[5, 6, 7, 8], &[9, 10], &[11, 12, 13]];
    let bad = u32::try_from(N_VOCAB).unwrap() + 3;
    let rows: [&[u32]; 3] = [&[20, 21], &[bad], &[30]];
    let sessions = || -> Vec<_> {
        prompts
            .iter()
            .map(|p| {
                let mut s = e.session(64, QType::F16, QType::F16).unwrap();
                e.prefill(&mut s, p, false).unwrap();
                s
            })
            .collect()
    };
    // Alone.
    let mut want = Vec::new();
    for (i, mut s) in sessions().into_iter().enumerate() {
        if i != 1 {
            want.extend(e.prefill(&mut s, rows[i], true).unwrap());
        }
    }
    let mut ss = sessions();
    let mut scratch = e.scratch();
    let mut out = specula_engine::Readout::default();
    let mut entries: Vec<BatchEntry<'_, CpuBackend>> = ss
        .iter_mut()
        .zip(rows)
        .map(|(session, tokens)| BatchEntry {
            session,
            tokens,
            logits_from: 0,
            capture: None,
        })
        .collect();
    assert!(
        e.decode_multi(&mut entries, &mut scratch, &mut out)
            .is_err(),
        "the batch as a whole is refused"
    );
    let mut failed = Vec::new();
    e.decode_multi_isolated(&mut entries, &mut scratch, &mut out, &mut failed);
    drop(entries);
    assert_eq!(failed.len(), 1, "{failed:?}");
    assert_eq!(failed[0].0, 1);
    assert!(
        failed[0].1.to_string().contains("outside the vocabulary"),
        "{}",
        failed[0].1
    );
    assert_eq!(out.logits.len(), want.len());
    assert!(
        out.logits
            .iter()
            .zip(&want)
            .all(|(a, b)| a.to_bits() == b.to_bits()),
        "the entries that did not fail have their own logits, bit for bit"
    );
    assert_eq!(
        ss.iter().map(|s| s.n_past()).collect::<Vec<_>>(),
        [6, 2, 4],
        "the good sessions advance, the failed one stays"
    );
}
