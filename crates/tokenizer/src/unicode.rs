//! Code point classes and GPT-2's byte-to-character map, as llama.cpp's `src/unicode.cpp`.
//!
//! The classes come from llama.cpp's own tables (`unicode_data.rs`, generated from its
//! `unicode-data.cpp`), not from Rust's `char` methods: the pre-tokenizers must draw word
//! boundaries exactly where llama.cpp draws them, and the two disagree on code points that
//! changed category between Unicode versions.

use crate::unicode_data::FLAG_RANGES;

/// llama.cpp's `unicode_cpt_flags` bits.
pub(crate) mod bits {
    pub(crate) const UNDEFINED: u16 = 0x0001;
    pub(crate) const NUMBER: u16 = 0x0002;
    pub(crate) const LETTER: u16 = 0x0004;
    pub(crate) const ACCENT_MARK: u16 = 0x0010;
    pub(crate) const PUNCTUATION: u16 = 0x0020;
    pub(crate) const SYMBOL: u16 = 0x0040;
    pub(crate) const CATEGORIES: u16 = 0x00FF;
    pub(crate) const WHITESPACE: u16 = 0x0100;
}

/// The flags of one code point; `Flags(0)` stands for "outside the current range", which
/// llama.cpp's splitters use as a sentinel (every real code point has at least one bit).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Flags(pub(crate) u16);

impl Flags {
    pub(crate) const OUT: Self = Self(0);

    pub(crate) fn is_number(self) -> bool {
        self.0 & bits::NUMBER != 0
    }
    pub(crate) fn is_letter(self) -> bool {
        self.0 & bits::LETTER != 0
    }
    pub(crate) fn is_accent_mark(self) -> bool {
        self.0 & bits::ACCENT_MARK != 0
    }
    pub(crate) fn is_whitespace(self) -> bool {
        self.0 & bits::WHITESPACE != 0
    }
    /// `as_uint() != 0`: a real code point (not the out-of-range sentinel).
    pub(crate) fn any(self) -> bool {
        self.0 != 0
    }
    pub(crate) fn category(self) -> u16 {
        self.0 & bits::CATEGORIES
    }
}

const fn ascii_table() -> [u16; 128] {
    let mut table = [0u16; 128];
    let mut r = 0;
    while r < FLAG_RANGES.len() && FLAG_RANGES[r].0 < 128 {
        let end = if r + 1 < FLAG_RANGES.len() && FLAG_RANGES[r + 1].0 < 128 {
            FLAG_RANGES[r + 1].0
        } else {
            128
        };
        let mut c = FLAG_RANGES[r].0;
        while c < end {
            table[c as usize] = FLAG_RANGES[r].1;
            c += 1;
        }
        r += 1;
    }
    table
}

static ASCII: [u16; 128] = ascii_table();

/// `unicode_cpt_flags_from_cpt`.
pub(crate) fn flags(cpt: u32) -> Flags {
    if cpt < 128 {
        return Flags(ASCII[cpt as usize]);
    }
    if cpt >= 0x11_0000 {
        return Flags(bits::UNDEFINED);
    }
    let i = FLAG_RANGES.partition_point(|&(start, _)| start <= cpt);
    Flags(FLAG_RANGES[i - 1].1)
}

/// Whether `byte` is one of the 188 bytes GPT-2 maps to the code point of the same value.
const fn is_printable_byte(byte: u8) -> bool {
    matches!(byte, 0x21..=0x7E | 0xA1..=0xAC | 0xAE..=0xFF)
}

const fn byte_to_char_table() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut n = 0u32;
    let mut b = 0usize;
    while b < 256 {
        #[allow(clippy::cast_possible_truncation, reason = "b < 256 by the loop bound")]
        let byte = b as u8;
        let cpt = if is_printable_byte(byte) {
            byte as u32
        } else {
            n += 1;
            255 + n
        };
        table[b] = match char::from_u32(cpt) {
            Some(c) => c,
            None => '\0',
        };
        b += 1;
    }
    table
}

/// GPT-2's byte-level alphabet: each byte as the character that stands for it in the vocab
/// (`unicode_byte_to_utf8`).
pub(crate) static BYTE_TO_CHAR: [char; 256] = byte_to_char_table();

/// The inverse of [`BYTE_TO_CHAR`] (`unicode_utf8_to_byte`).
pub(crate) fn char_to_byte(c: char) -> Option<u8> {
    let cpt = u32::from(c);
    if let Ok(b) = u8::try_from(cpt)
        && is_printable_byte(b)
    {
        return Some(b);
    }
    if !(256..256 + 68).contains(&cpt) {
        return None;
    }
    // The n-th (0-based) byte that is not printable maps to 256 + n.
    let mut n = cpt - 256;
    for b in 0..=255u8 {
        if !is_printable_byte(b) {
            if n == 0 {
                return Some(b);
            }
            n -= 1;
        }
    }
    None
}

/// llama.cpp's `llama_decode_text`: a byte-level token text back to bytes. A character that
/// is not in the byte alphabet becomes `[UNK_BYTE_0x<hex of its UTF-8>` followed by the whole
/// token text and `]`, as llama.cpp writes it.
pub(crate) fn decode_byte_level(text: &str, out: &mut Vec<u8>) {
    for c in text.chars() {
        if let Some(b) = char_to_byte(c) {
            out.push(b);
        } else {
            out.extend_from_slice(b"[UNK_BYTE_0x");
            let mut buf = [0u8; 4];
            for byte in c.encode_utf8(&mut buf).bytes() {
                out.extend_from_slice(format!("{byte:02x}").as_bytes());
            }
            out.extend_from_slice(text.as_bytes());
            out.push(b']');
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_alphabet_round_trips() {
        for b in 0..=255u8 {
            assert_eq!(char_to_byte(BYTE_TO_CHAR[b as usize]), Some(b));
        }
        assert_eq!(BYTE_TO_CHAR[b' ' as usize], 'Ġ');
        assert_eq!(BYTE_TO_CHAR[b'\n' as usize], 'Ċ');
        assert_eq!(BYTE_TO_CHAR[b'a' as usize], 'a');
        assert_eq!(char_to_byte('中'), None);
    }

    #[test]
    fn classes_follow_llama_cpp() {
        assert!(flags(u32::from('a')).is_letter());
        assert!(flags(u32::from('7')).is_number());
        assert!(flags(u32::from(' ')).is_whitespace());
        assert!(flags(0x3000).is_whitespace());
        assert!(flags(u32::from('中')).is_letter());
        assert!(flags(u32::from('½')).is_number());
        assert!(flags(0x0301).is_accent_mark());
        assert_eq!(flags(u32::from('!')).category(), bits::PUNCTUATION);
        assert_eq!(flags(u32::from('$')).category(), bits::SYMBOL);
        assert!(flags(0x10_FFFF).any());
    }
}
