//! Minimal busybox initramfs images.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{bail, Context, Result};

use crate::cpio::CpioWriter;
use crate::modules::ModuleIndex;

/// First word of the line the smoke init prints once userspace runs.
pub const BOOT_MARKER: &str = "TINE-BOOT-OK";

/// Where Debian's busybox-static puts its binary.
pub const DEFAULT_BUSYBOX: &str = "/bin/busybox";

/// Used when `busybox --list` cannot be run on the build host.
const FALLBACK_APPLETS: &[&str] = &[
    "sh", "ash", "cat", "chroot", "cp", "cut", "dmesg", "echo", "env", "grep", "head", "insmod",
    "ln", "ls", "lsmod", "mkdir", "mknod", "mount", "mv", "nproc", "poweroff", "printf", "reboot",
    "rm", "sed", "sleep", "sync", "tail", "test", "tr", "umount", "uname", "[",
];

/// Kernel modules to put into an initramfs, in insmod order.
#[derive(Debug, Clone)]
pub struct KernelModules {
    index: ModuleIndex,
    /// Paths relative to the modules dir, as `modules.dep` spells them.
    files: Vec<String>,
}

impl KernelModules {
    /// `names` plus their dependencies, dependencies first.
    pub fn with_dependencies(index: ModuleIndex, names: &[&str]) -> Result<KernelModules> {
        let files = index.with_dependencies(names)?;
        Ok(KernelModules { index, files })
    }

    /// Exactly `names`, in that order (the caller knows the load order).
    pub fn exact(index: ModuleIndex, names: &[&str]) -> Result<KernelModules> {
        let files = index.paths_of(names)?;
        Ok(KernelModules { index, files })
    }

    /// Absolute paths inside the initramfs, in load order (what `/init` should insmod).
    pub fn archive_paths(&self) -> Vec<String> {
        self.files
            .iter()
            .map(|f| {
                format!(
                    "/lib/modules/{}/{}",
                    self.index.release(),
                    uncompressed_name(f)
                )
            })
            .collect()
    }

    /// The kernel release these modules belong to (`uname -r`).
    pub fn release(&self) -> &str {
        self.index.release()
    }

    /// The module files (decompressed) and a matching `modules.dep`, as (archive path relative
    /// to `/`, content), in load order with `modules.dep` last.
    pub fn archive_files(&self) -> Result<Vec<(String, Vec<u8>)>> {
        let base = format!("lib/modules/{}", self.index.release());
        let mut out = Vec::with_capacity(self.files.len() + 1);
        let mut dep = String::new();
        for file in &self.files {
            let stored = uncompressed_name(file);
            let data = read_module(&self.index.dir().join(file))?;
            out.push((format!("{base}/{stored}"), data));
            dep.push_str(&format!("{stored}:"));
            for d in self.index.deps_within(file, &self.files) {
                dep.push(' ');
                dep.push_str(uncompressed_name(d));
            }
            dep.push('\n');
        }
        out.push((format!("{base}/modules.dep"), dep.into_bytes()));
        Ok(out)
    }

    /// Inputs that determine the archive content, for cache keys.
    pub fn describe(&self) -> String {
        format!("{}:{}", self.index.dir().display(), self.files.join(","))
    }
}

/// `x.ko.xz` -> `x.ko`: we store modules uncompressed because busybox insmod cannot inflate.
fn uncompressed_name(path: &str) -> &str {
    [".xz", ".zst", ".gz"]
        .iter()
        .find_map(|ext| path.strip_suffix(ext))
        .unwrap_or(path)
}

fn read_module(path: &Path) -> Result<Vec<u8>> {
    let name = path.to_string_lossy();
    let tool = if name.ends_with(".xz") {
        Some("xz")
    } else if name.ends_with(".zst") {
        Some("zstd")
    } else {
        None
    };
    if let Some(tool) = tool {
        let out = Command::new(tool)
            .arg("-dc")
            .arg(path)
            .stdin(Stdio::null())
            .output()
            .with_context(|| format!("running {tool} -dc {name}"))?;
        if !out.status.success() {
            bail!(
                "{tool} -dc {name} failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        return Ok(out.stdout);
    }
    let raw = std::fs::read(path).with_context(|| format!("reading {name}"))?;
    if name.ends_with(".gz") {
        let mut out = Vec::new();
        flate2::read::GzDecoder::new(&raw[..])
            .read_to_end(&mut out)
            .with_context(|| format!("gunzip {name}"))?;
        return Ok(out);
    }
    Ok(raw)
}

/// A busybox initramfs: `/bin/busybox` with applet symlinks, `/dev/console`, the standard mount
/// points, an `/init` script, optional kernel modules and extra files.
#[derive(Debug, Clone)]
pub struct Initramfs {
    busybox: PathBuf,
    init: String,
    modules: Option<KernelModules>,
    files: Vec<(String, u32, Vec<u8>)>,
}

impl Initramfs {
    /// An image whose `/init` is `init_script` (it should start with `#!/bin/sh`).
    pub fn new(init_script: impl Into<String>) -> Initramfs {
        Initramfs {
            busybox: PathBuf::from(DEFAULT_BUSYBOX),
            init: init_script.into(),
            modules: None,
            files: Vec::new(),
        }
    }

    /// Use this (static) busybox binary instead of [`DEFAULT_BUSYBOX`].
    pub fn busybox(mut self, path: impl Into<PathBuf>) -> Initramfs {
        self.busybox = path.into();
        self
    }

    pub fn modules(mut self, modules: KernelModules) -> Initramfs {
        self.modules = Some(modules);
        self
    }

    /// An extra regular file at absolute archive path `path`.
    pub fn file(mut self, path: &str, mode: u32, data: impl Into<Vec<u8>>) -> Initramfs {
        self.files.push((path.to_string(), mode, data.into()));
        self
    }

    /// The uncompressed `newc` archive.
    pub fn to_cpio(&self) -> Result<Vec<u8>> {
        let busybox = std::fs::read(&self.busybox)
            .with_context(|| format!("reading {}", self.busybox.display()))?;
        if !is_static_elf(&busybox) {
            bail!(
                "{} is not a static executable; install busybox-static",
                self.busybox.display()
            );
        }
        let mut w = CpioWriter::new(Vec::new());
        for dir in [
            "dev", "proc", "sys", "tmp", "run", "root", "etc", "sbin", "usr/bin",
        ] {
            w.dir(dir, 0o755)?;
        }
        w.char_device("dev/console", 0o600, 5, 1)?;
        w.char_device("dev/null", 0o666, 1, 3)?;
        w.file("bin/busybox", 0o755, &busybox)?;
        for applet in applets(&self.busybox) {
            if applet != "busybox" && !applet.contains('/') {
                w.symlink(&format!("bin/{applet}"), "busybox")?;
            }
        }
        if let Some(m) = &self.modules {
            for (path, data) in m.archive_files()? {
                w.file(&path, 0o644, &data)?;
            }
        }
        for (path, mode, data) in &self.files {
            w.file(path, *mode, data)?;
        }
        w.file("init", 0o755, self.init.as_bytes())?;
        Ok(w.finish()?)
    }

    /// Writes the gzip-compressed archive to `out` atomically (temp file, fsync, rename).
    pub fn write_gz(&self, out: &Path) -> Result<()> {
        let cpio = self.to_cpio()?;
        crate::fsutil::write_atomic(out, |f| {
            let mut gz = flate2::write::GzEncoder::new(f, flate2::Compression::default());
            gz.write_all(&cpio)?;
            gz.finish()?;
            Ok(())
        })
        .with_context(|| format!("writing {}", out.display()))
    }
}

/// Applet names the busybox binary supports; `/init` may call any of them by name.
pub(crate) fn applets(busybox: &Path) -> Vec<String> {
    let listed = Command::new(busybox)
        .arg("--list")
        .stdin(Stdio::null())
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .map(str::to_string)
                .collect::<Vec<_>>()
        })
        .filter(|l| !l.is_empty());
    listed.unwrap_or_else(|| FALLBACK_APPLETS.iter().map(|s| s.to_string()).collect())
}

pub use crate::elf::is_static_elf;

/// The static busybox, installing Debian's busybox-static if it is missing.
pub fn find_busybox() -> Result<PathBuf> {
    let path = PathBuf::from(DEFAULT_BUSYBOX);
    let ok = |p: &Path| std::fs::read(p).is_ok_and(|d| is_static_elf(&d));
    if !ok(&path) {
        crate::apt::install(&["busybox-static"])?;
        if !ok(&path) {
            bail!(
                "{DEFAULT_BUSYBOX} is still not a static busybox after installing busybox-static"
            );
        }
    }
    Ok(path)
}

/// The smoke-test `/init`: mounts the API filesystems, loads `modules` (archive paths, in
/// order), prints `TINE-BOOT-OK cpus=<online CPUs> kernel=<uname -r>` and powers off.
pub fn smoke_init_script(modules: &[String]) -> String {
    let mut s = String::from(
        r#"#!/bin/sh
# Tine smoke init: show that the kernel reached userspace, then power off.
export PATH=/bin:/sbin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
"#,
    );
    for m in modules {
        s.push_str(&format!(
            "insmod {} || echo \"tine-smoke: insmod {} failed\"\n",
            shell_quote(m),
            m.replace(['"', '$', '`', '\\'], "_")
        ));
    }
    s.push_str(
        r#"# Count the online CPU list (e.g. "0-3,6"); fall back to nproc.
cpus=0
online=$(cat /sys/devices/system/cpu/online 2>/dev/null)
IFS=,
for r in $online; do
  case $r in
    *-*) cpus=$((cpus + ${r#*-} - ${r%-*} + 1)) ;;
    ?*) cpus=$((cpus + 1)) ;;
  esac
done
unset IFS
[ "$cpus" -gt 0 ] || cpus=$(nproc)
"#,
    );
    s.push_str(&format!(
        "echo \"{BOOT_MARKER} cpus=$cpus kernel=$(uname -r)\"\nsync\npoweroff -f\n"
    ));
    s
}

/// File name of the default smoke initramfs in the cache: what `tine run` boots without
/// `--initrd`, and what `tine image initramfs` writes without `-o`.
pub const SMOKE_INITRAMFS: &str = "smoke-initramfs.cpio.gz";

/// The default smoke initramfs, `<cache>/smoke-initramfs.cpio.gz` (busybox, no modules), built
/// if missing.
pub fn smoke_initramfs(cache: &Path) -> Result<PathBuf> {
    let path = cache.join(SMOKE_INITRAMFS);
    if !path.is_file() {
        crate::cache::ensure_writable(cache, "the smoke initramfs")?;
        Initramfs::new(smoke_init_script(&[]))
            .busybox(find_busybox()?)
            .write_gz(&path)?;
    }
    Ok(path)
}

/// Quotes `s` as one POSIX shell word.
pub fn shell_quote(s: &str) -> String {
    if !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"/._-+=:,@%".contains(&b))
    {
        return s.to_string();
    }
    format!("'{}'", s.replace('\'', r"'\''"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpio::read_archive;

    fn busybox_or_skip() -> Option<PathBuf> {
        let p = PathBuf::from(DEFAULT_BUSYBOX);
        if std::fs::read(&p).is_ok_and(|d| is_static_elf(&d)) {
            Some(p)
        } else {
            eprintln!("no static {DEFAULT_BUSYBOX}; skipped");
            None
        }
    }

    #[test]
    fn quoting_survives_the_shell() {
        for s in [
            "plain",
            "with space",
            "it's",
            "$(rm -rf /)",
            "",
            "a\nb",
            "\\",
        ] {
            let out = Command::new("sh")
                .arg("-c")
                .arg(format!("printf %s {}", shell_quote(s)))
                .output()
                .unwrap();
            assert_eq!(String::from_utf8_lossy(&out.stdout), s);
        }
    }

    #[test]
    fn smoke_script_counts_cpus_like_the_kernel_lists_them() {
        // Run the counting part of the script against fake "online" lists.
        let script = smoke_init_script(&[]);
        let start = script.find("cpus=0").unwrap();
        let end = script.find("[ \"$cpus\"").unwrap();
        for (online, want) in [("0", "1"), ("0-3", "4"), ("0-1,4,6-7", "5")] {
            let body = script[start..end].replace(
                "$(cat /sys/devices/system/cpu/online 2>/dev/null)",
                &format!("'{online}'"),
            );
            let out = Command::new("sh")
                .arg("-c")
                .arg(format!("{body}echo $cpus"))
                .output()
                .unwrap();
            assert_eq!(
                String::from_utf8_lossy(&out.stdout).trim(),
                want,
                "{online}"
            );
        }
        assert!(script.contains("echo \"TINE-BOOT-OK cpus=$cpus kernel=$(uname -r)\""));
        assert!(script.trim_end().ends_with("poweroff -f"));
    }

    #[test]
    fn smoke_image_has_busybox_console_and_init() {
        let Some(bb) = busybox_or_skip() else { return };
        let cpio = Initramfs::new(smoke_init_script(&[]))
            .busybox(&bb)
            .file("/etc/hello", 0o644, "hi")
            .to_cpio()
            .unwrap();
        let entries = read_archive(&cpio).unwrap();
        let get = |n: &str| {
            entries
                .iter()
                .find(|e| e.name == n)
                .unwrap_or_else(|| panic!("{n}"))
        };
        assert_eq!(get("dev/console").rdev, (5, 1));
        assert_eq!(get("bin/sh").data, b"busybox");
        assert_eq!(get("bin/poweroff").data, b"busybox");
        assert_eq!(get("bin/busybox").data, std::fs::read(&bb).unwrap());
        assert_eq!(get("etc/hello").data, b"hi");
        assert!(String::from_utf8_lossy(&get("init").data).starts_with("#!/bin/sh"));
        assert_eq!(get("init").mode & 0o777, 0o755);
    }

    #[test]
    fn writes_gzip_that_cpio_can_list() {
        let Some(bb) = busybox_or_skip() else { return };
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("img.cpio.gz");
        Initramfs::new("#!/bin/sh\n")
            .busybox(bb)
            .write_gz(&out)
            .unwrap();
        let mut cpio = Vec::new();
        flate2::read::GzDecoder::new(std::fs::File::open(&out).unwrap())
            .read_to_end(&mut cpio)
            .unwrap();
        let names: Vec<String> = read_archive(&cpio)
            .unwrap()
            .into_iter()
            .map(|e| e.name)
            .collect();
        assert!(names.contains(&"init".to_string()));
        assert!(names.contains(&"bin/busybox".to_string()));
    }

    #[test]
    fn modules_are_copied_under_their_release_with_a_modules_dep() {
        let Some(bb) = busybox_or_skip() else { return };
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("lib/modules/6.1.0-1-test");
        std::fs::create_dir_all(dir.join("kernel/a")).unwrap();
        std::fs::write(dir.join("kernel/a/base.ko"), b"BASE").unwrap();
        let mut xz = Command::new("xz")
            .args(["-c"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        xz.stdin.take().unwrap().write_all(b"TOP").unwrap();
        std::fs::write(
            dir.join("kernel/a/top.ko.xz"),
            xz.wait_with_output().unwrap().stdout,
        )
        .unwrap();
        std::fs::write(
            dir.join("modules.dep"),
            "kernel/a/top.ko.xz: kernel/a/base.ko\nkernel/a/base.ko:\n",
        )
        .unwrap();
        let mods =
            KernelModules::with_dependencies(ModuleIndex::load(&dir).unwrap(), &["top"]).unwrap();
        assert_eq!(
            mods.archive_paths(),
            [
                "/lib/modules/6.1.0-1-test/kernel/a/base.ko",
                "/lib/modules/6.1.0-1-test/kernel/a/top.ko"
            ]
        );
        let cpio = Initramfs::new(smoke_init_script(&mods.archive_paths()))
            .busybox(bb)
            .modules(mods)
            .to_cpio()
            .unwrap();
        let entries = read_archive(&cpio).unwrap();
        let get = |n: &str| {
            entries
                .iter()
                .find(|e| e.name == n)
                .unwrap_or_else(|| panic!("{n}"))
        };
        assert_eq!(get("lib/modules/6.1.0-1-test/kernel/a/top.ko").data, b"TOP");
        assert_eq!(
            get("lib/modules/6.1.0-1-test/kernel/a/base.ko").data,
            b"BASE"
        );
        assert_eq!(
            String::from_utf8_lossy(&get("lib/modules/6.1.0-1-test/modules.dep").data),
            "kernel/a/base.ko:\nkernel/a/top.ko: kernel/a/base.ko\n"
        );
        let init = String::from_utf8_lossy(&get("init").data).into_owned();
        assert!(init.contains("insmod /lib/modules/6.1.0-1-test/kernel/a/top.ko"));
    }
}
