//! Context parallelism (cp): one sequence's attention split over `cp` GPUs along the sequence,
//! and what that costs one GPU of the group per attention layer and microbatch.
//!
//! Every GPU of a cp group holds `T / cp` of a microbatch's tokens (queries) and their
//! activations; attention needs every earlier key and value, so the group exchanges them in one
//! of four ways, as Megatron-LM's `--cp-comm-type` names them
//! (`megatron/core/transformer/custom_layers/transformer_engine.py`, Transformer Engine's
//! `attn_forward_func_with_cp`):
//! - `p2p`, ring attention (Liu et al. 2023, "Ring Attention with Blockwise Transformers";
//!   torchtitan's ring): `cp - 1` steps per layer, each sending the key/value block it holds to
//!   the next GPU while computing attention on the block it has, so a step exposes
//!   `max(0, send - block compute)`. The backward circulates the key/value blocks again with
//!   their gradients (two blocks per step), as Transformer Engine's backward does.
//! - `a2a`, Ulysses (Jacobs et al. 2023, "DeepSpeed Ulysses"): all-to-alls turn the sequence
//!   split into a head split, attention runs whole on `heads / cp` heads, and an all-to-all
//!   turns it back: four in the forward (Q, K, V in; the output back), four in the backward
//!   (the output's gradient in; Q, K and V's back), none overlapped. `cp` must divide the
//!   query heads; with more GPUs than key/value heads those heads are replicated up to `cp`
//!   (grouped-query attention, as verl's and DeepSpeed's Ulysses do).
//! - `allgather` (Llama 3's choice, Dubey et al. 2024, §3.3.2): all-gather the keys and values
//!   before attention, reduce-scatter their gradients in the backward; not overlapped.
//! - `a2a+p2p`, hierarchical: Ulysses inside a node over `a2a` GPUs, the ring across nodes over
//!   `cp / a2a` groups (Megatron's `--hierarchical-context-parallel-sizes`).
//!
//! A causal sequence split into `cp` contiguous blocks gives the last GPU far more query-key
//! pairs than the first (about `2 cp - 1` times: 7x at cp = 4); split into `2 cp` chunks, GPU
//! `i` taking chunks `i` and `2 cp - 1 - i` ("zigzag", Megatron's and torchtitan's load
//! balancing), every GPU gets the same. Packed variable-length microbatches are split
//! document by document (each document padded to a multiple of `2 cp`, the divisibility
//! Transformer Engine's THD format requires; torchtitan #2536).
//!
//! Dynamic cp (Megatron-Core's dynamic context-parallel scheduler, Megatron-LM PR #2282 and
//! #5679): each sequence gets the smallest power-of-two group that holds it at
//! `max_seqlen_per_dp_cp_rank` tokens per GPU ([`gpus_needed`]).

use crate::{Error, Link, Result};

/// The largest cp group priced, GPUs: per-GPU tables are allocated per group, so a larger one is
/// refused before allocating (the largest published cp runs use tens of GPUs).
pub const MAX_CP: u32 = 65_536;

/// How a cp group exchanges keys and values (Megatron's `--cp-comm-type`). Written in files
/// as its flag value: `p2p`, `a2a`, `allgather` or `a2a+p2p:N`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum CpComm {
    /// Ring attention over point-to-point sends, overlapped with the attention blocks.
    Ring,
    /// Ulysses: all-to-alls between a sequence and a head split.
    Ulysses,
    /// All-gather of the keys and values (Llama 3).
    AllGather,
    /// Ulysses inside a node over this many GPUs, the ring across nodes.
    Hierarchical {
        /// GPUs of the all-to-all inside a node; divides cp.
        a2a: u32,
    },
}

impl TryFrom<String> for CpComm {
    type Error = Error;
    fn try_from(s: String) -> Result<Self> {
        s.parse()
    }
}

impl From<CpComm> for String {
    fn from(c: CpComm) -> String {
        c.to_string()
    }
}

/// How a causal sequence is cut over the cp group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum CpBalance {
    /// `cp` contiguous blocks, GPU `i` the `i`-th.
    Contiguous,
    /// `2 cp` chunks, GPU `i` taking chunks `i` and `2 cp - 1 - i`.
    Zigzag,
}

impl CpBalance {
    /// The chunks a sequence is cut into for `cp` GPUs (its length must be a multiple).
    pub fn chunks(self, cp: u32) -> u64 {
        match self {
            CpBalance::Contiguous => u64::from(cp),
            CpBalance::Zigzag => 2 * u64::from(cp),
        }
    }
}

impl std::fmt::Display for CpComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CpComm::Ring => f.write_str("p2p"),
            CpComm::Ulysses => f.write_str("a2a"),
            CpComm::AllGather => f.write_str("allgather"),
            CpComm::Hierarchical { a2a } => write!(f, "a2a+p2p:{a2a}"),
        }
    }
}

impl std::str::FromStr for CpComm {
    type Err = Error;
    /// `p2p`, `a2a`, `allgather` or `a2a+p2p:N` (Ulysses over N GPUs of a node).
    fn from_str(s: &str) -> Result<Self> {
        let bad = || {
            Error::invalid(
                "context parallelism",
                "cp communication",
                s,
                "p2p (ring), a2a (Ulysses), allgather, or a2a+p2p:N (Ulysses over N GPUs of a node, the ring across nodes)",
            )
        };
        Ok(match s {
            "p2p" => CpComm::Ring,
            "a2a" => CpComm::Ulysses,
            "allgather" => CpComm::AllGather,
            _ => {
                let n = s.strip_prefix("a2a+p2p:").ok_or_else(bad)?;
                CpComm::Hierarchical {
                    a2a: n.parse().map_err(|_| bad())?,
                }
            }
        })
    }
}

impl std::fmt::Display for CpBalance {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            CpBalance::Contiguous => "contiguous",
            CpBalance::Zigzag => "zigzag",
        })
    }
}

impl std::str::FromStr for CpBalance {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "zigzag" => Ok(CpBalance::Zigzag),
            "contiguous" => Ok(CpBalance::Contiguous),
            _ => Err(Error::invalid(
                "context parallelism",
                "cp balance",
                s,
                "zigzag or contiguous",
            )),
        }
    }
}

/// Causal query-key pairs of the queries `[start, start + len)` of one sequence:
/// `Σ_{q = start}^{start + len - 1} (q + 1) = len start + len (len + 1) / 2`.
fn pairs(start: u64, len: u64) -> u64 {
    len * start + len * (len + 1) / 2
}

/// Per GPU of a cp group, the causal query-key pairs it computes for one sequence of
/// `seq_len` tokens cut by `balance`.
///
/// # Errors
/// A `cp` of 0, or a length that is not a multiple of the chunks (`cp`, or `2 cp` for zigzag).
pub fn causal_pairs_per_rank(seq_len: u64, cp: u32, balance: CpBalance) -> Result<Vec<u64>> {
    if cp == 0 {
        return Err(Error::invalid("context parallelism", "cp", 0, ">= 1"));
    }
    let n = balance.chunks(cp);
    if seq_len % n != 0 {
        return Err(Error::invalid(
            "context parallelism",
            "sequence length",
            seq_len,
            format!(
                "a multiple of {n} ({} chunks for cp = {cp}): pad the sequence",
                if balance == CpBalance::Zigzag {
                    "2 cp zigzag"
                } else {
                    "cp contiguous"
                }
            ),
        ));
    }
    let c = seq_len / n;
    Ok((0..u64::from(cp))
        .map(|i| match balance {
            CpBalance::Contiguous => pairs(i * c, c),
            CpBalance::Zigzag => pairs(i * c, c) + pairs((n - 1 - i) * c, c),
        })
        .collect())
}

/// A packed microbatch cut over a cp group document by document: per GPU its query-key
/// pairs, and the padding tokens added so that every document is a multiple of the chunks.
#[derive(Debug, Clone, PartialEq)]
pub struct PackedSplit {
    /// Per GPU, causal query-key pairs (padding included: it is computed).
    pub pairs: Vec<u64>,
    /// Tokens of padding over all documents.
    pub pad_tokens: u64,
}

/// Splits a packed microbatch of documents `seq_lens` over `cp` GPUs, each document padded up
/// to a multiple of the chunks and cut by `balance` on its own (per-document balancing).
///
/// # Errors
/// A `cp` of 0 or above [`MAX_CP`].
pub fn packed_pairs_per_rank(seq_lens: &[u64], cp: u32, balance: CpBalance) -> Result<PackedSplit> {
    if cp == 0 || cp > MAX_CP {
        return Err(Error::invalid(
            "context parallelism",
            "cp",
            cp,
            format!("1 to {MAX_CP} GPUs"),
        ));
    }
    let n = balance.chunks(cp);
    let mut out = PackedSplit {
        pairs: vec![0; cp as usize],
        pad_tokens: 0,
    };
    for &s in seq_lens {
        let padded = s.div_ceil(n) * n;
        out.pad_tokens += padded - s;
        for (acc, p) in out
            .pairs
            .iter_mut()
            .zip(causal_pairs_per_rank(padded, cp, balance)?)
        {
            *acc += p;
        }
    }
    Ok(out)
}

/// GPUs a sequence of `seq_len` tokens needs under dynamic cp with at most
/// `max_seqlen_per_rank` tokens per GPU: `max(1, 2^ceil(log2(seq_len / max_seqlen_per_rank)))`,
/// a power of two (Megatron-Core's dynamic cp groups come in powers of two;
/// `megatron/core/pipeline_parallel/data_schedule.py`, `gpus_needed`).
///
/// # Errors
/// A `max_seqlen_per_rank` of 0.
pub fn gpus_needed(seq_len: u64, max_seqlen_per_rank: u64) -> Result<u32> {
    if max_seqlen_per_rank == 0 {
        return Err(Error::invalid(
            "dynamic context parallelism",
            "max_seqlen_per_dp_cp_rank",
            0,
            ">= 1 token",
        ));
    }
    let blocks = seq_len.div_ceil(max_seqlen_per_rank).max(1);
    Ok(blocks.next_power_of_two() as u32)
}

/// What an attention layer's exchange is priced on: the microbatch's tokens over the whole cp
/// group and the layer's heads.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CpAttention {
    /// Tokens of the microbatch, over the whole group (each GPU holds `tokens / cp`).
    pub tokens: u64,
    /// Query heads.
    pub heads: u32,
    /// Key/value heads.
    pub kv_heads: u32,
    /// Dimension of one head.
    pub head_dim: u32,
    /// Bytes per element (2 for bf16).
    pub dtype_bytes: u32,
}

impl CpAttention {
    /// Bytes of the keys and values one GPU holds: `2 (tokens / cp) kv_heads head_dim bytes`
    /// (one ring step's block).
    pub fn kv_block_bytes(&self, cp: u32) -> f64 {
        2.0 * self.tokens as f64 / f64::from(cp)
            * f64::from(self.kv_heads * self.head_dim * self.dtype_bytes)
    }
}

/// Exposed time of one direction of ring attention over `cp` GPUs: `cp - 1` steps, each
/// sending `bytes_per_step` on `link` while the attention block that feeds it computes for
/// `block_s`: `(cp - 1) max(0, link(bytes) - block_s)`, seconds. The forward sends one key/value
/// block per step ([`CpAttention::kv_block_bytes`]) under a forward block (`attention forward /
/// cp`); the backward two (the block and its gradient) under a backward block.
pub fn ring_exposed_s(link: &Link, bytes_per_step: f64, cp: u32, block_s: f64) -> f64 {
    f64::from(cp.saturating_sub(1)) * (link.time_s(bytes_per_step) - block_s).max(0.0)
}

/// The bytes one GPU sends in each of Ulysses' four all-to-alls of a forward (the backward's
/// four move the same): `(cp - 1) / cp` of its `[tokens / cp, heads, head_dim]` share of Q, K,
/// V and the output, with key/value heads replicated up to `cp` where fewer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct UlyssesBytes {
    /// Of the queries (and of the output, the same shape).
    pub q: f64,
    /// Of the keys (and of the values).
    pub kv: f64,
}

impl UlyssesBytes {
    /// Seconds of the four all-to-alls of one direction on `link`: `4 alpha + (2 q + 2 kv) / beta`.
    pub fn time_s(&self, link: &Link) -> f64 {
        2.0 * link.time_s(self.q) + 2.0 * link.time_s(self.kv)
    }
}

/// Ulysses' bytes per GPU ([`UlyssesBytes`]).
///
/// # Errors
/// A `cp` that does not divide the query heads (each GPU runs `heads / cp` of them).
pub fn ulysses_bytes(a: &CpAttention, cp: u32) -> Result<UlyssesBytes> {
    if cp == 0 || a.heads % cp != 0 {
        return Err(Error::invalid(
            "Ulysses context parallelism",
            "cp",
            cp,
            format!("a divisor of the {} query heads", a.heads),
        ));
    }
    let share = (f64::from(cp) - 1.0) / f64::from(cp) * a.tokens as f64 / f64::from(cp)
        * f64::from(a.head_dim * a.dtype_bytes);
    Ok(UlyssesBytes {
        q: share * f64::from(a.heads),
        kv: share * f64::from(a.kv_heads.max(cp)),
    })
}

/// Bytes one GPU receives in the all-gather of the keys and values (the forward), and sends in
/// the reduce-scatter of their gradients (the backward): `(cp - 1)` blocks of
/// [`CpAttention::kv_block_bytes`]. On a ring each takes `(cp - 1) (alpha + block / beta)`.
pub fn all_gather_kv_bytes(a: &CpAttention, cp: u32) -> f64 {
    f64::from(cp.saturating_sub(1)) * a.kv_block_bytes(cp)
}

/// The activation bytes one GPU of a cp group holds for a layer whose unsplit activations are
/// `bytes`, and the key/value bytes in flight while its attention runs: `bytes / cp`, plus two
/// blocks for the ring (the one computed on and the one arriving), `cp` blocks (the gathered
/// keys and values) for the all-gather, and a transient copy of its Q, K and V in the head
/// split for Ulysses.
pub fn activation_bytes_per_rank(bytes: f64, a: &CpAttention, cp: u32, comm: CpComm) -> f64 {
    let block = a.kv_block_bytes(cp);
    let in_flight = match comm {
        CpComm::Ring | CpComm::Hierarchical { .. } => 2.0 * block,
        CpComm::AllGather => f64::from(cp) * block,
        CpComm::Ulysses => {
            block * (f64::from(a.heads) + 2.0 * f64::from(a.kv_heads.max(cp)))
                / (2.0 * f64::from(a.kv_heads))
        }
    };
    bytes / f64::from(cp) + in_flight
}

/// Context parallelism of a run: `cp` GPUs per pipeline rank (a group acts as one rank of the
/// pipeline, as a tensor-parallel group does), how they exchange and split, and, for dynamic
/// cp, the tokens one GPU holds at most.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ContextParallel {
    /// GPUs per group, >= 1.
    pub cp: u32,
    /// How the group exchanges keys and values.
    pub comm: CpComm,
    /// How a sequence is cut over the group.
    pub balance: CpBalance,
    /// Dynamic cp: each microbatch runs on [`gpus_needed`] of its longest sequence at this many
    /// tokens per GPU (at most `cp`, at least 1), the group's other GPUs idle for it (inside a
    /// pipeline a stage's group runs one microbatch at a time). `None`: every microbatch on all
    /// `cp`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_seqlen_per_rank: Option<u64>,
}

/// One microbatch on a cp group ([`ContextParallel::share`]): what its busiest GPU computes.
#[derive(Debug, Clone, PartialEq)]
pub struct CpShare {
    /// Tokens on the busiest GPU (padding included).
    pub tokens: f64,
    /// Causal query-key pairs on the busiest GPU.
    pub pairs: f64,
    /// The sequences (or, with fixed cp, the whole microbatch) that GPU shares with others,
    /// whose exchanges it pays: each split over `gpus > 1`.
    pub parts: Vec<CpPart>,
}

/// A split of sequences over `gpus` GPUs of a cp group, as one GPU of it sees it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CpPart {
    /// GPUs it is split over.
    pub gpus: u32,
    /// Its tokens over those GPUs, padding included.
    pub padded_tokens: u64,
    /// Causal pairs of one GPU of the split (the busiest).
    pub pairs: f64,
}

impl ContextParallel {
    /// Checks `cp >= 1`, a hierarchical `a2a` that divides it, and a dynamic budget >= 1.
    ///
    /// # Errors
    /// [`Error::Invalid`] naming the field.
    pub fn validate(&self) -> Result<()> {
        let origin = "context parallelism";
        if self.cp == 0 || self.cp > MAX_CP {
            return Err(Error::invalid(
                origin,
                "cp",
                self.cp,
                format!("1 to {MAX_CP} GPUs"),
            ));
        }
        if let CpComm::Hierarchical { a2a } = self.comm
            && (a2a == 0 || self.cp % a2a != 0)
        {
            return Err(Error::invalid(
                origin,
                "a2a",
                a2a,
                format!("a divisor of cp = {}", self.cp),
            ));
        }
        if self.max_seqlen_per_rank == Some(0) {
            return Err(Error::invalid(
                origin,
                "max_seqlen_per_rank",
                0,
                ">= 1 token",
            ));
        }
        Ok(())
    }

    /// The GPUs a sequence of `len` tokens runs on: `cp`, or with dynamic cp [`gpus_needed`]
    /// within `1..=cp`.
    pub fn gpus_for(&self, len: u64) -> u32 {
        match self.max_seqlen_per_rank {
            Some(m) if m > 0 => gpus_needed(len, m).unwrap_or(1).clamp(1, self.cp.max(1)),
            _ => self.cp.max(1),
        }
    }

    /// A flat microbatch of documents `seq_lens` on the group, as its busiest GPU computes it.
    ///
    /// Fixed cp (Megatron's static cp): every document is split over all `cp` GPUs, each padded
    /// to the split's chunks ([`packed_pairs_per_rank`]). Dynamic cp: each document runs on
    /// [`ContextParallel::gpus_for`] GPUs, an aligned block of the group (powers of two, as
    /// Megatron-Core's dynamic groups), and the documents are placed most work first on the
    /// block whose busiest GPU has the least; the GPUs of a smaller block run other documents
    /// meanwhile. A document's work on one of its GPUs is `tokens + attn_weight x pairs` (its
    /// share of each; `attn_weight` is the cost of a pair over that of a token, from the
    /// profile: Megatron-Core's `get_total_workload` counts the attention alone,
    /// `len^2 / gpus`, which leaves the per-token work unbalanced). The busiest GPU by that
    /// work is the share.
    pub fn share(&self, seq_lens: &[u32], attn_weight: f64) -> CpShare {
        let lens: Vec<u64> = seq_lens.iter().map(|&s| u64::from(s)).collect();
        if self.max_seqlen_per_rank.is_none() {
            let part = split(&lens, self.cp.max(1), self.balance);
            return CpShare {
                tokens: part.padded_tokens as f64 / f64::from(part.gpus),
                pairs: part.pairs,
                parts: if part.gpus > 1 {
                    vec![part]
                } else {
                    Vec::new()
                },
            };
        }
        let cp = self.cp.max(1) as usize;
        let mut order: Vec<(CpPart, f64)> = lens
            .iter()
            .map(|&l| {
                let part = split(&[l], self.gpus_for(l), self.balance);
                let work =
                    part.padded_tokens as f64 / f64::from(part.gpus) + attn_weight * part.pairs;
                (part, work)
            })
            .collect();
        order.sort_by(|a, b| b.1.total_cmp(&a.1));
        let mut load = vec![0.0f64; cp];
        let mut gpus: Vec<CpShare> = vec![
            CpShare {
                tokens: 0.0,
                pairs: 0.0,
                parts: Vec::new()
            };
            cp
        ];
        for (part, work) in order {
            let g = part.gpus as usize;
            let start = (0..cp / g)
                .map(|b| b * g)
                .min_by(|&a, &b| {
                    let most = |s: usize| load[s..s + g].iter().copied().fold(0.0, f64::max);
                    most(a).total_cmp(&most(b))
                })
                .unwrap_or(0);
            for k in start..start + g {
                load[k] += work;
                gpus[k].tokens += part.padded_tokens as f64 / g as f64;
                gpus[k].pairs += part.pairs;
                if g > 1 {
                    gpus[k].parts.push(part);
                }
            }
        }
        let busiest = (0..cp)
            .max_by(|&a, &b| load[a].total_cmp(&load[b]))
            .unwrap_or(0);
        gpus.swap_remove(busiest)
    }
}

/// Documents `lens` split over `gpus` GPUs, each padded to the chunks and cut by `balance`; one
/// GPU cuts nothing.
fn split(lens: &[u64], gpus: u32, balance: CpBalance) -> CpPart {
    let tokens: u64 = lens.iter().sum();
    if gpus <= 1 {
        return CpPart {
            gpus: 1,
            padded_tokens: tokens,
            pairs: lens.iter().map(|&s| s * (s + 1) / 2).sum::<u64>() as f64,
        };
    }
    // gpus >= 2: the split cannot fail.
    let s = packed_pairs_per_rank(lens, gpus, balance).unwrap_or(PackedSplit {
        pairs: vec![0],
        pad_tokens: 0,
    });
    CpPart {
        gpus,
        padded_tokens: tokens + s.pad_tokens,
        pairs: s.pairs.iter().copied().max().unwrap_or(0) as f64,
    }
}

/// The links a cp group exchanges on: groups are placed inside a node first, so a group of at
/// most `gpus_per_node` GPUs uses `intra`, a larger one is bounded by `inter`.
#[derive(Debug, Clone, PartialEq)]
pub struct CpLinks {
    /// Inside a node.
    pub intra: Link,
    /// Between nodes.
    pub inter: Link,
    /// GPUs per node.
    pub gpus_per_node: u32,
}

impl CpLinks {
    fn of_group(&self, gpus: u32) -> &Link {
        if gpus <= self.gpus_per_node {
            &self.intra
        } else {
            &self.inter
        }
    }

    /// Exposed exchange seconds of one attention layer on one GPU of a cp group, as
    /// `(forward, backward)`, for the layer's attention compute on that GPU `attention_s`
    /// (forward, backward; what overlaps a ring's sends): the ring's
    /// [`ring_exposed_s`] (a block of `attention / cp` per step), Ulysses' four all-to-alls
    /// each way ([`UlyssesBytes::time_s`]), the all-gather's and reduce-scatter's
    /// `(cp - 1) (alpha + block / beta)`, or for `a2a+p2p` Ulysses over `a2a` GPUs on the
    /// node's link plus the ring over `cp / a2a` groups on the link between nodes. `cp = 1`
    /// exchanges nothing.
    ///
    /// # Errors
    /// Ulysses' divisibility ([`ulysses_bytes`]); an `a2a` size that does not divide cp, or
    /// larger than a node.
    pub fn exposed_s(
        &self,
        comm: CpComm,
        a: &CpAttention,
        cp: u32,
        attention_s: (f64, f64),
    ) -> Result<(f64, f64)> {
        if cp <= 1 {
            return Ok((0.0, 0.0));
        }
        let block = a.kv_block_bytes(cp);
        let ring = |link: &Link, steps: u32| {
            (
                ring_exposed_s(link, block, steps, attention_s.0 / f64::from(steps)),
                ring_exposed_s(link, 2.0 * block, steps, attention_s.1 / f64::from(steps)),
            )
        };
        Ok(match comm {
            CpComm::Ring => ring(self.of_group(cp), cp),
            CpComm::Ulysses => {
                let t = ulysses_bytes(a, cp)?.time_s(self.of_group(cp));
                (t, t)
            }
            CpComm::AllGather => {
                let l = self.of_group(cp);
                let t = f64::from(cp - 1) * l.time_s(block);
                (t, t)
            }
            CpComm::Hierarchical { a2a } => {
                if a2a == 0 || cp % a2a != 0 || a2a > self.gpus_per_node {
                    return Err(Error::invalid(
                        "hierarchical context parallelism",
                        "a2a",
                        a2a,
                        format!(
                            "a divisor of cp = {cp} of at most {} GPUs (one node)",
                            self.gpus_per_node
                        ),
                    ));
                }
                // Ulysses over a2a GPUs, each holding tokens / cp of the sequence.
                let inner = CpAttention {
                    tokens: a.tokens / u64::from(cp / a2a),
                    ..*a
                };
                let u = ulysses_bytes(&inner, a2a)?.time_s(&self.intra);
                let (f, b) = ring(&self.inter, cp / a2a);
                (u + f, u + b)
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn link(alpha_s: f64, gb_per_s: f64) -> Link {
        Link {
            name: String::new(),
            alpha_s,
            beta_bytes_per_s: gb_per_s * 1e9,
            post_s: 0.0,
        }
    }

    #[test]
    fn a_contiguous_causal_split_loads_the_last_gpu_seven_times_the_first_at_cp_4() {
        // 4,096 tokens in blocks of b = 1,024: GPU 0 b (b + 1) / 2 pairs, GPU 3 3 b^2 + b (b + 1) / 2.
        let p = causal_pairs_per_rank(4096, 4, CpBalance::Contiguous).unwrap();
        assert_eq!(p, vec![524_800, 1_573_376, 2_621_952, 3_670_528]);
        let ratio = p[3] as f64 / p[0] as f64;
        assert!((ratio - 7.0).abs() < 0.01, "{ratio}");
        // Every pair once: 4,096 x 4,097 / 2.
        assert_eq!(p.iter().sum::<u64>(), 4096 * 4097 / 2);
    }

    #[test]
    fn zigzag_gives_every_gpu_the_same_pairs() {
        // 8 chunks of c = 512: chunks i and 7 - i hold (7 c^2 + c^2) + c = 8 c^2 + c.
        let p = causal_pairs_per_rank(4096, 4, CpBalance::Zigzag).unwrap();
        assert_eq!(p, vec![8 * 512 * 512 + 512; 4]);
        assert_eq!(p.iter().sum::<u64>(), 4096 * 4097 / 2);
    }

    #[test]
    fn packed_documents_are_split_one_by_one_and_padded_to_the_chunks() {
        // cp = 2 zigzag: multiples of 4. 10 -> 12 (2 pad), 4 -> 4, 7 -> 8 (1 pad).
        let s = packed_pairs_per_rank(&[10, 4, 7], 2, CpBalance::Zigzag).unwrap();
        assert_eq!(s.pad_tokens, 3);
        let want: Vec<u64> = [12, 4, 8]
            .iter()
            .map(|&l| causal_pairs_per_rank(l, 2, CpBalance::Zigzag).unwrap())
            .fold(vec![0, 0], |a, p| vec![a[0] + p[0], a[1] + p[1]]);
        assert_eq!(s.pairs, want);
        // Balanced per document, so balanced in all.
        assert_eq!(s.pairs[0], s.pairs[1]);
        let e = causal_pairs_per_rank(10, 2, CpBalance::Zigzag)
            .unwrap_err()
            .to_string();
        assert!(e.contains("multiple of 4") && e.contains("10"), "{e}");
    }

    #[test]
    fn megatron_bridges_toy_example_needs_these_gpus_per_sample() {
        // Megatron-Bridge PR #3892 (examples/training_features/long_context): lengths
        // [128, 96, 64, 48, 32, 24, 16, 8] at max_seqlen_per_rank = 64; its README prints
        // "sample 0: length=128, gpus_needed=2" and "sample 2: length=64, gpus_needed=1".
        let got: Vec<u32> = [128, 96, 64, 48, 32, 24, 16, 8]
            .iter()
            .map(|&l| gpus_needed(l, 64).unwrap())
            .collect();
        assert_eq!(got, vec![2, 2, 1, 1, 1, 1, 1, 1]);
        // Powers of two: three blocks need four GPUs.
        assert_eq!(gpus_needed(129, 64).unwrap(), 4);
        assert_eq!(gpus_needed(1, 64).unwrap(), 1);
        assert!(gpus_needed(8, 0).is_err());
    }

    #[test]
    fn ring_exposes_what_a_send_takes_beyond_its_block() {
        // A 1 MB block on 100 GB/s with 5 us latency takes 15 us; the block computes for 4 us:
        // 11 us exposed per step, 3 steps at cp = 4.
        let l = link(5e-6, 100.0);
        let e = ring_exposed_s(&l, 1e6, 4, 4e-6);
        assert!((e - 33e-6).abs() < 1e-12, "{e}");
        // A block that computes longer hides the send.
        assert_eq!(ring_exposed_s(&l, 1e6, 4, 20e-6), 0.0);
        assert_eq!(ring_exposed_s(&l, 1e6, 1, 0.0), 0.0);
    }

    #[test]
    fn ulysses_and_all_gather_bytes_by_hand() {
        // Llama-3.1-8B's attention: 32 query heads, 8 KV heads of 128, bf16; 32,768 tokens.
        let a = CpAttention {
            tokens: 32_768,
            heads: 32,
            kv_heads: 8,
            head_dim: 128,
            dtype_bytes: 2,
        };
        // cp = 4: 8,192 local tokens; 3/4 of [8192, 32, 128] bf16 = 50,331,648 bytes of Q.
        let u = ulysses_bytes(&a, 4).unwrap();
        assert_eq!(u.q, 0.75 * 8192.0 * 32.0 * 128.0 * 2.0);
        assert_eq!(u.q, 50_331_648.0);
        assert_eq!(u.kv, 0.75 * 8192.0 * 8.0 * 128.0 * 2.0);
        // cp = 16 > 8 KV heads: replicated to 16.
        let u = ulysses_bytes(&a, 16).unwrap();
        assert_eq!(u.kv, 15.0 / 16.0 * 2048.0 * 16.0 * 128.0 * 2.0);
        assert_eq!(u.kv, u.q / 2.0);
        // On 450 GB/s and 10 us: 2 (10 us + q / beta) + 2 (10 us + kv / beta).
        let l = link(10e-6, 450.0);
        let want = 4.0 * 10e-6 + (2.0 * u.q + 2.0 * u.kv) / 450e9;
        assert!((u.time_s(&l) - want).abs() < 1e-15);
        let e = ulysses_bytes(&a, 3).unwrap_err().to_string();
        assert!(e.contains("32 query heads"), "{e}");
        // All-gather at cp = 4: 3 blocks of 2 x 8,192 x 8 x 128 x 2 bytes.
        assert_eq!(
            all_gather_kv_bytes(&a, 4),
            3.0 * 2.0 * 8192.0 * 8.0 * 128.0 * 2.0
        );
        assert_eq!(all_gather_kv_bytes(&a, 1), 0.0);
    }

    #[test]
    fn each_gpu_holds_its_share_and_the_blocks_in_flight() {
        let a = CpAttention {
            tokens: 4096,
            heads: 4,
            kv_heads: 2,
            head_dim: 64,
            dtype_bytes: 2,
        };
        let block = 2.0 * 1024.0 * 2.0 * 64.0 * 2.0;
        assert_eq!(a.kv_block_bytes(4), block);
        let ring = activation_bytes_per_rank(4e6, &a, 4, CpComm::Ring);
        assert_eq!(ring, 1e6 + 2.0 * block);
        let ag = activation_bytes_per_rank(4e6, &a, 4, CpComm::AllGather);
        assert_eq!(ag, 1e6 + 4.0 * block);
        // Ulysses: Q (4 heads) and K, V replicated to 4 heads each, at 1,024 tokens.
        let ul = activation_bytes_per_rank(4e6, &a, 4, CpComm::Ulysses);
        assert_eq!(ul, 1e6 + 1024.0 * (4.0 + 4.0 + 4.0) * 64.0 * 2.0);
    }

    #[test]
    fn each_exchange_priced_on_its_links() {
        let a = CpAttention {
            tokens: 65_536,
            heads: 64,
            kv_heads: 8,
            head_dim: 128,
            dtype_bytes: 2,
        };
        let links = CpLinks {
            intra: link(10e-6, 450.0),
            inter: link(20e-6, 50.0),
            gpus_per_node: 8,
        };
        // Short attention blocks: the sends show.
        let att = (0.1e-3, 0.25e-3);
        assert_eq!(
            links.exposed_s(CpComm::Ring, &a, 1, att).unwrap(),
            (0.0, 0.0)
        );
        // Ring at cp = 4 inside a node: block 2 x 16,384 x 8 x 128 x 2 = 67,108,864 bytes.
        let block = 67_108_864.0;
        assert_eq!(a.kv_block_bytes(4), block);
        let (f, b) = links.exposed_s(CpComm::Ring, &a, 4, att).unwrap();
        let send = 10e-6 + block / 450e9;
        assert!(
            f > 0.0 && (f - 3.0 * (send - 0.025e-3)).abs() < 1e-12,
            "{f}"
        );
        let send2 = 10e-6 + 2.0 * block / 450e9;
        assert!(
            b > 0.0 && (b - 3.0 * (send2 - 0.0625e-3)).abs() < 1e-12,
            "{b}"
        );
        // cp = 16 spans two nodes: the ring is bounded by the link between them.
        let (f16, _) = links.exposed_s(CpComm::Ring, &a, 16, att).unwrap();
        let send16 = 20e-6 + a.kv_block_bytes(16) / 50e9;
        assert!(
            (f16 - 15.0 * (send16 - 0.1e-3 / 16.0)).abs() < 1e-12,
            "{f16}"
        );
        // All-gather at cp = 4: 3 (alpha + block / beta) each way.
        let (f, b) = links.exposed_s(CpComm::AllGather, &a, 4, att).unwrap();
        assert!((f - 3.0 * send).abs() < 1e-12 && f == b);
        // Hierarchical 8 x 2 at cp = 16: Ulysses over 8 GPUs of 4,096 tokens each (as if the
        // sequence were 32,768 tokens over 8), then a 2-step ring between nodes.
        let (f, b) = links
            .exposed_s(CpComm::Hierarchical { a2a: 8 }, &a, 16, att)
            .unwrap();
        let inner = CpAttention {
            tokens: 32_768,
            ..a
        };
        let u = ulysses_bytes(&inner, 8).unwrap().time_s(&links.intra);
        let rf = ring_exposed_s(&links.inter, a.kv_block_bytes(16), 2, 0.05e-3);
        let rb = ring_exposed_s(&links.inter, 2.0 * a.kv_block_bytes(16), 2, 0.125e-3);
        assert!(rf > 0.0 && rb > 0.0);
        assert!((f - (u + rf)).abs() < 1e-15 && (b - (u + rb)).abs() < 1e-15);
        let e = links
            .exposed_s(CpComm::Hierarchical { a2a: 16 }, &a, 16, att)
            .unwrap_err()
            .to_string();
        assert!(e.contains("one node"), "{e}");
    }

    #[test]
    fn comm_and_balance_names_round_trip() {
        for c in [
            CpComm::Ring,
            CpComm::Ulysses,
            CpComm::AllGather,
            CpComm::Hierarchical { a2a: 8 },
        ] {
            assert_eq!(c.to_string().parse::<CpComm>().unwrap(), c);
        }
        for b in [CpBalance::Zigzag, CpBalance::Contiguous] {
            assert_eq!(b.to_string().parse::<CpBalance>().unwrap(), b);
        }
        let e = "ring".parse::<CpComm>().unwrap_err().to_string();
        assert!(e.contains("ring") && e.contains("a2a+p2p:N"), "{e}");
        assert!("a2a+p2p:x".parse::<CpComm>().is_err());
    }
}
