//! The file system a confined VMM sees: its own mount namespace whose root is a small
//! read-only tmpfs holding only
//! - `/vm`: its own directory (console.log, vmm.log, its sockets),
//! - `/snapshots`: the directory its snapshot sits in (its diff chain are siblings there;
//!   a branch is written into a directory the host makes there and lends it),
//! - `/dev/kvm` and `/proc`, a procfs of its own showing only its own process (its pagemap
//!   and maps, read for branches and rebases).
//!
//! Entered while the worker is still root and one thread, before the restore opens anything,
//! so every thread it makes lives in the view. Paths the host sends (the snapshot, a branch's
//! or a rebase's directory) are the host's; [`translate`] maps them into the view.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use super::{sys, ConfineError};

/// Where the VMM sees its own directory.
pub const VM_DIR: &str = "/vm";
/// Where it sees the directory its snapshot sits in.
pub const SNAPSHOTS_DIR: &str = "/snapshots";

/// The host's path of what the view shows at [`SNAPSHOTS_DIR`], once entered.
static SNAPSHOTS: OnceLock<PathBuf> = OnceLock::new();

fn cstr(p: &Path) -> CString {
    CString::new(p.as_os_str().as_bytes()).expect("paths hold no NUL")
}

fn mount(
    what: &'static str,
    src: Option<&Path>,
    target: &Path,
    fstype: Option<&str>,
    flags: libc::c_ulong,
    data: Option<&str>,
) -> Result<(), ConfineError> {
    let src = src.map(cstr);
    let target = cstr(target);
    let fstype = fstype.map(|s| CString::new(s).unwrap());
    let data = data.map(|s| CString::new(s).unwrap());
    let ptr = |c: &Option<CString>| c.as_ref().map_or(std::ptr::null(), |c| c.as_ptr());
    // SAFETY: every pointer is a NUL-terminated string that outlives the call, or null.
    sys(what, unsafe {
        libc::mount(
            ptr(&src),
            target.as_ptr(),
            ptr(&fstype),
            flags,
            ptr(&data) as *const libc::c_void,
        )
    })
}

fn io(what: &'static str) -> impl FnOnce(std::io::Error) -> ConfineError {
    move |source| ConfineError::Sys { what, source }
}

/// Enter the view of a VMM whose directory is `vm_dir` and whose snapshot sits in
/// `snapshots`.
/// `linked` are files outside `snapshots` that its snapshot links to (a fetched snapshot's
/// memory image, assembled in the layer cache): each is shown read-only at its own path.
pub fn enter(vm_dir: &Path, snapshots: &Path, linked: &[PathBuf]) -> Result<(), ConfineError> {
    // SAFETY: unshare on the calling thread, with no memory effects.
    sys("entering a mount namespace of its own", unsafe {
        libc::unshare(libc::CLONE_NEWNS)
    })?;
    // Nothing mounted here propagates back to the host.
    mount(
        "making the mounts private",
        None,
        Path::new("/"),
        None,
        libc::MS_REC | libc::MS_PRIVATE,
        None,
    )?;
    let root = vm_dir.join(".root");
    match std::fs::create_dir(&root) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(io("making the view's root")(e)),
    }
    let hardened = libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC;
    mount(
        "mounting the view's root",
        Some(Path::new("tmpfs")),
        &root,
        Some("tmpfs"),
        hardened,
        Some("size=64k,nr_inodes=256,mode=0755"),
    )?;
    for d in ["vm", "snapshots", "dev", "proc", "old"] {
        std::fs::create_dir(root.join(d)).map_err(io("making the view's directories"))?;
    }
    std::fs::File::create(root.join("dev/kvm")).map_err(io("making the view's /dev/kvm"))?;
    let bind = |what, src: &Path, dst: &str, flags: libc::c_ulong| -> Result<(), ConfineError> {
        let dst = root.join(dst);
        mount(what, Some(src), &dst, None, libc::MS_BIND | flags, None)?;
        // Bind mounts take their flags only from a remount.
        if flags & libc::MS_REC == 0 {
            mount(
                what,
                None,
                &dst,
                None,
                libc::MS_REMOUNT | libc::MS_BIND | hardened,
                None,
            )?;
        }
        Ok(())
    };
    bind("showing its directory", vm_dir, "vm", 0)?;
    bind("showing its snapshots", snapshots, "snapshots", 0)?;
    // A procfs of its own: `hidepid=invisible` shows only the processes of the VMM's user
    // (itself alone), `subset=pid` nothing but them (no /proc/sys, no host-wide files). A
    // kernel or container that refuses it (before 5.8, or a masked /proc) gets the host's.
    if let Err(e) = mount(
        "mounting its own /proc",
        Some(Path::new("proc")),
        &root.join("proc"),
        Some("proc"),
        hardened,
        Some("hidepid=invisible,subset=pid"),
    ) {
        eprintln!("{e}: showing it the host's /proc instead");
        bind("showing /proc", Path::new("/proc"), "proc", libc::MS_REC)?;
    }
    mount(
        "showing /dev/kvm",
        Some(Path::new("/dev/kvm")),
        &root.join("dev/kvm"),
        None,
        libc::MS_BIND,
        None,
    )?;
    for file in linked {
        let Ok(rel) = file.strip_prefix("/") else {
            continue;
        };
        let at = root.join(rel);
        if let Some(parent) = at.parent() {
            std::fs::create_dir_all(parent).map_err(io("showing a linked file"))?;
        }
        std::fs::File::create(&at).map_err(io("showing a linked file"))?;
        mount(
            "showing a linked file",
            Some(file),
            &at,
            None,
            libc::MS_BIND,
            None,
        )?;
        mount(
            "showing a linked file",
            None,
            &at,
            None,
            libc::MS_REMOUNT | libc::MS_BIND | libc::MS_RDONLY | hardened,
            None,
        )?;
    }
    std::env::set_current_dir(&root).map_err(io("entering the view"))?;
    let dot = CString::new(".").unwrap();
    let old = CString::new("old").unwrap();
    // SAFETY: pivot_root with two NUL-terminated paths.
    let pivoted = unsafe { libc::syscall(libc::SYS_pivot_root, dot.as_ptr(), old.as_ptr()) };
    if pivoted == 0 {
        let old = CString::new("/old").unwrap();
        // SAFETY: detaching the old root, a NUL-terminated path.
        sys("leaving the host's root", unsafe {
            libc::umount2(old.as_ptr(), libc::MNT_DETACH)
        })?;
        std::fs::remove_dir("/old").map_err(io("leaving the host's root"))?;
    } else {
        // A root that cannot be pivoted (an initramfs, or a chroot inside one): move the view
        // over it and chroot, as switch_root does. The host's tree stays beneath, out of reach
        // of a process that may neither chroot nor mount.
        mount(
            "moving the view to /",
            Some(Path::new(".")),
            Path::new("/"),
            None,
            libc::MS_MOVE,
            None,
        )?;
        // SAFETY: chroot to the current directory, a NUL-terminated path.
        sys("entering the view", unsafe { libc::chroot(dot.as_ptr()) })?;
        let _ = std::fs::remove_dir("/old");
    }
    std::env::set_current_dir("/").map_err(io("entering the view"))?;
    mount(
        "making the view's root read-only",
        None,
        Path::new("/"),
        None,
        libc::MS_REMOUNT | libc::MS_RDONLY | hardened,
        None,
    )?;
    let _ = SNAPSHOTS.set(snapshots.to_path_buf());
    Ok(())
}

/// `host_path` as this VMM sees it: unchanged outside a view; inside one, a path under the
/// snapshots it shows, or an error.
pub fn translate(host_path: &Path) -> Result<PathBuf, ConfineError> {
    let Some(snapshots) = SNAPSHOTS.get() else {
        return Ok(host_path.to_path_buf());
    };
    match host_path.strip_prefix(snapshots) {
        Ok(rel)
            if rel
                .components()
                .all(|c| matches!(c, std::path::Component::Normal(_))) =>
        {
            Ok(Path::new(SNAPSHOTS_DIR).join(rel))
        }
        _ => Err(ConfineError::OutsideView {
            path: host_path.to_path_buf(),
            snapshots: snapshots.clone(),
        }),
    }
}

/// Files outside `snapshots` that the snapshot in `dir`, or one its memory is a diff over,
/// links to.
pub fn linked_files(dir: &Path, snapshots: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut dir = dir.to_path_buf();
    // A chain is short; the bound stops a loop of diffs naming each other.
    for _ in 0..256 {
        for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            if entry.file_type().is_ok_and(|t| t.is_symlink()) {
                if let Ok(target) = std::fs::canonicalize(entry.path()) {
                    if !target.starts_with(snapshots) && !out.contains(&target) {
                        out.push(target);
                    }
                }
            }
        }
        match tine_vmm::snapshot::file::load_header(&dir).map(|h| h.diff) {
            Ok(Some(d)) => dir = dir.with_file_name(d.parent),
            _ => break,
        }
    }
    out
}
