//! The host's kernel samepage merging (KSM), which an executor may let merge the pages its
//! children wrote alike ([`crate::Limits::merge_pages`]): whether it runs, and the counters a
//! benchmark reports (what merged, and what the merging cost).

use std::path::Path;

/// The KSM daemon's switch: 0 stopped, 1 running, 2 stopped and everything unmerged.
pub const RUN: &str = "/sys/kernel/mm/ksm/run";
/// Where the daemon's settings and counters live.
pub const SYSFS: &str = "/sys/kernel/mm/ksm";

/// Why merging cannot be used here, or None when the daemon runs (`run` file at `path`).
pub fn refusal(path: &Path) -> Option<String> {
    match std::fs::read_to_string(path) {
        Ok(v) if v.trim() == "1" => None,
        Ok(v) => Some(format!(
            "{} is {}: the KSM daemon is not running (as root: echo 1 > {RUN})",
            path.display(),
            v.trim()
        )),
        Err(e) => Some(format!(
            "{}: {e} (a kernel without CONFIG_KSM cannot merge pages)",
            path.display()
        )),
    }
}

/// Host-wide counters (`/sys/kernel/mm/ksm/*`), in pages.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    /// Pages KSM keeps, each standing for several identical ones.
    pub pages_shared: u64,
    /// Further mappings of those pages: how many pages merging saved.
    pub pages_sharing: u64,
    /// Zero-filled pages merged with the kernel's zero page (`use_zero_pages`).
    pub zero_pages: u64,
    /// Complete passes over all mergeable memory.
    pub full_scans: u64,
}

impl Counters {
    /// The counters under `dir` (normally [`SYSFS`]); None where KSM is absent.
    pub fn read(dir: &Path) -> Option<Counters> {
        let get = |name: &str| -> Option<u64> {
            std::fs::read_to_string(dir.join(name))
                .ok()?
                .trim()
                .parse()
                .ok()
        };
        Some(Counters {
            pages_shared: get("pages_shared")?,
            pages_sharing: get("pages_sharing")?,
            // Newer kernels only (zero-page merging counted since about Linux 6.5).
            zero_pages: get("ksm_zero_pages").unwrap_or(0),
            full_scans: get("full_scans")?,
        })
    }
}

impl Counters {
    /// How much each counter grew since `before` (a counter that fell counts as 0; a pass
    /// count is the passes completed in between).
    pub fn since(&self, before: &Counters) -> Counters {
        Counters {
            pages_shared: self.pages_shared.saturating_sub(before.pages_shared),
            pages_sharing: self.pages_sharing.saturating_sub(before.pages_sharing),
            zero_pages: self.zero_pages.saturating_sub(before.zero_pages),
            full_scans: self.full_scans.saturating_sub(before.full_scans),
        }
    }
}

/// Pages of process `pid` that KSM merged (`/proc/PID/ksm_merging_pages`, Linux 5.19+).
pub fn merging_pages(pid: u32) -> Option<u64> {
    std::fs::read_to_string(format!("/proc/{pid}/ksm_merging_pages"))
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// CPU time the KSM daemon (the kernel thread `ksmd`) has used, in ms; None if it is not
/// found.
pub fn daemon_cpu_ms() -> Option<f64> {
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        if let Some(ms) = ksmd_cpu_ms(&stat) {
            return Some(ms);
        }
    }
    None
}

/// utime + stime of a `/proc/PID/stat` line, in ms, if it is ksmd's.
fn ksmd_cpu_ms(stat: &str) -> Option<f64> {
    let (comm, fields) = crate::process::stat_fields(stat)?;
    if comm != "ksmd" {
        return None;
    }
    // Fields start at the state (field 3); utime is field 14, stime 15.
    let utime: u64 = fields.get(14 - 3)?.parse().ok()?;
    let stime: u64 = fields.get(15 - 3)?.parse().ok()?;
    crate::process::ticks_to_ms(utime + stime)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusal_says_why_and_how() {
        let dir = tempfile::tempdir().unwrap();
        let run = dir.path().join("run");
        std::fs::write(&run, "1\n").unwrap();
        assert_eq!(refusal(&run), None);
        std::fs::write(&run, "0\n").unwrap();
        let why = refusal(&run).unwrap();
        assert!(why.contains("is 0") && why.contains("echo 1 >"), "{why}");
        let why = refusal(&dir.path().join("absent")).unwrap();
        assert!(why.contains("CONFIG_KSM"), "{why}");
    }

    #[test]
    fn counters_read_from_sysfs_files() {
        let dir = tempfile::tempdir().unwrap();
        for (f, v) in [
            ("pages_shared", "12\n"),
            ("pages_sharing", "40\n"),
            ("full_scans", "3\n"),
        ] {
            std::fs::write(dir.path().join(f), v).unwrap();
        }
        let c = Counters::read(dir.path()).unwrap();
        assert_eq!(
            c,
            Counters {
                pages_shared: 12,
                pages_sharing: 40,
                zero_pages: 0,
                full_scans: 3
            }
        );
        let earlier = Counters {
            pages_shared: 2,
            pages_sharing: 50,
            zero_pages: 0,
            full_scans: 1,
        };
        assert_eq!(
            c.since(&earlier),
            Counters {
                pages_shared: 10,
                pages_sharing: 0,
                zero_pages: 0,
                full_scans: 2
            }
        );
        std::fs::write(dir.path().join("full_scans"), "x").unwrap();
        assert_eq!(Counters::read(dir.path()), None);
    }

    #[test]
    fn ksmd_stat_line_gives_its_cpu_time() {
        let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
        let line = "57 (ksmd) S 2 0 0 0 -1 2129984 0 0 0 0 150 250 0 0 25 5 1 0 7 0 0";
        assert_eq!(ksmd_cpu_ms(line), Some(400.0 * 1e3 / hz));
        // The name ends at the last parenthesis, whatever it holds.
        let odd = "59 (a) (ksmd) S 2 0 0 0 -1 2129984 0 0 0 0 150 250 0 0 25 5 1 0 7 0 0";
        assert_eq!(ksmd_cpu_ms(odd), None);
        // A process that merely has ksmd in its name is not the daemon.
        let other = "58 (not ksmd) S 2 0 0 0 -1 2129984 0 0 0 0 150 250 0 0 25 5 1 0 7 0 0";
        assert_eq!(ksmd_cpu_ms(other), None);
    }

    #[test]
    fn own_process_reports_merging_pages() {
        // Linux 5.19+: the file exists for every process, 0 when nothing merged.
        if Path::new("/proc/self/ksm_merging_pages").exists() {
            assert!(merging_pages(std::process::id()).is_some());
        }
        assert_eq!(merging_pages(u32::MAX), None);
    }
}
