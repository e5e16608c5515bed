//! Thin wrappers around the Debian package tools (`apt-cache`, `apt-get`, `dpkg-deb`).
//!
//! Kernels are only downloaded and unpacked, never installed, so the host stays untouched.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use anyhow::{bail, Context, Result};

fn run(cmd: &mut Command) -> Result<Output> {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {cmd:?}"))?;
    Ok(out)
}

fn run_ok(cmd: &mut Command) -> Result<String> {
    let out = run(cmd)?;
    if !out.status.success() {
        bail!(
            "{cmd:?} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The first `Depends:` target of a metapackage whose name starts with `prefix`, e.g.
/// `linux-image-amd64` -> `linux-image-6.1.0-56-amd64`. `None` if apt knows no such package.
pub fn resolve_dependency(metapackage: &str, prefix: &str) -> Result<Option<String>> {
    let out = run(Command::new("apt-cache").args(["depends", metapackage]))?;
    if !out.status.success() {
        return Ok(None);
    }
    Ok(parse_first_dependency(
        &String::from_utf8_lossy(&out.stdout),
        prefix,
    ))
}

fn parse_first_dependency(depends_output: &str, prefix: &str) -> Option<String> {
    depends_output.lines().find_map(|line| {
        let dep = line.trim().strip_prefix("Depends:")?.trim();
        // Alternatives are printed as "|Depends: x"; those never match the stripped prefix.
        let name = dep.trim_start_matches('<').trim_end_matches('>');
        name.starts_with(prefix).then(|| name.to_string())
    })
}

/// The candidate version apt would download for `package`.
pub fn candidate_version(package: &str) -> Result<Option<String>> {
    let out = run(Command::new("apt-cache").args(["show", "--no-all-versions", package]))?;
    if !out.status.success() {
        return Ok(None);
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("Version:").map(|v| v.trim().to_string())))
}

/// `apt-get update`, used only when apt knows nothing about a package we need.
pub fn update() -> Result<()> {
    eprintln!("tine-image: apt has no package lists for what we need; running `apt-get update`");
    let status = Command::new("apt-get")
        .args(["update", "-q"])
        .stdin(Stdio::null())
        .status()
        .context("running apt-get update")?;
    if !status.success() {
        bail!("apt-get update failed ({status})");
    }
    Ok(())
}

/// Downloads `package` (a `.deb`, not installed) into `dir` and returns the file's path.
pub fn download(package: &str, dir: &Path) -> Result<PathBuf> {
    // Downloading as root into a directory the `_apt` sandbox user cannot write only warns;
    // skip the sandbox to keep the output clean.
    run_ok(
        Command::new("apt-get")
            .args(["download", "-q", "-o", "APT::Sandbox::User=root", package])
            .current_dir(dir),
    )
    .with_context(|| format!("downloading {package}"))?;
    let prefix = format!("{package}_");
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        let name = path.file_name().unwrap_or_default().to_string_lossy();
        if name.starts_with(&prefix) && name.ends_with(".deb") {
            return Ok(path);
        }
    }
    bail!(
        "apt-get download {package} produced no .deb in {}",
        dir.display()
    )
}

/// A field of a `.deb`'s control file (e.g. `Version`).
pub fn deb_field(deb: &Path, field: &str) -> Result<String> {
    Ok(
        run_ok(Command::new("dpkg-deb").arg("-f").arg(deb).arg(field))?
            .trim()
            .to_string(),
    )
}

/// Unpacks a `.deb`'s data into `dir` without running any maintainer script.
pub fn extract(deb: &Path, dir: &Path) -> Result<()> {
    run_ok(Command::new("dpkg-deb").arg("-x").arg(deb).arg(dir))
        .with_context(|| format!("unpacking {}", deb.display()))?;
    Ok(())
}

/// Makes sure the Debian packages are installed (`apt-get install -y` the missing ones).
/// `probes` pairs each package with a file it provides, which is how we check.
pub fn ensure_installed(probes: &[(&str, &str)]) -> Result<()> {
    let missing: Vec<&str> = probes
        .iter()
        .filter(|(_, file)| !Path::new(file).exists())
        .map(|(pkg, _)| *pkg)
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    install(&missing)
}

/// `apt-get install -y` of `packages`, with one `apt-get update` retry.
pub fn install(packages: &[&str]) -> Result<()> {
    eprintln!("tine-image: installing packages: {}", packages.join(" "));
    let install = |missing: &[&str]| -> Result<bool> {
        Ok(Command::new("apt-get")
            .args(["install", "-y", "-q", "--no-install-recommends"])
            .args(missing)
            .env("DEBIAN_FRONTEND", "noninteractive")
            .stdin(Stdio::null())
            .status()
            .context("running apt-get install")?
            .success())
    };
    if !install(packages)? {
        update()?;
        if !install(packages)? {
            bail!("apt-get install -y {} failed", packages.join(" "));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn picks_the_abi_package_from_apt_cache_depends() {
        let out = "linux-image-cloud-amd64\n  Depends: linux-image-6.1.0-56-cloud-amd64\n";
        assert_eq!(
            parse_first_dependency(out, "linux-image-").as_deref(),
            Some("linux-image-6.1.0-56-cloud-amd64")
        );
        assert_eq!(parse_first_dependency(out, "linux-headers-"), None);
        assert_eq!(parse_first_dependency("", "linux-image-"), None);
    }
}
