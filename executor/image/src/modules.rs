//! Kernel module lookup through `modules.dep` (which [`crate::fetch_kernel`] generates).

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

/// The modules of one unpacked kernel, indexed by module name.
#[derive(Debug, Clone)]
pub struct ModuleIndex {
    dir: PathBuf,
    release: String,
    /// name -> (path relative to `dir`, dependency paths as modules.dep lists them)
    entries: HashMap<String, (String, Vec<String>)>,
    /// Names built into the kernel (`modules.builtin`): nothing to load. Newer kernels build
    /// in what older ones shipped as modules (Debian's 6.12 has virtio_pci built in).
    builtin: std::collections::HashSet<String>,
}

/// `kernel/arch/x86/kvm/kvm-amd.ko.xz` -> `kvm_amd` (the kernel treats `-` and `_` alike).
pub fn module_name(path: &str) -> String {
    let base = path.rsplit('/').next().unwrap_or(path);
    let stem = base.split(".ko").next().unwrap_or(base);
    stem.replace('-', "_")
}

impl ModuleIndex {
    /// Reads `<modules_dir>/modules.dep`; `modules_dir` is `.../lib/modules/<release>`.
    pub fn load(modules_dir: &Path) -> Result<ModuleIndex> {
        let dep_file = modules_dir.join("modules.dep");
        let text = fs::read_to_string(&dep_file)
            .with_context(|| format!("reading {} (run depmod?)", dep_file.display()))?;
        let release = modules_dir
            .file_name()
            .context("modules dir has no name")?
            .to_string_lossy()
            .into_owned();
        // Optional: a kernel without the file simply has nothing built in we know of.
        let builtin = fs::read_to_string(modules_dir.join("modules.builtin"))
            .map(|t| t.lines().map(module_name).collect())
            .unwrap_or_default();
        Ok(ModuleIndex {
            dir: modules_dir.to_path_buf(),
            release,
            entries: parse_modules_dep(&text),
            builtin,
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn release(&self) -> &str {
        &self.release
    }

    /// Path (relative to the modules dir) of module `name`.
    pub fn path_of(&self, name: &str) -> Option<&str> {
        self.entries
            .get(&name.replace('-', "_"))
            .map(|(p, _)| p.as_str())
    }

    /// Whether `name` is built into the kernel rather than a loadable module.
    pub fn is_builtin(&self, name: &str) -> bool {
        self.builtin.contains(&name.replace('-', "_"))
    }

    /// Paths of `names` in the given order, without adding dependencies, skipping the ones
    /// built into the kernel; errors on names that are neither.
    pub fn paths_of(&self, names: &[&str]) -> Result<Vec<String>> {
        names
            .iter()
            .filter(|n| self.path_of(n).is_some() || !self.is_builtin(n))
            .map(|n| {
                self.path_of(n)
                    .map(str::to_string)
                    .with_context(|| format!("module {n} not found in {}", self.dir.display()))
            })
            .collect()
    }

    /// Paths of `names` and everything they depend on, dependencies first (an insmod order).
    pub fn with_dependencies(&self, names: &[&str]) -> Result<Vec<String>> {
        let mut order = Vec::new();
        for name in names {
            let key = name.replace('-', "_");
            if !self.entries.contains_key(&key) && self.is_builtin(name) {
                continue;
            }
            if !self.entries.contains_key(&key) {
                bail!("module {name} not found in {}", self.dir.display());
            }
            self.visit(&key, &mut order, 0)?;
        }
        Ok(order)
    }

    fn visit(&self, name: &str, order: &mut Vec<String>, depth: usize) -> Result<()> {
        if depth > 64 {
            bail!("module dependency loop at {name}");
        }
        let (path, deps) = self
            .entries
            .get(name)
            .with_context(|| format!("modules.dep names unknown module {name}"))?;
        if order.contains(path) {
            return Ok(());
        }
        // modules.dep lists direct dependencies before indirect ones; load the deepest first.
        for dep in deps.iter().rev() {
            self.visit(&module_name(dep), order, depth + 1)?;
        }
        if !order.contains(path) {
            order.push(path.clone());
        }
        Ok(())
    }

    /// The dependencies of `path` (as modules.dep lists them) that are also in `kept`.
    pub fn deps_within<'a>(&'a self, path: &str, kept: &[String]) -> Vec<&'a str> {
        self.entries
            .get(&module_name(path))
            .map(|(_, deps)| deps.as_slice())
            .unwrap_or_default()
            .iter()
            .filter(|d| kept.contains(d))
            .map(String::as_str)
            .collect()
    }
}

fn parse_modules_dep(text: &str) -> HashMap<String, (String, Vec<String>)> {
    text.lines()
        .filter_map(|line| {
            let (path, deps) = line.split_once(':')?;
            let path = path.trim().to_string();
            let deps = deps.split_whitespace().map(str::to_string).collect();
            Some((module_name(&path), (path, deps)))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const DEP: &str = "\
kernel/virt/lib/irqbypass.ko:
kernel/arch/x86/kvm/kvm.ko: kernel/virt/lib/irqbypass.ko
kernel/arch/x86/kvm/kvm-amd.ko: kernel/arch/x86/kvm/kvm.ko kernel/drivers/crypto/ccp/ccp.ko kernel/virt/lib/irqbypass.ko
kernel/drivers/crypto/ccp/ccp.ko:
kernel/drivers/block/virtio_blk.ko.xz: kernel/drivers/virtio/virtio.ko kernel/drivers/virtio/virtio_ring.ko
kernel/drivers/virtio/virtio.ko: kernel/drivers/virtio/virtio_ring.ko
kernel/drivers/virtio/virtio_ring.ko:
";

    fn index() -> ModuleIndex {
        ModuleIndex {
            dir: PathBuf::from("/m/6.1.0-1-amd64"),
            release: "6.1.0-1-amd64".into(),
            entries: parse_modules_dep(DEP),
            builtin: ["virtio_pci".to_string()].into(),
        }
    }

    #[test]
    fn builtin_modules_need_no_file_and_unknown_ones_fail() {
        let ix = index();
        assert_eq!(
            ix.paths_of(&["kvm", "virtio-pci", "ccp"]).unwrap(),
            [
                "kernel/arch/x86/kvm/kvm.ko",
                "kernel/drivers/crypto/ccp/ccp.ko"
            ]
        );
        assert_eq!(
            ix.with_dependencies(&["virtio_pci"]).unwrap(),
            Vec::<String>::new()
        );
        let err = ix.paths_of(&["kvm", "nope"]).unwrap_err().to_string();
        assert!(err.contains("module nope not found"), "{err}");
    }

    #[test]
    fn names_strip_directories_and_compression() {
        assert_eq!(module_name("kernel/arch/x86/kvm/kvm-amd.ko.xz"), "kvm_amd");
        assert_eq!(module_name("virtio.ko"), "virtio");
    }

    #[test]
    fn dependencies_come_first() {
        let order = index()
            .with_dependencies(&["kvm-amd", "virtio_blk"])
            .unwrap();
        assert_eq!(
            order,
            [
                "kernel/virt/lib/irqbypass.ko",
                "kernel/drivers/crypto/ccp/ccp.ko",
                "kernel/arch/x86/kvm/kvm.ko",
                "kernel/arch/x86/kvm/kvm-amd.ko",
                "kernel/drivers/virtio/virtio_ring.ko",
                "kernel/drivers/virtio/virtio.ko",
                "kernel/drivers/block/virtio_blk.ko.xz",
            ]
        );
        assert!(index().with_dependencies(&["nope"]).is_err());
    }

    #[test]
    fn deps_within_keeps_only_included_modules() {
        let idx = index();
        let kept = vec![
            "kernel/arch/x86/kvm/kvm.ko".to_string(),
            "kernel/arch/x86/kvm/kvm-amd.ko".to_string(),
        ];
        assert_eq!(
            idx.deps_within("kernel/arch/x86/kvm/kvm-amd.ko", &kept),
            ["kernel/arch/x86/kvm/kvm.ko"]
        );
        assert!(idx
            .deps_within("kernel/virt/lib/irqbypass.ko", &kept)
            .is_empty());
    }
}
