//! A mixture of experts' routing and weighted sum on the device
//! (`specula_tensor::route_row`, `Backend::moe_combine`); the experts' products are the matmul
//! kernels' routed variant (`matmul::matmul_blocks` with `by_id`).

use cubecl::prelude::*;

use super::attention::{expf, neg_inf};
use super::elementwise::order_key;
use super::matmul::exact;

/// Routes row `r` of `logits` (`[n, ne]`) as `specula_tensor::route_row` does, one unit per
/// row. The scores go to `probs`: the softmax (the maximum, `e^(x − m)` per expert summed in
/// expert order, each times `1 / Σ`) or the sigmoid `1 / (1 + e^−x)`, `e^x` by glibc's
/// operations from `tab` as the CPU backend's `f32::exp` computes it. Then `n_used` passes
/// each take the best selection score (the score plus `bias[e]` when `has_bias`) after the
/// previous pass's pick, in the order of `total_cmp` keys descending and experts ascending,
/// and add the chosen scores up in that order. The chosen experts are exactly those at or
/// before the last pick in that order, so one scan in expert order writes them by increasing
/// id, with no list of them kept: `ids`, and `w` = the score, `/ Σ` when `norm`, `· scale`.
#[cube(launch)]
#[allow(clippy::too_many_arguments, reason = "a kernel's buffers and sizes")]
pub fn moe_route(
    logits: &[f32],
    bias: &[f32],
    tab: &[u64],
    probs: &mut [f32],
    ids: &mut [u32],
    w: &mut [f32],
    n: u32,
    ne: u32,
    n_used: u32,
    scale: f32,
    zero: u32,
    #[comptime] sigmoid: bool,
    #[comptime] norm: bool,
    #[comptime] has_bias: bool,
) {
    let r = ABSOLUTE_POS;
    if r < n as usize {
        let ne = ne as usize;
        let k = n_used as usize;
        let base = r * ne;
        if comptime![sigmoid] {
            for e in 0..ne {
                probs[base + e] = 1.0f32 / (1.0f32 + expf(-logits[base + e], tab));
            }
        } else {
            // `f32::max` from −∞: NaN never replaces the maximum, as here.
            let mut m = neg_inf();
            for e in 0..ne {
                let v = logits[base + e];
                if v > m {
                    m = v;
                }
            }
            let mut sum = 0.0f32;
            for e in 0..ne {
                let p = expf(logits[base + e] - m, tab);
                probs[base + e] = p;
                sum += p;
            }
            let inv = 1.0f32 / sum;
            for e in 0..ne {
                probs[base + e] = exact(probs[base + e] * inv, zero);
            }
        }
        // The last pick `(pk, pi)` and the chosen scores' sum in selection order.
        let mut pk = 0u32;
        let mut pi = 0u32;
        let mut sum = 0.0f32;
        for j in 0..k {
            let mut bk = 0u32;
            let mut bi = 0u32;
            let mut found = false;
            for e in 0..ne {
                let key = order_key(probs[base + e] + bias_at(bias, e, has_bias));
                let c = u32::cast_from(e);
                let after = j == 0 || key < pk || (key == pk && c > pi);
                // Experts come in increasing order: among equal keys the first one stays.
                if after && (!found || key > bk) {
                    bk = key;
                    bi = c;
                    found = true;
                }
            }
            pk = bk;
            pi = bi;
            sum += probs[base + pi as usize];
        }
        let mut slot = r * k;
        for e in 0..ne {
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
