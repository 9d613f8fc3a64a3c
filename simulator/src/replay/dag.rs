//! The step's dependency DAG as a petgraph graph.
//!
//! Nodes are compute entries (an action or an overlapped pair, on its rank) and transfers
//! (derived from the placement: one after every F / Fo whose next stage is on another rank,
//! one after every I / B whose previous stage is). Edges:
//!
//! ```text
//! data:     F(s) -> [send] -> F(s+1)      I|B(s+1) -> [send] -> I|B(s)
//!           F(s) -> I|B(s)                I(s) -> W(s)          Fo(s) -> [send] -> Fo(s+1)
//! chunks:   F(s, k-1) -> F(s, k)          I|B(s, k) -> I|B(s, k-1)   (one sequence's chunks)
//! rank:     each rank's entries in program order
//! link:     transfers on one ordered rank pair in the order the sender issues them (FIFO)
//! ```
//!
//! [`Dag::replay_makespan_ns`] computes start times by longest path in topological order;
//! [`crate::replay::replay`] computes the same without building the graph and is what the
//! simulator uses (the tests check both agree). A cycle means the schedule deadlocks:
//! [`deadlock_error`] names the ops on one.

use crate::Error;
use crate::costs::CostModel;
use crate::ir::{Action, ActionKind, ComputeAction, Schedule, StageId};
use petgraph::Direction;
use petgraph::algo::toposort;
use petgraph::graph::{DiGraph, NodeIndex};
use std::collections::HashMap;

/// A node of the DAG.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum DagNode {
    /// Entry `pos` of `rank`'s action list.
    Compute {
        /// The rank.
        rank: u32,
        /// Position in its action list.
        pos: u32,
        /// The action or pair.
        action: Action,
    },
    /// The transfer that `action` (on rank `from`) sends to rank `to`.
    Transfer {
        /// Sender.
        from: u32,
        /// Receiver.
        to: u32,
        /// The sending action.
        action: ComputeAction,
    },
}

impl std::fmt::Display for DagNode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DagNode::Compute { rank, action, .. } => write!(f, "rank {rank}: {action}"),
            DagNode::Transfer { from, to, action } => {
                let dir = if matches!(action.kind, ActionKind::F | ActionKind::Fo) {
                    "F"
                } else {
                    "B"
                };
                write!(
                    f,
                    "{}SEND_{dir}{} (rank {from} -> rank {to})",
                    action.stage, action.microbatch
                )
            }
        }
    }
}

/// The dependency DAG of one step of a schedule.
#[derive(Debug, Clone)]
pub struct Dag {
    /// The graph; edge weights are unused.
    pub graph: DiGraph<DagNode, ()>,
}

impl Dag {
    /// Builds the DAG of `schedule` (which should have passed [`Schedule::validate`]).
    pub fn build(schedule: &Schedule) -> Self {
        let s_count = schedule.num_stages() as usize;
        let m = schedule.num_microbatches as usize;
        let mfo = schedule.num_fo_microbatches as usize;
        let n = schedule.ranks.iter().map(Vec::len).sum::<usize>();
        let mut g = DiGraph::with_capacity(2 * n, 4 * n);
        let none = NodeIndex::end();
        let mut f_node = vec![none; s_count * m];
        let mut i_node = vec![none; s_count * m];
        let mut bwd_node = vec![none; s_count * m];
        let mut entries = Vec::with_capacity(schedule.ranks.len());
        for (r, actions) in schedule.ranks.iter().enumerate() {
            let mut ids = Vec::with_capacity(actions.len());
            for (pos, &action) in actions.iter().enumerate() {
                let id = g.add_node(DagNode::Compute {
                    rank: r as u32,
                    pos: pos as u32,
                    action,
                });
                for a in action.parts() {
                    let k = a.stage.idx() * m + a.microbatch.idx();
                    match a.kind {
                        ActionKind::F => f_node[k] = id,
                        ActionKind::I => {
                            i_node[k] = id;
                            bwd_node[k] = id;
                        }
                        ActionKind::B => bwd_node[k] = id,
                        _ => {}
                    }
                }
                if let Some(&prev) = ids.last() {
                    g.add_edge(prev, id, ());
                }
                ids.push(id);
            }
            entries.push(ids);
        }
        // Transfers, in each sender's program order; arrival nodes of activations / gradients.
        let mut act_arrival = vec![none; s_count * m];
        let mut grad_arrival = vec![none; s_count * m];
        let mut fo_arrival = vec![none; s_count * mfo];
        let mut last_on_link: HashMap<(u32, u32), NodeIndex> = HashMap::new();
        for (r, actions) in schedule.ranks.iter().enumerate() {
            for (pos, action) in actions.iter().enumerate() {
                let id = entries[r][pos];
                for a in action.parts() {
                    let Some(target) = a.sends(s_count as u32).map(StageId::idx) else {
                        continue;
                    };
                    let mb = a.microbatch.idx();
                    let slot = match a.kind {
                        ActionKind::F => &mut act_arrival[target * m + mb],
                        ActionKind::Fo => &mut fo_arrival[target * mfo + mb],
                        _ => &mut grad_arrival[target * m + mb],
                    };
                    let to = schedule.placement.rank_of[target].0;
                    if to == r as u32 {
                        *slot = id;
                        continue;
                    }
                    let t = g.add_node(DagNode::Transfer {
                        from: r as u32,
                        to,
                        action: a,
                    });
                    *slot = t;
                    g.add_edge(id, t, ());
                    if let Some(prev) = last_on_link.insert((r as u32, to), t) {
                        g.add_edge(prev, t, ());
                    }
                }
            }
        }
        // Data edges into each compute entry.
        for (r, actions) in schedule.ranks.iter().enumerate() {
            for (pos, action) in actions.iter().enumerate() {
                let id = entries[r][pos];
                for a in action.parts() {
                    let (s, mb) = (a.stage.idx(), a.microbatch.idx());
                    let k = s * m + mb;
                    let receives = a.receives(s_count as u32).is_some();
                    let preds = match a.kind {
                        ActionKind::F => [receives.then(|| act_arrival[k]), None],
                        ActionKind::Fo => [receives.then(|| fo_arrival[s * mfo + mb]), None],
                        ActionKind::I | ActionKind::B => {
                            [Some(f_node[k]), receives.then(|| grad_arrival[k])]
                        }
                        ActionKind::W => [Some(i_node[k]), None],
                    };
                    for p in preds.into_iter().flatten().filter(|p| *p != none) {
                        g.add_edge(p, id, ());
                    }
                }
            }
        }
        // Chunk edges: on each stage, chunk k's F after chunk k-1's, chunk k-1's backward
        // after chunk k's.
        for chain in &schedule.chunks {
            for pair in chain.windows(2) {
                let (a, b) = (pair[0].idx(), pair[1].idx());
                if a >= m || b >= m {
                    continue;
                }
                for s in 0..s_count {
                    for (from, to) in [
                        (f_node[s * m + a], f_node[s * m + b]),
                        (bwd_node[s * m + b], bwd_node[s * m + a]),
                    ] {
                        if from != none && to != none {
                            g.add_edge(from, to, ());
                        }
                    }
                }
            }
        }
        Dag { graph: g }
    }

    /// The makespan (ns) by longest path in topological order, with durations from `costs`
    /// (optimizer steps excluded). `None` if the graph has a cycle.
    pub fn replay_makespan_ns<C: CostModel>(&self, costs: &C) -> Option<u64> {
        let order = toposort(&self.graph, None).ok()?;
        let mut end = vec![0u64; self.graph.node_count()];
        let mut makespan = 0;
        for n in order {
            let start = self
                .graph
                .neighbors_directed(n, Direction::Incoming)
                .map(|p| end[p.index()])
                .max()
                .unwrap_or(0);
            let dur = match self.graph[n] {
                DagNode::Compute {
                    action: Action::Compute(a),
                    ..
                } => costs.compute_ns(a),
                DagNode::Compute {
                    action: Action::Overlap(a, b),
                    ..
                } => costs.overlap_ns(a, b),
                DagNode::Transfer { action, .. } => {
                    costs.comm_ns(action.stage, action.microbatch, action.kind)
                }
            };
            end[n.index()] = start + dur;
            makespan = makespan.max(start + dur);
        }
        Some(makespan)
    }

    /// One dependency cycle, as the nodes on it in order, if the graph has one. Iterative
    /// (no recursion, so deep graphs are fine): Kahn's algorithm removes every node not
    /// downstream of a cycle; every remaining node has a remaining predecessor, so walking
    /// predecessors from any of them must repeat a node, and the walk between the repeats is a
    /// cycle.
    pub fn find_cycle(&self) -> Option<Vec<DagNode>> {
        let g = &self.graph;
        let mut indeg: Vec<u32> = vec![0; g.node_count()];
        for e in g.raw_edges() {
            indeg[e.target().index()] += 1;
        }
        let mut stack: Vec<NodeIndex> =
            g.node_indices().filter(|n| indeg[n.index()] == 0).collect();
        let mut removed = vec![false; g.node_count()];
        while let Some(u) = stack.pop() {
            removed[u.index()] = true;
            for v in g.neighbors_directed(u, Direction::Outgoing) {
                indeg[v.index()] -= 1;
                if indeg[v.index()] == 0 {
                    stack.push(v);
                }
            }
        }
        let start = g.node_indices().find(|n| !removed[n.index()])?;
        let mut seen_at: HashMap<NodeIndex, usize> = HashMap::new();
        let mut walk = Vec::new();
        let mut v = start;
        loop {
            if let Some(&i) = seen_at.get(&v) {
                let mut cycle: Vec<DagNode> = walk[i..].iter().map(|n: &NodeIndex| g[*n]).collect();
                cycle.reverse();
                return Some(cycle);
            }
            seen_at.insert(v, walk.len());
            walk.push(v);
            v = g
                .neighbors_directed(v, Direction::Incoming)
                .find(|p| !removed[p.index()])?;
        }
    }
}

/// The [`Error::Deadlock`] of a schedule that cannot finish, naming the ops on one cycle.
pub fn deadlock_error(schedule: &Schedule) -> Error {
    let cycle = Dag::build(schedule)
        .find_cycle()
        .map(|c| c.iter().map(ToString::to_string).collect())
        .unwrap_or_else(|| vec!["(no cycle found; the schedule is incomplete)".into()]);
    Error::Deadlock {
        schedule: schedule.name.clone(),
        cycle,
    }
}
