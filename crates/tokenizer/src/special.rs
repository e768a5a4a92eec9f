//! Special tokens in prompt text, as llama.cpp's `tokenizer_st_partition`.
//!
//! llama.cpp takes the special tokens (control, user-defined and unknown) longest first, and
//! for each one cuts every still-raw fragment of the text at its leftmost non-overlapping
//! occurrences. Control and unknown tokens take part only with `parse_special`; user-defined
//! ones always do. Tokens with the `LSTRIP` / `RSTRIP` attribute also swallow the ASCII
//! whitespace next to them.
//!
//! Doing that literally costs one scan of the text per special token (Gemma-3 has 6 414).
//! Here one Aho-Corasick pass finds every occurrence of every special token, and the
//! occurrences are then accepted in llama.cpp's order — token priority, then position — if
//! they lie wholly in bytes no earlier token claimed. That is the same partition: a raw
//! fragment is exactly a maximal run of unclaimed bytes, and scanning a fragment left to
//! right for non-overlapping occurrences accepts exactly the occurrences that do not overlap
//! an accepted one.

use aho_corasick::{AhoCorasick, AhoCorasickBuilder, MatchKind};

use crate::TokenId;
use crate::vocab::{TokenAttr, Vocab};

/// A piece of partitioned text.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Fragment {
    /// Raw text, a byte range of the input.
    Text(usize, usize),
    /// A special token matched in the text.
    Token(TokenId),
}

#[derive(Debug)]
pub(crate) struct SpecialMatcher {
    /// Patterns in priority order (longest first); `None` when there are no special tokens.
    ac: Option<AhoCorasick>,
    /// Pattern index -> token id.
    ids: Vec<TokenId>,
    /// Pattern index -> attributes.
    attrs: Vec<TokenAttr>,
}

/// `isspace` in the C locale.
fn is_c_space(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | 0x0B | 0x0C | b'\r')
}

const FREE: u8 = 0;
const CLAIMED: u8 = 1;

/// Orders occurrences by (priority, start). Aho-Corasick reports them by end position, so
/// each pattern's occurrences already come by start: a counting sort on the pattern index is
/// enough, and linear (runs of spaces produce many overlapping occurrences).
fn sort_by_priority(found: &mut Vec<(usize, usize, usize)>, n_patterns: usize) {
    if found.len() < 64 {
        found.sort_unstable();
        return;
    }
    let mut first = vec![0usize; n_patterns + 1];
    for &(p, _, _) in found.iter() {
        first[p + 1] += 1;
    }
    for i in 1..first.len() {
        first[i] += first[i - 1];
    }
    let mut sorted = vec![(0, 0, 0); found.len()];
    for &f in found.iter() {
        sorted[first[f.0]] = f;
        first[f.0] += 1;
    }
    *found = sorted;
}

impl SpecialMatcher {
    pub(crate) fn new(vocab: &Vocab) -> Self {
        let ids = vocab.special_cache.clone();
        let attrs: Vec<TokenAttr> = ids.iter().map(|&id| vocab.attrs[id as usize]).collect();
        let ac = if ids.is_empty() {
            None
        } else {
            let patterns: Vec<&str> = ids
                .iter()
                .map(|&id| vocab.texts[id as usize].as_str())
                .collect();
            // Special token texts are never empty (llama.cpp renames empty tokens), so the
            // automaton always builds; fall back to "no special tokens" if it does not.
            AhoCorasickBuilder::new()
                .match_kind(MatchKind::Standard)
                .build(&patterns)
                .ok()
        };
        Self { ac, ids, attrs }
    }

    /// Cuts `text` into raw fragments and special tokens, appending them to `out`.
    pub(crate) fn partition(&self, text: &str, parse_special: bool, out: &mut Vec<Fragment>) {
        if text.is_empty() {
            return;
        }
        let skipped = TokenAttr::CONTROL | TokenAttr::UNKNOWN;
        let mut found: Vec<(usize, usize, usize)> = Vec::new();
        if let Some(ac) = &self.ac {
            for m in ac.find_overlapping_iter(text) {
                let p = m.pattern().as_usize();
                if !parse_special && self.attrs[p].intersects(skipped) {
                    continue;
                }
                found.push((p, m.start(), m.end()));
            }
        }
        if found.is_empty() {
            out.push(Fragment::Text(0, text.len()));
            return;
        }
        sort_by_priority(&mut found, self.ids.len());

        let bytes = text.as_bytes();
        let mut state = vec![FREE; bytes.len()];
        // start -> pattern index of each accepted occurrence
        let mut accepted: Vec<(usize, usize, usize)> = Vec::new();
        for &(p, s, e) in &found {
            if state[s..e].iter().any(|&b| b != FREE) {
                continue;
            }
            state[s..e].fill(CLAIMED);
            let attr = self.attrs[p];
            if attr.intersects(TokenAttr::LSTRIP) {
                let mut i = s;
                while i > 0 && state[i - 1] == FREE && is_c_space(bytes[i - 1]) {
                    i -= 1;
                    state[i] = CLAIMED;
                }
            }
            if attr.intersects(TokenAttr::RSTRIP) {
                let mut i = e;
                while i < bytes.len() && state[i] == FREE && is_c_space(bytes[i]) {
                    state[i] = CLAIMED;
                    i += 1;
                }
            }
            accepted.push((s, e, p));
        }
        accepted.sort_unstable();

        // Raw runs between claimed bytes, and the tokens in text order.
        let mut pos = 0;
        let push_free_runs = |from: usize, to: usize, out: &mut Vec<Fragment>| {
            let mut i = from;
            while i < to {
                if state[i] != FREE {
                    i += 1;
                    continue;
                }
                let start = i;
                while i < to && state[i] == FREE {
                    i += 1;
                }
                out.push(Fragment::Text(start, i));
            }
        };
        for &(s, e, p) in &accepted {
            push_free_runs(pos, s, out);
            out.push(Fragment::Token(self.ids[p]));
            pos = e;
        }
        push_free_runs(pos, bytes.len(), out);
    }
}
