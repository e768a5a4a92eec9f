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
    /// The answer must call a tool (`tool_choice: "required"`, Anthropic's `any` / `tool`).
    ToolCalls(ToolCalls),
}

/// A required tool call in the Hermes / Qwen layout, as llama-server's grammar for such
/// templates asks for it (`common/chat-auto-parser-generator.cpp`, `standard_json_tools`):
/// any text that does not hold `<tool_call>` (thoughts, a preamble), then one or more blocks
/// `<tool_call>` ␣ `{"name": "<tool>", "arguments": <its parameters>}` ␣ `</tool_call>`
/// (␣: llama.cpp's `space`, nothing, a space, or one or two newlines and up to 20 spaces or
/// tabs), then the end. Names and arguments follow the tools' schemas; a model that never
/// writes the block writes on to its budget, as under llama-server. With `parallel`, blocks
/// may follow one another and a block may hold several calls, `,`-separated, as there;
/// without, the answer holds exactly one call (llama-server still allows more blocks, which
/// its parser then leaves as text).
#[derive(Clone, Debug, PartialEq)]
pub struct ToolCalls {
    /// Each tool's name and parameter schema (a non-object schema counts as any object).
    pub tools: Vec<(String, Value)>,
    /// More than one call (`parallel_tool_calls`).
    pub parallel: bool,
}

/// The tags of a Hermes / Qwen tool-call block.
const CALL_OPEN: &str = "<tool_call>";
const CALL_CLOSE: &str = "</tool_call>";

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
    tokenizer: Arc<Tokenizer>,
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
        let env: TokEnv = Arc::new(Env {
            trie,
            tokenizer: Arc::clone(&tokenizer),
        });
        let mut factory =
            ParserFactory::new_simple(&env).map_err(|e| GrammarError::Tokenizer(e.to_string()))?;
        factory.quiet();
        Ok(Self {
            factory,
            n_vocab: n,
            eog,
            tokenizer,
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
            Spec::ToolCalls(t) => TopLevelGrammar::from_lark(self.tool_calls_lark(t)?),
        };
        let parser = self.factory.create_parser(grammar).map_err(|e| {
            let msg = e.to_string();
            match spec {
                Spec::JsonObject | Spec::JsonSchema(_) => GrammarError::Schema(msg),
                Spec::Lark(_) | Spec::Gbnf(_) | Spec::ToolCalls(_) => GrammarError::Grammar(msg),
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

impl Grammars {
    /// A tag as a grammar atom: the token that spells it when the vocabulary has one as a
    /// control token (no text matches those), else its text.
    fn tag(&self, text: &str) -> (String, bool) {
        match self.tokenizer.token_id(text) {
            Some(id) if self.tokenizer.token_attr(id).intersects(TokenAttr::CONTROL) => {
                (format!("<[{id}]>"), true)
            }
            _ => (lark_string(text), false),
        }
    }

    /// The Lark grammar of [`ToolCalls`].
    fn tool_calls_lark(&self, t: &ToolCalls) -> Result<String, GrammarError> {
        if t.tools.is_empty() {
            return Err(GrammarError::Grammar(
                "a required tool call needs at least one tool".into(),
            ));
        }
        let mut calls: Vec<Value> = t
            .tools
            .iter()
            .map(|(name, params)| {
                let args = if params.is_object() {
                    params.clone()
                } else {
                    json!({"type": "object"})
                };
                json!({
                    "type": "object",
                    "properties": {"name": {"const": name}, "arguments": args},
                    "required": ["name", "arguments"],
                    "additionalProperties": false,
                })
            })
            .collect();
        let mut schema = if calls.len() == 1 {
            calls.pop().unwrap_or_default()
        } else {
            json!({"anyOf": calls})
        };
        schema["x-guidance"] = json_layout();
        let (open, open_token) = self.tag(CALL_OPEN);
        let (close, _) = self.tag(CALL_CLOSE);
        // What comes before the first block: text up to the first opening tag (a lazy
        // lexeme ends at its first match), or, when the tag is a control token that no
        // text matches, any text.
        let head = if open_token {
            format!("start: TEXT? {open} block more\nTEXT: /(?s:.+)/\n")
        } else {
            format!(
                "start: head block more\nhead[lazy]: /(?s:.*){}/\n",
                regex_escape(CALL_OPEN)
            )
        };
        let (more, calls) = if t.parallel {
            (
                format!("(SP? {open} block)* SP?"),
                "call (SP? \",\" SP? call)*",
            )
        } else {
            ("SP?".to_owned(), "call")
        };
        Ok(format!(
            "{head}\
             more: {more}\n\
             block: SP? {calls} SP? {close}\n\
             call: %json {schema}\n\
             SP: / |\\n{{1,2}}[ \\t]{{0,20}}/\n"
        ))
    }
}

/// `s` as a Lark string literal.
fn lark_string(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_default()
}

/// `s` as a regex matching itself.
fn regex_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if "\\.+*?()|[]{}^$/".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
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

impl specula_sampling::LogitsMask for Constraint {
    fn valid_prefix(&mut self, draft: &[u32]) -> usize {
        Constraint::valid_prefix(self, draft)
    }

    fn mask_rows(&mut self, rows: &mut [f32], n_vocab: usize, draft: &[u32]) -> Result<(), String> {
        Constraint::mask_rows(self, rows, n_vocab, draft).map_err(|e| e.to_string())
    }

    fn accept(&mut self, tokens: &[u32]) -> Result<(), String> {
        Constraint::accept(self, tokens).map_err(|e| e.to_string())
    }
}
