//! Cell bookkeeping: which position and which sequences each cache cell holds, and the
//! sequence operations of llama.cpp's `llama_memory_seq_*` (`seq_rm`, `seq_cp`, `seq_keep`,
//! `seq_add`) on that metadata.
//!
//! Storage is separate ([`crate::Plane`]): removing a cell only marks it empty, and the next
//! write to it overwrites its bytes, so trimming then re-appending leaves the same bytes as
//! never having appended (each row is quantized on its own).

use specula_tensor::Mask;

use crate::{KvError, Result};

/// A sequence id (`0..MAX_SEQ`).
pub type SeqId = u32;

/// Sequences one cache can hold (the bits of a cell's sequence set).
pub const MAX_SEQ: u32 = 64;

/// Position and sequence set of every cell.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Cells {
    /// Position of each cell; meaningful only where `seqs != 0`.
    pos: Vec<i64>,
    /// Bit `s` set when the cell belongs to sequence `s`; 0 = empty.
    seqs: Vec<u64>,
    /// Accumulated position shift per cell since the last [`Cells::take_shifts`] (a K cache
    /// stored after RoPE must be re-rotated by this amount).
    shift: Vec<i64>,
}

fn bit(seq: SeqId) -> Result<u64> {
    if seq >= MAX_SEQ {
        return Err(KvError::Seq(format!("sequence id {seq} ≥ {MAX_SEQ}")));
    }
    Ok(1u64 << seq)
}

/// `[p0, p1)` with llama.cpp's conventions: a negative `p0` means 0, a negative `p1` means ∞.
fn in_range(p: i64, p0: i64, p1: i64) -> bool {
    let p1 = if p1 < 0 { i64::MAX } else { p1 };
    p >= p0.max(0) && p < p1
}

impl Cells {
    /// `n` empty cells.
    #[must_use]
    pub fn new(n: usize) -> Self {
        Self {
            pos: vec![0; n],
            seqs: vec![0; n],
            shift: vec![0; n],
        }
    }

    /// Number of cells.
    #[must_use]
    pub fn len(&self) -> usize {
        self.pos.len()
    }

    /// Whether there are no cells at all.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.pos.is_empty()
    }

    /// Cells in use.
    #[must_use]
    pub fn used(&self) -> usize {
        self.seqs.iter().filter(|&&s| s != 0).count()
    }

    /// The position of `cell`, or `None` when it is empty.
    #[must_use]
    pub fn pos(&self, cell: usize) -> Option<i64> {
        (self.seqs[cell] != 0).then_some(self.pos[cell])
    }

    /// Whether `cell` belongs to `seq`.
    #[must_use]
    pub fn has_seq(&self, cell: usize, seq: SeqId) -> bool {
        seq < MAX_SEQ && self.seqs[cell] & (1 << seq) != 0
    }

    /// The first `n` empty cells, in index order.
    ///
    /// # Errors
    /// [`KvError::Full`] when fewer than `n` cells are empty.
    pub fn find_slots(&self, n: usize) -> Result<Vec<usize>> {
        let free: Vec<usize> = (0..self.len())
            .filter(|&c| self.seqs[c] == 0)
            .take(n)
            .collect();
        if free.len() < n {
            return Err(KvError::Full {
                needed: n,
                free: free.len(),
                n_cells: self.len(),
            });
        }
        Ok(free)
    }

    /// Records that `cell` now holds position `pos` of `seq` (its previous content is gone).
    ///
    /// # Errors
    /// An out-of-range cell or sequence id.
    pub fn assign(&mut self, cell: usize, pos: i64, seq: SeqId) -> Result<()> {
        let b = bit(seq)?;
        if cell >= self.len() {
            return Err(KvError::Shape(format!(
                "cell {cell} of a {}-cell cache",
                self.len()
            )));
        }
        self.pos[cell] = pos;
        self.seqs[cell] = b;
        self.shift[cell] = 0;
        Ok(())
    }

    /// Removes positions `[p0, p1)` of `seq` (every sequence when `None`); cells left with no
    /// sequence become empty.
    ///
    /// # Errors
    /// An out-of-range sequence id.
    pub fn seq_rm(&mut self, seq: Option<SeqId>, p0: i64, p1: i64) -> Result<()> {
        let mask = match seq {
            Some(s) => bit(s)?,
            None => u64::MAX,
        };
        for c in 0..self.len() {
            if self.seqs[c] & mask != 0 && in_range(self.pos[c], p0, p1) {
                self.seqs[c] &= !mask;
            }
        }
        Ok(())
    }

    /// Adds `dst` to every cell of `src` with a position in `[p0, p1)` (the cells are shared,
    /// not copied).
    ///
    /// # Errors
    /// An out-of-range sequence id.
    pub fn seq_cp(&mut self, src: SeqId, dst: SeqId, p0: i64, p1: i64) -> Result<()> {
        let (s, d) = (bit(src)?, bit(dst)?);
        for c in 0..self.len() {
            if self.seqs[c] & s != 0 && in_range(self.pos[c], p0, p1) {
                self.seqs[c] |= d;
            }
        }
        Ok(())
    }

    /// Drops every sequence but `seq`.
    ///
    /// # Errors
    /// An out-of-range sequence id.
    pub fn seq_keep(&mut self, seq: SeqId) -> Result<()> {
        let b = bit(seq)?;
        for s in &mut self.seqs {
            *s &= b;
        }
        Ok(())
    }

    /// Adds `delta` to the positions `[p0, p1)` of `seq`; cells moved below position 0 are
    /// removed from it. Only cells that belong to `seq` alone are moved (a shared cell cannot
    /// have two positions): shared cells are an error.
    ///
    /// # Errors
    /// An out-of-range sequence id, or a shared cell in the range.
    pub fn seq_add(&mut self, seq: SeqId, p0: i64, p1: i64, delta: i64) -> Result<()> {
        let b = bit(seq)?;
        let hits: Vec<usize> = (0..self.len())
            .filter(|&c| self.seqs[c] & b != 0 && in_range(self.pos[c], p0, p1))
            .collect();
        if let Some(&c) = hits.iter().find(|&&c| self.seqs[c] != b) {
            return Err(KvError::Seq(format!(
                "seq_add: cell {c} (position {}) is shared with other sequences",
                self.pos[c]
            )));
        }
        for c in hits {
            self.pos[c] += delta;
            self.shift[c] += delta;
            if self.pos[c] < 0 {
                self.seqs[c] = 0;
            }
        }
        Ok(())
    }

    /// The cells moved by [`Cells::seq_add`] since the last call and how far (the RoPE shift
    /// their K rows need); clears the record.
    pub fn take_shifts(&mut self) -> Vec<(usize, i64)> {
        let out = (0..self.len())
            .filter(|&c| self.shift[c] != 0 && self.seqs[c] != 0)
            .map(|c| (c, self.shift[c]))
            .collect();
        self.shift.fill(0);
        out
    }

    /// The largest position of `seq`, or `None` if it has no cell.
    #[must_use]
    pub fn seq_pos_max(&self, seq: SeqId) -> Option<i64> {
        (0..self.len())
            .filter(|&c| self.has_seq(c, seq))
            .map(|c| self.pos[c])
            .max()
    }

    /// The smallest position of `seq`, or `None` if it has no cell.
    #[must_use]
    pub fn seq_pos_min(&self, seq: SeqId) -> Option<i64> {
        (0..self.len())
            .filter(|&c| self.has_seq(c, seq))
            .map(|c| self.pos[c])
            .min()
    }

    /// Whether a query of `seq` at position `q_pos` sees `cell` under `mask`.
    #[must_use]
    pub fn visible(&self, cell: usize, seq: SeqId, q_pos: i64, mask: Mask) -> bool {
        if !self.has_seq(cell, seq) {
            return false;
        }
        let k = self.pos[cell];
        match mask {
            Mask::Causal => k <= q_pos,
            Mask::SlidingWindow(w) => k <= q_pos && usize::try_from(q_pos - k).is_ok_and(|d| d < w),
            Mask::None => true,
        }
    }

    /// Whether removing the positions `≥ p` of `seq` (`seq_rm(seq, p, -1)`) leaves everything
    /// a query of `seq` at position `p` should see under `mask`: every position of
    /// `[p − window + 1, p)` for a sliding window, of `[0, p)` otherwise. It does not when
    /// [`Cells::prune_swa`] freed cells for positions past `p` that the rows being removed had
    /// pushed out of the window: those cells are gone, and only a checkpoint taken before the
    /// rows were appended brings them back. Positions are assumed unique within a sequence.
    #[must_use]
    pub fn can_trim_to(&self, seq: SeqId, p: i64, mask: Mask) -> bool {
        let lo = match mask {
            Mask::SlidingWindow(w) => (p + 1 - i64::try_from(w).unwrap_or(i64::MAX)).max(0),
            Mask::Causal | Mask::None => 0,
        };
        let held = (0..self.len())
            .filter(|&c| self.has_seq(c, seq) && (lo..p).contains(&self.pos[c]))
            .count();
        i64::try_from(held).is_ok_and(|h| h == (p - lo).max(0))
    }

    /// Sliding-window sub-cache upkeep: frees the cells of `seq` that no query at a position
    /// `≥ pos_max` can see through a window of `window` positions (llama.cpp's SWA pruning).
    /// Returns how many cells were freed.
    ///
    /// Pruning keeps no margin: with `pos_max` the last position of a batch, the cells that
    /// batch pushed out of the window are freed, so removing its rows again (a rejected draft)
    /// loses cells the next query needs — [`Cells::can_trim_to`] tells, and the cache must be
    /// restored from a checkpoint instead (`tests.rs`, `swa_prune_then_trim_loses_cells`).
    /// Pruning against the *first* position of the batch keeps every cell a trim back into the
    /// batch needs (llama.cpp's `n_swa + n_ubatch` cells).
    ///
    /// # Errors
    /// An out-of-range sequence id.
    pub fn prune_swa(&mut self, seq: SeqId, pos_max: i64, window: usize) -> Result<usize> {
        let b = bit(seq)?;
        let w = i64::try_from(window).unwrap_or(i64::MAX);
        let mut n = 0;
        for c in 0..self.len() {
            if self.seqs[c] & b != 0 && pos_max - self.pos[c] >= w {
                self.seqs[c] &= !b;
                n += 1;
            }
        }
        Ok(n)
    }
}
