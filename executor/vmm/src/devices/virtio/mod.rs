//! virtio devices over the virtio-mmio transport (version 2).

pub mod mmio;
pub mod vsock;

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

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

/// The device half of a virtio device; the transport owns feature negotiation and queue setup.
pub trait VirtioDevice: Send {
    fn device_type(&self) -> u32;
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
    /// The driver made buffers available on `queue`.
    fn queue_notify(&mut self, queue: u16);
    /// The driver reset the device.
    fn reset(&mut self);
    /// Stop (or resume) touching guest memory from device threads: while paused, the memory
    /// image and the vCPU state can be saved as one instant.
    fn set_paused(&mut self, paused: bool);
    /// Live queue positions of an activated device.
    fn queue_states(&self) -> Vec<QueueState>;
    /// What a snapshot needs to recreate this device.
    fn kind(&self) -> VirtioKind;
    /// Called once after an activated device was restored from a snapshot.
    fn after_restore(&mut self);
}
