//! `specula run --grammar / --grammar-file / -j / -jf` on SmolLM2-135M (skipped with a note
//! when the model is not fetched):
//!
//! - the GBNF fixtures of llama-server (golden/llama_server_grammar/, its own GBNF sampler on
//!   the same model and prompts, greedy) give the same tokens from the CLI, EOS included;
//!   `grammar_arith_text` up to its recorded near tie (10 tokens, see
//!   `server/tests/llama_server_grammar.rs`);
//! - constrained speculative decoding is constrained plain decoding: the model drafting for
//!   itself (unconstrained drafts, cut where the grammar rejects them) and prompt lookup give
//!   the plain constrained ids;
//! - a JSON schema, inline or from a file, yields JSON that follows it;
//! - a grammar that does not compile, a schema that is not JSON, two constraints, and a
//!   constraint with `--force-ids` fail with one line naming the problem.

use std::path::PathBuf;

use serde_json::Value;

mod common;
use common::{json_of, specula};

/// `specula run -m model -p prompt --json` greedy with `extra`; the parsed JSON.
fn run(model: &str, prompt: &str, extra: &[&str]) -> Value {
    run_at(("0", "1"), model, prompt, extra)
}

/// [`run`] at (temperature, top-k) `sampling`.
fn run_at(sampling: (&str, &str), model: &str, prompt: &str, extra: &[&str]) -> Value {
    let mut args = vec![
        "run", "-m", model, "-p", prompt, "-n", "48", "--temp", sampling.0, "--top-k", sampling.1,
        "-t", "2", "-c", "2048", "--json",
    ];
    args.extend_from_slice(extra);
    json_of(&args)
}

fn ids(v: &Value) -> Vec<u64> {
    v["generated_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i.as_u64().unwrap())
        .collect()
}

fn fixture(name: &str) -> Value {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../golden/llama_server_grammar")
        .join(format!("{name}.json"));
    serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap()
}

#[test]
fn gbnf_output_is_llama_servers_and_speculation_keeps_it() {
    let Some(path) = specula_testkit::real_model("smollm2-135m") else {
        return;
    };
    let m = path.to_str().unwrap();
    for (name, equal_for) in [
        ("grammar_yes_no", None),
        ("grammar_yes_no_capital", None),
        ("grammar_arith", None),
        ("grammar_words", None),
        ("grammar_digits", None),
        ("grammar_arith_text", Some(10)),
    ] {
        let g = fixture(name);
        let body = &g["request"]["body"];
        let prompt = body["prompt"].as_str().unwrap();
        let grammar = body["grammar"].as_str().unwrap();
        let plain = run(m, prompt, &["--grammar", grammar, "--spec-type", "none"]);
        let want: Vec<u64> = g["response"]["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap())
            .collect();
        let got = ids(&plain);
        match equal_for {
            None => {
                assert_eq!(got, want, "{name}: tokens");
                // llama-server's content stops before the end-of-generation token.
                assert!(
                    plain["text"]
                        .as_str()
                        .unwrap()
                        .starts_with(g["response"]["content"].as_str().unwrap()),
                    "{name}: {plain}"
                );
            }
            Some(n) => {
                assert_eq!(got[..n], want[..n], "{name}: the first {n} tokens");
                assert_ne!(got[n], want[n], "{name}: the recorded near tie moved");
            }
        }
        // The same grammar from a file.
        let file = std::env::temp_dir().join(format!("specula-cli-{name}.gbnf"));
        std::fs::write(&file, grammar).unwrap();
        let from_file = run(
            m,
            prompt,
            &[
                "--grammar-file",
                file.to_str().unwrap(),
                "--spec-type",
                "none",
            ],
        );
        assert_eq!(ids(&from_file), got, "{name}: --grammar-file");
        std::fs::remove_file(&file).unwrap();
        // Speculative: drafts the grammar rejects are cut before the verify.
        for spec in [
            &[
                "-md",
                m,
                "--spec-fixed",
                "--spec-draft-n-max",
                "4",
                "--spec-draft-p-min",
                "0",
            ][..],
            &["--spec-type", "ngram-simple"],
        ] {
            let mut extra = vec!["--grammar", grammar];
            extra.extend_from_slice(spec);
            let j = run(m, prompt, &extra);
            assert_eq!(ids(&j), got, "{name}: {spec:?}");
        }
    }
}

#[test]
fn a_json_schema_constrains_the_answer_to_json_that_follows_it() {
    let Some(path) = specula_testkit::real_model("smollm2-135m") else {
        return;
    };
    let m = path.to_str().unwrap();
    let g = fixture("json_schema_person");
    let prompt = g["request"]["body"]["prompt"].as_str().unwrap();
    let schema = g["request"]["body"]["json_schema"].to_string();
    let check = |v: &Value, how: &str| {
        let text = v["text"].as_str().unwrap();
        let json: Value = serde_json::from_str(text.trim_end_matches("<|im_end|>"))
            .unwrap_or_else(|e| panic!("{how}: not JSON ({e}): {text:?}"));
        let obj = json.as_object().unwrap();
        assert_eq!(obj.len(), 2, "{how}: {json}");
        assert!(
            obj["name"]
                .as_str()
                .is_some_and(|n| n.chars().count() <= 12),
            "{how}: {json}"
        );
        assert!(
            obj["age"].as_u64().is_some_and(|a| a <= 120),
            "{how}: {json}"
        );
    };
    let inline = run(m, prompt, &["-j", &schema, "--spec-type", "none"]);
    check(&inline, "-j");
    // llama-server's values for the same schema and prompt (its layout differs: it lets the
    // model choose whitespace).
    let theirs: Value = serde_json::from_str(g["response"]["content"].as_str().unwrap()).unwrap();
    let text = inline["text"].as_str().unwrap();
    let ours: Value = serde_json::from_str(text.trim_end_matches("<|im_end|>")).unwrap();
    assert_eq!(
        ours, theirs,
        "the JSON values llama-server's schema sampler gave"
    );
    let file = std::env::temp_dir().join("specula-cli-person.schema.json");
    std::fs::write(&file, &schema).unwrap();
    let from_file = run(
        m,
        prompt,
        &["-jf", file.to_str().unwrap(), "--spec-type", "ngram-simple"],
    );
    std::fs::remove_file(&file).unwrap();
    check(&from_file, "-jf");
    assert_eq!(ids(&from_file), ids(&inline), "-jf with speculation");
    // `{}`: any JSON object, at temperature 1 too. A sampled object may still be open when
    // the 48-token budget runs out: then the text is a JSON prefix (serde_json stops at the
    // end of the input, not at a syntax error) starting an object.
    let any = run_at(("1", "0"), m, prompt, &["-j", "{}", "--seed", "7"]);
    let text = any["text"].as_str().unwrap();
    match serde_json::from_str::<Value>(text.trim_end_matches("<|im_end|>")) {
        Ok(v) => assert!(v.is_object(), "{v}"),
        Err(e) => assert!(
            e.is_eof() && ids(&any).len() == 48 && text.trim_start().starts_with('{'),
            "-j {{}}: not JSON ({e}): {text:?}"
        ),
    }
}

#[test]
fn bad_constraints_fail_with_one_line_naming_them() {
    let Some(path) = specula_testkit::real_model("smollm2-135m") else {
        return;
    };
    let m = path.to_str().unwrap();
    for (extra, want) in [
        (&["--grammar", "root ::= ("][..], "invalid grammar"),
        (&["-j", "{not json"], "is not JSON"),
        (
            &["-j", "{}", "--grammar", "root ::= \"a\""],
            "cannot be used with",
        ),
        (&["-j", "{}", "--force-ids", "1,2"], "--force-ids"),
        (
            &["-jf", "/nonexistent/s.json"],
            "cannot read the JSON schema file",
        ),
    ] {
        let mut args = vec!["run", "-m", m, "-p", "hi", "-n", "4"];
        args.extend_from_slice(extra);
        let out = specula(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{extra:?} succeeded");
        assert!(err.contains(want), "{extra:?}: {err}");
        assert!(!err.contains("panicked"), "{extra:?}: {err}");
    }
}
