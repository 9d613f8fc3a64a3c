//! How the commands print: JSON or a plain table, progress on stderr, numbers, chart paths and
//! titles.

use super::*;

/// `1/2/3`: a list joined with slashes (microbatches per replica, layers per stage), a run of
/// three or more equal values written once with its count: `2/3 x4/2`, `1 x128`.
pub(super) fn slash_list<T: ToString>(xs: impl IntoIterator<Item = T>) -> String {
    let mut runs: Vec<(String, usize)> = Vec::new();
    for x in xs {
        let x = x.to_string();
        match runs.last_mut() {
            Some((last, n)) if *last == x => *n += 1,
            _ => runs.push((x, 1)),
        }
    }
    let mut parts = Vec::new();
    for (x, n) in runs {
        if n >= 3 {
            parts.push(format!("{x} x{n}"));
        } else {
            parts.extend(std::iter::repeat_n(x, n));
        }
    }
    parts.join("/")
}

pub(super) fn emit<T: Serialize>(
    format: Format,
    reports: &T,
    header: &str,
    table: &PlainTable,
    notes: &[String],
) -> Result<ExitCode> {
    match format {
        Format::Json => {
            outln!("{}", serde_json::to_string_pretty(reports)?);
            eprintln!("{header}");
            for n in notes {
                eprintln!("{n}");
            }
        }
        Format::Table => {
            outln!("{header}");
            outln!("{table}");
            for n in notes {
                outln!("{n}");
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// A results table: plain columns three spaces apart, no borders and no trailing spaces
/// (copied into a document or a spreadsheet as it is, and what the README shows).
pub(super) struct PlainTable(Table);

impl std::ops::Deref for PlainTable {
    type Target = Table;
    fn deref(&self) -> &Table {
        &self.0
    }
}

impl std::ops::DerefMut for PlainTable {
    fn deref_mut(&mut self) -> &mut Table {
        &mut self.0
    }
}

impl std::fmt::Display for PlainTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let text = self.0.to_string();
        let lines: Vec<&str> = text.lines().map(str::trim_end).collect();
        f.write_str(&lines.join("\n"))
    }
}

pub(super) fn new_table(header: &[&str]) -> PlainTable {
    let mut t = Table::new();
    t.load_preset(NOTHING);
    t.set_header(header.to_vec());
    for c in t.column_iter_mut() {
        c.set_padding((0, 3));
    }
    PlainTable(t)
}

pub(super) fn pct(x: f64) -> String {
    format!("{:.1}%", 100.0 * x)
}

pub(super) fn dedup<T: PartialEq>(v: Vec<T>) -> Vec<T> {
    let mut out: Vec<T> = Vec::with_capacity(v.len());
    for x in v {
        if !out.contains(&x) {
            out.push(x);
        }
    }
    out
}

/// Progress as plain lines on stderr when it is not a terminal (a batch job, a pipe), where a
/// bar draws nothing: `plan: 120/640 candidates at 6 s`, after the first second and then at
/// most every 5 s, and at the end. Silent on a terminal (the bar shows it there).
pub(super) struct ProgressLines {
    what: &'static str,
    unit: &'static str,
    plain: bool,
    start: std::time::Instant,
    /// Seconds from `start` of the last line, as f64 bits (0: none yet).
    last: std::sync::atomic::AtomicU64,
    /// The line of the end is out.
    ended: std::sync::atomic::AtomicBool,
}

impl ProgressLines {
    pub(super) fn new(what: &'static str, unit: &'static str) -> Self {
        ProgressLines {
            what,
            unit,
            plain: !std::io::IsTerminal::is_terminal(&std::io::stderr()),
            start: std::time::Instant::now(),
            last: 0f64.to_bits().into(),
            ended: false.into(),
        }
    }

    /// `done` of `total` are finished.
    pub(super) fn report(&self, done: u64, total: u64) {
        use std::sync::atomic::Ordering;
        if !self.plain || self.ended.load(Ordering::Relaxed) {
            return;
        }
        let done = done.min(total);
        let now = self.start.elapsed().as_secs_f64();
        let last = f64::from_bits(self.last.load(Ordering::Relaxed));
        let due = if last == 0.0 {
            now >= 1.0
        } else {
            now - last >= 5.0
        };
        let end = done == total && last > 0.0 && !self.ended.swap(true, Ordering::Relaxed);
        if (due || end)
            && self
                .last
                .compare_exchange(
                    last.to_bits(),
                    now.to_bits(),
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                )
                .is_ok()
        {
            eprintln!("{}: {done}/{total} {} at {now:.0} s", self.what, self.unit);
        }
    }
}

/// A progress bar on stderr that appears only once the work has run for a second.
pub(super) struct Progress {
    bar: indicatif::ProgressBar,
    start: std::time::Instant,
    shown: std::sync::atomic::AtomicBool,
    lines: ProgressLines,
}

impl Progress {
    pub(super) fn new(len: u64) -> Self {
        let bar = indicatif::ProgressBar::with_draw_target(
            Some(len),
            indicatif::ProgressDrawTarget::hidden(),
        );
        if let Ok(style) = indicatif::ProgressStyle::with_template(
            "{bar:40} {pos}/{len} steps  {elapsed} (eta {eta})",
        ) {
            bar.set_style(style);
        }
        Progress {
            bar,
            start: std::time::Instant::now(),
            shown: false.into(),
            lines: ProgressLines::new("progress", "steps"),
        }
    }

    pub(super) fn inc(&self) {
        self.inc_by(1);
    }

    fn inc_by(&self, n: u64) {
        use std::sync::atomic::Ordering;
        if !self.shown.load(Ordering::Relaxed)
            && self.start.elapsed() > std::time::Duration::from_secs(1)
            && !self.shown.swap(true, Ordering::Relaxed)
        {
            self.bar
                .set_draw_target(indicatif::ProgressDrawTarget::stderr());
        }
        self.bar.inc(n);
        self.lines
            .report(self.bar.position(), self.bar.length().unwrap_or(0));
    }

    pub(super) fn finish(&self) {
        self.bar.finish_and_clear();
    }
}

/// A schedule name fit for a file name (a CSV schedule is named after its path).
pub(super) fn sanitize(name: &str) -> String {
    name.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// `out.png` + `1f1b` -> `out-1f1b.png`.
pub(super) fn sibling(path: &Path, tag: &str) -> PathBuf {
    let stem = path
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    let ext = path
        .extension()
        .map(|e| format!(".{}", e.to_string_lossy()))
        .unwrap_or_default();
    path.with_file_name(format!("{stem}-{tag}{ext}"))
}

/// Cuts one step into flat microbatches; warns about sequences longer than the token budget.
/// Seconds with a unit that fits.
pub(super) fn fmt_s(s: f64) -> String {
    if s >= 1.0 {
        format!("{s:.3} s")
    } else if s >= 1e-3 {
        format!("{:.3} ms", s * 1e3)
    } else {
        format!("{:.1} µs", s * 1e6)
    }
}

/// The exposed expert-parallel all-to-all of a row, of the whole it pays (its busiest rank's,
/// mean over steps): `0.412 s of 1.230 s`; `-` without expert parallelism.
pub(super) fn all_to_all_cell(a: Option<sim::AllToAllTime>) -> String {
    a.map_or("-".into(), |a| {
        format!("{} of {}", fmt_s(a.exposed_s), fmt_s(a.total_s))
    })
}

pub(super) fn fmt_bytes(b: f64) -> String {
    format!("{:.2} GiB", b / (1u64 << 30) as f64)
}

pub(super) fn gantt_title(
    name: &str,
    schedule: &sim::Schedule,
    v: u32,
    m: &sim::Metrics,
) -> String {
    format!(
        "{name}  p={} v={v} m={}  makespan {}  bubble {:.1}%",
        schedule.placement.num_ranks,
        schedule.num_microbatches,
        fmt_s(m.makespan_s),
        100.0 * m.bubble_ratio
    )
}

#[cfg(test)]
mod slash_list_tests {
    use super::slash_list;

    #[test]
    fn runs_of_three_or_more_are_counted() {
        assert_eq!(slash_list([1, 2, 3]), "1/2/3");
        assert_eq!(slash_list([2, 3, 3, 3, 3, 2]), "2/3 x4/2");
        assert_eq!(slash_list([5, 5, 7]), "5/5/7");
        assert_eq!(slash_list(vec![1; 128]), "1 x128");
        assert_eq!(slash_list(Vec::<u32>::new()), "");
    }
}
