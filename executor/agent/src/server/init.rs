//! PID 1 duties: the filesystems a bare initramfs lacks.

use std::ffi::CString;
use std::io;

struct Mount {
    source: &'static str,
    target: &'static str,
    fstype: &'static str,
    flags: libc::c_ulong,
    data: &'static str,
}

const MOUNTS: &[Mount] = &[
    Mount {
        source: "proc",
        target: "/proc",
        fstype: "proc",
        flags: libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
        data: "",
    },
    Mount {
        source: "sysfs",
        target: "/sys",
        fstype: "sysfs",
        flags: libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
        data: "",
    },
    Mount {
        source: "devtmpfs",
        target: "/dev",
        fstype: "devtmpfs",
        flags: libc::MS_NOSUID,
        data: "mode=0755",
    },
    Mount {
        source: "devpts",
        target: "/dev/pts",
        fstype: "devpts",
        flags: libc::MS_NOSUID | libc::MS_NOEXEC,
        data: "mode=0620,ptmxmode=0666",
    },
    Mount {
        source: "tmpfs",
        target: "/dev/shm",
        fstype: "tmpfs",
        flags: libc::MS_NOSUID | libc::MS_NODEV,
        data: "mode=1777",
    },
    Mount {
        source: "tmpfs",
        target: "/tmp",
        fstype: "tmpfs",
        flags: libc::MS_NOSUID | libc::MS_NODEV,
        data: "mode=1777",
    },
    Mount {
        source: "tmpfs",
        target: "/run",
        fstype: "tmpfs",
        flags: libc::MS_NOSUID | libc::MS_NODEV,
        data: "mode=0755",
    },
];

/// Mounts the standard pseudo filesystems. Failures are returned per mount
/// and do not stop the rest (a missing /dev/pts must not cost us /tmp).
pub fn mount_filesystems() -> Vec<(String, io::Error)> {
    let mut errors = Vec::new();
    for m in MOUNTS {
        if let Err(e) = mount_one(m) {
            errors.push((m.target.to_owned(), e));
        }
    }
    errors
}

fn mount_one(m: &Mount) -> io::Result<()> {
    std::fs::create_dir_all(m.target)?;
    let c = |s: &str| CString::new(s).expect("static strings have no NUL");
    let (source, target, fstype, data) = (c(m.source), c(m.target), c(m.fstype), c(m.data));
    // SAFETY: all pointers are valid NUL-terminated strings for the call.
    let rc = unsafe {
        libc::mount(
            source.as_ptr(),
            target.as_ptr(),
            fstype.as_ptr(),
            m.flags,
            data.as_ptr().cast(),
        )
    };
    if rc != 0 {
        let e = io::Error::last_os_error();
        // Already mounted (e.g. the kernel's devtmpfs automount).
        if e.raw_os_error() != Some(libc::EBUSY) {
            return Err(e);
        }
    }
    Ok(())
}
