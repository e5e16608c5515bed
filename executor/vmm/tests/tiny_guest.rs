//! Hand-made guests run on /dev/kvm directly: a few instructions that talk to our devices and
//! stop the VM, in each CPU mode the Linux entry protocols use. They exercise VM creation,
//! memory slots, the boot register state, port-I/O routing, the serial console, ACPI power-off,
//! i8042 reset and the vCPU kick that stops the other vCPUs.

mod common;

use common::{kvm_available, out8, Capture, POWER_OFF};

use tine_vmm::boot::EntryPoint;
use tine_vmm::{GuestExit, GuestRam, Vm};
use vm_memory::{Bytes, GuestAddress};

const CODE_ADDR: u64 = 0x10_0000;

fn print(code: &mut Vec<u8>, text: &str) {
    for b in text.bytes() {
        out8(code, 0x3f8, b);
    }
}

const I8042_RESET: (u16, u8) = (0x64, 0xfe);

/// A VM of `vcpus` about to run `code` from `entry`, and its console.
fn new_guest(vcpus: u8, entry: EntryPoint, code: &[u8]) -> (Vm, Capture) {
    let ram = GuestRam::new_memfd(64).unwrap();
    ram.memory()
        .write_slice(code, GuestAddress(CODE_ADDR))
        .unwrap();
    let out = Capture::default();
    let mut vm = Vm::create(vcpus, ram, Box::new(out.clone())).unwrap();
    vm.set_entry(entry).unwrap();
    (vm, out)
}

fn run_guest(vcpus: u8, entry: EntryPoint, code: &[u8]) -> (GuestExit, String) {
    let (vm, out) = new_guest(vcpus, entry, code);
    let exit = vm.run().unwrap();
    let text = String::from_utf8(out.0.lock().unwrap().clone()).unwrap();
    (exit, text)
}

#[test]
fn long_mode_guest_prints_and_powers_off() {
    if !kvm_available() {
        return;
    }
    let mut code = Vec::new();
    print(&mut code, "hello from long mode\n");
    out8(&mut code, POWER_OFF.0, POWER_OFF.1);
    code.push(0xf4); // hlt: never reached
    let (exit, text) = run_guest(1, EntryPoint::Linux64 { rip: CODE_ADDR }, &code);
    assert_eq!(exit, GuestExit::PowerOff);
    assert_eq!(exit.exit_code(), 0);
    assert_eq!(text, "hello from long mode\n");
}

#[test]
fn protected_mode_guest_prints_and_powers_off() {
    if !kvm_available() {
        return;
    }
    let mut code = Vec::new();
    print(&mut code, "pvh\n");
    out8(&mut code, POWER_OFF.0, POWER_OFF.1);
    let (exit, text) = run_guest(1, EntryPoint::Pvh { rip: CODE_ADDR }, &code);
    assert_eq!(exit, GuestExit::PowerOff);
    assert_eq!(text, "pvh\n");
}

#[test]
fn i8042_reset_is_a_reboot() {
    if !kvm_available() {
        return;
    }
    let mut code = Vec::new();
    out8(&mut code, I8042_RESET.0, I8042_RESET.1);
    let (exit, _) = run_guest(1, EntryPoint::Linux64 { rip: CODE_ADDR }, &code);
    assert_eq!(exit, GuestExit::Reboot);
    assert_ne!(exit.exit_code(), 0);
}

#[test]
fn power_off_stops_the_other_vcpus() {
    if !kvm_available() {
        return;
    }
    // vCPU 1 never gets a startup IPI: it waits inside KVM_RUN until the VMM kicks it.
    let mut code = Vec::new();
    print(&mut code, "bye\n");
    out8(&mut code, POWER_OFF.0, POWER_OFF.1);
    let (exit, text) = run_guest(4, EntryPoint::Linux64 { rip: CODE_ADDR }, &code);
    assert_eq!(exit, GuestExit::PowerOff);
    assert_eq!(text, "bye\n");
}

#[test]
fn bad_vcpu_counts_are_refused() {
    let ram = GuestRam::new_memfd(64).unwrap();
    let err = Vm::create(0, ram, Box::new(std::io::sink())).err().unwrap();
    assert!(err.to_string().contains("vCPUs"), "{err}");
}

/// A VM that stopped lets go of what its vsock thread held (the host socket, and guest RAM
/// once a driver activated the device): a VM run inside a long-lived process (the parent an
/// executor boots) must not keep them after it is dropped.
#[test]
fn a_dropped_vm_closes_its_vsock_socket() {
    if !kvm_available() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let uds = tmp.path().join("vsock.sock");
    let mut code = Vec::new();
    out8(&mut code, POWER_OFF.0, POWER_OFF.1);
    let ram = GuestRam::new_memfd(64).unwrap();
    ram.memory()
        .write_slice(&code, GuestAddress(CODE_ADDR))
        .unwrap();
    let mut vm = Vm::create(1, ram, Box::new(Capture::default())).unwrap();
    vm.add_vsock(3, &uds).unwrap();
    vm.set_entry(EntryPoint::Linux64 { rip: CODE_ADDR })
        .unwrap();
    assert!(
        std::os::unix::net::UnixStream::connect(&uds).is_ok(),
        "listening while it exists"
    );
    // `run` consumes the VM: it is dropped when the guest has stopped.
    assert_eq!(vm.run().unwrap(), GuestExit::PowerOff);
    let t = std::time::Instant::now();
    while std::os::unix::net::UnixStream::connect(&uds).is_ok() {
        assert!(
            t.elapsed() < std::time::Duration::from_secs(5),
            "the vsock thread still listens after its VM was dropped"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

#[test]
fn kvm_counts_the_guest_s_exits_by_reason() {
    if !kvm_available() {
        return;
    }
    let mut code = Vec::new();
    print(&mut code, "counted\n");
    out8(&mut code, POWER_OFF.0, POWER_OFF.1);
    let (vm, _out) = new_guest(1, EntryPoint::Linux64 { rip: CODE_ADDR }, &code);
    let running = vm.start().unwrap();
    assert_eq!(running.wait_exit().unwrap(), GuestExit::PowerOff);
    let Some(c) = running.kvm_counters() else {
        println!("SKIPPED: this kernel has no KVM statistics files");
        return;
    };
    println!("{c:?}");
    // Eight bytes to the serial port and the power-off write: each leaves the guest (KVM
    // counts them as io_exits; PVM emulates the instruction and counts insn_emulation).
    assert!(c.get("exits") >= 9, "{c:?}");
    assert!(c.get("exits") >= c.get("io_exits"), "{c:?}");
    assert!(c.0.keys().any(|k| k.starts_with("vm.")), "{c:?}");
    assert!(
        !c.0.contains_key("halt_poll_success_hist"),
        "histograms are left out"
    );
}
