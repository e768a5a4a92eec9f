//! Recurrent layers (Qwen3.5 / Qwen3-Next gated delta-net): the causal depthwise convolution
//! and the gated delta rule, with the CPU backend's operations in its order
//! (`specula_cpu`'s `recurrent.rs`).
//!
//! Both ops run a forward's rows one after the other inside one launch. Each unit owns a
//! column of the state — a channel of the convolution's history, or value index `j` of one
//! head's `head_dim × head_dim` matrix — whose update reads only that column and the row's
//! shared inputs, so the units never wait for each other and every row has the bits it would
//! have alone (batch invariance). The states after the forward's last rows (`keep` of them)
//! are copied into snapshot slots as the rows pass: slot `rows − 2 − i` gets the state after
//! row `i` when `rows − 1 − i ≤ keep`, the CPU backend's timeline.

use cubecl::prelude::*;

use super::attention::expf;
use super::matmul::exact;

/// `dst[t] = src[t]` for `t < n` (raw 32-bit words), one unit per word.
#[cube(launch)]
pub fn copy_u32(src: &[u32], dst: &mut [u32], n: u32) {
    let t = ABSOLUTE_POS;
    if t < n as usize {
        dst[t] = src[t];
    }
}

/// `dst[dst0 + t] = src[src0 + t]` for `t < n`, one unit per value.
#[cube(launch)]
pub fn copy_f32(src: &[f32], dst: &mut [f32], src0: u32, dst0: u32, n: u32) {
    let t = ABSOLUTE_POS;
    if t < n as usize {
        dst[dst0 as usize + t] = src[src0 as usize + t];
    }
}

/// The causal depthwise convolution over `n` rows of `x` (`[n, ch]`) with taps `w`
/// (`[ch, kernel]`) and the history `state` (`(kernel − 1) · ch`, oldest first), one unit per
/// channel: per row `Σ_k v_k · w_k` in tap order (products rounded apart), then the oldest
/// input dropped and the row appended.
#[cube(launch)]
#[allow(clippy::too_many_arguments, reason = "a kernel's buffers and sizes")]
pub fn ssm_conv(
    x: &[f32],
    w: &[f32],
    state: &mut [f32],
    snaps: &mut [f32],
    out: &mut [f32],
    n: u32,
    ch: u32,
    kernel: u32,
    keep: u32,
    zero: u32,
) {
    let c = ABSOLUTE_POS;
    let ch = ch as usize;
    if c < ch {
        let kernel = kernel as usize;
        let hist = kernel - 1;
        let rows = n as usize;
        let len = hist * ch;
        for r in 0..rows {
            let xr = x[r * ch + c];
            let mut sum = 0.0f32;
            for k in 0..kernel {
                let mut v = xr;
                if k < hist {
                    v = state[k * ch + c];
                }
                sum += exact(v * w[c * kernel + k], zero);
            }
            out[r * ch + c] = sum;
            if hist > 0 {
                for k in 0..hist - 1 {
                    state[k * ch + c] = state[(k + 1) * ch + c];
                }
                state[(hist - 1) * ch + c] = xr;
            }
            if r + 1 < rows && rows - 1 - r <= keep as usize {
                let slot = rows - 2 - r;
                for k in 0..hist {
                    snaps[slot * len + k * ch + c] = state[k * ch + c];
                }
            }
        }
    }
}

/// L2-normalizes each key head of `q` and `k` (`[n, hk · d]`, one unit per (row, head)):
/// `x · 1/√(Σx² + eps)` with the squares (rounded to f32) summed in f64 and the sum rounded
/// to f32, as ggml; `q` then times `scale`.
#[cube(launch)]
#[allow(clippy::too_many_arguments, reason = "a kernel's buffers and sizes")]
pub fn delta_norm(
    q: &[f32],
    k: &[f32],
    qn: &mut [f32],
    kn: &mut [f32],
    items: u32,
    d: u32,
    eps: f32,
    scale: f32,
    zero: u32,
) {
    let id = ABSOLUTE_POS;
    if id < items as usize {
        let d = d as usize;
        let base = id * d;
        let mut sq = 0.0f64;
        let mut sk = 0.0f64;
        for i in 0..d {
            let a = q[base + i];
            let b = k[base + i];
            sq += f64::cast_from(exact(a * a, zero));
            sk += f64::cast_from(exact(b * b, zero));
        }
        let iq = 1.0f32 / (f32::cast_from(sq) + eps).sqrt();
        let ik = 1.0f32 / (f32::cast_from(sk) + eps).sqrt();
        for i in 0..d {
            qn[base + i] = exact(q[base + i] * iq, zero) * scale;
            kn[base + i] = k[base + i] * ik;
        }
    }
}

/// The gates of each (row, value head) (`[n, hv]`, one unit each): the decay
/// `e^(a · softplus(alpha + dt_bias))` (softplus `ln(1 + eˣ)`, `x` itself past 20) and the
/// strength `1 / (1 + e^−beta)`, `e^x` by glibc's `expf` as the CPU backend computes it.
#[cube(launch)]
#[allow(clippy::too_many_arguments, reason = "a kernel's buffers and sizes")]
pub fn delta_gates(
    alpha: &[f32],
    beta: &[f32],
    dt_bias: &[f32],
    a: &[f32],
    tab: &[u64],
    decay: &mut [f32],
    strength: &mut [f32],
    items: u32,
    hv: u32,
) {
    let id = ABSOLUTE_POS;
    if id < items as usize {
        let h = id % hv as usize;
        let x = alpha[id] + dt_bias[h];
        let mut sp = x;
        if x <= 20.0f32 {
            sp = expf(x, tab).log1p();
        }
        decay[id] = expf(a[h] * sp, tab);
        strength[id] = 1.0f32 / (1.0f32 + expf(-beta[id], tab));
    }
}

/// The gated delta rule over `n` rows, one unit per (value head `h`, value index `j`): per
/// row the column `S[·][j]` decayed, `dv = Σᵢ S[i][j]·k[i]`, `dv = (v[j] − dv)·β`, then for
/// each `i` in order `S[i][j] += k[i]·dv` and `o[j] += S[i][j]·q[i]` — the CPU backend's
/// operations, products and sums rounded apart. Value head `h` reads key head
/// `h / (hv / hk)` when `grouped`, else `h % hk`.
#[cube(launch)]
#[allow(
    clippy::too_many_arguments,
    reason = "the rule's inputs, state and sizes"
)]
pub fn delta_rule(
    qn: &[f32],
    kn: &[f32],
    v: &[f32],
    decay: &[f32],
    strength: &[f32],
    state: &mut [f32],
    snaps: &mut [f32],
    out: &mut [f32],
    n: u32,
    hk: u32,
    hv: u32,
    d: u32,
    keep: u32,
    zero: u32,
    #[comptime] grouped: bool,
) {
    let id = ABSOLUTE_POS;
    let hv = hv as usize;
    let d = d as usize;
    if id < hv * d {
        let h = id / d;
        let j = id % d;
        let hk = hk as usize;
        let mut kh = h % hk;
        if grouped {
            kh = h / (hv / hk);
        }
        let sb = h * d * d;
        let len = hv * d * d;
        let rows = n as usize;
        for r in 0..rows {
            let dec = decay[r * hv + h];
            let kb = r * hk * d + kh * d;
            let mut dv = 0.0f32;
            for i in 0..d {
                let s = state[sb + i * d + j] * dec;
                state[sb + i * d + j] = s;
                dv += exact(s * kn[kb + i], zero);
            }
            let dj = exact(
                (v[r * hv * d + h * d + j] - dv) * strength[r * hv + h],
                zero,
            );
            let mut o = 0.0f32;
            for i in 0..d {
                let s = state[sb + i * d + j] + exact(kn[kb + i] * dj, zero);
                state[sb + i * d + j] = s;
                o += exact(s * qn[kb + i], zero);
            }
            out[r * hv * d + h * d + j] = o;
            if r + 1 < rows && rows - 1 - r <= keep as usize {
                let slot = rows - 2 - r;
                for i in 0..d {
                    snaps[slot * len + sb + i * d + j] = state[sb + i * d + j];
                }
            }
        }
    }
}
