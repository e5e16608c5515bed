//! Directories the host lends a confined VMM to write into (a branch, a parent's snapshot):
//! a VMM may create nothing else, and what it wrote comes back only as the host's plain files.

/// Make `dir` (new, empty) writable by the user VMM worker `pid` runs as, and by nobody else.
pub(crate) fn lend_dir(dir: &std::path::Path, pid: u32) -> std::io::Result<()> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt};
    std::fs::DirBuilder::new().mode(0o700).create(dir)?;
    let owner = std::fs::metadata(format!("/proc/{pid}"))?;
    std::os::unix::fs::chown(dir, Some(owner.uid()), Some(owner.gid()))
}

/// Take a directory a VMM wrote back from its user before anything reads it. The directory
/// is the host's again first (the VMM can no longer add, swap or remove entries); then each
/// entry, opened without following links, must be a plain file with one link (no symlink
/// out, nothing hard-linked in) and becomes the host's, read-only to others, through its
/// descriptor, so that no later VMM with the same user can change it.
pub(crate) fn take_back_dir(dir: &std::path::Path) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
    let bad = |what: String| std::io::Error::new(std::io::ErrorKind::InvalidData, what);
    // SAFETY: geteuid and getegid have no preconditions.
    let (uid, gid) = unsafe { (libc::geteuid(), libc::getegid()) };
    std::os::unix::fs::lchown(dir, Some(uid), Some(gid))?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))?;
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let f = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
            .open(entry.path())
            .map_err(|e| bad(format!("{name} is not a plain file ({e})")))?;
        let m = f.metadata()?;
        if !m.file_type().is_file() || m.nlink() != 1 {
            return Err(bad(format!("{name} is not a plain file")));
        }
        // SAFETY: fchown and fchmod on a descriptor we own.
        let r = unsafe {
            if libc::fchown(f.as_raw_fd(), uid, gid) == 0 {
                libc::fchmod(f.as_raw_fd(), 0o644)
            } else {
                -1
            }
        };
        if r != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

    /// What a hostile VMM could leave in the directory it was lent: a link out, a file
    /// hard-linked in, a FIFO; each refuses the branch. Plain files come back the host's.
    #[test]
    fn a_lent_directory_comes_back_only_as_plain_files() {
        let tmp = tempfile::tempdir().unwrap();
        let secret = tmp.path().join("secret");
        std::fs::write(&secret, b"host only").unwrap();
        std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).unwrap();
        let lent = |name: &str| {
            let d = tmp.path().join(name);
            std::fs::create_dir(&d).unwrap();
            std::fs::write(d.join("state.bin"), b"ok").unwrap();
            std::fs::set_permissions(d.join("state.bin"), std::fs::Permissions::from_mode(0o600))
                .unwrap();
            d
        };
        let d = lent("symlink");
        std::os::unix::fs::symlink(&secret, d.join("pages.bin")).unwrap();
        let e = take_back_dir(&d).unwrap_err();
        assert!(
            e.to_string().contains("pages.bin is not a plain file"),
            "{e}"
        );
        let d = lent("hardlink");
        std::fs::hard_link(&secret, d.join("pages.bin")).unwrap();
        let e = take_back_dir(&d).unwrap_err();
        assert!(
            e.to_string().contains("pages.bin is not a plain file"),
            "{e}"
        );
        let d = lent("fifo");
        let fifo = std::ffi::CString::new(d.join("pages.bin").to_str().unwrap()).unwrap();
        // SAFETY: mkfifo with a NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
        assert!(take_back_dir(&d).is_err());
        assert_eq!(
            std::fs::metadata(&secret).unwrap().mode() & 0o777,
            0o600,
            "nothing outside was touched"
        );
        let d = lent("plain");
        take_back_dir(&d).unwrap();
        let m = std::fs::metadata(d.join("state.bin")).unwrap();
        assert_eq!(m.mode() & 0o777, 0o644);
        assert_eq!(std::fs::metadata(&d).unwrap().mode() & 0o777, 0o755);
    }
}
