//! Schedule generators.
//!
//! GPipe (Huang et al. 2019) runs every forward, then every backward:
//!
//! ```text
//! rank 0: F0 F1 F2 F3 .  .  .  B0 B1 B2 B3
//! rank 1:    F0 F1 F2 F3 .  B0 B1 B2 B3
//! ```
//!
//! 1F1B (PipeDream-Flush, Narayanan et al. 2021) bounds in-flight microbatches on rank `r` by
//! `min(p - r, m)`: `min(p - r - 1, m)` warm-up forwards, then alternating one forward and one
//! backward, then the remaining backwards. With uniform costs both reach the makespan
//! `(m + p - 1)(f + b + w)`.

use crate::ir::{Action, ActionKind, Placement, Schedule};
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// The schedule families flatpipe can generate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum ScheduleKind {
    /// GPipe: all forwards, then all backwards (Huang et al. 2019).
    #[serde(rename = "gpipe")]
    GPipe,
    /// 1F1B / PipeDream-Flush (Narayanan et al. 2021).
    #[serde(rename = "1f1b")]
    OneFOneB,
}

impl ScheduleKind {
    /// Every implemented kind, in the order `all` lists them.
    pub const ALL: &'static [ScheduleKind] = &[ScheduleKind::GPipe, ScheduleKind::OneFOneB];

    /// The command-line name.
    pub fn name(self) -> &'static str {
        match self {
            ScheduleKind::GPipe => "gpipe",
            ScheduleKind::OneFOneB => "1f1b",
        }
    }

    /// PyTorch's name of the schedule class, where one exists.
    pub fn pytorch_name(self) -> &'static str {
        match self {
            ScheduleKind::GPipe => "GPipe",
            ScheduleKind::OneFOneB => "1F1B",
        }
    }

    /// The placement this kind implies.
    pub fn placement(self) -> crate::ir::PlacementKind {
        crate::ir::PlacementKind::Loop
    }

    /// Stages per rank this kind needs, given the requested `vpp`.
    pub fn stages_per_rank(self, _vpp: u32) -> u32 {
        1
    }

    /// Generates the schedule for `p` ranks and `m` microbatches (any `p, m >= 1`).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if `p` or `m` is 0.
    pub fn generate(self, p: u32, m: u32) -> Result<Schedule> {
        if p == 0 {
            return Err(Error::invalid("pp", 0, ">= 1 rank"));
        }
        if m == 0 {
            return Err(Error::invalid("microbatches", 0, ">= 1"));
        }
        Ok(match self {
            ScheduleKind::GPipe => gpipe(p, m),
            ScheduleKind::OneFOneB => one_f_one_b(p, m),
        })
    }
}

impl fmt::Display for ScheduleKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for ScheduleKind {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        let t = s.trim().to_ascii_lowercase();
        ScheduleKind::ALL
            .iter()
            .copied()
            .find(|k| k.name() == t || k.pytorch_name().eq_ignore_ascii_case(&t))
            .ok_or_else(|| {
                Error::invalid(
                    "--schedule",
                    s,
                    format!(
                        "one of {} or all",
                        ScheduleKind::ALL
                            .iter()
                            .map(|k| k.name())
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                )
            })
    }
}

/// GPipe on `p` ranks, `m` microbatches: rank `r` runs `rF0 .. rF(m-1)` then `rB0 .. rB(m-1)`.
pub fn gpipe(p: u32, m: u32) -> Schedule {
    let ranks = (0..p)
        .map(|r| {
            let f = (0..m).map(|mb| Action::new(r, ActionKind::F, mb));
            let b = (0..m).map(|mb| Action::new(r, ActionKind::B, mb));
            f.chain(b).collect()
        })
        .collect();
    Schedule {
        name: "gpipe".into(),
        placement: Placement::looped(p, 1),
        num_microbatches: m,
        num_fo_microbatches: 0,
        ranks,
    }
}

/// 1F1B (PipeDream-Flush) on `p` ranks, `m` microbatches: rank `r` runs
/// `w = min(p - r - 1, m)` warm-up forwards, then `m - w` pairs (forward `w + i`, backward `i`),
/// then backwards `m - w .. m`.
pub fn one_f_one_b(p: u32, m: u32) -> Schedule {
    let ranks = (0..p)
        .map(|r| {
            let warm = (p - r - 1).min(m);
            let mut a = Vec::with_capacity(2 * m as usize);
            a.extend((0..warm).map(|mb| Action::new(r, ActionKind::F, mb)));
            for i in 0..m - warm {
                a.push(Action::new(r, ActionKind::F, warm + i));
                a.push(Action::new(r, ActionKind::B, i));
            }
            a.extend((m - warm..m).map(|mb| Action::new(r, ActionKind::B, mb)));
            a
        })
        .collect();
    Schedule {
        name: "1f1b".into(),
        placement: Placement::looped(p, 1),
        num_microbatches: m,
        num_fo_microbatches: 0,
        ranks,
    }
}
