//! Refs to the results of executions.
use super::RefOwner;
use crate::channel::Msg;
use crate::compile::deadline_after;
use crate::error::{Error, Result, TaskError};
use crate::value::Value;
use std::marker::PhantomData;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::Poll;
use std::time::{Duration, Instant};

/// What the result buffer holds for an output of an execution that failed fast: the error of
/// the output that failed, handed to every ref of the execution.
pub(crate) struct Failed(pub(crate) Arc<TaskError>);

/// One submitted execution, from which the refs of its outputs are made. It borrows the
/// graph's handle, so that only the refs hold it (a count less to move per execution).
#[doc(hidden)]
pub struct ExecToken<'a> {
    owner: &'a Arc<dyn RefOwner>,
    exec: u64,
}

impl<'a> ExecToken<'a> {
    pub(crate) fn new(owner: &'a Arc<dyn RefOwner>, exec: u64) -> Self {
        ExecToken { owner, exec }
    }
}

struct RefInner {
    owner: Arc<dyn RefOwner>,
    exec: u64,
    output: usize,
    claimed: AtomicBool,
}

impl RefInner {
    /// `e`, once the teardown a death or a fault started has released the graph's actors
    /// (see [`RefOwner::settle`]).
    fn settled(&self, e: Error) -> Error {
        if matches!(e, Error::ActorDied { .. } | Error::TornDown { .. }) {
            self.owner.settle();
        }
        e
    }

    /// `graph #3, execution 5, output 1 (b.echo)`; a graph of one output shows no index.
    fn fmt_place(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (graph, outputs) = self.owner.graph();
        write!(f, "graph #{graph}, execution {}", self.exec)?;
        if outputs > 1 {
            write!(f, ", output {}", self.output)?;
        }
        write!(f, " ({})", self.owner.describe_output(self.output))
    }

    /// Waits up to `deadline` until claiming this ref answers at once.
    fn wait_ready(&self, deadline: Option<Instant>) -> Result<bool> {
        let timeout = deadline.map(|d| d.saturating_duration_since(Instant::now()));
        self.owner
            .wait_ready(
                self.exec,
                self.output,
                Some(timeout.unwrap_or(Duration::MAX)),
            )
            .map_err(|e| self.settled(e))
    }
}

impl Drop for RefInner {
    fn drop(&mut self) {
        if !self.claimed.load(Ordering::Acquire) {
            self.owner.release(self.exec, self.output);
        }
    }
}

/// The future result of one output of one execution (Ray's `CompiledDAGRef`).
///
/// `get` consumes the ref; clones share one result, so a second `get` through a clone is
/// [`Error::AlreadyClaimed`]. Dropping every clone unclaimed frees the result's place.
#[must_use = "a ref holds its execution's result until claimed (get, await) or dropped"]
pub struct CompiledRef<T> {
    inner: Arc<RefInner>,
    _t: PhantomData<fn() -> T>,
}

impl<T> Clone for CompiledRef<T> {
    fn clone(&self) -> Self {
        CompiledRef {
            inner: self.inner.clone(),
            _t: PhantomData,
        }
    }
}

/// `CompiledRef(graph #3, execution 5, output 1 (b.echo))`: the graph tells the refs of two
/// graphs apart; a graph with a single output shows no output index.
impl<T> std::fmt::Debug for CompiledRef<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CompiledRef(")?;
        self.inner.fmt_place(f)?;
        f.write_str(")")
    }
}

/// `graph #3, execution 5, output 1 (b.echo)`, as errors and logs name a result.
impl<T> std::fmt::Display for CompiledRef<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.inner.fmt_place(f)
    }
}

impl<T: Value> CompiledRef<T> {
    pub(crate) fn new(token: &ExecToken<'_>, output: usize) -> Self {
        CompiledRef {
            inner: Arc::new(RefInner {
                owner: token.owner.clone(),
                exec: token.exec,
                output,
                claimed: AtomicBool::new(false),
            }),
            _t: PhantomData,
        }
    }

    /// The execution's index (0 for the first `execute`).
    pub fn execution(&self) -> u64 {
        self.inner.exec
    }

    /// The output's index among the graph's outputs (0 for a graph with one output).
    pub fn output(&self) -> usize {
        self.inner.output
    }

    /// The id of the graph the ref belongs to ([`CompiledGraph::id`](super::CompiledGraph::id)).
    pub fn graph(&self) -> u64 {
        self.inner.owner.graph().0
    }

    /// Wait for the result, up to the graph's `get_timeout`.
    pub fn get(self) -> Result<T> {
        self.fetch(None)
    }

    /// Wait for the result up to `timeout`. On a timeout the ref stays valid: call again.
    pub fn get_timeout(&self, timeout: Duration) -> Result<T> {
        self.fetch(Some(timeout))
    }

    fn fetch(&self, timeout: Option<Duration>) -> Result<T> {
        let inner = &self.inner;
        if inner.claimed.swap(true, Ordering::AcqRel) {
            return Err(Error::AlreadyClaimed {
                execution: inner.exec,
                output: inner.output,
            });
        }
        let mut slot: Option<Msg<T>> = None;
        let fetched = match inner.owner.fetch_next(inner.exec, timeout, &mut slot) {
            Some(Ok(())) => {
                return Self::from_msg(slot.expect("fetch_next fills the slot when it reads"));
            }
            Some(Err(e)) => Err(e),
            None => inner.owner.fetch(inner.exec, inner.output, timeout),
        };
        let value = match fetched {
            Ok(v) => v,
            Err(e) => {
                let e = inner.settled(e);
                if matches!(
                    e,
                    Error::Timeout { .. }
                        | Error::CapacityExceeded { .. }
                        | Error::WrongMode { .. }
                ) {
                    inner.claimed.store(false, Ordering::Release);
                }
                return Err(e);
            }
        };
        self.unpack(value)
    }

    fn from_msg(msg: Msg<T>) -> Result<T> {
        match msg {
            Msg::Value(v) => Ok(v),
            Msg::Error(e) => Err(Error::from(&*e)),
        }
    }

    fn unpack(&self, value: Box<dyn std::any::Any + Send>) -> Result<T> {
        let inner = &self.inner;
        match value.downcast::<Msg<T>>() {
            Ok(msg) => Self::from_msg(*msg),
            // The execution failed fast on another output's error.
            Err(value) if value.is::<Failed>() => match value.downcast::<Failed>() {
                Ok(failed) => Err(Error::from(&*failed.0)),
                Err(_) => unreachable!("checked by is::<Failed>"),
            },
            Err(_) => Err(Error::Codec {
                op: "decode",
                ty: std::any::type_name::<T>().into(),
                place: inner.owner.describe_output(inner.output),
                message: "the output carries another type".into(),
            }),
        }
    }
}

/// The future of a ref in a graph compiled with `enable_asyncio` (Ray's `CompiledDAGFuture`).
/// Dropping it before it resolves frees the result's place and loses nothing for the other
/// executions.
pub struct RefFuture<T> {
    r: CompiledRef<T>,
    started: bool,
    finished: bool,
}

impl<T: Value> RefFuture<T> {
    /// Polls the future, but first reads the result from the graph's output channels on this
    /// thread, waiting up to `wait` (spinning, as the channels do), when no other thread is
    /// reading them. A plain `poll` is woken by the graph's result pump, a thread of its own:
    /// for a caller that would spin on its waker anyway (an event loop with nothing else to
    /// run), reading here saves that hop between threads. `Duration::ZERO` only looks.
    ///
    /// ```
    /// # use adag::{CompileOptions, Dag, Placement, Runtime};
    /// # use std::time::Duration;
    /// # struct Adder { k: u64 }
    /// # #[adag::actor]
    /// # impl Adder {
    /// #     fn new(k: u64) -> Self { Adder { k } }
    /// #     fn add(&mut self, x: u64) -> u64 { x + self.k }
    /// # }
    /// let rt = Runtime::new().unwrap();
    /// let a = rt.spawn::<Adder>(Placement::Thread, 1).unwrap();
    /// let dag = Dag::<u64>::new();
    /// let opts = CompileOptions::default().enable_asyncio(true);
    /// let graph = dag.compile(a.add(dag.input()), opts).unwrap();
    /// let tokio = tokio::runtime::Builder::new_current_thread().build().unwrap();
    /// let r = tokio.block_on(graph.execute_async(41)).unwrap();
    /// let mut fut = std::pin::pin!(std::future::IntoFuture::into_future(r));
    /// let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    /// let v = loop {
    ///     if let std::task::Poll::Ready(v) =
    ///         fut.as_mut().poll_reading(&mut cx, Duration::from_micros(50))
    ///     {
    ///         break v.unwrap();
    ///     }
    /// };
    /// assert_eq!(v, 42);
    /// ```
    pub fn poll_reading(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        wait: Duration,
    ) -> std::task::Poll<Result<T>> {
        self.get_mut().poll_with(cx, Some(wait))
    }

    fn poll_with(
        &mut self,
        cx: &mut std::task::Context<'_>,
        read_for: Option<Duration>,
    ) -> std::task::Poll<Result<T>> {
        let this = self;
        let inner = &this.r.inner;
        if !this.started {
            if inner.claimed.swap(true, Ordering::AcqRel) {
                return std::task::Poll::Ready(Err(Error::AlreadyClaimed {
                    execution: inner.exec,
                    output: inner.output,
                }));
            }
            this.started = true;
        }
        let polled = match read_for {
            None => inner.owner.poll_fetch(inner.exec, inner.output, cx),
            Some(wait) => inner.owner.poll_reading(inner.exec, inner.output, cx, wait),
        };
        match polled {
            std::task::Poll::Pending => std::task::Poll::Pending,
            std::task::Poll::Ready(Err(e @ Error::WrongMode { .. })) => {
                // Nothing was claimed: the ref stays usable through get().
                inner.claimed.store(false, Ordering::Release);
                this.started = false;
                std::task::Poll::Ready(Err(e))
            }
            std::task::Poll::Ready(r) => {
                this.finished = true;
                let r = r.map_err(|e| this.r.inner.settled(e));
                std::task::Poll::Ready(r.and_then(|v| this.r.unpack(v)))
            }
        }
    }
}

impl<T: Value> std::future::Future for RefFuture<T> {
    type Output = Result<T>;
    fn poll(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<T>> {
        self.get_mut().poll_with(cx, None)
    }
}

impl<T> Drop for RefFuture<T> {
    fn drop(&mut self) {
        // A future dropped before it resolved gives its result up (the claim was taken, so
        // the ref's own drop would not).
        if self.started && !self.finished {
            self.r
                .inner
                .owner
                .release(self.r.inner.exec, self.r.inner.output);
        }
    }
}

impl<T: Value> std::future::IntoFuture for CompiledRef<T> {
    type Output = Result<T>;
    type IntoFuture = RefFuture<T>;
    fn into_future(self) -> RefFuture<T> {
        RefFuture {
            r: self,
            started: false,
            finished: false,
        }
    }
}

/// Getting several refs at once: a `Vec` of refs or a tuple of refs.
pub trait RefSet {
    /// The values.
    type Output;
    /// Wait for all of them, each up to the graph's `get_timeout`.
    fn get(self) -> Result<Self::Output>;

    /// Wait for all of them with **one deadline for the whole set**. On a timeout nothing is
    /// claimed ([`Error::Timeout`]) and every ref stays valid: call again. An execution that
    /// failed fails every ref of it at once, without waiting for its slow outputs.
    ///
    /// ```
    /// # use adag::{CompileOptions, Dag, Placement, RefSet, Runtime};
    /// # use std::time::Duration;
    /// # struct Adder { k: u64 }
    /// # #[adag::actor]
    /// # impl Adder {
    /// #     fn new(k: u64) -> Self { Adder { k } }
    /// #     fn add(&mut self, x: u64) -> u64 { x + self.k }
    /// # }
    /// let rt = Runtime::new().unwrap();
    /// let a = rt.spawn::<Adder>(Placement::Thread, 1).unwrap();
    /// let dag = Dag::<u64>::new();
    /// let graph = dag.compile(a.add(dag.input()), CompileOptions::default()).unwrap();
    /// let refs = vec![graph.execute(1).unwrap(), graph.execute(2).unwrap()];
    /// assert_eq!(refs.get_timeout(Duration::from_secs(10)).unwrap(), vec![2, 3]);
    /// ```
    fn get_timeout(&self, timeout: Duration) -> Result<Self::Output> {
        if self.wait_ready_until(deadline_after(timeout))? {
            self.claim_ready()
        } else {
            Err(Error::Timeout {
                what: "every result of the set".into(),
                timeout,
                hint: "nothing was claimed; call again or raise the timeout".into(),
            })
        }
    }

    /// Waits up to `deadline` until claiming every ref answers at once.
    #[doc(hidden)]
    fn wait_ready_until(&self, deadline: Option<Instant>) -> Result<bool>;

    /// Claims every ref (after `wait_ready_until`, without waiting).
    #[doc(hidden)]
    fn claim_ready(&self) -> Result<Self::Output>;
}

impl<T: Value> RefSet for CompiledRef<T> {
    type Output = T;
    fn get(self) -> Result<T> {
        CompiledRef::get(self)
    }
    fn wait_ready_until(&self, deadline: Option<Instant>) -> Result<bool> {
        self.inner.wait_ready(deadline)
    }
    fn claim_ready(&self) -> Result<T> {
        self.fetch(None)
    }
}

impl<R: RefSet> RefSet for Vec<R> {
    type Output = Vec<R::Output>;
    fn get(self) -> Result<Self::Output> {
        self.into_iter().map(RefSet::get).collect()
    }
    fn wait_ready_until(&self, deadline: Option<Instant>) -> Result<bool> {
        for r in self {
            if !r.wait_ready_until(deadline)? {
                return Ok(false);
            }
        }
        Ok(true)
    }
    fn claim_ready(&self) -> Result<Self::Output> {
        self.iter().map(RefSet::claim_ready).collect()
    }
}

macro_rules! tuple_refs {
    ($($t:ident $i:tt),+) => {
        impl<$($t: RefSet),+> RefSet for ($($t,)+) {
            type Output = ($($t::Output,)+);
            fn get(self) -> Result<Self::Output> {
                Ok(($(self.$i.get()?,)+))
            }
            fn wait_ready_until(&self, deadline: Option<Instant>) -> Result<bool> {
                Ok($(self.$i.wait_ready_until(deadline)? &&)+ true)
            }
            fn claim_ready(&self) -> Result<Self::Output> {
                Ok(($(self.$i.claim_ready()?,)+))
            }
        }
    };
}
tuple_refs!(A 0, B 1);
tuple_refs!(A 0, B 1, C 2);
tuple_refs!(A 0, B 1, C 2, D 3);
tuple_refs!(A 0, B 1, C 2, D 3, E 4);
tuple_refs!(A 0, B 1, C 2, D 3, E 4, F 5);
tuple_refs!(A 0, B 1, C 2, D 3, E 4, F 5, G 6);
tuple_refs!(A 0, B 1, C 2, D 3, E 4, F 5, G 6, H 7);

/// Wait for every ref of a list (Ray's `ray.get([refs])`).
pub fn get_all<R: RefSet>(refs: R) -> Result<R::Output> {
    refs.get()
}

/// Wait for every ref of a list with one deadline for the whole list (Ray's
/// `ray.get([refs], timeout=..)`); on a timeout nothing is claimed and the refs stay valid.
/// See [`RefSet::get_timeout`].
pub fn get_all_timeout<R: RefSet>(refs: &R, timeout: Duration) -> Result<R::Output> {
    refs.get_timeout(timeout)
}

/// The first ref of a list to be ready, claimed, and the others, untouched.
#[derive(Debug)]
pub struct First<T> {
    /// Its index in the list given.
    pub index: usize,
    /// Its result: the value, or the error of its execution.
    pub result: Result<T>,
    /// The other refs, in their order, still unclaimed.
    pub rest: Vec<CompiledRef<T>>,
}

fn no_refs() -> Error {
    Error::WrongMode {
        message: "wait_first was given no refs; pass at least one".into(),
    }
}

/// Waits until one of `refs` is ready (its value or its error is in) and claims it (Ray's
/// `ray.wait(refs, num_returns=1)` then `ray.get`). Refs of one graph become ready in
/// execution order, except that an execution failing fast is ready at once. Fails with
/// [`Error::Timeout`] when none is ready within `timeout` (then nothing is claimed), or with
/// the graph's death or teardown. For graphs compiled with `enable_asyncio`, use
/// [`wait_first_async`].
///
/// ```
/// # use adag::{CompileOptions, Dag, Placement, Runtime};
/// # use std::time::Duration;
/// # struct Adder { k: u64 }
/// # #[adag::actor]
/// # impl Adder {
/// #     fn new(k: u64) -> Self { Adder { k } }
/// #     fn add(&mut self, x: u64) -> u64 { x + self.k }
/// # }
/// let rt = Runtime::new().unwrap();
/// let a = rt.spawn::<Adder>(Placement::Thread, 1).unwrap();
/// let dag = Dag::<u64>::new();
/// let graph = dag.compile(a.add(dag.input()), CompileOptions::default()).unwrap();
/// let refs = vec![graph.execute(1).unwrap(), graph.execute(2).unwrap()];
/// let first = adag::wait_first(refs, Duration::from_secs(10)).unwrap();
/// assert_eq!((first.index, first.result.unwrap()), (0, 2));
/// assert_eq!(first.rest.len(), 1);
/// ```
pub fn wait_first<T: Value>(refs: Vec<CompiledRef<T>>, timeout: Duration) -> Result<First<T>> {
    if refs.is_empty() {
        return Err(no_refs());
    }
    let deadline = deadline_after(timeout);
    let one_graph = refs
        .iter()
        .all(|r| Arc::ptr_eq(&r.inner.owner, &refs[0].inner.owner));
    // Within one graph, results settle in execution order: waiting on the earliest
    // execution is waiting for the first. Across graphs, look at each in turn, in slices.
    let mut slice = Duration::from_millis(1);
    loop {
        for i in 0..refs.len() {
            if refs[i].inner.wait_ready(Some(crate::channel::passed()))? {
                let i = first_ready_before(&refs, i)?;
                return Ok(claim_first(refs, i));
            }
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return Err(Error::Timeout {
                what: "the first result of the list".into(),
                timeout,
                hint: "nothing was claimed; call again or raise the timeout".into(),
            });
        }
        if one_graph {
            let (i, _) = refs
                .iter()
                .enumerate()
                .min_by_key(|(_, r)| (r.inner.exec, r.inner.output))
                .expect("not empty");
            if refs[i].inner.wait_ready(deadline)? {
                return Ok(claim_first(refs, i));
            }
        } else {
            let end = Instant::now() + slice;
            let d = Some(deadline.map_or(end, |d| d.min(end)));
            for i in 0..refs.len() {
                if refs[i].inner.wait_ready(d)? {
                    let i = first_ready_before(&refs, i)?;
                    return Ok(claim_first(refs, i));
                }
            }
            slice = (slice * 2).min(Duration::from_millis(20));
        }
    }
}

/// The first ref in list order that is ready, given that `refs[found]` is. Looking at a later
/// execution reads the earlier ones off their channels too, so an earlier ref looked at just
/// before may have become ready since; a second look keeps the list's order.
fn first_ready_before<T>(refs: &[CompiledRef<T>], found: usize) -> Result<usize> {
    for (i, r) in refs[..found].iter().enumerate() {
        if r.inner.wait_ready(Some(crate::channel::passed()))? {
            return Ok(i);
        }
    }
    Ok(found)
}

fn claim_first<T: Value>(mut refs: Vec<CompiledRef<T>>, index: usize) -> First<T> {
    let r = refs.remove(index);
    let result = r.fetch(None);
    First {
        index,
        result,
        rest: refs,
    }
}

/// [`wait_first`] for graphs compiled with `enable_asyncio`: resolves when one of `refs` is
/// ready, claimed; no thread is blocked meanwhile. Drop it to stop waiting (the refs go
/// with it).
pub async fn wait_first_async<T: Value>(refs: Vec<CompiledRef<T>>) -> Result<First<T>> {
    if refs.is_empty() {
        return Err(no_refs());
    }
    // A second pass over the refs before the one found ready, for the reason
    // `first_ready_before` gives.
    let index = std::future::poll_fn(|cx| {
        let mut found = None;
        for (i, r) in refs.iter().enumerate() {
            match r.inner.owner.poll_ready(r.inner.exec, r.inner.output, cx) {
                Poll::Ready(Ok(())) => {
                    found = Some(i);
                    break;
                }
                Poll::Ready(Err(e)) => return Poll::Ready(Err(r.inner.settled(e))),
                Poll::Pending => {}
            }
        }
        let Some(found) = found else {
            return Poll::Pending;
        };
        for (i, r) in refs[..found].iter().enumerate() {
            if let Poll::Ready(Ok(())) = r.inner.owner.poll_ready(r.inner.exec, r.inner.output, cx)
            {
                return Poll::Ready(Ok(i));
            }
        }
        Poll::Ready(Ok(found))
    })
    .await?;
    let mut refs = refs;
    let r = refs.remove(index);
    let result = r.await;
    Ok(First {
        index,
        result,
        rest: refs,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::any::Any;
    use std::future::Future;
    use std::sync::Mutex;
    use std::task::{Context, Waker};

    /// A graph of two executions in which the first lands between two looks of a scan:
    /// execution 0 reads as ready only once execution 1 has been looked at (as reading
    /// execution 1 off the channels reads execution 0 first).
    #[derive(Default)]
    struct LandsBetweenLooks {
        looked_at_second: Mutex<bool>,
    }

    impl LandsBetweenLooks {
        fn ready(&self, exec: u64) -> bool {
            let mut second = self.looked_at_second.lock().unwrap();
            if exec == 1 {
                *second = true;
            }
            *second
        }
    }

    impl RefOwner for LandsBetweenLooks {
        fn fetch_next(&self, _: u64, _: Option<Duration>, _: &mut dyn Any) -> Option<Result<()>> {
            None
        }
        fn fetch(&self, exec: u64, _: usize, _: Option<Duration>) -> Result<Box<dyn Any + Send>> {
            Ok(Box::new(Msg::Value(exec * 10)))
        }
        fn poll_fetch(
            &self,
            exec: u64,
            output: usize,
            _: &mut Context<'_>,
        ) -> Poll<Result<Box<dyn Any + Send>>> {
            Poll::Ready(self.fetch(exec, output, None))
        }
        fn poll_reading(
            &self,
            exec: u64,
            output: usize,
            cx: &mut Context<'_>,
            _: Duration,
        ) -> Poll<Result<Box<dyn Any + Send>>> {
            self.poll_fetch(exec, output, cx)
        }
        fn release(&self, _: u64, _: usize) {}
        fn describe_output(&self, _: usize) -> String {
            "the fake output".into()
        }
        fn graph(&self) -> (u64, usize) {
            (0, 1)
        }
        fn settle(&self) {}
        fn wait_ready(&self, exec: u64, _: usize, _: Option<Duration>) -> Result<bool> {
            Ok(self.ready(exec))
        }
        fn poll_ready(&self, exec: u64, _: usize, _: &mut Context<'_>) -> Poll<Result<()>> {
            if self.ready(exec) {
                Poll::Ready(Ok(()))
            } else {
                Poll::Pending
            }
        }
    }

    fn two_refs() -> Vec<CompiledRef<u64>> {
        let owner: Arc<dyn RefOwner> = Arc::new(LandsBetweenLooks::default());
        (0..2)
            .map(|exec| CompiledRef::new(&ExecToken::new(&owner, exec), 0))
            .collect()
    }

    #[test]
    fn wait_first_claims_an_earlier_ref_that_became_ready_during_the_scan() {
        let first = wait_first(two_refs(), Duration::from_secs(1)).unwrap();
        assert_eq!((first.index, first.result.unwrap()), (0, 0));
        assert_eq!(first.rest[0].execution(), 1);
    }

    #[test]
    fn wait_first_async_claims_an_earlier_ref_that_became_ready_during_the_scan() {
        let mut future = std::pin::pin!(wait_first_async(two_refs()));
        let mut cx = Context::from_waker(Waker::noop());
        let Poll::Ready(first) = future.as_mut().poll(&mut cx) else {
            panic!("both refs are ready after one scan");
        };
        let first = first.unwrap();
        assert_eq!((first.index, first.result.unwrap()), (0, 0));
        assert_eq!(first.rest[0].execution(), 1);
    }
}
