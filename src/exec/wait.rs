//! Back-pressure for servers: submitting that waits for room instead of failing at once.
//!
//! `execute` and `execute_async` fail with [`Error::CapacityExceeded`] when
//! `max_inflight_executions` executions are unread (Ray's semantics). The waiting variants
//! try again each time room may have freed: the graph notifies its [`SubmitWaiters`] when it
//! reads an execution's outputs (`store`, by a `get` or the async pump), when a ref is
//! released, and at teardown. A waiting future holds nothing but its input, a waker
//! registration and a timer entry until the very poll that submits, so dropping it at any
//! await point submits nothing and leaks nothing.
use super::timer::{TimerEntry, wake_at};
use super::{CompiledGraph, GraphShared, IntoOutputs};
use crate::compile::deadline_after;
use crate::error::{Capacity, Error, Result};
use crate::value::Value;
use parking_lot::{Condvar, Mutex};
use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll, Waker};
use std::time::Instant;

/// The submitters of one graph waiting for room.
pub(crate) struct SubmitWaiters {
    /// Bumped on every notification: a thread waits for it to change.
    generation: AtomicU64,
    /// Threads waiting plus tasks registered: while 0, a notification (one per execution
    /// read) costs two atomic operations and takes no lock.
    waiting: AtomicUsize,
    state: Mutex<WaitState>,
    /// Wakes threads in `execute_wait`.
    cv: Condvar,
}

struct WaitState {
    /// Tasks in `execute_async_wait`; each is woken once and registers again when polled.
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
    /// every waiter tries again.
    pub(crate) fn notify(&self) {
        // Pairs with the waiters' SeqCst store of `waiting` then load of `generation`: either
        // this sees them waiting, or they see the new generation (and a registered task
        // tries again in the poll that registered it).
        self.generation.fetch_add(1, Ordering::SeqCst);
        if self.waiting.load(Ordering::SeqCst) == 0 {
            return;
        }
        let wakers: Vec<Waker> = {
            let mut s = self.state.lock();
            let wakers = s.wakers.drain().map(|(_, w)| w).collect();
            self.waiting.store(s.count(), Ordering::SeqCst);
            wakers
        };
        self.cv.notify_all();
        for w in wakers {
            w.wake();
        }
    }

    fn generation(&self) -> u64 {
        self.generation.load(Ordering::SeqCst)
    }

    /// Wait until a notification after `seen`; false when `deadline` passed first.
    fn wait_change(&self, seen: u64, deadline: Option<Instant>) -> bool {
        let mut s = self.state.lock();
        s.threads += 1;
        self.waiting.store(s.count(), Ordering::SeqCst);
        let mut changed = true;
        while self.generation() == seen {
            match deadline {
                None => self.cv.wait(&mut s),
                Some(d) => {
                    if self.cv.wait_until(&mut s, d).timed_out() && self.generation() == seen {
                        changed = false;
                        break;
                    }
                }
            }
        }
        s.threads -= 1;
        self.waiting.store(s.count(), Ordering::SeqCst);
        changed
    }

    /// Register (or refresh) a task's waker; returns its id. The caller tries to submit
    /// after this, so a notification in between is not lost.
    fn register(&self, id: Option<u64>, waker: &Waker) -> u64 {
        let mut s = self.state.lock();
        let id = id.unwrap_or_else(|| {
            s.next_id += 1;
            s.next_id
        });
        s.wakers.insert(id, waker.clone());
        self.waiting.store(s.count(), Ordering::SeqCst);
        id
    }

    fn unregister(&self, id: u64) {
        let mut s = self.state.lock();
        if s.wakers.remove(&id).is_some() {
            self.waiting.store(s.count(), Ordering::SeqCst);
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
        // Register before trying: room freed after the attempt then wakes this task.
        this.waiter = Some(this.shared.submit_waiters.register(this.waiter, cx.waker()));
        // Synchronizes with any notification that did not see this task registered, so the
        // attempt below sees the room that notification announced.
        this.shared.submit_waiters.generation();
        match this.shared.execute(&this.input) {
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
        let deadline = deadline_after(self.opts.submit_timeout);
        loop {
            let seen = self.submit_waiters.generation();
            match self.execute(input) {
                Err(Error::CapacityExceeded {
                    capacity: Capacity::InflightExecutions,
                    limit,
                }) => {
                    if !self.submit_waiters.wait_change(seen, deadline) {
                        return Err(no_room(limit, &self.opts));
                    }
                }
                other => return other.map_err(|e| self.settled(e)),
            }
        }
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
