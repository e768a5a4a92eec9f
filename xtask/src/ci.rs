//! `cargo xtask ci`: every check CI runs, in one command, failing at the first broken step.
//!
//! Nothing here downloads a model: tests that need one print a skip message when it is not in
//! the cache. `.ci/run` fetches every model first and sets `SPECULA_REQUIRE_MODELS`, under
//! which such a skip is a failure. `flake.nix` is parsed when `nix-instantiate` is present.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

use anyhow::{Context, Result, bail};

use crate::util::{Steps, cargo, display, run_cmd, succeeds};
use crate::{CiArgs, FuzzArgs, fuzz};

pub fn run(args: &CiArgs) -> Result<()> {
    let mut steps = Steps::new(9);
    steps.step("llvm for cubecl", ensure_llvm)?;
    steps.step("fmt", || {
        run_cmd(&mut cargo(["fmt", "--all", "--", "--check"]))?;
        run_cmd(&mut cargo([
            "fmt",
            "--manifest-path",
            "fuzz/Cargo.toml",
            "--",
            "--check",
        ]))
    })?;
    steps.step("flake", || {
        // The dev shell's flake must at least parse; Nix is optional on CI machines.
        if succeeds(Command::new("nix-instantiate").arg("--version")) {
            run_cmd(
                Command::new("nix-instantiate")
                    .args(["--parse", "flake.nix"])
                    .stdout(Stdio::null()),
            )
        } else {
            println!("nix-instantiate is not installed; flake.nix not parsed");
            Ok(())
        }
    })?;
    steps.step("clippy", || {
        run_cmd(&mut cargo([
            "clippy",
            "--workspace",
            "--all-targets",
            "--locked",
            "--",
            "-D",
            "warnings",
        ]))?;
        // The CLI with the CUDA backend compiled in (`--device cuda`), drafter training on
        // CUDA too (`specula train --device cuda`, burn's CubeCL backend): builds without a
        // CUDA toolkit; cudarc's bindings pinned to the CUDA 13.0 API `cargo xtask gpu` uses.
        run_cmd(
            cargo([
                "clippy",
                "-p",
                "specula-cli",
                "--features",
                "cuda,train",
                "--all-targets",
                "--locked",
                "--",
                "-D",
                "warnings",
            ])
            .env("CUDARC_CUDA_VERSION", "13000"),
        )?;
        // The CLI with drafter training (burn) compiled in.
        run_cmd(&mut cargo([
            "clippy",
            "-p",
            "specula-cli",
            "--features",
            "train",
            "--all-targets",
            "--locked",
            "--",
            "-D",
            "warnings",
        ]))
    })?;
    steps.step("tests", || {
        // Passing tests' own output is shown so that CI logs carry the skip messages of
        // tests whose model or device is missing.
        if succeeds(&mut cargo(["nextest", "--version"])) {
            run_nextest(&mut cargo([
                "nextest",
                "run",
                "--workspace",
                "--locked",
                "--no-fail-fast",
                "--success-output",
                "final",
            ]))
        } else {
            println!("cargo-nextest is not installed; using cargo test");
            run_cmd(&mut cargo([
                "test",
                "--workspace",
                "--locked",
                "--no-fail-fast",
                "--",
                "--show-output",
            ]))
        }
    })?;
    steps.step("train smoke", || {
        // `specula train` exists only with the `train` feature, which `--workspace` leaves
        // off: its end-to-end test (extract, train, resume, export, draft losslessly) here.
        run_cmd(&mut cargo([
            "test",
            "-p",
            "specula-cli",
            "--features",
            "train",
            "--locked",
            "--test",
            "train",
            "--",
            "--show-output",
        ]))
    })?;
    // nextest does not run doctests; plain `cargo test` ran them above, but twice is cheap.
    steps.step("doctests", || {
        run_cmd(&mut cargo(["test", "--workspace", "--doc", "--locked"]))
    })?;
    steps.step("rustdoc", || {
        // RUSTDOCFLAGS reaches rustdoc only, so the shared target directory stays valid.
        let mut cmd = cargo(["doc", "--workspace", "--no-deps", "--locked"]);
        run_cmd(cmd.env("RUSTDOCFLAGS", "-D warnings"))
    })?;
    steps.step("fuzz", || {
        for target in fuzz::targets()? {
            fuzz::run(&FuzzArgs {
                seconds: args.fuzz_seconds,
                target,
                libfuzzer_args: Vec::new(),
            })?;
        }
        Ok(())
    })?;
    steps.summary();
    println!("ci: all checks passed");
    Ok(())
}

/// Makes sure cubecl-llvm's build finds an LLVM without downloading one: nothing to do when
/// `.ci/install-llvm.sh` (or a download) already filled the bundler's directory, else runs
/// the script (Debian's `llvm-22-dev`; needs root and apt).
fn ensure_llvm() -> Result<()> {
    let data = std::env::var_os("XDG_DATA_HOME")
        .map(std::path::PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| std::path::Path::new(&h).join(".local/share")))
        .context("neither XDG_DATA_HOME nor HOME is set")?;
    let marker = data.join("tracel/tracel-llvm-23.1.0-4/.tracel-llvm-installed");
    if marker.exists() {
        println!(
            "LLVM for cubecl: {}",
            marker.parent().unwrap_or(&marker).display()
        );
        return Ok(());
    }
    run_cmd(Command::new("bash").arg(crate::util::repo_root().join(".ci/install-llvm.sh")))
}

/// Runs nextest with its log forwarded through [`SuccessOutput`].
fn run_nextest(cmd: &mut Command) -> Result<()> {
    let shown = display(cmd);
    println!("$ {shown}");
    let mut child = cmd
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("could not start `{shown}`"))?;
    let mut filter = SuccessOutput::default();
    let mut print = |line: &str| eprint!("{line}");
    if let Some(stderr) = child.stderr.take() {
        let mut reader = BufReader::new(stderr);
        let mut buf = Vec::new();
        while reader.read_until(b'\n', &mut buf)? > 0 {
            filter.push(&String::from_utf8_lossy(&buf), &mut print);
            buf.clear();
        }
    }
    filter.finish(&mut print);
    if filter.quiet > 0 {
        println!(
            "({} passing tests printed nothing of their own; not shown)",
            filter.quiet
        );
    }
    let status = child
        .wait()
        .with_context(|| format!("waiting for `{shown}`"))?;
    if !status.success() {
        bail!("`{shown}` failed ({status})");
    }
    Ok(())
}

/// Filters what nextest prints after its summary with `--success-output final`: the captured
/// output of every passing test, most of it the test harness's own `running 1 test` lines.
/// Only tests that printed something themselves (a skip message, say) are kept; everything
/// before the summary, and every entry with other content (failures), passes unchanged.
#[derive(Debug, Default)]
struct SuccessOutput {
    after_summary: bool,
    entry: Vec<String>,
    entry_has_content: bool,
    /// Entries dropped for having nothing but harness output.
    quiet: usize,
}

impl SuccessOutput {
    fn push(&mut self, line: &str, out: &mut impl FnMut(&str)) {
        let plain = strip_ansi(line);
        let text = plain.trim();
        if !self.after_summary {
            out(line);
            self.after_summary = text.starts_with("Summary [");
            return;
        }
        if is_status_line(text) {
            self.flush(out);
        } else if self.entry.is_empty() {
            out(line);
            return;
        } else if !is_harness_output(text) {
            self.entry_has_content = true;
        }
        self.entry.push(line.to_owned());
    }

    fn flush(&mut self, out: &mut impl FnMut(&str)) {
        if self.entry_has_content {
            self.entry.iter().for_each(|l| out(l));
        } else if !self.entry.is_empty() {
            self.quiet += 1;
        }
        self.entry.clear();
        self.entry_has_content = false;
    }

    fn finish(&mut self, out: &mut impl FnMut(&str)) {
        self.flush(out);
    }
}

/// `PASS [   0.010s] (1/85) crate::binary test_name`: an upper-case status, then ` [`.
fn is_status_line(text: &str) -> bool {
    text.split_once(" [")
        .is_some_and(|(word, _)| !word.is_empty() && word.bytes().all(|b| b.is_ascii_uppercase()))
}

/// Blank lines, `stdout ───` headers and what libtest prints around a passing test.
fn is_harness_output(text: &str) -> bool {
    text.is_empty()
        || ((text.starts_with("stdout") || text.starts_with("stderr")) && text.ends_with('─'))
        || (text.starts_with("running ") && (text.ends_with(" test") || text.ends_with(" tests")))
        || (text.starts_with("test ") && text.ends_with(" ... ok"))
        || text.starts_with("test result: ok.")
}

/// `line` without ANSI colour sequences (`ESC [ ... letter`).
fn strip_ansi(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            if chars.next() == Some('[') {
                for c in chars.by_ref() {
                    if ('@'..='~').contains(&c) {
                        break;
                    }
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const LOG: &str = "\
   Compiling xtask v0.1.0
\u{1b}[32;1m        PASS\u{1b}[0m [   0.005s] (1/3) xtask::bin/xtask tests::a
\u{1b}[32;1m     Summary\u{1b}[0m [   0.550s] 3 tests run: 3 passed, 0 skipped
\u{1b}[32;1m        PASS\u{1b}[0m [   0.026s] (1/3) xtask::bin/xtask tests::a
\u{1b}[32;1m \u{1b}[0m \u{1b}[32;1mstdout\u{1b}[0m \u{1b}[32;1m───\u{1b}[0m

    running 1 test
    test tests::a ... ok

    test result: ok. 1 passed; 0 failed; 0 ignored; 0 measured; 3 filtered out; finished in 0.02s
    \u{1b}[0m

        PASS [   0.165s] (2/3) specula-cli::inspect real_models_when_fetched
  stdout ───

    running 1 test
    test real_models_when_fetched ... ok

    test result: ok. 1 passed; 0 failed; 0 ignored; 0 measured; 3 filtered out; finished in 0.16s
  stderr ───
    skipped: smollm2-135m not fetched
        PASS [   0.001s] (3/3) xtask::bin/xtask tests::c
  stdout ───
    running 1 test
    test tests::c ... ok
error: test run failed
";

    #[test]
    fn only_tests_with_their_own_output_are_shown_after_the_summary() {
        let mut filter = SuccessOutput::default();
        let mut kept = String::new();
        for line in LOG.split_inclusive('\n') {
            filter.push(line, &mut |l| kept.push_str(l));
        }
        filter.finish(&mut |l| kept.push_str(l));
        assert_eq!(filter.quiet, 1);
        assert!(kept.contains("Compiling xtask"));
        assert!(kept.contains("(1/3) xtask::bin/xtask tests::a\n\u{1b}[32;1m     Summary"));
        assert!(!kept.contains("finished in 0.02s"));
        assert!(kept.contains("skipped: smollm2-135m not fetched"));
        assert!(kept.contains("real_models_when_fetched ... ok"));
        assert!(kept.contains("error: test run failed"));
    }

    #[test]
    fn ansi_colours_are_stripped() {
        assert_eq!(strip_ansi("\u{1b}[32;1mPASS\u{1b}[0m [ 1s]"), "PASS [ 1s]");
    }
}
