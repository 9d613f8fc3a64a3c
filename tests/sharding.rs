//! Sharded data parallelism: memory per rank and collective times against the byte counts and
//! alpha-beta formulas written out by hand, and the planner's memory promise.

use flatpipe::planner::search::{RankBy, SearchConfig, SearchSpace, search};
use flatpipe::profiles::{Profile, StepSize, analytic_profile, builtins};
use flatpipe::simulator::batching::microbatch::Microbatch;
use flatpipe::simulator::batching::policy::Policy;
use flatpipe::simulator::costs::sharding::Sharding;
use flatpipe::simulator::costs::{CostOptions, TableCosts};
use flatpipe::simulator::ir::{ActionKind, ComputeAction, Rank};
use flatpipe::simulator::run::plan::even_split;
use flatpipe::simulator::run::step::{cut_step, plan_step};
use flatpipe::simulator::run::{
    config::{Capacity, RunConfig, ScheduleSource},
    montecarlo,
};
use flatpipe::simulator::{CostModel, Placement, Plan, ScheduleKind};

const GIB: f64 = (1u64 << 30) as f64;

fn profile(model: &str) -> Profile {
    let m = builtins::model(model).unwrap();
    let hw = builtins::hardware("h200").unwrap();
    analytic_profile(&m, &hw, &Default::default()).unwrap()
}

fn costs(
    prof: &Profile,
    stages: &[std::ops::Range<usize>],
    sharding: Sharding,
    dp: u32,
) -> TableCosts {
    let placement = Placement::looped(stages.len() as u32, 1);
    let mbs = vec![
        Microbatch {
            chunk: None,
            seq_lens: vec![512, 256],
            shape: Default::default(),
        };
        2
    ];
    TableCosts::with_options(
        prof,
        stages,
        &placement,
        &mbs,
        &[],
        &CostOptions {
            sharding,
            dp,
            ..Default::default()
        },
    )
    .unwrap()
}

/// pp = 2, dp = 4 on one 8-GPU node: every mode's bytes per parameter from the frameworks'
/// own tables (Megatron's distributed-optimizer table, the ZeRO paper's stage 2, FSDP2 with
/// bf16 compute and fp32 reduction), times each rank's parameters.
#[test]
fn memory_per_rank_for_each_sharding_mode_by_hand() {
    let prof = profile("tiny");
    let stages = even_split(prof.layers.len(), 2).unwrap();
    let params: Vec<f64> = stages
        .iter()
        .map(|r| {
            prof.layers[r.clone()]
                .iter()
                .map(|l| l.param_count as f64)
                .sum()
        })
        .collect();
    let largest: Vec<f64> = stages
        .iter()
        .map(|r| {
            prof.layers[r.clone()]
                .iter()
                .map(|l| l.param_count as f64)
                .fold(0.0, f64::max)
        })
        .collect();
    let d = 4.0;
    let by_hand = |m: Sharding, r: usize| -> f64 {
        let p = params[r];
        match m {
            // bf16 weights 2 + fp32 main grads 4 + fp32 master and Adam moments 12.
            Sharding::Ddp => 18.0 * p,
            // Megatron: "6 + 12/d".
            Sharding::Zero1 => (6.0 + 12.0 / d) * p,
            // ZeRO paper §5.2: 2 + (2 + 12)/d.
            Sharding::Zero2 => (2.0 + 14.0 / d) * p,
            // FSDP2 under PP: bf16 unsharded weights 2 and fp32 unsharded accumulated gradients
            // 4 all step, fp32 shards of weights, gradients and moments 16/d.
            Sharding::Fsdp | Sharding::Hsdp => (6.0 + 16.0 / d) * p,
            // Resharded per microbatch: 16/d, plus the largest layer unsharded: two layers of
            // bf16 weights (current and prefetched), bf16 gradients, their fp32 copy.
            Sharding::FsdpPerMicrobatch => 16.0 / d * p + (2.0 + 2.0 + 2.0 + 4.0) * largest[r],
        }
    };
    for m in Sharding::ALL {
        let c = costs(&prof, &stages, m, 4);
        for r in 0..2 {
            let got = c.static_bytes(Rank(r as u32));
            let want = by_hand(m, r);
            assert!(
                (got - want).abs() <= 1e-9 * want,
                "{m} rank {r}: {got} vs {want}"
            );
        }
    }
    // dp = 1: nothing to shard, every mode holds what its framework holds unsharded.
    let c = costs(&prof, &stages, Sharding::Zero1, 1);
    assert!((c.static_bytes(Rank(0)) - 18.0 * params[0]).abs() <= 1e-9 * params[0]);
}

/// The plan of one step of `config` on `prof`, and its predicted step time.
fn step(prof: &Profile, config: &RunConfig) -> (flatpipe::simulator::run::step::StepPlan, f64) {
    let w = builtins::workload("sharegpt-v3").unwrap();
    let seqs = w.sample_step(0, 0, StepSize::Seqs(64));
    let cost = flatpipe::simulator::run::config::balance_cost(prof);
    let cut = cut_step(config, &seqs, &cost).unwrap();
    let plan = plan_step(config, Some(prof), 0, &cut).unwrap();
    let t = plan.outcome(config, prof).unwrap().step_time_s;
    (plan, t)
}

fn run_config(pp: u32, dp: u32, sharding: Sharding, n_layers: usize) -> RunConfig {
    let mut c = RunConfig::new(
        ScheduleSource::Kind(ScheduleKind::OneFOneB),
        pp,
        1,
        even_split(n_layers, pp as usize).unwrap(),
        Policy::FlatFfd,
        Capacity::Dynamic,
    );
    c.dp = dp;
    c.sharding = sharding;
    c
}

/// Without a pipeline the step is the slowest replica's compute and optimizer, then the
/// collectives: ring all-reduce `2 (n-1) (a + B / (n b))` of fp32 gradients (ddp), ring
/// reduce-scatter of fp32 gradients plus all-gather of bf16 weights, `(n-1) (a + B / (n b))`
/// each (zero1); FSDP without PP reshards per microbatch, so nothing is left at the step's end.
#[test]
fn step_collectives_follow_the_ring_formulas() {
    let prof = profile("llama3.1-8b");
    let n = prof.layers.len();
    let p: f64 = prof.layers.iter().map(|l| l.param_count as f64).sum();
    let link = &prof.hardware.intra_node;
    let (a, b) = (link.alpha_s, link.beta_bytes_per_s);
    let ring = |n: f64, bytes: f64| (n - 1.0) * (a + bytes / (n * b));
    for (m, extra) in [
        (Sharding::Ddp, 2.0 * ring(4.0, 4.0 * p)),
        (Sharding::Zero1, ring(4.0, 4.0 * p) + ring(4.0, 2.0 * p)),
        (Sharding::Fsdp, 0.0),
    ] {
        let config = run_config(1, 4, m, n);
        let (plan, t) = step(&prof, &config);
        let pipeline = plan
            .replicas
            .iter()
            .map(|r| {
                r.rounds[0]
                    .prediction
                    .as_ref()
                    .unwrap()
                    .simulation
                    .metrics
                    .makespan_s
            })
            .fold(0.0, f64::max);
        assert!(
            (t - (pipeline + extra)).abs() < 1e-6,
            "{m}: step {t} s, pipeline {pipeline} s + collectives {extra} s"
        );
    }
}

/// FSDP resharded per microbatch: each forward waits for the all-gather of its stage's bf16
/// weights, `(n-1) (a + 2P / (n b))`, prefetched layer by layer: exposed `g/L + (L-1)/L
/// max(0, g - f)` over the stage's L layers.
#[test]
fn per_microbatch_all_gather_is_exposed_by_the_prefetch_formula() {
    let prof = profile("llama3.1-8b");
    let stages = even_split(prof.layers.len(), 2).unwrap();
    let link = &prof.hardware.intra_node;
    let base = costs(&prof, &stages, Sharding::Ddp, 4);
    let mb = costs(&prof, &stages, Sharding::FsdpPerMicrobatch, 4);
    for (s, r) in stages.iter().enumerate() {
        let p: f64 = prof.layers[r.clone()]
            .iter()
            .map(|l| l.param_count as f64)
            .sum();
        let l = r.len() as f64;
        let g = 3.0 * (link.alpha_s + 2.0 * p / (4.0 * link.beta_bytes_per_s));
        let a = ComputeAction::new(s as u32, ActionKind::F, 0);
        let f = base.compute_ns(a) as f64 * 1e-9;
        let want = g / l + (l - 1.0) / l * (g - f).max(0.0);
        let got = (mb.compute_ns(a) - base.compute_ns(a)) as f64 * 1e-9;
        assert!((got - want).abs() < 2e-9, "stage {s}: {got} vs {want}");
        assert!(got > 0.0);
    }
}

/// With a pipeline, a rank's gradient reduction starts at its own last compute: the last
/// pipeline rank of 1F1B finishes before rank 0 and hides its reduction there, so the step is
/// `max_r (end_r + reduce_r + optimizer_r)`; with most layers on the last rank, less than the
/// pipeline plus the largest reduction.
#[test]
fn gradient_reduction_starts_at_each_ranks_last_backward() {
    let prof = profile("llama3.1-8b");
    let mut config = run_config(2, 2, Sharding::Ddp, prof.layers.len());
    config.stages = vec![0..8, 8..prof.layers.len()];
    let (plan, t) = step(&prof, &config);
    let link = &prof.hardware.intra_node;
    let stages = &config.stages;
    let mut want = 0.0f64;
    let mut pipeline = 0.0f64;
    let mut largest = 0.0f64;
    for (r, stage) in stages.iter().enumerate() {
        let p: f64 = prof.layers[stage.clone()]
            .iter()
            .map(|l| l.param_count as f64)
            .sum();
        let reduce = 2.0 * (link.alpha_s + 4.0 * p / (2.0 * link.beta_bytes_per_s));
        largest = largest.max(reduce);
        for rep in &plan.replicas {
            let tl = &rep.rounds[0]
                .prediction
                .as_ref()
                .unwrap()
                .simulation
                .timeline;
            let end = tl.compute[r].last().unwrap().end_ns as f64 * 1e-9;
            let (o0, o1) = tl.optimizer[r].unwrap();
            want = want.max(end + reduce + (o1 - o0) as f64 * 1e-9);
            pipeline = pipeline.max(tl.makespan_ns() as f64 * 1e-9);
        }
    }
    assert!((t - want).abs() < 1e-6, "{t} vs {want}");
    assert!(
        t < pipeline + largest - 1e-6,
        "{t} vs {pipeline} + {largest}"
    );
}

/// The planner's promise: whatever the limit and the sharding modes, the plans it returns,
/// simulated again on the same steps, fit every rank.
#[test]
fn planned_peaks_never_exceed_the_limit() {
    let prof = profile("llama3.1-8b");
    let w = builtins::workload("sharegpt-v3").unwrap();
    for (limit_gib, modes) in [
        (136.4, vec![Sharding::Ddp, Sharding::Zero1, Sharding::Fsdp]),
        (80.0, vec![Sharding::Ddp, Sharding::Zero1, Sharding::Fsdp]),
        (60.0, vec![Sharding::Zero2, Sharding::FsdpPerMicrobatch]),
        (40.0, Sharding::ALL.to_vec()),
    ] {
        let mut space = SearchSpace::default_for(8);
        space.sharding = modes;
        space.token_budgets = vec![4096, 16_384];
        let config = SearchConfig {
            steps: 6,
            seed: 3,
            size: StepSize::Seqs(128),
            memory_limit_bytes: limit_gib * GIB,
            state_bytes: None,
            rank_by: RankBy::Mean,
            keep: 4,
            exact_split: flatpipe::planner::partition::ExactSplit::DEFAULT,
            forward_only: None,
        };
        let Ok(result) = search(&prof, &w, &space, &config, &|_, _| {}) else {
            assert!(limit_gib < 60.0, "nothing fits {limit_gib} GiB");
            continue;
        };
        for c in &result.ranked {
            let run = c.run.clone();
            let per_gpu = c.profile(&prof).unwrap();
            let mc =
                montecarlo::run(&per_gpu, &w, 3, StepSize::Seqs(128), 6, &[run], &|| {}).unwrap();
            for o in &mc.outcomes[0] {
                for (r, m) in o.rank_memory_bytes.iter().enumerate() {
                    assert!(
                        *m <= limit_gib * GIB,
                        "{}: rank {r} needs {:.1} GiB over {limit_gib} GiB",
                        c.describe(),
                        m / GIB
                    );
                }
            }
        }
    }
}

/// Llama-3.1-8B without a pipeline: under FSDP over 8 H200s a rank holds 16/8 bytes per
/// parameter (16 GB) and the plan fits one H200; unsharded, 18 bytes per parameter are 134.6
/// GiB of state, which leaves 1.8 GiB of the 136.4 GiB limit for activations: nothing fits.
#[test]
fn no_pipeline_fsdp_fits_llama_8b_on_one_h200() {
    let prof = profile("llama3.1-8b");
    let w = builtins::workload("sharegpt-v3").unwrap();
    let params: f64 = prof.layers.iter().map(|l| l.param_count as f64).sum();
    let limit = prof.hardware.memory_bytes as f64 - 4.0 * GIB;
    let run = |m: Sharding| {
        let mut space = SearchSpace::default_for(8);
        space.pp = vec![1];
        space.tp = vec![1];
        space.sharding = vec![m];
        let config = SearchConfig {
            steps: 8,
            seed: 0,
            size: StepSize::Seqs(128),
            memory_limit_bytes: limit,
            state_bytes: None,
            rank_by: RankBy::Mean,
            keep: 1,
            exact_split: flatpipe::planner::partition::ExactSplit::DEFAULT,
            forward_only: None,
        };
        search(&prof, &w, &space, &config, &|_, _| {})
    };
    let fsdp = run(Sharding::Fsdp).unwrap();
    let best = &fsdp.ranked[0];
    assert_eq!(
        (best.run.pp, best.run.dp, best.run.sharding),
        (1, 8, Sharding::Fsdp)
    );
    let peak = best.peak_memory_bytes[0];
    assert!(peak <= limit && peak >= 2.0 * params, "{} GiB", peak / GIB);
    assert!(limit - 18.0 * params < 2.0 * GIB);
    assert!(run(Sharding::Ddp).is_err());
}

/// A plan file keeps its sharding; a bad value names the field and the allowed values.
#[test]
fn plan_files_carry_the_sharding() {
    let mut p = Plan::new(
        "sharegpt-v3",
        ScheduleKind::OneFOneB,
        2,
        &even_split(34, 2).unwrap(),
        4096,
    );
    p.run.dp = 4;
    p.run.sharding = Sharding::Hsdp;
    let yaml = p.to_yaml().unwrap();
    assert!(yaml.contains("sharding: hsdp"), "{yaml}");
    let back = Plan::from_yaml(&yaml, "p.yaml").unwrap();
    assert_eq!(back.run_config().unwrap().sharding, Sharding::Hsdp);
    let plain = Plan::new(
        "sharegpt-v3",
        ScheduleKind::OneFOneB,
        2,
        &even_split(34, 2).unwrap(),
        4096,
    );
    assert!(!plain.to_yaml().unwrap().contains("sharding"));
    let bad = yaml.replace("sharding: hsdp", "sharding: zero4");
    let e = Plan::from_yaml(&bad, "p.yaml").unwrap_err().to_string();
    assert!(
        e.contains("p.yaml") && e.contains("zero4") && e.contains("fsdp"),
        "{e}"
    );
}

/// FSDP's per-stage collectives as actions (`--fsdp` on a profile): each stage's `UNSHARD` is
/// the ring all-gather of its bf16 weights and its `REDUCE_GRAD` the ring reduce-scatter of its
/// fp32 gradients over the dp = 4 replicas of one node, `(n - 1)(alpha + bytes / (n beta))`
/// written out here; DDP's all-reduce and ZeRO-1's reduce-scatter of the gradients at
/// REDUCE_GRAD; without the option, and for the modes without per-stage collectives (ZeRO-2,
/// FSDP resharded per microbatch), they cost nothing (the step's tail holds them).
#[test]
fn fsdp_actions_cost_each_stages_ring_all_gather_and_reduce_scatter() {
    use flatpipe::simulator::ir::StageId;
    use flatpipe::simulator::ir::comm::FsdpAction;
    let prof = profile("llama3.1-8b");
    let n = prof.layers.len();
    let stages = vec![0..n / 2, n / 2..n];
    let placement = Placement::looped(2, 1);
    let mbs = vec![
        Microbatch {
            chunk: None,
            seq_lens: vec![512],
            shape: Default::default(),
        };
        2
    ];
    let table = |sharding: Sharding, fsdp_actions: bool| {
        TableCosts::with_options(
            &prof,
            &stages,
            &placement,
            &mbs,
            &[],
            &CostOptions {
                sharding,
                dp: 4,
                fsdp_actions,
                ..Default::default()
            },
        )
        .unwrap()
    };
    let link = &prof.hardware.intra_node; // global ranks r * 4 + d: 4 replicas in an 8-GPU node
    let ring = |bytes: f64| 3.0 * (link.alpha_s + bytes / (4.0 * link.beta_bytes_per_s));
    // Per sharding: whether UNSHARD gathers the stage's bf16 weights, and the ring passes of
    // REDUCE_GRAD's reduction of its fp32 gradients: FSDP reduce-scatters (1), DDP all-reduces
    // (2: a reduce-scatter then an all-gather), ZeRO-1 reduce-scatters (1).
    for (sharding, gathers, passes) in [
        (Sharding::Fsdp, true, 1.0),
        (Sharding::Ddp, false, 2.0),
        (Sharding::Zero1, false, 1.0),
    ] {
        let c = table(sharding, true);
        for (s, r) in stages.iter().enumerate() {
            let params: f64 = prof.layers[r.clone()]
                .iter()
                .map(|l| l.param_count as f64)
                .sum();
            let got = |a| c.fsdp_ns(StageId(s as u32), a) as f64 * 1e-9;
            let gather = if gathers { ring(2.0 * params) } else { 0.0 };
            assert!(
                (got(FsdpAction::Unshard) - gather).abs() < 2e-9,
                "{sharding}"
            );
            let reduce = passes * ring(4.0 * params);
            assert!(
                (got(FsdpAction::ReduceGrad) - reduce).abs() < 2e-9,
                "{sharding}"
            );
            assert_eq!(c.fsdp_ns(StageId(s as u32), FsdpAction::Reshard), 0);
        }
    }
    for (sharding, on) in [
        (Sharding::Fsdp, false),
        (Sharding::Zero2, true),
        (Sharding::FsdpPerMicrobatch, true),
    ] {
        let c = table(sharding, on);
        assert_eq!(c.fsdp_ns(StageId(0), FsdpAction::Unshard), 0, "{sharding}");
        assert_eq!(
            c.fsdp_ns(StageId(1), FsdpAction::ReduceGrad),
            0,
            "{sharding}"
        );
    }
}

/// Expert parallelism: Qwen3-30B-A3B (48 layers of 128 experts of 768, hidden 2048) on pp = 2,
/// dp = 8, ep = 8 under Megatron's distributed optimizer. Each GPU holds 1/8 of every layer's
/// experts; their master weights and moments shard over the dp / ep = 1 replica that holds the
/// same experts ("6 + 12/1" = 18 bytes), the other weights' over all 8 ("6 + 12/8").
#[test]
fn expert_parallel_memory_by_hand() {
    let m = builtins::model("qwen3-30b-a3b").unwrap();
    let hw = builtins::hardware("h100").unwrap();
    let base = analytic_profile(&m, &hw, &Default::default()).unwrap();
    let prof = base.expert_parallel(8, 1, true).unwrap();
    let stages = even_split(prof.layers.len(), 2).unwrap();
    let c = costs(&prof, &stages, Sharding::Zero1, 8);
    let experts_per_layer = 128.0 * 3.0 * 2048.0 * 768.0 / 8.0;
    for (r, range) in stages.iter().enumerate() {
        let all: f64 = base.layers[range.clone()]
            .iter()
            .map(|l| l.param_count as f64)
            .sum();
        let decoders = range.clone().filter(|&i| (1..=48).contains(&i)).count() as f64;
        let local_experts = decoders * experts_per_layer;
        let rest = all - decoders * 8.0 * experts_per_layer;
        let want = rest * (6.0 + 12.0 / 8.0) + local_experts * 18.0;
        let got = c.static_bytes(Rank(r as u32));
        assert!(
            (got - want).abs() <= 1e-9 * want,
            "rank {r}: {got} vs {want}"
        );
    }
}
