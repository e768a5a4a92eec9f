//! A mixture of experts on the CPU backend: the routing on the host (where the CPU backend's
//! tensors are), each expert's pairs run as one matmul over its gathered rows, and the
//! weighted sum in increasing expert order.

use std::cell::RefCell;

use specula_tensor::{MoeExperts, MoeRoute, route_row};

use crate::{CpuBackend, CpuTensor, CpuWeight, matmul, ops};

/// The CPU backend's routing of a batch: each row's experts by increasing id, their weights.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CpuRoutes {
    ids: Vec<u32>,
    w: Vec<f32>,
    n_used: usize,
}

impl CpuRoutes {
    /// The expert of every (row, slot) pair, row after row.
    #[must_use]
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    /// The weight of every pair.
    #[must_use]
    pub fn weights(&self) -> &[f32] {
        &self.w
    }

    /// Experts per row.
    #[must_use]
    pub fn n_used(&self) -> usize {
        self.n_used
    }
}

pub(crate) fn route(
    logits: &CpuTensor,
    p: &MoeRoute,
    bias: Option<&CpuWeight>,
    out: &mut CpuRoutes,
) {
    let ne = logits.cols();
    let bias = bias.map(|b| b.vector(ne, "moe_route"));
    assert!(
        p.n_used >= 1 && p.n_used <= ne,
        "moe_route: {} experts used of {ne}",
        p.n_used
    );
    out.ids.clear();
    out.w.clear();
    out.n_used = p.n_used;
    let mut scratch = Vec::with_capacity(ne);
    for r in 0..logits.rows() {
        route_row(
            logits.row(r),
            p,
            bias,
            &mut scratch,
            &mut out.ids,
            &mut out.w,
        );
    }
}

/// [`specula_tensor::Backend::matmul_id`]: the pairs grouped by expert, each expert's rows
/// gathered and multiplied as one matmul (the CPU matmul gives a row the bits it has alone).
pub(crate) fn matmul_id(
    be: &CpuBackend,
    x: &CpuTensor,
    experts: &[CpuWeight],
    scales: Option<&[f32]>,
    r: &CpuRoutes,
    per_pair: bool,
    out: &mut CpuTensor,
) {
    let pairs = r.ids.len();
    let n_used = r.n_used.max(1);
    let want = if per_pair { pairs } else { pairs / n_used };
    assert_eq!(
        x.rows(),
        want,
        "matmul_id: x has {} rows for {pairs} pairs of {n_used}",
        x.rows()
    );
    let Some(first) = experts.first() else {
        assert_eq!(pairs, 0, "matmul_id: pairs routed to no expert");
        out.resize(0, 0);
        return;
    };
    let (n_in, n_out) = (first.row_len(), first.n_rows());
    assert_eq!(x.cols(), n_in, "matmul_id: x has {} columns", x.cols());
    out.resize(pairs, n_out);
    if let Some(s) = scales {
        assert_eq!(s.len(), experts.len(), "matmul_id: one scale per expert");
    }
    BUFS.with(|cell| {
        let bufs = &mut *cell.borrow_mut();
        let (by, xs, ys) = (&mut bufs.by, &mut bufs.xs, &mut bufs.ys);
        // Pairs by expert, in pair order within an expert.
        by.resize_with(experts.len(), Vec::new);
        for ps in by.iter_mut() {
            ps.clear();
        }
        for (p, &e) in r.ids.iter().enumerate() {
            let e = e as usize;
            assert!(
                e < experts.len(),
                "matmul_id: expert {e} of {}",
                experts.len()
            );
            by[e].push(p);
        }
        for (e, ps) in by.iter().enumerate() {
            if ps.is_empty() {
                continue;
            }
            let w = &experts[e];
            assert_eq!(
                (w.row_len(), w.n_rows()),
                (n_in, n_out),
                "matmul_id: expert `{}` has another shape",
                w.name()
            );
            xs.resize(ps.len(), n_in);
            for (i, &p) in ps.iter().enumerate() {
                let src = if per_pair { p } else { p / n_used };
                xs.row_mut(i).copy_from_slice(x.row(src));
            }
            matmul::matmul(be, xs, w, ys);
            if let Some(s) = scales {
                ops::scale(be, ys, s[e]);
            }
            for (i, &p) in ps.iter().enumerate() {
                out.row_mut(p).copy_from_slice(ys.row(i));
            }
        }
    });
}

/// What [`matmul_id`] reuses from call to call on a thread: fresh buffers of this size would
/// be new pages to fault in on every call of every layer.
#[derive(Default)]
struct Bufs {
    by: Vec<Vec<usize>>,
    xs: CpuTensor,
    ys: CpuTensor,
    gate: CpuTensor,
    up: CpuTensor,
    act: CpuTensor,
}

thread_local! {
    static BUFS: RefCell<Bufs> = RefCell::new(Bufs::default());
}

/// [`specula_tensor::Backend::moe_ffn`]: each expert's MLP over the rows that chose it, as
/// one gather, three matmuls and one activation, its output added, weighted, to those rows;
/// experts in increasing id order, so a row's sum has [`combine`]'s order and bits.
pub(crate) fn ffn(
    be: &CpuBackend,
    x: &CpuTensor,
    ex: &MoeExperts<'_, CpuWeight>,
    r: &CpuRoutes,
    out: &mut CpuTensor,
) {
    let pairs = r.ids.len();
    let n_used = r.n_used.max(1);
    let n = pairs / n_used;
    assert_eq!(
        x.rows(),
        n,
        "moe_ffn: x has {} rows for {n} routed",
        x.rows()
    );
    let n_expert = ex.gate.len();
    assert!(
        ex.up.len() == n_expert && ex.down.len() == n_expert,
        "moe_ffn: {} gate, {} up, {} down experts",
        n_expert,
        ex.up.len(),
        ex.down.len()
    );
    let cols = ex.down.first().map_or(0, CpuWeight::n_rows);
    out.resize(n, cols);
    out.as_mut_slice().fill(0.0);
    for s in [ex.gate_scales, ex.up_scales, ex.down_scales]
        .into_iter()
        .flatten()
    {
        assert_eq!(s.len(), n_expert, "moe_ffn: one scale per expert");
    }
    BUFS.with(|cell| {
        let b = &mut *cell.borrow_mut();
        b.by.resize_with(n_expert, Vec::new);
        for ps in &mut b.by {
            ps.clear();
        }
        for (p, &e) in r.ids.iter().enumerate() {
            let e = e as usize;
            assert!(e < n_expert, "moe_ffn: expert {e} of {n_expert}");
            b.by[e].push(p);
        }
        for e in 0..n_expert {
            let ps = &b.by[e];
            if ps.is_empty() {
                continue;
            }
            b.xs.resize(ps.len(), x.cols());
            for (i, &p) in ps.iter().enumerate() {
                b.xs.row_mut(i).copy_from_slice(x.row(p / n_used));
            }
            let scaled = |be: &CpuBackend, t: &mut CpuTensor, s: Option<&[f32]>| {
                if let Some(s) = s {
                    ops::scale(be, t, s[e]);
                }
            };
            matmul::matmul(be, &b.xs, &ex.gate[e], &mut b.gate);
            scaled(be, &mut b.gate, ex.gate_scales);
            matmul::matmul(be, &b.xs, &ex.up[e], &mut b.up);
            scaled(be, &mut b.up, ex.up_scales);
            if ex.geglu {
                ops::geglu(be, &b.gate, &b.up, &mut b.act);
            } else {
                ops::swiglu(be, &b.gate, &b.up, &mut b.act);
            }
            matmul::matmul(be, &b.act, &ex.down[e], &mut b.ys);
            scaled(be, &mut b.ys, ex.down_scales);
            for (k, &p) in ps.iter().enumerate() {
                let wi = r.w[p];
                for (o, &v) in out.row_mut(p / n_used).iter_mut().zip(b.ys.row(k)) {
                    *o += wi * v;
                }
            }
        }
    });
}

/// [`specula_tensor::Backend::moe_combine`].
pub(crate) fn combine(y: &CpuTensor, r: &CpuRoutes, out: &mut CpuTensor) {
    let n_used = r.n_used.max(1);
    let pairs = r.ids.len();
    assert_eq!(
        y.rows(),
        pairs,
        "moe_combine: y has {} rows for {pairs} pairs",
        y.rows()
    );
    let cols = y.cols();
    out.resize(pairs / n_used, cols);
    for i in 0..pairs / n_used {
        let o = out.row_mut(i);
        o.fill(0.0);
        for j in 0..n_used {
            let p = i * n_used + j;
            let wi = r.w[p];
            for (o, &v) in o.iter_mut().zip(y.row(p)) {
                *o += wi * v;
            }
        }
    }
}
