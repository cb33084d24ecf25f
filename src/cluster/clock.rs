//! How far a host's clock is from the driver's, estimated over the heartbeats: the driver
//! stamps each heartbeat with its clock (`t0`), the agent answers at once with `t0` and its own
//! clock (`a`), and the driver notes when the answer arrives (`t1`). If the two legs took as
//! long, the agent read its clock at the driver's `(t0 + t1) / 2`, so its offset is
//! `a - (t0 + t1) / 2`, and whatever the legs took, the truth lies within half the round trip
//! of that. The sample with the shortest round trip of the recent ones is the estimate (the
//! least delay, as NTP's clock filter), and half its round trip the bound reported with it.
use std::collections::VecDeque;

/// Samples kept: at one heartbeat each 500 ms, the last minute (recent enough that the clocks'
/// drift, a few ppm, stays far below the bound).
const WINDOW: usize = 120;

/// A host's clock against the driver's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClockOffset {
    /// The host's clock minus the driver's, in nanoseconds: subtract it from the host's
    /// readings to place them on the driver's clock.
    pub offset_ns: i64,
    /// The true offset lies within `offset_ns ± bound_ns` (half the round trip of the sample).
    pub bound_ns: u64,
    /// Samples the estimate was chosen from.
    pub samples: usize,
}

/// The recent samples of one host.
#[derive(Debug, Default)]
pub(crate) struct ClockSync {
    /// (round trip, offset), oldest first.
    samples: VecDeque<(u64, i64)>,
}

impl ClockSync {
    /// One heartbeat's answer: sent at `t0` and answered at `t1` (driver's clock), read `agent`
    /// on the host's clock in between.
    pub(crate) fn sample(&mut self, t0: u64, agent: u64, t1: u64) {
        if t1 < t0 {
            return; // not an answer to a heartbeat of this clock
        }
        let mid = (i128::from(t0) + i128::from(t1)) / 2;
        let offset = (i128::from(agent) - mid).clamp(i64::MIN.into(), i64::MAX.into()) as i64;
        if self.samples.len() == WINDOW {
            self.samples.pop_front();
        }
        self.samples.push_back((t1 - t0, offset));
    }

    /// The estimate: the sample with the shortest round trip.
    pub(crate) fn estimate(&self) -> Option<ClockOffset> {
        let (rtt, offset) = self.samples.iter().min_by_key(|(rtt, _)| *rtt)?;
        Some(ClockOffset {
            offset_ns: *offset,
            bound_ns: rtt.div_ceil(2),
            samples: self.samples.len(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_least_delayed_sample_wins_and_bounds_the_truth() {
        let truth: i64 = 5_000_000_000; // the host is 5 s ahead
        let mut c = ClockSync::default();
        assert_eq!(c.estimate(), None);
        // (t0, outbound leg, return leg): asymmetric delays skew each sample by half their
        // difference, always within half the round trip.
        for (i, (out, back)) in [(900_000u64, 100_000u64), (40_000, 60_000), (300_000, 5_000)]
            .into_iter()
            .enumerate()
        {
            let t0 = 1_000_000_000 * (i as u64 + 1);
            let agent = (t0 + out) as i64 + truth;
            c.sample(t0, agent as u64, t0 + out + back);
        }
        let e = c.estimate().unwrap();
        assert_eq!(e.samples, 3);
        assert_eq!(e.bound_ns, 50_000, "the 100 µs round trip");
        assert!((e.offset_ns - truth).unsigned_abs() <= e.bound_ns, "{e:?}");
        assert_eq!(e.offset_ns, truth - 10_000);
    }

    #[test]
    fn a_host_behind_and_the_window_forgets_old_samples() {
        let mut c = ClockSync::default();
        c.sample(1_000, 0, 1_010); // the best, then pushed out
        for i in 0..WINDOW as u64 {
            let t0 = 10_000_000 + i * 1_000_000;
            c.sample(t0, t0 - 3_000_000 + 500, t0 + 1_000);
        }
        let e = c.estimate().unwrap();
        assert_eq!(e.samples, WINDOW);
        assert_eq!(e.offset_ns, -3_000_000);
        assert_eq!(e.bound_ns, 500);
    }
}
