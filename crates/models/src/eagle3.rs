//! The EAGLE-3 draft head (Li, Wei, Zhang, Zhang, arXiv 2503.01840; HF
//! `LlamaForCausalLMEagle3`), loaded from a GGUF as llama.cpp's converter writes it
//! (`general.architecture = eagle3`).
//!
//! Scope: the network — [`Eagle3::encode`] (target features → `g` through `fc`, with the
//! optional `enc.output_norm` before it) and [`Eagle3::decode`] (one decoder layer over pairs
//! `(token, g)`, causal attention over its own cache). The drafting lifecycle is in
//! `specula-engine`.
//!
//! The decoder row at memory position `P` takes the token at `P + 1` and `g[P]` (llama.cpp's
//! convention): `input_layernorm(embed(token))` and `hidden_norm(g)` (`blk.0.attn_norm_2`) side
//! by side feed Q/K/V; the residual is `g` (or `hidden_norm(g)` with `norm_before_residual`);
//! post-attention norm, SwiGLU, residual give the *prenorm* state, which is the next chain
//! step's `g`; the final norm and the head (own, over a reduced vocabulary mapped by `d2t` to
//! absolute target ids, or the target's) give the logits.
//!
//! Taps: `eagle3.target_layers` (or the older `eagle3.extract_layers`) are layer *inputs*
//! already (vLLM's aux hidden-state ids, default `[2, n/2, n − 3]`), i.e. [`crate::Taps`]
//! indices.

use std::sync::Arc;

use specula_gguf::Gguf;
use specula_tensor::{AttentionParams, Backend, KvShape, Mask, RopeConfig, RopeKind};

use crate::dflash::{read_d2t, scatter_d2t, usize_array};
use crate::{
    AttnHparams, Linear, Loader, Model, ModelError, Result, count, get_usize, int_bound, mul,
    opt_usize,
};

/// Hyperparameters of an EAGLE-3 head (`eagle3.*` keys).
#[derive(Clone, Debug, PartialEq)]
pub struct Eagle3Hparams {
    /// Hidden size of the head.
    pub n_embd: usize,
    /// Feed-forward size.
    pub n_ff: usize,
    /// Query heads.
    pub n_head: usize,
    /// K/V heads.
    pub n_head_kv: usize,
    /// Values per head.
    pub head_dim: usize,
    /// Rotated dimensions per head.
    pub n_rot: usize,
    /// RoPE θ.
    pub rope_freq_base: f32,
    /// RoPE linear scale.
    pub rope_freq_scale: f32,
    /// RMSNorm epsilon.
    pub rms_eps: f32,
    /// Target taps, layer-input convention.
    pub target_layers: Vec<usize>,
    /// Hidden size of the target (`eagle3.target_hidden_size`).
    pub target_hidden_size: usize,
    /// The residual is `hidden_norm(g)` instead of `g` (RedHat speculators format).
    pub norm_before_residual: bool,
    /// RMSNorm over the concatenated features before `fc` (EAGLE 3.1).
    pub norm_before_fc: bool,
}

impl Eagle3Hparams {
    /// Reads the hyperparameters of an `eagle3` GGUF.
    ///
    /// # Errors
    /// Another architecture, a missing or invalid key.
    pub fn from_file(file: &Gguf) -> Result<Self> {
        let md = file.metadata();
        let arch = md
            .get_str("general.architecture")
            .ok_or_else(|| ModelError::MissingKey {
                key: "general.architecture".into(),
            })?;
        if arch != "eagle3" {
            return Err(ModelError::UnsupportedArch {
                arch: format!("{arch} (an EAGLE-3 head has general.architecture = eagle3)"),
            });
        }
        let k = |s: &str| format!("eagle3.{s}");
        let bad = |key: String, detail: String| ModelError::BadValue { key, detail };
        let n_layer = get_usize(md, &k("block_count"))?;
        if n_layer != 1 {
            return Err(bad(
                k("block_count"),
                format!("{n_layer}: an EAGLE-3 head has exactly one decoder layer"),
            ));
        }
        let at = AttnHparams::read(md, "eagle3", 1e-5)?;
        // One head size for K and V, as llama.cpp's EAGLE-3 graph.
        if opt_usize(md, &k("attention.value_length"))?.is_some() && at.head_dim_v != at.head_dim_k
        {
            return Err(int_bound(
                &k("attention.value_length"),
                at.head_dim_v,
                format!(
                    "the key length {} (an EAGLE-3 head has one head size)",
                    at.head_dim_k
                ),
            ));
        }
        let target_layers = match usize_array(file, &k("target_layers"))? {
            Some(t) => t,
            None => {
                usize_array(file, &k("extract_layers"))?.ok_or_else(|| ModelError::MissingKey {
                    key: k("target_layers"),
                })?
            }
        };
        if target_layers.is_empty() {
            return Err(bad(k("target_layers"), "no target layers".into()));
        }
        let flag = |key: &str| {
            md.get(&k(key))
                .and_then(specula_gguf::Value::as_bool)
                .unwrap_or(false)
        };
        Ok(Self {
            n_embd: at.n_embd,
            n_ff: count(md, &k("feed_forward_length"))?,
            n_head: at.n_head,
            n_head_kv: at.n_head_kv,
            head_dim: at.head_dim_k,
            n_rot: at.n_rot,
            rope_freq_base: at.rope_freq_base,
            rope_freq_scale: at.rope_freq_scale,
            rms_eps: at.rms_eps,
            target_layers,
            target_hidden_size: get_usize(md, &k("target_hidden_size"))?,
            norm_before_residual: flag("norm_before_residual"),
            norm_before_fc: flag("norm_before_fc"),
        })
    }
}

/// Reusable buffers.
#[derive(Debug)]
pub struct Eagle3Scratch<B: Backend> {
    feats: B::Tensor,
    fnorm: B::Tensor,
    g: B::Tensor,
    emb: B::Tensor,
    enorm: B::Tensor,
    gnorm: B::Tensor,
    cat: B::Tensor,
    /// The decoder's `g` rows.
    gt: B::Tensor,
    q: B::Tensor,
    k: B::Tensor,
    v: B::Tensor,
    attn: B::Tensor,
    x: B::Tensor,
    cur: B::Tensor,
    gate: B::Tensor,
    up: B::Tensor,
    act: B::Tensor,
    proj: B::Tensor,
    norm: B::Tensor,
    logits: B::Tensor,
    /// The index tensors of a pass (built once, read by its ops): the rows it copies, its
    /// tokens, positions (also its cells: cell = position) and the cells its queries read.
    rows: B::Index,
    tokens: B::Index,
    pos: B::Index,
    kv_pos: B::Index,
    /// Where an index is staged on the host.
    stage: Vec<u32>,
    h1: Vec<f32>,
    /// Logits of the last decode (target vocabulary).
    pub logits_host: Vec<f32>,
    /// Prenorm states of the last decode.
    pub prenorm: Vec<f32>,
    full: Vec<f32>,
}

impl<B: Backend> Eagle3Scratch<B> {
    /// The `g` rows of the last [`Eagle3::encode_rows`], on the backend.
    #[must_use]
    pub fn g_rows(&self) -> &B::Tensor {
        &self.g
    }

    /// The prenorm states of the last decode, on the backend: the next chain step's `g`.
    #[must_use]
    pub fn prenorm_rows(&self) -> &B::Tensor {
        &self.x
    }
}

/// A loaded EAGLE-3 head.
pub struct Eagle3<B: Backend> {
    hp: Eagle3Hparams,
    fc: Linear<B::Weight>,
    fc_norm: Option<B::Weight>,
    attn_norm: B::Weight,
    hidden_norm: B::Weight,
    wq: Linear<B::Weight>,
    wk: Linear<B::Weight>,
    wv: Linear<B::Weight>,
    wo: Linear<B::Weight>,
    ffn_norm: B::Weight,
    ffn_gate: Linear<B::Weight>,
    ffn_up: Linear<B::Weight>,
    ffn_down: Linear<B::Weight>,
    output_norm: B::Weight,
    tok_embd: Arc<B::Weight>,
    output: Linear<Arc<B::Weight>>,
    d2t: Option<Vec<u32>>,
    n_vocab: usize,
}

impl<B: Backend> std::fmt::Debug for Eagle3<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Eagle3")
            .field("hparams", &self.hp)
            .field("d2t", &self.d2t.as_ref().map(Vec::len))
            .finish_non_exhaustive()
    }
}

impl<B: Backend> Eagle3<B> {
    /// Loads an EAGLE-3 head for `target` (its embedding and head borrowed when absent).
    ///
    /// # Errors
    /// Loading errors: keys, tensors, shapes, taps past the target, a target hidden size that
    /// is not the target's, a borrowed embedding or head of another width.
    pub fn load(backend: &B, file: Arc<Gguf>, target: &Model<B>) -> Result<Self> {
        let hp = Eagle3Hparams::from_file(&file)?;
        let thp = target.hparams();
        if hp.target_hidden_size != thp.n_embd {
            return Err(ModelError::BadValue {
                key: "eagle3.target_hidden_size".into(),
                detail: format!(
                    "{} but the target's is {}",
                    hp.target_hidden_size, thp.n_embd
                ),
            });
        }
        if let Some(&t) = hp.target_layers.iter().find(|&&t| t > thp.n_layer) {
            return Err(ModelError::BadValue {
                key: "eagle3.target_layers".into(),
                detail: format!("tap {t} is past the target's {} layers", thp.n_layer),
            });
        }
        if file.tensor("blk.0.rope_freqs.weight").is_some()
            || file.tensor("rope_freqs.weight").is_some()
        {
            return Err(ModelError::UnsupportedArch {
                arch: "eagle3 with `rope_freqs` (llama3 rope scaling, not supported)".into(),
            });
        }
        let l = Loader::new(backend, &file);
        crate::check_layer_tensors(&file, "eagle3.block_count", 1)?;
        let (e, f, hd) = (hp.n_embd, hp.n_ff, hp.head_dim);
        let (qd, kd) = (
            mul("eagle3.attention.head_count", hp.n_head, hd)?,
            mul("eagle3.attention.head_count_kv", hp.n_head_kv, hd)?,
        );
        let e2 = mul("eagle3.embedding_length", e, 2)?;
        let n_vocab = thp.n_vocab;
        let d2t = read_d2t(&file, n_vocab)?;
        let n_vocab_draft = d2t.as_ref().map_or(n_vocab, Vec::len);
        let n_in = mul("eagle3.target_layers", hp.target_layers.len(), thp.n_embd)?;
        let tok_embd = match l.get("token_embd.weight", &[e, n_vocab])? {
            Some(w) => Arc::new(w),
            None if e == thp.n_embd => target.token_embedding(),
            None => {
                return Err(ModelError::MissingTensor {
                    name: format!(
                        "token_embd.weight (the head is {e} wide, the target's embedding {})",
                        thp.n_embd
                    ),
                });
            }
        };
        let output = match l.linear_opt("output", &[e, n_vocab_draft])? {
            Some(o) => Linear {
                w: Arc::new(o.w),
                scale: o.scale,
            },
            None if d2t.is_none() && e == thp.n_embd => target.output_linear(),
            None => {
                return Err(ModelError::MissingTensor {
                    name: "output.weight".into(),
                });
            }
        };
        let n = |s: &str| format!("blk.0.{s}");
        let net = Self {
            fc: l.linear("fc", &[n_in, e])?,
            fc_norm: if hp.norm_before_fc {
                Some(l.req("enc.output_norm.weight", &[n_in])?)
            } else {
                None
            },
            attn_norm: l.req(&n("attn_norm.weight"), &[e])?,
            hidden_norm: l.req(&n("attn_norm_2.weight"), &[e])?,
            wq: l.linear(&n("attn_q"), &[e2, qd])?,
            wk: l.linear(&n("attn_k"), &[e2, kd])?,
            wv: l.linear(&n("attn_v"), &[e2, kd])?,
            wo: l.linear(&n("attn_output"), &[qd, e])?,
            ffn_norm: l.req(&n("ffn_norm.weight"), &[e])?,
            ffn_gate: l.linear(&n("ffn_gate"), &[e, f])?,
            ffn_up: l.linear(&n("ffn_up"), &[e, f])?,
            ffn_down: l.linear(&n("ffn_down"), &[f, e])?,
            output_norm: l.req("output_norm.weight", &[e])?,
            tok_embd,
            output,
            d2t,
            n_vocab,
            hp,
        };
        l.scales.check(&file)?;
        Ok(net)
    }

    /// The hyperparameters.
    #[must_use]
    pub fn hparams(&self) -> &Eagle3Hparams {
        &self.hp
    }

    /// Logit row width (the target vocabulary).
    #[must_use]
    pub fn n_vocab(&self) -> usize {
        self.n_vocab
    }

    /// Width of one raw feature row.
    #[must_use]
    pub fn feature_width(&self) -> usize {
        self.hp.target_layers.len() * self.hp.target_hidden_size
    }

    /// The shape of a head cache of `n_ctx` cells (one layer).
    #[must_use]
    pub fn kv_shape(
        &self,
        n_ctx: usize,
        k_type: specula_quant::QType,
        v_type: specula_quant::QType,
    ) -> KvShape {
        KvShape::uniform(
            1,
            n_ctx,
            self.hp.n_head_kv,
            self.hp.head_dim,
            k_type,
            v_type,
        )
    }

    /// Fresh buffers.
    #[must_use]
    pub fn scratch(&self, be: &B) -> Eagle3Scratch<B> {
        let z = || be.zeros(0, 0);
        Eagle3Scratch {
            feats: z(),
            fnorm: z(),
            g: z(),
            emb: z(),
            enorm: z(),
            gnorm: z(),
            cat: z(),
            gt: z(),
            q: z(),
            k: z(),
            v: z(),
            attn: z(),
            x: z(),
            cur: z(),
            gate: z(),
            up: z(),
            act: z(),
            proj: z(),
            norm: z(),
            logits: z(),
            rows: be.index(&[]),
            tokens: be.index(&[]),
            pos: be.index(&[]),
            kv_pos: be.index(&[]),
            stage: Vec::new(),
            h1: Vec::new(),
            logits_host: Vec::new(),
            prenorm: Vec::new(),
            full: Vec::new(),
        }
    }

    /// `g = fc(features)` for `n` rows (row-major `[n, feature_width]`), appended to `out`.
    ///
    /// # Errors
    /// A feature buffer of the wrong size.
    pub fn encode(
        &self,
        be: &B,
        s: &mut Eagle3Scratch<B>,
        features: &[f32],
        out: &mut Vec<f32>,
    ) -> Result<()> {
        let w = self.feature_width();
        if !features.len().is_multiple_of(w) {
            return Err(ModelError::Features {
                what: "EAGLE-3 encoder",
                got: features.len(),
                rows: features.len().div_ceil(w),
                width: w,
            });
        }
        let n = features.len() / w;
        if n == 0 {
            return Ok(());
        }
        let t = be.from_host(n, w, features);
        self.encode_rows(be, s, &t, 0..n)?;
        be.to_host(&s.g, &mut s.h1);
        out.extend_from_slice(&s.h1);
        Ok(())
    }

    /// [`Eagle3::encode`] of rows `rows` of `features`, a backend tensor (`[_,
    /// feature_width]`, the target's taps as [`crate::TapSink::Device`] writes them),
    /// sanitized there; the `g` rows are left in [`Eagle3Scratch::g_rows`] — nothing goes through
    /// the host.
    ///
    /// # Errors
    /// A tensor of the wrong width or too few rows.
    pub fn encode_rows(
        &self,
        be: &B,
        s: &mut Eagle3Scratch<B>,
        features: &B::Tensor,
        rows: std::ops::Range<usize>,
    ) -> Result<()> {
        let w = self.feature_width();
        let (t_rows, t_cols) = be.shape(features);
        if t_cols != w || rows.end > t_rows {
            return Err(ModelError::Features {
                what: "EAGLE-3 encoder",
                got: rows.len().min(t_rows) * t_cols,
                rows: rows.len(),
                width: w,
            });
        }
        let at = crate::index::index_of;
        crate::index::stage(be, &mut s.rows, &mut s.stage, rows.map(at));
        be.copy_rows(features, &s.rows, &mut s.feats);
        be.clamp_finite(&mut s.feats, crate::dflash::F16_MAX);
        self.encode_feats(be, s);
        Ok(())
    }

    /// `s.g = fc(fc_norm(s.feats))`.
    fn encode_feats(&self, be: &B, s: &mut Eagle3Scratch<B>) {
        if let Some(nw) = &self.fc_norm {
            be.rms_norm(&s.feats, Some(nw), self.hp.rms_eps, &mut s.fnorm);
            self.fc.matmul(be, &s.fnorm, &mut s.g);
        } else {
            self.fc.matmul(be, &s.feats, &mut s.g);
        }
    }

    /// Runs decoder rows `(tokens[i], g[i])` at positions `pos[i]` (cell = position), causal
    /// over the cache, and leaves in `s.prenorm` their prenorm states and, when `logits`, in
    /// `s.logits_host` their logits over the target vocabulary (−∞ outside `d2t`).
    ///
    /// # Errors
    /// Sizes that do not fit, positions past the cache.
    #[allow(
        clippy::too_many_arguments,
        reason = "the decoder's inputs are all needed"
    )]
    pub fn decode(
        &self,
        be: &B,
        kv: &mut B::Kv,
        n_ctx: usize,
        s: &mut Eagle3Scratch<B>,
        tokens: &[u32],
        g: &[f32],
        pos: &[u32],
        logits: bool,
    ) -> Result<()> {
        let (n, e) = (tokens.len(), self.hp.n_embd);
        if n == 0 || pos.len() != n || g.len() != n * e {
            return Err(ModelError::DecoderRows {
                what: "EAGLE-3 decoder",
                tokens: n,
                positions: pos.len(),
                values: g.len(),
                width: e,
            });
        }
        s.gt = be.from_host(n, e, g);
        self.decode_gt(be, kv, n_ctx, s, tokens, pos)?;
        be.to_host(&s.x, &mut s.prenorm);
        if !logits {
            return Ok(());
        }
        self.head(be, s);
        be.to_host(&s.logits, &mut s.logits_host);
        if let Some(d2t) = &self.d2t {
            scatter_d2t(d2t, &s.logits_host, self.n_vocab, &mut s.full);
            std::mem::swap(&mut s.full, &mut s.logits_host);
        }
        Ok(())
    }

    /// [`Eagle3::decode`] with `g` on the backend: rows `g_rows` of `g` (`[_, n_embd]`).
    /// The prenorm states stay in [`Eagle3Scratch::prenorm_rows`]; with `top1`, each row's
    /// top-1 token (a target id, through `d2t`) and its probability go to `ids` and `probs`
    /// ([`Backend::top1_rows`]) — nothing else reaches the host.
    ///
    /// # Errors
    /// As [`Eagle3::decode`].
    #[allow(
        clippy::too_many_arguments,
        reason = "the decoder's inputs and its read-out"
    )]
    pub fn decode_rows(
        &self,
        be: &B,
        kv: &mut B::Kv,
        n_ctx: usize,
        s: &mut Eagle3Scratch<B>,
        tokens: &[u32],
        g: &B::Tensor,
        g_rows: &[usize],
        pos: &[u32],
        top1: Option<(&mut Vec<u32>, &mut Vec<f32>)>,
    ) -> Result<()> {
        let (n, e) = (tokens.len(), self.hp.n_embd);
        let (t_rows, t_cols) = be.shape(g);
        if n == 0
            || pos.len() != n
            || g_rows.len() != n
            || t_cols != e
            || g_rows.iter().any(|&r| r >= t_rows)
        {
            return Err(ModelError::DecoderRows {
                what: "EAGLE-3 decoder",
                tokens: n,
                positions: pos.len(),
                values: g_rows.len() * t_cols,
                width: e,
            });
        }
        let at = crate::index::index_of;
        crate::index::stage(be, &mut s.rows, &mut s.stage, g_rows.iter().map(|&r| at(r)));
        be.copy_rows(g, &s.rows, &mut s.gt);
        self.decode_gt(be, kv, n_ctx, s, tokens, pos)?;
        if let Some((ids, probs)) = top1 {
            self.head(be, s);
            be.top1_rows(&s.logits, ids, probs);
            if let Some(d2t) = &self.d2t {
                for id in ids.iter_mut() {
                    if let Some(&t) = d2t.get(*id as usize) {
                        *id = t;
                    }
                }
            }
        }
        Ok(())
    }

    /// The output norm and head over the prenorm rows `s.x`: draft-vocabulary logits in
    /// `s.logits`.
    fn head(&self, be: &B, s: &mut Eagle3Scratch<B>) {
        be.rms_norm(&s.x, Some(&self.output_norm), self.hp.rms_eps, &mut s.norm);
        self.output.matmul(be, &s.norm, &mut s.logits);
    }

    /// The decoder over the `g` rows in `s.gt`, leaving the prenorm states in `s.x`.
    fn decode_gt(
        &self,
        be: &B,
        kv: &mut B::Kv,
        n_ctx: usize,
        s: &mut Eagle3Scratch<B>,
        tokens: &[u32],
        pos: &[u32],
    ) -> Result<()> {
        let hp = &self.hp;
        let (n, e) = (tokens.len(), hp.n_embd);
        let max = pos.iter().max().map_or(0, |&p| p as usize);
        if max >= n_ctx {
            return Err(ModelError::PastCache {
                what: "EAGLE-3 decoder",
                rows: n,
                pos: max,
                n_ctx,
            });
        }
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= self.n_vocab) {
            return Err(ModelError::TokenPastVocab {
                what: "EAGLE-3 decoder",
                id: t,
                n_vocab: self.n_vocab,
            });
        }
        be.set_index(&mut s.pos, pos);
        be.set_index(&mut s.tokens, tokens);
        let at = crate::index::index_of;
        crate::index::stage(be, &mut s.kv_pos, &mut s.stage, (0..=max).map(at));
        let mut rope = RopeConfig::new(RopeKind::Normal, hp.n_rot, hp.rope_freq_base);
        rope.freq_scale = hp.rope_freq_scale;

        be.get_rows(&self.tok_embd, &s.tokens, &mut s.emb);
        be.rms_norm(&s.emb, Some(&self.attn_norm), hp.rms_eps, &mut s.enorm);
        be.rms_norm(&s.gt, Some(&self.hidden_norm), hp.rms_eps, &mut s.gnorm);
        // [embed_norm | g_norm], 2·E wide, put together on the backend.
        be.resize(&mut s.cat, n, 2 * e);
        be.put_cols(&s.enorm, 0, &mut s.cat);
        be.put_cols(&s.gnorm, e, &mut s.cat);
        self.wq.matmul(be, &s.cat, &mut s.q);
        self.wk.matmul(be, &s.cat, &mut s.k);
        self.wv.matmul(be, &s.cat, &mut s.v);
        be.rope(&mut s.q, hp.head_dim, &s.pos, &rope);
        be.rope(&mut s.k, hp.head_dim, &s.pos, &rope);
        be.kv_write(kv, 0, &s.pos, &s.k, &s.v);
        #[allow(clippy::cast_precision_loss, reason = "head dims are small")]
        let scale = 1.0 / (hp.head_dim as f32).sqrt();
        be.attention(
            &s.q,
            kv,
            &AttentionParams {
                layer: 0,
                n_head: hp.n_head,
                q_pos: &s.pos,
                kv_pos: &s.kv_pos,
                scale,
                mask: Mask::Causal,
                softcap: None,
            },
            &mut s.attn,
        );
        self.wo.matmul(be, &s.attn, &mut s.x);
        if hp.norm_before_residual {
            be.add(&mut s.x, &s.gnorm);
        } else {
            be.add(&mut s.x, &s.gt);
        }
        be.rms_norm(&s.x, Some(&self.ffn_norm), hp.rms_eps, &mut s.cur);
        self.ffn_gate.matmul(be, &s.cur, &mut s.gate);
        self.ffn_up.matmul(be, &s.cur, &mut s.up);
        be.swiglu(&s.gate, &s.up, &mut s.act);
        self.ffn_down.matmul(be, &s.act, &mut s.proj);
        be.add(&mut s.x, &s.proj);
        Ok(())
    }
}
