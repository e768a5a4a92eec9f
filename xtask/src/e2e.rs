//! `cargo xtask e2e`: the official `openai` Python client against `specula serve`.
//!
//! Builds the release `specula`, makes (or reuses) a venv in `reference/.venv-e2e` with
//! `openai` installed from PyPI, starts `specula serve` on the default model with an API key,
//! and runs `reference/e2e_openai.py` (a streamed chat, a plain chat, a completion, structured
//! output with two choices, the Responses API plain and streamed, a wrong key). Needs Python 3 and
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
    let has_openai = Command::new(&python)
        .args(["-c", "import openai"])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !has_openai {
        run_cmd(Command::new(&python).args(["-m", "pip", "install", "--quiet", "openai>=1.40"]))?;
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
    });
    let stopped = terminate(&mut child);
    result?;
    stopped?;
    if !args.quiet {
        println!("e2e: the openai client completed a streamed chat against specula serve");
    }
    Ok(())
}
