//! Confining a VMM worker before it runs guest code: it drops to a user of its own, keeps no
//! capabilities and may make only the system calls a VMM needs (a seccomp allow-list).
//!
//! Order inside the worker (see [`crate::worker::worker_main`]):
//! 1. while it waits for its job ([`Ahead`]), and again with the job for anything that failed
//!    then ([`before_restore`]), while it is still one thread: the capability bounding set and
//!    core dumps go (threads made later inherit both);
//! 2. the restore opens everything the VM needs: /dev/kvm, the snapshot's memory, the tap,
//!    the console and vmm.log, its vsock and control sockets;
//! 3. [`lock_down`]: signal handlers, the user switch (which clears every capability on every
//!    thread), then the filter on every thread at once (TSYNC);
//! 4. the vCPU threads start, inheriting all of it.
//!
//! A worker's user is `uid_base + its pid`: unique among running VMMs without any state to
//! keep, so one VMM cannot signal, trace or write the files of another.

use serde::{Deserialize, Serialize};

pub(crate) mod lend;
mod seccomp;
pub mod view;

/// What happens to a system call outside the allow-list.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SeccompMode {
    /// SIGSYS: the VMM writes the call's number to its vmm.log and dies.
    #[default]
    Enforce,
    /// Allowed, and logged by the kernel (dmesg: `type=1326 ... syscall=N`): for finding what
    /// a new code path needs.
    Log,
    /// No filter.
    Off,
}

impl std::str::FromStr for SeccompMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "enforce" => Ok(SeccompMode::Enforce),
            "log" => Ok(SeccompMode::Log),
            "off" => Ok(SeccompMode::Off),
            other => Err(format!(
                "seccomp mode {other:?}: expected enforce, log or off"
            )),
        }
    }
}

/// The first of the users VMM workers run as (the range up to the kernel's pid_max above it,
/// at most 4,194,304, is unused by systemd's allocations).
pub const DEFAULT_UID_BASE: u32 = 0x7E00_0000;

/// How an executor confines its VMM workers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Confinement {
    pub seccomp: SeccompMode,
    /// Workers switch to user and group `uid_base + pid` (None: they keep the executor's
    /// user; an executor that is not root cannot switch them and keeps them as its own).
    pub uid_base: Option<u32>,
    /// Tests only: each worker, once confined, makes a call outside its allow-list.
    #[cfg(feature = "testing")]
    pub trip_seccomp: bool,
}

impl Default for Confinement {
    fn default() -> Self {
        Confinement {
            seccomp: SeccompMode::Enforce,
            uid_base: Some(DEFAULT_UID_BASE),
            #[cfg(feature = "testing")]
            trip_seccomp: false,
        }
    }
}

impl Confinement {
    /// What a worker with `pid` is told.
    pub fn for_worker(&self, pid: u32) -> WorkerConfinement {
        // SAFETY: geteuid has no preconditions.
        let root = unsafe { libc::geteuid() } == 0;
        WorkerConfinement {
            seccomp: self.seccomp,
            user: self
                .uid_base
                .filter(|_| root)
                .and_then(|b| b.checked_add(pid)),
        }
    }
}

/// One worker's confinement, sent with its job.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerConfinement {
    pub seccomp: SeccompMode,
    /// User and group to switch to.
    pub user: Option<u32>,
}

#[derive(Debug, thiserror::Error)]
pub enum ConfineError {
    #[error("{what}: {source}")]
    Sys {
        what: &'static str,
        source: std::io::Error,
    },
    #[error("building the seccomp filter: {0}")]
    Filter(#[from] seccompiler::Error),
    #[error("building the seccomp filter: {0}")]
    Backend(#[from] seccompiler::BackendError),
    #[error("building the seccomp filter: {0}")]
    Splice(String),
    #[error("{} is outside the snapshots this VMM sees ({})", path.display(), snapshots.display())]
    OutsideView {
        path: std::path::PathBuf,
        snapshots: std::path::PathBuf,
    },
    #[error("capabilities remain after switching to user {uid}: {caps}")]
    CapsRemain { uid: u32, caps: String },
    /// Left in a mount namespace or root no job may run in (its mounts shared with the host's,
    /// or not the executor's root): this worker takes no job.
    #[error("this worker cannot run a VM: {0}")]
    Stranded(Box<ConfineError>),
}

fn sys(what: &'static str, r: libc::c_int) -> Result<(), ConfineError> {
    if r < 0 {
        return Err(ConfineError::Sys {
            what,
            source: std::io::Error::last_os_error(),
        });
    }
    Ok(())
}

/// The highest capability number this kernel knows.
fn last_cap() -> u32 {
    std::fs::read_to_string("/proc/sys/kernel/cap_last_cap")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(40)
}

/// Turn off core dumps (a dump would hold guest memory).
fn no_core_dumps() -> Result<(), ConfineError> {
    let no_core = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: setrlimit reads the struct we pass.
    sys("limiting core dumps", unsafe {
        libc::setrlimit(libc::RLIMIT_CORE, &no_core)
    })?;
    // A core handler behind a pipe ignores RLIMIT_CORE: keep guest memory out of any dump.
    std::fs::write("/proc/self/coredump_filter", "0").map_err(|source| ConfineError::Sys {
        what: "keeping guest memory out of core dumps",
        source,
    })
}

/// Empty the calling thread's capability bounding set, so nothing it could ever exec regains
/// a capability; threads made later inherit it. Needs CAP_SETPCAP (root). It takes nothing
/// from the capabilities the worker holds now (which the user switch clears).
fn empty_bounding_set() -> Result<(), ConfineError> {
    for cap in 0..=last_cap() {
        // SAFETY: prctl with integer arguments.
        let r = unsafe { libc::prctl(libc::PR_CAPBSET_DROP, cap as libc::c_ulong, 0, 0, 0) };
        // EINVAL: a capability this kernel does not have.
        if r < 0 && std::io::Error::last_os_error().raw_os_error() != Some(libc::EINVAL) {
            sys("emptying the capability bounding set", r)?;
        }
    }
    Ok(())
}

/// What confinement needs that no job decides, made while the worker starts, before it
/// reports idle (as the VM shell is), while it is still one thread: core dumps off, the
/// capability bounding set emptied (a root worker), a mount namespace of its own
/// ([`view::Early`]), the host facts a confined view hides read, and the filters of the
/// default mode ([`SeccompMode::Enforce`]) compiled. What failed here is done again for a job
/// that needs it ([`before_restore`]), or fails that job saying why.
pub struct Ahead {
    enforce: Result<Option<seccomp::Filters>, ConfineError>,
    core: Result<(), ConfineError>,
    bounding: Result<(), ConfineError>,
    mounts: Option<Result<view::Early, ConfineError>>,
}

impl Ahead {
    pub fn prepare() -> Ahead {
        // SAFETY: geteuid has no preconditions.
        let root = unsafe { libc::geteuid() } == 0;
        let core = no_core_dumps();
        // Only a root worker may be told to switch users and so to use either; for any other
        // they would only fail.
        let bounding = if root { empty_bounding_set() } else { Ok(()) };
        tine_vmm::vm::read_host_facts();
        // A failure costs only time: the lock-down tries again.
        if glibc_single_threaded() {
            let _ = first_thread();
        }
        Ahead {
            enforce: seccomp::Filters::compile(SeccompMode::Enforce),
            core,
            bounding,
            mounts: root.then(view::Early::enter),
        }
    }

    /// The filters for `mode`: the ones made ahead if they are that mode's, else compiled now.
    fn filters(self, mode: SeccompMode) -> Result<Option<seccomp::Filters>, ConfineError> {
        match self.enforce {
            Ok(Some(f)) if f.mode() == mode => Ok(Some(f)),
            Err(e) if mode == SeccompMode::Enforce => Err(e),
            _ => seccomp::Filters::compile(mode),
        }
    }

    /// For a job that enters a view (`for_view`), the mount namespace entered ahead to enter
    /// it from (None: entering it ahead failed, which is said in the job's log, and the view
    /// makes its own). Any other job goes back to the host's mounts here.
    pub fn take_mounts(&mut self, for_view: bool) -> Result<Option<view::Early>, ConfineError> {
        match (self.mounts.take(), for_view) {
            (Some(Err(e @ ConfineError::Stranded(_))), _) => Err(e),
            (Some(Ok(early)), true) => Ok(Some(early)),
            (Some(Err(e)), true) => {
                eprintln!("tine-vmm: {e} (ahead); again with the job");
                Ok(None)
            }
            (Some(Ok(early)), false) => match early.leave() {
                Ok(()) => Ok(None),
                Err(e @ ConfineError::Stranded(_)) => Err(e),
                // Still in its own namespace, the host's slave, at its own root: it mounts
                // nothing, and what the host mounts reaches it where the host shares it.
                Err(e) => {
                    eprintln!("tine-vmm: {e}; it stays in a mount namespace of its own");
                    Ok(None)
                }
            },
            (Some(Err(_)), false) | (None, _) => Ok(None),
        }
    }
}

/// With the job, still one thread: whatever of core dumps off and (for a worker that switches
/// users) the emptied bounding set failed ahead is done now, and the failure ahead said in
/// the job's log.
pub fn before_restore(c: &WorkerConfinement, ahead: &mut Ahead) -> Result<(), ConfineError> {
    if let Err(e) = std::mem::replace(&mut ahead.core, Ok(())) {
        eprintln!("tine-vmm: {e} (ahead); again with the job");
        no_core_dumps()?;
    }
    if c.user.is_some() {
        if let Err(e) = std::mem::replace(&mut ahead.bounding, Ok(())) {
            eprintln!("tine-vmm: {e} (ahead); again with the job");
            empty_bounding_set()?;
        }
    }
    Ok(())
}

/// Switch users, then install the filter on every thread. After this the process can open
/// only what its new user may, and call only what the allow-list holds. `ahead`: what the
/// worker prepared while it waited. `marks`: the calling thread's CPU per part (filters,
/// user, thread, seccomp), for vmm.log.
pub fn lock_down(
    c: &WorkerConfinement,
    ahead: Ahead,
    marks: &mut tine_vmm::marks::Marks,
) -> Result<(), ConfineError> {
    let filters = ahead.filters(c.seccomp)?;
    seccomp::install_sigsys_reporter()?;
    marks.mark("filters");
    if let Some(uid) = c.user {
        // SAFETY: plain system calls on integers; glibc applies the id changes to every
        // thread of the process.
        unsafe {
            sys(
                "dropping supplementary groups",
                libc::setgroups(0, std::ptr::null()),
            )?;
            sys("switching group", libc::setresgid(uid, uid, uid))?;
            sys("switching user", libc::setresuid(uid, uid, uid))?;
            sys(
                "clearing ambient capabilities",
                libc::prctl(
                    libc::PR_CAP_AMBIENT,
                    libc::PR_CAP_AMBIENT_CLEAR_ALL as libc::c_ulong,
                    0,
                    0,
                    0,
                ),
            )?;
            // A user switch makes the process undumpable, which puts /proc/self under root:
            // the VMM reads its own pagemap to find the pages a branch must write. Its user is
            // its own, so only the host (root) and itself can trace it.
            sys(
                "keeping /proc/self readable",
                libc::prctl(libc::PR_SET_DUMPABLE, 1, 0, 0, 0),
            )?;
        }
        let caps = capabilities()?;
        if caps.iter().any(|(_, v)| *v != 0) {
            return Err(ConfineError::CapsRemain {
                uid,
                caps: caps
                    .iter()
                    .map(|(k, v)| format!("{k} {v:#x}"))
                    .collect::<Vec<_>>()
                    .join(", "),
            });
        }
    }
    marks.mark("user");
    // Normally done ahead (see `first_thread`); again here if that failed.
    if glibc_single_threaded() {
        first_thread()?;
    }
    marks.mark("thread");
    if let Some(f) = filters {
        f.install()?;
    }
    marks.mark("seccomp");
    Ok(())
}

/// Make and join a thread, so glibc installs the signal handlers it installs with a
/// process's first thread while `rt_sigaction` is still allowed (the seccomp filters forbid
/// it; the VM's threads come after them). Its stack is the VMM's size too: glibc keeps it for
/// the next thread, which it would otherwise give a 2 MiB stack (see
/// `tine_vmm::THREAD_STACK_BYTES`). Returns once the kernel has let go of the thread: a
/// mount namespace is entered later (`setns`), which a process sharing its filesystem
/// context with another thread, even an exiting one, cannot do.
fn first_thread() -> Result<(), ConfineError> {
    let failed = |source| ConfineError::Sys {
        what: "starting a thread",
        source,
    };
    let tid = tine_vmm::thread_builder("setup")
        // SAFETY: gettid has no preconditions.
        .spawn(|| unsafe { libc::gettid() })
        .map_err(failed)?
        .join()
        .map_err(|_| failed(std::io::Error::other("it panicked")))?;
    // Joined as the thread let go of its memory; its filesystem context goes a little later,
    // before its /proc entry does.
    let entry = format!("/proc/self/task/{tid}");
    for _ in 0..1_000 {
        match std::fs::symlink_metadata(&entry) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            _ => std::thread::yield_now(),
        }
    }
    Err(failed(std::io::Error::other(
        "the joined thread is still not gone",
    )))
}

/// Whether glibc has yet to make this process's first thread, and so to install the signal
/// handlers it installs then. glibc clears the flag as it makes that thread and never sets it
/// again, so false means the handlers are in place.
#[cfg(target_env = "gnu")]
fn glibc_single_threaded() -> bool {
    extern "C" {
        // glibc 2.32 and later, which the worker's other symbols need already.
        static __libc_single_threaded: libc::c_char;
    }
    // SAFETY: a byte glibc exports for reading; it changes only as the first thread is made,
    // which only this thread could do here.
    unsafe { std::ptr::read_volatile(std::ptr::addr_of!(__libc_single_threaded)) != 0 }
}

/// Elsewhere the thread is always made.
#[cfg(not(target_env = "gnu"))]
fn glibc_single_threaded() -> bool {
    true
}

/// Every capability set of this thread, from /proc/thread-self/status.
fn capabilities() -> Result<Vec<(String, u64)>, ConfineError> {
    let status = std::fs::read_to_string("/proc/thread-self/status").map_err(|source| {
        ConfineError::Sys {
            what: "reading its capabilities",
            source,
        }
    })?;
    let sets: Vec<(String, u64)> = status
        .lines()
        .filter_map(|l| {
            let (k, v) = l.split_once(':')?;
            matches!(k, "CapInh" | "CapPrm" | "CapEff" | "CapBnd" | "CapAmb")
                .then(|| Some((k.to_string(), u64::from_str_radix(v.trim(), 16).ok()?)))?
        })
        .collect();
    if sets.len() != 5 {
        return Err(ConfineError::Sys {
            what: "reading its capabilities",
            source: std::io::Error::other("a capability set is missing from its status"),
        });
    }
    Ok(sets)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn glibc_reports_a_process_that_made_a_thread_as_threaded() {
        std::thread::spawn(|| {}).join().unwrap();
        assert!(!glibc_single_threaded());
    }

    #[test]
    fn the_first_thread_is_gone_when_it_returns() {
        first_thread().unwrap();
    }

    #[test]
    fn filters_made_ahead_serve_only_their_own_mode() {
        let mode = |r: Result<Option<seccomp::Filters>, ConfineError>| r.unwrap().map(|f| f.mode());
        for m in [SeccompMode::Enforce, SeccompMode::Log] {
            assert_eq!(mode(Ahead::prepare().filters(m)), Some(m));
        }
        assert_eq!(mode(Ahead::prepare().filters(SeccompMode::Off)), None);
        // A failure made ahead is the Enforce job's error; other modes compile their own.
        let failed = || Ahead {
            enforce: Err(ConfineError::Sys {
                what: "compiling ahead",
                source: std::io::Error::other("test"),
            }),
            core: Ok(()),
            bounding: Ok(()),
            mounts: None,
        };
        assert!(failed().filters(SeccompMode::Enforce).is_err());
        assert_eq!(
            mode(failed().filters(SeccompMode::Log)),
            Some(SeccompMode::Log)
        );
        assert_eq!(mode(failed().filters(SeccompMode::Off)), None);
    }

    #[test]
    fn a_stranded_worker_takes_no_job_and_a_failure_ahead_only_costs_the_early_start() {
        let with = |e: ConfineError| Ahead {
            enforce: Ok(None),
            core: Ok(()),
            bounding: Ok(()),
            mounts: Some(Err(e)),
        };
        let sys = || ConfineError::Sys {
            what: "entering a mount namespace of its own",
            source: std::io::Error::from_raw_os_error(libc::EPERM),
        };
        for for_view in [true, false] {
            // Failed ahead: the view makes its own, a job without one needs none.
            assert!(matches!(with(sys()).take_mounts(for_view), Ok(None)));
            let stranded = with(ConfineError::Stranded(Box::new(sys()))).take_mounts(for_view);
            let err = stranded.err().expect("no job in a stranded worker");
            assert!(err.to_string().contains("cannot run a VM"), "{err}");
        }
    }

    #[test]
    fn modes_parse_and_bad_ones_say_what_is_expected() {
        assert_eq!("log".parse::<SeccompMode>(), Ok(SeccompMode::Log));
        assert!("strict"
            .parse::<SeccompMode>()
            .unwrap_err()
            .contains("enforce, log or off"));
    }
}
