//! The per-actor schedules once communicators are involved: the order of receives
//! (`order.rs`: matching operations meet on rendezvous groups), the reordering of
//! `overlap_gpu_communication`, and the compile-time deadlock check of every graph with
//! communicator operations.
//!
//! # Overlap
//! Each communicator operation of a schedule is split in two: `Issue` hands it to the actor's
//! communication thread (a send, a receive, a collective), `Wait` joins it just before its
//! value is first used. Receives are issued as early as possible: each one moves back past
//! computes, reads, writes and waits, up to the previous communicator issue (so the relative
//! order of communicator operations, which every peer relies on, never changes); its wait
//! stays at the first use of the tensor. A collective's wait moves forward to its result's
//! first use. A send has no wait: the
//! actor's loop goes on at once, and the next issue of the same edge (one execution later)
//! joins it. Compute of one task thus runs while the communication thread moves the tensors
//! of another, and compute of execution `k + 1` runs while the sends of `k` complete.
//!
//! # Deadlock check
//! A collective completes only when every member reaches it. A send on a rendezvous group
//! (NCCL) completes only with its receive; a send on a buffered group (the CPU
//! communicator) completes at once and queues its tensor for the receiver, whose receive
//! completes once that tensor is the next one queued from that sender (messages of a pair
//! are matched in order). The group's kind is `GraphPlan::comm_groups`, from
//! `send_completion()` of the communicator. The check simulates every actor's schedule
//! for [`ROUNDS`] executions: each actor has a main thread running its schedule and, with
//! overlap, a communication thread running the operations in the order they were issued.
//! Computes and ordinary channel writes always proceed (channels are buffered); an ordinary
//! read proceeds once its writer wrote that execution's value (the driver's inputs are always
//! there); a rendezvous proceeds when all its participants are at it at once; a buffered send
//! at once, a buffered receive once its tensor heads its sender's queue; an issue
//! proceeds at once (a send's issue once the previous send of that edge is done); a wait once
//! its operation is done. If the simulation stops before every thread finished, the graph
//! would deadlock: the error follows the wait-for relation from a blocked thread until it
//! closes a cycle and names each actor and the operation it is blocked at.
use super::plan::{ActorPlan, GraphPlan, Loc, OpSpec, Stage};
use crate::comm::SendCompletion;
use crate::error::{Error, Result};
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};

/// Executions simulated by the deadlock check: enough for the steady state of a schedule
/// whose sends of one execution complete during the next.
pub(crate) const ROUNDS: u64 = 3;

/// Order the receives (`order.rs`), apply `overlap` (if asked) and check the result for
/// deadlocks (if it has communicator operations).
pub(crate) fn finish(plan: &mut GraphPlan, overlap: bool) -> Result<()> {
    let has_comm = plan
        .actors
        .iter()
        .any(|a| a.ops.iter().any(|o| o.comm_stage().is_some()));
    if !has_comm {
        return Ok(());
    }
    super::order::order_receives(plan);
    if overlap {
        for a in &mut plan.actors {
            a.ops = overlapped(std::mem::take(&mut a.ops));
        }
    }
    check_deadlock(plan)
}

fn with_stage(op: &OpSpec, to: Stage) -> OpSpec {
    let mut op = op.clone();
    match &mut op {
        OpSpec::Recv { stage, .. }
        | OpSpec::Send { stage, .. }
        | OpSpec::Collective { stage, .. } => *stage = to,
        _ => {}
    }
    op
}

/// The overlapped form of one actor's schedule (see the module doc).
pub(crate) fn overlapped(ops: Vec<OpSpec>) -> Vec<OpSpec> {
    let mut out = Vec::with_capacity(ops.len() * 2);
    for op in &ops {
        match op.comm_stage() {
            Some(Stage::Inline) => match op {
                OpSpec::Send { .. } => out.push(with_stage(op, Stage::Issue)),
                _ => {
                    out.push(with_stage(op, Stage::Issue));
                    out.push(with_stage(op, Stage::Wait));
                }
            },
            _ => out.push(op.clone()),
        }
    }
    // Receives: issue as early as the order of communicator issues allows.
    for i in 0..out.len() {
        if matches!(
            out[i],
            OpSpec::Recv {
                stage: Stage::Issue,
                ..
            }
        ) {
            let mut j = i;
            while j > 0 && out[j - 1].comm_stage() != Some(Stage::Issue) {
                out.swap(j - 1, j);
                j -= 1;
            }
        }
    }
    // Receives and collectives: wait only where the value is first used. A receive may sit
    // well before its use once ordered to meet its send (order.rs); its wait goes to the use
    // so that the compute in between overlaps the transfer.
    let waits: Vec<u64> = out
        .iter()
        .filter_map(|o| match o {
            OpSpec::Collective {
                node,
                stage: Stage::Wait,
                ..
            }
            | OpSpec::Recv {
                edge: node,
                stage: Stage::Wait,
                ..
            } => Some(*node),
            _ => None,
        })
        .collect();
    for node in waits {
        let at = out
            .iter()
            .position(|o| match o {
                OpSpec::Collective {
                    node: n,
                    stage: Stage::Wait,
                    ..
                }
                | OpSpec::Recv {
                    edge: n,
                    stage: Stage::Wait,
                    ..
                } => *n == node,
                _ => false,
            })
            .expect("the wait is there");
        let wait = out.remove(at);
        let first_use = out[at..]
            .iter()
            .position(|o| o.consumes(node))
            .map_or(out.len(), |p| at + p);
        out.insert(first_use, wait);
    }
    out
}

/// A rendezvous of one execution.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Rdv {
    /// The tensor of `edge` from its writer to actor `reader`.
    P2p { edge: u64, reader: u64, k: u64 },
    /// Collective `coll`.
    Coll { coll: u64, k: u64 },
}

/// How one side of a communicator operation completes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    /// With every participant at once (a collective, a rendezvous send or receive).
    Meet,
    /// At once, queueing the tensor for its receiver (a buffered send).
    Post,
    /// Once its tensor heads the queue from its sender (a buffered receive).
    Take,
}

/// One step of a communicator operation: the rendezvous it belongs to, how it completes,
/// and its description for errors.
#[derive(Debug, Clone)]
struct Step {
    id: Rdv,
    side: Side,
    /// The queue of a buffered step: (group, writer, reader).
    queue: (u32, u64, u64),
    what: String,
}

/// What a communication thread job is: one communicator operation of one execution.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum JobKey {
    Recv(u64),
    Send(u64),
    Coll(u64),
}

type Job = (JobKey, u64);

#[derive(Debug, Clone)]
enum SimOp {
    /// Compute, split or ordinary write (of `writes`).
    Local {
        writes: Option<u64>,
    },
    /// Ordinary read of `edge`.
    Read {
        edge: u64,
        k: u64,
    },
    Rdv {
        step: Step,
    },
    Issue {
        job: Job,
        steps: Vec<Step>,
        after: Option<Job>,
        what: String,
    },
    Wait {
        job: Job,
        what: String,
    },
}

struct Actor {
    id: u64,
    name: String,
    main: Vec<SimOp>,
    pc: usize,
    /// The communication thread's queue: steps with the job they finish.
    comm: Vec<(Step, Option<Job>)>,
    cpc: usize,
}

/// A thread of the simulation: (actor index, communication thread?).
type Thread = (usize, bool);

fn describe_rdv(
    plan: &GraphPlan,
    names: &HashMap<u64, String>,
    op: &OpSpec,
    me: u64,
    k: u64,
) -> Vec<Step> {
    let label = |e: &u64| {
        plan.edges
            .get(e)
            .map_or_else(|| format!("edge {e}"), |p| p.label.clone())
    };
    let name = |a: &u64| {
        names
            .get(a)
            .cloned()
            .unwrap_or_else(|| format!("actor {a}"))
    };
    let buffered = |group: &u32| {
        plan.comm_groups.get(*group as usize).copied() == Some(SendCompletion::Buffered)
    };
    let writer_of = |edge: &u64| match plan.edges.get(edge).map(|e| e.writer) {
        Some(Loc::Actor(w)) => Some(w),
        _ => None,
    };
    match op {
        OpSpec::Recv { edge, group, .. } => {
            let writer = writer_of(edge);
            vec![Step {
                id: Rdv::P2p {
                    edge: *edge,
                    reader: me,
                    k,
                },
                side: if buffered(group) {
                    Side::Take
                } else {
                    Side::Meet
                },
                queue: (*group, writer.unwrap_or(u64::MAX), me),
                what: format!(
                    "recv {} from {} (execution {k})",
                    label(edge),
                    writer.map_or_else(|| "the driver".into(), |w| name(&w))
                ),
            }]
        }
        OpSpec::Send { edge, group, .. } => {
            let e = plan.edges.get(edge);
            let readers: Vec<u64> = e
                .map(|e| {
                    e.channel_readers()
                        .filter_map(|l| match l {
                            Loc::Actor(a) => Some(*a),
                            Loc::Driver => None,
                        })
                        .collect()
                })
                .unwrap_or_default();
            readers
                .iter()
                .map(|r| Step {
                    id: Rdv::P2p {
                        edge: *edge,
                        reader: *r,
                        k,
                    },
                    side: if buffered(group) {
                        Side::Post
                    } else {
                        Side::Meet
                    },
                    queue: (*group, me, *r),
                    what: format!("send {} to {} (execution {k})", label(edge), name(r)),
                })
                .collect()
        }
        OpSpec::Collective {
            node, coll, group, ..
        } => vec![Step {
            id: Rdv::Coll { coll: *coll, k },
            side: Side::Meet,
            queue: (*group, me, me),
            what: format!("{} (execution {k})", label(node)),
        }],
        _ => Vec::new(),
    }
}

fn job_key(op: &OpSpec) -> Option<JobKey> {
    match op {
        OpSpec::Recv { edge, .. } => Some(JobKey::Recv(*edge)),
        OpSpec::Send { edge, .. } => Some(JobKey::Send(*edge)),
        OpSpec::Collective { node, .. } => Some(JobKey::Coll(*node)),
        _ => None,
    }
}

fn unroll(plan: &GraphPlan, names: &HashMap<u64, String>, a: &ActorPlan) -> Vec<SimOp> {
    let mut out = Vec::new();
    for k in 0..ROUNDS {
        for op in &a.ops {
            match op {
                OpSpec::Compute { .. } | OpSpec::Split { .. } => {
                    out.push(SimOp::Local { writes: None })
                }
                OpSpec::Write { edge } => out.push(SimOp::Local {
                    writes: Some(*edge),
                }),
                OpSpec::Read { edge } => out.push(SimOp::Read { edge: *edge, k }),
                OpSpec::Recv { stage, .. }
                | OpSpec::Send { stage, .. }
                | OpSpec::Collective { stage, .. } => {
                    let steps = describe_rdv(plan, names, op, a.actor, k);
                    let key = job_key(op).expect("a communicator op");
                    match stage {
                        Stage::Inline => {
                            out.extend(steps.into_iter().map(|step| SimOp::Rdv { step }))
                        }
                        Stage::Issue => {
                            let what = format!(
                                "issue of {}",
                                steps
                                    .first()
                                    .map_or_else(|| format!("{key:?}"), |s| s.what.clone())
                            );
                            let after =
                                (matches!(key, JobKey::Send(_)) && k > 0).then_some((key, k - 1));
                            out.push(SimOp::Issue {
                                job: (key, k),
                                steps,
                                after,
                                what,
                            });
                        }
                        Stage::Wait => {
                            let what = format!(
                                "wait for {}",
                                steps
                                    .first()
                                    .map_or_else(|| format!("{key:?}"), |s| s.what.clone())
                            );
                            out.push(SimOp::Wait {
                                job: (key, k),
                                what,
                            });
                        }
                    }
                }
            }
        }
    }
    out
}

/// Check that the schedules of `plan` cannot deadlock on communicator operations.
pub(crate) fn check_deadlock(plan: &GraphPlan) -> Result<()> {
    let names: HashMap<u64, String> = plan
        .actors
        .iter()
        .map(|a| (a.actor, a.name.clone()))
        .collect();
    let mut actors: Vec<Actor> = plan
        .actors
        .iter()
        .map(|a| Actor {
            id: a.actor,
            name: a.name.clone(),
            main: unroll(plan, &names, a),
            pc: 0,
            comm: Vec::new(),
            cpc: 0,
        })
        .collect();
    let index: HashMap<u64, usize> = actors.iter().enumerate().map(|(i, a)| (a.id, i)).collect();
    // Who takes part in each rendezvous.
    let mut coll_members: BTreeMap<u64, BTreeSet<usize>> = BTreeMap::new();
    for a in &plan.actors {
        for op in &a.ops {
            if let OpSpec::Collective { coll, .. } = op {
                coll_members
                    .entry(*coll)
                    .or_default()
                    .insert(index[&a.actor]);
            }
        }
    }
    let participants = |id: &Rdv| -> BTreeSet<usize> {
        match id {
            Rdv::P2p { edge, reader, .. } => {
                let mut s = BTreeSet::new();
                if let Some(Loc::Actor(w)) = plan.edges.get(edge).map(|e| e.writer)
                    && let Some(i) = index.get(&w)
                {
                    s.insert(*i);
                }
                if let Some(i) = index.get(reader) {
                    s.insert(*i);
                }
                s
            }
            Rdv::Coll { coll, .. } => coll_members.get(coll).cloned().unwrap_or_default(),
        }
    };
    let mut written: HashSet<(u64, u64)> = HashSet::new();
    let mut done: HashSet<(usize, Job)> = HashSet::new();
    // Tensors sent on buffered groups and not yet received, per (group, writer, reader).
    let mut queues: HashMap<(u32, u64, u64), VecDeque<Rdv>> = HashMap::new();
    // A buffered step proceeds alone: a send queues its tensor, a receive takes the tensor at
    // the head of its queue if it is its own.
    let mut alone = |step: &Step| match step.side {
        Side::Post => {
            queues.entry(step.queue).or_default().push_back(step.id);
            true
        }
        Side::Take => {
            let q = queues.entry(step.queue).or_default();
            if q.front() == Some(&step.id) {
                q.pop_front();
                true
            } else {
                false
            }
        }
        Side::Meet => false,
    };
    loop {
        let mut progress = false;
        for (ai, a) in actors.iter_mut().enumerate() {
            while let Some(op) = a.main.get(a.pc) {
                let go = match op {
                    SimOp::Local { writes } => {
                        if let Some(e) = writes {
                            // The write of execution k: count the writes of this edge so far.
                            let k = (0..)
                                .find(|k| !written.contains(&(*e, *k)))
                                .expect("unbounded");
                            written.insert((*e, k));
                        }
                        true
                    }
                    SimOp::Read { edge, k } => {
                        matches!(
                            plan.edges.get(edge).map(|e| e.writer),
                            Some(Loc::Driver) | None
                        ) || written.contains(&(*edge, *k))
                    }
                    SimOp::Issue {
                        job, steps, after, ..
                    } => {
                        if after.is_none_or(|j| done.contains(&(ai, j))) {
                            if steps.is_empty() {
                                done.insert((ai, *job));
                            }
                            let n = steps.len();
                            for (i, step) in steps.iter().enumerate() {
                                a.comm.push((step.clone(), (i + 1 == n).then_some(*job)));
                            }
                            true
                        } else {
                            false
                        }
                    }
                    SimOp::Wait { job, .. } => done.contains(&(ai, *job)),
                    SimOp::Rdv { step } => alone(step),
                };
                if !go {
                    break;
                }
                a.pc += 1;
                progress = true;
            }
            // The communication thread's buffered steps.
            while let Some((step, job)) = a.comm.get(a.cpc) {
                if !alone(step) {
                    break;
                }
                if let Some(job) = job {
                    done.insert((ai, *job));
                }
                a.cpc += 1;
                progress = true;
            }
        }
        // Rendezvous whose participants are all there.
        let mut at: BTreeMap<Rdv, Vec<Thread>> = BTreeMap::new();
        for (ai, a) in actors.iter().enumerate() {
            if let Some(SimOp::Rdv { step }) = a.main.get(a.pc)
                && step.side == Side::Meet
            {
                at.entry(step.id).or_default().push((ai, false));
            }
            if let Some((step, _)) = a.comm.get(a.cpc)
                && step.side == Side::Meet
            {
                at.entry(step.id).or_default().push((ai, true));
            }
        }
        for (id, threads) in at {
            let here: BTreeSet<usize> = threads.iter().map(|t| t.0).collect();
            if here == participants(&id) {
                for (ai, comm) in threads {
                    let a = &mut actors[ai];
                    if comm {
                        if let Some(job) = a.comm[a.cpc].1 {
                            done.insert((ai, job));
                        }
                        a.cpc += 1;
                    } else {
                        a.pc += 1;
                    }
                }
                progress = true;
            }
        }
        if !progress {
            break;
        }
    }
    let finished = |a: &Actor| a.pc == a.main.len() && a.cpc == a.comm.len();
    if actors.iter().all(finished) {
        return Ok(());
    }
    // Explain: follow who waits for whom until a thread repeats. A buffered receive waits for
    // its sender's main thread (which has not sent yet).
    let sender_of = |step: &Step| index.get(&step.queue.1).map(|&w| (w, false));
    let blocked_at = |t: Thread| -> (String, Vec<Thread>) {
        let a = &actors[t.0];
        if t.1 {
            match a.comm.get(a.cpc) {
                Some((step, _)) if step.side == Side::Take => {
                    (step.what.clone(), sender_of(step).into_iter().collect())
                }
                Some((step, _)) => {
                    let others = participants(&step.id)
                        .into_iter()
                        .filter(|&b| {
                            b != t.0
                                && actors[b]
                                    .comm
                                    .get(actors[b].cpc)
                                    .is_none_or(|c| c.0.id != step.id)
                        })
                        .map(|b| (b, true))
                        .collect();
                    (step.what.clone(), others)
                }
                None => ("nothing issued yet".into(), vec![(t.0, false)]),
            }
        } else {
            match a.main.get(a.pc) {
                Some(SimOp::Read { edge, k }) => {
                    let e = &plan.edges[edge];
                    let writer = match e.writer {
                        Loc::Actor(w) => index.get(&w).copied(),
                        Loc::Driver => None,
                    };
                    (
                        format!("read {} (execution {k})", e.label),
                        writer.map(|w| vec![(w, false)]).unwrap_or_default(),
                    )
                }
                Some(SimOp::Rdv { step }) if step.side == Side::Take => {
                    (step.what.clone(), sender_of(step).into_iter().collect())
                }
                Some(SimOp::Rdv { step }) => {
                    let others = participants(&step.id)
                        .into_iter()
                        .filter(|&b| {
                            b != t.0 && !matches!(actors[b].main.get(actors[b].pc), Some(SimOp::Rdv { step: other }) if other.id == step.id)
                        })
                        .map(|b| (b, false))
                        .collect();
                    (step.what.clone(), others)
                }
                Some(SimOp::Issue { what, .. }) => (
                    format!("{what} (the previous send of that edge has not finished)"),
                    vec![(t.0, true)],
                ),
                Some(SimOp::Wait { what, .. }) => (what.clone(), vec![(t.0, true)]),
                Some(SimOp::Local { .. }) | None => ("nothing".into(), Vec::new()),
            }
        }
    };
    let thread_name = |t: Thread| {
        if t.1 {
            format!("the communication thread of {}", actors[t.0].name)
        } else {
            actors[t.0].name.clone()
        }
    };
    let start: Thread = actors
        .iter()
        .enumerate()
        .find_map(|(i, a)| {
            if a.pc < a.main.len() && !matches!(a.main[a.pc], SimOp::Local { .. }) {
                Some((i, false))
            } else if a.cpc < a.comm.len() {
                Some((i, true))
            } else {
                None
            }
        })
        .unwrap_or((0, false));
    let mut path: Vec<(Thread, String)> = Vec::new();
    let mut t = start;
    let cycle_from = loop {
        if let Some(p) = path.iter().position(|(u, _)| *u == t) {
            break Some(p);
        }
        let (what, waits) = blocked_at(t);
        path.push((t, what));
        match waits.into_iter().next() {
            Some(next) => t = next,
            None => break None,
        }
    };
    let (steps, kind) = match cycle_from {
        Some(p) => (&path[p..], "a cycle"),
        None => (&path[..], "a chain that never resolves"),
    };
    let mut text = Vec::new();
    for (i, (t, what)) in steps.iter().enumerate() {
        let next = steps.get(i + 1).or(if cycle_from.is_some() {
            steps.first()
        } else {
            None
        });
        let waiting = next.map_or_else(String::new, |(n, _)| {
            format!(", waiting for {}", thread_name(*n))
        });
        text.push(format!(
            "{} is blocked at `{what}`{waiting}",
            thread_name(*t)
        ));
    }
    let label = |e: &u64| {
        plan.edges
            .get(e)
            .map_or_else(|| format!("edge {e}"), |p| p.label.clone())
    };
    let rdv_node = |id: &Rdv| match id {
        Rdv::P2p { edge, .. } => label(edge),
        Rdv::Coll { coll, .. } => plan
            .actors
            .iter()
            .flat_map(|a| &a.ops)
            .find_map(|o| match o {
                OpSpec::Collective { node, coll: c, .. } if c == coll => Some(label(node)),
                _ => None,
            })
            .unwrap_or_else(|| format!("collective {coll}")),
    };
    let job_node = |j: &Job| match j.0 {
        JobKey::Recv(e) | JobKey::Send(e) | JobKey::Coll(e) => label(&e),
    };
    // The node at fault: the one the first thread of the cycle is blocked at.
    let node = steps
        .first()
        .map(|((ai, comm), _)| {
            let a = &actors[*ai];
            if *comm {
                a.comm.get(a.cpc).map(|c| rdv_node(&c.0.id))
            } else {
                match a.main.get(a.pc) {
                    Some(SimOp::Read { edge, .. }) => Some(label(edge)),
                    Some(SimOp::Rdv { step }) => Some(rdv_node(&step.id)),
                    Some(SimOp::Issue { job, .. } | SimOp::Wait { job, .. }) => Some(job_node(job)),
                    _ => None,
                }
            }
            .unwrap_or_else(|| a.name.clone())
        })
        .unwrap_or_else(|| "schedule".into());
    Err(Error::compile(
        node,
        format!(
            "this graph would deadlock on communicator operations ({kind}): {}. A communicator send meets its receive, and a collective all its actors, at once; bind the tasks so that every actor reaches its communicator operations in a compatible order, or move one of these tensors with Transport::Shm",
            text.join("; ")
        ),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compile::plan::{ActorPlan, ArgSource, ChannelKind, ChannelPlan, EdgePlan};

    fn edge(id: u64, writer: u64, readers: &[u64]) -> (u64, EdgePlan) {
        (
            id,
            EdgePlan {
                id,
                label: format!("e{id}"),
                ty: "Tensor".into(),
                writer: Loc::Actor(writer),
                same_actor: false,
                channels: vec![ChannelPlan {
                    id,
                    kind: ChannelKind::InProcess,
                    readers: readers.iter().map(|r| Loc::Actor(*r)).collect(),
                    host: 0,
                }],
            },
        )
    }

    fn send(edge: u64) -> OpSpec {
        OpSpec::Send {
            edge,
            group: 0,
            peers: vec![1],
            stage: Stage::Inline,
        }
    }

    fn recv(edge: u64) -> OpSpec {
        OpSpec::Recv {
            edge,
            group: 0,
            peer: 0,
            stage: Stage::Inline,
        }
    }

    fn compute(node: u64, args: &[u64]) -> OpSpec {
        OpSpec::Compute {
            node,
            method: "f".into(),
            label: None,
            args: args.iter().map(|a| ArgSource::Edge(*a)).collect(),
        }
    }

    fn plan(actors: Vec<(u64, Vec<OpSpec>)>, edges: Vec<(u64, EdgePlan)>) -> GraphPlan {
        GraphPlan {
            graph: 1,
            depth: 4,
            edges: edges.into_iter().collect(),
            actors: actors
                .into_iter()
                .map(|(actor, ops)| ActorPlan {
                    actor,
                    name: format!("A{actor}"),
                    ops,
                })
                .collect(),
            inputs: vec![],
            outputs: vec![],
            comm_groups: vec![SendCompletion::Rendezvous],
            hosts: Default::default(),
        }
    }

    fn crossed() -> GraphPlan {
        plan(
            vec![
                (
                    1,
                    vec![compute(10, &[]), send(10), recv(20), compute(30, &[20])],
                ),
                (
                    2,
                    vec![compute(20, &[]), send(20), recv(10), compute(40, &[10])],
                ),
            ],
            vec![edge(10, 1, &[2]), edge(20, 2, &[1])],
        )
    }

    /// Crossed sends in bind order deadlock on a rendezvous group, and the error names the
    /// cycle; on a buffered group the same order is fine.
    #[test]
    fn crossed_sends_in_bind_order() {
        for overlap in [false, true] {
            let mut p = crossed();
            if overlap {
                for a in &mut p.actors {
                    a.ops = overlapped(std::mem::take(&mut a.ops));
                }
            }
            let e = check_deadlock(&p).unwrap_err().to_string();
            assert!(
                e.contains("A1") && e.contains("A2") && e.contains("cycle"),
                "{e}"
            );
            assert!(e.contains("send e10 to A2"), "{e}");
            p.comm_groups = vec![SendCompletion::Buffered];
            check_deadlock(&p).unwrap();
        }
    }

    /// `finish` orders the receives so that the crossed sends meet: the same graph compiles
    /// on a rendezvous group, with and without overlap.
    #[test]
    fn crossed_sends_meet_once_ordered() {
        for overlap in [false, true] {
            let mut p = crossed();
            finish(&mut p, overlap).unwrap();
        }
    }

    /// A buffered receive that is not at the head of its sender's queue never completes:
    /// the check refuses a schedule that takes one sender's tensors out of order.
    #[test]
    fn buffered_receives_out_of_order_are_refused() {
        let mut p = plan(
            vec![
                (
                    1,
                    vec![compute(10, &[]), send(10), compute(11, &[]), send(11)],
                ),
                (2, vec![recv(11), recv(10), compute(40, &[10, 11])]),
            ],
            vec![edge(10, 1, &[2]), edge(11, 1, &[2])],
        );
        p.comm_groups = vec![SendCompletion::Buffered];
        let e = check_deadlock(&p).unwrap_err().to_string();
        assert!(e.contains("recv e11 from A1"), "{e}");
    }

    #[test]
    fn a_chain_there_and_back_is_fine() {
        for overlap in [false, true] {
            let mut p = plan(
                vec![
                    (
                        1,
                        vec![compute(10, &[]), send(10), recv(20), compute(30, &[20])],
                    ),
                    (2, vec![recv(10), compute(20, &[10]), send(20)]),
                ],
                vec![edge(10, 1, &[2]), edge(20, 2, &[1])],
            );
            finish(&mut p, overlap).unwrap();
        }
    }

    #[test]
    fn overlap_hoists_receives_and_keeps_comm_order() {
        let ops = vec![
            OpSpec::Read { edge: 1 },
            compute(5, &[1]),
            recv(10),
            compute(6, &[10, 5]),
            send(6),
            recv(11),
            compute(7, &[11]),
        ];
        let out = overlapped(ops);
        let short: Vec<String> = out
            .iter()
            .map(|o| match o {
                OpSpec::Read { edge } => format!("R{edge}"),
                OpSpec::Compute { node, .. } => format!("C{node}"),
                OpSpec::Recv { edge, stage, .. } => format!("recv{edge}:{stage:?}"),
                OpSpec::Send { edge, stage, .. } => format!("send{edge}:{stage:?}"),
                other => format!("{other:?}"),
            })
            .collect();
        assert_eq!(
            short,
            [
                "recv10:Issue",
                "R1",
                "C5",
                "recv10:Wait",
                "C6",
                "send6:Issue",
                "recv11:Issue",
                "recv11:Wait",
                "C7"
            ]
        );
    }

    /// A receive ordered early to meet its send is waited for only where it is used, so
    /// the compute in between overlaps it.
    #[test]
    fn receive_waits_sink_to_first_use() {
        let out = overlapped(vec![recv(10), compute(5, &[]), compute(6, &[10])]);
        let stages: Vec<Option<Stage>> = out.iter().map(OpSpec::comm_stage).collect();
        assert_eq!(
            stages,
            [Some(Stage::Issue), None, Some(Stage::Wait), None],
            "{out:?}"
        );
    }

    #[test]
    fn collective_waits_sink_to_first_use() {
        let coll = |node, input| OpSpec::Collective {
            node,
            input,
            coll: 99,
            kind: crate::dag::collective::CollectiveKind::AllGather,
            group: 0,
            order: vec![0, 1],
            index: 0,
            stage: Stage::Inline,
        };
        let out = overlapped(vec![
            compute(5, &[]),
            coll(6, 5),
            compute(7, &[]),
            compute(8, &[6]),
        ]);
        let stages: Vec<Option<Stage>> = out.iter().map(OpSpec::comm_stage).collect();
        assert_eq!(
            stages,
            [None, Some(Stage::Issue), None, Some(Stage::Wait), None]
        );
    }
}
