//! Kernel module loading without modprobe: resolve dependencies from
//! `/lib/modules/$(uname -r)/modules.dep` and load with finit_module(2).

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::CStr;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

/// finit_module flag: let the kernel decompress (.ko.xz/.zst/.gz); needs
/// CONFIG_MODULE_DECOMPRESS, so images should ship plain `.ko` files.
const MODULE_INIT_COMPRESSED_FILE: libc::c_uint = 4;

#[derive(Debug, thiserror::Error)]
pub enum ModuleError {
    #[error("reading {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("module {0:?} is not in modules.dep nor modules.builtin")]
    Unknown(String),
    #[error("loading {path}: {source}")]
    Load {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("uname: {0}")]
    Uname(std::io::Error),
}

/// Module name as the kernel sees it: file stem without `.ko*`, `-` → `_`.
fn module_name(path: &str) -> String {
    let base = path.rsplit('/').next().unwrap_or(path);
    let stem = base.split(".ko").next().unwrap_or(base);
    stem.replace('-', "_")
}

/// Parsed modules.dep: module name → (relative path, dependency paths).
pub struct DepTable {
    by_name: BTreeMap<String, (String, Vec<String>)>,
    builtin: BTreeSet<String>,
}

impl DepTable {
    pub fn parse(modules_dep: &str, modules_builtin: &str) -> Self {
        let mut by_name = BTreeMap::new();
        for line in modules_dep.lines() {
            let Some((path, deps)) = line.split_once(':') else {
                continue;
            };
            let deps = deps.split_whitespace().map(str::to_owned).collect();
            by_name.insert(module_name(path), (path.trim().to_owned(), deps));
        }
        let builtin = modules_builtin
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(module_name)
            .collect();
        Self { by_name, builtin }
    }

    /// Relative paths to load, dependencies first, each once. Built-in
    /// modules are skipped.
    pub fn load_order(&self, wanted: &[String]) -> Result<Vec<String>, ModuleError> {
        let mut order = Vec::new();
        let mut seen = BTreeSet::new();
        for w in wanted {
            let name = module_name(w);
            if self.builtin.contains(&name) && !self.by_name.contains_key(&name) {
                continue;
            }
            self.visit(&name, &mut seen, &mut order)?;
        }
        Ok(order)
    }

    fn visit(
        &self,
        name: &str,
        seen: &mut BTreeSet<String>,
        order: &mut Vec<String>,
    ) -> Result<(), ModuleError> {
        if !seen.insert(name.to_owned()) {
            return Ok(());
        }
        let (path, deps) = self
            .by_name
            .get(name)
            .ok_or_else(|| ModuleError::Unknown(name.to_owned()))?;
        for dep in deps {
            self.visit(&module_name(dep), seen, order)?;
        }
        order.push(path.clone());
        Ok(())
    }
}

fn kernel_release() -> Result<String, ModuleError> {
    // SAFETY: uname fills a zeroed utsname; release is NUL-terminated.
    unsafe {
        let mut u: libc::utsname = std::mem::zeroed();
        if libc::uname(&mut u) != 0 {
            return Err(ModuleError::Uname(std::io::Error::last_os_error()));
        }
        Ok(CStr::from_ptr(u.release.as_ptr())
            .to_string_lossy()
            .into_owned())
    }
}

/// Loads `wanted` and their dependencies. Already-loaded modules are fine.
pub fn load_modules(wanted: &[String]) -> Result<Vec<String>, ModuleError> {
    if wanted.is_empty() {
        return Ok(Vec::new());
    }
    let root = Path::new("/lib/modules").join(kernel_release()?);
    let read = |name: &str, required: bool| {
        let path = root.join(name);
        match std::fs::read_to_string(&path) {
            Ok(s) => Ok(s),
            Err(e) if !required && e.kind() == std::io::ErrorKind::NotFound => Ok(String::new()),
            Err(source) => Err(ModuleError::Read { path, source }),
        }
    };
    let table = DepTable::parse(
        &read("modules.dep", true)?,
        &read("modules.builtin", false)?,
    );
    let order = table.load_order(wanted)?;
    for rel in &order {
        load_one(&root.join(rel))?;
    }
    Ok(order)
}

fn load_one(path: &Path) -> Result<(), ModuleError> {
    let err = |source| ModuleError::Load {
        path: path.to_owned(),
        source,
    };
    let file = File::open(path).map_err(err)?;
    let compressed = path.extension().is_none_or(|e| e != "ko");
    let flags = if compressed {
        MODULE_INIT_COMPRESSED_FILE
    } else {
        0
    };
    // SAFETY: finit_module on an open fd with an empty parameter string.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_finit_module,
            file.as_raw_fd(),
            c"".as_ptr(),
            flags,
        )
    };
    if rc != 0 {
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EEXIST) {
            return Err(err(e));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const DEP: &str = "\
kernel/net/vmw_vsock/vsock.ko:
kernel/net/vmw_vsock/vmw_vsock_virtio_transport_common.ko: kernel/net/vmw_vsock/vsock.ko
kernel/net/vmw_vsock/vmw_vsock_virtio_transport.ko.zst: kernel/net/vmw_vsock/vmw_vsock_virtio_transport_common.ko kernel/net/vmw_vsock/vsock.ko
kernel/drivers/virtio/virtio-mmio.ko:
";

    #[test]
    fn dependencies_load_first_and_once() {
        let t = DepTable::parse(DEP, "kernel/drivers/virtio/virtio.ko\n");
        let order = t
            .load_order(&[
                "vmw_vsock_virtio_transport".into(),
                "vsock".into(),
                "virtio".into(),
                "virtio-mmio".into(),
            ])
            .unwrap();
        assert_eq!(
            order,
            [
                "kernel/net/vmw_vsock/vsock.ko",
                "kernel/net/vmw_vsock/vmw_vsock_virtio_transport_common.ko",
                "kernel/net/vmw_vsock/vmw_vsock_virtio_transport.ko.zst",
                "kernel/drivers/virtio/virtio-mmio.ko",
            ]
        );
        let err = t.load_order(&["nope".into()]).unwrap_err().to_string();
        assert!(err.contains("\"nope\""), "{err}");
    }
}
