//! The KV cache and flash attention over it.
//!
//! [`CpuKv`] keeps, per layer, K and V as [`specula_kv::Plane`]s in any cache format of
//! [`specula_kv::CACHE_TYPES`], chosen independently for K and V; rows are quantized on write.
//!
//! **Attention** is a flash attention: for each query row and head, one pass over the cells
//! `0..kv_len` in tiles of [`TILE`] cells with an online softmax (running maximum `m`, running
//! sum `l`, output accumulator rescaled by `e^(m_old − m_new)` when the maximum grows), all in
//! f32. Keys are read straight from their format:
//!
//! - f32 / f16 / bf16 keys: `q·k` in f32 against the stored values;
//! - q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl keys: the query head is quantized once to the format's
//!   dot-product type (Q8_0 or Q8_1, as ggml-cpu does) and `q·k` is the block dot product of
//!   `specula-quant` (SIMD);
//! - turbo keys: the query head is taken to the stored domain once per call (padded and
//!   rotated forward by the cache's Walsh–Hadamard transform, [`specula_kv::turbo_query`]),
//!   then dotted with `centroid · norm` values decoded one tile at a time
//!   (`⟨q', k'⟩ = q · k̂`). A 64-value head stored in two stages (128 codes, coarse and
//!   fine) is read as its 64 values `y_i + β·y_{64+i}` (the first step of
//!   [`specula_kv::turbo_read`]) against `R₆₄q`, so scores and values run over 64
//!   dimensions, not 128; on AVX-512 such rows are decoded in registers by the tile loops.
//!
//! Block-format caches are stored under llama.cpp's Hadamard rotation
//! ([`specula_kv::Rotation::Hadamard`]): the query head is rotated the same way before it is
//! quantized for the dot product.
//!
//! Quantized planes store K and V minus a per-head offset fixed at the first write
//! ([`specula_kv::Plane::calibrate`]); the scores get `q·m` back and the output `m_v`, exactly.
//!
//! Values are decoded one tile at a time into f32 and accumulated as `acc += p·v`; with a
//! rotated V (turbo or Hadamard) the accumulator is in the rotated domain and is rotated back
//! once at the end, then cut to the model's head dim. Nothing decodes the whole cache.
//!
//! Work is split into tasks of (a block of query rows, one K/V head, some of the query heads
//! that share it) so that a decoded K/V tile serves every row and head of the task (GQA). A
//! query's result is computed by the same operations in the same order whatever task it lands
//! in — tiles are fixed in cell space, and masked cells are skipped — so it depends only on its
//! position, its values and the cells it can see: not on the rest of the batch, the thread
//! count or the split. A query that sees no cell gets zeros.

use std::cell::RefCell;

use specula_kv::{KvLayout, Plane, Rotation, hadamard, turbo_query, turbo_read, turbo_two_stage};
use specula_quant::blocks::{BlockTurbo2, BlockTurbo3, BlockTurbo4, QK_TURBO};
use specula_quant::dot::Kernels;
use specula_quant::{QType, turbo, wht};
use specula_tensor::{AttentionParams, KvShape, Mask, Result};

use crate::CpuBackend;
use crate::pool::{Disjoint, split};
use crate::recurrent::Recurrent;

pub mod expf;
pub(crate) mod simd;
mod tile;
use crate::tensor::CpuTensor;

/// Cells per tile of the key loop.
pub(crate) const TILE: usize = 32;
/// Cells per key chunk: the softmax state of a query is computed per chunk of cells
/// `[c·CHUNK, (c+1)·CHUNK)` and the chunks' states are merged in order (flash-decoding's
/// split-K). The chunk grid is fixed in cell space, so a query's result does not depend on the
/// cache length, the batch or how chunks are spread over threads.
pub(crate) const CHUNK: usize = 256;
/// Queries a score tile loop reads an f16 key row for (AVX2: one, each widening it again);
/// above this the tile's keys are widened once.
const SCORE_QUERIES: usize = 8;
/// Queries a value tile loop reads an f16 value row for.
const VALUE_QUERIES: usize = 8;
/// Query rows per task when a batch has many.
const ROWS_PER_TASK: usize = 16;

/// The K and V planes of one layer.
#[derive(Clone, Debug)]
struct Layer {
    k: Plane,
    v: Plane,
}

/// The key/value cache of all layers, `n_ctx` cells each — fewer in the sliding-window layers
/// of a shape with a ring ([`KvShape::layer_cells`]).
#[derive(Clone, Debug)]
pub struct CpuKv {
    layout: KvLayout,
    layers: Vec<Layer>,
    /// Per layer: the recurrent memory of a recurrent layer ([`KvShape::recurrent`]).
    recurrent: Vec<Option<Recurrent>>,
}

impl CpuKv {
    pub(crate) fn new(shape: KvShape) -> Result<Self> {
        let layout = KvLayout::new(&shape)?;
        let layers = layout
            .layers
            .iter()
            .enumerate()
            .map(|(il, l)| {
                let n_cells = shape.layer_cells(il);
                let h = shape.layer_heads(il);
                Ok(Layer {
                    k: Plane::new(
                        l.types.k,
                        n_cells,
                        h.n_kv_head,
                        h.head_dim_k,
                        l.k_dim,
                        l.k_rot,
                    )?,
                    v: Plane::new(
                        l.types.v,
                        n_cells,
                        h.n_kv_head,
                        h.head_dim_v,
                        l.v_dim,
                        l.v_rot,
                    )?,
                })
            })
            .collect::<Result<_, specula_kv::KvError>>()?;
        let recurrent = match &shape.recurrent {
            Some(r) => {
                if r.layers.len() != shape.n_layer {
                    return Err(specula_kv::KvError::Shape(format!(
                        "recurrent layer list of {} entries for {} layers",
                        r.layers.len(),
                        shape.n_layer
                    ))
                    .into());
                }
                r.layers
                    .iter()
                    .map(|l| l.map(|sh| Recurrent::new(sh, r.snapshots)))
                    .collect()
            }
            None => vec![None; shape.n_layer],
        };
        Ok(Self {
            layout,
            layers,
            recurrent,
        })
    }

    /// The recurrent memory of `layer`, or a panic naming the op.
    pub(crate) fn recurrent_mut(&mut self, layer: usize, op: &str) -> &mut Recurrent {
        match self.recurrent.get_mut(layer) {
            Some(Some(r)) => r,
            _ => panic!("{op}: layer {layer} of the cache is not recurrent"),
        }
    }

    /// Whether every recurrent layer can start a forward at `pos` (always true without
    /// recurrent layers).
    #[must_use]
    pub fn recurrent_holds(&self, pos: usize) -> bool {
        self.recurrent.iter().flatten().all(|r| r.holds(pos))
    }

    /// The shape the cache was made with.
    #[must_use]
    pub fn shape(&self) -> KvShape {
        self.layout.shape.clone()
    }

    /// Formats, stored widths and memory accounting.
    #[must_use]
    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    /// Appends cells `0..n` of every layer's K and V planes (`0..min(n, cells)` of a ring
    /// layer), layer by layer, K before V ([`specula_kv::Plane::export_prefix`]).
    ///
    /// # Errors
    /// When `n` is past the cache's context.
    pub(crate) fn export_prefix(
        &self,
        n: usize,
        out: &mut Vec<u8>,
    ) -> Result<(), specula_kv::KvError> {
        if n > self.layout.shape.n_ctx {
            return Err(specula_kv::KvError::Shape(format!(
                "exporting {n} positions of a {}-position cache",
                self.layout.shape.n_ctx
            )));
        }
        for l in &self.layers {
            l.k.export_prefix(n.min(l.k.n_cells()), out)?;
            l.v.export_prefix(n.min(l.v.n_cells()), out)?;
        }
        // A recurrent state is that of one position: the current one.
        for r in self.recurrent.iter().flatten() {
            let (seen, conv, ssm) = r.current();
            if seen != n {
                return Err(specula_kv::KvError::Shape(format!(
                    "exporting {n} positions of a recurrent layer whose state is that of {seen}"
                )));
            }
            for v in conv.iter().chain(ssm) {
                out.extend_from_slice(&v.to_le_bytes());
            }
        }
        Ok(())
    }

    /// Reads back what [`CpuKv::export_prefix`] wrote for `n` positions (all of `bytes`).
    ///
    /// # Errors
    /// When `bytes` is not the export of `n` positions of a cache of this shape.
    pub(crate) fn import_prefix(
        &mut self,
        n: usize,
        bytes: &[u8],
    ) -> Result<(), specula_kv::KvError> {
        if n > self.layout.shape.n_ctx {
            return Err(specula_kv::KvError::Shape(format!(
                "importing {n} positions into a {}-position cache",
                self.layout.shape.n_ctx
            )));
        }
        let mut off = 0;
        for l in &mut self.layers {
            let nk = n.min(l.k.n_cells());
            off += l.k.import_prefix(nk, &bytes[off..])?;
            let nv = n.min(l.v.n_cells());
            off += l.v.import_prefix(nv, &bytes[off..])?;
        }
        for r in self.recurrent.iter_mut().flatten() {
            let (nc, ns) = r.lens();
            let need = 4 * (nc + ns);
            let Some(b) = bytes.get(off..off + need) else {
                return Err(specula_kv::KvError::Shape(format!(
                    "{} bytes left for a recurrent state of {need}",
                    bytes.len().saturating_sub(off)
                )));
            };
            let vals: Vec<f32> = b
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            r.set_current(n, &vals[..nc], &vals[nc..]);
            off += need;
        }
        if off != bytes.len() {
            return Err(specula_kv::KvError::Shape(format!(
                "{} bytes past the saved cache's {off}",
                bytes.len() - off
            )));
        }
        Ok(())
    }

    /// The stored bytes of the K (`v = false`) or V plane of `layer`.
    ///
    /// # Panics
    /// If `layer` is out of range.
    #[must_use]
    pub fn plane_bytes(&self, layer: usize, v: bool) -> &[u8] {
        let l = &self.layers[layer];
        if v { l.v.bytes() } else { l.k.bytes() }
    }

    /// The K row (`n_kv_head · head_dim_k` values) stored in `cell` of `layer`, as attention
    /// reads it: dequantized, rotated back to the model's domain, padding folded, offset added.
    ///
    /// # Panics
    /// If `layer` or `cell` is out of range.
    #[must_use]
    pub fn k_row(&self, layer: usize, cell: usize) -> Vec<f32> {
        row_of(&self.layers[layer].k, cell)
    }

    /// The V row stored in `cell` of `layer`, as [`CpuKv::k_row`].
    ///
    /// # Panics
    /// If `layer` or `cell` is out of range.
    #[must_use]
    pub fn v_row(&self, layer: usize, cell: usize) -> Vec<f32> {
        row_of(&self.layers[layer].v, cell)
    }
}

fn row_of(p: &Plane, cell: usize) -> Vec<f32> {
    let (n_head, hd, dim) = (p.n_head(), p.head_dim(), p.dim());
    let mut out = Vec::with_capacity(n_head * hd);
    let mut buf = vec![0.0; dim];
    for h in 0..n_head {
        decode_head(p.ty(), p.head(cell, h), &mut buf);
        match p.rotation() {
            Rotation::Turbo => turbo_read(p.ty(), &mut buf, hd),
            Rotation::Hadamard(n) => hadamard(&mut buf, n),
            Rotation::None => {}
        }
        if let Some(c) = p.center(h) {
            for (b, m) in buf.iter_mut().zip(c) {
                *b += m;
            }
        }
        out.extend_from_slice(&buf[..hd]);
    }
    out
}

/// Decodes one stored head into f32 (turbo: `centroid · norm`, rotated domain), with table
/// lookups for the turbo types and the reference dequantizers for the rest. Gives the bits of
/// [`specula_quant::dequantize_row`].
pub(crate) fn decode_head(ty: QType, src: &[u8], out: &mut [f32]) {
    match ty {
        QType::F32 => {
            for (o, c) in out.iter_mut().zip(src.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        QType::Turbo4 => {
            let lut = turbo4_lut();
            for (b, o) in bytemuck::cast_slice::<u8, BlockTurbo4>(src)
                .iter()
                .zip(out.chunks_exact_mut(QK_TURBO))
            {
                let n = b.norm.to_f32();
                for (&q, o) in b.qs.iter().zip(o.chunks_exact_mut(2)) {
                    let [a, c] = lut[usize::from(q)];
                    o[0] = a * n;
                    o[1] = c * n;
                }
            }
        }
        QType::Turbo2 => {
            for (b, o) in bytemuck::cast_slice::<u8, BlockTurbo2>(src)
                .iter()
                .zip(out.chunks_exact_mut(QK_TURBO))
            {
                let n = b.norm.to_f32();
                for (&q, o) in b.qs.iter().zip(o.chunks_exact_mut(4)) {
                    for (k, o) in o.iter_mut().enumerate() {
                        *o = turbo::CENTROIDS_2[usize::from((q >> (2 * k)) & 3)] * n;
                    }
                }
            }
        }
        QType::Turbo3 => {
            for (b, o) in bytemuck::cast_slice::<u8, BlockTurbo3>(src)
                .iter()
                .zip(out.chunks_exact_mut(QK_TURBO))
            {
                let n = b.norm.to_f32();
                for (g, o) in o.chunks_exact_mut(8).enumerate() {
                    let (lo, hi) = (
                        u16::from(b.qs[2 * g]) | (u16::from(b.qs[2 * g + 1]) << 8),
                        b.signs[g],
                    );
                    for (k, o) in o.iter_mut().enumerate() {
                        let c = ((lo >> (2 * k)) & 3) as u8 | (((hi >> k) & 1) << 2);
                        *o = turbo::CENTROIDS_3[usize::from(c)] * n;
                    }
                }
            }
        }
        _ => {
            if let Err(e) = specula_quant::dequantize_row(ty, src, out) {
                panic!("attention: a stored {ty} head does not decode: {e}");
            }
        }
    }
}

/// The two centroids of every turbo4 byte (low nibble first).
fn turbo4_lut() -> &'static [[f32; 2]; 256] {
    static LUT: std::sync::OnceLock<[[f32; 2]; 256]> = std::sync::OnceLock::new();
    LUT.get_or_init(|| {
        std::array::from_fn(|b| [turbo::CENTROIDS_4[b & 15], turbo::CENTROIDS_4[b >> 4]])
    })
}

/// One row to encode: its index in the batch, whether it is V, and the cell's bytes.
type WriteItem<'a> = (usize, bool, Vec<&'a mut [u8]>);

/// Writes K and V rows of `layer` into `cells`.
pub(crate) fn kv_write(
    be: &CpuBackend,
    kv: &mut CpuKv,
    layer: usize,
    cells: &[usize],
    k: &CpuTensor,
    v: &CpuTensor,
) {
    assert_eq!(
        (k.rows(), v.rows()),
        (cells.len(), cells.len()),
        "kv_write: one K row and one V row per cell"
    );
    kv_write_rows(be, kv, layer, cells, k.as_slice(), v.as_slice());
}

/// [`kv_write`] of the rows `k` and `v` (one per cell, the layer's K and V widths).
pub(crate) fn kv_write_rows(
    be: &CpuBackend,
    kv: &mut CpuKv,
    layer: usize,
    cells: &[usize],
    k: &[f32],
    v: &[f32],
) {
    assert!(
        layer < kv.layers.len(),
        "kv_write: layer {layer} of a {}-layer cache",
        kv.layers.len()
    );
    let h = kv.layout.shape.layer_heads(layer);
    let (kw, vw) = (h.n_kv_head * h.head_dim_k, h.n_kv_head * h.head_dim_v);
    assert_eq!(
        k.len(),
        cells.len() * kw,
        "kv_write: K must be [{}, {kw}]",
        cells.len()
    );
    assert_eq!(
        v.len(),
        cells.len() * vw,
        "kv_write: V must be [{}, {vw}]",
        cells.len()
    );
    if cells.is_empty() {
        return;
    }
    let l = &mut kv.layers[layer];
    let calibrated = l.k.calibrate(k).and_then(|()| l.v.calibrate(v));
    if let Err(e) = calibrated {
        panic!("kv_write: {e}");
    }
    // Padded turbo heads are refined or encoded in two stages on write (`specula_kv`
    // `refine.rs`), which costs more than the other encoders: spread rows over threads when
    // there is enough of it.
    let padded = |p: &Plane| p.rotation() == Rotation::Turbo && p.dim() > p.head_dim();
    let heavy = padded(&l.k) || padded(&l.v);
    let (ek, ck) = match l.k.encoder_and_cells(cells) {
        Ok(x) => x,
        Err(e) => panic!("kv_write: K: {e}"),
    };
    let (ev, cv) = match l.v.encoder_and_cells(cells) {
        Ok(x) => x,
        Err(e) => panic!("kv_write: V: {e}"),
    };
    // One item per (cell, K or V).
    let mut items: Vec<WriteItem<'_>> = ck
        .into_iter()
        .zip(cv)
        .enumerate()
        .flat_map(|(t, (dk, dv))| [(t, false, dk), (t, true, dv)])
        .collect();
    let write = |(t, is_v, dst): &mut WriteItem<'_>, pad: &mut Vec<f32>| {
        let r = if *is_v {
            ev.encode_heads(&v[*t * vw..(*t + 1) * vw], dst, pad)
        } else {
            ek.encode_heads(&k[*t * kw..(*t + 1) * kw], dst, pad)
        };
        if let Err(e) = r {
            panic!("kv_write: {}: {e}", if *is_v { "V" } else { "K" });
        }
    };
    let nth = be.n_threads();
    if nth == 1 || !(heavy || cells.len() >= 16) {
        let mut pad = Vec::new();
        for it in &mut items {
            write(it, &mut pad);
        }
        return;
    }
    let per = items.len().div_ceil(nth);
    let parts: Vec<std::sync::Mutex<&mut [WriteItem<'_>]>> =
        items.chunks_mut(per).map(std::sync::Mutex::new).collect();
    be.pool().run(&|t| {
        if let Some(p) = parts.get(t) {
            let mut part = p.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            let mut pad = Vec::new();
            for it in part.iter_mut() {
                write(it, &mut pad);
            }
        }
    });
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

/// How much of a tile a query row sees.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum RowVis {
    #[default]
    None,
    All,
    /// Some cells: see [`visible`] per cell.
    Some,
}

/// What a query at `qp` sees of a tile whose key positions lie in `kmin..=kmax`, where the
/// range decides it (else [`RowVis::Some`]).
#[inline]
fn row_vis(mask: Mask, qp: u32, kmin: u32, kmax: u32) -> RowVis {
    match mask {
        Mask::None => RowVis::All,
        _ if kmin > qp => RowVis::None,
        Mask::Causal if kmax <= qp => RowVis::All,
        Mask::SlidingWindow(w) if kmax <= qp => {
            // Every key is at or before the query: the nearest is kmax, the farthest kmin.
            let inside = |k: u32| usize::try_from(qp - k).is_ok_and(|d| d < w);
            if inside(kmin) {
                RowVis::All
            } else if inside(kmax) {
                RowVis::Some
            } else {
                RowVis::None
            }
        }
        _ => RowVis::Some,
    }
}

/// `l[q] += w[q·TILE + j]` for `j < n`, in order, for `Q` queries at once (their chains
/// overlap); returns `Q`.
#[inline]
fn add_weights<const Q: usize>(w: &[f32], n: usize, l: &mut [f32]) -> usize {
    let mut acc: [f32; Q] = std::array::from_fn(|q| l[q]);
    for j in 0..n {
        for (q, a) in acc.iter_mut().enumerate() {
            *a += w[q * TILE + j];
        }
    }
    l[..Q].copy_from_slice(&acc);
    Q
}

/// Merges the softmax state of one chunk `(m, l, acc)` into a running state: both rescaled to
/// the larger maximum and added. An empty chunk (`m = −∞`) leaves the state as it is; into an
/// empty state the chunk is copied. Every path (one task over many chunks, or one task per
/// chunk merged afterwards) merges with this function in chunk order, so the bits agree.
#[inline]
fn merge_state(run: (&mut f32, &mut f32, &mut [f32]), chunk: (f32, f32, &[f32])) {
    let (m, l, acc) = run;
    let (cm, cl, cacc) = chunk;
    if cm == f32::NEG_INFINITY {
        return;
    }
    if *m == f32::NEG_INFINITY {
        *m = cm;
        *l = cl;
        acc.copy_from_slice(cacc);
        return;
    }
    let mn = m.max(cm);
    let (a, c) = ((*m - mn).exp(), (cm - mn).exp());
    *l = *l * a + cl * c;
    for (x, &y) in acc.iter_mut().zip(cacc) {
        *x = *x * a + y * c;
    }
    *m = mn;
}

/// The fine stage's weight β of a plane whose heads are stored in two turbo stages
/// ([`specula_kv::turbo_two_stage`]: 64-value heads in 128-code groups).
fn two_stage(p: &Plane) -> Option<f32> {
    if p.rotation() == Rotation::Turbo {
        turbo_two_stage(p.ty(), p.head_dim(), p.dim())
    } else {
        None
    }
}

/// Values per head of `p` as attention reads them: the stored width, or the 64 values of a
/// head stored in two turbo stages ([`Ctx::decode_read`]).
fn read_dim(p: &Plane) -> usize {
    if two_stage(p).is_some() {
        wht::HALF
    } else {
        p.dim()
    }
}

/// `out[i] = y[i] + β·y[64 + i]`: a decoded two-stage head's coarse and fine stages as one
/// head of 64 values (multiply and add rounded apart, as [`turbo_read`] does).
#[inline]
fn fold_stages(y: &[f32; wht::GROUP], beta: f32, out: &mut [f32]) {
    let (coarse, fine) = y.split_at(wht::HALF);
    for ((o, &c), &f) in out[..wht::HALF].iter_mut().zip(coarse).zip(fine) {
        *o = c + beta * f;
    }
}

/// How `q·k` is computed for a key format.
#[derive(Clone, Copy)]
enum KeyDot {
    /// f32 keys, read in place.
    F32,
    /// Keys decoded per tile to f32 (f16, bf16, turbo), dotted in f32.
    Decoded,
    /// Block formats: the query quantized to `qty`, dotted with `f`.
    Quant {
        qty: QType,
        f: fn(&Kernels, &[u8], &[u8]) -> f32,
    },
}

fn key_dot(ty: QType) -> KeyDot {
    use bytemuck::cast_slice as c;
    let quant = |f: fn(&Kernels, &[u8], &[u8]) -> f32| KeyDot::Quant {
        qty: ty.vec_dot_type(),
        f,
    };
    match ty {
        QType::F32 => KeyDot::F32,
        QType::Q8_0 => quant(|k, w, a| k.q8_0_q8_0(c(w), c(a))),
        QType::Q4_0 => quant(|k, w, a| k.q4_0_q8_0(c(w), c(a))),
        QType::Q4_1 => quant(|k, w, a| k.q4_1_q8_1(c(w), c(a))),
        QType::Q5_0 => quant(|k, w, a| k.q5_0_q8_0(c(w), c(a))),
        QType::Q5_1 => quant(|k, w, a| k.q5_1_q8_1(c(w), c(a))),
        QType::IQ4_NL => quant(|k, w, a| k.iq4_nl_q8_0(c(w), c(a))),
        _ => KeyDot::Decoded,
    }
}

/// Query heads prepared for a key format ([`Ctx::prepare`]).
#[derive(Default)]
struct Queries {
    /// f32 (`rows · heads · k_dim`).
    qf: Vec<f32>,
    /// Quantized bytes (`rows · heads · qbytes`).
    qb: Vec<u8>,
    /// `q·m` per (row, head): the key offset's part of every score.
    qm: Vec<f32>,
}

/// Per-thread buffers of a task.
#[derive(Default)]
struct TaskBufs {
    /// The task's prepared queries (when not handed in).
    q: Queries,
    /// Decoded K tile (`TILE · k_dim`).
    kt: Vec<f32>,
    /// Decoded V tile (`TILE · v_dim`).
    vt: Vec<f32>,
    /// f16 K and V tiles widened once for many queries (`TILE · k_dim`, `TILE · v_dim`).
    kw: Vec<f32>,
    vw: Vec<f32>,
    /// Scores, then weights (`rows · heads · TILE`).
    s: Vec<f32>,
    /// Accumulators of the merged chunks (`rows · heads · v_dim`).
    acc: Vec<f32>,
    /// Accumulators of the current chunk.
    cacc: Vec<f32>,
    /// Running maximum and sum of the current chunk per (row, head).
    cm: Vec<f32>,
    cl: Vec<f32>,
    /// Running maximum and sum per (row, head).
    m: Vec<f32>,
    l: Vec<f32>,
    /// Which rows see each cell of the tile.
    vis: Vec<bool>,
    /// Per row: whether it sees all, none or some of the tile's cells.
    rv: Vec<RowVis>,
    /// The task's output before it is copied into place.
    out: Vec<f32>,
}

thread_local! {
    static BUFS: RefCell<TaskBufs> = RefCell::new(TaskBufs::default());
}

fn fit<T: Clone + Default>(v: &mut Vec<T>, n: usize) {
    if v.len() < n {
        v.resize(n, T::default());
    }
}

/// Rows `cell0..cell0 + n` of head `kvh` of `p` as the tile loops read them in place, when
/// they can (f32 and f16 rows of whole vectors).
fn tile_rows(p: &Plane, cell0: usize, kvh: usize, n: usize, dim: usize) -> Option<tile::Rows<'_>> {
    let f16 = match p.ty() {
        QType::F32 => false,
        QType::F16 => true,
        _ => return None,
    };
    tile::fits(dim).then(|| tile::Rows {
        bytes: p.head_cells(kvh, cell0),
        stride: p.head_bytes(),
        n,
        dim,
        f16,
    })
}

/// Rows `cell0..cell0 + n` of head `kvh` of a block-format plane whose heads are whole
/// blocks (at most [`tile::MAX_BLOCKS`]), read in place by the tile loops.
fn block_rows(p: &Plane, cell0: usize, kvh: usize, n: usize) -> Option<tile::BlockRows<'_>> {
    let fmt = tile::BlockFmt::of(p.ty())?;
    let blocks = p.head_bytes() / fmt.bytes();
    (blocks > 0 && blocks <= tile::MAX_BLOCKS && blocks * fmt.bytes() == p.head_bytes()).then(
        || tile::BlockRows {
            bytes: p.head_cells(kvh, cell0),
            stride: p.head_bytes(),
            n,
            blocks,
            fmt,
        },
    )
}

/// f16 rows read in place by a tile loop that would widen each row once per `per` queries:
/// for more queries than that, widened once into `buf` (exact, so the scores and sums
/// keep their bits) and read from there.
fn widened<'b>(
    ctx: &Ctx<'_>,
    rows: tile::Rows<'b>,
    nq: usize,
    per: usize,
    buf: &'b mut Vec<f32>,
) -> tile::Rows<'b> {
    if !rows.f16 || nq <= per {
        return rows;
    }
    let (n, dim) = (rows.n, rows.dim);
    fit(buf, n * dim);
    for (j, out) in buf[..n * dim].chunks_exact_mut(dim).enumerate() {
        let src = &rows.bytes[j * rows.stride..j * rows.stride + 2 * dim];
        (ctx.attn.f16_to_f32)(bytemuck::cast_slice(src), out);
    }
    tile::Rows::f32(buf, n, dim)
}

/// Everything a task reads.
struct Ctx<'a> {
    /// The query rows of the sequence, `q_w` values each.
    q: &'a [f32],
    q_w: usize,
    p: AttentionParams<'a>,
    k: &'a Plane,
    v: &'a Plane,
    kernels: &'static Kernels,
    attn: simd::AttnKernels,
    key: KeyDot,
    hd_k: usize,
    hd_v: usize,
    /// Values per K / V head as attention reads them ([`read_dim`]).
    k_dim: usize,
    v_dim: usize,
    /// The fine stage's weight of K / V heads stored in two turbo stages ([`two_stage`]).
    k_two: Option<f32>,
    v_two: Option<f32>,
    /// Cells of the layer: `kv_pos` index `j` is cell `j % n_cells` (a ring).
    n_cells: usize,
}

impl<'a> Ctx<'a> {
    /// One stored head as attention reads it: [`Ctx::decode`], or for a head stored in two
    /// turbo stages (`two` = β) the 64 values `y_i + β·y_{64+i}` of its decoded codes `y` —
    /// the first step of [`turbo_read`], so that scores and values run over the 64 dimensions
    /// of the head, not the 128 of its codes — in [`simd::read_order`] (the query is put in
    /// that order too, and the output taken out of it).
    #[inline]
    fn decode_read(&self, ty: QType, two: Option<f32>, src: &[u8], out: &mut [f32]) {
        let Some(beta) = two else {
            self.decode(ty, src, out);
            return;
        };
        if ty == QType::Turbo4 {
            (self.attn.turbo4_two)(src, src.len(), 1, beta, out);
            return;
        }
        let mut y = [0.0f32; wht::GROUP];
        let mut f = [0.0f32; wht::HALF];
        self.decode(ty, src, &mut y);
        fold_stages(&y, beta, &mut f);
        simd::read_order(&f, out);
    }

    /// Decodes the `n` cells from `cell0` (`None`: the tile wraps around a ring) of head `kvh`
    /// of `p` into `out` in one call, where a kernel reads such rows in place: two-stage turbo4
    /// heads ([`Ctx::decode_read`]'s values, every cell's whether a query sees it or not).
    /// Returns whether it did.
    fn decode_tile(
        &self,
        p: &Plane,
        two: Option<f32>,
        cell0: Option<usize>,
        kvh: usize,
        n: usize,
        out: &mut [f32],
    ) -> bool {
        match (two, cell0) {
            (Some(beta), Some(c0)) if p.ty() == QType::Turbo4 => {
                (self.attn.turbo4_two)(p.head_cells(kvh, c0), p.head_bytes(), n, beta, out);
                true
            }
            _ => false,
        }
    }

    /// [`decode_head`] with this backend's f16 conversion (F16C where the CPU has it).
    #[inline]
    fn decode(&self, ty: QType, src: &[u8], out: &mut [f32]) {
        match ty {
            QType::F16 => (self.attn.f16_to_f32)(bytemuck::cast_slice(src), out),
            QType::Turbo4 => (self.attn.turbo4_decode)(bytemuck::cast_slice(src), out),
            QType::Turbo3 => (self.attn.turbo3_decode)(bytemuck::cast_slice(src), out),
            QType::Turbo2 => (self.attn.turbo2_decode)(bytemuck::cast_slice(src), out),
            QType::BF16 => (self.attn.bf16_to_f32)(src, out),
            _ => decode_head(ty, src, out),
        }
    }

    /// Prepares the query heads `heads` of rows `rows` for K/V head `kvh`'s key format into
    /// `q` (index `row · heads + head`): `q·m` of the key offset, and the head rotated as the
    /// keys are stored (and quantized to the format's dot-product type for block formats).
    fn prepare(
        &self,
        rows: std::ops::Range<usize>,
        kvh: usize,
        heads: std::ops::Range<usize>,
        q: &mut Queries,
    ) {
        let nh = heads.len();
        let nq = rows.len() * nh;
        let (k_dim, hd_k) = (self.k_dim, self.hd_k);
        let qbytes = self.query_bytes();
        fit(&mut q.qf, nq * k_dim);
        fit(&mut q.qb, nq * qbytes);
        fit(&mut q.qm, nq);
        let k_center = self.k.center(kvh);
        for (ri, r) in rows.clone().enumerate() {
            let qrow = &self.q[r * self.q_w..(r + 1) * self.q_w];
            for (hi, h) in heads.clone().enumerate() {
                let i = ri * nh + hi;
                let src = &qrow[h * hd_k..(h + 1) * hd_k];
                q.qm[i] = k_center.map_or(0.0, |c| (self.attn.dot_f32)(src, c));
                match self.key {
                    KeyDot::Quant { qty, .. } => {
                        let dst = &mut q.qb[i * qbytes..(i + 1) * qbytes];
                        let rotated = &mut q.qf[i * k_dim..i * k_dim + hd_k];
                        rotated.copy_from_slice(src);
                        if let Rotation::Hadamard(n) = self.k.rotation() {
                            hadamard(rotated, n);
                        }
                        if let Err(e) = specula_quant::quantize_row(qty, rotated, dst) {
                            panic!("attention: query head to {qty}: {e}");
                        }
                    }
                    _ => {
                        let dst = &mut q.qf[i * k_dim..(i + 1) * k_dim];
                        dst[..hd_k].copy_from_slice(src);
                        dst[hd_k..].fill(0.0);
                        match self.k.rotation() {
                            Rotation::Turbo if self.k_two.is_some() => {
                                let mut r: [f32; wht::HALF] =
                                    dst[..wht::HALF].try_into().expect("64 values");
                                wht::forward64(&mut r);
                                simd::read_order(&r, dst);
                            }
                            Rotation::Turbo => turbo_query(self.k.ty(), dst, hd_k),
                            Rotation::Hadamard(n) => hadamard(&mut dst[..hd_k], n),
                            Rotation::None => {}
                        }
                    }
                }
            }
        }
    }

    /// Bytes of one prepared query head for a block-format key (0 for the others).
    fn query_bytes(&self) -> usize {
        match self.key {
            KeyDot::Quant { qty, .. } => qty.row_bytes(self.hd_k).unwrap_or(0),
            _ => 0,
        }
    }

    /// Computes the softmax state of rows `rows` × query heads `heads` (all sharing K/V head
    /// `kvh`) over the key chunks `chunks`, merged in chunk order into `b.m`, `b.l`, `b.acc`
    /// (unnormalized; index `row · heads + head`).
    #[allow(
        clippy::too_many_lines,
        reason = "one flash-attention loop, kept in one piece to read in order"
    )]
    fn task(
        &self,
        rows: std::ops::Range<usize>,
        kvh: usize,
        heads: std::ops::Range<usize>,
        chunks: std::ops::Range<usize>,
        pre: Option<&Queries>,
        b: &mut TaskBufs,
    ) {
        let (nr, nh) = (rows.len(), heads.len());
        let nq = nr * nh;
        let (k_dim, v_dim) = (self.k_dim, self.v_dim);
        let kv_len = self.p.kv_pos.len();
        let tile = self.attn.tile;

        // Queries, prepared once for the key format (or handed in, prepared once for every
        // chunk of a split).
        let mut own = std::mem::take(&mut b.q);
        let q: &Queries = if let Some(p) = pre {
            p
        } else {
            self.prepare(rows.clone(), kvh, heads.clone(), &mut own);
            &own
        };
        let qbytes = self.query_bytes();
        fit(&mut b.acc, nq * v_dim);
        b.acc[..nq * v_dim].fill(0.0);
        fit(&mut b.m, nq);
        fit(&mut b.l, nq);
        b.m[..nq].fill(f32::NEG_INFINITY);
        b.l[..nq].fill(0.0);
        fit(&mut b.cacc, nq * v_dim);
        fit(&mut b.cm, nq);
        fit(&mut b.cl, nq);
        fit(&mut b.s, nq * TILE);
        fit(&mut b.kt, TILE * k_dim);
        fit(&mut b.vt, TILE * v_dim);
        fit(&mut b.vis, nr * TILE);
        fit(&mut b.rv, nr);

        for c in chunks {
            let end = ((c + 1) * CHUNK).min(kv_len);
            let mut j0 = c * CHUNK;
            if j0 >= end {
                continue;
            }
            b.cacc[..nq * v_dim].fill(0.0);
            b.cm[..nq].fill(f32::NEG_INFINITY);
            b.cl[..nq].fill(0.0);
            while j0 < end {
                let n = TILE.min(end - j0);
                // Visibility of each cell to each row, from the tile's position range where
                // that decides it for a whole row; skip the tile if no row sees any cell.
                let kp = &self.p.kv_pos[j0..j0 + n];
                let (kmin, kmax) = kp
                    .iter()
                    .fold((u32::MAX, 0), |(lo, hi), &x| (lo.min(x), hi.max(x)));
                let mut any = false;
                for (ri, r) in rows.clone().enumerate() {
                    let qp = self.p.q_pos[r];
                    let rv = row_vis(self.p.mask, qp, kmin, kmax);
                    let vis = &mut b.vis[ri * TILE..ri * TILE + n];
                    match rv {
                        RowVis::All => vis.fill(true),
                        RowVis::None => vis.fill(false),
                        RowVis::Some => {
                            for (v, &k) in vis.iter_mut().zip(kp) {
                                *v = visible(self.p.mask, qp, k);
                            }
                        }
                    }
                    b.rv[ri] = rv;
                    any |= rv != RowVis::None;
                }
                if !any {
                    j0 += n;
                    continue;
                }
                // Keys and values read in place by the tile loops: f32 / f16 rows of a
                // tile that does not wrap around a ring.
                let cell0 = j0 % self.n_cells;
                let contiguous = cell0 + n <= self.n_cells;
                let fast = tile.is_some() && contiguous;
                let in_place = |p, dim| fast.then(|| tile_rows(p, cell0, kvh, n, dim)).flatten();
                // Two-stage turbo4 rows, decoded in registers by the fused tile loops.
                let turbo = |p: &'a Plane, two: Option<f32>| match two {
                    Some(beta) if fast && p.ty() == QType::Turbo4 => Some(tile::TurboRows {
                        bytes: p.head_cells(kvh, cell0),
                        stride: p.head_bytes(),
                        n,
                        beta,
                    }),
                    _ => None,
                };
                let k_turbo = tile
                    .and_then(|t| t.scores_turbo)
                    .filter(|_| nq <= tile::TURBO_QUERIES)
                    .zip(turbo(self.k, self.k_two));
                let k_rows = match self.key {
                    KeyDot::F32 | KeyDot::Decoded => in_place(self.k, k_dim)
                        .map(|r| widened(self, r, nq, SCORE_QUERIES, &mut b.kw)),
                    KeyDot::Quant { .. } => None,
                };
                // Decode the tile's keys when their format is read in f32.
                if matches!(self.key, KeyDot::Decoded)
                    && k_rows.is_none()
                    && k_turbo.is_none()
                    && !self.decode_tile(
                        self.k,
                        self.k_two,
                        contiguous.then_some(cell0),
                        kvh,
                        n,
                        &mut b.kt,
                    )
                {
                    for jj in 0..n {
                        if (0..nr).any(|ri| b.vis[ri * TILE + jj]) {
                            self.decode_read(
                                self.k.ty(),
                                self.k_two,
                                self.k.head((j0 + jj) % self.n_cells, kvh),
                                &mut b.kt[jj * k_dim..(jj + 1) * k_dim],
                            );
                        }
                    }
                }
                // Scores: a tile's dot products at once where the tile loops read the keys
                // (a decoded key that no row sees holds an older key's values: its score
                // is replaced by −∞ below), else key by key.
                let decoded = matches!(self.key, KeyDot::Decoded) && tile::fits(k_dim);
                // Block-format keys in place, dotted with the quantized queries by the tile
                // loop.
                let k_blocks = match self.key {
                    KeyDot::Quant { .. } if fast => block_rows(self.k, cell0, kvh, n)
                        .filter(|r| r.blocks * r.fmt.query_bytes() == qbytes),
                    _ => None,
                };
                match (tile, k_rows, k_blocks) {
                    _ if k_turbo.is_some() => {
                        if let Some((f, rows)) = k_turbo {
                            f(&q.qf, k_dim, nq, rows, &mut b.s, TILE);
                        }
                    }
                    (Some(t), Some(rows), _) => {
                        (t.scores)(&q.qf, k_dim, nq, rows, &mut b.s, TILE);
                    }
                    (Some(t), None, Some(rows)) => {
                        (t.scores_blocks)(&q.qb, qbytes, nq, rows, &mut b.s, TILE);
                    }
                    (Some(t), None, None) if decoded => {
                        let rows = tile::Rows::f32(&b.kt, n, k_dim);
                        (t.scores)(&q.qf, k_dim, nq, rows, &mut b.s, TILE);
                    }
                    _ => {
                        for jj in 0..n {
                            let kb = self.k.head((j0 + jj) % self.n_cells, kvh);
                            let kf: &[f32] = match self.key {
                                KeyDot::F32 => bytemuck::cast_slice(kb),
                                KeyDot::Decoded => &b.kt[jj * k_dim..(jj + 1) * k_dim],
                                KeyDot::Quant { .. } => &[],
                            };
                            for ri in 0..nr {
                                if !b.vis[ri * TILE + jj] {
                                    continue;
                                }
                                for hi in 0..nh {
                                    let i = ri * nh + hi;
                                    b.s[i * TILE + jj] = match self.key {
                                        KeyDot::Quant { f, .. } => {
                                            f(self.kernels, kb, &q.qb[i * qbytes..(i + 1) * qbytes])
                                        }
                                        _ => (self.attn.dot_f32)(
                                            &q.qf[i * k_dim..(i + 1) * k_dim],
                                            kf,
                                        ),
                                    };
                                }
                            }
                        }
                    }
                }
                let (scale, softcap) = (self.p.scale, self.p.softcap);
                for ri in 0..nr {
                    for hi in 0..nh {
                        let i = ri * nh + hi;
                        let (qm, s) = (q.qm[i], &mut b.s[i * TILE..i * TILE + n]);
                        let vis = &b.vis[ri * TILE..ri * TILE + n];
                        match (b.rv[ri], softcap) {
                            (RowVis::None, _) => s.fill(f32::NEG_INFINITY),
                            (RowVis::All, None) => {
                                for x in s.iter_mut() {
                                    *x = (*x + qm) * scale;
                                }
                            }
                            (RowVis::Some, None) => {
                                for (x, &v) in s.iter_mut().zip(vis) {
                                    *x = if v {
                                        (*x + qm) * scale
                                    } else {
                                        f32::NEG_INFINITY
                                    };
                                }
                            }
                            (_, Some(c)) => {
                                for (x, &v) in s.iter_mut().zip(vis) {
                                    *x = if v {
                                        c * ((*x + qm) * scale / c).tanh()
                                    } else {
                                        f32::NEG_INFINITY
                                    };
                                }
                            }
                        }
                    }
                }
                // Online softmax: new maxima, rescaled accumulators, weights; then the sums of
                // the weights, each a sequential sum over the tile's cells, four queries at a
                // time so that the four chains overlap.
                for i in 0..nq {
                    let s = &mut b.s[i * TILE..i * TILE + n];
                    let tmax = (self.attn.max)(s);
                    if tmax == f32::NEG_INFINITY {
                        s.fill(0.0);
                        continue;
                    }
                    let m_old = b.cm[i];
                    let m_new = m_old.max(tmax);
                    if m_new > m_old {
                        let corr = if m_old == f32::NEG_INFINITY {
                            0.0
                        } else {
                            (m_old - m_new).exp()
                        };
                        b.cl[i] *= corr;
                        for a in &mut b.cacc[i * v_dim..(i + 1) * v_dim] {
                            *a *= corr;
                        }
                        b.cm[i] = m_new;
                    }
                    // A masked cell's −∞ gets e^−∞ = 0.
                    (self.attn.exp_sub)(s, m_new);
                }
                let mut i = 0;
                while i < nq {
                    let w = &b.s[i * TILE..];
                    i += match nq - i {
                        1 => add_weights::<1>(w, n, &mut b.cl[i..]),
                        2 => add_weights::<2>(w, n, &mut b.cl[i..]),
                        3 => add_weights::<3>(w, n, &mut b.cl[i..]),
                        _ => add_weights::<4>(w, n, &mut b.cl[i..]),
                    };
                }
                // Values: the tile loops over rows in place or decoded (a decoded row that
                // no query sees has weight 0 for every query and is skipped), else key by key.
                let v_rows =
                    in_place(self.v, v_dim).map(|r| widened(self, r, nq, VALUE_QUERIES, &mut b.vw));
                let v_blocks = fast
                    .then(|| block_rows(self.v, cell0, kvh, n))
                    .flatten()
                    .filter(|r| r.blocks * 32 == v_dim);
                let v_turbo = tile
                    .and_then(|t| t.pv_turbo)
                    .filter(|_| nq <= tile::TURBO_QUERIES)
                    .zip(turbo(self.v, self.v_two));
                match (tile, v_rows, v_blocks) {
                    _ if v_turbo.is_some() => {
                        if let Some((f, rows)) = v_turbo {
                            f(&b.s, TILE, nq, rows, &mut b.cacc, v_dim);
                        }
                    }
                    (Some(t), Some(rows), _) => (t.pv)(&b.s, TILE, nq, rows, &mut b.cacc, v_dim),
                    (Some(t), None, Some(src)) if tile::fused_blocks(t, nq, src.blocks) => {
                        if let Some(f) = t.pv_blocks {
                            f(&b.s, TILE, nq, src, &mut b.cacc, v_dim);
                        }
                    }
                    (Some(t), None, Some(src)) => {
                        (t.widen_blocks)(src, &mut b.vt, v_dim);
                        let rows = tile::Rows::f32(&b.vt, n, v_dim);
                        (t.pv)(&b.s, TILE, nq, rows, &mut b.cacc, v_dim);
                    }
                    _ => {
                        let whole = self.decode_tile(
                            self.v,
                            self.v_two,
                            contiguous.then_some(cell0),
                            kvh,
                            n,
                            &mut b.vt,
                        );
                        for jj in 0..n {
                            if !(0..nr).any(|ri| b.vis[ri * TILE + jj]) {
                                continue;
                            }
                            let d = &mut b.vt[jj * v_dim..(jj + 1) * v_dim];
                            if !whole {
                                let vb = self.v.head((j0 + jj) % self.n_cells, kvh);
                                if self.v.ty() == QType::F32 {
                                    d.copy_from_slice(bytemuck::cast_slice(vb));
                                } else {
                                    self.decode_read(self.v.ty(), self.v_two, vb, d);
                                }
                            }
                            if tile.is_none() || !tile::fits(v_dim) {
                                for i in 0..nq {
                                    let w = b.s[i * TILE + jj];
                                    if w != 0.0 {
                                        (self.attn.axpy)(
                                            &mut b.cacc[i * v_dim..(i + 1) * v_dim],
                                            w,
                                            &b.vt[jj * v_dim..(jj + 1) * v_dim],
                                        );
                                    }
                                }
                            }
                        }
                        if let Some(t) = tile.filter(|_| tile::fits(v_dim)) {
                            let rows = tile::Rows::f32(&b.vt, n, v_dim);
                            (t.pv)(&b.s, TILE, nq, rows, &mut b.cacc, v_dim);
                        }
                    }
                }
                j0 += n;
            }
            for i in 0..nq {
                merge_state(
                    (
                        &mut b.m[i],
                        &mut b.l[i],
                        &mut b.acc[i * v_dim..(i + 1) * v_dim],
                    ),
                    (b.cm[i], b.cl[i], &b.cacc[i * v_dim..(i + 1) * v_dim]),
                );
            }
        }
        b.q = own;
    }

    /// Normalizes merged states (`l`, `acc`: `nq` queries of K/V head `kvh`) into `o` (`nq`
    /// heads of `hd_v` values): divides by the sum, rotates a turbo / Hadamard V back, folds
    /// the padding and adds the V offset.
    fn finish(&self, kvh: usize, l: &[f32], acc: &mut [f32], o: &mut [f32]) {
        let (v_dim, hd_v) = (self.v_dim, self.hd_v);
        let v_rot = self.v.rotation();
        let v_center = self.v.center(kvh);
        for (i, &li) in l.iter().enumerate() {
            let dst = &mut o[i * hd_v..(i + 1) * hd_v];
            if li == 0.0 {
                dst.fill(0.0);
                continue;
            }
            let inv = 1.0 / li;
            let acc = &mut acc[i * v_dim..(i + 1) * v_dim];
            for a in acc.iter_mut() {
                *a *= inv;
            }
            match v_rot {
                Rotation::Turbo if self.v_two.is_some() => {
                    let mut r = [0.0f32; wht::HALF];
                    simd::natural_order(acc, &mut r);
                    wht::inverse64(&mut r);
                    acc.copy_from_slice(&r);
                }
                Rotation::Turbo => turbo_read(self.v.ty(), acc, hd_v),
                Rotation::Hadamard(n) => hadamard(&mut acc[..hd_v], n),
                Rotation::None => {}
            }
            dst.copy_from_slice(&acc[..hd_v]);
            if let Some(c) = v_center {
                for (d, m) in dst.iter_mut().zip(c) {
                    *d += m;
                }
            }
        }
    }
}

/// One sequence's attention, planned: what its tasks read, how its work splits into tasks,
/// and where its rows go in the output.
struct Job<'a> {
    ctx: Ctx<'a>,
    /// Its first row in the output.
    row0: usize,
    n_q: usize,
    n_kv_head: usize,
    group: usize,
    rows_per: usize,
    n_rb: usize,
    n_chunks: usize,
    split: Split,
}

/// How a job's work is cut into tasks.
enum Split {
    /// Split-K (flash decoding): every (row block, K/V head, chunk) is a task that leaves its
    /// chunk's softmax state in the job's part of `parts` (from `part0`, `stride` values per
    /// task); the states are merged in chunk order afterwards. The queries of each (row
    /// block, K/V head) are prepared once for all its chunks.
    Chunks {
        nq_task: usize,
        stride: usize,
        part0: usize,
        preps: Vec<Queries>,
    },
    /// Row blocks × K/V heads × slices of `heads_per` query heads of a group, each over every
    /// chunk, written straight into place.
    Heads { n_sub: usize, heads_per: usize },
}

impl Job<'_> {
    fn n_tasks(&self) -> usize {
        match &self.split {
            Split::Chunks { .. } => self.n_rb * self.n_kv_head * self.n_chunks,
            Split::Heads { n_sub, .. } => self.n_rb * self.n_kv_head * n_sub,
        }
    }

    fn rows(&self, rb: usize) -> std::ops::Range<usize> {
        rb * self.rows_per..((rb + 1) * self.rows_per).min(self.n_q)
    }

    /// Task `i` of the job, on this thread's buffers.
    fn run(&self, i: usize, b: &mut TaskBufs, dst: &Disjoint<'_, f32>, parts: &Disjoint<'_, f32>) {
        let (ctx, n_kv_head, group) = (&self.ctx, self.n_kv_head, self.group);
        let (hd_v, v_dim) = (ctx.hd_v, ctx.v_dim);
        let row_w = ctx.p.n_head * hd_v;
        match &self.split {
            Split::Chunks {
                nq_task,
                stride,
                part0,
                preps,
            } => {
                let n_chunks = self.n_chunks;
                let rb = i / (n_kv_head * n_chunks);
                let kvh = (i / n_chunks) % n_kv_head;
                let c = i % n_chunks;
                let rows = self.rows(rb);
                if rows.is_empty() {
                    return;
                }
                let heads = kvh * group..(kvh + 1) * group;
                let nq = rows.len() * group;
                let pre = &preps[rb * n_kv_head + kvh];
                ctx.task(rows, kvh, heads, c..c + 1, Some(pre), b);
                let at = part0 + i * stride;
                // SAFETY: task i of this job writes only its own `stride` slot of the job's
                // part of `parts`; jobs have disjoint parts and each task belongs to exactly
                // one thread of the split.
                let slot = unsafe { parts.slice(at..at + stride) };
                let (ml, acc) = slot.split_at_mut(2 * nq_task);
                ml[..nq].copy_from_slice(&b.m[..nq]);
                ml[*nq_task..nq_task + nq].copy_from_slice(&b.l[..nq]);
                acc[..nq * v_dim].copy_from_slice(&b.acc[..nq * v_dim]);
            }
            Split::Heads { n_sub, heads_per } => {
                let rb = i / (n_kv_head * n_sub);
                let kvh = (i / n_sub) % n_kv_head;
                let sub = i % n_sub;
                let rows = self.rows(rb);
                let h0 = kvh * group + sub * heads_per;
                let heads = h0..(h0 + heads_per).min((kvh + 1) * group);
                if rows.is_empty() || heads.is_empty() {
                    return;
                }
                let w = heads.len() * hd_v;
                let nq = rows.len() * heads.len();
                let mut tmp = std::mem::take(&mut b.out);
                tmp.clear();
                tmp.resize(rows.len() * w, 0.0);
                ctx.task(rows.clone(), kvh, heads.clone(), 0..self.n_chunks, None, b);
                ctx.finish(kvh, &b.l[..nq], &mut b.acc[..nq * v_dim], &mut tmp);
                for (ri, r) in rows.enumerate() {
                    let start = (self.row0 + r) * row_w + heads.start * hd_v;
                    // SAFETY: task i writes only row r's heads `heads` of its own rows; tasks
                    // cover disjoint (row block, head range) pairs, jobs disjoint rows, and
                    // each task belongs to exactly one thread of the split.
                    let o = unsafe { dst.slice(start..start + w) };
                    o.copy_from_slice(&tmp[ri * w..(ri + 1) * w]);
                }
                b.out = tmp;
            }
        }
    }

    /// A split-K job's chunk states merged in chunk order, normalized and put in place (small:
    /// rows × heads × chunks × v_dim).
    fn merge(&self, parts: &[f32], out: &mut [f32]) {
        let Split::Chunks {
            nq_task,
            stride,
            part0,
            ..
        } = &self.split
        else {
            return;
        };
        let (ctx, n_kv_head, group, n_chunks) =
            (&self.ctx, self.n_kv_head, self.group, self.n_chunks);
        let (hd_v, v_dim, nq_task) = (ctx.hd_v, ctx.v_dim, *nq_task);
        let row_w = ctx.p.n_head * hd_v;
        let mut m = vec![f32::NEG_INFINITY; nq_task];
        let mut l = vec![0.0f32; nq_task];
        let mut acc = vec![0.0f32; nq_task * v_dim];
        let mut tmp = vec![0.0f32; nq_task * hd_v];
        for rb in 0..self.n_rb {
            let rows = self.rows(rb);
            let nq = rows.len() * group;
            for kvh in 0..n_kv_head {
                m[..nq].fill(f32::NEG_INFINITY);
                l[..nq].fill(0.0);
                acc[..nq * v_dim].fill(0.0);
                for c in 0..n_chunks {
                    let at = part0 + ((rb * n_kv_head + kvh) * n_chunks + c) * stride;
                    let (ml, cacc) = parts[at..at + stride].split_at(2 * nq_task);
                    for q in 0..nq {
                        merge_state(
                            (&mut m[q], &mut l[q], &mut acc[q * v_dim..(q + 1) * v_dim]),
                            (ml[q], ml[nq_task + q], &cacc[q * v_dim..(q + 1) * v_dim]),
                        );
                    }
                }
                ctx.finish(kvh, &l[..nq], &mut acc[..nq * v_dim], &mut tmp[..nq * hd_v]);
                let w = group * hd_v;
                for (ri, r) in rows.clone().enumerate() {
                    let start = (self.row0 + r) * row_w + kvh * w;
                    out[start..start + w].copy_from_slice(&tmp[ri * w..(ri + 1) * w]);
                }
            }
        }
    }
}

/// Plans the attention of the query rows `q` (`n_q · n_head · head_dim_k` values) of one
/// sequence over the cells of one layer of `kv`, its output rows from `row0`; `part0` is where
/// a split-K job's chunk states start in the shared `parts` (it returns how many it takes).
fn plan<'a>(
    be: &CpuBackend,
    q: &'a [f32],
    q_w: usize,
    kv: &'a CpuKv,
    p: AttentionParams<'a>,
    row0: usize,
    part0: usize,
) -> (Job<'a>, usize) {
    let s = &kv.layout.shape;
    assert!(
        p.layer < kv.layers.len(),
        "attention: layer {} of a {}-layer cache",
        p.layer,
        kv.layers.len()
    );
    let h = s.layer_heads(p.layer);
    let (hd_k, n_kv_head, n_head) = (h.head_dim_k, h.n_kv_head, p.n_head);
    let kv_len = p.kv_pos.len();
    assert!(
        n_kv_head > 0 && n_head.is_multiple_of(n_kv_head),
        "attention: {n_head} query heads are not a multiple of {n_kv_head} K/V heads"
    );
    assert_eq!(
        q_w,
        n_head * hd_k,
        "attention: q rows must have n_head · head_dim_k = {} values",
        n_head * hd_k
    );
    let n_q = q.len() / q_w.max(1);
    assert_eq!(p.q_pos.len(), n_q, "attention: one position per query row");
    assert!(
        kv_len <= s.n_ctx,
        "attention: {kv_len} positions in a {}-position cache",
        s.n_ctx
    );
    let group = n_head / n_kv_head;
    let layer = &kv.layers[p.layer];
    let ly = &kv.layout.layers[p.layer];
    let ctx = Ctx {
        q,
        q_w,
        p,
        k: &layer.k,
        v: &layer.v,
        kernels: be.kernels(),
        attn: be.attn_kernels(),
        key: key_dot(ly.types.k),
        hd_k,
        hd_v: h.head_dim_v,
        k_dim: read_dim(&layer.k),
        v_dim: read_dim(&layer.v),
        k_two: two_stage(&layer.k),
        v_two: two_stage(&layer.v),
        n_cells: s.layer_cells(p.layer),
    };
    let nth = be.n_threads();
    let n_rb = n_q.div_ceil(ROWS_PER_TASK).max(1);
    let rows_per = n_q.div_ceil(n_rb).max(1);
    let n_chunks = kv_len.div_ceil(CHUNK).max(1);
    let mut job = Job {
        ctx,
        row0,
        n_q,
        n_kv_head,
        group,
        rows_per,
        n_rb,
        n_chunks,
        split: Split::Heads {
            n_sub: 1,
            heads_per: group,
        },
    };
    // Split-K (flash decoding): when the row blocks alone give each thread fewer than two
    // tasks (decode, short verify batches) and the cache spans several chunks — the same
    // merges, in the same order, that a task over all chunks does, so the split changes no
    // bit. A single row block (decode) always splits: one thread then still reads each K/V
    // head's cells once, where a split of the group's query heads would read them once per
    // slice.
    if n_chunks > 1 && (n_rb * n_kv_head < 2 * nth || n_rb == 1) {
        let nq_task = rows_per * group;
        let stride = nq_task * (job.ctx.v_dim + 2);
        let preps: Vec<Queries> = (0..n_rb * n_kv_head)
            .map(|i| {
                let (rb, kvh) = (i / n_kv_head, i % n_kv_head);
                let rows = job.rows(rb);
                let mut q = Queries::default();
                if !rows.is_empty() {
                    job.ctx
                        .prepare(rows, kvh, kvh * group..(kvh + 1) * group, &mut q);
                }
                q
            })
            .collect();
        job.split = Split::Chunks {
            nq_task,
            stride,
            part0,
            preps,
        };
        let n = job.n_tasks() * stride;
        return (job, n);
    }
    // Every task decodes the K/V tiles it reads: for block and turbo formats, where decoding
    // costs about as much as a head's arithmetic, a group is split only as far as it takes to
    // give each thread a task; float tiles are cheap to convert, so the split aims at four
    // tasks per thread for balance. The split changes no result (see the module docs).
    let float = |t: QType| matches!(t, QType::F32 | QType::F16 | QType::BF16);
    let per_thread = if float(ly.types.k) && float(ly.types.v) {
        4
    } else {
        1
    };
    let n_sub = (per_thread * nth)
        .div_ceil(n_rb * n_kv_head)
        .clamp(1, group);
    let heads_per = group.div_ceil(n_sub);
    job.split = Split::Heads {
        n_sub: group.div_ceil(heads_per),
        heads_per,
    };
    (job, 0)
}

/// Runs the tasks of every job in one parallel region of the pool, then merges the split-K
/// jobs' chunk states; `parts` values hold every split-K job's chunk states.
fn run_jobs(be: &CpuBackend, jobs: &[Job<'_>], parts: usize, out: &mut [f32]) {
    let n_tasks: usize = jobs.iter().map(Job::n_tasks).sum();
    let mut parts = vec![0.0f32; parts];
    {
        let pd = Disjoint::new(&mut parts);
        let dst = Disjoint::new(out);
        let nth = be.n_threads();
        let work = |t: usize| {
            BUFS.with(|cell| {
                let mut b = cell.borrow_mut();
                let range = split(n_tasks, nth, t);
                // The jobs' tasks numbered one after another: each job's share of the range.
                let mut start = 0;
                for job in jobs {
                    let end = start + job.n_tasks();
                    for i in range.start.max(start)..range.end.min(end) {
                        job.run(i - start, &mut b, &dst, &pd);
                    }
                    start = end;
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
    for j in jobs {
        j.merge(&parts, out);
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
    let (job, parts) = plan(be, q.as_slice(), q.cols(), kv, *p, 0, 0);
    out.resize(job.n_q, p.n_head * job.ctx.hd_v);
    run_jobs(be, std::slice::from_ref(&job), parts, out.as_mut_slice());
}

/// [`specula_tensor::Backend::attention_seqs`]: every sequence's K/V rows written from the
/// batch's rows (no gathers), then every sequence's attention in one parallel region, written
/// into its rows of `out`.
pub(crate) fn attention_seqs(
    be: &CpuBackend,
    q: &CpuTensor,
    k: &CpuTensor,
    v: &CpuTensor,
    seqs: &mut [specula_tensor::SeqAttention<'_, CpuKv, crate::CpuIndex>],
    out: &mut CpuTensor,
) {
    let total = q.rows();
    for s in seqs.iter_mut() {
        assert!(
            s.rows.start <= s.rows.end && s.rows.end <= total,
            "attention_seqs: rows {:?} of a {total}-row batch",
            s.rows
        );
        if let Some(cells) = s.cells {
            let (kw, vw) = (k.cols(), v.cols());
            assert_eq!(
                (k.rows(), v.rows()),
                (total, total),
                "attention_seqs: K and V must have the batch's {total} rows"
            );
            kv_write_rows(
                be,
                s.kv,
                s.params.layer,
                cells.as_usize(),
                &k.as_slice()[s.rows.start * kw..s.rows.end * kw],
                &v.as_slice()[s.rows.start * vw..s.rows.end * vw],
            );
        }
    }
    let q_w = q.cols();
    let mut parts = 0;
    let mut row_w = None;
    let jobs: Vec<Job<'_>> = seqs
        .iter()
        .map(|s| {
            let p = s
                .params
                .with_positions(s.params.q_pos.as_u32(), s.params.kv_pos.as_u32());
            let rows = &q.as_slice()[s.rows.start * q_w..s.rows.end * q_w];
            let (job, n) = plan(be, rows, q_w, s.kv, p, s.rows.start, parts);
            let w = p.n_head * job.ctx.hd_v;
            assert!(
                *row_w.get_or_insert(w) == w,
                "attention_seqs: every sequence must have the same output width"
            );
            parts += n;
            job
        })
        .collect();
    out.resize(total, row_w.unwrap_or(0));
    run_jobs(be, &jobs, parts, out.as_mut_slice());
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A row's visibility from a tile's position range agrees with [`visible`] for every cell
    /// of the range, whenever it decides the row.
    #[test]
    fn row_visibility_agrees_with_the_cells() {
        for mask in [
            Mask::Causal,
            Mask::None,
            Mask::SlidingWindow(1),
            Mask::SlidingWindow(5),
            Mask::SlidingWindow(40),
        ] {
            for qp in 0..60u32 {
                for kmin in 0..60u32 {
                    for kmax in kmin..(kmin + 12).min(64) {
                        let cells = (kmin..=kmax).map(|k| visible(mask, qp, k));
                        match row_vis(mask, qp, kmin, kmax) {
                            RowVis::All => assert!(cells.clone().all(|v| v), "{mask:?} {qp}"),
                            RowVis::None => assert!(!cells.clone().any(|v| v), "{mask:?} {qp}"),
                            RowVis::Some => {}
                        }
                    }
                }
            }
        }
        // The cases the fast path is for are decided.
        assert_eq!(row_vis(Mask::Causal, 10, 0, 10), RowVis::All);
        assert_eq!(row_vis(Mask::Causal, 3, 5, 9), RowVis::None);
        assert_eq!(row_vis(Mask::SlidingWindow(5), 20, 16, 20), RowVis::All);
        assert_eq!(row_vis(Mask::SlidingWindow(5), 20, 0, 10), RowVis::None);
        assert_eq!(row_vis(Mask::SlidingWindow(5), 20, 10, 20), RowVis::Some);
    }

    /// The SIMD turbo4 and f16 decoders give the bits of the reference dequantizers.
    #[test]
    fn simd_decoders_equal_the_reference() {
        use specula_quant::dot::SimdLevel;
        let x: Vec<f32> = (0..256u16)
            .map(|i| (f32::from(i) * 0.61).cos() * (1.0 + f32::from(i % 5)))
            .collect();
        let coded = |ty: QType| {
            let mut q = vec![0u8; ty.row_bytes(256).unwrap()];
            specula_kv::quantize_head(ty, &x, &mut q).unwrap();
            let mut want = vec![0f32; 256];
            specula_quant::dequantize_row(ty, &q, &mut want).unwrap();
            (q, want)
        };
        let (q, want) = coded(QType::Turbo4);
        let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        let h: Vec<specula_quant::blocks::Half> = x
            .iter()
            .map(|&v| specula_quant::blocks::Half::from_f32(v))
            .collect();
        for level in [SimdLevel::Avx512, SimdLevel::Avx2, SimdLevel::Scalar] {
            let k = simd::AttnKernels::for_level(level);
            let mut got = vec![0f32; 256];
            (k.turbo4_decode)(bytemuck::cast_slice(&q), &mut got);
            assert_eq!(
                got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "{level:?}"
            );
            // Two-stage rows (one block each), packed and with a gap between rows: each
            // row's 64 values are `y_i + β·y_{64+i}` of its decoded block `y`.
            for (stride, beta) in [(66, 0.075f32), (80, 0.3)] {
                let mut rows = vec![0xA5u8; stride + 66];
                rows[..66].copy_from_slice(&q[..66]);
                rows[stride..].copy_from_slice(&q[66..]);
                // In read order: slot 2k + h of each 16 holds value k + 8h.
                let want: Vec<f32> = want
                    .chunks_exact(128)
                    .flat_map(|y| {
                        (0..64).map(move |s| {
                            let i = s / 16 * 16 + s % 16 / 2 + 8 * (s % 2);
                            y[i] + beta * y[64 + i]
                        })
                    })
                    .collect();
                let mut got = vec![f32::NAN; 128];
                (k.turbo4_two)(&rows, stride, 2, beta, &mut got);
                assert_eq!(bits(&got), bits(&want), "{level:?} stride {stride}");
            }
            for ty in [QType::Turbo2, QType::Turbo3, QType::BF16] {
                let (q, want) = coded(ty);
                got.fill(f32::NAN);
                match ty {
                    QType::Turbo2 => (k.turbo2_decode)(bytemuck::cast_slice(&q), &mut got),
                    QType::Turbo3 => (k.turbo3_decode)(bytemuck::cast_slice(&q), &mut got),
                    _ => (k.bf16_to_f32)(&q, &mut got),
                }
                assert_eq!(bits(&got), bits(&want), "{level:?} {ty}");
            }
            (k.f16_to_f32)(&h, &mut got);
            assert!(
                got.iter()
                    .zip(&h)
                    .all(|(a, b)| a.to_bits() == b.to_f32().to_bits())
            );
        }
    }

    /// The table decoders give the bits of the reference dequantizers.
    #[test]
    fn decode_head_equals_the_reference_dequantizer() {
        let x: Vec<f32> = (0..256u16)
            .map(|i| (f32::from(i) * 0.37).sin() * (1.0 + f32::from(i % 7)))
            .collect();
        for &ty in specula_kv::CACHE_TYPES {
            let mut q = vec![0u8; ty.row_bytes(256).unwrap()];
            specula_kv::quantize_head(ty, &x, &mut q).unwrap();
            let (mut a, mut b) = (vec![0f32; 256], vec![0f32; 256]);
            decode_head(ty, &q, &mut a);
            specula_quant::dequantize_row(ty, &q, &mut b).unwrap();
            assert_eq!(
                a.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                b.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "{ty}"
            );
        }
    }
}
