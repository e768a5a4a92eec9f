//! `out = x · wᵀ` over weights in their block format.
//!
//! As in ggml-cpu: each activation row is first quantized to the weight's
//! [`QType::vec_dot_type`] (Q8_0, Q8_1 or Q8_K; float weights take the f32 row as it is), and
//! every output element is then one dot product of a weight row with an activation row, with
//! the semantics and the bits of the kernel of [`specula_quant::dot`] for the pair of types
//! (computed by that kernel or by a micro-kernel that reduces each output the same way, see
//! [`Gemm`]). Batching only decides which outputs a thread computes and in which order — never
//! how one output is reduced — so a row's result is the same bits whether it is computed alone
//! or in a batch, on any number of threads.
//!
//! Work is cut into tiles of `(activation rows × weight rows)`, numbered weight-block-major and
//! split statically over the threads: a thread owns a contiguous run of weight rows (each weight
//! byte is streamed from memory by one thread) and sweeps the activation rows with a block of
//! weight rows kept in cache; see [`Gemm`] for the per-tile kernels.
//!
//! NVFP4 weights carry a per-tensor scale outside the blocks; it is not applied here — the
//! model multiplies the output by it.

use specula_quant::QType;
use specula_quant::dot::Kernels;

use crate::CpuBackend;
use crate::gemm::Gemm;
use crate::pool::{Disjoint, split};
use crate::tensor::{CpuTensor, CpuWeight};

/// Bytes of a block of weight rows kept in cache while the activation rows of a tile pass.
const WEIGHT_BLOCK_BYTES: usize = 32 * 1024;
/// Tiles per thread aimed at, so that a static split stays balanced.
const TILES_PER_THREAD: usize = 4;
/// Activation values per thread below which quantizing runs on the calling thread alone.
const QUANTIZE_PARALLEL_MIN: usize = 16 * 1024;

/// How the outputs of one matmul are cut into tiles.
#[derive(Clone, Copy, Debug)]
struct Tiling {
    rows: usize,
    n_out: usize,
    /// Weight rows per tile.
    cb: usize,
    /// Activation rows per tile.
    rb: usize,
    /// Row blocks (tiles per weight block).
    n_rb: usize,
    /// Tiles in all.
    n_tiles: usize,
}

impl Tiling {
    fn new(rows: usize, n_out: usize, w_row_bytes: usize, n_threads: usize, align: usize) -> Self {
        // Whole groups of weight rows (`align`: eight for the micro-kernels, or the packing's
        // group), as far as the shape allows.
        let cb =
            (WEIGHT_BLOCK_BYTES / w_row_bytes.max(1)).clamp(align, 64.max(align)) / align * align;
        let cb = cb
            .min(n_out.div_ceil(n_threads).next_multiple_of(align))
            .max(1);
        let n_cb = n_out.div_ceil(cb);
        let want = TILES_PER_THREAD * n_threads;
        let n_rb = if n_cb >= want || rows == 1 {
            1
        } else {
            want.div_ceil(n_cb).min(rows)
        };
        // Whole groups of four activation rows for the one-weight-row micro-kernels.
        let rb = rows.div_ceil(n_rb);
        let rb = if rows >= 4 {
            rb.next_multiple_of(4)
        } else {
            rb
        };
        let n_rb = rows.div_ceil(rb);
        Self {
            rows,
            n_out,
            cb,
            rb,
            n_rb,
            n_tiles: n_cb * n_rb,
        }
    }

    /// The weight rows and activation rows of tile `i`.
    fn tile(&self, i: usize) -> (std::ops::Range<usize>, std::ops::Range<usize>) {
        let (c, r) = (i / self.n_rb, i % self.n_rb);
        let c0 = c * self.cb;
        let r0 = r * self.rb;
        (
            c0..(c0 + self.cb).min(self.n_out),
            r0..(r0 + self.rb).min(self.rows),
        )
    }
}

/// `out = x · wᵀ`.
pub(crate) fn matmul(be: &CpuBackend, x: &CpuTensor, w: &CpuWeight, out: &mut CpuTensor) {
    let (rows, n_in) = (x.rows(), x.cols());
    let n_out = w.n_rows();
    assert_eq!(
        n_in,
        w.row_len(),
        "matmul: `{}` takes rows of {} values, x has {n_in} columns",
        w.name(),
        w.row_len()
    );
    out.resize(rows, n_out);
    if rows == 0 || n_out == 0 {
        return;
    }
    let at = w.ty().vec_dot_type();
    let gemm = Gemm::new(be.kernels(), w.ty());
    if at == QType::F32 {
        let act: &[u8] = bytemuck::cast_slice(x.as_slice());
        run_tiles(be, &gemm, w, act, n_in * 4, &[], out);
        return;
    }
    let a_rb = at
        .row_bytes(n_in)
        .expect("a weight row is a whole number of activation blocks");
    // The lane kernels' zero-point term needs each activation block's value sum.
    let s_rb = if w.packed().is_some_and(|(p, _)| p.needs_sums()) {
        4 * (a_rb / at.type_size())
    } else {
        0
    };
    let mut scratch = be.scratch();
    scratch.resize(rows * (a_rb + s_rb), 0);
    let (act, sums) = scratch.split_at_mut(rows * a_rb);
    quantize_rows(be, at, x, a_rb, act);
    if s_rb > 0 {
        for (row, s) in act.chunks_exact(a_rb).zip(sums.chunks_exact_mut(s_rb)) {
            crate::gemm::lanes::block_sums(at, row, s);
        }
    }
    let (act, sums) = (&*act, &*sums);
    run_tiles(be, &gemm, w, act, a_rb, sums, out);
}

/// Quantizes every row of `x` to `at` into `dst` (`a_rb` bytes per row).
fn quantize_rows(be: &CpuBackend, at: QType, x: &CpuTensor, a_rb: usize, dst: &mut [u8]) {
    let (rows, n_in) = (x.rows(), x.cols());
    let quantize = |r: usize, d: &mut [u8]| {
        specula_quant::quantize_row(at, x.row(r), d)
            .expect("activation rows are whole blocks of the activation type");
    };
    let nth = be.n_threads();
    if nth == 1 || rows < 2 || rows * n_in < QUANTIZE_PARALLEL_MIN * 2 {
        for (r, d) in dst.chunks_exact_mut(a_rb).enumerate() {
            quantize(r, d);
        }
        return;
    }
    let out = Disjoint::new(dst);
    be.pool().run(&|t| {
        let mine = split(rows, nth, t);
        // SAFETY: thread t writes only the bytes of its own rows `split(rows, nth, t)`, and the
        // split's ranges are disjoint.
        let d = unsafe { out.slice(mine.start * a_rb..mine.end * a_rb) };
        for (r, d) in mine.zip(d.chunks_exact_mut(a_rb)) {
            quantize(r, d);
        }
    });
}

/// Computes every output from the activation rows `act` (`a_rb` bytes each).
fn run_tiles(
    be: &CpuBackend,
    gemm: &Gemm,
    w: &CpuWeight,
    act: &[u8],
    a_rb: usize,
    sums: &[u8],
    out: &mut CpuTensor,
) {
    let (rows, n_out) = (out.rows(), out.cols());
    let w_rb = w.row_bytes();
    let (packing, wb) = match w.packed() {
        Some((p, b)) => (Some(p), b),
        None => (None, w.bytes()),
    };
    // Rows in whole packed groups (the rest are plain).
    let n_packed = packing.map_or(0, |p| n_out / p.r * p.r);
    let nth = be.n_threads();
    let tiling = Tiling::new(rows, n_out, w_rb, nth, packing.map_or(8, |p| p.r.max(8)));
    // Bytes of block sums per activation row (absent unless the lane kernels need them).
    let s_rb = if sums.is_empty() {
        0
    } else {
        sums.len() / rows
    };
    let dst = Disjoint::new(out.as_mut_slice());
    let work = |t: usize| {
        for i in split(tiling.n_tiles, nth, t) {
            let (cols, rws) = tiling.tile(i);
            let w_tile = &wb[cols.start * w_rb..cols.end * w_rb];
            let a_tile = &act[rws.start * a_rb..rws.end * a_rb];
            let s_tile = &sums[rws.start * s_rb..rws.end * s_rb];
            let packed = packing.map(|p| (p, n_packed.min(cols.end).saturating_sub(cols.start)));
            gemm.tile(w_tile, w_rb, packed, a_tile, a_rb, s_tile, |r, c, v| {
                let at = (rws.start + r) * n_out + cols.start + c;
                // SAFETY: output (row, column) belongs to tile i alone (tiles partition the
                // outputs), and tile i is computed by this thread alone (the static split).
                unsafe { dst.write(at, v) };
            });
        }
    };
    if tiling.n_tiles == 1 || nth == 1 {
        for t in 0..nth {
            work(t);
        }
    } else {
        be.pool().run(&work);
    }
}

/// The kernels table a backend uses.
pub(crate) fn kernels_for(level: Option<specula_quant::dot::SimdLevel>) -> &'static Kernels {
    level
        .and_then(Kernels::for_level)
        .unwrap_or_else(Kernels::active)
}
