//! Quantized KV caches on the device: the per-head offset, the Hadamard rotation and the
//! 32-value block quantizers of the cache writes, and the queries prepared for the integer
//! dot products of attention — each with the operations, in the order, of the CPU backend's
//! cache (`specula_kv::Plane`, `RowEncoder`) and of `specula_quant`'s quantizers, so that a
//! cache on the device holds the codes and scales of the CPU backend's cache.
//!
//! A cached head is stored in the device layout of the weights (`layout`): per 32-value block
//! its codes packed at `bits` bits into `bits` u32 words (Q8_0's signed bytes biased by 128),
//! `d` and, for Q4_1 / Q5_1, `m` as f32 (the f16 the block format stores, widened). Block `b`
//! of head `h` of cell `c` is block `(c · n_kv_head + h) · blocks_per_head + b`.
//!
//! Formats are compile-time `(bits, offset, term)` with `term` [`crate::layout::Term::code`]:
//! Q8_0 `(8, 128, 1)`, Q4_0 `(4, 8, 0)`, Q5_0 `(5, 16, 2)`, Q4_1 `(4, 0, 3)`, Q5_1 `(5, 0, 3)`.
//!
//! turbo2/3/4 heads of whole 128-value groups keep, per group, the codes packed at `bits`
//! bits (`4 · bits` words) and the stored norm as f32: `specula_quant::turbo`'s layout
//! unpacked, in the rotated domain ([`kv_write_turbo()`], [`turbo_value()`]).

use cubecl::prelude::*;

use super::attention::neg_inf;
use super::matmul::exact;

/// Code `i` of the block whose words start at `at` (`bits` bits each, little-endian).
#[cube]
pub fn code_at(codes: &[u32], at: usize, i: usize, #[comptime] bits: u32) -> u32 {
    let bit = i * comptime![bits as usize];
    let w = at + bit / 32;
    let sh = u32::cast_from(bit % 32);
    let mut c = codes[w] >> sh;
    if sh + comptime![bits] > 32 {
        c |= codes[w + 1] << (32 - sh);
    }
    c & comptime![(1u32 << bits) - 1]
}

/// Value `i` of block `blk` by the format's dequantizer: `(q − offset) · d`, or `q · d + m`
/// for the formats with a min (product and sum rounded apart); a codebook format's `q` is its
/// table's value (`table` > 0, `nl` as `layout::Table::all`).
#[cube]
#[allow(
    unused_assignments,
    reason = "a kernel variable is declared before the branches that set it"
)]
pub fn block_value(
    codes: &[u32],
    bd: &[f32],
    bm: &[f32],
    nl: &[i32],
    blk: usize,
    i: usize,
    zero: u32,
    #[comptime] bits: u32,
    #[comptime] offset: u32,
    #[comptime] term: u32,
    #[comptime] table: u32,
) -> f32 {
    let c = code_at(codes, blk * comptime![bits as usize], i, bits);
    let mut qi = i32::cast_from(c) - comptime![offset.cast_signed()];
    if comptime![table > 0] {
        qi = nl[comptime![((table - 1) * 16) as usize] + c as usize];
    }
    let q = f32::cast_from(qi);
    let mut v = 0.0f32;
    if comptime![term == 3] {
        v = exact(q * bd[blk], zero) + bm[blk];
    } else {
        v = q * bd[blk];
    }
    v
}

/// `x` rounded to f16 and widened back (the scale a block stores).
#[cube]
fn f16_round(x: f32) -> f32 {
    f32::cast_from(half::f16::cast_from(x))
}

/// The normalized Sylvester–Hadamard transform of each group of `n` values of
/// `x[base..base + len]` (`n` = 0: none), as `specula_kv::hadamard`: butterflies of growing
/// span, then each value times `scale` (`1/√n`, computed by the host as the CPU does).
#[cube]
pub fn hadamard(x: &mut [f32], base: usize, len: usize, n: usize, scale: f32) {
    if n > 0 {
        let mut g = 0usize;
        while g < len {
            butterflies(x, base + g, n);
            for j in 0..n {
                x[base + g + j] *= scale;
            }
            g += n;
        }
    }
}

/// Quantizes the 32 values `x[base..base + 32]` into block `blk` by `specula_quant`'s
/// reference quantizer of the format: Q8_0 `d = amax/127`, codes `roundf(x/d)`; Q4_0 / Q5_0
/// `d = max/−offset` (`max` the first value of largest magnitude), codes
/// `min(2^bits − 1, trunc(x/d + offset + ½))`; Q4_1 / Q5_1 `d = (max − min)/(2^bits − 1)`,
/// `m = min`, codes `trunc((x − min)/d + ½)` (at most 15 for Q4_1). The codes are computed
/// with the f32 `d`; the block keeps `d` (and `m`) rounded to f16.
#[cube]
#[allow(
    unused_assignments,
    reason = "a kernel variable is declared before the branches that set it"
)]
#[allow(
    clippy::too_many_arguments,
    reason = "a block's source, its outputs and format"
)]
fn quantize_block(
    x: &mut [f32],
    base: usize,
    codes: &mut [u32],
    bd: &mut [f32],
    bm: &mut [f32],
    blk: usize,
    zero: u32,
    #[comptime] bits: u32,
    #[comptime] offset: u32,
    #[comptime] term: u32,
) {
    let words = comptime![bits as usize];
    let wb = blk * words;
    let mask = comptime![(1u32 << bits) - 1];
    for w in 0..words {
        codes[wb + w] = 0u32;
    }
    let mut d = 0.0f32;
    let mut lo = 0.0f32;
    if comptime![term == 3] {
        // The C loop starts from ±FLT_MAX: for finite values, the first value.
        let mut mn = x[base];
        let mut mx = x[base];
        for i in 0..32usize {
            let v = x[base + i];
            if v < mn {
                mn = v;
            }
            if v > mx {
                mx = v;
            }
        }
        d = (mx - mn) / f32::cast_from(mask);
        lo = mn;
    } else if comptime![term == 1] {
        let mut amax = 0.0f32;
        for i in 0..32usize {
            amax = max(amax, x[base + i].abs());
        }
        d = amax / 127.0f32;
    } else {
        let mut amax = 0.0f32;
        let mut mx = 0.0f32;
        for i in 0..32usize {
            let v = x[base + i];
            if amax < v.abs() {
                amax = v.abs();
                mx = v;
            }
        }
        d = mx / -f32::cast_from(comptime![offset]);
    }
    let mut id = 0.0f32;
    if d != 0.0 {
        id = 1.0f32 / d;
    }
    bd[blk] = f16_round(d);
    if comptime![term == 3] {
        bm[blk] = f16_round(lo);
    }
    for i in 0..32usize {
        let v = x[base + i];
        let mut c = 0u32;
        if comptime![term == 1] {
            // roundf: half away from zero (x − trunc(x) is exact).
            let p = exact(v * id, zero);
            let av = p.abs();
            let t = av.trunc();
            let mut r = t;
            if av - t >= 0.5 {
                r = t + 1.0;
            }
            let mut q = i32::cast_from(r);
            if p < 0.0 {
                q = -q;
            }
            c = u32::cast_from(q + 128i32);
        } else if comptime![term == 3] {
            let mut q = i32::cast_from((exact((v - lo) * id, zero) + 0.5f32).trunc());
            if comptime![bits == 4] {
                q = min(q, 15i32);
            }
            c = u32::cast_from(q) & mask;
        } else {
            let half_up = f32::cast_from(comptime![offset]) + 0.5f32;
            let q = min(
                i32::cast_from((exact(v * id, zero) + half_up).trunc()),
                comptime![mask.cast_signed()],
            );
            c = u32::cast_from(q) & mask;
        }
        let bit = i * comptime![bits as usize];
        let w = wb + bit / 32;
        let sh = u32::cast_from(bit % 32);
        codes[w] |= c << sh;
        if sh + comptime![bits] > 32 {
            codes[w + 1] |= c >> (32 - sh);
        }
    }
}

/// `center[c]` = the mean of column `c` over the `n` rows of `src` (`[n, width]`), summed in
/// f64 in row order and rounded once: `Plane::calibrate` on the first rows a layer writes.
/// One unit per column.
#[cube(launch)]
pub fn kv_center(src: &[f32], center: &mut [f32], n: u32, width: u32) {
    let c = ABSOLUTE_POS;
    if c < width as usize {
        let w = width as usize;
        let mut s = 0.0f64;
        for r in 0..n as usize {
            s += f64::cast_from(src[r * w + c]);
        }
        center[c] = f32::cast_from(s / f64::cast_from(n));
    }
}

/// `work[wb..wb + hd] = src[wb..wb + hd] − center[cb..cb + hd]`: a head less its offset.
#[cube]
fn less_center(src: &[f32], center: &[f32], work: &mut [f32], wb: usize, cb: usize, hd: usize) {
    for j in 0..hd {
        work[wb + j] = src[wb + j] - center[cb + j];
    }
}

/// For query head `id` (`hd` values at `id · hd`): `qm[id]` = the head · its K/V head
/// `kvh`'s offset (`dot16`), and the head copied into `out` to be rotated there.
#[cube]
#[allow(
    clippy::manual_memcpy,
    reason = "a kernel copies value by value (no slice copy on the device)"
)]
fn query_head(
    q: &[f32],
    center: &[f32],
    out: &mut [f32],
    qm: &mut [f32],
    id: usize,
    kvh: usize,
    hd: usize,
) {
    let qb = id * hd;
    qm[id] = dot16(q, qb, center, kvh * hd, hd);
    for j in 0..hd {
        out[qb + j] = q[qb + j];
    }
}

/// Writes rows of `src` (`[n, n_kv · hd]`) into cells `cells[t]` of a block-format cache: per
/// (row, head) — one unit each — the head less its offset (`center`), rotated by the Hadamard
/// transform of `had` values (0: none), quantized block by block. `work` holds
/// `n · n_kv · hd` values of scratch.
#[cube(launch)]
#[allow(
    clippy::too_many_arguments,
    reason = "a kernel's buffers, sizes and format"
)]
pub fn kv_write_blocks(
    src: &[f32],
    cells: &[u32],
    center: &[f32],
    codes: &mut [u32],
    bd: &mut [f32],
    bm: &mut [f32],
    work: &mut [f32],
    nl: &[i32],
    items: u32,
    n_kv: u32,
    hd: u32,
    had: u32,
    hscale: f32,
    zero: u32,
    #[comptime] bits: u32,
    #[comptime] offset: u32,
    #[comptime] term: u32,
    #[comptime] table: u32,
) {
    let id = ABSOLUTE_POS;
    if id < items as usize {
        let n_kv = n_kv as usize;
        let hd = hd as usize;
        let t = id / n_kv;
        let h = id % n_kv;
        let wb = id * hd;
        less_center(src, center, work, wb, h * hd, hd);
        hadamard(work, wb, hd, had as usize, hscale);
        let nb = hd / 32;
        let blk0 = (cells[t] as usize * n_kv + h) * nb;
        for b in 0..nb {
            if comptime![table == 1] {
                quantize_block_iq4nl(work, wb + b * 32, codes, bd, nl, blk0 + b, b == 0, zero);
            } else {
                quantize_block(
                    work,
                    wb + b * 32,
                    codes,
                    bd,
                    bm,
                    blk0 + b,
                    zero,
                    bits,
                    offset,
                    term,
                );
            }
        }
    }
}

/// The entry of the IQ4_NL codebook nearest to `x` (ggml's `best_index_int8`): the ends clamp,
/// a tie between neighbours goes to the upper one, NaN to the last.
#[cube]
fn best_index_nl(nl: &[i32], x: f32) -> u32 {
    let mut r = 15u32;
    if x <= f32::cast_from(nl[0]) {
        r = 0u32;
    } else if x < f32::cast_from(nl[15]) {
        let mut ml = 0u32;
        let mut mu = 15u32;
        while mu - ml > 1 {
            let mav = (ml + mu) / 2;
            if x < f32::cast_from(nl[mav as usize]) {
                mu = mav;
            } else {
                ml = mav;
            }
        }
        r = mu;
        if x - f32::cast_from(nl[(mu - 1) as usize]) < f32::cast_from(nl[mu as usize]) - x {
            r = mu - 1;
        }
    }
    r
}

/// Quantizes 32 values into IQ4_NL block `blk` as ggml-cpu writes a cache
/// (`quantize_row_iq4_nl_ref`, `ntry = −1`): the codes of `d = max/−127`, the scale their
/// least-squares refit with weights `x²`. A block whose largest magnitude is below 1e-15 gets
/// `d = 0` and the previous block's codes (code 8 for a head's first block).
#[cube]
#[allow(
    clippy::too_many_arguments,
    reason = "a block's source, its outputs and the codebook"
)]
fn quantize_block_iq4nl(
    x: &mut [f32],
    base: usize,
    codes: &mut [u32],
    bd: &mut [f32],
    nl: &[i32],
    blk: usize,
    first: bool,
    zero: u32,
) {
    let wb = blk * 4;
    let mut amax = 0.0f32;
    let mut mx = 0.0f32;
    for i in 0..32usize {
        let v = x[base + i];
        if v.abs() > amax {
            amax = v.abs();
            mx = v;
        }
    }
    if amax < 1e-15f32 {
        bd[blk] = 0.0f32;
        for w in 0..4usize {
            if first {
                codes[wb + w] = 0x8888_8888u32;
            } else {
                codes[wb + w] = codes[wb - 4 + w];
            }
        }
    } else {
        let d0 = mx / f32::cast_from(nl[0]);
        let id = 1.0f32 / d0;
        for w in 0..4usize {
            codes[wb + w] = 0u32;
        }
        let mut sumqx = 0.0f32;
        let mut sumq2 = 0.0f32;
        for i in 0..32usize {
            let v = x[base + i];
            let w = exact(v * v, zero);
            let c = best_index_nl(nl, exact(id * v, zero));
            let q = f32::cast_from(nl[c as usize]);
            let wq = exact(w * q, zero);
            sumqx += exact(wq * v, zero);
            sumq2 += exact(wq * q, zero);
            codes[wb + i / 8] |= c << u32::cast_from((i % 8) * 4);
        }
        let mut d = 0.0f32;
        if sumq2 > 0.0 {
            d = sumqx / sumq2;
        }
        bd[blk] = f16_round(d);
    }
}

/// `a[ab..ab + n] · b[bb..bb + n]` as the CPU backend's `dot_f32`: sixteen lanes of fused
/// multiply-adds (lane `l` takes values `l`, `l + 16`, …), reduced 8/4/2/1.
#[cube]
pub fn dot16(a: &[f32], ab: usize, b: &[f32], bb: usize, n: usize) -> f32 {
    let mut lanes = Array::<f32>::new(16usize);
    #[unroll]
    for l in 0..16usize {
        lanes[l] = 0.0f32;
    }
    let mut d0 = 0usize;
    while d0 < n {
        #[unroll]
        for l in 0..16usize {
            if d0 + l < n {
                lanes[l] = fma(a[ab + d0 + l], b[bb + d0 + l], lanes[l]);
            }
        }
        d0 += 16;
    }
    let mut hh = Array::<f32>::new(8usize);
    #[unroll]
    for i in 0..8usize {
        hh[i] = lanes[i] + lanes[i + 8];
    }
    let g0 = hh[0] + hh[4];
    let g1 = hh[1] + hh[5];
    let g2 = hh[2] + hh[6];
    let g3 = hh[3] + hh[7];
    (g0 + g2) + (g1 + g3)
}

/// Prepares every query head (`[items = rows · n_head, hd]`, one unit each) for the integer
/// dot products with a block-format K cache, as the CPU backend's attention does: `qm` = the
/// head · its K/V head's offset (`dot16`); the head rotated like the keys and quantized to
/// Q8_0 — or Q8_1 (`q81`: `qs` = f16(d · Σq)) for keys with a min — into `qa` (one i32 per
/// value), `qd` (`d` as f16, per block). `work` holds `items · hd` values of scratch.
#[cube(launch)]
#[allow(
    clippy::too_many_arguments,
    reason = "a kernel's buffers, sizes and format"
)]
pub fn attn_query_blocks(
    q: &[f32],
    center: &[f32],
    work: &mut [f32],
    qa: &mut [i32],
    qd: &mut [f32],
    qs: &mut [f32],
    qm: &mut [f32],
    items: u32,
    n_head: u32,
    group: u32,
    hd: u32,
    had: u32,
    hscale: f32,
    zero: u32,
    #[comptime] q81: bool,
) {
    let id = ABSOLUTE_POS;
    if id < items as usize {
        let hd = hd as usize;
        let kvh = (id % n_head as usize) / group as usize;
        let qb = id * hd;
        query_head(q, center, work, qm, id, kvh, hd);
        hadamard(work, qb, hd, had as usize, hscale);
        let nb = hd / 32;
        for b in 0..nb {
            let base = qb + b * 32;
            let mut amax = 0.0f32;
            for i in 0..32usize {
                amax = max(amax, work[base + i].abs());
            }
            let d = amax / 127.0f32;
            let mut inv = 0.0f32;
            if d != 0.0 {
                inv = 1.0f32 / d;
            }
            let mut sum = 0i32;
            for i in 0..32usize {
                let p = exact(work[base + i] * inv, zero);
                let av = p.abs();
                let t = av.trunc();
                let mut r = t;
                if av - t >= 0.5 {
                    r = t + 1.0;
                }
                let mut c = i32::cast_from(r);
                if p < 0.0 {
                    c = -c;
                }
                qa[base + i] = c;
                sum += c;
            }
            qd[id * nb + b] = f16_round(d);
            if q81 {
                qs[id * nb + b] = f16_round(f32::cast_from(sum) * d);
            }
        }
    }
}

/// The dot product of query head `qi` (prepared by [`attn_query_blocks()`]) with the cached
/// key whose blocks start at `kblk`: per block the integer sum of the codes (less `offset`)
/// times the query's codes, one float term by the format's formula, the terms added in block
/// order from 0 — the bits of `specula_quant`'s block dot products.
#[cube]
#[allow(
    unused_assignments,
    reason = "a kernel variable is declared before the branches that set it"
)]
#[allow(clippy::too_many_arguments, reason = "both operands and the format")]
pub fn key_dot(
    codes: &[u32],
    bd: &[f32],
    bm: &[f32],
    nl: &[i32],
    kblk: usize,
    qa: &[i32],
    qd: &[f32],
    qs: &[f32],
    qi: usize,
    nb: usize,
    zero: u32,
    #[comptime] bits: u32,
    #[comptime] offset: u32,
    #[comptime] term: u32,
    #[comptime] table: u32,
) -> f32 {
    let mut acc = 0.0f32;
    for b in 0..nb {
        let kb = kblk + b;
        let qbase = (qi * nb + b) * 32;
        let mut isum = 0i32;
        for i in 0..32usize {
            let code = code_at(codes, kb * comptime![bits as usize], i, bits);
            let mut c = i32::cast_from(code) - comptime![offset.cast_signed()];
            if comptime![table > 0] {
                c = nl[comptime![((table - 1) * 16) as usize] + code as usize];
            }
            isum += c * qa[qbase + i];
        }
        let fi = f32::cast_from(isum);
        let dk = bd[kb];
        let dq = qd[qi * nb + b];
        let mut tv = 0.0f32;
        if comptime![term == 0] {
            tv = exact(exact(fi * dk, zero) * dq, zero);
        } else if comptime![term == 3] {
            tv = exact((dk * dq) * fi, zero) + exact(bm[kb] * qs[qi * nb + b], zero);
        } else {
            tv = exact((dk * dq) * fi, zero);
        }
        acc += tv;
    }
    acc
}

/// Offsets into the turbo table ([`turbo_tables`]): the two sign tables of the rotation, then
/// the centroids and the thresholds of 2, 3 and 4 bits.
pub const TURBO_S2: usize = 128;
const TURBO_CENT: usize = 256;
const TURBO_THR: usize = TURBO_CENT + 4 + 8 + 16;

/// The tables the turbo kernels read, in one buffer: `wht::S1`, `wht::S2`, the centroids of
/// turbo2, turbo3, turbo4 and their thresholds.
#[must_use]
pub fn turbo_tables() -> Vec<f32> {
    use specula_quant::{turbo, wht};
    let mut t = Vec::with_capacity(TURBO_THR + 3 + 7 + 15);
    t.extend_from_slice(&wht::S1);
    t.extend_from_slice(&wht::S2);
    t.extend_from_slice(&turbo::CENTROIDS_2);
    t.extend_from_slice(&turbo::CENTROIDS_3);
    t.extend_from_slice(&turbo::CENTROIDS_4);
    t.extend_from_slice(&turbo::THRESHOLDS_2);
    t.extend_from_slice(&turbo::THRESHOLDS_3);
    t.extend_from_slice(&turbo::THRESHOLDS_4);
    t
}

/// `1/√128` as the TurboQuant rotation's f32 constant.
const INV_SQRT_128: f32 = 0.088_388_346;

/// The unnormalized Hadamard butterflies `(a, b) → (a + b, a − b)` of growing span over the
/// `n` values at `base` (`n` a power of two).
#[cube]
fn butterflies(x: &mut [f32], base: usize, n: usize) {
    let mut h = 1usize;
    while h < n {
        let mut i = 0usize;
        while i < n {
            for j in i..i + h {
                let a = x[base + j];
                let b = x[base + j + h];
                x[base + j] = a + b;
                x[base + j + h] = a - b;
            }
            i += 2 * h;
        }
        h *= 2;
    }
}

/// The TurboQuant rotation of the 128 values at `base`, as `specula_quant::wht`: forward
/// `D(s2)·H/√128·D(s1)` (`inverse`: false), or its inverse `D(s1)·H/√128·D(s2)`.
#[cube]
pub fn wht128(x: &mut [f32], base: usize, tabs: &[f32], #[comptime] inverse: bool) {
    let first = comptime![if inverse { TURBO_S2 } else { 0usize }];
    let second = comptime![if inverse { 0usize } else { TURBO_S2 }];
    for i in 0..128usize {
        x[base + i] *= tabs[first + i];
    }
    butterflies(x, base, 128);
    for i in 0..128usize {
        x[base + i] *= INV_SQRT_128 * tabs[second + i];
    }
}

/// Value `i` of a turbo head whose 128-value groups start at group `grp`: the centroid of
/// its code times the group's stored norm (`specula_quant::turbo`'s dequantizer, in the
/// rotated domain).
#[cube]
pub fn turbo_value(
    codes: &[u32],
    norms: &[f32],
    tabs: &[f32],
    grp: usize,
    i: usize,
    #[comptime] bits: u32,
) -> f32 {
    let g = grp + i / 128;
    let c = code_at(codes, g * comptime![4 * bits as usize], i % 128, bits);
    tabs[comptime![TURBO_CENT + (1usize << bits) - 4] + c as usize] * norms[g]
}

/// The value a slot `s < 64` of a two-stage head's read order holds
/// (`specula_cpu`'s `read_order`: slot `2k + h` of each 16 is value `k + 8h`).
#[cube]
pub fn two_stage_index(s: usize) -> usize {
    (s / 16) * 16 + (s % 16) / 2 + 8 * (s % 2)
}

/// Slot `s` of the 64 read values of the two-stage turbo head in group `grp` (128 codes: the
/// coarse stage, then the fine): `y_i + β·y_{64+i}` for the value `i` the slot holds, product
/// and sum rounded apart, as the CPU backend reads the head.
#[cube]
#[allow(
    clippy::too_many_arguments,
    reason = "a turbo plane's buffers and the read's terms"
)]
pub fn turbo_two_value(
    codes: &[u32],
    norms: &[f32],
    tabs: &[f32],
    grp: usize,
    s: usize,
    beta: f32,
    zero: u32,
    #[comptime] bits: u32,
) -> f32 {
    let i = two_stage_index(s);
    // Both terms kept from fusing into the sum (each is a product).
    exact(turbo_value(codes, norms, tabs, grp, i, bits), zero)
        + exact(
            beta * turbo_value(codes, norms, tabs, grp, 64 + i, bits),
            zero,
        )
}

/// Writes rows of `src` (`[n, n_kv · hd]`, `hd` a multiple of 128) into cells `cells[t]` of a
/// turbo cache, one unit per (row, head): the head less its offset, then per 128-value group
/// `specula_quant::turbo`'s reference quantizer — the norm, the unit vector rotated forward,
/// each value's code (how many thresholds lie at or below it), the norm divided by the
/// centroids' norm, stored as f16. `work` holds `n · n_kv · hd` values of scratch.
#[cube(launch)]
#[allow(
    clippy::too_many_arguments,
    unused_assignments,
    reason = "a kernel's buffers, sizes and format; kernel variables declared before the branches that set them"
)]
pub fn kv_write_turbo(
    src: &[f32],
    cells: &[u32],
    center: &[f32],
    codes: &mut [u32],
    norms: &mut [f32],
    work: &mut [f32],
    tabs: &[f32],
    items: u32,
    n_kv: u32,
    hd: u32,
    zero: u32,
    #[comptime] bits: u32,
) {
    let id = ABSOLUTE_POS;
    if id < items as usize {
        let n_kv = n_kv as usize;
        let hd = hd as usize;
        let t = id / n_kv;
        let h = id % n_kv;
        let wb = id * hd;
        less_center(src, center, work, wb, h * hd, hd);
        let words = comptime![4 * bits as usize];
        let n_thr = comptime![(1usize << bits) - 1];
        let thr = comptime![TURBO_THR + (1usize << bits) - bits as usize - 2];
        let cent = comptime![TURBO_CENT + (1usize << bits) - 4];
        let ng = hd / 128;
        let grp0 = (cells[t] as usize * n_kv + h) * ng;
        for g in 0..ng {
            let base = wb + g * 128;
            let grp = grp0 + g;
            let mut n2 = 0.0f32;
            for i in 0..128usize {
                let v = work[base + i];
                n2 += exact(v * v, zero);
            }
            let norm = n2.sqrt();
            let mut inv = 0.0f32;
            if norm > 1e-10f32 {
                inv = 1.0f32 / norm;
            }
            for i in 0..128usize {
                work[base + i] *= inv;
            }
            wht128(work, base, tabs, false);
            for w in 0..words {
                codes[grp * words + w] = 0u32;
            }
            let mut r2 = 0.0f32;
            for i in 0..128usize {
                let r = work[base + i];
                let mut c = 0u32;
                for k in 0..n_thr {
                    if r >= tabs[thr + k] {
                        c += 1;
                    }
                }
                let cv = tabs[cent + c as usize];
                r2 += exact(cv * cv, zero);
                let bit = i * comptime![bits as usize];
                let w = grp * words + bit / 32;
                let sh = u32::cast_from(bit % 32);
                codes[w] |= c << sh;
                if sh + comptime![bits] > 32 {
                    codes[w + 1] |= c >> (32 - sh);
                }
            }
            let recon = r2.sqrt();
            let mut stored = norm;
            if recon > 1e-10f32 {
                stored = norm / recon;
            }
            norms[grp] = f16_round(stored);
        }
    }
}

/// Prepares every query head (`[items = rows · n_head, hd]`, one unit each) for a turbo K
/// cache, as the CPU backend's attention does: `qm` = the head · its K/V head's offset, `qf`
/// = the head rotated forward group by group (the domain the keys are stored in), or for a
/// 64-value head stored in two stages (`two_stage`) the 64 values `R₆₄q`, read by
/// `attention::attn_chunk` in the head's read order.
#[cube(launch)]
#[allow(clippy::too_many_arguments, reason = "a kernel's buffers and sizes")]
pub fn attn_query_turbo(
    q: &[f32],
    center: &[f32],
    tabs: &[f32],
    qf: &mut [f32],
    qm: &mut [f32],
    items: u32,
    n_head: u32,
    group: u32,
    hd: u32,
    #[comptime] two_stage: bool,
) {
    let id = ABSOLUTE_POS;
    if id < items as usize {
        let hd = hd as usize;
        let kvh = (id % n_head as usize) / group as usize;
        if two_stage {
            // A 64-value head stored in two stages: `R₆₄q`.
            let qb = id * 64;
            qm[id] = dot16(q, id * 64, center, kvh * 64, 64);
            for j in 0..64usize {
                qf[qb + j] = q[id * 64 + j];
            }
            wht64(qf, qb, tabs, false);
        } else {
            let qb = id * hd;
            query_head(q, center, qf, qm, id, kvh, hd);
            for g in 0..hd / 128 {
                wht128(qf, qb + g * 128, tabs, false);
            }
        }
    }
}

/// The fork's 64-value rotation of the 64 values at `base` (`specula_quant::wht::forward64`,
/// or `inverse64`): the first 64 entries of the sign tables, scale 1/8.
#[cube]
pub fn wht64(x: &mut [f32], base: usize, tabs: &[f32], #[comptime] inverse: bool) {
    let first = comptime![if inverse { TURBO_S2 } else { 0usize }];
    let second = comptime![if inverse { 0usize } else { TURBO_S2 }];
    for i in 0..64usize {
        x[base + i] *= tabs[first + i];
    }
    butterflies(x, base, 64);
    for i in 0..64usize {
        x[base + i] *= 0.125f32 * tabs[second + i];
    }
}

/// The index of the two-stage level nearest to `t` (`specula_kv`'s `Levels::nearest`): the
/// bin of `t` gives the first midpoint to test, then the midpoints at or below `t` are
/// passed. `lf` holds the levels, the midpoints, then `lo`, `inv_width`, `last_bin`; `lu` the
/// code pairs, then the bins' first midpoints; `nl` levels.
#[cube]
fn nearest2(lf: &[f32], lu: &[u32], t: f32, #[comptime] nl: usize) -> usize {
    let x = (t - lf[2 * nl - 1]) * lf[2 * nl];
    let mut b = 0.0f32;
    if x >= 0.0 {
        b = x;
    }
    if b > lf[2 * nl + 1] {
        b = lf[2 * nl + 1];
    }
    let mut i = lu[nl + u32::cast_from(b) as usize] as usize;
    while i < nl - 1 && lf[nl + i] <= t {
        i += 1;
    }
    i
}

/// `Σ (z − s·level(z/s))²` over the 64 values at `base` (`Levels::error`).
#[cube]
fn error2(
    z: &mut [f32],
    base: usize,
    s: f32,
    lf: &[f32],
    lu: &[u32],
    zero: u32,
    #[comptime] nl: usize,
) -> f32 {
    let inv = 1.0f32 / s;
    let mut acc = 0.0f32;
    for j in 0..64usize {
        let v = z[base + j];
        let l = lf[nearest2(lf, lu, exact(v * inv, zero), nl)];
        let d = v - exact(s * l, zero);
        acc += exact(d * d, zero);
    }
    acc
}

/// The norm refitted from `s` by `steps` Lloyd steps (`Levels::refit`), rounded to f16.
#[cube]
#[allow(
    clippy::too_many_arguments,
    reason = "the head, the start and the tables"
)]
fn refit2(
    z: &mut [f32],
    base: usize,
    s0: f32,
    lf: &[f32],
    lu: &[u32],
    steps: u32,
    zero: u32,
    #[comptime] nl: usize,
) -> f32 {
    let mut s = s0;
    let mut go = true;
    for _ in 0..steps as usize {
        if go {
            let inv = 1.0f32 / s;
            let mut num = 0.0f32;
            let mut den = 0.0f32;
            for j in 0..64usize {
                let v = z[base + j];
                let l = lf[nearest2(lf, lu, exact(v * inv, zero), nl)];
                num += exact(v * l, zero);
                den += exact(l * l, zero);
            }
            if den <= 0.0 {
                go = false;
            } else {
                s = num / den;
            }
        }
    }
    f16_round(s)
}

/// Writes rows of `src` (`[n, n_kv · 64]`) into cells `cells[t]` of a turbo cache of 64-value
/// heads stored in two stages (`specula_kv`'s `encode_two_stage`), one unit per (row, head):
/// the head less its offset, rotated by the 64-value rotation; its norm `s` the best of the
/// grid `f · ‖z‖·√2` (`lf[2·nl + 3..]`), refitted by Lloyd steps and kept when no worse; each
/// value at the nearest level `s·(c_a + β·c_b)`, code `a` at position `j` and `b` at `64 + j`
/// of the head's one 128-code group. `work` holds `n · n_kv · 64` values of scratch.
#[cube(launch)]
#[allow(
    clippy::too_many_arguments,
    clippy::too_many_lines,
    unused_assignments,
    reason = "a kernel's buffers, sizes and format; kernel variables declared before the branches that set them"
)]
pub fn kv_write_turbo2s(
    src: &[f32],
    cells: &[u32],
    center: &[f32],
    codes: &mut [u32],
    norms: &mut [f32],
    work: &mut [f32],
    tabs: &[f32],
    lf: &[f32],
    lu: &[u32],
    items: u32,
    n_kv: u32,
    steps: u32,
    zero: u32,
    #[comptime] bits: u32,
    #[comptime] nl: usize,
) {
    let id = ABSOLUTE_POS;
    if id < items as usize {
        let n_kv = n_kv as usize;
        let t = id / n_kv;
        let h = id % n_kv;
        let wb = id * 64;
        less_center(src, center, work, wb, h * 64, 64);
        wht64(work, wb, tabs, false);
        let mut n2 = 0.0f32;
        for j in 0..64usize {
            let v = work[wb + j];
            n2 += exact(v * v, zero);
        }
        let base = (2.0f32 * n2).sqrt();
        let mut s = 0.0f32;
        if base > 0.0 && base <= f32::MAX {
            let mut best_e = -neg_inf();
            let mut best_s = 0.0f32;
            for k in 0..12usize {
                let fs = lf[2 * nl + 3 + k] * base;
                let e = error2(work, wb, fs, lf, lu, zero, nl);
                if e < best_e {
                    best_e = e;
                    best_s = fs;
                }
            }
            let start = f16_round(best_s);
            let fitted = refit2(work, wb, best_s, lf, lu, steps, zero, nl);
            s = start;
            // (Both errors are computed; they only decide for a finite positive fit.)
            if fitted > 0.0
                && fitted <= f32::MAX
                && error2(work, wb, fitted, lf, lu, zero, nl)
                    <= error2(work, wb, start, lf, lu, zero, nl)
            {
                s = fitted;
            }
        }
        let grp = cells[t] as usize * n_kv + h;
        norms[grp] = f16_round(s);
        let words = comptime![4 * bits as usize];
        for w in 0..words {
            codes[grp * words + w] = 0u32;
        }
        let mut inv = 0.0f32;
        if s > 0.0 {
            inv = 1.0f32 / s;
        }
        for j in 0..64usize {
            let mut p = 0u32;
            if s > 0.0 {
                p = lu[nearest2(lf, lu, exact(work[wb + j] * inv, zero), nl)];
            }
            let a = p & 0xFF;
            let b = p >> 8;
            for half in 0..2usize {
                let mut c = a;
                if half == 1 {
                    c = b;
                }
                let bit = (j + 64 * half) * comptime![bits as usize];
                let w = grp * words + bit / 32;
                let sh = u32::cast_from(bit % 32);
                codes[w] |= c << sh;
                if sh + comptime![bits] > 32 {
                    codes[w + 1] |= c >> (32 - sh);
                }
            }
        }
    }
}

/// Finishes two-stage turbo outputs (`mo`, 64 values per (row, head) in the heads' read
/// order, `two_stage_index`) as the CPU backend does: put back in order, rotated back by the
/// 64-value rotation, the K/V head's offset added; zeros for a row that saw no cell (`empty`).
#[cube(launch)]
#[allow(clippy::too_many_arguments, reason = "a kernel's buffers and sizes")]
pub fn turbo_fold64(
    mo: &[f32],
    empty: &[u32],
    vcenter: &[f32],
    tabs: &[f32],
    out: &mut [f32],
    items: u32,
    n_head: u32,
    group: u32,
) {
    let id = ABSOLUTE_POS;
    if id < items as usize {
        let ob = id * 64;
        let mb = id * 64;
        if empty[id] != 0 {
            for j in 0..64usize {
                out[ob + j] = 0.0f32;
            }
        } else {
            for t in 0..64usize {
                out[ob + two_stage_index(t)] = mo[mb + t];
            }
            wht64(out, ob, tabs, true);
            let cb = ((id % n_head as usize) / group as usize) * 64;
            for j in 0..64usize {
                out[ob + j] += vcenter[cb + j];
            }
        }
    }
}
