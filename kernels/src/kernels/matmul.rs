//! Matrix products: activation quantization and the group-format dot products.
//!
//! `out = x · wᵀ` with `x` `[rows, n_in]` and `w` `[n_out, n_in]`. For an integer weight
//! format the activations are first quantized as the CPU backend quantizes them (ggml's
//! `vec_dot_type`: Q8_0, Q8_1 or Q8_K), then each weight group is multiplied with the
//! activation codes in integers, exactly, and scaled once per group: the device computes the
//! same products as the CPU backend, in another summation order.
//!
//! One cube computes one output column for a tile of `tile` rows; its `units` units take
//! the groups of the row in turn and reduce their partial sums in shared memory in a fixed
//! tree. A row's result therefore depends only on its own activations: batch invariance.
//!
//! The same kernels run a mixture's experts (`Backend::matmul_id`) in one launch: compiled
//! with `by_id`, a cube takes one (row, expert) pair and reads the expert's weight rows by
//! the id the routing left on the device, with the bits a plain product gives that row.

use cubecl::prelude::*;

/// `(row, block)`-wise quantization of `x` (`[rows, cols]`) into codes `qa` (one i32 per
/// value), scales `da` and, for Q8_1 (`kind` 1), `sa = f16(d · Σq)` per block — one cube per
/// block (`CUBE_POS_X`), its `units` units taking the block's values in turn.
///
/// `kind`: 0 = Q8_0, 1 = Q8_1 (32-value blocks, `d = amax/127` rounded to f16 for the dot,
/// codes `round(x/d)` half away from zero), 2 = Q8_K (256-value blocks,
/// `d = 1 / (−127/max)` with `max` the first value of largest magnitude, codes `nearest_int`,
/// at most 127). The block's maximum is reduced with its first index, so it is the value the
/// CPU backend's sequential scan keeps.
///
/// `qa` is laid out for the matmul's reads: within a row, value `i` of weight group `g`
/// (groups of `gsz` values, `ng` per row) is at `i · ng + g`, so the units of a warp, which
/// take consecutive groups, read consecutive words.
#[cube(launch)]
#[allow(clippy::too_many_arguments, reason = "a kernel's buffers and sizes")]
pub fn quantize_act(
    x: &[f32],
    qa: &mut [i32],
    da: &mut [f32],
    sa: &mut [f32],
    n_in: u32,
    zero: u32,
    #[comptime] kind: u32,
    #[comptime] gsz: u32,
    #[comptime] units: usize,
) {
    let b = CUBE_POS_X as usize;
    let u = UNIT_POS_X as usize;
    let blk = comptime![if kind == 2 { 256usize } else { 32usize }];
    let base = b * blk;
    let n_in = n_in as usize;
    let ng = n_in / comptime![gsz as usize];
    // Where value `base + i` goes: row, then (position in group, group).
    let row0 = (base / n_in) * n_in;
    let c0 = base % n_in;
    let mut s_amax = Shared::<[f32]>::new_slice(units);
    let mut s_idx = Shared::<[u32]>::new_slice(units);
    let mut s_sum = Shared::<[i32]>::new_slice(units);

    // The first value of largest magnitude: per unit over its values in order, then reduced
    // keeping the larger magnitude, the smaller index on ties.
    let mut amax = 0.0f32;
    let mut idx = u32::cast_from(blk);
    let mut i = u;
    while i < blk {
        let av = x[base + i].abs();
        if av > amax {
            amax = av;
            idx = u32::cast_from(i);
        }
        i += units;
    }
    s_amax[u] = amax;
    s_idx[u] = idx;
    tree_max_first(&mut s_amax, &mut s_idx, u);
    let amax = s_amax[0];
    let first = s_idx[0] as usize;
    let mut max = 0.0f32;
    if first < blk {
        max = x[base + first];
    }

    if comptime![kind == 2] {
        let mut iscale = 0.0f32;
        if amax != 0.0 {
            iscale = -127.0f32 / max;
        }
        let mut i = u;
        while i < blk {
            let mut q = 0i32;
            if amax != 0.0 {
                // ggml's nearest_int (round half to even, |v| ≤ 127 here), without its
                // `v + 1.5·2^23` trick: a compiler may fuse that add with the product into
                // an FMA and round differently.
                let v = exact(iscale * x[base + i], zero);
                let fl = v.floor();
                let frac = v - fl;
                q = i32::cast_from(fl);
                if frac > 0.5 || (frac == 0.5 && (q & 1) == 1) {
                    q += 1;
                }
                q = min(q, 127i32);
            }
            let c = c0 + i;
            qa[row0 + (c % comptime![gsz as usize]) * ng + c / comptime![gsz as usize]] = q;
            i += units;
        }
        if u == 0 {
            if amax == 0.0 {
                da[b] = 0.0;
            } else {
                da[b] = 1.0f32 / iscale;
            }
        }
    } else {
        let d = amax / 127.0f32;
        let mut id = 0.0f32;
        if d != 0.0 {
            id = 1.0f32 / d;
        }
        let mut sum = 0i32;
        let mut i = u;
        while i < blk {
            // roundf: half away from zero, exactly (x − trunc(x) is exact).
            let v = exact(x[base + i] * id, zero);
            let av = v.abs();
            let t = av.trunc();
            let mut r = t;
            if av - t >= 0.5 {
                r = t + 1.0;
            }
            let mut q = i32::cast_from(r);
            if v < 0.0 {
                q = -q;
            }
            let c = c0 + i;
            qa[row0 + (c % comptime![gsz as usize]) * ng + c / comptime![gsz as usize]] = q;
            sum += q;
            i += units;
        }
        s_sum[u] = sum;
        tree_sum(&mut s_sum, u);
        if u == 0 {
            da[b] = f32::cast_from(half::f16::cast_from(d));
            if comptime![kind == 1] {
                sa[b] = f32::cast_from(half::f16::cast_from(f32::cast_from(s_sum[0]) * d));
            }
        }
    }
}

/// `(val[0], idx[0])` = the largest of `val[0..CUBE_DIM_X]` and its index, the lowest index
/// among equal values (NaN never wins), by a fixed tree (strides halving from
/// `CUBE_DIM_X / 2`, a power of two); every unit of the cube calls it, after writing its own
/// `val[u]`, `idx[u]`.
#[cube]
pub(crate) fn tree_max_first(val: &mut Shared<[f32]>, idx: &mut Shared<[u32]>, u: usize) {
    sync_cube();
    let mut stride = CUBE_DIM_X as usize / 2;
    while stride > 0 {
        if u < stride {
            let (a, ia) = (val[u], idx[u]);
            let (o, io) = (val[u + stride], idx[u + stride]);
            if o > a || (o == a && io < ia) {
                val[u] = o;
                idx[u] = io;
            }
        }
        sync_cube();
        stride /= 2;
    }
}

/// `sm[0] = Σ sm[0..CUBE_DIM_X]` by a fixed tree (strides halving from `CUBE_DIM_X / 2`, a
/// power of two); every unit of the cube calls it, after writing its own `sm[u]`.
#[cube]
pub(crate) fn tree_sum<N: Numeric>(sm: &mut Shared<[N]>, u: usize) {
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
}

/// A product that no compiler may fuse with the next addition (an FMA would round
/// once where the CPU backend rounds twice): its bits go through an integer XOR with `zero`,
/// a kernel argument that is 0 but unknown to the compiler (a `select` on such an argument
/// was not enough: LLVM moves the addition into the select's arms and fuses it there).
#[cube]
pub(crate) fn exact(x: f32, zero: u32) -> f32 {
    f32::reinterpret(u32::reinterpret(x) ^ zero)
}

/// `out[r][n]` = the dot product of weight row `n` with activation row `r`, with the bits of
/// specula-quant's dot products: per block (`block` values) the integer sums of the codes
/// (less `offset`) times the activation codes, times the groups' integer scales where the
/// format has them; one float term per block by the format's formula (`term`, see
/// `layout::Term`); the terms added in block order. The codes of a codebook format
/// (`table` > 0: IQ4_NL, MXFP4, NVFP4) index `nl` (`layout::Table::all`) instead; activation
/// blocks are `ablock` values, and a weight block lies inside one (NVFP4's 16-value blocks
/// read halves of Q8_0's 32).
///
/// One cube per output column (`CUBE_POS_X`) and tile of `tile` activation rows
/// (`CUBE_POS_Y`). The row is walked in segments of `seg` blocks: all units form the groups'
/// integer sums, then each block's term, then one unit per activation row adds the terms in
/// order. Weights: `codes`, `bd` (`d` per block), `bm` (`m` / `dmin`), `gsc`, `gmn` (integer
/// scale and min per group); activations: `qa`, `da`, `sa` from [`quantize_act()`].
///
/// Output column `n` reads weight row `row0 + n` (a view of a stack of experts starts at row
/// `row0`). A routed product (`by_id`, a mixture's `matmul_id`; `tile` 1) computes output row
/// `p` from activation row `p / div` and the weight rows of expert `ids[p]`, the view at
/// `row0 + ids[p] · stride`; `scaled` multiplies the sum by `scales[ids[p]]` as the `scale`
/// op does. Plain products pass any one-value `ids` and `scales`.
#[cube(launch)]
#[allow(
    clippy::too_many_arguments,
    clippy::too_many_lines,
    reason = "a kernel's buffers, sizes and phases"
)]
pub fn matmul_blocks(
    qa: &[i32],
    da: &[f32],
    sa: &[f32],
    codes: &[u32],
    bd: &[f32],
    bm: &[f32],
    gsc: &[i32],
    gmn: &[i32],
    nl: &[i32],
    ids: &[u32],
    scales: &[f32],
    out: &mut [f32],
    n_in: u32,
    n_out: u32,
    rows: u32,
    row0: u32,
    stride: u32,
    div: u32,
    zero: u32,
    #[comptime] by_id: bool,
    #[comptime] scaled: bool,
    #[comptime] bits: u32,
    #[comptime] group: u32,
    #[comptime] block: u32,
    #[comptime] offset: u32,
    #[comptime] term: u32,
    #[comptime] table: u32,
    #[comptime] ablock: u32,
    #[comptime] units: usize,
    #[comptime] tile: usize,
    #[comptime] seg: usize,
) {
    let n = CUBE_POS_X as usize;
    let r0 = CUBE_POS_Y as usize * tile;
    let u = UNIT_POS_X as usize;
    let n_in = n_in as usize;
    let rows = rows as usize;
    let gsz = comptime![group as usize];
    let gpb = comptime![(block / group) as usize];
    let words = comptime![(group * bits / 32) as usize];
    let mask = comptime![(1u32 << bits) - 1];
    let k_scales = comptime![block > group];
    let k_min = comptime![term == 4];
    let nb = n_in / comptime![block as usize];
    let ng = n_in / gsz;
    let wn = weight_row(ids, n, r0, row0, stride, by_id);
    let mut gi_sum = Shared::<[i32]>::new_slice(comptime![tile * seg * gpb]);
    let mut ga_sum = Shared::<[i32]>::new_slice(comptime![tile * seg * gpb]);
    let mut terms = Shared::<[f32]>::new_slice(comptime![tile * seg]);
    let mut sumf = Array::<f32>::new(tile);
    #[unroll]
    for t in 0..tile {
        sumf[t] = 0.0;
    }
    let mut s0 = 0usize;
    while s0 < nb {
        let nseg = min(comptime![seg], nb - s0);
        // Integer sums of each group of the segment.
        let mut c = u;
        while c < nseg * gpb {
            let g = s0 * gpb + c;
            let wg = wn * ng + g;
            let mut isum = Array::<i32>::new(tile);
            let mut asum = Array::<i32>::new(tile);
            #[unroll]
            for t in 0..tile {
                isum[t] = 0;
                asum[t] = 0;
            }
            #[unroll]
            for i in 0..gsz {
                let at = i * comptime![bits as usize];
                let w = at / 32;
                let sh = u32::cast_from(at % 32);
                let mut code = codes[wg * words + w] >> sh;
                if sh + comptime![bits] > 32 {
                    code |= codes[wg * words + w + 1] << (32 - sh);
                }
                let mut q = i32::cast_from(code & mask) - comptime![offset.cast_signed()];
                if comptime![table > 0] {
                    q = nl[comptime![((table - 1) * 16) as usize] + (code & mask) as usize];
                }
                #[unroll]
                for t in 0..tile {
                    let r = r0 + t;
                    if r < rows {
                        let a = qa[act_row(r, div, by_id) * n_in + i * ng + g];
                        isum[t] += q * a;
                        if k_min {
                            asum[t] += a;
                        }
                    }
                }
            }
            #[unroll]
            for t in 0..tile {
                gi_sum[(t * comptime![seg] * gpb) + c] = isum[t];
                ga_sum[(t * comptime![seg] * gpb) + c] = asum[t];
            }
            c += units;
        }
        sync_cube();
        // One float term per block.
        let mut bl = u;
        while bl < nseg {
            let b = s0 + bl;
            let wb = wn * nb + b;
            let dw = bd[wb];
            #[unroll]
            for t in 0..tile {
                let r = r0 + t;
                let mut tv = 0.0f32;
                if r < rows {
                    let base = t * comptime![seg] * gpb + bl * gpb;
                    let mut isum = 0i32;
                    let mut summs = 0i32;
                    #[unroll]
                    for j in 0..gpb {
                        if k_scales {
                            isum += gsc[wn * ng + b * gpb + j] * gi_sum[base + j];
                            if k_min {
                                summs += gmn[wn * ng + b * gpb + j] * ga_sum[base + j];
                            }
                        } else {
                            isum += gi_sum[base + j];
                        }
                    }
                    // The activation block holding this weight block (NVFP4's 16-value
                    // blocks read halves of Q8_0's 32).
                    let ab = act_row(r, div, by_id) * (n_in / comptime![ablock as usize])
                        + b * comptime![block as usize] / comptime![ablock as usize];
                    let dav = da[ab];
                    let fi = f32::cast_from(isum);
                    if comptime![term == 0] {
                        tv = exact(fi * dw, zero) * dav;
                    } else if comptime![term == 1 || term == 2] {
                        // `isum · (d_w · d_a)` (Q8_0) and `(d_w · d_a) · isum` (Q5_0,
                        // Q6_K): one product of the same two floats.
                        tv = (dw * dav) * fi;
                    } else if comptime![term == 3] {
                        tv = exact((dw * dav) * fi, zero) + exact(bm[wb] * sa[ab], zero);
                    } else {
                        let d = dw * dav;
                        let dmin = bm[wb] * dav;
                        tv = exact(d * fi, zero) - exact(dmin * f32::cast_from(summs), zero);
                    }
                }
                terms[t * comptime![seg] + bl] = tv;
            }
            bl += units;
        }
        sync_cube();
        // The terms added in block order, one unit per activation row.
        let mut t = u;
        while t < tile {
            for k in 0..nseg {
                sumf[t] += terms[t * comptime![seg] + k];
            }
            t += units;
        }
        sync_cube();
        s0 += comptime![seg];
    }
    let mut t = u;
    while t < tile {
        let r = r0 + t;
        if r < rows {
            out[r * n_out as usize + n] = scaled_sum(sumf[t], ids, scales, r, scaled);
        }
        t += units;
    }
}

/// `out = x · wᵀ` for f32 weights (f16 and bf16 weights are widened at upload): each
/// product rounded to f32 and summed in f64, rounded once at the end — specula-quant's
/// scalar float dot product. Same tiling, weight views and routed products (`by_id`,
/// `scaled`) as [`matmul_blocks()`], the units' partial sums added by a fixed tree.
#[cube(launch)]
#[allow(clippy::too_many_arguments, reason = "a kernel's buffers and sizes")]
pub fn matmul_f32(
    x: &[f32],
    w: &[f32],
    ids: &[u32],
    scales: &[f32],
    out: &mut [f32],
    n_in: u32,
    n_out: u32,
    rows: u32,
    row0: u32,
    stride: u32,
    div: u32,
    zero: u32,
    #[comptime] by_id: bool,
    #[comptime] scaled: bool,
    #[comptime] units: usize,
    #[comptime] tile: usize,
) {
    let n = CUBE_POS_X as usize;
    let r0 = CUBE_POS_Y as usize * tile;
    let u = UNIT_POS_X as usize;
    let n_in = n_in as usize;
    let rows = rows as usize;
    let wn = weight_row(ids, n, r0, row0, stride, by_id);
    let mut acc = Array::<f64>::new(tile);
    #[unroll]
    for t in 0..tile {
        acc[t] = 0.0;
    }
    let mut i = u;
    while i < n_in {
        let wv = w[wn * n_in + i];
        #[unroll]
        for t in 0..tile {
            let r = r0 + t;
            if r < rows {
                let xv = x[act_row(r, div, by_id) * n_in + i];
                acc[t] += f64::cast_from(exact(wv * xv, zero));
            }
        }
        i += units;
    }
    let mut sm = Shared::<[f64]>::new_slice(comptime![units * tile]);
    #[unroll]
    for t in 0..tile {
        sm[t * units + u] = acc[t];
    }
    sync_cube();
    let mut stride = CUBE_DIM_X as usize / 2;
    while stride > 0 {
        if u < stride {
            #[unroll]
            for t in 0..tile {
                let o = sm[t * units + u + stride];
                sm[t * units + u] += o;
            }
        }
        sync_cube();
        stride /= 2;
    }
    let mut t = u;
    while t < tile {
        let r = r0 + t;
        if r < rows {
            let v = f32::cast_from(sm[t * units]);
            out[r * n_out as usize + n] = scaled_sum(v, ids, scales, r, scaled);
        }
        t += units;
    }
}

/// The weight row output column `n` of a matmul cube reads: row `n` of the view at `row0`,
/// or, in a routed product (`by_id`: one output row `r0` per cube, every cube's a pair), of
/// the view of expert `ids[r0]` at `row0 + ids[r0] · stride`.
#[cube]
fn weight_row(
    ids: &[u32],
    n: usize,
    r0: usize,
    row0: u32,
    stride: u32,
    #[comptime] by_id: bool,
) -> usize {
    let mut wn = row0 as usize + n;
    if comptime![by_id] {
        wn += ids[r0] as usize * stride as usize;
    }
    wn
}

/// The activation row of output row `r`: itself, or in a routed product the row `r / div`
/// (`div` the experts per token when the pairs of a token share its row, else 1).
#[cube]
fn act_row(r: usize, div: u32, #[comptime] by_id: bool) -> usize {
    let mut a = r;
    if comptime![by_id] {
        a = r / div as usize;
    }
    a
}

/// A matmul's sum for output row `r`, times its expert's scale in a `scaled` routed product
/// (one rounded product, as the `scale` op gives it).
#[cube]
fn scaled_sum(v: f32, ids: &[u32], scales: &[f32], r: usize, #[comptime] scaled: bool) -> f32 {
    let mut o = v;
    if comptime![scaled] {
        o = v * scales[ids[r] as usize];
    }
    o
}
