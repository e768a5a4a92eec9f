//! Parsing and validation of a GGUF header, and the mmap-backed file handle.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use crate::error::{GgufError, Result};
use crate::types::GgmlType;
use crate::value::{Array, Value, ValueType};

/// The four bytes every GGUF file starts with.
pub const MAGIC: [u8; 4] = *b"GGUF";
/// Alignment of the data section and of every tensor when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// Most dimensions a tensor may have (`GGML_MAX_DIMS`).
pub const MAX_DIMS: usize = 4;
/// Deepest nesting of arrays inside arrays that the reader accepts; deeper nesting is a
/// malformed or hostile file, and refusing it keeps recursion bounded.
pub const MAX_ARRAY_DEPTH: usize = 8;
/// The metadata key that sets the alignment.
pub const ALIGNMENT_KEY: &str = "general.alignment";

/// The metadata of a GGUF file: key/value pairs in file order with an index by key.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Metadata {
    entries: Vec<(String, Value)>,
    index: HashMap<String, usize>,
}

impl Metadata {
    /// The value stored under `key`.
    #[must_use]
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.index.get(key).map(|&i| &self.entries[i].1)
    }

    /// The string stored under `key`, if it is a string.
    #[must_use]
    pub fn get_str(&self, key: &str) -> Option<&str> {
        self.get(key).and_then(Value::as_str)
    }

    /// The integer stored under `key`, if it is a non-negative integer.
    #[must_use]
    pub fn get_u64(&self, key: &str) -> Option<u64> {
        self.get(key).and_then(Value::as_u64)
    }

    /// The number stored under `key`, if it is a number.
    #[must_use]
    pub fn get_f64(&self, key: &str) -> Option<f64> {
        self.get(key).and_then(Value::as_f64)
    }

    /// The array stored under `key`, if it is an array.
    #[must_use]
    pub fn get_array(&self, key: &str) -> Option<&Array> {
        self.get(key).and_then(Value::as_array)
    }

    /// All entries in file order.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = (&str, &Value)> {
        self.entries.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// Number of entries.
    #[must_use]
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether there are no entries.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

/// One tensor info: where a tensor's data lies and how to interpret it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    /// Tensor name as llama.cpp writes it (`blk.0.attn_q.weight`).
    pub name: String,
    /// Element type.
    pub ty: GgmlType,
    /// Dimensions in ggml order: `dims[0]` (`ne0`) is the contiguous row length.
    pub dims: Vec<u64>,
    /// Offset of the data relative to the start of the data section.
    pub offset: u64,
    n_elements: u64,
    n_bytes: u64,
}

impl TensorInfo {
    /// Number of values.
    #[must_use]
    pub fn n_elements(&self) -> u64 {
        self.n_elements
    }

    /// Bytes of data.
    #[must_use]
    pub fn n_bytes(&self) -> u64 {
        self.n_bytes
    }
}

/// Checks a shape against a type and returns `(n_elements, n_bytes)`.
pub(crate) fn shape_sizes(name: &str, ty: GgmlType, dims: &[i64]) -> Result<(u64, u64)> {
    let bad = |reason| GgufError::BadShape {
        tensor: name.to_owned(),
        dims: dims.to_vec(),
        ty: ty.name(),
        reason,
    };
    let mut n: u64 = 1;
    for &d in dims {
        let d = match u64::try_from(d) {
            Ok(0) => return Err(bad("a dimension is zero")),
            Ok(d) => d,
            Err(_) => return Err(bad("a dimension is negative")),
        };
        n = n
            .checked_mul(d)
            .filter(|&n| i64::try_from(n).is_ok())
            .ok_or_else(|| bad("the element count overflows 63 bits"))?;
    }
    let ne0 = dims.first().map_or(1, |&d| d.unsigned_abs());
    if !ne0.is_multiple_of(ty.block_size()) {
        return Err(bad("ne0 is not a whole number of blocks of this type"));
    }
    let bytes = (n / ty.block_size())
        .checked_mul(ty.type_size())
        .filter(|&b| i64::try_from(b).is_ok())
        .ok_or_else(|| bad("the byte size overflows 63 bits"))?;
    Ok((n, bytes))
}

/// A parsed and validated GGUF header: everything before the tensor data.
#[derive(Clone, Debug)]
pub struct Header {
    /// File format version (2 or 3).
    pub version: u32,
    /// Key/value metadata.
    pub metadata: Metadata,
    /// Tensor infos in file order.
    pub tensors: Vec<TensorInfo>,
    /// Alignment of the data section and tensor offsets.
    pub alignment: u64,
    /// Absolute file offset of the data section.
    pub data_offset: u64,
    tensor_index: HashMap<String, usize>,
}

impl Header {
    /// Parses and validates the header of the GGUF file whose complete bytes are `bytes`.
    ///
    /// Validation covers every field: magic, version, counts that cannot fit, truncation,
    /// value type tags, UTF-8, bools, nesting depth, duplicate keys and tensor names, the
    /// alignment key, tensor types, shapes, alignment, bounds and overlap of tensor data.
    ///
    /// # Errors
    /// The first problem found, as a [`GgufError`] naming its offset, key or tensor.
    pub fn parse(bytes: &[u8]) -> Result<Self> {
        let mut r = Reader { buf: bytes, pos: 0 };
        let magic = r.take(4, || "magic".to_owned())?;
        if magic != MAGIC {
            let mut found = [0; 4];
            found.copy_from_slice(magic);
            return Err(GgufError::BadMagic { found });
        }
        let version = r.u32(|| "version".to_owned())?;
        if !(2..=3).contains(&version) {
            return Err(GgufError::UnsupportedVersion { version });
        }
        let n_tensors = r.count("tensor count", 24, "tensors")?;
        let n_kv = r.count("metadata entry count", 13, "metadata entries")?;

        let mut metadata = Metadata::default();
        let mut key_offsets: HashMap<String, u64> = HashMap::new();
        for i in 0..n_kv {
            let at = r.offset();
            let key = r.string(|| format!("key of metadata entry #{i}"))?;
            if let Some(&first) = key_offsets.get(&key) {
                return Err(GgufError::DuplicateKey {
                    key,
                    offset: at,
                    first,
                });
            }
            let tag_at = r.offset();
            let tag = r.u32(|| format!("value type of `{key}`"))?;
            let ty = ValueType::from_id(tag).ok_or_else(|| GgufError::UnknownValueType {
                key: key.clone(),
                offset: tag_at,
                id: tag,
            })?;
            let value = r.value(ty, &key, 0)?;
            key_offsets.insert(key.clone(), at);
            metadata.index.insert(key.clone(), metadata.entries.len());
            metadata.entries.push((key, value));
        }

        let alignment = match metadata.get(ALIGNMENT_KEY) {
            None => DEFAULT_ALIGNMENT,
            Some(Value::U32(a)) if a.is_power_of_two() => u64::from(*a),
            Some(other) => {
                return Err(GgufError::BadAlignment {
                    found: format!("{} {other}", other.value_type()),
                });
            }
        };

        let mut tensors = Vec::with_capacity(usize::try_from(n_tensors).unwrap_or(0));
        let mut tensor_index: HashMap<String, usize> = HashMap::new();
        for i in 0..n_tensors {
            let at = r.offset();
            let name = r.string(|| format!("name of tensor info #{i}"))?;
            let index = tensors.len();
            if let Some(&first) = tensor_index.get(&name) {
                return Err(GgufError::DuplicateTensor {
                    name,
                    offset: at,
                    first,
                    second: index,
                });
            }
            let dims_at = r.offset();
            let n_dims = r.u32(|| format!("n_dims of tensor `{name}`"))?;
            if n_dims as usize > MAX_DIMS {
                return Err(GgufError::TooManyDims {
                    tensor: name,
                    offset: dims_at,
                    n_dims,
                    max: MAX_DIMS,
                });
            }
            let mut dims = Vec::with_capacity(MAX_DIMS);
            for d in 0..n_dims {
                dims.push(r.i64(|| format!("dimension {d} of tensor `{name}`"))?);
            }
            let type_at = r.offset();
            let type_id = r.u32(|| format!("type of tensor `{name}`"))?;
            let ty = GgmlType::from_id(type_id).ok_or_else(|| GgufError::UnknownTensorType {
                tensor: name.clone(),
                offset: type_at,
                id: type_id,
            })?;
            let offset = r.u64(|| format!("data offset of tensor `{name}`"))?;
            let (n_elements, n_bytes) = shape_sizes(&name, ty, &dims)?;
            if offset % alignment != 0 {
                return Err(GgufError::Misaligned {
                    tensor: name,
                    offset,
                    alignment,
                });
            }
            tensor_index.insert(name.clone(), index);
            tensors.push(TensorInfo {
                name,
                ty,
                dims: dims.iter().map(|d| d.unsigned_abs()).collect(),
                offset,
                n_elements,
                n_bytes,
            });
        }

        let data_offset = r.offset().next_multiple_of(alignment);
        let file_len = r.len();
        for t in &tensors {
            let start = data_offset.checked_add(t.offset);
            let end = start.and_then(|s| s.checked_add(t.n_bytes));
            match (start, end) {
                (Some(_), Some(end)) if end <= file_len => {}
                _ => {
                    return Err(GgufError::OutOfBounds {
                        tensor: t.name.clone(),
                        start: start.unwrap_or(u64::MAX),
                        end: end.unwrap_or(u64::MAX),
                        file_len,
                    });
                }
            }
        }
        let mut order: Vec<&TensorInfo> = tensors.iter().collect();
        order.sort_by_key(|t| t.offset);
        for pair in order.windows(2) {
            let (a, b) = (pair[0], pair[1]);
            if b.offset < a.offset + a.n_bytes {
                return Err(GgufError::Overlap {
                    first: a.name.clone(),
                    first_start: a.offset,
                    first_end: a.offset + a.n_bytes,
                    second: b.name.clone(),
                    second_start: b.offset,
                    second_end: b.offset + b.n_bytes,
                });
            }
        }

        Ok(Self {
            version,
            metadata,
            tensors,
            alignment,
            data_offset,
            tensor_index,
        })
    }

    /// The tensor info called `name`.
    #[must_use]
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    /// `general.architecture`, if present and a string.
    #[must_use]
    pub fn architecture(&self) -> Option<&str> {
        self.metadata.get_str("general.architecture")
    }
}

/// A bounds-checked little-endian reader over the file bytes that reports offsets.
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

macro_rules! read_le {
    ($($fn:ident -> $t:ty;)*) => {$(
        fn $fn(&mut self, what: impl FnOnce() -> String) -> Result<$t> {
            let b = self.take(size_of::<$t>() as u64, what)?;
            let mut a = [0u8; size_of::<$t>()];
            a.copy_from_slice(b);
            Ok(<$t>::from_le_bytes(a))
        }
    )*};
}

macro_rules! read_vec {
    ($self:ident, $n:ident, $t:ty, $what:expr) => {{
        let bytes = $self.take($n * size_of::<$t>() as u64, $what)?;
        bytes
            .chunks_exact(size_of::<$t>())
            .map(|c| <$t>::from_le_bytes(c.try_into().expect("chunk has the element size")))
            .collect::<Vec<$t>>()
    }};
}

impl<'a> Reader<'a> {
    fn offset(&self) -> u64 {
        self.pos as u64
    }

    fn len(&self) -> u64 {
        self.buf.len() as u64
    }

    fn remaining(&self) -> u64 {
        (self.buf.len() - self.pos) as u64
    }

    fn take(&mut self, n: u64, what: impl FnOnce() -> String) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(GgufError::Truncated {
                what: what(),
                offset: self.offset(),
                needed: n,
                available: self.remaining(),
            });
        }
        // `n <= remaining`, which is a usize, so the conversion is lossless.
        let n = usize::try_from(n).expect("n fits in usize");
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    read_le! {
        u8 -> u8;
        i8 -> i8;
        u16 -> u16;
        i16 -> i16;
        u32 -> u32;
        i32 -> i32;
        f32 -> f32;
        u64 -> u64;
        i64 -> i64;
        f64 -> f64;
    }

    /// Reads an `i64` count and checks that `count` items of at least `min_size` bytes each
    /// can fit in the rest of the file.
    fn count(&mut self, what: &'static str, min_size: u64, unit: &'static str) -> Result<u64> {
        let at = self.offset();
        let value = self.i64(|| what.to_owned())?;
        let count = u64::try_from(value).map_err(|_| GgufError::NegativeCount {
            what,
            offset: at,
            value,
        })?;
        self.check_fits(count, min_size, at, unit, || what.to_owned())?;
        Ok(count)
    }

    fn check_fits(
        &self,
        count: u64,
        min_size: u64,
        at: u64,
        unit: &'static str,
        what: impl FnOnce() -> String,
    ) -> Result<()> {
        if count
            .checked_mul(min_size)
            .is_none_or(|b| b > self.remaining())
        {
            return Err(GgufError::ImplausibleCount {
                what: what(),
                offset: at,
                count,
                unit,
                available: self.remaining(),
            });
        }
        Ok(())
    }

    fn string(&mut self, what: impl Fn() -> String) -> Result<String> {
        let at = self.offset();
        let len = self.u64(&what)?;
        self.check_fits(len, 1, at, "bytes", &what)?;
        let start = self.offset();
        let bytes = self.take(len, &what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| GgufError::InvalidUtf8 {
            what: what(),
            offset: start,
        })
    }

    fn value(&mut self, ty: ValueType, key: &str, depth: usize) -> Result<Value> {
        let what = || format!("value of `{key}`");
        Ok(match ty {
            ValueType::U8 => Value::U8(self.u8(what)?),
            ValueType::I8 => Value::I8(self.i8(what)?),
            ValueType::U16 => Value::U16(self.u16(what)?),
            ValueType::I16 => Value::I16(self.i16(what)?),
            ValueType::U32 => Value::U32(self.u32(what)?),
            ValueType::I32 => Value::I32(self.i32(what)?),
            ValueType::F32 => Value::F32(self.f32(what)?),
            ValueType::U64 => Value::U64(self.u64(what)?),
            ValueType::I64 => Value::I64(self.i64(what)?),
            ValueType::F64 => Value::F64(self.f64(what)?),
            ValueType::Bool => Value::Bool(self.bool(key)?),
            ValueType::String => Value::String(self.string(what)?),
            ValueType::Array => Value::Array(self.array(key, depth)?),
        })
    }

    fn bool(&mut self, key: &str) -> Result<bool> {
        let at = self.offset();
        match self.u8(|| format!("value of `{key}`"))? {
            0 => Ok(false),
            1 => Ok(true),
            byte => Err(GgufError::InvalidBool {
                key: key.to_owned(),
                offset: at,
                byte,
            }),
        }
    }

    fn array(&mut self, key: &str, depth: usize) -> Result<Array> {
        let at = self.offset();
        if depth >= MAX_ARRAY_DEPTH {
            return Err(GgufError::NestingTooDeep {
                key: key.to_owned(),
                offset: at,
                max: MAX_ARRAY_DEPTH,
            });
        }
        let what = || format!("array value of `{key}`");
        let tag = self.u32(what)?;
        let ty = ValueType::from_id(tag).ok_or_else(|| GgufError::UnknownValueType {
            key: key.to_owned(),
            offset: at,
            id: tag,
        })?;
        let count_at = self.offset();
        let n = self.u64(what)?;
        self.check_fits(n, ty.min_encoded_size(), count_at, "elements", what)?;
        Ok(match ty {
            ValueType::U8 => Array::U8(self.take(n, what)?.to_vec()),
            ValueType::I8 => Array::I8(read_vec!(self, n, i8, what)),
            ValueType::U16 => Array::U16(read_vec!(self, n, u16, what)),
            ValueType::I16 => Array::I16(read_vec!(self, n, i16, what)),
            ValueType::U32 => Array::U32(read_vec!(self, n, u32, what)),
            ValueType::I32 => Array::I32(read_vec!(self, n, i32, what)),
            ValueType::F32 => Array::F32(read_vec!(self, n, f32, what)),
            ValueType::U64 => Array::U64(read_vec!(self, n, u64, what)),
            ValueType::I64 => Array::I64(read_vec!(self, n, i64, what)),
            ValueType::F64 => Array::F64(read_vec!(self, n, f64, what)),
            ValueType::Bool => {
                Array::Bool((0..n).map(|_| self.bool(key)).collect::<Result<Vec<_>>>()?)
            }
            ValueType::String => Array::String(
                (0..n)
                    .map(|i| self.string(|| format!("element {i} of `{key}`")))
                    .collect::<Result<Vec<_>>>()?,
            ),
            ValueType::Array => Array::Array(
                (0..n)
                    .map(|_| self.array(key, depth + 1))
                    .collect::<Result<Vec<_>>>()?,
            ),
        })
    }
}

enum Storage {
    Mapped(memmap2::Mmap),
    Owned(Vec<u8>),
}

impl Storage {
    fn bytes(&self) -> &[u8] {
        match self {
            Self::Mapped(m) => m,
            Self::Owned(v) => v,
        }
    }
}

/// An open GGUF file: its validated [`Header`] and its bytes (memory-mapped when opened from
/// a path, so tensor data is paged in on use and never copied).
pub struct Gguf {
    header: Header,
    storage: Storage,
    path: Option<PathBuf>,
}

impl std::fmt::Debug for Gguf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gguf")
            .field("path", &self.path)
            .field("len", &self.len())
            .field("version", &self.header.version)
            .field("n_kv", &self.header.metadata.len())
            .field("n_tensors", &self.header.tensors.len())
            .finish_non_exhaustive()
    }
}

impl Gguf {
    /// Opens, maps and validates the GGUF file at `path`.
    ///
    /// # Errors
    /// [`GgufError::Io`] if the file cannot be opened or mapped, else any validation error of
    /// [`Header::parse`].
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let io = |action| {
            move |source| GgufError::Io {
                action,
                path: path.to_owned(),
                source,
            }
        };
        let file = File::open(path).map_err(io("open"))?;
        let len = file.metadata().map_err(io("stat"))?.len();
        let storage = if len == 0 {
            Storage::Owned(Vec::new())
        } else {
            // SAFETY: the map is read-only and private to this handle. Like every mmap-based
            // model loader we rely on the file not being truncated or rewritten while it is
            // open; a concurrent writer could change bytes under us, which Rust cannot rule
            // out for shared file mappings. The header is validated against the mapped length.
            let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io("map"))?;
            Storage::Mapped(map)
        };
        let header = Header::parse(storage.bytes())?;
        let gguf = Self {
            header,
            storage,
            path: Some(path.to_owned()),
        };
        // The header now lives in owned values; its pages (1.7 MiB of vocabulary for
        // SmolLM2) need not stay resident.
        gguf.release(0..usize::try_from(gguf.header.data_offset).unwrap_or(0));
        Ok(gguf)
    }

    /// Validates an in-memory GGUF image.
    ///
    /// # Errors
    /// Any validation error of [`Header::parse`].
    pub fn from_bytes(bytes: Vec<u8>) -> Result<Self> {
        let header = Header::parse(&bytes)?;
        Ok(Self {
            header,
            storage: Storage::Owned(bytes),
            path: None,
        })
    }

    /// The validated header.
    #[must_use]
    pub fn header(&self) -> &Header {
        &self.header
    }

    /// The metadata.
    #[must_use]
    pub fn metadata(&self) -> &Metadata {
        &self.header.metadata
    }

    /// Tensor infos in file order.
    #[must_use]
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.header.tensors
    }

    /// The tensor info called `name`.
    #[must_use]
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.header.tensor(name)
    }

    /// The data bytes of the `i`-th tensor (file order).
    ///
    /// # Panics
    /// If `i >= self.tensors().len()`, like slice indexing.
    #[must_use]
    pub fn tensor_data(&self, i: usize) -> &[u8] {
        let t = &self.header.tensors[i];
        // Bounds were validated at parse time, and offsets fit in usize since the file is
        // mapped or held in memory.
        let start = usize::try_from(self.header.data_offset + t.offset).expect("validated");
        let len = usize::try_from(t.n_bytes).expect("validated");
        &self.storage.bytes()[start..start + len]
    }

    /// The data bytes of the tensor called `name`.
    #[must_use]
    pub fn tensor_data_by_name(&self, name: &str) -> Option<&[u8]> {
        let i = *self.header.tensor_index.get(name)?;
        Some(self.tensor_data(i))
    }

    /// The path this file was opened from, if any.
    #[must_use]
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// Size of the file in bytes.
    #[must_use]
    pub fn len(&self) -> u64 {
        self.storage.bytes().len() as u64
    }

    /// Whether the file is empty (never true for a valid file).
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.storage.bytes().is_empty()
    }

    /// All bytes of the file.
    #[must_use]
    pub fn bytes(&self) -> &[u8] {
        self.storage.bytes()
    }

    /// Tells the OS that `range` of the file's bytes will not be read soon (a backend copied
    /// them), so their pages can leave this process's resident memory; they stay readable and
    /// come back from the page cache on the next read. Only the whole pages inside `range` are
    /// released; a file held in memory (not mapped) keeps its bytes. Best effort: an OS that
    /// refuses the advice changes nothing.
    pub fn release(&self, range: std::ops::Range<usize>) {
        const PAGE: usize = 4096;
        let Storage::Mapped(map) = &self.storage else {
            return;
        };
        let start = range.start.next_multiple_of(PAGE);
        let end = range.end.min(map.len()) / PAGE * PAGE;
        if start < end {
            // SAFETY: the map is a read-only private file mapping that this process never
            // writes, so dropping its pages loses nothing: the next read maps the file's bytes
            // again — the same bytes, under the assumption `Mmap::map` already makes that the
            // file is not modified while mapped.
            let advised = unsafe {
                map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, start, end - start)
            };
            // Best effort: the bytes stay readable either way.
            drop(advised);
        }
    }
}
