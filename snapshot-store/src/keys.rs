//! Ed25519 key files for signing packs. Text files so they can be inspected
//! and pasted: `tine-ed25519-secret-key <64 hex>` / `tine-ed25519-public-key <64 hex>`.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use ed25519_dalek::{SigningKey, VerifyingKey};

use crate::error::{Result, StoreError};

const SECRET_TAG: &str = "tine-ed25519-secret-key";
const PUBLIC_TAG: &str = "tine-ed25519-public-key";

pub fn generate_signing_key() -> Result<SigningKey> {
    let mut seed = [0u8; 32];
    getrandom::fill(&mut seed)
        .map_err(|e| StoreError::Signature(format!("no randomness for a key: {e}")))?;
    Ok(SigningKey::from_bytes(&seed))
}

/// Writes `path` (secret, mode 0600) and `path.pub`; refuses to overwrite.
pub fn write_keypair(path: &Path, key: &SigningKey) -> Result<PathBuf> {
    let pub_path = PathBuf::from(format!("{}.pub", path.display()));
    let write = |p: &Path, text: String, mode: u32| -> Result<()> {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .open(p)
            .map_err(StoreError::io("create key file", p))?;
        f.write_all(text.as_bytes())
            .map_err(StoreError::io("write key file", p))?;
        f.sync_all().map_err(StoreError::io("fsync key file", p))
    };
    // The public half first: a pair that cannot be completed leaves no secret key behind.
    write(
        &pub_path,
        format!(
            "{PUBLIC_TAG} {}\n",
            hex::encode(key.verifying_key().to_bytes())
        ),
        0o644,
    )?;
    if let Err(e) = write(
        path,
        format!("{SECRET_TAG} {}\n", hex::encode(key.to_bytes())),
        0o600,
    ) {
        let _ = std::fs::remove_file(&pub_path);
        return Err(e);
    }
    Ok(pub_path)
}

fn read_key_bytes(path: &Path, tag: &str) -> Result<[u8; 32]> {
    let text = std::fs::read_to_string(path).map_err(StoreError::io("read key file", path))?;
    let bad = |why: &str| StoreError::Signature(format!("{}: {why}", path.display()));
    let rest = text
        .trim()
        .strip_prefix(tag)
        .ok_or_else(|| bad(&format!("not a {tag} file")))?;
    let mut out = [0u8; 32];
    hex::decode_to_slice(rest.trim(), &mut out).map_err(|_| bad("key is not 64 hex digits"))?;
    Ok(out)
}

pub fn load_signing_key(path: &Path) -> Result<SigningKey> {
    Ok(SigningKey::from_bytes(&read_key_bytes(path, SECRET_TAG)?))
}

pub fn load_verifying_key(path: &Path) -> Result<VerifyingKey> {
    let bytes = read_key_bytes(path, PUBLIC_TAG)?;
    VerifyingKey::from_bytes(&bytes)
        .map_err(|e| StoreError::Signature(format!("{}: invalid public key: {e}", path.display())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keypair_roundtrip() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("k");
        let key = generate_signing_key().unwrap();
        let pub_path = write_keypair(&path, &key).unwrap();
        assert_eq!(load_signing_key(&path).unwrap().to_bytes(), key.to_bytes());
        assert_eq!(load_verifying_key(&pub_path).unwrap(), key.verifying_key());
        assert!(load_verifying_key(&path)
            .unwrap_err()
            .to_string()
            .contains("not a"));
        assert!(write_keypair(&path, &key).is_err(), "must not overwrite");
    }

    /// Either half already there: the other is not written, and nothing is left half-made.
    #[test]
    fn a_keypair_that_cannot_be_completed_leaves_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let key = generate_signing_key().unwrap();
        let path = dir.path().join("a");
        std::fs::write(dir.path().join("a.pub"), "someone else's\n").unwrap();
        assert!(write_keypair(&path, &key).is_err());
        assert!(!path.exists(), "no orphan secret key");
        assert_eq!(
            std::fs::read_to_string(dir.path().join("a.pub")).unwrap(),
            "someone else's\n"
        );
        let path = dir.path().join("b");
        std::fs::write(&path, "an older secret\n").unwrap();
        assert!(write_keypair(&path, &key).is_err());
        assert!(!dir.path().join("b.pub").exists(), "no orphan public key");
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "an older secret\n");
    }
}
