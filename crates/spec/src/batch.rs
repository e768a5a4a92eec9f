//! Drafting for several sequences at once: [`BatchDrafter`] takes every active sequence of a
//! step in one call — the draft asks of all of them, and the target batch's rows of all of them
//! with their hidden states as rows of one feature batch — so that a drafter driving a network
//! (DFlash, EAGLE-3) can run it over every sequence in one forward. [`PerSeq`] serves any set of
//! per-sequence [`Drafter`]s through it (one drafter per sequence, called in turn, each call
//! isolated: an error or a panic of one sequence's drafter is that sequence's result alone), and
//! [`One`] a single borrowed drafter (`generate_speculative`, `bench`).

use std::ops::Range;

use crate::{DraftParams, Drafter, SpecError};

/// One sequence's draft request in a [`BatchDrafter::draft`] call.
#[derive(Clone, Copy, Debug)]
pub struct DraftAsk<'a> {
    /// The sequence (`0..n_seq`).
    pub seq: usize,
    /// What it asks for.
    pub params: DraftParams<'a>,
}

/// One sequence's rows of a target batch in a [`BatchDrafter::process`] call.
#[derive(Clone, Debug)]
pub struct SeqFeed<'a> {
    /// The sequence (`0..n_seq`).
    pub seq: usize,
    /// The tokens the target ran for it, at positions `pos0..`.
    pub tokens: &'a [u32],
    /// The position of `tokens[0]`.
    pub pos0: usize,
    /// Its rows of the batch's features (`tokens.len()` rows when the drafter asks for taps,
    /// else an empty range).
    pub rows: Range<usize>,
}

/// A target batch's captured hidden states, `[Σ rows, taps · n_embd]`, each row the taps side
/// by side.
#[derive(Clone, Copy)]
pub enum Features<'a> {
    /// Row-major on the host (empty without taps).
    Host(&'a [f32]),
    /// Left on the target's backend: its tensor (`B::Tensor`), type-erased, for drafters that
    /// run there ([`BatchDrafter::takes_device_features`]).
    Device(&'a (dyn std::any::Any + Send + Sync)),
}

impl std::fmt::Debug for Features<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Host(v) => f.debug_tuple("Host").field(&v.len()).finish(),
            Self::Device(_) => f.write_str("Device"),
        }
    }
}

/// A drafter over the sequences `0..n_seq()` (a server's slots, or one generation).
pub trait BatchDrafter {
    /// A short name for statistics and errors.
    fn name(&self) -> &'static str;

    /// How many sequences it drafts for.
    fn n_seq(&self) -> usize;

    /// The target hidden states it learns from (every sequence the same, see
    /// [`Drafter::target_taps`]); a batch's features are `[rows, taps · n_embd]`.
    fn target_taps(&self) -> &[usize];

    /// The longest draft of a round ([`Drafter::max_draft`]).
    fn max_draft(&self) -> Option<usize>;

    /// Whether drafts end where the drafter becomes unsure ([`Drafter::stops_when_unsure`]).
    fn stops_when_unsure(&self) -> bool;

    /// A new request on `seq` ([`Drafter::begin_reusing`]).
    ///
    /// # Errors
    /// The drafter's failure for that sequence.
    fn begin_reusing(
        &mut self,
        seq: usize,
        prompt: &[u32],
        reused: usize,
    ) -> Result<usize, SpecError>;

    /// Drafts for every ask; `out` (cleared first) gets one result per ask, in order.
    fn draft(&mut self, asks: &[DraftAsk<'_>], out: &mut Vec<Result<Vec<u32>, SpecError>>);

    /// Whether its drafters read features left on the target's backend
    /// ([`Drafter::takes_device_features`]; every sequence the same).
    fn takes_device_features(&self) -> bool;

    /// The target ran `feeds` (a prompt chunk or a verify batch of each, before rejected rows
    /// are rolled back); `features` holds all their captured rows, `[Σ rows, taps · n_embd]`
    /// (empty without taps; [`Features::Device`] only when
    /// [`BatchDrafter::takes_device_features`]). `out` (cleared first) gets one result per
    /// feed, in order.
    fn process(
        &mut self,
        feeds: &[SeqFeed<'_>],
        features: Features<'_>,
        out: &mut Vec<Result<(), SpecError>>,
    );

    /// The target accepted the first `n` tokens of `seq`'s last draft.
    ///
    /// # Errors
    /// A failure the drafter reports there ([`PerSeq`]: a panic of [`Drafter::accept`]).
    fn accept(&mut self, seq: usize, n: usize) -> Result<(), SpecError>;
}

/// The message of a caught panic's payload.
#[must_use]
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".to_owned())
}

/// Runs `f`, a panic becoming a [`SpecError::Panicked`] of `drafter`.
fn guarded<T>(
    drafter: &'static str,
    f: impl FnOnce() -> Result<T, SpecError>,
) -> Result<T, SpecError> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|p| {
        Err(SpecError::Panicked {
            drafter,
            message: panic_message(p.as_ref()),
        })
    })
}

/// One feed's rows of a batch's [`Features`].
enum FeedRows<'a> {
    Host(&'a [f32]),
    Device(&'a (dyn std::any::Any + Send + Sync), Range<usize>),
}

/// Calls `f` for each feed with its rows of `features` (`None` without taps), the results into
/// `out` (cleared first).
fn feed_each(
    feeds: &[SeqFeed<'_>],
    features: Features<'_>,
    taps: bool,
    out: &mut Vec<Result<(), SpecError>>,
    mut f: impl FnMut(&SeqFeed<'_>, Option<FeedRows<'_>>) -> Result<(), SpecError>,
) {
    out.clear();
    let width = match features {
        Features::Host(v) => v
            .len()
            .checked_div(feeds.iter().map(|f| f.rows.len()).sum())
            .unwrap_or(0),
        Features::Device(_) => 0,
    };
    for feed in feeds {
        let rows = taps.then(|| match features {
            Features::Host(v) => FeedRows::Host(&v[feed.rows.start * width..feed.rows.end * width]),
            Features::Device(t) => FeedRows::Device(t, feed.rows.clone()),
        });
        out.push(f(feed, rows));
    }
}

/// A per-sequence drafter takes in its rows ([`Drafter::process_features`] or
/// [`Drafter::process_device_features`] with features, else [`Drafter::process`]).
fn feed<D: Drafter + ?Sized>(
    d: &mut D,
    f: &SeqFeed<'_>,
    rows: Option<FeedRows<'_>>,
) -> Result<(), SpecError> {
    match rows {
        Some(FeedRows::Host(rows)) => d.process_features(f.tokens, f.pos0, rows),
        Some(FeedRows::Device(t, rows)) if d.takes_device_features() => {
            d.process_device_features(f.tokens, f.pos0, t, rows)
        }
        Some(FeedRows::Device(..)) => Err(SpecError::DeviceFeatures { drafter: d.name() }),
        None => d.process(f.tokens, f.pos0),
    }
}

/// One per-sequence [`Drafter`] for each sequence, called in turn. Each call is isolated: an
/// error or a panic (caught, as [`SpecError::Panicked`]) is the result of that sequence only,
/// and the other sequences' calls still run. A sequence whose drafter failed must start over
/// ([`BatchDrafter::begin_reusing`]) before it drafts again.
pub struct PerSeq<D: Drafter + ?Sized = dyn Drafter> {
    drafters: Vec<Box<D>>,
}

impl<D: Drafter + ?Sized> std::fmt::Debug for PerSeq<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PerSeq")
            .field("n_seq", &self.drafters.len())
            .field("name", &self.drafters.first().map(|d| d.name()))
            .finish()
    }
}

impl<D: Drafter + ?Sized> PerSeq<D> {
    /// The drafters of sequences `0..drafters.len()`.
    ///
    /// # Errors
    /// [`SpecError::Taps`] when they ask for different target taps (one feature batch has one
    /// row layout).
    pub fn new(drafters: Vec<Box<D>>) -> Result<Self, SpecError> {
        if let Some(first) = drafters.first()
            && let Some(i) = drafters
                .iter()
                .position(|d| d.target_taps() != first.target_taps())
        {
            return Err(SpecError::Taps {
                seq: i,
                taps: drafters[i].target_taps().to_vec(),
                first: first.target_taps().to_vec(),
            });
        }
        Ok(Self { drafters })
    }

    /// The drafter of `seq`.
    pub fn get_mut(&mut self, seq: usize) -> &mut D {
        &mut self.drafters[seq]
    }

    /// Puts a fresh drafter in place of `seq`'s (after a fault, so that nothing half-updated
    /// is used again).
    pub fn replace(&mut self, seq: usize, drafter: Box<D>) {
        self.drafters[seq] = drafter;
    }
}

impl<D: Drafter + ?Sized> BatchDrafter for PerSeq<D> {
    fn name(&self) -> &'static str {
        self.drafters.first().map_or("none", |d| d.name())
    }

    fn n_seq(&self) -> usize {
        self.drafters.len()
    }

    fn target_taps(&self) -> &[usize] {
        self.drafters.first().map_or(&[], |d| d.target_taps())
    }

    fn max_draft(&self) -> Option<usize> {
        self.drafters.first().and_then(|d| d.max_draft())
    }

    fn stops_when_unsure(&self) -> bool {
        self.drafters.first().is_some_and(|d| d.stops_when_unsure())
    }

    fn begin_reusing(
        &mut self,
        seq: usize,
        prompt: &[u32],
        reused: usize,
    ) -> Result<usize, SpecError> {
        let d = &mut self.drafters[seq];
        let name = d.name();
        guarded(name, || d.begin_reusing(prompt, reused))
    }

    fn draft(&mut self, asks: &[DraftAsk<'_>], out: &mut Vec<Result<Vec<u32>, SpecError>>) {
        out.clear();
        for a in asks {
            let d = &mut self.drafters[a.seq];
            let name = d.name();
            out.push(guarded(name, || d.draft(&a.params)));
        }
    }

    fn takes_device_features(&self) -> bool {
        !self.drafters.is_empty() && self.drafters.iter().all(|d| d.takes_device_features())
    }

    fn process(
        &mut self,
        feeds: &[SeqFeed<'_>],
        features: Features<'_>,
        out: &mut Vec<Result<(), SpecError>>,
    ) {
        let taps = !self.target_taps().is_empty();
        feed_each(feeds, features, taps, out, |f, rows| {
            let d = &mut self.drafters[f.seq];
            let name = d.name();
            guarded(name, || feed(&mut **d, f, rows))
        });
    }

    fn accept(&mut self, seq: usize, n: usize) -> Result<(), SpecError> {
        let d = &mut self.drafters[seq];
        let name = d.name();
        guarded(name, || {
            d.accept(n);
            Ok(())
        })
    }
}

/// One borrowed [`Drafter`] as the single sequence 0 of a [`BatchDrafter`] (calls are not
/// isolated: an error or a panic is the caller's).
pub struct One<'a>(pub &'a mut dyn Drafter);

impl std::fmt::Debug for One<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("One").field(&self.0.name()).finish()
    }
}

impl BatchDrafter for One<'_> {
    fn name(&self) -> &'static str {
        self.0.name()
    }

    fn n_seq(&self) -> usize {
        1
    }

    fn target_taps(&self) -> &[usize] {
        self.0.target_taps()
    }

    fn max_draft(&self) -> Option<usize> {
        self.0.max_draft()
    }

    fn stops_when_unsure(&self) -> bool {
        self.0.stops_when_unsure()
    }

    fn begin_reusing(
        &mut self,
        _seq: usize,
        prompt: &[u32],
        reused: usize,
    ) -> Result<usize, SpecError> {
        self.0.begin_reusing(prompt, reused)
    }

    fn draft(&mut self, asks: &[DraftAsk<'_>], out: &mut Vec<Result<Vec<u32>, SpecError>>) {
        out.clear();
        out.extend(asks.iter().map(|a| self.0.draft(&a.params)));
    }

    fn takes_device_features(&self) -> bool {
        self.0.takes_device_features()
    }

    fn process(
        &mut self,
        feeds: &[SeqFeed<'_>],
        features: Features<'_>,
        out: &mut Vec<Result<(), SpecError>>,
    ) {
        let taps = !self.0.target_taps().is_empty();
        feed_each(feeds, features, taps, out, |f, rows| {
            feed(&mut *self.0, f, rows)
        });
    }

    fn accept(&mut self, _seq: usize, n: usize) -> Result<(), SpecError> {
        self.0.accept(n);
        Ok(())
    }
}
