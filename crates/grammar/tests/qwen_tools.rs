//! A required tool call (`Spec::ToolCalls`) on Qwen2.5-Coder-0.5B's real vocabulary, where
//! `<tool_call>` and `</tool_call>` are single text tokens (skipped with a note when the model
//! is not fetched): text may come first but the answer cannot end before a call; a block with
//! a call of a listed tool whose arguments follow its schema is accepted token by token and
//! then the answer may end; an unknown name, arguments outside the schema and, without
//! `parallel`, a second call are cut where they go wrong.

use std::sync::Arc;

use serde_json::json;
use specula_grammar::{Constraint, Grammars, Spec, ToolCalls};
use specula_tokenizer::{EncodeOptions, Tokenizer};

fn tokens(tok: &Tokenizer, text: &str) -> Vec<u32> {
    tok.encode_with(
        text,
        EncodeOptions {
            add_special: false,
            parse_special: true,
        },
    )
}

fn compile(g: &Grammars, parallel: bool) -> Constraint {
    let weather = json!({
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}
        },
        "required": ["city"]
    });
    let time = json!({"type": "object", "properties": {"zone": {"type": "string"}}});
    g.compile(&Spec::ToolCalls(ToolCalls {
        tools: vec![("get_weather".into(), weather), ("get_time".into(), time)],
        parallel,
    }))
    .unwrap()
}

/// Whether the answer may end now (an end-of-generation token keeps a finite logit).
fn may_end(g: &Grammars, c: &mut Constraint, eos: u32) -> bool {
    let mut row = vec![0.0f32; g.n_vocab()];
    c.mask_row(&mut row).unwrap();
    row[eos as usize].is_finite()
}

#[test]
fn a_required_call_is_constrained_on_a_real_vocabulary() {
    let Some(path) = specula_testkit::real_model("qwen2.5-coder-0.5b") else {
        return;
    };
    let tok = Arc::new(Tokenizer::open(&path).unwrap());
    let g = Grammars::new(Arc::clone(&tok)).unwrap();
    let im_end = tok.token_id("<|im_end|>").unwrap();
    let open = tok
        .token_id("<tool_call>")
        .expect("Qwen2.5 has a <tool_call> token");
    let call = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"celsius\"}}\n</tool_call>";
    let answer = tokens(&tok, &format!("Let me check.{call}"));
    assert!(answer.contains(&open), "the tag is one token: {answer:?}");

    let mut c = compile(&g, false);
    assert!(!may_end(&g, &mut c, im_end), "an answer without a call");
    assert_eq!(c.valid_prefix(&answer), answer.len(), "{answer:?}");
    let preamble = tokens(&tok, "Let me check.");
    c.accept(&preamble).unwrap();
    assert!(
        !may_end(&g, &mut c, im_end),
        "text alone does not end the answer"
    );
    c.accept(&answer[preamble.len()..]).unwrap();
    assert!(may_end(&g, &mut c, im_end), "a complete call ends it");
    // One call only without `parallel`: a second block is cut at its tag.
    let second = tokens(&tok, &format!("\n{call}"));
    assert_eq!(c.valid_prefix(&second), 1, "{second:?}");

    // From the start: what goes wrong is cut where it does.
    for (bad, why) in [
        (
            "<tool_call>\n{\"name\": \"get_wind\"",
            "a tool that is not listed",
        ),
        (
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"kelvin\"}}",
            "an argument outside its enum",
        ),
        (
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"unit\": \"celsius\"}}",
            "a required argument missing",
        ),
        (
            "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"zone\": 1}}",
            "an argument of the wrong type",
        ),
    ] {
        let mut c = compile(&g, false);
        let ids = tokens(&tok, bad);
        let n = c.valid_prefix(&ids);
        assert!(n < ids.len(), "{why}: {bad:?} was accepted");
        assert!(n > 1, "{why}: cut at {n}, before the call began");
    }

    // With `parallel`, a second block follows the first.
    let mut c = compile(&g, true);
    let two = tokens(
        &tok,
        &format!(
            "{call}\n<tool_call>\n{{\"name\": \"get_time\", \"arguments\": {{\"zone\": \"CET\"}}}}\n</tool_call>"
        ),
    );
    assert_eq!(c.valid_prefix(&two), two.len());
    c.accept(&two).unwrap();
    assert!(may_end(&g, &mut c, im_end));
}

#[test]
fn a_required_call_needs_a_tool() {
    let Some(path) = specula_testkit::real_model("smollm2-135m") else {
        return;
    };
    let g = Grammars::new(Arc::new(Tokenizer::open(&path).unwrap())).unwrap();
    let e = g
        .compile(&Spec::ToolCalls(ToolCalls {
            tools: Vec::new(),
            parallel: true,
        }))
        .unwrap_err();
    assert!(e.to_string().contains("at least one tool"), "{e}");
}
