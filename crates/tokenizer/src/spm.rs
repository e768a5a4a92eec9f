//! SentencePiece-style merging by score, as llama.cpp's `llm_tokenizer_spm_session`.
//!
//! The fragment (spaces already escaped to U+2581) starts as one symbol per character; the
//! adjacent pair whose concatenation is a vocabulary token with the highest score is merged
//! first (ties: the leftmost), until no pair forms a token. A final symbol that is not a
//! token (a character outside the vocabulary) becomes its bytes' `<0xXX>` tokens. Adjacent
//! symbols are contiguous in the text, so a candidate is a slice of it: no string is built.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use crate::TokenId;
use crate::vocab::Vocab;

#[derive(Debug)]
pub(crate) struct Spm {
    /// The longest token text in bytes: no longer concatenation can be a token.
    max_token_len: usize,
    /// The token of each byte when a character has none: `<0xXX>`, else the byte itself as a
    /// one-byte string (llama.cpp's `byte_to_token`).
    byte_tokens: Vec<Option<TokenId>>,
}

#[derive(Clone, Copy, Debug)]
struct Sym {
    start: usize,
    len: usize,
    prev: usize,
    next: usize,
}

const NONE: usize = usize::MAX;

#[derive(Debug)]
struct Bigram {
    score: f32,
    left: u32,
    right: u32,
    size: u32,
}

impl PartialEq for Bigram {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Bigram {}
impl PartialOrd for Bigram {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Bigram {
    /// The greatest is popped first: highest score, then the leftmost.
    fn cmp(&self, other: &Self) -> Ordering {
        self.score
            .partial_cmp(&other.score)
            .unwrap_or(Ordering::Equal)
            .then_with(|| other.left.cmp(&self.left))
    }
}

impl Spm {
    pub(crate) fn new(vocab: &Vocab) -> Self {
        let mut byte_tokens = vec![None; 256];
        for (b, slot) in byte_tokens.iter_mut().enumerate() {
            *slot = vocab.lookup(&format!("<0x{b:02X}>")).or_else(|| {
                u8::try_from(b)
                    .ok()
                    .filter(u8::is_ascii)
                    .and_then(|b| vocab.lookup(char::from(b).encode_utf8(&mut [0u8; 4])))
            });
        }
        let max_token_len = vocab.texts.iter().map(String::len).max().unwrap_or(0);
        Self {
            max_token_len,
            byte_tokens,
        }
    }

    /// The token of a byte (llama.cpp's `byte_to_token`), for the newline id.
    pub(crate) fn byte_token(&self, b: u8) -> Option<TokenId> {
        self.byte_tokens[b as usize]
    }

    /// Tokenizes one fragment whose spaces are already escaped.
    pub(crate) fn encode(&self, text: &str, vocab: &Vocab, out: &mut Vec<TokenId>) {
        if u32::try_from(text.len()).is_err() {
            // Split a fragment of 4 GiB or more in two at a character boundary; the merge
            // indices are 32-bit. (Exactness at the cut is not a concern at that size.)
            let mut mid = text.len() / 2;
            while !text.is_char_boundary(mid) {
                mid += 1;
            }
            self.encode(&text[..mid], vocab, out);
            self.encode(&text[mid..], vocab, out);
            return;
        }
        let max_len = self.max_token_len;
        let mut syms: Vec<Sym> = Vec::with_capacity(text.len());
        for (i, c) in text.char_indices() {
            let idx = syms.len();
            syms.push(Sym {
                start: i,
                len: c.len_utf8(),
                prev: idx.wrapping_sub(1),
                next: idx + 1,
            });
        }
        let Some(last) = syms.last_mut() else {
            return;
        };
        last.next = NONE;

        let mut queue: BinaryHeap<Bigram> = BinaryHeap::with_capacity(syms.len());
        let try_add = |queue: &mut BinaryHeap<Bigram>, syms: &[Sym], left: usize, right: usize| {
            if left == NONE || right == NONE {
                return;
            }
            let (l, r) = (&syms[left], &syms[right]);
            let piece = &text[l.start..r.start + r.len];
            if piece.len() > max_len {
                return;
            }
            if let Some(id) = vocab.lookup(piece) {
                // Indices and sizes fit: fragments are shorter than 4 GiB (checked below).
                queue.push(Bigram {
                    score: vocab.scores[id as usize],
                    left: u32::try_from(left).unwrap_or(u32::MAX),
                    right: u32::try_from(right).unwrap_or(u32::MAX),
                    size: u32::try_from(piece.len()).unwrap_or(u32::MAX),
                });
            }
        };
        for i in 1..syms.len() {
            try_add(&mut queue, &syms, i - 1, i);
        }
        while let Some(b) = queue.pop() {
            let (bl, br) = (b.left as usize, b.right as usize);
            let (l, r) = (syms[bl], syms[br]);
            if l.len == 0 || r.len == 0 || l.len + r.len != b.size as usize {
                continue;
            }
            syms[bl].len += r.len;
            syms[br].len = 0;
            syms[bl].next = r.next;
            if r.next != NONE {
                syms[r.next].prev = bl;
            }
            try_add(&mut queue, &syms, syms[bl].prev, bl);
            try_add(&mut queue, &syms, bl, syms[bl].next);
        }

        let mut i = 0;
        while i != NONE {
            let s = syms[i];
            let piece = &text[s.start..s.start + s.len];
            if let Some(id) = vocab.lookup(piece) {
                out.push(id);
            } else {
                // Merged symbols are always tokens, so this is a single character.
                for &byte in piece.as_bytes() {
                    out.extend(self.byte_tokens[byte as usize].or(vocab.special.unk));
                }
            }
            i = s.next;
        }
    }
}
