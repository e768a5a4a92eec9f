//! The backend's device objects on the host: activation matrices and weights.

use std::sync::Arc;

use specula_quant::QType;
use specula_tensor::{ByteSource, Result, TensorError, WeightDesc};

use crate::gemm::Packing;
use crate::pool::{Disjoint, Pool, split};

/// An f32 activation matrix, row-major `[rows, cols]`.
///
/// Resizing keeps the allocation: a forward pass that reuses its tensors allocates only while
/// its batches grow.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CpuTensor {
    rows: usize,
    cols: usize,
    data: Vec<f32>,
}

impl CpuTensor {
    /// A `[rows, cols]` tensor holding `data`.
    ///
    /// # Panics
    /// If `data.len() != rows · cols`.
    #[must_use]
    pub fn new(rows: usize, cols: usize, data: Vec<f32>) -> Self {
        assert_eq!(
            data.len(),
            rows * cols,
            "a [{rows}, {cols}] tensor needs {} values",
            rows * cols
        );
        Self { rows, cols, data }
    }

    /// A zeroed `[rows, cols]` tensor.
    #[must_use]
    pub fn zeros(rows: usize, cols: usize) -> Self {
        Self::new(rows, cols, vec![0.0; rows * cols])
    }

    /// Rows.
    #[must_use]
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Columns (values per row).
    #[must_use]
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// All values, row-major.
    #[must_use]
    pub fn as_slice(&self) -> &[f32] {
        &self.data
    }

    /// All values, row-major, mutably.
    #[must_use]
    pub fn as_mut_slice(&mut self) -> &mut [f32] {
        &mut self.data
    }

    /// Row `r`.
    ///
    /// # Panics
    /// If `r ≥ rows`.
    #[must_use]
    pub fn row(&self, r: usize) -> &[f32] {
        &self.data[r * self.cols..(r + 1) * self.cols]
    }

    /// Row `r`, mutably.
    ///
    /// # Panics
    /// If `r ≥ rows`.
    #[must_use]
    pub fn row_mut(&mut self, r: usize) -> &mut [f32] {
        &mut self.data[r * self.cols..(r + 1) * self.cols]
    }

    /// Gives the tensor the shape `[rows, cols]`, reusing its allocation when it is large
    /// enough; values already present are kept in memory order, new ones are zero.
    pub fn resize(&mut self, rows: usize, cols: usize) {
        self.rows = rows;
        self.cols = cols;
        self.data.resize(rows * cols, 0.0);
    }
}

/// Where a weight's bytes live.
enum Storage {
    /// A range of the memory `source` keeps alive (the model file's memory map).
    Borrowed {
        /// The memory.
        source: Arc<dyn ByteSource>,
        /// Where the weight's bytes are in it.
        range: std::ops::Range<usize>,
    },
    /// An F32 matrix whose bytes were not 4-byte aligned, copied once so it can be read as
    /// `&[f32]` (GGUF aligns tensor data, so this does not happen with real files).
    OwnedF32(Vec<f32>),
}

/// A weight in its file format: a matrix `[n_out, n_in]` (ggml `dims = [n_in, n_out]`) or a
/// vector.
///
/// Matrices borrow their bytes from the memory the [`WeightDesc`] came from and are never
/// dequantized. Vectors (norm weights, biases) are also converted to f32 once at load, since
/// the ops that use them read them as f32.
pub struct CpuWeight {
    name: String,
    ty: QType,
    dims: Vec<usize>,
    storage: Storage,
    values: Option<Vec<f32>>,
    /// The rows rearranged for the matmul micro-kernels, when the model asked for it
    /// ([`CpuWeight::pack`]); `storage` keeps the file layout for `get_rows`.
    packed: Option<(Packing, PackedBytes)>,
}

/// The memory of a packed weight: an anonymous map, which Linux may back with 2 MiB pages
/// (fewer page faults while packing and fewer TLB misses while streaming it), or a vector
/// where the OS refuses the map.
enum PackedBytes {
    Map(memmap2::MmapMut),
    Vec(Vec<u8>),
}

impl PackedBytes {
    fn zeroed(len: usize) -> Self {
        match memmap2::MmapMut::map_anon(len) {
            Ok(map) => {
                #[cfg(target_os = "linux")]
                {
                    // Best effort: without huge pages the map works the same.
                    let advised = map.advise(memmap2::Advice::HugePage);
                    drop(advised);
                }
                Self::Map(map)
            }
            Err(_) => Self::Vec(vec![0; len]),
        }
    }

    fn bytes(&self) -> &[u8] {
        match self {
            Self::Map(m) => m,
            Self::Vec(v) => v,
        }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        match self {
            Self::Map(m) => m,
            Self::Vec(v) => v,
        }
    }
}

impl std::fmt::Debug for CpuWeight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuWeight")
            .field("name", &self.name)
            .field("ty", &self.ty)
            .field("dims", &self.dims)
            .field("bytes", &self.bytes().len())
            .finish_non_exhaustive()
    }
}

impl CpuWeight {
    /// Makes a weight from file bytes, checking their length against type and shape.
    ///
    /// The bytes are not copied: the weight keeps `desc.owner` and the range of `desc.data`
    /// inside it (checked here), and re-borrows that range on every read.
    pub(crate) fn from_desc(desc: WeightDesc<'_>) -> Result<Self> {
        let size_error = |expected| TensorError::WeightSize {
            name: desc.name.to_owned(),
            ty: desc.ty,
            dims: desc.dims.to_vec(),
            expected,
            got: desc.data.len(),
        };
        let (&n_in, rest) = desc.dims.split_first().ok_or_else(|| TensorError::Shape {
            op: "weight",
            detail: format!("weight `{}` has no dimensions", desc.name),
        })?;
        let n_rows: usize = rest.iter().product();
        let expected = desc.ty.row_bytes(n_in)? * n_rows;
        if desc.data.len() != expected {
            return Err(size_error(expected));
        }
        if !is_weight_type(desc.ty) {
            return Err(TensorError::UnsupportedWeight {
                name: desc.name.to_owned(),
                ty: desc.ty,
                backend: "cpu",
                op: "weights",
            });
        }
        let storage =
            if desc.ty == QType::F32 && bytemuck::try_cast_slice::<u8, f32>(desc.data).is_err() {
                let v = desc
                    .data
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect();
                Storage::OwnedF32(v)
            } else {
                Storage::Borrowed {
                    source: Arc::clone(&desc.owner),
                    range: desc.range_in_owner()?,
                }
            };
        let values = if desc.dims.len() == 1 {
            let mut v = vec![0.0; n_in];
            specula_quant::dequantize_row(desc.ty, desc.data, &mut v)?;
            // Read as f32 from now on: the file's pages need not stay resident.
            let _ = &storage;
            Some(v)
        } else {
            None
        };
        Ok(Self {
            name: desc.name.to_owned(),
            ty: desc.ty,
            dims: desc.dims.to_vec(),
            storage,
            values,
            packed: None,
        })
    }

    /// Rearranges the rows of a matrix in `packing` for the matmul (see [`Packing`]): a copy
    /// that the matmul reads from then on, made by the threads of `pool`. The file's pages of
    /// the weight are handed back to the OS as they are copied ([`ByteSource::release`]), so
    /// the resident memory stays about one copy of the weight (pages that `get_rows` reads
    /// later come back from the page cache).
    pub(crate) fn pack(&mut self, packing: Packing, pool: &Pool) {
        if self.dims.len() != 2 || self.packed.is_some() {
            return;
        }
        /// Bytes packed between two releases of the source pages.
        const CHUNK: usize = 256 << 10;
        let rb = self.row_bytes();
        let bs = self.ty.type_size();
        let group = packing.r * rb;
        let chunk = (CHUNK / group).max(1) * group;
        let src = self.bytes();
        let mut dst = PackedBytes::zeroed(src.len());
        let n_chunks = src.len().div_ceil(chunk);
        let nth = pool.n_threads();
        let out = Disjoint::new(dst.bytes_mut());
        let release = |r: std::ops::Range<usize>| {
            if let Storage::Borrowed { source, range } = &self.storage {
                source.release(range.start + r.start..range.start + r.end);
            }
        };
        let work = |t: usize| {
            for c in split(n_chunks, nth, t) {
                let r = c * chunk..((c + 1) * chunk).min(src.len());
                // SAFETY: chunk c's bytes are written by the one thread whose split holds c,
                // and the splits are disjoint.
                let d = unsafe { out.slice(r.clone()) };
                packing.pack(&src[r.clone()], d, rb, bs);
                release(r);
            }
        };
        if nth == 1 || n_chunks == 1 {
            for t in 0..nth {
                work(t);
            }
        } else {
            pool.run(&work);
        }
        self.packed = Some((packing, dst));
    }

    /// The packed rows and their packing, if the weight was packed.
    pub(crate) fn packed(&self) -> Option<(Packing, &[u8])> {
        self.packed.as_ref().map(|(p, b)| (*p, b.bytes()))
    }

    /// Tensor name.
    #[must_use]
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Block format.
    #[must_use]
    pub fn ty(&self) -> QType {
        self.ty
    }

    /// Dimensions in ggml order (`dims[0]` is the row length).
    #[must_use]
    pub fn dims(&self) -> &[usize] {
        &self.dims
    }

    /// Values per row (`dims[0]`).
    #[must_use]
    pub fn row_len(&self) -> usize {
        self.dims[0]
    }

    /// Rows (the product of `dims[1..]`; 1 for a vector).
    #[must_use]
    pub fn n_rows(&self) -> usize {
        self.dims[1..].iter().product()
    }

    /// Bytes of one row.
    #[must_use]
    pub fn row_bytes(&self) -> usize {
        self.bytes().len() / self.n_rows().max(1)
    }

    /// The bytes in the file format.
    #[must_use]
    pub fn bytes(&self) -> &[u8] {
        match &self.storage {
            // The range was checked against the source's bytes when the weight was made.
            Storage::Borrowed { source, range } => &source.bytes()[range.clone()],
            Storage::OwnedF32(v) => bytemuck::cast_slice(v),
        }
    }

    /// The bytes of row `r`.
    #[must_use]
    pub fn row(&self, r: usize) -> &[u8] {
        let rb = self.row_bytes();
        &self.bytes()[r * rb..(r + 1) * rb]
    }

    /// The f32 values of a vector weight (converted once at load), `None` for a matrix.
    #[must_use]
    pub fn values(&self) -> Option<&[f32]> {
        self.values.as_deref()
    }

    /// The f32 values of a vector weight of length `n`, or a panic naming the weight and `op`.
    pub(crate) fn vector(&self, n: usize, op: &str) -> &[f32] {
        let v = self
            .values()
            .unwrap_or_else(|| panic!("{op}: weight `{}` is not a vector", self.name));
        assert_eq!(
            v.len(),
            n,
            "{op}: weight `{}` has {} values, expected {n}",
            self.name,
            v.len()
        );
        v
    }
}

/// Whether the CPU backend has a dot product and a dequantizer for weights of `ty`.
fn is_weight_type(ty: QType) -> bool {
    !matches!(
        ty,
        QType::Q8_1 | QType::Q8_K | QType::Turbo2 | QType::Turbo3 | QType::Turbo4
    )
}

/// The CPU backend's index tensor: the indices as the host gave them, and as `usize` for the
/// ops that index rows and cells with them (both filled once, when the index is made).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CpuIndex {
    ids: Vec<u32>,
    at: Vec<usize>,
}

impl CpuIndex {
    /// An index holding `v`.
    #[must_use]
    pub fn new(v: &[u32]) -> Self {
        let mut i = Self::default();
        i.set(v);
        i
    }

    /// Makes the index hold `v`, reusing its storage.
    pub fn set(&mut self, v: &[u32]) {
        self.ids.clear();
        self.ids.extend_from_slice(v);
        self.at.clear();
        self.at.extend(v.iter().map(|&i| i as usize));
    }

    /// The indices.
    #[must_use]
    pub fn as_u32(&self) -> &[u32] {
        &self.ids
    }

    /// The indices as `usize`.
    #[must_use]
    pub fn as_usize(&self) -> &[usize] {
        &self.at
    }
}
