//! A minimal blocking HTTP/1.1 client for the server chores (e2e, load bench): one request
//! per connection, `Connection: close`, chunked bodies decoded.

use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use anyhow::{Context, Result, bail};

/// An answer.
#[derive(Debug)]
pub struct Resp {
    pub status: u16,
    pub body: String,
}

fn dechunk(mut b: &[u8]) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let eol = b
            .windows(2)
            .position(|w| w == b"\r\n")
            .context("a chunk size line")?;
        let line = std::str::from_utf8(&b[..eol])?;
        let size = usize::from_str_radix(line.split(';').next().unwrap_or("").trim(), 16)?;
        if size == 0 {
            return Ok(out);
        }
        let data = b
            .get(eol + 2..eol + 2 + size)
            .context("a truncated chunk")?;
        out.extend_from_slice(data);
        b = b.get(eol + 4 + size..).unwrap_or(&[]);
    }
}

/// Opens a connection and writes a request.
pub fn send(addr: SocketAddr, method: &str, path: &str, body: &str) -> Result<TcpStream> {
    let mut s = TcpStream::connect(addr).with_context(|| format!("connecting to {addr}"))?;
    s.set_read_timeout(Some(Duration::from_secs(600)))?;
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes())?;
    Ok(s)
}

/// One request, the whole answer.
pub fn request(addr: SocketAddr, method: &str, path: &str, body: &str) -> Result<Resp> {
    let mut s = send(addr, method, path, body)?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)?;
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .context("an HTTP head")?;
    let head = String::from_utf8_lossy(&raw[..split]).to_ascii_lowercase();
    let status: u16 = head
        .split(' ')
        .nth(1)
        .context("a status")?
        .parse()
        .context("a numeric status")?;
    let body = &raw[split + 4..];
    let body = if head.contains("transfer-encoding: chunked") {
        dechunk(body)?
    } else {
        body.to_vec()
    };
    Ok(Resp {
        status,
        body: String::from_utf8_lossy(&body).into_owned(),
    })
}

/// Waits until `GET /health` answers 200.
pub fn wait_healthy(addr: SocketAddr, child: &mut std::process::Child) -> Result<()> {
    for _ in 0..600 {
        if let Some(status) = child.try_wait()? {
            bail!("specula serve exited before answering ({status})");
        }
        if request(addr, "GET", "/health", "").is_ok_and(|r| r.status == 200) {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    bail!("specula serve did not answer /health within 60 s")
}

/// A free loopback port.
pub fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// Asks a child to stop with SIGTERM (graceful shutdown) and waits for it.
pub fn terminate(child: &mut std::process::Child) -> Result<()> {
    let pid = child.id().to_string();
    let _ = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status();
    let status = child.wait()?;
    if !status.success() {
        bail!("specula serve did not stop cleanly after SIGTERM ({status})");
    }
    Ok(())
}
