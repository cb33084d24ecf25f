//! Where a waiting thread runs: whether it shares its CPU with a runnable thread, whether the
//! kernel counts a CPU that may be idle, and moving the thread to another CPU.
//!
//! The wait strategy ([`wait`](super::wait)) needs these to get two ends of a ping-pong off one
//! CPU: a futex wake-up may place the woken thread beside its waker, and two threads that hand
//! one CPU to each other by `sched_yield` never leave its run queue, so the load balancer sees
//! two cache-hot tasks and rarely moves either (measured here: ~1.9 µs a round trip instead of
//! ~0.45 for as long as 10-20 ms, and sometimes a whole benchmark round).
//!
//! All three read or ask the kernel (a proc file opened, read and closed, two
//! `sched_setaffinity`), so the wait strategy calls them at most once per interval of a run of
//! yields, never per wait. None keeps a file open between calls.

/// Nanoseconds this thread has spent runnable but waiting for its CPU (the second field of
/// `/proc/thread-self/schedstat`). It grows while the thread yields to another runnable
/// thread on its CPU, and not while it yields on a CPU of its own (the yield returns at
/// once). `None` where the kernel does not keep it (no `CONFIG_SCHED_INFO`).
#[cfg(not(loom))]
pub(crate) fn queued_ns() -> Option<u64> {
    let text = read_proc_file("/proc/thread-self/schedstat")?;
    text.split_whitespace().nth(1)?.parse().ok()
}

/// The text of a small proc file, opened for this read and closed after it. Keeping the file
/// open would save ~2 µs a read (a `pread` at offset 0 makes it afresh: ~0.5 µs instead of
/// ~2.7 µs with the open, measured here), but these reads happen at most once per look (every
/// 250 µs or more, while the thread has nothing else to do), and a file kept open is an fd
/// per waiting thread that outlives every graph and counts against the process's limit.
#[cfg(not(loom))]
fn read_proc_file(path: &str) -> Option<String> {
    use std::io::Read;
    let mut text = String::with_capacity(128);
    std::fs::File::open(path)
        .ok()?
        .take(256)
        .read_to_string(&mut text)
        .ok()?;
    Some(text)
}

#[cfg(loom)]
pub(crate) fn queued_ns() -> Option<u64> {
    None
}

/// Whether the kernel counts no more runnable threads than this process may use CPUs (the
/// fourth field of `/proc/loadavg`, `running/total`; it counts the caller): a thread that
/// shares its CPU with its peer may then find another one idle. `false` when that cannot be
/// read. Where the threads truly outnumber the CPUs, sharing is unavoidable and moving only
/// shuffles them.
#[cfg(not(loom))]
pub(crate) fn a_cpu_may_be_idle() -> bool {
    static CPUS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    let cpus = *CPUS.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let Some(text) = read_proc_file("/proc/loadavg") else {
        return false;
    };
    text.split_whitespace()
        .nth(3)
        .and_then(|field| field.split_once('/'))
        .and_then(|(running, _)| running.parse::<usize>().ok())
        .is_some_and(|running| running <= cpus)
}

#[cfg(loom)]
pub(crate) fn a_cpu_may_be_idle() -> bool {
    false
}

/// Moves the calling thread off the CPU it runs on, to another CPU it is allowed, and leaves
/// its allowed set as it was: the kernel migrates a thread at once when its own CPU leaves
/// its mask, and does not move it back when the mask is restored. Returns the CPU it left, or
/// `None` (nothing changed) where the thread may run on one CPU only (it was pinned: that is
/// respected) or the kernel refuses.
#[cfg(not(loom))]
pub(crate) fn move_to_another_cpu() -> Option<usize> {
    use rustix::thread::{sched_getaffinity, sched_getcpu, sched_setaffinity};
    let allowed = sched_getaffinity(None).ok()?;
    let here = sched_getcpu();
    if allowed.count() < 2 || !allowed.is_set(here) {
        return None;
    }
    let mut elsewhere = allowed;
    elsewhere.unset(here);
    sched_setaffinity(None, &elsewhere).ok()?;
    // Restoring can only fail if the set became invalid meanwhile (a cpuset shrunk under us);
    // the thread then keeps the narrower set, which the kernel accepted a moment ago.
    let _ = sched_setaffinity(None, &allowed);
    Some(here)
}

#[cfg(loom)]
pub(crate) fn move_to_another_cpu() -> Option<usize> {
    None
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn the_time_spent_queued_is_read_and_never_goes_back() {
        let Some(before) = queued_ns() else {
            // A kernel without schedstat: the wait strategy then never moves a thread.
            return;
        };
        std::thread::yield_now();
        let after = queued_ns().expect("readable once, readable again");
        assert!(after >= before, "{after} < {before}");
    }

    /// Two threads that yield to each other on one CPU each spend about half their time
    /// queued: what the wait strategy takes for a CPU shared with a peer.
    #[test]
    fn threads_yielding_to_each_other_on_one_cpu_are_counted_queued() {
        if queued_ns().is_none() {
            return;
        }
        let cpu = rustix::thread::sched_getcpu();
        let yield_on_one_cpu = move || {
            let mut only = rustix::thread::CpuSet::new();
            only.set(cpu);
            rustix::thread::sched_setaffinity(None, &only).unwrap();
            let (start, queued_before) = (std::time::Instant::now(), queued_ns().unwrap());
            while start.elapsed() < std::time::Duration::from_millis(40) {
                std::thread::yield_now();
            }
            (start.elapsed(), queued_ns().unwrap() - queued_before)
        };
        let threads = [
            std::thread::spawn(yield_on_one_cpu),
            std::thread::spawn(yield_on_one_cpu),
        ];
        for thread in threads {
            let (elapsed, queued) = thread.join().unwrap();
            // A quarter is the wait strategy's threshold; the first thread alone on the CPU
            // for a moment before the second starts is why it is not a half here.
            assert!(
                queued as u128 >= elapsed.as_nanos() / 4,
                "queued {queued} ns of {elapsed:?}"
            );
        }
    }

    /// A thread that looked keeps no file of its own open afterwards: an fd per thread that
    /// ever waited would outlive every graph (and a leak check counts it).
    #[test]
    fn looking_leaves_no_file_open() {
        let (own_schedstat, open) = std::thread::spawn(|| {
            let _ = queued_ns();
            let _ = a_cpu_may_be_idle();
            let own_schedstat = std::fs::read_link("/proc/thread-self")
                .map(|task| std::path::Path::new("/proc").join(task).join("schedstat"))
                .unwrap();
            let open: Vec<_> = std::fs::read_dir("/proc/self/fd")
                .unwrap()
                .filter_map(|entry| std::fs::read_link(entry.ok()?.path()).ok())
                .collect();
            (own_schedstat, open)
        })
        .join()
        .unwrap();
        assert!(
            !open.contains(&own_schedstat),
            "{own_schedstat:?} still open: {open:?}"
        );
    }

    #[test]
    fn a_moved_thread_keeps_its_allowed_cpus_and_runs_elsewhere() {
        let allowed = rustix::thread::sched_getaffinity(None).unwrap();
        // A test thread, so that the runner's thread keeps its own placement. On a busy
        // machine the scheduler may move the thread back between the move and the look at
        // where it runs, so a few tries may be needed; one that stays put every time fails.
        let tries = std::thread::spawn(|| {
            (0..10)
                .map(|_| {
                    let left = move_to_another_cpu();
                    let now = rustix::thread::sched_getcpu();
                    (left, now, rustix::thread::sched_getaffinity(None).unwrap())
                })
                .collect::<Vec<_>>()
        })
        .join()
        .unwrap();
        for (_, _, after) in &tries {
            assert_eq!(*after, allowed, "the allowed set is restored");
        }
        for (left, _, _) in &tries {
            assert_eq!(left.is_some(), allowed.count() >= 2);
        }
        if allowed.count() >= 2 {
            assert!(
                tries.iter().any(|(left, now, _)| *left != Some(*now)),
                "still on the CPU it left in every try: {tries:?}"
            );
        }
    }
}
