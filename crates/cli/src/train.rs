//! `specula train dflash|eagle3`: a DFlash drafter or an EAGLE-3 head learnt from the target's
//! own hidden states (what `specula extract` wrote), exported as GGUF drafters that
//! `specula run -md` and llama.cpp load.
//!
//! The trainer is `specula-train` (burn); this binary carries it only when built with the
//! `train` feature (`cargo build --release -p specula-cli --features train`), so the rest of the
//! workspace never compiles burn. Without it the subcommand says how to get it.
//!
//! Output directory: `checkpoint.bin` (every `--checkpoint-every` steps; `--resume` continues
//! from it and reaches the bytes an uninterrupted run reaches), `train.jsonl` (one line per
//! step, then per validation), `loss.svg` (training and validation loss, validation τ) and
//! `drafter-<type>.gguf` for each `--export` type.

use std::path::PathBuf;

use anyhow::Result;

/// Which drafter to train.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Kind {
    /// DFlash: a block of MASK tokens drafted in one forward over the target's taps.
    Dflash,
    /// EAGLE-3: a one-layer head chained in feature space, trained with the training-time
    /// test (three taps).
    Eagle3,
}

/// Arguments of `specula train`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The drafter to train.
    #[arg(value_enum)]
    pub kind: Kind,
    /// The target the features are of: a GGUF file or a manifest model name.
    #[arg(long = "target", short = 'm')]
    pub target: Option<String>,
    /// The directory `specula extract` wrote.
    #[arg(long = "features")]
    pub features: PathBuf,
    /// Output directory (checkpoint, logs, plot, drafters).
    #[arg(long = "out", short = 'o')]
    pub out: PathBuf,
    /// Continue the run whose checkpoint is in `--out` (its settings must be these).
    #[arg(long = "resume")]
    pub resume: bool,
    /// Draft layers (DFlash; an EAGLE-3 head has one).
    #[arg(long = "layers", default_value_t = 1)]
    pub layers: usize,
    /// Block size (the anchor and block − 1 drafted positions).
    #[arg(long = "block", default_value_t = 16)]
    pub block: usize,
    /// Draft vocabulary: the K most frequent training labels (0: the target's whole
    /// vocabulary, the head borrowed).
    #[arg(long = "draft-vocab", default_value_t = 8192)]
    pub draft_vocab: usize,
    /// Optimiser steps. 0 (DFlash with `--init copy` only): the draft as the initialisation
    /// builds it, validated and written untrained.
    #[arg(long = "steps", default_value_t = 2000)]
    pub steps: usize,
    /// Peak learning rate (AdamW; linear warm-up over 5 % of the steps, cosine to 10 %).
    #[arg(long = "lr", default_value_t = 1e-3)]
    pub lr: f32,
    /// EAGLE-3: training-time-test unroll steps (the head fed its own outputs).
    #[arg(long = "ttt-steps", default_value_t = 3)]
    pub ttt_steps: usize,
    /// Blocks per sequence per step (random anchors; DFlash).
    #[arg(long = "anchors", default_value_t = 64)]
    pub anchors: usize,
    /// Sequences per step.
    #[arg(long = "seqs-per-step", default_value_t = 2)]
    pub seqs_per_step: usize,
    /// γ of the loss's position decay `exp(−(k−1)/γ)`.
    #[arg(long = "gamma", default_value_t = 7.0)]
    pub gamma: f32,
    /// DFlash context curriculum: early steps let a block see only the last N context
    /// positions before its anchor, so attention learns to find them before it faces the
    /// whole context (0: every step sees the whole context).
    #[arg(long = "window", default_value_t = 32)]
    pub window: usize,
    /// Steps of the context curriculum (default: three fifths of --steps).
    #[arg(long = "window-steps")]
    pub window_steps: Option<usize>,
    /// DFlash: weight of a loss on the anchor row itself (it learns block row 1's token),
    /// relative to row 1's; it teaches the one block row whose query carries content to look
    /// the anchor up in the context, which the MASK rows then read (0: the DFlash recipe).
    #[arg(long = "anchor-loss", default_value_t = 0.0)]
    pub anchor_loss: f32,
    /// DFlash: initial gain of the per-head query and key norms (a score is at most
    /// gain² · √head_dim, so a larger gain lets attention pick one key among hundreds early).
    #[arg(long = "qk-norm-init", default_value_t = 1.0)]
    pub qk_norm_init: f32,
    /// Train `fc` on the features as extracted, not divided by each column's RMS (the
    /// division, folded into `fc` at export, keeps a few huge residual columns from
    /// dominating its updates).
    #[arg(long = "raw-features")]
    pub raw_features: bool,
    /// DFlash: where the parameters start — `random` (the DFlash recipe) or `copy`, a draft
    /// that already looks the anchor's token up in the context and drafts what the target
    /// predicted after it (needs tap 0 and the target's output or its last layer's input —
    /// the latter loads in llama.cpp too; training continues from it).
    #[arg(long = "init", default_value = "random", value_parser = ["random", "copy"])]
    pub init: String,
    /// DFlash: K/V heads of the draft (a divisor of the target's query heads; default the
    /// target's). More widen what an attention layer carries from the context.
    #[arg(long = "kv-heads")]
    pub kv_heads: Option<usize>,
    /// What rows learn (features with --top-k for the first two): `greedy`, the target's
    /// next token while the corpus after the anchor is the target's greedy path (DFlash; as
    /// `target` for EAGLE-3); `target`, its next token everywhere; `corpus`, the corpus's.
    #[arg(long = "labels", default_value = "greedy", value_parser = ["greedy", "target", "corpus"])]
    pub labels: String,
    /// The taps the drafter reads (a subset of the extracted ones, in this order); default
    /// every extracted tap.
    #[arg(long = "taps", value_delimiter = ',')]
    pub taps: Vec<usize>,
    /// The MASK token (default: the target's padding token, else its end of sequence).
    #[arg(long = "mask-token")]
    pub mask_token: Option<u32>,
    /// Seed of every random draw.
    #[arg(long = "seed", default_value_t = 42)]
    pub seed: u64,
    /// Steps between checkpoints and validations.
    #[arg(long = "checkpoint-every", default_value_t = 100)]
    pub checkpoint_every: usize,
    /// Validation sequences held back from training.
    #[arg(long = "val-seqs", default_value_t = 16)]
    pub val_seqs: usize,
    /// Stop after this step (checkpointed; `--resume` continues to `--steps`); the drafters
    /// are written only when the run is complete.
    #[arg(long = "stop-at")]
    pub stop_at: Option<usize>,
    /// Where training computes: `cpu` (burn's CPU backend), `cuda` or `cuda:N` (a GPU; needs
    /// a build with the `cuda` feature). Not a setting of the run: `--resume` may continue a
    /// checkpoint on the other device.
    #[arg(long = "device", default_value = "cpu")]
    pub device: String,
    /// Drafter types written when training ends (comma-separated: f16, q8_0, nvfp4).
    #[arg(long = "export", value_delimiter = ',', default_value = "f16")]
    pub export: Vec<String>,
}

/// Runs `specula train`.
#[cfg(not(feature = "train"))]
pub fn run(_args: &Args) -> Result<String> {
    anyhow::bail!(
        "this specula was built without drafter training; build it with the `train` feature: \
         cargo build --release -p specula-cli --features train"
    )
}

/// Runs `specula train`.
#[cfg(feature = "train")]
pub fn run(args: &Args) -> Result<String> {
    imp::run(args)
}

#[cfg(feature = "train")]
mod imp {
    use std::fmt::Write as _;
    use std::io::Write as _;
    use std::path::Path;

    use anyhow::{Context, Result, bail};
    use indicatif::{ProgressBar, ProgressStyle};
    use specula_train::accel::Accel;
    use specula_train::dflash::{DflashConfig, Init, Labels, Run, StepLog, ValLog};
    use specula_train::eagle3::{Eagle3Config, Eagle3Run};
    use specula_train::export::{ExportType, write_dflash, write_eagle3};
    use specula_train::features::FeatureSet;
    use specula_train::plot::{Series, line_chart};
    use specula_train::target::Target;

    use super::{Args, Kind};
    use crate::load;

    pub fn run(args: &Args) -> Result<String> {
        let types = args
            .export
            .iter()
            .map(|t| ExportType::parse(t).map(|e| (t.to_ascii_lowercase(), e)))
            .collect::<Result<Vec<_>, _>>()?;
        if args.steps == 0 && !(matches!(args.kind, Kind::Dflash) && args.init == "copy") {
            bail!(
                "--steps must be at least 1 (0 writes a DFlash draft as --init copy builds it, \
                 untrained; a random start is not worth writing)"
            );
        }
        let accel = Accel::parse(&args.device)?;
        // Checked before the target and the features are read: a device that cannot run
        // fails in a second, not after the vocabulary pass.
        accel.device()?;
        let path = load::model_path(args.target.as_deref())?;
        let target = Target::load(&path).with_context(|| format!("loading {}", path.display()))?;
        let mut feats = FeatureSet::open(&args.features)?;
        if !args.taps.is_empty() {
            if args.taps.contains(&0) && !feats.manifest.taps.contains(&0) {
                // Tap 0 is the token embedding the first layer reads: it follows from the ids.
                feats.derive_tap0(target.embd.clone(), target.hp.embd_scale.unwrap_or(1.0));
            }
            feats.select_taps(&args.taps)?;
        }
        let labels = match args.labels.as_str() {
            "corpus" => Labels::Corpus,
            "target" => Labels::Target,
            _ => Labels::Greedy,
        };
        std::fs::create_dir_all(&args.out)
            .with_context(|| format!("creating {}", args.out.display()))?;
        let stem = path
            .file_stem()
            .map_or_else(|| "target".into(), |s| s.to_string_lossy().into_owned());
        let mut out = String::new();
        match args.kind {
            Kind::Dflash => {
                let mut cfg = DflashConfig::new(args.steps);
                cfg.n_layer = args.layers;
                cfg.block = args.block;
                cfg.draft_vocab = args.draft_vocab;
                cfg.anchors = args.anchors;
                cfg.seqs_per_step = args.seqs_per_step;
                cfg.gamma = args.gamma;
                cfg.window = args.window;
                if let Some(n) = args.window_steps {
                    cfg.window_steps = n;
                }
                cfg.anchor_loss = args.anchor_loss;
                cfg.qk_norm_init = args.qk_norm_init;
                cfg.standardize = !args.raw_features;
                cfg.labels = labels;
                cfg.init = if args.init == "copy" {
                    Init::Copy
                } else {
                    Init::Random
                };
                cfg.kv_heads = args.kv_heads;
                cfg.mask = args.mask_token;
                cfg.seed = args.seed;
                cfg.optim.lr = args.lr;
                cfg.checkpoint_every = args.checkpoint_every;
                cfg.val_seqs = args.val_seqs;
                let mut run = Run::start(&cfg, &target, &feats, &args.out, args.resume)?;
                run.accel = accel;
                let before = run.step;
                drive(
                    args,
                    &run.steps.clone(),
                    &run.vals.clone(),
                    run.step,
                    |each| run.train(&target, &feats, &args.out, args.stop_at, each),
                )?;
                let title = format!(
                    "DFlash drafter: {} layer(s), block {}, vocabulary {}",
                    run.shape.n_layer,
                    run.shape.block,
                    run.vocab.len()
                );
                if run.steps.is_empty() {
                    // Nothing trained (`--steps 0`): no curve to draw.
                    std::fs::remove_file(args.out.join("loss.svg")).ok();
                } else {
                    write_plot(&title, &run.steps, &run.vals, &args.out.join("loss.svg"))?;
                }
                if stopped(&mut out, run.step, args) {
                    return Ok(out);
                }
                for (name, ty) in &types {
                    let file = args.out.join(format!("drafter-{name}.gguf"));
                    let what = format!("{stem} DFlash drafter (specula train)");
                    write_dflash(
                        &file,
                        &run.shape,
                        &run.export_params(),
                        &run.vocab,
                        &target,
                        *ty,
                        &what,
                    )?;
                    let _ = writeln!(out, "wrote {}", file.display());
                }
                let _ = writeln!(
                    out,
                    "dflash: {} layers, block {}, draft vocabulary {}, taps {:?}; {}",
                    run.shape.n_layer,
                    run.shape.block,
                    run.vocab.len(),
                    run.shape.taps,
                    run.steps.last().map_or_else(
                        || "untrained (the draft as --init built it)".to_owned(),
                        |s| format!(
                            "steps {before}..{} (of {}), final loss {:.4}",
                            run.step, args.steps, s.loss
                        )
                    )
                );
                summary(&mut out, &run.vals);
                if run.shape.taps.contains(&target.hp.n_layer) {
                    let _ = writeln!(
                        out,
                        "note: the drafter reads tap {} (the target's output); llama.cpp's DFlash \
                         captures layer inputs only (taps 0..{}), so it loads in specula, not there",
                        target.hp.n_layer,
                        target.hp.n_layer.saturating_sub(1)
                    );
                }
            }
            Kind::Eagle3 => {
                if args.layers != 1 {
                    bail!(
                        "--layers {}: an EAGLE-3 head has one decoder layer",
                        args.layers
                    );
                }
                if args.init != "random" || args.kv_heads.is_some() {
                    bail!(
                        "--init copy and --kv-heads shape a DFlash draft; an EAGLE-3 head starts \
                         random and keeps the target's K/V heads"
                    );
                }
                let mut cfg = Eagle3Config::new(args.steps);
                cfg.draft_vocab = args.draft_vocab;
                cfg.ttt_steps = args.ttt_steps;
                cfg.seqs_per_step = args.seqs_per_step;
                cfg.labels = if labels == Labels::Greedy {
                    Labels::Target
                } else {
                    labels
                };
                cfg.standardize = !args.raw_features;
                cfg.seed = args.seed;
                cfg.optim.lr = args.lr;
                cfg.checkpoint_every = args.checkpoint_every;
                cfg.val_seqs = args.val_seqs;
                let mut run = Eagle3Run::start(&cfg, &target, &feats, &args.out, args.resume)?;
                run.accel = accel;
                let before = run.step;
                drive(
                    args,
                    &run.steps.clone(),
                    &run.vals.clone(),
                    run.step,
                    |each| run.train(&target, &feats, &args.out, args.stop_at, each),
                )?;
                let title = format!(
                    "EAGLE-3 head: {} training-time-test steps, vocabulary {}",
                    run.config.ttt_steps,
                    run.vocab.len()
                );
                write_plot(&title, &run.steps, &run.vals, &args.out.join("loss.svg"))?;
                if stopped(&mut out, run.step, args) {
                    return Ok(out);
                }
                for (name, ty) in &types {
                    let file = args.out.join(format!("drafter-{name}.gguf"));
                    let what = format!("{stem} EAGLE-3 head (specula train)");
                    write_eagle3(
                        &file,
                        &run.shape,
                        &run.export_params(),
                        &run.vocab,
                        &target,
                        *ty,
                        &what,
                    )?;
                    let _ = writeln!(out, "wrote {}", file.display());
                }
                let _ = writeln!(
                    out,
                    "eagle3: training-time test {} steps, draft vocabulary {}, taps {:?}; steps {before}..{} (of {}), final loss {:.4}",
                    run.config.ttt_steps,
                    run.vocab.len(),
                    run.shape.taps,
                    run.step,
                    args.steps,
                    run.steps.last().map_or(f32::NAN, |s| s.loss)
                );
                summary(&mut out, &run.vals);
            }
        }
        Ok(out)
    }

    /// `true` (with the message) when the run stopped before its last step.
    fn stopped(out: &mut String, step: usize, args: &Args) -> bool {
        if step >= args.steps {
            return false;
        }
        let _ = writeln!(
            out,
            "stopped at step {step} of {} (checkpoint in {}; continue with --resume)",
            args.steps,
            args.out.display()
        );
        true
    }

    fn summary(out: &mut String, vals: &[ValLog]) {
        if let Some(v) = vals.last() {
            let acc: Vec<String> = v.accuracy.iter().map(|a| format!("{a:.2}")).collect();
            let _ = writeln!(
                out,
                "validation at step {}: loss {:.4}, τ {:.3}, accuracy per position [{}]",
                v.step,
                v.loss,
                v.tau,
                acc.join(", ")
            );
        }
    }

    /// Runs `train` with a progress bar and `train.jsonl` (rewritten from the run's history
    /// first, so a resumed run's log is that of an uninterrupted one).
    fn drive(
        args: &Args,
        steps: &[StepLog],
        vals: &[ValLog],
        step: usize,
        train: impl FnOnce(&mut dyn FnMut(&StepLog, Option<&ValLog>)) -> specula_train::Result<()>,
    ) -> Result<()> {
        let bar = ProgressBar::new(args.steps as u64);
        bar.set_style(
            ProgressStyle::with_template("{spinner} [{bar:30}] {pos}/{len} steps {eta} {wide_msg}")
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> "),
        );
        bar.set_position(step as u64);
        let log_path = args.out.join("train.jsonl");
        let mut log = std::fs::File::create(&log_path)
            .with_context(|| format!("creating {}", log_path.display()))?;
        for s in steps {
            writeln!(log, "{}", serde_json::json!({ "step": s }))?;
            for v in vals.iter().filter(|v| v.step == s.step + 1) {
                writeln!(log, "{}", serde_json::json!({ "val": v }))?;
            }
        }
        let mut io_err = None;
        train(&mut |s, v| {
            let mut line = format!(
                "loss {:.3}  lr {:.2e}  {:.0} rows/s",
                s.loss, s.lr, s.rows_per_s
            );
            if let Err(e) = writeln!(log, "{}", serde_json::json!({ "step": s })) {
                io_err = Some(e);
            }
            if let Some(v) = v {
                let _ = write!(line, "  val loss {:.3} τ {:.2}", v.loss, v.tau);
                if let Err(e) = writeln!(log, "{}", serde_json::json!({ "val": v })) {
                    io_err = Some(e);
                }
                bar.println(format!("step {}: {line}", v.step));
            }
            bar.set_message(line);
            bar.inc(1);
        })?;
        bar.finish_and_clear();
        if let Some(e) = io_err {
            return Err(e).with_context(|| format!("writing {}", log_path.display()));
        }
        Ok(())
    }

    fn write_plot(title: &str, steps: &[StepLog], vals: &[ValLog], path: &Path) -> Result<()> {
        // Training loss as a moving mean over 20 steps (single steps are noisy).
        let n = 20;
        let train: Vec<(f64, f64)> = steps
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let w = &steps[i.saturating_sub(n - 1)..=i];
                #[allow(clippy::cast_precision_loss, reason = "window sizes are small")]
                let mean = w.iter().map(|s| f64::from(s.loss)).sum::<f64>() / w.len() as f64;
                #[allow(clippy::cast_precision_loss, reason = "step counts are small")]
                let x = s.step as f64 + 1.0;
                (x, mean)
            })
            .collect();
        #[allow(clippy::cast_precision_loss, reason = "step counts are small")]
        let val = |f: &dyn Fn(&ValLog) -> f32| -> Vec<(f64, f64)> {
            vals.iter()
                .map(|v| (v.step as f64, f64::from(f(v))))
                .collect()
        };
        let svg = line_chart(
            title,
            "step",
            "loss (nats) / τ",
            &[
                Series {
                    name: "train loss (mean of 20)".into(),
                    color: "steelblue",
                    points: train,
                },
                Series {
                    name: "validation loss".into(),
                    color: "darkorange",
                    points: val(&|v| v.loss),
                },
                Series {
                    name: "validation τ".into(),
                    color: "seagreen",
                    points: val(&|v| v.tau),
                },
            ],
        );
        std::fs::write(path, svg).with_context(|| format!("writing {}", path.display()))
    }
}
