//! `specula` — the command line of the specula inference engine.
//!
//! Subcommands live in their own modules; each builds a plain report value first and renders
//! it as text or JSON, so tests can check the report without parsing terminal output.
//!
//! - `specula inspect [FILE|MODEL] [--json]` — what is inside a GGUF file ([`inspect`]).
//! - `specula quantize IN OUT TYPE` — llama-quantize's presets, byte for byte ([`quantize`]).

mod bench;
mod inspect;
mod load;
mod perplexity;
mod quantize;
mod run;
mod tokenize;

use std::io::Write;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Fast, lossless LLM inference with speculative decoding.
#[derive(Debug, Parser)]
#[command(name = "specula", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Show a GGUF file's architecture, hyperparameters, tokenizer, tensors and size.
    Inspect(inspect::Args),
    /// Generate text from a prompt (greedy or sampled), like llama-cli.
    Run(run::Args),
    /// Prompt-processing and generation speed, llama-bench style.
    Bench(bench::Args),
    /// Perplexity of a text file, computed as llama-perplexity does.
    Perplexity(perplexity::Args),
    /// Quantize a GGUF model with llama-quantize's presets (same tensor types, same bytes).
    Quantize(quantize::Args),
    /// Print the token ids of a prompt, like llama-tokenize.
    Tokenize(tokenize::Args),
}

/// llama.cpp spells some long options with one dash (`-ctk q8_0`, `-ctv turbo4`); clap's short
/// options are one character, so those spellings are rewritten to their long forms first.
fn llama_style_args(args: impl Iterator<Item = std::ffi::OsString>) -> Vec<std::ffi::OsString> {
    const SPELLINGS: [(&str, &str); 2] = [("-ctk", "--cache-type-k"), ("-ctv", "--cache-type-v")];
    args.map(|a| {
        let Some(s) = a.to_str() else { return a };
        for (short, long) in SPELLINGS {
            if s == short {
                return long.into();
            }
            if let Some(v) = s.strip_prefix(short).and_then(|r| r.strip_prefix('=')) {
                return format!("{long}={v}").into();
            }
        }
        a
    })
    .collect()
}

fn main() -> ExitCode {
    let cli = Cli::parse_from(llama_style_args(std::env::args_os()));
    let result = match cli.command {
        Command::Inspect(args) => inspect::run(&args),
        Command::Run(args) => run::run(&args),
        Command::Bench(args) => bench::run(&args),
        Command::Perplexity(args) => perplexity::run(&args),
        Command::Quantize(args) => quantize::run(&args),
        Command::Tokenize(args) => tokenize::run(&args),
    };
    match result.and_then(|out| emit(&out)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Writes a command's output to stdout. A closed pipe (`specula inspect … | head`) is not an
/// error: the reader has what it wanted.
fn emit(out: &str) -> anyhow::Result<()> {
    let mut stdout = std::io::stdout().lock();
    match stdout
        .write_all(out.as_bytes())
        .and_then(|()| stdout.flush())
    {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e.into()),
        _ => Ok(()),
    }
}
