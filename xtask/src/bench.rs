//! `cargo xtask bench kv`: speed and memory of every KV cache format against context depth.
//!
//! Builds the release `specula`, runs `specula bench -p P -n N -d D… -ctk K -ctv V -o jsonl`
//! for each cache setting of each model (`-m a,b,c`), and writes to `benches/results/` per
//! model:
//! `kv-<model>.jsonl` (every record), `kv-<model>.md` (a table: bits per value, KV MiB, pp and
//! tg speed per depth) and `kv-<model>.svg` (tg speed and KV memory against depth, one line per
//! setting). Every file is written under a temporary name and renamed into place.
//!
//! With `--llama-bench PATH`, each setting whose K and V types llama.cpp has is run there too
//! (`llama-bench -fa 1`, same `-p -n -d -r -t`, right after specula's run of that setting),
//! and the table gets a `K/V llama.cpp` row and a `K/V specula ÷ llama.cpp` row of ratios.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};
use serde_json::Value;

use crate::KvBenchArgs;
use crate::util::{cargo, rel, repo_root, results_name, run_cmd, suffixed};

/// One `specula bench` record, the fields the sweep uses.
#[derive(Debug, Clone)]
struct Rec {
    setting: String,
    n_prompt: u64,
    n_gen: u64,
    depth: u64,
    ts: f64,
    bytes_per_token: u64,
}

fn field(v: &Value, k: &str) -> Result<u64> {
    v[k].as_u64()
        .with_context(|| format!("specula bench record without `{k}`: {v}"))
}

fn parse(setting: &str, out: &str) -> Result<Vec<Rec>> {
    parse_with(setting, out, true)
}

/// Records of `specula bench` (`ours`: with `kv_bytes_per_token`) or of `llama-bench -o
/// jsonl` (the same test fields, no cache accounting).
fn parse_with(setting: &str, out: &str, ours: bool) -> Result<Vec<Rec>> {
    out.lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| {
            let v: Value = serde_json::from_str(l).context("a bench JSON line")?;
            Ok(Rec {
                setting: setting.to_owned(),
                n_prompt: field(&v, "n_prompt")?,
                n_gen: field(&v, "n_gen")?,
                depth: field(&v, "n_depth")?,
                ts: v["avg_ts"].as_f64().context("avg_ts")?,
                bytes_per_token: if ours {
                    field(&v, "kv_bytes_per_token")?
                } else {
                    0
                },
            })
        })
        .collect()
}

/// The cache types llama.cpp's `-ctk` / `-ctv` take.
const LLAMA_TYPES: [&str; 9] = [
    "f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1",
];

/// The setting's name for llama.cpp's rows.
fn llama_setting(setting: &str) -> String {
    format!("{setting} llama.cpp")
}

/// Rows `specula ÷ llama.cpp` for every setting both ran: the ratio of each test's speed.
fn ratios(recs: &[Rec], settings: &[String]) -> Vec<Rec> {
    let mut out = Vec::new();
    for st in settings {
        let theirs = llama_setting(st);
        for r in recs.iter().filter(|r| &r.setting == st) {
            let peer = recs.iter().find(|o| {
                o.setting == theirs
                    && (o.n_prompt, o.n_gen, o.depth) == (r.n_prompt, r.n_gen, r.depth)
            });
            if let Some(o) = peer.filter(|o| o.ts > 0.0) {
                out.push(Rec {
                    setting: format!("{st} specula ÷ llama.cpp"),
                    ts: r.ts / o.ts,
                    ..r.clone()
                });
            }
        }
    }
    out
}

/// Writes `text` to `path` through a temporary file in the same directory.
fn write_atomic(path: &Path, text: &str) -> Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("renaming to {}", path.display()))
}

#[allow(clippy::cast_precision_loss, reason = "byte counts for display")]
fn mib(bytes: u64) -> f64 {
    bytes as f64 / f64::from(1u32 << 20)
}

fn table(recs: &[Rec], settings: &[String], depths: &[u64], model: &str) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "# KV cache sweep: {model}\n");
    let _ = write!(
        s,
        "| -ctk/-ctv | bytes/token | KV MiB @ d{} |",
        depths.last().unwrap_or(&0)
    );
    let tests: Vec<(u64, u64)> = {
        let mut t: Vec<(u64, u64)> = recs.iter().map(|r| (r.n_prompt, r.n_gen)).collect();
        t.sort_unstable();
        t.dedup();
        t
    };
    for &(p, n) in &tests {
        for d in depths {
            let name = if p > 0 {
                format!("pp{p}")
            } else {
                format!("tg{n}")
            };
            let _ = write!(s, " {name} @ d{d} |");
        }
    }
    s.push('\n');
    let _ = write!(s, "| --- | ---: | ---: |");
    for _ in 0..tests.len() * depths.len() {
        s.push_str(" ---: |");
    }
    s.push('\n');
    for st in settings {
        let mine: Vec<&Rec> = recs.iter().filter(|r| &r.setting == st).collect();
        let bpt = mine.first().map_or(0, |r| r.bytes_per_token);
        let dmax = depths.last().copied().unwrap_or(0);
        let _ = write!(s, "| {st} | {bpt} | {:.1} |", mib(bpt * dmax));
        for &(p, n) in &tests {
            for &d in depths {
                match mine
                    .iter()
                    .find(|r| (r.n_prompt, r.n_gen, r.depth) == (p, n, d))
                {
                    Some(r) => {
                        let _ = write!(s, " {:.2} |", r.ts);
                    }
                    None => s.push_str(" – |"),
                }
            }
        }
        s.push('\n');
    }
    s
}

const COLORS: [&str; 8] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
];

/// Two panels: generation speed and KV memory against depth.
#[allow(clippy::cast_precision_loss, reason = "plot coordinates")]
fn plot(recs: &[Rec], settings: &[String], depths: &[u64], model: &str) -> String {
    let (w, h, pad) = (420.0f64, 300.0f64, 50.0f64);
    let dmax = depths.iter().copied().max().unwrap_or(1).max(1) as f64;
    let tg: Vec<&Rec> = recs.iter().filter(|r| r.n_gen > 0).collect();
    let ts_max = tg.iter().map(|r| r.ts).fold(1.0, f64::max) * 1.1;
    let mem_max = settings
        .iter()
        .filter_map(|st| recs.iter().find(|r| &r.setting == st))
        .map(|r| mib(r.bytes_per_token) * dmax)
        .fold(1.0, f64::max)
        * 1.1;
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{}\" font-family=\"sans-serif\" font-size=\"11\">\n",
        2.0 * w,
        h + 20.0 * settings.len() as f64 + 20.0
    );
    let panels = [("tg t/s vs depth", ts_max), ("KV MiB vs depth", mem_max)];
    for (pi, (title, ymax)) in panels.iter().enumerate() {
        let x0 = pi as f64 * w;
        let _ = writeln!(
            s,
            "<text x=\"{}\" y=\"15\">{model}: {title}</text>\n<line x1=\"{}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"black\"/>\n<line x1=\"{}\" y1=\"25\" x2=\"{}\" y2=\"{}\" stroke=\"black\"/>",
            x0 + pad,
            x0 + pad,
            h - pad,
            x0 + w - 10.0,
            h - pad,
            x0 + pad,
            x0 + pad,
            h - pad
        );
        let _ = writeln!(
            s,
            "<text x=\"{}\" y=\"{}\">{ymax:.0}</text><text x=\"{}\" y=\"{}\">{dmax:.0}</text>",
            x0 + 2.0,
            30.0,
            x0 + w - 40.0,
            h - pad + 15.0
        );
        for (si, st) in settings.iter().enumerate() {
            let pts: Vec<(f64, f64)> = depths
                .iter()
                .filter_map(|&d| {
                    let y = if pi == 0 {
                        tg.iter().find(|r| &r.setting == st && r.depth == d)?.ts
                    } else {
                        mib(recs.iter().find(|r| &r.setting == st)?.bytes_per_token * d)
                    };
                    Some((
                        x0 + pad + (w - pad - 10.0) * d as f64 / dmax,
                        h - pad - (h - pad - 25.0) * y / ymax,
                    ))
                })
                .collect();
            let line: Vec<String> = pts.iter().map(|(x, y)| format!("{x:.1},{y:.1}")).collect();
            let _ = writeln!(
                s,
                "<polyline fill=\"none\" stroke=\"{}\" stroke-width=\"2\" points=\"{}\"/>",
                COLORS[si % COLORS.len()],
                line.join(" ")
            );
        }
    }
    for (si, st) in settings.iter().enumerate() {
        let _ = writeln!(
            s,
            "<text x=\"{pad}\" y=\"{}\" fill=\"{}\">{st}</text>",
            h + 20.0 * si as f64,
            COLORS[si % COLORS.len()]
        );
    }
    s.push_str("</svg>\n");
    s
}

pub fn run(args: &KvBenchArgs) -> Result<()> {
    if args.types.is_empty() || args.depths.is_empty() || args.models.is_empty() {
        bail!("--types, --depths and --model must not be empty");
    }
    run_cmd(&mut cargo(["build", "--release", "-p", "specula-cli"]))?;
    let bin = repo_root().join("target/release/specula");
    for model in &args.models {
        sweep(args, &bin, model)?;
    }
    Ok(())
}

/// The sweep of one model: every setting at every depth, its three files.
fn sweep(args: &KvBenchArgs, bin: &Path, model: &str) -> Result<()> {
    let depths: Vec<String> = args.depths.iter().map(u64::to_string).collect();
    let mut recs = Vec::new();
    let mut jsonl = String::new();
    let mut settings: Vec<String> = Vec::new();
    // The tests, the same for specula bench and llama-bench.
    let test_args = [
        "-p".to_owned(),
        args.n_prompt.to_string(),
        "-n".to_owned(),
        args.n_gen.to_string(),
        "-r".to_owned(),
        args.repetitions.to_string(),
        "-t".to_owned(),
        args.threads.to_string(),
        "-d".to_owned(),
        depths.join(","),
    ];
    for t in &args.types {
        let (k, v) = t.split_once('/').unwrap_or((t, t));
        let setting = format!("{k}/{v}");
        let mut cmd = Command::new(bin);
        cmd.args(["bench", "-m", model, "-o", "jsonl", "-ctk", k, "-ctv", v])
            .args(&test_args);
        eprintln!("xtask: {model} {setting}");
        let out = cmd.output().context("running specula bench")?;
        if !out.status.success() {
            bail!(
                "specula bench -ctk {k} -ctv {v} failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let text = String::from_utf8(out.stdout).context("specula bench output")?;
        jsonl.push_str(&text);
        recs.extend(parse(&setting, &text)?);
        settings.push(setting.clone());
        if let Some(lb) = &args.llama_bench {
            if !(LLAMA_TYPES.contains(&k) && LLAMA_TYPES.contains(&v)) {
                eprintln!("xtask: {setting}: llama.cpp has no such cache type, not run there");
                continue;
            }
            let file = model_file(model)?;
            let mut cmd = Command::new(lb);
            cmd.arg("-m")
                .arg(&file)
                .args(["-o", "jsonl", "-fa", "1", "-ctk", k, "-ctv", v])
                .args(&test_args);
            eprintln!("xtask: {model} {setting} (llama.cpp)");
            let out = cmd
                .output()
                .with_context(|| format!("running {}", lb.display()))?;
            if !out.status.success() {
                bail!(
                    "llama-bench -ctk {k} -ctv {v} failed: {}",
                    String::from_utf8_lossy(&out.stderr)
                );
            }
            let text = String::from_utf8(out.stdout).context("llama-bench output")?;
            jsonl.push_str(&text);
            recs.extend(parse_with(&llama_setting(&setting), &text, false)?);
        }
    }
    if args.llama_bench.is_some() {
        let mut rows = Vec::new();
        for st in &settings {
            rows.push(st.clone());
            let theirs = llama_setting(st);
            if recs.iter().any(|r| r.setting == theirs) {
                rows.push(theirs);
                rows.push(format!("{st} specula ÷ llama.cpp"));
            }
        }
        recs.extend(ratios(&recs, &settings));
        settings = rows;
    }
    let dir: PathBuf = repo_root().join(&args.out);
    std::fs::create_dir_all(&dir)?;
    // A GGUF path names its files after its stem (a manifest name may hold dots).
    let base = dir.join(format!("kv-{}", results_name(model)));
    let md = table(&recs, &settings, &args.depths, model);
    write_atomic(&suffixed(&base, "jsonl"), &jsonl)?;
    write_atomic(&suffixed(&base, "md"), &md)?;
    // The plot shows speeds (and memory): not the ratio rows.
    let plotted: Vec<String> = settings
        .iter()
        .filter(|s| !s.ends_with("÷ llama.cpp"))
        .cloned()
        .collect();
    write_atomic(
        &suffixed(&base, "svg"),
        &plot(&recs, &plotted, &args.depths, model),
    )?;
    print!("{md}");
    eprintln!("xtask: wrote {}.{{jsonl,md,svg}}", rel(&base).display());
    Ok(())
}

/// The file of a manifest model name (fetched if it is not cached yet), or the path given.
fn model_file(model: &str) -> Result<PathBuf> {
    let p = PathBuf::from(model);
    if p.is_file() {
        return Ok(p);
    }
    let cache = specula_fetch::ModelCache::from_env().context("locating the model cache")?;
    let paths = cache
        .fetch_names(&[model], true)
        .with_context(|| format!("fetching {model}"))?;
    paths
        .into_iter()
        .next()
        .with_context(|| format!("no file for {model}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama_bench_rows_and_ratios_join_the_table() {
        let ours = "{\"n_prompt\":512,\"n_gen\":0,\"n_depth\":16384,\"avg_ts\":60.0,\"kv_bytes_per_token\":100}\n";
        let theirs = "{\"build_commit\":\"0c1e570\",\"n_prompt\":512,\"n_gen\":0,\"n_depth\":16384,\"avg_ts\":40.0,\"type_k\":\"f16\"}\n";
        let mut recs = parse("f16/f16", ours).unwrap();
        recs.extend(parse_with(&llama_setting("f16/f16"), theirs, false).unwrap());
        assert!(
            parse("f16/f16", theirs).is_err(),
            "llama-bench has no cache accounting"
        );
        let settings = vec!["f16/f16".to_owned()];
        let r = ratios(&recs, &settings);
        assert_eq!(r.len(), 1);
        assert!((r[0].ts - 1.5).abs() < 1e-12);
        recs.extend(r);
        let rows = vec![
            "f16/f16".to_owned(),
            llama_setting("f16/f16"),
            "f16/f16 specula ÷ llama.cpp".to_owned(),
        ];
        let md = table(&recs, &rows, &[16384], "m");
        assert!(
            md.contains("| f16/f16 llama.cpp | 0 | 0.0 | 40.00 |"),
            "{md}"
        );
        assert!(
            md.contains("| f16/f16 specula ÷ llama.cpp | 100 | 1.6 | 1.50 |"),
            "{md}"
        );
    }

    #[test]
    fn records_become_a_table_and_a_plot() {
        let line = |t: &str, p: u64, n: u64, d: u64, ts: f64| {
            format!(
                "{{\"type_k\":\"{t}\",\"n_prompt\":{p},\"n_gen\":{n},\"n_depth\":{d},\"avg_ts\":{ts},\"kv_bytes_per_token\":100}}\n"
            )
        };
        let out = [
            line("f16", 0, 32, 0, 50.0),
            line("f16", 0, 32, 1024, 40.0),
            line("f16", 512, 0, 0, 500.0),
        ]
        .concat();
        let recs = parse("f16/f16", &out).unwrap();
        assert_eq!(recs.len(), 3);
        let md = table(&recs, &["f16/f16".into()], &[0, 1024], "m");
        assert!(
            md.contains("| f16/f16 | 100 | 0.1 | 50.00 | 40.00 | 500.00 | – |"),
            "{md}"
        );
        let svg = plot(&recs, &["f16/f16".into()], &[0, 1024], "m");
        assert!(svg.starts_with("<svg") && svg.contains("polyline"));
        assert!(parse("x", "{\"n_prompt\":1}").is_err());
    }
}
