//! `specula quantize`: `llama-quantize` in Rust — the same presets, the same per-tensor types,
//! the same bytes.
//!
//! [`mod@plan`] decides each tensor's type and the output order exactly as llama.cpp does (see its
//! module docs); this module reads the input, converts the tensors that change type (rows
//! split across `--threads` scoped threads; each row is quantized independently, so the bytes
//! do not depend on the thread count), and writes the output atomically with the metadata
//! llama.cpp writes: the input's keys in order without `general.quantization_version`,
//! `general.file_type` and the `split.*` keys, then `general.quantization_version = 2` and
//! `general.file_type = <ftype id>` appended (`gguf_set_val_*` removes a key and appends it).
//!
//! One deliberate difference: an input with a `general.alignment` other than 32 keeps that
//! alignment here, while llama.cpp copies the key but lays the data out at 32, writing a file
//! that contradicts its own header.

mod plan;

use std::fmt::Write as _;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;
use specula_gguf::{GgmlType, Gguf, GgufWriter, Value};
use specula_quant::QType;

use plan::{Ftype, Options, Plan, TensorPlan, plan};

/// Keys llama.cpp drops from the copied metadata (the first two are then appended anew).
const DROPPED_KEYS: &[&str] = &[
    "general.quantization_version",
    "general.file_type",
    "split.no",
    "split.count",
    "split.tensors.count",
];

/// `GGML_QNT_VERSION`, written as `general.quantization_version`.
const QUANTIZATION_VERSION: u32 = 2;

/// Values converted per slab of a tensor: bounds memory to a few hundred MiB on any model.
const SLAB_VALUES: usize = 16 << 20;

/// Arguments of `specula quantize`.
#[derive(Debug, clap::Args)]
#[command(
    after_help = "Types: Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 F16 BF16 F32 Q2_K Q2_K_S Q3_K(_S|_M|_L) \
    Q4_K(_S|_M) Q5_K(_S|_M) Q6_K IQ4_NL IQ4_XS MXFP4_MOE, in any case, or their llama_ftype ids."
)]
pub struct Args {
    /// The GGUF model to quantize (F32, F16 or BF16; an already quantized one needs
    /// --allow-requantize).
    #[arg(value_name = "IN")]
    pub input: PathBuf,
    /// Where to write the quantized model (atomically: nothing appears there on failure).
    /// With --dry-run it may be left out.
    #[arg(value_name = "OUT")]
    pub output: String,
    /// The llama-quantize preset (Q4_K_M, Q8_0, …).
    #[arg(value_name = "TYPE")]
    pub ty: Option<String>,
    /// Give every quantizable tensor the preset's base type: no mixture rules, no special type
    /// for output.weight or the token embedding (the --*-type flags still apply).
    #[arg(long)]
    pub pure: bool,
    /// Allow converting tensors that are already quantized (dequantized to f32 first; loses
    /// quality compared with quantizing from 16 or 32 bits).
    #[arg(long)]
    pub allow_requantize: bool,
    /// Copy output.weight as it is.
    #[arg(long)]
    pub leave_output_tensor: bool,
    /// The ggml type of output.weight (and of a tied token embedding).
    #[arg(long, value_name = "T")]
    pub output_tensor_type: Option<String>,
    /// The ggml type of token_embd.weight.
    #[arg(long, value_name = "T")]
    pub token_embedding_type: Option<String>,
    /// Worker threads (0: one per CPU).
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub threads: usize,
    /// Only show what each tensor would become; write nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// With --dry-run: print the plan as one JSON object.
    #[arg(long, requires = "dry_run")]
    pub json: bool,
}

/// Runs `specula quantize` and returns its report.
///
/// # Errors
/// Unknown types, unreadable or corrupt input, the same file as input and output, tensors that
/// cannot be converted (named), and write failures (after which nothing is left at OUT).
pub fn run(args: &Args) -> Result<String> {
    let (output, ty) = match (&args.ty, args.dry_run) {
        (Some(ty), _) => (Some(PathBuf::from(&args.output)), ty.as_str()),
        (None, true) => (None, args.output.as_str()),
        (None, false) => bail!("missing TYPE: usage is `specula quantize IN OUT TYPE`"),
    };
    let opts = Options {
        ftype: Ftype::parse(ty)?,
        pure: args.pure,
        leave_output_tensor: args.leave_output_tensor,
        output_tensor_type: args
            .output_tensor_type
            .as_deref()
            .map(|s| plan::parse_target_type("--output-tensor-type", s))
            .transpose()?,
        token_embedding_type: args
            .token_embedding_type
            .as_deref()
            .map(|s| plan::parse_target_type("--token-embedding-type", s))
            .transpose()?,
        allow_requantize: args.allow_requantize,
    };
    if let Some(out) = &output
        && !args.dry_run
        && same_file(&args.input, out)
    {
        bail!(
            "input and output are the same file ({}); write the quantized model elsewhere",
            out.display()
        );
    }
    let gguf =
        Gguf::open(&args.input).with_context(|| format!("reading {}", args.input.display()))?;
    if let Some(n) = gguf.metadata().get_u64("split.count")
        && n > 1
    {
        bail!(
            "{} is shard {} of a {n}-file split model; merge it first (llama-gguf-split --merge)",
            args.input.display(),
            gguf.metadata().get_u64("split.no").unwrap_or(0) + 1
        );
    }
    let plan = plan(gguf.header(), &opts)
        .with_context(|| format!("quantizing {} as {}", args.input.display(), opts.ftype))?;

    match output {
        Some(out) if !args.dry_run => {
            let threads = match args.threads {
                0 => std::thread::available_parallelism().map_or(1, std::num::NonZero::get),
                n => n,
            };
            let started = Instant::now();
            let written = write(&gguf, &plan, &out, threads)?;
            Ok(report(&gguf, &plan, &args.input, &out, written, started))
        }
        _ if args.json => {
            Ok(serde_json::to_string_pretty(&DryRun::new(&gguf, &plan, args))? + "\n")
        }
        _ => Ok(dry_run_text(&gguf, &plan)),
    }
}

/// Whether two paths name one file (as `std::filesystem::equivalent`, plus equal spellings).
fn same_file(a: &Path, b: &Path) -> bool {
    if a == b {
        return true;
    }
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        #[cfg(unix)]
        (Ok(ma), Ok(mb)) => {
            use std::os::unix::fs::MetadataExt;
            ma.dev() == mb.dev() && ma.ino() == mb.ino()
        }
        #[cfg(not(unix))]
        (Ok(_), Ok(_)) => std::fs::canonicalize(a).ok() == std::fs::canonicalize(b).ok(),
        _ => false,
    }
}

/// Writes the output file; returns its size.
fn write(gguf: &Gguf, plan: &Plan, out: &Path, threads: usize) -> Result<u64> {
    let mut w = GgufWriter::new();
    for (key, value) in gguf.metadata().iter() {
        if !DROPPED_KEYS.contains(&key) {
            w.add(key, value.clone())?;
        }
    }
    w.add(
        "general.quantization_version",
        Value::U32(QUANTIZATION_VERSION),
    )?;
    w.add("general.file_type", Value::U32(plan.ftype.id()))?;
    for t in &plan.tensors {
        w.add_tensor(&t.name, t.to, &t.shape)?;
    }

    let bar = ProgressBar::new(plan.tensors.len() as u64).with_style(
        ProgressStyle::with_template("{spinner} [{bar:30}] {pos}/{len} {elapsed} {wide_msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    // A conversion error is kept here and reported as itself; the writer only sees that the
    // callback failed, removes its temporary file and returns.
    let mut failure: Option<anyhow::Error> = None;
    let result = w.write_file(out, |i, _, sink| {
        let t = &plan.tensors[i];
        bar.set_message(format!("{} {} → {}", t.name, t.from, t.to));
        let data = gguf.tensor_data(t.input_index);
        let r = if t.converts() {
            convert(data, t, threads, sink).map_err(|e| match e {
                ConvertError::Io(e) => e,
                ConvertError::Data(e) => {
                    failure = Some(e);
                    io::Error::other("tensor conversion failed")
                }
            })
        } else {
            sink.write_all(data)
        };
        bar.inc(1);
        r
    });
    bar.finish_and_clear();
    match (result, failure) {
        (Ok(n), _) => Ok(n),
        (Err(_), Some(e)) => Err(e.context(format!(
            "nothing was written to {} (conversion failed)",
            out.display()
        ))),
        (Err(e), None) => Err(anyhow::Error::new(e).context(format!(
            "writing {} (nothing was left there)",
            out.display()
        ))),
    }
}

enum ConvertError {
    /// Writing to the output failed.
    Io(io::Error),
    /// The data could not be converted (a non-finite value, an unsupported type).
    Data(anyhow::Error),
}

impl From<io::Error> for ConvertError {
    fn from(e: io::Error) -> Self {
        Self::Io(e)
    }
}

/// Converts one tensor, a slab of rows at a time, each slab's rows split across `threads`.
fn convert(
    data: &[u8],
    t: &TensorPlan,
    threads: usize,
    sink: &mut dyn Write,
) -> Result<(), ConvertError> {
    let rows = Rows::new(t).map_err(ConvertError::Data)?;
    let slab_rows = (SLAB_VALUES / rows.ne0).max(1);
    for (k, src) in data.chunks(slab_rows * rows.src_bytes).enumerate() {
        let out = rows
            .convert_slab(src, k * slab_rows, threads)
            .map_err(ConvertError::Data)?;
        sink.write_all(&out)?;
    }
    Ok(())
}

/// The row geometry of one tensor's conversion.
struct Rows<'a> {
    name: &'a str,
    from: QType,
    to: QType,
    ne0: usize,
    src_bytes: usize,
    dst_bytes: usize,
}

impl<'a> Rows<'a> {
    fn new(t: &'a TensorPlan) -> Result<Self> {
        let qtype = |g: GgmlType| {
            QType::from_ggml_id(g.id())
                .with_context(|| format!("tensor {}: type {g} is not supported", t.name))
        };
        let (from, to) = (qtype(t.from)?, qtype(t.to)?);
        let ne0 = usize::try_from(t.shape[0]).context("row length overflows usize")?;
        Ok(Self {
            name: &t.name,
            from,
            to,
            ne0,
            src_bytes: from.row_bytes(ne0)?,
            dst_bytes: to.row_bytes(ne0)?,
        })
    }

    /// Converts the rows in `src` (whole rows; the first is row `first` of the tensor).
    fn convert_slab(&self, src: &[u8], first: usize, threads: usize) -> Result<Vec<u8>> {
        let n = src.len() / self.src_bytes;
        let mut out = vec![0u8; n * self.dst_bytes];
        let threads = threads.clamp(1, n.max(1));
        if threads == 1 {
            self.convert_rows(src, &mut out, first)?;
            return Ok(out);
        }
        let per = n.div_ceil(threads);
        std::thread::scope(|s| {
            let workers: Vec<_> = src
                .chunks(per * self.src_bytes)
                .zip(out.chunks_mut(per * self.dst_bytes))
                .enumerate()
                .map(|(k, (src, dst))| {
                    s.spawn(move || self.convert_rows(src, dst, first + k * per))
                })
                .collect();
            workers
                .into_iter()
                .try_for_each(|w| w.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
        })?;
        Ok(out)
    }

    fn convert_rows(&self, src: &[u8], dst: &mut [u8], first: usize) -> Result<()> {
        let mut row = vec![0f32; self.ne0];
        for (r, (s, d)) in src
            .chunks_exact(self.src_bytes)
            .zip(dst.chunks_exact_mut(self.dst_bytes))
            .enumerate()
        {
            specula_quant::dequantize_row(self.from, s, &mut row)?;
            if let Some(col) = row.iter().position(|v| !v.is_finite()) {
                // llama.cpp validates its output and fails on the NaN/Inf this would produce.
                bail!(
                    "tensor {}: row {}, column {col} holds {}, which cannot be quantized",
                    self.name,
                    first + r,
                    row[col]
                );
            }
            specula_quant::quantize_row(self.to, &row, d)?;
        }
        Ok(())
    }
}

#[allow(clippy::cast_precision_loss, reason = "sizes shown in MiB")]
fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

#[allow(
    clippy::cast_precision_loss,
    reason = "bits per weight, shown with two decimals"
)]
fn bpw(bytes: u64, n: u64) -> f64 {
    if n == 0 {
        0.0
    } else {
        8.0 * bytes as f64 / n as f64
    }
}

/// Sizes of the tensor data before and after, and the element count.
fn sizes(gguf: &Gguf, plan: &Plan) -> (u64, u64, u64) {
    let mut before = 0;
    let mut after = 0;
    let mut n = 0;
    for t in &plan.tensors {
        let info = &gguf.tensors()[t.input_index];
        before += info.n_bytes();
        n += info.n_elements();
        after += info.n_elements() / t.to.block_size() * t.to.type_size();
    }
    (before, after, n)
}

fn type_counts(plan: &Plan) -> String {
    let mut counts = std::collections::BTreeMap::<&str, usize>::new();
    for t in &plan.tensors {
        *counts.entry(t.to.name()).or_default() += 1;
    }
    counts
        .iter()
        .map(|(t, n)| format!("{t} ×{n}"))
        .collect::<Vec<_>>()
        .join(", ")
}

fn report(
    gguf: &Gguf,
    plan: &Plan,
    input: &Path,
    out: &Path,
    written: u64,
    started: Instant,
) -> String {
    let (before, after, n) = sizes(gguf, plan);
    let converted = plan.tensors.iter().filter(|t| t.converts()).count();
    let mut s = String::new();
    let _ = writeln!(
        s,
        "quantized {} to {} as {} (file type {}) in {:.2} s",
        input.display(),
        out.display(),
        plan.ftype,
        plan.ftype.id(),
        started.elapsed().as_secs_f64()
    );
    let _ = writeln!(
        s,
        "  tensors: {} ({converted} converted, {} copied); types: {}",
        plan.tensors.len(),
        plan.tensors.len() - converted,
        type_counts(plan)
    );
    let _ = writeln!(
        s,
        "  data: {:.2} MiB ({:.2} bpw) -> {:.2} MiB ({:.2} bpw); file: {written} bytes",
        mib(before),
        bpw(before, n),
        mib(after),
        bpw(after, n)
    );
    if plan.n_fallback > 0 {
        let _ = writeln!(
            s,
            "  {} of {} tensors fell back to a type whose blocks fit their rows",
            plan.n_fallback,
            plan.tensors.len()
        );
    }
    s
}

fn dry_run_text(gguf: &Gguf, plan: &Plan) -> String {
    let width = plan.tensors.iter().map(|t| t.name.len()).max().unwrap_or(0);
    let total = plan.tensors.len();
    let mut s = String::new();
    for (i, t) in plan.tensors.iter().enumerate() {
        let shape = format!("{:?}", t.shape);
        let mut line = format!(
            "[{:>4}/{total:>4}] {:<width$}  {shape:<20} {:>6} -> {:<6}",
            i + 1,
            t.name,
            t.from.name(),
            t.to.name()
        );
        if let Some(f) = t.fallback_from {
            let _ = write!(
                line,
                "  (fallback: {} values per row do not fit {f} blocks)",
                t.shape[0]
            );
        }
        s.push_str(line.trim_end());
        s.push('\n');
    }
    let (before, after, n) = sizes(gguf, plan);
    let _ = writeln!(
        s,
        "{} as {}: {:.2} MiB ({:.2} bpw) -> {:.2} MiB ({:.2} bpw); {} fallbacks",
        total,
        plan.ftype,
        mib(before),
        bpw(before, n),
        mib(after),
        bpw(after, n),
        plan.n_fallback
    );
    s
}

/// The JSON form of `--dry-run`.
#[derive(Debug, Serialize)]
struct DryRun<'a> {
    input: String,
    ftype: &'static str,
    ftype_id: u32,
    pure: bool,
    n_fallback: usize,
    data_bytes_in: u64,
    data_bytes_out: u64,
    tensors: &'a [TensorPlan],
}

impl<'a> DryRun<'a> {
    fn new(gguf: &Gguf, plan: &'a Plan, args: &Args) -> Self {
        let (before, after, _) = sizes(gguf, plan);
        Self {
            input: args.input.display().to_string(),
            ftype: plan.ftype.name(),
            ftype_id: plan.ftype.id(),
            pure: args.pure,
            n_fallback: plan.n_fallback,
            data_bytes_in: before,
            data_bytes_out: after,
            tensors: &plan.tensors,
        }
    }
}
