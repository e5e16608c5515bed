//! Tine's protocol definitions, generated from the `.proto` files under
//! `proto/tine/`. One Rust module per protobuf package.

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
