//! virtio-vsock implemented in the VMM (no vhost). The host side is a Unix socket per VM:
//!
//! * host → guest: connect to the socket, send `CONNECT <port>\n`, read `OK <host port>\n`, then
//!   the stream is connected to guest port `<port>`;
//! * guest → host: a guest connection to CID 2 port `P` is connected to the Unix socket
//!   `<socket path>_P`, if something listens there.
//!
//! Streams use the virtio-vsock credit protocol both ways, so a slow reader on either side
//! stalls only its own connection. Many concurrent streams per VM are supported.
//!
//! One file per concern:
//! * `packet`: the wire header, op codes and flags;
//! * `connection`: one stream's state machine and credit accounting;
//! * `muxer`: the host-side Unix sockets and the table routing packets to streams;
//! * `device`: the virtio device itself (queues, interrupts, pause, restore);
//! * `event_loop`: the event loop (host stream events, lost-interrupt watchdog);
//! * `dump`: the one-line state description logged when diagnosing stalls;
//! * `first_call`: what a restored guest's first host call waited on, logged once.
//!
//! The signal that asks for that state on demand is handled in [`crate::diagnostics`], not here.

mod connection;
mod device;
mod dump;
mod event_loop;
mod first_call;
mod muxer;
mod packet;

pub use device::{Vsock, QUEUES};
pub use packet::Header;

pub const DEVICE_ID: u32 = 19;
pub const HOST_CID: u64 = 2;
