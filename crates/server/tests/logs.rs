//! The speculative gate in the logs (llama-server's rule, `speculative.md` §3.3): a server
//! without a drafter sets nothing speculative up and logs nothing about speculation, yet still
//! probes and reports the cache's rollback capability; a server with one logs its setup.

mod common;

use std::io::Write;
use std::sync::{Arc, Mutex};

use common::{Draft, post, server};
use serde_json::json;
use specula_server::ServerConfig;

#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    fn take(&self) -> String {
        String::from_utf8(std::mem::take(&mut *self.0.lock().unwrap())).unwrap()
    }
}

#[test]
fn no_drafter_no_speculative_logs_but_the_rollback_probe_is_reported() {
    let logs = Captured::default();
    let writer = logs.clone();
    tracing_subscriber::fmt()
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .init();
    let cfg = ServerConfig {
        n_ctx: 512,
        ..ServerConfig::default()
    };
    let body = json!({"prompt": "abcabcabc", "max_tokens": 8, "temperature": 0});

    let s = server(cfg.clone(), Draft::None);
    assert_eq!(post(s.addr(), "/v1/completions", &body).status, 200);
    s.shutdown().unwrap();
    let plain = logs.take().to_lowercase();
    assert!(plain.contains("rollback capability: trim"), "{plain}");
    for word in ["speculative", "draft"] {
        assert!(
            !plain.contains(word),
            "`{word}` logged without a drafter:\n{plain}"
        );
    }

    let s = server(cfg, Draft::Ngram);
    assert_eq!(post(s.addr(), "/v1/completions", &body).status, 200);
    s.shutdown().unwrap();
    let spec = logs.take().to_lowercase();
    assert!(spec.contains("rollback capability: trim"), "{spec}");
    assert!(
        spec.contains("speculative decoding: ngram-simple"),
        "{spec}"
    );
}
