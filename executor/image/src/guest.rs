//! What Tine puts into every guest image on top of the root filesystem: busybox, the agent, a
//! tiny `/init` that execs it, the agent's config, device nodes and kernel modules.

use std::path::Path;

use anyhow::{Context, Result};

use crate::initramfs::KernelModules;
use crate::recipe::Recipe;
use crate::tree::{Node, Overlay};

/// Where the agent lives in the guest (a real directory with and without merged /usr).
pub const AGENT_GUEST_PATH: &str = "/usr/sbin/tine-agent";
/// Multi-line warm-ups go here (the config format is one `key = value` per line).
pub const WARMUP_GUEST_PATH: &str = "/etc/tine/warmup.py";
/// Modules every image needs: the virtio-mmio transport (devices are described in ACPI), the
/// vsock driver the agent listens on, and virtio-net for the guest's network interface. Their
/// dependencies come from modules.dep.
pub const REQUIRED_MODULES: &[&str] = &["virtio_mmio", "vmw_vsock_virtio_transport", "virtio_net"];

/// `/init`: exec the agent so it is PID 1. A script rather than the agent itself because the
/// kernel passes unrecognised command-line words to init as arguments, which the agent's
/// argument parser would reject.
pub fn init_script() -> String {
    format!(
        "#!/bin/sh\n# Tine guest init: the agent becomes PID 1 (exec keeps the PID).\n\
         exec {AGENT_GUEST_PATH} --config {}\n",
        tine_agent::config::DEFAULT_PATH
    )
}

/// Module names the agent loads: the required ones, then the recipe's.
pub fn module_names(recipe: &Recipe) -> Vec<String> {
    let mut names: Vec<String> = REQUIRED_MODULES.iter().map(|s| s.to_string()).collect();
    for m in &recipe.agent.modules {
        let m = m.replace('-', "_");
        if !names.contains(&m) {
            names.push(m);
        }
    }
    names
}

/// The agent's config file (format: tine_agent::config), and the warm-up file if one is needed.
pub fn agent_config(recipe: &Recipe, modules: &[String]) -> Result<(String, Option<String>)> {
    let mut text = format!(
        "# Written by `tine image build` (recipe {}).\nmodules = {}\n",
        recipe.name,
        modules.join(" ")
    );
    if let Some(py) = &recipe.agent.python {
        text.push_str(&format!("python = {py}\n"));
    }
    let warmup = recipe.agent.warmup.trim();
    let mut warmup_file = None;
    if warmup.contains('\n') {
        text.push_str(&format!("warmup_file = {WARMUP_GUEST_PATH}\n"));
        warmup_file = Some(format!("{warmup}\n"));
    } else if !warmup.is_empty() {
        text.push_str(&format!("warmup = {warmup}\n"));
    }
    if warmup_file.is_none() {
        // Catch a format mismatch at build time rather than at boot.
        tine_agent::config::AgentConfig::parse(&text)
            .with_context(|| format!("the generated agent config does not parse:\n{text}"))?;
    }
    Ok((text, warmup_file))
}

pub struct GuestFiles<'a> {
    pub busybox: &'a Path,
    pub busybox_data: &'a [u8],
    pub agent_data: &'a [u8],
    pub modules: &'a KernelModules,
    /// Copied when present: lets the agent skip modules that are built in.
    pub modules_builtin: Option<Vec<u8>>,
    pub config: &'a str,
    pub warmup_file: Option<&'a str>,
}

/// `poweroff`, `reboot` and `halt` as busybox applets where the root filesystem has none (a
/// Debian minbase has no init system and so none of them), so `tine exec -- poweroff -f` works
/// in every image. A distribution's own tools are never shadowed.
fn add_power_applets(ov: &mut Overlay) -> Result<()> {
    for applet in ["poweroff", "reboot", "halt"] {
        let present = ["/sbin", "/usr/sbin", "/bin", "/usr/bin"]
            .iter()
            .any(|d| ov.exists(&format!("{d}/{applet}")));
        if !present {
            ov.add(
                &format!("/sbin/{applet}"),
                Node::Symlink {
                    target: "/bin/busybox".into(),
                },
            )?;
        }
    }
    Ok(())
}

/// Builds the overlay for `recipe` on top of `base` (None: busybox-only image).
pub fn overlay(recipe: &Recipe, base: Option<&Path>, g: &GuestFiles<'_>) -> Result<Overlay> {
    let mut ov = Overlay::new(base);
    let dir = |mode| Node::Dir { mode };
    let file = |mode, data: &[u8]| Node::File {
        mode,
        data: data.to_vec(),
    };
    if base.is_none() {
        for d in [
            "bin", "dev", "etc", "proc", "root", "run", "sbin", "sys", "usr/bin", "usr/sbin",
        ] {
            ov.add(&format!("/{d}"), dir(0o755))?;
        }
        ov.add("/tmp", dir(0o1777))?;
    }
    // The kernel opens /dev/console for init before anything mounts devtmpfs.
    ov.add(
        "/dev/console",
        Node::CharDevice {
            mode: 0o600,
            major: 5,
            minor: 1,
        },
    )?;
    ov.add(
        "/dev/null",
        Node::CharDevice {
            mode: 0o666,
            major: 1,
            minor: 3,
        },
    )?;
    // busybox: the whole userland of a bare image; in a rootfs image only a fallback /bin/sh
    // and a toolbox for debugging (`busybox <applet>`), never shadowing the distribution's tools.
    if !ov.exists("/bin/busybox") {
        ov.add("/bin/busybox", file(0o755, g.busybox_data))?;
    }
    if base.is_none() {
        for applet in crate::initramfs::applets(g.busybox) {
            if applet != "busybox" && !applet.contains('/') {
                ov.add(
                    &format!("/bin/{applet}"),
                    Node::Symlink {
                        target: "busybox".into(),
                    },
                )?;
            }
        }
    } else {
        if !ov.exists("/bin/sh") {
            ov.add(
                "/bin/sh",
                Node::Symlink {
                    target: "busybox".into(),
                },
            )?;
        }
        add_power_applets(&mut ov)?;
    }
    ov.add(AGENT_GUEST_PATH, file(0o755, g.agent_data))?;
    ov.add("/init", file(0o755, init_script().as_bytes()))?;
    ov.add(
        tine_agent::config::DEFAULT_PATH,
        file(0o644, g.config.as_bytes()),
    )?;
    if let Some(w) = g.warmup_file {
        ov.add(WARMUP_GUEST_PATH, file(0o644, w.as_bytes()))?;
    }
    for (path, data) in g.modules.archive_files()? {
        ov.add(&format!("/{path}"), file(0o644, &data))?;
    }
    if let Some(b) = &g.modules_builtin {
        ov.add(
            &format!("/lib/modules/{}/modules.builtin", g.modules.release()),
            file(0o644, b),
        )?;
    }
    for f in &recipe.files {
        let data = recipe.file_content(f)?;
        ov.add(&f.path, file(f.mode, &data))
            .with_context(|| format!("[[files]] {}", f.path))?;
    }
    Ok(ov)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_parses_with_the_agents_own_parser() {
        let r = Recipe::parse(
            "name = \"t\"\n[agent]\npython = \"/usr/bin/python3\"\nwarmup = \"import numpy\"\nmodules = [\"virtio-blk\", \"virtio_mmio\"]\n",
            None,
        )
        .unwrap();
        let mods = module_names(&r);
        assert_eq!(
            mods,
            [
                "virtio_mmio",
                "vmw_vsock_virtio_transport",
                "virtio_net",
                "virtio_blk"
            ]
        );
        let (text, file) = agent_config(&r, &mods).unwrap();
        assert!(file.is_none());
        let cfg = tine_agent::config::AgentConfig::parse(&text).unwrap();
        assert_eq!(cfg.modules, mods);
        assert_eq!(cfg.warmup, "import numpy");
        assert_eq!(cfg.python, Path::new("/usr/bin/python3"));
    }

    #[test]
    fn multi_line_warmups_go_to_a_file() {
        let r = Recipe::parse(
            "name = \"t\"\n[agent]\nwarmup = \"\"\"\nimport json\nx = 1\n\"\"\"\n",
            None,
        )
        .unwrap();
        let (text, file) = agent_config(&r, &module_names(&r)).unwrap();
        assert!(text.contains(&format!("warmup_file = {WARMUP_GUEST_PATH}\n")));
        assert_eq!(file.as_deref(), Some("import json\nx = 1\n"));
    }

    #[test]
    fn power_applets_fill_gaps_without_shadowing() {
        // A merged-/usr tree: /sbin -> usr/sbin, with its own `reboot` but no `poweroff`/`halt`.
        let base = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(base.path().join("usr/sbin")).unwrap();
        std::os::unix::fs::symlink("usr/sbin", base.path().join("sbin")).unwrap();
        std::fs::write(base.path().join("usr/sbin/reboot"), b"distro").unwrap();
        let mut ov = Overlay::new(Some(base.path()));
        add_power_applets(&mut ov).unwrap();
        let paths: Vec<&str> = ov.paths().collect();
        assert_eq!(paths, vec!["usr/sbin/halt", "usr/sbin/poweroff"]);
    }

    #[test]
    fn init_execs_the_agent() {
        let s = init_script();
        assert!(s.starts_with("#!/bin/sh\n"));
        assert!(s.contains("exec /usr/sbin/tine-agent --config /etc/tine/agent.conf"));
    }
}
