//! An NVFP4 target with per-tensor scales against llama.cpp (issue 14, item 4).
//!
//! `golden/nvfp4/tiny_llama.gguf` (written by `reference/nvfp4_target_golden.py`, see
//! `golden/nvfp4/MANIFEST.md`) is a tiny random llama whose every matmul weight — Q, K, V, O,
//! gate, up, down of each layer and the output head — is NVFP4 with its own FP32
//! `<name>.scale`; `tiny_llama.json` holds llama.cpp's greedy run on it (ids and the logits of
//! every step). specula's greedy ids must be llama.cpp's and its logits within twice
//! llama.cpp's own spread ([`tol`]); a file without any one of the scales must give other ids
//! or logits farther than that from llama.cpp's (every scale is applied, none by accident); an
//! activation `input_scale`, or a scale of a tensor that is not a scaled matrix, is refused at
//! load by name. Before, the target ignored its scales (only the drafters applied theirs).

use std::path::Path;
use std::sync::Arc;

use serde_json::Value as Json;
use specula_cpu::CpuBackend;
use specula_gguf::{GgmlType, Gguf, GgufWriter};
use specula_models::{Model, ModelError};
use specula_quant::QType;

/// Largest |logit difference| to llama.cpp allowed over every step: twice the spread of
/// llama.cpp's own attention paths on this model (`oracle_spread` of the golden: flash
/// attention on / off, f16 / f32 cache; the random net amplifies rounding differences).
fn tol(g: &Json) -> f32 {
    #[allow(clippy::cast_possible_truncation, reason = "a small tolerance")]
    let spread = g["oracle_spread"].as_f64().unwrap() as f32;
    assert!(spread > 0.0 && spread < 0.5, "oracle spread {spread}");
    2.0 * spread
}

fn golden() -> (Vec<u8>, Json) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../golden/nvfp4");
    let bytes = std::fs::read(dir.join("tiny_llama.gguf")).unwrap();
    let json: Json =
        serde_json::from_str(&std::fs::read_to_string(dir.join("tiny_llama.json")).unwrap())
            .unwrap();
    assert_eq!(json["gguf"]["size"].as_u64().unwrap(), bytes.len() as u64);
    (bytes, json)
}

fn ids(v: &Json) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| u32::try_from(x.as_u64().unwrap()).unwrap())
        .collect()
}

/// The file with its metadata and every tensor but `drop`, plus `extra` (name, one F32 value).
fn rewrite(bytes: &[u8], drop: Option<&str>, extra: Option<(&str, f32)>) -> Vec<u8> {
    let src = Gguf::from_bytes(bytes.to_vec()).unwrap();
    let mut w = GgufWriter::new();
    for (k, v) in src.metadata().iter() {
        w.add(k, v.clone()).unwrap();
    }
    let mut data: Vec<Vec<u8>> = Vec::new();
    for (i, t) in src.tensors().iter().enumerate() {
        if Some(t.name.as_str()) == drop {
            continue;
        }
        w.add_tensor(t.name.as_str(), t.ty, &t.dims).unwrap();
        data.push(src.tensor_data(i).to_vec());
    }
    if let Some((name, x)) = extra {
        w.add_tensor(name, GgmlType::F32, &[1]).unwrap();
        data.push(x.to_le_bytes().to_vec());
    }
    let refs: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
    w.to_vec(&refs).unwrap()
}

fn load(bytes: Vec<u8>) -> Result<(CpuBackend, Model<CpuBackend>), ModelError> {
    let be = CpuBackend::new(2);
    let model = Model::load(&be, Arc::new(Gguf::from_bytes(bytes).unwrap()))?;
    Ok((be, model))
}

/// specula's greedy run of `n` tokens after `prompt` (the prompt in one batch, then one token
/// per forward, as the golden): the ids and the logits of every step.
fn greedy(bytes: Vec<u8>, prompt: &[u32], n: usize) -> (Vec<u32>, Vec<Vec<f32>>) {
    let (be, model) = load(bytes).unwrap();
    let mut kv = model.new_kv(&be, 256, QType::F16, QType::F16).unwrap();
    let mut s = model.scratch(&be);
    let pos: Vec<u32> = (0..u32::try_from(prompt.len()).unwrap()).collect();
    let mut logits = model
        .forward(
            &be,
            &mut kv,
            &mut s,
            prompt,
            &pos,
            &[prompt.len() - 1],
            None,
        )
        .unwrap()
        .to_vec();
    let (mut got, mut steps) = (Vec::new(), Vec::new());
    for i in 0..n {
        let tok = (0..logits.len())
            .max_by(|&a, &b| logits[a].total_cmp(&logits[b]).then(b.cmp(&a)))
            .unwrap();
        let tok = u32::try_from(tok).unwrap();
        got.push(tok);
        steps.push(std::mem::take(&mut logits));
        if i + 1 < n {
            let p = u32::try_from(prompt.len() + i).unwrap();
            logits = model
                .forward(&be, &mut kv, &mut s, &[tok], &[p], &[0], None)
                .unwrap()
                .to_vec();
        }
    }
    (got, steps)
}

/// max |ours − llama.cpp| over the steps both have.
fn max_diff(ours: &[Vec<f32>], golden: &Json) -> f32 {
    let mut m = 0.0f32;
    for (o, st) in ours.iter().zip(golden["steps"].as_array().unwrap()) {
        let want = st["logits"].as_array().unwrap();
        assert_eq!(o.len(), want.len());
        for (a, b) in o.iter().zip(want) {
            #[allow(
                clippy::cast_possible_truncation,
                reason = "golden logits are f32 values"
            )]
            let b = b.as_f64().unwrap() as f32;
            m = m.max((a - b).abs());
        }
    }
    m
}

#[test]
fn nvfp4_target_with_scales_matches_llama_cpp() {
    let (bytes, g) = golden();
    let (prompt, want) = (ids(&g["prompt_ids"]), ids(&g["generated_ids"]));
    let (got, steps) = greedy(bytes, &prompt, want.len());
    assert!(
        steps.iter().flatten().all(|x| x.is_finite()),
        "finite logits"
    );
    assert_eq!(got, want, "greedy ids");
    let (d, tol) = (max_diff(&steps, &g), tol(&g));
    eprintln!(
        "max |logit - llama.cpp| = {d:.3} over {} steps (tolerance {tol:.3})",
        steps.len()
    );
    assert!(d <= tol, "logits differ from llama.cpp's by {d} > {tol}");
}

#[test]
fn dropping_any_one_scale_changes_the_output() {
    let (bytes, g) = golden();
    let (prompt, want) = (ids(&g["prompt_ids"]), ids(&g["generated_ids"]));
    let names: Vec<String> = g["scales"].as_object().unwrap().keys().cloned().collect();
    assert_eq!(
        names.len(),
        2 * 7 + 1,
        "every matmul of the golden has a scale"
    );
    for name in names {
        let (got, steps) = greedy(rewrite(&bytes, Some(&name), None), &prompt, want.len());
        let (d, tol) = (max_diff(&steps, &g), tol(&g));
        eprintln!(
            "without {name}: ids equal {}, max |logit diff| {d:.3}",
            got == want
        );
        assert!(
            got != want || d > tol,
            "without {name} the output stays within {tol} of llama.cpp's ({d})"
        );
    }
}

#[test]
fn scales_specula_does_not_apply_are_refused_by_name() {
    let (bytes, _) = golden();
    for (name, what) in [
        ("blk.0.attn_q.input_scale", "activation scale"),
        ("blk.1.ffn_down.input_scale", "activation scale"),
        ("output.input_scale", "activation scale"),
        ("token_embd.scale", "does not multiply by"),
        ("blk.0.attn_norm.scale", "does not multiply by"),
        ("blk.0.ffn_gate_shexp.scale", "does not multiply by"),
    ] {
        let err = load(rewrite(&bytes, None, Some((name, 0.5)))).unwrap_err();
        let msg = err.to_string();
        assert!(
            matches!(&err, ModelError::UnappliedScale { name: n, .. } if n == name),
            "{name}: {msg}"
        );
        assert!(msg.contains(name) && msg.contains(what), "{name}: {msg}");
    }
    // The scale of a tied head (no `output.weight`: the head is the embedding).
    let tied = rewrite(&bytes, Some("output.weight"), None);
    let err = load(tied).unwrap_err();
    assert!(
        matches!(&err, ModelError::UnappliedScale { name, .. } if name == "output.scale"),
        "{err}"
    );
    // A scale that is not a finite number.
    let bad = rewrite(
        &bytes,
        Some("blk.0.attn_k.scale"),
        Some(("blk.0.attn_k.scale", f32::NAN)),
    );
    let err = load(bad).unwrap_err();
    assert!(
        matches!(&err, ModelError::BadScale { name, .. } if name == "blk.0.attn_k.scale"),
        "{err}"
    );
}
