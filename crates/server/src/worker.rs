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
use specula_engine::{
    BatchEntry, Capture, Engine, EngineError, PlanEntry, Readout, Rollback, RoundCost, SpecOptions,
    SpecSeq, plan,
};
use specula_models::{Scratch, Taps};
use specula_quant::QType;
use specula_sampling::{Candidates, Sampler, SamplerParams, steps};
use specula_spec::verify::{match_argmax, sample_and_match};
use specula_spec::{BatchDrafter, Drafter, Features, PerSeq, SeqFeed, SpecError, SpecStats};
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
    /// Save, restore or erase a slot (run when the slot is free).
    Slot(Box<crate::slots::SlotRequest>),
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
    /// The grammar the output follows (structured output), at the start of the output.
    pub constraint: Option<Box<specula_grammar::Constraint>>,
    /// Added to the logits before sampling (`logit_bias`; −∞ bans a token).
    pub logit_bias: Vec<(u32, f32)>,
    /// The slot the request must run in (llama-server's `id_slot`); any free one when `None`.
    pub slot: Option<usize>,
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
    /// The stop string that ended the generation (empty when none did).
    pub stopping_word: String,
    /// What the grammar masks cost (constrained requests).
    pub grammar: Option<crate::structured::MaskCost>,
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
    /// The speculative state and this step's round; its history is the prompt and the
    /// generated tokens, the last one the anchor the cache does not hold yet.
    seq: SpecSeq,
    n_generated: usize,
    cached: usize,
    text: TextStream,
    prompt_s: f64,
    /// When the slot took the job (prompt time runs from here to the end of the prefill).
    assigned: Instant,
    /// This step's prompt rows end here (`Prefill { next }` to `prefill_end`).
    prefill_end: usize,
    decode_start: Option<Instant>,
    candidates: Candidates,
    top: Vec<(u32, f32)>,
    /// The round's logits rows after `logit_bias` and the grammar mask (constrained jobs).
    masked: Vec<f32>,
}

impl Task {
    /// Whether the task's tokens follow from its rows' argmaxes alone: greedy with no
    /// penalty, no probabilities reported, no logit bias and no grammar. A batch of such
    /// tasks downloads one id per verify row and no logits.
    fn reads_argmax(&self) -> bool {
        self.sampler.params().is_argmax()
            && self.job.logprobs.is_none()
            && self.job.logit_bias.is_empty()
            && self.job.constraint.is_none()
    }
}

struct Slot<B: Backend> {
    id: usize,
    session: specula_engine::Session<B>,
    /// The tokens the cache holds, for prefix reuse.
    cached: Vec<u32>,
    /// The target hidden states the drafter learns from (none: a drafter that follows the
    /// tokens alone, and no capture in the batched forward).
    taps: Taps,
    /// This step's captured rows of the slot, `[rows, taps · n_embd]`.
    features: Vec<f32>,
    /// The same rows left on the backend, when the drafter reads them there
    /// ([`BatchDrafter::takes_device_features`]); `features` then stays empty.
    device: Option<B::Tensor>,
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
    /// One drafter per slot (sequence `i` is slot `i`), every sequence in each call.
    drafter: Option<PerSeq>,
    /// Makes a slot a fresh drafter after a fault.
    factory: Option<crate::DrafterFactory>,
    rollback: Rollback,
    scratch: Scratch<B>,
    /// The batched forward's logits rows, or only their argmaxes when every generating slot
    /// decodes greedily ([`Task::reads_argmax`]).
    readout: Readout,
    /// This step's features of all slots, `[rows, taps · n_embd]`.
    features: Vec<f32>,
    /// The same on the backend, when the drafter reads them there.
    device_features: Option<B::Tensor>,
    drafts: Vec<Result<Vec<u32>, SpecError>>,
    fed: Vec<Result<(), SpecError>>,
    clock: u64,
    /// Slot actions waiting for their slot to be free.
    slot_actions: Vec<crate::slots::SlotRequest>,
    /// The model's fingerprint in slot files (computed at the first slot action).
    fingerprint: Option<u64>,
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
        let mut drafters: Vec<Box<dyn Drafter>> = Vec::new();
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
            let device = drafter
                .as_ref()
                .is_some_and(|d| !d.target_taps().is_empty() && d.takes_device_features())
                .then(|| engine.backend.zeros(0, 0));
            drafters.extend(drafter);
            slots.push(Slot {
                id,
                session,
                cached: Vec::new(),
                taps,
                features: Vec::new(),
                device,
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
                Rollback::Snapshot => "recurrent snapshots selected, replay past them",
            }
        );
        let drafter = match spec {
            Some(_) => Some(PerSeq::new(drafters).map_err(crate::ServerError::SlotDrafters)?),
            None => None,
        };
        let (spec, factory) = spec.map_or((None, None), |(s, f)| (Some(s), Some(f)));
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
            drafter,
            factory,
            rollback,
            scratch,
            readout: Readout::default(),
            features: Vec::new(),
            device_features: None,
            drafts: Vec::new(),
            fed: Vec::new(),
            clock: 0,
            slot_actions: Vec::new(),
            fingerprint: None,
        })
    }

    /// How the slots' caches take back rejected draft rows.
    pub(crate) fn rollback(&self) -> Rollback {
        self.rollback
    }

    fn busy(&self) -> bool {
        !self.queue.is_empty()
            || !self.slot_actions.is_empty()
            || self.slots.iter().any(|s| s.task.is_some())
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
            Command::Slot(req) => {
                self.slot_actions.push(*req);
                self.slot_actions_run();
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
            // Faults of one slot are caught where they happen and fail that slot; a panic
            // anywhere else in a step fails every busy slot, and the engine goes on.
            let step = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                self.slot_actions_run();
                self.assign();
                self.reap();
                self.plan_prefill();
                self.decode_step();
            }));
            if let Err(p) = step {
                let msg = format!(
                    "the engine step panicked: {}",
                    specula_spec::batch::panic_message(p.as_ref())
                );
                for i in 0..self.slots.len() {
                    if self.slots[i].task.is_some() {
                        self.fault(i, &msg);
                    }
                }
            }
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
                        "n_max": task.map_or(sp.options.n_max, |t| t.seq.options().n_max),
                        "n_min": sp.options.n_min,
                        "p_min": sp.options.p_min,
                        "adaptive": sp.options.adaptive,
                        "enabled": task.is_none_or(|t| t.seq.drafting()),
                        "draft_n": task.map_or(0, |t| t.seq.stats().drafted),
                        "draft_n_accepted": task.map_or(0, |t| t.seq.stats().accepted),
                    })),
                })
            })
            .collect();
        serde_json::Value::Array(slots)
    }

    /// Runs the slot actions whose slot is free, in arrival order (the others wait, as
    /// llama-server defers them). As llama-server's `get_slot_by_id`, an id past the slots
    /// wraps around (`id % n_slots`); a negative one is answered "Invalid slot ID" at once.
    fn slot_actions_run(&mut self) {
        let mut i = 0;
        while i < self.slot_actions.len() {
            let id = self.slot_actions[i].id;
            let n = i64::try_from(self.slots.len()).unwrap_or(i64::MAX);
            let slot = usize::try_from(id % n).ok();
            if slot.is_some_and(|s| self.slots[s].task.is_some())
                && !self.slot_actions[i].reply.is_closed()
            {
                i += 1;
                continue;
            }
            let req = self.slot_actions.remove(i);
            let Some(s) = slot else {
                let _ = req
                    .reply
                    .send(Err(crate::http::ApiError::bad("Invalid slot ID")));
                continue;
            };
            if req.reply.is_closed() {
                continue;
            }
            let fingerprint = *self
                .fingerprint
                .get_or_insert_with(|| crate::slots::fingerprint(&self.engine));
            let slot = &mut self.slots[s];
            let r = crate::slots::perform(
                id,
                req.action,
                crate::slots::SlotParts {
                    engine: &self.engine,
                    session: &mut slot.session,
                    cached: &mut slot.cached,
                    fingerprint,
                },
            );
            let _ = req.reply.send(r);
        }
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
                .filter(|(i, s)| s.task.is_none() && job.slot.is_none_or(|w| w == *i))
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
            if let Err(msg) = start_task(slot, self.drafter.as_mut(), job, spec_default, n_vocab) {
                self.fault(i, &msg);
            }
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
    /// verification and streaming. A fault of one slot — its drafter's error or panic, its
    /// sampling, its rollback, its entry of the forward — fails that slot's request alone
    /// ([`Worker::fault`]); the others go on.
    #[allow(clippy::too_many_lines, reason = "one engine step, in order")]
    fn decode_step(&mut self) {
        let n_vocab = self.engine.model.hparams().n_vocab;
        // Plan the generating slots' rounds: one drafter call drafts for all of them.
        let mut n_busy = 0u64;
        let mut faults: Vec<(usize, String)> = Vec::new();
        {
            let mut idx = Vec::with_capacity(self.slots.len());
            let mut entries = Vec::with_capacity(self.slots.len());
            for (i, slot) in self.slots.iter_mut().enumerate() {
                let Some(t) = &mut slot.task else { continue };
                if t.phase != Phase::Decode {
                    continue;
                }
                n_busy += 1;
                if t.decode_start.is_none() {
                    t.decode_start = Some(Instant::now());
                }
                idx.push(i);
                entries.push(PlanEntry {
                    seq: &mut t.seq,
                    session: &slot.session,
                    lead: 0,
                    left: t.job.n_predict - t.n_generated,
                });
            }
            let drafter = self.drafter.as_mut().map(|d| d as &mut dyn BatchDrafter);
            for (j, e) in plan(&mut entries, drafter, n_vocab, &mut self.drafts) {
                faults.push((idx[j], format!("the drafter failed: {}", crate::chain(&e))));
            }
        }
        // A constrained slot's draft ends before its first token the grammar rejects, so
        // the verify batch carries only drafts the constrained target could accept.
        for slot in &mut self.slots {
            if let Some(t) = &mut slot.task
                && t.phase == Phase::Decode
                && let Some(c) = t.job.constraint.as_mut()
                && !t.seq.draft().is_empty()
            {
                let n = c.valid_prefix(t.seq.draft());
                t.seq.cut_draft(n);
            }
        }
        for (i, msg) in faults.drain(..) {
            self.fault(i, &msg);
        }
        let prefilling = self.slots.iter().any(|s| {
            s.task
                .as_ref()
                .is_some_and(|t| matches!(t.phase, Phase::Prefill { next } if t.prefill_end > next))
        });
        if n_busy == 0 && !prefilling {
            return;
        }
        // The batched forward; an entry that fails alone fails its slot. When every slot
        // with logits rows decodes greedily, the forward reads out only their argmaxes.
        let argmax = n_busy > 0
            && self.slots.iter().all(|s| {
                s.task
                    .as_ref()
                    .is_none_or(|t| t.phase != Phase::Decode || t.reads_argmax())
            });
        let tv = Instant::now();
        // The slot of each entry, and where its logits rows start (`None`: it failed).
        let mut order = Vec::with_capacity(self.slots.len());
        let mut failed = Vec::new();
        {
            let mut entries: Vec<BatchEntry<'_, B>> = Vec::with_capacity(self.slots.len());
            for (i, slot) in self.slots.iter_mut().enumerate() {
                let Slot {
                    session,
                    task,
                    taps,
                    features,
                    device,
                    ..
                } = slot;
                let Some(t) = task else { continue };
                // Hidden states only for a slot whose drafter learns from them and drafts
                // for this request.
                let capture = (t.seq.drafting() && !taps.layers.is_empty()).then_some(Capture {
                    taps,
                    features,
                    device: device.as_mut(),
                });
                let (tokens, logits_from) = match t.phase {
                    // Prompt rows: their KV only, no logits.
                    Phase::Prefill { next } if t.prefill_end > next => {
                        let chunk = &t.job.prompt[next..t.prefill_end];
                        (chunk, chunk.len())
                    }
                    Phase::Prefill { .. } => continue,
                    Phase::Decode => (t.seq.rows(), 0),
                };
                order.push((i, tokens.len() - logits_from));
                entries.push(BatchEntry {
                    session,
                    tokens,
                    logits_from,
                    capture,
                });
            }
            if entries.is_empty() {
                return;
            }
            self.scratch.set_argmax(argmax);
            self.engine.decode_multi_isolated(
                &mut entries,
                &mut self.scratch,
                &mut self.readout,
                &mut failed,
            );
            self.scratch.set_argmax(false);
        }
        let verify_s = tv.elapsed().as_secs_f64();
        if n_busy > 0 {
            self.metrics.with(|c| {
                c.n_decode += 1;
                c.n_busy_slots += n_busy;
            });
        }
        let mut starts: Vec<Option<usize>> = vec![Some(0); order.len()];
        for (j, e) in failed.drain(..) {
            starts[j] = None;
            faults.push((order[j].0, format!("decoding failed: {}", crate::chain(&e))));
        }
        let mut off = 0;
        for (start, &(_, n_rows)) in starts.iter_mut().zip(&order) {
            if let Some(s) = start {
                *s = off;
                off += n_rows;
            }
        }
        for (i, msg) in faults.drain(..) {
            self.fault(i, &msg);
        }
        // The drafter takes in every drafting slot's rows (prompt chunks and verify batches),
        // their features as rows of one batch.
        let mut in_drafter_s = 0.0;
        if let Some(d) = self.drafter.as_mut() {
            self.features.clear();
            let mut feeds = Vec::with_capacity(order.len());
            let mut n_rows = 0;
            // Slots whose features stay on the backend: (slot, first row in the batch).
            let mut on_device = Vec::new();
            for (&(i, _), start) in order.iter().zip(&starts) {
                let slot = &self.slots[i];
                let Some(t) = slot.task.as_ref().filter(|t| t.seq.drafting()) else {
                    continue;
                };
                if start.is_none() {
                    continue;
                }
                let mut feed = match t.phase {
                    Phase::Prefill { next } => SeqFeed {
                        seq: slot.id,
                        tokens: &t.job.prompt[next..t.prefill_end],
                        pos0: next,
                        rows: 0..0,
                    },
                    Phase::Decode => t.seq.feed(0..0),
                };
                if !slot.taps.layers.is_empty() {
                    feed.rows = n_rows..n_rows + feed.tokens.len();
                    if slot.device.is_some() {
                        on_device.push((i, n_rows));
                    } else {
                        self.features.extend_from_slice(&slot.features);
                    }
                    n_rows += feed.tokens.len();
                }
                feeds.push(feed);
            }
            // Every drafter of the batch reads its features on the backend, or none does
            // (one kind of drafter serves every slot): the slots' rows go into one tensor.
            let be = &self.engine.backend;
            let features = if on_device.is_empty() {
                Features::Host(&self.features)
            } else {
                let batch = self.device_features.get_or_insert_with(|| be.zeros(0, 0));
                let width = self.slots[on_device[0].0].taps.layers.len()
                    * self.engine.model.hparams().n_embd;
                be.resize(batch, n_rows, width);
                for &(i, at) in &on_device {
                    if let Some(t) = &self.slots[i].device {
                        let (rows, _) = be.shape(t);
                        be.put_rows(t, &be.index_range(at..at + rows), batch);
                    }
                }
                Features::Device(batch)
            };
            if !feeds.is_empty() {
                let td = Instant::now();
                d.process(&feeds, features, &mut self.fed);
                in_drafter_s = td.elapsed().as_secs_f64();
                for (f, r) in feeds.iter().zip(self.fed.drain(..)) {
                    if let Err(e) = r {
                        faults.push((f.seq, format!("the drafter failed: {}", crate::chain(&e))));
                    }
                }
            }
        }
        for (i, msg) in faults.drain(..) {
            self.fault(i, &msg);
        }
        // Verify, commit, stream; then the prompt rows: the slot advances, and starts
        // generating after the last chunk.
        let cost = RoundCost {
            verify_s,
            in_drafter_s,
        };
        for (&(i, n_rows), start) in order.iter().zip(&starts) {
            let Some(start) = *start else { continue };
            let slot = &mut self.slots[i];
            let Some(t) = &mut slot.task else { continue };
            if let Phase::Prefill { .. } = t.phase {
                t.phase = Phase::Prefill {
                    next: t.prefill_end,
                };
                if t.prefill_end == t.job.prompt.len() - 1 {
                    finish_prefill(slot);
                }
                continue;
            }
            let rows = if argmax {
                Rows::Ids(&self.readout.ids[start..start + n_rows])
            } else {
                Rows::Logits(&self.readout.logits[start * n_vocab..(start + n_rows) * n_vocab])
            };
            let drafter = self.drafter.as_mut().map(|d| d as &mut dyn BatchDrafter);
            let metrics = &self.metrics;
            let engine = &self.engine;
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                commit_slot(engine, slot, drafter, rows, cost, metrics)
            }))
            .unwrap_or_else(|p| {
                Err(format!(
                    "decoding panicked: {}",
                    specula_spec::batch::panic_message(p.as_ref())
                ))
            });
            if let Err(msg) = r {
                self.fault(i, &msg);
            }
        }
    }

    /// Fails slot `i`'s request with a 500 naming the cause, and resets what it holds — its
    /// cache, its drafter (a fresh one from the factory) — so that nothing half-updated is
    /// used again; the slot takes the next request.
    fn fault(&mut self, i: usize, msg: &str) {
        let slot = &mut self.slots[i];
        if let Some(t) = slot.task.take() {
            tracing::error!(id = %t.job.id, slot = slot.id, "request failed: {msg}");
            let _ = t.job.events.send(Event::Error(500, msg.to_owned()));
        }
        slot.session.reset();
        slot.cached.clear();
        slot.features.clear();
        if let (Some(d), Some(f)) = (self.drafter.as_mut(), self.factory.as_mut()) {
            match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
                Ok(Ok(fresh)) => d.replace(i, fresh),
                Ok(Err(e)) => {
                    tracing::error!(slot = i, "cannot remake the slot's drafter: {e}");
                }
                Err(_) => tracing::error!(slot = i, "remaking the slot's drafter panicked"),
            }
        }
    }
}

/// Verifies and commits a generating slot's round ([`SpecSeq::commit`]) and streams the
/// tokens; ends the task when it stops.
/// A generating slot's verify rows as the batched forward read them out.
#[derive(Clone, Copy)]
enum Rows<'a> {
    /// `n × n_vocab` logits.
    Logits(&'a [f32]),
    /// Each row's argmax (every slot decodes greedily: [`Task::reads_argmax`]).
    Ids(&'a [u32]),
}

fn commit_slot<B: Backend>(
    engine: &Engine<B>,
    slot: &mut Slot<B>,
    drafter: Option<&mut dyn BatchDrafter>,
    rows: Rows<'_>,
    cost: RoundCost,
    metrics: &Metrics,
) -> Result<(), String> {
    let n_vocab = engine.model.hparams().n_vocab;
    let tokenizer = &engine.tokenizer;
    // A server with a drafter reports its counters (zero when the request turned it off).
    let has_drafter = drafter.is_some();
    let Some(t) = &mut slot.task else {
        return Ok(());
    };
    // Logit biases, then the grammar: row `i` masked with the matcher state after the
    // anchor and `draft[..i]`, so the verifier sees what constrained plain decoding sees.
    let constrained = t.job.constraint.is_some() || !t.job.logit_bias.is_empty();
    let (rows, ids) = match rows {
        Rows::Logits(r) => (r, None),
        Rows::Ids(ids) => (&[][..], Some(ids)),
    };
    if constrained && ids.is_none() {
        t.masked.clear();
        t.masked.extend_from_slice(rows);
        for row in t.masked.chunks_exact_mut(n_vocab) {
            crate::structured::apply_bias(&t.job.logit_bias, row);
        }
        if let Some(c) = t.job.constraint.as_mut() {
            c.mask_rows(&mut t.masked, n_vocab, t.seq.draft())
                .map_err(|e| e.to_string())?;
        }
    }
    let sampled: &[f32] = if constrained { &t.masked } else { rows };
    let verdict = t
        .seq
        .commit(
            engine,
            &mut slot.session,
            drafter,
            sampled,
            |rows, draft| match ids {
                Some(ids) => match_argmax(&mut t.sampler, ids, draft),
                None => sample_and_match(&mut t.sampler, rows, n_vocab, draft),
            },
            cost,
        )
        .map_err(|e| match e {
            EngineError::Spec(
                SpecError::Sampling(_) | SpecError::Rows { .. } | SpecError::Distributions { .. },
            ) => format!("sampling failed: {}", crate::chain(&e)),
            EngineError::Spec(_) => format!("the drafter failed: {}", crate::chain(&e)),
            e => format!(
                "rolling back the rejected draft failed: {}",
                crate::chain(&e)
            ),
        })?;
    let mut finish: Option<&'static str> = None;
    for (i, &id) in verdict.tokens.iter().enumerate() {
        t.n_generated += 1;
        let logprob = t.job.logprobs.and_then(|n| {
            let row = rows.get(i * n_vocab..(i + 1) * n_vocab)?;
            Some(token_logprob(
                tokenizer,
                row,
                id,
                n,
                &mut t.candidates,
                &mut t.top,
            ))
        });
        if let Some(c) = t.job.constraint.as_mut() {
            c.accept(&[id]).map_err(|e| e.to_string())?;
        }
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
        finish_task(slot, t, reason, metrics, has_drafter);
    }
    Ok(())
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
/// A drafter's failure in `begin` answers the job with a 500 naming it and comes back as
/// `Err` (why) for the caller to reset the slot ([`Worker::fault`]).
fn start_task<B: Backend>(
    slot: &mut Slot<B>,
    mut drafter: Option<&mut PerSeq>,
    job: Job,
    spec_default: Option<SpecOptions>,
    n_vocab: usize,
) -> Result<(), String> {
    let refuse = |job: Job, status: u16, msg: String| {
        let _ = job.events.send(Event::Error(status, msg));
        Ok(())
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
    if let Some(cap) = drafter.as_ref().and_then(|d| d.max_draft()) {
        spec.n_max = spec.n_max.min(cap);
    }
    let spec_on = spec_default.is_some() && drafter.is_some() && spec.n_max > 0;
    // The drafter starts on the prompt with its context cut to exactly the reused positions
    // (a feature drafter that sat out the request which wrote some of them holds fewer: the
    // target runs those again, so that the drafter sees them); the prompt chunks that follow
    // bring it the rest, as on a cold cache.
    // The prompt's time starts here: a draft model's prefill of the prompt is part of it.
    let assigned = Instant::now();
    if let Some(d) = drafter.as_mut().filter(|_| spec_on) {
        match d.begin_reusing(slot.id, &job.prompt, common) {
            Ok(held) => common = common.min(held),
            Err(e) => {
                let msg = format!("the drafter failed: {}", crate::chain(&e));
                tracing::error!(id = %job.id, slot = slot.id, "request failed: {msg}");
                let _ = job.events.send(Event::Error(500, msg.clone()));
                return Err(msg);
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
    let stop = job.stop.clone();
    let drafter = drafter
        .filter(|_| spec_on)
        .map(|d| &*d as &dyn BatchDrafter);
    slot.task = Some(Task {
        phase: Phase::Prefill { next: common },
        sampler,
        seq: SpecSeq::new(slot.id, spec, drafter, &job.prompt),
        n_generated: 0,
        cached: common,
        text: TextStream::new(stop),
        prompt_s: 0.0,
        assigned,
        prefill_end: common,
        decode_start: None,
        candidates: Candidates::new(),
        top: Vec::new(),
        masked: Vec::new(),
        job,
    });
    Ok(())
}

/// Forgets a finished task's rows past its history and records what the cache holds.
fn release<B: Backend>(slot: &mut Slot<B>, t: &Task) {
    let history = t.seq.history();
    let mut keep = slot.session.n_past().min(history.len());
    if slot.session.can_trim_to(keep) {
        slot.session.truncate(keep);
    } else {
        slot.session.reset();
        keep = 0;
    }
    slot.cached.clear();
    slot.cached.extend_from_slice(&history[..keep]);
}

fn finish_task<B: Backend>(
    slot: &mut Slot<B>,
    mut t: Task,
    reason: &'static str,
    metrics: &Metrics,
    has_drafter: bool,
) {
    let tail = t.text.finish();
    let predicted_s = t.decode_start.map_or(0.0, |s| s.elapsed().as_secs_f64());
    let prompt_n = t.job.prompt.len() - t.cached;
    let spec = has_drafter.then(|| t.seq.stats().clone());
    metrics.with(|c| {
        c.prompt_tokens += prompt_n as u64;
        c.prompt_tokens_cached += t.cached as u64;
        c.prompt_seconds += t.prompt_s;
        c.tokens_predicted += t.n_generated as u64;
        c.predicted_seconds += predicted_s;
        c.n_tokens_max = c
            .n_tokens_max
            .max((t.job.prompt.len() + t.n_generated) as u64);
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
        stopping_word: t.text.stopping_word().unwrap_or_default().to_owned(),
        grammar: t
            .job
            .constraint
            .as_ref()
            .map(|c| crate::structured::MaskCost::of(c.mask_seconds())),
    };
    let _ = t.job.events.send(Event::Done(Box::new(summary)));
    release(slot, &t);
}
