//! Paths inside a guest root filesystem: validation, symlink resolution confined to the root,
//! and the exclusion patterns that keep images lean.

use std::path::{Path, PathBuf};

use anyhow::{bail, Result};

/// Components of a path given with or without a leading `/`; refuses `..`, NUL and empty paths.
pub fn components(path: &str) -> Result<Vec<String>> {
    if path.contains('\0') {
        bail!("{path:?} contains a NUL byte");
    }
    let parts: Vec<String> = path
        .split('/')
        .filter(|p| !p.is_empty() && *p != ".")
        .map(str::to_string)
        .collect();
    if parts.iter().any(|p| p == "..") {
        bail!("{path:?} contains '..'");
    }
    if parts.is_empty() {
        bail!("{path:?} names the root itself");
    }
    Ok(parts)
}

/// Like [`components`], for a path that must be absolute (`/etc/x`).
pub fn absolute(path: &str) -> Result<Vec<String>> {
    if !path.starts_with('/') {
        bail!("{path:?} must be absolute");
    }
    components(path)
}

/// Where `parts` really lives in the tree at `root`: symlinks among the leading directories are
/// followed the way the guest will follow them (absolute targets start at `root`, `..` stops at
/// `root`), so a file added at `lib/modules/...` lands in `usr/lib/modules/...` on a merged-/usr
/// system. The last component is not followed: it is the entry being added or replaced.
pub fn resolve_parent(root: &Path, parts: &[String]) -> Result<Vec<String>> {
    let Some((last, dirs)) = parts.split_last() else {
        bail!("empty path");
    };
    let mut todo: Vec<String> = dirs.iter().rev().cloned().collect();
    let mut out: Vec<String> = Vec::new();
    let mut hops = 0;
    while let Some(part) = todo.pop() {
        match part.as_str() {
            "" | "." => continue,
            ".." => {
                out.pop();
                continue;
            }
            _ => {}
        }
        let here: PathBuf = root.join(out.iter().collect::<PathBuf>()).join(&part);
        match std::fs::symlink_metadata(&here) {
            Ok(m) if m.file_type().is_symlink() => {
                hops += 1;
                if hops > 40 {
                    bail!("too many symlinks resolving {}", parts.join("/"));
                }
                let target = std::fs::read_link(&here)?;
                let target = target.to_string_lossy();
                if target.starts_with('/') {
                    out.clear();
                }
                todo.extend(target.split('/').rev().map(str::to_string));
            }
            _ => out.push(part),
        }
    }
    out.push(last.clone());
    Ok(out)
}

/// Root filesystem paths left out of images. Each pattern matches a path and everything below
/// it; `*` matches any run of characters within one component.
#[derive(Debug, Clone, Default)]
pub struct Excludes {
    patterns: Vec<Vec<String>>,
}

/// What "slim" removes: documentation, manuals, translations, and apt's package lists and
/// download cache (an image is never upgraded in place; rebuild it instead).
pub const SLIM: &[&str] = &[
    "usr/share/doc/*",
    "usr/share/man/*",
    "usr/share/info/*",
    "usr/share/locale/*",
    "usr/share/lintian/*",
    "usr/share/linda/*",
    "usr/share/bug/*",
    "var/cache/man/*",
    "var/cache/apt/*",
    "var/lib/apt/lists/*",
    "var/cache/debconf/*-old",
    "var/lib/dpkg/*-old",
    "var/log/*.log",
    "debootstrap",
];

impl Excludes {
    pub fn new(slim: bool, extra: &[String]) -> Result<Excludes> {
        let mut patterns = Vec::new();
        if slim {
            for p in SLIM {
                patterns.push(components(p)?);
            }
        }
        for p in extra {
            patterns.push(components(p)?);
        }
        Ok(Excludes { patterns })
    }

    /// `path` is relative to the root, `/`-separated.
    pub fn matches(&self, path: &str) -> bool {
        let parts: Vec<&str> = path.split('/').collect();
        self.patterns
            .iter()
            .any(|pat| pat.len() <= parts.len() && pat.iter().zip(&parts).all(|(p, c)| glob(p, c)))
    }
}

/// `*`-only wildcard match of one path component.
fn glob(pattern: &str, name: &str) -> bool {
    let Some((head, rest)) = pattern.split_once('*') else {
        return pattern == name;
    };
    let Some(mut remaining) = name.strip_prefix(head) else {
        return false;
    };
    let pieces: Vec<&str> = rest.split('*').collect();
    for (i, piece) in pieces.iter().enumerate() {
        if i == pieces.len() - 1 {
            return remaining.ends_with(piece);
        }
        match remaining.find(piece) {
            Some(at) => remaining = &remaining[at + piece.len()..],
            None => return false,
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn components_refuse_escapes() {
        assert_eq!(components("/usr//lib/./x").unwrap(), ["usr", "lib", "x"]);
        assert!(components("/a/../b").is_err());
        assert!(components("/").is_err());
        assert!(absolute("etc/x").is_err());
    }

    #[test]
    fn parents_follow_symlinks_inside_the_root_only() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        std::fs::create_dir_all(root.join("usr/lib")).unwrap();
        std::os::unix::fs::symlink("usr/lib", root.join("lib")).unwrap();
        // Absolute and climbing targets are taken relative to the image root, never the host's.
        std::os::unix::fs::symlink("/etc", root.join("usr/lib/abs")).unwrap();
        std::os::unix::fs::symlink("../../../../../../tmp", root.join("up")).unwrap();
        let r = |p: &str| {
            resolve_parent(root, &components(p).unwrap())
                .unwrap()
                .join("/")
        };
        assert_eq!(r("lib/modules/6.1/x.ko"), "usr/lib/modules/6.1/x.ko");
        assert_eq!(r("lib/abs/passwd"), "etc/passwd");
        assert_eq!(r("up/x"), "tmp/x");
        // The last component is the entry itself: not followed.
        assert_eq!(r("lib"), "lib");
    }

    #[test]
    fn symlink_loops_are_an_error() {
        let tmp = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink("b", tmp.path().join("a")).unwrap();
        std::os::unix::fs::symlink("a", tmp.path().join("b")).unwrap();
        assert!(resolve_parent(tmp.path(), &components("a/x").unwrap()).is_err());
    }

    #[test]
    fn slim_excludes_docs_but_keeps_their_directories() {
        let ex = Excludes::new(true, &["usr/lib/*.a".into()]).unwrap();
        assert!(ex.matches("usr/share/doc/python3/copyright"));
        assert!(ex.matches("usr/share/locale/de"));
        assert!(!ex.matches("usr/share/locale"));
        assert!(ex.matches("var/lib/apt/lists/deb.debian.org_InRelease"));
        assert!(ex.matches("var/cache/debconf/config.dat-old"));
        assert!(!ex.matches("var/cache/debconf/config.dat"));
        assert!(ex.matches("usr/lib/libfoo.a"));
        assert!(!ex.matches("usr/lib/libfoo.so"));
        assert!(!ex.matches("usr/lib/python3/dist-packages/numpy/__init__.py"));
        assert!(!Excludes::new(false, &[])
            .unwrap()
            .matches("usr/share/doc/x"));
    }

    #[test]
    fn glob_matches_within_a_component() {
        assert!(glob("*", "anything"));
        assert!(glob("*.log", "dpkg.log"));
        assert!(!glob("*.log", "dpkg.log.1"));
        assert!(glob("a*b*c", "aXXbYYc"));
        assert!(!glob("a*b*c", "aXXc"));
        assert!(glob("exact", "exact"));
    }
}
