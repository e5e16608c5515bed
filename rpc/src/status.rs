//! gRPC status codes by name (audit log, metrics labels, SpawnFailure.code) and the typed
//! per-child errors executors report.

use tine_proto::executor::v1 as xpb;
use tonic::{Code, Status};

pub fn code_name(c: Code) -> &'static str {
    match c {
        Code::Ok => "OK",
        Code::Cancelled => "CANCELLED",
        Code::Unknown => "UNKNOWN",
        Code::InvalidArgument => "INVALID_ARGUMENT",
        Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
        Code::NotFound => "NOT_FOUND",
        Code::AlreadyExists => "ALREADY_EXISTS",
        Code::PermissionDenied => "PERMISSION_DENIED",
        Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
        Code::FailedPrecondition => "FAILED_PRECONDITION",
        Code::Aborted => "ABORTED",
        Code::OutOfRange => "OUT_OF_RANGE",
        Code::Unimplemented => "UNIMPLEMENTED",
        Code::Internal => "INTERNAL",
        Code::Unavailable => "UNAVAILABLE",
        Code::DataLoss => "DATA_LOSS",
        Code::Unauthenticated => "UNAUTHENTICATED",
    }
}

/// The code by its name (`RESOURCE_EXHAUSTED`); UNKNOWN for anything else.
pub fn code_from_name(name: &str) -> Code {
    (0..=16)
        .map(Code::from_i32)
        .find(|c| code_name(*c) == name)
        .unwrap_or(Code::Unknown)
}

/// One child's failure as the executor API carries it.
pub fn child_error(status: &Status) -> xpb::ChildError {
    xpb::ChildError {
        code: status.code() as i32,
        message: status.message().to_string(),
    }
}

/// The status an executor's per-child error stands for (a code that is not an error, or not
/// a code at all, reads as UNKNOWN).
pub fn from_child_error(e: &xpb::ChildError) -> Status {
    let code = match Code::from_i32(e.code) {
        Code::Ok => Code::Unknown,
        c => c,
    };
    Status::new(code, e.message.clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip_by_name_and_on_the_wire() {
        for i in 0..=16 {
            let c = Code::from_i32(i);
            assert_eq!(code_from_name(code_name(c)), c);
        }
        assert_eq!(code_from_name("NOPE"), Code::Unknown);
        let s = Status::resource_exhausted("executor x is full (2 sandboxes)");
        let back = from_child_error(&child_error(&s));
        assert_eq!(back.code(), Code::ResourceExhausted);
        assert_eq!(back.message(), s.message());
        let ok = xpb::ChildError {
            code: 0,
            message: "?".into(),
        };
        assert_eq!(from_child_error(&ok).code(), Code::Unknown);
    }
}
