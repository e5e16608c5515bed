//! Making a warm parent snapshot: boot an image, wait until its agent is ready (warm-up
//! done), run optional warm-up code, pause and write the snapshot.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use tine_vmm::snapshot::file::SnapshotHeader;
use tine_vmm::{GuestRam, LinuxBoot, Vm, DEFAULT_CMDLINE};

use crate::console::open_console;
use crate::ready::agent;
use crate::vms;

/// What to snapshot.
#[derive(Clone, Debug)]
pub struct ParentSpec {
    /// Image name, id or directory (`tine image build`).
    pub image: String,
    pub tag: String,
    pub vcpus: u8,
    /// Guest memory; None = the image's recommendation.
    pub mem_mib: Option<u64>,
    /// Python run in the warm interpreter before the snapshot.
    pub evals: Vec<String>,
    pub ready_timeout: Duration,
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
}

pub fn create_snapshot(spec: &ParentSpec) -> Result<MadeSnapshot> {
    let dir = vms::snapshot_dir(&spec.tag)?;
    if dir.exists() {
        if !spec.replace {
            bail!(
                "snapshot {} already exists at {} (replace it explicitly)",
                spec.tag,
                dir.display()
            );
        }
        std::fs::remove_dir_all(&dir).with_context(|| format!("removing {}", dir.display()))?;
    }
    let image = tine_image::load_image(&spec.image).context("loading the image")?;
    let work = vms::vms_dir()?.join(vms::new_id(&format!("parent-{}", spec.tag)));
    std::fs::create_dir_all(&work)?;
    let sock = work.join("vsock.sock");
    let t0 = Instant::now();
    let mem = spec.mem_mib.unwrap_or(image.memory_mib as u64);
    let mut vm = Vm::create(
        spec.vcpus,
        GuestRam::new_memfd(mem)?,
        open_console(Some(&work.join("console.log")))?,
    )?;
    vm.add_vsock(3, &sock)?;
    let cmdline = if image.cmdline_append.is_empty() {
        DEFAULT_CMDLINE.to_string()
    } else {
        format!("{DEFAULT_CMDLINE} {}", image.cmdline_append)
    };
    vm.load_linux(&LinuxBoot {
        kernel: image.kernel_path(),
        initrd: Some(image.initrd_path()),
        cmdline,
    })?;
    let running = vm.start()?;
    let client = agent(&sock);
    let result = (|| -> Result<MadeSnapshot> {
        client.wait_ready(spec.ready_timeout).with_context(|| {
            format!(
                "parent never became ready (console: {})",
                work.join("console.log").display()
            )
        })?;
        let ready_after = t0.elapsed();
        for code in &spec.evals {
            let r = client.eval(code)?;
            if let Some(err) = r.error {
                bail!("warm-up code {code:?} raised:\n{err}");
            }
        }
        let t1 = Instant::now();
        let header = running.snapshot(&dir)?;
        Ok(MadeSnapshot {
            dir: dir.clone(),
            header,
            ready_after,
            written_in: t1.elapsed(),
        })
    })();
    running.stop();
    let _ = std::fs::remove_dir_all(&work);
    result
}

/// Tags of the snapshots held under the data directory.
pub fn local_tags() -> Result<Vec<String>> {
    let dir = vms::data_dir()?.join("snapshots");
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return Ok(Vec::new());
    };
    let mut tags: Vec<String> = entries
        .flatten()
        .filter(|e| e.path().join("snapshot.json").is_file())
        .filter_map(|e| e.file_name().into_string().ok())
        .collect();
    tags.sort();
    Ok(tags)
}
