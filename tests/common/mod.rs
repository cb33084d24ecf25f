//! Shared support of the behaviour suite: the test actors, the placements every test runs
//! against, and the watchdog that turns a hang into a failure.
#![allow(dead_code)]

use adag::{ActorHandle, Placement, Runtime};
use std::any::Any;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

/// Generous per-placement time limit of one test body.
pub const WATCHDOG_SECS: u64 = 60;

/// xorshift64*: reproducible random choices of the tests (each test says where its seed
/// comes from and prints it when it varies).
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// A number below `n`, from the output's high bits.
    pub fn below(&mut self, n: u64) -> u64 {
        (self.next() >> 33) % n
    }
}

// ---------------------------------------------------------------------------------------
// Test actors
// ---------------------------------------------------------------------------------------

/// The workhorse: an echo/adder with methods of 0, 1, 2 and 3 arguments, a fallible method,
/// a panicking one, a tuple-returning one, a slow one and a stateful log.
pub struct Worker {
    k: u64,
    calls: u64,
    log: Vec<String>,
}

#[adag::actor]
impl Worker {
    pub fn new(k: u64) -> Self {
        Worker {
            k,
            calls: 0,
            log: Vec::new(),
        }
    }

    /// One argument: `x + k`.
    pub fn echo(&mut self, x: u64) -> u64 {
        self.calls += 1;
        x + self.k
    }

    /// Two arguments: `a + b + k`.
    pub fn add(&mut self, a: u64, b: u64) -> u64 {
        self.calls += 1;
        a + b + self.k
    }

    /// Three arguments, order-sensitive: `100 a + 10 b + c + k`.
    pub fn add3(&mut self, a: u64, b: u64, c: u64) -> u64 {
        self.calls += 1;
        100 * a + 10 * b + c + self.k
    }

    /// Order-sensitive difference of two nodes (fan-in): `1000 a + b`.
    pub fn combine(&mut self, a: u64, b: u64) -> u64 {
        self.calls += 1;
        1000 * a + b
    }

    /// No argument: how many of the methods above ran.
    pub fn calls(&self) -> u64 {
        self.calls
    }

    /// Fails (returns `Err`) for every `x` ending in the digit 3.
    pub fn checked(&mut self, x: u64) -> Result<u64, String> {
        if x % 10 == 3 {
            Err(format!("bad input {x}"))
        } else {
            Ok(x + self.k)
        }
    }

    /// A fallible tuple result: fails like `checked`, else `(x + k, "v{x}")`.
    pub fn try_pair(&mut self, x: u64) -> Result<(u64, String), String> {
        if x % 10 == 3 {
            Err(format!("bad pair {x}"))
        } else {
            Ok((x + self.k, format!("v{x}")))
        }
    }

    /// Panics for `x == 13`.
    pub fn boom(&mut self, x: u64) -> u64 {
        if x == 13 {
            panic!("boom at {x}");
        }
        x + self.k
    }

    /// A tuple result: `(x + k, "v{x}")`.
    pub fn pair(&mut self, x: u64) -> (u64, String) {
        (x + self.k, format!("v{x}"))
    }

    /// Sleeps `ms` milliseconds, then `x + k`.
    pub fn slow(&mut self, x: u64, ms: u64) -> u64 {
        std::thread::sleep(Duration::from_millis(ms));
        x + self.k
    }

    /// Waits until the file `{dir}/go{x}` exists (30 s at most), then creates
    /// `{dir}/done{x}` and returns `x + k`: a method the test finishes when it chooses, whose
    /// end it can see from any process.
    pub fn wait_file(&mut self, x: u64, dir: String) -> u64 {
        let dir = std::path::Path::new(&dir);
        let go = dir.join(format!("go{x}"));
        let t = std::time::Instant::now();
        while !go.exists() && t.elapsed() < Duration::from_secs(30) {
            std::thread::sleep(Duration::from_millis(2));
        }
        let _ = std::fs::write(dir.join(format!("done{x}")), b"");
        x + self.k
    }

    /// The length of a string.
    pub fn strlen(&mut self, s: String) -> u64 {
        s.len() as u64
    }

    /// `"{s}!"`.
    pub fn shout(&mut self, s: String) -> String {
        format!("{s}!")
    }

    /// Appends `f{x}` to the log; returns the log's length.
    pub fn note_f(&mut self, x: u64) -> u64 {
        self.log.push(format!("f{x}"));
        self.log.len() as u64
    }

    /// Appends `g{x}` to the log; returns the log's length.
    pub fn note_g(&mut self, x: u64) -> u64 {
        self.log.push(format!("g{x}"));
        self.log.len() as u64
    }

    /// The log so far.
    pub fn log(&self) -> Vec<String> {
        self.log.clone()
    }

    /// `n` bytes: byte `i` is `(i + k) % 251`.
    pub fn fill(&mut self, n: u64) -> Vec<u8> {
        (0..n).map(|i| ((i + self.k) % 251) as u8).collect()
    }

    /// `(length, sum of the bytes)` of a buffer.
    pub fn digest(&mut self, v: Vec<u8>) -> (u64, u64) {
        (v.len() as u64, v.iter().map(|b| *b as u64).sum())
    }

    /// Fails for `x` ending in 3 with an anyhow chain: two contexts over an I/O error.
    pub fn layered(&mut self, x: u64) -> anyhow::Result<u64> {
        if x % 10 == 3 {
            let root = std::io::Error::new(
                std::io::ErrorKind::NotFound,
                format!("file {x}.bin is missing"),
            );
            return Err(anyhow::Error::new(root)
                .context(format!("loading shard {x}"))
                .context("step failed"));
        }
        Ok(x + self.k)
    }

    /// Fails for `x` ending in 3, from 13 on, with a `std::error::Error` whose source is an
    /// I/O error.
    pub fn shard(&mut self, x: u64) -> Result<u64, ShardError> {
        if x >= 10 && x % 10 == 3 {
            return Err(ShardError {
                shard: x,
                source: std::io::Error::new(std::io::ErrorKind::PermissionDenied, "disk says no"),
            });
        }
        Ok(x + self.k)
    }

    /// A tensor whose data lives on (a pretend) `cuda:0`: 4 `f32`s.
    pub fn on_device(&mut self, _x: u64) -> adag::Tensor {
        adag::Tensor::from_device_buffer(
            adag::DType::F32,
            vec![4],
            std::sync::Arc::new(FakeDeviceBuffer),
        )
        .expect("a 16-byte device buffer for 4 f32s")
    }
}

/// A device buffer that only pretends to be on `cuda:0`.
#[derive(Debug)]
pub struct FakeDeviceBuffer;

impl adag::tensor::DeviceBuffer for FakeDeviceBuffer {
    fn device(&self) -> adag::Device {
        adag::Device::Cuda(0)
    }
    fn nbytes(&self) -> usize {
        16
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// A shard that could not be read, caused by an I/O error.
#[derive(Debug)]
pub struct ShardError {
    pub shard: u64,
    pub source: std::io::Error,
}

impl std::fmt::Display for ShardError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "shard {} unreadable", self.shard)
    }
}

impl std::error::Error for ShardError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.source)
    }
}

/// What `Worker(k).fill(n)` then `digest` gives.
pub fn fill_digest(n: u64, k: u64) -> (u64, u64) {
    (n, (0..n).map(|i| (i + k) % 251).sum())
}

/// A counter built with `Default` (no `new`): `bump` returns how many times it ran.
#[derive(Default)]
pub struct Counter {
    n: u64,
}

#[adag::actor]
impl Counter {
    /// Counts one call; returns the count so far.
    pub fn bump(&mut self, _x: u64) -> u64 {
        self.n += 1;
        self.n
    }

    /// The count so far.
    pub fn count(&self) -> u64 {
        self.n
    }
}

/// A named-part input.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct Req {
    pub k: String,
    pub v: u64,
}

// ---------------------------------------------------------------------------------------
// Placements
// ---------------------------------------------------------------------------------------

/// Whether process actors can be spawned in this build (tried once per test binary).
pub fn process_actors_available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        let Ok(rt) = Runtime::new() else {
            return false;
        };
        match rt.spawn::<Worker>(Placement::Process, 0) {
            Ok(h) => {
                // Make sure it really answers, not just that it started.
                let ok = matches!(h.call().echo(1), Ok(1));
                drop(h);
                ok
            }
            Err(_) => false,
        }
    })
}

/// The placements every test runs against: `Thread` always; `Process` when process actors
/// work, or always when `ADAG_TEST_PROCESS=1` (so that their failures show).
pub fn placements() -> Vec<Placement> {
    let forced = std::env::var("ADAG_TEST_PROCESS").is_ok_and(|v| v == "1");
    vec![Placement::Thread, Placement::Process]
        .into_iter()
        .filter(|p| *p == Placement::Thread || forced || process_actors_available())
        .collect()
}

// ---------------------------------------------------------------------------------------
// Watchdog
// ---------------------------------------------------------------------------------------

fn panic_text(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "<non-string panic>".to_string()
    }
}

/// Run `body` on its own thread; panic naming `name` if it does not finish within `secs`.
/// A panic of the body is passed on, prefixed with `name`.
pub fn with_watchdog<R: Send + 'static>(
    name: &str,
    secs: u64,
    body: impl FnOnce() -> R + Send + 'static,
) -> R {
    let (tx, rx) = mpsc::channel();
    let handle = std::thread::Builder::new()
        .name(name.to_string())
        .spawn(move || {
            let r = catch_unwind(AssertUnwindSafe(body));
            let _ = tx.send(r);
        })
        .expect("cannot start the test thread");
    match rx.recv_timeout(Duration::from_secs(secs)) {
        Ok(Ok(v)) => {
            let _ = handle.join();
            v
        }
        Ok(Err(payload)) => {
            let _ = handle.join();
            let text = panic_text(&*payload);
            resume_unwind(Box::new(format!("{name}: {text}")))
        }
        Err(RecvTimeoutError::Timeout) => {
            panic!("watchdog: test `{name}` did not finish within {secs} s (a hang)")
        }
        Err(RecvTimeoutError::Disconnected) => {
            panic!("watchdog: test `{name}` stopped without a result")
        }
    }
}

/// Run `body` once per placement, each run under the watchdog and labelled `name [placement]`.
pub fn each_placement(name: &str, body: impl Fn(Placement) + Send + Sync + 'static) {
    let places = with_watchdog(&format!("{name} (placements)"), WATCHDOG_SECS, placements);
    let body = Arc::new(body);
    for p in places {
        let body = body.clone();
        with_watchdog(&format!("{name} [{p:?}]"), WATCHDOG_SECS, move || body(p));
    }
}

// ---------------------------------------------------------------------------------------
// Small helpers
// ---------------------------------------------------------------------------------------

/// Spawn a `Worker` adding `k`, failing the test with the placement on error.
pub fn worker(rt: &Runtime, p: Placement, k: u64) -> ActorHandle<Worker> {
    rt.spawn::<Worker>(p, k)
        .unwrap_or_else(|e| panic!("[{p:?}] spawn Worker({k}): {e}"))
}

/// Spawn a named `Worker`.
pub fn named_worker(rt: &Runtime, p: Placement, name: &str, k: u64) -> ActorHandle<Worker> {
    rt.spawn_named::<Worker>(p, name, k)
        .unwrap_or_else(|e| panic!("[{p:?}] spawn Worker {name}({k}): {e}"))
}

/// Spawn a `Counter`.
pub fn counter(rt: &Runtime, p: Placement) -> ActorHandle<Counter> {
    rt.spawn::<Counter>(p, ())
        .unwrap_or_else(|e| panic!("[{p:?}] spawn Counter: {e}"))
}

/// The error of `r`, or a failure naming `what` when it is `Ok`.
#[track_caller]
pub fn expect_err<T>(r: adag::Result<T>, what: &str) -> adag::Error {
    match r {
        Ok(_) => panic!("{what}: expected an error, got Ok"),
        Err(e) => e,
    }
}

/// An actor whose constructor fails on demand.
pub struct Picky {
    v: u64,
}

#[adag::actor]
impl Picky {
    pub fn new(v: u64) -> Result<Self, String> {
        if v == 0 {
            Err("zero is not allowed".to_string())
        } else {
            Ok(Picky { v })
        }
    }

    pub fn value(&self) -> u64 {
        self.v
    }
}

/// A fresh, empty directory for files a test and its actors share.
pub fn scratch_dir(name: &str) -> std::path::PathBuf {
    static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("adag-{name}-{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

/// Lets `wait_file(x, dir)` finish.
pub fn go(dir: &std::path::Path, x: u64) {
    std::fs::write(dir.join(format!("go{x}")), b"").expect("go file");
}

/// Whether `wait_file(x, dir)` has finished.
pub fn done(dir: &std::path::Path, x: u64) -> bool {
    dir.join(format!("done{x}")).exists()
}
