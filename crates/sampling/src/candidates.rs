//! A candidate list: the tokens still in play after some steps of the chain, with their
//! (possibly transformed) logits and probabilities.

use std::cmp::Ordering;

use crate::TokenId;
use crate::steps::mass;

/// One token still in play.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Candidate {
    /// The token.
    pub id: TokenId,
    /// Its logit after the steps run so far (penalties, temperature).
    pub logit: f32,
    /// Its probability, valid after a step that normalises (top-p, and the final softmax of
    /// the chain); `0.0` before that.
    pub p: f32,
}

/// The rank order of the whole crate: higher logit first, and among equal logits the lower id
/// first (llama.cpp's greedy sampler picks the first maximum, i.e. the lowest id; its sorts are
/// unstable, so this is where specula pins down what llama.cpp leaves open). `-0.0` and `0.0`
/// count as equal logits. Candidates never hold NaN.
pub(crate) fn rank(a: &Candidate, b: &Candidate) -> Ordering {
    rank_key(b).cmp(&rank_key(a))
}

/// A `u64` that orders candidates as [`rank`] does, highest rank = largest key: the logit's
/// bits mapped to an unsigned integer that orders like the float (sign bit flipped for
/// positives, all bits flipped for negatives; `-0.0` first folded into `0.0`), above the
/// complemented id. Integer compares keep the sorts and selections branch-light.
fn rank_key(c: &Candidate) -> u64 {
    let bits = (c.logit + 0.0).to_bits();
    let ordered = if bits & 0x8000_0000 == 0 {
        bits | 0x8000_0000
    } else {
        !bits
    };
    (u64::from(ordered) << 32) | u64::from(!c.id)
}

/// A list of candidate tokens. After [`crate::Sampler::distribution`] it is the final sampling
/// distribution: every token not listed has probability 0, and the listed probabilities sum
/// to 1 (up to `f32` rounding).
///
/// Order: when [`Candidates::is_sorted`] is true the list is in rank order (probability
/// descending, ties by ascending id); that is the case whenever top-k ran, or top-p kept at
/// most 256 tokens. Otherwise no step needed to sort the whole list and its order is
/// unspecified (but deterministic): ascending id straight from the logits, or the 256 best in
/// rank order followed by the rest of the top-p set.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Candidates {
    pub(crate) items: Vec<Candidate>,
    pub(crate) sorted: bool,
}

impl Candidates {
    /// An empty list.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// Every token of `logits` whose logit is not −∞ or NaN, in id order, probabilities unset.
    /// Tokens beyond `u32::MAX` cannot be named by a [`TokenId`] and are left out.
    #[must_use]
    pub fn from_logits(logits: &[f32]) -> Self {
        let mut c = Self::new();
        c.fill_from_logits(logits);
        c
    }

    /// [`Candidates::from_logits`] into an existing list, reusing its allocation.
    pub fn fill_from_logits(&mut self, logits: &[f32]) {
        /// Token offsets within a chunk.
        const OFFSETS: [TokenId; 16] = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15];
        let max = usize::try_from(u64::from(TokenId::MAX) + 1).unwrap_or(usize::MAX);
        let logits = &logits[..logits.len().min(max)];
        self.items.clear();
        self.sorted = false;
        self.items.reserve(logits.len());
        let (chunks, tail) = logits.as_chunks::<16>();
        let mut first: TokenId = 0;
        let keep = |(id, &logit): (TokenId, &f32)| {
            (logit > f32::NEG_INFINITY).then_some(Candidate { id, logit, p: 0.0 })
        };
        for chunk in chunks {
            // Whole chunks without −∞ or NaN (nearly all of them) are copied without a branch
            // per token.
            let mut all = true;
            for &x in chunk {
                all &= x > f32::NEG_INFINITY;
            }
            if all {
                let block: [Candidate; 16] = std::array::from_fn(|j| Candidate {
                    id: first.wrapping_add(OFFSETS[j]),
                    logit: chunk[j],
                    p: 0.0,
                });
                self.items.extend_from_slice(&block);
            } else {
                self.items
                    .extend((first..=TokenId::MAX).zip(chunk).filter_map(keep));
            }
            first = first.wrapping_add(16);
        }
        self.items
            .extend((first..=TokenId::MAX).zip(tail).filter_map(keep));
    }

    /// The candidates.
    #[must_use]
    pub fn as_slice(&self) -> &[Candidate] {
        &self.items
    }

    /// How many tokens are in play.
    #[must_use]
    pub fn len(&self) -> usize {
        self.items.len()
    }

    /// Whether no token is in play.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// Whether the list is in rank order (see the type's documentation).
    #[must_use]
    pub fn is_sorted(&self) -> bool {
        self.sorted
    }

    /// The candidates, in list order.
    pub fn iter(&self) -> std::slice::Iter<'_, Candidate> {
        self.items.iter()
    }

    /// The entry of `id`, if it is in play. Linear in the list length.
    #[must_use]
    pub fn get(&self, id: TokenId) -> Option<&Candidate> {
        self.items.iter().find(|c| c.id == id)
    }

    /// The probability of `id`: its `p` if in play, else 0. This is the `p(x)` a rejection
    /// verifier needs. Linear in the list length.
    #[must_use]
    pub fn prob(&self, id: TokenId) -> f32 {
        self.get(id).map_or(0.0, |c| c.p)
    }

    /// The highest-ranked candidate (the argmax), if any.
    #[must_use]
    pub fn top(&self) -> Option<&Candidate> {
        if self.sorted {
            self.items.first()
        } else {
            self.items.iter().min_by(|a, b| rank(a, b))
        }
    }

    /// Inverse-CDF sampling: the first token (in list order) at which the running sum of `p`
    /// exceeds `u` × the total mass, for `u` in `[0, 1)`. The comparison is strict, so a token
    /// with `p = 0` is never returned. `None` when the list is empty or carries no mass.
    ///
    /// Sums are in `f64`, over blocks of 64 entries (each block summed in fixed partial sums,
    /// so the work vectorises); only the block where the sum crosses the target is walked
    /// token by token. The result is a deterministic function of the list and `u`.
    #[must_use]
    pub fn sample(&self, u: f64) -> Option<TokenId> {
        const BLOCK: usize = 64;
        let total: f64 = self.items.chunks(BLOCK).map(mass).sum();
        if total.is_nan() || total <= 0.0 {
            return None;
        }
        let target = u * total;
        let mut cum = 0.0f64;
        let mut last_positive = None;
        for block in self.items.chunks(BLOCK) {
            let block_mass = mass(block);
            if cum + block_mass > target {
                for c in block {
                    cum += f64::from(c.p);
                    if cum > target {
                        return Some(c.id);
                    }
                }
            } else {
                cum += block_mass;
            }
            if let Some(c) = block.iter().rev().find(|c| c.p > 0.0) {
                last_positive = Some(c.id);
            }
        }
        // Reached only when `u` is so close to 1 that rounding keeps the running sum from
        // exceeding `u * total`; the last token with mass is the right answer then.
        last_positive
    }

    /// Sorts the list into rank order.
    pub fn sort(&mut self) {
        if !self.sorted {
            self.items.sort_unstable_by(rank);
            self.sorted = true;
        }
    }

    pub(crate) fn clear(&mut self) {
        self.items.clear();
        self.sorted = false;
    }
}

impl<'a> IntoIterator for &'a Candidates {
    type Item = &'a Candidate;
    type IntoIter = std::slice::Iter<'a, Candidate>;

    fn into_iter(self) -> Self::IntoIter {
        self.items.iter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_probs(ps: &[f32]) -> Candidates {
        Candidates {
            items: (0..)
                .zip(ps)
                .map(|(id, &p)| Candidate { id, logit: 0.0, p })
                .collect(),
            sorted: false,
        }
    }

    #[test]
    fn from_logits_drops_neg_inf_and_nan() {
        let c = Candidates::from_logits(&[1.0, f32::NEG_INFINITY, f32::NAN, -3.0, f32::INFINITY]);
        let ids: Vec<TokenId> = c.iter().map(|c| c.id).collect();
        assert_eq!(ids, [0, 3, 4]);
        assert!(!c.is_sorted());
    }

    #[test]
    fn rank_puts_higher_logit_first_then_lower_id() {
        let a = Candidate {
            id: 5,
            logit: 1.0,
            p: 0.0,
        };
        let b = Candidate {
            id: 2,
            logit: 1.0,
            p: 0.0,
        };
        let c = Candidate {
            id: 9,
            logit: 2.0,
            p: 0.0,
        };
        let z = Candidate {
            id: 1,
            logit: -0.0,
            p: 0.0,
        };
        let z2 = Candidate {
            id: 0,
            logit: 0.0,
            p: 0.0,
        };
        let mut v = [a, b, c, z, z2];
        v.sort_by(rank);
        let ids: Vec<TokenId> = v.iter().map(|c| c.id).collect();
        assert_eq!(ids, [9, 2, 5, 0, 1]);
    }

    #[test]
    fn inverse_cdf_boundaries() {
        let c = with_probs(&[0.0, 0.25, 0.0, 0.75]);
        // u = 0 never returns a zero-probability token.
        assert_eq!(c.sample(0.0), Some(1));
        assert_eq!(c.sample(0.2499), Some(1));
        assert_eq!(c.sample(0.25), Some(3));
        assert_eq!(c.sample(1.0 - f64::EPSILON), Some(3));
        assert_eq!(with_probs(&[]).sample(0.5), None);
        assert_eq!(with_probs(&[0.0, 0.0]).sample(0.5), None);
    }

    #[test]
    fn prob_of_absent_token_is_zero() {
        let c = with_probs(&[0.5, 0.5]);
        assert_eq!(c.prob(1), 0.5);
        assert_eq!(c.prob(7), 0.0);
        assert_eq!(c.top().map(|c| c.id), Some(0));
    }
}
