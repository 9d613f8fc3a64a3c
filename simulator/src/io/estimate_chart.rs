//! A run's estimate step by step (SVG or PNG by the file extension), drawn with plotters: on
//! top each step's predicted and measured makespan, below each rank's speed factor (measured
//! over predicted busy time, [`crate::run::estimate::SpeedEstimate::rank_factors`]) after it.

use crate::io::gantt::{Chart, render};
use crate::{Error, Result};
use plotters::coord::Shift;
use plotters::prelude::*;
use std::path::Path;

/// One step of the estimate: its id, predicted and measured makespan (seconds), and each rank's
/// factor after it.
#[derive(Debug, Clone, PartialEq)]
pub struct EstimatePoint {
    /// Step id.
    pub step: u64,
    /// Predicted makespan, seconds.
    pub predicted_s: f64,
    /// Measured makespan, seconds.
    pub measured_s: f64,
    /// Each rank's measured over predicted busy time after the step.
    pub rank_factors: Vec<f64>,
}

const COLORS: [RGBColor; 6] = [
    RGBColor(66, 133, 244),
    RGBColor(229, 57, 53),
    RGBColor(56, 142, 60),
    RGBColor(245, 124, 0),
    RGBColor(142, 36, 170),
    RGBColor(0, 151, 167),
];

struct EstimateChart<'a> {
    title: &'a str,
    points: &'a [EstimatePoint],
}

/// `(lo, hi)` of `values` with a tenth of the range (or 0.1) of room on both sides.
fn padded(values: impl Iterator<Item = f64>) -> (f64, f64) {
    let (lo, hi) = values
        .filter(|v| v.is_finite())
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), v| {
            (a.min(v), b.max(v))
        });
    if !lo.is_finite() {
        return (0.0, 1.0);
    }
    let pad = ((hi - lo) * 0.1).max(0.1 * hi.abs().max(1e-9));
    (lo - pad, hi + pad)
}

impl EstimateChart<'_> {
    /// One panel: `series` of (name, color, y per point) over the steps.
    fn panel<DB: DrawingBackend>(
        &self,
        area: &DrawingArea<DB, Shift>,
        (caption, y_desc): (&str, &str),
        series: &[(String, RGBColor, Vec<f64>)],
    ) -> std::result::Result<(), String> {
        let e = |x: DrawingAreaErrorKind<DB::ErrorType>| x.to_string();
        let first = self.points.first().map_or(0, |p| p.step) as f64;
        let last = self.points.last().map_or(1, |p| p.step) as f64;
        let (lo, hi) = padded(series.iter().flat_map(|s| s.2.iter().copied()));
        let mut chart = ChartBuilder::on(area)
            .caption(caption, ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(64)
            .build_cartesian_2d(first..last.max(first + 1.0), lo..hi)
            .map_err(e)?;
        chart
            .configure_mesh()
            .x_desc("step")
            .y_desc(y_desc)
            .draw()
            .map_err(e)?;
        for (name, color, ys) in series {
            let pts: Vec<(f64, f64)> = self
                .points
                .iter()
                .zip(ys)
                .map(|(p, &y)| (p.step as f64, y))
                .collect();
            let c = *color;
            chart
                .draw_series(LineSeries::new(pts.clone(), c.stroke_width(2)))
                .map_err(e)?
                .label(name.as_str())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], c));
            chart
                .draw_series(pts.into_iter().map(|p| Circle::new(p, 3, c.filled())))
                .map_err(e)?;
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()
            .map_err(e)?;
        Ok(())
    }
}

impl Chart for EstimateChart<'_> {
    fn size(&self) -> (u32, u32) {
        (1200, 800)
    }

    fn draw<DB: DrawingBackend>(
        &self,
        root: &DrawingArea<DB, Shift>,
    ) -> std::result::Result<(), String> {
        let e = |x: DrawingAreaErrorKind<DB::ErrorType>| x.to_string();
        root.fill(&WHITE).map_err(e)?;
        let root = root.titled(self.title, ("sans-serif", 24)).map_err(e)?;
        let (top, bottom) = root.split_vertically(400);
        let times = [
            (
                "predicted".to_string(),
                COLORS[0],
                self.points.iter().map(|p| p.predicted_s).collect(),
            ),
            (
                "measured".to_string(),
                COLORS[1],
                self.points.iter().map(|p| p.measured_s).collect(),
            ),
        ];
        self.panel(&top, ("step makespan", "seconds"), &times)?;
        let ranks = self
            .points
            .iter()
            .map(|p| p.rank_factors.len())
            .max()
            .unwrap_or(0);
        let factors: Vec<(String, RGBColor, Vec<f64>)> = (0..ranks)
            .map(|r| {
                (
                    format!("rank {r}"),
                    COLORS[r % COLORS.len()],
                    self.points
                        .iter()
                        .map(|p| p.rank_factors.get(r).copied().unwrap_or(f64::NAN))
                        .collect(),
                )
            })
            .collect();
        self.panel(
            &bottom,
            (
                "speed factor per rank after each step",
                "measured / predicted busy time",
            ),
            &factors,
        )
    }
}

/// Writes the chart of `points` to `path` (`.svg` or `.png`, atomically) under `title`.
///
/// # Errors
/// [`Error::InvalidArgument`] for no point; [`Error::Plot`] when the chart cannot be drawn or
/// written.
pub fn write_estimate_chart(path: &Path, title: &str, points: &[EstimatePoint]) -> Result<()> {
    if points.is_empty() {
        return Err(Error::invalid(
            "estimate chart",
            path.display(),
            "at least one measured step with a prediction",
        ));
    }
    render(path, &EstimateChart { title, points })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_chart_is_an_svg_with_both_panels_and_every_rank() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("e.svg");
        let points: Vec<EstimatePoint> = (0..5)
            .map(|k| EstimatePoint {
                step: k,
                predicted_s: 1.0,
                measured_s: 1.0 + 0.1 * k as f64,
                rank_factors: vec![1.0, 1.0 + 0.1 * k as f64],
            })
            .collect();
        write_estimate_chart(&path, "t", &points).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        for text in ["step makespan", "speed factor", "measured", "rank 1"] {
            assert!(svg.contains(text), "{text}");
        }
        assert!(write_estimate_chart(&path, "t", &[]).is_err());
    }
}
