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
    for prefix in ["torch-interleaved-1f1b", "flatpipe-zb-v"] {
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
    use flatpipe::simulator::ir::lowering::{Lowering, lower_with_fsdp};
    let files = rank_files("torch-interleaved-1f1b");
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
                "step {step} rank {r}"
            );
        }
    }
}
