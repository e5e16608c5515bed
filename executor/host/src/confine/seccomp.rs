//! The VMM's system-call allow-list, and what a call outside it does.

use std::collections::BTreeMap;

use seccompiler::{
    sock_filter, BpfProgram, SeccompAction, SeccompCmpArgLen as Len, SeccompCmpOp as Op,
    SeccompCondition, SeccompFilter, SeccompRule, TargetArch,
};

use super::{sys, ConfineError, SeccompMode};

/// The filter of one [`SeccompMode`], compiled: the allow-list with the refusals spliced in
/// ahead of it, one program (one filter to load per child, and to run per system call).
/// Compiling depends on no job, so a worker does it for the default mode before it reports
/// idle (see `confine::Ahead`).
pub struct Filters {
    mode: SeccompMode,
    program: BpfProgram,
}

impl Filters {
    /// None for [`SeccompMode::Off`].
    pub(super) fn compile(mode: SeccompMode) -> Result<Option<Filters>, ConfineError> {
        let action = match mode {
            SeccompMode::Off => return Ok(None),
            SeccompMode::Enforce => SeccompAction::Trap,
            SeccompMode::Log => SeccompAction::Log,
        };
        let allow: BpfProgram = SeccompFilter::new(
            allow_list()?,
            action,
            SeccompAction::Allow,
            TargetArch::x86_64,
        )?
        .try_into()?;
        Ok(Some(Filters {
            mode,
            program: with_refusals(allow)?,
        }))
    }

    pub(super) fn mode(&self) -> SeccompMode {
        self.mode
    }

    /// Install it on every thread of the process (TSYNC).
    pub(super) fn install(&self) -> Result<(), ConfineError> {
        seccompiler::apply_filter_all_threads(&self.program)?;
        Ok(())
    }
}

/// Calls answered ENOSYS rather than trapped (checked before the allow-list, which also
/// lists them, so that a program without the refusals would only let them through):
/// - clone3, whose flags sit behind a pointer no filter can read: glibc falls back to clone,
///   whose flags the allow-list checks;
/// - socket and connect, which a guest's vsock connection to the host tries (the host has no
///   listeners for it): the guest gets a reset, as before confinement, not a dead sandbox.
const REFUSED: [i64; 3] = [libc::SYS_clone3, libc::SYS_socket, libc::SYS_connect];

/// seccompiler's programs open with the architecture check (load the arch; jump over the next
/// instruction if it is x86_64; kill the process): this many instructions.
const ARCH_CHECK: usize = 3;
/// `seccomp_data.nr`'s offset.
const NR_OFFSET: u32 = 0;

fn stmt(code: u32, k: u32) -> sock_filter {
    sock_filter {
        code: code as u16,
        jt: 0,
        jf: 0,
        k,
    }
}

/// `allow` with [`REFUSED`] answered ENOSYS right after its architecture check. Jumps in
/// classic BPF are relative and only forward, so the instructions after the splice keep
/// their targets, and the check's own jump lands on the splice.
fn with_refusals(mut allow: BpfProgram) -> Result<BpfProgram, ConfineError> {
    use libc::{BPF_ABS, BPF_JA, BPF_JEQ, BPF_JMP, BPF_K, BPF_LD, BPF_RET, BPF_W};
    let head: Vec<_> = allow
        .iter()
        .take(ARCH_CHECK)
        .map(|i| (u32::from(i.code), i.jt, i.jf))
        .collect();
    let expected = [
        (BPF_LD | BPF_W | BPF_ABS, 0, 0),
        (BPF_JMP | BPF_JEQ | BPF_K, 1, 0),
        (BPF_RET | BPF_K, 0, 0),
    ];
    if head != expected {
        return Err(ConfineError::Splice(format!(
            "the allow-list does not open with the architecture check: {head:?}"
        )));
    }
    let n = REFUSED.len();
    let mut refusals = Vec::with_capacity(n + 3);
    refusals.push(stmt(BPF_LD | BPF_W | BPF_ABS, NR_OFFSET));
    for (i, nr) in REFUSED.iter().enumerate() {
        // To the RET at index n + 2, from index 1 + i.
        refusals.push(sock_filter {
            code: (BPF_JMP | BPF_JEQ | BPF_K) as u16,
            jt: (n - i) as u8,
            jf: 0,
            k: *nr as u32,
        });
    }
    refusals.push(stmt(BPF_JMP | BPF_JA, 1));
    refusals.push(stmt(
        BPF_RET | BPF_K,
        libc::SECCOMP_RET_ERRNO | libc::ENOSYS as u32,
    ));
    allow.splice(ARCH_CHECK..ARCH_CHECK, refusals);
    Ok(allow)
}

fn arg(index: u8, op: Op, value: u64) -> Result<SeccompCondition, ConfineError> {
    Ok(SeccompCondition::new(index, Len::Dword, op, value)?)
}

fn one_of(index: u8, values: &[u64]) -> Result<Vec<SeccompRule>, ConfineError> {
    values
        .iter()
        .map(|v| Ok(SeccompRule::new(vec![arg(index, Op::Eq, *v)?])?))
        .collect()
}

/// `clone` for a thread (what glibc's pthread_create passes).
const CLONE_THREAD_FLAGS: u64 = (libc::CLONE_VM
    | libc::CLONE_FS
    | libc::CLONE_FILES
    | libc::CLONE_SIGHAND
    | libc::CLONE_THREAD
    | libc::CLONE_SYSVSEM
    | libc::CLONE_SETTLS
    | libc::CLONE_PARENT_SETTID
    | libc::CLONE_CHILD_CLEARTID) as u64;
/// `clone` for fork(3): a live branch forks the VMM to copy its memory as of one instant.
const CLONE_FORK_FLAGS: u64 =
    (libc::CLONE_CHILD_SETTID | libc::CLONE_CHILD_CLEARTID | libc::SIGCHLD) as u64;

/// KVM's ioctl type, and the two KVM ioctls that would make more VMs or vCPUs.
const KVMIO: u64 = 0xAE;
const KVM_CREATE_VM: u64 = 0xAE01;
const KVM_CREATE_VCPU: u64 = 0xAE41;

/// Every system call a running VMM makes: its vCPU and device threads, its main thread (device
/// loops, the control socket), a thread per control connection, a branch (full, diff, live with
/// its forked copier) and a rebase. Found by running the host tests and the lab scenarios under
/// [`SeccompMode::Log`] and reading the kernel's log.
fn allow_list() -> Result<BTreeMap<i64, Vec<SeccompRule>>, ConfineError> {
    use libc::*;
    let any: &[i64] = &[
        // I/O on what it holds: guest memory files, console, sockets, eventfds, the tap.
        SYS_read,
        SYS_write,
        SYS_readv,
        SYS_writev,
        SYS_pread64,
        SYS_pwrite64,
        SYS_preadv,
        SYS_pwritev,
        SYS_lseek,
        SYS_close,
        SYS_fcntl,
        SYS_ftruncate,
        SYS_fallocate,
        SYS_fsync,
        SYS_fdatasync,
        SYS_copy_file_range,
        SYS_sendfile,
        // Branch files, written under the directory the host made for this VMM; a rebase
        // maps the branch's pages.
        SYS_openat,
        SYS_fstat,
        SYS_newfstatat,
        SYS_statx,
        SYS_getdents64,
        SYS_unlinkat,
        SYS_readlink,
        SYS_readlinkat,
        SYS_getcwd,
        // Memory.
        SYS_mmap,
        SYS_munmap,
        SYS_mprotect,
        SYS_madvise,
        SYS_mremap,
        SYS_brk,
        // Threads, time, signals to itself (vCPU kicks).
        SYS_futex,
        SYS_sched_yield,
        SYS_sched_getaffinity,
        SYS_set_robust_list,
        SYS_rseq,
        SYS_clone3,
        SYS_socket,
        SYS_connect,
        SYS_exit,
        SYS_exit_group,
        SYS_nanosleep,
        SYS_clock_nanosleep,
        SYS_clock_gettime,
        SYS_gettimeofday,
        SYS_getrandom,
        SYS_getpid,
        SYS_gettid,
        SYS_getppid,
        SYS_tgkill,
        SYS_rt_sigprocmask,
        SYS_rt_sigreturn,
        SYS_sigaltstack,
        SYS_restart_syscall,
        // Event loops and sockets it already holds (vsock and control listeners).
        SYS_epoll_create1,
        SYS_epoll_ctl,
        SYS_epoll_wait,
        SYS_epoll_pwait,
        SYS_eventfd2,
        SYS_poll,
        SYS_ppoll,
        SYS_accept4,
        SYS_recvfrom,
        SYS_recvmsg,
        SYS_sendto,
        SYS_sendmsg,
        SYS_shutdown,
        SYS_getsockopt,
        SYS_setsockopt,
        // A live branch's copier: a pipe for its report, and reaping it.
        SYS_pipe2,
        SYS_wait4,
    ];
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> =
        any.iter().map(|nr| (*nr, Vec::new())).collect();
    rules.insert(
        SYS_clone,
        one_of(0, &[CLONE_THREAD_FLAGS, CLONE_FORK_FLAGS])?,
    );
    // The worker's own page-fault count per step (its vmm.log marks), of its own thread only.
    rules.insert(
        libc::SYS_getrusage,
        one_of(0, &[libc::RUSAGE_THREAD as u64])?,
    );
    // Thread names, and the copier's "die with the VMM".
    rules.insert(
        SYS_prctl,
        one_of(0, &[PR_SET_NAME as u64, PR_SET_PDEATHSIG as u64])?,
    );
    // Rust's SIGSEGV/SIGBUS handler restores the default action to let a real fault kill the
    // process (a crash must not read as a seccomp violation).
    rules.insert(
        SYS_rt_sigaction,
        one_of(0, &[SIGSEGV as u64, SIGBUS as u64])?,
    );
    // Only to end its own copier.
    rules.insert(SYS_kill, one_of(1, &[SIGKILL as u64])?);
    let mut ioctl = vec![SeccompRule::new(vec![
        arg(1, Op::MaskedEq(0xff00), KVMIO << 8)?,
        arg(1, Op::Ne, KVM_CREATE_VM)?,
        arg(1, Op::Ne, KVM_CREATE_VCPU)?,
    ])?];
    ioctl.extend(one_of(
        1,
        &[
            // The tap's offloads and header size, set when the guest's driver starts.
            TUNSETOFFLOAD,
            TUNSETVNETHDRSZ,
            FIONBIO,
            FIOCLEX,
            TCGETS,
        ],
    )?);
    rules.insert(SYS_ioctl, ioctl);
    Ok(rules)
}

/// Where a trapped call's number sits in the SIGSYS siginfo (`si_syscall`).
const SI_SYSCALL_OFFSET: usize = 24;

extern "C" fn on_sigsys(_: libc::c_int, info: *mut libc::siginfo_t, _: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo for SIGSYS; only async-signal-safe calls
    // follow (write, getpid, gettid, tgkill).
    unsafe {
        let nr = std::ptr::read_unaligned((info as *const u8).add(SI_SYSCALL_OFFSET) as *const i32);
        let mut buf = [0u8; 96];
        let head = b"seccomp: system call ";
        buf[..head.len()].copy_from_slice(head);
        let mut n = head.len();
        let mut digits = [0u8; 12];
        let mut d = 0;
        let mut v = nr.unsigned_abs();
        loop {
            digits[d] = b'0' + (v % 10) as u8;
            d += 1;
            v /= 10;
            if v == 0 {
                break;
            }
        }
        while d > 0 {
            d -= 1;
            buf[n] = digits[d];
            n += 1;
        }
        let tail = b" is outside this VMM's allow-list\n";
        buf[n..n + tail.len()].copy_from_slice(tail);
        n += tail.len();
        libc::write(2, buf.as_ptr() as *const libc::c_void, n);
        // SA_RESETHAND made SIGSYS fatal again; it is blocked until this handler returns,
        // then kills the process, so the host sees a VMM killed by SIGSYS.
        libc::syscall(
            libc::SYS_tgkill,
            libc::getpid(),
            libc::syscall(libc::SYS_gettid),
            libc::SIGSYS,
        );
    }
}

pub(super) fn install_sigsys_reporter() -> Result<(), ConfineError> {
    // SAFETY: a zeroed sigaction with our handler, SA_SIGINFO for the call's number and
    // SA_RESETHAND so that the signal it raises again is fatal.
    unsafe {
        let mut act: libc::sigaction = std::mem::zeroed();
        act.sa_sigaction = on_sigsys as *const () as libc::sighandler_t;
        act.sa_flags = libc::SA_SIGINFO | libc::SA_RESETHAND;
        libc::sigemptyset(&mut act.sa_mask);
        sys(
            "installing the SIGSYS reporter",
            libc::sigaction(libc::SIGSYS, &act, std::ptr::null_mut()),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_allow_list_compiles_and_refuses_what_a_vmm_never_needs() {
        let rules = allow_list().unwrap();
        for never in [
            libc::SYS_execve,
            libc::SYS_execveat,
            libc::SYS_ptrace,
            libc::SYS_bind,
            libc::SYS_mount,
            libc::SYS_unshare,
            libc::SYS_setns,
            libc::SYS_setuid,
            libc::SYS_bpf,
            libc::SYS_userfaultfd,
            libc::SYS_mkdirat,
            libc::SYS_renameat2,
        ] {
            assert!(!rules.contains_key(&never), "syscall {never} is allowed");
        }
        for refused in REFUSED {
            assert!(
                rules.contains_key(&refused),
                "{refused} reaches the ENOSYS filter"
            );
        }
        assert!(
            !rules[&libc::SYS_rt_sigaction].is_empty(),
            "only SIGSEGV and SIGBUS"
        );
        let prog: BpfProgram = SeccompFilter::new(
            rules,
            SeccompAction::Trap,
            SeccompAction::Allow,
            TargetArch::x86_64,
        )
        .unwrap()
        .try_into()
        .unwrap();
        assert!(prog.len() > 50, "{} instructions", prog.len());
    }

    #[test]
    fn filters_compile_per_mode_and_off_has_none() {
        assert!(Filters::compile(SeccompMode::Off).unwrap().is_none());
        let e = Filters::compile(SeccompMode::Enforce).unwrap().unwrap();
        let l = Filters::compile(SeccompMode::Log).unwrap().unwrap();
        assert_eq!(
            (e.mode(), l.mode()),
            (SeccompMode::Enforce, SeccompMode::Log)
        );
        // The action for a call outside the list is what differs between the modes.
        let execve = Call::new(libc::SYS_execve, [0; 6]);
        assert_eq!(run(&e.program, &execve), libc::SECCOMP_RET_TRAP);
        assert_eq!(run(&l.program, &execve), libc::SECCOMP_RET_LOG);
    }

    /// `<linux/audit.h>`'s architectures (libc has none of them).
    const AUDIT_ARCH_X86_64: u32 = 0xc000_003e;
    const AUDIT_ARCH_I386: u32 = 0x4000_0003;

    /// One system call as the filter sees it (`struct seccomp_data`).
    struct Call([u8; 64]);

    impl Call {
        fn new(nr: i64, args: [u64; 6]) -> Self {
            Self::on(AUDIT_ARCH_X86_64, nr, args)
        }

        fn on(arch: u32, nr: i64, args: [u64; 6]) -> Self {
            let mut d = [0u8; 64];
            d[0..4].copy_from_slice(&(nr as u32).to_ne_bytes());
            d[4..8].copy_from_slice(&arch.to_ne_bytes());
            for (i, a) in args.iter().enumerate() {
                d[16 + 8 * i..24 + 8 * i].copy_from_slice(&a.to_ne_bytes());
            }
            Call(d)
        }
    }

    /// Runs a classic BPF program the way the kernel does, over the instructions seccompiler
    /// and the splice emit; anything else fails the test.
    fn run(program: &BpfProgram, call: &Call) -> u32 {
        use libc::*;
        let (mut pc, mut acc) = (0usize, 0u32);
        loop {
            let i = &program[pc];
            let code = u32::from(i.code);
            pc += 1;
            let jump = |taken: bool| if taken { i.jt } else { i.jf } as usize;
            match code {
                c if c == BPF_LD | BPF_W | BPF_ABS => {
                    let at = i.k as usize;
                    acc = u32::from_ne_bytes(call.0[at..at + 4].try_into().unwrap());
                }
                c if c == BPF_ALU | BPF_AND | BPF_K => acc &= i.k,
                c if c == BPF_JMP | BPF_JA => pc += i.k as usize,
                c if c == BPF_JMP | BPF_JEQ | BPF_K => pc += jump(acc == i.k),
                c if c == BPF_JMP | BPF_JGT | BPF_K => pc += jump(acc > i.k),
                c if c == BPF_JMP | BPF_JGE | BPF_K => pc += jump(acc >= i.k),
                c if c == BPF_JMP | BPF_JSET | BPF_K => pc += jump(acc & i.k != 0),
                c if c == BPF_RET | BPF_K => return i.k,
                c => panic!("instruction {c:#x} at {}", pc - 1),
            }
        }
    }

    #[test]
    fn one_program_refuses_then_allows_then_traps() {
        let f = Filters::compile(SeccompMode::Enforce).unwrap().unwrap();
        let p = &f.program;
        let enosys = libc::SECCOMP_RET_ERRNO | libc::ENOSYS as u32;
        for nr in REFUSED {
            assert_eq!(run(p, &Call::new(nr, [0; 6])), enosys, "call {nr}");
        }
        let allowed = |nr, args| run(p, &Call::new(nr, args)) == libc::SECCOMP_RET_ALLOW;
        assert!(allowed(libc::SYS_read, [0; 6]));
        assert!(allowed(libc::SYS_wait4, [0; 6]), "the list's last call");
        assert!(allowed(
            libc::SYS_clone,
            [CLONE_THREAD_FLAGS, 0, 0, 0, 0, 0]
        ));
        assert!(!allowed(libc::SYS_clone, [0, 0, 0, 0, 0, 0]));
        let kvm_run = 0xAE80;
        assert!(allowed(libc::SYS_ioctl, [3, kvm_run, 0, 0, 0, 0]));
        assert_eq!(
            run(
                p,
                &Call::new(libc::SYS_ioctl, [3, KVM_CREATE_VM, 0, 0, 0, 0])
            ),
            libc::SECCOMP_RET_TRAP
        );
        assert_eq!(
            run(p, &Call::new(libc::SYS_bpf, [0; 6])),
            libc::SECCOMP_RET_TRAP
        );
        // Another architecture's calls never reach the refusals.
        assert_eq!(
            run(p, &Call::on(AUDIT_ARCH_I386, libc::SYS_socket, [0; 6])),
            libc::SECCOMP_RET_KILL_PROCESS
        );
    }

    #[test]
    fn a_program_without_the_architecture_check_is_not_spliced() {
        let mut p = Filters::compile(SeccompMode::Enforce)
            .unwrap()
            .unwrap()
            .program;
        p.drain(..ARCH_CHECK + REFUSED.len() + 3);
        assert!(matches!(with_refusals(p), Err(ConfineError::Splice(_))));
    }
}
