//! The frozen pieces of the target a DFlash drafter borrows: its token embedding, its output
//! head (the embedding when tied) and the attention hyperparameters the drafter copies.

use std::path::Path;
use std::sync::Arc;

use specula_gguf::Gguf;
use specula_models::Hparams;
use specula_quant::QType;

use crate::{Result, TrainError};

/// The target, as far as training needs it.
#[derive(Debug)]
pub struct Target {
    /// The target's hyperparameters.
    pub hp: Hparams,
    /// sha256 of the GGUF file.
    pub sha256: String,
    /// `[n_vocab][n_embd]` embedding rows, dequantized.
    pub embd: Arc<Vec<f32>>,
    /// The output head, `[n_vocab][n_embd]`, when it is not the embedding.
    head: Option<Vec<f32>>,
    /// `tokenizer.ggml.padding_token_id`, else `tokenizer.ggml.eos_token_id`.
    pub default_mask: Option<u32>,
    /// The target's final norm weight (a drafter's own final norm starts from it, so the
    /// borrowed head sees hidden states of the scale it was trained on).
    pub output_norm: Option<Vec<f32>>,
    /// The target's `tokenizer.*` metadata but the MASK id, copied into exported drafters:
    /// llama.cpp loads a drafter's vocabulary from its own file (its converter copies the
    /// target's tokenizer into DFlash and EAGLE-3 drafters) and refuses one without it.
    pub tokenizer: Vec<(String, specula_gguf::Value)>,
}

fn bad(detail: impl Into<String>) -> TrainError {
    TrainError::Target(detail.into())
}

/// Dequantizes a 2-D tensor `[ne1][ne0]` to f32 rows.
fn dequant(file: &Gguf, name: &str, n_embd: usize) -> Result<Option<Vec<f32>>> {
    let Some(info) = file.tensor(name) else {
        return Ok(None);
    };
    if info.dims.len() != 2 || usize::try_from(info.dims[0]).ok() != Some(n_embd) {
        return Err(bad(format!(
            "{name} has dims {:?}, want [{n_embd}, n_vocab]",
            info.dims
        )));
    }
    let ty = QType::from_ggml_id(info.ty.id())
        .ok_or_else(|| bad(format!("{name}: type {} cannot be read", info.ty.name())))?;
    let rows = usize::try_from(info.dims[1]).map_err(|_| bad(format!("{name}: too many rows")))?;
    let data = file.tensor_data_by_name(name).unwrap_or(&[]);
    let row_bytes = ty
        .row_bytes(n_embd)
        .map_err(|e| bad(format!("{name}: {e}")))?;
    if data.len() != row_bytes * rows {
        return Err(bad(format!("{name}: {} data bytes", data.len())));
    }
    let mut out = vec![0f32; rows * n_embd];
    for (src, dst) in data
        .chunks_exact(row_bytes)
        .zip(out.chunks_exact_mut(n_embd))
    {
        specula_quant::dequantize_row(ty, src, dst).map_err(|e| bad(format!("{name}: {e}")))?;
    }
    Ok(Some(out))
}

impl Target {
    /// Loads the target's embedding, head and hyperparameters from `path`.
    ///
    /// # Errors
    /// The file is not a GGUF model specula reads, or its embedding/head cannot be dequantized.
    pub fn load(path: &Path) -> Result<Self> {
        let sha256 = crate::sha256_file(path)?;
        let file = Gguf::open(path).map_err(|e| bad(format!("{}: {e}", path.display())))?;
        let embd_info = file
            .tensor("token_embd.weight")
            .ok_or_else(|| bad("no token_embd.weight"))?;
        let n_vocab = usize::try_from(embd_info.dims.get(1).copied().unwrap_or(0))
            .map_err(|_| bad("vocabulary too large"))?;
        let hp = Hparams::from_metadata(file.metadata(), n_vocab)
            .map_err(|e| bad(format!("{}: {e}", path.display())))?;
        let embd = dequant(&file, "token_embd.weight", hp.n_embd)?
            .ok_or_else(|| bad("no token_embd.weight"))?;
        let head = dequant(&file, "output.weight", hp.n_embd)?;
        let output_norm = match file.tensor("output_norm.weight") {
            Some(info)
                if info.ty == specula_gguf::GgmlType::F32 && info.dims == [hp.n_embd as u64] =>
            {
                file.tensor_data_by_name("output_norm.weight").map(|b| {
                    b.chunks_exact(4)
                        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                        .collect()
                })
            }
            _ => None,
        };
        let md = file.metadata();
        let id = |k: &str| md.get_u64(k).and_then(|v| u32::try_from(v).ok());
        let default_mask = id("tokenizer.ggml.padding_token_id")
            .or_else(|| id("tokenizer.ggml.eos_token_id"))
            .filter(|&t| (t as usize) < n_vocab);
        let tokenizer = md
            .iter()
            .filter(|(k, _)| k.starts_with("tokenizer.") && *k != "tokenizer.ggml.mask_token_id")
            .map(|(k, v)| (k.to_owned(), v.clone()))
            .collect();
        Ok(Self {
            hp,
            sha256,
            embd: Arc::new(embd),
            head,
            default_mask,
            output_norm,
            tokenizer,
        })
    }

    /// Rows of the output head for `ids`, `[ids.len()][n_embd]`.
    #[must_use]
    pub fn head_rows(&self, ids: &[u32]) -> Vec<f32> {
        let e = self.hp.n_embd;
        let w = self.head.as_deref().unwrap_or(&self.embd);
        ids.iter()
            .flat_map(|&id| &w[id as usize * e..(id as usize + 1) * e])
            .copied()
            .collect()
    }
}
