//! virtio devices over the virtio-mmio transport (version 2).

pub mod mmio;
pub mod net;
pub mod queue_events;
mod runner;
pub mod used_irq;
pub mod vsock;

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use virtio_queue::{Queue, QueueState};

use crate::snapshot::devices::VirtioKind;
use vm_memory::GuestMemoryMmap;
use vmm_sys_util::eventfd::EventFd;

/// VIRTIO_F_VERSION_1: required by the version-2 MMIO transport.
pub const VIRTIO_F_VERSION_1: u64 = 1 << 32;
/// Interrupt status bits.
pub const INT_USED_RING: u32 = 1;
pub const INT_CONFIG: u32 = 2;

/// A device's interrupt line: status bits the driver reads, and an irqfd into the irqchip.
#[derive(Clone)]
pub struct IrqLine {
    status: Arc<AtomicU32>,
    evt: Arc<EventFd>,
}

impl IrqLine {
    pub fn new(evt: EventFd) -> Self {
        Self {
            status: Arc::new(AtomicU32::new(0)),
            evt: Arc::new(evt),
        }
    }

    pub fn trigger(&self, bits: u32) {
        self.status.fetch_or(bits, Ordering::SeqCst);
        // A full eventfd counter still raises the line; nothing to do on error.
        let _ = self.evt.write(1);
    }

    /// Raise the line again for status bits already set (a lost interrupt).
    pub fn resend(&self) {
        let _ = self.evt.write(1);
    }

    pub fn status(&self) -> u32 {
        self.status.load(Ordering::SeqCst)
    }

    pub fn set_status(&self, bits: u32) {
        self.status.store(bits, Ordering::SeqCst);
    }

    pub fn ack(&self, bits: u32) {
        self.status.fetch_and(!bits, Ordering::SeqCst);
    }

    pub fn eventfd(&self) -> &EventFd {
        &self.evt
    }
}

/// Recovery from interrupts that never reach the guest (seen in nested virtualization).
///
/// Linux acknowledges the interrupt status in its handler right away, so a status that stays
/// set means the interrupt was lost. Without a resend the guest never refills its receive
/// queue and a device with no buffers never signals again: a silent, permanent stall.
/// Resending is harmless if the guest was just slow.
#[derive(Default)]
pub struct LostIrqs {
    pending_since: Option<Instant>,
    resent: u64,
}

impl LostIrqs {
    /// How long the status may stay un-acknowledged before the interrupt is sent again.
    pub const RESEND_AFTER: Duration = Duration::from_millis(1000);

    /// An interrupt is pending: the device thread should look again soon.
    pub fn watching(&self) -> bool {
        self.pending_since.is_some()
    }

    /// Look at `irq` (None or `paused`: nothing to watch). Returns how many times it has been
    /// resent overall when it was resent just now.
    pub fn check(&mut self, irq: Option<&IrqLine>, paused: bool) -> Option<u64> {
        let irq = match irq {
            Some(i) if !paused && i.status() != 0 => i,
            _ => {
                self.pending_since = None;
                return None;
            }
        };
        let now = Instant::now();
        match self.pending_since {
            None => self.pending_since = Some(now),
            Some(t) if now.duration_since(t) >= Self::RESEND_AFTER => {
                self.resent += 1;
                irq.resend();
                self.pending_since = Some(now);
                return Some(self.resent);
            }
            Some(_) => {}
        }
        None
    }
}

/// A device's event loop, run by the owner of its VM on a thread the owner already has,
/// instead of on a thread of the device's own (a thread per device costs each VM a kernel
/// stack, a task and stack pages). The owner waits until [`fd`](Self::fd) is readable or the
/// last turn's timeout ran out, then turns it again.
pub trait DeviceLoop: Send {
    /// Readable when the loop has something to handle.
    fn fd(&self) -> std::os::fd::BorrowedFd<'_>;
    /// How long the owner may wait before the first turn if nothing wakes it: the first wait
    /// of a thread of the device's own. The owner does not turn it before.
    fn first_wait(&self) -> std::time::Duration;
    /// Handle what is ready, without waiting. Returns how long the owner may wait before the
    /// next turn if nothing wakes it (the loop's own timed checks), or None once the device
    /// has stopped: it is not turned again.
    fn turn(&mut self) -> Option<std::time::Duration>;
}

/// Test helper: as a VM's owner does, wait (up to 1 s) for `l`'s descriptor, then turn it,
/// until `done`; fails after 10 s or if the device stops.
#[cfg(test)]
pub(crate) fn turn_until(l: &mut dyn DeviceLoop, mut done: impl FnMut() -> bool) {
    use std::os::fd::AsRawFd;
    let t0 = Instant::now();
    while !done() {
        assert!(t0.elapsed() < Duration::from_secs(10), "never done");
        let mut fd = libc::pollfd {
            fd: l.fd().as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd.
        unsafe { libc::poll(&mut fd, 1, 1000) };
        let wait = l.turn().expect("the device runs");
        assert!(wait > Duration::ZERO);
    }
}

/// The device half of a virtio device; the transport owns feature negotiation and queue setup.
pub trait VirtioDevice: Send {
    fn device_type(&self) -> u32;
    /// Start what the device runs on its own (its thread), if not yet: called as its VM
    /// starts, before any vCPU runs, and a no-op for a device that needs nothing started.
    fn start(&mut self) -> Result<(), crate::error::DeviceError> {
        Ok(())
    }
    /// Instead of [`start`](Self::start): hand over the event loop a thread of the device's
    /// own would run, for the VM's owner to run (see [`DeviceLoop`]); `start` then starts
    /// nothing. None: the device has no loop to hand over (none, or its thread runs it).
    fn take_loop(&mut self) -> Option<Box<dyn DeviceLoop>> {
        None
    }
    /// Offered feature bits (VIRTIO_F_VERSION_1 is added by the transport).
    fn features(&self) -> u64;
    fn queue_max_sizes(&self) -> &[u16];
    fn read_config(&self, offset: u64, data: &mut [u8]);
    /// The driver set DRIVER_OK with every queue ready.
    fn activate(
        &mut self,
        mem: GuestMemoryMmap,
        queues: Vec<Queue>,
        irq: IrqLine,
        acked_features: u64,
    );
    /// The driver made buffers available on `queue` (a QueueNotify write that exited to the
    /// VMM: ioeventfds off or not registered, or a device that does not take them).
    fn queue_notify(&mut self, queue: u16);
    /// Take queue notifications from `events` (one per queue, in queue order) on the device's
    /// own thread instead of through [`queue_notify`](Self::queue_notify) on a vCPU thread.
    /// Called before the VM runs, once KVM signals them (`KVM_IOEVENTFD`: a 4-byte write of
    /// the queue index to QueueNotify); on false the VMM unregisters them and notifications
    /// keep coming through `queue_notify`. A signal can arrive before activation or after a
    /// reset (ignore it) and says no more than "look at this queue". Default: not taken.
    fn attach_queue_events(&mut self, events: &[Arc<EventFd>]) -> bool {
        let _ = events;
        false
    }
    /// The driver reset the device.
    fn reset(&mut self);
    /// Stop (or resume) touching guest memory from device threads: while paused, the memory
    /// image and the vCPU state can be saved as one instant. The vCPUs are already parked when
    /// this pauses: a device fed by queue events must first handle the notifications already
    /// signalled, as the vCPU would have before parking, or a snapshot would keep buffers the
    /// guest announced that no restored copy is ever told about.
    fn set_paused(&mut self, paused: bool);
    /// Live queue positions of an activated device.
    fn queue_states(&self) -> Vec<QueueState>;
    /// What a snapshot needs to recreate this device.
    fn kind(&self) -> VirtioKind;
    /// Called once after an activated device was restored from a snapshot.
    fn after_restore(&mut self);
    /// Activate a device restored from a snapshot with its saved queue positions, then tell
    /// it it was restored. A device whose own thread could act between the two steps
    /// overrides this to take them as one.
    fn activate_restored(
        &mut self,
        mem: GuestMemoryMmap,
        queues: Vec<Queue>,
        irq: IrqLine,
        acked_features: u64,
    ) {
        self.activate(mem, queues, irq, acked_features);
        self.after_restore();
    }
}
