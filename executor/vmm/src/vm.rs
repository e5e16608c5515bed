//! A VM: KVM VM + irqchip + PIT, guest RAM, devices and vCPUs; boot it and run it to its end.

use std::io::Write;
use std::os::unix::thread::JoinHandleExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Instant;

use kvm_bindings::{kvm_pit_config, kvm_userspace_memory_region, CpuId, KVM_PIT_SPEAKER_DUMMY};
use kvm_ioctls::{Kvm, VcpuFd, VmFd};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::acpi::{self, AcpiConfig, VirtioMmioSlot};
use crate::devices::mmio::MmioBus;
use crate::devices::virtio::mmio::VirtioMmio;
use crate::devices::virtio::vsock::Vsock;
use crate::devices::virtio::{IrqLine, VirtioDevice};
use crate::boot::{self, EntryPoint};
use crate::devices::bus::PioBus;
use crate::devices::power::{AcpiPm, I8042};
use crate::devices::serial::SerialConsole;
use crate::devices::GuestExit;
use crate::error::{Error, Result};
use crate::layout::*;
use crate::memory::GuestRam;
use crate::vcpu::{install_kick_handler, kick_signal, VcpuOutcome, VcpuRunner};
use crate::{cpuid, host, regs};

/// Most vCPUs we configure: MADT local-APIC ids are one byte and 255 is broadcast.
pub const MAX_VCPUS: u8 = 254;

/// Default kernel command line: serial console, no PCI probing, reboot via the i8042 line,
/// and no legacy devices we do not emulate.
pub const DEFAULT_CMDLINE: &str =
    "console=ttyS0 reboot=k panic=-1 pci=off nomodeset i8042.noaux i8042.nomux i8042.dumbkbd tsc=reliable";

/// A Linux boot: kernel image, optional initramfs and command line.
#[derive(Clone, Debug)]
pub struct LinuxBoot {
    pub kernel: PathBuf,
    pub initrd: Option<PathBuf>,
    pub cmdline: String,
}

pub struct Vm {
    // Kept alive: the VM and vCPU fds reference it.
    _kvm: Kvm,
    vm: VmFd,
    ram: GuestRam,
    vcpus: Vec<VcpuFd>,
    pio: PioBus,
    mmio: MmioBus,
    virtio_slots: Vec<VirtioMmioSlot>,
    serial: Arc<Mutex<SerialConsole>>,
}

fn validate_vcpus(n: u8) -> Result<()> {
    if n == 0 || n > MAX_VCPUS {
        return Err(Error::Config(format!(
            "{n} vCPUs requested: use 1..={MAX_VCPUS}"
        )));
    }
    Ok(())
}

impl Vm {
    /// Create the VM with `vcpus` vCPUs over `ram`, console output to `console`.
    pub fn create(vcpus: u8, ram: GuestRam, console: Box<dyn Write + Send>) -> Result<Self> {
        validate_vcpus(vcpus)?;
        let kvm = host::open_kvm()?;
        let max = kvm.get_max_vcpus();
        if vcpus as usize > max {
            return Err(Error::Config(format!(
                "{vcpus} vCPUs requested but this host's KVM allows {max}"
            )));
        }
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
        let serial = Arc::new(Mutex::new(SerialConsole::new(serial_irq, console)));
        let mut bus = PioBus::default();
        bus.insert(COM1_PORT, 8, serial.clone())
            .map_err(Error::Config)?;
        bus.insert(I8042_CMD_PORT, 1, Arc::new(Mutex::new(I8042)))
            .map_err(Error::Config)?;
        bus.insert(ACPI_PM_PORT, 3, Arc::new(Mutex::new(AcpiPm)))
            .map_err(Error::Config)?;

        let base_cpuid: CpuId = cpuid::supported(&kvm)?;
        let tsc_deadline = kvm.check_extension(kvm_ioctls::Cap::TscDeadlineTimer);
        let mut fds = Vec::with_capacity(vcpus as usize);
        for i in 0..vcpus {
            let fd = vm
                .create_vcpu(i as u64)
                .map_err(Error::kvm("KVM_CREATE_VCPU"))?;
            let c = cpuid::for_vcpu(&base_cpuid, i as u32, vcpus as u32, tsc_deadline);
            fd.set_cpuid2(&c).map_err(|e| Error::Vcpu {
                index: i as usize,
                reason: format!("KVM_SET_CPUID2: {e}"),
            })?;
            regs::setup_common(&fd, i as usize)?;
            fds.push(fd);
        }

        Ok(Self {
            _kvm: kvm,
            vm,
            ram,
            vcpus: fds,
            pio: bus,
            mmio: MmioBus::default(),
            virtio_slots: Vec::new(),
            serial,
        })
    }

    pub fn ram(&self) -> &GuestRam {
        &self.ram
    }

    pub fn vm_fd(&self) -> &VmFd {
        &self.vm
    }

    pub fn serial(&self) -> &Arc<Mutex<SerialConsole>> {
        &self.serial
    }

    /// Attach a virtio device in the next free MMIO window, announced to the guest in the DSDT.
    pub fn add_virtio(&mut self, device: Box<dyn VirtioDevice>) -> Result<VirtioMmioSlot> {
        let index = self.virtio_slots.len() as u64;
        let slot = VirtioMmioSlot {
            base: VIRTIO_MMIO_BASE + index * VIRTIO_MMIO_SIZE,
            size: VIRTIO_MMIO_SIZE,
            irq: VIRTIO_FIRST_IRQ + index as u32,
        };
        let evt = EventFd::new(EFD_NONBLOCK)?;
        self.vm
            .register_irqfd(&evt, slot.irq)
            .map_err(Error::kvm("KVM_IRQFD"))?;
        let transport = VirtioMmio::new(device, self.ram.memory().clone(), IrqLine::new(evt));
        self.mmio
            .insert(slot.base, slot.size, Arc::new(Mutex::new(transport)))
            .map_err(Error::Config)?;
        self.virtio_slots.push(slot);
        Ok(slot)
    }

    /// Attach a virtio-vsock device with guest CID `cid`, host side on the Unix socket `uds`.
    pub fn add_vsock(&mut self, cid: u64, uds: &std::path::Path) -> Result<VirtioMmioSlot> {
        let dev = Vsock::new(cid, uds).map_err(|e| {
            Error::Config(format!("vsock socket {}: {e}", uds.display()))
        })?;
        self.add_virtio(Box::new(dev))
    }

    /// Load a Linux kernel and point the boot vCPU at its entry.
    pub fn load_linux(&mut self, boot: &LinuxBoot) -> Result<EntryPoint> {
        let acpi_cfg = AcpiConfig {
            vcpus: self.vcpus.len() as u8,
            virtio: self.virtio_slots.clone(),
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

    /// Run every vCPU on its own thread until the guest stops or a vCPU fails.
    pub fn run(self) -> Result<GuestExit> {
        install_kick_handler()?;
        let stop = Arc::new(AtomicBool::new(false));
        let pio = Arc::new(self.pio);
        let mmio = Arc::new(self.mmio);
        let (tx, rx) = mpsc::channel::<(usize, Result<VcpuOutcome>)>();
        let mut threads = Vec::new();
        for (index, fd) in self.vcpus.into_iter().enumerate() {
            let runner = VcpuRunner {
                index,
                fd,
                pio: pio.clone(),
                mmio: mmio.clone(),
                stop: stop.clone(),
            };
            let tx = tx.clone();
            let t = std::thread::Builder::new()
                .name(format!("vcpu{index}"))
                .spawn(move || {
                    let r = runner.run();
                    let _ = tx.send((index, r));
                })?;
            threads.push(t);
        }
        drop(tx);

        let started = Instant::now();
        let mut result: Option<Result<GuestExit>> = None;
        let mut remaining = threads.len();
        while remaining > 0 {
            let Ok((index, outcome)) = rx.recv() else {
                break;
            };
            remaining -= 1;
            if result.is_none() {
                match outcome {
                    Ok(VcpuOutcome::Guest(exit)) => {
                        tracing::info!(vcpu = index, ?exit, elapsed = ?started.elapsed(), "guest stopped");
                        result = Some(Ok(exit));
                    }
                    Ok(VcpuOutcome::Stopped) => continue,
                    Err(e) => result = Some(Err(e)),
                }
                stop.store(true, Ordering::Release);
                for t in &threads {
                    // SAFETY: the thread is joinable (not yet joined), so its pthread_t is valid.
                    unsafe { libc::pthread_kill(t.as_pthread_t(), kick_signal()) };
                }
            }
        }
        for t in threads {
            let _ = t.join();
        }
        let _ = self.serial.lock().map(|mut s| s.flush());
        result.unwrap_or_else(|| Err(Error::Config("no vCPU reported an outcome".into())))
    }
}
