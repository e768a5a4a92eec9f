//! Quality gates of the turbo KV-cache formats (research note `quant.md` §9).
//!
//! Over thousands of Gaussian 128-value vectors (a deterministic splitmix64 + Box–Muller
//! generator, so every run sees the same data): quantize → dequantize → inverse rotation must
//! reach the Lloyd–Max distortion the formats are designed for (mean relative MSE ≤ 0.125 /
//! 0.037 / 0.0105 for turbo2 / 3 / 4, mean cosine similarity ≥ 0.94 / 0.98 / 0.995), with and
//! without an outlier channel, and keep the vector's norm up to the fp16 rounding of the stored
//! norm. The rotation itself must be orthogonal: forward then inverse is the identity and inner
//! products are kept. Measured numbers are printed (`--nocapture`, or CI logs).

use specula_quant::{QType, dequantize_row, quantize_row, wht};

const DIM: usize = 128;
const VECTORS: usize = 4096;

/// Vigna's splitmix64.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in (0, 1]: 53 random bits.
    #[allow(
        clippy::cast_precision_loss,
        reason = "a 53-bit integer is exact in f64"
    )]
    fn uniform(&mut self) -> f64 {
        ((self.next_u64() >> 11) + 1) as f64 / (1u64 << 53) as f64
    }

    /// Two independent N(0, 1) values (Box–Muller).
    fn gaussian_pair(&mut self) -> (f64, f64) {
        let (u1, u2) = (self.uniform(), self.uniform());
        let r = (-2.0 * u1.ln()).sqrt();
        let t = std::f64::consts::TAU * u2;
        (r * t.cos(), r * t.sin())
    }
}

#[allow(
    clippy::cast_possible_truncation,
    reason = "test data: rounding f64 samples to f32 is the point"
)]
fn to_f32(v: f64) -> f32 {
    v as f32
}

fn gaussian_vectors(seed: u64, count: usize) -> Vec<[f32; DIM]> {
    let mut rng = SplitMix64(seed);
    (0..count)
        .map(|_| {
            let mut v = [0f32; DIM];
            for pair in v.chunks_exact_mut(2) {
                let (a, b) = rng.gaussian_pair();
                pair[0] = to_f32(a);
                pair[1] = to_f32(b);
            }
            v
        })
        .collect()
}

fn dot(a: &[f32], b: &[f32]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| f64::from(*x) * f64::from(*y))
        .sum()
}

#[derive(Debug)]
struct Quality {
    mean_rel_mse: f64,
    mean_cos: f64,
    max_norm_rel_err: f64,
}

/// quantize → dequantize → inverse WHT of every vector, against the original.
#[allow(clippy::cast_precision_loss, reason = "a vector count is exact in f64")]
fn measure(ty: QType, vectors: &[[f32; DIM]]) -> Quality {
    let (mut mse, mut cos, mut norm_err) = (0.0, 0.0, 0.0f64);
    let mut q = vec![0u8; ty.type_size()];
    let mut y = [0f32; DIM];
    for x in vectors {
        quantize_row(ty, x, &mut q).expect("one whole group");
        dequantize_row(ty, &q, &mut y).expect("one whole group");
        wht::inverse_row(&mut y);
        let (xx, yy, xy) = (dot(x, x), dot(&y, &y), dot(x, &y));
        let err: f64 = x
            .iter()
            .zip(&y)
            .map(|(a, b)| (f64::from(*a) - f64::from(*b)).powi(2))
            .sum();
        mse += err / xx;
        cos += xy / (xx.sqrt() * yy.sqrt());
        norm_err = norm_err.max((yy.sqrt() - xx.sqrt()).abs() / xx.sqrt());
    }
    let n = vectors.len() as f64;
    Quality {
        mean_rel_mse: mse / n,
        mean_cos: cos / n,
        max_norm_rel_err: norm_err,
    }
}

/// (type, mean relative MSE ceiling, mean cosine floor).
const GATES: [(QType, f64, f64); 3] = [
    (QType::Turbo2, 0.125, 0.94),
    (QType::Turbo3, 0.037, 0.98),
    (QType::Turbo4, 0.0105, 0.995),
];

fn check_gates(label: &str, vectors: &[[f32; DIM]]) {
    let mut failures = Vec::new();
    for (ty, max_mse, min_cos) in GATES {
        let q = measure(ty, vectors);
        eprintln!(
            "{label} {ty}: {} vectors, mean rel-MSE {:.5} (gate ≤ {max_mse}), mean cosine {:.5} \
             (gate ≥ {min_cos}), max |‖x̂‖ − ‖x‖|/‖x‖ {:.3e} (gate ≤ 2^-10)",
            vectors.len(),
            q.mean_rel_mse,
            q.mean_cos,
            q.max_norm_rel_err
        );
        if q.mean_rel_mse > max_mse {
            failures.push(format!("{ty}: mean rel-MSE {} > {max_mse}", q.mean_rel_mse));
        }
        if q.mean_cos < min_cos {
            failures.push(format!("{ty}: mean cosine {} < {min_cos}", q.mean_cos));
        }
        if q.max_norm_rel_err > 2f64.powi(-10) {
            failures.push(format!(
                "{ty}: norm not preserved to fp16 rounding: relative error {}",
                q.max_norm_rel_err
            ));
        }
    }
    assert!(failures.is_empty(), "{label}: {}", failures.join("; "));
}

#[test]
fn gaussian_vectors_meet_the_quality_gates() {
    check_gates("gaussian", &gaussian_vectors(1, VECTORS));
}

#[test]
fn an_outlier_channel_still_meets_the_quality_gates() {
    let mut v = gaussian_vectors(2, VECTORS);
    for x in &mut v {
        x[17] *= 10.0;
    }
    check_gates("outlier channel 17 x10", &v);
}

#[test]
fn scaled_vectors_keep_their_norm() {
    // The corrected norm makes ‖x̂‖ = ‖x‖ up to the fp16 rounding of the stored norm, at any
    // scale fp16 represents as a normal number.
    for (scale, seed) in [(1e-3f32, 3), (1.0, 4), (300.0, 5)] {
        let v: Vec<[f32; DIM]> = gaussian_vectors(seed, 200)
            .into_iter()
            .map(|x| x.map(|e| e * scale))
            .collect();
        for (ty, _, _) in GATES {
            let q = measure(ty, &v);
            eprintln!(
                "scale {scale:e} {ty}: max relative norm error {:.3e}",
                q.max_norm_rel_err
            );
            assert!(
                q.max_norm_rel_err <= 2f64.powi(-10),
                "{ty} at scale {scale}: relative norm error {}",
                q.max_norm_rel_err
            );
        }
    }
}

#[test]
fn wht_inverse_undoes_forward() {
    // Unit-scale data: uniform in [-1, 1).
    let mut rng = SplitMix64(6);
    let vectors: Vec<[f32; DIM]> = (0..VECTORS)
        .map(|_| std::array::from_fn(|_| to_f32(2.0 * rng.uniform() - 1.0)))
        .collect();
    let mut max_err = 0f32;
    for x in vectors {
        let mut y = x;
        wht::forward(&mut y);
        wht::inverse(&mut y);
        for (a, b) in x.iter().zip(&y) {
            max_err = max_err.max((a - b).abs());
        }
    }
    eprintln!(
        "wht: max |inverse(forward(x)) − x| = {max_err:e} over {VECTORS} uniform(-1,1) vectors"
    );
    assert!(max_err <= 1e-6, "max abs error {max_err}");
}

#[test]
fn wht_keeps_inner_products() {
    let qs = gaussian_vectors(7, VECTORS);
    let noise = gaussian_vectors(8, VECTORS);
    let mut worst = 0f64;
    for (q, e) in qs.iter().zip(&noise) {
        // k correlated with q, so ⟨q, k⟩ is far from zero and the relative error is meaningful.
        let k: [f32; DIM] = std::array::from_fn(|i| 0.6 * q[i] + 0.8 * e[i]);
        let (mut wq, mut wk) = (*q, k);
        wht::forward(&mut wq);
        wht::forward(&mut wk);
        let (before, after) = (dot(q, &k), dot(&wq, &wk));
        worst = worst.max((after - before).abs() / before.abs());
    }
    eprintln!("wht: max |⟨Wq, Wk⟩ − ⟨q, k⟩| / |⟨q, k⟩| = {worst:e} over {VECTORS} pairs");
    assert!(worst <= 1e-5, "relative inner-product error {worst}");
}
