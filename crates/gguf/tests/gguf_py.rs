//! specula-gguf against gguf-py 0.19.0, the independent GGUF implementation.
//!
//! `reference/gguf_golden.py` wrote `golden/gguf/*.gguf` with gguf-py's `GGUFWriter` and
//! described each file (and each real model it found) as gguf-py's `GGUFReader` reads it in
//! `golden/gguf/*.json`. These tests check that our reader sees the same metadata (types,
//! values, array contents by hash), the same tensors (type, dims, offset, size, data hash) and
//! that our writer reproduces gguf-py's bytes exactly. Real-model goldens are checked when the
//! model has been fetched (`cargo xtask fetch-models`), and skipped with a message otherwise.

use std::path::{Path, PathBuf};

use serde_json::Value as Json;
use sha2::{Digest, Sha256};
use specula_gguf::{Array, GgmlType, Gguf, GgufWriter, Value};

fn golden_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../golden/gguf")
}

/// Where `cargo xtask fetch-models` caches models (same rule as `specula-fetch`).
fn model_cache() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("SPECULA_MODELS") {
        return Some(PathBuf::from(p));
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("specula/models"))
}

fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The canonical element encoding that `reference/gguf_golden.py` hashes.
fn canonical(a: &Array, out: &mut Vec<u8>) {
    macro_rules! le {
        ($v:expr) => {
            $v.iter()
                .for_each(|x| out.extend_from_slice(&x.to_le_bytes()))
        };
    }
    match a {
        Array::U8(v) => out.extend_from_slice(v),
        Array::I8(v) => le!(v),
        Array::U16(v) => le!(v),
        Array::I16(v) => le!(v),
        Array::U32(v) => le!(v),
        Array::I32(v) => le!(v),
        Array::F32(v) => le!(v),
        Array::U64(v) => le!(v),
        Array::I64(v) => le!(v),
        Array::F64(v) => le!(v),
        Array::Bool(v) => out.extend(v.iter().map(|&b| u8::from(b))),
        Array::String(v) => v.iter().for_each(|s| {
            out.extend_from_slice(&(s.len() as u64).to_le_bytes());
            out.extend_from_slice(s.as_bytes());
        }),
        Array::Array(v) => v.iter().for_each(|inner| {
            out.extend_from_slice(&inner.element_type().id().to_le_bytes());
            out.extend_from_slice(&(inner.len() as u64).to_le_bytes());
            canonical(inner, out);
        }),
    }
}

fn scalar_matches(v: &Value, j: &Json) -> bool {
    match v {
        Value::F32(x) => j.as_f64() == Some(f64::from(*x)),
        Value::F64(x) => j.as_f64() == Some(*x),
        Value::Bool(b) => j.as_bool() == Some(*b),
        Value::String(s) => j.as_str() == Some(s),
        Value::U64(x) => j.as_u64() == Some(*x),
        other => other.as_i64().is_some() && j.as_i64() == other.as_i64(),
    }
}

fn check_against_golden(g: &Gguf, golden: &Json, with_data: bool) {
    let file = golden["file"].as_str().unwrap();
    assert_eq!(g.len(), golden["file_size"].as_u64().unwrap(), "{file}");
    let h = g.header();
    assert_eq!(u64::from(h.version), golden["version"].as_u64().unwrap());
    assert_eq!(h.alignment, golden["alignment"].as_u64().unwrap());
    assert_eq!(h.data_offset, golden["data_offset"].as_u64().unwrap());

    let meta = golden["metadata"].as_array().unwrap();
    assert_eq!(g.metadata().len(), meta.len(), "{file}: number of keys");
    for ((key, value), j) in g.metadata().iter().zip(meta) {
        assert_eq!(key, j["key"].as_str().unwrap(), "{file}: key order");
        assert_eq!(
            value.value_type().name(),
            j["type"].as_str().unwrap(),
            "{key}"
        );
        match value {
            Value::Array(a) => {
                assert_eq!(a.element_type().name(), j["elem_type"].as_str().unwrap());
                assert_eq!(a.len() as u64, j["len"].as_u64().unwrap(), "{key}");
                let mut enc = Vec::new();
                canonical(a, &mut enc);
                assert_eq!(sha256_hex(&enc), j["sha256"].as_str().unwrap(), "{key}");
            }
            v => assert!(
                scalar_matches(v, &j["value"]),
                "{key}: {v:?} vs {}",
                j["value"]
            ),
        }
    }

    let tensors = golden["tensors"].as_array().unwrap();
    assert_eq!(
        g.tensors().len(),
        tensors.len(),
        "{file}: number of tensors"
    );
    for (i, (t, j)) in g.tensors().iter().zip(tensors).enumerate() {
        assert_eq!(t.name, j["name"].as_str().unwrap());
        assert_eq!(t.ty.name(), j["type"].as_str().unwrap(), "{}", t.name);
        let dims: Vec<u64> = j["dims"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_u64().unwrap())
            .collect();
        assert_eq!(t.dims, dims, "{}", t.name);
        assert_eq!(t.offset, j["offset"].as_u64().unwrap(), "{}", t.name);
        assert_eq!(t.n_bytes(), j["n_bytes"].as_u64().unwrap(), "{}", t.name);
        if with_data {
            assert_eq!(
                sha256_hex(g.tensor_data(i)),
                j["sha256"].as_str().unwrap(),
                "{}",
                t.name
            );
        }
    }
}

fn load_json(name: &str) -> Json {
    let p = golden_dir().join(name);
    serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap()
}

#[test]
fn synthetic_files_read_as_gguf_py_reads_them() {
    for name in ["synthetic", "synthetic-align64"] {
        let g = Gguf::open(golden_dir().join(format!("{name}.gguf"))).unwrap();
        check_against_golden(&g, &load_json(&format!("{name}.json")), true);
    }
}

/// Re-writing what we read with our writer must give gguf-py's bytes exactly.
#[test]
fn writer_reproduces_gguf_py_bytes() {
    for name in ["synthetic", "synthetic-align64"] {
        let path = golden_dir().join(format!("{name}.gguf"));
        let original = std::fs::read(&path).unwrap();
        let g = Gguf::open(&path).unwrap();
        let mut w = GgufWriter::new();
        for (k, v) in g.metadata().iter() {
            w.add(k, v.clone()).unwrap();
        }
        for t in g.tensors() {
            w.add_tensor(t.name.clone(), t.ty, &t.dims).unwrap();
        }
        let datas: Vec<&[u8]> = (0..g.tensors().len()).map(|i| g.tensor_data(i)).collect();
        let rewritten = w.to_vec(&datas).unwrap();
        assert!(rewritten == original, "{name}: rewritten bytes differ");

        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("copy.gguf");
        w.write_file(&out, |i, _, sink| sink.write_all(datas[i]))
            .unwrap();
        assert!(
            std::fs::read(&out).unwrap() == original,
            "{name}: write_file"
        );
    }
}

/// Our type table against gguf-py's `GGML_QUANT_SIZES`. The one known difference is Q8_1,
/// where gguf-py says 40 bytes and ggml's `block_q8_1` (two f16 + 32 i8) is 36.
#[test]
fn type_table_matches_gguf_py() {
    let types = load_json("ggml_types.json");
    let types = types.as_object().unwrap();
    assert_eq!(types.len(), GgmlType::ALL.len());
    for (name, j) in types {
        let id = u32::try_from(j["id"].as_u64().unwrap()).unwrap();
        let t = GgmlType::from_id(id).unwrap_or_else(|| panic!("{name} ({id}) unknown"));
        assert_eq!(t.name(), name);
        assert_eq!(t.block_size(), j["block"].as_u64().unwrap(), "{name}");
        let bytes = if t == GgmlType::Q8_1 {
            40
        } else {
            t.type_size()
        };
        assert_eq!(bytes, j["bytes"].as_u64().unwrap(), "{name}");
    }
}

/// Real models, when fetched: every key, array and tensor as gguf-py reads them.
#[test]
fn real_models_read_as_gguf_py_reads_them() {
    let cache = model_cache();
    let mut checked = 0;
    for entry in std::fs::read_dir(golden_dir()).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if !name.ends_with(".json") || name.starts_with("synthetic") || name == "ggml_types.json" {
            continue;
        }
        let golden = load_json(&name);
        let file = golden["file"].as_str().unwrap();
        let Some(model) = cache.as_ref().map(|c| c.join(file)).filter(|p| p.exists()) else {
            let _: Option<()> = specula_testkit::skip(&format!(
                "{file} is not in the model cache; `cargo xtask fetch-models` fetches it"
            ));
            continue;
        };
        let g = Gguf::open(&model).unwrap();
        check_against_golden(&g, &golden, false);
        checked += 1;
    }
    eprintln!("checked {checked} real model(s) against gguf-py");
}
