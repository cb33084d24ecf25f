//! Data-parallel training step: N workers (processes) each compute a gradient on their own
//! shard of a batch, allreduce the gradients (average) through a communicator group made by
//! the compiler, and apply the same update to their copy of the model. Every worker ends
//! with identical weights, and the loss goes down.
//!
//! Run: `cargo run --release --example allreduce`
use adag::collective::allreduce;
use adag::{CompileOptions, Dag, MultiOutput, Placement, ReduceOp, Runtime, Tensor};

const DIM: usize = 8;

/// Linear regression `y = w . x` on a private shard of data.
pub struct Trainer {
    w: Vec<f32>,
    xs: Vec<[f32; DIM]>,
    ys: Vec<f32>,
    lr: f32,
}

fn truth(i: usize) -> f32 {
    (i as f32 + 1.0) * 0.5
}

#[adag::actor]
impl Trainer {
    pub fn new(rank: u32, lr: f32) -> Self {
        // Each worker's shard: deterministic pseudo-random inputs, targets from the true w.
        let mut seed = 0x9e37_79b9u32.wrapping_mul(rank + 1);
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 17;
            seed ^= seed << 5;
            (seed % 2000) as f32 / 1000.0 - 1.0
        };
        let xs: Vec<[f32; DIM]> = (0..64).map(|_| std::array::from_fn(|_| next())).collect();
        let ys = xs
            .iter()
            .map(|x| x.iter().enumerate().map(|(i, v)| v * truth(i)).sum())
            .collect();
        Trainer {
            w: vec![0.0; DIM],
            xs,
            ys,
            lr,
        }
    }

    /// The gradient of the mean squared error on this shard (the step number is the input).
    pub fn grad(&mut self, _step: u32) -> Tensor {
        let mut g = vec![0.0f32; DIM];
        for (x, y) in self.xs.iter().zip(&self.ys) {
            let err: f32 = x.iter().zip(&self.w).map(|(a, b)| a * b).sum::<f32>() - y;
            for (gi, xi) in g.iter_mut().zip(x) {
                *gi += 2.0 * err * xi / self.xs.len() as f32;
            }
        }
        Tensor::from(g)
    }

    /// Apply the averaged gradient; returns this shard's loss after the step and the weights'
    /// checksum (equal on every worker).
    pub fn apply(&mut self, g: Tensor) -> (f32, f32) {
        for (w, g) in self
            .w
            .iter_mut()
            .zip(g.as_slice::<f32>().expect("f32 gradient"))
        {
            *w -= self.lr * g;
        }
        let loss = self
            .xs
            .iter()
            .zip(&self.ys)
            .map(|(x, y)| (x.iter().zip(&self.w).map(|(a, b)| a * b).sum::<f32>() - y).powi(2))
            .sum::<f32>()
            / self.xs.len() as f32;
        (loss, self.w.iter().sum())
    }

    pub fn weights(&self) -> Vec<f32> {
        self.w.clone()
    }
}

fn main() -> anyhow::Result<()> {
    adag::init();
    let rt = Runtime::new()?;
    let n = 4;
    let workers = (0..n)
        .map(|r| rt.spawn_named::<Trainer>(Placement::Process, format!("worker{r}"), (r, 0.1)))
        .collect::<Result<Vec<_>, _>>()?;
    let dag = Dag::<u32>::new();
    let step = dag.input();
    let grads: Vec<_> = workers.iter().map(|w| w.grad(&step)).collect();
    let averaged = allreduce(&grads, ReduceOp::Average);
    let applied: Vec<_> = workers
        .iter()
        .zip(&averaged)
        .map(|(w, g)| w.apply(g))
        .collect();
    let graph = dag.compile(MultiOutput(applied), CompileOptions::default())?;
    for c in graph.communicators() {
        println!(
            "communicator group {} ({}): ranks {:?}, used by {:?}",
            c.id, c.transport, c.actors, c.users
        );
    }
    let start = std::time::Instant::now();
    let mut first = None;
    let mut last = 0.0;
    for s in 0..200u32 {
        let out: Vec<(f32, f32)> = graph
            .execute(s)?
            .into_iter()
            .map(|r| r.get())
            .collect::<Result<_, _>>()?;
        let checksum = out[0].1;
        assert!(
            out.iter().all(|o| o.1 == checksum),
            "every worker holds the same weights"
        );
        let loss = out.iter().map(|o| o.0).sum::<f32>() / n as f32;
        first.get_or_insert(loss);
        last = loss;
        if s % 50 == 0 {
            println!("step {s:3}: mean loss {loss:.5}");
        }
    }
    println!(
        "200 steps of {n} workers in {:?}; loss {:.5} -> {last:.6}",
        start.elapsed(),
        first.unwrap_or_default()
    );
    graph.teardown()?;
    let w = workers[0].call().weights()?;
    println!(
        "learned w = {w:.3?} (true w = {:?})",
        (0..DIM).map(truth).collect::<Vec<_>>()
    );
    assert!(
        last < first.unwrap_or_default() / 100.0,
        "the loss went down"
    );
    Ok(())
}
