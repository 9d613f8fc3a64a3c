//! GPU tests (feature `cuda`). Each checks at run time for a device (and NVRTC) and, without one,
//! prints why and passes; with `FLATPIPE_REQUIRE_GPU=1` a missing device fails the test instead.
//! The CUDA stage is checked against the CPU stage on the same weights and data, and pipelined
//! CUDA steps against the single-rank CPU reference, at the oracle's fp32 tolerances.
#![cfg(feature = "cuda")]

mod common;

use flatpipe_executor::cpu::CpuStage;
use flatpipe_executor::cuda;
use flatpipe_executor::cuda::ops::{self, Gpu, Precision};
use flatpipe_executor::cuda::stage::{CudaStage, Init};
use flatpipe_executor::data::{LossReduction, build_step};
use flatpipe_executor::kernels::matmul;
use flatpipe_executor::runner::{Executor, Reference, Setup, compare};
use flatpipe_executor::worker::{StageInput, StageOutput, StageWorker};
use flatpipe_profiles::ModelSpec;
use flatpipe_simulator::ScheduleKind;
use flatpipe_simulator::costs::Recompute;
use flatpipe_simulator::run::config::ScheduleSource;
use ndarray::Array2;
use rand::{RngExt, SeedableRng, rngs::ChaCha8Rng};
use std::sync::Arc;

fn device() -> Option<cuda::DeviceInfo> {
    match cuda::usable() {
        Ok(d) => Some(d),
        Err(e) => {
            if std::env::var("FLATPIPE_REQUIRE_GPU").as_deref() == Ok("1") {
                panic!("FLATPIPE_REQUIRE_GPU=1, but {e}");
            }
            eprintln!("skipping GPU test: {e}");
            None
        }
    }
}

#[test]
fn probing_never_panics() {
    // On a machine without a driver this is an error value, not a panic.
    match cuda::probe() {
        Ok(d) => assert!(d.count >= 1 && d.total_bytes > 0, "{d:?}"),
        Err(e) => assert!(e.to_string().contains("CUDA is not usable here"), "{e}"),
    }
}

#[test]
fn cublas_fp32_gemm_matches_the_cpu_gemm() {
    let Some(dev) = device() else { return };
    eprintln!("GPU: {} ({} GiB)", dev.name, dev.total_bytes >> 30);
    let (m, k, n) = (67, 129, 33);
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let a = Array2::from_shape_fn((m, k), |_| rng.random::<f32>() - 0.5);
    let b = Array2::from_shape_fn((k, n), |_| rng.random::<f32>() - 0.5);
    let want = matmul(a.view(), b.view());
    let got = cuda::matmul_f32(a.as_slice().unwrap(), b.as_slice().unwrap(), (m, k, n)).unwrap();
    let scale = want.iter().fold(0.0f32, |x, y| x.max(y.abs()));
    for (g, w) in got.iter().zip(want.iter()) {
        // fp32 with TF32 off by default in cuBLAS: agreement to ~1e-6 of the largest value.
        assert!((g - w).abs() <= 1e-4 * scale, "{g} vs {w}");
    }
}

#[test]
fn gemm_timing_reports_a_plausible_rate() {
    if device().is_none() {
        return;
    }
    let t = cuda::time_gemm_f32((1024, 1024, 1024), 2, 5).unwrap();
    assert!(t.ms > 0.0 && t.tflops > 0.1, "{t:?}");
}

#[test]
fn the_kernels_compile_with_nvrtc_when_it_is_installed() {
    // NVRTC needs no GPU: with libnvrtc on the library path this checks the source compiles.
    match cuda::nvrtc_present() {
        Err(e) => {
            if std::env::var("FLATPIPE_REQUIRE_GPU").as_deref() == Ok("1") {
                panic!("FLATPIPE_REQUIRE_GPU=1, but {e}");
            }
            eprintln!("skipping the NVRTC compile check: {e}");
        }
        Ok(()) => {
            for d in [16, 64, 128] {
                let ptx = ops::compile(d, Some((9, 0))).unwrap_or_else(|e| panic!("d = {d}: {e}"));
                let src = ptx.to_src();
                for k in ops::KERNELS {
                    assert!(
                        src.contains(&format!(".entry {k}(")),
                        "d = {d}: no {k} in the PTX"
                    );
                }
            }
            assert!(
                ops::compile(130, None).is_err(),
                "head dimension > 128 is refused"
            );
        }
    }
}

fn small_model() -> ModelSpec {
    ModelSpec::from_yaml(
        "name: mini\ndtype: fp32\nlayers:\n  - {kind: embedding, vocab: 128, hidden: 64}\n  - {kind: decoder, count: 4, hidden: 64, ffn: 96, heads: 4, kv_heads: 2}\n  - {kind: head, vocab: 128, hidden: 64}\n",
        "mini",
    )
    .unwrap()
}

#[test]
fn a_cuda_stage_matches_the_cpu_stage_in_f_i_w() {
    if device().is_none() {
        return;
    }
    let model = small_model();
    let ctx = cuda::context().unwrap();
    let gpu = Arc::new(Gpu::new(&ctx, 16, Precision::Fp32).unwrap());
    // Sequences across tile boundaries (16) and a single token.
    let data = &build_step(&[vec![vec![37, 1, 20]]], 128, 3, 0, LossReduction::PerToken)[0][0];
    for range in [0..2, 2..4, 4..6] {
        let mut c = CpuStage::new(&model, range.clone(), 9, Recompute::None).unwrap();
        let mut g = CudaStage::new(
            gpu.clone(),
            &model,
            range.clone(),
            9,
            Recompute::None,
            Init::Exact,
        )
        .unwrap();
        let t = data.tokens();
        let mut rng = ChaCha8Rng::seed_from_u64(2);
        let x = Array2::from_shape_fn((t, 64), |_| rng.random::<f32>() - 0.5);
        let first = range.start == 0;
        let last = range.end == 6;
        let (ci, gi) = if first {
            (StageInput::Tokens, StageInput::Tokens)
        } else {
            (
                StageInput::Hidden(x.clone()),
                StageInput::Hidden(g.upload_hidden(x.as_slice().unwrap()).unwrap()),
            )
        };
        let co = c.forward(0, data, ci, true).unwrap();
        let go = g.forward(0, data, gi, true).unwrap();
        match (co, go) {
            (StageOutput::Hidden(a), StageOutput::Hidden(b)) => {
                let b = gpu.download(&b.buf).unwrap();
                assert_eq!(b.len(), t * 64);
                let e = common::rel(&b, a.as_slice().unwrap(), 1e-12);
                assert!(e < 1e-4, "{range:?} forward: {e}");
            }
            (StageOutput::Loss(a), StageOutput::LossPending) => {
                let l = g.take_losses().unwrap();
                assert_eq!(l.len(), 1);
                let b = l[0].2;
                assert!(
                    (a.sum - b.sum).abs() <= 1e-5 * a.sum.abs(),
                    "{a:?} vs {b:?}"
                );
                assert!((a.weighted - b.weighted).abs() <= 1e-5 * a.weighted.abs());
            }
            _ => panic!("{range:?}: outputs of different kinds"),
        }
        let (cg, gg) = if last {
            (None, None)
        } else {
            (
                Some(x.clone()),
                Some(g.upload_hidden(x.as_slice().unwrap()).unwrap()),
            )
        };
        let cdx = c.backward_input(0, data, cg).unwrap();
        let gdx = g.backward_input(0, data, gg).unwrap();
        if let (Some(a), Some(b)) = (cdx, gdx) {
            let b = gpu.download(&b.buf).unwrap();
            assert_eq!(b.len(), t * 64);
            let e = common::rel(&b, a.as_slice().unwrap(), 1e-12);
            assert!(e < 1e-4, "{range:?} dgrad: {e}");
        }
        c.backward_weight(0, data).unwrap();
        g.backward_weight(0, data).unwrap();
        for ((n, a), (_, b)) in c.named_grads().iter().zip(g.named_grads()) {
            let e = common::rel(&b, a, 1e-12);
            assert!(e < 1e-4, "{range:?} {n}: {e}");
        }
        assert_eq!(g.held_microbatches(), 0);
    }
}

fn setup(kind: ScheduleKind, pp: u32, v: u32, m: u32) -> Setup {
    common::setup(
        small_model(),
        common::workload(24.0, 96),
        ScheduleSource::Kind(kind),
        (pp, v, m),
    )
}

#[test]
fn pipelined_cuda_steps_match_the_cpu_reference() {
    let Some(dev) = device() else { return };
    // Ranks as streams of GPU 0; with two GPUs also one GPU per rank (peer copies).
    let device_counts: &[usize] = if dev.count >= 2 { &[1, 2] } else { &[1] };
    for &devices in device_counts {
        pipelined_steps_on(devices);
    }
}

fn pipelined_steps_on(devices: usize) {
    // ZB-V: two stages per rank (V placement) sharing the rank's streams.
    for (kind, pp, v) in [
        (ScheduleKind::OneFOneB, 3, 1),
        (ScheduleKind::ZbH1, 3, 1),
        (ScheduleKind::GPipe, 2, 1),
        (ScheduleKind::ZbV, 2, 2),
    ] {
        let s = setup(kind, pp, v, 5);
        let step = s.prepare(0).unwrap();
        let mut exec = Executor::cuda(&s, Precision::Fp32, Init::Exact, devices).unwrap();
        let mut reference = Reference::new(&s).unwrap();
        let run = exec.train_step(&s, &step).unwrap();
        let r = reference.step(&s, &step, true).unwrap();
        assert!(
            (run.loss - r.loss).abs() <= 1e-5 * r.loss.abs(),
            "{kind:?} on {devices} GPU(s): loss {} vs {}",
            run.loss,
            r.loss
        );
        let g = compare(&exec.named_grads(), &reference.named_grads()).unwrap();
        assert!(
            g.max_rel <= 1e-4,
            "{kind:?} on {devices} GPU(s): gradients {g:?}"
        );
        let p = compare(&exec.named_params(), &reference.named_params()).unwrap();
        assert!(
            p.max_rel <= 1e-4,
            "{kind:?} on {devices} GPU(s): parameters {p:?}"
        );
        // Timed by events: every action has a non-negative duration and ranks overlap in time.
        for ops in &run.timeline.compute {
            for o in ops {
                assert!(o.end_ns >= o.start_ns, "{kind:?}: {o:?}");
            }
        }
        assert!(run.timeline.makespan_ns() > 0);
        // Every transfer between ranks is a copy timed on the receiver's copy stream.
        assert!(!run.timeline.transfers.is_empty(), "{kind:?}: no transfers");
        for t in &run.timeline.transfers {
            assert!(t.end_ns >= t.start_ns && t.from != t.to, "{kind:?}: {t:?}");
        }
    }
}

#[test]
fn profiling_a_small_model_on_the_gpu_fits_its_phases() {
    if device().is_none() {
        return;
    }
    let cfg = flatpipe_executor::profiler::ProfileConfig {
        tokens: vec![256, 1024, 4096],
        short_seq: 64,
        warmup: 1,
        reps: 3,
        link_sizes: vec![1 << 16, 1 << 20, 1 << 24],
        concurrency: 2,
    };
    let (m, info) =
        cuda::profile::profile_cuda(&small_model(), &cfg, Precision::Fp32, 1, &|_| {}).unwrap();
    assert!(!info.name.is_empty());
    assert_eq!(m.kinds.len(), 3);
    for k in &m.kinds {
        assert!(
            k.f.coeffs.c_tok_s > 0.0 || k.f.coeffs.c0_s > 0.0,
            "{:?}",
            k.kind
        );
        assert!(k.act_bytes_per_token_w > 0.0, "{:?}", k.kind);
    }
    assert!(m.link.beta_bytes_per_s > 1e9, "{:?}", m.link);
    assert!(m.optimizer_s_per_param > 0.0);
}
