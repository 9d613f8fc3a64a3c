//! Communication as actions: `simulate --p2p-posting/--p2p-streams` and `schedule --comms`,
//! checked against timelines and lowered programs derived by hand.

use crate::cli::common::flatpipe;
use serde_json::Value;

/// Start of action `name` in a Chrome trace written by `simulate --trace`, seconds.
fn start_s(trace: &Value, name: &str) -> f64 {
    let e = trace["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["name"] == name && e["ph"] == "X")
        .unwrap_or_else(|| panic!("{name} is not in the trace"));
    e["ts"].as_f64().unwrap() / 1e6
}

/// Interleaved 1F1B, p = 4, v = 2, m = 8, f = 1 s per stage, a transfer c = 0.5 s: rank 0
/// posts the receive of stage 3's output (PyTorch's sweep puts it right after 0SEND_F0) before
/// 0SEND_F1. On per-edge streams 1F1 starts when F1 arrives, 2 + c = 2.5 s; on one shared
/// stream the send waits behind that receive, which completes when microbatch 0 has crossed all
/// four ranks (4 + 4c), so F1 crosses [4 + 4c, 4 + 5c] and 1F1 starts at 6.5 s.
#[test]
fn a_receive_posted_ahead_holds_the_sends_behind_it_on_a_shared_stream() {
    let dir = tempfile::tempdir().unwrap();
    let run = |streams: &str| {
        let trace = format!("{streams}.json");
        let o = flatpipe(
            dir.path(),
            &[
                "simulate",
                "--costs",
                "f=2,b=4,w=0,comm=0.5",
                "--pp",
                "4",
                "--vpp",
                "2",
                "--microbatches",
                "8",
                "--schedule",
                "interleaved-1f1b",
                "--p2p-streams",
                streams,
                "--gantt",
                "none",
                "--trace",
                &trace,
            ],
        );
        assert!(o.status.success(), "{}", o.stderr);
        let text = std::fs::read_to_string(dir.path().join(&trace)).unwrap();
        start_s(&serde_json::from_str(&text).unwrap(), "1F1")
    };
    assert_eq!(run("per-peer"), 2.5);
    assert_eq!(run("peer-pair"), 2.5);
    assert_eq!(run("shared"), 6.5);
}

/// 1F1B, p = 2, m = 2, lowered by PyTorch's sweep (ranks in order, one compute action each per
/// round; a send right after its producer, its receive appended to the receiver's list at that
/// moment) and `_add_wait_send` (a forward send's wait after the local backward, the others at
/// the end). Round 1: 0F0 0SEND_F0 | 1RECV_F0 1F0. Round 2: 0F1 0SEND_F1 | 1RECV_F1 1B0
/// 1SEND_B0 (0RECV_B0 to rank 0). Round 3: 0B0 | 1F1. Round 4: rank 0 waits; 1B1 1SEND_B1
/// (0RECV_B1). Round 5: 0B1.
#[test]
fn schedule_writes_pytorchs_compute_comms_csv() {
    let dir = tempfile::tempdir().unwrap();
    // The rows `schedule --comms ...` writes for 1F1B, p = 2, m = 2.
    let rows = |comms: &[&str]| -> Vec<String> {
        let args = [
            "schedule",
            "--schedule",
            "1f1b",
            "--pp",
            "2",
            "--microbatches",
            "2",
        ];
        let args: Vec<&str> = args
            .iter()
            .chain(comms)
            .chain(&["-o", "out.csv"])
            .copied()
            .collect();
        let o = flatpipe(dir.path(), &args);
        assert!(o.status.success(), "{}", o.stderr);
        let csv = std::fs::read_to_string(dir.path().join("out.csv")).unwrap();
        csv.lines().map(String::from).collect()
    };
    assert_eq!(
        rows(&["--comms", "ahead"]),
        [
            "0F0,0SEND_F0,0F1,0SEND_F1,0RECV_B0,0B0,0WAIT_SEND_F0,0RECV_B1,0B1,0WAIT_SEND_F1",
            "1RECV_F0,1F0,1RECV_F1,1B0,1SEND_B0,1F1,1B1,1SEND_B1,1WAIT_SEND_B0,1WAIT_SEND_B1",
        ]
    );
    // With FSDP's actions, as torch's compute-only loader adds them (worked by hand through
    // its sweep: each UNSHARD, REDUCE_GRAD, WAIT_REDUCE_GRAD and RESHARD takes its rank's turn;
    // the end-of-step send waits come after the RESHARD).
    assert_eq!(
        rows(&["--comms", "ahead", "--fsdp"]),
        [
            "0UNSHARD,0F0,0SEND_F0,0F1,0SEND_F1,0RECV_B0,0B0,0WAIT_SEND_F0,0RECV_B1,0B1,\
             0WAIT_SEND_F1,0REDUCE_GRAD,0WAIT_REDUCE_GRAD,0RESHARD",
            "1UNSHARD,1RECV_F0,1F0,1RECV_F1,1B0,1SEND_B0,1F1,1B1,1SEND_B1,1REDUCE_GRAD,\
             1WAIT_REDUCE_GRAD,1RESHARD,1WAIT_SEND_B0,1WAIT_SEND_B1",
        ]
    );
    // Deferred: rank 1's receive of F1 moves to just before 1F1 (rank 1 is the higher of the
    // pair, so its send to rank 0 does not flush it); rank 0's receives already sit just before
    // their backwards.
    assert_eq!(
        rows(&["--comms", "deferred"])[1],
        "1RECV_F0,1F0,1B0,1SEND_B0,1RECV_F1,1F1,1B1,1SEND_B1,1WAIT_SEND_B0,1WAIT_SEND_B1"
    );
}

/// The deferred order of the case above on one stream per peer pair: rank 0 posts 0SEND_F1
/// before 0RECV_B0 and rank 1 posts 1SEND_B0 before 1RECV_F1, each send waiting for a receive
/// queued behind the other's. The replay says so and names the waiting streams.
#[test]
fn streams_that_wait_on_each_other_are_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let o = flatpipe(
        dir.path(),
        &[
            "simulate",
            "--costs",
            "f=1,b=2,w=0,comm=0.5",
            "--pp",
            "2",
            "--microbatches",
            "2",
            "--schedule",
            "1f1b",
            "--p2p-posting",
            "deferred",
            "--p2p-streams",
            "peer-pair",
            "--gantt",
            "none",
        ],
    );
    assert_eq!(o.status.code(), Some(2), "{}", o.stderr);
    assert!(
        o.stderr.contains("hangs under its communication lowering")
            && o.stderr.contains("rank 0 p2p with 1: 0SEND_F1")
            && o.stderr.contains("rank 1 p2p with 0: 1SEND_B0"),
        "{}",
        o.stderr
    );
}

/// In a comparison, a schedule whose lowering cannot run is left out with a note and the others
/// are shown: on one shared stream, 1F1B's deferred receives hang (a rank sends before it
/// receives); ZB-V's come in another order than their peer's sends (its ranks send
/// activations and gradients over one edge); GPipe's do neither.
#[test]
fn a_schedule_that_hangs_is_left_out_of_a_comparison() {
    let dir = tempfile::tempdir().unwrap();
    let o = flatpipe(
        dir.path(),
        &[
            "simulate",
            "--costs",
            "f=1,b=2,w=0,comm=0.1",
            "--pp",
            "4",
            "--microbatches",
            "8",
            "--schedule",
            "gpipe,1f1b,zb-v",
            "--p2p-posting",
            "deferred",
            "--p2p-streams",
            "shared",
            "--gantt",
            "none",
        ],
    );
    assert!(o.status.success(), "{}", o.stderr);
    // GPipe's forwards all come before its backwards: no rank sends before it receives.
    assert!(
        o.stdout.lines().any(|l| l.starts_with("gpipe ")),
        "{}",
        o.stdout
    );
    // 1F1B's deferred receives on one stream: rank 1 sends before it receives (a hang);
    // ZB-V's deferred receives come in another order than the sends (refused).
    for (kind, why) in [
        ("1f1b", "hangs under its communication lowering"),
        ("zb-v", "posts its sends to rank 1 in another order"),
    ] {
        let shown = o
            .stdout
            .lines()
            .any(|l| l.starts_with(&format!("{kind} ")) && !l.contains("not shown"));
        assert!(!shown, "{}", o.stdout);
        assert!(
            o.stdout
                .lines()
                .any(|l| l.starts_with(&format!("{kind} not shown")) && l.contains(why)),
            "{}",
            o.stdout
        );
    }
}

/// A plan file's `lowering` runs as the same flags do, a field it leaves out keeps its
/// default, and a flag given on the command line replaces only its own field. The plan is
/// interleaved 1F1B at p = 4, v = 2, whose receives posted ahead on one shared stream hold
/// sends behind them (the case above), so the field read or not changes the step.
#[test]
fn a_plan_files_lowering_runs_as_the_flags_do() {
    let dir = tempfile::tempdir().unwrap();
    let plan = |lowering: &str| {
        format!(
            "model: llama3.1-8b\nhardware: h200\nworkload: sharegpt-v3\npp: 4\nvpp: 2\n\
             placement: loop\nschedule: interleaved-1f1b\nstages:\n  - {{start: 0, end: 5}}\n  \
             - {{start: 5, end: 9}}\n  - {{start: 9, end: 13}}\n  - {{start: 13, end: 17}}\n  \
             - {{start: 17, end: 21}}\n  - {{start: 21, end: 25}}\n  - {{start: 25, end: 29}}\n  \
             - {{start: 29, end: 34}}\nmicrobatches: 8\nseqs_per_step: 64\nseed: 3\n{lowering}"
        )
    };
    let write = |name: &str, lowering: &str| {
        std::fs::write(dir.path().join(name), plan(lowering)).unwrap();
    };
    write("plain.yaml", "");
    write("shared.yaml", "lowering: {streams: shared}\n");
    write(
        "deferred.yaml",
        "lowering: {posting: deferred, streams: per-peer}\n",
    );
    let mean_s = |args: &[&str]| {
        let mut all = vec!["simulate", "--format", "json", "--steps", "2"];
        all.extend_from_slice(args);
        let v = crate::cli::common::flatpipe_json(dir.path(), &all);
        v[0]["step_time_s"]["mean"]
            .as_f64()
            .unwrap_or_else(|| panic!("no step_time_s.mean in {v}"))
    };
    let default = mean_s(&["--plan", "plain.yaml"]);
    let shared = mean_s(&["--plan", "plain.yaml", "--p2p-streams", "shared"]);
    assert!(shared > default, "shared {shared} s, per-peer {default} s");
    assert_eq!(mean_s(&["--plan", "shared.yaml"]), shared);
    let deferred = mean_s(&["--plan", "plain.yaml", "--p2p-posting", "deferred"]);
    assert_eq!(mean_s(&["--plan", "deferred.yaml"]), deferred);
    // `--p2p-streams per-peer` replaces the file's shared streams: the default again.
    let overridden = mean_s(&["--plan", "shared.yaml", "--p2p-streams", "per-peer"]);
    assert_eq!(overridden, default);
    // An unknown field is named.
    write(
        "bad.yaml",
        "lowering: {posting: deferred, stream: shared}\n",
    );
    let o = flatpipe(dir.path(), &["simulate", "--plan", "bad.yaml"]);
    assert!(!o.status.success());
    assert!(o.stderr.contains("stream"), "{}", o.stderr);
}

/// FSDP's collectives as actions: with one stage per rank, 1F1B exposes both collectives
/// whole. Rank 0's all-gather (`ag`) precedes its first F, which every rank waits on; its
/// reduce-scatter (`rs`) follows its last B, the step's last compute: the step grows by
/// exactly ag + rs. With two stages per rank, the second stage's all-gather runs while the
/// first computes, so interleaved 1F1B grows by less. Without `--fsdp` the keys only warn; on
/// a profile `--fsdp` is refused (FSDP is still the sharding model's tail there).
#[test]
fn fsdp_collectives_run_as_actions_and_show_what_is_exposed() {
    let dir = tempfile::tempdir().unwrap();
    let makespans = |extra: &[&str]| -> Vec<(String, f64)> {
        let mut args = vec![
            "simulate",
            "--costs",
            "f=1,b=2,w=0,comm=0.1,ag=6,rs=6",
            "--pp",
            "4",
            "--microbatches",
            "8",
            "--schedule",
            "1f1b,interleaved-1f1b",
            "--gantt",
            "none",
            "--format",
            "json",
        ];
        args.extend(extra);
        let v = flatpipe(dir.path(), &args).json();
        v.as_array()
            .unwrap()
            .iter()
            .map(|r| {
                let name = r["schedule"].as_str().unwrap().to_string();
                (name, r["makespan_s"].as_f64().unwrap())
            })
            .collect()
    };
    let of = |rows: &[(String, f64)], k: &str| rows.iter().find(|r| r.0 == k).unwrap().1;
    let (plain, fsdp) = (makespans(&[]), makespans(&["--fsdp"]));
    assert!((of(&fsdp, "1f1b") - of(&plain, "1f1b") - 12.0).abs() < 1e-9);
    let grown = of(&fsdp, "interleaved-1f1b") - of(&plain, "interleaved-1f1b");
    assert!(grown > 0.0 && grown < 12.0, "{grown}");
    // Deferring the reduction's wait (defer_reduce_grad_wait) frees the interleaved rank's
    // other stage; with one stage per rank there is nothing else to free.
    let deferred = makespans(&["--fsdp", "--fsdp-defer-wait"]);
    assert!(of(&deferred, "interleaved-1f1b") < of(&fsdp, "interleaved-1f1b"));
    assert_eq!(of(&deferred, "1f1b"), of(&fsdp, "1f1b"));
    // On a profile, --fsdp needs a sharding that runs FSDP's per-stage collectives.
    let o = flatpipe(dir.path(), &["simulate", "--fsdp", "--gantt", "none"]);
    assert_eq!(o.status.code(), Some(2), "{}", o.stderr);
    assert!(
        o.stderr.contains("--sharding ddp with --dp 1 at pp 4"),
        "{}",
        o.stderr
    );
}

#[test]
fn fsdp_on_a_profile_runs_its_collectives_as_actions_in_place_of_the_tail() {
    // llama3.1-70b, tp 8 x dp 4 x pp 4 under FSDP on H200: the same step with FSDP's
    // collectives as the sharding model's tail (all-gather before the first forward, gradient
    // reduction after the last compute) and as per-stage actions on the collective streams.
    let dir = tempfile::tempdir().unwrap();
    let step_with = |sharding: &str, schedule: &str, extra: &[&str]| -> f64 {
        let mut args = vec![
            "simulate",
            "--model",
            "llama3.1-70b",
            "--tp",
            "8",
            "--pp",
            "4",
            "--dp",
            "4",
            "--sharding",
            sharding,
            "--schedule",
            schedule,
            "--gantt",
            "none",
            "--format",
            "json",
        ];
        args.extend(extra);
        flatpipe(dir.path(), &args).json()[0]["step_time_s"]["mean"]
            .as_f64()
            .unwrap()
    };
    let step = |schedule: &str, extra: &[&str]| step_with("fsdp", schedule, extra);
    // One stage per rank: the stage's all-gather is the rank's, its reduction follows the
    // rank's last backward, so the actions give the tail's closed form (to the ns of rounding);
    // so do DDP's all-reduce and ZeRO-1's reduce-scatter in REDUCE_GRAD's place.
    for sharding in ["fsdp", "ddp", "zero1"] {
        let tail = step_with(sharding, "1f1b", &[]);
        let actions = step_with(sharding, "1f1b", &["--fsdp"]);
        assert!(
            (tail - actions).abs() < 1e-8,
            "{sharding}: {tail} vs {actions}"
        );
    }
    // Two stages per rank: the first stage's reduction overlaps the other's last backwards,
    // which the tail (every reduction after the rank's last compute) cannot.
    let (tail, actions) = (
        step("interleaved-1f1b", &[]),
        step("interleaved-1f1b", &["--fsdp"]),
    );
    assert!(actions < tail, "{actions} vs {tail}");
}
