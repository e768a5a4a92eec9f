//! llama.cpp's `std::regex` fallback of `unicode_regex_split`, reproduced on `fancy-regex`.
//!
//! For a regex that uses Unicode classes (`\p{L}`, `\p{N}`, `\p{P}`, `\p{S}`, `\p{M}`,
//! `\p{Lu}`…), llama.cpp cannot hand it to `std::regex` (which has no Unicode classes), so it
//! *collapses* both sides: every code point of the text becomes one byte (ASCII stays ASCII,
//! other whitespace becomes `\v`, other code points become one byte per class: `0xD1` numbers,
//! `0xD2` letters, `0xD3` punctuation, `0xD4` marks, `0xD5` symbols, `0xD0` the rest), and every
//! `\p{X}` in the regex becomes a bracket of that byte plus the ASCII members of the class. A
//! regex without classes runs on the code points directly, with non-ASCII whitespace turned
//! into `\v` because `std::wregex`'s `\s` is ASCII-only.
//!
//! Here the collapsed bytes are the characters U+00D0…U+00D5, and the ECMAScript pattern is
//! translated into `fancy-regex` syntax with the ECMAScript meanings spelled out: `\s`, `\d`,
//! `\w` and `\b` are ASCII-only, `.` excludes line terminators, literals are hex escapes.

use crate::pretokenize::Text;
use crate::unicode::{Flags, bits};

/// A compiled fallback regex and how to present the text to it.
#[derive(Debug)]
pub(crate) struct CompatRegex {
    re: fancy_regex::Regex,
    /// Run on the collapsed text (the regex used `\p{…}` classes).
    collapsed: bool,
}

/// `k_ucat_enum`: the class names llama.cpp collapses, and the flag each stands for.
const UCAT: [(&str, u16); 10] = [
    ("\\p{N}", bits::NUMBER),
    ("\\p{L}", bits::LETTER),
    ("\\p{P}", bits::PUNCTUATION),
    ("\\p{M}", bits::ACCENT_MARK),
    ("\\p{S}", bits::SYMBOL),
    ("\\p{Lu}", bits::LETTER),
    ("\\p{Ll}", bits::LETTER),
    ("\\p{Lt}", bits::LETTER),
    ("\\p{Lm}", bits::LETTER),
    ("\\p{Lo}", bits::LETTER),
];

/// `k_ucat_cpt`: the collapsed character of a class.
fn collapsed_char(category: u16) -> Option<char> {
    Some(match category {
        bits::NUMBER => '\u{D1}',
        bits::LETTER => '\u{D2}',
        bits::PUNCTUATION => '\u{D3}',
        bits::ACCENT_MARK => '\u{D4}',
        bits::SYMBOL => '\u{D5}',
        _ => return None,
    })
}

/// `k_ucat_map`: the ASCII members of a class, as bracket contents.
fn ascii_members(category: u16) -> &'static str {
    match category {
        bits::NUMBER => "0-9",
        bits::LETTER => "A-Za-z",
        bits::PUNCTUATION => "!-#%-*,-/:-;?-@\\[-\\]_\\{\\}",
        bits::SYMBOL => "\\$\\+<->^`\\|\\~",
        _ => "",
    }
}

/// The collapsed form of a code point (`text_collapsed` in `unicode_regex_split`).
fn collapse(cpt: u32, f: Flags) -> char {
    if cpt < 128 {
        return char::from_u32(cpt).unwrap_or('\u{D0}');
    }
    if f.is_whitespace() {
        return '\u{0B}';
    }
    collapsed_char(f.category()).unwrap_or('\u{D0}')
}

/// llama.cpp's textual rewrite of `\p{X}` into `[<collapsed char><ASCII members>]` (no extra
/// brackets inside a bracket expression). The result is ECMAScript over collapsed characters.
fn collapse_regex(expr: &str) -> String {
    let b: Vec<char> = expr.chars().collect();
    let mut out = String::new();
    let mut inside = false;
    let mut i = 0;
    while i < b.len() {
        if b[i] == '[' && (i == 0 || b[i - 1] != '\\') {
            out.push('[');
            inside = true;
            i += 1;
            continue;
        }
        if inside && b[i] == ']' && b[i - 1] != '\\' {
            out.push(']');
            inside = false;
            i += 1;
            continue;
        }
        if b[i] == '\\'
            && i + 3 < b.len()
            && b[i + 1] == 'p'
            && b[i + 2] == '{'
            && let Some(close) = (i + 3..b.len()).find(|&j| b[j] == '}')
            && close <= i + 10
        {
            let pat: String = b[i..=close].iter().collect();
            if let Some(&(_, cat)) = UCAT.iter().find(|(name, _)| *name == pat) {
                if !inside {
                    out.push('[');
                }
                out.extend(collapsed_char(cat));
                out.push_str(ascii_members(cat));
                if !inside {
                    out.push(']');
                }
                i = close + 1;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    out
}

const ASCII_SPACE: &str = "\\x{9}\\x{A}\\x{B}\\x{C}\\x{D}\\x{20}";
const ASCII_WORD: &str = "A-Za-z0-9_";

fn hex(c: char) -> String {
    format!("\\x{{{:X}}}", u32::from(c))
}

/// Reads one escape after a backslash at `p[i]` (`i` points at the escaped character) and
/// returns what it denotes, and the index after it.
enum Escape {
    Char(char),
    /// A class escape: `d`, `D`, `s`, `S`, `w`, `W`.
    Class(char),
    /// `\b` or `\B` (outside brackets).
    Boundary(bool),
}

fn read_escape(p: &[char], i: usize, in_class: bool) -> Result<(Escape, usize), String> {
    let Some(&c) = p.get(i) else {
        return Err("pattern ends with a backslash".into());
    };
    let hexnum = |from: usize, n: usize| -> Result<char, String> {
        let s: String = p
            .get(from..from + n)
            .ok_or("truncated escape")?
            .iter()
            .collect();
        u32::from_str_radix(&s, 16)
            .ok()
            .and_then(char::from_u32)
            .ok_or_else(|| format!("bad escape \\{c}{s}"))
    };
    Ok(match c {
        'd' | 'D' | 's' | 'S' | 'w' | 'W' => (Escape::Class(c), i + 1),
        'b' if in_class => (Escape::Char('\u{8}'), i + 1),
        'b' | 'B' => (Escape::Boundary(c == 'b'), i + 1),
        'r' => (Escape::Char('\r'), i + 1),
        'n' => (Escape::Char('\n'), i + 1),
        't' => (Escape::Char('\t'), i + 1),
        'v' => (Escape::Char('\u{B}'), i + 1),
        'f' => (Escape::Char('\u{C}'), i + 1),
        '0' => (Escape::Char('\0'), i + 1),
        'x' => (Escape::Char(hexnum(i + 1, 2)?), i + 3),
        'u' => (Escape::Char(hexnum(i + 1, 4)?), i + 5),
        'p' | 'P' => return Err(format!("unsupported Unicode class escape \\{c}")),
        _ => (Escape::Char(c), i + 1),
    })
}

/// Class escape contents for use inside a bracket expression.
fn class_items(c: char) -> String {
    match c {
        'd' => "0-9".into(),
        's' => ASCII_SPACE.into(),
        'w' => ASCII_WORD.into(),
        'D' => "[^0-9]".into(),
        'S' => format!("[^{ASCII_SPACE}]"),
        _ => format!("[^{ASCII_WORD}]"),
    }
}

/// Translates an ECMAScript pattern into `fancy-regex` syntax with ECMAScript semantics.
fn translate(pattern: &str) -> Result<String, String> {
    let p: Vec<char> = pattern.chars().collect();
    let mut out = String::new();
    let mut i = 0;
    while i < p.len() {
        let c = p[i];
        match c {
            '\\' => {
                let (e, next) = read_escape(&p, i + 1, false)?;
                match e {
                    Escape::Char(ch) => out.push_str(&hex(ch)),
                    Escape::Class(k) => {
                        out.push('[');
                        out.push_str(&class_items(k));
                        out.push(']');
                    }
                    Escape::Boundary(word) => {
                        let w = format!("[{ASCII_WORD}]");
                        let at = format!("(?:(?<={w})(?!{w})|(?<!{w})(?={w}))");
                        if word {
                            out.push_str(&at);
                        } else {
                            out.push_str(&format!("(?!{at})"));
                        }
                    }
                }
                i = next;
            }
            '[' => {
                i += 1;
                out.push('[');
                if p.get(i) == Some(&'^') {
                    out.push('^');
                    i += 1;
                }
                let mut first = true;
                loop {
                    let Some(&c) = p.get(i) else {
                        return Err("unterminated bracket expression".into());
                    };
                    if c == ']' && !first {
                        i += 1;
                        break;
                    }
                    if c == ']' {
                        // ECMAScript's `[]` / `[^]`; no llama.cpp regex uses them.
                        return Err("empty bracket expression".into());
                    }
                    first = false;
                    // One atom, maybe the start of a range.
                    let (lo, next) = if c == '\\' {
                        match read_escape(&p, i + 1, true)? {
                            (Escape::Char(ch), n) => (Some(ch), n),
                            (Escape::Class(k), n) => {
                                out.push_str(&class_items(k));
                                (None, n)
                            }
                            (Escape::Boundary(_), _) => unreachable!("\\b is a char in brackets"),
                        }
                    } else {
                        (Some(c), i + 1)
                    };
                    i = next;
                    let Some(lo) = lo else { continue };
                    let is_range =
                        p.get(i) == Some(&'-') && p.get(i + 1).is_some_and(|&n| n != ']');
                    if is_range {
                        let (hi, next) = if p[i + 1] == '\\' {
                            match read_escape(&p, i + 2, true)? {
                                (Escape::Char(ch), n) => (ch, n),
                                _ => return Err("class escape as a range bound".into()),
                            }
                        } else {
                            (p[i + 1], i + 2)
                        };
                        if hi < lo {
                            return Err(format!("range out of order {lo:?}-{hi:?}"));
                        }
                        out.push_str(&hex(lo));
                        out.push('-');
                        out.push_str(&hex(hi));
                        i = next;
                    } else {
                        out.push_str(&hex(lo));
                    }
                }
                out.push(']');
            }
            '(' => {
                if p.get(i + 1) == Some(&'?') {
                    match p.get(i + 2) {
                        Some(&k @ (':' | '=' | '!')) => {
                            out.push_str("(?");
                            out.push(k);
                            i += 3;
                        }
                        _ => return Err("unsupported group syntax".into()),
                    }
                } else {
                    // Captures do not matter for splitting.
                    out.push_str("(?:");
                    i += 1;
                }
            }
            ')' | '|' | '*' | '+' | '?' | '^' | '$' => {
                out.push(c);
                i += 1;
            }
            '{' => {
                // A quantifier `{n}`, `{n,}` or `{n,m}`; copied as is.
                let close = (i..p.len())
                    .find(|&j| p[j] == '}')
                    .ok_or("unterminated quantifier")?;
                let body: String = p[i + 1..close].iter().collect();
                if body.is_empty() || !body.chars().all(|ch| ch.is_ascii_digit() || ch == ',') {
                    return Err(format!("bad quantifier {{{body}}}"));
                }
                out.push('{');
                out.push_str(&body);
                out.push('}');
                i = close + 1;
            }
            '.' => {
                out.push_str("[^\\x{A}\\x{D}\\x{2028}\\x{2029}]");
                i += 1;
            }
            _ if c.is_ascii_alphanumeric() => {
                out.push(c);
                i += 1;
            }
            _ => {
                out.push_str(&hex(c));
                i += 1;
            }
        }
    }
    Ok(out)
}

impl CompatRegex {
    /// Compiles one of llama.cpp's fallback regexes.
    pub(crate) fn new(expr: &str) -> Result<Self, String> {
        let collapsed = UCAT.iter().any(|(name, _)| expr.contains(name));
        let ecma = if collapsed {
            if !expr.is_ascii() {
                // llama.cpp throws here too ("Regex includes both unicode categories and
                // non-ASCII characters - not supported").
                return Err("regex mixes Unicode classes and non-ASCII characters".into());
            }
            collapse_regex(expr)
        } else {
            expr.to_owned()
        };
        let translated = translate(&ecma)?;
        let re = fancy_regex::RegexBuilder::new(&translated)
            .backtrack_limit(10_000_000)
            .build()
            .map_err(|e| format!("{e} (translated to {translated})"))?;
        Ok(Self { re, collapsed })
    }

    /// `unicode_regex_split_stl` over each piece of `offsets`: matches and the gaps between
    /// them become pieces (lengths in code points, appended to `out`).
    pub(crate) fn split(&self, t: &Text, offsets: &[usize], out: &mut Vec<usize>) {
        let mut start = 0;
        let mut piece = String::new();
        let mut char_at = Vec::new();
        for &len in offsets {
            piece.clear();
            char_at.clear();
            for i in start..start + len {
                let cpt = t.cpts[i];
                let f = Flags(t.flags[i]);
                let c = if self.collapsed {
                    collapse(cpt, f)
                } else if cpt > 0x7F && f.is_whitespace() {
                    '\u{0B}'
                } else {
                    char::from_u32(cpt).unwrap_or('\u{FFFD}')
                };
                char_at.push(piece.len());
                piece.push(c);
            }
            char_at.push(piece.len());
            // Byte offset in `piece` -> code point index within the piece.
            let to_cpt = |byte: usize| char_at.partition_point(|&b| b < byte);
            let mut prev = 0;
            for m in self.re.find_iter(&piece) {
                // A backtracking blow-up leaves the rest of the piece unsplit, as one word.
                let Ok(m) = m else { break };
                let (s, e) = (to_cpt(m.start()), to_cpt(m.end()));
                if s > prev {
                    out.push(s - prev);
                }
                out.push(e - s);
                prev = e;
            }
            if prev < len {
                out.push(len - prev);
            }
            start += len;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(expr: &str, text: &str) -> Vec<String> {
        let re = CompatRegex::new(expr).unwrap();
        let t = Text::new(text);
        let mut out = Vec::new();
        re.split(&t, &[t.cpts.len()], &mut out);
        let mut words = Vec::new();
        let mut s = 0;
        for len in out {
            words.push(text[t.starts[s]..t.starts[s + len]].to_owned());
            s += len;
        }
        words
    }

    #[test]
    fn collapses_classes_like_llama_cpp() {
        assert_eq!(collapse_regex("\\p{N}"), "[\u{D1}0-9]");
        assert_eq!(collapse_regex("[^\\s\\p{L}]"), "[^\\s\u{D2}A-Za-z]");
    }

    #[test]
    fn isolates_digits_including_non_ascii() {
        assert_eq!(split("\\p{N}", "ab12½c"), ["ab", "1", "2", "½", "c"]);
    }

    #[test]
    fn ecmascript_classes_are_ascii() {
        // U+00A0 is whitespace for llama.cpp (turned into \v), `é` is not a word character.
        assert_eq!(split("\\s+", "a\u{a0} b"), ["a", "\u{a0} ", "b"]);
        assert_eq!(split("\\w+", "été"), ["é", "t", "é"]);
        assert_eq!(split("[0-9][0-9][0-9]", "12345"), ["123", "45"]);
    }

    #[test]
    fn lookarounds_and_non_ascii_ranges_translate() {
        let gpt4o = "[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))*((?=[\\p{L}])([^A-Z]))+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
        assert_eq!(
            split(gpt4o, "HelloWorld 12345"),
            ["Hello", "World", " ", "123", "45"]
        );
        assert_eq!(split("[一-龥]+", "ab中文c"), ["ab", "中文", "c"]);
    }
}
