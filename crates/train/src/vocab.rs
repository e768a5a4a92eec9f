//! The reduced draft vocabulary: the most frequent target tokens, in ascending id order, and
//! the map both ways (`d2t` as llama.cpp's converter stores it: absolute target ids).

/// A draft vocabulary.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DraftVocab {
    /// Draft index → target id, strictly increasing.
    d2t: Vec<u32>,
    /// Target id → draft index.
    t2d: Vec<Option<u32>>,
    /// Whether this is the target's whole vocabulary (no `d2t` is exported then).
    full: bool,
}

impl DraftVocab {
    /// The `k` most frequent ids of `counts` (ties to the lower id); `k = 0` or `k ≥` the
    /// vocabulary gives the whole vocabulary.
    #[must_use]
    pub fn most_frequent(counts: &[u64], k: usize) -> Self {
        let n = counts.len();
        if k == 0 || k >= n {
            return Self::from_ids(
                (0..n)
                    .map(|i| u32::try_from(i).unwrap_or(u32::MAX))
                    .collect(),
                n,
            );
        }
        let mut order: Vec<usize> = (0..n).collect();
        order.sort_by(|&a, &b| counts[b].cmp(&counts[a]).then(a.cmp(&b)));
        let mut ids: Vec<u32> = order[..k]
            .iter()
            .map(|&i| u32::try_from(i).unwrap_or(u32::MAX))
            .collect();
        ids.sort_unstable();
        Self::from_ids(ids, n)
    }

    /// The vocabulary of the given ascending, distinct target ids (all `< n_vocab`).
    #[must_use]
    pub fn from_ids(d2t: Vec<u32>, n_vocab: usize) -> Self {
        let mut t2d = vec![None; n_vocab];
        for (d, &t) in d2t.iter().enumerate() {
            if let Some(slot) = t2d.get_mut(t as usize) {
                *slot = u32::try_from(d).ok();
            }
        }
        let full = d2t.len() == n_vocab;
        Self { d2t, t2d, full }
    }

    /// Draft index of target id `t`, if it is in the vocabulary.
    #[must_use]
    pub fn draft_id(&self, t: u32) -> Option<usize> {
        self.t2d
            .get(t as usize)
            .copied()
            .flatten()
            .map(|d| d as usize)
    }

    /// Target ids in draft order.
    #[must_use]
    pub fn ids(&self) -> Vec<u32> {
        self.d2t.clone()
    }

    /// Size of the draft vocabulary.
    #[must_use]
    pub fn len(&self) -> usize {
        self.d2t.len()
    }

    /// Whether it is empty.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.d2t.is_empty()
    }

    /// Whether it is the target's whole vocabulary.
    #[must_use]
    pub fn is_full(&self) -> bool {
        self.full
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_the_most_frequent_in_id_order() {
        let v = DraftVocab::most_frequent(&[5, 0, 9, 9, 1, 7], 3);
        assert_eq!(v.ids(), vec![2, 3, 5]);
        assert_eq!(v.draft_id(5), Some(2));
        assert_eq!(v.draft_id(0), None);
        assert!(!v.is_full());
        // Ties go to the lower id.
        assert_eq!(
            DraftVocab::most_frequent(&[1, 1, 1, 1], 2).ids(),
            vec![0, 1]
        );
        let all = DraftVocab::most_frequent(&[0, 0, 3], 0);
        assert!(all.is_full());
        assert_eq!(all.draft_id(1), Some(1));
    }
}
