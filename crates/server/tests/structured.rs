//! Structured output on every generation endpoint: 20 JSON schemas (nested objects, arrays,
//! enums, bounded numbers and integers, `additionalProperties: false`, `required`, patterns,
//! `anyOf`, `const`, nullable types) give JSON that parses and validates on every request —
//! plain, with an n-gram drafter and with a draft model, at temperature 0 and 1 — and greedy
//! constrained output is the same token for token with and without speculation. GBNF
//! grammars (`yes`/`no`, arithmetic expressions) constrain the output; `logit_bias` in both
//! forms bans and favours tokens; bad schemas, grammars and biases are a 400 before decoding.
//!
//! The tiny random model (a byte-level vocabulary) says nothing sensible, so without the
//! constraint none of its outputs would parse; SmolLM2-135M (when fetched) runs the schemas
//! on a real tokenizer, with and without n-gram speculation.

mod common;

use std::net::SocketAddr;

use common::{Draft, post, server};
use serde_json::{Value, json};
use specula_server::{ServerConfig, ServerHandle};

/// The schemas; each is bounded (string lengths, item counts, number ranges) so that every
/// output can finish inside the token budget even when the model rambles.
fn schemas() -> Vec<Value> {
    let s = |n: u32| json!({"type": "string", "maxLength": n});
    vec![
        json!({"type": "object", "properties": {"name": s(8), "age": {"type": "integer", "minimum": 0, "maximum": 120}},
               "required": ["name", "age"], "additionalProperties": false}),
        json!({"enum": ["red", "green", "blue"]}),
        json!({"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 9}, "minItems": 1, "maxItems": 4}),
        json!({"type": "object", "properties": {
                   "person": {"type": "object", "properties": {"first": s(6), "last": s(6)},
                              "required": ["first", "last"], "additionalProperties": false},
                   "tags": {"type": "array", "items": s(5), "maxItems": 3}},
               "required": ["person", "tags"], "additionalProperties": false}),
        json!({"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"type": "boolean"}, "c": {"type": "null"}},
               "required": ["a", "b", "c"], "additionalProperties": false}),
        json!({"type": "object", "properties": {"x": {"type": "integer", "minimum": -10, "maximum": 10}},
               "required": ["x"], "additionalProperties": false}),
        json!({"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 100}),
        json!({"type": "string", "pattern": "^[a-z]{3}-[0-9]{2}$"}),
        json!({"type": "object", "properties": {"version": {"const": 2}, "ok": {"type": "boolean"}},
               "required": ["version", "ok"], "additionalProperties": false}),
        json!({"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"enum": ["none"]}]}),
        json!({"type": "array", "maxItems": 3, "items": {"type": "object",
               "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999}, "done": {"type": "boolean"}},
               "required": ["id", "done"], "additionalProperties": false}}),
        json!({"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object",
               "properties": {"c": {"type": "object", "properties": {"d": {"type": "integer", "minimum": 0, "maximum": 5}},
               "required": ["d"], "additionalProperties": false}}, "required": ["c"], "additionalProperties": false}},
               "required": ["b"], "additionalProperties": false}}, "required": ["a"], "additionalProperties": false}),
        json!({"type": "object", "properties": {"p": s(4), "q": {"type": "integer", "minimum": 0, "maximum": 9}},
               "required": ["p"], "additionalProperties": false}),
        json!({"type": "string", "minLength": 2, "maxLength": 10}),
        json!({"type": "integer", "minimum": -50, "maximum": 50}),
        json!({"type": "array", "items": {"enum": ["x", "y", "z"]}, "minItems": 2, "maxItems": 5}),
        json!({"type": "object", "properties": {"unit": {"enum": ["cm", "m"]}, "value": {"type": "integer", "minimum": 0, "maximum": 1000}},
               "required": ["unit", "value"], "additionalProperties": false}),
        json!({"type": "object", "properties": {"note": {"type": ["string", "null"], "maxLength": 6}},
               "required": ["note"], "additionalProperties": false}),
        json!({"type": "array", "maxItems": 2, "items": {"type": "array", "maxItems": 2,
               "items": {"type": "integer", "minimum": 0, "maximum": 3}}}),
        json!({"type": "object", "properties": {"label": {"enum": ["pos", "neg"]}, "score": {"type": "integer", "minimum": 0, "maximum": 10},
               "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}},
               "required": ["label", "score", "flags"], "additionalProperties": false}),
    ]
}

/// Checks `v` against the schema features the schemas above use; the path of the first
/// violation.
fn validate(v: &Value, s: &Value, path: &str) -> Result<(), String> {
    let bad = |what: &str| Err(format!("{path}: {what} (value {v})"));
    if let Some(c) = s.get("const")
        && v != c
    {
        return bad("not the const");
    }
    if let Some(e) = s.get("enum").and_then(Value::as_array)
        && !e.contains(v)
    {
        return bad("not in the enum");
    }
    if let Some(any) = s.get("anyOf").and_then(Value::as_array)
        && !any.iter().any(|a| validate(v, a, path).is_ok())
    {
        return bad("matches no anyOf branch");
    }
    if let Some(t) = s.get("type") {
        let types: Vec<&str> = match t {
            Value::String(t) => vec![t.as_str()],
            Value::Array(ts) => ts.iter().filter_map(Value::as_str).collect(),
            _ => vec![],
        };
        let ok = types.iter().any(|t| match *t {
            "object" => v.is_object(),
            "array" => v.is_array(),
            "string" => v.is_string(),
            "integer" => v.is_i64() || v.is_u64(),
            "number" => v.is_number(),
            "boolean" => v.is_boolean(),
            "null" => v.is_null(),
            _ => false,
        });
        if !ok {
            return bad(&format!("not of type {t}"));
        }
    }
    let num = |k: &str| s.get(k).and_then(Value::as_f64);
    if let Some(x) = v.as_f64() {
        if num("minimum").is_some_and(|m| x < m) || num("maximum").is_some_and(|m| x > m) {
            return bad("out of [minimum, maximum]");
        }
        if num("exclusiveMinimum").is_some_and(|m| x <= m)
            || num("exclusiveMaximum").is_some_and(|m| x >= m)
        {
            return bad("out of the exclusive bounds");
        }
    }
    let count = |k: &str| {
        s.get(k)
            .and_then(Value::as_u64)
            .and_then(|n| usize::try_from(n).ok())
    };
    if let Some(t) = v.as_str() {
        let n = t.chars().count();
        if count("minLength").is_some_and(|m| n < m) || count("maxLength").is_some_and(|m| n > m) {
            return bad("length out of bounds");
        }
        if let Some(p) = s.get("pattern").and_then(Value::as_str)
            && !regex::Regex::new(p).unwrap().is_match(t)
        {
            return bad("does not match the pattern");
        }
    }
    if let Some(items) = v.as_array() {
        if count("minItems").is_some_and(|m| items.len() < m)
            || count("maxItems").is_some_and(|m| items.len() > m)
        {
            return bad("item count out of bounds");
        }
        if let Some(is) = s.get("items") {
            for (i, it) in items.iter().enumerate() {
                validate(it, is, &format!("{path}[{i}]"))?;
            }
        }
    }
    if let Some(o) = v.as_object() {
        let props = s.get("properties").and_then(Value::as_object);
        for r in s
            .get("required")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            if !o.contains_key(r.as_str().unwrap()) {
                return bad(&format!("misses required {r}"));
            }
        }
        for (k, x) in o {
            match props.and_then(|p| p.get(k)) {
                Some(ps) => validate(x, ps, &format!("{path}.{k}"))?,
                None if s.get("additionalProperties") == Some(&Value::Bool(false)) => {
                    return bad(&format!("has the extra property {k}"));
                }
                None => {}
            }
        }
    }
    Ok(())
}

/// One generation on endpoint `e` (0: chat with `response_format`, 1: `/v1/completions` with
/// `json_schema`, 2: `/completion` with `json_schema` and `return_tokens`): the text, the
/// tokens (endpoint 2 only) and the finish reason.
fn generate(
    addr: SocketAddr,
    e: usize,
    schema: &Value,
    temp: f32,
    seed: u64,
    n: usize,
) -> (String, Vec<Value>, String) {
    let q = "Answer in JSON.";
    match e {
        0 => {
            let body = json!({"messages": [{"role": "user", "content": q}], "max_tokens": n, "temperature": temp, "seed": seed,
                "response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}});
            let r = post(addr, "/v1/chat/completions", &body);
            assert_eq!(r.status, 200, "{}", r.text());
            let v = r.json();
            let c = &v["choices"][0];
            (
                c["message"]["content"].as_str().unwrap().to_owned(),
                vec![],
                c["finish_reason"].as_str().unwrap().to_owned(),
            )
        }
        1 => {
            let body = json!({"prompt": q, "max_tokens": n, "temperature": temp, "seed": seed, "json_schema": schema});
            let r = post(addr, "/v1/completions", &body);
            assert_eq!(r.status, 200, "{}", r.text());
            let v = r.json();
            let c = &v["choices"][0];
            (
                c["text"].as_str().unwrap().to_owned(),
                vec![],
                c["finish_reason"].as_str().unwrap().to_owned(),
            )
        }
        _ => {
            let body = json!({"prompt": q, "n_predict": n, "temperature": temp, "seed": seed, "json_schema": schema, "return_tokens": true});
            let r = post(addr, "/completion", &body);
            assert_eq!(r.status, 200, "{}", r.text());
            let v = r.json();
            (
                v["content"].as_str().unwrap().to_owned(),
                v["tokens"].as_array().unwrap().clone(),
                v["stop_type"].as_str().unwrap().to_owned(),
            )
        }
    }
}

fn check(out: &str, schema: &Value, what: &str) {
    let v: Value =
        serde_json::from_str(out).unwrap_or_else(|e| panic!("{what}: {out:?} is not JSON: {e}"));
    validate(&v, schema, "$").unwrap_or_else(|e| panic!("{what}: {out:?} does not validate: {e}"));
}

fn cfg() -> ServerConfig {
    ServerConfig {
        n_ctx: 512,
        ..ServerConfig::default()
    }
}

#[test]
fn twenty_schemas_validate_on_every_endpoint_with_and_without_speculation() {
    let schemas = schemas();
    assert_eq!(schemas.len(), 20);
    let mut greedy: Vec<Vec<(String, Vec<Value>)>> = Vec::new();
    for draft in [Draft::None, Draft::Ngram, Draft::SelfModel] {
        let name = format!("{draft:?}");
        let s = server(cfg(), draft);
        let mut row = Vec::new();
        for (i, schema) in schemas.iter().enumerate() {
            let e = i % 3;
            let (out, tokens, fin) = generate(s.addr(), e, schema, 0.0, 1, 200);
            check(
                &out,
                schema,
                &format!("schema {i}, {name}, greedy, endpoint {e} ({fin})"),
            );
            row.push((out, tokens));
            for seed in [7, 8] {
                let (out, _, fin) = generate(s.addr(), e, schema, 1.0, seed, 200);
                check(
                    &out,
                    schema,
                    &format!("schema {i}, {name}, T=1 seed {seed}, endpoint {e} ({fin})"),
                );
            }
        }
        greedy.push(row);
    }
    for (i, ((plain, spec_ngram), spec_model)) in
        greedy[0].iter().zip(&greedy[1]).zip(&greedy[2]).enumerate()
    {
        assert_eq!(
            plain, spec_ngram,
            "schema {i}: n-gram speculation changed the greedy output"
        );
        assert_eq!(
            plain, spec_model,
            "schema {i}: a draft model changed the greedy output"
        );
    }
}

#[test]
fn streamed_constrained_output_is_the_plain_output() {
    let s = server(cfg(), Draft::SelfModel);
    let schema = &schemas()[3];
    let body = |stream: bool| {
        json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 120, "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"schema": schema}}, "stream": stream})
    };
    let st = common::streamed(&post(s.addr(), "/v1/chat/completions", &body(true)));
    check(&st.text, schema, "streamed");
    let v = post(s.addr(), "/v1/chat/completions", &body(false)).json();
    assert_eq!(v["choices"][0]["message"]["content"], st.text.as_str());
}

#[test]
fn constrained_requests_still_speculate_and_report_the_mask_cost() {
    let s = server(cfg(), Draft::SelfModel);
    let schema = &schemas()[0];
    let body = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 200, "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"schema": schema}}});
    let v = post(s.addr(), "/v1/chat/completions", &body).json();
    let t = &v["timings"];
    let (drafted, accepted) = (
        t["draft_n"].as_u64().unwrap(),
        t["draft_n_accepted"].as_u64().unwrap(),
    );
    // The draft model drafts its unconstrained greedy tokens; the grammar cuts them, and what
    // is left is accepted (the draft model is the target).
    assert!(drafted > 0 && accepted == drafted, "{t}");
    let masks = t["grammar_masks"].as_u64().unwrap();
    assert!(masks >= t["predicted_n"].as_u64().unwrap(), "{t}");
    assert!(t["grammar_mask_median_ms"].as_f64().unwrap() > 0.0, "{t}");
    // Plain requests carry no grammar timings.
    let v = post(
        s.addr(),
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
    )
    .json();
    assert!(v["timings"].get("grammar_masks").is_none(), "{v}");
}

#[test]
fn n_choices_each_follow_the_schema_and_differ_by_seed() {
    let s = server(cfg(), Draft::Ngram);
    let schema = &schemas()[0];
    let body = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 200, "temperature": 1, "seed": 9, "n": 3,
        "response_format": {"type": "json_schema", "json_schema": {"schema": schema}}});
    let v = post(s.addr(), "/v1/chat/completions", &body).json();
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3, "{v}");
    let mut texts = Vec::new();
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i);
        let t = c["message"]["content"].as_str().unwrap();
        check(t, schema, &format!("choice {i}"));
        texts.push(t.to_owned());
    }
    assert!(texts[0] != texts[1] || texts[1] != texts[2], "{texts:?}");
    // Choice i is the n = 1 answer with seed 9 + i.
    let mut one = body.clone();
    one["n"] = json!(1);
    one["seed"] = json!(10);
    let v1 = post(s.addr(), "/v1/chat/completions", &one).json();
    assert_eq!(v1["choices"][0]["message"]["content"], texts[1].as_str());
    let completion: u64 = choices.len() as u64;
    assert!(
        v["usage"]["completion_tokens"].as_u64().unwrap() >= completion,
        "{v}"
    );
    // Text completions too; streaming several choices and n on /completion are refused.
    let v = post(
        s.addr(),
        "/v1/completions",
        &json!({"prompt": "a", "n": 2, "max_tokens": 3}),
    )
    .json();
    assert_eq!(v["choices"].as_array().unwrap().len(), 2, "{v}");
    let r = post(
        s.addr(),
        "/v1/completions",
        &json!({"prompt": "a", "n": 2, "stream": true}),
    );
    assert_eq!(r.status, 400);
    let r = post(s.addr(), "/completion", &json!({"prompt": "a", "n": 2}));
    assert_eq!(r.status, 400);
}

#[test]
fn json_object_gives_an_object_and_composes_with_logit_bias() {
    let s = server(cfg(), Draft::Ngram);
    // Favouring `"` and `}` makes the random model's strings and objects end; without the
    // grammar it would answer `}}}…`.
    for (temp, seed) in [(0.0, 1), (1.0, 1), (1.0, 2), (1.0, 3), (1.0, 4)] {
        let body = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 200, "temperature": temp,
            "seed": seed, "response_format": {"type": "json_object"}, "logit_bias": [["\"", 4.0], ["}", 6.0]]});
        let v = post(s.addr(), "/v1/chat/completions", &body).json();
        let out = v["choices"][0]["message"]["content"].as_str().unwrap();
        let o: Value =
            serde_json::from_str(out).unwrap_or_else(|e| panic!("json_object: {out:?}: {e}"));
        assert!(o.is_object(), "{o}");
    }
}

/// A grammar for expressions like `12+(3*4)-5`, with bounded repeats.
const ARITH: &str = r#"
root   ::= expr
expr   ::= term (("+" | "-") term){0,3}
term   ::= factor (("*" | "/") factor){0,2}
factor ::= [1-9] [0-9]{0,2} | "(" inner ")"
inner  ::= [0-9] ("+" [0-9]){0,2}
"#;

/// Whether `s` is an expression of [`ARITH`].
fn arith(s: &str) -> bool {
    fn number(b: &[u8], i: &mut usize) -> bool {
        let st = *i;
        if *i < b.len() && (b'1'..=b'9').contains(&b[*i]) {
            *i += 1;
            while *i < b.len() && b[*i].is_ascii_digit() && *i - st < 3 {
                *i += 1;
            }
            return true;
        }
        if *i < b.len() && b[*i] == b'(' {
            *i += 1;
            let mut terms = 0;
            loop {
                if *i >= b.len() || !b[*i].is_ascii_digit() {
                    return false;
                }
                *i += 1;
                terms += 1;
                if *i < b.len() && b[*i] == b'+' && terms < 3 {
                    *i += 1;
                    continue;
                }
                break;
            }
            if *i < b.len() && b[*i] == b')' {
                *i += 1;
                return true;
            }
        }
        false
    }
    fn chain(
        b: &[u8],
        i: &mut usize,
        ops: &[u8],
        max: usize,
        item: &dyn Fn(&[u8], &mut usize) -> bool,
    ) -> bool {
        if !item(b, i) {
            return false;
        }
        let mut n = 0;
        while n < max && *i < b.len() && ops.contains(&b[*i]) {
            *i += 1;
            if !item(b, i) {
                return false;
            }
            n += 1;
        }
        true
    }
    let b = s.as_bytes();
    let mut i = 0;
    let term = |b: &[u8], i: &mut usize| chain(b, i, b"*/", 2, &number);
    chain(b, &mut i, b"+-", 3, &term) && i == b.len()
}

#[test]
fn gbnf_grammars_constrain_every_endpoint() {
    assert!(arith("12+(3+4)*5") && !arith("1++2") && !arith("(12)"));
    let s = server(cfg(), Draft::Ngram);
    for temp in [0.0, 1.0] {
        for seed in 1..4u64 {
            let body = json!({"prompt": "Is it?", "n_predict": 16, "temperature": temp, "seed": seed,
                "grammar": r#"root ::= ("yes" | "no")"#});
            let r = post(s.addr(), "/completion", &body);
            assert_eq!(r.status, 200, "{}", r.text());
            let v = r.json();
            let c = v["content"].as_str().unwrap();
            assert!(c == "yes" || c == "no", "{v}");
            let body = json!({"messages": [{"role": "user", "content": "Compute."}], "max_tokens": 64,
                "temperature": temp, "seed": seed, "grammar": ARITH});
            let r = post(s.addr(), "/v1/chat/completions", &body);
            assert_eq!(r.status, 200, "{}", r.text());
            let v = r.json();
            let c = v["choices"][0]["message"]["content"].as_str().unwrap();
            assert!(arith(c), "{c:?} is not an expression of the grammar ({v})");
            let body = json!({"prompt": "2+2=", "max_tokens": 64, "temperature": temp, "seed": seed, "grammar": ARITH});
            let v = post(s.addr(), "/v1/completions", &body).json();
            let c = v["choices"][0]["text"].as_str().unwrap();
            assert!(arith(c), "{c:?} is not an expression of the grammar ({v})");
        }
    }
}

#[test]
fn logit_bias_bans_and_favours_tokens_in_both_forms() {
    let s = server(cfg(), Draft::None);
    let ask = |extra: Value| {
        let mut body = json!({"prompt": "hello", "n_predict": 8, "temperature": 0, "ignore_eos": true, "return_tokens": true});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        let r = post(s.addr(), "/completion", &body);
        assert_eq!(r.status, 200, "{}", r.text());
        r.json()["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap())
            .collect::<Vec<_>>()
    };
    let plain = ask(json!({}));
    let first = plain[0];
    for bias in [
        json!([[first, false]]),
        json!({first.to_string(): -1000}),
        json!([[first, -1e9]]),
    ] {
        let got = ask(json!({"logit_bias": bias}));
        assert!(
            !got.contains(&first),
            "{bias}: banned token {first} came anyway: {got:?}"
        );
    }
    // A large positive bias makes a token the greedy choice everywhere.
    let got = ask(json!({"logit_bias": [[65, 1000.0]]}));
    assert_eq!(got, vec![65; 8]);
    // Text keys bias the text's tokens (llama-server's string form).
    let got = ask(json!({"logit_bias": [["A", 1000.0]]}));
    assert_eq!(got, vec![65; 8]);
    // OpenAI's chat endpoint takes the map form.
    let body = json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "temperature": 0,
        "logit_bias": {"66": 1000}});
    let v = post(s.addr(), "/v1/chat/completions", &body).json();
    assert_eq!(v["choices"][0]["message"]["content"], "BBBB", "{v}");
}

#[test]
fn bad_schemas_grammars_and_biases_are_a_400_naming_the_problem() {
    let s = server(cfg(), Draft::None);
    let cases = [
        (
            "/completion",
            json!({"prompt": "x", "grammar": "root ::= [z-a]"}),
            "invalid grammar: at 1:10: the range",
        ),
        (
            "/completion",
            json!({"prompt": "x", "grammar": "root ::= undefined-rule"}),
            "invalid grammar",
        ),
        (
            "/completion",
            json!({"prompt": "x", "grammar": "rot ::= \"a\""}),
            "no `root` rule",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "json_schema": {"type": "nonsense"}}),
            "invalid JSON schema",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "json_schema": 5}),
            "invalid JSON schema",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "json_schema": {"type": "object"}, "grammar": "root ::= \"a\""}),
            "Cannot use both json_schema and grammar",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}}),
            "response_format type must be one of",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "x"}],
            "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "integer", "minimum": 5, "maximum": 1}}}}),
            "invalid JSON schema",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"99999": 1}}),
            "outside the vocabulary",
        ),
        (
            "/completion",
            json!({"prompt": "x", "logit_bias": [[1, "high"]]}),
            "a bias is a number, or false",
        ),
        (
            "/completion",
            json!({"prompt": "x", "logit_bias": [[1]]}),
            "each entry is",
        ),
    ];
    for (path, body, want) in cases {
        let r = post(s.addr(), path, &body);
        assert_eq!(r.status, 400, "{path} {body}: {}", r.text());
        let v = r.json();
        assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(
            msg.contains(want),
            "{path} {body}: {msg:?} does not say {want:?}"
        );
    }
    // The server goes on serving.
    let r = post(
        s.addr(),
        "/completion",
        &json!({"prompt": "x", "n_predict": 2}),
    );
    assert_eq!(r.status, 200);
}

fn smollm(ngram: bool) -> Option<ServerHandle> {
    let cfg = ServerConfig {
        n_ctx: 1024,
        ..ServerConfig::default()
    };
    common::real("smollm2-135m", cfg, ngram.then(common::ngram))
}

#[test]
fn smollm2_schemas_validate_and_ngram_speculation_keeps_greedy_tokens() {
    let Some(plain) = smollm(false) else { return };
    let schemas = schemas();
    let mut want = Vec::new();
    for (i, schema) in schemas.iter().enumerate() {
        let (out, tokens, fin) = generate(plain.addr(), 2, schema, 0.0, 1, 160);
        check(&out, schema, &format!("SmolLM2 schema {i}, greedy ({fin})"));
        want.push((out, tokens));
        let (out, _, fin) = generate(plain.addr(), i % 2, schema, 1.0, 3, 160);
        check(&out, schema, &format!("SmolLM2 schema {i}, T=1 ({fin})"));
    }
    drop(plain);
    let Some(spec) = smollm(true) else { return };
    for (i, schema) in schemas.iter().enumerate() {
        let (out, tokens, fin) = generate(spec.addr(), 2, schema, 0.0, 1, 160);
        check(
            &out,
            schema,
            &format!("SmolLM2 schema {i}, greedy, n-gram ({fin})"),
        );
        assert_eq!(
            (out, tokens),
            want[i],
            "schema {i}: n-gram speculation changed the greedy tokens"
        );
        let (out, _, fin) = generate(spec.addr(), 0, schema, 1.0, 3, 160);
        check(
            &out,
            schema,
            &format!("SmolLM2 schema {i}, T=1, n-gram ({fin})"),
        );
    }
}
