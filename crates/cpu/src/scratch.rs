//! Per-thread scratch memory for the ops that need a few temporary values per row (RoPE angles,
//! attention scores). Each pool thread keeps one buffer for the life of the thread and grows it
//! to the largest size asked for, so ops allocate only while shapes grow.

use std::cell::RefCell;

thread_local! {
    static F32: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f` with this thread's scratch buffer, at least `n` values long (contents unspecified).
///
/// # Panics
/// If called again from inside `f` on the same thread.
pub(crate) fn with_f32<R>(n: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
    F32.with(|cell| {
        let mut buf = cell.borrow_mut();
        if buf.len() < n {
            buf.resize(n, 0.0);
        }
        f(&mut buf[..n])
    })
}
