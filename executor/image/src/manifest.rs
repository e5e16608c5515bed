//! `image.json`: what a built guest image contains and how to boot it, and finding images in
//! the cache (`<cache>/images/<id>/`, names in `<cache>/images/names/<name>`).

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

use crate::compress::Compression;

pub const MANIFEST_FILE: &str = "image.json";
pub const FORMAT: u32 = 1;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ImageManifest {
    pub format: u32,
    /// Hash of the build inputs; also the directory name under `<cache>/images/`.
    pub id: String,
    pub recipe: String,
    /// Hash of what the guest boots: kernel and initrd digests and the command line.
    pub content_hash: String,
    /// The kernel: the ELF vmlinux (PVH entry), or a bzImage for kernels whose payload cannot be
    /// extracted (`--kernel generic`); `path` is relative to the image directory.
    pub kernel: FileInfo,
    pub kernel_package: String,
    pub kernel_version: String,
    pub kernel_release: String,
    pub initrd: FileInfo,
    pub compression: Compression,
    /// Append to the VMM's default command line (`tine_vmm::DEFAULT_CMDLINE`).
    pub cmdline_append: String,
    /// Guest RAM to give the VM: the whole root filesystem lives in it.
    pub memory_mib: u32,
    /// Python the agent runs before it reports ready (empty: ready at once).
    pub warmup: String,
    pub agent: AgentInfo,
    pub rootfs: RootfsInfo,
    /// The inputs `id` hashes, for "why was this rebuilt?".
    pub inputs: serde_json::Value,
    /// Seconds since the Unix epoch.
    pub built_unix: u64,
    pub build_seconds: f64,
    /// The image directory this manifest was loaded from (not stored).
    #[serde(skip)]
    pub dir: PathBuf,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileInfo {
    pub path: String,
    pub sha256: String,
    pub bytes: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentInfo {
    /// Where the agent binary is in the guest; `/init` execs it.
    pub guest_path: String,
    pub config_path: String,
    /// The config file's text as written into the image.
    pub config: String,
    pub sha256: String,
    /// Modules the agent loads at boot (dependencies resolved in the guest from modules.dep).
    pub modules: Vec<String>,
    /// Module files shipped in the image, in load order.
    pub module_files: Vec<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RootfsInfo {
    /// "none", "debootstrap <suite> ...", "dir <path>" or "tarball <path>".
    pub source: String,
    /// Installed Debian packages and versions, when the tree has a dpkg database.
    pub packages: BTreeMap<String, String>,
    pub files: u64,
    pub file_bytes: u64,
    /// Size of the uncompressed cpio: what the guest's RAM holds after unpacking.
    pub unpacked_bytes: u64,
    pub excluded_entries: u64,
    pub excluded_bytes: u64,
}

impl ImageManifest {
    pub fn kernel_path(&self) -> PathBuf {
        self.dir.join(&self.kernel.path)
    }

    pub fn initrd_path(&self) -> PathBuf {
        self.dir.join(&self.initrd.path)
    }

    /// Reads `<dir>/image.json` and checks that the files it names are there.
    pub fn load(dir: &Path) -> Result<ImageManifest> {
        let path = dir.join(MANIFEST_FILE);
        let text =
            fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
        let mut m: ImageManifest =
            serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
        if m.format != FORMAT {
            bail!(
                "{}: image format {} (this tine reads {FORMAT}); rebuild the image",
                path.display(),
                m.format
            );
        }
        m.dir = dir.to_path_buf();
        for (what, file) in [("kernel", &m.kernel.path), ("initrd", &m.initrd.path)] {
            // The files an image boots are its own: a plain name in its directory, a regular
            // file there (not a link to somewhere else on the host).
            let plain = Path::new(file)
                .components()
                .map(|c| matches!(c, std::path::Component::Normal(_)))
                .collect::<Vec<_>>()
                == [true];
            if !plain {
                bail!(
                    "{}: the {what} {file:?} is not a file name in the image directory",
                    path.display()
                );
            }
            let f = dir.join(file);
            match fs::symlink_metadata(&f) {
                Ok(meta) if meta.file_type().is_file() => {}
                Ok(_) => bail!(
                    "{}: the {what} {} is not a regular file",
                    path.display(),
                    f.display()
                ),
                Err(_) => bail!("{}: {} is missing", path.display(), f.display()),
            }
        }
        Ok(m)
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("manifest serializes") + "\n"
    }
}

pub fn images_dir(cache: &Path) -> PathBuf {
    cache.join("images")
}

pub fn names_dir(cache: &Path) -> PathBuf {
    images_dir(cache).join("names")
}

/// How a caller names an image.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ImageRef {
    /// A name, id or unique id prefix in the image store, and nothing else: what a remote
    /// caller may name (it never reaches a directory elsewhere on the host).
    Stored(String),
    /// That, or an image directory (or its image.json) on this machine: the local CLI's
    /// `--image`, given with the caller's own rights.
    Local(String),
}

impl std::fmt::Display for ImageRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ImageRef::Stored(s) | ImageRef::Local(s) => f.write_str(s),
        }
    }
}

/// The image `r` names in the image cache `cache`.
pub fn load_image(cache: &Path, r: &ImageRef) -> Result<ImageManifest> {
    match r {
        ImageRef::Local(s) => load_image_in(cache, s),
        ImageRef::Stored(s) => load_stored_image(cache, s),
    }
}

/// An image by name, id or unique id prefix in the image cache `cache` only: never a path,
/// and never anything that resolves outside the cache's images directory.
pub fn load_stored_image(cache: &Path, name: &str) -> Result<ImageManifest> {
    if name.is_empty()
        || name.contains('/')
        || name.starts_with('.')
        || name.chars().any(char::is_control)
    {
        bail!("image {name:?}: not an image name or id (names hold no '/' and start with no '.')");
    }
    let m = stored_image(cache, name)?;
    let images = images_dir(cache);
    let images = images
        .canonicalize()
        .with_context(|| format!("resolving {}", images.display()))?;
    let dir = m
        .dir
        .canonicalize()
        .with_context(|| format!("resolving {}", m.dir.display()))?;
    if dir.parent() != Some(images.as_path()) {
        bail!(
            "image {name:?} resolves to {}, outside the image store {}",
            dir.display(),
            images.display()
        );
    }
    Ok(m)
}

/// An image by directory (or its image.json), id, unique id prefix or name, in the image cache
/// `cache` (the caller's configuration: `tine` resolves `$TINE_CACHE_DIR` at its edge).
pub fn load_image_in(cache: &Path, dir_or_hash: &str) -> Result<ImageManifest> {
    let as_path = Path::new(dir_or_hash);
    if as_path.join(MANIFEST_FILE).is_file() {
        return ImageManifest::load(as_path);
    }
    if as_path.file_name().is_some_and(|n| n == MANIFEST_FILE) && as_path.is_file() {
        return ImageManifest::load(as_path.parent().unwrap_or(Path::new(".")));
    }
    stored_image(cache, dir_or_hash)
}

/// An image by name, id or unique id prefix in `cache`.
fn stored_image(cache: &Path, dir_or_hash: &str) -> Result<ImageManifest> {
    let images = images_dir(cache);
    let named = names_dir(cache).join(dir_or_hash);
    if !dir_or_hash.contains('/') && named.join(MANIFEST_FILE).is_file() {
        let target = named
            .canonicalize()
            .with_context(|| format!("resolving {}", named.display()))?;
        return ImageManifest::load(&target);
    }
    let is_hex = !dir_or_hash.is_empty() && dir_or_hash.bytes().all(|b| b.is_ascii_hexdigit());
    if is_hex {
        let mut found: Vec<PathBuf> = fs::read_dir(&images)
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with(dir_or_hash))
            .map(|e| e.path())
            .filter(|p| p.join(MANIFEST_FILE).is_file())
            .collect();
        found.sort();
        match found.len() {
            1 => return ImageManifest::load(&found[0]),
            0 => {}
            n => bail!(
                "{n} images in {} start with {dir_or_hash:?}; give more of the id",
                images.display()
            ),
        }
    }
    bail!(
        "no image {dir_or_hash:?}: not an image directory, nor an id or name in {} (see `tine image list`)",
        images.display()
    )
}

/// Every image in the cache, with the names pointing at it; oldest first.
pub fn list_images(cache: &Path) -> Result<Vec<(ImageManifest, Vec<String>)>> {
    let images = images_dir(cache);
    let mut names: BTreeMap<PathBuf, Vec<String>> = BTreeMap::new();
    for e in fs::read_dir(names_dir(cache))
        .into_iter()
        .flatten()
        .flatten()
    {
        if let Ok(target) = e.path().canonicalize() {
            names
                .entry(target)
                .or_default()
                .push(e.file_name().to_string_lossy().into_owned());
        }
    }
    let mut out = Vec::new();
    for e in fs::read_dir(&images).into_iter().flatten().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with('.') || name == "names" {
            continue;
        }
        match ImageManifest::load(&e.path()) {
            Ok(m) => {
                let n = e
                    .path()
                    .canonicalize()
                    .ok()
                    .and_then(|p| names.get(&p).cloned())
                    .unwrap_or_default();
                out.push((m, n));
            }
            Err(err) => eprintln!("tine-image: skipping {}: {err:#}", e.path().display()),
        }
    }
    out.sort_by(|a, b| {
        a.0.built_unix
            .cmp(&b.0.built_unix)
            .then(a.0.id.cmp(&b.0.id))
    });
    Ok(out)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn sample(id: &str) -> ImageManifest {
        ImageManifest {
            format: FORMAT,
            id: id.into(),
            recipe: "busybox".into(),
            content_hash: "c0ffee".into(),
            kernel: FileInfo {
                path: "vmlinux".into(),
                sha256: "aa".into(),
                bytes: 3,
            },
            kernel_package: "linux-image-6.1.0-56-cloud-amd64".into(),
            kernel_version: "6.1.192-2".into(),
            kernel_release: "6.1.0-56-cloud-amd64".into(),
            initrd: FileInfo {
                path: "initrd.cpio.zst".into(),
                sha256: "bb".into(),
                bytes: 4,
            },
            compression: Compression::Zstd,
            cmdline_append: "quiet".into(),
            memory_mib: 256,
            warmup: "import numpy".into(),
            agent: AgentInfo {
                guest_path: "/usr/sbin/tine-agent".into(),
                config_path: "/etc/tine/agent.conf".into(),
                config: "modules = virtio_mmio\n".into(),
                sha256: "cc".into(),
                modules: vec!["virtio_mmio".into()],
                module_files: vec!["kernel/drivers/virtio/virtio_mmio.ko".into()],
            },
            rootfs: RootfsInfo {
                source: "none".into(),
                packages: BTreeMap::from([("libc6".into(), "2.36-9".into())]),
                ..Default::default()
            },
            inputs: serde_json::json!({"builder": 1}),
            built_unix: 1_700_000_000,
            build_seconds: 1.5,
            dir: PathBuf::new(),
        }
    }

    fn install(cache: &Path, m: &ImageManifest) -> PathBuf {
        let dir = images_dir(cache).join(&m.id);
        fs::create_dir_all(&dir).unwrap();
        fs::write(dir.join("vmlinux"), "k").unwrap();
        fs::write(dir.join("initrd.cpio.zst"), "i").unwrap();
        fs::write(dir.join(MANIFEST_FILE), m.to_json()).unwrap();
        dir
    }

    #[test]
    fn manifest_round_trips() {
        let tmp = tempfile::tempdir().unwrap();
        let m = sample("0123abcd");
        let dir = install(tmp.path(), &m);
        let back = ImageManifest::load(&dir).unwrap();
        assert_eq!(back.dir, dir);
        assert_eq!(
            ImageManifest {
                dir: PathBuf::new(),
                ..back.clone()
            },
            m
        );
        assert_eq!(back.kernel_path(), dir.join("vmlinux"));
        assert_eq!(back.initrd_path(), dir.join("initrd.cpio.zst"));
        let json: serde_json::Value = serde_json::from_str(&m.to_json()).unwrap();
        assert_eq!(json["compression"], "zstd");
        assert!(json.get("dir").is_none());
    }

    #[test]
    fn images_are_found_by_dir_id_prefix_and_name() {
        let tmp = tempfile::tempdir().unwrap();
        let cache = tmp.path();
        let a = install(cache, &sample("0123abcd"));
        install(cache, &sample("0199ffff"));
        fs::create_dir_all(names_dir(cache)).unwrap();
        std::os::unix::fs::symlink("../0123abcd", names_dir(cache).join("bb")).unwrap();
        let id = |s: &str| load_image_in(cache, s).map(|m| m.id);
        assert_eq!(id(a.to_str().unwrap()).unwrap(), "0123abcd");
        assert_eq!(
            id(a.join(MANIFEST_FILE).to_str().unwrap()).unwrap(),
            "0123abcd"
        );
        assert_eq!(id("0123").unwrap(), "0123abcd");
        assert_eq!(id("bb").unwrap(), "0123abcd");
        assert!(id("01").unwrap_err().to_string().contains("2 images"));
        assert!(id("nope").unwrap_err().to_string().contains("no image"));

        // From the store only: names and ids, never a path, never out of the store.
        let stored = |s: &str| load_stored_image(cache, s).map(|m| m.id);
        assert_eq!(stored("bb").unwrap(), "0123abcd");
        assert_eq!(stored("0123").unwrap(), "0123abcd");
        for path in [
            a.to_str().unwrap(),
            "../images/0123abcd",
            ".",
            "..",
            "a/b",
            "",
        ] {
            assert!(stored(path).is_err(), "{path:?} was resolved");
        }
        let elsewhere = install(tmp.path(), &sample("feedbeef"));
        let outside = tmp.path().join("outside");
        fs::rename(&elsewhere, &outside).unwrap();
        std::os::unix::fs::symlink(&outside, names_dir(cache).join("escape")).unwrap();
        assert_eq!(id("escape").unwrap(), "feedbeef");
        let err = stored("escape").unwrap_err().to_string();
        assert!(err.contains("outside the image store"), "{err}");
        let listed = list_images(cache).unwrap();
        assert_eq!(listed.len(), 2);
        assert_eq!(listed[0].1, ["bb"]);
    }

    #[test]
    fn an_image_boots_only_files_of_its_own_directory() {
        let tmp = tempfile::tempdir().unwrap();
        fs::write(tmp.path().join("secret"), b"host file").unwrap();
        for kernel in ["../secret", "/etc/passwd", "sub/vmlinux", ""] {
            let mut m = sample(&format!("k{}", kernel.len()));
            m.kernel.path = kernel.into();
            let dir = install(tmp.path(), &m);
            let err = ImageManifest::load(&dir).unwrap_err().to_string();
            assert!(err.contains("not a file name"), "{kernel:?}: {err}");
        }
        let dir = install(tmp.path(), &sample("ee"));
        fs::remove_file(dir.join("vmlinux")).unwrap();
        std::os::unix::fs::symlink(tmp.path().join("secret"), dir.join("vmlinux")).unwrap();
        let err = ImageManifest::load(&dir).unwrap_err().to_string();
        assert!(err.contains("not a regular file"), "{err}");
    }

    #[test]
    fn missing_files_and_other_formats_are_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = install(tmp.path(), &sample("ab"));
        fs::remove_file(dir.join("vmlinux")).unwrap();
        assert!(ImageManifest::load(&dir)
            .unwrap_err()
            .to_string()
            .contains("missing"));
        let mut m = sample("cd");
        m.format = 99;
        let dir = install(tmp.path(), &m);
        assert!(ImageManifest::load(&dir)
            .unwrap_err()
            .to_string()
            .contains("rebuild"));
    }
}
