//! Lazy restore: a child starts on a host that does not have its snapshot's memory image yet.
//! Its guest RAM is anonymous memory registered with a userfaultfd (the worker hands the
//! descriptor over, see [`crate::handoff`]); this module supplies each page on first touch
//! from the host's chunk cache, fetching a missing chunk from the store on demand (verified
//! against the digest the layer names before it enters the cache).
//!
//! The first lazily restored child of a head records its working set: the pages it touched
//! until it was ready, in the order it touched them. That list is stored beside the layers
//! (`workingsets/<head>`) and later cold hosts fetch its chunks at once and copy its pages in
//! before the guest asks for them. Pages are supplied in aligned blocks of [`BLOCK_PAGES`],
//! so one fault (or one working-set entry) brings its neighbours along.

use std::collections::{HashMap, VecDeque};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use object_store::ObjectStoreExt;
use tine_proto::names::Tag;
use tine_snapshot_store::cache::LocalCache;
use tine_snapshot_store::manifest::{pb, Layer, PageSource};
use tine_snapshot_store::remote::RemoteStore;
use tine_snapshot_store::Digest;
use userfaultfd::{Event, Uffd};

use crate::error::{HostError, Result};
use crate::handoff::MappedRange;
use crate::layers::Layers;

/// Pages supplied per fault: an aligned 64 KiB block around the touched page.
pub const BLOCK_PAGES: u64 = 16;
const PAGE: u64 = 4096;
/// Decompressed chunks kept in memory (chunks are 1-5 MiB).
const DECODED_CHUNKS: usize = 16;
/// Upper bound on a working set's entries (hostile or corrupt objects).
const MAX_WORKING_SET: usize = 1 << 24;
const WS_MAGIC: &[u8; 4] = b"TWS1";

/// Store key of the working set recorded for `head`.
pub fn working_set_key(head: &Digest) -> String {
    format!("workingsets/{}", head.hex())
}

/// Encode a working set: magic, page size, count, then pages (u64 LE each).
pub fn encode_working_set(pages: &[u64]) -> Vec<u8> {
    let mut b = Vec::with_capacity(12 + pages.len() * 8);
    b.extend_from_slice(WS_MAGIC);
    b.extend_from_slice(&(PAGE as u32).to_le_bytes());
    b.extend_from_slice(&(pages.len() as u32).to_le_bytes());
    for p in pages {
        b.extend_from_slice(&p.to_le_bytes());
    }
    b
}

/// Decode a working set for a guest of `page_count` pages; None if it is not one.
pub fn decode_working_set(b: &[u8], page_count: u64) -> Option<Vec<u64>> {
    if b.get(..4)? != WS_MAGIC || u32::from_le_bytes(b.get(4..8)?.try_into().ok()?) as u64 != PAGE {
        return None;
    }
    let n = u32::from_le_bytes(b.get(8..12)?.try_into().ok()?) as usize;
    if n > MAX_WORKING_SET || b.len() != 12 + n * 8 {
        return None;
    }
    let pages: Vec<u64> = b[12..]
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
        .collect();
    pages.iter().all(|&p| p < page_count).then_some(pages)
}

/// A snapshot directory's copy of its working set: the pages its first child touched until
/// ready, which its workers map before the guest runs (see [`tine_vmm::prefault`]).
pub const WORKING_SET_FILE: &str = "workingset";
/// The pages children of this snapshot write until ready: its workers copy them ahead.
pub const WRITTEN_SET_FILE: &str = "writtenset";

/// Write `pages` as `dir/name` (temp file, fsync, rename: never half a file).
pub fn save_page_list(dir: &std::path::Path, name: &str, pages: &[u64]) -> Result<()> {
    use std::io::Write;
    // Unique, so two writers of one list (two publishes of a tag) never share a temp file.
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let path = dir.join(name);
    let seq = SEQ.fetch_add(1, Ordering::Relaxed);
    let tmp = dir.join(format!(".{name}.{}.{seq}.tmp", std::process::id()));
    let write = || -> std::io::Result<()> {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(&encode_working_set(pages))?;
        f.sync_all()?;
        std::fs::rename(&tmp, &path)
    };
    write().map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        HostError::io(format!("writing {}", path.display()))(e)
    })
}

/// The page list `dir/name` for a guest of `page_count` pages, if it is a well-formed one (a
/// hint: a missing or bad file means no prefault, never a failed spawn).
pub fn load_page_list(dir: &std::path::Path, name: &str, page_count: u64) -> Option<Vec<u64>> {
    let path = dir.join(name);
    if std::fs::metadata(&path).ok()?.len() > 12 + 8 * MAX_WORKING_SET as u64 {
        return None;
    }
    decode_working_set(&std::fs::read(path).ok()?, page_count)
}

/// What lazy restores of one head cost this host so far.
#[derive(Default, Debug)]
pub struct ImageCounters {
    pub fetched_objects: AtomicU64,
    pub fetched_bytes: AtomicU64,
}

/// One head's pages, served to any number of lazily restored children on this host.
pub(crate) struct LazyImage {
    pub tag: Tag,
    pub head: Digest,
    store: String,
    chain: Vec<Layer>,
    page_count: u64,
    cache: LocalCache,
    remote: RemoteStore,
    rt: tokio::runtime::Runtime,
    /// One fetch per object at a time; later askers wait and then find it cached.
    gates: Mutex<HashMap<Digest, Arc<Mutex<()>>>>,
    decoded: Mutex<VecDeque<(Digest, Arc<Vec<u8>>)>>,
    /// The snapshot's header and state (no memory image): what lazy workers restore.
    pub dir: PathBuf,
    /// The recorded working set, if the store has one and prefetching is on.
    pub working_set: Option<Arc<Vec<u64>>>,
    /// Set once some child has been chosen to record the working set.
    recording_claimed: AtomicBool,
    pub counters: ImageCounters,
}

impl Drop for LazyImage {
    /// The last child served from it has exited: its header and state are not needed.
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Where one page comes from.
enum Source {
    Zero,
    Stored {
        layer: usize,
        chunk: usize,
        chunk_page: u64,
    },
}

impl LazyImage {
    /// Fetch the manifests of `head`'s chain and its VM state (small), write the header and
    /// state into `dir`, and, with `prefetch`, load the recorded working set and start
    /// fetching its chunks in the background. No manifest enters the cache here: a cached
    /// manifest promises all its chunks, which only the full fetch keeps.
    pub fn open(
        layers: &Layers,
        tag: &Tag,
        head: &Digest,
        dir: PathBuf,
        prefetch: bool,
    ) -> Result<Arc<LazyImage>> {
        let store = layers.url();
        let (remote, cache) = (layers.remote()?, layers.cache().clone());
        let fetch_err = |reason: String| HostError::Fetch {
            tag: tag.clone(),
            store: store.to_string(),
            reason,
        };
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("tine-lazy-fetch")
            .enable_all()
            .build()
            .map_err(HostError::io("starting the store client"))?;
        let mut chain: Vec<Layer> = Vec::new();
        let mut next = Some(*head);
        while let Some(d) = next {
            let layer = if cache.has_layer(&d) {
                cache.read_layer(&d)
            } else {
                rt.block_on(remote.get_layer(&d))
            }
            .map_err(|e| fetch_err(format!("layer {d}: {e}")))?;
            if let Some(child) = chain.last() {
                let (c, p) = (&child.manifest, &layer.manifest);
                if c.memory_size != p.memory_size || c.page_size != p.page_size {
                    return Err(fetch_err(format!(
                        "layer {d} does not match its child's memory layout"
                    )));
                }
            }
            next = layer.parent();
            chain.push(layer);
        }
        let top = &chain[0];
        if top.page_size() != PAGE {
            return Err(fetch_err(format!(
                "lazy restore needs {PAGE}-byte pages; layer {head} has {}",
                top.page_size()
            )));
        }
        let page_count = top.page_count();
        let image = Arc::new(LazyImage {
            tag: tag.clone(),
            head: *head,
            store: store.to_string(),
            page_count,
            cache,
            remote,
            rt,
            gates: Mutex::default(),
            decoded: Mutex::default(),
            dir,
            working_set: None,
            recording_claimed: AtomicBool::new(false),
            counters: ImageCounters::default(),
            chain,
        });
        let state = image.chain[0].state_ref().clone();
        image.fetch_object(&state, "VM state")?;
        let blob = image
            .cache
            .read_object_raw(&state)
            .map_err(|e| fetch_err(format!("the VM state: {e}")))?;
        layers.write_vm_files(tag, &blob, &image.dir)?;
        // The working set recorded when the snapshot was made travels in its layer (its pages
        // in chunks of their own); an older layer may have one recorded by a lazy restore.
        let in_layer = &image.chain[0].manifest.working_set;
        let working_set = if !prefetch {
            None
        } else if !in_layer.is_empty() {
            Some(in_layer.clone())
        } else {
            image.load_working_set()
        };
        let Some(ws) = working_set else {
            return Ok(image);
        };
        // Nobody else holds the Arc yet.
        let mut image = Arc::into_inner(image).expect("sole owner");
        image.working_set = Some(Arc::new(ws));
        let image = Arc::new(image);
        image.prefetch_chunks_in_background();
        Ok(image)
    }

    /// The working set stored for this head, if any (a hint: a bad one is ignored).
    fn load_working_set(&self) -> Option<Vec<u64>> {
        let key = object_store::path::Path::from(working_set_key(&self.head));
        let store = self.remote.object_store().clone();
        let got = self
            .rt
            .block_on(async move { store.get(&key).await?.bytes().await });
        match got {
            Ok(b) => {
                let ws = decode_working_set(&b, self.page_count);
                if ws.is_none() {
                    tracing::warn!(head = %self.head, "ignoring a malformed working set");
                }
                ws
            }
            Err(object_store::Error::NotFound { .. }) => None,
            Err(e) => {
                tracing::warn!(head = %self.head, "no working set: {e}");
                None
            }
        }
    }

    /// Start fetching every chunk the working set needs, several at a time.
    fn prefetch_chunks_in_background(self: &Arc<Self>) {
        let Some(ws) = self.working_set.clone() else {
            return;
        };
        let mut wanted: Vec<(usize, usize)> = Vec::new();
        let mut seen = std::collections::HashSet::new();
        for &p in ws.iter() {
            if let Source::Stored { layer, chunk, .. } = self.locate(p) {
                if seen.insert((layer, chunk)) {
                    wanted.push((layer, chunk));
                }
            }
        }
        let me = self.clone();
        std::thread::Builder::new()
            .name("tine-prefetch".into())
            .spawn(move || {
                let queue = Mutex::new(wanted.into_iter());
                std::thread::scope(|s| {
                    for _ in 0..4 {
                        s.spawn(|| loop {
                            let next = queue.lock().unwrap_or_else(|p| p.into_inner()).next();
                            let Some((layer, chunk)) = next else { return };
                            let o = me.chain[layer].manifest.chunks[chunk].clone();
                            if let Err(e) = me.fetch_object(&o, "chunk") {
                                tracing::warn!(head = %me.head, "prefetching: {e}");
                            }
                        });
                    }
                });
            })
            .ok();
    }

    /// Claim the recording of this head's working set (once per host, and only when none is
    /// stored yet).
    pub fn claim_recording(&self) -> bool {
        self.working_set.is_none()
            && self.chain[0].manifest.working_set.is_empty()
            && !self.recording_claimed.swap(true, Ordering::AcqRel)
    }

    /// Store a recorded working set (best effort: it is only a hint).
    pub fn save_working_set(&self, pages: &[u64]) {
        let key = object_store::path::Path::from(working_set_key(&self.head));
        let store = self.remote.object_store().clone();
        let body = encode_working_set(pages);
        let r = self
            .rt
            .block_on(async move { store.put(&key, body.into()).await });
        match r {
            Ok(_) => tracing::info!(head = %self.head, pages = pages.len(), "working set recorded"),
            Err(e) => tracing::warn!(head = %self.head, "storing the working set: {e}"),
        }
    }

    fn locate(&self, page: u64) -> Source {
        for (li, layer) in self.chain.iter().enumerate() {
            match layer.lookup(page) {
                PageSource::Stored { chunk, chunk_page } => {
                    return Source::Stored {
                        layer: li,
                        chunk,
                        chunk_page,
                    }
                }
                PageSource::Zero => return Source::Zero,
                PageSource::Inherited => {}
            }
        }
        Source::Zero
    }

    /// Make sure object `o` is in the cache: fetched once, verified before it enters.
    /// `what` names the object in errors ("chunk", "VM state").
    fn fetch_object(&self, o: &pb::ObjectRef, what: &str) -> Result<()> {
        let fail = |reason: String| HostError::Fetch {
            tag: self.tag.clone(),
            store: self.store.clone(),
            reason,
        };
        let d = Digest::from_bytes(&o.hash).map_err(|e| fail(e.to_string()))?;
        if self.cache.has_object(&d) {
            return Ok(());
        }
        let gate = self
            .gates
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(d)
            .or_default()
            .clone();
        let _one = gate.lock().unwrap_or_else(|p| p.into_inner());
        if self.cache.has_object(&d) {
            return Ok(());
        }
        let data = self
            .rt
            .block_on(self.remote.get_object(&d, o.stored_len))
            .map_err(|e| fail(format!("{what} {d}: {e}")))?
            .ok_or_else(|| fail(format!("{what} {d} is missing from the store")))?;
        if data.len() as u64 != o.stored_len {
            return Err(fail(format!(
                "{what} {d} is {} bytes in the store, its layer says {}",
                data.len(),
                o.stored_len
            )));
        }
        self.cache
            .put_object_verified(&d, &data)
            .map_err(|e| fail(format!("{what}: {e}")))?;
        self.counters
            .fetched_objects
            .fetch_add(1, Ordering::Relaxed);
        self.counters
            .fetched_bytes
            .fetch_add(data.len() as u64, Ordering::Relaxed);
        Ok(())
    }

    /// A chunk's pages, decompressed (recently used ones stay in memory).
    fn chunk(&self, layer: usize, chunk: usize) -> Result<Arc<Vec<u8>>> {
        let o = &self.chain[layer].manifest.chunks[chunk];
        let d = self.chain[layer].chunk_digest(chunk);
        {
            let mut lru = self.decoded.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(i) = lru.iter().position(|(k, _)| *k == d) {
                let hit = lru.remove(i).expect("present");
                let data = hit.1.clone();
                lru.push_front(hit);
                return Ok(data);
            }
        }
        self.fetch_object(o, "chunk")?;
        let data = Arc::new(
            self.cache
                .read_object_raw(o)
                .map_err(|e| HostError::Fetch {
                    tag: self.tag.clone(),
                    store: self.store.clone(),
                    reason: e.to_string(),
                })?,
        );
        let mut lru = self.decoded.lock().unwrap_or_else(|p| p.into_inner());
        lru.push_front((d, data.clone()));
        lru.truncate(DECODED_CHUNKS);
        Ok(data)
    }
}

/// Where a lazily restored child's pages come from: a snapshot in the store
/// ([`LazyImage`]) or a memory image on this host ([`FileImage`], to record a working set).
pub(crate) trait Pages: Send + Sync {
    fn tag(&self) -> &Tag;
    fn page_count(&self) -> u64;
    /// Pages to copy in before the guest asks for them.
    fn working_set(&self) -> Option<Arc<Vec<u64>>>;
    /// Whether this child should record its working set.
    fn claim_recording(&self) -> bool;
    /// A child's recorded working set.
    fn recorded(self: Arc<Self>, pages: Vec<u64>);
    /// Whether recording goes on after the child is ready, until its VMM exits (the one
    /// who spawned it decides how long it runs on); the list is then handed over by the
    /// page server as it ends.
    fn records_past_ready(&self) -> bool {
        false
    }
    /// True for a page that is zero (mapped with UFFDIO_ZEROPAGE, nothing read).
    fn is_zero(&self, page: u64) -> bool;
    /// True if supplying the page needs nothing fetched (zero, or its chunk is here).
    fn is_local(&self, page: u64) -> bool;
    fn read_page(&self, page: u64, out: &mut [u8]) -> Result<()>;
    /// Bytes and objects fetched from the store so far.
    fn fetched(&self) -> (u64, u64);
}

impl Pages for LazyImage {
    fn tag(&self) -> &Tag {
        &self.tag
    }
    fn page_count(&self) -> u64 {
        self.page_count
    }
    fn working_set(&self) -> Option<Arc<Vec<u64>>> {
        self.working_set.clone()
    }
    fn claim_recording(&self) -> bool {
        LazyImage::claim_recording(self)
    }
    fn recorded(self: Arc<Self>, pages: Vec<u64>) {
        // Stored beside the layers for later cold hosts (only a hint: best effort).
        std::thread::spawn(move || self.save_working_set(&pages));
    }
    fn is_zero(&self, page: u64) -> bool {
        matches!(self.locate(page), Source::Zero)
    }
    fn is_local(&self, page: u64) -> bool {
        match self.locate(page) {
            Source::Zero => true,
            Source::Stored { layer, chunk, .. } => {
                let d = self.chain[layer].chunk_digest(chunk);
                let decoded = self
                    .decoded
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .iter()
                    .any(|(k, _)| *k == d);
                decoded || self.cache.has_object(&d)
            }
        }
    }
    fn read_page(&self, page: u64, out: &mut [u8]) -> Result<()> {
        match self.locate(page) {
            Source::Zero => out.fill(0),
            Source::Stored {
                layer,
                chunk,
                chunk_page,
            } => {
                let data = self.chunk(layer, chunk)?;
                let from = (chunk_page * PAGE) as usize;
                out.copy_from_slice(&data[from..from + PAGE as usize]);
            }
        }
        Ok(())
    }
    fn fetched(&self) -> (u64, u64) {
        (
            self.counters.fetched_bytes.load(Ordering::Acquire),
            self.counters.fetched_objects.load(Ordering::Acquire),
        )
    }
}

/// A snapshot's memory image on this host, served page by page to one child so that the
/// pages it touches until ready are recorded (the working set stored in its layer).
pub(crate) struct FileImage {
    tag: Tag,
    dir: PathBuf,
    file: std::fs::File,
    page_count: u64,
    recorded: Mutex<Option<Vec<u64>>>,
}

impl FileImage {
    pub fn open(tag: &Tag, dir: &std::path::Path) -> Result<Arc<FileImage>> {
        let path = dir.join(tine_vmm::snapshot::file::MEMORY_FILE);
        let file = std::fs::File::open(&path)
            .map_err(HostError::io(format!("opening {}", path.display())))?;
        let len = file
            .metadata()
            .map_err(HostError::io(format!("reading {}", path.display())))?
            .len();
        Ok(Arc::new(FileImage {
            tag: tag.clone(),
            dir: dir.to_path_buf(),
            file,
            page_count: len / PAGE,
            recorded: Mutex::default(),
        }))
    }

    /// What the child recorded (once).
    pub fn take_recorded(&self) -> Option<Vec<u64>> {
        self.recorded
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
    }
}

impl Pages for FileImage {
    fn tag(&self) -> &Tag {
        &self.tag
    }
    fn page_count(&self) -> u64 {
        self.page_count
    }
    fn working_set(&self) -> Option<Arc<Vec<u64>>> {
        None
    }
    fn claim_recording(&self) -> bool {
        true
    }
    fn recorded(self: Arc<Self>, pages: Vec<u64>) {
        *self.recorded.lock().unwrap_or_else(|p| p.into_inner()) = Some(pages);
    }
    fn records_past_ready(&self) -> bool {
        true
    }
    fn is_zero(&self, _page: u64) -> bool {
        false // read and copied like any page (the file is sparse: holes read as zeros)
    }
    fn is_local(&self, _page: u64) -> bool {
        true
    }
    fn read_page(&self, page: u64, out: &mut [u8]) -> Result<()> {
        use std::os::unix::fs::FileExt;
        self.file
            .read_exact_at(out, page * PAGE)
            .map_err(HostError::io(format!(
                "reading page {page} of {}",
                self.dir.display()
            )))
    }
    fn fetched(&self) -> (u64, u64) {
        (0, 0)
    }
}

/// One lazily restored child's page service, shared with the spawn that waits for it.
#[derive(Default)]
pub struct ChildPages {
    /// Set when the child is ready: recording stops.
    pub ready: AtomicBool,
    /// Pages first touched before readiness, in order (only for the recording child).
    pub recorded: Mutex<Option<Vec<u64>>>,
    pub faults: AtomicU64,
    pub pages_copied: AtomicU64,
    pub pages_zeroed: AtomicU64,
    pub pages_prefetched: AtomicU64,
    /// Why the pages stopped coming (the child was killed: a guest must never run on with a
    /// page it did not get).
    pub failure: Mutex<Option<HostError>>,
}

/// A page-aligned buffer for one block (UFFDIO_COPY copies whole pages).
struct BlockBuf(Box<[u8]>, usize);

impl BlockBuf {
    fn new() -> Self {
        // Over-allocate by a page and start at the first page boundary.
        let raw = vec![0u8; ((BLOCK_PAGES + 1) * PAGE) as usize].into_boxed_slice();
        let off = raw.as_ptr().align_offset(PAGE as usize);
        BlockBuf(raw, off)
    }
    fn page(&mut self, i: u64) -> &mut [u8] {
        let s = self.1 + (i * PAGE) as usize;
        &mut self.0[s..s + PAGE as usize]
    }
    fn ptr(&self, i: u64) -> *const libc::c_void {
        self.0[self.1 + (i * PAGE) as usize..].as_ptr().cast()
    }
}

struct Server {
    image: Arc<dyn Pages>,
    uffd: Uffd,
    ranges: Vec<MappedRange>,
    pages: Arc<ChildPages>,
    /// Pages supplied so far, by image page number.
    served: Vec<u64>,
    buf: BlockBuf,
    recorded_seen: Vec<u64>,
}

use crate::process::pidfd_kill;
pub use crate::process::pidfd_open;

/// Serve `uffd`'s faults until the process behind `pidfd` exits. With a working set, its
/// pages are copied in between faults (faults always go first).
pub(crate) fn serve(
    image: Arc<dyn Pages>,
    uffd: OwnedFd,
    ranges: Vec<MappedRange>,
    pidfd: OwnedFd,
    pages: Arc<ChildPages>,
) {
    // SAFETY: the descriptor is a userfaultfd handed over by our worker; we own it now.
    let uffd = unsafe { Uffd::from_raw_fd(std::os::fd::IntoRawFd::into_raw_fd(uffd)) };
    let words = image.page_count().div_ceil(64) as usize;
    let mut s = Server {
        image: image.clone(),
        uffd,
        ranges,
        pages,
        served: vec![0; words],
        buf: BlockBuf::new(),
        recorded_seen: vec![0; words],
    };
    let mut prefetch = image.working_set().map(|ws| (ws, 0usize));
    loop {
        let busy = prefetch.is_some();
        let mut pfds = [
            libc::pollfd {
                fd: s.uffd.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: pidfd.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: two valid pollfds.
        let n = unsafe { libc::poll(pfds.as_mut_ptr(), 2, if busy { 0 } else { 1000 }) };
        if n < 0 {
            if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            break;
        }
        if pfds[0].revents & libc::POLLIN != 0 {
            if let Err(e) = s.drain_events() {
                tracing::error!(tag = %image.tag(), "serving guest pages: {e}; killing the child");
                pidfd_kill(&pidfd);
                *s.pages.failure.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                break;
            }
            continue;
        }
        if pfds[1].revents != 0 || pfds[0].revents & (libc::POLLERR | libc::POLLHUP) != 0 {
            break; // the VMM is gone
        }
        if let Some((ws, next)) = prefetch.as_mut() {
            // One block per round, so a fault never waits behind the whole working set.
            while *next < ws.len() && s.is_served(ws[*next]) {
                *next += 1;
            }
            if *next >= ws.len() {
                prefetch = None;
                continue;
            }
            let page = ws[*next];
            *next += 1;
            match s.supply_block(page, None) {
                Ok(n) => {
                    s.pages.pages_prefetched.fetch_add(n, Ordering::Relaxed);
                }
                Err(e) => {
                    tracing::warn!(tag = %image.tag(), "prefetching page {page}: {e}");
                    prefetch = None;
                }
            }
        }
    }
    // A recording kept past readiness ends with the VMM (any other ends at readiness, and
    // a child that never got there leaves none).
    if image.records_past_ready() {
        let recorded = s
            .pages
            .recorded
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(ws) = recorded.filter(|w| !w.is_empty()) {
            image.recorded(ws);
        }
    }
}

impl Server {
    fn is_served(&self, p: u64) -> bool {
        self.served[(p / 64) as usize] & (1 << (p % 64)) != 0
    }
    fn mark(&mut self, p: u64) {
        self.served[(p / 64) as usize] |= 1 << (p % 64);
    }

    fn drain_events(&mut self) -> Result<()> {
        let broken =
            |what: String| HostError::io("serving guest pages")(std::io::Error::other(what));
        loop {
            match self.uffd.read_event() {
                Ok(None) => return Ok(()),
                Ok(Some(Event::Pagefault { addr, .. })) => {
                    let addr = addr as u64 & !(PAGE - 1);
                    let r = *MappedRange::find(&self.ranges, addr)
                        .ok_or_else(|| broken(format!("fault at {addr:#x} outside guest RAM")))?;
                    let page = (r.image_offset + (addr - r.host_addr)) / PAGE;
                    self.pages.faults.fetch_add(1, Ordering::Relaxed);
                    self.record(page);
                    self.supply_block(page, Some(addr))?;
                }
                Ok(Some(other)) => {
                    tracing::debug!(?other, "userfaultfd event ignored");
                }
                Err(userfaultfd::Error::SystemError(e)) if e as i32 == libc::EAGAIN => {
                    return Ok(())
                }
                Err(e) => return Err(broken(format!("reading the userfaultfd: {e}"))),
            }
        }
    }

    fn record(&mut self, page: u64) {
        if self.pages.ready.load(Ordering::Acquire) {
            return;
        }
        let w = (page / 64) as usize;
        if self.recorded_seen[w] & (1 << (page % 64)) != 0 {
            return;
        }
        self.recorded_seen[w] |= 1 << (page % 64);
        if let Some(list) = self
            .pages
            .recorded
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_mut()
        {
            list.push(page);
        }
    }

    /// Supply the aligned block around image page `page`: every page not supplied yet, and
    /// the faulting one (`fault`: its worker address) in any case. Returns pages supplied.
    fn supply_block(&mut self, page: u64, fault: Option<u64>) -> Result<u64> {
        let r = self
            .ranges
            .iter()
            .find(|r| page * PAGE >= r.image_offset && page * PAGE - r.image_offset < r.size)
            .copied();
        let Some(r) = r else {
            return Ok(0); // a page in no range (a working-set entry for a hole): nothing to do
        };
        let range_first = r.image_offset / PAGE;
        let range_end = range_first + r.size / PAGE;
        // While a working set is recorded, one page per fault: a neighbour supplied along
        // would never fault, so never be recorded, and a cold host would miss it.
        let recording = !self.pages.ready.load(Ordering::Acquire)
            && self
                .pages
                .recorded
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .is_some();
        let (first, end) = if recording {
            (page, page + 1)
        } else {
            let first = (page / BLOCK_PAGES * BLOCK_PAGES).max(range_first);
            (first, (first + BLOCK_PAGES).min(range_end))
        };
        let host = |p: u64| r.host_addr + (p * PAGE - r.image_offset);
        // The page asked for always (a repeated fault is answered again); a neighbour only if
        // not supplied yet and at hand: no chunk is fetched for a page nobody asked for.
        let wanted = |s: &Self, q: u64| {
            if q == page {
                fault.is_some() || !s.is_served(q)
            } else {
                !s.is_served(q) && s.image.is_local(q)
            }
        };
        let mut supplied = 0;
        let mut p = first;
        while p < end {
            if !wanted(self, p) {
                p += 1;
                continue;
            }
            // A run of wanted pages of one kind (zero or stored).
            let zero = self.image.is_zero(p);
            let mut q = p;
            while q < end && wanted(self, q) && self.image.is_zero(q) == zero {
                if !zero {
                    self.image.read_page(q, self.buf.page(q - p))?;
                }
                q += 1;
            }
            let dst = host(p) as *mut libc::c_void;
            let len = ((q - p) * PAGE) as usize;
            // SAFETY: dst..dst+len lies in a range the worker registered with this uffd, and
            // the buffer holds `len` bytes; the kernel copies into the worker's memory.
            let done = unsafe {
                if zero {
                    self.uffd.zeropage(dst, len, true)
                } else {
                    self.uffd.copy(self.buf.ptr(0), dst, len, true)
                }
            };
            match done {
                Ok(_) => {}
                // Already there (a second fault on a page we just supplied): wake the waiter.
                Err(userfaultfd::Error::CopyFailed(e) | userfaultfd::Error::ZeropageFailed(e))
                    if e as i32 == libc::EEXIST =>
                {
                    let _ = self.uffd.wake(dst, len);
                }
                Err(e) => {
                    return Err(HostError::io("supplying guest pages")(
                        std::io::Error::other(e.to_string()),
                    ))
                }
            }
            for k in p..q {
                self.mark(k);
            }
            let n = q - p;
            supplied += n;
            if zero {
                self.pages.pages_zeroed.fetch_add(n, Ordering::Relaxed);
            } else {
                self.pages.pages_copied.fetch_add(n, Ordering::Relaxed);
            }
            p = q;
        }
        if let Some(addr) = fault {
            debug_assert_eq!(host(page), addr);
        }
        Ok(supplied)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn working_sets_round_trip_and_hostile_ones_are_refused() {
        let ws = vec![5, 1, 4096, 7];
        let b = encode_working_set(&ws);
        assert_eq!(decode_working_set(&b, 8192), Some(ws));
        // A page past the guest's end, a wrong count, wrong magic.
        assert_eq!(decode_working_set(&b, 4096), None);
        assert_eq!(decode_working_set(&b[..b.len() - 1], 8192), None);
        let mut bad = b.clone();
        bad[0] = b'X';
        assert_eq!(decode_working_set(&bad, 8192), None);
        let mut huge = b.clone();
        huge[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(decode_working_set(&huge, 8192), None);
    }
}
