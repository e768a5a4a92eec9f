//! Fuzz target: `Header::parse` on arbitrary bytes must never panic, and whatever it accepts
//! must satisfy the invariants the rest of the engine relies on without re-checking them.
//!
//! Built and run on stable Rust by `cargo xtask fuzz --target gguf_header`.

#![no_main]

use libfuzzer_sys::fuzz_target;
use specula_gguf::{Gguf, Header, MAX_DIMS};

fuzz_target!(|data: &[u8]| {
    let Ok(header) = Header::parse(data) else {
        return;
    };
    let file_len = data.len() as u64;
    assert!(matches!(header.version, 2 | 3));
    assert!(header.alignment.is_power_of_two());
    assert_eq!(header.data_offset % header.alignment, 0);
    for (key, value) in header.metadata.iter() {
        std::hint::black_box((key.len(), value.value_type()));
    }
    for t in &header.tensors {
        assert!(
            t.dims.len() <= MAX_DIMS,
            "{}: {} dims",
            t.name,
            t.dims.len()
        );
        assert_eq!(t.offset % header.alignment, 0, "{} is misaligned", t.name);
        let n: u64 = t.dims.iter().product();
        assert_eq!(n, t.n_elements(), "{}: element count", t.name);
        assert_eq!(
            t.n_elements() / t.ty.block_size() * t.ty.type_size(),
            t.n_bytes(),
            "{}: byte size",
            t.name
        );
        let end = header.data_offset + t.offset + t.n_bytes();
        assert!(
            end <= file_len,
            "{}: data ends at {end} > {file_len}",
            t.name
        );
        let found = header.tensor(&t.name).map(|f| std::ptr::eq(f, t));
        assert_eq!(found, Some(true), "{}: lookup by name", t.name);
    }
    // The owning wrapper must accept the same bytes and slice every tensor without panicking.
    let file = Gguf::from_bytes(data.to_vec()).expect("Header::parse accepted these bytes");
    for (i, t) in file.tensors().iter().enumerate() {
        assert_eq!(file.tensor_data(i).len() as u64, t.n_bytes());
    }
});
