//! Ids back to text, as llama.cpp's `token_to_piece` and `detokenize`.

use crate::TokenId;
use crate::unicode::decode_byte_level;
use crate::vocab::{TokenAttr, Vocab, VocabKind};

/// Every token's piece with special tokens rendered (`cache_token_to_piece`), in one buffer.
#[derive(Debug)]
pub(crate) struct Pieces {
    bytes: Vec<u8>,
    /// `ends[i]` is the end of token `i`'s piece; it starts at `ends[i - 1]` (or 0).
    ends: Vec<usize>,
}

/// The byte of a `<0xXX>` token (`token_to_byte`: `strtol` of characters 3 and 4).
fn byte_of_hex_token(text: &str) -> u8 {
    let hex = text.get(3..5).unwrap_or("");
    // strtol stops at the first non-hex digit.
    let mut v: u32 = 0;
    for c in hex.chars() {
        match c.to_digit(16) {
            Some(d) => v = v * 16 + d,
            None => break,
        }
    }
    u8::try_from(v).unwrap_or(u8::MAX)
}

fn piece_of(vocab: &Vocab, id: usize, out: &mut Vec<u8>) {
    let attr = vocab.attrs[id];
    let text = &vocab.texts[id];
    let shown = TokenAttr::UNKNOWN | TokenAttr::CONTROL | TokenAttr::USER_DEFINED;
    if attr.intersects(shown) {
        out.extend_from_slice(text.as_bytes());
    } else if attr.intersects(TokenAttr::NORMAL) {
        let unescape = vocab.kind == VocabKind::Spm || vocab.escape_whitespaces;
        if unescape {
            out.extend_from_slice(text.replace('\u{2581}', " ").as_bytes());
        } else {
            decode_byte_level(text, out);
        }
    } else if attr.intersects(TokenAttr::BYTE) {
        out.push(byte_of_hex_token(text));
    }
}

impl Pieces {
    pub(crate) fn new(vocab: &Vocab) -> Self {
        let mut bytes = Vec::with_capacity(vocab.n_tokens() * 6);
        let mut ends = Vec::with_capacity(vocab.n_tokens());
        for id in 0..vocab.n_tokens() {
            piece_of(vocab, id, &mut bytes);
            ends.push(bytes.len());
        }
        Self { bytes, ends }
    }

    /// The cached piece (special tokens rendered).
    pub(crate) fn get(&self, id: TokenId) -> &[u8] {
        let i = id as usize;
        let start = if i == 0 { 0 } else { self.ends[i - 1] };
        &self.bytes[start..self.ends[i]]
    }
}

/// `token_to_piece`: the piece of `id`, empty for control and unknown tokens unless
/// `special`, with up to `lstrip` leading spaces removed. Out-of-range ids give nothing.
pub(crate) fn token_to_piece<'a>(
    vocab: &Vocab,
    pieces: &'a Pieces,
    id: TokenId,
    lstrip: usize,
    special: bool,
) -> &'a [u8] {
    if id as usize >= vocab.n_tokens() {
        return &[];
    }
    if !special && vocab.attrs[id as usize].intersects(TokenAttr::UNKNOWN | TokenAttr::CONTROL) {
        return &[];
    }
    let mut p = pieces.get(id);
    let mut n = 0;
    while n < lstrip && p.first() == Some(&b' ') {
        p = &p[1..];
        n += 1;
    }
    p
}

/// `detokenize`.
pub(crate) fn detokenize(
    vocab: &Vocab,
    pieces: &Pieces,
    mut ids: &[TokenId],
    remove_special: bool,
    unparse_special: bool,
) -> Vec<u8> {
    let mut remove_space = vocab.add_space_prefix;
    if remove_special && vocab.add_bos && ids.first().is_some_and(|&f| Some(f) == vocab.special.bos)
    {
        remove_space = false;
        ids = &ids[1..];
    }
    if remove_special && vocab.add_eos && ids.last().is_some_and(|&l| Some(l) == vocab.special.eos)
    {
        ids = &ids[..ids.len() - 1];
    }
    let mut text = Vec::new();
    for &id in ids {
        let lstrip = usize::from(remove_space);
        text.extend_from_slice(token_to_piece(vocab, pieces, id, lstrip, unparse_special));
        remove_space = false;
    }
    if vocab.clean_spaces {
        clean_spaces(&mut text);
    }
    text
}

/// The three clean-up passes of `detokenize` (`clean_up_tokenization_spaces`), byte for byte.
fn clean_spaces(text: &mut Vec<u8>) {
    // " ?", " !", " .", " ,": drop the space.
    let n = text.len();
    let mut total = usize::from(n > 0);
    for i in 1..n {
        let x = text[i];
        if text[i - 1] == b' ' && matches!(x, b'?' | b'!' | b'.' | b',') {
            total -= 1;
        }
        text[total] = x;
        total += 1;
    }
    text.truncate(total);

    // " ' ": drop both spaces around a lone apostrophe.
    let n = text.len();
    let mut total = usize::from(n > 0);
    let mut i = 1;
    while i < n {
        let x = text[i];
        if x == b'\'' && i + 1 < n && text[i - 1] == b' ' && text[i + 1] == b' ' {
            total -= 1;
            text[i + 1] = 0;
            i += 1;
        }
        text[total] = x;
        total += 1;
        i += 1;
    }
    text.truncate(total);

    // " 's", " 'm", " 're", " 've": drop the space.
    let n = text.len();
    let mut total = usize::from(n > 0);
    for i in 1..n {
        let x = text[i];
        if text[i - 1] == b' ' && x == b'\'' && i + 1 < n {
            let x1 = text[i + 1];
            if x1 == b's' || x1 == b'm' {
                total -= 1;
            } else if i + 2 < n {
                let x2 = text[i + 2];
                if x2 == b'e' && (x1 == b'r' || x1 == b'v') {
                    total -= 1;
                }
            }
        }
        text[total] = x;
        total += 1;
    }
    text.truncate(total);
}
