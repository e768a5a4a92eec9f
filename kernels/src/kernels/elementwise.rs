//! Row-wise and element-wise ops: norms, RoPE, activations, gathers.

use cubecl::prelude::*;

use super::attention::neg_inf;
use super::matmul::{exact, tree_max_first, tree_sum};

/// `out[r] = x[r] · (1/√(mean(x[r]²) + eps)) · w` over groups of `group` columns: one cube
/// per (row, group) (`CUBE_POS_X` = row · groups + group). `has_w`: multiply by `w`
/// (`group` values). The squares (f32) are summed in f64, as ggml does: such a sum is exact
/// whatever its order for any row whose squares span less than 2^29, so the scale has the
/// CPU backend's bits.
#[cube(launch)]
pub fn rms_norm(
    x: &[f32],
    w: &[f32],
    out: &mut [f32],
    group: u32,
    eps: f32,
    #[comptime] has_w: bool,
    #[comptime] units: usize,
) {
    let base = CUBE_POS_X as usize * group as usize;
    let u = UNIT_POS_X as usize;
    let group = group as usize;
    let mut sm = Shared::<[f64]>::new_slice(units);
    let mut s = 0.0f64;
    let mut i = u;
    while i < group {
        let v = x[base + i];
        s += f64::cast_from(v * v);
        i += units;
    }
    sm[u] = s;
    tree_sum(&mut sm, u);
    let mean = f32::cast_from(sm[0] / f64::cast_from(group));
    let scale = 1.0f32 / (mean + eps).sqrt();
    let mut i = u;
    while i < group {
        if comptime![has_w] {
            out[base + i] = x[base + i] * scale * w[i];
        } else {
            out[base + i] = x[base + i] * scale;
        }
        i += units;
    }
}

/// Rotates pairs of every head of every row: `table[r·n_rot + 2i]`, `[… + 2i + 1]` hold
/// `cos θ_i`, `sin θ_i` of row `r` (computed on the host as ggml does). `neox`: pairs
/// `(i, i + n_rot/2)`, else `(2i, 2i + 1)`. One unit per (row, head, pair).
#[cube(launch)]
pub fn rope(
    x: &mut [f32],
    table: &[f32],
    n_pairs: u32,
    heads: u32,
    head_dim: u32,
    n_rot: u32,
    zero: u32,
    #[comptime] neox: bool,
) {
    let id = ABSOLUTE_POS;
    let half = (n_rot / 2) as usize;
    let per_row = heads as usize * half;
    if id < n_pairs as usize {
        let r = id / per_row;
        let h = (id % per_row) / half;
        let i = id % half;
        let base = r * heads as usize * head_dim as usize + h * head_dim as usize;
        let (a, b) = if comptime![neox] {
            (base + i, base + i + half)
        } else {
            (base + 2 * i, base + 2 * i + 1)
        };
        let c = table[r * n_rot as usize + 2 * i];
        let s = table[r * n_rot as usize + 2 * i + 1];
        let x0 = x[a];
        let x1 = x[b];
        x[a] = exact(x0 * c, zero) - exact(x1 * s, zero);
        x[b] = exact(x0 * s, zero) + exact(x1 * c, zero);
    }
}

/// `x · σ(x)` with the C library's `expf` (the CPU backend's scalar `silu`).
#[cube]
fn silu_f(x: f32) -> f32 {
    x / (1.0f32 + (-x).exp())
}

/// Round half to even of an f32 holding a value below 2^22 in magnitude.
#[cube]
fn round_even(v: f32) -> f32 {
    let fl = v.floor();
    let frac = v - fl;
    let mut r = fl;
    if frac > 0.5f32 {
        r = fl + 1.0f32;
    } else if frac == 0.5f32 {
        let fi = i32::cast_from(fl);
        if (fi & 1) == 1 {
            r = fl + 1.0f32;
        }
    }
    r
}

/// `e^x` as the CPU backend's vector activations compute it (`vexp`): `x` clamped to
/// [−150, 128], `x = n·ln 2 + r` (Cody–Waite, two-part `ln 2`, fused), `e^r` by the degree-7
/// Taylor polynomial in fused multiply-adds, times `2^⌊n/2⌋` then `2^(n − ⌊n/2⌋)`.
#[cube]
fn vexp(x: f32) -> f32 {
    let xc = min(max(x, -150.0f32), 128.0f32);
    let n = round_even(xc * core::f32::consts::LOG2_E);
    let r0 = fma(-n, 0.69314575f32, xc);
    let r = fma(-n, 1.4286068e-6f32, r0);
    let p1 = fma(r, 1.0f32 / 5040.0f32, 1.0f32 / 720.0f32);
    let p2 = fma(p1, r, 1.0f32 / 120.0f32);
    let p3 = fma(p2, r, 1.0f32 / 24.0f32);
    let p4 = fma(p3, r, 1.0f32 / 6.0f32);
    let p5 = fma(p4, r, 1.0f32 / 2.0f32);
    let p6 = fma(p5, r, 1.0f32);
    let p = fma(p6, r, 1.0f32);
    let ni = i32::cast_from(n);
    let a = ni >> 1;
    let b = ni - a;
    let pa = f32::reinterpret(u32::cast_from(a + 127) << 23u32);
    let pb = f32::reinterpret(u32::cast_from(b + 127) << 23u32);
    (p * pa) * pb
}

/// GELU as ggml-cpu computes it for f32 rows: 0 at or below −10, the identity at or above
/// 10, else the tanh formula of the input rounded to f16, rounded to f16.
#[cube]
fn gelu_f16(x: f32) -> f32 {
    let mut y = x;
    if x <= -10.0f32 {
        y = 0.0f32;
    } else if x < 10.0f32 {
        let h = f32::cast_from(half::f16::cast_from(x));
        let g = 0.5f32 * h * (1.0f32 + (0.7978846f32 * h * (1.0f32 + 0.044715f32 * h * h)).tanh());
        y = f32::cast_from(half::f16::cast_from(g));
    }
    y
}

/// Element-wise ops of one or two operands, by `op`: 0 `out = silu(a) · b`, 1
/// `out = gelu(a) · b`, 2 `out = a + b`, 3 `out = a · s`, 4 `out = s · tanh(a / s)`, 5
/// `out = silu(a)`, 6 `out = a + b[i % b_len]` (a bias), 7 `out = a · σ(b[i / per])`, 8
/// `out = a · softplus(b[i / per])` (`per` consecutive values share one gate value), 9
/// `out = 0` where `a` is NaN, else `a` clamped to `[−s, s]`.
#[cube(launch)]
pub fn elementwise(
    a: &[f32],
    b: &[f32],
    out: &mut [f32],
    n: u32,
    s: f32,
    per: u32,
    #[comptime] op: u32,
) {
    let i = ABSOLUTE_POS;
    if i < n as usize {
        let x = a[i];
        let y = comptime![op];
        if y == 0 {
            // The CPU backend's vector path covers each row's first whole multiple of 16
            // values, its scalar `silu` the rest.
            let col = i % per as usize;
            if col < per as usize / 16 * 16 {
                out[i] = (x / (1.0f32 + vexp(0.0f32 - x))) * b[i];
            } else {
                out[i] = silu_f(x) * b[i];
            }
        } else if y == 1 {
            out[i] = gelu_f16(x) * b[i];
        } else if y == 2 {
            out[i] = x + b[i];
        } else if y == 3 {
            out[i] = x * s;
        } else if y == 4 {
            out[i] = s * (x / s).tanh();
        } else if y == 5 {
            out[i] = silu_f(x);
        } else if y == 6 {
            out[i] = x + b[i % per as usize];
        } else if y == 7 {
            let g = b[i / per as usize];
            out[i] = x * (1.0f32 / (1.0f32 + (-g).exp()));
        } else if y == 9 {
            // NaN is the one value that is not equal to itself.
            #[allow(clippy::eq_op, reason = "the NaN test, inside a kernel")]
            let finite_or_inf = x == x;
            let mut c = 0.0f32;
            if x > s {
                c = s;
            } else if x < 0.0f32 - s {
                c = 0.0f32 - s;
            } else if finite_or_inf {
                c = x;
            }
            out[i] = c;
        } else {
            let g = b[i / per as usize];
            let mut sp = g;
            if g <= 20.0 {
                sp = (1.0f32 + g.exp()).ln();
            }
            out[i] = x * sp;
        }
    }
}

/// `out[r][c] = src[idx[r]][off + c]`-style gathers: row `r` of `out` (`cols` wide) takes,
/// for each group `g` of `width` columns, `src[idx[r]][g·stride + start + j]`. Copying whole
/// rows is `width = stride = cols`, `start = 0`.
#[cube(launch)]
#[allow(clippy::too_many_arguments, reason = "a gather's shape")]
pub fn gather(
    src: &[f32],
    idx: &[u32],
    out: &mut [f32],
    n: u32,
    cols: u32,
    src_cols: u32,
    width: u32,
    stride: u32,
    start: u32,
) {
    let i = ABSOLUTE_POS;
    if i < n as usize {
        let r = i / cols as usize;
        let c = i % cols as usize;
        let g = c / width as usize;
        let j = c % width as usize;
        let sr = idx[r] as usize;
        out[i] = src[sr * src_cols as usize + g * stride as usize + start as usize + j];
    }
}

/// `dst[idx[r]] = src[r]` for rows of `cols` values: one unit per value.
#[cube(launch)]
pub fn scatter(src: &[f32], idx: &[u32], dst: &mut [f32], n: u32, cols: u32) {
    let i = ABSOLUTE_POS;
    if i < n as usize {
        let r = i / cols as usize;
        let c = i % cols as usize;
        dst[idx[r] as usize * cols as usize + c] = src[i];
    }
}

/// `dst[r][col0 + c] = src[r][c]` for rows of `cols` values into rows of `dst_cols`: one unit
/// per value of `src`.
#[cube(launch)]
pub fn put_cols(src: &[f32], dst: &mut [f32], n: u32, cols: u32, dst_cols: u32, col0: u32) {
    let i = ABSOLUTE_POS;
    if i < n as usize {
        let r = i / cols as usize;
        let c = i % cols as usize;
        dst[r * dst_cols as usize + col0 as usize + c] = src[i];
    }
}

/// The first maximum of row `r` (`cols` values): each unit scans its columns `u, u + units,
/// …` in order (keeping the first of equal values; NaN never wins), then a fixed tree keeps
/// the larger value, or the lower column of equal ones, in `(s_val[0], s_idx[0])` — index
/// `cols` where no value beats −∞.
#[cube]
fn row_max_first(
    x: &[f32],
    r: usize,
    cols: usize,
    u: usize,
    s_val: &mut Shared<[f32]>,
    s_idx: &mut Shared<[u32]>,
    #[comptime] units: usize,
) {
    let mut best = neg_inf();
    // `cols` stands for "none yet" (a runtime value; it loses every tie).
    let mut at = u32::cast_from(cols);
    let mut i = u;
    while i < cols {
        let v = x[r * cols + i];
        if v > best {
            best = v;
            at = u32::cast_from(i);
        }
        i += units;
    }
    s_val[u] = best;
    s_idx[u] = at;
    tree_max_first(s_val, s_idx, u);
}

/// `out[r]` = the column of the largest value of row `r` (`cols` values), the lowest among
/// equal maxima; NaN and −∞ never win, and a row of nothing else gives `u32::MAX`
/// (`specula_tensor::NO_ARGMAX`). One cube per row: each unit scans its columns in order
/// (keeping the first of equal values), then a fixed tree keeps the larger value, or the
/// lower column of equal ones.
#[cube(launch)]
pub fn argmax_rows(x: &[f32], out: &mut [u32], cols: u32, #[comptime] units: usize) {
    let r = CUBE_POS_X as usize;
    let u = UNIT_POS_X as usize;
    let cols = cols as usize;
    let mut s_val = Shared::<[f32]>::new_slice(units);
    let mut s_idx = Shared::<[u32]>::new_slice(units);
    row_max_first(x, r, cols, u, &mut s_val, &mut s_idx, units);
    if u == 0 {
        let w = s_idx[0];
        if (w as usize) < cols {
            out[r] = w;
        } else {
            out[r] = u32::MAX;
        }
    }
}

/// `ids[r]`, `probs[r]`: row `r`'s argmax as [`argmax_rows()`] finds it (`u32::MAX` and 0 for a
/// row with no winner) and the softmax probability of its value, `1 / Σ exp(x − max)` (each
/// `exp` in f32, summed in f64 per unit in column order, then a fixed tree; NaN counts for
/// nothing). One cube per
/// row.
#[cube(launch)]
pub fn top1_rows(
    x: &[f32],
    ids: &mut [u32],
    probs: &mut [f32],
    cols: u32,
    #[comptime] units: usize,
) {
    let r = CUBE_POS_X as usize;
    let u = UNIT_POS_X as usize;
    let cols = cols as usize;
    let mut s_val = Shared::<[f32]>::new_slice(units);
    let mut s_idx = Shared::<[u32]>::new_slice(units);
    let mut s_sum = Shared::<[f64]>::new_slice(units);
    row_max_first(x, r, cols, u, &mut s_val, &mut s_idx, units);
    let w = s_idx[0];
    let max = s_val[0];
    let mut sum = 0.0f64;
    if (w as usize) < cols {
        let mut j = u;
        while j < cols {
            let v = x[r * cols + j];
            // NaN (the one value not equal to itself) counts for nothing.
            #[allow(clippy::eq_op, reason = "the NaN test, inside a kernel")]
            let number = v == v;
            if number {
                sum += f64::cast_from((v - max).exp());
            }
            j += units;
        }
    }
    s_sum[u] = sum;
    tree_sum(&mut s_sum, u);
    if u == 0 {
        if (w as usize) < cols {
            ids[r] = w;
            probs[r] = f32::cast_from(1.0f64 / s_sum[0]);
        } else {
            ids[r] = u32::MAX;
            probs[r] = 0.0f32;
        }
    }
}

/// The key of `v` whose unsigned order is `f32::total_cmp`'s
/// (`specula_tensor::total_order_key`).
#[cube]
pub(crate) fn order_key(v: f32) -> u32 {
    let b = u32::reinterpret(v);
    if b >> 31 == 1 { !b } else { b | 0x8000_0000 }
}

/// `(key[0], idx[0])` = the first in order of `(key[0..], idx[0..])`: the larger key, or the
/// lower index of equal keys, by a fixed tree; every unit calls it after writing its own.
#[cube]
pub(crate) fn tree_first_key(key: &mut Shared<[u32]>, idx: &mut Shared<[u32]>, u: usize) {
    sync_cube();
    let mut stride = CUBE_DIM_X as usize / 2;
    while stride > 0 {
        if u < stride {
            let (a, ia) = (key[u], idx[u]);
            let (o, io) = (key[u + stride], idx[u + stride]);
            if o > a || (o == a && io < ia) {
                key[u] = o;
                idx[u] = io;
            }
        }
        sync_cube();
        stride /= 2;
    }
}

/// `ids[r·k + p]`, `vals[r·k + p]` for `p < k`: the `k` largest values of row `r` (`cols`
/// values, `k ≤ cols`) from the largest, in `f32::total_cmp` order with equal values by lower
/// column first (`specula_tensor::topk_row`). One cube per row and `k` passes, each taking the
/// first value after the previous pass's in that order: each unit scans its columns, then a
/// fixed tree.
#[cube(launch)]
pub fn topk_rows(
    x: &[f32],
    ids: &mut [u32],
    vals: &mut [f32],
    cols: u32,
    k: u32,
    #[comptime] units: usize,
) {
    let r = CUBE_POS_X as usize;
    let u = UNIT_POS_X as usize;
    let n = cols as usize;
    let mut s_key = Shared::<[u32]>::new_slice(units);
    let mut s_idx = Shared::<[u32]>::new_slice(units);
    // The previous pick: (key, column); before the first pass, one past every value.
    let mut pk = 0u32;
    let mut pi = 0u32;
    let mut first = true;
    for p in 0..k as usize {
        // "None yet" is key 0 at column `cols`: any value wins over it.
        let mut bk = 0u32;
        let mut bi = cols;
        let mut i = u;
        while i < n {
            let key = order_key(x[r * n + i]);
            let c = u32::cast_from(i);
            let after = first || key < pk || (key == pk && c > pi);
            if after && (key > bk || (key == bk && c < bi)) {
                bk = key;
                bi = c;
            }
            i += units;
        }
        s_key[u] = bk;
        s_idx[u] = bi;
        tree_first_key(&mut s_key, &mut s_idx, u);
        pk = s_key[0];
        pi = s_idx[0];
        first = false;
        if u == 0 {
            ids[r * k as usize + p] = pi;
            vals[r * k as usize + p] = x[r * n + pi as usize];
        }
        sync_cube();
    }
}

/// DFlash2's grouped dynamic causal convolution (`specula_tensor::block_conv_rows`): one
/// unit per output value `(i, c)` of the `n · e` values, the taps added in order from 0.
#[cube(launch)]
pub fn block_conv(
    x: &[f32],
    dynamic: &[f32],
    base: &[f32],
    out: &mut [f32],
    n: u32,
    e: u32,
    kernel: u32,
    group: u32,
    side: u32,
    zero: u32,
) {
    let at = ABSOLUTE_POS;
    if at < (n * e) as usize {
        let e = e as usize;
        let kernel = kernel as usize;
        let groups = e / group as usize;
        let i = at / e;
        let c = at % e;
        let dy = i * 2 * kernel * groups + side as usize * kernel * groups;
        let mut acc = 0.0f32;
        let mut t = 0usize;
        while t < kernel && t <= i {
            let b = base[(side as usize * kernel + t) * e + c];
            let w = b + dynamic[dy + t * groups + c / group as usize];
            acc += exact(w * x[(i - t) * e + c], zero);
            t += 1;
        }
        out[at] = acc;
    }
}
