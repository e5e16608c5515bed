//! Making a warm parent snapshot: a VMM worker, confined like a child's, boots an image; the
//! host waits until its agent is ready, runs the warm-up code, and has the VMM pause and
//! write the snapshot. The user's warm-up code never runs beside an unconfined VMM.

use crate::process::VmmProcess;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use tine_agent::client::{AnswerWait, ClientError, WAIT_READY_MAX_PERIOD};
use tine_proto::names::Tag;
use tine_vmm::snapshot::file::SnapshotHeader;
use tine_vmm::DEFAULT_CMDLINE;

use crate::confine::lend::{lend_dir, take_back_dir};
use crate::control::{request, Reply, Request};
use crate::error::{HostError, Result};
use crate::ready::{agent, vmm_log, wait_restored};
use crate::worker::BootJob;

/// What to snapshot.
#[derive(Clone, Debug)]
pub struct ParentSpec {
    /// The image (`tine image build`): from the image store only, or, for the local CLI, also
    /// a directory.
    pub image: tine_image::ImageRef,
    pub tag: Tag,
    pub vcpus: u8,
    /// Guest memory; None = the image's recommendation.
    pub mem_mib: Option<u64>,
    /// Python run in the warm interpreter before the snapshot.
    pub evals: Vec<String>,
    /// None: the host's `parent_ready_timeout`.
    pub ready_timeout: Option<Duration>,
    /// Replace an existing snapshot with this tag.
    pub replace: bool,
}

#[derive(Debug)]
pub struct MadeSnapshot {
    pub dir: PathBuf,
    pub header: SnapshotHeader,
    /// Boot to agent ready.
    pub ready_after: Duration,
    /// Pause and write.
    pub written_in: Duration,
    /// Its layer in the cluster's store (None when the host has no store).
    pub layer: Option<crate::layers::LayerInfo>,
}

/// The worker job that boots `spec`'s image: its kernel, initrd and command line (with
/// `net_cmdline`, the words that configure its interface, when it has one).
pub(crate) fn boot_job(
    spec: &ParentSpec,
    image_cache: &Path,
    snapshots: &Path,
    net_cmdline: Option<&str>,
) -> Result<BootJob> {
    let image = tine_image::load_image(image_cache, &spec.image).map_err(|e| HostError::Image {
        image: spec.image.to_string(),
        reason: format!("{e:#}"),
    })?;
    // Absolute and free of links: a confined VMM sees each at exactly this path.
    let resolved = |p: PathBuf| {
        std::fs::canonicalize(&p).map_err(|e| HostError::Image {
            image: spec.image.to_string(),
            reason: format!("{}: {e}", p.display()),
        })
    };
    let mut cmdline = DEFAULT_CMDLINE.to_string();
    for words in [net_cmdline.unwrap_or(""), image.cmdline_append.as_str()] {
        if !words.is_empty() {
            cmdline.push(' ');
            cmdline.push_str(words);
        }
    }
    Ok(BootJob {
        kernel: resolved(image.kernel_path())?,
        initrd: Some(resolved(image.initrd_path())?),
        cmdline,
        vcpus: spec.vcpus,
        mem_mib: spec.mem_mib.unwrap_or(image.memory_mib as u64),
        snapshots: resolved(snapshots.to_path_buf())?,
    })
}

/// How long a parent's VMM may take to write its snapshot (its whole memory, once).
const SNAPSHOT_TIMEOUT: Duration = Duration::from_secs(600);

/// Drive a parent that worker `vmm` boots in `work`: wait until its agent is ready, run the
/// warm-up code, then have the VMM write its snapshot into `staging` (lent to the VMM's user
/// for that) and end it. `started` is when the boot was asked for.
pub(crate) fn warm_and_snapshot(
    spec: &ParentSpec,
    work: &Path,
    staging: &Path,
    ready_timeout: Duration,
    vmm: &mut VmmProcess,
    report: &std::fs::File,
    started: Instant,
) -> Result<MadeSnapshot> {
    let console = work.join("console.log");
    let exited = |vmm: &mut VmmProcess| -> Option<HostError> {
        matches!(vmm.try_wait(), Ok(Some(_)) | Err(_))
            .then(|| HostError::VmmExited { log: vmm_log(work) })
    };
    wait_restored(report, ready_timeout)?
        .ok_or_else(|| HostError::ParentBootFailed { log: vmm_log(work) })?;
    let client = agent(&work.join("vsock.sock"));
    let mut wait = AnswerWait::default();
    loop {
        let left = ready_timeout.saturating_sub(started.elapsed());
        // In slices, so a VMM that died is reported as such rather than as a timeout; each at
        // least as long as the wait a slow guest has earned, which carries across them.
        match client.wait_ready_paced(
            wait.slice(left),
            Duration::from_millis(5),
            WAIT_READY_MAX_PERIOD,
            &mut wait,
        ) {
            Ok(_) => break,
            // A warm-up that failed stays failed: no point polling until the deadline.
            Err(e @ ClientError::WarmupFailed { .. }) => {
                return Err(HostError::ParentNotReady {
                    console,
                    reason: e.to_string(),
                })
            }
            Err(e) => {
                if let Some(dead) = exited(vmm) {
                    return Err(dead);
                }
                if started.elapsed() >= ready_timeout {
                    return Err(HostError::ParentNotReady {
                        console,
                        reason: e.to_string(),
                    });
                }
            }
        }
    }
    let ready_after = started.elapsed();
    for code in &spec.evals {
        let r = client.eval(code).map_err(|e| HostError::WarmupCall {
            code: code.clone(),
            reason: e.to_string(),
        })?;
        if let Some(error) = r.error {
            return Err(HostError::WarmupFailed {
                code: code.clone(),
                error,
            });
        }
    }
    // Ready the guest for its snapshot: the warm interpreter freezes its objects (clones'
    // garbage collections then leave the shared heap alone) and the kernel drops clean caches
    // (children start with that memory free). An older agent lacks the call; any other
    // failure means the parent is not what a snapshot should hold.
    match client.prepare_snapshot() {
        Ok(p) => tracing::info!(
            free_mib_before = p.free_kib_before / 1024,
            free_mib_after = p.free_kib_after / 1024,
            python_objects_frozen = p.python_objects_frozen,
            agent_done = p.closed,
            "guest prepared for the snapshot"
        ),
        Err(e) if e.is_unknown_request() => {
            tracing::warn!("not preparing the guest for its snapshot (its agent is older): {e}")
        }
        Err(e) => {
            return Err(HostError::ParentSnapshot {
                reason: format!("preparing the guest: {e}"),
            })
        }
    }
    let t1 = Instant::now();
    let failed = |reason: String| HostError::ParentSnapshot { reason };
    // Made here and lent to the VMM's user: a confined VMM can create nothing else.
    lend_dir(staging, vmm.id())
        .map_err(|e| failed(format!("preparing {} for its VMM: {e}", staging.display())))?;
    let reply = request(
        work,
        &Request::Snapshot {
            dir: staging.to_path_buf(),
        },
        SNAPSHOT_TIMEOUT,
    )
    .map_err(|e| match exited(vmm) {
        Some(dead) => dead,
        None => failed(e.to_string()),
    })?;
    match reply {
        Reply::Snapshotted { .. } => {}
        Reply::Failed { reason } => return Err(failed(reason)),
        other => return Err(failed(format!("unexpected answer {other:?}"))),
    }
    // Ended before its files are taken back: nothing of it can write to them afterwards.
    let _ = vmm.kill();
    let _ = vmm.wait();
    take_back_dir(staging)
        .map_err(|e| failed(format!("its VMM's snapshot in {}: {e}", staging.display())))?;
    let header = tine_vmm::snapshot::file::load_header(staging).map_err(|source| {
        HostError::BadSnapshot {
            tag: spec.tag.clone(),
            source,
        }
    })?;
    Ok(MadeSnapshot {
        dir: staging.to_path_buf(),
        header,
        ready_after,
        written_in: t1.elapsed(),
        layer: None,
    })
}
