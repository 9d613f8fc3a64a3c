//! The executor's speed: each layer's F, I and W against the time of the same layer's GEMMs
//! alone (same shapes, same GEMM library), and the interpreter's own overhead per action on a
//! backend whose kernels do nothing.
//!
//! Sizes: the built-in `tiny` model (hidden 256, FFN 688, 4 heads, 2 KV heads, vocabulary 4096)
//! on a microbatch of T = 1024 tokens in 8 sequences of 128 (the attention GEMMs run per
//! sequence, head and query block). The bench binary uses mimalloc like the `flatpipe` binary.

use criterion::{Criterion, criterion_group, criterion_main};
use flatpipe::executor::cpu::CpuStage;
use flatpipe::executor::data::{LossReduction, build_step};
use flatpipe::executor::interpreter::{Replica, StepOptions, run_step};
use flatpipe::executor::kernels::{ATTN_BLOCK, matmul};
use flatpipe::executor::null::NullStage;
use flatpipe::executor::worker::{StageInput, StageWorker};
use flatpipe::profiles::builtins;
use flatpipe::simulator::ScheduleKind;
use flatpipe::simulator::costs::Recompute;
use ndarray::Array2;
use std::hint::black_box;
use std::time::{Duration, Instant};

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const SEQS: usize = 8;
const SEQ_LEN: usize = 128;
const T: usize = SEQS * SEQ_LEN;

/// `(m, k, n)` of every GEMM a layer's phase runs, as `[m, k] @ [k, n]`. Attention runs per
/// sequence, head and query block of `ATTN_BLOCK` rows against the keys up to the block's end.
fn decoder_gemms(
    h: usize,
    kv: usize,
    ffn: usize,
    heads: usize,
    d: usize,
) -> [Vec<(usize, usize, usize)>; 3] {
    let (mut attn_f, mut attn_i) = (Vec::new(), Vec::new());
    for q0 in (0..SEQ_LEN).step_by(ATTN_BLOCK) {
        let rows = ATTN_BLOCK.min(SEQ_LEN - q0);
        let keys = q0 + rows;
        // S = Q K^T, O = P V.
        attn_f.extend([(rows, d, keys), (rows, keys, d)]);
        // Backward: recompute S, dV += P^T dO, dP = dO V^T, dQ = dS K, dK += dS^T Q.
        attn_i.extend([
            (rows, d, keys),
            (keys, rows, d),
            (rows, d, keys),
            (rows, keys, d),
            (keys, rows, d),
        ]);
    }
    let per_head = |g: &[(usize, usize, usize)]| {
        std::iter::repeat_n(g.to_vec(), SEQS * heads)
            .flatten()
            .collect::<Vec<_>>()
    };
    let mut f = vec![
        (T, h, h),
        (T, h, kv),
        (T, h, kv),
        (T, h, h),
        (T, h, ffn),
        (T, h, ffn),
        (T, ffn, h),
    ];
    f.extend(per_head(&attn_f));
    let mut i = vec![
        (T, h, ffn),
        (T, ffn, h),
        (T, ffn, h),
        (T, h, h),
        (T, h, h),
        (T, kv, h),
        (T, kv, h),
    ];
    i.extend(per_head(&attn_i));
    let w = vec![
        (h, T, h),
        (h, T, kv),
        (h, T, kv),
        (h, T, h),
        (h, T, ffn),
        (h, T, ffn),
        (ffn, T, h),
    ];
    [f, i, w]
}

fn head_gemms(h: usize, v: usize) -> [Vec<(usize, usize, usize)>; 3] {
    [vec![(T, h, v)], vec![(T, v, h)], vec![(h, T, v)]]
}

fn bench_layers(c: &mut Criterion) {
    let model = builtins::model("tiny").unwrap();
    let layers = model.layers();
    let dec = layers[1];
    let (h, heads) = (dec.hidden as usize, dec.heads as usize);
    let d = h / heads;
    let kv = d * dec.kv_heads as usize;
    let vocab = layers[layers.len() - 1].vocab as usize;
    let data = build_step(
        &[vec![vec![SEQ_LEN as u32; SEQS]]],
        vocab as u32,
        0,
        0,
        LossReduction::PerToken,
    )
    .remove(0)
    .remove(0);
    let x = Array2::from_shape_fn((T, h), |(i, j)| ((i * 31 + j * 7) % 17) as f32 / 17.0 - 0.5);
    let mut g = c.benchmark_group("layer_T1024");
    g.sample_size(20);
    let last = layers.len() - 1;
    for (name, range, gemms) in [
        (
            "decoder",
            1..2,
            decoder_gemms(h, kv, dec.ffn as usize, heads, d),
        ),
        ("head", last..last + 1, head_gemms(h, vocab)),
    ] {
        let mut st = CpuStage::new(&model, range.clone(), 0, Recompute::None).unwrap();
        let dy = x.clone();
        let grad = |name: &str| (name == "decoder").then(|| dy.clone());
        g.bench_function(format!("{name}/F"), |b| {
            b.iter(|| {
                st.forward(0, &data, StageInput::Hidden(x.clone()), false)
                    .unwrap()
            })
        });
        // I and W need the earlier phases' saved tensors: run those untimed in each iteration.
        g.bench_function(format!("{name}/I"), |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    st.forward(0, &data, StageInput::Hidden(x.clone()), true)
                        .unwrap();
                    let t = Instant::now();
                    black_box(st.backward_input(0, &data, grad(name)).unwrap());
                    total += t.elapsed();
                    st.backward_weight(0, &data).unwrap();
                }
                total
            })
        });
        g.bench_function(format!("{name}/W"), |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    st.forward(0, &data, StageInput::Hidden(x.clone()), true)
                        .unwrap();
                    st.backward_input(0, &data, grad(name)).unwrap();
                    let t = Instant::now();
                    st.backward_weight(0, &data).unwrap();
                    total += t.elapsed();
                }
                total
            })
        });
        for (phase, shapes) in ["F", "I", "W"].iter().zip(gemms) {
            let mats: Vec<(Array2<f32>, Array2<f32>)> = shapes
                .iter()
                .map(|&(m, k, n)| {
                    (
                        Array2::from_elem((m, k), 0.5f32),
                        Array2::from_elem((k, n), 0.25f32),
                    )
                })
                .collect();
            g.bench_function(format!("{name}/{phase} GEMMs only"), |b| {
                b.iter(|| {
                    for (a, bm) in &mats {
                        black_box(matmul(a.view(), bm.view()));
                    }
                })
            });
        }
    }
    g.finish();
}

/// The interpreter on a backend whose kernels do nothing: 1F1B and ZB-H1 at p = 4, m = 64 (one
/// thread per rank; the machine needs p cores for this to measure the interpreter rather than
/// the OS scheduler). Time per step / compute actions per rank = overhead per action.
fn bench_interpreter(c: &mut Criterion) {
    let (p, m) = (2u32, 64u32);
    let data = build_step(
        &[vec![vec![8]; m as usize]],
        16,
        0,
        0,
        LossReduction::PerToken,
    )
    .remove(0);
    let mut g = c.benchmark_group("interpreter_null_backend");
    g.sample_size(20);
    for kind in [
        ScheduleKind::OneFOneB,
        ScheduleKind::ZbH1,
        ScheduleKind::Interleaved1F1B,
    ] {
        let v = kind.stages_per_rank(None).unwrap();
        let s = kind.generate(p, v, m).unwrap();
        let n = s.num_stages();
        let mut ranks: Vec<Vec<(u32, NullStage)>> = (0..p)
            .map(|r| {
                s.placement
                    .stages_of(flatpipe::simulator::Rank(r))
                    .into_iter()
                    .map(|st| (st.0, NullStage::new(4, st.0 == 0, st.0 == n - 1)))
                    .collect()
            })
            .collect();
        let per_rank = s.num_compute_actions() / p as usize;
        g.bench_function(
            format!("{} p={p} m={m} ({per_rank} actions per rank)", kind.name()),
            |b| {
                b.iter(|| {
                    let rep = Replica {
                        schedule: &s,
                        microbatches: &data,
                        fo_microbatches: &[],
                        fo_feeds_loss: false,
                    };
                    run_step(&mut ranks, &[rep], &StepOptions::default()).unwrap()
                })
            },
        );
    }
    g.finish();
}

criterion_group!(benches, bench_layers, bench_interpreter);
criterion_main!(benches);
