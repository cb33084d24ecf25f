//! Refs to the results of executions.
use super::RefOwner;
use crate::channel::Msg;
use crate::compile::deadline_after;
use crate::error::{Error, Result, TaskError};
use crate::value::Value;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, OnceLock};
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

/// Where a ref's result is: its graph, execution and output.
struct Place {
    owner: Arc<dyn RefOwner>,
    exec: u64,
    output: usize,
}

impl Place {
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

/// A ref never cloned claims its result with a flag of its own.
const OWN_UNCLAIMED: u8 = 0;
/// ... and has claimed it.
const OWN_CLAIMED: u8 = 1;
/// The ref was cloned: the flag that counts is the one its clones share.
const SHARED: u8 = 2;

/// Whether a ref's result was claimed, one answer for the ref and all its clones.
///
/// Most refs are never cloned: their flag lives in the ref itself, so that an execution
/// allocates nothing for its ref and a `get` and the drop after it touch no shared count
/// (an `Arc` per ref, as before, cost ~40 ns of a 0.45 µs round trip here: its allocation,
/// its free and three locked counts on the `get`'s path). The first clone moves the flag
/// into a cell the clones share; the last of them to go releases an unclaimed result.
struct Claim {
    state: AtomicU8,
    shared: OnceLock<Arc<AtomicBool>>,
}

impl Claim {
    fn new() -> Self {
        Claim {
            state: AtomicU8::new(OWN_UNCLAIMED),
            shared: OnceLock::new(),
        }
    }

    /// The flag the clones share, made on first use from the ref's own. The state turns
    /// `SHARED` only inside this initialiser, which runs once while every other caller of
    /// `get_or_init` waits for it: whoever sees `SHARED` finds the cell here.
    fn shared(&self) -> &Arc<AtomicBool> {
        self.shared.get_or_init(|| {
            let was = self.state.swap(SHARED, Ordering::AcqRel);
            Arc::new(AtomicBool::new(was == OWN_CLAIMED))
        })
    }

    /// The claim of a clone: the shared flag.
    fn clone_shared(&self) -> Claim {
        Claim {
            state: AtomicU8::new(SHARED),
            shared: OnceLock::from(self.shared().clone()),
        }
    }

    /// Claims the result; `false` when it was claimed already.
    fn take(&self) -> bool {
        match self.state.compare_exchange(
            OWN_UNCLAIMED,
            OWN_CLAIMED,
            Ordering::AcqRel,
            Ordering::Acquire,
        ) {
            Ok(_) => true,
            Err(OWN_CLAIMED) => false,
            Err(_) => !self.shared().swap(true, Ordering::AcqRel),
        }
    }

    /// [`take`](Self::take) by the ref's only user: no other thread can look at its own
    /// flag, so it is set without a locked instruction.
    fn take_mut(&mut self) -> bool {
        let state = self.state.get_mut();
        match *state {
            OWN_UNCLAIMED => {
                *state = OWN_CLAIMED;
                true
            }
            OWN_CLAIMED => false,
            _ => !self.shared().swap(true, Ordering::AcqRel),
        }
    }

    /// Undoes a claim that got nothing (a timeout): the result can be claimed again.
    fn give_back(&self) {
        if self
            .state
            .compare_exchange(
                OWN_CLAIMED,
                OWN_UNCLAIMED,
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .is_err()
        {
            self.shared().store(false, Ordering::Release);
        }
    }

    /// As one holder lets go: whether it was the last and the result is still unclaimed.
    fn last_and_unclaimed(&mut self) -> bool {
        match *self.state.get_mut() {
            OWN_UNCLAIMED => true,
            OWN_CLAIMED => false,
            _ => self
                .shared
                .take()
                .and_then(Arc::into_inner)
                .is_some_and(|claimed| !claimed.into_inner()),
        }
    }
}

/// The future result of one output of one execution (Ray's `CompiledDAGRef`).
///
/// `get` consumes the ref; clones share one result, so a second `get` through a clone is
/// [`Error::AlreadyClaimed`]. Dropping every clone unclaimed frees the result's place.
#[must_use = "a ref holds its execution's result until claimed (get, await) or dropped"]
pub struct CompiledRef<T> {
    place: Place,
    claim: Claim,
    _t: PhantomData<fn() -> T>,
}

impl<T> Clone for CompiledRef<T> {
    fn clone(&self) -> Self {
        CompiledRef {
            place: Place {
                owner: self.place.owner.clone(),
                exec: self.place.exec,
                output: self.place.output,
            },
            claim: self.claim.clone_shared(),
            _t: PhantomData,
        }
    }
}

impl<T> Drop for CompiledRef<T> {
    fn drop(&mut self) {
        if self.claim.last_and_unclaimed() {
            self.place.owner.release(self.place.exec, self.place.output);
        }
    }
}

/// `CompiledRef(graph #3, execution 5, output 1 (b.echo))`: the graph tells the refs of two
/// graphs apart; a graph with a single output shows no output index.
impl<T> std::fmt::Debug for CompiledRef<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CompiledRef(")?;
        self.place.fmt_place(f)?;
        f.write_str(")")
    }
}

/// `graph #3, execution 5, output 1 (b.echo)`, as errors and logs name a result.
impl<T> std::fmt::Display for CompiledRef<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.place.fmt_place(f)
    }
}

impl<T: Value> CompiledRef<T> {
    pub(crate) fn new(token: &ExecToken<'_>, output: usize) -> Self {
        CompiledRef {
            place: Place {
                owner: token.owner.clone(),
                exec: token.exec,
                output,
            },
            claim: Claim::new(),
            _t: PhantomData,
        }
    }

    /// The execution's index (0 for the first `execute`).
    pub fn execution(&self) -> u64 {
        self.place.exec
    }

    /// The output's index among the graph's outputs (0 for a graph with one output).
    pub fn output(&self) -> usize {
        self.place.output
    }

    /// The id of the graph the ref belongs to ([`CompiledGraph::id`](super::CompiledGraph::id)).
    pub fn graph(&self) -> u64 {
        self.place.owner.graph().0
    }

    /// Wait for the result, up to the graph's `get_timeout`.
    pub fn get(mut self) -> Result<T> {
        if !self.claim.take_mut() {
            return Err(self.already_claimed());
        }
        self.fetch_claimed(None)
    }

    /// Wait for the result up to `timeout`. On a timeout the ref stays valid: call again.
    pub fn get_timeout(&self, timeout: Duration) -> Result<T> {
        self.fetch(Some(timeout))
    }

    fn already_claimed(&self) -> Error {
        Error::AlreadyClaimed {
            execution: self.place.exec,
            output: self.place.output,
        }
    }

    fn fetch(&self, timeout: Option<Duration>) -> Result<T> {
        if !self.claim.take() {
            return Err(self.already_claimed());
        }
        self.fetch_claimed(timeout)
    }

    /// Fetches the result this ref has claimed; a fetch that got nothing gives the claim
    /// back.
    fn fetch_claimed(&self, timeout: Option<Duration>) -> Result<T> {
        let place = &self.place;
        let mut slot: Option<Msg<T>> = None;
        let fetched = match place.owner.fetch_next(place.exec, timeout, &mut slot) {
            Some(Ok(())) => {
                return Self::from_msg(slot.expect("fetch_next fills the slot when it reads"));
            }
            Some(Err(e)) => Err(e),
            None => place.owner.fetch(place.exec, place.output, timeout),
        };
        let value = match fetched {
            Ok(v) => v,
            Err(e) => {
                let e = place.settled(e);
                if e.ref_stays_usable() {
                    self.claim.give_back();
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
        let place = &self.place;
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
                place: place.owner.describe_output(place.output),
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
        let place = &this.r.place;
        if !this.started {
            if !this.r.claim.take() {
                return std::task::Poll::Ready(Err(this.r.already_claimed()));
            }
            this.started = true;
        }
        let polled = match read_for {
            None => place.owner.poll_fetch(place.exec, place.output, cx),
            Some(wait) => place.owner.poll_reading(place.exec, place.output, cx, wait),
        };
        match polled {
            std::task::Poll::Pending => std::task::Poll::Pending,
            std::task::Poll::Ready(Err(e @ Error::WrongMode { .. })) => {
                // Nothing was claimed: the ref stays usable through get().
                this.r.claim.give_back();
                this.started = false;
                std::task::Poll::Ready(Err(e))
            }
            std::task::Poll::Ready(r) => {
                this.finished = true;
                let r = r.map_err(|e| this.r.place.settled(e));
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
            let place = &self.r.place;
            place.owner.release(place.exec, place.output);
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
        self.place.wait_ready(deadline)
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
        .all(|r| Arc::ptr_eq(&r.place.owner, &refs[0].place.owner));
    // Within one graph, results settle in execution order: waiting on the earliest
    // execution is waiting for the first. Across graphs, look at each in turn, in slices.
    let mut slice = Duration::from_millis(1);
    loop {
        for i in 0..refs.len() {
            if refs[i].place.wait_ready(Some(crate::channel::passed()))? {
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
                .min_by_key(|(_, r)| (r.place.exec, r.place.output))
                .expect("not empty");
            if refs[i].place.wait_ready(deadline)? {
                return Ok(claim_first(refs, i));
            }
        } else {
            let end = Instant::now() + slice;
            let d = Some(deadline.map_or(end, |d| d.min(end)));
            for i in 0..refs.len() {
                if refs[i].place.wait_ready(d)? {
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
        if r.place.wait_ready(Some(crate::channel::passed()))? {
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
            match r.place.owner.poll_ready(r.place.exec, r.place.output, cx) {
                Poll::Ready(Ok(())) => {
                    found = Some(i);
                    break;
                }
                Poll::Ready(Err(e)) => return Poll::Ready(Err(r.place.settled(e))),
                Poll::Pending => {}
            }
        }
        let Some(found) = found else {
            return Poll::Pending;
        };
        for (i, r) in refs[..found].iter().enumerate() {
            if let Poll::Ready(Ok(())) = r.place.owner.poll_ready(r.place.exec, r.place.output, cx)
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

    /// A fake graph. Its results are `exec * 10`, always there, after `timeouts` fetches
    /// that time out; it counts what its refs release. With `lands_between_looks`,
    /// execution 0 reads as ready only once execution 1 has been looked at (as reading
    /// execution 1 off the channels reads execution 0 first): a graph of two executions in
    /// which the first lands between two looks of a scan.
    #[derive(Default)]
    struct FakeOwner {
        lands_between_looks: bool,
        looked_at_second: Mutex<bool>,
        released: std::sync::atomic::AtomicUsize,
        timeouts: std::sync::atomic::AtomicUsize,
    }

    impl FakeOwner {
        fn ready(&self, exec: u64) -> bool {
            if !self.lands_between_looks {
                return true;
            }
            let mut second = self.looked_at_second.lock().unwrap();
            if exec == 1 {
                *second = true;
            }
            *second
        }
    }

    impl RefOwner for FakeOwner {
        fn fetch_next(&self, _: u64, _: Option<Duration>, _: &mut dyn Any) -> Option<Result<()>> {
            None
        }
        fn fetch(&self, exec: u64, _: usize, t: Option<Duration>) -> Result<Box<dyn Any + Send>> {
            let left = self.timeouts.load(Ordering::Relaxed);
            if left > 0 {
                self.timeouts.store(left - 1, Ordering::Relaxed);
                return Err(Error::Timeout {
                    what: "a result".into(),
                    timeout: t.unwrap_or_default(),
                    hint: String::new(),
                });
            }
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
        fn release(&self, _: u64, _: usize) {
            self.released.fetch_add(1, Ordering::Relaxed);
        }
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
        let owner: Arc<dyn RefOwner> = Arc::new(FakeOwner {
            lands_between_looks: true,
            ..FakeOwner::default()
        });
        (0..2)
            .map(|exec| CompiledRef::new(&ExecToken::new(&owner, exec), 0))
            .collect()
    }

    fn counted_ref(exec: u64) -> (Arc<FakeOwner>, CompiledRef<u64>) {
        let fake = Arc::new(FakeOwner::default());
        let owner: Arc<dyn RefOwner> = fake.clone();
        let r = CompiledRef::new(&ExecToken::new(&owner, exec), 0);
        (fake, r)
    }

    fn released(c: &FakeOwner) -> usize {
        c.released.load(Ordering::Relaxed)
    }

    #[test]
    fn a_ref_dropped_unclaimed_releases_its_result_once_whoever_holds_clones() {
        let (c, r) = counted_ref(3);
        drop(r);
        assert_eq!(released(&c), 1, "a ref never cloned");

        let (c, r) = counted_ref(3);
        let clones = vec![r.clone(), r.clone().clone()];
        drop(r);
        assert_eq!(released(&c), 0, "clones still hold the result");
        drop(clones);
        assert_eq!(released(&c), 1, "the last clone releases it, once");
    }

    #[test]
    fn a_claimed_result_is_claimed_for_every_clone_and_never_released() {
        let (c, r) = counted_ref(7);
        let clone = r.clone();
        assert_eq!(clone.get().unwrap(), 70);
        assert!(matches!(
            r.get_timeout(Duration::from_secs(1)),
            Err(Error::AlreadyClaimed { execution: 7, .. })
        ));
        assert!(matches!(r.get(), Err(Error::AlreadyClaimed { .. })));
        assert_eq!(released(&c), 0);

        // Claimed before the first clone: the clone made after sees the claim.
        let (c, r) = counted_ref(8);
        assert_eq!(r.get_timeout(Duration::from_secs(1)).unwrap(), 80);
        let clone = r.clone();
        assert!(matches!(clone.get(), Err(Error::AlreadyClaimed { .. })));
        drop(r);
        assert_eq!(released(&c), 0);
    }

    #[test]
    fn a_get_that_times_out_gives_the_claim_back_to_the_ref_and_its_clones() {
        let (c, r) = counted_ref(2);
        c.timeouts.store(2, Ordering::Relaxed);
        assert!(matches!(
            r.get_timeout(Duration::from_millis(1)),
            Err(Error::Timeout { .. })
        ));
        let clone = r.clone();
        assert!(matches!(
            clone.get_timeout(Duration::from_millis(1)),
            Err(Error::Timeout { .. })
        ));
        assert_eq!(r.get().unwrap(), 20);
        drop(clone);
        assert_eq!(released(&c), 0);
    }

    /// A ref cloned on one thread while another claims it: exactly one claim wins, and the
    /// result is released by nobody.
    #[test]
    fn cloning_while_another_thread_claims_loses_no_claim_and_adds_none() {
        for round in 0..2_000 {
            let (c, r) = counted_ref(round);
            let (claims, clone) = std::thread::scope(|s| {
                let claimer = s.spawn(|| r.get_timeout(Duration::from_secs(1)).is_ok());
                let clone = r.clone();
                let by_clone = clone.get_timeout(Duration::from_secs(1)).is_ok();
                (
                    usize::from(claimer.join().unwrap()) + usize::from(by_clone),
                    clone,
                )
            });
            assert_eq!(claims, 1, "round {round}: {claims} claims of one result");
            drop((r, clone));
            assert_eq!(released(&c), 0, "round {round}");
        }
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
