//! Cross-host rows: the same workloads with actors on other hosts (separate process trees on
//! this machine, joined over loopback, so that every edge between hosts is a TCP channel),
//! and the floor they are measured against: raw loopback TCP ping-pong and echo of the same
//! bytes, measured by this binary in the same run.
use super::{Bench, timed};
use adag::cluster::{ClusterOptions, HostInfo, LocalHosts};
use adag::{Buffer, CompileOptions, Placement, RefSet};
use adag_bench::{Shard, Stage, fanout, payload_echo};
use anyhow::{Context, Result, ensure};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

const SECRET: &str = "adag-bench-hosts";
const PLACEMENT: &str = "hosts";

impl Bench {
    /// Every cross-host workload, with three hosts joined for the run.
    pub(super) fn hosts(&mut self) -> Result<()> {
        let keys: Vec<String> = [
            "tcp_pingpong/hosts_floor",
            "tcp_echo_1MiB/hosts_floor",
            "tcp_echo_100MiB/hosts_floor",
            "echo/hosts",
            "chain3/hosts",
            "chain3_pipe16/hosts",
            "fanout3/hosts",
            "payload_1MiB/hosts",
            "payload_100MiB/hosts",
            "tcp_ring_allreduce_64MiB/hosts_floor",
            "allreduce_64MiB/hosts",
        ]
        .map(String::from)
        .to_vec();
        if !self.wants_any(&keys) {
            return Ok(());
        }
        self.raw_tcp()?;
        self.ring_floor()?;
        if !self.wants_any(&keys[3..]) {
            return Ok(());
        }
        let addr = self.rt.listen(ClusterOptions::new(SECRET))?;
        let _hosts = LocalHosts::start(3, addr, SECRET)?;
        let mut h = self.rt.wait_for_hosts(3, Duration::from_secs(60))?;
        h.sort_by(|a, b| a.name.cmp(&b.name));
        let spawn = |host: &HostInfo, k: u64| {
            self.rt
                .spawn::<Stage>(Placement::Host(host.id), k)
                .with_context(|| format!("spawning a stage on {}", host.name))
        };
        let stages = [spawn(&h[0], 1)?, spawn(&h[1], 1)?, spawn(&h[2], 1)?];
        let echo = spawn(&h[0], 0)?;
        if self.wants("echo/hosts") {
            let m = self.chain_round_trips(std::slice::from_ref(&echo), 0)?;
            self.push(m.row("echo", PLACEMENT, "actor on another host; 2 TCP hops"));
        }
        if self.wants("chain3/hosts") {
            let m = self.chain_round_trips(&stages, 3)?;
            self.push(m.row(
                "chain3",
                PLACEMENT,
                "one actor on each of 3 hosts; 4 TCP hops",
            ));
        }
        if self.wants("chain3_pipe16/hosts") {
            let m = self.chain_pipelined(&stages, 3, 16)?;
            self.push(m.row("chain3_pipe16", PLACEMENT, "16 in flight over 3 hosts"));
        }
        if self.wants("fanout3/hosts") {
            let g = fanout(&stages, self.opts.clone())?;
            let n = self.counts.sync;
            let m = timed(self.counts.warmup(n), n, |i| {
                let v = g.execute(i)?.get()?;
                ensure!(v.iter().all(|&x| x == i + 1), "fan-out returned {v:?}");
                Ok(())
            })?;
            g.teardown()?;
            self.push(m.row("fanout3", PLACEMENT, "input to an actor on each of 3 hosts"));
        }
        for (name, size) in [("1MiB", 1usize << 20), ("100MiB", 100 << 20)] {
            let key = format!("payload_{name}/{PLACEMENT}");
            if !self.wants(&key) {
                continue;
            }
            let opts = CompileOptions::default()
                .buffer_size_bytes(size + 64)
                .max_inflight_executions(2);
            let g = payload_echo(&echo, opts)?;
            let n = self.counts.payload(size);
            let mut buf = Some(Buffer::from(vec![0xa5; size]));
            let m = timed(self.counts.warmup(n).min(n), n, |_| {
                let out = g.execute(buf.take().expect("buffer is back"))?.get()?;
                ensure!(
                    out.len() == size,
                    "echo of {size} bytes returned {}",
                    out.len()
                );
                buf = Some(out);
                Ok(())
            })?;
            g.teardown()?;
            let mut row = m.row(&format!("payload_{name}"), PLACEMENT, String::new());
            let gbps = size as f64 / (m.p50_us() * 1e-6) / 1e9;
            row.gb_per_s = Some(gbps);
            row.note = format!("{gbps:.2} GB/s (size / p50 round trip, actor on another host)");
            self.push(row);
        }
        if self.wants("allreduce_64MiB/hosts") {
            let n = (64u64 << 20) / 4;
            let shards = h
                .iter()
                .enumerate()
                .map(|(r, host)| {
                    self.rt
                        .spawn::<Shard>(Placement::Host(host.id), (r as u32, n))
                        .with_context(|| format!("spawning a shard on {}", host.name))
                })
                .collect::<Result<Vec<_>>>()?;
            let dag = adag::Dag::<u64>::new();
            let step = dag.input();
            let grads: Vec<_> = shards.iter().map(|s| s.grad(&step)).collect();
            let summed = adag::collective::allreduce(&grads, adag::ReduceOp::Sum);
            let applied: Vec<_> = shards
                .iter()
                .zip(&summed)
                .map(|(s, g)| s.apply(g))
                .collect();
            let g = dag.compile(adag::MultiOutput(applied), self.opts.clone())?;
            let iters = self.counts.payload(64 << 20);
            let m = timed(self.counts.warmup(iters).min(iters), iters, |i| {
                for r in g.execute(i)? {
                    let v = r.get()?;
                    ensure!(v == 6.0, "allreduce gave {v}, not 1 + 2 + 3");
                }
                Ok(())
            })?;
            g.teardown()?;
            let mut row = m.row("allreduce_64MiB", PLACEMENT, String::new());
            let algbw = (64u64 << 20) as f64 / (m.p50_us() * 1e-6) / 1e9;
            row.gb_per_s = Some(algbw);
            row.note = format!(
                "{algbw:.2} GB/s of tensor (64 MiB / p50); one actor on each of 3 hosts, TCP communicator"
            );
            self.push(row);
        }
        Ok(())
    }

    /// What a ring allreduce of 64 MiB over 3 ranks can reach on these links: three threads,
    /// each with a loopback TCP connection to the next, all sending `2(n-1)/n` of 64 MiB to
    /// their successor while receiving as much from their predecessor (what each link carries
    /// in a ring allreduce, with every link busy at once, as in the real thing).
    fn ring_floor(&mut self) -> Result<()> {
        if !self.wants("tcp_ring_allreduce_64MiB/hosts_floor") {
            return Ok(());
        }
        let ranks = 3usize;
        let bytes = (64usize << 20) * 2 * (ranks - 1) / ranks;
        let listeners = (0..ranks)
            .map(|_| TcpListener::bind("127.0.0.1:0"))
            .collect::<std::io::Result<Vec<_>>>()?;
        let mut outs = Vec::new();
        let mut ins = Vec::new();
        for r in 0..ranks {
            let next = listeners[(r + 1) % ranks].local_addr()?;
            outs.push(TcpStream::connect(next)?);
            ins.push(None);
        }
        for r in 0..ranks {
            let (s, _) = listeners[(r + 1) % ranks].accept()?;
            ins[(r + 1) % ranks] = Some(s);
        }
        let iters = self.counts.payload(64 << 20);
        let warmup = self.counts.warmup(iters).min(iters);
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        let mut starts = Vec::new();
        let mut threads = Vec::new();
        for (mut out, inp) in outs.into_iter().zip(ins) {
            let mut inp = inp.context("a ring connection")?;
            let (start_tx, start_rx) = std::sync::mpsc::channel::<()>();
            starts.push(start_tx);
            let done_tx = done_tx.clone();
            for s in [&out, &inp] {
                s.set_nodelay(true)?;
            }
            threads.push(std::thread::spawn(move || -> std::io::Result<()> {
                // Sent from a tensor-sized buffer and received into another, as a ring moves
                // the tensor's bytes through memory (a small buffer sent over and over would
                // stay in cache and flatter the links).
                let chunk = 1usize << 20;
                let tensor = 64usize << 20;
                let src = vec![0x5au8; tensor];
                let mut dst = vec![0u8; tensor];
                while start_rx.recv().is_ok() {
                    std::thread::scope(|s| -> std::io::Result<()> {
                        let sender = s.spawn(|| -> std::io::Result<()> {
                            let mut done = 0;
                            while done < bytes {
                                let at = done % tensor;
                                let n = (bytes - done).min(chunk).min(tensor - at);
                                out.write_all(&src[at..at + n])?;
                                done += n;
                            }
                            Ok(())
                        });
                        let mut done = 0;
                        while done < bytes {
                            let at = done % tensor;
                            let n = (bytes - done).min(chunk).min(tensor - at);
                            inp.read_exact(&mut dst[at..at + n])?;
                            done += n;
                        }
                        sender.join().expect("sender")?;
                        Ok(())
                    })?;
                    let _ = done_tx.send(());
                }
                Ok(())
            }));
        }
        let m = timed(warmup, iters, |_| {
            for start in &starts {
                start.send(())?;
            }
            for _ in 0..ranks {
                done_rx.recv()?;
            }
            Ok(())
        })?;
        drop(starts);
        for t in threads {
            t.join()
                .map_err(|_| anyhow::anyhow!("a ring thread panicked"))??;
        }
        let mut row: super::Row = m.row("tcp_ring_allreduce_64MiB", "hosts_floor", String::new());
        let algbw = (64u64 << 20) as f64 / (m.p50_us() * 1e-6) / 1e9;
        row.gb_per_s = Some(algbw);
        row.note = format!(
            "{algbw:.2} GB/s of tensor: a ring's traffic on 3 loopback links at once, the floor of allreduce_64MiB/hosts"
        );
        self.push(row);
        Ok(())
    }

    /// The floor: a loopback TCP connection to a thread of this process that echoes what it
    /// reads (`TCP_NODELAY`, both ends polling without sleeping, as adag's channels spin).
    fn raw_tcp(&mut self) -> Result<()> {
        let sizes = [
            ("tcp_pingpong", 8usize),
            ("tcp_echo_1MiB", 1 << 20),
            ("tcp_echo_100MiB", 100 << 20),
        ];
        for (name, size) in sizes {
            let key = format!("{name}/hosts_floor");
            if !self.wants(&key) {
                continue;
            }
            let listener = TcpListener::bind("127.0.0.1:0")?;
            let mut client = TcpStream::connect(listener.local_addr()?)?;
            let (mut server, _) = listener.accept()?;
            for s in [&client, &server] {
                s.set_nodelay(true)?;
                s.set_nonblocking(true)?;
            }
            let n = if size <= 8 {
                self.counts.sync
            } else {
                self.counts.payload(size)
            };
            let warmup = self.counts.warmup(n).min(n);
            let total = warmup + n;
            let echo = std::thread::spawn(move || -> std::io::Result<()> {
                let mut buf = vec![0u8; size];
                for _ in 0..total {
                    spin_read(&mut server, &mut buf)?;
                    spin_write(&mut server, &buf)?;
                }
                Ok(())
            });
            let mut buf = vec![0x5au8; size];
            let m = timed(warmup, n, |_| {
                spin_write(&mut client, &buf)?;
                spin_read(&mut client, &mut buf)?;
                Ok(())
            })?;
            echo.join()
                .map_err(|_| anyhow::anyhow!("the echo thread panicked"))??;
            let mut row: super::Row = m.row(name, "hosts_floor", String::new());
            if size > 8 {
                let gbps = size as f64 / (m.p50_us() * 1e-6) / 1e9;
                row.gb_per_s = Some(gbps);
                row.note = format!(
                    "{gbps:.2} GB/s (size / p50 round trip): the floor of payload_{}",
                    &name[9..]
                );
            } else {
                row.note = "8 bytes there and back: the floor of echo/hosts (2 hops)".into();
            }
            self.push(row);
        }
        Ok(())
    }
}

/// Moves `len` bytes through `step` (one non-blocking read or write at an offset), spinning
/// while the socket would block; 30 s at most.
fn spin_all(
    len: usize,
    mut step: impl FnMut(usize) -> std::io::Result<usize>,
) -> std::io::Result<()> {
    let mut at = 0;
    let started = Instant::now();
    while at < len {
        match step(at) {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => at += n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if started.elapsed() > Duration::from_secs(30) {
                    return Err(std::io::ErrorKind::TimedOut.into());
                }
                std::hint::spin_loop();
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn spin_read(s: &mut TcpStream, buf: &mut [u8]) -> std::io::Result<()> {
    spin_all(buf.len(), |at| s.read(&mut buf[at..]))
}

fn spin_write(s: &mut TcpStream, buf: &[u8]) -> std::io::Result<()> {
    spin_all(buf.len(), |at| s.write(&buf[at..]))
}
