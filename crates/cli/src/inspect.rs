//! `specula inspect`: a gguf-dump-like summary of a GGUF file, as text or JSON.
//!
//! Only the header is parsed (the file is memory-mapped), so inspecting a 1 GB model takes
//! milliseconds. The JSON form lists every metadata key with its type, every tensor with its
//! type, shape, offset and size, and totals with bits per weight.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use anyhow::{Context, Result};
use serde::Serialize;
use serde_json::Value as Json;
use specula_gguf::{Array, Gguf, Value};

/// Arguments of `specula inspect`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// A GGUF file, or the name of a model from the manifest (`smollm2-135m`, …), fetched and
    /// verified on first use. Default: the default model.
    pub file: Option<String>,
    /// Print one JSON object instead of tables.
    #[arg(long)]
    pub json: bool,
    /// Leave the tensor table out of the text output.
    #[arg(long)]
    pub no_tensors: bool,
}

/// Everything `inspect` reports about a file.
#[derive(Debug, Serialize)]
pub struct Report {
    pub file: String,
    pub file_size: u64,
    pub version: u32,
    pub alignment: u64,
    pub data_offset: u64,
    pub architecture: Option<String>,
    pub name: Option<String>,
    /// `<arch>.*` keys without the prefix.
    pub hyperparameters: BTreeMap<String, Json>,
    pub tokenizer: Option<TokenizerSummary>,
    pub metadata: Vec<MetadataEntry>,
    pub tensors: Vec<TensorEntry>,
    pub totals: Totals,
    /// Tensor count and bytes per ggml type, by type name.
    pub types: BTreeMap<String, TypeTotals>,
}

#[derive(Debug, Serialize)]
pub struct TokenizerSummary {
    pub model: Option<String>,
    pub pre: Option<String>,
    pub n_tokens: Option<usize>,
    pub n_merges: Option<usize>,
    pub bos: Option<SpecialToken>,
    pub eos: Option<SpecialToken>,
    pub eot: Option<SpecialToken>,
    pub pad: Option<SpecialToken>,
    pub unk: Option<SpecialToken>,
    pub add_bos_token: Option<bool>,
    pub add_eos_token: Option<bool>,
    pub chat_template_bytes: Option<usize>,
}

#[derive(Debug, Serialize)]
pub struct SpecialToken {
    pub id: u64,
    pub text: Option<String>,
}

#[derive(Debug, Serialize)]
pub struct MetadataEntry {
    pub key: String,
    #[serde(rename = "type")]
    pub ty: &'static str,
    /// Scalars in full; for arrays `{elem_type, len, head}`.
    pub value: Json,
}

#[derive(Debug, Serialize)]
pub struct TensorEntry {
    pub name: String,
    #[serde(rename = "type")]
    pub ty: &'static str,
    /// ggml order: `shape[0]` is the row length.
    pub shape: Vec<u64>,
    pub offset: u64,
    pub bytes: u64,
}

#[derive(Debug, Serialize)]
pub struct Totals {
    pub n_tensors: usize,
    pub n_elements: u64,
    pub bytes: u64,
    pub bits_per_weight: f64,
}

#[derive(Debug, Default, Serialize)]
pub struct TypeTotals {
    pub n_tensors: usize,
    pub n_elements: u64,
    pub bytes: u64,
}

/// Runs `specula inspect` and returns what it prints.
pub fn run(args: &Args) -> Result<String> {
    let path = crate::load::model_path(args.file.as_deref())?;
    let file = Gguf::open(&path).with_context(|| format!("cannot inspect {}", path.display()))?;
    let report = build(&file, &path);
    if args.json {
        let mut s = serde_json::to_string_pretty(&report)?;
        s.push('\n');
        Ok(s)
    } else {
        Ok(render_text(&report, !args.no_tensors))
    }
}

/// Builds the report of an open file.
pub fn build(file: &Gguf, path: &Path) -> Report {
    let h = file.header();
    let md = file.metadata();
    let arch = h.architecture().map(str::to_owned);
    let hyperparameters = arch
        .as_deref()
        .map(|a| {
            let prefix = format!("{a}.");
            md.iter()
                .filter_map(|(k, v)| Some((k.strip_prefix(&prefix)?.to_owned(), value_json(v))))
                .collect()
        })
        .unwrap_or_default();

    let mut types: BTreeMap<String, TypeTotals> = BTreeMap::new();
    let mut totals = Totals {
        n_tensors: file.tensors().len(),
        n_elements: 0,
        bytes: 0,
        bits_per_weight: 0.0,
    };
    let tensors = file
        .tensors()
        .iter()
        .map(|t| {
            totals.n_elements += t.n_elements();
            totals.bytes += t.n_bytes();
            let e = types.entry(t.ty.name().to_owned()).or_default();
            e.n_tensors += 1;
            e.n_elements += t.n_elements();
            e.bytes += t.n_bytes();
            TensorEntry {
                name: t.name.clone(),
                ty: t.ty.name(),
                shape: t.dims.clone(),
                offset: t.offset,
                bytes: t.n_bytes(),
            }
        })
        .collect();
    if totals.n_elements > 0 {
        totals.bits_per_weight = ratio(8 * totals.bytes, totals.n_elements);
    }

    Report {
        file: path.display().to_string(),
        file_size: file.len(),
        version: h.version,
        alignment: h.alignment,
        data_offset: h.data_offset,
        architecture: arch,
        name: md.get_str("general.name").map(str::to_owned),
        hyperparameters,
        tokenizer: tokenizer_summary(file),
        metadata: md
            .iter()
            .map(|(k, v)| MetadataEntry {
                key: k.to_owned(),
                ty: v.value_type().name(),
                value: value_json(v),
            })
            .collect(),
        tensors,
        totals,
        types,
    }
}

#[allow(
    clippy::cast_precision_loss,
    reason = "a display ratio; 53 bits of mantissa are plenty"
)]
fn ratio(a: u64, b: u64) -> f64 {
    a as f64 / b as f64
}

fn tokenizer_summary(file: &Gguf) -> Option<TokenizerSummary> {
    let md = file.metadata();
    if !md.iter().any(|(k, _)| k.starts_with("tokenizer.")) {
        return None;
    }
    let tokens = md
        .get_array("tokenizer.ggml.tokens")
        .and_then(Array::as_strings);
    let special = |key: &str| {
        let id = md.get_u64(&format!("tokenizer.ggml.{key}_token_id"))?;
        let text = usize::try_from(id)
            .ok()
            .and_then(|i| tokens?.get(i).cloned());
        Some(SpecialToken { id, text })
    };
    Some(TokenizerSummary {
        model: md.get_str("tokenizer.ggml.model").map(str::to_owned),
        pre: md.get_str("tokenizer.ggml.pre").map(str::to_owned),
        n_tokens: tokens.map(<[String]>::len),
        n_merges: md.get_array("tokenizer.ggml.merges").map(Array::len),
        bos: special("bos"),
        eos: special("eos"),
        eot: special("eot"),
        pad: special("padding"),
        unk: special("unknown"),
        add_bos_token: md
            .get("tokenizer.ggml.add_bos_token")
            .and_then(Value::as_bool),
        add_eos_token: md
            .get("tokenizer.ggml.add_eos_token")
            .and_then(Value::as_bool),
        chat_template_bytes: md.get_str("tokenizer.chat_template").map(str::len),
    })
}

/// JSON for a metadata value: scalars in full, arrays as their element type, length and the
/// first elements.
fn value_json(v: &Value) -> Json {
    match v {
        Value::U8(x) => Json::from(*x),
        Value::I8(x) => Json::from(*x),
        Value::U16(x) => Json::from(*x),
        Value::I16(x) => Json::from(*x),
        Value::U32(x) => Json::from(*x),
        Value::I32(x) => Json::from(*x),
        Value::U64(x) => Json::from(*x),
        Value::I64(x) => Json::from(*x),
        Value::F32(x) => Json::from(f64::from(*x)),
        Value::F64(x) => Json::from(*x),
        Value::Bool(x) => Json::from(*x),
        Value::String(s) => Json::from(s.as_str()),
        Value::Array(a) => array_json(a),
    }
}

fn array_json(a: &Array) -> Json {
    const HEAD: usize = 8;
    fn head<T: Clone + Into<Json>>(v: &[T]) -> Json {
        Json::Array(v.iter().take(HEAD).cloned().map(Into::into).collect())
    }
    let head = match a {
        Array::U8(v) => head(v),
        Array::I8(v) => head(v),
        Array::U16(v) => head(v),
        Array::I16(v) => head(v),
        Array::U32(v) => head(v),
        Array::I32(v) => head(v),
        Array::U64(v) => head(v),
        Array::I64(v) => head(v),
        Array::F32(v) => head(v),
        Array::F64(v) => head(v),
        Array::Bool(v) => head(v),
        Array::String(v) => head(v),
        Array::Array(v) => Json::Array(v.iter().take(HEAD).map(array_json).collect()),
    };
    serde_json::json!({
        "elem_type": a.element_type().name(),
        "len": a.len(),
        "head": head,
    })
}

fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 4] = ["B", "KiB", "MiB", "GiB"];
    let mut v = ratio(n, 1);
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.2} {}", UNITS[u])
    }
}

fn human_count(n: u64) -> String {
    let v = ratio(n, 1);
    if v >= 1e9 {
        format!("{:.2} B", v / 1e9)
    } else if v >= 1e6 {
        format!("{:.2} M", v / 1e6)
    } else if v >= 1e3 {
        format!("{:.2} K", v / 1e3)
    } else {
        n.to_string()
    }
}

/// The text form: summary, metadata (arrays abbreviated), tensor table, totals per type.
fn render_text(r: &Report, with_tensors: bool) -> String {
    let mut s = String::new();
    let arch = r.architecture.as_deref().unwrap_or("(none)");
    let _ = writeln!(s, "file          {}", r.file);
    let _ = writeln!(
        s,
        "format        GGUF v{}, {} ({}), alignment {}, data at offset {}",
        r.version,
        human_bytes(r.file_size),
        r.file_size,
        r.alignment,
        r.data_offset
    );
    let _ = writeln!(s, "architecture  {arch}");
    if let Some(name) = &r.name {
        let _ = writeln!(s, "name          {name}");
    }
    let _ = writeln!(
        s,
        "parameters    {} in {} tensors, {} of weights, {:.4} bits per weight",
        human_count(r.totals.n_elements),
        r.totals.n_tensors,
        human_bytes(r.totals.bytes),
        r.totals.bits_per_weight
    );
    if let Some(t) = &r.tokenizer {
        let tok = |t: &Option<SpecialToken>| {
            t.as_ref().map_or_else(
                || "-".to_owned(),
                |t| format!("{} {:?}", t.id, t.text.as_deref().unwrap_or("?")),
            )
        };
        let _ = writeln!(
            s,
            "tokenizer     {} (pre {}), {} tokens, {} merges; bos {}, eos {}, add_bos {}; chat template {}",
            t.model.as_deref().unwrap_or("?"),
            t.pre.as_deref().unwrap_or("-"),
            t.n_tokens.map_or_else(|| "?".to_owned(), |n| n.to_string()),
            t.n_merges.map_or_else(|| "0".to_owned(), |n| n.to_string()),
            tok(&t.bos),
            tok(&t.eos),
            t.add_bos_token
                .map_or_else(|| "-".to_owned(), |b| b.to_string()),
            t.chat_template_bytes
                .map_or_else(|| "none".to_owned(), |n| format!("{n} bytes")),
        );
    }

    let _ = writeln!(s, "\nmetadata ({} keys)", r.metadata.len());
    let width = r.metadata.iter().map(|m| m.key.len()).max().unwrap_or(0);
    for m in &r.metadata {
        let shown = match &m.value {
            Json::Object(o) => format!(
                "[{}; {}] {}",
                o["elem_type"].as_str().unwrap_or("?"),
                o["len"],
                abbreviate(&o["head"].to_string(), 70)
            ),
            v => abbreviate(&v.to_string(), 90),
        };
        let _ = writeln!(s, "  {:<width$}  {:<7}  {shown}", m.key, m.ty);
    }

    if with_tensors {
        let _ = writeln!(s, "\ntensors ({})", r.tensors.len());
        let width = r.tensors.iter().map(|t| t.name.len()).max().unwrap_or(0);
        for t in &r.tensors {
            let shape: Vec<String> = t.shape.iter().map(u64::to_string).collect();
            let _ = writeln!(
                s,
                "  {:<width$}  {:<7}  {:<22}  {:>12}",
                t.name,
                t.ty,
                shape.join(" x "),
                human_bytes(t.bytes)
            );
        }
    }

    let _ = writeln!(s, "\nby type");
    for (ty, t) in &r.types {
        let _ = writeln!(
            s,
            "  {:<7}  {:>4} tensors  {:>10} values  {:>12}",
            ty,
            t.n_tensors,
            human_count(t.n_elements),
            human_bytes(t.bytes)
        );
    }
    s
}

fn abbreviate(s: &str, max: usize) -> String {
    let s = s.replace('\n', "\\n");
    match s.char_indices().nth(max) {
        Some((cut, _)) => format!("{}…", &s[..cut]),
        None => s,
    }
}
