//! Calls relayed to a child's guest agent. Nothing a guest says is trusted, and a hostile one
//! must neither stall the executor nor grow its memory:
//! - each call runs on a thread of its own, not on tokio's blocking pool (which spawns,
//!   branches and kills share), so calls stuck on silent guests cannot starve other children;
//! - a sandbox has at most [`MAX_CALLS_PER_SANDBOX`] calls in flight; past that a call is
//!   refused with RESOURCE_EXHAUSTED;
//! - a call whose caller went away (its RPC was cancelled or its stream dropped) is cancelled:
//!   its stream to the guest is shut down, so its thread ends at once;
//! - the client bounds each frame (4 MiB, held only as it arrives) and each stall mid-frame or
//!   mid-write ([`tine_agent::client::STALL_TIMEOUT`]).

use std::collections::HashMap;
use std::path::Path;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use futures::Stream;
use tine_agent::client::{AgentClient, Cancel, CancelOnDrop};
use tine_host::ready::agent;
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::ReceiverStream;
use tonic::Status;

/// Agent calls one sandbox may have in flight at once.
pub const MAX_CALLS_PER_SANDBOX: usize = 32;

/// Agent calls in flight, per sandbox.
#[derive(Default)]
pub struct AgentCalls(Arc<Mutex<HashMap<String, usize>>>);

/// A call's place in its sandbox's count, given back when the call's thread ends.
struct Slot {
    calls: Arc<Mutex<HashMap<String, usize>>>,
    sandbox: String,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut m = self.calls.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = m.get_mut(&self.sandbox) {
            *n -= 1;
            if *n == 0 {
                m.remove(&self.sandbox);
            }
        }
    }
}

/// A started call: its result, and the guard that cancels it when dropped.
pub struct Started<T> {
    pub result: oneshot::Receiver<T>,
    pub cancel: CancelOnDrop,
}

impl AgentCalls {
    fn take_slot(&self, sandbox: &str) -> Result<Slot, Status> {
        let mut m = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let n = m.entry(sandbox.to_string()).or_insert(0);
        if *n >= MAX_CALLS_PER_SANDBOX {
            return Err(Status::resource_exhausted(format!(
                "sandbox {sandbox} already has {MAX_CALLS_PER_SANDBOX} calls to its guest agent \
                 in flight; wait for one to finish"
            )));
        }
        *n += 1;
        Ok(Slot {
            calls: Arc::clone(&self.0),
            sandbox: sandbox.to_string(),
        })
    }

    /// Runs `call` with a cancellable client for the agent of `sandbox` (whose directory is
    /// `dir`) on a thread of its own.
    pub fn start<T: Send + 'static>(
        &self,
        sandbox: &str,
        dir: &Path,
        call: impl FnOnce(AgentClient) -> T + Send + 'static,
    ) -> Result<Started<T>, Status> {
        let slot = self.take_slot(sandbox)?;
        let cancel = Cancel::default();
        let client = agent(&dir.join("vsock.sock")).with_cancel(cancel.clone());
        let (tx, result) = oneshot::channel();
        std::thread::Builder::new()
            .name("agent-call".into())
            .spawn(move || {
                let _slot = slot;
                let _ = tx.send(call(client));
            })
            .map_err(|e| Status::resource_exhausted(format!("starting an agent call: {e}")))?;
        Ok(Started {
            result,
            cancel: cancel.on_drop(),
        })
    }
}

/// A response stream that cancels its agent call when dropped: the caller went away.
pub struct Guarded<S> {
    inner: S,
    _cancel: CancelOnDrop,
}

/// The response stream of a started call that sends its items into `rx`'s channel.
pub fn relayed<T: Send + 'static>(
    rx: mpsc::Receiver<Result<T, Status>>,
    started: Started<()>,
) -> Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>> {
    Box::pin(Guarded {
        inner: ReceiverStream::new(rx),
        _cancel: started.cancel,
    })
}

impl<S: Stream + Unpin> Stream for Guarded<S> {
    type Item = S::Item;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        Pin::new(&mut self.inner).poll_next(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sandbox_gets_a_bounded_number_of_calls_and_they_come_back() {
        let calls = AgentCalls::default();
        let slots: Vec<Slot> = (0..MAX_CALLS_PER_SANDBOX)
            .map(|_| calls.take_slot("sbx-a").unwrap())
            .collect();
        let err = calls.take_slot("sbx-a").err().unwrap();
        assert_eq!(err.code(), tonic::Code::ResourceExhausted);
        assert!(err.message().contains("sbx-a"), "{}", err.message());
        // Another sandbox is not affected.
        let other = calls.take_slot("sbx-b").unwrap();
        drop(slots);
        let in_flight = |s: &str| calls.0.lock().unwrap().get(s).copied();
        assert_eq!(in_flight("sbx-a"), None);
        assert_eq!(in_flight("sbx-b"), Some(1));
        drop(other);
        assert!(calls.0.lock().unwrap().is_empty());
    }
}
