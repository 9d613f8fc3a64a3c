//! `flatpipe simulate` on a profile: the default comparison, memory, workload options, plan
//! files and Monte Carlo runs. The `--costs` mode is in `simulate_costs`.

use crate::cli::common::{PLAN, flatpipe, flatpipe_json};

// The default comparison.

#[test]
fn default_simulate_compares_schedules_and_draws_the_best() {
    let dir = tempfile::tempdir().unwrap();
    let o = flatpipe(dir.path(), &["simulate"]);
    assert!(o.status.success(), "{}", o.stderr);
    let out = &o.stdout;
    assert!(
        out.contains("llama3.1-8b") && out.contains("seed 0") && out.contains("128 sequences"),
        "{out}"
    );
    assert!(out.contains("1f1b") && out.contains("gpipe"), "{out}");
    let png = std::fs::read(dir.path().join("flatpipe-gantt.png")).unwrap();
    assert_eq!(&png[1..4], b"PNG");
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

// Memory: which rows fit, and schedules that cannot be built.

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
    let rows = o.json();
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
    let out = &table.stdout;
    let gpipe = out
        .lines()
        .find(|l| l.split_whitespace().next() == Some("gpipe"))
        .unwrap();
    assert!(gpipe.contains("OVER by"), "{gpipe}");
    assert!(out.contains("does not fit 136.40 GiB per rank"), "{out}");
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
    assert!(o.status.success(), "{}", o.stderr);
    let err = &o.stderr;
    assert_eq!(
        err.matches("is more than NVIDIA H200 SXM's").count(),
        1,
        "{err}"
    );
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
    let out = &o.stdout;
    assert!(o.status.success(), "{}\n{out}", o.stderr);
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
    assert!(o.status.success(), "{}", o.stderr);
    let out = &o.stdout;
    assert!(out.contains("zb-auto not built"), "{out}");
    assert!(
        out.contains("GiB of activations") && out.contains("one microbatch's activations"),
        "{out}"
    );
    assert!(out.contains("1f1b"), "{out}");
}

// The step and the cluster.

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
    assert!(o.status.success(), "{}", o.stderr);
    assert!(
        o.stderr.contains("m = 2 microbatches < pp = 4 ranks"),
        "{}",
        o.stderr
    );
}

#[test]
fn simulate_takes_more_forward_only_than_training_microbatches() {
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
    let v = o.json();
    assert!(v[0]["fo_separate_s"].as_f64().unwrap() > 0.0);
}

/// With forward-only work each rank also holds the frozen model's weights: the params+opt
/// column counts them, so params+opt plus peak activations is the memory of the rank that
/// holds both maxima (rank 0 under 1F1B: the most layers' state and the most in-flight
/// microbatches). The column left them out (38.06 + 68.27 GiB against 110.56 GiB).
#[test]
fn with_forward_only_work_the_memory_columns_add_up() {
    let dir = tempfile::tempdir().unwrap();
    let v = flatpipe_json(
        dir.path(),
        &[
            "simulate",
            "--schedule",
            "1f1b",
            "--fo-microbatches",
            "same",
            "--gantt",
            "none",
            "--format",
            "json",
        ],
    );
    let r = &v[0];
    let (state, act, total) = (
        r["static_bytes"].as_f64().unwrap(),
        r["peak_activation_bytes"].as_f64().unwrap(),
        r["peak_memory_bytes"].as_f64().unwrap(),
    );
    assert!(
        (state + act - total).abs() < 1.0,
        "{state} + {act} != {total}"
    );
    // The frozen weights are on top of rank 0's own parameters and optimizer state.
    assert!(state > r["ranks"][0]["static_bytes"].as_f64().unwrap());
}

/// `simulate` runs one fixed tp x dp x pp configuration and says so.
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
    assert!(o.status.success(), "{}", o.stderr);
    let out = &o.stdout;
    assert!(
        out.contains("x 32 GPUs (tp=8 with sequence parallelism x dp=2 x pp=2, zero1)"),
        "{out}"
    );
}

// Plan files (`simulate --plan`).

#[test]
fn simulate_runs_a_plan_file() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("plan.yaml"), PLAN).unwrap();
    let v = flatpipe_json(
        dir.path(),
        &["simulate", "--plan", "plan.yaml", "--format", "json"],
    );
    assert_eq!(v[0]["schedule"], "1f1b");
    assert_eq!(v[0]["pp"], 2);
    assert_eq!(v[0]["microbatches"], 8);
    assert!(v[0]["ranks"][1]["peak_activation_bytes"].as_f64().unwrap() > 0.0);
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
    assert!(o.status.success(), "{}", o.stderr);
    let run = |plan: &str| {
        let o = flatpipe(
            dir.path(),
            &[
                "simulate", "--plan", plan, "--steps", "4", "--gantt", "none",
            ],
        );
        assert!(o.status.success(), "{}", o.stderr);
        (o.stdout.clone(), o.stderr)
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
        o.stderr.contains("z.yaml") && o.stderr.contains("`zigzag`, expected one of"),
        "{}",
        o.stderr
    );
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
    assert!(o.status.success(), "{}", o.stderr);
    let limit = |extra: &[&str]| {
        let mut args = vec![
            "simulate", "--plan", "p.yaml", "--gantt", "none", "--format", "json",
        ];
        args.extend(extra);
        let doc = flatpipe_json(dir.path(), &args);
        doc[0]["memory_limit_bytes"].as_f64().unwrap()
    };
    assert_eq!(limit(&[]), 100.0 * 2f64.powi(30));
    assert_eq!(limit(&["--memory-limit", "120GiB"]), 120.0 * 2f64.powi(30));
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
    assert!(o.status.success(), "{}", o.stderr);
    let header = |extra: &[&str]| {
        let mut args = vec!["simulate", "--plan", "p.yaml", "--gantt", "none"];
        args.extend(extra);
        let o = flatpipe(dir.path(), &args);
        assert!(o.status.success(), "{}", o.stderr);
        o.stdout.lines().next().unwrap().to_string()
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

// Monte Carlo runs (`--steps`) and fixed-capacity rounds.

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
    let v = o.json();
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
    assert!(o.stderr.contains("seed 0"), "{}", o.stderr);
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
    assert!(o.status.success(), "{}", o.stderr);
    let out = &o.stdout;
    assert!(
        out.contains("rounds of its fixed-capacity schedule"),
        "{out}"
    );
    let svg = std::fs::read_to_string(dir.path().join("g.svg")).unwrap();
    assert!(svg.contains("rounds of the 4-microbatch schedule"));
}

/// A plan file's `chunk_tokens` is applied, and the warning about sequences over the budget says
/// so (it said they "got a microbatch of their own" because it read only `--chunk-tokens`).
#[test]
fn a_planned_chunk_size_is_reported_as_applied() {
    let dir = tempfile::tempdir().unwrap();
    // tiny-chat sequences reach 512 tokens: over a 256-token budget, cut into 128-token chunks.
    let plan = "model: tiny\nhardware: cpu\nworkload: tiny-chat\npp: 2\nplacement: loop\nschedule: 1f1b\nstages:\n- {start: 0, end: 5}\n- {start: 5, end: 10}\ntoken_budget: 256\nchunk_tokens: 128\n";
    let path = dir.path().join("chunked.yaml");
    std::fs::write(&path, plan).unwrap();
    let o = flatpipe(
        dir.path(),
        &[
            "simulate",
            "--plan",
            path.to_str().unwrap(),
            "--steps",
            "4",
            "--gantt",
            "none",
        ],
    );
    assert!(o.status.success(), "{}", o.stderr);
    assert!(
        o.stderr
            .contains("were cut into chunks of at most 128 tokens")
            && !o.stderr.contains("of their own"),
        "{}",
        o.stderr
    );
}

/// `simulate --plan P --schedule a,b` compares those schedules on the plan's split,
/// recomputation and sharding: the plan's own schedule (1F1B) gives the plan's step time, and
/// a schedule of another number of stages per rank (zb-v) is left out, or refused when it is
/// the only one.
#[test]
fn a_plan_compares_schedules_on_its_own_split() {
    let dir = tempfile::tempdir().unwrap();
    let plan = crate::cli::common::repo_file("examples/plan.yaml");
    let rows = |extra: &[&str]| -> Vec<(String, f64)> {
        let mut args = vec![
            "simulate",
            "--plan",
            plan.as_str(),
            "--gantt",
            "none",
            "--format",
            "json",
        ];
        args.extend(extra);
        flatpipe_json(dir.path(), &args)
            .as_array()
            .unwrap()
            .iter()
            .map(|r| {
                (
                    r["schedule"].as_str().unwrap().to_string(),
                    r["step_time_s"]["mean"].as_f64().unwrap(),
                )
            })
            .collect()
    };
    let own = rows(&[]);
    assert_eq!(own.len(), 1);
    let compared = rows(&["--schedule", "1f1b,zb-h1,zb-v"]);
    let names: Vec<&str> = compared.iter().map(|r| r.0.as_str()).collect();
    assert!(names.contains(&"1f1b") && names.contains(&"zb-h1") && !names.contains(&"zb-v"));
    let one = compared.iter().find(|r| r.0 == own[0].0).unwrap();
    assert!((one.1 - own[0].1).abs() < 1e-9, "{one:?} vs {own:?}");
    let o = flatpipe(
        dir.path(),
        &[
            "simulate",
            "--plan",
            plan.as_str(),
            "--schedule",
            "zb-v",
            "--gantt",
            "none",
        ],
    );
    assert_eq!(o.status.code(), Some(2), "{}", o.stderr);
    assert!(o.stderr.contains("1 stage(s) per rank"), "{}", o.stderr);
}

/// `--cp` reaches the cost model: cp = 1 is the run without it, cp = 2 holds half the tokens per
/// GPU (less activation memory, a shorter step on a workload of short sequences), the header
/// counts its GPUs, and bad names, a cp the heads do not divide for Ulysses and more GPUs than
/// the cluster has are refused with the numbers.
#[test]
fn simulate_prices_context_parallelism() {
    let dir = tempfile::tempdir().unwrap();
    let run = |extra: &[&str]| {
        let mut args = vec![
            "simulate",
            "--model",
            "llama3.1-8b",
            "--hardware",
            "h100",
            "--schedule",
            "1f1b",
            "--pp",
            "4",
            "--steps",
            "3",
            "--gantt",
            "none",
            "--format",
            "json",
        ];
        args.extend_from_slice(extra);
        flatpipe_json(dir.path(), &args)[0].clone()
    };
    let none = run(&[]);
    assert_eq!(run(&["--cp", "1"]), none);
    let cp2 = run(&["--cp", "2"]);
    let act = |v: &serde_json::Value| v["peak_activation_bytes"].as_f64().unwrap();
    let step = |v: &serde_json::Value| v["step_time_s"]["mean"].as_f64().unwrap();
    assert!(
        act(&cp2) < 0.6 * act(&none),
        "{} vs {}",
        act(&cp2),
        act(&none)
    );
    assert!(step(&cp2) < step(&none));
    let base = [
        "simulate",
        "--model",
        "llama3.1-8b",
        "--hardware",
        "h100",
        "--pp",
        "4",
        "--steps",
        "1",
        "--gantt",
        "none",
    ];
    let o = flatpipe(dir.path(), &[&base[..], &["--cp", "2"]].concat());
    assert!(
        o.stdout.contains("8 GPUs") && o.stdout.contains("cp=2 (p2p, zigzag)"),
        "{}",
        o.stdout
    );
    for (args, want) in [
        (vec!["--cp", "2", "--cp-comm", "ring"], "a2a+p2p:N"),
        (vec!["--cp", "64", "--cp-comm", "a2a"], "32 query heads"),
        (
            vec!["--cp", "2", "--cp-balance", "halves"],
            "zigzag or contiguous",
        ),
    ] {
        let o = flatpipe(dir.path(), &[&base[..], &args[..]].concat());
        assert_eq!(o.status.code(), Some(2), "{}", o.stderr);
        assert!(o.stderr.contains(want), "{want}: {}", o.stderr);
    }
}
