//! `specula run` with a DFlash drafter, end to end on tiny random GGUFs written here: the
//! drafter is picked from the draft file's architecture (or `--dflash`), greedy output is the
//! plain output under both injection policies, `--spec-draft-n-max` is clamped to the block
//! size minus one, and contradictory or unsupported flags are one-line errors. The same for an
//! EAGLE-3 head (auto-detected, or `--eagle3`), and `specula bench -md`. `specula serve` runs
//! both drafters, auto-detected, with the answers of `specula run`.

use std::path::Path;
use std::process::Command;

use serde_json::Value as Json;
use specula_gguf::{Array, GgmlType, GgufWriter, Value};
use specula_testkit::{byte_symbols, values};

mod common;
use common::specula;

const N_VOCAB: usize = 256;
const E: usize = 64;
const N_FF: usize = 128;
const N_HEAD: usize = 4;
const N_HEAD_KV: usize = 2;
const HD: usize = 16;

fn u(v: usize) -> Value {
    Value::U32(u32::try_from(v).unwrap())
}

/// Writes an F32 GGUF: metadata of `arch`, the tokenizer, and random tensors (`(name, dims)`;
/// one-dim tensors are norm weights near 1).
fn write(
    path: &Path,
    arch: &str,
    n_layer: usize,
    extra: &[(&str, Value)],
    tensors: &[(String, Vec<usize>)],
) {
    let k = |s: &str| format!("{arch}.{s}");
    let mut w = GgufWriter::new();
    let mut md: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String(arch.into())),
        (k("block_count"), u(n_layer)),
        (k("context_length"), u(512)),
        (k("embedding_length"), u(E)),
        (k("feed_forward_length"), u(N_FF)),
        (k("attention.head_count"), u(N_HEAD)),
        (k("attention.head_count_kv"), u(N_HEAD_KV)),
        (k("rope.freq_base"), Value::F32(1e6)),
        (k("attention.layer_norm_rms_epsilon"), Value::F32(1e-6)),
        (k("attention.key_length"), u(HD)),
        (k("attention.value_length"), u(HD)),
        ("tokenizer.ggml.model".into(), Value::String("gpt2".into())),
        ("tokenizer.ggml.pre".into(), Value::String("default".into())),
        (
            "tokenizer.ggml.tokens".into(),
            Value::Array(Array::String(byte_symbols())),
        ),
        (
            "tokenizer.ggml.token_type".into(),
            Value::Array(Array::I32(vec![1; N_VOCAB])),
        ),
        (
            "tokenizer.ggml.merges".into(),
            Value::Array(Array::String(vec!["a 1".into()])),
        ),
        ("tokenizer.ggml.bos_token_id".into(), Value::U32(1)),
        ("tokenizer.ggml.eos_token_id".into(), Value::U32(0)),
        ("tokenizer.ggml.add_bos_token".into(), Value::Bool(false)),
    ];
    md.extend(extra.iter().map(|(k, v)| ((*k).to_owned(), v.clone())));
    for (k, v) in md {
        w.add(k, v).unwrap();
    }
    let mut data = Vec::new();
    for (i, (name, dims)) in tensors.iter().enumerate() {
        let d: Vec<u64> = dims.iter().map(|&d| d as u64).collect();
        w.add_tensor(name.as_str(), GgmlType::F32, &d).unwrap();
        let n: usize = dims.iter().product();
        let x: Vec<f32> = if dims.len() == 1 {
            values(i as u64 + 500, n, 0.2)
                .iter()
                .map(|v| 1.0 + v)
                .collect()
        } else {
            values(i as u64 + 900, n, 0.5)
        };
        data.push(x.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>());
    }
    let refs: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
    std::fs::write(path, w.to_vec(&refs).unwrap()).unwrap();
}

fn layer(l: usize, qk_norm: bool) -> Vec<(String, Vec<usize>)> {
    let (q, kv) = (N_HEAD * HD, N_HEAD_KV * HD);
    let n = |s: &str| format!("blk.{l}.{s}");
    let mut t = vec![
        (n("attn_norm.weight"), vec![E]),
        (n("ffn_norm.weight"), vec![E]),
        (n("attn_q.weight"), vec![E, q]),
        (n("attn_k.weight"), vec![E, kv]),
        (n("attn_v.weight"), vec![E, kv]),
        (n("attn_output.weight"), vec![q, E]),
        (n("ffn_gate.weight"), vec![E, N_FF]),
        (n("ffn_up.weight"), vec![E, N_FF]),
        (n("ffn_down.weight"), vec![N_FF, E]),
    ];
    if qk_norm {
        t.push((n("attn_q_norm.weight"), vec![HD]));
        t.push((n("attn_k_norm.weight"), vec![HD]));
    }
    t
}

fn files(dir: &Path) -> (String, String) {
    let target = dir.join("target.gguf");
    let mut t = vec![
        ("token_embd.weight".to_owned(), vec![E, N_VOCAB]),
        ("output_norm.weight".to_owned(), vec![E]),
        ("output.weight".to_owned(), vec![E, N_VOCAB]),
    ];
    for l in 0..3 {
        t.extend(layer(l, true));
    }
    write(&target, "qwen3", 3, &[], &t);
    let draft = dir.join("dflash.gguf");
    let mut d = vec![
        ("fc.weight".to_owned(), vec![2 * E, E]),
        ("enc.output_norm.weight".to_owned(), vec![E]),
        ("output_norm.weight".to_owned(), vec![E]),
    ];
    for l in 0..2 {
        d.extend(layer(l, true));
    }
    write(
        &draft,
        "dflash",
        2,
        &[
            ("dflash.block_size", u(6)),
            ("dflash.target_layers", Value::Array(Array::I32(vec![1, 3]))),
            ("tokenizer.ggml.mask_token_id", Value::U32(255)),
        ],
        &d,
    );
    let head = dir.join("eagle3.gguf");
    let (q, kv) = (N_HEAD * HD, N_HEAD_KV * HD);
    let n = |s: &str| format!("blk.0.{s}");
    let h = vec![
        ("fc.weight".to_owned(), vec![3 * E, E]),
        ("output_norm.weight".to_owned(), vec![E]),
        (n("attn_norm.weight"), vec![E]),
        (n("attn_norm_2.weight"), vec![E]),
        (n("ffn_norm.weight"), vec![E]),
        (n("attn_q.weight"), vec![2 * E, q]),
        (n("attn_k.weight"), vec![2 * E, kv]),
        (n("attn_v.weight"), vec![2 * E, kv]),
        (n("attn_output.weight"), vec![q, E]),
        (n("ffn_gate.weight"), vec![E, N_FF]),
        (n("ffn_up.weight"), vec![E, N_FF]),
        (n("ffn_down.weight"), vec![N_FF, E]),
    ];
    write(
        &head,
        "eagle3",
        1,
        &[
            (
                "eagle3.target_layers",
                Value::Array(Array::I32(vec![1, 2, 3])),
            ),
            ("eagle3.target_hidden_size", u(E)),
        ],
        &h,
    );
    (
        target.to_str().unwrap().to_owned(),
        draft.to_str().unwrap().to_owned(),
    )
}

fn run_json(args: &[&str]) -> (Json, String) {
    let out = specula(args);
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{err}");
    (serde_json::from_slice(&out.stdout).expect("JSON"), err)
}

#[test]
fn dflash_drafter_from_the_command_line() {
    let dir = tempfile::tempdir().unwrap();
    let (t, d) = files(dir.path());
    let base = [
        "run",
        "-m",
        &t,
        "-p",
        "Hello, world",
        "-n",
        "24",
        "--temp",
        "0",
        "--json",
        "-t",
        "1",
    ];
    let (plain, _) = run_json(&base);
    let want = &plain["generated_ids"];
    assert_eq!(want.as_array().unwrap().len(), 24);
    for extra in [
        vec!["-md", d.as_str()],
        vec![
            "-md",
            d.as_str(),
            "--dflash",
            "--dflash-defer-injection",
            "0",
        ],
        vec![
            "-md",
            d.as_str(),
            "--spec-type",
            "draft-dflash",
            "--spec-fixed",
            "--spec-draft-p-min",
            "0",
        ],
    ] {
        let mut args = base.to_vec();
        args.extend(&extra);
        let (got, err) = run_json(&args);
        assert_eq!(&got["generated_ids"], want, "{extra:?}");
        assert_eq!(got["spec"]["type"], "draft-dflash", "{extra:?}");
        // The default n_max 16 does not fit a block of 6.
        assert!(err.contains("clamped to 5"), "{err}");
        if extra.contains(&"--spec-fixed") {
            let drafted = got["timings"]["draft_n"].as_u64().unwrap();
            let rounds = got["timings"]["draft_rounds"].as_u64().unwrap();
            assert!(rounds > 0 && drafted <= 5 * rounds, "{got}");
        }
    }

    let bad = |extra: &[&str], needle: &str| {
        let mut args = base.to_vec();
        args.extend(extra);
        let out = specula(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        // 1: our errors; 2: clap's usage errors.
        assert!(matches!(out.status.code(), Some(1 | 2)), "{err}");
        assert!(err.contains(needle), "expected `{needle}` in: {err}");
        assert!(!err.contains("panicked"), "{err}");
    };
    bad(
        &["-md", &d, "--spec-type", "draft-simple", "--dflash"],
        "contradicts --dflash",
    );
    bad(
        &["-md", &d, "--dflash-defer-injection", "2"],
        "dflash-defer-injection",
    );
    // The target as a "DFlash drafter".
    bad(&["-md", &t, "--dflash"], "DFlash");
}

/// `specula serve` with a feature drafter from the command line (auto-detected from `-md`):
/// the greedy answer of a completion is `specula run`'s, the slots report the drafter, and the
/// DFlash default draft length is clamped to the block.
#[cfg(unix)]
#[test]
fn serve_runs_feature_drafters_from_the_command_line() {
    use std::io::{BufRead as _, BufReader, Read as _, Write as _};
    let dir = tempfile::tempdir().unwrap();
    let (t, d) = files(dir.path());
    let head = dir.path().join("eagle3.gguf");
    let (plain, _) = run_json(&[
        "run",
        "-m",
        &t,
        "-p",
        "Hello, world",
        "-n",
        "24",
        "--temp",
        "0",
        "--json",
        "-t",
        "1",
    ]);
    let want: Vec<u64> = plain["generated_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    for (md, kind) in [
        (d.as_str(), "draft-dflash"),
        (head.to_str().unwrap(), "draft-eagle3"),
    ] {
        let mut child = Command::new(env!("CARGO_BIN_EXE_specula"))
            .args(["serve", "-m", &t, "-md", md, "--port", "0", "-t", "1"])
            .args(["-c", "256", "--spec-fixed", "--spec-draft-p-min", "0"])
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut err = BufReader::new(child.stderr.take().unwrap());
        let mut log = String::new();
        let addr = loop {
            let mut line = String::new();
            assert!(err.read_line(&mut line).unwrap() > 0, "exited: {log}");
            log.push_str(&line);
            if let Some(rest) = line.split("listening on http://").nth(1) {
                break rest.trim().to_owned();
            }
        };
        let ask = |method: &str, path: &str, body: &str| {
            let mut s = std::net::TcpStream::connect(&addr).unwrap();
            write!(
                s,
                "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            )
            .unwrap();
            let mut out = String::new();
            s.read_to_string(&mut out).unwrap();
            out
        };
        let r = ask(
            "POST",
            "/v1/completions",
            r#"{"prompt":"Hello, world","max_tokens":24,"temperature":0,"ignore_eos":true,"stream":true}"#,
        );
        let mut ids = Vec::new();
        let mut last = Json::Null;
        for l in r.lines() {
            if let Some(data) = l.strip_prefix("data: ")
                && data != "[DONE]"
            {
                let v: Json = serde_json::from_str(data).unwrap();
                if let Some(ts) = v["tokens"].as_array() {
                    ids.extend(ts.iter().map(|t| t.as_u64().unwrap()));
                }
                last = v;
            }
        }
        assert_eq!(ids, want, "{kind}: {r}");
        let drafted = last["timings"]["draft_n"].as_u64().unwrap();
        let rounds = last["timings"]["draft_rounds"].as_u64().unwrap();
        assert!(drafted > 0, "{kind}: {last}");
        let slots = ask("GET", "/slots", "");
        assert!(slots.contains(&format!("\"type\":\"{kind}\"")), "{slots}");
        if kind == "draft-dflash" {
            // The default n_max 16 does not fit a block of 6.
            assert!(log.contains("clamped to 5"), "{log}");
            assert!(drafted <= 5 * rounds, "{last}");
        }
        child.kill().unwrap();
        let _ = child.wait();
    }
}

/// llama-bench's fields and their JSON types, in its order: `test::get_fields()` and
/// `test::get_field_type()` of `tools/llama-bench/llama-bench.cpp` (INT → integer, BOOL →
/// `true`/`false`, FLOAT → a number with a fraction, STRING → a string), then the two arrays
/// its JSON and JSONL printers append. Tools that read llama-bench's `-o json|jsonl` read these.
const LLAMA_BENCH_FIELDS: &[(&str, &str)] = &[
    ("build_commit", "string"),
    ("build_number", "int"),
    ("cpu_info", "string"),
    ("gpu_info", "string"),
    ("backends", "string"),
    ("model_filename", "string"),
    ("model_type", "string"),
    ("model_size", "int"),
    ("model_n_params", "int"),
    ("n_batch", "int"),
    ("n_ubatch", "int"),
    ("n_threads", "int"),
    ("cpu_mask", "string"),
    ("cpu_strict", "bool"),
    ("poll", "int"),
    ("type_k", "string"),
    ("type_v", "string"),
    ("n_gpu_layers", "int"),
    ("n_cpu_moe", "int"),
    ("split_mode", "string"),
    ("main_gpu", "int"),
    ("no_kv_offload", "bool"),
    ("flash_attn", "int"),
    ("devices", "string"),
    ("tensor_split", "string"),
    ("tensor_buft_overrides", "string"),
    ("load_mode", "string"),
    ("lazy_mode", "string"),
    ("embeddings", "bool"),
    ("no_op_offload", "int"),
    ("no_host", "bool"),
    ("repack", "bool"),
    ("fit_target", "int"),
    ("fit_min_ctx", "int"),
    ("n_prompt", "int"),
    ("n_gen", "int"),
    ("n_depth", "int"),
    ("test_time", "string"),
    ("avg_ns", "int"),
    ("stddev_ns", "int"),
    ("avg_ts", "float"),
    ("stddev_ts", "float"),
    ("samples_ns", "int[]"),
    ("samples_ts", "float[]"),
];

/// A JSON object's members in the order they were written.
struct Ordered(Vec<(String, Json)>);

impl<'de> serde::Deserialize<'de> for Ordered {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = Ordered;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut m: A,
            ) -> Result<Ordered, A::Error> {
                let mut v = Vec::new();
                while let Some(kv) = m.next_entry()? {
                    v.push(kv);
                }
                Ok(Ordered(v))
            }
        }
        d.deserialize_map(V)
    }
}

/// The JSON type of a value, in the names of [`LLAMA_BENCH_FIELDS`].
fn json_type(v: &Json) -> String {
    match v {
        Json::String(_) => "string".into(),
        Json::Bool(_) => "bool".into(),
        Json::Number(n) if n.is_f64() => "float".into(),
        Json::Number(_) => "int".into(),
        Json::Array(a) => {
            let t: Vec<String> = a.iter().map(json_type).collect();
            assert!(t.windows(2).all(|w| w[0] == w[1]), "mixed array {v}");
            format!("{}[]", t.first().map_or("?", String::as_str))
        }
        _ => format!("{v}"),
    }
}

/// `specula bench -o json|jsonl` carries every llama-bench field, in llama-bench's order and
/// with its JSON type (`test_time` an RFC 3339 UTC time), with and without a drafter; and
/// `-md` takes `--dflash` / `--eagle3` (or detects them) as `specula run` does.
#[test]
fn bench_json_has_llama_bench_fields_and_draft_kind_flags() {
    let dir = tempfile::tempdir().unwrap();
    let (t, d) = files(dir.path());
    let head = dir.path().join("eagle3.gguf");
    let head = head.to_str().unwrap();
    let cases: [(Vec<&str>, Option<&str>); 4] = [
        (vec![], None),
        (vec!["-md", &d, "--dflash"], Some("draft-dflash")),
        (vec!["-md", head, "--eagle3"], Some("draft-eagle3")),
        (vec!["-md", head], Some("draft-eagle3")),
    ];
    for (extra, spec) in &cases {
        for fmt in ["json", "jsonl"] {
            let mut args = vec![
                "bench", "-m", &t, "-p", "8", "-n", "2", "-r", "2", "-t", "1",
            ];
            args.extend(["-o", fmt]);
            args.extend(extra);
            let out = specula(&args);
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(out.status.success(), "{args:?}: {err}");
            let text = String::from_utf8(out.stdout).unwrap();
            let records: Vec<Ordered> = if fmt == "json" {
                serde_json::from_str(&text).expect("one JSON array")
            } else {
                text.lines()
                    .map(|l| serde_json::from_str(l).expect("one object per line"))
                    .collect()
            };
            assert_eq!(records.len(), 2, "{args:?}: pp8 and tg2: {text}");
            for (r, (pp, tg)) in records.iter().zip([(8, 0), (0, 2)]) {
                assert!(r.0.len() >= LLAMA_BENCH_FIELDS.len(), "{args:?}");
                for ((key, value), (want_key, want_type)) in r.0.iter().zip(LLAMA_BENCH_FIELDS) {
                    assert_eq!(key, want_key, "{args:?}: field order");
                    assert_eq!(json_type(value), *want_type, "{args:?}: {key} = {value}");
                }
                let get = |k: &str| &r.0.iter().find(|(key, _)| key == k).unwrap().1;
                assert_eq!(get("n_prompt"), pp, "{args:?}");
                assert_eq!(get("n_gen"), tg, "{args:?}");
                assert_eq!(get("samples_ns").as_array().unwrap().len(), 2);
                let time = get("test_time").as_str().unwrap().as_bytes();
                assert_eq!(time.len(), 20, "{args:?}: {}", get("test_time"));
                for (i, c) in time.iter().enumerate() {
                    let want = match i {
                        4 | 7 => Some(b'-'),
                        10 => Some(b'T'),
                        13 | 16 => Some(b':'),
                        19 => Some(b'Z'),
                        _ => None,
                    };
                    match want {
                        Some(w) => assert_eq!(*c, w, "{}", get("test_time")),
                        None => assert!(c.is_ascii_digit(), "{}", get("test_time")),
                    }
                }
                let got_spec = r.0.iter().find(|(k, _)| k == "spec").map(|(_, v)| v);
                match spec {
                    Some(s) => assert!(
                        got_spec
                            .and_then(Json::as_str)
                            .is_some_and(|g| g.starts_with(s)),
                        "{args:?}: {got_spec:?}"
                    ),
                    None => assert!(got_spec.is_none(), "{args:?}"),
                }
            }
        }
    }
    let bad = |extra: &[&str], needle: &str| {
        let mut args = vec![
            "bench", "-m", &t, "-p", "8", "-n", "0", "-r", "1", "-t", "1",
        ];
        args.extend(extra);
        let out = specula(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(err.contains(needle), "expected `{needle}` in: {err}");
        assert!(!err.contains("panicked"), "{err}");
    };
    bad(&["--dflash"], "--dflash needs a draft model (-md FILE)");
    bad(&["-md", &t, "--dflash"], "as a DFlash drafter");
    bad(&["-md", &t], "attaches DFlash or EAGLE-3 drafters");
}

/// `specula bench --parallel 1,3` runs each test with one sequence and with three stepped
/// as one batch (`n_parallel` in its records, the tokens of all three counted), and refuses
/// zero sequences and a drafter.
#[test]
fn bench_parallel_runs_sequences_together() {
    let dir = tempfile::tempdir().unwrap();
    let (t, d) = files(dir.path());
    let args = [
        "bench",
        "-m",
        &t,
        "-p",
        "8",
        "-n",
        "4",
        "-d",
        "0,5",
        "-r",
        "2",
        "-t",
        "1",
        "--parallel",
        "1,3",
        "-o",
        "jsonl",
    ];
    let out = specula(&args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let text = String::from_utf8(out.stdout).unwrap();
    let records: Vec<Json> = text
        .lines()
        .map(|l| serde_json::from_str(l).expect("one object per line"))
        .collect();
    let got: Vec<(u64, u64, u64, u64)> = records
        .iter()
        .map(|r| {
            let n = |k: &str| r[k].as_u64().unwrap();
            (n("n_depth"), n("n_parallel"), n("n_prompt"), n("n_gen"))
        })
        .collect();
    let want: Vec<(u64, u64, u64, u64)> = [0, 5]
        .iter()
        .flat_map(|&d| {
            [1, 3]
                .iter()
                .flat_map(move |&p| [(d, p, 8, 0), (d, p, 0, 4)])
        })
        .collect();
    assert_eq!(got, want, "{text}");
    for r in &records {
        // t/s counts every sequence's tokens: samples_ts = tokens · n_parallel / seconds.
        let tokens = r["n_prompt"].as_f64().unwrap() + r["n_gen"].as_f64().unwrap();
        let par = r["n_parallel"].as_f64().unwrap();
        for (ns, ts) in r["samples_ns"]
            .as_array()
            .unwrap()
            .iter()
            .zip(r["samples_ts"].as_array().unwrap())
        {
            let want = tokens * par * 1e9 / ns.as_f64().unwrap();
            assert!((ts.as_f64().unwrap() - want).abs() <= 1e-6 * want, "{r}");
        }
    }
    let md = specula(&[
        "bench",
        "-m",
        &t,
        "-p",
        "8",
        "-n",
        "0",
        "-r",
        "1",
        "-t",
        "1",
        "--parallel",
        "2",
    ]);
    assert!(String::from_utf8_lossy(&md.stdout).contains("| pp8 ×2 |"));
    for (extra, needle) in [
        (vec!["--parallel", "0"], "--parallel must be positive"),
        (
            vec!["--parallel", "2", "-md", &d, "--dflash"],
            "--parallel is not supported with -md",
        ),
    ] {
        let mut args = vec![
            "bench", "-m", &t, "-p", "8", "-n", "0", "-r", "1", "-t", "1",
        ];
        args.extend(extra);
        let out = specula(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(err.contains(needle), "expected `{needle}` in: {err}");
    }
}

/// A draft model's error from below the engine reaches the user with every layer of its
/// chain: the draft's own K cache (`-ctkd q4_0`) cannot hold the model's 16-value heads; `run`
/// names the draft model, `serve` the slot, and both the cache's own error.
#[test]
fn draft_model_errors_print_their_whole_chain() {
    let dir = tempfile::tempdir().unwrap();
    let (t, _) = files(dir.path());
    let kv = "K cache type q4_0 cannot store heads of 16 values: it needs a head dim that is a multiple of 32 (use f16, or a turbo type, which pads)";
    let draft = ["-md", &t, "--spec-type", "draft-simple", "-ctkd", "q4_0"];
    for (args, want) in [
        (
            vec!["run", "-m", &t, "-p", "hi", "-n", "2"],
            format!("error: cannot use {t} (Qwen3) as the draft model: {kv}"),
        ),
        (
            vec!["serve", "-m", &t, "--port", "0"],
            format!("error: cannot make the drafter of slot 0: {kv}"),
        ),
    ] {
        let mut args = args.clone();
        args.extend(draft);
        let out = specula(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{err}");
        assert_eq!(err.lines().last(), Some(want.as_str()), "{err}");
    }
}
