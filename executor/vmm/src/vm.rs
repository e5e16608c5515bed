//! A VM: KVM VM + irqchip + PIT, guest RAM, devices and vCPUs. Build one fresh (`create` +
//! `load_linux`) or from a snapshot (`restore`), then `start` it; the running VM can be paused,
//! snapshotted, resumed, stopped, or waited for.

use std::io::Write;
use std::os::unix::thread::JoinHandleExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvm_bindings::{kvm_pit_config, kvm_userspace_memory_region, CpuId, KVM_PIT_SPEAKER_DUMMY};
use kvm_ioctls::{IoEventAddress, Kvm, VcpuFd, VmFd};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::acpi::{self, AcpiConfig, VirtioMmioSlot};
use crate::boot::{self, EntryPoint};
use crate::devices::bus::PioBus;
use crate::devices::mmio::MmioBus;
use crate::devices::power::{AcpiPm, I8042};
use crate::devices::serial::SerialConsole;
use crate::devices::virtio::mmio::{VirtioMmio, QUEUE_NOTIFY_OFFSET};
use crate::devices::virtio::net::{Mac, Net, Tap};
use crate::devices::virtio::vsock::Vsock;
pub use crate::devices::virtio::DeviceLoop;
use crate::devices::virtio::{IrqLine, VirtioDevice};
use crate::devices::vmgenid::{self, VmGenId};
use crate::devices::GuestExit;
use crate::error::{
    ConfigError, DeviceError, Error, MemoryError, RestoreError, Result, SnapshotError, VcpuError,
};
use crate::kvm_stats::{Counters, VmStats};
use crate::layout::*;
use crate::memory::{GuestRam, Origin};
use crate::snapshot::devices::{SerialSnapshot, VirtioKind};
use crate::snapshot::file::{self as snapfile, MemoryOut, SnapshotHeader};
use crate::snapshot::{self, MachineState};
use crate::snapshot::{diff, live_copy};
use crate::vcpu::{install_kick_handler, kick_signal, VcpuControl, VcpuOutcome, VcpuRunner, Want};
use crate::{cpuid, host, regs};

/// Most vCPUs we configure: MADT local-APIC ids are one byte and 255 is broadcast.
pub const MAX_VCPUS: u8 = 254;

/// Default kernel command line: serial console, no PCI probing, reboot via the i8042 line,
/// and no legacy devices we do not emulate. Deliberately not `init_on_free=1`: zeroing every
/// freed page made the guest touch all of its RAM at boot (41% of a cold boot in the lab,
/// docs/performance.md) and made children copy shared pages only to clear them, while saving
/// under 2% of a snapshot's stored bytes. Transparent huge pages only where a program asks
/// (`madvise`, not Debian's `always`): otherwise the guest's khugepaged collapses an idle
/// clone's memory into huge pages, copying 2 MiB at a time into pages of the clone's own.
/// Fewer periodic wake-ups of an idle guest, each of which costs every idle child exits and
/// CPU (docs/performance.md, "What an idle child does"): no soft-lockup watchdog, no pressure
/// stall averaging, no proactive compaction (kcompactd's 0.5 s check), and VM statistics
/// folded every 10 s instead of every second.
pub const DEFAULT_CMDLINE: &str = "console=ttyS0 reboot=k panic=-1 pci=off i8042.noaux \
     i8042.nomux i8042.dumbkbd tsc=reliable transparent_hugepage=madvise nowatchdog psi=0 \
     sysctl.vm.compaction_proactiveness=0 sysctl.vm.stat_interval=10";

/// A Linux boot: kernel image, optional initramfs and command line.
#[derive(Clone, Debug)]
pub struct LinuxBoot {
    pub kernel: PathBuf,
    pub initrd: Option<PathBuf>,
    pub cmdline: String,
}

/// How the VMM runs a VM, where that changes nothing the guest can see (so nothing a snapshot
/// records: a VM can be restored with other options than it was snapshotted with).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VmOptions {
    /// Deliver virtio queue notifications through KVM ioeventfds (default): the guest's write
    /// to a queue's QueueNotify register signals an eventfd inside KVM, the vCPU goes straight
    /// back to the guest, and the device thread picks the notification up. Off, or where KVM
    /// refuses the registration (logged once), each notification is an MMIO exit handled on
    /// the vCPU thread.
    pub ioeventfd: bool,
}

impl Default for VmOptions {
    fn default() -> Self {
        Self { ioeventfd: true }
    }
}

/// How one virtio device's queue notifications reach it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NotifyPath {
    /// KVM signals the device's eventfds; the vCPU does not leave the kernel.
    Ioeventfd,
    /// The write exits to the VMM and is handled on the vCPU thread.
    VcpuExit,
}

/// Host-side wiring for a VM restored from a snapshot.
pub struct RestoreOptions {
    pub console: Box<dyn Write + Send>,
    /// Where the vsock device (if the snapshot has one) listens on the host.
    pub vsock_uds: Option<PathBuf>,
    /// The tap behind the network device, if the snapshot has one (None: the guest keeps its
    /// interface, with no link behind it).
    pub tap: Option<Tap>,
}

/// The parts of a VM that do not depend on what will run in it: the KVM VM with its irqchip
/// and PIT, and its first vCPU. A pre-started VMM worker makes one while it waits for its job,
/// so a restore starts with them done.
pub struct Shell {
    kvm: Kvm,
    vm: VmFd,
    vcpus: Vec<VcpuFd>,
}

impl Shell {
    pub fn new() -> Result<Shell> {
        let kvm = host::open_kvm()?;
        let vm = kvm.create_vm().map_err(Error::kvm("KVM_CREATE_VM"))?;
        vm.set_tss_address(KVM_TSS_ADDR as usize)
            .map_err(Error::kvm("KVM_SET_TSS_ADDR"))?;
        vm.set_identity_map_address(KVM_IDENTITY_MAP_ADDR)
            .map_err(Error::kvm("KVM_SET_IDENTITY_MAP_ADDR"))?;
        vm.create_irq_chip()
            .map_err(Error::kvm("KVM_CREATE_IRQCHIP"))?;
        let pit = kvm_pit_config {
            flags: KVM_PIT_SPEAKER_DUMMY,
            ..Default::default()
        };
        vm.create_pit2(pit).map_err(Error::kvm("KVM_CREATE_PIT2"))?;
        // Every VM has a vCPU 0; more are added once the count is known.
        let vcpu0 = vm.create_vcpu(0).map_err(Error::kvm("KVM_CREATE_VCPU"))?;
        Ok(Shell {
            kvm,
            vm,
            vcpus: vec![vcpu0],
        })
    }
}

/// A restore made up to what needs its child (see [`Vm::prime`]): the snapshot loaded and
/// checked, guest RAM mapped, the VM built with its memory slots, serial and vCPUs, and the
/// MMIO windows of its devices wired (irqfds, queue eventfds). What is left,
/// [`Primed::restore`], needs the child's console, vsock socket and tap: its devices made and
/// put in their windows, then vCPU, irqchip and clock, and device state, set just before the
/// guest runs (the clocks go on from the moment they are set). A pre-started worker primes
/// itself for the snapshot its host spawns from, so a child starts with this done.
pub struct Primed {
    vm: Vm,
    state: MachineState,
    dir: PathBuf,
    /// One per device of `state.virtio`, in order.
    wired: Vec<WiredSlot>,
}

/// A virtio MMIO window wired into the VM before its device exists (see `Vm::wire_slot`).
struct WiredSlot {
    slot: VirtioMmioSlot,
    /// Registered as the window's interrupt.
    irq: EventFd,
    /// Registered for QueueNotify writes of each queue's index; None: those writes exit to
    /// the VMM.
    queue_events: Option<Vec<Arc<EventFd>>>,
}

impl Primed {
    /// The VM so far: its RAM and memory slots, its vCPUs (to map pages ahead through).
    pub fn vm(&self) -> &Vm {
        &self.vm
    }

    /// The snapshot directory it was primed from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Finish the restore for the child `opts` describes, its snapshot now reached at
    /// `seen_at` (where it was primed from, or the same files in a view the VMM entered
    /// since): a diff of the child names its parent by that path. The restore marks go on
    /// from here: what this thread did between the priming and now is not the restore's.
    pub fn restore(self, seen_at: &Path, mut opts: RestoreOptions) -> Result<Vm> {
        let Primed {
            mut vm,
            state,
            wired,
            ..
        } = self;
        let dir = seen_at.to_path_buf();
        vm.ram.origin_seen_at(&dir);
        vm.restore_marks.resume();
        vm.serial.lock().unwrap().set_output(opts.console);
        for (v, w) in state.virtio.iter().zip(wired) {
            let dev: Box<dyn VirtioDevice> = match v.kind {
                VirtioKind::Vsock { guest_cid } => {
                    let uds = opts
                        .vsock_uds
                        .as_deref()
                        .ok_or_else(|| RestoreError::NoVsockSocket { dir: dir.clone() })?;
                    // Its thread starts with the VM, after the VMM's confinement.
                    Box::new(Vsock::prepare(guest_cid, uds)?)
                }
                VirtioKind::Net { mac } => Box::new(Net::prepare(mac, opts.tap.take())?),
            };
            vm.attach_wired(w, dev)?;
        }
        vm.restore_marks.mark("device-make");
        for (i, (fd, s)) in vm.vcpus.iter().zip(&state.vcpus).enumerate() {
            snapshot::vcpu::restore(fd, i, s)?;
        }
        vm.restore_marks.mark("vcpus");
        snapshot::restore_vm(&vm.vm, &state.vm)?;
        vm.restore_marks.mark("irqchip");
        // Devices last. Their registers only: a device that was active is activated by
        // `start` (a confined VMM starts only once confined), after which a restored vsock
        // raises an interrupt for its transport reset.
        for (t, s) in vm.virtio.iter().zip(&state.virtio) {
            t.lock().unwrap().restore(s)?;
        }
        // A new VM instance: a new generation ID, announced once the irqchip is back.
        // Raised only for a guest whose driver listens (devices::vmgenid::Driver).
        if let Some(driver) = state.vmgenid {
            let raised = vm.attach_generation_id(driver)?.notify_restored()?;
            tracing::debug!(?driver, raised, "new VM generation ID");
        }
        vm.restore_marks.mark("device-state");
        Ok(vm)
    }
}

/// What a restore may be handed ready-made (see [`Vm::restore_prepared`]).
#[derive(Default)]
pub struct Prepared {
    /// A copy of the root snapshot's `memory.img` to map instead of that file: one the host
    /// holds in memory (huge pages, so a child's first touches map 2 MiB at a time). The
    /// caller vouches that it is that file's copy; only its size is checked.
    pub image: Option<std::fs::File>,
    /// A VM shell made ahead of the restore.
    pub shell: Option<Shell>,
}

pub struct Vm {
    kvm: Kvm,
    vm: VmFd,
    ram: GuestRam,
    vcpus: Vec<VcpuFd>,
    pio: PioBus,
    mmio: MmioBus,
    virtio_slots: Vec<VirtioMmioSlot>,
    virtio: Vec<Arc<Mutex<VirtioMmio>>>,
    notify_paths: Vec<NotifyPath>,
    serial: Arc<Mutex<SerialConsole>>,
    options: VmOptions,
    /// Set once the guest's tables announce a generation ID (a boot) or its snapshot says they
    /// do (a restore).
    vmgenid: Option<VmGenId>,
    /// KVM's counters for this VM (None: the host kernel has no statistics files).
    stats: Option<VmStats>,
    /// The restoring thread's CPU and page faults per part of the restore (empty for a boot).
    restore_marks: crate::marks::Marks,
}

/// The vCPU count as KVM and the MADT take it, or why not.
fn validate_vcpus(n: usize) -> Result<u8> {
    match u8::try_from(n) {
        Ok(v) if (1..=MAX_VCPUS).contains(&v) => Ok(v),
        _ => Err(ConfigError::VcpuCount {
            requested: n,
            max: MAX_VCPUS,
        }
        .into()),
    }
}

impl Vm {
    /// KVM VM, irqchip, PIT, memory slots, legacy devices and bare vCPUs: what both a fresh
    /// boot and a restore need.
    fn build(
        vcpus: usize,
        ram: GuestRam,
        console: Box<dyn Write + Send>,
        serial_state: Option<&SerialSnapshot>,
        options: VmOptions,
        shell: Option<Shell>,
    ) -> Result<Self> {
        let vcpus = validate_vcpus(vcpus)?;
        let Shell {
            kvm,
            vm,
            vcpus: mut fds,
        } = match shell {
            Some(shell) => shell,
            None => Shell::new()?,
        };
        let max = kvm.get_max_vcpus();
        if vcpus as usize > max {
            return Err(ConfigError::VcpusOverHostLimit {
                requested: vcpus,
                host_max: max,
            }
            .into());
        }
        for (slot, r) in ram.ranges().iter().enumerate() {
            let region = kvm_userspace_memory_region {
                slot: slot as u32,
                guest_phys_addr: r.guest_addr,
                memory_size: r.size,
                userspace_addr: ram.host_address(r)?,
                flags: 0,
            };
            // SAFETY: the region maps memory owned by `ram`, which lives as long as the VM.
            unsafe { vm.set_user_memory_region(region) }
                .map_err(Error::kvm("KVM_SET_USER_MEMORY_REGION"))?;
        }

        let serial_irq = EventFd::new(EFD_NONBLOCK)?;
        vm.register_irqfd(&serial_irq, COM1_IRQ)
            .map_err(Error::kvm("KVM_IRQFD"))?;
        let serial = match serial_state {
            Some(s) => SerialConsole::from_snapshot(serial_irq, console, s)?,
            None => SerialConsole::new(serial_irq, console),
        };
        let serial = Arc::new(Mutex::new(serial));
        let mut pio = PioBus::default();
        pio.insert(COM1_PORT, 8, serial.clone())?;
        pio.insert(I8042_CMD_PORT, 1, Arc::new(Mutex::new(I8042)))?;
        pio.insert(ACPI_PM_PORT, 3, Arc::new(Mutex::new(AcpiPm)))?;

        for i in fds.len() as u8..vcpus {
            fds.push(
                vm.create_vcpu(i as u64)
                    .map_err(Error::kvm("KVM_CREATE_VCPU"))?,
            );
        }
        // Opened now, before the vCPUs run: an ioctl on a vCPU descriptor waits for that
        // vCPU's KVM_RUN to return, which a halted guest may not do for a long time.
        let stats = VmStats::open(&vm, &fds)
            .map_err(|e| tracing::debug!("no KVM counters: {e}"))
            .ok();
        Ok(Self {
            kvm,
            vm,
            ram,
            vcpus: fds,
            pio,
            mmio: MmioBus::default(),
            virtio_slots: Vec::new(),
            virtio: Vec::new(),
            notify_paths: Vec::new(),
            serial,
            options,
            vmgenid: None,
            restore_marks: crate::marks::Marks::default(),
            stats,
        })
    }

    /// Create a fresh VM with `vcpus` vCPUs over `ram`, console output to `console`, with the
    /// default [`VmOptions`].
    pub fn create(vcpus: u8, ram: GuestRam, console: Box<dyn Write + Send>) -> Result<Self> {
        Self::create_with(vcpus, ram, console, VmOptions::default())
    }

    /// [`create`](Self::create) with `options`.
    pub fn create_with(
        vcpus: u8,
        ram: GuestRam,
        console: Box<dyn Write + Send>,
        options: VmOptions,
    ) -> Result<Self> {
        Self::create_prepared(vcpus, ram, console, options, None)
    }

    /// [`create_with`](Self::create_with) on a VM shell made ahead (None: made here).
    pub fn create_prepared(
        vcpus: u8,
        ram: GuestRam,
        console: Box<dyn Write + Send>,
        options: VmOptions,
        shell: Option<Shell>,
    ) -> Result<Self> {
        let vm = Self::build(vcpus.into(), ram, console, None, options, shell)?;
        let base_cpuid: CpuId = cpuid::supported(&vm.kvm)?;
        let tsc_deadline = vm.kvm.check_extension(kvm_ioctls::Cap::TscDeadlineTimer);
        for (i, fd) in vm.vcpus.iter().enumerate() {
            let c = cpuid::for_vcpu(&base_cpuid, i as u32, vcpus as u32, tsc_deadline);
            fd.set_cpuid2(&c)
                .map_err(VcpuError::ioctl(i, "KVM_SET_CPUID2"))?;
            regs::setup_common(fd, i)?;
        }
        Ok(vm)
    }

    /// Recreate a VM from a snapshot directory. Guest RAM is the snapshot's memory image mapped
    /// copy-on-write: the image is never modified, and pages stay shared until written. The
    /// default [`VmOptions`] apply.
    pub fn restore(dir: &Path, opts: RestoreOptions) -> Result<Self> {
        Self::restore_with(dir, opts, VmOptions::default())
    }

    /// [`restore`](Self::restore) with `options`. Devices are created anew, so host-side
    /// wiring such as queue-notification eventfds belongs to this VM alone.
    pub fn restore_with(dir: &Path, opts: RestoreOptions, options: VmOptions) -> Result<Self> {
        Self::restore_prepared(dir, Prepared::default(), opts, options)
    }

    /// [`restore_with`](Self::restore_with), using what was made ahead: guest RAM mapped
    /// copy-on-write from a held copy of the image, and a VM shell.
    pub fn restore_prepared(
        dir: &Path,
        prepared: Prepared,
        opts: RestoreOptions,
        options: VmOptions,
    ) -> Result<Self> {
        let t0 = Instant::now();
        let held = prepared.image.is_some();
        let vm = Self::prime(dir, prepared, options)?.restore(dir, opts)?;
        tracing::info!(elapsed = ?t0.elapsed(), dir = %dir.display(), held, "restored");
        Ok(vm)
    }

    /// The part of a restore that needs only the snapshot: loaded and checked, guest RAM
    /// mapped, the VM with its memory slots, serial and vCPUs (see [`Primed`]).
    pub fn prime(dir: &Path, prepared: Prepared, options: VmOptions) -> Result<Primed> {
        let Prepared { image, shell } = prepared;
        let mut marks = crate::marks::Marks::from_now();
        let snap = snapfile::load_marked(dir, Some(&mut marks))?;
        let state = snap.state;
        let origin = Origin {
            dir: dir.to_path_buf(),
            state_sha256: snap.header.state_sha256,
        };
        let held = image.is_some();
        let ram = GuestRam::from_chain(
            image.unwrap_or(snap.memory),
            state.mem_size,
            snap.overlays,
            origin,
        )?;
        if held {
            // The copy sits in huge pages; a private mapping gets them only when advised.
            ram.advise_huge_pages();
        }
        marks.mark("ram");
        Self::prime_onto(dir, state, ram, options, shell, marks)
    }

    /// Restore the checked `state` of snapshot `dir` onto `ram` that the caller prepared, e.g.
    /// anonymous RAM registered with a userfaultfd whose pages are supplied on first touch
    /// (see [`GuestRam::new_anonymous`]). `ram` must be exactly the snapshot's memory size.
    /// `shell` is a VM shell made ahead (None: made here).
    pub fn restore_onto(
        dir: &Path,
        state: MachineState,
        ram: GuestRam,
        opts: RestoreOptions,
        options: VmOptions,
        shell: Option<Shell>,
    ) -> Result<Self> {
        let t0 = Instant::now();
        if ram.size() != state.mem_size {
            return Err(MemoryError::ImageSize {
                expected: state.mem_size,
                actual: ram.size(),
            }
            .into());
        }
        let marks = crate::marks::Marks::from_now();
        let vm = Self::restore_state(dir, state, ram, opts, options, shell, marks)?;
        tracing::info!(elapsed = ?t0.elapsed(), dir = %dir.display(), "restored onto supplied RAM");
        Ok(vm)
    }

    fn restore_state(
        dir: &Path,
        state: MachineState,
        ram: GuestRam,
        opts: RestoreOptions,
        options: VmOptions,
        shell: Option<Shell>,
        marks: crate::marks::Marks,
    ) -> Result<Self> {
        Self::prime_onto(dir, state, ram, options, shell, marks)?.restore(dir, opts)
    }

    fn prime_onto(
        dir: &Path,
        state: MachineState,
        ram: GuestRam,
        options: VmOptions,
        shell: Option<Shell>,
        mut marks: crate::marks::Marks,
    ) -> Result<Primed> {
        // The console is the child's, known only with it (Primed::restore).
        let mut vm = Self::build(
            state.vcpus.len(),
            ram,
            Box::new(std::io::sink()),
            Some(&state.serial),
            options,
            shell,
        )?;
        marks.mark("vm");
        // Its devices' windows, wired now: that needs the VM, not the devices or the child.
        let wired = state
            .virtio
            .iter()
            .enumerate()
            .map(|(i, v)| vm.wire_slot(i, v.kind.queues()))
            .collect::<Result<Vec<_>>>()?;
        marks.mark("device-wire");
        vm.restore_marks = marks;
        Ok(Primed {
            vm,
            state,
            dir: dir.to_path_buf(),
            wired,
        })
    }

    /// The restoring thread's CPU and page faults per part of the restore: the snapshot loaded
    /// and checked (header, state read, its checksum, decoded, the diff chain and memory image
    /// opened; a lazy restore loads before and has none of these), guest RAM mapped, the VM
    /// (memory slots, serial, vCPUs), its devices' MMIO windows wired (irqfds, queue
    /// eventfds; done by a primed worker before its child), its devices made (vsock's socket
    /// and thread, net's tap) and put in their windows, vCPU state, irqchip and clocks, device
    /// state and generation ID. Empty for a boot.
    pub fn restore_marks(&self) -> &crate::marks::Marks {
        &self.restore_marks
    }

    pub fn ram(&self) -> &GuestRam {
        &self.ram
    }

    /// Map these pages of the memory image for the guest before it runs, so its first touches
    /// of them do not each exit to the host, copying the ones it is expected to write (see
    /// [`crate::prefault`]). Call after the restore and before [`start`](Self::start); a
    /// failure only leaves the guest to fault as before.
    pub fn prefault(&self, touched: &[u64], written: &[u64]) -> crate::prefault::Prefaulted {
        crate::prefault::prefault(&self.vm, &self.vcpus[0], &self.ram, touched, written)
    }

    pub fn vm_fd(&self) -> &VmFd {
        &self.vm
    }

    pub fn options(&self) -> VmOptions {
        self.options
    }

    /// How each virtio device (in the order they were added) gets its queue notifications.
    pub fn notify_paths(&self) -> &[NotifyPath] {
        &self.notify_paths
    }

    /// Attach a virtio device in the next free MMIO window, announced to the guest in the DSDT.
    pub fn add_virtio(&mut self, device: Box<dyn VirtioDevice>) -> Result<VirtioMmioSlot> {
        let wired = self.wire_slot(self.virtio_slots.len(), device.queue_max_sizes().len())?;
        self.attach_wired(wired, device)
    }

    /// Wire MMIO window `index` for a device of `queues` virtqueues: its interrupt's irqfd
    /// and, with ioeventfds, one eventfd per queue registered with KVM for a 4-byte write of
    /// the queue index to QueueNotify. None of it needs the device, so a primed restore does
    /// it before its child is known. A failure to register the queue eventfds leaves none
    /// registered: those writes then exit to the VMM as without ioeventfds.
    fn wire_slot(&self, index: usize, queues: usize) -> Result<WiredSlot> {
        let slot = VirtioMmioSlot {
            base: Self::slot_base(index),
            size: VIRTIO_MMIO_SIZE,
            irq: VIRTIO_FIRST_IRQ + index as u32,
        };
        let irq = EventFd::new(EFD_NONBLOCK)?;
        self.vm
            .register_irqfd(&irq, slot.irq)
            .map_err(Error::kvm("KVM_IRQFD"))?;
        let queue_events = if self.options.ioeventfd {
            self.register_queue_events(slot.base, queues)
        } else {
            None
        };
        Ok(WiredSlot {
            slot,
            irq,
            queue_events,
        })
    }

    fn register_queue_events(&self, base: u64, queues: usize) -> Option<Vec<Arc<EventFd>>> {
        let mut events: Vec<Arc<EventFd>> = Vec::with_capacity(queues);
        for q in 0..queues {
            let registered = EventFd::new(EFD_NONBLOCK)
                .map_err(|e| format!("creating its eventfd: {e}"))
                .and_then(|e| {
                    // Datamatch on a u32: KVM matches 4-byte writes of exactly `q`; any other
                    // width or value still exits (and the transport handles or ignores it).
                    self.vm
                        .register_ioevent(&e, &Self::queue_notify_at(base), q as u32)
                        .map(|()| e)
                        .map_err(|e| format!("KVM_IOEVENTFD: {e}"))
                });
            match registered {
                Ok(e) => events.push(Arc::new(e)),
                Err(err) => {
                    self.unregister_queue_events(base, &events);
                    warn_ioeventfd_unavailable(base, q, &err);
                    return None;
                }
            }
        }
        Some(events)
    }

    fn queue_notify_at(base: u64) -> IoEventAddress {
        IoEventAddress::Mmio(base + QUEUE_NOTIFY_OFFSET)
    }

    fn unregister_queue_events(&self, base: u64, events: &[Arc<EventFd>]) {
        for (q, e) in events.iter().enumerate() {
            let _ = self
                .vm
                .unregister_ioevent(e, &Self::queue_notify_at(base), q as u32);
        }
    }

    /// Put `device` in the window `wired` made for it, the next free one. Its queue
    /// notifications come through the wired eventfds if it takes them (and has as many
    /// queues as were wired), else as exits to the VMM.
    fn attach_wired(
        &mut self,
        wired: WiredSlot,
        mut device: Box<dyn VirtioDevice>,
    ) -> Result<VirtioMmioSlot> {
        let WiredSlot {
            slot,
            irq,
            queue_events,
        } = wired;
        let next = Self::slot_base(self.virtio_slots.len());
        if slot.base != next {
            return Err(DeviceError::SlotOutOfOrder {
                wired: slot.base,
                next,
            }
            .into());
        }
        let notify = match queue_events {
            Some(events)
                if events.len() == device.queue_max_sizes().len()
                    && device.attach_queue_events(&events) =>
            {
                NotifyPath::Ioeventfd
            }
            Some(events) => {
                self.unregister_queue_events(slot.base, &events);
                NotifyPath::VcpuExit
            }
            None => NotifyPath::VcpuExit,
        };
        tracing::debug!(base = slot.base, ?notify, "virtio device added");
        let transport = Arc::new(Mutex::new(VirtioMmio::new(
            device,
            self.ram.memory().clone(),
            IrqLine::new(irq),
        )));
        self.mmio.insert(slot.base, slot.size, transport.clone())?;
        self.virtio.push(transport);
        self.virtio_slots.push(slot);
        self.notify_paths.push(notify);
        Ok(slot)
    }

    fn slot_base(index: usize) -> u64 {
        VIRTIO_MMIO_BASE + index as u64 * VIRTIO_MMIO_SIZE
    }

    /// Attach a virtio-vsock device with guest CID `cid`, host side on the Unix socket `uds`.
    pub fn add_vsock(&mut self, cid: u64, uds: &Path) -> Result<VirtioMmioSlot> {
        self.add_virtio(Box::new(Vsock::new(cid, uds)?))
    }

    /// Attach a virtio-net device with guest MAC `mac` backed by `tap` (None: no link).
    pub fn add_net(&mut self, mac: Mac, tap: Option<Tap>) -> Result<VirtioMmioSlot> {
        self.add_virtio(Box::new(Net::new(mac, tap)?))
    }

    /// Give the guest a VM generation ID (devices::vmgenid), renewed at every restore. A Linux
    /// boot does this and announces it in the ACPI tables; hand-made guests may opt in.
    pub fn enable_generation_id(&mut self) -> Result<()> {
        if self.vmgenid.is_none() {
            self.attach_generation_id(vmgenid::Driver::NotBound)?;
        }
        Ok(())
    }

    /// A fresh generation ID and its interrupt line, with the port its `ADDR` method writes to.
    fn attach_generation_id(&mut self, driver: vmgenid::Driver) -> Result<&VmGenId> {
        let g = VmGenId::new(&self.vm, self.ram.memory(), driver)?;
        self.pio
            .insert(VMGENID_WATCH_PORT, 1, Arc::new(Mutex::new(g.watch())))?;
        Ok(self.vmgenid.insert(g))
    }

    /// The guest's current generation ID, if it has one.
    pub fn generation_id(&self) -> Result<Option<[u8; 16]>> {
        match self.vmgenid {
            Some(_) => Ok(Some(vmgenid::read(self.ram.memory())?)),
            None => Ok(None),
        }
    }

    /// Load a Linux kernel and point the boot vCPU at its entry.
    pub fn load_linux(&mut self, boot: &LinuxBoot) -> Result<EntryPoint> {
        self.enable_generation_id()?;
        let acpi_cfg = AcpiConfig {
            vcpus: self.vcpus.len() as u8,
            virtio: self.virtio_slots.clone(),
            vmgenid: true,
        };
        let rsdp = acpi::write_tables(self.ram.memory(), &acpi_cfg)?;
        let info = boot::load(
            &self.ram,
            &boot.kernel,
            boot.initrd.as_deref(),
            &boot.cmdline,
            rsdp,
        )?;
        self.set_entry(info.entry)?;
        Ok(info.entry)
    }

    /// Start the boot vCPU at `entry` (boot tables written, registers set).
    pub fn set_entry(&mut self, entry: EntryPoint) -> Result<()> {
        regs::write_boot_tables(self.ram.memory(), entry)?;
        regs::setup_boot_vcpu(&self.vcpus[0], 0, entry)
    }

    /// Start every vCPU on its own thread, and every device's thread.
    pub fn start(self) -> Result<RunningVm> {
        self.start_devices(false).map(|(vm, _)| vm)
    }

    /// [`start`](Self::start), except that the devices that can (vsock, net) hand their event loops
    /// to the caller instead of starting threads of their own: the caller must turn them (see
    /// [`DeviceLoop`]) for as long as the VM runs, or those devices stall.
    pub fn start_with_loops(self) -> Result<(RunningVm, Vec<Box<dyn DeviceLoop>>)> {
        self.start_devices(true)
    }

    fn start_devices(self, hand_loops: bool) -> Result<(RunningVm, Vec<Box<dyn DeviceLoop>>)> {
        install_signal_handlers()?;
        // Device threads not started yet (a restore's), then a restored device looks at its
        // queues (guest-written) only now.
        let mut loops = Vec::new();
        for t in &self.virtio {
            let mut t = t.lock().unwrap();
            if hand_loops {
                loops.extend(t.take_device_loop());
            }
            t.start_device()?;
            t.activate_restored();
        }
        let msrs = Arc::new(snapshot::vcpu::msr_candidates(&self.kvm)?);
        let pio = Arc::new(self.pio);
        let mmio = Arc::new(self.mmio);
        let control = VcpuControl::new(self.vcpus.len());
        let (tx, rx) = mpsc::channel::<(usize, Result<VcpuOutcome>)>();
        let stopped = Arc::new(EventFd::new(EFD_NONBLOCK)?);
        let mut threads = Vec::new();
        for (index, fd) in self.vcpus.into_iter().enumerate() {
            let runner = VcpuRunner {
                index,
                fd,
                pio: pio.clone(),
                mmio: mmio.clone(),
                control: control.clone(),
                msrs: msrs.clone(),
            };
            let tx = tx.clone();
            let stopped = stopped.clone();
            let t = crate::thread_builder(format!("vcpu{index}")).spawn(move || {
                let r = runner.run();
                let _ = tx.send((index, r));
                // Cannot fail short of 2^64 - 1 writes; a waiter polls it, never reads it.
                let _ = stopped.write(1);
            })?;
            threads.push(t);
        }
        let running = RunningVm {
            _kvm: self.kvm,
            vm: self.vm,
            ram: self.ram,
            control,
            threads,
            outcomes: Mutex::new(rx),
            stopped,
            serial: self.serial,
            virtio: self.virtio,
            started: Instant::now(),
            vmgenid: self.vmgenid,
            stats: self.stats,
        };
        Ok((running, loops))
    }

    /// Run until the guest stops or a vCPU fails.
    pub fn run(self) -> Result<GuestExit> {
        self.start()?.wait()
    }
}

/// Install the signal handlers running VMs use (once per process; [`Vm::start`] calls it): a
/// VMM that will forbid itself `rt_sigaction` calls it first.
pub fn install_signal_handlers() -> Result<()> {
    install_kick_handler()?;
    // Diagnostics only: a VM without the handler still runs (SIGUSR1 would then kill it).
    if let Err(e) = crate::diagnostics::install_state_dump_signal() {
        tracing::warn!("cannot install the SIGUSR1 state-dump handler: {e}");
    }
    Ok(())
}

/// Say once per process that KVM refused an ioeventfd (every later VM would say the same).
fn warn_ioeventfd_unavailable(base: u64, queue: usize, err: &str) {
    static WARNED: AtomicBool = AtomicBool::new(false);
    if !WARNED.swap(true, Ordering::Relaxed) {
        tracing::warn!(
            "no ioeventfd for virtio queue {queue} at {base:#x} ({err}): virtio queue \
             notifications exit to the VMM instead (slower, same behaviour)"
        );
    } else {
        tracing::debug!(base, queue, "no ioeventfd: {err}");
    }
}

/// What a branch of a running VM holds of its memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SnapshotKind {
    /// A complete image (the chain flattened, plus the pages written since restore).
    Full,
    /// Only the pages written since restore, over the snapshot the VM was restored from.
    Diff,
}

/// A branch written: its header, how long the VM was paused, and the pages it wrote since
/// restore.
#[derive(Clone, Debug)]
pub struct Branched {
    pub header: SnapshotHeader,
    pub paused: std::time::Duration,
    pub pages_written: u64,
}

/// What [`RunningVm::rebase`] did.
#[derive(Clone, Copy, Debug)]
pub struct Rebase {
    pub paused: std::time::Duration,
    pub counts: crate::memory::Rebased,
}

/// A VM whose vCPUs are running (or paused).
pub struct RunningVm {
    _kvm: Kvm,
    vm: VmFd,
    ram: GuestRam,
    control: Arc<VcpuControl>,
    threads: Vec<JoinHandle<()>>,
    /// Locked by whoever waits for the guest to stop (the VM stays usable from other threads,
    /// e.g. to branch it, meanwhile).
    outcomes: Mutex<mpsc::Receiver<(usize, Result<VcpuOutcome>)>>,
    /// Written by each vCPU thread once its outcome is sent (see [`RunningVm::stopped_fd`]).
    stopped: Arc<EventFd>,
    serial: Arc<Mutex<SerialConsole>>,
    virtio: Vec<Arc<Mutex<VirtioMmio>>>,
    started: Instant,
    /// Holds the generation ID's interrupt line open.
    vmgenid: Option<VmGenId>,
    stats: Option<VmStats>,
}

impl RunningVm {
    /// KVM's counters for this VM so far: its vCPUs' summed (exits by reason, page faults,
    /// halts), and the VM's own under `vm.`. None where the host kernel has none (before
    /// 5.14) or they cannot be read.
    pub fn kvm_counters(&self) -> Option<Counters> {
        let stats = self.stats.as_ref()?;
        stats
            .read()
            .map_err(|e| tracing::warn!("reading KVM counters: {e}"))
            .ok()
    }

    fn kick(&self) {
        for t in &self.threads {
            // SAFETY: the thread is not joined yet, so its pthread_t is valid; if it already
            // returned, the signal is harmlessly ignored.
            unsafe { libc::pthread_kill(t.as_pthread_t(), kick_signal()) };
        }
    }

    fn set_devices_paused(&self, paused: bool) {
        for t in &self.virtio {
            t.lock().unwrap().set_paused(paused);
        }
    }

    pub fn ram(&self) -> &GuestRam {
        &self.ram
    }

    /// Stop the guest at one instant: vCPUs parked out of KVM_RUN, devices quiet.
    pub fn pause(&self) -> Result<()> {
        if !self.control.request(Want::Pause { save: false }) {
            return Err(VcpuError::Stopping.into());
        }
        self.kick();
        self.control.wait_parked()?;
        self.set_devices_paused(true);
        Ok(())
    }

    pub fn resume(&self) {
        self.set_devices_paused(false);
        self.control.request(Want::Run);
    }

    /// Give back the guest RAM pages this VMM holds privately but unchanged from the snapshot
    /// (see [`crate::give_back`]). The pages are found and compared once while the guest runs;
    /// only those equal then are compared again, and given back, with the guest paused, in
    /// steps of at most [`crate::give_back::STEP_PAGES`] with the guest running in between.
    /// None: this VM's RAM is not mapped over a sole snapshot image (booted, page-by-page, or
    /// with diff layers), and nothing was paused. Like a branch or a rebase, it must not run
    /// while another of them pauses this VM (the VMM's owner serializes them).
    pub fn give_back_unchanged(&self) -> Result<Option<crate::give_back::GivenBack>> {
        use crate::give_back::{Scan, STEP_PAGES};
        let (private_pages, equal) = match crate::give_back::scan(&self.ram)? {
            Scan::NotSole => return Ok(None),
            Scan::Candidates {
                private_pages,
                equal,
            } => (private_pages, equal),
            Scan::TooMany { private_pages } => (private_pages, Vec::new()),
        };
        let mut found = crate::give_back::GivenBack {
            private_pages,
            candidates: diff::page_count(&equal),
            ..Default::default()
        };
        for step in diff::page_steps(&equal, STEP_PAGES) {
            let runs: Vec<diff::PageRun> = step.into_iter().map(|(r, _)| r).collect();
            let t0 = Instant::now();
            let given = self
                .pause()
                .and_then(|()| crate::give_back::give_back_unchanged(&self.ram, &runs));
            self.resume();
            found.paused = found.paused.max(t0.elapsed());
            found.pauses += 1;
            found.given_back += given?;
        }
        Ok(Some(found))
    }

    /// Pause, save the whole machine into `dir` (atomically), and leave the VM paused.
    pub fn snapshot(&self, dir: &Path) -> Result<SnapshotHeader> {
        let t0 = Instant::now();
        let state = self.pause_and_save(dir)?;
        let paused_at = t0.elapsed();
        let header = match self.ram.file() {
            Some(file) if self.ram.origin().is_none() => {
                snapfile::write(dir, &state, MemoryOut::Image(file))?
            }
            _ => self.write_from_private_ram(dir, &state, None)?.0,
        };
        tracing::info!(pause = ?paused_at, total = ?t0.elapsed(), dir = %dir.display(), "snapshot written");
        Ok(header)
    }

    /// Snapshot a running VM restored from a snapshot into `dir` and let it run on: a diff
    /// over the snapshot it was restored from (only the pages written since), or a complete
    /// image. Memory and vCPU and device state are taken inside one pause, so they describe
    /// the same instant; the VM resumes once the files are written (also on failure).
    pub fn branch(&self, dir: &Path, kind: SnapshotKind) -> Result<Branched> {
        let base = match kind {
            SnapshotKind::Diff => Some(self.diff_base(dir)?),
            SnapshotKind::Full => None,
        };
        let t0 = Instant::now();
        let written = (|| {
            let state = self.pause_and_save(dir)?;
            self.write_from_private_ram(dir, &state, base)
        })();
        self.resume();
        let paused = t0.elapsed();
        let (header, pages) = written?;
        tracing::info!(?paused, ?kind, pages, dir = %dir.display(), "branch written");
        Ok(Branched {
            header,
            paused,
            pages_written: pages,
        })
    }

    /// [`branch`](Self::branch) with the sandbox paused only to save its vCPU and device
    /// state and fork this process: the fork's memory is the guest's at that instant
    /// (copy-on-write: a page the guest writes afterwards is copied for it, the fork keeps the
    /// old one), and the fork writes the pages while the guest runs on. Returns once they are
    /// on disk; `paused` is the pause alone.
    pub fn branch_live(&self, dir: &Path, kind: SnapshotKind) -> Result<Branched> {
        self.branch_live_then(dir, kind, |_, _| {})
    }

    /// [`branch_live`](Self::branch_live), calling `resumed` with the pause and the name of
    /// the diff's parent (None for a complete image) as soon as the guest runs again (while
    /// the fork is still writing).
    pub fn branch_live_then(
        &self,
        dir: &Path,
        kind: SnapshotKind,
        resumed: impl FnOnce(Duration, Option<&str>),
    ) -> Result<Branched> {
        if self.ram.origin().is_none() {
            // Booted RAM is a shared mapping: a fork would see the guest's later writes.
            return Err(SnapshotError::NoParent {
                dir: dir.to_path_buf(),
            }
            .into());
        }
        let base = match kind {
            SnapshotKind::Diff => {
                let (origin, since) = self.diff_base(dir)?;
                Some((snapfile::parent_link(dir, &origin)?, origin, since))
            }
            SnapshotKind::Full => None,
        };
        let t0 = Instant::now();
        let mut paused = None;
        let mut pages = 0;
        let written = (|| {
            let state = self.pause_and_save(dir)?;
            snapfile::write_with(dir, &state, |tmp| {
                let since = base.as_ref().map_or(&[][..], |b| &b.2[..]);
                let parent = base.as_ref().map(|b| b.0.as_str());
                let copied = live_copy::fork_and_copy(&self.ram, kind, since, tmp, || {
                    self.resume();
                    let p = t0.elapsed();
                    paused = Some(p);
                    resumed(p, parent);
                });
                let copied = copied.map_err(|source| SnapshotError::LiveCopy {
                    dir: dir.to_path_buf(),
                    source,
                })?;
                pages = copied;
                match base {
                    Some((name, origin, _)) => {
                        Ok(Some(snapfile::diff_info_written(tmp, name, &origin)?))
                    }
                    None => Ok(None),
                }
            })
        })();
        self.resume();
        let header = written?;
        let paused = paused.unwrap_or_else(|| t0.elapsed());
        tracing::info!(?paused, total = ?t0.elapsed(), ?kind, pages, dir = %dir.display(), "live branch written");
        Ok(Branched {
            header,
            paused,
            pages_written: pages,
        })
    }

    /// Take the diff branch in `dir` (written from this VM, over the snapshot it is currently
    /// a diff over) as what it is a diff over from now on, so the next branch holds only what
    /// changed since this one (repeated branches stay flat in cost). Pauses the guest while
    /// its pages are compared with the branch's and those unchanged are mapped from the
    /// branch's page file. Refused, changing nothing, for a branch over another snapshot.
    pub fn rebase(&self, dir: &Path) -> Result<Rebase> {
        let not = |reason: String| SnapshotError::Rebase {
            dir: dir.to_path_buf(),
            reason,
        };
        let header = snapfile::load_header(dir)?;
        let Some(d) = header.diff.clone() else {
            return Err(not("it is a complete snapshot, not a diff".into()).into());
        };
        if self.ram.origin().is_none() {
            return Err(not("this VM was not restored from a snapshot".into()).into());
        }
        let layer = snapfile::diff_pages(dir, &header)?.ok_or_else(|| not("no pages".into()))?;
        // Its parent must be one this VM's memory is a diff over, and it must hold every page
        // mapped since that one (else it was taken before a later branch was mapped).
        let is_parent = |o: &Origin| {
            o.state_sha256 == d.parent_state_sha256
                && snapfile::parent_link(dir, o).is_ok_and(|name| name == d.parent)
        };
        match self.ram.holds_all_since(is_parent, &layer.runs) {
            Some(true) => {}
            Some(false) => {
                return Err(not(format!(
                    "it is a diff over {} taken before this VM's latest branch (it lacks pages mapped since)",
                    d.parent
                ))
                .into())
            }
            None => {
                return Err(not(format!(
                    "it is a diff over {}, which this VM's memory is not a diff over",
                    d.parent
                ))
                .into())
            }
        }
        // A restore of the next branch maps one more layer: stay within what restores accept.
        if self.ram.depth() + 2 >= diff::MAX_CHAIN {
            return Err(not(format!(
                "its chain is {} layers deep already",
                self.ram.depth() + 1
            ))
            .into());
        }
        // Each stretch of unchanged pages becomes a mapping of its own: stay well inside the
        // kernel's limit on mappings per process.
        if let Some((now, max)) = mapping_counts() {
            let worst = 2 * layer.runs.len() + 1;
            if now + worst + 1024 > max {
                return Err(not(format!(
                    "{now} mappings already, up to {worst} more would near vm.max_map_count ({max})"
                ))
                .into());
            }
        }
        let to = Origin {
            dir: dir.to_path_buf(),
            state_sha256: header.state_sha256.clone(),
        };
        // Read in before pausing, so the pauses only compare and map.
        let view = crate::memory::LayerView::open(&layer)?;
        let mut counts = crate::memory::Rebased::default();
        let (mut paused, mut total) = (Duration::ZERO, Duration::ZERO);
        let mut done = Ok(());
        // In steps of at most REBASE_STEP_PAGES, the guest running in between: however
        // large the branch, no single pause grows past one step's compare and map.
        for step in rebase_steps(&layer.runs) {
            let t0 = Instant::now();
            // Devices too: the VMM's own writes (virtio rings) must not land mid-comparison.
            done = self
                .pause()
                .and_then(|()| self.ram.rebase_step(&layer, &view, &step, &mut counts));
            self.resume();
            paused = paused.max(t0.elapsed());
            total += t0.elapsed();
            if done.is_err() {
                break;
            }
        }
        drop(view);
        self.ram.finish_rebase(layer, to, done.is_ok());
        done?;
        tracing::info!(?paused, ?total, mapped = counts.pages_mapped, kept = counts.pages_kept, dir = %dir.display(), "rebased onto a branch");
        Ok(Rebase { paused, counts })
    }

    /// The snapshot a diff of this VM is taken over now, and the pages it must hold besides
    /// the private ones (those of layers mapped since that snapshot). A base deleted or
    /// replaced since is passed over for an older one.
    fn diff_base(&self, dir: &Path) -> Result<(Origin, Vec<diff::PageRun>)> {
        if self.ram.origin().is_none() {
            return Err(SnapshotError::NoParent {
                dir: dir.to_path_buf(),
            }
            .into());
        }
        let unchanged = |o: &Origin| {
            snapfile::load_header(&o.dir).is_ok_and(|h| h.state_sha256 == o.state_sha256)
        };
        Ok(self
            .ram
            .diff_base(unchanged)
            .ok_or_else(|| SnapshotError::BaseGone {
                dir: dir.to_path_buf(),
            })?)
    }

    /// Write guest RAM into `dir`: a diff over `base` (the snapshot and the pages mapped since
    /// it), or with None a complete image.
    fn write_from_private_ram(
        &self,
        dir: &Path,
        state: &MachineState,
        base: Option<(Origin, Vec<diff::PageRun>)>,
    ) -> Result<(SnapshotHeader, u64)> {
        if self.ram.file().is_none() {
            return Err(SnapshotError::NoMemoryFile {
                dir: dir.to_path_buf(),
            }
            .into());
        }
        if self.ram.origin().is_none() {
            return Err(SnapshotError::NoParent {
                dir: dir.to_path_buf(),
            }
            .into());
        }
        let private = diff::private_runs(&self.ram).map_err(|source| SnapshotError::Pagemap {
            dir: dir.to_path_buf(),
            source,
        })?;
        Ok(match &base {
            None => {
                let memory = MemoryOut::Flatten {
                    ram: &self.ram,
                    written: &private,
                };
                // Written since the restore: private, or mapped from a branch since.
                let since = diff::union(&private, &self.ram.since_restore());
                (
                    snapfile::write(dir, state, memory)?,
                    diff::page_count(&since),
                )
            }
            Some((origin, since)) => {
                let written = diff::union(&private, since);
                let memory = MemoryOut::Diff {
                    ram: &self.ram,
                    written: &written,
                    parent: origin,
                };
                (
                    snapfile::write(dir, state, memory)?,
                    diff::page_count(&written),
                )
            }
        })
    }

    /// Park the vCPUs (saving their state) and quiet the devices; the VM stays paused.
    fn pause_and_save(&self, dir: &Path) -> Result<MachineState> {
        if !self.control.request(Want::Pause { save: true }) {
            return Err(VcpuError::Stopping.into());
        }
        self.kick();
        let saved = self.control.wait_parked_and_saved()?;
        self.set_devices_paused(true);
        let mut vcpus = Vec::with_capacity(saved.len());
        for (index, s) in saved.into_iter().enumerate() {
            let s = s.ok_or_else(|| SnapshotError::VcpuNotSaved {
                dir: dir.to_path_buf(),
                index,
            })?;
            vcpus.push(s?);
        }
        Ok(MachineState {
            vcpus,
            vm: snapshot::save_vm(&self.vm)?,
            serial: self.serial.lock().unwrap().snapshot(),
            virtio: self
                .virtio
                .iter()
                .map(|t| t.lock().unwrap().save())
                .collect(),
            mem_size: self.ram.size(),
            vmgenid: self.vmgenid.as_ref().map(VmGenId::driver),
        })
    }

    /// Wait until the guest stops on its own (or a vCPU fails), then stop every vCPU.
    pub fn wait(self) -> Result<GuestExit> {
        let result = self.wait_exit();
        self.finish();
        result
    }

    /// Readable (for `poll`) from the moment a vCPU has stopped: [`wait_exit`](Self::wait_exit)
    /// then returns without waiting on a running guest. For a thread that waits on other
    /// things too, instead of a thread of its own to block in `wait_exit`. Never read it.
    pub fn stopped_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        use std::os::fd::{AsRawFd, BorrowedFd};
        // SAFETY: the eventfd lives as long as self.
        unsafe { BorrowedFd::borrow_raw(self.stopped.as_raw_fd()) }
    }

    /// [`wait`](Self::wait) through a shared reference: returns once every vCPU has stopped
    /// (their threads are joined when the VM is dropped or finished).
    pub fn wait_exit(&self) -> Result<GuestExit> {
        let outcomes = self.outcomes.lock().unwrap_or_else(|p| p.into_inner());
        let mut result: Option<Result<GuestExit>> = None;
        let mut remaining = self.threads.len();
        while remaining > 0 {
            let Ok((index, outcome)) = outcomes.recv() else {
                break;
            };
            remaining -= 1;
            if result.is_none() {
                match outcome {
                    Ok(VcpuOutcome::Guest(exit)) => {
                        tracing::info!(vcpu = index, ?exit, elapsed = ?self.started.elapsed(), "guest stopped");
                        result = Some(Ok(exit));
                    }
                    Ok(VcpuOutcome::Stopped) => continue,
                    Err(e) => result = Some(Err(e)),
                }
                self.control.request(Want::Stop);
                self.kick();
            }
        }
        let _ = self.serial.lock().map(|mut s| s.flush());
        result.unwrap_or_else(|| Err(VcpuError::NoOutcome.into()))
    }

    /// Stop the VM now (the guest does not get a say).
    pub fn stop(self) {
        self.control.request(Want::Stop);
        self.kick();
        {
            let outcomes = self.outcomes.lock().unwrap_or_else(|p| p.into_inner());
            while outcomes.recv().is_ok() {}
        }
        self.finish();
    }

    fn finish(self) {
        for t in self.threads {
            let _ = t.join();
        }
        let _ = self.serial.lock().map(|mut s| s.flush());
    }
}

/// This process's memory mappings and the most it may have (vm.max_map_count); None when
/// either cannot be read.
fn mapping_counts() -> Option<(usize, usize)> {
    let maps = std::fs::read("/proc/self/maps").ok()?;
    let now = maps.iter().filter(|b| **b == b'\n').count();
    Some((now, max_map_count()?))
}

/// vm.max_map_count, read once per process.
fn max_map_count() -> Option<usize> {
    static MAX: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    *MAX.get_or_init(|| {
        std::fs::read_to_string("/proc/sys/vm/max_map_count")
            .ok()?
            .trim()
            .parse()
            .ok()
    })
}

/// Read now what a VMM needs of the host's /proc beyond its own process (the host identity
/// snapshots carry, vm.max_map_count): a VMM about to confine itself to a view whose /proc
/// shows only its own process calls this first.
pub fn read_host_facts() {
    let _ = crate::snapshot::host_id::HostIdentity::current();
    let _ = max_map_count();
}

/// Most pages a rebase compares and maps in one pause (8 MiB).
const REBASE_STEP_PAGES: u64 = 2048;

/// `runs` (packed in this order in their page file) cut into steps of at most
/// [`REBASE_STEP_PAGES`], each piece with its offset in the page file.
fn rebase_steps(runs: &[diff::PageRun]) -> Vec<Vec<(diff::PageRun, u64)>> {
    diff::page_steps(runs, REBASE_STEP_PAGES)
}

#[cfg(test)]
mod tests {
    #[test]
    fn rebase_steps_cut_runs_and_keep_file_offsets() {
        use super::{rebase_steps, REBASE_STEP_PAGES as N};
        use crate::snapshot::diff::PageRun;
        let r = |first, count| PageRun { first, count };
        let steps = rebase_steps(&[r(0, 3), r(10, 2 * N), r(100_000, 1)]);
        assert_eq!(steps.len(), 3);
        assert_eq!(steps[0], vec![(r(0, 3), 0), (r(10, N - 3), 3 * 4096)]);
        assert_eq!(steps[1], vec![(r(10 + N - 3, N), N * 4096)]);
        assert_eq!(
            steps[2],
            vec![
                (r(10 + 2 * N - 3, 3), 2 * N * 4096),
                (r(100_000, 1), (2 * N + 3) * 4096)
            ]
        );
        assert!(rebase_steps(&[]).is_empty());
    }

    use super::*;

    #[test]
    fn vcpu_counts_outside_the_madt_range_are_refused_with_the_count() {
        assert_eq!(validate_vcpus(1).unwrap(), 1);
        assert_eq!(validate_vcpus(MAX_VCPUS.into()).unwrap(), MAX_VCPUS);
        // 300 must not wrap to 44 on its way to a u8 (a snapshot header can say anything).
        for n in [0, 255, 300] {
            let err = validate_vcpus(n).unwrap_err();
            assert!(
                matches!(err, Error::Config(ConfigError::VcpuCount { requested, max: MAX_VCPUS })
                    if requested == n),
                "{err:?}"
            );
            assert!(
                err.to_string()
                    .contains(&format!("{n} vCPUs requested: use 1..=254")),
                "{err}"
            );
        }
    }
}
