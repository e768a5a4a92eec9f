//! A session's state as bytes — its positions, its sliding-window ring and the stored KV cells
//! of those positions — for a server slot saved to a file and restored later
//! ([`Engine::save_session`], [`Engine::load_session`]).
//!
//! The layout (little-endian): the cache's layout signature (length-prefixed text naming every
//! layer's K/V formats, stored widths and cells), the positions held (`u64`), the ring's cell
//! positions when the session keeps one (`u8` flag, `u32` count, `u32` each), then the
//! backend's export of the KV cells ([`specula_tensor::Backend::kv_export`]). Loading checks
//! each part against the session and fails with what differs; the session is left empty then.

use specula_tensor::Backend;

use crate::{Engine, EngineError, Result, Session, SwaRing};

/// What a session's cache looks like, as text: two sessions load each other's state exactly
/// when their signatures are equal.
fn signature<B: Backend>(s: &Session<B>) -> String {
    let shape = &s.layout.shape;
    let mut sig = format!(
        "heads {} k {} v {}",
        shape.n_kv_head, shape.head_dim_k, shape.head_dim_v
    );
    for h in &shape.heads {
        sig.push_str(&format!(
            " {}x{}/{}",
            h.n_kv_head, h.head_dim_k, h.head_dim_v
        ));
    }
    for (i, l) in s.layout.layers.iter().enumerate() {
        let cells = if shape.layer_cells(i) == shape.n_ctx {
            "ctx".to_owned()
        } else {
            shape.layer_cells(i).to_string()
        };
        sig.push_str(&format!(
            "; {}:{}x{}/{}x{}@{cells}",
            i, l.types.k, l.k_dim, l.types.v, l.v_dim
        ));
    }
    sig
}

/// A reader over saved state that names what is missing.
struct Reader<'a> {
    bytes: &'a [u8],
    off: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        let end = self.off.checked_add(n).filter(|&e| e <= self.bytes.len());
        let Some(end) = end else {
            return Err(EngineError::SessionState(format!(
                "truncated: {what} needs {n} bytes, {} are left",
                self.bytes.len() - self.off
            )));
        };
        let b = &self.bytes[self.off..end];
        self.off = end;
        Ok(b)
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        let b = self.take(4, what)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        let b = self.take(8, what)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }
}

impl<B: Backend> Engine<B> {
    /// Appends the state of `s` — what it holds, nothing past its positions — to `out`, for
    /// [`Engine::load_session`] into a session of the same cache layout.
    ///
    /// # Errors
    /// When the backend cannot export its cache.
    pub fn save_session(&self, s: &Session<B>, out: &mut Vec<u8>) -> Result<()> {
        let sig = signature(s);
        out.extend_from_slice(&u32::try_from(sig.len()).unwrap_or(u32::MAX).to_le_bytes());
        out.extend_from_slice(sig.as_bytes());
        out.extend_from_slice(&(s.n_past as u64).to_le_bytes());
        match &s.ring {
            Some(r) => {
                out.push(1);
                out.extend_from_slice(
                    &u32::try_from(r.pos.len()).unwrap_or(u32::MAX).to_le_bytes(),
                );
                for &p in &r.pos {
                    out.extend_from_slice(&p.to_le_bytes());
                }
            }
            None => out.push(0),
        }
        self.backend
            .kv_export(&s.kv, s.n_past, out)
            .map_err(|e| EngineError::Model(e.into()))
    }

    /// Replaces what `s` holds with state [`Engine::save_session`] wrote (all of `bytes`), and
    /// returns the positions it now holds.
    ///
    /// # Errors
    /// [`EngineError::SessionState`] naming what does not fit: another cache layout, more
    /// positions than the session's context, a truncated or overlong state, ring positions
    /// that are not the ring's. On error the session is empty.
    pub fn load_session(&self, s: &mut Session<B>, bytes: &[u8]) -> Result<usize> {
        let r = self.load_inner(s, bytes);
        if r.is_err() {
            s.reset();
        }
        r
    }

    fn load_inner(&self, s: &mut Session<B>, bytes: &[u8]) -> Result<usize> {
        let mut rd = Reader { bytes, off: 0 };
        let n_sig = rd.u32("the layout signature's length")? as usize;
        let sig = rd.take(n_sig, "the layout signature")?;
        let want = signature(s);
        if sig != want.as_bytes() {
            return Err(EngineError::SessionState(format!(
                "saved from a cache of another layout ({}), this one is {want}; save and restore with the same model and -ctk/-ctv",
                String::from_utf8_lossy(sig)
            )));
        }
        let n_past = usize::try_from(rd.u64("the number of positions")?).unwrap_or(usize::MAX);
        if n_past > s.n_ctx {
            return Err(EngineError::SessionState(format!(
                "{n_past} saved positions do not fit a context of {}; restore into a server with a larger -c (or fewer slots)",
                s.n_ctx
            )));
        }
        let flag = rd.take(1, "the ring flag")?[0];
        match (&mut s.ring, flag) {
            (None, 0) => {}
            (Some(ring), 1) => {
                let n = rd.u32("the ring's size")? as usize;
                if n != ring.pos.len() {
                    return Err(EngineError::SessionState(format!(
                        "a ring of {n} cells was saved, this session keeps {}",
                        ring.pos.len()
                    )));
                }
                ring.clear();
                for c in 0..n {
                    let p = rd.u32("a ring cell's position")?;
                    if p != SwaRing::EMPTY {
                        if p as usize >= ring.held.len() || p as usize % n != c {
                            return Err(EngineError::SessionState(format!(
                                "ring cell {c} holds position {p}, which a ring of {n} cells over {} positions cannot",
                                ring.held.len()
                            )));
                        }
                        ring.held[p as usize] = p;
                    }
                    ring.pos[c] = p;
                }
            }
            (_, f) => {
                return Err(EngineError::SessionState(format!(
                    "ring flag {f} does not match this session ({})",
                    if s.ring.is_some() {
                        "it keeps a sliding-window ring"
                    } else {
                        "it keeps no ring"
                    }
                )));
            }
        }
        self.backend
            .kv_import(&mut s.kv, n_past, &bytes[rd.off..])
            .map_err(|e| EngineError::SessionState(format!("the KV cells: {e}")))?;
        s.n_past = n_past;
        // The recurrent layers hold the state of `n_past` and nothing else.
        if let Some(r) = &mut s.recurrent {
            r.start = n_past;
            r.end = n_past;
        }
        Ok(n_past)
    }
}
