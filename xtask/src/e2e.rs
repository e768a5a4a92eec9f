//! `cargo xtask e2e`: the official `openai` and `anthropic` Python clients against
//! `specula serve`.
//!
//! Builds the release `specula`, makes (or reuses) a venv in `reference/.venv-e2e` with
//! `openai` and `anthropic` installed from PyPI, starts `specula serve` on the default model
//! with an API key, and runs `reference/e2e_openai.py` (a streamed chat, a plain chat, a
//! completion, a chat with tools, structured output with two choices, the Responses API plain
//! and streamed, a wrong key) and `reference/e2e_anthropic.py` (Messages with a system prompt,
//! streamed and not, count_tokens, tools, a wrong key, a bad request). Needs Python 3 and
//! network access to PyPI the first time; never part of `ci`.

use std::net::SocketAddr;
use std::process::{Command, Stdio};

use anyhow::{Context, Result};

use crate::E2eArgs;
use crate::http::{free_port, terminate, wait_healthy};
use crate::util::{cargo, repo_root, run_cmd};

/// Runs the check.
pub fn run(args: &E2eArgs) -> Result<()> {
    run_cmd(cargo(["build", "--release", "-p", "specula-cli"]).arg("--quiet"))?;
    let root = repo_root();
    let venv = root.join("reference/.venv-e2e");
    let python = venv.join("bin/python");
    if !python.exists() {
        run_cmd(Command::new("python3").args(["-m", "venv"]).arg(&venv))?;
    }
    let has_clients = Command::new(&python)
        .args(["-c", "import openai, anthropic"])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !has_clients {
        run_cmd(Command::new(&python).args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "openai>=1.40",
            "anthropic>=0.40",
        ]))?;
    }
    let port = free_port()?;
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse()?;
    let key = "e2e-key";
    let mut cmd = Command::new(root.join("target/release/specula"));
    cmd.args(["serve", "--port", &port.to_string(), "--api-key", key]);
    cmd.args(["-np", "2", "-c", "4096"]);
    if let Some(m) = &args.model {
        cmd.args(["-m", m]);
    }
    println!("$ {}", crate::util::display(&cmd));
    let mut child = cmd.spawn().context("starting specula serve")?;
    let result = wait_healthy(addr, &mut child).and_then(|()| {
        run_cmd(
            Command::new(&python)
                .arg(root.join("reference/e2e_openai.py"))
                .args(["--base-url", &format!("http://{addr}/v1"), "--api-key", key]),
        )
        .and_then(|()| {
            run_cmd(
                Command::new(&python)
                    .arg(root.join("reference/e2e_anthropic.py"))
                    .args(["--base-url", &format!("http://{addr}"), "--api-key", key]),
            )
        })
    });
    let stopped = terminate(&mut child);
    result?;
    stopped?;
    if !args.quiet {
        println!(
            "e2e: the openai and anthropic clients completed their calls against specula serve"
        );
    }
    Ok(())
}
