//! Every pre-tokenizer llama.cpp knows, against llama.cpp itself: the `tokenizer.ggml.pre`
//! names with the type and flags they select, each type's regexes (parsed from llama.cpp's
//! `src/llama-vocab.cpp`), and the words llama.cpp's `unicode_regex_split` cuts a set of
//! tricky strings into — recorded by `reference/tokenizer_golden.py` in
//! `golden/tokenizer/pretokenizers.json`. Needs no model.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::Value as Json;
use specula_tokenizer::{PreSettings, PreTokenizer, PreType};

fn golden() -> Json {
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../golden/tokenizer/pretokenizers.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// The types reachable from the names, by llama.cpp enum name, plus the default.
fn types_by_name(g: &Json) -> BTreeMap<String, PreType> {
    let mut m: BTreeMap<String, PreType> = g["names"]
        .as_object()
        .unwrap()
        .keys()
        .map(|n| {
            let pre = PreSettings::from_name(n).unwrap().pre;
            (pre.llama_cpp_name().to_owned(), pre)
        })
        .collect();
    m.insert("DEFAULT".into(), PreType::Default);
    m
}

#[test]
fn names_select_llama_cpps_types_and_flags() {
    let g = golden();
    for (name, entry) in g["names"].as_object().unwrap() {
        let s = PreSettings::from_name(name).unwrap_or_else(|| panic!("{name} is not known"));
        assert_eq!(
            s.pre.llama_cpp_name(),
            entry["type"].as_str().unwrap(),
            "{name}"
        );
        let flags = entry["flags"].as_object().unwrap();
        let flag = |k: &str| flags.get(k).and_then(Json::as_str);
        assert_eq!(
            s.clean_spaces,
            flag("clean_spaces") != Some("false"),
            "{name} clean_spaces"
        );
        assert_eq!(
            s.ignore_merges,
            flag("ignore_merges") == Some("true"),
            "{name} ignore_merges"
        );
        assert_eq!(
            s.add_bos,
            flag("add_bos").map(|v| v == "true"),
            "{name} add_bos"
        );
        assert_eq!(
            s.escape_whitespaces,
            flag("escape_whitespaces") == Some("true"),
            "{name} escape_whitespaces"
        );
        assert_eq!(s.add_sep, flag("add_sep") == Some("true"), "{name} add_sep");
        assert_eq!(
            s.no_bos,
            flag("special_bos_id") == Some("LLAMA_TOKEN_NULL"),
            "{name} bos"
        );
    }
    assert_eq!(PreSettings::from_name("no-such-pre"), None);
}

#[test]
fn every_type_splits_like_llama_cpp() {
    let g = golden();
    let by_name = types_by_name(&g);
    let strings: Vec<&str> = g["strings"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap())
        .collect();
    let mut bad = Vec::new();
    let mut checked = 0;
    for (tname, entry) in g["types"].as_object().unwrap() {
        let Some(&pre) = by_name.get(tname) else {
            // A type no name selects (llama.cpp keeps a few enum values for old files).
            continue;
        };
        let (regexes, byte_encode) = pre.regex_exprs();
        let theirs: Vec<&str> = entry["regexes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r.as_str().unwrap())
            .collect();
        assert_eq!(regexes, theirs.as_slice(), "{tname}: regexes");
        assert_eq!(
            byte_encode,
            entry["byte_encode"].as_bool().unwrap(),
            "{tname}"
        );
        let pt = PreTokenizer::new(pre).unwrap_or_else(|e| panic!("{tname}: {e}"));
        for (text, split) in strings.iter().zip(entry["splits"].as_array().unwrap()) {
            let Some(split) = split.as_array() else {
                continue;
            };
            let theirs: Vec<usize> = split
                .iter()
                .map(|n| usize::try_from(n.as_u64().unwrap()).unwrap())
                .collect();
            let ours: Vec<usize> = pt.split(text).iter().map(|w| w.len()).collect();
            checked += 1;
            if ours != theirs {
                bad.push(format!(
                    "{tname} {text:?}:\n  ours      {:?}\n  llama.cpp {:?}",
                    pt.split(text),
                    words(text, &theirs)
                ));
            }
        }
    }
    eprintln!("{checked} (type, string) splits compared");
    assert!(
        bad.is_empty(),
        "{} differences:\n{}",
        bad.len(),
        bad.join("\n")
    );
}

fn words<'a>(text: &'a str, lens: &[usize]) -> Vec<&'a str> {
    let mut s = 0;
    lens.iter()
        .map(|&n| {
            let w = text.get(s..s + n).unwrap_or("<split inside a character>");
            s += n;
            w
        })
        .collect()
}
