//! A mixture of experts' routing and weighted sum on the device
//! (`specula_tensor::route_row`, `Backend::moe_combine`); the experts' products are the matmul
//! kernels' routed variant (`matmul::matmul_blocks` with `by_id`).

use cubecl::prelude::*;

use super::attention::{expf, neg_inf};
use super::elementwise::{order_key, tree_first_key};
use super::matmul::exact;

/// Routes row `r = CUBE_POS_X` of `logits` (`[n, ne]`) as `specula_tensor::route_row` does,
/// one cube per row, its units over the experts: the scores into `probs` (the softmax: the
/// maximum by a fixed tree — the same value as a scan, whatever the order —, `e^(x − m)` per
/// expert, summed in expert order by one unit, times `1 / Σ`; or the sigmoid
/// `1 / (1 + e^−x)`; `e^x` by glibc's operations from `tab`, as the CPU backend's `f32::exp`),
/// then `n_used` passes, each taking by a fixed tree the best selection score
/// (`score + bias[e]`, `has_bias`) after the previous pass's in `(total_cmp` key descending,
/// expert ascending`)` order, and adding the chosen score to the sum in that order. The chosen
/// experts are exactly those at or before the last pick in that order, so one scan in expert
/// order writes them by increasing id: `ids`, and `w` = the score, `/ Σ` when `norm`,
/// `· scale`. A decode step's row of 128–512 experts takes a few tree steps per pass, not a
/// scan of the row per pass on one unit.
#[cube(launch)]
#[allow(clippy::too_many_arguments, reason = "a kernel's buffers and sizes")]
pub fn moe_route(
    logits: &[f32],
    bias: &[f32],
    tab: &[u64],
    probs: &mut [f32],
    ids: &mut [u32],
    w: &mut [f32],
    ne: u32,
    n_used: u32,
    scale: f32,
    zero: u32,
    #[comptime] sigmoid: bool,
    #[comptime] norm: bool,
    #[comptime] has_bias: bool,
    #[comptime] units: usize,
) {
    let r = CUBE_POS_X as usize;
    let u = UNIT_POS_X as usize;
    let n_e = ne as usize;
    let k = n_used as usize;
    let base = r * n_e;
    let mut s_f = Shared::<[f32]>::new_slice(units);
    let mut s_key = Shared::<[u32]>::new_slice(units);
    let mut s_idx = Shared::<[u32]>::new_slice(units);
    if comptime![sigmoid] {
        let mut e = u;
        while e < n_e {
            probs[base + e] = 1.0f32 / (1.0f32 + expf(-logits[base + e], tab));
            e += units;
        }
        sync_cube();
    } else {
        // `f32::max` from −∞: NaN never replaces the maximum, here or in the tree.
        let mut m = neg_inf();
        let mut e = u;
        while e < n_e {
            let v = logits[base + e];
            if v > m {
                m = v;
            }
            e += units;
        }
        s_f[u] = m;
        sync_cube();
        let mut stride = CUBE_DIM_X as usize / 2;
        while stride > 0 {
            if u < stride && s_f[u + stride] > s_f[u] {
                s_f[u] = s_f[u + stride];
            }
            sync_cube();
            stride /= 2;
        }
        let m = s_f[0];
        let mut e = u;
        while e < n_e {
            probs[base + e] = expf(logits[base + e] - m, tab);
            e += units;
        }
        sync_cube();
        // The sum in expert order, as the host adds it.
        if u == 0 {
            let mut sum = 0.0f32;
            for e in 0..n_e {
                sum += probs[base + e];
            }
            s_f[0] = 1.0f32 / sum;
        }
        sync_cube();
        let inv = s_f[0];
        let mut e = u;
        while e < n_e {
            probs[base + e] = exact(probs[base + e] * inv, zero);
            e += units;
        }
        sync_cube();
    }
    // The last pick `(pk, pi)`, and (unit 0) the chosen scores' sum in selection order.
    let mut pk = 0u32;
    let mut pi = 0u32;
    let mut sum = 0.0f32;
    for j in 0..k {
        // "None yet" is key 0 at expert `ne`: any expert wins over it.
        let mut bk = 0u32;
        let mut bi = ne;
        let mut e = u;
        while e < n_e {
            let key = order_key(probs[base + e] + bias_at(bias, e, has_bias));
            let c = u32::cast_from(e);
            let after = j == 0 || key < pk || (key == pk && c > pi);
            if after && (key > bk || (key == bk && c < bi)) {
                bk = key;
                bi = c;
            }
            e += units;
        }
        s_key[u] = bk;
        s_idx[u] = bi;
        tree_first_key(&mut s_key, &mut s_idx, u);
        pk = s_key[0];
        pi = s_idx[0];
        sum += probs[base + pi as usize];
        sync_cube();
    }
    if u == 0 {
        let mut slot = r * k;
        for e in 0..n_e {
            let key = order_key(probs[base + e] + bias_at(bias, e, has_bias));
            if key > pk || (key == pk && u32::cast_from(e) <= pi) {
                let mut v = probs[base + e];
                if comptime![norm] {
                    v /= sum;
                }
                ids[slot] = u32::cast_from(e);
                w[slot] = v * scale;
                slot += 1;
            }
        }
    }
}

/// What expert `e`'s selection score adds to its score: its bias, or 0 without one (the host
/// adds 0 too).
#[cube]
fn bias_at(bias: &[f32], e: usize, #[comptime] has_bias: bool) -> f32 {
    let mut b = 0.0f32;
    if comptime![has_bias] {
        b = bias[e];
    }
    b
}

/// `out[i][c] = ((0 + w[i·k] · y[i·k][c]) + w[i·k + 1] · y[i·k + 1][c]) + …` over the `k`
/// slots of row `i` in order, each product rounded before its addition: one unit per output
/// value (`n` of them, rows of `cols`).
#[cube(launch)]
pub fn moe_combine(y: &[f32], w: &[f32], out: &mut [f32], n: u32, cols: u32, k: u32, zero: u32) {
    let at = ABSOLUTE_POS;
    if at < n as usize {
        let cols = cols as usize;
        let k = k as usize;
        let i = at / cols;
        let c = at % cols;
        let mut acc = 0.0f32;
        for j in 0..k {
            let p = i * k + j;
            acc += exact(w[p] * y[p * cols + c], zero);
        }
        out[at] = acc;
    }
}
