//! Build facts for `specula bench`'s `build_commit` and `build_number` (llama-bench's fields):
//! the short commit and the commit count of the git tree the binary is built from, or
//! `unknown` and 0 outside one, as llama.cpp's build reports them.

use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    let s = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    (out.status.success() && !s.is_empty()).then_some(s)
}

fn main() {
    let commit = git(&["rev-parse", "--short=7", "HEAD"]).unwrap_or_else(|| "unknown".into());
    let number = git(&["rev-list", "--count", "HEAD"]).unwrap_or_else(|| "0".into());
    println!("cargo:rustc-env=SPECULA_BUILD_COMMIT={commit}");
    println!("cargo:rustc-env=SPECULA_BUILD_NUMBER={number}");
    println!("cargo:rerun-if-changed=build.rs");
    // A commit or a checkout moves HEAD and appends to its log.
    for p in ["HEAD", "logs/HEAD"] {
        if let Some(path) = git(&["rev-parse", "--git-path", p]) {
            println!("cargo:rerun-if-changed={path}");
        }
    }
}
