//! A process-wide timer for the driver's futures: wakes a task when its deadline passes, so
//! that waiting futures keep their deadline on any executor (tokio's timers need tokio's
//! runtime; the futures of this crate are plain `std` futures). One thread, started at the
//! first deadline, sleeps until the earliest one.
use crate::error::{Error, Result};
use parking_lot::{Condvar, Mutex};
use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock};
use std::task::Waker;
use std::time::Instant;

struct Timer {
    state: Mutex<State>,
    cv: Condvar,
}

struct State {
    /// Waiting tasks by deadline; the id tells apart equal deadlines.
    entries: BTreeMap<(Instant, u64), Waker>,
    next_id: u64,
}

static TIMER: OnceLock<std::result::Result<Arc<Timer>, String>> = OnceLock::new();

fn timer() -> Result<&'static Arc<Timer>> {
    TIMER
        .get_or_init(|| {
            let t = Arc::new(Timer {
                state: Mutex::new(State {
                    entries: BTreeMap::new(),
                    next_id: 0,
                }),
                cv: Condvar::new(),
            });
            let run = t.clone();
            std::thread::Builder::new()
                .name("adag-timer".into())
                .spawn(move || run.run())
                .map(|_| t)
                .map_err(|e| e.to_string())
        })
        .as_ref()
        .map_err(|e| Error::io("starting the driver's timer thread", e))
}

impl Timer {
    fn run(&self) {
        let mut s = self.state.lock();
        loop {
            let now = Instant::now();
            let mut due = Vec::new();
            while let Some(entry) = s.entries.first_entry() {
                if entry.key().0 > now {
                    break;
                }
                due.push(entry.remove());
            }
            if !due.is_empty() {
                // Wake outside the lock: a waker may run the task inline and register again.
                drop(s);
                for w in due {
                    w.wake();
                }
                s = self.state.lock();
                continue;
            }
            match s.entries.keys().next() {
                Some(&(deadline, _)) => {
                    self.cv.wait_until(&mut s, deadline);
                }
                None => self.cv.wait(&mut s),
            }
        }
    }
}

/// A task's deadline on the timer; dropping it cancels the wake-up.
pub(crate) struct TimerEntry {
    key: (Instant, u64),
}

/// Wake `waker` once `deadline` has passed.
pub(crate) fn wake_at(deadline: Instant, waker: &Waker) -> Result<TimerEntry> {
    let t = timer()?;
    let mut s = t.state.lock();
    let key = (deadline, s.next_id);
    s.next_id += 1;
    let earliest = s.entries.keys().next().is_none_or(|k| *k > key);
    s.entries.insert(key, waker.clone());
    drop(s);
    if earliest {
        t.cv.notify_one();
    }
    Ok(TimerEntry { key })
}

impl TimerEntry {
    /// The task moved to another waker (it is polled from elsewhere): wake that one.
    pub(crate) fn update(&self, waker: &Waker) {
        let Ok(t) = timer() else { return };
        let mut s = t.state.lock();
        if let Some(w) = s.entries.get_mut(&self.key)
            && !w.will_wake(waker)
        {
            *w = waker.clone();
        }
    }
}

impl Drop for TimerEntry {
    fn drop(&mut self) {
        if let Ok(t) = timer() {
            t.state.lock().entries.remove(&self.key);
        }
    }
}
