//! Schedule generators: every handcrafted pipeline schedule of the field, for any valid
//! `(p, v, m)`.
//!
//! | kind | placement | source |
//! |---|---|---|
//! | `gpipe` | loop, v = 1 | Huang et al. 2019 |
//! | `1f1b` | loop, v = 1 | PipeDream-Flush, Narayanan et al. 2021 |
//! | `interleaved-1f1b` | loop, v >= 1 | Narayanan et al. 2021; Megatron-LM's warm-up rule |
//! | `looped-bfs` | loop, v >= 1 | PyTorch's `ScheduleLoopedBFS` (breadth-first) |
//! | `zb-h1`, `zb-h2` | loop, v = 1 | Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024 |
//! | `zb-v` | V, v = 2 | Qi et al. 2024, "Pipeline Parallelism with Controllable Memory" |
//! | `dualpipev` | V, v = 2 | DeepSeek-V3 report; the DualPipe repository's DualPipeV |
//! | `combined-1f1b` | loop, v >= 2 | Megatron-LM's combined 1F1B (`--overlap-moe-expert-parallel-comm`) |
//!
//! GPipe runs every forward, then every backward; 1F1B bounds in-flight microbatches on rank `r`
//! by `min(p - r, m)`:
//!
//! ```text
//! gpipe  rank 0: F0 F1 F2 F3 .  .  .  B0 B1 B2 B3        1f1b  rank 0: F0 F1 F2 .  .  B0 F3 B1 ..
//!        rank 1:    F0 F1 F2 F3 .  B0 B1 B2 B3                 rank 1:    F0 F1 .  B0 F2 B1 F3 ..
//! ```
//!
//! With uniform costs and no communication both take `(m + p - 1)(f + b + w)`.

use crate::ir::{Action, ActionKind, ComputeAction, Placement, PlacementKind, Schedule};
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
    /// Interleaved 1F1B with `v` stages per rank in loop placement (Narayanan et al. 2021).
    #[serde(rename = "interleaved-1f1b")]
    Interleaved1F1B,
    /// Breadth-first looping: every microbatch through chunk 0, then chunk 1, ... (PyTorch).
    #[serde(rename = "looped-bfs")]
    LoopedBfs,
    /// ZB-H1: 1F1B's memory, split backward, deferred W's (Qi et al. 2024).
    #[serde(rename = "zb-h1")]
    ZbH1,
    /// ZB-H2: `2p - 1` in-flight microbatches on rank 0, deferred W's (Qi et al. 2024).
    #[serde(rename = "zb-h2")]
    ZbH2,
    /// ZB-V: V placement, split backward (Qi et al. 2024, controllable memory).
    #[serde(rename = "zb-v")]
    ZbV,
    /// DualPipeV: V placement with overlapped forward-backward pairs (DeepSeek).
    #[serde(rename = "dualpipev")]
    DualPipeV,
    /// Megatron-LM's combined 1F1B: interleaved 1F1B whose steady-state forward and backward
    /// run as overlapped pairs, one more warm-up forward per rank
    /// ([`combined_1f1b`]; `--overlap-moe-expert-parallel-comm`).
    #[serde(rename = "combined-1f1b")]
    Combined1F1B,
    /// zb-auto: built per step from its costs under an activation-memory limit (loop placement,
    /// or V with 2 stages per rank); see [`crate::schedules::zb_auto`].
    #[serde(rename = "zb-auto")]
    ZbAuto,
}

impl ScheduleKind {
    /// Every implemented kind, in the order `all` lists them.
    pub const ALL: &'static [ScheduleKind] = &[
        ScheduleKind::GPipe,
        ScheduleKind::OneFOneB,
        ScheduleKind::Interleaved1F1B,
        ScheduleKind::LoopedBfs,
        ScheduleKind::ZbH1,
        ScheduleKind::ZbH2,
        ScheduleKind::ZbV,
        ScheduleKind::DualPipeV,
        ScheduleKind::Combined1F1B,
        ScheduleKind::ZbAuto,
    ];

    /// The command-line name.
    pub fn name(self) -> &'static str {
        match self {
            ScheduleKind::GPipe => "gpipe",
            ScheduleKind::OneFOneB => "1f1b",
            ScheduleKind::Interleaved1F1B => "interleaved-1f1b",
            ScheduleKind::LoopedBfs => "looped-bfs",
            ScheduleKind::ZbH1 => "zb-h1",
            ScheduleKind::ZbH2 => "zb-h2",
            ScheduleKind::ZbV => "zb-v",
            ScheduleKind::DualPipeV => "dualpipev",
            ScheduleKind::Combined1F1B => "combined-1f1b",
            ScheduleKind::ZbAuto => "zb-auto",
        }
    }

    /// PyTorch's name of the schedule class, where one exists.
    pub fn pytorch_name(self) -> Option<&'static str> {
        match self {
            ScheduleKind::GPipe => Some("GPipe"),
            ScheduleKind::OneFOneB => Some("1F1B"),
            ScheduleKind::Interleaved1F1B => Some("Interleaved1F1B"),
            ScheduleKind::LoopedBfs => Some("LoopedBFS"),
            ScheduleKind::ZbV => Some("ZBVZeroBubble"),
            ScheduleKind::DualPipeV => Some("DualPipeV"),
            ScheduleKind::ZbH1
            | ScheduleKind::ZbH2
            | ScheduleKind::Combined1F1B
            | ScheduleKind::ZbAuto => None,
        }
    }

    /// The placement this kind implies with its default stages per rank.
    pub fn placement(self) -> PlacementKind {
        match self {
            ScheduleKind::ZbV | ScheduleKind::DualPipeV => PlacementKind::V,
            _ => PlacementKind::Loop,
        }
    }

    /// The stage -> rank map this kind uses on `p` ranks with `v` stages per rank (the same as
    /// its generated schedules', without generating one).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `v` does not fit the kind (see
    /// [`ScheduleKind::stages_per_rank`]).
    pub fn placement_on(self, p: u32, v: u32) -> Result<Placement> {
        let want = self.stages_per_rank(Some(v))?;
        if want != v {
            return Err(Error::invalid(
                "vpp",
                v,
                format!("{self} uses {want} stage(s) per rank"),
            ));
        }
        Ok(match self.placement_for(v) {
            PlacementKind::V => Placement::v_shape(p),
            _ => Placement::looped(p, v),
        })
    }

    /// The placement this kind uses with `v` stages per rank (zb-auto: V when `v = 2`).
    pub fn placement_for(self, v: u32) -> PlacementKind {
        match (self, v) {
            (ScheduleKind::ZbAuto, 2) => PlacementKind::V,
            _ => self.placement(),
        }
    }

    /// Stages per rank this kind uses given the requested `vpp` (`None`: the default, 2 for
    /// interleaved schedules).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `vpp` is 0, or a V schedule is given `vpp != 2`.
    pub fn stages_per_rank(self, vpp: Option<u32>) -> Result<u32> {
        match (self, vpp) {
            (_, Some(0)) => Err(Error::invalid("vpp", 0, ">= 1 stage per rank")),
            (ScheduleKind::Interleaved1F1B | ScheduleKind::LoopedBfs, v) => Ok(v.unwrap_or(2)),
            (ScheduleKind::Combined1F1B, Some(1)) => Err(Error::invalid(
                "vpp",
                1,
                "2 or more stages per rank for combined-1f1b (Megatron-LM's EP A2A overlap runs on a virtual pipeline)",
            )),
            (ScheduleKind::Combined1F1B, v) => Ok(v.unwrap_or(2)),
            (ScheduleKind::ZbAuto, None | Some(1)) => Ok(1),
            (ScheduleKind::ZbAuto, Some(2)) => Ok(2),
            (ScheduleKind::ZbAuto, Some(v)) => Err(Error::invalid(
                "vpp",
                v,
                "1 (loop placement) or 2 (V placement) for zb-auto",
            )),
            (ScheduleKind::ZbV | ScheduleKind::DualPipeV, None | Some(2)) => Ok(2),
            (ScheduleKind::ZbV | ScheduleKind::DualPipeV, Some(v)) => Err(Error::invalid(
                "vpp",
                v,
                format!(
                    "{self} uses the V placement: exactly 2 stages per rank (r and 2p - 1 - r)"
                ),
            )),
            _ => Ok(1),
        }
    }

    /// Generates the schedule for `p` ranks, `v` stages per rank (see
    /// [`ScheduleKind::stages_per_rank`]) and `m` microbatches; any `p, m >= 1` works.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if `p`, `v` or `m` is 0 or `v` does not fit the kind.
    pub fn generate(self, p: u32, v: u32, m: u32) -> Result<Schedule> {
        if p == 0 {
            return Err(Error::invalid("pp", 0, ">= 1 rank"));
        }
        if m == 0 {
            return Err(Error::invalid("microbatches", 0, ">= 1"));
        }
        let want = self.stages_per_rank(Some(v))?;
        if want != v
            && !matches!(
                self,
                ScheduleKind::Interleaved1F1B
                    | ScheduleKind::LoopedBfs
                    | ScheduleKind::Combined1F1B
                    | ScheduleKind::ZbAuto
            )
        {
            return Err(Error::invalid(
                "vpp",
                v,
                format!("{self} uses {want} stage(s) per rank"),
            ));
        }
        Ok(match self {
            ScheduleKind::GPipe => gpipe(p, m),
            ScheduleKind::OneFOneB => one_f_one_b(p, m),
            ScheduleKind::Interleaved1F1B => interleaved_1f1b(p, v, m, None)?.0,
            ScheduleKind::LoopedBfs => looped_bfs(p, v, m),
            ScheduleKind::ZbH1 => zb_h1(p, m),
            ScheduleKind::ZbH2 => zb_h2(p, m),
            ScheduleKind::ZbV => zb_v(p, m),
            ScheduleKind::DualPipeV => dualpipev(p, m),
            ScheduleKind::Combined1F1B => combined_1f1b(p, v, m)?,
            ScheduleKind::ZbAuto => {
                // Without a step's costs: unit costs (f = b = w, no transfers) under 1F1B's
                // memory, p units. With costs, `build`.
                let costs = crate::costs::UniformCosts::new(&Default::default(), v);
                return self.build(p, v, m, &costs, p as f64);
            }
        })
    }

    /// The schedule-building contract every kind implements with the same inputs: `p` ranks,
    /// `v` stages per rank, `m` microbatches, the step's `costs` (built for
    /// [`ScheduleKind::placement_on`]`(p, v)`) and each rank's activation memory limit (in the
    /// cost model's unit). The handcrafted kinds are fixed orders and use neither costs nor
    /// limit ([`ScheduleKind::generate`]); zb-auto searches for the fastest schedule under the
    /// limit ([`crate::schedules::zb_auto::zb_auto`], the handcrafted zero-bubble schedules competing).
    ///
    /// # Errors
    /// [`ScheduleKind::generate`]'s; for zb-auto [`Error::MemoryLimit`] when nothing fits.
    pub fn build<C: crate::costs::CostModel>(
        self,
        p: u32,
        v: u32,
        m: u32,
        costs: &C,
        activation_limit: f64,
    ) -> Result<Schedule> {
        self.build_for(
            p,
            v,
            m,
            costs,
            activation_limit,
            crate::schedules::zb_auto::Objective::Step,
        )
    }

    /// The handcrafted schedules zb-auto weighs against its own on `v` stages per rank, in its
    /// order of preference: ZB-V in V placement (v = 2), else 1F1B, ZB-H1 and ZB-H2.
    pub(crate) fn zb_auto_handcrafted(v: u32) -> &'static [ScheduleKind] {
        if v == 2 {
            &[ScheduleKind::ZbV]
        } else {
            &[
                ScheduleKind::OneFOneB,
                ScheduleKind::ZbH1,
                ScheduleKind::ZbH2,
            ]
        }
    }

    /// [`ScheduleKind::build`] with zb-auto minimising `objective` (one step, or the steady
    /// state under optimizer post-validation); the handcrafted kinds ignore it.
    ///
    /// # Errors
    /// As [`ScheduleKind::build`].
    pub fn build_for<C: crate::costs::CostModel>(
        self,
        p: u32,
        v: u32,
        m: u32,
        costs: &C,
        activation_limit: f64,
        objective: crate::schedules::zb_auto::Objective,
    ) -> Result<Schedule> {
        if self != ScheduleKind::ZbAuto {
            return self.generate(p, v, m);
        }
        let candidates = Self::zb_auto_handcrafted(v)
            .iter()
            .filter_map(|k| k.generate(p, v, m).ok())
            .collect();
        // flatpipe's own generators: valid schedules (tests/schedules.rs validates them).
        crate::schedules::zb_auto::search(
            p,
            v,
            m,
            costs,
            activation_limit,
            candidates,
            objective,
            false,
        )
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
        let t = s.trim();
        ScheduleKind::ALL
            .iter()
            .copied()
            .find(|k| {
                k.name().eq_ignore_ascii_case(t)
                    || k.pytorch_name().is_some_and(|n| n.eq_ignore_ascii_case(t))
            })
            .ok_or_else(|| {
                let names: Vec<_> = ScheduleKind::ALL.iter().map(|k| k.name()).collect();
                Error::invalid("schedule", s, format!("one of {}", names.join(", ")))
            })
    }
}

fn act(stage: u32, kind: ActionKind, mb: u32) -> Action {
    Action::new(stage, kind, mb)
}

fn schedule(name: &str, placement: Placement, m: u32, ranks: Vec<Vec<Action>>) -> Schedule {
    Schedule {
        name: name.into(),
        placement,
        num_microbatches: m,
        num_fo_microbatches: 0,
        chunks: Vec::new(),
        ranks,
    }
}

/// GPipe on `p` ranks, `m` microbatches: rank `r` runs `rF0 .. rF(m-1)` then `rB0 .. rB(m-1)`.
pub fn gpipe(p: u32, m: u32) -> Schedule {
    let ranks = (0..p)
        .map(|r| {
            (0..m)
                .map(|mb| act(r, ActionKind::F, mb))
                .chain((0..m).map(|mb| act(r, ActionKind::B, mb)))
                .collect()
        })
        .collect();
    schedule("gpipe", Placement::looped(p, 1), m, ranks)
}

/// 1F1B (PipeDream-Flush) on `p` ranks, `m` microbatches: rank `r` runs
/// `w = min(p - r - 1, m)` warm-up forwards, then `m - w` pairs (forward `w + i`, backward `i`),
/// then backwards `m - w .. m`.
pub fn one_f_one_b(p: u32, m: u32) -> Schedule {
    let ranks = (0..p)
        .map(|r| {
            let warm = (p - r - 1).min(m);
            let mut a = Vec::with_capacity(2 * m as usize);
            a.extend((0..warm).map(|mb| act(r, ActionKind::F, mb)));
            for i in 0..m - warm {
                a.push(act(r, ActionKind::F, warm + i));
                a.push(act(r, ActionKind::B, i));
            }
            a.extend((m - warm..m).map(|mb| act(r, ActionKind::B, mb)));
            a
        })
        .collect();
    schedule("1f1b", Placement::looped(p, 1), m, ranks)
}

/// Interleaved 1F1B (Narayanan et al. 2021) on `p` ranks with `v` stages per rank (stage
/// `c * p + r` on rank `r`), `m` microbatches, microbatch group size `g` (Megatron's
/// `--microbatch-group-size-per-virtual-pipeline-stage`; default `min(p, m)`).
///
/// The order follows Megatron-LM: microbatches go in groups of `g`; within a group every chunk
/// runs over the group's microbatches (a short last group runs over what is left). Backwards
/// use the same order with the chunks reversed. Rank `r` runs
/// `min((p - r - 1) * 2 + (v - 1) * g, m * v)` warm-up forwards (for `v = 1`, 1F1B's
/// `min(p - r - 1, m)`), then one forward and one backward alternately, then the remaining
/// backwards. Some `(p, v, m)` deadlock with the default `g` when the last group is short (e.g.
/// `p = 5, v = 2, m = 7`); then, and when `g` is not given, the smallest deadlock-free `g <= m`
/// is used (and logged at `-v`). Returns the schedule and the group size used.
///
/// # Errors
/// [`Error::InvalidArgument`] for a zero argument or a given `g` outside `1..=m`;
/// [`Error::Deadlock`] if a given `g` deadlocks.
pub fn interleaved_1f1b(p: u32, v: u32, m: u32, g: Option<u32>) -> Result<(Schedule, u32)> {
    if p == 0 || v == 0 || m == 0 {
        return Err(Error::invalid(
            "p, v, m",
            format!("{p}, {v}, {m}"),
            "all >= 1",
        ));
    }
    if let Some(g) = g {
        if g == 0 || g > m {
            return Err(Error::invalid(
                "microbatch group size",
                g,
                format!("in 1..={m}"),
            ));
        }
        let s = interleaved_with_group(p, v, m, g, false);
        check_deadlock_free(&s)?;
        return Ok((s, g));
    }
    first_deadlock_free(p, v, m, false)
}

/// Interleaved 1F1B (`combined`: Megatron's combined 1F1B) with the default microbatch group
/// size `min(p, m)`, or else the smallest deadlock-free one, and the size used.
fn first_deadlock_free(p: u32, v: u32, m: u32, combined: bool) -> Result<(Schedule, u32)> {
    let default = p.min(m);
    let s = interleaved_with_group(p, v, m, default, combined);
    if crate::replay::is_deadlock_free(&s) {
        return Ok((s, default));
    }
    for g in 1..=m {
        let s = interleaved_with_group(p, v, m, g, combined);
        if crate::replay::is_deadlock_free(&s) {
            tracing::info!(
                "{} with p = {p}, v = {v}, m = {m} deadlocks with the default microbatch group size {default} \
                 (the last group is short); using the smallest deadlock-free group size {g}",
                s.name
            );
            return Ok((s, g));
        }
    }
    Err(crate::replay::dag::deadlock_error(&s))
}

fn check_deadlock_free(s: &Schedule) -> Result<()> {
    if crate::replay::is_deadlock_free(s) {
        Ok(())
    } else {
        Err(crate::replay::dag::deadlock_error(s))
    }
}

/// Megatron-LM's combined 1F1B (`megatron/core/pipeline_parallel/combined_1f1b.py`, run under
/// `--overlap-moe-expert-parallel-comm`): [`interleaved_1f1b`]'s order with one more warm-up
/// forward per rank (`schedules.py`: `num_warmup_microbatches += 1`, so that each steady-state
/// forward and backward belong to different microbatches), and each steady-state forward run
/// together with the backward after it as one overlapped pair, `(F; B)OVERLAP_F_B`, whose
/// expert-parallel all-to-alls hide under the other's compute. On one rank (Megatron's
/// `combined_1f1b_schedule_for_no_pipelining`): `F0, (F1; B0), .., (F(m-1); B(m-2)), B(m-1)`.
/// On several ranks it needs a virtual pipeline (`v >= 2`), as Megatron-LM requires: with one
/// stage per rank each pair waits for a backward that the next rank's pair holds behind its own
/// forward, and the ranks serialize (p = 2, m = 4, f = 12, b = 24, w = 12: 336 against
/// 1F1B's 240).
///
/// # Errors
/// [`Error::InvalidArgument`] for a zero argument or `v = 1` on several ranks;
/// [`Error::Deadlock`] as [`interleaved_1f1b`].
pub fn combined_1f1b(p: u32, v: u32, m: u32) -> Result<Schedule> {
    if p == 0 || v == 0 || m == 0 {
        return Err(Error::invalid(
            "p, v, m",
            format!("{p}, {v}, {m}"),
            "all >= 1",
        ));
    }
    if p > 1 && v == 1 {
        return Err(Error::invalid(
            "vpp",
            1,
            "at least 2 stages per rank for combined-1f1b on several ranks (Megatron-LM's EP A2A overlap runs on a virtual pipeline)",
        ));
    }
    Ok(first_deadlock_free(p, v, m, true)?.0)
}

/// Megatron's interleaved 1F1B with microbatch group size `g`; `combined`: one more warm-up
/// forward per rank and the steady state's F and B as overlapped pairs ([`combined_1f1b`]).
fn interleaved_with_group(p: u32, v: u32, m: u32, g: u32, combined: bool) -> Schedule {
    // Megatron's schedule table: (microbatch, chunk) in forward order.
    let mut table = Vec::with_capacity((m * v) as usize);
    let mut start = 0;
    while start < m {
        let end = (start + g).min(m);
        for chunk in 0..v {
            table.extend((start..end).map(|mb| (mb, chunk)));
        }
        start = end;
    }
    let total = m * v;
    let ranks = (0..p)
        .map(|r| {
            let warm = if v == 1 {
                (p - r - 1 + u32::from(combined)).min(m)
            } else {
                ((p - r - 1) * 2 + (v - 1) * g + u32::from(combined)).min(total)
            };
            let fwd = |k: u32| {
                let (mb, c) = table[k as usize];
                act(c * p + r, ActionKind::F, mb)
            };
            let bwd = |k: u32| {
                let (mb, c) = table[k as usize];
                act((v - 1 - c) * p + r, ActionKind::B, mb)
            };
            let mut a: Vec<Action> = (0..warm).map(fwd).collect();
            for i in 0..total - warm {
                let (f, b) = (fwd(warm + i), bwd(i));
                match (combined, f, b) {
                    (true, Action::Compute(f), Action::Compute(b)) => a.push(Action::Overlap(f, b)),
                    _ => a.extend([f, b]),
                }
            }
            a.extend((total - warm..total).map(bwd));
            a
        })
        .collect();
    let name = if combined {
        "combined-1f1b"
    } else {
        "interleaved-1f1b"
    };
    schedule(name, Placement::looped(p, v), m, ranks)
}

/// Breadth-first looping (PyTorch's `ScheduleLoopedBFS`): rank `r` runs every microbatch's
/// forward through its chunk 0, then chunk 1, ...; then the backwards chunk by chunk in
/// reverse. Loop placement with `v` stages per rank.
pub fn looped_bfs(p: u32, v: u32, m: u32) -> Schedule {
    let ranks = (0..p)
        .map(|r| {
            let f = (0..v).flat_map(|c| (0..m).map(move |mb| act(c * p + r, ActionKind::F, mb)));
            let b = (0..v)
                .rev()
                .flat_map(|c| (0..m).map(move |mb| act(c * p + r, ActionKind::B, mb)));
            f.chain(b).collect()
        })
        .collect();
    schedule("looped-bfs", Placement::looped(p, v), m, ranks)
}

/// The zero-bubble handcrafted family on one stage per rank: rank `r` runs `warm(r)` forwards,
/// then repeats I, W, F (I and W of microbatch `i`, then the next forward), except that the W's
/// of its first `defer(r)` microbatches go to the end.
fn zero_bubble_h(
    name: &str,
    p: u32,
    m: u32,
    warm: impl Fn(u32) -> u32,
    defer: impl Fn(u32) -> u32,
) -> Schedule {
    let ranks = (0..p)
        .map(|r| {
            let (w, d) = (warm(r).min(m), defer(r).min(m));
            let mut a: Vec<Action> = (0..w).map(|mb| act(r, ActionKind::F, mb)).collect();
            let mut next_f = w;
            for i in 0..m {
                a.push(act(r, ActionKind::I, i));
                if i >= d {
                    a.push(act(r, ActionKind::W, i));
                }
                if next_f < m {
                    a.push(act(r, ActionKind::F, next_f));
                    next_f += 1;
                }
            }
            a.extend((0..d).map(|mb| act(r, ActionKind::W, mb)));
            a
        })
        .collect();
    schedule(name, Placement::looped(p, 1), m, ranks)
}

/// ZB-H1 (Qi et al. 2024): 1F1B's activation memory (`p` in-flight microbatches on rank 0)
/// with the backward split into I and W. Rank `r` runs `min(p - r, m)` forwards, then I, W, F
/// repeatedly, deferring the W's of its first `r` microbatches to the end. With uniform costs,
/// `m >= p` and `b >= w`: makespan `m(f + b + w) + (p - 1)(f + b - min(f, w))`.
pub fn zb_h1(p: u32, m: u32) -> Schedule {
    zero_bubble_h("zb-h1", p, m, |r| p - r, |r| r)
}

/// ZB-H2 (Qi et al. 2024): `2p - 1` in-flight microbatches on rank 0. Rank `r` runs
/// `min(2(p - r) - 1, m)` forwards, then I, W, F repeatedly, deferring the W's of its first `2r`
/// microbatches to the end. With uniform costs and `m >= 2p - 1`: makespan
/// `m(f + b + w) + (p - 1) max(f, f + b - 2w, b - f)`.
pub fn zb_h2(p: u32, m: u32) -> Schedule {
    zero_bubble_h("zb-h2", p, m, |r| 2 * (p - r) - 1, |r| 2 * r)
}

/// Keeps only the actions of microbatches `< m` (V schedules are built for at least `2p - 1`
/// microbatches and trimmed; removing ops never adds a dependency, so no deadlock appears).
fn trim(ranks: Vec<Vec<Action>>, m: u32) -> Vec<Vec<Action>> {
    ranks
        .into_iter()
        .map(|actions| {
            actions
                .into_iter()
                .filter_map(|a| match a {
                    Action::Compute(c) => (c.microbatch.0 < m).then_some(a),
                    Action::Overlap(f, b) => match (f.microbatch.0 < m, b.microbatch.0 < m) {
                        (true, true) => Some(a),
                        (true, false) => Some(Action::Compute(f)),
                        (false, true) => Some(Action::Compute(b)),
                        (false, false) => None,
                    },
                })
                .collect()
        })
        .collect()
}

/// ZB-V (Qi et al. 2024, "Pipeline Parallelism with Controllable Memory"; the order of PyTorch's
/// `ScheduleZBVZeroBubble`): V placement, rank `r` holds stages `r` (chunk 0) and
/// `2p - 1 - r` (chunk 1). Rank `r` runs `2(p - r) - 1` chunk-0 forwards; `r` pairs of forwards
/// (chunk 1, chunk 0); `p - r` rounds of F, I, W on chunk 1; then rounds of (F, I, W on chunk 0;
/// F, I, W on chunk 1) until every forward is issued; then `r` pairs of I (chunk 0, chunk 1),
/// `p - r` rounds of (I, W) on chunk 0, and the remaining W's. Built for `max(m, 2p - 1)`
/// microbatches and trimmed to `m`. With `f = b = w` and `m >= 2p` it reaches the lower bound
/// `m(f + b + w) + (p - 1) f / 2`.
pub fn zb_v(p: u32, m: u32) -> Schedule {
    let n = m.max(2 * p - 1);
    let ranks = (0..p)
        .map(|r| {
            let (c0, c1) = (r, 2 * p - 1 - r);
            let (mut f0, mut f1, mut b0, mut b1) = (0, 0, 0, 0);
            let mut a = Vec::new();
            let push = |a: &mut Vec<Action>, s: u32, k: ActionKind, mb: u32| a.push(act(s, k, mb));
            for _ in 0..2 * (p - r) - 1 {
                push(&mut a, c0, ActionKind::F, f0);
                f0 += 1;
            }
            for _ in 0..r {
                push(&mut a, c1, ActionKind::F, f1);
                f1 += 1;
                push(&mut a, c0, ActionKind::F, f0);
                f0 += 1;
            }
            for _ in 0..p - r {
                push(&mut a, c1, ActionKind::F, f1);
                f1 += 1;
                push(&mut a, c1, ActionKind::I, b1);
                push(&mut a, c1, ActionKind::W, b1);
                b1 += 1;
            }
            while f1 < f0 || f0 < n {
                if f0 < n {
                    push(&mut a, c0, ActionKind::F, f0);
                    f0 += 1;
                }
                push(&mut a, c0, ActionKind::I, b0);
                push(&mut a, c0, ActionKind::W, b0);
                b0 += 1;
                push(&mut a, c1, ActionKind::F, f1);
                f1 += 1;
                push(&mut a, c1, ActionKind::I, b1);
                push(&mut a, c1, ActionKind::W, b1);
                b1 += 1;
            }
            let (mut w0, mut w1) = (b0, b1);
            for _ in 0..r {
                push(&mut a, c0, ActionKind::I, b0);
                b0 += 1;
                push(&mut a, c1, ActionKind::I, b1);
                b1 += 1;
            }
            for _ in 0..p - r {
                push(&mut a, c0, ActionKind::I, b0);
                b0 += 1;
                push(&mut a, c0, ActionKind::W, w0);
                w0 += 1;
            }
            while w1 < b1 {
                push(&mut a, c1, ActionKind::W, w1);
                w1 += 1;
            }
            while w0 < b0 {
                push(&mut a, c0, ActionKind::W, w0);
                w0 += 1;
            }
            a
        })
        .collect();
    schedule("zb-v", Placement::v_shape(p), m, trim(ranks, m))
}

/// Per-rank builder for DualPipeV: microbatch counters per chunk and the FIFO of deferred W's.
struct DualPipeRank {
    stage: [u32; 2],
    f: [u32; 2],
    b: [u32; 2],
    deferred_w: std::collections::VecDeque<ComputeAction>,
    out: Vec<Action>,
}

impl DualPipeRank {
    fn fwd(&mut self, c: usize) -> ComputeAction {
        let a = ComputeAction::new(self.stage[c], ActionKind::F, self.f[c]);
        self.f[c] += 1;
        a
    }
    /// A backward of chunk `c`: a fused B, or with `zb` an I whose W is deferred.
    fn bwd(&mut self, c: usize, zb: bool) -> ComputeAction {
        let mb = self.b[c];
        self.b[c] += 1;
        if zb {
            self.deferred_w
                .push_back(ComputeAction::new(self.stage[c], ActionKind::W, mb));
            ComputeAction::new(self.stage[c], ActionKind::I, mb)
        } else {
            ComputeAction::new(self.stage[c], ActionKind::B, mb)
        }
    }
    fn push(&mut self, a: ComputeAction) {
        self.out.push(Action::Compute(a));
    }
    fn weight(&mut self) {
        if let Some(w) = self.deferred_w.pop_front() {
            self.out.push(Action::Compute(w));
        }
    }
    fn pair(&mut self, fc: usize, bc: usize) {
        let f = self.fwd(fc);
        let b = self.bwd(bc, false);
        self.out.push(Action::Overlap(f, b));
    }
}

/// DualPipeV (DeepSeek-V3 report; the DualPipe repository's `dualpipev.py`, the "cut-in-half"
/// DualPipe): V placement, rank `r` holds stages `r` (chunk 0) and `2p - 1 - r` (chunk 1). Its
/// eight phases per rank: `2(p - r - 1)` chunk-0 forwards; `r + 1` pairs of forwards (chunk 0,
/// chunk 1); `p - r - 1` rounds of (I, W, F) on chunk 1; `n - 2p + r + 1` main rounds of two
/// overlapped forward-backward pairs (F chunk 0 with B chunk 1, F chunk 1 with B chunk 0; the
/// last rank runs the first F and B apart); `p - r - 1` rounds of (B chunk 1, pair F chunk 1 with
/// B chunk 0); `r + 1` rounds of backwards (chunk 1, chunk 0) that switch from fused B to I with
/// deferred W half-way (odd ranks before chunk 1, even ranks before chunk 0); `p - r - 1`
/// rounds of (deferred W, I chunk 0); the deferred W's. Built for `n = max(m, 2p)`
/// microbatches and trimmed to `m`.
pub fn dualpipev(p: u32, m: u32) -> Schedule {
    let n = m.max(2 * p);
    let ranks = (0..p)
        .map(|r| {
            let mut x = DualPipeRank {
                stage: [r, 2 * p - 1 - r],
                f: [0; 2],
                b: [0; 2],
                deferred_w: Default::default(),
                out: Vec::new(),
            };
            for _ in 0..2 * (p - r - 1) {
                let a = x.fwd(0);
                x.push(a);
            }
            for _ in 0..r + 1 {
                let a = x.fwd(0);
                x.push(a);
                let a = x.fwd(1);
                x.push(a);
            }
            for _ in 0..p - r - 1 {
                let i = x.bwd(1, true);
                x.push(i);
                x.weight();
                let a = x.fwd(1);
                x.push(a);
            }
            for i in 0..n - 2 * p + r + 1 {
                if i == 0 && r == p - 1 {
                    let a = x.fwd(0);
                    x.push(a);
                    let b = x.bwd(1, false);
                    x.push(b);
                } else {
                    x.pair(0, 1);
                }
                x.pair(1, 0);
            }
            for _ in 0..p - r - 1 {
                let b = x.bwd(1, false);
                x.push(b);
                x.pair(1, 0);
            }
            let step6 = r + 1;
            let mut zb = false;
            for i in 0..step6 {
                if i == step6 / 2 && r % 2 == 1 {
                    zb = true;
                }
                let b = x.bwd(1, zb);
                x.push(b);
                if i == step6 / 2 && r % 2 == 0 {
                    zb = true;
                }
                let b = x.bwd(0, zb);
                x.push(b);
            }
            for _ in 0..p - r - 1 {
                x.weight();
                let b = x.bwd(0, true);
                x.push(b);
            }
            while !x.deferred_w.is_empty() {
                x.weight();
            }
            x.out
        })
        .collect();
    schedule("dualpipev", Placement::v_shape(p), m, trim(ranks, m))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placement_on_is_the_generated_schedules_placement() {
        for &k in ScheduleKind::ALL {
            let vs: &[u32] = match k {
                ScheduleKind::Interleaved1F1B | ScheduleKind::LoopedBfs => &[1, 2, 3],
                ScheduleKind::ZbAuto => &[1, 2],
                ScheduleKind::ZbV | ScheduleKind::DualPipeV => &[2],
                ScheduleKind::Combined1F1B => &[2, 3],
                _ => &[1],
            };
            for &v in vs {
                for p in [1u32, 3, 4] {
                    let s = k.generate(p, v, 5).unwrap();
                    assert_eq!(
                        k.placement_on(p, v).unwrap(),
                        s.placement,
                        "{k} p={p} v={v}"
                    );
                }
            }
        }
        assert!(ScheduleKind::OneFOneB.placement_on(4, 2).is_err());
    }

    /// Megatron-LM's `combined_1f1b_schedule_for_no_pipelining` on one rank: F0 alone, then
    /// each backward paired with the next forward, the last backward alone.
    #[test]
    fn combined_1f1b_on_one_rank_is_megatrons_no_pipelining_order() {
        let s = combined_1f1b(1, 1, 4).unwrap();
        let got: Vec<String> = s.ranks[0].iter().map(|a| a.to_string()).collect();
        assert_eq!(
            got,
            [
                "0F0",
                "(0F1;0B0)OVERLAP_F_B",
                "(0F2;0B1)OVERLAP_F_B",
                "(0F3;0B2)OVERLAP_F_B",
                "0B3"
            ]
        );
    }

    /// On several ranks: interleaved 1F1B's warm-up forwards plus one (Megatron's
    /// `num_warmup_microbatches += 1`), every steady-state F with the B after it as one pair,
    /// each F and B of every (stage, microbatch) once; one stage per rank on several ranks is
    /// refused, by the kind too.
    #[test]
    fn combined_1f1b_warms_up_one_more_and_pairs_the_steady_state() {
        for p in 2..=5u32 {
            for v in 2..=3u32 {
                for m in 1..=12u32 {
                    let c = combined_1f1b(p, v, m).unwrap();
                    c.validate().unwrap();
                    let g = p.min(m);
                    if c != interleaved_with_group(p, v, m, g, true) {
                        // The default group size deadlocks: another was chosen.
                        continue;
                    }
                    let warm = |a: &[Action]| {
                        a.iter()
                            .take_while(
                                |x| matches!(x, Action::Compute(c) if c.kind == ActionKind::F),
                            )
                            .count()
                    };
                    for r in 0..p as usize {
                        let total = (m * v) as usize;
                        let megatron = (p as usize - r - 1) * 2 + (v - 1) as usize * g as usize;
                        assert_eq!(
                            warm(&c.ranks[r]),
                            (megatron + 1).min(total),
                            "p={p} v={v} m={m} r={r}"
                        );
                        let parts: usize = c.ranks[r].iter().map(|a| a.parts().count()).sum();
                        assert_eq!(parts, 2 * total, "p={p} v={v} m={m} r={r}");
                        let pairs = c.ranks[r]
                            .iter()
                            .filter(|a| matches!(a, Action::Overlap(..)))
                            .count();
                        assert_eq!(pairs, total - warm(&c.ranks[r]), "p={p} v={v} m={m} r={r}");
                    }
                }
            }
        }
        let e = combined_1f1b(4, 1, 8).unwrap_err().to_string();
        assert!(e.contains("virtual pipeline"), "{e}");
        // Why: on one stage per rank the pairs serialize the ranks (f = 12, B = b + w = 36,
        // a pair 48, p = 2, m = 4). By hand: rank 0 runs F0 F1 (0-24), rank 1 F0 (12-24);
        // rank 1's (F1;B0) 24-72; rank 0's (F2;B0) waits for B0's gradient, 72-120; rank 1's
        // (F2;B1) waits for F2, 120-168; rank 0's (F3;B1) 168-216; rank 1's (F3;B2) 216-264;
        // rank 1's B3 264-300, rank 0's B2 264-300 and B3 300-336. 1F1B: (m + p - 1)(f + B)
        // = 240.
        let spec = crate::UniformCostSpec {
            f: 12.0,
            b: 24.0,
            w: 12.0,
            comm: 0.0,
            fb: None,
            fo: None,
            fsdp: Default::default(),
        };
        let costs = crate::UniformCosts::new(&spec, 1);
        let serial = crate::simulate(&interleaved_with_group(2, 1, 4, 2, true), &costs).unwrap();
        assert_eq!(serial.metrics.makespan_s, 336.0);
        let plain = crate::simulate(&one_f_one_b(2, 4), &costs).unwrap();
        assert_eq!(plain.metrics.makespan_s, 240.0);
        assert!(ScheduleKind::Combined1F1B.stages_per_rank(Some(1)).is_err());
    }
}
