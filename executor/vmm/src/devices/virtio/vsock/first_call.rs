//! What a restored guest's first host call waited on, seen from the device: the steps between
//! its activation and the first data the guest sends back (the agent's first answer), written
//! to the VMM's log once. The spawn's `agent` phase is these steps plus the host's own side.

use std::time::{Duration, Instant};

use crate::devices::virtio::used_irq::IrqCounts;

/// One restored device's first call, step by step; each step is kept the first time only.
#[derive(Debug, Default)]
pub(super) struct FirstCall {
    started: Option<Instant>,
    steps: Vec<(&'static str, Duration)>,
    done: bool,
}

impl FirstCall {
    /// The device was activated after a restore: the clock starts (a boot keeps none).
    pub(super) fn start(&mut self) {
        *self = FirstCall {
            started: Some(Instant::now()),
            ..FirstCall::default()
        };
    }

    /// `step` happened now, if it is new and the first call is still to come.
    pub(super) fn mark(&mut self, step: &'static str) {
        let Some(t0) = self.started else { return };
        if self.done || self.steps.iter().any(|(s, _)| *s == step) {
            return;
        }
        self.steps.push((step, t0.elapsed()));
    }

    /// The guest sent its first data: mark it and return the log line, once, with the
    /// interrupts the device had raised (and held back) by then.
    pub(super) fn answered(&mut self, irqs: IrqCounts) -> Option<String> {
        if self.started.is_none() || self.done {
            return None;
        }
        self.mark("first data");
        self.done = true;
        Some(self.line(irqs))
    }

    fn line(&self, irqs: IrqCounts) -> String {
        let steps: Vec<String> = self
            .steps
            .iter()
            .map(|(s, d)| format!("{s} {:.1}", d.as_secs_f64() * 1e3))
            .collect();
        format!(
            "tine-vmm: vsock first call, ms after activation: {}; interrupts raised {}, not wanted {}\n",
            steps.join(", "),
            irqs.raised,
            irqs.not_wanted
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_are_kept_once_in_order_and_the_line_comes_once() {
        let mut f = FirstCall::default();
        f.mark("host connected");
        let irqs = IrqCounts {
            raised: 3,
            not_wanted: 1,
        };
        assert!(
            f.answered(irqs).is_none(),
            "a booted device keeps no timeline"
        );
        f.start();
        f.mark("host connected");
        f.mark("request given");
        f.mark("host connected");
        let line = f.answered(irqs).expect("the first answer gives the line");
        let (line, counts) = line.trim_end().split_once("; ").unwrap();
        assert_eq!(counts, "interrupts raised 3, not wanted 1");
        let names: Vec<&str> = line
            .split(": ")
            .nth(2)
            .unwrap()
            .split(", ")
            .map(|s| s.rsplit_once(' ').unwrap().0)
            .collect();
        assert_eq!(names, ["host connected", "request given", "first data"]);
        assert!(f.answered(irqs).is_none(), "only once");
        f.mark("late");
        assert!(!f.line(irqs).contains("late"));
    }
}
