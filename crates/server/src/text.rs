//! Incremental text of a generation: token bytes become UTF-8 text as soon as they form whole
//! characters, stop strings end the text where they begin, and text that could still turn
//! into a stop string is held back until it cannot.

/// The text of one generation, released piece by piece.
#[derive(Debug, Default)]
pub(crate) struct TextStream {
    /// Bytes of an unfinished UTF-8 character.
    pending: Vec<u8>,
    /// Decoded text so far (cut at a stop string once one is found).
    text: String,
    /// Bytes of `text` already released.
    sent: usize,
    stops: Vec<String>,
    max_stop: usize,
    /// The stop string that ended the text, once one has.
    matched: Option<String>,
}

/// The largest char boundary of `s` at or below `i`.
fn floor_boundary(s: &str, mut i: usize) -> usize {
    i = i.min(s.len());
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

impl TextStream {
    /// A stream that stops at the first of `stops` (empty strings are ignored).
    pub(crate) fn new(stops: Vec<String>) -> Self {
        let stops: Vec<String> = stops.into_iter().filter(|s| !s.is_empty()).collect();
        let max_stop = stops.iter().map(String::len).max().unwrap_or(0);
        Self {
            stops,
            max_stop,
            ..Self::default()
        }
    }

    /// Decodes whole characters from `pending` into `text`; an invalid sequence becomes
    /// U+FFFD, an incomplete one at the end waits (or, with `flush`, becomes U+FFFD too).
    fn decode(&mut self, flush: bool) {
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(s) => {
                    self.text.push_str(s);
                    self.pending.clear();
                    return;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    if let Ok(s) = std::str::from_utf8(&self.pending[..valid]) {
                        self.text.push_str(s);
                    }
                    match e.error_len() {
                        Some(n) => {
                            self.text.push('\u{FFFD}');
                            self.pending.drain(..valid + n);
                        }
                        None if flush => {
                            self.text.push('\u{FFFD}');
                            self.pending.clear();
                            return;
                        }
                        None => {
                            self.pending.drain(..valid);
                            return;
                        }
                    }
                }
            }
        }
    }

    /// Adds a token's bytes; returns true when a stop string now appears (the text is cut
    /// where it begins).
    pub(crate) fn push(&mut self, bytes: &[u8]) -> bool {
        self.pending.extend_from_slice(bytes);
        self.decode(false);
        if self.stops.is_empty() {
            return false;
        }
        let start = floor_boundary(&self.text, self.sent.saturating_sub(self.max_stop));
        let hit = self
            .stops
            .iter()
            .filter_map(|s| self.text[start..].find(s.as_str()).map(|p| (start + p, s)))
            .min_by_key(|&(p, _)| p);
        match hit {
            Some((p, word)) => {
                self.matched = Some(word.clone());
                self.text.truncate(p.max(self.sent));
                self.pending.clear();
                true
            }
            None => false,
        }
    }

    /// The stop string that ended the text (llama-server's `stopping_word`), if one did.
    pub(crate) fn stopping_word(&self) -> Option<&str> {
        self.matched.as_deref()
    }

    /// The text that can be released now: everything decoded except an ending that is the
    /// beginning of a stop string.
    pub(crate) fn take_ready(&mut self) -> String {
        let unsent = &self.text[self.sent..];
        let mut hold = 0;
        for s in &self.stops {
            for k in (1..s.len().min(unsent.len() + 1)).rev() {
                if k > hold && s.is_char_boundary(k) && unsent.ends_with(&s[..k]) {
                    hold = k;
                    break;
                }
            }
        }
        let end = floor_boundary(&self.text, self.text.len() - hold);
        let out = self.text[self.sent..end].to_owned();
        self.sent = end;
        out
    }

    /// Everything not released yet, an unfinished character included (as U+FFFD).
    pub(crate) fn finish(&mut self) -> String {
        self.decode(true);
        let out = self.text[self.sent..].to_owned();
        self.sent = self.text.len();
        out
    }

    /// All the text so far.
    #[cfg(test)]
    pub(crate) fn text(&self) -> &str {
        &self.text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(pieces: &[&[u8]], stops: &[&str]) -> (String, bool) {
        let mut t = TextStream::new(stops.iter().map(|s| (*s).to_owned()).collect());
        let mut out = String::new();
        for p in pieces {
            if t.push(p) {
                out.push_str(&t.take_ready());
                out.push_str(&t.finish());
                return (out, true);
            }
            out.push_str(&t.take_ready());
        }
        out.push_str(&t.finish());
        (out, false)
    }

    #[test]
    fn a_stop_string_split_across_tokens_ends_the_text_before_it() {
        assert_eq!(
            run(&[b"Hello", b" wo", b"rld! x"], &["world"]),
            ("Hello ".into(), true)
        );
        assert_eq!(run(&[b"ab", b"c"], &["c", "bc"]), ("a".into(), true));
    }

    /// `stopping_word` of llama-server: the stop string that begins first, none before a hit.
    #[test]
    fn the_stop_string_that_ended_the_text_is_remembered() {
        let mut t = TextStream::new(vec!["c".into(), "bc".into()]);
        assert!(!t.push(b"ab"));
        assert_eq!(t.stopping_word(), None);
        assert!(t.push(b"c"));
        assert_eq!(t.stopping_word(), Some("bc"));
        assert_eq!(t.take_ready(), "a");
    }

    #[test]
    fn a_possible_stop_prefix_is_held_then_released_when_it_diverges() {
        let mut t = TextStream::new(vec!["STOP".into()]);
        assert!(!t.push(b"xx ST"));
        assert_eq!(t.take_ready(), "xx ");
        assert!(!t.push(b"Oy"));
        assert_eq!(t.take_ready(), "STOy");
        assert_eq!(t.finish(), "");
    }

    #[test]
    fn multibyte_characters_wait_for_their_last_byte() {
        let e = "é".as_bytes();
        let mut t = TextStream::new(Vec::new());
        t.push(&e[..1]);
        assert_eq!(t.take_ready(), "");
        t.push(&e[1..]);
        assert_eq!(t.take_ready(), "é");
        // An invalid byte is replaced, an unfinished character at the end is flushed.
        t.push(&[0xFF, b'a', 0xE2]);
        assert_eq!(t.take_ready(), "\u{FFFD}a");
        assert_eq!(t.finish(), "\u{FFFD}");
        assert_eq!(t.text(), "é\u{FFFD}a\u{FFFD}");
    }
}
