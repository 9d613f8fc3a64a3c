//! The planner: partition solvers against each other and by hand, memory limits, exports, and
//! the chosen plan against the plans a user would try by hand.

use flatpipe::planner::export::{
    megatron, megatron_layout, parse_megatron_layout, torchtitan, verl,
};
use flatpipe::planner::partition::{
    LayerCost, PartitionProblem, StaticBytes, solve, solve_dp, solve_milp,
};
use flatpipe::planner::search::{RankBy, SearchConfig, SearchSpace, search};
use flatpipe::profiles::{AnalyticOptions, StepSize, analytic_profile, builtins};
use flatpipe::simulator::batching::policy::Policy;
use flatpipe::simulator::costs::Recompute;
use flatpipe::simulator::costs::sharding::Sharding;
use flatpipe::simulator::run::plan::even_split;
use flatpipe::simulator::run::{
    config::{Capacity, RunConfig, ScheduleSource},
    montecarlo,
};
use flatpipe::simulator::{Placement, PlacementKind, Plan, ScheduleKind};
use proptest::prelude::*;

fn layers(times: &[f64], params: &[u64], act: &[f64]) -> Vec<LayerCost> {
    times
        .iter()
        .zip(params)
        .zip(act)
        .map(|((&t, &p), &a)| LayerCost {
            time_s: [t, t * 1.1, t * 1.3],
            act_bytes: [a, a * 0.5, a * 0.1],
            params: p,
        })
        .collect()
}

fn problem(
    ls: Vec<LayerCost>,
    placement: Placement,
    limit: f64,
    modes: Vec<Recompute>,
) -> PartitionProblem {
    let s = placement.num_stages() as usize;
    PartitionProblem {
        layers: ls,
        placement,
        inflight: vec![2.0; s],
        memory_limit_bytes: limit,
        static_bytes: StaticBytes::default(),
        modes,
    }
}

/// Every contiguous split of `n` layers into `s` non-empty stages (brute force).
fn splits(n: usize, s: usize) -> Vec<Vec<std::ops::Range<usize>>> {
    if s == 1 {
        return vec![std::iter::once(0..n).collect()];
    }
    let mut out = Vec::new();
    for first in 1..=n - (s - 1) {
        for rest in splits(n - first, s - 1) {
            let v = std::iter::once(0..first)
                .chain(rest.into_iter().map(|r| r.start + first..r.end + first));
            out.push(v.collect());
        }
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(40))]

    /// The MILP and the exact DP find the same optimum of the plain contiguous min-max split.
    #[test]
    fn milp_equals_dp(times in prop::collection::vec(1u32..20, 2..14), p in 1u32..5) {
        prop_assume!(times.len() >= p as usize);
        let t: Vec<f64> = times.iter().map(|&x| x as f64).collect();
        let n = t.len();
        let pr = problem(layers(&t, &vec![0; n], &vec![0.0; n]), Placement::looped(p, 1), f64::INFINITY, vec![Recompute::None]);
        let dp = solve_dp(&pr, false).unwrap();
        let milp = solve_milp(&pr).unwrap();
        prop_assert!((dp.bottleneck_s - milp.bottleneck_s).abs() < 1e-9, "dp {} milp {}", dp.bottleneck_s, milp.bottleneck_s);
        prop_assert_eq!(dp.stages.iter().map(|r| r.len()).sum::<usize>(), n);
    }

    /// With memory limits and recomputation on two stages per rank, the MILP matches a brute
    /// force over every split and mode, and `solve` is feasible and no better than that optimum
    /// nor below its certified lower bound.
    #[test]
    fn milp_matches_brute_force_with_memory(
        times in prop::collection::vec(1u32..10, 4..8),
        params in prop::collection::vec(0u64..4, 4..8),
        limit in 20.0f64..60.0,
    ) {
        let n = times.len().min(params.len());
        let t: Vec<f64> = times[..n].iter().map(|&x| x as f64).collect();
        let act: Vec<f64> = vec![2.0; n];
        let placement = Placement::looped(2, 2);
        let modes = vec![Recompute::None, Recompute::Selective, Recompute::Full];
        let pr = problem(layers(&t, &params[..n], &act), placement.clone(), limit, modes.clone());
        let mut best = f64::INFINITY;
        for split in splits(n, 4) {
            for combo in 0..81usize {
                let rec: Vec<Recompute> = (0..4).map(|s| modes[(combo / 3usize.pow(s as u32)) % 3]).collect();
                if pr.rank_memory(&split, &rec).iter().all(|&m| m <= limit) {
                    let idx = |m: Recompute| modes.iter().position(|x| *x == m).unwrap();
                    let b = split.iter().zip(&rec).map(|(r, &m)| pr.layers[r.clone()].iter().map(|l| l.time_s[idx(m)]).sum::<f64>()).fold(0.0, f64::max);
                    best = best.min(b);
                }
            }
        }
        match solve_milp(&pr) {
            Ok(m) => prop_assert!((m.bottleneck_s - best).abs() < 1e-6, "milp {} brute {}", m.bottleneck_s, best),
            Err(_) => prop_assert!(best.is_infinite()),
        }
        // `solve` (the default branch and bound) finds the brute-force optimum and proves it.
        if let Ok(s) = solve(&pr) {
            prop_assert!(s.rank_memory_bytes.iter().all(|&m| m <= limit + 1e-9));
            prop_assert!((s.bottleneck_s - best).abs() < 1e-9, "solve {} ({}) brute {}", s.bottleneck_s, s.solver, best);
            prop_assert!(s.optimal, "{}", s.solver);
            prop_assert!(s.lower_bound_s <= best + 1e-9);
        } else {
            prop_assert!(best.is_infinite());
        }
    }

    /// On larger problems (up to 14 layers, 2-3 ranks, 2-3 stages per rank, looped and V
    /// placements, per-layer parameters and activations), the branch and bound and the MILP
    /// (good_lp's microlp, an independent formulation) reach the same optimal bottleneck.
    #[test]
    fn branch_and_bound_equals_milp(
        times in prop::collection::vec(1u32..30, 14),
        params in prop::collection::vec(0u64..6, 14),
        acts in prop::collection::vec(1u32..8, 14),
        n in 8usize..15,
        p in 2u32..4,
        v in 2u32..4,
        v_shape in any::<bool>(),
        tightness in 0.3f64..1.0,
    ) {
        let placement = if v_shape { Placement::v_shape(p) } else { Placement::looped(p, v) };
        let s = placement.num_stages() as usize;
        prop_assume!(n >= s);
        let t: Vec<f64> = times[..n].iter().map(|&x| x as f64).collect();
        let act: Vec<f64> = acts[..n].iter().map(|&x| x as f64).collect();
        let modes = Recompute::ALL.to_vec();
        let mut pr = problem(layers(&t, &params[..n], &act), placement, f64::INFINITY, modes);
        pr.inflight = (0..s).map(|i| (s - i) as f64).collect();
        // A limit between the leanest spread and the memory-free optimum's heaviest rank.
        let free = solve_dp(&pr, true).unwrap();
        let heaviest = free.rank_memory_bytes.iter().copied().fold(0.0, f64::max);
        pr.memory_limit_bytes = heaviest * tightness;
        let milp = solve_milp(&pr);
        match (solve(&pr), milp) {
            (Ok(b), Ok(m)) => {
                prop_assert!(b.optimal, "{}", b.solver);
                prop_assert!((b.bottleneck_s - m.bottleneck_s).abs() < 1e-6, "bnb {} milp {}", b.bottleneck_s, m.bottleneck_s);
                prop_assert!(b.rank_memory_bytes.iter().all(|&x| x <= pr.memory_limit_bytes));
            }
            (Err(_), Err(_)) => {}
            (b, m) => prop_assert!(false, "bnb {:?} milp {:?}", b.map(|x| x.bottleneck_s), m.map(|x| x.bottleneck_s)),
        }
    }
}

/// The unconstrained optimum puts too much on the rank holding the heavy embedding; under the
/// limit the split moves layers off it (and stays optimal by the DP, exact for one stage per
/// rank).
#[test]
fn memory_limit_moves_layers_off_the_heavy_rank() {
    // 8 layers of time 1; layer 0 has 10 parameters (160 bytes), the others none; each layer's
    // activations are 10 bytes per microbatch, 2 in flight: 20 bytes per layer.
    let mut params = vec![0u64; 8];
    params[0] = 10;
    let ls = layers(&[1.0; 8], &params, &[10.0; 8]);
    let free = solve_dp(
        &problem(
            ls.clone(),
            Placement::looped(2, 1),
            f64::INFINITY,
            vec![Recompute::None],
        ),
        false,
    )
    .unwrap();
    assert_eq!(free.stages, vec![0..4, 4..8]); // rank 0: 160 + 4 * 20 = 240 bytes
    let limited = solve_dp(
        &problem(ls, Placement::looped(2, 1), 200.0, vec![Recompute::None]),
        false,
    )
    .unwrap();
    // Rank 0 may hold 160 + 2 * 20 = 200 bytes: two layers; the rest (6) go to rank 1.
    assert_eq!(limited.stages, vec![0..2, 2..8]);
    assert_eq!(limited.bottleneck_s, 6.0);
}

#[test]
fn infeasible_requests_explain_the_heaviest_rank() {
    let ls = layers(&[1.0; 4], &[1 << 30; 4], &[1.0; 4]);
    let pr = problem(
        ls,
        Placement::looped(2, 1),
        20.0 * (1u64 << 30) as f64,
        vec![Recompute::None],
    );
    let e = solve(&pr).unwrap_err().to_string();
    // Each rank holds 2 layers of 1 Gi parameters: 2 * 16 = 32 GiB (params 4, grads 4, optimizer 24).
    assert!(
        e.contains("rank 0 needs 32.0 GiB: params 4.0, grads 4.0, optimizer 24.0")
            && e.contains("limit 20.0 GiB"),
        "{e}"
    );
}

fn profile() -> flatpipe::profiles::Profile {
    let m = builtins::model("llama3.1-8b").unwrap();
    let h = builtins::hardware("h200").unwrap();
    analytic_profile(&m, &h, &AnalyticOptions::default()).unwrap()
}

fn plan(schedule: ScheduleKind, pp: u32, stages: &[std::ops::Range<usize>]) -> Plan {
    let mut p = Plan::new("sharegpt-v3", schedule, pp, stages, 16_384);
    p.inputs.model = Some("llama3.1-8b".into());
    p.inputs.hardware = Some("h200".into());
    p
}

#[test]
fn context_parallelism_exports_as_megatron_and_torchtitan_run_it() {
    use flatpipe::profiles::context_parallel::{ContextParallel, CpBalance, CpComm};
    let prof = profile();
    let stages = even_split(34, 2).unwrap();
    let group = |cp, comm, balance, dynamic| ContextParallel {
        cp,
        comm,
        balance,
        max_seqlen_per_rank: dynamic,
    };
    for (cp, want_m, want_t) in [
        (
            group(2, CpComm::Ring, CpBalance::Zigzag, None),
            "--cp-comm-type p2p",
            Some("alltoall"),
        ),
        (
            group(4, CpComm::Ulysses, CpBalance::Zigzag, None),
            "--cp-comm-type a2a",
            None,
        ),
        (
            group(2, CpComm::AllGather, CpBalance::Zigzag, None),
            "--cp-comm-type allgather",
            Some("allgather"),
        ),
        (
            group(4, CpComm::Hierarchical { a2a: 2 }, CpBalance::Zigzag, None),
            "--hierarchical-context-parallel-sizes 2 2",
            None,
        ),
    ] {
        let mut p = plan(ScheduleKind::OneFOneB, 2, &stages);
        p.run.context_parallel = Some(cp);
        let args = megatron(&p, &prof, 4).unwrap();
        megatron_rules(&args, 2, 1).unwrap_or_else(|e| panic!("{e}\n{args}"));
        assert!(
            args.contains(&format!("--context-parallel-size {}", cp.cp)) && args.contains(want_m),
            "{args}"
        );
        assert!(
            !args.contains("# warning: the plan runs dynamic cp"),
            "{args}"
        );
        match (torchtitan(&p, &prof, 4, None), want_t) {
            (Ok(t), Some(rotate)) => {
                assert!(
                    t.contains(&format!("context_parallel_degree = {}", cp.cp)),
                    "{t}"
                );
                assert!(
                    t.contains(&format!("context_parallel_rotate_method = \"{rotate}\"")),
                    "{t}"
                );
                // Varlen attention does not run with cp in torchtitan: the flex flavor does.
                assert!(t.contains("flavor = \"8B_flex\""), "{t}");
            }
            (Err(e), None) => assert!(e.to_string().contains("no Ulysses"), "{e}"),
            (got, want) => panic!("{cp:?}: {got:?} vs {want:?}"),
        }
    }
    // A budget the target cannot cut into 2 cp chunks is refused, with the numbers.
    let mut p = plan(ScheduleKind::OneFOneB, 2, &stages);
    p.run.context_parallel = Some(group(3, CpComm::Ring, CpBalance::Zigzag, None));
    let e = megatron(&p, &prof, 4).unwrap_err().to_string();
    assert!(e.contains("16384") && e.contains("= 6"), "{e}");
    // Dynamic and contiguous are what neither runs under a pipeline: warned.
    p.run.context_parallel = Some(group(2, CpComm::Ring, CpBalance::Contiguous, Some(8192)));
    let args = megatron(&p, &prof, 4).unwrap();
    megatron_rules(&args, 2, 1).unwrap_or_else(|e| panic!("{e}\n{args}"));
    assert!(
        args.contains("dynamic cp") && args.contains("zigzag"),
        "{args}"
    );
    // The rules catch what Megatron refuses.
    let bad = args.replace("--cp-comm-type p2p", "--cp-comm-type a2a+p2p");
    assert!(
        megatron_rules(&bad, 2, 1)
            .unwrap_err()
            .contains("without hierarchical")
    );
}

#[test]
fn megatron_layout_round_trips() {
    let prof = profile();
    let stages = even_split(34, 8).unwrap();
    let p = plan(ScheduleKind::Interleaved1F1B, 4, &stages);
    let layout = megatron_layout(&p, &prof).unwrap();
    // 34 layers into 8 stages: 5,5,4,4,4,4,4,4 -> E + 4 decoders first, 3 decoders + loss last.
    assert_eq!(layout, "Etttt|ttttt|tttt|tttt|tttt|tttt|tttt|tttL");
    let parsed = parse_megatron_layout(&layout).unwrap();
    let sizes: Vec<usize> = parsed
        .iter()
        .map(|(e, t, l)| usize::from(*e) + t + usize::from(*l))
        .collect();
    assert_eq!(sizes, stages.iter().map(|r| r.len()).collect::<Vec<_>>());
    // "E(tt|)*2t|tL" expands to "Ett|tt|t|tL".
    assert_eq!(
        parse_megatron_layout("E(tt|)*2t|tL").unwrap(),
        vec![
            (true, 2, false),
            (false, 2, false),
            (false, 1, false),
            (false, 1, true)
        ]
    );
    // The layout alone carries the virtual stages (Megatron refuses it with a second one).
    let args = megatron(&p, &prof, 12).unwrap();
    megatron_rules(&args, 4, 1).unwrap_or_else(|e| panic!("{e}\n{args}"));
    // V placements cannot be expressed; ZB warns.
    let v = plan(ScheduleKind::ZbV, 4, &stages);
    assert!(
        megatron(&v, &prof, 12)
            .unwrap_err()
            .to_string()
            .contains("V placement")
    );
    let zb = plan(ScheduleKind::ZbH1, 4, &even_split(34, 4).unwrap());
    assert!(
        megatron(&zb, &prof, 12)
            .unwrap()
            .starts_with("# warning: Megatron-LM has no zb-h1")
    );
    let tt = torchtitan(&zb, &prof, 12, Some("s.csv")).unwrap();
    assert!(
        tt.contains("module_fqns_per_model_part = [[\"tok_embeddings\", \"layers.0\""),
        "{tt}"
    );
    assert!(
        tt.contains("\"layers.31\", \"norm\", \"output\"]]")
            && tt.contains("pipeline_parallel_schedule_csv = \"s.csv\""),
        "{tt}"
    );
    assert!(
        tt.contains("seq_len = 16384") && tt.contains("local_batch_size = 12"),
        "{tt}"
    );
    assert_eq!(PlacementKind::V, v.placement());
}

/// A search asked to keep no plan is refused, naming `keep` (it panicked indexing an empty
/// ranking).
#[test]
fn a_search_keeping_no_plan_is_refused() {
    let prof = profile();
    let w = builtins::workload("sharegpt-v3").unwrap();
    let config = SearchConfig {
        steps: 2,
        seed: 0,
        size: StepSize::Seqs(16),
        memory_limit_bytes: prof.hardware.memory_bytes as f64,
        state_bytes: None,
        rank_by: RankBy::Mean,
        keep: 0,
        exact_split: flatpipe::planner::partition::ExactSplit::DEFAULT,
        forward_only: None,
    };
    let e = search(&prof, &w, &SearchSpace::default_for(8), &config, &|_, _| {})
        .unwrap_err()
        .to_string();
    assert!(e.contains("keep") && e.contains(">= 1"), "{e}");
}

/// On the embedded default (Llama-3.1-8B, 8 H200, ShareGPT) the chosen plan is at least as fast,
/// on the same sampled steps, as 1F1B at pp = 2, 4, 8 with an even split (dp = 8 / pp, token
/// budget 16,384), the plans a user would try by hand.
#[test]
fn default_plan_beats_hand_written_1f1b() {
    let prof = profile();
    let w = builtins::workload("sharegpt-v3").unwrap();
    let limit = prof.hardware.memory_bytes as f64 - 4.0 * (1u64 << 30) as f64;
    let config = SearchConfig {
        steps: 64,
        seed: 0,
        size: StepSize::Seqs(128),
        memory_limit_bytes: limit,
        state_bytes: None,
        rank_by: RankBy::Mean,
        keep: 5,
        exact_split: flatpipe::planner::partition::ExactSplit::DEFAULT,
        forward_only: None,
    };
    let result = search(&prof, &w, &SearchSpace::default_for(8), &config, &|_, _| {}).unwrap();
    let best = result.ranked[0].summary.step_time_s.mean;
    for pp in [2u32, 4, 8] {
        let stages = even_split(prof.layers.len(), pp as usize).unwrap();
        let mut combo = RunConfig::new(
            ScheduleSource::Kind(ScheduleKind::OneFOneB),
            pp,
            1,
            stages,
            Policy::FlatFfd,
            Capacity::Dynamic,
        );
        combo.dp = 8 / pp;
        let mc = montecarlo::run(&prof, &w, 0, StepSize::Seqs(128), 64, &[combo], &|| {}).unwrap();
        let hand = montecarlo::summarize(&mc.outcomes[0], 8, prof.hardware.peak_flops)
            .step_time_s
            .mean;
        assert!(best <= hand, "chosen {best} s vs 1f1b pp={pp}: {hand} s");
    }
}

/// The README's main job (Llama-3.1-8B, 8 H200, sharegpt-v3, 64 steps) unsharded and without
/// tensor parallelism: the default split
/// solver (branch and bound) chooses the same plan as HiGHS's MILP, and on every candidate
/// where both ran to a proof they agree on the bottleneck (HiGHS stops at a 1% gap).
#[cfg(feature = "highs")]
#[test]
fn branch_and_bound_chooses_the_plan_highs_chooses() {
    use flatpipe::planner::partition::{ExactSplit, MILP_TIME_LIMIT_S};
    let prof = profile();
    let w = builtins::workload("sharegpt-v3").unwrap();
    let limit = prof.hardware.memory_bytes as f64 - 4.0 * (1u64 << 30) as f64;
    let run = |exact| {
        let config = SearchConfig {
            steps: 64,
            seed: 0,
            size: StepSize::Seqs(128),
            memory_limit_bytes: limit,
            state_bytes: None,
            rank_by: RankBy::Mean,
            keep: 5,
            exact_split: exact,
            forward_only: None,
        };
        // Unsharded replicas without tensor parallelism, where memory binds the splits most
        // (the main job's answer is now no pipeline at all, whose split is trivial).
        let mut space = SearchSpace::default_for(8);
        space.tp = vec![1];
        space.sharding = vec![flatpipe::simulator::costs::sharding::Sharding::Ddp];
        search(&prof, &w, &space, &config, &|_, _| {}).unwrap()
    };
    let bnb = run(ExactSplit::DEFAULT);
    let highs = run(ExactSplit::Highs {
        time_limit_s: MILP_TIME_LIMIT_S,
    });
    // A candidate's layout, budget and chunk size; with its split, the whole plan.
    let layout = |c: &flatpipe::planner::search::Candidate| {
        (
            c.schedule(),
            c.tp,
            c.run.sharding,
            c.run.dp,
            c.run.pp,
            c.run.v,
            c.token_budget(),
            c.chunk_tokens(),
        )
    };
    let key = |c: &flatpipe::planner::search::Candidate| {
        (layout(c), c.run.stages.clone(), c.run.recompute.clone())
    };
    assert_eq!(key(&bnb.ranked[0]), key(&highs.ranked[0]));
    // HiGHS stops at a relative gap of 1%, `(primal - dual) / primal <= 0.01`: its split is
    // within a factor 1 / 0.99 of the optimum (not 1.01, which a split 1.0100x off failed).
    let gap = 1.0 / (1.0 - 0.01);
    // The same candidate (layout and budget) in both rankings: their orders below the first
    // may differ, so pairing by rank compared different candidates.
    for b in &bnb.ranked {
        let Some(h) = highs.ranked.iter().find(|h| layout(h) == layout(b)) else {
            continue;
        };
        if b.split.optimal && h.split.optimal {
            let (bs, hs) = (b.split.bottleneck_s, h.split.bottleneck_s);
            assert!(bs <= hs * (1.0 + 1e-9), "bnb {bs} highs {hs}");
            assert!(hs <= bs * gap * (1.0 + 1e-9), "bnb {bs} highs {hs}");
        }
    }
}

/// The layout's multi-token-prediction rules (`PipelineParallelLayerLayout.validate_layer_layout`
/// in `megatron/core/transformer/pipeline_parallel_layer_layout.py`): as many `m` layers as
/// `--mtp-num-layers` (none without it), no decoder layer after the first `m`, and `m` only in
/// a rank's last virtual stage (stage index `vpp_index * pp + pp_rank`). `layout` is
/// flatpipe's, written out without repetition.
fn mtp_rules(
    layout: &str,
    args: &std::collections::HashMap<String, Option<String>>,
    pp: usize,
    vpp: usize,
) -> Result<(), String> {
    let want: usize = match args.get("--mtp-num-layers") {
        Some(Some(n)) => n.parse().map_err(|_| format!("--mtp-num-layers {n}"))?,
        Some(None) => return Err("--mtp-num-layers without a value".into()),
        None => 0,
    };
    let flat: String = layout.chars().filter(|c| *c != '|').collect();
    if flat.matches('m').count() != want {
        return Err(format!(
            "{} mtp layers in the layout, --mtp-num-layers {want}",
            flat.matches('m').count()
        ));
    }
    if let Some(first) = flat.find('m')
        && flat[first..].contains('t')
    {
        return Err("decoder layers must be placed before MTP layers".into());
    }
    for (i, stage) in layout.split('|').enumerate() {
        if stage.contains('m') && i / pp != vpp - 1 {
            return Err(format!(
                "an MTP layer in stage {i}, not a last virtual stage"
            ));
        }
    }
    Ok(())
}

/// The rules Megatron-LM's own argument checks enforce on the arguments flatpipe exports,
/// parsed from the exported text (`megatron-core` does not ship `arguments.py`, so they are
/// encoded here, each with its source, Megatron-LM at d98e8a6, 2026-08-22):
/// - `megatron/training/arguments.py`, `validate_args`: at most one of
///   `--num-layers-per-virtual-pipeline-stage`, `--num-virtual-stages-per-pipeline-rank`,
///   `--pipeline-model-parallel-layout`; the layout's stage count divisible by
///   `--pipeline-model-parallel-size`; `selective` granularity takes no `--recompute-method`;
/// - `megatron/core/transformer/transformer_config.py`, `TransformerConfig.__post_init__`:
///   granularity `full` or `selective`; method `block` or `uniform`, required unless
///   `selective`; `--recompute-num-layers` required unless `selective`, and absent with it;
///   group-limited routing names its groups, which divide the experts, and its group top-k is
///   at most the groups and divides the router's top-k.
fn megatron_rules(text: &str, pp: u32, dp: u32) -> Result<(), String> {
    let mut args: std::collections::HashMap<String, Option<String>> = Default::default();
    let flat: String = text
        .lines()
        .filter(|l| !l.starts_with('#'))
        .map(|l| l.trim_end_matches('\\').trim())
        .collect::<Vec<_>>()
        .join(" ");
    let mut words = flat.split_whitespace().peekable();
    while let Some(w) = words.next() {
        let name = w.to_string();
        if !name.starts_with("--") {
            return Err(format!("stray word `{name}`"));
        }
        // A flag takes the words up to the next flag (`nargs='+'` lists joined by a space).
        let mut values = Vec::new();
        while let Some(v) = words.peek().filter(|v| !v.starts_with("--")) {
            values.push(v.trim_matches('"').to_string());
            words.next();
        }
        let value = (!values.is_empty()).then(|| values.join(" "));
        if args.insert(name.clone(), value).is_some() {
            return Err(format!("{name} given twice"));
        }
    }
    let vpp_args = [
        "--num-layers-per-virtual-pipeline-stage",
        "--num-virtual-stages-per-pipeline-rank",
        "--pipeline-model-parallel-layout",
    ];
    if vpp_args.iter().filter(|a| args.contains_key(**a)).count() > 1 {
        return Err("more than one of the virtual-pipeline arguments".into());
    }
    if args.get("--pipeline-model-parallel-size") != Some(&Some(pp.to_string())) {
        return Err(format!("--pipeline-model-parallel-size is not {pp}"));
    }
    let mut vpp = 1;
    if let Some(Some(layout)) = args.get("--pipeline-model-parallel-layout") {
        let stages = parse_megatron_layout(layout)
            .map_err(|e| e.to_string())?
            .len();
        if stages % pp as usize != 0 {
            return Err(format!("{stages} layout stages, not a multiple of pp {pp}"));
        }
        vpp = stages / pp as usize;
        mtp_rules(layout, &args, pp as usize, vpp)?;
    }
    // The batch (megatron/training/arguments.py, validate_args: micro batch > 0;
    // megatron/core/num_microbatches_calculator.py: the global batch a multiple of micro batch
    // x dp; megatron/core/pipeline_parallel/schedules.py, interleaved: pp <= group <= M, and the
    // last group, M mod microbatch_group_size_per_vp_stage (default pp), 0 or >= pp).
    let int = |name: &str| -> Result<Option<u64>, String> {
        match args.get(name) {
            None => Ok(None),
            Some(Some(v)) => v.parse().map(Some).map_err(|_| format!("{name} {v}")),
            Some(None) => Err(format!("{name} without a value")),
        }
    };
    if let Some(mbs) = int("--micro-batch-size")? {
        let gbs = int("--global-batch-size")?.unwrap_or(mbs * u64::from(dp));
        if mbs == 0 || gbs == 0 || gbs % (mbs * u64::from(dp)) != 0 {
            return Err(format!(
                "global batch {gbs} is not a multiple of {mbs} x dp {dp}"
            ));
        }
        let m = gbs / (mbs * u64::from(dp));
        let pp = u64::from(pp);
        // With groups of pp, a last group of M mod pp microbatches is fewer than pp unless 0.
        if vpp > 1 && (m < pp || m % pp != 0) {
            return Err(format!("interleaved: {m} microbatches for pp {pp}"));
        }
        if int("--seq-length")?.unwrap_or(0) == 0 {
            return Err("no --seq-length".into());
        }
    }
    // Context parallelism (arguments.py: `--cp-comm-type` choices p2p, a2a, allgather,
    // a2a+p2p; a2a+p2p needs `--hierarchical-context-parallel-sizes`, whose product is cp;
    // megatron/training/utils.py, get_batch_on_this_cp_rank: a sample cut into 2 cp chunks, so
    // the sequence length a multiple of 2 cp, and of tp with sequence parallelism).
    let cp = int("--context-parallel-size")?.unwrap_or(1);
    if cp == 0 {
        return Err("--context-parallel-size 0".into());
    }
    if let Some(comm) = args.get("--cp-comm-type") {
        let comm = comm.clone().ok_or("--cp-comm-type without a value")?;
        if !["p2p", "a2a", "allgather", "a2a+p2p"].contains(&comm.as_str()) {
            return Err(format!("--cp-comm-type {comm}"));
        }
        let sizes = args
            .get("--hierarchical-context-parallel-sizes")
            .cloned()
            .flatten();
        match (comm.as_str(), sizes) {
            ("a2a+p2p", Some(s)) => {
                let product: u64 = s
                    .split(' ')
                    .map(|x| x.parse::<u64>().unwrap_or(0))
                    .product();
                if product != cp {
                    return Err(format!("hierarchical sizes {s}, product not cp {cp}"));
                }
            }
            ("a2a+p2p", None) => return Err("a2a+p2p without hierarchical sizes".into()),
            (_, Some(_)) => return Err("hierarchical sizes without a2a+p2p".into()),
            _ => {}
        }
    }
    if cp > 1 {
        let seq = int("--seq-length")?.ok_or("context parallelism without --seq-length")?;
        let tp = int("--tensor-model-parallel-size")?.unwrap_or(1);
        let sp = if args.contains_key("--sequence-parallel") {
            tp
        } else {
            1
        };
        if seq % (2 * cp * sp) != 0 {
            return Err(format!(
                "--seq-length {seq} not a multiple of 2 cp x tp = {}",
                2 * cp * sp
            ));
        }
    }
    // Expert parallelism (arguments.py: "num_experts must be non None to use expert model
    // parallelism", "Number of experts should be a multiple of expert model parallel_size";
    // megatron/core/parallel_state.py: the world size divisible by expert tp x ep x pp).
    if let Some(ep) = int("--expert-model-parallel-size")? {
        let experts = int("--num-experts")?.ok_or("expert parallelism without --num-experts")?;
        if ep == 0 || experts % ep != 0 {
            return Err(format!("{experts} experts, not a multiple of ep {ep}"));
        }
        let tp = int("--tensor-model-parallel-size")?.unwrap_or(1);
        let etp = int("--expert-tensor-parallel-size")?.unwrap_or(tp);
        let world = tp * cp * u64::from(dp) * u64::from(pp);
        if world % (etp * ep * u64::from(pp)) != 0 {
            return Err(format!(
                "world {world} not divisible by etp {etp} x ep {ep} x pp {pp}"
            ));
        }
        // EP A2A overlap (transformer_config.py's __post_init__): expert parallelism, the
        // all-to-all or flex dispatcher, a virtual pipeline when pp > 1, no full recomputation.
        if args.contains_key("--overlap-moe-expert-parallel-comm") {
            if ep <= 1 {
                return Err("overlap_moe_expert_parallel_comm without expert parallelism".into());
            }
            let dispatcher = args.get("--moe-token-dispatcher-type").cloned().flatten();
            if !matches!(dispatcher.as_deref(), Some("alltoall" | "flex")) {
                return Err(format!("overlap with the {dispatcher:?} dispatcher"));
            }
            if pp > 1 && vpp < 2 {
                return Err("overlap with pp > 1 and no virtual pipeline".into());
            }
            if args
                .get("--recompute-granularity")
                .cloned()
                .flatten()
                .as_deref()
                == Some("full")
            {
                return Err("overlap with full recomputation".into());
            }
        }
        // Group-limited routing (transformer_config.py's __post_init__): the groups given,
        // dividing the experts, no more chosen than exist, and dividing the router's top-k.
        if let Some(g) = int("--moe-router-group-topk")? {
            let groups = int("--moe-router-num-groups")?
                .ok_or("group limited routing without --moe-router-num-groups")?;
            let topk = int("--moe-router-topk")?.unwrap_or(2);
            if groups == 0 || experts % groups != 0 {
                return Err(format!(
                    "{experts} experts not divisible by {groups} groups"
                ));
            }
            if g > groups || g == 0 || topk % g != 0 {
                return Err(format!(
                    "group top-k {g} of {groups} groups, router top-k {topk}"
                ));
            }
        }
    }
    let gran = args.get("--recompute-granularity").cloned().flatten();
    let method = args.get("--recompute-method").cloned().flatten();
    let layers = args.get("--recompute-num-layers").cloned().flatten();
    match gran.as_deref() {
        None => {
            if method.is_some() || layers.is_some() {
                return Err("recompute method or layers without a granularity".into());
            }
        }
        Some("selective") => {
            if method.is_some() || layers.is_some() {
                return Err(
                    "selective takes no --recompute-method / --recompute-num-layers".into(),
                );
            }
        }
        Some("full") => {
            if !matches!(method.as_deref(), Some("block" | "uniform")) {
                return Err(format!(
                    "full needs --recompute-method block|uniform, got {method:?}"
                ));
            }
            match layers.as_deref().map(str::parse::<u32>) {
                Some(Ok(n)) if n >= 1 => {}
                other => {
                    return Err(format!(
                        "full needs --recompute-num-layers >= 1, got {other:?}"
                    ));
                }
            }
        }
        Some(g) => return Err(format!("granularity {g}")),
    }
    Ok(())
}

/// Every loop-placed schedule, v in {1, 2, 4}, and every pattern of per-stage recomputation
/// exports Megatron-LM arguments that pass Megatron's own rules, with a warning wherever
/// Megatron runs another schedule or recomputes differently from the plan.
#[test]
fn megatron_exports_pass_megatrons_argument_checks() {
    let prof = profile();
    let modes = [Recompute::None, Recompute::Selective, Recompute::Full];
    for kind in ScheduleKind::ALL.iter().copied() {
        for v in [1u32, 2, 4] {
            if kind.placement_for(v) == PlacementKind::V {
                continue;
            }
            let stages = even_split(34, (4 * v) as usize).unwrap();
            for pattern in 0..5usize {
                let mut p = plan(kind, 4, &stages);
                p.run.v = v;
                p.run.recompute = (0..stages.len())
                    .map(|s| match pattern {
                        0..=2 => modes[pattern],
                        3 => modes[s % 2], // none / selective mixed
                        _ => modes[s % 3], // all three mixed
                    })
                    .collect();
                let args = megatron(&p, &prof, 12).unwrap();
                megatron_rules(&args, 4, 1)
                    .unwrap_or_else(|e| panic!("{kind} v={v} pattern {pattern}: {e}\n{args}"));
                let same_schedule = kind == ScheduleKind::OneFOneB && v == 1
                    || kind == ScheduleKind::Interleaved1F1B;
                assert_eq!(
                    args.contains("has no"),
                    !same_schedule,
                    "{kind} v={v}\n{args}"
                );
                // Exact only when every stage has the same mode (and full is flatpipe's full).
                let warned = args.contains("cannot recompute per stage");
                assert_eq!(
                    warned,
                    pattern >= 3,
                    "{kind} v={v} pattern {pattern}\n{args}"
                );
                if pattern == 1 {
                    assert!(args.contains("core_attn"), "{args}");
                }
            }
        }
    }
}

/// The plan's sharding reaches both exports: torchtitan's data-parallel degrees (FSDP over the
/// replicas, HSDP as shard within a node x replicate across nodes, warned where torchtitan runs
/// FSDP instead), Megatron-LM's distributed optimizer (its only sharding under PP, warned where
/// the plan shards more), and the Megatron arguments still pass Megatron's rules.
#[test]
fn exports_carry_the_sharding() {
    use flatpipe::simulator::costs::sharding::Sharding;
    let prof = profile();
    let stages = even_split(34, 2).unwrap();
    let degrees = |text: &str| -> (u32, u32) {
        let get = |key: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(&format!("{key} = ")))
                .unwrap_or_else(|| panic!("{key} in\n{text}"))
                .parse()
                .unwrap()
        };
        (
            get("data_parallel_replicate_degree"),
            get("data_parallel_shard_degree"),
        )
    };
    for (m, dp, want, warned) in [
        (Sharding::Fsdp, 4, (1, 4), false),
        (Sharding::FsdpPerMicrobatch, 4, (1, 4), true),
        // 32 ranks on 8-GPU nodes, pp = 2 x dp = 16: a pipeline rank's replicas span 2 nodes.
        (Sharding::Hsdp, 16, (2, 8), false),
        (Sharding::Zero1, 4, (1, 4), true),
        (Sharding::Ddp, 4, (1, 4), true),
    ] {
        let mut p = plan(ScheduleKind::OneFOneB, 2, &stages);
        p.run.dp = dp;
        p.run.sharding = m;
        let t = torchtitan(&p, &prof, 4, None).unwrap();
        assert_eq!(degrees(&t), want, "{m}\n{t}");
        assert_eq!(t.contains("# warning"), warned, "{m}\n{t}");
        assert_eq!(
            t.contains("fsdp_reshard_after_forward = \"always\""),
            m == Sharding::FsdpPerMicrobatch
        );
        let args = megatron(&p, &prof, 4).unwrap();
        megatron_rules(&args, 2, dp).unwrap_or_else(|e| panic!("{m}: {e}\n{args}"));
        assert_eq!(
            args.contains("--use-distributed-optimizer"),
            m != Sharding::Ddp,
            "{m}\n{args}"
        );
        assert_eq!(
            args.contains("# warning: the plan shards as"),
            !matches!(m, Sharding::Ddp | Sharding::Zero1),
            "{m}\n{args}"
        );
    }
    // Without a pipeline torchtitan runs DDP: replicate degree dp, nothing to warn.
    let mut p = plan(ScheduleKind::OneFOneB, 1, &even_split(34, 1).unwrap());
    p.run.dp = 8;
    let t = torchtitan(&p, &prof, 4, None).unwrap();
    assert_eq!(degrees(&t), (8, 1), "{t}");
    assert!(!t.contains("# warning"), "{t}");
}

/// Budgets that cut a step the same way tie, and the tie goes to the larger budget: with every
/// sequence 8,192 tokens long, budgets 4,096 and 8,192 both give one microbatch per sequence,
/// but only 8,192 is what an export's `seq_len` can train without cutting sequences.
#[test]
fn tied_budgets_choose_the_one_that_holds_the_sequences() {
    let prof = profile();
    let w = flatpipe::profiles::Workload::from_yaml(
        "name: fixed-8k\nlengths: {kind: fixed, tokens: 8192}\nseqs_per_step: 32\n",
        "test",
        |csv| panic!("no CSV here: {csv}"),
    )
    .unwrap();
    let mut space = SearchSpace::default_for(8);
    space.pp = vec![2];
    space.tp = vec![1];
    space.kinds = vec![ScheduleKind::OneFOneB];
    space.sharding = vec![flatpipe::simulator::costs::sharding::Sharding::Ddp];
    space.token_budgets = vec![4096, 8192];
    space.recompute = vec![Recompute::None, Recompute::Full];
    let config = SearchConfig {
        steps: 2,
        seed: 0,
        size: StepSize::Seqs(32),
        memory_limit_bytes: prof.hardware.memory_bytes as f64 - 4.0 * (1u64 << 30) as f64,
        state_bytes: None,
        rank_by: RankBy::Mean,
        keep: 2,
        exact_split: flatpipe::planner::partition::ExactSplit::DEFAULT,
        forward_only: None,
    };
    let r = search(&prof, &w, &space, &config, &|_, _| {}).unwrap();
    assert_eq!(r.ranked.len(), 2);
    let (a, b) = (&r.ranked[0], &r.ranked[1]);
    assert_eq!(a.summary.step_time_s.mean, b.summary.step_time_s.mean);
    assert_eq!((a.token_budget(), b.token_budget()), (8192, 4096));
}

/// The Megatron export's batch: a flat plan's microbatch is one packed sample of at most the
/// token budget (`--seq-length`, `--micro-batch-size 1`, `--global-batch-size` = microbatches x
/// dp) with the documents kept apart (`--dataloader-inter-document-masking`,
/// `--reset-position-ids`); `packed` keeps the sample without the masking; `padded` leaves the
/// batch to the user. Interleaved Megatron runs a multiple of pp microbatches: 10 at pp 4 are
/// rounded up to 12 (global batch 24 over dp 2), said in a warning. Each passes the rules.
#[test]
fn megatron_exports_the_batch_its_schedule_can_run() {
    use flatpipe::simulator::batching::policy::Policy;
    let prof = profile();
    // An argument's value, read from the argument lines (not the `# warning:` lines).
    let value = |args: &str, name: &str| -> Option<String> {
        let mut words = args
            .lines()
            .filter(|l| !l.starts_with('#'))
            .flat_map(str::split_whitespace);
        words.find(|w| *w == name)?;
        words.next().map(str::to_string)
    };
    let mut p = plan(ScheduleKind::OneFOneB, 4, &even_split(34, 4).unwrap());
    p.run.dp = 2;
    let args = megatron(&p, &prof, 10).unwrap();
    megatron_rules(&args, 4, 2).unwrap_or_else(|e| panic!("{e}\n{args}"));
    assert_eq!(value(&args, "--seq-length").as_deref(), Some("16384"));
    assert_eq!(value(&args, "--micro-batch-size").as_deref(), Some("1"));
    assert_eq!(value(&args, "--global-batch-size").as_deref(), Some("20"));
    assert!(
        args.contains("--dataloader-inter-document-masking")
            && args.contains("--reset-position-ids")
    );
    assert!(!args.contains("rounded up"), "{args}");
    let mut i = plan(
        ScheduleKind::Interleaved1F1B,
        4,
        &even_split(34, 8).unwrap(),
    );
    i.run.dp = 2;
    let args = megatron(&i, &prof, 10).unwrap();
    megatron_rules(&args, 4, 2).unwrap_or_else(|e| panic!("{e}\n{args}"));
    assert_eq!(value(&args, "--global-batch-size").as_deref(), Some("24"));
    assert!(
        args.contains("the step's 10 are rounded up to 12"),
        "{args}"
    );
    // The rules refuse the unrounded count, as Megatron would.
    let unrounded = args.replace("--global-batch-size 24", "--global-batch-size 20");
    assert!(megatron_rules(&unrounded, 4, 2).is_err());
    p.run.policy = Policy::Packed;
    let args = megatron(&p, &prof, 10).unwrap();
    assert!(args.contains("--seq-length") && !args.contains("--dataloader-inter-document-masking"));
    p.run.policy = Policy::Padded;
    let args = megatron(&p, &prof, 10).unwrap();
    assert!(
        value(&args, "--seq-length").is_none()
            && args.contains("leave Megatron-LM's batch settings"),
        "{args}"
    );
    megatron_rules(&args, 4, 2).unwrap_or_else(|e| panic!("{e}\n{args}"));
}

/// torchtitan's `[model]`: a flat plan's packed rows keep their documents apart, which
/// torchtitan 0.2.2 runs with its `8B_varlen` flavor (varlen attention, block_causal mask);
/// a `packed` plan attends across documents (the plain flavor); the 70B flavor has no varlen
/// form there, which the export says. (The interop check loads these with torchtitan's parser
/// and checks the flavor's mask in torchtitan's own `llama3_args`.)
#[test]
fn torchtitan_exports_the_attention_the_plan_predicted() {
    use flatpipe::simulator::batching::policy::Policy;
    let prof = profile();
    let mut p = plan(ScheduleKind::OneFOneB, 2, &even_split(34, 2).unwrap());
    let t = torchtitan(&p, &prof, 8, None).unwrap();
    assert!(
        t.contains("[model]\nname = \"llama3\"\nflavor = \"8B_varlen\"\n"),
        "{t}"
    );
    assert!(!t.contains("varlen flavor"), "{t}");
    p.run.policy = Policy::Packed;
    let t = torchtitan(&p, &prof, 8, None).unwrap();
    assert!(t.contains("flavor = \"8B\"\n"), "{t}");
    p.run.policy = Policy::FlatFfd;
    p.inputs.model = Some("llama3.1-70b".into());
    let t = torchtitan(&p, &prof, 8, None).unwrap();
    assert!(
        t.contains("flavor = \"70B\"\n")
            && t.contains("# warning: torchtitan 0.2.2 has no varlen flavor of llama3 70B"),
        "{t}"
    );
    p.inputs.model = Some("my-model.yaml".into());
    let t = torchtitan(&p, &prof, 8, None).unwrap();
    assert!(!t.contains("\n[model]\n") && t.contains("torchtitan has no flavor of my-model.yaml"));
}

/// The verl export's overrides, each checked against verl 0.7.0's own flattened Megatron
/// trainer configuration (tests/data/verl, written by scripts/verl_config_fixture.sh from verl's
/// source): the key exists and the value has the type verl's default has (a boolean, an
/// integer, a string; `null` where verl allows it). Dynamic batching at the plan's budget, the
/// pipeline and virtual stages, recomputation; V placements refused, other schedules warned.
#[test]
fn verl_exports_overrides_of_verls_own_configuration() {
    use serde_yaml::Value;
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/verl/ppo_megatron_trainer.v0.7.0.yaml"
    ))
    .unwrap();
    let config: Value = serde_yaml::from_str(&text).unwrap();
    let check = |export: &str| {
        for line in export.lines().filter(|l| !l.starts_with('#')) {
            let (key, value) = line.split_once('=').unwrap_or_else(|| panic!("{line}"));
            let mut node = &config;
            for part in key.split('.') {
                node = node
                    .get(part)
                    .unwrap_or_else(|| panic!("{key}: no `{part}` in verl's configuration"));
            }
            let fits = match node {
                Value::Bool(_) => matches!(value, "True" | "False"),
                Value::Number(_) => value.parse::<i64>().is_ok(),
                Value::String(_) => !value.is_empty(),
                // verl's `null` defaults take a value or stay null.
                Value::Null => !value.is_empty(),
                _ => false,
            };
            assert!(fits, "{key}={value}: verl's default is {node:?}");
        }
    };
    // The check refuses what verl does not have, and a value of another type.
    for bad in [
        "actor_rollout_ref.actor.no_such_field=1",
        "actor_rollout_ref.actor.use_dynamic_bsz=8192",
    ] {
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| check(bad)));
        assert!(r.is_err(), "{bad}");
    }
    let prof = profile();
    let value = |export: &str, key: &str| -> String {
        export
            .lines()
            .find_map(|l| l.strip_prefix(&format!("actor_rollout_ref.actor.{key}=")))
            .unwrap_or_else(|| panic!("{key}:\n{export}"))
            .to_string()
    };
    let mut p = plan(
        ScheduleKind::Interleaved1F1B,
        4,
        &even_split(34, 8).unwrap(),
    );
    p.run.params.token_budget = 8192;
    p.run.recompute = vec![flatpipe::simulator::costs::Recompute::Full; 8];
    let e = verl(&p, &prof).unwrap();
    check(&e);
    assert_eq!(value(&e, "use_dynamic_bsz"), "True");
    assert_eq!(value(&e, "ppo_max_token_len_per_gpu"), "8192");
    assert_eq!(value(&e, "megatron.pipeline_model_parallel_size"), "4");
    assert_eq!(
        value(&e, "megatron.virtual_pipeline_model_parallel_size"),
        "2"
    );
    assert_eq!(
        value(
            &e,
            "megatron.override_transformer_config.recompute_granularity"
        ),
        "full"
    );
    assert!(!e.contains("schedule, not"), "{e}");
    let one = plan(ScheduleKind::ZbH1, 4, &even_split(34, 4).unwrap());
    let e = verl(&one, &prof).unwrap();
    check(&e);
    assert_eq!(
        value(&e, "megatron.virtual_pipeline_model_parallel_size"),
        "null"
    );
    assert!(
        e.contains("# warning: verl runs Megatron-LM's 1F1B schedule, not zb-h1"),
        "{e}"
    );
    let v = plan(ScheduleKind::ZbV, 4, &even_split(34, 8).unwrap());
    assert!(
        verl(&v, &prof)
            .unwrap_err()
            .to_string()
            .contains("V placement")
    );
}

/// Expert parallelism in the search: Qwen3-30B-A3B on 16 H100s at pp = 2 (dp = 8) under
/// Megatron's distributed optimizer. Without it each GPU holds half the model's experts with
/// their state sharded over 8 replicas; the searched degrees are 1 and the powers of two that
/// divide the 128 experts; under a limit only expert parallelism meets, the chosen plan has it,
/// and its predicted memory is what `simulate` gives on the candidate's own profile.
#[test]
fn the_search_finds_expert_parallelism_where_memory_needs_it() {
    let m = builtins::model("qwen3-30b-a3b").unwrap();
    let h = builtins::hardware("h100").unwrap();
    let prof = analytic_profile(&m, &h, &AnalyticOptions::default()).unwrap();
    assert_eq!(
        flatpipe::planner::search::expert_parallel_degrees(&prof),
        [1, 2, 4, 8, 16, 32, 64, 128]
    );
    assert_eq!(
        flatpipe::planner::search::expert_parallel_degrees(&profile()),
        [1]
    );
    let w = builtins::workload("sharegpt-v3").unwrap();
    let mut space = SearchSpace::default_for(16);
    space.pp = vec![2];
    space.tp = vec![1];
    space.kinds = vec![ScheduleKind::OneFOneB, ScheduleKind::DualPipeV];
    space.token_budgets = vec![4096];
    space.sharding = vec![Sharding::Zero1];
    space.chunk = false;
    let config = SearchConfig {
        steps: 2,
        seed: 0,
        size: StepSize::Seqs(64),
        memory_limit_bytes: 60.0 * (1u64 << 30) as f64,
        state_bytes: None,
        rank_by: RankBy::Mean,
        keep: 3,
        exact_split: flatpipe::planner::partition::ExactSplit::DEFAULT,
        forward_only: None,
    };
    let result = search(&prof, &w, &space, &config, &|_, _| {}).unwrap();
    let best = &result.ranked[0];
    assert!(best.ep > 1, "{}", best.describe());
    assert!(result.ranked.iter().all(|c| c.run.dp % c.ep == 0));
    // The bound stays a bound where DualPipeV's pairs hide the all-to-alls.
    for c in &result.ranked {
        let mean = c.summary.step_time_s.mean;
        assert!(
            c.lower_bound_s <= mean * (1.0 + 1e-9),
            "{}: {} > {mean}",
            c.describe(),
            c.lower_bound_s
        );
    }
    // ep = 1 holds half of 30.5B parameters at 6 + 12/8 bytes: over 100 GiB, rejected.
    let per_gpu = best.profile(&prof).unwrap();
    assert_eq!(per_gpu.expert_parallel, best.ep);
    let mc = montecarlo::run(
        &per_gpu,
        &w,
        0,
        StepSize::Seqs(64),
        2,
        std::slice::from_ref(&best.run),
        &|| {},
    )
    .unwrap();
    let peak = mc.outcomes[0]
        .iter()
        .map(|o| o.rank_memory_bytes.iter().copied().fold(0.0, f64::max))
        .fold(0.0, f64::max);
    let planned = best.peak_memory_bytes.iter().copied().fold(0.0, f64::max);
    assert!((peak / planned - 1.0).abs() < 1e-9, "{peak} vs {planned}");
}

/// A mixture-of-experts plan's Megatron-LM arguments carry its experts, router top-k, expert
/// parallelism and dispatcher, and pass Megatron's rules; the expert-parallel degree that does
/// not divide the experts fails them.
#[test]
fn megatron_exports_expert_parallelism() {
    let m = builtins::model("qwen3-30b-a3b").unwrap();
    let h = builtins::hardware("h100").unwrap();
    let prof = analytic_profile(&m, &h, &AnalyticOptions::default()).unwrap();
    let stages = even_split(prof.layers.len(), 2).unwrap();
    let mut p = Plan::new("sharegpt-v3", ScheduleKind::OneFOneB, 2, &stages, 8192);
    p.run.dp = 8;
    p.ep = 8;
    let args = megatron(&p, &prof, 16).unwrap();
    for want in [
        "--num-experts 128",
        "--moe-router-topk 8",
        "--expert-model-parallel-size 8",
        "--expert-tensor-parallel-size 1",
        "--moe-token-dispatcher-type alltoall",
    ] {
        assert!(args.contains(want), "{want}: {args}");
    }
    megatron_rules(&args, 2, 8).unwrap_or_else(|e| panic!("{e}\n{args}"));
    let bad = args.replace(
        "--expert-model-parallel-size 8",
        "--expert-model-parallel-size 3",
    );
    assert!(
        megatron_rules(&bad, 2, 8)
            .unwrap_err()
            .contains("not a multiple of ep 3")
    );
    // Within a node, no group-limited routing.
    assert!(!args.contains("--moe-router-num-groups"), "{args}");
    assert!(
        !args.contains("--overlap-moe-expert-parallel-comm"),
        "{args}"
    );
    // Combined 1F1B (v = 2) is Megatron's interleaved 1F1B with the EP A2A overlap; with full
    // recomputation, or one stage per rank, Megatron refuses the overlap: left out, warned.
    let v2 = even_split(prof.layers.len(), 4).unwrap();
    let mut c = Plan::new("sharegpt-v3", ScheduleKind::Combined1F1B, 2, &v2, 8192);
    c.run.dp = 8;
    c.ep = 8;
    let args = megatron(&c, &prof, 16).unwrap();
    assert!(
        args.contains("--overlap-moe-expert-parallel-comm"),
        "{args}"
    );
    assert!(!args.contains("# warning: Megatron-LM has no"), "{args}");
    megatron_rules(&args, 2, 8).unwrap_or_else(|e| panic!("{e}\n{args}"));
    // verl's Megatron workers: the same, as its own settings and transformer-config overrides.
    let v = verl(&c, &prof).unwrap();
    for want in [
        "actor_rollout_ref.actor.megatron.expert_model_parallel_size=8",
        "actor_rollout_ref.actor.megatron.override_transformer_config.overlap_moe_expert_parallel_comm=True",
    ] {
        assert!(v.lines().any(|l| l == want), "{want}: {v}");
    }
    c.run.recompute = vec![flatpipe::simulator::costs::Recompute::Full; 4];
    let args = megatron(&c, &prof, 16).unwrap();
    assert!(
        !args
            .lines()
            .any(|l| l.starts_with("--overlap-moe-expert-parallel-comm")),
        "{args}"
    );
    assert!(args.contains("refuses full recomputation"), "{args}");
    megatron_rules(&args, 2, 8).unwrap_or_else(|e| panic!("{e}\n{args}"));
    let forced = args.replacen(
        "--pipeline-model-parallel-size",
        "--overlap-moe-expert-parallel-comm \\\n--pipeline-model-parallel-size",
        1,
    );
    assert!(
        megatron_rules(&forced, 2, 8)
            .unwrap_err()
            .contains("full recomputation")
    );
    // DeepSeek-V3's node-limited routing (4 nodes a token) at ep 64 over 8 nodes of 8 H800s:
    // one group per node, 4 of the 8 chosen; at ep 16 over 2 nodes, 2 of 2.
    let m = builtins::model("deepseek-v3").unwrap();
    let h = builtins::hardware("h800").unwrap();
    let ds = analytic_profile(&m, &h, &AnalyticOptions::default()).unwrap();
    let stages = even_split(ds.layers.len(), 16).unwrap();
    for (ep, dp, groups, topk) in [(64, 128, 8, 4), (16, 128, 2, 2)] {
        let mut p = Plan::new("deepseek-v3-4k", ScheduleKind::OneFOneB, 16, &stages, 4096);
        p.run.dp = dp;
        p.ep = ep;
        let args = megatron(&p, &ds, 4096).unwrap();
        // The MTP module: `m` before the loss, in the last stage, and counted.
        assert!(
            args.contains("mL\"") && args.contains("--mtp-num-layers 1"),
            "{args}"
        );
        for want in [
            format!("--moe-router-num-groups {groups}"),
            format!("--moe-router-group-topk {topk}"),
        ] {
            assert!(args.contains(&want), "{want}: {args}");
        }
        megatron_rules(&args, 16, dp).unwrap_or_else(|e| panic!("{e}\n{args}"));
    }
    // A dense model's arguments name no experts.
    assert!(
        !megatron(
            &plan(ScheduleKind::OneFOneB, 2, &stages_of_dense()),
            &profile(),
            16
        )
        .unwrap()
        .contains("--num-experts")
    );
}

fn stages_of_dense() -> Vec<std::ops::Range<usize>> {
    even_split(34, 2).unwrap()
}

/// The hand-ported MTP layout rules refuse what Megatron-LM refuses: a count other than
/// `--mtp-num-layers`, a decoder after an MTP layer, an MTP layer outside a last virtual stage.
#[test]
fn megatron_mtp_rules_refuse_what_megatron_refuses() {
    let one: std::collections::HashMap<String, Option<String>> =
        [("--mtp-num-layers".to_string(), Some("1".to_string()))].into();
    mtp_rules("Ett|tmL", &one, 2, 1).unwrap();
    let none = std::collections::HashMap::new();
    assert!(
        mtp_rules("Ett|tmL", &none, 2, 1)
            .unwrap_err()
            .contains("mtp layers")
    );
    assert!(
        mtp_rules("Etm|tL", &one, 2, 1)
            .unwrap_err()
            .contains("before MTP")
    );
    assert!(
        mtp_rules("Et|tm||L", &one, 2, 2)
            .unwrap_err()
            .contains("last virtual")
    );
}
