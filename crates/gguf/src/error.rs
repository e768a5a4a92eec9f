//! The one error type of this crate.

use std::io;
use std::path::PathBuf;

/// Everything that can be wrong with a GGUF file or a write request. Each variant names the
/// byte offset, metadata key or tensor concerned, so a user can find the fault with a hex dump.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GgufError {
    /// The file could not be opened, mapped, written or renamed.
    #[error("{action} {path}")]
    Io {
        /// What was being done (`open`, `map`, `write`, …).
        action: &'static str,
        /// The file concerned.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// The first four bytes are not `GGUF`.
    #[error("not a GGUF file: magic at offset 0 is {found:02x?}, expected 47 47 55 46 (\"GGUF\")")]
    BadMagic {
        /// The bytes found.
        found: [u8; 4],
    },
    /// A version other than 2 or 3 (version 1 used 32-bit lengths; big-endian files show a
    /// byte-swapped version).
    #[error("unsupported GGUF version {version} at offset 4: only versions 2 and 3 (little-endian) are read{}", if (2..=3).contains(&version.swap_bytes()) { " — this looks like a big-endian file" } else { "" })]
    UnsupportedVersion {
        /// The version field as read little-endian.
        version: u32,
    },
    /// The file ends inside a field.
    #[error(
        "truncated file: {what} at offset {offset} needs {needed} bytes but only {available} remain"
    )]
    Truncated {
        /// The field being read.
        what: String,
        /// Where the field starts.
        offset: u64,
        /// Bytes the field needs.
        needed: u64,
        /// Bytes left in the file from `offset`.
        available: u64,
    },
    /// A count or length that cannot possibly fit in the rest of the file (or exceeds a hard
    /// limit); rejected before any allocation is made for it.
    #[error(
        "{what} at offset {offset} declares {count} {unit}, which cannot fit in the {available} bytes left in the file"
    )]
    ImplausibleCount {
        /// The field being read.
        what: String,
        /// Where the count is stored.
        offset: u64,
        /// The declared count (as read; negative counts read as huge).
        count: u64,
        /// What is counted (`bytes`, `elements`, `tensors`, …).
        unit: &'static str,
        /// Bytes left in the file after the count.
        available: u64,
    },
    /// A signed count field (`n_tensors`, `n_kv`) is negative.
    #[error("{what} at offset {offset} is negative ({value})")]
    NegativeCount {
        /// The field.
        what: &'static str,
        /// Where it is stored.
        offset: u64,
        /// The value read.
        value: i64,
    },
    /// A metadata value type tag that GGUF does not define.
    #[error("unknown metadata value type {id} for key `{key}` at offset {offset}")]
    UnknownValueType {
        /// The key whose value (or array element type) is bad.
        key: String,
        /// Where the tag is stored.
        offset: u64,
        /// The tag read.
        id: u32,
    },
    /// A string that is not valid UTF-8.
    #[error("{what} at offset {offset} is not valid UTF-8")]
    InvalidUtf8 {
        /// The field (key name, value of a key, tensor name).
        what: String,
        /// Where the string bytes start.
        offset: u64,
    },
    /// A bool stored as a byte other than 0 or 1.
    #[error("bool value of `{key}` at offset {offset} is {byte}, expected 0 or 1")]
    InvalidBool {
        /// The key.
        key: String,
        /// Where the byte is.
        offset: u64,
        /// The byte found.
        byte: u8,
    },
    /// Arrays nested deeper than [`crate::MAX_ARRAY_DEPTH`].
    #[error("array value of `{key}` at offset {offset} nests deeper than {max} levels")]
    NestingTooDeep {
        /// The key.
        key: String,
        /// Where the too-deep array starts.
        offset: u64,
        /// The limit.
        max: usize,
    },
    /// The same metadata key twice.
    #[error("duplicate metadata key `{key}` at offset {offset} (first seen at offset {first})")]
    DuplicateKey {
        /// The key.
        key: String,
        /// Where the second occurrence starts.
        offset: u64,
        /// Where the first occurrence starts.
        first: u64,
    },
    /// `general.alignment` is not a non-zero power of two stored as `u32`.
    #[error("`general.alignment` must be a UINT32 power of two, found {found}")]
    BadAlignment {
        /// What was found, rendered.
        found: String,
    },
    /// The same tensor name twice.
    #[error(
        "duplicate tensor name `{name}` at offset {offset} (tensor infos #{first} and #{second})"
    )]
    DuplicateTensor {
        /// The name.
        name: String,
        /// Where the second info starts.
        offset: u64,
        /// Index of the first info.
        first: usize,
        /// Index of the second info.
        second: usize,
    },
    /// A ggml type id this crate does not know.
    #[error("tensor `{tensor}`: unknown ggml type id {id} at offset {offset}")]
    UnknownTensorType {
        /// The tensor.
        tensor: String,
        /// Where the id is stored.
        offset: u64,
        /// The id read.
        id: u32,
    },
    /// More than four dimensions.
    #[error("tensor `{tensor}`: {n_dims} dimensions at offset {offset}, at most {max} are allowed")]
    TooManyDims {
        /// The tensor.
        tensor: String,
        /// Where `n_dims` is stored.
        offset: u64,
        /// The value read.
        n_dims: u32,
        /// The limit.
        max: usize,
    },
    /// A shape that is zero, negative, overflowing or not a whole number of blocks.
    #[error("tensor `{tensor}`: invalid shape {dims:?} for type {ty}: {reason}")]
    BadShape {
        /// The tensor.
        tensor: String,
        /// The dims as stored (ggml order, `ne0` first).
        dims: Vec<i64>,
        /// The tensor type name.
        ty: &'static str,
        /// What is wrong.
        reason: &'static str,
    },
    /// A data offset that is not a multiple of the file's alignment.
    #[error(
        "tensor `{tensor}`: data offset {offset} is not a multiple of the alignment {alignment}"
    )]
    Misaligned {
        /// The tensor.
        tensor: String,
        /// Its offset relative to the data section.
        offset: u64,
        /// The alignment in force.
        alignment: u64,
    },
    /// Tensor data that extends past the end of the file.
    #[error(
        "tensor `{tensor}`: data at file bytes [{start}, {end}) lies past the end of the file ({file_len} bytes)"
    )]
    OutOfBounds {
        /// The tensor.
        tensor: String,
        /// Absolute start.
        start: u64,
        /// Absolute end (exclusive).
        end: u64,
        /// File length.
        file_len: u64,
    },
    /// Two tensors whose data ranges overlap.
    #[error(
        "tensors `{first}` [{first_start}, {first_end}) and `{second}` [{second_start}, {second_end}) overlap in the data section"
    )]
    Overlap {
        /// The tensor that starts first.
        first: String,
        /// Its start (relative to the data section).
        first_start: u64,
        /// Its end.
        first_end: u64,
        /// The tensor that starts inside it.
        second: String,
        /// Its start.
        second_start: u64,
        /// Its end.
        second_end: u64,
    },
    /// A writer was handed tensor data of the wrong length.
    #[error("tensor `{tensor}`: {got} bytes of data written, its type and shape need {expected}")]
    DataSize {
        /// The tensor.
        tensor: String,
        /// Bytes expected.
        expected: u64,
        /// Bytes given.
        got: u64,
    },
}

/// Result alias for this crate.
pub type Result<T, E = GgufError> = std::result::Result<T, E>;
