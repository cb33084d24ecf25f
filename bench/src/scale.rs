//! `adag-bench --scale`: how the costs grow with the size of a graph.
//!
//! ```text
//! cargo run --release -p adag-bench -- --scale            # full run (a few minutes on 2 vCPUs)
//! cargo run --release -p adag-bench -- --scale --quick    # small sizes only (seconds; CI)
//! cargo run --release -p adag-bench -- --scale --json /tmp/scale.json
//! ```
//!
//! For chains of N thread actors (4 to 1,024) and of N process actors (8 to 128), each run
//! spawns the actors (timed apart: for processes that is the process start), compiles the
//! chain, times synchronous round trips (`execute` + `get`, p50), a pipelined run (executions
//! per second with [`DEPTH`] in flight), tears the graph down (timed) and drops the actors.
//! Every figure is the median over the runs of its size. Memory is read in the first run of
//! each size: the driver's resident set before spawning, after spawning (idle actors), after
//! compiling (the edges); for process actors also the workers' resident sets and the channels'
//! shared memory (memfds, found in the `smaps` of the driver and its workers and counted once
//! per memfd).
//!
//! Beside them, fan-out: one value read by 1, 4, 16 and 64 actors, their results the graph's
//! outputs (`execute` + `get` of all of them, p50). And the floor: N threads passing a token
//! round a ring, each sleeping on a futex until its predecessor wakes it (no spin), timed per
//! round and divided by N: what one hand-off through the kernel costs on this machine with the
//! same number of threads.
use adag::{CompileOptions, Placement, RefSet, Runtime};
use adag_bench::{chain, fanout, spawn_stages};
use anyhow::{Context, Result, ensure};
use serde::Serialize;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// Executions kept in flight by the pipelined runs.
const DEPTH: usize = 16;

/// A run of a chain that takes longer than this is not repeated (the point keeps the runs it
/// has): the full run stays within minutes even where a size is pathological.
const POINT_BUDGET: Duration = Duration::from_secs(40);

/// One size of a chain.
#[derive(Serialize, Debug, Clone)]
struct ChainPoint {
    placement: &'static str,
    actors: usize,
    runs: usize,
    /// Spawning the actors (process actors: starting their processes), ms.
    spawn_ms: f64,
    /// `dag.compile(..)` of the chain (the graph built and compiled), ms.
    compile_ms: f64,
    /// `graph.teardown()`, ms.
    teardown_ms: f64,
    /// p50 of one synchronous round trip, µs.
    round_trip_us: f64,
    /// The round trip divided by the hops (actors + 1: the driver's edges in and out).
    per_hop_us: f64,
    /// Executions per second with [`DEPTH`] in flight.
    pipelined_per_s: f64,
    /// The driver's resident set grown by spawning the actors, per actor, KiB.
    driver_kib_per_actor: f64,
    /// The driver's resident set grown by compiling the chain, per edge, KiB.
    driver_kib_per_edge: f64,
    /// The workers' resident sets, per worker (process actors), KiB.
    worker_kib: Option<f64>,
    /// Shared memory of the channels, resident (once per memfd), KiB, and per edge.
    shm_kib: f64,
    shm_kib_per_edge: f64,
    /// The futex ring with as many threads as actors: µs per hand-off.
    floor_per_hop_us: Option<f64>,
    /// Runs that did not complete (a `get` timed out, an error): the reason.
    failed: Option<String>,
}

/// One fan-out size.
#[derive(Serialize, Debug, Clone)]
struct FanoutPoint {
    placement: &'static str,
    readers: usize,
    /// p50 of `execute` + `get` of every reader's result, µs.
    round_trip_us: f64,
    /// The round trip against the same placement's one reader.
    vs_one_reader: f64,
}

/// One size of the futex ring.
#[derive(Serialize, Debug, Clone)]
struct FloorPoint {
    threads: usize,
    /// p50 of one round, µs.
    round_us: f64,
    per_hop_us: f64,
}

#[derive(Serialize)]
struct Report {
    system: &'static str,
    quick: bool,
    cpus: usize,
    chains: Vec<ChainPoint>,
    fanout: Vec<FanoutPoint>,
    floor: Vec<FloorPoint>,
    /// Growth exponents (log-log slope between the smallest and the largest size).
    exponents: Vec<(String, f64)>,
}

/// The sizes of one run.
struct Plan {
    thread_chains: &'static [usize],
    process_chains: &'static [usize],
    thread_readers: &'static [usize],
    process_readers: &'static [usize],
}

const FULL: Plan = Plan {
    thread_chains: &[4, 16, 64, 256, 1024],
    process_chains: &[8, 32, 128],
    thread_readers: &[1, 4, 16, 64],
    process_readers: &[1, 4, 16, 64],
};

const QUICK: Plan = Plan {
    thread_chains: &[4, 16, 64],
    process_chains: &[8],
    thread_readers: &[1, 4, 16],
    process_readers: &[1, 4],
};

/// Runs the scale benchmark: tables on stdout, progress on stderr, JSON to `json`.
///
/// `filter` keeps the points whose key contains it: `chain/thread/1024`, `chain/process/8`,
/// `fanout/thread/16`, `floor/64`.
pub fn run(quick: bool, filter: Option<&str>, json: Option<&Path>) -> Result<()> {
    let plan = if quick { QUICK } else { FULL };
    let wants = |key: String| filter.is_none_or(|f| key.contains(f));
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let started = Instant::now();
    eprintln!(
        "adag-bench --scale{}: {cpus} CPU(s), load average {:.2}",
        if quick { " --quick" } else { "" },
        loadavg()
    );
    let rt = Runtime::new()?;
    // First-use costs (code paths, the allocator's arenas, page faults) outside every point.
    {
        let stages = spawn_stages(&rt, Placement::Thread, 4)?;
        let g = chain(&stages, CompileOptions::default())?;
        ensure!(
            g.execute(1)?.get()? == 5,
            "the warm-up chain returned a wrong sum"
        );
        g.teardown()?;
    }

    // The floor first, alone on the machine.
    let mut floor_sizes: Vec<usize> = plan
        .thread_chains
        .iter()
        .chain(plan.process_chains)
        .copied()
        .collect();
    floor_sizes.sort_unstable();
    floor_sizes.dedup();
    let mut floor = Vec::new();
    for &n in &floor_sizes {
        if !wants(format!("floor/{n}")) {
            continue;
        }
        let p = futex_ring(n, if quick { 3 } else { 5 })
            .with_context(|| format!("the futex ring of {n}"))?;
        eprintln!(
            "  floor      {n:>5} threads  round {:>10.1} µs  {:>7.2} µs/hop",
            p.round_us, p.per_hop_us
        );
        floor.push(p);
    }
    let floor_of = |n: usize| floor.iter().find(|p| p.threads == n).map(|p| p.per_hop_us);

    let mut chains = Vec::new();
    for (placement, sizes) in [
        (Placement::Thread, plan.thread_chains),
        (Placement::Process, plan.process_chains),
    ] {
        for &n in sizes {
            if !wants(format!("chain/{}/{n}", name(placement))) {
                continue;
            }
            let mut p = chain_point(&rt, placement, n, quick)
                .with_context(|| format!("a chain of {n} {}", name(placement)))?;
            p.floor_per_hop_us = floor_of(n);
            eprintln!(
                "  chain      {:>7} {n:>5}  spawn {:>8.2} ms  compile {:>8.2} ms  teardown {:>7.2} ms  rt {:>9.1} µs ({:>6.2}/hop)  {:>8.0} /s{}",
                p.placement,
                p.spawn_ms,
                p.compile_ms,
                p.teardown_ms,
                p.round_trip_us,
                p.per_hop_us,
                p.pipelined_per_s,
                p.failed
                    .as_deref()
                    .map_or(String::new(), |f| format!("  FAILED: {f}"))
            );
            chains.push(p);
        }
    }

    let mut fan = Vec::new();
    for (placement, sizes) in [
        (Placement::Thread, plan.thread_readers),
        (Placement::Process, plan.process_readers),
    ] {
        let mut one = None;
        for &n in sizes {
            if !wants(format!("fanout/{}/{n}", name(placement))) {
                continue;
            }
            let us = fanout_p50(&rt, placement, n)
                .with_context(|| format!("a fan-out to {n} {}", name(placement)))?;
            let one = *one.get_or_insert(us);
            eprintln!(
                "  fan-out    {:>7} {n:>5}  rt {us:>9.1} µs",
                name(placement)
            );
            fan.push(FanoutPoint {
                placement: name(placement),
                readers: n,
                round_trip_us: us,
                vs_one_reader: us / one,
            });
        }
    }

    let exponents = exponents(&chains, &fan, &floor);
    print_tables(&chains, &fan, &exponents);
    if let Some(path) = json {
        let report = Report {
            system: "adag",
            quick,
            cpus,
            chains,
            fanout: fan,
            floor,
            exponents,
        };
        std::fs::write(path, serde_json::to_string_pretty(&report)? + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
        eprintln!("wrote {}", path.display());
    }
    drop(rt);
    // Every handle was dropped: the workers must be gone.
    let deadline = Instant::now() + Duration::from_secs(5);
    while !children().is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    ensure!(
        children().is_empty(),
        "worker processes still alive after every handle was dropped: {:?}",
        children()
    );
    eprintln!(
        "done in {:.1} s; load average {:.2} after",
        started.elapsed().as_secs_f64(),
        loadavg()
    );
    Ok(())
}

fn name(p: Placement) -> &'static str {
    match p {
        Placement::Thread => "thread",
        Placement::Process => "process",
        _ => "remote",
    }
}

/// Round trips, pipelined executions and runs of a chain of `n`.
fn counts(n: usize, quick: bool) -> (u64, u64, usize) {
    let n = n as u64;
    let round_trips = (if quick { 4_000 } else { 40_000 } / n).clamp(20, 2_000);
    let pipelined = (if quick { 8_000 } else { 80_000 } / n).clamp(40, 4_000);
    let runs = if n >= 256 { 3 } else { 5 };
    (round_trips, pipelined, runs)
}

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let m = v.len() / 2;
    if v.len() % 2 == 1 {
        v[m]
    } else {
        (v[m - 1] + v[m]) / 2.0
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// What one run of a chain measured.
#[derive(Default)]
struct ChainRun {
    spawn: f64,
    compile: f64,
    teardown: f64,
    round_trip: f64,
    pipelined: f64,
}

fn chain_point(rt: &Runtime, placement: Placement, n: usize, quick: bool) -> Result<ChainPoint> {
    let (round_trips, pipelined, runs) = counts(n, quick);
    let mut done: Vec<ChainRun> = Vec::new();
    let mut memory = None;
    let mut failed = None;
    let started = Instant::now();
    for run in 0..runs {
        if run > 0 && started.elapsed() > POINT_BUDGET {
            break;
        }
        match chain_run(rt, placement, n, round_trips, pipelined, run == 0) {
            Ok((r, mem)) => {
                done.push(r);
                memory = memory.or(mem);
            }
            Err(e) => {
                failed = Some(format!("{e:#}"));
                break;
            }
        }
    }
    let med = |f: fn(&ChainRun) -> f64| median(done.iter().map(f).collect());
    let round_trip = med(|r| r.round_trip);
    let mem = memory.unwrap_or_default();
    Ok(ChainPoint {
        placement: name(placement),
        actors: n,
        runs: done.len(),
        spawn_ms: med(|r| r.spawn),
        compile_ms: med(|r| r.compile),
        teardown_ms: med(|r| r.teardown),
        round_trip_us: round_trip,
        per_hop_us: round_trip / (n + 1) as f64,
        pipelined_per_s: med(|r| r.pipelined),
        driver_kib_per_actor: mem.per_actor,
        driver_kib_per_edge: mem.per_edge,
        worker_kib: mem.worker,
        shm_kib: mem.shm,
        shm_kib_per_edge: mem.shm / (n + 1) as f64,
        floor_per_hop_us: None,
        failed,
    })
}

/// Memory read in one run.
#[derive(Default, Clone, Copy)]
struct Memory {
    per_actor: f64,
    per_edge: f64,
    worker: Option<f64>,
    shm: f64,
}

fn chain_run(
    rt: &Runtime,
    placement: Placement,
    n: usize,
    round_trips: u64,
    pipelined: u64,
    read_memory: bool,
) -> Result<(ChainRun, Option<Memory>)> {
    let rss0 = rss_kib(None);
    let t = Instant::now();
    let stages = spawn_stages(rt, placement, n)?;
    let spawn = ms(t.elapsed());
    let rss1 = rss_kib(None);
    let added = n as u64;
    let opts = CompileOptions::default().get_timeout(Duration::from_secs(20));

    let t = Instant::now();
    let g = chain(&stages, opts.clone())?;
    let compile = ms(t.elapsed());
    let mut memory = None;
    let mut lat = Vec::with_capacity(round_trips as usize);
    let outcome = (|| -> Result<()> {
        // Warm-up, then the timed round trips.
        for i in 0..(round_trips / 10).max(3) {
            let v = g.execute(i)?.get()?;
            ensure!(v == i + added, "a chain of {n} returned {v} for {i}");
        }
        if read_memory {
            let rss2 = rss_kib(None);
            let workers: Vec<f64> = children()
                .into_iter()
                .filter_map(|pid| rss_kib(Some(pid)))
                .collect();
            memory = Some(Memory {
                per_actor: (rss1.unwrap_or(0.0) - rss0.unwrap_or(0.0)) / n as f64,
                per_edge: (rss2.unwrap_or(0.0) - rss1.unwrap_or(0.0)) / (n + 1) as f64,
                worker: (!workers.is_empty()).then(|| median(workers)),
                shm: shm_resident_kib(),
            });
        }
        for i in 0..round_trips {
            let t = Instant::now();
            let v = g.execute(i)?.get()?;
            lat.push(us(t.elapsed()));
            ensure!(v == i + added, "a chain of {n} returned {v} for {i}");
        }
        Ok(())
    })();
    let t = Instant::now();
    g.teardown()?;
    let teardown = ms(t.elapsed());
    drop(g);
    outcome?;

    // Pipelined: its own graph, DEPTH executions in flight.
    let g = chain(&stages, opts.max_inflight_executions(DEPTH))?;
    let pipelined_per_s = (|| -> Result<f64> {
        let mut q = std::collections::VecDeque::with_capacity(DEPTH);
        let start = Instant::now();
        for i in 0..pipelined {
            if q.len() == DEPTH {
                let (j, r): (u64, adag::CompiledRef<u64>) = q.pop_front().expect("full");
                let v = r.get()?;
                ensure!(
                    v == j + added,
                    "a pipelined chain of {n} returned {v} for {j}"
                );
            }
            q.push_back((i, g.execute(i)?));
        }
        while let Some((j, r)) = q.pop_front() {
            let v = r.get()?;
            ensure!(
                v == j + added,
                "a pipelined chain of {n} returned {v} for {j}"
            );
        }
        Ok(pipelined as f64 / start.elapsed().as_secs_f64())
    })();
    g.teardown()?;
    drop(g);
    drop(stages);
    Ok((
        ChainRun {
            spawn,
            compile,
            teardown,
            round_trip: median(lat),
            pipelined: pipelined_per_s?,
        },
        memory,
    ))
}

/// p50 of one value read by `n` actors, all their results gathered.
fn fanout_p50(rt: &Runtime, placement: Placement, n: usize) -> Result<f64> {
    let stages = spawn_stages(rt, placement, n)?;
    let opts = CompileOptions::default().get_timeout(Duration::from_secs(20));
    let g = fanout(&stages, opts)?;
    let count = (20_000 / n as u64).clamp(200, 2_000);
    let mut lat = Vec::with_capacity(count as usize);
    let outcome = (|| -> Result<()> {
        for i in 0..count + count / 10 {
            let t = Instant::now();
            let v: Vec<u64> = g.execute(i)?.get()?;
            let d = us(t.elapsed());
            ensure!(
                v.len() == n && v.iter().all(|&x| x == i + 1),
                "a fan-out to {n} returned {v:?} for {i}"
            );
            if i >= count / 10 {
                lat.push(d);
            }
        }
        Ok(())
    })();
    g.teardown()?;
    outcome?;
    Ok(median(lat))
}

/// One futex word per thread of the ring, each on its own cache line.
#[repr(C, align(64))]
struct Word(AtomicU32);

fn futex_wait(word: &AtomicU32, expected: u32) {
    // SAFETY: FUTEX_WAIT_PRIVATE on a live, aligned u32 that outlives the call; no timeout.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT | libc::FUTEX_PRIVATE_FLAG,
            expected,
            std::ptr::null::<libc::timespec>(),
        );
    }
}

fn futex_wake(word: &AtomicU32) {
    // SAFETY: FUTEX_WAKE_PRIVATE on a live, aligned u32.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE | libc::FUTEX_PRIVATE_FLAG,
            1,
        );
    }
}

/// `n` threads passing a token round a ring, each sleeping on its futex until its
/// predecessor hands it on: p50 of a round (median of `runs` runs), and per hand-off.
fn futex_ring(n: usize, runs: usize) -> Result<FloorPoint> {
    let rounds = (40_000 / n).clamp(20, 4_000);
    let mut per_run = Vec::new();
    for _ in 0..runs {
        let words: Arc<Vec<Word>> = Arc::new((0..n).map(|_| Word(AtomicU32::new(0))).collect());
        let stop = Arc::new(AtomicBool::new(false));
        // Thread i waits for its word to become 1, clears it and hands on to i + 1; the last
        // hands back to this thread (word 0), which times the rounds.
        let threads: Vec<_> = (1..n)
            .map(|i| {
                let (words, stop) = (words.clone(), stop.clone());
                std::thread::Builder::new()
                    .stack_size(64 << 10)
                    .spawn(move || {
                        let next = (i + 1) % words.len();
                        loop {
                            let mine = &words[i].0;
                            while mine.load(Ordering::Acquire) == 0 {
                                futex_wait(mine, 0);
                            }
                            mine.store(0, Ordering::Relaxed);
                            if stop.load(Ordering::Acquire) {
                                words[next].0.store(1, Ordering::Release);
                                futex_wake(&words[next].0);
                                return;
                            }
                            words[next].0.store(1, Ordering::Release);
                            futex_wake(&words[next].0);
                        }
                    })
            })
            .collect::<std::io::Result<_>>()?;
        let mine = &words[0].0;
        let round = || {
            words[1 % n].0.store(1, Ordering::Release);
            futex_wake(&words[1 % n].0);
            if n > 1 {
                while mine.load(Ordering::Acquire) == 0 {
                    futex_wait(mine, 0);
                }
                mine.store(0, Ordering::Relaxed);
            } else {
                mine.store(0, Ordering::Relaxed);
            }
        };
        for _ in 0..(rounds / 10).max(3) {
            round();
        }
        let mut lat = Vec::with_capacity(rounds);
        for _ in 0..rounds {
            let t = Instant::now();
            round();
            lat.push(us(t.elapsed()));
        }
        stop.store(true, Ordering::Release);
        round();
        for t in threads {
            t.join()
                .map_err(|_| anyhow::anyhow!("a ring thread panicked"))?;
        }
        per_run.push(median(lat));
    }
    let round_us = median(per_run);
    Ok(FloorPoint {
        threads: n,
        round_us,
        per_hop_us: round_us / n as f64,
    })
}

/// `VmRSS` of this process (`None`) or of `pid`, KiB.
fn rss_kib(pid: Option<u32>) -> Option<f64> {
    let path = match pid {
        None => "/proc/self/status".to_string(),
        Some(pid) => format!("/proc/{pid}/status"),
    };
    let status = std::fs::read_to_string(path).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// This process's children (the workers of process actors).
fn children() -> Vec<u32> {
    let mut out = Vec::new();
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return out;
    };
    for t in tasks.flatten() {
        if let Ok(s) = std::fs::read_to_string(t.path().join("children")) {
            out.extend(s.split_whitespace().filter_map(|p| p.parse::<u32>().ok()));
        }
    }
    out
}

/// The channels' shared memory, resident, KiB: every memfd named `adag:` mapped by this
/// process or its workers, counted once (the largest resident size any of them sees).
/// `/dev/shm` does not show it: the memfds have no name there.
fn shm_resident_kib() -> f64 {
    let mut seen: std::collections::HashMap<String, f64> = std::collections::HashMap::new();
    let mut pids: Vec<Option<u32>> = vec![None];
    pids.extend(children().into_iter().map(Some));
    for pid in pids {
        let path = match pid {
            None => "/proc/self/smaps".to_string(),
            Some(pid) => format!("/proc/{pid}/smaps"),
        };
        let Ok(smaps) = std::fs::read_to_string(path) else {
            continue;
        };
        let mut current: Option<(String, f64)> = None;
        let mut flush = |cur: &mut Option<(String, f64)>| {
            if let Some((key, rss)) = cur.take() {
                let e = seen.entry(key).or_insert(0.0);
                *e = e.max(rss);
            }
        };
        for line in smaps.lines() {
            let first = line.split_whitespace().next().unwrap_or("");
            if first.contains('-') && !first.ends_with(':') {
                // A mapping's header: range perms offset dev inode path.
                flush(&mut current);
                let fields: Vec<&str> = line.split_whitespace().collect();
                if fields.len() >= 6 && fields[5].starts_with("/memfd:adag") {
                    // The inode (with the device) names the memfd; the offset tells two
                    // mappings of one memfd apart.
                    current = Some((format!("{} {} {}", fields[3], fields[4], fields[2]), 0.0));
                }
            } else if let Some(rest) = line.strip_prefix("Rss:")
                && let Some(cur) = current.as_mut()
            {
                cur.1 += rest
                    .split_whitespace()
                    .next()
                    .and_then(|v| v.parse::<f64>().ok())
                    .unwrap_or(0.0);
            }
        }
        flush(&mut current);
    }
    seen.values().fold(0.0, |a, b| a + b)
}

fn loadavg() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(f64::NAN)
}

/// log(y2 / y1) / log(x2 / x1) between the first and the last point.
fn slope(points: &[(usize, f64)]) -> Option<f64> {
    let (&(x1, y1), &(x2, y2)) = (points.first()?, points.last()?);
    (x2 > x1 && y1 > 0.0 && y2 > 0.0 && y1.is_finite() && y2.is_finite())
        .then(|| (y2 / y1).ln() / (x2 as f64 / x1 as f64).ln())
}

/// One figure of a chain point.
type Curve = fn(&ChainPoint) -> f64;

fn exponents(
    chains: &[ChainPoint],
    fan: &[FanoutPoint],
    floor: &[FloorPoint],
) -> Vec<(String, f64)> {
    let mut out = Vec::new();
    for placement in ["thread", "process"] {
        let pts: Vec<&ChainPoint> = chains
            .iter()
            .filter(|p| p.placement == placement && p.failed.is_none())
            .collect();
        let curves: [(&str, Curve); 6] = [
            ("spawn", |p| p.spawn_ms),
            ("compile", |p| p.compile_ms),
            ("teardown", |p| p.teardown_ms),
            ("round trip", |p| p.round_trip_us),
            ("per hop", |p| p.per_hop_us),
            ("pipelined throughput", |p| p.pipelined_per_s),
        ];
        for (curve, f) in curves {
            let v: Vec<(usize, f64)> = pts.iter().map(|p| (p.actors, f(p))).collect();
            if let Some(s) = slope(&v) {
                out.push((format!("{placement} chain: {curve}"), s));
            }
        }
        let v: Vec<(usize, f64)> = fan
            .iter()
            .filter(|p| p.placement == placement)
            .map(|p| (p.readers, p.round_trip_us))
            .collect();
        if let Some(s) = slope(&v) {
            out.push((format!("{placement} fan-out: round trip"), s));
        }
    }
    let v: Vec<(usize, f64)> = floor.iter().map(|p| (p.threads, p.per_hop_us)).collect();
    if let Some(s) = slope(&v) {
        out.push(("futex ring: per hop".into(), s));
    }
    out
}

fn print_tables(chains: &[ChainPoint], fan: &[FanoutPoint], exponents: &[(String, f64)]) {
    let f = |v: f64| {
        if !v.is_finite() {
            "-".to_string()
        } else if v >= 1000.0 {
            format!("{v:.0}")
        } else if v >= 10.0 {
            format!("{v:.1}")
        } else {
            format!("{v:.2}")
        }
    };
    println!(
        "| placement | actors | runs | spawn ms | compile ms | teardown ms | round trip µs | per hop µs | floor µs/hop | pipelined /s | driver KiB/actor | driver KiB/edge | worker KiB | shm KiB/edge |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for p in chains {
        println!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |{}",
            p.placement,
            p.actors,
            p.runs,
            f(p.spawn_ms),
            f(p.compile_ms),
            f(p.teardown_ms),
            f(p.round_trip_us),
            f(p.per_hop_us),
            p.floor_per_hop_us.map_or("-".into(), f),
            f(p.pipelined_per_s),
            f(p.driver_kib_per_actor),
            f(p.driver_kib_per_edge),
            p.worker_kib.map_or("-".into(), f),
            f(p.shm_kib_per_edge),
            p.failed
                .as_deref()
                .map_or(String::new(), |e| format!(" failed: {e}"))
        );
    }
    println!();
    println!("| placement | readers | round trip µs | × one reader |");
    println!("|---|---:|---:|---:|");
    for p in fan {
        println!(
            "| {} | {} | {} | {} |",
            p.placement,
            p.readers,
            f(p.round_trip_us),
            f(p.vs_one_reader)
        );
    }
    println!();
    println!("| curve | growth exponent (log-log, smallest to largest size) |");
    println!("|---|---:|");
    for (curve, s) in exponents {
        println!("| {curve} | {s:.2} |");
    }
}
