//! `cargo xtask fuzz`: libFuzzer on stable Rust, without cargo-fuzz.
//!
//! cargo-fuzz's default build (`--sanitizer none`) needs no nightly feature: coverage comes from
//! LLVM's SanitizerCoverage pass, which stable rustc runs when asked with `-Cpasses`, and
//! `libfuzzer-sys` compiles libFuzzer itself with the C++ compiler. So we pass the same kind of
//! flags to a plain `cargo build` of the standalone `fuzz/` crate and run the binary ourselves,
//! with a corpus under `target/fuzz/` seeded from the committed golden files.

use std::collections::BTreeSet;
use std::fs;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::time::Instant;

use anyhow::{Context, Result, bail};

use crate::FuzzArgs;
use crate::util::{cargo, display, rel, repo_root, run_cmd, secs};

/// Instrumentation for libFuzzer, as cargo-fuzz sets it for `--sanitizer none` in release
/// mode, plus debug assertions and overflow checks so that arithmetic bugs become crashes.
const RUSTFLAGS: &[&str] = &[
    "-Cpasses=sancov-module",
    "-Cllvm-args=-sanitizer-coverage-level=4",
    "-Cllvm-args=-sanitizer-coverage-inline-8bit-counters",
    "-Cllvm-args=-sanitizer-coverage-pc-table",
    "-Cllvm-args=-sanitizer-coverage-trace-compares",
    "-Cllvm-args=-sanitizer-coverage-stack-depth",
    // Keeps each condition its own branch, so that its coverage is seen separately.
    "-Cllvm-args=-simplifycfg-branch-fold-threshold=0",
    "--cfg",
    "fuzzing",
    "-Cdebug-assertions",
    "-Coverflow-checks",
];

/// libFuzzer limits for every run: 2 GiB of memory, 10 s per input.
const LIMITS: &[&str] = &["-rss_limit_mb=2048", "-timeout=10", "-print_final_stats=1"];

fn fuzz_dir() -> PathBuf {
    repo_root().join("fuzz")
}

fn work_dir() -> PathBuf {
    repo_root().join("target").join("fuzz")
}

/// The fuzz targets: the file stems of `fuzz/fuzz_targets/*.rs`, sorted.
pub fn targets() -> Result<Vec<String>> {
    let dir = fuzz_dir().join("fuzz_targets");
    let mut names = Vec::new();
    for entry in fs::read_dir(&dir).with_context(|| format!("listing {}", dir.display()))? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "rs")
            && let Some(stem) = path.file_stem().and_then(|s| s.to_str())
        {
            names.push(stem.to_owned());
        }
    }
    names.sort();
    Ok(names)
}

/// The host target triple. Building for an explicit `--target` keeps `RUSTFLAGS` away from
/// build scripts and proc macros, which must not be instrumented (they would not link).
fn host_triple() -> Result<String> {
    let out = Command::new("rustc")
        .arg("-vV")
        .current_dir(repo_root())
        .output()
        .context("running `rustc -vV`")?;
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .find_map(|l| l.strip_prefix("host: "))
        .map(str::to_owned)
        .context("`rustc -vV` printed no `host:` line")
}

/// Seed inputs for `target`: files in the repository that it should parse (`gguf_header`:
/// the golden GGUF files; `model_load`: one input per tiny seed model, `fuzz/seeds/model_load`).
fn seeds(target: &str) -> Result<Vec<PathBuf>> {
    let (dir, ext) = match target {
        "gguf_header" => (repo_root().join("golden").join("gguf"), Some("gguf")),
        "model_load" => (repo_root().join("fuzz").join("seeds").join(target), None),
        _ => return Ok(Vec::new()),
    };
    let mut seeds = Vec::new();
    for entry in fs::read_dir(&dir).with_context(|| format!("listing {}", dir.display()))? {
        let path = entry?.path();
        if ext.is_none_or(|x| path.extension().is_some_and(|e| e == x)) {
            seeds.push(path);
        }
    }
    seeds.sort();
    Ok(seeds)
}

fn list_files(dir: &Path) -> Result<BTreeSet<PathBuf>> {
    let mut files = BTreeSet::new();
    for entry in fs::read_dir(dir).with_context(|| format!("listing {}", dir.display()))? {
        files.insert(entry?.path());
    }
    Ok(files)
}

/// Whether a libFuzzer log line is routine progress (a new or reduced corpus entry, the
/// recommended dictionary) rather than something worth a CI log line.
fn is_progress(line: &str) -> bool {
    let event = line
        .strip_prefix('#')
        .and_then(|l| l.split_once('\t'))
        .map(|(n, rest)| (n.bytes().all(|b| b.is_ascii_digit()), rest));
    matches!(event, Some((true, rest)) if rest.starts_with("NEW") || rest.starts_with("REDUCE"))
        || line.contains("# Uses: ")
        || line.contains("ecommended dictionary. #####")
}

/// What a libFuzzer run left behind.
struct Outcome {
    status: ExitStatus,
    /// The inputs it wrote to disk as crashes, timeouts, leaks or out-of-memory cases.
    written: Vec<PathBuf>,
}

/// Runs libFuzzer with inherited stdout and its log forwarded without the routine progress
/// lines, noting the inputs it says it wrote.
fn run_quietly(cmd: &mut Command) -> Result<Outcome> {
    let shown = display(cmd);
    println!("$ {shown}");
    let mut child = cmd
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("could not start `{shown}`"))?;
    let mut hidden = 0_u64;
    let mut written = Vec::new();
    if let Some(stderr) = child.stderr.take() {
        let mut reader = BufReader::new(stderr);
        let mut buf = Vec::new();
        while reader.read_until(b'\n', &mut buf)? > 0 {
            let line = String::from_utf8_lossy(&buf);
            if is_progress(&line) {
                hidden += 1;
            } else {
                eprint!("{line}");
            }
            if let Some((_, path)) = line.split_once("Test unit written to ") {
                written.push(PathBuf::from(path.trim_end()));
            }
            buf.clear();
        }
    }
    let status = child
        .wait()
        .with_context(|| format!("waiting for `{shown}`"))?;
    println!("({hidden} routine progress lines of libFuzzer not shown)");
    Ok(Outcome { status, written })
}

pub fn run(args: &FuzzArgs) -> Result<()> {
    let target = args.target.as_str();
    let all = targets()?;
    if !all.iter().any(|t| t == target) {
        bail!(
            "unknown fuzz target `{target}`; fuzz/fuzz_targets/ has: {}",
            all.join(", ")
        );
    }
    let triple = host_triple()?;
    let work = work_dir();

    let t = Instant::now();
    let mut build = cargo(["build", "--release", "--locked", "--manifest-path"]);
    build
        .arg(fuzz_dir().join("Cargo.toml"))
        .arg("--target-dir")
        .arg(&work)
        .args(["--target", &triple, "--bin", target])
        .env("RUSTFLAGS", RUSTFLAGS.join(" "))
        // Cargo prefers this one over RUSTFLAGS; an outer cargo may have set it.
        .env_remove("CARGO_ENCODED_RUSTFLAGS");
    run_cmd(&mut build).context(
        "building the fuzz target (if fuzz/Cargo.lock is out of date because a dependency of \
         specula-gguf changed, run `cargo update --manifest-path fuzz/Cargo.toml --workspace` \
         and commit it)",
    )?;
    println!("built {target} in {}", secs(t.elapsed()));
    let bin = work.join(&triple).join("release").join(target);

    let corpus = work.join("corpus").join(target);
    let artifacts = work.join("artifacts").join(target);
    for dir in [&corpus, &artifacts] {
        fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let seeds = seeds(target)?;
    for seed in &seeds {
        let name = seed.file_name().context("seed without a file name")?;
        fs::copy(seed, corpus.join(name))
            .with_context(|| format!("copying seed {}", seed.display()))?;
    }
    println!(
        "corpus {} ({} seeds from the repository)",
        rel(&corpus).display(),
        seeds.len()
    );

    let before = list_files(&artifacts)?;
    let mut fuzz = Command::new(&bin);
    fuzz.current_dir(repo_root())
        .arg(format!("-max_total_time={}", args.seconds))
        .args(LIMITS)
        // libFuzzer pastes the prefix in front of the file name: the slash is needed.
        .arg(format!("-artifact_prefix={}/", artifacts.display()))
        .args(&args.libfuzzer_args)
        .arg(&corpus);
    let Outcome {
        status,
        mut written,
    } = run_quietly(&mut fuzz)?;
    // Also whatever appeared in the artifact directory, in case the log line changes.
    written.extend(list_files(&artifacts)?.difference(&before).cloned());
    written.sort();
    written.dedup();
    if !status.success() || !written.is_empty() {
        for artifact in &written {
            println!("failing input: {}", rel(artifact).display());
            println!(
                "  reproduce with: {} {}",
                rel(&bin).display(),
                rel(artifact).display()
            );
        }
        let paths: Vec<String> = written
            .iter()
            .map(|p| rel(p).display().to_string())
            .collect();
        bail!(
            "fuzz target `{target}` failed ({status}); failing input(s): {}",
            if paths.is_empty() {
                "none written".to_owned()
            } else {
                paths.join(", ")
            }
        );
    }
    println!("fuzz target `{target}`: no failure in {}s", args.seconds);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_lines_are_told_apart_from_findings() {
        assert!(is_progress(
            "#4096\tNEW    cov: 837 ft: 2177 corp: 310/449Kb exec/s: 72543 rss: 29Mb"
        ));
        assert!(is_progress(
            "#65536\tREDUCE cov: 837 ft: 2178 corp: 311/452Kb"
        ));
        assert!(is_progress("\"test.u8\" # Uses: 220"));
        assert!(!is_progress(
            "#131072\tpulse  cov: 837 ft: 2178 exec/s: 65536"
        ));
        assert!(!is_progress("==1234== ERROR: libFuzzer: deadly signal"));
        assert!(!is_progress("stat::average_exec_per_sec:     65469"));
    }

    #[test]
    fn the_gguf_header_target_exists_and_has_seeds() {
        assert!(targets().unwrap().contains(&"gguf_header".to_owned()));
        assert!(!seeds("gguf_header").unwrap().is_empty());
    }

    /// One seed per tiny model (four architectures, three drafters): the first byte of an
    /// input picks the model.
    #[test]
    fn the_model_load_target_exists_and_seeds_every_model() {
        assert!(targets().unwrap().contains(&"model_load".to_owned()));
        let mut firsts: Vec<u8> = seeds("model_load")
            .unwrap()
            .iter()
            .map(|p| fs::read(p).unwrap()[0])
            .collect();
        firsts.sort_unstable();
        assert_eq!(firsts, [0, 1, 2, 3, 4, 5, 6]);
    }
}
