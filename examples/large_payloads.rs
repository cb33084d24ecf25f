//! Large byte payloads between worker processes, read in place.
//!
//! The driver sends 32 MiB [`Buffer`]s through two process actors: `mask` flips every byte
//! and returns a new buffer, `digest` checksums it. Each buffer is copied once into a
//! channel's shared memory by its writer; readers get a `Buffer` that points into that
//! memory (no decode, no copy). `digest` also reports whether its input really lay in shared
//! memory, by looking its address up in its own `/proc/self/maps`.
//!
//! A payload is written once: a second graph's actor returns a slice of the buffer it read
//! (`header_off`), and that slice reaches the driver by reference to the input channel's
//! memory, not copied again; the driver then sends the result it got back as the next input,
//! which is not copied either (it already lies in that channel). Its first input is built in
//! memory the input channel lends (`CompiledGraph::input_buffer`), so that payload is written
//! exactly once, by the driver's own fill. The edge statistics show it: both edges carry a
//! few bytes per execution, not megabytes.
//!
//! Run: `cargo run --release --example large_payloads`
use adag::{Buffer, CompileOptions, Dag, Placement, Runtime};
use std::time::Instant;

const SIZE: usize = 32 << 20;

/// Whether `ptr` lies in one of adag's shared-memory channels mapped in this process.
fn in_shared_memory(ptr: *const u8) -> bool {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    maps.lines().any(|line| {
        let mut fields = line.split_whitespace();
        let range = fields.next().unwrap_or("");
        let path = fields.nth(4).unwrap_or("");
        let bounds = range.split_once('-').and_then(|(a, b)| {
            Some((
                usize::from_str_radix(a, 16).ok()?,
                usize::from_str_radix(b, 16).ok()?,
            ))
        });
        bounds.is_some_and(|(a, b)| (a..b).contains(&(ptr as usize)))
            && path.starts_with("/memfd:adag:")
    })
}

/// The two stages.
#[derive(Default)]
pub struct Stage;

#[adag::actor]
impl Stage {
    pub fn new() -> Self {
        Stage
    }

    /// Every byte inverted, as a new buffer.
    pub fn mask(&mut self, data: Buffer) -> Buffer {
        Buffer::from(data.iter().map(|b| !b).collect::<Vec<u8>>())
    }

    /// The bytes after a 64-byte header: a slice of the input, no copy.
    pub fn header_off(&mut self, data: Buffer) -> Buffer {
        data.slice(64..)
    }

    /// A checksum of the bytes, and whether they were read in place.
    pub fn digest(&mut self, data: Buffer) -> (u64, bool) {
        let sum = data.iter().map(|&b| u64::from(b)).sum();
        (sum, in_shared_memory(data.as_ptr()))
    }
}

fn main() -> anyhow::Result<()> {
    let rt = Runtime::new()?;
    let mask = rt.spawn::<Stage>(Placement::Process, ())?;
    let digest = rt.spawn::<Stage>(Placement::Process, ())?;

    let dag = Dag::<Buffer>::new();
    let out = digest.digest(mask.mask(dag.input()));
    // Slots sized for the payload (plus the frame's 64-byte header); two in flight.
    let opts = CompileOptions::default()
        .buffer_size_bytes(SIZE + 64)
        .max_inflight_executions(2);
    let graph = dag.compile(out, opts)?;

    let input = Buffer::from((0..SIZE).map(|i| (i % 251) as u8).collect::<Vec<u8>>());
    let expected: u64 = input.iter().map(|&b| u64::from(255 - b)).sum();
    let runs = 20;
    let start = Instant::now();
    for _ in 0..runs {
        let (sum, in_place) = graph.execute(input.clone())?.get()?;
        anyhow::ensure!(sum == expected, "checksum {sum}, expected {expected}");
        anyhow::ensure!(in_place, "the digest stage got a copy");
    }
    let elapsed = start.elapsed();
    let per_run = elapsed / runs;
    println!(
        "{runs} × {} MiB through two worker processes: {per_run:.2?} per execution, \
         {:.2} GB/s of payload (read in place by both stages)",
        SIZE >> 20,
        SIZE as f64 / per_run.as_secs_f64() / 1e9
    );
    graph.teardown()?;

    // Passed on by reference: the actor returns a slice of what it read in place.
    let dag = Dag::<Buffer>::new();
    let out = mask.header_off(dag.input());
    let opts = CompileOptions::default()
        .buffer_size_bytes(SIZE + 64)
        .max_inflight_executions(2);
    let graph = dag.compile(out, opts)?;
    // The first input is built straight in the input channel's shared memory (a loan): it is
    // never copied at all.
    let mut lent = graph.input_buffer(SIZE);
    lent.copy_from_slice(&input);
    let mut next = lent.freeze();
    for run in 0..runs as usize {
        let back = graph.execute(next)?.get()?;
        anyhow::ensure!(back.len() == SIZE - 64 * (run + 1), "a slice of the input");
        anyhow::ensure!(
            back[..] == input[64 * (run + 1)..],
            "the bytes of the input"
        );
        anyhow::ensure!(in_shared_memory(back.as_ptr()), "the driver got a copy");
        // Sent again: it already lies in the input channel's memory.
        next = back;
    }
    for edge in graph.stats().edges {
        println!(
            "edge {:<24} {:>3} messages, {:>10} bytes written",
            edge.label, edge.messages, edge.bytes
        );
    }
    graph.teardown()?;
    Ok(())
}
