//! Real PyTorch profiler traces (tests/data/traces/, written by scripts/traces/make_traces.py
//! with torch 2.15 on the CPU and gloo): PyTorch's own runtime and flatpipe's, two steps each,
//! imported and checked against what the schedule objects say each rank ran (truth.json).

use flatpipe::simulator::io::kineto::{ImportOptions, read_trace_file, read_traces};

const DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/traces");

fn gz(name: &str) -> (String, String) {
    let text = read_trace_file(std::path::Path::new(&format!("{DIR}/{name}"))).unwrap();
    (name.to_string(), text)
}

/// The two rank files of the committed trace `prefix`, in rank order.
fn rank_files(prefix: &str) -> Vec<(String, String)> {
    (0..2)
        .map(|r| gz(&format!("{prefix}.rank{r}.json.gz")))
        .collect()
}

fn truth() -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(format!("{DIR}/truth.json")).unwrap()).unwrap()
}

#[test]
fn both_runtimes_traces_import_as_the_ranks_ran_them() {
    let truth = truth();
    for prefix in [
        "torch-interleaved-1f1b",
        "flatpipe-zb-v",
        "torch-fsdp-interleaved-1f1b",
    ] {
        let names: Vec<String> = (0..2)
            .map(|r| format!("{prefix}.rank{r}.json.gz"))
            .collect();
        let files: Vec<_> = names.iter().map(|n| gz(n)).collect();
        for step in 0..2 {
            let t = read_traces(&files, &ImportOptions { step: Some(step) }).unwrap();
            assert_eq!((t.steps, t.step), (2, step), "{prefix}");
            for (r, name) in names.iter().enumerate() {
                let ran: Vec<String> = t.schedule.ranks[r].iter().map(|a| a.to_string()).collect();
                let want: Vec<String> = truth[name][step]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|a| a.as_str().unwrap().to_string())
                    .collect();
                assert_eq!(ran, want, "{prefix} step {step} rank {r}");
                for op in &t.timeline.compute[r] {
                    assert!(op.start_ns < op.end_ns, "{prefix}: {:?}", op);
                }
            }
            // CPU-side annotations only: the import says so.
            assert!(
                t.warnings.iter().any(|w| w.contains("CPU-side")),
                "{:?}",
                t.warnings
            );
        }
        // Default: the last step.
        assert_eq!(
            read_traces(&files, &ImportOptions::default()).unwrap().step,
            1
        );
    }
}

#[test]
fn pytorchs_comm_events_are_counted_and_its_waits_left_out_of_busy_time() {
    let files = rank_files("torch-interleaved-1f1b");
    let t = read_traces(&files, &ImportOptions::default()).unwrap();
    for label in ["SEND_F", "RECV_F", "SEND_B", "RECV_B", "UNSHARD", "RESHARD"] {
        assert!(
            t.other_events.contains_key(label),
            "{label}: {:?}",
            t.other_events
        );
    }
    // torch waits for an action's input inside its span: some rank's spans start before
    // their first operator.
    assert!(t.leading_wait_ns.iter().sum::<u64>() > 0);
    // flatpipe's runtime records its program's sends, receives and waits as PyTorch's does.
    let files = rank_files("flatpipe-zb-v");
    let t = read_traces(&files, &ImportOptions::default()).unwrap();
    for label in [
        "SEND_F",
        "RECV_F",
        "SEND_B",
        "RECV_B",
        "WAIT_SEND_F",
        "WAIT_SEND_B",
    ] {
        assert!(t.other_events.contains_key(label), "{label}");
    }
}

#[test]
fn rank_files_out_of_order_are_named() {
    let files = vec![
        gz("flatpipe-zb-v.rank1.json.gz"),
        gz("flatpipe-zb-v.rank0.json.gz"),
    ];
    // The swapped files may or may not form a valid schedule; either way the order is named.
    match read_traces(&files, &ImportOptions::default()) {
        Ok(t) => assert!(
            t.warnings
                .iter()
                .any(|w| w.contains("distributedInfo.rank")),
            "{:?}",
            t.warnings
        ),
        Err(e) => panic!("swapped rank files: {e}"),
    }
}

#[test]
fn a_trace_without_pp_events_is_refused_with_what_to_do() {
    // PyTorch's Schedule1F1B records no PP: event.
    let e = read_traces(&[gz("torch-1f1b.rank0.json.gz")], &ImportOptions::default())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("torch-1f1b.rank0.json.gz") && e.contains("Schedule1F1B record none"),
        "{e}"
    );
    assert!(e.contains("record_function"), "{e}");
    let files = rank_files("flatpipe-zb-v");
    let e = read_traces(&files, &ImportOptions { step: Some(2) })
        .unwrap_err()
        .to_string();
    assert!(e.contains("step") && e.contains("0..2"), "{e}");
}

#[test]
fn pytorchs_comm_actions_land_on_comm_lanes_in_its_eager_lowerings_order() {
    use flatpipe::simulator::ir::comm::{FsdpAction, LoweredAction};
    use flatpipe::simulator::ir::lowering::RecvPosting;
    let files = rank_files("torch-interleaved-1f1b");
    for step in 0..2 {
        let t = read_traces(&files, &ImportOptions { step: Some(step) }).unwrap();
        // torch 2.15's runtime runs `_add_send_recv`'s order (receives ahead): every rank's
        // sends, receives and send waits, in the order flatpipe's lowering gives the schedule.
        assert_eq!(t.posting_difference(RecvPosting::Ahead).unwrap(), None);
        // The deferred order is another: the comparison can fail.
        assert!(
            t.posting_difference(RecvPosting::Deferred)
                .unwrap()
                .is_some()
        );
        for (r, lane) in t.timeline.comm.iter().enumerate() {
            // Every step holds, per stage of the rank (two each), one UNSHARD, RESHARD and
            // REDUCE_GRAD: the step split kept them with their step.
            for a in [
                FsdpAction::Unshard,
                FsdpAction::Reshard,
                FsdpAction::ReduceGrad,
            ] {
                let n = lane
                    .iter()
                    .filter(|c| matches!(c.action, LoweredAction::Fsdp(_, x) if x == a))
                    .count();
                assert_eq!(n, 2, "step {step} rank {r} {a:?}");
            }
            // One lane per rank: its spans follow one another (one CPU thread ran them) and
            // lie inside the step.
            for w in lane.windows(2) {
                assert!(w[0].start_ns <= w[1].start_ns);
            }
            assert!(lane.iter().all(|c| c.end_ns <= t.timeline.makespan_ns()));
        }
    }
}

#[test]
fn pytorchs_whole_program_with_fsdp_actions_is_flatpipes_lowering() {
    // torch 2.15's runtime lowers a compute-only schedule with `_add_unshard_reshard`
    // (max_active_stages 3) and `_add_reduce_grad` before the sweep: every PP: event of the
    // trace, compute and communication, in order, is `lower_with_fsdp`'s program.
    // The same with FSDP2 really sharding every stage over two data-parallel ranks.
    use flatpipe::simulator::ir::lowering::{Lowering, lower_with_fsdp};
    for prefix in ["torch-interleaved-1f1b", "torch-fsdp-interleaved-1f1b"] {
        let files = rank_files(prefix);
        for step in 0..2 {
            let t = read_traces(&files, &ImportOptions { step: Some(step) }).unwrap();
            let lowered = lower_with_fsdp(&t.schedule, Lowering::UNCONTENDED, 3).unwrap();
            let names = |p: &[flatpipe::simulator::ir::comm::LoweredAction]| -> Vec<String> {
                p.iter().map(ToString::to_string).collect()
            };
            for (r, ran) in t.program().iter().enumerate() {
                assert_eq!(
                    names(ran),
                    names(&lowered.program[r]),
                    "{prefix} step {step} rank {r}"
                );
            }
        }
    }
}

/// The `"ph": "X"` events of a committed trace file, read here with serde_json alone: per
/// event its name, thread id, start and duration (µs, as the profiler wrote them).
fn raw_events(name: &str) -> Vec<(String, String, f64, f64)> {
    let (_, text) = gz(name);
    let doc: serde_json::Value = serde_json::from_str(&text).unwrap();
    doc["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["ph"] == "X")
        .map(|e| {
            (
                e["name"].as_str().unwrap_or_default().to_string(),
                e["tid"].to_string(),
                e["ts"].as_f64().unwrap(),
                e["dur"].as_f64().unwrap_or(0.0),
            )
        })
        .collect()
}

#[test]
fn fsdps_collectives_under_pp_land_on_the_comm_lanes_with_their_measured_spans() {
    use flatpipe::simulator::ir::comm::{FsdpAction, LoweredAction};
    let prefix = "torch-fsdp-interleaved-1f1b";
    let files = rank_files(prefix);
    // Files of global ranks 0 and 2 (the pipeline ranks of data-parallel replica 0): in
    // increasing order, so the import does not warn about their order.
    let last = read_traces(&files, &ImportOptions::default()).unwrap();
    assert!(
        !last.warnings.iter().any(|w| w.contains("distributedInfo")),
        "{:?}",
        last.warnings
    );
    for r in 0..2 {
        let events = raw_events(&format!("{prefix}.rank{r}.json.gz"));
        // FSDP really ran: each REDUCE_GRAD span holds a reduce-scatter and each UNSHARD span
        // an FSDP all-gather, on the same thread.
        let inside = |span: &(String, String, f64, f64), what: &str| {
            events.iter().any(|e| {
                e.0 == what && e.1 == span.1 && e.2 >= span.2 && e.2 + e.3 <= span.2 + span.3
            })
        };
        let spans = |label: &str| -> Vec<&(String, String, f64, f64)> {
            events
                .iter()
                .filter(|e| {
                    e.0.strip_prefix("PP:").is_some_and(|a| {
                        a.trim_start_matches(|c: char| c.is_ascii_digit()) == label
                    })
                })
                .collect()
        };
        let reduce = spans("REDUCE_GRAD");
        let unshard = spans("UNSHARD");
        assert_eq!(
            (reduce.len(), unshard.len()),
            (4, 4),
            "rank {r}: 2 stages x 2 steps"
        );
        assert!(
            reduce
                .iter()
                .all(|e| inside(e, "c10d::_reduce_scatter_base_"))
        );
        assert!(unshard.iter().all(|e| inside(e, "FSDP::all_gather")));
        // The import puts them on the rank's comm lane with the durations the profiler wrote,
        // step by step, in the trace's order.
        for step in 0..2 {
            let t = read_traces(&files, &ImportOptions { step: Some(step) }).unwrap();
            for (label, action, all) in [
                ("REDUCE_GRAD", FsdpAction::ReduceGrad, &reduce),
                ("UNSHARD", FsdpAction::Unshard, &unshard),
            ] {
                let got: Vec<u64> = t.timeline.comm[r]
                    .iter()
                    .filter(|c| matches!(c.action, LoweredAction::Fsdp(_, a) if a == action))
                    .map(|c| c.end_ns - c.start_ns)
                    .collect();
                let want: Vec<u64> = all[2 * step..2 * step + 2]
                    .iter()
                    .map(|e| (e.3 * 1e3).round() as u64)
                    .collect();
                assert_eq!(got.len(), 2, "rank {r} step {step} {label}");
                for (g, w) in got.iter().zip(&want) {
                    assert!(
                        g.abs_diff(*w) <= 1,
                        "rank {r} step {step} {label}: {g} vs {w} ns"
                    );
                }
            }
        }
    }
    // Without FSDP (the plain interleaved trace) the same actions hold no collective.
    let plain = raw_events("torch-interleaved-1f1b.rank0.json.gz");
    assert!(!plain.iter().any(|e| e.0 == "c10d::_reduce_scatter_base_"));
}
