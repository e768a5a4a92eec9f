//! Rotary position embedding, computed as ggml-cpu computes it (`ops.cpp`:
//! `ggml_rope_cache_init`, `rope_yarn`, `rotate_pairs`; `ggml.c`: `ggml_rope_yarn_corr_dims`),
//! with the same f32 operations in the same order: `θ_0 = pos`, `θ_{i+1} = θ_i · θ_scale` with
//! `θ_scale = freq_base^(−2/n_rot)`, then YaRN's interpolation/extrapolation mix and magnitude
//! scale, `cos`/`sin` in f32. The angles of a row depend only on its position, and each head
//! slice is rotated on its own, so a row's result does not depend on the batch.

use specula_tensor::{RopeConfig, RopeKind};

use crate::CpuBackend;
use crate::tensor::CpuTensor;

/// `ggml_rope_yarn_corr_dim`: the dimension at which the rotation count over the original
/// context is `n_rot` (`beta`).
#[allow(
    clippy::cast_precision_loss,
    reason = "dimension counts and context lengths, as ggml converts its ints to float"
)]
fn corr_dim(n_dims: usize, n_ctx_orig: usize, beta: f32, base: f32) -> f32 {
    n_dims as f32 * (n_ctx_orig as f32 / (beta * 2.0 * std::f32::consts::PI)).ln()
        / (2.0 * base.ln())
}

/// `ggml_rope_yarn_corr_dims`: the correction range `[start, end]` in dimension pairs.
#[allow(
    clippy::cast_precision_loss,
    reason = "n_dims − 1 is a small int, as in ggml's MIN(n_dims − 1, end)"
)]
pub(crate) fn corr_dims(
    n_dims: usize,
    n_ctx_orig: usize,
    base: f32,
    beta_fast: f32,
    beta_slow: f32,
) -> [f32; 2] {
    let start = corr_dim(n_dims, n_ctx_orig, beta_fast, base).floor();
    let end = corr_dim(n_dims, n_ctx_orig, beta_slow, base).ceil();
    [start.max(0.0), end.min(n_dims as f32 - 1.0)]
}

/// `rope_yarn_ramp`.
#[allow(
    clippy::cast_precision_loss,
    reason = "i0 / 2 is a small int, converted as ggml converts it"
)]
fn ramp(low: f32, high: f32, i0: usize) -> f32 {
    let y = ((i0 / 2) as f32 - low) / (high - low).max(0.001);
    1.0 - y.clamp(0.0, 1.0).min(1.0)
}

/// The per-row angle parameters, fixed for one call.
#[derive(Clone, Debug)]
pub(crate) struct RopeParams {
    n_rot: usize,
    kind: RopeKind,
    theta_scale: f32,
    freq_scale: f32,
    ext_factor: f32,
    mscale: f32,
    corr: [f32; 2],
    /// Divisors of each pair's frequency ([`RopeConfig::freq_factors`]).
    freq_factors: Option<std::sync::Arc<[f32]>>,
}

impl RopeParams {
    #[allow(
        clippy::cast_precision_loss,
        reason = "n_rot is a small int, as in ggml's -2.0f/n_dims"
    )]
    pub(crate) fn new(cfg: &RopeConfig) -> Self {
        let n_rot = cfg.n_rot;
        let (ext_factor, mscale, corr) = match cfg.yarn {
            Some(y) => (
                y.ext_factor,
                y.attn_factor,
                corr_dims(n_rot, y.orig_ctx, cfg.freq_base, y.beta_fast, y.beta_slow),
            ),
            None => (0.0, 1.0, [0.0, 0.0]),
        };
        Self {
            n_rot,
            kind: cfg.kind,
            theta_scale: cfg.freq_base.powf(-2.0 / n_rot as f32),
            freq_scale: cfg.freq_scale,
            ext_factor,
            mscale,
            corr,
            freq_factors: cfg.freq_factors.clone(),
        }
    }

    /// `(cos, sin)` of each rotated pair at position `pos` into `cache` (`n_rot` values:
    /// `cache[2i] = cos θ_i`, `cache[2i + 1] = sin θ_i`), as `ggml_rope_cache_init`.
    #[allow(
        clippy::cast_precision_loss,
        reason = "positions are converted to f32 as ggml converts its int64 position"
    )]
    pub(crate) fn cache(&self, pos: u32, cache: &mut [f32]) {
        let mut theta_base = pos as f32;
        for (i, cs) in cache.chunks_exact_mut(2).enumerate() {
            let theta_extrap = match &self.freq_factors {
                Some(f) => theta_base / f[i],
                None => theta_base,
            };
            let theta_interp = self.freq_scale * theta_extrap;
            let mut theta = theta_interp;
            let mut mscale = self.mscale;
            if self.ext_factor != 0.0 {
                let ramp_mix = ramp(self.corr[0], self.corr[1], 2 * i) * self.ext_factor;
                theta = theta_interp * (1.0 - ramp_mix) + theta_extrap * ramp_mix;
                mscale *= 1.0 + 0.1 * (1.0 / self.freq_scale).ln();
            }
            cs[0] = theta.cos() * mscale;
            cs[1] = theta.sin() * mscale;
            theta_base *= self.theta_scale;
        }
    }

    /// Rotates one head slice by the angles in `cache` (`rotate_pairs`).
    #[inline]
    pub(crate) fn rotate(&self, head: &mut [f32], cache: &[f32]) {
        let n = self.n_rot;
        match self.kind {
            RopeKind::Normal => {
                for (p, cs) in head[..n].chunks_exact_mut(2).zip(cache.chunks_exact(2)) {
                    let (x0, x1) = (p[0], p[1]);
                    p[0] = x0 * cs[0] - x1 * cs[1];
                    p[1] = x0 * cs[1] + x1 * cs[0];
                }
            }
            RopeKind::Neox => {
                let (lo, hi) = head[..n].split_at_mut(n / 2);
                for ((a, b), cs) in lo.iter_mut().zip(hi).zip(cache.chunks_exact(2)) {
                    let (x0, x1) = (*a, *b);
                    *a = x0 * cs[0] - x1 * cs[1];
                    *b = x0 * cs[1] + x1 * cs[0];
                }
            }
        }
    }
}

/// Rotates each `head_dim` slice of row `r` by position `pos[r]`.
pub(crate) fn rope(
    be: &CpuBackend,
    x: &mut CpuTensor,
    head_dim: usize,
    pos: &[u32],
    cfg: &RopeConfig,
) {
    let cols = x.cols();
    assert_eq!(
        pos.len(),
        x.rows(),
        "rope: {} positions for {} rows",
        pos.len(),
        x.rows()
    );
    assert!(
        head_dim > 0 && cols.is_multiple_of(head_dim),
        "rope: rows of {cols} values are not whole heads of {head_dim}"
    );
    assert!(
        cfg.n_rot.is_multiple_of(2) && cfg.n_rot <= head_dim,
        "rope: n_rot {} must be even and at most head_dim {head_dim}",
        cfg.n_rot
    );
    if cfg.n_rot == 0 {
        return;
    }
    if let Some(f) = &cfg.freq_factors {
        assert_eq!(
            f.len(),
            cfg.n_rot / 2,
            "rope: {} frequency factors for {} rotated pairs",
            f.len(),
            cfg.n_rot / 2
        );
    }
    let p = RopeParams::new(cfg);
    be.par_rows(x.as_mut_slice(), cols, |r, row| {
        crate::scratch::with_f32(cfg.n_rot, |cache| {
            p.cache(pos[r], cache);
            for head in row.chunks_exact_mut(head_dim) {
                p.rotate(head, cache);
            }
        });
    });
}

/// The angles of every row, as ggml computes them: `n_rot` values per position
/// (`cos θ_i`, `sin θ_i` of each rotated pair `i`), row after row. Backends that rotate on
/// another device compute the table here, so their angles are these bits.
#[must_use]
pub fn angle_table(cfg: &RopeConfig, pos: &[u32]) -> Vec<f32> {
    let p = RopeParams::new(cfg);
    let mut t = vec![0f32; pos.len() * cfg.n_rot];
    if cfg.n_rot > 0 {
        for (&q, row) in pos.iter().zip(t.chunks_exact_mut(cfg.n_rot)) {
            p.cache(q, row);
        }
    }
    t
}
