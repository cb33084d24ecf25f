//! The order of communicator receives in each actor's schedule (Ray's co-scheduling of
//! communicator operations).
//!
//! `build_plan` lists each actor's operations in bind order: before each task, the reads and
//! receives of its inputs; then the task; then the writes and sends of its result. Only
//! receives move here; everything else (computes, splits, collectives, ordinary reads and
//! writes, sends) keeps bind order, which stays a guarantee to the user.
//!
//! # The rule
//! Give every operation a time in one global order of the graph: a task is at its node id
//! (node ids grow in bind order across all actors, and every argument is bound before its
//! consumer), every member of one collective is at the collective's first output id, and a
//! send is right after the task that made its tensor. Then:
//!
//! - on a **rendezvous** group (a send waits for its receive: NCCL), a receive is placed at
//!   its send's time, i.e. before the receiver's first operation that comes later in the
//!   global order. The send and its receive then meet: every actor's schedule is its part
//!   of one global sequence of operations in which each rendezvous is one step and every
//!   operation waits only on steps before it, so no order of arrival deadlocks;
//! - on a **buffered** group (a send completes without its receive: the CPU communicator) a
//!   receive stays where the receiver first needs the tensor (the receiver does not block
//!   early and keeps computing while the tensor waits in the buffer), moved earlier only as
//!   far as needed to receive the messages of one sender in the order they were sent (both
//!   backends match the messages of a pair in order).
//!
//! Receives that land between the same two operations are ordered by their sends' times,
//! so the messages between two actors are sent and received in the same order on either
//! kind of group. The deadlock check (`schedule.rs`) then runs on the result with each
//! group's semantics; `overlap_gpu_communication` is applied on top.
use super::plan::{GraphPlan, OpSpec};
use crate::comm::SendCompletion;
use std::collections::{BTreeMap, HashMap};

/// A place in the global order: (time, 0 for a task / 1 for a send, node id).
type Key = (u64, u8, u64);

/// Reorder every actor's receives of `plan` (see the module doc).
pub(crate) fn order_receives(plan: &mut GraphPlan) {
    // The time of each collective: its first output id.
    let mut coll_time: HashMap<u64, u64> = HashMap::new();
    for a in &plan.actors {
        for op in &a.ops {
            if let OpSpec::Collective { node, coll, .. } = op {
                let t = coll_time.entry(*coll).or_insert(*node);
                *t = (*t).min(*node);
            }
        }
    }
    let mut node_time: HashMap<u64, u64> = HashMap::new();
    for a in &plan.actors {
        for op in &a.ops {
            if let OpSpec::Collective { node, coll, .. } = op {
                node_time.insert(*node, coll_time[coll]);
            }
        }
    }
    let time = |node: u64| node_time.get(&node).copied().unwrap_or(node);
    // Which actor writes each edge (for the sender of a receive).
    let writer: HashMap<u64, u64> = plan
        .actors
        .iter()
        .flat_map(|a| {
            a.ops.iter().filter_map(move |op| match op {
                OpSpec::Compute { node, .. }
                | OpSpec::Split { node, .. }
                | OpSpec::Collective { node, .. } => Some((*node, a.actor)),
                _ => None,
            })
        })
        .collect();
    let groups = plan.comm_groups.clone();
    for a in &mut plan.actors {
        let ops = std::mem::take(&mut a.ops);
        // The other operations in bind order, with their places in the global order.
        let mut rest: Vec<(OpSpec, Key)> = Vec::with_capacity(ops.len());
        // Receives: (op, gap in `rest` it came before, its send's key).
        let mut recvs: Vec<(OpSpec, usize, Key)> = Vec::new();
        for op in ops {
            match &op {
                OpSpec::Recv { edge, .. } => {
                    let send_key = (time(*edge), 1, *edge);
                    recvs.push((op, rest.len(), send_key));
                }
                _ => {
                    let key = match &op {
                        OpSpec::Compute { node, .. }
                        | OpSpec::Split { node, .. }
                        | OpSpec::Collective { node, .. } => (time(*node), 0, *node),
                        OpSpec::Write { edge } | OpSpec::Send { edge, .. } => {
                            (time(*edge), 1, *edge)
                        }
                        // Placed below: a read takes its consumer's key.
                        OpSpec::Read { .. } => (u64::MAX, 0, 0),
                        OpSpec::Recv { .. } => unreachable!("handled above"),
                    };
                    rest.push((op, key));
                }
            }
        }
        // A read is at its consumer's time: the next task after it.
        let mut next = (u64::MAX, 0, 0);
        for (op, key) in rest.iter_mut().rev() {
            if matches!(op, OpSpec::Read { .. }) {
                *key = next;
            } else {
                next = *key;
            }
        }
        // Where each receive goes: its gap (it runs before `rest[gap]`).
        for (op, gap, send_key) in &mut recvs {
            let OpSpec::Recv { group, .. } = op else {
                continue;
            };
            let sends = groups.get(*group as usize).copied().unwrap_or_default();
            if sends == SendCompletion::Rendezvous {
                let meet = rest.iter().position(|(_, k)| *k > *send_key);
                *gap = (*gap).min(meet.unwrap_or(rest.len()));
            }
        }
        // Messages of one sender over one group are received in the order they were sent:
        // walking them from the last sent, none may come after a later one.
        let mut queues: BTreeMap<(u32, u64), Vec<usize>> = BTreeMap::new();
        for (i, (op, _, _)) in recvs.iter().enumerate() {
            if let OpSpec::Recv { edge, group, .. } = op {
                let from = writer.get(edge).copied().unwrap_or(u64::MAX);
                queues.entry((*group, from)).or_default().push(i);
            }
        }
        for q in queues.values_mut() {
            q.sort_by_key(|&i| recvs[i].2);
            let mut bound = usize::MAX;
            for &i in q.iter().rev() {
                recvs[i].1 = recvs[i].1.min(bound);
                bound = recvs[i].1;
            }
        }
        recvs.sort_by_key(|(_, gap, send_key)| (*gap, *send_key));
        let mut out = Vec::with_capacity(rest.len() + recvs.len());
        let mut recvs = recvs.into_iter().peekable();
        for (g, (op, _)) in rest.into_iter().enumerate() {
            while let Some((r, _, _)) = recvs.next_if(|(_, gap, _)| *gap == g) {
                out.push(r);
            }
            out.push(op);
        }
        out.extend(recvs.map(|(r, _, _)| r));
        a.ops = out;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compile::plan::{ActorPlan, ArgSource, Stage};

    fn recv(edge: u64) -> OpSpec {
        OpSpec::Recv {
            edge,
            group: 0,
            peer: 0,
            stage: Stage::Inline,
        }
    }

    fn send(edge: u64) -> OpSpec {
        OpSpec::Send {
            edge,
            group: 0,
            peers: vec![1],
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

    fn short(ops: &[OpSpec]) -> Vec<String> {
        ops.iter()
            .map(|o| match o {
                OpSpec::Read { edge } => format!("R{edge}"),
                OpSpec::Compute { node, .. } => format!("C{node}"),
                OpSpec::Recv { edge, .. } => format!("recv{edge}"),
                OpSpec::Send { edge, .. } => format!("send{edge}"),
                OpSpec::Write { edge } => format!("W{edge}"),
                other => format!("{other:?}"),
            })
            .collect()
    }

    fn plan(actors: Vec<(u64, Vec<OpSpec>)>, sends: SendCompletion) -> GraphPlan {
        GraphPlan {
            graph: 1,
            depth: 4,
            edges: BTreeMap::new(),
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
            comm_groups: vec![sends],
            hosts: Default::default(),
        }
    }

    /// Crossed sends (A: t1 = make, B: t2 = make, A: total(t2), B: total(t1)): on a
    /// rendezvous group B receives t1 before making t2, A receives t2 where B sends it.
    #[test]
    fn crossed_sends_meet_on_a_rendezvous_group() {
        let actors = vec![
            (
                1,
                vec![compute(10, &[]), send(10), recv(20), compute(30, &[20])],
            ),
            (
                2,
                vec![compute(20, &[]), send(20), recv(10), compute(40, &[10])],
            ),
        ];
        let mut p = plan(actors.clone(), SendCompletion::Rendezvous);
        order_receives(&mut p);
        assert_eq!(short(&p.actors[0].ops), ["C10", "send10", "recv20", "C30"]);
        assert_eq!(short(&p.actors[1].ops), ["recv10", "C20", "send20", "C40"]);
        // Buffered: the receives stay where the tensors are used.
        let mut p = plan(actors, SendCompletion::Buffered);
        order_receives(&mut p);
        assert_eq!(short(&p.actors[1].ops), ["C20", "send20", "recv10", "C40"]);
    }

    /// A buffered receiver takes one sender's messages in the order they were sent, even
    /// when it uses them the other way round.
    #[test]
    fn buffered_receives_keep_the_senders_order() {
        let actors = vec![
            (
                1,
                vec![compute(10, &[]), send(10), compute(11, &[]), send(11)],
            ),
            (
                2,
                vec![
                    OpSpec::Read { edge: 5 },
                    compute(20, &[5]),
                    recv(11),
                    compute(21, &[11]),
                    recv(10),
                    compute(22, &[10]),
                ],
            ),
        ];
        let mut p = plan(actors, SendCompletion::Buffered);
        order_receives(&mut p);
        assert_eq!(
            short(&p.actors[1].ops),
            ["R5", "C20", "recv10", "recv11", "C21", "C22"]
        );
    }
}
