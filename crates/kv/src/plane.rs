//! Host storage of one layer's K or V rows in a block format: quantized on write (ggml's
//! `set_rows`), read back one head of one cell at a time.

use specula_quant::blocks::BlockIq4Nl;
use specula_quant::{QType, iq4};

use crate::{KvError, Result};

/// The K or V rows of one layer: `n_cells` cells × `n_head` heads, each head `dim` stored values
/// (`head_dim` from the model, zero-padded to `dim` for turbo) in format `ty`.
///
/// The bytes live in 8-byte words so that f32 and f16 heads are aligned for direct reads.
#[derive(Clone, Debug)]
pub struct Plane {
    ty: QType,
    n_cells: usize,
    n_head: usize,
    head_dim: usize,
    dim: usize,
    head_bytes: usize,
    words: Vec<u64>,
}

impl Plane {
    /// A zeroed plane.
    ///
    /// # Errors
    /// [`KvError::Shape`] when `dim` is not a whole number of `ty`'s blocks or smaller than
    /// `head_dim`, or the plane would not fit in memory.
    pub fn new(
        ty: QType,
        n_cells: usize,
        n_head: usize,
        head_dim: usize,
        dim: usize,
    ) -> Result<Self> {
        if dim < head_dim {
            return Err(KvError::Shape(format!(
                "a {head_dim}-value head cannot be stored in {dim} values"
            )));
        }
        let head_bytes = ty.row_bytes(dim)?;
        let total = n_cells
            .checked_mul(n_head)
            .and_then(|x| x.checked_mul(head_bytes))
            .ok_or_else(|| KvError::Shape(format!("{n_cells} cells of {n_head} heads overflow")))?;
        Ok(Self {
            ty,
            n_cells,
            n_head,
            head_dim,
            dim,
            head_bytes,
            words: vec![0; total.div_ceil(8)],
        })
    }

    /// The format.
    #[must_use]
    pub fn ty(&self) -> QType {
        self.ty
    }

    /// Values per stored head (padded).
    #[must_use]
    pub fn dim(&self) -> usize {
        self.dim
    }

    /// Values per model head.
    #[must_use]
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// Bytes of one head of one cell.
    #[must_use]
    pub fn head_bytes(&self) -> usize {
        self.head_bytes
    }

    /// Bytes of one cell (all heads).
    #[must_use]
    pub fn row_bytes(&self) -> usize {
        self.head_bytes * self.n_head
    }

    /// Cells.
    #[must_use]
    pub fn n_cells(&self) -> usize {
        self.n_cells
    }

    /// Every byte of the plane (cell-major, then head).
    #[must_use]
    pub fn bytes(&self) -> &[u8] {
        &bytemuck::cast_slice::<u64, u8>(&self.words)[..self.n_cells * self.row_bytes()]
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        let n = self.n_cells * self.row_bytes();
        &mut bytemuck::cast_slice_mut::<u64, u8>(&mut self.words)[..n]
    }

    /// The stored bytes of head `head` of `cell`.
    ///
    /// # Panics
    /// If `cell` or `head` is out of range.
    #[must_use]
    #[inline]
    pub fn head(&self, cell: usize, head: usize) -> &[u8] {
        assert!(
            cell < self.n_cells && head < self.n_head,
            "KV plane: cell {cell} head {head} out of range"
        );
        let off = (cell * self.n_head + head) * self.head_bytes;
        &self.bytes()[off..off + self.head_bytes]
    }

    /// The stored bytes of `cell` (all heads).
    ///
    /// # Panics
    /// If `cell` is out of range.
    #[must_use]
    pub fn cell(&self, cell: usize) -> &[u8] {
        let rb = self.row_bytes();
        &self.bytes()[cell * rb..(cell + 1) * rb]
    }

    /// Quantizes one row (`n_head · head_dim` values) into `cell`: each head is zero-padded to
    /// the stored width and encoded with the cache quantizer of the format (for IQ4_NL the
    /// `ntry = −1` reference ggml-cpu uses for caches; for turbo the rotation happens inside the
    /// quantizer, so `row` is in the model's domain). `pad` is scratch space.
    ///
    /// # Errors
    /// [`KvError::Shape`] when the row has the wrong length or the cell is out of range.
    pub fn write(&mut self, cell: usize, row: &[f32], pad: &mut Vec<f32>) -> Result<()> {
        if cell >= self.n_cells {
            return Err(KvError::Shape(format!(
                "cell {cell} of a {}-cell cache",
                self.n_cells
            )));
        }
        if row.len() != self.n_head * self.head_dim {
            return Err(KvError::Shape(format!(
                "a row of {} values, expected {} heads × {}",
                row.len(),
                self.n_head,
                self.head_dim
            )));
        }
        let (ty, hd, dim, hb, nh) = (
            self.ty,
            self.head_dim,
            self.dim,
            self.head_bytes,
            self.n_head,
        );
        pad.clear();
        pad.resize(dim, 0.0);
        let dst = &mut self.bytes_mut()[cell * nh * hb..(cell + 1) * nh * hb];
        for (src, dst) in row.chunks_exact(hd).zip(dst.chunks_exact_mut(hb)) {
            pad[..hd].copy_from_slice(src);
            quantize_head(ty, pad, dst)?;
        }
        Ok(())
    }

    /// Dequantizes head `head` of `cell` into `out` (`dim` values; turbo heads stay in the
    /// rotated domain).
    ///
    /// # Errors
    /// [`KvError::Shape`] when `out` does not hold `dim` values.
    ///
    /// # Panics
    /// If `cell` or `head` is out of range.
    pub fn dequantize_head(&self, cell: usize, head: usize, out: &mut [f32]) -> Result<()> {
        Ok(specula_quant::dequantize_row(
            self.ty,
            self.head(cell, head),
            out,
        )?)
    }
}

/// Encodes one stored head with the quantizer a cache uses for `ty`.
///
/// # Errors
/// When `x` / `dst` do not match the format.
pub fn quantize_head(ty: QType, x: &[f32], dst: &mut [u8]) -> Result<()> {
    if ty == QType::IQ4_NL {
        let want = ty.row_bytes(x.len())?;
        if dst.len() != want {
            return Err(KvError::Shape(format!(
                "iq4_nl head: {} bytes, expected {want}",
                dst.len()
            )));
        }
        iq4::quantize_row_iq4_nl_ref(x, bytemuck::cast_slice_mut::<u8, BlockIq4Nl>(dst));
        return Ok(());
    }
    Ok(specula_quant::quantize_row(ty, x, dst)?)
}
