//! A persistent pool of worker threads with a static split of work.
//!
//! The threads are created once, with the backend, and wait between ops: they poll for a short
//! while (ops of one forward pass follow each other within microseconds), yielding between
//! bursts of spinning so that an oversubscribed core still runs the thread being waited for,
//! and then sleep on a condition variable. An op hands the pool one closure; thread `t` of `n` (the calling thread
//! is thread 0) runs it with `t`, and decides from `t` alone which part of the work is its own
//! ([`split`]). No work stealing, no allocation per op: which thread computes an output never
//! changes its value anyway (every output is computed whole by one thread), but a fixed split
//! keeps the schedule reproducible and cheap.

use std::ops::Range;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long an idle worker polls for the next job before it sleeps on the condition variable.
const IDLE_POLL: Duration = Duration::from_micros(200);
/// `spin_loop` rounds between two checks of the clock (and two `yield_now`s) while polling.
const SPINS_PER_YIELD: u32 = 64;

/// Polls `done` until it holds (`true`) or `budget` has passed (`false`). Between short bursts
/// of spinning it yields the CPU, so that a thread it waits for can run on the same core when
/// the machine is oversubscribed (a pure spin would hold the core for its whole time slice).
fn poll(done: impl Fn() -> bool, budget: Option<Duration>) -> bool {
    let start = Instant::now();
    loop {
        for _ in 0..SPINS_PER_YIELD {
            if done() {
                return true;
            }
            std::hint::spin_loop();
        }
        if budget.is_some_and(|b| start.elapsed() > b) {
            return false;
        }
        std::thread::yield_now();
    }
}

/// The closure of one op, as the workers see it.
struct Job<'a> {
    f: &'a (dyn Fn(usize) + Sync),
}

/// State shared by the dispatcher and the workers.
struct Shared {
    /// Bumped once per job; a worker runs a job when it sees a value it has not run.
    generation: AtomicU64,
    /// The current job; valid from the bump of `generation` until `pending` reaches 0.
    job: AtomicPtr<Job<'static>>,
    /// Workers that have not finished the current job.
    pending: AtomicUsize,
    /// A worker's part of the current job panicked.
    panicked: AtomicBool,
    shutdown: AtomicBool,
    /// Number of workers asleep on `wake`.
    sleepers: Mutex<usize>,
    wake: Condvar,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Nothing guarded here can be left half-updated by a panic: recover the guard.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The pool: `n_threads − 1` workers plus the thread that calls [`Pool::run`].
pub(crate) struct Pool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    /// One job at a time (the backend is `Sync`; two threads may call ops at once).
    dispatch: Mutex<()>,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field("n_threads", &self.n_threads())
            .finish_non_exhaustive()
    }
}

impl Pool {
    /// A pool of `n_threads` threads in all (at least 1; the caller counts as one).
    pub(crate) fn new(n_threads: usize) -> Self {
        let n_threads = n_threads.max(1);
        let shared = Arc::new(Shared {
            generation: AtomicU64::new(0),
            job: AtomicPtr::new(std::ptr::null_mut()),
            pending: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            shutdown: AtomicBool::new(false),
            sleepers: Mutex::new(0),
            wake: Condvar::new(),
        });
        let workers = (1..n_threads)
            .map(|t| {
                let shared = Arc::clone(&shared);
                std::thread::Builder::new()
                    .name(format!("specula-cpu-{t}"))
                    .spawn(move || worker(&shared, t))
                    .expect("spawning a CPU backend worker thread")
            })
            .collect();
        Self {
            shared,
            workers,
            dispatch: Mutex::new(()),
        }
    }

    /// Threads in all, the caller included.
    pub(crate) fn n_threads(&self) -> usize {
        self.workers.len() + 1
    }

    /// Runs `f(t)` for every thread index `t` in `0..n_threads`, `t = 0` on the calling
    /// thread, and returns when all have finished. A panic in any part is raised again here.
    pub(crate) fn run(&self, f: &(dyn Fn(usize) + Sync)) {
        if self.workers.is_empty() {
            f(0);
            return;
        }
        let _one_at_a_time = lock(&self.dispatch);
        let sh = &*self.shared;
        let job = Job { f };
        // The pointer is only dereferenced by workers between the bump of `generation` below
        // and their decrement of `pending`; this function does not return (or unwind) before
        // `pending` is 0, so `job` outlives every use. Erasing the lifetime is a plain cast.
        let ptr: *const Job<'_> = &job;
        sh.job
            .store(ptr.cast::<Job<'static>>().cast_mut(), Ordering::Release);
        sh.pending.store(self.workers.len(), Ordering::Release);
        sh.generation.fetch_add(1, Ordering::SeqCst);
        {
            let sleepers = lock(&sh.sleepers);
            if *sleepers > 0 {
                sh.wake.notify_all();
            }
        }
        let mine = catch_unwind(AssertUnwindSafe(|| f(0)));
        poll(|| sh.pending.load(Ordering::Acquire) == 0, None);
        sh.job.store(std::ptr::null_mut(), Ordering::Release);
        if let Err(payload) = mine {
            sh.panicked.store(false, Ordering::Relaxed);
            resume_unwind(payload);
        }
        assert!(
            !sh.panicked.swap(false, Ordering::AcqRel),
            "a CPU backend worker thread panicked inside an op"
        );
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::SeqCst);
        {
            let _sleepers = lock(&self.shared.sleepers);
            self.shared.wake.notify_all();
        }
        for w in self.workers.drain(..) {
            // A worker never panics outside `catch_unwind`; nothing to report if it did.
            let _ = w.join();
        }
    }
}

/// The loop of worker `t`.
fn worker(sh: &Shared, t: usize) {
    let mut seen = 0u64;
    loop {
        let fresh = || sh.generation.load(Ordering::Acquire) != seen;
        let stop = || sh.shutdown.load(Ordering::Acquire);
        if !poll(|| fresh() || stop(), Some(IDLE_POLL)) {
            let mut sleepers = lock(&sh.sleepers);
            *sleepers += 1;
            while !fresh() && !stop() {
                sleepers = sh
                    .wake
                    .wait(sleepers)
                    .unwrap_or_else(PoisonError::into_inner);
            }
            *sleepers -= 1;
        }
        if stop() {
            return;
        }
        seen = sh.generation.load(Ordering::Acquire);
        let ptr = sh.job.load(Ordering::Acquire);
        // SAFETY: `Pool::run` stored a pointer to a live `Job` before bumping `generation`
        // (which this thread has just observed with Acquire) and keeps that `Job` alive until
        // `pending` — decremented below, after the last use — reaches 0.
        let job = unsafe { &*ptr };
        if catch_unwind(AssertUnwindSafe(|| (job.f)(t))).is_err() {
            sh.panicked.store(true, Ordering::Release);
        }
        sh.pending.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Part `i` of `0..n` split into `parts` contiguous ranges whose lengths differ by at most one
/// (the first `n % parts` ranges are one longer).
pub(crate) fn split(n: usize, parts: usize, i: usize) -> Range<usize> {
    let parts = parts.max(1);
    let (q, r) = (n / parts, n % parts);
    let start = i * q + i.min(r);
    let len = q + usize::from(i < r);
    start.min(n)..(start + len).min(n)
}

/// A mutable buffer that the threads of one job write into at disjoint places.
///
/// Each thread takes the sub-slices that its part of the static split owns; the split is
/// what makes them disjoint, so [`Disjoint::slice`] is `unsafe` and each call site states why
/// its ranges do not overlap.
pub(crate) struct Disjoint<'a, T> {
    ptr: *mut T,
    len: usize,
    _borrow: std::marker::PhantomData<&'a mut [T]>,
}

// SAFETY: `Disjoint` is a `&mut [T]` shared between the threads of one job; the only access
// is `slice`, whose contract requires that concurrently used ranges do not overlap, so no
// element is touched by two threads at once, and `T: Send` lets elements be written from
// another thread.
unsafe impl<T: Send> Send for Disjoint<'_, T> {}
// SAFETY: as above.
unsafe impl<T: Send> Sync for Disjoint<'_, T> {}

impl<'a, T> Disjoint<'a, T> {
    pub(crate) fn new(data: &'a mut [T]) -> Self {
        Self {
            ptr: data.as_mut_ptr(),
            len: data.len(),
            _borrow: std::marker::PhantomData,
        }
    }

    /// The elements `range` of the buffer.
    ///
    /// # Safety
    /// No other slice obtained from this `Disjoint` and alive at the same time may overlap
    /// `range`.
    ///
    /// # Panics
    /// If `range` is not inside the buffer.
    #[allow(
        clippy::mut_from_ref,
        reason = "disjointness of the ranges is the caller's contract"
    )]
    pub(crate) unsafe fn slice(&self, range: Range<usize>) -> &mut [T] {
        assert!(
            range.start <= range.end && range.end <= self.len,
            "range {range:?} outside a buffer of {}",
            self.len
        );
        // SAFETY: the range is inside the buffer borrowed mutably for 'a (checked above), and
        // the caller guarantees no overlapping slice is alive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(range.start), range.len()) }
    }
}

impl<T: Copy> Disjoint<'_, T> {
    /// Writes element `i`.
    ///
    /// # Safety
    /// No other thread may access element `i` while this job runs, and no slice obtained from
    /// this `Disjoint` and alive now may contain it.
    ///
    /// # Panics
    /// If `i` is outside the buffer.
    #[inline]
    pub(crate) unsafe fn write(&self, i: usize, v: T) {
        assert!(i < self.len, "index {i} outside a buffer of {}", self.len);
        // SAFETY: `i` is inside the buffer (checked above) and, by the caller's contract, no
        // other access to element i is alive.
        unsafe { self.ptr.add(i).write(v) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_covers_everything_once() {
        for n in 0..40 {
            for parts in 1..7 {
                let mut next = 0;
                for i in 0..parts {
                    let r = split(n, parts, i);
                    assert_eq!(r.start, next);
                    next = r.end;
                }
                assert_eq!(next, n);
            }
        }
    }

    #[test]
    fn every_thread_runs_once_per_job() {
        for n in 1..5 {
            let pool = Pool::new(n);
            for _ in 0..100 {
                let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
                pool.run(&|t| {
                    hits[t].fetch_add(1, Ordering::Relaxed);
                });
                assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
            }
        }
    }

    #[test]
    fn a_worker_panic_reaches_the_caller_and_the_pool_survives() {
        let pool = Pool::new(3);
        let r = catch_unwind(AssertUnwindSafe(|| {
            pool.run(&|t| assert_ne!(t, 2, "worker 2 fails"));
        }));
        assert!(r.is_err());
        let count = AtomicUsize::new(0);
        pool.run(&|_| {
            count.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(count.load(Ordering::Relaxed), 3);
    }
}
