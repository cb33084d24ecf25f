//! Fan-out to four actors, a multi-output node, split tuple results, input parts and
//! by-name binding, with the graph printed as DOT.
//!
//! Run: `cargo run --release --example multi_output`
use adag::{CompileOptions, Dag, ErasedArg, MultiOutput, Placement, Runtime};

/// A shard of a model: scores an input against its own weight.
pub struct Shard {
    weight: f64,
}

#[adag::actor]
impl Shard {
    pub fn new(weight: f64) -> Self {
        Shard { weight }
    }

    pub fn score(&mut self, x: f64) -> f64 {
        x * self.weight
    }

    pub fn stats(&mut self, x: f64, label: String) -> (f64, String) {
        (x + self.weight, format!("{label}:{}", self.weight))
    }
}

fn main() -> anyhow::Result<()> {
    let rt = Runtime::new()?;
    let shards: Vec<_> = (1..=4)
        .map(|w| rt.spawn::<Shard>(Placement::Process, w as f64))
        .collect::<Result<_, _>>()?;

    // Fan-out to four actors, read back as one multi-output node.
    let dag = Dag::<f64>::new();
    let x = dag.input();
    let outs = MultiOutput(shards.iter().map(|s| s.score(&x)).collect());
    let graph = dag.compile(outs, CompileOptions::default())?;
    let values = adag::get_all(graph.execute(10.0)?)?;
    println!("fan-out to 4: {values:?}");
    graph.teardown()?;

    // Input parts, a tuple result split into two nodes, and a by-name binding.
    let dag = Dag::<(f64, String)>::new();
    let input = dag.input();
    let (sum, label) = shards[0].stats(input.arg::<0>(), input.arg::<1>()).split();
    let scaled = shards[1]
        .method("score")?
        .bind([ErasedArg::from(sum.erase())])
        .typed::<f64>()
        .expect("score returns f64");
    let graph = dag.compile((scaled, label), CompileOptions::default())?;
    println!("{}", graph.visualize());
    let (a, b) = adag::get_all(graph.execute((1.0, "run".to_string()))?)?;
    println!("split + by-name: scaled = {a}, label = {b}");
    Ok(())
}
