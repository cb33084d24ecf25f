//! The wait strategy of every channel: spin briefly, yield, then sleep on a process-shared futex.
//!
//! Measured on the 2-vCPU machines adag targets: a
//! cross-process spin ping-pong costs ~0.3 µs per round trip, while anything that blocks and is
//! woken across vCPUs costs ~80 µs. A **50 µs spin window** keeps round trips at ~0.3 µs; a 5 µs
//! window lets a quarter of them fall asleep. But pure spinning when the actors outnumber the
//! cores costs a scheduler time slice (ms) per hand-off, so the spin phase yields between rounds
//! and ends in a futex sleep. Hence three phases, as crossbeam's `Backoff` and rayon's sleep
//! module do:
//!
//! 1. **spin**: one PAUSE at a time, polling after each, for [`PURE_STEPS`] PAUSEs (~2.5 µs
//!    where a PAUSE costs ~33 ns, ~1 µs where it costs 12 ns; a poll after every PAUSE sees a
//!    result the moment it lands);
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
//! A waker in the sleepers' own process (an in-process channel, where every message notifies)
//! may use [`WaitCell::notify_in_process`]: a compiler fence instead of its `SeqCst` one,
//! because the sleeper, after its own fence, also makes every running thread of its process
//! execute a full barrier (`membarrier`, [`asymmetric_fence`](crate::sync::asymmetric_fence)).
//! The waker's load then either comes after that barrier and sees the registration, or its
//! state change, made before the load, is visible to the sleeper's poll. A sleep costs the
//! system call once more; it comes after the spin budget anyway.
//!
//! Under `cfg(loom)` the futex is modelled by a mutex and condition variable keyed by the word's
//! address: `wait` returns at once if the word differs from the expected value, and otherwise
//! blocks until a `wake` on the same word — with no timeout, so that a lost wake-up shows up as
//! a deadlock in the model instead of being hidden by the 100 ms safety net.

use std::time::{Duration, Instant};

use super::cpu;
use crate::sync::{AtomicU32, Ordering, fence, thread};

/// Default spin budget before sleeping: the window that keeps cross-process round trips at
/// ~0.3 µs on the target machines.
pub(crate) const DEFAULT_SPIN: Duration = Duration::from_micros(50);

/// Longest single futex sleep: the condition, the closed flag and the deadline are re-checked at
/// least this often, so a peer that died without waking anybody cannot hang a waiter.
const SLEEP_SLICE: Duration = Duration::from_millis(100);

/// Polls of the pure-spin phase, one PAUSE before each. A count, not a time: on a CPU whose
/// PAUSE is short (12 ns here) the phase is short too. Stretched to 2.5 µs there, it saved a
/// Python echo ~35 ns of yields but held the CPU longer where the threads outnumber the CPUs:
/// `chain3/process` 5.48 → 6.89 µs, `chain3/hosts` 23.3 → 26.5 (6 alternating rounds).
const PURE_STEPS: u32 = 80;

/// PAUSEs per chunk once the doubling stops (`2^CHUNK_SHIFT`): ~0.5 µs between two polls.
#[cfg(not(loom))]
const CHUNK_SHIFT: u32 = 4;

/// In phase 2, one step in this many is a `yield_now` (and a look at the clock).
const YIELD_EVERY: u32 = 4;

/// Every this many waits, spin first even if the last waits ended only after a yield.
const PROBE_EVERY: u32 = 16;

/// While every wait is answered in its first yield (what a peer that runs only when this
/// thread yields its CPU looks like), once per this interval a wait looks whether its thread
/// shares its CPU ([`cpu`](super::cpu) explains why two ends of a ping-pong can stay stuck on
/// one CPU). It counts as sharing when the thread spent at least a quarter of the interval
/// queued behind another runnable thread ([`cpu::queued_ns`]): a thread that yields on a CPU
/// of its own (its peer computing elsewhere) is never queued. A sharing thread moves to
/// another CPU ([`cpu::move_to_another_cpu`]) on a coin's head, if the kernel counts a CPU
/// that may be idle: both ends of a stuck pair look at about the same time, and two that moved
/// together would be stuck together again. Where moving is refused (a pinned thread), the
/// yield becomes a short sleep ([`UNSTICK_SLEEP`]), after which the kernel places the thread
/// afresh.
///
/// Measured here (`adag-bench --filter echo/thread --iters 2000`): 6 of 12 runs stayed stuck
/// at ~1.9 µs a round trip for most of the run, 0 of 14 with this. Before, a 50 µs sleep every
/// 2 ms of yields, gated by the kernel's count alone, was meant to end it (but both ends may
/// sleep at once, and wake side by side again); a 200 µs interval for that sleep made it far
/// worse (p50 2.3 µs, p99 129 µs).
///
/// Where the threads outnumber the CPUs, sharing lasts and a move does not help: a look that
/// finds sharing and shows heads (moving or not) doubles the interval of its channel end, up
/// to [`UNSTICK_AFTER_MAX`], and a look that finds no sharing halves it again. And waits that
/// need several yields (a peer's work, the network) end the run, so they never look: looking
/// at every run of yields every 250 µs cost `fanout3/hosts` ~9% (15,000 looks a second).
const UNSTICK_AFTER: Duration = Duration::from_micros(250);

/// The longest interval between two looks (see [`UNSTICK_AFTER`]).
const UNSTICK_AFTER_MAX: Duration = Duration::from_millis(16);

/// The sleep of [`UNSTICK_AFTER`] where moving is refused.
const UNSTICK_SLEEP: Duration = Duration::from_micros(50);

/// How many threads of a process may spin or yield in their waits at once, per CPU it may
/// use (see [`Spinners`]). A bound against a runaway, not a tuning: a waiter refused the spin
/// sleeps and must be woken by a system call, across CPUs, so a tight bound slows exactly the
/// graphs that spinning and yielding serve well. Measured here on 2 CPUs (`adag-bench --scale`,
/// thread actors): at 1 per CPU `chain3/thread` took 37 µs instead of 6.7; at 2, a chain of 4
/// took 6.5 µs a hop instead of 2.7 and a fan-out to 4 readers 33 µs instead of 6; at 4, a
/// fan-out to 16 readers took 222 µs instead of 22. A chain of 1,024 was no faster with any
/// bound than with the idle rule alone (35-105 µs a hop from run to run).
const SPINNERS_PER_CPU: u32 = 8;

/// The threads of a process now in phase 1 or 2 of a wait (spinning, or yielding), counted
/// across every channel end: a wait that would make them more than the process may use CPUs
/// (times [`SPINNERS_PER_CPU`]) goes straight to its futex sleep. Spinning adapts to the
/// number of threads that spin, not only to its own end's history.
///
/// A spinning waiter is runnable: where the threads outnumber the CPUs, every one of them
/// stands in the run queue, so the thread that has work (the next stage of a chain) waits
/// behind all of them for its turn, and each turn is a `sched_yield` round of the whole queue.
/// The count bounds how many do so at once (a fan-out to a thousand thread actors would
/// otherwise set a thousand spinners going on every execution); the others sleep until
/// woken, which is what a hand-off between more threads than CPUs costs anyway.
///
/// An end whose last wait slept to its deadline sleeps at once ([`SpinPolicy`]'s `idle`):
/// an actor waiting for the next execution wakes every 20 ms to look for one-off calls, and
/// the spin that followed each look was what swamped the machine: 1,024 idle thread actors
/// on 2 CPUs made 50,000 spins of 50 µs a second, the load average climbed past 500, and 200
/// executions of their chain did not end in 10 minutes. With the rule they end in seconds.
///
/// Not modelled by loom (the count decides only whether a wait spins before it sleeps, never
/// what it sleeps on): under `cfg(loom)` every wait spins.
#[derive(Debug)]
pub(crate) struct Spinners {
    now: std::sync::atomic::AtomicU32,
    /// The most that may spin at once; 0 until first used (then [`SPINNERS_PER_CPU`] times
    /// the CPUs of the process).
    limit: std::sync::atomic::AtomicU32,
}

/// The process's count of spinning waiters.
pub(crate) static SPINNERS: Spinners = Spinners::new(0);

impl Spinners {
    /// A count allowing `limit` spinners (0: [`SPINNERS_PER_CPU`] per CPU of the process,
    /// looked up once).
    pub(crate) const fn new(limit: u32) -> Self {
        Self {
            now: std::sync::atomic::AtomicU32::new(0),
            limit: std::sync::atomic::AtomicU32::new(limit),
        }
    }

    fn limit(&self) -> u32 {
        use std::sync::atomic::Ordering::Relaxed;
        match self.limit.load(Relaxed) {
            0 => {
                let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
                let limit = u32::try_from(cpus)
                    .unwrap_or(u32::MAX)
                    .saturating_mul(SPINNERS_PER_CPU)
                    .max(1);
                self.limit.store(limit, Relaxed);
                limit
            }
            limit => limit,
        }
    }

    /// Counts the caller in as a spinner, if there is room: the returned guard counts it out.
    #[cfg(not(loom))]
    fn enter(&self) -> Option<Spinning<'_>> {
        use std::sync::atomic::Ordering::Relaxed;
        let limit = self.limit();
        // A load first: where the room is taken, refusing costs no write to the shared line.
        if self.now.load(Relaxed) >= limit {
            return None;
        }
        if self.now.fetch_add(1, Relaxed) >= limit {
            self.now.fetch_sub(1, Relaxed);
            return None;
        }
        Some(Spinning(self))
    }

    #[cfg(loom)]
    fn enter(&self) -> Option<Spinning<'_>> {
        let _ = (&self.now, &self.limit, Self::limit);
        Some(Spinning(self))
    }

    /// How many spin now.
    #[cfg(all(test, not(loom)))]
    fn spinning(&self) -> u32 {
        self.now.load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// One thread counted in [`Spinners`], until dropped.
#[derive(Debug)]
struct Spinning<'a>(&'a Spinners);

impl Drop for Spinning<'_> {
    fn drop(&mut self) {
        #[cfg(not(loom))]
        self.0
            .now
            .fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}

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
    /// spin, and again after an unsticking move).
    yielding_since: Option<Instant>,
    /// [`cpu::queued_ns`] at the last look of this run of yields (`None`: not looked yet).
    queued_at_look: Option<u64>,
    /// The interval between two looks: [`UNSTICK_AFTER`], doubled by each move.
    unstick_after: Duration,
    /// The last wait slept until its deadline: this end is idle (an actor waiting for the
    /// next execution in slices, to look for one-off calls between them), and its next wait
    /// sleeps at once (see [`Spinners`]).
    idle: bool,
    /// The count of spinning threads this end takes part in ([`SPINNERS`]; a test's own).
    spinners: &'static Spinners,
}

impl SpinPolicy {
    /// `budget`: how long a wait spins and yields before it sleeps. Zero sleeps at once.
    pub(crate) fn new(budget: Duration) -> Self {
        Self {
            budget,
            pure_steps: PURE_STEPS,
            waits: 0,
            yielding_since: None,
            queued_at_look: None,
            unstick_after: UNSTICK_AFTER,
            idle: false,
            spinners: &SPINNERS,
        }
    }

    /// A policy counted in `spinners` instead of the process's count (a test's own).
    #[cfg(all(test, not(loom)))]
    fn counted_in(budget: Duration, spinners: &'static Spinners) -> Self {
        Self {
            spinners,
            ..Self::new(budget)
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
            let interval = now.duration_since(since);
            if interval >= self.unstick_after {
                unstick = self.look(now, interval, cpu::queued_ns(), cpu::a_cpu_may_be_idle);
            }
        }
        Backoff {
            step: 0,
            pure_steps,
            budget: self.budget,
            since: None,
            unstick,
            unstuck: false,
        }
    }

    /// The look of [`UNSTICK_AFTER`], `interval` after the previous one (or the run's start):
    /// whether the next yield should move the thread. `queued` is [`cpu::queued_ns`] now; the
    /// first look of a run only keeps it for the next one to compare with.
    fn look(
        &mut self,
        now: Instant,
        interval: Duration,
        queued: Option<u64>,
        a_cpu_may_be_idle: impl FnOnce() -> bool,
    ) -> bool {
        self.yielding_since = Some(now);
        let shared = match (self.queued_at_look, queued) {
            (Some(then), Some(queued)) => {
                queued.saturating_sub(then) >= interval.as_nanos() as u64 / 4
            }
            _ => false,
        };
        self.queued_at_look = queued;
        let heads = shared && coin(now);
        self.unstick_after = if heads {
            (self.unstick_after * 2).min(UNSTICK_AFTER_MAX)
        } else if shared {
            self.unstick_after
        } else {
            (self.unstick_after / 2).max(UNSTICK_AFTER)
        };
        heads && a_cpu_may_be_idle()
    }

    /// Remembers how a wait that did not sleep ended.
    fn learn(&mut self, backoff: &Backoff) {
        if backoff.yielded() {
            self.pure_steps = 0;
            if backoff.unstuck || !backoff.answered_in_first_yield() {
                // A wait that took several yields waited for a peer's work or the network,
                // not for the peer to be let onto this CPU.
                self.end_run_of_yields();
            } else if self.yielding_since.is_none() {
                self.yielding_since = Some(Instant::now());
            }
        } else {
            self.pure_steps = PURE_STEPS;
            self.end_run_of_yields();
        }
    }

    fn end_run_of_yields(&mut self) {
        self.yielding_since = None;
        self.queued_at_look = None;
    }

    /// Phases 1 and 2 of one wait for a condition that has no wait cell (a socket): polls
    /// `ready` until it holds (`Ok(true)`) or the budget is spent (`Ok(false)`: the caller
    /// sleeps its own way now).
    pub(crate) fn idle<E>(
        &mut self,
        mut ready: impl FnMut() -> Result<bool, E>,
    ) -> Result<bool, E> {
        if ready()? {
            // What `learn` makes of a wait that never spun.
            self.pure_steps = PURE_STEPS;
            self.end_run_of_yields();
            return Ok(true);
        }
        // As many threads as CPUs spin already: sleep (see [`Spinners`]).
        let Some(_spinning) = self.spinners.enter() else {
            return Ok(false);
        };
        let mut backoff = self.backoff();
        loop {
            if let Step::Spent(_) = backoff.snooze() {
                return Ok(false);
            }
            if ready()? {
                self.learn(&backoff);
                return Ok(true);
            }
        }
    }
}

/// A fair coin from the clock's low bits (a few hundred ns apart, two threads' looks differ
/// there), so that only one of two stuck ends moves, most of the time.
fn coin(now: Instant) -> bool {
    now.duration_since(passed()).subsec_nanos() & 0x40 != 0
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
    /// The next yield is a move to another CPU (see [`UNSTICK_AFTER`]).
    unstick: bool,
    /// This wait moved (or slept, where moving was refused).
    unstuck: bool,
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
            if cpu::move_to_another_cpu().is_none() {
                thread::sleep(UNSTICK_SLEEP);
            }
            self.unstuck = true;
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
            self.unstuck,
            // The model never moves a thread off its CPU.
            cpu::move_to_another_cpu,
            UNSTICK_SLEEP,
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

    /// Whether this wait ended between its first yield and its second: what a peer that runs
    /// only while this thread yields its CPU looks like.
    fn answered_in_first_yield(&self) -> bool {
        self.yielded() && self.step <= self.pure_steps + YIELD_EVERY
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
        // An idle end (its last wait slept to its deadline) sleeps at once, and so does a
        // wait that would make more threads spin than there are CPUs ([`Spinners`]).
        let spinning = if policy.idle {
            None
        } else {
            policy.spinners.enter()
        };
        let Some(spinning) = spinning else {
            return self.sleep_learning(policy, deadline, poll);
        };
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
                Step::Spent(_) => {
                    drop(spinning);
                    return self.sleep_learning(policy, deadline, poll);
                }
            }
        }
    }

    /// [`sleep`](Self::sleep), remembering in `policy` whether it ran to its deadline.
    fn sleep_learning<T>(
        &self,
        policy: &mut SpinPolicy,
        deadline: Option<Instant>,
        poll: impl FnMut() -> Option<T>,
    ) -> Option<T> {
        let got = self.sleep(deadline, poll);
        policy.idle = got.is_none();
        got
    }

    /// Phase 3: register as a sleeper and sleep on the futex until `poll` is ready.
    fn sleep<T>(
        &self,
        deadline: Option<Instant>,
        mut poll: impl FnMut() -> Option<T>,
    ) -> Option<T> {
        self.sleepers.fetch_add(1, Ordering::Relaxed);
        // Pairs with the fence in `notify` (see the module docs), and, for a notifier of this
        // process, with the compiler fence of `notify_in_process`.
        fence(Ordering::SeqCst);
        heavy_fence();
        let result = loop {
            let expected = self.event.load(Ordering::Acquire);
            if let Some(ready) = poll() {
                break Some(ready);
            }
            let slice = match deadline {
                None => sleep_slice(),
                Some(deadline) => match deadline.checked_duration_since(Instant::now()) {
                    Some(left) if !left.is_zero() => left.min(sleep_slice()),
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

    /// [`notify`](Self::notify) for a notifier in the sleepers' process (an in-process
    /// channel): a compiler fence instead of the `SeqCst` one, paid for by the sleeper's
    /// `membarrier` ([`asymmetric_fence`](crate::sync::asymmetric_fence)). Costs a plain load
    /// when nobody sleeps. Never for a cell in shared memory: a sleeper in another process is
    /// not covered.
    pub(crate) fn notify_in_process(&self) {
        light_fence();
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

/// [`SLEEP_SLICE`], or in a test the slice its thread set: a stress test of the wake-up
/// handshake makes it far longer than any wake-up, so that a lost one shows.
#[cfg(not(all(test, not(loom))))]
fn sleep_slice() -> Duration {
    SLEEP_SLICE
}

#[cfg(all(test, not(loom)))]
thread_local! {
    static TEST_SLEEP_SLICE: std::cell::Cell<Duration> = const { std::cell::Cell::new(SLEEP_SLICE) };
}

#[cfg(all(test, not(loom)))]
fn sleep_slice() -> Duration {
    TEST_SLEEP_SLICE.with(std::cell::Cell::get)
}

/// The sleeper's side of [`WaitCell::notify_in_process`]: under loom a `SeqCst` fence, the
/// symmetric handshake the model can check.
#[cfg(not(loom))]
fn heavy_fence() {
    crate::sync::asymmetric_fence::heavy();
}

#[cfg(loom)]
fn heavy_fence() {}

/// The notifier's side of [`WaitCell::notify_in_process`].
#[cfg(not(loom))]
fn light_fence() {
    crate::sync::asymmetric_fence::light();
}

#[cfg(loom)]
fn light_fence() {
    fence(Ordering::SeqCst);
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

    /// The handshake of `notify_in_process` (module docs), run many times: the notifier
    /// changes the state and notifies with only a compiler fence while the sleeper registers,
    /// fences for the whole process and polls. A wake-up lost there leaves the sleeper asleep
    /// until its deadline (its slice made longer than that): that round fails.
    #[test]
    fn a_sleeper_registering_while_an_in_process_notifier_changes_the_state_is_woken() {
        const ROUNDS: u32 = 50_000;
        let cell = Arc::new(WaitCell::default());
        let state = Arc::new(AtomicU32::new(0));
        let acked = Arc::new(AtomicU32::new(0));
        let notifier = {
            let (cell, state, acked) = (cell.clone(), state.clone(), acked.clone());
            thread::spawn(move || {
                let give_up = Instant::now() + Duration::from_secs(300);
                for k in 1..=ROUNDS {
                    while acked.load(Ordering::Acquire) != k - 1 {
                        assert!(Instant::now() < give_up, "the sleeper stopped at round {k}");
                        std::hint::spin_loop();
                    }
                    state.store(k, Ordering::Release);
                    cell.notify_in_process();
                }
            })
        };
        TEST_SLEEP_SLICE.with(|slice| slice.set(Duration::from_secs(600)));
        // No spin: every wait that finds nothing registers and sleeps at once.
        let mut policy = SpinPolicy::new(Duration::ZERO);
        for k in 1..=ROUNDS {
            // A lost wake-up sleeps to the deadline, then finds the state changed.
            let start = Instant::now();
            let woken = cell.wait(&mut policy, Some(start + Duration::from_secs(20)), || {
                (state.load(Ordering::Acquire) >= k).then_some(())
            });
            let took = start.elapsed();
            assert!(
                woken.is_some() && took < Duration::from_secs(10),
                "round {k}: a wake-up was lost (the wait took {took:?})"
            );
            acked.store(k, Ordering::Release);
        }
        notifier.join().unwrap();
    }

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
            let mut policy = SpinPolicy::counted_in(DEFAULT_SPIN, own_spinners(u32::MAX));
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

    /// A run of waits answered in their first yield looks, once per interval, whether the
    /// thread shares its CPU; a wait that needed several yields, one that moved, or one
    /// answered while spinning ends the run.
    ///
    /// On a busy machine (CI runs tests side by side on two CPUs) a wait may be preempted for
    /// longer than the spin budget or the interval, so both are made too long to pass here,
    /// except where the test moves the start of the run back itself.
    #[test]
    fn a_run_of_waits_answered_in_a_yield_is_looked_at_once_per_interval() {
        const NEVER: Duration = Duration::from_secs(3600);
        with_watchdog(WATCHDOG, || {
            let cell = WaitCell::default();
            // A count of its own: the spinning of tests beside it must not make it sleep.
            let mut policy = SpinPolicy::counted_in(NEVER, own_spinners(u32::MAX));
            policy.unstick_after = NEVER;
            let mut polls = 0;
            let mut ready_after = |n: u32| {
                polls = 0;
                move || {
                    polls += 1;
                    (polls > n).then_some(())
                }
            };
            // Answered right after the first yield (the pure spins' polls, then one more).
            cell.wait(&mut policy, None, ready_after(PURE_STEPS + 1));
            let began = policy.yielding_since.expect("a run of yields began");
            // Within the interval nothing is looked at.
            assert!(!policy.backoff().unstick);
            assert_eq!(policy.yielding_since, Some(began));
            assert_eq!(policy.queued_at_look, None);
            // Past it, the next wait looks: the first look of a run only takes the count.
            policy.unstick_after = UNSTICK_AFTER;
            policy.yielding_since = Some(began - UNSTICK_AFTER);
            assert!(!policy.backoff().unstick);
            assert!(policy.yielding_since.unwrap() >= began);
            assert_eq!(policy.queued_at_look.is_some(), cpu::queued_ns().is_some());
            // No more looks: what follows is about what ends a run.
            policy.unstick_after = NEVER;
            // A wait that yields several times waited for work, not for this CPU: run over.
            // (The policy yields at once now: its last wait ended after a yield.)
            cell.wait(&mut policy, None, ready_after(3 * YIELD_EVERY));
            assert_eq!(policy.yielding_since, None);
            assert_eq!(policy.queued_at_look, None);
            // A wait whose yield is a move ends the run.
            cell.wait(&mut policy, None, ready_after(1));
            assert!(policy.yielding_since.is_some());
            let mut backoff = policy.backoff();
            backoff.unstick = true;
            while !backoff.unstuck {
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

    /// A look moves the thread only when it spent a quarter of the interval queued behind
    /// another thread, the coin shows heads, and a CPU may be idle. Looks that find sharing
    /// (on heads) make the next look later; looks that find none bring it back.
    #[test]
    fn a_look_moves_a_thread_that_shares_its_cpu_on_heads_only() {
        let interval = Duration::from_micros(400);
        let heads = passed() + Duration::from_nanos(0x40);
        let tails = passed() + Duration::from_nanos(0x80);
        assert!(coin(heads) && !coin(tails));
        let mut policy = SpinPolicy::new(DEFAULT_SPIN);
        let no_idle_cpu = || false;
        let idle_cpu = || true;

        // The first look only takes the count.
        assert!(!policy.look(heads, interval, Some(1_000), idle_cpu));
        assert_eq!(policy.unstick_after, UNSTICK_AFTER);
        // Queued 100 of 400 µs, heads, an idle CPU: move, and look later next time.
        assert!(policy.look(heads, interval, Some(101_000), idle_cpu));
        assert_eq!(policy.unstick_after, UNSTICK_AFTER * 2);
        // Sharing, but tails: no move, same interval.
        assert!(!policy.look(tails, interval, Some(201_000), idle_cpu));
        assert_eq!(policy.unstick_after, UNSTICK_AFTER * 2);
        // Sharing, heads, every CPU taken: no move, and later.
        assert!(!policy.look(heads, interval, Some(301_000), no_idle_cpu));
        assert_eq!(policy.unstick_after, UNSTICK_AFTER * 4);
        for _ in 0..20 {
            let queued = policy.queued_at_look.unwrap() + 200_000;
            assert!(!policy.look(heads, interval, Some(queued), no_idle_cpu));
        }
        assert_eq!(policy.unstick_after, UNSTICK_AFTER_MAX);
        // Queued less than a quarter: not shared, no move even on heads; the interval halves.
        let queued = policy.queued_at_look.unwrap() + 99_000;
        assert!(!policy.look(heads, interval, Some(queued), idle_cpu));
        assert_eq!(policy.unstick_after, UNSTICK_AFTER_MAX / 2);
        // Where the kernel keeps no count, nothing moves.
        assert!(!policy.look(heads, interval, None, idle_cpu));
    }

    /// A count of its own for a test, so that the waits of tests running beside it do not
    /// take its room.
    fn own_spinners(limit: u32) -> &'static Spinners {
        Box::leak(Box::new(Spinners::new(limit)))
    }

    /// Waits until `done` holds, failing after 20 s.
    fn until(what: &str, mut done: impl FnMut() -> bool) {
        let give_up = Instant::now() + Duration::from_secs(20);
        while !done() {
            assert!(Instant::now() < give_up, "never: {what}");
            thread::sleep(Duration::from_millis(1));
        }
    }

    /// With more waiters than the count allows, as many spin as it allows and every other one
    /// sleeps at once, although each has an hour of spin budget; woken, each sees its flag.
    #[test]
    fn waiters_beyond_the_count_of_spinners_sleep_at_once() {
        const WAITERS: usize = 8;
        const LIMIT: u32 = 2;
        with_watchdog(WATCHDOG, || {
            let spinners = own_spinners(LIMIT);
            let cells: Arc<Vec<WaitCell>> =
                Arc::new((0..WAITERS).map(|_| WaitCell::default()).collect());
            let flags: Arc<Vec<AtomicU32>> =
                Arc::new((0..WAITERS).map(|_| AtomicU32::new(0)).collect());
            let waiters: Vec<_> = (0..WAITERS)
                .map(|i| {
                    let (cells, flags) = (cells.clone(), flags.clone());
                    thread::spawn(move || {
                        let mut policy =
                            SpinPolicy::counted_in(Duration::from_secs(3600), spinners);
                        cells[i].wait(&mut policy, None, || {
                            (flags[i].load(Ordering::Acquire) == 1).then_some(())
                        })
                    })
                })
                .collect();
            let sleeping = || {
                cells
                    .iter()
                    .map(|c| c.sleepers.load(Ordering::Relaxed))
                    .sum::<u32>()
            };
            until("two spin and six sleep", || {
                spinners.spinning() == LIMIT && sleeping() == WAITERS as u32 - LIMIT
            });
            // It stays so: the sleepers do not come back to spin.
            thread::sleep(Duration::from_millis(20));
            assert_eq!(spinners.spinning(), LIMIT);
            assert_eq!(sleeping(), WAITERS as u32 - LIMIT);
            for (flag, cell) in flags.iter().zip(cells.iter()) {
                flag.store(1, Ordering::Release);
                cell.notify();
            }
            for waiter in waiters {
                assert_eq!(waiter.join().unwrap(), Some(()));
            }
            assert_eq!(spinners.spinning(), 0, "every spinner counted itself out");
            assert_eq!(sleeping(), 0);
        });
    }

    /// `idle` (the phase-1 and 2 wait of a socket or a call queue) is counted too: over the
    /// count it returns at once, for the caller to sleep its own way.
    #[test]
    fn an_idle_poll_over_the_count_returns_at_once() {
        let spinners = own_spinners(1);
        let held = spinners.enter().expect("room for one");
        let mut policy = SpinPolicy::counted_in(Duration::from_secs(3600), spinners);
        let mut polls = 0;
        let got = policy.idle(|| {
            polls += 1;
            Ok::<_, ()>(false)
        });
        assert_eq!(got, Ok(false));
        assert_eq!(polls, 1);
        drop(held);
        let mut polls = 0;
        let got = policy.idle(|| {
            polls += 1;
            Ok::<_, ()>(polls > 3)
        });
        assert_eq!(got, Ok(true));
        assert_eq!(spinners.spinning(), 0);
    }

    /// A wait that slept to its deadline leaves its end idle: the next wait sleeps at once
    /// (an actor looking for one-off calls between executions does not spin every time it
    /// looks); one that is answered makes the end spin again.
    #[test]
    fn after_a_wait_that_slept_to_its_deadline_the_next_one_sleeps_at_once() {
        with_watchdog(WATCHDOG, || {
            let spinners = own_spinners(4);
            let cell = Arc::new(WaitCell::default());
            let flag = Arc::new(AtomicU32::new(0));
            let mut policy = SpinPolicy::counted_in(Duration::from_micros(50), spinners);
            let deadline = Some(Instant::now() + Duration::from_millis(5));
            assert_eq!(cell.wait(&mut policy, deadline, || None::<()>), None);
            assert!(policy.idle);
            // An hour of spin budget, yet it sleeps (registers) at once.
            policy.budget = Duration::from_secs(3600);
            let waiter = {
                let (cell, flag) = (cell.clone(), flag.clone());
                thread::spawn(move || {
                    let got = cell.wait(&mut policy, None, || {
                        (flag.load(Ordering::Acquire) >= 1).then_some(())
                    });
                    (got, policy)
                })
            };
            until("the idle end sleeps", || {
                cell.sleepers.load(Ordering::Relaxed) == 1
            });
            assert_eq!(spinners.spinning(), 0);
            flag.store(1, Ordering::Release);
            cell.notify();
            let (got, mut policy) = waiter.join().unwrap();
            assert_eq!(got, Some(()));
            assert!(!policy.idle, "answered: no longer idle");
            // The next wait spins again (and is answered while it does).
            let mut polls = 0;
            let got = cell.wait(&mut policy, None, || {
                polls += 1;
                assert!(polls > 3 || spinners.spinning() == (polls > 1) as u32);
                (polls > 3).then_some(())
            });
            assert_eq!(got, Some(()));
            assert_eq!(cell.sleepers.load(Ordering::Relaxed), 0);
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
