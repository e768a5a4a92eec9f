//! Flash attention over every cache format against naive softmax attention over the
//! dequantized cache, turbo attention in the rotated domain against the original domain, and
//! rollback of the cache bytes.

mod common;

use common::{Rng, attend, ix, nmse, tensor};
use specula_cpu::{CpuBackend, CpuKv};
use specula_kv::{CACHE_TYPES, Rotation, hadamard, is_turbo, k_rotation, v_rotation};
use specula_quant::dot::SimdLevel;
use specula_quant::{QType, wht};
use specula_tensor::{AttentionParams, Backend, KvShape, Mask};

const N_KV_HEAD: usize = 2;
const N_HEAD: usize = 6;
const HD: usize = 64;

fn shape(k: QType, v: QType, n_ctx: usize) -> KvShape {
    KvShape {
        n_layer: 1,
        n_ctx,
        n_kv_head: N_KV_HEAD,
        head_dim_k: HD,
        head_dim_v: HD,
        k_type: k,
        v_type: v,
        overrides: Vec::new(),
        swa: None,
        recurrent: None,
        heads: Vec::new(),
        shared: Vec::new(),
    }
}

fn visible(mask: Mask, qp: u32, kp: u32) -> bool {
    match mask {
        Mask::Causal => kp <= qp,
        Mask::SlidingWindow(w) => kp <= qp && usize::try_from(qp - kp).unwrap() < w,
        Mask::None => true,
    }
}

/// Softmax attention in f64, written from the definition, over K and V rows as given.
fn naive(q: &[f32], k: &[Vec<f32>], v: &[Vec<f32>], q_pos: &[u32], mask: Mask) -> Vec<f64> {
    let scale = 1.0 / (HD as f64).sqrt();
    let group = N_HEAD / N_KV_HEAD;
    let mut out = Vec::new();
    for (r, &qp) in q_pos.iter().enumerate() {
        for h in 0..N_HEAD {
            let kvh = h / group;
            let qh = &q[(r * N_HEAD + h) * HD..][..HD];
            let scores: Vec<Option<f64>> = (0..k.len())
                .map(|j| {
                    visible(mask, qp, u32::try_from(j).unwrap()).then(|| {
                        qh.iter()
                            .zip(&k[j][kvh * HD..(kvh + 1) * HD])
                            .map(|(&a, &b)| f64::from(a) * f64::from(b))
                            .sum::<f64>()
                            * scale
                    })
                })
                .collect();
            let max = scores
                .iter()
                .flatten()
                .copied()
                .fold(f64::NEG_INFINITY, f64::max);
            let w: Vec<f64> = scores
                .iter()
                .map(|s| s.map_or(0.0, |s| (s - max).exp()))
                .collect();
            let sum: f64 = w.iter().sum();
            for d in 0..HD {
                let mut acc = 0.0;
                for (j, &wj) in w.iter().enumerate() {
                    acc += wj * f64::from(v[j][kvh * HD + d]);
                }
                out.push(if sum > 0.0 { acc / sum } else { 0.0 });
            }
        }
    }
    out
}

/// Fills `n` cells with random K/V rows (with a few outlier channels in K, as real models
/// have) and returns the cache.
fn filled(be: &CpuBackend, k_ty: QType, v_ty: QType, n: usize, rng: &mut Rng) -> CpuKv {
    let mut kv = be.kv_new(shape(k_ty, v_ty, n + 4)).unwrap();
    let w = N_KV_HEAD * HD;
    let mut k = rng.values(n * w, 1.0);
    for row in k.chunks_exact_mut(w) {
        row[3] *= 8.0;
        row[HD + 17] *= 6.0;
    }
    let v = rng.values(n * w, 1.0);
    let cells: Vec<usize> = (0..n).collect();
    be.kv_write(
        &mut kv,
        0,
        &ix(be, &cells),
        &tensor(n, w, k),
        &tensor(n, w, v),
    );
    kv
}

fn run(be: &CpuBackend, kv: &CpuKv, q: &[f32], q_pos: &[u32], n: usize, mask: Mask) -> Vec<f32> {
    let kv_pos: Vec<u32> = (0..u32::try_from(n).unwrap()).collect();
    let p = AttentionParams {
        layer: 0,
        n_head: N_HEAD,
        q_pos,
        kv_pos: &kv_pos,
        scale: 1.0 / (HD as f32).sqrt(),
        mask,
        softcap: None,
    };
    let mut out = be.zeros(0, 0);
    attend(
        be,
        &tensor(q_pos.len(), N_HEAD * HD, q.to_vec()),
        kv,
        &p,
        &mut out,
    );
    out.as_slice().to_vec()
}

/// Flash attention over each K/V format pair equals naive attention over the dequantized
/// cache (rotated back for turbo) to f32 rounding, on every instruction set, for every mask.
#[test]
fn flash_attention_equals_naive_attention_over_the_dequantized_cache() {
    let mut rng = Rng::new(5);
    let n = 77; // two whole tiles and a partial one
    let q_pos: Vec<u32> = vec![0, 5, 31, 32, 33, 63, 76, 76];
    let levels = [None, Some(SimdLevel::Avx2), Some(SimdLevel::Scalar)];
    let mut pairs: Vec<(QType, QType)> = CACHE_TYPES.iter().map(|&t| (t, t)).collect();
    pairs.extend([
        (QType::Q8_0, QType::Turbo4),
        (QType::Turbo3, QType::Q8_0),
        (QType::F16, QType::Turbo2),
        (QType::Turbo4, QType::F32),
        (QType::Q4_1, QType::IQ4_NL),
    ]);
    for (li, level) in levels.into_iter().enumerate() {
        let be = CpuBackend::with_simd(1 + li % 2, level);
        for &(kt, vt) in &pairs {
            let kv = filled(&be, kt, vt, n, &mut rng);
            let k: Vec<Vec<f32>> = (0..n).map(|j| kv.k_row(0, j)).collect();
            let v: Vec<Vec<f32>> = (0..n).map(|j| kv.v_row(0, j)).collect();
            let q = rng.values(q_pos.len() * N_HEAD * HD, 1.5);
            for mask in [Mask::Causal, Mask::SlidingWindow(20), Mask::None] {
                let got = run(&be, &kv, &q, &q_pos, n, mask);
                // Block-format keys take the query rotated like the keys (Hadamard) and
                // quantized to Q8_0/Q8_1, as llama.cpp does: the reference sees that query,
                // rotated back.
                let qref: Vec<f32> = match kt {
                    QType::F32 | QType::F16 | QType::BF16 => q.clone(),
                    t if is_turbo(t) => q.clone(),
                    t => {
                        let qty = t.vec_dot_type();
                        let mut out = Vec::new();
                        let Rotation::Hadamard(rn) = k_rotation(t, HD) else {
                            panic!("{t}: a 64-value head is rotated");
                        };
                        for h in q.chunks_exact(HD) {
                            let mut h = h.to_vec();
                            hadamard(&mut h, rn);
                            let mut b = vec![0u8; qty.row_bytes(HD).unwrap()];
                            specula_quant::quantize_row(qty, &h, &mut b).unwrap();
                            let mut d = vec![0f32; HD];
                            specula_quant::dequantize_row(qty, &b, &mut d).unwrap();
                            hadamard(&mut d, rn);
                            out.extend(d);
                        }
                        out
                    }
                };
                let want = naive(&qref, &k, &v, &q_pos, mask);
                let e = nmse(&got, &want);
                // Rotations add f32 rounding (query, output, the reference's own); Q8_1 queries (for
                // q4_1 / q5_1 keys) carry their block sum rounded to f16, which the block dot
                // product uses for the min term, as ggml's does.
                let tol = if matches!(kt, QType::Q4_1 | QType::Q5_1) {
                    1e-7
                } else if k_rotation(kt, HD) != Rotation::None
                    || v_rotation(vt, HD) != Rotation::None
                {
                    1e-9
                } else {
                    1e-10
                };
                assert!(
                    e <= tol,
                    "K {kt} V {vt} {mask:?} {:?}: NMSE {e:e}",
                    be.simd_level()
                );
            }
        }
    }
}

/// Turbo attention runs in the rotated domain (rotated query against rotated keys, output
/// rotated back); it must equal attention in the original domain over the rotated-back cache,
/// and the rotation must preserve dot products.
#[test]
fn turbo_rotated_domain_equals_original_domain() {
    let mut rng = Rng::new(9);
    let be = CpuBackend::new(2);
    let n = 40;
    for t in [QType::Turbo2, QType::Turbo3, QType::Turbo4] {
        let kv = filled(&be, t, t, n, &mut rng);
        // Original-domain cache: the turbo rows rotated back, stored exactly in f32.
        let mut f = be.kv_new(shape(QType::F32, QType::F32, n + 4)).unwrap();
        let w = N_KV_HEAD * HD;
        let k: Vec<f32> = (0..n).flat_map(|j| kv.k_row(0, j)).collect();
        let v: Vec<f32> = (0..n).flat_map(|j| kv.v_row(0, j)).collect();
        let cells: Vec<usize> = (0..n).collect();
        be.kv_write(
            &mut f,
            0,
            &ix(&be, &cells),
            &tensor(n, w, k),
            &tensor(n, w, v),
        );
        let q_pos: Vec<u32> = (0..u32::try_from(n).unwrap()).step_by(3).collect();
        let q = rng.values(q_pos.len() * N_HEAD * HD, 1.0);
        let a = run(&be, &kv, &q, &q_pos, n, Mask::Causal);
        let b = run(&be, &f, &q, &q_pos, n, Mask::Causal);
        let want: Vec<f64> = b.iter().map(|&x| f64::from(x)).collect();
        let e = nmse(&a, &want);
        assert!(e <= 1e-9, "{t}: NMSE {e:e}");
    }
    let x: Vec<f32> = rng.values(128, 1.0);
    let y: Vec<f32> = rng.values(128, 1.0);
    let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(p, q)| p * q).sum::<f32>();
    let (mut rx, mut ry) = (x.clone(), y.clone());
    wht::forward_row(&mut rx);
    wht::forward_row(&mut ry);
    assert!((dot(&x, &y) - dot(&rx, &ry)).abs() < 1e-4);
}

/// A query row's output does not depend on the other rows of the batch or the thread count:
/// decode (one row, the cache as long as its position) gives the bits of the same row inside a
/// prefill batch. The cache spans three key chunks, so decode splits the keys over threads
/// (split-K) while the batch runs each row's chunks in one task.
#[test]
fn flash_attention_is_batch_invariant_for_every_format() {
    let mut rng = Rng::new(13);
    let n = 600;
    for &t in CACHE_TYPES {
        let be1 = CpuBackend::new(1);
        let be3 = CpuBackend::new(3);
        let kv = filled(&be1, t, t, n, &mut rng);
        let q_pos: Vec<u32> = (0..u32::try_from(n).unwrap()).collect();
        let rows = [0usize, 9, 255, 256, 300, 511, 513, 599];
        let q = rng.values(n * N_HEAD * HD, 1.0);
        let all = run(&be3, &kv, &q, &q_pos, n, Mask::Causal);
        for r in rows {
            for be in [&be1, &be3] {
                let one = run(
                    be,
                    &kv,
                    &q[r * N_HEAD * HD..(r + 1) * N_HEAD * HD],
                    &q_pos[r..=r],
                    r + 1,
                    Mask::Causal,
                );
                assert_eq!(
                    one,
                    all[r * N_HEAD * HD..(r + 1) * N_HEAD * HD],
                    "{t} row {r} on {} threads",
                    be.n_threads()
                );
            }
        }
        // A short verify batch at depth (split-K over its rows) against the same rows alone.
        let tail = 595..600;
        let few = run(
            &be3,
            &kv,
            &q[tail.start * N_HEAD * HD..],
            &q_pos[tail.clone()],
            n,
            Mask::Causal,
        );
        assert_eq!(few, all[tail.start * N_HEAD * HD..], "{t} verify batch");
    }
}

/// Split-K decode over a long cache equals naive attention over the dequantized cache.
#[test]
fn split_k_decode_equals_naive_attention() {
    let mut rng = Rng::new(21);
    let n = 1000;
    let be = CpuBackend::new(2);
    for (kt, vt) in [
        (QType::F16, QType::F16),
        (QType::F32, QType::Turbo4),
        (QType::Turbo3, QType::F16),
    ] {
        let kv = filled(&be, kt, vt, n, &mut rng);
        let k: Vec<Vec<f32>> = (0..n).map(|j| kv.k_row(0, j)).collect();
        let v: Vec<Vec<f32>> = (0..n).map(|j| kv.v_row(0, j)).collect();
        let q_pos = [999u32];
        let q = rng.values(N_HEAD * HD, 1.5);
        for mask in [Mask::Causal, Mask::SlidingWindow(300)] {
            let got = run(&be, &kv, &q, &q_pos, n, mask);
            let want = naive(&q, &k, &v, &q_pos, mask);
            let e = nmse(&got, &want);
            assert!(e <= 1e-9, "K {kt} V {vt} {mask:?}: NMSE {e:e}");
        }
    }
}

/// Rollback: overwriting the cells of a trimmed tail gives the bytes of a cache that never
/// held the tail.
#[test]
fn rewrite_after_rollback_gives_the_same_bytes() {
    let mut rng = Rng::new(17);
    let be = CpuBackend::new(1);
    let w = N_KV_HEAD * HD;
    for &t in CACHE_TYPES {
        let a_k = rng.values(6 * w, 1.0);
        let a_v = rng.values(6 * w, 1.0);
        let tail = rng.values(3 * w, 1.0);
        let mut x = be.kv_new(shape(t, t, 8)).unwrap();
        let mut y = be.kv_new(shape(t, t, 8)).unwrap();
        let cells: Vec<usize> = (0..6).collect();
        // x: rows 0..6, then a rejected tail in cells 3..6, then rows 3..6 again.
        be.kv_write(
            &mut x,
            0,
            &ix(&be, &cells),
            &tensor(6, w, a_k.clone()),
            &tensor(6, w, a_v.clone()),
        );
        be.kv_write(
            &mut x,
            0,
            &be.index(&[3, 4, 5]),
            &tensor(3, w, tail.clone()),
            &tensor(3, w, tail),
        );
        be.kv_write(
            &mut x,
            0,
            &be.index(&[3, 4, 5]),
            &tensor(3, w, a_k[3 * w..].to_vec()),
            &tensor(3, w, a_v[3 * w..].to_vec()),
        );
        be.kv_write(
            &mut y,
            0,
            &ix(&be, &cells),
            &tensor(6, w, a_k),
            &tensor(6, w, a_v),
        );
        assert_eq!(x.plane_bytes(0, false), y.plane_bytes(0, false), "{t} K");
        assert_eq!(x.plane_bytes(0, true), y.plane_bytes(0, true), "{t} V");
    }
}

/// The cache's accounting matches the bytes it holds.
#[test]
fn the_cache_holds_the_bytes_it_accounts_for() {
    let be = CpuBackend::new(1);
    for &t in CACHE_TYPES {
        let kv = be.kv_new(shape(t, QType::F16, 10)).unwrap();
        let held = kv.plane_bytes(0, false).len() + kv.plane_bytes(0, true).len();
        assert_eq!(held, kv.layout().total_bytes(), "{t}");
        assert_eq!(held, 10 * kv.layout().bytes_per_token(), "{t}");
    }
}
