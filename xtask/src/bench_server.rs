//! `cargo xtask bench server`: load on `specula serve`.
//!
//! For each `-np` setting (default 1 and 4) it starts the release server on the model, sends
//! `--requests` (32) streaming greedy completions at once, each from its own connection and
//! with its own prompt, and measures the aggregate generated tokens per second over the wall
//! time of the whole batch. Checks: every request answers 200 and ends with `[DONE]`; its
//! stream carries exactly `max_tokens` token ids, as many as its `usage` says (no token lost
//! or duplicated); each request's token ids are the same under every `-np` (batching does not
//! change greedy output). Then, on the last setting, `--disconnects` clients leave after their
//! first chunk while other requests run: every slot must end idle and each departure must be
//! counted as cancelled. Prints a Markdown table for `docs/perf.md`.

use std::io::Read as _;
use std::net::SocketAddr;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use serde_json::{Value, json};

use crate::ServerBenchArgs;
use crate::http::{free_port, request, send, terminate, wait_healthy};
use crate::util::{cargo, repo_root, run_cmd};

/// One streamed request's outcome.
struct Streamed {
    tokens: Vec<u64>,
    usage_tokens: u64,
    done: bool,
}

fn stream_completion(addr: SocketAddr, prompt: &str, max_tokens: usize) -> Result<Streamed> {
    let body = json!({
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": true, "stream": true,
    });
    let r = request(addr, "POST", "/v1/completions", &body.to_string())?;
    ensure!(r.status == 200, "status {}: {}", r.status, r.body);
    let mut out = Streamed {
        tokens: Vec::new(),
        usage_tokens: 0,
        done: false,
    };
    for ev in r.body.split("\n\n") {
        let Some(data) = ev.lines().find_map(|l| l.strip_prefix("data: ")) else {
            continue;
        };
        if data == "[DONE]" {
            out.done = true;
            continue;
        }
        let v: Value =
            serde_json::from_str(data).with_context(|| format!("an SSE event: {data}"))?;
        ensure!(v.get("error").is_none(), "an error event: {v}");
        if let Some(ts) = v["tokens"].as_array() {
            out.tokens.extend(ts.iter().filter_map(Value::as_u64));
        }
        if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
            out.usage_tokens = n;
        }
    }
    Ok(out)
}

fn metric(text: &str, name: &str) -> Result<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix(' ')))
        .with_context(|| format!("no metric {name}"))?
        .parse()
        .context("a metric value")
}

fn prompt(i: usize) -> String {
    format!("Request {i}: tell a short story about the number {i} and a lighthouse.")
}

struct Run {
    np: usize,
    wall: f64,
    tokens: usize,
    busy_per_decode: f64,
    per_request: Vec<Vec<u64>>,
}

fn start(args: &ServerBenchArgs, np: usize) -> Result<(std::process::Child, SocketAddr)> {
    let port = free_port()?;
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse()?;
    let mut cmd = Command::new(repo_root().join("target/release/specula"));
    cmd.args(["serve", "--port", &port.to_string(), "-m", &args.model]);
    cmd.args(["-np", &np.to_string(), "-c", &(1024 * np).to_string()]);
    cmd.args(["-t", &args.threads.to_string(), "--metrics"]);
    cmd.stderr(std::process::Stdio::null());
    println!("$ {}", crate::util::display(&cmd));
    let mut child = cmd.spawn().context("starting specula serve")?;
    if let Err(e) = wait_healthy(addr, &mut child) {
        let _ = child.kill();
        return Err(e);
    }
    Ok((child, addr))
}

fn load(args: &ServerBenchArgs, addr: SocketAddr, np: usize) -> Result<Run> {
    stream_completion(addr, "warm up", 8)?;
    let t0 = Instant::now();
    let results: Vec<Result<Streamed>> = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..args.requests)
            .map(|i| sc.spawn(move || stream_completion(addr, &prompt(i), args.max_tokens)))
            .collect();
        hs.into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| bail!("a client thread panicked"))
            })
            .collect()
    });
    let wall = t0.elapsed().as_secs_f64();
    let mut per_request = Vec::with_capacity(results.len());
    for (i, r) in results.into_iter().enumerate() {
        let r = r.with_context(|| format!("-np {np}: request {i}"))?;
        ensure!(r.done, "-np {np}: request {i} did not end with [DONE]");
        ensure!(
            r.tokens.len() == args.max_tokens && r.usage_tokens == args.max_tokens as u64,
            "-np {np}: request {i} streamed {} tokens, usage says {}, asked {}",
            r.tokens.len(),
            r.usage_tokens,
            args.max_tokens
        );
        per_request.push(r.tokens);
    }
    let m = request(addr, "GET", "/metrics", "")?.body;
    Ok(Run {
        np,
        wall,
        tokens: per_request.iter().map(Vec::len).sum(),
        busy_per_decode: metric(&m, "specula:n_busy_slots_per_decode")?,
        per_request,
    })
}

/// Clients that leave after their first chunk while others run; every slot must end idle.
fn disconnects(args: &ServerBenchArgs, addr: SocketAddr) -> Result<(usize, f64)> {
    let before = metric(
        &request(addr, "GET", "/metrics", "")?.body,
        "specula:requests_cancelled_total",
    )?;
    std::thread::scope(|sc| -> Result<()> {
        let stays: Vec<_> = (0..4)
            .map(|i| sc.spawn(move || stream_completion(addr, &prompt(100 + i), args.max_tokens)))
            .collect();
        let leaves: Vec<_> = (0..args.disconnects)
            .map(|i| {
                sc.spawn(move || -> Result<()> {
                    let body = json!({"prompt": prompt(200 + i), "max_tokens": 900,
                                      "temperature": 0, "ignore_eos": true, "stream": true});
                    let mut s = send(addr, "POST", "/v1/completions", &body.to_string())?;
                    let mut buf = [0u8; 256];
                    let n = s.read(&mut buf)?;
                    ensure!(n > 0, "no first chunk");
                    Ok(())
                })
            })
            .collect();
        for h in leaves {
            h.join()
                .unwrap_or_else(|_| bail!("a client thread panicked"))?;
        }
        for h in stays {
            h.join()
                .unwrap_or_else(|_| bail!("a client thread panicked"))?;
        }
        Ok(())
    })?;
    let t0 = Instant::now();
    loop {
        let slots: Value = serde_json::from_str(&request(addr, "GET", "/slots", "")?.body)?;
        let busy = slots
            .as_array()
            .context("/slots is a list")?
            .iter()
            .filter(|s| s["is_processing"] == true)
            .count();
        if busy == 0 {
            break;
        }
        ensure!(
            t0.elapsed() < Duration::from_secs(120),
            "{busy} slots still busy 120 s after their clients left: {slots}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let after = metric(
        &request(addr, "GET", "/metrics", "")?.body,
        "specula:requests_cancelled_total",
    )?;
    let r = request(
        addr,
        "POST",
        "/v1/completions",
        &json!({"prompt": "after", "max_tokens": 4}).to_string(),
    )?;
    ensure!(
        r.status == 200,
        "a request after the disconnects failed: {}",
        r.body
    );
    Ok((args.disconnects, after - before))
}

/// Runs the bench.
pub fn run(args: &ServerBenchArgs) -> Result<()> {
    run_cmd(cargo(["build", "--release", "-p", "specula-cli"]).arg("--quiet"))?;
    let mut runs = Vec::new();
    let mut gone = None;
    for (k, &np) in args.parallel.iter().enumerate() {
        let (mut child, addr) = start(args, np)?;
        let r = load(args, addr, np).and_then(|run| {
            if k + 1 == args.parallel.len() && args.disconnects > 0 {
                gone = Some(disconnects(args, addr)?);
            }
            Ok(run)
        });
        let stopped = terminate(&mut child);
        runs.push(r?);
        stopped?;
    }
    for r in &runs[1..] {
        for (i, (a, b)) in runs[0].per_request.iter().zip(&r.per_request).enumerate() {
            ensure!(
                a == b,
                "request {i}: -np {} and -np {} streamed different tokens",
                runs[0].np,
                r.np
            );
        }
    }
    println!();
    println!("| -np | requests | tokens | wall s | aggregate t/s | busy slots per decode |");
    println!("|---:|---:|---:|---:|---:|---:|");
    #[allow(clippy::cast_precision_loss, reason = "token counts for rates")]
    for r in &runs {
        println!(
            "| {} | {} | {} | {:.2} | {:.1} | {:.2} |",
            r.np,
            args.requests,
            r.tokens,
            r.wall,
            r.tokens as f64 / r.wall,
            r.busy_per_decode
        );
    }
    println!(
        "\nEvery request: 200, [DONE], {} streamed token ids = usage; token ids identical across -np {:?}.",
        args.max_tokens, args.parallel
    );
    if let Some((left, cancelled)) = gone {
        println!(
            "Disconnects: {left} clients left after their first chunk; {cancelled} requests counted cancelled; every slot idle afterwards."
        );
        #[allow(clippy::cast_precision_loss, reason = "a small count")]
        let left = left as f64;
        ensure!(
            (cancelled - left).abs() < 0.5,
            "{left} clients left but {cancelled} requests were cancelled"
        );
    }
    Ok(())
}
