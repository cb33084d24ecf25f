//! Where an actor lives and how it is reached: the control link (one-off calls, running a
//! graph's schedule) and the loop that executes a schedule until its channels close.
use super::channels::GraphChannels;
use super::comm_ops::{CommCtx, CommGuard, CommMap, build_collective};
use super::method::{CallFailure, Op, TaskBuilder, find};
use super::observe::{BUSY_SAMPLE, Recorder, bump, mono_ns};
use super::worker::ProcessLink;
use super::{Actor, MethodEntry};
use crate::channel::wait::{DEFAULT_SPIN, SpinPolicy};
use crate::channel::{ChanError, Msg, Reader};
use crate::compile::plan::{GraphPlan, Loc, OpSpec, Stage};
use crate::error::{Error, Result};
use crate::value::Value;
use crossbeam_channel::{Receiver, RecvTimeoutError, Sender, TryRecvError};
use std::any::Any;
use std::cell::{Cell, OnceCell};
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// How long a one-off call waits for the actor to take it. An actor running a graph takes
/// calls between two executions of its schedule, and an idle one within [`CALL_POLL`]; one
/// that has not taken the call by then is stuck inside a method, and the call is withdrawn
/// (unrun) with `ActorBusy`.
pub(crate) const BUSY_AFTER: Duration = Duration::from_secs(2);

/// While an actor's loop waits for the next execution (its schedule's first read), it looks
/// for queued one-off calls this often: the longest an idle actor keeps a call waiting. Only
/// that idle wait is cut in slices; a read that finds its message at once, as in a busy
/// pipeline, reads no flag but one thread-local and makes no syscall.
pub(crate) const CALL_POLL: Duration = Duration::from_millis(20);

/// One-off calls queued for an actor's thread: the caller counts its call in before sending
/// it, the thread counts it out when it takes it off the queue. The graph loop reads this
/// counter once per execution (one relaxed load): no syscall, no wake-up.
#[derive(Default)]
pub(crate) struct Calls(AtomicUsize);

impl Calls {
    pub(crate) fn queued(&self) {
        self.0.fetch_add(1, Ordering::Release);
    }
    fn taken(&self) {
        self.0.fetch_sub(1, Ordering::Release);
    }
    fn any(&self) -> bool {
        self.0.load(Ordering::Acquire) > 0
    }
}

/// Who gets a queued call: the actor's thread (it runs it) or the caller (it gave up on a
/// stuck actor): whichever comes first, so that a withdrawn call never runs.
#[derive(Default)]
pub(crate) struct CallClaim(AtomicU8);

impl CallClaim {
    const QUEUED: u8 = 0;
    const TAKEN: u8 = 1;
    const WITHDRAWN: u8 = 2;
    fn take(&self) -> bool {
        self.0
            .compare_exchange(
                Self::QUEUED,
                Self::TAKEN,
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .is_ok()
    }
    /// Withdraws the call unless the actor took it already.
    pub(crate) fn cancel(&self) -> bool {
        self.0
            .compare_exchange(
                Self::QUEUED,
                Self::WITHDRAWN,
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .is_ok()
    }
}

thread_local! {
    /// The queued calls of the actor whose loop runs on this thread.
    static HOST_CALLS: OnceCell<Arc<Calls>> = const { OnceCell::new() };
    /// Set while the schedule's first operation runs: a read there is waiting *between* two
    /// executions, where a one-off call may run.
    static BETWEEN: Cell<bool> = const { Cell::new(false) };
    /// Set by a read that gave up its wait between two executions for a one-off call.
    static INTERRUPTED: Cell<bool> = const { Cell::new(false) };
}

/// The read operation of a schedule. Between two executions (the schedule's first operation)
/// it waits in [`CALL_POLL`] slices and gives up (`Timeout`, which the loop takes as "serve the
/// calls, then start the execution again") when a one-off call is queued; elsewhere it waits
/// for its message as any read.
pub(crate) fn read_between<T>(reader: &mut Reader<T>) -> Result<Msg<T>, ChanError> {
    if !BETWEEN.get() {
        return reader.read(None);
    }
    loop {
        match reader.read(Some(Instant::now() + CALL_POLL)) {
            Err(ChanError::Timeout) => {
                if HOST_CALLS.with(|c| c.get().is_some_and(|c| c.any())) {
                    INTERRUPTED.set(true);
                    return Err(ChanError::Timeout);
                }
            }
            r => return r,
        }
    }
}

/// Runs an operation of the schedule; when it is the first (`first`), its read may give up
/// waiting for the next execution so that a queued one-off call runs: that is `None`, and
/// nothing of the next execution was read.
fn between(
    first: bool,
    run: impl FnOnce() -> Result<(), ChanError>,
) -> Option<Result<(), ChanError>> {
    if !first {
        return Some(run());
    }
    BETWEEN.set(true);
    let r = run();
    BETWEEN.set(false);
    if matches!(r, Err(ChanError::Timeout)) && INTERRUPTED.replace(false) {
        None
    } else {
        Some(r)
    }
}

/// How the driver reaches an actor.
pub(crate) enum ActorLink {
    Thread(ThreadLink),
    Process(ProcessLink),
    /// A worker process on another host, reached through that host's agent.
    Remote(super::remote::RemoteLink),
}

/// Dropping the link closes the control channel, which ends the host loop; the thread is
/// detached, so the last handle's drop never blocks on a busy actor.
pub(crate) struct ThreadLink {
    pub(crate) control: Sender<Control>,
    pub(crate) calls: Arc<Calls>,
}

/// A request to an actor's host thread.
pub(crate) enum Control {
    Call {
        method: String,
        args: Box<dyn Any + Send>,
        reply: Sender<Result<Box<dyn Any + Send>, CallFailure>>,
        claim: Arc<CallClaim>,
    },
    CallEncoded {
        method: String,
        args: Vec<u8>,
        reply: Sender<Result<Vec<u8>, CallFailure>>,
        claim: Arc<CallClaim>,
    },
    Run(RunRequest),
}

/// Run a compiled graph's schedule until its channels close.
pub(crate) struct RunRequest {
    pub plan: Arc<GraphPlan>,
    pub chans: Arc<GraphChannels>,
    /// This actor's communicators, by group index of the plan.
    pub comms: CommMap,
    pub installed: Sender<Result<(), String>>,
    pub done: Sender<String>,
    /// Where the loop records its counters and, if asked, its timeline.
    pub recorder: Recorder,
}

/// The arguments of a one-off call to an actor in another process.
pub(crate) fn encode_args<Args: Value>(actor: &str, method: &str, args: &Args) -> Result<Vec<u8>> {
    crate::value::encode(args).map_err(|e| Error::Call {
        actor: actor.to_string(),
        method: method.to_string(),
        message: format!("cannot encode the arguments: {e}"),
    })
}

/// The result of a one-off call to an actor in another process; `stale` says where a type
/// mismatch most likely comes from.
pub(crate) fn decode_result<R: Value>(
    actor: &str,
    method: &str,
    bytes: &[u8],
    stale: &str,
) -> Result<R> {
    crate::value::decode::<R>(bytes).map_err(|e| Error::Codec {
        op: "decode",
        ty: std::any::type_name::<R>().into(),
        place: format!("the result of {actor}.{method}"),
        message: format!("{e}; {stale}"),
    })
}

pub(crate) fn call_failure(actor: &str, method: &str, failure: CallFailure) -> Error {
    match failure {
        CallFailure::Task(cause) => cause.into_error(actor, method),
        CallFailure::NoSuchMethod => Error::Call {
            actor: actor.to_string(),
            method: method.to_string(),
            message: "the actor has no such method; check the name against its #[actor] impl"
                .into(),
        },
        CallFailure::BadArgs(message) => Error::Call {
            actor: actor.to_string(),
            method: method.to_string(),
            message,
        },
        // The graph's id is filled in by the handle, which knows it.
        CallFailure::Busy => Error::ActorBusy {
            actor: actor.to_string(),
            graph: 0,
        },
    }
}

impl ActorLink {
    pub(crate) fn call<Args: Value, R: Value>(
        &self,
        actor: &str,
        method: &str,
        args: Args,
    ) -> Result<R> {
        match self {
            ActorLink::Thread(link) => {
                let (reply, rx) = crossbeam_channel::bounded(1);
                let gone = || Error::Call {
                    actor: actor.to_string(),
                    method: method.to_string(),
                    message: "the actor's thread has stopped".into(),
                };
                let claim = Arc::new(CallClaim::default());
                link.calls.queued();
                link.control
                    .send(Control::Call {
                        method: method.to_string(),
                        args: Box::new(args),
                        reply,
                        claim: claim.clone(),
                    })
                    .map_err(|_| gone())?;
                let reply = match recv_spinning(&rx, &mut SpinPolicy::new(DEFAULT_SPIN)) {
                    Ok(Some(r)) => Ok(r),
                    Ok(None) => rx.recv_timeout(BUSY_AFTER),
                    Err(()) => Err(RecvTimeoutError::Disconnected),
                };
                let reply = match reply {
                    Ok(r) => r,
                    Err(RecvTimeoutError::Timeout) if claim.cancel() => Err(CallFailure::Busy),
                    // Taken just now: it runs; wait for it.
                    Err(RecvTimeoutError::Timeout) => rx.recv().map_err(|_| gone())?,
                    Err(RecvTimeoutError::Disconnected) => return Err(gone()),
                };
                let value = reply.map_err(|f| call_failure(actor, method, f))?;
                value.downcast::<R>().map(|b| *b).map_err(|_| Error::Call {
                    actor: actor.to_string(),
                    method: method.to_string(),
                    message: format!("the method does not return {}", std::any::type_name::<R>()),
                })
            }
            ActorLink::Process(link) => link.call::<Args, R>(actor, method, args),
            ActorLink::Remote(link) => link.call::<Args, R>(actor, method, args),
        }
    }

    pub(crate) fn kill(&self, actor: &str) -> Result<()> {
        match self {
            ActorLink::Thread(_) => Err(Error::Call {
                actor: actor.to_string(),
                method: "kill".into(),
                message: "a thread actor cannot be killed; only process actors can".into(),
            }),
            ActorLink::Process(link) => link.kill(),
            ActorLink::Remote(link) => link.kill(),
        }
    }

    pub(crate) fn pid(&self) -> Option<u32> {
        match self {
            ActorLink::Thread(_) => None,
            ActorLink::Process(link) => Some(link.pid()),
            ActorLink::Remote(link) => Some(link.pid()),
        }
    }
}

/// Polls `rx` while `policy` spins (the channels' spin → yield phases): `Ok(Some(message))`
/// when one came, `Ok(None)` when the spin budget ran out first (the caller blocks now),
/// `Err(())` when the sender is gone. Both ends of a one-off call to a thread actor spin
/// first: a thread blocked in `recv` and woken from the other core costs ~80 µs on the
/// target machines, and a call had two of them (`reference/measurements.md`).
fn recv_spinning<T>(rx: &Receiver<T>, policy: &mut SpinPolicy) -> Result<Option<T>, ()> {
    let mut got = None;
    policy.idle(|| match rx.try_recv() {
        Ok(message) => {
            got = Some(message);
            Ok(true)
        }
        Err(TryRecvError::Empty) => Ok(false),
        Err(TryRecvError::Disconnected) => Err(()),
    })?;
    Ok(got)
}

/// An actor with its type erased, as a host thread or worker process holds it.
pub(crate) trait ErasedHost: Send {
    fn call_any(
        &mut self,
        method: &str,
        args: Box<dyn Any + Send>,
    ) -> Result<Box<dyn Any + Send>, CallFailure>;
    fn call_encoded(&mut self, method: &str, args: &[u8]) -> Result<Vec<u8>, CallFailure>;
    /// Build this actor's schedule of `plan`, report it through `installed`, then run it
    /// until a channel closes; returns why it stopped.
    fn run_graph(
        &mut self,
        plan: &GraphPlan,
        chans: &GraphChannels,
        comms: &CommMap,
        recorder: &Recorder,
        installed: &mut dyn FnMut(Result<(), String>),
        control: &Receiver<Control>,
    ) -> String;
}

/// Runs a one-off call taken off the control queue (unless its caller withdrew it); hands a
/// graph request back.
fn serve(host: &mut dyn ErasedHost, request: Control, calls: &Calls) -> Option<RunRequest> {
    match request {
        Control::Call {
            method,
            args,
            reply,
            claim,
        } => {
            calls.taken();
            if claim.take() {
                let _ = reply.send(host.call_any(&method, args));
            }
            None
        }
        Control::CallEncoded {
            method,
            args,
            reply,
            claim,
        } => {
            calls.taken();
            if claim.take() {
                let _ = reply.send(host.call_encoded(&method, &args));
            }
            None
        }
        Control::Run(run) => Some(run),
    }
}

/// Between two executions of a graph's schedule: runs every queued one-off call.
fn serve_between(host: &mut dyn ErasedHost, control: &Receiver<Control>) {
    let Some(calls) = HOST_CALLS.with(|c| c.get().cloned()) else {
        return;
    };
    while let Ok(request) = control.try_recv() {
        if let Some(run) = serve(host, request, &calls) {
            // The actor belongs to the running graph: no other can have claimed it.
            let _ = run
                .installed
                .send(Err("the actor is running another graph".into()));
            let _ = run.done.send("not started".into());
        }
    }
}

pub(crate) struct Host<A: Actor> {
    pub actor: A,
    pub id: u64,
    pub name: String,
}

fn method<A: Actor>(name: &str) -> Result<&'static MethodEntry<A>, CallFailure> {
    find(A::methods(), name).ok_or(CallFailure::NoSuchMethod)
}

impl<A: Actor> Host<A> {
    fn build(
        &self,
        plan: &GraphPlan,
        chans: &GraphChannels,
        comms: &CommMap,
    ) -> Result<(Vec<Op<A>>, CommGuard), String> {
        let me = Loc::Actor(self.id);
        let Some(mine) = plan.actors.iter().find(|a| a.actor == self.id) else {
            return Ok((Vec::new(), CommCtx::<A>::default().guard()));
        };
        let mut b = TaskBuilder::new(plan, me, chans, self.name.clone());
        b.comm = CommCtx::new(comms.clone(), &mine.ops);
        let mut computes: HashMap<u64, Op<A>> = HashMap::new();
        let missing = |m: &str| format!("actor {} has no method {m}", self.name);
        for op in &mine.ops {
            match op {
                OpSpec::Compute {
                    node,
                    method: m,
                    args,
                } => {
                    let entry = method::<A>(m).map_err(|_| missing(m))?;
                    computes.insert(*node, entry.imp.build(&mut b, *node, args)?);
                }
                OpSpec::Split {
                    node,
                    source,
                    method: m,
                    index,
                } => {
                    let entry = method::<A>(m).map_err(|_| missing(m))?;
                    computes.insert(
                        *node,
                        entry.imp.build_split(&mut b, *node, *source, *index)?,
                    );
                }
                OpSpec::Collective { stage, .. } => {
                    if *stage != Stage::Wait {
                        build_collective(&mut b, op)?;
                    }
                }
                OpSpec::Read { .. }
                | OpSpec::Write { .. }
                | OpSpec::Recv { .. }
                | OpSpec::Send { .. } => {}
            }
        }
        let mut ops = Vec::with_capacity(mine.ops.len());
        for op in &mine.ops {
            let built = match op {
                OpSpec::Read { edge } => b.reads.remove(edge),
                OpSpec::Write { edge } => b.writes.remove(edge),
                OpSpec::Compute { node, .. } | OpSpec::Split { node, .. } => computes.remove(node),
                OpSpec::Recv { .. } | OpSpec::Send { .. } | OpSpec::Collective { .. } => {
                    b.comm.take(op)
                }
            };
            ops.push(
                built.ok_or_else(|| format!("schedule of {}: {op:?} was not built", self.name))?,
            );
        }
        let guard = b.comm.guard();
        Ok((ops, guard))
    }
}

impl<A: Actor> ErasedHost for Host<A> {
    fn call_any(
        &mut self,
        name: &str,
        args: Box<dyn Any + Send>,
    ) -> Result<Box<dyn Any + Send>, CallFailure> {
        method::<A>(name)?.imp.call_any(&mut self.actor, args)
    }

    fn call_encoded(&mut self, name: &str, args: &[u8]) -> Result<Vec<u8>, CallFailure> {
        method::<A>(name)?.imp.call_encoded(&mut self.actor, args)
    }

    fn run_graph(
        &mut self,
        plan: &GraphPlan,
        chans: &GraphChannels,
        comms: &CommMap,
        recorder: &Recorder,
        installed: &mut dyn FnMut(Result<(), String>),
        control: &Receiver<Control>,
    ) -> String {
        // Every event of the actor's methods (and of the loop) carries the actor and the graph:
        // one span for the whole run, entered once, so it costs nothing per execution.
        let _actor = tracing::info_span!("actor", actor = %self.name, graph = plan.graph).entered();
        let (mut ops, guard) = match self.build(plan, chans, comms) {
            Ok(built) => built,
            Err(e) => {
                tracing::warn!(error = %e, "installing the schedule failed");
                installed(Err(e.clone()));
                return e;
            }
        };
        installed(Ok(()));
        if ops.is_empty() {
            return "empty schedule".into();
        }
        let specs: &[OpSpec] = plan
            .actors
            .iter()
            .find(|a| a.actor == self.id)
            .map_or(&[], |a| &a.ops);
        let names: Vec<(&'static str, String)> = specs.iter().map(|op| op_name(plan, op)).collect();
        // Compute operations are the actor's busy time.
        let computes: Vec<bool> = names.iter().map(|(kind, _)| *kind == "compute").collect();
        tracing::debug!(
            ops = ops.len(),
            timeline = recorder.timeline.is_some(),
            "running its schedule"
        );
        // Chosen once: without a timeline and with trace events off, the loop is the plain one.
        let traced = tracing::enabled!(tracing::Level::TRACE);
        let counters = &*recorder.counters;
        let has_calls = HOST_CALLS.with(|c| c.get().cloned());
        // One-off calls run between two executions of the schedule, never inside one: before
        // its first operation, when the counter says some are queued (one load per
        // execution), or when the first operation, a read waiting for the next execution,
        // gives up its wait for them (`read_between`).
        let why = if recorder.timeline.is_none() && !traced {
            // Busy time is timed on one execution in BUSY_SAMPLE (and scaled when read):
            // two clock reads on every method call would show in an echo's round trip.
            let mut exec = 0u64;
            'run: loop {
                if has_calls.as_ref().is_some_and(|c| c.any()) {
                    serve_between(self, control);
                }
                let timed = exec.is_multiple_of(BUSY_SAMPLE);
                for (i, (op, compute)) in ops.iter_mut().zip(&computes).enumerate() {
                    let actor = &mut self.actor;
                    let ran = between(i == 0, || {
                        if timed && *compute {
                            let start = mono_ns();
                            let r = op(actor);
                            bump(&counters.busy_ns, mono_ns() - start);
                            r
                        } else {
                            op(actor)
                        }
                    });
                    // Interrupted between executions (nothing of the next one was read).
                    let Some(r) = ran else { continue 'run };
                    if let Err(e) = r {
                        break 'run format!("{e:?}");
                    }
                }
                if timed {
                    bump(&counters.timed_executions, 1);
                }
                bump(&counters.executions, 1);
                exec += 1;
            }
        } else {
            let timeline = recorder.timeline.as_deref();
            let mut exec = 0u64;
            'run: loop {
                if has_calls.as_ref().is_some_and(|c| c.any()) {
                    serve_between(self, control);
                }
                let _exec = traced.then(|| tracing::trace_span!("execution", exec).entered());
                for (i, op) in ops.iter_mut().enumerate() {
                    let actor = &mut self.actor;
                    let start = mono_ns();
                    let ran = between(i == 0, || {
                        if traced {
                            let (kind, name) = &names[i];
                            let _task = tracing::trace_span!("task", kind, %name).entered();
                            op(actor)
                        } else {
                            op(actor)
                        }
                    });
                    let end = mono_ns();
                    let Some(r) = ran else { continue 'run };
                    if let Err(e) = r {
                        break 'run format!("{e:?}");
                    }
                    if computes[i] {
                        bump(&counters.busy_ns, end - start);
                    }
                    if let Some(t) = timeline {
                        t.record(i as u32, exec, start, end);
                    }
                }
                bump(&counters.timed_executions, 1);
                bump(&counters.executions, 1);
                exec += 1;
            }
        };
        tracing::debug!(reason = %why, executions = counters.executions.load(std::sync::atomic::Ordering::Relaxed), "schedule stopped");
        // The operations hold the communication thread's queue: drop them first, then
        // destroy the communicators (waking any peer blocked in one) and join the thread.
        drop(ops);
        drop(guard);
        why
    }
}

/// The kind of an operation (`read`, `compute`, `write`, `comm`) and what it names (the
/// method, or the edge's producing node), as spans and the timeline show it.
pub(crate) fn op_name(plan: &GraphPlan, op: &OpSpec) -> (&'static str, String) {
    let label = |edge: &u64| {
        plan.edges
            .get(edge)
            .map_or_else(|| format!("edge {edge}"), |e| e.label.clone())
    };
    match op {
        OpSpec::Read { edge } => ("read", label(edge)),
        OpSpec::Write { edge } => ("write", label(edge)),
        OpSpec::Compute { method, .. } | OpSpec::Split { method, .. } => {
            ("compute", method.clone())
        }
        OpSpec::Recv { edge, stage, .. } => ("comm", format!("recv {} ({stage:?})", label(edge))),
        OpSpec::Send { edge, stage, .. } => ("comm", format!("send {} ({stage:?})", label(edge))),
        OpSpec::Collective { kind, stage, .. } => ("comm", format!("{kind} ({stage:?})")),
    }
}

/// The loop of an actor's host thread: serve one-off calls and run graphs until every
/// handle is gone.
pub(crate) fn host_loop(
    mut host: Box<dyn ErasedHost>,
    control: Receiver<Control>,
    calls: Arc<Calls>,
) {
    HOST_CALLS.with(|c| {
        let _ = c.set(calls.clone());
    });
    let mut spin = SpinPolicy::new(DEFAULT_SPIN);
    loop {
        let request = match recv_spinning(&control, &mut spin) {
            Ok(Some(request)) => request,
            Ok(None) => match control.recv() {
                Ok(request) => request,
                Err(_) => break,
            },
            Err(()) => break,
        };
        if let Some(run) = serve(&mut *host, request, &calls) {
            let installed = run.installed.clone();
            let why = host.run_graph(
                &run.plan,
                &run.chans,
                &run.comms,
                &run.recorder,
                &mut |r| {
                    let _ = installed.send(r);
                },
                &control,
            );
            let _ = run.done.send(why);
        }
    }
}
