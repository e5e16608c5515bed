//! Layer manifests as a store or a peer hands them over: any bytes, hashed to the digest they
//! are fetched under. Decoding must refuse what does not validate, and whatever validates must
//! answer page lookups without panicking or allocating by declared sizes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tine_snapshot_store::{Digest, Layer};

fuzz_target!(|data: &[u8]| {
    let Ok(layer) = Layer::decode_verified(Digest::of(data), data.to_vec()) else {
        return;
    };
    let pages = layer.page_count();
    let _ = layer.totals();
    let _ = layer.stored_bytes();
    let _ = layer.parent();
    let _ = layer.state_ref();
    for r in layer.object_refs() {
        let _ = r;
    }
    // The first, last and a few pages the input itself points at.
    let mut probes = vec![0, pages.saturating_sub(1), pages / 2, pages, u64::MAX];
    probes.extend(
        data.chunks_exact(8)
            .take(8)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap()) % pages.max(1)),
    );
    for page in probes {
        let _ = layer.lookup(page);
    }
});
