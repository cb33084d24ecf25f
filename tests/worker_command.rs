//! `adag::set_worker_command`: workers started by another program (here this test binary
//! running only `worker_entry`), which enters the worker through `adag::init` — the start-up
//! hook leaves such a worker alone.
use adag::{CompileOptions, Dag, Placement, Runtime};
use std::sync::atomic::{AtomicBool, Ordering};

/// Set by `worker_entry` before it calls `adag::init`: true in a worker only if the explicit
/// entry (not the start-up hook) made it one.
static ENTERED_EXPLICITLY: AtomicBool = AtomicBool::new(false);

#[derive(Default)]
pub struct Probe;

#[adag::actor]
impl Probe {
    pub fn entered(&mut self, x: u64) -> (bool, u64) {
        (ENTERED_EXPLICITLY.load(Ordering::SeqCst), x)
    }
}

/// The worker's `main` for the test below; run only in the child (`--ignored --exact`).
#[test]
#[ignore = "the entry of the worker processes of `worker_command_starts_workers`"]
fn worker_entry() {
    ENTERED_EXPLICITLY.store(true, Ordering::SeqCst);
    adag::init();
    // Not a worker (run by hand): nothing to do.
}

#[test]
fn worker_command_starts_workers() {
    let exe = std::env::current_exe().unwrap();
    adag::set_worker_command(Some((
        exe,
        [
            "worker_entry",
            "--exact",
            "--ignored",
            "-q",
            "--test-threads=1",
        ]
        .map(String::from)
        .to_vec(),
    )));
    let rt = Runtime::new().unwrap();
    let p = rt.spawn::<Probe>(Placement::Process, ()).unwrap();
    // Only the spawns above use the command.
    adag::set_worker_command(None);
    assert_eq!(p.call().entered(1).unwrap(), (true, 1));
    let dag = Dag::<u64>::new();
    let g = dag
        .compile(p.entered(dag.input()), CompileOptions::default())
        .unwrap();
    for i in 0..3 {
        assert_eq!(g.execute(i).unwrap().get().unwrap(), (true, i));
    }
    g.teardown().unwrap();
    // The default again: this executable, entered by the start-up hook.
    let q = rt.spawn::<Probe>(Placement::Process, ()).unwrap();
    assert_eq!(q.call().entered(2).unwrap(), (false, 2));
}
