//! Named network namespaces kept as `ip netns` keeps them (a file under `/run/netns` with the
//! namespace bind-mounted on it, in a shared mount), made and removed in-process rather than
//! by running `ip netns add` and `ip netns del`; `ip netns` lists and removes them as its own.

use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::Path;

pub(super) const RUN_DIR: &str = "/run/netns";

fn cstr(p: &Path) -> io::Result<std::ffi::CString> {
    use std::os::unix::ffi::OsStrExt;
    std::ffi::CString::new(p.as_os_str().as_bytes()).map_err(io::Error::other)
}

fn mount(src: &Path, target: &Path, flags: libc::c_ulong) -> io::Result<()> {
    let (src, target) = (cstr(src)?, cstr(target)?);
    // SAFETY: NUL-terminated paths; no file system type or data for a bind or a propagation
    // change.
    let rc = unsafe {
        libc::mount(
            src.as_ptr(),
            target.as_ptr(),
            std::ptr::null(),
            flags,
            std::ptr::null(),
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// `/run/netns` exists and is a shared mount point, so a namespace mounted on a file in it
/// later shows in mount namespaces copied from this one before (as `ip netns add` does).
fn prepare_run_dir() -> io::Result<()> {
    let dir = Path::new(RUN_DIR);
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o755)
        .create(dir)
        .map_err(|e| io::Error::new(e.kind(), format!("creating {RUN_DIR}: {e}")))?;
    let shared = || mount(Path::new("none"), dir, libc::MS_SHARED | libc::MS_REC);
    match shared() {
        Ok(()) => Ok(()),
        // Not a mount point yet: make it one (bound onto itself), then shared.
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
            mount(dir, dir, libc::MS_BIND | libc::MS_REC)?;
            shared()
        }
        Err(e) => Err(e),
    }
    .map_err(|e| io::Error::new(e.kind(), format!("making {RUN_DIR} a shared mount: {e}")))
}

/// What making a named namespace found.
pub(super) enum Made<T> {
    /// Its file exists already (another process took the name).
    Taken,
    /// Made, and `f` ran inside it.
    Done(T),
}

/// Make namespace `path` (a new file under [`RUN_DIR`]) and run `f` in it, on a thread of its
/// own that enters it first; `f` gets a descriptor of the caller's namespace (where a veth's
/// peer goes). The file exists from the start: on an error it is left for
/// [`remove`], which the caller runs to clean up.
pub(super) fn make<T: Send>(
    path: &Path,
    f: impl FnOnce(&OwnedFd) -> io::Result<T> + Send,
) -> io::Result<Made<T>> {
    prepare_run_dir()?;
    match std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o0)
        .custom_flags(libc::O_CLOEXEC)
        .open(path)
    {
        Ok(_) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => return Ok(Made::Taken),
        Err(e) => {
            return Err(io::Error::new(
                e.kind(),
                format!("creating {}: {e}", path.display()),
            ))
        }
    }
    std::thread::scope(|s| {
        s.spawn(|| {
            let own = Path::new("/proc/thread-self/ns/net");
            let caller = std::fs::File::open(own).map(OwnedFd::from)?;
            // SAFETY: moves only this thread into a new network namespace; it ends with `f`.
            if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
                return Err(io::Error::last_os_error());
            }
            mount(own, path, libc::MS_BIND).map_err(|e| {
                io::Error::new(e.kind(), format!("mounting it on {}: {e}", path.display()))
            })?;
            f(&caller).map(Made::Done)
        })
        .join()
        .unwrap_or_else(|_| Err(io::Error::other("the namespace's thread panicked")))
    })
}

/// Remove namespace `path` made by [`make`] (or `ip netns add`): detach its mount, remove its
/// file. What is gone already is not an error.
pub(super) fn remove(path: &Path) -> io::Result<()> {
    let c = cstr(path)?;
    // SAFETY: a NUL-terminated path.
    if unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) } != 0 {
        let e = io::Error::last_os_error();
        // EINVAL: not mounted (a half-made one); ENOENT: gone.
        if !matches!(e.raw_os_error(), Some(libc::EINVAL | libc::ENOENT)) {
            return Err(e);
        }
    }
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}
