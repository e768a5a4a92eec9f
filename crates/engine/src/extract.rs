//! Feature extraction for drafter training: the target's hidden states at chosen taps (and,
//! if asked, its top-k logits) for many sequences, several sequences per forward.
//!
//! Each sequence runs from position 0 in a fresh session of its own (nothing is kept between
//! sequences). A group of sequences is one [`Engine::decode_multi`] batch: the matmuls run
//! over every row of the group, attention per sequence. With batch-invariant kernels a
//! sequence's rows have the bits [`Engine::prefill_with_features`] gives it alone (tested), so
//! what a drafter is trained on is what it is fed at inference. The output head runs only when
//! top-k logits are asked for.
//!
//! [`Engine::continue_greedy`] makes the text a drafter for greedy decoding should learn: the
//! target's own greedy continuations of corpus prompts (DFlash and EAGLE-3 train on responses
//! the target generated, not on the corpus, whose next token is the target's top-1 only about
//! half the time on code).

use specula_models::Taps;
use specula_quant::QType;
use specula_tensor::{Backend, NO_ARGMAX};

use crate::{BatchEntry, Capture, Engine, EngineError, Readout, Result, top_k_logits};

/// What [`Engine::extract`] captures and how it batches.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExtractOptions {
    /// Taps in the layer-input convention of [`Taps`] (0 = the embeddings, `l` = the output
    /// of layer `l − 1`, `n_layer` = the pre-final-norm state), in the order the features lay
    /// them side by side.
    pub taps: Vec<usize>,
    /// Keep the `top_k` largest target logits of every row (0: the output head does not run).
    pub top_k: usize,
    /// Sequences per forward.
    pub batch: usize,
}

/// One sequence's features.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SeqFeatures {
    /// `[tokens, taps · n_embd]` row-major, each row the taps side by side in
    /// [`ExtractOptions::taps`] order.
    pub features: Vec<f32>,
    /// `[tokens][top_k]` `(id, logit)` pairs, largest first (empty without top-k).
    pub top_k: Vec<Vec<(u32, f32)>>,
}

impl<B: Backend> Engine<B> {
    /// Each prompt followed by the target's greedy continuation of up to `n` tokens (ending
    /// early after an end-of-generation token), `batch` prompts per forward: the first forward
    /// runs the prompts, every later one the last token of each unfinished sequence.
    /// `progress(tokens)` is told of every step's new tokens. With batch-invariant kernels a
    /// continuation is the one plain greedy decoding of its prompt gives.
    ///
    /// # Errors
    /// An empty prompt, ids outside the vocabulary, a batch of 0, or a cache the backend
    /// cannot allocate.
    pub fn continue_greedy(
        &self,
        prompts: &[&[u32]],
        n: usize,
        batch: usize,
        mut progress: impl FnMut(usize),
    ) -> Result<Vec<Vec<u32>>> {
        if batch == 0 {
            return Err(EngineError::Extract(
                "a batch of 0 sequences per forward".into(),
            ));
        }
        if let Some(i) = prompts.iter().position(|s| s.is_empty()) {
            return Err(EngineError::Extract(format!("prompt {i} is empty")));
        }
        let n_vocab = self.model.hparams().n_vocab;
        let mut scratch = self.scratch();
        // Greedy steps read out one id per sequence, no logits.
        scratch.set_argmax(true);
        let mut readout = Readout::default();
        let mut out: Vec<Vec<u32>> = prompts.iter().map(|p| p.to_vec()).collect();
        for (g, group) in prompts.chunks(batch).enumerate() {
            let base = g * batch;
            let mut sessions = group
                .iter()
                .map(|s| self.session(s.len() + n, QType::F16, QType::F16))
                .collect::<Result<Vec<_>>>()?;
            // Sequences of the group still generating, by index in the group.
            let mut live: Vec<usize> = (0..group.len()).collect();
            let mut step = 0;
            while step < n && !live.is_empty() {
                let last: Vec<[u32; 1]> = live
                    .iter()
                    .map(|&j| [*out[base + j].last().unwrap_or(&0)])
                    .collect();
                let mut entries: Vec<BatchEntry<'_, B>> = Vec::with_capacity(live.len());
                let mut live_sessions: Vec<Option<&mut crate::Session<B>>> =
                    sessions.iter_mut().map(Some).collect();
                for (k, &j) in live.iter().enumerate() {
                    let tokens: &[u32] = if step == 0 { group[j] } else { &last[k] };
                    if let Some(session) = live_sessions[j].take() {
                        entries.push(BatchEntry {
                            session,
                            tokens,
                            logits_from: tokens.len() - 1,
                            capture: None,
                        });
                    }
                }
                self.decode_multi(&mut entries, &mut scratch, &mut readout)?;
                drop(entries);
                let mut done = Vec::new();
                for (&id, &j) in readout.ids.iter().zip(&live) {
                    if id == NO_ARGMAX || id as usize >= n_vocab {
                        return Err(EngineError::Extract(
                            "every logit of a row is NaN or −∞".into(),
                        ));
                    }
                    out[base + j].push(id);
                    if self.tokenizer.is_eog(id) {
                        done.push(j);
                    }
                }
                progress(live.len());
                live.retain(|j| !done.contains(j));
                step += 1;
            }
        }
        Ok(out)
    }

    /// The features of `seqs`, `opts.batch` sequences per forward; `each(i, features)` is
    /// called for sequence `i` in order (a caller writes shards as they come, so memory stays
    /// one group's).
    ///
    /// # Errors
    /// An empty sequence, ids outside the vocabulary, a tap past the model's layers, no taps,
    /// a batch of 0, a cache the backend cannot allocate, or what `each` returns.
    pub fn extract(
        &self,
        seqs: &[&[u32]],
        opts: &ExtractOptions,
        mut each: impl FnMut(usize, SeqFeatures) -> Result<()>,
    ) -> Result<()> {
        if opts.taps.is_empty() {
            return Err(EngineError::Extract("no taps to extract".into()));
        }
        if opts.batch == 0 {
            return Err(EngineError::Extract(
                "a batch of 0 sequences per forward".into(),
            ));
        }
        self.check_taps(&opts.taps)?;
        if let Some(i) = seqs.iter().position(|s| s.is_empty()) {
            return Err(EngineError::Extract(format!("sequence {i} is empty")));
        }
        let n_vocab = self.model.hparams().n_vocab;
        let mut scratch = self.scratch();
        let mut readout = Readout::default();
        for (g, group) in seqs.chunks(opts.batch).enumerate() {
            let mut sessions = group
                .iter()
                .map(|s| self.session(s.len(), QType::F16, QType::F16))
                .collect::<Result<Vec<_>>>()?;
            let mut taps: Vec<Taps> = group
                .iter()
                .map(|_| Taps {
                    layers: opts.taps.clone(),
                    rows: Vec::new(),
                })
                .collect();
            let mut features: Vec<Vec<f32>> = vec![Vec::new(); group.len()];
            let mut entries: Vec<BatchEntry<'_, B>> = sessions
                .iter_mut()
                .zip(group)
                .zip(taps.iter_mut().zip(features.iter_mut()))
                .map(|((session, tokens), (taps, features))| BatchEntry {
                    session,
                    tokens,
                    logits_from: if opts.top_k > 0 { 0 } else { tokens.len() },
                    capture: Some(Capture {
                        taps,
                        features,
                        device: None,
                    }),
                })
                .collect();
            self.decode_multi(&mut entries, &mut scratch, &mut readout)?;
            drop(entries);
            let mut rows = readout.logits.chunks_exact(n_vocab);
            for (j, (tokens, features)) in group.iter().zip(features).enumerate() {
                let top_k = if opts.top_k > 0 {
                    rows.by_ref()
                        .take(tokens.len())
                        .map(|r| top_k_logits(r, opts.top_k))
                        .collect()
                } else {
                    Vec::new()
                };
                each(g * opts.batch + j, SeqFeatures { features, top_k })?;
            }
        }
        Ok(())
    }
}
