//! `tine doctor`: host checks, each with what it found and how to fix it.

use std::path::{Path, PathBuf};

use anyhow::Result;
use tine_vmm::host::{open_kvm, KvmFlavor};

#[derive(clap::Args)]
pub struct DoctorArgs {
    /// Directory whose free space matters (snapshots, images).
    #[arg(long, env = "TINE_DATA_DIR")]
    data_dir: Option<PathBuf>,
}

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Status {
    Ok,
    Warn,
    Fail,
}

struct Check {
    name: &'static str,
    status: Status,
    found: String,
    fix: &'static str,
}

fn check(name: &'static str, status: Status, found: impl Into<String>, fix: &'static str) -> Check {
    Check {
        name,
        status,
        found: found.into(),
        fix,
    }
}

fn kvm_checks(out: &mut Vec<Check>) {
    if !Path::new("/dev/kvm").exists() {
        out.push(check(
            "/dev/kvm",
            Status::Fail,
            "absent",
            "enable VT-x/AMD-V in firmware and load kvm_intel or kvm_amd; in a cloud VM enable nested virtualization",
        ));
        return;
    }
    match open_kvm() {
        Ok(kvm) => {
            out.push(check(
                "/dev/kvm",
                Status::Ok,
                format!("API 12, up to {} vCPUs per VM", kvm.get_max_vcpus()),
                "",
            ));
        }
        Err(e) => out.push(check(
            "/dev/kvm",
            Status::Fail,
            e.to_string(),
            "run as root or add the user to the group owning /dev/kvm",
        )),
    }
    let flavor = KvmFlavor::detect();
    out.push(check(
        "virtualization",
        if flavor.boots_linux() {
            Status::Ok
        } else {
            Status::Fail
        },
        flavor.describe(),
        "stock Linux guests need VMX or SVM; on this host use `tine lab -- ...` for anything that boots Linux",
    ));
}

fn kernel_check(out: &mut Vec<Check>) {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let release = release.trim();
    let mut parts = release
        .split(|c: char| !c.is_ascii_digit())
        .filter(|s| !s.is_empty());
    let major: u32 = parts.next().and_then(|s| s.parse().ok()).unwrap_or(0);
    let minor: u32 = parts.next().and_then(|s| s.parse().ok()).unwrap_or(0);
    let ok = (major, minor) >= (5, 10);
    out.push(check(
        "host kernel",
        if ok { Status::Ok } else { Status::Fail },
        release,
        "use Linux 5.10 or newer (userfaultfd write-protect, memfd sealing, cgroup v2)",
    ));
}

fn cgroup_check(out: &mut Vec<Check>) {
    let (status, found) = match tine_host::cgroup::probe() {
        Ok(at) => (
            Status::Ok,
            format!("v2 at {} with cpu, memory, pids", at.display()),
        ),
        Err(why) => (Status::Warn, why),
    };
    out.push(check(
        "cgroup v2",
        status,
        found,
        "boot with systemd.unified_cgroup_hierarchy=1 (or mount cgroup2 on /sys/fs/cgroup) so each child gets its memory, CPU and process limits; without it spawns asking for limits are refused",
    ));
}

fn userfaultfd_check(out: &mut Vec<Check>) {
    // SAFETY: plain syscall; the fd is closed right away.
    let fd = unsafe { libc::syscall(libc::SYS_userfaultfd, libc::O_CLOEXEC | libc::O_NONBLOCK) };
    let (status, found) = if fd >= 0 {
        // SAFETY: fd was just returned by the kernel.
        unsafe { libc::close(fd as i32) };
        (Status::Ok, "userfaultfd(2) works".to_string())
    } else if Path::new("/dev/userfaultfd").exists() {
        (
            Status::Warn,
            format!(
                "syscall refused ({}), /dev/userfaultfd present",
                std::io::Error::last_os_error()
            ),
        )
    } else {
        (
            Status::Warn,
            format!("unavailable: {}", std::io::Error::last_os_error()),
        )
    };
    out.push(check(
        "userfaultfd",
        status,
        found,
        "needed for lazy restores from remote layers: run as root or set vm.unprivileged_userfaultfd=1",
    ));
}

fn memfd_check(out: &mut Vec<Check>) {
    let r = tine_vmm::GuestRam::new_memfd(tine_vmm::memory::MIN_MEM_MIB);
    out.push(match r {
        Ok(_) => check("memfd", Status::Ok, "memfd_create + mmap work", ""),
        Err(e) => check(
            "memfd",
            Status::Fail,
            e.to_string(),
            "guest RAM lives in a memfd: check RLIMIT_MEMLOCK/seccomp policy",
        ),
    });
}

fn huge_pages_check(out: &mut Vec<Check>) {
    const PATH: &str = tine_host::hot::SHMEM_ENABLED;
    const FIX: &str = "as root: echo advise > /sys/kernel/mm/transparent_hugepage/shmem_enabled \
        (persist it with a tmpfiles.d line `w /sys/kernel/mm/transparent_hugepage/shmem_enabled - - - - advise`); \
        only mappings that ask are affected: a booting guest's RAM then fills 2 MiB at a \
        time (cold boots about a third faster in the lab), and an executor holds a hot \
        snapshot's memory in huge pages for its children (docs/performance.md)";
    let setting = std::fs::read_to_string(PATH).unwrap_or_default();
    out.push(match tine_host::hot::selected(&setting) {
        Some(v @ ("advise" | "within_size" | "always" | "force")) => check(
            "huge pages (guest RAM)",
            Status::Ok,
            format!("shmem_enabled = {v}"),
            "",
        ),
        Some(v) => check(
            "huge pages (guest RAM)",
            Status::Warn,
            format!("shmem_enabled = {v}: booting guests fault their RAM in 4 KiB at a time"),
            FIX,
        ),
        None => check(
            "huge pages (guest RAM)",
            Status::Warn,
            format!("{PATH} unreadable: no transparent huge pages for guest RAM"),
            FIX,
        ),
    });
}

/// Page merging is an opt-in (`--merge-pages`), so a stopped KSM daemon is fine; the line
/// says whether the option would work here.
fn ksm_check(out: &mut Vec<Check>) {
    let run = std::path::Path::new(tine_host::ksm::RUN);
    out.push(match tine_host::ksm::refusal(run) {
        None => check(
            "page merging (KSM)",
            Status::Ok,
            "ksmd runs: `--merge-pages` lets it merge identical pages children wrote",
            "",
        ),
        Some(why) => check(
            "page merging (KSM)",
            Status::Ok,
            format!("off ({why}); only `--merge-pages` needs it"),
            "",
        ),
    });
}

/// KVM makes a kernel thread for every VM (`kvm-nx-lpage-recovery`, charged to the child's
/// cgroup: a 16 KiB kernel stack and a task) unless its iTLB-multihit mitigation is turned off
/// for good; on a CPU the bug does not affect the thread has nothing to do.
fn nx_thread_check(out: &mut Vec<Check>) {
    let read = |p: &str| std::fs::read_to_string(p).ok();
    out.push(nx_thread_advice(
        read("/sys/module/kvm/parameters/nx_huge_pages").as_deref(),
        read("/sys/devices/system/cpu/vulnerabilities/itlb_multihit").as_deref(),
    ));
}

fn nx_thread_advice(param: Option<&str>, itlb_multihit: Option<&str>) -> Check {
    const NAME: &str = "KVM thread per VM";
    let Some(param) = param.map(str::trim) else {
        return check(NAME, Status::Ok, "kvm not loaded: nothing to tell yet", "");
    };
    if param == "never" {
        return check(NAME, Status::Ok, "nx_huge_pages = never: none", "");
    }
    match itlb_multihit.map(str::trim) {
        Some("Not affected") => check(
            NAME,
            Status::Warn,
            format!(
                "nx_huge_pages = {param} on a CPU not affected by iTLB multihit: each child's VM \
                 gets a kernel thread that has nothing to do (about 0.02 MiB of kernel memory \
                 per child)"
            ),
            "boot with kvm.nx_huge_pages=never (or, before any VM runs: echo never > \
             /sys/module/kvm/parameters/nx_huge_pages); only on CPUs the bug does not affect",
        ),
        Some(v) => check(
            NAME,
            Status::Ok,
            format!("nx_huge_pages = {param}; the CPU needs the mitigation ({v})"),
            "",
        ),
        None => check(
            NAME,
            Status::Ok,
            format!("nx_huge_pages = {param}; the CPU's iTLB multihit status is unknown"),
            "",
        ),
    }
}

/// KVM gives every VM a debugfs directory of about 70 files (its statistics, which Tine reads
/// from KVM's binary statistics instead): about 0.055 MiB of inodes and dentries per child,
/// measured in the lab. The kernel makes them wherever debugfs is registered, which is where
/// its mount point exists.
fn debugfs_check(out: &mut Vec<Check>) {
    out.push(debugfs_advice(Path::new("/sys/kernel/debug").exists()));
}

fn debugfs_advice(registered: bool) -> Check {
    const NAME: &str = "KVM debugfs files per VM";
    if registered {
        check(
            NAME,
            Status::Warn,
            "debugfs is on: each child's VM gets about 70 debugfs files (about 0.055 MiB of \
             kernel memory per child)",
            "boot with debugfs=off where nothing on the host needs debugfs (tracing has its own \
             tracefs at /sys/kernel/tracing; Tine reads KVM's counters from its statistics \
             files)",
        )
    } else {
        check(NAME, Status::Ok, "debugfs is off: none", "")
    }
}

fn tun_check(out: &mut Vec<Check>) {
    let ok = Path::new("/dev/net/tun").exists();
    out.push(check(
        "/dev/net/tun",
        if ok { Status::Ok } else { Status::Warn },
        if ok { "present" } else { "absent" },
        "modprobe tun (children get their network through tap devices)",
    ));
    // Namespaces, links and routes are made in-process; only the rules need a command.
    let found = std::process::Command::new("nft")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    out.push(check(
        "nft",
        if found { Status::Ok } else { Status::Warn },
        if found { "installed" } else { "not found" },
        "apt install nftables (child networks' rules), or run executors with --no-network",
    ));
}

fn space_check(out: &mut Vec<Check>, dir: &Path) {
    let probe = dir
        .ancestors()
        .find(|p| p.exists())
        .unwrap_or(Path::new("/"))
        .to_path_buf();
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    let c = std::ffi::CString::new(probe.as_os_str().as_encoded_bytes()).unwrap_or_default();
    // SAFETY: valid C string and out-pointer.
    let rc = unsafe { libc::statvfs(c.as_ptr(), &mut st) };
    let free_gib = if rc == 0 {
        (st.f_bavail as f64 * st.f_frsize as f64) / (1u64 << 30) as f64
    } else {
        0.0
    };
    out.push(check(
        "disk space",
        if free_gib >= 10.0 {
            Status::Ok
        } else if free_gib >= 2.0 {
            Status::Warn
        } else {
            Status::Fail
        },
        format!("{free_gib:.1} GiB free at {}", probe.display()),
        "snapshots need guest RAM size each: free space or point TINE_DATA_DIR elsewhere",
    ));
}

fn nofile_check(out: &mut Vec<Check>) {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: valid out-pointer.
    unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) };
    out.push(check(
        "open files",
        if r.rlim_max >= 65536 {
            Status::Ok
        } else {
            Status::Warn
        },
        format!("soft {} / hard {}", r.rlim_cur, r.rlim_max),
        "raise the hard limit (LimitNOFILE=1048576 in the systemd unit) for large fan-outs",
    ));
}

fn tool_check(out: &mut Vec<Check>, name: &'static str, path: &str, fix: &'static str) {
    let found = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).any(|d| d.join(path).exists()))
        .unwrap_or(false)
        || Path::new(path).exists();
    out.push(check(
        name,
        if found { Status::Ok } else { Status::Warn },
        if found { "found" } else { "missing" },
        fix,
    ));
}

pub fn run(a: DoctorArgs) -> Result<i32> {
    let mut checks = Vec::new();
    kvm_checks(&mut checks);
    kernel_check(&mut checks);
    cgroup_check(&mut checks);
    userfaultfd_check(&mut checks);
    memfd_check(&mut checks);
    huge_pages_check(&mut checks);
    ksm_check(&mut checks);
    nx_thread_check(&mut checks);
    debugfs_check(&mut checks);
    tun_check(&mut checks);
    let data_dir = a.data_dir.unwrap_or_else(tine_image::default_cache_dir);
    space_check(&mut checks, &data_dir);
    nofile_check(&mut checks);
    tool_check(
        &mut checks,
        "busybox-static",
        "/bin/busybox",
        "apt-get install busybox-static (guest images)",
    );
    tool_check(
        &mut checks,
        "dpkg-deb",
        "dpkg-deb",
        "guest kernels are unpacked from Debian packages: install dpkg",
    );
    tool_check(
        &mut checks,
        "qemu (lab)",
        "qemu-system-x86_64",
        "only for the nested lab: apt-get install qemu-system-x86",
    );

    let width = checks.iter().map(|c| c.name.len()).max().unwrap_or(0);
    for c in &checks {
        let tag = match c.status {
            Status::Ok => "ok  ",
            Status::Warn => "warn",
            Status::Fail => "FAIL",
        };
        println!("{tag}  {:width$}  {}", c.name, c.found);
        if c.status != Status::Ok && !c.fix.is_empty() {
            println!("      {:width$}  fix: {}", "", c.fix);
        }
    }
    let worst = checks.iter().map(|c| c.status).max().unwrap_or(Status::Ok);
    let fails = checks.iter().filter(|c| c.status == Status::Fail).count();
    let warns = checks.iter().filter(|c| c.status == Status::Warn).count();
    println!(
        "\n{} checks: {fails} failed, {warns} warnings",
        checks.len()
    );
    Ok(if worst == Status::Fail { 1 } else { 0 })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kvm_s_thread_per_vm_is_advised_against_only_where_the_cpu_is_not_affected() {
        let warn = nx_thread_advice(Some("N\n"), Some("Not affected\n"));
        assert!(warn.status == Status::Warn && warn.fix.contains("kvm.nx_huge_pages=never"));
        assert!(warn.found.contains("nx_huge_pages = N"), "{}", warn.found);
        for (param, cpu) in [
            (Some("never\n"), Some("Not affected\n")),
            (Some("Y\n"), Some("KVM: Mitigation: Split huge pages\n")),
            (Some("N\n"), None),
            (None, Some("Not affected\n")),
        ] {
            let c = nx_thread_advice(param, cpu);
            assert!(c.status == Status::Ok, "{param:?} {cpu:?}: {}", c.found);
        }
    }

    #[test]
    fn debugfs_is_advised_against_where_it_is_registered() {
        assert!(debugfs_advice(true).status == Status::Warn);
        assert!(debugfs_advice(true).fix.contains("debugfs=off"));
        assert!(debugfs_advice(false).status == Status::Ok);
    }
}
