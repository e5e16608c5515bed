//! Tine's protocol definitions, generated from the `.proto` files under
//! `proto/tine/`. One Rust module per protobuf package, plus the validated names and the
//! limits every side of the APIs shares.

pub mod limits;
pub mod names;
pub mod net;

/// `tine.store.v1`: the on-disk/on-wire formats of the snapshot store.
pub mod store {
    pub mod v1 {
        include!(concat!(env!("OUT_DIR"), "/tine.store.v1.rs"));
    }
}

/// `tine.agent.v1`: host <-> guest agent protocol over virtio-vsock.
pub mod agent {
    pub mod v1 {
        include!(concat!(env!("OUT_DIR"), "/tine.agent.v1.rs"));
    }
}

/// `tine.v1`: the public control-plane API.
#[cfg(feature = "grpc")]
pub mod v1 {
    tonic::include_proto!("tine.v1");
}

/// `tine.executor.v1`: the internal API executors serve to the control plane.
#[cfg(feature = "grpc")]
pub mod executor {
    pub mod v1 {
        tonic::include_proto!("tine.executor.v1");
    }
}

/// Encoded descriptors of every package, for gRPC server reflection.
#[cfg(feature = "grpc")]
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("tine_descriptor");
