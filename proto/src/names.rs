//! Names that become file names, object keys and database keys: snapshot tags, sandbox ids
//! and executor ids. They are validated once, where they enter (a request, a command line),
//! and travel as these types afterwards, so code below the edge never sees an unchecked one.

use std::fmt;

pub const MAX_NAME_LEN: usize = 128;

/// Why a name was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NameError {
    pub kind: &'static str,
    pub value: String,
    pub reason: &'static str,
}

impl fmt::Display for NameError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invalid {} {:?}: {}", self.kind, self.value, self.reason)
    }
}

impl std::error::Error for NameError {}

/// `[A-Za-z0-9][A-Za-z0-9._+-]*`, at most 128 bytes, no `..`, and not 64 lower-case hex
/// digits (which would read as a content digest). Strict rather than escaped: these names
/// are used as path components.
pub fn check_name(kind: &'static str, value: &str) -> Result<(), NameError> {
    let bad = |reason| {
        Err(NameError {
            kind,
            value: value.to_string(),
            reason,
        })
    };
    if value.is_empty() {
        return bad("empty");
    }
    if value.len() > MAX_NAME_LEN {
        return bad("longer than 128 bytes");
    }
    if value.chars().any(|c| c.is_control()) {
        return bad("contains a control character");
    }
    if value.contains('/') || value.contains('\\') {
        return bad("contains a path separator");
    }
    if value.contains("..") {
        return bad("contains \"..\"");
    }
    if !value.as_bytes()[0].is_ascii_alphanumeric() {
        return bad("must start with a letter or digit");
    }
    if !value
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-' | b'+'))
    {
        return bad("only letters, digits and . _ - + are allowed");
    }
    let digest = value.len() == 64
        && value
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
    if digest {
        return bad("looks like a digest");
    }
    Ok(())
}

macro_rules! name_type {
    ($(#[$doc:meta])* $name:ident, $kind:literal) => {
        $(#[$doc])*
        #[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub struct $name(String);

        impl $name {
            pub fn parse(value: impl Into<String>) -> Result<$name, NameError> {
                let value = value.into();
                check_name($kind, &value)?;
                Ok($name(value))
            }
            pub fn as_str(&self) -> &str {
                &self.0
            }
            pub fn into_string(self) -> String {
                self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl AsRef<str> for $name {
            fn as_ref(&self) -> &str {
                &self.0
            }
        }

        impl std::str::FromStr for $name {
            type Err = NameError;
            fn from_str(s: &str) -> Result<$name, NameError> {
                $name::parse(s)
            }
        }
    };
}

name_type!(
    /// A snapshot tag.
    Tag,
    "tag"
);
name_type!(
    /// A sandbox (VM) id, chosen by the control plane or `tine fork`.
    SandboxId,
    "sandbox id"
);
name_type!(
    /// An executor's id in the cluster.
    ExecutorId,
    "executor id"
);

impl SandboxId {
    /// A fresh random id, `<prefix>-<16 hex digits>`, the prefix cut to fit the length
    /// limit; a prefix that is not a valid name becomes `vm`.
    pub fn random(prefix: &str) -> SandboxId {
        let mut b = [0u8; 8];
        getrandom::fill(&mut b).expect("getrandom");
        let hex: String = b.iter().map(|x| format!("{x:02x}")).collect();
        let room = MAX_NAME_LEN - 1 - hex.len();
        let prefix = match check_name("prefix", prefix) {
            // Valid names are ASCII, so any cut is a char boundary.
            Ok(()) => prefix[..prefix.len().min(room)].trim_end_matches(['.', '-', '_', '+']),
            Err(_) => "vm",
        };
        let prefix = if prefix.is_empty() { "vm" } else { prefix };
        SandboxId::parse(format!("{prefix}-{hex}"))
            .unwrap_or_else(|_| SandboxId::parse(format!("vm-{hex}")).expect("a fixed valid name"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hostile_names_are_refused() {
        let long = "a".repeat(129);
        let digest = "ab".repeat(32);
        for bad in [
            "", "a/b", "..", "a..b", "-x", ".hidden", "a\nb", "a\0b", "a b", "x\\y", &long, &digest,
        ] {
            let e = Tag::parse(bad).unwrap_err();
            assert!(e.to_string().starts_with("invalid tag"), "{bad:?}: {e}");
        }
        for good in ["python", "py3.12+pandas", "repo-checkout_v2", "A1"] {
            assert_eq!(Tag::parse(good).unwrap().as_str(), good);
        }
        let id = SandboxId::random("sbx");
        assert!(id.as_str().starts_with("sbx-") && id.as_str().len() == 20);
        assert!(SandboxId::parse("../x").is_err());
        // Long tags still give valid ids (the prefix is cut), hostile ones a neutral prefix.
        let long = SandboxId::random(&"t".repeat(128));
        assert_eq!(long.as_str().len(), MAX_NAME_LEN);
        assert!(SandboxId::random("../etc").as_str().starts_with("vm-"));
    }
}
