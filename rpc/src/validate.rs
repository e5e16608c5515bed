//! Input checks shared by every RPC: each failure is an INVALID_ARGUMENT naming the field.
//! Names are parsed into their validated types here, at the edge.

use tine_proto::limits::{
    MAX_CPU_MILLIS, MAX_GUEST_MEM_MIB, MAX_MEMORY_LIMIT_MIB, MAX_READY_TIMEOUT_MS, MAX_SPAWN,
    MAX_VCPUS, MAX_WARMUP_EVALS, MIN_CPU_MILLIS, MIN_GUEST_MEM_MIB, MIN_MEMORY_LIMIT_MIB,
};
use tine_proto::names::{ExecutorId, NameError, SandboxId, Tag};
use tonic::Status;

const MAX_CODE_BYTES: usize = 1 << 20;
const MAX_ARGV: usize = 4096;
const MAX_PATH: usize = 4096;

fn invalid(field: &str, why: impl std::fmt::Display) -> Status {
    Status::invalid_argument(format!("{field}: {why}"))
}

fn named<T>(field: &str, r: Result<T, NameError>) -> Result<T, Status> {
    r.map_err(|e| invalid(field, e))
}

/// Snapshot tags and image names: letters, digits, `.`, `_`, `-`, `+`, no `/` or `..`, at most
/// 128 bytes.
pub fn name(field: &str, value: &str) -> Result<(), Status> {
    tag(field, value).map(drop)
}

pub fn tag(field: &str, value: &str) -> Result<Tag, Status> {
    named(field, Tag::parse(value))
}

pub fn sandbox_id(field: &str, value: &str) -> Result<SandboxId, Status> {
    named(field, SandboxId::parse(value))
}

pub fn executor_id(field: &str, value: &str) -> Result<ExecutorId, Status> {
    named(field, ExecutorId::parse(value))
}

pub fn spawn_count(n: u32) -> Result<(), Status> {
    if n == 0 || n > MAX_SPAWN {
        return Err(invalid("count", format!("{n} is outside 1..={MAX_SPAWN}")));
    }
    Ok(())
}

/// A per-child readiness deadline: 0 (the default) or at most `MAX_READY_TIMEOUT_MS`.
pub fn ready_timeout_ms(ms: u32) -> Result<(), Status> {
    if ms > MAX_READY_TIMEOUT_MS {
        return Err(invalid(
            "ready_timeout_ms",
            format!("{ms} is over {MAX_READY_TIMEOUT_MS}"),
        ));
    }
    Ok(())
}

/// A parent VM's shape: vCPUs (0: one) up to `MAX_VCPUS`, guest memory 0 (the image's
/// recommendation) or within `MIN_GUEST_MEM_MIB..=MAX_GUEST_MEM_MIB`, and no more warm-up
/// snippets than `MAX_WARMUP_EVALS`, each a bounded piece of code.
pub fn parent_shape(r: &tine_proto::v1::CreateSnapshotRequest) -> Result<(), Status> {
    if r.vcpus > MAX_VCPUS {
        return Err(invalid("vcpus", format!("{} is over {MAX_VCPUS}", r.vcpus)));
    }
    let m = r.mem_mib;
    if m != 0 && !(MIN_GUEST_MEM_MIB..=MAX_GUEST_MEM_MIB).contains(&m) {
        return Err(invalid(
            "mem_mib",
            format!("{m} is outside {MIN_GUEST_MEM_MIB}..={MAX_GUEST_MEM_MIB} (0: the image's)"),
        ));
    }
    if r.warmup_eval.len() > MAX_WARMUP_EVALS {
        return Err(invalid(
            "warmup_eval",
            format!("more than {MAX_WARMUP_EVALS} entries"),
        ));
    }
    for c in &r.warmup_eval {
        code("warmup_eval", c)?;
    }
    Ok(())
}

/// A spawn's resources: each 0 (the default) or within its documented bounds.
pub fn resources(r: &tine_proto::v1::Resources) -> Result<(), Status> {
    let m = r.memory_limit_mib;
    if m != 0 && !(MIN_MEMORY_LIMIT_MIB..=MAX_MEMORY_LIMIT_MIB).contains(&m) {
        return Err(invalid(
            "resources.memory_limit_mib",
            format!(
                "{m} is outside {MIN_MEMORY_LIMIT_MIB}..={MAX_MEMORY_LIMIT_MIB} (0: the default)"
            ),
        ));
    }
    let c = r.cpu_millis;
    if c != 0 && !(MIN_CPU_MILLIS..=MAX_CPU_MILLIS).contains(&c) {
        return Err(invalid(
            "resources.cpu_millis",
            format!("{c} is outside {MIN_CPU_MILLIS}..={MAX_CPU_MILLIS} (0: unlimited)"),
        ));
    }
    Ok(())
}

/// A TCP port of a guest: 1..=65535.
pub fn guest_port(p: u32) -> Result<u16, Status> {
    u16::try_from(p)
        .ok()
        .filter(|p| *p != 0)
        .ok_or_else(|| invalid("guest_port", format!("{p} is outside 1..=65535")))
}

/// A spawn's network request, checked: `internet` None means the executor's default.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NetworkRequest {
    pub internet: Option<bool>,
    pub allow: Vec<tine_proto::net::Target>,
    pub deny: Vec<tine_proto::net::Target>,
}

pub fn network(n: &tine_proto::v1::Network) -> Result<NetworkRequest, Status> {
    use tine_proto::v1::Internet;
    let internet = match Internet::try_from(n.internet) {
        Ok(Internet::Default) => None,
        Ok(Internet::Allow) => Some(true),
        Ok(Internet::Deny) => Some(false),
        Err(_) => return Err(invalid("network.internet", "unknown value")),
    };
    let list = |field, l: &[String]| {
        tine_proto::net::parse_list(field, l).map_err(Status::invalid_argument)
    };
    Ok(NetworkRequest {
        internet,
        allow: list("network.allow", &n.allow)?,
        deny: list("network.deny", &n.deny)?,
    })
}

/// An absolute guest path (the agent enforces the guest root on top of this).
pub fn guest_path(field: &str, p: &str) -> Result<(), Status> {
    if p.is_empty() || !p.starts_with('/') {
        return Err(invalid(field, format!("{p:?} is not an absolute path")));
    }
    if p.len() > MAX_PATH || p.contains('\0') {
        return Err(invalid(field, "too long or contains NUL"));
    }
    Ok(())
}

pub fn code(field: &str, c: &str) -> Result<(), Status> {
    if c.len() > MAX_CODE_BYTES {
        return Err(invalid(
            field,
            format!("{} bytes is over the {MAX_CODE_BYTES} limit", c.len()),
        ));
    }
    Ok(())
}

pub fn argv(a: &[String]) -> Result<(), Status> {
    if a.is_empty() {
        return Err(invalid("argv", "empty"));
    }
    if a.len() > MAX_ARGV || a.iter().any(|s| s.contains('\0')) {
        return Err(invalid(
            "argv",
            "too many arguments or an argument contains NUL",
        ));
    }
    Ok(())
}

/// An executor's advertised address: http(s)://host:port.
pub fn executor_addr(a: &str) -> Result<(), Status> {
    let ok = (a.starts_with("http://") || a.starts_with("https://"))
        && a.len() <= 256
        && a.parse::<tonic::codegen::http::Uri>()
            .is_ok_and(|u| u.port().is_some());
    if !ok {
        return Err(invalid("addr", format!("{a:?} is not http(s)://host:port")));
    }
    Ok(())
}

/// A branch's mode: FULL, DIFF (also for UNSPECIFIED) or LIVE.
pub fn branch_mode(mode: i32) -> Result<tine_proto::v1::BranchMode, Status> {
    use tine_proto::v1::BranchMode;
    let m = BranchMode::try_from(mode)
        .map_err(|_| invalid("mode", format!("{mode} is not a BranchMode")))?;
    match m {
        BranchMode::Unspecified | BranchMode::Diff => Ok(BranchMode::Diff),
        BranchMode::Full => Ok(BranchMode::Full),
        BranchMode::Live => Ok(BranchMode::Live),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hostile_names_are_refused() {
        for bad in ["", "../x", "a/b", "..", ".hidden", "a\nb", &"x".repeat(200)] {
            assert!(name("tag", bad).is_err(), "{bad:?}");
            assert!(sandbox_id("id", bad).is_err(), "{bad:?}");
        }
        name("tag", "py-numpy_1.2").unwrap();
        assert!(spawn_count(0).is_err() && spawn_count(MAX_SPAWN + 1).is_err());
        assert!(ready_timeout_ms(MAX_READY_TIMEOUT_MS + 1).is_err());
        assert!(guest_path("path", "etc/passwd").is_err());
        assert!(executor_addr("127.0.0.1:80").is_err());
        executor_addr("http://127.0.0.1:7071").unwrap();
        let res = |memory_limit_mib, cpu_millis| {
            resources(&tine_proto::v1::Resources {
                memory_limit_mib,
                cpu_millis,
            })
        };
        res(0, 0).unwrap();
        res(64, 10).unwrap();
        let e = res(63, 0).unwrap_err();
        assert!(e
            .message()
            .starts_with("resources.memory_limit_mib: 63 is outside 64"));
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        assert!(res(MAX_MEMORY_LIMIT_MIB + 1, 0).is_err());
        assert!(res(0, 9)
            .unwrap_err()
            .message()
            .contains("resources.cpu_millis: 9"));
        assert!(res(0, MAX_CPU_MILLIS + 1).is_err());
    }
}
