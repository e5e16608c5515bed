//! The virtio-mmio transport, version 2 (virtio 1.x, "modern"): registers, feature negotiation,
//! queue configuration and the device status state machine. All of it is plain data so it can be
//! saved in a snapshot.

use virtio_queue::{Queue, QueueState, QueueT};
use vm_memory::GuestMemoryMmap;

use super::{IrqLine, VirtioDevice, VIRTIO_F_VERSION_1};
use crate::devices::mmio::MmioDevice;
use crate::error::DeviceError;
use crate::snapshot::devices::{QueueSnapshot, VirtioMmioSnapshot};

const MAGIC: u32 = 0x7472_6976; // "virt"
const VERSION: u32 = 2;
const VENDOR_ID: u32 = 0x454e_4954; // "TINE"

const STATUS_ACKNOWLEDGE: u32 = 1;
const STATUS_DRIVER: u32 = 2;
const STATUS_DRIVER_OK: u32 = 4;
const STATUS_FEATURES_OK: u32 = 8;
const STATUS_FAILED: u32 = 0x80;

/// Register offsets (virtio 1.2, 4.2.2).
mod reg {
    pub const MAGIC: u64 = 0x000;
    pub const VERSION: u64 = 0x004;
    pub const DEVICE_ID: u64 = 0x008;
    pub const VENDOR_ID: u64 = 0x00c;
    pub const DEVICE_FEATURES: u64 = 0x010;
    pub const DEVICE_FEATURES_SEL: u64 = 0x014;
    pub const DRIVER_FEATURES: u64 = 0x020;
    pub const DRIVER_FEATURES_SEL: u64 = 0x024;
    pub const QUEUE_SEL: u64 = 0x030;
    pub const QUEUE_NUM_MAX: u64 = 0x034;
    pub const QUEUE_NUM: u64 = 0x038;
    pub const QUEUE_READY: u64 = 0x044;
    pub const QUEUE_NOTIFY: u64 = 0x050;
    pub const INTERRUPT_STATUS: u64 = 0x060;
    pub const INTERRUPT_ACK: u64 = 0x064;
    pub const STATUS: u64 = 0x070;
    pub const QUEUE_DESC_LOW: u64 = 0x080;
    pub const QUEUE_DESC_HIGH: u64 = 0x084;
    pub const QUEUE_DRIVER_LOW: u64 = 0x090;
    pub const QUEUE_DRIVER_HIGH: u64 = 0x094;
    pub const QUEUE_DEVICE_LOW: u64 = 0x0a0;
    pub const QUEUE_DEVICE_HIGH: u64 = 0x0a4;
    pub const CONFIG_GENERATION: u64 = 0x0fc;
    pub const CONFIG: u64 = 0x100;
}

/// Offset of QueueNotify in a device's window: where the VMM registers its ioeventfds.
pub const QUEUE_NOTIFY_OFFSET: u64 = reg::QUEUE_NOTIFY;

pub struct VirtioMmio {
    device: Box<dyn VirtioDevice>,
    mem: GuestMemoryMmap,
    irq: IrqLine,
    queues: Vec<Queue>,
    status: u32,
    device_features_sel: u32,
    driver_features_sel: u32,
    acked_features: u64,
    queue_sel: u32,
    activated: bool,
    /// Restored from a snapshot in which the device was active: activated by
    /// [`VirtioMmio::activate_restored`].
    activate_pending: bool,
}

impl VirtioMmio {
    pub fn new(device: Box<dyn VirtioDevice>, mem: GuestMemoryMmap, irq: IrqLine) -> Self {
        let queues = device
            .queue_max_sizes()
            .iter()
            .map(|&max| Queue::new(max).expect("queue sizes are powers of two"))
            .collect();
        Self {
            device,
            mem,
            irq,
            queues,
            status: 0,
            device_features_sel: 0,
            driver_features_sel: 0,
            acked_features: 0,
            queue_sel: 0,
            activated: false,
            activate_pending: false,
        }
    }

    fn offered(&self) -> u64 {
        self.device.features() | VIRTIO_F_VERSION_1
    }

    fn selected_queue(&mut self) -> Option<&mut Queue> {
        self.queues.get_mut(self.queue_sel as usize)
    }

    fn reset(&mut self) {
        if self.activated {
            self.device.reset();
        }
        for q in &mut self.queues {
            q.reset();
        }
        self.status = 0;
        self.acked_features = 0;
        self.device_features_sel = 0;
        self.driver_features_sel = 0;
        self.queue_sel = 0;
        self.activated = false;
        self.irq.ack(u32::MAX);
    }

    fn set_status(&mut self, v: u32) {
        if v == 0 {
            self.reset();
            return;
        }
        // FEATURES_OK only sticks if the driver accepted VERSION_1 and nothing we did not offer.
        if v & STATUS_FEATURES_OK != 0 && self.status & STATUS_FEATURES_OK == 0 {
            let ok = self.acked_features & VIRTIO_F_VERSION_1 != 0
                && self.acked_features & !self.offered() == 0;
            if !ok {
                self.status = v & !STATUS_FEATURES_OK;
                return;
            }
        }
        self.status = v;
        let want = STATUS_ACKNOWLEDGE | STATUS_DRIVER | STATUS_FEATURES_OK | STATUS_DRIVER_OK;
        if !self.activated && v & want == want && v & STATUS_FAILED == 0 {
            if self
                .queues
                .iter()
                .all(|q| q.ready() && q.is_valid(&self.mem))
            {
                self.activate_device();
            } else {
                tracing::warn!("virtio driver set DRIVER_OK with invalid queues");
                self.status |= STATUS_FAILED;
            }
        }
    }

    fn read32(&mut self, offset: u64) -> u32 {
        match offset {
            reg::MAGIC => MAGIC,
            reg::VERSION => VERSION,
            reg::DEVICE_ID => self.device.device_type(),
            reg::VENDOR_ID => VENDOR_ID,
            reg::DEVICE_FEATURES => match self.device_features_sel {
                0 => self.offered() as u32,
                1 => (self.offered() >> 32) as u32,
                _ => 0,
            },
            reg::QUEUE_NUM_MAX => self.selected_queue().map_or(0, |q| q.max_size() as u32),
            reg::QUEUE_READY => self.selected_queue().map_or(0, |q| q.ready() as u32),
            reg::INTERRUPT_STATUS => self.irq.status(),
            reg::STATUS => self.status,
            reg::CONFIG_GENERATION => 0,
            _ => 0,
        }
    }

    fn write32(&mut self, offset: u64, v: u32) {
        // Queue and feature setup is only legal before DRIVER_OK.
        let setup = self.status & STATUS_DRIVER_OK == 0;
        match offset {
            reg::DEVICE_FEATURES_SEL => self.device_features_sel = v,
            reg::DRIVER_FEATURES_SEL => self.driver_features_sel = v,
            reg::DRIVER_FEATURES if setup => match self.driver_features_sel {
                0 => self.acked_features = (self.acked_features & !0xffff_ffff) | v as u64,
                1 => self.acked_features = (self.acked_features & 0xffff_ffff) | ((v as u64) << 32),
                _ => {}
            },
            reg::QUEUE_SEL => self.queue_sel = v,
            reg::QUEUE_NUM if setup => {
                if let Some(q) = self.selected_queue() {
                    q.set_size(v as u16);
                }
            }
            reg::QUEUE_READY if setup => {
                if let Some(q) = self.selected_queue() {
                    q.set_ready(v == 1);
                }
            }
            reg::QUEUE_DESC_LOW if setup => {
                self.with_queue(|q| q.set_desc_table_address(Some(v), None))
            }
            reg::QUEUE_DESC_HIGH if setup => {
                self.with_queue(|q| q.set_desc_table_address(None, Some(v)))
            }
            reg::QUEUE_DRIVER_LOW if setup => {
                self.with_queue(|q| q.set_avail_ring_address(Some(v), None))
            }
            reg::QUEUE_DRIVER_HIGH if setup => {
                self.with_queue(|q| q.set_avail_ring_address(None, Some(v)))
            }
            reg::QUEUE_DEVICE_LOW if setup => {
                self.with_queue(|q| q.set_used_ring_address(Some(v), None))
            }
            reg::QUEUE_DEVICE_HIGH if setup => {
                self.with_queue(|q| q.set_used_ring_address(None, Some(v)))
            }
            reg::QUEUE_NOTIFY => {
                if self.activated && (v as usize) < self.queues.len() {
                    self.device.queue_notify(v as u16);
                }
            }
            reg::INTERRUPT_ACK => self.irq.ack(v),
            reg::STATUS => self.set_status(v),
            _ => tracing::debug!(offset, v, "ignored virtio-mmio write"),
        }
    }

    fn with_queue(&mut self, f: impl FnOnce(&mut Queue)) {
        if let Some(q) = self.selected_queue() {
            f(q);
        }
    }
}

impl VirtioMmio {
    pub fn save(&self) -> VirtioMmioSnapshot {
        let queues = if self.activated {
            self.device.queue_states()
        } else {
            self.queues.iter().map(|q| q.state()).collect()
        };
        VirtioMmioSnapshot {
            kind: self.device.kind(),
            status: self.status,
            acked_features: self.acked_features,
            device_features_sel: self.device_features_sel,
            driver_features_sel: self.driver_features_sel,
            queue_sel: self.queue_sel,
            activated: self.activated,
            interrupt_status: self.irq.status(),
            queues: queues.iter().map(QueueSnapshot::from).collect(),
        }
    }

    /// Recreate the transport state: registers and queues, checked. A device that was active
    /// is activated (its queues in guest memory looked at) only by
    /// [`activate_restored`](Self::activate_restored), so that a VMM can confine itself first.
    pub fn restore(&mut self, s: &VirtioMmioSnapshot) -> Result<(), DeviceError> {
        let kind = self.device.kind();
        if s.kind != kind || s.queues.len() != self.queues.len() {
            return Err(DeviceError::VirtioMismatch {
                device: kind,
                device_queues: self.queues.len(),
                snapshot: s.kind.clone(),
                snapshot_queues: s.queues.len(),
            });
        }
        let mut queues = Vec::with_capacity(s.queues.len());
        for (index, q) in s.queues.iter().enumerate() {
            let st = QueueState::from(q);
            queues.push(
                Queue::try_from(st).map_err(|source| DeviceError::VirtioQueue {
                    kind: kind.clone(),
                    index,
                    source,
                })?,
            );
        }
        self.status = s.status;
        self.acked_features = s.acked_features;
        self.device_features_sel = s.device_features_sel;
        self.driver_features_sel = s.driver_features_sel;
        self.queue_sel = s.queue_sel;
        self.irq.set_status(s.interrupt_status);
        self.queues = queues;
        self.activate_pending = s.activated;
        Ok(())
    }

    /// Start the device's own threads (see [`VirtioDevice::start`]).
    pub fn start_device(&mut self) -> Result<(), crate::error::DeviceError> {
        self.device.start()
    }

    /// See [`VirtioDevice::take_loop`].
    pub fn take_device_loop(&mut self) -> Option<Box<dyn super::DeviceLoop>> {
        self.device.take_loop()
    }

    /// Activate a restored device that was active, with the saved queue positions, and tell
    /// it it was restored. Does nothing for any other.
    pub fn activate_restored(&mut self) {
        if std::mem::take(&mut self.activate_pending) {
            self.activated = true;
            let queues = self.device_queues();
            self.device.activate_restored(
                self.mem.clone(),
                queues,
                self.irq.clone(),
                self.acked_features,
            );
        }
    }

    fn activate_device(&mut self) {
        self.activated = true;
        let queues = self.device_queues();
        self.device.activate(
            self.mem.clone(),
            queues,
            self.irq.clone(),
            self.acked_features,
        );
    }

    /// The device gets its own copies of the queues; the transport's stay for register reads.
    fn device_queues(&self) -> Vec<Queue> {
        self.queues
            .iter()
            .map(|q| Queue::try_from(q.state()).expect("validated queue state"))
            .collect()
    }

    pub fn set_paused(&mut self, paused: bool) {
        self.device.set_paused(paused);
    }
}

impl MmioDevice for VirtioMmio {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        if offset >= reg::CONFIG {
            self.device.read_config(offset - reg::CONFIG, data);
            return;
        }
        if data.len() != 4 {
            data.fill(0);
            return;
        }
        let v = self.read32(offset);
        data.copy_from_slice(&v.to_le_bytes());
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if offset >= reg::CONFIG || data.len() != 4 {
            // Config space of our devices is read-only; registers are 32-bit only.
            return;
        }
        let v = u32::from_le_bytes(data.try_into().unwrap());
        self.write32(offset, v);
    }
}
