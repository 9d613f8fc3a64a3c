//! Refusals of bad options and values: exit 2, naming the flag and the allowed range.

use crate::cli::common::{flatpipe, repo_file};

// Any command.

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
        // Expert parallelism: a divisor of dp and of the experts, on a model that has them.
        (
            &[
                "simulate",
                "--model",
                "qwen3-30b-a3b",
                "--dp",
                "4",
                "--ep",
                "8",
            ],
            "--ep = 8 is invalid: a divisor of --dp = 4",
        ),
        (
            &[
                "simulate",
                "--model",
                "qwen3-30b-a3b",
                "--dp",
                "6",
                "--ep",
                "3",
            ],
            "a divisor of the 128 routed experts of layer 1 of the model",
        ),
        (
            &["simulate", "--dp", "2", "--ep", "2"],
            "no mixture-of-experts layer",
        ),
    ];
    for (args, needle) in cases {
        let o = flatpipe(dir.path(), args);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", o.stderr);
        assert!(o.stderr.contains(needle), "{args:?}: {}", o.stderr);
        assert!(!o.stderr.contains("panicked"), "{args:?}");
    }
}

/// Every `--flag` the `flatpipe` command takes, read from its own `--help` pages (the
/// top-level page's command list, then each command's option lines).
fn flatpipe_flags(dir: &std::path::Path) -> std::collections::BTreeSet<String> {
    let top = flatpipe(dir, &["--help"]).stdout;
    let commands: Vec<String> = top
        .lines()
        .skip_while(|l| !l.starts_with("Commands:"))
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .filter_map(|l| l.split_whitespace().next().map(str::to_string))
        .filter(|c| c != "help")
        .collect();
    assert!(commands.len() >= 8, "{top}");
    let mut flags = std::collections::BTreeSet::new();
    for c in commands {
        // The options' own lines (`  -v, --verbose...`, `      --pp <PP>`), not their prose,
        // which may name other tools' flags (cargo's `--features`).
        let help = flatpipe(dir, &[c.as_str(), "--help"]).stdout;
        // (`- highs: ... --features highs` lists a value, not an option.)
        let option_line = |l: &&str| {
            let t = l.trim_start().as_bytes();
            t.len() > 1 && t[0] == b'-' && (t[1] == b'-' || t[1].is_ascii_alphabetic())
        };
        for line in help.lines().filter(option_line) {
            flags.extend(flags_in(line).into_iter().take(1));
        }
    }
    flags.remove("--help");
    flags.remove("--version");
    flags
}

/// The `--flag` words in `text`: `--` after a non-word character, then `[a-z0-9-]+`.
fn flags_in(text: &str) -> Vec<String> {
    let bytes = text.as_bytes();
    let word = |b: u8| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-';
    let mut out = vec![];
    let mut i = 0;
    while let Some(at) = text[i..].find("--") {
        let start = i + at;
        let mut end = start + 2;
        while end < bytes.len() && word(bytes[end]) {
            end += 1;
        }
        let before_ok =
            start == 0 || !(bytes[start - 1].is_ascii_alphanumeric() || bytes[start - 1] == b'-');
        if before_ok && end > start + 2 && bytes[start + 2].is_ascii_lowercase() {
            out.push(text[start..end].to_string());
        }
        i = end.max(start + 2);
    }
    out
}

/// The libraries name what they check in their own words (a plan file's keys, such as
/// `token_budget`), never a flag of the `flatpipe` command: the command line maps those fields
/// to its flags when it prints an error (`--token-budget = 0 is invalid`). Every flag the
/// command's `--help` pages list is looked for in every code line of the library crates
/// (comments and unit tests aside); the exporters may write the target tools' own flags
/// (Megatron-LM's `--sequence-parallel`), which flatpipe does not take.
#[test]
fn library_code_names_no_flatpipe_flag() {
    let dir = tempfile::tempdir().unwrap();
    let flags = flatpipe_flags(dir.path());
    assert!(
        flags.contains("--token-budget") && flags.contains("--ranks"),
        "{flags:?}"
    );
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut found = vec![];
    for krate in crate::architecture::LIBRARIES {
        for file in crate::architecture::rust_files(&root.join(krate).join("src")) {
            let text = std::fs::read_to_string(&file).unwrap();
            for (n, line) in crate::architecture::code_lines(&text) {
                let code = line.split(" // ").next().unwrap_or(line);
                for f in flags_in(code).into_iter().filter(|f| flags.contains(f)) {
                    found.push(format!("{}:{n}: {f}: {}", file.display(), line.trim()));
                }
            }
        }
    }
    assert!(
        found.is_empty(),
        "library code names flatpipe's flags (name the field instead):\n{}",
        found.join("\n")
    );
}

/// The flag reader finds flags as words, not inside other words or dashes.
#[test]
fn the_flag_reader_finds_whole_flags() {
    assert_eq!(
        flags_in("use --pp 4 or --token-budget=8; x--y, ---, --no-chunk. a-- b"),
        ["--pp", "--token-budget", "--no-chunk"]
    );
}

/// The command line names its flags where it refuses a value.
#[test]
fn the_command_line_names_flags_in_errors() {
    let dir = tempfile::tempdir().unwrap();
    let o = flatpipe(dir.path(), &["simulate", "--token-budget", "0"]);
    assert!(
        o.stderr.contains("--token-budget = 0 is invalid"),
        "{}",
        o.stderr
    );
    let o = flatpipe(dir.path(), &["simulate", "--costs", "f=1,b=x"]);
    assert!(
        o.stderr.contains("--costs b = x is invalid"),
        "{}",
        o.stderr
    );
}

/// Out-of-range requests are refused with the numbers: a message that must not list `all` while
/// refusing it; `--costs` values whose nanoseconds overflow (f = 1e10 s gave a 98.9% bubble) or
/// round to zero; work that overflows the clock; an `execute` of a billion sequences per step
/// (it sampled until it ran out of memory).
#[test]
fn out_of_range_costs_sizes_and_schedule_names_are_refused_with_the_numbers() {
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
        let err = &o.stderr;
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        for n in *needles {
            assert!(err.contains(n), "{args:?}: {err}");
        }
        assert!(!err.contains("or all"), "{args:?}: {err}");
    }
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
    assert!(ok.status.success(), "{}", ok.stderr);
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
    let e = &o.stderr;
    assert!(
        e.contains("--model tiny is model tiny with 10 layers")
            && e.contains("is of model llama3.1-8b with 34 layers"),
        "{e}"
    );
}

// Options that `--costs` excludes or needs.

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
        assert!(o.stderr.contains(extra[0]), "{}", o.stderr);
    }
}

#[test]
fn costs_refuse_monte_carlo_options() {
    let dir = tempfile::tempdir().unwrap();
    let o = flatpipe(dir.path(), &["simulate", "--costs", "f=1", "--steps", "1"]);
    assert!(o.status.success(), "--steps 1 is one step: {}", o.stderr);
    for extra in [
        ["--steps", "5"],
        ["--policy", "padded"],
        ["--capacity", "8"],
    ] {
        let mut args = vec!["simulate", "--costs", "f=1"];
        args.extend(extra);
        let o = flatpipe(dir.path(), &args);
        assert_eq!(o.status.code(), Some(2), "{extra:?}");
        assert!(o.stderr.contains(extra[0]), "{}", o.stderr);
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
        assert!(o.stderr.contains(needle), "{args:?}: {}", o.stderr);
    }
}

/// Per-rank `--costs` lists whose lengths do not match --pp are refused with both numbers.
#[test]
fn per_rank_cost_lists_that_do_not_match_pp_are_refused() {
    let dir = tempfile::tempdir().unwrap();
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
        assert!(o.stderr.contains(want), "{costs}: {}", o.stderr);
    }
}

/// `--zb-objective` without --costs is refused, naming --costs.
#[test]
fn zb_objective_without_costs_is_refused() {
    let dir = tempfile::tempdir().unwrap();
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
    assert!(o.stderr.contains("--costs"), "{}", o.stderr);
}

// Parallelism and backends.

/// A tp that does not divide the GPUs per node is refused naming the flag's value and the node
/// (`plan` refuses an invalid degree in a --tp list); `execute` refuses a plan with tensor
/// parallelism (priced, not executed).
#[test]
fn tensor_parallel_degrees_that_cannot_run_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    // plan refuses a --tp list with an invalid degree (it dropped it silently), listing the
    // valid ones.
    let o = flatpipe(dir.path(), &["plan", "--tp", "2,3", "--gantt", "none"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        o.stderr.contains("--tp 3 is invalid: one of 1, 2, 4, 8"),
        "{}",
        o.stderr
    );
    let o = flatpipe(dir.path(), &["simulate", "--tp", "3", "--gantt", "none"]);
    assert_eq!(o.status.code(), Some(2));
    let err = &o.stderr;
    assert!(
        err.contains("tp = 3") && err.contains("8 GPUs per node"),
        "{err}"
    );
    let text = std::fs::read_to_string(repo_file("examples/cpu-tiny/plan.yaml"))
        .unwrap()
        .replace("dp: 1\n", "dp: 1\ntp: 2\n");
    std::fs::write(dir.path().join("t.yaml"), text).unwrap();
    let o = flatpipe(
        dir.path(),
        &[
            "execute", "--plan", "t.yaml", "--steps", "1", "--gantt", "none",
        ],
    );
    assert_eq!(o.status.code(), Some(2), "{}", o.stderr);
    assert!(o.stderr.contains("tp = 2"), "{}", o.stderr);
}

/// `--sharding` refuses an unknown mode naming the flag and the allowed values.
#[test]
fn plan_refuses_an_unknown_sharding_mode() {
    let dir = tempfile::tempdir().unwrap();
    let o = flatpipe(
        dir.path(),
        &["plan", "--sharding", "zero4", "--gantt", "none"],
    );
    assert_eq!(o.status.code(), Some(2));
    let err = &o.stderr;
    assert!(
        err.contains("--sharding") && err.contains("zero4") && err.contains("fsdp-mb"),
        "{err}"
    );
}

#[test]
fn gpu_only_options_on_the_cpu_backend_are_refused() {
    let dir = tempfile::tempdir().unwrap();
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
        assert!(o.stderr.contains(needle), "{args:?}: {}", o.stderr);
    }
}

#[test]
fn bad_execute_options_and_a_zb_auto_limit_too_small_are_refused() {
    let dir = tempfile::tempdir().unwrap();
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
        assert!(o.stderr.contains(needle), "{args:?}: {}", o.stderr);
        assert!(!o.stderr.contains("panicked"), "{args:?}");
    }
}
