//! `flatpipe plan --export`: the schedule an export carries is the one the plan's prediction
//! ran, and what the target cannot run of the plan is said.

use crate::cli::common::flatpipe;
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::Path;

/// Each rank's compute actions in start order, from a Chrome trace `simulate --trace` wrote
/// (compute events are on thread 0 and named in the pipeline-order CSV notation, e.g. `1F3`;
/// the optimizer step is not an action).
fn trace_orders(path: &Path) -> BTreeMap<u64, Vec<String>> {
    let v: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let mut events: Vec<(u64, f64, String)> = v["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["ph"] == "X" && e["tid"] == 0)
        // Compute actions only: the optimizer step is an event of its own.
        .filter(|e| {
            e["name"]
                .as_str()
                .is_some_and(|n| n.starts_with(|c: char| c.is_ascii_digit()))
        })
        .map(|e| {
            (
                e["pid"].as_u64().unwrap(),
                e["ts"].as_f64().unwrap(),
                e["name"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    events.sort_by(|a, b| a.0.cmp(&b.0).then(a.1.total_cmp(&b.1)));
    let mut out: BTreeMap<u64, Vec<String>> = BTreeMap::new();
    for (rank, _, name) in events {
        out.entry(rank).or_default().push(name);
    }
    out
}

/// A zb-auto plan's CSV export is, action for action, the order its prediction replayed: the
/// plan's one sampled step, replayed by `simulate --plan` and written as a trace. (The export
/// once regenerated zb-auto at unit costs, which orders the W actions differently.)
#[test]
fn a_zb_auto_export_is_the_schedule_the_plan_predicted() {
    let dir = tempfile::tempdir().unwrap();
    let o = flatpipe(
        dir.path(),
        &[
            "plan",
            "--ranks",
            "4",
            "--pp",
            "4",
            "--schedule",
            "zb-auto",
            "--steps",
            "1",
            "--export",
            "pytorch-csv",
            "-o",
            "p.yaml",
            "--gantt",
            "none",
        ],
    );
    assert!(o.status.success(), "{}", o.stderr);
    let s = flatpipe(
        dir.path(),
        &[
            "simulate", "--plan", "p.yaml", "--trace", "t.json", "--gantt", "none",
        ],
    );
    assert!(s.status.success(), "{}", s.stderr);
    let csv = std::fs::read_to_string(dir.path().join("p.pytorch.csv")).unwrap();
    let exported: Vec<Vec<String>> = csv
        .lines()
        .map(|l| l.split(',').map(str::to_string).collect())
        .collect();
    let replayed: Vec<Vec<String>> = trace_orders(&dir.path().join("t.json"))
        .into_values()
        .collect();
    assert_eq!(exported.len(), 4);
    assert_eq!(exported, replayed);
}

/// An export of a plan whose microbatch count varies per step says so on stderr, and the
/// torchtitan batch is the exported step's count (the CSV's microbatches), not a mean.
#[test]
fn an_export_warns_what_the_target_runs_instead() {
    let dir = tempfile::tempdir().unwrap();
    let o = flatpipe(
        dir.path(),
        &[
            "plan",
            "--ranks",
            "4",
            "--pp",
            "4",
            "--schedule",
            "zb-h1",
            "--steps",
            "8",
            "--export",
            "torchtitan",
            "-o",
            "p.yaml",
            "--gantt",
            "none",
        ],
    );
    assert!(o.status.success(), "{}", o.stderr);
    assert!(
        o.stderr
            .contains("warning: --export torchtitan: the plan's microbatch count changes per step"),
        "{}",
        o.stderr
    );
    let csv = std::fs::read_to_string(dir.path().join("p.torchtitan.csv")).unwrap();
    let first = csv.lines().next().unwrap();
    let microbatches = first.split(',').filter(|a| a.starts_with("0F")).count();
    let toml = std::fs::read_to_string(dir.path().join("p.torchtitan.toml")).unwrap();
    assert!(
        toml.contains(&format!("local_batch_size = {microbatches}\n")),
        "{toml}"
    );
    // Megatron's file carries the same warning as a comment line.
    let m = flatpipe(
        dir.path(),
        &[
            "plan",
            "--ranks",
            "4",
            "--pp",
            "4",
            "--schedule",
            "1f1b",
            "--steps",
            "8",
            "--export",
            "megatron",
            "-o",
            "m.yaml",
            "--gantt",
            "none",
        ],
    );
    assert!(m.status.success(), "{}", m.stderr);
    let text = std::fs::read_to_string(dir.path().join("m.megatron.txt")).unwrap();
    assert!(
        text.lines()
            .any(|l| l.starts_with("# warning: the plan's microbatch count changes per step")),
        "{text}"
    );
}

/// `--export megatron` names a target that cannot place V schedules (Megatron-LM puts stage i
/// on rank i mod pp): the search leaves them out instead of choosing one and failing after the
/// search, and a `--schedule` of V schedules only is refused up front with what to give.
#[test]
fn an_export_to_megatron_searches_what_megatron_can_run() {
    let dir = tempfile::tempdir().unwrap();
    let base = [
        "plan", "--ranks", "2", "--pp", "2", "--steps", "2", "--gantt", "none", "--export",
        "megatron",
    ];
    let mut only_v = base.to_vec();
    only_v.extend(["--schedule", "zb-v,dualpipev"]);
    let o = flatpipe(dir.path(), &only_v);
    assert_eq!(o.status.code(), Some(2), "{}", o.stderr);
    assert!(
        o.stderr
            .contains("cannot run the V placement of zb-v, dualpipev")
            && o.stderr.contains("--export pytorch-csv"),
        "{}",
        o.stderr
    );
    // With V and loop schedules, the V ones are left out of the search (no zb-v row) and a
    // loop-placed plan is chosen and exported.
    let mut mixed = base.to_vec();
    mixed.extend(["--schedule", "zb-v,1f1b"]);
    let o = flatpipe(dir.path(), &mixed);
    assert!(o.status.success(), "{}", o.stderr);
    assert!(
        o.stderr.contains("zb-v left out of --schedule"),
        "{}",
        o.stderr
    );
    assert!(!o.stderr.contains("   zb-v "), "{}", o.stderr);
    assert!(
        o.stdout.contains("--pipeline-model-parallel-size 2") && o.stderr.contains("chosen: 1f1b"),
        "{}\n{}",
        o.stdout,
        o.stderr
    );
    // Without --schedule the search keeps to the schedules Megatron-LM runs (1F1B, interleaved
    // 1F1B, combined 1F1B), says so, and the export runs the plan it predicted: no warning that
    // Megatron runs another schedule.
    let o = flatpipe(dir.path(), &base);
    assert!(o.status.success(), "{}", o.stderr);
    assert!(
        o.stderr.contains("keeps to the schedules Megatron-LM runs"),
        "{}",
        o.stderr
    );
    for other in ["zb-h1", "zb-h2", "zb-auto", "gpipe", "looped-bfs", "zb-v"] {
        assert!(
            !o.stderr.contains(&format!("   {other} ")),
            "{other}: {}",
            o.stderr
        );
    }
    assert!(!o.stdout.contains("Megatron-LM has no"), "{}", o.stdout);
}

/// Llama-3.1-70B on 32 H100: the plan chosen under the limit leaves its busiest rank less than
/// 5% of it, which the notes and the export say, with the re-plan that keeps a margin;
/// `--memory-margin 0.05` plans under 95% of the limit, and nothing is said. A margin outside
/// [0, 1) is refused.
#[test]
fn a_plan_with_little_memory_headroom_says_so_and_offers_a_margin() {
    let dir = tempfile::tempdir().unwrap();
    let run = |margin: &str| {
        flatpipe(
            dir.path(),
            &[
                "plan",
                "--model",
                "llama3.1-70b",
                "--hardware",
                "h100",
                "--ranks",
                "32",
                "--steps",
                "4",
                "--gantt",
                "none",
                "--export",
                "megatron",
                // Every schedule Megatron can be given, as a user may ask (the default keeps
                // to the ones it runs).
                "--schedule",
                "all",
                "--memory-margin",
                margin,
            ],
        )
    };
    let o = run("0");
    assert!(o.status.success(), "{}", o.stderr);
    assert!(
        o.stdout
            .contains("# warning: the plan's busiest rank needs")
            && o.stdout.contains("re-plan with --memory-margin 0.05"),
        "{}",
        o.stdout
    );
    let o = run("0.05");
    assert!(o.status.success(), "{}", o.stderr);
    assert!(!o.stdout.contains("headroom") && !o.stderr.contains("headroom"));
    let o = run("1");
    assert_eq!(o.status.code(), Some(2));
    assert!(
        o.stderr.contains("--memory-margin 1 is invalid"),
        "{}",
        o.stderr
    );
}
