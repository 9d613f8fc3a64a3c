//! Gantt charts of a timeline (SVG or PNG by the file extension), drawn with plotters.
//!
//! One row per rank, top to bottom; F blue, I orange, W green, B purple, Fo grey-blue, an
//! overlapped pair split in two halves (forward above, backward below), the optimizer step
//! light grey; a rank's later stages (chunks) darker, named in the legend; the microbatch number
//! on every box wide enough to hold it (the width grows with the busiest rank's action count, up
//! to 8,000 px). Idle time is the
//! pale row background left uncovered. A timeline with communication actions
//! ([`Timeline::comm`]: an imported trace's, or a lowered replay's) gets a thin comm lane under
//! each rank's compute: sends teal, receives brown, waits grey, FSDP's actions pink, each from
//! its posting to its end.

use crate::ir::comm::{CommAction, FsdpAction, LoweredAction};
use crate::ir::{Action, ActionKind};
use crate::replay::timeline::Timeline;
use crate::{Error, Result};
use plotters::coord::Shift;
use plotters::coord::types::RangedCoordf64;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use std::path::Path;
use std::sync::Once;

static FONT: Once = Once::new();

fn register_font() {
    FONT.call_once(|| {
        // DejaVu Sans (Bitstream Vera licence, assets/DejaVuSans-LICENSE.txt): plotters' bitmap
        // backend needs a font to draw text and we ship one instead of relying on fontconfig.
        let _ = plotters::style::register_font(
            "sans-serif",
            FontStyle::Normal,
            include_bytes!("../../assets/DejaVuSans.ttf"),
        );
    });
}

/// Fill colour of an action kind.
pub fn color(kind: ActionKind) -> RGBColor {
    match kind {
        ActionKind::F => RGBColor(66, 133, 244),
        ActionKind::I => RGBColor(245, 124, 0),
        ActionKind::W => RGBColor(56, 142, 60),
        ActionKind::B => RGBColor(142, 36, 170),
        ActionKind::Fo => RGBColor(96, 125, 139),
    }
}

/// The colour of `kind` on a rank's `chunk`-th stage: later chunks are drawn darker so that
/// interleaved and V schedules show which stage ran.
fn chunk_color(kind: ActionKind, chunk: usize) -> RGBColor {
    let RGBColor(r, g, b) = color(kind);
    let k = 1.0 - 0.15 * (chunk.min(3) as f64);
    let d = |c: u8| (c as f64 * k).round() as u8;
    RGBColor(d(r), d(g), d(b))
}

/// The stage ids a rank's ops run, ascending: its chunks, first to last.
fn rank_stages(ops: &[crate::replay::timeline::TimedOp]) -> Vec<u32> {
    let mut stages: Vec<u32> = ops
        .iter()
        .flat_map(|o| o.action.parts())
        .map(|a| a.stage.0)
        .collect();
    stages.sort_unstable();
    stages.dedup();
    stages
}

fn time_unit(makespan_s: f64) -> (f64, &'static str) {
    if makespan_s >= 1.0 {
        (1.0, "s")
    } else if makespan_s >= 1e-3 {
        (1e3, "ms")
    } else {
        (1e6, "µs")
    }
}

/// Rank r's row spans y from [`row_bottom`] to that + 1 in the chart's data coordinates (rank 0
/// on top); boxes leave this much of the row free above and below.
const ROW_PAD: f64 = 0.12;

/// The bottom of rank `r`'s row of `p`, in the chart's data coordinates.
fn row_bottom(p: usize, r: usize) -> f64 {
    (p - 1 - r) as f64
}

/// The chart's data coordinates: x in time units (`time_unit`), y in rows.
type Plane = Cartesian2d<RangedCoordf64, RangedCoordf64>;
/// A box in the chart's data coordinates.
type DataBox = Rectangle<(f64, f64)>;
/// A label in the chart's data coordinates.
type DataText = Text<'static, (f64, f64), String>;

fn draw<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    title: &str,
    t: &Timeline,
) -> std::result::Result<(), String> {
    let e = |x: DrawingAreaErrorKind<DB::ErrorType>| x.to_string();
    root.fill(&WHITE).map_err(e)?;
    let p = t.num_ranks().max(1);
    let makespan_s = (t.makespan_ns() as f64 * 1e-9).max(1e-12);
    let (scale, unit) = time_unit(makespan_s);
    let x_max = makespan_s * scale;
    // The title and, on its own line below it, the legend: neither covers the other nor a bar.
    let (w, _) = root.dim_in_pixel();
    let (_, body) = root.split_vertically(LEGEND_BAND_PX);
    root.draw(&Text::new(
        title,
        (w as i32 / 2, 20),
        ("sans-serif", 22)
            .into_font()
            .color(&BLACK)
            .pos(Pos::new(HPos::Center, VPos::Center)),
    ))
    .map_err(e)?;
    let mut chart = ChartBuilder::on(&body)
        .margin(12)
        .margin_left(80)
        .x_label_area_size(40)
        .build_cartesian_2d(0f64..x_max, 0f64..p as f64)
        .map_err(e)?;
    chart
        .configure_mesh()
        .disable_y_mesh()
        .disable_y_axis()
        .x_desc(format!("time ({unit})"))
        .label_style(("sans-serif", 14))
        .draw()
        .map_err(e)?;
    // Row backgrounds: what stays visible is idle time.
    chart
        .draw_series((0..p).map(|r| {
            Rectangle::new(
                [
                    (0.0, row_bottom(p, r) + ROW_PAD),
                    (x_max, row_bottom(p, r) + 1.0 - ROW_PAD),
                ],
                RGBColor(236, 239, 241).filled(),
            )
        }))
        .map_err(e)?;
    let px_per_unit = {
        let (a, _) = chart.backend_coord(&(0.0, 0.0));
        let (b, _) = chart.backend_coord(&(x_max, 0.0));
        (b - a).max(1) as f64 / x_max
    };
    let (boxes, labels) = op_boxes(t, p, scale, px_per_unit);
    chart.draw_series(boxes).map_err(e)?;
    chart.draw_series(comm_boxes(t, p, scale)).map_err(e)?;
    chart.draw_series(labels).map_err(e)?;
    draw_rank_names(root, &chart, p).map_err(e)?;
    draw_legend(root, w, &legend_entries(t)).map_err(e)?;
    root.present().map_err(e)?;
    Ok(())
}

/// Every op's box (split in two halves for an overlapped pair: forward above, backward
/// below), its thin white edge and each rank's optimizer step, with the microbatch labels of
/// the boxes wide enough to hold them; in data coordinates, x = seconds * `scale`, for `p`
/// rows, `px_per_unit` pixels per x unit.
fn op_boxes(t: &Timeline, p: usize, scale: f64, px_per_unit: f64) -> (Vec<DataBox>, Vec<DataText>) {
    let label_style = ("sans-serif", 11)
        .into_font()
        .color(&WHITE)
        .pos(Pos::new(HPos::Center, VPos::Center));
    let mut boxes = Vec::new();
    let mut labels = Vec::new();
    let lane = if has_comm_lanes(t) { COMM_LANE } else { 0.0 };
    for (r, ops) in t.compute.iter().enumerate() {
        let (y0, y1) = (
            row_bottom(p, r) + ROW_PAD + lane,
            row_bottom(p, r) + 1.0 - ROW_PAD,
        );
        let stages = rank_stages(ops);
        let chunk = |s: u32| stages.binary_search(&s).unwrap_or(0);
        for op in ops {
            let x0 = op.start_ns as f64 * 1e-9 * scale;
            let x1 = op.end_ns as f64 * 1e-9 * scale;
            match op.action {
                Action::Compute(a) => {
                    boxes.push(Rectangle::new(
                        [(x0, y0), (x1, y1)],
                        chunk_color(a.kind, chunk(a.stage.0)).filled(),
                    ));
                    let text = a.microbatch.to_string();
                    if (x1 - x0) * px_per_unit >= 7.0 * text.len() as f64 + 2.0 {
                        labels.push(Text::new(
                            text,
                            ((x0 + x1) / 2.0, (y0 + y1) / 2.0),
                            label_style.clone(),
                        ));
                    }
                }
                Action::Overlap(f, b) => {
                    let mid = (y0 + y1) / 2.0;
                    boxes.push(Rectangle::new(
                        [(x0, mid), (x1, y1)],
                        chunk_color(f.kind, chunk(f.stage.0)).filled(),
                    ));
                    boxes.push(Rectangle::new(
                        [(x0, y0), (x1, mid)],
                        chunk_color(b.kind, chunk(b.stage.0)).filled(),
                    ));
                    if (x1 - x0) * px_per_unit >= 30.0 {
                        let s = label_style.clone();
                        labels.push(Text::new(
                            format!("{}/{}", f.microbatch, b.microbatch),
                            ((x0 + x1) / 2.0, mid),
                            s,
                        ));
                    }
                }
            }
            // A thin white edge keeps adjacent boxes apart.
            boxes.push(Rectangle::new([(x0, y0), (x1, y1)], WHITE.stroke_width(1)));
        }
        if let Some(Some((a, b))) = t.optimizer.get(r) {
            let (x0, x1) = (*a as f64 * 1e-9 * scale, *b as f64 * 1e-9 * scale);
            boxes.push(Rectangle::new(
                [(x0, y0), (x1, y1)],
                RGBColor(176, 176, 176).filled(),
            ));
        }
    }
    (boxes, labels)
}

/// Height of the comm lane at the bottom of a rank's row, in rows, when the timeline has comm
/// lanes; the compute boxes sit above it.
const COMM_LANE: f64 = 0.22;

/// Whether some rank has communication actions to draw ([`Timeline::comm`]).
fn has_comm_lanes(t: &Timeline) -> bool {
    t.comm.iter().any(|l| !l.is_empty())
}

/// The colour and legend name of a communication action on a comm lane.
fn comm_color(a: LoweredAction) -> (&'static str, RGBColor) {
    match a {
        LoweredAction::Comm(CommAction::Send(_)) => ("send", RGBColor(0, 150, 136)),
        LoweredAction::Comm(CommAction::Recv(_)) => ("recv", RGBColor(121, 85, 72)),
        LoweredAction::Fsdp(_, FsdpAction::WaitReduceGrad) | LoweredAction::WaitSend(_) => {
            ("wait", RGBColor(120, 120, 120))
        }
        LoweredAction::Fsdp(..) => ("FSDP", RGBColor(216, 27, 96)),
        LoweredAction::AllToAll(_) => ("all-to-all", RGBColor(253, 216, 53)),
        LoweredAction::Compute(_) => ("compute", RGBColor(0, 0, 0)),
    }
}

/// Each rank's communication actions as thin boxes in the comm lane under its compute (a
/// zero-length span drawn one pixel-ish wide is left as it is: invisible).
fn comm_boxes(t: &Timeline, p: usize, scale: f64) -> Vec<DataBox> {
    let mut boxes = Vec::new();
    // With FSDP's actions too, the lane splits: point-to-point above, collectives below.
    let split = t.comm.iter().flatten().any(|c| {
        matches!(
            c.action,
            LoweredAction::Fsdp(..) | LoweredAction::AllToAll(_)
        )
    });
    for (r, lane) in t.comm.iter().enumerate().take(p) {
        let bottom = row_bottom(p, r) + ROW_PAD;
        let (mid, top) = (bottom + (COMM_LANE - 0.04) / 2.0, bottom + COMM_LANE - 0.04);
        for c in lane {
            let fsdp = matches!(
                c.action,
                LoweredAction::Fsdp(..) | LoweredAction::AllToAll(_)
            );
            let (y0, y1) = match (split, fsdp) {
                (false, _) => (bottom, top),
                (true, true) => (bottom, mid),
                (true, false) => (mid, top),
            };
            let (x0, x1) = (
                c.start_ns as f64 * 1e-9 * scale,
                c.end_ns as f64 * 1e-9 * scale,
            );
            boxes.push(Rectangle::new(
                [(x0, y0), (x1, y1)],
                comm_color(c.action).1.mix(0.75).filled(),
            ));
        }
    }
    boxes
}

/// Rank names left of the `p` rows of `chart`; with rows thinner than the font, every k-th
/// rank's (and the last).
fn draw_rank_names<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    chart: &ChartContext<'_, DB, Plane>,
    p: usize,
) -> std::result::Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    let row_px = {
        let (_, a) = chart.backend_coord(&(0.0, 0.0));
        let (_, b) = chart.backend_coord(&(0.0, 1.0));
        (a - b).abs().max(1)
    };
    let font_px = row_px.clamp(9, 14);
    let every = (font_px as usize + 2).div_ceil(row_px as usize).max(1);
    let name_style = ("sans-serif", font_px)
        .into_font()
        .color(&BLACK)
        .pos(Pos::new(HPos::Right, VPos::Center));
    for r in (0..p).filter(|r| r % every == 0 || *r == p - 1) {
        let (x, y) = chart.backend_coord(&(0.0, row_bottom(p, r) + 0.5));
        root.draw(&Text::new(
            format!("rank {r}"),
            (x - 8, y),
            name_style.clone(),
        ))?;
    }
    Ok(())
}

/// What the legend lists, in order: the action kinds the chart shows, the shades of a rank's
/// later stages (interleaved, V) when some rank has several, and the optimizer step if drawn.
fn legend_entries(t: &Timeline) -> Vec<(&'static str, RGBColor)> {
    let shown = |k: ActionKind| {
        t.compute
            .iter()
            .flatten()
            .any(|o| o.action.parts().any(|a| a.kind == k))
    };
    let mut legend: Vec<(&str, RGBColor)> = [
        ("F", ActionKind::F),
        ("I", ActionKind::I),
        ("W", ActionKind::W),
        ("B", ActionKind::B),
        ("Fo", ActionKind::Fo),
    ]
    .into_iter()
    .filter(|(_, k)| shown(*k))
    .map(|(n, k)| (n, color(k)))
    .collect();
    let max_chunks = t
        .compute
        .iter()
        .map(|ops| rank_stages(ops).len())
        .max()
        .unwrap_or(1);
    if max_chunks > 1 {
        legend.push(("F, rank's 2nd stage", chunk_color(ActionKind::F, 1)));
    }
    if max_chunks > 2 {
        legend.push(("3rd", chunk_color(ActionKind::F, 2)));
    }
    if t.optimizer.iter().any(Option::is_some) {
        legend.push(("opt", RGBColor(176, 176, 176)));
    }
    for c in t.comm.iter().flatten() {
        let entry = comm_color(c.action);
        if !legend.iter().any(|(n, _)| *n == entry.0) {
            legend.push(entry);
        }
    }
    legend
}

/// The legend, centred on its own line under the title of a chart `w` pixels wide: a swatch
/// and a name per entry.
fn draw_legend<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    w: u32,
    legend: &[(&str, RGBColor)],
) -> std::result::Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    let slot = |name: &str| 34 + 8 * name.chars().count() as i32;
    let mut x = (w as i32 - legend.iter().map(|(n, _)| slot(n)).sum::<i32>()) / 2;
    for &(name, c) in legend {
        root.draw(&Rectangle::new([(x, 40), (x + 14, 54)], c.filled()))?;
        root.draw(&Text::new(
            name,
            (x + 18, 47),
            ("sans-serif", 13)
                .into_font()
                .color(&BLACK)
                .pos(Pos::new(HPos::Left, VPos::Center)),
        ))?;
        x += slot(name);
    }
    Ok(())
}

/// Checks that `path` names a chart format (`.svg` or `.png`), before any work is done.
///
/// # Errors
/// [`Error::Plot`] naming the path and the formats.
pub fn check_chart_path(path: &Path) -> Result<()> {
    let ext = path
        .extension()
        .and_then(|e| e.to_str())
        .map(str::to_ascii_lowercase)
        .unwrap_or_default();
    if ext == "svg" || ext == "png" {
        Ok(())
    } else {
        Err(Error::Plot {
            path: path.display().to_string(),
            message: format!("unknown chart format `{ext}`: use a .svg or .png file name"),
        })
    }
}

/// Something drawable on any plotters backend.
pub(crate) trait Chart {
    /// Size in pixels.
    fn size(&self) -> (u32, u32);
    /// Draws onto `root`.
    fn draw<DB: DrawingBackend>(
        &self,
        root: &DrawingArea<DB, Shift>,
    ) -> std::result::Result<(), String>;
}

/// Pixel size of a Gantt chart: 12 px per action of the busiest rank (so one-digit microbatch
/// labels fit in a box of a step with no bubbles), at least 1,600 and at most 8,000 wide; rows
/// 44 px high up to 64 ranks, then the height stays at 64 ranks' (2,990 px) and rows thin.
fn gantt_size(t: &Timeline) -> (u32, u32) {
    let rows = t.num_ranks().max(1) as u32;
    let actions = t.compute.iter().map(Vec::len).max().unwrap_or(0) as u32;
    let width = (200 + 12 * actions).clamp(1600, 8000);
    (width, 80 + LEGEND_BAND_PX + 44 * rows.min(64) + 30)
}

/// Height of the band above the chart that holds the title and the legend, px.
const LEGEND_BAND_PX: u32 = 64;

struct Gantt<'a> {
    title: &'a str,
    timeline: &'a Timeline,
}

impl Chart for Gantt<'_> {
    fn size(&self) -> (u32, u32) {
        gantt_size(self.timeline)
    }
    fn draw<DB: DrawingBackend>(
        &self,
        root: &DrawingArea<DB, Shift>,
    ) -> std::result::Result<(), String> {
        draw(root, self.title, self.timeline)
    }
}

/// Renders `chart` to `path` (`.svg` or `.png`) atomically: a temporary file in the same
/// directory, renamed over the target.
pub(crate) fn render(path: &Path, chart: &impl Chart) -> Result<()> {
    register_font();
    let plot_err = |message: String| Error::Plot {
        path: path.display().to_string(),
        message,
    };
    let ext = path
        .extension()
        .and_then(|e| e.to_str())
        .map(str::to_ascii_lowercase)
        .unwrap_or_default();
    let size = chart.size();
    match ext.as_str() {
        "svg" => {
            let mut svg = String::new();
            {
                let root = SVGBackend::with_string(&mut svg, size).into_drawing_area();
                chart.draw(&root).map_err(plot_err)?;
            }
            flatpipe_profiles::write_atomic(path, svg.as_bytes())?;
        }
        "png" => {
            let dir = match path.parent() {
                Some(d) if !d.as_os_str().is_empty() => d,
                _ => Path::new("."),
            };
            let mut builder = tempfile::Builder::new();
            builder.prefix(".flatpipe-").suffix(".png");
            // A temporary file is created private (0600); charts are ordinary files (0644),
            // like `write_atomic`'s outputs.
            #[cfg(unix)]
            {
                use std::os::unix::fs::PermissionsExt;
                builder.permissions(std::fs::Permissions::from_mode(0o644));
            }
            let tmp = builder
                .tempfile_in(dir)
                .map_err(|e| plot_err(e.to_string()))?;
            {
                let root = BitMapBackend::new(tmp.path(), size).into_drawing_area();
                chart.draw(&root).map_err(plot_err)?;
            }
            // Through `write_atomic`, which writes symbolic links' targets and devices in place.
            let bytes = std::fs::read(tmp.path()).map_err(|e| plot_err(e.to_string()))?;
            flatpipe_profiles::write_atomic(path, &bytes)?;
        }
        other => {
            return Err(plot_err(format!(
                "unknown chart format `{other}`: use a .svg or .png file name"
            )));
        }
    }
    Ok(())
}

/// Writes the Gantt chart of `timeline` to `path` (`.svg` or `.png`), atomically (a temporary
/// file in the same directory, renamed over the target).
///
/// # Errors
/// [`Error::Plot`] if the extension is neither svg nor png or drawing / writing fails.
pub fn write_gantt(path: &Path, title: &str, timeline: &Timeline) -> Result<()> {
    render(path, &Gantt { title, timeline })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ScheduleKind;
    use crate::costs::{UniformCostSpec, UniformCosts};

    fn timeline(kind: ScheduleKind, p: u32, v: u32, m: u32) -> Timeline {
        let s = kind.generate(p, v, m).unwrap();
        crate::simulate(&s, &UniformCosts::new(&UniformCostSpec::default(), v))
            .unwrap()
            .timeline
    }

    /// The width follows the busiest rank's action count (1F1B: 2m actions per rank, each 12
    /// px, plus 200 px of margins), between 1,600 and 8,000 px.
    #[test]
    fn width_grows_with_the_actions_up_to_a_cap() {
        assert_eq!(
            gantt_size(&timeline(ScheduleKind::OneFOneB, 4, 1, 8)).0,
            1600
        );
        assert_eq!(
            gantt_size(&timeline(ScheduleKind::OneFOneB, 4, 1, 200)).0,
            200 + 12 * 400
        );
        assert_eq!(
            gantt_size(&timeline(ScheduleKind::OneFOneB, 2, 1, 1000)).0,
            8000
        );
    }

    /// Interleaved charts name the darker shade of a rank's later stages in the legend; a PNG is
    /// an ordinary 0644 file like every other output (not a temporary file's 0600).
    #[test]
    fn legend_names_later_stages_and_png_is_0644() {
        let dir = tempfile::tempdir().unwrap();
        let svg = dir.path().join("g.svg");
        write_gantt(&svg, "t", &timeline(ScheduleKind::Interleaved1F1B, 2, 2, 4)).unwrap();
        assert!(std::fs::read_to_string(&svg).unwrap().contains("2nd stage"));
        let one = dir.path().join("one.svg");
        write_gantt(&one, "t", &timeline(ScheduleKind::OneFOneB, 2, 1, 4)).unwrap();
        assert!(!std::fs::read_to_string(&one).unwrap().contains("2nd stage"));
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let png = dir.path().join("g.png");
            write_gantt(&png, "t", &timeline(ScheduleKind::OneFOneB, 2, 1, 4)).unwrap();
            let mode = std::fs::metadata(&png).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o644, "{mode:o}");
        }
    }
}
