//! The errors of building a tokenizer and rendering chat templates.

/// Everything that can go wrong in this crate.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TokenizerError {
    /// The GGUF file could not be opened or parsed.
    #[error(transparent)]
    Gguf(#[from] specula_gguf::GgufError),
    /// A required metadata key is absent.
    #[error("metadata key {key} is missing")]
    MissingKey {
        /// The key, e.g. `tokenizer.ggml.tokens`.
        key: &'static str,
    },
    /// A metadata key holds a value of the wrong type.
    #[error("metadata key {key} has type {found}, expected {expected}")]
    WrongType {
        /// The key.
        key: &'static str,
        /// What llama.cpp accepts there.
        expected: &'static str,
        /// What the file holds.
        found: String,
    },
    /// A per-token array is shorter than the vocabulary.
    #[error("metadata key {key} has {len} entries for {n_tokens} tokens")]
    ShortArray {
        /// The key.
        key: &'static str,
        /// Its length.
        len: usize,
        /// The number of tokens.
        n_tokens: usize,
    },
    /// `tokenizer.ggml.model` names a tokenizer llama.cpp does not know.
    #[error("unknown tokenizer model '{model}' (tokenizer.ggml.model)")]
    UnknownModel {
        /// The name.
        model: String,
    },
    /// `tokenizer.ggml.model` names a tokenizer llama.cpp knows but this crate does not build.
    #[error(
        "tokenizer model '{model}' (tokenizer.ggml.model) is not supported; supported: gpt2, llama, gemma4"
    )]
    UnsupportedModel {
        /// The name.
        model: String,
    },
    /// `tokenizer.ggml.pre` names a pre-tokenizer llama.cpp does not know.
    #[error("unknown pre-tokenizer '{pre}' (tokenizer.ggml.pre)")]
    UnknownPre {
        /// The name.
        pre: String,
    },
    /// One of llama.cpp's pre-tokenizer regexes could not be compiled.
    #[error("pre-tokenizer {pre}: regex {regex:?} cannot be used: {reason}")]
    Regex {
        /// The pre-tokenizer type.
        pre: String,
        /// The regex, as llama.cpp writes it.
        regex: String,
        /// Why.
        reason: String,
    },
    /// The vocabulary asks for a BOS/EOS token it does not have.
    #[error("{key} is true but the vocabulary has no {what} token")]
    MissingSpecial {
        /// The flag, e.g. `tokenizer.ggml.add_bos_token`.
        key: &'static str,
        /// `BOS` or `EOS`.
        what: &'static str,
    },
    /// The model has no `tokenizer.chat_template`.
    #[error("the model has no chat template (tokenizer.chat_template)")]
    NoChatTemplate,
    /// The chat template does not parse or fails while rendering. The message carries
    /// minijinja's whole report (`{:#}`: the kind, the detail and the template line), so the
    /// error is not also given as this one's source (a cause chain would print it twice).
    #[error("chat template: {0:#}")]
    Template(minijinja::Error),
}

impl From<minijinja::Error> for TokenizerError {
    fn from(e: minijinja::Error) -> Self {
        Self::Template(e)
    }
}
