//! `cargo xtask`: the single entry point for specula's multi-step chores.
//!
//! - `cargo xtask ci` — everything CI checks, in order, failing fast: fmt, clippy, tests,
//!   doctests, rustdoc, fuzz smoke. Never downloads models.
//! - `cargo xtask fuzz` — builds a libFuzzer target on stable Rust and runs it for a while.
//! - `cargo xtask fetch-models` — fetches the real models pinned in `models.toml`.
//! - `cargo xtask golden` — regenerates `golden/` with the Python oracles in `reference/`.
//! - `cargo xtask bench kv` — speed and memory of the KV cache formats against depth.
//! - `cargo xtask bench server` — load on `specula serve`: concurrent streams, `-np 4` vs 1.
//! - `cargo xtask e2e` — the official `openai` Python client against `specula serve`.
//! - `cargo xtask bench spec` — speculative against plain decoding over a mixed prompt set.
//! - `cargo xtask exp spec` — train drafters on the target's hidden states and measure what
//!   each speculative method saves (the paper-style experiment).
//!
//! The alias in `.cargo/config.toml` builds this crate into `target/xtask`, so running a chore
//! never invalidates the workspace build.

mod bench;
mod bench_server;
mod bench_spec;
mod ci;
mod e2e;
mod exp_spec;
mod fuzz;
mod golden;
mod gpu;
mod http;
mod models;
mod util;

use std::process::ExitCode;

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

/// Project chores for specula.
#[derive(Debug, Parser)]
#[command(name = "cargo xtask", version, about)]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

#[derive(Debug, Subcommand)]
enum Task {
    /// Run every CI check: fmt, clippy, tests, doctests, rustdoc, fuzz smoke.
    Ci(CiArgs),
    /// Build a fuzz target with libFuzzer instrumentation (stable Rust) and run it.
    Fuzz(FuzzArgs),
    /// Fetch the real models of `models.toml` into the model cache.
    FetchModels(FetchArgs),
    /// Regenerate `golden/` with the Python oracles in `reference/` (never run by CI).
    Golden(GoldenArgs),
    /// Benchmark sweeps (tables and plots in `benches/results/`).
    #[command(subcommand)]
    Bench(BenchTask),
    /// The official `openai` Python client against `specula serve` (needs Python and PyPI).
    E2e(E2eArgs),
    /// Experiments (results in `benches/results/`).
    #[command(subcommand)]
    Exp(ExpTask),
    /// The prepared script for a lent GPU machine: build the CUDA bench bundle (conformance
    /// on CUDA, GEMV/attention/model benches, one table) and run it.
    Gpu(gpu::GpuArgs),
}

/// The experiments of `cargo xtask exp`.
#[derive(Debug, Subcommand)]
enum ExpTask {
    /// Train DFlash and EAGLE-3 drafters on the target's hidden states and measure τ and
    /// tokens/s of every speculative method on held-out code and prose (resumable).
    Spec(ExpSpecArgs),
}

/// Options of `cargo xtask exp spec`.
#[derive(Debug, Args)]
struct ExpSpecArgs {
    /// Target (manifest model name).
    #[arg(long, default_value = "smollm2-135m")]
    target: String,
    /// The code corpus: a Python standard library directory (its top-level modules); default
    /// that of the `python3` on PATH.
    #[arg(long)]
    code_dir: Option<PathBuf>,
    /// Feature shards to extract (64 sequences of 512 tokens each).
    #[arg(long, default_value_t = 6)]
    shards: usize,
    /// Tokens of each 512-token feature sequence the target generates greedily from the
    /// corpus tokens before them (`specula extract --generate`): drafters then learn the
    /// target's own greedy path. 0: the corpus as it is.
    #[arg(long, default_value_t = 448)]
    generate: usize,
    /// What DFlash's block rows learn (`specula train --labels`: greedy, target, corpus).
    #[arg(long, default_value = "greedy")]
    dflash_labels: String,
    /// DFlash training steps (0 with `--dflash-init copy`: the copy circuit as built,
    /// untrained — training from it has so far cost row 1 more than it gave the later rows).
    #[arg(long, default_value_t = 1200)]
    steps: usize,
    /// DFlash draft layers (`specula train --layers`). With one layer the MASK rows' queries
    /// carry no content (a MASK embedding at a position), so what they read of the context is
    /// fixed by position; a second layer's queries carry what the first gathered.
    #[arg(long, default_value_t = 2)]
    dflash_layers: usize,
    /// Weight of the DFlash anchor row's own loss (`specula train --anchor-loss`): the one
    /// block row whose first-layer query carries content learns row 1's token, so the
    /// lookup the MASK rows read from it is trained directly.
    #[arg(long, default_value_t = 1.0)]
    dflash_anchor_loss: f32,
    /// Initial gain of the DFlash draft's query and key norms (`specula train
    /// --qk-norm-init`): a score is at most gain² · √head_dim, so at 1 attention cannot single
    /// out one context position among hundreds until the gains grow.
    #[arg(long, default_value_t = 2.0)]
    dflash_qk_norm_init: f32,
    /// Where the DFlash draft starts (`specula train --init`): `random`, or `copy` — a draft
    /// that already looks the anchor's token up in the context and drafts what the target
    /// predicted after it (it reads the target's output as a tap, so the DFlash taps gain the
    /// last layer).
    #[arg(long, default_value = "random", value_parser = ["random", "copy"])]
    dflash_init: String,
    /// K/V heads of the DFlash draft (`specula train --kv-heads`; 0: the target's). The copy
    /// circuit's value path is K/V heads × head_dim wide: more heads carry more of the
    /// target's prediction through a lookup.
    #[arg(long, default_value_t = 0)]
    dflash_kv_heads: usize,
    /// EAGLE-3 training steps.
    #[arg(long, default_value_t = 400)]
    eagle_steps: usize,
    /// Prompts per held-out file.
    #[arg(long, default_value_t = 2)]
    prompts_per_file: usize,
    /// Characters per prompt (cut at a line end).
    #[arg(long, default_value_t = 1200)]
    prompt_chars: usize,
    /// Tokens generated per prompt.
    #[arg(short = 'n', long, default_value_t = 128)]
    n: usize,
    /// Threads.
    #[arg(short = 't', long, default_value_t = 2)]
    threads: usize,
    /// Runs of each (prompt, method, temperature) cell: its time is their median, its tokens
    /// and acceptance the first run's.
    #[arg(long, default_value_t = 3)]
    reps: usize,
}

/// Options of `cargo xtask e2e`.
#[derive(Debug, Args)]
struct E2eArgs {
    /// Model (file or manifest name; default: the default model).
    #[arg(short = 'm', long)]
    model: Option<String>,
    /// Print less.
    #[arg(long)]
    quiet: bool,
}

/// Options of `cargo xtask bench server`.
#[derive(Debug, Args)]
struct ServerBenchArgs {
    /// Model (file or manifest name).
    #[arg(short = 'm', long, default_value = "smollm2-135m")]
    model: String,
    /// Concurrent streaming requests.
    #[arg(long, default_value_t = 32)]
    requests: usize,
    /// Tokens per request.
    #[arg(short = 'n', long = "max-tokens", default_value_t = 64)]
    max_tokens: usize,
    /// Slot settings to compare.
    #[arg(long = "np", value_delimiter = ',', default_value = "1,4")]
    parallel: Vec<usize>,
    /// Server threads.
    #[arg(short = 't', long, default_value_t = 2)]
    threads: usize,
    /// Clients that leave after their first chunk (on the last -np setting).
    #[arg(long, default_value_t = 8)]
    disconnects: usize,
}

/// The sweeps of `cargo xtask bench`.
#[derive(Debug, Subcommand)]
enum BenchTask {
    /// Speed and memory of KV cache formats against context depth.
    Kv(KvBenchArgs),
    /// Load on `specula serve`: concurrent streams, aggregate t/s for each -np, disconnects.
    Server(ServerBenchArgs),
    /// Speculative against plain decoding over a mixed prompt set (lossless check included).
    Spec(SpecBenchArgs),
}

/// Options of `cargo xtask bench spec`.
#[derive(Debug, Args)]
struct SpecBenchArgs {
    /// Model (file or manifest name).
    #[arg(short = 'm', long, default_value = "smollm2-135m")]
    model: String,
    /// Speculative settings to compare with `--spec-type none`, each a string of `specula run`
    /// flags (repeat the option); default: one setting, `specula run`'s default (n-gram).
    #[arg(long, allow_hyphen_values = true)]
    spec: Vec<String>,
    /// Rounds; each prompt and setting runs once per round and the median is kept.
    #[arg(short = 'r', long, default_value_t = 3)]
    rounds: usize,
    /// Threads.
    #[arg(short = 't', long, default_value_t = 2)]
    threads: usize,
    /// The prompt set (TOML, relative to the repository root).
    #[arg(long, default_value = "benches/prompts/spec.toml")]
    prompts: PathBuf,
    /// Only these prompts (by name, comma-separated).
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// Output directory (relative to the repository root).
    #[arg(long, default_value = "benches/results")]
    out: PathBuf,
}

/// Options of `cargo xtask bench kv`.
#[derive(Debug, Args)]
struct KvBenchArgs {
    /// Models (files or manifest names, comma-separated): each gets its own sweep and files.
    #[arg(
        short = 'm',
        long = "model",
        value_delimiter = ',',
        default_value = "smollm2-135m"
    )]
    models: Vec<String>,
    /// Cache settings: `T` (K and V) or `K/V`.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "f16,q8_0,q4_0,turbo4,turbo3,turbo2,q8_0/turbo4"
    )]
    types: Vec<String>,
    /// Depths.
    #[arg(
        short = 'd',
        long,
        value_delimiter = ',',
        default_value = "0,1024,4096"
    )]
    depths: Vec<u64>,
    /// Prompt length of the pp test.
    #[arg(short = 'p', long, default_value_t = 512)]
    n_prompt: usize,
    /// Tokens of the tg test.
    #[arg(short = 'n', long, default_value_t = 32)]
    n_gen: usize,
    /// Repetitions.
    #[arg(short = 'r', long, default_value_t = 2)]
    repetitions: usize,
    /// Threads.
    #[arg(short = 't', long, default_value_t = 2)]
    threads: usize,
    /// Output directory (relative to the repository root).
    #[arg(long, default_value = "benches/results")]
    out: PathBuf,
    /// A `llama-bench` binary: each setting llama.cpp has (not the turbo types) is also run
    /// there with `-fa 1`, one after the other, and the table gets its rows and the ratios.
    #[arg(long)]
    llama_bench: Option<PathBuf>,
}

/// Options of `cargo xtask ci`.
#[derive(Debug, Args)]
struct CiArgs {
    /// How long the fuzz smoke runs each target, in seconds.
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u64).range(1..))]
    fuzz_seconds: u64,
}

/// Options of `cargo xtask fuzz`.
#[derive(Debug, Args)]
struct FuzzArgs {
    /// How long to fuzz, in seconds.
    #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..))]
    seconds: u64,
    /// Which target of `fuzz/fuzz_targets/` to run.
    #[arg(long, default_value = "gguf_header")]
    target: String,
    /// Extra libFuzzer flags, after `--` (e.g. `-- -max_len=65536 -jobs=2`).
    #[arg(last = true)]
    libfuzzer_args: Vec<String>,
}

/// Options of `cargo xtask fetch-models`.
#[derive(Debug, Args)]
struct FetchArgs {
    /// Models to fetch (default: all of them).
    names: Vec<String>,
    /// List the models with size, licence and whether they are cached; fetch nothing.
    #[arg(long, conflicts_with = "names")]
    list: bool,
}

/// Options of `cargo xtask golden`.
#[derive(Debug, Args)]
struct GoldenArgs {
    /// Where the fetched real models are (default: the specula-fetch model cache).
    #[arg(long, value_name = "DIR")]
    models_dir: Option<std::path::PathBuf>,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.task {
        Task::Ci(args) => ci::run(&args),
        Task::Fuzz(args) => fuzz::run(&args),
        Task::FetchModels(args) => models::run(&args),
        Task::Golden(args) => golden::run(&args),
        Task::Gpu(args) => gpu::run(&args),
        Task::Bench(BenchTask::Kv(args)) => bench::run(&args),
        Task::Bench(BenchTask::Server(args)) => bench_server::run(&args),
        Task::E2e(args) => e2e::run(&args),
        Task::Exp(ExpTask::Spec(args)) => exp_spec::run(&args),
        Task::Bench(BenchTask::Spec(args)) => bench_spec::run(&args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // The cause chain, without the backtrace of xtask itself that `RUST_BACKTRACE`
            // would add: the failing command's own output is above it.
            eprintln!("\nxtask: error: {e}");
            for cause in e.chain().skip(1) {
                eprintln!("  caused by: {cause}");
            }
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("xtask").chain(args.iter().copied()))
    }

    #[test]
    fn clap_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn ci_defaults_to_a_twenty_second_fuzz_smoke() {
        let Task::Ci(args) = parse(&["ci"]).unwrap().task else {
            panic!("not ci");
        };
        assert_eq!(args.fuzz_seconds, 20);
    }

    #[test]
    fn fuzz_takes_seconds_target_and_raw_libfuzzer_flags() {
        let cli = parse(&["fuzz", "--seconds", "5", "--", "-max_len=64"]).unwrap();
        let Task::Fuzz(args) = cli.task else {
            panic!("not fuzz");
        };
        assert_eq!(args.seconds, 5);
        assert_eq!(args.target, "gguf_header");
        assert_eq!(args.libfuzzer_args, ["-max_len=64"]);
    }

    #[test]
    fn zero_seconds_is_rejected_because_libfuzzer_reads_it_as_forever() {
        assert!(parse(&["fuzz", "--seconds", "0"]).is_err());
        assert!(parse(&["ci", "--fuzz-seconds", "0"]).is_err());
    }

    #[test]
    fn fetch_models_takes_names_or_list_but_not_both() {
        let Task::FetchModels(args) = parse(&["fetch-models", "smollm2-135m"]).unwrap().task else {
            panic!("not fetch-models");
        };
        assert_eq!(args.names, ["smollm2-135m"]);
        assert!(!args.list);
        assert!(parse(&["fetch-models", "--list", "smollm2-135m"]).is_err());
    }

    #[test]
    fn golden_models_dir_is_optional() {
        let Task::Golden(args) = parse(&["golden"]).unwrap().task else {
            panic!("not golden");
        };
        assert_eq!(args.models_dir, None);
    }
}
