//! `Engine::extract` on the tiny target of every architecture of
//! `specula_testkit::tiny::ARCHS` (dense, sliding window, MoE, hybrid recurrent, …): the
//! features of sequences extracted several to a forward are, bit for bit, the features
//! `prefill_with_features` captures for each sequence alone, and the top-k logits are those of
//! the sequence's own logits; bad requests are refused with a precise error.

use std::sync::Arc;

use specula_cpu::CpuBackend;
use specula_engine::{Engine, EngineError, ExtractOptions, SeqFeatures, top_k_logits};
use specula_gguf::Gguf;
use specula_models::{Model, Taps};
use specula_quant::QType;
use specula_testkit::tiny;
use specula_tokenizer::Tokenizer;

fn engine(arch: &str) -> Engine<CpuBackend> {
    let g = tiny::target(arch);
    let f = Arc::new(Gguf::from_bytes(g.to_bytes().expect("writes")).expect("valid GGUF"));
    let tokenizer = Tokenizer::from_gguf(&f).expect("tokenizer");
    let be = CpuBackend::new(2);
    let model = Model::load(&be, f).expect("the tiny model loads");
    Engine::new(be, model, tokenizer)
}

/// Sequences of different lengths (one longer than a prefill chunk of the engine below).
fn seqs() -> Vec<Vec<u32>> {
    [37usize, 5, 1, 70, 12]
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            (0..n)
                .map(|j| u32::try_from((j * 7 + i * 13 + 1) % 32).unwrap())
                .collect()
        })
        .collect()
}

fn alone(e: &Engine<CpuBackend>, ids: &[u32], taps: &[usize], k: usize) -> SeqFeatures {
    let mut s = e.session(ids.len(), QType::F16, QType::F16).unwrap();
    let mut t = Taps {
        layers: taps.to_vec(),
        rows: Vec::new(),
    };
    let (mut logits, mut features) = (Vec::new(), Vec::new());
    e.prefill_with_features(&mut s, ids, 0, &mut logits, &mut t, &mut features)
        .unwrap();
    let n_vocab = e.model.hparams().n_vocab;
    SeqFeatures {
        features,
        top_k: if k > 0 {
            logits
                .chunks_exact(n_vocab)
                .map(|r| top_k_logits(r, k))
                .collect()
        } else {
            Vec::new()
        },
    }
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

#[test]
fn batched_extraction_has_each_sequences_own_bits() {
    for arch in tiny::ARCHS {
        let mut e = engine(arch);
        e.n_batch = 32;
        let n_layer = e.model.hparams().n_layer;
        let taps = vec![n_layer, 1, 0];
        let seqs = seqs();
        let refs: Vec<&[u32]> = seqs.iter().map(Vec::as_slice).collect();
        for (batch, k) in [(3, 4), (5, 0), (1, 2)] {
            let opts = ExtractOptions {
                taps: taps.clone(),
                top_k: k,
                batch,
            };
            let mut got = Vec::new();
            e.extract(&refs, &opts, |i, f| {
                got.push((i, f));
                Ok(())
            })
            .unwrap();
            assert_eq!(got.len(), seqs.len(), "{arch}");
            for (i, f) in got {
                let want = alone(&e, &seqs[i], &taps, k);
                assert_eq!(
                    f.features.len(),
                    seqs[i].len() * taps.len() * e.model.hparams().n_embd,
                    "{arch}: sequence {i}"
                );
                assert_eq!(
                    bits(&f.features),
                    bits(&want.features),
                    "{arch}: sequence {i}, batch {batch}"
                );
                assert_eq!(f.top_k, want.top_k, "{arch}: sequence {i}, batch {batch}");
                assert_eq!(f.top_k.len(), if k > 0 { seqs[i].len() } else { 0 });
            }
        }
    }
}

#[test]
fn bad_requests_are_refused_by_name() {
    let e = engine("llama");
    let n_layer = e.model.hparams().n_layer;
    let ok: &[u32] = &[1, 2, 3];
    let run = |seqs: &[&[u32]], taps: Vec<usize>, batch: usize| {
        e.extract(
            seqs,
            &ExtractOptions {
                taps,
                top_k: 0,
                batch,
            },
            |_, _| Ok(()),
        )
        .unwrap_err()
    };
    let msg = run(&[ok], vec![n_layer + 1], 1).to_string();
    assert!(msg.contains("past the target"), "{msg}");
    assert!(run(&[ok], vec![], 1).to_string().contains("no taps"));
    assert!(run(&[ok], vec![1], 0).to_string().contains("batch of 0"));
    assert!(
        run(&[ok, &[]], vec![1], 2)
            .to_string()
            .contains("sequence 1 is empty")
    );
    assert!(matches!(
        run(&[&[1, 999_999]], vec![1], 1),
        EngineError::BadToken { .. }
    ));
    // What the callback returns ends the run.
    let err = e
        .extract(
            &[ok, ok],
            &ExtractOptions {
                taps: vec![1],
                top_k: 0,
                batch: 1,
            },
            |i, _| {
                if i == 1 {
                    Err(EngineError::Extract("stop".into()))
                } else {
                    Ok(())
                }
            },
        )
        .unwrap_err();
    assert!(err.to_string().contains("stop"));
}

/// `continue_greedy` over a batch gives each prompt the continuation plain greedy decoding of
/// that prompt alone gives (ending after an end-of-generation token), whatever the batch size.
#[test]
fn batched_greedy_continuations_are_each_prompts_own() {
    for arch in ["llama", "qwen3moe", "qwen35"] {
        let e = engine(arch);
        let seqs = seqs();
        let refs: Vec<&[u32]> = seqs.iter().map(Vec::as_slice).collect();
        let n = 9;
        let want: Vec<Vec<u32>> = seqs
            .iter()
            .map(|p| {
                let mut s = e.session(p.len() + n, QType::F16, QType::F16).unwrap();
                let mut opts = specula_engine::GenerateOptions::greedy(n);
                opts.stop_at_eog = true;
                let g = e.generate(&mut s, p, &opts, |_| {}).unwrap();
                [p.clone(), g.generated_ids].concat()
            })
            .collect();
        for batch in [1, 2, 5] {
            let mut told = 0;
            let got = e.continue_greedy(&refs, n, batch, |k| told += k).unwrap();
            assert_eq!(got, want, "{arch}, batch {batch}");
            let added: usize = got.iter().zip(&seqs).map(|(g, p)| g.len() - p.len()).sum();
            assert_eq!(told, added, "{arch}: progress counts every new token");
        }
    }
    let e = engine("llama");
    let msg = e
        .continue_greedy(&[&[1, 2], &[]], 3, 2, |_| {})
        .unwrap_err()
        .to_string();
    assert!(msg.contains("prompt 1 is empty"), "{msg}");
    assert!(
        e.continue_greedy(&[&[1]], 3, 0, |_| {})
            .unwrap_err()
            .to_string()
            .contains("batch of 0")
    );
}
