//! Behaviour on tiny vocabularies written here (no model needed): BPE and SentencePiece
//! merging, special tokens in text, BOS/EOS rules, end-of-generation rules, decoding, and
//! the errors for bad metadata. The expected values follow llama.cpp's `llama-vocab.cpp`,
//! which the golden tests check on real vocabularies.

use proptest::prelude::*;
use specula_gguf::{Array, Gguf, GgufWriter, Value};
use specula_tokenizer::{
    DecodeOptions, EncodeOptions, PreType, TokenAttr, Tokenizer, TokenizerError, VocabKind,
};

const NORMAL: i32 = 1;
const CONTROL: i32 = 3;
const USER_DEFINED: i32 = 4;
const BYTE: i32 = 6;

fn strings(v: &[&str]) -> Value {
    Value::Array(Array::String(v.iter().map(|s| (*s).to_owned()).collect()))
}

fn build(kv: Vec<(&str, Value)>) -> Result<Tokenizer, TokenizerError> {
    let mut w = GgufWriter::new();
    for (k, v) in kv {
        w.add(k, v).unwrap();
    }
    Tokenizer::from_gguf(&Gguf::from_bytes(w.to_vec(&[]).unwrap()).unwrap())
}

/// GPT-2's byte-level alphabet: the vocabulary text of each byte.
fn byte_char(b: u8) -> char {
    let printable = |b: u8| matches!(b, 0x21..=0x7E | 0xA1..=0xAC | 0xAE..=0xFF);
    if printable(b) {
        return char::from(b);
    }
    let n = (0..b).filter(|&x| !printable(x)).count();
    char::from_u32(256 + u32::try_from(n).unwrap()).unwrap()
}

/// A byte-level BPE vocabulary: the 256 byte characters (ids 0..256), then `extra` tokens
/// with their types, and `merges`.
fn bpe(pre: &str, extra: &[(&str, i32)], merges: &[&str], more: Vec<(&str, Value)>) -> Tokenizer {
    let mut tokens: Vec<String> = (0..=255u8).map(|b| byte_char(b).to_string()).collect();
    let mut types = vec![NORMAL; 256];
    for (t, ty) in extra {
        tokens.push((*t).to_owned());
        types.push(*ty);
    }
    let mut kv = vec![
        ("tokenizer.ggml.model", Value::String("gpt2".into())),
        ("tokenizer.ggml.pre", Value::String(pre.into())),
        ("tokenizer.ggml.tokens", Value::Array(Array::String(tokens))),
        ("tokenizer.ggml.token_type", Value::Array(Array::I32(types))),
        ("tokenizer.ggml.merges", strings(merges)),
    ];
    kv.extend(more);
    build(kv).unwrap()
}

fn id(tok: &Tokenizer, text: &str) -> u32 {
    tok.token_id(text)
        .unwrap_or_else(|| panic!("{text:?} is not a token"))
}

/// No BOS/EOS, special tokens parsed.
const RAW: EncodeOptions = EncodeOptions {
    add_special: false,
    parse_special: true,
};

#[test]
fn bpe_merges_lowest_rank_first_within_words() {
    // "a b" outranks "b c", so "abc" is "ab" + "c"; " abc" starts a new word.
    let tok = bpe(
        "qwen2",
        &[("ab", NORMAL), ("bc", NORMAL), ("Ġab", NORMAL)],
        &["a b", "b c", "Ġ ab"],
        vec![],
    );
    let ids = tok.encode_with("abc abc", RAW);
    assert_eq!(
        ids,
        [
            id(&tok, "ab"),
            id(&tok, "c"),
            id(&tok, "Ġab"),
            id(&tok, "c")
        ]
    );
    assert_eq!(tok.decode(&ids, DecodeOptions::default()), "abc abc");
    assert_eq!(tok.kind(), VocabKind::Bpe);
    assert_eq!(tok.pre_type(), PreType::Qwen2);
}

#[test]
fn merged_strings_outside_the_vocabulary_fall_back_to_bytes() {
    // The merge makes "xy", which is no token: llama.cpp emits the bytes' tokens.
    let tok = bpe("qwen2", &[], &["x y"], vec![]);
    assert_eq!(tok.encode_with("xy", RAW), [id(&tok, "x"), id(&tok, "y")]);
}

#[test]
fn ignore_merges_takes_whole_words_that_are_tokens() {
    // llama-bpe (Llama-3) looks the whole word up first, even without a merge path to it.
    let tok = bpe("llama-bpe", &[("hello", NORMAL)], &[], vec![]);
    assert_eq!(tok.encode_with("hello", RAW), [id(&tok, "hello")]);
    let tok = bpe("qwen2", &[("hello", NORMAL)], &[], vec![]);
    assert_eq!(tok.encode_with("hello", RAW).len(), 5);
}

#[test]
fn special_tokens_are_parsed_longest_first_and_only_when_asked() {
    let tok = bpe(
        "qwen2",
        &[
            ("<|a|>", CONTROL),
            ("<|a|><|b|>", CONTROL),
            ("<tag>", USER_DEFINED),
        ],
        &[],
        vec![],
    );
    let (a, ab, tag) = (id(&tok, "<|a|>"), id(&tok, "<|a|><|b|>"), id(&tok, "<tag>"));
    let ids = tok.encode_with("<|a|><|b|>x<|a|>", RAW);
    assert_eq!(ids, [ab, id(&tok, "x"), a]);
    // Without parse_special, control tokens are text; user-defined ones still match.
    let no_special = EncodeOptions {
        add_special: false,
        parse_special: false,
    };
    let ids = tok.encode_with("<|a|><tag>", no_special);
    assert!(!ids.contains(&a));
    assert_eq!(ids.last(), Some(&tag));
    // Rendered only when asked for.
    assert_eq!(
        tok.decode(&[a, tag], DecodeOptions::default()),
        "<tag>",
        "control tokens vanish, user-defined ones are text"
    );
    let render = DecodeOptions {
        render_special: true,
        ..DecodeOptions::default()
    };
    assert_eq!(tok.decode(&[a, tag], render), "<|a|><tag>");
}

#[test]
fn phi3_special_tokens_swallow_the_whitespace_after_them() {
    // llama.cpp sets RSTRIP on every special token of a model named like Phi-3.
    let tok = bpe(
        "gpt-2",
        &[("<|user|>", CONTROL)],
        &[],
        vec![("general.name", Value::String("Phi-3-mini".into()))],
    );
    let user = id(&tok, "<|user|>");
    assert!(tok.token_attr(user).intersects(TokenAttr::RSTRIP));
    assert_eq!(
        tok.encode_with("<|user|> \n hi", RAW),
        [user, id(&tok, "h"), id(&tok, "i")]
    );
}

#[test]
fn bos_and_eos_follow_the_metadata() {
    let extra = [("<s>", CONTROL), ("</s>", CONTROL)];
    let (bos, eos) = (256, 257);
    let keys = |add_bos: bool, add_eos: bool| {
        vec![
            ("tokenizer.ggml.bos_token_id", Value::U32(bos)),
            ("tokenizer.ggml.eos_token_id", Value::U32(eos)),
            ("tokenizer.ggml.add_bos_token", Value::Bool(add_bos)),
            ("tokenizer.ggml.add_eos_token", Value::Bool(add_eos)),
        ]
    };
    let tok = bpe("qwen2", &extra, &[], keys(true, true));
    assert_eq!(tok.encode("x"), [bos, id(&tok, "x"), eos]);
    assert_eq!(tok.encode(""), [bos, eos]);
    let remove = DecodeOptions {
        remove_special: true,
        render_special: true,
    };
    assert_eq!(tok.decode(&[bos, id(&tok, "x"), eos], remove), "x");
    let tok = bpe("qwen2", &extra, &[], keys(false, false));
    assert_eq!(tok.encode("x"), [id(&tok, "x")]);
    // Llama-3 vocabularies add BOS when the key is absent.
    let tok = bpe(
        "llama-bpe",
        &extra,
        &[],
        vec![("tokenizer.ggml.bos_token_id", Value::U32(bos))],
    );
    assert!(tok.add_bos());
}

#[test]
fn end_of_generation_follows_llama_cpps_rules() {
    let tok = bpe(
        "qwen2",
        &[
            ("<|im_end|>", CONTROL),
            ("<|endoftext|>", CONTROL),
            ("<|fim_pad|>", CONTROL),
            ("<|repo_name|>", CONTROL),
            ("</s>", NORMAL),
        ],
        &[],
        vec![],
    );
    // Without tokenizer.ggml.eos_token_id, llama.cpp's GPT-2 default EOS is id 11.
    assert_eq!(tok.special_tokens().eos, Some(11));
    let eog: Vec<u32> = tok.eog_ids().collect();
    assert_eq!(eog, [11, 256, 257, 258, 259, 260]);
    // "</s>" is an end marker, so llama.cpp makes it a control token.
    assert!(tok.token_attr(260).intersects(TokenAttr::CONTROL));
    assert_eq!(tok.special_tokens().eot, Some(256));
    assert_eq!(tok.special_tokens().fim_pad, Some(258));

    // o200k_harmony: "<|end|>" is not EOG next to "<|return|>" and "<|call|>".
    let tok = bpe(
        "gpt-4o",
        &[
            ("<|end|>", CONTROL),
            ("<|return|>", CONTROL),
            ("<|call|>", CONTROL),
        ],
        &[],
        vec![],
    );
    assert!(!tok.is_eog(256));
    assert_eq!(tok.token_attr(256), TokenAttr::USER_DEFINED);
    assert!(tok.is_eog(257) && tok.is_eog(258));
}

#[test]
fn decoding_cleans_spaces_for_gpt2_style_vocabularies() {
    // "gpt-2" keeps clean_spaces on: " ," and " 's" lose their space; "qwen2" turns it off.
    let text = "a , b 's";
    let tok = bpe("gpt-2", &[], &[], vec![]);
    assert_eq!(
        tok.decode(&tok.encode_with(text, RAW), DecodeOptions::default()),
        "a, b's"
    );
    let tok = bpe("qwen2", &[], &[], vec![]);
    assert_eq!(
        tok.decode(&tok.encode_with(text, RAW), DecodeOptions::default()),
        text
    );
}

/// A SentencePiece vocabulary: `<unk> <s> </s>`, byte tokens for every byte, then pieces.
fn spm(pieces: &[(&str, f32)], more: Vec<(&str, Value)>) -> Tokenizer {
    let mut tokens = vec!["<unk>".to_owned(), "<s>".to_owned(), "</s>".to_owned()];
    let mut types = vec![2, CONTROL, CONTROL];
    let mut scores = vec![0.0, 0.0, 0.0];
    for b in 0..=255u8 {
        tokens.push(format!("<0x{b:02X}>"));
        types.push(BYTE);
        scores.push(0.0);
    }
    for (p, s) in pieces {
        tokens.push((*p).to_owned());
        types.push(NORMAL);
        scores.push(*s);
    }
    let mut kv = vec![
        ("tokenizer.ggml.model", Value::String("llama".into())),
        ("tokenizer.ggml.tokens", Value::Array(Array::String(tokens))),
        ("tokenizer.ggml.token_type", Value::Array(Array::I32(types))),
        ("tokenizer.ggml.scores", Value::Array(Array::F32(scores))),
    ];
    kv.extend(more);
    build(kv).unwrap()
}

#[test]
fn spm_merges_highest_score_first_with_byte_fallback() {
    let tok = spm(
        &[
            ("▁", -1.0),
            ("a", -1.0),
            ("b", -1.0),
            ("c", -1.0),
            ("ab", -5.0),
            ("bc", -2.0),
            ("▁a", -3.0),
        ],
        vec![],
    );
    assert_eq!(tok.kind(), VocabKind::Spm);
    // BOS by default; a space prefix; "bc" (score -2) beats "▁a"/"ab"; "é" is bytes.
    let ids = tok.encode("abc é");
    let t = |s: &str| id(&tok, s);
    assert_eq!(ids, [1, t("▁a"), t("bc"), t("▁"), t("<0xC3>"), t("<0xA9>")]);
    // Decoding strips the prefix space of the first token, except right after a removed BOS
    // (llama.cpp's `detokenize` keeps it there).
    let remove = DecodeOptions {
        remove_special: true,
        render_special: false,
    };
    assert_eq!(tok.decode(&ids, remove), " abc é");
    assert_eq!(tok.decode(&ids[1..], remove), "abc é");
    assert_eq!(tok.special_tokens().nl, Some(3 + 10));
}

#[test]
fn spm_adds_the_space_prefix_after_special_tokens_only_when_configured() {
    let pieces = [("▁", -1.0), ("a", -1.0), ("▁a", -0.5)];
    let tok = spm(&pieces, vec![]);
    // "</s>" is a control token; the text after it gets a space prefix again.
    assert_eq!(tok.encode("a</s>a"), [1, id(&tok, "▁a"), 2, id(&tok, "▁a")]);
    let tok = spm(
        &pieces,
        vec![("tokenizer.ggml.add_space_prefix", Value::Bool(false))],
    );
    assert_eq!(tok.encode("a"), [1, id(&tok, "a")]);
}

#[test]
fn metadata_errors_name_the_key_or_value() {
    let base = |model: &str, pre: &str| {
        vec![
            ("tokenizer.ggml.model", Value::String(model.into())),
            ("tokenizer.ggml.pre", Value::String(pre.into())),
            ("tokenizer.ggml.tokens", strings(&["a"])),
            ("tokenizer.ggml.merges", strings(&[])),
        ]
    };
    let err = build(base("gpt2", "no-such-pre")).unwrap_err();
    assert!(matches!(err, TokenizerError::UnknownPre { ref pre } if pre == "no-such-pre"));
    assert_eq!(
        err.to_string(),
        "unknown pre-tokenizer 'no-such-pre' (tokenizer.ggml.pre)"
    );
    let err = build(base("bert", "default")).unwrap_err();
    assert!(
        matches!(err, TokenizerError::UnsupportedModel { .. }),
        "{err}"
    );
    let err = build(base("frobnicate", "default")).unwrap_err();
    assert!(err.to_string().contains("'frobnicate'"), "{err}");
    let err = build(vec![("tokenizer.ggml.model", Value::String("gpt2".into()))]).unwrap_err();
    assert!(err.to_string().contains("tokenizer.ggml.tokens"), "{err}");
    let err = build(vec![
        ("tokenizer.ggml.model", Value::String("llama".into())),
        ("tokenizer.ggml.tokens", Value::U32(3)),
    ])
    .unwrap_err();
    assert!(
        matches!(
            err,
            TokenizerError::WrongType {
                key: "tokenizer.ggml.tokens",
                ..
            }
        ),
        "{err}"
    );
    let mut no_merges = base("gpt2", "qwen2");
    no_merges.pop();
    let err = build(no_merges).unwrap_err();
    assert!(err.to_string().contains("tokenizer.ggml.merges"), "{err}");
    // add_bos without a BOS token (gpt2's default BOS id 11 is out of this vocabulary).
    let mut kv = base("gpt2", "qwen2");
    kv.push(("tokenizer.ggml.add_bos_token", Value::Bool(true)));
    let err = build(kv).unwrap_err();
    assert!(
        matches!(err, TokenizerError::MissingSpecial { .. }),
        "{err}"
    );
}

#[test]
fn chat_template_renders_from_the_vocabulary() {
    let tok = bpe(
        "qwen2",
        &[("<|im_start|>", CONTROL), ("<|im_end|>", CONTROL)],
        &[],
        vec![
            ("tokenizer.ggml.eos_token_id", Value::U32(257)),
            (
                "tokenizer.chat_template",
                Value::String(
                    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}[{{ eos_token }}]".into(),
                ),
            ),
        ],
    );
    let tpl = tok.chat_template().unwrap();
    let text = tpl
        .render(&[specula_tokenizer::ChatMessage::new("user", "hi")], true)
        .unwrap();
    assert_eq!(
        text,
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n[<|im_end|>]"
    );
    let ids = tok.encode(&text);
    assert_eq!(ids[0], 256);
    let no_template = bpe("qwen2", &[], &[], vec![]);
    assert!(matches!(
        no_template.chat_template(),
        Err(TokenizerError::NoChatTemplate)
    ));
}

proptest! {
    /// With every byte in the vocabulary, byte-level BPE is lossless: the tokens' pieces give
    /// back the text, whatever the pre-tokenizer makes of it. (`decode` is not the identity:
    /// like llama.cpp's detokenize it cleans spaces before punctuation for some vocabularies,
    /// e.g. `" ?"` → `"?"` with `llama-bpe` — a case this property once found.)
    #[test]
    fn byte_level_bpe_round_trips(text in "\\PC*", pre in prop::sample::select(vec!["qwen2", "smollm", "llama-bpe", "gpt-4o", "deepseek-llm", "kimi-k2"])) {
        // The merges' results are tokens too: a merge whose result is not in the vocabulary
        // falls back to the raw bytes of its UTF-8 text, as llama.cpp does, which drops
        // byte-level characters such as `Ġ` (found by this property: " t" with `Ġ t`).
        let tok = bpe(pre, &[("Ġt", NORMAL), ("he", NORMAL), ("Ġthe", NORMAL)], &["Ġ t", "h e", "Ġt he"], vec![]);
        let ids = tok.encode_with(&text, EncodeOptions { add_special: false, parse_special: false });
        let back: Vec<u8> = ids.iter().flat_map(|&id| tok.token_to_piece(id, false).to_vec()).collect();
        prop_assert_eq!(back, text.as_bytes());
    }
}

#[test]
fn tokenizers_can_be_shared_between_threads() {
    fn shared<T: Send + Sync>() {}
    shared::<Tokenizer>();
    shared::<specula_tokenizer::ChatTemplate>();
    // Debug output is a summary, not the vocabulary.
    let tok = bpe("qwen2", &[], &[], vec![]);
    let dbg = format!("{tok:?}");
    assert!(dbg.contains("n_tokens: 256") && dbg.len() < 400, "{dbg}");
}
