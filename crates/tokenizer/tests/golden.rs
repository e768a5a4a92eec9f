//! specula-tokenizer against llama.cpp: ids, decoded text, pieces, attributes, special ids,
//! end-of-generation sets and rendered chat templates recorded by
//! `reference/tokenizer_golden.py` (llama.cpp 0c1e57098 through its ctypes bindings) in
//! `golden/tokenizer/<model>.json`. Each test needs its model in the cache and skips with a
//! message otherwise; the standard-library sample also needs CPython 3.11.7's `lib/python3.11`.

use std::path::{Path, PathBuf};
use std::time::Instant;

use serde_json::Value as Json;
use sha2::{Digest, Sha256};
use specula_tokenizer::{ChatMessage, DecodeOptions, EncodeOptions, TokenId, Tokenizer};

fn golden_path(model: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../golden/tokenizer")
        .join(format!("{model}.json"))
}

fn hex(d: impl AsRef<[u8]>) -> String {
    d.as_ref().iter().map(|b| format!("{b:02x}")).collect()
}

fn ids_sha256(ids: &[TokenId]) -> String {
    let mut h = Sha256::new();
    for &id in ids {
        h.update(i32::try_from(id).unwrap().to_le_bytes());
    }
    hex(h.finalize())
}

/// A golden string or `{"bytes": [...]}` as bytes.
fn golden_bytes(v: &Json) -> Vec<u8> {
    match v {
        Json::String(s) => s.as_bytes().to_vec(),
        Json::Object(o) => o["bytes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| u8::try_from(b.as_u64().unwrap()).unwrap())
            .collect(),
        _ => panic!("unexpected golden text {v}"),
    }
}

fn ids_of(v: &Json) -> Vec<TokenId> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| TokenId::try_from(x.as_u64().unwrap()).unwrap())
        .collect()
}

fn opt_id(v: &Json) -> Option<TokenId> {
    v.as_i64().and_then(|i| TokenId::try_from(i).ok())
}

/// Checks one model; returns the list of differences.
fn check(model: &str) -> Option<Vec<String>> {
    let path = specula_testkit::real_model(model)?;
    let g: Json = serde_json::from_str(&std::fs::read_to_string(golden_path(model)).unwrap())
        .expect("golden parses");
    let t0 = Instant::now();
    let tok = Tokenizer::open(&path).expect("tokenizer builds");
    eprintln!(
        "{model}: tokenizer built in {:.0} ms",
        t0.elapsed().as_secs_f64() * 1e3
    );
    let mut bad = Vec::new();

    // Vocabulary.
    let v = &g["vocab"];
    if tok.n_tokens() as u64 != v["n_tokens"].as_u64().unwrap() {
        bad.push(format!("n_tokens {} vs {}", tok.n_tokens(), v["n_tokens"]));
    }
    if tok.add_bos() != v["add_bos"].as_bool().unwrap() {
        bad.push(format!("add_bos {}", tok.add_bos()));
    }
    if tok.add_eos() != v["add_eos"].as_bool().unwrap() {
        bad.push(format!("add_eos {}", tok.add_eos()));
    }
    let sp = tok.special_tokens();
    let named = [
        ("bos", sp.bos),
        ("eos", sp.eos),
        ("sep", sp.sep),
        ("nl", sp.nl),
        ("pad", sp.pad),
        ("mask", sp.mask),
        ("fim_pre", sp.fim_pre),
        ("fim_suf", sp.fim_suf),
        ("fim_mid", sp.fim_mid),
        ("fim_pad", sp.fim_pad),
        ("fim_rep", sp.fim_rep),
        ("fim_sep", sp.fim_sep),
    ];
    for (name, ours) in named {
        let theirs = opt_id(&v["special"][name]);
        if ours != theirs {
            bad.push(format!(
                "special {name}: ours {ours:?}, llama.cpp {theirs:?}"
            ));
        }
    }
    // EOT: llama.cpp picks among several candidate texts in hash-map order (see vocab.rs);
    // ours must be an end-of-generation token with one of the recognised texts.
    let eot_theirs = opt_id(&v["special"]["eot"]);
    if sp.eot != eot_theirs {
        let ok = sp.eot.is_some_and(|e| tok.is_eog(e));
        eprintln!(
            "{model}: EOT differs from llama.cpp's hash-order pick: ours {:?} ({:?}), llama.cpp {:?} ({:?})",
            sp.eot,
            sp.eot.and_then(|e| tok.token_text(e)),
            eot_theirs,
            eot_theirs.and_then(|e| tok.token_text(e)),
        );
        if !ok {
            bad.push(format!("eot {:?} is not an EOG token", sp.eot));
        }
    }
    let eog: Vec<TokenId> = tok.eog_ids().collect();
    if eog != ids_of(&v["eog"]) {
        bad.push(format!("eog {eog:?} vs {}", v["eog"]));
    }
    let mut attr_hash = Sha256::new();
    let mut hist = std::collections::BTreeMap::<String, u64>::new();
    for id in 0..tok.n_tokens() {
        let a = tok.token_attr(TokenId::try_from(id).unwrap()).0;
        attr_hash.update(a.to_le_bytes());
        *hist.entry(a.to_string()).or_default() += 1;
    }
    let theirs_hist: std::collections::BTreeMap<String, u64> = v["attr_histogram"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(k, n)| (k.clone(), n.as_u64().unwrap()))
        .collect();
    if hist != theirs_hist {
        bad.push(format!("attribute histogram {hist:?} vs {theirs_hist:?}"));
    }
    if hex(attr_hash.finalize()) != v["attr_sha256"].as_str().unwrap() {
        bad.push("attribute hash differs".into());
    }
    for (special, key) in [(true, "special"), (false, "plain")] {
        let mut h = Sha256::new();
        for id in 0..tok.n_tokens() {
            let p = tok.token_to_piece(TokenId::try_from(id).unwrap(), special);
            h.update(u32::try_from(p.len()).unwrap().to_le_bytes());
            h.update(p);
        }
        if hex(h.finalize()) != v["pieces_sha256"][key].as_str().unwrap() {
            bad.push(format!("pieces hash ({key}) differs"));
        }
    }
    for p in g["pieces"].as_array().unwrap() {
        let id = TokenId::try_from(p["id"].as_u64().unwrap()).unwrap();
        if tok.token_text(id) != p["text"].as_str() {
            bad.push(format!(
                "text of {id}: {:?} vs {}",
                tok.token_text(id),
                p["text"]
            ));
        }
        for (special, key) in [(true, "special"), (false, "plain")] {
            if tok.token_to_piece(id, special) != golden_bytes(&p[key]).as_slice() {
                bad.push(format!("piece of {id} ({key})"));
            }
        }
    }

    // Strings.
    let mut n_strings = 0;
    for s in g["strings"].as_array().unwrap() {
        let text = s["text"].as_str().unwrap();
        for m in s["modes"].as_array().unwrap() {
            n_strings += 1;
            let opts = EncodeOptions {
                add_special: m["add_special"].as_bool().unwrap(),
                parse_special: m["parse_special"].as_bool().unwrap(),
            };
            let ids = tok.encode_with(text, opts);
            let theirs = ids_of(&m["ids"]);
            if ids != theirs {
                bad.push(format!(
                    "encode {text:?} {opts:?}:\n  ours     {ids:?}\n  llama.cpp {theirs:?}"
                ));
            }
            // Decoded text is recorded for the parse_special modes only.
            if m.get("detok_unparse").is_none() {
                continue;
            }
            let unparse = tok.decode_bytes(
                &theirs,
                DecodeOptions {
                    remove_special: false,
                    render_special: true,
                },
            );
            if unparse != golden_bytes(&m["detok_unparse"]) {
                bad.push(format!(
                    "decode (render special) {theirs:?}: {:?} vs {}",
                    String::from_utf8_lossy(&unparse),
                    m["detok_unparse"]
                ));
            }
            let removed = tok.decode_bytes(
                &theirs,
                DecodeOptions {
                    remove_special: true,
                    render_special: false,
                },
            );
            if removed != golden_bytes(&m["detok_remove"]) {
                bad.push(format!(
                    "decode (remove special) {theirs:?}: {:?} vs {}",
                    String::from_utf8_lossy(&removed),
                    m["detok_remove"]
                ));
            }
        }
    }

    // Standard library sample.
    let root = Path::new(g["stdlib"]["root"].as_str().unwrap());
    let (mut n_files, mut n_bytes, mut n_tokens, mut secs) = (0, 0usize, 0usize, 0.0);
    for f in g["stdlib"]["files"].as_array().unwrap() {
        let rel = f["path"].as_str().unwrap();
        let Ok(raw) = std::fs::read(root.join(rel)) else {
            let _: Option<()> = specula_testkit::skip(&format!(
                "{} not found (CPython 3.11.7 standard library)",
                root.join(rel).display()
            ));
            continue;
        };
        if hex(Sha256::digest(&raw)) != f["text_sha256"].as_str().unwrap() {
            let _: Option<()> = specula_testkit::skip(&format!(
                "{rel} differs from the file the golden was made from"
            ));
            continue;
        }
        let text = String::from_utf8(raw).unwrap();
        for m in f["modes"].as_array().unwrap() {
            let opts = EncodeOptions {
                add_special: m["add_special"].as_bool().unwrap(),
                parse_special: m["parse_special"].as_bool().unwrap(),
            };
            let t = Instant::now();
            let ids = tok.encode_with(&text, opts);
            secs += t.elapsed().as_secs_f64();
            n_bytes += text.len();
            n_tokens += ids.len();
            let (n, sha) = (
                m["n_ids"].as_u64().unwrap(),
                m["ids_sha256"].as_str().unwrap(),
            );
            if ids.len() as u64 != n || ids_sha256(&ids) != sha {
                bad.push(format!("stdlib {rel} {opts:?}: {} ids vs {n}", ids.len()));
            }
        }
        n_files += 1;
    }
    #[allow(clippy::cast_precision_loss, reason = "a throughput figure")]
    let mbps = n_bytes as f64 / 1e6 / secs.max(1e-9);
    eprintln!(
        "{model}: {n_strings} string cases, {n_files} stdlib files ({n_bytes} bytes, {n_tokens} tokens) \
         encoded at {mbps:.1} MB/s in this build profile"
    );

    // Chat template.
    match (&g["chat"], tok.chat_template_source()) {
        (Json::Null, None) => {}
        (Json::Null, Some(_)) => bad.push("chat template present, golden has none".into()),
        (_, None) => bad.push("chat template missing".into()),
        (chat, Some(src)) => {
            if hex(Sha256::digest(src.as_bytes())) != chat["template_sha256"].as_str().unwrap() {
                bad.push("chat template source differs".into());
            }
            let tpl = tok.chat_template().expect("template compiles");
            for r in chat["renders"].as_array().unwrap() {
                let agp = r["add_generation_prompt"].as_bool().unwrap();
                let messages_json = r["messages_json"].as_str().unwrap();
                let tools = r["tools_json"]
                    .as_str()
                    .map(|t| format!("{{\"tools\": {t}}}"));
                let ours = tpl
                    .render_json(messages_json, agp, tools.as_deref())
                    .expect("template renders");
                if ours != r["text"].as_str().unwrap() {
                    bad.push(format!(
                        "chat render (agp {agp}): {ours:?} vs {}",
                        r["text"]
                    ));
                }
                if tools.is_none() {
                    // The plain path with `ChatMessage`s renders the same.
                    let messages: Vec<ChatMessage> =
                        serde_json::from_str::<Vec<Json>>(messages_json)
                            .unwrap()
                            .iter()
                            .map(|m| {
                                ChatMessage::new(
                                    m["role"].as_str().unwrap(),
                                    m["content"].as_str().unwrap(),
                                )
                            })
                            .collect();
                    if tpl.render(&messages, agp).expect("template renders") != ours {
                        bad.push(format!("chat render via ChatMessage (agp {agp}) differs"));
                    }
                }
            }
        }
    }
    Some(bad)
}

fn assert_model(model: &str) {
    if let Some(bad) = check(model) {
        assert!(
            bad.is_empty(),
            "{model}: {} differences from llama.cpp:\n{}",
            bad.len(),
            bad.iter().take(30).cloned().collect::<Vec<_>>().join("\n")
        );
    }
}

#[test]
fn smollm2_135m_matches_llama_cpp() {
    assert_model("smollm2-135m");
}

#[test]
fn qwen25_coder_05b_matches_llama_cpp() {
    assert_model("qwen2.5-coder-0.5b");
}

#[test]
fn qwen25_coder_15b_matches_llama_cpp() {
    assert_model("qwen2.5-coder-1.5b");
}

#[test]
fn gemma3_270m_matches_llama_cpp() {
    assert_model("gemma3-270m");
}
