//! Validation of guest paths supplied by the host.

use std::path::{Component, Path, PathBuf};

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PathError {
    #[error("path is empty")]
    Empty,
    #[error("path {0:?} contains a NUL byte")]
    Nul(String),
    #[error("path {0:?} is relative; guest paths must be absolute")]
    Relative(String),
    #[error("path {0:?} contains a `..` component, which is not allowed")]
    ParentDir(String),
}

/// Accepts only absolute paths without NUL bytes or `..` components, so a
/// path means the same thing no matter which directory the agent runs in.
pub fn validate_guest_path(path: &str) -> Result<PathBuf, PathError> {
    if path.is_empty() {
        return Err(PathError::Empty);
    }
    if path.contains('\0') {
        return Err(PathError::Nul(path.into()));
    }
    let p = Path::new(path);
    if !p.is_absolute() {
        return Err(PathError::Relative(path.into()));
    }
    if p.components().any(|c| c == Component::ParentDir) {
        return Err(PathError::ParentDir(path.into()));
    }
    Ok(p.to_path_buf())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_and_rejects() {
        assert_eq!(
            validate_guest_path("/tmp/x").unwrap(),
            PathBuf::from("/tmp/x")
        );
        assert_eq!(validate_guest_path(""), Err(PathError::Empty));
        assert!(matches!(
            validate_guest_path("tmp/x"),
            Err(PathError::Relative(_))
        ));
        assert!(matches!(
            validate_guest_path("/tmp/../etc"),
            Err(PathError::ParentDir(_))
        ));
        assert!(matches!(
            validate_guest_path("/tmp/a\0b"),
            Err(PathError::Nul(_))
        ));
        // `..` inside a name is just a name.
        assert!(validate_guest_path("/tmp/a..b").is_ok());
    }
}
