//! Property: any metadata and tensor set written by [`GgufWriter`] reads back identical,
//! as version 3 and, with the version field patched, as version 2.

use proptest::collection::vec;
use proptest::prelude::*;
use specula_gguf::{Array, GgmlType, Gguf, GgufWriter, Value};

fn finite_f32() -> impl Strategy<Value = f32> {
    prop_oneof![
        prop::num::f32::NORMAL,
        prop::num::f32::SUBNORMAL,
        prop::num::f32::ZERO,
        prop::num::f32::INFINITE,
    ]
}

fn finite_f64() -> impl Strategy<Value = f64> {
    prop_oneof![
        prop::num::f64::NORMAL,
        prop::num::f64::SUBNORMAL,
        prop::num::f64::ZERO,
        prop::num::f64::INFINITE,
    ]
}

fn leaf_array() -> impl Strategy<Value = Array> {
    prop_oneof![
        vec(any::<u8>(), 0..8).prop_map(Array::U8),
        vec(any::<i8>(), 0..8).prop_map(Array::I8),
        vec(any::<u16>(), 0..8).prop_map(Array::U16),
        vec(any::<i16>(), 0..8).prop_map(Array::I16),
        vec(any::<u32>(), 0..8).prop_map(Array::U32),
        vec(any::<i32>(), 0..8).prop_map(Array::I32),
        vec(finite_f32(), 0..8).prop_map(Array::F32),
        vec(any::<bool>(), 0..8).prop_map(Array::Bool),
        vec(".{0,12}", 0..6).prop_map(Array::String),
        vec(any::<u64>(), 0..8).prop_map(Array::U64),
        vec(any::<i64>(), 0..8).prop_map(Array::I64),
        vec(finite_f64(), 0..8).prop_map(Array::F64),
    ]
}

fn array() -> impl Strategy<Value = Array> {
    leaf_array().prop_recursive(3, 24, 4, |inner| vec(inner, 0..4).prop_map(Array::Array))
}

fn value() -> impl Strategy<Value = Value> {
    prop_oneof![
        any::<u8>().prop_map(Value::U8),
        any::<i8>().prop_map(Value::I8),
        any::<u16>().prop_map(Value::U16),
        any::<i16>().prop_map(Value::I16),
        any::<u32>().prop_map(Value::U32),
        any::<i32>().prop_map(Value::I32),
        finite_f32().prop_map(Value::F32),
        any::<bool>().prop_map(Value::Bool),
        ".{0,40}".prop_map(Value::String),
        array().prop_map(Value::Array),
        any::<u64>().prop_map(Value::U64),
        any::<i64>().prop_map(Value::I64),
        finite_f64().prop_map(Value::F64),
    ]
}

#[derive(Debug, Clone)]
struct Tensor {
    name: String,
    ty: GgmlType,
    dims: Vec<u64>,
    data: Vec<u8>,
}

fn tensor() -> impl Strategy<Value = Tensor> {
    (
        "[a-z]{1,6}(\\.[a-z0-9_]{1,8}){0,3}",
        prop::sample::select(GgmlType::ALL.to_vec()),
        1u64..4,
        vec(1u64..4, 0..3),
        any::<u64>(),
    )
        .prop_map(|(name, ty, blocks, rest, seed)| {
            let mut dims = vec![blocks * ty.block_size()];
            dims.extend(rest);
            let rows: u64 = dims[1..].iter().product();
            let n = ty.row_bytes(dims[0]).unwrap() * rows;
            // Deterministic pseudo-random bytes (splitmix64) so data mix-ups show.
            let mut s = seed;
            let data = (0..n)
                .map(|_| {
                    s = s.wrapping_add(0x9e37_79b9_7f4a_7c15);
                    let z = (s ^ (s >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
                    z.to_le_bytes()[7]
                })
                .collect();
            Tensor {
                name,
                ty,
                dims,
                data,
            }
        })
}

fn metadata() -> impl Strategy<Value = Vec<(String, Value)>> {
    vec(("[a-z]{1,8}(\\.[a-z_]{1,10}){0,2}", value()), 0..12).prop_map(|kvs| {
        let mut seen = std::collections::HashSet::new();
        kvs.into_iter()
            .filter(|(k, _)| k != "general.alignment" && seen.insert(k.clone()))
            .collect()
    })
}

fn tensors() -> impl Strategy<Value = Vec<Tensor>> {
    vec(tensor(), 0..6).prop_map(|ts| {
        let mut seen = std::collections::HashSet::new();
        ts.into_iter()
            .filter(|t| seen.insert(t.name.clone()))
            .collect()
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn written_then_read_is_identical(
        meta in metadata(),
        tensors in tensors(),
        alignment in prop::sample::select(vec![None, Some(1u32), Some(8), Some(64), Some(4096)]),
    ) {
        let mut w = GgufWriter::new();
        if let Some(a) = alignment {
            w.add("general.alignment", Value::U32(a)).unwrap();
        }
        for (k, v) in &meta {
            w.add(k.clone(), v.clone()).unwrap();
        }
        for t in &tensors {
            w.add_tensor(t.name.clone(), t.ty, &t.dims).unwrap();
        }
        let datas: Vec<&[u8]> = tensors.iter().map(|t| t.data.as_slice()).collect();
        let bytes = w.to_vec(&datas).unwrap();

        for version in [3u32, 2] {
            let mut bytes = bytes.clone();
            bytes[4..8].copy_from_slice(&version.to_le_bytes());
            let g = Gguf::from_bytes(bytes).unwrap();
            prop_assert_eq!(g.header().version, version);
            let read: Vec<(String, Value)> = g
                .metadata()
                .iter()
                .filter(|(k, _)| *k != "general.alignment")
                .map(|(k, v)| (k.to_owned(), v.clone()))
                .collect();
            prop_assert_eq!(&read, &meta);
            prop_assert_eq!(g.header().alignment, u64::from(alignment.unwrap_or(32)));
            prop_assert_eq!(g.tensors().len(), tensors.len());
            for (i, t) in tensors.iter().enumerate() {
                let info = &g.tensors()[i];
                prop_assert_eq!(&info.name, &t.name);
                prop_assert_eq!(info.ty, t.ty);
                prop_assert_eq!(&info.dims, &t.dims);
                prop_assert_eq!(g.tensor_data(i), t.data.as_slice());
                prop_assert_eq!(g.tensor_data_by_name(&t.name), Some(t.data.as_slice()));
            }
        }
    }

    /// Flipping, truncating or splicing bytes of a valid file never panics: the reader either
    /// parses a (different) valid file or returns an error.
    #[test]
    fn mutated_files_never_panic(
        meta in metadata(),
        tensors in tensors(),
        edits in vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
        cut in any::<prop::sample::Index>(),
    ) {
        let mut w = GgufWriter::new();
        for (k, v) in &meta {
            w.add(k.clone(), v.clone()).unwrap();
        }
        for t in &tensors {
            w.add_tensor(t.name.clone(), t.ty, &t.dims).unwrap();
        }
        let datas: Vec<&[u8]> = tensors.iter().map(|t| t.data.as_slice()).collect();
        let mut bytes = w.to_vec(&datas).unwrap();
        for (at, b) in edits {
            let i = at.index(bytes.len());
            bytes[i] = b;
        }
        let _ = specula_gguf::Header::parse(&bytes);
        let len = cut.index(bytes.len() + 1);
        let _ = specula_gguf::Header::parse(&bytes[..len]);
    }
}
