//! `specula` — the command line of the specula inference engine.
//!
//! Subcommands live in their own modules; each builds a plain report value first and renders
//! it as text or JSON, so tests can check the report without parsing terminal output.
//!
//! - `specula inspect [FILE|MODEL] [--json]` — what is inside a GGUF file ([`inspect`]).
//! - `specula run` — generate text, plain or speculative, like llama-cli ([`run`]).
//! - `specula serve` — the OpenAI-compatible server, like llama-server ([`serve`]).
//! - `specula bench` — llama-bench's pp/tg tests and its JSON fields ([`mod@bench`]).
//! - `specula perplexity FILE` — llama-perplexity's numbers ([`perplexity`]).
//! - `specula quantize IN OUT TYPE` — llama-quantize's presets, byte for byte ([`quantize`]).
//! - `specula tokenize` — a prompt's token ids, like llama-tokenize ([`tokenize`]).
//! - `specula extract` — the target's hidden states over a corpus, for drafter training
//!   ([`extract`]).
//! - `specula train dflash` — a drafter learnt from those hidden states, exported as GGUF
//!   ([`train`]; needs the `train` feature).
//!
//! Every subcommand that takes a draft model (`-md`) takes `--dflash` / `--eagle3` too
//! ([`draft_args::DraftKind`]); errors are printed with their whole cause chain.

mod bandwidth;
mod bench;
mod device;
mod draft_args;
mod extract;
mod inspect;
mod load;
mod perplexity;
mod quantize;
mod run;
mod serve;
mod tokenize;
mod train;

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
    Run(Box<run::Args>),
    /// OpenAI-compatible HTTP server with parallel slots and speculative decoding, like
    /// llama-server.
    Serve(Box<serve::Args>),
    /// Prompt-processing and generation speed, llama-bench style.
    Bench(bench::Args),
    /// Perplexity of a text file, computed as llama-perplexity does.
    Perplexity(perplexity::Args),
    /// Quantize a GGUF model with llama-quantize's presets (same tensor types, same bytes).
    Quantize(quantize::Args),
    /// Print the token ids of a prompt, like llama-tokenize.
    Tokenize(tokenize::Args),
    /// The target's hidden states over a corpus, in resumable shards, for drafter training.
    Extract(Box<extract::Args>),
    /// Train a drafter on extracted hidden states and export it as GGUF (`train` feature).
    Train(Box<train::Args>),
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
    ("-ub", "--ubatch-size"),
    ("-fa", "--flash-attn"),
    ("-ngl", "--n-gpu-layers"),
    ("-cb", "--cont-batching"),
    ("-nocb", "--no-cont-batching"),
    ("-kvu", "--kv-unified"),
    ("-no-kvu", "--no-kv-unified"),
    ("-jf", "--json-schema-file"),
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
        Command::Extract(args) => extract::run(&args),
        Command::Train(args) => train::run(&args),
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

    fn serve(args: &[&str]) -> serve::Args {
        let all = ["specula", "serve"].iter().chain(args);
        let cli = Cli::try_parse_from(llama_args(all.map(std::ffi::OsString::from)))
            .unwrap_or_else(|e| panic!("{args:?}: {e}"));
        let Command::Serve(a) = cli.command else {
            panic!("not serve");
        };
        *a
    }

    /// Each llama-server flag in each of its spellings (short, long, alias, `=`).
    #[test]
    fn serve_parses_every_llama_server_spelling() {
        type Check = fn(&serve::Args) -> bool;
        let cases: &[(&[&str], Check)] = &[
            (&["--temp", "0.2"], |a| a.llama.temp == 0.2),
            (&["--temperature=0.3"], |a| a.llama.temp == 0.3),
            (&["-s", "42"], |a| a.llama.seed == 42),
            (&["--seed=-1"], |a| a.llama.seed == -1),
            (&["--seed", "-1"], |a| a.llama.seed == -1),
            (&["--top-k", "5"], |a| a.llama.top_k == 5),
            (&["--top-p=0.5"], |a| a.llama.top_p == 0.5),
            (&["--min-p", "0.1"], |a| a.llama.min_p == 0.1),
            (&["--repeat-penalty", "1.1"], |a| {
                a.llama.repeat_penalty == 1.1
            }),
            (&["--repeat-last-n", "-1"], |a| a.llama.repeat_last_n == -1),
            (&["--presence-penalty", "-0.5"], |a| {
                a.llama.presence_penalty == -0.5
            }),
            (&["--frequency-penalty=0.5"], |a| {
                a.llama.frequency_penalty == 0.5
            }),
            (&["-n", "64"], |a| a.llama.n_predict == 64),
            (&["--n-predict", "-1"], |a| a.llama.n_predict == -1),
            (&["--predict=7"], |a| a.llama.n_predict == 7),
            (&["-ub", "128"], |a| a.ubatch_size == 128),
            (&["-ub=64"], |a| a.ubatch_size == 64),
            (&["--ubatch-size", "32"], |a| a.ubatch_size == 32),
            (&["-b", "256"], |a| a.batch_size == 256),
            (&["-fa", "on"], |a| a.llama.flash_attn == "on"),
            (&["-fa=off"], |a| a.llama.flash_attn == "off"),
            (&["--flash-attn", "auto"], |a| a.llama.flash_attn == "auto"),
            (&["-ctk", "q8_0", "-ctv=q4_0"], |a| {
                a.cache_type_k == "q8_0" && a.cache_type_v == "q4_0"
            }),
            (&["--cache-type-k=q8_0"], |a| a.cache_type_k == "q8_0"),
            (&["-cb"], |a| a.llama.cont_batching),
            (&["--cont-batching"], |a| a.llama.cont_batching),
            (&["-nocb"], |a| a.llama.no_cont_batching),
            (&["--no-cont-batching"], |a| a.llama.no_cont_batching),
            (&["-kvu"], |a| a.llama.kv_unified),
            (&["--kv-unified"], |a| a.llama.kv_unified),
            (&["-no-kvu"], |a| a.llama.no_kv_unified),
            (&["--context-shift"], |a| a.llama.context_shift),
            (&["--no-context-shift"], |a| a.llama.no_context_shift),
            (&["--metrics"], |a| a.llama.metrics),
            (&[], |a| !a.llama.metrics && !a.llama.no_slots),
            (&["--slots"], |a| a.llama.slots),
            (&["--no-slots"], |a| a.llama.no_slots),
            (&["--slot-save-path", "/tmp/s"], |a| {
                a.llama.slot_save_path.is_some()
            }),
            (&["--jinja"], |a| a.llama.jinja),
            (&["--no-jinja"], |a| a.llama.no_jinja),
            (&["--chat-template", "chatml"], |a| {
                a.llama.chat_template.as_deref() == Some("chatml")
            }),
            (&["--chat-template-file=t.jinja"], |a| {
                a.llama.chat_template_file.is_some()
            }),
            (&["--reasoning-format", "deepseek"], |a| {
                a.llama.reasoning_format == "deepseek"
            }),
            (&["--cors-origins", "*"], |a| a.llama.cors_origins.is_some()),
            (&["--api-key", "a,b"], |a| {
                a.api_key.as_deref() == Some("a,b")
            }),
            (&["--api-key-file", "k.txt"], |a| a.api_key_file.is_some()),
            (&["--offline"], |a| a.llama.offline),
            (&["--no-webui"], |a| a.llama.no_webui),
            (&["--no-ui"], |a| a.llama.no_webui),
            (&["--host", "0.0.0.0"], |a| a.host == "0.0.0.0"),
            (&["--timeout", "9"], |a| a.timeout == 9),
            (&["-to", "8"], |a| a.timeout == 8),
            (&["-to=7"], |a| a.timeout == 7),
            (&["-a", "x"], |a| a.alias.as_deref() == Some("x")),
            (&["--alias=y"], |a| a.alias.as_deref() == Some("y")),
            (&["--threads-http", "3"], |a| a.threads_http == 3),
            (&["-ngl", "99"], |a| {
                a.llama.n_gpu_layers.as_deref() == Some("99")
            }),
            (&["--n-gpu-layers=all"], |a| {
                a.llama.n_gpu_layers.as_deref() == Some("all")
            }),
            (&["--gpu-layers", "auto"], |a| {
                a.llama.n_gpu_layers.is_some()
            }),
            (&["--mlock"], |a| a.llama.mlock),
            (&["--no-mmap"], |a| a.llama.no_mmap),
            (&["-v"], |a| a.verbose),
            (&["--verbose"], |a| a.verbose),
            (&["--log-verbose"], |a| a.verbose),
            (&["--log-disable"], |a| a.log_disable),
            (&["--embedding"], |a| a.llama.embedding),
            (&["--embeddings"], |a| a.llama.embedding),
            (&["-np", "2", "-c", "4096"], |a| {
                a.parallel == 2 && a.ctx_size == 4096
            }),
        ];
        for (args, check) in cases {
            assert!(check(&serve(args)), "{args:?}");
        }
        // The later of --chat-template and --chat-template-file wins, as in llama-server.
        let a = serve(&[
            "--chat-template",
            "chatml",
            "--chat-template-file",
            "t.jinja",
        ]);
        assert!(a.llama.chat_template.is_none() && a.llama.chat_template_file.is_some());
        // A value outside llama.cpp's set is a parse error naming the flag.
        let bad = Cli::try_parse_from(llama_args(
            ["specula", "serve", "-fa", "maybe"]
                .iter()
                .map(std::ffi::OsString::from),
        ))
        .unwrap_err()
        .to_string();
        assert!(bad.contains("--flash-attn"), "{bad}");
    }
}
