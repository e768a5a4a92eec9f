//! Tokenizers built from GGUF metadata exactly as llama.cpp builds them.
//!
//! A GGUF model carries its tokenizer in `tokenizer.*` metadata; this crate turns that into
//! a [`Tokenizer`] whose ids are llama.cpp's ids for the same text (checked against
//! llama.cpp 0c1e57098 on SmolLM2, Qwen2.5 and Gemma-3: `golden/tokenizer/`).
//!
//! - [`Tokenizer`] — encode text to ids ([`Tokenizer::encode`], [`EncodeOptions`]) and ids to
//!   text ([`Tokenizer::decode`], [`DecodeOptions`]); special ids ([`SpecialTokens`]), the
//!   end-of-generation set ([`Tokenizer::is_eog`]), per-token [`TokenAttr`]s.
//! - Vocabulary kinds ([`VocabKind`]): `gpt2` (byte-level BPE over the pre-tokenizer named by
//!   `tokenizer.ggml.pre`, [`PreType`], [`PreSettings`], [`PreTokenizer`]), `llama` (SentencePiece-style merges by score with
//!   `<0xXX>` byte fallback, e.g. Gemma-3) and `gemma4` (BPE over raw UTF-8).
//! - Special tokens written in the prompt (`<|im_start|>`, `<start_of_turn>`…) become their
//!   ids by default, as llama.cpp's `parse_special = true`; user-defined tokens always do.
//! - [`ChatTemplate`] — `tokenizer.chat_template` rendered with `minijinja` in Hugging Face's
//!   jinja2 environment ([`Tokenizer::chat_template`], [`ChatMessage`]).
//! - [`TokenizerError`] — what, where (metadata key) and what was expected.
//!
//! Module map: `vocab` (loading, special ids, EOG), `pretokenize` and `regex_compat` (word
//! splitting), `bpe` and `spm` (merging), `special` (special tokens in text), `decode`,
//! `chat`, `unicode` (+ the generated `unicode_data`).
//!
//! ```
//! use specula_gguf::{Array, Gguf, GgufWriter, Value};
//! use specula_tokenizer::{DecodeOptions, Tokenizer};
//!
//! // A tiny Qwen2-style vocabulary: byte-level BPE, one merge list, one control token.
//! let mut w = GgufWriter::new();
//! w.add("tokenizer.ggml.model", Value::String("gpt2".into()))?;
//! w.add("tokenizer.ggml.pre", Value::String("qwen2".into()))?;
//! let tokens = ["h", "i", "Ġ", "hi", "Ġhi", "<|im_end|>"].map(String::from).to_vec();
//! w.add("tokenizer.ggml.tokens", Value::Array(Array::String(tokens)))?;
//! w.add("tokenizer.ggml.token_type", Value::Array(Array::I32(vec![1, 1, 1, 1, 1, 3])))?;
//! let merges = vec!["h i".to_owned(), "Ġ hi".to_owned()];
//! w.add("tokenizer.ggml.merges", Value::Array(Array::String(merges)))?;
//! w.add("tokenizer.ggml.eos_token_id", Value::U32(5))?;
//! let tok = Tokenizer::from_gguf(&Gguf::from_bytes(w.to_vec(&[])?)?)?;
//!
//! let ids = tok.encode("hi hi<|im_end|>");
//! assert_eq!(ids, [3, 4, 5]);
//! assert!(tok.is_eog(5));
//! assert_eq!(tok.decode(&ids, DecodeOptions::default()), "hi hi");
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod bpe;
mod chat;
mod decode;
mod error;
mod pretokenize;
mod regex_compat;
mod special;
mod spm;
mod unicode;
mod unicode_data;
mod vocab;

use std::path::Path;

use rustc_hash::FxHashMap;
use specula_gguf::{Gguf, Metadata};

pub use chat::{ChatMessage, ChatTemplate};
pub use error::TokenizerError;
pub use pretokenize::{PreSettings, PreTokenizer, PreType};
pub use vocab::{SpecialTokens, TokenAttr, VocabKind};

use bpe::Bpe;
use decode::Pieces;
use special::{Fragment, SpecialMatcher};
use spm::Spm;
use vocab::Vocab;

/// A token id (an index into the vocabulary).
pub type TokenId = u32;

/// How [`Tokenizer::encode_with`] treats special tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EncodeOptions {
    /// Add BOS / EOS where the model asks for them (`tokenizer.ggml.add_bos_token`,
    /// `add_eos_token`, or llama.cpp's default for the vocabulary type).
    pub add_special: bool,
    /// Turn control tokens written in the text (`<|im_start|>`) into their ids. User-defined
    /// tokens are matched either way.
    pub parse_special: bool,
}

impl Default for EncodeOptions {
    /// llama.cpp's defaults for a prompt: `add_special` and `parse_special` on.
    fn default() -> Self {
        Self {
            add_special: true,
            parse_special: true,
        }
    }
}

/// How [`Tokenizer::decode`] treats special tokens.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DecodeOptions {
    /// Drop a leading BOS and a trailing EOS where the model adds them.
    pub remove_special: bool,
    /// Write control tokens (`<|im_end|>`) as their text; otherwise they vanish.
    pub render_special: bool,
}

#[derive(Debug)]
enum Model {
    Bpe(Bpe),
    Spm(Spm),
}

/// A tokenizer built from a model's GGUF metadata. It is `Send + Sync`: one instance can
/// serve every request thread.
pub struct Tokenizer {
    vocab: Vocab,
    model: Model,
    special: SpecialMatcher,
    pieces: Pieces,
    chat_template: Option<String>,
}

/// A summary: the vocabulary itself is hundreds of thousands of strings.
impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("model", &self.vocab.model_name)
            .field("pre", &self.vocab.pre_name)
            .field("n_tokens", &self.vocab.n_tokens())
            .field("special", &self.vocab.special)
            .field("add_bos", &self.vocab.add_bos)
            .field("add_eos", &self.vocab.add_eos)
            .field("eog", &self.vocab.eog)
            .finish_non_exhaustive()
    }
}

impl Tokenizer {
    /// Opens a GGUF file and builds its tokenizer (only the header is read).
    ///
    /// # Errors
    /// [`TokenizerError::Gguf`] if the file cannot be read, else as [`Tokenizer::from_metadata`].
    pub fn open(path: impl AsRef<Path>) -> Result<Self, TokenizerError> {
        Self::from_gguf(&Gguf::open(path)?)
    }

    /// Builds the tokenizer of an open GGUF file.
    ///
    /// # Errors
    /// As [`Tokenizer::from_metadata`].
    pub fn from_gguf(file: &Gguf) -> Result<Self, TokenizerError> {
        Self::from_metadata(file.metadata())
    }

    /// Builds a tokenizer from `tokenizer.*` metadata, as llama.cpp's `llama_vocab::load`.
    ///
    /// # Errors
    /// A missing or mistyped key, an unknown or unsupported `tokenizer.ggml.model` or
    /// `tokenizer.ggml.pre`, or an add-BOS/EOS rule without the token.
    pub fn from_metadata(md: &Metadata) -> Result<Self, TokenizerError> {
        let mut vocab = Vocab::load(md)?;
        let model = match vocab.kind {
            VocabKind::Spm => {
                let spm = Spm::new(&vocab);
                vocab.special.nl = spm.byte_token(b'\n');
                Model::Spm(spm)
            }
            VocabKind::Bpe => {
                let merges = vocab::string_array(md, vocab::KEY_MERGES)?.ok_or(
                    TokenizerError::MissingKey {
                        key: vocab::KEY_MERGES,
                    },
                )?;
                let pre = pretokenize::PreTokenizer::new(vocab.pre)?;
                let bpe = Bpe::new(&vocab, merges, pre);
                let mut nl = Vec::new();
                bpe.encode("\n", &vocab, &mut nl);
                vocab.special.nl = nl.first().copied();
                Model::Bpe(bpe)
            }
        };
        let special = SpecialMatcher::new(&vocab);
        let pieces = Pieces::new(&vocab);
        let chat_template = md.get_str("tokenizer.chat_template").map(str::to_owned);
        Ok(Self {
            vocab,
            model,
            special,
            pieces,
            chat_template,
        })
    }

    /// Text to ids with [`EncodeOptions::default`]: BOS as the model asks, special tokens in
    /// the text parsed.
    #[must_use]
    pub fn encode(&self, text: &str) -> Vec<TokenId> {
        self.encode_with(text, EncodeOptions::default())
    }

    /// Text to ids (`llama_tokenize(text, add_special, parse_special)`).
    #[must_use]
    pub fn encode_with(&self, text: &str, opts: EncodeOptions) -> Vec<TokenId> {
        let v = &self.vocab;
        let mut frags = Vec::new();
        self.special.partition(text, opts.parse_special, &mut frags);
        let mut out = Vec::with_capacity(text.len() / 3 + 2);
        if opts.add_special && v.add_bos {
            out.extend(v.special.bos);
        }
        match &self.model {
            Model::Spm(spm) => {
                let mut prev_special = true;
                let mut buf = String::new();
                // Fragments repeat (lines of code between indentation tokens): merge each
                // distinct one once per call.
                let mut cache: FxHashMap<(bool, &str), (usize, usize)> = FxHashMap::default();
                let mut cached: Vec<TokenId> = Vec::new();
                for f in frags {
                    match f {
                        Fragment::Text(s, e) => {
                            let prefix = v.add_space_prefix && prev_special;
                            let key = (prefix, &text[s..e]);
                            if let Some(&(a, b)) = cache.get(&key) {
                                out.extend_from_slice(&cached[a..b]);
                            } else {
                                buf.clear();
                                if prefix {
                                    buf.push('\u{2581}');
                                }
                                for c in text[s..e].chars() {
                                    buf.push(if c == ' ' { '\u{2581}' } else { c });
                                }
                                let a = cached.len();
                                spm.encode(&buf, v, &mut cached);
                                out.extend_from_slice(&cached[a..]);
                                cache.insert(key, (a, cached.len()));
                            }
                            prev_special = false;
                        }
                        Fragment::Token(id) => {
                            out.push(id);
                            prev_special = true;
                        }
                    }
                }
            }
            Model::Bpe(bpe) => {
                for f in frags {
                    match f {
                        Fragment::Text(s, e) => bpe.encode(&text[s..e], v, &mut out),
                        Fragment::Token(id) => out.push(id),
                    }
                }
            }
        }
        if opts.add_special && v.add_eos {
            out.extend(v.special.eos);
        }
        out
    }

    /// Ids to text (`llama_detokenize`), invalid UTF-8 replaced by U+FFFD.
    #[must_use]
    pub fn decode(&self, ids: &[TokenId], opts: DecodeOptions) -> String {
        String::from_utf8_lossy(&self.decode_bytes(ids, opts)).into_owned()
    }

    /// Ids to bytes (`llama_detokenize`): a prefix of a generation may end inside a UTF-8
    /// sequence.
    #[must_use]
    pub fn decode_bytes(&self, ids: &[TokenId], opts: DecodeOptions) -> Vec<u8> {
        decode::detokenize(
            &self.vocab,
            &self.pieces,
            ids,
            opts.remove_special,
            opts.render_special,
        )
    }

    /// The bytes one token stands for (`llama_token_to_piece`); control and unknown tokens
    /// give nothing unless `render_special`. Ids out of range give nothing.
    #[must_use]
    pub fn token_to_piece(&self, id: TokenId, render_special: bool) -> &[u8] {
        decode::token_to_piece(&self.vocab, &self.pieces, id, 0, render_special)
    }

    /// The token's text as stored in the vocabulary (byte-level or `▁`-escaped).
    #[must_use]
    pub fn token_text(&self, id: TokenId) -> Option<&str> {
        self.vocab.texts.get(id as usize).map(String::as_str)
    }

    /// The id of a vocabulary text.
    #[must_use]
    pub fn token_id(&self, text: &str) -> Option<TokenId> {
        self.vocab.lookup(text)
    }

    /// The token's attributes (after llama.cpp's adjustments: EOG tokens are control,
    /// `<unusedN>` control tokens are unused, …); `UNDEFINED` out of range.
    #[must_use]
    pub fn token_attr(&self, id: TokenId) -> TokenAttr {
        self.vocab
            .attrs
            .get(id as usize)
            .copied()
            .unwrap_or_default()
    }

    /// The token's score (SentencePiece log-probability; 0 where the vocabulary has none).
    #[must_use]
    pub fn token_score(&self, id: TokenId) -> f32 {
        self.vocab.scores.get(id as usize).copied().unwrap_or(0.0)
    }

    /// Number of tokens in the vocabulary.
    #[must_use]
    pub fn n_tokens(&self) -> usize {
        self.vocab.n_tokens()
    }

    /// The special ids (BOS, EOS, EOT, newline, FIM…).
    #[must_use]
    pub fn special_tokens(&self) -> &SpecialTokens {
        &self.vocab.special
    }

    /// Whether `encode` with `add_special` puts BOS first.
    #[must_use]
    pub fn add_bos(&self) -> bool {
        self.vocab.add_bos
    }

    /// Whether `encode` with `add_special` puts EOS last.
    #[must_use]
    pub fn add_eos(&self) -> bool {
        self.vocab.add_eos
    }

    /// `tokenizer.ggml.add_sep_token` (used by embedding models, not by `encode`).
    #[must_use]
    pub fn add_sep(&self) -> bool {
        self.vocab.add_sep
    }

    /// Whether generating `id` ends the generation (EOS, EOT, EOM and every token llama.cpp
    /// recognises as an end marker, such as `<|im_end|>`, `<|endoftext|>`, `<end_of_turn>`).
    #[must_use]
    pub fn is_eog(&self, id: TokenId) -> bool {
        self.vocab.eog.contains(&id)
    }

    /// The end-of-generation ids, ascending.
    pub fn eog_ids(&self) -> impl ExactSizeIterator<Item = TokenId> + '_ {
        self.vocab.eog.iter().copied()
    }

    /// Which merging algorithm the vocabulary uses.
    #[must_use]
    pub fn kind(&self) -> VocabKind {
        self.vocab.kind
    }

    /// `tokenizer.ggml.model`.
    #[must_use]
    pub fn model_name(&self) -> &str {
        &self.vocab.model_name
    }

    /// `tokenizer.ggml.pre`, as written in the file.
    #[must_use]
    pub fn pre_name(&self) -> Option<&str> {
        self.vocab.pre_name.as_deref()
    }

    /// The pre-tokenizer in use (BPE vocabularies; [`PreType::Default`] otherwise).
    #[must_use]
    pub fn pre_type(&self) -> PreType {
        self.vocab.pre
    }

    /// The raw `tokenizer.chat_template`, if the model has one.
    #[must_use]
    pub fn chat_template_source(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// The model's chat template, compiled, with its BOS / EOS texts.
    ///
    /// # Errors
    /// [`TokenizerError::NoChatTemplate`] if the model has none, [`TokenizerError::Template`]
    /// if it does not parse.
    pub fn chat_template(&self) -> Result<ChatTemplate, TokenizerError> {
        let source = self
            .chat_template
            .as_deref()
            .ok_or(TokenizerError::NoChatTemplate)?;
        self.chat_template_from(source)
    }

    /// `source` compiled as a chat template with this model's BOS / EOS texts (a template
    /// given in place of the model's: llama-server's `--chat-template-file`).
    ///
    /// # Errors
    /// [`TokenizerError::Template`] if it does not parse.
    pub fn chat_template_from(&self, source: &str) -> Result<ChatTemplate, TokenizerError> {
        let text = |id: Option<TokenId>| id.and_then(|i| self.token_text(i)).unwrap_or("");
        ChatTemplate::new(
            source,
            text(self.vocab.special.bos),
            text(self.vocab.special.eos),
        )
    }
}
