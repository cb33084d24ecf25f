//! Compilation: validate a graph, plan one channel per edge and one schedule per actor.
use crate::dag::{ActorRef, ArgInner, DagInner, InputKind, NodeInner, NodeKind};
use crate::error::{CompileProblem, Error, Result};
use plan::{
    ActorPlan, ArgSource, ChannelKind, ChannelPlan, EdgePlan, GraphPlan, Loc, OpSpec, Place, Stage,
};
use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::sync::Arc;

pub(crate) mod comms;
mod options;
mod order;
pub(crate) mod plan;
pub(crate) mod schedule;
pub(crate) use options::deadline_after;
pub use options::{CompileOptions, DefaultCommunicator};

/// A validated graph with its plan.
pub(crate) struct Planned {
    pub plan: GraphPlan,
    /// Every reached node by id.
    pub nodes: BTreeMap<u64, Arc<NodeInner>>,
    /// The distinct actors, in the order of their first task.
    pub actors: Vec<ActorRef>,
    /// The communicator groups and who uses them.
    pub comm: comms::CommPlan,
}

/// Where a node's value is written: by its actor, or by the driver for input nodes.
pub(crate) fn loc_of(node: &NodeInner) -> Loc {
    node.actor().map_or(Loc::Driver, |a| Loc::Actor(a.id()))
}

/// Validate the graph reached from `outputs` and plan it. Plain data in, plain data out:
/// nothing is spawned, claimed or opened.
pub(crate) fn plan(
    dag: &Arc<DagInner>,
    outputs: &[Arc<NodeInner>],
    opts: &CompileOptions,
    graph: u64,
) -> Result<Planned> {
    opts.validate()?;
    // Checked first: while it runs, the first graph's nodes would otherwise be reported as
    // unused, or its actors as busy, which hides the cause.
    if let Some(live) = dag.live_compiled() {
        return Err(Error::compile(
            "outputs",
            format!(
                "this Dag (#{}) is already compiled: compiled graph #{live} was compiled from it and is still live; tear graph #{live} down first (CompiledGraph::teardown, or drop it), or build the second graph on a new Dag",
                dag.id
            ),
        ));
    }
    if outputs.is_empty() {
        return Err(Error::compile(
            "outputs",
            "no output was given; pass a node, a tuple or a Vec of nodes",
        ));
    }
    // Every node reachable from the outputs.
    let mut nodes: BTreeMap<u64, Arc<NodeInner>> = BTreeMap::new();
    let mut stack: Vec<Arc<NodeInner>> = outputs.to_vec();
    while let Some(n) = stack.pop() {
        if nodes.contains_key(&n.id) {
            continue;
        }
        stack.extend(n.upstream().into_iter().cloned());
        nodes.insert(n.id, n);
    }
    // Every problem is collected, so that one compile reports them all: those of tasks
    // first, then those of input nodes (whose labels say less).
    let mut problems: Vec<CompileProblem> = Vec::new();
    let mut input_problems: Vec<CompileProblem> = Vec::new();
    let mut collectives_seen: HashSet<u64> = HashSet::new();
    for n in nodes.values() {
        let out = if matches!(n.kind, NodeKind::Input(_)) {
            &mut input_problems
        } else {
            &mut problems
        };
        check_node(dag, n, out);
        check_collective(n, &nodes, &mut collectives_seen, out);
    }
    let mut problem = |node: String, message: &str| {
        problems.push(CompileProblem {
            node,
            message: message.to_string(),
        })
    };
    if dag.input.lock().is_none() {
        problem(
            "input".into(),
            "the graph has no input node; call dag.input() and bind it to a task",
        );
    }
    for out in outputs {
        if let NodeKind::Input(_) = out.kind {
            problem(
                out.describe(),
                "an output is the graph's input itself, which no actor computes; pass it through an actor method",
            );
        }
    }
    if dag.input.lock().is_some() && !nodes.values().any(|n| matches!(n.kind, NodeKind::Input(_))) {
        problem(
            "input".into(),
            "the input node is not used by any task; bind it (or its parts) to a task",
        );
    }
    // Nodes created in this graph that no output depends on (Ray's leaf nodes).
    let created: Vec<Arc<NodeInner>> = dag
        .nodes
        .lock()
        .iter()
        .filter_map(|w| w.upgrade())
        .collect();
    for n in created {
        if nodes.contains_key(&n.id) {
            continue;
        }
        match &n.kind {
            NodeKind::Input(InputKind::Whole) => {}
            NodeKind::Input(_) => problem(
                n.describe(),
                "this input part is never used; bind it to a task, or drop it before compiling",
            ),
            _ => problem(
                n.describe(),
                "no output depends on this node; add it to the outputs (a tuple or Vec of nodes), or drop it before compiling",
            ),
        }
    }
    problems.append(&mut input_problems);
    if !problems.is_empty() {
        return Err(Error::compile_all(problems));
    }
    let mut actors: Vec<ActorRef> = Vec::new();
    for n in nodes.values() {
        if let NodeKind::Method { actor, .. } = &n.kind
            && !actors.iter().any(|a| a.same(actor))
        {
            actors.push(actor.clone());
        }
    }
    let (plan, comm) = build_plan(&nodes, outputs, opts, graph)?;
    Ok(Planned {
        plan,
        nodes,
        actors,
        comm,
    })
}

/// A collective runs only if every actor takes part: each of its outputs must be part of the
/// graph.
fn check_collective(
    n: &Arc<NodeInner>,
    nodes: &BTreeMap<u64, Arc<NodeInner>>,
    seen: &mut HashSet<u64>,
    problems: &mut Vec<CompileProblem>,
) {
    let NodeKind::Collective { group, .. } = &n.kind else {
        return;
    };
    // A collective's problems are its group's: reported once, at its first output.
    if !seen.insert(group.id) {
        return;
    }
    if let Some(e) = &group.error {
        problems.push(CompileProblem {
            node: n.describe(),
            message: e.clone(),
        });
        return;
    }
    let names = group.actor_names();
    for (i, out) in group.outputs.lock().iter().enumerate() {
        let reached = out.upgrade().is_some_and(|o| nodes.contains_key(&o.id));
        if !reached {
            problems.push(CompileProblem {
                node: n.describe(),
                message: format!(
                    "the output of this collective on actor {} (input {i}) is not used by the graph, but every actor of a collective must take part; use each of its outputs (as an output of the graph or an argument of a task)",
                    names.get(i).cloned().unwrap_or_default()
                ),
            });
        }
    }
}

fn check_node(dag: &Arc<DagInner>, n: &Arc<NodeInner>, problems: &mut Vec<CompileProblem>) {
    let mut problem = |message: String| {
        problems.push(CompileProblem {
            node: label(n, dag),
            message,
        })
    };
    if let NodeKind::Method {
        actor,
        method,
        args,
    } = &n.kind
    {
        if !args.iter().any(|a| matches!(a.0, ArgInner::Node(_))) {
            problem(
                "this task does not depend on the graph's input; bind at least one argument to the input or to a node that reads it".into(),
            );
        }
        match actor.signature(method) {
            None => problem(format!(
                "actor {} has no method `{method}`; its methods are: {}",
                actor.name(),
                actor.method_names().join(", ")
            )),
            Some(sig) if sig.args.len() != args.len() => problem(format!(
                "`{method}` takes {} arguments but {} were bound",
                sig.args.len(),
                args.len()
            )),
            Some(sig) => {
                for (i, (want, arg)) in sig.args.iter().zip(args).enumerate() {
                    let have = arg.type_tag();
                    if *want != have {
                        let from = match &arg.0 {
                            ArgInner::Node(up) => format!("node {}", label(up, dag)),
                            ArgInner::Const(_) => "a constant".to_string(),
                        };
                        let name = sig.names.get(i).copied().unwrap_or("?");
                        problem(format!(
                            "argument {i} (`{name}`) of `{method}` has type {} but {from} gives {}; bind a value of the right type",
                            want.name(),
                            have.name()
                        ));
                    }
                }
                if sig.ret != n.ty {
                    problem(format!(
                        "`{method}` returns {} but the node was typed {}",
                        sig.ret.name(),
                        n.ty.name()
                    ));
                }
            }
        }
        for a in args {
            if let ArgInner::Const(c) = &a.0
                && let Err(e) = &c.bytes
            {
                problem(format!("a constant argument cannot be encoded: {e}"));
            }
        }
    }
    if let Some(other) = n.foreign {
        problem(format!(
            "this node mixes nodes of graph #{} and graph #{other}; build each graph from its own input",
            dag.id
        ));
        return;
    }
    match &n.dag {
        Some(d) if d.id == dag.id => {}
        Some(d) => problem(format!(
            "this node belongs to graph #{}, not to graph #{} being compiled; compile it with its own Dag",
            d.id, dag.id
        )),
        None => problem("this node belongs to no graph".into()),
    }
}

/// A node's label in compile errors: `actor.method#id`, and for an input node of another
/// graph, which graph (`input of graph #3`), since every graph's input is called `input`.
fn label(n: &NodeInner, dag: &DagInner) -> String {
    match (&n.kind, &n.dag) {
        (NodeKind::Input(_), Some(d)) if d.id != dag.id => {
            format!("{} of graph #{}", n.describe(), d.id)
        }
        _ => n.describe(),
    }
}

fn place_of(loc: Loc, actors: &BTreeMap<u64, ActorRef>) -> Place {
    match loc {
        Loc::Driver => Place {
            host: 0,
            process: 0,
        },
        Loc::Actor(id) => actors.get(&id).map_or(
            Place {
                host: 0,
                process: 0,
            },
            |a| Place {
                host: a.host(),
                process: a.process(),
            },
        ),
    }
}

/// The id of the next network channel of a graph: apart from node ids (which the channels of
/// the other kinds take), since an edge has one network channel per reading host.
const NETWORK_CHANNEL_IDS: u64 = 1 << 48;

fn build_plan(
    nodes: &BTreeMap<u64, Arc<NodeInner>>,
    outputs: &[Arc<NodeInner>],
    opts: &CompileOptions,
    graph: u64,
) -> Result<(GraphPlan, comms::CommPlan)> {
    let depth = opts.max_inflight_executions;
    let actors: BTreeMap<u64, ActorRef> = nodes
        .values()
        .filter_map(|n| n.actor().map(|a| (a.id(), a.clone())))
        .collect();
    // Readers of each edge.
    let mut readers: BTreeMap<u64, BTreeSet<Loc>> =
        nodes.keys().map(|id| (*id, BTreeSet::new())).collect();
    for n in nodes.values() {
        for up in n.upstream() {
            readers.entry(up.id).or_default().insert(loc_of(n));
        }
    }
    for out in outputs {
        readers.entry(out.id).or_default().insert(Loc::Driver);
    }
    let mut comm = comms::resolve(nodes, &readers, &actors, &opts.default_communicator)?;
    for g in &mut comm.groups {
        if !g.actors.iter().any(|a| a.host() != 0) {
            continue;
        }
        // The shared-memory backend reaches the ranks of one host: a group the graph makes
        // that spans hosts talks over TCP instead. Other factories' tickets travel to the
        // hosts as they are (NCCL's unique id forms one communicator across nodes); a group
        // whose ranks cannot be opened on another host says so when the graph starts.
        if let comms::GroupSource::Create { transport } = &mut g.source
            && transport == crate::comm::cpu::TRANSPORT
        {
            *transport = crate::comm::tcp::TRANSPORT.into();
            g.sends = crate::comm::SendCompletion::Rendezvous;
        }
    }
    let mut edges = BTreeMap::new();
    let mut next_network = NETWORK_CHANNEL_IDS;
    for (id, n) in nodes {
        let writer = loc_of(n);
        let wplace = place_of(writer, &actors);
        let mut channels: Vec<ChannelPlan> = Vec::new();
        let mut same_actor = false;
        for r in &readers[id] {
            if *r == writer {
                same_actor = true;
                continue;
            }
            let rplace = place_of(*r, &actors);
            let kind = ChannelKind::between(wplace, rplace);
            match channels
                .iter_mut()
                .find(|c| c.kind == kind && c.host == rplace.host)
            {
                Some(c) => c.readers.push(*r),
                None => channels.push(ChannelPlan {
                    id: if kind == ChannelKind::Network {
                        next_network += 1;
                        next_network
                    } else {
                        *id
                    },
                    kind,
                    readers: vec![*r],
                    host: rplace.host,
                }),
            }
        }
        edges.insert(
            *id,
            EdgePlan {
                id: *id,
                label: n.describe(),
                ty: n.ty.name().to_string(),
                writer,
                same_actor,
                channels,
            },
        );
    }
    // One schedule per actor, in bind order.
    let mut schedules: BTreeMap<u64, (String, Vec<OpSpec>, HashSet<u64>)> = BTreeMap::new();
    for (id, n) in nodes {
        let Some(actor) = n.actor() else { continue };
        let me = Loc::Actor(actor.id());
        let (_, ops, read) = schedules
            .entry(actor.id())
            .or_insert_with(|| (actor.name().to_string(), Vec::new(), HashSet::new()));
        for up in n.upstream() {
            if edges[&up.id].writer != me && read.insert(up.id) {
                ops.push(match comm.edges.get(&up.id) {
                    Some(c) => OpSpec::Recv {
                        edge: up.id,
                        group: c.group,
                        peer: c.writer_rank,
                        stage: Stage::Inline,
                    },
                    None => OpSpec::Read { edge: up.id },
                });
            }
        }
        match &n.kind {
            NodeKind::Method { method, args, .. } => ops.push(OpSpec::Compute {
                node: *id,
                method: method.clone(),
                label: n.label.lock().clone(),
                args: args
                    .iter()
                    .map(|a| match &a.0 {
                        ArgInner::Node(up) => ArgSource::Edge(up.id),
                        ArgInner::Const(c) => {
                            ArgSource::Const(c.bytes.as_deref().unwrap_or_default().to_vec())
                        }
                    })
                    .collect(),
            }),
            NodeKind::Split { source, index } => {
                let NodeKind::Method { method, .. } = &source.kind else {
                    return Err(Error::compile(
                        n.describe(),
                        "only the result of a method can be split",
                    ));
                };
                ops.push(OpSpec::Split {
                    node: *id,
                    source: source.id,
                    method: method.clone(),
                    index: *index,
                })
            }
            NodeKind::Collective {
                input,
                group,
                index,
            } => {
                let c = comm.collectives.get(&group.id).ok_or_else(|| {
                    Error::compile(
                        n.describe(),
                        "this collective has no communicator group (a bug)",
                    )
                })?;
                ops.push(OpSpec::Collective {
                    node: *id,
                    input: input.id,
                    coll: group.id,
                    kind: group.kind,
                    group: c.group,
                    order: c.order.clone(),
                    index: *index,
                    stage: Stage::Inline,
                })
            }
            NodeKind::Input(_) => {}
        }
        if edges[id].has_channel() {
            ops.push(match comm.edges.get(id) {
                Some(c) => OpSpec::Send {
                    edge: *id,
                    group: c.group,
                    peers: c.readers.iter().map(|r| r.1).collect(),
                    stage: Stage::Inline,
                },
                None => OpSpec::Write { edge: *id },
            });
        }
    }
    let inputs = nodes
        .values()
        .filter(|n| matches!(n.kind, NodeKind::Input(_)))
        .map(|n| n.id)
        .collect();
    let mut plan = GraphPlan {
        graph,
        depth,
        edges,
        actors: schedules
            .into_iter()
            .map(|(actor, (name, ops, _))| ActorPlan { actor, name, ops })
            .collect(),
        inputs,
        outputs: outputs.iter().map(|o| o.id).collect(),
        comm_groups: comm.groups.iter().map(|g| g.sends).collect(),
        hosts: actors
            .values()
            .filter(|a| a.host() != 0)
            .map(|a| (a.id(), a.host()))
            .collect(),
    };
    schedule::finish(&mut plan, opts.overlap_gpu_communication)?;
    Ok((plan, comm))
}
