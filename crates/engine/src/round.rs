//! One speculative round, the same for `run` ([`Engine::generate_speculative`]), `bench` and
//! `serve` (the server's worker batches several sequences' rounds into one forward).
//!
//! A sequence's [`SpecSeq`] holds what lives across rounds — options, the adaptive policy,
//! the statistics, the committed history, how many committed tokens the drafter has not seen —
//! and the round in flight. A round is:
//!
//! 1. [`plan`] (every sequence of a step at once): choose `k` (the policy, bounded by the
//!    context and the budget), one [`BatchDrafter::draft`] call for all sequences that draft,
//!    clamp each draft (at most `k`, at least `n_min` or none, ids inside the vocabulary), build
//!    the rows `[lead prompt tokens, anchor, draft]` and, for a memory that rolls back by
//!    replay, take the checkpoint.
//! 2. The caller runs [`SpecSeq::rows`] through the target (alone, or in a `decode_multi` with
//!    other sequences' rows) and feeds the drafter the batch with its features
//!    ([`BatchDrafter::process`], e.g. through [`Engine::run_for`]).
//! 3. [`SpecSeq::commit`]: verify the rows' logits, tell the drafter how many drafts were
//!    accepted, record statistics and the policy's costs, take the rejected rows back out of
//!    the cache ([`Engine::rewind`]: a trim, or restore the checkpoint and replay; for a
//!    sliding-window ring that the verify overwrote, the replay runs from the history) and
//!    return the tokens to commit.
//!
//! Timings follow llama.cpp's: a round's drafting cost is the draft call plus the drafter's
//! share of the round after the forward (feature injection, deferred injection on
//! acceptance); the verify cost is the forward without that share. A round that carried prompt
//! rows in front of its anchor records no cost (it says nothing about a verify's).

use std::time::Instant;

use specula_spec::policy::Adaptive;
use specula_spec::verify::Verdict;
use specula_spec::{BatchDrafter, DraftAsk, DraftParams, Features, SeqFeed, SpecError, SpecStats};
use specula_tensor::Backend;

use crate::{Checkpoint, Engine, EngineError, Result, Rewound, Rollback, Session, SpecOptions};

/// One sequence's speculative state across rounds, and its round in flight.
#[derive(Clone, Debug)]
pub struct SpecSeq {
    seq: usize,
    opts: SpecOptions,
    drafting: bool,
    policy: Adaptive,
    stats: SpecStats,
    /// Committed tokens the drafter had not seen when it was last asked.
    since_draft: usize,
    /// Committed tokens (prompt included); the last one is the anchor of the next round.
    history: Vec<u32>,
    // The round in flight.
    rows: Vec<u32>,
    lead: usize,
    base: usize,
    k: usize,
    /// The round's context window for the drafter (a probe's).
    window: Option<usize>,
    ck: Option<Checkpoint>,
    draft_s: f64,
    caught_up: usize,
}

/// What a round cost after its plan, for the policy.
#[derive(Clone, Copy, Debug, Default)]
pub struct RoundCost {
    /// Seconds of the target forward that ran the rows, without the drafter's share.
    pub verify_s: f64,
    /// Seconds the drafter took taking in the batch ([`BatchDrafter::process`]).
    pub in_drafter_s: f64,
}

/// A sequence's part of a [`plan`] call.
#[derive(Debug)]
pub struct PlanEntry<'a, B: Backend> {
    /// The sequence.
    pub seq: &'a mut SpecSeq,
    /// Its target session (the round starts from what it holds).
    pub session: &'a Session<B>,
    /// Prompt tokens (the last ones of the history before the anchor) that run in front of
    /// the anchor in this round's forward.
    pub lead: usize,
    /// Tokens it may still generate (at least one).
    pub left: usize,
}

impl SpecSeq {
    /// A sequence `seq` of `drafter` (none: rounds of plain decoding, one row each, no
    /// statistics) starting from `prompt` (its last token is the first round's anchor).
    #[must_use]
    pub fn new(
        seq: usize,
        opts: SpecOptions,
        drafter: Option<&dyn BatchDrafter>,
        prompt: &[u32],
    ) -> Self {
        let self_limiting = opts.p_min > 0.0 && drafter.is_some_and(|d| d.stops_when_unsure());
        Self {
            seq,
            opts,
            drafting: drafter.is_some(),
            policy: Adaptive::new(opts.n_max).self_limiting(self_limiting),
            stats: SpecStats::default(),
            // The first anchor, the last prompt token, is new to the drafter.
            since_draft: 1,
            history: prompt.to_vec(),
            rows: Vec::with_capacity(opts.n_max.saturating_add(1).min(4096)),
            lead: 0,
            base: 0,
            k: 0,
            window: None,
            ck: None,
            draft_s: 0.0,
            caught_up: 0,
        }
    }

    /// The sequence's index in its drafter.
    #[must_use]
    pub fn seq(&self) -> usize {
        self.seq
    }

    /// Whether it drafts (it has a drafter).
    #[must_use]
    pub fn drafting(&self) -> bool {
        self.drafting
    }

    /// Its options.
    #[must_use]
    pub fn options(&self) -> &SpecOptions {
        &self.opts
    }

    /// Its acceptance statistics.
    #[must_use]
    pub fn stats(&self) -> &SpecStats {
        &self.stats
    }

    /// The committed tokens, prompt included (after a commit, every token it returned).
    #[must_use]
    pub fn history(&self) -> &[u32] {
        &self.history
    }

    /// The planned round's rows: the lead prompt tokens, the anchor, the draft.
    #[must_use]
    pub fn rows(&self) -> &[u32] {
        &self.rows
    }

    /// Prompt tokens in front of the anchor in the planned round.
    #[must_use]
    pub fn lead(&self) -> usize {
        self.lead
    }

    /// The planned round's draft.
    #[must_use]
    pub fn draft(&self) -> &[u32] {
        &self.rows[(self.lead + 1).min(self.rows.len())..]
    }

    /// Cuts the planned round's draft to its first `n` tokens (a constraint rejects the
    /// next one: e.g. a grammar, before the verify batch runs).
    pub fn cut_draft(&mut self, n: usize) {
        self.rows.truncate((self.lead + 1 + n).min(self.rows.len()));
    }

    /// The planned round's rows as the drafter takes them after the forward, their features at
    /// `rows` of the batch's.
    #[must_use]
    pub fn feed(&self, rows: std::ops::Range<usize>) -> SeqFeed<'_> {
        SeqFeed {
            seq: self.seq,
            tokens: &self.rows,
            pos0: self.base - self.lead,
            rows,
        }
    }

    /// Seconds the last committed round spent in the drafter (drafting, taking in the batch,
    /// acceptance): the policy's drafting cost.
    #[must_use]
    pub fn last_draft_s(&self) -> f64 {
        self.draft_s
    }

    /// The round's draft length from the policy (0 without a drafter), bounded by the context
    /// after the anchor and by the budget after the token the target adds.
    fn choose<B: Backend>(&mut self, s: &Session<B>, lead: usize, left: usize) -> usize {
        self.lead = lead;
        // The anchor's position.
        self.base = s.n_past() + lead;
        self.draft_s = 0.0;
        self.caught_up = 0;
        let room = (s.n_ctx() - self.base - 1).min(left.saturating_sub(1));
        self.window = None;
        self.k = if !self.drafting {
            0
        } else if self.opts.adaptive {
            let ask = self.policy.ask(room);
            self.window = ask.window();
            ask.k
        } else {
            self.opts.n_max.min(room)
        };
        self.k
    }

    fn ask(&self) -> Option<DraftAsk<'_>> {
        (self.k > 0).then(|| DraftAsk {
            seq: self.seq,
            params: DraftParams {
                history: &self.history,
                n_max: self.k,
                p_min: self.opts.p_min,
                window: self.window,
            },
        })
    }

    /// Clamps the draft and builds the rows; takes the checkpoint of a memory that replays.
    fn set_draft<B: Backend>(
        &mut self,
        s: &Session<B>,
        mut draft: Vec<u32>,
        draft_s: f64,
        n_vocab: usize,
    ) {
        draft.truncate(self.k);
        if draft.len() < self.opts.n_min || draft.iter().any(|&d| d as usize >= n_vocab) {
            draft.clear();
        }
        self.draft_s = draft_s;
        if self.k > 0 {
            // A probe's drafter catches up with at most its window (and the anchor).
            let since = std::mem::replace(&mut self.since_draft, 0);
            self.caught_up = self.window.map_or(since, |w| since.min(w + 1));
        }
        self.rows.clear();
        self.rows
            .extend_from_slice(&self.history[self.history.len() - 1 - self.lead..]);
        self.rows.extend_from_slice(&draft);
        // A memory that cannot trim comes back to this state on a partial rejection (a
        // recurrent one when the rejection goes past its snapshots).
        self.ck = (s.rollback() != Rollback::Trim).then(|| s.checkpoint());
    }

    /// Commits the round: `logits` are the rows of the anchor and the draft (row `i` the
    /// target's prediction after the anchor and `draft[..i]`), `verify` picks what to keep
    /// ([`specula_spec::verify::sample_and_match`], or a benchmark's fixed verdict). The drafter
    /// hears the acceptance; statistics and the policy record the round; the cache keeps the
    /// anchor and the accepted drafts. Returns the verdict, whose tokens are now the end of
    /// [`SpecSeq::history`].
    ///
    /// # Errors
    /// The verifier's, the drafter's acceptance, the rollback's.
    pub fn commit<B: Backend>(
        &mut self,
        engine: &Engine<B>,
        s: &mut Session<B>,
        drafter: Option<&mut dyn BatchDrafter>,
        logits: &[f32],
        verify: impl FnOnce(&[f32], &[u32]) -> Result<Verdict, SpecError>,
        cost: RoundCost,
    ) -> Result<Verdict> {
        let lead = self.lead;
        let n_draft = self.rows.len() - lead - 1;
        let verdict = verify(logits, &self.rows[lead + 1..]).map_err(EngineError::Spec)?;
        if self.drafting {
            // Acceptance first: a drafter's work there (DFlash's deferred injection) is
            // drafting cost too.
            let ta = Instant::now();
            if n_draft > 0
                && let Some(d) = drafter
            {
                d.accept(self.seq, verdict.accepted)
                    .map_err(EngineError::Spec)?;
            }
            self.draft_s += cost.in_drafter_s + ta.elapsed().as_secs_f64();
            self.stats.record(n_draft, verdict.accepted);
            if lead == 0 {
                // A verify that carried the prompt says nothing about a verify's cost.
                self.policy.record(
                    n_draft,
                    verdict.accepted,
                    cost.verify_s,
                    self.draft_s,
                    self.caught_up,
                );
                if n_draft == 0 && self.k > 0 {
                    // Asked, the drafter declined (unsure of even the first token).
                    self.policy.declined(self.k, self.draft_s);
                }
            }
        }
        self.history.extend_from_slice(&verdict.tokens);
        // The cache keeps the anchor and the accepted drafts (and the prompt rows in front
        // of the first round's anchor, which a replay runs again too).
        let keep = 1 + verdict.accepted;
        let n = self.base + keep;
        let rewound = match engine.rewind(s, n, self.ck.as_ref(), &self.rows[..lead + keep]) {
            // A sliding-window ring that a verify of more rows than one forward writes has
            // overwritten: the replay starts before this round, from the history (whose last
            // token, the target's own, is at position `n`).
            Err(EngineError::Rewind { .. }) => {
                let tail = &self.history[..self.history.len() - 1];
                engine.rewind(s, n, self.ck.as_ref(), tail)?
            }
            r => r?,
        };
        if let Rewound::Replayed(rows) = rewound {
            self.stats.record_replay(rows);
        }
        // The drafter has seen the accepted drafts (it made them); the target's own token is
        // new to it.
        self.since_draft += 1;
        self.ck = None;
        Ok(verdict)
    }
}

/// Plans the round of every entry: the draft length of each, one drafter call for all that
/// draft (its time counted as each one's drafting cost), each draft clamped, the rows built,
/// the checkpoints taken. A sequence whose draft failed plans a round without a draft and is
/// listed in the result (index into `entries`, error) for the caller to fail or carry on.
/// `drafts` is the drafter's result buffer, kept by the caller across rounds.
pub fn plan<B: Backend>(
    entries: &mut [PlanEntry<'_, B>],
    drafter: Option<&mut dyn BatchDrafter>,
    n_vocab: usize,
    drafts: &mut Vec<std::result::Result<Vec<u32>, SpecError>>,
) -> Vec<(usize, SpecError)> {
    let mut asking = 0;
    for e in entries.iter_mut() {
        if e.seq.choose(e.session, e.lead, e.left) > 0 {
            asking += 1;
        }
    }
    drafts.clear();
    let mut draft_s = 0.0;
    if asking > 0
        && let Some(d) = drafter
    {
        let asks: Vec<DraftAsk<'_>> = entries.iter().filter_map(|e| e.seq.ask()).collect();
        let td = Instant::now();
        d.draft(&asks, drafts);
        draft_s = td.elapsed().as_secs_f64();
    }
    let mut failed = Vec::new();
    let mut results = drafts.drain(..);
    for (i, e) in entries.iter_mut().enumerate() {
        let draft = if e.seq.k > 0 {
            match results.next() {
                Some(Ok(d)) => d,
                Some(Err(err)) => {
                    failed.push((i, err));
                    Vec::new()
                }
                None => Vec::new(),
            }
        } else {
            Vec::new()
        };
        e.seq.set_draft(e.session, draft, draft_s, n_vocab);
    }
    failed
}

/// The target features of one sequence's batches, reused across rounds: the taps a feature
/// drafter asks for, captured on the host or — for a drafter that reads them where the target
/// computed them ([`BatchDrafter::takes_device_features`]) — into a backend tensor that never
/// leaves the backend.
pub struct FeatureBuf<B: Backend> {
    taps: specula_models::Taps,
    host: Vec<f32>,
    device: Option<B::Tensor>,
}

impl<B: Backend> std::fmt::Debug for FeatureBuf<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FeatureBuf")
            .field("taps", &self.taps.layers)
            .field("host", &self.host.len())
            .field("device", &self.device.is_some())
            .finish()
    }
}

impl<B: Backend> FeatureBuf<B> {
    /// Buffers for the taps `layers` (none: nothing is captured).
    #[must_use]
    pub fn new(layers: &[usize]) -> Self {
        Self {
            taps: specula_models::Taps {
                layers: layers.to_vec(),
                rows: Vec::new(),
            },
            host: Vec::new(),
            device: None,
        }
    }

    /// Whether any tap is captured.
    #[must_use]
    pub fn wanted(&self) -> bool {
        !self.taps.layers.is_empty()
    }
}

impl<B: Backend> Engine<B> {
    /// Runs a target batch of one sequence (a prompt, or a round's rows) with the logits of
    /// `ids[first..]` into `logits`, capturing the taps of `feats` when it has any (on the
    /// backend when the drafter reads them there), and feeds it to sequence `seq` of
    /// `drafter`; returns the seconds the drafter took.
    ///
    /// # Errors
    /// The forward's, and the drafter's.
    #[allow(
        clippy::too_many_arguments,
        reason = "the loop's buffers, reused across rounds"
    )]
    pub fn run_for(
        &self,
        s: &mut Session<B>,
        ids: &[u32],
        first: usize,
        logits: &mut Vec<f32>,
        feats: &mut FeatureBuf<B>,
        drafter: &mut dyn BatchDrafter,
        seq: usize,
    ) -> Result<f64> {
        let pos0 = s.n_past();
        let device = feats.wanted() && drafter.takes_device_features();
        let rows = if !feats.wanted() {
            self.prefill_into(s, ids, first, logits)?;
            feats.host.clear();
            0..0
        } else if device {
            let t = feats.device.get_or_insert_with(|| self.backend.zeros(0, 0));
            self.prefill_with_device_features(s, ids, first, logits, &feats.taps.layers, t)?;
            0..ids.len()
        } else {
            self.prefill_with_features(s, ids, first, logits, &mut feats.taps, &mut feats.host)?;
            0..ids.len()
        };
        let features = match (&feats.device, device) {
            (Some(t), true) => Features::Device(t),
            _ => Features::Host(&feats.host),
        };
        let t = Instant::now();
        let mut fed = Vec::with_capacity(1);
        drafter.process(
            &[SeqFeed {
                seq,
                tokens: ids,
                pos0,
                rows,
            }],
            features,
            &mut fed,
        );
        let in_drafter = t.elapsed().as_secs_f64();
        fed.pop().unwrap_or(Ok(())).map_err(EngineError::Spec)?;
        Ok(in_drafter)
    }
}
