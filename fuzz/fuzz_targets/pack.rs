//! Packs as `tine store import` reads them from a file someone handed over: any bytes. The
//! import must refuse what is malformed, truncated or inconsistent, all or nothing, and leave
//! the cache as it was.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tine_snapshot_store::cache::LocalCache;
use tine_snapshot_store::pack::{import_pack, ImportOptions};

fuzz_target!(|data: &[u8]| {
    let dir = tempfile::tempdir().unwrap();
    let cache = LocalCache::open(dir.path().join("cache")).unwrap();
    let imported = import_pack(&cache, data, &ImportOptions::default());
    if imported.is_err() {
        // All or nothing: a refused pack leaves no tag behind.
        assert!(cache.list_tags().map(|t| t.is_empty()).unwrap_or(true));
    }
});
