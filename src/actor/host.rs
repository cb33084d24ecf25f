//! Where an actor lives and how it is reached: the control link (one-off calls, running a
//! graph's schedule) and the loop that executes a schedule until its channels close.
use super::channels::GraphChannels;
use super::comm_ops::{CommCtx, CommGuard, CommMap, build_collective};
use super::method::{CallFailure, Op, TaskBuilder, find};
use super::observe::{BUSY_SAMPLE, Recorder, bump, mono_ns};
use super::worker::ProcessLink;
use super::{Actor, MethodEntry};
use crate::compile::plan::{GraphPlan, Loc, OpSpec, Stage};
use crate::error::{Error, Result};
use crate::value::Value;
use crossbeam_channel::{Receiver, Sender};
use std::any::Any;
use std::collections::HashMap;
use std::sync::Arc;

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
}

/// A request to an actor's host thread.
pub(crate) enum Control {
    Call {
        method: String,
        args: Box<dyn Any + Send>,
        reply: Sender<Result<Box<dyn Any + Send>, CallFailure>>,
    },
    CallEncoded {
        method: String,
        args: Vec<u8>,
        reply: Sender<Result<Vec<u8>, CallFailure>>,
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
                link.control
                    .send(Control::Call {
                        method: method.to_string(),
                        args: Box::new(args),
                        reply,
                    })
                    .map_err(|_| gone())?;
                let value = rx
                    .recv()
                    .map_err(|_| gone())?
                    .map_err(|f| call_failure(actor, method, f))?;
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
    ) -> String;
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
        let why = if recorder.timeline.is_none() && !traced {
            // Busy time is timed on one execution in BUSY_SAMPLE (and scaled when read):
            // two clock reads on every method call would show in an echo's round trip.
            let mut exec = 0u64;
            'run: loop {
                let timed = exec.is_multiple_of(BUSY_SAMPLE);
                for (op, compute) in ops.iter_mut().zip(&computes) {
                    let r = if timed && *compute {
                        let start = mono_ns();
                        let r = op(&mut self.actor);
                        bump(&counters.busy_ns, mono_ns() - start);
                        r
                    } else {
                        op(&mut self.actor)
                    };
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
                let _exec = traced.then(|| tracing::trace_span!("execution", exec).entered());
                for (i, op) in ops.iter_mut().enumerate() {
                    let start = mono_ns();
                    let r = if traced {
                        let (kind, name) = &names[i];
                        let _task = tracing::trace_span!("task", kind, %name).entered();
                        op(&mut self.actor)
                    } else {
                        op(&mut self.actor)
                    };
                    let end = mono_ns();
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
pub(crate) fn host_loop(mut host: Box<dyn ErasedHost>, control: Receiver<Control>) {
    while let Ok(request) = control.recv() {
        match request {
            Control::Call {
                method,
                args,
                reply,
            } => {
                let _ = reply.send(host.call_any(&method, args));
            }
            Control::CallEncoded {
                method,
                args,
                reply,
            } => {
                let _ = reply.send(host.call_encoded(&method, &args));
            }
            Control::Run(run) => {
                let installed = run.installed.clone();
                let why =
                    host.run_graph(&run.plan, &run.chans, &run.comms, &run.recorder, &mut |r| {
                        let _ = installed.send(r);
                    });
                let _ = run.done.send(why);
            }
        }
    }
}
