//! `matmul` against an f64 reference, for every weight format: the reference multiplies the
//! dequantized weight by the dequantized activation row (quantized to the weight's
//! `vec_dot_type`, as the backend does), so the only difference left is the kernel's f32
//! rounding.

mod common;

use std::sync::Arc;

use common::{Rng, decode, encode, nmse, random_weight, tensor};
use specula_cpu::CpuBackend;
use specula_quant::blocks::Half;
use specula_tensor::{Backend, QType, TensorError, WeightDesc};

/// Every format the backend multiplies by.
const WEIGHT_TYPES: &[QType] = &[
    QType::F32,
    QType::F16,
    QType::BF16,
    QType::Q4_0,
    QType::Q4_1,
    QType::Q5_0,
    QType::Q5_1,
    QType::Q8_0,
    QType::IQ4_NL,
    QType::MXFP4,
    QType::NVFP4,
    QType::Q2_K,
    QType::Q3_K,
    QType::Q4_K,
    QType::Q5_K,
    QType::Q6_K,
    QType::IQ4_XS,
];

fn half_at(b: &[u8], i: usize) -> f64 {
    f64::from(Half([b[i], b[i + 1]]).to_f32())
}

/// `Σ w·x` in f64 for one weight row and one activation row as the kernel defines it.
///
/// Q4_1 / Q5_1 take the min's contribution from the activation block's stored `s = fp16(d·Σq)`
/// (ggml's formula), not from the exact sum; the correction term adds that difference.
fn reference_dot(ty: QType, w_bytes: &[u8], w: &[f32], a_bytes: &[u8], a: &[f32]) -> f64 {
    let exact: f64 = w
        .iter()
        .zip(a)
        .map(|(&w, &a)| f64::from(w) * f64::from(a))
        .sum();
    let (wb, ab) = match ty {
        QType::Q4_1 => (20, 36),
        QType::Q5_1 => (24, 36),
        _ => return exact,
    };
    let mut corr = 0.0;
    for (wblk, ablk) in w_bytes.chunks_exact(wb).zip(a_bytes.chunks_exact(ab)) {
        let m = half_at(wblk, 2);
        let (d, s) = (half_at(ablk, 0), half_at(ablk, 2));
        let sum_q: f64 = ablk[4..].iter().map(|&q| f64::from(q.cast_signed())).sum();
        corr += m * (s - d * sum_q);
    }
    exact + corr
}

#[test]
fn matmul_matches_the_f64_reference_for_every_weight_format() {
    let (n_in, n_out, rows) = (512, 24, 5);
    for threads in [1, 2] {
        let be = CpuBackend::new(threads);
        for &ty in WEIGHT_TYPES {
            let mut rng = Rng::new(7 + u64::from(ty.ggml_id().unwrap_or(0)));
            let (w, w_bytes) = random_weight(&be, &mut rng, ty, n_in, n_out);
            let wf = decode(ty, &w_bytes, n_in);
            let x = rng.values(rows * n_in, 2.0);
            let at = ty.vec_dot_type();
            let (a_bytes, af) = if at == QType::F32 {
                (Vec::new(), x.clone())
            } else {
                let q = encode(at, &x, n_in);
                let f = decode(at, &q, n_in);
                (q, f)
            };
            let mut out = be.zeros(1, 1);
            be.matmul(&tensor(rows, n_in, x), &w, &mut out);
            assert_eq!(be.shape(&out), (rows, n_out));
            let w_rb = ty.row_bytes(n_in).unwrap();
            let a_rb = if at == QType::F32 {
                0
            } else {
                at.row_bytes(n_in).unwrap()
            };
            let mut want = Vec::new();
            for r in 0..rows {
                for c in 0..n_out {
                    want.push(reference_dot(
                        ty,
                        &w_bytes[c * w_rb..(c + 1) * w_rb],
                        &wf[c * n_in..(c + 1) * n_in],
                        a_bytes.get(r * a_rb..(r + 1) * a_rb).unwrap_or(&[]),
                        &af[r * n_in..(r + 1) * n_in],
                    ));
                }
            }
            let e = nmse(out.as_slice(), &want);
            assert!(e <= 1e-10, "{ty}, {threads} threads: NMSE {e:e}");
        }
    }
}

#[test]
fn matmul_of_a_larger_shape_uses_every_tile_path() {
    // Enough rows and columns that the tiling splits both, on three threads.
    let (n_in, n_out, rows) = (256, 200, 40);
    let be = CpuBackend::new(3);
    let mut rng = Rng::new(11);
    let (w, w_bytes) = random_weight(&be, &mut rng, QType::Q4_K, n_in, n_out);
    let wf = decode(QType::Q4_K, &w_bytes, n_in);
    let x = rng.values(rows * n_in, 1.0);
    let af = decode(QType::Q8_K, &encode(QType::Q8_K, &x, n_in), n_in);
    let mut out = be.zeros(0, 0);
    be.matmul(&tensor(rows, n_in, x), &w, &mut out);
    let want: Vec<f64> = (0..rows)
        .flat_map(|r| {
            let (wf, af) = (&wf, &af);
            (0..n_out).map(move |c| {
                (0..n_in)
                    .map(|i| f64::from(wf[c * n_in + i]) * f64::from(af[r * n_in + i]))
                    .sum()
            })
        })
        .collect();
    let e = nmse(out.as_slice(), &want);
    assert!(e <= 1e-10, "NMSE {e:e}");
}

#[test]
fn an_unaligned_f32_weight_is_copied_and_still_correct() {
    let be = CpuBackend::new(1);
    let (n_in, n_out) = (32, 3);
    let mut rng = Rng::new(3);
    let wv = rng.values(n_in * n_out, 1.0);
    // One leading byte puts the f32 data off its 4-byte alignment.
    let mut buf = vec![0u8];
    buf.extend(wv.iter().flat_map(|v| v.to_le_bytes()));
    let owner = Arc::new(buf);
    let w = be
        .weight(WeightDesc {
            name: "unaligned",
            ty: QType::F32,
            dims: &[n_in, n_out],
            data: &owner[1..],
            owner: owner.clone(),
        })
        .unwrap();
    let x = rng.values(n_in, 1.0);
    let mut out = be.zeros(1, n_out);
    be.matmul(&tensor(1, n_in, x.clone()), &w, &mut out);
    let want: Vec<f64> = (0..n_out)
        .map(|c| {
            (0..n_in)
                .map(|i| f64::from(wv[c * n_in + i]) * f64::from(x[i]))
                .sum()
        })
        .collect();
    assert!(nmse(out.as_slice(), &want) <= 1e-12);
}

#[test]
fn weights_with_the_wrong_size_or_format_are_refused_with_their_name() {
    let be = CpuBackend::new(1);
    let owner = Arc::new(vec![0u8; 100]);
    let err = be
        .weight(WeightDesc {
            name: "blk.0.attn_q.weight",
            ty: QType::Q8_0,
            dims: &[32, 3],
            data: &owner[..],
            owner: owner.clone(),
        })
        .unwrap_err();
    assert!(
        matches!(&err, TensorError::WeightSize { name, expected: 102, got: 100, .. } if name == "blk.0.attn_q.weight"),
        "{err}"
    );
    let owner = Arc::new(vec![0u8; 292]);
    let err = be
        .weight(WeightDesc {
            name: "q8k",
            ty: QType::Q8_K,
            dims: &[256, 1],
            data: &owner[..],
            owner: owner.clone(),
        })
        .unwrap_err();
    assert!(
        matches!(
            err,
            TensorError::UnsupportedWeight {
                ty: QType::Q8_K,
                ..
            }
        ),
        "{err}"
    );
    let err = be
        .weight(WeightDesc {
            name: "ragged",
            ty: QType::Q4_0,
            dims: &[33, 1],
            data: &owner[..18],
            owner: owner.clone(),
        })
        .unwrap_err();
    assert!(matches!(err, TensorError::Quant(_)), "{err}");
}

#[test]
fn empty_batches_give_empty_outputs() {
    let be = CpuBackend::new(2);
    let mut rng = Rng::new(5);
    let (w, _) = random_weight(&be, &mut rng, QType::Q8_0, 64, 8);
    let mut out = be.zeros(3, 3);
    be.matmul(&be.zeros(0, 64), &w, &mut out);
    assert_eq!(be.shape(&out), (0, 8));
}

#[test]
fn every_output_is_the_bits_of_the_single_row_dot_product() {
    // The tile micro-kernels reduce each output as `specula_quant::dot` does; tile edges use
    // that kernel itself. Odd shapes put outputs on every path (four weight rows at once, four
    // activation rows at once, leftovers), and odd block counts exercise the kernels' tails.
    // Weights prepared for the matmul (rows packed in groups for the micro-kernels, the rest
    // left plain) give the same bits, and `get_rows` still reads the file layout.
    let kernels = specula_quant::dot::Kernels::active();
    let scalar = specula_quant::dot::Kernels::for_level(specula_quant::dot::SimdLevel::Scalar)
        .expect("the scalar level is always supported");
    for &ty in WEIGHT_TYPES {
        let block = ty.block_size().max(ty.vec_dot_type().block_size()).max(32);
        let shapes = [
            (block, 7, 9),
            (3 * block, 13, 6),
            (5 * block, 4, 1),
            (3 * block, 37, 5),
            // Two and three activation rows left after the groups of four (packed groups of
            // sixteen weight rows, and one plain row).
            (2 * block, 33, 7),
            (block, 17, 2),
        ];
        for ((n_in, n_out, rows), threads, prepared) in shapes
            .into_iter()
            .flat_map(|s| [1, 3].map(|t| (s, t)))
            .flat_map(|(s, t)| [false, true].map(|p| (s, t, p)))
        {
            {
                let be = CpuBackend::new(threads);
                let mut rng = Rng::new(u64::try_from(n_in * 31 + n_out + threads).unwrap());
                let (mut w, w_bytes) = random_weight(&be, &mut rng, ty, n_in, n_out);
                if prepared {
                    let mut plain = be.zeros(0, 0);
                    let ids: Vec<u32> = (0..u32::try_from(n_out).unwrap()).collect();
                    be.get_rows(&w, &be.index(&ids), &mut plain);
                    be.prepare_matmul(&mut w);
                    let mut got = be.zeros(0, 0);
                    be.get_rows(&w, &be.index(&ids), &mut got);
                    assert_eq!(
                        got.as_slice(),
                        plain.as_slice(),
                        "{ty}: get_rows after packing"
                    );
                }
                let x = rng.values(rows * n_in, 1.0);
                let at = ty.vec_dot_type();
                let a_bytes = encode(at, &x, n_in);
                let mut out = be.zeros(0, 0);
                be.matmul(&tensor(rows, n_in, x), &w, &mut out);
                let (w_rb, a_rb) = (ty.row_bytes(n_in).unwrap(), at.row_bytes(n_in).unwrap());
                for r in 0..rows {
                    for c in 0..n_out {
                        let want = kernels
                            .vec_dot(
                                ty,
                                n_in,
                                &w_bytes[c * w_rb..(c + 1) * w_rb],
                                &a_bytes[r * a_rb..(r + 1) * a_rb],
                            )
                            .unwrap();
                        let got = out.as_slice()[r * n_out + c];
                        // Quantized formats: the scalar reference gives the same bits too.
                        if !matches!(ty, QType::F32 | QType::F16 | QType::BF16) {
                            let reference = scalar
                                .vec_dot(
                                    ty,
                                    n_in,
                                    &w_bytes[c * w_rb..(c + 1) * w_rb],
                                    &a_bytes[r * a_rb..(r + 1) * a_rb],
                                )
                                .unwrap();
                            assert_eq!(got.to_bits(), reference.to_bits(), "{ty} vs scalar");
                        }
                        assert_eq!(
                            got.to_bits(),
                            want.to_bits(),
                            "{ty}, n_in {n_in}, prepared {prepared}, row {r}, column {c}: {got} vs {want}"
                        );
                    }
                }
            }
        }
    }
}
