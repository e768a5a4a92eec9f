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

use cubecl::prelude::*;

/// `(row, block)`-wise quantization of `x` (`[rows, cols]`) into codes `qa` (one i32 per
/// value), scales `da` and, for Q8_1 (`kind` 1), `sa = f16(d · Σq)` per block.
/// `kind`: 0 = Q8_0, 1 = Q8_1 (32-value blocks, `d = amax/127` rounded to f16 for the dot,
/// codes `round(x/d)` half away from zero), 2 = Q8_K (256-value blocks,
/// `d = 1 / (−127/max)`, codes `nearest_int`, at most 127).
#[cube(launch)]
pub fn quantize_act(
    x: &[f32],
    qa: &mut [i32],
    da: &mut [f32],
    sa: &mut [f32],
    n_blocks: u32,
    #[comptime] kind: u32,
) {
    let b = ABSOLUTE_POS;
    if b < n_blocks as usize {
        let blk = comptime![if kind == 2 { 256usize } else { 32usize }];
        let base = b * blk;
        let mut amax = 0.0f32;
        let mut max = 0.0f32;
        for i in 0..blk {
            let v = x[base + i];
            let av = v.abs();
            if av > amax {
                amax = av;
                max = v;
            }
        }
        if comptime![kind == 2] {
            if amax == 0.0 {
                for i in 0..blk {
                    qa[base + i] = 0;
                }
                da[b] = 0.0;
            } else {
                let iscale = -127.0f32 / max;
                for i in 0..blk {
                    // ggml's nearest_int: the float's mantissa after adding 1.5·2^23.
                    let f = iscale * x[base + i] + 12_582_912.0f32;
                    let bits = u32::reinterpret(f) & 0x007F_FFFFu32;
                    let q = i32::cast_from(bits) - 0x0040_0000i32;
                    qa[base + i] = min(q, 127i32);
                }
                da[b] = 1.0f32 / iscale;
            }
        } else {
            let d = amax / 127.0f32;
            let mut id = 0.0f32;
            if d != 0.0 {
                id = 1.0f32 / d;
            }
            let mut sum = 0i32;
            for i in 0..blk {
                // roundf: half away from zero, exactly (x − trunc(x) is exact).
                let v = x[base + i] * id;
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
                qa[base + i] = q;
                sum += q;
            }
            let dh = f32::cast_from(half::f16::cast_from(d));
            da[b] = dh;
            if comptime![kind == 1] {
                sa[b] = f32::cast_from(half::f16::cast_from(f32::cast_from(sum) * d));
            }
        }
    }
}

/// `out[r][n] = Σ_g` (group `g` of weight row `n`) · (activation codes of row `r`), for a
/// tile of `tile` rows per cube (`CUBE_POS_Y`) and one output column per cube
/// (`CUBE_POS_X`).
///
/// Weights: `codes` (`words` u32 per group, `bits`-bit codes), `scales`, `mins` (read when
/// `has_min`). Activations: `qa`, `da`, `sa` from [`quantize_act`] with blocks of `ablk`
/// values (32 or 256).
#[cube(launch)]
#[allow(clippy::too_many_arguments, reason = "a kernel's buffers and sizes")]
pub fn matmul_groups(
    qa: &[i32],
    da: &[f32],
    sa: &[f32],
    codes: &[u32],
    scales: &[f32],
    mins: &[f32],
    out: &mut [f32],
    n_in: u32,
    n_out: u32,
    rows: u32,
    #[comptime] bits: u32,
    #[comptime] group: u32,
    #[comptime] offset: u32,
    #[comptime] has_min: bool,
    #[comptime] ablk: u32,
    #[comptime] units: usize,
    #[comptime] tile: usize,
) {
    let n = CUBE_POS_X as usize;
    let r0 = CUBE_POS_Y as usize * tile;
    let u = UNIT_POS_X as usize;
    let n_in = n_in as usize;
    let groups = n_in / comptime![group as usize];
    let words = comptime![(group * bits / 32) as usize];
    let mask = comptime![(1u32 << bits) - 1];
    let g_per_blk = comptime![(ablk / group) as usize];
    let rows = rows as usize;
    let mut acc = Array::<f32>::new(tile);
    for t in 0..tile {
        acc[t] = 0.0;
    }
    let mut gi = u;
    while gi < groups {
        let wg = n * groups + gi;
        let mut isum = Array::<i32>::new(tile);
        let mut asum = Array::<i32>::new(tile);
        for t in 0..tile {
            isum[t] = 0;
            asum[t] = 0;
        }
        for i in 0..comptime![group as usize] {
            let at = i * comptime![bits as usize];
            let w = at / 32;
            let sh = (at % 32) as u32;
            let mut c = codes[wg * words + w] >> sh;
            if sh + comptime![bits] > 32 {
                c |= codes[wg * words + w + 1] << (32 - sh);
            }
            let q = i32::cast_from(c & mask) - comptime![offset as i32];
            for t in 0..tile {
                let r = r0 + t;
                if r < rows {
                    let a = qa[r * n_in + gi * comptime![group as usize] + i];
                    isum[t] += q * a;
                    if comptime![has_min && ablk == 256] {
                        asum[t] += a;
                    }
                }
            }
        }
        let scale = scales[wg];
        for t in 0..tile {
            let r = r0 + t;
            if r < rows {
                let ab = r * (n_in / comptime![ablk as usize]) + gi / g_per_blk;
                if comptime![has_min] {
                    if comptime![ablk == 256] {
                        acc[t] += da[ab]
                            * (scale * f32::cast_from(isum[t])
                                + mins[wg] * f32::cast_from(asum[t]));
                    } else {
                        acc[t] += scale * da[ab] * f32::cast_from(isum[t]) + mins[wg] * sa[ab];
                    }
                } else {
                    acc[t] += scale * da[ab] * f32::cast_from(isum[t]);
                }
            }
        }
        gi += units;
    }
    reduce_out(&acc, out, n, r0, n_out as usize, rows, u, units, tile);
}

/// `out = x · wᵀ` for f32 weights (f16 and bf16 weights are widened at upload), same tiling
/// as [`matmul_groups`].
#[cube(launch)]
#[allow(clippy::too_many_arguments, reason = "a kernel's buffers and sizes")]
pub fn matmul_f32(
    x: &[f32],
    w: &[f32],
    out: &mut [f32],
    n_in: u32,
    n_out: u32,
    rows: u32,
    #[comptime] units: usize,
    #[comptime] tile: usize,
) {
    let n = CUBE_POS_X as usize;
    let r0 = CUBE_POS_Y as usize * tile;
    let u = UNIT_POS_X as usize;
    let n_in = n_in as usize;
    let rows = rows as usize;
    let mut acc = Array::<f32>::new(tile);
    for t in 0..tile {
        acc[t] = 0.0;
    }
    let mut i = u;
    while i < n_in {
        let wv = w[n * n_in + i];
        for t in 0..tile {
            let r = r0 + t;
            if r < rows {
                acc[t] += wv * x[r * n_in + i];
            }
        }
        i += units;
    }
    reduce_out(&acc, out, n, r0, n_out as usize, rows, u, units, tile);
}

/// Sums each row's partial sums over the cube's units (a fixed tree in shared memory) and
/// writes `out[r][n]`.
#[cube]
#[allow(clippy::too_many_arguments, reason = "the tile's coordinates")]
fn reduce_out(
    acc: &Array<f32>,
    out: &mut [f32],
    n: usize,
    r0: usize,
    n_out: usize,
    rows: usize,
    u: usize,
    #[comptime] units: usize,
    #[comptime] tile: usize,
) {
    let mut sm = Shared::<[f32]>::new_slice(comptime![units * tile]);
    for t in 0..tile {
        sm[t * units + u] = acc[t];
    }
    sync_cube();
    let mut stride = CUBE_DIM_X as usize / 2;
    while stride > 0 {
        if u < stride {
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
            out[r * n_out + n] = sm[t * units];
        }
        t += units;
    }
}
