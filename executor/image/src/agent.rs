//! The guest agent binary that `tine image build` puts into images. It is a build artifact
//! (`deploy/build.sh` puts it beside `tine`); the image builder never compiles anything.

use std::path::{Path, PathBuf};

use crate::elf::{check_static_x86_64, ElfProblem};

/// How to get a usable agent, appended to every agent error.
const HOW: &str = "`tine image build` needs the static tine-agent: pass --agent PATH, or put \
                   tine-agent beside the tine binary; `deploy/build.sh [OUTDIR]` in a Tine \
                   checkout builds both side by side";

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    // `error` is part of the message (before the advice), so it is not a `source`.
    #[error("cannot read the guest agent {}: {error}. {HOW}", path.display())]
    Unreadable {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("the guest agent {} is not a static x86_64 executable: {problem}. {HOW}", path.display())]
    NotStatic { path: PathBuf, problem: ElfProblem },
    #[error("cannot locate the running tine binary to find tine-agent beside it: {0}. {HOW}")]
    NoExecutable(std::io::Error),
}

/// The agent `tine image build` uses without `--agent`: `tine-agent` in the directory of
/// `exe`, the running binary (`std::env::current_exe()`, which resolves symlinks, so a `tine`
/// linked into `/usr/local/bin` finds the agent next to the real file).
pub fn beside(exe: &Path) -> PathBuf {
    exe.with_file_name(tine_agent::build::BINARY_NAME)
}

/// `explicit` if given, else the agent beside `exe` (the running binary, or why it could not
/// be found).
pub fn choose(
    explicit: Option<PathBuf>,
    exe: std::io::Result<PathBuf>,
) -> Result<PathBuf, AgentError> {
    match explicit {
        Some(path) => Ok(path),
        None => exe.map(|e| beside(&e)).map_err(AgentError::NoExecutable),
    }
}

/// Reads the agent at `path` and checks that it can run as the guest's PID 1.
pub fn read_agent(path: &Path) -> Result<Vec<u8>, AgentError> {
    let data = std::fs::read(path).map_err(|error| AgentError::Unreadable {
        path: path.to_path_buf(),
        error,
    })?;
    check_static_x86_64(&data).map_err(|problem| AgentError::NotStatic {
        path: path.to_path_buf(),
        problem,
    })?;
    Ok(data)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_agent_flag_the_agent_is_looked_for_beside_the_executable() {
        let exe = Ok(PathBuf::from("/opt/tine/tine"));
        assert_eq!(
            choose(None, exe).unwrap(),
            PathBuf::from("/opt/tine/tine-agent")
        );
        let exe = Ok(PathBuf::from("/opt/tine/tine"));
        assert_eq!(
            choose(Some("/a/agent".into()), exe).unwrap(),
            PathBuf::from("/a/agent")
        );
        let gone = Err(std::io::Error::from(std::io::ErrorKind::NotFound));
        assert!(matches!(
            choose(None, gone),
            Err(AgentError::NoExecutable(_))
        ));
    }

    #[test]
    fn errors_name_the_path_and_how_to_build_the_agent() {
        let tmp = tempfile::tempdir().unwrap();
        let missing = tmp.path().join("tine-agent");
        let e = read_agent(&missing).unwrap_err().to_string();
        assert!(e.contains(&missing.display().to_string()), "{e}");
        assert!(
            e.contains("deploy/build.sh") && e.contains("--agent"),
            "{e}"
        );

        // A dynamically linked executable (this test binary) is refused, saying why.
        let me = std::env::current_exe().unwrap();
        let e = read_agent(&me).unwrap_err();
        assert!(
            matches!(
                e,
                AgentError::NotStatic {
                    problem: ElfProblem::Dynamic,
                    ..
                }
            ),
            "{e}"
        );
        let e = e.to_string();
        assert!(
            e.contains(&me.display().to_string()) && e.contains("PT_INTERP"),
            "{e}"
        );

        let script = tmp.path().join("script");
        std::fs::write(&script, "#!/bin/sh\n").unwrap();
        let e = read_agent(&script).unwrap_err().to_string();
        assert!(e.contains("not an ELF file"), "{e}");
    }
}
