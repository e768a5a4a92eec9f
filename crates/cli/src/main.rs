//! `specula` — the command line of the specula inference engine.
//!
//! Subcommands live in their own modules; each builds a plain report value first and renders
//! it as text or JSON, so tests can check the report without parsing terminal output.
//!
//! - `specula inspect [FILE|MODEL] [--json]` — what is inside a GGUF file ([`inspect`]).
//! - `specula run` — generate text, plain or speculative, like llama-cli ([`run`]).
//! - `specula serve` — the OpenAI-compatible server, like llama-server ([`serve`]).
//! - `specula bench` — llama-bench's pp/tg tests and its JSON fields ([`bench`]).
//! - `specula perplexity FILE` — llama-perplexity's numbers ([`perplexity`]).
//! - `specula quantize IN OUT TYPE` — llama-quantize's presets, byte for byte ([`quantize`]).
//! - `specula tokenize` — a prompt's token ids, like llama-tokenize ([`tokenize`]).
//!
//! Every subcommand that takes a draft model (`-md`) takes `--dflash` / `--eagle3` too
//! ([`draft_args::DraftKind`]); errors are printed with their whole cause chain.

mod bench;
mod draft_args;
mod inspect;
mod load;
mod perplexity;
mod quantize;
mod run;
mod serve;
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
    /// OpenAI-compatible HTTP server with parallel slots and speculative decoding, like
    /// llama-server.
    Serve(serve::Args),
    /// Prompt-processing and generation speed, llama-bench style.
    Bench(bench::Args),
    /// Perplexity of a text file, computed as llama-perplexity does.
    Perplexity(perplexity::Args),
    /// Quantize a GGUF model with llama-quantize's presets (same tensor types, same bytes).
    Quantize(quantize::Args),
    /// Print the token ids of a prompt, like llama-tokenize.
    Tokenize(tokenize::Args),
}

/// llama.cpp's multi-letter single-dash flags, as the long flags clap knows.
const LLAMA_SHORT: &[(&str, &str)] = &[
    ("-md", "--model-draft"),
    ("-cd", "--ctx-size-draft"),
    ("-td", "--threads-draft"),
    ("-ctk", "--cache-type-k"),
    ("-ctv", "--cache-type-v"),
    ("-ctkd", "--cache-type-k-draft"),
    ("-ctvd", "--cache-type-v-draft"),
    ("-np", "--parallel"),
    ("-to", "--timeout"),
];

/// The arguments with llama.cpp's multi-letter single-dash flags (`-md FILE`, `-ctk q8_0`,
/// also `-ctk=q8_0`) spelled as long flags.
fn llama_args(args: impl Iterator<Item = std::ffi::OsString>) -> Vec<std::ffi::OsString> {
    args.map(|a| {
        let Some(s) = a.to_str() else { return a };
        let (flag, value) = match s.split_once('=') {
            Some((f, v)) => (f, Some(v)),
            None => (s, None),
        };
        match LLAMA_SHORT.iter().find(|(short, _)| *short == flag) {
            Some((_, long)) => match value {
                Some(v) => format!("{long}={v}").into(),
                None => (*long).into(),
            },
            None => a,
        }
    })
    .collect()
}

fn main() -> ExitCode {
    let cli = Cli::parse_from(llama_args(std::env::args_os()));
    let result = match cli.command {
        Command::Inspect(args) => inspect::run(&args),
        Command::Run(args) => run::run(&args),
        Command::Serve(args) => serve::run(&args),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama_multi_letter_flags_become_long_flags() {
        let args = [
            "specula",
            "run",
            "-md",
            "d.gguf",
            "-ctk=q8_0",
            "-m",
            "t.gguf",
            "-cd",
            "64",
        ];
        let got = llama_args(args.iter().map(std::ffi::OsString::from));
        let want = [
            "specula",
            "run",
            "--model-draft",
            "d.gguf",
            "--cache-type-k=q8_0",
            "-m",
            "t.gguf",
            "--ctx-size-draft",
            "64",
        ];
        assert_eq!(got, want.map(std::ffi::OsString::from));
        let cli = Cli::try_parse_from(got).unwrap();
        assert!(
            matches!(cli.command, Command::Run(ref a) if a.model_draft.as_deref() == Some("d.gguf") && a.draft.ctx_size_draft == 64)
        );
    }

    #[test]
    fn serve_takes_llama_server_flags() {
        let args = [
            "specula",
            "serve",
            "-m",
            "t.gguf",
            "-np",
            "4",
            "-c",
            "8192",
            "-md",
            "d.gguf",
            "-ctk",
            "q8_0",
            "--api-key",
            "k",
            "-to",
            "30",
            "--host",
            "0.0.0.0",
            "--port",
            "9000",
            "--spec-draft-n-max",
            "8",
        ];
        let cli =
            Cli::try_parse_from(llama_args(args.iter().map(std::ffi::OsString::from))).unwrap();
        let Command::Serve(a) = cli.command else {
            panic!("not serve");
        };
        assert_eq!(a.parallel, 4);
        assert_eq!(a.ctx_size, 8192);
        assert_eq!(a.model_draft.as_deref(), Some("d.gguf"));
        assert_eq!(a.cache_type_k, "q8_0");
        assert_eq!(a.api_key.as_deref(), Some("k"));
        assert_eq!(a.timeout, 30);
        assert_eq!((a.host.as_str(), a.port), ("0.0.0.0", 9000));
        assert_eq!(a.draft.spec_n_max, 8);
    }
}
