//! DFlash as a drafter, on tiny random models built here.
//!
//! - Lossless: greedy speculative output with a random DFlash or DFlash2 drafter equals plain
//!   greedy output, for eager and deferred injection, any block size, draft length, `p_min`,
//!   taps, and for a one-token prompt (nothing prefilled; EAGLE-3 too).
//! - KV injection equivalence: every draft the drafter makes during a generation (its cache
//!   grown round by round, rejected rows rolled back) is the draft a fresh drafter makes from
//!   the committed history's features injected at once.
//! - Tap convention: with a synthetic target whose layer `l` adds the constant `10·(l+1)` to
//!   every hidden value, the features a drafter asking for taps `[3, 1, 2]` receives are
//!   `[60, 10, 30]` (the outputs of HF layers 2, 0, 1; tap 3 = the 3-layer target's pre-norm
//!   state), side by side in that order.
//! - Per-tensor scales (NVFP4 exports): a `.scale` of 2⁻¹ on every matmul gives exactly the
//!   logits of weights pre-multiplied by 2⁻¹, and dropping one scale (V — in the injection and
//!   block paths —, O, gate, up, down; those of `fc`, Q and K are divided out by the RMSNorm
//!   after them) changes them (llama.cpp
//!   PR #28000: Q/K/V/O scales were skipped and NVFP4 drafts accepted almost nothing).
//! - Loader: unknown variants are refused by name; `n_max` is clamped to `block_size − 1`.
//! - EAGLE-3: greedy speculative output with a random head (own reduced-vocabulary head with
//!   `d2t`, or the target's) equals plain greedy output, and every chain equals a fresh head's
//!   from the committed history at once.

use std::sync::Arc;

use proptest::prelude::*;
use specula_cpu::CpuBackend;
use specula_engine::{
    DflashDrafter, Eagle3Drafter, Engine, GenerateOptions, Injection, SpecOptions,
};
use specula_gguf::{Array, GgmlType, Gguf, GgufWriter, Value};
use specula_models::Model;
use specula_quant::QType;
use specula_spec::{DraftParams, Drafter, DrafterState, SpecError};
use specula_testkit::{byte_symbols, values};
use specula_tokenizer::Tokenizer;

const N_VOCAB: usize = 256;
const E: usize = 64;
const N_FF: usize = 128;
const N_HEAD: usize = 4;
const N_HEAD_KV: usize = 2;
const HD: usize = 16;
const MASK: u32 = 255;

fn u(v: usize) -> Value {
    Value::U32(u32::try_from(v).unwrap())
}

/// A tensor: name, type, ggml dims, values.
type T = (String, QType, Vec<usize>, Vec<f32>);

fn write(md: Vec<(String, Value)>, tensors: &[T]) -> Vec<u8> {
    let mut w = GgufWriter::new();
    for (k, v) in md {
        w.add(k, v).unwrap();
    }
    let mut data = Vec::new();
    for (name, ty, dims, x) in tensors {
        let d: Vec<u64> = dims.iter().map(|&d| d as u64).collect();
        w.add_tensor(
            name.as_str(),
            GgmlType::from_id(ty.ggml_id().unwrap()).unwrap(),
            &d,
        )
        .unwrap();
        let rb = ty.row_bytes(dims[0]).unwrap();
        let rows = x.len() / dims[0];
        let mut bytes = vec![0u8; rb * rows];
        for (row, b) in x.chunks_exact(dims[0]).zip(bytes.chunks_exact_mut(rb)) {
            specula_quant::quantize_row(*ty, row, b).unwrap();
        }
        data.push(bytes);
    }
    let refs: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
    w.to_vec(&refs).unwrap()
}

fn arch_md(arch: &str, n_layer: usize) -> Vec<(String, Value)> {
    let k = |s: &str| format!("{arch}.{s}");
    vec![
        ("general.architecture".into(), Value::String(arch.into())),
        (k("block_count"), u(n_layer)),
        (k("context_length"), u(512)),
        (k("embedding_length"), u(E)),
        (k("feed_forward_length"), u(N_FF)),
        (k("attention.head_count"), u(N_HEAD)),
        (k("attention.head_count_kv"), u(N_HEAD_KV)),
        (k("rope.freq_base"), Value::F32(10_000.0)),
        (k("attention.layer_norm_rms_epsilon"), Value::F32(1e-5)),
        (k("attention.key_length"), u(HD)),
        (k("attention.value_length"), u(HD)),
    ]
}

fn tokenizer_md() -> Vec<(String, Value)> {
    vec![
        ("tokenizer.ggml.model".into(), Value::String("gpt2".into())),
        ("tokenizer.ggml.pre".into(), Value::String("default".into())),
        (
            "tokenizer.ggml.tokens".into(),
            Value::Array(Array::String(byte_symbols())),
        ),
        (
            "tokenizer.ggml.token_type".into(),
            Value::Array(Array::I32(vec![1; N_VOCAB])),
        ),
        (
            "tokenizer.ggml.merges".into(),
            Value::Array(Array::String(vec!["a b".into()])),
        ),
        ("tokenizer.ggml.bos_token_id".into(), Value::U32(1)),
        ("tokenizer.ggml.eos_token_id".into(), Value::U32(0)),
        ("tokenizer.ggml.add_bos_token".into(), Value::Bool(false)),
    ]
}

fn vec_t(name: String, x: Vec<f32>) -> T {
    let n = x.len();
    (name, QType::F32, vec![n], x)
}

fn mat(name: String, ty: QType, n_in: usize, n_out: usize, x: Vec<f32>) -> T {
    (name, ty, vec![n_in, n_out], x)
}

/// A tiny random llama target (2 layers, quantized matrices).
fn target(seed: u64) -> Vec<u8> {
    let mut md = arch_md("llama", 2);
    md.extend(tokenizer_md());
    let (q, kv) = (N_HEAD * HD, N_HEAD_KV * HD);
    let mut i = seed * 100;
    let mut r = |n: usize, s: f32| {
        i += 1;
        values(i, n, s)
    };
    let mut t = vec![
        mat(
            "token_embd.weight".into(),
            QType::Q8_0,
            E,
            N_VOCAB,
            r(E * N_VOCAB, 0.6),
        ),
        vec_t(
            "output_norm.weight".into(),
            r(E, 0.2).iter().map(|v| 1.0 + v).collect(),
        ),
        mat(
            "output.weight".into(),
            QType::Q8_0,
            E,
            N_VOCAB,
            r(E * N_VOCAB, 0.6),
        ),
    ];
    for l in 0..2 {
        let n = |s: &str| format!("blk.{l}.{s}");
        t.extend([
            vec_t(
                n("attn_norm.weight"),
                r(E, 0.2).iter().map(|v| 1.0 + v).collect(),
            ),
            vec_t(
                n("ffn_norm.weight"),
                r(E, 0.2).iter().map(|v| 1.0 + v).collect(),
            ),
            mat(n("attn_q.weight"), QType::Q8_0, E, q, r(E * q, 0.6)),
            mat(n("attn_k.weight"), QType::Q4_0, E, kv, r(E * kv, 0.6)),
            mat(n("attn_v.weight"), QType::Q8_0, E, kv, r(E * kv, 0.6)),
            mat(n("attn_output.weight"), QType::Q4_0, q, E, r(q * E, 0.6)),
            mat(n("ffn_gate.weight"), QType::Q4_0, E, N_FF, r(E * N_FF, 0.6)),
            mat(n("ffn_up.weight"), QType::Q8_0, E, N_FF, r(E * N_FF, 0.6)),
            mat(n("ffn_down.weight"), QType::Q4_0, N_FF, E, r(N_FF * E, 0.6)),
        ]);
    }
    write(md, &t)
}

/// How to build a random DFlash draft.
#[derive(Clone)]
struct DraftSpec {
    seed: u64,
    taps: Vec<i32>,
    block: usize,
    /// Per-tensor scale written as `<name>.scale` for every matmul, and the factor the
    /// weights are pre-multiplied by.
    scale: Option<f32>,
    premultiply: f32,
    /// A matmul whose `.scale` is left out.
    drop_scale: Option<&'static str>,
    /// Extra metadata / tensors (variants to refuse).
    extra_md: Vec<(String, Value)>,
    extra_tensors: Vec<T>,
    old_keys: bool,
    /// Zero `W_o` and `ffn_down`: every block row keeps its embedding.
    silent: bool,
    /// Format of the matrices.
    qtype: QType,
    /// A DFlash2 draft (convolutions and the candidate selector).
    dflash2: bool,
}

impl DraftSpec {
    fn new(seed: u64, taps: &[i32], block: usize) -> Self {
        Self {
            seed,
            taps: taps.to_vec(),
            block,
            scale: None,
            premultiply: 1.0,
            drop_scale: None,
            extra_md: Vec::new(),
            extra_tensors: Vec::new(),
            old_keys: false,
            silent: false,
            qtype: QType::F32,
            dflash2: false,
        }
    }
}

fn draft(spec: &DraftSpec) -> Vec<u8> {
    let mut md = arch_md("dflash", 2);
    md.retain(|(k, _)| k != "dflash.rope.freq_base");
    md.push(("dflash.rope.freq_base".into(), Value::F32(1e6)));
    md.push(("dflash.block_size".into(), u(spec.block)));
    let (taps_key, mask_key) = if spec.old_keys {
        ("dflash.target_layer_ids", "dflash.mask_token_id")
    } else {
        ("dflash.target_layers", "tokenizer.ggml.mask_token_id")
    };
    md.push((taps_key.into(), Value::Array(Array::I32(spec.taps.clone()))));
    md.push((mask_key.into(), Value::U32(MASK)));
    md.extend(spec.extra_md.iter().cloned());
    let (q, kv) = (N_HEAD * HD, N_HEAD_KV * HD);
    let mut i = spec.seed * 100;
    let pm = spec.premultiply;
    let mut r = |n: usize, s: f32| {
        i += 1;
        values(i, n, s)
    };
    let norm = |x: Vec<f32>| x.iter().map(|v| 1.0 + v).collect::<Vec<f32>>();
    let nf = spec.taps.len() * E;
    let qt = spec.qtype;
    let mut mats: Vec<T> = vec![mat("fc.weight".into(), qt, nf, E, r(nf * E, 0.3))];
    let mut t = vec![
        vec_t("enc.output_norm.weight".into(), norm(r(E, 0.2))),
        vec_t("output_norm.weight".into(), norm(r(E, 0.2))),
    ];
    for l in 0..2 {
        let n = |s: &str| format!("blk.{l}.{s}");
        t.extend([
            vec_t(n("attn_norm.weight"), norm(r(E, 0.2))),
            vec_t(n("ffn_norm.weight"), norm(r(E, 0.2))),
            vec_t(n("attn_q_norm.weight"), norm(r(HD, 0.2))),
            vec_t(n("attn_k_norm.weight"), norm(r(HD, 0.2))),
        ]);
        mats.extend([
            mat(n("attn_q.weight"), qt, E, q, r(E * q, 0.6)),
            mat(n("attn_k.weight"), qt, E, kv, r(E * kv, 0.6)),
            mat(n("attn_v.weight"), qt, E, kv, r(E * kv, 0.6)),
            mat(n("attn_output.weight"), qt, q, E, r(q * E, 0.6)),
            mat(n("ffn_gate.weight"), qt, E, N_FF, r(E * N_FF, 0.6)),
            mat(n("ffn_up.weight"), qt, E, N_FF, r(E * N_FF, 0.6)),
            mat(n("ffn_down.weight"), qt, N_FF, E, r(N_FF * E, 0.6)),
        ]);
    }
    for m in &mut mats {
        let zero = spec.silent && (m.0.contains("attn_output") || m.0.contains("ffn_down"));
        for v in &mut m.3 {
            *v = if zero { 0.0 } else { *v * pm };
        }
        if let Some(s) = spec.scale {
            let base = m.0.trim_end_matches(".weight").to_owned();
            if spec.drop_scale != Some(base.as_str()) {
                t.push(vec_t(format!("{base}.scale"), vec![s]));
            }
        }
    }
    t.extend(mats);
    if spec.dflash2 {
        let (kernel, group, rank) = (2usize, 16usize, 8usize);
        let proj = 2 * kernel * (E / group);
        for l in 0..2 {
            for c in ["attn", "ffn"] {
                t.push((
                    format!("blk.{l}.{c}_conv_base"),
                    QType::F32,
                    vec![E, kernel, 2],
                    r(E * kernel * 2, 0.5),
                ));
                t.push(mat(
                    format!("blk.{l}.{c}_conv_proj.weight"),
                    QType::F32,
                    E,
                    proj,
                    r(E * proj, 0.3),
                ));
            }
        }
        t.push(mat(
            "selector_hidden.weight".into(),
            QType::F32,
            E,
            rank,
            r(E * rank, 0.5),
        ));
        t.push(mat(
            "selector_predecessor.weight".into(),
            QType::F32,
            rank,
            N_VOCAB,
            r(rank * N_VOCAB, 1.0),
        ));
        t.push(mat(
            "selector_successor.weight".into(),
            QType::F32,
            rank,
            N_VOCAB,
            r(rank * N_VOCAB, 1.0),
        ));
        md.extend([
            ("dflash.conv_kernel_size".into(), u(kernel)),
            ("dflash.conv_group_size".into(), u(group)),
            ("dflash.selector_rank".into(), u(rank)),
            ("dflash.selector_top_k".into(), u(4)),
        ]);
    }
    t.extend(spec.extra_tensors.iter().cloned());
    write(md, &t)
}

fn engine(bytes: Vec<u8>) -> Engine<CpuBackend> {
    let file = Arc::new(Gguf::from_bytes(bytes).unwrap());
    let tokenizer = Tokenizer::from_gguf(&file).unwrap();
    let be = CpuBackend::new(1);
    let model = Model::load(&be, file).unwrap();
    Engine::new(be, model, tokenizer)
}

fn drafter(
    e: &Engine<CpuBackend>,
    spec: &DraftSpec,
    policy: Injection,
) -> Result<DflashDrafter<CpuBackend>, specula_engine::EngineError> {
    DflashDrafter::new(
        Arc::clone(&e.backend),
        Arc::new(Gguf::from_bytes(draft(spec)).unwrap()),
        e,
        256,
        QType::F32,
        QType::F32,
        policy,
    )
}

fn greedy(n: usize) -> GenerateOptions {
    GenerateOptions::greedy(n)
}

const PROMPT: &[u32] = &[72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100];

/// Records every draft the inner drafter makes, with the history it was asked for, and the
/// draft context it held when asked.
struct Recording {
    inner: DflashDrafter<CpuBackend>,
    log: Vec<(Vec<u32>, usize, Vec<u32>)>,
    context_at_draft: Vec<(usize, usize)>,
    /// The context's first position after each draft, and the window it was asked with.
    starts: Vec<(usize, Option<usize>)>,
}

impl Recording {
    fn new(inner: DflashDrafter<CpuBackend>) -> Self {
        Self {
            inner,
            log: Vec::new(),
            context_at_draft: Vec::new(),
            starts: Vec::new(),
        }
    }
}

impl Drafter for Recording {
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn target_taps(&self) -> &[usize] {
        self.inner.target_taps()
    }
    fn begin(&mut self, prompt: &[u32]) -> Result<(), SpecError> {
        self.inner.begin(prompt)
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
    fn draft(&mut self, p: &DraftParams<'_>) -> Result<Vec<u32>, SpecError> {
        self.context_at_draft
            .push((self.inner.context_len(), p.history.len() - 1));
        let d = self.inner.draft(p)?;
        self.log.push((p.history.to_vec(), p.n_max, d.clone()));
        self.starts.push((self.inner.context_start(), p.window));
        Ok(d)
    }
    fn accept(&mut self, n: usize) {
        self.inner.accept(n);
    }
    fn state(&self) -> DrafterState {
        self.inner.state()
    }
    fn restore(&mut self, s: &DrafterState) -> Result<(), SpecError> {
        self.inner.restore(s)
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, ..ProptestConfig::default() })]

    #[test]
    fn dflash_speculation_is_lossless_and_injection_is_incremental(
        seed in 1u64..1000,
        deferred in any::<bool>(),
        block in 2usize..=16,
        n_max in 1usize..=16,
        adaptive in any::<bool>(),
        p_min in prop::sample::select(vec![0.0f32, 0.5]),
        taps in prop::sample::select(vec![vec![1], vec![2, 0], vec![0, 1, 2]]),
        dflash2 in any::<bool>(),
    ) {
        let e = engine(target(7));
        let n = 24;
        let opts = greedy(n);
        let n_ctx = PROMPT.len() + n;
        let mut s = e.session(n_ctx, QType::F16, QType::F16).unwrap();
        let want = e.generate(&mut s, PROMPT, &opts, |_| {}).unwrap().generated_ids;

        let policy = if deferred { Injection::Deferred } else { Injection::Eager };
        let mut spec = DraftSpec::new(seed, &taps, block);
        spec.dflash2 = dflash2;
        let mut d = Recording::new(drafter(&e, &spec, policy).unwrap());
        prop_assert_eq!(d.inner.net().is_dflash2(), dflash2);
        let so = SpecOptions { n_max, n_min: 0, p_min, adaptive };
        let mut s = e.session(n_ctx, QType::F16, QType::F16).unwrap();
        let got = e.generate_speculative(&mut s, PROMPT, &opts, &mut d, &so, |_| {}).unwrap();
        prop_assert_eq!(&got.generated_ids, &want);
        let st = got.spec.unwrap();
        prop_assert!(st.accepted <= st.drafted);
        prop_assert!(st.drafted <= st.rounds * (block - 1));
        check_context(&d, deferred);

        // Every draft equals a fresh drafter's from the committed history injected at once.
        for (history, k, drafted) in d.log.iter().take(6) {
            let committed = &history[..history.len() - 1];
            let mut fresh = drafter(&e, &spec, Injection::Eager).unwrap();
            let mut ts = e.session(n_ctx, QType::F16, QType::F16).unwrap();
            let mut taps_buf = specula_models::Taps { layers: fresh.target_taps().to_vec(), rows: Vec::new() };
            let (mut logits, mut feats) = (Vec::new(), Vec::new());
            e.prefill_with_features(&mut ts, committed, committed.len(), &mut logits, &mut taps_buf, &mut feats).unwrap();
            fresh.begin(history).unwrap();
            fresh.process_features(committed, 0, &feats).unwrap();
            let again = fresh.draft(&DraftParams { history, n_max: *k, p_min, window: None }).unwrap();
            prop_assert_eq!(&again, drafted, "draft at history length {}", history.len());
        }
    }
}

/// Between rounds the draft cache holds context for exactly the committed positions
/// (deferred); eager injection may hold rejected rows too, which the draft then forgets.
fn check_context(d: &Recording, deferred: bool) {
    for &(held, committed) in &d.context_at_draft {
        if deferred {
            assert_eq!(held, committed, "deferred: context at a draft");
        } else {
            assert!(
                held >= committed,
                "eager: context {held} < committed {committed}"
            );
        }
    }
}

/// A bigram target: zero layers, so the next token depends on the current one only. Every
/// token's embedding is `v` except token 5's (`w`); the head maps `v` to 5 and `w` to 6. Greedy
/// output alternates 5, 6, 5, 6…
fn bigram_target() -> Vec<u8> {
    let mut md = arch_md("llama", 1);
    md.extend(tokenizer_md());
    let (q, kv) = (N_HEAD * HD, N_HEAD_KV * HD);
    let z = |n: usize| vec![0.0f32; n];
    let (v, w) = (values(31, E, 1.0), values(32, E, 1.0));
    let mut embd = Vec::with_capacity(E * N_VOCAB);
    for t in 0..N_VOCAB {
        embd.extend_from_slice(if t == 5 { &w } else { &v });
    }
    let mut out = values(33, E * N_VOCAB, 0.05);
    out[5 * E..6 * E].copy_from_slice(&v);
    out[6 * E..7 * E].copy_from_slice(&w);
    let t = vec![
        mat("token_embd.weight".into(), QType::F32, E, N_VOCAB, embd),
        vec_t("output_norm.weight".into(), vec![1.0; E]),
        mat("output.weight".into(), QType::F32, E, N_VOCAB, out),
        vec_t("blk.0.attn_norm.weight".into(), vec![1.0; E]),
        vec_t("blk.0.ffn_norm.weight".into(), vec![1.0; E]),
        mat("blk.0.attn_q.weight".into(), QType::F32, E, q, z(E * q)),
        mat("blk.0.attn_k.weight".into(), QType::F32, E, kv, z(E * kv)),
        mat("blk.0.attn_v.weight".into(), QType::F32, E, kv, z(E * kv)),
        mat(
            "blk.0.attn_output.weight".into(),
            QType::F32,
            q,
            E,
            z(q * E),
        ),
        mat(
            "blk.0.ffn_gate.weight".into(),
            QType::F32,
            E,
            N_FF,
            z(E * N_FF),
        ),
        mat(
            "blk.0.ffn_up.weight".into(),
            QType::F32,
            E,
            N_FF,
            z(E * N_FF),
        ),
        mat(
            "blk.0.ffn_down.weight".into(),
            QType::F32,
            N_FF,
            E,
            z(N_FF * E),
        ),
    ];
    write(md, &t)
}

/// Partial acceptance: on the bigram target a silent drafter (block rows keep their
/// embedding, MASK's is `v`) always drafts 5s, so a round after anchor 6 accepts exactly one
/// draft and a round after anchor 5 none. Eager and deferred injection agree, output is
/// lossless, and the context invariant holds at every draft.
#[test]
fn partial_acceptance_keeps_the_draft_context_on_the_committed_positions() {
    let e = engine(bigram_target());
    let opts = greedy(30);
    let mut s = e.session(64, QType::F32, QType::F32).unwrap();
    let want = e
        .generate(&mut s, PROMPT, &opts, |_| {})
        .unwrap()
        .generated_ids;
    assert!(
        want.windows(2).all(|p| p == [5, 6] || p == [6, 5]),
        "{want:?}"
    );
    let mut spec = DraftSpec::new(8, &[1, 0], 6);
    spec.silent = true;
    let so = SpecOptions {
        n_max: 5,
        n_min: 0,
        p_min: 0.0,
        adaptive: false,
    };
    let mut counts = Vec::new();
    for policy in [Injection::Eager, Injection::Deferred] {
        let mut d = Recording::new(drafter(&e, &spec, policy).unwrap());
        let mut s = e.session(64, QType::F32, QType::F32).unwrap();
        let got = e
            .generate_speculative(&mut s, PROMPT, &opts, &mut d, &so, |_| {})
            .unwrap();
        assert_eq!(got.generated_ids, want, "{policy:?}");
        let st = got.spec.unwrap();
        assert!(
            st.accepted > 0 && st.accepted < st.drafted,
            "{policy:?}: {st:?}"
        );
        assert!(d.log.iter().all(|(_, _, dr)| dr.iter().all(|&t| t == 5)));
        check_context(&d, policy == Injection::Deferred);
        if policy == Injection::Deferred {
            assert_eq!(
                d.inner.context_len(),
                s.n_past(),
                "context after the last round"
            );
        }
        counts.push((st.drafted, st.accepted, st.rounds));
    }
    assert_eq!(counts[0], counts[1]);
    // The prompt ends in 'd' (embedding v), the first round's anchor: its draft's first 5 is
    // the target's next token and its second is not (6 follows 5), so every round commits
    // 5, 6 and accepts one draft. Rounds start at 0, 2, …, 28 generated tokens and draft
    // min(5, 30 − generated − 1): 13 × 5 + 3 + 1 = 69 tokens over 15 rounds.
    assert_eq!(counts[0], (69, 15, 15));
}

/// A one-token prompt: nothing is prefilled, the prompt is the first round's anchor, and the
/// feature drafters (no context yet: DFlash drafts from the block alone, EAGLE-3 waits for
/// one feature row) stay lossless.
#[test]
fn a_one_token_prompt_is_lossless_for_feature_drafters() {
    let e = engine(target(7));
    let prompt = &PROMPT[..1];
    let opts = greedy(16);
    let mut s = e.session(64, QType::F16, QType::F16).unwrap();
    let want = e
        .generate(&mut s, prompt, &opts, |_| {})
        .unwrap()
        .generated_ids;
    let so = SpecOptions {
        n_max: 4,
        n_min: 0,
        p_min: 0.0,
        adaptive: false,
    };
    let spec = DraftSpec::new(5, &[2, 0], 8);
    for policy in [Injection::Eager, Injection::Deferred] {
        let mut d = Recording::new(drafter(&e, &spec, policy).unwrap());
        let mut s = e.session(64, QType::F16, QType::F16).unwrap();
        let got = e
            .generate_speculative(&mut s, prompt, &opts, &mut d, &so, |_| {})
            .unwrap();
        assert_eq!(got.generated_ids, want, "{policy:?}");
        // p_min 0: the first round drafts 4 from an empty context.
        assert_eq!(d.log[0].0, prompt);
        assert_eq!(d.log[0].2.len(), 4);
        check_context(&d, policy == Injection::Deferred);
    }
    let mut d = RecordingE3 {
        inner: eagle3_drafter(&e, eagle3(5, &[0, 1, 2], false, false)),
        log: Vec::new(),
    };
    let mut s = e.session(64, QType::F16, QType::F16).unwrap();
    let got = e
        .generate_speculative(&mut s, prompt, &opts, &mut d, &so, |_| {})
        .unwrap();
    assert_eq!(got.generated_ids, want);
    // No feature row before the anchor: the first round is a plain step, the next ones draft.
    assert_eq!(d.log[0], (prompt.to_vec(), 4, Vec::new()));
    assert!(got.spec.unwrap().drafted > 0);
}

#[test]
fn the_draft_is_clamped_to_block_size_minus_one_and_fills_the_block() {
    let e = engine(target(7));
    let spec = DraftSpec::new(3, &[1], 4);
    let mut d = drafter(&e, &spec, Injection::Deferred).unwrap();
    let opts = greedy(20);
    let so = SpecOptions {
        n_max: 15,
        n_min: 0,
        p_min: 0.0,
        adaptive: false,
    };
    let mut s = e.session(64, QType::F16, QType::F16).unwrap();
    let got = e
        .generate_speculative(&mut s, PROMPT, &opts, &mut d, &so, |_| {})
        .unwrap();
    let st = got.spec.unwrap();
    // p_min 0: every round drafts exactly B − 1 = 3 (the budget allowing).
    assert!(st.rounds > 0);
    assert!(st.drafted <= 3 * st.rounds, "{st:?}");
    assert!(st.drafted >= 3 * (st.rounds - 2), "{st:?}");
}

/// A qwen2 target whose layer `l` adds `10·(l+1)` to every hidden value: zero embeddings,
/// zero Q/K/V matrices, V bias `10·(l+1)` (so attention returns it whatever the weights), an
/// identity output projection, a zero MLP.
fn constant_target() -> Vec<u8> {
    let n_layer = 3;
    let mut md = arch_md("qwen2", n_layer);
    md.extend(tokenizer_md());
    let (q, kv) = (N_HEAD * HD, N_HEAD_KV * HD);
    let z = |n: usize| vec![0.0f32; n];
    let mut eye = z(E * q);
    for r in 0..E {
        eye[r * q + r] = 1.0;
    }
    let mut t = vec![
        mat(
            "token_embd.weight".into(),
            QType::F32,
            E,
            N_VOCAB,
            z(E * N_VOCAB),
        ),
        vec_t("output_norm.weight".into(), vec![1.0; E]),
        mat(
            "output.weight".into(),
            QType::F32,
            E,
            N_VOCAB,
            values(5, E * N_VOCAB, 1.0),
        ),
    ];
    for l in 0..n_layer {
        let n = |s: &str| format!("blk.{l}.{s}");
        #[allow(clippy::cast_precision_loss, reason = "small layer numbers")]
        let c = 10.0 * (l + 1) as f32;
        t.extend([
            vec_t(n("attn_norm.weight"), vec![1.0; E]),
            vec_t(n("ffn_norm.weight"), vec![1.0; E]),
            mat(n("attn_q.weight"), QType::F32, E, q, z(E * q)),
            mat(n("attn_k.weight"), QType::F32, E, kv, z(E * kv)),
            mat(n("attn_v.weight"), QType::F32, E, kv, z(E * kv)),
            vec_t(n("attn_q.bias"), z(q)),
            vec_t(n("attn_k.bias"), z(kv)),
            vec_t(n("attn_v.bias"), vec![c; kv]),
            mat(n("attn_output.weight"), QType::F32, q, E, eye.clone()),
            mat(n("ffn_gate.weight"), QType::F32, E, N_FF, z(E * N_FF)),
            mat(n("ffn_up.weight"), QType::F32, E, N_FF, z(E * N_FF)),
            mat(n("ffn_down.weight"), QType::F32, N_FF, E, z(N_FF * E)),
        ]);
    }
    write(md, &t)
}

/// Keeps the features it is given.
struct Taps {
    taps: Vec<usize>,
    seen: Vec<(Vec<u32>, usize, Vec<f32>)>,
}

impl Drafter for Taps {
    fn name(&self) -> &'static str {
        "taps"
    }
    fn target_taps(&self) -> &[usize] {
        &self.taps
    }
    fn begin(&mut self, _prompt: &[u32]) -> Result<(), SpecError> {
        Ok(())
    }
    fn process_features(
        &mut self,
        tokens: &[u32],
        pos0: usize,
        features: &[f32],
    ) -> Result<(), SpecError> {
        self.seen.push((tokens.to_vec(), pos0, features.to_vec()));
        Ok(())
    }
    fn draft(&mut self, _p: &DraftParams<'_>) -> Result<Vec<u32>, SpecError> {
        Ok(Vec::new())
    }
    fn state(&self) -> DrafterState {
        Box::new(())
    }
    fn restore(&mut self, _s: &DrafterState) -> Result<(), SpecError> {
        Ok(())
    }
}

#[test]
fn taps_are_layer_inputs_in_the_order_asked_for() {
    let e = engine(constant_target());
    // HF target_layer_ids [2, 0, 1] → GGUF target_layers [3, 1, 2]; 3 = n_layer: pre-norm.
    let mut d = Taps {
        taps: vec![3, 1, 2],
        seen: Vec::new(),
    };
    let so = SpecOptions {
        n_max: 4,
        n_min: 0,
        p_min: 0.0,
        adaptive: false,
    };
    let mut s = e.session(64, QType::F32, QType::F32).unwrap();
    e.generate_speculative(&mut s, PROMPT, &greedy(3), &mut d, &so, |_| {})
        .unwrap();
    // The prompt but its last token, then one-token verify batches from that token (the
    // first anchor) on.
    let n = PROMPT.len();
    assert_eq!(d.seen.len(), 4);
    assert_eq!(d.seen[0].0, PROMPT[..n - 1]);
    assert_eq!(d.seen[0].1, 0);
    assert_eq!(d.seen[1], (vec![PROMPT[n - 1]], n - 1, d.seen[1].2.clone()));
    assert_eq!(d.seen[2].1, n);
    assert_eq!(d.seen[3].1, n + 1);
    for (tokens, _, f) in &d.seen {
        assert_eq!(f.len(), tokens.len() * 3 * E);
        for row in f.chunks_exact(3 * E) {
            for (k, want) in [60.0f32, 10.0, 30.0].into_iter().enumerate() {
                let part = &row[k * E..(k + 1) * E];
                assert!(
                    part.iter().all(|&x| (x - want).abs() < 1e-4),
                    "tap {} should be {want}: {:?}",
                    d.taps[k],
                    &part[..4]
                );
            }
        }
    }
    // A tap past the target is refused before any work.
    let mut bad = Taps {
        taps: vec![4],
        seen: Vec::new(),
    };
    let mut s = e.session(64, QType::F32, QType::F32).unwrap();
    let err = e
        .generate_speculative(&mut s, PROMPT, &greedy(3), &mut bad, &so, |_| {})
        .unwrap_err();
    assert!(err.to_string().contains("tap 4"), "{err}");
}

fn block_logits(e: &Engine<CpuBackend>, spec: &DraftSpec) -> Vec<f32> {
    let net = specula_models::dflash::Dflash::load(
        &*e.backend,
        Arc::new(Gguf::from_bytes(draft(spec)).unwrap()),
        &e.model,
    )
    .unwrap();
    let be = &*e.backend;
    let mut kv =
        specula_tensor::Backend::kv_new(be, net.kv_shape(64, QType::F32, QType::F32)).unwrap();
    let mut s = net.scratch(be);
    let w = net.feature_width();
    let feats = values(77, 5 * w, 3.0);
    net.inject(be, &mut kv, 64, &mut s, &feats, &[0, 1, 2, 3, 4])
        .unwrap();
    net.block(
        be,
        &mut kv,
        64,
        &mut s,
        &[9, MASK, MASK, MASK],
        5,
        &[0, 1, 2, 3],
    )
    .unwrap()
    .to_vec()
}

#[test]
fn every_matmul_applies_its_per_tensor_scale() {
    let e = engine(target(7));
    let base = DraftSpec::new(4, &[1, 2], 8);
    let mut scaled = base.clone();
    scaled.scale = Some(0.5);
    let mut premultiplied = base.clone();
    premultiplied.premultiply = 0.5;
    let want = block_logits(&e, &premultiplied);
    // (x·W)·2⁻¹ and x·(2⁻¹W) are the same floats.
    assert_eq!(block_logits(&e, &scaled), want);
    // The scales of `fc`, Q and K cannot show: the RMSNorm right after each (encoder norm,
    // q_norm, k_norm) divides any factor out (up to its ε).
    for name in [
        "blk.0.attn_v",
        "blk.1.attn_output",
        "blk.0.ffn_gate",
        "blk.1.ffn_up",
        "blk.0.ffn_down",
    ] {
        let mut dropped = scaled.clone();
        dropped.drop_scale = Some(name);
        assert!(
            block_logits(&e, &dropped) != want,
            "dropping the scale of {name} changed nothing"
        );
    }
}

/// The same with NVFP4 matrices (their per-tensor scale lives outside the blocks, so the model
/// must apply it): dropping the V, O or FFN scale changes the logits.
#[test]
fn nvfp4_drafts_apply_their_scales() {
    let e = engine(target(7));
    let mut scaled = DraftSpec::new(4, &[1, 2], 8);
    scaled.qtype = QType::NVFP4;
    scaled.scale = Some(0.25);
    let want = block_logits(&e, &scaled);
    assert!(want.iter().all(|x| x.is_finite()));
    let mut unscaled = scaled.clone();
    unscaled.scale = None;
    assert!(
        block_logits(&e, &unscaled) != want,
        "the scales changed nothing"
    );
    for name in ["blk.1.attn_v", "blk.0.attn_output", "blk.1.ffn_down"] {
        let mut dropped = scaled.clone();
        dropped.drop_scale = Some(name);
        assert!(
            block_logits(&e, &dropped) != want,
            "dropping the NVFP4 scale of {name} changed nothing"
        );
    }
}

#[test]
fn old_key_spellings_load_and_variants_are_refused_by_name() {
    let e = engine(target(7));
    let mut old = DraftSpec::new(4, &[1, 2], 8);
    old.old_keys = true;
    let d = drafter(&e, &old, Injection::Eager).unwrap();
    assert_eq!(d.target_taps(), &[1, 2]);
    assert_eq!(d.net().hparams().mask_token_id, MASK);

    let refuse = |spec: DraftSpec, needle: &str| {
        let err = drafter(&e, &spec, Injection::Eager)
            .unwrap_err()
            .to_string();
        assert!(err.contains(needle), "expected `{needle}` in: {err}");
    };
    let mut dspark = DraftSpec::new(4, &[1], 8);
    dspark.extra_tensors.push(mat(
        "markov_w1.weight".into(),
        QType::F32,
        32,
        N_VOCAB,
        vec![0.0; 32 * N_VOCAB],
    ));
    refuse(dspark, "DSpark");
    let mut dflash2 = DraftSpec::new(4, &[1], 8);
    dflash2
        .extra_md
        .push(("dflash.selector_top_k".into(), Value::U32(16)));
    refuse(dflash2, "conv_kernel_size");
    let mut swa = DraftSpec::new(4, &[1], 8);
    swa.extra_md
        .push(("dflash.attention.sliding_window".into(), Value::U32(2048)));
    refuse(swa, "sliding-window");
    refuse(
        DraftSpec::new(4, &[3], 8),
        "tap 3 is past the target's 2 layers",
    );
    refuse(DraftSpec::new(4, &[1], 1), "at least one MASK");
}

/// A random EAGLE-3 head: taps `taps`, its own head over 64 ids (`d2t` = 4i + 1) or the
/// target's.
fn eagle3(seed: u64, taps: &[i32], own_head: bool, nbr: bool) -> Vec<u8> {
    let mut md = arch_md("eagle3", 1);
    md.push((
        "eagle3.target_layers".into(),
        Value::Array(Array::I32(taps.to_vec())),
    ));
    md.push(("eagle3.target_hidden_size".into(), u(E)));
    md.push(("eagle3.norm_before_residual".into(), Value::Bool(nbr)));
    let (q, kv) = (N_HEAD * HD, N_HEAD_KV * HD);
    let mut i = seed * 100;
    let mut r = |n: usize, s: f32| {
        i += 1;
        values(i, n, s)
    };
    let norm = |x: Vec<f32>| x.iter().map(|v| 1.0 + v).collect::<Vec<f32>>();
    let nf = taps.len() * E;
    let mut t = vec![
        mat("fc.weight".into(), QType::F32, nf, E, r(nf * E, 0.3)),
        vec_t("output_norm.weight".into(), norm(r(E, 0.2))),
        vec_t("blk.0.attn_norm.weight".into(), norm(r(E, 0.2))),
        vec_t("blk.0.attn_norm_2.weight".into(), norm(r(E, 0.2))),
        vec_t("blk.0.ffn_norm.weight".into(), norm(r(E, 0.2))),
        mat(
            "blk.0.attn_q.weight".into(),
            QType::F32,
            2 * E,
            q,
            r(2 * E * q, 0.5),
        ),
        mat(
            "blk.0.attn_k.weight".into(),
            QType::F32,
            2 * E,
            kv,
            r(2 * E * kv, 0.5),
        ),
        mat(
            "blk.0.attn_v.weight".into(),
            QType::F32,
            2 * E,
            kv,
            r(2 * E * kv, 0.5),
        ),
        mat(
            "blk.0.attn_output.weight".into(),
            QType::F32,
            q,
            E,
            r(q * E, 0.5),
        ),
        mat(
            "blk.0.ffn_gate.weight".into(),
            QType::F32,
            E,
            N_FF,
            r(E * N_FF, 0.5),
        ),
        mat(
            "blk.0.ffn_up.weight".into(),
            QType::F32,
            E,
            N_FF,
            r(E * N_FF, 0.5),
        ),
        mat(
            "blk.0.ffn_down.weight".into(),
            QType::F32,
            N_FF,
            E,
            r(N_FF * E, 0.5),
        ),
    ];
    if own_head {
        t.push(mat(
            "output.weight".into(),
            QType::F32,
            E,
            64,
            r(E * 64, 1.0),
        ));
    }
    let mut bytes = write(md, &t);
    if own_head {
        // Append d2t (I64) by rewriting with it: the F32 writer above cannot hold it.
        let mut w = GgufWriter::new();
        let file = Gguf::from_bytes(bytes).unwrap();
        for (k, v) in file.metadata().iter() {
            w.add(k, v.clone()).unwrap();
        }
        let mut data: Vec<Vec<u8>> = Vec::new();
        for (idx, info) in file.tensors().iter().enumerate() {
            w.add_tensor(info.name.as_str(), info.ty, &info.dims)
                .unwrap();
            data.push(file.tensor_data(idx).to_vec());
        }
        w.add_tensor("d2t", GgmlType::I64, &[64]).unwrap();
        data.push((0..64i64).flat_map(|i| (4 * i + 1).to_le_bytes()).collect());
        let refs: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
        bytes = w.to_vec(&refs).unwrap();
    }
    bytes
}

fn eagle3_drafter(e: &Engine<CpuBackend>, bytes: Vec<u8>) -> Eagle3Drafter<CpuBackend> {
    Eagle3Drafter::new(
        Arc::clone(&e.backend),
        Arc::new(Gguf::from_bytes(bytes).unwrap()),
        e,
        256,
        QType::F32,
        QType::F32,
    )
    .unwrap()
}

/// Records the drafts of an EAGLE-3 drafter.
struct RecordingE3 {
    inner: Eagle3Drafter<CpuBackend>,
    log: Vec<(Vec<u32>, usize, Vec<u32>)>,
}

impl Drafter for RecordingE3 {
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn target_taps(&self) -> &[usize] {
        self.inner.target_taps()
    }
    fn begin(&mut self, prompt: &[u32]) -> Result<(), SpecError> {
        self.inner.begin(prompt)
    }
    fn process_features(
        &mut self,
        tokens: &[u32],
        pos0: usize,
        features: &[f32],
    ) -> Result<(), SpecError> {
        self.inner.process_features(tokens, pos0, features)
    }
    fn draft(&mut self, p: &DraftParams<'_>) -> Result<Vec<u32>, SpecError> {
        let d = self.inner.draft(p)?;
        self.log.push((p.history.to_vec(), p.n_max, d.clone()));
        Ok(d)
    }
    fn accept(&mut self, n: usize) {
        self.inner.accept(n);
    }
    fn state(&self) -> DrafterState {
        self.inner.state()
    }
    fn restore(&mut self, s: &DrafterState) -> Result<(), SpecError> {
        self.inner.restore(s)
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 10, ..ProptestConfig::default() })]

    #[test]
    fn eagle3_speculation_is_lossless_and_chains_are_incremental(
        seed in 1u64..1000,
        own_head in any::<bool>(),
        nbr in any::<bool>(),
        n_max in 1usize..=8,
        taps in prop::sample::select(vec![vec![0, 1, 2], vec![2, 1, 1]]),
        adaptive in any::<bool>(),
    ) {
        let e = engine(target(7));
        let n = 20;
        let opts = greedy(n);
        let n_ctx = PROMPT.len() + n;
        let mut s = e.session(n_ctx, QType::F16, QType::F16).unwrap();
        let want = e.generate(&mut s, PROMPT, &opts, |_| {}).unwrap().generated_ids;
        let bytes = eagle3(seed, &taps, own_head, nbr);
        let mut d = RecordingE3 { inner: eagle3_drafter(&e, bytes.clone()), log: Vec::new() };
        // Adaptive runs take plain steps between drafts: their features wait, unencoded, for
        // the next draft, which encodes them in one pass.
        let so = SpecOptions { n_max, n_min: 0, p_min: 0.0, adaptive };
        let mut s = e.session(n_ctx, QType::F16, QType::F16).unwrap();
        let got = e.generate_speculative(&mut s, PROMPT, &opts, &mut d, &so, |_| {}).unwrap();
        prop_assert_eq!(&got.generated_ids, &want);
        let st = got.spec.unwrap();
        prop_assert!(st.drafted > 0);
        if own_head {
            // Every draft is an id the reduced vocabulary maps to.
            prop_assert!(d.log.iter().all(|(_, _, dr)| dr.iter().all(|&t| t % 4 == 1)));
        }
        for (history, k, drafted) in d.log.iter().take(5) {
            let committed = &history[..history.len() - 1];
            let mut fresh = eagle3_drafter(&e, bytes.clone());
            let mut ts = e.session(n_ctx, QType::F16, QType::F16).unwrap();
            let mut taps_buf = specula_models::Taps { layers: fresh.target_taps().to_vec(), rows: Vec::new() };
            let (mut logits, mut feats) = (Vec::new(), Vec::new());
            e.prefill_with_features(&mut ts, committed, committed.len(), &mut logits, &mut taps_buf, &mut feats).unwrap();
            fresh.begin(history).unwrap();
            fresh.process_features(committed, 0, &feats).unwrap();
            let again = fresh.draft(&DraftParams { history, n_max: *k, p_min: 0.0, window: None }).unwrap();
            prop_assert_eq!(&again, drafted, "chain at history length {}", history.len());
        }
    }
}

/// Snapshots (`state`) taken between rounds and mid-round (a verify batch stashed, acceptance
/// not known yet) restore to drafters that draft exactly as they did: the draft context of a
/// snapshot is complete whenever it is taken (llama.cpp fork bug TheTom#231: a flush deferred
/// into `draft()` left checkpoints without context, and restored requests drafted nothing).
#[test]
fn snapshots_restore_the_draft_context() {
    fn p(h: &[u32]) -> DraftParams<'_> {
        DraftParams {
            history: h,
            n_max: 7,
            p_min: 0.0,
            window: None,
        }
    }
    let e = engine(target(7));
    let spec = DraftSpec::new(21, &[2, 0], 8);
    let mut d = drafter(&e, &spec, Injection::Deferred).unwrap();
    let mut s = e.session(64, QType::F32, QType::F32).unwrap();
    let mut taps = specula_models::Taps {
        layers: d.target_taps().to_vec(),
        rows: Vec::new(),
    };
    let (mut logits, mut feats) = (Vec::new(), Vec::new());
    let mut history = PROMPT.to_vec();
    let head = &PROMPT[..PROMPT.len() - 1];
    e.prefill_with_features(&mut s, head, head.len(), &mut logits, &mut taps, &mut feats)
        .unwrap();
    d.begin(&history).unwrap();
    d.process_features(head, 0, &feats).unwrap();
    let first = d.draft(&p(&history)).unwrap();
    assert_eq!(first.len(), 7);
    let between = d.state();

    // A verify of that draft: stashed until acceptance is known.
    let base = s.n_past();
    let mut batch = vec![*history.last().unwrap()];
    batch.extend_from_slice(&first);
    e.prefill_with_features(&mut s, &batch, 0, &mut logits, &mut taps, &mut feats)
        .unwrap();
    d.process_features(&batch, base, &feats).unwrap();
    let mid = d.state();
    d.accept(1);
    history.extend_from_slice(&first[..1]);
    history.push(3);
    let second = d.draft(&p(&history)).unwrap();
    assert_eq!(d.context_len(), history.len() - 1);

    // Back to the snapshot between rounds: the first draft again.
    d.restore(&between).unwrap();
    assert_eq!(d.context_len(), PROMPT.len() - 1);
    assert_eq!(d.draft(&p(PROMPT)).unwrap(), first);
    // Back to the mid-round snapshot: its stash is injected on acceptance, as it was.
    d.restore(&mid).unwrap();
    d.accept(1);
    assert_eq!(d.draft(&p(&history)).unwrap(), second);
    assert_eq!(d.context_len(), history.len() - 1);
}

/// The features of `committed` (all its positions), run through a fresh target session.
fn features_of(e: &Engine<CpuBackend>, taps: &[usize], committed: &[u32]) -> Vec<f32> {
    let mut ts = e.session(256, QType::F16, QType::F16).unwrap();
    let mut taps_buf = specula_models::Taps {
        layers: taps.to_vec(),
        rows: Vec::new(),
    };
    let (mut logits, mut feats) = (Vec::new(), Vec::new());
    e.prefill_with_features(
        &mut ts,
        committed,
        committed.len(),
        &mut logits,
        &mut taps_buf,
        &mut feats,
    )
    .unwrap();
    feats
}

/// A probe (`window: Some(w)`) with more than `w` committed rows to catch up with drafts from
/// the last `w` only — exactly what a drafter that was shown only those rows drafts — and the
/// next draft that is not a probe brings the whole context back: exactly a full drafter's.
#[test]
fn dflash_probes_draft_from_their_window_and_paying_drafts_bring_the_context_back() {
    let e = engine(target(7));
    let spec = DraftSpec::new(33, &[2, 0], 8);
    let history: Vec<u32> = PROMPT.iter().chain(PROMPT).chain(PROMPT).copied().collect();
    let n = history.len() - 1;
    let committed = &history[..n];
    let mut d = drafter(&e, &spec, Injection::Deferred).unwrap();
    let w = d.net().feature_width();
    let feats = features_of(&e, d.target_taps(), committed);
    let ask = |window| DraftParams {
        history: &history,
        n_max: 7,
        p_min: 0.0,
        window,
    };

    d.begin(&history).unwrap();
    d.process_features(committed, 0, &feats).unwrap();
    let probe = d.draft(&ask(Some(5))).unwrap();
    assert_eq!(d.context_start(), n - 5);
    assert_eq!(d.context_len(), n);

    let mut windowed = drafter(&e, &spec, Injection::Deferred).unwrap();
    windowed.begin(&history).unwrap();
    windowed
        .process_features(&committed[n - 5..], n - 5, &feats[(n - 5) * w..])
        .unwrap();
    assert_eq!(windowed.draft(&ask(None)).unwrap(), probe);
    assert_eq!(windowed.context_start(), n - 5);

    let mut full = drafter(&e, &spec, Injection::Deferred).unwrap();
    full.begin(&history).unwrap();
    full.process_features(committed, 0, &feats).unwrap();
    let whole = full.draft(&ask(None)).unwrap();
    assert_ne!(
        whole, probe,
        "the window must change this draft for the test to see it"
    );
    assert_eq!(d.draft(&ask(None)).unwrap(), whole);
    assert_eq!(d.context_start(), 0);

    // A probe with no more than its window to catch up with keeps the whole context.
    let mut near = drafter(&e, &spec, Injection::Deferred).unwrap();
    near.begin(&history).unwrap();
    near.process_features(committed, 0, &feats).unwrap();
    assert_eq!(near.draft(&ask(Some(n))).unwrap(), whole);
    assert_eq!(near.context_start(), 0);
}

/// EAGLE-3: a probe writes at most its window of pairs (the chain then equals a drafter's
/// that saw only those positions), and a draft that is not a probe rewrites them all.
#[test]
fn eagle3_probes_draft_from_their_window_and_paying_drafts_bring_the_context_back() {
    let e = engine(target(7));
    let bytes = eagle3(41, &[0, 1, 2], false, false);
    let history: Vec<u32> = PROMPT.iter().chain(PROMPT).chain(PROMPT).copied().collect();
    let n = history.len() - 1;
    let committed = &history[..n];
    let mut d = eagle3_drafter(&e, bytes.clone());
    let w = d.net().feature_width();
    let feats = features_of(&e, d.target_taps(), committed);
    let ask = |window| DraftParams {
        history: &history,
        n_max: 6,
        p_min: 0.0,
        window,
    };

    d.begin(&history).unwrap();
    d.process_features(committed, 0, &feats).unwrap();
    let probe = d.draft(&ask(Some(4))).unwrap();

    // The pairs of the last 4 positions before the anchor's, with the window's own `g`: a
    // drafter whose sequence starts there (its first pair is (token[P + 1], g[P]) at P = 0).
    let mut full = eagle3_drafter(&e, bytes.clone());
    full.begin(&history).unwrap();
    full.process_features(committed, 0, &feats).unwrap();
    let whole = full.draft(&ask(None)).unwrap();
    assert_ne!(
        whole, probe,
        "the window must change this chain for the test to see it"
    );
    let tail = &history[n - 5..];
    let mut windowed = eagle3_drafter(&e, bytes);
    windowed.begin(tail).unwrap();
    windowed
        .process_features(&tail[..5], 0, &feats[(n - 5) * w..])
        .unwrap();
    let p = DraftParams {
        history: tail,
        n_max: 6,
        p_min: 0.0,
        window: None,
    };
    assert_eq!(windowed.draft(&p).unwrap(), probe);

    assert_eq!(d.draft(&ask(None)).unwrap(), whole);
}

/// The adaptive policy's probes on a prompt longer than their window restart the draft
/// context (the drafter answers from the window), and the output stays the target's own.
#[test]
fn adaptive_probes_past_their_window_are_lossless() {
    let e = engine(target(7));
    let prompt: Vec<u32> = (0..4).flat_map(|_| PROMPT.iter().copied()).collect();
    let n = 80;
    let opts = greedy(n);
    let n_ctx = prompt.len() + n;
    let mut s = e.session(n_ctx, QType::F16, QType::F16).unwrap();
    let want = e
        .generate(&mut s, &prompt, &opts, |_| {})
        .unwrap()
        .generated_ids;
    for seed in [3, 21, 57] {
        let spec = DraftSpec::new(seed, &[2, 0], 8);
        let mut d = Recording::new(drafter(&e, &spec, Injection::Deferred).unwrap());
        let so = SpecOptions {
            n_max: 7,
            n_min: 0,
            p_min: 0.0,
            adaptive: true,
        };
        let mut s = e.session(n_ctx, QType::F16, QType::F16).unwrap();
        let got = e
            .generate_speculative(&mut s, &prompt, &opts, &mut d, &so, |_| {})
            .unwrap();
        assert_eq!(got.generated_ids, want, "seed {seed}");
        let windowed = d
            .starts
            .iter()
            .filter(|(start, w)| *start > 0 && w.is_some())
            .count();
        assert!(
            windowed > 0,
            "seed {seed}: no probe restarted from its window: {:?}",
            d.starts
        );
        check_context(&d, true);

        let mut d = RecordingE3 {
            inner: eagle3_drafter(&e, eagle3(seed, &[0, 1, 2], false, false)),
            log: Vec::new(),
        };
        let mut s = e.session(n_ctx, QType::F16, QType::F16).unwrap();
        let got = e
            .generate_speculative(&mut s, &prompt, &opts, &mut d, &so, |_| {})
            .unwrap();
        assert_eq!(got.generated_ids, want, "EAGLE-3, seed {seed}");
        assert!(!d.log.is_empty());
    }
}

/// An EAGLE-3 context restarted by a probe and then cut back to a shared prefix that ends
/// where it starts (a new request on the same slot, whole prompt reused) declines to draft:
/// no panic on the missing seed row.
#[test]
fn eagle3_context_cut_to_its_start_declines() {
    let e = engine(target(7));
    let history: Vec<u32> = PROMPT.iter().chain(PROMPT).chain(PROMPT).copied().collect();
    let n = history.len() - 1;
    let mut d = eagle3_drafter(&e, eagle3(41, &[0, 1, 2], false, false));
    let feats = features_of(&e, d.target_taps(), &history[..n]);
    d.begin(&history).unwrap();
    d.process_features(&history[..n], 0, &feats).unwrap();
    d.draft(&DraftParams {
        history: &history,
        n_max: 4,
        p_min: 0.0,
        window: Some(4),
    })
    .unwrap();
    // The window started at n − 5; a new prompt shares only that much.
    let next = &history[..n - 4];
    assert_eq!(d.begin_reusing(next, n - 5).unwrap(), n - 5);
    // A probe: nothing held is brought back, and no `g` row precedes the anchor.
    let ask = |window| DraftParams {
        history: next,
        n_max: 4,
        p_min: 0.0,
        window,
    };
    assert_eq!(d.draft(&ask(Some(4))).unwrap(), Vec::<u32>::new());
    // A paying draft brings the held rows back and drafts from the whole prefix.
    assert!(!d.draft(&ask(None)).unwrap().is_empty());
}
