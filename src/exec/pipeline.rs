//! The pipelining helpers: run a sequence of inputs through a graph with up to `depth`
//! executions in flight and get the results back in input order, without hand-writing the
//! queue of pending refs. [`Pipeline`] is an iterator (sync graphs); [`AsyncPipeline`] is a
//! stream (graphs compiled with `enable_asyncio`).
use super::refs::{CompiledRef, RefSet};
use super::wait::Submit;
use super::{CompiledGraph, IntoOutputs};
use crate::error::{Error, Result};
use crate::value::Value;
use std::collections::VecDeque;
use std::future::{Future, IntoFuture};
use std::pin::Pin;
use std::task::{Context, Poll};

/// What one execution of a pipeline yields: the values of its refs.
type Item<O> = Result<<<O as IntoOutputs>::Refs as RefSet>::Output>;

/// A boxed claim of one execution's refs.
pub type ClaimFuture<T> = Pin<Box<dyn Future<Output = Result<T>> + Send>>;

/// Refs that can be awaited together (one ref, a `Vec` or a tuple of them): what
/// [`AsyncPipeline`] awaits for each execution. Implemented for every shape of refs that
/// `execute_async` returns.
pub trait AsyncRefSet: RefSet + Send + 'static {
    /// Await every ref, in order.
    #[doc(hidden)]
    fn claim_async(self) -> ClaimFuture<Self::Output>;
}

impl<T: Value> AsyncRefSet for CompiledRef<T> {
    fn claim_async(self) -> ClaimFuture<T> {
        Box::pin(self.into_future())
    }
}

impl<R: AsyncRefSet> AsyncRefSet for Vec<R>
where
    R::Output: Send,
{
    fn claim_async(self) -> ClaimFuture<Self::Output> {
        Box::pin(async move {
            let mut out = Vec::with_capacity(self.len());
            for r in self {
                out.push(r.claim_async().await?);
            }
            Ok(out)
        })
    }
}

macro_rules! tuple_claims {
    ($($t:ident $i:tt),+) => {
        impl<$($t: AsyncRefSet),+> AsyncRefSet for ($($t,)+)
        where
            $($t::Output: Send,)+
        {
            #[allow(non_snake_case)]
            fn claim_async(self) -> ClaimFuture<Self::Output> {
                let ($($t,)+) = self;
                Box::pin(async move { Ok(($($t.claim_async().await?,)+)) })
            }
        }
    };
}
tuple_claims!(A 0, B 1);
tuple_claims!(A 0, B 1, C 2);
tuple_claims!(A 0, B 1, C 2, D 3);
tuple_claims!(A 0, B 1, C 2, D 3, E 4);
tuple_claims!(A 0, B 1, C 2, D 3, E 4, F 5);
tuple_claims!(A 0, B 1, C 2, D 3, E 4, F 5, G 6);
tuple_claims!(A 0, B 1, C 2, D 3, E 4, F 5, G 6, H 7);

fn check_depth<I: Value, O: IntoOutputs>(graph: &CompiledGraph<I, O>, depth: usize) -> Result<()> {
    let max = graph.shared.opts.max_inflight_executions;
    if depth == 0 || depth > max {
        return Err(Error::InvalidArgument {
            name: "depth".into(),
            message: format!(
                "a pipeline keeps 1 to max_inflight_executions ({max}) executions in flight, not {depth}; pass a depth in that range or compile with a larger CompileOptions::max_inflight_executions"
            ),
        });
    }
    Ok(())
}

/// The results of a sequence of inputs, in input order, with up to `depth` executions in
/// flight (a sync graph). Made by [`CompiledGraph::pipeline`].
///
/// Each item is one execution's values, or its error ([`Error::Task`], a timeout claiming
/// it); the pipeline goes on after such an item. When an input cannot be submitted (an
/// [`Error::Input`], a torn-down graph, no room within `submit_timeout`), the pipeline
/// yields the results before it, then that error, and ends.
#[must_use = "a pipeline submits nothing until it is iterated"]
pub struct Pipeline<'g, I: Value, O: IntoOutputs, It> {
    graph: &'g CompiledGraph<I, O>,
    inputs: It,
    depth: usize,
    pending: VecDeque<O::Refs>,
    failed: Option<Error>,
    exhausted: bool,
}

impl<I: Value, O: IntoOutputs, It> Pipeline<'_, I, O, It> {
    /// How many executions are submitted and not yet yielded.
    pub fn in_flight(&self) -> usize {
        self.pending.len()
    }
}

impl<I: Value, O: IntoOutputs, It: Iterator<Item = I>> Iterator for Pipeline<'_, I, O, It>
where
    O::Refs: RefSet,
{
    type Item = Item<O>;

    fn next(&mut self) -> Option<Item<O>> {
        // Top up to `depth` in flight before waiting on the oldest, so that the graph works
        // on the next inputs while this one is claimed.
        while !self.exhausted && self.pending.len() < self.depth {
            match self.inputs.next() {
                None => self.exhausted = true,
                Some(input) => match self.graph.execute_wait(input) {
                    Ok(refs) => self.pending.push_back(refs),
                    Err(e) => {
                        self.failed = Some(e);
                        self.exhausted = true;
                    }
                },
            }
        }
        match self.pending.pop_front() {
            Some(refs) => Some(refs.get()),
            None => self.failed.take().map(Err),
        }
    }
}

impl<I: Value, O: IntoOutputs, It: Iterator<Item = I>> std::iter::FusedIterator
    for Pipeline<'_, I, O, It>
where
    O::Refs: RefSet,
{
}

/// The results of a sequence of inputs, in input order, with up to `depth` executions in
/// flight (a graph compiled with `enable_asyncio`): a [`Stream`](futures_core::Stream), also
/// read with [`next`](AsyncPipeline::next). Made by [`CompiledGraph::pipeline_async`].
///
/// Items and errors are as for [`Pipeline`]. Each submission waits for room like
/// [`CompiledGraph::execute_async_wait`]; dropping the pipeline drops its pending refs,
/// which frees their places.
#[must_use = "a pipeline submits nothing until it is polled"]
pub struct AsyncPipeline<'g, I: Value, O: IntoOutputs, It>
where
    O::Refs: AsyncRefSet,
{
    graph: &'g CompiledGraph<I, O>,
    inputs: It,
    depth: usize,
    submitting: Option<Submit<I>>,
    pending: VecDeque<ClaimFuture<<O::Refs as RefSet>::Output>>,
    failed: Option<Error>,
    exhausted: bool,
}

// Neither the inputs nor the submission are ever pinned in place.
impl<I: Value, O: IntoOutputs, It> Unpin for AsyncPipeline<'_, I, O, It> where O::Refs: AsyncRefSet {}

impl<I: Value, O: IntoOutputs, It: Iterator<Item = I>> AsyncPipeline<'_, I, O, It>
where
    O::Refs: AsyncRefSet,
{
    /// How many executions are submitted (or being submitted) and not yet yielded.
    pub fn in_flight(&self) -> usize {
        self.pending.len() + usize::from(self.submitting.is_some())
    }

    /// The next result, in input order; `None` after the last.
    pub async fn next(&mut self) -> Option<Item<O>> {
        std::future::poll_fn(|cx| self.poll_item(cx)).await
    }

    fn poll_item(&mut self, cx: &mut Context<'_>) -> Poll<Option<Item<O>>> {
        loop {
            if let Some(submit) = &mut self.submitting {
                match Pin::new(submit).poll(cx) {
                    Poll::Ready(Ok(exec)) => {
                        self.submitting = None;
                        let refs = self.graph.refs(exec);
                        self.pending.push_back(refs.claim_async());
                    }
                    Poll::Ready(Err(e)) => {
                        self.submitting = None;
                        self.failed = Some(e);
                        self.exhausted = true;
                    }
                    Poll::Pending => {}
                }
            }
            if self.submitting.is_none() && !self.exhausted && self.pending.len() < self.depth {
                match self.inputs.next() {
                    Some(input) => {
                        self.submitting = Some(Submit::new(self.graph.shared.clone(), input));
                        continue;
                    }
                    None => self.exhausted = true,
                }
            }
            if let Some(front) = self.pending.front_mut() {
                return match front.as_mut().poll(cx) {
                    Poll::Ready(r) => {
                        self.pending.pop_front();
                        Poll::Ready(Some(r))
                    }
                    Poll::Pending => Poll::Pending,
                };
            }
            if self.submitting.is_some() {
                return Poll::Pending;
            }
            return Poll::Ready(self.failed.take().map(Err));
        }
    }
}

impl<I: Value, O: IntoOutputs, It: Iterator<Item = I>> futures_core::Stream
    for AsyncPipeline<'_, I, O, It>
where
    O::Refs: AsyncRefSet,
{
    type Item = Item<O>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Item<O>>> {
        self.get_mut().poll_item(cx)
    }
}

impl<I: Value, O: IntoOutputs> CompiledGraph<I, O> {
    /// Execute every input of `inputs` with up to `depth` executions in flight
    /// (`1..=max_inflight_executions`), yielding the results in input order: the queue of
    /// pending refs, written once. Each submission waits for room like
    /// [`execute_wait`](CompiledGraph::execute_wait), so other users of the graph may share
    /// it.
    ///
    /// ```
    /// use adag::{CompileOptions, Dag, Placement, Runtime};
    /// # pub struct E;
    /// # #[adag::actor]
    /// # impl E { pub fn new() -> Self { E } pub fn echo(&mut self, x: u64) -> u64 { x } }
    /// let rt = Runtime::new()?;
    /// let e = rt.spawn::<E>(Placement::Thread, ())?;
    /// let dag = Dag::<u64>::new();
    /// let graph = dag.compile(e.echo(dag.input()), CompileOptions::default().max_inflight_executions(4))?;
    /// let results: Vec<u64> = graph.pipeline(0..100, 4)?.collect::<Result<_, _>>()?;
    /// assert_eq!(results, (0..100).collect::<Vec<_>>());
    /// # Ok::<(), adag::Error>(())
    /// ```
    pub fn pipeline<It: IntoIterator<Item = I>>(
        &self,
        inputs: It,
        depth: usize,
    ) -> Result<Pipeline<'_, I, O, It::IntoIter>>
    where
        O::Refs: RefSet,
    {
        if self.shared.opts.enable_asyncio {
            return Err(Error::WrongMode {
                message: "this graph was compiled with enable_asyncio; use pipeline_async".into(),
            });
        }
        check_depth(self, depth)?;
        Ok(Pipeline {
            graph: self,
            inputs: inputs.into_iter(),
            depth,
            pending: VecDeque::with_capacity(depth),
            failed: None,
            exhausted: false,
        })
    }

    /// [`pipeline`](CompiledGraph::pipeline) for a graph compiled with `enable_asyncio`: a
    /// stream of the results in input order, with up to `depth` executions in flight.
    ///
    /// ```
    /// use adag::{CompileOptions, Dag, Placement, Runtime};
    /// # pub struct E;
    /// # #[adag::actor]
    /// # impl E { pub fn new() -> Self { E } pub fn echo(&mut self, x: u64) -> u64 { x } }
    /// let rt = Runtime::new()?;
    /// let e = rt.spawn::<E>(Placement::Thread, ())?;
    /// let dag = Dag::<u64>::new();
    /// let opts = CompileOptions::default().enable_asyncio(true).max_inflight_executions(4);
    /// let graph = dag.compile(e.echo(dag.input()), opts)?;
    /// let tokio = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    /// tokio.block_on(async {
    ///     let mut results = graph.pipeline_async(0..100, 4)?;
    ///     let mut expected = 0;
    ///     while let Some(value) = results.next().await {
    ///         assert_eq!(value?, expected);
    ///         expected += 1;
    ///     }
    ///     assert_eq!(expected, 100);
    ///     Ok::<(), adag::Error>(())
    /// })?;
    /// # Ok::<(), adag::Error>(())
    /// ```
    pub fn pipeline_async<It: IntoIterator<Item = I>>(
        &self,
        inputs: It,
        depth: usize,
    ) -> Result<AsyncPipeline<'_, I, O, It::IntoIter>>
    where
        O::Refs: AsyncRefSet,
    {
        if !self.shared.opts.enable_asyncio {
            return Err(Error::WrongMode {
                message: "this graph was compiled without enable_asyncio; use pipeline".into(),
            });
        }
        check_depth(self, depth)?;
        Ok(AsyncPipeline {
            graph: self,
            inputs: inputs.into_iter(),
            depth,
            submitting: None,
            pending: VecDeque::with_capacity(depth),
            failed: None,
            exhausted: false,
        })
    }
}
