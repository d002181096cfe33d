//! The benchmark's figures as SVG (plotters): a layer-wise round's
//! timeline in both modes, and the main job's bandwidth sweep.

use std::path::Path;
use std::time::Instant;

use anyhow::Result;
use plotters::prelude::*;

use crate::layerwise::{Mode, Timeline};

/// A chart on `root` with the caption and margins both figures share.
fn framed<'a, 'b>(
    root: &'a DrawingArea<SVGBackend<'b>, plotters::coord::Shift>,
    title: &str,
) -> ChartBuilder<'a, 'b, SVGBackend<'b>> {
    let mut b = ChartBuilder::on(root);
    b.caption(title, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(50);
    b
}

/// Draws the two rounds' timelines to `path` (SVG): when each layer was
/// ready, when each landed on the generation side in each mode, and the
/// exposed tails.
pub(crate) fn timeline(path: &Path, title: &str, whole: &Timeline, lw: &Timeline) -> Result<()> {
    let ms = |t0: Instant, t: Instant| t.saturating_duration_since(t0).as_secs_f64() * 1e3;
    let layers = whole.ready.len() as u32;
    let end = ms(whole.t0, whole.complete).max(ms(lw.t0, lw.complete)) * 1.05;
    let root = SVGBackend::new(path, (960, 560)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = framed(&root, title).build_cartesian_2d(0.0..end, 0.0..f64::from(layers))?;
    chart
        .configure_mesh()
        .x_desc("time since the prefill started (ms)")
        .y_desc("model layer")
        .draw()?;
    let ready: Vec<(f64, f64)> = whole
        .ready
        .iter()
        .enumerate()
        .map(|(l, &t)| (ms(whole.t0, t), l as f64 + 0.5))
        .collect();
    chart
        .draw_series(LineSeries::new(ready.clone(), BLACK.stroke_width(2)))?
        .label("layer ready (simulated prefill)")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], BLACK));
    for (tl, color, name) in [
        (lw, BLUE, "landed, layer by layer"),
        (whole, RED, "landed, whole request after the prefill"),
    ] {
        let marks: Vec<(f64, f64)> = tl
            .landed
            .iter()
            .flatten()
            .flat_map(|(run, at)| run.clone().map(move |l| (*at, l)))
            .map(|(at, l)| (ms(tl.t0, at), f64::from(l) + 0.5))
            .collect();
        chart
            .draw_series(
                marks
                    .iter()
                    .map(|&p| Circle::new(p, 3, color.mix(0.8).filled())),
            )?
            .label(format!(
                "{name}: exposed {:.1} ms",
                tl.exposed().as_secs_f64() * 1e3
            ))
            .legend(move |(x, y)| Circle::new((x + 8, y), 3, color.filled()));
        // The exposed tail: from the last layer ready to the KV complete.
        let last = ms(tl.t0, *tl.ready.last().expect("a layer"));
        let done = ms(tl.t0, tl.complete);
        let y = if tl.mode == Mode::Whole { 0.6 } else { 0.3 };
        chart.draw_series(std::iter::once(Rectangle::new(
            [(last, y - 0.15), (done, y + 0.15)],
            color.mix(0.5).filled(),
        )))?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}

/// Plots a bandwidth sweep (GB/s against block size, one tick per point)
/// to `path` (SVG).
pub(crate) fn sweep(path: &Path, title: &str, points: &[(u64, f64)]) -> Result<()> {
    let top = points.iter().map(|p| p.1).fold(0.0, f64::max) * 1.15;
    let n = points.len();
    let root = SVGBackend::new(path, (800, 480)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart =
        framed(&root, title).build_cartesian_2d(-0.5..n as f64 - 0.5, 0.0..top.max(0.001))?;
    let label = |v: &f64| {
        let i = v.round();
        if (v - i).abs() < 1e-6 && i >= 0.0 && (i as usize) < n {
            crate::human(points[i as usize].0)
        } else {
            String::new()
        }
    };
    chart
        .configure_mesh()
        .x_desc("block size")
        .y_desc("GB/s")
        .x_labels(n)
        .x_label_formatter(&label)
        .draw()?;
    let pts: Vec<(f64, f64)> = points
        .iter()
        .enumerate()
        .map(|(i, &(_, g))| (i as f64, g))
        .collect();
    chart.draw_series(LineSeries::new(pts.clone(), BLUE.stroke_width(2)))?;
    chart.draw_series(pts.iter().map(|&p| Circle::new(p, 4, BLUE.filled())))?;
    root.present()?;
    Ok(())
}
