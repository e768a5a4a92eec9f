//! What the CLI's integration tests share: running the built `specula` binary.

#![allow(dead_code, reason = "each test crate uses the helpers it needs")]

use std::process::{Command, Output};

/// `specula ARGS`, its output captured.
pub fn specula(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_specula"))
        .args(args)
        .output()
        .expect("the specula binary runs")
}

/// `specula ARGS`, which must succeed and print one JSON object: that object.
pub fn json_of(args: &[&str]) -> serde_json::Value {
    let out = specula(args);
    assert!(
        out.status.success(),
        "specula {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("one JSON object")
}
