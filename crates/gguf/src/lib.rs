//! GGUF files: a validating reader over a memory map and an atomic writer.
//!
//! GGUF is llama.cpp's model container: a header of typed key/value metadata and tensor infos
//! (name, ggml type, shape, data offset), then an aligned data section. This crate reads
//! versions 2 and 3 (little-endian) and writes version 3 exactly as gguf-py lays it out.
//!
//! - [`Gguf`] — an open file: [`Gguf::open`] maps it and validates the whole header; tensor
//!   bytes are borrowed from the map with [`Gguf::tensor_data`].
//! - [`Header`] — the parsed header ([`Metadata`], [`TensorInfo`]s, alignment, data offset);
//!   [`Header::parse`] works on any byte slice (the fuzz target calls it).
//! - [`Value`] / [`Array`] — typed metadata values, nested arrays included.
//! - [`GgmlType`] — tensor element types with their block geometry (ids 0–41, incl. MXFP4 = 39
//!   and NVFP4 = 40).
//! - [`GgufWriter`] — builds a file; [`GgufWriter::write_file`] writes to a temporary file,
//!   fsyncs and renames, so a failed write never leaves a half-written model behind.
//! - [`GgufError`] — every malformation has its own variant naming the offset, key or tensor.
//!
//! Format reference: `ggml/include/gguf.h` and gguf-py's `gguf_writer.py` / `gguf_reader.py`.
//!
//! ```
//! use specula_gguf::{GgmlType, Gguf, GgufWriter, Value};
//!
//! let mut w = GgufWriter::new();
//! w.add("general.architecture", Value::String("llama".into()))?;
//! w.add_tensor("token_embd.weight", GgmlType::F32, &[4, 2])?;
//! let bytes = w.to_vec(&[&[0u8; 32]])?;
//!
//! let file = Gguf::from_bytes(bytes)?;
//! assert_eq!(file.header().architecture(), Some("llama"));
//! assert_eq!(file.tensors()[0].dims, vec![4, 2]);
//! assert_eq!(file.tensor_data(0).len(), 32);
//! # Ok::<(), specula_gguf::GgufError>(())
//! ```

mod error;
mod ftype;
mod reader;
mod types;
mod value;
mod writer;

pub use error::{GgufError, Result};
pub use ftype::ftype_name;
pub use reader::{
    ALIGNMENT_KEY, DEFAULT_ALIGNMENT, Gguf, Header, MAGIC, MAX_ARRAY_DEPTH, MAX_DIMS, Metadata,
    TensorInfo,
};
pub use types::GgmlType;
pub use value::{Array, Value, ValueType};
pub use writer::{GgufWriter, TensorSpec};
