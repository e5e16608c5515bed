//! The calling thread's own CPU time (CLOCK_THREAD_CPUTIME_ID: the scheduler's count, not
//! ticks) and page faults (getrusage(RUSAGE_THREAD), minor and major), step by step: where a
//! spawn's CPU goes, read off a VMM's log.

use std::time::Duration;

/// The thread's CPU time and page faults so far (None: a call failed).
fn now() -> Option<(Duration, u64)> {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the timespec we pass; this clock always exists.
    if unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) } != 0 {
        return None;
    }
    // SAFETY: rusage is plain integers, for which zero is valid.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: getrusage writes the struct we pass.
    if unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut ru) } != 0 {
        return None;
    }
    Some((
        Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32),
        (ru.ru_minflt + ru.ru_majflt) as u64,
    ))
}

/// Steps of one thread, each with the CPU and page faults it took since the step before.
#[derive(Clone, Debug, Default)]
pub struct Marks {
    last: (Duration, u64),
    steps: Vec<(&'static str, Duration, u64)>,
}

impl Marks {
    /// Counting from the thread's start: the first step holds all it used before.
    pub fn from_thread_start() -> Marks {
        Marks::default()
    }

    /// Counting from now.
    pub fn from_now() -> Marks {
        Marks {
            last: now().unwrap_or_default(),
            steps: Vec::new(),
        }
    }

    /// End step `step` here (a failed reading leaves it out).
    pub fn mark(&mut self, step: &'static str) {
        let Some((cpu, faults)) = now() else {
            return;
        };
        self.steps.push((
            step,
            cpu.saturating_sub(self.last.0),
            faults.saturating_sub(self.last.1),
        ));
        self.last = (cpu, faults);
    }

    /// Go on counting from now: what the thread did since the last step (it waited, or did
    /// another step's work) is left out.
    pub fn resume(&mut self) {
        if let Some(now) = now() {
            self.last = now;
        }
    }

    pub fn steps(&self) -> &[(&'static str, Duration, u64)] {
        &self.steps
    }

    /// `step ms, step ms, ...` (one decimal).
    pub fn cpu_ms(&self) -> String {
        self.list(|d, _| format!("{:.1}", d.as_secs_f64() * 1e3))
    }

    /// `step faults, step faults, ...`.
    pub fn faults(&self) -> String {
        self.list(|_, n| n.to_string())
    }

    fn list(&self, f: impl Fn(Duration, u64) -> String) -> String {
        let items: Vec<String> = self
            .steps
            .iter()
            .map(|(step, d, n)| format!("{step} {}", f(*d, *n)))
            .collect();
        items.join(", ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_count_what_the_thread_did_between_them() {
        let mut m = Marks::from_now();
        // Touch fresh pages and burn a little CPU, so both counters move.
        let v = vec![1u8; 1 << 20];
        let mut x = 0u64;
        for i in 0..200_000u64 {
            x = x
                .wrapping_mul(31)
                .wrapping_add(i ^ v[(i as usize) % v.len()] as u64);
        }
        std::hint::black_box(x);
        m.mark("work");
        m.mark("nothing");
        let s = m.steps();
        assert_eq!(
            s.iter().map(|s| s.0).collect::<Vec<_>>(),
            ["work", "nothing"]
        );
        assert!(s[0].1 > Duration::ZERO && s[0].2 > 0, "{s:?}");
        assert!(s[1].2 <= s[0].2, "{s:?}");
        assert!(m.cpu_ms().starts_with("work ") && m.faults().contains(", nothing "));
    }
}
