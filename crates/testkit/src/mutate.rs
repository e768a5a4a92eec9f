//! Mutations of tiny models and the property every mutated model must keep: loading it and
//! running a short forward (a prefill of three tokens, then a one-token decode; for a drafter
//! its own passes on the target's features) either returns a clean error or runs with logits
//! that hold no NaN and no +∞ — never a panic. Shared by the property test
//! (`crates/models/tests/load_mutations.rs`) and the `model_load` fuzz target, which decode
//! a list of [`Mutation`]s from their own inputs.

use std::sync::Arc;

use specula_cpu::CpuBackend;
use specula_gguf::{Array, GgmlType, Gguf, Value};
use specula_models::dflash::Dflash;
use specula_models::eagle3::Eagle3;
use specula_models::{Model, Taps};
use specula_quant::QType;
use specula_tensor::Backend;

use crate::tiny::{self, Drafter, TinyGguf};

/// What a case builds: a target of one architecture, or a drafter for a (clean) qwen3 target.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Subject {
    /// A target of `tiny::ARCHS[i]`.
    Target(usize),
    /// A drafter (mutated) for a clean tiny qwen3 target.
    Drafter(Drafter),
}

impl Subject {
    /// Every subject: the eleven tiny targets and the three drafters.
    pub const ALL: [Self; 14] = [
        Self::Target(0),
        Self::Target(1),
        Self::Target(2),
        Self::Target(3),
        Self::Target(4),
        Self::Target(5),
        Self::Target(6),
        Self::Target(7),
        Self::Target(8),
        Self::Target(9),
        Self::Target(10),
        Self::Drafter(Drafter::Dflash),
        Self::Drafter(Drafter::Dflash2),
        Self::Drafter(Drafter::Eagle3),
    ];

    /// The unmutated file of the subject.
    #[must_use]
    pub fn seed(self) -> TinyGguf {
        match self {
            Self::Target(i) => tiny::target(tiny::ARCHS[i % tiny::ARCHS.len()]),
            Self::Drafter(Drafter::Dflash) => tiny::dflash(false),
            Self::Drafter(Drafter::Dflash2) => tiny::dflash(true),
            Self::Drafter(Drafter::Eagle3) => tiny::eagle3(),
        }
    }

    /// The key prefix of the subject's hyperparameters.
    fn prefix(self) -> &'static str {
        match self {
            Self::Target(i) => tiny::arch_of(tiny::ARCHS[i % tiny::ARCHS.len()]),
            Self::Drafter(Drafter::Dflash | Drafter::Dflash2) => "dflash",
            Self::Drafter(Drafter::Eagle3) => "eagle3",
        }
    }
}

/// Keys a mutation may set although the seed lacks them (under the subject's prefix).
pub const EXTRA_KEYS: &[&str] = &[
    "rope.dimension_count",
    "rope.scaling.factor",
    "rope.freq_base_swa",
    "rope.dimension_sections",
    "attention.sliding_window",
    "attention.sliding_window_pattern",
    "attention.scale",
    "attention.value_scale",
    "embedding_scale",
    "logit_scale",
    "final_logit_softcapping",
    "selector_top_k",
    "conv_kernel_size",
    "conv_group_size",
    "selector_rank",
    "norm_before_fc",
    "norm_before_residual",
];

/// Integer values a mutation writes.
pub const INTS: [i64; 12] = [0, 1, 2, 3, 7, 31, 33, 64, 65, 62, 1 << 40, -1];
/// Float values a mutation writes.
pub const FLOATS: [f32; 8] = [
    f32::NAN,
    f32::INFINITY,
    f32::NEG_INFINITY,
    0.0,
    -1.0,
    1e-45,
    0.5,
    3e38,
];
/// Tensor types a mutation gives a tensor.
pub const TYPES: [GgmlType; 12] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q8_0,
    GgmlType::Q4_0,
    GgmlType::Q4_K,
    GgmlType::Q6_K,
    GgmlType::IQ4_NL,
    GgmlType::MXFP4,
    GgmlType::Q8_1,
    GgmlType::Q8_K,
    GgmlType::I32,
];

/// One change to a model file. Indices pick among the file's keys (then [`EXTRA_KEYS`]) and
/// tensors modulo their count, so any index is valid.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mutation {
    /// Sets a key to `INTS[v]` (as U32, U64 or I32 by the value's size and sign).
    Int { key: usize, v: usize },
    /// Sets a key to `FLOATS[v]`.
    Float { key: usize, v: usize },
    /// Cuts an array value to `len` entries (a non-array value is replaced by an empty array).
    Shorten { key: usize, len: usize },
    /// Sets a key to a string.
    Retype { key: usize },
    /// Removes a key.
    Drop { key: usize },
    /// Swaps the first two dimensions of a tensor.
    SwapDims { tensor: usize },
    /// Sets dimension `dim` of a tensor to `INTS[v]` (clamped to be non-negative).
    SetDim { tensor: usize, dim: usize, v: usize },
    /// Adds a trailing dimension of 1 (or removes the last dimension if `remove`).
    Rank { tensor: usize, remove: bool },
    /// Removes a tensor.
    DropTensor { tensor: usize },
    /// Changes a tensor's type to `TYPES[ty]`.
    Type { tensor: usize, ty: usize },
}

fn key_name(g: &TinyGguf, subject: Subject, key: usize) -> String {
    let n = g.metadata.len() + EXTRA_KEYS.len();
    let i = key % n.max(1);
    match g.metadata.get(i) {
        Some((k, _)) => k.clone(),
        None => format!(
            "{}.{}",
            subject.prefix(),
            EXTRA_KEYS[(i - g.metadata.len()) % EXTRA_KEYS.len()]
        ),
    }
}

fn int_value(v: i64) -> Value {
    match (u32::try_from(v), u64::try_from(v)) {
        (Ok(x), _) => Value::U32(x),
        (_, Ok(x)) => Value::U64(x),
        _ => Value::I32(i32::try_from(v).unwrap_or(-1)),
    }
}

fn shorten(v: &Value, len: usize) -> Value {
    let cut = |n: usize| len.min(n.saturating_sub(1));
    Value::Array(match v {
        Value::Array(Array::U32(x)) => Array::U32(x[..cut(x.len())].to_vec()),
        Value::Array(Array::I32(x)) => Array::I32(x[..cut(x.len())].to_vec()),
        Value::Array(Array::F32(x)) => Array::F32(x[..cut(x.len())].to_vec()),
        Value::Array(Array::Bool(x)) => Array::Bool(x[..cut(x.len())].to_vec()),
        Value::Array(Array::String(x)) => Array::String(x[..cut(x.len())].to_vec()),
        _ => Array::U32(Vec::new()),
    })
}

impl Mutation {
    /// Applies the mutation to `g`, the file of `subject`.
    pub fn apply(self, subject: Subject, g: &mut TinyGguf) {
        let n_t = g.tensors.len().max(1);
        match self {
            Self::Int { key, v } => {
                let k = key_name(g, subject, key);
                g.set(&k, int_value(INTS[v % INTS.len()]));
            }
            Self::Float { key, v } => {
                let k = key_name(g, subject, key);
                g.set(&k, Value::F32(FLOATS[v % FLOATS.len()]));
            }
            Self::Shorten { key, len } => {
                let k = key_name(g, subject, key);
                let new = g
                    .get(&k)
                    .map_or(Value::Array(Array::U32(Vec::new())), |v| shorten(v, len));
                g.set(&k, new);
            }
            Self::Retype { key } => {
                let k = key_name(g, subject, key);
                g.set(&k, Value::String("x".into()));
            }
            Self::Drop { key } => {
                let k = key_name(g, subject, key);
                g.remove(&k);
            }
            Self::SwapDims { tensor } => {
                if let Some(t) = g.tensors.get_mut(tensor % n_t)
                    && t.dims.len() >= 2
                {
                    t.dims.swap(0, 1);
                }
            }
            Self::SetDim { tensor, dim, v } => {
                if let Some(t) = g.tensors.get_mut(tensor % n_t) {
                    let n = t.dims.len().max(1);
                    if let Some(d) = t.dims.get_mut(dim % n) {
                        *d = u64::try_from(INTS[v % INTS.len()]).unwrap_or(0);
                    }
                }
            }
            Self::Rank { tensor, remove } => {
                if let Some(t) = g.tensors.get_mut(tensor % n_t) {
                    if remove {
                        t.dims.pop();
                    } else {
                        t.dims.push(1);
                    }
                }
            }
            Self::DropTensor { tensor } => {
                if !g.tensors.is_empty() {
                    g.tensors.remove(tensor % n_t);
                }
            }
            Self::Type { tensor, ty } => {
                if let Some(t) = g.tensors.get_mut(tensor % n_t) {
                    t.ty = TYPES[ty % TYPES.len()];
                }
            }
        }
    }

    /// A mutation from a few bytes (the fuzz target's decoder): the first byte picks the
    /// kind, the next ones its indices.
    #[must_use]
    pub fn from_bytes(b: [u8; 4]) -> Self {
        let [kind, x, y, z] = b.map(usize::from);
        match kind % 10 {
            0 => Self::Int { key: x, v: y },
            1 => Self::Float { key: x, v: y },
            2 => Self::Shorten { key: x, len: y % 4 },
            3 => Self::Retype { key: x },
            4 => Self::Drop { key: x },
            5 => Self::SwapDims { tensor: x },
            6 => Self::SetDim {
                tensor: x,
                dim: y,
                v: z,
            },
            7 => Self::Rank {
                tensor: x,
                remove: y % 2 == 1,
            },
            8 => Self::DropTensor { tensor: x },
            _ => Self::Type { tensor: x, ty: y },
        }
    }
}

/// How a case ended when it kept the property.
#[derive(Debug)]
pub enum Outcome {
    /// The writer could not hold the mutated file (not a model file at all).
    Unwritable,
    /// Loading or running returned this error.
    Refused(String),
    /// It ran, with logits free of NaN and +∞.
    Ran,
}

/// The KV cache formats a case runs with (`cache % 4`): F16, Q8_0, Q4_0, turbo3.
const CACHES: [QType; 4] = [QType::F16, QType::Q8_0, QType::Q4_0, QType::Turbo3];

/// Context of the caches of a run.
const N_CTX: usize = 16;

/// Checks `rows` rows of `logits`: no NaN, no +∞, and a finite value in every row (−∞ marks
/// tokens outside a drafter's reduced vocabulary).
fn check_logits(what: &str, logits: &[f32], rows: usize) -> Result<(), String> {
    if rows == 0 || logits.is_empty() || !logits.len().is_multiple_of(rows) {
        return Err(format!("{what}: {} logits for {rows} rows", logits.len()));
    }
    for (r, row) in logits.chunks_exact(logits.len() / rows).enumerate() {
        if let Some(x) = row.iter().find(|x| x.is_nan() || **x == f32::INFINITY) {
            return Err(format!("{what}: row {r} holds {x}"));
        }
        if !row.iter().any(|x| x.is_finite()) {
            return Err(format!("{what}: row {r} has no finite logit"));
        }
    }
    Ok(())
}

/// Loads `subject` with `mutations` applied and runs it: `Ok` when the property holds (see
/// [`Outcome`]), `Err` naming the violation (a NaN or +∞ logit, logits of the wrong size). A
/// panic is left to the caller to catch (the property test) or report (libFuzzer).
///
/// # Errors
/// A violation of the property, described.
pub fn check(subject: Subject, mutations: &[Mutation], cache: usize) -> Result<Outcome, String> {
    let mut g = subject.seed();
    for m in mutations {
        m.apply(subject, &mut g);
    }
    let Some(bytes) = g.to_bytes() else {
        return Ok(Outcome::Unwritable);
    };
    let Ok(file) = Gguf::from_bytes(bytes) else {
        return Ok(Outcome::Unwritable);
    };
    let be = CpuBackend::new(1);
    let kv_type = CACHES[cache % CACHES.len()];
    let run = || -> Result<Result<(), String>, Box<dyn std::error::Error>> {
        match subject {
            Subject::Target(_) => run_target(&be, Arc::new(file), kv_type),
            Subject::Drafter(d) => {
                let target = tiny::target("qwen3").to_bytes().ok_or("the clean target")?;
                let target = Model::load(&be, Arc::new(Gguf::from_bytes(target)?))?;
                run_drafter(&be, &target, d, Arc::new(file), kv_type)
            }
        }
    };
    match run() {
        Ok(Ok(())) => Ok(Outcome::Ran),
        Ok(Err(violation)) => Err(violation),
        Err(e) => Ok(Outcome::Refused(e.to_string())),
    }
}

type RunResult = Result<Result<(), String>, Box<dyn std::error::Error>>;

/// Prefill of three tokens (logits of every row), then a one-token decode.
fn run_target(be: &CpuBackend, file: Arc<Gguf>, kv_type: QType) -> RunResult {
    let model = Model::load(be, file)?;
    let n_vocab = u32::try_from(model.hparams().n_vocab).unwrap_or(u32::MAX);
    let mut kv = model.new_kv(be, N_CTX, kv_type, kv_type)?;
    let mut s = model.scratch(be);
    let toks: Vec<u32> = [1, 5, 9].iter().map(|t| t % n_vocab).collect();
    let logits = model.forward(be, &mut kv, &mut s, &toks, &[0, 1, 2], &[0, 1, 2], None)?;
    if let Err(v) = check_logits("prefill", logits, 3) {
        return Ok(Err(v));
    }
    let logits = model.forward(be, &mut kv, &mut s, &[7 % n_vocab], &[3], &[0], None)?;
    Ok(check_logits("decode", logits, 1))
}

/// The target's taps side by side, one row per token.
fn features(taps: &Taps, n: usize) -> Vec<f32> {
    let mut out = Vec::new();
    for r in 0..n {
        for rows in &taps.rows {
            let w = rows.len() / n.max(1);
            out.extend_from_slice(&rows[r * w..(r + 1) * w]);
        }
    }
    out
}

/// The drafter's passes on the target's features of a three-token prompt.
fn run_drafter(
    be: &CpuBackend,
    target: &Model<CpuBackend>,
    d: Drafter,
    file: Arc<Gguf>,
    kv_type: QType,
) -> RunResult {
    let mut tkv = target.new_kv(be, N_CTX, QType::F16, QType::F16)?;
    let mut ts = target.scratch(be);
    let prompt = [1u32, 5, 9];
    match d {
        Drafter::Dflash | Drafter::Dflash2 => {
            let net = Dflash::load(be, file, target)?;
            let mut taps = Taps {
                layers: net.hparams().target_layers.clone(),
                rows: Vec::new(),
            };
            target.forward(
                be,
                &mut tkv,
                &mut ts,
                &prompt,
                &[0, 1, 2],
                &[],
                Some(&mut taps),
            )?;
            let mut kv = be.kv_new(net.kv_shape(N_CTX, kv_type, kv_type))?;
            let mut s = net.scratch(be);
            net.inject(be, &mut kv, N_CTX, &mut s, &features(&taps, 3), &[0, 1, 2])?;
            let mask = net.hparams().mask_token_id;
            let logits = net.block(be, &mut kv, N_CTX, &mut s, &[9, mask, mask], 3, &[1, 2])?;
            if let Err(v) = check_logits("DFlash block", logits, 2) {
                return Ok(Err(v));
            }
            let drafts = net.select(be, &mut s, 9, 0.0);
            if let Some(t) = drafts.iter().find(|&&t| t as usize >= net.n_vocab()) {
                return Ok(Err(format!(
                    "DFlash2 selected token {t} past the vocabulary"
                )));
            }
            Ok(Ok(()))
        }
        Drafter::Eagle3 => {
            let net = Eagle3::load(be, file, target)?;
            let mut taps = Taps {
                layers: net.hparams().target_layers.clone(),
                rows: Vec::new(),
            };
            target.forward(
                be,
                &mut tkv,
                &mut ts,
                &prompt,
                &[0, 1, 2],
                &[],
                Some(&mut taps),
            )?;
            let mut kv = be.kv_new(net.kv_shape(N_CTX, kv_type, kv_type))?;
            let mut s = net.scratch(be);
            let mut g = Vec::new();
            net.encode(be, &mut s, &features(&taps, 3), &mut g)?;
            // Pairs (token[P + 1], g[P]) for the prompt, then one chain step.
            let e = net.hparams().n_embd;
            let g2 = &g[..(2 * e).min(g.len())];
            net.decode(be, &mut kv, N_CTX, &mut s, &[5, 9], g2, &[0, 1], true)?;
            if let Err(v) = check_logits("EAGLE-3 prompt", &s.logits_host, 2) {
                return Ok(Err(v));
            }
            let last: Vec<f32> = s.prenorm[s.prenorm.len() - e.min(s.prenorm.len())..].to_vec();
            net.decode(be, &mut kv, N_CTX, &mut s, &[9], &last, &[2], true)?;
            Ok(check_logits("EAGLE-3 chain", &s.logits_host, 1))
        }
    }
}
