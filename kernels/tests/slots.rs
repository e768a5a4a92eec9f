//! A session saved from the CubeCL backend's cache and loaded into a new session continues
//! with the same logits (float, block-format and turbo planes, recurrent states); another
//! backend's export is refused with the session left empty.

use std::sync::Arc;

use specula_cpu::CpuBackend;
use specula_engine::Engine;
use specula_gguf::Gguf;
use specula_kernels::CubeBackend;
use specula_models::Model;
use specula_quant::QType;
use specula_tensor::Backend;
use specula_testkit::tiny;
use specula_tokenizer::Tokenizer;

const PROMPT: &[u32] = &[1, 5, 9, 12, 5, 9, 12, 5, 9, 30, 7];

fn engine<B: Backend>(be: B, g: &tiny::TinyGguf) -> Engine<B> {
    let f = Arc::new(Gguf::from_bytes(g.to_bytes().unwrap()).unwrap());
    let tok = Tokenizer::from_gguf(&f).unwrap();
    let model = Model::load(&be, f).unwrap();
    Engine::new(be, model, tok)
}

#[test]
fn a_saved_session_continues_with_the_same_logits() {
    let wide = tiny::Dims {
        head_dim: 128,
        ..tiny::Dims::TINY
    };
    let two_stage = tiny::Dims {
        head_dim: 64,
        ..tiny::Dims::TINY
    };
    for (what, g, k, v) in [
        (
            "qwen35, q8_0 K / q4_1 V",
            tiny::target("qwen35"),
            QType::Q8_0,
            QType::Q4_1,
        ),
        ("qwen3, f16", tiny::target("qwen3"), QType::F16, QType::F16),
        (
            "qwen3 (heads of 128), turbo4 K / iq4_nl V",
            tiny::target_sized("qwen3", &wide),
            QType::Turbo4,
            QType::IQ4_NL,
        ),
        (
            "qwen3 (heads of 64, two-stage), turbo3 K / turbo2 V",
            tiny::target_sized("qwen3", &two_stage),
            QType::Turbo3,
            QType::Turbo2,
        ),
    ] {
        let e = engine(CubeBackend::cpu().unwrap(), &g);
        let mut s = e.session(64, k, v).unwrap();
        e.prefill(&mut s, PROMPT, false).unwrap();
        let mut bytes = Vec::new();
        e.save_session(&s, &mut bytes).unwrap();
        let mut t = e.session(64, k, v).unwrap();
        // Something in the new session first, which the load replaces.
        e.prefill(&mut t, &PROMPT[..3], false).unwrap();
        assert_eq!(
            e.load_session(&mut t, &bytes).unwrap(),
            PROMPT.len(),
            "{what}"
        );
        let a = e.decode(&mut s, 4).unwrap().to_vec();
        let b = e.decode(&mut t, 4).unwrap().to_vec();
        assert!(
            a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
            "{what}: the loaded session's logits differ"
        );
    }

    // The CPU backend's export of the same session is refused.
    let g = tiny::target("qwen3");
    let cpu = engine(CpuBackend::new(1), &g);
    let mut s = cpu.session(64, QType::F16, QType::F16).unwrap();
    cpu.prefill(&mut s, PROMPT, false).unwrap();
    let mut bytes = Vec::new();
    cpu.save_session(&s, &mut bytes).unwrap();
    let e = engine(CubeBackend::cpu().unwrap(), &g);
    let mut t = e.session(64, QType::F16, QType::F16).unwrap();
    let err = e.load_session(&mut t, &bytes).unwrap_err().to_string();
    assert!(err.contains("cubecl"), "{err}");
}
