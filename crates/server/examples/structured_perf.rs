//! What structured output costs: the same chat requests on one server, plain and constrained
//! by a JSON schema, back to back, with the decode speed of each and the grammar mask's
//! per-step time (`timings.grammar_mask_median_ms`). The numbers of `docs/perf.md`.
//!
//! ```text
//! cargo run --release -p specula-server --example structured_perf -- MODEL.gguf [ROUNDS]
//! ```

use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;

use serde_json::{Value, json};
use specula_cpu::CpuBackend;
use specula_engine::Engine;
use specula_gguf::Gguf;
use specula_models::Model;
use specula_server::ServerConfig;
use specula_tokenizer::Tokenizer;

fn post(addr: SocketAddr, path: &str, body: &Value) -> Value {
    let body = body.to_string();
    let mut s = TcpStream::connect(addr).expect("connect");
    write!(
        s,
        "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .expect("send");
    let mut out = String::new();
    s.read_to_string(&mut out).expect("read");
    let (_, json) = out.split_once("\r\n\r\n").expect("an HTTP answer");
    serde_json::from_str(json).expect("a JSON answer")
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

fn main() {
    let mut args = std::env::args().skip(1);
    let path = args
        .next()
        .expect("usage: structured_perf MODEL.gguf [ROUNDS]");
    let rounds: usize = args.next().map_or(5, |r| r.parse().expect("ROUNDS"));
    let file = Arc::new(Gguf::open(&path).expect("a GGUF model"));
    let be =
        CpuBackend::new(std::thread::available_parallelism().map_or(2, std::num::NonZero::get));
    let model = Model::load(&be, Arc::clone(&file)).expect("the model loads");
    let engine = Engine::new(be, model, Tokenizer::from_gguf(&file).expect("a tokenizer"));
    let tok = Tokenizer::from_gguf(&file).expect("a tokenizer");
    let cfg = ServerConfig {
        port: 0,
        n_ctx: 2048,
        ..ServerConfig::default()
    };
    let server = specula_server::start(cfg, engine, tok, None).expect("the server starts");
    let schema = json!({"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 5},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["city", "zip"],
            "additionalProperties": false}},
        "required": ["name", "age", "hobbies", "address"], "additionalProperties": false});
    let ask = |constrained: bool| {
        let mut body = json!({"messages": [{"role": "user", "content": "Describe a person as JSON with name, age, hobbies and address."}],
            "max_tokens": 128, "temperature": 0});
        if constrained {
            body["response_format"] =
                json!({"type": "json_schema", "json_schema": {"schema": schema}});
        } else {
            body["ignore_eos"] = json!(true);
        }
        post(server.addr(), "/v1/chat/completions", &body)
    };
    ask(true);
    ask(false);
    let (mut plain, mut constrained, mut mask_ms, mut masks, mut tokens) =
        (Vec::new(), Vec::new(), Vec::new(), 0u64, 0u64);
    for _ in 0..rounds {
        let p = ask(false);
        plain.push(p["timings"]["predicted_per_second"].as_f64().unwrap_or(0.0));
        let c = ask(true);
        let t = &c["timings"];
        constrained.push(t["predicted_per_second"].as_f64().unwrap_or(0.0));
        mask_ms.push(t["grammar_mask_median_ms"].as_f64().unwrap_or(0.0));
        masks += t["grammar_masks"].as_u64().unwrap_or(0);
        tokens += t["predicted_n"].as_u64().unwrap_or(0);
    }
    println!(
        "rounds {rounds}: plain {:.1} tok/s, constrained {:.1} tok/s (median of rounds); mask median {:.3} ms per step ({masks} masks for {tokens} tokens)",
        median(plain),
        median(constrained),
        median(mask_ms),
    );
}
