//! Snapshots (`insta`) of what the `specula` binary says to a person: the top-level help and
//! every subcommand's help, the main error texts, and `specula inspect` of the committed
//! synthetic GGUF as text and JSON. They guard against unintended changes of these texts: a
//! change shows as a diff of `tests/snapshots/cli_text__*.snap`, to be reviewed and accepted
//! (`cargo insta review`, or `INSTA_UPDATE=always`). Paths that depend on the checkout are
//! redacted.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn specula(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_specula"))
        .args(args)
        .output()
        .expect("the specula binary runs")
}

fn golden(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../golden")
        .join(name)
        .canonicalize()
        .expect("the golden file exists")
}

/// Every subcommand, as `specula --help` lists them.
const SUBCOMMANDS: &[&str] = &[
    "inspect",
    "run",
    "serve",
    "bench",
    "perplexity",
    "quantize",
    "tokenize",
];

/// Stdout of a successful run.
fn stdout_of(args: &[&str]) -> String {
    let out = specula(args);
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// Exit code and stderr of a failing run, with the golden directory's path redacted.
fn error_of(args: &[&str]) -> String {
    let out = specula(args);
    assert!(!out.status.success(), "{args:?} succeeded");
    let dir = golden("gguf");
    let err = String::from_utf8_lossy(&out.stderr).replace(dir.to_str().unwrap(), "[GOLDEN]");
    format!("exit {:?}\n{err}", out.status.code())
}

#[test]
fn top_level_help_lists_the_subcommands() {
    let help = stdout_of(&["--help"]);
    for cmd in SUBCOMMANDS {
        assert!(help.contains(&format!("  {cmd} ")), "{cmd} missing: {help}");
    }
    insta::assert_snapshot!("help", help);
}

#[test]
fn subcommand_help() {
    for cmd in SUBCOMMANDS {
        insta::assert_snapshot!(format!("help_{cmd}"), stdout_of(&[cmd, "--help"]));
    }
}

/// Every subcommand that takes `-md` takes `--dflash` / `--eagle3` too.
#[test]
fn draft_kind_flags_wherever_md_is() {
    for cmd in SUBCOMMANDS {
        let help = stdout_of(&[cmd, "--help"]);
        if help.contains("--model-draft") {
            assert!(help.contains("--dflash"), "{cmd}: {help}");
            assert!(help.contains("--eagle3"), "{cmd}: {help}");
        }
    }
}

#[test]
fn error_texts() {
    let synthetic = golden("gguf/synthetic.gguf");
    let m = synthetic.to_str().unwrap();
    let cases: &[(&str, &[&str])] = &[
        (
            "missing_model_file",
            &["run", "-m", "/nonexistent/model.gguf", "-p", "x"],
        ),
        ("not_a_model", &["run", "-m", m, "-p", "x"]),
        ("negative_temperature", &["run", "-m", m, "--temp", "-1"]),
        ("zero_context", &["run", "-m", m, "-c", "0"]),
        ("unknown_cache_type", &["run", "-m", m, "-ctk", "q9_9"]),
        (
            "weight_format_as_cache_type",
            &["bench", "-m", m, "-ctv", "q4_k"],
        ),
        (
            "bad_layer_range",
            &["run", "-m", m, "--cache-type-k-layers", "3-1:q8_0"],
        ),
        ("not_a_number", &["run", "-n", "many"]),
        ("unknown_flag", &["bench", "--no-such-flag"]),
        (
            "contradicting_draft_flags",
            &["run", "-m", m, "--dflash", "--eagle3"],
        ),
        ("draft_kind_without_md", &["bench", "-m", m, "--eagle3"]),
        (
            "spec_type_contradicts_flag",
            &["serve", "-m", m, "--spec-type", "ngram-simple", "--dflash"],
        ),
        (
            "inspect_missing_file",
            &["inspect", "/nonexistent/model.gguf"],
        ),
    ];
    for (name, args) in cases {
        insta::assert_snapshot!(format!("error_{name}"), error_of(args));
    }
}

#[test]
fn inspect_synthetic() {
    let path = golden("gguf/synthetic.gguf");
    let p = path.to_str().unwrap();
    let redact = |s: String| s.replace(p, "[GOLDEN]/synthetic.gguf");
    insta::assert_snapshot!("inspect_text", redact(stdout_of(&["inspect", p])));
    insta::assert_snapshot!("inspect_json", redact(stdout_of(&["inspect", p, "--json"])));
}

/// Without the `train` feature, `specula train` says how to get it (and the top-level help
/// still lists it).
#[cfg(not(feature = "train"))]
#[test]
fn train_without_the_feature_says_how_to_build_it() {
    let err = error_of(&["train", "dflash", "--features", "f", "-o", "o"]);
    assert!(err.contains("--features train"), "{err}");
}
