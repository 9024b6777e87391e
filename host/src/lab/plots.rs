//! The run report's pictures (SVG, so they need no fonts installed): test accuracy against
//! wall-clock time, each worker's iterations on a timeline with its waits, deferred pulls over
//! time, and the policy's own metrics over time. Every time plot marks the hot swaps.

use std::path::{Path, PathBuf};

use plotters::prelude::*;

use crate::lab::report::{AbRow, RunReport};

type PlotResult<T> = Result<T, Box<dyn std::error::Error>>;

/// Writes every plot the report has data for into `dir`; returns their paths.
/// The run's policy, as plots name it.
fn label(report: &RunReport) -> String {
    if report.simulated {
        format!("{} (simulated)", report.policy)
    } else {
        report.policy.clone()
    }
}

pub fn write_all(report: &RunReport, dir: &Path) -> PlotResult<Vec<PathBuf>> {
    let mut files = Vec::new();
    if report.watch.iter().any(|p| p.accuracy.is_some()) {
        let path = dir.join("accuracy.svg");
        accuracy(report, &path)?;
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

/// Marks every hot swap on a time chart: a grey vertical line from `y0` to `y1` where the next
/// policy was first seen, labelled with it.
fn mark_swaps(chart: &mut TimeChart<'_, '_>, report: &RunReport, y0: f64, y1: f64) -> PlotResult<()> {
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

/// The policy's metrics over time, one line per name (last value, averaged over shards).
fn metrics(report: &RunReport, path: &Path) -> PlotResult<()> {
    let mut names: Vec<&str> = Vec::new();
    for p in &report.watch {
        for (n, _) in &p.metrics {
            if !names.contains(&n.as_str()) {
                names.push(n);
            }
        }
    }
    let values = || report.watch.iter().flat_map(|p| p.metrics.iter().map(|m| m.1));
    let (lo, hi) = (values().fold(0.0, f64::min), values().fold(1.0, f64::max));
    let t_max = report.watch.iter().map(|p| p.t_s).fold(1.0, f64::max);
    let root = SVGBackend::new(path, (900, 520)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(format!("Policy metrics — {}", label(report)), ("sans-serif", 22))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(70)
        .build_cartesian_2d(0.0..t_max * 1.02, lo..hi * 1.05)?;
    chart.configure_mesh().x_desc(TIME_AXIS).y_desc("value (ctx.metric, last sample)").draw()?;
    for (i, name) in names.iter().enumerate() {
        let color = PALETTE[i % PALETTE.len()];
        let pts: Vec<(f64, f64)> = report
            .watch
            .iter()
            .filter_map(|p| p.metrics.iter().find(|m| m.0 == *name).map(|m| (p.t_s, m.1)))
            .collect();
        chart
            .draw_series(LineSeries::new(pts, color.stroke_width(2)))?
            .label(*name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
    }
    mark_swaps(&mut chart, report, lo, hi * 1.05)?;
    chart.configure_series_labels().border_style(BLACK).background_style(WHITE.mix(0.8)).draw()?;
    root.present()?;
    Ok(())
}

fn accuracy(report: &RunReport, path: &Path) -> PlotResult<()> {
    let pts = report.watch.iter().filter_map(|p| p.accuracy.map(|a| (p.t_s, f64::from(a) * 100.0))).collect();
    time_line(report, path, "Test accuracy", "test accuracy (%)", pts, 100.0, BLUE)
}

fn deferred(report: &RunReport, path: &Path) -> PlotResult<()> {
    let pts: Vec<(f64, f64)> = report.watch.iter().map(|p| (p.t_s, p.pulls_deferred as f64)).collect();
    let y_max = pts.iter().map(|p| p.1).fold(1.0, f64::max) * 1.05;
    time_line(report, path, "Deferred pulls", "deferred pulls so far (all shards)", pts, y_max, RED)
}

fn timeline(report: &RunReport, path: &Path) -> PlotResult<()> {
    let t0 = report.started_unix_s;
    let n = report.workers.iter().map(|w| w.worker + 1).max().unwrap_or(1);
    let t_max = report
        .workers
        .iter()
        .flat_map(|w| w.timeline.last().map(|(s, wait, busy)| s - t0 + f64::from(*wait + *busy)))
        .fold(1.0, f64::max);
    let root = SVGBackend::new(path, (1000, 120 + 60 * n)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption("Worker timeline: pulling, deferrals included (red), and working (blue)", ("sans-serif", 20))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(70)
        .build_cartesian_2d(0.0..t_max * 1.02, -0.5..f64::from(n) - 0.5)?;
    chart
        .configure_mesh()
        .x_desc(TIME_AXIS)
        .y_desc("worker")
        .y_labels(n as usize)
        .y_label_formatter(&|y| {
            if (y - y.round()).abs() < 0.01 {
                format!("{}", y.round() as i64)
            } else {
                String::new()
            }
        })
        .draw()?;
    for w in &report.workers {
        let y = f64::from(w.worker);
        let bars = w.timeline.iter().flat_map(|(s, wait, busy)| {
            let s = s - t0;
            let (wait, busy) = (f64::from(*wait), f64::from(*busy));
            [
                Rectangle::new([(s, y - 0.35), (s + wait, y + 0.35)], RED.mix(0.7).filled()),
                Rectangle::new([(s + wait, y - 0.35), (s + wait + busy, y + 0.35)], BLUE.mix(0.5).filled()),
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
        .label("computing and pushing")
        .legend(|(x, y)| Rectangle::new([(x, y - 5), (x + 15, y + 5)], BLUE.mix(0.5).filled()));
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

/// The pictures of a `syncopate ab` comparison: every policy's test accuracy against time on one
/// chart, and bars of the share of time workers spent waiting.
pub fn comparison(
    rows: &[AbRow],
    reports: &[RunReport],
    scenario: &crate::lab::scenario::Scenario,
    dir: &Path,
) -> PlotResult<Vec<PathBuf>> {
    let mut files = Vec::new();
    if reports.iter().any(|r| r.watch.iter().any(|p| p.accuracy.is_some())) {
        let path = dir.join("accuracy.svg");
        let t_max = reports.iter().flat_map(|r| r.watch.iter().map(|p| p.t_s)).fold(1.0, f64::max);
        let root = SVGBackend::new(&path, (1000, 560)).into_drawing_area();
        root.fill(&WHITE)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(format!("Test accuracy — scenario `{}`", scenario.name), ("sans-serif", 22))
            .margin(15)
            .x_label_area_size(45)
            .y_label_area_size(70)
            .build_cartesian_2d(0.0..t_max * 1.02, 0.0..100.0)?;
        chart.configure_mesh().x_desc(TIME_AXIS).y_desc("test accuracy (%)").draw()?;
        for (i, (row, r)) in rows.iter().zip(reports).enumerate() {
            let color = PALETTE[i % PALETTE.len()];
            let pts: Vec<(f64, f64)> =
                r.watch.iter().filter_map(|p| p.accuracy.map(|a| (p.t_s, f64::from(a) * 100.0))).collect();
            chart
                .draw_series(LineSeries::new(pts, color.stroke_width(2)))?
                .label(row.policy.clone())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
        }
        if let Some(t) = scenario.target_accuracy {
            let y = f64::from(t) * 100.0;
            chart
                .draw_series(LineSeries::new([(0.0, y), (t_max * 1.02, y)], BLACK.mix(0.4)))?
                .label("target")
                .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLACK.mix(0.4)));
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .border_style(BLACK)
            .background_style(WHITE.mix(0.9))
            .draw()?;
        root.present()?;
        drop(chart);
        drop(root);
        files.push(path);
    }
    let path = dir.join("waits.svg");
    let n = rows.len() as u32;
    let root = SVGBackend::new(&path, (1000, 560)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!("Time workers spent waiting for pulls — scenario `{}`", scenario.name),
            ("sans-serif", 22),
        )
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(70)
        .build_cartesian_2d((0u32..n.saturating_sub(1)).into_segmented(), 0.0..100.0)?;
    chart
        .configure_mesh()
        .x_desc("policy")
        .y_desc("share of the run spent waiting, mean over workers (%)")
        .x_label_formatter(&|v| match v {
            SegmentValue::CenterOf(i) => rows.get(*i as usize).map(|r| r.policy.clone()).unwrap_or_default(),
            _ => String::new(),
        })
        .draw()?;
    chart.draw_series(rows.iter().enumerate().map(|(i, r)| {
        let i = i as u32;
        Rectangle::new(
            [(SegmentValue::Exact(i), 0.0), (SegmentValue::Exact(i + 1), r.wait_share * 100.0)],
            PALETTE[i as usize % PALETTE.len()].mix(0.7).filled(),
        )
    }))?;
    root.present()?;
    drop(chart);
    drop(root);
    files.push(path);
    Ok(files)
}
