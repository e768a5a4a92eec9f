//! The fixed randomized Walsh–Hadamard rotation of the TurboQuant KV types.
//!
//! `forward(x) = D(s2) · H/√128 · D(s1) · x` and `inverse(y) = D(s1) · H/√128 · D(s2) · y`
//! on 128-value groups, where `H` is the unnormalised Sylvester Hadamard matrix applied with
//! in-place butterflies (strides 1, 2, …, 64) and `s1`, `s2` are fixed ±1 tables ("seed 42").
//! The tables are data, identical in the TurboQuant fork's CPU (`ggml-turbo-quant.c`
//! `turbo_cpu_s1/s2`), CUDA and Metal code; they are not derivable and are copied verbatim.
//!
//! The rotation is orthogonal, so `⟨forward(q), forward(k)⟩ = ⟨q, k⟩`: attention can run with
//! rotated queries against a cache kept in the rotated domain, and only the output of a turbo
//! V cache is rotated back.

/// Values per rotation group.
pub const GROUP: usize = 128;

/// `1/√128` as the f32 constant the fork uses.
const INV_SQRT_128: f32 = 0.088_388_346;

/// First sign table (applied before the butterflies in `forward`).
pub const S1: [f32; GROUP] = [
    -1., 1., 1., -1., -1., 1., -1., 1., -1., -1., 1., 1., 1., 1., 1., 1., 1., -1., 1., -1., 1.,
    -1., -1., 1., 1., 1., -1., 1., 1., -1., -1., -1., -1., 1., 1., -1., 1., 1., -1., 1., -1., 1.,
    1., -1., -1., 1., -1., 1., 1., 1., 1., -1., -1., -1., -1., -1., 1., -1., 1., 1., 1., 1., -1.,
    1., -1., -1., 1., -1., -1., -1., 1., -1., -1., -1., 1., -1., -1., -1., 1., 1., 1., -1., -1.,
    1., 1., 1., -1., -1., 1., 1., -1., 1., 1., -1., 1., -1., -1., 1., 1., -1., 1., -1., 1., -1.,
    1., 1., 1., 1., -1., 1., -1., 1., 1., -1., 1., 1., -1., -1., -1., -1., -1., 1., 1., -1., 1.,
    1., -1., 1.,
];

/// Second sign table (applied after the butterflies in `forward`).
pub const S2: [f32; GROUP] = [
    1., 1., 1., 1., -1., 1., 1., -1., 1., -1., -1., -1., 1., -1., -1., -1., 1., 1., -1., -1., 1.,
    -1., 1., -1., 1., -1., -1., 1., -1., 1., 1., 1., 1., 1., -1., -1., -1., 1., -1., -1., -1., -1.,
    -1., -1., 1., 1., 1., -1., 1., -1., 1., 1., 1., -1., -1., 1., -1., -1., -1., -1., -1., -1., 1.,
    1., 1., -1., 1., -1., -1., -1., -1., 1., -1., 1., -1., 1., -1., -1., 1., 1., -1., 1., -1., 1.,
    1., -1., 1., -1., -1., -1., -1., 1., -1., -1., 1., -1., 1., -1., 1., 1., 1., -1., -1., 1., -1.,
    1., -1., 1., 1., -1., -1., 1., -1., 1., -1., 1., 1., -1., 1., -1., 1., -1., -1., -1., -1., -1.,
    1., -1.,
];

/// Values of the fork's 64-value variant of the rotation.
pub const HALF: usize = 64;

/// The unnormalised Hadamard transform by in-place butterflies `(a, b) → (a + b, a − b)`.
#[inline]
fn butterflies(x: &mut [f32]) {
    let n = x.len();
    let mut h = 1;
    while h < n {
        for i in (0..n).step_by(2 * h) {
            for j in i..i + h {
                let (a, b) = (x[j], x[j + h]);
                x[j] = a + b;
                x[j + h] = a - b;
            }
        }
        h *= 2;
    }
}

/// Rotates one group forward, in place.
pub fn forward(x: &mut [f32; GROUP]) {
    for (v, s) in x.iter_mut().zip(&S1) {
        *v *= s;
    }
    butterflies(x);
    for (v, s) in x.iter_mut().zip(&S2) {
        *v *= INV_SQRT_128 * s;
    }
}

/// Rotates one group back, in place (the inverse of [`forward`]).
pub fn inverse(x: &mut [f32; GROUP]) {
    for (v, s) in x.iter_mut().zip(&S2) {
        *v *= s;
    }
    butterflies(x);
    for (v, s) in x.iter_mut().zip(&S1) {
        *v *= INV_SQRT_128 * s;
    }
}

/// Rotates 64 values forward with the fork's 64-group variant of the rotation
/// (`GGML_OP_TURBO_WHT` with group 64): the first 64 entries of each sign table and `1/√64`.
pub fn forward64(x: &mut [f32; HALF]) {
    for (v, s) in x.iter_mut().zip(&S1) {
        *v *= s;
    }
    butterflies(x);
    for (v, s) in x.iter_mut().zip(&S2) {
        *v *= 0.125 * s;
    }
}

/// Rotates 64 values back (the inverse of [`forward64`]).
pub fn inverse64(x: &mut [f32; HALF]) {
    for (v, s) in x.iter_mut().zip(&S2) {
        *v *= s;
    }
    butterflies(x);
    for (v, s) in x.iter_mut().zip(&S1) {
        *v *= 0.125 * s;
    }
}

/// Rotates every whole 128-value group of `x` forward; a tail shorter than a group passes
/// through unchanged, as the fork's `GGML_OP_TURBO_WHT` does.
pub fn forward_row(x: &mut [f32]) {
    for g in x.chunks_exact_mut(GROUP) {
        forward(g.try_into().expect("chunks_exact yields whole groups"));
    }
}

/// Rotates every whole 128-value group of `x` back (tail unchanged).
pub fn inverse_row(x: &mut [f32]) {
    for g in x.chunks_exact_mut(GROUP) {
        inverse(g.try_into().expect("chunks_exact yields whole groups"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        let top = u32::try_from(*seed >> 40).unwrap();
        #[allow(clippy::cast_precision_loss, reason = "24-bit value, exact")]
        let u = top as f32 / 16_777_216.0;
        2.0 * u - 1.0
    }

    /// Regression: the constant was once written `0.088_388_35`, one f32 ulp above the fork's
    /// `0.08838834764831845f`, which shifted 124 of 128 rotated groups by an ulp.
    #[test]
    fn normalisation_is_the_correctly_rounded_inverse_sqrt_128() {
        assert_eq!(INV_SQRT_128.to_bits(), 0x3db5_04f3);
    }

    #[test]
    fn signs_start_as_in_the_fork() {
        let s1: Vec<i8> = S1[..16]
            .iter()
            .map(|&s| if s > 0.0 { 1 } else { -1 })
            .collect();
        assert_eq!(s1, [-1, 1, 1, -1, -1, 1, -1, 1, -1, -1, 1, 1, 1, 1, 1, 1]);
        let s2: Vec<i8> = S2[..16]
            .iter()
            .map(|&s| if s > 0.0 { 1 } else { -1 })
            .collect();
        assert_eq!(s2, [1, 1, 1, 1, -1, 1, 1, -1, 1, -1, -1, -1, 1, -1, -1, -1]);
        assert!(S1.iter().chain(&S2).all(|s| s.abs() == 1.0));
    }

    #[test]
    fn inverse_undoes_forward_and_inner_products_are_kept() {
        let mut seed = 42;
        for _ in 0..200 {
            let q: [f32; GROUP] = std::array::from_fn(|_| lcg(&mut seed) * 3.0);
            let k: [f32; GROUP] = std::array::from_fn(|_| lcg(&mut seed));
            let (mut wq, mut wk) = (q, k);
            forward(&mut wq);
            forward(&mut wk);
            let dot = |a: &[f32], b: &[f32]| -> f64 {
                a.iter()
                    .zip(b)
                    .map(|(x, y)| f64::from(*x) * f64::from(*y))
                    .sum()
            };
            let (before, after) = (dot(&q, &k), dot(&wq, &wk));
            let scale = dot(&q, &q).sqrt() * dot(&k, &k).sqrt();
            assert!(
                (before - after).abs() <= 1e-6 * scale,
                "{before} vs {after}"
            );
            let mut back = wq;
            inverse(&mut back);
            let err = q
                .iter()
                .zip(&back)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f32::max);
            assert!(err <= 1e-6 * 3.0, "max |x - inverse(forward(x))| = {err}");
        }
        let mut zero = [0.0; GROUP];
        forward(&mut zero);
        assert!(zero.iter().all(|&v| v == 0.0));
    }

    #[test]
    fn the_64_variant_is_orthogonal() {
        let mut seed = 7;
        for _ in 0..50 {
            let x: [f32; HALF] = std::array::from_fn(|_| lcg(&mut seed));
            let mut y = x;
            forward64(&mut y);
            let n2 = |v: &[f32]| v.iter().map(|a| f64::from(*a).powi(2)).sum::<f64>();
            assert!((n2(&x) - n2(&y)).abs() <= 1e-5 * n2(&x));
            inverse64(&mut y);
            assert!(x.iter().zip(&y).all(|(a, b)| (a - b).abs() < 1e-6));
        }
        // e_0 goes to s1[0] · s2[j] / 8 in every coordinate j.
        let mut e = [0.0f32; HALF];
        e[0] = 1.0;
        forward64(&mut e);
        assert!(e.iter().zip(&S2).all(|(v, s)| *v == S1[0] * s * 0.125));
    }

    #[test]
    fn tails_pass_through() {
        let mut x: Vec<f32> = (0..200u8).map(f32::from).collect();
        let orig = x.clone();
        forward_row(&mut x);
        assert_eq!(x[128..], orig[128..]);
        inverse_row(&mut x);
        assert!(x.iter().zip(&orig).all(|(a, b)| (a - b).abs() < 1e-3));
    }
}
