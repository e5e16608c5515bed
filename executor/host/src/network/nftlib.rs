//! Rule sets applied through libnftables, the library the `nft` program is built on, loaded
//! once at run time: no process per child network (in the lab one process start is
//! 80-240 ms). Its netlink socket is opened by the calling thread, so a thread that entered a
//! child's namespace changes that namespace's rules. Where the library is missing the caller
//! runs `nft` instead ([`apply`] answers None).

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::sync::{Mutex, OnceLock};

/// The library's name with the API used here (`nft_run_cmd_from_buffer(ctx, const char *)`,
/// since nftables 0.9.3).
const LIBRARY: &CStr = c"libnftables.so.1";

type CtxNew = unsafe extern "C" fn(u32) -> *mut c_void;
type CtxFree = unsafe extern "C" fn(*mut c_void);
type Buffer = unsafe extern "C" fn(*mut c_void) -> c_int;
type ErrorBuffer = unsafe extern "C" fn(*mut c_void) -> *const c_char;
type RunBuffer = unsafe extern "C" fn(*mut c_void, *const c_char) -> c_int;

struct Lib {
    ctx_new: CtxNew,
    ctx_free: CtxFree,
    buffer_output: Buffer,
    buffer_error: Buffer,
    error_buffer: ErrorBuffer,
    run: RunBuffer,
}

/// The library keeps process-wide state (its interface cache, a first-use initialisation):
/// one rule set at a time.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn lib() -> Option<&'static Lib> {
    static LIB: OnceLock<Option<Lib>> = OnceLock::new();
    LIB.get_or_init(|| {
        let lib = load();
        match &lib {
            Some(_) => tracing::debug!("child networks' rules through libnftables"),
            None => tracing::info!(
                "libnftables.so.1 not found: child networks' rules through the nft program"
            ),
        }
        lib
    })
    .as_ref()
}

fn load() -> Option<Lib> {
    // SAFETY: dlopen of a library by name; it is never closed, so the symbols below stay
    // valid for the life of the process.
    let handle = unsafe { libc::dlopen(LIBRARY.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if handle.is_null() {
        return None;
    }
    let sym = |name: &CStr| {
        // SAFETY: dlsym on the handle above.
        let p = unsafe { libc::dlsym(handle, name.as_ptr()) };
        (!p.is_null()).then_some(p)
    };
    // SAFETY: each symbol is the libnftables function of that name, whose C signature is the
    // type it is cast to (nftables/libnftables.h).
    unsafe {
        Some(Lib {
            ctx_new: std::mem::transmute::<*mut c_void, CtxNew>(sym(c"nft_ctx_new")?),
            ctx_free: std::mem::transmute::<*mut c_void, CtxFree>(sym(c"nft_ctx_free")?),
            buffer_output: std::mem::transmute::<*mut c_void, Buffer>(sym(
                c"nft_ctx_buffer_output",
            )?),
            buffer_error: std::mem::transmute::<*mut c_void, Buffer>(sym(c"nft_ctx_buffer_error")?),
            error_buffer: std::mem::transmute::<*mut c_void, ErrorBuffer>(sym(
                c"nft_ctx_get_error_buffer",
            )?),
            run: std::mem::transmute::<*mut c_void, RunBuffer>(sym(c"nft_run_cmd_from_buffer")?),
        })
    }
}

/// Apply `rules` (nft's own syntax, one transaction) in the calling thread's network
/// namespace. None: libnftables is not there (run `nft -f` instead); else what nft said when
/// it refused them.
pub(super) fn apply(rules: &str) -> Option<Result<(), String>> {
    let lib = lib()?;
    let text = match CString::new(rules) {
        Ok(t) => t,
        Err(_) => return Some(Err("the rules hold a NUL byte".into())),
    };
    // The library ends the process when it cannot open its netlink socket (no nf_tables, no
    // descriptor left): find out first, with a socket of the same kind.
    let probe = match super::netlink::socket(libc::NETLINK_NETFILTER) {
        Ok(fd) => fd,
        Err(e) => return Some(Err(format!("opening a netfilter netlink socket: {e}"))),
    };
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    // Closed once the lock is held, so the library's own socket takes a descriptor freed for it.
    drop(probe);
    // SAFETY: a context made, used and freed on this thread, under the lock; the error
    // buffer is copied out before the context is freed.
    unsafe {
        // 0: NFT_CTX_DEFAULT, a context with its netlink socket.
        let ctx = (lib.ctx_new)(0);
        if ctx.is_null() {
            return Some(Err("libnftables made no context".into()));
        }
        (lib.buffer_output)(ctx);
        (lib.buffer_error)(ctx);
        let rc = (lib.run)(ctx, text.as_ptr());
        let said = {
            let p = (lib.error_buffer)(ctx);
            if p.is_null() {
                String::new()
            } else {
                CStr::from_ptr(p).to_string_lossy().trim().to_string()
            }
        };
        (lib.ctx_free)(ctx);
        Some(if rc == 0 {
            Ok(())
        } else if said.is_empty() {
            Err(format!("libnftables refused them ({rc})"))
        } else {
            Err(said)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rules the library cannot parse come back as its message, and nothing is applied: no
    /// privilege or namespace is needed for the parser to refuse them.
    #[test]
    fn malformed_rules_are_refused_with_the_parsers_message() {
        let Some(r) = apply("table ip tine-test {\n  chain c {\n    this is not a rule\n  }\n}\n")
        else {
            eprintln!("skipped: libnftables.so.1 is not installed");
            return;
        };
        let e = r.expect_err("malformed rules were accepted");
        assert!(e.contains("syntax error") || e.contains("Error"), "{e}");
        assert!(apply("table ip t\0").unwrap().is_err());
    }
}
