//! The module's functions: the planner's search (`plan`) and a Kineto trace's import
//! (`import_trace`).

use super::*;

/// The planner's search: the best (tp, dp, pp, vpp, schedule, token budget, sharding, stages,
/// recomputation) for `profile` on `ranks` GPUs over `steps` steps of `workload` (sampled with
/// `seed`, default the workload's), under the hardware's memory less a reserve, as a list of
/// at most `keep` `flatpipe.results.PlanCandidate`s, best first (predicted mean step time,
/// seconds; peak memory per rank, bytes).
#[pyfunction]
#[pyo3(signature = (profile, workload, ranks, *, steps = 8, seed = None, keep = 5))]
pub(crate) fn plan<'py>(
    py: Python<'py>,
    profile: PyRef<'_, PyProfile>,
    workload: &str,
    ranks: i128,
    steps: i128,
    seed: Option<i128>,
    keep: i128,
) -> PyResult<Vec<Bound<'py, PyAny>>> {
    let ranks: u32 = nat("ranks", ranks)?;
    let steps: u32 = nat("steps", steps)?;
    let seed: Option<u64> = nat_opt("seed", seed)?;
    let keep: usize = nat("keep", keep)?;
    if steps == 0 {
        return Err(invalid("steps", 0, ">= 1"));
    }
    let w = builtins::workload(workload).map_err(err)?;
    let seed = seed.unwrap_or(w.seed);
    let p = profile.inner.clone();
    let space = SearchSpace::default_for(ranks);
    let config = SearchConfig {
        steps,
        seed,
        size: w.default_step_size(),
        memory_limit_bytes: default_memory_limit(&p),
        state_bytes: None,
        rank_by: RankBy::Mean,
        keep: keep.max(1),
        exact_split: flatpipe_planner::partition::ExactSplit::Off,
        forward_only: None,
    };
    let result = py
        .detach(|| search::search(&p, &w, &space, &config, &|_, _| {}))
        .map_err(err)?;
    result
        .ranked
        .iter()
        .map(|c| {
            let d = PyDict::new(py);
            d.set_item("tp", c.tp)?;
            d.set_item("ep", c.ep)?;
            d.set_item("dp", c.run.dp)?;
            d.set_item("pp", c.run.pp)?;
            d.set_item("vpp", c.run.v)?;
            d.set_item("schedule", c.run.source.name())?;
            d.set_item("token_budget", c.token_budget())?;
            d.set_item("sharding", c.run.sharding.to_string())?;
            d.set_item(
                "stages",
                c.run
                    .stages
                    .iter()
                    .map(|r| (r.start, r.end))
                    .collect::<Vec<_>>(),
            )?;
            d.set_item(
                "recompute",
                c.run
                    .recompute
                    .iter()
                    .map(|r| format!("{r:?}").to_lowercase())
                    .collect::<Vec<_>>(),
            )?;
            d.set_item("step_time_mean_s", c.summary.step_time_s.mean)?;
            d.set_item("step_time_p90_s", c.summary.step_time_s.p90)?;
            d.set_item("lower_bound_s", c.lower_bound_s)?;
            d.set_item("peak_memory_bytes", c.peak_memory_bytes.clone())?;
            typed_result(&d, "PlanCandidate")
        })
        .collect()
}

/// Reads PyTorch profiler traces of a pipelined run (`PP:<action>` events; one file per rank in
/// rank order, `.gz` read too), as `flatpipe import-trace` does
/// (`simulator/src/io/kineto.rs`), and returns a `flatpipe.results.ImportedTrace`: `actions`
/// (per rank, `(action, start_s, end_s)` of the imported step, busy time from each action's
/// first nested operator), `nested`, `comm`, `steps`, `step`, `leading_wait_s` (per rank),
/// `other_events` and `warnings`.
#[pyfunction]
#[pyo3(signature = (paths, step = None))]
pub(crate) fn import_trace<'py>(
    py: Python<'py>,
    paths: Vec<String>,
    step: Option<i128>,
) -> PyResult<Bound<'py, PyAny>> {
    let step: Option<usize> = nat_opt("step", step)?;
    let mut files = Vec::with_capacity(paths.len());
    for p in &paths {
        let text = flatpipe_simulator::io::kineto::read_trace_file(std::path::Path::new(p))
            .map_err(err)?;
        files.push((p.clone(), text));
    }
    let t = flatpipe_simulator::io::kineto::read_traces(
        &files,
        &flatpipe_simulator::io::kineto::ImportOptions { step },
    )
    .map_err(err)?;
    let d = PyDict::new(py);
    d.set_item(
        "actions",
        spans(&t.timeline.compute, |o| {
            (o.action.to_string(), o.start_ns, o.end_ns)
        }),
    )?;
    d.set_item("steps", t.steps)?;
    d.set_item("step", t.step)?;
    d.set_item(
        "leading_wait_s",
        t.leading_wait_ns
            .iter()
            .map(|&w| w as f64 * 1e-9)
            .collect::<Vec<_>>(),
    )?;
    d.set_item("other_events", t.other_events.clone())?;
    d.set_item("warnings", t.warnings.clone())?;
    let nested: Vec<Vec<(u32, f64)>> = t
        .nested
        .iter()
        .map(|v| {
            v.iter()
                .map(|n| (n.events, n.comm_ns as f64 * 1e-9))
                .collect()
        })
        .collect();
    d.set_item("nested", nested)?;
    d.set_item(
        "comm",
        spans(&t.timeline.comm, |c| {
            (c.action.to_string(), c.start_ns, c.end_ns)
        }),
    )?;
    typed_result(&d, "ImportedTrace")
}

/// Per rank, each item as `(name, start_s, end_s)`, from `item`'s name and ns span.
fn spans<T>(
    lanes: &[Vec<T>],
    item: impl Fn(&T) -> (String, u64, u64),
) -> Vec<Vec<(String, f64, f64)>> {
    lanes
        .iter()
        .map(|lane| {
            lane.iter()
                .map(|x| {
                    let (name, start, end) = item(x);
                    (name, start as f64 * 1e-9, end as f64 * 1e-9)
                })
                .collect()
        })
        .collect()
}
