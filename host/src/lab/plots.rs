//! The run report's pictures (SVG, so they need no fonts installed): test accuracy against
//! wall-clock time, each worker's iterations on a timeline with its waits, deferred pulls over
//! time, and the policy's own metrics over time. Every time plot marks the hot swaps.

use std::path::{Path, PathBuf};

use plotters::prelude::*;

use crate::lab::report::{Comparison, RunReport};
use crate::worker::WorkerReport;

type PlotResult<T> = Result<T, Box<dyn std::error::Error>>;

/// The run's policy, as plots name it: each policy it ran under, in order, for a run with hot
/// swaps (the first and last of a long series).
fn label(report: &RunReport) -> String {
    let names: Vec<&str> = report.phases.iter().map(|p| p.policy.as_str()).collect();
    let policy = match names.len() {
        // A module file by its file name, not its whole path.
        0 | 1 => {
            report.policy.parse::<crate::builtin::PolicySpec>().map_or(report.policy.clone(), |s| s.label())
        }
        2..=4 => names.join(" → "),
        n => format!("{} → ({} swaps) → {}", names[0], n - 2, names[n - 1]),
    };
    match (report.simulated, &report.modelled) {
        (true, Some(m)) => format!("{policy} (simulated; wire costs of {m})"),
        (true, None) => format!("{policy} (simulated)"),
        _ => policy,
    }
}

/// Writes every plot the report has data for into `dir`; returns their paths.
pub fn write_all(report: &RunReport, dir: &Path) -> PlotResult<Vec<PathBuf>> {
    let mut files = Vec::new();
    if report.watch.iter().any(|p| p.accuracy.is_some()) {
        let path = dir.join("accuracy.svg");
        accuracy(report, &path)?;
        files.push(path);
    }
    if report.watch.iter().any(|p| p.loss.is_some()) {
        let path = dir.join("loss.svg");
        loss(report, &path)?;
        files.push(path);
    }
    if report.workers.iter().any(|w| !w.timeline.is_empty()) {
        let path = dir.join("timeline.svg");
        timeline(report, &path)?;
        files.push(path);
    }
    if !report.watch.is_empty() {
        let path = dir.join("deferred.svg");
        deferred(report, &path)?;
        files.push(path);
    }
    if report.watch.iter().any(|p| !p.metrics.is_empty()) {
        let path = dir.join("metrics.svg");
        metrics(report, &path)?;
        files.push(path);
    }
    if report.staleness.iter().any(|n| *n > 0) {
        let path = dir.join("staleness.svg");
        staleness(report, &path)?;
        files.push(path);
    }
    Ok(files)
}

/// Time on x; the time axis's label.
const TIME_AXIS: &str = "wall-clock time since the workers were started (s)";

type TimeChart<'a, 'b> = ChartContext<
    'a,
    SVGBackend<'b>,
    Cartesian2d<plotters::coord::types::RangedCoordf64, plotters::coord::types::RangedCoordf64>,
>;

/// Marks every hot swap on a time chart (a grey vertical line from `y0` to `y1` where the next
/// policy was first seen, labelled with it), every failover (a red one where the watcher first
/// saw the server lost) and every restart of the coordinator (an orange one when it died).
fn mark_swaps(chart: &mut TimeChart<'_, '_>, report: &RunReport, y0: f64, y1: f64) -> PlotResult<()> {
    let orange = RGBColor(220, 120, 0);
    for &x in &report.coordinator_restarts {
        chart
            .draw_series(std::iter::once(PathElement::new(vec![(x, y0), (x, y1)], orange.stroke_width(2))))?;
        chart.draw_series(std::iter::once(Text::new(
            " coordinator restarted",
            (x, y1 - (y1 - y0) * 0.14),
            ("sans-serif", 14).into_font().color(&orange),
        )))?;
    }
    let red = RGBColor(200, 30, 30);
    for f in &report.failovers {
        let x = f.t_s;
        chart.draw_series(std::iter::once(PathElement::new(vec![(x, y0), (x, y1)], red.stroke_width(2))))?;
        chart.draw_series(std::iter::once(Text::new(
            format!(" server {} lost, failed over", f.server),
            (x, y1 - (y1 - y0) * 0.09),
            ("sans-serif", 14).into_font().color(&red),
        )))?;
    }
    let grey = RGBColor(90, 90, 90);
    for p in report.phases.iter().skip(1) {
        let x = p.from_s;
        chart.draw_series(std::iter::once(PathElement::new(vec![(x, y0), (x, y1)], grey.stroke_width(2))))?;
        chart.draw_series(std::iter::once(Text::new(
            format!(" swap to {}", p.policy),
            (x, y1 - (y1 - y0) * 0.04),
            ("sans-serif", 14).into_font().color(&grey),
        )))?;
    }
    Ok(())
}

/// One line over time, labelled with the run's policy.
fn time_line(
    report: &RunReport,
    path: &Path,
    title: &str,
    y_desc: &str,
    pts: Vec<(f64, f64)>,
    y_max: f64,
    color: RGBColor,
) -> PlotResult<()> {
    let t_max = pts.iter().map(|p| p.0).fold(1.0, f64::max);
    let root = SVGBackend::new(path, (900, 520)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(format!("{title} — {}", label(report)), ("sans-serif", 22))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(70)
        .build_cartesian_2d(0.0..t_max * 1.02, 0.0..y_max)?;
    chart.configure_mesh().x_desc(TIME_AXIS).y_desc(y_desc).draw()?;
    chart
        .draw_series(LineSeries::new(pts, color.stroke_width(2)))?
        .label(label(report))
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
    mark_swaps(&mut chart, report, 0.0, y_max)?;
    chart.configure_series_labels().border_style(BLACK).background_style(WHITE.mix(0.8)).draw()?;
    root.present()?;
    Ok(())
}

/// The policy's metrics over time (last value, averaged over shards): one panel per name,
/// each on its own axis, so that a counter in the thousands does not flatten a ratio near 1.
fn metrics(report: &RunReport, path: &Path) -> PlotResult<()> {
    let mut names: Vec<&str> = Vec::new();
    for p in &report.watch {
        for (n, _) in &p.metrics {
            if !names.contains(&n.as_str()) {
                names.push(n);
            }
        }
    }
    let t_max = report.watch.iter().map(|p| p.t_s).fold(1.0, f64::max);
    let panel_h = 190u32;
    let root = SVGBackend::new(path, (900, 50 + panel_h * names.len() as u32)).into_drawing_area();
    root.fill(&WHITE)?;
    let root = root.titled(&format!("Policy metrics — {}", label(report)), ("sans-serif", 22))?;
    let panels = root.split_evenly((names.len(), 1));
    for (i, (name, area)) in names.iter().zip(&panels).enumerate() {
        let color = PALETTE[i % PALETTE.len()];
        let pts: Vec<(f64, f64)> = report
            .watch
            .iter()
            .filter_map(|p| p.metrics.iter().find(|m| m.0 == *name).map(|m| (p.t_s, m.1)))
            .collect();
        let lo = pts.iter().map(|p| p.1).fold(f64::INFINITY, f64::min).min(0.0);
        let hi = pts.iter().map(|p| p.1).fold(f64::NEG_INFINITY, f64::max);
        let hi = if hi > lo { hi + (hi - lo) * 0.05 } else { lo + 1.0 };
        let last = i + 1 == names.len();
        let mut chart = ChartBuilder::on(area)
            .caption(*name, ("sans-serif", 16))
            .margin(8)
            .x_label_area_size(if last { 40 } else { 20 })
            .y_label_area_size(70)
            .build_cartesian_2d(0.0..t_max * 1.02, lo..hi)?;
        let mut mesh = chart.configure_mesh();
        if last {
            mesh.x_desc(TIME_AXIS);
        }
        mesh.y_labels(4).draw()?;
        chart.draw_series(LineSeries::new(pts, color.stroke_width(2)))?;
        mark_swaps(&mut chart, report, lo, hi)?;
    }
    root.present()?;
    Ok(())
}

fn accuracy(report: &RunReport, path: &Path) -> PlotResult<()> {
    let pts = report.watch.iter().filter_map(|p| p.accuracy.map(|a| (p.t_s, f64::from(a) * 100.0))).collect();
    time_line(report, path, "Test accuracy", "test accuracy (%)", pts, 100.0, BLUE)
}

fn loss(report: &RunReport, path: &Path) -> PlotResult<()> {
    let pts: Vec<(f64, f64)> =
        report.watch.iter().filter_map(|p| Some((p.t_s, Measure::Loss.of(p)?))).collect();
    let y_max = pts.iter().map(|p| p.1).fold(0.1, f64::max) * 1.05;
    time_line(report, path, Measure::Loss.title(), Measure::Loss.axis(), pts, y_max, GREEN)
}

fn deferred(report: &RunReport, path: &Path) -> PlotResult<()> {
    let pts: Vec<(f64, f64)> = report.watch.iter().map(|p| (p.t_s, p.pulls_deferred as f64)).collect();
    let y_max = pts.iter().map(|p| p.1).fold(1.0, f64::max) * 1.05;
    time_line(report, path, "Deferred pulls", "deferred pulls so far (all shards)", pts, y_max, RED)
}

/// The most workers a timeline draws, one lane each.
const TIMELINE_LANES: usize = 64;

/// The workers a timeline shows, in lane order: all of them, or on a larger cluster
/// [`TIMELINE_LANES`] spread evenly over the range of their total waits (the least waiting, the
/// most, and the quantiles between), so that the stragglers and the typical worker both appear.
fn timeline_lanes(workers: &[WorkerReport]) -> Vec<&WorkerReport> {
    let mut by_wait: Vec<&WorkerReport> = workers.iter().collect();
    if by_wait.len() > TIMELINE_LANES {
        let waited = |w: &WorkerReport| w.timeline.iter().map(|(_, wait, _)| f64::from(*wait)).sum::<f64>();
        by_wait.sort_by(|a, b| waited(a).total_cmp(&waited(b)).then(a.worker.cmp(&b.worker)));
        let last = by_wait.len() - 1;
        by_wait = (0..TIMELINE_LANES).map(|i| by_wait[i * last / (TIMELINE_LANES - 1)]).collect();
    }
    by_wait.sort_by_key(|w| w.worker);
    by_wait
}

/// "Pushing while computing" in the timeline.
const PURPLE: RGBColor = RGBColor(150, 60, 190);

fn timeline(report: &RunReport, path: &Path) -> PlotResult<()> {
    let t0 = report.started_unix_s;
    let lanes = timeline_lanes(&report.workers);
    let n = lanes.len().max(1) as u32;
    let caption = match report.workers.len() {
        all if all > lanes.len() => format!(
            "Worker timeline ({} of {all} workers, from the least to the most waiting): pulling (red), computing (blue), pushing while computing (purple), waiting for acknowledgements (orange)",
            lanes.len()
        ),
        _ => "Worker timeline: pulling (red), computing (blue), pushing while computing (purple), waiting for acknowledgements (orange)".to_owned(),
    };
    let t_max = report
        .workers
        .iter()
        .flat_map(|w| w.timeline.last().map(|(s, wait, busy)| s - t0 + f64::from(*wait + *busy)))
        .fold(1.0, f64::max);
    let root = SVGBackend::new(path, (1000, 120 + 60 * n)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(caption, ("sans-serif", 20))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(70)
        .build_cartesian_2d(0.0..t_max * 1.02, -0.5..f64::from(n) - 0.5)?;
    chart
        .configure_mesh()
        .x_desc(TIME_AXIS)
        .y_desc("worker")
        .y_labels(n as usize)
        .y_label_formatter(&|y| match lanes.get(y.round() as usize) {
            Some(w) if (y - y.round()).abs() < 0.01 => w.worker.to_string(),
            _ => String::new(),
        })
        .draw()?;
    for (lane, w) in lanes.iter().enumerate() {
        let y = lane as f64;
        let orange = RGBColor(230, 140, 20);
        let bars = w.timeline.iter().enumerate().flat_map(|(i, (s, wait, busy))| {
            let s = s - t0;
            let (wait, busy) = (f64::from(*wait), f64::from(*busy));
            // The end of the busy stretch that waited for acknowledgements (0 in older reports).
            let acks = w.timeline_acks.get(i).map_or(0.0, |a| f64::from(*a)).min(busy);
            // Of that, the start the worker still computed through (a push overlapped with
            // the backward pass; 0 for every other worker).
            let overlap = w.timeline_overlap.get(i).map_or(0.0, |o| f64::from(*o)).min(acks);
            let end = s + wait + busy;
            [
                Rectangle::new([(s, y - 0.35), (s + wait, y + 0.35)], RED.mix(0.7).filled()),
                Rectangle::new([(s + wait, y - 0.35), (end - acks, y + 0.35)], BLUE.mix(0.5).filled()),
                Rectangle::new([(end - acks, y - 0.35), (end - acks + overlap, y + 0.35)], PURPLE.filled()),
                Rectangle::new([(end - acks + overlap, y - 0.35), (end, y + 0.35)], orange.mix(0.8).filled()),
            ]
        });
        chart.draw_series(bars)?;
    }
    // The watcher's times count from the same origin as the timeline's.
    mark_swaps(&mut chart, report, -0.5, f64::from(n) - 0.5)?;
    chart
        .draw_series(std::iter::once(Rectangle::new([(0.0, 0.0), (0.0, 0.0)], RED.mix(0.7).filled())))?
        .label("pulling (waiting while deferred)")
        .legend(|(x, y)| Rectangle::new([(x, y - 5), (x + 15, y + 5)], RED.mix(0.7).filled()));
    chart
        .draw_series(std::iter::once(Rectangle::new([(0.0, 0.0), (0.0, 0.0)], BLUE.mix(0.5).filled())))?
        .label("computing (and sending its push)")
        .legend(|(x, y)| Rectangle::new([(x, y - 5), (x + 15, y + 5)], BLUE.mix(0.5).filled()));
    if lanes.iter().any(|w| w.timeline_overlap.iter().any(|o| *o > 0.0)) {
        chart
            .draw_series(std::iter::once(Rectangle::new([(0.0, 0.0), (0.0, 0.0)], PURPLE.filled())))?
            .label("pushing while computing (overlapped with backward)")
            .legend(|(x, y)| Rectangle::new([(x, y - 5), (x + 15, y + 5)], PURPLE.filled()));
    }
    chart
        .draw_series(std::iter::once(Rectangle::new(
            [(0.0, 0.0), (0.0, 0.0)],
            RGBColor(230, 140, 20).mix(0.8).filled(),
        )))?
        .label("waiting for acknowledgements (held pushes included)")
        .legend(|(x, y)| {
            Rectangle::new([(x, y - 5), (x + 15, y + 5)], RGBColor(230, 140, 20).mix(0.8).filled())
        });
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .border_style(BLACK)
        .background_style(WHITE.mix(0.9))
        .draw()?;
    root.present()?;
    Ok(())
}

fn staleness(report: &RunReport, path: &Path) -> PlotResult<()> {
    let buckets = report.staleness.len() as u32;
    let total: u64 = report.staleness.iter().sum();
    let y_max = report.staleness.iter().map(|n| *n as f64 / total.max(1) as f64 * 100.0).fold(1.0, f64::max);
    let root = SVGBackend::new(path, (900, 520)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(format!("Staleness of applied gradients — {}", label(report)), ("sans-serif", 22))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(60)
        .build_cartesian_2d((0u32..buckets.saturating_sub(1)).into_segmented(), 0.0..y_max * 1.05)?;
    chart
        .configure_mesh()
        .x_desc(format!("optimizer steps between the pull and the push (last bar: {} or more)", buckets - 1))
        .y_desc("share of pushes (%)")
        .x_label_formatter(&|v| match v {
            SegmentValue::CenterOf(b) => b.to_string(),
            _ => String::new(),
        })
        .draw()?;
    chart.draw_series(report.staleness.iter().enumerate().map(|(b, n)| {
        let share = *n as f64 / total.max(1) as f64 * 100.0;
        let b = b as u32;
        Rectangle::new(
            [(SegmentValue::Exact(b), 0.0), (SegmentValue::Exact(b + 1), share)],
            BLUE.mix(0.6).filled(),
        )
    }))?;
    root.present()?;
    Ok(())
}

/// Colours for the policies of a comparison, in order.
const PALETTE: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
];

/// The pictures of a `syncopate ab` comparison (`reports` in the order of `c.rows`):
/// - `accuracy.svg` and `loss.svg`: each policy's test accuracy, and held-out loss, against
///   time; with repeated runs the median over its runs as a line and the band from the lowest
///   to the highest run;
/// - `waits.svg`: the share of time workers spent waiting for pulls;
/// - `time-to-target.svg` (scenarios with a target): each run's time to the target.
///
/// The last two draw every run as a dot, the median as a bar and, with repeated runs, the
/// median's confidence interval as a whisker.
pub fn comparison(c: &Comparison, reports: &[RunReport], dir: &Path) -> PlotResult<Vec<PathBuf>> {
    let mut files = Vec::new();
    for measure in [Measure::Accuracy, Measure::Loss] {
        if reports.iter().any(|r| r.watch.iter().any(|p| measure.of(p).is_some())) {
            let path = dir.join(measure.file());
            score_plot(c, reports, &path, measure)?;
            files.push(path);
        }
    }
    let path = dir.join("waits.svg");
    let title = format!("Time workers spent waiting for pulls — scenario `{}`", c.scenario.name);
    dots(c, &path, &title, "share of the run spent waiting, mean over workers (%)", "wait_share", 100.0)?;
    files.push(path);
    if let Some(target) = c.scenario.target() {
        let path = dir.join("time-to-target.svg");
        let missed = c.rows.iter().filter(|r| r.time_to_target_s.is_none()).count();
        let title = match missed {
            0 => format!("Time to {} — scenario `{}`", target.describe(), c.scenario.name),
            n => format!(
                "Time to {} ({n} runs did not reach it) — scenario `{}`",
                target.describe(),
                c.scenario.name
            ),
        };
        dots(
            c,
            &path,
            &title,
            "seconds until the model first scored at the target",
            "time_to_target_s",
            1.0,
        )?;
        files.push(path);
    }
    Ok(files)
}

/// What a score plot shows: test accuracy (percent, higher is better) or held-out loss.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Measure {
    Accuracy,
    Loss,
}

impl Measure {
    /// Its value at a look, as plotted.
    fn of(self, p: &crate::lab::report::WatchPoint) -> Option<f64> {
        match self {
            Measure::Accuracy => p.accuracy.map(|a| f64::from(a) * 100.0),
            Measure::Loss => p.loss.map(f64::from),
        }
    }

    fn file(self) -> &'static str {
        match self {
            Measure::Accuracy => "accuracy.svg",
            Measure::Loss => "loss.svg",
        }
    }

    fn title(self) -> &'static str {
        match self {
            Measure::Accuracy => "Test accuracy",
            Measure::Loss => "Held-out loss",
        }
    }

    fn axis(self) -> &'static str {
        match self {
            Measure::Accuracy => "test accuracy (%)",
            Measure::Loss => "held-out loss (nats per sample or byte; lower is better)",
        }
    }

    /// The target's line on this plot, if the target is in this measure.
    fn target(self, target: Option<crate::lab::report::Target>) -> Option<f64> {
        use crate::lab::report::Target;
        match (self, target?) {
            (Measure::Accuracy, Target::Accuracy(a)) => Some(f64::from(a) * 100.0),
            (Measure::Loss, Target::Loss(l)) => Some(f64::from(l)),
            _ => None,
        }
    }
}

/// Each policy's `measure` against time; with repeated runs the median over its runs as a
/// line and the band from the lowest to the highest run; the target, if in this measure.
fn score_plot(c: &Comparison, reports: &[RunReport], path: &Path, measure: Measure) -> PlotResult<()> {
    let policies: Vec<&str> = c.summaries.iter().map(|s| s.policy.as_str()).collect();
    let runs_of = |p: &str| -> Vec<usize> { (0..c.rows.len()).filter(|i| c.rows[*i].policy == p).collect() };
    let t_max = reports.iter().flat_map(|r| r.watch.iter().map(|p| p.t_s)).fold(1.0, f64::max);
    let y_max = match measure {
        Measure::Accuracy => 100.0,
        Measure::Loss => {
            reports.iter().flat_map(|r| r.watch.iter().filter_map(|p| measure.of(p))).fold(0.1, f64::max)
                * 1.05
        }
    };
    let root = SVGBackend::new(path, (1000, 560)).into_drawing_area();
    root.fill(&WHITE)?;
    let caption = match c.repeat {
        1 => format!("{} — scenario `{}`", measure.title(), c.scenario.name),
        n => format!(
            "{}, median of {n} runs and their range — scenario `{}`",
            measure.title(),
            c.scenario.name
        ),
    };
    let mut chart = ChartBuilder::on(&root)
        .caption(caption, ("sans-serif", 22))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(70)
        .build_cartesian_2d(0.0..t_max * 1.02, 0.0..y_max)?;
    chart.configure_mesh().x_desc(TIME_AXIS).y_desc(measure.axis()).draw()?;
    let step = (c.scenario.eval_every_ms as f64 / 1000.0).max(0.05);
    for (k, p) in policies.iter().enumerate() {
        let color = PALETTE[k % PALETTE.len()];
        let runs: Vec<&RunReport> = runs_of(p).into_iter().map(|i| &reports[i]).collect();
        let (line, band) = score_band(&runs, step, measure);
        if runs.len() > 1 && band.len() > 1 {
            let mut poly: Vec<(f64, f64)> = band.iter().map(|(t, lo, _)| (*t, *lo)).collect();
            poly.extend(band.iter().rev().map(|(t, _, hi)| (*t, *hi)));
            chart.draw_series(std::iter::once(Polygon::new(poly, color.mix(0.18).filled())))?;
        }
        chart
            .draw_series(LineSeries::new(line, color.stroke_width(2)))?
            .label(p.to_string())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
    }
    if let Some(y) = measure.target(c.scenario.target()) {
        chart
            .draw_series(LineSeries::new([(0.0, y), (t_max * 1.02, y)], BLACK.mix(0.4)))?
            .label("target")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLACK.mix(0.4)));
    }
    let corner = match measure {
        Measure::Accuracy => SeriesLabelPosition::LowerRight,
        Measure::Loss => SeriesLabelPosition::UpperRight,
    };
    chart
        .configure_series_labels()
        .position(corner)
        .border_style(BLACK)
        .background_style(WHITE.mix(0.9))
        .draw()?;
    root.present()?;
    Ok(())
}

/// `(t, lowest, highest)` of a band around a line.
type Band = (f64, f64, f64);

/// The median `measure` of `runs` on a grid of `step` seconds, and the `(t, lowest, highest)`
/// band; each run holds its last reading after it ended.
fn score_band(runs: &[&RunReport], step: f64, measure: Measure) -> (Vec<(f64, f64)>, Vec<Band>) {
    let readings: Vec<Vec<(f64, f64)>> =
        runs.iter().map(|r| r.watch.iter().filter_map(|p| Some((p.t_s, measure.of(p)?))).collect()).collect();
    if runs.len() == 1 {
        return (readings.into_iter().next().unwrap_or_default(), Vec::new());
    }
    let end = readings.iter().filter_map(|r| r.last().map(|p| p.0)).fold(0.0, f64::max);
    let (mut line, mut band) = (Vec::new(), Vec::new());
    let mut t = step;
    while t <= end + step / 2.0 {
        let mut at: Vec<f64> = readings
            .iter()
            .filter_map(|r| r.iter().take_while(|p| p.0 <= t + 1e-9).last().map(|p| p.1))
            .collect();
        if at.len() == runs.len() {
            at.sort_by(f64::total_cmp);
            line.push((t, crate::lab::stats::median_of_sorted(&at)));
            band.push((t, at[0], at[at.len() - 1]));
        }
        t += step;
    }
    (line, band)
}

/// A dot plot of figure `key` (times `scale`): every run a dot, each policy's median a bar and
/// its confidence interval a whisker.
fn dots(c: &Comparison, path: &Path, title: &str, y_desc: &str, key: &str, scale: f64) -> PlotResult<()> {
    let figure = crate::lab::report::FIGURES.iter().find(|f| f.key == key).expect("a known figure");
    let values: Vec<(usize, f64)> = c
        .rows
        .iter()
        .filter_map(|r| {
            let k = c.summaries.iter().position(|s| s.policy == r.policy)?;
            (figure.get)(r).filter(|v| v.is_finite()).map(|v| (k, v * scale))
        })
        .collect();
    let y_max = values.iter().map(|v| v.1).fold(0.0, f64::max).max(1e-9) * 1.1;
    let n = c.summaries.len() as u32;
    let root = SVGBackend::new(path, (1000, 560)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(70)
        .build_cartesian_2d((0u32..n.saturating_sub(1)).into_segmented(), 0.0..y_max)?;
    chart
        .configure_mesh()
        .x_desc("policy")
        .y_desc(y_desc)
        .x_label_formatter(&|v| match v {
            SegmentValue::CenterOf(i) => {
                c.summaries.get(*i as usize).map(|s| s.policy.clone()).unwrap_or_default()
            }
            _ => String::new(),
        })
        .draw()?;
    for (k, s) in c.summaries.iter().enumerate() {
        let Some(e) = s.figure(key) else { continue };
        let i = k as u32;
        let color = PALETTE[k % PALETTE.len()];
        if let Some(m) = e.median {
            chart.draw_series(std::iter::once(Rectangle::new(
                [(SegmentValue::Exact(i), 0.0), (SegmentValue::Exact(i + 1), m * scale)],
                color.mix(0.35).filled(),
            )))?;
        }
        if e.n > 1 {
            let lo = e.lo.map_or(0.0, |v| v * scale);
            let hi = e.hi.map_or(y_max, |v| v * scale);
            chart.draw_series(std::iter::once(PathElement::new(
                vec![(SegmentValue::CenterOf(i), lo), (SegmentValue::CenterOf(i), hi)],
                BLACK.stroke_width(2),
            )))?;
        }
        chart.draw_series(
            values
                .iter()
                .filter(|(p, _)| *p == k)
                .map(|(_, v)| Circle::new((SegmentValue::CenterOf(i), *v), 4, color.filled())),
        )?;
    }
    root.present()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_large_clusters_timeline_shows_the_least_and_most_waiting_workers_and_the_quantiles_between() {
        // Worker w waited (w * 7) % 300 seconds in all: the least is worker 0, the most 257.
        let workers: Vec<WorkerReport> = (0..300u32)
            .map(|w| WorkerReport {
                worker: w,
                timeline: vec![(0.0, ((w * 7) % 300) as f32, 1.0)],
                ..WorkerReport::default()
            })
            .collect();
        let lanes = timeline_lanes(&workers);
        let ids: Vec<u32> = lanes.iter().map(|w| w.worker).collect();
        assert_eq!(ids.len(), TIMELINE_LANES);
        assert!(ids.windows(2).all(|p| p[0] < p[1]), "lanes in worker order, no repeats: {ids:?}");
        assert!(ids.contains(&0) && ids.contains(&257), "{ids:?}");
        let small: Vec<u32> = timeline_lanes(&workers[..10]).iter().map(|w| w.worker).collect();
        assert_eq!(small, (0..10).collect::<Vec<_>>(), "a small cluster shows every worker");
    }
}
