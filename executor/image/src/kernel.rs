//! Fetching Debian kernels into the Tine cache.
//!
//! Layout: `<cache>/kernels/<package>_<version>/` holds the unpacked package (`boot/vmlinuz-*`,
//! `lib/modules/<release>/` with a `modules.dep` we generate) plus `tine-kernel.txt`. A directory
//! only appears there by an atomic rename of a fully prepared one, so its existence means it is
//! complete.

use std::fmt;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{bail, Context, Result};

use crate::apt;

const META_FILE: &str = "tine-kernel.txt";

/// Which Debian kernel flavour.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, clap::ValueEnum)]
pub enum Flavor {
    /// `linux-image-cloud-amd64`: small, the guest (L2) kernel.
    Cloud,
    /// `linux-image-amd64`: the full kernel (a guest's, with the VM generation ID driver the
    /// cloud kernel lacks).
    Generic,
    /// The lab's L1 kernel: Debian's newest generic kernel, `linux-image-6.12-amd64` on Debian
    /// 12 (else `linux-image-amd64`); it has kvm-amd, ccp and 9p as modules. Newer than 6.1
    /// because KVM_PRE_FAULT_MEMORY (Linux 6.10) is what maps a child's working set before it
    /// runs, and the lab is where that can be seen.
    Lab,
}

impl Flavor {
    /// The Debian metapackages that track the current ABI of this flavour, preferred first.
    pub fn metapackages(self) -> &'static [&'static str] {
        match self {
            Flavor::Cloud => &["linux-image-cloud-amd64"],
            Flavor::Generic => &["linux-image-amd64"],
            Flavor::Lab => &["linux-image-6.12-amd64", "linux-image-amd64"],
        }
    }

    /// How to name the flavour's packages in messages.
    fn metapackage_names(self) -> String {
        self.metapackages().join(" or ")
    }

    fn matches_package(self, package: &str) -> bool {
        package.starts_with("linux-image-")
            && package.ends_with("-amd64")
            && package.contains("-cloud-") == (self == Flavor::Cloud)
            && !package.contains("-unsigned")
    }
}

impl fmt::Display for Flavor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Flavor::Cloud => "cloud",
            Flavor::Generic => "generic",
            Flavor::Lab => "lab",
        })
    }
}

/// An unpacked kernel in the cache.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Kernel {
    pub flavor: Flavor,
    /// e.g. `linux-image-6.1.0-56-cloud-amd64`.
    pub package: String,
    /// Debian package version, e.g. `6.1.192-2`.
    pub version: String,
    /// `uname -r` of this kernel, e.g. `6.1.0-56-cloud-amd64`.
    pub release: String,
    /// The unpacked package root.
    pub root: PathBuf,
    /// The bzImage (`boot/vmlinuz-<release>`).
    pub vmlinuz: PathBuf,
    /// `lib/modules/<release>`, with a generated `modules.dep`.
    pub modules_dir: PathBuf,
}

impl Kernel {
    /// Reads an unpacked kernel directory previously prepared by [`fetch_kernel`].
    pub fn load(root: &Path) -> Result<Kernel> {
        let meta_path = root.join(META_FILE);
        let meta = fs::read_to_string(&meta_path)
            .with_context(|| format!("reading {}", meta_path.display()))?;
        let field = |key: &str| -> Result<String> {
            meta.lines()
                .find_map(|l| l.strip_prefix(key)?.strip_prefix('=').map(str::to_string))
                .with_context(|| format!("{} lacks {key}", meta_path.display()))
        };
        let flavor = match field("flavor")?.as_str() {
            "cloud" => Flavor::Cloud,
            "generic" => Flavor::Generic,
            "lab" => Flavor::Lab,
            other => bail!("{}: unknown flavor {other:?}", meta_path.display()),
        };
        let (vmlinuz, release) = find_vmlinuz(root)?;
        let modules_dir = modules_dir(root, &release)?;
        Ok(Kernel {
            flavor,
            package: field("package")?,
            version: field("version")?,
            release,
            root: root.to_path_buf(),
            vmlinuz,
            modules_dir,
        })
    }

    /// The uncompressed ELF `vmlinux`, extracted next to the bzImage on first use.
    pub fn vmlinux(&self) -> Result<PathBuf> {
        let out = crate::bzimage::vmlinux_path(&self.vmlinuz)?;
        if !out.is_file() {
            let dir = out.parent().unwrap_or(Path::new("."));
            crate::cache::ensure_writable(dir, &format!("the vmlinux of {}", self.package))?;
            crate::bzimage::extract_vmlinux_to(&self.vmlinuz, &out)?;
        }
        Ok(out)
    }
}

fn find_vmlinuz(root: &Path) -> Result<(PathBuf, String)> {
    let boot = root.join("boot");
    for entry in fs::read_dir(&boot).with_context(|| format!("reading {}", boot.display()))? {
        let path = entry?.path();
        let name = path.file_name().unwrap_or_default().to_string_lossy();
        if let Some(release) = name.strip_prefix("vmlinuz-") {
            let release = release.to_string();
            return Ok((path, release));
        }
    }
    bail!("no vmlinuz-* in {}", boot.display())
}

fn modules_dir(root: &Path, release: &str) -> Result<PathBuf> {
    // Debian 12 ships modules under /lib, later releases under /usr/lib.
    for base in ["lib/modules", "usr/lib/modules"] {
        let dir = root.join(base).join(release);
        if dir.is_dir() {
            return Ok(dir);
        }
    }
    bail!("no lib/modules/{release} in {}", root.display())
}

/// Where the cache keeps kernels.
pub fn kernels_dir(cache: &Path) -> PathBuf {
    cache.join("kernels")
}

/// Downloads (if not cached) and unpacks the current Debian kernel of `flavor`.
pub fn fetch_kernel(flavor: Flavor, cache: &Path) -> Result<Kernel> {
    let kernels = kernels_dir(cache);
    let (package, version) = match lookup(flavor)? {
        Some(found) => found,
        None => {
            // Without package lists an already cached kernel is still good (offline use).
            if let Some(kernel) = newest_cached(flavor, &kernels)? {
                eprintln!(
                    "tine-image: apt knows no {}; using the cached {} {}",
                    flavor.metapackage_names(),
                    kernel.package,
                    kernel.version
                );
                return Ok(kernel);
            }
            apt::update()?;
            lookup(flavor)?.with_context(|| {
                format!(
                    "apt cannot resolve {} even after apt-get update",
                    flavor.metapackage_names()
                )
            })?
        }
    };
    let dir = kernels.join(cache_key(&package, &version));
    if dir.is_dir() {
        return Kernel::load(&dir);
    }
    crate::cache::ensure_writable(&kernels, &format!("kernel {package} {version}"))?;
    fs::create_dir_all(&kernels).with_context(|| format!("creating {}", kernels.display()))?;
    tracing::info!(%package, %version, "downloading kernel");
    let work = tempfile::Builder::new()
        .prefix(".download-")
        .tempdir_in(&kernels)
        .context("creating a download directory")?;
    let deb = apt::download(&package, work.path())?;
    let deb_version = apt::deb_field(&deb, "Version")?;
    if deb_version != version {
        bail!("apt-get download {package} gave version {deb_version}, expected {version}");
    }
    let root = work.path().join("root");
    apt::extract(&deb, &root)?;
    let (_, release) = find_vmlinuz(&root)?;
    let mods = modules_dir(&root, &release)?;
    depmod(&root, &mods, &release)?;
    fs::write(
        root.join(META_FILE),
        format!("flavor={flavor}\npackage={package}\nversion={version}\nrelease={release}\n"),
    )?;
    if let Err(err) = fs::rename(&root, &dir) {
        // Lost a race with another fetch of the same package: theirs is just as good.
        if !dir.is_dir() {
            return Err(err).with_context(|| format!("renaming into {}", dir.display()));
        }
    }
    Kernel::load(&dir)
}

/// The ABI package of `flavor` and its candidate version, if apt knows them.
fn lookup(flavor: Flavor) -> Result<Option<(String, String)>> {
    for meta in flavor.metapackages() {
        if let Some(package) = apt::resolve_dependency(meta, "linux-image-")? {
            if let Some(v) = apt::candidate_version(&package)? {
                return Ok(Some((package, v)));
            }
        }
    }
    Ok(None)
}

/// The most recently prepared cached kernel of `flavor`, if any.
pub fn newest_cached(flavor: Flavor, kernels: &Path) -> Result<Option<Kernel>> {
    let Ok(entries) = fs::read_dir(kernels) else {
        return Ok(None);
    };
    // A kernel fetched as this flavour first, then the newest by mtime: the lab's newer
    // kernel over a generic one cached before it, for example.
    let mut best: Option<((bool, std::time::SystemTime), Kernel)> = None;
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with('.') || !flavor.matches_package(name.split('_').next().unwrap_or("")) {
            continue;
        }
        // A package both flavours resolve to is cached once, under the first one's name.
        let Ok(kernel) = Kernel::load(&entry.path()) else {
            continue;
        };
        if kernel.flavor != flavor && flavor != Flavor::Lab {
            continue;
        }
        let mtime = entry
            .metadata()
            .and_then(|m| m.modified())
            .unwrap_or(std::time::UNIX_EPOCH);
        let rank = (kernel.flavor == flavor, mtime);
        if best.as_ref().is_none_or(|(r, _)| rank > *r) {
            best = Some((rank, kernel));
        }
    }
    Ok(best.map(|(_, k)| k))
}

/// `(major, minor)` of a kernel release such as `6.12.117+deb12-amd64`.
pub fn release_version(release: &str) -> Option<(u32, u32)> {
    let mut parts = release.split(|c: char| !c.is_ascii_digit());
    Some((parts.next()?.parse().ok()?, parts.next()?.parse().ok()?))
}

/// Directory name for a package version; `:` (epochs) is not path-friendly everywhere.
fn cache_key(package: &str, version: &str) -> String {
    format!("{package}_{}", version.replace([':', '/'], "_"))
}

/// By absolute path: it exists with and without merged /usr, and PATH may lack the sbin
/// directories (e.g. `env -i PATH=/usr/bin:/bin`).
const DEPMOD: &str = "/sbin/depmod";

/// Debian generates `modules.dep` at install time; we never install, so run depmod ourselves.
fn depmod(root: &Path, modules: &Path, release: &str) -> Result<()> {
    apt::ensure_installed(&[("kmod", DEPMOD)])?;
    // depmod -b wants <base>/lib/modules/<release>; derive <base> from where the modules are.
    let base = modules
        .parent()
        .and_then(Path::parent)
        .and_then(Path::parent)
        .unwrap_or(root);
    let out = Command::new(DEPMOD)
        .arg("-b")
        .arg(base)
        .arg(release)
        .stdin(Stdio::null())
        .output()
        .context("running depmod (package kmod)")?;
    if !out.status.success() {
        bail!(
            "depmod -b {} {release} failed: {}",
            base.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn release_versions() {
        assert_eq!(release_version("6.12.117+deb12-amd64"), Some((6, 12)));
        assert_eq!(release_version("6.1.0-56-amd64"), Some((6, 1)));
        assert_eq!(release_version("junk"), None);
    }

    #[test]
    fn flavours_recognise_their_packages() {
        assert!(Flavor::Cloud.matches_package("linux-image-6.1.0-56-cloud-amd64"));
        assert!(!Flavor::Cloud.matches_package("linux-image-6.1.0-56-amd64"));
        assert!(Flavor::Generic.matches_package("linux-image-6.1.0-56-amd64"));
        assert!(!Flavor::Generic.matches_package("linux-image-6.1.0-56-cloud-amd64"));
        assert!(!Flavor::Generic.matches_package("linux-image-6.1.0-56-amd64-unsigned"));
    }

    #[test]
    fn cache_keys_are_path_safe() {
        assert_eq!(cache_key("busybox", "1:1.35.0-4"), "busybox_1_1.35.0-4");
        assert_eq!(
            cache_key("linux-image-6.1.0-56-amd64", "6.1.192-2"),
            "linux-image-6.1.0-56-amd64_6.1.192-2"
        );
    }

    #[test]
    fn loads_a_prepared_kernel_dir() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        fs::create_dir_all(root.join("boot")).unwrap();
        fs::write(root.join("boot/vmlinuz-6.1.0-9-cloud-amd64"), b"x").unwrap();
        fs::create_dir_all(root.join("lib/modules/6.1.0-9-cloud-amd64")).unwrap();
        fs::write(
            root.join(META_FILE),
            "flavor=cloud\npackage=linux-image-6.1.0-9-cloud-amd64\nversion=6.1.1-1\n",
        )
        .unwrap();
        let k = Kernel::load(root).unwrap();
        assert_eq!(k.release, "6.1.0-9-cloud-amd64");
        assert_eq!(k.version, "6.1.1-1");
        assert_eq!(k.flavor, Flavor::Cloud);
        assert_eq!(k.modules_dir, root.join("lib/modules/6.1.0-9-cloud-amd64"));
    }
}
