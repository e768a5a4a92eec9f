//! llama-server's slot actions, `POST /slots/{id}?action=save|restore|erase`: a slot's tokens
//! and KV cache written to a file under `--slot-save-path` and read back later (into any slot
//! of a server with the same model and cache formats), or the slot emptied. The answers are
//! llama-server's (`server_task_result_slot_save_load` / `_slot_erase` of `server-task.cpp`);
//! an action on a busy slot waits until the slot is free, as llama-server defers it.
//!
//! The file (little-endian), written to a temporary file beside it, synced, then renamed over
//! the name asked for, so that a reader never sees half a file:
//!
//! | bytes | what |
//! |---|---|
//! | 8 | magic `SPECSLOT` |
//! | 4 | format version ([`VERSION`]) |
//! | 8 | the model's fingerprint ([`fingerprint`]: its hyperparameters and vocabulary) |
//! | 4 + 4·n | the slot's `n` tokens |
//! | 8 + m | the slot's session state, `m` bytes ([`specula_engine::Engine::save_session`]) |
//! | 8 | FNV-1a 64 of every byte before it |
//!
//! Reading checks the magic, the version, the length, the checksum, the fingerprint, the
//! tokens (in the vocabulary, as many as the state's positions, within the slot's context)
//! and the state's cache layout, and answers what is wrong; the slot is left empty then.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path as UrlPath, State};
use axum::http::Uri;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use serde_json::{Value, json};
use specula_engine::{Engine, Session};
use specula_tensor::Backend;
use tokio::sync::oneshot;

use crate::http::{ApiError, AppState, body_bytes, parse};
use crate::worker::Command;

/// The file's first bytes.
const MAGIC: &[u8; 8] = b"SPECSLOT";
/// The format version this build writes and reads.
pub(crate) const VERSION: u32 = 1;

/// What to do with a slot.
#[derive(Debug)]
pub(crate) enum Action {
    /// Write the slot to `path` (`filename` under `--slot-save-path`).
    Save { filename: String, path: PathBuf },
    /// Read the slot back from `path`.
    Restore { filename: String, path: PathBuf },
    /// Empty the slot.
    Erase,
}

/// A slot action for the engine thread, and where its answer goes.
#[derive(Debug)]
pub(crate) struct SlotRequest {
    /// The slot (checked by the engine thread against the slots it has).
    pub id: i64,
    pub action: Action,
    pub reply: oneshot::Sender<Result<Value, ApiError>>,
}

/// The route (merged into the application by `http::router`).
pub(crate) fn routes() -> Router<AppState> {
    Router::new().route("/slots/{id_slot}", post(slot_action))
}

/// `POST /slots/{id_slot}?action=…`, checked in llama-server's order: the feature, the slot id,
/// the action, the filename.
async fn slot_action(
    State(st): State<AppState>,
    UrlPath(id): UrlPath<String>,
    uri: Uri,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    match prepare(&st, &id, &uri, body) {
        Ok((id, action)) => {
            let (tx, rx) = oneshot::channel();
            let req = SlotRequest {
                id,
                action,
                reply: tx,
            };
            if st.tx.send(Command::Slot(Box::new(req))).is_err() {
                return ApiError::new(503, "the engine has stopped").into_response();
            }
            match rx.await {
                Ok(Ok(v)) => axum::Json(v).into_response(),
                Ok(Err(e)) => e.into_response(),
                Err(_) => ApiError::new(503, "the engine has stopped").into_response(),
            }
        }
        Err(e) => e.into_response(),
    }
}

fn prepare(
    st: &AppState,
    id: &str,
    uri: &Uri,
    body: Result<Bytes, BytesRejection>,
) -> Result<(i64, Action), ApiError> {
    let Some(dir) = st.limits.slot_save_path.as_deref() else {
        return Err(ApiError::new(
            501,
            "This server does not support slots action. Start it with `--slot-save-path`",
        ));
    };
    let id: i64 = id
        .trim()
        .parse()
        .map_err(|_| ApiError::bad("Invalid slot ID"))?;
    let action = uri
        .query()
        .unwrap_or("")
        .split('&')
        .find_map(|kv| kv.strip_prefix("action="))
        .unwrap_or("");
    let filename = |body: Result<Bytes, BytesRejection>| -> Result<(String, PathBuf), ApiError> {
        let v: Value = parse(&body_bytes(st, body)?)?;
        let name = v
            .get("filename")
            .and_then(Value::as_str)
            .ok_or_else(|| ApiError::bad("\"filename\" must be provided as a string"))?;
        if !valid_filename(name) {
            return Err(ApiError::bad("Invalid filename"));
        }
        Ok((name.to_owned(), dir.join(name)))
    };
    let action = match action {
        "save" => {
            let (filename, path) = filename(body)?;
            Action::Save { filename, path }
        }
        "restore" => {
            let (filename, path) = filename(body)?;
            Action::Restore { filename, path }
        }
        "erase" => Action::Erase,
        _ => return Err(ApiError::bad("Invalid action")),
    };
    Ok((id, action))
}

/// llama.cpp's `fs_validate_filename` (without subdirectories): no empty or overlong name, no
/// control characters, path separators, `..`, reserved characters or their Unicode look-alikes,
/// no leading or trailing space, no trailing dot.
pub(crate) fn valid_filename(name: &str) -> bool {
    if name.is_empty() || name.len() > 255 {
        return false;
    }
    let bad = |c: char| {
        let u = u32::from(c);
        u <= 0x1F
            || u == 0x7F
            || (0x80..=0x9F).contains(&u)
            || matches!(
                c,
                '\u{FF0E}'
                    | '\u{2215}'
                    | '\u{2216}'
                    | '\u{FFFD}'
                    | '\u{FEFF}'
                    | ':'
                    | '*'
                    | '?'
                    | '"'
                    | '<'
                    | '>'
                    | '|'
                    | '/'
                    | '\\'
            )
    };
    !(name.chars().any(bad)
        || name.starts_with(' ')
        || name.ends_with(' ')
        || name.ends_with('.')
        || name.contains(".."))
}

/// FNV-1a, 64 bits.
fn fnv1a(h: u64, bytes: &[u8]) -> u64 {
    bytes
        .iter()
        .fold(h, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;

/// What a slot file is checked against to belong to this model: a hash of the model's
/// hyperparameters and of every token's text. (Two models of the same shape and vocabulary —
/// fine-tunes of one base — hash alike: the file's KV would load and be wrong for the other.)
pub(crate) fn fingerprint<B: Backend>(engine: &Engine<B>) -> u64 {
    let mut h = fnv1a(
        FNV_OFFSET,
        format!("{:?}", engine.model.hparams()).as_bytes(),
    );
    for id in 0..engine.tokenizer.n_tokens() {
        let id = u32::try_from(id).unwrap_or(u32::MAX);
        h = fnv1a(h, engine.tokenizer.token_text(id).unwrap_or("").as_bytes());
        h = fnv1a(h, &[0xff]);
    }
    h
}

/// What the engine thread needs to run an action on one slot.
pub(crate) struct SlotParts<'a, B: Backend> {
    pub engine: &'a Engine<B>,
    pub session: &'a mut Session<B>,
    /// The tokens the slot's cache holds.
    pub cached: &'a mut Vec<u32>,
    pub fingerprint: u64,
}

/// Runs `action` on a free slot and returns llama-server's answer.
/// `id_slot` is the id as asked (llama-server answers with it, wrapped or not).
pub(crate) fn perform<B: Backend>(
    id_slot: i64,
    action: Action,
    p: SlotParts<'_, B>,
) -> Result<Value, ApiError> {
    let t0 = Instant::now();
    let ms = || t0.elapsed().as_secs_f64() * 1e3;
    match action {
        Action::Erase => {
            let n_erased = p.cached.len();
            p.session.reset();
            p.cached.clear();
            Ok(json!({"id_slot": id_slot, "n_erased": n_erased}))
        }
        Action::Save { filename, path } => {
            let bytes = encode(p.engine, p.session, p.cached, p.fingerprint)
                .map_err(|e| ApiError::new(500, format!("Unable to save slot: {e}")))?;
            write_atomic(&path, &bytes).map_err(|e| {
                ApiError::new(
                    500,
                    format!("Unable to save slot: cannot write {filename}: {e}"),
                )
            })?;
            tracing::info!(slot = id_slot, file = %path.display(), tokens = p.cached.len(), bytes = bytes.len(), "slot saved");
            Ok(json!({
                "id_slot": id_slot,
                "filename": filename,
                "n_saved": p.cached.len(),
                "n_written": bytes.len(),
                "timings": {"save_ms": ms()},
            }))
        }
        Action::Restore { filename, path } => {
            let r = std::fs::read(&path)
                .map_err(|e| format!("cannot read {filename}: {e}"))
                .and_then(|bytes| {
                    let n = decode(p.engine, p.session, p.cached, p.fingerprint, &bytes)?;
                    Ok((n, bytes.len()))
                });
            match r {
                Ok((n, n_read)) => {
                    tracing::info!(slot = id_slot, file = %path.display(), tokens = n, "slot restored");
                    Ok(json!({
                        "id_slot": id_slot,
                        "filename": filename,
                        "n_restored": n,
                        "n_read": n_read,
                        "timings": {"restore_ms": ms()},
                    }))
                }
                Err(e) => {
                    // As llama-server: a failed restore leaves the slot empty.
                    p.session.reset();
                    p.cached.clear();
                    Err(ApiError::bad(format!("Unable to restore slot: {e}")))
                }
            }
        }
    }
}

/// The file's bytes for a slot holding `cached` in `session`.
fn encode<B: Backend>(
    engine: &Engine<B>,
    session: &Session<B>,
    cached: &[u32],
    fingerprint: u64,
) -> Result<Vec<u8>, String> {
    if session.n_past() != cached.len() {
        return Err(format!(
            "the slot's cache holds {} positions for {} tokens",
            session.n_past(),
            cached.len()
        ));
    }
    let mut state = Vec::new();
    engine
        .save_session(session, &mut state)
        .map_err(|e| crate::chain(&e))?;
    let mut out = Vec::with_capacity(40 + 4 * cached.len() + state.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.extend_from_slice(&fingerprint.to_le_bytes());
    let n = u32::try_from(cached.len()).map_err(|_| "too many tokens".to_owned())?;
    out.extend_from_slice(&n.to_le_bytes());
    for &t in cached {
        out.extend_from_slice(&t.to_le_bytes());
    }
    out.extend_from_slice(&(state.len() as u64).to_le_bytes());
    out.extend_from_slice(&state);
    let sum = fnv1a(FNV_OFFSET, &out);
    out.extend_from_slice(&sum.to_le_bytes());
    Ok(out)
}

fn le_u32(b: &[u8], at: usize) -> Option<u32> {
    b.get(at..at + 4)
        .map(|s| u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
}

fn le_u64(b: &[u8], at: usize) -> Option<u64> {
    b.get(at..at + 8).map(|s| {
        let mut a = [0u8; 8];
        a.copy_from_slice(s);
        u64::from_le_bytes(a)
    })
}

/// Checks a slot file and loads it into the slot; returns the tokens restored.
fn decode<B: Backend>(
    engine: &Engine<B>,
    session: &mut Session<B>,
    cached: &mut Vec<u32>,
    fingerprint: u64,
    b: &[u8],
) -> Result<usize, String> {
    const HEAD: usize = 8 + 4 + 8 + 4;
    if b.len() < MAGIC.len() || &b[..MAGIC.len()] != MAGIC {
        return Err("not a specula slot file (bad magic)".into());
    }
    let version = le_u32(b, 8).ok_or("truncated: the file ends in its header")?;
    if version != VERSION {
        return Err(format!(
            "slot file format version {version}; this server reads version {VERSION}"
        ));
    }
    if b.len() < HEAD + 8 + 8 {
        return Err(format!(
            "truncated: {} bytes, shorter than any slot file",
            b.len()
        ));
    }
    let n = le_u32(b, 20).ok_or("truncated header")? as usize;
    let state_at = HEAD + 4 * n;
    let state_len = le_u64(b, state_at)
        .and_then(|l| usize::try_from(l).ok())
        .ok_or_else(|| {
            format!(
                "truncated: {n} tokens need {} bytes, the file has {}",
                state_at + 8,
                b.len()
            )
        })?;
    let want = state_at
        .checked_add(8)
        .and_then(|x| x.checked_add(state_len))
        .and_then(|x| x.checked_add(8))
        .ok_or("corrupt: impossible lengths")?;
    if b.len() != want {
        return Err(format!(
            "{}: the header says {want} bytes, the file has {}",
            if b.len() < want {
                "truncated"
            } else {
                "corrupt"
            },
            b.len()
        ));
    }
    let body = &b[..want - 8];
    let sum = le_u64(b, want - 8).ok_or("truncated checksum")?;
    if fnv1a(FNV_OFFSET, body) != sum {
        return Err("corrupt: the checksum does not match the contents".into());
    }
    if le_u64(b, 12) != Some(fingerprint) {
        return Err(
            "the file was saved from another model (its fingerprint differs from this server's)"
                .into(),
        );
    }
    let n_vocab = engine.model.hparams().n_vocab;
    let tokens: Vec<u32> = (0..n)
        .map(|i| le_u32(b, HEAD + 4 * i).unwrap_or(u32::MAX))
        .collect();
    if let Some(bad) = tokens.iter().find(|&&t| t as usize >= n_vocab) {
        return Err(format!(
            "Invalid tokens in slot save file: token id {bad} is outside the vocabulary of {n_vocab} tokens"
        ));
    }
    if n > session.n_ctx() {
        return Err(format!(
            "Restored prompt does not fit in the slot context: {n} tokens, the slot holds {}",
            session.n_ctx()
        ));
    }
    let state = &b[state_at + 8..want - 8];
    cached.clear();
    let n_past = engine
        .load_session(session, state)
        .map_err(|e| crate::chain(&e))?;
    if n_past != n {
        session.reset();
        return Err(format!(
            "corrupt: {n} tokens for a cache of {n_past} positions"
        ));
    }
    cached.extend_from_slice(&tokens);
    Ok(n)
}

static TEMP: AtomicU64 = AtomicU64::new(0);

/// Writes `bytes` to `path` through a temporary file in the same directory (synced, then
/// renamed over `path`): `path` holds the old file or the new one, never part of one.
fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or_else(|| Path::new("."));
    let name = path
        .file_name()
        .map_or_else(|| "slot".to_owned(), |n| n.to_string_lossy().into_owned());
    let tmp = dir.join(format!(
        ".{name}.{}.{}.tmp",
        std::process::id(),
        TEMP.fetch_add(1, Ordering::Relaxed)
    ));
    let written = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filenames_are_checked_as_llama_cpp_does() {
        for ok in ["slot0.bin", "a b", "résumé.bin", ".hidden", "x.y.z"] {
            assert!(valid_filename(ok), "{ok}");
        }
        for bad in [
            "",
            "../etc/passwd",
            "a/b",
            "a\\b",
            "..",
            ".",
            "x..y",
            "name.",
            " lead",
            "trail ",
            "c:d",
            "a*b",
            "q?",
            "tab\tname",
            "del\u{7f}",
            "fullwidth\u{FF0E}stop",
            "div\u{2215}slash",
            "bom\u{FEFF}",
            &"x".repeat(256),
        ] {
            assert!(!valid_filename(bad), "{bad:?}");
        }
    }
}
