//! The DFlash block-diffusion draft network (Chen, Liang, Liu, "DFlash: Block Diffusion for
//! Flash Speculative Decoding", arXiv 2602.06036; reference `z-lab/dflash:dflash/model.py`),
//! loaded from a GGUF as llama.cpp's converter writes it (`general.architecture = dflash`).
//!
//! Scope: the network only — its two entry points on one KV cache. The drafting lifecycle
//! (when to inject, what the cache holds between rounds) lives in `specula-engine`.
//!
//! - [`Dflash::inject`] — *KV injection* with the encoder fused in: raw target features
//!   `[n, n_extract · H_t]` → `fc` (+ per-tensor scale) → RMSNorm (`enc.output_norm`) → for
//!   every layer `K = k_norm(W_k·g)` with RoPE at the target positions, `V = W_v·g`, written
//!   into the draft cache. One pass, no attention, no logits; the features never leave the
//!   backend between the encoder and the cache.
//! - [`Dflash::block`] — the noise block `[anchor, MASK × n]` in one forward: embeddings from the
//!   (usually borrowed) target `token_embd`, Qwen3-style layers whose queries see every cached
//!   context key and every block key (non-causal unless `dflash.attention.causal`), final norm,
//!   the (usually borrowed) target output head, and `d2t` scattered to the target vocabulary.
//!
//! - DFlash2 (`dflash.selector_top_k` > 0; Inco AI / z-lab, llama.cpp PR #27342): grouped
//!   two-tap dynamic convolutions around every attention and MLP sublayer of the block (on the
//!   host: the CPU backend's tensors are host memory) and [`Dflash::select`], the candidate
//!   selector's greedy walk over each row's top-K from the anchor.
//!
//! Layer taps: `dflash.target_layers` holds Hugging Face `target_layer_ids + 1`, i.e. indices
//! of target layer *inputs* — exactly [`crate::Taps`] indices, so they are used as they are.

use std::sync::Arc;

use specula_gguf::{Gguf, Value};
use specula_tensor::{AttentionParams, Backend, KvShape, Mask, RopeConfig, RopeKind};

use crate::{
    AttnHparams, Linear, Loader, Model, ModelError, Result, count, finite_f32, get_usize,
    int_bound, mul, opt_usize, scale_f32,
};

/// Hyperparameters of a DFlash draft (`dflash.*` keys).
#[derive(Clone, Debug, PartialEq)]
pub struct DflashHparams {
    /// Draft layers.
    pub n_layer: usize,
    /// Hidden size of the draft (= the target's when it borrows the embedding).
    pub n_embd: usize,
    /// Feed-forward size.
    pub n_ff: usize,
    /// Query heads.
    pub n_head: usize,
    /// K/V heads.
    pub n_head_kv: usize,
    /// Values per head (K and V).
    pub head_dim: usize,
    /// Rotated dimensions per head.
    pub n_rot: usize,
    /// RoPE θ.
    pub rope_freq_base: f32,
    /// RoPE linear scale (`1/factor`).
    pub rope_freq_scale: f32,
    /// RMSNorm epsilon.
    pub rms_eps: f32,
    /// Target taps in the layer-input convention (`dflash.target_layers`, HF ids + 1).
    pub target_layers: Vec<usize>,
    /// Trained block size `B` (`dflash.block_size`, 16 when absent): at most `B − 1` drafts.
    pub block_size: usize,
    /// The MASK token filling the block after the anchor.
    pub mask_token_id: u32,
    /// Block attention causal inside the block (`dflash.attention.causal`); normally false.
    pub causal: bool,
    /// Scale of the block embeddings (`dflash.embedding_scale`), 1 when absent.
    pub embedding_scale: f32,
    /// Attention score scale (`dflash.attention.scale`), `1/√head_dim` when absent.
    pub attention_scale: f32,
    /// Scale of each attention output before `W_o` (`dflash.attention.value_scale`).
    pub attn_value_scale: Option<f32>,
    /// GELU (tanh) instead of SiLU in the gated MLP (`dflash.hidden_activation`).
    pub gelu: bool,
    /// DFlash2 (`dflash.selector_top_k` > 0): the two-tap dynamic convolutions and the
    /// candidate selector.
    pub dflash2: Option<Dflash2Hparams>,
}

/// DFlash2's extra hyperparameters (`dflash.conv_*`, `dflash.selector_*`).
#[derive(Clone, Debug, PartialEq)]
pub struct Dflash2Hparams {
    /// Taps of each dynamic convolution (`conv_kernel_size`, 2 in the released draft).
    pub kernel: usize,
    /// Channels sharing one dynamic coefficient (`conv_group_size`).
    pub group: usize,
    /// Rank of the selector's codebooks (`selector_rank`).
    pub rank: usize,
    /// Candidates kept per block row (`selector_top_k`).
    pub top_k: usize,
    /// The target's logit scale, applied before the selector (`dflash.logit_scale`).
    pub logit_scale: Option<f32>,
    /// The target's final soft-capping, applied before the selector.
    pub softcap: Option<f32>,
}

impl Dflash2Hparams {
    /// A draft logit as the selector scores it: the target's own output transforms (scale,
    /// then soft-capping).
    #[must_use]
    pub fn transform(&self, mut x: f32) -> f32 {
        if let Some(sc) = self.logit_scale {
            x *= sc;
        }
        if let Some(cap) = self.softcap {
            x = (x / cap).tanh() * cap;
        }
        x
    }
}

fn bad(key: &str, detail: impl Into<String>) -> ModelError {
    ModelError::BadValue {
        key: key.to_owned(),
        detail: detail.into(),
    }
}

/// An integer array key as `usize`s.
pub(crate) fn usize_array(file: &Gguf, key: &str) -> Result<Option<Vec<usize>>> {
    let Some(v) = file.metadata().get(key) else {
        return Ok(None);
    };
    let Value::Array(a) = v else {
        return Err(bad(key, "expected an integer array"));
    };
    let ints: Vec<i64> = match a {
        specula_gguf::Array::I32(x) => x.iter().map(|&v| i64::from(v)).collect(),
        specula_gguf::Array::U32(x) => x.iter().map(|&v| i64::from(v)).collect(),
        specula_gguf::Array::I64(x) => x.clone(),
        specula_gguf::Array::U64(x) => x.iter().map(|&v| i64::try_from(v).unwrap_or(-1)).collect(),
        _ => return Err(bad(key, "expected an integer array")),
    };
    ints.iter()
        .map(|&v| usize::try_from(v).map_err(|_| bad(key, format!("negative layer {v}"))))
        .collect::<Result<Vec<_>>>()
        .map(Some)
}

fn get_bool(file: &Gguf, key: &str) -> Option<bool> {
    file.metadata().get(key).and_then(Value::as_bool)
}

impl DflashHparams {
    /// Reads the hyperparameters of a `dflash` GGUF, refusing variants specula does not run
    /// by name.
    ///
    /// # Errors
    /// A missing or invalid key, or an unsupported variant (DSpark, sliding-window,
    /// DeepSeek-V4 backbone, the buun fork's `dflash-draft` layout).
    pub fn from_file(file: &Gguf) -> Result<Self> {
        let md = file.metadata();
        let arch = md
            .get_str("general.architecture")
            .ok_or_else(|| ModelError::MissingKey {
                key: "general.architecture".into(),
            })?;
        if arch == "dflash-draft" {
            return Err(ModelError::UnsupportedArch {
                arch: "dflash-draft (a GGUF of the buun llama.cpp fork, tensor `dflash_fc`; \
                       reconvert the draft with upstream convert_hf_to_gguf.py)"
                    .into(),
            });
        }
        if arch != "dflash" {
            return Err(ModelError::UnsupportedArch {
                arch: format!("{arch} (a DFlash draft has general.architecture = dflash)"),
            });
        }
        if file.tensor("markov_w1.weight").is_some() {
            return Err(ModelError::UnsupportedArch {
                arch: "dflash with a Markov head (`markov_w1`): a DSpark draft \
                       (--spec-type draft-dspark), which specula does not run"
                    .into(),
            });
        }
        let k = |s: &str| format!("dflash.{s}");
        if md
            .get_u64(&k("hyper_connection_count"))
            .is_some_and(|v| v > 0)
        {
            return Err(ModelError::UnsupportedArch {
                arch: "dflash with a DeepSeek-V4 backbone (hyper-connections): a DSpark DSV4 \
                       draft, which specula does not run"
                    .into(),
            });
        }
        if md
            .get_u64(&k("attention.sliding_window"))
            .is_some_and(|v| v > 0)
        {
            return Err(bad(
                &k("attention.sliding_window"),
                "sliding-window DFlash drafts are not supported yet",
            ));
        }
        if let Some(a) = md.get_str(&k("decoder_arch")) {
            return Err(bad(
                &k("decoder_arch"),
                format!("DFlash decoder `{a}` is not supported (only the Qwen3-style one)"),
            ));
        }

        let at = AttnHparams::read(md, "dflash", 1e-6)?;
        let (n_embd, n_head, head_dim) = (at.n_embd, at.n_head, at.head_dim_k);
        // One head size for K and V: a value length, when given, must be the key length.
        if opt_usize(md, &k("attention.value_length"))?.is_some() && at.head_dim_v != head_dim {
            return Err(int_bound(
                &k("attention.value_length"),
                at.head_dim_v,
                format!("the key length {head_dim} (a DFlash draft has one head size)"),
            ));
        }
        // Drafts of M-RoPE targets carry degenerate sections [n_rot/2, 0, 0, 0]: plain RoPE on
        // the temporal positions, which is what text positions are.
        if let Some(sec) = usize_array(file, &k("rope.dimension_sections"))?
            && (sec.first().is_none_or(|&s| s == 0) || sec.iter().skip(1).any(|&s| s != 0))
        {
            return Err(bad(
                &k("rope.dimension_sections"),
                format!("{sec:?}: only degenerate sections [n, 0, 0, 0] with n > 0 are supported"),
            ));
        }
        // The layer taps: current key, then the earlier spelling (both hold HF ids + 1).
        let target_layers = match usize_array(file, &k("target_layers"))? {
            Some(t) => t,
            None => usize_array(file, &k("target_layer_ids"))?.ok_or_else(|| {
                ModelError::MissingKey {
                    key: k("target_layers"),
                }
            })?,
        };
        if target_layers.is_empty() {
            return Err(bad(&k("target_layers"), "no target layers"));
        }
        let block_size = opt_usize(md, &k("block_size"))?.unwrap_or(16);
        if block_size < 2 {
            return Err(bad(
                &k("block_size"),
                format!("{block_size}: a block needs the anchor and at least one MASK"),
            ));
        }
        let mask_token_id = md
            .get_u64("tokenizer.ggml.mask_token_id")
            .or_else(|| md.get_u64(&k("mask_token_id")))
            .ok_or_else(|| ModelError::MissingKey {
                key: "tokenizer.ggml.mask_token_id".into(),
            })?;
        let mask_token_id = u32::try_from(mask_token_id)
            .map_err(|_| bad("tokenizer.ggml.mask_token_id", "too large"))?;
        let gelu = match md.get_str(&k("hidden_activation")) {
            None | Some("silu") => false,
            Some("gelu" | "gelu_pytorch_tanh") => true,
            Some(other) => {
                return Err(bad(
                    &k("hidden_activation"),
                    format!("unsupported activation `{other}`"),
                ));
            }
        };
        let dflash2 = match md.get_u64(&k("selector_top_k")) {
            Some(top_k) if top_k > 0 => {
                let need = |key: &str| -> Result<usize> {
                    let v = get_usize(md, &k(key))?;
                    if v == 0 {
                        return Err(bad(&k(key), "must be positive for a DFlash2 draft"));
                    }
                    Ok(v)
                };
                let (kernel, group, rank) = (
                    need("conv_kernel_size")?,
                    need("conv_group_size")?,
                    need("selector_rank")?,
                );
                let top_k = usize::try_from(top_k).unwrap_or(usize::MAX);
                // The selector's `top_k · (top_k + 1)` bound and the convolutions' tensor
                // shapes must be computable.
                top_k
                    .checked_add(1)
                    .and_then(|t| t.checked_mul(top_k))
                    .ok_or_else(|| int_bound(&k("selector_top_k"), top_k, "a smaller value"))?;
                mul(
                    &k("conv_kernel_size"),
                    mul(&k("conv_kernel_size"), n_embd, kernel)?,
                    2,
                )?;
                if n_embd % group != 0 {
                    return Err(bad(
                        &k("conv_group_size"),
                        format!("{group} does not divide the hidden size {n_embd}"),
                    ));
                }
                Some(Dflash2Hparams {
                    kernel,
                    group,
                    rank,
                    top_k,
                    logit_scale: scale_f32(md, &k("logit_scale"))?.filter(|&v| v != 0.0),
                    softcap: finite_f32(md, &k("final_logit_softcapping"))?.filter(|&v| v > 0.0),
                })
            }
            _ if file.tensor("selector_hidden.weight").is_some() => {
                return Err(bad(
                    &k("selector_top_k"),
                    "a DFlash2 draft (selector tensors) without its conv/selector metadata",
                ));
            }
            _ => None,
        };
        #[allow(clippy::cast_precision_loss, reason = "head dims are small")]
        let default_scale = 1.0 / (head_dim as f32).sqrt();
        let nonzero = |key: &str| -> Result<Option<f32>> {
            Ok(scale_f32(md, &k(key))?.filter(|&v| v != 0.0))
        };
        Ok(Self {
            n_layer: count(md, &k("block_count"))?,
            n_embd,
            n_ff: count(md, &k("feed_forward_length"))?,
            n_head,
            n_head_kv: at.n_head_kv,
            head_dim,
            n_rot: at.n_rot,
            rope_freq_base: at.rope_freq_base,
            rope_freq_scale: at.rope_freq_scale,
            rms_eps: at.rms_eps,
            target_layers,
            block_size,
            mask_token_id,
            causal: get_bool(file, &k("attention.causal")).unwrap_or(false),
            embedding_scale: nonzero("embedding_scale")?.unwrap_or(1.0),
            attention_scale: nonzero("attention.scale")?.unwrap_or(default_scale),
            attn_value_scale: nonzero("attention.value_scale")?,
            gelu,
            dflash2,
        })
    }
}

#[derive(Debug)]
struct DLayer<W, T> {
    attn_norm: W,
    wq: Linear<W>,
    wk: Linear<W>,
    wv: Linear<W>,
    wo: Linear<W>,
    q_norm: W,
    k_norm: W,
    ffn_norm: W,
    ffn_gate: Linear<W>,
    ffn_up: Linear<W>,
    ffn_down: Linear<W>,
    /// DFlash2: the attention and MLP convolutions.
    attn_conv: Option<Conv<W, T>>,
    ffn_conv: Option<Conv<W, T>>,
}

/// One DFlash2 grouped dynamic convolution pair ("in" before a sublayer, "out" after it).
#[derive(Debug)]
struct Conv<W, T> {
    /// `[2 · kernel, n_embd]` (side, tap; channel), as HF's `base_kernel`, on the backend.
    base: T,
    /// `n_embd → 2 · kernel · groups` coefficients, read `[side][tap][group]`.
    proj: Linear<W>,
}

/// `x` through DFlash2's convolution `conv` on `side` with the block's coefficients `dynamic`
/// (`conv.proj` of the sublayer's input), on the backend ([`Backend::block_conv`]).
fn conv_apply<B: Backend>(
    be: &B,
    conv: &Conv<B::Weight, B::Tensor>,
    dynamic: &B::Tensor,
    side: usize,
    (kernel, group): (usize, usize),
    x: &mut B::Tensor,
    tmp: &mut B::Tensor,
) {
    be.block_conv(x, dynamic, &conv.base, side, kernel, group, tmp);
    std::mem::swap(x, tmp);
}

/// DFlash2's candidate selector.
#[derive(Debug)]
struct Selector<W> {
    /// `[n_vocab][rank]` rows: a token as predecessor.
    prev: W,
    /// `[n_vocab][rank]` rows: a token as successor.
    next: W,
    /// `n_embd → rank`.
    hidden: W,
}

/// Reusable buffers of the draft's two passes.
#[derive(Debug)]
pub struct DflashScratch<B: Backend> {
    feats: B::Tensor,
    fc: B::Tensor,
    g: B::Tensor,
    x: B::Tensor,
    cur: B::Tensor,
    q: B::Tensor,
    k: B::Tensor,
    v: B::Tensor,
    attn: B::Tensor,
    proj: B::Tensor,
    gate: B::Tensor,
    up: B::Tensor,
    act: B::Tensor,
    sel: B::Tensor,
    norm: B::Tensor,
    logits: B::Tensor,
    /// The index tensors of a pass (built once, read by every layer): its tokens, positions
    /// (also its cells: cell = position), the cells its queries read, and the rows it copies
    /// (feature rows of [`Dflash::inject_rows`], logits rows of a block).
    tokens: B::Index,
    pos: B::Index,
    kv_pos: B::Index,
    rows: B::Index,
    /// Where an index is staged on the host.
    stage: Vec<u32>,
    host: Vec<f32>,
    full: Vec<f32>,
    /// DFlash2: each block row's candidates as the backend finds them (`K + 1` ids and
    /// logits), and as the walk reads them (`K`, best first, transformed).
    top_ids: Vec<u32>,
    top_vals: Vec<f32>,
    cand_ids: Vec<u32>,
    cand_vals: Vec<f32>,
    /// DFlash2: a convolution's output, swapped with its input.
    conv: B::Tensor,
    h1: Vec<f32>,
    h2: Vec<f32>,
    dynt: B::Tensor,
    selh: B::Tensor,
    code: B::Tensor,
    codes: B::Tensor,
}

/// A loaded DFlash draft network.
pub struct Dflash<B: Backend> {
    hp: DflashHparams,
    fc: Linear<B::Weight>,
    enc_norm: B::Weight,
    output_norm: B::Weight,
    tok_embd: Arc<B::Weight>,
    output: Linear<Arc<B::Weight>>,
    /// Draft row → absolute target id, for reduced-vocabulary drafts.
    d2t: Option<Vec<u32>>,
    n_vocab: usize,
    n_embd_target: usize,
    layers: Vec<DLayer<B::Weight, B::Tensor>>,
    selector: Option<Selector<B::Weight>>,
}

impl<B: Backend> std::fmt::Debug for Dflash<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dflash")
            .field("hparams", &self.hp)
            .field("d2t", &self.d2t.as_ref().map(Vec::len))
            .finish_non_exhaustive()
    }
}

/// Reads the `d2t` tensor (I64 absolute target ids, as llama.cpp's converter stores them).
pub(crate) fn read_d2t(file: &Gguf, n_vocab_target: usize) -> Result<Option<Vec<u32>>> {
    let Some(info) = file.tensor("d2t") else {
        return Ok(None);
    };
    if info.ty != specula_gguf::GgmlType::I64 || info.dims.len() != 1 {
        return Err(ModelError::UnsupportedType {
            name: "d2t".into(),
            ty: format!(
                "{} with {} dims (expected i64, 1 dim)",
                info.ty.name(),
                info.dims.len()
            ),
        });
    }
    let data = file.tensor_data_by_name("d2t").unwrap_or(&[]);
    let mut out = Vec::with_capacity(data.len() / 8);
    let mut prev: Option<u32> = None;
    for c in data.chunks_exact(8) {
        let v = i64::from_le_bytes(c.try_into().unwrap_or([0; 8]));
        let id = u32::try_from(v)
            .ok()
            .filter(|&id| (id as usize) < n_vocab_target)
            .ok_or_else(|| ModelError::BadValue {
                key: "d2t".into(),
                detail: format!("target id {v} outside the target vocabulary of {n_vocab_target}"),
            })?;
        if prev.is_some_and(|p| id <= p) {
            return Err(ModelError::BadValue {
                key: "d2t".into(),
                detail: "ids must be strictly increasing absolute target ids (an offset-style \
                         d2t from the HF checkpoint was not converted)"
                    .into(),
            });
        }
        prev = Some(id);
        out.push(id);
    }
    if out.is_empty() {
        return Err(ModelError::BadValue {
            key: "d2t".into(),
            detail: "no ids: a reduced vocabulary needs at least one token".into(),
        });
    }
    Ok(Some(out))
}

/// The largest finite f16: target features are clamped to it, NaN set to 0
/// ([`Backend::clamp_finite`]) — llama.cpp's guard against massive activations poisoning the
/// draft cache through f16 staging.
pub(crate) const F16_MAX: f32 = 65504.0;

/// Scatters rows of draft-vocabulary logits into target-vocabulary rows, −∞ elsewhere.
pub(crate) fn scatter_d2t(d2t: &[u32], draft: &[f32], n_vocab: usize, out: &mut Vec<f32>) {
    let rows = draft.len() / d2t.len().max(1);
    out.clear();
    out.resize(rows * n_vocab, f32::NEG_INFINITY);
    for r in 0..rows {
        let src = &draft[r * d2t.len()..(r + 1) * d2t.len()];
        let dst = &mut out[r * n_vocab..(r + 1) * n_vocab];
        for (&id, &x) in d2t.iter().zip(src) {
            dst[id as usize] = x;
        }
    }
}

impl<B: Backend> Dflash<B> {
    /// Loads a DFlash draft for `target`; the token embedding and the output head are the
    /// target's unless the draft ships its own.
    ///
    /// # Errors
    /// Unsupported variants (by name), missing keys or tensors, wrong shapes, taps past the
    /// target's layers, a draft width that differs from the target's while borrowing its
    /// embedding.
    pub fn load(backend: &B, file: Arc<Gguf>, target: &Model<B>) -> Result<Self> {
        let hp = DflashHparams::from_file(&file)?;
        let thp = target.hparams();
        if let Some(&t) = hp.target_layers.iter().find(|&&t| t > thp.n_layer) {
            return Err(bad(
                "dflash.target_layers",
                format!(
                    "tap {t} is past the target's {} layers (taps are layer inputs, HF id + 1; \
                     {} is the final pre-norm state)",
                    thp.n_layer, thp.n_layer
                ),
            ));
        }
        let n_vocab = thp.n_vocab;
        if hp.mask_token_id as usize >= n_vocab {
            return Err(int_bound(
                "tokenizer.ggml.mask_token_id",
                hp.mask_token_id as usize,
                format!("a token of the target's vocabulary of {n_vocab}"),
            ));
        }
        crate::check_layer_tensors(&file, "dflash.block_count", hp.n_layer)?;
        let l = Loader::new(backend, &file);
        let (e, f, hd) = (hp.n_embd, hp.n_ff, hp.head_dim);
        let (qd, kd) = (
            mul("dflash.attention.head_count", hp.n_head, hd)?,
            mul("dflash.attention.head_count_kv", hp.n_head_kv, hd)?,
        );
        let d2t = read_d2t(&file, n_vocab)?;
        let n_vocab_draft = d2t.as_ref().map_or(n_vocab, Vec::len);
        let own_embd = l.get("token_embd.weight", &[e, n_vocab])?;
        if own_embd.is_none() && e != thp.n_embd {
            return Err(bad(
                "dflash.embedding_length",
                format!(
                    "{e} differs from the target's {} and the draft has no token_embd of its own",
                    thp.n_embd
                ),
            ));
        }
        let own_output = l.linear_opt("output", &[e, n_vocab_draft])?;
        let tok_embd = match own_embd {
            Some(w) => Arc::new(w),
            None => target.token_embedding(),
        };
        let output = match own_output {
            Some(o) => Linear {
                w: Arc::new(o.w),
                scale: o.scale,
            },
            None if d2t.is_some() => {
                return Err(ModelError::MissingTensor {
                    name: "output.weight (a reduced-vocabulary draft with d2t needs its own head)"
                        .into(),
                });
            }
            None if file.tensor("token_embd.weight").is_some() => {
                // llama.cpp ties a draft's own embedding as its head.
                let mut w = l.req("token_embd.weight", &[e, n_vocab])?;
                backend.prepare_matmul(&mut w);
                Linear {
                    w: Arc::new(w),
                    scale: None,
                }
            }
            None => target.output_linear(),
        };
        let n_extract = hp.target_layers.len();
        let fc = l.linear(
            "fc",
            &[mul("dflash.target_layers", n_extract, thp.n_embd)?, e],
        )?;
        let enc_norm = match l.get("enc.output_norm.weight", &[e])? {
            Some(w) => w,
            // The earliest upstream converter named the encoder norm after HF's `hidden_norm`.
            None => {
                l.get("hidden_norm.weight", &[e])?
                    .ok_or_else(|| ModelError::MissingTensor {
                        name: "enc.output_norm.weight".into(),
                    })?
            }
        };
        let output_norm = l.req("output_norm.weight", &[e])?;
        let mut layers = Vec::with_capacity(hp.n_layer.min(file.tensors().len()));
        for i in 0..hp.n_layer {
            let n = |s: &str| format!("blk.{i}.{s}");
            for unsupported in [
                "attn_sinks.weight",
                "attn_post_norm.weight",
                "ffn_post_norm.weight",
                "layer_output_scale.weight",
                "rope_freqs.weight",
            ] {
                if file.tensor(&n(unsupported)).is_some() {
                    return Err(ModelError::UnsupportedArch {
                        arch: format!("dflash with `{}` (not supported)", n(unsupported)),
                    });
                }
            }
            if file.tensor(&n("attn_v.weight")).is_none() {
                return Err(ModelError::UnsupportedArch {
                    arch: format!("dflash with shared K/V (no `{}`)", n("attn_v.weight")),
                });
            }
            let conv = |which: &str| -> Result<Option<Conv<B::Weight, B::Tensor>>> {
                let Some(h2) = &hp.dflash2 else {
                    return Ok(None);
                };
                let groups = e / h2.group;
                let base_name = n(&format!("{which}_conv_base"));
                let base_w = l.req(&base_name, &[e, h2.kernel, 2])?;
                let base = base_values(&file, &base_name, e * h2.kernel * 2)?;
                drop(base_w);
                Ok(Some(Conv {
                    base: backend.from_host(2 * h2.kernel, e, &base),
                    proj: l.linear(
                        &n(&format!("{which}_conv_proj")),
                        &[e, 2 * h2.kernel * groups],
                    )?,
                }))
            };
            layers.push(DLayer {
                attn_conv: conv("attn")?,
                ffn_conv: conv("ffn")?,
                attn_norm: l.req(&n("attn_norm.weight"), &[e])?,
                wq: l.linear(&n("attn_q"), &[e, qd])?,
                wk: l.linear(&n("attn_k"), &[e, kd])?,
                wv: l.linear(&n("attn_v"), &[e, kd])?,
                wo: l.linear(&n("attn_output"), &[qd, e])?,
                q_norm: l.req(&n("attn_q_norm.weight"), &[hd])?,
                k_norm: l.req(&n("attn_k_norm.weight"), &[hd])?,
                ffn_norm: l.req(&n("ffn_norm.weight"), &[e])?,
                ffn_gate: l.linear(&n("ffn_gate"), &[e, f])?,
                ffn_up: l.linear(&n("ffn_up"), &[e, f])?,
                ffn_down: l.linear(&n("ffn_down"), &[f, e])?,
            });
        }
        let selector = match &hp.dflash2 {
            Some(h2) => {
                let min = h2.top_k * (h2.top_k + 1);
                if e < min {
                    return Err(bad(
                        "dflash.selector_top_k",
                        format!("the hidden size {e} is below top_k · (top_k + 1) = {min}"),
                    ));
                }
                if d2t.is_some() {
                    return Err(ModelError::UnsupportedArch {
                        arch: "a DFlash2 draft with a reduced vocabulary (d2t): its selector \
                               scores the full vocabulary"
                            .into(),
                    });
                }
                let mut hidden = l.req("selector_hidden.weight", &[e, h2.rank])?;
                backend.prepare_matmul(&mut hidden);
                Some(Selector {
                    prev: l.req("selector_predecessor.weight", &[h2.rank, n_vocab])?,
                    next: l.req("selector_successor.weight", &[h2.rank, n_vocab])?,
                    hidden,
                })
            }
            None => None,
        };
        l.scales.check(&file)?;
        Ok(Self {
            selector,
            hp,
            fc,
            enc_norm,
            output_norm,
            tok_embd,
            output,
            d2t,
            n_vocab,
            n_embd_target: thp.n_embd,
            layers,
        })
    }

    /// The hyperparameters.
    #[must_use]
    pub fn hparams(&self) -> &DflashHparams {
        &self.hp
    }

    /// Width of one feature row: `n_extract · H_t`.
    #[must_use]
    pub fn feature_width(&self) -> usize {
        self.hp.target_layers.len() * self.n_embd_target
    }

    /// Logit row width (the target vocabulary).
    #[must_use]
    pub fn n_vocab(&self) -> usize {
        self.n_vocab
    }

    /// The shape of a draft cache of `n_ctx` cells.
    #[must_use]
    pub fn kv_shape(
        &self,
        n_ctx: usize,
        k_type: specula_quant::QType,
        v_type: specula_quant::QType,
    ) -> KvShape {
        KvShape::uniform(
            self.hp.n_layer,
            n_ctx,
            self.hp.n_head_kv,
            self.hp.head_dim,
            k_type,
            v_type,
        )
    }

    /// Fresh buffers.
    #[must_use]
    pub fn scratch(&self, be: &B) -> DflashScratch<B> {
        let z = || be.zeros(0, 0);
        DflashScratch {
            feats: z(),
            fc: z(),
            g: z(),
            x: z(),
            cur: z(),
            q: z(),
            k: z(),
            v: z(),
            attn: z(),
            proj: z(),
            gate: z(),
            up: z(),
            act: z(),
            sel: z(),
            norm: z(),
            logits: z(),
            tokens: be.index(&[]),
            pos: be.index(&[]),
            kv_pos: be.index(&[]),
            rows: be.index(&[]),
            stage: Vec::new(),
            host: Vec::new(),
            full: Vec::new(),
            top_ids: Vec::new(),
            top_vals: Vec::new(),
            cand_ids: Vec::new(),
            cand_vals: Vec::new(),
            conv: z(),
            h1: Vec::new(),
            h2: Vec::new(),
            dynt: z(),
            selh: z(),
            code: z(),
            codes: z(),
        }
    }

    fn rope(&self) -> RopeConfig {
        let mut r = RopeConfig::new(RopeKind::Neox, self.hp.n_rot, self.hp.rope_freq_base);
        r.freq_scale = self.hp.rope_freq_scale;
        r
    }

    /// KV injection: encodes `features` (row-major `[pos.len(), feature_width]`, the target
    /// taps side by side) with `fc` and the encoder norm, and writes every layer's context
    /// K/V for them into cells `pos` (cell = position). One pass; no attention.
    ///
    /// # Errors
    /// A feature buffer of the wrong size, or positions past the cache.
    pub fn inject(
        &self,
        be: &B,
        kv: &mut B::Kv,
        n_ctx: usize,
        s: &mut DflashScratch<B>,
        features: &[f32],
        pos: &[u32],
    ) -> Result<()> {
        let (n, w) = (pos.len(), self.feature_width());
        if n == 0 {
            return Ok(());
        }
        if features.len() != n * w {
            return Err(ModelError::Features {
                what: "DFlash injection",
                got: features.len(),
                rows: n,
                width: w,
            });
        }
        let t = be.from_host(n, w, features);
        self.inject_rows(be, kv, n_ctx, s, &t, 0..n, pos)
    }

    /// [`Dflash::inject`] of features that lie on the backend: `rows` of `features` (a
    /// `[_, feature_width]` tensor, the target's taps as [`crate::TapSink::Device`] writes
    /// them) for positions `pos`, sanitized there — nothing goes through the host.
    ///
    /// # Errors
    /// As [`Dflash::inject`]: a tensor of the wrong width or too few rows, positions past the
    /// cache.
    #[allow(
        clippy::too_many_arguments,
        reason = "inject's inputs, the features as a tensor and its rows"
    )]
    pub fn inject_rows(
        &self,
        be: &B,
        kv: &mut B::Kv,
        n_ctx: usize,
        s: &mut DflashScratch<B>,
        features: &B::Tensor,
        rows: std::ops::Range<usize>,
        pos: &[u32],
    ) -> Result<()> {
        let (n, w) = (pos.len(), self.feature_width());
        if n == 0 {
            return Ok(());
        }
        let (t_rows, t_cols) = be.shape(features);
        if t_cols != w || rows.len() != n || rows.end > t_rows {
            return Err(ModelError::Features {
                what: "DFlash injection",
                got: rows.len().min(t_rows) * t_cols,
                rows: n,
                width: w,
            });
        }
        if let Some(&p) = pos.iter().find(|&&p| p as usize >= n_ctx) {
            return Err(ModelError::PastCache {
                what: "DFlash injection",
                rows: n,
                pos: p as usize,
                n_ctx,
            });
        }
        crate::index::stage(
            be,
            &mut s.rows,
            &mut s.stage,
            rows.map(crate::index::index_of),
        );
        be.copy_rows(features, &s.rows, &mut s.feats);
        be.clamp_finite(&mut s.feats, F16_MAX);
        self.encode_context(be, kv, s, pos);
        Ok(())
    }

    /// `fc`, the encoder norm and every layer's K/V of the sanitized features in `s.feats`,
    /// written into cells `pos`.
    fn encode_context(&self, be: &B, kv: &mut B::Kv, s: &mut DflashScratch<B>, pos: &[u32]) {
        let hp = &self.hp;
        self.fc.matmul(be, &s.feats, &mut s.fc);
        be.rms_norm(&s.fc, Some(&self.enc_norm), hp.rms_eps, &mut s.g);
        be.set_index(&mut s.pos, pos);
        let rope = self.rope();
        for (il, layer) in self.layers.iter().enumerate() {
            layer.wk.matmul(be, &s.g, &mut s.k);
            layer.wv.matmul(be, &s.g, &mut s.v);
            be.rms_norm_groups(&mut s.k, hp.head_dim, &layer.k_norm, hp.rms_eps);
            be.rope(&mut s.k, hp.head_dim, &s.pos, &rope);
            be.kv_write(kv, il, &s.pos, &s.k, &s.v);
        }
    }

    /// The noise block: `tokens` (`[anchor, MASK, …]`) at positions `pos0..`, attending to the
    /// context in cells `0..pos0` and to every block row (their K/V go to cells
    /// `pos0..pos0 + n` for this pass only: the next injection or block overwrites them).
    /// Returns the logits (target vocabulary) of `rows`, row-major.
    ///
    /// # Errors
    /// An empty block, ids past the vocabulary, or a block past the cache.
    #[allow(
        clippy::too_many_arguments,
        reason = "the block forward's inputs are all needed"
    )]
    pub fn block<'s>(
        &self,
        be: &B,
        kv: &mut B::Kv,
        n_ctx: usize,
        s: &'s mut DflashScratch<B>,
        tokens: &[u32],
        pos0: usize,
        rows: &[usize],
    ) -> Result<&'s [f32]> {
        let hp = &self.hp;
        self.block_logits(be, kv, n_ctx, s, tokens, pos0, rows)?;
        if rows.is_empty() {
            s.host.clear();
            return Ok(&s.host);
        }
        be.to_host(&s.logits, &mut s.host);
        if let Some(h2) = &hp.dflash2 {
            // The selector scores with the target's own output transforms.
            for x in &mut s.host {
                *x = h2.transform(*x);
            }
        }
        if let Some(d2t) = &self.d2t {
            scatter_d2t(d2t, &s.host, self.n_vocab, &mut s.full);
            return Ok(&s.full);
        }
        Ok(&s.host)
    }

    /// [`Dflash::block`] read out on the backend ([`Backend::top1_rows`]): the top-1 token
    /// (target id) of each of `rows` and its probability, into `ids` and `probs` — the logits
    /// never reach the host. Among equal maxima the lowest draft-vocabulary index wins (with
    /// a `d2t` that increases, as the trainer writes it, the lowest target id, as
    /// [`Dflash::block`]'s rows give it). Not for DFlash2 (its selector reads the rows).
    ///
    /// # Errors
    /// As [`Dflash::block`].
    #[allow(
        clippy::too_many_arguments,
        reason = "the block forward's inputs and its two outputs"
    )]
    pub fn block_top1(
        &self,
        be: &B,
        kv: &mut B::Kv,
        n_ctx: usize,
        s: &mut DflashScratch<B>,
        tokens: &[u32],
        pos0: usize,
        rows: &[usize],
        ids: &mut Vec<u32>,
        probs: &mut Vec<f32>,
    ) -> Result<()> {
        self.block_logits(be, kv, n_ctx, s, tokens, pos0, rows)?;
        ids.clear();
        probs.clear();
        if rows.is_empty() {
            return Ok(());
        }
        be.top1_rows(&s.logits, ids, probs);
        if let Some(d2t) = &self.d2t {
            for id in ids.iter_mut() {
                if let Some(&t) = d2t.get(*id as usize) {
                    *id = t;
                }
            }
        }
        Ok(())
    }

    /// The block forward of [`Dflash::block`], leaving the (draft-vocabulary) logits of `rows`
    /// in `s.logits` on the backend.
    #[allow(
        clippy::too_many_arguments,
        reason = "the block forward's inputs are all needed"
    )]
    fn block_logits(
        &self,
        be: &B,
        kv: &mut B::Kv,
        n_ctx: usize,
        s: &mut DflashScratch<B>,
        tokens: &[u32],
        pos0: usize,
        rows: &[usize],
    ) -> Result<()> {
        let hp = &self.hp;
        let n = tokens.len();
        if n == 0 || pos0 + n > n_ctx {
            return Err(ModelError::PastCache {
                what: "DFlash block",
                rows: n,
                pos: pos0,
                n_ctx,
            });
        }
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= self.n_vocab) {
            return Err(ModelError::TokenPastVocab {
                what: "DFlash block",
                id: t,
                n_vocab: self.n_vocab,
            });
        }
        if let Some(&r) = rows.iter().find(|&&r| r >= n) {
            return Err(ModelError::LogitsRow {
                what: "DFlash block".into(),
                row: r,
                rows: n,
            });
        }
        let at = crate::index::index_of;
        crate::index::stage(be, &mut s.pos, &mut s.stage, (pos0..pos0 + n).map(at));
        crate::index::stage(be, &mut s.kv_pos, &mut s.stage, (0..pos0 + n).map(at));
        crate::index::stage(be, &mut s.rows, &mut s.stage, rows.iter().map(|&r| at(r)));
        be.set_index(&mut s.tokens, tokens);
        let rope = self.rope();
        let mask = if hp.causal { Mask::Causal } else { Mask::None };

        be.get_rows(&self.tok_embd, &s.tokens, &mut s.x);
        if hp.embedding_scale != 1.0 {
            be.scale(&mut s.x, hp.embedding_scale);
        }
        let cshape = hp
            .dflash2
            .as_ref()
            .map_or((0, 1), |h2| (h2.kernel, h2.group));
        for (il, layer) in self.layers.iter().enumerate() {
            be.rms_norm(&s.x, Some(&layer.attn_norm), hp.rms_eps, &mut s.cur);
            if let Some(c) = &layer.attn_conv {
                c.proj.matmul(be, &s.cur, &mut s.dynt);
                conv_apply(be, c, &s.dynt, 0, cshape, &mut s.cur, &mut s.conv);
            }
            layer.wq.matmul(be, &s.cur, &mut s.q);
            layer.wk.matmul(be, &s.cur, &mut s.k);
            layer.wv.matmul(be, &s.cur, &mut s.v);
            be.rms_norm_groups(&mut s.q, hp.head_dim, &layer.q_norm, hp.rms_eps);
            be.rms_norm_groups(&mut s.k, hp.head_dim, &layer.k_norm, hp.rms_eps);
            be.rope(&mut s.q, hp.head_dim, &s.pos, &rope);
            be.rope(&mut s.k, hp.head_dim, &s.pos, &rope);
            be.kv_write(kv, il, &s.pos, &s.k, &s.v);
            be.attention(
                &s.q,
                kv,
                &AttentionParams {
                    layer: il,
                    n_head: hp.n_head,
                    q_pos: &s.pos,
                    kv_pos: &s.kv_pos,
                    scale: hp.attention_scale,
                    mask,
                    softcap: None,
                },
                &mut s.attn,
            );
            if let Some(vs) = hp.attn_value_scale {
                be.scale(&mut s.attn, vs);
            }
            layer.wo.matmul(be, &s.attn, &mut s.proj);
            if let Some(c) = &layer.attn_conv {
                conv_apply(be, c, &s.dynt, 1, cshape, &mut s.proj, &mut s.conv);
            }
            be.add(&mut s.x, &s.proj);

            be.rms_norm(&s.x, Some(&layer.ffn_norm), hp.rms_eps, &mut s.cur);
            if let Some(c) = &layer.ffn_conv {
                c.proj.matmul(be, &s.cur, &mut s.dynt);
                conv_apply(be, c, &s.dynt, 0, cshape, &mut s.cur, &mut s.conv);
            }
            layer.ffn_gate.matmul(be, &s.cur, &mut s.gate);
            layer.ffn_up.matmul(be, &s.cur, &mut s.up);
            if hp.gelu {
                be.geglu(&s.gate, &s.up, &mut s.act);
            } else {
                be.swiglu(&s.gate, &s.up, &mut s.act);
            }
            layer.ffn_down.matmul(be, &s.act, &mut s.proj);
            if let Some(c) = &layer.ffn_conv {
                conv_apply(be, c, &s.dynt, 1, cshape, &mut s.proj, &mut s.conv);
            }
            be.add(&mut s.x, &s.proj);
        }
        if rows.is_empty() {
            return Ok(());
        }
        be.copy_rows(&s.x, &s.rows, &mut s.sel);
        be.rms_norm(&s.sel, Some(&self.output_norm), hp.rms_eps, &mut s.norm);
        self.output.matmul(be, &s.norm, &mut s.logits);
        Ok(())
    }

    /// Whether this is a DFlash2 draft (its drafts come from [`Dflash::select`]).
    #[must_use]
    pub fn is_dflash2(&self) -> bool {
        self.selector.is_some()
    }

    /// DFlash2's greedy selector walk over the rows of the last [`Dflash::block`] (their logits
    /// and final hidden states): keep the top-K candidates of each row, score
    /// `S(u → v) = logit(v) + ⟨A[u] ⊙ P·h, B[v]⟩` from the predecessor `u` (the anchor for the
    /// first row), take the best and carry it; stop where its softmax over the K scores falls
    /// below `p_min` (llama.cpp's walk). Returns the drafts (empty for a DFlash draft).
    pub fn select(&self, be: &B, s: &mut DflashScratch<B>, anchor: u32, p_min: f32) -> Vec<u32> {
        let Some(h2) = &self.hp.dflash2 else {
            return Vec::new();
        };
        let n_vocab = self.n_vocab;
        let rows = s.host.len() / n_vocab;
        let k = h2.top_k.min(n_vocab);
        s.cand_ids.clear();
        s.cand_vals.clear();
        for r in 0..rows {
            let row = &s.host[r * n_vocab..(r + 1) * n_vocab];
            specula_tensor::topk_row(row, k, &mut s.cand_ids, &mut s.cand_vals);
        }
        self.walk(be, s, rows, k, anchor, p_min)
    }

    /// [`Dflash::block`] and [`Dflash::select`] with the logits left on the backend: each
    /// row's candidates come to the host as `K + 1` ids and logits ([`Backend::topk_rows`]),
    /// not as a row of the vocabulary. The selector's logit transforms (scale, soft-capping)
    /// keep the order, so these are the host path's candidates; where they could tie with the
    /// next one (equal after the transforms at the K-th), or a transform is not increasing,
    /// the block takes the host path, so the drafts are that path's in every case.
    ///
    /// # Errors
    /// As [`Dflash::block`].
    #[allow(
        clippy::too_many_arguments,
        reason = "the block forward's inputs and the walk's"
    )]
    pub fn block_select(
        &self,
        be: &B,
        kv: &mut B::Kv,
        n_ctx: usize,
        s: &mut DflashScratch<B>,
        tokens: &[u32],
        pos0: usize,
        rows: &[usize],
        anchor: u32,
        p_min: f32,
    ) -> Result<Vec<u32>> {
        let Some(h2) = &self.hp.dflash2 else {
            return Ok(Vec::new());
        };
        let increasing =
            h2.logit_scale.is_none_or(|sc| sc > 0.0) && h2.softcap.is_none_or(|c| c > 0.0);
        if !increasing {
            self.block(be, kv, n_ctx, s, tokens, pos0, rows)?;
            return Ok(self.select(be, s, anchor, p_min));
        }
        self.block_logits(be, kv, n_ctx, s, tokens, pos0, rows)?;
        let n_rows = rows.len();
        if n_rows == 0 {
            return Ok(Vec::new());
        }
        let n_vocab = self.n_vocab;
        let k = h2.top_k.min(n_vocab);
        let wide = (k + 1).min(n_vocab);
        let (mut ids, mut vals) = (
            std::mem::take(&mut s.top_ids),
            std::mem::take(&mut s.top_vals),
        );
        be.topk_rows(&s.logits, wide, &mut ids, &mut vals);
        for x in &mut vals {
            *x = h2.transform(*x);
        }
        // Candidates of each row by transformed logit, then id (the host path's order).
        let mut tie = false;
        s.cand_ids.clear();
        s.cand_vals.clear();
        let mut order: Vec<usize> = Vec::with_capacity(wide);
        for r in 0..n_rows {
            let (ri, rv) = (
                &ids[r * wide..(r + 1) * wide],
                &vals[r * wide..(r + 1) * wide],
            );
            order.clear();
            order.extend(0..wide);
            order.sort_by(|&a, &b| rv[b].total_cmp(&rv[a]).then(ri[a].cmp(&ri[b])));
            if wide > k && rv[order[k - 1]].total_cmp(&rv[order[k]]).is_eq() {
                tie = true;
            }
            s.cand_ids.extend(order[..k].iter().map(|&j| ri[j]));
            s.cand_vals.extend(order[..k].iter().map(|&j| rv[j]));
        }
        s.top_ids = ids;
        s.top_vals = vals;
        if tie {
            // The K-th candidate may not be the host path's: read the rows.
            be.to_host(&s.logits, &mut s.host);
            for x in &mut s.host {
                *x = h2.transform(*x);
            }
            return Ok(self.select(be, s, anchor, p_min));
        }
        Ok(self.walk(be, s, n_rows, k, anchor, p_min))
    }

    /// The selector's walk over `rows` rows of `k` candidates each (`s.cand_ids`,
    /// `s.cand_vals`, best first), from `anchor`.
    fn walk(
        &self,
        be: &B,
        s: &mut DflashScratch<B>,
        rows: usize,
        k: usize,
        anchor: u32,
        p_min: f32,
    ) -> Vec<u32> {
        let (Some(sel), Some(h2)) = (&self.selector, &self.hp.dflash2) else {
            return Vec::new();
        };
        be.matmul(&s.norm, &sel.hidden, &mut s.selh);
        be.to_host(&s.selh, &mut s.h1);
        let rank = h2.rank;
        let mut out = Vec::with_capacity(rows);
        let mut pred = anchor;
        let mut scores = vec![0.0f32; k];
        let mut a = vec![0.0f32; rank];
        for r in 0..rows {
            let idx = &s.cand_ids[r * k..(r + 1) * k];
            let val = &s.cand_vals[r * k..(r + 1) * k];
            be.set_index(&mut s.tokens, &[pred]);
            be.get_rows(&sel.prev, &s.tokens, &mut s.code);
            be.to_host(&s.code, &mut s.h2);
            for ((o, x), y) in a.iter_mut().zip(&s.h2).zip(&s.h1[r * rank..(r + 1) * rank]) {
                *o = x * y;
            }
            be.set_index(&mut s.tokens, idx);
            be.get_rows(&sel.next, &s.tokens, &mut s.codes);
            be.to_host(&s.codes, &mut s.h2);
            for (j, &v) in val.iter().enumerate() {
                let b = &s.h2[j * rank..(j + 1) * rank];
                scores[j] = v + a.iter().zip(b).map(|(x, y)| x * y).sum::<f32>();
            }
            let (best, max) =
                scores[..k]
                    .iter()
                    .enumerate()
                    .fold(
                        (0, f32::NEG_INFINITY),
                        |m, (j, &x)| if x > m.1 { (j, x) } else { m },
                    );
            if p_min > 0.0 {
                let sum: f32 = scores[..k].iter().map(|&x| (x - max).exp()).sum();
                if 1.0 / sum < p_min {
                    break;
                }
            }
            pred = idx[best];
            out.push(pred);
        }
        out
    }
}

/// The f32 values of a small tensor (a DFlash2 `*_conv_base`), whatever its file type.
fn base_values(file: &Gguf, name: &str, n: usize) -> Result<Vec<f32>> {
    let info = file.tensor(name).ok_or_else(|| ModelError::MissingTensor {
        name: name.to_owned(),
    })?;
    let ty = specula_quant::QType::from_ggml_id(info.ty.id()).ok_or_else(|| {
        ModelError::UnsupportedType {
            name: name.to_owned(),
            ty: info.ty.name().to_owned(),
        }
    })?;
    let mut out = vec![0.0; n];
    specula_quant::dequantize_row(ty, file.tensor_data_by_name(name).unwrap_or(&[]), &mut out)
        .map_err(|e| ModelError::Backend(e.into()))?;
    Ok(out)
}
