//! Histograms of step times (SVG or PNG by the file extension), drawn with plotters.

use crate::io::gantt::{Chart, render};
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

/// Equal-width bins over all series' values. When the largest value lies further above the
/// pooled 99th percentile than the whole range below it (one step 100x the median), the bins
/// span `[min, p99]` and one more bin at the end counts every value above (`overflow_from`), so
/// a single outlier does not squeeze every series into the first bin.
#[derive(Debug, Clone, PartialEq)]
struct Bins {
    /// Left edge of the first bin, seconds.
    lo: f64,
    /// Bin width, seconds.
    width: f64,
    /// Per series, the count of each bin (the overflow bin last, when there is one).
    counts: Vec<Vec<u32>>,
    /// Values above this went into the last bin.
    overflow_from: Option<f64>,
}

impl Bins {
    fn of(series: &[(String, Vec<f64>)], bins: usize) -> Self {
        let mut all: Vec<f64> = series
            .iter()
            .flat_map(|(_, v)| v.iter().copied())
            .filter(|x| x.is_finite())
            .collect();
        all.sort_by(f64::total_cmp);
        let (lo, max) = match (all.first(), all.last()) {
            (Some(&a), Some(&b)) => (a, b),
            _ => (0.0, 1.0),
        };
        let p99 = all
            .get(((all.len() as f64 - 1.0) * 0.99).round() as usize)
            .copied()
            .unwrap_or(max);
        let clip = p99 > lo && max - p99 > p99 - lo;
        let hi = if clip { p99 } else { max };
        let (lo, hi) = if lo >= hi {
            (lo - 0.5, lo + 0.5)
        } else {
            (lo, hi)
        };
        let width = (hi - lo) / bins as f64;
        let total = bins + usize::from(clip);
        let counts = series
            .iter()
            .map(|(_, v)| {
                let mut c = vec![0u32; total];
                for &x in v.iter().filter(|x| x.is_finite()) {
                    let b = if clip && x > hi {
                        bins
                    } else {
                        (((x - lo) / width).max(0.0) as usize).min(bins - 1)
                    };
                    c[b] += 1;
                }
                c
            })
            .collect();
        Bins {
            lo,
            width,
            counts,
            overflow_from: clip.then_some(hi),
        }
    }
}

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
        let bins = Bins::of(self.series, 40);
        let (lo, width) = (bins.lo, bins.width);
        let counts = &bins.counts;
        let hi = lo + width * bins.counts.first().map_or(1, Vec::len) as f64;
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
            .x_desc(match bins.overflow_from {
                Some(x) => format!(
                    "step time (s); axis clipped at the 99th percentile: the last bin counts the steps over {x:.4} s"
                ),
                None => "step time (s)".into(),
            })
            .y_desc("steps")
            .label_style(("sans-serif", 14))
            .draw()
            .map_err(e)?;
        for (i, ((name, _), c)) in self.series.iter().zip(counts).enumerate() {
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

#[cfg(test)]
mod tests {
    use super::*;

    /// 999 steps spread over [1, 2) s and one of 100 s (the 3,300 s outlier case): the bins
    /// span the 999 and the outlier sits alone in the overflow bin; without an outlier there
    /// is no overflow bin.
    #[test]
    fn one_outlier_goes_to_an_overflow_bin() {
        let mut v: Vec<f64> = (0..999).map(|i| 1.0 + i as f64 / 999.0).collect();
        v.push(100.0);
        let b = Bins::of(&[("a".into(), v.clone())], 40);
        let c = &b.counts[0];
        assert_eq!(c.len(), 41);
        assert!(c[40] >= 1 && c[40] <= 11, "{c:?}");
        assert_eq!(c.iter().sum::<u32>(), 1000);
        // The 999 regular steps are spread over the 40 bins, ~25 each.
        assert!(c[..40].iter().all(|&n| (15..=35).contains(&n)), "{c:?}");
        let hi = b.overflow_from.unwrap();
        assert!((1.98..=2.0).contains(&hi), "{hi}");
        v.pop();
        let b = Bins::of(&[("a".into(), v)], 40);
        assert_eq!(b.counts[0].len(), 40);
        assert_eq!(b.overflow_from, None);
    }
}
