//! Batch invariance: the result for a row is the same bits whether the row is computed alone
//! or inside a batch of 3, 8 or 17 rows, on 1, 2 or 3 threads. Speculative verification relies
//! on this to reproduce plain decoding exactly.

mod common;

use common::{BATCHES, Rng, THREADS, attend, bits, ix, random_weight, tensor, vector};
use specula_cpu::{CpuBackend, CpuTensor};
use specula_tensor::{AttentionParams, Backend, KvShape, Mask, QType, RopeConfig, RopeKind, Yarn};

/// Rows of the test inputs; batches are windows of them.
const N_ROWS: usize = 20;

/// The windows `start..start + b` each batch size is tried at.
fn windows(b: usize) -> Vec<usize> {
    let mut s = vec![0, N_ROWS - b, (N_ROWS - b) / 2];
    s.dedup();
    s
}

/// Checks that `op` on any window of rows gives, for each row, the bits `alone[row]` (the row
/// computed by itself on one thread).
fn check(
    what: &str,
    alone: &[Vec<u32>],
    op: impl Fn(&CpuBackend, std::ops::Range<usize>) -> CpuTensor,
) {
    for threads in THREADS {
        let be = CpuBackend::new(threads);
        for b in BATCHES {
            for s in windows(b) {
                let out = op(&be, s..s + b);
                assert_eq!(out.rows(), b);
                for (i, r) in (s..s + b).enumerate() {
                    assert!(
                        bits(out.row(i)) == alone[r],
                        "{what}: row {r} differs in a batch of {b} (rows {s}..) on {threads} threads"
                    );
                }
            }
        }
    }
}

fn rows_of(x: &[f32], cols: usize, r: std::ops::Range<usize>) -> CpuTensor {
    tensor(r.len(), cols, x[r.start * cols..r.end * cols].to_vec())
}

#[test]
fn matmul_is_batch_invariant_for_the_common_weight_formats() {
    // Wide enough that activations are quantized in parallel and the tiling splits rows and
    // columns.
    let (n_in, n_out) = (2048, 72);
    for ty in [
        QType::F32,
        QType::F16,
        QType::Q8_0,
        QType::Q4_0,
        QType::Q4_1,
        QType::Q5_0,
        QType::Q4_K,
        QType::Q6_K,
    ] {
        let one = CpuBackend::new(1);
        let mut rng = Rng::new(100 + u64::from(ty.ggml_id().unwrap()));
        let (w, _) = random_weight(&one, &mut rng, ty, n_in, n_out);
        let x = rng.values(N_ROWS * n_in, 1.5);
        let alone: Vec<Vec<u32>> = (0..N_ROWS)
            .map(|r| {
                let mut out = one.zeros(0, 0);
                one.matmul(&rows_of(&x, n_in, r..r + 1), &w, &mut out);
                bits(out.as_slice())
            })
            .collect();
        check(&format!("matmul {ty}"), &alone, |be, r| {
            let mut out = be.zeros(0, 0);
            be.matmul(&rows_of(&x, n_in, r), &w, &mut out);
            out
        });
    }
}

#[test]
fn rms_norm_and_rope_are_batch_invariant() {
    let one = CpuBackend::new(1);
    let mut rng = Rng::new(200);
    // Wide rows so that the row-wise ops split over threads.
    let (heads, hd) = (32, 128);
    let cols = heads * hd;
    let x = rng.values(N_ROWS * cols, 3.0);
    let w = vector(&one, "norm", &rng.values(cols, 1.0));
    let alone: Vec<Vec<u32>> = (0..N_ROWS)
        .map(|r| {
            let mut out = one.zeros(0, 0);
            one.rms_norm(&rows_of(&x, cols, r..r + 1), Some(&w), 1e-5, &mut out);
            bits(out.as_slice())
        })
        .collect();
    check("rms_norm", &alone, |be, r| {
        let mut out = be.zeros(0, 0);
        be.rms_norm(&rows_of(&x, cols, r), Some(&w), 1e-5, &mut out);
        out
    });

    let pos: Vec<u32> = (0..N_ROWS)
        .map(|i| u32::try_from(i * 37 + 5).unwrap())
        .collect();
    let cfgs = [
        RopeConfig::new(RopeKind::Normal, 128, 10_000.0),
        RopeConfig::new(RopeKind::Neox, 64, 1_000_000.0),
        RopeConfig {
            freq_scale: 0.25,
            yarn: Some(Yarn {
                orig_ctx: 4096,
                ext_factor: 1.0,
                attn_factor: 1.0,
                beta_fast: 32.0,
                beta_slow: 1.0,
            }),
            ..RopeConfig::new(RopeKind::Neox, 128, 10_000.0)
        },
    ];
    for cfg in cfgs {
        let alone: Vec<Vec<u32>> = (0..N_ROWS)
            .map(|r| {
                let mut t = rows_of(&x, cols, r..r + 1);
                one.rope(&mut t, hd, &one.index(&pos[r..=r]), &cfg);
                bits(t.as_slice())
            })
            .collect();
        check(&format!("rope {cfg:?}"), &alone, |be, r| {
            let mut t = rows_of(&x, cols, r.clone());
            be.rope(&mut t, hd, &be.index(&pos[r]), &cfg);
            t
        });
    }
}

#[test]
fn attention_is_batch_invariant() {
    // Query row r sits at position r of a sequence whose K/V cells 0..N_ROWS hold positions
    // 0..N_ROWS. Alone, a row sees the cache as decoding would leave it (cells 0..=r); in a
    // batch, as prefill would (cells up to the batch's last row), with later cells masked.
    let (n_head, n_kv_head, hd) = (8, 2, 64);
    for kv_type in [QType::F32, QType::F16] {
        for mask in [Mask::Causal, Mask::SlidingWindow(6)] {
            let one = CpuBackend::new(1);
            let mut rng = Rng::new(300);
            let shape = KvShape {
                n_layer: 1,
                n_ctx: 64,
                n_kv_head,
                head_dim_k: hd,
                head_dim_v: hd,
                k_type: kv_type,
                v_type: kv_type,
                overrides: Vec::new(),
                swa: None,
                recurrent: None,
                heads: Vec::new(),
                shared: Vec::new(),
            };
            let mut kv = one.kv_new(shape).unwrap();
            let kw = n_kv_head * hd;
            let k = tensor(N_ROWS, kw, rng.values(N_ROWS * kw, 1.0));
            let v = tensor(N_ROWS, kw, rng.values(N_ROWS * kw, 1.0));
            let cells: Vec<usize> = (0..N_ROWS).collect();
            one.kv_write(&mut kv, 0, &ix(&one, &cells), &k, &v);
            let cols = n_head * hd;
            let q = rng.values(N_ROWS * cols, 2.0);
            let pos: Vec<u32> = (0..N_ROWS).map(|i| u32::try_from(i).unwrap()).collect();
            let run = |be: &CpuBackend, r: std::ops::Range<usize>| {
                let p = AttentionParams {
                    layer: 0,
                    n_head,
                    q_pos: &pos[r.clone()],
                    kv_pos: &pos[..r.end],
                    scale: 0.125,
                    mask,
                    softcap: Some(20.0),
                };
                let mut out = be.zeros(0, 0);
                attend(be, &rows_of(&q, cols, r), &kv, &p, &mut out);
                out
            };
            let alone: Vec<Vec<u32>> = (0..N_ROWS)
                .map(|r| bits(run(&one, r..r + 1).as_slice()))
                .collect();
            check(&format!("attention {kv_type} {mask:?}"), &alone, run);
        }
    }
}
