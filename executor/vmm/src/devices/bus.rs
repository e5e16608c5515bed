//! Port-I/O bus: maps port ranges to devices.

use std::sync::{Arc, Mutex};

use super::GuestExit;
use crate::error::DeviceError;

/// A device reached through port I/O. `offset` is relative to the device's first port.
pub trait PioDevice: Send {
    fn read(&mut self, offset: u16, data: &mut [u8]);
    /// Returns `Some` when the write asks the VM to stop (power-off, reset).
    fn write(&mut self, offset: u16, data: &[u8]) -> Option<GuestExit>;
}

struct Entry {
    base: u16,
    len: u16,
    device: Arc<Mutex<dyn PioDevice>>,
}

#[derive(Default)]
pub struct PioBus {
    entries: Vec<Entry>,
}

impl PioBus {
    /// Register a device; overlapping ranges are a programming error and are refused.
    pub fn insert(
        &mut self,
        base: u16,
        len: u16,
        device: Arc<Mutex<dyn PioDevice>>,
    ) -> Result<(), DeviceError> {
        let end = base as u32 + len as u32;
        if let Some(e) = self
            .entries
            .iter()
            .find(|e| (base as u32) < e.base as u32 + e.len as u32 && (e.base as u32) < end)
        {
            return Err(DeviceError::PortOverlap {
                base,
                len,
                other_base: e.base,
                other_len: e.len,
            });
        }
        self.entries.push(Entry { base, len, device });
        Ok(())
    }

    fn find(&self, port: u16) -> Option<(&Entry, u16)> {
        self.entries
            .iter()
            .find(|e| port >= e.base && (port - e.base) < e.len)
            .map(|e| (e, port - e.base))
    }

    /// Unclaimed ports read as all-ones, like an empty ISA bus.
    pub fn read(&self, port: u16, data: &mut [u8]) {
        match self.find(port) {
            Some((e, off)) => e.device.lock().unwrap().read(off, data),
            None => data.fill(0xff),
        }
    }

    /// Unclaimed ports swallow writes.
    pub fn write(&self, port: u16, data: &[u8]) -> Option<GuestExit> {
        let (e, off) = self.find(port)?;
        e.device.lock().unwrap().write(off, data)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Echo(u8);
    impl PioDevice for Echo {
        fn read(&mut self, offset: u16, data: &mut [u8]) {
            data.fill(self.0 + offset as u8);
        }
        fn write(&mut self, _offset: u16, data: &[u8]) -> Option<GuestExit> {
            self.0 = data[0];
            (data[0] == 0xff).then_some(GuestExit::PowerOff)
        }
    }

    #[test]
    fn routes_by_port_and_refuses_overlap() {
        let mut bus = PioBus::default();
        bus.insert(0x100, 4, Arc::new(Mutex::new(Echo(10))))
            .unwrap();
        let err = bus
            .insert(0x103, 2, Arc::new(Mutex::new(Echo(0))))
            .unwrap_err();
        assert!(
            matches!(
                err,
                DeviceError::PortOverlap {
                    base: 0x103,
                    other_base: 0x100,
                    other_len: 4,
                    ..
                }
            ),
            "{err:?}"
        );
        bus.insert(0x104, 2, Arc::new(Mutex::new(Echo(50))))
            .unwrap();
        let mut b = [0u8];
        bus.read(0x102, &mut b);
        assert_eq!(b[0], 12);
        bus.read(0x105, &mut b);
        assert_eq!(b[0], 51);
        bus.read(0x200, &mut b);
        assert_eq!(b[0], 0xff);
        assert_eq!(bus.write(0x100, &[0xff]), Some(GuestExit::PowerOff));
        assert_eq!(bus.write(0x300, &[0xff]), None);
    }
}
