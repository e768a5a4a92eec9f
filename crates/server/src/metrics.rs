//! Server-wide counters and gauges, rendered as Prometheus text under the `specula:` prefix
//! (llama-server's `llamacpp:` names where it has one).

use std::fmt::Write as _;
use std::sync::Mutex;

use specula_spec::SpecStats;

/// Upper bounds (seconds) of the request latency histogram.
const LATENCY_BUCKETS: [f64; 10] = [0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];

/// What the engine thread and the HTTP handlers count.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub prompt_tokens: u64,
    pub prompt_tokens_cached: u64,
    pub prompt_seconds: f64,
    pub tokens_predicted: u64,
    pub predicted_seconds: f64,
    /// Batched forwards of the decode loop, and the busy slots summed over them.
    pub n_decode: u64,
    pub n_busy_slots: u64,
    pub n_tokens_max: u64,
    pub spec: SpecStats,
    pub requests_success: u64,
    pub requests_error: u64,
    pub requests_cancelled: u64,
    pub latency_count: [u64; LATENCY_BUCKETS.len()],
    pub latency_sum: f64,
    pub latency_n: u64,
    /// Gauges, set by the engine after each step.
    pub slots_total: u64,
    pub slots_busy: u64,
    pub requests_deferred: u64,
    pub kv_cells_used: u64,
    pub kv_cells_total: u64,
    pub kv_bytes_used: u64,
}

/// The shared metrics.
#[derive(Debug, Default)]
pub(crate) struct Metrics(Mutex<Counters>);

impl Metrics {
    /// Runs `f` on the counters.
    pub(crate) fn with<R>(&self, f: impl FnOnce(&mut Counters) -> R) -> R {
        let mut g = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        f(&mut g)
    }

    /// Records a finished request: its outcome and wall time.
    pub(crate) fn request_done(&self, outcome: Outcome, seconds: f64) {
        self.with(|c| {
            match outcome {
                Outcome::Success => c.requests_success += 1,
                Outcome::Error => c.requests_error += 1,
            }
            for (n, &b) in c.latency_count.iter_mut().zip(&LATENCY_BUCKETS) {
                if seconds <= b {
                    *n += 1;
                }
            }
            c.latency_sum += seconds;
            c.latency_n += 1;
        });
    }

    /// The Prometheus text exposition.
    pub(crate) fn render(&self) -> String {
        self.with(|c| render(c))
    }
}

/// How a request ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// A response was sent.
    Success,
    /// An error was sent.
    Error,
}

#[allow(clippy::cast_precision_loss, reason = "counters as Prometheus floats")]
fn f(x: u64) -> f64 {
    x as f64
}

fn metric(out: &mut String, kind: &str, name: &str, help: &str, value: f64) {
    let _ = writeln!(out, "# HELP specula:{name} {help}");
    let _ = writeln!(out, "# TYPE specula:{name} {kind}");
    let _ = writeln!(out, "specula:{name} {value}");
}

fn render(c: &Counters) -> String {
    let mut o = String::new();
    let counters: [(&str, &str, f64); 14] = [
        (
            "prompt_tokens_total",
            "Number of prompt tokens processed",
            f(c.prompt_tokens),
        ),
        (
            "prompt_tokens_cached_total",
            "Number of prompt tokens reused from a slot's cache",
            f(c.prompt_tokens_cached),
        ),
        (
            "prompt_seconds_total",
            "Total time spent processing prompts",
            c.prompt_seconds,
        ),
        (
            "tokens_predicted_total",
            "Number of generation tokens processed",
            f(c.tokens_predicted),
        ),
        (
            "tokens_predicted_seconds_total",
            "Total time spent generating tokens",
            c.predicted_seconds,
        ),
        (
            "n_decode_total",
            "Total number of batched decode forwards (one per engine step, all slots together)",
            f(c.n_decode),
        ),
        (
            "spec_decode_num_draft_tokens_total",
            "Speculative: Total draft tokens sent to verification",
            f(c.spec.drafted as u64),
        ),
        (
            "spec_decode_num_accepted_tokens_total",
            "Speculative: Total draft tokens accepted by the target model",
            f(c.spec.accepted as u64),
        ),
        (
            "spec_decode_num_drafts_total",
            "Speculative: Total speculative decoding verification steps",
            f(c.spec.rounds as u64),
        ),
        (
            "spec_decode_num_replays_total",
            "Speculative: Verify steps whose rejected rows were taken back by checkpoint and replay (the cache cannot trim)",
            f(c.spec.replays as u64),
        ),
        (
            "requests_success_total",
            "Requests answered",
            f(c.requests_success),
        ),
        (
            "requests_error_total",
            "Requests answered with an error",
            f(c.requests_error),
        ),
        (
            "requests_cancelled_total",
            "Requests cancelled by a client disconnect or the request timeout",
            f(c.requests_cancelled),
        ),
        (
            "n_tokens_max",
            "Largest observed sequence length (prompt + generation)",
            f(c.n_tokens_max),
        ),
    ];
    for (name, help, v) in counters {
        metric(&mut o, "counter", name, help, v);
    }
    let per_second = |n: u64, s: f64| if s > 0.0 { f(n) / s } else { 0.0 };
    let ratio = |a: u64, b: u64| if b > 0 { f(a) / f(b) } else { 0.0 };
    let gauges: [(&str, &str, f64); 10] = [
        (
            "prompt_tokens_seconds",
            "Average prompt throughput in tokens/s",
            per_second(c.prompt_tokens, c.prompt_seconds),
        ),
        (
            "predicted_tokens_seconds",
            "Average generation throughput in tokens/s",
            per_second(c.tokens_predicted, c.predicted_seconds),
        ),
        (
            "requests_processing",
            "Number of requests processing (busy slots)",
            f(c.slots_busy),
        ),
        (
            "requests_deferred",
            "Number of requests waiting for a free slot",
            f(c.requests_deferred),
        ),
        ("slots_total", "Number of slots (-np)", f(c.slots_total)),
        (
            "n_busy_slots_per_decode",
            "Average number of busy slots per batched decode forward",
            ratio(c.n_busy_slots, c.n_decode),
        ),
        (
            "kv_cache_usage_ratio",
            "KV cache usage: filled cells over all cells of all slots",
            ratio(c.kv_cells_used, c.kv_cells_total),
        ),
        (
            "kv_cache_tokens",
            "KV cache cells filled, all slots",
            f(c.kv_cells_used),
        ),
        (
            "kv_cache_bytes",
            "KV cache bytes the filled cells occupy, all slots",
            f(c.kv_bytes_used),
        ),
        (
            "spec_decode_mean_acceptance_length",
            "Speculative: mean tokens per verification step (1 + accepted / steps)",
            c.spec.mean_accept_len(),
        ),
    ];
    for (name, help, v) in gauges {
        metric(&mut o, "gauge", name, help, v);
    }
    if !c.spec.drafted_at.is_empty() {
        for (name, help, values) in [
            (
                "spec_decode_num_accepted_tokens_per_pos_total",
                "Accepted tokens per draft position",
                &c.spec.accepted_at,
            ),
            (
                "spec_decode_num_drafted_tokens_per_pos_total",
                "Verification steps whose draft reached each position",
                &c.spec.drafted_at,
            ),
        ] {
            let _ = writeln!(o, "# HELP specula:{name} {help}");
            let _ = writeln!(o, "# TYPE specula:{name} counter");
            for (i, v) in values.iter().enumerate() {
                let _ = writeln!(o, "specula:{name}{{position=\"{i}\"}} {v}");
            }
        }
    }
    let name = "request_duration_seconds";
    let _ = writeln!(
        o,
        "# HELP specula:{name} Request wall time, from receipt to the last byte of the answer"
    );
    let _ = writeln!(o, "# TYPE specula:{name} histogram");
    for (n, b) in c.latency_count.iter().zip(&LATENCY_BUCKETS) {
        let _ = writeln!(o, "specula:{name}_bucket{{le=\"{b}\"}} {n}");
    }
    let _ = writeln!(o, "specula:{name}_bucket{{le=\"+Inf\"}} {}", c.latency_n);
    let _ = writeln!(o, "specula:{name}_sum {}", c.latency_sum);
    let _ = writeln!(o, "specula:{name}_count {}", c.latency_n);
    o
}

/// Adds one generation's speculative statistics to the server's.
pub(crate) fn add_spec(total: &mut SpecStats, s: &SpecStats) {
    total.drafted += s.drafted;
    total.accepted += s.accepted;
    total.rounds += s.rounds;
    total.replays += s.replays;
    total.replayed += s.replayed;
    if total.drafted_at.len() < s.drafted_at.len() {
        total.drafted_at.resize(s.drafted_at.len(), 0);
        total.accepted_at.resize(s.drafted_at.len(), 0);
    }
    for (t, v) in total.drafted_at.iter_mut().zip(&s.drafted_at) {
        *t += v;
    }
    for (t, v) in total.accepted_at.iter_mut().zip(&s.accepted_at) {
        *t += v;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_exposition_has_help_type_and_value_for_each_metric() {
        let m = Metrics::default();
        m.with(|c| {
            c.prompt_tokens = 7;
            c.spec.record(3, 2);
        });
        m.request_done(Outcome::Success, 0.2);
        let text = m.render();
        assert!(text.contains("specula:prompt_tokens_total 7\n"), "{text}");
        assert!(
            text.contains(
                "specula:spec_decode_num_accepted_tokens_per_pos_total{position=\"1\"} 1\n"
            )
        );
        assert!(
            text.contains(
                "specula:spec_decode_num_accepted_tokens_per_pos_total{position=\"2\"} 0\n"
            )
        );
        assert!(text.contains("specula:spec_decode_mean_acceptance_length 3\n"));
        assert!(text.contains("specula:request_duration_seconds_bucket{le=\"0.1\"} 0\n"));
        assert!(text.contains("specula:request_duration_seconds_bucket{le=\"0.25\"} 1\n"));
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let (name, value) = line.rsplit_once(' ').unwrap();
            assert!(name.starts_with("specula:"), "{line}");
            value.parse::<f64>().unwrap();
        }
    }
}
