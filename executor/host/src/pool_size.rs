//! How many idle VMM workers a pool keeps. A burst larger than the pool gets workers started
//! on demand: each pays its exec and start-up and restores from the start, unprimed, on the
//! spawn's path, and on the CPUs the burst's other children need. So the pool grows by what a
//! burst found missing, up to a ceiling, and goes back to its floor once no spawn has found
//! it short for a while (idle workers hold memory: their VM shell, and a primed one its
//! snapshot's working set).

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The pool's floor and ceiling, and how long it stays grown.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolBounds {
    /// Idle workers kept started (0: none, and the pool never grows).
    pub floor: usize,
    /// Most idle workers it grows to after bursts (at most the floor: it never grows).
    pub ceiling: usize,
    /// Back to the floor once no spawn found the pool short for this long.
    pub shrink_after: Duration,
}

#[derive(Debug)]
pub struct PoolSize {
    bounds: PoolBounds,
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    target: usize,
    /// Takes that found no idle worker since the target last grew.
    short: usize,
    /// When a take last found none (None: not since the pool last shrank).
    last_short: Option<Instant>,
}

impl PoolSize {
    pub fn new(bounds: PoolBounds) -> PoolSize {
        PoolSize {
            bounds,
            state: Mutex::new(State {
                target: bounds.floor,
                short: 0,
                last_short: None,
            }),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Idle workers to keep now.
    pub fn target(&self) -> usize {
        self.state().target
    }

    /// Takes that found the pool short since it last grew.
    pub fn pending(&self) -> usize {
        self.state().short
    }

    /// A take found no idle worker and started one.
    pub fn missed(&self, now: Instant) {
        let mut s = self.state();
        s.short += 1;
        s.last_short = Some(now);
    }

    /// The target grown by the takes that found the pool short since it last grew, up to the
    /// ceiling (a pool with no floor never grows); returns it.
    pub fn grow(&self) -> usize {
        let mut s = self.state();
        let short = std::mem::take(&mut s.short);
        if self.bounds.floor > 0 {
            let ceiling = self.bounds.ceiling.max(self.bounds.floor);
            s.target = s.target.saturating_add(short).min(ceiling);
        }
        s.target
    }

    /// Back to the floor if the pool is above it and no take found it short for
    /// `shrink_after`; returns the new target when it shrank.
    pub fn shrink(&self, now: Instant) -> Option<usize> {
        let mut s = self.state();
        let quiet = s
            .last_short
            .is_none_or(|t| now.saturating_duration_since(t) >= self.bounds.shrink_after);
        if s.target <= self.bounds.floor || !quiet {
            return None;
        }
        s.target = self.bounds.floor;
        s.short = 0;
        s.last_short = None;
        Some(s.target)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bounds(floor: usize, ceiling: usize) -> PoolBounds {
        PoolBounds {
            floor,
            ceiling,
            shrink_after: Duration::from_secs(60),
        }
    }

    #[test]
    fn a_burst_grows_the_pool_by_what_it_found_missing_up_to_the_ceiling() {
        let size = PoolSize::new(bounds(8, 32));
        let t = Instant::now();
        assert_eq!(size.grow(), 8, "nothing missed: the floor");
        for _ in 0..10 {
            size.missed(t);
        }
        assert_eq!(size.pending(), 10);
        assert_eq!(size.grow(), 18);
        assert_eq!(size.pending(), 0);
        assert_eq!(size.grow(), 18, "each shortfall counts once");
        for _ in 0..100 {
            size.missed(t);
        }
        assert_eq!(size.grow(), 32);
        assert_eq!(size.target(), 32);
    }

    #[test]
    fn the_pool_shrinks_to_its_floor_only_after_a_quiet_period() {
        let size = PoolSize::new(bounds(4, 16));
        let t = Instant::now();
        assert_eq!(size.shrink(t), None, "at its floor already");
        size.missed(t);
        size.missed(t);
        assert_eq!(size.grow(), 6);
        assert_eq!(size.shrink(t + Duration::from_secs(59)), None);
        // Found short again: the quiet period starts over.
        size.missed(t + Duration::from_secs(50));
        assert_eq!(size.shrink(t + Duration::from_secs(100)), None);
        assert_eq!(size.shrink(t + Duration::from_secs(110)), Some(4));
        assert_eq!(size.target(), 4);
        // What was missed before the shrink is not carried into the next growth.
        assert_eq!(size.grow(), 4);
    }

    #[test]
    fn a_pool_without_a_floor_or_room_above_it_never_grows() {
        let none = PoolSize::new(bounds(0, 32));
        none.missed(Instant::now());
        assert_eq!(none.grow(), 0);
        let fixed = PoolSize::new(bounds(8, 4));
        fixed.missed(Instant::now());
        assert_eq!(fixed.grow(), 8, "a ceiling below the floor is the floor");
    }
}
