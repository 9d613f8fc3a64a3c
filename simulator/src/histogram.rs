//! Histograms of step times (SVG or PNG by the file extension), drawn with plotters.

use crate::gantt::{Chart, render};
use crate::{Error, Result};
use plotters::coord::Shift;
use plotters::prelude::*;
use std::path::Path;

const PALETTE: [RGBColor; 10] = [
    RGBColor(142, 36, 170),
    RGBColor(245, 124, 0),
    RGBColor(66, 133, 244),
    RGBColor(56, 142, 60),
    RGBColor(229, 57, 53),
    RGBColor(0, 151, 167),
    RGBColor(121, 85, 72),
    RGBColor(233, 30, 99),
    RGBColor(96, 125, 139),
    RGBColor(205, 220, 57),
];

struct Histogram<'a> {
    title: &'a str,
    series: &'a [(String, Vec<f64>)],
}

impl Chart for Histogram<'_> {
    fn size(&self) -> (u32, u32) {
        (1200, 600)
    }

    fn draw<DB: DrawingBackend>(
        &self,
        root: &DrawingArea<DB, Shift>,
    ) -> std::result::Result<(), String> {
        let e = |x: DrawingAreaErrorKind<DB::ErrorType>| x.to_string();
        root.fill(&WHITE).map_err(e)?;
        let all = self.series.iter().flat_map(|(_, v)| v.iter().copied());
        let (lo, hi) = all.fold((f64::MAX, f64::MIN), |(a, b), x| (a.min(x), b.max(x)));
        let (lo, hi) = if lo >= hi {
            (lo - 0.5, lo + 0.5)
        } else {
            (lo, hi)
        };
        let bins = 40usize;
        let width = (hi - lo) / bins as f64;
        let counts: Vec<Vec<u32>> = self
            .series
            .iter()
            .map(|(_, v)| {
                let mut c = vec![0u32; bins];
                for &x in v {
                    c[(((x - lo) / width) as usize).min(bins - 1)] += 1;
                }
                c
            })
            .collect();
        let ymax = counts.iter().flatten().copied().max().unwrap_or(1).max(1);
        let mut chart = ChartBuilder::on(root)
            .caption(self.title, ("sans-serif", 22))
            .margin(14)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d(lo..hi, 0u32..ymax + ymax / 10 + 1)
            .map_err(e)?;
        chart
            .configure_mesh()
            .x_desc("step time (s)")
            .y_desc("steps")
            .label_style(("sans-serif", 14))
            .draw()
            .map_err(e)?;
        for (i, ((name, _), c)) in self.series.iter().zip(&counts).enumerate() {
            let color = PALETTE[i % PALETTE.len()];
            // A step outline per series, so overlapping distributions stay readable.
            let mut outline = vec![(lo, 0u32)];
            for (b, &n) in c.iter().enumerate() {
                let x0 = lo + b as f64 * width;
                outline.push((x0, n));
                outline.push((x0 + width, n));
            }
            outline.push((hi, 0));
            chart
                .draw_series(
                    c.iter()
                        .enumerate()
                        .filter(|(_, n)| **n > 0)
                        .map(|(b, &n)| {
                            let x0 = lo + b as f64 * width;
                            Rectangle::new([(x0, 0), (x0 + width, n)], color.mix(0.15).filled())
                        }),
                )
                .map_err(e)?;
            chart
                .draw_series(std::iter::once(PathElement::new(
                    outline,
                    color.stroke_width(2),
                )))
                .map_err(e)?
                .label(name.clone())
                .legend(move |(x, y)| {
                    Rectangle::new([(x, y - 6), (x + 14, y + 6)], color.filled())
                });
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.9))
            .border_style(BLACK)
            .label_font(("sans-serif", 14))
            .draw()
            .map_err(e)?;
        root.present().map_err(e)
    }
}

/// Writes a histogram of each named series of step times (seconds) to `path` (`.svg` or
/// `.png`), atomically.
///
/// # Errors
/// [`Error::Plot`] for an unknown extension, empty data, or a drawing or writing failure.
pub fn write_histogram(path: &Path, title: &str, series: &[(String, Vec<f64>)]) -> Result<()> {
    if series.iter().all(|(_, v)| v.is_empty()) {
        return Err(Error::Plot {
            path: path.display().to_string(),
            message: "no step times to draw".into(),
        });
    }
    render(path, &Histogram { title, series })
}
