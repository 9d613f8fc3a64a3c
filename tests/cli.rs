//! End-to-end tests of the `flatpipe` command.

use serde_json::Value;
use std::path::Path;
use std::process::{Command, Output};

fn flatpipe(dir: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_flatpipe"))
        .args(args)
        .current_dir(dir)
        .output()
        .expect("run flatpipe")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn json(o: &Output) -> Value {
    assert!(
        o.status.success(),
        "exit {:?}: {}",
        o.status.code(),
        stderr(o)
    );
    serde_json::from_slice(&o.stdout).expect("JSON on stdout")
}

#[test]
fn default_simulate_compares_schedules_and_draws_the_best() {
    let dir = tempfile::tempdir().unwrap();
    let o = flatpipe(dir.path(), &["simulate"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.contains("llama3.1-8b") && out.contains("seed 0") && out.contains("128 sequences"),
        "{out}"
    );
    assert!(out.contains("1f1b") && out.contains("gpipe"), "{out}");
    let png = std::fs::read(dir.path().join("flatpipe-gantt.png")).unwrap();
    assert_eq!(&png[1..4], b"PNG");
}

#[test]
fn uniform_costs_json_matches_the_closed_form() {
    let dir = tempfile::tempdir().unwrap();
    let o = flatpipe(
        dir.path(),
        &[
            "simulate",
            "--costs",
            "f=1,b=1,w=1,comm=0",
            "--pp",
            "4",
            "--microbatches",
            "8",
            "--schedule",
            "1f1b,gpipe",
            "--format",
            "json",
            "--gantt",
            "g.svg",
            "--trace",
            "t.json",
        ],
    );
    let v = json(&o);
    let list = v.as_array().unwrap();
    assert_eq!(list.len(), 2);
    for r in list {
        // (m + p - 1)(f + b + w) = 11 * 3; bubble (p - 1) / (m + p - 1) = 3 / 11.
        assert_eq!(r["makespan_s"], 33.0);
        assert!((r["bubble_ratio"].as_f64().unwrap() - 3.0 / 11.0).abs() < 1e-12);
        assert_eq!(r["pp"], 4);
        assert_eq!(r["microbatches"], 8);
        let ranks = r["ranks"].as_array().unwrap();
        assert_eq!(ranks.len(), 4);
        assert!(ranks[0]["peak_activation_units"].is_number());
        assert!(ranks[0].get("peak_activation_bytes").is_none());
    }
    let one = list.iter().find(|r| r["schedule"] == "1f1b").unwrap();
    assert_eq!(one["ranks"][0]["peak_inflight_microbatches"], 4);
    assert_eq!(one["lower_bound_s"], 3.0 + 24.0);
    // The SVG and the trace exist, and the trace names actions in PyTorch notation.
    assert!(
        std::fs::read_to_string(dir.path().join("g.svg"))
            .unwrap()
            .starts_with("<svg")
    );
    assert!(dir.path().join("g-1f1b.svg").exists() && dir.path().join("g-gpipe.svg").exists());
    let trace: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("t.json")).unwrap()).unwrap();
    let names: Vec<&str> = trace["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|e| e["name"].as_str())
        .collect();
    assert!(names.contains(&"0F0") && names.contains(&"3B7") && names.contains(&"process_name"));
}

#[test]
fn costs_refuse_workload_options() {
    let dir = tempfile::tempdir().unwrap();
    for extra in [
        ["--workload", "sharegpt-v3"],
        ["--token-budget", "4096"],
        ["--seqs-per-step", "8"],
        ["--tokens-per-step", "9000"],
        ["--chunk-tokens", "4096"],
    ] {
        let mut args = vec!["simulate", "--costs", "f=1"];
        args.extend(extra);
        let o = flatpipe(dir.path(), &args);
        assert_eq!(o.status.code(), Some(2), "{extra:?}");
        assert!(stderr(&o).contains(extra[0]), "{}", stderr(&o));
    }
}

#[test]
fn bad_input_is_a_clear_error_with_exit_code_2() {
    let dir = tempfile::tempdir().unwrap();
    let cases: &[(&[&str], &str)] = &[
        (&["simulate", "--costs", "f=-1"], "0 or 1e-9"),
        (&["simulate", "--costs", "f=1", "--pp", "0"], "pp"),
        (&["simulate", "--pp", "0"], ">= 1 rank"),
        (&["simulate", "--pp", "40"], "34 layers"),
        (
            &["simulate", "--schedule", "zigzag"],
            "one of gpipe, 1f1b, interleaved-1f1b",
        ),
        (&["simulate", "--model", "gpt-9"], "llama3.1-8b"),
        (&["simulate", "--token-budget", "0"], "--token-budget"),
        (&["simulate", "--microbatches", "500"], "in 1..=128"),
        (&["simulate", "--gantt", "chart.jpg"], "svg or .png"),
        // A directory given for a file: said as such (it was "no such file").
        (&["simulate", "--workload", "."], "Is a directory"),
    ];
    for (args, needle) in cases {
        let o = flatpipe(dir.path(), args);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", stderr(&o));
        assert!(stderr(&o).contains(needle), "{args:?}: {}", stderr(&o));
        assert!(!stderr(&o).contains("panicked"), "{args:?}");
    }
}

#[test]
fn malformed_files_name_the_file_and_field() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("m.yaml"),
        "name: x\ndtype: bf16\nlayers: [\n",
    )
    .unwrap();
    let o = flatpipe(dir.path(), &["simulate", "--model", "m.yaml"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains("m.yaml: invalid YAML"),
        "{}",
        stderr(&o)
    );
    std::fs::write(dir.path().join("h.yaml"), "name: x\nmemory_bytes: 1\npeak_flops: -5\nhbm_bytes_per_s: 1\ngpus_per_node: 8\nintra_node: {alpha_s: 0, beta_bytes_per_s: 1}\ninter_node: {alpha_s: 0, beta_bytes_per_s: 1}\n").unwrap();
    let o = flatpipe(dir.path(), &["simulate", "--hardware", "h.yaml"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains("h.yaml: field `peak_flops` = -5"),
        "{}",
        stderr(&o)
    );
    std::fs::write(dir.path().join("w.csv"), "tokens\n100\n-3\n").unwrap();
    let o = flatpipe(dir.path(), &["simulate", "--workload", "w.csv"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains("w.csv") && stderr(&o).contains("row 3"),
        "{}",
        stderr(&o)
    );
}

const PLAN: &str = "model: llama3.1-8b
hardware: h200
workload: sharegpt-v3
pp: 2
placement: loop
schedule: 1f1b
stages:
  - {start: 0, end: 18}
  - {start: 18, end: 34}
microbatches: 8
seqs_per_step: 64
seed: 3
";

#[test]
fn plan_files_run_and_are_validated() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("plan.yaml"), PLAN).unwrap();
    let v = json(&flatpipe(
        dir.path(),
        &["simulate", "--plan", "plan.yaml", "--format", "json"],
    ));
    assert_eq!(v[0]["schedule"], "1f1b");
    assert_eq!(v[0]["pp"], 2);
    assert_eq!(v[0]["microbatches"], 8);
    assert!(v[0]["ranks"][1]["peak_activation_bytes"].as_f64().unwrap() > 0.0);
    // A gap in the layer ranges.
    std::fs::write(
        dir.path().join("bad.yaml"),
        PLAN.replace("{start: 18, end: 34}", "{start: 19, end: 34}"),
    )
    .unwrap();
    let o = flatpipe(dir.path(), &["simulate", "--plan", "bad.yaml"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains("bad.yaml: stages[1]") && stderr(&o).contains("must start at 18"),
        "{}",
        stderr(&o)
    );
    // --plan excludes the options it sets.
    let o = flatpipe(
        dir.path(),
        &["simulate", "--plan", "plan.yaml", "--pp", "4"],
    );
    assert_eq!(o.status.code(), Some(2));
}

#[test]
fn same_seed_same_output() {
    let dir = tempfile::tempdir().unwrap();
    let run = |seed: &str| {
        flatpipe(
            dir.path(),
            &[
                "simulate",
                "--workload",
                "sharegpt-v3-merged",
                "--seed",
                seed,
                "--format",
                "json",
            ],
        )
        .stdout
    };
    assert_eq!(run("7"), run("7"));
    assert_ne!(run("7"), run("8"));
}

#[test]
fn builtins_lists_every_name() {
    let dir = tempfile::tempdir().unwrap();
    let v = json(&flatpipe(dir.path(), &["builtins", "--format", "json"]));
    let names: Vec<&str> = v
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["name"].as_str().unwrap())
        .collect();
    for n in [
        "llama3.1-8b",
        "llama3.1-70b",
        "h200",
        "sharegpt-v3",
        "sharegpt-v3-merged",
        "llama3.1-8b@h200",
    ] {
        assert!(names.contains(&n), "{n} missing from {names:?}");
    }
}

#[test]
fn every_subcommand_has_help() {
    let dir = tempfile::tempdir().unwrap();
    for sub in [
        vec!["--help"],
        vec!["simulate", "--help"],
        vec!["builtins", "--help"],
    ] {
        let o = flatpipe(dir.path(), &sub);
        assert!(o.status.success());
        assert!(String::from_utf8_lossy(&o.stdout).contains("Usage"));
    }
}

#[test]
fn schedule_command_prints_the_grid_and_writes_csv() {
    let dir = tempfile::tempdir().unwrap();
    let o = flatpipe(
        dir.path(),
        &[
            "schedule",
            "--schedule",
            "1f1b",
            "--pp",
            "2",
            "--microbatches",
            "3",
            "-o",
            "order.csv",
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    // 1F1B, p = 2, m = 3 by hand: rank 0 warms up with one forward.
    assert!(out.contains("rank  0: 0F0 0F1 0B0 0F2 0B1 0B2"), "{out}");
    assert!(out.contains("rank  1: 1F0 1B0 1F1 1B1 1F2 1B2"), "{out}");
    let csv = std::fs::read_to_string(dir.path().join("order.csv")).unwrap();
    assert_eq!(csv, "0F0,0F1,0B0,0F2,0B1,0B2\n1F0,1B0,1F1,1B1,1F2,1B2\n");
    // The CSV simulates like the generated schedule: (m + p - 1)(f + b + w) = 4 * 3.
    let v = json(&flatpipe(
        dir.path(),
        &[
            "simulate",
            "--schedule-csv",
            "order.csv",
            "--costs",
            "f=1,b=1,w=1",
            "--format",
            "json",
        ],
    ));
    assert_eq!(v[0]["makespan_s"], 12.0);
    assert_eq!(v[0]["microbatches"], 3);
    // A broken file names the row and cell.
    std::fs::write(dir.path().join("bad.csv"), "0F0,0B0\n1F0,1Q0\n").unwrap();
    let o = flatpipe(
        dir.path(),
        &["simulate", "--schedule-csv", "bad.csv", "--costs", "f=1"],
    );
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("row 2, cell 2"), "{}", stderr(&o));
    // A CSV with a profile: the step is cut into the file's microbatch count.
    let v = json(&flatpipe(
        dir.path(),
        &[
            "simulate",
            "--schedule-csv",
            "order.csv",
            "--format",
            "json",
        ],
    ));
    assert_eq!(v[0]["microbatches"], 3);
    assert!(v[0]["ranks"][0]["static_bytes"].as_f64().unwrap() > 1e9);
}

#[test]
fn v_schedules_refuse_loop_placement_in_plans() {
    let dir = tempfile::tempdir().unwrap();
    let plan = PLAN.replace("schedule: 1f1b", "schedule: zb-v").replace(
        "  - {start: 0, end: 18}\n  - {start: 18, end: 34}\n",
        "  - {start: 0, end: 9}\n  - {start: 9, end: 18}\n  - {start: 18, end: 26}\n  - {start: 26, end: 34}\n",
    );
    std::fs::write(dir.path().join("v.yaml"), &plan).unwrap();
    let o = flatpipe(dir.path(), &["simulate", "--plan", "v.yaml"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains("placement") && stderr(&o).contains("zb-v uses v placement"),
        "{}",
        stderr(&o)
    );
    std::fs::write(
        dir.path().join("v.yaml"),
        plan.replace("placement: loop", "placement: v"),
    )
    .unwrap();
    let v = json(&flatpipe(
        dir.path(),
        &["simulate", "--plan", "v.yaml", "--format", "json"],
    ));
    assert_eq!(v[0]["vpp"], 2);
    // --vpp other than 2 for a V schedule is refused.
    let o = flatpipe(
        dir.path(),
        &["simulate", "--schedule", "dualpipev", "--vpp", "3"],
    );
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains("exactly 2 stages per rank"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn monte_carlo_reports_distributions_per_policy_and_capacity() {
    let dir = tempfile::tempdir().unwrap();
    let args = [
        "simulate",
        "--schedule",
        "1f1b,zb-h1",
        "--policy",
        "padded,packed,flat-ffd,flat-balanced",
        "--capacity",
        "dynamic,8",
        "--steps",
        "25",
        "--workload",
        "sharegpt-v3-merged",
        "--keep-prob",
        "0.7",
        "--format",
        "json",
        "--histogram",
        "h.svg",
    ];
    let o = flatpipe(dir.path(), &args);
    let v = json(&o);
    let rows = v.as_array().unwrap();
    assert_eq!(rows.len(), 2 * 4 * 2);
    for r in rows {
        for key in [
            "schedule",
            "policy",
            "capacity",
            "steps",
            "bubble_ratio_mean",
            "tokens_per_s",
            "padding_fraction",
            "peak_activation_bytes",
            "mfu",
        ] {
            assert!(r.get(key).is_some(), "{key} missing in {r}");
        }
        let q = &r["step_time_s"];
        let (mean, p50, p90, p99) = (
            q["mean"].as_f64().unwrap(),
            q["p50"].as_f64().unwrap(),
            q["p90"].as_f64().unwrap(),
            q["p99"].as_f64().unwrap(),
        );
        assert!(p50 <= p90 && p90 <= p99 && mean > 0.0);
        assert_eq!(r["steps"], 25);
        // Single-step fields only for one step.
        assert!(r.get("makespan_s").is_none());
        let pad = r["padding_fraction"].as_f64().unwrap();
        if r["policy"].as_str().unwrap().starts_with("flat") {
            assert_eq!(pad, 0.0);
        } else {
            assert!(pad > 0.0);
        }
    }
    // Sorted by mean step time.
    let means: Vec<f64> = rows
        .iter()
        .map(|r| r["step_time_s"]["mean"].as_f64().unwrap())
        .collect();
    assert!(means.windows(2).all(|w| w[0] <= w[1]));
    assert!(
        std::fs::read_to_string(dir.path().join("h.svg"))
            .unwrap()
            .contains("<svg")
    );
    // Byte-identical on a second run with the same seed.
    assert_eq!(flatpipe(dir.path(), &args).stdout, o.stdout);
    // The seed is printed.
    assert!(stderr(&o).contains("seed 0"), "{}", stderr(&o));
}

#[test]
fn costs_refuse_monte_carlo_options() {
    let dir = tempfile::tempdir().unwrap();
    let o = flatpipe(dir.path(), &["simulate", "--costs", "f=1", "--steps", "1"]);
    assert!(o.status.success(), "--steps 1 is one step: {}", stderr(&o));
    for extra in [
        ["--steps", "5"],
        ["--policy", "padded"],
        ["--capacity", "8"],
    ] {
        let mut args = vec!["simulate", "--costs", "f=1"];
        args.extend(extra);
        let o = flatpipe(dir.path(), &args);
        assert_eq!(o.status.code(), Some(2), "{extra:?}");
        assert!(stderr(&o).contains(extra[0]), "{}", stderr(&o));
    }
    for (args, needle) in [
        (
            vec!["simulate", "--policy", "squeezed"],
            "one of padded, packed",
        ),
        (vec!["simulate", "--capacity", "0"], "`dynamic` or a number"),
        (vec!["simulate", "--steps", "0"], "--steps"),
        (vec!["simulate", "--keep-prob", "1.5"], "keep_probability"),
    ] {
        let o = flatpipe(dir.path(), &args);
        assert_eq!(o.status.code(), Some(2), "{args:?}");
        assert!(stderr(&o).contains(needle), "{args:?}: {}", stderr(&o));
    }
}

#[test]
fn memory_timeline_csv_by_hand() {
    // 1F1B, p = 2, m = 2, f = b = w = 1 (B = 2): rank 0 runs F0 [0,1] F1 [1,2] B0 [4,6]
    // B1 [7,9]; rank 1 runs F0 [1,2] B0 [2,4] F1 [4,5] B1 [5,7]. One unit per microbatch,
    // allocated at an F's start and freed at its B's end.
    let dir = tempfile::tempdir().unwrap();
    let o = flatpipe(
        dir.path(),
        &[
            "simulate",
            "--costs",
            "f=1,b=1,w=1",
            "--pp",
            "2",
            "--microbatches",
            "2",
            "--schedule",
            "1f1b",
            "--memory",
            "m.csv",
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let csv = std::fs::read_to_string(dir.path().join("m.csv")).unwrap();
    assert_eq!(
        csv,
        "rank,time_s,activation_units\n0,0,0\n0,0,1\n0,1,2\n0,6,1\n0,9,0\n1,0,0\n1,1,1\n1,4,0\n1,4,1\n1,7,0\n"
    );
}

#[test]
fn plan_writes_a_plan_that_simulate_reproduces() {
    let dir = tempfile::tempdir().unwrap();
    let o = flatpipe(
        dir.path(),
        &[
            "plan",
            "--steps",
            "8",
            "--pp",
            "2,4",
            "--schedule",
            "1f1b,zb-h1",
            "--token-budgets",
            "8192,16384",
            "-o",
            "p.yaml",
            "--export",
            "megatron",
            "--format",
            "json",
        ],
    );
    let v = json(&o);
    let plans = v["plans"].as_array().unwrap();
    assert!(!plans.is_empty() && plans.len() <= 5);
    let predicted = v["chosen"]["predicted"]["step_time_mean_s"]
        .as_f64()
        .unwrap();
    assert_eq!(
        plans[0]["summary"]["step_time_s"]["mean"].as_f64().unwrap(),
        predicted
    );
    let text = std::fs::read_to_string(dir.path().join("p.yaml")).unwrap();
    assert!(
        text.contains("profile_sha256") && text.contains("workload_sha256"),
        "{text}"
    );
    let megatron = std::fs::read_to_string(dir.path().join("p.megatron.txt")).unwrap();
    assert!(
        megatron.contains("--pipeline-model-parallel-layout \"E"),
        "{megatron}"
    );
    // simulate --plan on the same steps gives the same mean.
    let s = json(&flatpipe(
        dir.path(),
        &[
            "simulate", "--plan", "p.yaml", "--steps", "8", "--format", "json",
        ],
    ));
    assert!((s[0]["step_time_s"]["mean"].as_f64().unwrap() - predicted).abs() < 1e-9);
}

#[test]
fn plan_that_cannot_fit_says_why() {
    let dir = tempfile::tempdir().unwrap();
    let o = flatpipe(
        dir.path(),
        &[
            "plan",
            "--steps",
            "2",
            "--memory-limit",
            "10GiB",
            "--schedule",
            "1f1b",
        ],
    );
    assert_eq!(o.status.code(), Some(2));
    let e = stderr(&o);
    assert!(
        e.contains("no plan fits") && e.contains("GiB") && e.contains("limit 10.0 GiB"),
        "{e}"
    );
    let o = flatpipe(dir.path(), &["plan", "--memory-limit", "lots"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains("--memory-limit `lots` is invalid"),
        "{}",
        stderr(&o)
    );
    let o = flatpipe(dir.path(), &["plan", "--ranks", "8", "--pp", "3"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains("a divisor of --ranks 8"),
        "{}",
        stderr(&o)
    );
}

fn repo_file(rel: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join(rel)
        .display()
        .to_string()
}

#[test]
fn execute_runs_the_shipped_plan_and_verifies_it() {
    let dir = tempfile::tempdir().unwrap();
    let plan = repo_file("examples/cpu-tiny/plan.yaml");
    let o = flatpipe(
        dir.path(),
        &[
            "execute",
            "--plan",
            &plan,
            "--steps",
            "1",
            "--seqs-per-step",
            "8",
            "--verify",
            "--gantt",
            "g.svg",
            "--trace",
            "t.json",
            "--format",
            "json",
        ],
    );
    let v = json(&o);
    assert_eq!(v["schedule"], "zb-h2");
    assert_eq!(v["pp"], 2);
    let step = &v["steps"][0];
    assert_eq!(step["verify"]["within_tolerance"], true, "{step}");
    assert!(step["verify"]["grad_max_rel_diff"].as_f64().unwrap() <= 1e-4);
    // The loss of random-ish tokens over a 4096-token vocabulary starts near ln(4096) = 8.32.
    let loss = step["loss"].as_f64().unwrap();
    assert!((loss - 4096f64.ln()).abs() < 0.5, "{loss}");
    assert!(step["measured_makespan_s"].as_f64().unwrap() > 0.0);
    // No measured profile: no prediction, and the output says so.
    assert!(step.get("predicted_makespan_s").is_none());
    assert!(
        stderr(&o).contains("No profile measured on the cpu backend"),
        "{}",
        stderr(&o)
    );
    let svg = std::fs::read_to_string(dir.path().join("g.svg")).unwrap();
    assert!(svg.contains("measured on cpu") && svg.contains("rank 1"));
    let trace: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("t.json")).unwrap()).unwrap();
    let names: Vec<&str> = trace["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|e| e["name"].as_str())
        .collect();
    // ZB-H2 runs separate I and W actions, and the last stage's first F is 1F0.
    assert!(names.iter().any(|n| n.starts_with("1I")), "{names:?}");
    assert!(names.iter().any(|n| n.starts_with("1W")), "{names:?}");
    assert!(names.contains(&"1F0"), "{names:?}");
}

#[test]
fn execute_takes_inline_options_like_simulate() {
    let dir = tempfile::tempdir().unwrap();
    let o = flatpipe(
        dir.path(),
        &[
            "execute",
            "--schedule",
            "zb-v",
            "--pp",
            "2",
            "--microbatches",
            "3",
            "--seqs-per-step",
            "6",
            "--steps",
            "2",
            "--format",
            "json",
        ],
    );
    let v = json(&o);
    assert_eq!(v["schedule"], "zb-v");
    assert_eq!(v["vpp"], 2);
    let steps = v["steps"].as_array().unwrap();
    assert_eq!(steps.len(), 2);
    for s in steps {
        assert_eq!(s["microbatches"], serde_json::json!([3]));
        let b = s["bubble_ratio"].as_f64().unwrap();
        assert!((0.0..1.0).contains(&b), "{b}");
    }
}

#[test]
fn execute_refuses_impossible_requests_clearly() {
    let dir = tempfile::tempdir().unwrap();
    // tiny has 10 layers: 12 stages cannot each hold one.
    let o = flatpipe(dir.path(), &["execute", "--pp", "12", "--steps", "1"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("12"), "{}", stderr(&o));
    // More microbatches than sequences.
    let o = flatpipe(
        dir.path(),
        &[
            "execute",
            "--microbatches",
            "9",
            "--seqs-per-step",
            "4",
            "--steps",
            "1",
        ],
    );
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("--microbatches"), "{}", stderr(&o));
    // A padded plan: the executor runs flat microbatches only.
    let plan = std::fs::read_to_string(repo_file("examples/cpu-tiny/plan.yaml"))
        .unwrap()
        .replace("policy: flat-ffd", "policy: padded");
    std::fs::write(dir.path().join("p.yaml"), plan).unwrap();
    let o = flatpipe(dir.path(), &["execute", "--plan", "p.yaml", "--steps", "1"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("flat"), "{}", stderr(&o));
}

#[test]
fn execute_compares_with_a_profile_measured_on_its_backend() {
    use flatpipe::profiles::{AnalyticOptions, ProfileSource, analytic_profile, builtins};
    let dir = tempfile::tempdir().unwrap();
    // Stand-in for a profiler output: the analytic tiny@cpu profile marked as measured on a CPU.
    let model = builtins::model("tiny").unwrap();
    let hw = builtins::hardware("cpu").unwrap();
    let mut p = analytic_profile(&model, &hw, &AnalyticOptions::default()).unwrap();
    p.provenance.source = ProfileSource::Measured;
    p.provenance.device = "test CPU".into();
    p.provenance.date = Some("2026-11-30".into());
    std::fs::write(dir.path().join("measured.yaml"), p.to_yaml().unwrap()).unwrap();
    let o = flatpipe(
        dir.path(),
        &[
            "execute",
            "--profile",
            "measured.yaml",
            "--pp",
            "2",
            "--microbatches",
            "2",
            "--seqs-per-step",
            "4",
            "--steps",
            "2",
            "--format",
            "json",
        ],
    );
    let v = json(&o);
    let mut errs = Vec::new();
    for s in v["steps"].as_array().unwrap() {
        let (pred, meas) = (
            s["predicted_makespan_s"].as_f64().unwrap(),
            s["measured_makespan_s"].as_f64().unwrap(),
        );
        assert!(pred > 0.0 && meas > 0.0);
        let e = s["rel_error"].as_f64().unwrap();
        assert!((e - (pred - meas) / meas).abs() < 1e-9);
        errs.push(e.abs());
    }
    errs.sort_by(f64::total_cmp);
    // Median of two values: nearest rank (the smaller).
    let m = v["median_abs_rel_error"].as_f64().unwrap();
    assert!(errs.contains(&m), "{m} {errs:?}");
}

/// A model small enough to profile in a test.
const SMALL_MODEL: &str = "name: small\ndtype: fp32\nlayers:\n  - {kind: embedding, vocab: 64, hidden: 32}\n  - {kind: decoder, count: 4, hidden: 32, ffn: 64, heads: 4, kv_heads: 2}\n  - {kind: head, vocab: 64, hidden: 32}\n";

#[test]
fn a_profile_written_by_the_profiler_drives_simulate_plan_and_execute() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("small.yaml"), SMALL_MODEL).unwrap();
    let o = flatpipe(
        dir.path(),
        &[
            "-v",
            "profile",
            "--model",
            "small.yaml",
            "--quick",
            "-o",
            "p.yaml",
            "--format",
            "json",
        ],
    );
    let v = json(&o);
    // Not on a terminal (the bar draws nothing there): one progress line per measurement, 33 of
    // them: 3 layer kinds x 5 token counts x 2 compositions, the link, the optimizer, and the
    // GEMMs split 2 ways (2 divides the 2 key/value heads, 4 does not).
    let err = stderr(&o);
    let lines: Vec<&str> = err
        .lines()
        .filter(|l| l.starts_with("profiling "))
        .collect();
    assert_eq!(lines.len(), 33, "{err}");
    // With -v, each grid point's medians: 3 kinds x 5 token counts x 2 compositions.
    assert_eq!(err.matches("ms per layer").count(), 30, "{err}");
    for (k, l) in lines.iter().enumerate() {
        assert!(l.starts_with(&format!("profiling {}/33 at ", k + 1)), "{l}");
    }
    // F, I, W, Fo for each of the three layer kinds, all non-negative, W without attention.
    let fits = v["fits"].as_array().unwrap();
    assert_eq!(fits.len(), 12);
    for f in fits {
        for k in ["c0_s", "c_tok_s", "c_attn_s"] {
            assert!(f[k].as_f64().unwrap() >= 0.0, "{f}");
        }
        if f["phase"] == "W" {
            assert_eq!(f["c_attn_s"].as_f64().unwrap(), 0.0);
        }
    }
    let text = std::fs::read_to_string(dir.path().join("p.yaml")).unwrap();
    let p = flatpipe::profiles::Profile::from_yaml(&text, "p.yaml").unwrap();
    assert_eq!(
        p.provenance.source,
        flatpipe::profiles::ProfileSource::Measured
    );
    assert!(
        p.provenance.device.starts_with("cpu"),
        "{}",
        p.provenance.device
    );
    assert!(p.provenance.date.is_some() && p.provenance.grid.is_some());
    assert_eq!(p.provenance.fits.len(), 12);
    assert_eq!(p.layers.len(), 6);
    // The GEMMs split the ways tensor parallelism may split them: 4 heads and 2 key-value
    // heads allow tp = 2 only; measured at the grid's largest T, and applied by the split.
    let grid = flatpipe::executor::profiler::ProfileConfig::quick().tokens;
    assert_eq!(p.gemm_split.len(), 1, "{:?}", p.gemm_split);
    let g = p.gemm_split[0];
    assert_eq!((g.tp, g.tokens), (2, *grid.iter().max().unwrap() as u64));
    assert!(g.relative_throughput > 0.0 && g.relative_throughput <= 2.0);
    let tp2 = p.tensor_parallel(2, true).unwrap();
    assert!(
        tp2.provenance
            .notes
            .contains("of the unsplit throughput (measured")
    );
    // FLOPs (and MFU) come from true tokens and pairs: the model's counts, not the timings.
    let small = flatpipe::profiles::ModelSpec::from_yaml(SMALL_MODEL, "small").unwrap();
    let analytic = flatpipe::profiles::analytic_profile(
        &small,
        &flatpipe::profiles::builtins::hardware("cpu").unwrap(),
        &Default::default(),
    )
    .unwrap();
    assert_eq!(
        p.model_flops(1000.0, 5000.0),
        analytic.model_flops(1000.0, 5000.0)
    );
    // It drives simulate and plan ...
    let o = flatpipe(
        dir.path(),
        &[
            "simulate",
            "--profile",
            "p.yaml",
            "--workload",
            "tiny-chat",
            "--schedule",
            "1f1b",
            "--pp",
            "2",
            "--token-budget",
            "512",
            "--format",
            "json",
        ],
    );
    let s = json(&o);
    assert!(s[0]["step_time_s"]["mean"].as_f64().unwrap() > 0.0, "{s}");
    let o = flatpipe(
        dir.path(),
        &[
            "plan",
            "--profile",
            "p.yaml",
            "--workload",
            "tiny-chat",
            "--ranks",
            "2",
            "--recompute",
            "none",
            "--steps",
            "4",
            "--token-budgets",
            "512",
            // The executor runs unsharded replicas: plan what it runs.
            "--sharding",
            "ddp",
            "-o",
            "plan.yaml",
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    // ... and execute predicts with it (measured on this backend): the plan names the profile,
    // whose model is a file, so give the architecture with the plan's model field.
    let plan = std::fs::read_to_string(dir.path().join("plan.yaml"))
        .unwrap()
        .replace("profile: p.yaml", "profile: p.yaml\nmodel: small.yaml");
    std::fs::write(dir.path().join("plan.yaml"), plan).unwrap();
    let o = flatpipe(
        dir.path(),
        &[
            "execute",
            "--plan",
            "plan.yaml",
            "--steps",
            "2",
            "--seqs-per-step",
            "8",
            "--format",
            "json",
        ],
    );
    let v = json(&o);
    assert!(v["median_abs_rel_error"].as_f64().is_some(), "{v}");
    // The profile was measured with one thread busy; the plan runs two ranks at once where
    // there are two cores: said before the prediction is trusted.
    assert_eq!(p.provenance.concurrency, Some(1));
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let warned = v["profile_warnings"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|w| {
            w.as_str()
                .unwrap_or_default()
                .contains("measured with 1 thread(s) busy at once, this run keeps 2 busy")
        });
    assert_eq!(warned, cores >= 2, "{v}");
}

#[test]
fn calibrate_closes_the_loop() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("small.yaml"), SMALL_MODEL).unwrap();
    let o = flatpipe(
        dir.path(),
        &[
            "calibrate",
            "--model",
            "small.yaml",
            "--quick",
            "--pp",
            "2",
            "--schedule",
            "1f1b,zb-v",
            "--steps",
            "2",
            "--format",
            "json",
        ],
    );
    let v = json(&o);
    let rows = v["schedules"].as_array().unwrap();
    assert_eq!(rows.len(), 2);
    for r in rows {
        let (p, m) = (
            r["predicted_makespan_s"].as_f64().unwrap(),
            r["measured_makespan_s"].as_f64().unwrap(),
        );
        assert!(p > 0.0 && m > 0.0);
        assert!((r["rel_error"].as_f64().unwrap() - (p - m) / m).abs() < 1e-9);
        assert_eq!(r["measured_bubble_per_rank"].as_array().unwrap().len(), 2);
    }
    assert_eq!(rows[1]["schedule"], "zb-v");
    assert!(v["median_abs_rel_error"].as_f64().unwrap() >= 0.0);
}

#[test]
fn calibrate_refuses_schedules_side_by_side_the_host_cannot_hold() {
    // Llama-3.1-70B on the CPU backend: 70.6 G parameters x 16 bytes of fp32 weights,
    // gradients and AdamW state is 1.1 TB per executor, and `--order interleaved` builds one
    // per schedule before it runs them step by step. Refused before profiling or allocating.
    let dir = tempfile::tempdir().unwrap();
    let o = flatpipe(
        dir.path(),
        &[
            "calibrate",
            "--model",
            "llama3.1-70b",
            "--schedule",
            "1f1b,zb-v",
            "--quick",
            "--order",
            "interleaved",
        ],
    );
    assert!(!o.status.success());
    let e = stderr(&o);
    assert!(
        e.contains("calibrate of llama3.1-70b over 2 schedules is too large")
            && e.contains("2 executor(s) at once")
            && e.contains("70553706496 parameters x 16 bytes")
            && e.contains("--schedule"),
        "{e}"
    );
}

#[test]
fn import_trace_reads_a_hand_written_kineto_trace() {
    // tests/data/pp_trace_1f1b_p2_m3.json: 1F1B, p = 2, m = 3, F = 10 us, B = 20 us, 2 us between
    // ranks, times laid out by hand: rank 0 runs 0F0 0F1 0B0 0F2 0B1 0B2, rank 1 1F0 1B0 1F1 1B1
    // 1F2 1B2; the last op, 0B2, ends at 128 us. Both ranks are busy 90 us: bubble 1 - 90/128.
    // GPU-side annotations are used; the CPU-side copies (other times) are ignored.
    let dir = tempfile::tempdir().unwrap();
    let trace = repo_file("tests/data/pp_trace_1f1b_p2_m3.json");
    let o = flatpipe(
        dir.path(),
        &[
            "import-trace",
            &trace,
            "--gantt",
            "trace.svg",
            "--format",
            "json",
        ],
    );
    let v = json(&o);
    assert_eq!(v["ranks"], 2);
    assert_eq!(v["stages"], 2);
    assert_eq!(v["microbatches"], 3);
    assert!((v["measured_makespan_s"].as_f64().unwrap() - 128e-6).abs() < 1e-12);
    for r in v["per_rank"].as_array().unwrap() {
        let b = r["measured_bubble_ratio"].as_f64().unwrap();
        assert!((b - (1.0 - 90.0 / 128.0)).abs() < 1e-9, "{b}");
        assert_eq!(r["actions"], 6);
    }
    assert!(v.get("predicted_makespan_s").is_none());
    assert!(
        std::fs::read_to_string(dir.path().join("trace.svg"))
            .unwrap()
            .contains("imported trace")
    );
    // With a profile: flatpipe's prediction of the schedule the trace ran.
    let o = flatpipe(
        dir.path(),
        &[
            "import-trace",
            &trace,
            "--model",
            "tiny",
            "--hardware",
            "cpu",
            "--tokens-per-microbatch",
            "256",
            "--format",
            "json",
        ],
    );
    let v = json(&o);
    let p = v["predicted_makespan_s"].as_f64().unwrap();
    assert!(p > 0.0);
    let m = v["measured_makespan_s"].as_f64().unwrap();
    assert!((v["rel_error"].as_f64().unwrap() - (p - m) / m).abs() < 1e-9);
    assert!(
        v["per_rank"][0]["predicted_bubble_ratio"]
            .as_f64()
            .is_some()
    );
    // Not a trace: a clear error naming the file.
    std::fs::write(dir.path().join("bad.json"), "{\"traceEvents\": []}").unwrap();
    let o = flatpipe(dir.path(), &["import-trace", "bad.json"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains("bad.json") && stderr(&o).contains("PP:"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn zb_auto_and_forward_only_work_from_the_command_line() {
    let dir = tempfile::tempdir().unwrap();
    // 2p units, m >= 2p - 1, b <= 2w, b <= 2f: the lower bound (p - 1) f + m (f + b + w) = 27.
    let o = flatpipe(
        dir.path(),
        &[
            "simulate",
            "--costs",
            "f=1,b=1,w=1,comm=0",
            "--pp",
            "4",
            "--microbatches",
            "8",
            "--schedule",
            "zb-auto",
            "--max-activation-units",
            "8",
            "--format",
            "json",
        ],
    );
    let v = json(&o);
    assert_eq!(v[0]["schedule"], "zb-auto");
    assert_eq!(v[0]["makespan_s"].as_f64().unwrap(), 27.0);
    // Too little memory: a clear error with the numbers.
    let o = flatpipe(
        dir.path(),
        &[
            "simulate",
            "--costs",
            "f=1,b=1,w=1,comm=0",
            "--schedule",
            "zb-auto",
            "--max-activation-units",
            "0.5",
        ],
    );
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains("0.50 units") && stderr(&o).contains("at least 1.00 units"),
        "{}",
        stderr(&o)
    );
    // Forward-only work: 1F1B p = 4, m = 8, f = b = w = 1; 4 Fo of 0.5 fit in 1F1B's bubbles.
    // The separate pass alone: (K + p - 1) fo = 3.5 s.
    let o = flatpipe(
        dir.path(),
        &[
            "simulate",
            "--costs",
            "f=1,b=1,w=1,comm=0,fo=0.5",
            "--pp",
            "4",
            "--microbatches",
            "8",
            "--schedule",
            "1f1b",
            "--fo-microbatches",
            "4",
            "--format",
            "json",
        ],
    );
    let v = json(&o);
    assert_eq!(v[0]["fo_separate_s"].as_f64().unwrap(), 3.5);
    assert_eq!(v[0]["train_only_s"].as_f64().unwrap(), 33.0);
    let hidden = v[0]["fo_hidden_fraction"].as_f64().unwrap();
    let t = v[0]["makespan_s"].as_f64().unwrap();
    assert!(
        (hidden - (33.0 + 3.5 - t) / 3.5).abs() < 1e-12 && hidden > 0.5,
        "{hidden}"
    );
    // Fo is refused in PyTorch's CSV unless asked for.
    let o = flatpipe(
        dir.path(),
        &[
            "schedule",
            "--schedule",
            "1f1b",
            "--pp",
            "2",
            "--microbatches",
            "2",
            "--fo-microbatches",
            "2",
            "-o",
            "s.csv",
        ],
    );
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("--fo-extension"), "{}", stderr(&o));
    let o = flatpipe(
        dir.path(),
        &[
            "schedule",
            "--schedule",
            "1f1b",
            "--pp",
            "2",
            "--microbatches",
            "2",
            "--fo-microbatches",
            "2",
            "--fo-extension",
            "-o",
            "s.csv",
        ],
    );
    assert!(o.status.success());
    assert!(
        std::fs::read_to_string(dir.path().join("s.csv"))
            .unwrap()
            .contains("1Fo1")
    );
}

#[test]
fn the_cuda_backend_without_a_gpu_is_a_clear_error_and_auto_falls_back() {
    let dir = tempfile::tempdir().unwrap();
    let o = flatpipe(
        dir.path(),
        &[
            "execute",
            "--backend",
            "cuda",
            "--steps",
            "1",
            "--seqs-per-step",
            "4",
        ],
    );
    let e = stderr(&o);
    assert!(!e.contains("panicked"), "{e}");
    let gpu_here = o.status.success();
    if !gpu_here {
        // No driver, no device or no NVRTC here (CI): the reason, and what to use instead.
        assert_eq!(o.status.code(), Some(2));
        assert!(
            e.contains("--backend cuda: CUDA is not usable here") && e.contains("--backend cpu"),
            "{e}"
        );
    }
    // auto takes the GPU when there is one, else the CPU and says why.
    let o = flatpipe(
        dir.path(),
        &[
            "execute",
            "--backend",
            "auto",
            "--steps",
            "1",
            "--seqs-per-step",
            "4",
            "--format",
            "json",
        ],
    );
    let v = json(&o);
    if gpu_here {
        assert_eq!(v["backend"], "cuda (fp32 GEMMs)");
    } else {
        assert_eq!(v["backend"], "cpu");
        assert!(stderr(&o).contains("--backend auto"), "{}", stderr(&o));
    }
    // GPU-only options on the CPU backend are refused with the reason.
    for (args, needle) in [
        (
            vec!["execute", "--precision", "bf16", "--steps", "1"],
            "--precision = bf16 is invalid: bf16 runs only on the cuda backend",
        ),
        (
            vec!["execute", "--init-on-device", "--steps", "1"],
            "--init-on-device = true is invalid: drawing weights on the device needs the cuda backend",
        ),
        (
            vec!["profile", "--precision", "bf16", "--quick"],
            "--precision = bf16 is invalid: bf16 runs only on the cuda backend",
        ),
        (
            vec!["execute", "--gpus", "2", "--steps", "1"],
            "--gpus = 2 is invalid: more than 1 GPU needs the cuda backend",
        ),
        (
            vec!["calibrate", "--precision", "bf16", "--quick"],
            "--precision = bf16 is invalid: bf16 runs only on the cuda backend",
        ),
        (
            vec!["execute", "--backend", "cuda", "--gpus", "0"],
            "--gpus",
        ),
    ] {
        let o = flatpipe(dir.path(), &args);
        assert_eq!(o.status.code(), Some(2), "{args:?}");
        assert!(stderr(&o).contains(needle), "{args:?}: {}", stderr(&o));
    }
}

#[test]
fn more_forward_only_than_training_microbatches_and_bad_options_are_handled() {
    let dir = tempfile::tempdir().unwrap();
    // K = 20 forward-only microbatches against 12 training ones (profile mode): no panic.
    let o = flatpipe(
        dir.path(),
        &[
            "simulate",
            "--schedule",
            "1f1b",
            "--fo-microbatches",
            "20",
            "--format",
            "json",
        ],
    );
    let v = json(&o);
    assert!(v[0]["fo_separate_s"].as_f64().unwrap() > 0.0);
    for (args, needle) in [
        (vec!["execute", "--lr", "nan", "--steps", "1"], "--lr"),
        (
            vec!["execute", "--max-grad-norm=-1", "--steps", "1"],
            "--max-grad-norm",
        ),
        (
            vec![
                "execute",
                "--vpp",
                "3",
                "--schedule",
                "1f1b",
                "--steps",
                "1",
            ],
            "--vpp",
        ),
        (
            vec!["execute", "--fo-loss-dependency", "--steps", "1"],
            "--fo-microbatches",
        ),
        (
            vec!["execute", "--steps", "1", "--gantt", "no/such/dir/g.png"],
            "does not exist",
        ),
        (
            vec![
                "simulate",
                "--schedule",
                "zb-auto",
                "--memory-limit",
                "20GiB",
            ],
            "--memory-limit",
        ),
    ] {
        let o = flatpipe(dir.path(), &args);
        assert_eq!(o.status.code(), Some(2), "{args:?}");
        assert!(stderr(&o).contains(needle), "{args:?}: {}", stderr(&o));
        assert!(!stderr(&o).contains("panicked"), "{args:?}");
    }
}

#[test]
fn a_plan_carries_its_forward_only_work_to_simulate_and_execute() {
    let dir = tempfile::tempdir().unwrap();
    let o = flatpipe(
        dir.path(),
        &[
            "plan",
            "--model",
            "tiny",
            "--hardware",
            "cpu",
            "--workload",
            "tiny-chat",
            "--ranks",
            "2",
            "--pp",
            "2",
            "--recompute",
            "none",
            "--token-budgets",
            "256",
            "--steps",
            "4",
            "--fo-microbatches",
            "same",
            "--fo-loss-dependency",
            "-o",
            "p.yaml",
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let text = std::fs::read_to_string(dir.path().join("p.yaml")).unwrap();
    assert!(
        text.contains("forward_only") && text.contains("loss_dependency: true"),
        "{text}"
    );
    let o = flatpipe(
        dir.path(),
        &["simulate", "--plan", "p.yaml", "--format", "json"],
    );
    let v = json(&o);
    assert!(v[0]["fo_separate_s"].as_f64().unwrap() > 0.0, "{v}");
    let o = flatpipe(
        dir.path(),
        &[
            "execute",
            "--plan",
            "p.yaml",
            "--steps",
            "1",
            "--seqs-per-step",
            "12",
            "--verify",
            "--format",
            "json",
        ],
    );
    let v = json(&o);
    let s = &v["steps"][0];
    // `same`: one forward-only microbatch per training microbatch.
    assert_eq!(s["fo_microbatches"], s["microbatches"][0]);
    assert_eq!(s["verify"]["within_tolerance"], true);
}

#[test]
fn model_with_profile_must_be_the_profiles_model() {
    let dir = tempfile::tempdir().unwrap();
    let ok = flatpipe(
        dir.path(),
        &[
            "simulate",
            "--profile",
            "llama3.1-8b@h200",
            "--model",
            "llama3.1-8b",
            "--schedule",
            "1f1b",
            "--format",
            "json",
        ],
    );
    assert!(ok.status.success(), "{}", stderr(&ok));
    let o = flatpipe(
        dir.path(),
        &[
            "simulate",
            "--profile",
            "llama3.1-8b@h200",
            "--model",
            "tiny",
            "--schedule",
            "1f1b",
        ],
    );
    assert_eq!(o.status.code(), Some(2));
    let e = stderr(&o);
    assert!(
        e.contains("--model tiny is model tiny with 10 layers")
            && e.contains("is of model llama3.1-8b with 34 layers"),
        "{e}"
    );
}

#[test]
fn warmup_steps_run_before_the_reported_ones_and_are_not_reported() {
    let dir = tempfile::tempdir().unwrap();
    let run = |warmup: &str| {
        let o = flatpipe(
            dir.path(),
            &[
                "execute",
                "--steps",
                "1",
                "--warmup-steps",
                warmup,
                "--seqs-per-step",
                "4",
                "--verify",
                "--format",
                "json",
            ],
        );
        assert!(o.status.success(), "{}", stderr(&o));
        json(&o)
    };
    let (cold, warm) = (run("0"), run("1"));
    for v in [&cold, &warm] {
        assert_eq!(v["steps"].as_array().unwrap().len(), 1);
        assert_eq!(v["steps"][0]["step"], 0);
    }
    // The same step 0 (same tokens), after one AdamW update of the weights: another loss, and
    // the reference still agrees.
    assert_eq!(cold["steps"][0]["tokens"], warm["steps"][0]["tokens"]);
    assert_ne!(cold["steps"][0]["loss"], warm["steps"][0]["loss"]);
    assert_eq!(warm["steps"][0]["verify"]["within_tolerance"], true);
}

/// A reader that stops early (`flatpipe schedule --format json | head -1`) ends the command
/// quietly with exit 0, not a panic (exit 101) on the closed pipe.
#[test]
fn closed_stdout_is_not_a_panic() {
    use std::io::{BufRead, BufReader};
    use std::process::Stdio;
    let dir = tempfile::tempdir().unwrap();
    // Far more than a pipe's 64 KiB buffer.
    let mut child = Command::new(env!("CARGO_BIN_EXE_flatpipe"))
        .args([
            "schedule",
            "--schedule",
            "1f1b",
            "--pp",
            "8",
            "--microbatches",
            "2048",
            "--format",
            "json",
        ])
        .current_dir(dir.path())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut first)
        .unwrap();
    assert!(first.starts_with('{'), "{first}");
    // The read end is dropped here: the rest of the output meets a closed pipe.
    let out = child.wait_with_output().unwrap();
    let err = stderr(&out);
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(out.status.code(), Some(0), "{err}");
}

/// `simulate` checks every row against the per-rank memory (the hardware's memory less its
/// reserve by default): on the default step GPipe and looped BFS keep all 12 microbatches'
/// activations on rank 0 (they exceed an H200), 1F1B at most p = 4 (it fits); the table marks
/// the rows that do not fit and by how much, and the JSON says `fits`.
#[test]
fn simulate_marks_rows_that_do_not_fit_memory() {
    let dir = tempfile::tempdir().unwrap();
    let o = flatpipe(
        dir.path(),
        &["simulate", "--format", "json", "--gantt", "g.png"],
    );
    let rows = json(&o);
    let rows = rows.as_array().expect("rows");
    let row = |name: &str| {
        rows.iter()
            .find(|r| r["schedule"] == name)
            .unwrap_or_else(|| panic!("no {name} row"))
    };
    let limit = row("gpipe")["memory_limit_bytes"].as_f64().unwrap();
    // 143,771 MiB less 4 GiB, the H200 default.
    assert_eq!(limit, 143_771.0 * 1024.0 * 1024.0 - 4.0 * 1024f64.powi(3));
    for r in rows {
        let need = r["peak_memory_bytes"].as_f64().unwrap();
        let stat = r["static_bytes"].as_f64().unwrap();
        let act = r["peak_activation_bytes"].as_f64().unwrap();
        // One rank's total: at least its largest part, at most the two largest added.
        assert!(need >= stat.max(act) && need <= stat + act + 1.0, "{r}");
        assert_eq!(r["fits"].as_bool().unwrap(), need <= limit, "{r}");
    }
    assert!(!row("gpipe")["fits"].as_bool().unwrap());
    assert!(row("1f1b")["fits"].as_bool().unwrap());
    let table = flatpipe(dir.path(), &["simulate", "--gantt", "g.png"]);
    let out = String::from_utf8_lossy(&table.stdout);
    let gpipe = out
        .lines()
        .find(|l| l.split_whitespace().next() == Some("gpipe"))
        .unwrap();
    assert!(gpipe.contains("OVER by"), "{gpipe}");
    assert!(out.contains("does not fit 136.40 GiB per rank"), "{out}");
}

/// Llama-3.1-70B on 4 H200: a rank's parameters, gradients and optimizer state (270.66 GiB)
/// exceed the 136.40 GiB per rank, so zb-auto cannot be built; the comparison still shows every
/// other schedule (each marked as not fitting) and says why zb-auto is missing, without
/// blaming a --memory-limit the user never set.
#[test]
fn a_schedule_that_cannot_be_built_does_not_abort_the_comparison() {
    let dir = tempfile::tempdir().unwrap();
    let o = flatpipe(
        dir.path(),
        &[
            "simulate",
            "--model",
            "llama3.1-70b",
            "--workload",
            "sharegpt-v3-merged",
            "--seed",
            "3",
        ],
    );
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}\n{out}", stderr(&o));
    assert!(
        out.contains("zb-auto not built") && out.contains("memory less its reserve"),
        "{out}"
    );
    // The flag the user never typed is not named as the culprit, and the note on the rows
    // over the limit does not claim that the missing zb-auto was built under it.
    assert!(!out.contains("--memory-limit ="), "{out}");
    assert!(!out.contains("zb-auto is built under the limit"), "{out}");
    for kind in ["1f1b", "gpipe", "zb-h1", "zb-v", "dualpipev"] {
        let row = out
            .lines()
            .find(|l| l.split_whitespace().next() == Some(kind))
            .unwrap_or_else(|| panic!("{kind}: {out}"));
        assert!(row.contains("OVER by"), "{row}");
    }
}

/// A request whose schedules cannot fit in memory is refused before anything is allocated,
/// with the estimate: 4,000,000,000 microbatches on 4 ranks are 1.6e10 (stage, microbatch)
/// pairs for 1F1B alone, terabytes at ~1.2 kB each.
#[test]
fn schedules_too_large_for_memory_are_refused_up_front() {
    let dir = tempfile::tempdir().unwrap();
    for args in [
        &[
            "schedule",
            "--schedule",
            "1f1b",
            "--pp",
            "4",
            "--microbatches",
            "4000000000",
        ][..],
        &[
            "simulate",
            "--costs",
            "f=1,b=2",
            "--schedule",
            "1f1b",
            "--pp",
            "4",
            "--microbatches",
            "4000000000",
        ][..],
        &[
            "simulate",
            "--schedule",
            "1f1b",
            "--pp",
            "4",
            "--microbatches",
            "4000000000",
        ][..],
    ] {
        let o = flatpipe(dir.path(), args);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert!(
            err.contains("too large") && err.contains("16000000000 (stage, microbatch) pairs"),
            "{args:?}: {err}"
        );
    }
}

/// A Monte Carlo or plan search too large for memory is refused before it samples anything,
/// with an estimate no smaller than a closed-form floor: 4e9 steps of 9 schedules on 4 ranks
/// keep at least 4e9 x 9 x 4 x 8 bytes of per-rank memory figures (1,073 GiB); the planner
/// keeps 4e9 sampled steps of 128 four-byte lengths (1,907 GiB); one step of 4e9 sequences
/// holds at least its 4e9 four-byte lengths (14.9 GiB). Each ran until killed before.
#[test]
fn monte_carlo_runs_too_large_for_memory_are_refused_up_front() {
    let dir = tempfile::tempdir().unwrap();
    for (args, floor_gib) in [
        (
            &["simulate", "--steps", "4000000000", "--gantt", "none"][..],
            4e9 * 9.0 * 4.0 * 8.0 / 2f64.powi(30),
        ),
        (
            &["plan", "--steps", "4000000000", "--gantt", "none"][..],
            4e9 * 128.0 * 4.0 / 2f64.powi(30),
        ),
        (
            &[
                "simulate",
                "--seqs-per-step",
                "4000000000",
                "--steps",
                "1",
                "--gantt",
                "none",
            ][..],
            4e9 * 4.0 / 2f64.powi(30),
        ),
    ] {
        let o = flatpipe(dir.path(), args);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        let gib: f64 = err
            .split("estimated to hold ")
            .nth(1)
            .and_then(|t| t.split(" GiB").next())
            .and_then(|t| t.parse().ok())
            .unwrap_or_else(|| panic!("{args:?}: {err}"));
        assert!(
            err.contains("too large") && gib >= floor_gib,
            "{args:?}: {err}"
        );
    }
}

/// A bad output path is refused before the work starts (no plan half-written, exit 2 naming
/// the path); `--gantt none` switches the chart off.
#[test]
fn output_paths_are_checked_first_and_charts_can_be_switched_off() {
    let dir = tempfile::tempdir().unwrap();
    let o = flatpipe(
        dir.path(),
        &[
            "plan",
            "--gantt",
            "missing/g.png",
            "-o",
            "plan.yaml",
            "--steps",
            "4",
        ],
    );
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("missing/g.png"), "{}", stderr(&o));
    assert!(!dir.path().join("plan.yaml").exists());
    assert!(o.stdout.is_empty());
    let o = flatpipe(dir.path(), &["simulate", "--gantt", "none"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!dir.path().join("flatpipe-gantt.png").exists());
    assert!(!String::from_utf8_lossy(&o.stdout).contains("Gantt chart"));
    let o = flatpipe(dir.path(), &["plan", "--gantt", "none", "--steps", "4"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!dir.path().join("flatpipe-plan.png").exists());
}

/// `plan` says when sequences are longer than the chosen token budget: with every sequence
/// 5,000 tokens and budgets of 4,096 only, all 4 steps x 16 sequences are.
#[test]
fn plan_says_when_sequences_exceed_the_token_budget() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("w.yaml"),
        "name: long\nlengths: {kind: fixed, tokens: 5000}\nseqs_per_step: 16\n",
    )
    .unwrap();
    let o = flatpipe(
        dir.path(),
        &[
            "plan",
            "--workload",
            "w.yaml",
            "--token-budgets",
            "4096",
            "--steps",
            "4",
            "--pp",
            "2",
            "--gantt",
            "none",
        ],
    );
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        out.contains(
            "64 of the 64 sampled sequences are longer than the chosen token budget of 4096"
        ),
        "{out}"
    );
}

/// pp = 1 is one candidate, "no pipeline", not one row per pipeline schedule with equal times.
#[test]
fn plan_counts_pp_1_once() {
    let dir = tempfile::tempdir().unwrap();
    let args = [
        "plan",
        "--model",
        "tiny",
        "--hardware",
        "cpu",
        "--workload",
        "tiny-chat",
        "--ranks",
        "2",
        "--pp",
        "1",
        "--tp",
        "1",
        "--token-budgets",
        "4096",
        "--steps",
        "4",
        "--keep",
        "20",
        "--gantt",
        "none",
    ];
    let mut json_args = args.to_vec();
    json_args.extend(["--format", "json"]);
    let doc = json(&flatpipe(dir.path(), &json_args));
    let plans = doc["plans"].as_array().unwrap();
    // Once per data-parallel sharding mode searched by default (ddp, zero1, fsdp; hsdp is fsdp
    // on one node), not once per schedule.
    let mut modes: Vec<&str> = plans
        .iter()
        .map(|p| p["sharding"].as_str().unwrap())
        .collect();
    modes.sort();
    assert_eq!(modes, ["ddp", "fsdp", "zero1"], "{doc}");
    assert!(plans.iter().all(|p| p["pp"] == 1), "{doc}");
    let table = flatpipe(dir.path(), &args);
    let out = String::from_utf8_lossy(&table.stdout);
    assert!(out.contains("no pipeline"), "{out}");
    // The chosen line says the same as its row (it said "chosen: 1f1b").
    assert!(out.contains("chosen: no pipeline dp=2 pp=1"), "{out}");
}

/// A data-parallel degree larger than a step's sequence count drops only those candidates,
/// with the reason: 3 sequences per step on 4 ranks leave dp = 4 (pp = 1) replicas empty.
#[test]
fn plan_drops_replicas_without_sequences() {
    let dir = tempfile::tempdir().unwrap();
    let doc = json(&flatpipe(
        dir.path(),
        &[
            "plan",
            "--ranks",
            "4",
            "--seqs-per-step",
            "3",
            "--steps",
            "4",
            "--gantt",
            "none",
            "--format",
            "json",
        ],
    ));
    let rejected = doc["rejected"].as_array().unwrap();
    let r = rejected
        .iter()
        .find(|r| r["candidate"] == "dp=4 pp=1")
        .unwrap_or_else(|| panic!("{doc}"));
    assert!(
        r["reason"].as_str().unwrap().contains("only 3 sequence(s)"),
        "{r}"
    );
    assert!(doc["chosen"]["dp"].as_u64().unwrap() <= 3, "{doc}");
}

/// `execute` refuses, before allocating, a model the host cannot hold, with the numbers: a
/// 70.6-billion-parameter model needs 16 bytes per parameter (fp32 weights, gradients, AdamW's
/// two moments) = 1,051 GiB before any activation, more than any test machine has.
#[test]
fn execute_refuses_a_model_the_host_cannot_hold() {
    let dir = tempfile::tempdir().unwrap();
    let started = std::time::Instant::now();
    let o = flatpipe(
        dir.path(),
        &["execute", "--model", "llama3.1-70b", "--steps", "1"],
    );
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    let err = stderr(&o);
    // Llama-3.1-70B's parameters from its architecture (Meta's config: 80 layers, hidden 8192,
    // FFN 28672, 64 query and 8 KV heads of 128, vocabulary 128256, untied embedding and head).
    let (h, ffn, kv, vocab) = (8192f64, 28672f64, 1024f64, 128256f64);
    let per_layer = h * (h + 2.0 * kv) + h * h + 3.0 * h * ffn + 2.0 * h;
    let params = 2.0 * vocab * h + h + 80.0 * per_layer;
    let state_gib = params * 16.0 / (1u64 << 30) as f64;
    assert!(
        err.contains(&format!("{state_gib:.2} GiB of fp32 weights")),
        "{err}"
    );
    assert!(err.contains("available"), "{err}");
    // Refused before building the stages (which would take minutes and the machine's memory).
    assert!(started.elapsed().as_secs() < 60);
}

/// One default microbatch count, p·v, for every multi-stage schedule: interleaved-1f1b at pp 4
/// (v = 2) runs 8 microbatches; fewer than p warns with 1F1B's bubble bound
/// (p - 1)/(m + p - 1) = 3/5 at p = 4, m = 2.
#[test]
fn default_microbatches_fill_every_stage_and_fewer_warn() {
    let dir = tempfile::tempdir().unwrap();
    let base = [
        "simulate",
        "--costs",
        "f=1,b=2",
        "--schedule",
        "interleaved-1f1b",
        "--pp",
        "4",
        "--gantt",
        "none",
        "--format",
        "json",
    ];
    let doc = json(&flatpipe(dir.path(), &base));
    assert_eq!(doc[0]["microbatches"], 8, "{doc}");
    let mut args = base.to_vec();
    args.extend(["--microbatches", "2"]);
    let o = flatpipe(dir.path(), &args);
    assert!(o.status.success());
    assert!(stderr(&o).contains("= 60%"), "{}", stderr(&o));
    args.pop();
    args.push("6");
    let o = flatpipe(dir.path(), &args);
    assert!(stderr(&o).contains("< p·v = 8 stages"), "{}", stderr(&o));
    let o = flatpipe(
        dir.path(),
        &[
            "schedule",
            "--schedule",
            "1f1b",
            "--pp",
            "4",
            "--microbatches",
            "3",
        ],
    );
    assert!(stderr(&o).contains("< pp = 4 ranks"), "{}", stderr(&o));
}

/// `execute` says when sequences are longer than the token budget (each runs alone).
#[test]
fn execute_notes_sequences_longer_than_the_budget() {
    let dir = tempfile::tempdir().unwrap();
    let o = flatpipe(
        dir.path(),
        &[
            "execute",
            "--token-budget",
            "64",
            "--steps",
            "1",
            "--pp",
            "2",
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    let line = out
        .lines()
        .find(|l| l.contains("longer than the token budget of 64 tokens"))
        .unwrap_or_else(|| panic!("{out}"));
    let longest: u64 = line
        .split("the longest ")
        .nth(1)
        .and_then(|r| r.split(')').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{line}"));
    assert!(longest > 64, "{line}");
}

/// A step that runs several rounds of a fixed-capacity schedule gets a chart of all its rounds,
/// and the command says so (it used to skip the chart without a word).
#[test]
fn multi_round_steps_are_charted_and_said() {
    let dir = tempfile::tempdir().unwrap();
    let o = flatpipe(
        dir.path(),
        &[
            "simulate",
            "--steps",
            "1",
            "--schedule",
            "1f1b",
            "--capacity",
            "4",
            "--gantt",
            "g.svg",
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.contains("rounds of its fixed-capacity schedule"),
        "{out}"
    );
    let svg = std::fs::read_to_string(dir.path().join("g.svg")).unwrap();
    assert!(svg.contains("rounds of the 4-microbatch schedule"));
}

/// A zb-auto that cannot be built for one sampled step (a microbatch whose activations exceed
/// what the memory limit leaves) drops zb-auto from the comparison with the reason; the other
/// schedules are still shown. 3,000 steps of the default workload reach such a step.
#[test]
fn a_zb_auto_step_that_cannot_be_built_does_not_abort_the_comparison() {
    let dir = tempfile::tempdir().unwrap();
    let o = flatpipe(
        dir.path(),
        &["simulate", "--steps", "3000", "--gantt", "none"],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("zb-auto not built"), "{out}");
    assert!(
        out.contains("GiB of activations") && out.contains("one microbatch's activations"),
        "{out}"
    );
    assert!(out.contains("1f1b"), "{out}");
}

/// On a terminal, work longer than a second shows a progress bar on stderr; into a pipe, none.
/// The terminal is a pseudo-terminal from util-linux's `script` (on every Debian machine);
/// where `script` is missing the test says so and returns.
#[test]
fn progress_bars_show_on_a_terminal_only() {
    let dir = tempfile::tempdir().unwrap();
    let bin = env!("CARGO_BIN_EXE_flatpipe");
    let cmd = format!("{bin} simulate --steps 20000 --gantt none");
    let Ok(o) = Command::new("script")
        .args(["-qec", &cmd, "/dev/null"])
        .current_dir(dir.path())
        .output()
    else {
        eprintln!("skipped: util-linux `script` (a pseudo-terminal) is not installed");
        return;
    };
    let tty = String::from_utf8_lossy(&o.stdout);
    assert!(
        tty.contains("/20000 steps"),
        "no progress bar on the terminal: {tty}"
    );
    let piped = flatpipe(
        dir.path(),
        &["simulate", "--steps", "20000", "--gantt", "none"],
    );
    assert!(piped.status.success());
    assert!(
        !stderr(&piped).contains("/20000 steps"),
        "{}",
        stderr(&piped)
    );
}

/// Absurd sequence lengths are refused at the workload, naming the field and the range (a
/// 4e9-token sequence used to run, wrapping the attention-pair sums and printing nonsense
/// MFU); 2^24 tokens is the cap.
#[test]
fn absurd_sequence_lengths_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("huge.yaml"),
        "name: huge\nlengths:\n  kind: fixed\n  tokens: 4000000000\nseqs_per_step: 4\n",
    )
    .unwrap();
    std::fs::write(dir.path().join("huge.csv"), "tokens\n12\n16777217\n").unwrap();
    for (file, field) in [("huge.yaml", "lengths.tokens"), ("huge.csv", "row 3")] {
        let o = flatpipe(
            dir.path(),
            &[
                "simulate",
                "--workload",
                file,
                "--steps",
                "2",
                "--gantt",
                "none",
            ],
        );
        assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
        let err = stderr(&o);
        assert!(err.contains(field) && err.contains("16777216"), "{err}");
    }
}

/// A bad chart format is found before the work: nothing is written (plan used to write the plan
/// and its exports, then fail on the chart's extension).
#[test]
fn a_bad_chart_format_fails_before_any_output() {
    let dir = tempfile::tempdir().unwrap();
    let o = flatpipe(
        dir.path(),
        &[
            "plan",
            "-o",
            "p.yaml",
            "--export",
            "torchtitan",
            "--gantt",
            "g.jpg",
        ],
    );
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("jpg"), "{}", stderr(&o));
    let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
    assert!(left.is_empty(), "{left:?}");
    let o = flatpipe(
        dir.path(),
        &[
            "simulate",
            "--gantt",
            "g.png",
            "--memory",
            "m.csv",
            "--histogram",
            "noext",
        ],
    );
    assert_eq!(o.status.code(), Some(2));
    assert!(std::fs::read_dir(dir.path()).unwrap().next().is_none());
    let o = flatpipe(dir.path(), &["plan", "--vpp", "0"]);
    assert_eq!(o.status.code(), Some(2));
}

/// The README's first two outputs are what `plan` and `simulate` print on the embedded
/// defaults, line for line (the chart lines aside): plain columns a user can copy, no box
/// borders (the commands drew them, the README did not).
#[test]
fn the_readme_shows_what_plan_and_simulate_print() {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md"))
        .expect("README.md");
    let mut blocks = readme.split("```text\n").skip(1).map(|b| {
        b.split("\n```")
            .next()
            .unwrap_or_default()
            .lines()
            .filter(|l| !l.starts_with("Gantt chart"))
            .map(|l| l.trim_end().to_string())
            .collect::<Vec<_>>()
    });
    let dir = tempfile::tempdir().unwrap();
    for cmd in ["plan", "simulate"] {
        let want = blocks.next().expect("a text block per command");
        let o = flatpipe(dir.path(), &[cmd, "--gantt", "none"]);
        assert!(o.status.success(), "{cmd}: {}", stderr(&o));
        let stdout = String::from_utf8_lossy(&o.stdout);
        assert!(
            !stdout.lines().any(|l| l.ends_with(' ')),
            "{cmd}: trailing spaces"
        );
        let got: Vec<String> = stdout.lines().map(str::to_string).collect();
        assert_eq!(got, want, "{cmd}");
    }
}

/// `execute --gantt none` means no chart, as in the other commands (it was taken for a file
/// name without an extension and refused); a step too small for the default microbatch count
/// says that the count is the default p·v and what to give instead (it named a
/// `--microbatches = 2` the user never typed).
#[test]
fn execute_takes_gantt_none_and_explains_its_default_microbatches() {
    let dir = tempfile::tempdir().unwrap();
    let base = [
        "execute",
        "--model",
        "tiny",
        "--hardware",
        "cpu",
        "--workload",
        "tiny-chat",
        "--steps",
        "1",
        "--gantt",
        "none",
    ];
    let o = flatpipe(dir.path(), &base);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!dir.path().join("none").exists());
    let mut args = base.to_vec();
    args.extend(["--tokens-per-step", "1"]);
    let o = flatpipe(dir.path(), &args);
    assert_eq!(o.status.code(), Some(2));
    let err = stderr(&o);
    assert!(
        err.contains("default of pp x vpp = 2 microbatches") && err.contains("--token-budget"),
        "{err}"
    );
}

/// The libraries name what they check in their own words (a plan file's keys, such as
/// `token_budget`), never a command-line flag a plan file's user never typed; the command line
/// maps those fields to its flags when it prints an error (`--token-budget = 0 is invalid`).
#[test]
fn library_errors_name_fields_and_the_command_line_names_flags() {
    let root = env!("CARGO_MANIFEST_DIR");
    for dir in [
        "simulator/src",
        "planner/src",
        "executor/src",
        "profiles/src",
    ] {
        for entry in std::fs::read_dir(format!("{root}/{dir}")).unwrap() {
            let path = entry.unwrap().path();
            // Megatron's flags are the subject of the Megatron export, not ours.
            if path.extension().is_none_or(|e| e != "rs") || path.ends_with("export.rs") {
                continue;
            }
            let text = std::fs::read_to_string(&path).unwrap();
            for (i, line) in text.lines().enumerate() {
                let l = line.trim_start();
                assert!(
                    !(l.contains("invalid(\"--") || l.starts_with("\"--") && !l.starts_with("///")),
                    "{}:{}: a library error names a flag: {line}",
                    path.display(),
                    i + 1
                );
            }
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let o = flatpipe(dir.path(), &["simulate", "--token-budget", "0"]);
    assert!(
        stderr(&o).contains("--token-budget = 0 is invalid"),
        "{}",
        stderr(&o)
    );
    let o = flatpipe(dir.path(), &["simulate", "--costs", "f=1,b=x"]);
    assert!(
        stderr(&o).contains("--costs b = x is invalid"),
        "{}",
        stderr(&o)
    );
}

/// Found by a fresh user's try-out: a message that lists `all` while refusing it; `--costs`
/// values whose nanoseconds overflow (f = 1e10 s gave a 98.9% bubble) or round to zero; an
/// `execute` of a billion sequences per step that sampled until it ran out of memory.
#[test]
fn try_out_findings_are_refused_with_the_numbers() {
    let dir = tempfile::tempdir().unwrap();
    let cases: &[(&[&str], &[&str])] = &[
        (
            &[
                "schedule",
                "--schedule",
                "all",
                "--pp",
                "4",
                "--microbatches",
                "8",
            ],
            &["one of gpipe"],
        ),
        (
            &[
                "simulate",
                "--costs",
                "f=1e10,b=1e10,w=1e10",
                "--pp",
                "4",
                "--microbatches",
                "8",
                "--schedule",
                "1f1b",
            ],
            &["--costs f", "1e10", "1000000"],
        ),
        (
            &["simulate", "--costs", "f=1e-10", "--schedule", "1f1b"],
            &["--costs f", "1 ns"],
        ),
        // Each cost in range, but 64 x 100 x 3e6 s = 1.92e10 s of work overflows the clock.
        (
            &[
                "simulate",
                "--costs",
                "f=1e6,b=1e6,w=1e6",
                "--schedule",
                "1f1b",
                "--pp",
                "64",
                "--microbatches",
                "100",
            ],
            &["1.920e10 s", "range of 1e10 s"],
        ),
        // Forward-only work counts too: 4 x 20,000 x 1e6 s of Fo (it costs f by default).
        (
            &[
                "simulate",
                "--costs",
                "f=1e6",
                "--schedule",
                "1f1b",
                "--pp",
                "4",
                "--microbatches",
                "8",
                "--fo-microbatches",
                "20000",
            ],
            &["range of 1e10 s", "20000 forward-only"],
        ),
        (
            &[
                "execute",
                "--model",
                "tiny",
                "--hardware",
                "cpu",
                "--workload",
                "tiny-chat",
                "--seqs-per-step",
                "4000000000",
                "--steps",
                "1",
            ],
            &["too large", "GiB"],
        ),
    ];
    for (args, needles) in cases {
        let o = flatpipe(dir.path(), args);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        for n in *needles {
            assert!(err.contains(n), "{args:?}: {err}");
        }
        assert!(!err.contains("or all"), "{args:?}: {err}");
    }
}

/// `plan --export pytorch-csv > schedule.csv` without `-o` is a usable file: the export alone
/// on stdout, the table and notes on stderr (they were mixed, and `simulate --schedule-csv`
/// refused the table's first line as an action).
#[test]
fn an_export_without_output_file_is_alone_on_stdout() {
    let dir = tempfile::tempdir().unwrap();
    let o = flatpipe(
        dir.path(),
        &[
            "plan",
            "--pp",
            "4",
            "--schedule",
            "1f1b",
            "--steps",
            "2",
            "--export",
            "pytorch-csv",
            "--gantt",
            "none",
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("chosen: 1f1b"), "{}", stderr(&o));
    let csv = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(!csv.contains("chosen"), "{csv}");
    std::fs::write(dir.path().join("s.csv"), &csv).unwrap();
    let o = flatpipe(
        dir.path(),
        &[
            "simulate",
            "--schedule-csv",
            "s.csv",
            "--costs",
            "f=1,b=1,w=1",
            "--gantt",
            "none",
        ],
    );
    assert!(o.status.success(), "{}\n{csv}", stderr(&o));
}

/// With a profile too, `simulate` says when the steps leave the pipeline under-filled (it only
/// did with --costs): two microbatches on four ranks.
#[test]
fn simulate_warns_of_an_underfilled_pipeline_with_a_profile() {
    let dir = tempfile::tempdir().unwrap();
    let o = flatpipe(
        dir.path(),
        &[
            "simulate",
            "--microbatches",
            "2",
            "--schedule",
            "1f1b",
            "--gantt",
            "none",
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("m = 2 microbatches < pp = 4 ranks"),
        "{}",
        stderr(&o)
    );
}

/// When no plan fits because the static state alone cannot fit even over the most pipeline
/// ranks, that leads the message, with the closed form: Llama-3.1-70B's parameters (counted
/// from the architecture) x 16 bytes / 2 ranks.
#[test]
fn no_plan_fits_leads_with_the_static_state() {
    let dir = tempfile::tempdir().unwrap();
    let o = flatpipe(
        dir.path(),
        &[
            "plan",
            "--model",
            "llama3.1-70b",
            "--ranks",
            "2",
            "--gantt",
            "none",
        ],
    );
    assert_eq!(o.status.code(), Some(2));
    let err = stderr(&o);
    let m = flatpipe::profiles::builtins::model("llama3.1-70b").unwrap();
    let params: f64 = m.layers().iter().map(|l| l.param_count() as f64).sum();
    // The least any layout holds: no pipeline, FSDP over both ranks, 16/2 bytes per parameter
    // (fp32 shards of weights, gradients and AdamW's two moments).
    let want = format!("{:.1} GiB", params * 16.0 / 2.0 / 2f64.powi(30));
    assert!(
        err.contains("no plan fits: parameters, gradients and optimizer state alone need at least")
            && err.contains(&want),
        "{want}: {err}"
    );
}

/// A memory limit above the device's memory is accepted (a what-if) but said.
#[test]
fn a_memory_limit_above_the_device_is_said() {
    let dir = tempfile::tempdir().unwrap();
    let o = flatpipe(
        dir.path(),
        &[
            "simulate",
            "--memory-limit",
            "10TB",
            "--steps",
            "1",
            "--gantt",
            "none",
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let err = stderr(&o);
    assert_eq!(
        err.matches("is more than NVIDIA H200 SXM's").count(),
        1,
        "{err}"
    );
}

/// `simulate --plan` compares its run with what the plan file predicted (the same steps give
/// the same mean, +0.0%) and says when the plan was made on another profile (its SHA-256
/// differs): before, an edited plan ran silently.
#[test]
fn simulate_plan_compares_with_the_prediction_and_checks_provenance() {
    let dir = tempfile::tempdir().unwrap();
    let base = [
        "--model",
        "tiny",
        "--hardware",
        "cpu",
        "--workload",
        "tiny-chat",
    ];
    let mut args = vec!["plan", "--ranks", "2", "--steps", "4", "--gantt", "none"];
    args.extend(base);
    args.extend(["-o", "p.yaml"]);
    let o = flatpipe(dir.path(), &args);
    assert!(o.status.success(), "{}", stderr(&o));
    let run = |plan: &str| {
        let o = flatpipe(
            dir.path(),
            &[
                "simulate", "--plan", plan, "--steps", "4", "--gantt", "none",
            ],
        );
        assert!(o.status.success(), "{}", stderr(&o));
        (String::from_utf8_lossy(&o.stdout).into_owned(), stderr(&o))
    };
    let (out, err) = run("p.yaml");
    assert!(
        out.contains("the plan predicted a mean step of") && out.contains("(+0.0%)"),
        "{out}"
    );
    assert!(!err.contains("another profile"), "{err}");
    let text = std::fs::read_to_string(dir.path().join("p.yaml")).unwrap();
    assert!(text.contains("hardware: cpu"), "{text}");
    std::fs::write(
        dir.path().join("q.yaml"),
        text.replace("hardware: cpu", "hardware: h200"),
    )
    .unwrap();
    let (_, err) = run("q.yaml");
    assert!(
        err.contains("the plan was made on another profile"),
        "{err}"
    );
    // The policy is a typed field: a wrong one is refused where the file says it.
    std::fs::write(
        dir.path().join("z.yaml"),
        text.replace("policy: flat-ffd", "policy: zigzag"),
    )
    .unwrap();
    let o = flatpipe(dir.path(), &["simulate", "--plan", "z.yaml"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains("z.yaml") && stderr(&o).contains("`zigzag`, expected one of"),
        "{}",
        stderr(&o)
    );
}

/// A chosen plan within 2% of the memory limit on the sampled steps says so (zb-auto fills the
/// limit by construction); a 1F1B plan (well under the limit) does not. The note's figures are
/// the table's.
#[test]
fn plan_notes_a_chosen_plan_without_memory_margin() {
    let dir = tempfile::tempdir().unwrap();
    let o = flatpipe(
        dir.path(),
        &[
            "plan",
            "--schedule",
            "zb-auto",
            "--pp",
            "2,4,8",
            "--tp",
            "1",
            "--gantt",
            "none",
            // Chunked long sequences give a faster zb-auto plan with room to spare (100 of
            // 136 GiB); unchunked, zb-auto fills the limit.
            "--no-chunk",
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    let line = out
        .lines()
        .find(|l| l.starts_with("the chosen plan's busiest rank needs"))
        .unwrap_or_else(|| panic!("{out}"));
    let num = |t: &str| -> f64 {
        t.trim_matches(|c: char| !c.is_ascii_digit() && c != '.')
            .parse()
            .unwrap()
    };
    let words: Vec<&str> = line.split_whitespace().collect();
    let (need, limit) = (num(words[6]), num(words[10]));
    let pct = num(words[13]);
    assert!(
        (pct - 100.0 * need / limit).abs() < 0.06 && pct > 98.0,
        "{line}"
    );
    // The table's first row: "135.0 / 136.4 GiB".
    let row = out.lines().find(|l| l.starts_with("1 ")).unwrap();
    let (before, after) = row.split_once(" / ").unwrap();
    let table_need = num(before.split_whitespace().last().unwrap());
    let table_limit = num(after.split_whitespace().next().unwrap());
    assert!(
        (need - table_need).abs() < 0.06 && (limit - table_limit).abs() < 0.06,
        "{line} / {row}"
    );
    let o = flatpipe(
        dir.path(),
        &["plan", "--schedule", "1f1b", "--gantt", "none"],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!String::from_utf8_lossy(&o.stdout).contains("busiest rank needs"));
}

/// The step size is resolved one way everywhere: a flag overrides the plan file's size
/// (`simulate --plan` with --tokens-per-step kept the plan's seqs_per_step, execute did not).
#[test]
fn a_step_size_flag_overrides_the_plan_file() {
    let dir = tempfile::tempdir().unwrap();
    let o = flatpipe(
        dir.path(),
        &[
            "plan",
            "--model",
            "tiny",
            "--hardware",
            "cpu",
            "--workload",
            "tiny-chat",
            "--ranks",
            "2",
            "--steps",
            "2",
            "--seqs-per-step",
            "8",
            "--gantt",
            "none",
            "-o",
            "p.yaml",
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let header = |extra: &[&str]| {
        let mut args = vec!["simulate", "--plan", "p.yaml", "--gantt", "none"];
        args.extend(extra);
        let o = flatpipe(dir.path(), &args);
        assert!(o.status.success(), "{}", stderr(&o));
        String::from_utf8_lossy(&o.stdout)
            .lines()
            .next()
            .unwrap()
            .to_string()
    };
    assert!(header(&[]).contains("(step 0: 8)"), "{}", header(&[]));
    // 20,000 tokens of tiny-chat's short sequences are many more than 8 sequences.
    let h = header(&["--tokens-per-step", "20000"]);
    let n0: usize = h
        .split("(step 0: ")
        .nth(1)
        .and_then(|t| t.split(')').next())
        .and_then(|t| t.parse().ok())
        .unwrap_or_else(|| panic!("{h}"));
    assert!(n0 > 8, "{h}");
}

/// `simulate --plan` checks its rows against the memory limit the plan was searched under
/// (the one zb-auto is built under), not the hardware's default, unless --memory-limit says
/// otherwise.
#[test]
fn simulate_plan_checks_rows_against_the_plans_memory_limit() {
    let dir = tempfile::tempdir().unwrap();
    let o = flatpipe(
        dir.path(),
        &[
            "plan",
            "--memory-limit",
            "100GiB",
            "--steps",
            "4",
            "--gantt",
            "none",
            "-o",
            "p.yaml",
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let limit = |extra: &[&str]| {
        let mut args = vec![
            "simulate", "--plan", "p.yaml", "--gantt", "none", "--format", "json",
        ];
        args.extend(extra);
        let doc = json(&flatpipe(dir.path(), &args));
        doc[0]["memory_limit_bytes"].as_f64().unwrap()
    };
    assert_eq!(limit(&[]), 100.0 * 2f64.powi(30));
    assert_eq!(limit(&["--memory-limit", "120GiB"]), 120.0 * 2f64.powi(30));
}

/// The note on execute's default microbatch count is added only to the refusal of that count:
/// too few sequences for the replicas is said as such.
#[test]
fn execute_blames_its_default_microbatches_only_when_they_are_the_cause() {
    let dir = tempfile::tempdir().unwrap();
    let o = flatpipe(
        dir.path(),
        &[
            "execute",
            "--model",
            "tiny",
            "--hardware",
            "cpu",
            "--workload",
            "tiny-chat",
            "--dp",
            "4",
            "--seqs-per-step",
            "2",
            "--steps",
            "1",
        ],
    );
    assert_eq!(o.status.code(), Some(2));
    let err = stderr(&o);
    assert!(err.contains("too few for dp = 4"), "{err}");
    assert!(!err.contains("the default of pp x vpp"), "{err}");
}

#[test]
fn a_plan_with_selective_recomputation_executes_and_verifies() {
    // The CPU executor used to refuse selective recomputation, which `plan` may choose.
    let dir = tempfile::tempdir().unwrap();
    let o = flatpipe(
        dir.path(),
        &[
            "plan",
            "--model",
            "tiny",
            "--hardware",
            "cpu",
            "--workload",
            "tiny-chat",
            "--ranks",
            "2",
            "--pp",
            "2",
            "--schedule",
            "zb-h1",
            "--recompute",
            "none",
            "--token-budgets",
            "512",
            "-o",
            "none.yaml",
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let plan = std::fs::read_to_string(dir.path().join("none.yaml")).unwrap();
    assert!(plan.contains("recompute:\n- none\n- none"), "{plan}");
    std::fs::write(
        dir.path().join("selective.yaml"),
        plan.replace("- none", "- selective"),
    )
    .unwrap();
    let o = flatpipe(
        dir.path(),
        &[
            "execute",
            "--plan",
            "selective.yaml",
            "--steps",
            "1",
            "--verify",
            "--format",
            "json",
        ],
    );
    let v = json(&o);
    let step = &v["steps"][0];
    assert!(
        step["microbatches"][0].as_u64().unwrap() >= 2,
        "several microbatches in flight: {step}"
    );
    assert_eq!(step["verify"]["within_tolerance"], true, "{step}");
    assert!(step["verify"]["grad_max_rel_diff"].as_f64().unwrap() <= 1e-4);
}

/// `plan` compares the chosen plan with the no-pipeline FSDP run a torchtitan user starts from
/// (in words and in JSON), and `--sharding` refuses an unknown mode naming the flag and the
/// allowed values.
#[test]
fn plan_compares_with_the_no_pipeline_fsdp_run() {
    let dir = tempfile::tempdir().unwrap();
    let args = [
        "plan",
        "--model",
        "tiny",
        "--hardware",
        "cpu",
        "--workload",
        "tiny-chat",
        "--ranks",
        "2",
        "--pp",
        "2",
        "--token-budgets",
        "4096",
        "--steps",
        "4",
        "--gantt",
        "none",
    ];
    let o = flatpipe(dir.path(), &args);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    let line = out
        .lines()
        .find(|l| l.starts_with("Against the no-pipeline FSDP configuration"))
        .unwrap_or_else(|| panic!("{out}"));
    assert!(line.contains("pp=1") && line.contains("fsdp"), "{line}");
    let mut json_args = args.to_vec();
    json_args.extend(["--format", "json"]);
    let doc = json(&flatpipe(dir.path(), &json_args));
    let base = &doc["fsdp_baseline"];
    let chosen = doc["plans"][0]["summary"]["step_time_s"]["mean"]
        .as_f64()
        .unwrap();
    let t = base["mean_s"].as_f64().unwrap();
    let change = base["chosen_vs_baseline"].as_f64().unwrap();
    assert!((change - (chosen / t - 1.0)).abs() < 1e-12, "{doc}");
    let o = flatpipe(
        dir.path(),
        &["plan", "--sharding", "zero4", "--gantt", "none"],
    );
    assert_eq!(o.status.code(), Some(2));
    let err = stderr(&o);
    assert!(
        err.contains("--sharding") && err.contains("zero4") && err.contains("fsdp-mb"),
        "{err}"
    );
}

/// The executor's replicas hold full state: a plan sharded over dp > 1 replicas is refused with
/// the reason (sharding is priced and planned, not executed) and nothing runs.
#[test]
fn execute_refuses_a_sharded_plan() {
    let dir = tempfile::tempdir().unwrap();
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/examples/cpu-tiny/plan.yaml"
    ))
    .unwrap();
    let sharded = text
        .replace("dp: 1\n", "dp: 2\nsharding: fsdp\n")
        .replace("predicted:", "predicted_unused:");
    let sharded = sharded
        .split("predicted_unused:")
        .next()
        .unwrap()
        .to_string();
    std::fs::write(dir.path().join("s.yaml"), sharded).unwrap();
    let o = flatpipe(
        dir.path(),
        &[
            "execute", "--plan", "s.yaml", "--steps", "1", "--gantt", "none",
        ],
    );
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(
        err.contains("sharding fsdp") && err.contains("not executed"),
        "{err}"
    );
}

/// `simulate` runs one fixed tp x dp x pp configuration and says so; a tp that does not divide
/// the GPUs per node is refused naming the flag's value and the node; `execute` refuses a plan
/// with tensor parallelism (priced, not executed).
#[test]
fn simulate_takes_a_tensor_parallel_configuration() {
    let dir = tempfile::tempdir().unwrap();
    let o = flatpipe(
        dir.path(),
        &[
            "simulate",
            "--model",
            "llama3.1-70b",
            "--tp",
            "8",
            "--pp",
            "2",
            "--dp",
            "2",
            "--sharding",
            "zero1",
            "--schedule",
            "1f1b",
            "--gantt",
            "none",
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.contains("x 32 GPUs (tp=8 with sequence parallelism x dp=2 x pp=2, zero1)"),
        "{out}"
    );
    // plan refuses a --tp list with an invalid degree (it dropped it silently), listing the
    // valid ones.
    let o = flatpipe(dir.path(), &["plan", "--tp", "2,3", "--gantt", "none"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains("--tp 3 is invalid: one of 1, 2, 4, 8"),
        "{}",
        stderr(&o)
    );
    let o = flatpipe(dir.path(), &["simulate", "--tp", "3", "--gantt", "none"]);
    assert_eq!(o.status.code(), Some(2));
    let err = stderr(&o);
    assert!(
        err.contains("tp = 3") && err.contains("8 GPUs per node"),
        "{err}"
    );
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/examples/cpu-tiny/plan.yaml"
    ))
    .unwrap()
    .replace("dp: 1\n", "dp: 1\ntp: 2\n");
    std::fs::write(dir.path().join("t.yaml"), text).unwrap();
    let o = flatpipe(
        dir.path(),
        &[
            "execute", "--plan", "t.yaml", "--steps", "1", "--gantt", "none",
        ],
    );
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("tp = 2"), "{}", stderr(&o));
}

/// A hardware file with a cluster size refuses a run of more GPUs than it has, in `plan` and in
/// `simulate`, with both numbers.
#[test]
fn more_gpus_than_the_cluster_has_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let hw = include_str!("../profiles/data/hardware/h200.yaml").to_string() + "nodes: 2\n";
    std::fs::write(dir.path().join("hw.yaml"), hw).unwrap();
    for args in [
        &[
            "plan",
            "--hardware",
            "hw.yaml",
            "--ranks",
            "32",
            "--gantt",
            "none",
        ][..],
        &[
            "simulate",
            "--hardware",
            "hw.yaml",
            "--tp",
            "8",
            "--pp",
            "2",
            "--dp",
            "2",
            "--gantt",
            "none",
        ][..],
    ] {
        let o = flatpipe(dir.path(), args);
        assert_eq!(o.status.code(), Some(2), "{args:?}");
        let err = stderr(&o);
        assert!(
            err.contains("32") && err.contains("at most 2 nodes x 8 GPUs = 16"),
            "{args:?}: {err}"
        );
    }
    let o = flatpipe(
        dir.path(),
        &[
            "plan",
            "--hardware",
            "hw.yaml",
            "--ranks",
            "16",
            "--steps",
            "2",
            "--gantt",
            "none",
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
}

/// Per-rank `--costs` lists and `--exact` (issue 26): GPipe with one microbatch on two ranks
/// takes f0 + f1 + b1 + w1 + b0 + w0 = 1 + 2 + 3 + 1 + 1 + 1 = 9 s; the exact solver proves
/// 61 s optimal at p = 8, m = 8, f = 1, b = 3, w = 1 with 8 units (the issue's closed form);
/// list lengths that do not match --pp are refused with both numbers.
#[test]
fn per_rank_costs_and_exact_from_the_command_line() {
    let dir = tempfile::tempdir().unwrap();
    let o = flatpipe(
        dir.path(),
        &[
            "simulate",
            "--costs",
            "f=1/2,b=1/3,w=1",
            "--pp",
            "2",
            "--microbatches",
            "1",
            "--schedule",
            "gpipe",
            "--format",
            "json",
        ],
    );
    let v = json(&o);
    assert_eq!(v[0]["makespan_s"].as_f64().unwrap(), 9.0);
    let o = flatpipe(
        dir.path(),
        &[
            "simulate",
            "--costs",
            "f=1,b=3,w=1",
            "--pp",
            "8",
            "--microbatches",
            "8",
            "--schedule",
            "1f1b,zb-auto",
            "--max-activation-units",
            "8",
            "--exact",
            "30",
            "--gantt",
            "none",
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.contains("exact: the optimal makespan is 61.000 s under 8 units"),
        "{out}"
    );
    let exact_row = out.lines().find(|l| l.starts_with("exact ")).unwrap();
    assert!(exact_row.contains("61.000 s"), "{exact_row}");
    for (costs, want) in [
        ("f=1/2/3,b=1", "3 values"),
        ("f=1/2/3/4,b=1/2", "2 values"),
        ("f=1/2/3/4,fo=1", "fb and fo only with one value"),
    ] {
        let o = flatpipe(
            dir.path(),
            &["simulate", "--costs", costs, "--pp", "4", "--gantt", "none"],
        );
        assert_eq!(o.status.code(), Some(2), "{costs}");
        assert!(stderr(&o).contains(want), "{costs}: {}", stderr(&o));
    }
}

/// `--consecutive-steps` (issue 27): with f = b = w = 1, p = 4, m = 8, ZB-H2's steady step is
/// m (f + b + w) = 24 s under optimizer post-validation (the next step's warm-up fills its
/// tail) and its single step, (p - 1) f + 24 = 27 s, under a global sync; 1F1B's is
/// (m + p - 1)(f + b + w) = 33 s either way (rank 0 ends last).
#[test]
fn consecutive_steps_from_the_command_line() {
    let dir = tempfile::tempdir().unwrap();
    let o = flatpipe(
        dir.path(),
        &[
            "simulate",
            "--costs",
            "f=1,b=1,w=1",
            "--pp",
            "4",
            "--microbatches",
            "8",
            "--schedule",
            "1f1b,zb-h2",
            "--consecutive-steps",
            "6",
            "--format",
            "json",
        ],
    );
    let v = json(&o);
    let row = |name: &str| {
        v.as_array()
            .unwrap()
            .iter()
            .find(|r| r["schedule"] == name)
            .unwrap()["consecutive_steps"]
            .clone()
    };
    assert_eq!(row("zb-h2")["post_validation_step_s"].as_f64(), Some(24.0));
    assert_eq!(row("zb-h2")["global_sync_step_s"].as_f64(), Some(27.0));
    assert_eq!(row("1f1b")["post_validation_step_s"].as_f64(), Some(33.0));
    assert_eq!(row("1f1b")["global_sync_step_s"].as_f64(), Some(33.0));
    assert_eq!(row("1f1b")["steps"].as_u64(), Some(6));
}

/// `--zb-objective post-validation`: zb-auto ranks its candidates by the steady-state step
/// under optimizer post-validation and reaches a rank's work, m (f + b + w) = 24 s, at p = 4,
/// m = 8 under 2p = 8 units; ranking by one step (the default) it keeps a shape that takes
/// 27 s per step either way. Without --costs the flag is refused.
#[test]
fn zb_objective_post_validation_from_the_command_line() {
    let dir = tempfile::tempdir().unwrap();
    let steady = |objective: &str| {
        let o = flatpipe(
            dir.path(),
            &[
                "simulate",
                "--costs",
                "f=1,b=1,w=1",
                "--pp",
                "4",
                "--microbatches",
                "8",
                "--schedule",
                "zb-auto",
                "--max-activation-units",
                "8",
                "--consecutive-steps",
                "6",
                "--zb-objective",
                objective,
                "--format",
                "json",
            ],
        );
        json(&o)[0]["consecutive_steps"]["post_validation_step_s"]
            .as_f64()
            .unwrap()
    };
    assert_eq!(steady("post-validation"), 24.0);
    assert_eq!(steady("step"), 27.0);
    let o = flatpipe(
        dir.path(),
        &[
            "simulate",
            "--zb-objective",
            "post-validation",
            "--gantt",
            "none",
        ],
    );
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("--costs"), "{}", stderr(&o));
}

/// Without a chart, trace or memory CSV, `simulate --costs` replays without a timeline
/// (`summary::metrics_without_timeline`); with one it keeps the full simulation. Both must
/// report the same metrics, row for row: every schedule, V and interleaved placements,
/// heterogeneous ranks, forward-only work (three replays per schedule) and the exact solver's
/// row.
#[test]
fn simulate_reports_the_same_metrics_with_and_without_a_timeline() {
    let dir = tempfile::tempdir().unwrap();
    let cases: [&[&str]; 3] = [
        &[
            "--costs",
            "f=1,b=2,w=1,comm=0.1",
            "--pp",
            "4",
            "--microbatches",
            "12",
        ],
        &[
            "--costs",
            "f=1/1/1/2,b=2/2/2/3,w=1,comm=0.05",
            "--pp",
            "4",
            "--microbatches",
            "8",
            "--fo-microbatches",
            "4",
        ],
        &[
            "--costs",
            "f=1,b=1,w=1",
            "--pp",
            "2",
            "--microbatches",
            "4",
            "--schedule",
            "zb-h1,zb-auto",
            "--exact",
            "10",
        ],
    ];
    for case in cases {
        let run = |extra: &[&str]| {
            let mut args = vec!["simulate", "--format", "json"];
            args.extend_from_slice(case);
            args.extend_from_slice(extra);
            json(&flatpipe(dir.path(), &args))
        };
        let lean = run(&["--gantt", "none"]);
        let full = run(&["--gantt", "none", "--memory", "memory.csv"]);
        assert!(dir.path().join("memory.csv").exists());
        assert!(
            lean.as_array().is_some_and(|rows| rows.len() >= 2),
            "{lean}"
        );
        assert_eq!(lean, full, "{case:?}");
    }
}
