//! `specula train dflash|eagle3` end to end on SmolLM2-135M (skipped with a note when the model is
//! not fetched; CI runs it with `--features train`): features of a small code corpus, a few
//! training steps, the exported drafters (F16, Q8_0, NVFP4) loading and drafting losslessly.
//!
//! - the loss goes down;
//! - a run stopped at a checkpoint (`--stop-at`) and resumed has the losses of a run that never
//!   stopped and writes the same drafter bytes;
//! - an EAGLE-3 head trained on the same features (its loss going down too) and exported;
//! - every exported drafter gives the plain run's greedy output through `specula run --dflash`,
//!   drafting in every round;
//! - a resumed run with other settings, a subset of taps the features lack, an unknown
//!   export type and no steps from a random start are refused by name.

#![cfg(feature = "train")]

use std::path::{Path, PathBuf};

mod common;
use common::specula;

fn ok(o: &std::process::Output) -> String {
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8(o.stdout.clone()).unwrap()
}

fn corpus(dir: &Path) -> PathBuf {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let c = dir.join("corpus");
    std::fs::create_dir_all(&c).unwrap();
    for f in ["optim.rs", "vocab.rs", "rng.rs"] {
        std::fs::copy(root.join("crates/train/src").join(f), c.join(f)).unwrap();
    }
    c
}

fn train(m: &str, feats: &Path, out: &Path, extra: &[&str]) -> std::process::Output {
    let mut args = vec![
        "train",
        "dflash",
        "-m",
        m,
        "--features",
        feats.to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
        "--steps",
        "24",
        "--block",
        "8",
        "--draft-vocab",
        "1024",
        "--anchors",
        "12",
        "--seqs-per-step",
        "2",
        "--lr",
        "2e-3",
        "--checkpoint-every",
        "12",
        "--val-seqs",
        "1",
        "--export",
        "f16,q8_0,nvfp4",
    ];
    args.extend_from_slice(extra);
    specula(&args)
}

fn losses(out: &Path) -> Vec<f64> {
    std::fs::read_to_string(out.join("train.jsonl"))
        .unwrap()
        .lines()
        .filter_map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            v["step"]["loss"].as_f64()
        })
        .collect()
}

#[test]
fn a_trained_drafter_loads_and_drafts_losslessly() {
    let Some(path) = specula_testkit::real_model("smollm2-135m") else {
        return;
    };
    let m = path.to_str().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let c = corpus(dir.path());
    let feats = dir.path().join("feats");
    ok(&specula(&[
        "extract",
        "-m",
        m,
        "--corpus",
        c.to_str().unwrap(),
        "-o",
        feats.to_str().unwrap(),
        "--seq-len",
        "96",
        "--taps",
        "2,16,28",
        "--top-k",
        "1",
        "--shard-seqs",
        "16",
        "--max-shards",
        "1",
        "-t",
        "2",
    ]));

    // One go.
    let a = dir.path().join("a");
    let report = ok(&train(m, &feats, &a, &["--taps", "2,28"]));
    assert!(report.contains("taps [2, 28]"), "{report}");
    let l = losses(&a);
    assert_eq!(l.len(), 24);
    let first: f64 = l[..6].iter().sum::<f64>() / 6.0;
    let last: f64 = l[18..].iter().sum::<f64>() / 6.0;
    assert!(last < 0.8 * first, "loss {first:.3} → {last:.3}: {l:?}");

    // Stopped at the first checkpoint, then resumed: the same losses and drafter bytes.
    let b = dir.path().join("b");
    let stopped = ok(&train(
        m,
        &feats,
        &b,
        &["--taps", "2,28", "--stop-at", "12"],
    ));
    assert!(stopped.contains("stopped at step 12 of 24"), "{stopped}");
    assert!(!b.join("drafter-f16.gguf").exists());
    ok(&train(m, &feats, &b, &["--taps", "2,28", "--resume"]));
    assert_eq!(losses(&b), l);
    for ty in ["f16", "q8_0", "nvfp4"] {
        let f = format!("drafter-{ty}.gguf");
        assert!(
            std::fs::read(a.join(&f)).unwrap() == std::fs::read(b.join(&f)).unwrap(),
            "{f} differs between a run in one go and a stopped and resumed one"
        );
    }

    // Refusals.
    let bad = |o: std::process::Output, want: &str| {
        assert!(!o.status.success());
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains(want), "want `{want}` in: {err}");
    };
    bad(
        train(
            m,
            &feats,
            &b,
            &["--taps", "2,28", "--resume", "--gamma", "5"],
        ),
        "`gamma` is 7.0, this run's is 5.0",
    );
    bad(train(m, &feats, &b, &["--taps", "2,28"]), "--resume");
    bad(
        train(m, &feats, &dir.path().join("c"), &["--taps", "2,9"]),
        "tap 9 was not extracted",
    );
    bad(
        train(m, &feats, &dir.path().join("c"), &["--export", "q4_k"]),
        "export type `q4_k`",
    );
    // No steps writes an untrained draft only where the copy circuit built it.
    let c = dir.path().join("c");
    let no_steps = [
        "--features",
        feats.to_str().unwrap(),
        "-o",
        c.to_str().unwrap(),
    ];
    for kind in ["dflash", "eagle3"] {
        let mut args = vec!["train", kind, "-m", m, "--steps", "0"];
        args.extend_from_slice(&no_steps);
        bad(specula(&args), "--steps must be at least 1");
    }

    // Each drafter: the plain greedy output, drafting in every round.
    let run = |extra: &[&str]| -> serde_json::Value {
        let mut args = vec![
            "run",
            "-m",
            m,
            "-p",
            "def gcd(a, b):\n    while b:\n",
            "-n",
            "24",
            "--temp",
            "0",
            "--json",
            "-t",
            "2",
        ];
        args.extend_from_slice(extra);
        serde_json::from_str(&ok(&specula(&args))).unwrap()
    };
    let plain = run(&[]);

    // An EAGLE-3 head on the same features (its three taps), a few steps.
    let e = dir.path().join("e");
    let mut eargs = vec![
        "train",
        "eagle3",
        "-m",
        m,
        "--features",
        feats.to_str().unwrap(),
        "-o",
        e.to_str().unwrap(),
        "--steps",
        "16",
        "--draft-vocab",
        "1024",
        "--ttt-steps",
        "2",
        "--seqs-per-step",
        "2",
        "--lr",
        "2e-3",
        "--checkpoint-every",
        "8",
        "--val-seqs",
        "1",
        "--export",
        "f16,q8_0",
    ];
    let report = ok(&specula(&eargs));
    assert!(report.contains("taps [2, 16, 28]"), "{report}");
    let el = losses(&e);
    assert!(
        el[12..].iter().sum::<f64>() < 0.8 * el[..4].iter().sum::<f64>(),
        "{el:?}"
    );
    eargs.extend(["--layers", "2"]);
    bad(specula(&eargs), "one decoder layer");
    eargs.truncate(eargs.len() - 2);
    eargs.extend(["--kv-heads", "3"]);
    bad(specula(&eargs), "shape a DFlash draft");
    for ty in ["f16", "q8_0"] {
        let d = e.join(format!("drafter-{ty}.gguf"));
        let got = run(&[
            "-md",
            d.to_str().unwrap(),
            "--eagle3",
            "--spec-fixed",
            "--spec-draft-p-min",
            "0",
        ]);
        assert_eq!(got["generated_ids"], plain["generated_ids"], "eagle3 {ty}");
        assert_eq!(got["spec"]["type"], "draft-eagle3", "{ty}");
        assert!(
            got["timings"]["draft_rounds"].as_u64().unwrap() > 0,
            "{got}"
        );
    }

    for ty in ["f16", "q8_0", "nvfp4"] {
        let d = a.join(format!("drafter-{ty}.gguf"));
        let got = run(&[
            "-md",
            d.to_str().unwrap(),
            "--dflash",
            "--spec-fixed",
            "--spec-draft-p-min",
            "0",
        ]);
        assert_eq!(got["generated_ids"], plain["generated_ids"], "{ty}");
        assert_eq!(got["spec"]["type"], "draft-dflash", "{ty}");
        let drafted = got["timings"]["draft_n"].as_u64().unwrap();
        let rounds = got["timings"]["draft_rounds"].as_u64().unwrap();
        assert!(rounds > 0 && drafted >= rounds, "{ty}: {got}");
    }
}
