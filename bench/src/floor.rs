//! The floors of a round trip on this machine: two threads, or two processes, handing a
//! counter back and forth through one shared cache line, spinning (then yielding, as adag's
//! own waits do, so that two ends sharing one CPU still make progress). No channel costs
//! less than this; `echo/thread` and `echo/process` are read against it.
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// The shared line: even values are the ping's, odd ones the pong's.
#[repr(C, align(64))]
pub struct Line(AtomicU64);

/// How long a waiting end spins before it starts yielding the CPU (adag's spin window).
const SPIN: Duration = Duration::from_micros(50);

/// Wait until `line` holds `want`, or `deadline` passes (`false` then).
fn wait_for(line: &AtomicU64, want: u64, deadline: Instant) -> bool {
    let start = Instant::now();
    let mut n = 0u32;
    while line.load(Ordering::Acquire) != want {
        n = n.wrapping_add(1);
        if n.is_multiple_of(64) {
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            if now - start > SPIN {
                std::thread::yield_now();
                continue;
            }
        }
        std::hint::spin_loop();
    }
    true
}

/// The pong side: answers `rounds` pings, then returns (or gives up at `deadline`).
pub fn pong(line: &AtomicU64, rounds: u64, deadline: Instant) -> bool {
    for k in 0..rounds {
        if !wait_for(line, 2 * k + 1, deadline) {
            return false;
        }
        line.store(2 * k + 2, Ordering::Release);
    }
    true
}

/// The ping side: `rounds` round trips, each one timed by `record`.
pub fn ping(
    line: &AtomicU64,
    rounds: u64,
    deadline: Instant,
    mut record: impl FnMut(Duration),
) -> bool {
    for k in 0..rounds {
        let t = Instant::now();
        line.store(2 * k + 1, Ordering::Release);
        if !wait_for(line, 2 * k + 2, deadline) {
            return false;
        }
        record(t.elapsed());
    }
    true
}

/// Round trips between this thread and another one.
pub fn threads(rounds: u64, record: impl FnMut(Duration)) -> anyhow::Result<()> {
    let line = std::sync::Arc::new(Line(AtomicU64::new(0)));
    let deadline = Instant::now() + Duration::from_secs(120);
    let other = line.clone();
    let t = std::thread::spawn(move || pong(&other.0, rounds, deadline));
    let ok = ping(&line.0, rounds, deadline, record);
    let answered = t
        .join()
        .map_err(|_| anyhow::anyhow!("the pong thread panicked"))?;
    anyhow::ensure!(ok && answered, "the thread ping-pong ran past its deadline");
    Ok(())
}

/// Round trips between this process and a child forked for it, through an anonymous shared
/// mapping.
pub fn processes(rounds: u64, record: impl FnMut(Duration)) -> anyhow::Result<()> {
    use rustix::mm::{MapFlags, ProtFlags, mmap_anonymous, munmap};
    let len = std::mem::size_of::<Line>();
    // SAFETY: a fresh anonymous mapping of one line, unmapped below once the child is gone;
    // nothing else refers to it.
    let ptr = unsafe {
        mmap_anonymous(
            std::ptr::null_mut(),
            len,
            ProtFlags::READ | ProtFlags::WRITE,
            MapFlags::SHARED,
        )?
    };
    // SAFETY: the mapping is page-aligned, zeroed (a valid `AtomicU64` 0) and outlives every
    // use below; both processes touch it only through atomics.
    let line: &AtomicU64 = unsafe { &(*(ptr as *const Line)).0 };
    let deadline = Instant::now() + Duration::from_secs(120);
    // SAFETY: the child runs only the spinning `pong` over the shared line (atomics, the
    // clock and sched_yield: no allocation, no lock another thread could hold) and leaves
    // with `_exit`, so the threads this process had before the fork do not matter to it.
    let child = unsafe { libc::fork() };
    if child < 0 {
        anyhow::bail!("fork failed: {}", std::io::Error::last_os_error());
    }
    if child == 0 {
        let ok = pong(line, rounds, deadline);
        // SAFETY: ends the child at once, running no destructor or atexit handler of the
        // parent's state.
        unsafe { libc::_exit(if ok { 0 } else { 1 }) };
    }
    let ok = ping(line, rounds, deadline, record);
    let mut status = 0;
    // SAFETY: waits for our own child, whose pid fork returned.
    let waited = unsafe { libc::waitpid(child, &mut status, 0) };
    // SAFETY: the child has exited (waited for above): nothing maps the line any more but us.
    unsafe { munmap(ptr, len)? };
    anyhow::ensure!(waited == child, "waitpid failed");
    anyhow::ensure!(
        ok && libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "the process ping-pong ran past its deadline"
    );
    Ok(())
}
