//! llama-server's native endpoints on loopback around the tiny random llama: `/completion`
//! with text, token-id and mixed prompts (streamed and not), its `stop_type` / `stopping_word`
//! / `tokens` fields, `id_slot`, `/apply-template`, `/props`, and llama-server's error shapes
//! (`exceed_context_size_error` with its counts, `invalid_request_error`).

mod common;

use common::{Draft, get, post, request, server};
use serde_json::{Value, json};
use specula_server::ServerConfig;

fn cfg(n_parallel: usize) -> ServerConfig {
    ServerConfig {
        n_parallel,
        n_ctx: 256 * n_parallel,
        model_path: "/models/tiny.gguf".into(),
        ..ServerConfig::default()
    }
}

fn greedy(prompt: Value, n: u64) -> Value {
    json!({"prompt": prompt, "n_predict": n, "temperature": 0, "ignore_eos": true, "return_tokens": true})
}

fn ids(v: &Value) -> Vec<u64> {
    v.as_array()
        .unwrap_or_else(|| panic!("not a list: {v}"))
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect()
}

fn tokenize(addr: std::net::SocketAddr, text: &str, add_special: bool) -> Vec<u64> {
    let r = post(
        addr,
        "/tokenize",
        &json!({"content": text, "add_special": add_special}),
    );
    ids(&r.json()["tokens"])
}

#[test]
fn completion_text_ids_and_mixed_prompts_give_the_same_tokens() {
    let s = server(cfg(1), Draft::None);
    let text = "Once upon a time there was";
    let r = post(s.addr(), "/completion", &greedy(json!(text), 12));
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    let want = ids(&v["tokens"]);
    assert_eq!(want.len(), 12);
    assert_eq!(v["stop"], true);
    assert_eq!(v["stop_type"], "limit");
    assert_eq!(v["stopping_word"], "");
    assert_eq!(v["tokens_predicted"], 12);
    assert_eq!(v["truncated"], false);
    assert_eq!(v["id_slot"], 0);
    assert_eq!(v["generation_settings"]["n_predict"], 12);
    assert_eq!(v["generation_settings"]["temperature"], 0.0);
    assert!(v["timings"]["predicted_n"] == 12, "{v}");
    let prompt_ids = tokenize(s.addr(), text, true);
    assert_eq!(v["tokens_evaluated"], prompt_ids.len());

    // The same prompt as ids, and as ids followed by text (tokenized without BOS).
    let by_ids = post(s.addr(), "/completion", &greedy(json!(prompt_ids), 12)).json();
    assert_eq!(ids(&by_ids["tokens"]), want);
    assert_eq!(by_ids["content"], v["content"]);
    let head = tokenize(s.addr(), "Once upon", true);
    let tail = tokenize(s.addr(), " a time there was", false);
    let mut joined = head.clone();
    joined.extend(&tail);
    let mut mixed: Vec<Value> = head.iter().map(|&t| json!(t)).collect();
    mixed.push(json!(" a time there was"));
    let mixed = post(s.addr(), "/completion", &greedy(json!(mixed), 12)).json();
    let by_joined = post(s.addr(), "/completion", &greedy(json!(joined), 12)).json();
    assert_eq!(mixed["tokens"], by_joined["tokens"]);
    assert_eq!(mixed["tokens_evaluated"], joined.len());

    // `/completions` is the same native endpoint (the OpenAI one is `/v1/completions`).
    let plural = post(s.addr(), "/completions", &greedy(json!(text), 12)).json();
    assert_eq!(plural["content"], v["content"]);
    // Without `return_tokens` the list is empty, as in llama-server.
    let mut body = greedy(json!(text), 4);
    body["return_tokens"] = json!(false);
    assert_eq!(
        post(s.addr(), "/completion", &body).json()["tokens"],
        json!([])
    );
}

#[test]
fn completion_streams_tokens_then_a_summary_without_done() {
    let s = server(cfg(1), Draft::None);
    let whole = post(s.addr(), "/completion", &greedy(json!("Hello world"), 10)).json();
    let mut body = greedy(json!("Hello world"), 10);
    body["stream"] = json!(true);
    let r = post(s.addr(), "/completion", &body);
    assert_eq!(r.status, 200, "{}", r.text());
    let events = r.sse();
    assert!(!events.iter().any(|e| e == "[DONE]"), "{events:?}");
    let chunks: Vec<Value> = events
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let (last, tokens) = chunks.split_last().unwrap();
    assert_eq!(tokens.len(), 10);
    let mut text = String::new();
    let mut toks = Vec::new();
    for (i, c) in tokens.iter().enumerate() {
        assert_eq!(c["stop"], false);
        assert_eq!(c["tokens_predicted"], i + 1);
        text.push_str(c["content"].as_str().unwrap());
        toks.extend(ids(&c["tokens"]));
    }
    assert_eq!(last["stop"], true);
    assert_eq!(last["stop_type"], "limit");
    assert_eq!(last["tokens_predicted"], 10);
    text.push_str(last["content"].as_str().unwrap());
    assert_eq!(text, whole["content"].as_str().unwrap());
    assert_eq!(toks, ids(&whole["tokens"]));
}

#[test]
fn a_stop_string_reports_stop_type_word_and_the_stopping_word() {
    let s = server(cfg(1), Draft::None);
    let whole = post(
        s.addr(),
        "/completion",
        &greedy(json!("The quick brown"), 24),
    )
    .json();
    let content = whole["content"].as_str().unwrap().to_owned();
    // A stop string from the middle of the greedy text: the answer ends where it begins.
    let chars: Vec<char> = content.chars().collect();
    let at = chars.len() / 2;
    let word: String = chars[at..at + 2].iter().collect();
    let before = &content[..content.find(&word).unwrap()];
    let mut body = greedy(json!("The quick brown"), 24);
    body["stop"] = json!([word]);
    let v = post(s.addr(), "/completion", &body).json();
    assert_eq!(v["stop_type"], "word", "{v}");
    assert_eq!(v["stopping_word"], word);
    assert_eq!(v["content"], before);
    assert_eq!(v["generation_settings"]["stop"], json!([word]));
}

/// llama-server (without context shift) does not refuse an `n_predict` past the slot's room:
/// it generates until the slot is full and says `truncated`.
#[test]
fn n_predict_past_the_slot_stops_at_its_end_truncated() {
    let s = server(cfg(1), Draft::None);
    let prompt = tokenize(s.addr(), "fill the slot", true);
    let room = 256 - prompt.len();
    for n in [json!(1000), json!(-1)] {
        let mut body = greedy(json!(prompt), 0);
        body["n_predict"] = n.clone();
        let r = post(s.addr(), "/completion", &body);
        assert_eq!(r.status, 200, "{}", r.text());
        let v = r.json();
        assert_eq!(v["tokens_predicted"], room, "n_predict {n}");
        assert_eq!(v["stop_type"], "limit");
        assert_eq!(v["truncated"], true);
        assert_eq!(v["generation_settings"]["n_predict"], n);
    }
    // Within the room: not truncated.
    let v = post(s.addr(), "/completion", &greedy(json!(prompt), 5)).json();
    assert_eq!(v["truncated"], false);
}

#[test]
fn id_slot_picks_the_slot_and_an_unknown_one_is_refused() {
    let s = server(cfg(2), Draft::None);
    let mut body = greedy(json!("slot test"), 3);
    body["id_slot"] = json!(1);
    let v = post(s.addr(), "/completion", &body).json();
    assert_eq!(v["id_slot"], 1, "{v}");
    body["id_slot"] = json!(5);
    let r = post(s.addr(), "/completion", &body);
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["error"]["type"], "invalid_request_error");
}

#[test]
fn errors_have_llama_servers_shape_and_types() {
    let s = server(cfg(1), Draft::None);
    // A prompt of a whole slot (256 positions) leaves no room.
    let long = vec![5u32; 256];
    let r = post(
        s.addr(),
        "/completion",
        &json!({"prompt": long, "n_predict": 4}),
    );
    assert_eq!(r.status, 400, "{}", r.text());
    let e = &r.json()["error"];
    assert_eq!(e["type"], "exceed_context_size_error");
    assert_eq!(e["code"], 400);
    assert_eq!(e["n_prompt_tokens"], 256);
    assert_eq!(e["n_ctx"], 256);
    // The OpenAI endpoint says the same.
    let r = post(
        s.addr(),
        "/v1/completions",
        &json!({"prompt": long, "max_tokens": 4}),
    );
    assert_eq!(r.json()["error"]["type"], "exceed_context_size_error");

    let r = post(s.addr(), "/completion", &json!({"n_predict": 4}));
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["error"]["type"], "invalid_request_error");
    assert!(
        r.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("prompt")
    );

    let r = request(s.addr(), "POST", "/completion", &[], b"{not json");
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["error"]["type"], "invalid_request_error");

    let r = get(s.addr(), "/no/such/endpoint");
    assert_eq!(r.status, 404);
    assert_eq!(r.json()["error"]["type"], "not_found_error");
}

#[test]
fn apply_template_renders_what_chat_completions_generates_from() {
    let s = server(cfg(1), Draft::None);
    let messages = json!([{"role": "user", "content": "Hi there"}]);
    let r = post(s.addr(), "/apply-template", &json!({"messages": messages}));
    assert_eq!(r.status, 200, "{}", r.text());
    let prompt = r.json()["prompt"].as_str().unwrap().to_owned();
    assert!(prompt.contains("Hi there"), "{prompt}");
    // The rendered text, completed, gives what the chat endpoint gives for the messages.
    let native = post(s.addr(), "/completion", &greedy(json!(prompt), 8)).json();
    let chat = post(
        s.addr(),
        "/v1/chat/completions",
        &json!({"messages": messages, "max_tokens": 8, "temperature": 0, "ignore_eos": true}),
    )
    .json();
    assert_eq!(
        native["content"], chat["choices"][0]["message"]["content"],
        "{chat}"
    );
    let r = post(s.addr(), "/apply-template", &json!({"prompt": "x"}));
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["error"]["type"], "invalid_request_error");
}

#[test]
fn props_names_llama_servers_fields() {
    let s = server(cfg(2), Draft::None);
    let v = get(s.addr(), "/props").json();
    assert_eq!(v["model_path"], "/models/tiny.gguf");
    assert_eq!(v["total_slots"], 2);
    assert_eq!(v["default_generation_settings"]["n_ctx"], 256);
    assert_eq!(v["default_generation_settings"]["params"]["n_predict"], -1);
    assert!(!v["chat_template"].as_str().unwrap().is_empty(), "{v}");
    assert!(v["build_info"].as_str().unwrap().starts_with("specula"));
}

#[test]
fn cors_preflight_and_origin_are_answered_as_llama_server_does() {
    let mut c = cfg(1);
    c.api_key = Some("k".into());
    let s = server(c, Draft::None);
    // A preflight needs no key and gets llama-server's default CORS headers.
    let r = request(
        s.addr(),
        "OPTIONS",
        "/completion",
        &[("Origin", "http://example.test")],
        b"",
    );
    assert_eq!(r.status, 200, "{}", r.head);
    let head = r.head.to_ascii_lowercase();
    for h in [
        "access-control-allow-origin: http://example.test",
        "access-control-allow-credentials: true",
        "access-control-allow-methods: get, post, delete, options",
        "access-control-allow-headers: *",
    ] {
        assert!(head.contains(h), "{h} missing in {head}");
    }
    // Other answers (a refused one too) carry the origin.
    let r = request(
        s.addr(),
        "GET",
        "/props",
        &[("Origin", "http://example.test")],
        b"",
    );
    assert_eq!(r.status, 401);
    assert_eq!(r.json()["error"]["type"], "authentication_error");
    assert!(
        r.head
            .to_ascii_lowercase()
            .contains("access-control-allow-origin: http://example.test")
    );
    // A known path with the wrong method is a 404 not_found_error, as in llama-server.
    let r = request(
        s.addr(),
        "GET",
        "/completion",
        &[("Authorization", "Bearer k")],
        b"",
    );
    assert_eq!(r.status, 404);
    assert_eq!(r.json()["error"]["type"], "not_found_error");
}
