//! Debian root filesystems made by `debootstrap`, cached under `<cache>/rootfs/`.
//!
//! A finished tree is renamed into place (`debootstrap-<key>`), so its existence means it is
//! complete; the key covers suite, mirror, variant, package list and, when the build host runs
//! the same suite, the candidate versions of the requested packages.

use std::collections::BTreeMap;
use std::fs;
use std::io::{BufRead, BufReader};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde::Serialize;
use sha2::{Digest, Sha256};

use crate::apt;

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Debootstrap {
    pub suite: String,
    pub mirror: String,
    pub variant: String,
    pub packages: Vec<String>,
    /// Candidate versions of `packages` as the build host's apt sees them, when it tracks the
    /// same suite (None otherwise: the key then only changes with the recipe).
    pub versions: Option<BTreeMap<String, String>>,
}

impl Debootstrap {
    pub fn new(suite: &str, mirror: &str, variant: &str, packages: &[String]) -> Result<Self> {
        let mut packages = packages.to_vec();
        packages.sort();
        packages.dedup();
        let versions = host_candidate_versions(suite, &packages)?;
        Ok(Debootstrap {
            suite: suite.into(),
            mirror: mirror.into(),
            variant: variant.into(),
            packages,
            versions,
        })
    }

    pub fn key(&self) -> String {
        let json = serde_json::to_vec(self).expect("serializable");
        hex::encode(&Sha256::digest(&json)[..12])
    }

    /// The cached tree, running debootstrap first if there is none.
    pub fn rootfs(&self, cache: &Path) -> Result<PathBuf> {
        let base = cache.join("rootfs");
        let dir = base.join(format!("debootstrap-{}", self.key()));
        if dir.is_dir() {
            eprintln!("tine-image: reusing {}", dir.display());
            return Ok(dir);
        }
        if fs::metadata("/proc/self").map(|m| m.uid()).unwrap_or(0) != 0 {
            bail!("debootstrap needs root (it chroots and installs packages into the tree)");
        }
        apt::ensure_installed(&[("debootstrap", "/usr/sbin/debootstrap")])?;
        fs::create_dir_all(&base).with_context(|| format!("creating {}", base.display()))?;
        let work = tempfile::Builder::new()
            .prefix(".debootstrap-")
            .tempdir_in(&base)
            .context("creating a debootstrap work directory")?;
        let target = work.path().join("root");
        let result = self.run(&target);
        // debootstrap mounts /proc, /sys and (in containers) binds device nodes into the tree;
        // they must be gone before anything deletes or moves it.
        unmount_below(&target)?;
        result?;
        clean(&target)?;
        if let Err(e) = fs::rename(&target, &dir) {
            if !dir.is_dir() {
                return Err(e).with_context(|| format!("renaming into {}", dir.display()));
            }
        }
        Ok(dir)
    }

    fn run(&self, target: &Path) -> Result<()> {
        let mut cmd = Command::new("debootstrap");
        cmd.arg(format!("--variant={}", self.variant));
        if !self.packages.is_empty() {
            cmd.arg(format!("--include={}", self.packages.join(",")));
        }
        cmd.arg(&self.suite)
            .arg(target)
            .arg(&self.mirror)
            .env("DEBIAN_FRONTEND", "noninteractive")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        eprintln!(
            "tine-image: debootstrap --variant={} {} ({} extra packages) from {}",
            self.variant,
            self.suite,
            self.packages.len(),
            self.mirror
        );
        let started = Instant::now();
        let mut child = cmd.spawn().context("running debootstrap")?;
        let stderr = child.stderr.take().expect("piped");
        let err_thread = std::thread::spawn(move || {
            BufReader::new(stderr)
                .lines()
                .map_while(Result::ok)
                .collect::<Vec<_>>()
        });
        let mut status_line = StatusLine::new(started);
        for line in BufReader::new(child.stdout.take().expect("piped"))
            .lines()
            .map_while(Result::ok)
        {
            status_line.feed(&line);
        }
        let status = child.wait().context("waiting for debootstrap")?;
        let stderr = err_thread.join().unwrap_or_default();
        if !status.success() {
            let log = target.join("debootstrap/debootstrap.log");
            let tail = fs::read_to_string(&log)
                .map(|t| last_lines(&t, 15))
                .unwrap_or_default();
            bail!(
                "debootstrap failed ({status}) after {:.0} s:\n{}\n{tail}",
                started.elapsed().as_secs_f64(),
                last_lines(&stderr.join("\n"), 10)
            );
        }
        eprintln!(
            "tine-image: debootstrap finished in {:.0} s",
            started.elapsed().as_secs_f64()
        );
        Ok(())
    }
}

/// Condenses debootstrap's per-package lines ("I: Retrieving x", "I: Unpacking y", which
/// interleave) to the first of each kind and a progress line every few seconds; everything
/// else is printed as it comes.
struct StatusLine {
    started: Instant,
    counts: BTreeMap<&'static str, u32>,
    last_print: Instant,
}

impl StatusLine {
    fn new(started: Instant) -> Self {
        StatusLine {
            started,
            counts: BTreeMap::new(),
            last_print: started,
        }
    }

    fn feed(&mut self, line: &str) {
        let secs = self.started.elapsed().as_secs();
        let stage = [
            "Retrieving",
            "Validating",
            "Extracting",
            "Unpacking",
            "Configuring",
        ]
        .into_iter()
        .find(|s| line.starts_with(&format!("I: {s} ")));
        match stage {
            Some(s) => {
                let n = self.counts.entry(s).or_default();
                *n += 1;
                if *n == 1 || self.last_print.elapsed() >= Duration::from_secs(3) {
                    self.last_print = Instant::now();
                    eprintln!(
                        "tine-image: debootstrap [{secs:>3}s] {s} #{n}: {}",
                        line.split_whitespace().nth(2).unwrap_or("")
                    );
                }
            }
            None => eprintln!("tine-image: debootstrap [{secs:>3}s] {line}"),
        }
    }
}

fn last_lines(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Frees the disk space debootstrap leaves behind (downloaded .debs); other leftovers are
/// excluded from images by the slim filter.
fn clean(root: &Path) -> Result<()> {
    let archives = root.join("var/cache/apt/archives");
    if let Ok(entries) = fs::read_dir(&archives) {
        for e in entries.flatten() {
            if e.file_name().to_string_lossy().ends_with(".deb") {
                fs::remove_file(e.path())
                    .with_context(|| format!("removing {}", e.path().display()))?;
            }
        }
    }
    Ok(())
}

/// Lazily unmounts every mount point at or below `dir`, deepest first.
fn unmount_below(dir: &Path) -> Result<()> {
    let Ok(mounts) = fs::read_to_string("/proc/self/mounts") else {
        return Ok(());
    };
    let prefix = dir.to_string_lossy().into_owned();
    let mut points: Vec<String> = mounts
        .lines()
        .filter_map(|l| l.split_whitespace().nth(1))
        // /proc/self/mounts escapes spaces as \040; our paths have none.
        .filter(|p| *p == prefix || p.starts_with(&format!("{prefix}/")))
        .map(str::to_string)
        .collect();
    points.sort_by_key(|p| std::cmp::Reverse(p.len()));
    for p in points {
        let status = Command::new("umount")
            .args(["-l", &p])
            .stdin(Stdio::null())
            .status()
            .context("running umount")?;
        if !status.success() {
            bail!("cannot unmount {p} (left by debootstrap); unmount it by hand");
        }
    }
    Ok(())
}

fn host_candidate_versions(
    suite: &str,
    packages: &[String],
) -> Result<Option<BTreeMap<String, String>>> {
    let codename = fs::read_to_string("/etc/os-release")
        .ok()
        .and_then(|t| {
            t.lines()
                .find_map(|l| l.strip_prefix("VERSION_CODENAME=").map(str::to_string))
        })
        .map(|c| c.trim_matches('"').to_string());
    if codename.as_deref() != Some(suite) {
        return Ok(None);
    }
    let mut versions = BTreeMap::new();
    for p in packages {
        match apt::candidate_version(p)? {
            Some(v) => versions.insert(p.clone(), v),
            // Unknown to the host's apt: the key cannot track this package.
            None => return Ok(None),
        };
    }
    Ok(Some(versions))
}

/// Installed package versions from a root filesystem's dpkg database (empty if it has none).
pub fn installed_packages(root: &Path) -> BTreeMap<String, String> {
    let Ok(status) = fs::read_to_string(root.join("var/lib/dpkg/status")) else {
        return BTreeMap::new();
    };
    parse_dpkg_status(&status)
}

fn parse_dpkg_status(status: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for para in status.split("\n\n") {
        let field = |name: &str| {
            para.lines()
                .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
                .map(|v| v.trim().to_string())
        };
        let installed = field("Status").is_some_and(|s| s.ends_with(" installed"));
        if let (true, Some(p), Some(v)) = (installed, field("Package"), field("Version")) {
            out.insert(p, v);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dpkg_status_lists_installed_packages_only() {
        let status = "Package: python3-numpy\nStatus: install ok installed\nVersion: 1:1.24.2-1\n\n\
                      Package: gone\nStatus: deinstall ok config-files\nVersion: 1\n\n\
                      Package: libc6\nStatus: install ok installed\nArchitecture: amd64\nVersion: 2.36-9\n";
        let got = parse_dpkg_status(status);
        assert_eq!(got.len(), 2);
        assert_eq!(got["python3-numpy"], "1:1.24.2-1");
        assert_eq!(got["libc6"], "2.36-9");
    }

    #[test]
    fn key_follows_packages_and_versions() {
        let d = |pkgs: &[&str], v: Option<&str>| Debootstrap {
            suite: "bookworm".into(),
            mirror: "http://deb.debian.org/debian".into(),
            variant: "minbase".into(),
            packages: pkgs.iter().map(|s| s.to_string()).collect(),
            versions: v.map(|v| BTreeMap::from([("python3-numpy".to_string(), v.to_string())])),
        };
        let a = d(&["python3-numpy"], Some("1:1.24.2-1"));
        assert_eq!(a.key(), a.clone().key());
        assert_ne!(a.key(), d(&["python3-numpy"], Some("1:1.24.2-2")).key());
        assert_ne!(
            a.key(),
            d(&["python3-numpy", "curl"], Some("1:1.24.2-1")).key()
        );
    }

    #[test]
    fn status_lines_are_condensed() {
        let mut s = StatusLine::new(Instant::now());
        for i in 0..5 {
            s.feed(&format!("I: Retrieving pkg{i} 1.0"));
            s.feed(&format!("I: Validating pkg{i} 1.0"));
        }
        s.feed("I: Unpacking libc6...");
        s.feed("I: Base system installed successfully.");
        assert_eq!(
            s.counts,
            BTreeMap::from([("Retrieving", 5), ("Unpacking", 1), ("Validating", 5)])
        );
    }
}
