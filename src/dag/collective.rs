//! Collective nodes: `allreduce`, `allgather` and `reducescatter` over tensors that several
//! actors hold (Ray's `ray.experimental.collective`).
//!
//! Each function takes one tensor node per distinct actor and returns one output node per
//! input, on the input's actor. Every participating actor runs its part as one operation of
//! its schedule, in bind order, through a communicator group of exactly those actors: one
//! given with the `*_with` forms, else the compile options' default
//! ([`DefaultCommunicator`](crate::DefaultCommunicator)).
//!
//! Results follow the order of the inputs, whatever the group's rank order: `allgather`
//! concatenates the tensors along dimension 0 in input order, and `reducescatter` gives the
//! `i`-th input's actor the `i`-th of `n` equal parts of the reduction.
//!
//! ```
//! use adag::collective::allreduce;
//! use adag::{CompileOptions, Dag, MultiOutput, Placement, ReduceOp, Runtime, Tensor};
//!
//! struct Shard { k: f32 }
//! #[adag::actor]
//! impl Shard {
//!     fn new(k: f32) -> Self { Shard { k } }
//!     fn grad(&mut self, x: f32) -> Tensor { Tensor::from(vec![x * self.k; 4]) }
//! }
//!
//! let rt = Runtime::new()?;
//! let a = rt.spawn::<Shard>(Placement::Thread, 1.0)?;
//! let b = rt.spawn::<Shard>(Placement::Thread, 2.0)?;
//! let dag = Dag::<f32>::new();
//! let x = dag.input();
//! let sums = allreduce(&[a.grad(&x), b.grad(&x)], ReduceOp::Sum);
//! let graph = dag.compile(MultiOutput(sums), CompileOptions::default())?;
//! for r in graph.execute(1.0)? {
//!     assert_eq!(r.get()?.as_slice::<f32>()?, &[3.0; 4]);
//! }
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
use super::transport::CustomCommunicator;
use super::{DagInner, Node, NodeInner, NodeKind};
use crate::comm::ReduceOp;
use crate::tensor::Tensor;
use crate::value::TypeTag;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};

static NEXT_COLLECTIVE: AtomicU64 = AtomicU64::new(1);

/// Which collective a node runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum CollectiveKind {
    /// Element-wise reduction; every rank gets the whole result.
    AllReduce(ReduceOp),
    /// Concatenation along dimension 0; every rank gets the whole result.
    AllGather,
    /// Element-wise reduction, split along dimension 0: each rank gets its part.
    ReduceScatter(ReduceOp),
}

impl fmt::Display for CollectiveKind {
    /// Ray's method names: `allreduce.sum`, `allgather`, `reducescatter.max`...
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CollectiveKind::AllReduce(op) => write!(f, "allreduce.{op}"),
            CollectiveKind::AllGather => f.write_str("allgather"),
            CollectiveKind::ReduceScatter(op) => write!(f, "reducescatter.{op}"),
        }
    }
}

/// One collective operation as bound: its inputs, its outputs (one per input) and its
/// communicator.
pub(crate) struct CollectiveGroup {
    /// Unique across graphs; every participant's operation names it.
    pub id: u64,
    pub kind: CollectiveKind,
    pub inputs: Vec<Arc<NodeInner>>,
    /// The output nodes, in input order (weak: the outputs point at the group).
    pub outputs: Mutex<Vec<Weak<NodeInner>>>,
    pub comm: Option<CustomCommunicator>,
    /// A problem found when binding, reported by `compile` naming the node.
    pub error: Option<String>,
}

impl CollectiveGroup {
    /// The actors' names in input order, for messages.
    pub(crate) fn actor_names(&self) -> Vec<String> {
        self.inputs
            .iter()
            .map(|n| {
                n.actor()
                    .map_or_else(|| n.describe(), |a| a.name().to_string())
            })
            .collect()
    }
}

#[track_caller]
fn bind(
    inputs: &[Node<Tensor>],
    kind: CollectiveKind,
    comm: Option<CustomCommunicator>,
) -> Vec<Node<Tensor>> {
    // With no input there is no node to carry the problem to `compile` (nor a graph to
    // report it in), and the empty result would be dropped silently: fail here, at the
    // caller's line (Ray's "Expected non-empty input list").
    assert!(
        !inputs.is_empty(),
        "{kind}: no input nodes were given; a collective takes one tensor node per participating actor, so pass at least one"
    );
    let inputs: Vec<Arc<NodeInner>> = inputs.iter().map(|n| n.inner.clone()).collect();
    let mut error = None;
    let mut dag: Option<Arc<DagInner>> = None;
    let mut foreign = None;
    for (i, n) in inputs.iter().enumerate() {
        if inputs[..i].iter().any(|m| Arc::ptr_eq(m, n)) {
            error.get_or_insert(format!(
                "input node {} is given twice; a collective takes one tensor node per actor",
                n.describe()
            ));
        }
        match n.actor() {
            None => {
                error.get_or_insert(format!(
                    "input {} is not computed by an actor (the driver cannot take part in a collective); pass nodes returned by actor methods",
                    n.describe()
                ));
            }
            Some(a) => {
                if let Some(m) = inputs[..i]
                    .iter()
                    .find(|m| m.actor().is_some_and(|b| b.same(a)))
                {
                    error.get_or_insert(format!(
                        "inputs {} and {} are on the same actor {}; a collective takes one input per distinct actor",
                        m.describe(),
                        n.describe(),
                        a.name()
                    ));
                }
            }
        }
        match (&dag, &n.dag) {
            (None, Some(d)) => dag = Some(d.clone()),
            (Some(a), Some(b)) if a.id != b.id => foreign = Some(b.id),
            _ => {}
        }
        foreign = foreign.or(n.foreign);
    }
    if let Some(c) = &comm {
        let mismatch = c.actors.len() != inputs.len()
            || inputs
                .iter()
                .any(|n| n.actor().is_none_or(|a| c.rank_of(a).is_none()));
        if mismatch {
            let theirs: Vec<&str> = c.actors.iter().map(|a| a.name()).collect();
            let ours: Vec<String> = inputs
                .iter()
                .map(|n| {
                    n.actor()
                        .map_or_else(|| n.describe(), |a| a.name().to_string())
                })
                .collect();
            error.get_or_insert(format!(
                "the passed-in communicator must have the same set of actors as the collective operation: the communicator has actors {theirs:?} while the collective has {ours:?}"
            ));
        }
    }
    let group = Arc::new(CollectiveGroup {
        id: NEXT_COLLECTIVE.fetch_add(1, Ordering::Relaxed),
        kind,
        inputs: inputs.clone(),
        outputs: Mutex::new(Vec::new()),
        comm,
        error,
    });
    let outputs: Vec<Node<Tensor>> = inputs
        .iter()
        .enumerate()
        .map(|(index, input)| {
            Node::from_inner(NodeInner::with_foreign(
                dag.clone(),
                foreign,
                NodeKind::Collective {
                    input: input.clone(),
                    group: group.clone(),
                    index,
                },
                TypeTag::of::<Tensor>(),
                None,
            ))
        })
        .collect();
    *group.outputs.lock() = outputs.iter().map(|n| Arc::downgrade(&n.inner)).collect();
    outputs
}

/// Reduce the tensors of `inputs` (one node per distinct actor) element-wise with `op`; each
/// actor gets the whole result, as the output node at its input's position. The communicator
/// is the compile options' default.
///
/// # Panics
///
/// When `inputs` is empty (so are the `_with` forms and the other collectives): there is no
/// graph to report it in, and an empty collective is always a mistake.
#[must_use = "the collective runs only if each of its outputs is used by a task or is an output"]
#[track_caller]
pub fn allreduce(inputs: &[Node<Tensor>], op: ReduceOp) -> Vec<Node<Tensor>> {
    bind(inputs, CollectiveKind::AllReduce(op), None)
}

/// [`allreduce`] through this communicator, whose actors must be exactly those of `inputs`.
#[must_use = "the collective runs only if each of its outputs is used by a task or is an output"]
#[track_caller]
pub fn allreduce_with(
    inputs: &[Node<Tensor>],
    op: ReduceOp,
    comm: CustomCommunicator,
) -> Vec<Node<Tensor>> {
    bind(inputs, CollectiveKind::AllReduce(op), Some(comm))
}

/// Concatenate the tensors of `inputs` along dimension 0 in input order (a 0-dimensional
/// tensor counts as one element); each actor gets the whole result.
#[must_use = "the collective runs only if each of its outputs is used by a task or is an output"]
#[track_caller]
pub fn allgather(inputs: &[Node<Tensor>]) -> Vec<Node<Tensor>> {
    bind(inputs, CollectiveKind::AllGather, None)
}

/// [`allgather`] through this communicator.
#[must_use = "the collective runs only if each of its outputs is used by a task or is an output"]
#[track_caller]
pub fn allgather_with(inputs: &[Node<Tensor>], comm: CustomCommunicator) -> Vec<Node<Tensor>> {
    bind(inputs, CollectiveKind::AllGather, Some(comm))
}

/// Reduce the tensors of `inputs` with `op` and give the `i`-th input's actor the `i`-th of
/// `n` equal parts along dimension 0 (which must divide by `n`).
#[must_use = "the collective runs only if each of its outputs is used by a task or is an output"]
#[track_caller]
pub fn reducescatter(inputs: &[Node<Tensor>], op: ReduceOp) -> Vec<Node<Tensor>> {
    bind(inputs, CollectiveKind::ReduceScatter(op), None)
}

/// [`reducescatter`] through this communicator.
#[must_use = "the collective runs only if each of its outputs is used by a task or is an output"]
#[track_caller]
pub fn reducescatter_with(
    inputs: &[Node<Tensor>],
    op: ReduceOp,
    comm: CustomCommunicator,
) -> Vec<Node<Tensor>> {
    bind(inputs, CollectiveKind::ReduceScatter(op), Some(comm))
}
