//! The wait strategy of every channel: spin briefly, yield, then sleep on a process-shared futex.
//!
//! Measured on the 2-vCPU machines adag targets (see `reference/measurements.md`): a
//! cross-process spin ping-pong costs ~0.3 µs per round trip, while anything that blocks and is
//! woken across vCPUs costs ~80 µs. A **50 µs spin window** keeps round trips at ~0.3 µs; a 5 µs
//! window lets a quarter of them fall asleep. But pure spinning when the actors outnumber the
//! cores costs a scheduler time slice (ms) per hand-off, so the spin phase yields between rounds
//! and ends in a futex sleep. Hence three phases, as crossbeam's `Backoff` and rayon's sleep
//! module do:
//!
//! 1. **spin**: `2^step` PAUSE instructions, doubling up to [`SPIN_LIMIT`] (~2 µs in all);
//! 2. **spin and yield**: rounds of `2^SPIN_LIMIT` PAUSEs followed by `sched_yield`, until the
//!    spin budget (a [`Duration`], [`DEFAULT_SPIN`] by default) has passed;
//! 3. **sleep** on a [`WaitCell`]: a futex word in shared memory (no `FUTEX_PRIVATE_FLAG`, so
//!    it works across processes), each sleep bounded by [`SLEEP_SLICE`] so that the caller's
//!    condition, closed flag and deadline are re-checked at least that often, even if the peer
//!    died without waking anybody.
//!
//! # No lost wake-up
//!
//! A [`WaitCell`] is two words: `event`, the futex word, and `sleepers`, how many waiters are in
//! phase 3. A waker changes its state (a sequence number, the closed flag) *then* calls
//! [`WaitCell::notify`]; a sleeper registers *then* polls its condition:
//!
//! ```text
//! waker                              sleeper
//! state.store(new, Release)          sleepers += 1
//! fence(SeqCst)                      fence(SeqCst)
//! if sleepers > 0 {                  loop {
//!     event += 1 (Release)               e = event.load(Acquire)
//!     futex_wake(event, all)             if poll() is ready { break }
//! }                                      futex_wait(event, e)   // sleeps only if event == e
//!                                    }
//!                                    sleepers -= 1
//! ```
//!
//! The two SeqCst fences are ordered one way or the other. If the waker's comes first, the
//! sleeper's poll sees the new state. If the sleeper's comes first, the waker sees
//! `sleepers > 0` and bumps `event` after its state change: either the sleeper loaded `e` after
//! the bump (and, by acquire, polls the new state), or `futex_wait` finds `event != e` and
//! returns at once, or the sleeper is already queued on the futex and `futex_wake` wakes it.
//! The fast path of a waker is one fence and one load: no syscall unless somebody sleeps.
//!
//! Under `cfg(loom)` the futex is modelled by a mutex and condition variable keyed by the word's
//! address: `wait` returns at once if the word differs from the expected value, and otherwise
//! blocks until a `wake` on the same word — with no timeout, so that a lost wake-up shows up as
//! a deadlock in the model instead of being hidden by the 100 ms safety net.

use std::time::{Duration, Instant};

use crate::sync::{AtomicU32, Ordering, fence, thread};

/// Default spin budget before sleeping: the window that keeps cross-process round trips at
/// ~0.3 µs on the target machines.
pub(crate) const DEFAULT_SPIN: Duration = Duration::from_micros(50);

/// Longest single futex sleep: the condition, the closed flag and the deadline are re-checked at
/// least this often, so a peer that died without waking anybody cannot hang a waiter.
pub(crate) const SLEEP_SLICE: Duration = Duration::from_millis(100);

/// Doubling steps of pure spinning (`2^0 + .. + 2^5` = 63 PAUSEs) before yielding, as in
/// crossbeam's `Backoff`; each later round spins `2^SPIN_LIMIT` PAUSEs and then yields.
pub(crate) const SPIN_LIMIT: u32 = 6;

/// Graded idling before a sleep: spin with doubling PAUSE counts, then rounds of spinning and
/// `yield_now` until the spin budget is spent.
#[derive(Debug)]
pub(crate) struct Backoff {
    step: u32,
    budget: Duration,
    /// When the yielding phase began; the budget is measured from there, so that the pure
    /// spins of the fast path never read the clock.
    since: Option<Instant>,
}

impl Backoff {
    pub(crate) fn new(budget: Duration) -> Self {
        Self {
            step: 0,
            budget,
            since: None,
        }
    }

    /// Waits a little. Returns `false` once the spin budget is spent and the caller should
    /// sleep instead; `now` is the clock read at this step, if it was read.
    #[cfg(not(loom))]
    pub(crate) fn snooze(&mut self) -> (bool, Option<Instant>) {
        if self.step < SPIN_LIMIT {
            for _ in 0..1u32 << self.step {
                std::hint::spin_loop();
            }
            self.step += 1;
            return (true, None);
        }
        let now = Instant::now();
        let since = *self.since.get_or_insert(now);
        if now.duration_since(since) >= self.budget {
            return (false, Some(now));
        }
        // Yield first: with more runnable actors than cores the peer may be waiting for this
        // CPU, and `sched_yield` hands it over in ~1 µs.
        thread::yield_now();
        for _ in 0..1u32 << SPIN_LIMIT {
            std::hint::spin_loop();
        }
        (true, Some(now))
    }

    /// Under loom: one yield (so that the model explores the poll after a spin) and then sleep.
    #[cfg(loom)]
    pub(crate) fn snooze(&mut self) -> (bool, Option<Instant>) {
        let _ = (self.budget, self.since);
        self.step += 1;
        if self.step > 1 {
            return (false, None);
        }
        thread::yield_now();
        (true, None)
    }
}

/// A futex word and its sleeper count, both in (possibly shared) memory. All-zero is the
/// initial state, so a fresh, zeroed shared mapping is a valid `WaitCell`.
#[repr(C)]
#[derive(Debug, Default)]
pub(crate) struct WaitCell {
    /// The futex word: bumped by every wake-up that found a sleeper.
    event: AtomicU32,
    /// How many waiters are registered for a sleep on `event`.
    sleepers: AtomicU32,
}

impl WaitCell {
    /// Waits until `poll` returns `Some`, spinning for `spin`, then sleeping on the futex.
    ///
    /// `poll` must check everything that may end the wait (the condition *and* a closed flag);
    /// it is called again after every spin round and every wake-up. Returns `None` when
    /// `deadline` passed first. Whoever changes what `poll` looks at must call
    /// [`notify`](Self::notify) afterwards.
    pub(crate) fn wait<T>(
        &self,
        spin: Duration,
        deadline: Option<Instant>,
        mut poll: impl FnMut() -> Option<T>,
    ) -> Option<T> {
        if let Some(ready) = poll() {
            return Some(ready);
        }
        let mut backoff = Backoff::new(spin);
        loop {
            let (more, now) = backoff.snooze();
            if let Some(ready) = poll() {
                return Some(ready);
            }
            if let (Some(deadline), Some(now)) = (deadline, now) {
                if now >= deadline {
                    return None;
                }
            }
            if !more {
                return self.sleep(deadline, poll);
            }
        }
    }

    /// Phase 3: register as a sleeper and sleep on the futex until `poll` is ready.
    fn sleep<T>(
        &self,
        deadline: Option<Instant>,
        mut poll: impl FnMut() -> Option<T>,
    ) -> Option<T> {
        self.sleepers.fetch_add(1, Ordering::Relaxed);
        // Pairs with the fence in `notify`: see the module docs.
        fence(Ordering::SeqCst);
        let result = loop {
            let expected = self.event.load(Ordering::Acquire);
            if let Some(ready) = poll() {
                break Some(ready);
            }
            let slice = match deadline {
                None => SLEEP_SLICE,
                Some(deadline) => match deadline.checked_duration_since(Instant::now()) {
                    Some(left) if !left.is_zero() => left.min(SLEEP_SLICE),
                    _ => break None,
                },
            };
            futex::wait(&self.event, expected, slice);
        };
        self.sleepers.fetch_sub(1, Ordering::Relaxed);
        result
    }

    /// Tells the sleepers, if any, that what they poll may have changed. Call it after the
    /// change. Costs a fence and a load when nobody sleeps.
    pub(crate) fn notify(&self) {
        // Pairs with the fence in `sleep`: see the module docs.
        fence(Ordering::SeqCst);
        if self.sleepers.load(Ordering::Relaxed) != 0 {
            self.wake();
        }
    }

    /// Wakes every sleeper unconditionally (for `close`, which is rare and must not depend on
    /// the sleeper count of a peer that may have died).
    pub(crate) fn wake(&self) {
        self.event.fetch_add(1, Ordering::Release);
        futex::wake_all(&self.event);
    }
}

/// Process-shared futex wait and wake on a word in memory.
#[cfg(not(loom))]
mod futex {
    use std::time::Duration;

    use rustix::thread::futex;

    use crate::sync::AtomicU32;

    /// Sleeps while `*word == expected`, for at most `timeout`. Every outcome (woken, value
    /// changed, timed out, interrupted) means "re-check", so errors are not reported.
    pub(super) fn wait(word: &AtomicU32, expected: u32, timeout: Duration) {
        let timeout = futex::Timespec {
            tv_sec: timeout.as_secs() as i64,
            tv_nsec: i64::from(timeout.subsec_nanos()),
        };
        // Shared (not PRIVATE) futex: the word may live in memory mapped by other processes.
        let _ = futex::wait(word, futex::Flags::empty(), expected, Some(&timeout));
    }

    /// Wakes every thread of every process sleeping on `word`.
    pub(super) fn wake_all(word: &AtomicU32) {
        let _ = futex::wake(word, futex::Flags::empty(), i32::MAX as u32);
    }
}

/// The futex modelled for loom: a mutex and condition variable, a wake generation per word.
#[cfg(loom)]
mod futex {
    use std::collections::HashMap;
    use std::time::Duration;

    use loom::sync::{Condvar, Mutex};

    use crate::sync::{AtomicU32, Ordering};

    loom::lazy_static! {
        /// Wake generation of every word that was woken, keyed by address.
        static ref TABLE: (Mutex<HashMap<usize, u64>>, Condvar) =
            (Mutex::new(HashMap::new()), Condvar::new());
    }

    fn key(word: &AtomicU32) -> usize {
        word as *const AtomicU32 as usize
    }

    /// Like `FUTEX_WAIT`: returns at once if `*word != expected`, otherwise blocks until a
    /// `wake_all` on the same word. The timeout is ignored so that a lost wake-up deadlocks.
    pub(super) fn wait(word: &AtomicU32, expected: u32, _timeout: Duration) {
        let (table, woken) = &*TABLE;
        let mut table = table.lock().unwrap();
        if word.load(Ordering::SeqCst) != expected {
            return;
        }
        let generation = *table.entry(key(word)).or_insert(0);
        while table[&key(word)] == generation {
            table = woken.wait(table).unwrap();
        }
    }

    pub(super) fn wake_all(word: &AtomicU32) {
        let (table, woken) = &*TABLE;
        *table.lock().unwrap().entry(key(word)).or_insert(0) += 1;
        woken.notify_all();
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::sync::{Arc, AtomicU32};

    #[test]
    fn wait_times_out_at_the_deadline() {
        let cell = WaitCell::default();
        let start = Instant::now();
        let got = cell.wait(
            DEFAULT_SPIN,
            Some(start + Duration::from_millis(30)),
            || None::<()>,
        );
        let waited = start.elapsed();
        assert!(got.is_none());
        assert!(waited >= Duration::from_millis(30), "{waited:?}");
        assert!(waited < Duration::from_secs(2), "{waited:?}");
    }

    #[test]
    fn a_sleeper_is_woken_by_notify() {
        let cell = Arc::new(WaitCell::default());
        let flag = Arc::new(AtomicU32::new(0));
        let sleeper = {
            let (cell, flag) = (cell.clone(), flag.clone());
            thread::spawn(move || {
                cell.wait(Duration::ZERO, None, || {
                    (flag.load(Ordering::Acquire) == 1).then_some(())
                });
                Instant::now()
            })
        };
        // Let it register as a sleeper, then wake it: it must not need the 100 ms re-check.
        while cell.sleepers.load(Ordering::Relaxed) == 0 {
            thread::yield_now();
        }
        thread::sleep(Duration::from_millis(5));
        let notified = Instant::now();
        flag.store(1, Ordering::Release);
        cell.notify();
        let woke = sleeper.join().unwrap();
        let latency = woke.saturating_duration_since(notified);
        assert!(latency < SLEEP_SLICE / 2, "woken after {latency:?}");
    }
}
