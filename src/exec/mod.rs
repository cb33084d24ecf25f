//! Execution: the compiled graph, `execute`, refs, the result buffer, capacity accounting,
//! teardown and the death of an actor.
use crate::actor::HandleCore;
use crate::actor::worker::DeathSink;
use crate::actor::host::{ActorLink, Control, RunRequest};
use crate::channel::endpoint::{ChanError, EdgeReader, EdgeWriter, Msg, ProcChannels};
use crate::channel::shm::{ShmChannel, ShmConfig};
use crate::compile::plan::{GraphPlan, Loc};
use crate::compile::{CompileOptions, Planned, deadline_after, release_actors};
use crate::dag::input::{Feeder, InputFeed};
use crate::dag::{AnyNode, IntoOutputs};
use crate::error::{Capacity, Error, Result};
use crate::value::Value;
use crossbeam_channel::Receiver;
use parking_lot::{Condvar, Mutex};
use std::task::{Context, Poll, Waker};
use std::any::Any;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::marker::PhantomData;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

mod pump;
mod refs;
pub(crate) mod viz;
pub use refs::{CompiledRef, ExecToken, RefFuture, RefSet, get_all};

/// The driver's endpoints in its own process.
pub struct DriverIo {
    pub(crate) chans: Arc<ProcChannels>,
}

impl DriverIo {
    pub(crate) fn writer<T: Value>(&self, plan: &GraphPlan, edge: u64) -> Result<EdgeWriter<T>> {
        self.chans
            .writer::<T>(plan, edge, Loc::Driver)
            .map_err(|e| Error::compile(format!("edge {edge}"), e))
    }

    pub(crate) fn reader<T: Value>(&self, plan: &GraphPlan, edge: u64) -> Result<EdgeReader<T>> {
        self.chans
            .reader::<T>(plan, edge, Loc::Driver)
            .map_err(|e| Error::compile(format!("edge {edge}"), e))
    }
}

/// Reads one output edge and hands one copy of each value to every output that names it.
pub(crate) trait OutputReader: Send {
    fn read(&mut self, copies: usize, deadline: Option<Instant>) -> Result<Vec<Box<dyn Any + Send>>, ChanError>;
}

struct TypedOutput<T>(EdgeReader<T>);

impl<T: Value> OutputReader for TypedOutput<T> {
    fn read(&mut self, copies: usize, deadline: Option<Instant>) -> Result<Vec<Box<dyn Any + Send>>, ChanError> {
        let msg = self.0.read(deadline)?;
        let mut out: Vec<Box<dyn Any + Send>> = (1..copies).map(|_| Box::new(msg.clone()) as Box<dyn Any + Send>).collect();
        out.push(Box::new(msg));
        Ok(out)
    }
}

/// One output of a graph with the typed code that reads it (built by [`IntoOutputs`]).
#[doc(hidden)]
pub struct OutputSpec {
    pub(crate) node: AnyNode,
    make: fn(&DriverIo, &GraphPlan, u64) -> Result<Box<dyn OutputReader>>,
}

impl OutputSpec {
    pub(crate) fn of<T: Value>(node: AnyNode) -> Self {
        OutputSpec {
            node,
            make: |io, plan, edge| Ok(Box::new(TypedOutput::<T>(io.reader::<T>(plan, edge)?))),
        }
    }
}

struct OutputEdge {
    reader: Box<dyn OutputReader>,
    /// The output indices this edge feeds.
    outputs: Vec<usize>,
}

struct DriverState<I> {
    feeders: Vec<Box<dyn Feeder<I>>>,
    edges: Vec<OutputEdge>,
    next_exec: u64,
    next_read: u64,
    /// Outputs of execution `next_read` read so far (it may be read edge by edge across timeouts).
    partial: Vec<Option<Box<dyn Any + Send>>>,
    partial_edges: usize,
    buffer: BTreeMap<u64, Vec<Option<Box<dyn Any + Send>>>>,
    /// Refs dropped before their execution was read.
    dropped: HashSet<(u64, usize)>,
    /// Async mode: futures waiting for a result, and the pump's submission tokens.
    wakers: HashMap<(u64, usize), Waker>,
    submitted: Option<crossbeam_channel::Sender<()>>,
}

/// What refs see of their graph.
pub(crate) trait RefOwner: Send + Sync {
    fn fetch(&self, exec: u64, output: usize, timeout: Option<Duration>) -> Result<Box<dyn Any + Send>>;
    fn poll_fetch(&self, exec: u64, output: usize, cx: &mut Context<'_>) -> Poll<Result<Box<dyn Any + Send>>>;
    fn release(&self, exec: u64, output: usize);
    fn describe_output(&self, output: usize) -> String;
}

pub(crate) struct GraphShared<I> {
    pub(crate) id: u64,
    opts: CompileOptions,
    plan: Arc<GraphPlan>,
    chans: Arc<ProcChannels>,
    actors: Vec<HandleCore>,
    output_labels: Vec<String>,
    state: Mutex<DriverState<I>>,
    torn: AtomicBool,
    torn_reason: Mutex<Option<String>>,
    death: Mutex<Option<Error>>,
    done: Mutex<Vec<(String, Receiver<String>)>>,
    dot: String,
    /// Signalled when an async future claims a buffered result (room for the pump).
    room: Condvar,
}

/// A compiled graph: execute it many times, then tear it down (also on drop).
///
/// ```
/// use adag::{CompileOptions, Dag, Placement, Runtime};
///
/// struct Adder { k: u64 }
/// #[adag::actor]
/// impl Adder {
///     fn new(k: u64) -> Self { Adder { k } }
///     fn add(&mut self, x: u64) -> u64 { x + self.k }
/// }
///
/// let rt = Runtime::new().unwrap();
/// let a = rt.spawn::<Adder>(Placement::Thread, 1).unwrap();
/// let b = rt.spawn::<Adder>(Placement::Thread, 10).unwrap();
/// let dag = Dag::<u64>::new();
/// let out = b.add(a.add(dag.input()));
/// let graph = dag.compile(out, CompileOptions::default()).unwrap();
/// assert_eq!(graph.execute(5).unwrap().get().unwrap(), 16);
/// graph.teardown().unwrap();
/// ```
pub struct CompiledGraph<I: Value, O: IntoOutputs> {
    shared: Arc<GraphShared<I>>,
    outputs: O,
    _o: PhantomData<fn() -> O>,
}

fn chan_error(shared_death: Option<Error>, torn_reason: Option<String>, e: ChanError, what: impl FnOnce() -> String, timeout: Duration, hint: &str) -> Error {
    match e {
        ChanError::Closed => shared_death.unwrap_or(Error::TornDown { reason: torn_reason }),
        ChanError::Timeout => Error::Timeout {
            what: what(),
            timeout,
            hint: hint.to_string(),
        },
        ChanError::TooLarge { size, limit } => Error::MessageTooLarge { edge: what(), size, limit },
        ChanError::Codec(message) => Error::Codec {
            op: "decode",
            ty: "value".into(),
            place: what(),
            message,
        },
    }
}

impl<I: Value> crate::dag::Dag<I> {
    /// Compile the graph that computes `outputs` (a node, a tuple of nodes or a `Vec` of
    /// nodes). Validates the graph, plans one channel per edge, installs every actor's
    /// schedule and returns the graph ready to execute.
    pub fn compile<O: IntoOutputs>(&self, outputs: O, opts: CompileOptions) -> Result<CompiledGraph<I, O>> {
        let specs = outputs.output_specs();
        let nodes: Vec<_> = specs.iter().map(|s| s.node.inner.clone()).collect();
        let graph = crate::dag::next_graph_id();
        let planned = crate::compile::plan(&self.inner, &nodes, opts.max_inflight_executions, graph)?;
        let actors = planned.actors.clone();
        match start(planned, specs, opts) {
            Ok(shared) => Ok(CompiledGraph {
                shared,
                outputs,
                _o: PhantomData,
            }),
            Err(e) => {
                release_actors(&actors, graph);
                Err(e)
            }
        }
    }
}

fn start<I: Value>(planned: Planned, specs: Vec<OutputSpec>, opts: CompileOptions) -> Result<Arc<GraphShared<I>>> {
    let Planned { plan, nodes, actors } = planned;
    let plan = Arc::new(plan);
    let mut shm = HashMap::new();
    for edge in plan.edges.values() {
        if let Some(s) = &edge.shm {
            let cfg = ShmConfig {
                depth: plan.depth as u32,
                readers: s.readers.len() as u32,
                slot_bytes: opts.buffer_size_bytes,
                max_message_bytes: opts.max_message_bytes,
                spin: opts.spin,
            };
            let ch = ShmChannel::create(&cfg, &format!("adag-g{}-e{}", plan.graph, edge.id))
                .map_err(|e| Error::io(format!("creating the shared-memory channel of {}", edge.label), e))?;
            shm.insert(s.chan, ch);
        }
    }
    let chans = Arc::new(ProcChannels::new(shm));
    let io = DriverIo { chans: chans.clone() };
    // Actors first: they take their ends of the channels.
    let mut done = Vec::new();
    let mut installing = Vec::new();
    for actor in &actors {
        let (installed, installed_rx) = crossbeam_channel::bounded(1);
        let (done_tx, done_rx) = crossbeam_channel::bounded(1);
        match &actor.0.link {
            ActorLink::Thread(link) => {
                link.control
                    .send(Control::Run(RunRequest {
                        plan: plan.clone(),
                        chans: chans.clone(),
                        installed,
                        done: done_tx,
                    }))
                    .map_err(|_| Error::compile(actor.name(), "the actor's thread has stopped"))?;
            }
            ActorLink::Process(link) => {
                link.install(actor.id(), plan.clone(), &chans, installed, done_tx)?;
            }
        }
        done.push((actor.name().to_string(), done_rx));
        installing.push((actor.name().to_string(), installed_rx));
    }
    let fail = |e: Error| {
        chans.close_all();
        e
    };
    let install_deadline = Instant::now() + Duration::from_secs(30);
    for (name, rx) in &installing {
        match rx.recv_deadline(install_deadline) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(fail(Error::compile(name.clone(), format!("installing the schedule failed: {e}")))),
            Err(_) => return Err(fail(Error::compile(name.clone(), "the actor did not install its schedule within 30 s"))),
        }
    }
    let mut feeders = Vec::new();
    for edge in &plan.inputs {
        let node = &nodes[edge];
        let feed = node
            .feed
            .as_ref()
            .and_then(|f| f.downcast_ref::<Arc<dyn InputFeed<I>>>())
            .ok_or_else(|| fail(Error::compile(node.describe(), "input node of another input type")))?;
        feeders.push(feed.feeder(&io, &plan, *edge).map_err(&fail)?);
    }
    let mut edges: Vec<OutputEdge> = Vec::new();
    let mut seen: HashMap<u64, usize> = HashMap::new();
    for (i, spec) in specs.iter().enumerate() {
        let edge = spec.node.inner.id;
        if let Some(&k) = seen.get(&edge) {
            edges[k].outputs.push(i);
        } else {
            seen.insert(edge, edges.len());
            edges.push(OutputEdge {
                reader: (spec.make)(&io, &plan, edge).map_err(&fail)?,
                outputs: vec![i],
            });
        }
    }
    let output_labels = specs.iter().map(|s| s.node.describe()).collect();
    let dot = viz::dot(&plan, &nodes);
    let shared = Arc::new(GraphShared {
        id: plan.graph,
        state: Mutex::new(DriverState {
            feeders,
            edges,
            next_exec: 0,
            next_read: 0,
            partial: Vec::new(),
            partial_edges: 0,
            buffer: BTreeMap::new(),
            dropped: HashSet::new(),
            wakers: HashMap::new(),
            submitted: None,
        }),
        opts,
        plan,
        chans,
        actors,
        output_labels,
        torn: AtomicBool::new(false),
        torn_reason: Mutex::new(None),
        death: Mutex::new(None),
        done: Mutex::new(done),
        dot,
        room: Condvar::new(),
    });
    if shared.opts.enable_asyncio {
        pump::start(&shared).map_err(|e| {
            let _ = shared.teardown_with(Some("the async result pump could not start".into()));
            e
        })?;
    }
    let sink: Arc<dyn DeathSink> = shared.clone();
    crate::actor::worker::graphs().lock().insert(shared.id, Arc::downgrade(&sink));
    // A worker that died while the graph was being installed.
    for actor in &shared.actors {
        if let ActorLink::Process(link) = &actor.0.link
            && link.is_dead()
        {
            shared.actor_died(actor.name(), "it died while the graph was compiled");
        }
    }
    Ok(shared)
}

impl<I: Value> DeathSink for GraphShared<I> {
    fn actor_died(&self, actor: &str, reason: &str) {
        self.record_death(Error::ActorDied {
            actor: actor.to_string(),
            reason: reason.to_string(),
        });
        let _ = self.teardown_with(Some(format!("actor {actor} died: {reason}")));
    }
}

impl<I: Value> GraphShared<I> {
    fn closed_error(&self) -> Error {
        if let Some(d) = self.death.lock().clone() {
            return d;
        }
        Error::TornDown {
            reason: self.torn_reason.lock().clone(),
        }
    }

    fn map_chan(&self, e: ChanError, what: impl FnOnce() -> String, timeout: Duration, hint: &str) -> Error {
        chan_error(self.death.lock().clone(), self.torn_reason.lock().clone(), e, what, timeout, hint)
    }

    fn check_live(&self) -> Result<()> {
        if self.torn.load(Ordering::Acquire) {
            Err(self.closed_error())
        } else {
            Ok(())
        }
    }

    /// Read the outputs of execution `next_read`, keeping what is read across timeouts.
    fn read_next(&self, st: &mut DriverState<I>, deadline: Option<Instant>, timeout: Duration) -> Result<Vec<Option<Box<dyn Any + Send>>>> {
        let n_outputs = self.output_labels.len();
        if st.partial.is_empty() {
            st.partial = (0..n_outputs).map(|_| None).collect();
            st.partial_edges = 0;
        }
        let exec = st.next_read;
        while st.partial_edges < st.edges.len() {
            let edge = &mut st.edges[st.partial_edges];
            let copies = edge.outputs.len();
            let values = edge.reader.read(copies, deadline).map_err(|e| {
                let label = self.output_labels[edge.outputs[0]].clone();
                self.map_chan(
                    e,
                    || format!("the result of execution {exec} ({label})"),
                    timeout,
                    "raise the timeout (get_timeout, CompileOptions::get_timeout) if the execution is expected to take that long; otherwise it may be hanging",
                )
            })?;
            for (out, v) in edge.outputs.clone().into_iter().zip(values) {
                st.partial[out] = Some(v);
            }
            st.partial_edges += 1;
        }
        st.next_read += 1;
        st.partial_edges = 0;
        let mut results = std::mem::take(&mut st.partial);
        for (out, r) in results.iter_mut().enumerate() {
            if st.dropped.remove(&(exec, out)) {
                *r = None;
            }
        }
        Ok(results)
    }

    fn all_dropped(st: &DriverState<I>, exec: u64, n: usize) -> bool {
        (0..n).all(|o| st.dropped.contains(&(exec, o)))
    }

    fn execute(self: &Arc<Self>, input: &I) -> Result<ExecToken> {
        self.check_live()?;
        let mut st = self.state.lock();
        self.check_live()?;
        let limit = self.opts.max_inflight_executions;
        let deadline = deadline_after(self.opts.submit_timeout);
        let n = self.output_labels.len();
        // Results whose refs were all dropped free their slot here (the async pump does it
        // by itself).
        while !self.opts.enable_asyncio
            && st.next_exec - st.next_read >= limit as u64
            && Self::all_dropped(&st, st.next_read, n)
        {
            self.read_next(&mut st, deadline, self.opts.submit_timeout)?;
        }
        if st.next_exec - st.next_read >= limit as u64 {
            return Err(Error::CapacityExceeded {
                capacity: Capacity::InflightExecutions,
                limit,
            });
        }
        let exec = st.next_exec;
        let mut result = Ok(());
        let mut written = 0;
        for feeder in st.feeders.iter_mut() {
            if let Err(e) = feeder.feed(input, deadline) {
                result = Err(e);
                break;
            }
            written += 1;
        }
        if let Err(e) = result {
            let label = || format!("room in the input channels of execution {exec}");
            let err = self.map_chan(e, label, self.opts.submit_timeout, "raise CompileOptions::submit_timeout, or get results to make room");
            if written > 0 {
                // Part of this input went out: the channels are no longer in step.
                drop(st);
                let _ = self.teardown_with(Some(format!("execution {exec} was only partly submitted: {err}")));
            }
            return Err(err);
        }
        st.next_exec += 1;
        if let Some(tx) = &st.submitted {
            let _ = tx.send(());
        }
        Ok(ExecToken::new(self.clone() as Arc<dyn RefOwner>, exec))
    }

    pub(crate) fn record_death(&self, error: Error) {
        let mut d = self.death.lock();
        if d.is_none() {
            *d = Some(error);
        }
    }

    /// Stop the graph: close every channel (waking every waiter), stop every actor loop,
    /// release the actors. Idempotent.
    pub(crate) fn teardown_with(&self, reason: Option<String>) -> Result<()> {
        if self.torn.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        *self.torn_reason.lock() = reason;
        self.chans.close_all();
        {
            let mut st = self.state.lock();
            st.feeders.clear();
            st.edges.clear();
            st.buffer.clear();
            st.partial.clear();
            st.submitted = None;
            for (_, w) in st.wakers.drain() {
                w.wake();
            }
        }
        self.room.notify_all();
        let deadline = Instant::now() + self.opts.teardown_timeout;
        let mut stuck = Vec::new();
        for (name, rx) in self.done.lock().drain(..) {
            // A disconnected channel means the actor's process is gone: nothing to wait for.
            if let Err(crossbeam_channel::RecvTimeoutError::Timeout) = rx.recv_deadline(deadline) {
                stuck.push(name);
            }
        }
        for actor in &self.actors {
            if let ActorLink::Process(link) = &actor.0.link
                && stuck.iter().any(|s| s == actor.name())
            {
                let _ = link.kill();
            }
        }
        release_actors(&self.actors, self.id);
        crate::actor::worker::graphs().lock().remove(&self.id);
        if stuck.is_empty() {
            Ok(())
        } else {
            Err(Error::Timeout {
                what: format!("actors {} to stop their loops at teardown", stuck.join(", ")),
                timeout: self.opts.teardown_timeout,
                hint: "a method is still running; worker processes were killed, thread actors finish it in the background".into(),
            })
        }
    }
}

impl<I: Value> RefOwner for GraphShared<I> {
    fn fetch(&self, exec: u64, output: usize, timeout: Option<Duration>) -> Result<Box<dyn Any + Send>> {
        if self.opts.enable_asyncio {
            return Err(Error::WrongMode {
                message: "this graph was compiled with enable_asyncio; await the ref instead of calling get".into(),
            });
        }
        let mut st = self.state.lock();
        if let Some(entry) = st.buffer.get_mut(&exec) {
            if let Some(v) = entry[output].take() {
                if entry.iter().all(Option::is_none) {
                    st.buffer.remove(&exec);
                }
                return Ok(v);
            }
        }
        self.check_live()?;
        if exec < st.next_read {
            return Err(Error::AlreadyClaimed { execution: exec, output });
        }
        let timeout = timeout.unwrap_or(self.opts.get_timeout);
        let deadline = deadline_after(timeout);
        let n = self.output_labels.len();
        loop {
            let e = st.next_read;
            let buffering = e != exec && !Self::all_dropped(&st, e, n);
            if buffering && st.partial.is_empty() && st.buffer.len() >= self.opts.max_buffered_results {
                return Err(Error::CapacityExceeded {
                    capacity: Capacity::BufferedResults,
                    limit: self.opts.max_buffered_results,
                });
            }
            let mut results = self.read_next(&mut st, deadline, timeout)?;
            if e == exec {
                let value = results[output].take();
                if results.iter().any(Option::is_some) {
                    st.buffer.insert(e, results);
                }
                return value.ok_or(Error::AlreadyClaimed { execution: exec, output });
            }
            if results.iter().any(Option::is_some) {
                st.buffer.insert(e, results);
            }
        }
    }

    fn poll_fetch(&self, exec: u64, output: usize, cx: &mut Context<'_>) -> Poll<Result<Box<dyn Any + Send>>> {
        if !self.opts.enable_asyncio {
            return Poll::Ready(Err(Error::WrongMode {
                message: "this graph was compiled without enable_asyncio; call get() instead of awaiting".into(),
            }));
        }
        let mut st = self.state.lock();
        if let Some(entry) = st.buffer.get_mut(&exec)
            && let Some(v) = entry[output].take()
        {
            if entry.iter().all(Option::is_none) {
                st.buffer.remove(&exec);
            }
            st.wakers.remove(&(exec, output));
            drop(st);
            self.room.notify_all();
            return Poll::Ready(Ok(v));
        }
        if let Err(e) = self.check_live() {
            return Poll::Ready(Err(e));
        }
        if exec < st.next_read {
            return Poll::Ready(Err(Error::AlreadyClaimed { execution: exec, output }));
        }
        st.wakers.insert((exec, output), cx.waker().clone());
        Poll::Pending
    }

    fn release(&self, exec: u64, output: usize) {
        let mut st = self.state.lock();
        st.wakers.remove(&(exec, output));
        if exec < st.next_read {
            if let Some(entry) = st.buffer.get_mut(&exec) {
                entry[output] = None;
                if entry.iter().all(Option::is_none) {
                    st.buffer.remove(&exec);
                }
            }
        } else {
            st.dropped.insert((exec, output));
        }
        drop(st);
        self.room.notify_all();
    }

    fn describe_output(&self, output: usize) -> String {
        self.output_labels[output].clone()
    }
}

impl<I: Value, O: IntoOutputs> CompiledGraph<I, O> {
    /// Submit one execution. Never blocks for longer than `submit_timeout`; with
    /// `max_inflight_executions` results unread it fails at once with
    /// [`Error::CapacityExceeded`].
    pub fn execute(&self, input: I) -> Result<O::Refs> {
        if self.shared.opts.enable_asyncio {
            return Err(Error::WrongMode {
                message: "this graph was compiled with enable_asyncio; call execute_async(..).await".into(),
            });
        }
        let token = self.shared.execute(&input)?;
        Ok(self.outputs.make_refs(&token, 0).0)
    }

    /// Submit one execution from async code (graphs compiled with `enable_asyncio`). The
    /// returned refs are awaited: `graph.execute_async(x).await?.await?`. No thread is
    /// blocked per pending execution: one result pump per graph reads the outputs and wakes
    /// the waiting tasks.
    pub async fn execute_async(&self, input: I) -> Result<O::Refs> {
        if !self.shared.opts.enable_asyncio {
            return Err(Error::WrongMode {
                message: "this graph was compiled without enable_asyncio; call execute() or compile with CompileOptions::enable_asyncio(true)".into(),
            });
        }
        let token = self.shared.execute(&input)?;
        Ok(self.outputs.make_refs(&token, 0).0)
    }

    /// Stop the graph and release its actors. Idempotent; also done on drop.
    pub fn teardown(&self) -> Result<()> {
        self.shared.teardown_with(None)
    }

    /// The graph and every actor's schedule as Graphviz DOT.
    pub fn visualize(&self) -> String {
        self.shared.dot.clone()
    }

    /// The graph's id (shown in errors).
    pub fn id(&self) -> u64 {
        self.shared.id
    }

    /// The options it was compiled with.
    pub fn options(&self) -> &CompileOptions {
        &self.shared.opts
    }
}

impl<I: Value, O: IntoOutputs> Drop for CompiledGraph<I, O> {
    fn drop(&mut self) {
        let _ = self.shared.teardown_with(None);
    }
}
