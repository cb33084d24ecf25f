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
//! 1. **spin**: one PAUSE at a time, polling after each, for [`PURE_STEPS`] PAUSEs (~2.5 µs
//!    where a PAUSE costs ~33 ns; a poll after every PAUSE sees a result the moment it lands);
//! 2. **spin and yield**: `sched_yield`, then chunks of 16 PAUSEs with polls, then yield again,
//!    until the spin budget (a [`Duration`], [`DEFAULT_SPIN`] by default) has passed;
//! 3. **sleep** on a [`WaitCell`]: a futex word in shared memory (no `FUTEX_PRIVATE_FLAG`, so
//!    it works across processes), each sleep bounded by [`SLEEP_SLICE`] so that the caller's
//!    condition, closed flag and deadline are re-checked at least that often, even if the peer
//!    died without waking anybody.
//!
//! Phase 1 adapts ([`SpinPolicy`], one per channel end). A peer running on another CPU answers
//! while we spin; a peer that needs *our* CPU answers only after we yield, and every PAUSE
//! before that yield only delays it (measured: two processes stuck on one vCPU went from
//! ~10 µs to ~2.5 µs per round trip without it). So a wait that ended after a yield makes the
//! next waits yield at once, a wait that ended in phase 1 restores it, and every
//! [`PROBE_EVERY`]th wait spins first anyway to notice when the peer moved to another CPU.
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
const SLEEP_SLICE: Duration = Duration::from_millis(100);

/// Polls of the pure-spin phase, one PAUSE before each.
const PURE_STEPS: u32 = 80;

/// PAUSEs per chunk once the doubling stops (`2^CHUNK_SHIFT`): ~0.5 µs between two polls.
#[cfg(not(loom))]
const CHUNK_SHIFT: u32 = 4;

/// In phase 2, one step in this many is a `yield_now` (and a look at the clock).
#[cfg(not(loom))]
const YIELD_EVERY: u32 = 4;

/// Every this many waits, spin first even if the last waits ended only after a yield.
const PROBE_EVERY: u32 = 16;

/// After this long with every wait ending only after a yield, one yield becomes a short sleep
/// ([`UNSTICK_SLEEP`]). Two ends of a ping-pong that the kernel put on one CPU (a futex
/// wake-up places the woken thread beside its waker) hand the CPU to each other by
/// `sched_yield` for ever: neither leaves the run queue, both look cache-hot, so the load
/// balancer never moves one to the idle CPU. Measured here: an echo stuck so took ~1.9 µs a
/// round trip instead of ~0.45, in a quarter of the runs, with one context switch per yield.
/// Waking from a timer, the sleeper is placed afresh, on an idle CPU if there is one. It sleeps
/// only when the kernel counts no more runnable threads than CPUs ([`a_cpu_may_be_idle`]):
/// where the actors truly outnumber the CPUs, yielding is right, and a sleep there cost the
/// oversubscribed rows (`chain3/*`) 2-6% in a trial.
const UNSTICK_AFTER: Duration = Duration::from_millis(2);

/// The sleep of [`UNSTICK_AFTER`].
const UNSTICK_SLEEP: Duration = Duration::from_micros(50);

/// A deadline that has always passed: a wait given it polls once and returns (a try),
/// recognised without reading the clock.
pub(crate) fn passed() -> Instant {
    static PASSED: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    *PASSED.get_or_init(Instant::now)
}

/// What one channel end learned from its previous waits, and its spin budget.
#[derive(Debug, Clone)]
pub(crate) struct SpinPolicy {
    budget: Duration,
    /// Pure-spin polls of the next wait: [`PURE_STEPS`], or 0 after a wait that ended only
    /// after a yield.
    pure_steps: u32,
    waits: u32,
    /// Since when every wait ended only after a yield (`None` while waits end in the pure
    /// spin, and again after an unsticking sleep).
    yielding_since: Option<Instant>,
}

impl SpinPolicy {
    /// `budget`: how long a wait spins and yields before it sleeps. Zero sleeps at once.
    pub(crate) fn new(budget: Duration) -> Self {
        Self {
            budget,
            pure_steps: PURE_STEPS,
            waits: 0,
            yielding_since: None,
        }
    }

    fn backoff(&mut self) -> Backoff {
        self.waits = self.waits.wrapping_add(1);
        let pure_steps = if self.budget.is_zero() {
            0
        } else if self.waits.is_multiple_of(PROBE_EVERY) {
            PURE_STEPS
        } else {
            self.pure_steps
        };
        let mut unstick = false;
        if let Some(since) = self.yielding_since {
            let now = Instant::now();
            if now.duration_since(since) >= UNSTICK_AFTER {
                // Looked at once per interval, whatever it says.
                self.yielding_since = Some(now);
                unstick = a_cpu_may_be_idle();
            }
        }
        Backoff {
            step: 0,
            pure_steps,
            budget: self.budget,
            since: None,
            unstick,
            slept: false,
        }
    }

    /// Remembers how a wait that did not sleep ended.
    fn learn(&mut self, backoff: &Backoff) {
        if backoff.yielded() {
            self.pure_steps = 0;
            if backoff.slept {
                self.yielding_since = None;
            } else if self.yielding_since.is_none() {
                self.yielding_since = Some(Instant::now());
            }
        } else {
            self.pure_steps = PURE_STEPS;
            self.yielding_since = None;
        }
    }

    /// Phases 1 and 2 of one wait for a condition that has no wait cell (a socket): polls
    /// `ready` until it holds (`Ok(true)`) or the budget is spent (`Ok(false)`: the caller
    /// sleeps its own way now).
    pub(crate) fn idle<E>(
        &mut self,
        mut ready: impl FnMut() -> Result<bool, E>,
    ) -> Result<bool, E> {
        let mut backoff = self.backoff();
        loop {
            if ready()? {
                self.learn(&backoff);
                return Ok(true);
            }
            if let Step::Spent(_) = backoff.snooze() {
                return Ok(false);
            }
        }
    }
}

/// Whether the kernel counts no more runnable threads than this process may use CPUs (the
/// fourth field of `/proc/loadavg`, `running/total`; it counts the caller): a thread that
/// shares its CPU with its peer may then find another one idle. `false` when that cannot be
/// read (the waits keep yielding, as they did before).
#[cfg(not(loom))]
fn a_cpu_may_be_idle() -> bool {
    use std::os::unix::fs::FileExt;
    // Opened once: a read at offset 0 of a proc file makes it afresh (a few µs, no open).
    static LOADAVG: std::sync::OnceLock<Option<(std::fs::File, usize)>> =
        std::sync::OnceLock::new();
    let Some((file, cpus)) = LOADAVG.get_or_init(|| {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        std::fs::File::open("/proc/loadavg").ok().map(|f| (f, cpus))
    }) else {
        return false;
    };
    let mut buf = [0u8; 128];
    let Ok(len) = file.read_at(&mut buf, 0) else {
        return false;
    };
    std::str::from_utf8(&buf[..len])
        .unwrap_or_default()
        .split_whitespace()
        .nth(3)
        .and_then(|field| field.split_once('/'))
        .and_then(|(running, _)| running.parse::<usize>().ok())
        .is_some_and(|running| running <= *cpus)
}

#[cfg(loom)]
fn a_cpu_may_be_idle() -> bool {
    false
}

/// One step of a [`Backoff`].
#[derive(Debug, Clone, Copy)]
enum Step {
    /// Spun a chunk of PAUSEs.
    Spun,
    /// Yielded the CPU; the clock read just before.
    Yielded(Instant),
    /// The spin budget is spent (clock read at `.0`): time to sleep.
    Spent(Instant),
}

/// Graded idling before a sleep, in the manner of crossbeam's `Backoff`: spin in doubling
/// chunks, then alternate yields and short spins until the budget is spent.
#[derive(Debug)]
struct Backoff {
    step: u32,
    pure_steps: u32,
    budget: Duration,
    /// When phase 2 began; the budget is counted from there, so that the pure spins of the
    /// fast path never read the clock.
    since: Option<Instant>,
    /// The next yield is a sleep of [`UNSTICK_SLEEP`] (see [`UNSTICK_AFTER`]).
    unstick: bool,
    /// This wait slept so.
    slept: bool,
}

impl Backoff {
    /// Waits a little; the caller polls its condition after each step.
    #[cfg(not(loom))]
    fn snooze(&mut self) -> Step {
        let step = self.step;
        self.step += 1;
        if step < self.pure_steps {
            spin(1);
            return Step::Spun;
        }
        if !(step - self.pure_steps).is_multiple_of(YIELD_EVERY) {
            spin(1 << CHUNK_SHIFT);
            return Step::Spun;
        }
        let now = Instant::now();
        let since = *self.since.get_or_insert(now);
        if now.duration_since(since) >= self.budget {
            return Step::Spent(now);
        }
        if std::mem::take(&mut self.unstick) {
            thread::sleep(UNSTICK_SLEEP);
            self.slept = true;
            return Step::Yielded(now);
        }
        // With more runnable actors than cores the peer may be waiting for this CPU:
        // `sched_yield` hands it over in ~1 µs.
        thread::yield_now();
        Step::Yielded(now)
    }

    /// Under loom: a spin and a yield (each a loom yield, so that the model explores a poll
    /// after either), then sleep.
    #[cfg(loom)]
    fn snooze(&mut self) -> Step {
        let _ = (
            self.pure_steps,
            self.budget,
            self.since,
            self.unstick,
            self.slept,
        );
        self.step += 1;
        match self.step {
            1 => {
                thread::yield_now();
                Step::Spun
            }
            2 => {
                thread::yield_now();
                Step::Yielded(Instant::now())
            }
            _ => Step::Spent(Instant::now()),
        }
    }

    /// Whether this wait went past its pure-spin phase.
    fn yielded(&self) -> bool {
        self.step > self.pure_steps
    }
}

#[cfg(not(loom))]
fn spin(pauses: u32) {
    for _ in 0..pauses {
        std::hint::spin_loop();
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
    /// Waits until `poll` returns `Some`: spins and yields as `policy` says, then sleeps on
    /// the futex.
    ///
    /// `poll` must check everything that may end the wait (the condition *and* a closed flag);
    /// it is called again after every spin chunk, yield and wake-up. Returns `None` when
    /// `deadline` passed first. Whoever changes what `poll` looks at must call
    /// [`notify`](Self::notify) afterwards.
    pub(crate) fn wait<T>(
        &self,
        policy: &mut SpinPolicy,
        deadline: Option<Instant>,
        mut poll: impl FnMut() -> Option<T>,
    ) -> Option<T> {
        if let Some(ready) = poll() {
            return Some(ready);
        }
        // A try ([`passed`]): one poll, no spin (the driver sweeps the output edges of an
        // execution this way, to see an error on one while it waits on another). Any other
        // deadline is first looked at after the pure spins: reading the clock here, on every
        // wait, cost a sixth of a small round trip's time in the driver.
        if deadline.is_some_and(|d| d == passed()) {
            return None;
        }
        let mut backoff = policy.backoff();
        loop {
            let step = backoff.snooze();
            if let Some(ready) = poll() {
                policy.learn(&backoff);
                return Some(ready);
            }
            match step {
                Step::Spun => {}
                Step::Yielded(now) | Step::Spent(now) if deadline.is_some_and(|d| now >= d) => {
                    return None;
                }
                Step::Yielded(_) => {}
                Step::Spent(_) => return self.sleep(deadline, poll),
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

/// Watchdogs for the channel tests: a hang becomes a failure.
#[cfg(all(test, not(loom)))]
pub(crate) mod watchdog {
    use std::sync::mpsc;
    use std::thread;
    use std::time::Duration;

    /// A generous bound on every test.
    pub(crate) const WATCHDOG: Duration = Duration::from_secs(120);

    /// Runs `test` on its own thread and fails if it takes longer than `limit`.
    pub(crate) fn with_watchdog<T: Send + 'static>(
        limit: Duration,
        test: impl FnOnce() -> T + Send + 'static,
    ) -> T {
        let (done, finished) = mpsc::channel();
        let handle = thread::spawn(move || {
            let result = test();
            let _ = done.send(());
            result
        });
        match finished.recv_timeout(limit) {
            // Disconnected: the test panicked; `join` passes the panic on.
            Ok(()) | Err(mpsc::RecvTimeoutError::Disconnected) => match handle.join() {
                Ok(result) => result,
                Err(panic) => std::panic::resume_unwind(panic),
            },
            Err(mpsc::RecvTimeoutError::Timeout) => {
                panic!("watchdog: still running after {limit:?}")
            }
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::watchdog::{WATCHDOG, with_watchdog};
    use super::*;
    use crate::sync::{Arc, AtomicU32};

    #[test]
    fn wait_times_out_at_the_deadline() {
        with_watchdog(WATCHDOG, || {
            let cell = WaitCell::default();
            let start = Instant::now();
            let deadline = Some(start + Duration::from_millis(30));
            let got = cell.wait(&mut SpinPolicy::new(DEFAULT_SPIN), deadline, || None::<()>);
            let waited = start.elapsed();
            assert!(got.is_none());
            assert!(waited >= Duration::from_millis(30), "{waited:?}");
            assert!(waited < Duration::from_secs(2), "{waited:?}");
        });
    }

    /// A wait that ends only after a yield makes the next ones yield at once, except probes;
    /// one that ends while spinning restores the spin.
    #[test]
    fn the_pure_spin_adapts_to_how_waits_end() {
        with_watchdog(WATCHDOG, || {
            let cell = WaitCell::default();
            let mut policy = SpinPolicy::new(DEFAULT_SPIN);
            let mut polls = 0;
            // Ready at the first poll after the pure-spin phase.
            let ready_after = |polls: &mut u32, n: u32| {
                *polls += 1;
                (*polls > n).then_some(())
            };
            cell.wait(&mut policy, None, || {
                ready_after(&mut polls, PURE_STEPS + 1)
            });
            assert_eq!(policy.pure_steps, 0);
            for wait in 2..PROBE_EVERY {
                assert_eq!(policy.backoff().pure_steps, 0, "wait {wait}");
            }
            // The probe spins first; answered while spinning, it restores the spin.
            polls = 0;
            cell.wait(&mut policy, None, || ready_after(&mut polls, 2));
            assert_eq!(policy.pure_steps, PURE_STEPS);
        });
    }

    /// A run of waits that all end after a yield looks, once per [`UNSTICK_AFTER`], whether a
    /// CPU may be idle; a wait whose yield became a sleep, or one answered while spinning,
    /// ends the run.
    #[test]
    fn a_long_run_of_yields_sleeps_once_to_be_placed_afresh() {
        with_watchdog(WATCHDOG, || {
            let cell = WaitCell::default();
            let mut policy = SpinPolicy::new(DEFAULT_SPIN);
            let mut polls = 0;
            let mut ready_after = |n: u32| {
                polls = 0;
                move || {
                    polls += 1;
                    (polls > n).then_some(())
                }
            };
            cell.wait(&mut policy, None, ready_after(PURE_STEPS + 1));
            let began = policy.yielding_since.expect("a run of yields began");
            // Within the interval nothing is looked at.
            assert!(!policy.backoff().unstick);
            assert_eq!(policy.yielding_since, Some(began));
            // Past it, the next wait looks (what it finds is the kernel's) and the interval
            // starts again.
            policy.yielding_since = Some(began - UNSTICK_AFTER);
            let _ = policy.backoff();
            assert!(policy.yielding_since.unwrap() >= began);
            // A wait whose yield is a sleep ends the run.
            let mut backoff = policy.backoff();
            backoff.unstick = true;
            while !backoff.slept {
                backoff.snooze();
            }
            policy.learn(&backoff);
            assert_eq!(policy.yielding_since, None);
            // So does a wait answered while spinning (one that spins first, as a probe does).
            policy.yielding_since = Some(began);
            policy.pure_steps = PURE_STEPS;
            cell.wait(&mut policy, None, ready_after(2));
            assert_eq!(policy.yielding_since, None);
        });
    }

    #[test]
    fn a_sleeper_is_woken_by_notify() {
        with_watchdog(WATCHDOG, || {
            let cell = Arc::new(WaitCell::default());
            let flag = Arc::new(AtomicU32::new(0));
            let sleeper = {
                let (cell, flag) = (cell.clone(), flag.clone());
                thread::spawn(move || {
                    cell.wait(&mut SpinPolicy::new(Duration::ZERO), None, || {
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
        });
    }
}
