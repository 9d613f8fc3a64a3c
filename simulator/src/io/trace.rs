//! Chrome trace (Perfetto) JSON of a timeline.
//!
//! One process per rank (`rank r`), thread 0 its compute, thread `1 + q` its sends to rank `q`
//! (events on one thread must nest, so each link gets its own), and threads `comm k` for its
//! communication actions where the timeline has them (an imported trace's, a lowered replay's). Compute events are named in
//! PyTorch notation (`0F1`, `(0F3;1B2)OVERLAP_F_B`), sends `0SEND_F1` / `3SEND_B1`, so they line
//! up with PyTorch profiler traces (which label actions `PP:0F1`). Times are microseconds.

use crate::ir::Action;
use crate::ir::comm::{CommAction, LoweredAction};
use crate::replay::timeline::Timeline;
use serde_json::{Value, json};

fn us(ns: u64) -> f64 {
    ns as f64 / 1000.0
}

/// The Chrome trace JSON document of `timeline`.
pub fn chrome_trace(timeline: &Timeline) -> Value {
    let mut events = Vec::new();
    let p = timeline.num_ranks();
    for r in 0..p {
        events.push(json!({"ph": "M", "name": "process_name", "pid": r, "args": {"name": format!("rank {r}")}}));
        events.push(
            json!({"ph": "M", "name": "process_sort_index", "pid": r, "args": {"sort_index": r}}),
        );
        events.push(json!({"ph": "M", "name": "thread_name", "pid": r, "tid": 0, "args": {"name": "compute"}}));
        for op in &timeline.compute[r] {
            let cat = match op.action {
                Action::Compute(a) => a.kind.letter().to_string(),
                Action::Overlap(..) => "OVERLAP_F_B".to_string(),
            };
            events.push(json!({
                "ph": "X", "name": op.action.to_string(), "cat": cat, "pid": r, "tid": 0,
                "ts": us(op.start_ns), "dur": us(op.end_ns - op.start_ns),
            }));
        }
        if let Some(Some((a, b))) = timeline.optimizer.get(r) {
            events.push(json!({"ph": "X", "name": "optimizer", "cat": "optimizer", "pid": r, "tid": 0, "ts": us(*a), "dur": us(b - a)}));
        }
    }
    let mut links = std::collections::BTreeSet::new();
    for t in &timeline.transfers {
        if links.insert((t.from.0, t.to.0)) {
            events.push(json!({"ph": "M", "name": "thread_name", "pid": t.from.0, "tid": 1 + t.to.0, "args": {"name": format!("send to rank {}", t.to)}}));
        }
        events.push(json!({
            "ph": "X", "name": t.name(), "cat": "send", "pid": t.from.0, "tid": 1 + t.to.0,
            "ts": us(t.start_ns), "dur": us(t.end_ns - t.start_ns),
        }));
    }
    comm_lanes(timeline, &mut events);
    json!({"traceEvents": events, "displayTimeUnit": "ms"})
}

/// Appends each rank's communication actions ([`Timeline::comm`]) on threads `COMM_TID + k`
/// named `comm k`: an action goes on the first of its rank's comm threads whose last action
/// has ended (actions on different streams may overlap, and events on one thread must nest).
fn comm_lanes(timeline: &Timeline, events: &mut Vec<Value>) {
    for (r, lane) in timeline.comm.iter().enumerate() {
        let mut ends: Vec<u64> = Vec::new();
        for c in lane {
            let k = match ends.iter().position(|&e| e <= c.start_ns) {
                Some(k) => k,
                None => {
                    events.push(json!({"ph": "M", "name": "thread_name", "pid": r, "tid": COMM_TID + ends.len(), "args": {"name": format!("comm {}", ends.len())}}));
                    ends.push(0);
                    ends.len() - 1
                }
            };
            ends[k] = c.end_ns;
            let cat = match c.action {
                LoweredAction::Comm(CommAction::Send(_)) => "send",
                LoweredAction::Comm(CommAction::Recv(_)) => "recv",
                LoweredAction::WaitSend(_) => "wait",
                LoweredAction::AllToAll(_) => "all_to_all",
                _ => "fsdp",
            };
            events.push(json!({
                "ph": "X", "name": c.action.to_string(), "cat": cat, "pid": r, "tid": COMM_TID + k,
                "ts": us(c.start_ns), "dur": us(c.end_ns - c.start_ns),
            }));
        }
    }
}

/// The first comm thread's id (send threads are `1 + peer`, below it for any rank count a
/// trace viewer shows).
const COMM_TID: usize = 1_000_000;
