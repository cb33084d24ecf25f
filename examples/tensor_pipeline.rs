//! A two-stage pipeline passing tensors between worker processes: stage 1 computes an
//! activation, stage 2 a reduction of it. The same graph runs three ways: the tensor over
//! shared memory, over a communicator (shape and dtype on the ordinary channel, the data
//! through the CPU communicator, as NCCL would move it between GPUs), and over a
//! communicator with `overlap_gpu_communication`, where stage 2 receives the next tensor on
//! its communication thread while it computes.
//!
//! Run: `cargo run --release --example tensor_pipeline`
use adag::{CompileOptions, Dag, Placement, Runtime, Tensor, Transport};
use std::time::Instant;

/// One stage of the pipeline.
pub struct Stage {
    weight: f32,
}

#[adag::actor]
impl Stage {
    pub fn new(weight: f32) -> Self {
        Stage { weight }
    }

    /// A `rows x 256` activation: `weight * (x + column)`, then a ReLU of `sin`.
    pub fn forward(&mut self, x: u32, rows: u32) -> Tensor {
        let data: Vec<f32> = (0..rows * 256)
            .map(|i| (self.weight * (x as f32 + (i % 256) as f32)).sin().max(0.0))
            .collect();
        Tensor::from_vec(data, [rows as usize, 256]).expect("the shape matches the data")
    }

    /// The weighted sum of an activation.
    pub fn head(&mut self, t: Tensor) -> f64 {
        t.as_slice::<f32>()
            .expect("an f32 tensor")
            .iter()
            .map(|v| (*v * self.weight) as f64)
            .sum()
    }
}

fn main() -> anyhow::Result<()> {
    adag::init();
    let rt = Runtime::new()?;
    let s1 = rt.spawn_named::<Stage>(Placement::Process, "stage1", 0.01)?;
    let s2 = rt.spawn_named::<Stage>(Placement::Process, "stage2", 2.0)?;
    let n = 2_000u32;
    let mut reference = Vec::new();
    for (name, transport, overlap) in [
        ("shared memory", Transport::Shm, false),
        ("communicator", Transport::communicator(), false),
        ("communicator, overlapped", Transport::communicator(), true),
    ] {
        let dag = Dag::<u32>::new();
        let x = dag.input();
        let act = s1.forward(&x, 64).with_tensor_transport(transport);
        let out = s2.head(&act);
        let graph = dag.compile(
            out,
            CompileOptions::default().overlap_gpu_communication(overlap),
        )?;
        if name == "communicator" {
            println!("{}", graph.visualize());
        }
        let start = Instant::now();
        // Keep a few executions in flight: the stages work on different executions at once.
        let mut pending = std::collections::VecDeque::new();
        let mut results = Vec::new();
        for i in 0..n {
            if pending.len() == 8 {
                let r: adag::CompiledRef<f64> = pending.pop_front().expect("not empty");
                results.push(r.get()?);
            }
            pending.push_back(graph.execute(i)?);
        }
        for r in pending {
            results.push(r.get()?);
        }
        let took = start.elapsed();
        println!(
            "{name:>26}: {n} executions of a 64x256 f32 tensor in {took:?} ({:.1} us each); communicators: {:?}",
            took.as_secs_f64() * 1e6 / n as f64,
            graph
                .communicators()
                .iter()
                .map(|c| (&c.transport, &c.actors))
                .collect::<Vec<_>>()
        );
        if reference.is_empty() {
            reference = results;
        } else {
            assert_eq!(results, reference, "every transport gives the same results");
        }
        graph.teardown()?;
    }
    Ok(())
}
