//! Where an actor lives and how it is reached: the control link (one-off calls, running a
//! graph's schedule) and the loop that executes a schedule until its channels close.
use super::call::{
    Between, CallClaim, CallFailure, Calls, between, calls_here, recv_spinning, serve_calls_here,
};
use super::channels::GraphChannels;
use super::comm_ops::{CommCtx, CommGuard, CommMap, build_collective};
use super::method::{TaskBuilder, find};
use super::observe::{BUSY_SAMPLE, BusyClock, Recorder, bump, mono_ns};
use super::op::Op;
use super::{Actor, MethodEntry};
use crate::channel::Holding;
use crate::channel::wait::{DEFAULT_SPIN, SpinPolicy};
use crate::compile::plan::{GraphPlan, Loc, OpSpec, Stage};
use crate::error::Result;
use crossbeam_channel::{Receiver, Sender};
use std::any::Any;
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::Arc;

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
fn serve_between(host: &mut dyn ErasedHost, control: &Receiver<Control>, holding: &Holding) {
    let Some(calls) = calls_here() else {
        return;
    };
    // A one-off call may take long: nothing stays held meanwhile (a failed connection shows
    // at the next read or write).
    let _ = holding.release();
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

/// An actor's schedule, built: its operations, what keeps its communicators, and the frames
/// its network writers hold back.
struct Installed<A> {
    ops: Vec<Op<A>>,
    /// Per operation: whether the loop times it, on `busy`, as the actor's busy time (a
    /// method's compute; a fused operation times its method itself).
    computes: Vec<bool>,
    busy: Rc<BusyClock>,
    guard: CommGuard,
    holding: Arc<Holding>,
    between: Rc<Between>,
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
    /// Builds this actor's schedule of `plan`. With `fuse`, a read, the method that takes it
    /// as its one node argument and the write of the method's result run as one operation
    /// where nothing else of the actor uses the two values: no slots between them, one
    /// dynamic call instead of three (an echo's round trip is a few hundred cycles; these
    /// were ~50). The operations then no longer match the plan's one for one, so a timeline
    /// or trace, which name the plan's operations, builds without.
    fn build(
        &self,
        plan: &GraphPlan,
        chans: &GraphChannels,
        comms: &CommMap,
        fuse: bool,
    ) -> Result<Installed<A>, String> {
        let me = Loc::Actor(self.id);
        let Some(mine) = plan.actors.iter().find(|a| a.actor == self.id) else {
            return Ok(Installed {
                ops: Vec::new(),
                computes: Vec::new(),
                busy: Rc::default(),
                guard: CommCtx::<A>::default().guard(),
                holding: Arc::default(),
                between: Rc::default(),
            });
        };
        let mut b = TaskBuilder::new(plan, me, chans, self.name.clone());
        b.comm = CommCtx::new(comms.clone(), &mine.ops);
        let mut computes: HashMap<u64, Op<A>> = HashMap::new();
        let missing = |m: &str| format!("actor {} has no method {m}", self.name);
        // Fused operations, at the index of their read in the plan's schedule; the method and
        // the write they take in are `covered`.
        let mut fused: Vec<Option<Op<A>>> = mine.ops.iter().map(|_| None).collect();
        let mut covered = vec![false; mine.ops.len()];
        for at in 0..mine.ops.len() {
            let Some((node, edge)) = fuse.then(|| b.fusable(&mine.ops, at)).flatten() else {
                continue;
            };
            let OpSpec::Compute {
                method: m, args, ..
            } = &mine.ops[at + 1]
            else {
                continue;
            };
            let entry = method::<A>(m).map_err(|_| missing(m))?;
            if let Some(op) = entry.imp.build_fused(&mut b, node, args, edge)? {
                fused[at] = Some(op);
                covered[at + 1] = true;
                covered[at + 2] = true;
            }
        }
        for (i, op) in mine.ops.iter().enumerate() {
            if fused[i].is_some() || covered[i] {
                continue;
            }
            match op {
                OpSpec::Compute {
                    node,
                    method: m,
                    args,
                    ..
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
        let mut is_compute = Vec::with_capacity(mine.ops.len());
        for (i, op) in mine.ops.iter().enumerate() {
            if covered[i] {
                continue;
            }
            if let Some(op) = fused[i].take() {
                ops.push(op);
                is_compute.push(false);
                continue;
            }
            is_compute.push(matches!(op, OpSpec::Compute { .. } | OpSpec::Split { .. }));
            let built = match op {
                OpSpec::Read { edge } => b.reads.remove(edge),
                OpSpec::Write { edge } => b.writes.remove(edge),
                OpSpec::Compute { node, .. } | OpSpec::Split { node, .. } => computes.remove(node),
                OpSpec::Recv { .. } | OpSpec::Send { .. } | OpSpec::Collective { .. } => {
                    b.comm.take(op).map(|mut comm| {
                        // A communicator operation may wait on a peer: nothing stays held.
                        let holding = b.holding.clone();
                        Box::new(move |actor: &mut A| {
                            holding.release()?;
                            comm(actor)
                        }) as Op<A>
                    })
                }
            };
            ops.push(
                built.ok_or_else(|| format!("schedule of {}: {op:?} was not built", self.name))?,
            );
        }
        let guard = b.comm.guard();
        Ok(Installed {
            ops,
            computes: is_compute,
            busy: b.busy,
            guard,
            holding: b.holding,
            between: b.between,
        })
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
        // Chosen once: without a timeline and with trace events off, the loop is the plain one.
        let traced = tracing::enabled!(tracing::Level::TRACE);
        let plain = recorder.timeline.is_none() && !traced;
        let Installed {
            mut ops,
            computes,
            busy,
            guard,
            holding,
            between: state,
        } = match self.build(plan, chans, comms, plain) {
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
        tracing::debug!(
            ops = ops.len(),
            timeline = recorder.timeline.is_some(),
            "running its schedule"
        );
        let counters = &*recorder.counters;
        let has_calls = calls_here();
        // One-off calls run between two executions of the schedule, never inside one: before
        // its first operation, when the counter says some are queued (one load per
        // execution), or when the first operation, a read waiting for the next execution,
        // gives up its wait for them (`read_between`).
        let why = if plain {
            // Busy time is timed on one execution in BUSY_SAMPLE (and scaled when read):
            // two clock reads on every method call would show in an echo's round trip.
            let mut exec = 0u64;
            'run: loop {
                if has_calls.as_ref().is_some_and(|c| c.any()) {
                    serve_between(self, control, &holding);
                }
                let timed = exec.is_multiple_of(BUSY_SAMPLE);
                busy.sample(timed);
                for (i, (op, compute)) in ops.iter_mut().zip(&computes).enumerate() {
                    let actor = &mut self.actor;
                    let ran = between(&state, i == 0, || {
                        if *compute {
                            let start = busy.start();
                            let r = op(actor);
                            busy.stop(start);
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
                    bump(&counters.busy_ns, busy.take());
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
                    serve_between(self, control, &holding);
                }
                let _exec = traced.then(|| tracing::trace_span!("execution", exec).entered());
                for (i, op) in ops.iter_mut().enumerate() {
                    let actor = &mut self.actor;
                    let start = mono_ns();
                    let ran = between(&state, i == 0, || {
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
        // What the last, unfinished execution timed.
        bump(&counters.busy_ns, busy.take());
        tracing::debug!(reason = %why, executions = counters.executions.load(std::sync::atomic::Ordering::Relaxed), "schedule stopped");
        // Frames still held go out (a stop by error leaves the others' channels working).
        let _ = holding.release();
        // The operations hold the communication thread's queue: drop them first (with the
        // holding, which shares their network connections: they close now, as before), then
        // destroy the communicators (waking any peer blocked in one) and join the thread.
        drop(ops);
        drop(holding);
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
        OpSpec::Compute {
            label: Some(label), ..
        } => ("compute", label.clone()),
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
    serve_calls_here(calls.clone());
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
