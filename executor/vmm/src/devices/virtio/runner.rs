//! Who runs a device's event loop: nobody yet, a thread of the device's own, or the VM's owner
//! (see [`DeviceLoop`](super::DeviceLoop)). Each device that has a loop keeps one of these, so
//! a loop is never run twice and a device's own thread is waited for when it goes.

use std::thread::JoinHandle;

pub(crate) enum Runner {
    /// Nobody yet: the device was prepared and its VM has not started.
    NotYet,
    /// A thread of the device's own.
    Thread(JoinHandle<()>),
    /// The VM's owner, who turns the loop on a thread it already has.
    Handed,
}

impl Runner {
    /// Start the loop `make` builds on a thread named `name`, unless someone runs it already.
    pub(crate) fn start_thread<F>(
        &mut self,
        name: &str,
        make: impl FnOnce() -> F,
    ) -> std::io::Result<()>
    where
        F: FnOnce() + Send + 'static,
    {
        if !matches!(self, Runner::NotYet) {
            return Ok(());
        }
        let thread = crate::thread_builder(name).spawn(make())?;
        *self = Runner::Thread(thread);
        Ok(())
    }

    /// Whether the loop may be handed over (nobody runs it yet); from then on the owner does.
    pub(crate) fn hand_over(&mut self) -> bool {
        if !matches!(self, Runner::NotYet) {
            return false;
        }
        *self = Runner::Handed;
        true
    }

    /// Wait for the device's own thread, once it was told to stop.
    pub(crate) fn join(&mut self) {
        if let Runner::Thread(t) = std::mem::replace(self, Runner::NotYet) {
            let _ = t.join();
        }
    }
}
