//! `plan`'s table of ranked plans.

use super::*;

/// `plan`'s table: the ranked plans, best first, each with its layout (a `cp` column where a
/// row has context parallelism; an `ep` column and, last, the exposed all-to-all where a row
/// has expert parallelism), predicted step time, lower bound
/// and peak memory against the per-rank `limit` (bytes).
pub(super) fn plan_table(rows: &[PlanRow], limit: f64) -> PlainTable {
    let gib = |b: f64| b / (1u64 << 30) as f64;
    let with_ep = rows.iter().any(|r| r.candidate.ep > 1);
    let with_cp = rows
        .iter()
        .any(|r| r.candidate.run.context_parallel.is_some());
    let mut head = vec![
        "#",
        "schedule",
        "tp",
        "dp",
        "pp",
        "v",
        "budget",
        "chunk",
        "sharding",
        "mean",
        "p90",
        "bubble",
        "lower bound",
        "gap",
        "peak mem (max rank)",
        "layers per stage",
        "recompute",
    ];
    if with_cp {
        head.insert(3, "cp");
    }
    if with_ep {
        head.insert(3, "ep");
        head.push("a2a exposed");
    }
    let mut t = new_table(&head);
    for r in rows {
        let c = &r.candidate;
        let sizes = slash_list(c.run.stages.iter().map(|x| x.len()));
        let rec = recompute_summary(&c.run.recompute);
        let mut row = vec![
            r.rank.to_string(),
            c.schedule_name(),
            c.tp.to_string(),
            c.run.dp.to_string(),
            c.run.pp.to_string(),
            c.run.v.to_string(),
            c.token_budget().to_string(),
            c.chunk_tokens().map_or("-".into(), |n| n.to_string()),
            c.run.sharding.to_string(),
            fmt_s(c.summary.step_time_s.mean),
            fmt_s(c.summary.step_time_s.p90),
            pct(c.summary.bubble_ratio_mean),
            fmt_s(c.lower_bound_s),
            format!("{:+.1}%", 100.0 * r.gap_to_lower_bound),
            format!(
                "{:.1} / {:.1} GiB",
                gib(c.peak_memory_bytes.iter().copied().fold(0.0, f64::max)),
                gib(limit)
            ),
            sizes,
            rec,
        ];
        if with_cp {
            row.insert(3, cp_cell(c.run.context_parallel));
        }
        if with_ep {
            row.insert(3, c.ep.to_string());
            row.push(all_to_all_cell(c.summary.all_to_all_mean));
        }
        t.add_row(row);
    }
    t
}

/// A row's context parallelism: `-` without, `2 p2p` fixed, `2 p2p dyn 16384` dynamic at
/// that many tokens per GPU.
fn cp_cell(cp: Option<profiles::context_parallel::ContextParallel>) -> String {
    match cp {
        None => "-".into(),
        Some(c) => match c.max_seqlen_per_rank {
            None => format!("{} {}", c.cp, c.comm),
            Some(t) => format!("{} {} dyn {t}", c.cp, c.comm),
        },
    }
}

/// `none x6, full x2` (run-length counts of the per-stage modes, in stage order).
pub(in crate::cli) fn recompute_summary(modes: &[sim::costs::Recompute]) -> String {
    let mut parts: Vec<(sim::costs::Recompute, usize)> = Vec::new();
    for &m in modes {
        match parts.last_mut() {
            Some((last, n)) if *last == m => *n += 1,
            _ => parts.push((m, 1)),
        }
    }
    parts
        .iter()
        .map(|(m, n)| format!("{} x{n}", format!("{m:?}").to_lowercase()))
        .collect::<Vec<_>>()
        .join(", ")
}
