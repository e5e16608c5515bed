//! Power management: the hardware-reduced ACPI sleep/reset registers and the i8042 reset line.

use super::bus::PioDevice;
use super::GuestExit;
use crate::layout::{ACPI_RESET_VALUE, ACPI_S5_SLEEP_TYPE};

/// SLP_EN and SLP_TYP fields of the hardware-reduced sleep-control register (ACPI 6, 4.8.3.7).
const SLP_EN: u8 = 1 << 5;
const SLP_TYP_SHIFT: u8 = 2;
const SLP_TYP_MASK: u8 = 0x7 << SLP_TYP_SHIFT;
/// WAK_STS in the sleep-status register.
const WAK_STS: u8 = 1 << 7;

/// Ports: +0 sleep control, +1 sleep status, +2 reset.
#[derive(Default)]
pub struct AcpiPm;

impl PioDevice for AcpiPm {
    fn read(&mut self, offset: u16, data: &mut [u8]) {
        data.fill(0);
        if offset == 1 {
            data[0] = WAK_STS;
        }
    }

    fn write(&mut self, offset: u16, data: &[u8]) -> Option<GuestExit> {
        let v = *data.first()?;
        match offset {
            0 if v & SLP_EN != 0 && (v & SLP_TYP_MASK) >> SLP_TYP_SHIFT == ACPI_S5_SLEEP_TYPE => {
                Some(GuestExit::PowerOff)
            }
            2 if v == ACPI_RESET_VALUE => Some(GuestExit::Reboot),
            _ => None,
        }
    }
}

/// Just enough of the i8042 keyboard controller for Linux's `reboot=k` path and its probes.
#[derive(Default)]
pub struct I8042;

const I8042_CMD_RESET: u8 = 0xfe;

impl PioDevice for I8042 {
    fn read(&mut self, _offset: u16, data: &mut [u8]) {
        // Status register: output buffer empty, input buffer empty.
        data.fill(0);
    }

    fn write(&mut self, _offset: u16, data: &[u8]) -> Option<GuestExit> {
        (data.first() == Some(&I8042_CMD_RESET)).then_some(GuestExit::Reboot)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn s5_powers_off_other_sleep_states_do_not() {
        let mut pm = AcpiPm;
        let s5 = SLP_EN | (ACPI_S5_SLEEP_TYPE << SLP_TYP_SHIFT);
        assert_eq!(pm.write(0, &[s5]), Some(GuestExit::PowerOff));
        assert_eq!(pm.write(0, &[SLP_EN | (3 << SLP_TYP_SHIFT)]), None);
        assert_eq!(pm.write(0, &[ACPI_S5_SLEEP_TYPE << SLP_TYP_SHIFT]), None);
        assert_eq!(pm.write(2, &[ACPI_RESET_VALUE]), Some(GuestExit::Reboot));
        let mut st = [0u8];
        pm.read(1, &mut st);
        assert_eq!(st[0], WAK_STS);
    }

    #[test]
    fn i8042_reset() {
        let mut k = I8042;
        assert_eq!(k.write(0, &[0xfe]), Some(GuestExit::Reboot));
        assert_eq!(k.write(0, &[0xaa]), None);
    }
}
