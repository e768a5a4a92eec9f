//! Pre-tokenizers: how llama.cpp cuts text into words before byte-level BPE merges them.
//!
//! Each `tokenizer.ggml.pre` name maps to one of llama.cpp's pre-tokenizer types
//! (`llama_vocab_pre_type`) with a list of regexes applied in turn, each splitting the pieces
//! the previous one produced (`unicode_regex_split` in llama.cpp's `src/unicode.cpp`). The
//! names, types and regexes below are copied from `llama_vocab::impl::load` and
//! `llm_tokenizer_bpe` of llama.cpp 0c1e57098.
//!
//! llama.cpp runs the common regexes (GPT-2's, Llama-3's, Qwen2's, Qwen3.5's, Kimi-K2's, the
//! digit groupers and the newline splitter) through hand-written code rather than a regex
//! engine, and those hand-written paths are the behaviour to match — they differ from the
//! regex in corner cases. They are ported one to one here ([`Custom`]). Every other regex runs
//! through [`crate::regex_compat`], which reproduces llama.cpp's `std::regex` fallback (code
//! points collapsed to one character per Unicode class) on `fancy-regex`.

use crate::error::TokenizerError;
use crate::regex_compat::CompatRegex;
use crate::unicode::{Flags, flags};

/// llama.cpp's pre-tokenizer types (`enum llama_vocab_pre_type`) that some
/// `tokenizer.ggml.pre` name selects.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
#[allow(
    missing_docs,
    reason = "one variant per llama.cpp enum value, named alike"
)]
pub enum PreType {
    Default,
    Minicpm5,
    Llama3,
    DeepseekLlm,
    DeepseekCoder,
    Deepseek3Llm,
    Spark25,
    Youtu,
    Falcon,
    Mpt,
    Starcoder,
    Gpt2,
    Jais2,
    Gemma4,
    SarvamMoe,
    Whitespace,
    Refact,
    CommandR,
    Qwen2,
    Qwen35,
    Stablelm2,
    Olmo,
    Dbrx,
    Smaug,
    Poro,
    Chatglm4,
    Viking,
    Jais,
    Tekken,
    Smollm,
    Codeshell,
    Bloom,
    Gpt3Finnish,
    Exaone,
    ExaoneMoe,
    Chameleon,
    Minerva,
    Gpt4o,
    GraniteEmbMulti,
    TinyAya,
    Superbpe,
    Trillion,
    GraniteDocling,
    Bailingmoe,
    SeedCoder,
    Hunyuan,
    HunyuanDense,
    HyV4,
    JoyaiLlm,
    KimiK2,
    Ufakzeka,
    Grok2,
    Afmoe,
    Laguna,
    MinimaxM2,
    SolarOpen,
    Mellum2,
}

/// What a `tokenizer.ggml.pre` name selects in llama.cpp's `llama_vocab::impl::load`: the
/// pre-tokenizer type and the flags set with it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct PreSettings {
    /// The pre-tokenizer type.
    pub pre: PreType,
    /// Clean up spaces before punctuation when decoding (`clean_up_tokenization_spaces`);
    /// the BPE default is on.
    pub clean_spaces: bool,
    /// Look a whole word up before merging (Llama-3 style vocabularies).
    pub ignore_merges: bool,
    /// A default for adding BOS when `tokenizer.ggml.add_bos_token` is absent.
    pub add_bos: Option<bool>,
    /// Replace spaces by U+2581 before merging (Gemma-4 style vocabularies).
    pub escape_whitespaces: bool,
    /// A default for `tokenizer.ggml.add_sep_token`.
    pub add_sep: bool,
    /// The model has no BOS token unless `tokenizer.ggml.bos_token_id` names one.
    pub no_bos: bool,
}

impl PreSettings {
    const fn plain() -> Self {
        Self {
            pre: PreType::Default,
            clean_spaces: true,
            ignore_merges: false,
            add_bos: None,
            escape_whitespaces: false,
            add_sep: false,
            no_bos: false,
        }
    }

    /// The settings of a `tokenizer.ggml.pre` name; `None` for a name llama.cpp rejects.
    #[must_use]
    pub fn from_name(name: &str) -> Option<Self> {
        Some(match name {
            "default" => PreSettings {
                pre: PreType::Default,
                ..PreSettings::plain()
            },
            "minicpm5" => PreSettings {
                pre: PreType::Minicpm5,
                ignore_merges: true,
                ..PreSettings::plain()
            },
            "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral"
            | "midm-2.0" | "lfm2" | "jina-v5-nano" => PreSettings {
                pre: PreType::Llama3,
                ignore_merges: true,
                add_bos: Some(true),
                ..PreSettings::plain()
            },
            "deepseek-llm" => PreSettings {
                pre: PreType::DeepseekLlm,
                clean_spaces: false,
                ..PreSettings::plain()
            },
            "deepseek-coder" => PreSettings {
                pre: PreType::DeepseekCoder,
                clean_spaces: false,
                ..PreSettings::plain()
            },
            "deepseek-v3" => PreSettings {
                pre: PreType::Deepseek3Llm,
                clean_spaces: false,
                ..PreSettings::plain()
            },
            "spark2_5" => PreSettings {
                pre: PreType::Spark25,
                clean_spaces: false,
                ..PreSettings::plain()
            },
            "youtu" => PreSettings {
                pre: PreType::Youtu,
                clean_spaces: false,
                ignore_merges: true,
                ..PreSettings::plain()
            },
            "falcon" => PreSettings {
                pre: PreType::Falcon,
                ..PreSettings::plain()
            },
            "mpt" => PreSettings {
                pre: PreType::Mpt,
                ..PreSettings::plain()
            },
            "starcoder" => PreSettings {
                pre: PreType::Starcoder,
                ..PreSettings::plain()
            },
            "gpt-2" | "phi-2" | "jina-es" | "jina-de" | "gigachat" | "jina-v2-es"
            | "jina-v2-de" | "a.x-4.0" | "mellum" | "modern-bert" => PreSettings {
                pre: PreType::Gpt2,
                ..PreSettings::plain()
            },
            "jais-2" => PreSettings {
                pre: PreType::Jais2,
                ..PreSettings::plain()
            },
            "gemma4" | "granite-embed-multi-311m" => PreSettings {
                pre: PreType::Gemma4,
                escape_whitespaces: true,
                ..PreSettings::plain()
            },
            "sarvam-moe" => PreSettings {
                pre: PreType::SarvamMoe,
                escape_whitespaces: true,
                clean_spaces: false,
                ..PreSettings::plain()
            },
            "jina-v1-en" | "jina-v2-code" | "roberta-bpe" => PreSettings {
                pre: PreType::Gpt2,
                add_sep: true,
                ..PreSettings::plain()
            },
            "whitespace" => PreSettings {
                pre: PreType::Whitespace,
                ..PreSettings::plain()
            },
            "refact" => PreSettings {
                pre: PreType::Refact,
                ..PreSettings::plain()
            },
            "command-r" => PreSettings {
                pre: PreType::CommandR,
                clean_spaces: false,
                ..PreSettings::plain()
            },
            "qwen2" | "deepseek-r1-qwen" | "kormo" | "f2llmv2" => PreSettings {
                pre: PreType::Qwen2,
                clean_spaces: false,
                ..PreSettings::plain()
            },
            "qwen35" => PreSettings {
                pre: PreType::Qwen35,
                clean_spaces: false,
                ..PreSettings::plain()
            },
            "stablelm2" => PreSettings {
                pre: PreType::Stablelm2,
                ..PreSettings::plain()
            },
            "olmo" => PreSettings {
                pre: PreType::Olmo,
                ..PreSettings::plain()
            },
            "dbrx" => PreSettings {
                pre: PreType::Dbrx,
                ..PreSettings::plain()
            },
            "smaug-bpe" => PreSettings {
                pre: PreType::Smaug,
                ..PreSettings::plain()
            },
            "poro-chat" => PreSettings {
                pre: PreType::Poro,
                clean_spaces: false,
                ..PreSettings::plain()
            },
            "chatglm-bpe" => PreSettings {
                pre: PreType::Chatglm4,
                no_bos: true,
                ..PreSettings::plain()
            },
            "glm4" | "glm5" => PreSettings {
                pre: PreType::Chatglm4,
                no_bos: true,
                ignore_merges: true,
                ..PreSettings::plain()
            },
            "viking" => PreSettings {
                pre: PreType::Viking,
                clean_spaces: false,
                ..PreSettings::plain()
            },
            "jais" => PreSettings {
                pre: PreType::Jais,
                ..PreSettings::plain()
            },
            "tekken" => PreSettings {
                pre: PreType::Tekken,
                clean_spaces: false,
                ignore_merges: true,
                add_bos: Some(true),
                ..PreSettings::plain()
            },
            "smollm" => PreSettings {
                pre: PreType::Smollm,
                clean_spaces: false,
                ..PreSettings::plain()
            },
            "codeshell" => PreSettings {
                pre: PreType::Codeshell,
                ..PreSettings::plain()
            },
            "bloom" => PreSettings {
                pre: PreType::Bloom,
                ..PreSettings::plain()
            },
            "gpt3-finnish" => PreSettings {
                pre: PreType::Gpt3Finnish,
                ..PreSettings::plain()
            },
            "exaone" => PreSettings {
                pre: PreType::Exaone,
                ..PreSettings::plain()
            },
            "exaone4" => PreSettings {
                pre: PreType::Gpt2,
                ..PreSettings::plain()
            },
            "exaone-moe" => PreSettings {
                pre: PreType::ExaoneMoe,
                ..PreSettings::plain()
            },
            "chameleon" => PreSettings {
                pre: PreType::Chameleon,
                add_bos: Some(true),
                clean_spaces: false,
                ..PreSettings::plain()
            },
            "minerva-7b" => PreSettings {
                pre: PreType::Minerva,
                ..PreSettings::plain()
            },
            "megrez" => PreSettings {
                pre: PreType::Qwen2,
                ..PreSettings::plain()
            },
            "gpt-4o" | "llama4" | "kanana2" | "talkie" => PreSettings {
                pre: PreType::Gpt4o,
                clean_spaces: false,
                ..PreSettings::plain()
            },
            "granite-embed-multi-97m" => PreSettings {
                pre: PreType::GraniteEmbMulti,
                clean_spaces: false,
                ignore_merges: true,
                ..PreSettings::plain()
            },
            "tiny_aya" | "cohere2moe" => PreSettings {
                pre: PreType::TinyAya,
                clean_spaces: false,
                ..PreSettings::plain()
            },
            "superbpe" => PreSettings {
                pre: PreType::Superbpe,
                clean_spaces: false,
                ..PreSettings::plain()
            },
            "trillion" => PreSettings {
                pre: PreType::Trillion,
                clean_spaces: false,
                ..PreSettings::plain()
            },
            "granite-docling" => PreSettings {
                pre: PreType::GraniteDocling,
                clean_spaces: false,
                ..PreSettings::plain()
            },
            "bailingmoe" | "bailingmoe2" | "llada-moe" => PreSettings {
                pre: PreType::Bailingmoe,
                clean_spaces: false,
                ..PreSettings::plain()
            },
            "seed-coder" => PreSettings {
                pre: PreType::SeedCoder,
                clean_spaces: false,
                ..PreSettings::plain()
            },
            "hunyuan" => PreSettings {
                pre: PreType::Hunyuan,
                clean_spaces: false,
                ..PreSettings::plain()
            },
            "hunyuan-dense" => PreSettings {
                pre: PreType::HunyuanDense,
                clean_spaces: false,
                ..PreSettings::plain()
            },
            "hy_v4" => PreSettings {
                pre: PreType::HyV4,
                clean_spaces: false,
                ..PreSettings::plain()
            },
            "joyai-llm" => PreSettings {
                pre: PreType::JoyaiLlm,
                clean_spaces: false,
                ..PreSettings::plain()
            },
            "kimi-k2" => PreSettings {
                pre: PreType::KimiK2,
                clean_spaces: false,
                ..PreSettings::plain()
            },
            "ufakzeka" => PreSettings {
                pre: PreType::Ufakzeka,
                clean_spaces: false,
                ..PreSettings::plain()
            },
            "grok-2" => PreSettings {
                pre: PreType::Grok2,
                clean_spaces: false,
                ..PreSettings::plain()
            },
            "afmoe" => PreSettings {
                pre: PreType::Afmoe,
                clean_spaces: false,
                ..PreSettings::plain()
            },
            "laguna" => PreSettings {
                pre: PreType::Laguna,
                clean_spaces: false,
                ..PreSettings::plain()
            },
            "minimax-m2" => PreSettings {
                pre: PreType::MinimaxM2,
                clean_spaces: false,
                ..PreSettings::plain()
            },
            "solar-open" => PreSettings {
                pre: PreType::SolarOpen,
                clean_spaces: false,
                ..PreSettings::plain()
            },
            "mellum2" => PreSettings {
                pre: PreType::Mellum2,
                ..PreSettings::plain()
            },
            _ => return None,
        })
    }
}

impl PreType {
    /// The name of the `llama_vocab_pre_type` value without its `LLAMA_VOCAB_PRE_TYPE_` prefix.
    #[must_use]
    pub fn llama_cpp_name(self) -> &'static str {
        match self {
            Self::Default => "DEFAULT",
            Self::Minicpm5 => "MINICPM5",
            Self::Llama3 => "LLAMA3",
            Self::DeepseekLlm => "DEEPSEEK_LLM",
            Self::DeepseekCoder => "DEEPSEEK_CODER",
            Self::Deepseek3Llm => "DEEPSEEK3_LLM",
            Self::Spark25 => "SPARK2_5",
            Self::Youtu => "YOUTU",
            Self::Falcon => "FALCON",
            Self::Mpt => "MPT",
            Self::Starcoder => "STARCODER",
            Self::Gpt2 => "GPT2",
            Self::Jais2 => "JAIS2",
            Self::Gemma4 => "GEMMA4",
            Self::SarvamMoe => "SARVAM_MOE",
            Self::Whitespace => "WHITESPACE",
            Self::Refact => "REFACT",
            Self::CommandR => "COMMAND_R",
            Self::Qwen2 => "QWEN2",
            Self::Qwen35 => "QWEN35",
            Self::Stablelm2 => "STABLELM2",
            Self::Olmo => "OLMO",
            Self::Dbrx => "DBRX",
            Self::Smaug => "SMAUG",
            Self::Poro => "PORO",
            Self::Chatglm4 => "CHATGLM4",
            Self::Viking => "VIKING",
            Self::Jais => "JAIS",
            Self::Tekken => "TEKKEN",
            Self::Smollm => "SMOLLM",
            Self::Codeshell => "CODESHELL",
            Self::Bloom => "BLOOM",
            Self::Gpt3Finnish => "GPT3_FINNISH",
            Self::Exaone => "EXAONE",
            Self::ExaoneMoe => "EXAONE_MOE",
            Self::Chameleon => "CHAMELEON",
            Self::Minerva => "MINERVA",
            Self::Gpt4o => "GPT4O",
            Self::GraniteEmbMulti => "GRANITE_EMB_MULTI",
            Self::TinyAya => "TINY_AYA",
            Self::Superbpe => "SUPERBPE",
            Self::Trillion => "TRILLION",
            Self::GraniteDocling => "GRANITE_DOCLING",
            Self::Bailingmoe => "BAILINGMOE",
            Self::SeedCoder => "SEED_CODER",
            Self::Hunyuan => "HUNYUAN",
            Self::HunyuanDense => "HUNYUAN_DENSE",
            Self::HyV4 => "HY_V4",
            Self::JoyaiLlm => "JOYAI_LLM",
            Self::KimiK2 => "KIMI_K2",
            Self::Ufakzeka => "UFAKZEKA",
            Self::Grok2 => "GROK_2",
            Self::Afmoe => "AFMOE",
            Self::Laguna => "LAGUNA",
            Self::MinimaxM2 => "MINIMAX_M2",
            Self::SolarOpen => "SOLAR_OPEN",
            Self::Mellum2 => "MELLUM2",
        }
    }

    /// The regexes llama.cpp applies for this type, in order, and whether words are then
    /// mapped to GPT-2's byte-level alphabet (false for SentencePiece-style BPE vocabularies).
    #[must_use]
    pub fn regex_exprs(self) -> (&'static [&'static str], bool) {
        match self {
            PreType::Llama3 => (
                &[
                    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
                ],
                true,
            ),
            PreType::Jais2 => (
                &[
                    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s{512}(?!\\S)|\\s{256}(?!\\S)|\\s{128}(?!\\S)|\\s{64}(?!\\S)|\\s{32}(?!\\S)|\\s{16}(?!\\S)|\\s{8}(?!\\S)|\\s{4}(?!\\S)|\\s{1,2}(?!\\S)|\\s{1}",
                ],
                true,
            ),
            PreType::Dbrx | PreType::Smaug => (
                &[
                    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
                ],
                true,
            ),
            PreType::DeepseekLlm => (
                &[
                    "[\r\n]",
                    "\\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-ώᾀ-ᾴᾶ-ᾼιῂ-ῄῆ-ῌῐ-ΐῖ-Ίῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤΩℨK-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+",
                    "\\s?[!-/:-~！-／：-～‘-‟　-。]+",
                    "\\s+$",
                    "[一-龥ࠀ-一가-퟿]+",
                    "\\p{N}+",
                ],
                true,
            ),
            PreType::Deepseek3Llm | PreType::HunyuanDense | PreType::JoyaiLlm | PreType::HyV4 => (
                &[
                    "\\p{N}{1,3}",
                    "[一-龥぀-ゟ゠-ヿ]+",
                    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
                ],
                true,
            ),
            PreType::Spark25 => (
                &[
                    "\\p{N}{1,3}",
                    "[一-龥぀-ゟ゠-ヿ]+",
                    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+|[\r\n]|\\s+(?!\\S)|\\s+",
                    "\\p{N}",
                ],
                true,
            ),
            PreType::Youtu => (
                &[
                    "[가-힣ㄱ-ㆎ]+|[！…“”‘’—：；，、-〿︰-﹏]+|[ㄅ-ㄯ]+|[一-龥぀-ゟ゠-ヿ]+",
                    "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
                ],
                true,
            ),
            PreType::DeepseekCoder => (
                &[
                    "[\r\n]",
                    "\\s?\\p{L}+",
                    "\\s?\\p{P}+",
                    "[一-龥ࠀ-一가-퟿]+",
                    "\\p{N}",
                ],
                true,
            ),
            PreType::Falcon => (
                &[
                    "[\\p{P}\\$\\+<=>\\^~\\|`]+",
                    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)",
                    "[0-9][0-9][0-9]",
                ],
                true,
            ),
            PreType::Starcoder
            | PreType::Refact
            | PreType::CommandR
            | PreType::Smollm
            | PreType::Codeshell
            | PreType::Exaone
            | PreType::Minerva
            | PreType::Mellum2 => (
                &[
                    "\\p{N}",
                    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)",
                ],
                true,
            ),
            PreType::Gpt2
            | PreType::Mpt
            | PreType::Olmo
            | PreType::Jais
            | PreType::Trillion
            | PreType::GraniteDocling => (
                &["'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)"],
                true,
            ),
            PreType::Stablelm2 | PreType::Qwen2 | PreType::Hunyuan | PreType::SolarOpen => (
                &[
                    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
                ],
                true,
            ),
            PreType::Qwen35 => (
                &[
                    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?[\\p{L}\\p{M}]+|\\p{N}| ?[^\\s\\p{L}\\p{M}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
                ],
                true,
            ),
            PreType::Poro | PreType::Bloom | PreType::Gpt3Finnish => {
                (&[" ?[^(\\s|.,!?…。，、।۔،)]+"], true)
            }
            PreType::Chatglm4 => (
                &[
                    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
                ],
                true,
            ),
            PreType::Viking => (&[" ?[^(\\s|.,!?…。，、।۔،)]+", "\\p{N}"], true),
            PreType::Tekken => (
                &[
                    "[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))*((?=[\\p{L}])([^A-Z]))+|[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))+((?=[\\p{L}])([^A-Z]))*|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
                ],
                true,
            ),
            PreType::Chameleon => (
                &[
                    "<sentinel:[0-9]+>",
                    "(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z",
                    "([\\t\\n]|    |  )",
                    "\\p{N}",
                    "[\\p{P}!-/:-@\\[-`{-~]",
                    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)",
                ],
                true,
            ),
            PreType::Gpt4o | PreType::MinimaxM2 => (
                &[
                    "[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))*((?=[\\p{L}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))+((?=[\\p{L}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
                ],
                true,
            ),
            PreType::GraniteEmbMulti => (
                &[
                    "[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}\\p{M}])([^a-z]))*((?=[\\p{L}\\p{M}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}\\p{M}])([^a-z]))+((?=[\\p{L}\\p{M}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
                ],
                true,
            ),
            PreType::TinyAya => (
                &[
                    "\\d{1,3}(?=(?:\\d{3})*\\b)",
                    "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
                ],
                true,
            ),
            PreType::KimiK2 => (&["\\p{Han}+"], true),
            PreType::Superbpe => (&["\\p{N}+", "(?=(\\d{3})+(?!\\d))"], true),
            PreType::Bailingmoe => (
                &[
                    "'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]|\\s+(?!\\S)|\\s+",
                ],
                true,
            ),
            PreType::SeedCoder => (
                &[
                    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1}| ?[^\\s\\p{L}\\p{N}\\r\\n]+|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
                ],
                true,
            ),
            PreType::Ufakzeka => (
                &[
                    "[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
                ],
                true,
            ),
            PreType::Grok2 => (
                &[
                    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
                ],
                true,
            ),
            PreType::Afmoe => (
                &[
                    "\\p{AFMoE_digits}",
                    "[一-鿿㐀-䶿豈-﫿぀-ゟ゠-ヿ･-ﾟ⼀-⿟เ-๿຀-໿ក-៿က-႟ꩠ-ꩿꧠ-꧿가-힯ᄀ-ᇿ]+",
                    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\\r\\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
                ],
                true,
            ),
            PreType::Laguna => (
                &[
                    "[^\\n]+|[\\n]+",
                    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
                ],
                true,
            ),
            PreType::ExaoneMoe => (
                &[
                    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?(?:\\p{L}\\p{M}*(?: \\p{L}\\p{M}*)*)+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]?|\\s*[\\r\\n]|\\s+(?!\\S)|\\s+",
                ],
                true,
            ),
            PreType::Gemma4 => (&["[^\\n]+|[\\n]+"], false),
            PreType::SarvamMoe => (&["[^\\n]+|[\\n]+"], false),
            PreType::Minicpm5 => (
                &[
                    "\\p{N}{1,3}",
                    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}+| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
                ],
                true,
            ),
            PreType::Whitespace => (&["\\S+"], false),
            PreType::Default => (
                &[
                    "[\\p{P}\\$\\+<=>\\^~\\|]+",
                    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)",
                    "\\p{N}+",
                    "[0-9][0-9][0-9]",
                ],
                true,
            ),
        }
    }
}

/// llama.cpp's hand-written splitters (`unicode_regex_split_custom_*`), chosen by the exact
/// text of the regex they stand for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Custom {
    Gpt2,
    Llama3,
    Qwen2,
    Qwen35,
    KimiK2,
    /// Digit runs grouped by threes from the right (`\p{AFMoE_digits}` and tiny_aya's regex).
    Afmoe,
    /// `[^\n]+|[\n]+`.
    Newlines,
    /// `\p{N}`: every number code point on its own. llama.cpp runs this one through
    /// `std::regex` on collapsed text; isolating the code points it collapses to the number
    /// class (ASCII digits, and non-whitespace code points of category N) is the same split.
    Numbers,
}

impl Custom {
    /// `unicode_regex_split_custom`'s dispatch.
    fn for_regex(expr: &str) -> Option<Self> {
        Some(match expr {
            "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)" => {
                Self::Gpt2
            }
            "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
            | "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+" => {
                Self::Llama3
            }
            "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+" => {
                Self::Qwen2
            }
            "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?[\\p{L}\\p{M}]+|\\p{N}| ?[^\\s\\p{L}\\p{M}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+" => {
                Self::Qwen35
            }
            "\\p{Han}+" => Self::KimiK2,
            "\\p{AFMoE_digits}" | "\\d{1,3}(?=(?:\\d{3})*\\b)" => Self::Afmoe,
            "[^\\n]+|[\\n]+" => Self::Newlines,
            "\\p{N}" => Self::Numbers,
            _ => return None,
        })
    }
}

#[derive(Debug)]
enum Step {
    Custom(Custom),
    Regex(Box<CompatRegex>),
}

/// A compiled pre-tokenizer: the steps of one [`PreType`].
///
/// ```
/// use specula_tokenizer::{PreTokenizer, PreType};
///
/// let pre = PreTokenizer::new(PreType::Qwen2)?;
/// assert_eq!(pre.split("Hello world 42!"), ["Hello", " world", " ", "4", "2", "!"]);
/// # Ok::<(), specula_tokenizer::TokenizerError>(())
/// ```
#[derive(Debug)]
pub struct PreTokenizer {
    steps: Vec<Step>,
    pub(crate) byte_encode: bool,
}

/// Code points of the text being split, with their byte offsets and flags.
pub(crate) struct Text {
    pub(crate) cpts: Vec<u32>,
    /// `starts[i]` is the byte offset of code point `i`; `starts[len]` is the text length.
    pub(crate) starts: Vec<usize>,
    pub(crate) flags: Vec<u16>,
}

impl Text {
    pub(crate) fn new(text: &str) -> Self {
        let n = text.len();
        let mut cpts = Vec::with_capacity(n);
        let mut starts = Vec::with_capacity(n + 1);
        let mut fl = Vec::with_capacity(n);
        for (i, c) in text.char_indices() {
            let cpt = u32::from(c);
            cpts.push(cpt);
            starts.push(i);
            fl.push(flags(cpt).0);
        }
        starts.push(n);
        Self {
            cpts,
            starts,
            flags: fl,
        }
    }
}

const OUT_OF_RANGE: u32 = u32::MAX;

/// One range `[ini, end)` of code points, with llama.cpp's accessors that return a sentinel
/// outside it, and the word lengths it emits.
struct Region<'a> {
    cpts: &'a [u32],
    flags: &'a [u16],
    ini: usize,
    end: usize,
    prev_end: usize,
    out: &'a mut Vec<usize>,
}

impl Region<'_> {
    fn cpt(&self, pos: usize) -> u32 {
        if self.ini <= pos && pos < self.end {
            self.cpts[pos]
        } else {
            OUT_OF_RANGE
        }
    }

    fn flags(&self, pos: usize) -> Flags {
        if self.ini <= pos && pos < self.end {
            Flags(self.flags[pos])
        } else {
            Flags::OUT
        }
    }

    /// `_add_token`: emits the word `[prev_end, end)` if it is not empty; returns its length.
    fn add(&mut self, end: usize) -> usize {
        let len = end - self.prev_end;
        if len > 0 {
            self.out.push(len);
        }
        self.prev_end = end;
        len
    }

    /// The case-insensitive contractions `'s 't 'm 'd 're 've 'll` at `pos` (a `'`): the length
    /// to take (2 or 3), or 0. Lowering is ASCII-only here: llama.cpp's `unicode_tolower` maps
    /// nothing but the ASCII capitals onto these letters (checked by gen_unicode_data.py).
    fn contraction(&self, pos: usize, case_insensitive: bool) -> usize {
        let lower = |c: u32| {
            if case_insensitive && (u32::from(b'A')..=u32::from(b'Z')).contains(&c) {
                c + 32
            } else {
                c
            }
        };
        if !(self.cpt(pos) == u32::from(b'\'') && pos + 1 < self.end) {
            return 0;
        }
        let next = lower(self.cpt(pos + 1));
        if [b's', b't', b'm', b'd']
            .iter()
            .any(|&b| next == u32::from(b))
        {
            return 2;
        }
        if pos + 2 < self.end {
            let next2 = lower(self.cpt(pos + 2));
            let is = |a: u8, b: u8| next == u32::from(a) && next2 == u32::from(b);
            if is(b'r', b'e') || is(b'v', b'e') || is(b'l', b'l') {
                return 3;
            }
        }
        0
    }

    /// The tail shared by the Llama-3 family: `\s*[\r\n]+`, `\s+(?!\S)`, `\s+`, else one
    /// code point. Returns the new position.
    fn whitespace_tail(&mut self, pos: usize) -> usize {
        let mut n_ws = 0;
        let mut last_end_r_or_n = 0;
        while self.flags(pos + n_ws).is_whitespace() {
            let c = self.cpt(pos + n_ws);
            if c == u32::from(b'\r') || c == u32::from(b'\n') {
                last_end_r_or_n = pos + n_ws + 1;
            }
            n_ws += 1;
        }
        if last_end_r_or_n > 0 {
            self.add(last_end_r_or_n);
            return last_end_r_or_n;
        }
        if n_ws > 1 && self.cpt(pos + n_ws) != OUT_OF_RANGE {
            let p = pos + n_ws - 1;
            self.add(p);
            return p;
        }
        if n_ws > 0 {
            let p = pos + n_ws;
            self.add(p);
            return p;
        }
        self.add(pos + 1);
        pos + 1
    }
}

fn is_cr_or_lf(c: u32) -> bool {
    c == u32::from(b'\r') || c == u32::from(b'\n')
}

/// `unicode_regex_split_custom_gpt2` on one region.
fn split_gpt2(r: &mut Region<'_>) {
    let mut pos = r.ini;
    while pos < r.end {
        let cpt = r.cpt(pos);
        let f = r.flags(pos);
        let n = r.contraction(pos, false);
        if n > 0 {
            pos += r.add(pos + n);
            continue;
        }
        let space = cpt == u32::from(b' ');
        let mut f2 = if space { r.flags(pos + 1) } else { f };
        // <space>?\p{L}+
        if f2.is_letter() {
            pos += usize::from(space);
            while f2.is_letter() {
                pos += 1;
                f2 = r.flags(pos);
            }
            r.add(pos);
            continue;
        }
        // <space>?\p{N}+
        if f2.is_number() {
            pos += usize::from(space);
            while f2.is_number() {
                pos += 1;
                f2 = r.flags(pos);
            }
            r.add(pos);
            continue;
        }
        // <space>?[^\s\p{L}\p{N}]+
        let other = |f: Flags| !(f.is_whitespace() || f.is_letter() || f.is_number()) && f.any();
        if other(f2) {
            pos += usize::from(space);
            while other(f2) {
                pos += 1;
                f2 = r.flags(pos);
            }
            r.add(pos);
            continue;
        }
        let mut n_ws = 0;
        while r.flags(pos + n_ws).is_whitespace() {
            n_ws += 1;
        }
        // \s+(?!\S)
        if n_ws > 1 && r.cpt(pos + n_ws) != OUT_OF_RANGE {
            pos += n_ws - 1;
            r.add(pos);
            continue;
        }
        // \s+
        if n_ws > 0 {
            pos += n_ws;
            r.add(pos);
            continue;
        }
        pos += 1;
        r.add(pos);
    }
}

/// `unicode_regex_split_custom_llama3` (`three_digits`) and `_qwen2` (single digits); with
/// `marks`, `_qwen35` (letter runs also take `\p{M}`).
fn split_llama3_family(r: &mut Region<'_>, three_digits: bool, marks: bool) {
    let letterish = |f: Flags| f.is_letter() || (marks && f.is_accent_mark());
    let mut pos = r.ini;
    while pos < r.end {
        let cpt = r.cpt(pos);
        let f = r.flags(pos);
        let n = r.contraction(pos, true);
        if n > 0 {
            pos += r.add(pos + n);
            continue;
        }
        // [^\r\n\p{L}\p{N}]?\p{L}+   (qwen35: [\p{L}\p{M}]+)
        if !(is_cr_or_lf(cpt) || f.is_number()) && (letterish(f) || letterish(r.flags(pos + 1))) {
            pos += 1;
            while letterish(r.flags(pos)) {
                pos += 1;
            }
            r.add(pos);
            continue;
        }
        if f.is_number() {
            if three_digits {
                // \p{N}{1,3}
                let mut ini = pos;
                while r.flags(pos).is_number() {
                    pos += 1;
                    if pos - ini >= 3 {
                        r.add(pos);
                        ini = pos;
                    }
                }
                r.add(pos);
            } else {
                // \p{N}
                pos += 1;
                r.add(pos);
            }
            continue;
        }
        // <space>?[^\s\p{L}\p{N}]+[\r\n]*   (qwen35: also not \p{M})
        let space = cpt == u32::from(b' ');
        let mut f2 = if space { r.flags(pos + 1) } else { f };
        let other = |f: Flags| !(f.is_whitespace() || letterish(f) || f.is_number());
        if other(f2) && f.any() {
            pos += usize::from(space);
            while other(f2) && f2.any() {
                pos += 1;
                f2 = r.flags(pos);
            }
            while is_cr_or_lf(r.cpt(pos)) {
                pos += 1;
            }
            r.add(pos);
            continue;
        }
        pos = r.whitespace_tail(pos);
    }
}

/// Han code points as llama.cpp's `unicode_cpt_is_han`.
fn is_han(c: u32) -> bool {
    matches!(c,
        0x4E00..=0x9FFF
        | 0x3400..=0x4DBF
        | 0x2_0000..=0x2_A6DF
        | 0x2_A700..=0x2_B73F
        | 0x2_B740..=0x2_B81F
        | 0x2_B820..=0x2_CEAF
        | 0x2_CEB0..=0x2_EBEF
        | 0xF900..=0xFAFF
        | 0x2_F800..=0x2_FA1F)
}

/// `unicode_regex_split_custom_kimi_k2`.
fn split_kimi_k2(r: &mut Region<'_>) {
    let mut pos = r.ini;
    while pos < r.end {
        let cpt = r.cpt(pos);
        let f = r.flags(pos);
        // [\p{Han}]+
        if is_han(cpt) {
            while is_han(r.cpt(pos)) {
                pos += 1;
            }
            r.add(pos);
            continue;
        }
        let letter_not_han = |r: &Region<'_>, p: usize| r.flags(p).is_letter() && !is_han(r.cpt(p));
        let can_lead = !(is_cr_or_lf(cpt) || f.is_letter() || f.is_number());
        let is_letter_pattern =
            (f.is_letter() && !is_han(cpt)) || (can_lead && letter_not_han(r, pos + 1));
        if is_letter_pattern {
            let mut has_leading_char = false;
            if can_lead {
                has_leading_char = true;
                pos += 1;
            }
            let mut has_letters = false;
            while letter_not_han(r, pos) {
                has_letters = true;
                pos += 1;
            }
            if has_letters || (!has_leading_char && letter_not_han(r, pos)) {
                if !has_letters {
                    pos += 1;
                }
                while letter_not_han(r, pos) {
                    pos += 1;
                }
                if r.cpt(pos) == u32::from(b'\'') && pos + 1 < r.end {
                    let lower = |c: u32| {
                        if (u32::from(b'A')..=u32::from(b'Z')).contains(&c) {
                            c + 32
                        } else {
                            c
                        }
                    };
                    let next = lower(r.cpt(pos + 1));
                    if [b's', b't', b'm', b'd']
                        .iter()
                        .any(|&b| next == u32::from(b))
                    {
                        pos += 2;
                    } else if pos + 2 < r.end {
                        let next2 = lower(r.cpt(pos + 2));
                        let is = |a: u8, b: u8| next == u32::from(a) && next2 == u32::from(b);
                        if is(b'r', b'e') || is(b'v', b'e') || is(b'l', b'l') {
                            pos += 3;
                        }
                    }
                }
                r.add(pos);
                continue;
            } else if has_leading_char {
                pos -= 1;
            }
        }
        // \p{N}{1,3}
        if f.is_number() {
            let mut ini = pos;
            while r.flags(pos).is_number() {
                pos += 1;
                if pos - ini >= 3 {
                    r.add(pos);
                    ini = pos;
                }
            }
            r.add(pos);
            continue;
        }
        // <space>?[^\s\p{L}\p{N}]+[\r\n]*
        let space = cpt == u32::from(b' ');
        let mut f2 = if space { r.flags(pos + 1) } else { f };
        let other = |f: Flags| !(f.is_whitespace() || f.is_letter() || f.is_number()) && f.any();
        if other(f2) {
            pos += usize::from(space);
            while other(f2) {
                pos += 1;
                f2 = r.flags(pos);
            }
            while is_cr_or_lf(r.cpt(pos)) {
                pos += 1;
            }
            r.add(pos);
            continue;
        }
        pos = r.whitespace_tail(pos);
    }
}

/// `unicode_regex_split_custom_afmoe`: digit runs split into a leading group of `len % 3`
/// and then groups of three; everything between digit runs stays one piece.
fn split_afmoe(r: &mut Region<'_>) {
    let mut pos = r.ini;
    while pos < r.end {
        if r.flags(pos).is_number() {
            let start = pos;
            while r.flags(pos).is_number() && pos < r.end {
                pos += 1;
            }
            let count = pos - start;
            let mut current = start;
            let rem = count % 3;
            if rem > 0 {
                r.add(current + rem);
                current += rem;
            }
            while current < start + count {
                r.add(current + 3);
                current += 3;
            }
            continue;
        }
        pos += 1;
    }
    if r.prev_end < r.end {
        let end = r.end;
        r.add(end);
    }
}

/// `unicode_regex_split_custom_newlines`: runs of `\n` and runs of anything else.
fn split_newlines(r: &mut Region<'_>) {
    let mut pos = r.ini;
    while pos < r.end {
        let newline = r.cpts[pos] == u32::from(b'\n');
        let start = pos;
        while pos < r.end && (r.cpts[pos] == u32::from(b'\n')) == newline {
            pos += 1;
        }
        r.out.push(pos - start);
    }
}

/// `\p{N}` as llama.cpp's collapsed `std::regex` matches it: each number isolated.
fn split_numbers(r: &mut Region<'_>) {
    for pos in r.ini..r.end {
        let f = Flags(r.flags[pos]);
        let is_number = if r.cpts[pos] < 128 {
            f.is_number()
        } else {
            !f.is_whitespace() && f.category() == crate::unicode::bits::NUMBER
        };
        if is_number {
            r.add(pos);
            r.add(pos + 1);
        }
    }
    let end = r.end;
    r.add(end);
}

impl PreTokenizer {
    /// Compiles the steps of `pre`.
    ///
    /// # Errors
    /// [`TokenizerError::Regex`] if one of its regexes cannot be translated (none of
    /// llama.cpp's can fail).
    pub fn new(pre: PreType) -> Result<Self, TokenizerError> {
        let (exprs, byte_encode) = pre.regex_exprs();
        let steps = exprs
            .iter()
            .map(|e| match Custom::for_regex(e) {
                Some(c) => Ok(Step::Custom(c)),
                None => CompatRegex::new(e)
                    .map(|r| Step::Regex(Box::new(r)))
                    .map_err(|reason| TokenizerError::Regex {
                        pre: format!("{pre:?}"),
                        regex: (*e).to_owned(),
                        reason,
                    }),
            })
            .collect::<Result<_, _>>()?;
        Ok(Self { steps, byte_encode })
    }

    /// Cuts `text` into words as llama.cpp's `unicode_regex_split` (before byte encoding).
    #[must_use]
    pub fn split<'a>(&self, text: &'a str) -> Vec<&'a str> {
        let mut ranges = Vec::new();
        self.split_ranges(text, &mut ranges);
        ranges.into_iter().map(|(s, e)| &text[s..e]).collect()
    }

    /// Whether words are mapped to GPT-2's byte-level alphabet before merging.
    #[must_use]
    pub fn byte_encode(&self) -> bool {
        self.byte_encode
    }

    /// Cuts `text` into words, appending their byte ranges to `words`. Empty words are left
    /// out.
    pub(crate) fn split_ranges(&self, text: &str, words: &mut Vec<(usize, usize)>) {
        if text.is_empty() {
            return;
        }
        let t = Text::new(text);
        let mut offsets = vec![t.cpts.len()];
        let mut next = Vec::with_capacity(text.len() / 3 + 1);
        for step in &self.steps {
            next.clear();
            match step {
                Step::Custom(c) => {
                    let mut start = 0;
                    for &len in &offsets {
                        let mut r = Region {
                            cpts: &t.cpts,
                            flags: &t.flags,
                            ini: start,
                            end: start + len,
                            prev_end: start,
                            out: &mut next,
                        };
                        match c {
                            Custom::Gpt2 => split_gpt2(&mut r),
                            Custom::Llama3 => split_llama3_family(&mut r, true, false),
                            Custom::Qwen2 => split_llama3_family(&mut r, false, false),
                            Custom::Qwen35 => split_llama3_family(&mut r, false, true),
                            Custom::KimiK2 => split_kimi_k2(&mut r),
                            Custom::Afmoe => split_afmoe(&mut r),
                            Custom::Newlines => split_newlines(&mut r),
                            Custom::Numbers => split_numbers(&mut r),
                        }
                        start += len;
                    }
                }
                Step::Regex(re) => re.split(&t, &offsets, &mut next),
            }
            std::mem::swap(&mut offsets, &mut next);
        }
        let mut start = 0;
        for len in offsets {
            if len > 0 {
                words.push((t.starts[start], t.starts[start + len]));
            }
            start += len;
        }
    }
}
