//! Reads PyTorch profiler (Kineto / Chrome JSON) traces of a pipelined training run into a
//! measured [`Timeline`] and the [`Schedule`] the ranks actually ran.
//!
//! Pipeline actions are complete events (`"ph": "X"`) named `PP:<action>` in PyTorch's notation
//! (`PP:0F1`, `PP:3I0`, `PP:2W1`, `PP:1B0`, `PP:(0F3;1B2)OVERLAP_F_B`), e.g. from
//! `torch.profiler.record_function(f"PP:{action}")` around each action. `ts` and `dur` are
//! microseconds. When GPU-side annotations are present (`"cat": "gpu_user_annotation"`) only
//! they are used (device time); otherwise the CPU-side ones, with a warning. PyTorch's runtime
//! (2.15) also labels its other actions `PP:` (`0SEND_F1`, `2RECV_B0`, `0UNSHARD`,
//! `2WAIT_SEND_F0`, `0REDUCE_GRAD`, ...): they go on each rank's comm lane
//! ([`Timeline::comm`]) with their spans, and can be compared with flatpipe's lowering of the
//! schedule ([`ImportedTrace::posting_difference`], [`ImportedTrace::program`]). An action's busy time
//! starts at its first nested event on the same thread, because torch's runtime waits for the
//! action's input inside the action's span and records no event for the wait (a real
//! `PP:1F0` spanned 1,969 us with its first operator 1,486 us in). A trace of several steps is
//! cut where a rank's actions repeat; one step is imported ([`ImportOptions::step`]).
//!
//! Ranks: with several files, file k is rank k (PyTorch writes one trace per rank); with one
//! file, each distinct `pid` is a rank, in increasing order. Times are taken relative to the
//! earliest action of all ranks, so the ranks' clocks must agree (one node, or synchronised).
//! Events of one rank must not overlap.

use crate::ir::comm::LoweredAction;
use crate::ir::lowering::RecvPosting;
use crate::ir::{Action, Schedule};
use crate::replay::timeline::{TimedComm, TimedOp, Timeline};
use crate::{Error, Result};
use serde_json::Value;
use std::collections::BTreeMap;

/// An input error naming the file (or rank), the field or event, the value and what is allowed.
fn bad(
    origin: impl AsRef<str>,
    field: impl AsRef<str>,
    value: impl ToString,
    allowed: &str,
) -> Error {
    Error::invalid(
        format!("{}: {}", origin.as_ref(), field.as_ref()),
        value,
        allowed,
    )
}

/// The text of a trace file; `.gz` files (as torch's TensorBoard handler writes them) are
/// decompressed.
///
/// # Errors
/// [`Error::InvalidArgument`] naming the file when it cannot be read or is not gzip-compressed
/// UTF-8; the profiles crate's read error for a plain file.
pub fn read_trace_file(path: &std::path::Path) -> Result<String> {
    if path.extension().is_none_or(|e| e != "gz") {
        return Ok(flatpipe_profiles::read_to_string(path)?);
    }
    let name = path.display().to_string();
    let bytes = std::fs::read(path).map_err(|e| bad(&name, "file", e, "a readable trace file"))?;
    let mut text = String::new();
    std::io::Read::read_to_string(&mut flate2::read::GzDecoder::new(&bytes[..]), &mut text)
        .map_err(|e| bad(&name, "gzip", e, "a gzip-compressed UTF-8 trace"))?;
    Ok(text)
}

/// What to read of a trace.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ImportOptions {
    /// The training step to import, 0-based, of a trace that holds several (`None`: the last,
    /// the warmest).
    pub step: Option<usize>,
}

/// A trace read back: what ran where and when, and the schedule that was.
#[derive(Debug, Clone)]
pub struct ImportedTrace {
    /// Measured timeline of the imported step (ns from its first action), one row per rank:
    /// each action from its first nested operator to its end (see the module documentation).
    pub timeline: Timeline,
    /// The ranks' action lists in time order, as a schedule (placement inferred).
    pub schedule: Schedule,
    /// Steps the trace holds (a step ends where a rank's actions start repeating).
    pub steps: usize,
    /// The step imported, 0-based.
    pub step: usize,
    /// Per rank: the time between its actions' starts and their first nested operators, ns
    /// (the waits for inputs that torch records inside the action's span; not busy time).
    pub leading_wait_ns: Vec<u64>,
    /// `PP:` events that are not compute actions (sends, receives, waits, FSDP's unshard and
    /// reshard, gradient reduction), by label without stage and microbatch, with their counts
    /// over all steps. Those PyTorch names are on the comm lanes ([`Timeline::comm`]).
    pub other_events: BTreeMap<String, usize>,
    /// What the user should know about the reading: CPU-side annotations only, files that name
    /// another rank than their position, the steps skipped.
    pub warnings: Vec<String>,
    /// Per rank, per action of [`ImportedTrace::timeline`] (same order): what ran inside its
    /// span on its thread (CPU-side annotations; empty counts for GPU-side ones).
    pub nested: Vec<Vec<NestedEvents>>,
}

/// Where a trace's point-to-point actions first differ from a lowering of the schedule it ran
/// ([`ImportedTrace::posting_difference`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PostingDifference {
    /// The rank.
    pub rank: usize,
    /// Position among the rank's sends, receives and send waits, 0-based.
    pub index: usize,
    /// The lowering's action there (`None`: the lowering has no more).
    pub lowered: Option<LoweredAction>,
    /// The trace's action there (`None`: the trace has no more).
    pub recorded: Option<LoweredAction>,
}

impl ImportedTrace {
    /// Per rank, every `PP:` action of the imported step in start order: its compute actions
    /// and its communication (the program the rank ran, as PyTorch's runtime lowered it).
    pub fn program(&self) -> Vec<Vec<LoweredAction>> {
        let t = &self.timeline;
        (0..t.num_ranks())
            .map(|r| {
                let mut all: Vec<(u64, LoweredAction)> = t.compute[r]
                    .iter()
                    .map(|o| (o.start_ns, LoweredAction::Compute(o.action)))
                    .chain(
                        t.comm
                            .get(r)
                            .into_iter()
                            .flatten()
                            .map(|c| (c.start_ns, c.action)),
                    )
                    .collect();
                all.sort_by_key(|e| e.0);
                all.into_iter().map(|e| e.1).collect()
            })
            .collect()
    }

    /// Compares each rank's point-to-point actions in the imported step (sends, receives and
    /// send waits, in start order; FSDP's actions are left out) with the program
    /// [`crate::ir::lowering::sweep`] gives the imported schedule under `posting`: `None` when
    /// they are the same actions in the same order on every rank, else the first difference
    /// (lowest rank first). PyTorch 2.15's runtime posts in [`RecvPosting::Ahead`]'s order
    /// by default (`_add_send_recv`), in [`RecvPosting::Deferred`]'s with `defer_pp_recv`.
    ///
    /// # Errors
    /// As [`crate::ir::lowering::sweep`] (a schedule whose inputs are never sent).
    pub fn posting_difference(&self, posting: RecvPosting) -> Result<Option<PostingDifference>> {
        let p2p =
            |a: &LoweredAction| matches!(a, LoweredAction::Comm(_) | LoweredAction::WaitSend(_));
        let mut lowered: Vec<Vec<LoweredAction>> = vec![Vec::new(); self.schedule.ranks.len()];
        crate::ir::lowering::sweep(&self.schedule, posting, |r, a| {
            if p2p(&a) {
                lowered[r].push(a);
            }
        })?;
        for (rank, want) in lowered.iter().enumerate() {
            let got: Vec<LoweredAction> = self.timeline.comm.get(rank).map_or(Vec::new(), |v| {
                v.iter().map(|c| c.action).filter(p2p).collect()
            });
            let n = want.len().max(got.len());
            if let Some(index) = (0..n).find(|&i| want.get(i) != got.get(i)) {
                return Ok(Some(PostingDifference {
                    rank,
                    index,
                    lowered: want.get(index).copied(),
                    recorded: got.get(index).copied(),
                }));
            }
        }
        Ok(None)
    }
}

/// The events recorded inside one action's span on its thread.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct NestedEvents {
    /// Events (operators and their children) the profiler recorded in the span: each cost
    /// the profiler its own overhead, which the run without the profiler does not pay.
    pub events: u32,
    /// Time in torch.distributed's calls (events named `c10d::...`: posting `isend`/`irecv`,
    /// or a blocking `send`/`recv`), ns.
    pub comm_ns: u64,
}

/// A non-`PP:` event on a thread: (start us, duration us, whether it is a `c10d::` call).
type Op = (f64, f64, bool);

/// A `PP:` event that is a communication action (a send, receive, wait or FSDP action).
struct CommEvent {
    rank: usize,
    action: LoweredAction,
    ts_us: f64,
    dur_us: f64,
}

struct Event {
    rank: usize,
    action: Action,
    ts_us: f64,
    dur_us: f64,
    /// Start of the first event nested in this one on the same thread (an operator), us.
    first_nested_us: Option<f64>,
    nested: NestedEvents,
}

/// The `"ph": "X"` events of one file, and its `distributedInfo.rank` when the trace has one.
fn events_of(doc: &Value, origin: &str) -> Result<(Vec<Value>, Option<u64>)> {
    let list = match doc {
        Value::Array(a) => a,
        Value::Object(o) => o
            .get("traceEvents")
            .and_then(Value::as_array)
            .ok_or_else(|| bad(origin, "traceEvents", "missing", "a Chrome / Kineto trace: an object with a traceEvents array, or an array of events"))?,
        _ => {
            return Err(bad(
                origin,
                "top level",
                "not an object or array",
                "a Chrome / Kineto trace",
            ));
        }
    };
    let rank = doc
        .get("distributedInfo")
        .and_then(|d| d.get("rank"))
        .and_then(Value::as_u64);
    Ok((
        list.iter()
            .filter(|e| e.get("ph").and_then(Value::as_str) == Some("X"))
            .cloned()
            .collect(),
        rank,
    ))
}

/// Whether a `PP:` label that is not a compute action is one of PyTorch's other pipeline
/// actions (`torch/distributed/pipelining/schedules.py`, `_ComputationType`): `0SEND_F1`,
/// `2RECV_B0`, `0UNSHARD`, `1RESHARD`, `0REDUCE_GRAD`, `2WAIT_SEND_F0`, ... (and flatpipe's
/// runtime's receive waits, named like PyTorch's receives). Returns the label without stage
/// and microbatch.
fn other_action(label: &str) -> Option<String> {
    let core = label
        .trim_start_matches(|c: char| c.is_ascii_digit())
        .trim_end_matches(|c: char| c.is_ascii_digit());
    let known = ["SEND", "RECV", "SHARD", "WAIT", "REDUCE"];
    (!core.is_empty()
        && core.len() < label.len()
        && core.chars().all(|c| c.is_ascii_uppercase() || c == '_')
        && known.iter().any(|k| core.contains(k)))
    .then(|| core.to_string())
}

fn id_of(e: &Value, field: &str) -> String {
    match e.get(field) {
        Some(Value::String(s)) => s.clone(),
        Some(v) => v.to_string(),
        None => String::new(),
    }
}

/// Parses one or more trace files (`(origin, text)`; several files = one per rank, in rank
/// order) and imports one step ([`ImportOptions::step`]).
///
/// Compute actions are the `PP:` events whose label is an action (`0F1`, `3I0`, `2W1`, `1B0`,
/// an overlapped pair); PyTorch's other `PP:` events (sends, receives, waits, unshard, reshard,
/// gradient reduction) are counted in [`ImportedTrace::other_events`] and put on the step's
/// comm lanes (those between two steps go with the step before, but a receive or an unshard
/// with the step it leads). A
/// CPU-side compute action's busy time runs from its first nested event on the same thread
/// (torch's first operator) to its end (a GPU-side span is taken whole: it runs from its first
/// kernel to its last): in PyTorch's runtime the wait for the action's input happens
/// inside its span and torch records no event for it. What that misses: work before the first
/// operator (Python only), and, on a GPU, everything: CPU-side spans time the launches, not the
/// kernels (a warning says so when only CPU-side annotations exist).
///
/// # Errors
/// [`Error::InvalidArgument`] naming the file and event for malformed JSON, a trace without
/// `PP:` compute actions (saying how to get them), an unknown `PP:` label, missing `ts` / `dur`,
/// overlapping actions on one rank, ranks with different step counts, or a step out of range;
/// [`Error::InvalidSchedule`] when the step's actions do not form a valid schedule.
pub fn read_traces(files: &[(String, String)], opts: &ImportOptions) -> Result<ImportedTrace> {
    if files.is_empty() {
        return Err(Error::invalid("trace files", "none", ">= 1 file"));
    }
    let mut warnings = Vec::new();
    let mut raw = RawEvents::parse(files, &mut warnings)?;
    let gpu = raw.keep_gpu_side(&mut warnings);
    let names = files
        .iter()
        .map(|f| f.0.as_str())
        .collect::<Vec<_>>()
        .join(", ");
    let (events, comm_events, other_events) = raw.actions(files.len() > 1, gpu)?;
    if events.is_empty() {
        return Err(no_compute_actions(names, &other_events));
    }
    let per_rank = split_steps(&events);
    let (steps, step) = choose_step(&per_rank, opts, &names, &mut warnings)?;
    let chosen: Vec<&Vec<&Event>> = per_rank.iter().map(|v| &v[step]).collect();
    let chosen_comm = comm_of_step(&per_rank, &comm_events, step);
    let measured = StepTimeline::of(&chosen, &chosen_comm)?;
    check_dependencies(&measured.compute)?;
    let schedule = schedule_of(&measured.compute, files)?;
    let ranks = measured.compute.len();
    Ok(ImportedTrace {
        timeline: Timeline {
            compute: measured.compute,
            transfers: Vec::new(),
            optimizer: vec![None; ranks],
            comm: measured.comm,
        },
        schedule,
        steps,
        step,
        leading_wait_ns: measured.leading_wait_ns,
        other_events,
        warnings,
        nested: measured.nested,
    })
}

/// The events of every file: the `PP:` events, and every other event by thread for the
/// nested-operator lookup.
struct RawEvents {
    /// (file index, event, origin) of each `PP:` event, in file order.
    pp: Vec<(usize, Value, String)>,
    /// Per (file index, pid, tid): the thread's other events, sorted by start.
    ops: BTreeMap<(usize, String, String), Vec<Op>>,
}

impl RawEvents {
    /// Parses `files` (`(origin, text)`), warning in `warnings` when a file of several names
    /// another rank than its position.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming the file for malformed JSON or a document that is not
    /// a Chrome / Kineto trace.
    fn parse(files: &[(String, String)], warnings: &mut Vec<String>) -> Result<Self> {
        let mut raw = RawEvents {
            pp: Vec::new(),
            ops: BTreeMap::new(),
        };
        // The previous file's global rank: the pipeline ranks of one data-parallel replica
        // (global ranks 0 and 2 of a pp 2 x dp 2 mesh) come in increasing order, not always
        // 0, 1, ...
        let mut previous: Option<u64> = None;
        for (k, (origin, text)) in files.iter().enumerate() {
            let doc: Value = serde_json::from_str(text)
                .map_err(|e| bad(origin, "JSON", e, "a JSON trace file"))?;
            let (events, rank) = events_of(&doc, origin)?;
            if files.len() > 1
                && let Some(r) = rank
            {
                if previous.is_some_and(|p| r <= p) {
                    warnings.push(format!(
                        "{origin} is file {k} of {} but its trace says rank {r} (distributedInfo.rank), after rank {} in the file before: files are taken as pipeline ranks in the order given, so give them in rank order",
                        files.len(),
                        previous.unwrap_or_default()
                    ));
                }
                previous = Some(r);
            }
            for e in events {
                let name = e.get("name").and_then(Value::as_str).unwrap_or_default();
                if name.starts_with("PP:") {
                    raw.pp.push((k, e, origin.clone()));
                } else if let Some(ts) = e.get("ts").and_then(Value::as_f64) {
                    let dur = e.get("dur").and_then(Value::as_f64).unwrap_or(0.0);
                    raw.ops
                        .entry((k, id_of(&e, "pid"), id_of(&e, "tid")))
                        .or_default()
                        .push((ts, dur, name.starts_with("c10d::")));
                }
            }
        }
        for v in raw.ops.values_mut() {
            v.sort_by(|a, b| a.0.total_cmp(&b.0));
        }
        Ok(raw)
    }

    /// Keeps only the GPU-side `PP:` events (`gpu_user_annotation`) when there are any, and
    /// says whether there were; else warns that the CPU-side spans time the CPU.
    fn keep_gpu_side(&mut self, warnings: &mut Vec<String>) -> bool {
        let is_gpu =
            |e: &Value| e.get("cat").and_then(Value::as_str) == Some("gpu_user_annotation");
        let gpu = self.pp.iter().any(|(_, e, _)| is_gpu(e));
        if gpu {
            self.pp.retain(|(_, e, _)| is_gpu(e));
        } else if !self.pp.is_empty() {
            warnings.push(
                "only CPU-side annotations (user_annotation): their spans time what the CPU did; on a GPU the kernels' time is what matters, so profile with ProfilerActivity.CUDA to get gpu_user_annotation events".to_string(),
            );
        }
        gpu
    }

    /// The rank of each `pid` of a single file, in increasing (numeric, then text) order.
    fn pid_ranks(&self) -> BTreeMap<(u64, String), usize> {
        let mut pids: Vec<(u64, String)> = self
            .pp
            .iter()
            .map(|(_, e, _)| {
                let p = id_of(e, "pid");
                (p.parse::<u64>().unwrap_or(u64::MAX), p)
            })
            .collect();
        pids.sort();
        pids.dedup();
        pids.into_iter().enumerate().map(|(i, p)| (p, i)).collect()
    }

    /// The compute actions among the `PP:` events (ranks: the file index when
    /// `several_files`, else the pid's order), with what ran inside each CPU-side span (none
    /// when `gpu`); and the other `PP:` labels, without stage and microbatch, with their
    /// counts.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming the file and event for an unknown `PP:` label or a
    /// missing or negative `ts` / `dur`.
    fn actions(&self, several_files: bool, gpu: bool) -> Result<Actions> {
        let pid_rank = self.pid_ranks();
        let mut other_events: BTreeMap<String, usize> = BTreeMap::new();
        let mut events = Vec::with_capacity(self.pp.len());
        let mut comm = Vec::new();
        for (k, e, origin) in &self.pp {
            let name = e["name"].as_str().unwrap_or_default();
            let text = &name[3..];
            let rank = if several_files {
                *k
            } else {
                let p = id_of(e, "pid");
                pid_rank[&(p.parse::<u64>().unwrap_or(u64::MAX), p)]
            };
            let action: Action = match text.parse() {
                Ok(a) => a,
                Err(err) => {
                    let Some(label) = other_action(text) else {
                        return Err(bad(
                            origin,
                            format!("event {name}"),
                            err,
                            "PP:<stage><F|I|W|B><microbatch>, PP:(..;..)OVERLAP_F_B, or one of PyTorch's other pipeline actions (SEND_F, RECV_B, UNSHARD, WAIT_..., REDUCE_GRAD)",
                        ));
                    };
                    *other_events.entry(label).or_default() += 1;
                    if let Ok(action) = text.parse::<LoweredAction>() {
                        let (ts_us, dur_us) = span_of(e, origin)?;
                        comm.push(CommEvent {
                            rank,
                            action,
                            ts_us,
                            dur_us,
                        });
                    }
                    continue;
                }
            };
            events.push(self.event(*k, e, origin, rank, action, gpu)?);
        }
        Ok((events, comm, other_events))
    }

    /// The [`Event`] of compute action `action` on `rank`, from the `PP:` event `e` of file
    /// `k`: its span, us, and what its thread ran inside it (nothing for a GPU-side span, which
    /// runs from its first kernel to its last already).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming the file and event for a missing, negative or
    /// non-finite `ts` / `dur`.
    fn event(
        &self,
        k: usize,
        e: &Value,
        origin: &str,
        rank: usize,
        action: Action,
        gpu: bool,
    ) -> Result<Event> {
        let (ts_us, dur_us) = span_of(e, origin)?;
        let inside: &[Op] = self
            .ops
            .get(&(k, id_of(e, "pid"), id_of(e, "tid")))
            .filter(|_| !gpu)
            .map_or(&[], |v| {
                let i = v.partition_point(|o| o.0 < ts_us);
                let j = v.partition_point(|o| o.0 <= ts_us + dur_us);
                &v[i..j]
            });
        let first_nested_us = inside.first().map(|o| o.0);
        // c10d calls do not nest in one another (their gloo:/nccl: children are not c10d::).
        let comm_us: f64 = inside.iter().filter(|o| o.2).map(|o| o.1).sum();
        Ok(Event {
            rank,
            action,
            ts_us,
            dur_us,
            first_nested_us,
            nested: NestedEvents {
                events: u32::try_from(inside.len()).unwrap_or(u32::MAX),
                comm_ns: (comm_us * 1e3).round() as u64,
            },
        })
    }
}

/// The compute actions, the communication actions and the other `PP:` labels' counts of a
/// trace ([`RawEvents::actions`]).
type Actions = (Vec<Event>, Vec<CommEvent>, BTreeMap<String, usize>);

/// The span (`ts`, `dur`, us) of event `e` of file `origin`.
///
/// # Errors
/// [`Error::InvalidArgument`] naming the file and event for a missing, negative or non-finite
/// `ts` / `dur`.
fn span_of(e: &Value, origin: &str) -> Result<(f64, f64)> {
    let name = e["name"].as_str().unwrap_or_default();
    let num = |field: &str| -> Result<f64> {
        e.get(field)
            .and_then(Value::as_f64)
            .filter(|x| x.is_finite() && *x >= 0.0)
            .ok_or_else(|| {
                bad(
                    origin,
                    format!("event {name}: {field}"),
                    e.get(field).map_or("missing".into(), |v| v.to_string()),
                    "microseconds >= 0",
                )
            })
    };
    Ok((num("ts")?, num("dur")?))
}

/// Per rank, the communication events of step `step` of `per_rank` (the compute events split
/// into steps), in start order. An event belongs to the step whose first compute action
/// starts at or before it; one in the gap after a step's last compute action that leads the
/// next step's work (a receive, an unshard) belongs to the next step, as PyTorch's lowering
/// posts them before the compute that needs them.
fn comm_of_step<'a>(
    per_rank: &[Vec<Vec<&Event>>],
    comm: &'a [CommEvent],
    step: usize,
) -> Vec<Vec<&'a CommEvent>> {
    let mut out: Vec<Vec<&CommEvent>> = vec![Vec::new(); per_rank.len()];
    for c in comm {
        let Some(steps) = per_rank.get(c.rank) else {
            continue;
        };
        let first = |k: usize| steps[k].first().map_or(f64::INFINITY, |e| e.ts_us);
        let last_end = |k: usize| steps[k].last().map_or(0.0, |e| e.ts_us + e.dur_us);
        let mut k = (0..steps.len())
            .rev()
            .find(|&k| first(k) <= c.ts_us)
            .unwrap_or(0);
        let leads = matches!(
            c.action,
            LoweredAction::Comm(crate::ir::comm::CommAction::Recv(_))
                | LoweredAction::Fsdp(_, crate::ir::comm::FsdpAction::Unshard)
        );
        if leads && k + 1 < steps.len() && c.ts_us >= last_end(k) {
            k += 1;
        }
        if k == step {
            out[c.rank].push(c);
        }
    }
    for v in &mut out {
        v.sort_by(|a, b| a.ts_us.total_cmp(&b.ts_us));
    }
    out
}

/// The error for traces (`names`) without a `PP:` compute action, saying how to get them.
fn no_compute_actions(names: String, other_events: &BTreeMap<String, usize>) -> Error {
    bad(
        names,
        "traceEvents",
        if other_events.is_empty() {
            "no `PP:` events".to_string()
        } else {
            format!("`PP:` events but no compute action among them ({other_events:?})")
        },
        "complete events (ph X) named PP:<action> (PP:0F1, PP:1I0, ...) around each pipeline action: PyTorch's ScheduleGPipe and Schedule1F1B record none, its multi-stage schedules (ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble, _PipelineScheduleRuntime) and flatpipe.torch's runtime do; or wrap your own with torch.profiler.record_function(f\"PP:{action}\")",
    )
}

/// Per rank, per step, the rank's events in time order (sorts `events` by rank, then start):
/// a rank's step ends where an action it already ran comes again.
fn split_steps(events: &[Event]) -> Vec<Vec<Vec<&Event>>> {
    let ranks = events.iter().map(|e| e.rank).max().unwrap_or(0) + 1;
    let mut sorted: Vec<&Event> = events.iter().collect();
    sorted.sort_by(|a, b| a.rank.cmp(&b.rank).then(a.ts_us.total_cmp(&b.ts_us)));
    let mut per_rank: Vec<Vec<Vec<&Event>>> = vec![vec![Vec::new()]; ranks];
    let mut seen: Vec<std::collections::HashSet<String>> =
        vec![std::collections::HashSet::new(); ranks];
    for e in sorted {
        let key = e.action.to_string();
        if !seen[e.rank].insert(key.clone()) {
            seen[e.rank].clear();
            seen[e.rank].insert(key);
            per_rank[e.rank].push(Vec::new());
        }
        per_rank[e.rank].last_mut().expect("a step").push(e);
    }
    per_rank
}

/// The trace's step count and the step to import ([`ImportOptions::step`], else the last),
/// with a warning in `warnings` when the trace holds several.
///
/// # Errors
/// [`Error::InvalidArgument`] naming the traces (`names`) when the ranks' step counts differ
/// or the step is out of range.
fn choose_step(
    per_rank: &[Vec<Vec<&Event>>],
    opts: &ImportOptions,
    names: &str,
    warnings: &mut Vec<String>,
) -> Result<(usize, usize)> {
    let steps = per_rank[0].len();
    if let Some((r, v)) = per_rank.iter().enumerate().find(|(_, v)| v.len() != steps) {
        return Err(bad(
            names,
            format!("rank {r}"),
            format!("{} steps (rank 0 has {steps})", v.len()),
            "the same number of steps on every rank (a step ends where a rank's actions repeat)",
        ));
    }
    let step = opts.step.unwrap_or(steps - 1);
    if step >= steps {
        return Err(bad(
            names,
            "step",
            step,
            &format!("0..{steps} (the trace holds {steps} steps)"),
        ));
    }
    if steps > 1 {
        warnings.push(format!(
            "the trace holds {steps} steps: step {step} imported{} (choose another by its step number, 0-based)",
            if opts.step.is_none() {
                ", the last"
            } else {
                ""
            }
        ));
    }
    Ok((steps, step))
}

/// The measured timeline of one step, per rank, times in ns from the step's first action.
struct StepTimeline {
    /// Each action from its first nested operator (clamped to its span) to its end.
    compute: Vec<Vec<TimedOp>>,
    /// What ran inside each action's span, same order as `compute`.
    nested: Vec<Vec<NestedEvents>>,
    /// The time between the actions' starts and their first nested operators, summed.
    leading_wait_ns: Vec<u64>,
    /// The communication actions, whole spans.
    comm: Vec<Vec<TimedComm>>,
}

impl StepTimeline {
    /// The timeline of `chosen` (per rank, the step's compute events in time order) and
    /// `comm` (per rank, its communication events), from the step's first `PP:` event.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming the rank and action when an action starts before the
    /// previous one on its rank ends.
    fn of(chosen: &[&Vec<&Event>], comm: &[Vec<&CommEvent>]) -> Result<Self> {
        let ranks = chosen.len();
        let start = |e: &Event| e.first_nested_us.unwrap_or(e.ts_us);
        let t0 = chosen
            .iter()
            .flat_map(|v| v.iter().map(|e| e.ts_us))
            .chain(comm.iter().flatten().map(|c| c.ts_us))
            .fold(f64::INFINITY, f64::min);
        let ns = |us: f64| ((us - t0) * 1e3).round() as u64;
        let mut out = StepTimeline {
            compute: vec![Vec::new(); ranks],
            nested: vec![Vec::new(); ranks],
            leading_wait_ns: vec![0u64; ranks],
            comm: comm
                .iter()
                .map(|v| {
                    v.iter()
                        .map(|c| TimedComm {
                            action: c.action,
                            start_ns: ns(c.ts_us),
                            end_ns: ns(c.ts_us + c.dur_us),
                        })
                        .collect()
                })
                .collect(),
        };
        for (r, evs) in chosen.iter().enumerate() {
            for e in evs.iter() {
                let end_ns = ((e.ts_us + e.dur_us - t0) * 1e3).round() as u64;
                let span_start_ns = ((e.ts_us - t0) * 1e3).round() as u64;
                let start_ns =
                    (((start(e) - t0) * 1e3).round() as u64).clamp(span_start_ns, end_ns);
                out.leading_wait_ns[r] += start_ns - span_start_ns;
                if let Some(prev) = out.compute[r].last()
                    && start_ns < prev.end_ns
                {
                    return Err(bad(
                        format!("rank {r}"),
                        format!("PP:{}", e.action),
                        format!(
                            "starts at {:.1} us, before PP:{} ends at {:.1} us",
                            e.ts_us - t0,
                            prev.action,
                            prev.end_ns as f64 / 1e3
                        ),
                        "one action at a time per rank (no overlapping PP: events)",
                    ));
                }
                out.compute[r].push(TimedOp {
                    action: e.action,
                    start_ns,
                    end_ns,
                });
                out.nested[r].push(e.nested);
            }
        }
        Ok(out)
    }
}

/// Checks that on each rank a stage's microbatch runs F before I or B, and I before W.
///
/// # Errors
/// [`Error::InvalidArgument`] naming the rank and the first action that runs too early.
fn check_dependencies(compute: &[Vec<TimedOp>]) -> Result<()> {
    for (r, ops) in compute.iter().enumerate() {
        let mut seen: std::collections::HashSet<(u32, u32, u8)> = std::collections::HashSet::new();
        for o in ops {
            for a in o.action.parts() {
                let key = |k: u8| (a.stage.0, a.microbatch.0, k);
                let needs = match a.kind {
                    crate::ir::ActionKind::I | crate::ir::ActionKind::B => Some((0, "F")),
                    crate::ir::ActionKind::W => Some((1, "I")),
                    _ => None,
                };
                if let Some((k, what)) = needs
                    && !seen.contains(&key(k))
                {
                    return Err(bad(
                        format!("rank {r}"),
                        format!("PP:{a}"),
                        format!(
                            "runs at {:.1} us before its {what}",
                            o.start_ns as f64 / 1e3
                        ),
                        "each microbatch's F before its I or B, and its I before its W, on a stage",
                    ));
                }
                let k = match a.kind {
                    crate::ir::ActionKind::F => 0,
                    crate::ir::ActionKind::I => 1,
                    crate::ir::ActionKind::B => 1,
                    _ => 2,
                };
                seen.insert(key(k));
            }
        }
    }
    Ok(())
}

/// The ranks' action lists as a schedule, read as PyTorch's CSV (the reader infers and checks
/// the placement), named after the file or the file count.
///
/// # Errors
/// [`Error::InvalidSchedule`] when the actions do not form a valid schedule.
fn schedule_of(compute: &[Vec<TimedOp>], files: &[(String, String)]) -> Result<Schedule> {
    let csv: String = compute
        .iter()
        .map(|ops| {
            ops.iter()
                .map(|o| o.action.to_string())
                .collect::<Vec<_>>()
                .join(",")
        })
        .collect::<Vec<_>>()
        .join("\n");
    let name = if files.len() == 1 {
        files[0].0.clone()
    } else {
        format!("{} trace files", files.len())
    };
    crate::ir::pytorch_csv::read_pytorch_csv(&csv, &name)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(pid: u32, name: &str, ts: f64, dur: f64) -> String {
        format!(
            r#"{{"ph": "X", "cat": "user_annotation", "name": "{name}", "pid": {pid}, "tid": 1, "ts": {ts}, "dur": {dur}}}"#
        )
    }

    #[test]
    fn a_two_rank_trace_becomes_a_timeline_and_a_schedule() {
        let events = [
            ev(7, "PP:0F0", 1000.0, 10.0),
            ev(7, "PP:0F1", 1010.0, 10.0),
            ev(9, "PP:1F0", 1012.0, 10.0),
            ev(9, "PP:1B0", 1022.0, 20.0),
            ev(9, "PP:1F1", 1042.0, 10.0),
            ev(7, "PP:0B0", 1044.0, 20.0),
            ev(9, "PP:1B1", 1052.0, 20.0),
            ev(7, "PP:0B1", 1074.0, 20.0),
            r#"{"ph": "X", "name": "aten::mm", "pid": 7, "ts": 1001, "dur": 3}"#.to_string(),
        ];
        let text = format!(r#"{{"traceEvents": [{}]}}"#, events.join(","));
        let t = read_traces(&[("t.json".into(), text)], &ImportOptions::default()).unwrap();
        assert_eq!(t.timeline.num_ranks(), 2);
        assert_eq!(t.schedule.num_microbatches, 2);
        assert_eq!(t.schedule.num_stages(), 2);
        // Makespan 94 us; rank 0 busy 60 us, rank 1 busy 60 us.
        assert_eq!(t.timeline.makespan_ns(), 94_000);
        assert_eq!(t.timeline.busy_ns(0), 60_000);
        assert_eq!(t.timeline.compute[1][0].start_ns, 12_000);
    }

    #[test]
    fn bad_traces_say_what_is_wrong() {
        let e = read_traces(&[("x.json".into(), "{".into())], &ImportOptions::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains("x.json"), "{e}");
        let e = read_traces(
            &[("x.json".into(), r#"{"traceEvents": []}"#.into())],
            &ImportOptions::default(),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("PP:"), "{e}");
        let text = format!(
            r#"[{},{}]"#,
            ev(1, "PP:0F0", 0.0, 10.0),
            ev(1, "PP:0F1", 5.0, 10.0)
        );
        let e = read_traces(&[("x.json".into(), text)], &ImportOptions::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains("overlapping"), "{e}");
        let text = format!(r#"[{}]"#, ev(1, "PP:0Q0", 0.0, 10.0));
        let e = read_traces(&[("x.json".into(), text)], &ImportOptions::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains("PP:0Q0"), "{e}");
    }

    #[test]
    fn busy_time_starts_at_the_first_operator_and_steps_split_where_actions_repeat() {
        let op = |ts: f64| {
            format!(
                r#"{{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": {ts}, "dur": 1}}"#
            )
        };
        // One rank, one stage, two steps of F0 B0; the first F waits 30 us inside its span.
        let events = [
            ev(1, "PP:0F0", 100.0, 50.0),
            op(130.0),
            ev(1, "PP:0SEND_F0", 150.0, 5.0),
            ev(1, "PP:0B0", 160.0, 40.0),
            op(161.0),
            ev(1, "PP:0F0", 300.0, 10.0),
            op(302.0),
            ev(1, "PP:0B0", 310.0, 10.0),
            op(310.0),
        ];
        let text = format!("[{}]", events.join(","));
        let first = read_traces(
            &[("t.json".into(), text.clone())],
            &ImportOptions { step: Some(0) },
        )
        .unwrap();
        assert_eq!((first.steps, first.step), (2, 0));
        // F busy 130..150 (20 us), B 161..200 (39 us); waits 30 + 1 us.
        assert_eq!(first.timeline.busy_ns(0), 59_000);
        assert_eq!(first.leading_wait_ns, vec![31_000]);
        assert_eq!(first.other_events.get("SEND_F"), Some(&1));
        let last = read_traces(&[("t.json".into(), text)], &ImportOptions::default()).unwrap();
        assert_eq!(last.step, 1);
        // F busy 302..310, B 310..320.
        assert_eq!(last.timeline.busy_ns(0), 18_000);
    }

    #[test]
    fn nested_events_are_counted_and_c10d_calls_timed() {
        let op = |name: &str, ts: f64, dur: f64| {
            format!(
                r#"{{"ph": "X", "cat": "cpu_op", "name": "{name}", "pid": 1, "tid": 1, "ts": {ts}, "dur": {dur}}}"#
            )
        };
        // F0 holds 2 operators and an isend (c10d::send, 7 us, with gloo's child); B0 one
        // operator and a recv of 3 us; an operator after B0's end belongs to neither.
        let events = [
            ev(1, "PP:0F0", 100.0, 50.0),
            op("aten::mm", 110.0, 10.0),
            op("aten::add", 121.0, 2.0),
            op("c10d::send", 130.0, 7.0),
            op("gloo:send", 131.0, 5.0),
            ev(1, "PP:0B0", 160.0, 40.0),
            op("c10d::recv_", 160.0, 3.0),
            op("aten::mm", 170.0, 20.0),
            op("aten::mm", 201.0, 1.0),
        ];
        let t = read_traces(
            &[("t.json".into(), format!("[{}]", events.join(",")))],
            &ImportOptions::default(),
        )
        .unwrap();
        let want = vec![
            NestedEvents {
                events: 4,
                comm_ns: 7_000,
            },
            NestedEvents {
                events: 2,
                comm_ns: 3_000,
            },
        ];
        assert_eq!(t.nested, vec![want]);
    }
}
