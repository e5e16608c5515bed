//! vCPU threads: one OS thread per vCPU running KVM_RUN, routing exits to the device bus, and a
//! signal-based kick so the VMM can stop every vCPU promptly (also one parked in a guest HLT).

use std::cell::Cell;
use std::ptr::null_mut;
use std::sync::{Arc, Condvar, Mutex};

use kvm_bindings::kvm_run;
use kvm_ioctls::{VcpuExit, VcpuFd};

use crate::devices::bus::PioBus;
use crate::devices::mmio::MmioBus;
use crate::devices::GuestExit;
use crate::error::{Result, VcpuError};
use crate::snapshot::vcpu::VcpuState;

const KVM_SYSTEM_EVENT_SHUTDOWN: u32 = 1;
const KVM_SYSTEM_EVENT_RESET: u32 = 2;
const KVM_SYSTEM_EVENT_CRASH: u32 = 3;

thread_local! {
    /// This thread's kvm_run page, so the kick signal can set `immediate_exit` and close the
    /// race between checking the stop flag and entering KVM_RUN.
    static KVM_RUN_PTR: Cell<*mut kvm_run> = const { Cell::new(null_mut()) };
}

extern "C" fn kick_handler(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {
    KVM_RUN_PTR.with(|p| {
        let run = p.get();
        if !run.is_null() {
            // SAFETY: the pointer is this thread's live kvm_run mapping, set while its VcpuFd
            // exists; writing one byte is async-signal-safe.
            unsafe { (*run).immediate_exit = 1 };
        }
    });
}

/// The real-time signal used to kick vCPU threads out of KVM_RUN.
pub fn kick_signal() -> libc::c_int {
    libc::SIGRTMIN()
}

/// Install the kick handler once per process.
pub fn install_kick_handler() -> Result<()> {
    static ONCE: std::sync::OnceLock<std::result::Result<(), vmm_sys_util::errno::Error>> =
        std::sync::OnceLock::new();
    let installed = *ONCE
        .get_or_init(|| vmm_sys_util::signal::register_signal_handler(kick_signal(), kick_handler));
    installed.map_err(|source| {
        VcpuError::KickHandler {
            signal: kick_signal(),
            source,
        }
        .into()
    })
}

/// How a vCPU thread ended.
#[derive(Debug)]
pub enum VcpuOutcome {
    /// The guest asked to stop (or crashed) on this vCPU.
    Guest(GuestExit),
    /// The VMM asked this vCPU to stop.
    Stopped,
}

/// What the VMM wants the vCPU threads to do next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Want {
    Run,
    /// Leave KVM_RUN and park; with `save`, each vCPU saves its own state first (KVM requires
    /// vCPU ioctls from the vCPU's thread for a consistent picture).
    Pause {
        save: bool,
    },
    Stop,
}

struct ControlState {
    want: Want,
    /// Bumped on every pause request so a vCPU parks once per request.
    epoch: u64,
    parked: Vec<Option<u64>>,
    saved: Vec<Option<Result<VcpuState>>>,
    exited: Vec<bool>,
}

/// Shared between the VMM thread and the vCPU threads.
pub struct VcpuControl {
    state: Mutex<ControlState>,
    cv: Condvar,
}

impl VcpuControl {
    pub fn new(vcpus: usize) -> Arc<Self> {
        Arc::new(Self {
            state: Mutex::new(ControlState {
                want: Want::Run,
                epoch: 0,
                parked: vec![None; vcpus],
                saved: (0..vcpus).map(|_| None).collect(),
                exited: vec![false; vcpus],
            }),
            cv: Condvar::new(),
        })
    }

    /// Ask every vCPU for `want`. Stopping is final: once asked, later requests are refused
    /// (false), so a pause racing the guest's own exit cannot revive stopping vCPUs.
    pub fn request(&self, want: Want) -> bool {
        let mut s = self.state.lock().unwrap();
        if matches!(s.want, Want::Stop) {
            return matches!(want, Want::Stop);
        }
        s.want = want;
        if let Want::Pause { .. } = want {
            s.epoch += 1;
            s.saved.iter_mut().for_each(|v| *v = None);
        }
        self.cv.notify_all();
        true
    }

    /// Wait until every live vCPU parked for the current pause request, or fail if a vCPU
    /// exited meanwhile.
    pub fn wait_parked(&self) -> Result<()> {
        self.parked_then(|_| ())
    }

    /// [`wait_parked`](Self::wait_parked), then take the states the vCPUs saved (for a pause
    /// that asked for them), in vCPU order. A pause that saves nothing need not hold room for
    /// them: each is several KiB, and memory a child's VMM touches once stays with it.
    pub fn wait_parked_and_saved(&self) -> Result<Vec<Option<Result<VcpuState>>>> {
        self.parked_then(|s| s.saved.iter_mut().map(|v| v.take()).collect())
    }

    fn parked_then<T>(&self, f: impl FnOnce(&mut ControlState) -> T) -> Result<T> {
        let mut s = self.state.lock().unwrap();
        loop {
            let epoch = s.epoch;
            if let Some(index) = s.exited.iter().position(|e| *e) {
                return Err(VcpuError::StoppedWhilePausing { index }.into());
            }
            if s.parked.iter().all(|p| *p == Some(epoch)) {
                return Ok(f(&mut s));
            }
            s = self.cv.wait(s).unwrap();
        }
    }

    fn mark_exited(&self, index: usize) {
        let mut s = self.state.lock().unwrap();
        s.exited[index] = true;
        self.cv.notify_all();
    }

    /// Called by a vCPU thread at the top of its loop: returns what to do now, parking while
    /// paused.
    fn checkpoint(&self, index: usize, fd: &VcpuFd, msrs: &[u32]) -> Want {
        // Read under the lock and released before parking, which takes it again.
        let want = self.state.lock().unwrap().want;
        match want {
            Want::Pause { .. } => self.park(index, fd, msrs),
            want => want,
        }
    }

    /// A vCPU's own state, saved for a pause that asked for it. Out of line from
    /// [`Self::park`] for the same reason park is out of the loop: only a pause that saves
    /// (a snapshot, a branch) takes this frame, not every pause (a give-back's).
    #[cold]
    #[inline(never)]
    fn save_own_state(&self, index: usize, fd: &VcpuFd, msrs: &[u32]) {
        let saved = crate::snapshot::vcpu::save(fd, index, msrs);
        self.state.lock().unwrap().saved[index] = Some(saved);
    }

    /// [`Self::checkpoint`] while paused. Out of line: the state it saves (an XSAVE area and
    /// more, several KiB) would otherwise sit in the vCPU loop's frame, and a frame's pages
    /// are all touched on entry (stack probes), so every vCPU thread would hold them for good.
    #[cold]
    #[inline(never)]
    fn park(&self, index: usize, fd: &VcpuFd, msrs: &[u32]) -> Want {
        let mut s = self.state.lock().unwrap();
        loop {
            match s.want {
                Want::Pause { save } if s.parked[index] != Some(s.epoch) => {
                    let epoch = s.epoch;
                    drop(s);
                    // Tell KVM the guest was paused on purpose (no soft-lockup warning).
                    let _ = fd.kvmclock_ctrl();
                    if save {
                        self.save_own_state(index, fd, msrs);
                    }
                    s = self.state.lock().unwrap();
                    s.parked[index] = Some(epoch);
                    self.cv.notify_all();
                }
                Want::Pause { .. } => s = self.cv.wait(s).unwrap(),
                want => return want,
            }
        }
    }
}

pub struct VcpuRunner {
    pub index: usize,
    pub fd: VcpuFd,
    pub pio: Arc<PioBus>,
    pub mmio: Arc<MmioBus>,
    pub control: Arc<VcpuControl>,
    /// MSRs to save when asked to.
    pub msrs: Arc<Vec<u32>>,
}

impl VcpuRunner {
    pub fn run(mut self) -> Result<VcpuOutcome> {
        let run_ptr: *mut kvm_run = self.fd.get_kvm_run();
        KVM_RUN_PTR.with(|p| p.set(run_ptr));
        let result = self.run_loop();
        KVM_RUN_PTR.with(|p| p.set(null_mut()));
        self.control.mark_exited(self.index);
        result
    }

    /// Registers at a guest crash: the first thing anyone debugging it asks for. Out of line,
    /// as [`VcpuControl::park`] is.
    #[cold]
    #[inline(never)]
    fn log_crash_state(&self) {
        let regs = self.fd.get_regs();
        let sregs = self.fd.get_sregs();
        let events = self.fd.get_vcpu_events();
        tracing::warn!(
            vcpu = self.index,
            ?regs,
            ?sregs,
            ?events,
            "guest triple fault"
        );
    }

    fn run_loop(&mut self) -> Result<VcpuOutcome> {
        loop {
            if self.control.checkpoint(self.index, &self.fd, &self.msrs) == Want::Stop {
                return Ok(VcpuOutcome::Stopped);
            }
            match self.fd.run() {
                Ok(VcpuExit::IoIn(port, data)) => self.pio.read(port, data),
                Ok(VcpuExit::IoOut(port, data)) => {
                    if let Some(exit) = self.pio.write(port, data) {
                        return Ok(VcpuOutcome::Guest(exit));
                    }
                }
                Ok(VcpuExit::MmioRead(addr, data)) => self.mmio.read(addr, data),
                Ok(VcpuExit::MmioWrite(addr, data)) => self.mmio.write(addr, data),
                Ok(VcpuExit::Hlt) => {}
                Ok(VcpuExit::Shutdown) => {
                    self.log_crash_state();
                    return Ok(VcpuOutcome::Guest(GuestExit::TripleFault));
                }
                Ok(VcpuExit::SystemEvent(kind, _)) => {
                    let exit = match kind {
                        KVM_SYSTEM_EVENT_SHUTDOWN => GuestExit::PowerOff,
                        KVM_SYSTEM_EVENT_RESET => GuestExit::Reboot,
                        KVM_SYSTEM_EVENT_CRASH => GuestExit::TripleFault,
                        event => {
                            return Err(VcpuError::UnknownSystemEvent {
                                index: self.index,
                                event,
                            }
                            .into())
                        }
                    };
                    return Ok(VcpuOutcome::Guest(exit));
                }
                Ok(VcpuExit::FailEntry(reason, cpu)) => {
                    return Err(VcpuError::EntryFailed {
                        index: self.index,
                        reason,
                        cpu,
                    }
                    .into())
                }
                Ok(VcpuExit::InternalError) => {
                    let rip = self.fd.get_regs().map(|r| r.rip).unwrap_or(0);
                    return Err(VcpuError::Internal {
                        index: self.index,
                        rip,
                    }
                    .into());
                }
                Ok(other) => {
                    return Err(VcpuError::UnexpectedExit {
                        index: self.index,
                        exit: format!("{other:?}"),
                    }
                    .into());
                }
                Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => {
                    self.fd.set_kvm_immediate_exit(0);
                }
                Err(source) => {
                    return Err(VcpuError::Ioctl {
                        index: self.index,
                        call: "KVM_RUN",
                        source,
                    }
                    .into())
                }
            }
        }
    }
}
