//! The agent's config file, written into the guest image by the image builder.
//!
//! Format: one `key = value` per line, `#` starts a comment line. Keys:
//! - `modules = vsock vmw_vsock_virtio_transport` — kernel modules to load at
//!   boot (dependencies are resolved from modules.dep); space or comma separated.
//! - `python = /usr/bin/python3` — interpreter for Eval (default `python3`).
//! - `warmup = import numpy` — Python run in the warm interpreter at boot;
//!   Ping reports `warming` until it has finished.
//! - `warmup_file = /etc/tine/warmup.py` — same, read from a file (appended
//!   after `warmup` if both are given).

use std::path::{Path, PathBuf};

pub const DEFAULT_PATH: &str = "/etc/tine/agent.conf";

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentConfig {
    pub modules: Vec<String>,
    pub python: PathBuf,
    /// Empty means no warm-up: the agent is ready as soon as it listens.
    pub warmup: String,
}

impl Default for AgentConfig {
    fn default() -> Self {
        Self {
            modules: Vec::new(),
            python: PathBuf::from("python3"),
            warmup: String::new(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("reading config {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("config line {line}: {msg}")]
    Syntax { line: usize, msg: String },
}

impl AgentConfig {
    /// Loads `path`; a missing file yields the defaults (a bare image works).
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        match std::fs::read_to_string(path) {
            Ok(text) => Self::parse(&text),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Self::default()),
            Err(source) => Err(ConfigError::Read {
                path: path.into(),
                source,
            }),
        }
    }

    pub fn parse(text: &str) -> Result<Self, ConfigError> {
        let mut cfg = Self::default();
        let mut warmup_file = None;
        for (i, raw) in text.lines().enumerate() {
            let line = raw.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let syntax = |msg: String| ConfigError::Syntax { line: i + 1, msg };
            let (key, value) = line
                .split_once('=')
                .ok_or_else(|| syntax(format!("expected `key = value`, got {line:?}")))?;
            let value = value.trim();
            match key.trim() {
                "modules" => cfg.modules.extend(
                    value
                        .split([' ', ',', '\t'])
                        .filter(|m| !m.is_empty())
                        .map(str::to_owned),
                ),
                "python" => cfg.python = PathBuf::from(value),
                "warmup" => cfg.warmup = value.to_owned(),
                "warmup_file" => warmup_file = Some(PathBuf::from(value)),
                other => return Err(syntax(format!("unknown key {other:?}"))),
            }
        }
        if let Some(path) = warmup_file {
            let code = std::fs::read_to_string(&path)
                .map_err(|source| ConfigError::Read { path, source })?;
            if !cfg.warmup.is_empty() {
                cfg.warmup.push('\n');
            }
            cfg.warmup.push_str(&code);
        }
        Ok(cfg)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_keys() {
        let cfg = AgentConfig::parse(
            "# comment\nmodules = vsock, virtio_vsock\n\npython=/usr/bin/python3\nwarmup = import json; x = 1\n",
        )
        .unwrap();
        assert_eq!(cfg.modules, ["vsock", "virtio_vsock"]);
        assert_eq!(cfg.python, PathBuf::from("/usr/bin/python3"));
        assert_eq!(cfg.warmup, "import json; x = 1");
    }

    #[test]
    fn rejects_unknown_keys_and_garbage() {
        let err = AgentConfig::parse("modulez = x").unwrap_err().to_string();
        assert!(err.contains("line 1") && err.contains("modulez"), "{err}");
        let err = AgentConfig::parse("\njust words").unwrap_err().to_string();
        assert!(err.contains("line 2"), "{err}");
    }
}
