//! MMIO bus: guest-physical windows mapped to devices (the virtio-mmio transports).

use std::sync::{Arc, Mutex};

use crate::error::DeviceError;

/// A device reached through MMIO. `offset` is relative to the window base.
pub trait MmioDevice: Send {
    fn read(&mut self, offset: u64, data: &mut [u8]);
    fn write(&mut self, offset: u64, data: &[u8]);
}

struct Window {
    base: u64,
    size: u64,
    device: Arc<Mutex<dyn MmioDevice>>,
}

#[derive(Default)]
pub struct MmioBus {
    windows: Vec<Window>,
}

impl MmioBus {
    pub fn insert(
        &mut self,
        base: u64,
        size: u64,
        device: Arc<Mutex<dyn MmioDevice>>,
    ) -> Result<(), DeviceError> {
        if size == 0 || base.checked_add(size).is_none() {
            return Err(DeviceError::MmioWindow { base, size });
        }
        if let Some(w) = self
            .windows
            .iter()
            .find(|w| base < w.base + w.size && w.base < base + size)
        {
            return Err(DeviceError::MmioOverlap {
                base,
                size,
                other_base: w.base,
                other_size: w.size,
            });
        }
        self.windows.push(Window { base, size, device });
        Ok(())
    }

    fn find(&self, addr: u64) -> Option<(&Window, u64)> {
        self.windows
            .iter()
            .find(|w| addr >= w.base && addr - w.base < w.size)
            .map(|w| (w, addr - w.base))
    }

    /// Unclaimed addresses read as all-ones.
    pub fn read(&self, addr: u64, data: &mut [u8]) {
        match self.find(addr) {
            Some((w, off)) => w.device.lock().unwrap().read(off, data),
            None => data.fill(0xff),
        }
    }

    pub fn write(&self, addr: u64, data: &[u8]) {
        if let Some((w, off)) = self.find(addr) {
            w.device.lock().unwrap().write(off, data);
        }
    }
}
