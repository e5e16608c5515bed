//! The per-run part of the L1 initrd: a small uncompressed cpio with `/tine/nonce`,
//! `/tine/setup.sh` (mounts the shares) and `/tine/job.sh` (cwd, environment, argv).
//!
//! Every string is single-quoted for the shell (see [`shell_quote`]), so arguments travel
//! verbatim whatever they contain. The archive goes in front of the cached gzip image: the kernel
//! unpacks concatenated archives in order.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use tine_image::cpio::CpioWriter;
use tine_image::initramfs::shell_quote;

/// What to run inside L1.
#[derive(Debug, Clone)]
pub struct Job {
    pub argv: Vec<String>,
    /// Working directory (a host path; the host root is mounted read-only).
    pub cwd: PathBuf,
    pub env: Vec<(String, String)>,
    /// Host directories exported and mounted at the same path, in this order (a directory
    /// before any share inside it).
    pub shares: Vec<Share>,
}

/// A host directory exported to L1 and mounted at its own path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Share {
    pub dir: PathBuf,
    pub writable: bool,
}

impl Share {
    pub fn writable(dir: impl Into<PathBuf>) -> Share {
        Share {
            dir: dir.into(),
            writable: true,
        }
    }

    pub fn read_only(dir: impl Into<PathBuf>) -> Share {
        Share {
            dir: dir.into(),
            writable: false,
        }
    }
}

/// The 9p mount tag of the i-th share.
pub fn share_tag(i: usize) -> String {
    format!("tineshare{i}")
}

impl Job {
    pub fn setup_script(&self) -> String {
        let mut s = String::from("# Shares, mounted over the read-only host root.\n");
        for (i, share) in self.shares.iter().enumerate() {
            let target = shell_quote(&format!("/host{}", share.dir.display()));
            let what = shell_quote(&format!("share {}", share.dir.display()));
            // A read-only share (the cache) does not change under a run either: cached as the
            // host root is. A writable one is where results are written: no caching.
            let ro = if share.writable {
                ""
            } else {
                ",ro,cache=loose"
            };
            s.push_str(&format!(
                "mkdir -p {target} 2>/dev/null\nmount -t 9p -o trans=virtio,version=9p2000.L,msize=262144{ro} {} {target} || fail {what}\n",
                share_tag(i)
            ));
        }
        s
    }

    pub fn job_script(&self) -> Result<String> {
        if self.argv.is_empty() {
            bail!("no command given");
        }
        let cwd = self.cwd.to_string_lossy();
        let mut s = format!(
            "cd {0} || {{ echo \"tine-lab: cannot enter \"{0}\" inside L1 (host /tmp and /run are \
             not shared; see --share)\" >&2; exit 125; }}\n",
            shell_quote(&cwd)
        );
        for (k, v) in &self.env {
            if k.is_empty() || !k.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_') {
                bail!("environment variable name {k:?} is not shell-safe");
            }
            s.push_str(&format!("export {}\n", shell_quote(&format!("{k}={v}"))));
        }
        s.push_str("exec");
        for a in &self.argv {
            s.push(' ');
            s.push_str(&shell_quote(a));
        }
        s.push('\n');
        Ok(s)
    }

    /// The uncompressed job archive.
    pub fn archive(&self, nonce: &str) -> Result<Vec<u8>> {
        let mut w = CpioWriter::new(Vec::new());
        w.file("tine/nonce", 0o644, nonce.as_bytes())?;
        w.file("tine/setup.sh", 0o644, self.setup_script().as_bytes())?;
        w.file("tine/job.sh", 0o755, self.job_script()?.as_bytes())?;
        Ok(w.finish()?)
    }

    /// Writes job archive + `base` (the cached L1 image) to `out`.
    pub fn write_initrd(&self, nonce: &str, base: &Path, out: &Path) -> Result<()> {
        let mut f =
            std::fs::File::create(out).with_context(|| format!("creating {}", out.display()))?;
        // newc pads to 4 bytes, so the gzip member after it starts aligned as the kernel wants.
        f.write_all(&self.archive(nonce)?)?;
        let mut b =
            std::fs::File::open(base).with_context(|| format!("opening {}", base.display()))?;
        std::io::copy(&mut b, &mut f)?;
        f.flush()?;
        Ok(())
    }
}

/// Environment variables carried into L1: the caller's `PATH` and `HOME`, `TINE_*`, `RUST_LOG`
/// and `RUST_BACKTRACE`.
pub fn passthrough_env() -> Vec<(String, String)> {
    let mut env: Vec<(String, String)> = std::env::vars()
        .filter(|(k, _)| {
            k.starts_with("TINE_")
                || matches!(k.as_str(), "RUST_LOG" | "RUST_BACKTRACE" | "PATH" | "HOME")
        })
        .collect();
    if !env.iter().any(|(k, _)| k == "PATH") {
        env.push((
            "PATH".into(),
            "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into(),
        ));
    }
    env.sort();
    env
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    fn job(argv: &[&str]) -> Job {
        Job {
            argv: argv.iter().map(|s| s.to_string()).collect(),
            cwd: PathBuf::from("/"),
            env: vec![("TINE_X".into(), "a 'b' $c".into())],
            shares: vec![
                Share::writable("/tmp/it's here"),
                Share::read_only("/tmp/cache"),
            ],
        }
    }

    /// Runs job.sh with the host shell (no chroot) and checks argv and env arrive verbatim.
    #[test]
    fn job_script_passes_argv_and_env_verbatim() {
        let tricky = [
            "printf",
            "[%s]",
            "$(touch /oops)",
            "a b",
            "it's",
            "*",
            "",
            "x\ny",
        ];
        let script = job(&tricky).job_script().unwrap();
        let out = Command::new("sh").arg("-c").arg(&script).output().unwrap();
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            "[$(touch /oops)][a b][it's][*][][x\ny]"
        );
        let env_script = job(&["sh", "-c", "printf %s \"$TINE_X\""])
            .job_script()
            .unwrap();
        let out = Command::new("sh")
            .arg("-c")
            .arg(&env_script)
            .output()
            .unwrap();
        assert_eq!(String::from_utf8_lossy(&out.stdout), "a 'b' $c");
    }

    #[test]
    fn rejects_empty_argv_and_bad_env_names() {
        assert!(job(&[]).job_script().is_err());
        let mut j = job(&["true"]);
        j.env.push(("A;B".into(), "x".into()));
        assert!(j.job_script().is_err());
    }

    #[test]
    fn setup_mounts_each_share_at_its_host_path() {
        let s = job(&["true"]).setup_script();
        assert!(
            s.contains("msize=262144 tineshare0 '/host/tmp/it'\\''s here' || fail"),
            "{s}"
        );
        assert!(
            s.contains("msize=262144,ro,cache=loose tineshare1 /host/tmp/cache || fail"),
            "{s}"
        );
    }

    #[test]
    fn archive_holds_the_three_files() {
        let a = job(&["true"]).archive("n0nce").unwrap();
        let entries = tine_image::cpio::read_archive(&a).unwrap();
        let names: Vec<&str> = entries.iter().map(|e| e.name.as_str()).collect();
        assert_eq!(
            names,
            ["tine", "tine/nonce", "tine/setup.sh", "tine/job.sh"]
        );
        assert_eq!(entries[1].data, b"n0nce");
        assert_eq!(a.len() % 4, 0);
    }
}
