//! Chat templates: the Jinja template of `tokenizer.chat_template`, rendered with `minijinja`
//! the way Hugging Face's `apply_chat_template` renders it with jinja2.
//!
//! The environment matches `transformers`' one: `trim_blocks` and `lstrip_blocks` on, the
//! trailing newline of the template dropped, `{% break %}` / `{% continue %}`, Python string
//! and dict methods (`.strip()`, `.startswith()`, `.items()`… from `minijinja-contrib`'s
//! pycompat), `raise_exception(msg)`, `strftime_now(fmt)`, and a `tojson` that writes what
//! Python's `json.dumps(x, ensure_ascii=False)` writes (minijinja's own escapes `<`, `>`, `&`
//! and `'` for HTML, which would change prompts that contain tool schemas).

use std::fmt::Write as _;
use std::time::{SystemTime, UNIX_EPOCH};

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Environment, Error, ErrorKind, Value, context};
use serde::Serialize;

use crate::error::TokenizerError;

/// One chat message: a role (`system`, `user`, `assistant`, `tool`…) and its text.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ChatMessage {
    /// Who speaks.
    pub role: String,
    /// What is said.
    pub content: String,
}

impl ChatMessage {
    /// A message from `role`.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// A compiled chat template with the model's BOS and EOS texts.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish_non_exhaustive()
    }
}

const NAME: &str = "chat_template";

impl ChatTemplate {
    /// Compiles `source`; `bos_token` / `eos_token` are what the template sees under those
    /// names. `strftime_now` reads the clock (UTC); [`ChatTemplate::with_fixed_time`] pins it.
    ///
    /// # Errors
    /// [`TokenizerError::Template`] if the template does not parse.
    pub fn new(
        source: impl Into<String>,
        bos_token: impl Into<String>,
        eos_token: impl Into<String>,
    ) -> Result<Self, TokenizerError> {
        Self::build(source.into(), bos_token.into(), eos_token.into(), None)
    }

    /// The same template with `strftime_now` reporting `unix_seconds` (UTC) instead of the
    /// clock, for reproducible prompts.
    ///
    /// # Errors
    /// [`TokenizerError::Template`] if the template does not parse.
    pub fn with_fixed_time(self, unix_seconds: i64) -> Result<Self, TokenizerError> {
        let source = self
            .env
            .get_template(NAME)
            .map(|t| t.source().to_owned())
            .map_err(TokenizerError::Template)?;
        Self::build(source, self.bos_token, self.eos_token, Some(unix_seconds))
    }

    fn build(
        source: String,
        bos_token: String,
        eos_token: String,
        fixed_time: Option<i64>,
    ) -> Result<Self, TokenizerError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_keep_trailing_newline(false);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<Value, Error> {
            Err(Error::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_function("strftime_now", move |fmt: String| -> String {
            let secs = fixed_time.unwrap_or_else(|| {
                SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .map(|d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
                    .unwrap_or(0)
            });
            strftime(&fmt, secs)
        });
        env.add_filter("tojson", tojson);
        env.add_template_owned(NAME, source)?;
        Ok(Self {
            env,
            bos_token,
            eos_token,
        })
    }

    /// Renders a conversation; `add_generation_prompt` appends the opening of the
    /// assistant's turn.
    ///
    /// # Errors
    /// [`TokenizerError::Template`] if rendering fails (`raise_exception` included).
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, TokenizerError> {
        self.render_with(messages, add_generation_prompt, ())
    }

    /// Renders any serializable message list (tool calls and other fields included), with
    /// `extra` (a serializable map or struct, e.g. `{"tools": [...]}`) merged into the
    /// template's variables. Maps keep the order their `Serialize` gives — note that
    /// `serde_json::Value` objects sort their keys, which `tojson` then prints sorted; use
    /// [`ChatTemplate::render_json`] to keep a JSON text's key order as Python does.
    ///
    /// # Errors
    /// [`TokenizerError::Template`] if rendering fails.
    pub fn render_with<M: Serialize + ?Sized, X: Serialize>(
        &self,
        messages: &M,
        add_generation_prompt: bool,
        extra: X,
    ) -> Result<String, TokenizerError> {
        let ctx = context! {
            messages => Value::from_serialize(messages),
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token.as_str(),
            eos_token => self.eos_token.as_str(),
            ..Value::from_serialize(extra)
        };
        Ok(self.env.get_template(NAME)?.render(ctx)?)
    }
}

impl ChatTemplate {
    /// Renders messages given as JSON text (an array of message objects, as in an
    /// OpenAI-style request body), with `extra_json` (a JSON object such as
    /// `{"tools": [...]}`, or `None`) merged into the template's variables. Object keys keep
    /// their order in the text, as in Python's `json.loads`, so `tojson` reproduces it.
    ///
    /// # Errors
    /// [`TokenizerError::Template`] for JSON that does not parse or a failing render.
    pub fn render_json(
        &self,
        messages_json: &str,
        add_generation_prompt: bool,
        extra_json: Option<&str>,
    ) -> Result<String, TokenizerError> {
        let parse = |text: &str| -> Result<Value, TokenizerError> {
            serde_json::from_str::<Value>(text).map_err(|e| {
                TokenizerError::Template(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("invalid JSON: {e}"),
                ))
            })
        };
        let messages = parse(messages_json)?;
        let extra = match extra_json {
            Some(text) => parse(text)?,
            None => Value::from(()),
        };
        let ctx = context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token.as_str(),
            eos_token => self.eos_token.as_str(),
            ..extra
        };
        Ok(self.env.get_template(NAME)?.render(ctx)?)
    }
}

/// Python's `json.dumps(value, ensure_ascii=False, indent=indent, sort_keys=sort_keys)`.
fn tojson(value: &Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;
    let mut out = String::new();
    let opts = JsonOpts {
        indent,
        sort_keys: sort_keys.unwrap_or(false),
        ensure_ascii: ensure_ascii.unwrap_or(false),
    };
    write_json(value, &opts, 0, &mut out)?;
    Ok(Value::from_safe_string(out))
}

struct JsonOpts {
    indent: Option<usize>,
    sort_keys: bool,
    ensure_ascii: bool,
}

fn write_json_str(s: &str, ensure_ascii: bool, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if u32::from(c) < 0x20 || (ensure_ascii && !c.is_ascii()) => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

fn newline_indent(opts: &JsonOpts, depth: usize, out: &mut String) {
    if let Some(n) = opts.indent {
        out.push('\n');
        out.extend(std::iter::repeat_n(' ', n * depth));
    }
}

fn write_json(v: &Value, opts: &JsonOpts, depth: usize, out: &mut String) -> Result<(), Error> {
    let item_sep = if opts.indent.is_some() { "," } else { ", " };
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if let Some(i) = v.as_i64() {
                let _ = write!(out, "{i}");
            } else if let Ok(f) = f64::try_from(v.clone()) {
                if f.is_finite() && f.fract() == 0.0 && f.abs() < 1e16 {
                    let _ = write!(out, "{f:.1}");
                } else if f.is_nan() {
                    out.push_str("NaN");
                } else if f.is_infinite() {
                    out.push_str(if f > 0.0 { "Infinity" } else { "-Infinity" });
                } else {
                    let _ = write!(out, "{f}");
                }
            } else {
                let _ = write!(out, "{v}");
            }
        }
        ValueKind::String => write_json_str(v.as_str().unwrap_or_default(), opts.ensure_ascii, out),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline_indent(opts, depth + 1, out);
                write_json(item, opts, depth + 1, out)?;
            }
            newline_indent(opts, depth, out);
            out.push(']');
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = v.try_iter()?.collect();
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            if opts.sort_keys {
                keys.sort();
            }
            out.push('{');
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline_indent(opts, depth + 1, out);
                let key = match k.as_str() {
                    Some(s) => s.to_owned(),
                    None => k.to_string(),
                };
                write_json_str(&key, opts.ensure_ascii, out);
                out.push_str(": ");
                write_json(&v.get_item(k)?, opts, depth + 1, out)?;
            }
            newline_indent(opts, depth, out);
            out.push('}');
        }
        _ => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: cannot serialize a {} value", v.kind()),
            ));
        }
    }
    Ok(())
}

/// Civil date of a day count since 1970-01-01 (Howard Hinnant's `civil_from_days`).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    (
        y,
        u32::try_from(m).unwrap_or(1),
        u32::try_from(d).unwrap_or(1),
    )
}

/// Days since 1970-01-01 of a civil date (Howard Hinnant's `days_from_civil`).
fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let m = i64::from(m);
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + i64::from(d) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const WEEKDAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];

/// C `strftime` for the conversions chat templates use (`%Y %m %d %H %M %S %B %b %A %a %y %j
/// %p %I %e %%`), in UTC; other conversions are copied through.
fn strftime(fmt: &str, unix_seconds: i64) -> String {
    let days = unix_seconds.div_euclid(86_400);
    let secs = unix_seconds.rem_euclid(86_400);
    let (y, m, d) = civil_from_days(days);
    let (hh, mm, ss) = (secs / 3600, secs / 60 % 60, secs % 60);
    // 1970-01-01 was a Thursday (index 3 from Monday).
    let wd = usize::try_from((days + 3).rem_euclid(7)).unwrap_or(0);
    let jan1 = days - days_from_civil(y, 1, 1) + 1;
    let month = MONTHS[(m as usize).saturating_sub(1) % 12];
    let mut out = String::new();
    let mut chars = fmt.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => {
                let _ = write!(out, "{y}");
            }
            Some('y') => {
                let _ = write!(out, "{:02}", y.rem_euclid(100));
            }
            Some('m') => {
                let _ = write!(out, "{m:02}");
            }
            Some('d') => {
                let _ = write!(out, "{d:02}");
            }
            Some('e') => {
                let _ = write!(out, "{d:2}");
            }
            Some('H') => {
                let _ = write!(out, "{hh:02}");
            }
            Some('I') => {
                let h12 = if hh % 12 == 0 { 12 } else { hh % 12 };
                let _ = write!(out, "{h12:02}");
            }
            Some('p') => out.push_str(if hh < 12 { "AM" } else { "PM" }),
            Some('M') => {
                let _ = write!(out, "{mm:02}");
            }
            Some('S') => {
                let _ = write!(out, "{ss:02}");
            }
            Some('B') => out.push_str(month),
            Some('b' | 'h') => out.push_str(&month[..3]),
            Some('A') => out.push_str(WEEKDAYS[wd]),
            Some('a') => out.push_str(&WEEKDAYS[wd][..3]),
            Some('j') => {
                let _ = write!(out, "{jan1:03}");
            }
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strftime_formats_a_known_date() {
        // 2026-01-02 03:04:05 UTC, a Friday.
        let t = 1_767_323_045;
        assert_eq!(strftime("%Y-%m-%d %H:%M:%S", t), "2026-01-02 03:04:05");
        assert_eq!(strftime("%d %b %Y, %A %j", t), "02 Jan 2026, Friday 002");
        assert_eq!(strftime("%d %B %Y", 0), "01 January 1970");
    }

    #[test]
    fn tojson_is_python_json_dumps() {
        let tpl = ChatTemplate::new("{{ x | tojson }}|{{ x | tojson(indent=2) }}", "", "").unwrap();
        let out = tpl
            .render_with(
                &[] as &[ChatMessage],
                false,
                context! { x => context! { name => "f<x>", args => vec![1, 2], ok => true, none => () } },
            )
            .unwrap();
        assert_eq!(
            out,
            "{\"name\": \"f<x>\", \"args\": [1, 2], \"ok\": true, \"none\": null}|{\n  \"name\": \"f<x>\",\n  \"args\": [\n    1,\n    2\n  ],\n  \"ok\": true,\n  \"none\": null\n}"
        );
    }

    #[test]
    fn hf_environment_features() {
        let src = "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content.strip().upper() }}{% endfor %}\n";
        let tpl = ChatTemplate::new(src, "<s>", "</s>").unwrap();
        let out = tpl
            .render(
                &[
                    ChatMessage::new("user", "  hi "),
                    ChatMessage::new("user", "no"),
                ],
                false,
            )
            .unwrap();
        assert_eq!(out, "HI");
        let tpl = ChatTemplate::new("{{ raise_exception('bad role') }}", "", "").unwrap();
        let err = tpl.render(&[], false).unwrap_err().to_string();
        assert!(err.contains("bad role"), "{err}");
    }
}
