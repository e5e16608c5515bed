//! Bearer-token authentication with named tokens and roles. Tokens are compared as SHA-256
//! digests in constant time, so neither their content nor their length leaks through timing.

use std::path::Path;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;
use tonic::metadata::{AsciiMetadataValue, MetadataMap};
use tonic::service::Interceptor;
use tonic::{Request, Status};

/// What a token may do.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Everything, including draining executors.
    Admin,
    /// Snapshots and sandboxes; read-only on executors.
    User,
    /// Executor daemons: register and heartbeat only. Also the secret the control plane
    /// presents to executors.
    Executor,
}

/// Who made a call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Principal {
    pub name: String,
    pub role: Role,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct TokenEntry {
    pub name: String,
    pub role: Role,
    pub token: String,
}

/// The tokens file: `{"tokens": [{"name": ..., "role": "admin"|"user"|"executor", "token": ...}]}`.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct TokensFile {
    pub tokens: Vec<TokenEntry>,
}

#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    #[error("token {name:?} is too weak: {reason} (generate one with `tine token new`)")]
    Weak { name: String, reason: &'static str },
    #[error("token name {0:?} is used twice")]
    DuplicateName(String),
    #[error("the same token is given to {0:?} and {1:?}")]
    DuplicateToken(String, String),
    #[error("{path}: {what}")]
    File { path: String, what: String },
}

pub const MIN_TOKEN_LEN: usize = 32;

/// The name of a token that speaks for executor `id` alone (one token per executor).
pub fn executor_token_name(id: &str) -> String {
    format!("executor:{id}")
}

/// The executor a token named `name` speaks for alone, if it is such a token.
pub fn bound_executor(name: &str) -> Option<&str> {
    name.strip_prefix("executor:")
}

/// Refuse a file holding secrets that users other than its owner may read or write.
fn check_private(path: &Path) -> Result<(), TokenError> {
    use std::os::unix::fs::PermissionsExt;
    let meta = std::fs::metadata(path).map_err(|e| TokenError::File {
        path: path.display().to_string(),
        what: e.to_string(),
    })?;
    let mode = meta.permissions().mode();
    if mode & 0o077 != 0 {
        return Err(TokenError::File {
            path: path.display().to_string(),
            what: format!(
                "mode {:o} lets other users read the token; chmod 600 it",
                mode & 0o777
            ),
        });
    }
    Ok(())
}

/// A single token kept in a file (an executor's `--token-file`, a client's `TINE_TOKEN_FILE`):
/// its trimmed text, refusing a file that others can read.
pub fn read_token_file(path: &Path) -> Result<String, TokenError> {
    check_private(path)?;
    let text = std::fs::read_to_string(path).map_err(|e| TokenError::File {
        path: path.display().to_string(),
        what: e.to_string(),
    })?;
    let token = text.trim();
    if token.is_empty() {
        return Err(TokenError::File {
            path: path.display().to_string(),
            what: "holds no token".into(),
        });
    }
    Ok(token.to_string())
}

/// Refuse tokens a person typed or copied from an example.
pub fn check_strength(name: &str, token: &str) -> Result<(), TokenError> {
    let weak = |reason| {
        Err(TokenError::Weak {
            name: name.to_string(),
            reason,
        })
    };
    if token.len() < MIN_TOKEN_LEN {
        return weak("shorter than 32 characters");
    }
    if token.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return weak("contains whitespace or control characters");
    }
    let lower = token.to_ascii_lowercase();
    for placeholder in [
        "changeme",
        "change-me",
        "password",
        "example",
        "placeholder",
        "secret",
        "xxxxxxxx",
        "12345678",
        "test-token",
    ] {
        if lower.contains(placeholder) {
            return weak("looks like a placeholder");
        }
    }
    let mut distinct: Vec<char> = token.chars().collect();
    distinct.sort_unstable();
    distinct.dedup();
    if distinct.len() < 10 {
        return weak("fewer than 10 distinct characters");
    }
    Ok(())
}

/// A fresh random token: `tine_` and 64 hex digits (256 bits).
pub fn generate_token() -> String {
    let mut b = [0u8; 32];
    getrandom::fill(&mut b).expect("getrandom");
    format!("tine_{}", hex::encode(b))
}

struct Known {
    principal: Principal,
    digest: [u8; 32],
}

/// The accepted tokens.
pub struct TokenSet {
    known: Vec<Known>,
}

impl std::fmt::Debug for TokenSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenSet")
            .field(
                "names",
                &self
                    .known
                    .iter()
                    .map(|k| &k.principal.name)
                    .collect::<Vec<_>>(),
            )
            .finish()
    }
}

fn digest(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

impl TokenSet {
    pub fn new(entries: &[TokenEntry]) -> Result<TokenSet, TokenError> {
        let mut known: Vec<Known> = Vec::new();
        for e in entries {
            check_strength(&e.name, &e.token)?;
            if known.iter().any(|k| k.principal.name == e.name) {
                return Err(TokenError::DuplicateName(e.name.clone()));
            }
            let d = digest(&e.token);
            if let Some(k) = known.iter().find(|k| k.digest == d) {
                return Err(TokenError::DuplicateToken(
                    k.principal.name.clone(),
                    e.name.clone(),
                ));
            }
            known.push(Known {
                principal: Principal {
                    name: e.name.clone(),
                    role: e.role,
                },
                digest: d,
            });
        }
        Ok(TokenSet { known })
    }

    /// Load a tokens file, refusing one that others can read.
    pub fn load(path: &Path) -> Result<TokenSet, TokenError> {
        Ok(TokenSet::load_file(path)?.0)
    }

    /// [`TokenSet::load`], also returning the file's entries (for callers that need a token
    /// itself, e.g. to present it to executors, or that edit the file).
    pub fn load_file(path: &Path) -> Result<(TokenSet, TokensFile), TokenError> {
        let file_err = |what: String| TokenError::File {
            path: path.display().to_string(),
            what,
        };
        check_private(path)?;
        let text = std::fs::read_to_string(path).map_err(|e| file_err(e.to_string()))?;
        let parsed: TokensFile =
            serde_json::from_str(&text).map_err(|e| file_err(e.to_string()))?;
        if parsed.tokens.is_empty() {
            return Err(file_err("holds no tokens".into()));
        }
        Ok((TokenSet::new(&parsed.tokens)?, parsed))
    }

    /// The principal whose token `presented` is. Every entry is compared (no early exit).
    pub fn check(&self, presented: &str) -> Option<Principal> {
        let d = digest(presented);
        let mut found = None;
        for k in &self.known {
            if bool::from(k.digest.ct_eq(&d)) {
                found = Some(k.principal.clone());
            }
        }
        found
    }

    /// Authenticate a call from its `authorization: Bearer <token>` metadata.
    pub fn authenticate(&self, md: &MetadataMap) -> Result<Principal, Status> {
        self.authenticate_value(md.get("authorization").map(|v| v.as_bytes()))
    }

    /// [`TokenSet::authenticate`] on a request's HTTP headers (before it is decoded).
    pub fn authenticate_headers(&self, headers: &http::HeaderMap) -> Result<Principal, Status> {
        self.authenticate_value(headers.get("authorization").map(|v| v.as_bytes()))
    }

    fn authenticate_value(&self, value: Option<&[u8]>) -> Result<Principal, Status> {
        let Some(value) = value else {
            return Err(Status::unauthenticated(
                "missing `authorization: Bearer <token>` metadata (set TINE_TOKEN)",
            ));
        };
        let value = std::str::from_utf8(value)
            .ok()
            .filter(|v| v.is_ascii())
            .ok_or_else(|| Status::unauthenticated("authorization metadata is not ASCII"))?;
        let Some(token) = value.strip_prefix("Bearer ") else {
            return Err(Status::unauthenticated(
                "authorization must be `Bearer <token>`",
            ));
        };
        self.check(token.trim())
            .ok_or_else(|| Status::unauthenticated("unknown token"))
    }
}

/// A tokens set holding one secret, the cluster's executor token, as the control plane
/// presents it to executors.
pub fn executor_secret(token: &str) -> Result<TokenSet, TokenError> {
    TokenSet::new(&[TokenEntry {
        name: "control-plane".into(),
        role: Role::Executor,
        token: token.to_string(),
    }])
}

/// Client side: adds `authorization: Bearer <token>` (when there is one) and the current
/// trace context to every request.
#[derive(Clone)]
pub struct Bearer(Option<AsciiMetadataValue>);

impl Bearer {
    pub fn new(token: Option<&str>) -> Result<Bearer, TokenError> {
        token
            .map(|t| {
                format!("Bearer {t}")
                    .parse::<AsciiMetadataValue>()
                    .map_err(|_| TokenError::Weak {
                        name: "token".into(),
                        reason: "not printable ASCII",
                    })
            })
            .transpose()
            .map(Bearer)
    }
}

impl Interceptor for Bearer {
    fn call(&mut self, mut req: Request<()>) -> Result<Request<()>, Status> {
        if let Some(v) = &self.0 {
            req.metadata_mut().insert("authorization", v.clone());
        }
        crate::telemetry::inject_current(req.metadata_mut());
        Ok(req)
    }
}

/// Write a tokens file atomically with mode 0600.
pub fn write_tokens_file(path: &Path, file: &TokensFile) -> std::io::Result<()> {
    write_private_file(
        path,
        &serde_json::to_vec_pretty(file).map_err(std::io::Error::other)?,
    )
}

/// Write `data` to `path` atomically (temp file, fsync, rename), readable by the owner only.
pub fn write_private_file(path: &Path, data: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let tmp = path.with_extension("tmp");
    let _ = std::fs::remove_file(&tmp);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)?;
    f.write_all(data)?;
    f.sync_all()?;
    std::fs::rename(&tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(name: &str, role: Role, token: &str) -> TokenEntry {
        TokenEntry {
            name: name.into(),
            role,
            token: token.into(),
        }
    }

    #[test]
    fn weak_tokens_are_refused() {
        for t in [
            "short",
            "changeme-changeme-changeme-changeme",
            "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
            "abababababababababababababababababab",
            "my secret token that is long enough 123",
        ] {
            assert!(check_strength("t", t).is_err(), "{t} accepted");
        }
        check_strength("t", &generate_token()).unwrap();
    }

    #[test]
    fn tokens_map_to_their_principal_only() {
        let (a, u) = (generate_token(), generate_token());
        let set =
            TokenSet::new(&[entry("ops", Role::Admin, &a), entry("ci", Role::User, &u)]).unwrap();
        assert_eq!(set.check(&a).unwrap().role, Role::Admin);
        assert_eq!(set.check(&u).unwrap().name, "ci");
        assert!(set.check(&generate_token()).is_none());
        assert!(set.check(&a[..a.len() - 1]).is_none());
        let dup = TokenSet::new(&[entry("a", Role::Admin, &a), entry("b", Role::User, &a)]);
        assert!(matches!(dup, Err(TokenError::DuplicateToken(..))));
    }

    #[test]
    fn readable_tokens_file_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("tokens.json");
        let file = TokensFile {
            tokens: vec![entry("ops", Role::Admin, &generate_token())],
        };
        write_tokens_file(&p, &file).unwrap();
        TokenSet::load(&p).unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
        let err = TokenSet::load(&p).unwrap_err().to_string();
        assert!(err.contains("chmod 600"), "{err}");
    }

    #[test]
    fn a_token_file_others_can_read_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("executor.token");
        std::fs::write(&p, "  s3cret-token-text\n").unwrap();
        for mode in [0o644, 0o640, 0o604, 0o660] {
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
            let err = read_token_file(&p).unwrap_err().to_string();
            assert!(err.contains("chmod 600"), "{mode:o}: {err}");
        }
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(read_token_file(&p).unwrap(), "s3cret-token-text");
        std::fs::write(&p, "\n").unwrap();
        assert!(read_token_file(&p)
            .unwrap_err()
            .to_string()
            .contains("holds no token"));
    }
}
