//! llama-server's flags as `ServerConfig` fields, on loopback around the tiny model: `/metrics`
//! and `/slots` answer llama-server's 501 when turned off, the CLI's sampling defaults, seed and
//! `-n` reach a request that omits them, a given chat template replaces the model's, and every
//! key of a comma-separated `--api-key` opens the server.

mod common;

use common::{Draft, get, post, request, server};
use serde_json::{Value, json};
use specula_sampling::SamplerParams;
use specula_server::ServerConfig;

fn cfg() -> ServerConfig {
    ServerConfig {
        n_ctx: 512,
        ..ServerConfig::default()
    }
}

fn text(v: &Value) -> String {
    v["choices"][0]["text"]
        .as_str()
        .unwrap_or_else(|| panic!("no text in {v}"))
        .to_owned()
}

fn completion(s: &specula_server::ServerHandle, body: &Value) -> Value {
    let r = post(s.addr(), "/v1/completions", body);
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()
}

#[test]
fn metrics_without_the_flag_answers_llama_servers_501() {
    let s = server(
        ServerConfig {
            metrics: false,
            ..cfg()
        },
        Draft::None,
    );
    let r = get(s.addr(), "/metrics");
    assert_eq!(r.status, 501, "{}", r.text());
    assert_eq!(
        r.json(),
        json!({"error": {
            "code": 501,
            "message": "This server does not support metrics endpoint. Start it with `--metrics`",
            "type": "not_supported_error",
        }})
    );
    // The other endpoints stay.
    assert_eq!(get(s.addr(), "/slots").status, 200);
    let on = server(cfg(), Draft::None);
    assert_eq!(get(on.addr(), "/metrics").status, 200);
}

#[test]
fn no_slots_answers_llama_servers_501() {
    let s = server(
        ServerConfig {
            slots: false,
            ..cfg()
        },
        Draft::None,
    );
    let r = get(s.addr(), "/slots");
    assert_eq!(r.status, 501, "{}", r.text());
    assert_eq!(
        r.json(),
        json!({"error": {
            "code": 501,
            "message": "This server does not support slots endpoint. Start it with `--slots`",
            "type": "not_supported_error",
        }})
    );
    assert_eq!(get(s.addr(), "/metrics").status, 200);
}

/// `--temp 0`: a request without `temperature` is greedy, token for token what an explicit
/// `temperature: 0` gives (at the default 0.8 with a random seed, it would sample).
#[test]
fn temperature_default_reaches_a_request_that_omits_it() {
    let s = server(
        ServerConfig {
            sampling: SamplerParams {
                temperature: 0.0,
                ..SamplerParams::default()
            },
            ..cfg()
        },
        Draft::None,
    );
    let base = json!({"prompt": "The tiny model says", "max_tokens": 32, "ignore_eos": true});
    let mut explicit = base.clone();
    explicit["temperature"] = json!(0);
    let greedy = text(&completion(&s, &explicit));
    for _ in 0..3 {
        assert_eq!(text(&completion(&s, &base)), greedy);
    }
    // The same request sampled at 1.0 (seeded) leaves the greedy path: the default is what
    // made the difference.
    let mut hot = base.clone();
    hot["temperature"] = json!(1.0);
    hot["top_k"] = json!(0);
    hot["top_p"] = json!(1.0);
    hot["min_p"] = json!(0.0);
    let sampled: Vec<String> = (0..3)
        .map(|i| {
            hot["seed"] = json!(100 + i);
            text(&completion(&s, &hot))
        })
        .collect();
    assert!(sampled.iter().any(|t| *t != greedy), "{sampled:?}");
}

/// `--seed 7` with sampling defaults wide open: requests without `seed` sample the same text,
/// the one an explicit `seed: 7` gives; another seed gives another text.
#[test]
fn seed_default_makes_sampled_requests_reproducible() {
    let s = server(
        ServerConfig {
            sampling: SamplerParams {
                temperature: 1.0,
                top_k: 0,
                top_p: 1.0,
                min_p: 0.0,
                ..SamplerParams::default()
            },
            seed: Some(7),
            ..cfg()
        },
        Draft::None,
    );
    let base = json!({"prompt": "Roll the dice", "max_tokens": 32, "ignore_eos": true});
    let first = text(&completion(&s, &base));
    assert_eq!(text(&completion(&s, &base)), first);
    let mut seven = base.clone();
    seven["seed"] = json!(7);
    assert_eq!(text(&completion(&s, &seven)), first);
    let others: Vec<String> = (8..11)
        .map(|i| {
            let mut b = base.clone();
            b["seed"] = json!(i);
            text(&completion(&s, &b))
        })
        .collect();
    assert!(others.iter().any(|t| *t != first), "{others:?}");
}

/// `-n 5`: a request without `max_tokens` stops after 5 tokens; one that sets it is not capped.
#[test]
fn n_predict_default_caps_a_request_without_max_tokens() {
    let s = server(
        ServerConfig {
            n_predict: Some(5),
            ..cfg()
        },
        Draft::None,
    );
    let v = completion(
        &s,
        &json!({"prompt": "Count", "temperature": 0, "ignore_eos": true}),
    );
    assert_eq!(v["usage"]["completion_tokens"], 5, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    let v = completion(
        &s,
        &json!({"prompt": "Count", "temperature": 0, "ignore_eos": true, "max_tokens": 9}),
    );
    assert_eq!(v["usage"]["completion_tokens"], 9, "{v}");
}

/// `--chat-template-file`: the given template renders the chat prompt, not the model's.
#[test]
fn chat_template_replaces_the_models() {
    let fixed = "FIXED PROMPT:";
    let s = server(
        ServerConfig {
            chat_template: Some(format!(
                "{fixed}{{% for m in messages %}}[{{{{ m.content }}}}]{{% endfor %}}"
            )),
            ..cfg()
        },
        Draft::None,
    );
    let body = json!({
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 1, "temperature": 0,
    });
    let r = post(s.addr(), "/v1/chat/completions", &body);
    assert_eq!(r.status, 200, "{}", r.text());
    let prompt_tokens = r.json()["usage"]["prompt_tokens"].clone();
    let t = post(
        s.addr(),
        "/tokenize",
        &json!({"content": format!("{fixed}[hi]"), "add_special": true}),
    );
    let n = t.json()["tokens"].as_array().unwrap().len();
    assert_eq!(prompt_tokens, json!(n));
    // The model's own template renders something else.
    let plain = server(cfg(), Draft::None);
    let r = post(plain.addr(), "/v1/chat/completions", &body);
    assert_ne!(r.json()["usage"]["prompt_tokens"], json!(n));
}

/// A bad template is an error at start, not a 400 per request.
#[test]
fn a_chat_template_that_does_not_parse_fails_the_start() {
    let bytes = common::tiny(common::SEED, 0, false);
    let tok = specula_tokenizer::Tokenizer::from_gguf(
        &specula_gguf::Gguf::from_bytes(bytes.clone()).unwrap(),
    )
    .unwrap();
    let e = specula_server::start(
        ServerConfig {
            port: 0,
            chat_template: Some("{% for m in messages %}".into()),
            ..cfg()
        },
        common::engine(bytes),
        tok,
        None,
    )
    .unwrap_err();
    assert!(
        matches!(e, specula_server::ServerError::ChatTemplate(_)),
        "{e}"
    );
}

/// Several keys (`--api-key a,b` / `--api-key-file`): each one opens the server, others do not.
#[test]
fn every_api_key_opens_the_server() {
    let s = server(
        ServerConfig {
            api_key: Some("first".into()),
            extra_api_keys: vec!["second".into()],
            ..cfg()
        },
        Draft::None,
    );
    for (key, status) in [("first", 200), ("second", 200), ("third", 401)] {
        let auth = format!("Bearer {key}");
        let r = request(
            s.addr(),
            "GET",
            "/props",
            &[("Authorization", auth.as_str())],
            b"",
        );
        assert_eq!(r.status, status, "{key}: {}", r.text());
    }
}
