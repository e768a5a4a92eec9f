//! The conformance suite: every op of a backend against the CPU backend (`specula-cpu`), on
//! random shapes including odd sizes, every weight format the device holds and every cache
//! format it keeps, by normalized MSE in named tolerance buckets; plus batch invariance (a
//! row's bits do not depend on the other rows of its batch).
//!
//! [`conformance`] is written once against `Backend`: `tests/conformance.rs` runs it on
//! CubeCL's CPU runtime (and on CUDA with `SPECULA_KERNELS_CUDA=1`), the GPU bench
//! (`examples/gpu_bench.rs`, `cargo xtask gpu`) on the GPU it is given. Buckets: 0 where the
//! device reproduces the CPU backend's operations in its order (integer-format matmuls, norms,
//! attention without soft-capping, RoPE, SwiGLU), [`tol::REORDERED`] and [`tol::LIBM`] where it
//! does not (float-weight sums, the C library's `tanhf`, `expf` of the scalar activations).

use std::sync::Arc;

use specula_cpu::CpuBackend;
use specula_quant::QType;
use specula_tensor::{
    AttentionParams, Backend, GateAct, KvShape, Mask, RopeConfig, RopeKind, WeightDesc, Yarn,
};
use specula_testkit::values;

/// Tolerance buckets (normalized MSE against the CPU backend).
pub mod tol {
    /// Same operations in another order (sums of products of equal inputs).
    pub const REORDERED: f64 = 1e-10;
    /// Transcendental functions of another libm (exp, tanh, cos) on top of reordering.
    pub const LIBM: f64 = 1e-9;
}

fn nmse(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len(), "lengths");
    let (mut num, mut den) = (0f64, 0f64);
    for (&g, &w) in got.iter().zip(want) {
        let d = f64::from(g) - f64::from(w);
        num += d * d;
        den += f64::from(w) * f64::from(w);
    }
    if den == 0.0 { num } else { num / den }
}

/// Checks that failed so far, where `SPECULA_CONFORMANCE_KEEP_GOING` lets the suite go on
/// after a failure (to see every op's standing on a new device in one run).
static FAILED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

fn check(what: &str, got: &[f32], want: &[f32], bound: f64) {
    let finite = got.iter().all(|x| x.is_finite());
    let e = nmse(got, want);
    if std::env::var_os("SPECULA_CONFORMANCE_VERBOSE").is_some() {
        eprintln!("{what}: NMSE {e:.3e}");
    }
    if finite && e <= bound {
        return;
    }
    let msg = if finite {
        format!("{what}: NMSE {e:.3e} > {bound:.0e}")
    } else {
        format!("{what}: non-finite output")
    };
    assert!(
        std::env::var_os("SPECULA_CONFORMANCE_KEEP_GOING").is_some(),
        "{msg}"
    );
    eprintln!("FAIL {msg}");
    FAILED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
}

/// The matmul bound of a weight format: integer formats form the same integer sums and the
/// same float operations in the same order as the CPU backend, so they give its bits; float
/// weights are summed in f64 here and in the CPU's SIMD lanes there.
fn exact_bound(ty: QType) -> f64 {
    if matches!(ty, QType::F32 | QType::F16 | QType::BF16) {
        tol::REORDERED
    } else {
        0.0
    }
}

/// The weight formats of the matmul checks: every format of a model file the device holds.
const FORMATS: [QType; 17] = [
    QType::F32,
    QType::F16,
    QType::BF16,
    QType::Q8_0,
    QType::Q4_0,
    QType::Q4_1,
    QType::Q5_0,
    QType::Q5_1,
    QType::Q4_K,
    QType::Q5_K,
    QType::Q6_K,
    QType::Q2_K,
    QType::Q3_K,
    QType::IQ4_XS,
    QType::IQ4_NL,
    QType::MXFP4,
    QType::NVFP4,
];

/// A weight of `ty` with `n_out` rows of `n_in` random values, made by each backend from
/// the same bytes.
#[derive(Debug)]
pub struct Weights {
    /// The bytes (an owner weights may borrow from).
    pub bytes: Arc<Vec<u8>>,
    /// Their format.
    pub ty: QType,
    /// Their dims, ggml order.
    pub dims: Vec<usize>,
}

impl Weights {
    /// `n_out` rows of `n_in` pseudo-random values quantized to `ty`.
    ///
    /// # Panics
    /// If `n_in` is not whole blocks of `ty`.
    #[must_use]
    pub fn new(ty: QType, n_in: usize, n_out: usize, seed: u64) -> Self {
        let x = values(seed, n_in * n_out, 1.0);
        let row = ty.row_bytes(n_in).unwrap();
        let mut bytes = vec![0u8; row * n_out];
        for (src, dst) in x.chunks_exact(n_in).zip(bytes.chunks_exact_mut(row)) {
            specula_quant::quantize_row(ty, src, dst).unwrap();
        }
        Self {
            bytes: Arc::new(bytes),
            ty,
            dims: if n_out == 1 {
                vec![n_in]
            } else {
                vec![n_in, n_out]
            },
        }
    }

    /// The weight on `be` (prepared for its matmuls when `matmul`).
    ///
    /// # Panics
    /// If the backend refuses it.
    pub fn on<B: Backend>(&self, be: &B, matmul: bool) -> B::Weight {
        let mut w = be
            .weight(WeightDesc {
                name: "w",
                ty: self.ty,
                dims: &self.dims,
                data: &self.bytes,
                owner: self.bytes.clone(),
            })
            .unwrap();
        if matmul {
            be.prepare_matmul(&mut w);
        }
        w
    }
}

fn host<B: Backend>(be: &B, t: &B::Tensor) -> Vec<f32> {
    let mut v = Vec::new();
    be.to_host(t, &mut v);
    v
}

/// Runs `f` on the backend under test and on the CPU backend with the same inputs.
struct Pair<'a, B: Backend> {
    be: &'a B,
    cpu: CpuBackend,
}

impl<B: Backend> Pair<'_, B> {
    fn tensors(
        &self,
        rows: usize,
        cols: usize,
        seed: u64,
        scale: f32,
    ) -> (B::Tensor, specula_cpu::CpuTensor) {
        let v = values(seed, rows * cols, scale);
        (
            self.be.from_host(rows, cols, &v),
            self.cpu.from_host(rows, cols, &v),
        )
    }
}

/// `[rows, 7]` of fixed values (`put_cols`'s narrow operand).
fn rc_narrow<B: Backend>(be: &B, rows: usize) -> B::Tensor {
    be.from_host(rows, 7, &values(31, rows * 7, 2.0))
}

/// The whole op-level suite on `be`.
///
/// # Panics
/// At the first op outside its bucket (naming the op, shape and NMSE).
#[allow(clippy::too_many_lines, reason = "one suite, op after op")]
pub fn conformance<B: Backend>(be: &B) {
    let p = Pair {
        be,
        cpu: CpuBackend::new(2),
    };
    let cpu = &p.cpu;

    // Matmul: every weight format, odd row counts and output widths.
    for ty in FORMATS {
        for &(rows, n_in, n_out) in &[(1, 256, 37), (3, 512, 64), (13, 256, 9), (40, 256, 33)] {
            let w = Weights::new(ty, n_in, n_out, 7 + rows as u64);
            let (wb, wc) = (w.on(be, true), w.on(cpu, true));
            let (xb, xc) = p.tensors(rows, n_in, 11, 1.0);
            let (mut ob, mut oc) = (be.zeros(0, 0), cpu.zeros(0, 0));
            be.matmul(&xb, &wb, &mut ob);
            cpu.matmul(&xc, &wc, &mut oc);
            assert_eq!(be.shape(&ob), (rows, n_out));
            check(
                &format!("matmul {ty} {rows}×{n_in}→{n_out}"),
                &host(be, &ob),
                &host(cpu, &oc),
                exact_bound(ty),
            );

            // Batch invariance: each row alone gives the bits it had in the batch.
            let all = host(be, &ob);
            let xs = host(be, &xb);
            for r in [0, rows - 1] {
                let x1 = be.from_host(1, n_in, &xs[r * n_in..(r + 1) * n_in]);
                let mut o1 = be.zeros(0, 0);
                be.matmul(&x1, &wb, &mut o1);
                let one = host(be, &o1);
                assert!(
                    one.iter()
                        .zip(&all[r * n_out..(r + 1) * n_out])
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "matmul {ty}: row {r} alone differs from the batch"
                );
            }

            // get_rows dequantizes rows exactly (the same dequantizer).
            let ids = [0u32, u32::try_from(n_out - 1).unwrap(), 2];
            let (mut gb, mut gc) = (be.zeros(0, 0), cpu.zeros(0, 0));
            be.get_rows(&wb, &be.index(&ids), &mut gb);
            cpu.get_rows(&wc, &cpu.index(&ids), &mut gc);
            check(
                &format!("get_rows {ty}"),
                &host(be, &gb),
                &host(cpu, &gc),
                0.0,
            );
        }
    }

    // Norms.
    for &(rows, cols) in &[(1, 64), (5, 576), (3, 100)] {
        let w = Weights::new(QType::F32, cols, 1, 3);
        let (wb, wc) = (w.on(be, false), w.on(cpu, false));
        let (xb, xc) = p.tensors(rows, cols, 5, 2.0);
        let (mut ob, mut oc) = (be.zeros(0, 0), cpu.zeros(0, 0));
        be.rms_norm(&xb, Some(&wb), 1e-6, &mut ob);
        cpu.rms_norm(&xc, Some(&wc), 1e-6, &mut oc);
        check(
            &format!("rms_norm {rows}×{cols}"),
            &host(be, &ob),
            &host(cpu, &oc),
            0.0,
        );
        be.rms_norm(&xb, None, 1e-5, &mut ob);
        cpu.rms_norm(&xc, None, 1e-5, &mut oc);
        check(
            "rms_norm without weight",
            &host(be, &ob),
            &host(cpu, &oc),
            0.0,
        );
    }
    {
        let w = Weights::new(QType::F32, 32, 1, 9);
        let (wb, wc) = (w.on(be, false), w.on(cpu, false));
        let (mut xb, mut xc) = p.tensors(3, 32 * 6, 13, 1.5);
        be.rms_norm_groups(&mut xb, 32, &wb, 1e-6);
        cpu.rms_norm_groups(&mut xc, 32, &wc, 1e-6);
        check("rms_norm_groups", &host(be, &xb), &host(cpu, &xc), 0.0);
    }

    // RoPE: both pairings, partial rotation, YaRN, frequency factors.
    let yarn = RopeConfig {
        freq_scale: 0.25,
        yarn: Some(Yarn {
            orig_ctx: 4096,
            ext_factor: 1.0,
            attn_factor: 1.0,
            beta_fast: 32.0,
            beta_slow: 1.0,
        }),
        ..RopeConfig::new(RopeKind::Neox, 64, 1e6)
    };
    let factors = RopeConfig {
        freq_factors: Some(
            (0..16)
                .map(|i| 1.0 + i as f32 * 0.5)
                .collect::<Vec<_>>()
                .into(),
        ),
        ..RopeConfig::new(RopeKind::Neox, 32, 1e4)
    };
    for (cfg, hd) in [
        (RopeConfig::new(RopeKind::Normal, 64, 1e4), 64),
        (RopeConfig::new(RopeKind::Neox, 64, 1e6), 64),
        (RopeConfig::new(RopeKind::Neox, 32, 1e4), 80),
        (yarn, 64),
        (factors, 48),
    ] {
        let pos = [0u32, 7, 1000, 31_999];
        let (mut xb, mut xc) = p.tensors(4, hd * 3, 17, 1.0);
        be.rope(&mut xb, hd, &be.index(&pos), &cfg);
        cpu.rope(&mut xc, hd, &cpu.index(&pos), &cfg);
        check(
            &format!("rope {:?} n_rot {} hd {hd}", cfg.kind, cfg.n_rot),
            &host(be, &xb),
            &host(cpu, &xc),
            tol::REORDERED,
        );
    }

    // Element-wise ops.
    {
        let (rows, cols) = (3, 130);
        let (gb, gc) = p.tensors(rows, cols, 21, 4.0);
        let (ub, uc) = p.tensors(rows, cols, 22, 1.0);
        let (mut ob, mut oc) = (be.zeros(0, 0), cpu.zeros(0, 0));
        be.swiglu(&gb, &ub, &mut ob);
        cpu.swiglu(&gc, &uc, &mut oc);
        check("swiglu", &host(be, &ob), &host(cpu, &oc), tol::LIBM);
        be.geglu(&gb, &ub, &mut ob);
        cpu.geglu(&gc, &uc, &mut oc);
        check("geglu", &host(be, &ob), &host(cpu, &oc), tol::LIBM);

        let (mut ab, mut ac) = p.tensors(rows, cols, 23, 30.0);
        be.add(&mut ab, &ub);
        cpu.add(&mut ac, &uc);
        check("add", &host(be, &ab), &host(cpu, &ac), 0.0);
        be.scale(&mut ab, 0.37);
        cpu.scale(&mut ac, 0.37);
        check("scale", &host(be, &ab), &host(cpu, &ac), 0.0);
        be.softcap(&mut ab, 5.0);
        cpu.softcap(&mut ac, 5.0);
        check("softcap", &host(be, &ab), &host(cpu, &ac), tol::LIBM);
        be.silu(&mut ab);
        cpu.silu(&mut ac);
        check("silu", &host(be, &ab), &host(cpu, &ac), tol::LIBM);
        // Equal inputs again for the exact ops below.
        let (mut ab, mut ac) = p.tensors(rows, cols, 28, 3.0);

        let b = Weights::new(QType::F32, cols, 1, 24);
        be.add_vector(&mut ab, &b.on(be, false));
        cpu.add_vector(&mut ac, &b.on(cpu, false));
        check("add_vector", &host(be, &ab), &host(cpu, &ac), 0.0);

        for (gcols, act) in [
            (cols, GateAct::Sigmoid),
            (10, GateAct::Softplus),
            (1, GateAct::Sigmoid),
        ] {
            let (gb, gc) = p.tensors(rows, gcols, 25, 30.0);
            be.gate_mul(&mut ab, &gb, act);
            cpu.gate_mul(&mut ac, &gc, act);
            check(
                &format!("gate_mul {act:?} /{gcols}"),
                &host(be, &ab),
                &host(cpu, &ac),
                tol::LIBM,
            );
        }
        let (ab, ac) = p.tensors(rows, cols, 29, 3.0);

        be.gather_cols(&ab, 13, 2..7, &mut ob);
        cpu.gather_cols(&ac, 13, 2..7, &mut oc);
        assert_eq!(be.shape(&ob), cpu.shape(&oc));
        check("gather_cols", &host(be, &ob), &host(cpu, &oc), 0.0);

        be.copy_rows(&ab, &be.index(&[2, 0, 2]), &mut ob);
        cpu.copy_rows(&ac, &cpu.index(&[2, 0, 2]), &mut oc);
        check("copy_rows", &host(be, &ob), &host(cpu, &oc), 0.0);

        // Two of the four rows scattered into the middle of a five-row tensor, the rest kept.
        let (mut pb, mut pc) = p.tensors(5, cols, 28, 1.0);
        let (rb, rc) = p.tensors(2, cols, 29, 1.0);
        be.put_rows(&rb, &be.index(&[3, 1]), &mut pb);
        cpu.put_rows(&rc, &cpu.index(&[3, 1]), &mut pc);
        assert_eq!(be.shape(&pb), (5, cols));
        check("put_rows", &host(be, &pb), &host(cpu, &pc), 0.0);

        // A narrower tensor into a column range of a wider one, its other columns kept; and
        // both against the host's own copy.
        let (mut wb, mut wc) = p.tensors(rows, cols + 9, 30, 1.0);
        let want_wide = {
            let mut w = host(cpu, &wc);
            let n = host(cpu, &rc_narrow(cpu, rows));
            for r in 0..rows {
                w[r * (cols + 9) + 4..r * (cols + 9) + 11].copy_from_slice(&n[r * 7..r * 7 + 7]);
            }
            w
        };
        let (nb, nc) = (rc_narrow(be, rows), rc_narrow(cpu, rows));
        be.put_cols(&nb, 4, &mut wb);
        cpu.put_cols(&nc, 4, &mut wc);
        check("put_cols", &host(be, &wb), &host(cpu, &wc), 0.0);
        check("put_cols (host)", &host(cpu, &wc), &want_wide, 0.0);

        // NaN to 0, infinities and massive values to ±65504, the rest as they are.
        let special = [
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            1e6,
            -7e4,
            65504.0,
            -3.25,
            0.0,
        ];
        let want_clamped = [
            0.0, 65504.0, -65504.0, 65504.0, -65504.0, 65504.0, -3.25, 0.0,
        ];
        let (mut xb, mut xc) = (be.from_host(2, 4, &special), cpu.from_host(2, 4, &special));
        be.clamp_finite(&mut xb, 65504.0);
        cpu.clamp_finite(&mut xc, 65504.0);
        check("clamp_finite", &host(be, &xb), &want_clamped, 0.0);
        check("clamp_finite (cpu)", &host(cpu, &xc), &want_clamped, 0.0);

        // Argmax per row: random rows; a row whose maximum repeats (the first wins); NaN and
        // −∞ that never win; a row of nothing else; a vocabulary-sized row.
        let mut rows_in: Vec<Vec<f32>> = (0..4u64)
            .map(|r| {
                let (t, _) = p.tensors(1, 1000, 40 + r, 5.0);
                host(be, &t)
            })
            .collect();
        rows_in[1][17] = 9.0;
        rows_in[1][400] = 9.0;
        rows_in[1][999] = 9.0;
        rows_in[2][3] = f32::NAN;
        rows_in[2][500] = f32::NAN;
        rows_in[3] = vec![f32::NEG_INFINITY; 1000];
        rows_in[3][7] = f32::NAN;
        let flat: Vec<f32> = rows_in.concat();
        let (xb, xc) = (be.from_host(4, 1000, &flat), cpu.from_host(4, 1000, &flat));
        let (mut ib, mut ic) = (Vec::new(), Vec::new());
        be.argmax_rows(&xb, &mut ib);
        cpu.argmax_rows(&xc, &mut ic);
        assert_eq!(ib, ic, "argmax_rows");
        assert_eq!(ic[1], 17, "argmax_rows: the first of equal maxima");
        assert_eq!(
            ic[3],
            specula_tensor::NO_ARGMAX,
            "argmax_rows: no value above −∞"
        );
        let (vb, vc) = p.tensors(2, 151_936, 44, 8.0);
        be.argmax_rows(&vb, &mut ib);
        cpu.argmax_rows(&vc, &mut ic);
        assert_eq!(ib, ic, "argmax_rows over a vocabulary");

        // Top-1 and its probability: the ids exactly, the probabilities within rounding of
        // the host's f64 sums (`top1_row`), on the rows above.
        for (what, xb, xc, rows) in [("rows", &xb, &xc, 4), ("vocabulary", &vb, &vc, 2)] {
            let (mut ib, mut pb, mut ic, mut pc) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
            be.top1_rows(xb, &mut ib, &mut pb);
            cpu.top1_rows(xc, &mut ic, &mut pc);
            let flat = host(cpu, xc);
            let cols = flat.len() / rows;
            let want: Vec<(u32, f32)> = flat
                .chunks_exact(cols)
                .map(specula_tensor::top1_row)
                .collect();
            let (wi, wp): (Vec<u32>, Vec<f32>) = want.into_iter().unzip();
            assert_eq!(ib, wi, "top1_rows {what}");
            assert_eq!(ic, wi, "top1_rows {what} (cpu)");
            check(&format!("top1_rows {what}"), &pb, &wp, tol::LIBM);
            check(&format!("top1_rows {what} (cpu)"), &pc, &wp, 0.0);
        }

        // Top-k (DFlash2's candidates): the ids and values exactly, in `total_cmp` order with
        // equal values by lower column (ties, NaN, −∞ in the rows above), k of 1, 8, more
        // than a row holds; a vocabulary-sized row.
        for (what, xb, xc, rows, k) in [
            ("rows", &xb, &xc, 4, 8),
            ("rows, k 1", &xb, &xc, 4, 1),
            ("rows, k past the row", &xb, &xc, 4, 1200),
            ("vocabulary", &vb, &vc, 2, 9),
        ] {
            let (mut ib, mut vb_, mut ic, mut vc_) =
                (Vec::new(), Vec::new(), Vec::new(), Vec::new());
            be.topk_rows(xb, k, &mut ib, &mut vb_);
            cpu.topk_rows(xc, k, &mut ic, &mut vc_);
            let flat = host(cpu, xc);
            let cols = flat.len() / rows;
            let (mut wi, mut wv) = (Vec::new(), Vec::new());
            for row in flat.chunks_exact(cols) {
                specula_tensor::topk_row(row, k, &mut wi, &mut wv);
            }
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
            assert_eq!(ib, wi, "topk_rows {what}");
            assert_eq!(ic, wi, "topk_rows {what} (cpu)");
            assert_eq!(bits(&vb_), bits(&wv), "topk_rows {what}: values");
            assert_eq!(bits(&vc_), bits(&wv), "topk_rows {what} (cpu): values");
        }
        // Equal maxima come lowest column first; NaN leads (`total_cmp`).
        let mut want = (Vec::new(), Vec::new());
        specula_tensor::topk_row(&rows_in[1], 3, &mut want.0, &mut want.1);
        assert_eq!(want.0, [17, 400, 999], "topk_row: equal values by column");
        want.0.clear();
        specula_tensor::topk_row(&rows_in[2], 2, &mut want.0, &mut want.1);
        assert_eq!(want.0, [3, 500], "topk_row: NaN first, in total_cmp order");
    }

    // DFlash2's block convolution: 7 rows of 24 values in groups of 4, kernel 3, both sides;
    // the CPU backend against the host reference exactly, the device within rounding (its
    // products are not fused, so its bits too).
    {
        let (n, e, kernel, group) = (7, 24, 3, 4);
        let (xb_, xc_) = p.tensors(n, e, 50, 2.0);
        let (db, dc) = p.tensors(n, 2 * kernel * (e / group), 51, 0.5);
        let (bb, bc) = p.tensors(2 * kernel, e, 52, 1.0);
        for side in 0..2 {
            let (mut ob, mut oc) = (be.zeros(0, 0), cpu.zeros(0, 0));
            be.block_conv(&xb_, &db, &bb, side, kernel, group, &mut ob);
            cpu.block_conv(&xc_, &dc, &bc, side, kernel, group, &mut oc);
            let mut want = Vec::new();
            specula_tensor::block_conv_rows(
                &host(cpu, &xc_),
                &host(cpu, &dc),
                &host(cpu, &bc),
                side,
                (e, kernel, group),
                &mut want,
            );
            check(
                &format!("block_conv side {side}"),
                &host(be, &ob),
                &want,
                0.0,
            );
            check(
                &format!("block_conv side {side} (cpu)"),
                &host(cpu, &oc),
                &want,
                0.0,
            );
        }
    }

    // Attention: each cache format the device keeps, K and V apart, GQA, every mask,
    // soft-capping; heads of 64 (rotated K and V), 32 (not rotated), 128 (K rotated by 128, V
    // by 64) and 256 (two turbo groups).
    let shapes = [
        (Mask::Causal, None, 4, 2, 64),
        (Mask::SlidingWindow(5), None, 2, 2, 32),
        (Mask::None, Some(50.0), 6, 1, 128),
        (Mask::Causal, None, 4, 2, 256),
    ];
    let blocks = [
        QType::Q8_0,
        QType::Q4_0,
        QType::Q4_1,
        QType::Q5_0,
        QType::Q5_1,
        QType::IQ4_NL,
    ];
    let mut cases: Vec<(QType, QType, usize)> = Vec::new();
    for s in 0..shapes.len() {
        cases.push((QType::F16, QType::F16, s));
        cases.push((QType::F32, QType::F32, s));
    }
    // Every block format as K, as V and as both on the first shape; mixed pairs on the others.
    for &b in &blocks {
        cases.extend([(b, QType::F16, 0), (QType::F16, b, 0), (b, b, 0)]);
    }
    cases.extend([
        (QType::Q4_1, QType::Q5_1, 1),
        (QType::Q8_0, QType::Q4_0, 1),
        (QType::Q8_0, QType::Q8_0, 2),
        (QType::Q5_0, QType::Q4_1, 2),
        // turbo2/3/4 on heads of whole 128-value groups, K and V apart.
        (QType::Turbo4, QType::Turbo4, 3),
        (QType::Turbo3, QType::F16, 3),
        (QType::F16, QType::Turbo2, 3),
        (QType::Q8_0, QType::Turbo4, 3),
        (QType::Turbo4, QType::Q4_0, 2),
        (QType::IQ4_NL, QType::Turbo3, 3),
        // 64-value heads stored in two stages.
        (QType::Turbo4, QType::Turbo4, 0),
        (QType::Turbo3, QType::F16, 0),
        (QType::Q8_0, QType::Turbo2, 0),
    ]);
    for (kt, vt, si) in cases {
        {
            let (mask, softcap, n_head, n_kv, hd) = shapes[si];
            let ty = format!("{kt}/{vt}");
            let (n_ctx, depth, n_q) = (600, 530, 37);
            let shape = KvShape::uniform(2, n_ctx, n_kv, hd, kt, vt);
            let (mut kb, mut kc) = (
                be.kv_new(shape.clone()).unwrap(),
                cpu.kv_new(shape).unwrap(),
            );
            let cells: Vec<u32> = (0..u32::try_from(depth + n_q).unwrap()).collect();
            let (knb, knc) = p.tensors(cells.len(), n_kv * hd, 31, 1.0);
            let (vnb, vnc) = p.tensors(cells.len(), n_kv * hd, 32, 1.0);
            be.kv_write(&mut kb, 1, &be.index(&cells), &knb, &vnb);
            cpu.kv_write(&mut kc, 1, &cpu.index(&cells), &knc, &vnc);
            let (qb, qc) = p.tensors(n_q, n_head * hd, 33, 1.0);
            let (lo, hi) = (
                u32::try_from(depth).unwrap(),
                u32::try_from(depth + n_q).unwrap(),
            );
            let q_pos: Vec<u32> = (lo..hi).collect();
            let kv_pos: Vec<u32> = (0..hi).collect();
            let params = AttentionParams {
                layer: 1,
                n_head,
                q_pos: &q_pos[..],
                kv_pos: &kv_pos[..],
                scale: 1.0 / (hd as f32).sqrt(),
                mask,
                softcap,
            };
            let (qib, kib) = (be.index(&q_pos), be.index(&kv_pos));
            let (qic, kic) = (cpu.index(&q_pos), cpu.index(&kv_pos));
            // Without soft-capping: the CPU backend's operations in its order, so its bits
            // (soft-capping calls the C library's tanhf, which the device does not reproduce).
            let (mut ob, mut oc) = (be.zeros(0, 0), cpu.zeros(0, 0));
            be.attention(&qb, &kb, &params.with_positions(&qib, &kib), &mut ob);
            cpu.attention(&qc, &kc, &params.with_positions(&qic, &kic), &mut oc);
            check(
                &format!("attention {ty} {mask:?} {softcap:?} {n_head}/{n_kv}×{hd}"),
                &host(be, &ob),
                &host(cpu, &oc),
                if softcap.is_some() { tol::LIBM } else { 0.0 },
            );

            // Batch invariance: the last query row alone.
            let all = host(be, &ob);
            let qs = host(be, &qb);
            let w = n_head * hd;
            let q1 = be.from_host(1, w, &qs[(n_q - 1) * w..]);
            let q1b = be.index(&q_pos[n_q - 1..]);
            let mut o1 = be.zeros(0, 0);
            be.attention(&q1, &kb, &params.with_positions(&q1b, &kib), &mut o1);
            assert!(
                host(be, &o1)
                    .iter()
                    .zip(&all[(n_q - 1) * w..])
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "attention {ty} {mask:?}: the last row alone differs from the batch"
            );
        }
    }
    attention_seqs(&p);
    recurrent(&p);
    moe(&p);
    let failed = FAILED.swap(0, std::sync::atomic::Ordering::Relaxed);
    assert!(failed == 0, "{failed} checks failed (printed above)");
}

/// The attention of several sequences as one op (`attention_seqs`) against the CPU backend's
/// definition of it (each sequence gathered, written, attended, scattered): caches of
/// different formats and depths (split-K decode rows, prefill rows, a sliding window), a
/// layer that writes its cells and one that only reads them; and on the backend itself, the
/// op's bits are its definition's.
fn attention_seqs<B: Backend>(p: &Pair<'_, B>) {
    use specula_tensor::{SeqAttention, attention_seqs_apart};
    let (be, cpu) = (p.be, &p.cpu);
    let (n_head, n_kv, hd) = (4, 2, 64);
    // (K type, V type, depth already cached, rows, mask)
    let seqs = [
        (QType::F16, QType::F16, 300, 1, Mask::Causal),
        (QType::Q8_0, QType::Q4_0, 21, 6, Mask::SlidingWindow(16)),
        (QType::Turbo4, QType::Turbo3, 40, 1, Mask::Causal),
        (QType::F32, QType::F32, 0, 9, Mask::Causal),
    ];
    /// One backend's run: the op (or its definition) on fresh caches over a writing layer and
    /// a reading one; the outputs of both.
    fn run<C: Backend>(
        be: &C,
        seqs: &[(QType, QType, usize, usize, Mask)],
        (n_head, n_kv, hd): (usize, usize, usize),
        apart: bool,
    ) -> Vec<Vec<f32>> {
        let (kw, cols) = (n_kv * hd, n_head * hd);
        let total: usize = seqs.iter().map(|s| s.3).sum();
        let u = |r: std::ops::Range<usize>| -> Vec<u32> {
            r.map(|i| u32::try_from(i).unwrap()).collect()
        };
        let mut caches: Vec<C::Kv> = seqs
            .iter()
            .enumerate()
            .map(|(i, &(kt, vt, depth, _, _))| {
                let mut kv = be
                    .kv_new(KvShape::uniform(1, 400, n_kv, hd, kt, vt))
                    .unwrap();
                if depth > 0 {
                    let seed = 200 + 2 * i as u64;
                    let kk = be.from_host(depth, kw, &values(seed, depth * kw, 1.0));
                    let vv = be.from_host(depth, kw, &values(seed + 1, depth * kw, 1.0));
                    be.kv_write(&mut kv, 0, &be.index(&u(0..depth)), &kk, &vv);
                }
                kv
            })
            .collect();
        let q = be.from_host(total, cols, &values(210, total * cols, 1.0));
        let k = be.from_host(total, kw, &values(211, total * kw, 1.0));
        let v = be.from_host(total, kw, &values(212, total * kw, 1.0));
        let mut ixs = Vec::new();
        let mut off = 0;
        for &(_, _, depth, n, _) in seqs {
            ixs.push((
                be.index(&u(off..off + n)),
                be.index(&u(depth..depth + n)),
                be.index(&u(depth..depth + n)),
                be.index(&u(0..depth + n)),
            ));
            off += n;
        }
        let mut outs = Vec::new();
        for write in [true, false] {
            let mut off = 0;
            let mut att: Vec<SeqAttention<'_, C::Kv, C::Index>> = caches
                .iter_mut()
                .zip(&ixs)
                .zip(seqs)
                .map(|((kv, (rows, cells, qp, kp)), &(_, _, _, n, mask))| {
                    let a = SeqAttention {
                        kv,
                        rows: off..off + n,
                        row_index: rows,
                        cells: write.then_some(cells),
                        params: AttentionParams {
                            layer: 0,
                            n_head,
                            q_pos: qp,
                            kv_pos: kp,
                            scale: 0.125,
                            mask,
                            softcap: None,
                        },
                    };
                    off += n;
                    a
                })
                .collect();
            let mut out = be.zeros(0, 0);
            if apart {
                attention_seqs_apart(be, &q, &k, &v, &mut att, &mut out);
            } else {
                be.attention_seqs(&q, &k, &v, &mut att, &mut out);
            }
            assert_eq!(
                be.shape(&out),
                (total, cols),
                "attention_seqs: output shape"
            );
            outs.push(host(be, &out));
        }
        outs
    }
    let dims = (n_head, n_kv, hd);
    let want = run(cpu, &seqs, dims, true);
    let got = run(be, &seqs, dims, false);
    let mine = run(be, &seqs, dims, true);
    for (l, what) in ["writing layer", "reading layer"].iter().enumerate() {
        check(&format!("attention_seqs, {what}"), &got[l], &want[l], 0.0);
        assert!(
            got[l]
                .iter()
                .zip(&mine[l])
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "attention_seqs, {what}: the op's bits differ from its definition's"
        );
    }
}

/// The recurrent ops (causal convolution, gated delta rule) over a forward of several rows,
/// a rollback to a kept state, and the same rows one at a time (batch invariance); tiled
/// (Qwen3.5) and grouped (Qwen3-Next) value heads.
fn recurrent<B: Backend>(p: &Pair<'_, B>) {
    use specula_tensor::{DeltaNetParams, RecurrentLayers, RecurrentShape};
    let (be, cpu) = (p.be, &p.cpu);
    for grouped in [false, true] {
        let sh = RecurrentShape {
            conv_kernel: 4,
            conv_channels: 3 * 2 * 16 + 4 * 16,
            n_head_k: 2,
            n_head_v: 4,
            head_dim: 16,
            grouped,
        };
        let (hk, hv, d, ch) = (sh.n_head_k, sh.n_head_v, sh.head_dim, sh.conv_channels);
        let mut shape = KvShape::uniform(1, 64, 1, 32, QType::F16, QType::F16);
        shape.recurrent = Some(RecurrentLayers {
            layers: vec![Some(sh)],
            snapshots: 3,
        });
        let (mut kb, mut kc) = (
            be.kv_new(shape.clone()).unwrap(),
            cpu.kv_new(shape).unwrap(),
        );
        let conv = Weights::new(QType::F32, sh.conv_kernel, ch, 41);
        let (wb, wc) = (conv.on(be, false), conv.on(cpu, false));
        let dt = Weights::new(QType::F32, hv, 1, 42);
        let a = Weights::new(QType::F32, hv, 1, 43);
        let (dtb, dtc, ab, ac) = (
            dt.on(be, false),
            dt.on(cpu, false),
            a.on(be, false),
            a.on(cpu, false),
        );
        let what = if grouped { "grouped" } else { "tiled" };
        // (pos0, rows, seed): a forward of 6, a rollback to the state after its 4th row (a
        // kept snapshot) with 3 new rows, then 2 single rows.
        for (pos0, rows, seed) in [(0, 6, 50), (4, 3, 60), (7, 1, 70), (8, 1, 80)] {
            assert!(
                be.kv_holds(&kb, pos0) && cpu.kv_holds(&kc, pos0),
                "{what}: position {pos0} kept"
            );
            let (xb, xc) = p.tensors(rows, ch, seed, 1.0);
            let (mut ob, mut oc) = (be.zeros(0, 0), cpu.zeros(0, 0));
            be.ssm_conv(&mut kb, 0, pos0, &xb, &wb, &mut ob);
            cpu.ssm_conv(&mut kc, 0, pos0, &xc, &wc, &mut oc);
            check(
                &format!("ssm_conv {what} at {pos0}, {rows} rows"),
                &host(be, &ob),
                &host(cpu, &oc),
                0.0,
            );
            let (qb, qc) = p.tensors(rows, hk * d, seed + 1, 1.0);
            let (kkb, kkc) = p.tensors(rows, hk * d, seed + 2, 1.0);
            let (vb, vc) = p.tensors(rows, hv * d, seed + 3, 1.0);
            let (alb, alc) = p.tensors(rows, hv, seed + 4, 1.0);
            let (beb, bec) = p.tensors(rows, hv, seed + 5, 1.0);
            let params = DeltaNetParams {
                layer: 0,
                pos0,
                eps: 1e-6,
            };
            be.gated_delta_net(
                &mut kb, &params, &qb, &kkb, &vb, &alb, &beb, &dtb, &ab, &mut ob,
            );
            cpu.gated_delta_net(
                &mut kc, &params, &qc, &kkc, &vc, &alc, &bec, &dtc, &ac, &mut oc,
            );
            // The decay's softplus goes through the device's log1p.
            check(
                &format!("gated_delta_net {what} at {pos0}, {rows} rows"),
                &host(be, &ob),
                &host(cpu, &oc),
                tol::LIBM,
            );
        }
        assert!(!be.kv_holds(&kb, 3), "{what}: position 3 was not kept");
    }

    // Batch invariance: five rows at once equal the same rows one at a time.
    let sh = RecurrentShape {
        conv_kernel: 4,
        conv_channels: 32,
        n_head_k: 1,
        n_head_v: 2,
        head_dim: 8,
        grouped: false,
    };
    let mut shape = KvShape::uniform(1, 16, 1, 32, QType::F16, QType::F16);
    shape.recurrent = Some(RecurrentLayers {
        layers: vec![Some(sh)],
        snapshots: 0,
    });
    let conv = Weights::new(QType::F32, 4, 32, 44).on(be, false);
    let dt = Weights::new(QType::F32, 2, 1, 45).on(be, false);
    let a = Weights::new(QType::F32, 2, 1, 46).on(be, false);
    let x = values(90, 5 * 32, 1.0);
    let (q, k, v) = (
        values(91, 5 * 8, 1.0),
        values(92, 5 * 8, 1.0),
        values(93, 5 * 16, 1.0),
    );
    let (al, bt) = (values(94, 5 * 2, 1.0), values(95, 5 * 2, 1.0));
    let run = |split: bool| {
        let mut kv = be.kv_new(shape.clone()).unwrap();
        let (mut conv_out, mut rule_out) = (Vec::new(), Vec::new());
        let chunks: Vec<(usize, usize)> = if split {
            (0..5).map(|r| (r, 1)).collect()
        } else {
            vec![(0, 5)]
        };
        for (r0, n) in chunks {
            let t = |v: &[f32], w: usize| be.from_host(n, w, &v[r0 * w..(r0 + n) * w]);
            let mut o = be.zeros(0, 0);
            be.ssm_conv(&mut kv, 0, r0, &t(&x, 32), &conv, &mut o);
            conv_out.extend(host(be, &o));
            let params = DeltaNetParams {
                layer: 0,
                pos0: r0,
                eps: 1e-6,
            };
            be.gated_delta_net(
                &mut kv,
                &params,
                &t(&q, 8),
                &t(&k, 8),
                &t(&v, 16),
                &t(&al, 2),
                &t(&bt, 2),
                &dt,
                &a,
                &mut o,
            );
            rule_out.extend(host(be, &o));
        }
        (conv_out, rule_out)
    };
    let (whole, apart) = (run(false), run(true));
    let same = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
    assert!(
        same(&whole.0, &apart.0),
        "ssm_conv: rows in one batch differ from rows alone"
    );
    assert!(
        same(&whole.1, &apart.1),
        "gated_delta_net: rows in one batch differ from rows alone"
    );
}

/// One `matmul_id` check: its rows, whether each pair has its own row of `x`, whether the
/// experts are scaled, and the experts on the backend and on the CPU backend.
struct IdCase<'a, B: Backend> {
    what: &'static str,
    rows: usize,
    per_pair: bool,
    scaled: bool,
    eb: &'a [B::Weight],
    ec: &'a [specula_cpu::CpuWeight],
}

impl<'a, B: Backend> IdCase<'a, B> {
    fn new(
        what: &'static str,
        rows: usize,
        per_pair: bool,
        scaled: bool,
        eb: &'a [B::Weight],
        ec: &'a [specula_cpu::CpuWeight],
    ) -> Self {
        Self {
            what,
            rows,
            per_pair,
            scaled,
            eb,
            ec,
        }
    }
}

/// Bit equality of two rows.
fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// A mixture of experts' ops: the routing against the host's `route_row` (softmax and
/// sigmoid, with and without a selection bias, normalized or not, scaled, equal scores, one
/// and many experts per row, one and many rows); `matmul_id` over the views of a fused
/// gate-and-up stack and over experts of their own, in every weight format, few pairs (the
/// device's routed launch) and many (grouped by expert), each pair's row with the bits of a
/// `matmul` of that row alone; the weighted sum.
#[allow(
    clippy::too_many_lines,
    reason = "one family of ops, check after check"
)]
fn moe<B: Backend>(p: &Pair<'_, B>) {
    use specula_tensor::{MoeRoute, route_row};
    let (be, cpu) = (p.be, &p.cpu);
    let (mut rb, mut rc) = (be.routes(), cpu.routes());
    let (mut ib, mut wb, mut ic, mut wc) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let route = |n_used, sigmoid, norm, scale| MoeRoute {
        n_used,
        sigmoid,
        norm,
        scale,
    };
    // (rows, experts, the routing, the bias's seed).
    let cases = [
        (1, 8, route(1, false, false, 1.0), None),
        (1, 8, route(8, false, true, 1.0), None),
        (6, 16, route(4, false, true, 1.0), None),
        (6, 16, route(2, true, false, 2.5), None),
        (9, 32, route(8, true, true, 2.5), Some(61)),
        (9, 64, route(6, false, false, 1.0), Some(62)),
        (70, 128, route(8, true, true, 1.0), Some(63)),
        (70, 60, route(4, false, true, 16.0), Some(64)),
    ];
    for (rows, ne, mp, bias) in cases {
        let n_used = mp.n_used;
        let what = format!(
            "{rows}×{ne}, {n_used} used, {mp:?}, bias {}",
            bias.is_some()
        );
        // Equal scores: a row of one value, and a row of pairs of equal values.
        let mut logits = values(60, rows * ne, 4.0);
        logits[..ne].fill(0.25);
        if rows > 1 {
            for (e, v) in (0u16..).zip(&mut logits[ne..2 * ne]) {
                *v = f32::from(e / 2) * 0.5 - 1.0;
            }
        }
        let bias_v = bias.map(|s| values(s, ne, 1.0));
        let bias_w = bias.map(|s| Weights::new(QType::F32, ne, 1, s));
        let (bb, bc) = (
            bias_w.as_ref().map(|w| w.on(be, false)),
            bias_w.as_ref().map(|w| w.on(cpu, false)),
        );
        be.moe_route(&be.from_host(rows, ne, &logits), &mp, bb.as_ref(), &mut rb);
        cpu.moe_route(&cpu.from_host(rows, ne, &logits), &mp, bc.as_ref(), &mut rc);
        let (mut wi, mut ww, mut scratch) = (Vec::new(), Vec::new(), Vec::new());
        for row in logits.chunks_exact(ne) {
            route_row(row, &mp, bias_v.as_deref(), &mut scratch, &mut wi, &mut ww);
        }
        if bias.is_none() {
            let first: Vec<u32> = (0..u32::try_from(n_used).unwrap()).collect();
            assert_eq!(
                wi[..n_used],
                first,
                "route_row: equal scores by lower expert"
            );
        }
        be.routes_to_host(&rb, &mut ib, &mut wb);
        cpu.routes_to_host(&rc, &mut ic, &mut wc);
        assert_eq!(ib, wi, "moe_route {what}: experts");
        assert_eq!(ic, wi, "moe_route {what} (cpu): experts");
        check(&format!("moe_route {what}: weights"), &wb, &ww, 0.0);
        check(&format!("moe_route {what} (cpu): weights"), &wc, &ww, 0.0);
    }

    // The weighted sum over the last routing (70 rows of 4), and over one of 1 per row.
    for (rows, n_used) in [(70, 4), (3, 1)] {
        if n_used == 1 {
            let mp = route(n_used, false, false, 0.75);
            let (lb, lc) = p.tensors(rows, 10, 65, 3.0);
            be.moe_route(&lb, &mp, None, &mut rb);
            cpu.moe_route(&lc, &mp, None, &mut rc);
        }
        let (yb, yc) = p.tensors(rows * n_used, 37, 66, 2.0);
        let (mut ob, mut oc) = (be.zeros(0, 0), cpu.zeros(0, 0));
        be.moe_combine(&yb, &rb, &mut ob);
        cpu.moe_combine(&yc, &rc, &mut oc);
        assert_eq!(be.shape(&ob), (rows, 37), "moe_combine: shape");
        check(
            &format!("moe_combine {rows} rows of {n_used}"),
            &host(be, &ob),
            &host(cpu, &oc),
            0.0,
        );
    }

    // The experts' products. `ne` experts of `f` rows; the gate and up halves of expert `e`
    // are rows `[e·2f, e·2f + f)` and `[e·2f + f, (e + 1)·2f)` of one stack.
    let (ne, n_used, f, n_in) = (8, 3, 24, 256);
    let scales = values(70, ne, 2.0);
    let gate: Vec<std::ops::Range<usize>> = (0..ne).map(|e| e * 2 * f..e * 2 * f + f).collect();
    let up: Vec<std::ops::Range<usize>> = (0..ne).map(|e| e * 2 * f + f..(e + 1) * 2 * f).collect();
    for ty in FORMATS {
        let stack = Weights::new(ty, n_in, ne * 2 * f, 71);
        let desc = WeightDesc {
            name: "blk.0.ffn_gate_up_exps.weight",
            ty,
            dims: &stack.dims,
            data: &stack.bytes,
            owner: stack.bytes.clone(),
        };
        let mut gb = be.weight_views(&desc, &gate).unwrap();
        let mut ub = be.weight_views(&desc, &up).unwrap();
        let mut gc = cpu.weight_views(&desc, &gate).unwrap();
        let mut uc = cpu.weight_views(&desc, &up).unwrap();
        for w in gb.iter_mut().chain(&mut ub) {
            be.prepare_matmul(w);
        }
        for w in gc.iter_mut().chain(&mut uc) {
            cpu.prepare_matmul(w);
        }
        let own: Vec<Weights> = (0..ne as u64)
            .map(|e| Weights::new(ty, n_in, f, 80 + e))
            .collect();
        let ob_: Vec<B::Weight> = own.iter().map(|w| w.on(be, true)).collect();
        let oc_: Vec<specula_cpu::CpuWeight> = own.iter().map(|w| w.on(cpu, true)).collect();

        // A view alone: rows of the stack past its first, by matmul and by get_rows.
        let (xb, xc) = p.tensors(3, n_in, 72, 1.0);
        let (mut ob, mut oc) = (be.zeros(0, 0), cpu.zeros(0, 0));
        be.matmul(&xb, &ub[5], &mut ob);
        cpu.matmul(&xc, &uc[5], &mut oc);
        check(
            &format!("matmul {ty}, a view"),
            &host(be, &ob),
            &host(cpu, &oc),
            exact_bound(ty),
        );
        let ids = [0u32, u32::try_from(f - 1).unwrap(), 2];
        be.get_rows(&ub[5], &be.index(&ids), &mut ob);
        cpu.get_rows(&uc[5], &cpu.index(&ids), &mut oc);
        check(
            &format!("get_rows {ty}, a view"),
            &host(be, &ob),
            &host(cpu, &oc),
            0.0,
        );

        // (what, rows, per pair, scaled, experts): 15 pairs run as the device's routed
        // launch, 90 grouped by expert, and experts of their own grouped whatever their
        // number.
        let lists = [
            IdCase::<B>::new("gate views", 5, false, true, &gb, &gc),
            IdCase::new("up views, per pair", 5, true, false, &ub, &uc),
            IdCase::new("gate views, 90 pairs", 30, false, true, &gb, &gc),
            IdCase::new("own experts, per pair", 4, true, true, &ob_, &oc_),
        ];
        for IdCase {
            what,
            rows,
            per_pair,
            scaled,
            eb,
            ec,
        } in lists
        {
            let what = format!("matmul_id {ty}, {what}");
            let mp = route(n_used, false, true, 1.0);
            let (lb, lc) = p.tensors(rows, ne, 73 + rows as u64, 3.0);
            be.moe_route(&lb, &mp, None, &mut rb);
            cpu.moe_route(&lc, &mp, None, &mut rc);
            let xrows = if per_pair { rows * n_used } else { rows };
            let (xb, xc) = p.tensors(xrows, n_in, 74, 1.0);
            let s = scaled.then_some(&scales[..]);
            be.matmul_id(&xb, eb, s, &rb, per_pair, &mut ob);
            cpu.matmul_id(&xc, ec, s, &rc, per_pair, &mut oc);
            assert_eq!(be.shape(&ob), (rows * n_used, f), "{what}: shape");
            let got = host(be, &ob);
            check(&what, &got, &host(cpu, &oc), exact_bound(ty));

            // Each pair's row is `matmul` (then `scale`) of its row alone with its expert.
            be.routes_to_host(&rb, &mut ib, &mut wb);
            let xs = host(be, &xb);
            let pairs = rows * n_used;
            let some: Vec<usize> = if pairs <= 16 {
                (0..pairs).collect()
            } else {
                vec![0, pairs / 2, pairs - 1]
            };
            for pr in some {
                let src = if per_pair { pr } else { pr / n_used };
                let e = ib[pr] as usize;
                let x1 = be.from_host(1, n_in, &xs[src * n_in..(src + 1) * n_in]);
                let mut o1 = be.zeros(0, 0);
                be.matmul(&x1, &eb[e], &mut o1);
                if scaled {
                    be.scale(&mut o1, scales[e]);
                }
                assert!(
                    same_bits(&host(be, &o1), &got[pr * f..(pr + 1) * f]),
                    "{what}: pair {pr} (expert {e}) differs from its row alone"
                );
            }
        }
    }
}
