//! AdamW over host parameter vectors, with a linear warm-up and a cosine decay.
//!
//! The parameters live on the host between steps (they are a few million values): the
//! gradients come back from burn, the update runs here, and the next step builds its tensors
//! from the updated vectors. The state (`m`, `v`, the step) is what a checkpoint saves.

use serde::{Deserialize, Serialize};

/// AdamW's hyperparameters and schedule.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AdamW {
    /// Peak learning rate.
    pub lr: f32,
    /// Warm-up steps (linear from 0).
    pub warmup: usize,
    /// Total steps (the cosine reaches `min_lr_ratio · lr` at the end).
    pub steps: usize,
    /// Floor of the cosine, as a fraction of `lr`.
    pub min_lr_ratio: f32,
    /// β₁.
    pub beta1: f32,
    /// β₂.
    pub beta2: f32,
    /// ε.
    pub eps: f32,
    /// Decoupled weight decay (matrices only).
    pub weight_decay: f32,
    /// Global gradient-norm clip (0: none).
    pub clip: f32,
}

impl AdamW {
    /// The learning rate at step `t` (0-based).
    #[must_use]
    pub fn lr_at(&self, t: usize) -> f32 {
        #[allow(clippy::cast_precision_loss, reason = "step counts are far below 2^24")]
        let (t, w, n) = (t as f32, self.warmup as f32, self.steps.max(1) as f32);
        if t < w {
            return self.lr * (t + 1.0) / w;
        }
        let p = ((t - w) / (n - w).max(1.0)).clamp(0.0, 1.0);
        let floor = self.min_lr_ratio * self.lr;
        floor + (self.lr - floor) * 0.5 * (1.0 + (std::f32::consts::PI * p).cos())
    }
}

/// One parameter's moments.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Moments {
    /// First moment.
    pub m: Vec<f32>,
    /// Second moment.
    pub v: Vec<f32>,
}

/// Applies one AdamW step at step `t` (0-based) to every parameter; `decay[i]` says whether
/// parameter `i` takes weight decay. Returns the gradient norm before clipping.
pub fn step(
    cfg: &AdamW,
    t: usize,
    params: &mut [Vec<f32>],
    grads: &[Vec<f32>],
    state: &mut [Moments],
    decay: &[bool],
) -> f32 {
    let norm = grads
        .iter()
        .flatten()
        .map(|&g| f64::from(g) * f64::from(g))
        .sum::<f64>()
        .sqrt();
    #[allow(clippy::cast_possible_truncation, reason = "a norm reported as f32")]
    let norm = norm as f32;
    let clip = if cfg.clip > 0.0 && norm > cfg.clip {
        cfg.clip / norm
    } else {
        1.0
    };
    let lr = cfg.lr_at(t);
    #[allow(
        clippy::cast_possible_truncation,
        clippy::cast_possible_wrap,
        reason = "step counts fit i32"
    )]
    let n = (t + 1) as i32;
    let bc1 = 1.0 - cfg.beta1.powi(n);
    let bc2 = 1.0 - cfg.beta2.powi(n);
    for (((p, g), s), &d) in params
        .iter_mut()
        .zip(grads)
        .zip(state.iter_mut())
        .zip(decay)
    {
        if s.m.len() != p.len() {
            s.m = vec![0.0; p.len()];
            s.v = vec![0.0; p.len()];
        }
        let wd = if d { cfg.weight_decay } else { 0.0 };
        for (((x, &gi), m), v) in p.iter_mut().zip(g).zip(&mut s.m).zip(&mut s.v) {
            let gi = gi * clip;
            *m = cfg.beta1 * *m + (1.0 - cfg.beta1) * gi;
            *v = cfg.beta2 * *v + (1.0 - cfg.beta2) * gi * gi;
            let mh = *m / bc1;
            let vh = *v / bc2;
            *x -= lr * (mh / (vh.sqrt() + cfg.eps) + wd * *x);
        }
    }
    norm
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> AdamW {
        AdamW {
            lr: 0.1,
            warmup: 10,
            steps: 110,
            min_lr_ratio: 0.1,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
            clip: 0.0,
        }
    }

    #[test]
    fn schedule_warms_up_then_decays_to_its_floor() {
        let c = cfg();
        assert!((c.lr_at(0) - 0.01).abs() < 1e-7);
        assert!((c.lr_at(9) - 0.1).abs() < 1e-7);
        assert!((c.lr_at(10) - 0.1).abs() < 1e-7);
        assert!((c.lr_at(60) - 0.055).abs() < 1e-6);
        assert!((c.lr_at(110) - 0.01).abs() < 1e-7);
        assert!((c.lr_at(500) - 0.01).abs() < 1e-7);
    }

    #[test]
    fn first_step_moves_each_value_by_the_learning_rate() {
        // Adam's first bias-corrected step is lr · sign(g) (up to ε).
        let mut c = cfg();
        c.warmup = 1;
        let mut p = vec![vec![1.0f32, -2.0, 0.5]];
        let g = vec![vec![0.3f32, -4.0, 0.0]];
        let mut s = vec![Moments::default()];
        step(&c, 0, &mut p, &g, &mut s, &[false]);
        let want = [1.0 - 0.1, -2.0 + 0.1, 0.5];
        for (a, b) in p[0].iter().zip(want) {
            assert!((a - b).abs() < 1e-5, "{a} vs {b}");
        }
    }

    #[test]
    fn minimises_a_quadratic() {
        let mut c = cfg();
        c.lr = 0.05;
        c.warmup = 1;
        c.steps = 400;
        c.clip = 1.0;
        c.weight_decay = 0.01;
        let mut p = vec![vec![3.0f32, -5.0]];
        let mut s = vec![Moments::default()];
        for t in 0..400 {
            let g = vec![p[0].iter().map(|&x| 2.0 * (x - 1.0)).collect::<Vec<_>>()];
            step(&c, t, &mut p, &g, &mut s, &[true]);
        }
        assert!(p[0].iter().all(|&x| (x - 1.0).abs() < 0.05), "{:?}", p[0]);
    }
}
