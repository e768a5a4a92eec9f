//! The index tensors of one forward: token ids, positions, cache cells and row numbers, built
//! once from the host ([`Backend::set_index`]) and read by every layer, so that no layer
//! uploads anything (issue 16's device-resident contract).

use specula_tensor::Backend;

use crate::Ring;

/// `r` as an index (rows and cells of a batch or a cache, far below `u32::MAX`; a value that
/// does not fit saturates and is refused by the op that reads it).
pub(crate) fn index_of(r: usize) -> u32 {
    u32::try_from(r).unwrap_or(u32::MAX)
}

/// Fills the index `i` with `v`, staged through `host`.
pub(crate) fn stage<B: Backend>(
    be: &B,
    i: &mut B::Index,
    host: &mut Vec<u32>,
    v: impl Iterator<Item = u32>,
) {
    host.clear();
    host.extend(v);
    be.set_index(i, host);
}

/// The cells `0..kv_len` a sequence's queries read, where `kv_len` is one past its largest
/// position (cell = position).
fn kv_len(pos: &[u32]) -> u32 {
    pos.iter().max().map_or(0, |&m| m.saturating_add(1))
}

/// The index tensors of one sequence's rows in a forward.
#[derive(Debug)]
pub(crate) struct SeqIndex<B: Backend> {
    /// Its rows in the batch.
    pub rows: B::Index,
    /// Their positions; also their cells where cell = position.
    pub pos: B::Index,
    /// The positions of the cells its queries read (`0..kv_len`).
    pub kv_pos: B::Index,
    /// The ring cells of its rows in the sliding-window layers ([`Ring::cells`]).
    pub ring_cells: B::Index,
    /// The ring in position order ([`Ring::kv_pos`]).
    pub ring_kv_pos: B::Index,
}

impl<B: Backend> SeqIndex<B> {
    pub fn new(be: &B) -> Self {
        Self {
            rows: be.index(&[]),
            pos: be.index(&[]),
            kv_pos: be.index(&[]),
            ring_cells: be.index(&[]),
            ring_kv_pos: be.index(&[]),
        }
    }

    /// Rows `rows` of the batch at positions `pos` (with `ring` where the sliding-window
    /// layers keep one). `with_rows`: whether the rows are wanted (a batch of several
    /// sequences; a sequence alone is the whole batch).
    pub fn fill(
        &mut self,
        be: &B,
        host: &mut Vec<u32>,
        rows: Option<std::ops::Range<usize>>,
        pos: &[u32],
        ring: Option<&Ring<'_>>,
    ) {
        if let Some(rows) = rows {
            stage(be, &mut self.rows, host, rows.map(index_of));
        }
        be.set_index(&mut self.pos, pos);
        stage(be, &mut self.kv_pos, host, 0..kv_len(pos));
        if let Some(r) = ring {
            stage(
                be,
                &mut self.ring_cells,
                host,
                r.cells.iter().map(|&c| index_of(c)),
            );
            be.set_index(&mut self.ring_kv_pos, r.kv_pos);
        }
    }

    /// The cells layer rows go to and the positions of the cells they read: the ring's in a
    /// sliding-window layer of a ring cache (`ring`), else cell = position.
    pub fn cells(&self, ring: bool) -> (&B::Index, &B::Index) {
        if ring {
            (&self.ring_cells, &self.ring_kv_pos)
        } else {
            (&self.pos, &self.kv_pos)
        }
    }
}

/// The index tensors of a forward: the batch's tokens, positions and logits rows, and each
/// sequence's own (one sequence: `seqs[0]`, whose positions are the batch's).
#[derive(Debug)]
pub(crate) struct ForwardIndex<B: Backend> {
    pub tokens: B::Index,
    /// The batch's positions (several sequences; one sequence's are `seqs[0].pos`).
    pub pos: B::Index,
    pub logits: B::Index,
    pub seqs: Vec<SeqIndex<B>>,
    host: Vec<u32>,
}

impl<B: Backend> ForwardIndex<B> {
    pub fn new(be: &B) -> Self {
        Self {
            tokens: be.index(&[]),
            pos: be.index(&[]),
            logits: be.index(&[]),
            seqs: Vec::new(),
            host: Vec::new(),
        }
    }

    /// The tokens and the logits rows of the batch.
    pub fn fill_batch(&mut self, be: &B, tokens: &[u32], logits_rows: &[usize]) {
        be.set_index(&mut self.tokens, tokens);
        stage(
            be,
            &mut self.logits,
            &mut self.host,
            logits_rows.iter().map(|&r| index_of(r)),
        );
    }

    /// Sequence `i` (growing the list): its rows (when the batch holds several), positions and
    /// ring.
    pub fn fill_seq(
        &mut self,
        be: &B,
        i: usize,
        rows: Option<std::ops::Range<usize>>,
        pos: &[u32],
        ring: Option<&Ring<'_>>,
    ) {
        while self.seqs.len() <= i {
            self.seqs.push(SeqIndex::new(be));
        }
        self.seqs[i].fill(be, &mut self.host, rows, pos, ring);
    }
}
