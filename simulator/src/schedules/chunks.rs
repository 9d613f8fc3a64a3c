//! Sequence chunks in a schedule: one sequence longer than the token budget, cut along the
//! token dimension into chunks that are microbatches of their own (TeraPipe, Li et al. ICML
//! 2021; Seq1F1B, Ao et al. 2024).
//!
//! Chunk k of a sequence attends to the keys and values of chunks `< k`, so on every stage
//! its forward needs the earlier chunks' forwards, and its input-gradient pass produces the
//! earlier chunks' key/value gradients, so the earlier chunks' backwards wait for it:
//!
//! ```text
//! on each stage s:   F(s, c0) -> F(s, c1) -> .. -> F(s, cn)      (chunk order)
//!                    B(s, cn) -> .. -> B(s, c1) -> B(s, c0)      (reverse chunk order; I or B)
//! ```
//!
//! These are dependencies of the schedule IR ([`crate::ir::Schedule::chunks`]): the replay
//! and the DAG honour them for every schedule, and [`order_chunks`] makes any generated
//! schedule respect them, the same way for every kind, in two moves:
//!
//! 1. **Reverse the backward order within a chain.** On each stage, the backward positions
//!    (I or B) the schedule gave to one sequence's chunks keep their places, and are handed
//!    out last chunk first; W positions follow their I (the same renaming), so each W stays
//!    after its I. The forward positions are handed out in chunk order.
//! 2. **Hoist forwards.** A backward of chunk k needs the forwards of chunks `<= k` on its
//!    stage: where the schedule runs them later on the rank, they move to just before the
//!    backward (Seq1F1B's longer warm-up; each hoisted forward keeps one more chunk's
//!    activations in flight, which the memory timeline counts).
//!
//! The result is validated and replayed; a schedule that still cannot run (a dependency
//! cycle across ranks) is refused with the cycle the deadlock finder names.

use crate::batching::microbatch::Microbatch;
use crate::ir::{Action, ActionKind, ComputeAction, MicrobatchId, Schedule};
use crate::{Error, Result, replay, replay::dag};
use std::collections::BTreeMap;

/// The chunk chains of a round's microbatches: per sequence cut into two chunks or more,
/// its chunks' microbatch ids in chunk order ([`crate::ir::Schedule::chunks`]).
///
/// # Errors
/// [`Error::InvalidArgument`] when a sequence's chunks are not all among `slots` (a fixed
/// capacity put them in different rounds) or appear twice.
pub fn chains(slots: &[Microbatch]) -> Result<Vec<Vec<MicrobatchId>>> {
    let mut by_seq: BTreeMap<u32, Vec<(u32, u32, MicrobatchId)>> = BTreeMap::new();
    for (i, mb) in slots.iter().enumerate() {
        if let Some(c) = mb.chunk {
            by_seq
                .entry(c.sequence)
                .or_default()
                .push((c.index, c.of, MicrobatchId(i as u32)));
        }
    }
    let mut out = Vec::new();
    for (seq, mut chunks) in by_seq {
        chunks.sort_unstable();
        let of = chunks[0].1;
        let complete =
            chunks.len() == of as usize && chunks.iter().enumerate().all(|(k, c)| c.0 == k as u32);
        if !complete {
            return Err(Error::invalid(
                "chunks of a sequence",
                format!("{} of {of} (sequence {seq})", chunks.len()),
                "all of a sequence's chunks in one round: use the dynamic capacity, or a fixed capacity of at least its chunk count",
            ));
        }
        if of >= 2 {
            out.push(chunks.into_iter().map(|c| c.2).collect());
        }
    }
    Ok(out)
}

/// `schedule` with the chunk chains `chains` (ids of its training microbatches, each chain in
/// chunk order) and its actions reordered so that every chain's dependencies hold (the module
/// doc's two moves). With no chains, the schedule unchanged.
///
/// When that schedule deadlocks (a forward hoisted on one rank waits, through the other ranks,
/// for one this rank runs later: interleaved 1F1B at some p, v, m), it tries once more with
/// each chain's forwards first gathered, on every stage, right after the chain's first forward
/// (so the chain crosses the pipeline as one block), then the two moves.
///
/// # Errors
/// [`Error::InvalidSchedule`] for a malformed chain; [`Error::Deadlock`] (with the cycle of
/// the first attempt) when neither reordered schedule can run.
pub fn order_chunks(schedule: &Schedule, chains: &[Vec<MicrobatchId>]) -> Result<Schedule> {
    match reorder(schedule, chains, false) {
        Err(first @ Error::Deadlock { .. }) => reorder(schedule, chains, true).map_err(|_| first),
        other => other,
    }
}

/// Each chain's forwards on every stage moved to right after the chain's first forward there
/// (an overlapped pair losing its forward keeps its backward in place).
fn gather_forwards(out: &mut Schedule, chain_of: &[Option<(usize, usize)>]) {
    let m = out.num_microbatches as usize;
    let key = |a: &ComputeAction| {
        (a.kind == ActionKind::F && a.microbatch.idx() < m)
            .then(|| chain_of[a.microbatch.idx()].map(|(c, _)| (a.stage.0, c)))
            .flatten()
    };
    for actions in &mut out.ranks {
        let mut first: Vec<(u32, usize)> = Vec::new();
        let mut moved: Vec<((u32, usize), ComputeAction)> = Vec::new();
        let mut keep: Vec<Action> = Vec::with_capacity(actions.len());
        for action in actions.iter() {
            let mut remaining: Vec<ComputeAction> = Vec::with_capacity(2);
            for a in action.parts() {
                match key(&a) {
                    Some(k) if first.contains(&k) => moved.push((k, a)),
                    Some(k) => {
                        first.push(k);
                        remaining.push(a);
                    }
                    None => remaining.push(a),
                }
            }
            match remaining.len() {
                0 => {}
                2 => keep.push(*action),
                _ => keep.push(Action::Compute(remaining[0])),
            }
        }
        let mut placed: Vec<(u32, usize)> = Vec::new();
        let mut rebuilt = Vec::with_capacity(actions.len());
        for action in keep {
            rebuilt.push(action);
            for a in action.parts() {
                if let Some(k) = key(&a)
                    && !placed.contains(&k)
                {
                    placed.push(k);
                    rebuilt.extend(
                        moved
                            .iter()
                            .filter(|(mk, _)| *mk == k)
                            .map(|(_, f)| Action::Compute(*f)),
                    );
                }
            }
        }
        *actions = rebuilt;
    }
}

/// [`order_chunks`]' two moves, after [`gather_forwards`] when `gather`.
fn reorder(schedule: &Schedule, chains: &[Vec<MicrobatchId>], gather: bool) -> Result<Schedule> {
    let mut out = schedule.clone();
    out.chunks = chains.to_vec();
    if chains.is_empty() {
        return Ok(out);
    }
    out.chunk_links()?;
    let m = out.num_microbatches as usize;
    let s_count = out.num_stages() as usize;
    // chain_of[mb] = (chain, position in it)
    let mut chain_of = vec![None; m];
    for (c, chain) in chains.iter().enumerate() {
        for (k, mb) in chain.iter().enumerate() {
            chain_of[mb.idx()] = Some((c, k));
        }
    }
    if gather {
        gather_forwards(&mut out, &chain_of);
    }
    rename_chunks(&mut out, chains, &chain_of);
    // Move 2: hoist the forwards a backward needs (its chunk and the earlier ones, on its
    // stage, and what those need of earlier stages on the same rank) to just before it.
    let rank_of: Vec<u32> = out.placement.rank_of.iter().map(|r| r.0).collect();
    let hoist = Hoist {
        chains,
        chain_of: &chain_of,
        rank_of: &rank_of,
        m,
        s_count,
    };
    for r in 0..out.ranks.len() {
        let actions = std::mem::take(&mut out.ranks[r]);
        out.ranks[r] = hoist
            .rank(r as u32, actions)
            .map_err(|reason| Error::InvalidSchedule {
                schedule: out.name.clone(),
                reason,
            })?;
    }
    out.validate()?;
    if !replay::is_deadlock_free(&out) {
        return Err(dag::deadlock_error(&out));
    }
    Ok(out)
}

/// Move 1 of [`order_chunks`]: per stage and chain, forwards renamed to chunk order and
/// backwards to reverse chunk order, in program order; a W follows its I's renaming.
fn rename_chunks(
    out: &mut Schedule,
    chains: &[Vec<MicrobatchId>],
    chain_of: &[Option<(usize, usize)>],
) {
    let m = out.num_microbatches as usize;
    let s_count = out.num_stages() as usize;
    let mut f_seen = vec![0usize; s_count * chains.len()];
    let mut b_seen = vec![0usize; s_count * chains.len()];
    // rename_w[s * m + original mb] = the id its I got.
    let mut rename_w = vec![u32::MAX; s_count * m];
    for actions in &mut out.ranks {
        for action in actions.iter_mut() {
            let mut rename = |a: &mut ComputeAction, f_seen: &mut [usize], b_seen: &mut [usize]| {
                let (s, mb) = (a.stage.idx(), a.microbatch.idx());
                if a.kind == ActionKind::Fo || mb >= m || s >= s_count {
                    return;
                }
                let Some((c, _)) = chain_of[mb] else { return };
                let chain = &chains[c];
                match a.kind {
                    ActionKind::F => {
                        let k = &mut f_seen[s * chains.len() + c];
                        a.microbatch = chain[(*k).min(chain.len() - 1)];
                        *k += 1;
                    }
                    ActionKind::I | ActionKind::B => {
                        let k = &mut b_seen[s * chains.len() + c];
                        let new = chain[chain.len() - 1 - (*k).min(chain.len() - 1)];
                        *k += 1;
                        rename_w[s * m + mb] = new.0;
                        a.microbatch = new;
                    }
                    ActionKind::W => {
                        let new = rename_w[s * m + mb];
                        if new != u32::MAX {
                            a.microbatch = MicrobatchId(new);
                        }
                    }
                    ActionKind::Fo => {}
                }
            };
            match action {
                Action::Compute(a) => rename(a, &mut f_seen, &mut b_seen),
                Action::Overlap(a, b) => {
                    rename(a, &mut f_seen, &mut b_seen);
                    rename(b, &mut f_seen, &mut b_seen);
                }
            }
        }
    }
}

/// Move 2 of [`order_chunks`] on one rank, in one pass over its program: every forward a
/// backward needs and the rank has not run yet is taken out of its later place (an
/// overlapped pair keeps its other half) and put, dependencies first, just before the
/// backward. `O(actions + chunks)` per rank: a 16M-token sequence in 4,096 chunks hoists
/// thousands of forwards per rank, which in-place removals and insertions made quadratic.
struct Hoist<'a> {
    chains: &'a [Vec<MicrobatchId>],
    /// `chain_of[mb] = (chain, position in it)`.
    chain_of: &'a [Option<(usize, usize)>],
    rank_of: &'a [u32],
    /// Training microbatches and stages of the schedule.
    m: usize,
    s_count: usize,
}

impl Hoist<'_> {
    /// The rank's program with the needed forwards hoisted, or why one cannot be (a needed
    /// forward that is not on the rank at all).
    fn rank(&self, r: u32, actions: Vec<Action>) -> std::result::Result<Vec<Action>, String> {
        let (m, nc) = (self.m, self.chains.len());
        let slot = |a: &ComputeAction| a.stage.idx() * m + a.microbatch.idx();
        let is_f = |a: &ComputeAction| {
            a.kind == ActionKind::F && a.microbatch.idx() < m && a.stage.idx() < self.s_count
        };
        let mut present = vec![false; self.s_count * m];
        for a in actions.iter().flat_map(Action::parts).filter(is_f) {
            present[slot(&a)] = true;
        }
        let mut issued = vec![false; self.s_count * m];
        // prefix[s * nc + c]: a chain's chunks below it are issued on stage s (a hint that
        // skips them; `issued` stays the truth).
        let mut prefix = vec![0usize; self.s_count * nc];
        let mut hoisted = vec![false; self.s_count * m];
        let mut out = Vec::with_capacity(actions.len());
        for action in actions {
            // A forward hoisted earlier is dropped at its old place.
            let kept: Vec<ComputeAction> = action
                .parts()
                .filter(|a| !(is_f(a) && hoisted[slot(a)]))
                .collect();
            let mut todo = match kept[..] {
                [] => continue,
                [a] => vec![Action::Compute(a)],
                _ => vec![action],
            };
            while let Some(action) = todo.pop() {
                // A half of a split pair whose forward the other half just hoisted.
                if let Action::Compute(a) = action
                    && is_f(&a)
                    && hoisted[slot(&a)]
                {
                    continue;
                }
                let mut need: Vec<ComputeAction> = Vec::new();
                for a in action.parts() {
                    match a.kind {
                        ActionKind::F if is_f(&a) => issued[slot(&a)] = true,
                        ActionKind::I | ActionKind::B => {
                            self.needs(a, r, (&mut issued, &mut prefix), &mut need)
                        }
                        _ => {}
                    }
                }
                if need.is_empty() {
                    out.push(action);
                    continue;
                }
                if let Action::Overlap(x, y) = action {
                    // The pair's backward needs forwards: run its two halves apart, and look
                    // again.
                    for a in &need {
                        issued[slot(a)] = false;
                        if let Some((c, k)) = self.chain_of[a.microbatch.idx()] {
                            let p = &mut prefix[a.stage.idx() * nc + c];
                            *p = (*p).min(k);
                        }
                    }
                    todo.push(Action::Compute(y));
                    todo.push(Action::Compute(x));
                    continue;
                }
                for f in need {
                    if !present[slot(&f)] {
                        return Err(format!(
                            "{f} is needed before {action} on its rank and is not after it"
                        ));
                    }
                    hoisted[slot(&f)] = true;
                    out.push(Action::Compute(f));
                }
                out.push(action);
            }
        }
        Ok(out)
    }

    /// Appends to `need` the forwards backward `b` needs that have not run: its chunk's and
    /// the chain's earlier chunks' on its stage, with what each needs of the rank's earlier
    /// stages ([`forwards_needed`]).
    fn needs(
        &self,
        b: ComputeAction,
        r: u32,
        (issued, prefix): (&mut [bool], &mut [usize]),
        need: &mut Vec<ComputeAction>,
    ) {
        let Some((c, k)) = self.chain_of.get(b.microbatch.idx()).copied().flatten() else {
            return;
        };
        let (s, m) = (b.stage.idx(), self.m);
        let chain = &self.chains[c];
        let p = &mut prefix[s * self.chains.len() + c];
        while *p <= k && issued[s * m + chain[*p].idx()] {
            *p += 1;
        }
        for mb in &chain[(*p).min(k + 1)..=k] {
            forwards_needed((s, mb.idx()), (r, self.rank_of, m), issued, need);
        }
    }
}

/// Appends to `need`, dependencies first, the forwards of `(stage, mb)` and of the earlier
/// stages on rank `r` (`(r, rank_of, m)`; in a V placement the rank's first stage feeds its
/// second through the other ranks) that have not run yet, marking them issued.
fn forwards_needed(
    (s, mb): (usize, usize),
    (r, rank_of, m): (u32, &[u32], usize),
    issued: &mut [bool],
    need: &mut Vec<ComputeAction>,
) {
    if issued[s * m + mb] {
        return;
    }
    // The latest earlier stage on this rank (the ones in between run on other ranks).
    if let Some(up) = (0..s).rev().find(|&u| rank_of[u] == r) {
        forwards_needed((up, mb), (r, rank_of, m), issued, need);
    }
    issued[s * m + mb] = true;
    need.push(ComputeAction::new(s as u32, ActionKind::F, mb as u32));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::costs::{UniformCostSpec, UniformCosts};
    use crate::schedules::generators::{ScheduleKind, one_f_one_b};

    fn ids(v: &[u32]) -> Vec<MicrobatchId> {
        v.iter().map(|&i| MicrobatchId(i)).collect()
    }

    /// The quadratic in-place pass [`Hoist`] replaced (removals and insertions in the rank's
    /// program), kept as the reference it must agree with.
    fn reference_hoist(
        out: &mut Schedule,
        chains: &[Vec<MicrobatchId>],
        chain_of: &[Option<(usize, usize)>],
    ) -> std::result::Result<(), String> {
        let m = out.num_microbatches as usize;
        let s_count = out.num_stages() as usize;
        let rank_of: Vec<u32> = out.placement.rank_of.iter().map(|r| r.0).collect();
        for (r, actions) in out.ranks.iter_mut().enumerate() {
            let mut issued = vec![false; s_count * m];
            let mut i = 0;
            while i < actions.len() {
                let mut need: Vec<ComputeAction> = Vec::new();
                for a in actions[i].parts() {
                    match a.kind {
                        ActionKind::F => issued[a.stage.idx() * m + a.microbatch.idx()] = true,
                        ActionKind::I | ActionKind::B => {
                            let Some((c, k)) = chain_of.get(a.microbatch.idx()).copied().flatten()
                            else {
                                continue;
                            };
                            for mb in &chains[c][..=k] {
                                forwards_needed(
                                    (a.stage.idx(), mb.idx()),
                                    (r as u32, &rank_of, m),
                                    &mut issued,
                                    &mut need,
                                );
                            }
                        }
                        _ => {}
                    }
                }
                if need.is_empty() {
                    i += 1;
                    continue;
                }
                if let Action::Overlap(f, b) = actions[i] {
                    // The pair's backward needs forwards: run its two halves apart, and look again.
                    actions[i] = Action::Compute(f);
                    actions.insert(i + 1, Action::Compute(b));
                    for a in &need {
                        issued[a.stage.idx() * m + a.microbatch.idx()] = false;
                    }
                    continue;
                }
                // Take each needed F out of its later place (an overlapped pair keeps its other
                // half) and put them, in chunk order, before entry i.
                for f in &need {
                    let at = actions[i + 1..]
                        .iter()
                        .position(|x| x.parts().any(|p| p == *f))
                        .map(|j| i + 1 + j);
                    match at {
                        Some(j) => match actions[j] {
                            Action::Compute(_) => {
                                actions.remove(j);
                            }
                            Action::Overlap(a, b) => {
                                actions[j] = Action::Compute(if a == *f { b } else { a });
                            }
                        },
                        None => {
                            return Err(format!(
                                "{f} is needed before {} on its rank and is not after it",
                                actions[i]
                            ));
                        }
                    }
                }
                for (n, f) in need.iter().enumerate() {
                    actions.insert(i + n, Action::Compute(*f));
                }
                // Re-scan from the first inserted forward.
            }
        }
        Ok(())
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(200))]

        /// The one-pass hoist gives exactly the reference pass's programs (or its refusal), on
        /// every kind, with one or two chains cut anywhere, with and without the gathered
        /// forwards.
        #[test]
        fn the_one_pass_hoist_is_the_reference_pass(
            k in 0usize..ScheduleKind::ALL.len(), p in 1u32..=5, v in 1u32..=3, m in 2u32..=14,
            first in 0u32..14, len in 2u32..=8, second in proptest::option::of(2u32..=4),
            gather in proptest::bool::ANY,
        ) {
            let kind = ScheduleKind::ALL[k];
            let v = kind.stages_per_rank(Some(v)).unwrap_or(2);
            let first = first % m;
            let len = len.min(m - first);
            proptest::prop_assume!(len >= 2);
            let mut chains = vec![ids(&(first..first + len).collect::<Vec<_>>())];
            if let Some(n) = second && first + len + n <= m {
                chains.push(ids(&(first + len..first + len + n).collect::<Vec<_>>()));
            }
            let costs = UniformCosts::new(&UniformCostSpec { f: 1.0, b: 2.0, w: 1.0, comm: 0.0, fb: None, fo: None, fsdp: Default::default() }, v);
            let schedule = kind.build(p, v, m, &costs, (2 * p * v) as f64).unwrap();
            let mut chain_of = vec![None; m as usize];
            for (c, chain) in chains.iter().enumerate() {
                for (i, mb) in chain.iter().enumerate() {
                    chain_of[mb.idx()] = Some((c, i));
                }
            }
            let mut base = schedule.clone();
            if gather {
                gather_forwards(&mut base, &chain_of);
            }
            rename_chunks(&mut base, &chains, &chain_of);
            let rank_of: Vec<u32> = base.placement.rank_of.iter().map(|r| r.0).collect();
            let hoist = Hoist { chains: &chains, chain_of: &chain_of, rank_of: &rank_of, m: m as usize, s_count: base.num_stages() as usize };
            let mut reference = base.clone();
            let want = reference_hoist(&mut reference, &chains, &chain_of);
            let got: std::result::Result<Vec<Vec<Action>>, String> = base
                .ranks
                .iter()
                .enumerate()
                .map(|(r, a)| hoist.rank(r as u32, a.clone()))
                .collect();
            match (got, want) {
                (Ok(got), Ok(())) => proptest::prop_assert_eq!(got, reference.ranks),
                (Err(_), Err(_)) => {}
                (got, want) => proptest::prop_assert!(false, "{kind} p={p} v={v} m={m}: {got:?} against {want:?}"),
            }
        }
    }

    /// An overlapped pair whose backward needs the pair's own forward: the pair is split, the
    /// forward hoisted before the backward, and not run a second time at its old place.
    #[test]
    fn a_pair_whose_backward_needs_its_own_forward() {
        let chains = vec![ids(&[0, 1])];
        let chain_of = vec![Some((0, 0)), Some((0, 1))];
        let hoist = Hoist {
            chains: &chains,
            chain_of: &chain_of,
            rank_of: &[0],
            m: 2,
            s_count: 1,
        };
        let f = |mb| ComputeAction::new(0, ActionKind::F, mb);
        let b = |mb| ComputeAction::new(0, ActionKind::B, mb);
        let program = vec![Action::Compute(f(0)), Action::Overlap(b(1), f(1))];
        let got: Vec<String> = hoist
            .rank(0, program)
            .unwrap()
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(got, ["0F0", "0F1", "0B1"]);
    }

    #[test]
    fn one_f_one_b_with_a_chain_by_hand() {
        // p = 2, m = 3, microbatches 0 and 1 are chunks of one sequence. Rank 1 (the last
        // stage) ran 1F0 1B0 1F1 1B1 1F2 1B2; chunk 0's backward must wait for chunk 1's, so
        // 1F1 is hoisted and the backward order within the chain reversed.
        let s = order_chunks(&one_f_one_b(2, 3), &[ids(&[0, 1])]).unwrap();
        let rank1: Vec<String> = s.ranks[1].iter().map(ToString::to_string).collect();
        assert_eq!(rank1, ["1F0", "1F1", "1B1", "1B0", "1F2", "1B2"]);
        // Rank 0 ran 0F0 0F1 0B0 0F2 0B1 0B2: its backwards of the chain reversed in place.
        let rank0: Vec<String> = s.ranks[0].iter().map(ToString::to_string).collect();
        assert_eq!(rank0, ["0F0", "0F1", "0B1", "0F2", "0B0", "0B2"]);
        // Unit costs f = b = 1, by hand: rank 1 runs 1F0 [1,2] 1F1 [2,3] 1B1 [3,4] 1B0 [4,5];
        // rank 0 runs 0B1 [4,5] 0F2 [5,6] 0B0 [6,7]; then 1F2 [6,7] 1B2 [7,8] 0B2 [8,9]: 9,
        // one unit more than unchunked 1F1B's (m + p - 1)(f + b) = 8.
        let c = UniformCosts::new(
            &UniformCostSpec {
                f: 1.0,
                b: 1.0,
                w: 0.0,
                comm: 0.0,
                fb: None,
                fo: None,
                fsdp: Default::default(),
            },
            1,
        );
        let t = replay::replay(&s, &c).unwrap();
        assert_eq!(t.makespan_ns(), 9_000_000_000);
        assert_eq!(
            dag::Dag::build(&s).replay_makespan_ns(&c),
            Some(t.makespan_ns())
        );
    }

    #[test]
    fn the_unordered_schedule_is_refused_with_the_reason() {
        let mut s = one_f_one_b(2, 2);
        s.chunks = vec![ids(&[0, 1])];
        let e = s.validate().unwrap_err().to_string();
        assert!(
            e.contains("0B0") && e.contains("key/value gradients"),
            "{e}"
        );
    }

    #[test]
    fn chains_need_all_chunks() {
        let mut mbs = Microbatch::chunks(3, 10, 4).unwrap();
        assert_eq!(chains(&mbs).unwrap(), vec![ids(&[0, 1, 2])]);
        mbs.pop();
        let e = chains(&mbs).unwrap_err().to_string();
        assert!(e.contains("2 of 3"), "{e}");
    }
}
