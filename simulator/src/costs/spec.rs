//! The `--costs` strings: one rank's share of the model per microbatch, seconds, as one
//! value per key ([`UniformCostSpec`]) or one value per rank ([`PerRankCostSpec`]).

use crate::{Error, Result};
use std::str::FromStr;

/// The `--costs` specification: one rank's share per microbatch, seconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct UniformCostSpec {
    /// Forward, seconds.
    pub f: f64,
    /// Backward for inputs (dgrad), seconds.
    pub b: f64,
    /// Backward for weights (wgrad), seconds.
    pub w: f64,
    /// One transfer between adjacent stages on different ranks, seconds.
    pub comm: f64,
    /// An overlapped forward + backward pair (one rank's share), seconds; default `f + b + w`.
    pub fb: Option<f64>,
    /// A forward-only action (one rank's share), seconds; default `f`.
    pub fo: Option<f64>,
    /// FSDP's collectives, when the lowering runs them ([`crate::ir::lowering::Lowering`]'s
    /// `fsdp`).
    pub fsdp: FsdpCostSpec,
}

/// The time of FSDP's collectives under uniform costs: one rank's share, spread over its `v`
/// stages like the compute (`--costs ...,ag=2,rs=3`).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct FsdpCostSpec {
    /// All-gather of one rank's parameters (`UNSHARD`), seconds.
    pub ag: f64,
    /// Reduce-scatter of one rank's gradients (`REDUCE_GRAD`), seconds.
    pub rs: f64,
    /// How much longer compute runs while one of these collectives runs on its rank, a
    /// fraction 0 to 10 (`interference=0.18`; [`crate::CostModel::collective_interference`]);
    /// default 0.
    pub interference: f64,
}

impl Default for UniformCostSpec {
    fn default() -> Self {
        UniformCostSpec {
            f: 1.0,
            b: 1.0,
            w: 1.0,
            comm: 0.0,
            fb: None,
            fo: None,
            fsdp: Default::default(),
        }
    }
}

/// The least non-zero `--costs` value, seconds: 1 ns, the simulator's time unit.
pub const MIN_COST_S: f64 = 1e-9;
/// The largest `--costs` value, seconds (11.6 days per action).
pub const MAX_COST_S: f64 = 1e6;

/// One `--costs` value in seconds, checked: 0 or [`MIN_COST_S`]..=[`MAX_COST_S`].
fn parse_cost_s(key: &str, v: &str) -> Result<f64> {
    let x: f64 = v
        .trim()
        .parse()
        .map_err(|_| Error::invalid(format!("costs {key}"), v, "a number of seconds"))?;
    // Time is integer nanoseconds (u64): a cost must not round to 0 ns unless it is 0, and a
    // step of many such actions must stay far below 2^64 ns (584 years).
    if !(x.is_finite() && (x == 0.0 || (MIN_COST_S..=MAX_COST_S).contains(&x))) {
        return Err(Error::invalid(
            format!("costs {key}"),
            v,
            format!(
                "0 or {MIN_COST_S:e} to {MAX_COST_S} seconds (time is counted in whole ns: 1 ns is the least, and 1000000 s per action keeps a step's makespan in range)"
            ),
        ));
    }
    Ok(x)
}

/// The `interference` value of a `--costs` string: a fraction, 0 to 10.
fn parse_interference(v: &str) -> Result<f64> {
    match v.trim().parse::<f64>() {
        Ok(x) if x.is_finite() && (0.0..=10.0).contains(&x) => Ok(x),
        _ => Err(Error::invalid(
            "costs interference",
            v,
            "a fraction from 0 to 10 (0.18: compute runs 18% longer beside a collective)",
        )),
    }
}

/// The `key=value` pairs of a `--costs` string, keys trimmed, in order.
///
/// # Errors
/// [`Error::InvalidArgument`] for an item without `=` (naming it and `example`) or a key given
/// twice.
fn cost_pairs<'a>(s: &'a str, example: &str) -> Result<Vec<(&'a str, &'a str)>> {
    let mut pairs: Vec<(&str, &str)> = Vec::new();
    for item in s.split(',').map(str::trim).filter(|x| !x.is_empty()) {
        let (k, v) = item.split_once('=').ok_or_else(|| {
            Error::invalid(
                "costs",
                item,
                format!("key=seconds pairs such as {example}"),
            )
        })?;
        let key = k.trim();
        if pairs.iter().any(|(seen, _)| *seen == key) {
            return Err(Error::invalid(
                "costs",
                s,
                format!("each key at most once ({key} is given twice)"),
            ));
        }
        pairs.push((key, v));
    }
    Ok(pairs)
}

/// `--costs` with per-rank values: `f=1/1/2/2,b=2/2/3/3,w=1,comm=0.1` gives each rank's share
/// of the model per microbatch, seconds, one value per rank separated by `/` (a single value
/// applies to every rank); with v stages per rank each of its stages costs its share / v
/// ([`StageCosts::per_rank`](super::StageCosts::per_rank)). Heterogeneous pipelines, such as the Zero Bubble repository's
/// 8-stage example, are written this way.
#[derive(Debug, Clone, PartialEq)]
pub struct PerRankCostSpec {
    /// Forward per rank, seconds (one value: every rank).
    pub f: Vec<f64>,
    /// Backward for inputs (dgrad) per rank, seconds.
    pub b: Vec<f64>,
    /// Backward for weights (wgrad) per rank, seconds.
    pub w: Vec<f64>,
    /// One transfer between adjacent stages on different ranks, seconds.
    pub comm: f64,
}

impl PerRankCostSpec {
    /// The number of ranks the lists give, if any list has more than one value.
    pub fn num_ranks(&self) -> Option<usize> {
        [&self.f, &self.b, &self.w]
            .iter()
            .map(|x| x.len())
            .find(|&n| n > 1)
    }

    /// The three lists for `p` ranks (single values repeated).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when a list's length is neither 1 nor `p`.
    pub fn for_ranks(&self, p: u32) -> Result<[Vec<f64>; 3]> {
        let mut out: [Vec<f64>; 3] = Default::default();
        for (o, (name, xs)) in out
            .iter_mut()
            .zip([("f", &self.f), ("b", &self.b), ("w", &self.w)])
        {
            *o = match xs.len() {
                1 => vec![xs[0]; p as usize],
                n if n == p as usize => xs.clone(),
                n => {
                    return Err(Error::invalid(
                        format!("costs {name}"),
                        format!("{n} values"),
                        format!("one value per rank (pp = {p}) or a single value"),
                    ));
                }
            };
        }
        Ok(out)
    }
}

impl FromStr for PerRankCostSpec {
    type Err = Error;
    /// Parses `f=1/2/1/1,b=2/3/2/2,w=1,comm=0` (keys f, b, w, comm; missing ones keep
    /// f = b = w = 1, comm = 0; comm takes one value).
    fn from_str(s: &str) -> Result<Self> {
        let mut spec = PerRankCostSpec {
            f: vec![1.0],
            b: vec![1.0],
            w: vec![1.0],
            comm: 0.0,
        };
        for (key, v) in cost_pairs(s, "f=1/2/1/1,b=2,w=1,comm=0")? {
            let list = || {
                v.split('/')
                    .map(|x| parse_cost_s(key, x))
                    .collect::<Result<Vec<f64>>>()
            };
            match key {
                "f" => spec.f = list()?,
                "b" => spec.b = list()?,
                "w" => spec.w = list()?,
                "comm" => spec.comm = parse_cost_s(key, v)?,
                "fb" | "fo" => {
                    return Err(Error::invalid(
                        "costs",
                        key,
                        "f, b, w and comm with per-rank values (fb and fo only with one value per key)",
                    ));
                }
                other => {
                    return Err(Error::invalid("costs", other, "keys are f, b, w, comm"));
                }
            }
        }
        if let Some(n) = spec.num_ranks() {
            for (name, xs) in [("f", &spec.f), ("b", &spec.b), ("w", &spec.w)] {
                if xs.len() != 1 && xs.len() != n {
                    return Err(Error::invalid(
                        format!("costs {name}"),
                        format!("{} values", xs.len()),
                        format!("{n} values (one per rank, as another key gives) or one"),
                    ));
                }
            }
        }
        Ok(spec)
    }
}

impl FromStr for UniformCostSpec {
    type Err = Error;
    /// Parses `f=1,b=1,w=1,comm=0` (any subset, in any order; missing keys keep the defaults
    /// f = b = w = 1, comm = 0).
    fn from_str(s: &str) -> Result<Self> {
        let mut spec = UniformCostSpec::default();
        for (key, v) in cost_pairs(s, "f=1,b=1,w=1,comm=0")? {
            if key == "interference" {
                spec.fsdp.interference = parse_interference(v)?;
                continue;
            }
            let x = parse_cost_s(key, v)?;
            match key {
                "f" => spec.f = x,
                "b" => spec.b = x,
                "w" => spec.w = x,
                "comm" => spec.comm = x,
                "fb" => spec.fb = Some(x),
                "fo" => spec.fo = Some(x),
                "ag" => spec.fsdp.ag = x,
                "rs" => spec.fsdp.rs = x,
                other => {
                    return Err(Error::invalid(
                        "costs",
                        other,
                        "keys are f, b, w, comm, fb, fo, and FSDP's ag, rs and interference",
                    ));
                }
            }
        }
        Ok(spec)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cost_spec_parses_and_rejects() {
        let c: UniformCostSpec = "f=1,b=2,w=0.5,comm=0.1".parse().unwrap();
        assert_eq!((c.f, c.b, c.w, c.comm), (1.0, 2.0, 0.5, 0.1));
        let e = "f=-1".parse::<UniformCostSpec>().unwrap_err().to_string();
        assert!(e.contains("0 or 1e-9") && e.contains("costs f"), "{e}");
        assert!("x=1".parse::<UniformCostSpec>().is_err());
        assert!("f".parse::<UniformCostSpec>().is_err());
        // A repeated key was silently the last one given.
        let e = "f=1,b=2,f=3"
            .parse::<UniformCostSpec>()
            .unwrap_err()
            .to_string();
        assert!(e.contains("f is given twice"), "{e}");
        // interference is a fraction, not seconds: 0 to 10.
        let c: UniformCostSpec = "ag=1,interference=0.18".parse().unwrap();
        assert_eq!((c.fsdp.ag, c.fsdp.interference), (1.0, 0.18));
        for bad in ["interference=-0.1", "interference=11", "interference=x"] {
            let e = bad.parse::<UniformCostSpec>().unwrap_err().to_string();
            assert!(
                e.contains("costs interference") && e.contains("0 to 10"),
                "{e}"
            );
        }
    }
}
