//! The schedule IR: per-rank ordered actions in PyTorch's notation.
//!
//! ```text
//! rank 0: 0F0 0F1 0F2 0F3 0B0 0F4 ...      stage 0 on rank 0
//! rank 1:     1F0 1F1 1F2 1B0 1F3 1B1 ...  stage 1 on rank 1
//! ```
//!
//! An action is `<stage><kind><microbatch>`; `Display` and `FromStr` round-trip PyTorch's
//! strings (`torch.distributed.pipelining`): `0F1`, `3I0`, `3W0`, `2B1`, the overlapped pair
//! `(0F3;1B2)OVERLAP_F_B`, and our forward-only extension `1Fo0`. Bubbles are never stored: they
//! are whatever time the replay leaves between actions. Send and receive are derived from the
//! [`Placement`], never written in a schedule.

pub mod comm;
pub mod lowering;
pub mod pytorch_csv;

use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

macro_rules! id {
    ($(#[$m:meta])* $name:ident) => {
        $(#[$m])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        pub struct $name(pub u32);
        impl $name {
            /// The index as `usize`.
            pub fn idx(self) -> usize {
                self.0 as usize
            }
        }
        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                self.0.fmt(f)
            }
        }
    };
}
id!(
    /// A device (GPU, or a CPU thread in the CPU backend), 0-based.
    Rank
);
id!(
    /// A pipeline stage (global index over all virtual stages), 0-based.
    StageId
);
id!(
    /// A microbatch of the step, 0-based. Forward-only microbatches have their own id space.
    MicrobatchId
);

/// What a compute action does (PyTorch's letters, plus `Fo`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum ActionKind {
    /// Forward, keeping activations for the backward.
    F,
    /// Backward for inputs (dgrad; the Zero Bubble paper's "B").
    I,
    /// Backward for weights (wgrad).
    W,
    /// Full backward: I and W fused.
    B,
    /// Forward-only (reference / teacher): no activations kept, no backward. Our extension.
    Fo,
}

impl ActionKind {
    /// The letter(s) in PyTorch notation.
    pub fn letter(self) -> &'static str {
        match self {
            ActionKind::F => "F",
            ActionKind::I => "I",
            ActionKind::W => "W",
            ActionKind::B => "B",
            ActionKind::Fo => "Fo",
        }
    }

    /// Whether this action is a backward that sends a gradient to the previous stage (I or B).
    pub fn is_input_backward(self) -> bool {
        matches!(self, ActionKind::I | ActionKind::B)
    }
}

/// One stage's work on one microbatch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ComputeAction {
    /// The stage.
    pub stage: StageId,
    /// The microbatch.
    pub microbatch: MicrobatchId,
    /// What is done.
    pub kind: ActionKind,
}

impl ComputeAction {
    /// Shorthand constructor.
    pub fn new(stage: u32, kind: ActionKind, microbatch: u32) -> Self {
        ComputeAction {
            stage: StageId(stage),
            microbatch: MicrobatchId(microbatch),
            kind,
        }
    }

    /// The stage this action's result goes to, in a pipeline of `num_stages` stages: F and Fo
    /// send their output activations to stage s + 1, I and B their input gradient to stage
    /// s - 1; W sends nothing, nor does the last stage's forward (its loss gradient stays on
    /// the rank) or stage 0's backward. This is the pipeline's one transfer rule: the replay,
    /// the DAG, the exact solver, the executor's interpreter and the Python runtime all ask it.
    #[inline]
    pub fn sends(self, num_stages: u32) -> Option<StageId> {
        let s = self.stage.0;
        match self.kind {
            ActionKind::F | ActionKind::Fo => (s + 1 < num_stages).then_some(StageId(s + 1)),
            ActionKind::I | ActionKind::B => s.checked_sub(1).map(StageId),
            ActionKind::W => None,
        }
    }

    /// The stage this action waits on for its input, the mirror of [`ComputeAction::sends`]:
    /// F and Fo of stage s > 0 receive stage s - 1's activations, I and B of a stage before the
    /// last receive stage s + 1's gradient; W and the ends of the pipeline receive nothing.
    #[inline]
    pub fn receives(self, num_stages: u32) -> Option<StageId> {
        let s = self.stage.0;
        match self.kind {
            ActionKind::F | ActionKind::Fo => s.checked_sub(1).map(StageId),
            ActionKind::I | ActionKind::B => (s + 1 < num_stages).then_some(StageId(s + 1)),
            ActionKind::W => None,
        }
    }
}

/// One entry of a rank's action list.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Action {
    /// A single compute action.
    Compute(ComputeAction),
    /// A forward and a backward run together on one rank (DualPipe's overlapped pair), printed
    /// `(0F3;1B2)OVERLAP_F_B`. The first is the forward, the second the backward.
    Overlap(ComputeAction, ComputeAction),
}

impl Action {
    /// Shorthand for a compute action.
    pub fn new(stage: u32, kind: ActionKind, microbatch: u32) -> Self {
        Action::Compute(ComputeAction::new(stage, kind, microbatch))
    }

    /// The one or two compute actions this entry holds.
    pub fn parts(&self) -> impl Iterator<Item = ComputeAction> + '_ {
        let (a, b) = match self {
            Action::Compute(a) => (*a, None),
            Action::Overlap(a, b) => (*a, Some(*b)),
        };
        std::iter::once(a).chain(b)
    }
}

impl fmt::Display for ComputeAction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}{}", self.stage, self.kind.letter(), self.microbatch)
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Action::Compute(a) => a.fmt(f),
            Action::Overlap(a, b) => write!(f, "({a};{b})OVERLAP_F_B"),
        }
    }
}

impl FromStr for ComputeAction {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        let err = |reason: &str| Error::ParseAction {
            text: s.to_string(),
            reason: reason.to_string(),
        };
        let t = s.trim();
        let d1 = t
            .find(|c: char| !c.is_ascii_digit())
            .ok_or_else(|| err("no action letter"))?;
        if d1 == 0 {
            return Err(err("must start with the stage number"));
        }
        let rest = &t[d1..];
        let l = rest
            .find(|c: char| c.is_ascii_digit())
            .ok_or_else(|| err("no microbatch number after the letter"))?;
        let kind = match &rest[..l] {
            "F" => ActionKind::F,
            "I" => ActionKind::I,
            "W" => ActionKind::W,
            "B" => ActionKind::B,
            "Fo" => ActionKind::Fo,
            other => {
                return Err(err(&format!(
                    "unknown action type `{other}` (compute actions are F, I, W, B, Fo)"
                )));
            }
        };
        let mb = &rest[l..];
        if !mb.bytes().all(|b| b.is_ascii_digit()) {
            return Err(err("trailing characters after the microbatch number"));
        }
        let stage: u32 = t[..d1]
            .parse()
            .map_err(|_| err("stage number out of range"))?;
        let microbatch: u32 = mb
            .parse()
            .map_err(|_| err("microbatch number out of range"))?;
        Ok(ComputeAction::new(stage, kind, microbatch))
    }
}

impl FromStr for Action {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        let t = s.trim();
        if let Some(inner) = t.strip_prefix('(') {
            let err = |reason: &str| Error::ParseAction {
                text: s.to_string(),
                reason: reason.to_string(),
            };
            let inner = inner
                .strip_suffix(")OVERLAP_F_B")
                .ok_or_else(|| err("an overlapped pair ends with )OVERLAP_F_B"))?;
            let (a, b) = inner
                .split_once(';')
                .ok_or_else(|| err("an overlapped pair holds two actions separated by ;"))?;
            return Ok(Action::Overlap(a.parse()?, b.parse()?));
        }
        Ok(Action::Compute(t.parse()?))
    }
}

/// How stages are laid out on ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PlacementKind {
    /// Stage `s` on rank `s mod p` (interleaved 1F1B, GPipe, 1F1B).
    Loop,
    /// Rank `r` holds stages `r` and `2p - 1 - r` (ZB-V, DualPipeV).
    V,
    /// Any other mapping (e.g. inferred from a CSV file).
    Custom,
}

/// The map stage -> rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    /// `rank_of[s]` is the rank that runs stage `s`.
    pub rank_of: Vec<Rank>,
    /// Number of ranks `p`.
    pub num_ranks: u32,
    /// The layout family.
    pub kind: PlacementKind,
}

impl Placement {
    /// Loop placement of `p * v` stages: stage `s` on rank `s mod p`.
    pub fn looped(p: u32, v: u32) -> Self {
        Placement {
            rank_of: (0..p * v).map(|s| Rank(s % p)).collect(),
            num_ranks: p,
            kind: PlacementKind::Loop,
        }
    }

    /// V placement of `2p` stages: rank `r` holds stages `r` and `2p - 1 - r`.
    pub fn v_shape(p: u32) -> Self {
        let rank_of = (0..2 * p)
            .map(|s| Rank(if s < p { s } else { 2 * p - 1 - s }))
            .collect();
        Placement {
            rank_of,
            num_ranks: p,
            kind: PlacementKind::V,
        }
    }

    /// Number of stages.
    pub fn num_stages(&self) -> u32 {
        self.rank_of.len() as u32
    }

    /// The rank of stage `s`.
    pub fn rank(&self, s: StageId) -> Rank {
        self.rank_of[s.idx()]
    }

    /// The stages held by `rank`, in increasing order.
    pub fn stages_of(&self, rank: Rank) -> Vec<StageId> {
        (0..self.num_stages())
            .map(StageId)
            .filter(|s| self.rank(*s) == rank)
            .collect()
    }
}

/// A schedule: for each rank, the ordered list of actions it runs in one step.
#[derive(Debug, Clone, PartialEq)]
pub struct Schedule {
    /// Name, e.g. `1f1b`.
    pub name: String,
    /// Stage -> rank.
    pub placement: Placement,
    /// Training microbatches of the step.
    pub num_microbatches: u32,
    /// Forward-only microbatches of the step (their own id space).
    pub num_fo_microbatches: u32,
    /// `ranks[r]` is rank `r`'s action list.
    pub ranks: Vec<Vec<Action>>,
    /// Chunk chains: each lists the training microbatches that are the chunks of one sequence
    /// longer than the token budget, in chunk order ([`crate::batching::microbatch::Chunk`]). On every
    /// stage, chunk k's F needs chunk k-1's F (the keys and values of the earlier chunks) and
    /// chunk k-1's backward (I or B) needs chunk k's (the key/value gradients chunk k's input
    /// gradient produces), so a sequence's forwards run in chunk order and its backwards in
    /// reverse chunk order. Empty when no sequence was cut.
    pub chunks: Vec<Vec<MicrobatchId>>,
}

/// Per training microbatch, the previous and the next chunk of its sequence
/// ([`Schedule::chunks`]); `u32::MAX` where there is none.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChunkLinks {
    /// `prev[mb]`: the chunk before `mb` in its sequence.
    pub prev: Vec<u32>,
    /// `next[mb]`: the chunk after `mb` in its sequence.
    pub next: Vec<u32>,
}

impl ChunkLinks {
    /// No chunk before or after.
    pub const NONE: u32 = u32::MAX;
}

impl Schedule {
    /// Number of stages.
    pub fn num_stages(&self) -> u32 {
        self.placement.num_stages()
    }

    /// Total compute actions (an overlapped pair counts two).
    pub fn num_compute_actions(&self) -> usize {
        self.ranks.iter().flatten().map(|a| a.parts().count()).sum()
    }

    /// The chunk links of [`Schedule::chunks`], or `None` when no sequence was cut.
    ///
    /// # Errors
    /// [`Error::InvalidSchedule`] for a chain naming a microbatch out of range, one in two
    /// chains or twice, or a chain of fewer than two chunks.
    pub fn chunk_links(&self) -> Result<Option<ChunkLinks>> {
        if self.chunks.is_empty() {
            return Ok(None);
        }
        let m = self.num_microbatches as usize;
        let mut links = ChunkLinks {
            prev: vec![ChunkLinks::NONE; m],
            next: vec![ChunkLinks::NONE; m],
        };
        let mut seen = vec![false; m];
        for (c, chain) in self.chunks.iter().enumerate() {
            let fail = |reason: String| {
                Err(Error::InvalidSchedule {
                    schedule: self.name.clone(),
                    reason: format!("chunk chain {c}: {reason}"),
                })
            };
            if chain.len() < 2 {
                return fail(format!(
                    "{} chunk(s); a chain holds >= 2 chunks of one sequence",
                    chain.len()
                ));
            }
            for (k, mb) in chain.iter().enumerate() {
                if mb.idx() >= m {
                    return fail(format!("names microbatch {mb}; microbatches are 0..{m}"));
                }
                if std::mem::replace(&mut seen[mb.idx()], true) {
                    return fail(format!("microbatch {mb} is already a chunk of a chain"));
                }
                if k > 0 {
                    links.prev[mb.idx()] = chain[k - 1].0;
                    links.next[chain[k - 1].idx()] = mb.0;
                }
            }
        }
        Ok(Some(links))
    }

    /// Checks the schedule's validity: every action on the rank its stage is placed on; every
    /// (stage, microbatch) has exactly one F and exactly one backward, either a fused B or an I
    /// and a W, with W after I when both are on one rank; forward-only microbatches one Fo per
    /// stage; overlapped pairs hold a forward then a backward (I or B); the chunks of a
    /// sequence ([`Schedule::chunks`]) forward in chunk order and backward in reverse chunk
    /// order on every stage. Dependencies across ranks are checked by the replay (a violation
    /// is a deadlock).
    ///
    /// # Errors
    /// [`Error::InvalidSchedule`] naming the rank, position and action.
    pub fn validate(&self) -> Result<()> {
        let fail = |reason: String| {
            Err(Error::InvalidSchedule {
                schedule: self.name.clone(),
                reason,
            })
        };
        let p = self.placement.num_ranks as usize;
        let s_count = self.num_stages() as usize;
        let m = self.num_microbatches as usize;
        let mfo = self.num_fo_microbatches as usize;
        if self.ranks.len() != p {
            return fail(format!("{} action lists for {p} ranks", self.ranks.len()));
        }
        // counts[(s * m + mb)] = [F, I, W, B]; position of I for the W-after-I check.
        let mut counts = vec![[0u32; 4]; s_count * m];
        let mut fo_counts = vec![0u32; s_count * mfo];
        for (r, actions) in self.ranks.iter().enumerate() {
            for (pos, action) in actions.iter().enumerate() {
                if let Action::Overlap(a, b) = action
                    && !(a.kind == ActionKind::F && b.kind.is_input_backward())
                {
                    return fail(format!(
                        "rank {r}, position {pos}: {action} must pair a forward F with a backward I or B"
                    ));
                }
                for a in action.parts() {
                    let s = a.stage.idx();
                    if s >= s_count {
                        return fail(format!(
                            "rank {r}, position {pos}: {a} names stage {s}; stages are 0..{s_count}"
                        ));
                    }
                    if self.placement.rank(a.stage).idx() != r {
                        return fail(format!(
                            "rank {r}, position {pos}: {a} runs stage {s}, which is placed on rank {}",
                            self.placement.rank(a.stage)
                        ));
                    }
                    let mb = a.microbatch.idx();
                    if a.kind == ActionKind::Fo {
                        if mb >= mfo {
                            return fail(format!(
                                "rank {r}, position {pos}: {a} names forward-only microbatch {mb}; there are {mfo}"
                            ));
                        }
                        fo_counts[s * mfo + mb] += 1;
                        continue;
                    }
                    if mb >= m {
                        return fail(format!(
                            "rank {r}, position {pos}: {a} names microbatch {mb}; microbatches are 0..{m}"
                        ));
                    }
                    let c = &mut counts[s * m + mb];
                    let k = match a.kind {
                        ActionKind::F => 0,
                        ActionKind::I => 1,
                        ActionKind::W => {
                            if c[1] == 0 {
                                return fail(format!(
                                    "rank {r}, position {pos}: {a} comes before its I ({}I{})",
                                    s, mb
                                ));
                            }
                            2
                        }
                        ActionKind::B => 3,
                        ActionKind::Fo => unreachable!("handled above"),
                    };
                    c[k] += 1;
                }
            }
        }
        if let Some(links) = self.chunk_links()? {
            self.check_chunk_order(&links)?;
        }
        for s in 0..s_count {
            for mb in 0..m {
                let [f, i, w, b] = counts[s * m + mb];
                if f != 1 {
                    return fail(format!(
                        "stage {s} microbatch {mb} has {f} forwards ({s}F{mb}); exactly 1 is needed"
                    ));
                }
                let ok = (b == 1 && i == 0 && w == 0) || (b == 0 && i == 1 && w == 1);
                if !ok {
                    return fail(format!(
                        "stage {s} microbatch {mb} has B x{b}, I x{i}, W x{w}; exactly one B, or one I and one W, is needed"
                    ));
                }
            }
            for k in 0..mfo {
                let c = fo_counts[s * mfo + k];
                if c != 1 {
                    return fail(format!(
                        "stage {s} forward-only microbatch {k} has {c} Fo actions; exactly 1 is needed"
                    ));
                }
            }
        }
        Ok(())
    }

    /// On every rank, a chunk's F after its previous chunk's F and its backward (I or B) before
    /// its previous chunk's backward, when both are on the rank (a stage's actions are all on
    /// one rank).
    fn check_chunk_order(&self, links: &ChunkLinks) -> Result<()> {
        let m = self.num_microbatches as usize;
        let s_count = self.num_stages() as usize;
        // Whether each (stage, mb)'s F and backward have come yet in its rank's program.
        let mut f_seen = vec![false; s_count * m];
        let mut b_seen = vec![false; s_count * m];
        for (r, actions) in self.ranks.iter().enumerate() {
            for (pos, action) in actions.iter().enumerate() {
                for a in action.parts() {
                    let (s, mb) = (a.stage.idx(), a.microbatch.idx());
                    if a.kind == ActionKind::Fo || s >= s_count || mb >= m {
                        continue;
                    }
                    let slot = match a.kind {
                        ActionKind::F => &mut f_seen,
                        ActionKind::I | ActionKind::B => &mut b_seen,
                        _ => continue,
                    };
                    slot[s * m + mb] = true;
                    let before = links.prev[mb];
                    let after = links.next[mb];
                    let broken = match a.kind {
                        ActionKind::F => {
                            before != ChunkLinks::NONE && !f_seen[s * m + before as usize]
                        }
                        _ => after != ChunkLinks::NONE && !b_seen[s * m + after as usize],
                    };
                    if broken {
                        let reason = match a.kind {
                            ActionKind::F => format!(
                                "rank {r}, position {pos}: {a} must come after {s}F{before}: its forward needs the keys and values of the chunk before it"
                            ),
                            _ => format!(
                                "rank {r}, position {pos}: {a} must come after stage {s}'s backward (I or B) of microbatch {after}: the later chunk's input gradient produces this chunk's key/value gradients"
                            ),
                        };
                        return Err(Error::InvalidSchedule {
                            schedule: self.name.clone(),
                            reason,
                        });
                    }
                }
            }
        }
        Ok(())
    }

    /// The step-by-rank grid as text: one line per rank, one action per column (columns as
    /// wide as their widest cell).
    pub fn grid(&self) -> String {
        let cells: Vec<Vec<String>> = self
            .ranks
            .iter()
            .map(|a| a.iter().map(ToString::to_string).collect())
            .collect();
        let cols = cells.iter().map(Vec::len).max().unwrap_or(0);
        let widths: Vec<usize> = (0..cols)
            .map(|c| {
                cells
                    .iter()
                    .filter_map(|row| row.get(c))
                    .map(String::len)
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        let mut out = String::new();
        for (r, row) in cells.iter().enumerate() {
            out.push_str(&format!("rank {r:>2}:"));
            for (c, cell) in row.iter().enumerate() {
                out.push_str(&format!(" {cell:>w$}", w = widths[c]));
            }
            out.push('\n');
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_pytorch_notation() {
        assert_eq!(
            "0F1".parse::<Action>().unwrap(),
            Action::new(0, ActionKind::F, 1)
        );
        assert_eq!(
            "12I30".parse::<Action>().unwrap(),
            Action::new(12, ActionKind::I, 30)
        );
        assert_eq!(
            "2Fo5".parse::<Action>().unwrap(),
            Action::new(2, ActionKind::Fo, 5)
        );
        let pair: Action = "(0F7;7B3)OVERLAP_F_B".parse().unwrap();
        assert_eq!(
            pair,
            Action::Overlap(
                ComputeAction::new(0, ActionKind::F, 7),
                ComputeAction::new(7, ActionKind::B, 3)
            )
        );
        assert_eq!(pair.to_string(), "(0F7;7B3)OVERLAP_F_B");
        for bad in ["", "F1", "0X1", "0F", "0F1x", "(0F1;1B0)", "0SEND_F1"] {
            assert!(bad.parse::<Action>().is_err(), "{bad}");
        }
    }

    #[test]
    fn transfer_rule() {
        // Four stages, written out by hand: forwards go down the pipeline, input backwards up.
        let table = [
            ("0F3", Some(1), None),
            ("2F3", Some(3), Some(1)),
            ("3F3", None, Some(2)),
            ("1Fo0", Some(2), Some(0)),
            ("3Fo0", None, Some(2)),
            ("0I1", None, Some(1)),
            ("2I1", Some(1), Some(3)),
            ("3B1", Some(2), None),
            ("0B1", None, Some(1)),
            ("1W5", None, None),
        ];
        for (text, to, from) in table {
            let a: ComputeAction = text.parse().unwrap();
            assert_eq!(a.sends(4), to.map(StageId), "{text} sends");
            assert_eq!(a.receives(4), from.map(StageId), "{text} receives");
        }
        // One stage: nothing moves.
        for text in ["0F0", "0I0", "0B0", "0Fo0", "0W0"] {
            let a: ComputeAction = text.parse().unwrap();
            assert_eq!((a.sends(1), a.receives(1)), (None, None), "{text}");
        }
    }

    #[test]
    fn placements() {
        let v = Placement::v_shape(4);
        assert_eq!(v.stages_of(Rank(0)), vec![StageId(0), StageId(7)]);
        assert_eq!(v.stages_of(Rank(3)), vec![StageId(3), StageId(4)]);
        let l = Placement::looped(4, 2);
        assert_eq!(l.stages_of(Rank(1)), vec![StageId(1), StageId(5)]);
    }
}
