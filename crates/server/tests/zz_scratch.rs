use std::sync::Arc;
mod common;
use specula_cpu::CpuBackend;
use specula_engine::Engine;
use specula_gguf::Gguf;
use specula_models::Model;
use specula_server::ServerConfig;
use specula_tokenizer::Tokenizer;

#[test]
fn scratch() {
    let path = specula_testkit::real_model(&std::env::var("SCRATCH_MODEL").unwrap()).unwrap();
    let file = Arc::new(Gguf::open(&path).unwrap());
    let be = CpuBackend::new(2);
    let model = Model::load(&be, Arc::clone(&file)).unwrap();
    let engine = Engine::new(be, model, Tokenizer::from_gguf(&file).unwrap());
    let tok = Tokenizer::from_gguf(&file).unwrap();
    let cfg = ServerConfig {
        port: 0,
        n_parallel: 1,
        n_ctx: 4096,
        ..ServerConfig::default()
    };
    let s = specula_server::start(cfg, engine, tok, None).unwrap();
    let body: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string("/tmp/scratch_req.json").unwrap()).unwrap();
    for b in body.as_array().unwrap() {
        let r = common::request(
            s.addr(),
            "POST",
            b["path"].as_str().unwrap(),
            &[("Content-Type", "application/json")],
            b["body"].to_string().as_bytes(),
        );
        eprintln!(
            "=== {} {}\n{}",
            b["path"],
            r.status,
            String::from_utf8_lossy(&r.body)
        );
    }
}
