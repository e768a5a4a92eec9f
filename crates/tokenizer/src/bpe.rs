//! Byte-pair encoding by merge rank, as llama.cpp's `llm_tokenizer_bpe_session`.
//!
//! llama.cpp merges inside each pre-tokenizer word: start from one symbol per character of
//! the (byte-encoded) word, repeatedly merge the adjacent pair with the lowest merge rank
//! (ties: the leftmost), and emit each final symbol's token — or, when a merged string is not
//! in the vocabulary, one token per byte. Strings are interned to integer symbols at load time
//! so that a merge is one hash lookup of a pair of integers.
//!
//! Two equivalent merge loops: a linear scan for short words (most words) and llama.cpp's
//! priority queue with lazy deletion for long ones; `merge_matches_heap` checks they agree.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use rustc_hash::FxHashMap;

use crate::TokenId;
use crate::pretokenize::{PreTokenizer, PreType};
use crate::unicode::BYTE_TO_CHAR;
use crate::vocab::Vocab;

/// A symbol that is neither a token nor part of any merge.
const NO_SYM: u32 = u32::MAX;
const NO_TOKEN: u32 = u32::MAX;
/// Words up to this many symbols use the linear scan.
const SHORT_WORD: usize = 48;

#[derive(Debug)]
pub(crate) struct Bpe {
    pre: PreTokenizer,
    /// `(left, right)` symbols -> `(rank, merged symbol)`; the first rank of a pair wins.
    merges: FxHashMap<(u32, u32), (u32, u32)>,
    /// Symbol -> token id, or `NO_TOKEN`.
    sym_token: Vec<u32>,
    /// Interned strings (token texts and merge operands/results) -> symbol.
    interner: FxHashMap<Box<str>, u32>,
    /// Byte-level mode: the symbol of each byte's alphabet character.
    byte_sym: Vec<u32>,
    /// The tokens a byte falls back to when its symbol did not end as a token.
    byte_fallback: Vec<Vec<TokenId>>,
    ignore_merges: bool,
    escape_whitespaces: bool,
    /// Gemma-4: a word of newlines that is a token is taken whole.
    whole_newline_words: bool,
}

/// A merge candidate: (rank, left, right, merged symbol, combined length); the heap pops
/// the lowest rank, then the leftmost.
type Candidate = (u32, usize, usize, u32, u32);

/// One symbol of a word being merged: interned id and byte span in the word.
#[derive(Clone, Copy, Debug)]
struct Sym {
    sym: u32,
    start: u32,
    len: u32,
}

fn intern(interner: &mut FxHashMap<Box<str>, u32>, sym_token: &mut Vec<u32>, s: &str) -> u32 {
    if let Some(&id) = interner.get(s) {
        return id;
    }
    let id = u32::try_from(sym_token.len()).unwrap_or(NO_SYM);
    interner.insert(s.into(), id);
    sym_token.push(NO_TOKEN);
    id
}

impl Bpe {
    pub(crate) fn new(vocab: &Vocab, merges: &[String], pre: PreTokenizer) -> Self {
        let mut interner: FxHashMap<Box<str>, u32> = FxHashMap::with_capacity_and_hasher(
            vocab.n_tokens() + merges.len(),
            Default::default(),
        );
        let mut sym_token: Vec<u32> = Vec::with_capacity(vocab.n_tokens() + merges.len());
        // Token texts first; a text's token is the one `token_to_id` keeps (the last).
        for text in &vocab.texts {
            let s = intern(&mut interner, &mut sym_token, text);
            if let Some(id) = vocab.lookup(text) {
                sym_token[s as usize] = id;
            }
        }
        let mut merge_map: FxHashMap<(u32, u32), (u32, u32)> =
            FxHashMap::with_capacity_and_hasher(merges.len(), Default::default());
        let mut joined = String::new();
        for (rank, m) in merges.iter().enumerate() {
            // llama.cpp splits at the first space from byte 1 on; no space: ("", "").
            let space = m.bytes().skip(1).position(|b| b == b' ').map(|p| p + 1);
            let (first, second) = match space {
                Some(p) => (&m[..p], &m[p + 1..]),
                None => ("", ""),
            };
            let l = intern(&mut interner, &mut sym_token, first);
            let r = intern(&mut interner, &mut sym_token, second);
            joined.clear();
            joined.push_str(first);
            joined.push_str(second);
            let j = intern(&mut interner, &mut sym_token, &joined);
            let rank = u32::try_from(rank).unwrap_or(u32::MAX);
            merge_map.entry((l, r)).or_insert((rank, j));
        }
        let mut byte_sym = vec![NO_SYM; 256];
        let mut byte_fallback = Vec::with_capacity(256);
        let mut buf = [0u8; 4];
        for b in 0..=255u8 {
            if pre.byte_encode {
                let c = BYTE_TO_CHAR[b as usize].encode_utf8(&mut buf);
                byte_sym[b as usize] = intern(&mut interner, &mut sym_token, c);
                // llama.cpp looks up each byte of the encoded character as a one-byte
                // string; only ASCII bytes can be vocabulary strings.
                let fb = c
                    .bytes()
                    .filter(|x| x.is_ascii())
                    .filter_map(|x| vocab.lookup(char::from(x).encode_utf8(&mut [0u8; 4])))
                    .collect();
                byte_fallback.push(fb);
            } else {
                let hex = format!("<0x{b:02X}>");
                byte_fallback.push(vocab.lookup(&hex).into_iter().collect());
            }
        }
        // Sized for every token and merge operand, filled with far fewer distinct strings.
        interner.shrink_to_fit();
        Self {
            pre,
            merges: merge_map,
            sym_token,
            interner,
            byte_sym,
            byte_fallback,
            ignore_merges: vocab.ignore_merges,
            escape_whitespaces: vocab.escape_whitespaces,
            whole_newline_words: vocab.pre == PreType::Gemma4,
        }
    }

    /// Tokenizes one raw-text fragment (`llm_tokenizer_bpe_session::tokenize`).
    pub(crate) fn encode(&self, text: &str, vocab: &Vocab, out: &mut Vec<TokenId>) {
        let escaped;
        let text = if self.escape_whitespaces {
            escaped = text.replace(' ', "\u{2581}");
            escaped.as_str()
        } else {
            text
        };
        let mut words = Vec::new();
        self.pre.split_ranges(text, &mut words);
        let mut syms: Vec<Sym> = Vec::new();
        let mut encoded = String::new();
        // Words repeat (identifiers, indentation, keywords): merge each distinct word once
        // per call. `cache` maps a word to its ids in `cached`.
        let mut cache: FxHashMap<&str, (usize, usize)> = FxHashMap::default();
        let mut cached: Vec<TokenId> = Vec::new();
        for &(s, e) in &words {
            let word = &text[s..e];
            if word.len() > 1 {
                if let Some(&(a, b)) = cache.get(word) {
                    out.extend_from_slice(&cached[a..b]);
                    continue;
                }
                let a = cached.len();
                self.encode_word(word, vocab, &mut syms, &mut encoded, &mut cached);
                out.extend_from_slice(&cached[a..]);
                cache.insert(word, (a, cached.len()));
            } else {
                self.encode_word(word, vocab, &mut syms, &mut encoded, out);
            }
        }
    }

    /// Merges one word and appends its ids.
    fn encode_word(
        &self,
        word: &str,
        vocab: &Vocab,
        syms: &mut Vec<Sym>,
        encoded: &mut String,
        out: &mut Vec<TokenId>,
    ) {
        if self.ignore_merges || (self.whole_newline_words && word.bytes().all(|b| b == b'\n')) {
            // Llama-3 style: a word that is a token is taken whole (Gemma-4: so are runs
            // of newlines).
            let key = if self.pre.byte_encode {
                encoded.clear();
                encoded.extend(word.bytes().map(|b| BYTE_TO_CHAR[b as usize]));
                encoded.as_str()
            } else {
                word
            };
            if let Some(id) = vocab.lookup(key) {
                out.push(id);
                return;
            }
        }
        syms.clear();
        if self.pre.byte_encode {
            for (i, b) in word.bytes().enumerate() {
                syms.push(Sym {
                    sym: self.byte_sym[b as usize],
                    start: u32::try_from(i).unwrap_or(u32::MAX),
                    len: 1,
                });
            }
        } else {
            let mut buf = [0u8; 4];
            for (i, c) in word.char_indices() {
                let sym = self
                    .interner
                    .get(&*c.encode_utf8(&mut buf))
                    .copied()
                    .unwrap_or(NO_SYM);
                syms.push(Sym {
                    sym,
                    start: u32::try_from(i).unwrap_or(u32::MAX),
                    len: u32::try_from(c.len_utf8()).unwrap_or(4),
                });
            }
        }
        if syms.len() <= SHORT_WORD {
            self.merge_short(syms);
        } else {
            self.merge_heap(syms);
        }
        for s in syms.iter() {
            let tok = if s.sym == NO_SYM {
                NO_TOKEN
            } else {
                self.sym_token[s.sym as usize]
            };
            if tok != NO_TOKEN {
                out.push(tok);
            } else {
                let bytes = &word.as_bytes()[s.start as usize..(s.start + s.len) as usize];
                for &b in bytes {
                    out.extend_from_slice(&self.byte_fallback[b as usize]);
                }
            }
        }
    }

    fn merge_of(&self, l: u32, r: u32) -> Option<(u32, u32)> {
        if l == NO_SYM || r == NO_SYM {
            return None;
        }
        self.merges.get(&(l, r)).copied()
    }

    /// Repeatedly merges the lowest-ranked adjacent pair, leftmost first.
    fn merge_short(&self, syms: &mut Vec<Sym>) {
        if syms.len() < 2 {
            return;
        }
        let mut ranks: Vec<(u32, u32)> = syms
            .windows(2)
            .map(|w| {
                self.merge_of(w[0].sym, w[1].sym)
                    .unwrap_or((u32::MAX, NO_SYM))
            })
            .collect();
        loop {
            let mut best = usize::MAX;
            let mut best_rank = u32::MAX;
            for (i, &(rank, _)) in ranks.iter().enumerate() {
                if rank < best_rank {
                    best_rank = rank;
                    best = i;
                }
            }
            if best == usize::MAX {
                break;
            }
            let merged = ranks[best].1;
            syms[best].sym = merged;
            syms[best].len += syms[best + 1].len;
            syms.remove(best + 1);
            ranks.remove(best);
            if best > 0 {
                ranks[best - 1] = self
                    .merge_of(syms[best - 1].sym, merged)
                    .unwrap_or((u32::MAX, NO_SYM));
            }
            if best < ranks.len() {
                ranks[best] = self
                    .merge_of(merged, syms[best + 1].sym)
                    .unwrap_or((u32::MAX, NO_SYM));
            }
        }
    }

    /// llama.cpp's loop: a min-queue of candidate pairs by (rank, left position), stale
    /// entries skipped when popped.
    fn merge_heap(&self, syms: &mut Vec<Sym>) {
        let n = syms.len();
        if n < 2 {
            return;
        }
        let mut prev: Vec<usize> = (0..n).map(|i| i.wrapping_sub(1)).collect();
        let mut next: Vec<usize> = (1..=n).collect();
        next[n - 1] = usize::MAX;
        let mut heap: BinaryHeap<Reverse<Candidate>> = BinaryHeap::new();
        let push = |heap: &mut BinaryHeap<_>, syms: &[Sym], l: usize, r: usize| {
            if let Some((rank, m)) = self.merge_of(syms[l].sym, syms[r].sym) {
                heap.push(Reverse((rank, l, r, m, syms[l].len + syms[r].len)));
            }
        };
        for i in 0..n - 1 {
            push(&mut heap, syms, i, i + 1);
        }
        while let Some(Reverse((_, l, r, m, size))) = heap.pop() {
            if syms[l].len == 0 || syms[r].len == 0 || syms[l].len + syms[r].len != size {
                continue;
            }
            syms[l].sym = m;
            syms[l].len = size;
            syms[r].len = 0;
            next[l] = next[r];
            if next[r] != usize::MAX {
                prev[next[r]] = l;
            }
            if prev[l] != usize::MAX {
                push(&mut heap, syms, prev[l], l);
            }
            if next[l] != usize::MAX {
                push(&mut heap, syms, l, next[l]);
            }
        }
        syms.retain(|s| s.len > 0);
    }
}

#[cfg(test)]
impl Bpe {
    /// Both merge loops on the same word, for the equivalence test.
    pub(crate) fn merge_both(&self, word: &[u8]) -> (Vec<u32>, Vec<u32>) {
        let syms: Vec<Sym> = word
            .iter()
            .enumerate()
            .map(|(i, &b)| Sym {
                sym: self.byte_sym[b as usize],
                start: u32::try_from(i).unwrap(),
                len: 1,
            })
            .collect();
        let (mut a, mut b) = (syms.clone(), syms);
        self.merge_short(&mut a);
        self.merge_heap(&mut b);
        (
            a.iter().map(|s| s.sym).collect(),
            b.iter().map(|s| s.sym).collect(),
        )
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use specula_gguf::{Array, Gguf, GgufWriter, Value};

    use crate::{Model, Tokenizer};

    /// A byte-level vocabulary over `abcd` whose merges (all two-letter pairs, then pairs of
    /// pairs) come in the order `order` gives.
    fn tokenizer(order: &[usize]) -> Tokenizer {
        let letters = ["a", "b", "c", "d"];
        let mut merges: Vec<String> = Vec::new();
        let mut tokens: Vec<String> = letters.iter().map(|s| (*s).to_owned()).collect();
        for l in letters {
            for r in letters {
                merges.push(format!("{l} {r}"));
                tokens.push(format!("{l}{r}"));
            }
        }
        for l in ["ab", "ba", "cc", "dd"] {
            for r in ["ab", "cd", "aa"] {
                merges.push(format!("{l} {r}"));
                tokens.push(format!("{l}{r}"));
            }
        }
        let merges: Vec<String> = order
            .iter()
            .map(|&i| merges[i % merges.len()].clone())
            .collect();
        let mut w = GgufWriter::new();
        w.add("tokenizer.ggml.model", Value::String("gpt2".into()))
            .unwrap();
        w.add("tokenizer.ggml.pre", Value::String("qwen2".into()))
            .unwrap();
        w.add("tokenizer.ggml.tokens", Value::Array(Array::String(tokens)))
            .unwrap();
        w.add("tokenizer.ggml.merges", Value::Array(Array::String(merges)))
            .unwrap();
        Tokenizer::from_gguf(&Gguf::from_bytes(w.to_vec(&[]).unwrap()).unwrap()).unwrap()
    }

    proptest! {
        /// The linear scan used for short words and llama.cpp's priority queue merge alike.
        #[test]
        fn merge_matches_heap(
            order in Just((0..28).collect::<Vec<usize>>()).prop_shuffle(),
            word in "[abcd]{0,120}",
        ) {
            let tok = tokenizer(&order);
            let Model::Bpe(bpe) = &tok.model else { unreachable!("a gpt2 vocabulary") };
            let (short, heap) = bpe.merge_both(word.as_bytes());
            prop_assert_eq!(short, heap);
        }
    }
}
