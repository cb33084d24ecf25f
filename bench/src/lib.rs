//! Shared pieces of adag's benchmarks: the actors every workload uses and the graphs built
//! from them, for the `adag-bench` binary and the criterion benches alike.
//!
//! The actor types live in this library; every executable that spawns them as process actors
//! links them in (the workers are the same executable re-started in worker mode).

use adag::{ActorHandle, Buffer, CompileOptions, CompiledGraph, Dag, Node, Placement, Runtime};

/// A stage that adds a constant: echo is `Stage(0)`, chains check the sum.
pub struct Stage {
    k: u64,
}

#[adag::actor]
impl Stage {
    /// A stage adding `k`.
    pub fn new(k: u64) -> Self {
        Stage { k }
    }

    /// `x + k`.
    pub fn add(&mut self, x: u64) -> u64 {
        x.wrapping_add(self.k)
    }

    /// Return the payload unchanged (read in place from shared memory, written once).
    pub fn echo_bytes(&mut self, p: Buffer) -> Buffer {
        p
    }
}

/// A graph with one input of type `u64` and one `u64` output.
pub type U64Graph = CompiledGraph<u64, Node<u64>>;
/// The fan-out graph: four outputs.
pub type FanoutGraph = CompiledGraph<u64, Vec<Node<u64>>>;

/// Spawn `n` stages adding 1 each.
pub fn spawn_stages(
    rt: &Runtime,
    placement: Placement,
    n: usize,
) -> adag::Result<Vec<ActorHandle<Stage>>> {
    (0..n).map(|_| rt.spawn::<Stage>(placement, 1)).collect()
}

/// `input → s[0].add → s[1].add → ... → output` (one stage: one-actor echo plus one).
pub fn chain(stages: &[ActorHandle<Stage>], opts: CompileOptions) -> adag::Result<U64Graph> {
    let dag = Dag::<u64>::new();
    let mut node: Node<u64> = stages[0].add(dag.input());
    for s in &stages[1..] {
        node = s.add(&node);
    }
    dag.compile(node, opts)
}

/// The input read by every stage, the stages' results as a multi-output node.
pub fn fanout(stages: &[ActorHandle<Stage>], opts: CompileOptions) -> adag::Result<FanoutGraph> {
    let dag = Dag::<u64>::new();
    let input = dag.input();
    let outs: Vec<Node<u64>> = stages.iter().map(|s| s.add(&input)).collect();
    dag.compile(outs, opts)
}

/// `input → s.echo_bytes → output`.
pub fn payload_echo(
    stage: &ActorHandle<Stage>,
    opts: CompileOptions,
) -> adag::Result<CompiledGraph<Buffer, Node<Buffer>>> {
    let dag = Dag::<Buffer>::new();
    let out = stage.echo_bytes(dag.input());
    dag.compile(out, opts)
}
