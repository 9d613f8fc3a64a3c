//! The step's dependency DAG as a petgraph graph.
//!
//! Nodes are compute entries (an action or an overlapped pair, on its rank) and transfers
//! (derived from the placement: one after every F / Fo whose next stage is on another rank,
//! one after every I / B whose previous stage is). Edges:
//!
//! ```text
//! data:     F(s) -> [send] -> F(s+1)      I|B(s+1) -> [send] -> I|B(s)
//!           F(s) -> I|B(s)                I(s) -> W(s)          Fo(s) -> [send] -> Fo(s+1)
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
use crate::ir::{Action, ActionKind, ComputeAction, Schedule};
use petgraph::Direction;
use petgraph::algo::{tarjan_scc, toposort};
use petgraph::graph::{DiGraph, NodeIndex};
use std::collections::{HashMap, VecDeque};

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
                        ActionKind::I => i_node[k] = id,
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
                    let (s, mb) = (a.stage.idx(), a.microbatch.idx());
                    let (target, slot) = match a.kind {
                        ActionKind::F if s + 1 < s_count => {
                            (s + 1, &mut act_arrival[(s + 1) * m + mb])
                        }
                        ActionKind::Fo if s + 1 < s_count => {
                            (s + 1, &mut fo_arrival[(s + 1) * mfo + mb])
                        }
                        ActionKind::I | ActionKind::B if s > 0 => {
                            (s - 1, &mut grad_arrival[(s - 1) * m + mb])
                        }
                        _ => continue,
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
                    let preds = match a.kind {
                        ActionKind::F => [(s > 0).then(|| act_arrival[k]), None],
                        ActionKind::Fo => [(s > 0).then(|| fo_arrival[s * mfo + mb]), None],
                        ActionKind::I | ActionKind::B => {
                            [Some(f_node[k]), (s + 1 < s_count).then(|| grad_arrival[k])]
                        }
                        ActionKind::W => [Some(i_node[k]), None],
                    };
                    for p in preds.into_iter().flatten().filter(|p| *p != none) {
                        g.add_edge(p, id, ());
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

    /// One dependency cycle, as the nodes on it in order, if the graph has one.
    pub fn find_cycle(&self) -> Option<Vec<DagNode>> {
        let start = match toposort(&self.graph, None) {
            Ok(_) => return None,
            Err(c) => c.node_id(),
        };
        let scc = tarjan_scc(&self.graph)
            .into_iter()
            .find(|c| c.contains(&start))?;
        let in_scc: std::collections::HashSet<NodeIndex> = scc.into_iter().collect();
        // Shortest path start -> ... -> start inside the component (BFS).
        let mut parent: HashMap<NodeIndex, NodeIndex> = HashMap::new();
        let mut queue = VecDeque::from([start]);
        while let Some(u) = queue.pop_front() {
            for v in self.graph.neighbors_directed(u, Direction::Outgoing) {
                if !in_scc.contains(&v) {
                    continue;
                }
                if v == start {
                    let mut path = vec![u];
                    let mut x = u;
                    while x != start {
                        x = parent[&x];
                        path.push(x);
                    }
                    path.reverse();
                    return Some(path.into_iter().map(|n| self.graph[n]).collect());
                }
                if let std::collections::hash_map::Entry::Vacant(e) = parent.entry(v) {
                    e.insert(u);
                    queue.push_back(v);
                }
            }
        }
        None
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
