//! zb-auto against the Zero Bubble authors' heuristic (issue 26, part 3): the same settings,
//! the same costs and memory limits, the heuristic's figures written by its own code
//! (`scripts/zb_parity.py`, `tests/data/zb_heuristic.json`).

use flatpipe::simulator::{ScheduleKind, StageCosts, replay};

/// One setting of the committed grid.
struct Setting {
    p: u32,
    m: u32,
    f: Vec<f64>,
    b: Vec<f64>,
    w: Vec<f64>,
    comm: f64,
    limit: f64,
    heuristic: Option<u64>,
    heuristic_makespan: Option<u64>,
}

fn settings() -> Vec<Setting> {
    let text = include_str!("data/zb_heuristic.json");
    let data: serde_json::Value = serde_json::from_str(text).unwrap();
    let nums = |v: &serde_json::Value| -> Vec<f64> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect()
    };
    data["settings"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| Setting {
            p: s["p"].as_u64().unwrap() as u32,
            m: s["m"].as_u64().unwrap() as u32,
            f: nums(&s["f"]),
            b: nums(&s["b"]),
            w: nums(&s["w"]),
            comm: s["comm"].as_f64().unwrap(),
            limit: s["limit_microbatches"].as_f64().unwrap(),
            heuristic: s["heuristic_span"].as_u64(),
            heuristic_makespan: s["heuristic_makespan"].as_u64(),
        })
        .collect()
}

/// zb-auto's figure in the heuristic's terms: over the ranks, the longest span from a rank's
/// first action's start to its last action's end (one stage per rank), in cost units; and its
/// makespan; and the makespan's lower bound ([`flatpipe::simulator::replay::metrics::lower_bound_ns`]).
fn zb_auto_span(s: &Setting) -> (u64, u64, u64) {
    let costs = StageCosts::new(&s.f, &s.b, &s.w, s.comm).unwrap();
    let schedule = ScheduleKind::ZbAuto
        .build(s.p, 1, s.m, &costs, s.limit)
        .unwrap();
    let t = replay::replay(&schedule, &costs).unwrap();
    let bound = flatpipe::simulator::replay::metrics::lower_bound_ns(&schedule, &costs);
    let span = t
        .compute
        .iter()
        .map(|ops| ops.last().unwrap().end_ns - ops.first().unwrap().start_ns)
        .max()
        .unwrap();
    let unit = 1_000_000_000;
    (span / unit, t.makespan_ns() / unit, bound / unit)
}

/// zb-auto's makespan is at most the heuristic's on every committed setting the heuristic
/// ran (258 of the grid's 288, on 30 its own assertions fail; and the authors' heterogeneous
/// 8-stage example from the file's `__main__`, the last setting). Also counts, by makespan and by the
/// heuristic's own figure (the longest per-stage span, which zb-auto does not minimise), where
/// zb-auto is better, the same or worse (`-- --nocapture` prints them).
#[test]
fn zb_auto_never_worse_than_the_heuristic() {
    // (better, same, worse) by makespan and by the heuristic's span.
    let mut by_makespan = [0u32; 3];
    let mut by_span = [0u32; 3];
    let tally = |ours: u64, theirs: u64, t: &mut [u32; 3]| {
        t[match ours.cmp(&theirs) {
            std::cmp::Ordering::Less => 0,
            std::cmp::Ordering::Equal => 1,
            std::cmp::Ordering::Greater => 2,
        }] += 1;
    };
    let mut compared = 0;
    let (mut gap_ours, mut gap_theirs) = (0.0f64, 0.0f64);
    for s in settings() {
        let (Some(h_span), Some(h_make)) = (s.heuristic, s.heuristic_makespan) else {
            continue;
        };
        compared += 1;
        let (span, make, bound) = zb_auto_span(&s);
        assert!(bound <= make.min(h_make), "bound {bound} above a makespan");
        gap_ours += make as f64 / bound as f64 - 1.0;
        gap_theirs += h_make as f64 / bound as f64 - 1.0;
        if s.comm == 473.0 {
            eprintln!(
                "the authors' heterogeneous example: zb-auto {make}, the heuristic {h_make}, bound {bound}"
            );
        }
        tally(make, h_make, &mut by_makespan);
        tally(span, h_span, &mut by_span);
        assert!(
            make <= h_make,
            "p {} m {} comm {} limit {} f {:?} b {:?} w {:?}: zb-auto {make} vs the heuristic's {h_make}",
            s.p,
            s.m,
            s.comm,
            s.limit,
            s.f,
            s.b,
            s.w
        );
    }
    assert_eq!(compared, 259);
    eprintln!(
        "makespan: better {}, same {}, worse {}; span: better {}, same {}, worse {}; mean gap to the lower bound: zb-auto {:.2}%, heuristic {:.2}%",
        by_makespan[0],
        by_makespan[1],
        by_makespan[2],
        by_span[0],
        by_span[1],
        by_span[2],
        100.0 * gap_ours / compared as f64,
        100.0 * gap_theirs / compared as f64
    );
}

/// Where the exact optimum is within reach (the grid's p = 4 settings with m <= 8, issue 26
/// part 2), zb-auto is at least as close to it as the heuristic: optimum <= zb-auto <=
/// heuristic, and the counts of settings each reaches the optimum on are printed.
#[test]
fn zb_auto_and_the_heuristic_against_the_exact_optimum() {
    use flatpipe::simulator::ir::Placement;
    use flatpipe::simulator::schedules::exact::{self, ExactOptions};
    let (mut n, mut heur_n, mut zb_opt, mut heur_opt) = (0, 0, 0, 0);
    let (mut zb_gap, mut heur_gap) = (0.0, 0.0);
    for s in settings().iter().filter(|s| s.p == 4 && s.m <= 8) {
        let costs = StageCosts::new(&s.f, &s.b, &s.w, s.comm).unwrap();
        let zb = ScheduleKind::ZbAuto
            .build(s.p, 1, s.m, &costs, s.limit)
            .unwrap();
        let zb_t = replay::replay(&zb, &costs).unwrap().makespan_ns();
        let got = exact::solve(
            &Placement::looped(s.p, 1),
            s.m,
            &costs,
            s.limit,
            Some(&zb),
            &ExactOptions::default(),
        )
        .unwrap();
        assert!(got.optimal);
        let opt = got.makespan_ns.unwrap();
        assert!(opt <= zb_t);
        n += 1;
        zb_opt += u32::from(zb_t == opt);
        zb_gap += zb_t as f64 / opt as f64 - 1.0;
        if let Some(h) = s.heuristic_makespan {
            let h = h * 1_000_000_000;
            assert!(opt <= h, "the heuristic below the optimum: {h} < {opt}");
            heur_n += 1;
            heur_opt += u32::from(h == opt);
            heur_gap += h as f64 / opt as f64 - 1.0;
        }
    }
    eprintln!(
        "exact optimum on {n} settings: zb-auto optimal on {zb_opt} (mean gap {:.2}%); the heuristic (where it ran, {heur_n}) on {heur_opt} (mean gap {:.2}%)",
        100.0 * zb_gap / f64::from(n),
        100.0 * heur_gap / f64::from(heur_n)
    );
    assert_eq!(n, 32);
}
