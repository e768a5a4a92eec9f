//! `specula serve` as a process, on SmolLM2 when it is cached: it answers a streamed request,
//! and SIGTERM while the request runs lets it finish (200, `[DONE]`) before the process exits
//! cleanly. Also: bad flags fail before listening, with a message.

use std::io::{BufRead as _, BufReader, Read as _, Write as _};
use std::net::TcpStream;
use std::process::{Command, Stdio};

fn specula() -> Command {
    Command::new(env!("CARGO_BIN_EXE_specula"))
}

#[test]
fn bad_flags_fail_before_listening() {
    let out = specula()
        .args(["serve", "-m", "/nonexistent.gguf", "--port", "0"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("nonexistent.gguf"), "{err}");
    let out = specula().args(["serve", "-np", "0"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("-np"));
    // As llama-server: --slot-save-path names a directory.
    let out = specula()
        .args([
            "serve",
            "-m",
            "/nonexistent.gguf",
            "--slot-save-path",
            "/nonexistent-dir",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--slot-save-path /nonexistent-dir: not a directory"),
        "{err}"
    );
}

#[cfg(unix)]
#[test]
fn sigterm_lets_the_request_in_flight_finish() {
    let Some(smollm) = specula_testkit::real_model("smollm2-135m") else {
        return;
    };
    let mut child = specula()
        .args([
            "serve",
            "-m",
            smollm.to_str().unwrap(),
            "--port",
            "0",
            "-t",
            "2",
        ])
        .args(["-c", "1024"])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = BufReader::new(child.stderr.take().unwrap());
    let addr = loop {
        let mut line = String::new();
        assert!(err.read_line(&mut line).unwrap() > 0, "the server exited");
        if let Some(rest) = line.split("listening on http://").nth(1) {
            break rest.trim().to_owned();
        }
    };
    let body = r#"{"prompt":"Once upon a time","max_tokens":48,"temperature":0,"ignore_eos":true,"stream":true}"#;
    let mut s = TcpStream::connect(&addr).unwrap();
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    // The first token has arrived: the request is in flight.
    let mut first = [0u8; 64];
    assert!(s.read(&mut first).unwrap() > 0);
    let pid = child.id().to_string();
    assert!(
        Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success()
    );
    let mut rest = Vec::new();
    s.read_to_end(&mut rest).unwrap();
    let text = String::from_utf8_lossy(&first).into_owned() + &String::from_utf8_lossy(&rest);
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert!(text.contains("\"completion_tokens\":48"), "{text}");
    assert!(text.contains("data: [DONE]"), "{text}");
    let status = child.wait().unwrap();
    assert!(status.success(), "{status}");
    let mut log = String::new();
    err.read_to_string(&mut log).unwrap();
    assert!(log.contains("SIGTERM"), "{log}");
}

/// Reads the server's stderr up to its "listening" line; returns the address and the lines
/// before it.
fn listening(
    child: &mut std::process::Child,
) -> (String, Vec<String>, BufReader<std::process::ChildStderr>) {
    let mut err = BufReader::new(child.stderr.take().unwrap());
    let mut lines = Vec::new();
    loop {
        let mut line = String::new();
        assert!(
            err.read_line(&mut line).unwrap() > 0,
            "the server exited: {lines:?}"
        );
        if let Some(rest) = line.split("listening on http://").nth(1) {
            return (rest.trim().to_owned(), lines, err);
        }
        lines.push(line);
    }
}

/// One HTTP request; the status and the body.
fn http(addr: &str, method: &str, path: &str, key: Option<&str>, body: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    let auth = key.map_or_else(String::new, |k| format!("Authorization: Bearer {k}\r\n"));
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n{auth}Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).unwrap();
    let status = raw.split(' ').nth(1).unwrap().parse().unwrap();
    let body = raw.split_once("\r\n\r\n").map_or("", |(_, b)| b).to_owned();
    (status, body)
}

/// An unmodified llama-server command line, every deployment flag spelled as llama-server
/// spells it (short, long, `=`), starts a healthy server on a tiny model: the flags that
/// cannot apply print one notice line each, the API key file's keys open it, `--metrics`
/// serves /metrics, `--chat-template chatml` renders chats, `-n 6` caps a request.
#[test]
fn a_llama_server_command_line_starts_a_healthy_server() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("tiny.gguf");
    std::fs::write(
        &model,
        specula_testkit::tiny::target("llama").to_bytes().unwrap(),
    )
    .unwrap();
    let keys = dir.path().join("keys.txt");
    std::fs::write(&keys, "# deploy keys\nfile-key\n").unwrap();
    let m = model.to_str().unwrap();
    let key_file = keys.to_str().unwrap();
    let mut child = specula()
        .args(["serve", "-m", m, "--host", "127.0.0.1", "--port", "0"])
        .args([
            "-a",
            "tiny-alias, second ,",
            "-c",
            "1024",
            "-np",
            "2",
            "-t",
            "2",
        ])
        .args([
            "--temp",
            "0.8",
            "--seed",
            "42",
            "--top-k",
            "40",
            "--top-p=0.9",
        ])
        .args([
            "--min-p",
            "0.05",
            "--repeat-penalty",
            "1.1",
            "--repeat-last-n",
            "64",
        ])
        .args(["--presence-penalty", "0.0", "--frequency-penalty", "0.0"])
        .args([
            "-n", "6", "-b", "256", "-ub", "128", "-fa", "on", "-ctk", "f16", "-ctv=f16",
        ])
        .args([
            "--cont-batching",
            "--kv-unified",
            "--no-context-shift",
            "--metrics",
        ])
        .args(["--slots", "--slot-save-path", dir.path().to_str().unwrap()])
        .args([
            "--jinja",
            "--chat-template",
            "chatml",
            "--reasoning-format",
            "none",
        ])
        .args([
            "--cors-origins",
            "*",
            "--api-key",
            "cli-key",
            "--api-key-file",
            key_file,
        ])
        .args([
            "--offline",
            "--no-webui",
            "--timeout",
            "60",
            "--threads-http",
            "2",
        ])
        .args(["-ngl", "99", "--mlock", "--no-mmap", "-v"])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (addr, before, _err) = listening(&mut child);
    let notices: Vec<&String> = before.iter().filter(|l| l.contains("ignored:")).collect();
    for flag in [
        "-ngl",
        "--kv-unified",
        "--cors-origins",
        "--mlock",
        "--no-mmap",
    ] {
        assert!(
            notices
                .iter()
                .any(|l| l.contains(&format!("ignored: {flag} ("))),
            "{flag}: {notices:?}"
        );
    }
    assert!(!before.iter().any(|l| l.contains("Usage")), "{before:?}");
    let (status, body) = http(&addr, "GET", "/health", None, "");
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("\"ok\""), "{body}");
    let prompt = r#"{"prompt":"Once upon a time","ignore_eos":true}"#;
    assert_eq!(http(&addr, "POST", "/v1/completions", None, prompt).0, 401);
    for key in ["cli-key", "file-key"] {
        let (status, body) = http(&addr, "POST", "/v1/completions", Some(key), prompt);
        assert_eq!(status, 200, "{body}");
        assert!(body.contains("\"completion_tokens\":6"), "{body}");
        assert!(body.contains("\"model\":\"second\""), "{body}");
    }
    let chat = r#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":2}"#;
    let (status, body) = http(&addr, "POST", "/v1/chat/completions", Some("cli-key"), chat);
    assert_eq!(status, 200, "{body}");
    let (status, body) = http(&addr, "GET", "/metrics", Some("cli-key"), "");
    assert_eq!(status, 200, "{body}");
    // -a: comma-separated names, sorted; the first names the model.
    let (status, body) = http(&addr, "GET", "/v1/models", None, "");
    assert_eq!(status, 200, "{body}");
    assert!(
        body.contains(r#""aliases":["second","tiny-alias"]"#),
        "{body}"
    );
    assert!(body.contains(r#""id":"second""#), "{body}");
    // --slot-save-path turns the slot actions on.
    let save = r#"{"filename":"cli-slot.bin"}"#;
    let (status, body) = http(&addr, "POST", "/slots/0?action=save", Some("cli-key"), save);
    assert_eq!(status, 200, "{body}");
    assert!(dir.path().join("cli-slot.bin").is_file(), "{body}");
    child.kill().unwrap();
    child.wait().unwrap();
}

/// Without `--metrics`, /metrics answers llama-server's 501; `--no-slots` turns /slots off the
/// same way.
#[test]
fn metrics_off_by_default_and_no_slots() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("tiny.gguf");
    std::fs::write(
        &model,
        specula_testkit::tiny::target("llama").to_bytes().unwrap(),
    )
    .unwrap();
    let mut child = specula()
        .args([
            "serve",
            "-m",
            model.to_str().unwrap(),
            "--port",
            "0",
            "-c",
            "256",
        ])
        .args(["--no-slots", "--log-disable"])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (addr, _, _err) = listening(&mut child);
    let (status, body) = http(&addr, "GET", "/metrics", None, "");
    assert_eq!(status, 501, "{body}");
    assert!(body.contains("\"not_supported_error\""), "{body}");
    assert_eq!(http(&addr, "GET", "/slots", None, "").0, 501);
    child.kill().unwrap();
    child.wait().unwrap();
}

/// A flag that cannot be served is refused in one line, not a usage dump.
#[test]
fn embedding_and_unknown_template_are_refused_in_one_line() {
    for (args, needle) in [
        (&["--embedding"][..], "embeddings are not served"),
        (&["--chat-template", "nosuch"][..], "chatml, llama3, zephyr"),
        (&["--host", "127.0.0.1,::1"][..], "one address only"),
    ] {
        let out = specula()
            .args(["serve", "-m", "/nonexistent.gguf", "--port", "0"])
            .args(args)
            .output()
            .unwrap();
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(needle), "{args:?}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{args:?}: {err}");
    }
}
