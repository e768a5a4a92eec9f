//! The KV cache and attention over it.
//!
//! [`CpuKv`] keeps, per layer, K and V rows (`n_kv_head · head_dim` values per cell) in f32 or
//! f16; compact types (q8_0, turbo) are not stored by this backend yet.
//!
//! Attention is computed per (query row, query head), one task each, split statically over the
//! threads. A task makes two passes over the cells `0..kv_len` in cell order: the first computes
//! each visible key's score (`q·k`, times `scale`, then the optional soft cap `c·tanh(s/c)`)
//! and the maximum; the second turns the scores into weights `e^(s − max)` and adds them to the
//! denominator (in f64); then the output row is `Σ weight · v` (in f32, cell order) scaled by
//! `1/denominator`. The inner loops (`q·k`, the weighted sum of value rows) are in [`simd`],
//! one instruction set per backend. Masked cells are skipped outright, so the result of a query row
//! depends only on its position, its values and the cells it can see — not on the rest of the
//! batch, nor on cells past it. A query that sees no cell gets zeros.

use specula_quant::QType;
use specula_quant::blocks::Half;
use specula_tensor::{AttentionParams, KvShape, Mask, Result, TensorError};

use crate::CpuBackend;
use crate::pool::Disjoint;

pub(crate) mod simd;
use crate::tensor::CpuTensor;

/// The K or V rows of one layer.
#[derive(Clone, Debug)]
enum Plane {
    F32(Vec<f32>),
    F16(Vec<Half>),
}

impl Plane {
    fn new(ty: QType, len: usize, what: &str) -> Result<Self> {
        match ty {
            QType::F32 => Ok(Self::F32(vec![0.0; len])),
            QType::F16 => Ok(Self::F16(vec![Half::default(); len])),
            _ => Err(TensorError::Kv {
                detail: format!(
                    "{what} type {ty} is not supported by the cpu backend (it stores f32 and f16)"
                ),
            }),
        }
    }

    /// Writes `src` at `offset`.
    fn write(&mut self, offset: usize, src: &[f32]) {
        match self {
            Self::F32(d) => d[offset..offset + src.len()].copy_from_slice(src),
            Self::F16(d) => {
                for (d, &s) in d[offset..offset + src.len()].iter_mut().zip(src) {
                    *d = Half::from_f32(s);
                }
            }
        }
    }

    /// Reads `out.len()` values at `offset` as f32.
    fn read(&self, offset: usize, out: &mut [f32]) {
        match self {
            Self::F32(d) => out.copy_from_slice(&d[offset..offset + out.len()]),
            Self::F16(d) => {
                let n = out.len();
                for (o, h) in out.iter_mut().zip(&d[offset..offset + n]) {
                    *o = h.to_f32();
                }
            }
        }
    }
}

/// The K and V planes of one layer.
#[derive(Clone, Debug)]
struct Layer {
    k: Plane,
    v: Plane,
}

/// The key/value cache of all layers, `n_ctx` cells each.
#[derive(Clone, Debug)]
pub struct CpuKv {
    shape: KvShape,
    layers: Vec<Layer>,
}

impl CpuKv {
    pub(crate) fn new(shape: KvShape) -> Result<Self> {
        let k_len = shape.n_ctx * shape.n_kv_head * shape.head_dim_k;
        let v_len = shape.n_ctx * shape.n_kv_head * shape.head_dim_v;
        let layers = (0..shape.n_layer)
            .map(|_| {
                Ok(Layer {
                    k: Plane::new(shape.k_type, k_len, "K cache")?,
                    v: Plane::new(shape.v_type, v_len, "V cache")?,
                })
            })
            .collect::<Result<_>>()?;
        Ok(Self { shape, layers })
    }

    /// The shape the cache was made with.
    #[must_use]
    pub fn shape(&self) -> KvShape {
        self.shape
    }

    fn k_width(&self) -> usize {
        self.shape.n_kv_head * self.shape.head_dim_k
    }

    fn v_width(&self) -> usize {
        self.shape.n_kv_head * self.shape.head_dim_v
    }

    /// The K row (`n_kv_head · head_dim_k` values) stored in `cell` of `layer`, as f32.
    ///
    /// # Panics
    /// If `layer` or `cell` is out of range.
    #[must_use]
    pub fn k_row(&self, layer: usize, cell: usize) -> Vec<f32> {
        let w = self.k_width();
        let mut out = vec![0.0; w];
        self.layers[layer].k.read(cell * w, &mut out);
        out
    }

    /// The V row stored in `cell` of `layer`, as f32.
    ///
    /// # Panics
    /// If `layer` or `cell` is out of range.
    #[must_use]
    pub fn v_row(&self, layer: usize, cell: usize) -> Vec<f32> {
        let w = self.v_width();
        let mut out = vec![0.0; w];
        self.layers[layer].v.read(cell * w, &mut out);
        out
    }
}

/// Writes K and V rows of `layer` into `cells`.
pub(crate) fn kv_write(
    kv: &mut CpuKv,
    layer: usize,
    cells: &[usize],
    k: &CpuTensor,
    v: &CpuTensor,
) {
    let (kw, vw, n_ctx) = (kv.k_width(), kv.v_width(), kv.shape.n_ctx);
    assert!(
        layer < kv.layers.len(),
        "kv_write: layer {layer} of a {}-layer cache",
        kv.layers.len()
    );
    assert_eq!(
        (k.rows(), k.cols()),
        (cells.len(), kw),
        "kv_write: K must be [{}, {kw}]",
        cells.len()
    );
    assert_eq!(
        (v.rows(), v.cols()),
        (cells.len(), vw),
        "kv_write: V must be [{}, {vw}]",
        cells.len()
    );
    let l = &mut kv.layers[layer];
    for (t, &cell) in cells.iter().enumerate() {
        assert!(
            cell < n_ctx,
            "kv_write: cell {cell} of a {n_ctx}-cell cache"
        );
        l.k.write(cell * kw, k.row(t));
        l.v.write(cell * vw, v.row(t));
    }
}

/// Whether a query at `qp` sees a key at `kp`.
#[inline]
fn visible(mask: Mask, qp: u32, kp: u32) -> bool {
    match mask {
        Mask::Causal => kp <= qp,
        Mask::SlidingWindow(w) => kp <= qp && usize::try_from(qp - kp).is_ok_and(|d| d < w),
        Mask::None => true,
    }
}

/// Attention of every query head of every row of `q` over the cells of one layer.
pub(crate) fn attention(
    be: &CpuBackend,
    q: &CpuTensor,
    kv: &CpuKv,
    p: &AttentionParams<'_>,
    out: &mut CpuTensor,
) {
    let s = kv.shape;
    let (hd_k, hd_v, n_kv_head, n_head) = (s.head_dim_k, s.head_dim_v, s.n_kv_head, p.n_head);
    let n_q = q.rows();
    let kv_len = p.kv_pos.len();
    assert!(
        p.layer < kv.layers.len(),
        "attention: layer {} of a {}-layer cache",
        p.layer,
        kv.layers.len()
    );
    assert!(
        n_kv_head > 0 && n_head.is_multiple_of(n_kv_head),
        "attention: {n_head} query heads are not a multiple of {n_kv_head} K/V heads"
    );
    assert_eq!(
        q.cols(),
        n_head * hd_k,
        "attention: q rows must have n_head · head_dim_k = {} values",
        n_head * hd_k
    );
    assert_eq!(p.q_pos.len(), n_q, "attention: one position per query row");
    assert!(
        kv_len <= s.n_ctx,
        "attention: {kv_len} cells in a {}-cell cache",
        s.n_ctx
    );
    out.resize(n_q, n_head * hd_v);
    let group = n_head / n_kv_head;
    let layer = &kv.layers[p.layer];
    let (kw, vw) = (kv.k_width(), kv.v_width());
    let kernels = be.attn_kernels();
    let n_tasks = n_q * n_head;
    let nth = be.n_threads();
    let dst = Disjoint::new(out.as_mut_slice());

    let task = |i: usize, o: &mut [f32], scores: &mut [f32]| {
        let (r, h) = (i / n_head, i % n_head);
        let kvh = h / group;
        let qh = &q.row(r)[h * hd_k..(h + 1) * hd_k];
        let qp = p.q_pos[r];
        let mut max = f32::NEG_INFINITY;
        let mut any = false;
        for (j, sc) in scores.iter_mut().enumerate() {
            if !visible(p.mask, qp, p.kv_pos[j]) {
                *sc = f32::NEG_INFINITY;
                continue;
            }
            let off = j * kw + kvh * hd_k;
            let dot = match &layer.k {
                Plane::F32(k) => (kernels.dot_f32)(qh, &k[off..off + hd_k]),
                Plane::F16(k) => (kernels.dot_f16)(qh, &k[off..off + hd_k]),
            };
            let mut x = dot * p.scale;
            if let Some(c) = p.softcap {
                x = c * (x / c).tanh();
            }
            *sc = x;
            any = true;
            max = max.max(x);
        }
        if !any {
            o.fill(0.0);
            return;
        }
        // Scores become weights e^(s − max) (0 for masked cells), summed in f64 in cell order.
        let mut sum = 0.0f64;
        for sc in scores.iter_mut() {
            let e = if *sc == f32::NEG_INFINITY {
                0.0
            } else {
                (*sc - max).exp()
            };
            sum += f64::from(e);
            *sc = e;
        }
        let off = kvh * hd_v;
        match &layer.v {
            Plane::F32(v) => (kernels.wsum_f32)(o, scores, v, off, vw),
            Plane::F16(v) => (kernels.wsum_f16)(o, scores, v, off, vw),
        }
        #[allow(
            clippy::cast_possible_truncation,
            reason = "the f32 normaliser of the f64 sum, as ggml's soft_max"
        )]
        let inv = (1.0 / sum) as f32;
        for o in o.iter_mut() {
            *o *= inv;
        }
    };

    let work = |t: usize| {
        // Every nth task: under a causal mask later rows see more cells, so contiguous runs
        // of rows would leave the last thread the most work.
        let mine = (t..n_tasks).step_by(nth);
        crate::scratch::with_f32(kv_len, |scores| {
            for i in mine {
                // SAFETY: task i writes only output chunk i (`hd_v` values: query row i / n_head,
                // head i % n_head), and each task belongs to exactly one thread (i mod nth).
                let o = unsafe { dst.slice(i * hd_v..(i + 1) * hd_v) };
                task(i, o, scores);
            }
        });
    };
    if nth == 1 || n_tasks < 2 {
        for t in 0..nth {
            work(t);
        }
    } else {
        be.pool().run(&work);
    }
}
