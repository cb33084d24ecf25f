//! Zero-copy reads: large [`Buffer`]s and tensors that cross processes are read in place from
//! the channel's shared memory, by actors and by the driver; values kept by either side never
//! stall the graph; small payloads are copied. Where a buffer's bytes are is checked against
//! `/proc/self/maps` of the process that holds it.
mod common;

use adag::{Buffer, CompileOptions, Dag, Placement, Runtime, Tensor};
use common::{process_actors_available, with_watchdog};

const WATCHDOG_SECS: u64 = 120;

/// Whether `ptr` lies in a mapping of one of adag's channel memfds in this process.
fn in_channel_memory(ptr: *const u8) -> bool {
    let addr = ptr as usize;
    let maps = std::fs::read_to_string("/proc/self/maps").expect("read /proc/self/maps");
    maps.lines().any(|line| {
        let mut fields = line.split_whitespace();
        let range = fields.next().unwrap_or("");
        let path = fields.nth(4).unwrap_or("");
        let Some((start, end)) = range.split_once('-') else {
            return false;
        };
        let (Ok(start), Ok(end)) = (
            usize::from_str_radix(start, 16),
            usize::from_str_radix(end, 16),
        ) else {
            return false;
        };
        (start..end).contains(&addr) && path.starts_with("/memfd:adag:")
    })
}

/// Bytes that tell message `seq` apart: a reader can check them knowing only `seq`.
fn pattern(seq: u64, len: usize) -> Buffer {
    Buffer::from(
        (0..len as u64)
            .map(|i| (i.wrapping_mul(31) ^ seq.wrapping_mul(0x9e37)) as u8)
            .collect::<Vec<_>>(),
    )
}

fn checksum(data: &[u8]) -> u64 {
    data.iter().enumerate().fold(0u64, |acc, (i, &b)| {
        acc.wrapping_mul(131).wrapping_add(b as u64 ^ i as u64)
    })
}

/// Reports where its inputs are, and keeps some of them.
#[derive(Default)]
pub struct Inspector {
    kept: Vec<(u64, Buffer)>,
}

#[adag::actor]
impl Inspector {
    pub fn new() -> Self {
        Inspector::default()
    }

    /// Whether the buffer is in channel memory, its address, and its checksum.
    pub fn locate(&mut self, data: Buffer) -> (bool, u64, u64) {
        (
            in_channel_memory(data.as_ptr()),
            data.as_ptr() as u64,
            checksum(&data),
        )
    }

    /// The buffer back, unchanged.
    pub fn echo(&mut self, data: Buffer) -> Buffer {
        data
    }

    /// The bytes from `from` on, without a copy.
    pub fn tail(&mut self, data: Buffer, from: u64) -> Buffer {
        data.slice(from as usize..)
    }

    /// Whether the tensor's data is in channel memory, whether it is 64-byte aligned, and the
    /// sum of its elements.
    pub fn locate_tensor(&mut self, t: Tensor) -> (bool, bool, f64) {
        let bytes = t.as_bytes().expect("a CPU tensor");
        let sum = t.as_slice::<f64>().expect("f64 elements").iter().sum();
        (
            in_channel_memory(bytes.as_ptr()),
            (bytes.as_ptr() as usize).is_multiple_of(64),
            sum,
        )
    }

    /// A new buffer computed from the input (every byte XOR 0x5a), built in the memory the
    /// output channel lends; whether it was lent.
    pub fn transform(&mut self, data: Buffer) -> (bool, Buffer) {
        let mut out = adag::output_buffer(data.len());
        let lent = out.is_loaned();
        for (o, i) in out.iter_mut().zip(data.iter()) {
            *o = i ^ 0x5a;
        }
        (lent, out.freeze())
    }

    /// The same, built on the heap (the plain way: copied into the channel after).
    pub fn transform_heap(&mut self, data: Buffer) -> Buffer {
        Buffer::from(data.iter().map(|b| b ^ 0x5a).collect::<Vec<u8>>())
    }

    /// Keeps the buffer (as message `seq`) and passes it on.
    pub fn keep(&mut self, seq: u64, data: Buffer) -> Buffer {
        self.kept.push((seq, data.clone()));
        data
    }

    /// Checks every kept buffer against its pattern; returns how many there are.
    pub fn check_kept(&self, len: u64) -> Result<u64, String> {
        for (seq, data) in &self.kept {
            if data[..] != pattern(*seq, len as usize)[..] {
                return Err(format!("kept message {seq} changed"));
            }
        }
        Ok(self.kept.len() as u64)
    }
}

fn process_runtime() -> Option<Runtime> {
    if !process_actors_available() {
        eprintln!("process actors are not available in this build: skipped");
        return None;
    }
    Some(Runtime::new().expect("runtime"))
}

#[test]
fn large_buffers_are_read_in_place_by_the_actor_and_the_driver() {
    with_watchdog("large_buffers_in_place", WATCHDOG_SECS, || {
        let Some(rt) = process_runtime() else { return };
        let a = rt.spawn::<Inspector>(Placement::Process, ()).unwrap();
        let opts = CompileOptions::default().buffer_size_bytes(2 << 20);

        let dag = Dag::<Buffer>::new();
        let g = dag.compile(a.locate(dag.input()), opts.clone()).unwrap();
        let data = pattern(1, 1 << 20);
        let (in_place, _, sum) = g.execute(data.clone()).unwrap().get().unwrap();
        assert!(in_place, "the actor got a copy of a 1 MiB buffer");
        assert_eq!(sum, checksum(&data));
        g.teardown().unwrap();

        let dag = Dag::<Buffer>::new();
        let g = dag.compile(a.echo(dag.input()), opts).unwrap();
        for seq in 0..20 {
            let data = pattern(seq, 1 << 20);
            let back = g.execute(data.clone()).unwrap().get().unwrap();
            assert!(
                in_channel_memory(back.as_ptr()),
                "the driver got a copy of result {seq}"
            );
            assert_eq!(back, data, "result {seq}");
        }
    });
}

#[test]
fn small_payloads_are_copied() {
    with_watchdog("small_payloads_copied", WATCHDOG_SECS, || {
        let Some(rt) = process_runtime() else { return };
        let a = rt.spawn::<Inspector>(Placement::Process, ()).unwrap();
        let dag = Dag::<Buffer>::new();
        // The default slot of 1,000,000 bytes.
        let g = dag
            .compile(a.locate(dag.input()), CompileOptions::default())
            .unwrap();
        // Inline (under 16 KiB), and out of band but under a quarter of the slot.
        for len in [1 << 10, 64 << 10] {
            let data = pattern(len as u64, len);
            let (in_place, _, sum) = g.execute(data.clone()).unwrap().get().unwrap();
            assert!(!in_place, "a {len}-byte buffer was kept in place");
            assert_eq!(sum, checksum(&data));
        }
        // A quarter of the slot or more: in place.
        let data = pattern(0, 300_000);
        assert!(g.execute(data).unwrap().get().unwrap().0);
    });
}

#[test]
fn tensors_are_read_in_place_and_aligned() {
    with_watchdog("tensors_in_place", WATCHDOG_SECS, || {
        let Some(rt) = process_runtime() else { return };
        let a = rt.spawn::<Inspector>(Placement::Process, ()).unwrap();
        let dag = Dag::<Tensor>::new();
        let g = dag
            .compile(a.locate_tensor(dag.input()), CompileOptions::default())
            .unwrap();
        let n = 256 * 1024; // 2 MiB of f64: the channel grows for it
        let t = Tensor::from_vec((0..n).map(|i| i as f64).collect(), [512, n / 512]).unwrap();
        let expected = (0..n).map(|i| i as f64).sum::<f64>();
        for _ in 0..3 {
            let (in_place, aligned, sum) = g.execute(t.clone()).unwrap().get().unwrap();
            assert!(in_place, "the actor got a copy of the tensor");
            assert!(aligned, "the tensor's data is not 64-byte aligned");
            assert_eq!(sum, expected);
        }
    });
}

/// The actor keeps every input and the driver every result, far more of them than the ring
/// has slots: the graph never waits for them, and none of them changes afterwards.
#[test]
fn values_kept_by_actor_and_driver_never_stall_the_graph() {
    with_watchdog("kept_values", WATCHDOG_SECS, || {
        let Some(rt) = process_runtime() else { return };
        const LEN: usize = 256 << 10;
        const RUNS: u64 = 150;
        let a = rt.spawn::<Inspector>(Placement::Process, ()).unwrap();
        let dag = Dag::<(u64, Buffer)>::new();
        let input = dag.input();
        let out = a.keep(input.arg::<0>(), input.arg::<1>());
        let opts = CompileOptions::default()
            .buffer_size_bytes(LEN + 64)
            .max_inflight_executions(2);
        let g = dag.compile(out, opts).unwrap();
        let mut results = Vec::new();
        for seq in 0..RUNS {
            let back = g.execute((seq, pattern(seq, LEN))).unwrap().get().unwrap();
            assert!(in_channel_memory(back.as_ptr()), "result {seq} was copied");
            results.push((seq, back));
        }
        for (seq, back) in &results {
            assert_eq!(
                back[..],
                pattern(*seq, LEN)[..],
                "kept result {seq} changed"
            );
        }
        g.teardown().unwrap();
        // One-off calls reach the actor once its graph is down.
        assert_eq!(a.call().check_kept(LEN as u64).unwrap(), RUNS);
        // Results outlive the graph (and its channels).
        assert_eq!(results[7].1[..], pattern(7, LEN)[..]);
        drop((g, a, rt));
        assert_eq!(results[8].1[..], pattern(8, LEN)[..]);
    });
}

/// Between threads of one process a buffer moves: the actor sees the driver's own bytes.
#[test]
fn buffers_move_between_threads_without_a_copy() {
    with_watchdog("buffers_between_threads", WATCHDOG_SECS, || {
        let rt = Runtime::new().unwrap();
        let a = rt.spawn::<Inspector>(Placement::Thread, ()).unwrap();
        let dag = Dag::<Buffer>::new();
        let g = dag
            .compile(a.locate(dag.input()), CompileOptions::default())
            .unwrap();
        let data = pattern(3, 1 << 20);
        let (_, address, sum) = g.execute(data.clone()).unwrap().get().unwrap();
        assert_eq!(address, data.as_ptr() as u64);
        assert_eq!(sum, checksum(&data));
    });
}

/// The bytes written on the edge whose label contains `name`.
fn edge_bytes(stats: &adag::GraphStats, name: &str) -> u64 {
    stats
        .edges
        .iter()
        .filter(|e| e.label.contains(name))
        .map(|e| e.bytes)
        .sum()
}

/// A buffer the actor returns, whole or sliced, reaches the driver by reference to the input
/// channel's memory (written once); the driver keeps results while the graph goes on, sends
/// some of them again (by reference, in the channel they lie in), and none of them changes.
/// A chain passes the payload on between actors by copy (the next actor does not map the
/// first channel) and back to the driver by reference.
#[test]
fn returned_buffers_are_written_once() {
    with_watchdog("written_once", WATCHDOG_SECS, || {
        let Some(rt) = process_runtime() else { return };
        const LEN: usize = 1 << 20;
        const RUNS: u64 = 60;
        let a = rt.spawn::<Inspector>(Placement::Process, ()).unwrap();
        let b = rt.spawn::<Inspector>(Placement::Process, ()).unwrap();
        let opts = CompileOptions::default()
            .buffer_size_bytes(LEN + 64)
            .max_inflight_executions(2);

        let dag = Dag::<(Buffer, u64)>::new();
        let input = dag.input();
        let g = dag
            .compile(a.tail(input.arg::<0>(), input.arg::<1>()), opts.clone())
            .unwrap();
        let mut kept = Vec::new();
        for seq in 0..RUNS {
            let skip = seq % 3 * 100;
            // Every fifth input is a result the driver got back: already in shared memory.
            let (sent, from) = match kept.get(seq as usize / 2) {
                Some((origin, from, data)) if seq % 5 == 4 => {
                    (Buffer::clone(data), (*origin, *from))
                }
                _ => (pattern(seq, LEN), (seq, 0)),
            };
            let back = g.execute((sent, skip)).unwrap().get().unwrap();
            assert!(in_channel_memory(back.as_ptr()), "result {seq} was copied");
            let (origin, from) = (from.0, from.1 + skip as usize);
            assert_eq!(back[..], pattern(origin, LEN)[from..], "result {seq}");
            kept.push((origin, from, back));
        }
        let stats = g.stats();
        let returned = edge_bytes(&stats, "tail");
        assert!(
            stats
                .edges
                .iter()
                .any(|e| e.label.contains("tail") && e.messages == RUNS),
            "no edge of the actor's results in {:?}",
            stats.edges
        );
        assert!(
            returned < RUNS * 4096,
            "the actor wrote {returned} bytes for {RUNS} results of 1 MiB: copies, not references"
        );
        let sent = edge_bytes(&stats, "input[0]");
        assert!(
            sent < (RUNS - 10) * LEN as u64,
            "the driver wrote {sent} bytes: results sent again were copied"
        );
        g.teardown().unwrap();
        for (origin, from, back) in &kept {
            assert_eq!(
                back[..],
                pattern(*origin, LEN)[*from..],
                "a kept result changed"
            );
        }

        let dag = Dag::<Buffer>::new();
        let g = dag.compile(b.echo(a.echo(dag.input())), opts).unwrap();
        for seq in 0..20 {
            let data = pattern(seq, LEN);
            let back = g.execute(data.clone()).unwrap().get().unwrap();
            assert!(in_channel_memory(back.as_ptr()), "result {seq} was copied");
            assert_eq!(back, data, "result {seq}");
        }
    });
}

/// A buffer built in memory lent by the graph's input channel crosses to the actor and back
/// without a copy: the input edge carries a reference, the actor reads it in place, and the
/// result it returns is the same memory. Results kept by the driver keep their memory; later
/// loans get other memory, and nothing changes.
#[test]
fn input_buffers_built_in_lent_memory_are_never_copied() {
    with_watchdog("lent_input", WATCHDOG_SECS, || {
        let Some(rt) = process_runtime() else { return };
        const LEN: usize = 1 << 20;
        const RUNS: u64 = 40;
        let a = rt.spawn::<Inspector>(Placement::Process, ()).unwrap();
        let opts = CompileOptions::default()
            .buffer_size_bytes(4096)
            .max_inflight_executions(2);

        let dag = Dag::<Buffer>::new();
        let g = dag.compile(a.locate(dag.input()), opts.clone()).unwrap();
        let mut data = g.input_buffer(LEN);
        assert!(
            data.is_loaned(),
            "a process actor's input channel lends memory"
        );
        data.copy_from_slice(&pattern(9, LEN));
        let data = data.freeze();
        assert!(in_channel_memory(data.as_ptr()));
        let (in_place, _, sum) = g.execute(data.clone()).unwrap().get().unwrap();
        assert!(in_place, "the actor got a copy");
        assert_eq!(sum, checksum(&data));
        let sent = edge_bytes(&g.stats(), "input");
        assert!(
            sent < 4096,
            "the input edge carried {sent} bytes for a lent 1 MiB buffer"
        );
        g.teardown().unwrap();

        let dag = Dag::<Buffer>::new();
        let g = dag.compile(a.echo(dag.input()), opts).unwrap();
        let mut kept = Vec::new();
        for seq in 0..RUNS {
            let mut data = g.input_buffer(LEN);
            data.copy_from_slice(&pattern(seq, LEN));
            let data = data.freeze();
            let back = g.execute(data.clone()).unwrap().get().unwrap();
            assert_eq!(
                back.as_ptr(),
                data.as_ptr(),
                "result {seq} is not the lent memory"
            );
            if seq % 4 == 0 {
                kept.push((seq, back));
            }
        }
        let stats = g.stats();
        let moved: u64 = stats.edges.iter().map(|e| e.bytes).sum();
        assert!(
            moved < RUNS * 8192,
            "{moved} bytes written for {RUNS} round trips"
        );
        for (seq, back) in &kept {
            assert_eq!(
                back[..],
                pattern(*seq, LEN)[..],
                "kept result {seq} changed"
            );
        }
        // A thread actor's graph has no shared memory to lend: a heap buffer.
        let t = rt.spawn::<Inspector>(Placement::Thread, ()).unwrap();
        let dag = Dag::<Buffer>::new();
        let g = dag
            .compile(t.echo(dag.input()), CompileOptions::default())
            .unwrap();
        assert!(!g.input_buffer(64).is_loaned());
    });
}

/// A result the actor builds in the memory its output channel lends (`adag::output_buffer`)
/// is written once: the output edge carries a reference, the driver reads the bytes in
/// place, results kept by the driver never change while later results are built, and the
/// plain way (a heap buffer) is copied into the channel as before. Outside a graph, and in a
/// thread actor read by the driver's thread, the buffer is on the heap.
#[test]
fn results_built_in_lent_output_memory_are_written_once() {
    with_watchdog("lent_output", WATCHDOG_SECS, || {
        assert!(
            !adag::output_buffer(16).is_loaned(),
            "lent outside a method"
        );
        let Some(rt) = process_runtime() else { return };
        const LEN: usize = 1 << 20;
        const RUNS: u64 = 40;
        let a = rt.spawn::<Inspector>(Placement::Process, ()).unwrap();
        let opts = CompileOptions::default()
            .buffer_size_bytes(4096)
            .max_inflight_executions(3);
        let dag = Dag::<Buffer>::new();
        let g = dag.compile(a.transform(dag.input()), opts.clone()).unwrap();
        let mut kept = Vec::new();
        for seq in 0..RUNS {
            let (lent, out) = g.execute(pattern(seq, LEN)).unwrap().get().unwrap();
            assert!(lent, "the output channel lent no memory for result {seq}");
            assert!(in_channel_memory(out.as_ptr()), "result {seq} was copied");
            let want: Vec<u8> = pattern(seq, LEN).iter().map(|b| b ^ 0x5a).collect();
            assert_eq!(out[..], want[..], "result {seq}");
            if seq % 3 == 0 {
                kept.push((seq, out));
            }
        }
        let written = edge_bytes(&g.stats(), "transform");
        assert!(
            written < RUNS * 4096,
            "the actor wrote {written} bytes for {RUNS} results of 1 MiB built in place"
        );
        for (seq, out) in &kept {
            let want: Vec<u8> = pattern(*seq, LEN).iter().map(|b| b ^ 0x5a).collect();
            assert_eq!(out[..], want[..], "kept result {seq} changed");
        }
        g.teardown().unwrap();

        let dag = Dag::<Buffer>::new();
        let g = dag.compile(a.transform_heap(dag.input()), opts).unwrap();
        for seq in 0..5 {
            let out = g.execute(pattern(seq, LEN)).unwrap().get().unwrap();
            assert_eq!(out[0], pattern(seq, LEN)[0] ^ 0x5a);
        }
        let copied = edge_bytes(&g.stats(), "transform_heap");
        assert!(
            copied >= 5 * LEN as u64,
            "a heap result was not copied into the channel ({copied} bytes)"
        );
        g.teardown().unwrap();

        let t = rt.spawn::<Inspector>(Placement::Thread, ()).unwrap();
        let dag = Dag::<Buffer>::new();
        let g = dag
            .compile(t.transform(dag.input()), CompileOptions::default())
            .unwrap();
        let (lent, out) = g.execute(pattern(1, 4096)).unwrap().get().unwrap();
        assert!(!lent, "an in-process output lent shared memory");
        assert_eq!(out[1], pattern(1, 4096)[1] ^ 0x5a);
    });
}
