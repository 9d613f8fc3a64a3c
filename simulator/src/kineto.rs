//! Reads PyTorch profiler (Kineto / Chrome JSON) traces of a pipelined training run into a
//! measured [`Timeline`] and the [`Schedule`] the ranks actually ran.
//!
//! Pipeline actions are complete events (`"ph": "X"`) named `PP:<action>` in PyTorch's notation
//! (`PP:0F1`, `PP:3I0`, `PP:2W1`, `PP:1B0`, `PP:(0F3;1B2)OVERLAP_F_B`), e.g. from
//! `torch.profiler.record_function(f"PP:{action}")` around each action. `ts` and `dur` are
//! microseconds. When GPU-side annotations are present (`"cat": "gpu_user_annotation"`) only
//! they are used (device time); otherwise every `PP:` event counts.
//!
//! Ranks: with several files, file k is rank k (PyTorch writes one trace per rank); with one
//! file, each distinct `pid` is a rank, in increasing order. Times are taken relative to the
//! earliest action of all ranks, so the ranks' clocks must agree (one node, or synchronised).
//! Events of one rank must not overlap.

use crate::ir::{Action, Schedule};
use crate::timeline::{TimedOp, Timeline};
use crate::{Error, Result};
use serde_json::Value;
use std::collections::BTreeMap;

/// An input error naming the file (or rank), the field or event, the value and what is allowed.
fn bad(
    origin: impl AsRef<str>,
    field: impl AsRef<str>,
    value: impl ToString,
    allowed: &str,
) -> Error {
    Error::invalid(
        format!("{}: {}", origin.as_ref(), field.as_ref()),
        value,
        allowed,
    )
}

/// A trace read back: what ran where and when, and the schedule that was.
#[derive(Debug, Clone)]
pub struct ImportedTrace {
    /// Measured timeline (ns from the first action), one row per rank.
    pub timeline: Timeline,
    /// The ranks' action lists in time order, as a schedule (placement inferred).
    pub schedule: Schedule,
}

struct Event {
    rank: usize,
    action: Action,
    ts_us: f64,
    dur_us: f64,
}

fn events_of(doc: &Value, origin: &str) -> Result<Vec<(Value, String)>> {
    let list = match doc {
        Value::Array(a) => a,
        Value::Object(o) => o
            .get("traceEvents")
            .and_then(Value::as_array)
            .ok_or_else(|| bad(origin, "traceEvents", "missing", "a Chrome / Kineto trace: an object with a traceEvents array, or an array of events"))?,
        _ => {
            return Err(bad(
                origin,
                "top level",
                "not an object or array",
                "a Chrome / Kineto trace",
            ));
        }
    };
    Ok(list
        .iter()
        .filter(|e| e.get("ph").and_then(Value::as_str) == Some("X"))
        .filter(|e| {
            e.get("name")
                .and_then(Value::as_str)
                .is_some_and(|n| n.starts_with("PP:"))
        })
        .map(|e| (e.clone(), origin.to_string()))
        .collect())
}

/// Parses one or more trace files (`(origin, text)`; several files = one per rank, in rank
/// order).
///
/// # Errors
/// [`Error::InvalidArgument`] naming the file and event for malformed JSON, a trace without
/// `PP:` actions, an unparsable action, missing `ts` / `dur`, or overlapping actions on one
/// rank; [`Error::InvalidSchedule`] when the actions do not form a valid schedule (a stage on
/// two ranks, a missing F, ...).
pub fn read_traces(files: &[(String, String)]) -> Result<ImportedTrace> {
    if files.is_empty() {
        return Err(Error::invalid("trace files", "none", ">= 1 file"));
    }
    let mut raw: Vec<(usize, Value, String)> = Vec::new();
    for (k, (origin, text)) in files.iter().enumerate() {
        let doc: Value =
            serde_json::from_str(text).map_err(|e| bad(origin, "JSON", e, "a JSON trace file"))?;
        for (e, o) in events_of(&doc, origin)? {
            raw.push((k, e, o));
        }
    }
    if raw.is_empty() {
        return Err(bad(
            files
                .iter()
                .map(|f| f.0.as_str())
                .collect::<Vec<_>>()
                .join(", "),
            "traceEvents",
            "no `PP:` events",
            "complete events (ph X) named PP:<action>, e.g. PP:0F1, recorded around each pipeline action",
        ));
    }
    let gpu = raw
        .iter()
        .any(|(_, e, _)| e.get("cat").and_then(Value::as_str) == Some("gpu_user_annotation"));
    if gpu {
        raw.retain(|(_, e, _)| e.get("cat").and_then(Value::as_str) == Some("gpu_user_annotation"));
    }
    // Ranks: file index with several files, else pid order.
    let pid_of = |e: &Value| -> String {
        match e.get("pid") {
            Some(Value::String(s)) => s.clone(),
            Some(v) => v.to_string(),
            None => String::new(),
        }
    };
    let pid_rank: BTreeMap<(u64, String), usize> = {
        let mut pids: Vec<(u64, String)> = raw
            .iter()
            .map(|(_, e, _)| {
                let p = pid_of(e);
                (p.parse::<u64>().unwrap_or(u64::MAX), p)
            })
            .collect();
        pids.sort();
        pids.dedup();
        pids.into_iter().enumerate().map(|(i, p)| (p, i)).collect()
    };
    let mut events = Vec::with_capacity(raw.len());
    for (k, e, origin) in &raw {
        let name = e["name"].as_str().unwrap_or_default();
        let text = &name[3..];
        let action: Action = text.parse().map_err(|err: Error| {
            bad(
                origin,
                format!("event {name}"),
                err,
                "PP:<stage><F|I|W|B><microbatch> or PP:(..;..)OVERLAP_F_B",
            )
        })?;
        let num = |field: &str| -> Result<f64> {
            e.get(field)
                .and_then(Value::as_f64)
                .filter(|x| x.is_finite() && *x >= 0.0)
                .ok_or_else(|| {
                    bad(
                        origin,
                        format!("event {name}: {field}"),
                        e.get(field).map_or("missing".into(), |v| v.to_string()),
                        "microseconds >= 0",
                    )
                })
        };
        let rank = if files.len() > 1 {
            *k
        } else {
            let p = pid_of(e);
            pid_rank[&(p.parse::<u64>().unwrap_or(u64::MAX), p)]
        };
        events.push(Event {
            rank,
            action,
            ts_us: num("ts")?,
            dur_us: num("dur")?,
        });
    }
    let ranks = events.iter().map(|e| e.rank).max().unwrap_or(0) + 1;
    let t0 = events.iter().map(|e| e.ts_us).fold(f64::INFINITY, f64::min);
    events.sort_by(|a, b| a.rank.cmp(&b.rank).then(a.ts_us.total_cmp(&b.ts_us)));
    let mut compute: Vec<Vec<TimedOp>> = vec![Vec::new(); ranks];
    for e in &events {
        let start_ns = ((e.ts_us - t0) * 1e3).round() as u64;
        let end_ns = start_ns + (e.dur_us * 1e3).round() as u64;
        if let Some(prev) = compute[e.rank].last()
            && start_ns < prev.end_ns
        {
            return Err(bad(
                format!("rank {}", e.rank),
                format!("PP:{}", e.action),
                format!(
                    "starts at {:.1} us, before PP:{} ends at {:.1} us",
                    e.ts_us - t0,
                    prev.action,
                    prev.end_ns as f64 / 1e3
                ),
                "one action at a time per rank (no overlapping PP: events)",
            ));
        }
        compute[e.rank].push(TimedOp {
            action: e.action,
            start_ns,
            end_ns,
        });
    }
    // On each rank, a stage's microbatch runs F before I or B, and I before W.
    for (r, ops) in compute.iter().enumerate() {
        let mut seen: std::collections::HashSet<(u32, u32, u8)> = std::collections::HashSet::new();
        for o in ops {
            for a in o.action.parts() {
                let key = |k: u8| (a.stage.0, a.microbatch.0, k);
                let needs = match a.kind {
                    crate::ir::ActionKind::I | crate::ir::ActionKind::B => Some((0, "F")),
                    crate::ir::ActionKind::W => Some((1, "I")),
                    _ => None,
                };
                if let Some((k, what)) = needs
                    && !seen.contains(&key(k))
                {
                    return Err(bad(
                        format!("rank {r}"),
                        format!("PP:{a}"),
                        format!(
                            "runs at {:.1} us before its {what}",
                            o.start_ns as f64 / 1e3
                        ),
                        "each microbatch's F before its I or B, and its I before its W, on a stage",
                    ));
                }
                let k = match a.kind {
                    crate::ir::ActionKind::F => 0,
                    crate::ir::ActionKind::I => 1,
                    crate::ir::ActionKind::B => 1,
                    _ => 2,
                };
                seen.insert(key(k));
            }
        }
    }
    // The ranks' action lists as PyTorch's CSV: the reader infers and checks the placement.
    let csv: String = compute
        .iter()
        .map(|ops| {
            ops.iter()
                .map(|o| o.action.to_string())
                .collect::<Vec<_>>()
                .join(",")
        })
        .collect::<Vec<_>>()
        .join("\n");
    let name = if files.len() == 1 {
        files[0].0.clone()
    } else {
        format!("{} trace files", files.len())
    };
    let schedule = crate::pytorch_csv::read_pytorch_csv(&csv, &name)?;
    Ok(ImportedTrace {
        timeline: Timeline {
            compute,
            transfers: Vec::new(),
            optimizer: vec![None; ranks],
        },
        schedule,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(pid: u32, name: &str, ts: f64, dur: f64) -> String {
        format!(
            r#"{{"ph": "X", "cat": "user_annotation", "name": "{name}", "pid": {pid}, "tid": 1, "ts": {ts}, "dur": {dur}}}"#
        )
    }

    #[test]
    fn a_two_rank_trace_becomes_a_timeline_and_a_schedule() {
        let events = [
            ev(7, "PP:0F0", 1000.0, 10.0),
            ev(7, "PP:0F1", 1010.0, 10.0),
            ev(9, "PP:1F0", 1012.0, 10.0),
            ev(9, "PP:1B0", 1022.0, 20.0),
            ev(9, "PP:1F1", 1042.0, 10.0),
            ev(7, "PP:0B0", 1044.0, 20.0),
            ev(9, "PP:1B1", 1052.0, 20.0),
            ev(7, "PP:0B1", 1074.0, 20.0),
            r#"{"ph": "X", "name": "aten::mm", "pid": 7, "ts": 1001, "dur": 3}"#.to_string(),
        ];
        let text = format!(r#"{{"traceEvents": [{}]}}"#, events.join(","));
        let t = read_traces(&[("t.json".into(), text)]).unwrap();
        assert_eq!(t.timeline.num_ranks(), 2);
        assert_eq!(t.schedule.num_microbatches, 2);
        assert_eq!(t.schedule.num_stages(), 2);
        // Makespan 94 us; rank 0 busy 60 us, rank 1 busy 60 us.
        assert_eq!(t.timeline.makespan_ns(), 94_000);
        assert_eq!(t.timeline.busy_ns(0), 60_000);
        assert_eq!(t.timeline.compute[1][0].start_ns, 12_000);
    }

    #[test]
    fn bad_traces_say_what_is_wrong() {
        let e = read_traces(&[("x.json".into(), "{".into())])
            .unwrap_err()
            .to_string();
        assert!(e.contains("x.json"), "{e}");
        let e = read_traces(&[("x.json".into(), r#"{"traceEvents": []}"#.into())])
            .unwrap_err()
            .to_string();
        assert!(e.contains("PP:"), "{e}");
        let text = format!(
            r#"[{},{}]"#,
            ev(1, "PP:0F0", 0.0, 10.0),
            ev(1, "PP:0F1", 5.0, 10.0)
        );
        let e = read_traces(&[("x.json".into(), text)])
            .unwrap_err()
            .to_string();
        assert!(e.contains("overlapping"), "{e}");
        let text = format!(r#"[{}]"#, ev(1, "PP:0Q0", 0.0, 10.0));
        let e = read_traces(&[("x.json".into(), text)])
            .unwrap_err()
            .to_string();
        assert!(e.contains("PP:0Q0"), "{e}");
    }
}
