//! Planner speed: the layer partition at 128 layers x 16 stages under per-rank memory limits,
//! the exact split of an interleaved placement under a binding limit (branch and bound; HiGHS
//! with `--features highs`), and the whole plan search for Llama-3.1-70B on 16 ranks (both
//! split solvers).

use criterion::{Criterion, criterion_group, criterion_main};
use flatpipe::planner::partition::{
    ExactSplit, LayerCost, PartitionProblem, StaticBytes, solve, solve_dp, solve_with,
};
use flatpipe::planner::search::{RankBy, SearchConfig, SearchSpace, search};
use flatpipe::profiles::{
    AnalyticOptions, LayerGroup, LayerKind, ModelSpec, StepSize, analytic_profile, builtins,
};
use flatpipe::simulator::Placement;
use flatpipe::simulator::costs::{Recompute, input_bytes_per_token, recompute_effect};
use std::hint::black_box;

/// Layer costs of a Llama-70B-shaped model with `decoders` decoder layers (plus embedding and
/// head) at 16,384-token microbatches of 2,048-token sequences.
fn layer_costs(decoders: u32) -> Vec<LayerCost> {
    let hw = builtins::hardware("h200").unwrap();
    let g = |kind, count, hidden, ffn, heads, kv, vocab| LayerGroup {
        kind,
        count,
        hidden,
        ffn,
        heads,
        kv_heads: kv,
        vocab,
        head_dim: None,
        mla: None,
        moe: None,
        mtp: false,
    };
    let model = ModelSpec {
        name: "bench".into(),
        dtype: flatpipe::profiles::Dtype::Bf16,
        attention: Default::default(),
        layers: vec![
            g(
                LayerKind::Embedding,
                1,
                Some(8192),
                None,
                None,
                None,
                Some(128_256),
            ),
            g(
                LayerKind::Decoder,
                decoders,
                Some(8192),
                Some(28_672),
                Some(64),
                Some(8),
                None,
            ),
            g(
                LayerKind::Head,
                1,
                Some(8192),
                None,
                None,
                None,
                Some(128_256),
            ),
        ],
    };
    let profile = analytic_profile(&model, &hw, &AnalyticOptions::default()).unwrap();
    let (t, a) = (16_384.0, 8.0 * 2048.0 * 2049.0 / 2.0);
    profile
        .layers
        .iter()
        .enumerate()
        .map(|(j, l)| {
            let input = input_bytes_per_token(&profile, j);
            let mut time_s = [0.0; 3];
            let mut act_bytes = [0.0; 3];
            for (i, &m) in Recompute::ALL.iter().enumerate() {
                let e = recompute_effect(l, input, m, t, a);
                time_s[i] = l.f.time_s(t, a) + l.i.time_s(t, a) + l.w.time_s(t, a) + e.extra_i_s;
                act_bytes[i] = e.peak();
            }
            LayerCost {
                time_s,
                act_bytes,
                params: l.param_count,
            }
        })
        .collect()
}

fn bench_partition(c: &mut Criterion) {
    // 126 decoders + embedding + head = 128 layers into 16 stages (1F1B-like in-flight counts).
    let layers = layer_costs(126);
    let mut problem = PartitionProblem {
        layers,
        placement: Placement::looped(16, 1),
        inflight: (0..16).map(|r| (16 - r) as f64).collect(),
        memory_limit_bytes: f64::INFINITY,
        static_bytes: StaticBytes::default(),
        modes: Recompute::ALL.to_vec(),
    };
    // A limit 10% below the unconstrained optimum's heaviest rank, so memory binds.
    let free = solve_dp(&problem, true).unwrap();
    problem.memory_limit_bytes = 0.9 * free.rank_memory_bytes.iter().copied().fold(0.0, f64::max);
    let limited = solve(&problem).unwrap();
    assert!(
        limited.optimal
            && limited
                .rank_memory_bytes
                .iter()
                .all(|&m| m <= problem.memory_limit_bytes)
    );
    let mut g = c.benchmark_group("partition");
    g.bench_function("128_layers_16_stages_memory_limited_dp", |b| {
        b.iter(|| solve(black_box(&problem)).unwrap())
    });
    // The exact split on an interleaved placement under a binding limit: 32 decoders +
    // embedding + head into 8 ranks x 4 stages (looped BFS in-flight counts: every stage holds
    // all 32 microbatches), where the DP with per-stage shares of the limit is far from optimal.
    let mut interleaved = PartitionProblem {
        layers: layer_costs(32),
        placement: Placement::looped(8, 4),
        inflight: vec![8.0; 32],
        memory_limit_bytes: f64::INFINITY,
        static_bytes: StaticBytes::default(),
        modes: Recompute::ALL.to_vec(),
    };
    let free = solve_dp(&interleaved, true).unwrap();
    interleaved.memory_limit_bytes =
        0.95 * free.rank_memory_bytes.iter().copied().fold(0.0, f64::max);
    let fast = solve_with(&interleaved, ExactSplit::Off).unwrap();
    let bnb = solve_with(&interleaved, ExactSplit::DEFAULT).unwrap();
    assert!(bnb.optimal && bnb.bottleneck_s < fast.bottleneck_s);
    g.sample_size(20);
    g.bench_function("34_layers_32_stages_memory_limited_bnb", |b| {
        b.iter(|| solve_with(black_box(&interleaved), ExactSplit::DEFAULT).unwrap())
    });
    #[cfg(feature = "highs")]
    {
        let highs = ExactSplit::Highs { time_limit_s: 60.0 };
        let m = solve_with(&interleaved, highs).unwrap();
        assert!(m.bottleneck_s <= bnb.bottleneck_s * 1.01);
        g.bench_function("34_layers_32_stages_memory_limited_highs", |b| {
            b.iter(|| solve_with(black_box(&interleaved), highs).unwrap())
        });
    }
    g.finish();
}

fn bench_search(c: &mut Criterion) {
    let model = builtins::model("llama3.1-70b").unwrap();
    let hw = builtins::hardware("h200").unwrap();
    let profile = analytic_profile(&model, &hw, &AnalyticOptions::default()).unwrap();
    let w = builtins::workload("sharegpt-v3").unwrap();
    let mut space = SearchSpace::default_for(16);
    space.pp = vec![1, 2, 4, 8, 16];
    space.vpp = vec![1, 2, 4];
    let config = SearchConfig {
        steps: 64,
        seed: 0,
        size: StepSize::Seqs(128),
        memory_limit_bytes: hw.memory_bytes as f64 - 4.0 * (1u64 << 30) as f64,
        state_bytes: None,
        rank_by: RankBy::Mean,
        keep: 5,
        exact_split: flatpipe::planner::partition::ExactSplit::Off,
        forward_only: None,
    };
    let mut g = c.benchmark_group("search");
    g.sample_size(10);
    let mut solvers = vec![("bnb", ExactSplit::DEFAULT), ("dp", ExactSplit::Off)];
    if cfg!(feature = "highs") {
        solvers.push((
            "highs",
            ExactSplit::Highs {
                time_limit_s: flatpipe::planner::partition::MILP_TIME_LIMIT_S,
            },
        ));
    }
    for (name, exact) in solvers {
        let config = SearchConfig {
            exact_split: exact,
            ..config.clone()
        };
        g.bench_function(format!("llama3.1-70b_16_ranks_64_steps_{name}"), |b| {
            b.iter(|| search(&profile, &w, &space, &config, &|_, _| {}).unwrap())
        });
    }
    g.finish();
}

/// The scale target of the planner: Llama-3.1-405B on 1,024 H100s, every tp x dp x pp x v x
/// schedule x token budget x sharding x recomputation, on 4 sampled steps of 512 sequences of
/// 8,192 tokens (one 4M-token batch per step).
fn bench_search_405b(c: &mut Criterion) {
    let model = builtins::model("llama3.1-405b").unwrap();
    let hw = builtins::hardware("h100").unwrap();
    let profile = analytic_profile(&model, &hw, &AnalyticOptions::default()).unwrap();
    let w = flatpipe::profiles::Workload::from_yaml(
        "name: fixed-8k\nlengths: {kind: fixed, tokens: 8192}\nseqs_per_step: 512\n",
        "bench",
        |csv| panic!("no CSV is read here: {csv}"),
    )
    .unwrap();
    let space = SearchSpace::default_for(1024);
    let config = SearchConfig {
        steps: 4,
        seed: 0,
        size: StepSize::Seqs(512),
        memory_limit_bytes: hw.memory_bytes as f64 - 4.0 * (1u64 << 30) as f64,
        state_bytes: None,
        rank_by: RankBy::Mean,
        keep: 5,
        exact_split: ExactSplit::DEFAULT,
        forward_only: None,
    };
    let mut g = c.benchmark_group("search");
    g.sample_size(10);
    g.bench_function("llama3.1-405b_1024_h100_4_steps", |b| {
        b.iter(|| search(&profile, &w, &space, &config, &|_, _| {}).unwrap())
    });
    g.finish();
}

criterion_group!(benches, bench_partition, bench_search, bench_search_405b);
criterion_main!(benches);
