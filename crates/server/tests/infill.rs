//! llama-server's `POST /infill` against its own answers (golden/llama_server_endpoints/
//! `infill_*`, recorded by reference/llama_server_endpoints.py on qwen2.5-coder-0.5b-instruct
//! Q4_K_M with `-c 4096 -np 1`): the FIM prompt specula builds (`prompt` of the answer, the
//! repo-level `<|repo_name|>` / `<|file_sep|>` layout with `input_extra`) is llama-server's
//! text for text, and the greedy tokens and `content` are its own (equal, or equal up to a
//! near tie of the two best logits, as the golden test of `/completion` allows). A model
//! without FIM tokens (the tiny llama) answers llama-server's 501. Skips without the model.

mod common;

use common::{Draft, greedy_agrees, post, server};
use serde_json::{Value, json};
use specula_server::{ServerConfig, ServerHandle};

fn golden(name: &str) -> Value {
    common::golden("llama_server_endpoints", name)
}

fn coder() -> Option<ServerHandle> {
    let cfg = ServerConfig {
        n_parallel: 1,
        n_ctx: 4096,
        ..ServerConfig::default()
    };
    common::real("qwen2.5-coder-0.5b", cfg, None)
}

#[test]
fn qwen_coder_infill_matches_llama_server() {
    let Some(s) = coder() else { return };
    for name in ["infill_plain", "infill_extra"] {
        let g = golden(name);
        assert_eq!(g["status"], 200, "{name}: the fixture is an answer");
        let r = post(s.addr(), "/infill", &g["request"]["body"]);
        assert_eq!(r.status, 200, "{name}: {}", r.text());
        let v = r.json();
        let want = &g["response"];
        // The prompt: the same FIM layout, token for token (as text).
        assert_eq!(v["prompt"], want["prompt"], "{name}: prompt");
        assert_eq!(
            v["tokens_evaluated"], want["tokens_evaluated"],
            "{name}: prompt tokens"
        );
        let ours = v["tokens"].as_array().unwrap();
        let theirs = want["tokens"].as_array().unwrap();
        match greedy_agrees(&s, "/infill", name, &g["request"]["body"], ours, theirs) {
            None => {
                assert_eq!(v["content"], want["content"], "{name}: content");
                assert_eq!(v["stop_type"], want["stop_type"], "{name}");
            }
            Some(step) => eprintln!("{name}: greedy tokens equal for {step} steps, then a tie"),
        }
        assert_eq!(v["stop"], true);
    }
    let (a, b) = (golden("infill_plain"), golden("infill_extra"));
    assert!(
        b["response"]["tokens_evaluated"].as_u64() > a["response"]["tokens_evaluated"].as_u64(),
        "input_extra adds context"
    );

    // A missing field: llama-server means to answer 400 `"input_prefix" is required` but
    // goes on and fails in its JSON library (500 `server_error`, recorded); specula answers
    // the 400 it means, a client error.
    let g = golden("infill_missing_prefix");
    assert_eq!(g["status"], 500);
    let r = post(s.addr(), "/infill", &g["request"]["body"]);
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(r.json()["error"]["type"], "invalid_request_error");
    assert!(
        r.text().contains("\\\"input_prefix\\\" is required"),
        "{}",
        r.text()
    );
}

#[test]
fn infill_checks_its_fields_as_llama_server() {
    // The tiny llama has no FIM tokens: llama-server's 501, naming the three
    // (`post_infill` of server-context.cpp).
    let s = server(ServerConfig::default(), Draft::None);
    let r = post(
        s.addr(),
        "/infill",
        &json!({"input_prefix": "a", "input_suffix": "b"}),
    );
    assert_eq!(r.status, 501, "{}", r.text());
    let e = &r.json()["error"];
    assert_eq!(e["type"], "not_supported_error");
    assert_eq!(
        e["message"],
        "Infill is not supported by this model: prefix token is missing. suffix token is missing. middle token is missing. "
    );
}

#[test]
fn qwen_coder_infill_errors_are_llama_servers() {
    let Some(s) = coder() else { return };
    for (body, msg) in [
        (
            json!({"input_prefix": "a", "input_suffix": "b", "prompt": 3}),
            "\"prompt\" must be a string",
        ),
        (json!({"input_prefix": "a"}), "\"input_suffix\" is required"),
        (
            json!({"input_prefix": "a", "input_suffix": "b", "input_extra": "x"}),
            "\"input_extra\" must be an array of {\"filename\": string, \"text\": string}",
        ),
        (
            json!({"input_prefix": "a", "input_suffix": "b", "input_extra": [{"filename": "f"}]}),
            "extra_context chunk must contain a \"text\" field with a string value",
        ),
        (
            json!({"input_prefix": "a", "input_suffix": "b", "input_extra": [{"text": "t", "filename": 1}]}),
            "extra_context chunk's \"filename\" field must be a string",
        ),
    ] {
        let r = post(s.addr(), "/infill", &body);
        assert_eq!(r.status, 400, "{body}: {}", r.text());
        let e = &r.json()["error"];
        assert_eq!(e["type"], "invalid_request_error");
        assert_eq!(e["message"], msg);
    }
}

/// `--spm-infill` (`ServerConfig::spm_infill`): llama-server's prompt of `infill_plain` with
/// its suffix part (`<|fim_suffix|>` and the suffix) moved in front of the prefix part
/// (`<|fim_prefix|>`, the prefix and the prompt), the extra context still first and
/// `<|fim_middle|>` last, as `format_prompt_infill` orders them.
#[test]
fn spm_infill_puts_the_suffix_first() {
    let cfg = ServerConfig {
        n_parallel: 1,
        n_ctx: 4096,
        spm_infill: true,
        ..ServerConfig::default()
    };
    let Some(s) = common::real("qwen2.5-coder-0.5b", cfg, None) else {
        return;
    };
    let g = golden("infill_plain");
    let psm = g["response"]["prompt"].as_str().unwrap();
    let (extra, rest) = psm.split_at(psm.find("<|fim_prefix|>").unwrap());
    let (prefix, rest) = rest.split_at(rest.find("<|fim_suffix|>").unwrap());
    let suffix = rest.strip_suffix("<|fim_middle|>").unwrap();
    let mut body = g["request"]["body"].clone();
    body["n_predict"] = 1.into();
    let r = post(s.addr(), "/infill", &body);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(
        r.json()["prompt"],
        format!("{extra}{suffix}{prefix}<|fim_middle|>")
    );
}
