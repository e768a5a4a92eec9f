//! What the golden-file tests of this crate share: reading the JSON the `reference/` scripts
//! write, decoding its arrays, and the error measures.

#![allow(dead_code, reason = "each test crate uses the helpers it needs")]

use std::path::Path;

use serde_json::Value as Json;
use sha2::{Digest, Sha256};

/// `golden/<dir>/<name>.json`, written by `reference/<script>`.
pub fn golden(dir: &str, name: &str, script: &str) -> Json {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../golden")
        .join(dir)
        .join(format!("{name}.json"));
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (written by reference/{script})", path.display()));
    serde_json::from_str(&text).expect("valid JSON")
}

/// Standard base64 (with `=` padding).
pub fn base64_decode(s: &str) -> Vec<u8> {
    let sextet = |c: u8| -> u32 {
        match c {
            b'A'..=b'Z' => u32::from(c - b'A'),
            b'a'..=b'z' => u32::from(c - b'a') + 26,
            b'0'..=b'9' => u32::from(c - b'0') + 52,
            b'+' => 62,
            b'/' => 63,
            _ => panic!("not base64: {c:#04x}"),
        }
    };
    let s = s.as_bytes();
    assert_eq!(s.len() % 4, 0, "base64 length");
    let mut out = Vec::with_capacity(s.len() / 4 * 3);
    for chunk in s.chunks(4) {
        let pad = chunk.iter().rev().take_while(|&&c| c == b'=').count();
        let n = chunk[..4 - pad]
            .iter()
            .enumerate()
            .fold(0u32, |acc, (i, &c)| acc | (sextet(c) << (18 - 6 * i)));
        let bytes = n.to_be_bytes();
        out.extend_from_slice(&bytes[1..4 - pad]);
    }
    out
}

/// Little-endian f32 values.
pub fn f32_le(bytes: &[u8]) -> Vec<f32> {
    assert_eq!(bytes.len() % 4, 0);
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
        .collect()
}

/// A base64 string of little-endian f32 values.
pub fn f32_base64(v: &Json) -> Vec<f32> {
    f32_le(&base64_decode(v.as_str().expect("a base64 string")))
}

pub fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// `Σ(ours − hf)² / Σhf²`, in f64.
pub fn nmse(ours: &[f32], hf: &[f32]) -> f64 {
    assert_eq!(ours.len(), hf.len());
    let (num, den) = ours.iter().zip(hf).fold((0.0, 0.0), |(n, d), (&o, &h)| {
        let (o, h) = (f64::from(o), f64::from(h));
        (n + (o - h) * (o - h), d + h * h)
    });
    num / den
}

pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// The first index where `a` and `b` differ in bits.
pub fn first_difference(a: &[f32], b: &[f32]) -> Option<usize> {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .position(|(x, y)| x.to_bits() != y.to_bits())
}
