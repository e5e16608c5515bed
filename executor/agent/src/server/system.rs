//! SetTime and Reseed: fix-ups a clone needs right after it is restored from
//! a snapshot (its clock and entropy are the parent's); PrepareSnapshot: what a parent does
//! just before it is snapshotted.

use std::fs::OpenOptions;
use std::io::Write;
use std::os::fd::AsRawFd;

use anyhow::Context;

/// `_IOW('R', 0x03, int[2])` from <linux/random.h>.
const RNDADDENTROPY: libc::c_ulong = 0x4008_5203;
/// `_IO('R', 0x07)`: reseed the CRNG from the input pool now.
const RNDRESEEDCRNG: libc::c_ulong = 0x5207;

pub fn set_time(unix_nanos: u64) -> anyhow::Result<()> {
    let ts = libc::timespec {
        tv_sec: (unix_nanos / 1_000_000_000) as libc::time_t,
        tv_nsec: (unix_nanos % 1_000_000_000) as libc::c_long,
    };
    // SAFETY: clock_settime with a valid timespec.
    if unsafe { libc::clock_settime(libc::CLOCK_REALTIME, &ts) } != 0 {
        return Err(std::io::Error::last_os_error()).context("clock_settime(CLOCK_REALTIME)");
    }
    Ok(())
}

/// Mixes `entropy` into the kernel pool. Returns true if it was credited
/// (RNDADDENTROPY, needs CAP_SYS_ADMIN); otherwise it is written to
/// /dev/urandom, which mixes it in without crediting.
pub fn add_entropy(entropy: &[u8]) -> anyhow::Result<bool> {
    let files = WAKE_FILES.lock().unwrap_or_else(|e| e.into_inner());
    let opened;
    let mut dev = match files.as_ref().and_then(|f| f.urandom.as_ref()) {
        Some(f) => f,
        None => {
            opened = OpenOptions::new()
                .write(true)
                .open("/dev/urandom")
                .context("opening /dev/urandom")?;
            &opened
        }
    };
    if entropy.is_empty() {
        return Ok(false);
    }
    // struct rand_pool_info { int entropy_count; int buf_size; __u32 buf[]; }
    let mut info = Vec::with_capacity(8 + entropy.len() + 3);
    let bits = (entropy.len() as i32).saturating_mul(8);
    info.extend_from_slice(&bits.to_ne_bytes());
    info.extend_from_slice(&(entropy.len() as i32).to_ne_bytes());
    info.extend_from_slice(entropy);
    info.resize(info.len().next_multiple_of(4), 0);
    // SAFETY: the buffer holds a complete rand_pool_info of buf_size bytes.
    let rc = unsafe { libc::ioctl(dev.as_raw_fd(), RNDADDENTROPY as _, info.as_ptr()) };
    let credited = rc == 0;
    if !credited {
        dev.write_all(entropy).context("writing /dev/urandom")?;
    }
    // Clones share the parent's CRNG state, and the kernel only reseeds it from the input pool
    // at intervals: force it now, or two children can read the same "random" bytes.
    // SAFETY: argument-less ioctl on an open random device; needs CAP_SYS_ADMIN (we are init).
    let rc = unsafe { libc::ioctl(dev.as_raw_fd(), RNDRESEEDCRNG as _) };
    if rc != 0 {
        eprintln!(
            "tine-agent: RNDRESEEDCRNG: {}",
            std::io::Error::last_os_error()
        );
    }
    Ok(credited)
}

/// Give this clone its own hostname (the kernel's and /etc/hostname) and /etc/machine-id.
/// Both are checked first: the host names them, but nothing unchecked reaches a syscall.
pub fn set_identity(hostname: &str, machine_id: &str) -> anyhow::Result<()> {
    check_identity(hostname, machine_id)?;
    // One caller at a time sets the kernel's name and the files, so they agree.
    let files = WAKE_FILES.lock().unwrap_or_else(|e| e.into_inner());
    // SAFETY: a valid buffer of the given length.
    if unsafe { libc::sethostname(hostname.as_ptr().cast(), hostname.len()) } != 0 {
        return Err(std::io::Error::last_os_error()).context("sethostname");
    }
    let etc = std::path::Path::new("/etc");
    match files.as_ref() {
        Some(f) => f.write_identity(etc, hostname, machine_id),
        None => write_identity(etc, hostname, machine_id),
    }
}

/// The files a clone's Wake writes, opened when the parent prepares its snapshot, so a clone
/// changes only their contents. Opening them in each clone walks their paths and takes and
/// drops references on their dentries and inodes, and writing a file aside and renaming it
/// makes a new inode and dentry: kernel pages every clone would copy out of the snapshot.
/// A file that could not be opened (missing, say) is written by path, as without them.
struct WakeFiles {
    urandom: Option<std::fs::File>,
    hostname: Option<std::fs::File>,
    machine_id: Option<std::fs::File>,
}

/// Set by [`prepare_snapshot`]; also the one-writer-at-a-time lock of the identity.
static WAKE_FILES: std::sync::Mutex<Option<WakeFiles>> = std::sync::Mutex::new(None);

impl WakeFiles {
    /// The random device and `<etc>/hostname` and `<etc>/machine-id` as they are (none is
    /// made: a guest without one keeps it missing until a Wake names it).
    fn open(etc: &std::path::Path, random: &std::path::Path) -> WakeFiles {
        let rw = |name: &str| {
            OpenOptions::new()
                .read(true)
                .write(true)
                .open(etc.join(name))
                .ok()
        };
        WakeFiles {
            urandom: OpenOptions::new().write(true).open(random).ok(),
            hostname: rw("hostname"),
            machine_id: rw("machine-id"),
        }
    }

    /// Each identity file rewritten through its open descriptor while that is still the file
    /// at its path; otherwise (missing when opened, removed, renamed away or replaced since)
    /// written by path.
    fn write_identity(
        &self,
        etc: &std::path::Path,
        hostname: &str,
        machine_id: &str,
    ) -> anyhow::Result<()> {
        for (file, name, value) in [
            (&self.hostname, "hostname", hostname),
            (&self.machine_id, "machine-id", machine_id),
        ] {
            let path = etc.join(name);
            match file.as_ref().filter(|f| same_file(f, &path)) {
                Some(f) => rewrite_in_place(f, value)
                    .with_context(|| format!("writing {}", path.display()))?,
                None => write_aside(etc, name, value)?,
            }
        }
        Ok(())
    }
}

/// `f` is the file at `path` (same device and inode; `path` followed through symlinks).
fn same_file(f: &std::fs::File, path: &std::path::Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (f.metadata(), std::fs::metadata(path)) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    }
}

/// The file's contents replaced where they are (same inode and page): written from the start,
/// then cut to length. Unlike a rename, a reader in between can see the new line followed by
/// the rest of a longer old one; the Wake is a clone's first call, so that window is the
/// microseconds before any work of the clone's own.
fn rewrite_in_place(f: &std::fs::File, value: &str) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    let line = format!("{value}\n");
    f.write_all_at(line.as_bytes(), 0)?;
    f.set_len(line.len() as u64)
}

fn check_identity(hostname: &str, machine_id: &str) -> anyhow::Result<()> {
    let host_ok = (1..=64).contains(&hostname.len())
        && hostname
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.')
        && !hostname.starts_with(['-', '.']);
    anyhow::ensure!(
        host_ok,
        "hostname {hostname:?}: 1-64 letters, digits, '-', '.'"
    );
    let id_ok = machine_id.len() == 32
        && machine_id
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
    anyhow::ensure!(id_ok, "machine_id {machine_id:?}: 32 lowercase hex digits");
    Ok(())
}

/// `<etc>/hostname` and `<etc>/machine-id`, each replaced whole (written aside, renamed).
fn write_identity(etc: &std::path::Path, hostname: &str, machine_id: &str) -> anyhow::Result<()> {
    // One writer at a time: a host that retries a call whose connection dropped can have two
    // on their way, and both would write and rename the same temporary files.
    static WRITING: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = WRITING.lock().unwrap_or_else(|e| e.into_inner());
    write_aside(etc, "hostname", hostname)?;
    write_aside(etc, "machine-id", machine_id)
}

/// `<etc>/<name>` replaced whole by a file holding `value`, written aside and renamed over it.
fn write_aside(etc: &std::path::Path, name: &str, value: &str) -> anyhow::Result<()> {
    let path = etc.join(name);
    let tmp = etc.join(format!(".{name}.tine"));
    std::fs::write(&tmp, format!("{value}\n"))
        .and_then(|()| std::fs::rename(&tmp, &path))
        .with_context(|| format!("writing {}", path.display()))
}

/// MemFree from /proc/meminfo, in KiB (0 if unreadable).
fn mem_free_kib() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find_map(|l| l.strip_prefix("MemFree:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        })
        .unwrap_or(0)
}

/// Write back dirty data, drop clean page cache, dentries and inodes, and compact memory, so
/// the snapshot carries the workload and not reclaimable caches. Returns MemFree before and
/// after (KiB).
pub fn prepare_snapshot() -> anyhow::Result<(u64, u64)> {
    let before = mem_free_kib();
    // Opened now, as the files are when the snapshot is taken; without them a clone opens
    // and replaces them as before.
    let opened = WakeFiles::open(
        std::path::Path::new("/etc"),
        std::path::Path::new("/dev/urandom"),
    );
    *WAKE_FILES.lock().unwrap_or_else(|e| e.into_inner()) = Some(opened);
    // SAFETY: sync has no arguments and cannot fail.
    unsafe { libc::sync() };
    std::fs::write("/proc/sys/vm/drop_caches", b"3").context("writing /proc/sys/vm/drop_caches")?;
    // Absent without CONFIG_COMPACTION: dropping caches is what matters.
    let _ = std::fs::write("/proc/sys/vm/compact_memory", b"1");
    Ok((before, mem_free_kib()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identities_are_checked_and_written_whole() {
        let id = "0123456789abcdef0123456789abcdef";
        check_identity("sbx-1811c74a030833e5", id).unwrap();
        for bad in ["", "-x", ".x", "a b", "a/b", "a\nb", &"x".repeat(65)] {
            assert!(check_identity(bad, id).is_err(), "{bad:?}");
        }
        for bad in [
            "",
            "0123",
            &"0".repeat(33),
            "0123456789ABCDEF0123456789ABCDEF",
        ] {
            assert!(check_identity("h", bad).is_err(), "{bad:?}");
        }
        let tmp = tempfile::tempdir().unwrap();
        std::fs::write(tmp.path().join("machine-id"), "parent\n").unwrap();
        write_identity(tmp.path(), "child-1", id).unwrap();
        let read = |n: &str| std::fs::read_to_string(tmp.path().join(n)).unwrap();
        assert_eq!(read("hostname"), "child-1\n");
        assert_eq!(read("machine-id"), format!("{id}\n"));
        assert_eq!(
            std::fs::read_dir(tmp.path()).unwrap().count(),
            2,
            "no temp files left"
        );
    }

    #[test]
    fn prepared_files_are_rewritten_in_place_while_they_are_the_files_at_their_paths() {
        use std::os::unix::fs::MetadataExt;
        let tmp = tempfile::tempdir().unwrap();
        let (etc, random) = (tmp.path().join("etc"), tmp.path().join("random"));
        std::fs::create_dir(&etc).unwrap();
        std::fs::write(etc.join("hostname"), "a-rather-long-parent-name\n").unwrap();
        std::fs::write(etc.join("machine-id"), "parent\n").unwrap();
        std::fs::write(&random, "").unwrap();
        let files = WakeFiles::open(&etc, &random);
        let ino = |n: &str| std::fs::metadata(etc.join(n)).unwrap().ino();
        let before = (ino("hostname"), ino("machine-id"));
        let read = |n: &str| std::fs::read_to_string(etc.join(n)).unwrap();
        let id = "0123456789abcdef0123456789abcdef";
        files.write_identity(&etc, "child-1", id).unwrap();
        assert_eq!(read("hostname"), "child-1\n", "shorter: cut to length");
        assert_eq!(read("machine-id"), format!("{id}\n"));
        files.write_identity(&etc, "child-1-longer", id).unwrap();
        assert_eq!(read("hostname"), "child-1-longer\n");
        assert_eq!((ino("hostname"), ino("machine-id")), before, "same inodes");

        // Renamed away and a new one made: the new one is written, by path.
        std::fs::rename(etc.join("hostname"), tmp.path().join("hostname.bak")).unwrap();
        std::fs::write(etc.join("hostname"), "other\n").unwrap();
        files.write_identity(&etc, "child-2", id).unwrap();
        assert_eq!(read("hostname"), "child-2\n");
        let bak = std::fs::read_to_string(tmp.path().join("hostname.bak")).unwrap();
        assert_eq!(bak, "child-1-longer\n", "the old file is left alone");
        assert_eq!(
            std::fs::read_dir(&etc).unwrap().count(),
            2,
            "no other files"
        );
    }

    #[test]
    fn a_file_missing_when_prepared_is_neither_made_then_nor_left_missing() {
        let tmp = tempfile::tempdir().unwrap();
        let etc = tmp.path();
        std::fs::write(etc.join("hostname"), "parent\n").unwrap();
        let files = WakeFiles::open(etc, &etc.join("no-random-device"));
        assert!(files.urandom.is_none() && files.machine_id.is_none());
        assert!(!etc.join("machine-id").exists(), "not made by preparing");
        let id = "0123456789abcdef0123456789abcdef";
        files.write_identity(etc, "child-1", id).unwrap();
        let read = |n: &str| std::fs::read_to_string(etc.join(n)).unwrap();
        assert_eq!(read("machine-id"), format!("{id}\n"));
        assert_eq!(read("hostname"), "child-1\n");
    }

    #[test]
    fn calls_that_overlap_each_write_the_identity_whole() {
        let tmp = tempfile::tempdir().unwrap();
        let id = "0123456789abcdef0123456789abcdef";
        std::thread::scope(|s| {
            for t in 0..8 {
                let dir = tmp.path();
                s.spawn(move || {
                    for _ in 0..50 {
                        write_identity(dir, &format!("child-{t}"), id).unwrap();
                    }
                });
            }
        });
        let host = std::fs::read_to_string(tmp.path().join("hostname")).unwrap();
        assert!(
            host.starts_with("child-") && host.ends_with('\n'),
            "{host:?}"
        );
        assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 2);
    }
}
