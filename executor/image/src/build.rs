//! `tine image build`: recipe + kernel + busybox + agent (+ root filesystem) -> a guest image in
//! `<cache>/images/<id>/` (`vmlinux`, `initrd.cpio.*`, `image.json`).
//!
//! `id` hashes the inputs, so an unchanged recipe with the same kernel, agent, busybox and
//! package versions finds its image without building anything. Images are assembled in a
//! temporary directory next to their final place and renamed into it, so a directory with an
//! `image.json` is always complete.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context, Result};
use serde::Serialize;
use sha2::{Digest, Sha256};

use crate::compress::Compression;
use crate::elf::check_static_x86_64;
use crate::guestpath::Excludes;
use crate::initramfs::{find_busybox, KernelModules};
use crate::manifest::{self, AgentInfo, FileInfo, ImageManifest, RootfsInfo};
use crate::modules::ModuleIndex;
use crate::recipe::{Recipe, RootfsSource};
use crate::rootfs::{self, file_sha256};
use crate::{fetch_kernel, guest, Flavor};

/// Bump when the builder would produce a different image from the same inputs.
pub const BUILDER_VERSION: u32 = 2;

const MIB: u64 = 1 << 20;

#[derive(Debug, Clone)]
pub struct BuildOptions {
    pub recipe: Recipe,
    /// Replaces the recipe's root filesystem: a directory or a tarball.
    pub rootfs: Option<PathBuf>,
    /// Points `<cache>/images/names/<name>` at the image (default: the recipe name).
    pub name: Option<String>,
    pub cache: PathBuf,
    /// The static tine-agent binary (a build artifact, see [`crate::agent`]).
    pub agent: PathBuf,
    /// Static busybox (default: /bin/busybox from busybox-static, installed if missing).
    pub busybox: Option<PathBuf>,
    /// Overrides the recipe's compression.
    pub compression: Option<Compression>,
    /// Build even if an image with the same inputs exists (replacing it).
    pub rebuild: bool,
    /// The guest kernel's flavour (part of the image's id through the kernel package).
    pub kernel: Flavor,
}

impl BuildOptions {
    pub fn new(recipe: Recipe, cache: PathBuf, agent: PathBuf) -> BuildOptions {
        BuildOptions {
            recipe,
            rootfs: None,
            name: None,
            cache,
            agent,
            busybox: None,
            compression: None,
            rebuild: false,
            kernel: Flavor::Cloud,
        }
    }
}

#[derive(Debug, Clone)]
pub struct BuiltImage {
    pub manifest: ImageManifest,
    /// True if an existing image with the same inputs was returned.
    pub reused: bool,
}

/// Everything the image id depends on.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CacheInputs {
    pub builder: u32,
    pub recipe: Recipe,
    /// sha256 of each extra file's content, by guest path.
    pub files: Vec<(String, String)>,
    pub rootfs: serde_json::Value,
    pub kernel_package: String,
    pub kernel_version: String,
    pub module_files: Vec<String>,
    pub agent_sha256: String,
    pub busybox_sha256: String,
    pub compression: Compression,
}

impl CacheInputs {
    pub fn id(&self) -> String {
        let json = serde_json::to_vec(self).expect("inputs serialize");
        hex::encode(&Sha256::digest(&json)[..16])
    }
}

/// Builds (or finds) the image described by `opts`.
pub fn build_image(opts: &BuildOptions) -> Result<BuiltImage> {
    let started = Instant::now();
    let mut recipe = opts.recipe.clone();
    if let Some(path) = &opts.rootfs {
        recipe.rootfs = Some(rootfs::source_from_path(path)?);
    }
    // Spelled out, so "default" and an explicit zstd give the same id.
    let compression = opts.compression.or(recipe.compression).unwrap_or_default();
    recipe.compression = Some(compression);
    let name = opts.name.clone().unwrap_or_else(|| recipe.name.clone());
    check_name(&name)?;
    // Before any download: a missing or dynamic agent should fail at once.
    let agent_data = crate::agent::read_agent(&opts.agent)?;

    let kernel = fetch_kernel(opts.kernel, &opts.cache).context("fetching the guest kernel")?;
    // The cloud kernel boots as its ELF vmlinux (PVH entry). Debian's generic kernel packs its
    // payload with xz, which the extractor does not read: it boots as the bzImage (the VMM's
    // 64-bit boot protocol).
    let (kernel_file, kernel_name) = match opts.kernel {
        Flavor::Cloud => (kernel.vmlinux().context("extracting vmlinux")?, "vmlinux"),
        Flavor::Generic | Flavor::Lab => (kernel.vmlinuz.clone(), "bzImage"),
    };
    let module_names = guest::module_names(&recipe);
    let names: Vec<&str> = module_names.iter().map(String::as_str).collect();
    let modules = KernelModules::with_dependencies(ModuleIndex::load(&kernel.modules_dir)?, &names)
        .context("resolving the guest's kernel modules")?;

    let busybox = match &opts.busybox {
        Some(b) => b.clone(),
        None => find_busybox()?,
    };
    let busybox_data = read_static(&busybox, "busybox (install busybox-static)")?;

    let files = recipe
        .files
        .iter()
        .map(|f| {
            Ok((
                f.path.clone(),
                hex::encode(Sha256::digest(recipe.file_content(f)?)),
            ))
        })
        .collect::<Result<Vec<_>>>()?;
    let inputs = CacheInputs {
        builder: BUILDER_VERSION,
        recipe: recipe.clone(),
        files,
        rootfs: rootfs::cache_key(recipe.rootfs.as_ref())?,
        kernel_package: kernel.package.clone(),
        kernel_version: kernel.version.clone(),
        module_files: modules.archive_paths(),
        agent_sha256: hex::encode(Sha256::digest(&agent_data)),
        busybox_sha256: hex::encode(Sha256::digest(&busybox_data)),
        compression,
    };
    let id = inputs.id();
    let images = manifest::images_dir(&opts.cache);
    let dir = images.join(&id);
    if !opts.rebuild && dir.join(manifest::MANIFEST_FILE).is_file() {
        if let Ok(m) = ImageManifest::load(&dir) {
            set_name(&opts.cache, &name, &id)?;
            return Ok(BuiltImage {
                manifest: m,
                reused: true,
            });
        }
    }
    crate::cache::ensure_writable(&images, &format!("image {name} ({id})"))?;
    fs::create_dir_all(&images).with_context(|| format!("creating {}", images.display()))?;
    let work = tempfile::Builder::new()
        .prefix(".build-")
        .tempdir_in(&images)
        .context("creating a build directory")?;

    let mut prepared = rootfs::prepare(recipe.rootfs.as_ref(), &opts.cache, work.path())?;
    let (config, warmup_file) = guest::agent_config(&recipe, &module_names)?;
    let builtin = fs::read(kernel.modules_dir.join("modules.builtin")).ok();
    let overlay = guest::overlay(
        &recipe,
        prepared.root.as_deref(),
        &guest::GuestFiles {
            busybox: &busybox,
            busybox_data: &busybox_data,
            agent_data: &agent_data,
            modules: &modules,
            modules_builtin: builtin,
            config: &config,
            warmup_file: warmup_file.as_deref(),
        },
    )?;
    let excludes = Excludes::new(recipe.slim, &recipe.exclude)?;

    let cpio_path = work.path().join("initrd.cpio");
    let out = crate::progress::ProgressWriter::new(
        std::io::BufWriter::with_capacity(
            1 << 20,
            fs::File::create(&cpio_path)
                .with_context(|| format!("creating {}", cpio_path.display()))?,
        ),
        "writing cpio",
    );
    let (out, stats) =
        crate::tree::write_archive(prepared.root.as_deref(), &excludes, &overlay, out)?;
    let unpacked_bytes = out.written();
    out.finish()?
        .into_inner()
        .map_err(|e| e.into_error())?
        .sync_all()?;
    let packages = std::mem::take(&mut prepared.packages);
    drop(prepared);

    let initrd_path = work.path().join(compression.file_name());
    if compression != Compression::None {
        compression.compress_file(&cpio_path, &initrd_path)?;
        fs::remove_file(&cpio_path)?;
    }
    let kernel_dst = work.path().join(kernel_name);
    // A hard link keeps the image self-contained without a second copy of the kernel.
    if fs::hard_link(&kernel_file, &kernel_dst).is_err() {
        fs::copy(&kernel_file, &kernel_dst)
            .with_context(|| format!("copying {}", kernel_file.display()))?;
    }
    let kernel_info = file_info(&kernel_dst)?;
    let initrd_info = file_info(&initrd_path)?;
    let memory_mib = recommended_memory_mib(recipe.memory_mib, initrd_info.bytes, unpacked_bytes);
    if memory_mib > recipe.memory_mib {
        eprintln!(
            "tine-image: recipe asks for {} MiB but the root filesystem needs {memory_mib} MiB; \
             recommending {memory_mib} MiB",
            recipe.memory_mib
        );
    }
    let content_hash = hex::encode(Sha256::digest(
        format!(
            "{}\n{}\n{}\n",
            kernel_info.sha256, initrd_info.sha256, recipe.cmdline
        )
        .as_bytes(),
    ));
    let m = ImageManifest {
        format: manifest::FORMAT,
        id: id.clone(),
        recipe: recipe.name.clone(),
        content_hash,
        kernel: kernel_info,
        kernel_package: kernel.package.clone(),
        kernel_version: kernel.version.clone(),
        kernel_release: kernel.release.clone(),
        initrd: initrd_info,
        compression,
        cmdline_append: recipe.cmdline.clone(),
        memory_mib,
        warmup: recipe.agent.warmup.trim().to_string(),
        agent: AgentInfo {
            guest_path: guest::AGENT_GUEST_PATH.into(),
            config_path: tine_agent::config::DEFAULT_PATH.into(),
            config,
            sha256: inputs.agent_sha256.clone(),
            modules: module_names,
            module_files: modules.archive_paths(),
        },
        rootfs: RootfsInfo {
            source: describe_source(recipe.rootfs.as_ref()),
            packages,
            files: stats.files,
            file_bytes: stats.file_bytes,
            unpacked_bytes,
            excluded_entries: stats.excluded_entries,
            excluded_bytes: stats.excluded_bytes,
        },
        inputs: serde_json::to_value(&inputs)?,
        built_unix: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
        build_seconds: (started.elapsed().as_secs_f64() * 10.0).round() / 10.0,
        dir: PathBuf::new(),
    };
    fs::write(work.path().join(manifest::MANIFEST_FILE), m.to_json())?;
    if stats.skipped_special > 0 {
        eprintln!(
            "tine-image: left out {} block devices/FIFOs/sockets (devtmpfs provides /dev)",
            stats.skipped_special
        );
    }
    install(work, &dir, opts.rebuild)?;
    set_name(&opts.cache, &name, &id)?;
    Ok(BuiltImage {
        manifest: ImageManifest::load(&dir)?,
        reused: false,
    })
}

/// Guest RAM for an image. The kernel unpacks the initramfs into a tmpfs capped at half of
/// RAM, and the compressed initrd sits in RAM until it is unpacked; 192 MiB on top covers the
/// kernel, the agent, the warm interpreter and about 100 MiB of free space in `/`.
/// Rounded up to 64 MiB.
pub fn recommended_memory_mib(recipe_mib: u32, initrd_bytes: u64, unpacked_bytes: u64) -> u32 {
    let need = (2 * unpacked_bytes + initrd_bytes).div_ceil(MIB) + 192;
    let need = need.div_ceil(64) * 64;
    recipe_mib.max(need.min(u32::MAX as u64) as u32)
}

fn describe_source(source: Option<&RootfsSource>) -> String {
    match source {
        None => "none".into(),
        Some(RootfsSource::Debootstrap {
            suite,
            variant,
            packages,
            ..
        }) => format!(
            "debootstrap --variant={variant} {suite} + {}",
            packages.join(",")
        ),
        Some(RootfsSource::Dir { path }) => format!("dir {}", path.display()),
        Some(RootfsSource::Tarball { path }) => format!("tarball {}", path.display()),
    }
}

fn read_static(path: &Path, what: &str) -> Result<Vec<u8>> {
    let data = fs::read(path).with_context(|| format!("reading {what} at {}", path.display()))?;
    if let Err(problem) = check_static_x86_64(&data) {
        bail!(
            "{} is not a static x86_64 executable ({problem}); the guest has no dynamic loader \
             for {what}",
            path.display()
        );
    }
    Ok(data)
}

fn file_info(path: &Path) -> Result<FileInfo> {
    Ok(FileInfo {
        path: path
            .file_name()
            .context("file without a name")?
            .to_string_lossy()
            .into_owned(),
        sha256: file_sha256(path)?,
        bytes: fs::metadata(path)?.len(),
    })
}

/// Renames the finished build into place. With `replace`, an existing image is moved aside
/// first; otherwise an image that appeared meanwhile (a concurrent build) wins.
fn install(work: tempfile::TempDir, dir: &Path, replace: bool) -> Result<()> {
    let parent = dir.parent().context("image dir has no parent")?;
    let mut old = None;
    if replace && dir.exists() {
        let trash = tempfile::Builder::new()
            .prefix(".old-")
            .tempdir_in(parent)?;
        fs::rename(dir, trash.path().join("image"))
            .with_context(|| format!("moving the old {} aside", dir.display()))?;
        old = Some(trash);
    }
    let path = work.keep();
    if let Err(e) = fs::rename(&path, dir) {
        let _ = fs::remove_dir_all(&path);
        if !dir.join(manifest::MANIFEST_FILE).is_file() {
            return Err(e).with_context(|| format!("renaming into {}", dir.display()));
        }
    }
    drop(old);
    Ok(())
}

fn check_name(name: &str) -> Result<()> {
    if name.is_empty()
        || name.starts_with('.')
        || !name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
    {
        bail!("image name {name:?}: use letters, digits, '.', '_' and '-'");
    }
    Ok(())
}

/// Points `<cache>/images/names/<name>` at image `id` (atomically replacing an older target).
fn set_name(cache: &Path, name: &str, id: &str) -> Result<()> {
    let names = manifest::names_dir(cache);
    fs::create_dir_all(&names).with_context(|| format!("creating {}", names.display()))?;
    let tmp = names.join(format!(".{name}.{}", std::process::id()));
    let _ = fs::remove_file(&tmp);
    std::os::unix::fs::symlink(format!("../{id}"), &tmp)?;
    fs::rename(&tmp, names.join(name)).with_context(|| format!("naming image {name}"))?;
    Ok(())
}

/// Copies (hard-links where possible) an image directory to `out`, e.g. for shipping it.
pub fn export_image(m: &ImageManifest, out: &Path) -> Result<()> {
    fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    for name in [
        m.kernel.path.as_str(),
        m.initrd.path.as_str(),
        manifest::MANIFEST_FILE,
    ] {
        let (src, dst) = (m.dir.join(name), out.join(name));
        let _ = fs::remove_file(&dst);
        if fs::hard_link(&src, &dst).is_err() {
            fs::copy(&src, &dst).with_context(|| format!("copying {}", src.display()))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inputs() -> CacheInputs {
        CacheInputs {
            builder: BUILDER_VERSION,
            recipe: Recipe::resolve("python-numpy").unwrap(),
            files: vec![("/etc/x".into(), "ab".into())],
            rootfs: serde_json::json!({"kind": "none"}),
            kernel_package: "linux-image-6.1.0-56-cloud-amd64".into(),
            kernel_version: "6.1.192-2".into(),
            module_files: vec!["/lib/modules/r/virtio_mmio.ko".into()],
            agent_sha256: "a".repeat(64),
            busybox_sha256: "b".repeat(64),
            compression: Compression::Zstd,
        }
    }

    #[test]
    fn id_is_stable_and_ignores_recipe_formatting() {
        let a = inputs();
        assert_eq!(a.id(), inputs().id());
        assert_eq!(a.id().len(), 32);
        // The same recipe written differently (comments, order, defaults spelled out).
        let mut b = inputs();
        b.recipe = Recipe::parse(
            &format!(
                "# reformatted\nslim = true\n{}",
                crate::recipe::BUILTIN[1].1
            ),
            None,
        )
        .unwrap();
        assert_eq!(a.id(), b.id());
    }

    type Change = Box<dyn Fn(&mut CacheInputs)>;

    #[test]
    fn id_changes_with_every_input() {
        let base = inputs().id();
        let changes: Vec<Change> = vec![
            Box::new(|i| i.builder += 1),
            Box::new(|i| i.recipe.agent.warmup = "import scipy".into()),
            Box::new(|i| i.recipe.memory_mib += 64),
            Box::new(|i| i.recipe.cmdline.push_str(" debug")),
            Box::new(|i| i.files[0].1 = "cd".into()),
            Box::new(|i| i.rootfs = serde_json::json!({"kind": "tarball", "sha256": "00"})),
            Box::new(|i| i.kernel_version = "6.1.193-1".into()),
            Box::new(|i| i.module_files.push("/lib/modules/r/x.ko".into())),
            Box::new(|i| i.agent_sha256 = "c".repeat(64)),
            Box::new(|i| i.busybox_sha256 = "d".repeat(64)),
            Box::new(|i| i.compression = Compression::Gzip),
        ];
        let mut seen = std::collections::HashSet::from([base.clone()]);
        for (n, change) in changes.iter().enumerate() {
            let mut i = inputs();
            change(&mut i);
            assert!(seen.insert(i.id()), "change {n} did not give a new id");
        }
    }

    #[test]
    fn memory_covers_the_unpacked_root_twice() {
        // Bare image: the recipe's figure stands.
        assert_eq!(recommended_memory_mib(256, 2 * MIB, 5 * MIB), 256);
        // 170 MiB of files (python-numpy): 2 x 170 + 47 + 192 = 579 -> 640.
        assert_eq!(recommended_memory_mib(512, 47 * MIB, 170 * MIB), 640);
    }

    #[test]
    fn names_are_checked() {
        assert!(check_name("python-numpy").is_ok());
        assert!(check_name("../x").is_err());
        assert!(check_name(".hidden").is_err());
    }
}
