//! `flatpipe execute`: running a plan on the CPU (or CUDA) backend, verifying it, and comparing
//! the measurement with a prediction.

use crate::cli::common::{flatpipe, repo_file};
use serde_json::Value;

// Running and verifying.

/// `execute` and `simulate` resolve a run without layout flags the same way: pp 4, 1F1B,
/// flat-ffd at a 16,384-token budget. Every tiny-chat sequence is at most 512 tokens and a step
/// holds 32 (profiles/data/workloads/tiny-chat.yaml), so a step is at most 16,384 tokens: one
/// microbatch, on both.
#[test]
fn execute_and_simulate_share_one_set_of_run_defaults() {
    let dir = tempfile::tempdir().unwrap();
    let common = [
        "--model",
        "tiny",
        "--hardware",
        "cpu",
        "--workload",
        "tiny-chat",
        "--gantt",
        "none",
        "--format",
        "json",
    ];
    let mut args = vec!["execute", "--steps", "1"];
    args.extend(common);
    let o = flatpipe(dir.path(), &args);
    assert!(o.status.success(), "{}", o.stderr);
    let e = o.json();
    assert_eq!(e["schedule"], "1f1b");
    assert_eq!((e["pp"].as_u64(), e["vpp"].as_u64()), (Some(4), Some(1)));
    assert_eq!(e["steps"][0]["microbatches"], serde_json::json!([1]));
    let mut args = vec!["simulate", "--schedule", "1f1b"];
    args.extend(common);
    let o = flatpipe(dir.path(), &args);
    assert!(o.status.success(), "{}", o.stderr);
    let s = &o.json()[0];
    assert_eq!((s["pp"].as_u64(), s["vpp"].as_u64()), (Some(4), Some(1)));
    assert_eq!(s["policy"], "flat-ffd");
    assert_eq!(s["microbatches"].as_u64(), Some(1));
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
    let v = o.json();
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
        o.stderr.contains("No profile measured on the cpu backend"),
        "{}",
        o.stderr
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
    let v = o.json();
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
    assert!(o.status.success(), "{}", o.stderr);
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
    let v = o.json();
    let step = &v["steps"][0];
    assert!(
        step["microbatches"][0].as_u64().unwrap() >= 2,
        "several microbatches in flight: {step}"
    );
    assert_eq!(step["verify"]["within_tolerance"], true, "{step}");
    assert!(step["verify"]["grad_max_rel_diff"].as_f64().unwrap() <= 1e-4);
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
        assert!(o.status.success(), "{}", o.stderr);
        o.json()
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

// Prediction against measurement.

/// Stand-in for a profiler output, written to `dir/measured.yaml`: the analytic tiny@cpu
/// profile marked as measured on a CPU.
fn measured_stand_in(dir: &std::path::Path) -> flatpipe::profiles::Profile {
    use flatpipe::profiles::{AnalyticOptions, ProfileSource, analytic_profile, builtins};
    let model = builtins::model("tiny").unwrap();
    let hw = builtins::hardware("cpu").unwrap();
    let mut p = analytic_profile(&model, &hw, &AnalyticOptions::default()).unwrap();
    p.provenance.source = ProfileSource::Measured;
    p.provenance.device = "test CPU".into();
    p.provenance.date = Some("2026-11-30".into());
    std::fs::write(dir.join("measured.yaml"), p.to_yaml().unwrap()).unwrap();
    p
}

#[test]
fn execute_compares_with_a_profile_measured_on_its_backend() {
    let dir = tempfile::tempdir().unwrap();
    measured_stand_in(dir.path());
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
    let v = o.json();
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

/// `--fit-profile` writes the profile with each phase's costs times the steps' measured over
/// predicted busy time, the factors in the JSON, and `--estimate-log` the estimate step by step (that the factors make the replay's busy time the
/// measured one is `executor/tests/prediction.rs`).
#[test]
fn execute_refits_the_profile_on_its_steps() {
    let dir = tempfile::tempdir().unwrap();
    let p = measured_stand_in(dir.path());
    let v = flatpipe(
        dir.path(),
        &[
            "execute",
            "--profile",
            "measured.yaml",
            "--pp",
            "2",
            "--microbatches",
            "4",
            "--seqs-per-step",
            "8",
            "--steps",
            "3",
            "--warmup-steps",
            "1",
            "--format",
            "json",
            "--fit-profile",
            "fitted.yaml",
            "--estimate-log",
            "estimate.jsonl",
        ],
    )
    .json();
    // One line per measured step, its times those of the step's row; without forgetting the
    // last line's estimate is the one the refit applied.
    let log = std::fs::read_to_string(dir.path().join("estimate.jsonl")).unwrap();
    let lines: Vec<serde_json::Value> = log
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 3);
    for (line, row) in lines.iter().zip(v["steps"].as_array().unwrap()) {
        for key in ["step", "predicted_makespan_s", "measured_makespan_s"] {
            assert_eq!(line[key], row[key], "{key}");
        }
        assert_eq!(line["rank_factors"].as_array().unwrap().len(), 2);
        // The CPU backend's hand-offs are not timed: no link is fitted.
        assert!(line["link"].is_null(), "{}", line["link"]);
        // Each layer kind's factors, fitted on the same actions.
        for kind in ["embedding", "decoder", "head"] {
            let f = line["kind_factors"][kind]["f"].as_f64().unwrap();
            assert!(f > 0.0 && f.is_finite(), "{kind}: {f}");
        }
    }
    assert_eq!(lines[2]["phase_scale"], v["fitted_scale"]);
    let k = &v["fitted_scale"];
    let scale = serde_json::from_value(k.clone()).unwrap();
    // 1F1B runs fused backwards: I and W take B's factor.
    assert_eq!(k["i"], k["b"]);
    assert_eq!(k["w"], k["b"]);
    let text = std::fs::read_to_string(dir.path().join("fitted.yaml")).unwrap();
    let fitted = flatpipe::profiles::Profile::from_yaml(&text, "fitted.yaml").unwrap();
    let want = p.scaled(&scale).unwrap();
    // To the last bits JSON's decimal factors may lose.
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-12 * b.abs();
    assert_eq!(fitted.layers.len(), want.layers.len());
    for (a, b) in fitted.layers.iter().zip(&want.layers) {
        for (x, y) in [(a.f, b.f), (a.i, b.i), (a.w, b.w), (a.fo, b.fo)] {
            assert!(
                close(x.c0_s, y.c0_s) && close(x.c_tok_s, y.c_tok_s),
                "{}",
                a.name
            );
            assert!(close(x.c_attn_s, y.c_attn_s), "{}", a.name);
        }
        assert_eq!(a.param_bytes, b.param_bytes);
    }
    assert!(close(
        fitted.optimizer_s_per_param,
        want.optimizer_s_per_param
    ));
}

/// `--replan` plans each step from the estimate: with rank 1 computing 2x slower from step 1
/// on (the `--slow-rank` test hook), rank 1's factor rises to about twice rank 0's, each step's
/// planning time is logged, the refitted profile scales rank 1's layers more than rank 0's, and
/// a layer split that gives rank 1 fewer layers is proposed and written as a plan that
/// `execute --plan` runs. What the hook and re-planning need is refused by name.
#[test]
fn execute_replans_each_step_and_proposes_a_split_for_a_straggler() {
    let dir = tempfile::tempdir().unwrap();
    let p = measured_stand_in(dir.path());
    let args = [
        "execute",
        "--profile",
        "measured.yaml",
        "--pp",
        "2",
        "--schedule",
        "zb-auto",
        "--microbatches",
        "4",
        "--seqs-per-step",
        "8",
        "--steps",
        "6",
        "--format",
        "json",
        "--slow-rank",
        "1:2:1",
        "--replan",
        "--forgetting",
        "0.5",
        "--estimate-log",
        "estimate.jsonl",
        "--fit-profile",
        "fitted.yaml",
        "--propose-plan",
        "proposed.yaml",
    ];
    let o = flatpipe(dir.path(), &args);
    assert!(o.status.success(), "{}", o.stderr);
    let log = std::fs::read_to_string(dir.path().join("estimate.jsonl")).unwrap();
    let lines: Vec<serde_json::Value> = log
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let f = lines[5]["rank_factors"].as_array().unwrap();
    let ratio = f[1].as_f64().unwrap() / f[0].as_f64().unwrap();
    assert!(ratio > 1.4 && ratio < 2.6, "rank 1 / rank 0: {ratio}");
    assert!(lines[0]["planning_s"].is_null());
    assert!(
        lines[1..]
            .iter()
            .all(|l| l["planning_s"].as_f64().unwrap() > 0.0)
    );
    // Rank 1 holds layers 5..10 under the even split: they are scaled by its own factors.
    let fitted = flatpipe::profiles::Profile::from_yaml(
        &std::fs::read_to_string(dir.path().join("fitted.yaml")).unwrap(),
        "fitted.yaml",
    )
    .unwrap();
    let k = |l: usize| fitted.layers[l].f.c_tok_s / p.layers[l].f.c_tok_s;
    assert!(k(6) > 1.4 * k(2), "{} vs {}", k(6), k(2));
    let plan = std::fs::read_to_string(dir.path().join("proposed.yaml")).unwrap();
    let proposed = flatpipe::simulator::Plan::from_yaml(&plan, "proposed.yaml").unwrap();
    let last = proposed.run.stages[1].clone();
    assert!(last.len() < 5 && last.end == 10, "{plan}");
    let run = flatpipe(
        dir.path(),
        &[
            "execute",
            "--plan",
            "proposed.yaml",
            "--steps",
            "1",
            "--seqs-per-step",
            "8",
            "--gantt",
            "none",
        ],
    );
    assert!(run.status.success(), "{}", run.stderr);
    for (extra, says) in [
        (
            &["--slow-rank", "2:1.5:0"][..],
            "--slow-rank 2:1.5:0 is invalid",
        ),
        (&["--slow-rank", "1:0.5:0"], "a factor >= 1"),
    ] {
        let mut a = vec!["execute", "--pp", "2", "--steps", "1", "--gantt", "none"];
        a.extend(extra);
        let o = flatpipe(dir.path(), &a);
        assert!(
            !o.status.success() && o.stderr.contains(says),
            "{extra:?}: {}",
            o.stderr
        );
    }
    let o = flatpipe(
        dir.path(),
        &["execute", "--pp", "2", "--steps", "1", "--replan"],
    );
    assert!(
        !o.status.success() && o.stderr.contains("--replan: the estimate"),
        "{}",
        o.stderr
    );
}

// Notes, charts and backends.

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
    assert!(o.status.success(), "{}", o.stderr);
    let out = &o.stdout;
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

/// `execute --gantt none` means no chart, as in the other commands (it was taken for a file
/// name without an extension and refused).
#[test]
fn execute_takes_gantt_none() {
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
    assert!(o.status.success(), "{}", o.stderr);
    assert!(!dir.path().join("none").exists());
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
    let e = &o.stderr;
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
    let v = o.json();
    if gpu_here {
        assert_eq!(v["backend"], "cuda (fp32 GEMMs)");
    } else {
        assert_eq!(v["backend"], "cpu");
        assert!(o.stderr.contains("--backend auto"), "{}", o.stderr);
    }
}

/// A step's tokens do not depend on the plan: the step-0 loss of the tiny model is the same
/// whatever the layer split (pp 2 or 4), the token budget (one microbatch or three), the chunks
/// and the data-parallel split; it was drawn per microbatch slot, so it changed with the
/// packing (8.3723 at one microbatch, 8.3629 at three).
#[test]
fn the_step_loss_does_not_depend_on_the_plan() {
    let dir = tempfile::tempdir().unwrap();
    let loss = |extra: &[&str]| -> f64 {
        let mut args = vec!["execute", "--steps", "1", "--format", "json"];
        args.extend(extra);
        let o = flatpipe(dir.path(), &args);
        assert!(o.status.success(), "{extra:?}: {}", o.stderr);
        let v: Value = serde_json::from_str(&o.stdout).unwrap();
        v["steps"][0]["loss"].as_f64().unwrap()
    };
    let base = loss(&["--pp", "2"]);
    for extra in [
        &["--pp", "4"][..],
        &["--pp", "2", "--token-budget", "1024"],
        &[
            "--pp",
            "2",
            "--token-budget",
            "256",
            "--chunk-tokens",
            "128",
        ],
        &["--pp", "2", "--dp", "2"],
    ] {
        let l = loss(extra);
        assert!((l - base).abs() <= 1e-5 * base, "{extra:?}: {l} vs {base}");
    }
}

/// A mixture-of-experts model under expert parallelism: verified against the single-rank run,
/// the measured all-to-all time in the JSON (exposed never above the total), and the
/// all-to-alls in the Chrome trace: 4 per MoE decoder (6) and microbatch (2 x 2 replicas).
#[test]
fn execute_runs_experts_in_parallel_and_traces_their_all_to_alls() {
    let dir = tempfile::tempdir().unwrap();
    let o = flatpipe(
        dir.path(),
        &[
            "execute",
            "--model",
            "tiny-moe",
            "--schedule",
            "dualpipev",
            "--pp",
            "2",
            "--dp",
            "2",
            "--ep",
            "2",
            "--microbatches",
            "2",
            "--seqs-per-step",
            "8",
            "--steps",
            "1",
            "--verify",
            "--trace",
            "t.json",
            "--format",
            "json",
        ],
    );
    let v = o.json();
    let s = &v["steps"][0];
    assert_eq!(s["verify"]["within_tolerance"], true, "{s}");
    let a = &s["all_to_all"];
    let (total, exposed) = (
        a["total_s"].as_f64().unwrap(),
        a["exposed_s"].as_f64().unwrap(),
    );
    assert!(0.0 < total && exposed <= total, "{a}");
    let trace: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("t.json")).unwrap()).unwrap();
    let spans: Vec<&serde_json::Value> = trace["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["cat"] == "all_to_all")
        .collect();
    assert_eq!(spans.len(), 4 * 6 * 2 * 2);
    // On the ranks' comm lanes, named by stage, exchange, pass, microbatch and layer: the first
    // MoE decoder is layer 1, on stage 0.
    let names: Vec<&str> = spans.iter().map(|e| e["name"].as_str().unwrap()).collect();
    for name in [
        "0DISPATCH_F0_L1",
        "0COMBINE_F0_L1",
        "0DISPATCH_I0_L1",
        "0COMBINE_I0_L1",
    ] {
        assert!(names.contains(&name), "{name} not in {names:?}");
    }
}

/// `execute --cp 2` runs every rank as two worker ranks, each with its zigzag share of every
/// microbatch, gathering the keys and values of the group: on a step of one long and several
/// short sequences (checked here from the workload's own sampler), under 1F1B, ZB-H1 and
/// interleaved 1F1B at pp 2, and at cp 4 with dp 2, the loss and gradients equal the
/// single-rank run's (`--verify`). What the executor does not run is refused by name.
#[test]
fn execute_runs_context_parallel_groups_equal_to_one_rank() {
    let dir = tempfile::tempdir().unwrap();
    let yaml = "name: long-and-short\nlengths: {kind: pareto, scale: 8, alpha: 0.7, max: 768}\nseqs_per_step: 6\nseed: 3\n";
    std::fs::write(dir.path().join("w.yaml"), yaml).unwrap();
    let w = flatpipe::profiles::Workload::from_file(&dir.path().join("w.yaml")).unwrap();
    // The first seed whose step 0 is one sequence of at least 256 tokens and five of at most 64.
    let seed = (0..1000u64)
        .find(|&seed| {
            let mut lens = w.sample_step(seed, 0, flatpipe::profiles::StepSize::Seqs(6));
            lens.sort_unstable();
            lens[5] >= 256 && lens[4] <= 64
        })
        .expect("a heavy tail draws one")
        .to_string();
    let run = |extra: &[&str]| {
        let mut args = vec![
            "execute",
            "--model",
            "tiny",
            "--hardware",
            "cpu",
            "--workload",
            "w.yaml",
            "--pp",
            "2",
            "--steps",
            "1",
            "--verify",
            "--gantt",
            "none",
            "--format",
            "json",
            "--seed",
            &seed,
        ];
        args.extend(extra);
        flatpipe(dir.path(), &args)
    };
    let whole = ["--token-budget", "4096"];
    for extra in [
        &["--cp", "2"][..],
        &["--cp", "2", "--schedule", "zb-h1"],
        &["--cp", "2", "--schedule", "interleaved-1f1b"],
        &["--cp", "4", "--cp-comm", "allgather", "--dp", "2"],
    ] {
        let extra = &[extra, &whole[..]].concat();
        let o = run(extra);
        assert!(o.status.success(), "{extra:?}: {}", o.stderr);
        let v = &o.json()["steps"][0]["verify"];
        assert_eq!(v["within_tolerance"], true, "{extra:?}: {v}");
        assert!(
            v["grad_max_rel_diff"].as_f64().unwrap() < 1e-4,
            "{extra:?}: {v}"
        );
    }
    for (extra, says) in [
        (
            &["--cp", "2", "--cp-comm", "a2a", "--token-budget", "4096"][..],
            "a2a",
        ),
        (
            &["--cp", "2", "--dynamic-cp", "64", "--token-budget", "4096"],
            "dynamic cp",
        ),
        (
            &[
                "--cp",
                "2",
                "--token-budget",
                "128",
                "--chunk-tokens",
                "128",
            ],
            "chunk",
        ),
    ] {
        let o = run(extra);
        assert!(
            !o.status.success() && o.stderr.contains(says),
            "{extra:?}: {}",
            o.stderr
        );
    }
}
