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
//! [`coarse_now`] is the other clock here: a cheap, never-early `Instant` for deadlines.
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

/// An `Instant` no earlier than now and less than two ticks of the kernel's coarse clock later
/// (a few ms), read from `CLOCK_MONOTONIC_COARSE`: ~4 ns here where `Instant::now` costs
/// ~18 ns, which is a tenth of the driver's part of a small round trip. For deadlines seconds
/// away, where a few ms late do not matter ([`deadline_after`](crate::compile::deadline_after)).
pub(crate) fn coarse_now() -> std::time::Instant {
    use rustix::time::{ClockId, clock_getres, clock_gettime};
    use std::time::{Duration, Instant};
    let coarse = || duration(clock_gettime(ClockId::MonotonicCoarse));
    // The coarse clock reads the monotonic time of the last tick: at most one resolution
    // behind. `origin` is read after `coarse_origin`, so `origin + (coarse() - coarse_origin)`
    // lags now by less than a resolution and leads it by less than one; adding a resolution
    // makes it no earlier than now.
    static BASE: OnceLock<(Duration, Instant, Duration)> = OnceLock::new();
    let (coarse_origin, origin, resolution) = *BASE.get_or_init(|| {
        let coarse_origin = coarse();
        let resolution = duration(clock_getres(ClockId::MonotonicCoarse));
        (coarse_origin, Instant::now(), resolution)
    });
    origin + coarse().saturating_sub(coarse_origin) + resolution
}

fn duration(t: rustix::time::Timespec) -> std::time::Duration {
    std::time::Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
}

#[cfg(test)]
mod tests {
    use super::{coarse_now, duration};
    use std::time::{Duration, Instant};

    #[test]
    fn coarse_now_is_never_early_and_at_most_two_ticks_late() {
        let res = duration(rustix::time::clock_getres(
            rustix::time::ClockId::MonotonicCoarse,
        ));
        // Slack for a preemption between the reads; a wrong sign or a missing tick shows as an
        // error of a whole tick every time, which the many rounds catch.
        let slack = Duration::from_millis(50);
        let _ = coarse_now();
        for _ in 0..10_000 {
            let before = Instant::now();
            let coarse = coarse_now();
            let after = Instant::now();
            assert!(
                coarse >= before,
                "coarse_now is {:?} early",
                before - coarse
            );
            assert!(
                coarse <= after + 2 * res + slack,
                "coarse_now is {:?} late with a resolution of {res:?}",
                coarse - after
            );
        }
    }
}
