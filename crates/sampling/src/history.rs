//! The penalty window: the last `n` accepted tokens and how often each occurs in them.

use std::collections::VecDeque;

use crate::TokenId;

/// The last `window` accepted tokens (oldest first) and the per-token counts the penalties
/// read (llama.cpp keeps the same pair: a ring buffer and a `token → count` map). The counts
/// are a list sorted by token, at most `window` long, so updates are a binary search and a
/// short shift and no vocabulary-sized array is ever allocated or cleared.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct History {
    window: usize,
    tokens: VecDeque<TokenId>,
    counts: Vec<(TokenId, u32)>,
}

impl History {
    pub(crate) fn new(window: usize) -> Self {
        Self {
            window,
            tokens: VecDeque::new(),
            counts: Vec::new(),
        }
    }

    /// Appends `token`, dropping the oldest token once the window is full. A zero window keeps
    /// nothing.
    pub(crate) fn push(&mut self, token: TokenId) {
        if self.window == 0 {
            return;
        }
        if self.tokens.len() == self.window
            && let Some(old) = self.tokens.pop_front()
        {
            self.decrement(old);
        }
        self.tokens.push_back(token);
        match self.counts.binary_search_by_key(&token, |&(t, _)| t) {
            Ok(i) => self.counts[i].1 += 1,
            Err(i) => self.counts.insert(i, (token, 1)),
        }
    }

    fn decrement(&mut self, token: TokenId) {
        if let Ok(i) = self.counts.binary_search_by_key(&token, |&(t, _)| t) {
            self.counts[i].1 -= 1;
            if self.counts[i].1 == 0 {
                self.counts.remove(i);
            }
        }
    }

    /// `(token, occurrences)` for every token in the window, by ascending token.
    pub(crate) fn counts(&self) -> &[(TokenId, u32)] {
        &self.counts
    }

    /// The window's tokens, oldest first.
    pub(crate) fn tokens(&self) -> impl ExactSizeIterator<Item = TokenId> + '_ {
        self.tokens.iter().copied()
    }

    pub(crate) fn clear(&mut self) {
        self.tokens.clear();
        self.counts.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn window_drops_oldest_and_counts_follow() {
        let mut h = History::new(3);
        for t in [5, 7, 5] {
            h.push(t);
        }
        assert_eq!(h.counts(), [(5, 2), (7, 1)]);
        h.push(9); // drops the first 5
        assert_eq!(h.counts(), [(5, 1), (7, 1), (9, 1)]);
        h.push(9); // drops 7
        assert_eq!(h.counts(), [(5, 1), (9, 2)]);
        assert_eq!(h.tokens().collect::<Vec<_>>(), [5, 9, 9]);
        h.clear();
        assert!(h.counts().is_empty());
    }

    #[test]
    fn zero_window_keeps_nothing() {
        let mut h = History::new(0);
        h.push(1);
        assert!(h.counts().is_empty());
        assert_eq!(h.tokens().len(), 0);
    }
}
