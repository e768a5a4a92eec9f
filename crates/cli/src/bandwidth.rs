//! What a decode step reads from memory, and how fast this machine reads memory.
//!
//! Decoding one token is bound by memory: every matmul weight is read once per step, and every
//! attention layer reads its K/V cells. [`weight_bytes_per_token`] counts the first from the
//! GGUF's tensors; the KV cache layout counts the second; [`probe`] measures the yardstick, a
//! plain summing loop over a buffer far larger than the last-level cache, on the bench's
//! threads. `specula bench` reports their ratio for each `tg` test.

use std::hint::black_box;
use std::time::Instant;

use specula_gguf::{Metadata, TensorInfo};

/// Bytes of weights one decode step reads: every tensor once, except the token embeddings,
/// of which a step reads one row (all of it when the output head is tied to it, as no
/// `output.weight` says), and the stacked experts of a MoE layer, of which a step reads the
/// `expert_used_count` of `expert_count` it routes to.
#[must_use]
pub fn weight_bytes_per_token(tensors: &[TensorInfo], md: &Metadata) -> u64 {
    let arch = md.get_str("general.architecture").unwrap_or("");
    let experts = md
        .get_u64(&format!("{arch}.expert_used_count"))
        .zip(md.get_u64(&format!("{arch}.expert_count")));
    read_bytes(
        tensors.iter().map(|t| {
            let rows = t.dims.iter().skip(1).product::<u64>();
            (t.name.as_str(), t.n_bytes(), rows)
        }),
        experts,
    )
}

/// [`weight_bytes_per_token`] over `(name, bytes, rows)` and the MoE's `(used, count)`.
fn read_bytes<'a>(
    tensors: impl Iterator<Item = (&'a str, u64, u64)> + Clone,
    experts: Option<(u64, u64)>,
) -> u64 {
    let tied = !tensors.clone().any(|(name, ..)| name == "output.weight");
    tensors
        .map(|(name, bytes, rows)| {
            if name.ends_with("token_embd.weight") && !(tied && name == "token_embd.weight") {
                // A lookup table (the token embeddings, Gemma's per-layer inputs): one row.
                bytes / rows.max(1)
            } else if name.contains("_exps.") {
                match experts {
                    Some((used, n)) if n > 0 => bytes * used.min(n) / n,
                    _ => bytes,
                }
            } else {
                bytes
            }
        })
        .sum()
}

/// Bytes of the probe's buffer: far above any last-level cache.
const PROBE_BYTES: usize = 1 << 30;
/// Timed passes of the probe; the median is reported.
const PROBE_PASSES: usize = 7;

/// GB/s (10⁹ bytes per second) that `threads` threads read memory at: each sums its own
/// contiguous share of a 1 GiB buffer, written once first so that every page is mapped; the
/// median of seven passes after one warm-up pass.
///
/// # Errors
/// The buffer cannot be allocated.
pub fn probe(threads: usize) -> anyhow::Result<f64> {
    let threads = threads.max(1);
    let words = PROBE_BYTES / 8;
    let share = words.div_ceil(threads);
    let mut buf: Vec<u64> = Vec::new();
    buf.try_reserve_exact(words)
        .map_err(|_| anyhow::anyhow!("--bandwidth-probe: cannot allocate its 1 GiB buffer"))?;
    buf.resize(words, 1);
    let pass = |buf: &[u64]| -> f64 {
        let start = Instant::now();
        std::thread::scope(|s| {
            for part in buf.chunks(share) {
                s.spawn(move || black_box(sum(black_box(part))));
            }
        });
        start.elapsed().as_secs_f64()
    };
    pass(&buf);
    let mut secs: Vec<f64> = (0..PROBE_PASSES).map(|_| pass(&buf)).collect();
    secs.sort_by(f64::total_cmp);
    #[allow(clippy::cast_precision_loss, reason = "a byte count as a rate")]
    let bytes = (words * 8) as f64;
    Ok(bytes / secs[PROBE_PASSES / 2] / 1e9)
}

/// Wrapping sum with eight independent lanes (vectorized by the compiler).
fn sum(v: &[u64]) -> u64 {
    let mut acc = [0u64; 8];
    let chunks = v.chunks_exact(8);
    let tail: u64 = chunks.remainder().iter().fold(0, |a, &b| a.wrapping_add(b));
    for c in chunks {
        for (a, &x) in acc.iter_mut().zip(c) {
            *a = a.wrapping_add(x);
        }
    }
    acc.iter().fold(tail, |a, &b| a.wrapping_add(b))
}

#[cfg(test)]
mod tests {
    use super::*;
    use specula_gguf::Gguf;

    /// The real SmolLM2 (tied head) and Qwen2.5-Coder-0.5B (own head) files: a decode step
    /// reads every tensor but the embedding table, or with a tied head every tensor; hand
    /// counts from the tensor list (the embedding's type and shape), not from this function.
    #[test]
    fn weight_bytes_count_the_embeddings_once_or_one_row() {
        for (name, tied) in [("smollm2-135m", true), ("qwen2.5-coder-0.5b", false)] {
            let Some(path) = specula_testkit::real_model(name) else {
                continue;
            };
            let f = Gguf::open(&path).expect("a real GGUF");
            let all: u64 = f.tensors().iter().map(TensorInfo::n_bytes).sum();
            let emb = f
                .tensors()
                .iter()
                .find(|t| t.name == "token_embd.weight")
                .expect("token_embd");
            let row = emb.n_bytes() / emb.dims[1];
            let want = if tied { all } else { all - emb.n_bytes() + row };
            assert_eq!(
                weight_bytes_per_token(f.tensors(), f.metadata()),
                want,
                "{name}"
            );
            assert_eq!(
                f.tensors().iter().any(|t| t.name == "output.weight"),
                !tied,
                "{name}"
            );
        }
    }

    /// The stacked experts of a MoE count their routed share; a lookup table one row; a
    /// tied head the whole table.
    #[test]
    fn experts_count_their_routed_share() {
        let own = [
            ("token_embd.weight", 6400, 100),
            ("output.weight", 6400, 100),
            ("blk.0.ffn_up_exps.weight", 16384, 256),
            ("blk.0.attn_q.weight", 1024, 16),
        ];
        assert_eq!(
            read_bytes(own.iter().copied(), Some((2, 8))),
            64 + 6400 + 16384 / 4 + 1024
        );
        assert_eq!(
            read_bytes(own.iter().copied(), None),
            64 + 6400 + 16384 + 1024
        );
        let tied = [
            ("token_embd.weight", 6400, 100),
            ("blk.0.attn_q.weight", 1024, 16),
        ];
        assert_eq!(read_bytes(tied.iter().copied(), None), 6400 + 1024);
    }

    /// The probe runs on one and two threads and gives a finite, plausible rate (any machine
    /// that runs the tests reads well over 0.1 GB/s and under 10 TB/s).
    #[test]
    fn probe_gives_a_plausible_rate() {
        for t in [1, 2] {
            let gbs = probe(t).expect("1 GiB to probe");
            assert!(
                gbs.is_finite() && (0.1..10_000.0).contains(&gbs),
                "{t} threads: {gbs}"
            );
        }
    }

    #[test]
    fn sum_wraps_over_every_word() {
        assert_eq!(sum(&[1, 2, 3, 4, 5, 6, 7, 8, 9, u64::MAX]), 44);
        assert_eq!(sum(&[7; 17]), 119);
    }
}
