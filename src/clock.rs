//! The clock of timelines and of the offsets between hosts' clocks: nanoseconds of
//! `CLOCK_MONOTONIC`, one clock for every thread and process of a host (so the slices of a
//! driver and its workers line up), unrelated between hosts (so the driver estimates each
//! host's offset, `cluster/clock.rs`).
//!
//! `ADAG_CLOCK_SKEW_NS` (a signed number of nanoseconds, read once) shifts this process's clock
//! and, through the environment, its workers': it makes a host on this machine behave as a
//! machine whose clock differs, which is how the tests check that offsets are estimated and
//! applied. Leave it unset otherwise.
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
