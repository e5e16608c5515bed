//! Tine's guest agent and its host-side client.
//!
//! The agent runs inside each microVM (as PID 1 or under a small init) and
//! serves exec, file transfer and warm-Python eval over virtio-vsock port 52.
//! The protocol is `tine.agent.v1` (proto/tine/agent/v1/agent.proto), framed
//! as u32 big-endian length + protobuf, one request per connection.

pub mod bench;
pub mod build;
pub mod cli;
pub mod client;
pub mod config;
pub mod frame;
pub mod paths;
pub mod server;

/// Generated protocol types.
pub use tine_proto::agent::v1 as pb;
