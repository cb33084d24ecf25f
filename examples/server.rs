//! A server-style async loop: requests arrive faster than the graph runs them; each one
//! waits for room with `execute_async_wait` (back-pressure without a semaphore of the
//! server's own), and a client that gives up (a timeout) takes no room. Then a batch job
//! runs through the same graph with the pipelining helper, 8 executions in flight.
//!
//! Run: `cargo run --release --example server`
use adag::{CompileOptions, Dag, Placement, Runtime};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A model stage: a little work per request.
#[derive(Default)]
pub struct Stage;

#[adag::actor]
impl Stage {
    pub fn embed(&mut self, x: u64) -> Vec<u64> {
        (0..64)
            .map(|i| x.wrapping_mul(31).wrapping_add(i))
            .collect()
    }

    pub fn score(&mut self, v: Vec<u64>) -> u64 {
        std::thread::sleep(Duration::from_micros(200));
        v.iter().fold(0u64, |a, b| a.wrapping_add(*b))
    }
}

fn expected(x: u64) -> u64 {
    (0..64u64).fold(0u64, |a, i| {
        a.wrapping_add(x.wrapping_mul(31).wrapping_add(i))
    })
}

fn main() -> anyhow::Result<()> {
    let rt = Runtime::new()?;
    let embed = rt.spawn::<Stage>(Placement::Process, ())?;
    let score = rt.spawn::<Stage>(Placement::Thread, ())?;
    let dag = Dag::<u64>::new();
    let out = score.score(embed.embed(dag.input()));
    let graph = Arc::new(
        dag.compile(
            out,
            CompileOptions::default()
                .enable_asyncio(true)
                .max_inflight_executions(8)
                .submit_timeout(Duration::from_secs(30)),
        )?,
    );
    let tokio_rt = tokio::runtime::Runtime::new()?;
    tokio_rt.block_on(async {
        // The server: 1000 requests at once from 1000 clients, 8 executions in flight.
        // Every third client gives up after 1 ms; its request is dropped while it waits or
        // while its result is pending, and frees whatever it held.
        let t = Instant::now();
        let mut clients = Vec::new();
        for x in 0..1000u64 {
            let graph = graph.clone();
            clients.push(tokio::spawn(async move {
                let request = async {
                    let r = graph.execute_async_wait(x).await?;
                    r.await
                };
                if x % 3 == 0 {
                    match tokio::time::timeout(Duration::from_millis(1), request).await {
                        Ok(v) => Ok(Some((x, v?))),
                        Err(_gave_up) => Ok(None),
                    }
                } else {
                    request.await.map(|v| Some((x, v)))
                }
            }));
        }
        let (mut served, mut gave_up) = (0, 0);
        for c in clients {
            match c.await?? {
                Some((x, v)) => {
                    assert_eq!(v, expected(x));
                    served += 1;
                }
                None => gave_up += 1,
            }
        }
        println!(
            "server: {served} requests served, {gave_up} clients gave up, in {:?}",
            t.elapsed()
        );

        // The batch job: every input in order, 8 in flight, through the same graph.
        let t = Instant::now();
        let mut results = graph.pipeline_async(0..2000u64, 8)?;
        let mut x = 0;
        while let Some(v) = results.next().await {
            assert_eq!(v?, expected(x));
            x += 1;
        }
        println!("batch: {x} inputs pipelined in {:?}", t.elapsed());
        Ok::<_, anyhow::Error>(())
    })?;
    graph.teardown()?;
    Ok(())
}
