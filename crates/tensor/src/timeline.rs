//! The positions of a recurrent state over time, shared by every backend's recurrent layers
//! ([`RecurrentLayers`](crate::RecurrentLayers)): which positions a forward may start at, and
//! where the state of each comes from. The backend keeps the states themselves (the current
//! one, the one before the latest forward, the snapshots) and copies them as this says.
//!
//! A forward of `rows` rows started at `pos` keeps the state before it and the states after its
//! last rows — after row `i` when `rows − 1 − i ≤ keep`, in slot `rows − 2 − i` (the final
//! state is the current one). A rejected draft tail is then taken back by selecting one of
//! them, with nothing replayed.

/// Where the state for a forward's first position comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StateSource {
    /// The current state is already there.
    Current,
    /// The zero state (position 0).
    Zero,
    /// The state before the latest forward.
    Before,
    /// A snapshot slot.
    Snapshot(usize),
}

/// The positions of one recurrent state (see the module docs).
#[derive(Clone, Debug)]
pub struct StateTimeline {
    /// Positions the current state has seen.
    n: usize,
    /// Start of the latest forward (the state before it is kept).
    start: usize,
    /// Per snapshot slot, the position whose state it holds (`usize::MAX`: none).
    snaps: Vec<usize>,
    /// Snapshots a forward keeps at most.
    keep: usize,
}

impl StateTimeline {
    /// A timeline at position 0 that keeps `keep` snapshots per forward.
    #[must_use]
    pub fn new(keep: usize) -> Self {
        Self {
            n: 0,
            start: 0,
            snaps: Vec::new(),
            keep,
        }
    }

    /// Positions the current state has seen.
    #[must_use]
    pub fn position(&self) -> usize {
        self.n
    }

    /// Snapshots a forward keeps at most.
    #[must_use]
    pub fn keep(&self) -> usize {
        self.keep
    }

    /// Where the state at `pos` comes from, or `None` when it is not kept.
    #[must_use]
    pub fn source(&self, pos: usize) -> Option<StateSource> {
        if pos == self.n {
            Some(StateSource::Current)
        } else if pos == 0 {
            Some(StateSource::Zero)
        } else if pos == self.start {
            Some(StateSource::Before)
        } else {
            self.snaps
                .iter()
                .position(|&p| p == pos)
                .map(StateSource::Snapshot)
        }
    }

    /// Whether a forward may start at `pos`.
    #[must_use]
    pub fn holds(&self, pos: usize) -> bool {
        self.source(pos).is_some()
    }

    /// Starts a forward of `rows` rows at `pos`, once the caller has made the current state
    /// that of `pos` ([`StateTimeline::source`]) and kept it as the state before the forward.
    /// Returns how many snapshot slots the forward fills.
    pub fn begin(&mut self, pos: usize, rows: usize) -> usize {
        self.n = pos;
        self.start = pos;
        let want = rows.saturating_sub(1).min(self.keep);
        self.snaps.clear();
        self.snaps.resize(want, usize::MAX);
        want
    }

    /// The slot that keeps the state after row `i` (0-based) of a forward of `rows` rows.
    #[must_use]
    pub fn slot(i: usize, rows: usize, keep: usize) -> Option<usize> {
        (i + 1 < rows && rows - 1 - i <= keep).then(|| rows - 2 - i)
    }

    /// Records row `i` of a forward of `rows` rows done; returns the slot its state goes to.
    pub fn after_row(&mut self, i: usize, rows: usize) -> Option<usize> {
        self.n += 1;
        let slot = Self::slot(i, rows, self.keep)?;
        self.snaps[slot] = self.n;
        Some(slot)
    }

    /// Sets the timeline to a state after `n` positions with nothing else kept (a saved slot
    /// read back).
    pub fn reset_to(&mut self, n: usize) {
        self.n = n;
        self.start = n;
        self.snaps.clear();
    }

    /// The panic message of a forward asked to start at a position whose state is not kept.
    #[must_use]
    pub fn not_kept(&self, what: &str, pos: usize) -> String {
        format!(
            "{what}: no recurrent state is kept for position {pos} (it holds {}, the forward \
             before started at {}); the caller must replay from a kept one",
            self.n, self.start
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A forward of 5 rows keeps the state before it and after rows 2, 3, 4 (keep 3): a later
    /// forward may start at any of them, at the end, or at 0 — not in between.
    #[test]
    fn a_forward_keeps_the_positions_it_promises() {
        let mut t = StateTimeline::new(3);
        assert_eq!(t.begin(2, 5), 3);
        let slots: Vec<_> = (0..5).map(|i| t.after_row(i, 5)).collect();
        assert_eq!(slots, [None, Some(2), Some(1), Some(0), None]);
        assert_eq!(t.position(), 7);
        for (pos, src) in [
            (7, Some(StateSource::Current)),
            (0, Some(StateSource::Zero)),
            (2, Some(StateSource::Before)),
            (4, Some(StateSource::Snapshot(2))),
            (5, Some(StateSource::Snapshot(1))),
            (6, Some(StateSource::Snapshot(0))),
            (3, None),
            (8, None),
        ] {
            assert_eq!(t.source(pos), src, "position {pos}");
        }
        // A one-row forward keeps no snapshot.
        assert_eq!(t.begin(7, 1), 0);
        assert_eq!(t.after_row(0, 1), None);
        assert!(!t.holds(5) && t.holds(8) && t.holds(7));
    }
}
