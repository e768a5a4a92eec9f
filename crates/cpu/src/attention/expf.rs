//! `e^x` for the softmax weights, eight at a time, with the bits of the C library's `expf`.
//!
//! The algorithm is that of glibc ≥ 2.28 (from Arm's optimized-routines, `e_expf.c`): in
//! double precision, `x·32/ln 2 = k + r` with `k` rounded to an integer by the add-and-subtract
//! of `1.5·2^52`, `e^x = 2^(k/32) · 2^(r/32)` with `2^(k/32)` from a 32-entry table whose
//! entries' exponent fields take `k / 32`, and `2^(r/32)` a cubic, the result rounded once to
//! f32. With FMA (glibc's `__expf_fma`, which x86-64 CPUs with FMA run) the multiply of `x` by
//! `32/ln 2` is fused into both the rounding and the reduction, and the cubic is three fused
//! multiply-adds; `expf` writes down exactly those operations, and the AVX2 loop
//! (`x86::exp_sub_256`) does them in four double lanes. So the weights are those the scalar
//! `f32::exp` gave on such machines (the tests compare with it wherever the C library is glibc
//! on an FMA CPU), and they are the same bits on every CPU the AVX2 path runs on, whatever
//! its C library.

/// `2^(i/32)` as f64 bits, minus `i << 47` (the exponent field gets `k << 47` added back).
pub const TAB: [u64; 32] = [
    0x3ff0_0000_0000_0000,
    0x3fef_d9b0_d315_8574,
    0x3fef_b558_6cf9_890f,
    0x3fef_9301_d012_5b51,
    0x3fef_72b8_3c7d_517b,
    0x3fef_5487_3168_b9aa,
    0x3fef_387a_6e75_6238,
    0x3fef_1e9d_f51f_dee1,
    0x3fef_06fe_0a31_b715,
    0x3fee_f1a7_373a_a9cb,
    0x3fee_dea6_4c12_3422,
    0x3fee_ce08_6061_892d,
    0x3fee_bfda_d536_2a27,
    0x3fee_b42b_569d_4f82,
    0x3fee_ab07_dd48_5429,
    0x3fee_a47e_b03a_5585,
    0x3fee_a09e_667f_3bcd,
    0x3fee_9f75_e8ec_5f74,
    0x3fee_a114_73eb_0187,
    0x3fee_a589_994c_ce13,
    0x3fee_ace5_422a_a0db,
    0x3fee_b737_b0cd_c5e5,
    0x3fee_c491_82a3_f090,
    0x3fee_d503_b23e_255d,
    0x3fee_e89f_995a_d3ad,
    0x3fee_ff76_f2fb_5e47,
    0x3fef_199b_dd85_529c,
    0x3fef_3720_dcef_9069,
    0x3fef_5818_dcfb_a487,
    0x3fef_7c97_337b_9b5f,
    0x3fef_a4af_a2a4_90da,
    0x3fef_d076_5b6e_4540,
];
/// `1.5 · 2^52`: adding it rounds a double of magnitude < 2^51 to an integer, kept in the low
/// bits of the sum.
pub const SHIFT: f64 = 6_755_399_441_055_744.0;
/// `32 / ln 2`.
pub const INV_LN2_N: f64 = f64::from_bits(0x4047_1547_652b_82fe);
/// The cubic of `2^(r/32)` for `|r| ≤ 1/2`: `C0·r³ + C1·r² + C2·r + 1`.
pub const C0: f64 = f64::from_bits(0x3ebc_6af8_4b91_2394);
pub const C1: f64 = f64::from_bits(0x3f2e_bfce_50fa_c4f3);
pub const C2: f64 = f64::from_bits(0x3f96_2e42_ff0c_52d6);
/// Above this `e^x` overflows f32 (the largest f32 below `ln 2^128`).
pub const OFLOW: f32 = f32::from_bits(0x42b1_7217);
/// Below this `e^x` rounds to 0 (the largest f32 below `ln 2^−150`).
pub const UFLOW: f32 = f32::from_bits(0xc2cf_f1b4);

/// `e^x` by the operations of glibc's `__expf_fma` (module docs): NaN stays NaN, above
/// [`OFLOW`] is +∞, below [`UFLOW`] (and −∞) is 0.
#[must_use]
pub(crate) fn expf(x: f32) -> f32 {
    if x.is_nan() {
        return x + x;
    }
    if x > OFLOW {
        return f32::INFINITY;
    }
    if x < UFLOW {
        return 0.0;
    }
    let xd = f64::from(x);
    let kd = INV_LN2_N.mul_add(xd, SHIFT);
    let ki = kd.to_bits();
    let kd = kd - SHIFT;
    let r = INV_LN2_N.mul_add(xd, -kd);
    let t = TAB[usize::try_from(ki % 32).unwrap_or(0)].wrapping_add(ki << 47);
    let s = f64::from_bits(t);
    let z = C0.mul_add(r, C1);
    let r2 = r * r;
    let y = C2.mul_add(r, 1.0);
    let y = z.mul_add(r2, y);
    #[allow(
        clippy::cast_possible_truncation,
        reason = "the one rounding of the result to f32, as the C function's return"
    )]
    let e = (y * s) as f32;
    e
}

/// `s[i] = e^(s[i] − m)` with the C library's `expf` (the portable path).
pub(crate) fn exp_sub_portable(s: &mut [f32], m: f32) {
    for x in s {
        *x = (*x - m).exp();
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    use std::arch::x86_64::*;

    use super::{C0, C1, C2, INV_LN2_N, OFLOW, SHIFT, TAB, UFLOW, expf};

    /// `e^x` of four f32 in double lanes: `expf`'s operations, without its special cases.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn exp4(x: __m128) -> __m128 {
        let xd = _mm256_cvtps_pd(x);
        let n = _mm256_set1_pd(INV_LN2_N);
        let shift = _mm256_set1_pd(SHIFT);
        let kd = _mm256_fmadd_pd(n, xd, shift);
        let ki = _mm256_castpd_si256(kd);
        let kd = _mm256_sub_pd(kd, shift);
        let r = _mm256_fmsub_pd(n, xd, kd);
        let idx = _mm256_and_si256(ki, _mm256_set1_epi64x(31));
        // SAFETY: every index is in 0..32, inside TAB.
        let t = unsafe { _mm256_i64gather_epi64::<8>(TAB.as_ptr().cast::<i64>(), idx) };
        let s = _mm256_castsi256_pd(_mm256_add_epi64(t, _mm256_slli_epi64::<47>(ki)));
        let z = _mm256_fmadd_pd(r, _mm256_set1_pd(C0), _mm256_set1_pd(C1));
        let r2 = _mm256_mul_pd(r, r);
        let y = _mm256_fmadd_pd(r, _mm256_set1_pd(C2), _mm256_set1_pd(1.0));
        let y = _mm256_fmadd_pd(z, r2, y);
        _mm256_cvtpd_ps(_mm256_mul_pd(y, s))
    }

    /// `e^x` of eight f32: `expf`, its special cases by blends (NaN stays NaN through the
    /// arithmetic).
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(crate) fn exp8(x: __m256) -> __m256 {
        let lo = exp4(_mm256_castps256_ps128(x));
        let hi = exp4(_mm256_extractf128_ps::<1>(x));
        let y = _mm256_set_m128(hi, lo);
        let over = _mm256_cmp_ps::<_CMP_GT_OQ>(x, _mm256_set1_ps(OFLOW));
        let under = _mm256_cmp_ps::<_CMP_LT_OQ>(x, _mm256_set1_ps(UFLOW));
        let y = _mm256_blendv_ps(y, _mm256_set1_ps(f32::INFINITY), over);
        _mm256_andnot_ps(under, y)
    }

    /// `e^x` of eight f32 in the eight double lanes of an AVX-512 vector: [`exp4`]'s
    /// operations, the table read by two two-register permutes instead of a gather.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma")]
    fn exp8_512(x: __m256) -> __m256 {
        // SAFETY: TAB has 32 entries: four vectors of eight.
        let tab = |i: usize| unsafe { _mm512_loadu_pd(TAB.as_ptr().add(8 * i).cast::<f64>()) };
        let xd = _mm512_cvtps_pd(x);
        let n = _mm512_set1_pd(INV_LN2_N);
        let shift = _mm512_set1_pd(SHIFT);
        let kd = _mm512_fmadd_pd(n, xd, shift);
        let ki = _mm512_castpd_si512(kd);
        let kd = _mm512_sub_pd(kd, shift);
        let r = _mm512_fmsub_pd(n, xd, kd);
        // Entries 0–15 and 16–31 by index bits 0–3, then bit 4 picks between them.
        let lo = _mm512_permutex2var_pd(tab(0), ki, tab(1));
        let hi = _mm512_permutex2var_pd(tab(2), ki, tab(3));
        let upper = _mm512_test_epi64_mask(ki, _mm512_set1_epi64(16));
        let t = _mm512_castpd_si512(_mm512_mask_blend_pd(upper, lo, hi));
        let s = _mm512_castsi512_pd(_mm512_add_epi64(t, _mm512_slli_epi64::<47>(ki)));
        let z = _mm512_fmadd_pd(r, _mm512_set1_pd(C0), _mm512_set1_pd(C1));
        let r2 = _mm512_mul_pd(r, r);
        let y = _mm512_fmadd_pd(r, _mm512_set1_pd(C2), _mm512_set1_pd(1.0));
        let y = _mm512_fmadd_pd(z, r2, y);
        _mm512_cvtpd_ps(_mm512_mul_pd(y, s))
    }

    /// `e^x` of sixteen f32: [`exp8`] on AVX-512.
    #[inline]
    #[target_feature(enable = "avx512f,avx512dq,avx2,fma")]
    fn exp16(x: __m512) -> __m512 {
        let lo = exp8_512(_mm512_castps512_ps256(x));
        let hi = exp8_512(_mm512_extractf32x8_ps::<1>(x));
        let y = _mm512_insertf32x8::<1>(_mm512_castps256_ps512(lo), hi);
        let over = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(x, _mm512_set1_ps(OFLOW));
        let under = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, _mm512_set1_ps(UFLOW));
        let y = _mm512_mask_blend_ps(over, y, _mm512_set1_ps(f32::INFINITY));
        _mm512_maskz_mov_ps(!under, y)
    }

    /// `s[i] = e^(s[i] − m)`, sixteen at a time, the tail by `expf`.
    ///
    /// # Safety
    /// The CPU must support AVX-512 F and DQ, AVX2 and FMA.
    #[target_feature(enable = "avx512f,avx512dq,avx2,fma")]
    pub(crate) unsafe fn exp_sub_512(s: &mut [f32], m: f32) {
        let (chunks, tail) = s.as_chunks_mut::<16>();
        let mv = _mm512_set1_ps(m);
        for c in chunks {
            // SAFETY: sixteen values of the chunk.
            unsafe {
                let x = _mm512_sub_ps(_mm512_loadu_ps(c.as_ptr()), mv);
                _mm512_storeu_ps(c.as_mut_ptr(), exp16(x));
            }
        }
        for x in tail {
            *x = expf(*x - m);
        }
    }

    /// `s[i] = e^(s[i] − m)`, eight at a time, the tail by `expf`.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn exp_sub_256(s: &mut [f32], m: f32) {
        let (chunks, tail) = s.as_chunks_mut::<8>();
        let mv = _mm256_set1_ps(m);
        for c in chunks {
            // SAFETY: eight values of the chunk.
            unsafe {
                let x = _mm256_sub_ps(_mm256_loadu_ps(c.as_ptr()), mv);
                _mm256_storeu_ps(c.as_mut_ptr(), exp8(x));
            }
        }
        for x in tail {
            *x = expf(*x - m);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether `f32::exp` here is glibc's `__expf_fma` (the oracle of the bit comparisons).
    fn libm_is_glibc_fma() -> bool {
        cfg!(all(target_env = "gnu", target_arch = "x86_64")) && {
            #[cfg(target_arch = "x86_64")]
            {
                is_x86_feature_detected!("fma") && is_x86_feature_detected!("avx2")
            }
            #[cfg(not(target_arch = "x86_64"))]
            {
                false
            }
        }
    }

    /// Every 4099th f32 bit pattern (both signs; all exponents) plus the edges.
    fn samples() -> Vec<f32> {
        let mut v: Vec<f32> = (0..u32::MAX / 4099)
            .map(|i| f32::from_bits(i * 4099))
            .collect();
        v.extend([
            0.0,
            -0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            OFLOW,
            f32::from_bits(OFLOW.to_bits() + 1),
            UFLOW,
            f32::from_bits(UFLOW.to_bits() + 1),
            -88.0,
            -87.999_99,
            -103.0,
            f32::MIN_POSITIVE,
            -f32::MIN_POSITIVE,
            f32::from_bits(1),
        ]);
        v
    }

    fn same(a: f32, b: f32) -> bool {
        a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
    }

    #[test]
    fn scalar_expf_is_the_c_librarys_where_that_is_glibc_with_fma() {
        if !libm_is_glibc_fma() {
            return;
        }
        for x in samples() {
            assert!(
                same(expf(x), x.exp()),
                "expf({x:e}): {} vs {}",
                expf(x),
                x.exp()
            );
        }
        // Every f32 of the softmax's usual range [−20, 0] that is a multiple of 2^−17 apart.
        let mut x = -20.0f32;
        while x <= 0.0 {
            assert!(same(expf(x), x.exp()), "expf({x:e})");
            x += 1.0 / 131_072.0;
        }
    }

    /// All 2^32 inputs, about 75 s in release, so only when `SPECULA_EXHAUSTIVE=1` (`cargo
    /// test --release -p specula-cpu --lib expf` with it set; run it after touching the
    /// constants).
    #[test]
    fn scalar_expf_is_the_c_librarys_everywhere() {
        if std::env::var_os("SPECULA_EXHAUSTIVE").is_none_or(|v| v != "1") {
            eprintln!("skipped: the exhaustive expf check runs with SPECULA_EXHAUSTIVE=1");
            return;
        }
        if !libm_is_glibc_fma() {
            eprintln!("skipped: the C library's expf here is not glibc's __expf_fma");
            return;
        }
        let bad = (0..=u32::MAX)
            .map(f32::from_bits)
            .filter(|&x| !same(expf(x), x.exp()))
            .count();
        assert_eq!(bad, 0);
    }

    #[test]
    fn scalar_expf_is_accurate() {
        for x in samples() {
            if !(-103.0..88.0).contains(&x) {
                continue;
            }
            let want = f64::from(x).exp();
            let got = f64::from(expf(x));
            if want >= f64::from(f32::MIN_POSITIVE) {
                assert!(
                    ((got - want) / want).abs() < 1.5e-7,
                    "expf({x:e}) = {got:e}, e^x = {want:e}"
                );
            }
        }
    }

    /// The vector loops this CPU has on all 2^32 inputs against the scalar `expf`
    /// (`SPECULA_EXHAUSTIVE=1`, as above).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_vector_loops_are_the_scalar_expf_everywhere() {
        if std::env::var_os("SPECULA_EXHAUSTIVE").is_none_or(|v| v != "1") {
            eprintln!("skipped: the exhaustive expf check runs with SPECULA_EXHAUSTIVE=1");
            return;
        }
        let has = |f: &[&str]| {
            f.iter().all(|f| match *f {
                "avx512f" => is_x86_feature_detected!("avx512f"),
                "avx512dq" => is_x86_feature_detected!("avx512dq"),
                "avx2" => is_x86_feature_detected!("avx2"),
                _ => is_x86_feature_detected!("fma"),
            })
        };
        type Loop = unsafe fn(&mut [f32], f32);
        let mut loops: Vec<(&str, Loop)> = Vec::new();
        if has(&["avx512f", "avx512dq", "avx2", "fma"]) {
            loops.push(("avx512", x86::exp_sub_512));
        }
        if has(&["avx2", "fma"]) {
            loops.push(("avx2", x86::exp_sub_256));
        }
        const CHUNK: u32 = 1 << 20;
        let mut xs = vec![0.0f32; CHUNK as usize];
        let mut got = xs.clone();
        for base in (0..=u32::MAX - (CHUNK - 1)).step_by(CHUNK as usize) {
            for (x, b) in xs.iter_mut().zip(base..) {
                *x = f32::from_bits(b);
            }
            for &(name, f) in &loops {
                got.copy_from_slice(&xs);
                // SAFETY: the CPU has the loop's features (checked above).
                unsafe { f(&mut got, 0.0) };
                for (&x, &g) in xs.iter().zip(&got) {
                    assert!(
                        same(g, expf(x)),
                        "{name}: e^{x:e} = {g:e}, not {:e}",
                        expf(x)
                    );
                }
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_avx512_loop_has_the_scalar_bits() {
        if !(is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512dq")
            && is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma"))
        {
            return;
        }
        // The edge cases (appended last) moved to the front, into the vector loop.
        let mut xs = samples();
        xs.rotate_right(32);
        for m in [0.0f32, 1.5, -3.25] {
            let mut got: Vec<f32> = xs.clone();
            // SAFETY: the CPU has the features (checked above).
            unsafe { x86::exp_sub_512(&mut got, m) };
            for (&x, &g) in xs.iter().zip(&got) {
                assert!(
                    same(g, expf(x - m)),
                    "e^({x:e} − {m}): {g:e} vs {:e}",
                    expf(x - m)
                );
            }
        }
    }

    #[test]
    fn the_avx2_loop_has_the_scalar_bits() {
        if !(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")) {
            return;
        }
        let xs = samples();
        for m in [0.0f32, 1.5, -3.25] {
            let mut got: Vec<f32> = xs.clone();
            // SAFETY: the CPU has AVX2 and FMA (checked above).
            unsafe { x86::exp_sub_256(&mut got, m) };
            for (&x, &g) in xs.iter().zip(&got) {
                assert!(
                    same(g, expf(x - m)),
                    "e^({x:e} − {m}): {g:e} vs {:e}",
                    expf(x - m)
                );
            }
        }
    }
}
