//! The clock of timelines and of the offsets between hosts' clocks: nanoseconds of
//! `CLOCK_MONOTONIC`, one clock for every thread and process of a host (so the slices of a
//! driver and its workers line up), unrelated between hosts (so the driver estimates each
//! host's offset, `cluster/clock.rs`).
//!
//! `ADAG_CLOCK_SKEW_NS` (a signed number of nanoseconds, read once) shifts this process's clock
//! and, through the environment, its workers': it makes a host on this machine behave as a
//! machine whose clock differs, which is how the tests check that offsets are estimated and
//! applied. Leave it unset otherwise.
//!
//! [`coarse_deadline`] is the other clock here: cheap, never-early deadlines.
use std::sync::OnceLock;

/// Shifts this process's clock (testing: see the module's documentation).
pub(crate) const ENV_CLOCK_SKEW_NS: &str = "ADAG_CLOCK_SKEW_NS";

fn skew() -> i64 {
    static SKEW: OnceLock<i64> = OnceLock::new();
    *SKEW.get_or_init(|| {
        std::env::var(ENV_CLOCK_SKEW_NS)
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0)
    })
}

/// Nanoseconds of `CLOCK_MONOTONIC` (shifted by `ADAG_CLOCK_SKEW_NS`, when set).
#[inline]
pub(crate) fn mono_ns() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    let raw = t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64;
    raw.saturating_add_signed(skew())
}

/// `d` from now by the kernel's coarse clock (`CLOCK_MONOTONIC_COARSE`): never earlier than
/// `Instant::now() + d`, and less than two ticks of that clock (a few ms) later; `None` on
/// overflow. For deadlines seconds away, where a few ms late do not matter
/// ([`deadline_after`](crate::compile::deadline_after)): the coarse clock costs ~4 ns here
/// where `Instant::now` costs ~25, and the sum is one `Instant` addition of nanoseconds (the
/// same sum in `Duration`s and `Instant`s took 14 ns, 7 this way: a round trip of the driver
/// computes one).
pub(crate) fn coarse_deadline(d: std::time::Duration) -> Option<std::time::Instant> {
    use rustix::time::{ClockId, clock_getres, clock_gettime};
    use std::time::{Duration, Instant};
    let ns = |t: rustix::time::Timespec| t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64;
    // The coarse clock reads the monotonic time of the last tick: at most one resolution
    // behind. `origin` is read after the coarse clock's `base` (moved one resolution back), so
    // `origin + (coarse - base)` is no earlier than now and less than two resolutions later.
    static BASE: OnceLock<(u64, Instant)> = OnceLock::new();
    let (base, origin) = *BASE.get_or_init(|| {
        let coarse = ns(clock_gettime(ClockId::MonotonicCoarse));
        let resolution = ns(clock_getres(ClockId::MonotonicCoarse));
        (coarse.saturating_sub(resolution), Instant::now())
    });
    let ahead = ns(clock_gettime(ClockId::MonotonicCoarse)).saturating_sub(base);
    origin.checked_add(d.checked_add(Duration::from_nanos(ahead))?)
}

#[cfg(test)]
mod tests {
    use super::coarse_deadline;
    use std::time::{Duration, Instant};

    fn duration(t: rustix::time::Timespec) -> Duration {
        Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
    }

    #[test]
    fn coarse_deadlines_are_never_early_and_at_most_two_ticks_late() {
        let res = duration(rustix::time::clock_getres(
            rustix::time::ClockId::MonotonicCoarse,
        ));
        // Slack for a preemption between the reads; a wrong sign or a missing tick shows as an
        // error of a whole tick every time, which the many rounds catch.
        let slack = Duration::from_millis(50);
        let d = Duration::from_secs(3);
        let _ = coarse_deadline(d);
        for _ in 0..10_000 {
            let before = Instant::now();
            let coarse = coarse_deadline(d).unwrap() - d;
            let after = Instant::now();
            assert!(
                coarse >= before,
                "a coarse deadline is {:?} early",
                before - coarse
            );
            assert!(
                coarse <= after + 2 * res + slack,
                "a coarse deadline is {:?} late with a resolution of {res:?}",
                coarse - after
            );
        }
    }
}
