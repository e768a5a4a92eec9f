//! llama-server's slot actions, `POST /slots/{id}?action=save|restore|erase`, on SmolLM2-135M
//! (Q4_1) when it has been fetched (skips with a note otherwise), and on the tiny random llama
//! for the checks that need no real model:
//! - save after a completion, erase, restore: a `/completion` that follows reuses the restored
//!   prefix (`timings.cache_n`, only the rest evaluated, `prompt_n`) and gives the greedy tokens
//!   of a cold run; a second server (another process's worth of state) restores the file too;
//! - the answers' keys and values as llama-server's fixtures (golden/llama_server_endpoints/),
//!   but for the byte counts `n_written` / `n_read` (the size of a file in our format, not
//!   llama.cpp's state format) and `timings` (speeds);
//! - without `--slot-save-path` llama-server's 501; a bad slot id, action or filename its 400s
//!   (an id past the slots wraps around, as llama-server's `get_slot_by_id`); a corrupt,
//!   truncated, foreign or other-version file a precise 400, and the slot left empty; a save
//!   never leaves a half-written file.
//!
//! Deliberate differences: `n_written` / `n_read` are the size of our file format (llama.cpp
//! writes its own state format: 784672 bytes for the fixture's 34 tokens); `timings` are
//! speeds; a missing `filename` is a 400 naming it (llama-server: a 500 from its JSON
//! library); a failed restore says why (llama-server: "No available space in KV cache or
//! invalid slot save file" whatever the cause), with llama-server's prefix and type.

mod common;

use std::path::{Path, PathBuf};

use common::{Draft, post, server};
use serde_json::{Value, json};
use specula_server::{ServerConfig, ServerHandle};

/// A fresh directory under the system's temporary one, removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> Self {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let p = std::env::temp_dir().join(format!("specula-slots-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        Self(p)
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn golden(name: &str) -> Value {
    common::golden("llama_server_endpoints", name)
}

fn smollm(dir: &Path) -> Option<ServerHandle> {
    let cfg = ServerConfig {
        n_parallel: 2,
        n_ctx: 4096,
        slot_save_path: Some(dir.to_path_buf()),
        ..ServerConfig::default()
    };
    common::real("smollm2-135m", cfg, None)
}

const TEXT: &str =
    "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is";

fn greedy(prompt: &str, n: u64) -> Value {
    json!({"prompt": prompt, "n_predict": n, "temperature": 0, "return_tokens": true, "cache_prompt": true, "id_slot": 0})
}

fn action(s: &ServerHandle, id: &str, what: &str, filename: Option<&str>) -> (u16, Value) {
    let body = filename.map_or(json!({}), |f| json!({"filename": f}));
    let r = post(s.addr(), &format!("/slots/{id}?action={what}"), &body);
    (r.status, r.json())
}

/// A restore of `file` into slot 0 of `s` is refused (400) with a message naming each of
/// `wants`.
fn restore_refused(s: &ServerHandle, file: &str, wants: &[&str]) {
    let (status, v) = action(s, "0", "restore", Some(file));
    assert_eq!(status, 400, "{v}");
    let msg = v["error"]["message"].as_str().unwrap();
    for want in wants {
        assert!(msg.contains(want), "{want:?} not in {v}");
    }
}

/// The keys of `ours` are llama-server's (`theirs`), and so are the values but for those
/// named in `differ`.
fn same_shape(what: &str, ours: &Value, theirs: &Value, differ: &[&str]) {
    let (o, t) = (ours.as_object().unwrap(), theirs.as_object().unwrap());
    let mut ko: Vec<_> = o.keys().collect();
    let mut kt: Vec<_> = t.keys().collect();
    ko.sort();
    kt.sort();
    assert_eq!(ko, kt, "{what}: keys");
    for (k, v) in o {
        if differ.contains(&k.as_str()) {
            assert_eq!(
                std::mem::discriminant(v),
                std::mem::discriminant(&t[k]),
                "{what}.{k}: {v} vs {}",
                t[k]
            );
        } else {
            assert_eq!(v, &t[k], "{what}.{k}");
        }
    }
}

#[test]
fn smollm2_save_erase_restore_reuses_the_prefix_and_keeps_greedy_tokens() {
    let dir = TempDir::new();
    let Some(s) = smollm(dir.path()) else { return };
    // Cold: what the prompt gives with nothing cached.
    let cold = post(s.addr(), "/completion", &greedy(TEXT, 16)).json();
    assert_eq!(cold["timings"]["cache_n"], 0, "{cold}");
    let n_prompt = cold["tokens_evaluated"].as_u64().unwrap();
    let n_cached = n_prompt + 16 - 1;

    let (status, saved) = action(&s, "0", "save", Some("slot0.bin"));
    assert_eq!(status, 200, "{saved}");
    same_shape(
        "save",
        &saved,
        &golden("slot_save")["response"],
        &["n_saved", "n_written", "timings"],
    );
    // llama-server saved its slot after the same completion on the same model: its token
    // count is the fixture's (prompt + generated − the last token, never decoded).
    assert_eq!(saved["n_saved"], n_cached, "{saved}");
    assert_eq!(saved["n_saved"], golden("slot_save")["response"]["n_saved"]);
    let file = dir.path().join("slot0.bin");
    assert_eq!(
        std::fs::metadata(&file).unwrap().len(),
        saved["n_written"].as_u64().unwrap()
    );
    assert!(saved["timings"]["save_ms"].as_f64().unwrap() >= 0.0);

    let (status, erased) = action(&s, "0", "erase", None);
    assert_eq!(status, 200, "{erased}");
    same_shape("erase", &erased, &golden("slot_erase")["response"], &[]);
    // Erased: the same prompt runs cold again.
    let after_erase = post(s.addr(), "/completion", &greedy(TEXT, 16)).json();
    assert_eq!(after_erase["timings"]["cache_n"], 0, "{after_erase}");
    action(&s, "0", "erase", None);

    let (status, restored) = action(&s, "0", "restore", Some("slot0.bin"));
    assert_eq!(status, 200, "{restored}");
    same_shape(
        "restore",
        &restored,
        &golden("slot_restore")["response"],
        &["n_read", "timings"],
    );
    assert_eq!(restored["n_read"], saved["n_written"]);
    // The restored prefix is reused: all but the anchor token of the prompt comes from the
    // file, and the greedy tokens are the cold run's.
    let warm = post(s.addr(), "/completion", &greedy(TEXT, 16)).json();
    assert_eq!(warm["timings"]["cache_n"], n_prompt - 1, "{warm}");
    assert_eq!(warm["timings"]["prompt_n"], 1, "{warm}");
    // llama-server reuses the restored prefix alike, and its cold and restored runs give the
    // tokens ours give.
    let (g_cold, g_warm) = (
        golden("slot_completion")["response"].clone(),
        golden("slot_restored_completion")["response"].clone(),
    );
    for k in ["cache_n", "prompt_n"] {
        assert_eq!(warm["timings"][k], g_warm["timings"][k], "timings.{k}");
        assert_eq!(cold["timings"][k], g_cold["timings"][k], "timings.{k}");
    }
    assert_eq!(cold["tokens_evaluated"], g_cold["tokens_evaluated"]);
    assert_eq!(cold["tokens"], g_cold["tokens"]);
    assert_eq!(warm["tokens"], g_warm["tokens"]);
    let (status, v) = action(&s, "1", "restore", Some("missing.bin"));
    assert_eq!(status, golden("slot_restore_missing")["status"], "{v}");
    assert_eq!(v["error"]["type"], "invalid_request_error");
    assert_eq!(warm["tokens"], cold["tokens"]);
    assert_eq!(warm["content"], cold["content"]);

    // Into the other slot, and a longer prompt that continues the saved one.
    let (status, r) = action(&s, "1", "restore", Some("slot0.bin"));
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["id_slot"], 1);
    let longer = format!("{TEXT}{}", cold["content"].as_str().unwrap());
    let mut body = greedy(&longer, 8);
    body["id_slot"] = json!(1);
    let cont = post(s.addr(), "/completion", &body).json();
    assert!(
        cont["timings"]["cache_n"].as_u64().unwrap() >= n_prompt,
        "{cont}"
    );
    drop(s);

    // A fresh server (its own slots, nothing cached) reads the file and answers as cold.
    let s2 = smollm(dir.path()).unwrap();
    let (status, _) = action(&s2, "0", "restore", Some("slot0.bin"));
    assert_eq!(status, 200);
    let warm2 = post(s2.addr(), "/completion", &greedy(TEXT, 16)).json();
    assert_eq!(warm2["timings"]["cache_n"], n_prompt - 1, "{warm2}");
    assert_eq!(warm2["tokens"], cold["tokens"]);
}

fn tiny(dir: Option<&Path>) -> ServerHandle {
    server(
        ServerConfig {
            n_parallel: 2,
            n_ctx: 512,
            slot_save_path: dir.map(Path::to_path_buf),
            ..ServerConfig::default()
        },
        Draft::None,
    )
}

fn tiny_completion(s: &ServerHandle, slot: u64) -> Value {
    let body = json!({"prompt": "Once upon a time there was", "n_predict": 8, "temperature": 0,
        "ignore_eos": true, "return_tokens": true, "id_slot": slot});
    let r = post(s.addr(), "/completion", &body);
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()
}

#[test]
fn without_slot_save_path_actions_answer_llama_servers_501() {
    let s = tiny(None);
    let (status, v) = action(&s, "0", "save", Some("x.bin"));
    assert_eq!(status, 501);
    let g = golden("slot_disabled");
    assert_eq!(status, g["status"]);
    assert_eq!(v, g["response"]);
}

#[test]
fn bad_ids_actions_and_filenames_are_llama_servers_400s() {
    let dir = TempDir::new();
    let s = tiny(Some(dir.path()));
    for (name, id, what, file) in [
        ("slot_bad_filename", "0", "save", Some("../escape.bin")),
        ("slot_bad_action", "0", "explode", None),
        ("slot_bad_id_text", "abc", "erase", None),
    ] {
        let (status, v) = action(&s, id, what, file);
        let g = golden(name);
        assert_eq!(status, g["status"], "{name}: {v}");
        assert_eq!(v["error"]["type"], g["response"]["error"]["type"], "{name}");
        assert_eq!(
            v["error"]["message"], g["response"]["error"]["message"],
            "{name}"
        );
    }
    // An id past the slots wraps around, as llama-server's `get_slot_by_id` (99 of 2 slots:
    // slot 1), and the answer names the id as asked; a negative one is refused.
    let (status, v) = action(&s, "99", "erase", None);
    let g = golden("slot_bad_id");
    assert_eq!(status, g["status"], "{v}");
    assert_eq!(v, g["response"]);
    let (status, v) = action(&s, "-1", "erase", None);
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["message"], "Invalid slot ID");
    for bad in ["a/b.bin", "..", "x.", " x", "c:d", "nul\u{1}"] {
        let (status, v) = action(&s, "0", "save", Some(bad));
        assert_eq!(status, 400, "{bad:?}: {v}");
        assert_eq!(v["error"]["message"], "Invalid filename");
    }
    assert!(
        std::fs::read_dir(dir.path()).unwrap().next().is_none(),
        "nothing written"
    );
    assert!(!dir.path().parent().unwrap().join("escape.bin").exists());
    // No filename at all: a 400 naming the field.
    let r = post(s.addr(), "/slots/0?action=save", &json!({}));
    assert_eq!(r.status, 400);
    assert!(r.text().contains("filename"), "{}", r.text());
}

#[test]
fn bad_files_are_precise_400s_and_leave_the_slot_empty() {
    let dir = TempDir::new();
    let s = tiny(Some(dir.path()));
    let cold = tiny_completion(&s, 0);
    let (status, saved) = action(&s, "0", "save", Some("good.bin"));
    assert_eq!(status, 200, "{saved}");
    let good = std::fs::read(dir.path().join("good.bin")).unwrap();
    assert_eq!(good.len() as u64, saved["n_written"].as_u64().unwrap());
    assert_eq!(&good[..8], b"SPECSLOT");
    // No temporary file is left beside it.
    let names: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, ["good.bin"]);

    let mut truncated = good.clone();
    truncated.truncate(good.len() / 2);
    let mut flipped = good.clone();
    let mid = good.len() * 3 / 4;
    flipped[mid] ^= 0x40;
    let mut version = good.clone();
    version[8] = 9;
    let mut foreign = good.clone();
    foreign[12] ^= 1;
    let cases: [(&str, Vec<u8>, &str); 6] = [
        ("truncated.bin", truncated, "truncated"),
        ("flipped.bin", flipped, "checksum"),
        ("version.bin", version, "version 9"),
        (
            "magic.bin",
            b"GGUF and then some bytes".to_vec(),
            "not a specula slot file",
        ),
        ("empty.bin", Vec::new(), "not a specula slot file"),
        ("foreign.bin", foreign, "checksum"),
    ];
    for (name, bytes, why) in cases {
        std::fs::write(dir.path().join(name), bytes).unwrap();
        // Something cached in slot 0 first: a failed restore empties it, as llama-server.
        tiny_completion(&s, 0);
        let (status, v) = action(&s, "0", "restore", Some(name));
        assert_eq!(status, 400, "{name}: {v}");
        assert_eq!(v["error"]["type"], "invalid_request_error", "{name}");
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(msg.starts_with("Unable to restore slot: "), "{name}: {msg}");
        assert!(msg.contains(why), "{name}: {msg}");
        let again = tiny_completion(&s, 0);
        assert_eq!(again["timings"]["cache_n"], 0, "{name}: the slot is empty");
        assert_eq!(again["tokens"], cold["tokens"], "{name}");
    }
    restore_refused(&s, "missing.bin", &["missing.bin"]);

    // Another model (the tiny llama of another seed with a renamed token: the same shapes)
    // refuses the file by its fingerprint, its checksum being valid.
    let other = common::server_on(
        common::tiny(7, 1, true),
        ServerConfig {
            n_ctx: 512,
            slot_save_path: Some(dir.path().to_path_buf()),
            ..ServerConfig::default()
        },
        Draft::None,
        512,
    );
    restore_refused(&other, "good.bin", &["another model"]);

    // The good file still restores, and the slot then reuses it.
    let (status, _) = action(&s, "0", "restore", Some("good.bin"));
    assert_eq!(status, 200);
    let warm = tiny_completion(&s, 0);
    assert!(warm["timings"]["cache_n"].as_u64().unwrap() > 0, "{warm}");
    assert_eq!(warm["tokens"], cold["tokens"]);
}

#[test]
fn an_action_on_a_busy_slot_waits_for_it() {
    let dir = TempDir::new();
    let s = tiny(Some(dir.path()));
    let addr = s.addr();
    std::thread::scope(|sc| {
        let long = sc.spawn(move || {
            let body = json!({"prompt": "Once upon a time", "n_predict": 200, "temperature": 0,
                "ignore_eos": true, "id_slot": 0});
            post(addr, "/completion", &body).json()
        });
        // Wait until slot 0 is generating, then erase it: the erase answers after the request.
        for _ in 0..500 {
            let slots = common::get(addr, "/slots").json();
            if slots[0]["is_processing"] == true {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        let (status, v) = action(&s, "0", "erase", None);
        assert_eq!(status, 200, "{v}");
        let done = long.join().unwrap();
        assert_eq!(done["tokens_predicted"], 200, "{done}");
        // The whole request's tokens were in the slot when it was erased.
        assert_eq!(
            v["n_erased"].as_u64().unwrap(),
            done["tokens_evaluated"].as_u64().unwrap() + 200 - 1,
            "{v}"
        );
    });
}

/// Gemma-3 270m with forwards of 16 rows: its sliding-window layers keep a ring of 528 cells
/// that a 650-token prompt wraps. The ring's bookkeeping travels in the file: a second server
/// restores it and continues the saved history from its cache (`cache_n` = the saved tokens)
/// with the greedy tokens of the server that saved it.
#[test]
fn gemma3_a_wrapped_ring_restores_into_a_fresh_server() {
    fn gemma(dir: &Path) -> Option<ServerHandle> {
        let path = specula_testkit::real_model("gemma3-270m")?;
        let cfg = ServerConfig {
            n_parallel: 1,
            n_ctx: 1024,
            slot_save_path: Some(dir.to_path_buf()),
            ..ServerConfig::default()
        };
        Some(common::real_server_tuned(&path, cfg, None, |engine| {
            engine.n_batch = 16;
            assert_eq!(engine.swa_ring(), Some(528));
        }))
    }
    let dir = TempDir::new();
    let Some(a) = gemma(dir.path()) else { return };
    let prompt: String = (0..45)
        .map(|i| format!("row {i}: acc = acc * 3 + data[{}]\n", i % 5))
        .collect();
    let body = |p: Value, n: u64| json!({"prompt": p, "n_predict": n, "temperature": 0, "return_tokens": true, "ignore_eos": true});
    let cold = post(a.addr(), "/completion", &body(json!(prompt), 12)).json();
    let n_prompt = cold["tokens_evaluated"].as_u64().unwrap();
    assert!(n_prompt > 600, "{cold}");
    let (status, saved) = action(&a, "0", "save", Some("ring.bin"));
    assert_eq!(status, 200, "{saved}");
    assert_eq!(saved["n_saved"], n_prompt + 11);
    // The saved history continued: the prompt's ids and all 12 generated tokens.
    let r = post(
        a.addr(),
        "/tokenize",
        &json!({"content": prompt, "add_special": true}),
    );
    let mut ids: Vec<Value> = r.json()["tokens"].as_array().unwrap().clone();
    ids.extend(cold["tokens"].as_array().unwrap().iter().cloned());
    let cont_a = post(a.addr(), "/completion", &body(json!(ids), 8)).json();
    assert_eq!(cont_a["timings"]["cache_n"], n_prompt + 11, "{cont_a}");
    drop(a);

    let b = gemma(dir.path()).unwrap();
    let (status, restored) = action(&b, "0", "restore", Some("ring.bin"));
    assert_eq!(status, 200, "{restored}");
    let cont_b = post(b.addr(), "/completion", &body(json!(ids), 8)).json();
    assert_eq!(cont_b["timings"]["cache_n"], n_prompt + 11, "{cont_b}");
    assert_eq!(cont_b["tokens"], cont_a["tokens"]);
    // And cold, after an erase: the same tokens with nothing reused.
    action(&b, "0", "erase", None);
    let cont_cold = post(b.addr(), "/completion", &body(json!(ids), 8)).json();
    assert_eq!(cont_cold["timings"]["cache_n"], 0, "{cont_cold}");
    assert_eq!(cont_cold["tokens"], cont_a["tokens"]);
}

/// A file saved with one cache format does not load into a slot of another (`-ctk q8_0` vs
/// f16): the session state's layout signature names both; the slot is left empty. Nor into a
/// quantized cache calibrated with other offsets.
#[test]
fn another_cache_format_is_refused_by_its_layout() {
    let dir = TempDir::new();
    let bytes = common::tiny_heads(3, 1, false, 32);
    let cfg = |k_type| ServerConfig {
        n_ctx: 512,
        k_type,
        slot_save_path: Some(dir.path().to_path_buf()),
        ..ServerConfig::default()
    };
    let f16 = common::server_on(
        bytes.clone(),
        cfg(specula_quant::QType::F16),
        Draft::None,
        512,
    );
    let cold = tiny_completion(&f16, 0);
    let (status, v) = action(&f16, "0", "save", Some("f16.bin"));
    assert_eq!(status, 200, "{v}");
    let q8 = common::server_on(bytes, cfg(specula_quant::QType::Q8_0), Draft::None, 512);
    restore_refused(&q8, "f16.bin", &["another layout", "q8_0"]);
    // The same file restores into the f16 server, and a q8_0 file into the q8_0 one.
    let (status, _) = action(&f16, "0", "restore", Some("f16.bin"));
    assert_eq!(status, 200);
    let warm = tiny_completion(&f16, 0);
    assert!(warm["timings"]["cache_n"].as_u64().unwrap() > 0, "{warm}");
    assert_eq!(warm["tokens"], cold["tokens"]);
    let q8_cold = tiny_completion(&q8, 0);
    // A q8_0 cache of a 64-position context is calibrated on fewer tokens
    // (`KV_CALIBRATION_TOKENS` is 128): its offsets differ, and the file is refused rather
    // than mixing two calibrations in one slot.
    assert_eq!(action(&q8, "0", "save", Some("q8-512.bin")).0, 200);
    let small = common::server_on(
        common::tiny_heads(3, 1, false, 32),
        ServerConfig {
            n_ctx: 64,
            ..cfg(specula_quant::QType::Q8_0)
        },
        Draft::None,
        512,
    );
    restore_refused(&small, "q8-512.bin", &["another offset"]);
    assert_eq!(action(&q8, "0", "save", Some("q8.bin")).0, 200);
    action(&q8, "0", "erase", None);
    assert_eq!(action(&q8, "0", "restore", Some("q8.bin")).0, 200);
    let q8_warm = tiny_completion(&q8, 0);
    assert!(
        q8_warm["timings"]["cache_n"].as_u64().unwrap() > 0,
        "{q8_warm}"
    );
    assert_eq!(q8_warm["tokens"], q8_cold["tokens"]);
}
