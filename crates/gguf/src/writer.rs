//! Writing GGUF v3 files: header layout, per-tensor data with padding, atomic file creation.

use std::collections::HashMap;
use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};

use crate::error::{GgufError, Result};
use crate::reader::{ALIGNMENT_KEY, DEFAULT_ALIGNMENT, MAGIC, MAX_DIMS, shape_sizes};
use crate::types::GgmlType;
use crate::value::{Array, Value};

/// A tensor to be written: name, type and shape (ggml order, `ne0` first).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorSpec {
    /// Tensor name.
    pub name: String,
    /// Element type.
    pub ty: GgmlType,
    /// Dimensions, `ne0` first.
    pub dims: Vec<u64>,
    n_bytes: u64,
}

impl TensorSpec {
    /// Bytes of data this tensor takes.
    #[must_use]
    pub fn n_bytes(&self) -> u64 {
        self.n_bytes
    }
}

/// Builds a GGUF v3 file: metadata in insertion order, then tensor infos, then tensor data,
/// laid out as gguf-py's `GGUFWriter` does (data section and every tensor padded to the
/// alignment), so the same inputs give the same bytes.
///
/// Tensor data is supplied at write time by a callback, one tensor after another, so a
/// quantizer can stream its output without holding the whole model in memory.
#[derive(Clone, Debug, Default)]
pub struct GgufWriter {
    metadata: Vec<(String, Value)>,
    keys: HashMap<String, usize>,
    tensors: Vec<TensorSpec>,
    names: HashMap<String, usize>,
}

impl GgufWriter {
    /// An empty writer.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends a metadata entry.
    ///
    /// # Errors
    /// [`GgufError::DuplicateKey`] if `key` was already added (offsets are entry indices), or
    /// [`GgufError::BadAlignment`] for a `general.alignment` that is not a `u32` power of two.
    pub fn add(&mut self, key: impl Into<String>, value: Value) -> Result<&mut Self> {
        let key = key.into();
        if let Some(&first) = self.keys.get(&key) {
            return Err(GgufError::DuplicateKey {
                key,
                offset: self.metadata.len() as u64,
                first: first as u64,
            });
        }
        if key == ALIGNMENT_KEY && !matches!(value, Value::U32(a) if a.is_power_of_two()) {
            return Err(GgufError::BadAlignment {
                found: format!("{} {value}", value.value_type()),
            });
        }
        self.keys.insert(key.clone(), self.metadata.len());
        self.metadata.push((key, value));
        Ok(self)
    }

    /// Appends a tensor info; its data is given to [`GgufWriter::write`] later, in the same order.
    ///
    /// # Errors
    /// [`GgufError::DuplicateTensor`], [`GgufError::TooManyDims`] or [`GgufError::BadShape`].
    pub fn add_tensor(
        &mut self,
        name: impl Into<String>,
        ty: GgmlType,
        dims: &[u64],
    ) -> Result<&mut Self> {
        let name = name.into();
        if let Some(&first) = self.names.get(&name) {
            return Err(GgufError::DuplicateTensor {
                name,
                offset: 0,
                first,
                second: self.tensors.len(),
            });
        }
        if dims.len() > MAX_DIMS {
            return Err(GgufError::TooManyDims {
                tensor: name,
                offset: 0,
                n_dims: u32::try_from(dims.len()).unwrap_or(u32::MAX),
                max: MAX_DIMS,
            });
        }
        let signed: Vec<i64> = dims
            .iter()
            .map(|&d| i64::try_from(d).unwrap_or(-1))
            .collect();
        let (_, n_bytes) = shape_sizes(&name, ty, &signed)?;
        self.names.insert(name.clone(), self.tensors.len());
        self.tensors.push(TensorSpec {
            name,
            ty,
            dims: dims.to_vec(),
            n_bytes,
        });
        Ok(self)
    }

    /// The tensors added so far.
    #[must_use]
    pub fn tensors(&self) -> &[TensorSpec] {
        &self.tensors
    }

    fn alignment(&self) -> u64 {
        match self.keys.get(ALIGNMENT_KEY).map(|&i| &self.metadata[i].1) {
            Some(Value::U32(a)) => u64::from(*a),
            _ => DEFAULT_ALIGNMENT,
        }
    }

    /// Writes the whole file to `out`. `data(i, spec, sink)` must write exactly
    /// `spec.n_bytes()` bytes of tensor `i` to `sink`. Returns the number of bytes written.
    ///
    /// # Errors
    /// [`GgufError::DataSize`] if a callback writes the wrong amount, [`GgufError::Io`] if
    /// writing fails (the path is reported as `<stream>`).
    pub fn write<W: Write>(
        &self,
        out: &mut W,
        mut data: impl FnMut(usize, &TensorSpec, &mut dyn Write) -> io::Result<()>,
    ) -> Result<u64> {
        let io_err = |source| GgufError::Io {
            action: "write",
            path: PathBuf::from("<stream>"),
            source,
        };
        let alignment = self.alignment();
        let mut header = Vec::new();
        self.encode_header(&mut header, alignment);
        let padded = (header.len() as u64).next_multiple_of(alignment);
        header.resize(usize::try_from(padded).unwrap_or(usize::MAX), 0);
        out.write_all(&header).map_err(io_err)?;
        let mut total = padded;
        for (i, spec) in self.tensors.iter().enumerate() {
            let mut counter = CountingWriter {
                inner: &mut *out,
                count: 0,
            };
            data(i, spec, &mut counter).map_err(io_err)?;
            if counter.count != spec.n_bytes {
                return Err(GgufError::DataSize {
                    tensor: spec.name.clone(),
                    expected: spec.n_bytes,
                    got: counter.count,
                });
            }
            let pad = spec.n_bytes.next_multiple_of(alignment) - spec.n_bytes;
            let zeros = vec![0u8; usize::try_from(pad).unwrap_or(0)];
            out.write_all(&zeros).map_err(io_err)?;
            total += spec.n_bytes + pad;
        }
        out.flush().map_err(io_err)?;
        Ok(total)
    }

    /// Writes the file to memory with the tensors' data given in order.
    ///
    /// # Errors
    /// As [`GgufWriter::write`]; also [`GgufError::DataSize`] if `data` has the wrong length.
    pub fn to_vec(&self, data: &[&[u8]]) -> Result<Vec<u8>> {
        if data.len() != self.tensors.len() {
            let missing = self.tensors.get(data.len()).map_or("<extra>", |t| &t.name);
            return Err(GgufError::DataSize {
                tensor: missing.to_owned(),
                expected: self.tensors.len() as u64,
                got: data.len() as u64,
            });
        }
        let mut out = Vec::new();
        self.write(&mut out, |i, _, sink| sink.write_all(data[i]))?;
        Ok(out)
    }

    /// Writes the file atomically to `path`: into a temporary file in the same directory,
    /// flushed and fsynced, then renamed over `path`. On any error nothing is left at `path`
    /// (an existing file there is untouched) and the temporary file is removed.
    ///
    /// # Errors
    /// As [`GgufWriter::write`], with the real path in I/O errors.
    pub fn write_file(
        &self,
        path: impl AsRef<Path>,
        data: impl FnMut(usize, &TensorSpec, &mut dyn Write) -> io::Result<()>,
    ) -> Result<u64> {
        let path = path.as_ref();
        let io = |action| {
            move |source| GgufError::Io {
                action,
                path: path.to_owned(),
                source,
            }
        };
        let dir = match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        let mut builder = tempfile::Builder::new();
        builder.prefix(".specula-").suffix(".gguf.partial");
        // A model file, not a secret: created as `File::create` would (0o666 less the umask),
        // not with a temporary file's 0o600 that other users (a server's account) cannot read.
        #[cfg(unix)]
        builder.permissions(std::os::unix::fs::PermissionsExt::from_mode(0o666));
        let tmp = builder
            .tempfile_in(dir)
            .map_err(io("create a temporary file next to"))?;
        let mut buf = BufWriter::with_capacity(1 << 20, tmp);
        let n = self.write(&mut buf, data).map_err(|e| match e {
            GgufError::Io { source, .. } => GgufError::Io {
                action: "write",
                path: path.to_owned(),
                source,
            },
            other => other,
        })?;
        let tmp = buf.into_inner().map_err(|e| io("write")(e.into_error()))?;
        tmp.as_file().sync_all().map_err(io("sync"))?;
        tmp.persist(path).map_err(|e| io("rename into")(e.error))?;
        // Make the rename itself durable; failure to open a directory is not fatal on
        // platforms that do not support it.
        if let Ok(d) = File::open(dir) {
            d.sync_all().map_err(io("sync the directory of"))?;
        }
        Ok(n)
    }

    fn encode_header(&self, out: &mut Vec<u8>, alignment: u64) {
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&3u32.to_le_bytes());
        out.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (key, value) in &self.metadata {
            put_str(out, key);
            out.extend_from_slice(&value.value_type().id().to_le_bytes());
            put_value(out, value);
        }
        let mut offset = 0u64;
        for t in &self.tensors {
            put_str(out, &t.name);
            // `add_tensor` keeps dims.len() <= MAX_DIMS.
            let n_dims = u32::try_from(t.dims.len()).unwrap_or(u32::MAX);
            out.extend_from_slice(&n_dims.to_le_bytes());
            for &d in &t.dims {
                out.extend_from_slice(&d.to_le_bytes());
            }
            out.extend_from_slice(&t.ty.id().to_le_bytes());
            out.extend_from_slice(&offset.to_le_bytes());
            offset += t.n_bytes.next_multiple_of(alignment);
        }
    }
}

struct CountingWriter<'a, W: Write> {
    inner: &'a mut W,
    count: u64,
}

impl<W: Write> Write for CountingWriter<'_, W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.count += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn put_value(out: &mut Vec<u8>, v: &Value) {
    match v {
        Value::U8(x) => out.push(*x),
        Value::I8(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::Bool(x) => out.push(u8::from(*x)),
        Value::String(s) => put_str(out, s),
        Value::Array(a) => put_array(out, a),
    }
}

fn put_array(out: &mut Vec<u8>, a: &Array) {
    out.extend_from_slice(&a.element_type().id().to_le_bytes());
    out.extend_from_slice(&(a.len() as u64).to_le_bytes());
    macro_rules! le {
        ($v:expr) => {
            for x in $v {
                out.extend_from_slice(&x.to_le_bytes());
            }
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
        Array::String(v) => v.iter().for_each(|s| put_str(out, s)),
        Array::Array(v) => v.iter().for_each(|inner| put_array(out, inner)),
    }
}
