//! Network policy entries as every side of the APIs checks them: the CLI and the Python
//! client's server side, the control plane (INVALID_ARGUMENT before scheduling) and the
//! executor (which turns them into rules).

use std::fmt;
use std::net::Ipv4Addr;
use std::str::FromStr;

/// Most entries a spawn's allow or deny list may hold (each is a rule on the child's path).
pub const MAX_ENTRIES: usize = 256;

/// An IPv4 network, optionally narrowed to one port (TCP and UDP): `10.0.0.0/8`,
/// `203.0.113.7`, `203.0.113.7:443`, `192.0.2.0/24:53`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Target {
    pub addr: Ipv4Addr,
    pub prefix: u8,
    pub port: Option<u16>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("{input:?} is not CIDR[:port] (e.g. 10.0.0.0/8 or 203.0.113.7:443): {why}")]
pub struct TargetError {
    pub input: String,
    pub why: &'static str,
}

impl FromStr for Target {
    type Err = TargetError;

    fn from_str(s: &str) -> Result<Target, TargetError> {
        let err = |why| TargetError {
            input: s.to_string(),
            why,
        };
        let (net, port) = match s.rsplit_once(':') {
            Some((n, p)) => {
                let port = p
                    .parse::<u16>()
                    .ok()
                    .filter(|p| *p != 0)
                    .ok_or_else(|| err("the port is not 1..=65535"))?;
                (n, Some(port))
            }
            None => (s, None),
        };
        let (addr, prefix) = match net.split_once('/') {
            Some((a, p)) => (
                a,
                p.parse::<u8>()
                    .ok()
                    .filter(|p| *p <= 32)
                    .ok_or_else(|| err("the prefix is not 0..=32"))?,
            ),
            None => (net, 32),
        };
        let addr: Ipv4Addr = addr.parse().map_err(|_| err("not an IPv4 address"))?;
        let mask = u32::MAX.checked_shl(32 - prefix as u32).unwrap_or(0);
        if u32::from(addr) & !mask != 0 {
            return Err(err("host bits are set below the prefix"));
        }
        Ok(Target { addr, prefix, port })
    }
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)?;
        if let Some(p) = self.port {
            write!(f, ":{p}")?;
        }
        Ok(())
    }
}

/// Parse a request's list (`field` names it in errors), bounded by [`MAX_ENTRIES`].
pub fn parse_list(field: &str, entries: &[String]) -> Result<Vec<Target>, String> {
    if entries.len() > MAX_ENTRIES {
        return Err(format!(
            "{field}: {} entries, at most {MAX_ENTRIES}",
            entries.len()
        ));
    }
    entries
        .iter()
        .map(|e| e.parse().map_err(|err| format!("{field}: {err}")))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_parse_with_and_without_prefix_and_port() {
        let t: Target = "203.0.113.7:443".parse().unwrap();
        assert_eq!((t.prefix, t.port), (32, Some(443)));
        let t: Target = "10.0.0.0/8".parse().unwrap();
        assert_eq!((t.prefix, t.port), (8, None));
        assert_eq!(t.to_string(), "10.0.0.0/8");
        let t: Target = "0.0.0.0/0:53".parse().unwrap();
        assert_eq!(t.to_string(), "0.0.0.0/0:53");
    }

    #[test]
    fn malformed_or_hostile_targets_are_refused() {
        for bad in [
            "",
            "10.0.0.1/33",
            "10.0.0.1/24",
            "10.0.0.0/8:0",
            "10.0.0.0/8:70000",
            "example.com",
            "10.0.0.0/8 accept",
            "10.0.0.0/8; flush ruleset",
            "::1",
        ] {
            assert!(bad.parse::<Target>().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn lists_are_bounded() {
        let many: Vec<String> = (0..=MAX_ENTRIES).map(|_| "10.0.0.0/8".into()).collect();
        assert!(parse_list("allow", &many).unwrap_err().contains("at most"));
        assert_eq!(parse_list("allow", &many[..2]).unwrap().len(), 2);
        assert!(parse_list("deny", &["x".into()])
            .unwrap_err()
            .starts_with("deny: "));
    }
}
