//! Snapshots as layers in the cluster's store. A snapshot made on this host becomes a base
//! layer (its memory image as zstd chunks, its VM state as the layer's state blob) in the
//! host's layer cache and is pushed to the store; a host that lacks a snapshot pulls exactly the
//! layers it is missing (every object verified against its digest as it enters the cache),
//! assembles the flat image once, and restores from it like from its own snapshot.

use std::path::{Path, PathBuf};

use tine_proto::names::Tag;
use tine_snapshot_store::builder::{
    build_base, build_diff, BuildOptions, DirtyPages, LayerInput, DEFAULT_PAGE_SIZE,
};
use tine_snapshot_store::cache::LocalCache;
use tine_snapshot_store::progress::NoProgress;
use tine_snapshot_store::remote::RemoteStore;
use tine_snapshot_store::{Digest, StoreError};
use tine_vmm::snapshot::file::{SnapshotHeader, HEADER_FILE, MEMORY_FILE, STATE_FILE};

use crate::error::{HostError, Result};

/// Where a host's layers live.
#[derive(Clone, Debug)]
pub struct StoreConfig {
    /// The cluster's store: a directory, `file:///dir`, or `s3://bucket[/prefix]` (S3 settings
    /// from the AWS_* variables, read by the store when it is opened).
    pub url: String,
    /// This host's cache of verified layers and assembled images.
    pub layer_cache: PathBuf,
    /// How a snapshot found only in the store is restored here.
    pub fetch: crate::fetch::FetchMode,
    /// Bound on the layer cache's size (None: unbounded). Images and layers no child here
    /// runs from go first, least recently used first.
    pub cache_max_bytes: Option<u64>,
    /// Layers of deleted snapshots are collected once they are this old (and nobody pushed
    /// anything during the collection); an executor daemon collects this often.
    pub gc_grace: std::time::Duration,
}

/// Default for [`StoreConfig::gc_grace`].
pub const DEFAULT_GC_GRACE: std::time::Duration = std::time::Duration::from_secs(3600);

/// What a garbage collection removed.
#[derive(Clone, Debug, Default)]
pub struct Collected {
    /// In the cluster's store.
    pub store: tine_snapshot_store::gc::GcReport,
    /// In this host's layer cache (and its assembled images).
    pub cache: tine_snapshot_store::gc::GcReport,
    pub images: u64,
}

/// What the store holds for one snapshot.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerInfo {
    /// The snapshot's own layer.
    pub head: Digest,
    /// Its parent layer (None for a base layer).
    pub parent: Option<Digest>,
    /// Head first, down to the base.
    pub chain: Vec<Digest>,
    /// Guest memory size.
    pub memory_bytes: u64,
    /// Bytes of the pages the chain stores (zero pages are not stored).
    pub raw_bytes: u64,
    /// Compressed bytes of those pages in the store.
    pub stored_bytes: u64,
    /// Pages of the working set recorded in the head layer, and the compressed bytes of the
    /// chunks holding them (what a cold host fetches before its first child).
    pub working_set_pages: u64,
    pub working_set_stored_bytes: u64,
}

/// What fetching a snapshot cost this host.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Fetched {
    pub layers: u64,
    pub objects: u64,
    pub bytes: u64,
}

/// The VM's own snapshot files travel as the layer's state blob: `snapshot.json` (the header,
/// with the state's checksum) and `state.bin`, framed as `len(header) u32 LE, header, state`.
fn encode_vm_files(header: &[u8], state: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(4 + header.len() + state.len());
    out.extend_from_slice(&(header.len() as u32).to_le_bytes());
    out.extend_from_slice(header);
    out.extend_from_slice(state);
    out
}

fn decode_vm_files(blob: &[u8]) -> Option<(&[u8], &[u8])> {
    let len = u32::from_le_bytes(blob.get(..4)?.try_into().ok()?) as usize;
    let header = blob.get(4..4usize.checked_add(len)?)?;
    let state = blob.get(4 + len..)?;
    Some((header, state))
}

fn store_err(what: &str) -> impl FnOnce(StoreError) -> HostError + '_ {
    move |e| HostError::Store {
        what: what.to_string(),
        reason: e.to_string(),
    }
}

/// The layer cache and the store of one host.
pub(crate) struct Layers {
    cfg: StoreConfig,
    cache: LocalCache,
}

impl Layers {
    pub(crate) fn open(cfg: &StoreConfig) -> Result<Layers> {
        let cache = LocalCache::open(&cfg.layer_cache).map_err(store_err("the layer cache"))?;
        let layers = Layers {
            cfg: cfg.clone(),
            cache,
        };
        // A malformed store URL is refused at start, not at the first snapshot. (The client
        // itself is made per operation: its connections belong to that operation's runtime.)
        layers.remote()?;
        Ok(layers)
    }

    pub(crate) fn url(&self) -> &str {
        &self.cfg.url
    }

    pub(crate) fn cache(&self) -> &LocalCache {
        &self.cache
    }

    pub(crate) fn remote(&self) -> Result<RemoteStore> {
        RemoteStore::open_url(&self.cfg.url).map_err(|e| HostError::Store {
            what: format!("store {}", self.cfg.url),
            reason: e.to_string(),
        })
    }

    /// Run one store operation to completion from this (blocking) thread.
    fn block_on<T>(&self, f: impl std::future::Future<Output = T>) -> Result<T> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(HostError::io("starting the store client"))?;
        Ok(rt.block_on(f))
    }

    /// Make the snapshot in `dir` a base layer and push it to the store under `tag`.
    pub(crate) fn publish(
        &self,
        tag: &Tag,
        dir: &Path,
        working_set: Vec<u64>,
    ) -> Result<LayerInfo> {
        let read = |name: &str| {
            let p = dir.join(name);
            std::fs::read(&p).map_err(HostError::io(format!("reading {}", p.display())))
        };
        let blob = encode_vm_files(&read(HEADER_FILE)?, &read(STATE_FILE)?);
        let memory = dir.join(MEMORY_FILE);
        let layer = build_base(
            &self.cache,
            &LayerInput {
                memory: &memory,
                page_size: DEFAULT_PAGE_SIZE,
                state: &blob,
            },
            &BuildOptions {
                working_set,
                ..BuildOptions::default()
            },
        )
        .map_err(store_err("building the snapshot's layer"))?;
        self.tag_and_push(tag, &layer.digest)
    }

    /// Make the diff snapshot in `dir` (a branch over `parent`, whose layer this cache holds)
    /// a diff layer over the parent's layer, and push it under `tag`: only the pages the
    /// branch holds are chunked, compressed and sent.
    pub(crate) fn publish_diff(&self, tag: &Tag, dir: &Path, parent: &Tag) -> Result<LayerInfo> {
        let read = |name: &str| {
            let p = dir.join(name);
            std::fs::read(&p).map_err(HostError::io(format!("reading {}", p.display())))
        };
        let header_raw = read(HEADER_FILE)?;
        let bad = |source| HostError::BadSnapshot {
            tag: tag.clone(),
            source,
        };
        let header = tine_vmm::snapshot::file::load_header(dir).map_err(bad)?;
        let Some(diff) = tine_vmm::snapshot::file::diff_pages(dir, &header).map_err(bad)? else {
            return Err(HostError::Store {
                what: format!("publishing branch {tag}"),
                reason: "it is not a diff".into(),
            });
        };
        let parent_head = self
            .cache
            .get_tag(parent.as_str())
            .map_err(|e| HostError::Store {
                what: format!("publishing branch {tag}"),
                reason: format!("its parent {parent} is not a layer here: {e}"),
            })?;
        // build_diff reads the pages it is given from a full-size image: a sparse one holding
        // only these pages, removed when done (a crash leaves it to the cache's temp sweep).
        let image = self.cache.tmp_dir().join(format!(
            "branch-{}.img",
            tine_proto::names::SandboxId::random("t").as_str()
        ));
        let copy = || -> std::io::Result<Vec<u64>> {
            use std::os::unix::fs::FileExt;
            let out = std::fs::File::create(&image)?;
            out.set_len(header.mem_size)?;
            let mut buf = Vec::new();
            let mut from = 0u64;
            let mut list = Vec::new();
            for r in &diff.runs {
                buf.resize(r.len() as usize, 0);
                diff.file.read_exact_at(&mut buf, from)?;
                out.write_all_at(&buf, r.offset())?;
                from += r.len();
                list.extend(r.first..r.first + r.count);
            }
            Ok(list)
        };
        let built = (|| {
            let list = copy().map_err(HostError::io(format!("staging the pages of {tag}")))?;
            let blob = encode_vm_files(&header_raw, &read(STATE_FILE)?);
            build_diff(
                &self.cache,
                &parent_head,
                &LayerInput {
                    memory: &image,
                    page_size: DEFAULT_PAGE_SIZE,
                    state: &blob,
                },
                DirtyPages::List(&list),
                &BuildOptions::default(),
            )
            .map_err(store_err("building the branch's diff layer"))
        })();
        let _ = std::fs::remove_file(&image);
        self.tag_and_push(tag, &built?.digest)
    }
    fn tag_and_push(&self, tag: &Tag, head: &Digest) -> Result<LayerInfo> {
        self.cache
            .set_tag(tag.as_str(), head)
            .map_err(store_err("tagging the layer in the cache"))?;
        let remote = self.remote()?;
        self.block_on(remote.push(&self.cache, head, Some(tag.as_str()), &NoProgress))?
            .map_err(|e| HostError::Store {
                what: format!("pushing {tag} to {}", self.cfg.url),
                reason: e.to_string(),
            })?;
        self.info(head)
    }

    /// A snapshot is deleted: untag it here and in the store, so garbage collection takes its
    /// layers once no other snapshot's chain uses them.
    pub(crate) fn forget(&self, tag: &Tag) -> Result<()> {
        match self.cache.remove_tag(tag.as_str()) {
            Ok(()) | Err(StoreError::UnknownTag(_)) => {}
            Err(e) => return Err(store_err("untagging the layer in the cache")(e)),
        }
        let remote = self.remote()?;
        self.block_on(remote.remove_tag(tag.as_str()))?
            .map_err(|e| HostError::Store {
                what: format!("untagging {tag} in {}", self.cfg.url),
                reason: e.to_string(),
            })
    }

    /// Collect layers no tag reaches (older than the grace period) in the store, then in
    /// this host's cache.
    pub(crate) fn collect_garbage(&self) -> Result<Collected> {
        use tine_snapshot_store::gc::{collect_cache_garbage, collect_garbage, GcOptions};
        let opts = GcOptions {
            min_age: self.cfg.gc_grace,
            prune_untagged: true,
            dry_run: false,
        };
        let remote = self.remote()?;
        let store = self
            .block_on(collect_garbage(&remote, &opts))?
            .map_err(|e| HostError::Store {
                what: format!("collecting garbage in {}", self.cfg.url),
                reason: e.to_string(),
            })?;
        let (cache, images) = self
            .block_on(collect_cache_garbage(&self.cache, &opts))?
            .map_err(store_err("collecting garbage in the layer cache"))?;
        Ok(Collected {
            store,
            cache,
            images,
        })
    }

    /// Digests and sizes of the chain of `head` (in the cache).
    pub(crate) fn info(&self, head: &Digest) -> Result<LayerInfo> {
        let chain = self
            .cache
            .chain(head)
            .map_err(store_err("reading the layer chain"))?;
        let mut info = LayerInfo {
            head: *head,
            parent: chain.first().and_then(|l| l.parent()),
            chain: chain.iter().map(|l| l.digest).collect(),
            memory_bytes: chain.first().map_or(0, |l| l.manifest.memory_size),
            raw_bytes: 0,
            stored_bytes: 0,
            working_set_pages: chain
                .first()
                .map_or(0, |l| l.manifest.working_set.len() as u64),
            working_set_stored_bytes: chain.first().map_or(0, |l| {
                let m = &l.manifest;
                m.chunks[..m.working_set_chunks as usize]
                    .iter()
                    .map(|c| c.stored_len)
                    .sum()
            }),
        };
        for l in &chain {
            let t = l.totals();
            info.raw_bytes += t.raw_bytes;
            info.stored_bytes += t.stored_bytes;
        }
        Ok(info)
    }

    /// Write a layer's VM files (header and state, from its state blob) into `dir`.
    pub(crate) fn write_vm_files(&self, tag: &Tag, blob: &[u8], dir: &Path) -> Result<()> {
        let malformed = || HostError::Fetch {
            tag: tag.clone(),
            store: self.cfg.url.clone(),
            reason: "the layer's VM state is malformed".into(),
        };
        let (header, state) = decode_vm_files(blob).ok_or_else(malformed)?;
        // A branch's header names its parent's directory on the host that made it; here its
        // chain is assembled into one image, so the snapshot is a complete one.
        let mut h: SnapshotHeader = serde_json::from_slice(header).map_err(|_| malformed())?;
        h.diff = None;
        let header = &serde_json::to_vec_pretty(&h).expect("a header serializes")[..];
        std::fs::create_dir_all(dir)
            .map_err(HostError::io(format!("creating {}", dir.display())))?;
        for (name, bytes) in [(HEADER_FILE, header), (STATE_FILE, state)] {
            let p = dir.join(name);
            std::fs::write(&p, bytes).map_err(HostError::io(format!("writing {}", p.display())))?;
        }
        Ok(())
    }

    /// Pull what this host lacks of `head`'s chain, assemble the flat image, and write a
    /// snapshot directory into `staging` whose memory image is that (shared, read-only) file.
    pub(crate) fn materialize(&self, tag: &Tag, head: &Digest, staging: &Path) -> Result<Fetched> {
        let remote = self.remote()?;
        let summary = self
            .block_on(remote.pull_head(&self.cache, head, &NoProgress))?
            .map_err(|e| HostError::Fetch {
                tag: tag.clone(),
                store: self.cfg.url.clone(),
                reason: e.to_string(),
            })?;
        let image = tine_snapshot_store::assemble::assemble(&self.cache, head)
            .map_err(store_err("assembling the memory image"))?;
        // Tagged here as in the store: the cache's garbage collection keeps what a snapshot
        // of this host still names.
        self.cache
            .set_tag(tag.as_str(), head)
            .map_err(store_err("tagging the layer in the cache"))?;
        let layer = self
            .cache
            .read_layer(head)
            .map_err(store_err("reading the head layer"))?;
        let blob = self
            .cache
            .read_object_raw(layer.state_ref())
            .map_err(store_err("reading the VM state"))?;
        self.write_vm_files(tag, &blob, staging)?;
        // Children here map the recorded working set before they run, as at its origin (the
        // manifest's checks keep its pages inside the image). Only a hint: not a failed fetch.
        if !layer.manifest.working_set.is_empty() {
            if let Err(e) = crate::lazy::save_page_list(
                staging,
                crate::lazy::WORKING_SET_FILE,
                &layer.manifest.working_set,
            ) {
                tracing::warn!(%tag, "keeping the working set beside the snapshot: {e}");
            }
        }
        // Children map it MAP_PRIVATE: the assembled image is shared, never written.
        std::os::unix::fs::symlink(&image, staging.join(MEMORY_FILE))
            .map_err(HostError::io(format!("linking {}", image.display())))?;
        Ok(Fetched {
            layers: summary.layers_transferred,
            objects: summary.objects_transferred,
            bytes: summary.bytes_transferred,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vm_files_frame_round_trips_and_rejects_garbage() {
        let blob = encode_vm_files(b"{\"h\":1}", b"state bytes");
        assert_eq!(
            decode_vm_files(&blob),
            Some((&b"{\"h\":1}"[..], &b"state bytes"[..]))
        );
        assert_eq!(decode_vm_files(&[1, 2]), None);
        assert_eq!(decode_vm_files(&[255, 255, 255, 255, 0]), None);
    }
}
