//! Writing a trained drafter as a GGUF that specula and llama.cpp load (`general.architecture
//! = dflash`, the keys and tensor names of llama.cpp's converter; embedding and, for the whole
//! vocabulary, the head borrowed from the target). [`write_eagle3`] writes an EAGLE-3 head
//! (`general.architecture = eagle3`): the embedding borrowed, its own trained head.
//!
//! Matrices are written in F16, Q8_0 or NVFP4; norms stay F32. NVFP4 matrices carry the
//! per-tensor FP32 scale `<name>.scale` (the matrix is divided by it before quantization, so
//! the largest block scale lands near the top of UE4M3's range). A reduced vocabulary adds
//! `d2t` (I64, absolute target ids) and its own `output.weight`: the target's head rows of
//! those ids, in the matrices' type.

use std::path::Path;

use specula_gguf::{Array, GgmlType, GgufWriter, Value};
use specula_quant::QType;

use crate::eagle3::Eagle3Shape;
use crate::net::DraftShape;
use crate::target::Target;
use crate::vocab::DraftVocab;
use crate::{Result, TrainError};

/// The type of the exported matrices.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExportType {
    /// IEEE half.
    F16,
    /// 8-bit blocks of 32.
    Q8_0,
    /// NVFP4 with per-tensor scales.
    Nvfp4,
}

impl ExportType {
    /// Parses `f16`, `q8_0` or `nvfp4` (any case).
    ///
    /// # Errors
    /// Another name.
    pub fn parse(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "f16" => Ok(Self::F16),
            "q8_0" => Ok(Self::Q8_0),
            "nvfp4" => Ok(Self::Nvfp4),
            other => Err(TrainError::Config(format!(
                "export type `{other}`: use f16, q8_0 or nvfp4"
            ))),
        }
    }

    fn ggml(self) -> GgmlType {
        match self {
            Self::F16 => GgmlType::F16,
            Self::Q8_0 => GgmlType::Q8_0,
            Self::Nvfp4 => GgmlType::NVFP4,
        }
    }
}

/// One tensor to write.
struct Out {
    name: String,
    ty: GgmlType,
    dims: Vec<u64>,
    bytes: Vec<u8>,
}

fn u64s(d: &[usize]) -> Vec<u64> {
    d.iter().map(|&x| x as u64).collect()
}

/// `values` (`rows × ne0`) in `ty`, falling back to F16 when rows do not fill its blocks;
/// NVFP4 also yields the per-tensor scale.
fn encode(values: &[f32], ne0: usize, ty: ExportType) -> Result<(GgmlType, Vec<u8>, Option<f32>)> {
    let mut g = ty.ggml();
    if g.row_bytes(ne0 as u64).is_none() {
        g = GgmlType::F16;
    }
    let q = QType::from_ggml_id(g.id())
        .ok_or_else(|| TrainError::Config(format!("no quantizer for {}", g.name())))?;
    let mut scale = None;
    let scaled: Vec<f32>;
    let src = if g == GgmlType::NVFP4 {
        let amax = values.iter().fold(0f32, |m, v| m.max(v.abs()));
        let s = if amax > 0.0 {
            amax / (6.0 * 448.0)
        } else {
            1.0
        };
        scale = Some(s);
        scaled = values.iter().map(|v| v / s).collect();
        &scaled
    } else {
        values
    };
    let rb = q
        .row_bytes(ne0)
        .map_err(|e| TrainError::Config(format!("{}: {e}", g.name())))?;
    let rows = values.len() / ne0;
    let mut out = vec![0u8; rb * rows];
    for (s, d) in src.chunks_exact(ne0).zip(out.chunks_exact_mut(rb)) {
        specula_quant::quantize_row(q, s, d)
            .map_err(|e| TrainError::Config(format!("{}: {e}", g.name())))?;
    }
    Ok((g, out, scale))
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Writes the drafter to `path` atomically.
///
/// # Errors
/// A tensor that cannot be encoded, or the file cannot be written.
pub fn write_dflash(
    path: &Path,
    shape: &DraftShape,
    params: &[Vec<f32>],
    vocab: &DraftVocab,
    target: &Target,
    ty: ExportType,
    name: &str,
) -> Result<()> {
    let mut outs = params_out(&shape.params(), params, ty)?;
    if !vocab.is_full() {
        let ids = vocab.ids();
        let head = target.head_rows(&ids);
        push_matrix(
            &mut outs,
            "output.weight",
            &[shape.n_embd, ids.len()],
            &head,
            ty,
        )?;
        outs.push(d2t_out(&ids));
    }

    let k = |s: &str| format!("dflash.{s}");
    let u = |v: usize| Value::U32(u32::try_from(v).unwrap_or(u32::MAX));
    let taps: Vec<i32> = shape
        .taps
        .iter()
        .map(|&t| i32::try_from(t).unwrap_or(i32::MAX))
        .collect();
    let kv: Vec<(String, Value)> = vec![
        (
            "general.architecture".into(),
            Value::String("dflash".into()),
        ),
        ("general.name".into(), Value::String(name.to_owned())),
        (k("block_count"), u(shape.n_layer)),
        (k("context_length"), u(target.hp.n_ctx_train)),
        (k("embedding_length"), u(shape.n_embd)),
        (k("feed_forward_length"), u(shape.n_ff)),
        (k("attention.head_count"), u(shape.n_head)),
        (k("attention.head_count_kv"), u(shape.n_head_kv)),
        (k("attention.key_length"), u(shape.head_dim)),
        (k("attention.value_length"), u(shape.head_dim)),
        (k("rope.freq_base"), Value::F32(shape.rope_base)),
        (
            k("attention.layer_norm_rms_epsilon"),
            Value::F32(shape.rms_eps),
        ),
        (k("target_layers"), Value::Array(Array::I32(taps))),
        (k("block_size"), u(shape.block)),
        (
            "tokenizer.ggml.mask_token_id".into(),
            Value::U32(shape.mask),
        ),
    ];
    write_gguf(path, with_tokenizer(kv, target), &outs)
}

/// Every parameter of `spec`: matrices in `ty` (NVFP4 with their `.scale`), norms F32.
fn params_out(
    spec: &[(String, Vec<usize>)],
    params: &[Vec<f32>],
    ty: ExportType,
) -> Result<Vec<Out>> {
    let mut outs = Vec::with_capacity(spec.len());
    for ((name, dims), v) in spec.iter().zip(params) {
        if dims.len() == 2 {
            push_matrix(&mut outs, name, dims, v, ty)?;
        } else {
            outs.push(Out {
                name: name.clone(),
                ty: GgmlType::F32,
                dims: u64s(dims),
                bytes: f32_bytes(v),
            });
        }
    }
    Ok(outs)
}

/// `d2t`: the draft vocabulary's target ids as I64 (llama.cpp's converter's absolute ids).
fn d2t_out(ids: &[u32]) -> Out {
    Out {
        name: "d2t".into(),
        ty: GgmlType::I64,
        dims: vec![ids.len() as u64],
        bytes: ids
            .iter()
            .flat_map(|&t| i64::from(t).to_le_bytes())
            .collect(),
    }
}

/// Writes the metadata `kv` and the tensors `outs` to `path` atomically.
fn write_gguf(path: &Path, kv: Vec<(String, Value)>, outs: &[Out]) -> Result<()> {
    let cfg_err =
        |e: specula_gguf::GgufError| TrainError::Config(format!("{}: {e}", path.display()));
    let mut w = GgufWriter::new();
    for (key, v) in kv {
        w.add(key, v).map_err(cfg_err)?;
    }
    for o in outs {
        w.add_tensor(o.name.clone(), o.ty, &o.dims)
            .map_err(cfg_err)?;
    }
    w.write_file(path, |i, _, sink| sink.write_all(&outs[i].bytes))
        .map_err(cfg_err)?;
    Ok(())
}

/// A matrix `[ne0, ne1]` in `ty` (and, for NVFP4, its `.scale`) appended to `outs`.
fn push_matrix(
    outs: &mut Vec<Out>,
    name: &str,
    dims: &[usize],
    v: &[f32],
    ty: ExportType,
) -> Result<()> {
    let (g, bytes, scale) = encode(v, dims[0], ty)?;
    outs.push(Out {
        name: name.to_owned(),
        ty: g,
        dims: u64s(dims),
        bytes,
    });
    if let Some(s) = scale {
        let base = name.strip_suffix(".weight").unwrap_or(name);
        outs.push(Out {
            name: format!("{base}.scale"),
            ty: GgmlType::F32,
            dims: vec![1],
            bytes: f32_bytes(&[s]),
        });
    }
    Ok(())
}

/// Writes an EAGLE-3 head to `path` atomically: `general.architecture = eagle3`, the keys
/// `specula-models`' `Eagle3` and llama.cpp's `eagle3` loader read (`eagle3.target_layers`,
/// also as the older `eagle3.extract_layers`; `eagle3.target_hidden_size`; one block), the
/// parameters of [`Eagle3Shape::params`] (matrices in `ty`, norms F32; the head
/// `output.weight` over the draft vocabulary), and, for a reduced vocabulary, `d2t` (I64,
/// absolute target ids). The token embedding is the target's and is not written.
///
/// # Errors
/// Parameters that are not the shape's, a tensor that cannot be encoded, or the file cannot
/// be written.
pub fn write_eagle3(
    path: &Path,
    shape: &Eagle3Shape,
    params: &[Vec<f32>],
    vocab: &DraftVocab,
    target: &Target,
    ty: ExportType,
    name: &str,
) -> Result<()> {
    let spec = shape.params();
    if params.len() != spec.len()
        || spec
            .iter()
            .zip(params)
            .any(|((_, d), v)| d.iter().product::<usize>() != v.len())
        || vocab.len() != shape.n_vocab_draft
    {
        return Err(TrainError::Config(format!(
            "{}: the parameters or the vocabulary are not those of the head's shape",
            path.display()
        )));
    }
    let mut outs = params_out(&spec, params, ty)?;
    if !vocab.is_full() {
        outs.push(d2t_out(&vocab.ids()));
    }

    let k = |s: &str| format!("eagle3.{s}");
    let u = |v: usize| Value::U32(u32::try_from(v).unwrap_or(u32::MAX));
    let taps: Vec<i32> = shape
        .taps
        .iter()
        .map(|&t| i32::try_from(t).unwrap_or(i32::MAX))
        .collect();
    let kv: Vec<(String, Value)> = vec![
        (
            "general.architecture".into(),
            Value::String("eagle3".into()),
        ),
        ("general.name".into(), Value::String(name.to_owned())),
        (k("block_count"), u(1)),
        (k("context_length"), u(target.hp.n_ctx_train)),
        (k("embedding_length"), u(shape.n_embd)),
        (k("feed_forward_length"), u(shape.n_ff)),
        (k("attention.head_count"), u(shape.n_head)),
        (k("attention.head_count_kv"), u(shape.n_head_kv)),
        (k("attention.key_length"), u(shape.head_dim)),
        (k("attention.value_length"), u(shape.head_dim)),
        (k("rope.dimension_count"), u(shape.head_dim)),
        (k("rope.freq_base"), Value::F32(shape.rope_base)),
        (
            k("attention.layer_norm_rms_epsilon"),
            Value::F32(shape.rms_eps),
        ),
        (k("target_layers"), Value::Array(Array::I32(taps.clone()))),
        (k("extract_layers"), Value::Array(Array::I32(taps))),
        (k("target_hidden_size"), u(shape.n_embd_target)),
    ];
    write_gguf(path, with_tokenizer(kv, target), &outs)
}

/// `kv` followed by the target's tokenizer metadata (llama.cpp reads a drafter's vocabulary
/// from the drafter's own file).
fn with_tokenizer(mut kv: Vec<(String, Value)>, target: &Target) -> Vec<(String, Value)> {
    kv.extend(target.tokenizer.iter().cloned());
    kv
}
