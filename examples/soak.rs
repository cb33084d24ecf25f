//! Soak: a pipelined chain of three process actors runs many executions, each checked one by
//! one, while the resources of the driver and of every worker are watched.
//!
//! Every execution's input carries its index and a checksum. Each stage checks the checksum
//! and that indices reach it in order (no loss, duplicate or reordering on the way in), then
//! updates both; the driver checks that the result of ref `i` is execution `i`, went through
//! all three stages, and carries the expected checksum. Resident memory (`VmRSS`), open fds
//! (`/proc/<pid>/fd`) and mappings (`/proc/<pid>/maps`) of the driver and of each worker are
//! taken after a warm-up and at the end; growth past a small tolerance fails the run.
//!
//! Run: `cargo run --release --example soak -- --n 1000000 [--inflight 8]`
//! (exit status 0 = every execution checked and nothing grew; 1 = a failure, printed.)
//!
//! `tests/reliability.rs` includes this file (`soak_short`) to run the same checks on a
//! shorter run in CI.
use adag::{CompileOptions, Dag, Placement, Runtime};
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// The value that travels through the chain.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Item {
    /// The execution's index.
    pub idx: u64,
    /// How many stages it went through.
    pub hops: u32,
    /// Checksum over the index, the payload and the stages passed.
    pub check: u64,
    /// A few bytes derived from the index, so the payload is checked as well.
    pub payload: Vec<u8>,
}

/// A 64-bit mix (splitmix64's finalizer).
pub fn mix(mut x: u64) -> u64 {
    x ^= x >> 30;
    x = x.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x ^= x >> 27;
    x = x.wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

fn payload_sum(p: &[u8]) -> u64 {
    p.iter().fold(0u64, |acc, b| mix(acc ^ u64::from(*b)))
}

impl Item {
    /// The input of execution `idx`.
    pub fn input(idx: u64) -> Item {
        let len = (idx % 24) as usize;
        let payload: Vec<u8> = (0..len).map(|i| (mix(idx) >> (i % 8 * 8)) as u8).collect();
        let check = mix(idx ^ payload_sum(&payload));
        Item {
            idx,
            hops: 0,
            check,
            payload,
        }
    }

    /// The checksum after stage `k` (stage keys are distinct).
    pub fn step_check(check: u64, k: u64) -> u64 {
        mix(check ^ k)
    }

    /// What the driver expects back from execution `idx` through stages `keys`.
    pub fn expected(idx: u64, keys: &[u64]) -> Item {
        let mut it = Item::input(idx);
        for k in keys {
            it.check = Item::step_check(it.check, *k);
            it.hops += 1;
        }
        it
    }
}

/// One stage of the chain.
pub struct SoakStage {
    /// This stage's key and position (0, 1, 2): the checksum it expects depends on both.
    key: u64,
    upstream: Vec<u64>,
    next: u64,
}

#[adag::actor]
impl SoakStage {
    /// `keys[..pos]` are the stages before this one, `keys[pos]` is this one's key.
    pub fn new(keys: Vec<u64>, pos: u32) -> Self {
        SoakStage {
            key: keys[pos as usize],
            upstream: keys[..pos as usize].to_vec(),
            next: 0,
        }
    }

    /// Check the item (order and checksum), then pass it on.
    pub fn step(&mut self, mut x: Item) -> Result<Item, String> {
        if x.idx != self.next {
            return Err(format!(
                "stage {:#x}: got execution {} where {} was due (lost, duplicated or reordered)",
                self.key, x.idx, self.next
            ));
        }
        let want = Item::expected(x.idx, &self.upstream);
        if x != want {
            return Err(format!(
                "stage {:#x}: execution {} arrived corrupted: {x:?}, expected {want:?}",
                self.key, x.idx
            ));
        }
        self.next += 1;
        x.check = Item::step_check(x.check, self.key);
        x.hops += 1;
        Ok(x)
    }

    /// How many items this stage passed on.
    pub fn seen(&self) -> u64 {
        self.next
    }
}

/// Resident memory, open fds and mappings of one process.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProcStats {
    /// `VmRSS` in KiB.
    pub rss_kib: u64,
    /// Entries of `/proc/<pid>/fd`.
    pub fds: usize,
    /// Lines of `/proc/<pid>/maps`.
    pub maps: usize,
}

/// The `VmRSS` of `pid` in KiB (0 when unreadable).
pub fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}

/// Open fds of `pid` (entries of `/proc/<pid>/fd`).
pub fn fd_count(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count())
}

/// The targets of the open fds of `pid`, for reports.
pub fn fd_targets(pid: u32) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| {
                    let t = std::fs::read_link(e.path())
                        .map_or_else(|_| "?".into(), |p| p.display().to_string());
                    format!("{} -> {t}", e.file_name().to_string_lossy())
                })
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// Mappings of `pid` (lines of `/proc/<pid>/maps`).
pub fn maps_count(pid: u32) -> usize {
    std::fs::read_to_string(format!("/proc/{pid}/maps")).map_or(0, |s| s.lines().count())
}

/// Threads of `pid` (entries of `/proc/<pid>/task`).
pub fn thread_count(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/task")).map_or(0, |d| d.count())
}

impl ProcStats {
    /// The figures of `pid` now.
    pub fn of(pid: u32) -> ProcStats {
        ProcStats {
            rss_kib: rss_kib(pid),
            fds: fd_count(pid),
            maps: maps_count(pid),
        }
    }
}

/// How much the figures may grow between the warm-up and the end.
#[derive(Clone, Copy, Debug)]
pub struct Tolerance {
    /// Extra fds.
    pub fds: usize,
    /// Extra mappings.
    pub maps: usize,
    /// Extra resident KiB.
    pub rss_kib: u64,
}

impl Default for Tolerance {
    fn default() -> Self {
        Tolerance {
            fds: 2,
            maps: 8,
            rss_kib: 8 * 1024,
        }
    }
}

/// The figures of one process at the start (after the warm-up) and at the end.
#[derive(Clone, Debug)]
pub struct ProcRow {
    /// `driver` or the worker's actor name.
    pub who: String,
    /// Its pid.
    pub pid: u32,
    /// After the warm-up.
    pub start: ProcStats,
    /// After the last execution.
    pub end: ProcStats,
}

/// What a soak run saw.
#[derive(Clone, Debug)]
pub struct SoakReport {
    /// Executions checked.
    pub executions: u64,
    /// Executions run before the start figures were taken.
    pub warmup: u64,
    /// Time of the measured part.
    pub elapsed: Duration,
    /// One row per process.
    pub rows: Vec<ProcRow>,
    /// Every check that failed (empty = pass).
    pub failures: Vec<String>,
}

impl SoakReport {
    /// Executions per second of the measured part.
    pub fn rate(&self) -> f64 {
        (self.executions - self.warmup) as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }

    /// A table of the figures.
    pub fn table(&self) -> String {
        let mut s = format!(
            "{} executions ({} warm-up) in {:.2?} after the warm-up: {:.0} executions/s\n",
            self.executions,
            self.warmup,
            self.elapsed,
            self.rate()
        );
        s += &format!(
            "{:<12} {:>8} {:>12} {:>12} {:>9} {:>9} {:>9} {:>9}\n",
            "process",
            "pid",
            "VmRSS start",
            "VmRSS end",
            "fds start",
            "fds end",
            "maps start",
            "maps end"
        );
        for r in &self.rows {
            s += &format!(
                "{:<12} {:>8} {:>9} KiB {:>8} KiB {:>9} {:>9} {:>9} {:>9}\n",
                r.who,
                r.pid,
                r.start.rss_kib,
                r.end.rss_kib,
                r.start.fds,
                r.end.fds,
                r.start.maps,
                r.end.maps
            );
        }
        s
    }
}

/// Run the soak: `n` executions with `inflight` of them in flight, checked one by one.
pub fn run_soak(n: u64, inflight: usize, tol: Tolerance) -> adag::Result<SoakReport> {
    let keys: Vec<u64> = vec![0x5151_0001, 0x5151_0002, 0x5151_0003];
    let rt = Runtime::new()?;
    let stages = (0..3u32)
        .map(|pos| {
            rt.spawn_named::<SoakStage>(
                Placement::Process,
                format!("stage{pos}"),
                (keys.clone(), pos),
            )
        })
        .collect::<adag::Result<Vec<_>>>()?;
    let dag = Dag::<Item>::new();
    let out = stages[2].step(stages[1].step(stages[0].step(dag.input())));
    let graph = dag.compile(
        out,
        CompileOptions::default().max_inflight_executions(inflight.max(1)),
    )?;
    let me = std::process::id();
    let mut pids = vec![("driver".to_string(), me)];
    for s in &stages {
        pids.push((
            s.name().to_string(),
            s.pid().expect("a process actor has a pid"),
        ));
    }
    let warmup = (n / 20).min(5_000);
    let mut failures = Vec::new();
    let mut pending: VecDeque<(u64, adag::CompiledRef<Item>)> = VecDeque::with_capacity(inflight);
    let mut starts = Vec::new();
    let mut t0 = Instant::now();
    let mut checked = 0u64;
    let mut check = |idx: u64, r: adag::CompiledRef<Item>, failures: &mut Vec<String>| {
        checked += 1;
        match r.get() {
            Ok(v) => {
                let want = Item::expected(idx, &keys);
                if v != want {
                    failures.push(format!("execution {idx}: got {v:?}, expected {want:?}"));
                }
            }
            Err(e) => failures.push(format!("execution {idx}: {e}")),
        }
    };
    for idx in 0..n {
        if idx == warmup {
            // Drain, then take the start figures.
            while let Some((i, r)) = pending.pop_front() {
                check(i, r, &mut failures);
            }
            starts = pids.iter().map(|(_, pid)| ProcStats::of(*pid)).collect();
            t0 = Instant::now();
        }
        if pending.len() >= inflight.max(1) {
            let (i, r) = pending.pop_front().expect("non-empty");
            check(i, r, &mut failures);
        }
        match graph.execute(Item::input(idx)) {
            Ok(r) => pending.push_back((idx, r)),
            Err(e) => {
                failures.push(format!("execute {idx}: {e}"));
                break;
            }
        }
        if failures.len() > 20 {
            failures.push("(stopped after 20 failures)".into());
            break;
        }
    }
    while let Some((i, r)) = pending.pop_front() {
        check(i, r, &mut failures);
    }
    let elapsed = t0.elapsed();
    if starts.is_empty() {
        starts = pids.iter().map(|(_, pid)| ProcStats::of(*pid)).collect();
    }
    let ends: Vec<ProcStats> = pids.iter().map(|(_, pid)| ProcStats::of(*pid)).collect();
    if checked != n {
        failures.push(format!("{checked} executions checked, {n} submitted"));
    }
    graph.teardown()?;
    for s in &stages {
        let seen = s.call().seen()?;
        if seen != n {
            failures.push(format!("{} passed {seen} items on, expected {n}", s.name()));
        }
    }
    let rows: Vec<ProcRow> = pids
        .iter()
        .zip(starts.iter().zip(&ends))
        .map(|((who, pid), (start, end))| ProcRow {
            who: who.clone(),
            pid: *pid,
            start: *start,
            end: *end,
        })
        .collect();
    for r in &rows {
        if r.end.fds > r.start.fds + tol.fds {
            failures.push(format!(
                "{}: fds grew from {} to {}",
                r.who, r.start.fds, r.end.fds
            ));
        }
        if r.end.maps > r.start.maps + tol.maps {
            failures.push(format!(
                "{}: mappings grew from {} to {}",
                r.who, r.start.maps, r.end.maps
            ));
        }
        if r.end.rss_kib > r.start.rss_kib + tol.rss_kib {
            failures.push(format!(
                "{}: VmRSS grew from {} KiB to {} KiB",
                r.who, r.start.rss_kib, r.end.rss_kib
            ));
        }
    }
    Ok(SoakReport {
        executions: checked,
        warmup,
        elapsed,
        rows,
        failures,
    })
}

fn arg_value(args: &[String], name: &str) -> Option<u64> {
    args.iter().position(|a| a == name).map(|i| {
        args.get(i + 1)
            .and_then(|v| v.replace('_', "").parse().ok())
            .unwrap_or_else(|| {
                eprintln!("{name} takes a number");
                std::process::exit(2)
            })
    })
}

#[allow(dead_code)] // unused where tests/reliability.rs includes this file
fn main() {
    adag::init();
    let args: Vec<String> = std::env::args().collect();
    let n = arg_value(&args, "--n").unwrap_or(1_000_000);
    let inflight = arg_value(&args, "--inflight").unwrap_or(8) as usize;
    println!("soak: {n} executions through a chain of 3 process actors, {inflight} in flight");
    match run_soak(n, inflight, Tolerance::default()) {
        Ok(report) => {
            print!("{}", report.table());
            if report.failures.is_empty() {
                println!(
                    "PASS: every execution checked; no growth beyond {:?}",
                    Tolerance::default()
                );
            } else {
                for f in &report.failures {
                    println!("FAIL: {f}");
                }
                std::process::exit(1);
            }
        }
        Err(e) => {
            println!("FAIL: {e}");
            std::process::exit(1);
        }
    }
}
