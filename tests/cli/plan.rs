//! `flatpipe plan`: the search, what it says about the chosen plan, and the plan file it writes.

use crate::cli::common::{flatpipe, flatpipe_json};

// The plan file.

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
    let v = o.json();
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
    let s = flatpipe_json(
        dir.path(),
        &[
            "simulate", "--plan", "p.yaml", "--steps", "8", "--format", "json",
        ],
    );
    assert!((s[0]["step_time_s"]["mean"].as_f64().unwrap() - predicted).abs() < 1e-9);
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
    assert!(o.status.success(), "{}", o.stderr);
    let text = std::fs::read_to_string(dir.path().join("p.yaml")).unwrap();
    assert!(
        text.contains("forward_only") && text.contains("loss_dependency: true"),
        "{text}"
    );
    let o = flatpipe(
        dir.path(),
        &["simulate", "--plan", "p.yaml", "--format", "json"],
    );
    let v = o.json();
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
    let v = o.json();
    let s = &v["steps"][0];
    // `same`: one forward-only microbatch per training microbatch.
    assert_eq!(s["fo_microbatches"], s["microbatches"][0]);
    assert_eq!(s["verify"]["within_tolerance"], true);
}

// The candidates.

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
    let doc = flatpipe_json(dir.path(), &json_args);
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
    let out = &table.stdout;
    assert!(out.contains("no pipeline"), "{out}");
    // The chosen line says the same as its row (it said "chosen: 1f1b").
    assert!(out.contains("chosen: no pipeline dp=2 pp=1"), "{out}");
}

/// A data-parallel degree larger than a step's sequence count drops only those candidates,
/// with the reason: 3 sequences per step on 4 ranks leave dp = 4 (pp = 1) replicas empty.
#[test]
fn plan_drops_replicas_without_sequences() {
    let dir = tempfile::tempdir().unwrap();
    let doc = flatpipe_json(
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
    );
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

/// `plan` compares the chosen plan with the no-pipeline FSDP run a torchtitan user starts from
/// (in words and in JSON).
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
    assert!(o.status.success(), "{}", o.stderr);
    let out = &o.stdout;
    let line = out
        .lines()
        .find(|l| l.starts_with("Against the no-pipeline FSDP configuration"))
        .unwrap_or_else(|| panic!("{out}"));
    assert!(line.contains("pp=1") && line.contains("fsdp"), "{line}");
    let mut json_args = args.to_vec();
    json_args.extend(["--format", "json"]);
    let doc = flatpipe_json(dir.path(), &json_args);
    let base = &doc["fsdp_baseline"];
    let chosen = doc["plans"][0]["summary"]["step_time_s"]["mean"]
        .as_f64()
        .unwrap();
    let t = base["mean_s"].as_f64().unwrap();
    let change = base["chosen_vs_baseline"].as_f64().unwrap();
    assert!((change - (chosen / t - 1.0)).abs() < 1e-12, "{doc}");
}

// Notes on the chosen plan.

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
    assert!(o.status.success(), "{}", o.stderr);
    let out = &o.stdout;
    let line = out
        .lines()
        .find(|l| l.starts_with("the plan's busiest rank needs"))
        .unwrap_or_else(|| panic!("{out}"));
    let num = |t: &str| -> f64 {
        t.trim_matches(|c: char| !c.is_ascii_digit() && c != '.')
            .parse()
            .unwrap()
    };
    let words: Vec<&str> = line.split_whitespace().collect();
    // "the plan's busiest rank needs 135.80 GiB of the 136.40 GiB memory limit (99.6%, ..."
    let (need, limit) = (num(words[5]), num(words[9]));
    assert!(line.contains("re-plan with --memory-margin 0.05"), "{line}");
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
    assert!(o.status.success(), "{}", o.stderr);
    assert!(!o.stdout.contains("busiest rank needs"));
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
    let out = &o.stdout;
    assert!(o.status.success(), "{}", o.stderr);
    assert!(
        out.contains(
            "64 of the 64 sampled sequences are longer than the chosen token budget of 4096"
        ),
        "{out}"
    );
}

/// Off a terminal (here stderr is a pipe) a plan search longer than a second prints its
/// progress as lines, where a bar would draw nothing: the first after a second, the end.
#[test]
fn plan_prints_progress_lines_off_a_terminal() {
    let dir = tempfile::tempdir().unwrap();
    let o = flatpipe(dir.path(), &["plan", "--steps", "256", "--gantt", "none"]);
    assert!(o.status.success(), "{}", o.stderr);
    let lines: Vec<&str> = o
        .stderr
        .lines()
        .filter(|l| l.starts_with("plan: ") && l.contains(" candidates at "))
        .collect();
    assert!(!lines.is_empty(), "{}", o.stderr);
    let last = lines.last().unwrap();
    let (done, total) = last["plan: ".len()..]
        .split(' ')
        .next()
        .and_then(|f| f.split_once('/'))
        .unwrap();
    assert_eq!(done, total, "{last}");
}

/// The workload's default step (128 sequences of ShareGPT) cannot feed 256 data-parallel
/// replicas: the plan says so up front, naming the flags for the run's global batch, and the
/// no-pipeline baseline's refusal names them too. The long per-stage lists print as runs.
#[test]
fn a_default_step_smaller_than_the_replicas_is_named_with_the_flags_to_set() {
    let dir = tempfile::tempdir().unwrap();
    let args = [
        "plan",
        "--model",
        "tiny",
        "--hardware",
        "cpu",
        "--ranks",
        "512",
        "--pp",
        "2",
        "--gantt",
        "none",
    ];
    let o = flatpipe(dir.path(), &args);
    assert!(o.status.success(), "{}", o.stderr);
    let all = format!("{}{}", o.stdout, o.stderr);
    assert!(
        all.contains("the workload's default step holds 128 sequences, fewer than the up to 256")
            && all.contains("--seqs-per-step or --tokens-per-step"),
        "{all}"
    );
    assert!(
        all.contains("a replica would get none (a larger step: more sequences or tokens"),
        "{all}"
    );
    let mut with_batch = args.to_vec();
    with_batch.extend(["--seqs-per-step", "256", "--steps", "2"]);
    let o = flatpipe(dir.path(), &with_batch);
    assert!(!o.stderr.contains("default step holds"), "{}", o.stderr);
}

/// `plan --cp 1,2` weighs context parallelism beside chunks on a long-context workload: a plan
/// with a cp group is written with it and `simulate --plan` reproduces its prediction, and the
/// notes say which answer to long sequences the chosen plan takes and what the others cost.
#[test]
fn plan_searches_context_parallelism_and_simulate_reproduces_it() {
    let dir = tempfile::tempdir().unwrap();
    let workload = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/examples/long-context-128k.yaml"
    );
    let args = |cp: &'static str| {
        vec![
            "plan",
            "--model",
            "llama3.1-8b",
            "--hardware",
            "h100",
            "--ranks",
            "8",
            "--tp",
            "2",
            "--workload",
            workload,
            "--cp",
            cp,
            "--steps",
            "4",
            "--schedule",
            "1f1b,zb-h1",
            "--pp",
            "2,4",
            "--token-budgets",
            "16384,32768",
            "--gantt",
            "g.png",
        ]
    };
    let mut only_cp = args("2");
    only_cp.extend(["-o", "p.yaml", "--format", "json"]);
    let v = flatpipe(dir.path(), &only_cp).json();
    let predicted = v["chosen"]["predicted"]["step_time_mean_s"]
        .as_f64()
        .unwrap();
    assert_eq!(v["plans"][0]["context_parallel"]["cp"], 2, "{v}");
    let text = std::fs::read_to_string(dir.path().join("p.yaml")).unwrap();
    assert!(
        text.contains("context_parallel:") && text.contains("comm: p2p"),
        "{text}"
    );
    let s = flatpipe_json(
        dir.path(),
        &[
            "simulate", "--plan", "p.yaml", "--steps", "4", "--format", "json",
        ],
    );
    assert!((s[0]["step_time_s"]["mean"].as_f64().unwrap() - predicted).abs() < 1e-9 * predicted);
    let both = flatpipe(dir.path(), &args("1,2"));
    assert!(
        both.stdout.contains("Long sequences: the chosen plan runs")
            && both.stdout.contains("cp 2 p2p")
            && both.stdout.contains("chunks"),
        "{}",
        both.stdout
    );
}
