//! The drafters that drive a model, in one home: [`DraftModel`] (a smaller model of the
//! target's vocabulary, its own cache), [`DflashDrafter`] (a DFlash block drafter fed with the
//! target's hidden states by KV injection) and [`Eagle3Drafter`] (an EAGLE-3 head drafting a
//! chain in feature space). Each is a per-sequence [`specula_spec::Drafter`]; a server serves
//! one per slot through [`specula_spec::PerSeq`], every active sequence in one
//! [`specula_spec::BatchDrafter`] call.

mod dflash;
mod draft_model;
mod eagle3;
mod rows;

pub use dflash::{DflashDrafter, Injection};
pub use draft_model::{DraftModel, VocabMismatch, check_vocab, frequent_tokens};
pub use eagle3::Eagle3Drafter;
