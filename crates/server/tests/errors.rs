//! Errors keep their type and their causes on the way out of the server: a drafter whose own
//! engine fails (a real `EngineError` from a forward of a tiny model, not a string) fails the
//! request with a 500 whose message carries every layer of the chain, and the server keeps
//! serving; a factory that cannot make a slot's drafter stops `start` with a typed
//! `ServerError` whose source is the engine's error.

mod common;

use std::sync::Arc;

use common::{SEED, engine, post, tiny};
use serde_json::json;
use specula_cpu::CpuBackend;
use specula_engine::{Engine, EngineError, Session, SpecOptions};
use specula_gguf::Gguf;
use specula_quant::QType;
use specula_server::{ServerConfig, ServerError, Speculative};
use specula_spec::{DraftParams, Drafter, DrafterState, SpecError};
use specula_tokenizer::Tokenizer;

/// A drafter around its own engine with a 4-cell cache: drafting runs the history through it,
/// which fails inside the engine once the history is longer than the cache.
struct Faulty {
    engine: Arc<Engine<CpuBackend>>,
    session: Session<CpuBackend>,
}

impl Drafter for Faulty {
    fn name(&self) -> &'static str {
        "faulty"
    }
    fn begin(&mut self, _prompt: &[u32]) -> Result<(), SpecError> {
        Ok(())
    }
    fn draft(&mut self, p: &DraftParams<'_>) -> Result<Vec<u32>, SpecError> {
        self.session.truncate(0);
        self.engine
            .prefill(&mut self.session, p.history, false)
            .map_err(|e| SpecError::drafter("faulty", e))?;
        Ok(Vec::new())
    }
    fn state(&self) -> DrafterState {
        Box::new(())
    }
    fn restore(&mut self, _state: &DrafterState) -> Result<(), SpecError> {
        Ok(())
    }
}

fn faulty(engine: &Arc<Engine<CpuBackend>>) -> Faulty {
    Faulty {
        engine: Arc::clone(engine),
        session: engine.session(4, QType::F16, QType::F16).unwrap(),
    }
}

/// `e` and its causes joined by `: `, as the server writes them.
fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s = format!("{s}: {c}");
        cur = c.source();
    }
    s
}

fn start(
    factory: specula_server::DrafterFactory,
) -> Result<specula_server::ServerHandle, ServerError> {
    let bytes = tiny(SEED, 0, false);
    let tok = Tokenizer::from_gguf(&Gguf::from_bytes(bytes.clone()).unwrap()).unwrap();
    specula_server::start(
        ServerConfig {
            host: "127.0.0.1".into(),
            port: 0,
            n_parallel: 1,
            n_ctx: 256,
            ..ServerConfig::default()
        },
        engine(bytes),
        tok,
        Some(Speculative {
            kind: "faulty".into(),
            options: SpecOptions {
                n_max: 4,
                n_min: 0,
                p_min: 0.0,
                adaptive: false,
            },
            factory,
        }),
    )
}

#[test]
fn a_drafter_error_keeps_its_type_and_reaches_the_500_with_its_causes() {
    let draft_engine = Arc::new(engine(tiny(SEED, 0, false)));
    let prompt = "a prompt longer than the drafter's four cells";

    // The drafter's error, directly: typed all the way down.
    let ids = draft_engine.tokenizer.encode(prompt);
    let err = faulty(&draft_engine)
        .draft(&DraftParams {
            history: &ids,
            n_max: 4,
            p_min: 0.0,
            window: None,
        })
        .unwrap_err();
    let SpecError::Drafter { drafter, source } = &err else {
        panic!("not a drafter error: {err:?}");
    };
    assert_eq!(*drafter, "faulty");
    let inner = source
        .downcast_ref::<EngineError>()
        .unwrap_or_else(|| panic!("the source is not the engine's error: {source:?}"));
    assert!(
        matches!(inner, EngineError::ContextFull { n_ctx: 4, .. }),
        "{inner:?}"
    );
    let inner_chain = chain(inner);
    assert_eq!(chain(&err), format!("drafter faulty: {inner_chain}"));

    // Through the server: a 500 naming the whole chain; the server keeps serving.
    let e = Arc::clone(&draft_engine);
    let server = start(Box::new(move || Ok(Box::new(faulty(&e)) as _))).unwrap();
    let body = json!({"prompt": prompt, "max_tokens": 4, "temperature": 0});
    let r = post(server.addr(), "/v1/completions", &body);
    assert_eq!(r.status, 500, "{}", r.text());
    assert_eq!(
        r.json()["error"]["message"],
        format!("the drafter failed: drafter faulty: {inner_chain}"),
    );
    let mut plain = body.clone();
    plain["speculative.n_max"] = json!(0);
    let r = post(server.addr(), "/v1/completions", &plain);
    assert_eq!(r.status, 200, "{}", r.text());
}

#[test]
fn a_failing_drafter_factory_is_a_typed_start_error() {
    let draft_engine = Arc::new(engine(tiny(SEED, 0, false)));
    let e = Arc::clone(&draft_engine);
    // A q4_0 K cache cannot hold the tiny model's 16-value heads: the drafter's own session
    // cannot be made.
    let factory: specula_server::DrafterFactory = Box::new(move || {
        e.session(8, QType::Q4_0, QType::F16)?;
        unreachable!("q4_0 cannot store heads of 16 values")
    });
    let err = start(factory).map(|_| ()).unwrap_err();
    let ServerError::SlotDrafter { slot: 0, source } = &err else {
        panic!("not a drafter error: {err:?}");
    };
    assert!(
        matches!(
            source.downcast_ref::<EngineError>(),
            Some(EngineError::Kv(k)) if k.to_string().contains("cannot store heads of 16 values")
        ),
        "{source:?}"
    );
    assert!(
        chain(&err).starts_with("cannot make the drafter of slot 0: K cache type q4_0"),
        "{}",
        chain(&err)
    );
}
