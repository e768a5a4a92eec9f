//! Taking back the rows of a rejected draft tail: a trim where the memory can, else a
//! checkpoint taken before the verify forward, restored, and the accepted rows run again.
//!
//! A [`Session`]'s cache keeps one cell per position in its global layers, so dropping the rows
//! past a position leaves exactly the cache plain decoding would have. Sliding-window layers
//! keep one too with `--swa-full`; by default they keep a ring of `window + n_batch` cells
//! where position `p` overwrites `p − ring`. A trim to `n` is then exact only while the ring
//! still holds the positions `n − window + 1 .. n` a query at `n` sees: with `m` the highest
//! position written, exactly when `n` is 0 or `max(0, n − window + 1) + ring > m` — for
//! `n ≥ window − 1`, when `m − n ≤ ring − window` (writing position `p` overwrote `p − ring`,
//! and the oldest position the window needs is `n − window + 1`).
//! [`Session::can_trim_to`] checks the ring cell by cell. Every forward writes at most
//! `ring − window` rows, aligned to the end of a batch, so taking back rows of the last forward
//! (a rejected draft tail) is always a trim; going further back, [`Engine::rewind`] runs again
//! from the latest position whose window the ring still holds, or from the start.
//!
//! [`Rollback::Replay`] exists for memories that lose state when rows are appended — a
//! sliding-window cache that prunes (see `specula_kv::Cells::can_trim_to`), recurrent layers —
//! and can be forced on any session ([`Session::force_replay`]) to test that path: the output
//! must not change, the kernels being batch-invariant (a replayed row has the bits of the
//! verify row).

use specula_kv::Rollback;
use specula_tensor::Backend;

use crate::{Engine, EngineError, Result, Session};

/// The state of a [`Session`] before a forward that may be partly taken back
/// ([`Session::checkpoint`]). The cache writes only the cells past its positions, so for
/// attention KV the checkpoint is the number of positions; a memory that overwrites cells
/// (pruning, wrapping, recurrent state) would add the bytes the forward overwrites.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Checkpoint {
    n_past: usize,
}

impl Checkpoint {
    /// Positions the session held when the checkpoint was taken.
    #[must_use]
    pub fn n_past(&self) -> usize {
        self.n_past
    }
}

/// What [`Engine::rewind`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rewound {
    /// Nothing to take back.
    Nothing,
    /// The rows past the position were dropped.
    Trimmed,
    /// A checkpoint (or the empty cache) was restored and this many rows were run again.
    Replayed(usize),
}

impl<B: Backend> Session<B> {
    /// How this session's memory takes back rows ([`Rollback::Trim`] unless forced).
    #[must_use]
    pub fn rollback(&self) -> Rollback {
        self.rollback
    }

    /// Rolls back by checkpoint and replay from now on, although the cache could trim: the
    /// slower path, for testing that it gives the output of plain decoding
    /// (`--spec-rollback replay`).
    pub fn force_replay(&mut self) {
        self.rollback = Rollback::Replay;
    }

    /// Whether [`Session::truncate`] to `n` positions leaves exactly the cache plain decoding
    /// of those `n` positions would have: when nothing is taken back; otherwise for a trimming
    /// memory whose sliding-window ring (if any) still holds the positions `n − window + 1 ..
    /// n` — not when later rows overwrote them (see the module's notes).
    #[must_use]
    pub fn can_trim_to(&self, n: usize) -> bool {
        n >= self.n_past
            || match self.rollback {
                Rollback::Trim => self.window_intact(n),
                // A recurrent state kept for `n` (a snapshot, or the one before the latest
                // forward); the attention layers beside it trim.
                Rollback::Snapshot => self.recurrent_holds(n),
                Rollback::Replay => false,
            }
    }

    /// Whether the recurrent layers (if any) can continue from position `n`.
    fn recurrent_holds(&self, n: usize) -> bool {
        self.recurrent.as_ref().is_none_or(|r| r.holds(n))
    }

    /// Whether the sliding-window ring (if any) holds every position a query at `n` sees.
    fn window_intact(&self, n: usize) -> bool {
        self.ring.as_ref().is_none_or(|r| r.window_intact(n))
    }

    /// The state to come back to if the rows of the next forward are taken back.
    #[must_use]
    pub fn checkpoint(&self) -> Checkpoint {
        Checkpoint {
            n_past: self.n_past,
        }
    }

    /// Returns to the state of `ck`, taken on this session with only appends since.
    ///
    /// # Errors
    /// [`EngineError::StaleCheckpoint`] when the session no longer holds the positions the
    /// checkpoint holds (it was trimmed or reset below them since, or its sliding-window ring
    /// has overwritten them).
    pub fn restore(&mut self, ck: &Checkpoint) -> Result<()> {
        if ck.n_past > self.n_past
            || !self.window_intact(ck.n_past)
            || !self.recurrent_holds(ck.n_past)
        {
            return Err(EngineError::StaleCheckpoint {
                checkpoint: ck.n_past,
                n_past: self.n_past,
            });
        }
        self.n_past = ck.n_past;
        Ok(())
    }

    /// Empties the cache (any memory can).
    pub fn reset(&mut self) {
        self.n_past = 0;
        if let Some(r) = &mut self.ring {
            r.clear();
        }
    }
}

impl<B: Backend> Engine<B> {
    /// Takes `s` back to its first `n` positions. A memory that can trim drops the rows past
    /// `n`; one that cannot is restored to `ck` — or, for a sliding-window ring that overwrote
    /// what a trim to `n` needs, trimmed to the latest position of `tail` whose window it still
    /// holds; else emptied — and the positions from there to `n` run again. `tail` holds the
    /// ids of positions `n − tail.len() .. n`; it must reach back to where the replay starts.
    ///
    /// # Errors
    /// [`EngineError::Rewind`] when a replay needs ids `tail` does not have; errors of the
    /// replayed forward.
    pub fn rewind(
        &self,
        s: &mut Session<B>,
        n: usize,
        ck: Option<&Checkpoint>,
        tail: &[u32],
    ) -> Result<Rewound> {
        if n >= s.n_past {
            return Ok(Rewound::Nothing);
        }
        if s.can_trim_to(n) {
            s.truncate(n);
            return Ok(Rewound::Trimmed);
        }
        let known = n.saturating_sub(tail.len());
        let ck_from = ck
            .filter(|c| {
                c.n_past <= n
                    && c.n_past <= s.n_past
                    && s.window_intact(c.n_past)
                    && s.recurrent_holds(c.n_past)
            })
            .map(|c| c.n_past);
        let ring_from = if s.rollback == Rollback::Trim && s.ring.is_some() {
            (known..n).rev().find(|&f| s.window_intact(f))
        } else {
            None
        };
        let from = ck_from.max(ring_from).unwrap_or(0);
        if from < known {
            return Err(EngineError::Rewind { to: n, from, known });
        }
        match ck {
            _ if ring_from == Some(from) => s.n_past = from,
            Some(c) if c.n_past == from => s.restore(c)?,
            _ => s.reset(),
        }
        let ids = &tail[from - known..];
        if !ids.is_empty() {
            let mut none = Vec::new();
            self.prefill_into(s, ids, ids.len(), &mut none)?;
        }
        Ok(Rewound::Replayed(ids.len()))
    }
}
