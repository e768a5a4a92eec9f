//! Structured output: a request's JSON schema, Lark grammar or llama.cpp GBNF grammar compiled
//! by [llguidance](https://github.com/guidance-ai/llguidance) (the engine llama.cpp, vLLM and
//! SGLang use) into a [`Constraint`] that says, before each token, which tokens may come next.
//!
//! - [`Grammars`] is built once per tokenizer: llguidance's token trie over specula's token
//!   byte strings (control tokens as `\xFF` + their text, so no text matches them; the
//!   end-of-generation set as the grammar's EOS) and its parser factory.
//! - [`Grammars::compile`] turns a [`Spec`] into a [`Constraint`], or a [`GrammarError`] naming
//!   the problem (the server answers it 400 before decoding).
//! - Per step, [`Constraint::mask_row`] sets the logits of every token the grammar rejects to
//!   −∞ (greedy and sampling alike then pick an allowed one) and [`Constraint::accept`]
//!   advances the matcher. For speculative decoding, [`Constraint::valid_prefix`] cuts a draft
//!   at its first rejected token and [`Constraint::mask_rows`] masks each verify row with the
//!   matcher state after the draft tokens in front of it, rolling the matcher back afterwards,
//!   so constrained speculative output is constrained plain output.
//!
//! ```no_run
//! # fn demo(tok: std::sync::Arc<specula_tokenizer::Tokenizer>) -> Result<(), specula_grammar::GrammarError> {
//! use specula_grammar::{Grammars, Spec};
//! let grammars = Grammars::new(tok)?;
//! let mut c = grammars.compile(&Spec::Gbnf(r#"root ::= "yes" | "no""#.into()))?;
//! let mut logits = vec![0.0f32; grammars.n_vocab()];
//! c.mask_row(&mut logits)?; // only tokens that start "yes" or "no" keep a finite logit
//! # Ok(()) }
//! ```

mod gbnf;

use std::sync::Arc;
use std::time::Instant;

use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use serde_json::{Value, json};
use specula_tokenizer::{EncodeOptions, TokenAttr, Tokenizer, VocabKind};
use toktrie::{SimpleVob, TokEnv, TokRxInfo, TokTrie, TokenizerEnv};

/// What went wrong.
#[derive(Debug, thiserror::Error)]
pub enum GrammarError {
    /// The JSON schema does not compile.
    #[error("invalid JSON schema: {0}")]
    Schema(String),
    /// The grammar does not compile.
    #[error("invalid grammar: {0}")]
    Grammar(String),
    /// The tokenizer cannot back a grammar (e.g. it has no end-of-generation token).
    #[error("structured output is not available for this tokenizer: {0}")]
    Tokenizer(String),
    /// The matcher failed during generation (a token it had not allowed, an internal error).
    #[error("the grammar matcher failed: {0}")]
    Matcher(String),
}

/// What a request constrains its output to.
#[derive(Clone, Debug, PartialEq)]
pub enum Spec {
    /// Any JSON object (OpenAI's `response_format: {"type": "json_object"}`).
    JsonObject,
    /// A JSON schema (`response_format.json_schema.schema`, llama-server's `json_schema`).
    JsonSchema(Value),
    /// A grammar in llguidance's Lark dialect.
    Lark(String),
    /// A grammar in llama.cpp's GBNF (llama-server's `grammar`).
    Gbnf(String),
}

/// The tokenizer as llguidance sees it.
struct Env {
    trie: TokTrie,
    tokenizer: Arc<Tokenizer>,
}

impl TokenizerEnv for Env {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<u32> {
        match std::str::from_utf8(s) {
            Ok(text) if self.tokenizer.kind() == VocabKind::Bpe => self.tokenizer.encode_with(
                text,
                EncodeOptions {
                    add_special: false,
                    parse_special: false,
                },
            ),
            _ => self.trie.greedy_tokenize(s),
        }
    }

    // Masks do not depend on it; it keeps llguidance from forcing tokens by tokenizing text.
    fn tokenize_is_canonical(&self) -> bool {
        false
    }
}

/// The JSON layout generated JSON takes: `", "` and `": "` between items, no other
/// whitespace (a request's own `x-guidance` options take precedence). Flexible whitespace lets
/// a small model fill its budget with newlines before the JSON ends.
fn json_layout() -> Value {
    json!({"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": false})
}

/// The token trie and parser factory of one tokenizer; compiles requests' constraints.
pub struct Grammars {
    factory: ParserFactory,
    n_vocab: usize,
    eog: Arc<[u32]>,
}

impl std::fmt::Debug for Grammars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammars")
            .field("n_vocab", &self.n_vocab)
            .finish_non_exhaustive()
    }
}

impl Grammars {
    /// The trie of `tokenizer`'s tokens and llguidance's parser factory over it.
    ///
    /// # Errors
    /// [`GrammarError::Tokenizer`] when the vocabulary has no end-of-generation token.
    pub fn new(tokenizer: Arc<Tokenizer>) -> Result<Self, GrammarError> {
        let n = tokenizer.n_tokens();
        let eog: Vec<u32> = tokenizer.eog_ids().collect();
        let Some(&eos) = tokenizer.special_tokens().eos.as_ref().or(eog.first()) else {
            return Err(GrammarError::Tokenizer(
                "the vocabulary has no end-of-generation token to end a grammar with".into(),
            ));
        };
        let words: Vec<Vec<u8>> = (0..n)
            .map(|i| {
                let id = u32::try_from(i).unwrap_or(u32::MAX);
                let attr = tokenizer.token_attr(id);
                if attr.intersects(TokenAttr::CONTROL) || tokenizer.is_eog(id) {
                    let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    w.extend_from_slice(tokenizer.token_text(id).unwrap_or("").as_bytes());
                    w
                } else if attr.intersects(TokenAttr::UNUSED | TokenAttr::UNKNOWN) {
                    Vec::new()
                } else {
                    tokenizer.token_to_piece(id, false).to_vec()
                }
            })
            .collect();
        let mut info = TokRxInfo::new(u32::try_from(n).unwrap_or(u32::MAX), eos);
        info.tok_bos = tokenizer.special_tokens().bos;
        let mut eos_set = vec![eos];
        eos_set.extend(eog.iter().copied().filter(|&e| e != eos));
        let trie = TokTrie::from(&info, &words).with_eos_tokens(&eos_set);
        let eog: Arc<[u32]> = eos_set.into();
        let env: TokEnv = Arc::new(Env { trie, tokenizer });
        let mut factory =
            ParserFactory::new_simple(&env).map_err(|e| GrammarError::Tokenizer(e.to_string()))?;
        factory.quiet();
        Ok(Self {
            factory,
            n_vocab: n,
            eog,
        })
    }

    /// Tokens the masks cover (the tokenizer's; logits rows past it are always masked).
    #[must_use]
    pub fn n_vocab(&self) -> usize {
        self.n_vocab
    }

    /// Compiles `spec` into a fresh constraint at the start of the output.
    ///
    /// # Errors
    /// [`GrammarError::Schema`] / [`GrammarError::Grammar`] with llguidance's (or the GBNF
    /// bridge's) message.
    pub fn compile(&self, spec: &Spec) -> Result<Constraint, GrammarError> {
        let schema_err = |e: String| GrammarError::Schema(e);
        let grammar = match spec {
            Spec::JsonObject => {
                let mut s = json!({"type": "object"});
                s["x-guidance"] = json_layout();
                TopLevelGrammar::from_json_schema(s)
            }
            Spec::JsonSchema(schema) => {
                let mut s = schema.clone();
                match &mut s {
                    Value::Object(m) => {
                        m.entry("x-guidance").or_insert_with(json_layout);
                    }
                    Value::Bool(_) => {}
                    other => {
                        return Err(schema_err(format!(
                            "a schema is a JSON object (or true/false), not {other}"
                        )));
                    }
                }
                TopLevelGrammar::from_json_schema(s)
            }
            Spec::Lark(g) => TopLevelGrammar::from_lark(g.clone()),
            Spec::Gbnf(g) => {
                TopLevelGrammar::from_lark(gbnf::to_lark(g).map_err(GrammarError::Grammar)?)
            }
        };
        let parser = self.factory.create_parser(grammar).map_err(|e| {
            let msg = e.to_string();
            match spec {
                Spec::JsonObject | Spec::JsonSchema(_) => GrammarError::Schema(msg),
                Spec::Lark(_) | Spec::Gbnf(_) => GrammarError::Grammar(msg),
            }
        })?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(GrammarError::Grammar(e));
        }
        Ok(Constraint {
            matcher,
            eog: Arc::clone(&self.eog),
            mask_s: Vec::new(),
        })
    }
}

/// One request's grammar state: the matcher after the tokens accepted so far.
pub struct Constraint {
    matcher: Matcher,
    /// The end-of-generation tokens: generation ends at one, so the matcher never takes one.
    eog: Arc<[u32]>,
    mask_s: Vec<f64>,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint")
            .field("stopped", &self.matcher.is_stopped())
            .finish_non_exhaustive()
    }
}

fn matcher_err(e: impl std::fmt::Display) -> GrammarError {
    GrammarError::Matcher(e.to_string())
}

/// Sets every logit of `row` whose token `mask` does not allow to −∞ (and every row entry
/// past the mask: padding rows of a model's head).
fn apply(mask: &SimpleVob, row: &mut [f32]) {
    let n = mask.len().min(row.len());
    for (i, x) in row[..n].iter_mut().enumerate() {
        if !mask.is_allowed(u32::try_from(i).unwrap_or(u32::MAX)) {
            *x = f32::NEG_INFINITY;
        }
    }
    for x in &mut row[n..] {
        *x = f32::NEG_INFINITY;
    }
}

impl Constraint {
    /// Masks one logits row with the current state: tokens the grammar rejects get −∞; once
    /// the grammar is complete only the end-of-generation tokens remain.
    ///
    /// # Errors
    /// [`GrammarError::Matcher`] when the matcher is in an error state.
    pub fn mask_row(&mut self, row: &mut [f32]) -> Result<(), GrammarError> {
        let t = Instant::now();
        let mask = self.matcher.compute_mask_or_eos().map_err(matcher_err)?;
        self.mask_s.push(t.elapsed().as_secs_f64());
        apply(&mask, row);
        Ok(())
    }

    /// Masks the rows of a verify batch `[anchor, draft…]`: row `i` with the state after
    /// `draft[..i]`. The draft must be one the grammar accepts ([`Constraint::valid_prefix`]);
    /// the matcher is back at the current state afterwards.
    ///
    /// # Errors
    /// [`GrammarError::Matcher`] when the matcher fails or rejects a draft token.
    pub fn mask_rows(
        &mut self,
        rows: &mut [f32],
        n_vocab: usize,
        draft: &[u32],
    ) -> Result<(), GrammarError> {
        let mut consumed = 0;
        let mut ended = false;
        let mut result = Ok(());
        for (i, row) in rows.chunks_exact_mut(n_vocab).enumerate() {
            if let Err(e) = self.mask_row(row) {
                result = Err(e);
                break;
            }
            // Rows after an end-of-generation draft token are never used (generation ends
            // there); they keep the state before it.
            let Some(&d) = draft.get(i) else { break };
            ended |= self.eog.contains(&d) || self.matcher.is_stopped();
            if ended {
                continue;
            }
            if let Err(e) = self.matcher.consume_token(d) {
                result = Err(matcher_err(e));
                break;
            }
            consumed += 1;
        }
        self.matcher.rollback(consumed).map_err(matcher_err)?;
        result
    }

    /// How many leading tokens of `draft` the grammar accepts from the current state (the
    /// state is unchanged).
    pub fn valid_prefix(&mut self, draft: &[u32]) -> usize {
        if draft.is_empty() {
            return 0;
        }
        self.matcher.validate_tokens(draft).unwrap_or(0)
    }

    /// Advances the state past `tokens` (committed output).
    ///
    /// # Errors
    /// [`GrammarError::Matcher`] when a token is not allowed.
    pub fn accept(&mut self, tokens: &[u32]) -> Result<(), GrammarError> {
        for &t in tokens {
            // Generation ends at an end-of-generation token (which a complete grammar allows
            // and a stopped one forces); the matcher does not need to see it.
            if self.eog.contains(&t) || self.matcher.is_stopped() {
                return Ok(());
            }
            self.matcher.consume_token(t).map_err(matcher_err)?;
        }
        Ok(())
    }

    /// Whether the grammar is complete (only end-of-generation may follow).
    #[must_use]
    pub fn is_stopped(&self) -> bool {
        self.matcher.is_stopped()
    }

    /// The seconds each mask computation took so far (for cost measurements).
    #[must_use]
    pub fn mask_seconds(&self) -> &[f64] {
        &self.mask_s
    }
}
