//! The bridge from llama.cpp's GBNF (`grammars/README.md` of llama.cpp) to llguidance's Lark
//! dialect, so that llama-server's `grammar` field is compiled by llguidance.
//!
//! The two languages share alternation, grouping, `*` `+` `?` and `{m,n}` repeats and JSON-like
//! string literals; they differ where this module rewrites:
//!
//! - a rule is `name ::= body` (Lark: `name: body`), and its body runs until the next rule's
//!   `name ::=` (GBNF lets alternatives and groups continue on the next lines);
//! - `[...]` is a character class (Lark: an optional group), so it becomes the regex `/[...]/`,
//!   each character written as `\x{HEX}`; `.` is any character, `/(?s:.)/`;
//! - string escapes `\xHH`, `\uHHHH`, `\UHHHHHHHH`, `\t`, `\n`, `\r`, `\\`, `\"`, `\[`, `\]`
//!   are decoded and the literal re-emitted as a JSON string (Lark decodes it with `serde_json`);
//! - the start rule is `root` (Lark: `start`); names that Lark's rule syntax does not take as
//!   they are (upper case, `_`, a leading digit, `start` itself) are escaped injectively:
//!   `_u-` then the name with `_` as `__` and an upper-case letter `X` as `_x`;
//! - `#` starts a comment to the end of the line.

use std::fmt::Write as _;

/// One lexical unit of GBNF.
#[derive(Debug, PartialEq)]
enum Tok {
    Name(String),
    Defn,
    Str(String),
    Class {
        negated: bool,
        items: Vec<(char, char)>,
    },
    Any,
    Punct(char),
    Repeat(String),
}

/// Converts a GBNF grammar to llguidance's Lark, or says what is wrong and where
/// (`line:column`).
pub(crate) fn to_lark(src: &str) -> Result<String, String> {
    let toks = lex(src)?;
    let mut out = String::from("start: root\n");
    let mut i = 0;
    let mut defined = Vec::new();
    if toks.is_empty() {
        return Err("the grammar is empty: it needs a `root ::= ...` rule".into());
    }
    while i < toks.len() {
        let (Tok::Name(name), Some((Tok::Defn, _))) = (&toks[i].0, toks.get(i + 1)) else {
            let (line, col) = toks[i].1;
            return Err(format!(
                "at {line}:{col}: expected a rule `name ::= ...`, found {}",
                describe(&toks[i].0)
            ));
        };
        defined.push(name.clone());
        let _ = write!(out, "{}:", rule_name(name));
        i += 2;
        let body_start = i;
        while i < toks.len() && !matches!(toks.get(i + 1), Some((Tok::Defn, _))) {
            out.push(' ');
            emit(&toks[i].0, &mut out);
            i += 1;
        }
        if i == body_start {
            // An empty body matches the empty string.
            out.push_str(" \"\"");
        }
        out.push('\n');
    }
    if !defined.iter().any(|n| n == "root") {
        return Err("the grammar has no `root` rule (generation starts at `root ::= ...`)".into());
    }
    Ok(out)
}

fn describe(t: &Tok) -> String {
    match t {
        Tok::Name(n) => format!("the name `{n}`"),
        Tok::Defn => "`::=`".into(),
        Tok::Str(s) => format!("the string {s:?}"),
        Tok::Class { .. } => "a character class".into(),
        Tok::Any => "`.`".into(),
        Tok::Punct(c) => format!("`{c}`"),
        Tok::Repeat(r) => format!("`{r}`"),
    }
}

/// A GBNF rule name as a Lark rule name (see the module docs).
fn rule_name(name: &str) -> String {
    let plain = name != "start"
        && name.starts_with(|c: char| c.is_ascii_lowercase())
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-');
    if plain {
        return name.to_owned();
    }
    let mut s = String::from("_u-");
    for c in name.chars() {
        match c {
            '_' => s.push_str("__"),
            c if c.is_ascii_uppercase() => {
                s.push('_');
                s.push(c.to_ascii_lowercase());
            }
            c => s.push(c),
        }
    }
    s
}

fn emit(t: &Tok, out: &mut String) {
    match t {
        Tok::Name(n) => out.push_str(&rule_name(n)),
        Tok::Str(s) => out.push_str(&serde_json::Value::String(s.clone()).to_string()),
        Tok::Class { negated, items } => {
            out.push_str("/[");
            if *negated {
                out.push('^');
            }
            for &(a, b) in items {
                let _ = write!(out, "\\x{{{:x}}}", u32::from(a));
                if a != b {
                    let _ = write!(out, "-\\x{{{:x}}}", u32::from(b));
                }
            }
            out.push_str("]/");
        }
        Tok::Any => out.push_str("/(?s:.)/"),
        Tok::Punct(c) => out.push(*c),
        Tok::Repeat(r) => out.push_str(r),
        Tok::Defn => out.push_str("::="),
    }
}

struct Lexer<'a> {
    chars: std::iter::Peekable<std::str::CharIndices<'a>>,
    src: &'a str,
}

impl Lexer<'_> {
    fn pos(&mut self) -> usize {
        self.chars.peek().map_or(self.src.len(), |&(i, _)| i)
    }

    fn at(&self, byte: usize) -> (usize, usize) {
        let before = &self.src[..byte];
        let line = before.matches('\n').count() + 1;
        let col = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
        (line, col)
    }

    fn err(&self, byte: usize, msg: &str) -> String {
        let (line, col) = self.at(byte);
        format!("at {line}:{col}: {msg}")
    }

    /// One character of a string or class, escapes decoded.
    fn char_in(&mut self, what: &str) -> Result<char, String> {
        let start = self.pos();
        let Some((_, c)) = self.chars.next() else {
            return Err(self.err(start, &format!("unterminated {what}")));
        };
        if c != '\\' {
            return Ok(c);
        }
        let Some((_, e)) = self.chars.next() else {
            return Err(self.err(start, &format!("unterminated {what}")));
        };
        let hex = |lx: &mut Self, n: usize| -> Result<char, String> {
            let mut v = 0u32;
            for _ in 0..n {
                let d = lx
                    .chars
                    .next()
                    .and_then(|(_, d)| d.to_digit(16))
                    .ok_or_else(|| lx.err(start, &format!("`\\{e}` needs {n} hex digits")))?;
                v = v * 16 + d;
            }
            char::from_u32(v).ok_or_else(|| lx.err(start, &format!("U+{v:X} is not a character")))
        };
        match e {
            'x' => hex(self, 2),
            'u' => hex(self, 4),
            'U' => hex(self, 8),
            't' => Ok('\t'),
            'n' => Ok('\n'),
            'r' => Ok('\r'),
            '\\' | '"' | '[' | ']' => Ok(e),
            _ => Err(self.err(start, &format!("unknown escape `\\{e}`"))),
        }
    }
}

/// A token and where it starts (line, column).
type Located = (Tok, (usize, usize));

fn lex(src: &str) -> Result<Vec<Located>, String> {
    let mut lx = Lexer {
        chars: src.char_indices().peekable(),
        src,
    };
    let mut toks = Vec::new();
    while let Some(&(start, c)) = lx.chars.peek() {
        let here = lx.at(start);
        let tok = match c {
            c if c.is_whitespace() => {
                lx.chars.next();
                continue;
            }
            '#' => {
                while lx.chars.next_if(|&(_, c)| c != '\n').is_some() {}
                continue;
            }
            ':' => {
                if src[start..].starts_with("::=") {
                    lx.chars.nth(2);
                    Tok::Defn
                } else {
                    return Err(lx.err(start, "expected `::=`"));
                }
            }
            '"' => {
                lx.chars.next();
                let mut s = String::new();
                loop {
                    if lx.chars.next_if(|&(_, c)| c == '"').is_some() {
                        break;
                    }
                    if lx.chars.peek().is_none_or(|&(_, c)| c == '\n') {
                        return Err(lx.err(start, "unterminated string"));
                    }
                    s.push(lx.char_in("string")?);
                }
                Tok::Str(s)
            }
            '[' => {
                lx.chars.next();
                let negated = lx.chars.next_if(|&(_, c)| c == '^').is_some();
                let mut items = Vec::new();
                loop {
                    if lx.chars.next_if(|&(_, c)| c == ']').is_some() {
                        break;
                    }
                    if lx.chars.peek().is_none() {
                        return Err(lx.err(start, "unterminated character class"));
                    }
                    let a = lx.char_in("character class")?;
                    let b = if lx.chars.peek().is_some_and(|&(_, c)| c == '-')
                        && !src[lx.pos()..].starts_with("-]")
                    {
                        lx.chars.next();
                        lx.char_in("character class")?
                    } else {
                        a
                    };
                    if b < a {
                        return Err(lx.err(start, &format!("the range {a:?}-{b:?} is reversed")));
                    }
                    items.push((a, b));
                }
                Tok::Class { negated, items }
            }
            '.' => {
                lx.chars.next();
                Tok::Any
            }
            '(' | ')' | '|' | '*' | '+' | '?' => {
                lx.chars.next();
                Tok::Punct(c)
            }
            '{' => {
                lx.chars.next();
                let mut r = String::new();
                loop {
                    match lx.chars.next() {
                        Some((_, '}')) => break,
                        Some((_, c)) if c.is_ascii_digit() || c == ',' => r.push(c),
                        Some((_, ' ')) => {}
                        _ => {
                            return Err(lx.err(start, "a repeat is `{m}`, `{m,}` or `{m,n}`"));
                        }
                    }
                }
                if r.is_empty() || r == "," {
                    return Err(lx.err(start, "a repeat is `{m}`, `{m,}` or `{m,n}`"));
                }
                Tok::Repeat(format!("{{{r}}}"))
            }
            c if c.is_alphanumeric() || c == '-' || c == '_' => {
                let mut n = String::new();
                while let Some((_, c)) = lx
                    .chars
                    .next_if(|&(_, c)| c.is_alphanumeric() || c == '-' || c == '_')
                {
                    n.push(c);
                }
                if !n.is_ascii() {
                    return Err(lx.err(start, &format!("the rule name `{n}` is not ASCII")));
                }
                Tok::Name(n)
            }
            c => return Err(lx.err(start, &format!("unexpected character {c:?}"))),
        };
        toks.push((tok, here));
    }
    Ok(toks)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_classes_and_strings_become_lark() {
        let g = to_lark(
            "root ::= answer # a comment\nanswer ::= (\"yes\" | \"no\\n\"){1,2}\n  [a-c^\\]]* .",
        )
        .unwrap();
        assert_eq!(
            g,
            "start: root\nroot: answer\nanswer: ( \"yes\" | \"no\\n\" ) {1,2} /[\\x{61}-\\x{63}\\x{5e}\\x{5d}]/ * /(?s:.)/\n"
        );
    }

    #[test]
    fn names_lark_would_misread_are_escaped_injectively() {
        assert_eq!(rule_name("json-value"), "json-value");
        assert_eq!(rule_name("start"), "_u-start");
        assert_eq!(rule_name("Value_1"), "_u-_value__1");
        assert_ne!(rule_name("a_b"), rule_name("aB"));
    }

    #[test]
    fn mistakes_name_their_place() {
        assert_eq!(
            to_lark("root ::= \"a\"\n  x ::= [z-a]").unwrap_err(),
            "at 2:9: the range 'z'-'a' is reversed"
        );
        assert!(
            to_lark("root ::= \"abc")
                .unwrap_err()
                .contains("unterminated string")
        );
        assert!(
            to_lark("rot ::= \"a\"")
                .unwrap_err()
                .contains("no `root` rule")
        );
        assert!(
            to_lark("root = \"a\"")
                .unwrap_err()
                .contains("unexpected character '='")
        );
        assert!(
            to_lark("\"a\" ::= \"b\"")
                .unwrap_err()
                .contains("expected a rule")
        );
    }
}
