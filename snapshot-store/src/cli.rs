//! `tine push|pull|pack|unpack|images|gc|keygen|layer-create` as a library
//! module; the `tine` binary flattens [`StoreCommand`] into its subcommands
//! and calls [`run`] (async) or [`run_blocking`].

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context};

use crate::assemble::assemble;
use crate::builder::{
    build_base, build_diff, BuildOptions, DirtyPages, LayerInput, DEFAULT_PAGE_SIZE,
};
use crate::cache::LocalCache;
use crate::digest::Digest;
use crate::gc::{collect_cache_garbage, collect_garbage, GcOptions};
use crate::keys::{generate_signing_key, load_signing_key, load_verifying_key, write_keypair};
use crate::pack::{export_pack_to_file, import_pack_file, ImportOptions, PackHead};
use crate::progress::StderrProgress;
use crate::remote::{RemoteStore, TransferOptions};
use crate::tag::validate_tag;

/// Where the store and the cache live.
#[derive(Debug, Clone, clap::Args)]
pub struct StoreArgs {
    /// Snapshot store: a directory, file:///dir, or s3://bucket[/prefix]
    /// (S3 settings from AWS_* variables). Default: $TINE_DATA_DIR/store.
    #[arg(long, env = "TINE_STORE")]
    pub store: Option<String>,
    /// Local cache of verified layers and assembled images (not the kernel/image cache,
    /// `TINE_CACHE_DIR`). Default: $TINE_DATA_DIR/cache.
    #[arg(long = "layer-cache", env = "TINE_LAYER_CACHE")]
    pub cache_dir: Option<PathBuf>,
    /// Object transfers in flight at once.
    #[arg(long, default_value_t = 8)]
    pub concurrency: usize,
}

/// `$TINE_DATA_DIR`, else `$XDG_DATA_HOME/tine`, else `~/.local/share/tine`.
pub fn data_dir() -> anyhow::Result<PathBuf> {
    let var = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    if let Some(d) = var("TINE_DATA_DIR") {
        return Ok(d);
    }
    if let Some(d) = var("XDG_DATA_HOME") {
        return Ok(d.join("tine"));
    }
    let home = var("HOME").context("cannot find a data directory: set TINE_DATA_DIR or HOME")?;
    Ok(home.join(".local/share/tine"))
}

impl StoreArgs {
    pub fn cache(&self) -> anyhow::Result<LocalCache> {
        let dir = match &self.cache_dir {
            Some(d) => d.clone(),
            None => data_dir()?.join("cache"),
        };
        LocalCache::open(&dir).with_context(|| format!("opening cache {}", dir.display()))
    }

    pub fn remote(&self) -> anyhow::Result<RemoteStore> {
        let url = match &self.store {
            Some(s) => s.clone(),
            None => data_dir()?.join("store").display().to_string(),
        };
        let remote = RemoteStore::open_url(&url).with_context(|| format!("opening store {url}"))?;
        let opts = TransferOptions {
            concurrency: self.concurrency.max(1),
            ..TransferOptions::default()
        };
        Ok(remote.with_options(opts))
    }
}

#[derive(Debug, Clone, clap::Subcommand)]
pub enum StoreCommand {
    /// Upload a tagged snapshot chain to the store and tag it there.
    Push(PushArgs),
    /// Download a chain (by tag or digest) into the cache and assemble it.
    Pull(PullArgs),
    /// Export a chain as one pack file, optionally signed.
    Pack(PackArgs),
    /// Import a pack file into the cache, optionally verifying its signature.
    Unpack(UnpackArgs),
    /// List cached snapshots with logical and stored sizes per layer.
    Images(ImagesArgs),
    /// Delete objects no layer references (store and cache).
    Gc(GcArgs),
    /// Generate an ed25519 key pair for signing packs (FILE and FILE.pub).
    Keygen(KeygenArgs),
    /// Create a layer in the cache from a flat memory file (for tests and tooling).
    LayerCreate(LayerCreateArgs),
}

#[derive(Debug, Clone, clap::Args)]
pub struct PushArgs {
    /// Local tag (or digest) to push.
    pub tag: String,
    #[command(flatten)]
    pub store: StoreArgs,
}

#[derive(Debug, Clone, clap::Args)]
pub struct PullArgs {
    /// Tag or digest (blake3:<hex>) in the store.
    pub target: String,
    /// Only download; do not assemble the flat image.
    #[arg(long)]
    pub no_assemble: bool,
    #[command(flatten)]
    pub store: StoreArgs,
}

#[derive(Debug, Clone, clap::Args)]
pub struct PackArgs {
    /// Tag (or digest) to export; pulled from the store first if not cached.
    pub tag: String,
    #[arg(short = 'o', long)]
    pub output: PathBuf,
    /// Secret key file from `tine keygen`.
    #[arg(long)]
    pub sign: Option<PathBuf>,
    #[command(flatten)]
    pub store: StoreArgs,
}

#[derive(Debug, Clone, clap::Args)]
pub struct UnpackArgs {
    pub file: PathBuf,
    /// Public key file (FILE.pub from `tine keygen`): refuse unless signed by it.
    #[arg(long)]
    pub verify: Option<PathBuf>,
    /// Let an unverified pack move tags this cache already has to other snapshots.
    #[arg(long)]
    pub replace_tags: bool,
    #[command(flatten)]
    pub store: StoreArgs,
}

#[derive(Debug, Clone, clap::Args)]
pub struct ImagesArgs {
    /// Also list the tags in the store.
    #[arg(long)]
    pub remote: bool,
    #[command(flatten)]
    pub store: StoreArgs,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum GcTarget {
    Store,
    Cache,
    All,
}

#[derive(Debug, Clone, clap::Args)]
pub struct GcArgs {
    #[arg(long, value_enum, default_value_t = GcTarget::All)]
    pub target: GcTarget,
    /// Keep unreferenced objects younger than this many seconds.
    #[arg(long, default_value_t = 3600)]
    pub min_age_secs: u64,
    /// Also delete layers that no tag reaches.
    #[arg(long)]
    pub prune_untagged: bool,
    #[arg(long)]
    pub dry_run: bool,
    #[command(flatten)]
    pub store: StoreArgs,
}

#[derive(Debug, Clone, clap::Args)]
pub struct KeygenArgs {
    /// Secret key file to create (the public key goes to FILE.pub).
    pub output: PathBuf,
}

#[derive(Debug, Clone, clap::Args)]
pub struct LayerCreateArgs {
    /// Flat guest memory file.
    #[arg(long)]
    pub memory: PathBuf,
    /// VMM state blob file (empty when omitted).
    #[arg(long)]
    pub state: Option<PathBuf>,
    /// Parent layer (tag or digest): makes a diff layer of the dirty pages.
    #[arg(long, requires = "dirty")]
    pub parent: Option<String>,
    /// File of dirty page numbers, one per line (diff layers).
    #[arg(long)]
    pub dirty: Option<PathBuf>,
    #[arg(long, default_value_t = DEFAULT_PAGE_SIZE)]
    pub page_size: u32,
    /// Tag the new layer in the cache.
    #[arg(long)]
    pub tag: Option<String>,
    #[command(flatten)]
    pub store: StoreArgs,
}

/// Runs a store subcommand on a fresh tokio runtime.
pub fn run_blocking(cmd: StoreCommand) -> anyhow::Result<()> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?
        .block_on(run(cmd))
}

pub async fn run(cmd: StoreCommand) -> anyhow::Result<()> {
    let progress = StderrProgress::new(Duration::from_millis(500));
    match cmd {
        StoreCommand::Push(a) => {
            let cache = a.store.cache()?;
            let head = cache.resolve(&a.tag)?;
            let remote = a.store.remote()?;
            let tag = Digest::parse(&a.tag).is_err().then_some(a.tag.as_str());
            let s = remote
                .push(&cache, &head, tag, &progress)
                .await
                .with_context(|| format!("pushing {}", a.tag))?;
            println!(
                "pushed {} ({head}) to {}: {} layers, {} objects ({} already there), {}",
                a.tag,
                remote.description(),
                s.layers_transferred,
                s.objects_transferred,
                s.objects_skipped,
                human(s.bytes_transferred)
            );
        }
        StoreCommand::Pull(a) => {
            let cache = a.store.cache()?;
            let remote = a.store.remote()?;
            let (head, s) = remote
                .pull(&cache, &a.target, &progress)
                .await
                .with_context(|| format!("pulling {}", a.target))?;
            println!(
                "pulled {} ({head}): {} layers, {} objects, {}",
                a.target,
                s.layers_transferred,
                s.objects_transferred,
                human(s.bytes_transferred)
            );
            if !a.no_assemble {
                let c = cache.clone();
                let path = tokio::task::spawn_blocking(move || assemble(&c, &head)).await??;
                println!("image {}", path.display());
            }
        }
        StoreCommand::Pack(a) => {
            let cache = a.store.cache()?;
            let head = match cache.resolve(&a.tag) {
                Ok(h) if cache.has_layer(&h) => h,
                _ => {
                    let remote = a.store.remote()?;
                    remote
                        .pull(&cache, &a.tag, &progress)
                        .await
                        .with_context(|| format!("fetching {}", a.tag))?
                        .0
                }
            };
            let key = a.sign.as_deref().map(load_signing_key).transpose()?;
            let tag = Digest::parse(&a.tag).is_err().then(|| a.tag.clone());
            let heads = [PackHead { tag, head }];
            let out = a.output.clone();
            let s = tokio::task::spawn_blocking(move || {
                export_pack_to_file(&cache, &heads, key.as_ref(), &out)
            })
            .await?
            .with_context(|| format!("writing pack {}", a.output.display()))?;
            println!(
                "packed {} into {}: {} layers, {} objects, {} ({} of memory){}",
                a.tag,
                a.output.display(),
                s.layers,
                s.objects,
                human(s.content_bytes),
                human(s.logical_bytes),
                s.signer
                    .map(|k| format!(", signed by {k}"))
                    .unwrap_or_default()
            );
        }
        StoreCommand::Unpack(a) => {
            let cache = a.store.cache()?;
            let verify_key = a.verify.as_deref().map(load_verifying_key).transpose()?;
            let opts = ImportOptions {
                verify_key,
                replace_tags: a.replace_tags,
            };
            let file = a.file.clone();
            let s = tokio::task::spawn_blocking(move || import_pack_file(&cache, &file, &opts))
                .await?
                .with_context(|| format!("importing pack {}", a.file.display()))?;
            let tags: Vec<String> = s.tags.iter().map(|(t, d)| format!("{t} -> {d}")).collect();
            println!(
                "imported {}: {} layers, {} objects, {}; tags: {}; signature: {}",
                a.file.display(),
                s.layers,
                s.objects,
                human(s.content_bytes),
                if tags.is_empty() {
                    "none".into()
                } else {
                    tags.join(", ")
                },
                match (&s.signer, a.verify.is_some()) {
                    (Some(k), true) => format!("verified ({k})"),
                    (Some(k), false) =>
                        format!("present but not checked (signer {k}; pass --verify)"),
                    (None, _) => "none".into(),
                }
            );
        }
        StoreCommand::Images(a) => {
            let cache = a.store.cache()?;
            print!("{}", images_table(&cache)?);
            if a.remote {
                let remote = a.store.remote()?;
                println!("\nstore {}:", remote.description());
                for (t, d) in remote.list_tags().await? {
                    println!("  {t:<32} {d}");
                }
            }
        }
        StoreCommand::Gc(a) => {
            let opts = GcOptions {
                min_age: Duration::from_secs(a.min_age_secs),
                prune_untagged: a.prune_untagged,
                dry_run: a.dry_run,
            };
            let verb = if a.dry_run { "would delete" } else { "deleted" };
            if matches!(a.target, GcTarget::Store | GcTarget::All) {
                let remote = a.store.remote()?;
                let r = collect_garbage(&remote, &opts)
                    .await
                    .context("collecting garbage in the store")?;
                println!(
                    "store {}: {} live layers, {} live objects; {verb} {} layers, {} objects ({}); kept {} young objects",
                    remote.description(),
                    r.layers_live,
                    r.objects_live,
                    r.layers_deleted,
                    r.objects_deleted,
                    human(r.bytes_deleted),
                    r.objects_too_young
                );
            }
            if matches!(a.target, GcTarget::Cache | GcTarget::All) {
                let cache = a.store.cache()?;
                let (r, images) = collect_cache_garbage(&cache, &opts)
                    .await
                    .context("collecting garbage in the cache")?;
                println!(
                    "cache {}: {verb} {} layers, {} objects ({}), {images} images; kept {} young objects",
                    cache.root().display(),
                    r.layers_deleted,
                    r.objects_deleted,
                    human(r.bytes_deleted),
                    r.objects_too_young
                );
            }
        }
        StoreCommand::Keygen(a) => {
            let key = generate_signing_key()?;
            let pub_path = write_keypair(&a.output, &key)?;
            println!(
                "secret key {} (keep private), public key {}",
                a.output.display(),
                pub_path.display()
            );
        }
        StoreCommand::LayerCreate(a) => {
            let cache = a.store.cache()?;
            let layer = tokio::task::spawn_blocking(move || create_layer(&cache, &a)).await??;
            println!("{}", layer);
        }
    }
    Ok(())
}

fn create_layer(cache: &LocalCache, a: &LayerCreateArgs) -> anyhow::Result<Digest> {
    if let Some(t) = &a.tag {
        validate_tag(t)?;
    }
    let state = match &a.state {
        Some(p) => std::fs::read(p).with_context(|| format!("reading state {}", p.display()))?,
        None => Vec::new(),
    };
    let input = LayerInput {
        memory: &a.memory,
        page_size: a.page_size,
        state: &state,
    };
    let opts = BuildOptions::default();
    let layer = match (&a.parent, &a.dirty) {
        (None, _) => build_base(cache, &input, &opts)?,
        (Some(parent), Some(dirty)) => {
            let parent = cache.resolve(parent)?;
            let pages = read_page_list(dirty)?;
            build_diff(cache, &parent, &input, DirtyPages::List(&pages), &opts)?
        }
        (Some(_), None) => bail!("--parent needs --dirty"),
    };
    if let Some(t) = &a.tag {
        cache.set_tag(t, &layer.digest)?;
    }
    Ok(layer.digest)
}

fn read_page_list(path: &Path) -> anyhow::Result<Vec<u64>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    text.split_whitespace()
        .map(|w| {
            w.parse::<u64>()
                .with_context(|| format!("{}: {w:?} is not a page number", path.display()))
        })
        .collect()
}

/// The `tine images` table: one line per tag, then one per layer of its chain.
pub fn images_table(cache: &LocalCache) -> anyhow::Result<String> {
    use std::fmt::Write;
    let mut out = String::new();
    writeln!(
        out,
        "{:<24} {:<20} {:>5} {:>10} {:>10} {:>7}",
        "TAG", "HEAD", "DEPTH", "LOGICAL", "STORED", "RATIO"
    )?;
    for (tag, head) in cache.list_tags()? {
        let chain = match cache.chain(&head) {
            Ok(c) => c,
            Err(e) => {
                writeln!(out, "{tag:<24} {:<20} (unavailable: {e})", short(&head))?;
                continue;
            }
        };
        let logical = chain[0].manifest.memory_size;
        let stored: u64 = chain.iter().map(|l| l.stored_bytes()).sum();
        writeln!(
            out,
            "{tag:<24} {:<20} {:>5} {:>10} {:>10} {:>6.1}x",
            short(&head),
            chain.len() - 1,
            human(logical),
            human(stored),
            logical as f64 / stored.max(1) as f64
        )?;
        for l in &chain {
            let t = l.totals();
            writeln!(
                out,
                "  └ {:<20} depth {:<2} {:>8} pages stored, {:>7} zeroed, {:>10} raw, {:>10} stored",
                short(&l.digest),
                l.manifest.depth,
                t.stored_pages,
                t.zeroed_pages,
                human(t.raw_bytes),
                human(l.stored_bytes())
            )?;
        }
    }
    Ok(out)
}

fn short(d: &Digest) -> String {
    format!("blake3:{}", &d.hex()[..12])
}

pub fn human(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}
