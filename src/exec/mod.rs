//! Execution: the compiled graph, `execute`, refs, the result buffer, capacity accounting,
//! teardown and the death of an actor.
use crate::actor::HandleCore;
use crate::actor::channels::{ChannelSizes, GraphChannels};
use crate::actor::host::{Control, RunRequest};
use crate::actor::link::ActorLink;
use crate::actor::worker::DeathSink;
use crate::buffer::BufferMut;
use crate::channel::{ChanError, FanOut, Reader};
use crate::compile::plan::{GraphPlan, Loc};
use crate::compile::{CompileOptions, Planned, deadline_after};
use crate::error::{Capacity, Error, Result};
use crate::value::Value;
use crossbeam_channel::Receiver;
use hosts::RemoteParts;
use parking_lot::{Condvar, Mutex};
use std::any::Any;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::marker::PhantomData;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

mod comms;
mod gather;
mod hosts;
mod input;
mod output;
mod pipeline;
mod pump;
mod refs;
mod stats;
mod timeline;
mod timer;
pub(crate) mod viz;
mod wait;
use comms::CommSetup;
pub use comms::CommunicatorInfo;
use gather::{Gather, OutputEdge, Results};
use input::Feeder;
pub use input::IndexedInput;
pub use output::IntoOutputs;
#[doc(hidden)]
pub use output::OutputSpec;
pub use pipeline::{AsyncPipeline, AsyncRefSet, Pipeline};
pub use refs::{
    CompiledRef, ExecToken, First, RefFuture, RefSet, get_all, get_all_timeout, wait_first,
    wait_first_async,
};
pub use stats::{ActorStats, EdgeStats, GraphStats};
pub use timeline::{HostClock, OpKind, Timeline, TimelineEvent};

/// The driver's endpoints in its own process.
pub struct DriverIo {
    pub(crate) chans: Arc<GraphChannels>,
}

impl DriverIo {
    pub(crate) fn writer<T: Value>(&self, plan: &GraphPlan, edge: u64) -> Result<FanOut<T>> {
        self.chans
            .writer::<T>(plan, edge, Loc::Driver)
            .map_err(|e| Error::compile(format!("edge {edge}"), e))
    }

    pub(crate) fn reader<T: Value>(&self, plan: &GraphPlan, edge: u64) -> Result<Reader<T>> {
        self.chans
            .reader::<T>(plan, edge, Loc::Driver)
            .map_err(|e| Error::compile(format!("edge {edge}"), e))
    }
}

/// The submitting side: held by `execute` only, never while waiting for results.
struct SubmitState<I> {
    feeders: Vec<Box<dyn Feeder<I>>>,
}

/// Results read but not claimed: short critical sections only.
pub(crate) struct ResultState {
    buffer: BTreeMap<u64, Results>,
    /// Refs dropped before their execution was read.
    dropped: HashSet<(u64, usize)>,
    /// Async mode: futures waiting for a result.
    wakers: HashMap<(u64, usize), Waker>,
    /// Async mode: `execute_async` calls waiting for the pump to free a place.
    room_wakers: Vec<Waker>,
}

/// What refs see of their graph.
pub(crate) trait RefOwner: Send + Sync {
    /// The fast path of `fetch` for the execution to be read next, in a graph of one output:
    /// its message goes straight into `slot` (an `Option<Msg<T>>` of the ref's `T`). `None`
    /// where it does not apply, or another get holds the output channels: call `fetch`.
    fn fetch_next(
        &self,
        exec: u64,
        timeout: Option<Duration>,
        slot: &mut dyn Any,
    ) -> Option<Result<()>>;
    fn fetch(
        &self,
        exec: u64,
        output: usize,
        timeout: Option<Duration>,
    ) -> Result<Box<dyn Any + Send>>;
    fn poll_fetch(
        &self,
        exec: u64,
        output: usize,
        cx: &mut Context<'_>,
    ) -> Poll<Result<Box<dyn Any + Send>>>;
    /// Async mode: `poll_fetch`, but first reads the output channels on the calling thread
    /// for up to `wait` (the channels' own spin) when no other reader holds them: the result
    /// comes without a hop through the pump's thread.
    fn poll_reading(
        &self,
        exec: u64,
        output: usize,
        cx: &mut Context<'_>,
        wait: Duration,
    ) -> Poll<Result<Box<dyn Any + Send>>>;
    fn release(&self, exec: u64, output: usize);
    fn describe_output(&self, output: usize) -> String;
    /// The graph's id and its number of outputs (for a ref's `Debug` and `Display`).
    fn graph(&self) -> (u64, usize);
    /// Returns once the graph's teardown, if one runs, has finished: called before a death is
    /// reported, so that whoever sees `ActorDied` finds the survivors released (a thread actor
    /// still inside a method stays busy until it returns; the wait is at most
    /// `teardown_timeout`).
    fn settle(&self);
    /// Waits until output `output` of execution `exec` can be claimed without waiting (its
    /// result or error is in, or it was claimed already); `Ok(false)` when `timeout` passed.
    fn wait_ready(&self, exec: u64, output: usize, timeout: Option<Duration>) -> Result<bool>;
    /// Async mode: like `wait_ready`, waking `cx` when it may have become ready.
    fn poll_ready(&self, exec: u64, output: usize, cx: &mut Context<'_>) -> Poll<Result<()>>;
}

pub(crate) struct GraphShared<I> {
    pub(crate) id: u64,
    opts: CompileOptions,
    chans: Arc<GraphChannels>,
    actors: Vec<HandleCore>,
    output_labels: Vec<String>,
    /// The input parts in feeder order, as errors name them.
    input_labels: Vec<String>,
    submit: Mutex<SubmitState<I>>,
    reader: Mutex<Gather>,
    results: Mutex<ResultState>,
    next_exec: AtomicU64,
    /// The oldest execution not settled yet (being read, or not yet read).
    next_read: AtomicU64,
    /// The oldest execution with a message still in an output channel (`<= next_read`; less
    /// while leftovers of a failed execution are on their way): capacity counts from here.
    drained: AtomicU64,
    teardown_lock: Mutex<()>,
    torn: AtomicBool,
    torn_reason: Mutex<Option<String>>,
    death: Mutex<Option<Error>>,
    done: Mutex<Vec<(String, Receiver<String>)>>,
    dot: String,
    /// Signalled (with `results`) when a buffered result is claimed or dropped: room for the
    /// async pump.
    room: Condvar,
    /// The communicator groups of the graph, destroyed at teardown.
    comms: CommSetup,
    /// Statistics and the timeline.
    obs: stats::Observers,
    /// Submitters waiting for room (`execute_wait`, `execute_async_wait`).
    submit_waiters: wait::SubmitWaiters,
    /// The graph's parts on other hosts, if it has any.
    remote: Option<RemoteParts>,
    /// Async mode: until when (`clock::mono_ns`) a thread awaiting a result reads the output
    /// channels itself ([`RefOwner::poll_reading`]); the pump stands aside meanwhile, unless
    /// a future or a submission waits on it.
    reading_directly_until: AtomicU64,
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
    /// `shared` as its refs hold it.
    owner: Arc<dyn RefOwner>,
    outputs: O,
    _o: PhantomData<fn() -> O>,
}

impl<I: Value> crate::dag::Dag<I> {
    /// Compile the graph that computes `outputs` (a node, a tuple of nodes or a `Vec` of
    /// nodes). Validates the graph, plans one channel per edge, installs every actor's
    /// schedule and returns the graph ready to execute.
    pub fn compile<O: IntoOutputs>(
        &self,
        outputs: O,
        opts: CompileOptions,
    ) -> Result<CompiledGraph<I, O>> {
        let specs = outputs.output_specs();
        let nodes: Vec<_> = specs.iter().map(|s| s.node.inner.clone()).collect();
        let graph = crate::dag::next_graph_id();
        let planned = crate::compile::plan(&self.inner, &nodes, &opts, graph)?;
        let actors = claim_actors(&planned, graph)?;
        match start(planned, actors.clone(), specs, opts) {
            Ok(shared) => {
                let live: Arc<dyn crate::dag::Liveness> = shared.clone();
                self.inner.record_compiled(graph, Arc::downgrade(&live));
                Ok(CompiledGraph {
                    owner: shared.clone(),
                    shared,
                    outputs,
                    _o: PhantomData,
                })
            }
            Err(e) => {
                release_actors(&actors, graph);
                Err(e)
            }
        }
    }
}

/// Claim every actor of the plan for graph `graph`: an actor serves one live graph at a time.
fn claim_actors(planned: &Planned, graph: u64) -> Result<Vec<HandleCore>> {
    let mut actors: Vec<HandleCore> = Vec::new();
    for actor in &planned.actors {
        let Some(handle) = HandleCore::of(actor) else {
            release_actors(&actors, graph);
            return Err(Error::compile(
                actor.name(),
                "this actor was not spawned by an adag Runtime; spawn it with Runtime::spawn",
            ));
        };
        let mut live = handle.0.live_graph.lock();
        if let Some(other) = *live {
            drop(live);
            release_actors(&actors, graph);
            let node = planned
                .nodes
                .values()
                .find(|n| n.actor().is_some_and(|a| a.same(actor)))
                .map_or_else(|| actor.name().to_string(), |n| n.describe());
            return Err(Error::compile(
                node,
                format!(
                    "actor {} is already part of live compiled graph #{other}; tear that graph down first (an actor serves one compiled graph at a time)",
                    actor.name()
                ),
            ));
        }
        *live = Some(graph);
        drop(live);
        actors.push(handle);
    }
    Ok(actors)
}

/// Free the actors claimed by graph `graph`.
pub(crate) fn release_actors(actors: &[HandleCore], graph: u64) {
    for a in actors {
        let mut live = a.0.live_graph.lock();
        if *live == Some(graph) {
            *live = None;
        }
    }
}

/// How long a get that found a channel from another host closed waits for the report of
/// why (a lost host: up to the heartbeat timeout after the connection broke is not waited
/// for; a closed connection is reported at once).
const REPORT_GRACE: Duration = Duration::from_secs(2);

/// How long after a thread last read the output channels directly the async pump keeps
/// standing aside for the next such read (an await loop's next await comes within
/// microseconds; a pump that took the channels back would make it wait for the pump's hop).
const DIRECT_READING_GRACE: Duration = Duration::from_millis(2);

fn start<I: Value>(
    planned: Planned,
    actors: Vec<HandleCore>,
    specs: Vec<OutputSpec>,
    opts: CompileOptions,
) -> Result<Arc<GraphShared<I>>> {
    let Planned {
        plan, nodes, comm, ..
    } = planned;
    let plan = Arc::new(plan);
    // Communicator groups: made (or taken from the user) before any actor installs.
    let comms = CommSetup::start(comm, plan.graph)?;
    let sizes = ChannelSizes {
        slot_bytes: opts.buffer_size_bytes,
        max_message_bytes: opts.max_message_bytes,
        spin: opts.spin,
    };
    let chans =
        Arc::new(GraphChannels::create(&plan, &sizes, 0).inspect_err(|_| comms.destroy_all())?);
    let io = DriverIo {
        chans: chans.clone(),
    };
    let obs = stats::Observers::new(plan.clone(), &actors, opts.timeline);
    // Other hosts install their parts first (each connects the network channels it writes,
    // then waits for those it reads), while this host does the same.
    let remote = match RemoteParts::start(&plan, &actors, &sizes, obs.timeline, &comms) {
        Ok(r) => r,
        Err(e) => {
            comms.destroy_all();
            chans.close_all();
            return Err(e);
        }
    };
    let fail_early = |e: Error| {
        comms.destroy_all();
        chans.close_all();
        if let Some(r) = &remote {
            r.close(plan.graph);
        }
        e
    };
    if let Some(r) = &remote {
        chans
            .connect_network(
                &plan,
                0,
                r.cluster.data(),
                &r.cluster.data_addrs().into_iter().collect(),
                Instant::now() + crate::actor::remote::INSTALL_TIMEOUT,
            )
            .map_err(&fail_early)?;
    }
    // Actors first: they take their ends of the channels.
    let mut done = Vec::new();
    let mut installing = Vec::new();
    for actor in &actors {
        let (installed, installed_rx) = crossbeam_channel::bounded(1);
        let (done_tx, done_rx) = crossbeam_channel::bounded(1);
        let sent = match &actor.0.link {
            ActorLink::Thread(link) => comms.thread_comms(actor).and_then(|actor_comms| {
                link.control
                    .send(Control::Run(RunRequest {
                        plan: plan.clone(),
                        chans: chans.clone(),
                        comms: actor_comms,
                        installed,
                        done: done_tx,
                        recorder: obs.recorder(actor.id()),
                    }))
                    .map_err(|_| Error::compile(actor.name(), "the actor's thread has stopped"))
            }),
            // Installed by its host's agent (above); told done when its host closed the graph.
            ActorLink::Remote(link) => {
                if let Some(r) = &remote {
                    r.waiting(link.host(), installed, done_tx);
                }
                Ok(())
            }
            ActorLink::Process(link) => comms.tickets(actor).and_then(|tickets| {
                link.install(
                    actor.id(),
                    plan.clone(),
                    &chans,
                    installed,
                    done_tx,
                    tickets,
                    obs.timeline,
                )
            }),
        };
        if let Err(e) = sent {
            // The actors already started wake and stop.
            return Err(fail_early(e));
        }
        done.push((actor.name().to_string(), done_rx));
        installing.push((actor.clone(), installed_rx));
    }
    let install_deadline = Instant::now() + Duration::from_secs(30);
    for (actor, rx) in &installing {
        let name = actor.name();
        match rx.recv_deadline(install_deadline) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                return Err(fail_early(Error::compile(
                    name,
                    format!("installing the schedule failed: {e}"),
                )));
            }
            // The actor's end was dropped: a worker that died (its monitor drops every waiter)
            // is reported as such, not as a slow install.
            Err(crossbeam_channel::RecvTimeoutError::Disconnected) => {
                let died = match &actor.0.link {
                    ActorLink::Process(link) => link.death_within(Duration::from_millis(500)),
                    ActorLink::Remote(link) => link.died(),
                    ActorLink::Thread(_) => None,
                };
                return Err(fail_early(died.unwrap_or_else(|| {
                    Error::compile(name, "the actor stopped before it installed its schedule")
                })));
            }
            Err(crossbeam_channel::RecvTimeoutError::Timeout) => {
                return Err(fail_early(Error::compile(
                    name,
                    "the actor did not install its schedule within 30 s",
                )));
            }
        }
    }
    let mut feeders = Vec::new();
    for edge in &plan.inputs {
        feeders.push(input::feeder::<I>(&nodes[edge], &io, &plan, *edge).map_err(&fail_early)?);
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
                reader: (spec.make)(&io, &plan, edge).map_err(&fail_early)?,
                outputs: vec![i],
                next: 0,
            });
        }
    }
    let output_labels = specs.iter().map(|s| s.node.describe()).collect();
    let input_labels = plan.inputs.iter().map(|e| nodes[e].describe()).collect();
    tracing::debug!(
        graph = plan.graph,
        actors = plan.actors.len(),
        edges = plan.edges.len(),
        channels = plan.edges.values().map(|e| e.channels.len()).sum::<usize>(),
        inputs = plan.inputs.len(),
        outputs = plan.outputs.len(),
        depth = plan.depth,
        comm_groups = comms.groups.len(),
        timeline = obs.timeline,
        schedules = %plan
            .actors
            .iter()
            .map(|a| format!("{}: {} ops", a.name, a.ops.len()))
            .collect::<Vec<_>>()
            .join(", "),
        "compiled graph"
    );
    let mut dot = viz::dot(&plan, &nodes);
    if !comms.groups.is_empty() && dot.ends_with("}\n") {
        dot.truncate(dot.len() - 2);
        dot.push_str(&comms.dot());
        dot.push_str("}\n");
    }
    let shared = Arc::new(GraphShared {
        id: plan.graph,
        submit: Mutex::new(SubmitState { feeders }),
        reader: Mutex::new(Gather::new(edges)),
        results: Mutex::new(ResultState {
            buffer: BTreeMap::new(),
            dropped: HashSet::new(),
            wakers: HashMap::new(),
            room_wakers: Vec::new(),
        }),
        next_exec: AtomicU64::new(0),
        next_read: AtomicU64::new(0),
        drained: AtomicU64::new(0),
        teardown_lock: Mutex::new(()),
        opts,
        chans,
        actors,
        output_labels,
        input_labels,
        torn: AtomicBool::new(false),
        torn_reason: Mutex::new(None),
        death: Mutex::new(None),
        done: Mutex::new(done),
        dot,
        room: Condvar::new(),
        comms,
        obs,
        submit_waiters: wait::SubmitWaiters::new(),
        remote,
        reading_directly_until: AtomicU64::new(0),
    });
    if shared.opts.enable_asyncio {
        pump::start(&shared).inspect_err(|_| {
            let _ = shared.teardown_with(Some("the async result pump could not start".into()));
        })?;
    }
    if let Some(r) = &shared.remote {
        let weak = Arc::downgrade(&shared);
        r.cluster.on_fault(
            shared.id,
            Arc::new(move |actor: &str, why: &str| {
                if let Some(g) = weak.upgrade() {
                    g.schedule_stopped(actor, why);
                }
            }),
        );
    }
    let sink: Arc<dyn DeathSink> = shared.clone();
    crate::actor::worker::graphs()
        .lock()
        .insert(shared.id, Arc::downgrade(&sink));
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
        tracing::warn!(
            graph = self.id,
            actor,
            reason,
            "an actor died: tearing the graph down"
        );
        let death = Error::ActorDied {
            actor: actor.to_string(),
            reason: reason.to_string(),
        };
        let _ = self.teardown_inner(Some(format!("actor {actor} died: {reason}")), Some(death));
    }
}

impl<I: Value> GraphShared<I> {
    /// An actor's schedule stopped on another host before the graph was closed (one of its
    /// connections broke): the graph is over.
    fn schedule_stopped(&self, actor: &str, why: &str) {
        tracing::warn!(
            graph = self.id,
            actor,
            why,
            "a schedule stopped: tearing the graph down"
        );
        let fault = Error::TornDown {
            reason: Some(format!(
                "the schedule of actor {actor} stopped {why}; a connection between hosts broke or a host stalled; compile the graph again"
            )),
        };
        let _ = self.teardown_inner(
            Some(format!("actor {actor}'s schedule stopped")),
            Some(fault),
        );
    }
}

impl<I: Value> crate::dag::Liveness for GraphShared<I> {
    fn is_live(&self) -> bool {
        !self.torn.load(Ordering::Acquire)
    }
}

impl<I: Value> GraphShared<I> {
    /// `e`, once the teardown a death started has released the actors (an explicit teardown
    /// releases them before `teardown()` returns; a get it wakes does not wait for it).
    fn settled(&self, e: Error) -> Error {
        if matches!(e, Error::ActorDied { .. } | Error::TornDown { .. }) {
            self.settle();
        }
        e
    }

    fn closed_error(&self) -> Error {
        if self.remote.is_some() && !self.torn.load(Ordering::Acquire) {
            // A channel from another host closed before this graph was torn down: that host
            // was lost or a schedule there stopped, and the report of it (which tears the
            // graph down, naming the cause) is on its way. Wait for it, bounded.
            let until = Instant::now() + REPORT_GRACE;
            while !self.torn.load(Ordering::Acquire) && Instant::now() < until {
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        if let Some(d) = self.death.lock().clone() {
            return d;
        }
        Error::TornDown {
            reason: self.torn_reason.lock().clone(),
        }
    }

    fn map_chan(
        &self,
        e: ChanError,
        what: impl FnOnce() -> String,
        timeout: Duration,
        hint: &str,
    ) -> Error {
        match e {
            ChanError::Closed => self.closed_error(),
            ChanError::Timeout => Error::Timeout {
                what: what(),
                timeout,
                hint: hint.to_string(),
            },
            ChanError::TooLarge { size, limit } => Error::MessageTooLarge {
                edge: what(),
                size,
                limit,
            },
            ChanError::Codec(message) => Error::Codec {
                op: "decode",
                ty: "value".into(),
                place: what(),
                message,
            },
        }
    }

    /// Refs of a graph compiled without `enable_asyncio` are claimed with `get`, not awaited.
    fn check_awaitable(&self) -> Result<()> {
        if self.opts.enable_asyncio {
            return Ok(());
        }
        Err(Error::WrongMode {
            message:
                "this graph was compiled without enable_asyncio; call get() instead of awaiting"
                    .into(),
        })
    }

    fn check_live(&self) -> Result<()> {
        if self.torn.load(Ordering::Acquire) {
            Err(self.closed_error())
        } else {
            Ok(())
        }
    }

    /// Read the outputs of execution `next_read` as they become ready (see `gather`),
    /// keeping what is read across timeouts. When that execution is `want.0`, returns output
    /// `want.1`; every other result read is buffered unless its ref was dropped.
    fn read_next(
        &self,
        rs: &mut Gather,
        deadline: Option<Instant>,
        timeout: Duration,
        want: Option<(u64, usize)>,
    ) -> Result<Option<Box<dyn Any + Send>>> {
        let exec = self.next_read.load(Ordering::Acquire);
        self.read_exec(rs, exec, deadline, want)
            .map_err(|(edge, e)| self.edge_error(rs, edge, exec, e, timeout))
    }

    /// `read_next` for execution `exec` (`next_read`, loaded by the caller under the
    /// channels' lock), with a channel error as it came: a caller that expects timeouts
    /// (the pump, an await reading for itself) names none it does not report.
    fn read_exec(
        &self,
        rs: &mut Gather,
        exec: u64,
        deadline: Option<Instant>,
        want: Option<(u64, usize)>,
    ) -> std::result::Result<Option<Box<dyn Any + Send>>, (usize, ChanError)> {
        match rs.read(exec, deadline) {
            Ok(results) => Ok(self.store(exec, results, want, rs.drained())),
            Err(err) => {
                // Leftovers drained while waiting: room for the waiting submitters.
                self.drained.store(rs.drained(), Ordering::Release);
                self.submit_waiters.notify();
                Err(err)
            }
        }
    }

    /// The error of reading output edge `edge` for execution `exec`.
    fn edge_error(
        &self,
        rs: &Gather,
        edge: usize,
        exec: u64,
        e: ChanError,
        timeout: Duration,
    ) -> Error {
        let edge = &rs.edges[edge];
        let label = self.output_labels[edge.outputs[0]].clone();
        let behind = edge.next;
        self.map_chan(
            e,
            || {
                if behind < exec {
                    format!(
                        "the result of execution {exec} ({label}), queued behind the unfinished work of failed execution {behind}"
                    )
                } else {
                    format!("the result of execution {exec} ({label})")
                }
            },
            timeout,
            "raise the timeout (get_timeout, CompileOptions::get_timeout) if the execution is expected to take that long; otherwise it may be hanging",
        )
    }

    /// File one execution's results: drop those whose refs are gone, hand `want` back,
    /// buffer the rest and wake their futures.
    fn store(
        &self,
        exec: u64,
        mut results: Results,
        want: Option<(u64, usize)>,
        drained: u64,
    ) -> Option<Box<dyn Any + Send>> {
        let mut r = self.results.lock();
        self.next_read.store(exec + 1, Ordering::Release);
        self.drained.store(drained, Ordering::Release);
        // Hashing costs more than the rest of a small execution's bookkeeping: look in the
        // sets of dropped refs and of wakers only when something is in them.
        if !r.dropped.is_empty() {
            for (out, v) in results.iter_mut().enumerate() {
                if r.dropped.remove(&(exec, out)) {
                    *v = None;
                }
            }
        }
        let wanted = match want {
            Some((e, out)) if e == exec => results[out].take(),
            _ => None,
        };
        let mut wake: Vec<Waker> = if r.wakers.is_empty() {
            Vec::new()
        } else {
            (0..results.len())
                .filter_map(|o| r.wakers.remove(&(exec, o)))
                .collect()
        };
        wake.append(&mut r.room_wakers);
        if results.iter().any(Option::is_some) {
            r.buffer.insert(exec, results);
        }
        drop(r);
        for w in wake {
            w.wake();
        }
        // An execution was read: room for one more.
        self.submit_waiters.notify();
        wanted
    }

    fn take_from(r: &mut ResultState, exec: u64, output: usize) -> Option<Box<dyn Any + Send>> {
        let entry = r.buffer.get_mut(&exec)?;
        let v = entry[output].take()?;
        if entry.iter().all(Option::is_none) {
            r.buffer.remove(&exec);
        }
        Some(v)
    }

    /// Async mode: output `output` of `exec` if it is buffered (taken, its waker dropped),
    /// the graph's error once it stopped, or `AlreadyClaimed` once its execution was read
    /// without it; `None` while it is still to be read (`r`: the results, locked). After a
    /// take, the caller signals `room` once `r` is unlocked.
    fn claim_from(
        &self,
        r: &mut ResultState,
        exec: u64,
        output: usize,
    ) -> Option<Result<Box<dyn Any + Send>>> {
        if let Some(v) = Self::take_from(r, exec, output) {
            r.wakers.remove(&(exec, output));
            return Some(Ok(v));
        }
        if let Err(e) = self.check_live() {
            return Some(Err(e));
        }
        (exec < self.next_read.load(Ordering::Acquire)).then_some(Err(Error::AlreadyClaimed {
            execution: exec,
            output,
        }))
    }

    fn take_buffered(&self, exec: u64, output: usize) -> Option<Box<dyn Any + Send>> {
        let v = Self::take_from(&mut self.results.lock(), exec, output);
        if v.is_some() {
            self.room.notify_all();
        }
        v
    }

    fn all_dropped(&self, exec: u64) -> bool {
        self.dropped_whole(&self.results.lock(), exec)
    }

    /// Whether reading execution `next` on the way to `exec` would overfill the buffer of
    /// unclaimed results (`r`: the results, locked; `rs`: the channels). An execution read
    /// part of the way is finished, and one whose refs were all dropped is discarded, so
    /// neither counts.
    fn reading_on_overfills(&self, r: &ResultState, rs: &Gather, next: u64, exec: u64) -> bool {
        next != exec
            && !rs.reading()
            && !self.dropped_whole(r, next)
            && r.buffer.len() >= self.opts.max_buffered_results
    }

    /// Whether every ref of `exec` was dropped (`r`: the results, locked).
    fn dropped_whole(&self, r: &ResultState, exec: u64) -> bool {
        !r.dropped.is_empty()
            && (0..self.output_labels.len()).all(|o| r.dropped.contains(&(exec, o)))
    }

    /// Executions with a message still in the channels (leftovers of failed ones included).
    fn in_flight(&self) -> u64 {
        let drained = self.drained.load(Ordering::Acquire);
        self.next_exec
            .load(Ordering::Acquire)
            .saturating_sub(drained)
    }

    /// Whether an execution would fit in flight now. An `execute` refused a moment ago may
    /// find room: the pump can have discarded every dropped execution in between.
    fn has_room(&self) -> bool {
        self.in_flight() < self.opts.max_inflight_executions as u64
    }

    /// `execute` waited the whole `submit_timeout` for a place in flight that the results of
    /// dropped refs were to free, and they had not all arrived.
    fn submit_timed_out(&self, limit: usize) -> Error {
        Error::Timeout {
            what: format!(
                "a place for one more execution in flight (max_inflight_executions = {limit}), freed as the results of dropped refs arrive"
            ),
            timeout: self.opts.submit_timeout,
            hint: "raise the submit timeout (CompileOptions::submit_timeout; Ray's _submit_timeout) if executions take that long; otherwise a method may be hanging".into(),
        }
    }

    /// Async mode: whether a place is free, or the pump frees one by itself (without anybody
    /// claiming a result): the oldest execution in flight is a failed one's leftovers, or one
    /// whose refs were all dropped. One look under the results lock, where the pump files
    /// each execution (its `next_read` and `drained` move there together, and its dropped
    /// refs are forgotten): separate looks could each miss what the pump did between them
    /// and refuse a submission that had room (seen under load: 3 runs in 25).
    fn room_or_pump_frees_it(&self) -> bool {
        let r = self.results.lock();
        if self.has_room() {
            return true;
        }
        let next = self.next_read.load(Ordering::Acquire);
        self.drained.load(Ordering::Acquire) < next || self.dropped_whole(&r, next)
    }

    /// Wakes the `execute_async` calls waiting for a place, to look again.
    fn wake_room(&self) {
        let wake = std::mem::take(&mut self.results.lock().room_wakers);
        for w in wake {
            w.wake();
        }
    }

    /// Submits one execution; returns its index.
    fn execute(&self, input: &I) -> Result<u64> {
        self.check_live()?;
        let mut sub = self.submit.lock();
        self.check_live()?;
        let limit = self.opts.max_inflight_executions as u64;
        let deadline = deadline_after(self.opts.submit_timeout);
        // Results whose refs were all dropped free their place here, unless a get is reading
        // (it will discard them itself). The async pump does this by itself.
        // So do the leftovers of a failed execution, once its slow methods finish.
        if !self.opts.enable_asyncio
            && self.in_flight() >= limit
            && let Some(mut rs) = self.reader.try_lock()
        {
            while self.in_flight() >= limit {
                let next = self.next_read.load(Ordering::Acquire);
                if self.drained.load(Ordering::Acquire) < next {
                    let drained = rs.drain(next, deadline);
                    self.drained.store(rs.drained(), Ordering::Release);
                    self.submit_waiters.notify();
                    match drained {
                        Ok(()) => {}
                        Err((_, ChanError::Timeout)) => break,
                        Err((edge, e)) => {
                            return Err(self.edge_error(
                                &rs,
                                edge,
                                next,
                                e,
                                self.opts.submit_timeout,
                            ));
                        }
                    }
                } else if self.all_dropped(next) {
                    // Reading a dropped execution's result is part of this submission: its
                    // timeout is the submit timeout's.
                    self.read_next(&mut rs, deadline, self.opts.submit_timeout, None)
                        .map_err(|e| match e {
                            Error::Timeout { .. } => self.submit_timed_out(limit as usize),
                            e => e,
                        })?;
                } else {
                    break;
                }
            }
        }
        if self.in_flight() >= limit {
            tracing::debug!(
                graph = self.id,
                limit,
                "execute refused: max_inflight_executions results unread"
            );
            return Err(Error::CapacityExceeded {
                capacity: Capacity::InflightExecutions,
                limit: limit as usize,
            });
        }
        let exec = self.next_exec.load(Ordering::Acquire);
        for (feeder, part) in sub.feeders.iter().zip(&self.input_labels) {
            feeder.check(input).map_err(|message| Error::Input {
                part: part.clone(),
                message,
            })?;
        }
        let mut result = Ok(());
        let mut written = 0;
        for feeder in sub.feeders.iter_mut() {
            if let Err(e) = feeder.feed(input, deadline) {
                result = Err((e, feeder.part().to_string(), feeder.type_name()));
                break;
            }
            written += 1;
        }
        if let Err((e, part, ty)) = result {
            let err = match e {
                // The input could not be encoded: say so, naming the part and its type
                // (map_chan reads a codec error as a decode on the way out).
                ChanError::Codec(message) => Error::Codec {
                    op: "encode",
                    ty: ty.to_string(),
                    place: format!("{part} of execution {exec}"),
                    message,
                },
                ChanError::TooLarge { size, limit } => Error::MessageTooLarge {
                    edge: part,
                    size,
                    limit,
                },
                e => self.map_chan(
                    e,
                    || format!("room in the channel of {part} (execution {exec})"),
                    self.opts.submit_timeout,
                    "raise CompileOptions::submit_timeout, or get results to make room",
                ),
            };
            if written > 0 {
                // Part of this input went out: the channels are no longer in step.
                drop(sub);
                let _ = self.teardown_with(Some(format!(
                    "execution {exec} was only partly submitted: {err}"
                )));
            }
            return Err(err);
        }
        self.next_exec.store(exec + 1, Ordering::Release);
        tracing::trace!(graph = self.id, exec, "submitted");
        Ok(exec)
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
        self.teardown_inner(reason, None)
    }

    /// Teardown, recording `death` first when an actor's death started it. The death is
    /// recorded under the teardown lock, so that whoever sees it and then waits for that lock
    /// ([`RefOwner::settle`]) finds the actors released.
    fn teardown_inner(&self, reason: Option<String>, death: Option<Error>) -> Result<()> {
        // A second caller waits for the first to finish, so that once teardown returns the
        // actors are released whoever started it.
        let _one_at_a_time = self.teardown_lock.lock();
        if let Some(death) = death {
            self.record_death(death);
        }
        if self.torn.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        tracing::debug!(
            graph = self.id,
            reason = reason.as_deref().unwrap_or("asked"),
            "tearing down"
        );
        *self.torn_reason.lock() = reason;
        // Closing first wakes any get blocked on a channel, so the locks below come free.
        self.chans.close_all();
        // Other hosts close their parts (their actors there are told done when they did).
        if let Some(r) = &self.remote {
            r.cluster.forget_graph(self.id);
            r.close(self.id);
        }
        // Destroying the communicator groups wakes every actor blocked in one.
        self.comms.destroy_all();
        {
            let mut sub = self.submit.lock();
            sub.feeders.clear();
        }
        self.reader.lock().clear();
        let wakers: Vec<Waker> = {
            let mut r = self.results.lock();
            r.buffer.clear();
            let mut w: Vec<Waker> = r.wakers.drain().map(|(_, w)| w).collect();
            w.append(&mut r.room_wakers);
            w
        };
        for w in wakers {
            w.wake();
        }
        self.room.notify_all();
        self.submit_waiters.notify();
        let deadline = Instant::now() + self.opts.teardown_timeout;
        let mut stuck = Vec::new();
        let mut stuck_done = Vec::new();
        for (name, rx) in self.done.lock().drain(..) {
            // A disconnected channel means the actor's process is gone: nothing to wait for.
            if let Err(crossbeam_channel::RecvTimeoutError::Timeout) = rx.recv_deadline(deadline) {
                stuck.push(name.clone());
                stuck_done.push((name, rx));
            }
        }
        let mut still_busy = Vec::new();
        for actor in &self.actors {
            if !stuck.iter().any(|s| s == actor.name()) {
                continue;
            }
            match &actor.0.link {
                ActorLink::Process(link) => {
                    let _ = link.kill();
                }
                ActorLink::Remote(link) => {
                    let _ = link.kill();
                }
                ActorLink::Thread(_) => still_busy.push(actor.clone()),
            }
        }
        let free: Vec<HandleCore> = self
            .actors
            .iter()
            .filter(|a| !still_busy.iter().any(|b| b.same(a)))
            .cloned()
            .collect();
        release_actors(&free, self.id);
        // A thread actor still inside a method cannot be stopped: it stays busy (one-off calls
        // and new graphs get `ActorBusy` instead of queueing for ever behind the method) until
        // its loop ends, and is released then.
        for actor in still_busy {
            let Some(at) = stuck_done.iter().position(|(name, _)| name == actor.name()) else {
                release_actors(std::slice::from_ref(&actor), self.id);
                continue;
            };
            let (_, done) = stuck_done.swap_remove(at);
            let graph = self.id;
            let waiter = actor.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("adag-release-{}", actor.name()))
                .spawn(move || {
                    let _ = done.recv();
                    release_actors(std::slice::from_ref(&waiter), graph);
                });
            if spawned.is_err() {
                release_actors(std::slice::from_ref(&actor), self.id);
            }
        }
        crate::actor::worker::graphs().lock().remove(&self.id);
        // Workers keep their counters and timeline after their loop stopped: fetch them now,
        // while the graph's actors are known to be idle (killed ones are skipped).
        let idle: Vec<HandleCore> = self
            .actors
            .iter()
            .filter(|a| !stuck.iter().any(|s| s == a.name()))
            .cloned()
            .collect();
        self.obs.collect_final(&idle);
        if stuck.is_empty() {
            Ok(())
        } else {
            Err(Error::Timeout {
                what: format!("actors {} to stop their loops at teardown", stuck.join(", ")),
                timeout: self.opts.teardown_timeout,
                hint: "a method is still running; worker processes were killed, thread actors finish it in the background and stay busy until then".into(),
            })
        }
    }
}

impl<I: Value> GraphShared<I> {
    /// Async mode: reads executions in order on the calling thread, up to `wait`, until
    /// output `output` of `exec` is in. `None` when it is not in by then, or another thread
    /// holds the channels (the pump, blocked on them: it delivers the result), or reading on
    /// would overfill the buffer of unclaimed results (the pump waits for room instead).
    /// While such reads come, the pump stands aside ([`Self::pump_stands_aside`]), so that
    /// the channels are free for the next one.
    fn read_directly(
        &self,
        exec: u64,
        output: usize,
        wait: Duration,
    ) -> Option<Result<Box<dyn Any + Send>>> {
        self.reading_directly_until.store(
            crate::clock::mono_ns() + DIRECT_READING_GRACE.as_nanos() as u64,
            Ordering::Release,
        );
        let mut rs = self.reader.try_lock()?;
        let deadline = if wait.is_zero() {
            crate::channel::passed()
        } else {
            Instant::now() + wait
        };
        loop {
            let mut r = self.results.lock();
            if let Some(done) = self.claim_from(&mut r, exec, output) {
                drop(r);
                if done.is_ok() {
                    self.room.notify_all();
                }
                return Some(done);
            }
            // The channels are locked: nobody else moves it on.
            let next = self.next_read.load(Ordering::Acquire);
            if self.reading_on_overfills(&r, &rs, next, exec) {
                return None;
            }
            drop(r);
            match self.read_exec(&mut rs, next, Some(deadline), Some((exec, output))) {
                // `store` took its waker out, if it had one.
                Ok(Some(v)) => return Some(Ok(v)),
                Ok(None) => {}
                // Not in yet: no error to name (the caller waits on, through the pump).
                Err((_, ChanError::Timeout)) => return None,
                Err((edge, e)) => return Some(Err(self.edge_error(&rs, edge, next, e, wait))),
            }
        }
    }

    /// Whether the pump leaves the output channels to threads reading them directly: one
    /// did within [`DIRECT_READING_GRACE`], and no future or submission waits on the pump
    /// (`r`: the results, locked).
    fn pump_stands_aside(&self, r: &ResultState) -> Option<Duration> {
        let until = self.reading_directly_until.load(Ordering::Acquire);
        let now = crate::clock::mono_ns();
        (until > now && r.wakers.is_empty() && r.room_wakers.is_empty())
            .then(|| Duration::from_nanos(until - now))
    }

    fn is_buffered(&self, exec: u64, output: usize) -> bool {
        self.results
            .lock()
            .buffer
            .get(&exec)
            .is_some_and(|r| r[output].is_some())
    }

    /// Reads executions until output `output` of `exec` is in (or its execution failed).
    /// With `claim`, takes the result and returns it; without, leaves it buffered and returns
    /// `None` (also when it was claimed already: claiming it answers at once).
    fn read_until(
        &self,
        exec: u64,
        output: usize,
        timeout: Option<Duration>,
        claim: bool,
    ) -> Result<Option<Box<dyn Any + Send>>> {
        if self.opts.enable_asyncio {
            return Err(Error::WrongMode {
                message: "this graph was compiled with enable_asyncio; await the ref instead of calling get".into(),
            });
        }
        let ready = || {
            if claim {
                self.take_buffered(exec, output).map(Some)
            } else {
                self.is_buffered(exec, output).then_some(None)
            }
        };
        if let Some(v) = ready() {
            return Ok(v);
        }
        self.check_live()?;
        let timeout = timeout.unwrap_or(self.opts.get_timeout);
        let deadline = deadline_after(timeout);
        let mut rs = match deadline {
            None => self.reader.lock(),
            Some(d) => self
                .reader
                .try_lock_until(d)
                .ok_or_else(|| Error::Timeout {
                    what: format!("another get reading the results before execution {exec}"),
                    timeout,
                    hint: "raise the timeout; an earlier execution is slow".into(),
                })?,
        };
        loop {
            // Another get may have read this execution while this one waited for the lock.
            if let Some(v) = ready() {
                return Ok(v);
            }
            self.check_live()?;
            let next = self.next_read.load(Ordering::Acquire);
            if exec < next {
                if !claim {
                    return Ok(None);
                }
                return Err(Error::AlreadyClaimed {
                    execution: exec,
                    output,
                });
            }
            if self.reading_on_overfills(&self.results.lock(), &rs, next, exec) {
                tracing::debug!(
                    graph = self.id,
                    limit = self.opts.max_buffered_results,
                    "get refused: max_buffered_results results unclaimed"
                );
                return Err(Error::CapacityExceeded {
                    capacity: Capacity::BufferedResults,
                    limit: self.opts.max_buffered_results,
                });
            }
            let want = claim.then_some((exec, output));
            if let Some(v) = self.read_next(&mut rs, deadline, timeout, want)? {
                return Ok(Some(v));
            }
        }
    }
}

impl<I: Value> RefOwner for GraphShared<I> {
    fn fetch_next(
        &self,
        exec: u64,
        timeout: Option<Duration>,
        slot: &mut dyn Any,
    ) -> Option<Result<()>> {
        // Execution `exec` is the next to read, so its result is not buffered and no other
        // output of it waits; `next_read` moves only under the reader's lock, so it is still
        // the next one once that lock is held.
        if self.opts.enable_asyncio || self.next_read.load(Ordering::Acquire) != exec {
            return None;
        }
        let mut rs = self.reader.try_lock()?;
        if self.next_read.load(Ordering::Acquire) != exec || self.torn.load(Ordering::Acquire) {
            return None;
        }
        let timeout = timeout.unwrap_or(self.opts.get_timeout);
        let read = rs.read_alone(exec, slot, deadline_after(timeout))?;
        Some(match read {
            Ok(()) => {
                // Nothing to file: the one result goes to the ref that asked, no future
                // waits in a graph without asyncio, and the ref was not dropped. So the
                // results' lock is not taken; `release` of a later execution's ref files it
                // as dropped either way.
                self.next_read.store(exec + 1, Ordering::Release);
                self.drained.store(rs.drained(), Ordering::Release);
                drop(rs);
                // An execution was read: room for one more.
                self.submit_waiters.notify();
                Ok(())
            }
            Err(e) => Err(self.edge_error(&rs, 0, exec, e, timeout)),
        })
    }

    fn fetch(
        &self,
        exec: u64,
        output: usize,
        timeout: Option<Duration>,
    ) -> Result<Box<dyn Any + Send>> {
        self.read_until(exec, output, timeout, true)?
            .ok_or(Error::AlreadyClaimed {
                execution: exec,
                output,
            })
    }

    fn graph(&self) -> (u64, usize) {
        (self.id, self.output_labels.len())
    }

    fn settle(&self) {
        // Only a teardown that a death or a fault started: a get woken by an explicit
        // teardown must not wait for it (it may wait for a slow method).
        if self.death.lock().is_some() {
            drop(self.teardown_lock.lock());
        }
    }

    fn wait_ready(&self, exec: u64, output: usize, timeout: Option<Duration>) -> Result<bool> {
        match self.read_until(exec, output, timeout, false) {
            Ok(_) => Ok(true),
            Err(Error::Timeout { .. }) => Ok(false),
            Err(e) => Err(e),
        }
    }

    fn poll_ready(&self, exec: u64, output: usize, cx: &mut Context<'_>) -> Poll<Result<()>> {
        if let Err(e) = self.check_awaitable() {
            return Poll::Ready(Err(e));
        }
        let mut r = self.results.lock();
        if r.buffer.get(&exec).is_some_and(|v| v[output].is_some()) {
            return Poll::Ready(Ok(()));
        }
        if let Err(e) = self.check_live() {
            return Poll::Ready(Err(e));
        }
        if exec < self.next_read.load(Ordering::Acquire) {
            return Poll::Ready(Ok(()));
        }
        r.wakers.insert((exec, output), cx.waker().clone());
        Poll::Pending
    }

    fn poll_fetch(
        &self,
        exec: u64,
        output: usize,
        cx: &mut Context<'_>,
    ) -> Poll<Result<Box<dyn Any + Send>>> {
        if let Err(e) = self.check_awaitable() {
            return Poll::Ready(Err(e));
        }
        let mut r = self.results.lock();
        if let Some(done) = self.claim_from(&mut r, exec, output) {
            drop(r);
            if done.is_ok() {
                self.room.notify_all();
            }
            return Poll::Ready(done);
        }
        r.wakers.insert((exec, output), cx.waker().clone());
        Poll::Pending
    }

    fn poll_reading(
        &self,
        exec: u64,
        output: usize,
        cx: &mut Context<'_>,
        wait: Duration,
    ) -> Poll<Result<Box<dyn Any + Send>>> {
        if let Err(e) = self.check_awaitable() {
            return Poll::Ready(Err(e));
        }
        match self.read_directly(exec, output, wait) {
            Some(done) => Poll::Ready(done),
            None => {
                let pending = self.poll_fetch(exec, output, cx);
                // The pump may stand aside for readers like this one: it reads for the
                // waker just filed.
                self.room.notify_all();
                pending
            }
        }
    }

    fn release(&self, exec: u64, output: usize) {
        let mut r = self.results.lock();
        r.wakers.remove(&(exec, output));
        if exec < self.next_read.load(Ordering::Acquire) {
            Self::take_from(&mut r, exec, output);
        } else {
            r.dropped.insert((exec, output));
        }
        drop(r);
        self.room.notify_all();
        // A dropped ref lets `execute` discard its unread execution.
        self.submit_waiters.notify();
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
                message:
                    "this graph was compiled with enable_asyncio; call execute_async(..).await"
                        .into(),
            });
        }
        let exec = self
            .shared
            .execute(&input)
            .map_err(|e| self.shared.settled(e))?;
        Ok(self.refs(exec))
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
        // At capacity because of executions whose refs were all dropped (or the leftovers of
        // a failed one), wait (up to submit_timeout) for the pump to discard them, as a sync
        // `execute` reads them itself: dropping futures frees their places deterministically.
        let deadline = deadline_after(self.shared.opts.submit_timeout);
        let exec = loop {
            match self.shared.execute(&input) {
                Err(Error::CapacityExceeded {
                    capacity: Capacity::InflightExecutions,
                    limit,
                }) if self.shared.room_or_pump_frees_it() => {
                    if deadline.is_some_and(|d| Instant::now() >= d) {
                        return Err(self.shared.submit_timed_out(limit));
                    }
                    RoomWait {
                        shared: &self.shared,
                        deadline,
                    }
                    .await;
                }
                r => break r.map_err(|e| self.shared.settled(e))?,
            }
        };
        Ok(self.refs(exec))
    }

    /// The refs of execution `exec`'s outputs.
    fn refs(&self, exec: u64) -> O::Refs {
        self.outputs
            .make_refs(&ExecToken::new(&self.owner, exec), 0)
            .0
    }

    /// Stop the graph and release its actors. Idempotent; also done on drop.
    pub fn teardown(&self) -> Result<()> {
        self.shared.teardown_with(None)
    }

    /// The graph and every actor's schedule as Graphviz DOT.
    pub fn visualize(&self) -> String {
        self.shared.dot.clone()
    }

    /// The communicator groups of the graph (made by `DefaultCommunicator::Create` or the
    /// user's own), in the order the compiler chose them, with the nodes that use each.
    pub fn communicators(&self) -> Vec<CommunicatorInfo> {
        self.shared.comms.infos()
    }

    /// The graph's id (shown in errors).
    pub fn id(&self) -> u64 {
        self.shared.id
    }

    /// The options it was compiled with.
    pub fn options(&self) -> &CompileOptions {
        &self.shared.opts
    }

    /// `len` bytes to build a [`Buffer`](crate::Buffer) in place and send it as this graph's
    /// input, or a part of it, without copying it: the memory is lent by the shared-memory
    /// channel of the first input edge read by another process, and that channel writes the
    /// frozen buffer by reference (its readers read it in place). Written to any other
    /// channel, the buffer is copied like any other. Where no input channel crosses a process,
    /// or none has memory free without waiting (values kept by readers pin it all), or the
    /// graph was torn down, the bytes are on the heap ([`BufferMut::is_loaned`] says which).
    ///
    /// The bytes of lent memory are not cleared: they may hold an earlier message's, so fill
    /// all of them. The memory goes back to the channel once the buffer and every value made
    /// from it (the readers' included) are dropped. Waits for an `execute` of another thread
    /// that is in progress. A tensor is built in lent memory the same way: fill the bytes,
    /// then [`Tensor::from_bytes`](crate::Tensor::from_bytes) takes the frozen buffer's
    /// [`into_bytes`](crate::Buffer::into_bytes) without a copy (lent memory is 64-byte
    /// aligned).
    ///
    /// # Example
    ///
    /// ```
    /// use adag::{Buffer, CompileOptions, Dag, Placement, Runtime};
    ///
    /// struct Checksum;
    ///
    /// #[adag::actor]
    /// impl Checksum {
    ///     pub fn new() -> Self {
    ///         Checksum
    ///     }
    ///     pub fn sum(&mut self, data: Buffer) -> u64 {
    ///         data.iter().map(|&b| u64::from(b)).sum()
    ///     }
    /// }
    ///
    /// # fn main() -> adag::Result<()> {
    /// let rt = Runtime::new()?;
    /// let actor = rt.spawn::<Checksum>(Placement::Process, ())?;
    /// let dag = Dag::<Buffer>::new();
    /// let graph = dag.compile(actor.sum(dag.input()), CompileOptions::default())?;
    /// let mut data = graph.input_buffer(1 << 20);
    /// assert!(data.is_loaned());
    /// data.fill(1); // built straight in the channel's shared memory
    /// assert_eq!(graph.execute(data.freeze())?.get()?, 1 << 20);
    /// # Ok(())
    /// # }
    /// ```
    pub fn input_buffer(&self, len: usize) -> BufferMut {
        if !self.shared.torn.load(Ordering::Acquire) {
            let mut sub = self.shared.submit.lock();
            if let Some(lent) = sub.feeders.iter_mut().find_map(|f| f.loan(len)) {
                return lent;
            }
        }
        BufferMut::zeroed(len)
    }

    /// Where the graph's executions and time went so far: executions in flight, results
    /// buffered, messages, bytes and growths of every edge, executions and busy time of every
    /// actor. Worker processes are asked for their counters over their control socket (a
    /// round trip each), those on other hosts through their host's agent; each ask is bounded
    /// (a few seconds for a silent worker or host, at once for a dead one, which is reported
    /// with [`ActorStats::reported`] false). After teardown their last counters are reported.
    /// See [`GraphStats`] for an example.
    pub fn stats(&self) -> GraphStats {
        let s = &self.shared;
        let live = !s.torn.load(Ordering::Acquire);
        let (edges, actors) = s.obs.stats(&s.actors, &s.chans, live);
        let results_buffered = s
            .results
            .lock()
            .buffer
            .values()
            .map(|r| r.iter().filter(|v| v.is_some()).count())
            .sum();
        GraphStats {
            graph: s.id,
            executions_submitted: s.next_exec.load(Ordering::Acquire),
            executions_in_flight: s.in_flight(),
            results_buffered,
            edges,
            actors,
        }
    }

    /// Every operation recorded so far by every actor, if the graph was compiled with
    /// [`CompileOptions::timeline`] or `ADAG_TIMELINE` was set (empty otherwise). Worker
    /// processes send theirs over their control socket; after teardown the last ones are
    /// returned. Actors on other hosts are not on it: their clock is not the driver's. See
    /// [`Timeline`] for an example.
    pub fn timeline(&self) -> Timeline {
        let s = &self.shared;
        s.obs.timeline(&s.actors, !s.torn.load(Ordering::Acquire))
    }

    /// Write [`CompiledGraph::timeline`] as Chrome-trace JSON (open it in
    /// <https://ui.perfetto.dev> or `chrome://tracing`).
    pub fn write_timeline(&self, path: impl AsRef<std::path::Path>) -> Result<()> {
        self.timeline().write(path)
    }
}

/// Resolves when the pump may have freed a place in flight, the graph stopped, or `deadline`
/// passed (the pump wakes it at least every 100 ms, so the deadline is noticed).
struct RoomWait<'a, I> {
    shared: &'a GraphShared<I>,
    deadline: Option<Instant>,
}

impl<I: Value> std::future::Future for RoomWait<'_, I> {
    type Output = ();
    fn poll(self: std::pin::Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let s = self.shared;
        let free = || s.has_room() || s.torn.load(Ordering::Acquire);
        if free()
            || self.deadline.is_some_and(|d| Instant::now() >= d)
            || !s.room_or_pump_frees_it()
        {
            return Poll::Ready(());
        }
        s.results.lock().room_wakers.push(cx.waker().clone());
        // A pump standing aside for direct readers reads for this waiter now.
        s.room.notify_all();
        // The pump may have moved between the look above and the registration.
        if free() {
            return Poll::Ready(());
        }
        Poll::Pending
    }
}

impl<I: Value, O: IntoOutputs> Drop for CompiledGraph<I, O> {
    fn drop(&mut self) {
        let _ = self.shared.teardown_with(None);
    }
}
