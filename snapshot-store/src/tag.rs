//! Tag names. Tags become object keys and file names, so they are validated
//! strictly rather than escaped.

use crate::digest::Digest;
use crate::error::StoreError;

pub const MAX_TAG_LEN: usize = tine_proto::names::MAX_NAME_LEN;

/// Accepts `[A-Za-z0-9][A-Za-z0-9._+-]*`, at most 128 bytes, not `..`-containing
/// and not a digest (so `pull X` is never ambiguous).
pub fn validate_tag(tag: &str) -> Result<(), StoreError> {
    // One rule set for every name in Tine (tags, sandbox and executor ids).
    tine_proto::names::check_name("tag", tag).map_err(|e| StoreError::InvalidTag {
        tag: tag.to_string(),
        reason: e.reason,
    })?;
    if Digest::looks_like_digest(tag) {
        return Err(StoreError::InvalidTag {
            tag: tag.to_string(),
            reason: "looks like a digest",
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_reasonable_tags() {
        for t in ["python", "py3.12+pandas", "repo-checkout_v2", "A1"] {
            validate_tag(t).unwrap();
        }
    }

    #[test]
    fn rejects_hostile_tags() {
        let long = "a".repeat(129);
        for t in [
            "",
            "a/b",
            "..",
            "a..b",
            "-x",
            ".hidden",
            "a\nb",
            "a\0b",
            "a b",
            long.as_str(),
            "x\\y",
        ] {
            let err = validate_tag(t).unwrap_err();
            assert!(err.to_string().contains("invalid tag"), "{t:?}: {err}");
        }
        let digest = Digest::of(b"x").hex();
        assert!(validate_tag(&digest).is_err());
    }
}
