//! `specula extract` on SmolLM2-135M (skipped with a note when the model is not fetched), over
//! a corpus of this repository's own text files:
//!
//! - a shard holds the corpus's token ids (the file tokenized, cut into `--seq-len` pieces),
//!   each token's taps side by side as f16 — the f16 of the rows
//!   `Engine::prefill_with_features` captures for the sequence alone — and its top-k logits;
//! - a run stopped by `--max-shards` resumes to the bytes of a run that never stopped;
//! - held-out files stay out, non-UTF-8 files are listed as skipped;
//! - a directory of another run (other taps) and a damaged shard are refused by name.

use std::path::{Path, PathBuf};

use specula_models::Taps;
use specula_quant::QType;
use specula_quant::blocks::Half;

mod common;
use common::specula;

fn corpus(dir: &Path) -> PathBuf {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let c = dir.join("corpus");
    std::fs::create_dir_all(c.join("sub")).unwrap();
    std::fs::copy(root.join("README.md"), c.join("readme.md")).unwrap();
    std::fs::copy(root.join("docs/ARCHITECTURE.md"), c.join("sub/arch.md")).unwrap();
    std::fs::copy(
        root.join("crates/cli/src/extract.rs"),
        c.join("sub/held.md"),
    )
    .unwrap();
    std::fs::write(c.join("sub/latin1.md"), b"caf\xe9\n").unwrap();
    c
}

fn extract(m: &str, corpus: &Path, out: &Path, extra: &[&str]) -> std::process::Output {
    let mut args = vec![
        "extract",
        "-m",
        m,
        "--corpus",
        corpus.to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
        "--seq-len",
        "48",
        "--shard-seqs",
        "3",
        "--batch",
        "2",
        "--held-out",
        "held.md",
        "-t",
        "2",
    ];
    args.extend_from_slice(extra);
    specula(&args)
}

/// The target on the CPU backend, as `specula extract` loads it.
fn engine(path: &Path) -> specula_engine::Engine<specula_cpu::CpuBackend> {
    let f = std::sync::Arc::new(specula_gguf::Gguf::open(path).unwrap());
    let tok = specula_tokenizer::Tokenizer::from_gguf(&f).unwrap();
    let be = specula_cpu::CpuBackend::new(2);
    let model = specula_models::Model::load(&be, f).unwrap();
    specula_engine::Engine::new(be, model, tok)
}

fn ok(o: &std::process::Output) -> String {
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8(o.stdout.clone()).unwrap()
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}

#[test]
fn shards_hold_the_targets_rows_and_resume_to_the_same_bytes() {
    let Some(path) = specula_testkit::real_model("smollm2-135m") else {
        return;
    };
    let m = path.to_str().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let c = corpus(dir.path());
    // Limit the run: the first four shards (12 sequences) of the corpus.
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    let taps = ["--taps", "30,1,12", "--top-k", "3"];
    let first = ok(&extract(
        m,
        &c,
        &a,
        &[&taps[..], &["--max-shards", "1"]].concat(),
    ));
    assert!(first.contains("run again to resume"), "{first}");
    let more = ok(&extract(
        m,
        &c,
        &a,
        &[&taps[..], &["--max-shards", "3"]].concat(),
    ));
    assert!(more.contains("4 of"), "{more}");
    ok(&extract(
        m,
        &c,
        &b,
        &[&taps[..], &["--max-shards", "4"]].concat(),
    ));
    for f in [
        "shard-00000.bin",
        "shard-00001.bin",
        "shard-00003.bin",
        "manifest.json",
    ] {
        assert_eq!(
            std::fs::read(a.join(f)).unwrap(),
            std::fs::read(b.join(f)).unwrap(),
            "{f}: resumed vs one go"
        );
    }

    let man: serde_json::Value =
        serde_json::from_slice(&std::fs::read(a.join("manifest.json")).unwrap()).unwrap();
    let docs: Vec<&str> = man["corpus"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["path"].as_str().unwrap())
        .collect();
    assert_eq!(docs.len(), 2, "{docs:?}");
    assert!(docs[0].ends_with("readme.md") && docs[1].ends_with("sub/arch.md"));
    assert!(man["skipped"][0].as_str().unwrap().ends_with("latin1.md"));
    assert_eq!(man["taps"], serde_json::json!([30, 1, 12]));

    // Shard 0: header, the README's first tokens, the rows of the sequence alone.
    let s = std::fs::read(a.join("shard-00000.bin")).unwrap();
    assert_eq!(&s[..8], b"SPECFEAT");
    let (n_seqs, width, k) = (u32_at(&s, 12), u32_at(&s, 24), u32_at(&s, 28));
    let tokens = u64::from_le_bytes(s[16..24].try_into().unwrap());
    assert_eq!((n_seqs, width, k, tokens), (3, 3 * 576, 3, 3 * 48));
    let at = 32 + 4 * 3;
    let ids: Vec<u32> = (0..48).map(|i| u32_at(&s, at + 4 * i)).collect();
    let engine = engine(&path);
    let text = std::fs::read_to_string(c.join("readme.md")).unwrap();
    let want_ids = engine.tokenizer.encode_with(
        &text,
        specula_tokenizer::EncodeOptions {
            add_special: true,
            parse_special: false,
        },
    );
    assert_eq!(ids, want_ids[..48]);
    let mut session = engine.session(48, QType::F16, QType::F16).unwrap();
    let mut t = Taps {
        layers: vec![30, 1, 12],
        rows: Vec::new(),
    };
    let (mut logits, mut features) = (Vec::new(), Vec::new());
    engine
        .prefill_with_features(&mut session, &ids, 0, &mut logits, &mut t, &mut features)
        .unwrap();
    let fat = at + 4 * usize::try_from(tokens).unwrap();
    let got: Vec<u16> = (0..48 * 3 * 576)
        .map(|i| u16::from_le_bytes([s[fat + 2 * i], s[fat + 2 * i + 1]]))
        .collect();
    let want: Vec<u16> = features
        .iter()
        .map(|&x| Half::from_f32(x).to_bits())
        .collect();
    assert_eq!(got, want, "features of sequence 0");
    let kat = fat + 2 * 144 * 3 * 576;
    let top = specula_engine::top_k_logits(&logits[..49_152], 3);
    for (j, (id, logit)) in top.into_iter().enumerate() {
        assert_eq!(u32_at(&s, kat + 8 * j), id);
        assert_eq!(
            f32::from_le_bytes(s[kat + 8 * j + 4..kat + 8 * j + 8].try_into().unwrap()),
            logit
        );
    }

    // Another run's directory, and a damaged shard.
    let other = extract(m, &c, &a, &["--taps", "2,3", "--top-k", "3"]);
    let err = String::from_utf8_lossy(&other.stderr);
    assert!(
        !other.status.success() && err.contains("taps: [30, 1, 12] there, [2, 3] here"),
        "{err}"
    );
    let mut bad = s.clone();
    bad[100] ^= 1;
    std::fs::write(a.join("shard-00000.bin"), bad).unwrap();
    let damaged = extract(m, &c, &a, &[&taps[..], &["--max-shards", "1"]].concat());
    let err = String::from_utf8_lossy(&damaged.stderr);
    assert!(
        !damaged.status.success() && err.contains("damaged shard"),
        "{err}"
    );
}

#[test]
fn bad_arguments_fail_with_one_line() {
    let Some(path) = specula_testkit::real_model("smollm2-135m") else {
        return;
    };
    let m = path.to_str().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let c = corpus(dir.path());
    let out = dir.path().join("o");
    for (extra, want) in [
        (
            &["--taps", "31"][..],
            "tap 31 is past the target's 30 layers",
        ),
        (&["--ext", "rs"], "no files to extract from"),
    ] {
        let o = extract(m, &c, &out, extra);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(
            !o.status.success() && err.contains(want),
            "{extra:?}: {err}"
        );
        assert_eq!(err.trim().lines().count(), 1, "{err}");
    }
    let o = specula(&[
        "extract",
        "-m",
        m,
        "--corpus",
        c.to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
        "--seq-len",
        "1",
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("--seq-len must be at least 2"),
        "{err}"
    );
    let o = extract(m, &dir.path().join("nope"), &out, &[]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("nope"), "{err}");
}

/// `--generate 16`: each sequence is its first 32 corpus tokens and the target's greedy
/// continuation of them (what `Engine::generate` gives greedily), so every stored top-1 of
/// the continuation is the next stored id; a directory of corpus features refuses it by name.
#[test]
fn generated_sequences_are_the_targets_greedy_continuations() {
    let Some(path) = specula_testkit::real_model("smollm2-135m") else {
        return;
    };
    let m = path.to_str().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let c = corpus(dir.path());
    let a = dir.path().join("a");
    let flags = ["--taps", "30", "--top-k", "1", "--max-shards", "1"];
    ok(&extract(
        m,
        &c,
        &a,
        &[&flags[..], &["--generate", "16"]].concat(),
    ));
    let s = std::fs::read(a.join("shard-00000.bin")).unwrap();
    let n_seqs = u32_at(&s, 12) as usize;
    let tokens = usize::try_from(u64::from_le_bytes(s[16..24].try_into().unwrap())).unwrap();
    let lens: Vec<usize> = (0..n_seqs)
        .map(|i| u32_at(&s, 32 + 4 * i) as usize)
        .collect();
    assert_eq!(lens.iter().sum::<usize>(), tokens);
    let at = 32 + 4 * n_seqs;
    let ids: Vec<u32> = (0..tokens).map(|i| u32_at(&s, at + 4 * i)).collect();
    let kat = at + 4 * tokens + 2 * tokens * 576;
    let top1: Vec<u32> = (0..tokens).map(|i| u32_at(&s, kat + 8 * i)).collect();

    let engine = engine(&path);
    let text = std::fs::read_to_string(c.join("readme.md")).unwrap();
    let corpus_ids = engine.tokenizer.encode_with(
        &text,
        specula_tokenizer::EncodeOptions {
            add_special: true,
            parse_special: false,
        },
    );
    let mut start = 0;
    for (i, &len) in lens.iter().enumerate() {
        let seq = &ids[start..start + len];
        let prompt = &corpus_ids[48 * i..48 * i + 32];
        assert_eq!(
            &seq[..32],
            prompt,
            "sequence {i}: its prompt is the corpus's"
        );
        let mut session = engine.session(48, QType::F16, QType::F16).unwrap();
        let mut opts = specula_engine::GenerateOptions::greedy(16);
        opts.stop_at_eog = true;
        let g = engine
            .generate(&mut session, prompt, &opts, |_| {})
            .unwrap();
        assert_eq!(
            &seq[32..],
            g.generated_ids,
            "sequence {i}: the greedy continuation"
        );
        for p in start + 31..start + len - 1 {
            assert_eq!(top1[p], ids[p + 1], "sequence {i}: row {p}'s top-1");
        }
        start += len;
    }

    let other = extract(m, &c, &a, &flags);
    let err = String::from_utf8_lossy(&other.stderr);
    assert!(
        !other.status.success() && err.contains("generate: 16 there, 0 here"),
        "{err}"
    );
    let o = extract(m, &c, &dir.path().join("b"), &["--generate", "48"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("--generate 48 leaves no prompt"),
        "{err}"
    );
}
