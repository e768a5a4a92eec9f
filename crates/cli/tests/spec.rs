//! Speculative decoding end to end on real quantized models (each test runs when its models are
//! fetched and says so when it is skipped): greedy speculative output is the plain greedy
//! output token for token, whatever the drafter, and the JSON reports what was drafted.
//!
//! - The default model with every n-gram drafter, and with itself as the draft model: the
//!   draft model decodes one token at a time while the target verifies blocks, so a self-draft
//!   is accepted whole only if a verify row has the bits of a single-token decode (batch
//!   invariance on a real Q4_1 model).
//! - Rollback by replay forced on the default model (`--spec-rollback replay`), and a
//!   sliding-window model (Gemma-3) past its window.
//! - The pair of issue 6: Qwen2.5-Coder-1.5B target, 0.5B draft, the quicksort prompt in the
//!   chat template, `--spec-draft-n-max 16`, 128 tokens.

use serde_json::Value as Json;

mod common;
use common::json_of;

/// `specula run … --chat --json` with greedy sampling; the parsed JSON.
fn run_json(model: &str, prompt: &str, n: &str, extra: &[&str]) -> Json {
    run_json_with(&["--chat"], model, prompt, n, extra)
}

/// `specula run … --json` with greedy sampling, `how` the prompt flags (`--chat`, or none for a
/// base model without a chat template); the parsed JSON.
fn run_json_with(how: &[&str], model: &str, prompt: &str, n: &str, extra: &[&str]) -> Json {
    let mut args = vec!["run", "-m", model];
    args.extend_from_slice(how);
    args.extend_from_slice(&[
        "-p", prompt, "-n", n, "--temp", "0", "--top-k", "1", "--seed", "42", "-t", "2", "--json",
    ]);
    args.extend_from_slice(extra);
    json_of(&args)
}

fn ids(j: &Json) -> Vec<u64> {
    j["generated_ids"]
        .as_array()
        .expect("generated_ids")
        .iter()
        .map(|v| v.as_u64().expect("an id"))
        .collect()
}

fn count(j: &Json, key: &str) -> u64 {
    j["timings"][key]
        .as_u64()
        .unwrap_or_else(|| panic!("timings.{key} in {j}"))
}

const EDIT: &str = "Rewrite this Python function so that its loop variable is named `item` \
instead of `x`. Output only the function.\n\n```python\ndef total(values):\n    s = 0\n    \
for x in values:\n        if x > 0:\n            s += x\n    return s\n```";

#[test]
fn default_model_speculative_output_is_the_plain_output() {
    let Some(path) = specula_testkit::real_model("smollm2-135m") else {
        return;
    };
    let m = path.to_str().unwrap();
    let plain = run_json(m, EDIT, "64", &["--spec-type", "none"]);
    assert!(plain["timings"].get("draft_n").is_none(), "{plain}");
    let want = ids(&plain);
    assert!(want.len() > 16, "{plain}");

    // The default of `specula run` is prompt lookup. How much the adaptive policy drafts
    // depends on the costs it measures on this machine, so only its ids are checked.
    let default = run_json(m, EDIT, "64", &[]);
    assert_eq!(ids(&default), want, "default (ngram-simple)");
    assert_eq!(default["spec"]["type"], "ngram-simple");
    for extra in [
        &["--spec-type", "ngram-cache"][..],
        &["--spec-draft-n-max", "1"],
    ] {
        let j = run_json(m, EDIT, "64", extra);
        assert_eq!(ids(&j), want, "{extra:?}");
        let (d, a) = (count(&j, "draft_n"), count(&j, "draft_n_accepted"));
        assert!(a <= d, "{j}");
    }
    // Fixed-length drafts do not depend on timing: the answer repeats the prompt's
    // `def total(values):` line, which prompt lookup drafts and the target keeps.
    for extra in [
        &["--spec-fixed", "--spec-draft-n-max", "7"][..],
        &["--spec-fixed", "--spec-draft-n-max", "1"],
    ] {
        let j = run_json(m, EDIT, "64", extra);
        assert_eq!(ids(&j), want, "{extra:?}");
        let (d, a) = (count(&j, "draft_n"), count(&j, "draft_n_accepted"));
        assert!(a > 0 && a < d, "{extra:?}: {j}");
    }

    // The model drafting for itself: every draft token is the target's own greedy choice.
    let own = run_json(
        m,
        EDIT,
        "64",
        &[
            "-md",
            m,
            "--spec-fixed",
            "--spec-draft-n-max",
            "4",
            "--spec-draft-p-min",
            "0",
        ],
    );
    assert_eq!(ids(&own), want, "self-draft");
    let (d, a) = (count(&own, "draft_n"), count(&own, "draft_n_accepted"));
    assert!(d >= 8, "{own}");
    assert_eq!(a, d, "a self-draft must be accepted whole: {own}");
}

/// Rollback by checkpoint and replay (`--spec-rollback replay`, the path of memories that
/// cannot trim) on a real model, 128 tokens past the end of the answer (`--ignore-eos`, so the
/// drafts keep being rejected): every n-gram drafter gives the plain greedy ids, the JSON
/// says the cache rolled back by replay and counts the rounds that did.
#[test]
fn forced_replay_speculative_output_is_the_plain_output() {
    let Some(path) = specula_testkit::real_model("smollm2-135m") else {
        return;
    };
    let m = path.to_str().unwrap();
    let plain = run_json(m, EDIT, "128", &["--spec-type", "none", "--ignore-eos"]);
    let want = ids(&plain);
    assert_eq!(want.len(), 128, "{plain}");
    let trim = run_json(m, EDIT, "128", &["--ignore-eos"]);
    assert_eq!(trim["spec"]["rollback"], "trim", "{trim}");
    assert_eq!(count(&trim, "draft_replays"), 0, "{trim}");
    for extra in [
        &["--spec-rollback", "replay"][..],
        &["--spec-rollback", "replay", "--spec-type", "ngram-cache"],
        &[
            "--spec-rollback",
            "replay",
            "--spec-fixed",
            "--spec-draft-n-max",
            "7",
        ],
        &[
            "--spec-rollback",
            "replay",
            "--spec-fixed",
            "--spec-type",
            "ngram-cache",
        ],
    ] {
        let j = run_json(m, EDIT, "128", &[extra, &["--ignore-eos"]].concat());
        assert_eq!(ids(&j), want, "{extra:?}");
        assert_eq!(j["spec"]["rollback"], "replay", "{j}");
        let (d, a) = (count(&j, "draft_n"), count(&j, "draft_n_accepted"));
        let replays = count(&j, "draft_replays");
        assert!(replays <= count(&j, "draft_rounds"), "{j}");
        if extra.contains(&"--spec-fixed") {
            // Fixed drafts do not depend on timing; the adaptive runs may draft little.
            assert!(a < d, "some drafts must be rejected for replay to run: {j}");
            assert!(replays > 0, "{j}");
        }
    }
}

/// Gemma-3 (sliding window of 512 on 270m; a base model, no chat template, so the prompt is
/// raw text) past its window: a prompt of more than 512 tokens
/// and 160 generated, greedy speculative ids (prompt lookup, the model drafting for itself,
/// rollback by trim and by forced replay) equal the plain ids. This is the memory where a
/// pruning sliding-window cache cannot trim; specula's keeps every position and masks, so
/// verify rows (several positions, each with its own window) and replays must give the bits of
/// plain decoding.
#[test]
fn sliding_window_model_past_its_window_speculates_losslessly() {
    let Some(path) = specula_testkit::real_model("gemma3-270m") else {
        return;
    };
    let m = path.to_str().unwrap();
    // Numbered lines that repeat with small changes: long, and good for prompt lookup.
    let prompt: String = (0..60)
        .map(|i| format!("item {i}: total = total + values[{}]\n", i % 7))
        .collect();
    // Batches of 64 rows: the 15 sliding-window layers keep a ring of 512 + 64 cells, which
    // the prompt and the generation (over 800 positions) wrap.
    let base = ["-c", "2048", "-b", "64", "--ignore-eos"];
    let plain = run_json_with(
        &[],
        m,
        &prompt,
        "160",
        &[&base[..], &["--spec-type", "none"]].concat(),
    );
    assert!(count(&plain, "prompt_n") > 512, "{plain}");
    assert_eq!(plain["kv"]["swa_ring"], 576, "{plain}");
    assert!(count(&plain, "prompt_n") + 160 > 576, "{plain}");
    let want = ids(&plain);
    assert_eq!(want.len(), 160, "{plain}");
    for extra in [
        &[][..],
        &["--spec-rollback", "replay"],
        &["-md", m, "--spec-fixed", "--spec-draft-n-max", "4"],
        &[
            "-md",
            m,
            "--spec-rollback",
            "replay",
            "--spec-draft-n-max",
            "4",
        ],
    ] {
        let j = run_json_with(&[], m, &prompt, "160", &[&base[..], extra].concat());
        assert_eq!(ids(&j), want, "{extra:?}");
    }
    // Drafts longer than a forward may write into the ring (8 rows): verify batches are split
    // and rejections early in a draft run positions again; still the plain output.
    let small = ["-c", "2048", "-b", "8", "--ignore-eos", "--spec-fixed"];
    let j = run_json_with(&[], m, &prompt, "160", &small);
    assert_eq!(j["kv"]["swa_ring"], 520, "{j}");
    assert_eq!(ids(&j), want, "-b 8, prompt lookup of 16");
    assert!(j["spec"]["replayed"].as_u64().unwrap() > 0, "{j}");
    let j = run_json_with(
        &[],
        m,
        &prompt,
        "160",
        &[&small[..], &["-md", m, "--spec-draft-n-max", "12"]].concat(),
    );
    assert_eq!(ids(&j), want, "-b 8, draft model, 12 drafts");
    // Full-size sliding-window layers (`--swa-full`): the same tokens (the ring is attended in
    // position order: the same bits), a larger cache.
    let full = run_json_with(
        &[],
        m,
        &prompt,
        "160",
        &[&base[..], &["--spec-type", "none", "--swa-full"]].concat(),
    );
    assert!(full["kv"].get("swa_ring").is_none(), "{full}");
    let bytes = |j: &Json| j["kv"]["bytes"].as_u64().expect("kv.bytes");
    assert!(bytes(&full) > bytes(&plain), "{full}\n{plain}");
    assert_eq!(ids(&full), want, "--swa-full");
}

#[test]
fn real_pair_speculative_output_is_the_plain_output() {
    let (Some(target), Some(draft)) = (
        specula_testkit::real_model("qwen2.5-coder-1.5b"),
        specula_testkit::real_model("qwen2.5-coder-0.5b"),
    ) else {
        return;
    };
    let (t, d) = (target.to_str().unwrap(), draft.to_str().unwrap());
    let prompt = "Write a quicksort algorithm in Python. Write code only.";
    let plain = run_json(t, prompt, "128", &["--spec-type", "none"]);
    let want = ids(&plain);
    assert_eq!(want.len(), 128, "{plain}");
    let j = run_json(t, prompt, "128", &["-md", d, "--spec-draft-n-max", "16"]);
    assert_eq!(ids(&j), want);
    assert_eq!(j["spec"]["type"], "draft-simple");
    assert!(count(&j, "draft_n_accepted") > 0, "{j}");
}
