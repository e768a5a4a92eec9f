//! How many tokens to draft in a round, from measured acceptance and measured costs.
//!
//! A round with a draft of `k` tokens commits `E(k) = 1 + Σ_{i<k} Π_{j≤i} a_j` tokens on
//! average (`a_j`: the measured chance that draft position `j` is accepted when reached) and
//! costs `v(k) + d(k)` (`v(k)`: the target's forward over `k + 1` rows, `d(k)`: drafting `k`
//! tokens). [`Adaptive`] picks the `k ≤ n_max` with the most tokens per second — `0`, a plain
//! decode step, when drafting does not pay — and keeps learning:
//! - `v(k)` and `d(k)` from every round, averaged so that a slow round moves them less than a
//!   fast one; between measured lengths on the line joining them, past the longest measured
//!   on the line through the two longest — or, for a drafter that ends its drafts where it is
//!   unsure (a draft model), `v` stays flat (optimistic: the batch cost curve bends, and trying
//!   a length corrects it) and the drafter gets the longest draft allowed whenever drafting
//!   pays;
//! - acceptance per position with a uniform prior;
//! - draft lengths that grow with what rounds have kept;
//! - a one-token probe draft every [`PROBE_EVERY`] plain steps (backing off while probes keep
//!   nothing or drafting still does not pay after them), so that a drafter that starts to fit
//!   again is noticed;
//! - probes are asked with a context window ([`PROBE_WINDOW`], [`crate::DraftParams::window`]):
//!   a drafter that keeps context of target positions (DFlash, EAGLE-3) then catches up with
//!   at most that many positions instead of every one since it last drafted, so that a drafter
//!   which does not pay costs a bounded amount per probe, not the whole context again;
//! - a drafter that is asked for a draft and declines (one that stops where it is unsure, not
//!   sure of even the first token: [`Adaptive::declined`]) is a probe that kept nothing, so it
//!   is asked again only after the backed-off interval, not every step.

/// Plain steps between two probe drafts while drafting does not pay; the interval doubles
/// with each drafted round in a row that kept nothing or after which drafting still did not
/// pay, up to `PROBE_EVERY << MAX_BACKOFF`.
pub const PROBE_EVERY: usize = 16;

/// Most doublings of the probe interval.
pub const MAX_BACKOFF: u32 = 3;

/// Length of a probe draft.
pub const PROBE_LEN: usize = 1;

/// Context window of a probe: the most committed positions a drafter catches up with to
/// answer it ([`crate::DraftParams::window`]).
pub const PROBE_WINDOW: usize = 32;

/// The policy's ask for the next round.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ask {
    /// Tokens to draft (0: a plain decode step).
    pub k: usize,
    /// A probe: drafting has not been shown to pay (yet, or any more), so the drafter may
    /// answer from a window of the context ([`PROBE_WINDOW`]).
    pub probe: bool,
}

impl Ask {
    /// The context window the drafter is asked with: [`PROBE_WINDOW`] for a probe.
    #[must_use]
    pub fn window(&self) -> Option<usize> {
        self.probe.then_some(PROBE_WINDOW)
    }
}

/// Weight of a new measurement in the cost averages when it is cheaper than the average…
const EMA_DOWN: f64 = 0.5;
/// …and when it is dearer. A busy machine only ever adds time, and one slow round (the first
/// batch of a size allocating its buffers, another process taking the core) must not price a
/// draft length out for good: such a length is not tried again, so its price would never be
/// corrected. A lasting slowdown still moves the average within a few rounds.
const EMA_UP: f64 = 0.1;

/// The adaptive draft-length policy.
#[derive(Clone, Debug)]
pub struct Adaptive {
    n_max: usize,
    /// `v(k)` averages (seconds), `None` until measured.
    verify: Vec<Option<f64>>,
    /// Seconds spent drafting in a round that drafted `k` tokens (the drafter catching up
    /// with the committed tokens included), `None` until measured.
    draft: Vec<Option<f64>>,
    /// Rounds that reached / accepted each draft position.
    reached: Vec<f64>,
    kept: Vec<f64>,
    plain_streak: usize,
    /// Drafted rounds in a row that kept nothing (capped at [`MAX_BACKOFF`]).
    misses: u32,
    /// The most draft tokens any round has kept: drafts grow to at most twice this plus
    /// two, so that one lucky probe does not buy a full-length draft.
    best_kept: usize,
    /// The drafter ends drafts where it is unsure ([`crate::Drafter::stops_when_unsure`]).
    self_limiting: bool,
}

impl Adaptive {
    /// A policy that drafts at most `n_max` tokens.
    #[must_use]
    pub fn new(n_max: usize) -> Self {
        Self {
            n_max,
            verify: vec![None; n_max + 1],
            draft: vec![None; n_max + 1],
            reached: vec![0.0; n_max],
            kept: vec![0.0; n_max],
            plain_streak: 0,
            misses: 0,
            best_kept: 0,
            self_limiting: false,
        }
    }

    /// For a drafter that ends each draft where it becomes unsure: when drafting pays, ask
    /// for the longest draft allowed (twice the most tokens a round kept, plus two) and let
    /// the drafter stop earlier, token by token. Its confidence says more about one draft than
    /// the policy's averages: on code, a draft model is sure of long runs and unsure of single
    /// tokens, and the averages would cut the long runs short.
    #[must_use]
    pub fn self_limiting(mut self, on: bool) -> Self {
        self.self_limiting = on;
        self
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

    /// `v(k)`: measured; between two measured sizes, on the line joining them; past the
    /// largest measured size, for a drafter that stops by itself ([`Adaptive::self_limiting`])
    /// that size's cost, else the line through the two largest (one measured size: a tenth of
    /// it more per row). The first is optimistic on purpose: a batch's cost grows more slowly
    /// per row the larger it is (weights are streamed once per batch; on a CPU the curve bends
    /// from about a third of a step per row to a fifth), so a line through short drafts
    /// overprices long ones, and a draft model sure of a long run would never be given the
    /// room; trying it measures it. A drafter that does not stop by itself fills whatever
    /// length it is given, so for it the cautious line. `None` when nothing was measured yet.
    #[must_use]
    pub fn verify_cost(&self, k: usize) -> Option<f64> {
        let below = lookup(&self.verify, k, Side::Below);
        let above = lookup(&self.verify, k, Side::Above);
        match (below, above) {
            (Some((a, va)), Some((b, vb))) if b > a => {
                Some(va + (vb - va) * to_f64(k - a) / to_f64(b - a))
            }
            (Some((a, va)), None) if a < k && !self.self_limiting => {
                let slope = match a
                    .checked_sub(1)
                    .and_then(|j| lookup(&self.verify, j, Side::Below))
                {
                    Some((b, vb)) => ((va - vb) / to_f64(a - b)).max(0.0),
                    None => 0.1 * va,
                };
                Some(va + slope * to_f64(k - a))
            }
            (Some((_, v)), _) | (None, Some((_, v))) => Some(v),
            (None, None) => None,
        }
    }

    /// Seconds to draft `k` tokens: measured; else on the line through the nearest measured
    /// sizes (drafting costs about the same per token), else proportional to the one measured
    /// size; `None` before any drafted round.
    #[must_use]
    pub fn draft_cost(&self, k: usize) -> Option<f64> {
        if k == 0 {
            return Some(0.0);
        }
        if let Some(d) = self.draft.get(k).copied().flatten() {
            return Some(d);
        }
        let measured: Vec<(usize, f64)> = self
            .draft
            .iter()
            .enumerate()
            .skip(1)
            .filter_map(|(k, d)| d.map(|d| (k, d)))
            .collect();
        let below = measured.iter().rev().find(|p| p.0 < k).copied();
        let above = measured.iter().find(|p| p.0 > k).copied();
        let (a, b) = match (below, above) {
            (Some(a), Some(b)) => (a, b),
            // Past the largest: the slope of the two largest.
            (Some(b), None) if measured.len() >= 2 => (measured[measured.len() - 2], b),
            // Below the smallest: the slope of the two smallest.
            (None, Some(a)) if measured.len() >= 2 => (a, measured[1]),
            (Some((m, d)), None) | (None, Some((m, d))) => {
                return Some(d * to_f64(k) / to_f64(m));
            }
            (None, None) => return None,
        };
        let slope = ((b.1 - a.1) / to_f64(b.0 - a.0)).max(0.0);
        Some((a.1 + slope * (to_f64(k) - to_f64(a.0))).max(0.0))
    }

    /// The draft length for the next round, at most `room` (what context and budget allow).
    #[must_use]
    pub fn next(&self, room: usize) -> usize {
        self.ask(room).k
    }

    /// The next round's ask: its draft length, at most `room` (what context and budget
    /// allow), and whether it is a probe.
    #[must_use]
    pub fn ask(&self, room: usize) -> Ask {
        let plain = Ask { k: 0, probe: false };
        let probe = |cap: usize| Ask {
            k: cap.min(PROBE_LEN),
            probe: true,
        };
        let cap = self.n_max.min(room).min(2 * self.best_kept + 2);
        if cap == 0 {
            return plain;
        }
        if self.verify.iter().all(Option::is_none) {
            // Nothing measured: a short draft, cheap to verify whatever the costs turn out to
            // be, starts the measurements.
            return probe(cap);
        }
        if self.verify[0].is_none() {
            // What drafting is compared with: a plain step.
            return plain;
        }
        if self.verify.iter().skip(1).all(Option::is_none) {
            // Only plain steps measured: probe, at once the first time, then at the
            // backed-off interval while the drafter declines.
            let due = self.misses == 0 || self.plain_streak >= PROBE_EVERY << self.misses;
            return if due { probe(cap) } else { plain };
        }
        let best = self.best(cap);
        if best == 0 && self.plain_streak >= PROBE_EVERY << self.misses {
            return probe(cap);
        }
        let k = if best > 0 && self.self_limiting {
            cap
        } else {
            best
        };
        Ask { k, probe: false }
    }

    /// The draft length up to `cap` with the most committed tokens per second by the
    /// current estimates (the shorter among equals).
    fn best(&self, cap: usize) -> usize {
        let rate = |k: usize| {
            let cost = self.verify_cost(k).unwrap_or(0.0) + self.draft_cost(k).unwrap_or(0.0);
            self.expected_tokens(k) / cost.max(1e-12)
        };
        (0..=cap)
            .max_by(|&a, &b| rate(a).total_cmp(&rate(b)).then(b.cmp(&a)))
            .unwrap_or(0)
    }

    /// Records a round: a draft of `drafted` tokens (0 for a plain step), `accepted` of them
    /// kept, the target's forward took `verify_s` seconds and drafting `draft_s`, in which the
    /// drafter also caught up with `caught_up` tokens committed since it last drafted (one in
    /// a run of drafted rounds: the target's own token). A round that first catches up with
    /// several plain steps' tokens pays that once, not in the next round of the same length:
    /// its time counts as if each extra token had cost a whole draft step. That errs on the
    /// cheap side on purpose: a price too low is corrected by the next drafted round, while a
    /// price too high stops drafting and with it the measurements that would correct it.
    pub fn record(
        &mut self,
        drafted: usize,
        accepted: usize,
        verify_s: f64,
        draft_s: f64,
        caught_up: usize,
    ) {
        let k = drafted.min(self.n_max);
        ema(&mut self.verify[k], verify_s);
        if drafted > 0 {
            let extra = caught_up.saturating_sub(1);
            ema(&mut self.draft[k], draft_s * to_f64(k) / to_f64(k + extra));
            for j in 0..k {
                self.reached[j] += 1.0;
                if j < accepted {
                    self.kept[j] += 1.0;
                }
            }
            self.plain_streak = 0;
            self.best_kept = self.best_kept.max(accepted);
            // A probe that kept nothing backs off, and so does one whose news still leaves
            // drafting unprofitable when the drafter costs time of its own (a draft model that
            // is right but too slow for this target: every probe makes it catch up with the
            // plain steps since the last one, which costs about as much per token as drafting
            // all along). A free drafter (prompt lookup) keeps probing.
            let costly = self.verify[0].is_some_and(|v0| draft_s > 0.1 * v0);
            let still_plain = costly && self.best(self.n_max.min(2 * self.best_kept + 2)) == 0;
            self.misses = if accepted == 0 || still_plain {
                (self.misses + 1).min(MAX_BACKOFF)
            } else {
                0
            };
        } else {
            self.plain_streak += 1;
        }
    }
}

impl Adaptive {
    /// Records that the drafter was asked for `asked > 0` tokens and returned none (it stops
    /// where it is unsure, or its draft fell short of the minimum), after the round was
    /// recorded as a plain step ([`Adaptive::record`] with `drafted = 0`): the ask was a probe
    /// that kept nothing, so the next one waits for the backed-off interval. Its drafting
    /// time, `draft_s`, prices drafting `asked` tokens when nothing else has.
    pub fn declined(&mut self, asked: usize, draft_s: f64) {
        let k = asked.min(self.n_max);
        if k == 0 {
            return;
        }
        if self.draft[k].is_none() {
            self.draft[k] = Some(draft_s);
        }
        self.plain_streak = 0;
        self.misses = (self.misses + 1).min(MAX_BACKOFF);
    }
}

fn ema(slot: &mut Option<f64>, x: f64) {
    *slot = Some(slot.map_or(x, |v| v + if x < v { EMA_DOWN } else { EMA_UP } * (x - v)));
}

#[derive(Clone, Copy)]
enum Side {
    Below,
    Above,
}

/// The measured size nearest to `k` on one side (`k` itself counts as both).
fn lookup(table: &[Option<f64>], k: usize, side: Side) -> Option<(usize, f64)> {
    let hit = |i: usize| table.get(i).copied().flatten().map(|v| (i, v));
    match side {
        Side::Below => (0..=k.min(table.len().saturating_sub(1)))
            .rev()
            .find_map(hit),
        Side::Above => (k..table.len()).find_map(hit),
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
    fn probes_are_asked_with_a_window_and_drafts_that_pay_without() {
        let mut p = Adaptive::new(8);
        let first = p.ask(100);
        assert_eq!(
            first,
            Ask {
                k: PROBE_LEN,
                probe: true
            }
        );
        assert_eq!(first.window(), Some(PROBE_WINDOW));
        // A plain step next (what drafting is compared with), not a probe.
        p.record(1, 0, 0.011, 0.001, 40);
        assert_eq!(p.ask(100), Ask { k: 0, probe: false });
        assert_eq!(p.ask(100).window(), None);
        // Drafts that keep paying: asked without a window.
        for _ in 0..20 {
            p.record(8, 8, 0.012, 0.0, 1);
            p.record(0, 0, 0.010, 0.0, 0);
        }
        let paying = p.ask(100);
        assert!(paying.k > PROBE_LEN && !paying.probe, "{paying:?}");
        // Drafts that stop paying: after the interval, a probe again, with its window.
        for _ in 0..200 {
            p.record(8, 0, 0.014, 0.004, 1);
        }
        let mut asks = Vec::new();
        for _ in 0..PROBE_EVERY << MAX_BACKOFF {
            asks.push(p.ask(100));
            p.record(0, 0, 0.010, 0.0, 0);
        }
        assert!(asks.iter().all(|a| a.k == 0 && !a.probe));
        assert_eq!(
            p.ask(100),
            Ask {
                k: PROBE_LEN,
                probe: true
            }
        );
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
        // A probe that keeps its token but leaves drafting unprofitable (one kept after
        // thirty misses) does not shorten the interval: probing is not free either.
        p.record(1, 1, 0.011, 0.002, 1);
        for _ in 0..PROBE_EVERY {
            p.record(0, 0, 0.010, 0.0, 0);
        }
        assert_eq!(p.next(100), 0);
        // Drafts kept again and again make drafting pay: the policy drafts.
        for _ in 0..40 {
            p.record(1, 1, 0.011, 0.0, 1);
        }
        assert!(p.next(100) >= 1);
        assert_eq!(p.misses, 0);
    }

    #[test]
    fn a_drafter_that_declines_is_asked_again_only_after_the_backed_off_interval() {
        let mut p = Adaptive::new(8).self_limiting(true);
        assert_eq!(p.next(100), PROBE_LEN);
        // Asked for one token, it returns none: a plain step with a declined ask.
        p.record(0, 0, 0.010, 0.0, 0);
        p.declined(1, 0.003);
        let mut asks = 0;
        for _ in 0..200 {
            let k = p.next(100);
            p.record(0, 0, 0.010, 0.0, 0);
            if k > 0 {
                asks += 1;
                p.declined(k, 0.003);
            }
        }
        // Asked again after 32 plain steps, then after 64 more; the next would wait 128:
        // 2 asks in 200 steps, not 200.
        assert_eq!(asks, 2);
        // A drafter that drafts again is measured as before.
        for _ in 0..40 {
            p.record(1, 1, 0.011, 0.001, 1);
            p.record(0, 0, 0.010, 0.0, 0);
        }
        assert!(p.next(100) >= 1);
    }

    #[test]
    fn longer_drafts_are_tried_when_short_ones_are_always_kept() {
        // Verify rows as expensive as on a CPU with small batches (0.6 of a step each) and a
        // drafter costing 0.3 of a step per token: a line through 1- and 2-token drafts says
        // nothing longer pays, yet every draft so far was kept whole. The next round tries the
        // longest draft allowed (twice the most kept plus two) and measures it.
        let feed = |p: &mut Adaptive| {
            for _ in 0..10 {
                p.record(0, 0, 0.010, 0.0, 0);
                p.record(1, 1, 0.016, 0.003, 1);
                p.record(2, 2, 0.022, 0.006, 1);
            }
        };
        // A drafter that fills whatever length it gets is priced on the cautious line.
        let mut cautious = Adaptive::new(16);
        feed(&mut cautious);
        assert!(cautious.next(100) < 6);
        let mut p = Adaptive::new(16).self_limiting(true);
        feed(&mut p);
        assert_eq!(p.next(100), 6);
        // Measured, it costs what the line said: the policy goes back to what pays.
        for _ in 0..10 {
            p.record(6, 6, 0.046, 0.018, 1);
        }
        let k = p.next(100);
        let rate = |k: usize| {
            p.expected_tokens(k) / (p.verify_cost(k).unwrap() + p.draft_cost(k).unwrap())
        };
        assert!((0..=14).all(|j| rate(j) <= rate(k)), "chose {k}");
    }

    #[test]
    fn a_drafter_that_stops_itself_is_given_the_longest_draft_when_drafting_pays() {
        let feed = |p: &mut Adaptive| {
            for _ in 0..6 {
                p.record(0, 0, 0.010, 0.0, 0);
                p.record(3, 3, 0.016, 0.006, 1);
                p.record(5, 5, 0.020, 0.010, 1);
            }
        };
        let mut averages = Adaptive::new(16);
        feed(&mut averages);
        let mut stops = Adaptive::new(16).self_limiting(true);
        feed(&mut stops);
        // Both find that drafting pays; the second leaves the length to the drafter, up to
        // twice the most kept plus two.
        let k = averages.next(100);
        assert!((1..12).contains(&k), "{k}");
        assert_eq!(stops.next(100), 12);
        // Where drafting does not pay, neither drafts.
        let mut slow = Adaptive::new(16).self_limiting(true);
        for _ in 0..6 {
            slow.record(0, 0, 0.010, 0.0, 0);
            slow.record(3, 0, 0.016, 0.030, 1);
        }
        assert_eq!(slow.next(100), 0);
    }

    #[test]
    fn costs_between_measured_sizes_are_interpolated() {
        let mut p = Adaptive::new(8);
        p.record(0, 0, 0.010, 0.0, 0);
        p.record(4, 4, 0.030, 0.008, 1);
        p.record(8, 8, 0.040, 0.016, 1);
        assert!((p.verify_cost(2).unwrap() - 0.020).abs() < 1e-12);
        assert!((p.verify_cost(6).unwrap() - 0.035).abs() < 1e-12);
        assert!((p.draft_cost(6).unwrap() - 0.012).abs() < 1e-12);
        assert!((p.draft_cost(2).unwrap() - 0.004).abs() < 1e-12);
        // A round that first caught up with five plain steps' tokens: its drafting time is
        // counted as if each extra token were a draft step, on the cheap side.
        // 24 ms for 4 drafts after 4 extra tokens counts as 12 ms.
        p.record(4, 4, 0.030, 0.024, 5);
        assert!((p.draft_cost(4).unwrap() - (0.008 + EMA_UP * 0.004)).abs() < 1e-12);
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
