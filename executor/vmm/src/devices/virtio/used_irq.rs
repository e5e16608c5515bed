//! The used-buffer interrupt, raised once where a device's pass over its queues ends rather
//! than once per queue as buffers are given back, and not at all when the driver has asked for
//! none on every queue given back (`VRING_AVAIL_F_NO_INTERRUPT`, virtio 1.2, 2.7.7). Each
//! interrupt costs the guest an injection, two MMIO exits (status read, acknowledgement) and
//! an EOI; Linux sets the flag while its handler or NAPI poll drains a queue, and looks at the
//! queue again after clearing it, so what it asked not to be told it finds anyway.

use std::sync::atomic::{fence, Ordering};

use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use super::{IrqLine, INT_USED_RING};

const VRING_AVAIL_F_NO_INTERRUPT: u16 = 1;

/// Interrupts raised, and the passes that gave buffers back to a driver that wanted none.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct IrqCounts {
    pub raised: u64,
    pub not_wanted: u64,
}

/// Which of a device's `N` queues were given used buffers since the interrupt was last
/// considered.
#[derive(Debug, Clone, Copy)]
pub struct UsedIrq<const N: usize> {
    due: [bool; N],
    pub counts: IrqCounts,
}

impl<const N: usize> Default for UsedIrq<N> {
    fn default() -> Self {
        Self {
            due: [false; N],
            counts: IrqCounts::default(),
        }
    }
}

impl<const N: usize> UsedIrq<N> {
    /// Queue `q` was given used buffers (a queue index out of range is ignored).
    pub fn mark(&mut self, q: usize) {
        if let Some(d) = self.due.get_mut(q) {
            *d = true;
        }
    }

    /// Forget what is due (the device was reset: there is no driver to tell).
    pub fn clear(&mut self) {
        self.due = [false; N];
    }

    /// Raise the interrupt once if any queue marked since the last call still wants one.
    /// Without a line or guest memory (not activated, reset) nothing is raised.
    pub fn flush(
        &mut self,
        irq: Option<&IrqLine>,
        mem: Option<&GuestMemoryMmap>,
        queues: &[Queue],
    ) {
        if !self.due.contains(&true) {
            return;
        }
        let due = std::mem::replace(&mut self.due, [false; N]);
        let (Some(irq), Some(mem)) = (irq, mem) else {
            return;
        };
        // The used entries are written before the flags are read; the driver clears the flag
        // and then looks for used entries: one of the two sides sees the other.
        fence(Ordering::SeqCst);
        let wanted = due
            .iter()
            .zip(queues)
            .any(|(d, q)| *d && driver_wants_interrupt(q, mem));
        if wanted {
            irq.trigger(INT_USED_RING);
            self.counts.raised += 1;
        } else {
            self.counts.not_wanted += 1;
        }
    }
}

/// False if the driver has set `VRING_AVAIL_F_NO_INTERRUPT` in `q`'s available ring.
fn driver_wants_interrupt(q: &Queue, mem: &GuestMemoryMmap) -> bool {
    let flags: Result<u16, _> = mem.load(GuestAddress(q.avail_ring()), Ordering::Acquire);
    // Unreadable flags: interrupt, as a device that never looks would.
    flags.map_or(true, |f| u16::from_le(f) & VRING_AVAIL_F_NO_INTERRUPT == 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

    /// Two ready queues whose available rings are at 0x1000 and 0x3000.
    fn setup() -> (GuestMemoryMmap, Vec<Queue>, IrqLine) {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10000)]).unwrap();
        let queues = (0..2u64)
            .map(|i| {
                let mut q = Queue::new(16).unwrap();
                let base = i * 0x2000;
                q.set_desc_table_address(Some(base as u32), Some(0));
                q.set_avail_ring_address(Some((base + 0x1000) as u32), Some(0));
                q.set_used_ring_address(Some((base + 0x1800) as u32), Some(0));
                q.set_ready(true);
                q
            })
            .collect();
        (
            mem,
            queues,
            IrqLine::new(EventFd::new(EFD_NONBLOCK).unwrap()),
        )
    }

    fn suppress(mem: &GuestMemoryMmap, q: &Queue, on: bool) {
        mem.write_obj(u16::from(on), GuestAddress(q.avail_ring()))
            .unwrap();
    }

    fn raised(irq: &IrqLine) -> u64 {
        irq.eventfd().read().unwrap_or(0)
    }

    #[test]
    fn queues_marked_in_one_pass_raise_one_interrupt() {
        let (mem, queues, irq) = setup();
        let mut u = UsedIrq::<2>::default();
        u.flush(Some(&irq), Some(&mem), &queues);
        assert_eq!(raised(&irq), 0, "nothing due");
        u.mark(0);
        u.mark(1);
        u.mark(7);
        u.flush(Some(&irq), Some(&mem), &queues);
        assert_eq!(raised(&irq), 1);
        assert_eq!(irq.status() & INT_USED_RING, INT_USED_RING);
        u.flush(Some(&irq), Some(&mem), &queues);
        assert_eq!(raised(&irq), 0, "raised once, then nothing due");
        assert_eq!(
            u.counts,
            IrqCounts {
                raised: 1,
                not_wanted: 0
            }
        );
    }

    #[test]
    fn a_queue_that_still_wants_one_is_enough() {
        let (mem, queues, irq) = setup();
        let mut u = UsedIrq::<2>::default();
        suppress(&mem, &queues[0], true);
        u.mark(0);
        u.flush(Some(&irq), Some(&mem), &queues);
        assert_eq!(raised(&irq), 0, "the driver is draining queue 0");
        assert_eq!(u.counts.not_wanted, 1);
        u.mark(0);
        u.mark(1);
        u.flush(Some(&irq), Some(&mem), &queues);
        assert_eq!(raised(&irq), 1, "queue 1 wants it");
        suppress(&mem, &queues[0], false);
        u.mark(0);
        u.flush(Some(&irq), Some(&mem), &queues);
        assert_eq!(raised(&irq), 1, "queue 0 wants them again");
        assert_eq!(
            u.counts,
            IrqCounts {
                raised: 2,
                not_wanted: 1
            }
        );
    }

    #[test]
    fn nothing_is_raised_without_a_line_and_a_reset_forgets_what_was_due() {
        let (mem, queues, irq) = setup();
        let mut u = UsedIrq::<2>::default();
        u.mark(1);
        u.flush(None, Some(&mem), &queues);
        u.flush(Some(&irq), Some(&mem), &queues);
        assert_eq!(raised(&irq), 0, "what was due went with the missing line");
        u.mark(1);
        u.clear();
        u.flush(Some(&irq), Some(&mem), &queues);
        assert_eq!(raised(&irq), 0);
        assert_eq!(u.counts, IrqCounts::default());
    }
}
