//! Device state as plain data.

use serde::{Deserialize, Serialize};
use virtio_queue::QueueState;
use vm_superio::serial::SerialState;

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct SerialSnapshot {
    pub baud_divisor_low: u8,
    pub baud_divisor_high: u8,
    pub interrupt_enable: u8,
    pub interrupt_identification: u8,
    pub line_control: u8,
    pub line_status: u8,
    pub modem_control: u8,
    pub modem_status: u8,
    pub scratch: u8,
    pub in_buffer: Vec<u8>,
}

impl From<&SerialState> for SerialSnapshot {
    fn from(s: &SerialState) -> Self {
        Self {
            baud_divisor_low: s.baud_divisor_low,
            baud_divisor_high: s.baud_divisor_high,
            interrupt_enable: s.interrupt_enable,
            interrupt_identification: s.interrupt_identification,
            line_control: s.line_control,
            line_status: s.line_status,
            modem_control: s.modem_control,
            modem_status: s.modem_status,
            scratch: s.scratch,
            in_buffer: s.in_buffer.clone(),
        }
    }
}

impl From<&SerialSnapshot> for SerialState {
    fn from(s: &SerialSnapshot) -> Self {
        SerialState {
            baud_divisor_low: s.baud_divisor_low,
            baud_divisor_high: s.baud_divisor_high,
            interrupt_enable: s.interrupt_enable,
            interrupt_identification: s.interrupt_identification,
            line_control: s.line_control,
            line_status: s.line_status,
            modem_control: s.modem_control,
            modem_status: s.modem_status,
            scratch: s.scratch,
            in_buffer: s.in_buffer.clone(),
        }
    }
}

/// A virtqueue's configuration and ring positions.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueueSnapshot {
    pub max_size: u16,
    pub size: u16,
    pub ready: bool,
    pub desc_table: u64,
    pub avail_ring: u64,
    pub used_ring: u64,
    pub next_avail: u16,
    pub next_used: u16,
    pub event_idx_enabled: bool,
}

impl From<&QueueState> for QueueSnapshot {
    fn from(q: &QueueState) -> Self {
        Self {
            max_size: q.max_size,
            size: q.size,
            ready: q.ready,
            desc_table: q.desc_table,
            avail_ring: q.avail_ring,
            used_ring: q.used_ring,
            next_avail: q.next_avail,
            next_used: q.next_used,
            event_idx_enabled: q.event_idx_enabled,
        }
    }
}

impl From<&QueueSnapshot> for QueueState {
    fn from(q: &QueueSnapshot) -> Self {
        QueueState {
            max_size: q.max_size,
            size: q.size,
            ready: q.ready,
            desc_table: q.desc_table,
            avail_ring: q.avail_ring,
            used_ring: q.used_ring,
            next_avail: q.next_avail,
            next_used: q.next_used,
            event_idx_enabled: q.event_idx_enabled,
        }
    }
}

/// What kind of virtio device sits behind a transport, with its own configuration.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum VirtioKind {
    Vsock {
        guest_cid: u64,
    },
    /// Appended after Vsock: older snapshots keep their encoding.
    Net {
        mac: [u8; 6],
    },
}

impl VirtioKind {
    /// How many virtqueues such a device has (what its transport is wired for).
    pub fn queues(&self) -> usize {
        match self {
            VirtioKind::Vsock { .. } => crate::devices::virtio::vsock::QUEUES,
            VirtioKind::Net { .. } => crate::devices::virtio::net::QUEUES,
        }
    }
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct VirtioMmioSnapshot {
    pub kind: VirtioKind,
    pub status: u32,
    pub acked_features: u64,
    pub device_features_sel: u32,
    pub driver_features_sel: u32,
    pub queue_sel: u32,
    pub activated: bool,
    pub interrupt_status: u32,
    /// Live queue positions (from the device once activated).
    pub queues: Vec<QueueSnapshot>,
}
