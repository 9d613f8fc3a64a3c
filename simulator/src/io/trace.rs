//! Chrome trace (Perfetto) JSON of a timeline.
//!
//! One process per rank (`rank r`), thread 0 its compute, thread `1 + q` its sends to rank `q`
//! (events on one thread must nest, so each link gets its own). Compute events are named in
//! PyTorch notation (`0F1`, `(0F3;1B2)OVERLAP_F_B`), sends `0SEND_F1` / `3SEND_B1`, so they line
//! up with PyTorch profiler traces (which label actions `PP:0F1`). Times are microseconds.

use crate::ir::Action;
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
    json!({"traceEvents": events, "displayTimeUnit": "ms"})
}
