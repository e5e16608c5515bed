//! Making a warm parent snapshot: boot an image, wait until its agent is ready (warm-up
//! done), run optional warm-up code, pause and write the snapshot.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use tine_proto::names::Tag;
use tine_vmm::snapshot::file::SnapshotHeader;
use tine_vmm::{GuestRam, LinuxBoot, Vm, DEFAULT_CMDLINE};

use crate::console::open_console;
use crate::error::{HostError, Result};
use crate::ready::agent;

/// What to snapshot.
#[derive(Clone, Debug)]
pub struct ParentSpec {
    /// Image name, id or directory (`tine image build`).
    pub image: String,
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

/// The parent's network interface: the tap behind it and the kernel command line words that
/// configure the guest's side.
pub(crate) struct ParentNet {
    pub tap: tine_vmm::devices::virtio::net::Tap,
    pub cmdline: String,
}

/// Boot `spec.image` in `work` (a fresh directory) and snapshot it into `dir`.
pub(crate) fn boot_and_snapshot(
    spec: &ParentSpec,
    image_cache: &Path,
    work: &Path,
    dir: &Path,
    ready_timeout: Duration,
    net: Option<ParentNet>,
) -> Result<MadeSnapshot> {
    let image =
        tine_image::load_image_in(image_cache, &spec.image).map_err(|e| HostError::Image {
            image: spec.image.clone(),
            reason: format!("{e:#}"),
        })?;
    let sock = work.join("vsock.sock");
    let console = work.join("console.log");
    let t0 = Instant::now();
    let mem = spec.mem_mib.unwrap_or(image.memory_mib as u64);
    let mut vm = Vm::create(
        spec.vcpus,
        GuestRam::new_memfd(mem)?,
        open_console(Some(&console)).map_err(|e| HostError::Io {
            context: format!("creating {}", console.display()),
            source: std::io::Error::other(e),
        })?,
    )?;
    vm.add_vsock(3, &sock)?;
    let mut cmdline = DEFAULT_CMDLINE.to_string();
    if let Some(net) = net {
        // After vsock: the device order is part of every snapshot of this parent.
        vm.add_net(crate::network::GUEST_MAC, Some(net.tap))?;
        cmdline.push(' ');
        cmdline.push_str(&net.cmdline);
    }
    if !image.cmdline_append.is_empty() {
        cmdline.push(' ');
        cmdline.push_str(&image.cmdline_append);
    }
    vm.load_linux(&LinuxBoot {
        kernel: image.kernel_path(),
        initrd: Some(image.initrd_path()),
        cmdline,
    })?;
    let running = vm.start()?;
    let client = agent(&sock);
    let result = (|| -> Result<MadeSnapshot> {
        client
            .wait_ready(ready_timeout)
            .map_err(|e| HostError::ParentNotReady {
                console: console.clone(),
                reason: e.to_string(),
            })?;
        let ready_after = t0.elapsed();
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
        // Clean caches out of the image (a kernel with init_on_free=1 zeroes what it frees):
        // smaller to store, to fetch and to keep resident. An older agent lacks the call.
        match client.prepare_snapshot() {
            Ok((before, after)) => tracing::info!(
                free_mib_before = before / 1024,
                free_mib_after = after / 1024,
                "guest caches dropped before the snapshot"
            ),
            Err(e) => tracing::warn!("not preparing the guest for its snapshot: {e}"),
        }
        let t1 = Instant::now();
        let header = running.snapshot(dir)?;
        Ok(MadeSnapshot {
            dir: dir.to_path_buf(),
            header,
            ready_after,
            written_in: t1.elapsed(),
            layer: None,
        })
    })();
    running.stop();
    result
}
