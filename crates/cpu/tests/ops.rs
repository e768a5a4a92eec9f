//! The row-wise ops and RoPE against naive f64 references written from the formulas.

mod common;

use common::{Rng, decode, nmse, random_weight, tensor, vector};
use specula_cpu::{CpuBackend, CpuTensor};
use specula_tensor::{Backend, QType, RopeConfig, RopeKind, Yarn};

const EPS: f32 = 1e-6;

fn f64s(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| f64::from(x)).collect()
}

fn rms_ref(x: &[f32], w: Option<&[f32]>, eps: f32) -> Vec<f64> {
    let n = f64::from(u32::try_from(x.len()).unwrap());
    let ms: f64 = x.iter().map(|&v| f64::from(v) * f64::from(v)).sum::<f64>() / n;
    let s = 1.0 / (ms + f64::from(eps)).sqrt();
    x.iter()
        .enumerate()
        .map(|(i, &v)| f64::from(v) * s * w.map_or(1.0, |w| f64::from(w[i])))
        .collect()
}

#[test]
fn get_rows_dequantizes_the_requested_rows() {
    let be = CpuBackend::new(2);
    let mut rng = Rng::new(1);
    for ty in [
        QType::F32,
        QType::F16,
        QType::Q4_K,
        QType::Q6_K,
        QType::Q8_0,
    ] {
        let (n_in, n_rows) = (256, 40);
        let (w, bytes) = random_weight(&be, &mut rng, ty, n_in, n_rows);
        let all = decode(ty, &bytes, n_in);
        let ids: Vec<u32> = (0..300).map(|i| (i * 7 + 3) % 40).collect();
        let mut out = be.zeros(0, 0);
        be.get_rows(&w, &be.index(&ids), &mut out);
        assert_eq!(be.shape(&out), (ids.len(), n_in));
        for (r, &id) in ids.iter().enumerate() {
            let id = usize::try_from(id).unwrap();
            assert_eq!(
                out.row(r),
                &all[id * n_in..(id + 1) * n_in],
                "{ty}, id {id}"
            );
        }
    }
}

#[test]
fn copy_rows_gathers_rows() {
    let be = CpuBackend::new(1);
    let src = tensor(3, 2, vec![0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
    let mut out = be.zeros(0, 0);
    be.copy_rows(&src, &be.index(&[2, 0, 2]), &mut out);
    assert_eq!(out.as_slice(), [4.0, 5.0, 0.0, 1.0, 4.0, 5.0]);
}

#[test]
fn put_rows_scatters_rows_and_keeps_the_others() {
    let be = CpuBackend::new(1);
    let dst: Vec<f32> = (0..15u8).map(f32::from).collect();
    let mut d = be.from_host(5, 3, &dst);
    let src = be.from_host(2, 3, &[-1.0, -2.0, -3.0, -4.0, -5.0, -6.0]);
    be.put_rows(&src, &be.index(&[3, 0]), &mut d);
    let mut got = Vec::new();
    be.to_host(&d, &mut got);
    assert_eq!(
        got,
        [
            -4.0, -5.0, -6.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, -1.0, -2.0, -3.0, 12.0, 13.0, 14.0
        ]
    );
}

#[test]
fn add_vector_add_and_scale_are_exact() {
    for threads in [1, 3] {
        let be = CpuBackend::new(threads);
        let mut rng = Rng::new(2);
        let (rows, cols) = (70, 1000);
        let x = rng.values(rows * cols, 3.0);
        let b = rng.values(cols, 1.0);
        let y = rng.values(rows * cols, 3.0);
        let mut t = tensor(rows, cols, x.clone());
        be.add_vector(&mut t, &vector(&be, "bias", &b));
        be.add(&mut t, &tensor(rows, cols, y.clone()));
        be.scale(&mut t, 0.5);
        for (i, &v) in t.as_slice().iter().enumerate() {
            assert_eq!(v, (x[i] + b[i % cols] + y[i]) * 0.5);
        }
    }
}

#[test]
fn rms_norm_matches_the_formula() {
    let mut rng = Rng::new(3);
    for threads in [1, 2] {
        let be = CpuBackend::new(threads);
        let (rows, cols) = (80, 896);
        let x = rng.values(rows * cols, 4.0);
        let w = rng.values(cols, 2.0);
        let wt = vector(&be, "norm", &w);
        let xt = tensor(rows, cols, x.clone());
        let mut out = be.zeros(0, 0);
        be.rms_norm(&xt, Some(&wt), EPS, &mut out);
        let want: Vec<f64> = x
            .chunks(cols)
            .flat_map(|r| rms_ref(r, Some(&w), EPS))
            .collect();
        assert!(nmse(out.as_slice(), &want) <= 1e-10);
        be.rms_norm(&xt, None, EPS, &mut out);
        let want: Vec<f64> = x.chunks(cols).flat_map(|r| rms_ref(r, None, EPS)).collect();
        assert!(nmse(out.as_slice(), &want) <= 1e-10);
    }
}

#[test]
fn rms_norm_groups_normalises_each_head() {
    let be = CpuBackend::new(2);
    let mut rng = Rng::new(4);
    let (rows, heads, hd) = (9, 6, 64);
    let x = rng.values(rows * heads * hd, 2.0);
    let w = rng.values(hd, 1.5);
    let mut t = tensor(rows, heads * hd, x.clone());
    be.rms_norm_groups(&mut t, hd, &vector(&be, "q_norm", &w), EPS);
    let want: Vec<f64> = x
        .chunks(hd)
        .flat_map(|g| rms_ref(g, Some(&w), EPS))
        .collect();
    assert!(nmse(t.as_slice(), &want) <= 1e-10);
}

#[test]
fn swiglu_and_geglu_match_their_formulas() {
    let be = CpuBackend::new(2);
    let mut rng = Rng::new(5);
    let (rows, cols) = (40, 1200);
    let g = rng.values(rows * cols, 12.0);
    let u = rng.values(rows * cols, 2.0);
    let (gt, ut) = (tensor(rows, cols, g.clone()), tensor(rows, cols, u.clone()));
    let mut out = be.zeros(0, 0);
    be.swiglu(&gt, &ut, &mut out);
    let want: Vec<f64> = g
        .iter()
        .zip(&u)
        .map(|(&g, &u)| {
            let g = f64::from(g);
            g / (1.0 + (-g).exp()) * f64::from(u)
        })
        .collect();
    assert!(nmse(out.as_slice(), &want) <= 1e-10);
    // GELU as ggml-cpu's f32 rows get it (`ggml_vec_geglu_f32`, `GGML_GELU_FP16`): the input
    // rounded to f16, the f16 value of GELU there, 0 at or below −10, the identity at or above 10.
    be.geglu(&gt, &ut, &mut out);
    let f16 = |x: f64| {
        #[allow(
            clippy::cast_possible_truncation,
            reason = "rounding to f16 on purpose"
        )]
        let h = specula_quant::blocks::Half::from_f32(x as f32);
        f64::from(h.to_f32())
    };
    let want: Vec<f64> = g
        .iter()
        .zip(&u)
        .map(|(&g, &u)| {
            let x = f64::from(g);
            let act = if x <= -10.0 {
                0.0
            } else if x >= 10.0 {
                x
            } else {
                let x = f16(x);
                let c = (2.0 / std::f64::consts::PI).sqrt();
                f16(0.5 * x * (1.0 + (c * x * (1.0 + 0.044_715 * x * x)).tanh()))
            };
            act * f64::from(u)
        })
        .collect();
    assert!(nmse(out.as_slice(), &want) <= 1e-12);
    // Not the exact formula: the rounding is what llama.cpp computes.
    let exact: Vec<f64> = g
        .iter()
        .zip(&u)
        .map(|(&g, &u)| f64::from(specula_cpu::gelu_tanh(g)) * f64::from(u))
        .collect();
    assert!(nmse(out.as_slice(), &exact) > 1e-9);
}

/// The angles llama.cpp uses: `θ_0 = pos`, `θ_{i+1} = θ_i · θ_scale`, in f32.
fn ggml_thetas(pos: u32, n_rot: usize, base: f32) -> Vec<f32> {
    let scale = base.powf(-2.0 / f32::from(u16::try_from(n_rot).unwrap()));
    #[allow(clippy::cast_precision_loss, reason = "test positions are small")]
    let mut t = pos as f32;
    (0..n_rot / 2)
        .map(|_| {
            let v = t;
            t *= scale;
            v
        })
        .collect()
}

/// RoPE of one row in f64 from the angles, with YaRN's mix (`ramp` over pair index) when given.
fn rope_ref(x: &[f32], head_dim: usize, pos: u32, cfg: &RopeConfig) -> Vec<f64> {
    let n = cfg.n_rot;
    let thetas = ggml_thetas(pos, n, cfg.freq_base);
    let fs = f64::from(cfg.freq_scale);
    let angle = |i: usize| -> (f64, f64) {
        let te = f64::from(thetas[i]);
        let ti = fs * te;
        match cfg.yarn {
            None => (ti, 1.0),
            Some(y) => {
                let corr = |beta: f32| {
                    let nd = f64::from(u32::try_from(n).unwrap());
                    let ctx = f64::from(u32::try_from(y.orig_ctx).unwrap());
                    nd * (ctx / (f64::from(beta) * 2.0 * std::f64::consts::PI)).ln()
                        / (2.0 * f64::from(cfg.freq_base).ln())
                };
                let lo = corr(y.beta_fast).floor().max(0.0);
                let hi = corr(y.beta_slow)
                    .ceil()
                    .min(f64::from(u32::try_from(n).unwrap()) - 1.0);
                let yv = (f64::from(u32::try_from(i).unwrap()) - lo) / (hi - lo).max(0.001);
                let mix = (1.0 - yv.clamp(0.0, 1.0)) * f64::from(y.ext_factor);
                let th = ti * (1.0 - mix) + te * mix;
                let ms = f64::from(y.attn_factor) * (1.0 + 0.1 * (1.0 / fs).ln());
                (th, ms)
            }
        }
    };
    let mut out = f64s(x);
    for head in out.chunks_mut(head_dim) {
        for i in 0..n / 2 {
            let (a, b) = match cfg.kind {
                RopeKind::Normal => (2 * i, 2 * i + 1),
                RopeKind::Neox => (i, i + n / 2),
            };
            let (th, ms) = angle(i);
            let (c, s) = (th.cos() * ms, th.sin() * ms);
            let (x0, x1) = (head[a], head[b]);
            head[a] = x0 * c - x1 * s;
            head[b] = x0 * s + x1 * c;
        }
    }
    out
}

fn rope_configs() -> Vec<RopeConfig> {
    let yarn = Yarn {
        orig_ctx: 4096,
        ext_factor: 1.0,
        attn_factor: 1.0,
        beta_fast: 32.0,
        beta_slow: 1.0,
    };
    vec![
        RopeConfig::new(RopeKind::Normal, 64, 10_000.0),
        RopeConfig::new(RopeKind::Neox, 64, 1_000_000.0),
        // Partial rotation: 32 of 64 dimensions.
        RopeConfig::new(RopeKind::Neox, 32, 10_000.0),
        RopeConfig::new(RopeKind::Normal, 16, 500_000.0),
        RopeConfig {
            freq_scale: 0.25,
            ..RopeConfig::new(RopeKind::Neox, 64, 10_000.0)
        },
        RopeConfig {
            freq_scale: 0.25,
            yarn: Some(yarn),
            ..RopeConfig::new(RopeKind::Neox, 64, 10_000.0)
        },
        RopeConfig {
            freq_scale: 0.125,
            yarn: Some(Yarn {
                attn_factor: 0.8,
                ..yarn
            }),
            ..RopeConfig::new(RopeKind::Normal, 64, 1_000_000.0)
        },
    ]
}

#[test]
fn rope_matches_the_pairing_and_angle_formulas() {
    let be = CpuBackend::new(2);
    let mut rng = Rng::new(6);
    let (heads, hd) = (4, 64);
    for cfg in rope_configs() {
        let pos: Vec<u32> = vec![0, 1, 2, 7, 100, 1000, 4095, 20_000, 131_071];
        let x = rng.values(pos.len() * heads * hd, 1.0);
        let mut t = tensor(pos.len(), heads * hd, x.clone());
        be.rope(&mut t, hd, &be.index(&pos), &cfg);
        let want: Vec<f64> = x
            .chunks(heads * hd)
            .zip(&pos)
            .flat_map(|(r, &p)| rope_ref(r, hd, p, &cfg))
            .collect();
        // YaRN mixes two angles of up to ~1.3e5 rad in f32 (as ggml does), which rounds the
        // angle by up to ulp/2 ≈ 4e-3 rad at position 131071: a looser, named bucket.
        let tol = if cfg.yarn.is_some() { 1e-9 } else { 1e-10 };
        let e = nmse(t.as_slice(), &want);
        assert!(e <= tol, "{cfg:?}: NMSE {e:e}");
        // Dimensions past n_rot pass through untouched.
        for (got, src) in t.as_slice().chunks(hd).zip(x.chunks(hd)) {
            assert_eq!(got[cfg.n_rot..], src[cfg.n_rot..]);
        }
    }
}

#[test]
fn rope_angles_follow_the_exact_powers_at_small_positions() {
    // The f32 recurrence of the angles (llama.cpp's) stays within f32 rounding of
    // pos · base^(−2i/n) at small positions.
    for pos in [1u32, 3, 17] {
        let t = ggml_thetas(pos, 128, 10_000.0);
        for (i, &v) in t.iter().enumerate() {
            let exact = f64::from(pos)
                * 10_000f64.powf(-2.0 * f64::from(u32::try_from(i).unwrap()) / 128.0);
            assert!(
                (f64::from(v) - exact).abs() <= 1e-5 * exact,
                "pos {pos}, i {i}"
            );
        }
    }
}

#[test]
fn rope_at_position_zero_is_the_identity() {
    let be = CpuBackend::new(1);
    let x: Vec<f32> = (0..128)
        .map(|i| f32::from(u8::try_from(i).unwrap()) - 60.0)
        .collect();
    for cfg in rope_configs().into_iter().filter(|c| c.yarn.is_none()) {
        let mut t: CpuTensor = tensor(1, 128, x.clone());
        be.rope(&mut t, 64, &be.index(&[0]), &cfg);
        assert_eq!(t.as_slice(), &x[..], "{cfg:?}");
    }
}
