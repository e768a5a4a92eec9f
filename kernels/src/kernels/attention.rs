//! Dequantizing gathers (embedding rows), cache writes and attention.

use cubecl::prelude::*;

/// `out[r] = table[ids[r]]` for a group-format table (`cols` values per row): one unit per
/// output value, read as `scale · (code − offset) + min`.
#[cube(launch)]
#[allow(clippy::too_many_arguments, reason = "a kernel's buffers and sizes")]
pub fn get_rows_groups(
    codes: &[u32],
    scales: &[f32],
    mins: &[f32],
    ids: &[u32],
    out: &mut [f32],
    n: u32,
    cols: u32,
    #[comptime] bits: u32,
    #[comptime] group: u32,
    #[comptime] offset: u32,
    #[comptime] has_min: bool,
) {
    let id = ABSOLUTE_POS;
    if id < n as usize {
        let r = id / cols as usize;
        let c = id % cols as usize;
        let groups = cols as usize / comptime![group as usize];
        let g = ids[r] as usize * groups + c / comptime![group as usize];
        let i = c % comptime![group as usize];
        let words = comptime![(group * bits / 32) as usize];
        let at = i * comptime![bits as usize];
        let w = at / 32;
        let sh = (at % 32) as u32;
        let mut code = codes[g * words + w] >> sh;
        if sh + comptime![bits] > 32 {
            code |= codes[g * words + w + 1] << (32 - sh);
        }
        let q = f32::cast_from(
            i32::cast_from(code & comptime![(1u32 << bits) - 1]) - comptime![offset as i32],
        );
        let mut v = scales[g] * q;
        if comptime![has_min] {
            v += mins[g];
        }
        out[id] = v;
    }
}

/// Writes rows of `src` (`[n, width]`) into cells `cells[t]` of a cache of element type `E`
/// (rounding to it): one unit per value.
#[cube(launch)]
pub fn kv_write<E: Float>(src: &[f32], cells: &[u32], dst: &mut [E], n: u32, width: u32) {
    let id = ABSOLUTE_POS;
    if id < n as usize {
        let t = id / width as usize;
        let c = id % width as usize;
        dst[cells[t] as usize * width as usize + c] = E::cast_from(src[id]);
    }
}

/// −∞ as a runtime value (a constant would stay a compile-time value, which a kernel cannot
/// assign to).
#[cube]
#[allow(
    unused_assignments,
    reason = "the first assignment makes the runtime variable"
)]
fn neg_inf() -> f32 {
    let mut x = 0.0f32;
    x = f32::NEG_INFINITY;
    x
}

/// Attention of one query row and head per cube (`CUBE_POS_X` = (row − row0) · n_head + head,
/// `scores` holding the launch's rows from `row0`) over
/// `kv_len` cache entries (entry `j` is cell `j % cells`, at position `kv_pos[j]`).
///
/// Three passes, each a fixed order: scores (`scale · q·k`, soft-capped, masked) into
/// `scores` and the running max; `exp(s − max)` and its sum; then each unit owns output
/// dimensions and sums `p_j · v_j` over `j` in order. `mask`: 0 causal, 1 sliding window of
/// `window`, 2 none. A row that sees no key gets zeros.
#[cube(launch)]
#[allow(clippy::too_many_arguments, reason = "attention's inputs and shape")]
pub fn attention<E: Float>(
    q: &[f32],
    k: &[E],
    v: &[E],
    q_pos: &[u32],
    kv_pos: &[u32],
    scores: &mut [f32],
    out: &mut [f32],
    row0: u32,
    kv_len: u32,
    cells: u32,
    n_head: u32,
    group: u32,
    hd_k: u32,
    hd_v: u32,
    scale: f32,
    softcap: f32,
    window: u32,
    #[comptime] mask: u32,
    #[comptime] use_softcap: bool,
    #[comptime] units: usize,
) {
    let cube = CUBE_POS_X as usize;
    let u = UNIT_POS_X as usize;
    let r = row0 as usize + cube / n_head as usize;
    let h = cube % n_head as usize;
    let kvh = h / group as usize;
    let n_kv = n_head as usize / group as usize;
    let hd_k = hd_k as usize;
    let hd_v = hd_v as usize;
    let kv_len = kv_len as usize;
    let qbase = (r * n_head as usize + h) * hd_k;
    let sbase = cube * kv_len;
    let qp = q_pos[r];
    let mut sm = Shared::<[f32]>::new_slice(units);

    let mut mx = neg_inf();
    let mut j = u;
    while j < kv_len {
        let kp = kv_pos[j];
        let mut vis = true;
        if comptime![mask == 0] {
            vis = kp <= qp;
        } else if comptime![mask == 1] {
            vis = kp <= qp && qp - kp < window;
        }
        let mut s = neg_inf();
        if vis {
            let cell = j % cells as usize;
            let kb = (cell * n_kv + kvh) * hd_k;
            let mut d = 0.0f32;
            for i in 0..hd_k {
                d += q[qbase + i] * f32::cast_from(k[kb + i]);
            }
            s = d * scale;
            if comptime![use_softcap] {
                s = softcap * (s / softcap).tanh();
            }
            mx = max(mx, s);
        }
        scores[sbase + j] = s;
        j += units;
    }
    sm[u] = mx;
    sync_cube();
    let mut stride = CUBE_DIM_X as usize / 2;
    while stride > 0 {
        if u < stride {
            let o = sm[u + stride];
            sm[u] = max(sm[u], o);
        }
        sync_cube();
        stride /= 2;
    }
    let m = sm[0];
    sync_cube();

    let mut sum = 0.0f32;
    let mut j = u;
    while j < kv_len {
        let s = scores[sbase + j];
        let mut p = 0.0f32;
        if s != f32::NEG_INFINITY {
            p = (s - m).exp();
        }
        scores[sbase + j] = p;
        sum += p;
        j += units;
    }
    sm[u] = sum;
    sync_cube();
    let mut stride = CUBE_DIM_X as usize / 2;
    while stride > 0 {
        if u < stride {
            let o = sm[u + stride];
            sm[u] += o;
        }
        sync_cube();
        stride /= 2;
    }
    let total = sm[0];
    let mut inv = 0.0f32;
    if total > 0.0 {
        inv = 1.0f32 / total;
    }

    let obase = (r * n_head as usize + h) * hd_v;
    let mut d = u;
    while d < hd_v {
        let mut acc = 0.0f32;
        for j in 0..kv_len {
            let p = scores[sbase + j];
            if p != 0.0 {
                let cell = j % cells as usize;
                acc += p * f32::cast_from(v[(cell * n_kv + kvh) * hd_v + d]);
            }
        }
        out[obase + d] = acc * inv;
        d += units;
    }
}
