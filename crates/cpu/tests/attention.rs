//! Attention against a naive f64 softmax-attention written from the definition, and the KV
//! cache's formats.

mod common;

use common::{Rng, attend, ix, nmse, tensor};
use specula_cpu::CpuBackend;
use specula_quant::blocks::Half;
use specula_quant::dot::SimdLevel;
use specula_tensor::{AttentionParams, Backend, KvShape, Mask, QType, TensorError};

struct Case {
    n_head: usize,
    n_kv_head: usize,
    hd_k: usize,
    hd_v: usize,
    kv_type: QType,
}

fn shape(c: &Case, n_ctx: usize) -> KvShape {
    KvShape {
        n_layer: 2,
        n_ctx,
        n_kv_head: c.n_kv_head,
        head_dim_k: c.hd_k,
        head_dim_v: c.hd_v,
        k_type: c.kv_type,
        v_type: c.kv_type,
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

/// Softmax attention in f64 over the stored (possibly f16-rounded) K and V.
#[allow(clippy::too_many_arguments, reason = "a test reference spelled out")]
fn reference(
    c: &Case,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    q_pos: &[u32],
    kv_pos: &[u32],
    scale: f32,
    mask: Mask,
    softcap: Option<f32>,
) -> Vec<f64> {
    let round = |x: f32| match c.kv_type {
        QType::F16 => Half::from_f32(x).to_f32(),
        _ => x,
    };
    let (kw, vw) = (c.n_kv_head * c.hd_k, c.n_kv_head * c.hd_v);
    let group = c.n_head / c.n_kv_head;
    let mut out = Vec::new();
    for (r, &qp) in q_pos.iter().enumerate() {
        for h in 0..c.n_head {
            let kvh = h / group;
            let qh = &q[r * c.n_head * c.hd_k + h * c.hd_k..][..c.hd_k];
            let scores: Vec<Option<f64>> = kv_pos
                .iter()
                .enumerate()
                .map(|(j, &kp)| {
                    visible(mask, qp, kp).then(|| {
                        let kr = &k[j * kw + kvh * c.hd_k..][..c.hd_k];
                        let d: f64 = qh
                            .iter()
                            .zip(kr)
                            .map(|(&a, &b)| f64::from(a) * f64::from(round(b)))
                            .sum();
                        let s = d * f64::from(scale);
                        softcap.map_or(s, |cap| f64::from(cap) * (s / f64::from(cap)).tanh())
                    })
                })
                .collect();
            let max = scores
                .iter()
                .flatten()
                .copied()
                .fold(f64::NEG_INFINITY, f64::max);
            let mut acc = vec![0.0f64; c.hd_v];
            let mut sum = 0.0;
            for (j, s) in scores.iter().enumerate() {
                if let Some(s) = s {
                    let e = (s - max).exp();
                    sum += e;
                    let vr = &v[j * vw + kvh * c.hd_v..][..c.hd_v];
                    for (a, &x) in acc.iter_mut().zip(vr) {
                        *a += e * f64::from(round(x));
                    }
                }
            }
            out.extend(acc.iter().map(|a| if sum > 0.0 { a / sum } else { 0.0 }));
        }
    }
    out
}

#[test]
fn attention_matches_the_definition() {
    let mut rng = Rng::new(21);
    let cases = [
        Case {
            n_head: 4,
            n_kv_head: 4,
            hd_k: 64,
            hd_v: 64,
            kv_type: QType::F32,
        },
        Case {
            n_head: 8,
            n_kv_head: 2,
            hd_k: 64,
            hd_v: 64,
            kv_type: QType::F32,
        },
        Case {
            n_head: 6,
            n_kv_head: 1,
            hd_k: 128,
            hd_v: 96,
            kv_type: QType::F16,
        },
        Case {
            n_head: 4,
            n_kv_head: 2,
            hd_k: 32,
            hd_v: 32,
            kv_type: QType::F16,
        },
        // Head sizes that are not whole SIMD vectors: the kernels' tails.
        Case {
            n_head: 2,
            n_kv_head: 1,
            hd_k: 40,
            hd_v: 24,
            kv_type: QType::F32,
        },
        Case {
            n_head: 3,
            n_kv_head: 3,
            hd_k: 72,
            hd_v: 8,
            kv_type: QType::F16,
        },
    ];
    let masks = [Mask::Causal, Mask::SlidingWindow(5), Mask::None];
    // Every instruction set this CPU has for the inner loops (AVX-512, AVX2, portable), on one
    // and three threads.
    let levels = [None, Some(SimdLevel::Avx2), Some(SimdLevel::Scalar)];
    for (threads, level) in [1, 3].into_iter().flat_map(|t| levels.map(|l| (t, l))) {
        let be = CpuBackend::with_simd(threads, level);
        for c in &cases {
            let n_ctx = 40;
            let n_kv = 23;
            let mut kv = be.kv_new(shape(c, n_ctx)).unwrap();
            let k = rng.values(n_kv * c.n_kv_head * c.hd_k, 1.0);
            let v = rng.values(n_kv * c.n_kv_head * c.hd_v, 1.0);
            // Fill cells in a scrambled order to check that cells, not write order, count.
            let cells: Vec<usize> = (0..n_kv).map(|i| (i * 5) % n_kv).collect();
            let mut ks = vec![0.0; k.len()];
            let mut vs = vec![0.0; v.len()];
            let (kw, vw) = (c.n_kv_head * c.hd_k, c.n_kv_head * c.hd_v);
            for (t, &cell) in cells.iter().enumerate() {
                ks[t * kw..(t + 1) * kw].copy_from_slice(&k[cell * kw..(cell + 1) * kw]);
                vs[t * vw..(t + 1) * vw].copy_from_slice(&v[cell * vw..(cell + 1) * vw]);
            }
            be.kv_write(
                &mut kv,
                1,
                &ix(&be, &cells),
                &tensor(n_kv, kw, ks),
                &tensor(n_kv, vw, vs),
            );
            let kv_pos: Vec<u32> = (0..n_kv).map(|i| u32::try_from(i).unwrap() + 10).collect();
            let q_pos: Vec<u32> = vec![10, 15, 20, 32, 30, 9];
            let q = rng.values(q_pos.len() * c.n_head * c.hd_k, 2.0);
            let qt = tensor(q_pos.len(), c.n_head * c.hd_k, q.clone());
            for mask in masks {
                for softcap in [None, Some(3.0)] {
                    let scale = 1.0 / f32::from(u16::try_from(c.hd_k).unwrap()).sqrt();
                    let p = AttentionParams {
                        layer: 1,
                        n_head: c.n_head,
                        q_pos: &q_pos[..],
                        kv_pos: &kv_pos[..],
                        scale,
                        mask,
                        softcap,
                    };
                    let mut out = be.zeros(0, 0);
                    attend(&be, &qt, &kv, &p, &mut out);
                    assert_eq!(be.shape(&out), (q_pos.len(), c.n_head * c.hd_v));
                    let want = reference(c, &q, &k, &v, &q_pos, &kv_pos, scale, mask, softcap);
                    let e = nmse(out.as_slice(), &want);
                    assert!(
                        e <= 1e-10,
                        "{} heads / {} kv heads, {}, {mask:?}, softcap {softcap:?}, {:?}: NMSE {e:e}",
                        c.n_head,
                        c.n_kv_head,
                        c.kv_type,
                        be.simd_level()
                    );
                    // Position 9 sees no cell under a causal mask: zeros, not NaN.
                    if mask != Mask::None {
                        assert!(out.row(5).iter().all(|&x| x == 0.0));
                    }
                }
            }
        }
    }
}

#[test]
fn the_cache_stores_f16_rounded_values_and_refuses_bad_heads() {
    let be = CpuBackend::new(1);
    let c = Case {
        n_head: 2,
        n_kv_head: 1,
        hd_k: 4,
        hd_v: 4,
        kv_type: QType::F16,
    };
    let mut kv = be.kv_new(shape(&c, 3)).unwrap();
    let k = [0.1f32, -2.5, 3.3, 1e-3];
    be.kv_write(
        &mut kv,
        0,
        &be.index(&[2]),
        &tensor(1, 4, k.to_vec()),
        &tensor(1, 4, k.to_vec()),
    );
    let want: Vec<f32> = k.iter().map(|&x| Half::from_f32(x).to_f32()).collect();
    assert_eq!(kv.k_row(0, 2), want);
    assert_eq!(kv.v_row(0, 2), want);
    assert_eq!(kv.k_row(0, 1), [0.0; 4]);
    // Block formats need whole blocks per head; weight-only formats are no cache formats.
    for ty in [QType::Q8_0, QType::Q4_0, QType::IQ4_NL, QType::Q4_K] {
        let err = be
            .kv_new(KvShape {
                k_type: ty,
                ..shape(&c, 3)
            })
            .unwrap_err();
        assert!(
            matches!(&err, TensorError::Kv(e) if e.downcast_ref::<specula_kv::KvError>().is_some() && e.to_string().contains(ty.name())),
            "{err}"
        );
    }
    // Turbo pads a 4-value head to one 128-value group.
    let kv = be
        .kv_new(KvShape {
            k_type: QType::Turbo3,
            ..shape(&c, 3)
        })
        .unwrap();
    assert_eq!(kv.layout().layers[0].k_dim, 128);
}
