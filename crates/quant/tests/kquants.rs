//! K-quants (Q2_K … Q6_K, Q8_K) and IQ4_NL / IQ4_XS: error bounds, exact round trips of values
//! the formats represent, extreme rows, and hashes of ggml's own output for a fixed input.
//!
//! The hashes in [`matches_ggml_on_anchor_rows`] were computed by running the same generated
//! input through a shared-library build of the vendored llama.cpp (`ggml_quantize_chunk` with
//! no importance matrix, `quantize_row_q8_K_ref`, `quantize_row_iq4_nl_ref`, and the matching
//! `dequantize_row_*`), so they pin bit-exactness without needing the library at test time.

use specula_quant::blocks::{BlockIq4Nl, BlockIq4Xs, BlockQ4K, BlockQ5K, BlockQ6K, BlockQ8K, Half};
use specula_quant::{QType, dequantize_row, iq4, kquants, quantize_row};

/// xorshift64*, so inputs are reproducible here and from the Python script that produced the
/// anchor hashes.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// Uniform in [0, 1) with 24 random bits (exact in f32).
    #[allow(
        clippy::cast_precision_loss,
        reason = "a 24-bit integer is exact in f32"
    )]
    fn unif(&mut self) -> f32 {
        (self.next() >> 40) as f32 / 16_777_216.0
    }

    /// Irwin–Hall(4) − 2: bell-shaped, variance 1/3, computed with plain f32 additions only so
    /// that numpy reproduces it bit for bit.
    fn gaussish(&mut self) -> f32 {
        let (a, b, c, d) = (self.unif(), self.unif(), self.unif(), self.unif());
        a + b + c + d - 2.0
    }

    /// A standard normal sample (Box–Muller).
    fn normal(&mut self) -> f32 {
        let u1 = 1.0 - self.unif();
        let u2 = self.unif();
        (-2.0 * u1.ln()).sqrt() * (std::f32::consts::TAU * u2).cos()
    }

    fn below(&mut self, n: usize) -> usize {
        usize::try_from(self.next() % u64::try_from(n).unwrap()).unwrap()
    }
}

fn fnv1a(bytes: impl IntoIterator<Item = u8>) -> u64 {
    bytes.into_iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// The IQ4_NL variants by name: the byte-level API has the llama-quantize one only.
#[derive(Clone, Copy, Debug)]
enum Fmt {
    Q(QType),
    Iq4NlRef,
}

impl Fmt {
    fn qtype(self) -> QType {
        match self {
            Fmt::Q(t) => t,
            Fmt::Iq4NlRef => QType::IQ4_NL,
        }
    }

    fn quantize(self, x: &[f32]) -> Vec<u8> {
        let mut q = vec![0u8; self.qtype().row_bytes(x.len()).unwrap()];
        match self {
            Fmt::Q(t) => quantize_row(t, x, &mut q).unwrap(),
            Fmt::Iq4NlRef => {
                iq4::quantize_row_iq4_nl_ref(x, bytemuck::cast_slice_mut::<u8, BlockIq4Nl>(&mut q));
            }
        }
        q
    }

    fn dequantize(self, q: &[u8], n: usize) -> Vec<f32> {
        let mut y = vec![0f32; n];
        dequantize_row(self.qtype(), q, &mut y).unwrap();
        y
    }

    fn round_trip(self, x: &[f32]) -> Vec<f32> {
        self.dequantize(&self.quantize(x), x.len())
    }
}

const ALL: [Fmt; 9] = [
    Fmt::Q(QType::Q2_K),
    Fmt::Q(QType::Q3_K),
    Fmt::Q(QType::Q4_K),
    Fmt::Q(QType::Q5_K),
    Fmt::Q(QType::Q6_K),
    Fmt::Q(QType::Q8_K),
    Fmt::Q(QType::IQ4_NL),
    Fmt::Q(QType::IQ4_XS),
    Fmt::Iq4NlRef,
];

/// The anchor input: eight 256-value rows of different scales and shapes.
fn anchor_input() -> Vec<f32> {
    let mut rng = Rng(0x5eed_1234_abcd_0001);
    let scales = [1.0f32, 0.02, 300.0, 1e-3, 4.0, 1e-5, 70000.0, 0.5];
    let mut x = Vec::with_capacity(8 * 256);
    for (r, &s) in scales.iter().enumerate() {
        let mut row: Vec<f32> = (0..256).map(|_| rng.gaussish() * s).collect();
        match r {
            1 => row[32..64].fill(0.0),
            2 => row[100] *= 50.0,
            4 => row.iter_mut().step_by(3).for_each(|v| *v = v.abs()),
            5 => row[..16].fill(0.25),
            7 => row.iter_mut().for_each(|v| *v = v.abs()),
            _ => {}
        }
        x.extend(row);
    }
    x
}

#[test]
fn matches_ggml_on_anchor_rows() {
    let x = anchor_input();
    assert_eq!(
        fnv1a(x.iter().flat_map(|v| v.to_le_bytes())),
        0x6199_4cab_db0c_6c65,
        "the generated input itself changed"
    );
    // (format, FNV-1a of ggml's quantized bytes, FNV-1a of ggml's dequantized f32 bytes)
    let expected = [
        (
            Fmt::Q(QType::Q2_K),
            0xf06f_6827_32f1_5f98,
            0x4e53_2329_4483_fc2b,
        ),
        (
            Fmt::Q(QType::Q3_K),
            0xfdcd_deeb_0436_aae3,
            0xc6b3_1611_4cbd_23f8,
        ),
        (
            Fmt::Q(QType::Q4_K),
            0xc1b9_3b7e_d791_b4c2,
            0x6471_ed87_2c33_dcad,
        ),
        (
            Fmt::Q(QType::Q5_K),
            0x6939_a35e_8b1d_b193,
            0xd979_43f8_276b_e716,
        ),
        (
            Fmt::Q(QType::Q6_K),
            0xa4ec_1ac3_bbf1_4509,
            0x4361_342f_1621_c9e3,
        ),
        (
            Fmt::Q(QType::IQ4_NL),
            0x255e_c721_6a18_5419,
            0xef87_8f8c_a255_1a44,
        ),
        (
            Fmt::Q(QType::IQ4_XS),
            0x53ff_7753_9c24_919e,
            0x6df1_412a_2f13_4f38,
        ),
        (
            Fmt::Q(QType::Q8_K),
            0x742f_463a_ae4b_9fdd,
            0xea67_70a0_22d7_00b6,
        ),
        (Fmt::Iq4NlRef, 0xe2d8_7a49_8ec2_fe1a, 0x7993_ec78_ff17_8f1b),
    ];
    for (fmt, q_hash, y_hash) in expected {
        // ggml quantizes the eight rows in one call; rows are independent for every format
        // here (IQ4_NL_REF was also run one row per call).
        let q: Vec<u8> = x.chunks_exact(256).flat_map(|r| fmt.quantize(r)).collect();
        assert_eq!(fnv1a(q.iter().copied()), q_hash, "{fmt:?}: quantized bytes");
        let y = fmt.dequantize(&q, x.len());
        assert_eq!(
            fnv1a(y.iter().flat_map(|v| v.to_le_bytes())),
            y_hash,
            "{fmt:?}: dequantized values"
        );
    }
}

fn relative_mse(x: &[f32], y: &[f32]) -> f64 {
    let err: f64 = x
        .iter()
        .zip(y)
        .map(|(&a, &b)| f64::from(a - b).powi(2))
        .sum();
    let energy: f64 = x.iter().map(|&a| f64::from(a).powi(2)).sum();
    err / energy
}

#[test]
fn relative_mse_on_gaussian_rows() {
    let mut rng = Rng(42);
    let x: Vec<f32> = (0..64 * 1024).map(|_| rng.normal()).collect();
    // Upper bounds on N(0, 1) data. Measured here (identical to ggml, which these functions match
    // bit for bit): Q2_K 8.8e-2, Q3_K 2.3e-2, Q4_K 5.1e-3, Q5_K 1.3e-3, Q6_K 3.1e-4, Q8_K 4.9e-5,
    // IQ4_NL 5.8e-3, IQ4_XS 5.9e-3, IQ4_NL (KV variant) 6.2e-3.
    let bounds = [
        (Fmt::Q(QType::Q2_K), 0.1),
        (Fmt::Q(QType::Q3_K), 2.7e-2),
        (Fmt::Q(QType::Q4_K), 7.7e-3),
        (Fmt::Q(QType::Q5_K), 2e-3),
        (Fmt::Q(QType::Q6_K), 4.7e-4),
        (Fmt::Q(QType::Q8_K), 6e-5),
        (Fmt::Q(QType::IQ4_NL), 9e-3),
        (Fmt::Q(QType::IQ4_XS), 7e-3),
        (Fmt::Iq4NlRef, 7.5e-3),
    ];
    for (fmt, bound) in bounds {
        let e = relative_mse(&x, &fmt.round_trip(&x));
        assert!(e < bound, "{fmt:?}: relative MSE {e:.3e} ≥ {bound:.1e}");
    }
}

/// A power of two `2^e`, exact.
fn pow2(e: i32) -> f32 {
    f32::powi(2.0, e)
}

#[test]
fn q8_k_is_exact_on_its_grid() {
    let mut rng = Rng(7);
    for e in [-20, -3, 0, 5, 30] {
        let d = pow2(e);
        let mut codes: Vec<i8> = (0..256)
            .map(|_| i8::try_from(rng.below(255)).map_or(0, |v| v) - 127)
            .collect();
        codes[rng.below(256)] = 127;
        let x: Vec<f32> = codes.iter().map(|&q| d * f32::from(q)).collect();
        let q = Fmt::Q(QType::Q8_K).quantize(&x);
        let b: &BlockQ8K = bytemuck::from_bytes(&q);
        assert_eq!(Fmt::Q(QType::Q8_K).dequantize(&q, 256), x, "d = 2^{e}");
        // bsums are the sums of the stored codes.
        for (k, s) in b.bsums.iter().enumerate() {
            let sum: i32 = b.qs[16 * k..16 * k + 16]
                .iter()
                .map(|&v| i32::from(v))
                .sum();
            assert_eq!(i32::from(i16::from_le_bytes(*s)), sum);
        }
    }
}

/// Q4_K / Q5_K sub-block scales 20, 25, 30, 63, 40, 45, 50, 55 and mins 0, packed as
/// `get_scale_min_k4` reads them.
fn k4_scales() -> [u8; 12] {
    let sc: [u8; 8] = [20, 25, 30, 63, 40, 45, 50, 55];
    let mut scales = [0u8; 12];
    for j in 0..8 {
        if j < 4 {
            scales[j] = sc[j];
        } else {
            scales[j + 4] = sc[j] & 0xF;
            scales[j - 4] |= (sc[j] >> 4) << 6;
        }
    }
    scales
}

#[test]
fn q4_k_and_q5_k_are_exact_on_their_grid() {
    // Blocks built from a scale d (an f16), 6-bit sub-scales whose maximum is 63, no min, and
    // codes covering 0 and the top code in every sub-block: the search recovers them exactly.
    let mut rng = Rng(11);
    for d in [1.0f32, 0.003, 17.5] {
        let d = Half::from_f32(d);
        // Q4_K
        let mut b: BlockQ4K = bytemuck::Zeroable::zeroed();
        b.d = d;
        b.scales = k4_scales();
        let mut codes: [u8; 256] = std::array::from_fn(|_| u8::try_from(rng.below(16)).unwrap());
        for s in 0..8 {
            codes[32 * s] = 0;
            codes[32 * s + 1] = 15;
        }
        for (c, q) in b.qs.iter_mut().enumerate() {
            let (chunk, l) = (c / 32, c % 32);
            *q = codes[64 * chunk + l] | (codes[64 * chunk + 32 + l] << 4);
        }
        let mut x = vec![0f32; 256];
        kquants::dequantize_row_q4_k(std::slice::from_ref(&b), &mut x);
        let back = Fmt::Q(QType::Q4_K).quantize(&x);
        assert_eq!(back, bytemuck::bytes_of(&b), "Q4_K, d = {d:?}");

        // Q5_K
        let mut b: BlockQ5K = bytemuck::Zeroable::zeroed();
        b.d = d;
        b.scales = k4_scales();
        let mut codes: [u8; 256] = std::array::from_fn(|_| u8::try_from(rng.below(32)).unwrap());
        for s in 0..8 {
            codes[32 * s + 5] = 0;
            codes[32 * s + 9] = 31;
        }
        for (c, q) in b.qs.iter_mut().enumerate() {
            let (chunk, l) = (c / 32, c % 32);
            let (lo, hi) = (codes[64 * chunk + l], codes[64 * chunk + 32 + l]);
            *q = (lo & 0xF) | ((hi & 0xF) << 4);
            b.qh[l] |= ((lo >> 4) << (2 * chunk)) | ((hi >> 4) << (2 * chunk + 1));
        }
        let mut x = vec![0f32; 256];
        kquants::dequantize_row_q5_k(std::slice::from_ref(&b), &mut x);
        let back = Fmt::Q(QType::Q5_K).quantize(&x);
        assert_eq!(back, bytemuck::bytes_of(&b), "Q5_K, d = {d:?}");
    }
}

#[test]
fn q6_k_is_exact_on_its_grid() {
    // The sub-block of largest scale is stored as −128, and each sub-block's largest magnitude
    // is code −32: the format's own fixed point.
    let mut rng = Rng(13);
    for d in [-0.5f32, 0.0123, -3.0e-3] {
        let mut b: BlockQ6K = bytemuck::Zeroable::zeroed();
        b.d = Half::from_f32(d);
        for (k, s) in b.scales.iter_mut().enumerate() {
            *s = if k == 5 {
                -128
            } else {
                i8::try_from(-100 + 13 * i32::try_from(k).unwrap()).unwrap()
            };
        }
        let mut codes: [u8; 256] =
            std::array::from_fn(|_| 1 + u8::try_from(rng.below(63)).unwrap());
        for s in 0..16 {
            codes[16 * s + rng.below(16)] = 0; // q − 32 = −32
        }
        for h in 0..2 {
            for l in 0..32 {
                let c = |k: usize| codes[128 * h + l + 32 * k];
                b.ql[64 * h + l] = (c(0) & 0xF) | ((c(2) & 0xF) << 4);
                b.ql[64 * h + l + 32] = (c(1) & 0xF) | ((c(3) & 0xF) << 4);
                b.qh[32 * h + l] =
                    (c(0) >> 4) | ((c(1) >> 4) << 2) | ((c(2) >> 4) << 4) | ((c(3) >> 4) << 6);
            }
        }
        let mut x = vec![0f32; 256];
        kquants::dequantize_row_q6_k(std::slice::from_ref(&b), &mut x);
        let back = Fmt::Q(QType::Q6_K).quantize(&x);
        assert_eq!(back, bytemuck::bytes_of(&b), "d = {d}");
    }
}

#[test]
fn iq4_is_exact_on_its_grid() {
    let kv: [i8; 16] = [
        -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
    ];
    let mut rng = Rng(17);
    // IQ4_NL, both variants: a block whose largest magnitude is code 0 (−127) is a fixed point.
    for d in [1.0f32, -0.0071, 2.5e-3, 40.0] {
        let d = Half::from_f32(d).to_f32();
        let mut idx: Vec<usize> = (0..256).map(|_| rng.below(16)).collect();
        for b in 0..8 {
            idx[32 * b + rng.below(32)] = 0;
        }
        let x: Vec<f32> = idx.iter().map(|&i| d * f32::from(kv[i])).collect();
        for fmt in [Fmt::Q(QType::IQ4_NL), Fmt::Iq4NlRef] {
            assert_eq!(fmt.round_trip(&x), x, "{fmt:?}, d = {d}");
        }
    }
    // IQ4_XS: sub-block scales D·k with k = −32 the largest, each sub-block containing code 0.
    for dd in [0.01f32, 1.0, -2.0e-3] {
        let mut b: BlockIq4Xs = bytemuck::Zeroable::zeroed();
        b.d = Half::from_f32(dd);
        let mut scales_h = 0u16;
        for ib in 0..8 {
            let ls: u8 = if ib == 2 {
                0
            } else {
                7 + 6 * u8::try_from(ib).unwrap()
            };
            b.scales_l[ib / 2] |= (ls & 0xF) << (4 * (ib % 2));
            scales_h |= u16::from(ls >> 4) << (2 * ib);
        }
        b.scales_h = scales_h.to_le_bytes();
        let mut idx: [u8; 256] = std::array::from_fn(|_| u8::try_from(rng.below(16)).unwrap());
        for s in 0..8 {
            idx[32 * s + rng.below(32)] = 0;
        }
        for (c, q) in b.qs.iter_mut().enumerate() {
            let (s, l) = (c / 16, c % 16);
            *q = idx[32 * s + l] | (idx[32 * s + 16 + l] << 4);
        }
        let mut x = vec![0f32; 256];
        iq4::dequantize_row_iq4_xs(std::slice::from_ref(&b), &mut x);
        let back = Fmt::Q(QType::IQ4_XS).quantize(&x);
        assert_eq!(back, bytemuck::bytes_of(&b), "D = {dd}");
    }
}

/// Rows that stress the searches: nothing may panic, all-zero rows must come back as zeros, and
/// rows inside the f16 range of the scales must come back finite.
#[test]
fn extreme_rows_do_not_panic() {
    let mut rng = Rng(99);
    let n = 512;
    let gauss = |rng: &mut Rng, s: f32| -> Vec<f32> { (0..n).map(|_| rng.normal() * s).collect() };
    let mut rows: Vec<(&str, Vec<f32>, bool)> = vec![
        ("zero", vec![0.0; n], true),
        ("negative zero", vec![-0.0; n], true),
        ("constant", vec![1.5; n], true),
        ("negative constant", vec![-7.0; n], true),
        ("tiny 1e-30", gauss(&mut rng, 1e-30), true),
        ("around GROUP_MAX_EPS", gauss(&mut rng, 1e-15), true),
        ("subnormal", gauss(&mut rng, 1e-40), true),
        ("huge 1e30", gauss(&mut rng, 1e30), false),
        ("f32::MAX", vec![f32::MAX; n], false),
        (
            "alternating ±f32::MAX",
            (0..n)
                .map(|i| if i % 2 == 0 { f32::MAX } else { -f32::MAX })
                .collect(),
            false,
        ),
        (
            "ties",
            (0..n)
                .map(|i| f32::from(u8::try_from(i % 9).unwrap()) - 4.0)
                .collect(),
            true,
        ),
    ];
    let mut outlier = gauss(&mut rng, 1.0);
    outlier[77] = 1e4;
    rows.push(("one outlier", outlier, true));
    let mut mixed = gauss(&mut rng, 1.0);
    for (k, chunk) in mixed.chunks_exact_mut(16).enumerate() {
        match k % 4 {
            0 => chunk.fill(0.0),
            1 => chunk.iter_mut().for_each(|v| *v *= 1e-12),
            2 => chunk.iter_mut().for_each(|v| *v *= 1e3),
            _ => {}
        }
    }
    rows.push(("mixed sub-blocks", mixed, true));

    for (name, x, finite) in &rows {
        for fmt in ALL {
            let y = fmt.round_trip(x);
            if x.iter().all(|&v| v == 0.0) {
                assert!(
                    y.iter().all(|&v| v == 0.0),
                    "{fmt:?}, {name}: zeros expected"
                );
            }
            if *finite {
                assert!(
                    y.iter().all(|v| v.is_finite()),
                    "{fmt:?}, {name}: non-finite output"
                );
            }
        }
    }
}

#[test]
fn iq4_nl_variants_differ_as_documented() {
    // Same input, two ggml quantizers: the llama-quantize search (ntry = 7) re-encodes with the
    // final scale, the KV-cache one (ntry = −1) keeps the codes of d = max/−127. On Gaussian data
    // they disagree on some blocks, and the searched one is never worse in squared error.
    let mut rng = Rng(5);
    let x: Vec<f32> = (0..32 * 256).map(|_| rng.normal()).collect();
    let a = Fmt::Q(QType::IQ4_NL).quantize(&x);
    let b = Fmt::Iq4NlRef.quantize(&x);
    assert_ne!(a, b);
    let ya = Fmt::Q(QType::IQ4_NL).dequantize(&a, x.len());
    let yb = Fmt::Iq4NlRef.dequantize(&b, x.len());
    assert!(relative_mse(&x, &ya) <= relative_mse(&x, &yb));
}
