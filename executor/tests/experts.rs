//! Mixture-of-experts layers under expert parallelism: for the pipeline schedules that run MoE
//! models, a step on `pp x dp` ranks whose expert-parallel groups split the routed experts
//! equals the single-rank run of the same step (loss, every gradient, the global norm, and the
//! parameters after AdamW), within the oracle's fp32 tolerances ([`verify_step`]).
//!
//! The expert-parallel runs move each routed token to its expert's rank and back (four
//! all-to-alls per MoE layer and microbatch); the reference runs every expert on one rank.
//! Only the order of the sums differs.

mod common;

use flatpipe_executor::runner::{Executor, PreparedStep, Reference, Setup};
use flatpipe_executor::verify::verify_step;
use flatpipe_profiles::ModelSpec;
use flatpipe_simulator::ScheduleKind;
use flatpipe_simulator::run::config::ScheduleSource;

/// 4 routed experts (2 per token, one shared expert) in each of 6 decoders.
fn model() -> ModelSpec {
    ModelSpec::from_yaml(
        "name: mini-moe\ndtype: fp32\nlayers:\n  - {kind: embedding, vocab: 128, hidden: 32}\n  - {kind: decoder, count: 6, hidden: 32, heads: 4, kv_heads: 2, moe: {experts: 4, top_k: 2, expert_ffn: 16, shared_experts: 1}}\n  - {kind: head, vocab: 128, hidden: 32}\n",
        "mini-moe",
    )
    .unwrap()
}

fn setup(kind: ScheduleKind, (pp, v, m): (u32, u32, u32), dp: u32, ep: u32) -> Setup {
    let mut s = common::setup(
        model(),
        common::workload(12.0, 64),
        ScheduleSource::Kind(kind),
        (pp, v, m),
    );
    s.config.dp = dp;
    s.ep = ep;
    s.step_size = flatpipe_profiles::StepSize::Seqs(3 * m * dp);
    s
}

/// Checks one step's gradients, then one step with AdamW, against the reference; returns the
/// gradients of the first.
fn check(s: &Setup, step: &PreparedStep) -> std::collections::BTreeMap<String, Vec<f32>> {
    let name = format!(
        "{} pp={} v={} dp={} ep={}",
        s.config.source.name(),
        s.config.pp,
        s.config.v,
        s.config.dp,
        s.ep
    );
    let mut exec = Executor::cpu(s).unwrap();
    let mut reference = Reference::new(s).unwrap();
    let run = exec.gradients(step).unwrap();
    let grads = exec.named_grads();
    let v = verify_step(&run, &grads, None, &mut reference, s, step).unwrap();
    assert!(v.within_tolerance, "{name}: {v:?}");
    // Every MoE layer of every microbatch exchanged tokens: 2 all-to-alls in F, 2 in I.
    if s.ep > 1 {
        let moe_layers = 6;
        let microbatches: usize = step.replicas.iter().map(|r| r.microbatches.len()).sum();
        let spans: usize = run.all_to_all.iter().map(Vec::len).sum();
        assert_eq!(spans, 4 * moe_layers * microbatches, "{name}");
        check_exposed(&run, s, &name);
    }
    let mut exec = Executor::cpu(s).unwrap();
    let mut reference = Reference::new(s).unwrap();
    let run = exec.train_step(s, step).unwrap();
    let v = verify_step(
        &run,
        &exec.named_grads(),
        Some(&exec.named_params()),
        &mut reference,
        s,
        step,
    )
    .unwrap();
    assert!(v.within_tolerance, "{name} after AdamW: {v:?}");
    // The replicas of an expert-data-parallel group hold the same experts after the step.
    let per_replica = exec.replica_params();
    let ep = s.ep as usize;
    for (d, params) in per_replica.iter().enumerate().skip(ep) {
        for (k, val) in params {
            assert_eq!(
                Some(val),
                per_replica[d % ep].get(k),
                "{name}: replica {d}'s {k}"
            );
        }
    }
    grads
}

/// A schedule, its `(pp, v, m)`, dp and ep.
type Case = (ScheduleKind, (u32, u32, u32), u32, u32);

/// The exposed all-to-all time of each rank: all of it where actions run one part at a time
/// (their all-to-alls never overlap each other), less than all of it on a rank that runs
/// overlapped pairs (a half waits on the wire while the other computes).
fn check_exposed(run: &flatpipe_executor::interpreter::StepRun, s: &Setup, name: &str) {
    let pairs = matches!(
        s.config.source,
        ScheduleSource::Kind(ScheduleKind::DualPipeV | ScheduleKind::Combined1F1B)
    );
    let mut hidden_somewhere = false;
    for (g, spans) in run.all_to_all.iter().enumerate() {
        let total: u64 = spans.iter().map(|a| a.end_ns - a.ready_ns).sum();
        let exposed = run.exposed_all_to_all_ns[g];
        assert!(exposed <= total, "{name} rank {g}: {exposed} > {total}");
        if !pairs {
            assert_eq!(exposed, total, "{name} rank {g}");
        }
        hidden_somewhere |= exposed < total;
    }
    if pairs {
        assert!(
            hidden_somewhere,
            "{name}: no all-to-all hid under a paired half"
        );
    }
}

#[test]
fn expert_parallel_steps_match_the_single_rank_run() {
    let cases: &[Case] = &[
        (ScheduleKind::OneFOneB, (2, 1, 3), 1, 1),
        (ScheduleKind::OneFOneB, (2, 1, 3), 2, 2),
        (ScheduleKind::ZbH1, (2, 1, 3), 2, 2),
        (ScheduleKind::Interleaved1F1B, (2, 2, 3), 2, 2),
        (ScheduleKind::DualPipeV, (2, 2, 4), 2, 2),
        (ScheduleKind::Combined1F1B, (2, 2, 3), 2, 2),
        (ScheduleKind::OneFOneB, (4, 1, 4), 2, 2),
        (ScheduleKind::ZbH1, (4, 1, 4), 2, 2),
        (ScheduleKind::Interleaved1F1B, (4, 2, 4), 2, 2),
        (ScheduleKind::DualPipeV, (4, 2, 8), 2, 2),
        // Two expert-parallel groups: the experts' gradients reduced over their own replicas.
        (ScheduleKind::OneFOneB, (1, 1, 2), 4, 2),
    ];
    for &(kind, shape, dp, ep) in cases {
        let s = setup(kind, shape, dp, ep);
        let step = s.prepare(0).unwrap();
        check(&s, &step);
    }
}

/// Every token the same id: identical inputs give identical hidden states (attention over equal
/// values returns that value), so the router sends every token to the same `top_k` experts,
/// as the padding of a padded microbatch would. The expert-parallel run still matches, and
/// exactly those experts get gradients.
#[test]
fn a_step_routed_to_one_expert_pair_matches() {
    let s = setup(ScheduleKind::OneFOneB, (2, 1, 3), 2, 2);
    let mut step = s.prepare(0).unwrap();
    for r in &mut step.replicas {
        for mb in &mut r.microbatches {
            mb.ids.iter_mut().for_each(|x| *x = 7);
        }
    }
    let grads = check(&s, &step);
    for layer in 0..6 {
        let hot: Vec<usize> = (0..4)
            .filter(|e| {
                grads[&format!("layers.{layer}.moe.experts.{e}.w1.weight")]
                    .iter()
                    .any(|&g| g != 0.0)
            })
            .collect();
        assert_eq!(
            hot.len(),
            2,
            "layer {layer}: experts with gradients {hot:?}"
        );
    }
}

#[test]
fn unequal_microbatch_counts_in_a_group_are_refused() {
    let s = setup(ScheduleKind::OneFOneB, (2, 1, 3), 2, 2);
    let mut step = s.prepare(0).unwrap();
    let other = setup(ScheduleKind::OneFOneB, (2, 1, 2), 2, 2);
    step.replicas[1] = other.prepare(0).unwrap().replicas[1].clone();
    let mut exec = Executor::cpu(&s).unwrap();
    let e = exec.gradients(&step).unwrap_err().to_string();
    assert!(
        e.contains("expert-parallel group") && e.contains("3 and 2 microbatches"),
        "{e}"
    );
}

#[test]
fn an_expert_parallel_degree_that_does_not_fit_is_refused() {
    let e = Executor::cpu(&setup(ScheduleKind::OneFOneB, (2, 1, 3), 2, 3))
        .unwrap_err()
        .to_string();
    assert!(e.contains("ep = 3") && e.contains("dp = 2"), "{e}");
    // 4 experts do not split over 8... nor over 3 replicas of 6.
    let e = Executor::cpu(&setup(ScheduleKind::OneFOneB, (1, 1, 2), 6, 3))
        .unwrap_err()
        .to_string();
    assert!(e.contains("4 routed experts"), "{e}");
}

/// An expert-parallel group runs in step with its slowest member, microbatch by microbatch:
/// its prediction replays every member on the group's costliest k-th microbatch for each k (by
/// model FLOPs), while each member keeps its own microbatches; without expert parallelism the
/// plan is unchanged.
#[test]
fn a_group_is_predicted_on_its_costliest_microbatches() {
    use flatpipe_simulator::batching::microbatch::Microbatch;
    let s = setup(ScheduleKind::OneFOneB, (2, 1, 3), 2, 2);
    let step = s.prepare(0).unwrap();
    let hw = flatpipe_profiles::builtins::hardware("cpu").unwrap();
    let profile = flatpipe_profiles::analytic_profile(&s.model, &hw, &Default::default()).unwrap();
    let flops = |m: &Microbatch| profile.model_flops(m.tokens() as f64, m.attn_pairs() as f64);
    let coupled = step.plan.expert_coupled(2, &profile);
    let slots = |p: &flatpipe_simulator::run::step::StepPlan, d: usize| {
        p.replicas[d].rounds[0].slots.clone()
    };
    let (a, b) = (slots(&step.plan, 0), slots(&step.plan, 1));
    assert_ne!(a, b, "the replicas' microbatches differ");
    for k in 0..3 {
        let want = if flops(&b[k]) >= flops(&a[k]) {
            &b[k]
        } else {
            &a[k]
        };
        for d in 0..2 {
            assert_eq!(&slots(&coupled, d)[k], want, "slot {k} of replica {d}");
        }
    }
    for d in 0..2 {
        assert_eq!(
            coupled.replicas[d].microbatches,
            step.plan.replicas[d].microbatches
        );
    }
    let alone = step.plan.expert_coupled(1, &profile);
    assert_eq!((slots(&alone, 0), slots(&alone, 1)), (a, b));
}
