//! The correctness oracle: for every schedule, several (p, v, m), the pipelined step's loss and
//! every parameter gradient equal a single-rank run of the same step.
//!
//! Tolerance (fp32): loss within 1e-5 relative; every gradient tensor within 1e-4 normwise
//! relative (`max|a - b| / max|b|`). The pipelined and the reference runs do the same
//! arithmetic per microbatch; they differ only in the order the wgrad GEMMs accumulate the
//! microbatches' contributions, which moves the last bits.

mod common;

use flatpipe_executor::data::LossReduction;
use flatpipe_executor::runner::{Executor, Reference, Setup, compare};
use flatpipe_profiles::{ModelSpec, StepSize};
use flatpipe_simulator::ScheduleKind;
use flatpipe_simulator::costs::Recompute;
use flatpipe_simulator::run::config::ScheduleSource;

use flatpipe_executor::verify::{LOSS_RTOL, TENSOR_RTOL as GRAD_RTOL, verify_step};

/// A 6-decoder model small enough for many configurations in a debug test run.
fn model() -> ModelSpec {
    ModelSpec::from_yaml(
        "name: mini\ndtype: fp32\nlayers:\n  - {kind: embedding, vocab: 128, hidden: 32}\n  - {kind: decoder, count: 6, hidden: 32, ffn: 64, heads: 4, kv_heads: 2}\n  - {kind: head, vocab: 128, hidden: 32}\n",
        "mini",
    )
    .unwrap()
}

fn setup(source: ScheduleSource, pp: u32, v: u32, m: u32) -> Setup {
    common::setup(model(), common::workload(12.0, 64), source, (pp, v, m))
}

/// Runs one step pipelined and on one rank; checks loss, gradients, grad norm, and then the
/// parameters after an AdamW step.
fn check(s: &Setup) {
    let name = format!(
        "{} p={} v={} m={:?}",
        s.config.source.name(),
        s.config.pp,
        s.config.v,
        s.config.params.microbatches
    );
    let step = s.prepare(0).unwrap();
    // Gradients of one step (no optimizer), through the library's --verify.
    let mut exec = Executor::cpu(s).unwrap();
    let mut reference = Reference::new(s).unwrap();
    let run = exec.gradients(&step).unwrap();
    let v = verify_step(&run, &exec.named_grads(), None, &mut reference, s, &step).unwrap();
    assert!(v.within_tolerance, "{name}: {v:?}");
    // The tolerances themselves, stated: loss, gradients, grad norm.
    assert!(v.loss_rel_diff <= LOSS_RTOL, "{name}: loss {v:?}");
    assert!(
        v.grads.max_rel <= GRAD_RTOL,
        "{name}: gradients differ: {v:?}"
    );
    assert!(v.grad_norm_rel_diff <= GRAD_RTOL, "{name}: grad norm {v:?}");
    // Every microbatch ran once on every stage, and nothing is left held.
    for rank in &exec.ranks {
        for (_, w) in rank {
            use flatpipe_executor::StageWorker;
            assert_eq!(
                w.held_microbatches(),
                0,
                "{name}: activations left after the step"
            );
        }
    }
    // One optimizer step on both: parameters agree.
    let mut exec = Executor::cpu(s).unwrap();
    let mut reference = Reference::new(s).unwrap();
    let run = exec.train_step(s, &step).unwrap();
    let v = verify_step(
        &run,
        &exec.named_grads(),
        Some(&exec.named_params()),
        &mut reference,
        s,
        &step,
    )
    .unwrap();
    let p = v.params.as_ref().unwrap();
    assert!(
        p.max_rel <= GRAD_RTOL && v.within_tolerance,
        "{name}: parameters after AdamW differ: {v:?}"
    );
}

#[test]
fn every_schedule_matches_the_single_rank_run() {
    // (kind, p, v, m): m < p, m % p != 0, p = 2 with v = 2, and the schedules' own v.
    let cases: &[(ScheduleKind, u32, u32, u32)] = &[
        (ScheduleKind::GPipe, 4, 1, 5),
        (ScheduleKind::OneFOneB, 4, 1, 3),
        (ScheduleKind::OneFOneB, 2, 1, 5),
        (ScheduleKind::Interleaved1F1B, 2, 2, 5),
        (ScheduleKind::Interleaved1F1B, 2, 2, 1),
        (ScheduleKind::LoopedBfs, 2, 2, 3),
        (ScheduleKind::ZbH1, 4, 1, 6),
        (ScheduleKind::ZbH1, 3, 1, 2),
        (ScheduleKind::ZbH2, 2, 1, 3),
        (ScheduleKind::ZbV, 2, 2, 3),
        (ScheduleKind::ZbV, 3, 2, 2),
        (ScheduleKind::DualPipeV, 2, 2, 5),
        (ScheduleKind::DualPipeV, 3, 2, 7),
    ];
    for &(kind, p, v, m) in cases {
        check(&setup(ScheduleSource::Kind(kind), p, v, m));
    }
}

#[test]
fn pp_one_runs_through_the_same_interpreter() {
    check(&setup(
        ScheduleSource::Kind(ScheduleKind::OneFOneB),
        1,
        1,
        3,
    ));
}

#[test]
fn a_loaded_pytorch_csv_schedule_matches() {
    // ZB-H1 written to PyTorch's CSV and read back: a schedule given as data.
    let s = ScheduleKind::ZbH1.generate(2, 1, 4).unwrap();
    let csv = flatpipe_simulator::ir::pytorch_csv::write_pytorch_csv(&s, false).unwrap();
    let loaded = flatpipe_simulator::ir::pytorch_csv::read_pytorch_csv(&csv, "zb.csv").unwrap();
    check(&setup(ScheduleSource::Given(loaded), 2, 1, 4));
}

#[test]
fn more_microbatches_or_pipelining_leave_loss_and_gradients_unchanged() {
    // The same step's sequences as 1 microbatch on 1 rank and as 4 microbatches on 2 ranks.
    let mut one = setup(ScheduleSource::Kind(ScheduleKind::GPipe), 1, 1, 1);
    one.step_size = StepSize::Seqs(8);
    let mut four = setup(ScheduleSource::Kind(ScheduleKind::OneFOneB), 2, 1, 4);
    four.step_size = StepSize::Seqs(8);
    let (s1, s4) = (one.prepare(0).unwrap(), four.prepare(0).unwrap());
    let mut lens1: Vec<u32> = s1
        .all_microbatches()
        .flat_map(|m| m.seq_lens.clone())
        .collect();
    let mut lens4: Vec<u32> = s4
        .all_microbatches()
        .flat_map(|m| m.seq_lens.clone())
        .collect();
    lens1.sort_unstable();
    lens4.sort_unstable();
    assert_eq!(lens1, lens4, "same sequences");
    // Token ids depend on the microbatch a sequence lands in, so compare on the same data: put
    // the 4-microbatch step's sequences into one microbatch by concatenation.
    let mut merged = s4.clone();
    let all: Vec<_> = s4.all_microbatches().cloned().collect();
    let mut big = all[0].clone();
    for m in &all[1..] {
        let off = big.ids.len();
        big.seq_lens.extend(&m.seq_lens);
        big.ids.extend(&m.ids);
        big.labels.extend(&m.labels);
        big.loss_weights.extend(&m.loss_weights);
        big.cu_seqlens
            .extend(m.cu_seqlens[1..].iter().map(|c| c + off));
    }
    merged.replicas[0].microbatches = vec![big];
    merged.replicas[0].schedule = ScheduleKind::GPipe.generate(1, 1, 1).unwrap();
    let mut single = Executor::cpu(&one).unwrap();
    let a = single.gradients(&merged).unwrap();
    let mut piped = Executor::cpu(&four).unwrap();
    let b = piped.gradients(&s4).unwrap();
    assert!(
        (a.loss - b.loss).abs() <= LOSS_RTOL * a.loss,
        "{} vs {}",
        a.loss,
        b.loss
    );
    let d = compare(&piped.named_grads(), &single.named_grads()).unwrap();
    assert!(d.max_rel <= GRAD_RTOL, "{d:?}");
    // The loss is the per-token mean: Σ loss sums / Σ tokens, not a mean of microbatch means.
    let parts: Vec<(f64, u64)> = b.microbatch_losses[0]
        .iter()
        .map(|l| (l.sum, l.tokens))
        .collect();
    let per_token = flatpipe_executor::data::per_token_mean(&parts);
    assert!(
        (per_token - b.loss).abs() < 1e-6 * b.loss,
        "{per_token} vs {}",
        b.loss
    );
}

#[test]
fn data_parallel_replicas_all_reduce_to_the_single_rank_gradient() {
    let mut s = setup(ScheduleSource::Kind(ScheduleKind::OneFOneB), 2, 1, 2);
    s.config.dp = 2;
    s.step_size = StepSize::Seqs(16);
    let step = s.prepare(0).unwrap();
    assert_eq!(step.replicas.len(), 2);
    let mut exec = Executor::cpu(&s).unwrap();
    let mut reference = Reference::new(&s).unwrap();
    let run = exec.train_step(&s, &step).unwrap();
    let r = reference.step(&s, &step, true).unwrap();
    assert!((run.loss - r.loss).abs() <= LOSS_RTOL * r.loss);
    assert!((run.grad_norm - r.grad_norm).abs() <= GRAD_RTOL * r.grad_norm);
    let params = exec.replica_params();
    let d = compare(&params[0], &reference.named_params()).unwrap();
    assert!(d.max_rel <= GRAD_RTOL, "{d:?}");
    assert_eq!(
        params[0], params[1],
        "replicas hold the same weights after the step"
    );
    assert_eq!(run.timeline.num_ranks(), 4);
}

#[test]
fn full_and_selective_recomputation_run_as_planned() {
    let mut s = setup(ScheduleSource::Kind(ScheduleKind::OneFOneB), 2, 1, 3);
    s.config.recompute = vec![Recompute::Full, Recompute::None];
    check(&s);
    s.config.recompute = vec![Recompute::Selective, Recompute::None];
    check(&s);
    // Selective on every stage of a zero-bubble schedule (I and W apart).
    let mut s = setup(ScheduleSource::Kind(ScheduleKind::ZbH1), 2, 1, 3);
    s.config.recompute = vec![Recompute::Selective, Recompute::Selective];
    check(&s);
}

#[test]
fn evaluation_then_training_on_the_same_stages() {
    let s = setup(ScheduleSource::Kind(ScheduleKind::Interleaved1F1B), 2, 2, 3);
    let step = s.prepare(0).unwrap();
    let mut exec = Executor::cpu(&s).unwrap();
    let eval = exec.eval_step(&step).unwrap();
    let train = exec.gradients(&step).unwrap();
    // The evaluation computes the same loss as the training forward and leaves nothing held.
    let eval_loss: f64 = eval.fo_losses[0].iter().map(|l| l.weighted).sum();
    assert!((eval_loss - train.loss).abs() <= LOSS_RTOL * train.loss);
    let mut reference = Reference::new(&s).unwrap();
    reference.step(&s, &step, false).unwrap();
    let d = compare(&exec.named_grads(), &reference.named_grads()).unwrap();
    assert!(d.max_rel <= GRAD_RTOL, "{d:?}");
}

#[test]
fn losses_fall_over_a_few_adamw_steps() {
    let mut s = setup(ScheduleSource::Kind(ScheduleKind::ZbH1), 2, 1, 2);
    s.adamw.lr = 3e-3;
    let mut exec = Executor::cpu(&s).unwrap();
    let step = s.prepare(0).unwrap();
    let first = exec.train_step(&s, &step).unwrap().loss;
    let mut last = first;
    for _ in 0..15 {
        last = exec.train_step(&s, &step).unwrap().loss;
    }
    assert!(last < 0.9 * first, "{first} -> {last}");
}

#[test]
fn per_sequence_loss_reduction_matches_too() {
    let mut s = setup(ScheduleSource::Kind(ScheduleKind::ZbH2), 2, 1, 4);
    s.reduction = LossReduction::PerSequence;
    check(&s);
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(16))]
    /// Any schedule, any p in 1..=4 and m in 1..=8: the pipelined step equals the single-rank one.
    #[test]
    fn random_configurations_match_the_single_rank_run(
        k in 0usize..ScheduleKind::ALL.len(),
        p in 1u32..=4,
        m in 1u32..=8,
    ) {
        let kind = ScheduleKind::ALL[k];
        let v = kind.stages_per_rank(None).unwrap();
        // The mini model has 8 layers: at most 8 stages.
        proptest::prop_assume!(p * v <= 8);
        check(&setup(ScheduleSource::Kind(kind), p, v, m));
    }
}

#[test]
fn forward_only_work_runs_in_the_interpreter_and_leaves_training_unchanged() {
    use flatpipe_simulator::run::config::ForwardOnlySpec;
    use flatpipe_simulator::schedules::forward_only::FoMode;
    for (kind, mode, dep) in [
        (ScheduleKind::OneFOneB, FoMode::Fused, true),
        (ScheduleKind::ZbH1, FoMode::Fused, false),
        (ScheduleKind::Interleaved1F1B, FoMode::Separate, true),
        (ScheduleKind::ZbAuto, FoMode::Fused, true),
    ] {
        let v = kind.stages_per_rank(None).unwrap();
        let mut s = setup(ScheduleSource::Kind(kind), 2, v, 4);
        s.config.forward_only = Some(ForwardOnlySpec {
            microbatches: Some(5),
            mode,
            loss_dependency: dep,
        });
        let step = s.prepare(0).unwrap();
        assert_eq!(step.replicas[0].schedule.num_fo_microbatches, 5);
        let mut exec = Executor::cpu(&s).unwrap();
        let run = exec.gradients(&step).unwrap();
        let mut reference = Reference::new(&s).unwrap();
        let r = reference.step(&s, &step, false).unwrap();
        assert!((run.loss - r.loss).abs() <= LOSS_RTOL * r.loss);
        let d = compare(&exec.named_grads(), &reference.named_grads()).unwrap();
        assert!(d.max_rel <= GRAD_RTOL, "{}: {d:?}", kind.name());
        // Fo microbatch k is training microbatch k mod 4 with the same weights: same loss sums.
        let (fo, train) = (&run.fo_losses[0], &run.microbatch_losses[0]);
        assert_eq!(fo.len(), 5);
        for (k, l) in fo.iter().enumerate() {
            let t = train[k % 4];
            assert!(
                (l.sum - t.sum).abs() <= 1e-6 * t.sum,
                "{}: Fo {k}",
                kind.name()
            );
        }
        // Every Fo ran on every stage.
        let n_fo: usize = run
            .timeline
            .compute
            .iter()
            .flatten()
            .flat_map(|o| o.action.parts())
            .filter(|a| a.kind == flatpipe_simulator::ActionKind::Fo)
            .count();
        assert_eq!(n_fo, 5 * s.config.stages.len());
    }
}

/// Issue 24: a 2,048-token sequence with a 512-token budget runs as 4 chunks whose forwards
/// read the earlier chunks' keys and values and whose dgrads hand back their key/value
/// gradients; loss and every gradient equal the single-rank run of the whole sequence unsplit
/// (the reference joins the chunks back), for every schedule kind that orders chunks, with
/// short sequences alongside and under both loss reductions.
#[test]
fn chunked_sequences_match_the_unsplit_single_rank_run() {
    use flatpipe_profiles::{LengthDistribution, Workload};
    use flatpipe_simulator::batching::policy::{Policy, PolicyParams};
    let chunked = |kind: ScheduleKind, pp: u32, lengths: LengthDistribution, seqs: u32| {
        let v = kind.stages_per_rank(None).unwrap();
        let mut w = Workload::empirical("long".into(), "t".into(), vec![1]);
        w.lengths = lengths;
        let mut s = common::setup(model(), w, ScheduleSource::Kind(kind), (pp, v, 1));
        s.config.policy = Policy::FlatFfd;
        s.config.params = PolicyParams {
            token_budget: 512,
            chunk_tokens: Some(512),
            ..PolicyParams::default()
        };
        s.step_size = StepSize::Seqs(seqs);
        s
    };
    let one = LengthDistribution::Fixed { tokens: 2048 };
    for kind in [
        ScheduleKind::OneFOneB,
        ScheduleKind::ZbH1,
        ScheduleKind::Interleaved1F1B,
        ScheduleKind::ZbV,
        ScheduleKind::DualPipeV,
    ] {
        let s = chunked(kind, 2, one.clone(), 1);
        let step = s.prepare(0).unwrap();
        let mbs = &step.replicas[0].microbatches;
        assert_eq!(mbs.len(), 4, "{kind}");
        assert!(mbs.iter().all(|m| m.tokens() == 512 && m.chunk.is_some()));
        assert_eq!(step.replicas[0].schedule.chunks.len(), 1);
        check(&s);
    }
    // Two long sequences among short ones, per-sequence reduction: chunks of two chains and
    // whole microbatches in one step.
    let mut s = chunked(
        ScheduleKind::OneFOneB,
        2,
        LengthDistribution::Lognormal {
            median: 300.0,
            sigma: 1.2,
            min: 16,
            max: 2048,
        },
        8,
    );
    s.reduction = LossReduction::PerSequence;
    let step = s.prepare(0).unwrap();
    let chains = step.replicas[0].schedule.chunks.len();
    assert!(
        chains >= 1,
        "the sampled step has no sequence over 512 tokens"
    );
    check(&s);
}

/// Chunked sequences with recomputation are refused with the reason (a chunk's later chunks
/// read its saved keys and values), not run wrong.
#[test]
fn chunked_sequences_refuse_recomputation() {
    use flatpipe_profiles::{LengthDistribution, Workload};
    use flatpipe_simulator::batching::policy::PolicyParams;
    let mut w = Workload::empirical("long".into(), "t".into(), vec![1]);
    w.lengths = LengthDistribution::Fixed { tokens: 1024 };
    let mut s = common::setup(
        model(),
        w,
        ScheduleSource::Kind(ScheduleKind::OneFOneB),
        (2, 1, 1),
    );
    s.config.params = PolicyParams {
        token_budget: 512,
        chunk_tokens: Some(512),
        ..PolicyParams::default()
    };
    s.config.recompute = vec![Recompute::Selective; 2];
    s.step_size = StepSize::Seqs(1);
    let step = s.prepare(0).unwrap();
    let mut exec = Executor::cpu(&s).unwrap();
    let e = exec.gradients(&step).unwrap_err().to_string();
    assert!(e.contains("without recomputation"), "{e}");
}

/// A pipelined step whose gradients differ from the reference's only by rounding, as a GPU's
/// GEMMs do (fp32 cuBLAS against the CPU's: 1e-6 to 2e-5 normwise on an H200, 2026-12-04),
/// then take the executor's own AdamW step. AdamW moves an element by about `lr * sign(g)`
/// whatever `|g|` (once `|g|` is well above `eps`), so an element whose gradient is near zero
/// and changes sign under rounding moves `2 lr` apart: on the H200, `--verify` flagged
/// parameters 1.5e-4 apart at lr 1e-3 and 1.6e-7 apart at lr 1e-6 while the gradients agreed.
/// The parameter check therefore applies the reference's AdamW to the pipelined gradients.
/// Here the gradients of a CPU run get an additive 1e-6 of their tensor's largest element.
#[test]
fn gradients_apart_by_rounding_pass_the_parameter_check_and_a_skipped_update_does_not() {
    use flatpipe_executor::StageWorker;
    let s = setup(ScheduleSource::Kind(ScheduleKind::OneFOneB), 2, 1, 4);
    let step = s.prepare(0).unwrap();
    // A decoder's FFN down-projection (`layers.1.feed_forward.w2.weight` or similar).
    let skipped = Executor::cpu(&s)
        .unwrap()
        .named_params()
        .into_keys()
        .find(|n| n.contains("w2"))
        .unwrap();
    let perturbed_step = |skip: Option<&str>| {
        let mut exec = Executor::cpu(&s).unwrap();
        let run = exec.gradients(&step).unwrap();
        let mut sq = 0.0;
        for rank in &mut exec.ranks {
            for (_, w) in rank.iter_mut() {
                w.visit_grads(&mut |g| {
                    let top = g.iter().fold(0f32, |a, x| a.max(x.abs()));
                    for (i, x) in g.iter_mut().enumerate() {
                        // A fixed pattern of signs (a multiplicative hash of the index).
                        let sign = if (i as u32).wrapping_mul(2_654_435_761) >> 31 == 0 {
                            1.0
                        } else {
                            -1.0
                        };
                        *x += sign * 1e-6 * top;
                    }
                })
                .unwrap();
                sq += w.grad_sq_norm().unwrap();
            }
        }
        let norm = sq.sqrt();
        let scale = match s.max_grad_norm {
            Some(c) if norm > c => (c / (norm + 1e-6)) as f32,
            _ => 1.0,
        };
        let grads = exec.named_grads();
        let before = exec.named_params();
        for rank in &mut exec.ranks {
            for (_, w) in rank.iter_mut() {
                w.optimizer_step(&s.adamw, 1, scale).unwrap();
            }
        }
        let mut params = exec.named_params();
        if let Some(name) = skip {
            // One tensor's update lost (a rank that skipped it, say).
            params.insert(name.to_string(), before[name].clone());
        }
        (run, grads, params)
    };
    let verify = |skip: Option<&str>| {
        let (run, grads, params) = perturbed_step(skip);
        let mut reference = Reference::new(&s).unwrap();
        verify_step(&run, &grads, Some(&params), &mut reference, &s, &step).unwrap()
    };
    let v = verify(None);
    assert!(v.grads.max_rel <= GRAD_RTOL, "{v:?}");
    assert!(
        v.within_tolerance,
        "gradients apart by rounding failed the check: {v:?}"
    );
    let name = skipped.as_str();
    let v = verify(Some(name));
    let p = v.params.as_ref().unwrap();
    assert!(
        !v.within_tolerance && p.worst == name,
        "a skipped update of {name} passed the check: {v:?}"
    );
}

/// Gradients of other tensors, or of another size, are refused by name before any is replaced:
/// the reference's parameters stay as they were.
#[test]
fn the_reference_refuses_gradients_that_do_not_fit_its_model() {
    let s = setup(ScheduleSource::Kind(ScheduleKind::OneFOneB), 2, 1, 2);
    let step = s.prepare(0).unwrap();
    let mut reference = Reference::new(&s).unwrap();
    reference.step(&s, &step, false).unwrap();
    let before = reference.named_params();
    let mut grads = reference.named_grads();
    let (name, _) = grads.pop_first().unwrap();
    let e = reference
        .optimizer_step_with(&s, &grads)
        .unwrap_err()
        .to_string();
    assert!(e.contains("name other tensors"), "{e}");
    let mut grads = reference.named_grads();
    grads.get_mut(&name).unwrap().pop();
    let e = reference
        .optimizer_step_with(&s, &grads)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(&name) && e.contains("gradient values given"),
        "{e}"
    );
    assert_eq!(reference.named_params(), before);
    // Its own gradients fit, and the step moves the parameters.
    let own = reference.named_grads();
    reference.optimizer_step_with(&s, &own).unwrap();
    assert_ne!(reference.named_params(), before);
}
