//! The vocabulary as llama.cpp loads it (`llama_vocab::impl::load`): token texts, scores and
//! attributes, special ids, the add-BOS/EOS rules and the end-of-generation set.

use std::collections::BTreeSet;

use rustc_hash::FxHashMap;
use specula_gguf::{Array, Metadata, Value};

use crate::TokenId;
use crate::error::TokenizerError;
use crate::pretokenize::{PreSettings, PreType};

/// Token attributes, llama.cpp's `llama_token_attr` bits.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct TokenAttr(pub u32);

impl TokenAttr {
    /// No type information.
    pub const UNDEFINED: Self = Self(0);
    /// The unknown token.
    pub const UNKNOWN: Self = Self(1 << 0);
    /// Reserved, never produced.
    pub const UNUSED: Self = Self(1 << 1);
    /// An ordinary piece of text.
    pub const NORMAL: Self = Self(1 << 2);
    /// A control token (BOS, EOS, `<|im_start|>`…): parsed only with `parse_special`, rendered
    /// only when asked for.
    pub const CONTROL: Self = Self(1 << 3);
    /// A user-defined token: always matched as a whole in the text, always rendered.
    pub const USER_DEFINED: Self = Self(1 << 4);
    /// A byte-fallback token `<0xXX>`.
    pub const BYTE: Self = Self(1 << 5);
    /// Normalized (unused by GGUF vocabularies).
    pub const NORMALIZED: Self = Self(1 << 6);
    /// Swallows the whitespace before it when matched in text.
    pub const LSTRIP: Self = Self(1 << 7);
    /// Swallows the whitespace after it when matched in text.
    pub const RSTRIP: Self = Self(1 << 8);
    /// Single word (unused by GGUF vocabularies).
    pub const SINGLE_WORD: Self = Self(1 << 9);

    /// Whether any bit of `other` is set.
    #[must_use]
    pub fn intersects(self, other: Self) -> bool {
        self.0 & other.0 != 0
    }

    fn set(&mut self, other: Self, on: bool) {
        if on {
            self.0 |= other.0;
        } else {
            self.0 &= !other.0;
        }
    }
}

impl std::ops::BitOr for TokenAttr {
    type Output = Self;
    fn bitor(self, rhs: Self) -> Self {
        Self(self.0 | rhs.0)
    }
}

/// Which algorithm merges the pieces.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VocabKind {
    /// SentencePiece-style: merges by score over characters, byte fallback (`llama`).
    Spm,
    /// Byte-pair encoding by merge rank after a pre-tokenizer (`gpt2`, `gemma4`).
    Bpe,
}

/// The special token ids llama.cpp tracks (`llama_vocab_bos()` and friends); `None` where the
/// vocabulary has none.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[allow(
    missing_docs,
    reason = "named like llama.cpp's llama_vocab_* accessors"
)]
pub struct SpecialTokens {
    pub bos: Option<TokenId>,
    pub eos: Option<TokenId>,
    pub eot: Option<TokenId>,
    pub eom: Option<TokenId>,
    pub unk: Option<TokenId>,
    pub sep: Option<TokenId>,
    pub pad: Option<TokenId>,
    pub mask: Option<TokenId>,
    /// The newline token.
    pub nl: Option<TokenId>,
    pub fim_pre: Option<TokenId>,
    pub fim_suf: Option<TokenId>,
    pub fim_mid: Option<TokenId>,
    pub fim_pad: Option<TokenId>,
    pub fim_rep: Option<TokenId>,
    pub fim_sep: Option<TokenId>,
}

#[derive(Debug)]
pub(crate) struct Vocab {
    pub(crate) kind: VocabKind,
    pub(crate) model_name: String,
    pub(crate) pre_name: Option<String>,
    pub(crate) pre: PreType,
    pub(crate) texts: Vec<String>,
    pub(crate) scores: Vec<f32>,
    pub(crate) attrs: Vec<TokenAttr>,
    pub(crate) token_to_id: FxHashMap<Box<str>, TokenId>,
    pub(crate) special: SpecialTokens,
    pub(crate) add_bos: bool,
    pub(crate) add_eos: bool,
    pub(crate) add_sep: bool,
    pub(crate) add_space_prefix: bool,
    pub(crate) clean_spaces: bool,
    pub(crate) ignore_merges: bool,
    pub(crate) escape_whitespaces: bool,
    pub(crate) eog: BTreeSet<TokenId>,
    /// Control, user-defined and unknown tokens, longest text first (`cache_special_tokens`).
    pub(crate) special_cache: Vec<TokenId>,
}

const KEY_MODEL: &str = "tokenizer.ggml.model";
const KEY_PRE: &str = "tokenizer.ggml.pre";
const KEY_TOKENS: &str = "tokenizer.ggml.tokens";
const KEY_SCORES: &str = "tokenizer.ggml.scores";
const KEY_TOKEN_TYPE: &str = "tokenizer.ggml.token_type";
pub(crate) const KEY_MERGES: &str = "tokenizer.ggml.merges";
const KEY_ADD_BOS: &str = "tokenizer.ggml.add_bos_token";
const KEY_ADD_EOS: &str = "tokenizer.ggml.add_eos_token";
const KEY_ADD_SEP: &str = "tokenizer.ggml.add_sep_token";
const KEY_ADD_PREFIX: &str = "tokenizer.ggml.add_space_prefix";

/// The candidates llama.cpp recognises by text when the id keys are absent, in the order it
/// lists them. llama.cpp takes the first candidate met while iterating an
/// `std::unordered_map`, whose order is the standard library's hash order; where a vocabulary
/// has several candidates (SmolLM2 and Qwen2.5 have both `<|im_end|>` and `<|endoftext|>`),
/// this crate takes the first in list order instead (`<|im_end|>`), so its EOT can differ
/// from one llama.cpp build's. The end-of-generation set does not depend on the choice.
const EOT_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "<｜end▁of▁sentence｜>",
    "<end_of_utterance>",
];
const EOM_TEXTS: &[&str] = &["<|eom_id|>"];
const FIM_PRE_TEXTS: &[&str] = &[
    "<|fim_prefix|>",
    "<fim-prefix>",
    "<fim_prefix>",
    "<｜fim▁begin｜>",
    "<PRE>",
    "▁<PRE>",
    "<|code_prefix|>",
    "<|prefix|>",
];
const FIM_SUF_TEXTS: &[&str] = &[
    "<|fim_suffix|>",
    "<fim-suffix>",
    "<fim_suffix>",
    "<｜fim▁hole｜>",
    "<SUF>",
    "▁<SUF>",
    "<|code_suffix|>",
    "<|suffix|>",
];
const FIM_MID_TEXTS: &[&str] = &[
    "<|fim_middle|>",
    "<fim-middle>",
    "<fim_middle>",
    "<｜fim▁end｜>",
    "<MID>",
    "▁<MID>",
    "<|code_middle|>",
    "<|middle|>",
];
const FIM_PAD_TEXTS: &[&str] = &["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"];
const FIM_REP_TEXTS: &[&str] = &[
    "<|fim_repo|>",
    "<|repo_name|>",
    "<fim-repo>",
    "<REPO>",
    "<reponame>",
];
const FIM_SEP_TEXTS: &[&str] = &["<|file_sep|>"];

/// Texts that end generation wherever they occur in a vocabulary.
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
    "[e~[",
];

fn type_name(v: &Value) -> String {
    match v {
        Value::Array(a) => format!("array of {}", a.element_type()),
        _ => v.value_type().to_string(),
    }
}

fn get_bool(md: &Metadata, key: &'static str) -> Result<Option<bool>, TokenizerError> {
    match md.get(key) {
        None => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(v) => Err(TokenizerError::WrongType {
            key,
            expected: "bool",
            found: type_name(v),
        }),
    }
}

fn get_string<'a>(md: &'a Metadata, key: &'static str) -> Result<Option<&'a str>, TokenizerError> {
    match md.get(key) {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(v) => Err(TokenizerError::WrongType {
            key,
            expected: "string",
            found: type_name(v),
        }),
    }
}

/// A special id key: absent, or a non-negative integer of any width.
fn get_id(md: &Metadata, key: &'static str) -> Result<Option<u64>, TokenizerError> {
    match md.get(key) {
        None => Ok(None),
        Some(v) => match v.as_i64() {
            Some(i) => Ok(u64::try_from(i).ok()),
            None => Err(TokenizerError::WrongType {
                key,
                expected: "integer",
                found: type_name(v),
            }),
        },
    }
}

pub(crate) fn string_array<'a>(
    md: &'a Metadata,
    key: &'static str,
) -> Result<Option<&'a [String]>, TokenizerError> {
    match md.get(key) {
        None => Ok(None),
        Some(Value::Array(Array::String(v))) => Ok(Some(v)),
        Some(v) => Err(TokenizerError::WrongType {
            key,
            expected: "array of string",
            found: type_name(v),
        }),
    }
}

/// The flags `load` sets before reading the token list.
struct Defaults {
    kind: VocabKind,
    pre: PreType,
    special: SpecialTokens,
    add_bos: bool,
    add_space_prefix: bool,
    clean_spaces: bool,
    ignore_merges: bool,
    escape_whitespaces: bool,
    add_sep: bool,
}

fn defaults(model: &str, pre_name: Option<&str>) -> Result<Defaults, TokenizerError> {
    match model {
        "llama" => Ok(Defaults {
            kind: VocabKind::Spm,
            pre: PreType::Default,
            special: SpecialTokens {
                bos: Some(1),
                eos: Some(2),
                unk: Some(0),
                ..SpecialTokens::default()
            },
            add_bos: true,
            add_space_prefix: true,
            clean_spaces: false,
            ignore_merges: false,
            escape_whitespaces: true,
            add_sep: false,
        }),
        "gpt2" | "gemma4" => {
            let (special, pre_name) = if model == "gemma4" {
                (SpecialTokens::default(), Some("gemma4"))
            } else {
                let s = SpecialTokens {
                    bos: Some(11),
                    eos: Some(11),
                    ..SpecialTokens::default()
                };
                (s, pre_name)
            };
            let settings = match pre_name {
                None => PreSettings::from_name("default"),
                Some(name) => PreSettings::from_name(name),
            }
            .ok_or_else(|| TokenizerError::UnknownPre {
                pre: pre_name.unwrap_or_default().to_owned(),
            })?;
            let mut special = special;
            if settings.no_bos {
                special.bos = None;
            }
            Ok(Defaults {
                kind: VocabKind::Bpe,
                pre: settings.pre,
                special,
                add_bos: settings.add_bos.unwrap_or(false),
                add_space_prefix: false,
                clean_spaces: settings.clean_spaces,
                ignore_merges: settings.ignore_merges,
                escape_whitespaces: settings.escape_whitespaces,
                add_sep: settings.add_sep,
            })
        }
        "no_vocab" | "none" | "bert" | "t5" | "rwkv" | "test" | "plamo2" | "hybriddna"
        | "whitespace" => Err(TokenizerError::UnsupportedModel {
            model: model.to_owned(),
        }),
        _ => Err(TokenizerError::UnknownModel {
            model: model.to_owned(),
        }),
    }
}

fn token_attr_of_type(t: i32) -> TokenAttr {
    match t {
        1 => TokenAttr::NORMAL,
        2 => TokenAttr::UNKNOWN,
        3 => TokenAttr::CONTROL,
        4 => TokenAttr::USER_DEFINED,
        5 => TokenAttr::UNUSED,
        6 => TokenAttr::BYTE,
        _ => TokenAttr::UNDEFINED,
    }
}

impl Vocab {
    /// Reads the vocabulary; the newline id is filled in later by the tokenizer, which
    /// needs the model to find it.
    pub(crate) fn load(md: &Metadata) -> Result<Self, TokenizerError> {
        let model =
            get_string(md, KEY_MODEL)?.ok_or(TokenizerError::MissingKey { key: KEY_MODEL })?;
        let pre_name = get_string(md, KEY_PRE)?;
        let d = defaults(model, pre_name)?;
        let add_space_prefix = get_bool(md, KEY_ADD_PREFIX)?.unwrap_or(d.add_space_prefix);

        let texts_in =
            string_array(md, KEY_TOKENS)?.ok_or(TokenizerError::MissingKey { key: KEY_TOKENS })?;
        let n = texts_in.len();
        let scores: Vec<f32> = match md.get(KEY_SCORES) {
            None => vec![0.0; n],
            Some(Value::Array(Array::F32(v))) if v.len() >= n => v[..n].to_vec(),
            Some(Value::Array(Array::I32(v))) if v.len() >= n => {
                #[allow(
                    clippy::cast_precision_loss,
                    reason = "llama.cpp converts integer scores with static_cast<float>"
                )]
                let s = v[..n].iter().map(|&x| x as f32).collect();
                s
            }
            Some(Value::Array(a @ (Array::F32(_) | Array::I32(_)))) => {
                return Err(TokenizerError::ShortArray {
                    key: KEY_SCORES,
                    len: a.len(),
                    n_tokens: n,
                });
            }
            Some(v) => {
                return Err(TokenizerError::WrongType {
                    key: KEY_SCORES,
                    expected: "array of f32 or i32",
                    found: type_name(v),
                });
            }
        };
        let mut attrs: Vec<TokenAttr> = match md.get(KEY_TOKEN_TYPE) {
            None => vec![TokenAttr::NORMAL; n],
            Some(Value::Array(Array::I32(v))) if v.len() >= n => {
                v[..n].iter().map(|&t| token_attr_of_type(t)).collect()
            }
            Some(Value::Array(a @ Array::I32(_))) => {
                return Err(TokenizerError::ShortArray {
                    key: KEY_TOKEN_TYPE,
                    len: a.len(),
                    n_tokens: n,
                });
            }
            Some(v) => {
                return Err(TokenizerError::WrongType {
                    key: KEY_TOKEN_TYPE,
                    expected: "array of i32",
                    found: type_name(v),
                });
            }
        };

        let mut texts = Vec::with_capacity(n);
        let mut token_to_id: FxHashMap<Box<str>, TokenId> =
            FxHashMap::with_capacity_and_hasher(n, Default::default());
        for (i, t) in texts_in.iter().enumerate() {
            let text = if t.is_empty() {
                format!("[EMPTY_{i}]")
            } else {
                t.clone()
            };
            let id = TokenId::try_from(i).map_err(|_| TokenizerError::ShortArray {
                key: KEY_TOKENS,
                len: n,
                n_tokens: usize::try_from(u32::MAX).unwrap_or(usize::MAX),
            })?;
            token_to_id.insert(text.as_str().into(), id);
            texts.push(text);
        }
        let lookup = |s: &str| token_to_id.get(s).copied();

        // Special ids: defaults out of range are dropped, then the keys override.
        let in_range = |id: Option<TokenId>| id.filter(|&i| (i as usize) < n);
        let mut sp = d.special;
        for slot in [
            &mut sp.bos,
            &mut sp.eos,
            &mut sp.eot,
            &mut sp.eom,
            &mut sp.unk,
            &mut sp.sep,
            &mut sp.pad,
            &mut sp.mask,
            &mut sp.fim_pre,
            &mut sp.fim_suf,
            &mut sp.fim_mid,
            &mut sp.fim_pad,
            &mut sp.fim_rep,
            &mut sp.fim_sep,
        ] {
            *slot = in_range(*slot);
        }
        type Slot = fn(&mut SpecialTokens) -> &mut Option<TokenId>;
        let keyed: [(&'static str, Slot); 17] = [
            ("tokenizer.ggml.bos_token_id", |s| &mut s.bos),
            ("tokenizer.ggml.eos_token_id", |s| &mut s.eos),
            ("tokenizer.ggml.eot_token_id", |s| &mut s.eot),
            ("tokenizer.ggml.eom_token_id", |s| &mut s.eom),
            ("tokenizer.ggml.unknown_token_id", |s| &mut s.unk),
            ("tokenizer.ggml.seperator_token_id", |s| &mut s.sep),
            ("tokenizer.ggml.padding_token_id", |s| &mut s.pad),
            ("tokenizer.ggml.mask_token_id", |s| &mut s.mask),
            ("tokenizer.ggml.fim_pre_token_id", |s| &mut s.fim_pre),
            ("tokenizer.ggml.fim_suf_token_id", |s| &mut s.fim_suf),
            ("tokenizer.ggml.fim_mid_token_id", |s| &mut s.fim_mid),
            ("tokenizer.ggml.fim_pad_token_id", |s| &mut s.fim_pad),
            ("tokenizer.ggml.fim_rep_token_id", |s| &mut s.fim_rep),
            ("tokenizer.ggml.fim_sep_token_id", |s| &mut s.fim_sep),
            ("tokenizer.ggml.prefix_token_id", |s| &mut s.fim_pre),
            ("tokenizer.ggml.suffix_token_id", |s| &mut s.fim_suf),
            ("tokenizer.ggml.middle_token_id", |s| &mut s.fim_mid),
        ];
        for (key, slot) in keyed {
            if let Some(id) = get_id(md, key)?
                && let Ok(id) = TokenId::try_from(id)
                && (id as usize) < n
            {
                *slot(&mut sp) = Some(id);
            }
        }

        let mut add_bos = get_bool(md, KEY_ADD_BOS)?.unwrap_or(d.add_bos);
        let add_eos = get_bool(md, KEY_ADD_EOS)?.unwrap_or(false);
        let add_sep = get_bool(md, KEY_ADD_SEP)?.unwrap_or(d.add_sep);
        if d.pre == PreType::Gemma4 {
            add_bos = true;
        }

        // Recognise EOT/EOM/FIM tokens by their text where no key names them.
        let mark_control = |id: TokenId, attrs: &mut Vec<TokenAttr>| {
            attrs[id as usize].set(TokenAttr::CONTROL, true);
        };
        for (slot, candidates) in [
            (&mut sp.eot, EOT_TEXTS),
            (&mut sp.eom, EOM_TEXTS),
            (&mut sp.fim_pre, FIM_PRE_TEXTS),
            (&mut sp.fim_suf, FIM_SUF_TEXTS),
            (&mut sp.fim_mid, FIM_MID_TEXTS),
            (&mut sp.fim_pad, FIM_PAD_TEXTS),
            (&mut sp.fim_rep, FIM_REP_TEXTS),
            (&mut sp.fim_sep, FIM_SEP_TEXTS),
        ] {
            if slot.is_none()
                && let Some(id) = candidates.iter().find_map(|t| lookup(t))
            {
                *slot = Some(id);
                mark_control(id, &mut attrs);
            }
        }

        // Control tokens named "unused…" are unused.
        for (text, attr) in texts.iter().zip(attrs.iter_mut()) {
            if attr.intersects(TokenAttr::CONTROL) && text.contains("unused") {
                attr.set(TokenAttr::UNUSED, true);
            }
        }

        // End of generation.
        let mut eog: BTreeSet<TokenId> = [sp.fim_pad, sp.fim_rep, sp.fim_sep]
            .into_iter()
            .flatten()
            .collect();
        for t in EOG_TEXTS {
            if let Some(id) = lookup(t) {
                eog.insert(id);
                mark_control(id, &mut attrs);
            }
        }
        // gpt-oss: always render these.
        for t in ["<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"] {
            if let Some(id) = lookup(t) {
                attrs[id as usize] = TokenAttr::USER_DEFINED;
            }
        }
        eog.extend([sp.eos, sp.eot, sp.eom].into_iter().flatten());
        // o200k_harmony / solar-open: `<|end|>` is not EOG when `<|return|>` and `<|call|>`
        // (or `<|calls|>` and `<|flush|>`) are.
        let has = |eog: &BTreeSet<TokenId>, t: &str| eog.iter().any(|&id| texts[id as usize] == t);
        let (has_return, has_call, has_flush) = (
            has(&eog, "<|return|>"),
            has(&eog, "<|call|>") || has(&eog, "<|calls|>"),
            has(&eog, "<|flush|>"),
        );
        if let Some(end) = eog
            .iter()
            .copied()
            .find(|&id| texts[id as usize] == "<|end|>")
            && has_call
            && (has_return || has_flush)
        {
            eog.remove(&end);
            attrs[end as usize] = TokenAttr::USER_DEFINED;
        }
        // gemma4 and plamo have an ordinary `</s>`.
        if (has(&eog, "<|tool_response>") || has(&eog, "<|plamo:eos|>"))
            && let Some(s) = eog.iter().copied().find(|&id| texts[id as usize] == "</s>")
        {
            eog.remove(&s);
            attrs[s as usize] = TokenAttr::NORMAL;
        }

        // Special tokens in match order: longest text first (llama.cpp's std::sort is not
        // stable; ties are kept in id order here, which only matters for equal-length special
        // tokens that overlap in some text).
        let special_mask = TokenAttr::CONTROL | TokenAttr::USER_DEFINED | TokenAttr::UNKNOWN;
        let mut special_cache: Vec<TokenId> = (0..n)
            .filter(|&i| attrs[i].intersects(special_mask))
            .filter_map(|i| TokenId::try_from(i).ok())
            .collect();
        special_cache.sort_by_key(|&id| std::cmp::Reverse(texts[id as usize].len()));

        // Per-model strip attributes (set after the cache, as in llama.cpp).
        let name = md
            .get_str("general.name")
            .map(str::to_ascii_lowercase)
            .unwrap_or_default();
        let arch = md.get_str("general.architecture").unwrap_or_default();
        let pre_raw = pre_name.unwrap_or_default();
        let contains_any = |s: &str, subs: &[&str]| subs.iter().any(|x| s.contains(x));
        if contains_any(pre_raw, &["jina-v2-de", "jina-v2-es", "jina-v2-code"])
            || contains_any(arch, &["nomic-bert-moe", "jina-bert-v3"])
        {
            if let Some(id) = lookup("<mask>") {
                attrs[id as usize].set(TokenAttr::LSTRIP, true);
            }
        } else if contains_any(&name, &["phi-3", "phi3"]) {
            for &id in &special_cache {
                attrs[id as usize].set(TokenAttr::RSTRIP, true);
            }
            if let Some(id) = lookup("</s>") {
                attrs[id as usize].set(TokenAttr::RSTRIP, true);
            }
            for t in ["<unk>", "<s>", "<|endoftext|>"] {
                if let Some(id) = lookup(t) {
                    attrs[id as usize].set(TokenAttr::RSTRIP, false);
                }
            }
        } else if contains_any(&name, &["modern-bert"])
            && let Some(id) = lookup("[MASK]")
        {
            attrs[id as usize].set(TokenAttr::LSTRIP, true);
        }

        if add_bos && sp.bos.is_none() {
            return Err(TokenizerError::MissingSpecial {
                key: KEY_ADD_BOS,
                what: "BOS",
            });
        }
        if add_eos && sp.eos.is_none() {
            return Err(TokenizerError::MissingSpecial {
                key: KEY_ADD_EOS,
                what: "EOS",
            });
        }

        Ok(Self {
            kind: d.kind,
            model_name: model.to_owned(),
            pre_name: pre_name.map(str::to_owned),
            pre: d.pre,
            texts,
            scores,
            attrs,
            token_to_id,
            special: sp,
            add_bos,
            add_eos,
            add_sep,
            add_space_prefix,
            clean_spaces: d.clean_spaces,
            ignore_merges: d.ignore_merges,
            escape_whitespaces: d.escape_whitespaces,
            eog,
            special_cache,
        })
    }

    pub(crate) fn lookup(&self, text: &str) -> Option<TokenId> {
        self.token_to_id.get(text).copied()
    }

    pub(crate) fn n_tokens(&self) -> usize {
        self.texts.len()
    }
}
