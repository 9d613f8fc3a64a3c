//! Simulator throughput: build and replay the DAG of one 1F1B step with p = 64, m = 4096
//! (524,288 compute ops and 516,096 transfers), reported as simulated ops per second.

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use flatpipe::simulator::{ScheduleKind, UniformCostSpec, UniformCosts, metrics, replay};
use std::hint::black_box;

fn bench_1f1b(c: &mut Criterion) {
    let (p, m) = (64u32, 4096u32);
    let costs = UniformCosts::new(
        &UniformCostSpec {
            f: 1.0,
            b: 2.0,
            w: 1.0,
            comm: 0.1,
            fb: None,
            fo: None,
        },
        1,
    );
    let schedule = ScheduleKind::OneFOneB.generate(p, 1, m).unwrap();
    let t = replay::replay(&schedule, &costs).unwrap();
    let ops = schedule.num_compute_actions() + t.transfers.len();
    assert_eq!(ops, 524_288 + 516_096);
    let mut g = c.benchmark_group("1f1b_p64_m4096");
    g.throughput(Throughput::Elements(ops as u64));
    g.sample_size(20);
    g.bench_function("generate+validate+replay", |b| {
        b.iter(|| {
            let s = ScheduleKind::OneFOneB
                .generate(black_box(p), 1, black_box(m))
                .unwrap();
            s.validate().unwrap();
            replay::replay(&s, &costs).unwrap()
        })
    });
    g.bench_function("replay", |b| {
        b.iter(|| replay::replay(black_box(&schedule), &costs).unwrap())
    });
    g.bench_function("replay+metrics", |b| {
        b.iter(|| {
            let t = replay::replay(black_box(&schedule), &costs).unwrap();
            metrics::metrics(&schedule, &costs, &t)
        })
    });
    g.finish();
}

/// Generating, validating and replaying every handcrafted schedule at p = 32, v = 2 (1 where
/// the kind has one stage per rank), m = 256.
fn bench_every_schedule(c: &mut Criterion) {
    let (p, m) = (32u32, 256u32);
    let spec = UniformCostSpec {
        f: 1.0,
        b: 2.0,
        w: 1.0,
        comm: 0.1,
        fb: None,
        fo: None,
    };
    let mut g = c.benchmark_group("generate+simulate_p32_v2_m256");
    g.sample_size(20);
    for &kind in ScheduleKind::ALL {
        let v = kind.stages_per_rank(Some(2)).unwrap_or(2);
        let costs = UniformCosts::new(&spec, v);
        g.bench_function(kind.name(), |b| {
            b.iter(|| {
                let s = kind.generate(black_box(p), v, black_box(m)).unwrap();
                flatpipe::simulator::simulate(&s, &costs).unwrap()
            })
        });
    }
    g.finish();
}

criterion_group!(benches, bench_1f1b, bench_every_schedule);
criterion_main!(benches);
