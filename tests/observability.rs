//! Seeing inside a running graph: worker logs and tracing events reach the driver, the user's
//! RUST_BACKTRACE reaches the workers, a stalled log reader never stalls a graph, and the
//! timeline and statistics report what ran.
//!
//! The log tests run a child process of this test binary as the driver (one test function,
//! `scenario`, that does nothing unless `ADAG_OBS_SCENARIO` names a scenario), so that they
//! can read what that driver writes to its stdout and stderr.
use adag::{
    ActorHandle, CompileOptions, CompiledGraph, Dag, Node, OpKind, Placement, Runtime,
    TimelineEvent,
};
use std::collections::HashMap;
use std::io::Read;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Turns a hang into a failure; never a timing assertion.
const WATCHDOG: Duration = Duration::from_secs(120);

pub struct Chatty {
    k: u64,
}

#[adag::actor]
impl Chatty {
    pub fn new(k: u64) -> Self {
        Chatty { k }
    }

    /// Writes to stdout and stderr and emits tracing events at two levels.
    pub fn talk(&mut self, x: u64) -> u64 {
        println!("stdout line {x}");
        eprintln!("stderr line {x}");
        tracing::info!(x, "tracing info {x}");
        tracing::debug!("tracing debug {x}");
        x + self.k
    }

    /// Floods stdout: `lines` lines of 1000 characters.
    pub fn flood(&mut self, x: u64, lines: u64) -> u64 {
        let text = "y".repeat(1000);
        for i in 0..lines {
            println!("{x} {i} {text}");
        }
        x + self.k
    }

    pub fn backtrace_var(&self) -> Option<String> {
        std::env::var("RUST_BACKTRACE").ok()
    }

    pub fn size(&mut self, v: Vec<u8>) -> u64 {
        v.len() as u64
    }

    /// Sleeps a little: some busy time to measure.
    pub fn step(&mut self, x: u64) -> u64 {
        tracing::trace!(x, "stepping");
        std::thread::sleep(Duration::from_micros(200));
        x + self.k
    }
}

/// Run `f` on a thread; fail if it does not finish within the watchdog.
fn guarded<R: Send + 'static>(f: impl FnOnce() -> R + Send + 'static) -> R {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)));
    });
    match rx.recv_timeout(WATCHDOG) {
        Ok(Ok(r)) => r,
        Ok(Err(p)) => std::panic::resume_unwind(p),
        Err(_) => panic!("the test did not finish within {WATCHDOG:?}"),
    }
}

/// The child driver's side of the log tests.
#[test]
fn scenario() {
    match std::env::var("ADAG_OBS_SCENARIO").as_deref() {
        Ok("logs") => scenario_logs(),
        Ok("flood") => scenario_flood(),
        Ok("trace") => scenario_trace(),
        Ok("hosts") => scenario_hosts(),
        _ => {}
    }
}

fn scenario_logs() {
    tracing_subscriber::fmt()
        .with_max_level(tracing::Level::INFO)
        .with_writer(std::io::stdout)
        .init();
    let rt = Runtime::new().unwrap();
    let p = rt
        .spawn_named::<Chatty>(Placement::Process, "Chatty", 1)
        .unwrap();
    let t = rt
        .spawn_named::<Chatty>(Placement::Thread, "ChattyT", 1)
        .unwrap();
    println!("BACKTRACE={:?}", p.call().backtrace_var().unwrap());
    let dag = Dag::<u64>::new();
    let out = t.talk(p.talk(dag.input()));
    let graph = dag.compile(out, CompileOptions::default()).unwrap();
    for i in 0..3 {
        assert_eq!(graph.execute(i).unwrap().get().unwrap(), i + 2);
    }
    graph.teardown().unwrap();
    drop(graph);
    // The worker exits with its last handle; its forwarders then pass on what is left. Give
    // them a moment before this process exits (nothing here can wait on them).
    drop((p, t));
    std::thread::sleep(Duration::from_millis(500));
    println!("SCENARIO DONE");
}

/// A worker on another host (an agent started here as its own process tree) writes and emits
/// events; the driver prints them as its own workers'.
fn scenario_hosts() {
    tracing_subscriber::fmt()
        .with_max_level(tracing::Level::INFO)
        .with_writer(std::io::stdout)
        .init();
    let rt = Runtime::new().unwrap();
    let addr = rt
        .listen(adag::cluster::ClusterOptions::new("obs-secret"))
        .unwrap();
    let _hosts = adag::cluster::LocalHosts::start(1, addr, "obs-secret").unwrap();
    let joined = rt.wait_for_hosts(1, Duration::from_secs(60)).unwrap();
    let far = rt
        .spawn_named::<Chatty>(Placement::Host(joined[0].id), "Far", 1)
        .unwrap();
    let dag = Dag::<u64>::new();
    let graph = dag
        .compile(far.talk(dag.input()), CompileOptions::default())
        .unwrap();
    for i in 0..3 {
        assert_eq!(graph.execute(i).unwrap().get().unwrap(), i + 1);
    }
    graph.teardown().unwrap();
    drop(graph);
    drop(far);
    // The lines cross the network after the worker wrote them: wait (bounded) before leaving.
    std::thread::sleep(Duration::from_millis(1500));
    println!("SCENARIO DONE");
}

fn scenario_trace() {
    tracing_subscriber::fmt()
        .with_max_level(tracing::Level::TRACE)
        .with_writer(std::io::stdout)
        .init();
    let rt = Runtime::new().unwrap();
    let p = rt
        .spawn_named::<Chatty>(Placement::Process, "TraceP", 1)
        .unwrap();
    let t = rt
        .spawn_named::<Chatty>(Placement::Thread, "TraceT", 1)
        .unwrap();
    let dag = Dag::<u64>::new();
    let graph = dag
        .compile(t.step(p.step(dag.input())), CompileOptions::default())
        .unwrap();
    for i in 0..2 {
        graph.execute(i).unwrap().get().unwrap();
    }
    graph.teardown().unwrap();
    drop(graph);
    drop((p, t));
    std::thread::sleep(Duration::from_millis(500));
    println!("SCENARIO DONE");
}

fn scenario_flood() {
    let marker = std::env::var("ADAG_OBS_MARKER").unwrap();
    let rt = Runtime::new().unwrap();
    let p = rt
        .spawn_named::<Chatty>(Placement::Process, "Flood", 0)
        .unwrap();
    let dag = Dag::<u64>::new();
    let out = p.flood(dag.input(), 200);
    let graph = dag.compile(out, CompileOptions::default()).unwrap();
    let n = 100;
    for i in 0..n {
        assert_eq!(graph.execute(i).unwrap().get().unwrap(), i);
    }
    let stats = graph.stats();
    graph.teardown().unwrap();
    let actor = &stats.actors[0];
    std::fs::write(
        &marker,
        format!(
            "executions={} dropped={}",
            stats.edges.last().map_or(0, |e| e.messages),
            actor.log_lines_dropped
        ),
    )
    .unwrap();
}

/// Run the child driver for `scenario` with `env`; returns its stdout and stderr.
fn run_child(scenario: &str, env: &[(&str, &str)]) -> (String, String) {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(["--exact", "scenario", "--nocapture", "--test-threads=1"])
        .env("ADAG_OBS_SCENARIO", scenario)
        .env_remove("RUST_LOG")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = guarded(move || cmd.output().unwrap());
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        out.status.success(),
        "child driver failed\n--- stdout\n{stdout}\n--- stderr\n{stderr}"
    );
    (stdout, stderr)
}

fn temp_path(name: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("adag-obs-{}-{name}", std::process::id()))
}

#[test]
fn worker_output_and_tracing_reach_the_driver_with_the_actor_and_pid() {
    let timeline = temp_path("timeline.json");
    let (stdout, stderr) = run_child(
        "logs",
        &[
            ("RUST_BACKTRACE", "1"),
            ("ADAG_TIMELINE", timeline.to_str().unwrap()),
        ],
    );
    let all = format!("--- stdout\n{stdout}\n--- stderr\n{stderr}");
    assert!(stdout.contains("SCENARIO DONE"), "{all}");
    // Plain output of the process actor: prefixed with its name and pid, on the same stream.
    for x in 0..3 {
        assert!(
            stdout.lines().any(
                |l| l.starts_with("(Chatty pid=") && l.ends_with(&format!(") stdout line {x}"))
            ),
            "no prefixed stdout line {x}\n{all}"
        );
        assert!(
            stderr.lines().any(
                |l| l.starts_with("(Chatty pid=") && l.ends_with(&format!(") stderr line {x}"))
            ),
            "no prefixed stderr line {x}\n{all}"
        );
    }
    // Its tracing events come out of the driver's subscriber with the actor and pid.
    let forwarded: Vec<&str> = stdout
        .lines()
        .filter(|l| l.contains("tracing info") && l.contains("adag::worker"))
        .collect();
    assert_eq!(forwarded.len(), 3, "{all}");
    for l in &forwarded {
        assert!(l.contains("Chatty") && l.contains("pid="), "{l}");
        assert!(l.contains(" INFO "), "{l}");
    }
    // The thread actor's events are the driver's own, inside the actor's span.
    assert!(
        stdout
            .lines()
            .any(|l| l.contains("tracing info") && l.contains("actor{actor=ChattyT")),
        "{all}"
    );
    // The driver's filter (INFO) holds in the worker too.
    assert!(!all.contains("tracing debug"), "{all}");
    // The user's RUST_BACKTRACE reached the worker.
    assert!(stdout.contains("BACKTRACE=Some(\"1\")"), "{all}");
    // ADAG_TIMELINE wrote the graph's timeline at teardown.
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&timeline).unwrap()).unwrap();
    let _ = std::fs::remove_file(&timeline);
    let slices = json["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["ph"] == "X")
        .count();
    // Two actors, three operations each, three executions.
    assert_eq!(slices, 18, "{json}");
}

#[test]
fn output_and_events_of_workers_on_other_hosts_reach_the_driver_with_the_host() {
    let (stdout, stderr) = run_child("hosts", &[]);
    let all = format!("--- stdout\n{stdout}\n--- stderr\n{stderr}");
    assert!(stdout.contains("SCENARIO DONE"), "{all}");
    for x in 0..3 {
        assert!(
            stdout.lines().any(|l| l.starts_with("(Far pid=")
                && l.ends_with(&format!(", host=local-0) stdout line {x}"))),
            "no prefixed stdout line {x} of the remote worker\n{all}"
        );
        assert!(
            stderr.lines().any(|l| l.starts_with("(Far pid=")
                && l.ends_with(&format!(", host=local-0) stderr line {x}"))),
            "no prefixed stderr line {x} of the remote worker\n{all}"
        );
    }
    let forwarded: Vec<&str> = stdout
        .lines()
        .filter(|l| l.contains("tracing info") && l.contains("adag::worker"))
        .collect();
    assert_eq!(forwarded.len(), 3, "{all}");
    for l in &forwarded {
        assert!(
            l.contains("Far") && l.contains("local-0") && l.contains(" INFO "),
            "{l}"
        );
    }
    // The driver's level (INFO) reached the remote worker: no debug event crossed.
    assert!(!all.contains("tracing debug"), "{all}");
}

#[test]
fn the_library_traces_spawn_compile_executions_tasks_and_teardown() {
    let (stdout, stderr) = run_child("trace", &[]);
    let all = format!("--- stdout\n{stdout}\n--- stderr\n{stderr}");
    assert!(stdout.contains("SCENARIO DONE"), "{all}");
    let has = |what: &[&str]| stdout.lines().any(|l| what.iter().all(|w| l.contains(w)));
    assert!(has(&["spawned actor", "actor=TraceP", "pid="]), "{all}");
    assert!(has(&["compiled graph", "actors=2", "schedules="]), "{all}");
    assert!(has(&["submitted", "exec=1"]), "{all}");
    // The thread actor's tasks, in its actor and execution spans.
    assert!(
        has(&[
            "actor{actor=TraceT",
            "execution{exec=1}",
            "task{kind=\"compute\" name=step}",
            "stepping"
        ]),
        "{all}"
    );
    // The worker's events come to the driver with the spans they were in there.
    assert!(
        has(&[
            "adag::worker",
            "stepping",
            "actor=\"TraceP\"",
            "execution{exec=1}:task{kind=compute name=step}"
        ]),
        "{all}"
    );
    assert!(
        has(&["adag::worker", "schedule stopped", "executions=2"]),
        "{all}"
    );
    assert!(has(&["tearing down"]), "{all}");
}

#[test]
fn a_stalled_log_reader_drops_lines_and_never_stalls_the_graph() {
    let marker = temp_path("flood-marker");
    let _ = std::fs::remove_file(&marker);
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "scenario", "--nocapture", "--test-threads=1"])
        .env("ADAG_OBS_SCENARIO", "flood")
        .env("ADAG_OBS_MARKER", &marker)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // Nobody reads the child driver's stdout while its graph runs: its log writer blocks on a
    // full pipe, and the worker's lines must be dropped rather than stall the worker.
    let start = Instant::now();
    while !marker.exists() {
        if start.elapsed() > WATCHDOG {
            let _ = child.kill();
            panic!("the graph stalled behind a blocked log reader");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_millis(100));
    let report = std::fs::read_to_string(&marker).unwrap();
    let _ = std::fs::remove_file(&marker);
    // Now drain, so that the child can finish.
    let mut stdout = child.stdout.take().unwrap();
    let drained = std::thread::spawn(move || {
        let mut s = Vec::new();
        let _ = stdout.read_to_end(&mut s);
        s
    });
    let status = guarded(move || child.wait().unwrap());
    let out = String::from_utf8_lossy(&drained.join().unwrap()).into_owned();
    assert!(status.success(), "{report}");
    let fields: HashMap<&str, u64> = report
        .split_whitespace()
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k, v.parse().unwrap()))
        .collect();
    assert_eq!(fields["executions"], 100, "{report}");
    assert!(fields["dropped"] > 0, "{report}");
    // Lines that did get through are whole and prefixed (libtest's own "test scenario ... "
    // may precede one on its line).
    let bad: Vec<&str> = out
        .lines()
        .filter(|l| l.contains(" yyy") && !l.contains("(Flood pid="))
        .collect();
    assert!(
        bad.is_empty(),
        "unprefixed output: {:?}",
        &bad[..bad.len().min(3)]
    );
}

fn of(events: &[TimelineEvent], actor: &str, exec: u64, kind: OpKind) -> Vec<TimelineEvent> {
    events
        .iter()
        .filter(|e| e.actor == actor && e.exec == exec && e.kind == kind)
        .cloned()
        .collect()
}

#[test]
fn the_timeline_has_one_slice_per_operation_in_order_across_processes() {
    guarded(|| {
        let rt = Runtime::new().unwrap();
        let a = rt
            .spawn_named::<Chatty>(Placement::Process, "A", 1)
            .unwrap();
        let b = rt.spawn_named::<Chatty>(Placement::Thread, "B", 1).unwrap();
        let c = rt
            .spawn_named::<Chatty>(Placement::Process, "C", 1)
            .unwrap();
        let dag = Dag::<u64>::new();
        let out = c.step(b.step(a.step(dag.input())));
        let graph = dag
            .compile(out, CompileOptions::default().timeline(true))
            .unwrap();
        let n = 20;
        for i in 0..n {
            assert_eq!(graph.execute(i).unwrap().get().unwrap(), i + 3);
        }
        // Asked of the live graph (the workers answer over their control sockets), then
        // again after teardown (their last report).
        let live = graph.timeline();
        graph.teardown().unwrap();
        let t = graph.timeline();
        assert_eq!(t.dropped, 0);
        assert_eq!(t.events.len(), 3 * 3 * n as usize);
        assert!(live.events.len() >= t.events.len() - 3 * 3);
        for exec in 0..n {
            for actor in ["A", "B", "C"] {
                let read = of(&t.events, actor, exec, OpKind::Read);
                let compute = of(&t.events, actor, exec, OpKind::Compute);
                let write = of(&t.events, actor, exec, OpKind::Write);
                assert_eq!((read.len(), compute.len(), write.len()), (1, 1, 1));
                assert_eq!(compute[0].name, "step");
                let (r, cm, w) = (&read[0], &compute[0], &write[0]);
                assert!(
                    r.start_ns <= r.end_ns && r.end_ns <= cm.start_ns,
                    "{r:?} {cm:?}"
                );
                assert!(
                    cm.end_ns <= w.start_ns && w.start_ns <= w.end_ns,
                    "{cm:?} {w:?}"
                );
            }
            // One clock across processes: each stage computes after its upstream started
            // writing the value it needs.
            for (up, down) in [("A", "B"), ("B", "C")] {
                let w = &of(&t.events, up, exec, OpKind::Write)[0];
                let cm = &of(&t.events, down, exec, OpKind::Compute)[0];
                assert!(cm.start_ns >= w.start_ns, "{up} {w:?} then {down} {cm:?}");
            }
            // And each stage runs execution k after execution k - 1.
            if exec > 0 {
                let prev = &of(&t.events, "A", exec - 1, OpKind::Compute)[0];
                let now = &of(&t.events, "A", exec, OpKind::Compute)[0];
                assert!(now.start_ns >= prev.end_ns);
            }
        }
        let pids: std::collections::BTreeSet<u32> = t.events.iter().map(|e| e.pid).collect();
        assert_eq!(pids.len(), 3, "the driver and two workers");
        let json: serde_json::Value = serde_json::from_str(&t.to_chrome_json()).unwrap();
        let slices: Vec<&serde_json::Value> = json["traceEvents"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["ph"] == "X")
            .collect();
        assert_eq!(slices.len(), t.events.len());
        assert!(slices.iter().any(|e| e["name"] == "B.step"));
    });
}

#[test]
fn without_the_option_there_is_no_timeline() {
    guarded(|| {
        let rt = Runtime::new().unwrap();
        let a = rt.spawn::<Chatty>(Placement::Process, 1).unwrap();
        let dag = Dag::<u64>::new();
        let graph = dag
            .compile(a.step(dag.input()), CompileOptions::default())
            .unwrap();
        graph.execute(1).unwrap().get().unwrap();
        assert!(graph.timeline().events.is_empty());
    });
}

/// `input → P.step → T.step`: a process actor "P", then a thread actor "T" (each adds 1);
/// returns the graph and P.
fn two_steps(rt: &Runtime) -> (CompiledGraph<u64, Node<u64>>, ActorHandle<Chatty>) {
    let a = rt
        .spawn_named::<Chatty>(Placement::Process, "P", 1)
        .unwrap();
    let b = rt.spawn_named::<Chatty>(Placement::Thread, "T", 1).unwrap();
    let dag = Dag::<u64>::new();
    let graph = dag
        .compile(b.step(a.step(dag.input())), CompileOptions::default())
        .unwrap();
    (graph, a)
}

#[test]
fn statistics_count_what_ran() {
    guarded(|| {
        let rt = Runtime::new().unwrap();
        let (graph, a) = two_steps(&rt);
        let n = 30;
        for i in 0..n {
            graph.execute(i).unwrap().get().unwrap();
        }
        // Two in flight, then the second claimed first: the first's result is buffered.
        let r1 = graph.execute(100).unwrap();
        let r2 = graph.execute(101).unwrap();
        let s = graph.stats();
        assert_eq!(s.executions_submitted, n + 2);
        assert_eq!(s.executions_in_flight, 2);
        assert_eq!(s.results_buffered, 0);
        assert_eq!(r2.get().unwrap(), 103);
        let s = graph.stats();
        assert_eq!(s.executions_in_flight, 0);
        assert_eq!(s.results_buffered, 1);
        assert_eq!(r1.get().unwrap(), 102);
        assert_eq!(graph.stats().results_buffered, 0);
        // Every edge carried one message per execution, counted by its writer.
        assert_eq!(s.edges.len(), 3, "{s:?}");
        for e in &s.edges {
            assert_eq!(e.messages, n + 2, "{e:?}");
        }
        // The edges that cross into or out of the worker are encoded into shared memory.
        assert!(s.edges.iter().filter(|e| e.bytes > 0).count() >= 2, "{s:?}");
        graph.teardown().unwrap();
        // Once the loops stopped, each actor's count is final.
        let s = graph.stats();
        for a in &s.actors {
            assert!(a.reported, "{a:?}");
            assert_eq!(a.executions, n + 2, "{a:?}");
            assert!(a.busy > Duration::ZERO, "{a:?}");
        }
        assert_eq!(s.actors[0].pid, a.pid());
        assert_eq!(s.actors.iter().find(|a| a.actor == "T").unwrap().pid, None);
    });
}

/// An actor's busy time is its methods' time, not the time its loop waits for the next
/// input, also where a read, the method and the write run as one fused operation (as in this
/// chain of one-argument methods).
#[test]
fn busy_time_counts_the_methods_not_the_waits_for_input() {
    guarded(|| {
        let rt = Runtime::new().unwrap();
        let (graph, _) = two_steps(&rt);
        // Each actor waits ~300 ms for every input and runs its method for ~200 µs; only
        // the first execution is timed and the estimate scales it by three. Counting the
        // waits would give ~900 ms.
        let gap = Duration::from_millis(300);
        for i in 0..3 {
            std::thread::sleep(gap);
            assert_eq!(graph.execute(i).unwrap().get().unwrap(), i + 2);
        }
        graph.teardown().unwrap();
        let s = graph.stats();
        for a in &s.actors {
            assert!(a.reported, "{a:?}");
            assert_eq!(a.executions, 3, "{a:?}");
            // Three sleeps of at least 200 µs each, as the estimate counts them.
            assert!(a.busy >= Duration::from_micros(600), "{a:?}");
            assert!(a.busy < gap, "the waits were counted as busy time: {a:?}");
        }
    });
}

#[test]
fn growth_of_a_shared_memory_channel_is_counted() {
    guarded(|| {
        let rt = Runtime::new().unwrap();
        let a = rt.spawn::<Chatty>(Placement::Process, 0).unwrap();
        let dag = Dag::<Vec<u8>>::new();
        // Small slots: a large input grows the input channel.
        let graph = dag
            .compile(
                a.size(dag.input()),
                CompileOptions::default().buffer_size_bytes(4096),
            )
            .unwrap();
        assert_eq!(graph.execute(vec![7; 100]).unwrap().get().unwrap(), 100);
        assert_eq!(
            graph.execute(vec![7; 100_000]).unwrap().get().unwrap(),
            100_000
        );
        let s = graph.stats();
        let input = s.edges.iter().find(|e| e.label == "input").unwrap();
        assert_eq!(input.messages, 2);
        assert!(input.growths >= 1, "{input:?}");
        assert!(input.bytes >= 100_100, "{input:?}");
    });
}
