//! Back-pressure for servers: submitting that waits for room instead of failing at once.
//!
//! `execute` and `execute_async` fail with [`Error::CapacityExceeded`] when
//! `max_inflight_executions` executions are unread (Ray's semantics). The waiting variants
//! try again each time room may have freed: the graph notifies its [`SubmitWaiters`] when it
//! reads an execution's outputs (`store`, by a `get` or the async pump), when a ref is
//! released, and at teardown. A waiting future holds nothing but its input, a waker
//! registration and a timer entry until the very poll that submits, so dropping it at any
//! await point submits nothing and leaks nothing.
//!
//! # No lost wake-up, and a free notification
//!
//! Every `get` notifies, and almost never is anybody waiting, so the notifier's side is made
//! free and the waiter's side pays: an asymmetric fence (`membarrier`, as liburcu and folly
//! do). A notifier changes the state (room), then, with only a compiler fence, loads the
//! count of registered waiters and returns when it is 0. A waiter registers (count up), then
//! makes every thread of the process run a full memory barrier (`membarrier`,
//! `PRIVATE_EXPEDITED`), then looks at the room. Either a notifier's load came after that
//! barrier on its CPU, and sees the registration, or before it, and then its change of the
//! room, made earlier, is visible to the waiter's look. A notifier that sees a waiter bumps
//! `generation` under the state lock and wakes everybody; a waiter sleeps only while the
//! generation is the one it saw before it looked, and at most [`WAIT_SLICE`] at a time. Where
//! the kernel refuses `membarrier` (old kernels, some sandboxes) both sides use a `SeqCst`
//! fence instead. Registration is once per waiting call (a task stays registered across its
//! polls), so the system call is paid once per submission that had to wait. Measured: the
//! `SeqCst` increment this replaces cost ~11 ns of a 0.43 µs `echo/thread` round trip.
use super::timer::{TimerEntry, wake_at};
use super::{CompiledGraph, GraphShared, IntoOutputs};
use crate::compile::deadline_after;
use crate::error::{Capacity, Error, Result};
use crate::sync::asymmetric_fence as fence;
use crate::value::Value;
use parking_lot::{Condvar, Mutex};
use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

/// Longest sleep of a waiting thread before it looks at the room again, whatever it was told.
const WAIT_SLICE: Duration = Duration::from_millis(100);

/// The submitters of one graph waiting for room.
pub(crate) struct SubmitWaiters {
    /// Bumped, under the state lock, by every notification that finds somebody waiting: a
    /// thread waits for it to change.
    generation: AtomicU64,
    /// Threads waiting plus tasks registered: while 0, a notification (one per execution
    /// read) is one plain load.
    waiting: AtomicUsize,
    state: Mutex<WaitState>,
    /// Wakes threads in `execute_wait`.
    cv: Condvar,
}

struct WaitState {
    /// Tasks in `execute_async_wait`, from their first refused attempt to their end; each
    /// poll refreshes its waker.
    wakers: HashMap<u64, Waker>,
    /// Threads in `wait_change`.
    threads: usize,
    next_id: u64,
}

impl WaitState {
    fn count(&self) -> usize {
        self.wakers.len() + self.threads
    }
}

impl SubmitWaiters {
    pub(crate) fn new() -> Self {
        SubmitWaiters {
            generation: AtomicU64::new(0),
            waiting: AtomicUsize::new(0),
            state: Mutex::new(WaitState {
                wakers: HashMap::new(),
                threads: 0,
                next_id: 0,
            }),
            cv: Condvar::new(),
        }
    }

    /// Room may have freed (an execution was read, a ref released) or the graph stopped:
    /// every waiter tries again. Call it after the change.
    pub(crate) fn notify(&self) {
        fence::light();
        if self.waiting.load(Ordering::Relaxed) == 0 {
            return;
        }
        let wakers: Vec<Waker> = {
            let s = self.state.lock();
            self.generation.fetch_add(1, Ordering::Release);
            s.wakers.values().cloned().collect()
        };
        self.cv.notify_all();
        for w in wakers {
            w.wake();
        }
    }

    /// The generation now; read after registering, before looking at the room.
    fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// Counts a thread as waiting, then fences (see the module docs): the caller looks at
    /// the room after this, and calls [`leave`](Self::leave) when it is done waiting.
    fn enter(&self) {
        let mut s = self.state.lock();
        s.threads += 1;
        self.waiting.store(s.count(), Ordering::Relaxed);
        drop(s);
        fence::heavy();
    }

    fn leave(&self) {
        let mut s = self.state.lock();
        s.threads -= 1;
        self.waiting.store(s.count(), Ordering::Relaxed);
    }

    /// Sleeps until a notification after `seen`, or [`WAIT_SLICE`], or `deadline`; the
    /// caller then looks at the room again.
    fn sleep(&self, seen: u64, deadline: Option<Instant>) {
        self.sleep_up_to(seen, deadline, WAIT_SLICE);
    }

    /// [`sleep`](Self::sleep) with its slice given; whether a notification ended it.
    fn sleep_up_to(&self, seen: u64, deadline: Option<Instant>, slice: Duration) -> bool {
        let slice_end = Instant::now() + slice;
        let until = deadline.map_or(slice_end, |d| d.min(slice_end));
        let mut s = self.state.lock();
        while self.generation() == seen {
            if self.cv.wait_until(&mut s, until).timed_out() {
                return self.generation() != seen;
            }
        }
        true
    }

    /// Registers a task's waker (first call: `id` is `None`, and the fence of the module
    /// docs follows), or refreshes it; returns its id. The caller looks at the room after
    /// this.
    fn register(&self, id: Option<u64>, waker: &Waker) -> u64 {
        let mut s = self.state.lock();
        let (id, first) = match id {
            Some(id) => (id, false),
            None => {
                s.next_id += 1;
                (s.next_id, true)
            }
        };
        s.wakers.insert(id, waker.clone());
        self.waiting.store(s.count(), Ordering::Relaxed);
        drop(s);
        if first {
            fence::heavy();
        }
        id
    }

    fn unregister(&self, id: u64) {
        let mut s = self.state.lock();
        if s.wakers.remove(&id).is_some() {
            self.waiting.store(s.count(), Ordering::Relaxed);
        }
    }
}

fn no_room(limit: usize, opts: &crate::compile::CompileOptions) -> Error {
    Error::Timeout {
        what: format!(
            "room to submit an execution within submit_timeout: all {limit} in-flight executions (max_inflight_executions) stayed unread"
        ),
        timeout: opts.submit_timeout,
        hint: "claim (get or await) earlier results so that the graph can read them, or raise CompileOptions::submit_timeout or max_inflight_executions".into(),
    }
}

/// Submits one execution as soon as there is room, up to `submit_timeout`.
pub(crate) struct Submit<I: Value> {
    shared: Arc<GraphShared<I>>,
    input: I,
    deadline: Option<Instant>,
    /// The registration of this task's waker with the graph's waiters.
    waiter: Option<u64>,
    /// Wakes the task at its deadline, whatever executor runs it.
    timer: Option<TimerEntry>,
    done: bool,
}

// The input is never pinned: it is only lent to `execute` by reference.
impl<I: Value> Unpin for Submit<I> {}

impl<I: Value> Submit<I> {
    pub(crate) fn new(shared: Arc<GraphShared<I>>, input: I) -> Self {
        let deadline = deadline_after(shared.opts.submit_timeout);
        Submit {
            shared,
            input,
            deadline,
            waiter: None,
            timer: None,
            done: false,
        }
    }

    fn finish(&mut self) {
        self.done = true;
        if let Some(id) = self.waiter.take() {
            self.shared.submit_waiters.unregister(id);
        }
        self.timer = None;
    }
}

impl<I: Value> Future for Submit<I> {
    type Output = Result<u64>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<u64>> {
        let this = self.get_mut();
        if this.done {
            return Poll::Ready(Err(Error::WrongMode {
                message: "this submission already completed; it is polled only once to its end"
                    .into(),
            }));
        }
        let mut attempt = this.shared.execute(&this.input);
        if matches!(
            attempt,
            Err(Error::CapacityExceeded {
                capacity: Capacity::InflightExecutions,
                ..
            })
        ) {
            // Registered (or its waker refreshed) before looking again: room freed after
            // this look wakes the task (module docs).
            this.waiter = Some(this.shared.submit_waiters.register(this.waiter, cx.waker()));
            attempt = this.shared.execute(&this.input);
        }
        match attempt {
            Err(Error::CapacityExceeded {
                capacity: Capacity::InflightExecutions,
                limit,
            }) => {
                if let Some(d) = this.deadline {
                    if Instant::now() >= d {
                        this.finish();
                        return Poll::Ready(Err(no_room(limit, &this.shared.opts)));
                    }
                    match &this.timer {
                        Some(t) => t.update(cx.waker()),
                        None => match wake_at(d, cx.waker()) {
                            Ok(t) => this.timer = Some(t),
                            Err(e) => {
                                this.finish();
                                return Poll::Ready(Err(e));
                            }
                        },
                    }
                }
                Poll::Pending
            }
            other => {
                this.finish();
                Poll::Ready(other.map_err(|e| this.shared.settled(e)))
            }
        }
    }
}

impl<I: Value> Drop for Submit<I> {
    fn drop(&mut self) {
        // Cancelled while waiting: nothing was submitted; forget the waker.
        if let Some(id) = self.waiter.take() {
            self.shared.submit_waiters.unregister(id);
        }
    }
}

impl<I: Value> GraphShared<I> {
    /// Submit, waiting for room up to `submit_timeout` (the calling thread sleeps).
    pub(crate) fn execute_wait(&self, input: &I) -> Result<u64> {
        let first = self.execute(input);
        if !matches!(
            first,
            Err(Error::CapacityExceeded {
                capacity: Capacity::InflightExecutions,
                ..
            })
        ) {
            return first.map_err(|e| self.settled(e));
        }
        let deadline = deadline_after(self.opts.submit_timeout);
        let waiters = &self.submit_waiters;
        waiters.enter();
        let result = loop {
            let seen = waiters.generation();
            match self.execute(input) {
                Err(Error::CapacityExceeded {
                    capacity: Capacity::InflightExecutions,
                    limit,
                }) => {
                    if deadline.is_some_and(|d| Instant::now() >= d) {
                        break Err(no_room(limit, &self.opts));
                    }
                    waiters.sleep(seen, deadline);
                }
                other => break other.map_err(|e| self.settled(e)),
            }
        };
        waiters.leave();
        result
    }
}

impl<I: Value, O: IntoOutputs> CompiledGraph<I, O> {
    /// [`execute`](CompiledGraph::execute) that waits for room instead of failing with
    /// [`Error::CapacityExceeded`]: with `max_inflight_executions` results unread, the
    /// calling thread sleeps until a result is read (claimed by any thread, or its refs
    /// dropped), up to `submit_timeout`, then fails with [`Error::Timeout`].
    ///
    /// ```
    /// use adag::{CompileOptions, Dag, Placement, Runtime};
    /// # pub struct E;
    /// # #[adag::actor]
    /// # impl E { pub fn new() -> Self { E } pub fn echo(&mut self, x: u64) -> u64 { x } }
    /// let rt = Runtime::new()?;
    /// let e = rt.spawn::<E>(Placement::Thread, ())?;
    /// let dag = Dag::<u64>::new();
    /// let graph = dag.compile(e.echo(dag.input()), CompileOptions::default().max_inflight_executions(1))?;
    /// let first = graph.execute(1)?;
    /// assert!(graph.execute(2).is_err());               // full: fails at once
    /// std::thread::scope(|s| {
    ///     s.spawn(|| first.get());                       // another thread claims...
    ///     let second = graph.execute_wait(2)?;           // ...and this one waits for the room
    ///     assert_eq!(second.get()?, 2);
    ///     Ok::<(), adag::Error>(())
    /// })?;
    /// # Ok::<(), adag::Error>(())
    /// ```
    pub fn execute_wait(&self, input: I) -> Result<O::Refs> {
        if self.shared.opts.enable_asyncio {
            return Err(Error::WrongMode {
                message:
                    "this graph was compiled with enable_asyncio; call execute_async_wait(..).await"
                        .into(),
            });
        }
        let exec = self.shared.execute_wait(&input)?;
        Ok(self.refs(exec))
    }

    /// [`execute_async`](CompiledGraph::execute_async) that waits for room instead of
    /// failing with [`Error::CapacityExceeded`]: back-pressure for servers, without a
    /// semaphore of their own. The future resolves once the execution is submitted, or with
    /// [`Error::Timeout`] when no room freed within `submit_timeout`.
    ///
    /// It is cancel-safe: dropping it before it resolves submits nothing and leaves the
    /// graph's capacity as it was. It works on any executor: room is signalled by the
    /// graph's result pump, and the deadline by a timer thread of the driver.
    ///
    /// ```
    /// use adag::{CompileOptions, Dag, Placement, Runtime};
    /// # pub struct E;
    /// # #[adag::actor]
    /// # impl E { pub fn new() -> Self { E } pub fn echo(&mut self, x: u64) -> u64 { x } }
    /// let rt = Runtime::new()?;
    /// let e = rt.spawn::<E>(Placement::Thread, ())?;
    /// let dag = Dag::<u64>::new();
    /// let opts = CompileOptions::default().enable_asyncio(true).max_inflight_executions(2);
    /// let graph = std::sync::Arc::new(dag.compile(e.echo(dag.input()), opts)?);
    /// let tokio = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    /// let sum = tokio.block_on(async {
    ///     // Twenty requests at once, two executions in flight: each waits for room, none is
    ///     // refused.
    ///     let tasks: Vec<_> = (0..20u64)
    ///         .map(|i| {
    ///             let graph = graph.clone();
    ///             tokio::spawn(async move { graph.execute_async_wait(i).await?.await })
    ///         })
    ///         .collect();
    ///     let mut sum = 0;
    ///     for task in tasks {
    ///         sum += task.await.expect("the request task")?;
    ///     }
    ///     Ok::<u64, adag::Error>(sum)
    /// })?;
    /// assert_eq!(sum, (0..20).sum::<u64>());
    /// # Ok::<(), adag::Error>(())
    /// ```
    pub async fn execute_async_wait(&self, input: I) -> Result<O::Refs> {
        if !self.shared.opts.enable_asyncio {
            return Err(Error::WrongMode {
                message: "this graph was compiled without enable_asyncio; call execute_wait() or compile with CompileOptions::enable_asyncio(true)".into(),
            });
        }
        let exec = Submit::new(self.shared.clone(), input).await?;
        Ok(self.refs(exec))
    }
}

#[cfg(test)]
mod tests {
    use super::SubmitWaiters;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::time::{Duration, Instant};

    /// Spins (yielding) until `cond`, for at most `limit`.
    fn spin_until(limit: Duration, cond: impl Fn() -> bool) -> bool {
        let end = Instant::now() + limit;
        while !cond() {
            if Instant::now() >= end {
                return false;
            }
            std::thread::yield_now();
        }
        true
    }

    /// The race of the module docs, run many times: a notifier changes the state and notifies
    /// while a waiter that found no room registers and looks again. A notification lost
    /// there leaves the waiter asleep for its whole slice (here far longer than any wake-up):
    /// each round must end by a notification.
    #[test]
    fn a_waiter_registering_while_the_room_changes_misses_no_notification() {
        const ROUNDS: u64 = 100_000;
        let waiters = Arc::new(SubmitWaiters::new());
        let room = Arc::new(AtomicU64::new(0));
        let seen_by_waiter = Arc::new(AtomicU64::new(0));
        let notifier = {
            let (waiters, room, seen_by_waiter) =
                (waiters.clone(), room.clone(), seen_by_waiter.clone());
            std::thread::spawn(move || {
                for k in 1..=ROUNDS {
                    let acked = spin_until(Duration::from_secs(60), || {
                        seen_by_waiter.load(Ordering::Acquire) == k - 1
                    });
                    assert!(acked, "the waiter stopped at round {k}");
                    room.store(k, Ordering::Release);
                    waiters.notify();
                }
            })
        };
        let slice = Duration::from_secs(30);
        for k in 1..=ROUNDS {
            // As execute_wait: a first look without registering, then register and look again.
            if room.load(Ordering::Acquire) < k {
                waiters.enter();
                loop {
                    let seen = waiters.generation();
                    if room.load(Ordering::Acquire) >= k {
                        break;
                    }
                    assert!(
                        waiters.sleep_up_to(seen, None, slice),
                        "round {k}: the waiter slept its whole slice, a notification was lost"
                    );
                }
                waiters.leave();
            }
            seen_by_waiter.store(k, Ordering::Release);
        }
        notifier.join().unwrap();
    }
}
