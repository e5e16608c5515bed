//! Image recipes: TOML files that say what goes into a guest image.
//!
//! ```toml
//! name = "python-numpy"
//! memory_mib = 512            # guest RAM to recommend (raised if the image needs more)
//! cmdline = "quiet"           # appended to the VMM's default kernel command line
//!
//! [rootfs]                    # optional; without it the image is busybox + the agent
//! kind = "debootstrap"        # or "dir" / "tarball" with `path = "..."`
//! suite = "bookworm"
//! packages = ["python3-minimal", "python3-numpy"]
//!
//! [agent]
//! python = "/usr/bin/python3"
//! warmup = "import numpy"     # run in the agent's warm interpreter before it reports ready
//! modules = []                # kernel modules beyond virtio_mmio and the vsock transport
//!
//! [[files]]                   # extra files; `content` inline or `source` (relative to the recipe)
//! path = "/etc/motd"
//! content = "hello\n"
//! mode = 0o644
//! ```
//!
//! Relative paths inside a recipe file are relative to the file's directory.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

use crate::compress::Compression;

pub const DEFAULT_SUITE: &str = "bookworm";
pub const DEFAULT_MIRROR: &str = "http://deb.debian.org/debian";
pub const DEFAULT_VARIANT: &str = "minbase";
const MIN_MEMORY_MIB: u32 = 64;

/// The recipes shipped with Tine (executor/image/recipes/), by name.
pub const BUILTIN: &[(&str, &str)] = &[
    ("busybox", include_str!("../recipes/busybox.toml")),
    ("python-numpy", include_str!("../recipes/python-numpy.toml")),
];

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Recipe {
    pub name: String,
    #[serde(default)]
    pub description: String,
    #[serde(default = "default_memory")]
    pub memory_mib: u32,
    /// Appended to the VMM's default kernel command line.
    #[serde(default)]
    pub cmdline: String,
    /// Default: [`Compression::default`].
    #[serde(default)]
    pub compression: Option<Compression>,
    #[serde(default)]
    pub rootfs: Option<RootfsSource>,
    /// Drop documentation, man pages, locales and apt lists/caches from the root filesystem.
    #[serde(default = "yes")]
    pub slim: bool,
    /// More root filesystem paths to leave out (`*` matches within one path component).
    #[serde(default)]
    pub exclude: Vec<String>,
    #[serde(default)]
    pub agent: AgentSection,
    #[serde(default)]
    pub files: Vec<ExtraFile>,
    /// Directory that relative paths are resolved against (the recipe file's).
    #[serde(skip)]
    pub base_dir: Option<PathBuf>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
pub enum RootfsSource {
    /// `debootstrap --variant=<variant> --include=<packages> <suite> <dir> <mirror>`.
    Debootstrap {
        #[serde(default = "default_suite")]
        suite: String,
        #[serde(default = "default_mirror")]
        mirror: String,
        #[serde(default = "default_variant")]
        variant: String,
        #[serde(default)]
        packages: Vec<String>,
    },
    /// A directory on the build host, copied as it is.
    Dir { path: PathBuf },
    /// A tar archive (plain, gzip, zstd or xz); hostile entries are refused.
    Tarball { path: PathBuf },
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgentSection {
    /// Interpreter for the agent's warm Python (agent default: `python3` on PATH).
    #[serde(default)]
    pub python: Option<String>,
    /// Python run in the warm interpreter at boot; the agent reports ready once it is done.
    #[serde(default)]
    pub warmup: String,
    #[serde(default)]
    pub modules: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExtraFile {
    /// Absolute path in the guest.
    pub path: String,
    #[serde(default)]
    pub content: Option<String>,
    /// A build-host file (relative to the recipe file).
    #[serde(default)]
    pub source: Option<PathBuf>,
    #[serde(default = "default_mode")]
    pub mode: u32,
}

fn default_memory() -> u32 {
    256
}
fn yes() -> bool {
    true
}
fn default_mode() -> u32 {
    0o644
}
fn default_suite() -> String {
    DEFAULT_SUITE.into()
}
fn default_mirror() -> String {
    DEFAULT_MIRROR.into()
}
fn default_variant() -> String {
    DEFAULT_VARIANT.into()
}

impl Recipe {
    /// Parses and validates recipe text; `base_dir` anchors relative paths.
    pub fn parse(text: &str, base_dir: Option<&Path>) -> Result<Recipe> {
        let mut r: Recipe = toml::from_str(text).context("parsing the recipe")?;
        r.base_dir = base_dir.map(Path::to_path_buf);
        r.validate()?;
        Ok(r)
    }

    pub fn load(path: &Path) -> Result<Recipe> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let dir = path.parent().map(|p| {
            if p.as_os_str().is_empty() {
                Path::new(".")
            } else {
                p
            }
        });
        Recipe::parse(&text, dir).with_context(|| format!("recipe {}", path.display()))
    }

    /// A recipe file path, or the name of a built-in recipe.
    pub fn resolve(name_or_path: &str) -> Result<Recipe> {
        let path = Path::new(name_or_path);
        if path.is_file() {
            return Recipe::load(path);
        }
        if let Some((_, text)) = BUILTIN.iter().find(|(n, _)| *n == name_or_path) {
            return Recipe::parse(text, None)
                .with_context(|| format!("built-in recipe {name_or_path}"));
        }
        let names: Vec<&str> = BUILTIN.iter().map(|(n, _)| *n).collect();
        bail!(
            "no recipe file {name_or_path:?} and no built-in recipe of that name (built-in: {})",
            names.join(", ")
        )
    }

    /// `path` made absolute against the recipe's directory.
    pub fn resolve_path(&self, path: &Path) -> PathBuf {
        match &self.base_dir {
            Some(dir) if path.is_relative() => dir.join(path),
            _ => path.to_path_buf(),
        }
    }

    fn validate(&self) -> Result<()> {
        if self.name.is_empty()
            || !self
                .name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
        {
            bail!(
                "name {:?}: use letters, digits, '.', '_' and '-'",
                self.name
            );
        }
        if self.memory_mib < MIN_MEMORY_MIB {
            bail!(
                "memory_mib = {}: at least {MIN_MEMORY_MIB} MiB",
                self.memory_mib
            );
        }
        if self.cmdline.contains('\n') {
            bail!("cmdline must be one line");
        }
        if let Some(RootfsSource::Debootstrap {
            packages,
            suite,
            variant,
            ..
        }) = &self.rootfs
        {
            for p in packages {
                let ok = p.len() > 1
                    && p.bytes().all(|b| {
                        b.is_ascii_lowercase() || b.is_ascii_digit() || b"+-.:".contains(&b)
                    });
                if !ok {
                    bail!("package {p:?} is not a Debian package name");
                }
            }
            for (what, v) in [("suite", suite), ("variant", variant)] {
                if v.is_empty() || !v.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-') {
                    bail!("{what} {v:?} is not valid");
                }
            }
        }
        for m in &self.agent.modules {
            if m.is_empty()
                || !m
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"_-".contains(&b))
            {
                bail!("module name {m:?} is not valid");
            }
        }
        for f in &self.files {
            crate::guestpath::absolute(&f.path).with_context(|| format!("[[files]] {}", f.path))?;
            if f.content.is_some() == f.source.is_some() {
                bail!(
                    "[[files]] {}: give exactly one of `content` and `source`",
                    f.path
                );
            }
            if f.mode > 0o7777 {
                bail!(
                    "[[files]] {}: mode {:o} is not a permission mode",
                    f.path,
                    f.mode
                );
            }
        }
        for pattern in &self.exclude {
            crate::guestpath::components(pattern)
                .with_context(|| format!("exclude {pattern:?}"))?;
        }
        Ok(())
    }

    /// The content of an extra file.
    pub fn file_content(&self, f: &ExtraFile) -> Result<Vec<u8>> {
        match (&f.content, &f.source) {
            (Some(c), _) => Ok(c.clone().into_bytes()),
            (None, Some(src)) => {
                let p = self.resolve_path(src);
                std::fs::read(&p).with_context(|| format!("reading {} for {}", p.display(), f.path))
            }
            (None, None) => bail!("{}: no content", f.path),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtin_recipes_parse() {
        let bb = Recipe::resolve("busybox").unwrap();
        assert_eq!(bb.name, "busybox");
        assert!(bb.rootfs.is_none());
        let np = Recipe::resolve("python-numpy").unwrap();
        match &np.rootfs {
            Some(RootfsSource::Debootstrap {
                packages, variant, ..
            }) => {
                assert!(packages.iter().any(|p| p == "python3-numpy"));
                assert_eq!(variant, "minbase");
            }
            other => panic!("python-numpy rootfs: {other:?}"),
        }
        assert!(np.agent.warmup.contains("import numpy"));
        assert_eq!(np.agent.python.as_deref(), Some("/usr/bin/python3"));
    }

    #[test]
    fn full_recipe_with_defaults() {
        let r = Recipe::parse(
            r#"
name = "t"
cmdline = "quiet"
compression = "lz4"
exclude = ["usr/share/zoneinfo"]
[rootfs]
kind = "debootstrap"
packages = ["python3-minimal"]
[agent]
warmup = "import json"
modules = ["virtio_blk"]
[[files]]
path = "/etc/x"
content = "y"
mode = 0o600
[[files]]
path = "/etc/z"
source = "z.txt"
"#,
            Some(Path::new("/recipes")),
        )
        .unwrap();
        assert_eq!(r.memory_mib, 256);
        assert!(r.slim);
        assert_eq!(r.compression, Some(Compression::Lz4));
        assert_eq!(
            r.rootfs,
            Some(RootfsSource::Debootstrap {
                suite: "bookworm".into(),
                mirror: "http://deb.debian.org/debian".into(),
                variant: "minbase".into(),
                packages: vec!["python3-minimal".into()],
            })
        );
        assert_eq!(r.files[0].mode, 0o600);
        assert_eq!(r.files[1].mode, 0o644);
        assert_eq!(
            r.resolve_path(r.files[1].source.as_ref().unwrap()),
            Path::new("/recipes/z.txt")
        );
        assert_eq!(r.file_content(&r.files[0]).unwrap(), b"y");
    }

    #[test]
    fn rejects_bad_recipes_with_a_reason() {
        let cases = [
            ("name = \"a b\"", "name"),
            ("name = \"a\"\nmemroy_mib = 5", "memroy_mib"),
            ("name = \"a\"\nmemory_mib = 16", "at least"),
            (
                "name = \"a\"\n[rootfs]\nkind = \"debootstrap\"\npackages = [\"x; rm -rf /\"]",
                "not a Debian package",
            ),
            ("name = \"a\"\n[rootfs]\nkind = \"zip\"", "zip"),
            (
                "name = \"a\"\n[[files]]\npath = \"/etc/x\"",
                "exactly one of",
            ),
            (
                "name = \"a\"\n[[files]]\npath = \"etc/x\"\ncontent = \"\"",
                "absolute",
            ),
            (
                "name = \"a\"\n[[files]]\npath = \"/etc/../x\"\ncontent = \"\"",
                "..",
            ),
            ("name = \"a\"\n[agent]\nmodules = [\"a b\"]", "module"),
        ];
        for (text, want) in cases {
            let err = format!("{:#}", Recipe::parse(text, None).unwrap_err());
            assert!(err.contains(want), "{text:?}: {err}");
        }
        let err = Recipe::resolve("no-such-recipe").unwrap_err().to_string();
        assert!(err.contains("busybox, python-numpy"), "{err}");
    }

    #[test]
    fn recipe_files_resolve_relative_to_their_directory() {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::write(tmp.path().join("w.py"), "import json\n").unwrap();
        let path = tmp.path().join("r.toml");
        std::fs::write(
            &path,
            "name = \"r\"\n[[files]]\npath = \"/etc/w.py\"\nsource = \"w.py\"\n",
        )
        .unwrap();
        let r = Recipe::resolve(path.to_str().unwrap()).unwrap();
        assert_eq!(r.file_content(&r.files[0]).unwrap(), b"import json\n");
    }
}
