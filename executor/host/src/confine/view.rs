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
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use tine_vmm::marks::Marks;

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
/// `early`: the mount namespace the worker entered while it waited (None: it enters one now).
/// `marks`: the calling thread's CPU per part (namespace, root, binds, proc, kvm-linked,
/// pivot, seal), for vmm.log.
pub fn enter(
    early: Option<Early>,
    vm_dir: &Path,
    snapshots: &Path,
    linked: &[PathBuf],
    marks: &mut Marks,
) -> Result<(), ConfineError> {
    // Entered now if not ahead; its handles on the host's tree are closed here, before
    // anything of the guest's runs.
    drop(match early {
        Some(early) => early,
        None => Early::enter()?,
    });
    marks.mark("namespace");
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
    marks.mark("root");
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
    marks.mark("binds");
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
    marks.mark("proc");
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
    marks.mark("kvm-linked");
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
    marks.mark("pivot");
    mount(
        "making the view's root read-only",
        None,
        Path::new("/"),
        None,
        libc::MS_REMOUNT | libc::MS_RDONLY | hardened,
        None,
    )?;
    // A namespace entered early is the host's slave, and so are the binds made from it: cut the
    // view's few mounts off, so nothing the host mounts later shows in it.
    mount(
        "making the view's mounts private",
        None,
        Path::new("/"),
        None,
        libc::MS_REC | libc::MS_PRIVATE,
        None,
    )?;
    let _ = SNAPSHOTS.set(snapshots.to_path_buf());
    marks.mark("seal");
    Ok(())
}

/// A mount namespace of the worker's own, entered while it waits for its job: copying the
/// host's mount table (and, at the job, cutting the copy off) is per-mount work no job decides.
/// It is the host's slave, so what the host mounts or unmounts meanwhile (a child's network
/// namespace under /run/netns, an unmounted disk) reaches it instead of being pinned in a
/// stale copy. Until the job it holds the host's root and mount namespace: a job with a view
/// closes both as it enters it ([`enter`]); one without goes back ([`Early::leave`]).
pub struct Early {
    host_ns: OwnedFd,
    host_root: OwnedFd,
    /// The worker's working directory, restored when it goes back.
    cwd: OwnedFd,
}

fn open_fd(what: &'static str, path: &str, flags: libc::c_int) -> Result<OwnedFd, ConfineError> {
    let c = CString::new(path).expect("no NUL");
    // SAFETY: open with a NUL-terminated path; the descriptor returned is ours.
    let fd = unsafe { libc::open(c.as_ptr(), flags | libc::O_CLOEXEC) };
    sys(what, fd)?;
    // SAFETY: a fresh descriptor from open.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

impl Early {
    /// Needs root (CAP_SYS_ADMIN) and a calling thread that is the process's only one.
    pub fn enter() -> Result<Early, ConfineError> {
        let what = "entering a mount namespace of its own";
        let early = Early {
            host_ns: open_fd(what, "/proc/self/ns/mnt", libc::O_RDONLY)?,
            host_root: open_fd(what, "/", libc::O_PATH | libc::O_DIRECTORY)?,
            cwd: open_fd(what, ".", libc::O_PATH | libc::O_DIRECTORY)?,
        };
        // SAFETY: unshare on the calling thread, with no memory effects.
        sys(what, unsafe { libc::unshare(libc::CLONE_NEWNS) })?;
        // Nothing mounted here propagates back to the host; what it mounts reaches here.
        if let Err(e) = mount(
            what,
            None,
            Path::new("/"),
            None,
            libc::MS_REC | libc::MS_SLAVE,
            None,
        ) {
            // Its mounts are still the host's peers: no job may run here.
            return Err(match early.leave() {
                Ok(()) => e,
                Err(_) => ConfineError::Stranded(Box::new(e)),
            });
        }
        Ok(early)
    }

    /// Back to the host's mount namespace, root and working directory (a job without a view).
    /// If the namespace cannot be entered nothing changed (the worker stays in its own, the
    /// host's slave); a failure after that is [`ConfineError::Stranded`].
    pub fn leave(self) -> Result<(), ConfineError> {
        // SAFETY: setns on a descriptor we own; the calling thread is the only one.
        sys("going back to the host's mount namespace", unsafe {
            libc::setns(self.host_ns.as_raw_fd(), libc::CLONE_NEWNS)
        })?;
        // setns moved root and working directory to the namespace's root: put back the root
        // the worker had (an executor in a chroot), then its working directory.
        let dot = CString::new(".").unwrap();
        // SAFETY: fchdir on descriptors we own, chroot to a NUL-terminated path.
        let back = unsafe {
            sys(
                "going back to its root",
                libc::fchdir(self.host_root.as_raw_fd()),
            )
            .and_then(|()| sys("going back to its root", libc::chroot(dot.as_ptr())))
            .and_then(|()| {
                sys(
                    "going back to its working directory",
                    libc::fchdir(self.cwd.as_raw_fd()),
                )
            })
        };
        back.map_err(|e| ConfineError::Stranded(Box::new(e)))
    }

    /// Open `path` (absolute) for reading in the host's tree as it is now, mounts made since
    /// this namespace was entered included (a path walk from the host's root follows the
    /// host's mounts, whatever namespace the caller is in).
    pub fn open_host(&self, path: &Path) -> std::io::Result<std::fs::File> {
        let rel = path.strip_prefix("/").map_err(|_| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("{} is not absolute", path.display()),
            )
        })?;
        let rel = if rel.as_os_str().is_empty() {
            CString::new(".").unwrap()
        } else {
            cstr(rel)
        };
        // SAFETY: openat on a descriptor we own with a NUL-terminated relative path.
        let fd = unsafe {
            libc::openat(
                self.host_root.as_raw_fd(),
                rel.as_ptr(),
                libc::O_RDONLY | libc::O_CLOEXEC,
            )
        };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: a fresh descriptor from openat.
        Ok(std::fs::File::from(unsafe { OwnedFd::from_raw_fd(fd) }))
    }
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
