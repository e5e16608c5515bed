//! The L1 initramfs: busybox, the KVM/virtio/9p modules and an /init that mounts the host root
//! over 9p and runs the job in a chroot. The per-run job (command, environment, shares) is not
//! part of it, so one cached image serves every run.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use sha2::{Digest, Sha256};
use tine_image::initramfs::{find_busybox, shell_quote, Initramfs, KernelModules};
use tine_image::modules::ModuleIndex;
use tine_image::Kernel;

/// Modules /init loads, in this order (dependencies first), from the generic Debian kernel.
pub const L1_MODULES: &[&str] = &[
    "irqbypass",
    "kvm",
    "ccp",
    "kvm-amd",
    "virtio_ring",
    "virtio",
    "virtio_pci_modern_dev",
    "virtio_pci_legacy_dev",
    "virtio_pci",
    "netfs",
    // Folded into netfs since Linux 6.4: loaded only where it still exists on its own.
    "fscache",
    "9pnet",
    "9pnet_virtio",
    "9p",
    // Child networks (namespaces, taps, veth pairs, nftables rules with NAT and reject). L1
    // has no /sbin/modprobe, so the kernel cannot load these on demand: each is listed, its
    // dependencies first.
    "tun",
    "veth",
    "crc32c_generic",
    "libcrc32c",
    "nfnetlink",
    "nf_tables",
    "nf_defrag_ipv4",
    "nf_defrag_ipv6",
    "nf_conntrack",
    "nf_nat",
    "nft_ct",
    "nft_chain_nat",
    "nft_nat",
    "nft_masq",
    "nf_reject_ipv4",
    "nf_reject_ipv6",
    "nft_reject",
    "nft_reject_ipv4",
    "nft_reject_inet",
];

/// Names in [`L1_MODULES`] that newer kernels no longer ship, having merged them elsewhere.
const MERGED_IN_NEWER_KERNELS: &[&str] = &["fscache"];

/// The L1 modules this kernel has: [`L1_MODULES`] without the merged ones it lacks.
fn l1_modules(index: &ModuleIndex) -> Vec<&'static str> {
    L1_MODULES
        .iter()
        .copied()
        .filter(|m| !MERGED_IN_NEWER_KERNELS.contains(m) || index.path_of(m).is_some())
        .collect()
}

/// The 9p mount tag of the read-only host root export.
pub const HOST_TAG: &str = "host";

/// Host paths /init hides under fresh tmpfs mounts: host files there are not visible in L1
/// unless a share exports them.
pub const MASKED: [&str; 3] = ["/tmp", "/run", "/dev/shm"];

/// Bump when the image layout or /init changes in a way the inputs below do not capture.
const FORMAT: &str = "tine-lab-l1-v1";

/// The /init script. `modules` are archive paths in load order.
fn init_script(modules: &[String]) -> String {
    let insmods: String = modules
        .iter()
        .map(|m| format!("insmod {0} || fail \"insmod {0}\"\n", shell_quote(m)))
        .collect();
    format!(
        r#"#!/bin/sh
# Tine lab L1 init: real kvm_amd on an emulated SVM CPU; run one job from the host root.
export PATH=/bin:/sbin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
# Raw LF on the console; the host side turns any CRLF back into LF anyway.
stty -onlcr </dev/console 2>/dev/null
m="TINE-LAB-$(cat /tine/nonce)"
read up rest </proc/uptime
echo "$m init $up"
fail() {{
  echo "$m setup-failed $*"
  poweroff -f
  sleep 60
}}
{insmods}# Loopback for jobs that serve and call on 127.0.0.1 (e.g. `tine up`).
ip link set lo up 2>/dev/null || ifconfig lo 127.0.0.1 up 2>/dev/null
mkdir -p /host
# cache=loose: the host root does not change under a run, so L1 keeps what it read (file pages,
# attributes, lookups). Without it every process faults its binary in over 9p again and every
# open and stat is a round trip to the host (a Python start, e.g. moto_server's, takes minutes).
mount -t 9p -o trans=virtio,version=9p2000.L,ro,cache=loose,msize=262144 {HOST_TAG} /host || fail "mount 9p {HOST_TAG}"
mount -t proc proc /host/proc || fail "mount /host/proc"
mount -t sysfs sysfs /host/sys || fail "mount /host/sys"
mount -t devtmpfs devtmpfs /host/dev || fail "mount /host/dev"
mount -t tmpfs -o mode=1777 tmpfs /host/tmp || fail "mount /host/tmp"
mount -t tmpfs -o mode=755 tmpfs /host/run || fail "mount /host/run"
mkdir -p /host/dev/pts /host/dev/shm
mount -t devpts devpts /host/dev/pts
mount -t tmpfs -o mode=1777 tmpfs /host/dev/shm
# cgroup v2 with every controller (nothing mounts v1 here): children get their own cgroups.
mount -t cgroup2 cgroup2 /host/sys/fs/cgroup || echo "$m no cgroup2"
# As deploy/systemd/tine-executor-tmpfiles.conf sets up an executor host: huge pages for the
# guest RAM that asks for them (a job may write `never` to measure without).
echo advise > /sys/kernel/mm/transparent_hugepage/shmem_enabled 2>/dev/null || echo "$m no shmem huge pages"
. /tine/setup.sh
mkdir -p /host/run/tine
cp /tine/job.sh /host/run/tine/job.sh || fail "copy job"
echo "$m start"
chroot /host /usr/bin/env -i /bin/sh /run/tine/job.sh </dev/null
status=$?
echo "$m exit $status"
sync
poweroff -f
sleep 60
"#
    )
}

/// Builds (or reuses from `cache`) the L1 initramfs for `kernel`; returns its path.
pub fn l1_initramfs(kernel: &Kernel, cache: &Path) -> Result<PathBuf> {
    let index = ModuleIndex::load(&kernel.modules_dir)?;
    let names = l1_modules(&index);
    let modules = KernelModules::exact(index, &names)
        .with_context(|| format!("the L1 modules in {}", kernel.modules_dir.display()))?;
    let init = init_script(&modules.archive_paths());
    let busybox = find_busybox()?;
    let busybox_bytes =
        std::fs::read(&busybox).with_context(|| format!("reading {}", busybox.display()))?;

    let mut key = Sha256::new();
    for part in [
        FORMAT.as_bytes(),
        kernel.package.as_bytes(),
        kernel.version.as_bytes(),
        modules.describe().as_bytes(),
        init.as_bytes(),
        &Sha256::digest(&busybox_bytes),
    ] {
        key.update((part.len() as u64).to_le_bytes());
        key.update(part);
    }
    let key = hex::encode(&key.finalize()[..12]);
    let path = cache.join("lab").join(format!("l1-{key}.cpio.gz"));
    if path.is_file() {
        return Ok(path);
    }
    tracing::info!(path = %path.display(), "building the L1 initramfs");
    Initramfs::new(init)
        .busybox(busybox)
        .modules(modules)
        .write_gz(&path)?;
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn init_loads_modules_in_order_then_chroots() {
        let mods: Vec<String> = L1_MODULES.iter().map(|m| format!("/lib/{m}.ko")).collect();
        let s = init_script(&mods);
        let pos = |needle: &str| s.find(needle).unwrap_or_else(|| panic!("{needle}"));
        assert!(pos("insmod /lib/irqbypass.ko") < pos("insmod /lib/kvm.ko"));
        assert!(pos("insmod /lib/kvm-amd.ko") < pos("insmod /lib/9p.ko"));
        assert!(pos("insmod /lib/9p.ko") < pos("mount -t 9p"));
        assert!(pos("mount -t 9p") < pos("chroot /host"));
        assert!(pos("$m start") < pos("chroot /host") && pos("chroot /host") < pos("$m exit"));
        assert!(s.contains(",ro,cache=loose,") && s.contains(" host /host"));
    }

    /// With the lab kernel cached, every L1 module must resolve to a file.
    #[test]
    fn l1_modules_exist_in_the_cached_lab_kernel() {
        let kernels = tine_image::kernel::kernels_dir(&tine_image::default_cache_dir());
        let Ok(Some(kernel)) = tine_image::kernel::newest_cached(tine_image::Flavor::Lab, &kernels)
        else {
            eprintln!("no cached lab kernel; skipped");
            return;
        };
        let index = ModuleIndex::load(&kernel.modules_dir).unwrap();
        let paths = index.paths_of(&l1_modules(&index)).unwrap();
        for p in &paths {
            assert!(kernel.modules_dir.join(p).is_file(), "{p}");
        }
        // Our order must respect modules.dep: each module's deps come before it.
        for (i, p) in paths.iter().enumerate() {
            for dep in index.deps_within(p, &paths) {
                let j = paths.iter().position(|q| q == dep).unwrap();
                assert!(j < i, "{p} needs {dep} first");
            }
        }
    }
}
