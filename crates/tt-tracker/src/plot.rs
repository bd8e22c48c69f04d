//! `--plot usage.svg`: RAM, GPU RAM and CPU over time, peaks marked.
// Left out of mutation testing: SVG drawing behind the `plot` feature, not in the
// measured build.
#![cfg_attr(mutants, mutants::skip)]

use std::path::Path;

use plotters::prelude::*;

use crate::tracker::SeriesPoint;
use crate::{Error, Result};

/// Draws three stacked panels (RAM and GPU RAM of the tree in GB, CPU in percent of
/// one core) against seconds, with each panel's peak marked and labelled.
pub fn plot(path: &Path, series: &[SeriesPoint]) -> Result<()> {
    let err = |e: &dyn std::fmt::Display| Error::Plot {
        path: path.to_owned(),
        reason: e.to_string(),
    };
    let root = SVGBackend::new(path, (960, 720)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let panels = root.split_evenly((3, 1));
    let t_max = series.last().map_or(1.0, |p| p.t).max(1e-3);
    type Panel = (&'static str, fn(&SeriesPoint) -> f64, RGBColor);
    let draws: [Panel; 3] = [
        ("RAM (GB)", |p| p.ram / 1e9, BLUE),
        ("GPU RAM (GB)", |p| p.gpu_ram / 1e9, GREEN),
        ("CPU (% of a core)", |p| p.cpu, RED),
    ];
    for (area, (label, value, color)) in panels.iter().zip(draws) {
        let y_max = series.iter().map(value).fold(0.0f64, f64::max);
        let mut chart = ChartBuilder::on(area)
            .margin(8)
            .x_label_area_size(28)
            .y_label_area_size(56)
            .caption(label, ("sans-serif", 16))
            .build_cartesian_2d(0.0..t_max, 0.0..(y_max * 1.1).max(1e-3))
            .map_err(|e| err(&e))?;
        chart
            .configure_mesh()
            .x_desc("seconds")
            .draw()
            .map_err(|e| err(&e))?;
        chart
            .draw_series(LineSeries::new(
                series.iter().map(|p| (p.t, value(p))),
                &color,
            ))
            .map_err(|e| err(&e))?;
        if let Some(peak) = series.iter().max_by(|a, b| value(a).total_cmp(&value(b))) {
            let (x, y) = (peak.t, value(peak));
            chart
                .draw_series(std::iter::once(Circle::new((x, y), 4, color.filled())))
                .map_err(|e| err(&e))?;
            chart
                .draw_series(std::iter::once(Text::new(
                    format!("peak {y:.3} at {x:.2} s"),
                    (x, y),
                    ("sans-serif", 12),
                )))
                .map_err(|e| err(&e))?;
        }
    }
    root.present().map_err(|e| err(&e))?;
    Ok(())
}
