//! Sliding-window attention (Gemma-3's `gemma3` architecture) on a tiny random model with a
//! window of 8 in two of every three layers: every way the engine runs rows — one prefill, a
//! prefill in chunks, one-token decodes, the several-position verify batches of speculative
//! decoding with rollback by trim or by replay, several sessions in one batch — masks each query at position `p` to the keys
//! `p − 7 ..= p` (llama.cpp `is_masked_swa`: masked when `p − p_k ≥ n_swa`), so their logits
//! have the same bits and greedy speculative output is the plain output, logits and all, far
//! past the window.

use std::sync::Arc;

use specula_cpu::CpuBackend;
use specula_engine::{DraftModel, Engine, GenerateOptions, SpecOptions};
use specula_gguf::{Array, GgmlType, Gguf, GgufWriter, Value};
use specula_models::Model;
use specula_quant::QType;
use specula_sampling::SamplerParams;
use specula_spec::{DraftParams, Drafter, DrafterState, SpecError};
use specula_tensor::Backend;
use specula_testkit::{byte_symbols, splitmix64, values};
use specula_tokenizer::Tokenizer;

const N_VOCAB: usize = 256;
const N_EMBD: usize = 64;
const N_FF: usize = 128;
const N_HEAD: usize = 4;
const N_HEAD_KV: usize = 2;
const HEAD_DIM: usize = 32;
const N_LAYER: usize = 3;
const WINDOW: usize = 8;

/// A tiny gemma3 GGUF with random weights (`seed`): layers 0 and 1 slide over `window`
/// positions (0: no sliding window), layer 2 is global (pattern 3). Both RoPE bases are
/// 10 000, so a model with the window and one without differ by the mask alone.
fn tiny_gemma(seed: u64, window: usize) -> Vec<u8> {
    let u = |v: usize| Value::U32(u32::try_from(v).unwrap());
    let mut w = GgufWriter::new();
    let md: Vec<(&str, Value)> = vec![
        ("general.architecture", Value::String("gemma3".into())),
        ("gemma3.block_count", u(N_LAYER)),
        ("gemma3.context_length", u(512)),
        ("gemma3.embedding_length", u(N_EMBD)),
        ("gemma3.feed_forward_length", u(N_FF)),
        ("gemma3.attention.head_count", u(N_HEAD)),
        ("gemma3.attention.head_count_kv", u(N_HEAD_KV)),
        ("gemma3.attention.key_length", u(HEAD_DIM)),
        ("gemma3.attention.value_length", u(HEAD_DIM)),
        ("gemma3.rope.freq_base", Value::F32(10_000.0)),
        ("gemma3.attention.layer_norm_rms_epsilon", Value::F32(1e-6)),
        ("gemma3.attention.sliding_window", u(window)),
        ("gemma3.attention.sliding_window_pattern", u(3)),
        ("tokenizer.ggml.model", Value::String("gpt2".into())),
        ("tokenizer.ggml.pre", Value::String("default".into())),
        (
            "tokenizer.ggml.tokens",
            Value::Array(Array::String(byte_symbols())),
        ),
        (
            "tokenizer.ggml.token_type",
            Value::Array(Array::I32(vec![1; N_VOCAB])),
        ),
        (
            "tokenizer.ggml.merges",
            Value::Array(Array::String(vec!["a b".into()])),
        ),
        ("tokenizer.ggml.bos_token_id", Value::U32(1)),
        ("tokenizer.ggml.eos_token_id", Value::U32(0)),
        ("tokenizer.ggml.add_bos_token", Value::Bool(false)),
    ];
    for (k, v) in md {
        w.add(k, v).unwrap();
    }
    let (q, kv) = (N_HEAD * HEAD_DIM, N_HEAD_KV * HEAD_DIM);
    // The output head is tied to the Q8_0 embedding, as in Gemma-3's GGUFs.
    let mut t: Vec<(String, QType, usize, usize)> = vec![
        ("token_embd.weight".into(), QType::Q8_0, N_EMBD, N_VOCAB),
        ("output_norm.weight".into(), QType::F32, N_EMBD, 1),
    ];
    for l in 0..N_LAYER {
        let n = |s: &str| format!("blk.{l}.{s}");
        t.extend([
            (n("attn_norm.weight"), QType::F32, N_EMBD, 1),
            (n("attn_q.weight"), QType::Q8_0, N_EMBD, q),
            (n("attn_k.weight"), QType::Q4_0, N_EMBD, kv),
            (n("attn_v.weight"), QType::Q8_0, N_EMBD, kv),
            (n("attn_q_norm.weight"), QType::F32, HEAD_DIM, 1),
            (n("attn_k_norm.weight"), QType::F32, HEAD_DIM, 1),
            (n("attn_output.weight"), QType::Q4_0, q, N_EMBD),
            (n("post_attention_norm.weight"), QType::F32, N_EMBD, 1),
            (n("ffn_norm.weight"), QType::F32, N_EMBD, 1),
            (n("ffn_gate.weight"), QType::Q4_0, N_EMBD, N_FF),
            (n("ffn_up.weight"), QType::Q8_0, N_EMBD, N_FF),
            (n("ffn_down.weight"), QType::Q4_0, N_FF, N_EMBD),
            (n("post_ffw_norm.weight"), QType::F32, N_EMBD, 1),
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
        let x: Vec<f32> = if vector {
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

/// A prompt of `n` token ids.
fn prompt(n: usize) -> Vec<u32> {
    (0..n as u64)
        .map(|i| u32::try_from(splitmix64(i ^ 0x5eed) % N_VOCAB as u64).unwrap())
        .collect()
}

/// The logits of every position of `ids`, one prefill in chunks of `n_batch`.
fn prefill_all(e: &mut Engine<CpuBackend>, ids: &[u32], n_batch: usize) -> Vec<f32> {
    e.n_batch = n_batch;
    let mut s = e.session(64, QType::F16, QType::F16).unwrap();
    e.prefill(&mut s, ids, true).unwrap()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn the_hyperparameters_follow_llama_cpp() {
    let e = engine(tiny_gemma(3, WINDOW));
    let hp = e.model.hparams();
    let swa = hp.swa.as_ref().expect("a sliding window");
    assert_eq!(swa.window, WINDOW);
    assert_eq!(swa.layers, [true, true, false]);
    assert_eq!(swa.rope_freq_base, 10_000.0);
    // 1/√head_dim (not 1/√(n_embd/n_head) = 1/4: that is 27B's rule), embeddings × √n_embd.
    assert!((hp.attn_scale - 1.0 / 32f32.sqrt()).abs() < 1e-7);
    assert_eq!(hp.embd_scale, Some(8.0));
    assert!(engine(tiny_gemma(3, 0)).model.hparams().swa.is_none());
}

#[test]
fn prefill_chunks_and_decodes_mask_the_window_alike() {
    let mut e = engine(tiny_gemma(3, WINDOW));
    let ids = prompt(40);
    let one = prefill_all(&mut e, &ids, 512);
    let n_vocab = e.model.hparams().n_vocab;
    assert_eq!(one.len(), ids.len() * n_vocab);
    for n_batch in [1, 3, 7, 8, 9, 16] {
        assert_eq!(
            bits(&prefill_all(&mut e, &ids, n_batch)),
            bits(&one),
            "prefill in chunks of {n_batch}"
        );
    }
    // One-token decodes after a prefill of 11.
    e.n_batch = 512;
    let mut s = e.session(64, QType::F16, QType::F16).unwrap();
    let mut got = e.prefill(&mut s, &ids[..11], true).unwrap();
    for &t in &ids[11..] {
        got.extend(e.decode(&mut s, t).unwrap());
    }
    assert_eq!(bits(&got), bits(&one), "decode");
}

/// Two sessions of `n_ctx` cells that have run the first `done` tokens of their ids, then the
/// rest of both in one `decode_multi` batch (logits from row `logits_from` of each): the
/// batch's logits and the sessions' positions after it.
fn two_in_one_batch(
    e: &Engine<CpuBackend>,
    n_ctx: usize,
    (a, a_done, a_from): (&[u32], usize, usize),
    (b, b_done, b_from): (&[u32], usize, usize),
) -> (Vec<f32>, [usize; 2]) {
    let mut sa = e.session(n_ctx, QType::F16, QType::F16).unwrap();
    let mut sb = e.session(n_ctx, QType::F16, QType::F16).unwrap();
    e.prefill(&mut sa, &a[..a_done], false).unwrap();
    e.prefill(&mut sb, &b[..b_done], false).unwrap();
    let mut scratch = e.scratch();
    let mut out = specula_engine::Readout::default();
    e.decode_multi(
        &mut [
            specula_engine::BatchEntry {
                session: &mut sa,
                tokens: &a[a_done..],
                logits_from: a_from,
                capture: None,
            },
            specula_engine::BatchEntry {
                session: &mut sb,
                tokens: &b[b_done..],
                logits_from: b_from,
                capture: None,
            },
        ],
        &mut scratch,
        &mut out,
    )
    .unwrap();
    (out.logits, [sa.n_past(), sb.n_past()])
}

/// Several sessions in one batch (`decode_multi`, the server's continuous batching): a
/// session 30 positions in running a 3-token verify-like block next to one 14 positions in
/// running one token, each row with the bits it has alone.
#[test]
fn batched_sessions_each_mask_their_own_window() {
    let mut e = engine(tiny_gemma(3, WINDOW));
    let (a, b) = (prompt(33), prompt(15));
    let one_a = prefill_all(&mut e, &a, 512);
    let one_b = prefill_all(&mut e, &b, 512);
    let (out, _) = two_in_one_batch(&e, 64, (&a, 30, 0), (&b, 14, 0));
    let want: Vec<f32> = one_a[30 * N_VOCAB..]
        .iter()
        .chain(&one_b[14 * N_VOCAB..])
        .copied()
        .collect();
    assert_eq!(bits(&out), bits(&want));
}

/// The window is exactly `WINDOW` positions, the query's own included: against the same
/// weights without a window, positions `0..WINDOW` (which see every earlier key either way)
/// have the same bits, and every position from `WINDOW` on differs.
#[test]
fn the_window_hides_exactly_the_keys_window_or_more_positions_back() {
    let ids = prompt(24);
    let with = prefill_all(&mut engine(tiny_gemma(3, WINDOW)), &ids, 512);
    let without = prefill_all(&mut engine(tiny_gemma(3, 0)), &ids, 512);
    let rows = |v: &[f32]| -> Vec<Vec<u32>> { v.chunks_exact(N_VOCAB).map(bits).collect() };
    let (a, b) = (rows(&with), rows(&without));
    for p in 0..ids.len() {
        if p < WINDOW {
            assert_eq!(a[p], b[p], "position {p} sees every key either way");
        } else {
            assert_ne!(
                a[p],
                b[p],
                "position {p} must not see position {}",
                p - WINDOW
            );
        }
    }
}

/// Drafts `truth` (the plain output) with the token at draft position `round % (k + 1)`
/// changed, so most rounds are rejected part-way.
struct Wrong {
    truth: Vec<u32>,
    n_prompt: usize,
    round: usize,
}

impl Drafter for Wrong {
    fn name(&self) -> &'static str {
        "wrong"
    }
    fn begin(&mut self, _prompt: &[u32]) -> Result<(), SpecError> {
        self.round = 0;
        Ok(())
    }
    fn draft(&mut self, p: &DraftParams<'_>) -> Result<Vec<u32>, SpecError> {
        self.round += 1;
        let at = p.history.len() - self.n_prompt;
        let mut v: Vec<u32> = self.truth.iter().skip(at).take(p.n_max).copied().collect();
        let k = p.n_max;
        if let Some(x) = v.get_mut(self.round % (k + 1)) {
            *x = (*x + 1) % 256;
        }
        Ok(v)
    }
    fn state(&self) -> DrafterState {
        Box::new(self.round)
    }
    fn restore(&mut self, s: &DrafterState) -> Result<(), SpecError> {
        self.round = *s
            .downcast_ref::<usize>()
            .ok_or(SpecError::ForeignState("wrong"))?;
        Ok(())
    }
}

#[test]
fn speculative_verify_batches_past_the_window_are_lossless() {
    let e = engine(tiny_gemma(3, WINDOW));
    let ids = prompt(12);
    let n = 40;
    let opts = GenerateOptions {
        n_predict: n,
        sampler: SamplerParams::greedy(),
        force_ids: None,
        top_logits: 8,
        stop_at_eog: false,
    };
    let n_ctx = ids.len() + n;
    let mut s = e.session(n_ctx, QType::F16, QType::F16).unwrap();
    let plain = e.generate(&mut s, &ids, &opts, |_| {}).unwrap();
    let want = plain.generated_ids.clone();
    // The top-8 logits of every step, bits and all: a verify row must be the decode row.
    let top = |g: &specula_engine::Generation| -> Vec<Vec<(u32, u32)>> {
        g.top_logits
            .iter()
            .map(|r| r.iter().map(|&(t, l)| (t, l.to_bits())).collect())
            .collect()
    };
    let want_top = top(&plain);
    assert_eq!(want_top.len(), n);
    let spec = SpecOptions {
        n_max: 5,
        n_min: 0,
        p_min: 0.0,
        adaptive: false,
    };
    for replay in [false, true] {
        let mut d = Wrong {
            truth: want.clone(),
            n_prompt: ids.len(),
            round: 0,
        };
        let mut s = e.session(n_ctx, QType::F16, QType::F16).unwrap();
        if replay {
            s.force_replay();
        }
        let got = e
            .generate_speculative(&mut s, &ids, &opts, &mut d, &spec, |_| {})
            .unwrap();
        assert_eq!(got.generated_ids, want, "replay {replay}");
        assert_eq!(top(&got), want_top, "replay {replay}");
        let st = got.spec.unwrap();
        assert!(st.accepted > 0 && st.accepted < st.drafted, "{st:?}");
        if replay {
            assert!(st.replays > 0, "{st:?}");
        }

        // Another tiny gemma3 as the draft model, its own cache past the window too.
        let mut dm = DraftModel::new(
            engine(tiny_gemma(77, WINDOW)),
            &e.tokenizer,
            n_ctx,
            QType::F16,
            QType::F16,
        )
        .unwrap();
        if replay {
            dm.force_replay();
        }
        let mut s = e.session(n_ctx, QType::F16, QType::F16).unwrap();
        if replay {
            s.force_replay();
        }
        let got = e
            .generate_speculative(&mut s, &ids, &opts, &mut dm, &spec, |_| {})
            .unwrap();
        assert_eq!(got.generated_ids, want, "draft model, replay {replay}");
        assert_eq!(top(&got), want_top, "draft model, replay {replay}");
    }
}

// The sliding-window ring: with `n_batch` 4 the sliding layers of a 64-cell session keep a
// ring of `WINDOW + 4` = 12 cells (llama.cpp's SWA cache), the global layer 64.

const RING_BATCH: usize = 4;
const RING: usize = WINDOW + RING_BATCH;
const CTX: usize = 64;

/// An engine whose sessions keep a ring of `RING` cells (or full-size sliding layers).
fn ring_engine(seed: u64, swa_full: bool) -> Engine<CpuBackend> {
    let mut e = engine(tiny_gemma(seed, WINDOW));
    e.n_batch = RING_BATCH;
    e.swa_full = swa_full;
    e
}

/// The logits of every position of `ids` from one prefill into a fresh session of `e`, run in
/// forwards of at most `n_batch` rows (the session's ring is sized by `e.n_batch` when made).
fn ring_prefill(e: &mut Engine<CpuBackend>, ids: &[u32], n_batch: usize) -> Vec<f32> {
    let mut s = e.session(CTX, QType::F16, QType::F16).unwrap();
    let made = e.n_batch;
    e.n_batch = n_batch;
    let out = e.prefill(&mut s, ids, true).unwrap();
    e.n_batch = made;
    out
}

#[test]
fn sessions_keep_a_ring_of_window_plus_batch_cells_unless_swa_full() {
    let e = ring_engine(3, false);
    let s = e.session(CTX, QType::F16, QType::F16).unwrap();
    assert_eq!(s.swa_ring(), Some(RING));
    assert_eq!(s.max_rows(), RING_BATCH);
    // f16 heads of 32 values: 64 bytes; 2 K/V heads, K and V: 256 bytes a cell and layer.
    let cell = 2 * 2 * 64;
    assert_eq!(s.kv_layout().total_bytes(), cell * (RING + RING + CTX));
    assert_eq!(s.kv_bytes_used(), 0);
    let full = ring_engine(3, true);
    let f = full.session(CTX, QType::F16, QType::F16).unwrap();
    assert_eq!(f.swa_ring(), None);
    assert_eq!(f.kv_layout().total_bytes(), cell * 3 * CTX);
    // A ring at least the context is no ring.
    assert_eq!(
        e.session(RING, QType::F16, QType::F16).unwrap().swa_ring(),
        None
    );
    // Positions held: every layer up to its cells.
    let mut s = s;
    let mut e = e;
    e.prefill(&mut s, &prompt(30), false).unwrap();
    assert_eq!(s.kv_bytes_used(), cell * (RING + RING + 30));
    e.n_batch = 512;
    assert_eq!(e.swa_ring(), Some(WINDOW + 512));
}

/// Within one ring, every way of running rows gives the same bits: a query sees the same
/// positions in the same ring cells whatever forward wrote them.
#[test]
fn ring_prefill_chunks_decodes_and_batches_have_the_same_bits() {
    let mut e = ring_engine(3, false);
    let ids = prompt(40);
    let one = ring_prefill(&mut e, &ids, RING_BATCH);
    for n_batch in [1, 2, 3] {
        assert_eq!(
            bits(&ring_prefill(&mut e, &ids, n_batch)),
            bits(&one),
            "forwards of {n_batch} rows"
        );
    }
    let mut s = e.session(CTX, QType::F16, QType::F16).unwrap();
    let mut got = e.prefill(&mut s, &ids[..11], true).unwrap();
    for &t in &ids[11..] {
        got.extend(e.decode(&mut s, t).unwrap());
    }
    assert_eq!(bits(&got), bits(&one), "decode");

    // Two sessions in one batch, one with 9 rows: more than a forward may write into its
    // ring, so the batch is split (1 + 4 + 4 rows, aligned to the end); each row keeps its bits.
    let (a, b) = (prompt(33), &ids[..15]);
    let one_a = ring_prefill(&mut e, &a, RING_BATCH);
    let (out, n_past) = two_in_one_batch(&e, CTX, (&a, 24, 2), (b, 14, 0));
    let want: Vec<f32> = one_a[26 * N_VOCAB..]
        .iter()
        .chain(&one[14 * N_VOCAB..15 * N_VOCAB])
        .copied()
        .collect();
    assert_eq!(bits(&out), bits(&want));
    assert_eq!(n_past, [33, 15]);

    // The split batch capturing the first session's taps, on the host and into a backend
    // tensor (the pieces put into their rows there): the same rows, the same bits.
    let captured = |device: bool| {
        let mut sa = e.session(CTX, QType::F16, QType::F16).unwrap();
        let mut sb = e.session(CTX, QType::F16, QType::F16).unwrap();
        e.prefill(&mut sa, &a[..24], false).unwrap();
        e.prefill(&mut sb, &b[..14], false).unwrap();
        let mut taps = specula_models::Taps {
            layers: vec![1, 3],
            rows: Vec::new(),
        };
        let mut host = Vec::new();
        let mut dev = e.backend.zeros(0, 0);
        let mut scratch = e.scratch();
        let mut out = specula_engine::Readout::default();
        e.decode_multi(
            &mut [
                specula_engine::BatchEntry {
                    session: &mut sa,
                    tokens: &a[24..],
                    logits_from: 2,
                    capture: Some(specula_engine::Capture {
                        taps: &mut taps,
                        features: &mut host,
                        device: device.then_some(&mut dev),
                    }),
                },
                specula_engine::BatchEntry {
                    session: &mut sb,
                    tokens: &b[14..],
                    logits_from: 0,
                    capture: None,
                },
            ],
            &mut scratch,
            &mut out,
        )
        .unwrap();
        if device {
            assert!(host.is_empty());
            e.backend.to_host(&dev, &mut host);
        }
        (out.logits, host)
    };
    let (on_host, on_device) = (captured(false), captured(true));
    assert_eq!(bits(&on_host.0), bits(&want), "logits with a capture");
    assert_eq!(on_host.1.len(), 9 * 2 * e.model.hparams().n_embd);
    assert_eq!(
        bits(&on_device.1),
        bits(&on_host.1),
        "features of a split batch"
    );
}

/// The ring and a full-size cache hold the same keys, and the attention visits the ring in
/// position order (entry `p` of its `kv_pos` is cell `p % ring`), so the logits have the same
/// bits at every position, past the wrap too.
#[test]
fn ring_and_full_cache_logits_have_the_same_bits() {
    let ids = prompt(40);
    let ring = ring_prefill(&mut ring_engine(3, false), &ids, RING_BATCH);
    let full = ring_prefill(&mut ring_engine(3, true), &ids, RING_BATCH);
    assert_eq!(bits(&ring), bits(&full));
}

/// A trim to `n` is exact while the ring still holds `n − WINDOW + 1 .. n`: with `m` the
/// highest position written, when `m − n ≤ RING − WINDOW` (or `n` is 0). At the last exact point the trim
/// continues as a fresh prefill would; one past it `can_trim_to` says no, and a rewind runs
/// the positions again from where the ring still holds a window (here: the start).
#[test]
fn trims_are_exact_exactly_while_the_ring_holds_the_window() {
    let mut e = ring_engine(3, false);
    let ids = prompt(40);
    let fresh = ring_prefill(&mut e, &ids, RING_BATCH);
    let m = 29;
    let mut s = e.session(CTX, QType::F16, QType::F16).unwrap();
    e.prefill(&mut s, &ids[..=m], false).unwrap();
    for n in 0..=m + 1 {
        assert_eq!(
            s.can_trim_to(n),
            // Position 0 sees nothing before it: emptying the cache is always exact.
            n > m || n == 0 || m - n <= RING - WINDOW,
            "trim of {} positions to {n}",
            m + 1
        );
    }
    let edge = m - (RING - WINDOW);
    assert!(s.can_trim_to(edge) && !s.can_trim_to(edge - 1));

    // At the edge: trim, then decode — the bits of the fresh prefill.
    let mut t = e.session(CTX, QType::F16, QType::F16).unwrap();
    e.prefill(&mut t, &ids[..=m], false).unwrap();
    assert_eq!(
        e.rewind(&mut t, edge, None, &[]).unwrap(),
        specula_engine::Rewound::Trimmed
    );
    let mut got = Vec::new();
    for &id in &ids[edge..] {
        got.extend(e.decode(&mut t, id).unwrap());
    }
    assert_eq!(bits(&got), bits(&fresh[edge * N_VOCAB..]), "trim to {edge}");

    // One past the edge: a tail that does not reach a held window is refused with a typed
    // error (nothing changed), the whole history replays from the start.
    let n = edge - 1;
    let err = e.rewind(&mut s, n, None, &ids[n - 4..n]).unwrap_err();
    assert!(
        matches!(err, specula_engine::EngineError::Rewind { from: 0, .. }),
        "{err}"
    );
    assert_eq!(s.n_past(), m + 1);
    assert_eq!(
        e.rewind(&mut s, n, None, &ids[..n]).unwrap(),
        specula_engine::Rewound::Replayed(n)
    );
    let mut got = Vec::new();
    for &id in &ids[n..] {
        got.extend(e.decode(&mut s, id).unwrap());
    }
    assert_eq!(bits(&got), bits(&fresh[n * N_VOCAB..]), "rewind to {n}");

    // A checkpoint whose window the ring has since overwritten cannot be restored.
    let mut c = e.session(CTX, QType::F16, QType::F16).unwrap();
    e.prefill(&mut c, &ids[..20], false).unwrap();
    let ck = c.checkpoint();
    e.prefill(&mut c, &ids[20..30], false).unwrap();
    assert!(matches!(
        c.restore(&ck),
        Err(specula_engine::EngineError::StaleCheckpoint { .. })
    ));
}

/// Speculative decoding on the ring: greedy output, and the top-8 logits by bits, are plain
/// decoding's on the same ring, for drafts that fit one forward (every rejected tail is a
/// trim) and drafts longer than a forward may write (verify batches split; a rejection past
/// the last forward runs positions again), with a scripted drafter and a draft model (its
/// own ring), rolling back by trim or forced replay.
#[test]
fn speculative_decoding_on_the_ring_is_lossless() {
    let e = ring_engine(3, false);
    let ids = prompt(12);
    let n = 40;
    let opts = GenerateOptions {
        n_predict: n,
        sampler: SamplerParams::greedy(),
        force_ids: None,
        top_logits: 8,
        stop_at_eog: false,
    };
    let n_ctx = ids.len() + n;
    let mut s = e.session(n_ctx, QType::F16, QType::F16).unwrap();
    assert_eq!(s.swa_ring(), Some(RING));
    let plain = e.generate(&mut s, &ids, &opts, |_| {}).unwrap();
    let want = plain.generated_ids.clone();
    let top = |g: &specula_engine::Generation| -> Vec<Vec<(u32, u32)>> {
        g.top_logits
            .iter()
            .map(|r| r.iter().map(|&(t, l)| (t, l.to_bits())).collect())
            .collect()
    };
    let want_top = top(&plain);
    for n_max in [3, 9] {
        let spec = SpecOptions {
            n_max,
            n_min: 0,
            p_min: 0.0,
            adaptive: false,
        };
        for replay in [false, true] {
            let mut d = Wrong {
                truth: want.clone(),
                n_prompt: ids.len(),
                round: 0,
            };
            let mut s = e.session(n_ctx, QType::F16, QType::F16).unwrap();
            if replay {
                s.force_replay();
            }
            let got = e
                .generate_speculative(&mut s, &ids, &opts, &mut d, &spec, |_| {})
                .unwrap();
            let what = format!("n_max {n_max}, replay {replay}");
            assert_eq!(got.generated_ids, want, "{what}");
            assert_eq!(top(&got), want_top, "{what}");
            let st = got.spec.unwrap();
            assert!(
                st.accepted > 0 && st.accepted < st.drafted,
                "{what}: {st:?}"
            );
            if !replay {
                // Anchor + 3 drafts fit one forward: every rejected tail is a trim. Anchor + 9
                // drafts do not: rejections early in the draft run positions again.
                assert_eq!(st.replays > 0, n_max > RING_BATCH, "{what}: {st:?}");
            }

            let mut dm = DraftModel::new(
                ring_engine(77, false),
                &e.tokenizer,
                n_ctx,
                QType::F16,
                QType::F16,
            )
            .unwrap();
            if replay {
                dm.force_replay();
            }
            let mut s = e.session(n_ctx, QType::F16, QType::F16).unwrap();
            if replay {
                s.force_replay();
            }
            let got = e
                .generate_speculative(&mut s, &ids, &opts, &mut dm, &spec, |_| {})
                .unwrap();
            assert_eq!(got.generated_ids, want, "draft model, {what}");
            assert_eq!(top(&got), want_top, "draft model, {what}");
        }
    }
    // The ring's output is the full cache's, here token for token.
    let full = ring_engine(3, true);
    let mut f = full.session(n_ctx, QType::F16, QType::F16).unwrap();
    assert_eq!(
        full.generate(&mut f, &ids, &opts, |_| {})
            .unwrap()
            .generated_ids,
        want
    );
}

/// A ring over several key tiles and chunks of the attention kernel (window 300, ring 316,
/// 900 positions, in forwards of 16 rows and of one): the bits of the full cache.
#[test]
fn a_ring_of_many_tiles_has_the_bits_of_the_full_cache() {
    let ids: Vec<u32> = (0..900u64)
        .map(|i| u32::try_from(splitmix64(i ^ 0x5eed) % N_VOCAB as u64).unwrap())
        .collect();
    let run = |full: bool, n_batch: usize| {
        let mut e = engine(tiny_gemma(3, 300));
        e.n_batch = 16;
        e.swa_full = full;
        let mut s = e.session(900, QType::F16, QType::F16).unwrap();
        assert_eq!(s.swa_ring(), (!full).then_some(316));
        e.n_batch = n_batch;
        e.prefill(&mut s, &ids, true).unwrap()
    };
    let full = bits(&run(true, 16));
    assert_eq!(bits(&run(false, 16)), full);
    assert_eq!(bits(&run(false, 1)), full);
}

/// The logits of every position of `ids` prefilled into `s`, in forwards of at most `n_batch`
/// rows.
fn prefill_in(
    e: &mut Engine<CpuBackend>,
    s: &mut specula_engine::Session<CpuBackend>,
    ids: &[u32],
    n_batch: usize,
) -> Vec<f32> {
    let made = e.n_batch;
    e.n_batch = n_batch;
    let out = e.prefill(s, ids, true).unwrap();
    e.n_batch = made;
    out
}

/// Quantized caches (issue 14, item 3): a session's quantized planes get their per-head
/// offsets when the session is made, from the engine's calibration text, never from the rows
/// a request writes first. So a sequence's logits have the same bits whatever the session ran
/// before (emptied, or rewound to a shared prefix that is not a whole chunk), however its rows
/// are chunked, on the ring and on a full cache. Before, the offsets were the mean of the
/// first forward's rows: a chunk of one row and a chunk of eight gave different logits, and a
/// reused session kept the offsets of the first sequence it ever ran.
#[test]
fn quantized_cache_logits_do_not_depend_on_history_or_chunking() {
    use QType::{IQ4_NL, Q4_0, Q4_1, Q8_0, Turbo3, Turbo4};
    let ids = prompt(40);
    let other: Vec<u32> = prompt(50).iter().map(|&t| (t * 7 + 3) % 256).collect();
    for swa_full in [false, true] {
        let mut e = ring_engine(3, swa_full);
        for (k, v) in [
            (Q8_0, Q8_0),
            (Q4_0, Q4_1),
            (Turbo3, Turbo3),
            (IQ4_NL, Turbo4),
        ] {
            let what = format!("-ctk {k} -ctv {v}, swa_full {swa_full}");
            let mut fresh = e.session(CTX, k, v).unwrap();
            let want = prefill_in(&mut e, &mut fresh, &ids, RING_BATCH);
            for n_batch in [1, 3] {
                let mut s = e.session(CTX, k, v).unwrap();
                let got = prefill_in(&mut e, &mut s, &ids, n_batch);
                assert_eq!(
                    bits(&got),
                    bits(&want),
                    "{what}: forwards of {n_batch} rows"
                );
            }
            // A session that ran another sequence first, emptied.
            let mut s = e.session(CTX, k, v).unwrap();
            prefill_in(&mut e, &mut s, &other, 1);
            s.reset();
            let got = prefill_in(&mut e, &mut s, &ids, RING_BATCH);
            assert_eq!(bits(&got), bits(&want), "{what}: after another sequence");
            // A session holding the first 13 positions with another tail, taken back to them.
            let mut s = e.session(CTX, k, v).unwrap();
            let head: Vec<u32> = ids[..13].iter().chain(&other[..20]).copied().collect();
            prefill_in(&mut e, &mut s, &head, 1);
            e.rewind(&mut s, 13, None, &ids[..13]).unwrap();
            let got = prefill_in(&mut e, &mut s, &ids[13..], 3);
            assert_eq!(
                bits(&got),
                bits(&want[13 * N_VOCAB..]),
                "{what}: after a rewind to a shared prefix"
            );
        }
    }
}
