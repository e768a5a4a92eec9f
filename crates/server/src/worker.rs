//! The engine thread: it owns the model, the slots (one session and one drafter each) and
//! runs the continuous-batching loop. HTTP handlers send it [`Command`]s over a channel and
//! receive each request's [`Event`]s over a channel of their own.
//!
//! One loop iteration: take new commands; give queued requests to free slots (the slot whose
//! cache shares the longest prefix with the prompt first, its KV kept for that prefix); drop
//! requests whose client left or whose time ran out; then one batched forward over every busy
//! slot — a slot reading its prompt contributes its next prompt chunk (all chunks together at
//! most `n_batch` rows, no logits), a generating slot its anchor token and, when it
//! speculates, its draft — and verify, commit and stream each generating slot's tokens. A
//! slot whose drafter learns from target hidden states captures them in that forward, and its
//! drafter sees every prompt chunk and verify batch with them (as `generate_speculative`
//! feeds it).

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, TryRecvError};
use std::time::Instant;

use serde_json::json;
use specula_engine::{BatchEntry, Capture, Engine, EngineError, Rewound, Rollback, SpecOptions};
use specula_models::{Scratch, Taps};
use specula_quant::QType;
use specula_sampling::{Candidates, Sampler, SamplerParams, steps};
use specula_spec::policy::Adaptive;
use specula_spec::verify::sample_and_match;
use specula_spec::{DraftParams, Drafter, SpecStats};
use specula_tensor::Backend;
use tokio::sync::{mpsc, oneshot};

use crate::metrics::{Metrics, add_spec};
use crate::text::TextStream;

/// What a handler asks of the engine thread.
pub(crate) enum Command {
    /// Generate for a request.
    Generate(Box<Job>),
    /// The state of every slot, as JSON.
    Slots(oneshot::Sender<serde_json::Value>),
    /// Cancel what runs and stop.
    Shutdown,
}

/// Per-request speculative overrides (`speculative.n_max`, …).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct SpecRequest {
    pub n_max: Option<usize>,
    pub n_min: Option<usize>,
    pub p_min: Option<f32>,
}

/// One generation request, tokenized and checked.
#[derive(Debug)]
pub(crate) struct Job {
    pub id: String,
    pub prompt: Vec<u32>,
    pub n_predict: usize,
    pub sampler: SamplerParams,
    pub stop: Vec<String>,
    /// Top log-probabilities per token (`Some(0)`: only the chosen token's).
    pub logprobs: Option<usize>,
    pub spec: SpecRequest,
    pub ignore_eos: bool,
    pub events: mpsc::UnboundedSender<Event>,
    pub deadline: Instant,
}

/// A token's log-probability and the most likely alternatives, with their texts.
#[derive(Clone, Debug)]
pub(crate) struct TokenLogprob {
    pub token: String,
    pub bytes: Vec<u8>,
    pub logprob: f32,
    pub top: Vec<(String, Vec<u8>, f32)>,
}

/// One generated token and the text it releases (possibly empty: an unfinished character
/// or a possible stop string is held back).
#[derive(Clone, Debug)]
pub(crate) struct Delta {
    pub text: String,
    pub token: u32,
    pub logprob: Option<TokenLogprob>,
}

/// The end of a generation.
#[derive(Clone, Debug)]
pub(crate) struct Summary {
    pub finish_reason: &'static str,
    /// Text released with the end (held-back text that turned out not to be a stop).
    pub tail: String,
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    pub completion_tokens: usize,
    pub prompt_ms: f64,
    pub predicted_ms: f64,
    pub spec: Option<SpecStats>,
    pub slot: usize,
}

/// What the engine sends back for a request.
#[derive(Debug)]
pub(crate) enum Event {
    Delta(Delta),
    Done(Box<Summary>),
    /// An error with its HTTP status.
    Error(u16, String),
}

/// Where a slot's request is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// Prompt tokens `..next` of the head (all but the anchor) are in the cache.
    Prefill { next: usize },
    /// Generating.
    Decode,
}

struct Task {
    job: Job,
    phase: Phase,
    sampler: Sampler,
    /// Prompt and generated tokens; the last one is the anchor the cache does not hold yet.
    history: Vec<u32>,
    n_generated: usize,
    cached: usize,
    text: TextStream,
    spec_on: bool,
    spec: SpecOptions,
    policy: Adaptive,
    stats: SpecStats,
    since_draft: usize,
    /// This step's batch: the anchor and the draft.
    batch: Vec<u32>,
    draft_s: f64,
    caught_up: usize,
    prompt_s: f64,
    /// When the slot took the job (prompt time runs from here to the end of the prefill).
    assigned: Instant,
    /// This step's prompt rows end here (`Prefill { next }` to `prefill_end`).
    prefill_end: usize,
    decode_start: Option<Instant>,
    candidates: Candidates,
    top: Vec<(u32, f32)>,
}

struct Slot<B: Backend> {
    id: usize,
    session: specula_engine::Session<B>,
    /// The tokens the cache holds, for prefix reuse.
    cached: Vec<u32>,
    drafter: Option<Box<dyn Drafter>>,
    /// The target hidden states the drafter learns from (none: a drafter that follows the
    /// tokens alone, and no capture in the batched forward).
    taps: Taps,
    /// This step's captured rows of the slot, `[rows, taps · n_embd]`.
    features: Vec<f32>,
    task: Option<Task>,
    last_used: u64,
}

/// The speculative setup of the server.
pub(crate) struct SpecSetup {
    pub kind: String,
    pub options: SpecOptions,
}

/// Everything the engine thread needs.
pub(crate) struct Worker<B: Backend> {
    engine: Engine<B>,
    slots: Vec<Slot<B>>,
    queue: VecDeque<Job>,
    rx: Receiver<Command>,
    metrics: Arc<Metrics>,
    spec: Option<SpecSetup>,
    rollback: Rollback,
    scratch: Scratch<B>,
    logits: Vec<f32>,
    clock: u64,
}

/// Settings of the slots.
pub(crate) struct SlotConfig {
    pub n_parallel: usize,
    pub n_ctx_slot: usize,
    pub k_type: QType,
    pub v_type: QType,
    pub force_replay: bool,
}

impl<B: Backend> Worker<B> {
    /// Allocates the slots (and their drafters).
    pub(crate) fn new(
        engine: Engine<B>,
        cfg: &SlotConfig,
        mut spec: Option<(SpecSetup, crate::DrafterFactory)>,
        rx: Receiver<Command>,
        metrics: Arc<Metrics>,
    ) -> Result<Self, crate::ServerError> {
        let mut slots = Vec::with_capacity(cfg.n_parallel);
        for id in 0..cfg.n_parallel {
            let mut session = engine
                .session(cfg.n_ctx_slot, cfg.k_type, cfg.v_type)
                .map_err(|source| crate::ServerError::SlotCache { slot: id, source })?;
            if cfg.force_replay {
                session.force_replay();
            }
            let drafter = match spec.as_mut() {
                Some((_, factory)) => Some(
                    factory()
                        .map_err(|source| crate::ServerError::SlotDrafter { slot: id, source })?,
                ),
                None => None,
            };
            let taps = Taps {
                layers: drafter
                    .as_ref()
                    .map_or_else(Vec::new, |d| d.target_taps().to_vec()),
                rows: Vec::new(),
            };
            slots.push(Slot {
                id,
                session,
                cached: Vec::new(),
                drafter,
                taps,
                features: Vec::new(),
                task: None,
                last_used: 0,
            });
        }
        // What the slots' memory does, as the engine reports it (every slot has the same).
        let rollback = slots
            .first()
            .map_or(Rollback::Trim, |s| s.session.rollback());
        tracing::info!(
            rollback = rollback.name(),
            "target cache rollback capability: {} ({})",
            rollback.name(),
            match rollback {
                Rollback::Trim => "partial suffix removal",
                Rollback::Replay => "checkpoint before each verify, accepted rows run again",
            }
        );
        let spec = spec.map(|(s, _)| s);
        if let Some(s) = &spec {
            tracing::info!(
                kind = %s.kind,
                taps = ?slots.first().map(|s| &s.taps.layers),
                n_max = s.options.n_max,
                n_min = s.options.n_min,
                p_min = s.options.p_min,
                adaptive = s.options.adaptive,
                "speculative decoding: {} drafter per slot",
                s.kind
            );
        }
        let layout = engine.kv_layout(cfg.n_ctx_slot, cfg.k_type, cfg.v_type);
        metrics.with(|c| {
            c.slots_total = cfg.n_parallel as u64;
            c.kv_cells_total = (cfg.n_parallel * cfg.n_ctx_slot) as u64;
        });
        if let Ok(l) = layout {
            tracing::info!(
                slots = cfg.n_parallel,
                n_ctx_slot = cfg.n_ctx_slot,
                kv_mib = l.total_bytes() as f64 * cfg.n_parallel as f64 / (1024.0 * 1024.0),
                swa_ring = engine.swa_ring().filter(|&r| r < cfg.n_ctx_slot),
                "slots ready"
            );
        }
        let scratch = engine.scratch();
        Ok(Self {
            engine,
            slots,
            queue: VecDeque::new(),
            rx,
            metrics,
            spec,
            rollback,
            scratch,
            logits: Vec::new(),
            clock: 0,
        })
    }

    /// How the slots' caches take back rejected draft rows.
    pub(crate) fn rollback(&self) -> Rollback {
        self.rollback
    }

    fn busy(&self) -> bool {
        !self.queue.is_empty() || self.slots.iter().any(|s| s.task.is_some())
    }

    /// Handles a command; false to stop.
    fn command(&mut self, c: Command) -> bool {
        match c {
            Command::Generate(job) => {
                self.queue.push_back(*job);
                true
            }
            Command::Slots(reply) => {
                let _ = reply.send(self.slots_json());
                true
            }
            Command::Shutdown => false,
        }
    }

    /// The loop; returns when told to stop or when every sender is gone.
    pub(crate) fn run(mut self) {
        loop {
            if !self.busy() {
                match self.rx.recv() {
                    Ok(c) => {
                        if !self.command(c) {
                            break;
                        }
                    }
                    Err(_) => break,
                }
            }
            let mut stop = false;
            loop {
                match self.rx.try_recv() {
                    Ok(c) => {
                        if !self.command(c) {
                            stop = true;
                            break;
                        }
                    }
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => {
                        stop = true;
                        break;
                    }
                }
            }
            if stop {
                break;
            }
            self.assign();
            self.reap();
            self.plan_prefill();
            self.decode_step();
            self.gauges();
        }
        for slot in &mut self.slots {
            if let Some(t) = slot.task.take() {
                let _ = t.job.events.send(Event::Error(
                    503,
                    "the server is shutting down; retry on another instance".into(),
                ));
            }
        }
        for job in self.queue.drain(..) {
            let _ = job.events.send(Event::Error(
                503,
                "the server is shutting down; retry on another instance".into(),
            ));
        }
        tracing::info!("engine thread stopped");
    }

    fn gauges(&self) {
        let used: usize = self.slots.iter().map(|s| s.session.n_past()).sum();
        let bytes: usize = self.slots.iter().map(|s| s.session.kv_bytes_used()).sum();
        let busy = self.slots.iter().filter(|s| s.task.is_some()).count();
        self.metrics.with(|c| {
            c.kv_cells_used = used as u64;
            c.kv_bytes_used = bytes as u64;
            c.slots_busy = busy as u64;
            c.requests_deferred = self.queue.len() as u64;
        });
    }

    fn slots_json(&self) -> serde_json::Value {
        let slots: Vec<serde_json::Value> = self
            .slots
            .iter()
            .map(|s| {
                let task = s.task.as_ref();
                json!({
                    "id": s.id,
                    "n_ctx": s.session.n_ctx(),
                    "is_processing": task.is_some(),
                    "id_task": task.map(|t| t.job.id.clone()),
                    "n_past": s.session.n_past(),
                    "n_cached_tokens": s.cached.len(),
                    "kv_bytes_used": s.session.kv_bytes_used(),
                    "phase": task.map(|t| match t.phase {
                        Phase::Prefill { .. } => "prompt",
                        Phase::Decode => "generating",
                    }),
                    "n_decoded": task.map_or(0, |t| t.n_generated),
                    "n_prompt_tokens": task.map_or(0, |t| t.job.prompt.len()),
                    "rollback": self.rollback.name(),
                    "speculative": self.spec.as_ref().map(|sp| json!({
                        "type": sp.kind,
                        "n_max": task.map_or(sp.options.n_max, |t| t.spec.n_max),
                        "n_min": sp.options.n_min,
                        "p_min": sp.options.p_min,
                        "adaptive": sp.options.adaptive,
                        "enabled": task.is_none_or(|t| t.spec_on),
                        "draft_n": task.map_or(0, |t| t.stats.drafted),
                        "draft_n_accepted": task.map_or(0, |t| t.stats.accepted),
                    })),
                })
            })
            .collect();
        serde_json::Value::Array(slots)
    }

    /// Gives queued requests to free slots, in arrival order.
    fn assign(&mut self) {
        while let Some(job) = self.queue.front() {
            if job.events.is_closed() || Instant::now() >= job.deadline {
                let job = self.queue.pop_front().expect("the front was there");
                if !job.events.is_closed() {
                    let _ = job.events.send(Event::Error(
                        504,
                        "the request waited for a free slot longer than the server's --timeout; retry later, or start the server with more slots (-np) or a larger --timeout".into(),
                    ));
                }
                self.metrics.with(|c| c.requests_cancelled += 1);
                continue;
            }
            // The free slot sharing the longest prefix with the prompt, else the least
            // recently used one.
            let best = self
                .slots
                .iter()
                .enumerate()
                .filter(|(_, s)| s.task.is_none())
                .map(|(i, s)| {
                    let common = s
                        .cached
                        .iter()
                        .zip(&job.prompt)
                        .take_while(|(a, b)| a == b)
                        .count();
                    (i, common, s.last_used)
                })
                .max_by(|a, b| a.1.cmp(&b.1).then(b.2.cmp(&a.2)).then(b.0.cmp(&a.0)));
            let Some((i, _, _)) = best else { break };
            let job = self.queue.pop_front().expect("the front was there");
            self.clock += 1;
            let clock = self.clock;
            let spec_default = self.spec.as_ref().map(|s| s.options);
            let n_vocab = self.engine.model.hparams().n_vocab;
            let slot = &mut self.slots[i];
            slot.last_used = clock;
            start_task(slot, job, spec_default, n_vocab);
        }
    }

    /// Ends requests whose client has gone or whose deadline has passed.
    fn reap(&mut self) {
        let now = Instant::now();
        for slot in &mut self.slots {
            let Some(t) = &slot.task else { continue };
            let gone = t.job.events.is_closed();
            let late = now >= t.job.deadline;
            if !(gone || late) {
                continue;
            }
            let t = slot.task.take().expect("checked");
            if late && !gone {
                let _ = t.job.events.send(Event::Error(
                    504,
                    "the request took longer than the server's --timeout; raise --timeout or ask for fewer tokens (max_tokens)".into(),
                ));
            }
            tracing::info!(
                id = %t.job.id,
                slot = slot.id,
                generated = t.n_generated,
                reason = if gone { "client disconnected" } else { "timeout" },
                "request cancelled"
            );
            release(slot, &t);
            self.metrics.with(|c| c.requests_cancelled += 1);
        }
    }

    /// Plans this step's prompt rows: the next chunk of every slot still reading its prompt,
    /// all chunks together at most `n_batch` rows. A slot with nothing left to read (its
    /// prompt was cached, or is one token) starts generating in this step.
    fn plan_prefill(&mut self) {
        let mut budget = self.engine.n_batch.max(1);
        for slot in &mut self.slots {
            let Some(t) = &mut slot.task else { continue };
            let Phase::Prefill { next } = t.phase else {
                continue;
            };
            let head_len = t.job.prompt.len() - 1;
            let end = (next + budget).min(head_len);
            budget -= end - next;
            t.prefill_end = end;
            if next == head_len {
                finish_prefill(slot);
            }
        }
    }

    /// One batched forward over every busy slot (prompt chunks and generation rows), then
    /// verification and streaming.
    #[allow(clippy::too_many_lines, reason = "one engine step, in order")]
    fn decode_step(&mut self) {
        let n_vocab = self.engine.model.hparams().n_vocab;
        // Drafts.
        let mut n_busy = 0u64;
        for slot in &mut self.slots {
            let Some(t) = &mut slot.task else { continue };
            if t.phase != Phase::Decode {
                continue;
            }
            n_busy += 1;
            if t.decode_start.is_none() {
                t.decode_start = Some(Instant::now());
            }
            let anchor = *t.history.last().expect("a prompt has a token");
            t.batch.clear();
            t.batch.push(anchor);
            t.draft_s = 0.0;
            t.caught_up = 0;
            let Some(d) = slot.drafter.as_mut().filter(|_| t.spec_on) else {
                continue;
            };
            let left = t.job.n_predict - t.n_generated;
            let room = (slot.session.n_ctx() - slot.session.n_past() - 1).min(left - 1);
            let k = if t.spec.adaptive {
                t.policy.next(room)
            } else {
                t.spec.n_max.min(room)
            };
            if k == 0 {
                continue;
            }
            let td = Instant::now();
            let draft = d.draft(&DraftParams {
                history: &t.history,
                n_max: k,
                p_min: t.spec.p_min,
            });
            t.draft_s = td.elapsed().as_secs_f64();
            t.caught_up = std::mem::replace(&mut t.since_draft, 0);
            match draft {
                Ok(mut draft) => {
                    draft.truncate(k);
                    if draft.len() >= t.spec.n_min && draft.iter().all(|&x| (x as usize) < n_vocab)
                    {
                        t.batch.extend_from_slice(&draft);
                    }
                }
                Err(e) => {
                    fail(
                        slot,
                        500,
                        &format!("the drafter failed: {}", crate::chain(&e)),
                    );
                }
            }
        }
        let prefilling = self.slots.iter().any(|s| {
            s.task
                .as_ref()
                .is_some_and(|t| matches!(t.phase, Phase::Prefill { next } if t.prefill_end > next))
        });
        if n_busy == 0 && !prefilling {
            return;
        }
        // The batched forward.
        let mut bases = Vec::with_capacity(self.slots.len());
        // A memory that cannot trim comes back to its state before the verify.
        let mut checkpoints = Vec::with_capacity(self.slots.len());
        let tv = Instant::now();
        let result = {
            let mut entries: Vec<BatchEntry<'_, B>> = Vec::with_capacity(self.slots.len());
            for slot in &mut self.slots {
                let Slot {
                    session,
                    task,
                    taps,
                    features,
                    ..
                } = slot;
                let Some(t) = task else { continue };
                // Hidden states only for a slot whose drafter learns from them and drafts
                // for this request.
                let capture =
                    (t.spec_on && !taps.layers.is_empty()).then_some(Capture { taps, features });
                match t.phase {
                    // Prompt rows: their KV only, no logits.
                    Phase::Prefill { next } if t.prefill_end > next => {
                        let chunk = &t.job.prompt[next..t.prefill_end];
                        entries.push(BatchEntry {
                            session,
                            tokens: chunk,
                            logits_from: chunk.len(),
                            capture,
                        });
                    }
                    Phase::Prefill { .. } => {}
                    Phase::Decode => {
                        bases.push(session.n_past());
                        checkpoints.push(
                            (session.rollback() == Rollback::Replay).then(|| session.checkpoint()),
                        );
                        entries.push(BatchEntry {
                            session,
                            tokens: &t.batch,
                            logits_from: 0,
                            capture,
                        });
                    }
                }
            }
            if entries.is_empty() {
                return;
            }
            self.engine
                .decode_multi(&mut entries, &mut self.scratch, &mut self.logits)
        };
        let verify_s = tv.elapsed().as_secs_f64();
        if n_busy > 0 {
            self.metrics.with(|c| {
                c.n_decode += 1;
                c.n_busy_slots += n_busy;
            });
        }
        if let Err(e) = result {
            for slot in &mut self.slots {
                if slot.task.is_some() {
                    fail(slot, 500, &format!("decoding failed: {}", crate::chain(&e)));
                    slot.session.reset();
                    slot.cached.clear();
                }
            }
            return;
        }
        // Verify, commit, stream.
        let mut off = 0;
        let mut bases = bases.into_iter();
        let mut checkpoints = checkpoints.into_iter();
        let engine = &self.engine;
        let tokenizer = &engine.tokenizer;
        for slot in &mut self.slots {
            let Some(t) = &mut slot.task else { continue };
            if t.phase != Phase::Decode {
                continue;
            }
            let base = bases.next().expect("one base per entry");
            let ck = checkpoints.next().expect("one checkpoint per entry");
            let n_rows = t.batch.len();
            let rows = &self.logits[off * n_vocab..(off + n_rows) * n_vocab];
            off += n_rows;
            let draft = &t.batch[1..];
            let verdict = match sample_and_match(&mut t.sampler, rows, n_vocab, draft) {
                Ok(v) => v,
                Err(e) => {
                    fail(slot, 500, &format!("sampling failed: {}", crate::chain(&e)));
                    continue;
                }
            };
            if let Some(d) = slot.drafter.as_mut().filter(|_| t.spec_on) {
                // The drafter's share of the round after the forward (feature injection, its
                // deferred part on acceptance) is drafting cost, as in `generate_speculative`.
                let td = Instant::now();
                let fed = if slot.taps.layers.is_empty() {
                    d.process(&t.batch, base)
                } else {
                    d.process_features(&t.batch, base, &slot.features)
                };
                if let Err(e) = fed {
                    fail(
                        slot,
                        500,
                        &format!("the drafter failed: {}", crate::chain(&e)),
                    );
                    continue;
                }
                if !draft.is_empty() {
                    d.accept(verdict.accepted);
                }
                let draft_s = t.draft_s + td.elapsed().as_secs_f64();
                t.stats.record(draft.len(), verdict.accepted);
                t.policy.record(
                    draft.len(),
                    verdict.accepted,
                    verify_s,
                    draft_s,
                    t.caught_up,
                );
            }
            // The cache keeps the anchor and the accepted drafts.
            let keep = 1 + verdict.accepted;
            let mut rewound = engine.rewind(
                &mut slot.session,
                base + keep,
                ck.as_ref(),
                &t.batch[..keep],
            );
            if let Err(EngineError::Rewind { .. }) = rewound {
                // A sliding-window ring that a verify of more rows than one forward writes has
                // overwritten: the replay starts before this round, from the history.
                let mut tail = t.history.clone();
                tail.extend_from_slice(&t.batch[1..keep]);
                rewound = engine.rewind(&mut slot.session, base + keep, ck.as_ref(), &tail);
            }
            match rewound {
                Ok(Rewound::Replayed(rows)) => t.stats.record_replay(rows),
                Ok(Rewound::Nothing | Rewound::Trimmed) => {}
                Err(e) => {
                    fail(
                        slot,
                        500,
                        &format!(
                            "rolling back the rejected draft failed: {}",
                            crate::chain(&e)
                        ),
                    );
                    continue;
                }
            }
            t.since_draft += 1;
            let mut finish: Option<&'static str> = None;
            for (i, &id) in verdict.tokens.iter().enumerate() {
                t.history.push(id);
                t.n_generated += 1;
                let row = &rows[i * n_vocab..(i + 1) * n_vocab];
                let logprob = t
                    .job
                    .logprobs
                    .map(|n| token_logprob(tokenizer, row, id, n, &mut t.candidates, &mut t.top));
                let eog = !t.job.ignore_eos && tokenizer.is_eog(id);
                let stopped = !eog && t.text.push(tokenizer.token_to_piece(id, false));
                let text = t.text.take_ready();
                let _ = t.job.events.send(Event::Delta(Delta {
                    text,
                    token: id,
                    logprob,
                }));
                if eog || stopped {
                    finish = Some("stop");
                    break;
                }
                if t.n_generated >= t.job.n_predict {
                    finish = Some("length");
                    break;
                }
            }
            if let Some(reason) = finish {
                let t = slot.task.take().expect("a task");
                finish_task(slot, t, reason, &self.metrics);
            }
        }
        // Prompt rows: the drafter sees them, the slot advances, and starts generating after
        // the last chunk.
        for slot in &mut self.slots {
            let Some(t) = &mut slot.task else { continue };
            if let Phase::Prefill { next } = t.phase
                && t.prefill_end > next
            {
                if let Some(d) = slot.drafter.as_mut().filter(|_| t.spec_on) {
                    let chunk = &t.job.prompt[next..t.prefill_end];
                    let fed = if slot.taps.layers.is_empty() {
                        d.process(chunk, next)
                    } else {
                        d.process_features(chunk, next, &slot.features)
                    };
                    if let Err(e) = fed {
                        fail(
                            slot,
                            500,
                            &format!("the drafter failed: {}", crate::chain(&e)),
                        );
                        continue;
                    }
                }
                t.phase = Phase::Prefill {
                    next: t.prefill_end,
                };
                if t.prefill_end == t.job.prompt.len() - 1 {
                    finish_prefill(slot);
                }
            }
        }
    }
}

/// The prompt is in the cache (all but the anchor), and the drafter has seen it chunk by
/// chunk: the slot generates from the next step.
fn finish_prefill<B: Backend>(slot: &mut Slot<B>) {
    let Some(t) = &mut slot.task else { return };
    t.phase = Phase::Decode;
    t.prompt_s = t.assigned.elapsed().as_secs_f64();
}

/// The log-probability of `id` under the raw logits `row` and the `n` most likely tokens.
fn token_logprob(
    tok: &specula_tokenizer::Tokenizer,
    row: &[f32],
    id: u32,
    n: usize,
    scratch: &mut Candidates,
    top: &mut Vec<(u32, f32)>,
) -> TokenLogprob {
    let lse = steps::log_sum_exp(row).unwrap_or(0.0);
    let lp = row.get(id as usize).map_or(f32::NEG_INFINITY, |&x| x - lse);
    steps::top_logprobs(row, n, scratch, top);
    let piece = |t: u32| {
        let b = tok.token_to_piece(t, false).to_vec();
        (String::from_utf8_lossy(&b).into_owned(), b)
    };
    let (token, bytes) = piece(id);
    TokenLogprob {
        token,
        bytes,
        logprob: lp,
        top: top
            .iter()
            .map(|&(t, l)| {
                let (s, b) = piece(t);
                (s, b, l)
            })
            .collect(),
    }
}

/// Sets up a slot for a job: keeps the cache's prefix shared with the prompt, makes the
/// sampler (the prompt in its penalty window) and the speculative state. A job that cannot
/// run is answered with its error.
fn start_task<B: Backend>(
    slot: &mut Slot<B>,
    job: Job,
    spec_default: Option<SpecOptions>,
    n_vocab: usize,
) {
    let refuse = |job: Job, status: u16, msg: String| {
        let _ = job.events.send(Event::Error(status, msg));
    };
    let n_ctx = slot.session.n_ctx();
    if job.prompt.is_empty() || job.prompt.len() + job.n_predict > n_ctx {
        let msg = format!(
            "the request needs {} positions ({} prompt tokens + {} to generate) but a slot holds {n_ctx}; shorten the prompt, lower max_tokens, or start the server with a larger -c (or fewer slots, -np)",
            job.prompt.len() + job.n_predict,
            job.prompt.len(),
            job.n_predict
        );
        return refuse(job, 400, msg);
    }
    if let Some(&bad) = job.prompt.iter().find(|&&id| id as usize >= n_vocab) {
        return refuse(
            job,
            400,
            format!("token id {bad} is outside the vocabulary of {n_vocab} tokens"),
        );
    }
    let mut sampler = match Sampler::new(job.sampler, n_vocab) {
        Ok(s) => s,
        Err(e) => {
            return refuse(
                job,
                400,
                format!("bad sampling parameter: {}", crate::chain(&e)),
            );
        }
    };
    for &id in &job.prompt {
        if let Err(e) = sampler.accept(id) {
            return refuse(job, 400, format!("bad prompt token: {}", crate::chain(&e)));
        }
    }
    // Keep the cached prefix; the anchor (last prompt token) always runs in the first step.
    let mut common = slot
        .cached
        .iter()
        .zip(&job.prompt)
        .take_while(|(a, b)| a == b)
        .count()
        .min(job.prompt.len() - 1);
    // A memory that cannot trim starts over: the whole prompt runs again (llama-server's
    // full re-processing when the cache cannot take back a suffix).
    if !slot.session.can_trim_to(common) {
        common = 0;
    }
    let mut spec = spec_default.unwrap_or_default();
    if let Some(n) = job.spec.n_max {
        spec.n_max = n;
    }
    if let Some(n) = job.spec.n_min {
        spec.n_min = n;
    }
    if let Some(p) = job.spec.p_min {
        spec.p_min = p;
    }
    if let Some(cap) = slot.drafter.as_ref().and_then(|d| d.max_draft()) {
        spec.n_max = spec.n_max.min(cap);
    }
    let spec_on = spec_default.is_some() && slot.drafter.is_some() && spec.n_max > 0;
    // The drafter starts on the prompt with its context cut to exactly the reused positions
    // (a feature drafter that sat out the request which wrote some of them holds fewer: the
    // target runs those again, so that the drafter sees them); the prompt chunks that follow
    // bring it the rest, as on a cold cache.
    // The prompt's time starts here: a draft model's prefill of the prompt is part of it.
    let assigned = Instant::now();
    if let Some(d) = slot.drafter.as_mut().filter(|_| spec_on) {
        match d.begin_reusing(&job.prompt, common) {
            Ok(held) => common = common.min(held),
            Err(e) => {
                return refuse(
                    job,
                    500,
                    format!("the drafter failed: {}", crate::chain(&e)),
                );
            }
        }
    }
    // The drafter may hold fewer positions than the target could keep; a sliding-window ring
    // may not trim that far back exactly.
    if !slot.session.can_trim_to(common) {
        common = 0;
    }
    if common == 0 {
        slot.session.reset();
    } else {
        slot.session.truncate(common);
    }
    slot.cached.truncate(common);
    let self_limiting =
        spec.p_min > 0.0 && slot.drafter.as_ref().is_some_and(|d| d.stops_when_unsure());
    let stop = job.stop.clone();
    slot.task = Some(Task {
        phase: Phase::Prefill { next: common },
        sampler,
        history: job.prompt.clone(),
        n_generated: 0,
        cached: common,
        text: TextStream::new(stop),
        spec_on,
        policy: Adaptive::new(spec.n_max).self_limiting(self_limiting),
        spec,
        stats: SpecStats::default(),
        since_draft: 1,
        batch: Vec::new(),
        draft_s: 0.0,
        caught_up: 0,
        prompt_s: 0.0,
        assigned,
        prefill_end: common,
        decode_start: None,
        candidates: Candidates::new(),
        top: Vec::new(),
        job,
    });
}

/// Forgets a finished task's rows past its history and records what the cache holds.
fn release<B: Backend>(slot: &mut Slot<B>, t: &Task) {
    let mut keep = slot.session.n_past().min(t.history.len());
    if slot.session.can_trim_to(keep) {
        slot.session.truncate(keep);
    } else {
        slot.session.reset();
        keep = 0;
    }
    slot.cached.clear();
    slot.cached.extend_from_slice(&t.history[..keep]);
}

/// Ends a slot's task with an error.
fn fail<B: Backend>(slot: &mut Slot<B>, status: u16, msg: &str) {
    if let Some(t) = slot.task.take() {
        tracing::warn!(id = %t.job.id, slot = slot.id, "{msg}");
        let _ = t.job.events.send(Event::Error(status, msg.to_owned()));
        release(slot, &t);
    }
}

fn finish_task<B: Backend>(
    slot: &mut Slot<B>,
    mut t: Task,
    reason: &'static str,
    metrics: &Metrics,
) {
    let tail = t.text.finish();
    let predicted_s = t.decode_start.map_or(0.0, |s| s.elapsed().as_secs_f64());
    let prompt_n = t.job.prompt.len() - t.cached;
    // A server with a drafter reports its counters (zero when the request turned it off).
    let spec = slot.drafter.is_some().then(|| t.stats.clone());
    metrics.with(|c| {
        c.prompt_tokens += prompt_n as u64;
        c.prompt_tokens_cached += t.cached as u64;
        c.prompt_seconds += t.prompt_s;
        c.tokens_predicted += t.n_generated as u64;
        c.predicted_seconds += predicted_s;
        c.n_tokens_max = c.n_tokens_max.max(t.history.len() as u64);
        if let Some(s) = &spec {
            add_spec(&mut c.spec, s);
        }
    });
    #[allow(clippy::cast_precision_loss, reason = "token counts for a rate")]
    let tps = if predicted_s > 0.0 {
        t.n_generated as f64 / predicted_s
    } else {
        0.0
    };
    let tps = format!("{tps:.2}");
    match &spec {
        Some(sp) => tracing::info!(
            id = %t.job.id,
            slot = slot.id,
            prompt = t.job.prompt.len(),
            cached = t.cached,
            generated = t.n_generated,
            tokens_per_second = tps,
            draft_n = sp.drafted,
            draft_n_accepted = sp.accepted,
            finish = reason,
            "request done"
        ),
        None => tracing::info!(
            id = %t.job.id,
            slot = slot.id,
            prompt = t.job.prompt.len(),
            cached = t.cached,
            generated = t.n_generated,
            tokens_per_second = tps,
            finish = reason,
            "request done"
        ),
    }
    let summary = Summary {
        finish_reason: reason,
        tail,
        prompt_tokens: t.job.prompt.len(),
        cached_tokens: t.cached,
        completion_tokens: t.n_generated,
        prompt_ms: t.prompt_s * 1e3,
        predicted_ms: predicted_s * 1e3,
        spec,
        slot: slot.id,
    };
    let _ = t.job.events.send(Event::Done(Box::new(summary)));
    release(slot, &t);
}
