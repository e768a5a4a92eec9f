//! Recurrent layers' memory and the two ops that read and write it: the causal depthwise
//! convolution (`ssm_conv`) and the gated delta rule (`gated_delta_net`) of Qwen3.5's linear
//! attention.
//!
//! Each recurrent layer keeps two states (the convolution's last `kernel − 1` inputs; the delta
//! rule's `head_dim × head_dim` matrix per value head), each as a [`Timeline`]: the current
//! state and the position it has seen, the state before the latest forward, and the states
//! after that forward's last rows ([`specula_tensor::RecurrentLayers::snapshots`] of them). An
//! op called at a position `pos0` first makes the current state that of `pos0` — the current
//! one, a kept one (a rejected draft tail taken back: a snapshot selected, nothing replayed),
//! or the zero state at 0 — then runs its rows in order. Rows are processed one at a time, in
//! the same operations and order whatever the batch, so a row's result depends only on the
//! state before it and its own inputs (batch invariance: prefill, decode and verify rows agree
//! bit for bit).

use specula_tensor::{DeltaNetParams, RecurrentShape, StateSource, StateTimeline};

use crate::tensor::{CpuTensor, CpuWeight};

/// One state over time (see the module docs): the states, their positions in a
/// [`StateTimeline`].
#[derive(Clone, Debug)]
struct Timeline {
    cur: Vec<f32>,
    /// The state before the latest forward.
    before: Vec<f32>,
    /// States kept after rows of the latest forward, by slot.
    snaps: Vec<Vec<f32>>,
    pos: StateTimeline,
}

impl Timeline {
    fn new(len: usize, keep: usize) -> Self {
        Self {
            cur: vec![0.0; len],
            before: vec![0.0; len],
            snaps: Vec::new(),
            pos: StateTimeline::new(keep),
        }
    }

    /// Whether a forward may start at `pos`.
    fn holds(&self, pos: usize) -> bool {
        self.pos.holds(pos)
    }

    /// Makes `cur` the state at `pos`, then starts a forward of `rows` rows there.
    fn begin(&mut self, pos: usize, rows: usize, what: &str) {
        match self.pos.source(pos) {
            Some(StateSource::Current) => {}
            Some(StateSource::Zero) => self.cur.fill(0.0),
            Some(StateSource::Before) => self.cur.copy_from_slice(&self.before),
            Some(StateSource::Snapshot(s)) => self.cur.copy_from_slice(&self.snaps[s]),
            None => panic!("{}", self.pos.not_kept(what, pos)),
        }
        self.before.copy_from_slice(&self.cur);
        let want = self.pos.begin(pos, rows);
        self.snaps.truncate(want);
    }

    /// Records that row `i` (0-based) of a forward of `rows` rows is done.
    fn after_row(&mut self, i: usize, rows: usize) {
        if let Some(slot) = self.pos.after_row(i, rows) {
            while self.snaps.len() <= slot {
                self.snaps.push(vec![0.0; self.cur.len()]);
            }
            self.snaps[slot].copy_from_slice(&self.cur);
        }
    }
}

/// The memory of one recurrent layer.
#[derive(Clone, Debug)]
pub(crate) struct Recurrent {
    shape: RecurrentShape,
    conv: Timeline,
    ssm: Timeline,
}

impl Recurrent {
    pub(crate) fn new(shape: RecurrentShape, keep: usize) -> Self {
        Self {
            shape,
            conv: Timeline::new(shape.conv_len(), keep),
            ssm: Timeline::new(shape.state_len(), keep),
        }
    }

    /// Whether a forward may start at `pos` (both states hold it).
    pub(crate) fn holds(&self, pos: usize) -> bool {
        self.conv.holds(pos) && self.ssm.holds(pos)
    }

    /// The current states (convolution, then delta rule) and the positions they have seen.
    pub(crate) fn current(&self) -> (usize, &[f32], &[f32]) {
        (self.conv.pos.position(), &self.conv.cur, &self.ssm.cur)
    }

    /// Sets the current states to those after `n` positions (a saved slot read back).
    pub(crate) fn set_current(&mut self, n: usize, conv: &[f32], ssm: &[f32]) {
        for (t, v) in [(&mut self.conv, conv), (&mut self.ssm, ssm)] {
            t.cur.copy_from_slice(v);
            t.before.copy_from_slice(v);
            t.snaps.clear();
            t.pos.reset_to(n);
        }
    }

    /// f32 values of the two states.
    pub(crate) fn lens(&self) -> (usize, usize) {
        (self.shape.conv_len(), self.shape.state_len())
    }
}

/// `ssm_conv` of one layer (see [`specula_tensor::Backend::ssm_conv`]).
pub(crate) fn ssm_conv(
    mem: &mut Recurrent,
    pos0: usize,
    x: &CpuTensor,
    w: &CpuWeight,
    out: &mut CpuTensor,
) {
    let (kernel, ch) = (mem.shape.conv_kernel, mem.shape.conv_channels);
    assert_eq!(x.cols(), ch, "ssm_conv: rows of {ch} channels");
    assert_eq!(
        w.dims(),
        [kernel, ch],
        "ssm_conv: weight `{}` must be [{kernel}, {ch}]",
        w.name()
    );
    // The taps, channel by channel.
    let mut taps = vec![0.0f32; kernel * ch];
    for (c, t) in taps.chunks_exact_mut(kernel).enumerate() {
        if let Err(e) = specula_quant::dequantize_row(w.ty(), w.row(c), t) {
            panic!("ssm_conv: weight `{}`: {e}", w.name());
        }
    }
    let n = x.rows();
    out.resize(n, ch);
    let t = &mut mem.conv;
    t.begin(pos0, n, "ssm_conv");
    let hist = kernel - 1;
    for r in 0..n {
        let xr = x.row(r);
        let o = out.row_mut(r);
        for c in 0..ch {
            let tc = &taps[c * kernel..(c + 1) * kernel];
            let mut sum = 0.0f32;
            for (k, &wk) in tc.iter().enumerate() {
                let v = if k < hist { t.cur[k * ch + c] } else { xr[c] };
                sum += v * wk;
            }
            o[c] = sum;
        }
        // The state: drop the oldest input, append this row.
        if hist > 0 {
            t.cur.copy_within(ch.., 0);
            t.cur[(hist - 1) * ch..].copy_from_slice(xr);
        }
        t.after_row(r, n);
    }
}

/// `x / √(Σx² + eps)`, the sum in f64 as ggml's `rms_norm` sums.
fn l2_normalize(x: &mut [f32], eps: f32) {
    let mut sum = 0.0f64;
    for &v in x.iter() {
        sum += f64::from(v * v);
    }
    #[allow(
        clippy::cast_possible_truncation,
        reason = "the sum of squares rounded to f32, as ggml does"
    )]
    let s = 1.0 / ((sum as f32) + eps).sqrt();
    for v in x {
        *v *= s;
    }
}

/// The per-row gate inputs of the delta rule and the layer's vectors that activate them.
pub(crate) struct Gates<'a> {
    pub(crate) alpha: &'a CpuTensor,
    pub(crate) beta: &'a CpuTensor,
    pub(crate) dt_bias: &'a [f32],
    pub(crate) a: &'a [f32],
}

/// `log(1 + eˣ)`, as ggml's `ggml_softplus_f32`: `x` itself past 20.
#[inline]
fn softplus(x: f32) -> f32 {
    if x > 20.0 { x } else { x.exp().ln_1p() }
}

/// `gated_delta_net` of one layer (see [`specula_tensor::Backend::gated_delta_net`]).
#[allow(
    clippy::cast_precision_loss,
    reason = "a head size, converted as ggml converts it"
)]
pub(crate) fn gated_delta_net(
    mem: &mut Recurrent,
    p: &DeltaNetParams,
    q: &CpuTensor,
    k: &CpuTensor,
    v: &CpuTensor,
    gates: &Gates<'_>,
    out: &mut CpuTensor,
) {
    let (g, beta) = (gates.alpha, gates.beta);
    let sh = mem.shape;
    let (hk, hv, d) = (sh.n_head_k, sh.n_head_v, sh.head_dim);
    let n = q.rows();
    assert!(
        (k.rows(), v.rows(), g.rows(), beta.rows()) == (n, n, n, n)
            && q.cols() == hk * d
            && k.cols() == hk * d
            && v.cols() == hv * d
            && g.cols() == hv
            && beta.cols() == hv,
        "gated_delta_net: q, k [n, {hk}·{d}], v [n, {hv}·{d}], alpha and beta [n, {hv}]"
    );
    let mut decay = vec![0.0f32; hv];
    let mut strength = vec![0.0f32; hv];
    out.resize(n, hv * d);
    let scale = 1.0 / (d as f32).sqrt();
    let (mut qn, mut kn) = (vec![0.0f32; hk * d], vec![0.0f32; hk * d]);
    let mut dv = vec![0.0f32; d];
    let t = &mut mem.ssm;
    t.begin(p.pos0, n, "gated_delta_net");
    for r in 0..n {
        qn.copy_from_slice(q.row(r));
        kn.copy_from_slice(k.row(r));
        for h in 0..hk {
            l2_normalize(&mut qn[h * d..(h + 1) * d], p.eps);
            l2_normalize(&mut kn[h * d..(h + 1) * d], p.eps);
        }
        for x in &mut qn {
            *x *= scale;
        }
        let (vr, ar, br) = (v.row(r), g.row(r), beta.row(r));
        for h in 0..hv {
            decay[h] = (gates.a[h] * softplus(ar[h] + gates.dt_bias[h])).exp();
            strength[h] = 1.0 / (1.0 + (-br[h]).exp());
        }
        let o = out.row_mut(r);
        for h in 0..hv {
            let kh = if sh.grouped { h / (hv / hk) } else { h % hk };
            let (qh, khv) = (&qn[kh * d..(kh + 1) * d], &kn[kh * d..(kh + 1) * d]);
            // s[i][j]: i the key index, j the value index.
            let s = &mut t.cur[h * d * d..(h + 1) * d * d];
            for x in s.iter_mut() {
                *x *= decay[h];
            }
            // Sᵀk, then d = β (v − Sᵀk).
            dv.fill(0.0);
            for (i, &ki) in khv.iter().enumerate() {
                for (a, &sij) in dv.iter_mut().zip(&s[i * d..(i + 1) * d]) {
                    *a += sij * ki;
                }
            }
            for (j, a) in dv.iter_mut().enumerate() {
                *a = (vr[h * d + j] - *a) * strength[h];
            }
            // S += k dᵀ, then o = Sᵀq.
            let oh = &mut o[h * d..(h + 1) * d];
            oh.fill(0.0);
            for (i, (&ki, &qi)) in khv.iter().zip(qh).enumerate() {
                let row = &mut s[i * d..(i + 1) * d];
                for ((sij, &dj), oj) in row.iter_mut().zip(&dv).zip(oh.iter_mut()) {
                    *sij += ki * dj;
                    *oj += *sij * qi;
                }
            }
        }
        t.after_row(r, n);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A forward of 5 rows keeps the state before it and after rows 2, 3, 4 (keep 3): a later
    /// forward may start at any of them, at the end, or at 0 — not in between.
    #[test]
    fn a_timeline_keeps_the_states_it_promises() {
        let mut t = Timeline::new(1, 3);
        t.begin(0, 2, "t");
        for i in 0..2 {
            t.cur[0] += 1.0;
            t.after_row(i, 2);
        }
        // 2 positions; a forward of 5 from there.
        t.begin(2, 5, "t");
        for i in 0..5 {
            t.cur[0] += 10.0;
            t.after_row(i, 5);
        }
        assert_eq!(t.pos.position(), 7);
        for pos in [0, 2, 4, 5, 6, 7] {
            assert!(t.holds(pos), "{pos}");
        }
        assert!(!t.holds(3) && !t.holds(1) && !t.holds(8));
        let mut u = t.clone();
        u.begin(5, 1, "t");
        assert_eq!(u.cur[0], 32.0);
        // A new forward keeps only its own states.
        assert!(!u.holds(2) && u.holds(5) && u.holds(0));
        t.begin(2, 1, "t");
        assert_eq!(t.cur[0], 2.0);
        t.begin(0, 1, "t");
        assert_eq!(t.cur[0], 0.0);
    }
}
