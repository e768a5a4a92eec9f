//! Host storage of one layer's K or V rows in a block format: quantized on write (ggml's
//! `set_rows`), read back one head of one cell at a time.

use specula_quant::blocks::BlockIq4Nl;
use specula_quant::{QType, iq4};

use crate::layout::{Rotation, hadamard, turbo_pad, turbo_two_stage};
use crate::{KvError, Result};

/// The K or V rows of one layer: `n_cells` cells × `n_head` heads, each head `dim` stored values
/// (`head_dim` from the model, zero-padded to `dim` for turbo) in format `ty`.
///
/// Head-major: head `h` of every cell, cell after cell, then head `h + 1`. Attention reads one
/// head's cells in order, so it streams through contiguous bytes, which the hardware
/// prefetchers follow; in a cell-major plane each head's rows sit a whole row apart, and a long
/// cache read from memory that way ran at a third of the bandwidth.
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
    rot: Rotation,
    /// Per-head offset subtracted before quantization (`n_head · head_dim` values), set once by
    /// [`Plane::calibrate`]; `None` for float formats and before calibration.
    center: Option<Vec<f32>>,
    words: Vec<u64>,
}

impl Plane {
    /// A zeroed plane whose heads are rotated by `rot` before they are quantized.
    ///
    /// # Errors
    /// [`KvError::Shape`] when `dim` is not a whole number of `ty`'s blocks or smaller than
    /// `head_dim`, a Hadamard group does not divide the head, or the plane would not fit in
    /// memory.
    pub fn new(
        ty: QType,
        n_cells: usize,
        n_head: usize,
        head_dim: usize,
        dim: usize,
        rot: Rotation,
    ) -> Result<Self> {
        if let Rotation::Hadamard(n) = rot
            && (!n.is_power_of_two() || !head_dim.is_multiple_of(n))
        {
            return Err(KvError::Shape(format!(
                "a Hadamard rotation of {n} values does not tile a {head_dim}-value head"
            )));
        }
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
            rot,
            center: None,
            words: vec![0; total.div_ceil(8)],
        })
    }

    /// The format.
    #[must_use]
    pub fn ty(&self) -> QType {
        self.ty
    }

    /// Sets the per-head offset that quantized formats subtract before quantizing, once per
    /// plane, to the mean of `rows` (whole rows, `n_head · head_dim` values each): the first
    /// rows written. Float formats and an already calibrated plane are left as they are. The
    /// offset stays for the life of the plane (rolled-back cells are rewritten with the same
    /// offset, so a rewrite gives the bytes it would have given without the rollback).
    ///
    /// Keys and values of real models share a large common part (Qwen2.5's K biases, massive
    /// activations in a few channels) that carries no information for attention but dominates
    /// the scale of every quantization block; stored without it, the quantization error shrinks
    /// with the part that matters. Attention adds the offset back exactly: `q·k = q·(k − m) +
    /// q·m`, and `Σ p·v = Σ p·(v − m) + m` because the weights sum to one.
    ///
    /// # Errors
    /// [`KvError::Shape`] when `rows` is not a positive whole number of rows.
    pub fn calibrate(&mut self, rows: &[f32]) -> Result<()> {
        let w = self.n_head * self.head_dim;
        if rows.is_empty() || !rows.len().is_multiple_of(w) {
            return Err(KvError::Shape(format!(
                "calibration rows of {} values, expected a positive multiple of {w}",
                rows.len()
            )));
        }
        if self.center.is_some() || matches!(self.ty, QType::F32 | QType::F16 | QType::BF16) {
            return Ok(());
        }
        let mut sum = vec![0.0f64; w];
        for r in rows.chunks_exact(w) {
            for (s, &x) in sum.iter_mut().zip(r) {
                *s += f64::from(x);
            }
        }
        #[allow(
            clippy::cast_precision_loss,
            clippy::cast_possible_truncation,
            reason = "a row count; the mean back to f32"
        )]
        let n = (rows.len() / w) as f64;
        #[allow(clippy::cast_possible_truncation, reason = "the mean back to f32")]
        let center = sum.iter().map(|s| (s / n) as f32).collect();
        self.center = Some(center);
        Ok(())
    }

    /// The offset of head `head` subtracted before quantization, if any.
    #[must_use]
    pub fn center(&self, head: usize) -> Option<&[f32]> {
        self.center
            .as_deref()
            .map(|c| &c[head * self.head_dim..(head + 1) * self.head_dim])
    }

    /// The rotation applied before quantization.
    #[must_use]
    pub fn rotation(&self) -> Rotation {
        self.rot
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

    /// Heads per cell.
    #[must_use]
    pub fn n_head(&self) -> usize {
        self.n_head
    }

    /// Cells.
    #[must_use]
    pub fn n_cells(&self) -> usize {
        self.n_cells
    }

    /// Every byte of the plane (head-major, then cell).
    #[must_use]
    pub fn bytes(&self) -> &[u8] {
        &bytemuck::cast_slice::<u64, u8>(&self.words)[..self.n_cells * self.row_bytes()]
    }

    /// Head `head` of cells `cell0..`, to the last cell: one head's stored bytes after another
    /// (`head_bytes` apart), as attention's tile loops read them in place.
    ///
    /// # Panics
    /// If `cell0` or `head` is out of range.
    #[must_use]
    pub fn head_cells(&self, head: usize, cell0: usize) -> &[u8] {
        assert!(
            cell0 < self.n_cells && head < self.n_head,
            "KV plane: cell {cell0} head {head} out of range"
        );
        let hb = self.head_bytes;
        &self.bytes()[(head * self.n_cells + cell0) * hb..(head + 1) * self.n_cells * hb]
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
        let off = (head * self.n_cells + cell) * self.head_bytes;
        &self.bytes()[off..off + self.head_bytes]
    }

    /// A copy of the stored bytes of `cell`, head after head.
    ///
    /// # Panics
    /// If `cell` is out of range.
    #[must_use]
    pub fn cell_bytes(&self, cell: usize) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.row_bytes());
        for h in 0..self.n_head {
            out.extend_from_slice(self.head(cell, h));
        }
        out
    }

    /// The bytes of head `head` of `cell` in `bytes` (a plane's bytes, head-major).
    fn head_range(&self, cell: usize, head: usize) -> std::ops::Range<usize> {
        let off = (head * self.n_cells + cell) * self.head_bytes;
        off..off + self.head_bytes
    }

    /// Writes `src` (the bytes of one cell, head after head) into `cell`.
    fn put_cell(&mut self, cell: usize, src: &[u8]) {
        let hb = self.head_bytes;
        for h in 0..self.n_head {
            let r = self.head_range(cell, h);
            bytemuck::cast_slice_mut::<u64, u8>(&mut self.words)[r]
                .copy_from_slice(&src[h * hb..(h + 1) * hb]);
        }
    }

    /// The encoder of this plane's rows (its format, rotation, padding and offset).
    fn encoder(&self) -> RowEncoder<'_> {
        RowEncoder {
            ty: self.ty,
            rot: self.rot,
            n_head: self.n_head,
            head_dim: self.head_dim,
            dim: self.dim,
            head_bytes: self.head_bytes,
            center: self.center.as_deref(),
        }
    }

    /// Quantizes one row (`n_head · head_dim` values) into `cell` with [`RowEncoder::encode`].
    /// `pad` is scratch space.
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
        let mut buf = vec![0u8; self.row_bytes()];
        self.encoder().encode(row, &mut buf, pad)?;
        self.put_cell(cell, &buf);
        Ok(())
    }

    /// The encoder of this plane's rows and the bytes of `cells` (in that order; each cell's
    /// heads in order), so that rows can be written into different cells at the same time.
    ///
    /// # Errors
    /// [`KvError::Shape`] when a cell is out of range or named twice.
    pub fn encoder_and_cells(
        &mut self,
        cells: &[usize],
    ) -> Result<(RowEncoder<'_>, Vec<Vec<&mut [u8]>>)> {
        let (hb, n_cells, n_head) = (self.head_bytes, self.n_cells, self.n_head);
        let mut order: Vec<usize> = (0..cells.len()).collect();
        order.sort_unstable_by_key(|&i| cells[i]);
        let mut next = 0;
        for &i in &order {
            let c = cells[i];
            if c < next || c >= n_cells {
                return Err(KvError::Shape(format!(
                    "cell {c} of a {n_cells}-cell cache (or named twice)"
                )));
            }
            next = c + 1;
        }
        let enc = RowEncoder {
            ty: self.ty,
            rot: self.rot,
            n_head,
            head_dim: self.head_dim,
            dim: self.dim,
            head_bytes: hb,
            center: self.center.as_deref(),
        };
        let mut out: Vec<Vec<&mut [u8]>> = (0..cells.len())
            .map(|_| Vec::with_capacity(n_head))
            .collect();
        let bytes =
            &mut bytemuck::cast_slice_mut::<u64, u8>(&mut self.words)[..n_cells * n_head * hb];
        if hb > 0 && n_cells > 0 {
            for head in bytes.chunks_exact_mut(n_cells * hb) {
                let mut it = head.chunks_exact_mut(hb);
                let mut next = 0;
                for &i in &order {
                    let c = cells[i];
                    if let Some(d) = it.nth(c - next) {
                        out[i].push(d);
                    }
                    next = c + 1;
                }
            }
        }
        Ok((enc, out))
    }

    /// Copies the bytes of `cells` (a checkpoint of the cells a write is about to overwrite,
    /// for [`Plane::restore`]).
    ///
    /// # Errors
    /// [`KvError::Shape`] when a cell is out of range.
    pub fn save(&self, cells: &[usize]) -> Result<SavedCells> {
        let rb = self.row_bytes();
        let mut bytes = Vec::with_capacity(cells.len() * rb);
        for &c in cells {
            if c >= self.n_cells {
                return Err(KvError::Shape(format!(
                    "saving cell {c} of a {}-cell cache",
                    self.n_cells
                )));
            }
            bytes.extend_from_slice(&self.cell_bytes(c));
        }
        Ok(SavedCells {
            cells: cells.to_vec(),
            row_bytes: rb,
            bytes,
        })
    }

    /// Writes back the bytes [`Plane::save`] copied.
    ///
    /// # Errors
    /// [`KvError::Shape`] when `saved` comes from a plane with other rows or more cells.
    pub fn restore(&mut self, saved: &SavedCells) -> Result<()> {
        let rb = self.row_bytes();
        if saved.row_bytes != rb || saved.cells.iter().any(|&c| c >= self.n_cells) {
            return Err(KvError::Shape(format!(
                "restoring cells of {}-byte rows into a {}-cell plane of {rb}-byte rows",
                saved.row_bytes, self.n_cells
            )));
        }
        for (&c, src) in saved.cells.iter().zip(saved.bytes.chunks_exact(rb.max(1))) {
            self.put_cell(c, src);
        }
        Ok(())
    }

    /// Appends the state of cells `0..n` to `out`, for [`Plane::import_prefix`] into a plane of
    /// the same shape (a slot saved to a file): a flag byte and the per-head offset of
    /// [`Plane::calibrate`] when there is one (little-endian f32s), then the cells' bytes, cell
    /// after cell (each cell's heads in order, whatever the layout in memory).
    ///
    /// # Errors
    /// [`KvError::Shape`] when `n` is past the plane's cells.
    pub fn export_prefix(&self, n: usize, out: &mut Vec<u8>) -> Result<()> {
        if n > self.n_cells {
            return Err(KvError::Shape(format!(
                "exporting {n} cells of a {}-cell plane",
                self.n_cells
            )));
        }
        match &self.center {
            Some(c) => {
                out.push(1);
                for x in c {
                    out.extend_from_slice(&x.to_le_bytes());
                }
            }
            None => out.push(0),
        }
        out.reserve(n * self.row_bytes());
        for c in 0..n {
            for h in 0..self.n_head {
                out.extend_from_slice(self.head(c, h));
            }
        }
        Ok(())
    }

    /// Reads what [`Plane::export_prefix`] wrote for `n` cells from the front of `bytes` into
    /// cells `0..n` (and the offset, for a plane not yet calibrated), and returns the bytes it
    /// read. The cells past `n` are left as they are (they hold no position).
    ///
    /// # Errors
    /// [`KvError::Shape`] when `n` is past the plane's cells, `bytes` is shorter than the
    /// state of `n` cells of this plane or holds a bad flag (not written by this plane's
    /// shape), or the plane is calibrated with another offset than the saved one.
    pub fn import_prefix(&mut self, n: usize, bytes: &[u8]) -> Result<usize> {
        if n > self.n_cells {
            return Err(KvError::Shape(format!(
                "importing {n} cells into a {}-cell plane",
                self.n_cells
            )));
        }
        let w = self.n_head * self.head_dim;
        let (center, mut off) = match bytes.first() {
            Some(0) => (None, 1),
            Some(1) => {
                let end = 1 + 4 * w;
                let raw = bytes.get(1..end).ok_or_else(|| {
                    KvError::Shape(format!(
                        "a saved plane offset needs {} bytes, {} are left",
                        4 * w,
                        bytes.len() - 1
                    ))
                })?;
                let c: Vec<f32> = raw
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect();
                (Some(c), end)
            }
            Some(f) => {
                return Err(KvError::Shape(format!(
                    "a saved plane starts with flag {f}, expected 0 or 1"
                )));
            }
            None => return Err(KvError::Shape("a saved plane is empty".into())),
        };
        // The cells were quantized around the saved offset; a plane calibrated otherwise (the
        // same formats with another context: `specula_engine` calibrates per session) would
        // read them right but write the next rows differently from a plane that wrote them.
        if let (Some(have), Some(saved)) = (&self.center, &center)
            && have
                .iter()
                .map(|x| x.to_bits())
                .ne(saved.iter().map(|x| x.to_bits()))
        {
            return Err(KvError::Shape(
                "the saved plane was calibrated with another offset (saved from a cache of another context size?)".into(),
            ));
        }
        let rb = self.row_bytes();
        let len = n * rb;
        let cells = bytes.get(off..off + len).ok_or_else(|| {
            KvError::Shape(format!(
                "{n} saved cells need {len} bytes, {} are left",
                bytes.len() - off
            ))
        })?;
        for (c, src) in cells.chunks_exact(rb.max(1)).enumerate() {
            self.put_cell(c, src);
        }
        if self.center.is_none() {
            self.center = center;
        }
        off += len;
        Ok(off)
    }

    /// Dequantizes head `head` of `cell` into `out` (`dim` values, still in the rotated domain
    /// of [`Plane::rotation`]).
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

/// The bytes of some cells of a [`Plane`], saved before a write that overwrites them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SavedCells {
    cells: Vec<usize>,
    row_bytes: usize,
    bytes: Vec<u8>,
}

impl SavedCells {
    /// The cells saved.
    #[must_use]
    pub fn cells(&self) -> &[usize] {
        &self.cells
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

/// Encodes rows of one plane (its format, rotation, padding and offset); shared by threads.
#[derive(Clone, Copy, Debug)]
pub struct RowEncoder<'a> {
    ty: QType,
    rot: Rotation,
    n_head: usize,
    head_dim: usize,
    dim: usize,
    head_bytes: usize,
    center: Option<&'a [f32]>,
}

impl RowEncoder<'_> {
    /// Quantizes one row (`n_head · head_dim` values) into the bytes of one cell: each head
    /// minus its offset is rotated (a Hadamard rotation here; for turbo inside the quantizer,
    /// so `row` is in the model's domain), padded to the stored width (turbo:
    /// [`crate::turbo_pad`]) and encoded with the cache quantizer of the format (for IQ4_NL the
    /// `ntry = −1` reference ggml-cpu uses for caches); the codes of a padded turbo head are
    /// then refined against the head attention reads back (`refine.rs`), and a 64-value turbo
    /// head is encoded in two stages instead ([`crate::turbo_two_stage`]). `pad` is scratch.
    ///
    /// # Errors
    /// [`KvError::Shape`] when the row or the cell has the wrong length.
    pub fn encode(&self, row: &[f32], dst: &mut [u8], pad: &mut Vec<f32>) -> Result<()> {
        let hb = self.head_bytes;
        if dst.len() != self.n_head * hb {
            return Err(KvError::Shape(format!(
                "a row into {} bytes, expected {} heads of {hb}",
                dst.len(),
                self.n_head
            )));
        }
        let mut heads: Vec<&mut [u8]> = dst.chunks_exact_mut(hb.max(1)).collect();
        self.encode_heads(row, &mut heads, pad)
    }

    /// [`RowEncoder::encode`] into one destination per head (a cell of a head-major plane).
    ///
    /// # Errors
    /// [`KvError::Shape`] when the row, the number of heads or a head has the wrong length.
    pub fn encode_heads(
        &self,
        row: &[f32],
        dst: &mut [&mut [u8]],
        pad: &mut Vec<f32>,
    ) -> Result<()> {
        let (rot, ty, hd, dim, hb, nh) = (
            self.rot,
            self.ty,
            self.head_dim,
            self.dim,
            self.head_bytes,
            self.n_head,
        );
        if row.len() != nh * hd || dst.len() != nh || dst.iter().any(|d| d.len() != hb) {
            return Err(KvError::Shape(format!(
                "a row of {} values into {} heads, expected {nh} heads × {hd} into {hb} bytes each",
                row.len(),
                dst.len(),
            )));
        }
        pad.clear();
        pad.resize(dim, 0.0);
        for (h, (src, dst)) in row.chunks_exact(hd).zip(dst.iter_mut()).enumerate() {
            pad[..hd].copy_from_slice(src);
            if let Some(c) = self.center {
                for (p, m) in pad[..hd].iter_mut().zip(&c[h * hd..(h + 1) * hd]) {
                    *p -= m;
                }
            }
            match rot {
                Rotation::Hadamard(n) => hadamard(&mut pad[..hd], n),
                Rotation::Turbo if turbo_two_stage(ty, hd, dim).is_some() => {
                    crate::refine::encode_two_stage(ty, &pad[..hd], dst);
                    continue;
                }
                Rotation::Turbo => turbo_pad(pad, hd),
                Rotation::None => {}
            }
            quantize_head(ty, pad, dst)?;
            if rot == Rotation::Turbo && dim > hd {
                crate::refine::refine_turbo(ty, &pad[..hd], dst);
            }
        }
        Ok(())
    }
}
