//! A child's egress policy and its nftables rules. Parsed and checked here, so nothing a
//! caller typed reaches `nft` unvalidated.

pub use tine_proto::net::{Target, TargetError, MAX_ENTRIES};

/// The nft match for `t` (destination address, and port if any).
fn nft_match(t: &Target) -> String {
    match t.port {
        None => format!("ip daddr {}/{}", t.addr, t.prefix),
        Some(p) => format!(
            "ip daddr {}/{} meta l4proto {{ tcp, udp }} th dport {p}",
            t.addr, t.prefix
        ),
    }
}

/// Where a child may send traffic. Deny entries win over allow entries, which win over
/// `internet`. The executor's own addresses, link-local addresses and other children are out
/// of reach whatever this says (the host's table, not this one).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Policy {
    pub internet: bool,
    pub allow: Vec<Target>,
    pub deny: Vec<Target>,
}

impl Policy {
    /// The rules of the `egress` chain: what leaves the guest's tap toward the host.
    pub(super) fn egress_rules(&self) -> Vec<String> {
        // An ICMP "administratively prohibited" makes a connect fail at once with a clear
        // error (EHOSTUNREACH) instead of hanging until its timeout.
        const REFUSE: &str = "reject with icmp type admin-prohibited";
        let mut rules = Vec::new();
        for t in &self.deny {
            rules.push(format!("{} {REFUSE}", nft_match(t)));
        }
        for t in &self.allow {
            rules.push(format!("{} accept", nft_match(t)));
        }
        rules.push(if self.internet {
            "accept".to_string()
        } else {
            REFUSE.to_string()
        });
        rules
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deny_comes_before_allow_before_the_internet_default() {
        let p = Policy {
            internet: false,
            allow: vec!["198.51.100.0/24:80".parse().unwrap()],
            deny: vec!["198.51.100.9".parse().unwrap()],
        };
        let r = p.egress_rules();
        assert_eq!(r.len(), 3);
        assert!(r[0].starts_with("ip daddr 198.51.100.9/32 reject"), "{r:?}");
        assert!(r[1].contains("th dport 80 accept"), "{r:?}");
        assert!(r[2].starts_with("reject"), "{r:?}");
        let open = Policy {
            internet: true,
            ..Policy::default()
        };
        assert_eq!(open.egress_rules(), ["accept"]);
    }
}
