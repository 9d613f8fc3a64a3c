//! Mixture of experts: the routed part of a layer's costs against the expert GEMMs written out
//! by hand, and what a padded microbatch's identical padding tokens cost an expert-parallel
//! group through the router model.

use flatpipe::profiles::{AnalyticOptions, ModelSpec, Profile, analytic_profile, builtins};
use flatpipe::simulator::batching::microbatch::{Microbatch, Shape};
use flatpipe::simulator::costs::ns_to_s;
use flatpipe::simulator::costs::{CostOptions, TableCosts};
use flatpipe::simulator::ir::{Action, ActionKind, ComputeAction, MicrobatchId, StageId};
use flatpipe::simulator::replay::metrics::all_to_all_time;
use flatpipe::simulator::run::plan::even_split;
use flatpipe::simulator::{CostModel, Placement};

/// The A100's roofline GEMM (MAMF 271.2e12 FLOP/s, 2.039e12 B/s), without its 6 µs fixed cost.
fn a100_math_s(m: f64, n: f64, k: f64) -> f64 {
    (2.0 * m * n * k / 271.2e12).max(2.0 * (m * k + k * n + m * n) / 2.039e12)
}

/// Qwen3-30B-A3B's experts (128 of width 768, 8 per token, hidden 2048) at 4,096 tokens: each
/// expert's gate/up `[256, 2048] x [2048, 1536]` and down `[256, 768] x [768, 2048]`, 128 of
/// each as one grouped kernel with one fixed cost.
#[test]
fn the_routed_part_is_the_experts_gemms() {
    let m = builtins::model("qwen3-30b-a3b").unwrap();
    let hw = builtins::hardware("a100").unwrap();
    let p = analytic_profile(&m, &hw, &AnalyticOptions::default()).unwrap();
    let routed = p.layers[1].routed.expect("a mixture-of-experts layer");
    let rows = 4096.0 * 8.0 / 128.0;
    let want =
        128.0 * (a100_math_s(rows, 1536.0, 2048.0) + a100_math_s(rows, 2048.0, 768.0)) + 2.0 * 6e-6;
    let got = routed.f.time_s(4096.0, 0.0);
    // The profile is a line fitted over 512 to 16,384 tokens, and these GEMMs turn from
    // memory-bound (each expert's weights read whatever its rows) to compute-bound inside that
    // range: the line is within 15% of the curve here (11% above it).
    assert!((got / want - 1.0).abs() < 0.15, "{got} vs {want}");
    assert!(p.layers[0].routed.is_none() && p.layers[49].routed.is_none());
}

fn two_expert_profile() -> Profile {
    // Two experts, one per token, split over ep = 2: the padding's one expert is on one GPU,
    // which then gets `(1 - p) T / 2 + p T` routed tokens against a mean of `T / 2`: 1 + p.
    let text = "name: moe2\ndtype: bf16\nlayers:\n  - {kind: embedding, vocab: 1000, hidden: 256}\n  - {kind: decoder, count: 2, hidden: 256, heads: 4, kv_heads: 4, moe: {experts: 2, top_k: 1, expert_ffn: 512}}\n  - {kind: head, vocab: 1000, hidden: 256}\n";
    let m = ModelSpec::from_yaml(text, "moe2").unwrap();
    let hw = builtins::hardware("h100").unwrap();
    analytic_profile(&m, &hw, &AnalyticOptions::default())
        .unwrap()
        .expert_parallel(2, 1, true)
        .unwrap()
}

fn forward_s(prof: &Profile, mb: &Microbatch) -> f64 {
    let stages = even_split(prof.layers.len(), 1).unwrap();
    let c = TableCosts::with_options(
        prof,
        &stages,
        &Placement::looped(1, 1),
        std::slice::from_ref(mb),
        &[],
        &CostOptions {
            dp: 2,
            ..Default::default()
        },
    )
    .unwrap();
    ns_to_s(c.compute_ns(ComputeAction {
        kind: ActionKind::F,
        stage: StageId(0),
        microbatch: MicrobatchId(0),
    }))
}

#[test]
fn padding_unbalances_an_expert_parallel_group_and_flat_does_not() {
    let prof = two_expert_profile();
    let mut balanced = prof.clone();
    for l in &mut balanced.layers {
        l.routed = None;
    }
    // Two sequences of 100 and 300 tokens: flat, 400 tokens; padded to [2, 300], 600 computed
    // tokens of which 200 padding (p = 1/3).
    let flat = Microbatch {
        chunk: None,
        seq_lens: vec![100, 300],
        shape: Shape::Flat,
    };
    let padded = Microbatch {
        shape: Shape::Padded {
            rows: 2,
            seq_len: 300,
        },
        ..flat.clone()
    };
    assert!((forward_s(&prof, &flat) - forward_s(&balanced, &flat)).abs() < 1e-12);
    let excess: f64 = prof.layers[1..3]
        .iter()
        .map(|l| l.routed.unwrap().f.time_s(600.0, 0.0) / 3.0)
        .sum();
    let got = forward_s(&prof, &padded) - forward_s(&balanced, &padded);
    // Each cell is rounded to the nanosecond.
    assert!((got - excess).abs() < 3e-9, "{got} vs {excess}");
    assert!(excess > 0.0);
}

/// DualPipe's overlapped pair on the two-expert model (ep = 2 inside an H100 node): each of the
/// 2 decoders pays a dispatch and a combine per pass, `2 (alpha + T k H d (1 - 1/ep) / beta)`;
/// the pair F + B of one microbatch takes `max(C + k min(C, A), A)` with `A` its 4 passes'
/// all-to-alls, `C` the rest of its time and `k` the H100's collective interference (0.18).
#[test]
fn an_overlapped_pair_hides_its_all_to_alls_under_the_other_chunk() {
    let prof = two_expert_profile();
    let mb = Microbatch {
        chunk: None,
        seq_lens: vec![400],
        shape: Shape::Flat,
    };
    let stages = even_split(prof.layers.len(), 1).unwrap();
    let c = TableCosts::with_options(
        &prof,
        &stages,
        &Placement::looped(1, 1),
        std::slice::from_ref(&mb),
        &[],
        &CostOptions {
            dp: 2,
            ..Default::default()
        },
    )
    .unwrap();
    let action = |kind| ComputeAction {
        kind,
        stage: StageId(0),
        microbatch: MicrobatchId(0),
    };
    let link = &prof.hardware.intra_node;
    let per_pass = 2.0 * 2.0 * (link.alpha_s + 400.0 * 256.0 * 2.0 * 0.5 / link.beta_bytes_per_s);
    let a = 2.0 * per_pass;
    let (tf, tb) = (
        ns_to_s(c.compute_ns(action(ActionKind::F))),
        ns_to_s(c.compute_ns(action(ActionKind::B))),
    );
    let rest = tf + tb - a;
    let want = (rest + 0.18 * rest.min(a)).max(a);
    let got = ns_to_s(c.overlap_ns(action(ActionKind::F), action(ActionKind::B)));
    assert!((got - want).abs() < 5e-9, "{got} vs {want}");
    assert!(got < tf + tb);
    // F alone, the pair, then B alone: every pass's all-to-alls in all, exposed whole where an
    // action runs alone and, of the pair, its time beyond its compute.
    assert!((ns_to_s(c.all_to_all_ns(action(ActionKind::F))) - per_pass).abs() < 2e-9);
    assert_eq!(c.all_to_all_ns(action(ActionKind::W)), 0);
    let rank = [
        Action::Compute(action(ActionKind::F)),
        Action::Overlap(action(ActionKind::F), action(ActionKind::B)),
        Action::Compute(action(ActionKind::B)),
    ];
    let x = all_to_all_time(&rank, &c).expect("expert-parallel all-to-alls");
    assert!((x.total_s - 4.0 * per_pass).abs() < 1e-8, "{x:?}");
    let exposed = 2.0 * per_pass + (want - rest);
    assert!((x.exposed_s - exposed).abs() < 1e-8, "{x:?} vs {exposed}");
    assert!(x.exposed_s < x.total_s);
    // A dense model's pair is the sum of its two chunks.
    let dense = analytic_profile(
        &builtins::model("tiny").unwrap(),
        &builtins::hardware("h100").unwrap(),
        &AnalyticOptions::default(),
    )
    .unwrap();
    let stages = even_split(dense.layers.len(), 1).unwrap();
    let d = TableCosts::with_options(
        &dense,
        &stages,
        &Placement::looped(1, 1),
        std::slice::from_ref(&mb),
        &[],
        &CostOptions::default(),
    )
    .unwrap();
    let sum = d.compute_ns(action(ActionKind::F)) + d.compute_ns(action(ActionKind::B));
    assert_eq!(
        d.overlap_ns(action(ActionKind::F), action(ActionKind::B)),
        sum
    );
    assert_eq!(all_to_all_time(&rank, &d), None);
}
