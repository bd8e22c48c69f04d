//! The loss curve as an SVG picture, written at the end of training
//! ([`TrainConfig::loss_curve`](crate::TrainConfig)) and readable by any browser.

use std::fmt::Write as _;
use std::path::Path;

const WIDTH: f64 = 720.0;
const HEIGHT: f64 = 420.0;
/// Margins: left (for the value labels), right, top, bottom (for the step labels).
const LEFT: f64 = 70.0;
const RIGHT: f64 = 20.0;
const TOP: f64 = 40.0;
const BOTTOM: f64 = 50.0;

/// An SVG picture of the training loss (`(step, loss)`, blue) and the evaluations
/// (`(step, value)`, orange dots and line) against the step, on linear axes labelled
/// with their ranges. Points that are not finite are left out; with no point at all the
/// picture says so.
///
/// ```
/// let svg = tt_train::loss_curve_svg(&[(10, 2.0), (20, 1.0), (30, 0.5)], &[(20, 1.2)]);
/// assert!(svg.starts_with("<svg") && svg.contains("<polyline"));
/// ```
pub fn loss_curve_svg(losses: &[(u64, f64)], evals: &[(u64, f64)]) -> String {
    let losses: Vec<(u64, f64)> = losses.iter().copied().filter(|p| p.1.is_finite()).collect();
    let evals: Vec<(u64, f64)> = evals.iter().copied().filter(|p| p.1.is_finite()).collect();
    let mut svg = String::new();
    let _ = write!(
        svg,
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{WIDTH}\" height=\"{HEIGHT}\" \
         viewBox=\"0 0 {WIDTH} {HEIGHT}\" font-family=\"sans-serif\" font-size=\"12\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"{LEFT}\" y=\"22\" font-size=\"15\">training loss</text>\n"
    );
    let all = || losses.iter().chain(&evals);
    let (Some(x0), Some(x1)) = (all().map(|p| p.0).min(), all().map(|p| p.0).max()) else {
        svg.push_str("<text x=\"70\" y=\"80\">no loss was logged</text>\n</svg>\n");
        return svg;
    };
    let y0 = all().map(|p| p.1).fold(f64::INFINITY, f64::min);
    let y1 = all().map(|p| p.1).fold(f64::NEG_INFINITY, f64::max);
    // A flat curve or a single point gets a range around it.
    let (xs, ys) = ((x1 - x0).max(1) as f64, if y1 > y0 { y1 - y0 } else { 1.0 });
    let (pw, ph) = (WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM);
    let at = |(step, v): (u64, f64)| {
        (
            LEFT + (step - x0) as f64 / xs * pw,
            TOP + ph - (v - y0) / ys * ph,
        )
    };
    let (bx, by) = (LEFT + pw, TOP + ph);
    let _ = write!(
        svg,
        "<path d=\"M{LEFT},{TOP} V{by} H{bx}\" fill=\"none\" stroke=\"#444\"/>\n\
         <text x=\"{lx}\" y=\"{ty}\" text-anchor=\"end\">{y1}</text>\n\
         <text x=\"{lx}\" y=\"{by}\" text-anchor=\"end\">{y0}</text>\n\
         <text x=\"{LEFT}\" y=\"{sy}\" text-anchor=\"start\">step {x0}</text>\n\
         <text x=\"{bx}\" y=\"{sy}\" text-anchor=\"end\">step {x1}</text>\n",
        lx = LEFT - 6.0,
        ty = TOP + 4.0,
        sy = by + 20.0,
        y1 = label(y1),
        y0 = label(y0),
    );
    let mut line = |points: &[(u64, f64)], class: &str, colour: &str| {
        let coords: Vec<String> = points
            .iter()
            .map(|&p| {
                let (x, y) = at(p);
                format!("{x:.2},{y:.2}")
            })
            .collect();
        let _ = writeln!(
            svg,
            "<polyline class=\"{class}\" fill=\"none\" stroke=\"{colour}\" stroke-width=\"1.5\" \
             points=\"{}\"/>",
            coords.join(" ")
        );
    };
    line(&losses, "loss", "#1f77b4");
    line(&evals, "eval", "#ff7f0e");
    for &p in &evals {
        let (x, y) = at(p);
        let _ = writeln!(
            svg,
            "<circle cx=\"{x:.2}\" cy=\"{y:.2}\" r=\"3\" fill=\"#ff7f0e\"/>"
        );
    }
    let _ = write!(
        svg,
        "<text x=\"{bx}\" y=\"22\" text-anchor=\"end\"><tspan fill=\"#1f77b4\">loss</tspan>{}</text>\n</svg>\n",
        if evals.is_empty() {
            ""
        } else {
            " <tspan fill=\"#ff7f0e\">evaluation</tspan>"
        }
    );
    svg
}

/// A value label: 4 decimals, or scientific notation for very small or large values.
fn label(v: f64) -> String {
    if v == 0.0 || (1e-3..1e5).contains(&v.abs()) {
        format!("{v:.4}")
    } else {
        format!("{v:.3e}")
    }
}

/// `(step, value)` points of a curve.
pub(crate) type Points = Vec<(u64, f64)>;

/// The loss and evaluation history in a metrics file the trainer wrote (JSON Lines):
/// the last record of each step, in step order. Lines that are not the trainer's are
/// skipped.
#[cfg_attr(not(feature = "dist"), allow(dead_code))]
pub(crate) fn read_metrics(path: &Path) -> std::io::Result<(Points, Points)> {
    let text = std::fs::read_to_string(path)?;
    let mut losses = std::collections::BTreeMap::new();
    let mut evals = std::collections::BTreeMap::new();
    for line in text.lines() {
        let Ok(record) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        let Some(step) = record.get("step").and_then(serde_json::Value::as_u64) else {
            continue;
        };
        if let Some(loss) = record.get("loss").and_then(serde_json::Value::as_f64) {
            losses.insert(step, loss);
        }
        if let Some(eval) = record.get("eval").and_then(serde_json::Value::as_f64) {
            evals.insert(step, eval);
        }
    }
    Ok((losses.into_iter().collect(), evals.into_iter().collect()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The polyline's points of `class`.
    fn points(svg: &str, class: &str) -> Vec<(f64, f64)> {
        let start = svg
            .find(&format!("class=\"{class}\""))
            .expect("the polyline");
        let rest = &svg[start..];
        let p = rest.find("points=\"").expect("points") + 8;
        let end = rest[p..].find('"').expect("end of points");
        rest[p..p + end]
            .split_whitespace()
            .map(|xy| {
                let (x, y) = xy.split_once(',').expect("x,y");
                (x.parse().expect("x"), y.parse().expect("y"))
            })
            .collect()
    }

    #[test]
    fn the_curve_has_a_point_per_step_placed_by_step_and_value() {
        let losses = [(10, 3.0), (20, 1.0), (30, 2.0), (40, f64::NAN)];
        let svg = loss_curve_svg(&losses, &[(20, 2.5), (40, 1.5)]);
        let l = points(&svg, "loss");
        assert_eq!(l.len(), 3, "the NaN is left out");
        // Left to right by step, spaced by step (10 steps of 40 between 10 and 40).
        assert!((l[0].0 - LEFT).abs() < 1e-6);
        assert!((l[1].0 - l[0].0 - (l[2].0 - l[1].0)).abs() < 1e-6);
        // Higher loss, higher on the picture (smaller y); the top is the largest value.
        assert!(l[0].1 < l[2].1 && l[2].1 < l[1].1);
        assert!((l[0].1 - TOP).abs() < 1e-6, "3.0 is the largest value");
        let e = points(&svg, "eval");
        assert_eq!(e.len(), 2);
        assert!(
            (e[1].0 - (WIDTH - RIGHT)).abs() < 1e-6,
            "step 40 is the right edge"
        );
        assert_eq!(svg.matches("<circle").count(), 2);
        assert!(
            svg.contains(">3.0000<") && svg.contains(">1.0000<"),
            "{svg}"
        );
        assert!(svg.trim_end().ends_with("</svg>"));
    }

    #[test]
    fn a_single_point_and_no_point_still_make_a_picture() {
        let one = loss_curve_svg(&[(5, 0.7)], &[]);
        assert_eq!(points(&one, "loss").len(), 1);
        assert!(!one.contains("evaluation"));
        let none = loss_curve_svg(&[], &[]);
        assert!(none.contains("no loss was logged") && none.trim_end().ends_with("</svg>"));
    }

    #[test]
    fn the_metrics_history_keeps_the_last_record_of_each_step() -> std::io::Result<()> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("m.jsonl");
        std::fs::write(
            &path,
            "{\"step\":4,\"loss\":2.0}\n{\"step\":8,\"loss\":1.0}\n{\"step\":8,\"eval\":1.5}\n\
             not json\n{\"step\":4,\"loss\":1.8}\n{\"step\":12,\"loss\":0.5}",
        )?;
        let (losses, evals) = read_metrics(&path)?;
        assert_eq!(losses, [(4, 1.8), (8, 1.0), (12, 0.5)]);
        assert_eq!(evals, [(8, 1.5)]);
        Ok(())
    }
}
