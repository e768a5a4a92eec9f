//! `specula tokenize`: the token ids of a prompt, like llama.cpp's `llama-tokenize`.
//!
//! Only the tokenizer is built (the GGUF header is read, no weights), so this is instant on
//! any model. Text output is one `id -> 'piece'` line per token; `--ids` prints the id list
//! alone; `--json` prints one object with ids and pieces.

use std::fmt::Write as _;

use anyhow::{Context, Result};
use serde::Serialize;
use specula_tokenizer::{EncodeOptions, Tokenizer};

/// Arguments of `specula tokenize`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// A GGUF file, or the name of a model from the manifest (`smollm2-135m`, …), fetched and
    /// verified on first use. Default: the default model.
    #[arg(short = 'm', long = "model")]
    pub model: Option<String>,
    /// The text to tokenize.
    #[arg(short = 'p', long = "prompt")]
    pub prompt: String,
    /// Print only the ids, as `[1, 2, 3]`.
    #[arg(long)]
    pub ids: bool,
    /// Keep control tokens written in the prompt (`<|im_start|>`) as plain text.
    #[arg(long)]
    pub no_parse_special: bool,
    /// Do not add BOS / EOS even where the model asks for them.
    #[arg(long)]
    pub no_bos: bool,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// What `tokenize --json` prints.
#[derive(Debug, Serialize)]
pub struct Report {
    pub file: String,
    pub add_special: bool,
    pub parse_special: bool,
    pub n_tokens: usize,
    pub ids: Vec<u32>,
    /// Each token's bytes (special tokens rendered), invalid UTF-8 as `\xNN`.
    pub pieces: Vec<String>,
}

/// Bytes as text, with the bytes of invalid UTF-8 (a token that is part of a character)
/// written `\xNN`.
fn escape_piece(mut bytes: &[u8]) -> String {
    let mut out = String::new();
    loop {
        match std::str::from_utf8(bytes) {
            Ok(s) => {
                out.push_str(s);
                return out;
            }
            Err(e) => {
                let (good, bad) = bytes.split_at(e.valid_up_to());
                out.push_str(std::str::from_utf8(good).unwrap_or_default());
                let n = e.error_len().unwrap_or(bad.len());
                for b in &bad[..n] {
                    let _ = write!(out, "\\x{b:02x}");
                }
                bytes = &bad[n..];
            }
        }
    }
}

/// Runs `specula tokenize` and returns what it prints.
pub fn run(args: &Args) -> Result<String> {
    let path = crate::load::model_path(args.model.as_deref())?;
    let tok = Tokenizer::open(&path)
        .with_context(|| format!("cannot build the tokenizer of {}", path.display()))?;
    let opts = EncodeOptions {
        add_special: !args.no_bos,
        parse_special: !args.no_parse_special,
    };
    let ids = tok.encode_with(&args.prompt, opts);
    let pieces: Vec<String> = ids
        .iter()
        .map(|&id| escape_piece(tok.token_to_piece(id, true)))
        .collect();
    if args.json {
        let report = Report {
            file: path.display().to_string(),
            add_special: opts.add_special,
            parse_special: opts.parse_special,
            n_tokens: ids.len(),
            ids,
            pieces,
        };
        let mut s = serde_json::to_string_pretty(&report)?;
        s.push('\n');
        return Ok(s);
    }
    if args.ids {
        let list: Vec<String> = ids.iter().map(u32::to_string).collect();
        return Ok(format!("[{}]\n", list.join(", ")));
    }
    let mut out = String::new();
    for (id, piece) in ids.iter().zip(&pieces) {
        let _ = writeln!(out, "{id:6} -> '{piece}'");
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::escape_piece;

    #[test]
    fn partial_characters_are_escaped() {
        assert_eq!(escape_piece("é".as_bytes()), "é");
        assert_eq!(escape_piece(&[0xF0, 0x9F]), "\\xf0\\x9f");
        assert_eq!(escape_piece(b"a\xffb"), "a\\xffb");
    }
}
