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

    /// A new payload computed from the input (every byte XOR 0x5a), made on the heap: the
    /// plain way, copied into the output channel after the method.
    pub fn transform(&mut self, p: Buffer) -> Buffer {
        let mut out = vec![0u8; p.len()];
        xor_into(&mut out, &p);
        Buffer::from(out)
    }

    /// The same, made in the memory the output channel lends (`adag::output_buffer`): each
    /// byte written once, where the reader reads it.
    pub fn transform_lent(&mut self, p: Buffer) -> Buffer {
        let mut out = adag::output_buffer(p.len());
        xor_into(&mut out, &p);
        out.freeze()
    }
}

/// A data-parallel shard: holds a gradient of `n` f32 and hands it to an allreduce each step.
pub struct Shard {
    grad: adag::Tensor,
}

#[adag::actor]
impl Shard {
    /// A shard whose gradient is `n` values of `rank + 1`.
    pub fn new(rank: u32, n: u64) -> Self {
        Shard {
            grad: adag::Tensor::from(vec![rank as f32 + 1.0; n as usize]),
        }
    }

    /// The gradient of step `_step` (shared, not copied).
    pub fn grad(&mut self, _step: u64) -> adag::Tensor {
        self.grad.clone()
    }

    /// The first element of the reduced gradient (the check that it arrived).
    pub fn apply(&mut self, g: adag::Tensor) -> f32 {
        g.as_slice::<f32>().map_or(f32::NAN, |v| v[0])
    }
}

/// `out[i] = input[i] ^ 0x5a`, eight bytes at a time (the compiler vectorises it).
pub fn xor_into(out: &mut [u8], input: &[u8]) {
    const MASK: u64 = 0x5a5a_5a5a_5a5a_5a5a;
    let mut o = out.chunks_exact_mut(8);
    let mut i = input.chunks_exact(8);
    for (o, i) in (&mut o).zip(&mut i) {
        let v = u64::from_ne_bytes(i.try_into().expect("8 bytes")) ^ MASK;
        o.copy_from_slice(&v.to_ne_bytes());
    }
    for (o, i) in o.into_remainder().iter_mut().zip(i.remainder()) {
        *o = i ^ 0x5a;
    }
}

/// `input → s.transform → output` (`lent`: `s.transform_lent`).
pub fn payload_transform(
    stage: &ActorHandle<Stage>,
    lent: bool,
    opts: CompileOptions,
) -> adag::Result<CompiledGraph<Buffer, Node<Buffer>>> {
    let dag = Dag::<Buffer>::new();
    let out = if lent {
        stage.transform_lent(dag.input())
    } else {
        stage.transform(dag.input())
    };
    dag.compile(out, opts)
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
