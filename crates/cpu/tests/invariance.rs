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

/// A mixture of experts: each row's experts and their weighted sum have the bits of the row
/// routed alone, whatever else is in its batch, with the experts as views of one stacked
/// tensor (GGUF's `ffn_*_exps`); and the CPU backend's one-pass `moe_ffn` (each expert's
/// whole MLP over its rows) has the bits of the contract's default, the pair ops
/// (`matmul_id` per projection, the gated activation, `moe_combine`).
#[test]
fn a_mixture_of_experts_is_batch_invariant_and_its_one_pass_is_the_pair_ops() {
    use specula_tensor::{MoeExperts, MoeRoute, WeightDesc};
    let one = CpuBackend::new(1);
    let mut rng = Rng::new(300);
    let (n_expert, n_in, n_ff) = (6, 256, 256);
    let x = rng.values(N_ROWS * n_in, 1.0);
    let logits = rng.values(N_ROWS * n_expert, 2.0);
    for (ty, scaled, geglu, sigmoid) in [
        (QType::Q8_0, false, false, false),
        (QType::F32, true, true, true),
        (QType::Q4_K, false, false, false),
    ] {
        // The stacks: `[n_in, n_ff, n_expert]` gate and up, `[n_ff, n_in, n_expert]` down.
        let stack = |be: &CpuBackend, rng: &mut Rng, k: usize, m: usize| {
            let bytes = common::encode(ty, &rng.values(k * m * n_expert, 1.0), k);
            let owner = std::sync::Arc::new(bytes);
            let rows: Vec<_> = (0..n_expert).map(|e| e * m..(e + 1) * m).collect();
            let mut ws = be
                .weight_views(
                    &WeightDesc {
                        name: "exps",
                        ty,
                        dims: &[k, m * n_expert],
                        data: &owner[..],
                        owner: owner.clone(),
                    },
                    &rows,
                )
                .expect("views of a stack");
            for w in &mut ws {
                be.prepare_matmul(w);
            }
            ws
        };
        let mut wr = Rng::new(301);
        let (gate, up, down) = (
            stack(&one, &mut wr, n_in, n_ff),
            stack(&one, &mut wr, n_in, n_ff),
            stack(&one, &mut wr, n_ff, n_in),
        );
        let sc: Vec<f32> = (0..n_expert).map(|e| 0.5 + 0.25 * e as f32).collect();
        let scales = scaled.then_some(&sc[..]);
        let experts = MoeExperts {
            gate: &gate,
            up: &up,
            down: &down,
            gate_scales: scales,
            up_scales: scales,
            down_scales: scales,
            geglu,
        };
        let route = MoeRoute {
            n_used: 2,
            sigmoid,
            norm: true,
            scale: 1.5,
        };
        let run = |be: &CpuBackend, r: std::ops::Range<usize>| {
            let mut routes = be.routes();
            be.moe_route(
                &rows_of(&logits, n_expert, r.clone()),
                &route,
                None,
                &mut routes,
            );
            let mut out = be.zeros(0, 0);
            be.moe_ffn(&rows_of(&x, n_in, r), &experts, &routes, &mut out);
            (out, routes)
        };
        let alone: Vec<Vec<u32>> = (0..N_ROWS)
            .map(|r| bits(run(&one, r..r + 1).0.as_slice()))
            .collect();
        check(&format!("moe_ffn {ty:?}"), &alone, |be, r| run(be, r).0);

        // The pair ops over all rows give the one pass's bits.
        let be = CpuBackend::new(2);
        let (fused, routes) = run(&be, 0..N_ROWS);
        let xs = rows_of(&x, n_in, 0..N_ROWS);
        let z = || be.zeros(0, 0);
        let (mut g, mut u, mut a, mut y, mut out) = (z(), z(), z(), z(), z());
        be.matmul_id(&xs, &gate, scales, &routes, false, &mut g);
        be.matmul_id(&xs, &up, scales, &routes, false, &mut u);
        if geglu {
            be.geglu(&g, &u, &mut a);
        } else {
            be.swiglu(&g, &u, &mut a);
        }
        be.matmul_id(&a, &down, scales, &routes, true, &mut y);
        be.moe_combine(&y, &routes, &mut out);
        assert!(
            bits(out.as_slice()) == bits(fused.as_slice()),
            "moe_ffn {ty:?}: the one pass differs from the pair ops"
        );
    }
}

/// The attention of several sequences as one op (`attention_seqs`: each sequence's K/V rows
/// written from the batch's rows, every sequence's work in one parallel region) gives every
/// sequence's rows the bits of the op's definition — the sequence's rows gathered, written,
/// attended and scattered (`attention_seqs_apart`) — and leaves each cache as the definition
/// does: caches of different formats, depths past one chunk (split-K decode rows) and not,
/// prefill rows, a sliding window and a layer that only reads its cells.
#[test]
fn attention_of_several_sequences_is_each_sequence_alone() {
    use specula_tensor::{SeqAttention, attention_seqs_apart};
    let (n_head, n_kv_head, hd) = (6, 2, 64);
    let (kw, cols) = (n_kv_head * hd, n_head * hd);
    // (K type, V type, depth already cached, rows of the batch, mask)
    let seqs = [
        (QType::F16, QType::F16, 600, 1, Mask::Causal),
        (QType::Q8_0, QType::Q4_0, 37, 5, Mask::SlidingWindow(24)),
        (QType::Turbo4, QType::Turbo4, 300, 1, Mask::Causal),
        (QType::F32, QType::F16, 0, 19, Mask::Causal),
    ];
    let total: usize = seqs.iter().map(|s| s.3).sum();
    let mut rng = Rng::new(410);
    let (q, k, v) = (
        rng.values(total * cols, 2.0),
        rng.values(total * kw, 1.0),
        rng.values(total * kw, 1.0),
    );
    // Layer 0 writes its cells, layer 1 reads layer 0's (a K/V-shared layer's call).
    let fresh = |be: &CpuBackend, rng: &mut Rng| -> Vec<specula_cpu::CpuKv> {
        seqs.iter()
            .map(|&(kt, vt, depth, _, _)| {
                let shape = KvShape::uniform(2, 700, n_kv_head, hd, kt, vt);
                let mut kv = be.kv_new(shape).unwrap();
                if depth > 0 {
                    let cells: Vec<usize> = (0..depth).collect();
                    let kk = tensor(depth, kw, rng.values(depth * kw, 1.0));
                    let vv = tensor(depth, kw, rng.values(depth * kw, 1.0));
                    be.kv_write(&mut kv, 0, &ix(be, &cells), &kk, &vv);
                }
                kv
            })
            .collect()
    };
    for threads in THREADS {
        let be = CpuBackend::new(threads);
        let (qt, kt, vt) = (
            tensor(total, cols, q.clone()),
            tensor(total, kw, k.clone()),
            tensor(total, kw, v.clone()),
        );
        let mut runs = Vec::new();
        for apart in [true, false] {
            let mut caches = fresh(&be, &mut Rng::new(411));
            let mut outs = Vec::new();
            for (layer, write) in [(0, true), (1, false)] {
                let mut off = 0;
                let mut ix_rows = Vec::new();
                let mut ix_cells = Vec::new();
                let mut pos = Vec::new();
                for &(_, _, depth, n, _) in &seqs {
                    let rows: Vec<usize> = (off..off + n).collect();
                    let cells: Vec<usize> = (depth..depth + n).collect();
                    let q_pos: Vec<u32> = (depth..depth + n)
                        .map(|p| u32::try_from(p).unwrap())
                        .collect();
                    let kv_pos: Vec<u32> =
                        (0..depth + n).map(|p| u32::try_from(p).unwrap()).collect();
                    ix_rows.push(ix(&be, &rows));
                    ix_cells.push(ix(&be, &cells));
                    pos.push((be.index(&q_pos), be.index(&kv_pos)));
                    off += n;
                }
                let mut off = 0;
                let mut att: Vec<SeqAttention<'_, _, _>> = caches
                    .iter_mut()
                    .enumerate()
                    .map(|(i, kv)| {
                        let n = seqs[i].3;
                        let a = SeqAttention {
                            kv,
                            rows: off..off + n,
                            row_index: &ix_rows[i],
                            cells: write.then_some(&ix_cells[i]),
                            params: AttentionParams {
                                layer: 0,
                                n_head,
                                q_pos: &pos[i].0,
                                kv_pos: &pos[i].1,
                                scale: 0.125,
                                mask: seqs[i].4,
                                softcap: None,
                            },
                        };
                        off += n;
                        a
                    })
                    .collect();
                let mut out = be.zeros(0, 0);
                if apart {
                    attention_seqs_apart(&be, &qt, &kt, &vt, &mut att, &mut out);
                } else {
                    be.attention_seqs(&qt, &kt, &vt, &mut att, &mut out);
                }
                assert_eq!((out.rows(), out.cols()), (total, cols), "layer {layer}");
                outs.push(bits(out.as_slice()));
            }
            // What the caches hold: every cell as attention reads it.
            let mut state = Vec::new();
            for (kv, &(_, _, depth, n, _)) in caches.iter().zip(&seqs) {
                let all: Vec<u32> = (0..depth + n).map(|p| u32::try_from(p).unwrap()).collect();
                let eye: Vec<f32> = (0..n_head * hd)
                    .map(|i| if i % hd == 0 { 1.0 } else { 0.0 })
                    .collect();
                let p = AttentionParams {
                    layer: 0,
                    n_head,
                    q_pos: &all[all.len() - 1..],
                    kv_pos: &all[..],
                    scale: 0.125,
                    mask: Mask::Causal,
                    softcap: None,
                };
                let mut o = be.zeros(0, 0);
                attend(&be, &tensor(1, cols, eye), kv, &p, &mut o);
                state.push(bits(o.as_slice()));
            }
            runs.push((outs, state));
        }
        let names = ["layer 0 (writes)", "layer 1 (reads only)"];
        for (l, name) in names.iter().enumerate() {
            let (a, b) = (&runs[0].0[l], &runs[1].0[l]);
            let row = a.chunks(cols).zip(b.chunks(cols)).position(|(x, y)| x != y);
            assert!(
                row.is_none(),
                "{name}: row {row:?} differs from the sequences apart on {threads} threads"
            );
        }
        assert!(
            runs[0].1 == runs[1].1,
            "the caches differ from the sequences apart on {threads} threads"
        );
    }
}
