//! Guest physical memory map shared by the boot code, the ACPI tables and the devices.
//!
//! Everything below 1 MiB is firmware-style scratch space that Linux reads once at boot;
//! the kernel itself goes above 1 MiB (bzImage) or at its ELF physical address (vmlinux).

/// GDT for the boot vCPU state (4 entries).
pub const BOOT_GDT: u64 = 0x500;
/// Empty IDT: the kernel installs its own before enabling interrupts.
pub const BOOT_IDT: u64 = 0x520;
/// PVH `hvm_start_info`, followed by its memory map.
pub const PVH_START_INFO: u64 = 0x6000;
pub const PVH_MEMMAP: u64 = 0x6040;
pub const PVH_MODLIST: u64 = 0x6800;
/// Linux "zero page" (`struct boot_params`) for the 64-bit boot protocol.
pub const ZERO_PAGE: u64 = 0x7000;
/// Initial stack top for the boot vCPU.
pub const BOOT_STACK: u64 = 0x8ff0;
/// Identity page tables: PML4, one PDPT and four page directories mapping 4 GiB with 2 MiB pages.
pub const PML4: u64 = 0x9000;
pub const PDPT: u64 = 0xa000;
pub const PD: u64 = 0xb000;
pub const PD_COUNT: u64 = 4;
/// Kernel command line.
pub const CMDLINE: u64 = 0x20000;
/// x86 Linux copies at most this many bytes (COMMAND_LINE_SIZE).
pub const CMDLINE_MAX: usize = 2048;
/// End of conventional low memory; the EBDA-sized hole above it stays reserved.
pub const LOW_RAM_END: u64 = 0x9fc00;
/// ACPI tables live in the BIOS area, where Linux also scans for the RSDP.
pub const ACPI_START: u64 = 0xe0000;
pub const ACPI_END: u64 = 0x100000;
/// The VM generation ID's 16 bytes, on the last page of the (e820-reserved) ACPI area; the
/// tables end below it.
pub const VMGENID_ADDR: u64 = ACPI_END - 0x1000;
pub const ACPI_TABLES_END: u64 = VMGENID_ADDR;
/// First byte above the legacy area.
pub const HIMEM_START: u64 = 0x100000;
/// bzImage protected-mode code goes here (its default `code32_start`).
pub const BZIMAGE_LOAD: u64 = 0x100000;
/// RAM above this address is moved above 4 GiB, leaving room for MMIO (IOAPIC, LAPIC, virtio).
pub const MMIO_GAP_START: u64 = 0xc000_0000;
pub const MMIO_GAP_END: u64 = 0x1_0000_0000;
/// Where virtio-mmio windows are placed (one page each).
pub const VIRTIO_MMIO_BASE: u64 = 0xd000_0000;
pub const VIRTIO_MMIO_SIZE: u64 = 0x1000;
/// GSIs for virtio devices, one each, after the ISA range our legacy devices use.
pub const VIRTIO_FIRST_IRQ: u32 = 5;
pub const IOAPIC_ADDR: u64 = 0xfec0_0000;
pub const LAPIC_ADDR: u64 = 0xfee0_0000;
/// KVM needs three pages for the TSS and one for the identity map (VMX real-mode emulation).
pub const KVM_TSS_ADDR: u64 = 0xfffb_d000;
pub const KVM_IDENTITY_MAP_ADDR: u64 = 0xfffb_c000;

/// I/O ports.
pub const COM1_PORT: u16 = 0x3f8;
pub const COM1_IRQ: u32 = 4;
/// The ACPI Generic Event Device's interrupt (the IOAPIC's last pin, clear of the virtio
/// devices counting up from VIRTIO_FIRST_IRQ): raised after a restore for the VM generation ID.
pub const GED_IRQ: u32 = 23;
/// i8042 command port: Linux writes 0xfe here to reset the machine (`reboot=k`).
pub const I8042_CMD_PORT: u16 = 0x64;
/// Our ACPI power-management block (hardware-reduced ACPI sleep and reset registers).
pub const ACPI_PM_PORT: u16 = 0x600;
pub const ACPI_SLEEP_CONTROL_PORT: u16 = ACPI_PM_PORT;
pub const ACPI_SLEEP_STATUS_PORT: u16 = ACPI_PM_PORT + 1;
pub const ACPI_RESET_PORT: u16 = ACPI_PM_PORT + 2;
pub const ACPI_RESET_VALUE: u8 = 0x01;
/// Written by the generation ID's `ADDR` method, i.e. when a guest driver binds to it
/// (devices::vmgenid::Watch).
pub const VMGENID_WATCH_PORT: u16 = 0x610;
/// SLP_TYP value we advertise for S5 in the DSDT `_S5_` package.
pub const ACPI_S5_SLEEP_TYPE: u8 = 5;
