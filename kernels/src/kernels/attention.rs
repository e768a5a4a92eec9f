//! Dequantizing gathers (embedding rows), cache writes and attention.

use cubecl::prelude::*;

use super::kv::{
    block_value, hadamard, key_dot, turbo_two_value, turbo_value, two_stage_index, wht128,
};
use super::matmul::exact;

/// `out[r] = table[row0 + ids[r]]` for a table in the device layout (`cols` values per row;
/// a view of a stack starts at row `row0`): one unit per output value, dequantized by ggml's formula for the format (`layout::value`);
/// codes of a codebook format (`table` > 0, `layout::Table::code`) index `nl`
/// (`layout::Table::all`).
#[cube(launch)]
#[allow(clippy::too_many_arguments, reason = "a kernel's buffers and sizes")]
pub fn get_rows_blocks(
    codes: &[u32],
    bd: &[f32],
    bm: &[f32],
    gsc: &[i32],
    gmn: &[i32],
    nl: &[i32],
    ids: &[u32],
    out: &mut [f32],
    n: u32,
    cols: u32,
    row0: u32,
    zero: u32,
    #[comptime] bits: u32,
    #[comptime] group: u32,
    #[comptime] block: u32,
    #[comptime] offset: u32,
    #[comptime] term: u32,
    #[comptime] table: u32,
) {
    let id = ABSOLUTE_POS;
    if id < n as usize {
        let r = id / cols as usize;
        let c = id % cols as usize;
        let gsz = comptime![group as usize];
        let row = row0 as usize + ids[r] as usize;
        let g = row * (cols as usize / gsz) + c / gsz;
        let b = row * (cols as usize / comptime![block as usize]) + c / comptime![block as usize];
        let words = comptime![(group * bits / 32) as usize];
        let at = (c % gsz) * comptime![bits as usize];
        let w = at / 32;
        let sh = u32::cast_from(at % 32);
        let mut code = codes[g * words + w] >> sh;
        if sh + comptime![bits] > 32 {
            code |= codes[g * words + w + 1] << (32 - sh);
        }
        let c = code & comptime![(1u32 << bits) - 1];
        let mut qi = i32::cast_from(c) - comptime![offset.cast_signed()];
        if comptime![table > 0] {
            qi = nl[comptime![((table - 1) * 16) as usize] + c as usize];
        }
        let q = f32::cast_from(qi);
        let d = bd[b];
        if comptime![term == 3] {
            out[id] = exact(q * d, zero) + bm[b];
        } else if comptime![block > group] {
            let s = d * f32::cast_from(gsc[g]);
            if comptime![term == 4] {
                out[id] = exact(s * q, zero) - exact(bm[b] * f32::cast_from(gmn[g]), zero);
            } else {
                out[id] = s * q;
            }
        } else {
            out[id] = q * d;
        }
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
pub(crate) fn neg_inf() -> f32 {
    let mut x = 0.0f32;
    x = f32::NEG_INFINITY;
    x
}

/// `e^x` by the operations of glibc's `__expf_fma`, as the CPU backend's softmax computes it
/// (`specula_cpu::expf`): in f64, `x·32/ln 2` rounded to an integer `k` by adding `1.5·2^52`,
/// `2^(k/32)` from the 32-entry table `tab`, a cubic in three fused multiply-adds, one rounding
/// to f32.
#[cube]
pub fn expf(x: f32, tab: &[u64]) -> f32 {
    let mut e = 0.0f32;
    if x.is_nan() {
        e = x + x;
    } else if x > f32::reinterpret(0x42b1_7217u32) {
        e = f32::INFINITY;
    } else if x >= f32::reinterpret(0xc2cf_f1b4u32) {
        let n = f64::reinterpret(0x4047_1547_652b_82feu64);
        let shift = f64::reinterpret(0x4338_0000_0000_0000u64);
        let xd = f64::cast_from(x);
        let kd0 = fma(n, xd, shift);
        let ki = u64::reinterpret(kd0);
        let kd = kd0 - shift;
        let r = fma(n, xd, -kd);
        let t = tab[(ki % 32) as usize] + (ki << 47u64);
        let sc = f64::reinterpret(t);
        let z = fma(
            f64::reinterpret(0x3ebc_6af8_4b91_2394u64),
            r,
            f64::reinterpret(0x3f2e_bfce_50fa_c4f3u64),
        );
        let r2 = r * r;
        let y0 = fma(f64::reinterpret(0x3f96_2e42_ff0c_52d6u64), r, 1.0f64);
        let y = fma(z, r2, y0);
        e = f32::cast_from(y * sc);
    }
    e
}

/// Cells per tile of the online softmax (the CPU backend's `TILE`).
pub const TILE: usize = 32;
/// Cells per chunk (the CPU backend's `CHUNK`): chunk states are merged in order.
pub const CHUNK: usize = 256;

/// The softmax state of one query row and head over one chunk of `CHUNK` cells, with the CPU
/// backend's operations in its order (`docs/ARCHITECTURE.md`, attention): per 32-cell tile
/// the scores (`q·k` in 16 fused lanes, reduced 8/4/2/1, `· scale`, soft-capped, −∞ where the
/// mask hides the cell), the tile max, the rescale `e^(m − m_new)` when it grows, the weights
/// `e^(s − m_new)`, `l` summed in cell order and `acc += w·v` per dimension in cell order
/// (product and sum rounded apart). One cube per (row − row0, head) (`CUBE_POS_X`) and chunk
/// (`CUBE_POS_Y`); `states` gets `[m, l, acc[hd_v]]` per (cube, chunk).
///
/// K and V are each either floats of `E` (`k`, `v`; `kbits` / `vbits` 0) or a block format
/// (`kbits`, `koff`, `kterm` as in `kernels::kv`): block-format keys are scored by the integer
/// dot product with the query prepared by `kv::attn_query_blocks` (`qa`, `qd`, `qs`) plus its
/// `q·m` (`qms`), as the CPU backend scores them; block-format values are dequantized by the
/// format's formula as they are read (a codebook format, `ktable` / `vtable` > 0, through
/// `nl`). Turbo planes (`kterm` / `vterm` 5, `kbits` the code
/// width) are read as centroid · norm in the rotated domain (`kv::turbo_value`, `tabs`), the
/// keys dotted in the float lanes with the query rotated forward (`qf`) plus its `q·m`. A
/// 64-value head stored in two stages (`ktwo` / `vtwo`, fine weight `kbeta` / `vbeta`; `hd_k`
/// / `hd_v` then 64) is read as the CPU backend reads it: 64 values `y_i + β·y_{64+i}` in its
/// read order (`kv::turbo_two_value`), against the natural-order `R₆₄q` of `qf` taken in the
/// same order; its values accumulate in that order (`kv::turbo_fold64` puts them back). The
/// unused operands are any buffer.
#[cube(launch)]
#[allow(
    clippy::too_many_arguments,
    clippy::too_many_lines,
    unused_assignments,
    reason = "attention's inputs, shape and steps; kernel variables declared before the branches that set them"
)]
pub fn attn_chunk<E: Float>(
    q: &[f32],
    k: &[E],
    v: &[E],
    kcodes: &[u32],
    kd: &[f32],
    km: &[f32],
    vcodes: &[u32],
    vd: &[f32],
    vm: &[f32],
    qa: &[i32],
    qd: &[f32],
    qs: &[f32],
    qms: &[f32],
    qf: &[f32],
    tabs: &[f32],
    nl: &[i32],
    q_pos: &[u32],
    kv_pos: &[u32],
    tab: &[u64],
    states: &mut [f32],
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
    zero: u32,
    kbeta: f32,
    vbeta: f32,
    #[comptime] mask: u32,
    #[comptime] use_softcap: bool,
    #[comptime] units: usize,
    #[comptime] ktwo: bool,
    #[comptime] vtwo: bool,
    #[comptime] kbits: u32,
    #[comptime] koff: u32,
    #[comptime] kterm: u32,
    #[comptime] vbits: u32,
    #[comptime] voff: u32,
    #[comptime] vterm: u32,
    #[comptime] ktable: u32,
    #[comptime] vtable: u32,
) {
    let cube = CUBE_POS_X as usize;
    let c = CUBE_POS_Y as usize;
    let n_chunks = CUBE_COUNT_Y as usize;
    let u = UNIT_POS_X as usize;
    let r = row0 as usize + cube / n_head as usize;
    let h = cube % n_head as usize;
    let kvh = h / group as usize;
    let n_kv = n_head as usize / group as usize;
    let hd_k = hd_k as usize;
    let hd_v = hd_v as usize;
    let kv_len = kv_len as usize;
    let qbase = (r * n_head as usize + h) * hd_k;
    let qp = q_pos[r];
    let sbase = (cube * n_chunks + c) * (hd_v + 2);
    let mut s = Shared::<[f32]>::new_slice(TILE);
    let mut w = Shared::<[f32]>::new_slice(TILE);
    let mut lanes = Shared::<[f32]>::new_slice(TILE * 16);

    let mut m = neg_inf();
    let mut l = 0.0f32;
    let mut d = u;
    while d < hd_v {
        states[sbase + 2 + d] = 0.0;
        d += units;
    }
    let j_end = min((c + 1) * CHUNK, kv_len);
    let mut j0 = c * CHUNK;
    while j0 < j_end {
        let n = min(TILE, j_end - j0);
        // Block-format keys: one cell's integer dot product per unit.
        if comptime![kbits > 0 && kterm != 5] {
            let nbk = hd_k / 32;
            let mut t = u;
            while t < n {
                let j = j0 + t;
                let kblk = ((j % cells as usize) * n_kv + kvh) * nbk;
                lanes[t * 16] = key_dot(
                    kcodes,
                    kd,
                    km,
                    nl,
                    kblk,
                    qa,
                    qd,
                    qs,
                    r * n_head as usize + h,
                    nbk,
                    zero,
                    kbits,
                    koff,
                    kterm,
                    ktable,
                );
                t += units;
            }
        }
        // Float keys: the 16 fused lanes of every cell's q·k, one (cell, lane) pair per unit
        // at a time (a warp reads a cell's 16 consecutive values of each block together).
        let mut it = u;
        while it
            < comptime![if kbits > 0 && kterm != 5 {
                0usize
            } else {
                TILE * 16
            }]
        {
            let t = it / 16;
            let lane = it % 16;
            if t < n {
                let j = j0 + t;
                let kb = ((j % cells as usize) * n_kv + kvh) * hd_k;
                let mut a = 0.0f32;
                let nblk = hd_k.div_ceil(16);
                for b in 0..nblk {
                    let dd = b * 16 + lane;
                    let mut x = 0.0f32;
                    let mut y = 0.0f32;
                    if dd < hd_k {
                        if comptime![kterm == 5 && ktwo] {
                            // Two-stage keys: slot dd of the read order.
                            x = qf[qbase + two_stage_index(dd)];
                            y = turbo_two_value(kcodes, kd, tabs, kb / 64, dd, kbeta, zero, kbits);
                        } else if comptime![kterm == 5] {
                            // Turbo keys: the rotated query against the decoded key.
                            x = qf[qbase + dd];
                            y = turbo_value(kcodes, kd, tabs, kb / comptime![128usize], dd, kbits);
                        } else {
                            x = q[qbase + dd];
                            y = f32::cast_from(k[kb + dd]);
                        }
                    }
                    a = fma(x, y, a);
                }
                lanes[it] = a;
            }
            it += units;
        }
        sync_cube();
        let mut t = u;
        while t < TILE {
            let mut sv = neg_inf();
            if t < n {
                let kp = kv_pos[j0 + t];
                let mut vis = true;
                if comptime![mask == 0] {
                    vis = kp <= qp;
                } else if comptime![mask == 1] {
                    vis = kp <= qp && qp - kp < window;
                }
                if vis {
                    let lb = t * 16;
                    let mut dot = 0.0f32;
                    let mut qm = 0.0f32;
                    if comptime![kbits > 0] {
                        // `q·k = q·(k − m) + q·m`: the stored keys less their offset.
                        qm = qms[r * n_head as usize + h];
                    }
                    if comptime![kbits > 0 && kterm != 5] {
                        dot = lanes[lb];
                    } else {
                        // The lanes reduced 8/4/2/1 as the CPU backend's 512-bit reduction.
                        let mut hh = Array::<f32>::new(8usize);
                        #[unroll]
                        for i in 0..8usize {
                            hh[i] = lanes[lb + i] + lanes[lb + i + 8];
                        }
                        let g0 = hh[0] + hh[4];
                        let g1 = hh[1] + hh[5];
                        let g2 = hh[2] + hh[6];
                        let g3 = hh[3] + hh[7];
                        dot = (g0 + g2) + (g1 + g3);
                    }
                    sv = (dot + qm) * scale;
                    if comptime![use_softcap] {
                        sv = softcap * (sv / softcap).tanh();
                    }
                }
            }
            s[t] = sv;
            t += units;
        }
        sync_cube();
        let mut tmax = neg_inf();
        for t in 0..n {
            tmax = max(tmax, s[t]);
        }
        if tmax != f32::NEG_INFINITY {
            let m_new = max(m, tmax);
            if m_new > m {
                let mut corr = 0.0f32;
                if m != f32::NEG_INFINITY {
                    corr = expf(m - m_new, tab);
                }
                l *= corr;
                let mut d = u;
                while d < hd_v {
                    states[sbase + 2 + d] *= corr;
                    d += units;
                }
                m = m_new;
            }
            let mut t = u;
            while t < n {
                w[t] = expf(s[t] - m_new, tab);
                t += units;
            }
            sync_cube();
            for t in 0..n {
                l += w[t];
            }
            let mut d = u;
            while d < hd_v {
                let mut acc = states[sbase + 2 + d];
                for t in 0..n {
                    let wt = w[t];
                    if wt != 0.0 {
                        let cell = ((j0 + t) % cells as usize) * n_kv + kvh;
                        let mut x = 0.0f32;
                        if comptime![vterm == 5 && vtwo] {
                            x = turbo_two_value(vcodes, vd, tabs, cell, d, vbeta, zero, vbits);
                        } else if comptime![vterm == 5] {
                            x = turbo_value(vcodes, vd, tabs, cell * (hd_v / 128), d, vbits);
                        } else if comptime![vbits > 0] {
                            x = block_value(
                                vcodes,
                                vd,
                                vm,
                                nl,
                                cell * (hd_v / 32) + d / 32,
                                d % 32,
                                zero,
                                vbits,
                                voff,
                                vterm,
                                vtable,
                            );
                        } else {
                            x = f32::cast_from(v[cell * hd_v + d]);
                        }
                        acc += exact(wt * x, zero);
                    }
                }
                states[sbase + 2 + d] = acc;
                d += units;
            }
        }
        sync_cube();
        j0 += TILE;
    }
    if u == 0 {
        states[sbase] = m;
        states[sbase + 1] = l;
    }
}

/// Merges the chunk states of one query row and head (`CUBE_POS_X` = (row − row0) · n_head +
/// head) in chunk order and writes the output: `L = L·a + l·b`, `ACC = ACC·a + acc·b` with
/// `a`, `b` the exps of the maxima less the new one; `out = ACC · (1/L)`, zeros for a row
/// that sees no cell. Values from a quantized cache (`v_blocks`) are then rotated back — by
/// the Hadamard transform of `had` values (0: none), or for turbo (`v_turbo`) by the inverse
/// TurboQuant rotation of each 128-value group (`tabs`) — and get their K/V head's offset
/// (`vcenter`) added, as the CPU backend finishes them. With `mark_empty`, `empty` gets 1 per
/// (row, head) that saw no cell (for `kv::turbo_fold64`, which finishes two-stage values).
#[cube(launch)]
#[allow(clippy::too_many_arguments, reason = "attention's shape")]
pub fn attn_merge(
    states: &[f32],
    tab: &[u64],
    vcenter: &[f32],
    tabs: &[f32],
    out: &mut [f32],
    empty: &mut [u32],
    row0: u32,
    n_chunks: u32,
    n_head: u32,
    group: u32,
    hd_v: u32,
    had: u32,
    hscale: f32,
    zero: u32,
    #[comptime] units: usize,
    #[comptime] v_blocks: bool,
    #[comptime] v_turbo: bool,
    #[comptime] mark_empty: bool,
) {
    let cube = CUBE_POS_X as usize;
    let u = UNIT_POS_X as usize;
    let hd_v = hd_v as usize;
    let r = row0 as usize + cube / n_head as usize;
    let h = cube % n_head as usize;
    let obase = (r * n_head as usize + h) * hd_v;
    let mut big_m = neg_inf();
    let mut big_l = 0.0f32;
    for c in 0..n_chunks as usize {
        let sb = (cube * n_chunks as usize + c) * (hd_v + 2);
        let cm = states[sb];
        let cl = states[sb + 1];
        if cm != f32::NEG_INFINITY {
            if big_m == f32::NEG_INFINITY {
                big_m = cm;
                big_l = cl;
                let mut d = u;
                while d < hd_v {
                    out[obase + d] = states[sb + 2 + d];
                    d += units;
                }
            } else {
                let mn = max(big_m, cm);
                let a = expf(big_m - mn, tab);
                let b = expf(cm - mn, tab);
                big_l = exact(big_l * a, zero) + exact(cl * b, zero);
                let mut d = u;
                while d < hd_v {
                    out[obase + d] =
                        exact(out[obase + d] * a, zero) + exact(states[sb + 2 + d] * b, zero);
                    d += units;
                }
                big_m = mn;
            }
        }
    }
    let mut d = u;
    if mark_empty && u == 0 {
        let mut e = 0u32;
        if big_l == 0.0 {
            e = 1u32;
        }
        empty[r * n_head as usize + h] = e;
    }
    if big_l == 0.0 {
        while d < hd_v {
            out[obase + d] = 0.0;
            d += units;
        }
    } else {
        let inv = 1.0f32 / big_l;
        while d < hd_v {
            out[obase + d] *= inv;
            d += units;
        }
        if comptime![v_blocks] {
            // Values stored less their offset and rotated: rotated back, the offset added
            // (the weights sum to one).
            sync_cube();
            if u == 0 {
                if comptime![v_turbo] {
                    for g in 0..hd_v / 128 {
                        wht128(out, obase + g * 128, tabs, true);
                    }
                } else {
                    hadamard(out, obase, hd_v, had as usize, hscale);
                }
                let cb = (h / group as usize) * hd_v;
                for i in 0..hd_v {
                    out[obase + i] += vcenter[cb + i];
                }
            }
        }
    }
}
