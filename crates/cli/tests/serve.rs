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
