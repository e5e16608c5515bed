//! The edge where `tine` turns its environment into configuration values: the data
//! directory, the image cache, and the [`HostConfig`] every local VM command uses. Nothing
//! below this module reads these variables.

use std::path::PathBuf;

use anyhow::Result;
use tine_host::{Host, HostConfig, Limits, Owner, Readiness};
use tine_proto::names::ExecutorId;

/// `--data-dir`, else `$TINE_DATA_DIR`, else `$XDG_DATA_HOME/tine`, else `~/.local/share/tine`.
pub fn data_dir(flag: Option<PathBuf>) -> Result<PathBuf> {
    match flag {
        Some(d) => Ok(d),
        None => tine_snapshot_store::cli::data_dir(),
    }
}

/// Kernels and built images: `$TINE_CACHE_DIR`, else `~/.cache/tine`.
pub fn image_cache() -> PathBuf {
    tine_image::default_cache_dir()
}

/// The host configuration for VMs this `tine` process starts itself.
pub fn host_config(owner: Owner, limits: Limits, readiness: Readiness) -> Result<HostConfig> {
    Ok(HostConfig {
        data_dir: data_dir(None)?,
        image_cache: image_cache(),
        worker_exe: std::env::current_exe()?,
        owner,
        readiness,
        limits,
        store: None,
    })
}

/// An executor's store settings; its layer cache lives in its data directory.
pub struct StoreChoice {
    pub url: String,
    pub fetch: tine_host::FetchMode,
    pub cache_max_bytes: Option<u64>,
    pub gc_grace: std::time::Duration,
}

/// The host configuration of an executor daemon (`tine up`, `tine executor`).
pub fn executor_host(
    id: &ExecutorId,
    data_dir: PathBuf,
    max_vms: u32,
    pool_size: usize,
    store: Option<StoreChoice>,
) -> Result<HostConfig> {
    let store = store.map(|s| tine_host::StoreConfig {
        url: s.url,
        layer_cache: data_dir.join("layers"),
        fetch: s.fetch,
        cache_max_bytes: s.cache_max_bytes,
        gc_grace: s.gc_grace,
    });
    Ok(HostConfig {
        store,
        data_dir,
        image_cache: image_cache(),
        worker_exe: std::env::current_exe()?,
        owner: Owner::executor(id),
        readiness: Readiness::Agent,
        limits: Limits {
            max_vms,
            pool_size,
            ..Limits::default()
        },
    })
}

/// The host as the CLI's own commands (`tine snapshot/fork/ls/kill`, benches) see it.
pub fn cli_host(readiness: Readiness) -> Result<Host> {
    Ok(Host::open(host_config(
        Owner::Cli,
        Limits::one_shot(),
        readiness,
    )?)?)
}
