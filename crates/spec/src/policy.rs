//! How many tokens to draft in a round, from measured acceptance and measured costs.
//!
//! A round with a draft of `k` tokens commits `E(k) = 1 + Σ_{i<k} Π_{j≤i} a_j` tokens on
//! average (`a_j`: the measured chance that draft position `j` is accepted when reached) and
//! costs `v(k) + k·d` (`v(k)`: the target's forward over `k + 1` rows, `d`: drafting one
//! token). [`Adaptive`] picks the `k ≤ n_max` with the most tokens per second — `0`, a plain
//! decode step, when drafting does not pay — and keeps learning: `v(k)` from every round
//! (measured sizes directly, the others from a line fitted through the measured ones),
//! acceptance per position with a uniform prior, draft lengths that grow with what rounds
//! have kept, and a one-token probe draft every [`PROBE_EVERY`] plain steps (backing off while
//! probes keep nothing) so that a drafter that starts to fit again is noticed.

/// Plain steps between two probe drafts while drafting does not pay; the interval doubles
/// with each drafted round in a row that kept nothing, up to `PROBE_EVERY << MAX_BACKOFF`.
pub const PROBE_EVERY: usize = 16;

/// Most doublings of the probe interval.
pub const MAX_BACKOFF: u32 = 3;

/// Length of a probe draft.
pub const PROBE_LEN: usize = 1;

/// Weight of a new measurement in the cost averages.
const EMA: f64 = 0.2;

/// The adaptive draft-length policy.
#[derive(Clone, Debug)]
pub struct Adaptive {
    n_max: usize,
    /// `v(k)` averages (seconds), `None` until measured.
    verify: Vec<Option<f64>>,
    /// Seconds per drafted token.
    draft: Option<f64>,
    /// Rounds that reached / accepted each draft position.
    reached: Vec<f64>,
    kept: Vec<f64>,
    plain_streak: usize,
    /// Drafted rounds in a row that kept nothing (capped at [`MAX_BACKOFF`]).
    misses: u32,
    /// The most draft tokens any round has kept: drafts grow to at most twice this plus
    /// two, so that one lucky probe does not buy a full-length draft.
    best_kept: usize,
}

impl Adaptive {
    /// A policy that drafts at most `n_max` tokens.
    #[must_use]
    pub fn new(n_max: usize) -> Self {
        Self {
            n_max,
            verify: vec![None; n_max + 1],
            draft: None,
            reached: vec![0.0; n_max],
            kept: vec![0.0; n_max],
            plain_streak: 0,
            misses: 0,
            best_kept: 0,
        }
    }

    /// The upper bound.
    #[must_use]
    pub fn n_max(&self) -> usize {
        self.n_max
    }

    /// Chance that position `j` is accepted when reached: measured, with a uniform prior of
    /// one accepted out of two (a drafter that keeps being right is soon trusted, one
    /// lucky probe is not mistaken for a good drafter); a position
    /// never reached takes the estimate of the deepest one that was (acceptance changes slowly
    /// along a draft, and a probe only reaches the first positions).
    fn accept_at(&self, j: usize) -> f64 {
        let j = (0..=j).rev().find(|&i| self.reached[i] > 0.0).unwrap_or(j);
        (self.kept[j] + 1.0) / (self.reached[j] + 2.0)
    }

    /// Expected committed tokens of a round that drafts `k`.
    #[must_use]
    pub fn expected_tokens(&self, k: usize) -> f64 {
        let mut e = 1.0;
        let mut reach = 1.0;
        for j in 0..k.min(self.n_max) {
            reach *= self.accept_at(j);
            e += reach;
        }
        e
    }

    /// `v(k)`: measured, else from the line through the measured sizes (least squares), else
    /// `None` when nothing was measured yet.
    #[must_use]
    pub fn verify_cost(&self, k: usize) -> Option<f64> {
        if let Some(v) = self.verify.get(k).copied().flatten() {
            return Some(v);
        }
        let pts = || {
            self.verify
                .iter()
                .enumerate()
                .filter_map(|(k, v)| v.map(|v| (to_f64(k), v)))
        };
        let n = to_f64(pts().count());
        if n == 0.0 {
            return None;
        }
        let (sx, sy) = pts().fold((0.0, 0.0), |(a, b), p| (a + p.0, b + p.1));
        let (mx, my) = (sx / n, sy / n);
        if n == 1.0 {
            // One size measured: assume a verify row costs a tenth of a decode step more
            // (weights are streamed once per batch on a CPU).
            return Some(my * (1.0 + 0.1 * (to_f64(k) - mx)).max(0.5));
        }
        let sxx: f64 = pts().map(|p| (p.0 - mx) * (p.0 - mx)).sum();
        let sxy: f64 = pts().map(|p| (p.0 - mx) * (p.1 - my)).sum();
        let slope = if sxx > 0.0 { (sxy / sxx).max(0.0) } else { 0.0 };
        Some((my + slope * (to_f64(k) - mx)).max(1e-9))
    }

    /// The draft length for the next round, at most `room` (what context and budget allow).
    #[must_use]
    pub fn next(&self, room: usize) -> usize {
        let cap = self.n_max.min(room).min(2 * self.best_kept + 2);
        if cap == 0 {
            return 0;
        }
        let Some(v0) = self.verify_cost(0) else {
            // Nothing measured: a short draft, cheap to verify whatever the costs turn out
            // to be, starts the measurements.
            return cap.min(PROBE_LEN);
        };
        if self.verify.iter().skip(1).all(Option::is_none) {
            // Only plain steps measured: probe.
            return cap.min(PROBE_LEN);
        }
        let d = self.draft.unwrap_or(0.0);
        // A round that drafts `k` also brings the drafter up to date with the token the
        // target added last round: `k + 1` draft steps.
        let rate = |k: usize| {
            let steps = if k == 0 { 0.0 } else { to_f64(k + 1) };
            let cost = self.verify_cost(k).unwrap_or(v0) + steps * d;
            self.expected_tokens(k) / cost.max(1e-12)
        };
        let best = (0..=cap)
            .max_by(|&a, &b| rate(a).total_cmp(&rate(b)).then(b.cmp(&a)))
            .unwrap_or(0);
        if best == 0 && self.plain_streak >= PROBE_EVERY << self.misses {
            return cap.min(PROBE_LEN);
        }
        best
    }

    /// Records a round: a draft of `drafted` tokens (0 for a plain step), `accepted` of them
    /// kept, the target's forward took `verify_s` seconds and drafting `draft_s`, in which the
    /// drafter also caught up with `caught_up` tokens committed since it last drafted (a draft
    /// model runs them; an n-gram drafter does not care).
    pub fn record(
        &mut self,
        drafted: usize,
        accepted: usize,
        verify_s: f64,
        draft_s: f64,
        caught_up: usize,
    ) {
        let k = drafted.min(self.n_max);
        if let Some(slot) = self.verify.get_mut(k) {
            *slot = Some(slot.map_or(verify_s, |v| v + EMA * (verify_s - v)));
        }
        if drafted > 0 {
            let per = draft_s / to_f64(drafted + caught_up);
            self.draft = Some(self.draft.map_or(per, |d| d + EMA * (per - d)));
            for j in 0..k {
                self.reached[j] += 1.0;
                if j < accepted {
                    self.kept[j] += 1.0;
                }
            }
            self.plain_streak = 0;
            self.best_kept = self.best_kept.max(accepted);
            self.misses = if accepted == 0 {
                (self.misses + 1).min(MAX_BACKOFF)
            } else {
                0
            };
        } else {
            self.plain_streak += 1;
        }
    }
}

fn to_f64(n: usize) -> f64 {
    #[allow(clippy::cast_precision_loss, reason = "small counts")]
    let v = n as f64;
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drafts_fully_before_measuring_then_follows_the_numbers() {
        let mut p = Adaptive::new(8);
        assert_eq!(p.next(100), PROBE_LEN);
        assert_eq!(p.next(1), 1);
        assert_eq!(p.next(0), 0);
        // A cheap drafter that is always right: draft the most.
        for _ in 0..20 {
            p.record(8, 8, 0.012, 0.0, 1);
            p.record(0, 0, 0.010, 0.0, 0);
        }
        assert_eq!(p.next(100), 8);
    }

    #[test]
    fn stops_drafting_when_nothing_is_accepted_and_probes_later() {
        let mut p = Adaptive::new(8);
        for _ in 0..30 {
            p.record(4, 0, 0.014, 0.002, 1);
        }
        p.record(0, 0, 0.010, 0.0, 0);
        assert_eq!(p.next(100), 0);
        // Every drafted round kept nothing: the probe interval has backed off to its longest.
        for _ in 1..=PROBE_EVERY {
            p.record(0, 0, 0.010, 0.0, 0);
        }
        assert_eq!(
            p.next(100),
            0,
            "no probe after only {PROBE_EVERY} plain steps"
        );
        for _ in PROBE_EVERY + 1..PROBE_EVERY << MAX_BACKOFF {
            p.record(0, 0, 0.010, 0.0, 0);
        }
        assert_eq!(p.next(100), PROBE_LEN);
        // A probe that keeps its token shortens the interval again.
        p.record(1, 1, 0.011, 0.002, 1);
        for _ in 0..PROBE_EVERY {
            p.record(0, 0, 0.010, 0.0, 0);
        }
        assert_eq!(p.next(100), PROBE_LEN);
    }

    #[test]
    fn expected_tokens_grow_with_acceptance() {
        let mut p = Adaptive::new(4);
        assert!((p.expected_tokens(0) - 1.0).abs() < 1e-12);
        for _ in 0..100 {
            p.record(4, 4, 0.01, 0.0, 1);
        }
        assert!(p.expected_tokens(4) > 4.5);
        let v = p.verify_cost(2).unwrap();
        assert!(v > 0.0);
    }
}
