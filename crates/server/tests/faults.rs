//! A failing request never takes the server down: a drafter that fails (an error, or a panic:
//! a bug) on one request, in `begin`, `draft`, `process` or `accept`, fails that request alone
//! with a 500 naming the cause (streaming: an error event), while the request decoding beside it
//! on the other slot gets exactly the answer it gets alone, and the next request on the faulty
//! slot is served as on a fresh server.
//!
//! The faulty drafter is prompt lookup wrapped to fail where the prompt holds a marker.

mod common;

use std::sync::Arc;

use common::{post, server_spec, streamed};
use serde_json::{Value, json};
use specula_engine::SpecOptions;
use specula_server::{ServerConfig, Speculative};
use specula_spec::ngram::NgramSimple;
use specula_spec::{DraftParams, Drafter, DrafterState, SpecError};

/// Where the faulty drafter fails.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    Begin,
    Draft,
    Process,
    Accept,
}

/// How it fails.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum How {
    Error,
    Panic,
}

const MARKER: &str = "FAULT!";
const CAUSE: &str = "injected fault";

/// Prompt lookup that fails at `stage` on a request whose prompt holds the marker's tokens.
struct Faulty {
    inner: NgramSimple,
    marker: Arc<Vec<u32>>,
    stage: Stage,
    how: How,
    armed: bool,
}

impl Faulty {
    fn trip(&self, at: Stage) -> Result<(), SpecError> {
        if !self.armed || at != self.stage {
            return Ok(());
        }
        match self.how {
            How::Error => Err(SpecError::Drafter {
                drafter: "faulty",
                source: format!("{CAUSE} in {at:?}").into(),
            }),
            How::Panic => panic!("{CAUSE} in {at:?}"),
        }
    }
}

impl Drafter for Faulty {
    fn name(&self) -> &'static str {
        "faulty"
    }

    fn begin(&mut self, prompt: &[u32]) -> Result<(), SpecError> {
        self.armed = prompt
            .windows(self.marker.len())
            .any(|w| w == self.marker.as_slice());
        self.trip(Stage::Begin)?;
        self.inner.begin(prompt)
    }

    fn process(&mut self, tokens: &[u32], pos0: usize) -> Result<(), SpecError> {
        self.trip(Stage::Process)?;
        self.inner.process(tokens, pos0)
    }

    fn draft(&mut self, p: &DraftParams<'_>) -> Result<Vec<u32>, SpecError> {
        self.trip(Stage::Draft)?;
        self.inner.draft(p)
    }

    fn accept(&mut self, n: usize) {
        if let Err(e) = self.trip(Stage::Accept) {
            panic!("{e}");
        }
        self.inner.accept(n);
    }

    fn state(&self) -> DrafterState {
        self.inner.state()
    }

    fn restore(&mut self, state: &DrafterState) -> Result<(), SpecError> {
        self.inner.restore(state)
    }
}

fn cfg() -> ServerConfig {
    ServerConfig {
        n_parallel: 2,
        n_ctx: 2048,
        ..ServerConfig::default()
    }
}

fn spec(stage: Stage, how: How) -> Speculative {
    let tok = {
        let bytes = common::tiny(common::SEED, 0, false);
        specula_tokenizer::Tokenizer::from_gguf(&specula_gguf::Gguf::from_bytes(bytes).unwrap())
            .unwrap()
    };
    let marker = Arc::new(tok.encode(MARKER));
    Speculative {
        kind: "ngram-simple".into(),
        options: SpecOptions {
            n_max: 4,
            n_min: 0,
            p_min: 0.0,
            adaptive: false,
        },
        factory: Box::new(move || {
            Ok(Box::new(Faulty {
                inner: NgramSimple::default(),
                marker: Arc::clone(&marker),
                stage,
                how,
                armed: false,
            }) as _)
        }),
    }
}

fn greedy(prompt: &str, max_tokens: u64) -> Value {
    json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true})
}

fn text(v: &Value) -> String {
    v["choices"][0]["text"]
        .as_str()
        .unwrap_or_else(|| panic!("no text in {v}"))
        .to_owned()
}

/// A prompt that repeats itself, so that prompt lookup drafts (and the drafter is asked, fed
/// and told what it accepted in most rounds).
fn prompt(tag: &str) -> String {
    format!("{tag}: {}", "ab cd ef ".repeat(12))
}

#[test]
fn a_faulty_request_fails_alone_and_the_server_keeps_serving() {
    let good = prompt("good");
    let next = prompt("next");
    let faulty = format!("{} {MARKER}", prompt("bad"));
    // What the good requests get on a fresh server (the faulty drafter never trips on them).
    let fresh = server_spec(cfg(), Some(spec(Stage::Draft, How::Panic)));
    let want_good = text(&post(fresh.addr(), "/v1/completions", &greedy(&good, 800)).json());
    let fresh = server_spec(cfg(), Some(spec(Stage::Draft, How::Panic)));
    let want_next = text(&post(fresh.addr(), "/v1/completions", &greedy(&next, 40)).json());
    drop(fresh);
    for stage in [Stage::Begin, Stage::Draft, Stage::Process, Stage::Accept] {
        for how in [How::Error, How::Panic] {
            if stage == Stage::Accept && how == How::Error {
                // `accept` has no error to return.
                continue;
            }
            for stream in [false, true] {
                let what = format!("{stage:?} {how:?} stream={stream}");
                let s = server_spec(cfg(), Some(spec(stage, how)));
                let addr = s.addr();
                let (bad, ok) = std::thread::scope(|sc| {
                    // The good request first, long enough that the faulty one decodes beside it.
                    let ok = sc.spawn(|| post(addr, "/v1/completions", &greedy(&good, 800)));
                    std::thread::sleep(std::time::Duration::from_millis(5));
                    let mut body = greedy(&faulty, 200);
                    if stream {
                        body["stream"] = json!(true);
                    }
                    let bad = post(addr, "/v1/completions", &body);
                    (bad, ok.join().unwrap())
                });
                let body = bad.text();
                if stream && bad.status == 200 {
                    assert!(
                        body.contains("\"error\"") && body.contains(CAUSE),
                        "{what}: no error event naming the cause in {body}"
                    );
                    assert!(!body.contains("[DONE]") || body.contains(CAUSE), "{what}");
                } else {
                    assert_eq!(bad.status, 500, "{what}: {body}");
                    assert!(
                        body.contains(CAUSE),
                        "{what}: the cause is not named: {body}"
                    );
                }
                assert_eq!(ok.status, 200, "{what}: {}", ok.text());
                assert_eq!(
                    text(&ok.json()),
                    want_good,
                    "{what}: the other slot's answer"
                );
                // The faulty slot serves the next requests as a fresh server (two, so that
                // both slots are used whatever slot the first one takes).
                for _ in 0..2 {
                    let r = post(addr, "/v1/completions", &greedy(&next, 40));
                    assert_eq!(r.status, 200, "{what}: {}", r.text());
                    assert_eq!(text(&r.json()), want_next, "{what}: after the fault");
                }
                if !stream {
                    // Streaming the faulty request again fails it again, the server still up.
                    let mut body = greedy(&faulty, 200);
                    body["stream"] = json!(true);
                    let r = post(addr, "/v1/completions", &body);
                    assert!(r.text().contains(CAUSE), "{what}: {}", r.text());
                    let st = streamed(&post(addr, "/v1/completions", &greedy(&next, 40).tap()));
                    assert_eq!(st.text, want_next, "{what}: streamed after the fault");
                }
            }
        }
    }
}

/// Adds `"stream": true`.
trait Tap {
    fn tap(self) -> Self;
}

impl Tap for Value {
    fn tap(mut self) -> Self {
        self["stream"] = json!(true);
        self
    }
}
