//! Every corruption class the reader must reject, each with the specific error it must give.
//! None of these may panic; the fuzz target (`fuzz/`) checks the same on random inputs.

mod common;

use common::{RawFile, str_bytes};
use specula_gguf::{GgmlType, Gguf, GgufError, GgufWriter, Header, MAX_ARRAY_DEPTH, Value};

const F32: u32 = 0;
const Q8_0: u32 = 8;

fn parse(f: &RawFile) -> Result<Header, GgufError> {
    Header::parse(&f.bytes())
}

/// A small valid file: two metadata entries and two F32 tensors of 16 and 8 bytes.
fn valid() -> RawFile {
    RawFile::default()
        .kv_str("general.architecture", "llama")
        .kv_u32("llama.block_count", 1)
        .tensor("a", &[4], F32, 0)
        .tensor("b", &[2], F32, 32)
        .data(64)
}

#[test]
fn the_valid_baseline_parses() {
    let h = parse(&valid()).unwrap();
    assert_eq!(h.tensors.len(), 2);
    assert_eq!(h.architecture(), Some("llama"));
}

#[test]
fn bad_magic() {
    let mut f = valid();
    f.magic = *b"GGML";
    match parse(&f) {
        Err(GgufError::BadMagic { found }) => assert_eq!(&found, b"GGML"),
        other => panic!("expected BadMagic, got {other:?}"),
    }
}

#[test]
fn unsupported_versions() {
    for version in [0, 1, 4, 0x0300_0000] {
        let mut f = valid();
        f.version = version;
        match parse(&f) {
            Err(e @ GgufError::UnsupportedVersion { version: v }) => {
                assert_eq!(v, version);
                let big_endian_hint = e.to_string().contains("big-endian");
                assert_eq!(big_endian_hint, version == 0x0300_0000, "{e}");
            }
            other => panic!("version {version}: expected UnsupportedVersion, got {other:?}"),
        }
    }
}

#[test]
fn version_2_reads_like_version_3() {
    let mut f = valid();
    f.version = 2;
    let h = parse(&f).unwrap();
    assert_eq!(h.version, 2);
    assert_eq!(h.tensors.len(), 2);
}

/// Cutting the file anywhere must give an error, never a panic: inside the header a
/// `Truncated` (or `ImplausibleCount` when a count no longer fits what is left), inside the
/// data section an `OutOfBounds` naming the tensor cut short.
#[test]
fn truncation_at_every_length() {
    let full = valid().bytes();
    let header_len = valid().header().len();
    // The last byte of tensor `b` (8 bytes at data offset 32); what follows is padding.
    let data_end = header_len.next_multiple_of(32) + 40;
    assert!(Header::parse(&full[..data_end]).is_ok());
    for len in 0..data_end {
        let err = Header::parse(&full[..len]).expect_err("a truncated file must not parse");
        if len < header_len {
            assert!(
                matches!(
                    err,
                    GgufError::Truncated { .. } | GgufError::ImplausibleCount { .. }
                ),
                "cut at {len}: {err:?}"
            );
        } else {
            assert!(
                matches!(err, GgufError::OutOfBounds { .. }),
                "cut at {len}: {err:?}"
            );
        }
    }
}

#[test]
fn truncated_value_names_the_key() {
    let f = RawFile::default().kv("general.x", 10, vec![1, 2, 3]);
    match Header::parse(&f.header()) {
        Err(GgufError::Truncated {
            what,
            offset,
            needed,
            available,
        }) => {
            assert!(what.contains("general.x"), "{what}");
            // 24-byte preamble, 8 + 9 bytes of key, 4 bytes of type tag.
            assert_eq!((offset, needed, available), (45, 8, 3));
        }
        other => panic!("expected Truncated, got {other:?}"),
    }
}

#[test]
fn string_length_past_end_of_file() {
    let mut v = (1u64 << 40).to_le_bytes().to_vec();
    v.extend_from_slice(b"abc");
    let f = RawFile::default().kv("general.name", 8, v);
    match parse(&f) {
        Err(GgufError::ImplausibleCount {
            count, unit, what, ..
        }) => {
            assert_eq!((count, unit), (1 << 40, "bytes"));
            assert!(what.contains("general.name"), "{what}");
        }
        other => panic!("expected ImplausibleCount, got {other:?}"),
    }
}

#[test]
fn absurd_array_counts_are_rejected_before_allocating() {
    for (elem, count) in [
        (8u32, u64::MAX),
        (4, u64::MAX / 2),
        (9, 1 << 60),
        (0, 1 << 50),
    ] {
        let mut v = elem.to_le_bytes().to_vec();
        v.extend_from_slice(&count.to_le_bytes());
        let f = RawFile::default().kv("tokenizer.ggml.tokens", 9, v);
        match parse(&f) {
            Err(GgufError::ImplausibleCount {
                count: c,
                unit: "elements",
                ..
            }) => assert_eq!(c, count),
            other => panic!("elem {elem}: expected ImplausibleCount, got {other:?}"),
        }
    }
}

#[test]
fn negative_and_absurd_header_counts() {
    let mut f = valid();
    f.n_tensors = Some(-1);
    assert!(matches!(
        parse(&f),
        Err(GgufError::NegativeCount {
            what: "tensor count",
            offset: 8,
            value: -1
        })
    ));
    let mut f = valid();
    f.n_kv = Some(i64::MAX);
    assert!(matches!(
        parse(&f),
        Err(GgufError::ImplausibleCount {
            unit: "metadata entries",
            offset: 16,
            ..
        })
    ));
}

#[test]
fn duplicate_keys() {
    let f = valid().kv_u32("llama.block_count", 2);
    match parse(&f) {
        Err(GgufError::DuplicateKey { key, offset, first }) => {
            assert_eq!(key, "llama.block_count");
            assert!(first < offset);
        }
        other => panic!("expected DuplicateKey, got {other:?}"),
    }
}

#[test]
fn duplicate_tensor_names() {
    let f = valid().tensor("a", &[4], F32, 64).data(96);
    match parse(&f) {
        Err(GgufError::DuplicateTensor {
            name,
            first,
            second,
            ..
        }) => assert_eq!((name.as_str(), first, second), ("a", 0, 2)),
        other => panic!("expected DuplicateTensor, got {other:?}"),
    }
}

#[test]
fn misaligned_tensor_offset() {
    let f = valid().tensor("c", &[1], F32, 70).data(128);
    match parse(&f) {
        Err(GgufError::Misaligned {
            tensor,
            offset,
            alignment,
        }) => assert_eq!((tensor.as_str(), offset, alignment), ("c", 70, 32)),
        other => panic!("expected Misaligned, got {other:?}"),
    }
}

#[test]
fn custom_alignment_is_honoured() {
    let f = RawFile {
        alignment: 64,
        ..RawFile::default()
    }
    .kv_u32("general.alignment", 64)
    .tensor("a", &[4], F32, 0)
    .tensor("b", &[4], F32, 32)
    .data(128);
    assert!(matches!(
        parse(&f),
        Err(GgufError::Misaligned { alignment: 64, .. })
    ));
    let f = RawFile {
        alignment: 64,
        ..RawFile::default()
    }
    .kv_u32("general.alignment", 64)
    .tensor("a", &[4], F32, 0)
    .tensor("b", &[4], F32, 64)
    .data(128);
    let h = parse(&f).unwrap();
    assert_eq!(h.alignment, 64);
    assert_eq!(h.data_offset % 64, 0);
}

#[test]
fn bad_alignment_values() {
    for (ty, value) in [
        (4u32, 0u32.to_le_bytes().to_vec()),
        (4, 48u32.to_le_bytes().to_vec()),
        (10, 32u64.to_le_bytes().to_vec()),
    ] {
        let f = RawFile::default().kv("general.alignment", ty, value);
        assert!(
            matches!(parse(&f), Err(GgufError::BadAlignment { .. })),
            "{:?}",
            parse(&f)
        );
    }
}

#[test]
fn overlapping_tensors() {
    let f = RawFile::default()
        .tensor("a", &[16], F32, 0)
        .tensor("b", &[4], F32, 32)
        .data(128);
    match parse(&f) {
        Err(GgufError::Overlap {
            first,
            second,
            first_end,
            second_start,
            ..
        }) => {
            assert_eq!((first.as_str(), second.as_str()), ("a", "b"));
            assert_eq!((first_end, second_start), (64, 32));
        }
        other => panic!("expected Overlap, got {other:?}"),
    }
}

#[test]
fn tensor_data_out_of_bounds() {
    let f = valid().tensor("c", &[8], F32, 64).data(64);
    match parse(&f) {
        Err(GgufError::OutOfBounds {
            tensor,
            start,
            end,
            file_len,
        }) => {
            assert_eq!(tensor, "c");
            assert_eq!(end - start, 32);
            assert!(end > file_len);
        }
        other => panic!("expected OutOfBounds, got {other:?}"),
    }
    // An offset so large that start + size overflows u64.
    let f = valid().tensor("c", &[8], F32, u64::MAX - 31).data(64);
    assert!(matches!(parse(&f), Err(GgufError::OutOfBounds { .. })));
}

#[test]
fn unknown_tensor_type_ids() {
    for id in [4u32, 31, 38, 42, 9999] {
        let f = valid().tensor("c", &[32], id, 64).data(256);
        match parse(&f) {
            Err(GgufError::UnknownTensorType {
                tensor, id: got, ..
            }) => {
                assert_eq!((tensor.as_str(), got), ("c", id));
            }
            other => panic!("id {id}: expected UnknownTensorType, got {other:?}"),
        }
    }
}

#[test]
fn mxfp4_and_nvfp4_tensor_types_are_known() {
    let f = RawFile::default()
        .tensor("m", &[32, 2], 39, 0)
        .tensor("n", &[64], 40, 64)
        .data(128);
    let h = parse(&f).unwrap();
    assert_eq!(h.tensors[0].ty, GgmlType::MXFP4);
    assert_eq!(h.tensors[0].n_bytes(), 34);
    assert_eq!(h.tensors[1].ty, GgmlType::NVFP4);
    assert_eq!(h.tensors[1].n_bytes(), 36);
}

#[test]
fn unknown_value_types() {
    let f = RawFile::default().kv("x.y", 13, vec![0; 8]);
    assert!(matches!(
        parse(&f),
        Err(GgufError::UnknownValueType { id: 13, ref key, .. }) if key == "x.y"
    ));
    let mut v = 77u32.to_le_bytes().to_vec();
    v.extend_from_slice(&1u64.to_le_bytes());
    let f = RawFile::default().kv("x.arr", 9, v);
    assert!(matches!(
        parse(&f),
        Err(GgufError::UnknownValueType { id: 77, .. })
    ));
}

#[test]
fn invalid_shapes() {
    let cases: [(&[i64], u32, &str); 5] = [
        (&[0, 4], F32, "zero"),
        (&[4, -2], F32, "negative"),
        (&[1 << 32, 1 << 32], F32, "overflows"),
        (&[i64::MAX, 1], Q8_0, "blocks"),
        (&[48], Q8_0, "blocks"),
    ];
    for (dims, ty, reason) in cases {
        let f = RawFile::default().tensor("w", dims, ty, 0).data(4096);
        match parse(&f) {
            Err(GgufError::BadShape {
                tensor, reason: r, ..
            }) => {
                assert_eq!(tensor, "w");
                assert!(r.contains(reason), "{dims:?}: {r}");
            }
            other => panic!("{dims:?}: expected BadShape, got {other:?}"),
        }
    }
    // The byte size (not the element count) overflowing.
    let f = RawFile::default()
        .tensor("w", &[1 << 31, 1 << 31], 28, 0)
        .data(64);
    assert!(matches!(parse(&f), Err(GgufError::BadShape { .. })));
}

#[test]
fn too_many_dims() {
    let f = RawFile::default()
        .tensor("w", &[1, 1, 1, 1, 1], F32, 0)
        .data(32);
    assert!(matches!(
        parse(&f),
        Err(GgufError::TooManyDims { n_dims: 5, .. })
    ));
}

#[test]
fn invalid_utf8_in_key_value_and_tensor_name() {
    let f = RawFile::default().kv("k", 8, str_bytes(&[0xff, 0xfe]));
    assert!(
        matches!(parse(&f), Err(GgufError::InvalidUtf8 { ref what, .. }) if what.contains("`k`"))
    );
    let mut f = RawFile::default();
    f.kvs.push((vec![0xc3], 4, 1u32.to_le_bytes().to_vec()));
    assert!(matches!(
        parse(&f),
        Err(GgufError::InvalidUtf8 { offset: 32, .. })
    ));
    let mut f = RawFile::default().data(32);
    f.tensors.push(common::RawTensor {
        name: vec![0x80],
        dims: vec![1],
        ty: F32,
        offset: 0,
    });
    assert!(
        matches!(parse(&f), Err(GgufError::InvalidUtf8 { ref what, .. }) if what.contains("tensor info #0"))
    );
}

#[test]
fn invalid_bool() {
    let f = RawFile::default().kv("b", 7, vec![2]);
    assert!(matches!(
        parse(&f),
        Err(GgufError::InvalidBool { byte: 2, .. })
    ));
}

#[test]
fn nesting_too_deep() {
    // MAX_ARRAY_DEPTH + 1 levels of single-element arrays around a u8.
    let mut v = Vec::new();
    for _ in 0..=MAX_ARRAY_DEPTH {
        v.extend_from_slice(&9u32.to_le_bytes());
        v.extend_from_slice(&1u64.to_le_bytes());
    }
    v.extend_from_slice(&0u32.to_le_bytes());
    v.extend_from_slice(&1u64.to_le_bytes());
    v.push(7);
    let f = RawFile::default().kv("deep", 9, v);
    assert!(matches!(
        parse(&f),
        Err(GgufError::NestingTooDeep {
            max: MAX_ARRAY_DEPTH,
            ..
        })
    ));
}

#[test]
fn open_reports_io_errors_with_the_path() {
    let missing = std::path::Path::new("/nonexistent/specula/model.gguf");
    match Gguf::open(missing) {
        Err(e @ GgufError::Io { .. }) => assert!(e.to_string().contains("model.gguf"), "{e}"),
        other => panic!("expected Io, got {other:?}"),
    }
}

#[test]
fn empty_file_is_truncated_not_a_panic() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("empty.gguf");
    std::fs::write(&p, b"").unwrap();
    assert!(matches!(
        Gguf::open(&p),
        Err(GgufError::Truncated { offset: 0, .. })
    ));
}

#[test]
fn writer_rejects_bad_input() {
    let mut w = GgufWriter::new();
    w.add("a", Value::U32(1)).unwrap();
    assert!(matches!(
        w.add("a", Value::U32(2)),
        Err(GgufError::DuplicateKey { .. })
    ));
    assert!(matches!(
        w.add("general.alignment", Value::U64(32)),
        Err(GgufError::BadAlignment { .. })
    ));
    w.add_tensor("t", GgmlType::Q4_K, &[256]).unwrap();
    assert!(matches!(
        w.add_tensor("t", GgmlType::F32, &[1]),
        Err(GgufError::DuplicateTensor { .. })
    ));
    assert!(matches!(
        w.add_tensor("u", GgmlType::Q4_K, &[100]),
        Err(GgufError::BadShape { .. })
    ));
    assert!(matches!(
        w.add_tensor("v", GgmlType::F32, &[1, 1, 1, 1, 1]),
        Err(GgufError::TooManyDims { .. })
    ));
    assert!(matches!(
        w.to_vec(&[&[0u8; 100]]),
        Err(GgufError::DataSize {
            expected: 144,
            got: 100,
            ..
        })
    ));
}

/// A failed write must leave neither the target file nor a temporary file behind, and must
/// not touch an existing file at the target path.
#[test]
fn failed_write_file_leaves_nothing_half_written() {
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("out.gguf");
    std::fs::write(&target, b"previous contents").unwrap();
    let mut w = GgufWriter::new();
    w.add_tensor("a", GgmlType::F32, &[4]).unwrap();
    w.add_tensor("b", GgmlType::F32, &[4]).unwrap();
    let err = w
        .write_file(&target, |i, _, sink| {
            if i == 0 {
                sink.write_all(&[0; 16])
            } else {
                Err(std::io::Error::other("quantizer failed"))
            }
        })
        .unwrap_err();
    // The message says what was done to which file; the callback's error is its source.
    assert!(err.to_string().contains("out.gguf"), "{err}");
    let cause = std::error::Error::source(&err).map(ToString::to_string);
    assert_eq!(cause.as_deref(), Some("quantizer failed"), "{err}");
    assert_eq!(std::fs::read(&target).unwrap(), b"previous contents");
    let leftovers: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(leftovers, vec![std::ffi::OsString::from("out.gguf")]);

    w.write_file(&target, |_, _, sink| sink.write_all(&[0; 16]))
        .unwrap();
    let g = Gguf::open(&target).unwrap();
    assert_eq!(g.tensors().len(), 2);
}

/// A written file gets the permissions `File::create` gives (0o666 less the umask), not the
/// temporary file's 0o600: a model quantized or a drafter trained by one account is read by
/// another (a server's).
#[cfg(unix)]
#[test]
fn written_files_are_readable_as_created_files_are() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let plain = dir.path().join("plain");
    std::fs::File::create(&plain).unwrap();
    let target = dir.path().join("out.gguf");
    let mut w = GgufWriter::new();
    w.add_tensor("a", GgmlType::F32, &[4]).unwrap();
    w.write_file(&target, |_, _, sink| sink.write_all(&[0; 16]))
        .unwrap();
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&target), mode(&plain));
}
