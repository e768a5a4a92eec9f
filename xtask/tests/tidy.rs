//! Repository hygiene, checked as a test so that `cargo test` and CI enforce it.
//!
//! Files are those git knows about (tracked, plus untracked ones that are not ignored, so a new
//! file is checked before its first commit); without git, the tree minus `target/`, `.git/` and
//! the Python virtual environment. The needles are assembled with `concat!` so that this file
//! does not match its own checks.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Largest file the repository may hold: models and corpora live in caches, not in git.
const MAX_FILE_BYTES: u64 = 1024 * 1024;

/// How many lines above an `unsafe` block its `// SAFETY:` comment may end.
const SAFETY_WINDOW: usize = 3;

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives one level below the repository root")
        .to_path_buf()
}

/// Repository files, relative to the root, sorted.
fn files() -> Vec<PathBuf> {
    let root = repo_root();
    let git = Command::new("git")
        .args([
            "ls-files",
            "-z",
            "--cached",
            "--others",
            "--exclude-standard",
        ])
        .current_dir(&root)
        .output();
    let mut files: Vec<PathBuf> = match git {
        Ok(out) if out.status.success() => out
            .stdout
            .split(|&b| b == 0)
            .filter(|p| !p.is_empty())
            .map(|p| PathBuf::from(String::from_utf8_lossy(p).into_owned()))
            // A tracked file deleted in the work tree is still listed.
            .filter(|p| root.join(p).is_file())
            .collect(),
        _ => {
            println!("tidy: git unavailable, walking the tree");
            let mut out = Vec::new();
            walk(&root, Path::new(""), &mut out);
            out
        }
    };
    files.sort();
    files.dedup();
    files
}

fn walk(root: &Path, rel: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = fs::read_dir(root.join(rel)) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let rel = rel.join(&name);
        let Ok(ty) = entry.file_type() else { continue };
        if ty.is_dir() {
            let skip = matches!(
                name.to_str(),
                Some("target" | ".git" | ".venv" | "__pycache__")
            );
            if !skip {
                walk(root, &rel, out);
            }
        } else if ty.is_file() {
            out.push(rel);
        }
    }
}

/// The `.rs` files with their text.
fn rust_sources() -> Vec<(PathBuf, String)> {
    let root = repo_root();
    files()
        .into_iter()
        .filter(|p| p.extension().is_some_and(|e| e == "rs"))
        .map(|p| {
            let text = fs::read_to_string(root.join(&p))
                .unwrap_or_else(|e| panic!("reading {}: {e}", p.display()));
            (p, text)
        })
        .collect()
}

fn report(what: &str, checked: usize, problems: &[String]) {
    println!(
        "tidy: {what}: checked {checked}, {} problem(s)",
        problems.len()
    );
    assert!(
        problems.is_empty(),
        "tidy: {what}:\n  {}",
        problems.join("\n  ")
    );
}

/// STYLE.md point 10: a test that cannot run says so at run time instead of hiding.
#[test]
fn no_ignored_or_should_panic_tests() {
    let needles = [concat!("#[", "ignore"), concat!("#[", "should_panic")];
    let sources = rust_sources();
    let mut problems = Vec::new();
    for (path, text) in &sources {
        for (i, line) in text.lines().enumerate() {
            for needle in needles {
                if line.contains(needle) {
                    problems.push(format!(
                        "{}:{}: `{needle}]`: gate the test or print a skip message instead",
                        path.display(),
                        i + 1
                    ));
                }
            }
        }
    }
    report("no ignored/should-panic tests", sources.len(), &problems);
}

/// Crate roots: library and binary roots of the workspace crates, xtask, fuzz targets.
fn is_crate_root(path: &Path) -> bool {
    let parts: Vec<&str> = path.iter().filter_map(|c| c.to_str()).collect();
    matches!(
        parts.as_slice(),
        ["crates", _, "src", "lib.rs" | "main.rs"]
            | ["xtask", "src", "main.rs"]
            | ["fuzz", "fuzz_targets", _]
    )
}

#[test]
fn crate_roots_start_with_docs() {
    let roots: Vec<(PathBuf, String)> = rust_sources()
        .into_iter()
        .filter(|(p, _)| is_crate_root(p))
        .collect();
    assert!(
        roots.iter().any(|(p, _)| p.ends_with("xtask/src/main.rs")),
        "tidy found no crate roots; is the file list right?"
    );
    let problems: Vec<String> = roots
        .iter()
        .filter(|(_, text)| {
            let first = text.lines().find(|l| !l.trim().is_empty()).unwrap_or("");
            !first.starts_with("//!")
        })
        .map(|(p, _)| format!("{}: must start with `//!` crate docs", p.display()))
        .collect();
    for (p, _) in &roots {
        println!("tidy: crate root {}", p.display());
    }
    report("crate roots start with //!", roots.len(), &problems);
}

#[test]
fn no_large_files() {
    let root = repo_root();
    let files = files();
    let problems: Vec<String> = files
        .iter()
        .filter_map(|p| {
            let len = fs::metadata(root.join(p)).ok()?.len();
            (len > MAX_FILE_BYTES).then(|| {
                format!(
                    "{}: {len} bytes ({:.1} MiB) is over the {} MiB limit; keep it out of git",
                    p.display(),
                    len as f64 / (1024.0 * 1024.0),
                    MAX_FILE_BYTES / (1024 * 1024)
                )
            })
        })
        .collect();
    report("files at most 1 MiB", files.len(), &problems);
}

/// Lines of `text` that open an `unsafe` block without a `// SAFETY:` comment on the same line
/// or ending within the [`SAFETY_WINDOW`] lines above (a comment may run over more lines; its
/// lines do not count against the window). Line numbers are 1-based.
fn unjustified_unsafe(text: &str) -> Vec<usize> {
    let needle = concat!("unsafe", " {");
    let marker = concat!("// SAFETY", ":");
    let lines: Vec<&str> = text.lines().collect();
    let justified = |i: usize| {
        if lines[i].contains(marker) {
            return true;
        }
        let mut code_lines = 0;
        for line in lines[..i].iter().rev().map(|l| l.trim_start()) {
            if line.contains(marker) {
                return true;
            }
            if !line.starts_with("//") {
                code_lines += 1;
                if code_lines >= SAFETY_WINDOW {
                    return false;
                }
            }
        }
        false
    };
    (0..lines.len())
        .filter(|&i| {
            let line = lines[i];
            !line.trim_start().starts_with("//") && line.contains(needle) && !justified(i)
        })
        .map(|i| i + 1)
        .collect()
}

#[test]
fn unsafe_blocks_have_safety_comments() {
    let sources = rust_sources();
    let mut blocks = 0;
    let mut problems = Vec::new();
    for (path, text) in &sources {
        blocks += text
            .lines()
            .filter(|l| l.contains(concat!("unsafe", " {")))
            .count();
        for line in unjustified_unsafe(text) {
            problems.push(format!(
                "{}:{line}: `unsafe` block without a `// SAFETY:` comment ending in the \
                 {SAFETY_WINDOW} lines above",
                path.display()
            ));
        }
    }
    report(
        &format!("unsafe blocks justified ({blocks} found)"),
        sources.len(),
        &problems,
    );
}

#[test]
fn the_unsafe_check_sees_what_it_should() {
    let ok = concat!(
        "// SAFETY",
        ": the map outlives the slice.\n",
        "let m = unsafe",
        " { f() };\n"
    );
    let far = concat!(
        "// SAFETY",
        ": too far up.\n\n\n\n",
        "let m = unsafe",
        " { f() };\n"
    );
    let long = concat!(
        "// SAFETY",
        ": a justification\n// that runs over\n// four\n// lines.\n",
        "let m = unsafe",
        " { f() };\n"
    );
    let split = concat!(
        "// SAFETY",
        ": the call is sound.\nlet m =\n    unsafe",
        " { f() };\n"
    );
    let commented = concat!("// an unsafe", " { block } in prose\n");
    assert!(unjustified_unsafe(long).is_empty());
    assert!(unjustified_unsafe(split).is_empty());
    assert!(unjustified_unsafe(ok).is_empty());
    assert_eq!(unjustified_unsafe(far), [5]);
    assert!(unjustified_unsafe(commented).is_empty());
}

#[test]
fn crate_roots_are_recognised() {
    for root in [
        "crates/gguf/src/lib.rs",
        "crates/cli/src/main.rs",
        "xtask/src/main.rs",
        "fuzz/fuzz_targets/gguf_header.rs",
    ] {
        assert!(is_crate_root(Path::new(root)), "{root}");
    }
    for other in [
        "crates/gguf/src/reader.rs",
        "xtask/src/ci.rs",
        "xtask/tests/tidy.rs",
    ] {
        assert!(!is_crate_root(Path::new(other)), "{other}");
    }
}

/// Build output never lands in git: no file of any `target/` directory (cargo's, or the one
/// criterion makes when a bench runs from a crate's own directory) is tracked or left
/// unignored. 192 criterion result files under `crates/cpu/target/` were once committed.
#[test]
fn no_build_output() {
    let files = files();
    let problems = build_output(&files);
    report("no build output (target/)", files.len(), &problems);
}

/// The files of `files` that lie under a directory named `target`.
fn build_output(files: &[PathBuf]) -> Vec<String> {
    files
        .iter()
        .filter(|p| {
            p.components()
                .rev()
                .skip(1)
                .any(|c| c.as_os_str() == "target")
        })
        .map(|p| {
            format!(
                "{}: build output; remove it from git (`target/` is ignored)",
                p.display()
            )
        })
        .collect()
}

#[test]
fn the_build_output_check_sees_what_it_should() {
    let files: Vec<PathBuf> = [
        "crates/cpu/target/criterion/gemv/report/index.html",
        "target/release/specula",
        "crates/cpu/src/target.rs",
        "docs/target",
    ]
    .iter()
    .map(PathBuf::from)
    .collect();
    let found = build_output(&files);
    assert_eq!(found.len(), 2, "{found:?}");
    assert!(found[0].starts_with("crates/cpu/target/criterion"));
    assert!(found[1].starts_with("target/release"));
}
