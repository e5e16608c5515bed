//! virtio-net implemented in the VMM over a tap device (no vhost).
//!
//! The guest sees one interface with a fixed MAC (kept in snapshots, so every clone of a
//! snapshot has the parent's). The host side is a tap opened by name in the VMM's network
//! namespace; each child runs with its own namespace holding a tap of the same name, which is
//! what lets clones keep the parent's address without colliding (the host crate sets that up).
//! Without a tap the device is still there, cable unplugged: what the guest sends is dropped
//! and nothing arrives.
//!
//! * `tap`: opening `/dev/net/tun`, the virtio-net header, offloads;
//! * `device`: the virtio device (config space, feature negotiation, RX/TX queues, pause);
//! * `event_loop`: the device's event loop (tap readiness, queue notifications, lost
//!   interrupts), on a thread of its own or turned by the VM's owner.

mod device;
mod event_loop;
pub mod tap;

pub use device::{Net, QUEUES};
pub use tap::{Tap, TapError};

pub const DEVICE_ID: u32 = 1;

/// A MAC address as the guest sees it.
pub type Mac = [u8; 6];
