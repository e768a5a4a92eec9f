//! The speculative decode loop of one generation (its rounds: [`crate::SpecSeq`]).
//!
//! Each round drafts up to `k` tokens after the anchor (the last committed token, not yet in
//! the target's cache), runs `[anchor, d1..dk]` through the target in one forward, keeps what
//! [`specula_spec::verify::sample_and_match`] accepts plus one token of the target's own, and
//! rolls the rejected rows back out of the cache ([`Engine::rewind`]: a trim, or for a memory
//! that cannot trim the checkpoint taken before the verify, restored, and the accepted rows run
//! again). The first round opens as in llama.cpp's
//! `llama-speculative-simple`: the prompt's last token anchors it, so the first generated
//! token is drafted and verified like every later one, and drafts and acceptance come out the
//! same as llama.cpp's. The rest of the prompt is prefilled before that round for a feature
//! drafter (which needs its hidden states to draft), and otherwise runs in front of the
//! round's verify rows, in the same forward (the server's slots also anchor their first step
//! at the last prompt token).
//! The target's kernels are batch-invariant, so every verify row (and every replayed row) has
//! the bits of a one-token decode and greedy output is the plain greedy output token for token
//! (`tests/spec.rs` checks it for random drafters on a tiny model and on a real pair). `k`
//! comes from [`specula_spec::policy::Adaptive`] unless fixed.

use std::time::Instant;

use specula_sampling::LogitsMask;
use specula_spec::verify::{match_argmax, sample_and_match};
use specula_spec::{Drafter, One, SpecStats};
use specula_tensor::Backend;
use specula_tokenizer::DecodeOptions;

use crate::round::{FeatureBuf, PlanEntry, RoundCost, SpecSeq, plan};
use crate::{Engine, EngineError, GenerateOptions, Generation, Result, Session, ms, top_k_logits};

/// How a generation drafts.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SpecOptions {
    /// At most this many draft tokens per round (`--spec-draft-n-max`).
    pub n_max: usize,
    /// Drafts shorter than this are not verified (`--spec-draft-n-min`).
    pub n_min: usize,
    /// Model drafters stop at a position whose top-1 probability is below this
    /// (`--spec-draft-p-min`).
    pub p_min: f32,
    /// Choose each round's draft length from measured acceptance and costs (else always ask
    /// for `n_max`).
    pub adaptive: bool,
}

impl Default for SpecOptions {
    fn default() -> Self {
        Self {
            n_max: 16,
            n_min: 0,
            p_min: 0.75,
            adaptive: true,
        }
    }
}

impl<B: Backend> Engine<B> {
    /// [`Engine::generate`] with speculative rounds from `drafter`: the same tokens for greedy
    /// sampling, the same distribution otherwise, and the acceptance statistics in
    /// [`Generation::spec`]. Teacher forcing (`force_ids`) has nothing to speculate on and
    /// runs [`Engine::generate`].
    ///
    /// # Errors
    /// As [`Engine::generate`], and a drafter's own failures.
    pub fn generate_speculative(
        &self,
        s: &mut Session<B>,
        prompt: &[u32],
        opts: &GenerateOptions,
        drafter: &mut dyn Drafter,
        spec: &SpecOptions,
        on_token: impl FnMut(u32),
    ) -> Result<Generation> {
        self.generate_speculative_masked(s, prompt, opts, drafter, spec, None, on_token)
    }

    /// [`Engine::generate_speculative`] under `mask` (a grammar), as
    /// [`Engine::generate_masked`]: each round's draft is cut before its first token the mask
    /// rejects, and verify row `i` is masked with the state after the first `i` drafts, so
    /// the output is that of masked plain decoding.
    ///
    /// # Errors
    /// As [`Engine::generate_speculative`], and [`EngineError::Mask`].
    #[allow(
        clippy::too_many_arguments,
        reason = "generate_speculative's arguments and the mask"
    )]
    pub fn generate_speculative_masked(
        &self,
        s: &mut Session<B>,
        prompt: &[u32],
        opts: &GenerateOptions,
        drafter: &mut dyn Drafter,
        spec: &SpecOptions,
        mask: Option<&mut dyn LogitsMask>,
        on_token: impl FnMut(u32),
    ) -> Result<Generation> {
        if opts.force_ids.is_some() {
            return self.generate(s, prompt, opts, on_token);
        }
        // Greedy verification reads each verify row's argmax, not its logits: a round
        // downloads the ids of its rows and nothing else of the target's output.
        let argmax = mask.is_none() && opts.top_logits == 0 && opts.sampler.is_argmax();
        let was = s.scratch.argmax();
        s.set_argmax(argmax);
        let r = self.speculate(s, prompt, opts, drafter, spec, mask, on_token);
        s.set_argmax(was);
        r
    }

    /// [`Engine::generate_speculative_masked`]'s rounds; with the session reading out
    /// argmaxes ([`Session::set_argmax`]) each verdict comes from the verify rows' argmaxes.
    #[allow(
        clippy::too_many_arguments,
        reason = "generate_speculative_masked's arguments"
    )]
    fn speculate(
        &self,
        s: &mut Session<B>,
        prompt: &[u32],
        opts: &GenerateOptions,
        drafter: &mut dyn Drafter,
        spec: &SpecOptions,
        mut mask: Option<&mut dyn LogitsMask>,
        mut on_token: impl FnMut(u32),
    ) -> Result<Generation> {
        if prompt.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        let n_predict = opts.n_predict;
        let needed = s.n_past + prompt.len() + n_predict;
        if needed > s.n_ctx {
            return Err(EngineError::ContextFull {
                needed,
                prompt: s.n_past + prompt.len(),
                predict: n_predict,
                n_ctx: s.n_ctx,
            });
        }
        if n_predict == 0 {
            // Nothing to draft for: the prompt is evaluated as plain decoding does.
            let mut out = self.generate_masked(s, prompt, opts, mask, on_token)?;
            out.spec = Some(SpecStats::default());
            return Ok(out);
        }
        let n_vocab = self.model.hparams().n_vocab;
        let (mut sampler, mut out) = self.start(prompt, opts)?;
        let t0 = Instant::now();
        // llama-speculative-simple's convention: the prompt's last token is the anchor of the
        // first round, so the first generated token is drafted and verified like every other.
        let mut logits = Vec::new();
        // Feature drafters (DFlash, EAGLE3) see the target's hidden states of every batch.
        let mut feats = FeatureBuf::new(drafter.target_taps());
        drafter.begin(prompt).map_err(EngineError::Spec)?;
        let mut drafter = One(drafter);
        let head = &prompt[..prompt.len() - 1];
        // Prompt tokens before the anchor that the first verify batch carries. A feature
        // drafter needs the target's hidden states of the prompt before it can draft, so the
        // head is prefilled first (one forward more than plain decoding); any other drafter
        // drafts round one from the prompt alone, and the head rides in front of that round's
        // verify rows: one forward for prompt and round, as plain decoding's prefill.
        let mut lead = 0;
        if feats.wanted() && !head.is_empty() {
            // No logits: nothing is sampled from the head.
            self.run_for(
                s,
                head,
                head.len(),
                &mut logits,
                &mut feats,
                &mut drafter,
                0,
            )?;
        } else {
            lead = head.len();
        }
        out.timings.prompt_n = prompt.len();
        out.timings.prompt_ms = ms(t0);

        let mut t1 = Instant::now();
        let mut seq = SpecSeq::new(0, *spec, Some(&drafter), prompt);
        let mut drafts = Vec::with_capacity(1);
        let mut masked = Vec::new();
        let mut ids = Vec::new();
        'rounds: while !out.stopped_at_eog && out.generated_ids.len() < n_predict {
            let lead = std::mem::take(&mut lead);
            let failed = plan(
                &mut [PlanEntry {
                    seq: &mut seq,
                    session: s,
                    lead,
                    left: n_predict - out.generated_ids.len(),
                }],
                Some(&mut drafter),
                n_vocab,
                &mut drafts,
            );
            if let Some((_, e)) = failed.into_iter().next() {
                return Err(EngineError::Spec(e));
            }
            if let Some(m) = mask.as_deref_mut()
                && !seq.draft().is_empty()
            {
                let n = m.valid_prefix(seq.draft());
                seq.cut_draft(n);
            }
            let tv = Instant::now();
            let in_drafter_s = self.run_for(
                s,
                seq.rows(),
                lead,
                &mut logits,
                &mut feats,
                &mut drafter,
                0,
            )?;
            // The drafter's share (feature injection) is drafting cost, not verification.
            let verify_s = tv.elapsed().as_secs_f64() - in_drafter_s;
            if lead > 0 {
                // As in plain decoding, the prompt's time is that of the forward that gives
                // the first token's logits.
                out.timings.prompt_ms = ms(t0);
                t1 = Instant::now();
            }
            if let Some(m) = mask.as_deref_mut() {
                masked.clear();
                masked.extend_from_slice(&logits);
                m.mask_rows(&mut masked, n_vocab, seq.draft())
                    .map_err(EngineError::Mask)?;
            }
            let argmax = s.scratch.argmax();
            ids.clear();
            ids.extend_from_slice(s.argmax_ids());
            let verdict = seq.commit(
                self,
                s,
                Some(&mut drafter),
                if mask.is_some() { &masked } else { &logits },
                |rows, draft| {
                    if argmax {
                        match_argmax(&mut sampler, &ids, draft)
                    } else {
                        sample_and_match(&mut sampler, rows, n_vocab, draft)
                    }
                },
                RoundCost {
                    verify_s,
                    in_drafter_s,
                },
            )?;
            if let Some(m) = mask.as_deref_mut() {
                m.accept(&verdict.tokens).map_err(EngineError::Mask)?;
            }
            for (i, &id) in verdict.tokens.iter().enumerate() {
                if opts.top_logits > 0 {
                    let row = &logits[i * n_vocab..(i + 1) * n_vocab];
                    out.top_logits.push(top_k_logits(row, opts.top_logits));
                }
                out.generated_ids.push(id);
                on_token(id);
                if opts.stop_at_eog && self.tokenizer.is_eog(id) {
                    out.stopped_at_eog = true;
                    break 'rounds;
                }
                if out.generated_ids.len() == n_predict {
                    break 'rounds;
                }
            }
        }
        out.timings.predicted_n = out.generated_ids.len();
        out.timings.predicted_ms = ms(t1);
        out.text = self.tokenizer.decode(
            &out.generated_ids,
            DecodeOptions {
                remove_special: false,
                render_special: false,
            },
        );
        out.spec = Some(seq.stats().clone());
        Ok(out)
    }
}
