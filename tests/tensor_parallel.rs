//! Tensor parallelism and placement: one GPU's profile against the collective formulas and the
//! parameter and activation counts written out by hand, and the links transfers cross.

use flatpipe::profiles::{AnalyticOptions, LayerKind, Profile, analytic_profile, builtins};
use flatpipe::simulator::batching::microbatch::Microbatch;
use flatpipe::simulator::costs::{CostOptions, TableCosts};
use flatpipe::simulator::ir::{ActionKind, MicrobatchId, StageId};
use flatpipe::simulator::{CostModel, Placement};

fn profile(model: &str) -> Profile {
    let m = builtins::model(model).unwrap();
    let hw = builtins::hardware("h200").unwrap();
    analytic_profile(&m, &hw, &AnalyticOptions::default()).unwrap()
}

/// Llama-3.1-70B decoder (H 8192, FFN 28672, 64 heads, 8 KV heads of 128), t = 8 on NVLink
/// (alpha a, bandwidth b): a forward of T tokens is the unsplit compute over 8, the same fixed
/// cost, and two ring all-reduces of the bf16 [T, H] output, `2 * 2 (t-1) (a + 2HT / (t b))`;
/// the input-gradient pass two more; the weight-gradient pass none without sequence
/// parallelism and two all-gathers `(t-1) (a + 2HT / (t b))` with it.
#[test]
fn decoder_collectives_follow_the_ring_formulas() {
    let mut p = profile("llama3.1-70b");
    // The narrower GEMMs' loss is the profiles crate's test; here the collectives alone.
    p.gemm_split.clear();
    let (a, b) = (
        p.hardware.intra_node.alpha_s,
        p.hardware.intra_node.beta_bytes_per_s,
    );
    let (h, t) = (8192.0, 8.0);
    let (tokens, pairs) = (4096.0, 4096.0 * 4097.0 / 2.0);
    let ring = |bytes: f64| (t - 1.0) * (a + bytes / (t * b));
    let base = &p.layers[1];
    for sp in [false, true] {
        let q = p.tensor_parallel(8, sp).unwrap();
        let l = &q.layers[1];
        assert_eq!(l.kind, LayerKind::Decoder);
        let compute = |c: &flatpipe::profiles::CostCoeffs| {
            c.c0_s + (c.c_tok_s * tokens + c.c_attn_s * pairs) / t
        };
        let all_reduce = 2.0 * ring(2.0 * h * tokens);
        let f = compute(&base.f) + 2.0 * all_reduce;
        let i = compute(&base.i) + 2.0 * all_reduce;
        let w = compute(&base.w)
            + if sp {
                2.0 * ring(2.0 * h * tokens)
            } else {
                0.0
            };
        for (got, want, what) in [
            (l.f.time_s(tokens, pairs), f, "F"),
            (l.i.time_s(tokens, pairs), i, "I"),
            (l.w.time_s(tokens, pairs), w, "W"),
        ] {
            assert!(
                (got - want).abs() < 1e-12 * want.max(1.0),
                "sp {sp} {what}: {got} vs {want}"
            );
        }
    }
}

/// Parameters and activations of one GPU, by hand. A Llama-3.1-70B decoder has
/// `H (H + 2 kv) + H^2` attention weights, `3 H F` MLP weights and `2 H` norm weights; t = 8
/// splits all but the norms. Per token the profile keeps `2 (3H + 2kv + 2F) + 4 heads` bytes
/// for dgrad and `2 (3H + F)` for wgrad (bf16); with sequence parallelism both divide by 8;
/// without it the two norm inputs (`2 * 2H`) and the two GEMM inputs after the norms (`2 * 2H`)
/// stay whole (Korthikanti et al. 2022, §4.1).
#[test]
fn parameters_and_activations_per_gpu_by_hand() {
    let p = profile("llama3.1-70b");
    let (h, kv, ffn, heads) = (8192.0f64, 1024.0f64, 28672.0f64, 64.0f64);
    let params = h * (h + 2.0 * kv) + h * h + 3.0 * h * ffn;
    let act_i = 2.0 * (3.0 * h + 2.0 * kv + 2.0 * ffn) + 4.0 * heads;
    let act_w = 2.0 * (3.0 * h + ffn);
    assert_eq!(p.layers[1].param_count as f64, params + 2.0 * h);
    for sp in [false, true] {
        let q = p.tensor_parallel(8, sp).unwrap();
        let l = &q.layers[1];
        assert_eq!(l.param_count as f64, params / 8.0 + 2.0 * h);
        assert_eq!(l.param_bytes, 2 * l.param_count);
        let keep = if sp { 0.0 } else { 4.0 * h };
        assert!((l.act_bytes_per_token_i - ((act_i - keep) / 8.0 + keep)).abs() < 1e-9);
        assert!((l.act_bytes_per_token_w - ((act_w - keep) / 8.0 + keep)).abs() < 1e-9);
        // A stage boundary sends 1/8 of [T, H] per GPU.
        assert_eq!(l.output_bytes_per_token, 2.0 * h / 8.0);
        // The vocabulary-parallel head: V H / 8 weights and its norm whole.
        let head = q.layers.last().unwrap();
        assert_eq!(head.param_count as f64, 128_256.0 * h / 8.0 + h);
        // One group of eight GPUs per node.
        assert_eq!(q.hardware.gpus_per_node, 1);
    }
}

/// The memory of one GPU holding a Llama-3.1-70B stage of 10 decoders at t = 8: its parameters
/// times 18 bytes (ddp) plus one microbatch's activations, both from the counts above.
#[test]
fn memory_per_gpu_with_tensor_parallelism() {
    let p = profile("llama3.1-70b");
    let (h, kv, ffn, heads) = (8192.0f64, 1024.0f64, 28672.0f64, 64.0f64);
    let tokens = 2048.0;
    for sp in [false, true] {
        let q = p.tensor_parallel(8, sp).unwrap();
        let placement = Placement::looped(1, 1);
        let mbs = [Microbatch {
            chunk: None,
            seq_lens: vec![2048],
            shape: Default::default(),
        }];
        let costs = TableCosts::with_options(
            &q,
            std::slice::from_ref(&(1..11)),
            &placement,
            &mbs,
            &[],
            &CostOptions::default(),
        )
        .unwrap();
        let params = (h * (h + 2.0 * kv) + h * h + 3.0 * h * ffn) / 8.0 + 2.0 * h;
        let keep = if sp { 0.0 } else { 4.0 * h };
        let act = (2.0 * (3.0 * h + 2.0 * kv + 2.0 * ffn) + 4.0 * heads - keep) / 8.0
            + keep
            + (2.0 * (3.0 * h + ffn) - keep) / 8.0
            + keep;
        let state = costs.static_bytes(flatpipe::simulator::ir::Rank(0));
        assert!((state - 10.0 * params * 18.0).abs() < 1.0, "{state}");
        let (ai, aw) = costs.activation(StageId(0), MicrobatchId(0));
        assert!((ai + aw - 10.0 * act * tokens).abs() < 1.0, "sp {sp}");
    }
}

/// Megatron's order on 2 nodes of 8 GPUs, tp = 4 (2 groups per node), pp = 2, dp = 2: replica
/// d's pipeline rank r is group `r * dp + d`; groups 0, 1 share node 0 and 2, 3 node 1. So the
/// pipeline transfer of stage 0 to stage 1 crosses nodes (InfiniBand) in both replicas, and the
/// data-parallel group of each pipeline rank stays on NVLink.
#[test]
fn transfers_cross_the_link_their_ranks_sit_on() {
    let p = profile("llama3.1-8b").tensor_parallel(4, true).unwrap();
    assert_eq!(p.hardware.gpus_per_node, 2);
    let placement = Placement::looped(2, 1);
    let mbs = [Microbatch {
        chunk: None,
        seq_lens: vec![1000],
        shape: Default::default(),
    }];
    let stages = [0..17, 17..34];
    let bytes = p.layers[16].output_bytes_per_token * 1000.0;
    for replica in 0..2 {
        let costs = TableCosts::with_options(
            &p,
            &stages,
            &placement,
            &mbs,
            &[],
            &CostOptions {
                replica,
                dp: 2,
                ..Default::default()
            },
        )
        .unwrap();
        let got = costs.comm_ns(StageId(0), MicrobatchId(0), ActionKind::F) as f64 * 1e-9;
        let ib = &p.hardware.inter_node;
        let want = ib.alpha_s + bytes / ib.beta_bytes_per_s;
        assert!(
            (got - want).abs() < 1e-9,
            "replica {replica}: {got} vs {want}"
        );
    }
    use flatpipe::simulator::costs::sharding::{DpGroup, Sharding};
    for r in 0..2 {
        let g = DpGroup::of(Sharding::Fsdp, &p.hardware, 2, 2, r);
        assert_eq!(g.shard_link, p.hardware.intra_node, "pipeline rank {r}");
    }
}

/// What tensor parallelism cannot do says why: a degree that does not divide the GPUs per node
/// or the heads.
#[test]
fn bad_tensor_parallel_degrees_are_clear_errors() {
    let p = profile("llama3.1-8b");
    let e = p.tensor_parallel(3, true).unwrap_err().to_string();
    assert!(
        e.contains("tp") && e.contains("3") && e.contains("8 GPUs per node"),
        "{e}"
    );
    let mut wide = p.clone();
    wide.hardware.gpus_per_node = 64;
    let e = wide.tensor_parallel(16, true).unwrap_err().to_string();
    assert!(
        e.contains("32 attention heads and 8 key-value heads"),
        "{e}"
    );
}

/// The planner searches tp over the divisors of the GPUs per node that divide the heads: on two
/// H200 nodes Llama-3.1-70B's candidates span tp in {1, 2, 4, 8}, each with tp x dp x pp = 16,
/// and a tp the model refuses is a clear error.
#[test]
fn planner_searches_tensor_parallel_degrees() {
    use flatpipe::planner::search::{
        RankBy, SearchConfig, SearchSpace, search, tensor_parallel_degrees,
    };
    use flatpipe::profiles::StepSize;
    let prof = profile("llama3.1-70b");
    // 8 GPUs per node; 64 heads and 8 KV heads: every divisor of 8 divides both.
    assert_eq!(tensor_parallel_degrees(&prof), vec![1, 2, 4, 8]);
    let w = builtins::workload("sharegpt-v3").unwrap();
    let mut space = SearchSpace::default_for(16);
    space.pp = vec![1, 2, 4];
    space.token_budgets = vec![8192];
    space.kinds = vec![flatpipe::simulator::ScheduleKind::OneFOneB];
    let config = SearchConfig {
        steps: 4,
        seed: 0,
        size: StepSize::Seqs(128),
        memory_limit_bytes: prof.hardware.memory_bytes as f64 - 4.0 * (1u64 << 30) as f64,
        state_bytes: None,
        rank_by: RankBy::Mean,
        keep: 50,
        exact_split: flatpipe::planner::partition::ExactSplit::DEFAULT,
        forward_only: None,
    };
    let r = search(&prof, &w, &space, &config, &|_, _| {}).unwrap();
    let tps: std::collections::BTreeSet<u32> = r.ranked.iter().map(|c| c.tp).collect();
    assert!(tps.iter().any(|&t| t > 1), "{tps:?}");
    for c in &r.ranked {
        assert_eq!(c.tp * c.run.dp * c.run.pp, 16, "{}", c.describe());
    }
    space.tp = vec![3];
    let e = search(&prof, &w, &space, &config, &|_, _| {})
        .unwrap_err()
        .to_string();
    assert!(e.contains("tp=3") && e.contains("GPUs"), "{e}");
}
