//! Acceptance statistics, counted once per verified round.

/// Drafted and accepted tokens over the verified rounds of a generation.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SpecStats {
    /// Draft tokens sent to verification (llama-server's `draft_n`).
    pub drafted: usize,
    /// Draft tokens the target kept (`draft_n_accepted`).
    pub accepted: usize,
    /// Verified rounds with a non-empty draft.
    pub rounds: usize,
    /// `accepted_at[i]`: rounds that accepted draft position `i`.
    pub accepted_at: Vec<usize>,
    /// `drafted_at[i]`: rounds whose draft reached position `i`.
    pub drafted_at: Vec<usize>,
    /// Rounds whose rejected rows were taken back by checkpoint and replay instead of a trim
    /// (the target's memory cannot trim, or replay was forced).
    pub replays: usize,
    /// Rows those replays ran again.
    pub replayed: usize,
}

impl SpecStats {
    /// Records one verified round: a draft of `drafted` tokens of which `accepted` were kept.
    /// Empty drafts (a plain decode step) are not rounds.
    pub fn record(&mut self, drafted: usize, accepted: usize) {
        if drafted == 0 {
            return;
        }
        let accepted = accepted.min(drafted);
        self.drafted += drafted;
        self.accepted += accepted;
        self.rounds += 1;
        if self.drafted_at.len() < drafted {
            self.drafted_at.resize(drafted, 0);
            self.accepted_at.resize(drafted, 0);
        }
        for n in &mut self.drafted_at[..drafted] {
            *n += 1;
        }
        for n in &mut self.accepted_at[..accepted] {
            *n += 1;
        }
    }

    /// Records a rollback by replay that ran `rows` rows again.
    pub fn record_replay(&mut self, rows: usize) {
        self.replays += 1;
        self.replayed += rows;
    }

    /// Mean tokens per round: `1 + accepted / rounds` (llama.cpp's "mean acc len").
    #[must_use]
    pub fn mean_accept_len(&self) -> f64 {
        if self.rounds == 0 {
            return 0.0;
        }
        #[allow(clippy::cast_precision_loss, reason = "token counts as f64")]
        let v = 1.0 + self.accepted as f64 / self.rounds as f64;
        v
    }

    /// Accepted over drafted tokens.
    #[must_use]
    pub fn acceptance(&self) -> f64 {
        if self.drafted == 0 {
            return 0.0;
        }
        #[allow(clippy::cast_precision_loss, reason = "token counts as f64")]
        let v = self.accepted as f64 / self.drafted as f64;
        v
    }

    /// Per draft position: the share of rounds reaching it that accepted it.
    #[must_use]
    pub fn acceptance_by_position(&self) -> Vec<f64> {
        #[allow(clippy::cast_precision_loss, reason = "round counts as f64")]
        self.accepted_at
            .iter()
            .zip(&self.drafted_at)
            .map(|(&a, &d)| if d == 0 { 0.0 } else { a as f64 / d as f64 })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounds_positions_and_means_add_up() {
        let mut s = SpecStats::default();
        s.record(4, 2);
        s.record(2, 2);
        s.record(0, 0);
        s.record(3, 0);
        assert_eq!((s.drafted, s.accepted, s.rounds), (9, 4, 3));
        assert_eq!(s.drafted_at, vec![3, 3, 2, 1]);
        assert_eq!(s.accepted_at, vec![2, 2, 0, 0]);
        assert!((s.mean_accept_len() - (1.0 + 4.0 / 3.0)).abs() < 1e-12);
        // Accepted per position sums to the accepted tokens.
        assert_eq!(s.accepted_at.iter().sum::<usize>(), s.accepted);
        assert_eq!(s.acceptance_by_position()[0], 2.0 / 3.0);
    }
}
