//! Drafters that need no second model: the history predicts itself.
//!
//! - [`NgramSimple`] (llama.cpp's `ngram-simple`, "prompt lookup decoding"): find the most
//!   recent earlier occurrence of the last `n` tokens (longest `n` first, down to `n_min`) and
//!   propose what followed it. Code edits and summaries copy long runs of their prompt.
//! - [`NgramCache`] (llama.cpp's `ngram-cache`): counts, for every context of `n` tokens seen
//!   so far, which token followed how often, and chains the most frequent continuations while
//!   they are frequent enough.

use rustc_hash::FxHashMap;

use crate::{DraftParams, Drafter, DrafterState, SpecError};

/// Prompt lookup: the continuation of the most recent earlier match of the history's tail.
#[derive(Clone, Debug)]
pub struct NgramSimple {
    n_min: usize,
    n_max: usize,
}

impl NgramSimple {
    /// Matches tails of `n_max` tokens down to `n_min` (both at least 1).
    #[must_use]
    pub fn new(n_min: usize, n_max: usize) -> Self {
        let n_min = n_min.max(1);
        Self {
            n_min,
            n_max: n_max.max(n_min),
        }
    }
}

impl Default for NgramSimple {
    /// Tails of 4 down to 2 tokens: one-token matches propose too much noise.
    fn default() -> Self {
        Self::new(2, 4)
    }
}

impl Drafter for NgramSimple {
    fn name(&self) -> &'static str {
        "ngram-simple"
    }

    fn begin(&mut self, _prompt: &[u32]) -> Result<(), SpecError> {
        Ok(())
    }

    fn draft(&mut self, p: &DraftParams<'_>) -> Result<Vec<u32>, SpecError> {
        let h = p.history;
        if p.n_max == 0 {
            return Ok(Vec::new());
        }
        for n in (self.n_min..=self.n_max.min(h.len().saturating_sub(1))).rev() {
            let tail = &h[h.len() - n..];
            // The most recent earlier occurrence that has at least one token after it.
            let found = (0..h.len() - n).rev().find(|&i| &h[i..i + n] == tail);
            if let Some(i) = found {
                let from = i + n;
                let to = (from + p.n_max).min(h.len());
                return Ok(h[from..to].to_vec());
            }
        }
        Ok(Vec::new())
    }

    fn state(&self) -> DrafterState {
        Box::new(())
    }

    fn restore(&mut self, state: &DrafterState) -> Result<(), SpecError> {
        if state.is::<()>() {
            Ok(())
        } else {
            Err(SpecError::ForeignState("ngram-simple"))
        }
    }
}

/// Counts of continuations per `n`-token context, built from the history as it grows.
#[derive(Clone, Debug)]
pub struct NgramCache {
    n: usize,
    /// Draft only continuations seen at least this often.
    min_count: u32,
    /// Draft only continuations that are at least this share of their context's.
    min_share: f32,
    /// Context hash → (next token → count).
    table: FxHashMap<u64, FxHashMap<u32, u32>>,
    /// How much of the history is in the table.
    seen: usize,
    /// The history the table was built from (to notice a different sequence).
    history: Vec<u32>,
}

impl NgramCache {
    /// Contexts of `n` tokens (at least 1); a continuation is drafted when it was seen at least
    /// `min_count` times and makes at least `min_share` of its context's continuations.
    #[must_use]
    pub fn new(n: usize, min_count: u32, min_share: f32) -> Self {
        Self {
            n: n.max(1),
            min_count: min_count.max(1),
            min_share,
            table: FxHashMap::default(),
            seen: 0,
            history: Vec::new(),
        }
    }

    fn key(ctx: &[u32]) -> u64 {
        // FNV-1a over the ids: a stable hash, independent of the process.
        ctx.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &t| {
            (h ^ u64::from(t)).wrapping_mul(0x0000_0100_0000_01b3)
        })
    }

    /// Adds every context of the history not yet counted.
    fn update(&mut self, h: &[u32]) {
        if !h.starts_with(&self.history[..self.seen.min(self.history.len())]) {
            // Another sequence, or the history was rewritten: start over.
            self.table.clear();
            self.seen = 0;
        }
        let n = self.n;
        for end in self.seen.max(n)..h.len() {
            let next = h[end];
            *self
                .table
                .entry(Self::key(&h[end - n..end]))
                .or_default()
                .entry(next)
                .or_default() += 1;
        }
        self.seen = h.len();
        self.history.clear();
        self.history.extend_from_slice(h);
    }
}

impl Default for NgramCache {
    /// Three-token contexts, continuations seen twice and at least half the time.
    fn default() -> Self {
        Self::new(3, 2, 0.5)
    }
}

impl Drafter for NgramCache {
    fn name(&self) -> &'static str {
        "ngram-cache"
    }

    fn begin(&mut self, prompt: &[u32]) -> Result<(), SpecError> {
        self.table.clear();
        self.seen = 0;
        self.history.clear();
        self.update(prompt);
        Ok(())
    }

    fn draft(&mut self, p: &DraftParams<'_>) -> Result<Vec<u32>, SpecError> {
        self.update(p.history);
        let mut ctx: Vec<u32> = p.history[p.history.len().saturating_sub(self.n)..].to_vec();
        let mut out = Vec::new();
        while out.len() < p.n_max && ctx.len() == self.n {
            let Some(next) = self.table.get(&Self::key(&ctx)) else {
                break;
            };
            let total: u32 = next.values().sum();
            // The most frequent continuation, the lowest id among equals.
            let Some((&tok, &count)) = next.iter().max_by(|a, b| a.1.cmp(b.1).then(b.0.cmp(a.0)))
            else {
                break;
            };
            #[allow(clippy::cast_precision_loss, reason = "a share of small counts as f32")]
            let share = count as f32 / total.max(1) as f32;
            if count < self.min_count || share < self.min_share {
                break;
            }
            out.push(tok);
            ctx.remove(0);
            ctx.push(tok);
        }
        Ok(out)
    }

    fn state(&self) -> DrafterState {
        Box::new(self.clone())
    }

    fn restore(&mut self, state: &DrafterState) -> Result<(), SpecError> {
        let s = state
            .downcast_ref::<Self>()
            .ok_or(SpecError::ForeignState("ngram-cache"))?;
        *self = s.clone();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn draft(d: &mut dyn Drafter, h: &[u32], n_max: usize) -> Vec<u32> {
        d.draft(&DraftParams {
            history: h,
            n_max,
            p_min: 0.0,
            window: None,
        })
        .unwrap()
    }

    #[test]
    fn prompt_lookup_takes_the_most_recent_longest_match() {
        let mut d = NgramSimple::new(1, 3);
        // Tail `2 3` occurs at 1 (followed by 9) and at 5 (followed by 4): the later wins.
        let h = [1, 2, 3, 9, 0, 2, 3, 4, 7, 2, 3];
        assert_eq!(draft(&mut d, &h, 2), vec![4, 7]);
        // Bounded by the history's end and by n_max.
        assert_eq!(draft(&mut d, &h, 10), vec![4, 7, 2, 3]);
        assert!(draft(&mut d, &[1, 2, 3], 4).is_empty());
        assert!(draft(&mut d, &h, 0).is_empty());
    }

    #[test]
    fn ngram_cache_chains_frequent_continuations_only() {
        let mut d = NgramCache::new(2, 2, 0.5);
        let h = [1, 2, 3, 1, 2, 3, 1, 2];
        d.begin(&h).unwrap();
        // (1,2) → 3 twice, (2,3) → 1 twice, (3,1) → 2 twice.
        assert_eq!(draft(&mut d, &h, 4), vec![3, 1, 2, 3]);
        // Seen once: not drafted.
        let mut d = NgramCache::new(2, 2, 0.5);
        assert!(draft(&mut d, &[5, 6, 7, 5, 6], 3).is_empty());
    }

    #[test]
    fn ngram_cache_starts_over_on_another_history() {
        let mut d = NgramCache::new(1, 1, 0.0);
        assert_eq!(draft(&mut d, &[4, 5, 4], 1), vec![5]);
        assert_eq!(draft(&mut d, &[9, 8, 9], 1), vec![8]);
        let s = d.state();
        // 9 was followed by 8 and by 7 once each: the lower id wins the tie.
        assert_eq!(draft(&mut d, &[9, 8, 9, 7, 9], 1), vec![7]);
        d.restore(&s).unwrap();
        assert!(d.restore(&NgramSimple::default().state()).is_err());
    }
}
