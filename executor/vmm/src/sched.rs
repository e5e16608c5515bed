//! Scheduling hints for the VMM's own threads.
//!
//! A device thread's work is short and sits on the guest's critical path: the guest notifies a
//! queue and waits for the answer, or a host connection waits to reach the guest. When the
//! device thread shares a CPU with a running vCPU (many children per core), EEVDF lets the
//! running thread finish its slice before a woken one runs, and a slice's end is only noticed
//! at the next tick: up to 4 ms at HZ=250 for each such hop. Since Linux 6.12 a thread may ask
//! for a shorter slice (`sched_attr.sched_runtime`), and a woken thread whose slice is shorter
//! than the running one's preempts it. That buys latency, not CPU: a short slice gets the same
//! share, in shorter turns. Older kernels accept the field and ignore it.

use std::io;

/// The slice a device thread asks for: the shortest the kernel accepts (0.1 ms).
pub const DEVICE_SLICE_NS: u64 = 100_000;

/// `struct sched_attr` as of its first version (`SCHED_ATTR_SIZE_VER0`, 48 bytes).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
struct SchedAttr {
    size: u32,
    policy: u32,
    flags: u64,
    nice: i32,
    priority: u32,
    runtime: u64,
    deadline: u64,
    period: u64,
}

const SCHED_ATTR_SIZE_VER0: u32 = 48;

/// Thread `tid`'s attributes (0: the calling thread).
fn get(tid: libc::pid_t) -> io::Result<SchedAttr> {
    let mut attr = SchedAttr::default();
    // SAFETY: the kernel writes at most `size` bytes into `attr`, which is that large.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_sched_getattr,
            tid,
            &mut attr as *mut SchedAttr,
            SCHED_ATTR_SIZE_VER0,
            0,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(attr)
}

/// What happened when a thread asked for a short slice.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Slice {
    /// Asked for (the kernel keeps it on 6.12 and later, and ignores it before).
    Asked,
    /// Left alone: the thread is not under the normal policy (an operator's choice: batch,
    /// idle or real-time), which this does not override.
    NotNormal,
}

/// Ask for [`DEVICE_SLICE_NS`] on the calling thread, keeping its policy and nice value.
pub fn short_slice_for_this_thread() -> io::Result<Slice> {
    let mut attr = get(0)?;
    if attr.policy != libc::SCHED_OTHER as u32 {
        return Ok(Slice::NotNormal);
    }
    attr.size = SCHED_ATTR_SIZE_VER0;
    attr.flags = 0;
    attr.priority = 0;
    attr.runtime = DEVICE_SLICE_NS;
    attr.deadline = 0;
    attr.period = 0;
    // SAFETY: `attr` is a valid VER0 sched_attr for the calling thread (pid 0).
    let rc = unsafe { libc::syscall(libc::SYS_sched_setattr, 0, &attr as *const SchedAttr, 0) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(Slice::Asked)
}

/// Thread `tid`'s slice as the kernel reports it (0: the calling thread; `sched_runtime` of a
/// normal thread: its slice on 6.12 and later, 0 before).
pub fn slice_ns(tid: libc::pid_t) -> io::Result<u64> {
    Ok(get(tid)?.runtime)
}

/// Whether this kernel keeps a thread's own slice (Linux 6.12 and later): a thread that asked
/// for [`DEVICE_SLICE_NS`] reports it back.
pub fn kernel_keeps_slices() -> bool {
    std::thread::spawn(|| {
        short_slice_for_this_thread().ok() == Some(Slice::Asked)
            && slice_ns(0).ok() == Some(DEVICE_SLICE_NS)
    })
    .join()
    .unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Linux's version as (major, minor), from uname.
    fn kernel() -> (u32, u32) {
        let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
        let mut parts = release.trim().split(['.', '-']);
        let major = parts.next().unwrap().parse().unwrap();
        let minor = parts.next().unwrap().parse().unwrap();
        (major, minor)
    }

    #[test]
    fn a_thread_that_asks_gets_the_short_slice_and_keeps_its_nice_value() {
        let (asked, slice, nice) = std::thread::spawn(|| {
            // A nice value of its own, to see that it is kept (raising it needs no privilege).
            // SAFETY: plain system call on the calling thread.
            unsafe { libc::setpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t, 5) };
            let asked = short_slice_for_this_thread().unwrap();
            (asked, slice_ns(0).unwrap(), get(0).unwrap().nice)
        })
        .join()
        .unwrap();
        assert_eq!(asked, Slice::Asked);
        assert_eq!(nice, 5);
        if kernel() >= (6, 12) {
            assert_eq!(slice, DEVICE_SLICE_NS);
        } else {
            assert_eq!(slice, 0, "before 6.12 a normal thread reports no slice");
        }
    }

    #[test]
    fn threads_that_did_not_ask_keep_the_default_slice() {
        let slice = std::thread::spawn(|| slice_ns(0).unwrap()).join().unwrap();
        assert_ne!(slice, DEVICE_SLICE_NS);
    }

    #[test]
    fn a_thread_under_another_policy_is_left_alone() {
        let (asked, policy) = std::thread::spawn(|| {
            let param = libc::sched_param { sched_priority: 0 };
            // SAFETY: plain system call on the calling thread; SCHED_IDLE needs no privilege.
            let rc = unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) };
            assert_eq!(rc, 0);
            (
                short_slice_for_this_thread().unwrap(),
                get(0).unwrap().policy,
            )
        })
        .join()
        .unwrap();
        assert_eq!(asked, Slice::NotNormal);
        assert_eq!(policy, libc::SCHED_IDLE as u32);
    }
}
