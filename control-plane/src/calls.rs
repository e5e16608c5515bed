//! Every RPC goes through `Ctx::begin` (authenticate, authorise) and `Ctx::finish` (audit
//! line, metrics), so no handler can forget either, and rejected calls are audited too.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Instant, SystemTime};

use tonic::{Code, Request, Status};

use crate::audit::{rfc3339, AuditLog, AuditRecord};
use crate::db::Db;
use crate::executors::ExecutorPool;
use crate::metrics::Metrics;
use tine_rpc::auth::{Principal, Role, TokenSet};
use tine_rpc::gate::{Gated, Gatekeeper, Refused, Verdict};
use tine_rpc::limits::MAX_MESSAGE_BYTES;
use tine_rpc::status::code_name;

/// Largest request of the calls that carry no code or data (the longest, a spawn with a
/// full egress list, is some 20 KiB).
pub const SMALL_REQUEST_BYTES: usize = 64 << 10;

/// The services this gate guards; other paths (health, reflection) are open.
const GATED_PREFIX: &str = "/tine.v1.";

/// How callers prove who they are.
pub enum Auth {
    Tokens(TokenSet),
    /// Everyone is admin. Only ever allowed on a loopback listener (see `server`).
    Disabled,
}

/// The public RPCs, with who may call them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rpc {
    CreateSnapshot,
    ListSnapshots,
    GetSnapshot,
    DeleteSnapshot,
    Spawn,
    ListSandboxes,
    GetSandbox,
    KillSandbox,
    Exec,
    Eval,
    ReadFile,
    WriteFile,
    Branch,
    ExposePort,
    SetTimeout,
    RegisterExecutor,
    Heartbeat,
    ListExecutors,
    DrainExecutor,
}

impl Rpc {
    pub fn name(self) -> &'static str {
        match self {
            Rpc::CreateSnapshot => "tine.v1.Snapshots/CreateSnapshot",
            Rpc::ListSnapshots => "tine.v1.Snapshots/ListSnapshots",
            Rpc::GetSnapshot => "tine.v1.Snapshots/GetSnapshot",
            Rpc::DeleteSnapshot => "tine.v1.Snapshots/DeleteSnapshot",
            Rpc::Spawn => "tine.v1.Sandboxes/Spawn",
            Rpc::ListSandboxes => "tine.v1.Sandboxes/ListSandboxes",
            Rpc::GetSandbox => "tine.v1.Sandboxes/GetSandbox",
            Rpc::KillSandbox => "tine.v1.Sandboxes/KillSandbox",
            Rpc::Exec => "tine.v1.Sandboxes/Exec",
            Rpc::Eval => "tine.v1.Sandboxes/Eval",
            Rpc::ReadFile => "tine.v1.Sandboxes/ReadFile",
            Rpc::WriteFile => "tine.v1.Sandboxes/WriteFile",
            Rpc::Branch => "tine.v1.Sandboxes/Branch",
            Rpc::ExposePort => "tine.v1.Sandboxes/ExposePort",
            Rpc::SetTimeout => "tine.v1.Sandboxes/SetTimeout",
            Rpc::RegisterExecutor => "tine.v1.Executors/RegisterExecutor",
            Rpc::Heartbeat => "tine.v1.Executors/Heartbeat",
            Rpc::ListExecutors => "tine.v1.Executors/ListExecutors",
            Rpc::DrainExecutor => "tine.v1.Executors/DrainExecutor",
        }
    }

    pub const ALL: [Rpc; 19] = [
        Rpc::CreateSnapshot,
        Rpc::ListSnapshots,
        Rpc::GetSnapshot,
        Rpc::DeleteSnapshot,
        Rpc::Spawn,
        Rpc::ListSandboxes,
        Rpc::GetSandbox,
        Rpc::KillSandbox,
        Rpc::Exec,
        Rpc::Eval,
        Rpc::ReadFile,
        Rpc::WriteFile,
        Rpc::Branch,
        Rpc::ExposePort,
        Rpc::SetTimeout,
        Rpc::RegisterExecutor,
        Rpc::Heartbeat,
        Rpc::ListExecutors,
        Rpc::DrainExecutor,
    ];

    /// The RPC a request path (`/tine.v1.Service/Method`) names.
    pub fn from_path(path: &str) -> Option<Rpc> {
        let name = path.strip_prefix('/')?;
        Rpc::ALL.into_iter().find(|r| r.name() == name)
    }

    /// The largest message a call's request may carry: calls with code, stdin or file data
    /// get the transport's maximum, every other request is a few names and numbers.
    pub fn body_limit(self) -> usize {
        match self {
            Rpc::CreateSnapshot | Rpc::Exec | Rpc::Eval | Rpc::WriteFile => MAX_MESSAGE_BYTES,
            _ => SMALL_REQUEST_BYTES,
        }
    }

    /// Whether the call acts on something (creates, deletes, runs code, changes a setting):
    /// such a call is audited before it acts, and refused if that record cannot be written.
    pub fn acts(self) -> bool {
        !matches!(
            self,
            Rpc::ListSnapshots
                | Rpc::GetSnapshot
                | Rpc::ListSandboxes
                | Rpc::GetSandbox
                | Rpc::ReadFile
                | Rpc::ListExecutors
                | Rpc::Heartbeat
        )
    }

    pub fn allows(self, role: Role) -> bool {
        match role {
            Role::Admin => true,
            Role::Executor => matches!(self, Rpc::RegisterExecutor | Rpc::Heartbeat),
            Role::User => !matches!(
                self,
                Rpc::RegisterExecutor | Rpc::Heartbeat | Rpc::DrainExecutor
            ),
        }
    }
}

/// Shared state of the control plane's services.
pub struct Ctx {
    pub db: Db,
    pub auth: Auth,
    pub audit: AuditLog,
    pub metrics: Arc<Metrics>,
    pub executors: ExecutorPool,
    /// Heartbeat period executors are told to keep; three missed ones mark an executor down.
    pub heartbeat_interval_s: u32,
    /// How long a ready sandbox its executor stopped reporting is given before it is lost.
    pub lost_grace_ms: i64,
    pub timeouts: SandboxTimeouts,
}

/// How long sandboxes live: the operator's default and the most a caller may ask for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SandboxTimeouts {
    /// Seconds a sandbox lives when its spawn does not say (0: until killed).
    pub default_s: u32,
    /// The most a spawn or SetTimeout may ask for, in seconds.
    pub max_s: u32,
    /// Seconds an ended (killed, failed, lost) sandbox stays listed before it is forgotten
    /// (0: kept forever). The audit log keeps every call regardless.
    pub history_s: u32,
}

impl Default for SandboxTimeouts {
    /// E2B's default of five minutes; a day at most; a week of history.
    fn default() -> Self {
        SandboxTimeouts {
            default_s: 300,
            max_s: 86_400,
            history_s: 7 * 86_400,
        }
    }
}

impl SandboxTimeouts {
    /// The seconds a spawn asking for `asked` (0: the default) gets, or why not (None: never
    /// expires).
    pub fn for_spawn(&self, asked: u32) -> Result<Option<u32>, Status> {
        if asked > self.max_s {
            return Err(Status::invalid_argument(format!(
                "sandbox_timeout_s: {asked} is over the maximum of {} s",
                self.max_s
            )));
        }
        Ok(match asked {
            0 => (self.default_s != 0).then_some(self.default_s),
            s => Some(s),
        })
    }

    /// The seconds SetTimeout may set: 1..=max.
    pub fn check_set(&self, asked: u32) -> Result<u32, Status> {
        if asked == 0 || asked > self.max_s {
            return Err(Status::invalid_argument(format!(
                "timeout_s: {asked} is outside 1..={}",
                self.max_s
            )));
        }
        Ok(asked)
    }
}

/// An accepted call in progress.
pub struct Call {
    rpc: Rpc,
    pub principal: Principal,
    peer: Option<SocketAddr>,
    start: Instant,
    pub args: serde_json::Value,
}

impl Ctx {
    /// Who a call comes from, if they may make it; a refusal names them when known.
    fn admit(
        &self,
        rpc: Rpc,
        authenticated: impl FnOnce(&TokenSet) -> Result<Principal, Status>,
    ) -> Result<Principal, (Option<String>, Status)> {
        let principal = match &self.auth {
            Auth::Tokens(t) => authenticated(t).map_err(|s| (None, s))?,
            Auth::Disabled => Principal {
                name: "anonymous".into(),
                role: Role::Admin,
            },
        };
        if !rpc.allows(principal.role) {
            let status = Status::permission_denied(format!(
                "token {:?} (role {:?}) may not call {}",
                principal.name,
                principal.role,
                rpc.name()
            ));
            return Err((Some(principal.name), status));
        }
        Ok(principal)
    }

    /// Take a call over from the gate (which authenticated and authorised it on its headers),
    /// or, for a call that did not pass one, authenticate and authorise it here. A call that
    /// acts is audited as STARTED before it does.
    pub fn begin<T>(
        &self,
        rpc: Rpc,
        req: &Request<T>,
        args: serde_json::Value,
    ) -> Result<Call, Status> {
        let start = Instant::now();
        let peer = req.remote_addr();
        let principal = match req.extensions().get::<Gated>() {
            Some(gated) => {
                gated.begin();
                gated.principal.clone()
            }
            None => match self.admit(rpc, |t| t.authenticate(req.metadata())) {
                Ok(p) => p,
                Err((name, status)) => {
                    self.record(rpc.name(), name.as_deref(), &args, &status, start, peer);
                    return Err(status);
                }
            },
        };
        if rpc.acts() {
            // Before it acts: a call that cannot be audited is not made (fail closed).
            let started = self.audit.record(&AuditRecord {
                time: rfc3339(SystemTime::now()),
                principal: Some(&principal.name),
                rpc: rpc.name(),
                args: args.clone(),
                status: "STARTED",
                message: None,
                latency_ms: 0.0,
                peer: peer.map(|p| p.to_string()),
            });
            if let Err(e) = started {
                let status = Status::unavailable(format!(
                    "the audit log cannot be written ({e}): calls that change anything are refused until it can"
                ));
                self.count(rpc.name(), &status, start.elapsed());
                return Err(status);
            }
        }
        Ok(Call {
            rpc,
            principal,
            peer,
            start,
            args,
        })
    }

    /// Audit and count the outcome of an accepted call, passing it through.
    pub fn finish<T>(&self, call: Call, result: Result<T, Status>) -> Result<T, Status> {
        let ok = Status::ok("");
        let status = match &result {
            Ok(_) => &ok,
            Err(s) => s,
        };
        self.record(
            call.rpc.name(),
            Some(&call.principal.name),
            &call.args,
            status,
            call.start,
            call.peer,
        );
        result
    }

    /// Audit something that happened outside a call (an executor reported it).
    pub fn audit_event(&self, what: &str, principal: &str, args: serde_json::Value) {
        // A failure is logged by the audit log; the event happened either way.
        let _ = self.audit.record(&AuditRecord {
            time: rfc3339(SystemTime::now()),
            principal: Some(principal),
            rpc: what,
            args,
            status: "OK",
            message: None,
            latency_ms: 0.0,
            peer: None,
        });
    }

    /// Count a call's outcome and latency.
    fn count(&self, rpc: &str, status: &Status, elapsed: std::time::Duration) {
        self.metrics
            .rpcs
            .with_label_values(&[rpc, code_name(status.code())])
            .inc();
        self.metrics
            .rpc_seconds
            .with_label_values(&[rpc])
            .observe(elapsed.as_secs_f64());
    }

    fn record(
        &self,
        rpc: &str,
        principal: Option<&str>,
        args: &serde_json::Value,
        status: &Status,
        start: Instant,
        peer: Option<SocketAddr>,
    ) {
        self.record_elapsed(rpc, principal, args, status, start.elapsed(), peer);
    }

    fn record_elapsed(
        &self,
        rpc: &str,
        principal: Option<&str>,
        args: &serde_json::Value,
        status: &Status,
        elapsed: std::time::Duration,
        peer: Option<SocketAddr>,
    ) {
        self.count(rpc, status, elapsed);
        let code = code_name(status.code());
        // A failure is logged by the audit log (a call that acts was audited as it started).
        let _ = self.audit.record(&AuditRecord {
            time: rfc3339(SystemTime::now()),
            principal,
            rpc,
            args: args.clone(),
            status: code,
            message: (status.code() != Code::Ok).then(|| status.message()),
            latency_ms: elapsed.as_secs_f64() * 1e3,
            peer: peer.map(|p| p.to_string()),
        });
    }
}

/// The control plane's gate: the public services' calls are authenticated, authorised and
/// held to their body limit on their headers; refusals are audited and counted like calls.
pub struct Keeper(pub Arc<Ctx>);

/// How a path that names no RPC of the gated services is audited and counted (a caller's
/// made-up paths must not become metric labels).
const UNKNOWN_RPC: &str = "tine.v1/unknown";

/// The bounded label a call refused before its handler is audited and counted under: its
/// RPC's name, or its service's for the open ones (health, reflection), never the raw path.
fn refused_label(path: &str) -> &'static str {
    if let Some(rpc) = Rpc::from_path(path) {
        return rpc.name();
    }
    if path.starts_with(GATED_PREFIX) {
        UNKNOWN_RPC
    } else if path.starts_with("/grpc.health.") {
        "grpc.health"
    } else if path.starts_with("/grpc.reflection.") {
        "grpc.reflection"
    } else {
        "unknown"
    }
}

impl Gatekeeper for Keeper {
    fn admit(&self, path: &str, headers: &http::HeaderMap) -> Verdict {
        if !path.starts_with(GATED_PREFIX) {
            return Verdict::Open;
        }
        let Some(rpc) = Rpc::from_path(path) else {
            // Unknown methods too are answered only to those who authenticate.
            let principal = match &self.0.auth {
                Auth::Tokens(t) => match t.authenticate_headers(headers) {
                    Ok(p) => Some(p.name),
                    Err(status) => {
                        return Verdict::Refuse {
                            principal: None,
                            status,
                        }
                    }
                },
                Auth::Disabled => None,
            };
            return Verdict::Refuse {
                principal,
                status: Status::unimplemented(format!("no such method: {path:?}")),
            };
        };
        match self.0.admit(rpc, |t| t.authenticate_headers(headers)) {
            Ok(principal) => Verdict::Admit {
                principal,
                body_limit: rpc.body_limit(),
            },
            Err((principal, status)) => Verdict::Refuse { principal, status },
        }
    }

    fn refused(&self, call: Refused<'_>) {
        let rpc = refused_label(call.path);
        let args = serde_json::json!({"before_handler": true});
        self.0.record_elapsed(
            rpc,
            call.principal,
            &args,
            call.status,
            call.elapsed,
            call.peer,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roles_gate_rpcs() {
        assert!(Rpc::DrainExecutor.allows(Role::Admin));
        assert!(!Rpc::DrainExecutor.allows(Role::User));
        assert!(Rpc::Spawn.allows(Role::User));
        assert!(!Rpc::Spawn.allows(Role::Executor));
        assert!(Rpc::Heartbeat.allows(Role::Executor));
        assert!(!Rpc::Heartbeat.allows(Role::User));
    }

    #[test]
    fn every_rpc_is_found_by_its_path() {
        for rpc in Rpc::ALL {
            assert_eq!(Rpc::from_path(&format!("/{}", rpc.name())), Some(rpc));
        }
        assert_eq!(Rpc::from_path("/tine.v1.Sandboxes/Nope"), None);
        assert_eq!(Rpc::from_path("tine.v1.Sandboxes/Spawn"), None);
    }

    #[test]
    fn calls_refused_before_their_handler_get_bounded_labels() {
        assert_eq!(
            refused_label("/tine.v1.Sandboxes/Spawn"),
            "tine.v1.Sandboxes/Spawn"
        );
        assert_eq!(refused_label("/tine.v1.Sandboxes/Made-up"), UNKNOWN_RPC);
        assert_eq!(refused_label("/grpc.health.v1.Health/Check"), "grpc.health");
        assert_eq!(
            refused_label("/grpc.reflection.v1.ServerReflection/ServerReflectionInfo"),
            "grpc.reflection"
        );
        assert_eq!(refused_label("/anything/else"), "unknown");
    }
}
