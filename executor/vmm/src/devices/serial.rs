//! COM1: a 16550 UART (vm-superio) whose interrupt is an irqfd into the KVM irqchip.

use std::io::Write;

use vm_superio::serial::NoEvents;
use vm_superio::{Serial, Trigger};
use vmm_sys_util::eventfd::EventFd;

use super::bus::PioDevice;
use super::GuestExit;
use crate::error::DeviceError;

/// Raises the UART's interrupt by signalling an eventfd registered as an irqfd.
pub struct IrqTrigger(pub EventFd);

impl Trigger for IrqTrigger {
    type E = std::io::Error;
    fn trigger(&self) -> std::io::Result<()> {
        self.0.write(1)
    }
}

pub struct SerialConsole {
    uart: Serial<IrqTrigger, NoEvents, Box<dyn Write + Send>>,
}

impl SerialConsole {
    pub fn new(irq: EventFd, out: Box<dyn Write + Send>) -> Self {
        Self {
            uart: Serial::new(IrqTrigger(irq), out),
        }
    }

    /// Send what the guest writes from now on to `out` (a restore made ahead of its child
    /// learns where the child's console goes only with the child).
    pub fn set_output(&mut self, out: Box<dyn Write + Send>) {
        *self.uart.writer_mut() = out;
    }

    /// Rebuild a UART from saved registers.
    pub fn from_snapshot(
        irq: EventFd,
        out: Box<dyn Write + Send>,
        s: &crate::snapshot::devices::SerialSnapshot,
    ) -> Result<Self, DeviceError> {
        let state = vm_superio::serial::SerialState::from(s);
        Serial::from_state(&state, IrqTrigger(irq), NoEvents, out)
            .map(|uart| Self { uart })
            .map_err(|source| DeviceError::SerialState {
                fifo: s.in_buffer.len(),
                source,
            })
    }

    pub fn snapshot(&self) -> crate::snapshot::devices::SerialSnapshot {
        (&self.uart.state()).into()
    }

    /// Push buffered console output to its destination.
    pub fn flush(&mut self) {
        let _ = self.uart.writer_mut().flush();
    }

    /// Feed host input to the guest (e.g. an interactive console).
    pub fn enqueue_input(&mut self, bytes: &[u8]) -> usize {
        self.uart.enqueue_raw_bytes(bytes).unwrap_or(0)
    }
}

impl PioDevice for SerialConsole {
    fn read(&mut self, offset: u16, data: &mut [u8]) {
        if let Some(b) = data.first_mut() {
            *b = self.uart.read(offset as u8);
        }
    }

    fn write(&mut self, offset: u16, data: &[u8]) -> Option<GuestExit> {
        if let Some(&b) = data.first() {
            // A failed console write (closed pipe) must not stop the guest.
            let _ = self.uart.write(offset as u8, b);
        }
        None
    }
}
