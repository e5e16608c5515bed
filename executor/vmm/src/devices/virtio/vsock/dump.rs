//! The device's state in one line (interrupt status, how queue notifications arrive, queue
//! positions on both sides, every connection with its credit), for diagnosing stalls: logged by
//! the watchdog when work stays pending, and on demand through [`crate::diagnostics`].

use std::fmt::Write as _;
use std::sync::atomic::Ordering;

use virtio_queue::QueueT;

use super::connection::ConnState;
use super::device::DeviceState;

pub(super) fn describe(s: &DeviceState) -> String {
    let mut out = format!(
        "irq_status={} irqs_raised={} irqs_not_wanted={} paused={} reset_unacked={:?} notify={} ctrl_pending={}",
        s.irq.as_ref().map_or(0, |i| i.status()),
        s.used_irq.counts.raised,
        s.used_irq.counts.not_wanted,
        s.paused,
        s.reset_unacked.map(|w| w.0),
        if s.queue_events.is_empty() {
            "exit"
        } else {
            "eventfd"
        },
        s.muxer.ctrl.len()
    );
    if let Some(h) = s.muxer.ctrl.front() {
        let _ = write!(out, " (first op {} {}->{})", h.op, h.src_port, h.dst_port);
    }
    if let Some(mem) = &s.mem {
        for (i, q) in s.queues.iter().enumerate() {
            let avail = q.avail_idx(mem, Ordering::Acquire).map(|w| w.0);
            let used = q.used_idx(mem, Ordering::Acquire).map(|w| w.0);
            let _ = write!(
                out,
                " q{i}[ready={} size={} next_avail={} next_used={} guest_avail={:?} guest_used={:?}]",
                q.ready(),
                q.size(),
                q.next_avail(),
                q.next_used(),
                avail.ok(),
                used.ok()
            );
        }
    } else {
        out += " (not activated)";
    }
    for c in s.muxer.conns.values() {
        let state = match c.state {
            ConnState::Handshake(_) => "handshake",
            ConnState::Requested => "requested",
            ConnState::Established => "established",
        };
        let _ = write!(
            out,
            " conn[{}->{} {state} readable={} credit={} to_host={} done(g={},h={})]",
            c.local_port,
            c.peer_port,
            c.readable,
            c.guest_credit(),
            c.to_host.len(),
            c.guest_done_sending,
            c.host_done_sending
        );
    }
    out
}
