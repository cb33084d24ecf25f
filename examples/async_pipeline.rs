//! Async execution: a graph compiled with `enable_asyncio`, driven from many tokio tasks.
//!
//! Run: `cargo run --release --example async_pipeline`
use adag::{CompileOptions, Dag, Placement, Runtime};
use std::sync::Arc;
use std::time::Instant;

/// Doubles its input in an async method, run on the actor's own runtime.
#[derive(Default)]
pub struct Doubler;

#[adag::actor]
impl Doubler {
    pub async fn double(&mut self, x: u64) -> u64 {
        tokio::task::yield_now().await;
        2 * x
    }
}

fn main() -> anyhow::Result<()> {
    let rt = Runtime::new()?;
    let a = rt.spawn::<Doubler>(Placement::Process, ())?;
    let b = rt.spawn::<Doubler>(Placement::Process, ())?;
    let dag = Dag::<u64>::new();
    let out = b.double(a.double(dag.input()));
    // Compiled outside any runtime; awaited inside one later.
    let graph = Arc::new(
        dag.compile(
            out,
            CompileOptions::default()
                .enable_asyncio(true)
                .max_inflight_executions(64),
        )?,
    );
    let tokio_rt = tokio::runtime::Runtime::new()?;
    tokio_rt.block_on(async {
        let t = Instant::now();
        let mut tasks = Vec::new();
        for task in 0..8u64 {
            let graph = graph.clone();
            tasks.push(tokio::spawn(async move {
                for i in 0..1000u64 {
                    let x = task * 1_000_000 + i;
                    let r = graph.execute_async(x).await?;
                    assert_eq!(r.await?, 4 * x);
                }
                Ok::<_, adag::Error>(())
            }));
        }
        for t in tasks {
            t.await??;
        }
        println!("8 tasks x 1000 async executions in {:?}", t.elapsed());
        Ok::<_, anyhow::Error>(())
    })?;
    graph.teardown()?;
    Ok(())
}
