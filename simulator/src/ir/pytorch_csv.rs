//! PyTorch's pipeline-order CSV (`torch.distributed.pipelining`, compute-only form).
//!
//! One row per rank (row index = rank), one action per cell: `0F1`, `3I0`, `3W0`, `2B1`,
//! `(0F3;1B2)OVERLAP_F_B`; an empty cell is an idle step and is skipped. The stage -> rank
//! placement is inferred from the rows (a stage may appear on one row only); the microbatch
//! count is one more than the largest microbatch index. Loaded schedules are validated like our
//! own. `Fo` (forward-only) is flatpipe's extension and is written only on request.

use crate::ir::{Action, ActionKind, Placement, PlacementKind, Rank, Schedule};
use crate::{Error, Result};
use std::collections::BTreeMap;

/// Parses a compute-only pipeline-order CSV. `origin` names the file in errors and the schedule.
///
/// # Errors
/// [`Error::InvalidSchedule`] naming the row and cell of an unparsable action, a stage found on
/// two rows, a missing stage, or any rule [`Schedule::validate`] checks.
pub fn read_pytorch_csv(text: &str, origin: &str) -> Result<Schedule> {
    let fail = |reason: String| Error::InvalidSchedule {
        schedule: origin.to_string(),
        reason,
    };
    let mut rdr = csv::ReaderBuilder::new()
        .has_headers(false)
        .flexible(true)
        .from_reader(text.as_bytes());
    let mut ranks: Vec<Vec<Action>> = Vec::new();
    let mut stage_row: BTreeMap<u32, usize> = BTreeMap::new();
    let (mut m, mut mfo) = (0u32, 0u32);
    for (row, rec) in rdr.records().enumerate() {
        let rec = rec.map_err(|e| fail(format!("row {}: {e}", row + 1)))?;
        let mut actions = Vec::new();
        for (col, cell) in rec.iter().enumerate() {
            let cell = cell.trim();
            if cell.is_empty() {
                continue;
            }
            let action: Action = cell.parse().map_err(|e: Error| {
                let hint = if cell.contains("SEND") || cell.contains("RECV") {
                    " (this reader takes compute-only files: F, I, W, B and overlapped pairs)"
                } else {
                    ""
                };
                fail(format!("row {}, cell {}: {e}{hint}", row + 1, col + 1))
            })?;
            for a in action.parts() {
                if let Some(&other) = stage_row.get(&a.stage.0)
                    && other != row
                {
                    return Err(fail(format!(
                        "row {}, cell {}: {a} puts stage {} on rank {row}, but row {} already placed it on rank {other}",
                        row + 1,
                        col + 1,
                        a.stage,
                        other + 1
                    )));
                }
                stage_row.insert(a.stage.0, row);
                if a.kind == ActionKind::Fo {
                    mfo = mfo.max(a.microbatch.0 + 1);
                } else {
                    m = m.max(a.microbatch.0 + 1);
                }
            }
            actions.push(action);
        }
        ranks.push(actions);
    }
    let p = ranks.len() as u32;
    if p == 0 || stage_row.is_empty() {
        return Err(fail("no actions".into()));
    }
    let s_count = stage_row.keys().next_back().map_or(0, |s| s + 1);
    let mut rank_of = Vec::with_capacity(s_count as usize);
    for s in 0..s_count {
        match stage_row.get(&s) {
            Some(&r) => rank_of.push(Rank(r as u32)),
            None => {
                return Err(fail(format!(
                    "stage {s} appears in no row, but stage {} does",
                    s_count - 1
                )));
            }
        }
    }
    let mut placement = Placement {
        rank_of,
        num_ranks: p,
        kind: PlacementKind::Custom,
    };
    if s_count % p == 0 && placement.rank_of == Placement::looped(p, s_count / p).rank_of {
        placement.kind = PlacementKind::Loop;
    } else if s_count == 2 * p && placement.rank_of == Placement::v_shape(p).rank_of {
        placement.kind = PlacementKind::V;
    }
    let schedule = Schedule {
        name: origin.to_string(),
        placement,
        num_microbatches: m,
        num_fo_microbatches: mfo,
        chunks: Vec::new(),
        ranks,
    };
    schedule.validate()?;
    Ok(schedule)
}

/// Writes `schedule` as a compute-only pipeline-order CSV (one row per rank, no padding).
///
/// # Errors
/// [`Error::InvalidSchedule`] if the schedule holds forward-only actions and `allow_fo` is false
/// (PyTorch has no `Fo`).
pub fn write_pytorch_csv(schedule: &Schedule, allow_fo: bool) -> Result<String> {
    let has_fo = schedule
        .ranks
        .iter()
        .flatten()
        .flat_map(Action::parts)
        .any(|a| a.kind == ActionKind::Fo);
    if has_fo && !allow_fo {
        return Err(Error::InvalidSchedule {
            schedule: schedule.name.clone(),
            reason:
                "it has forward-only (Fo) actions, flatpipe's extension that PyTorch cannot read; \
                     drop them or ask for flatpipe's extended CSV"
                    .into(),
        });
    }
    let mut w = csv::WriterBuilder::new()
        .flexible(true)
        .from_writer(Vec::new());
    for actions in &schedule.ranks {
        let cells: Vec<String> = actions.iter().map(ToString::to_string).collect();
        w.write_record(&cells).map_err(|e| Error::InvalidSchedule {
            schedule: schedule.name.clone(),
            reason: e.to_string(),
        })?;
    }
    let bytes = w.into_inner().map_err(|e| Error::InvalidSchedule {
        schedule: schedule.name.clone(),
        reason: e.to_string(),
    })?;
    Ok(String::from_utf8(bytes).expect("action strings are ASCII"))
}

/// Writes `lowered` as PyTorch's compute-and-communication pipeline-order CSV: one row per rank,
/// its program in posting order with `SEND_F` / `RECV_F` / `SEND_B` / `RECV_B` and PyTorch
/// 2.15's `WAIT_SEND_F` / `WAIT_SEND_B` (what `_PipelineScheduleRuntime._load_csv(path,
/// format="compute_comms")` runs as it stands, without lowering it again).
///
/// # Errors
/// [`Error::InvalidSchedule`] when the schedule holds forward-only actions (PyTorch has no
/// `Fo`) or a row cannot be written.
pub fn write_pytorch_comms_csv(lowered: &crate::ir::comm::Lowered) -> Result<String> {
    let schedule = &lowered.schedule;
    if schedule.num_fo_microbatches > 0 {
        return Err(Error::InvalidSchedule {
            schedule: schedule.name.clone(),
            reason: "it has forward-only (Fo) actions, which PyTorch's runtime cannot run".into(),
        });
    }
    let fail = |e: &dyn std::fmt::Display| Error::InvalidSchedule {
        schedule: schedule.name.clone(),
        reason: e.to_string(),
    };
    let mut w = csv::WriterBuilder::new()
        .flexible(true)
        .from_writer(Vec::new());
    for prog in &lowered.program {
        let cells: Vec<String> = prog.iter().map(ToString::to_string).collect();
        w.write_record(&cells).map_err(|e| fail(&e))?;
    }
    let bytes = w.into_inner().map_err(|e| fail(&e))?;
    Ok(String::from_utf8(bytes).expect("action strings are ASCII"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_name_row_and_cell() {
        let e = read_pytorch_csv("0F0,0B0\n1F0,1X0\n", "o.csv")
            .unwrap_err()
            .to_string();
        assert!(e.contains("row 2, cell 2") && e.contains("1X0"), "{e}");
        let e = read_pytorch_csv("0F0,0B0\n0F1,0B1\n", "o.csv")
            .unwrap_err()
            .to_string();
        assert!(e.contains("row 2, cell 1") && e.contains("stage 0"), "{e}");
        let e = read_pytorch_csv("0F0,0SEND_F0\n", "o.csv")
            .unwrap_err()
            .to_string();
        assert!(e.contains("compute-only"), "{e}");
        // W before its I.
        let e = read_pytorch_csv("0F0,0W0,0I0\n", "o.csv")
            .unwrap_err()
            .to_string();
        assert!(e.contains("before its I"), "{e}");
    }

    #[test]
    fn infers_placement() {
        let s = read_pytorch_csv("0F0,3F0,3B0,0B0\n1F0,2F0,2B0,1B0\n", "v.csv").unwrap();
        assert_eq!(s.placement.kind, PlacementKind::V);
        assert_eq!(s.num_microbatches, 1);
        let s = read_pytorch_csv("0F0,2F0,2B0,0B0\n1F0,3F0,3B0,1B0\n", "l.csv").unwrap();
        assert_eq!(s.placement.kind, PlacementKind::Loop);
    }
}
