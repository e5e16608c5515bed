//! Content hashes. BLAKE3 was chosen over SHA-256 after measuring both on the
//! target machine (see docs/snapshot-store.md and the store-bench example):
//! it is several times faster per core even against SHA-NI, and hashing sits
//! on the pack/unpack and cache-ingest paths.

use std::fmt;
use std::str::FromStr;

use crate::error::StoreError;

/// Textual prefix naming the algorithm, so a future algorithm can coexist.
pub const ALGORITHM_PREFIX: &str = "blake3:";

#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Digest([u8; 32]);

impl Digest {
    pub fn of(bytes: &[u8]) -> Self {
        Digest(*blake3::hash(bytes).as_bytes())
    }

    pub fn from_bytes(bytes: &[u8]) -> Result<Self, StoreError> {
        let arr: [u8; 32] = bytes.try_into().map_err(|_| StoreError::InvalidDigest {
            text: hex::encode(bytes),
            reason: "expected 32 bytes",
        })?;
        Ok(Digest(arr))
    }

    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// Lower-case hex without the algorithm prefix (used in object keys).
    pub fn hex(&self) -> String {
        hex::encode(self.0)
    }

    /// Parses `blake3:<64 hex>` or bare `<64 hex>`.
    pub fn parse(text: &str) -> Result<Self, StoreError> {
        let hex_part = text.strip_prefix(ALGORITHM_PREFIX).unwrap_or(text);
        let bad = |reason| StoreError::InvalidDigest {
            text: text.to_string(),
            reason,
        };
        if hex_part.len() != 64 {
            return Err(bad(
                "expected 64 hex digits (optionally prefixed by \"blake3:\")",
            ));
        }
        if !hex_part
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        {
            return Err(bad("expected lower-case hex digits"));
        }
        let mut out = [0u8; 32];
        hex::decode_to_slice(hex_part, &mut out).map_err(|_| bad("not hex"))?;
        Ok(Digest(out))
    }

    /// True when `text` looks like a digest rather than a tag.
    pub fn looks_like_digest(text: &str) -> bool {
        Self::parse(text).is_ok()
    }
}

impl fmt::Display for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{ALGORITHM_PREFIX}{}", self.hex())
    }
}

impl fmt::Debug for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl FromStr for Digest {
    type Err = StoreError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Digest::parse(s)
    }
}

/// Incremental hashing for streamed content (pack import, downloads).
#[derive(Default)]
pub struct Hasher(blake3::Hasher);

impl Hasher {
    pub fn new() -> Self {
        Self::default()
    }
    pub fn update(&mut self, bytes: &[u8]) {
        self.0.update(bytes);
    }
    pub fn finish(&self) -> Digest {
        Digest(*self.0.finalize().as_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_parse_roundtrip() {
        let d = Digest::of(b"tine");
        let text = d.to_string();
        assert!(text.starts_with("blake3:"));
        assert_eq!(Digest::parse(&text).unwrap(), d);
        assert_eq!(Digest::parse(&d.hex()).unwrap(), d);
    }

    #[test]
    fn parse_rejects_garbage() {
        assert!(Digest::parse("blake3:abc").is_err());
        assert!(Digest::parse(&"G".repeat(64)).is_err());
        assert!(
            Digest::parse(&"A".repeat(64)).is_err(),
            "upper case would alias keys"
        );
    }

    #[test]
    fn streaming_matches_oneshot() {
        let mut h = Hasher::new();
        h.update(b"ti");
        h.update(b"ne");
        assert_eq!(h.finish(), Digest::of(b"tine"));
    }
}
