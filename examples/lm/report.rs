//! What `--compare` writes: `compare.md` (a table per level), `loss.svg`
//! (every level's training and validation curves on one chart) and
//! `memory.svg` (persistent bytes by category, stacked, per level).
//! SVG through plotters' own backend: no system font or library needed.

use crate::train::Summary;
use anyhow::{anyhow, Result};
use plotters::coord::ranged1d::SegmentValue;
use plotters::prelude::*;
use std::fmt::Write as _;
use std::path::Path;

/// The categories of persistent bytes, in stacking order, with their labels.
const CATEGORIES: [(&str, &str); 8] = [
    ("linear_weights", "linear weights"),
    ("master_weights", "master weights"),
    ("weight_gradients", "weight gradients"),
    ("first_moments", "Adam m"),
    ("second_moments", "Adam v"),
    ("other_params", "other parameters"),
    ("other_states", "other grads + states"),
    ("scaling_metadata", "scaling metadata"),
];

const MIB: f64 = 1024.0 * 1024.0;

fn bytes(s: &Summary, key: &str) -> f64 {
    s.persistent_bytes
        .get(key)
        .and_then(serde_json::Value::as_f64)
        .unwrap_or(0.0)
}

/// The comparison table in Markdown.
pub fn markdown(runs: &[Summary]) -> String {
    let base = runs.iter().find(|r| r.level == "O0");
    let mut s = String::new();
    let _ = writeln!(
        s,
        "| level | compute | final train loss | val loss | val vs O0 | tokens/s | bytes / linear param (measured / predicted) | persistent MiB | vs O0 | skipped |"
    );
    let _ = writeln!(s, "|---|---|---|---|---|---|---|---|---|---|");
    for r in runs {
        let total = bytes(r, "total");
        let (dv, dm) = match base {
            Some(b) => (
                format!("{:+.2}%", 100.0 * (r.val_loss / b.val_loss - 1.0)),
                format!("{:.3}", total / bytes(b, "total").max(1.0)),
            ),
            None => ("-".into(), "-".into()),
        };
        let _ = writeln!(
            s,
            "| {} | {} | {:.4} | {:.4} | {dv} | {:.0} | {:.3} / {:.1} | {:.2} | {dm} | {} |",
            r.level,
            r.compute,
            r.final_loss,
            r.val_loss,
            r.tokens_per_s,
            r.bytes_per_linear_param,
            r.predicted_bytes_per_linear_param,
            total / MIB,
            r.skipped_steps
        );
    }
    let _ = writeln!(s, "\nPersistent bytes by category:\n");
    let mut head = String::from("| level |");
    let mut rule = String::from("|---|");
    for (_, label) in CATEGORIES {
        let _ = write!(head, " {label} |");
        rule.push_str("---|");
    }
    let _ = writeln!(s, "{head} total |\n{rule}---|");
    for r in runs {
        let _ = write!(s, "| {} |", r.level);
        for (key, _) in CATEGORIES {
            let _ = write!(s, " {:.0} |", bytes(r, key));
        }
        let _ = writeln!(s, " {:.0} |", bytes(r, "total"));
    }
    s
}

fn plot_err<E: std::fmt::Debug>(e: E) -> anyhow::Error {
    anyhow!("plotting: {e:?}")
}

/// The series' labels, boxed, in the upper right corner.
fn draw_legend<'a, DB: DrawingBackend + 'a, CT: plotters::coord::CoordTranslate>(
    chart: &mut ChartContext<'a, DB, CT>,
) -> Result<()>
where
    DB::ErrorType: 'static,
{
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(plot_err)
}

/// Training loss (thin) and validation loss (thick, with points) of every
/// run: the whole run on the left, its second half enlarged on the right
/// (where the levels differ, if at all).
pub fn loss_svg(runs: &[Summary], path: &Path) -> Result<()> {
    let last = runs
        .iter()
        .flat_map(|r| r.train_curve.iter().chain(&r.val_curve))
        .map(|p| p.0)
        .max()
        .unwrap_or(1)
        .max(1);
    let root = SVGBackend::new(path, (1280, 540)).into_drawing_area();
    root.fill(&WHITE).map_err(plot_err)?;
    let title = format!(
        "{} {} on the bundled corpus: loss per level",
        crate::model::ARCH,
        runs.first().map_or("", |r| r.size.as_str())
    );
    let root = root.titled(&title, ("sans-serif", 22)).map_err(plot_err)?;
    let (left, right) = root.split_horizontally(640);
    loss_panel(runs, &left, 0, last, "whole run", true)?;
    loss_panel(runs, &right, last / 2, last, "second half", false)?;
    root.present().map_err(plot_err)?;
    Ok(())
}

fn loss_panel<DB: DrawingBackend>(
    runs: &[Summary],
    area: &DrawingArea<DB, plotters::coord::Shift>,
    from: u64,
    to: u64,
    caption: &str,
    legend: bool,
) -> Result<()>
where
    DB::ErrorType: 'static,
{
    let (mut lo, mut hi) = (f32::INFINITY, f32::NEG_INFINITY);
    for &(step, loss) in runs
        .iter()
        .flat_map(|r| r.train_curve.iter().chain(&r.val_curve))
    {
        if step >= from && loss.is_finite() {
            lo = lo.min(loss);
            hi = hi.max(loss);
        }
    }
    if !(lo.is_finite() && hi > lo) {
        (lo, hi) = (0.0, lo.max(0.0) + 1.0);
    }
    let pad = 0.05 * (hi - lo);
    let mut chart = ChartBuilder::on(area)
        .caption(caption, ("sans-serif", 16))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(56)
        .build_cartesian_2d(from as f64..to as f64, (lo - pad) as f64..(hi + pad) as f64)
        .map_err(plot_err)?;
    chart
        .configure_mesh()
        .x_desc("step")
        .y_desc("cross-entropy (nats per byte)")
        .draw()
        .map_err(plot_err)?;
    let keep = |&&(s, _): &&(u64, f32)| s >= from;
    for (i, r) in runs.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        let name = format!("{} {}", r.level, r.compute);
        let train: Vec<(f64, f64)> = r
            .train_curve
            .iter()
            .filter(keep)
            .map(|&(s, l)| (s as f64, l as f64))
            .collect();
        chart
            .draw_series(LineSeries::new(train, color.mix(0.45).stroke_width(1)))
            .map_err(plot_err)?
            .label(format!("{name} train"))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.mix(0.45)));
        let val: Vec<(f64, f64)> = r
            .val_curve
            .iter()
            .filter(keep)
            .map(|&(s, l)| (s as f64, l as f64))
            .collect();
        chart
            .draw_series(LineSeries::new(val.clone(), color.stroke_width(3)))
            .map_err(plot_err)?
            .label(format!("{name} validation"))
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(3))
            });
        chart
            .draw_series(val.into_iter().map(|p| Circle::new(p, 3, color.filled())))
            .map_err(plot_err)?;
    }
    if legend {
        draw_legend(&mut chart)?;
    }
    Ok(())
}

/// Stacked bars of persistent MiB by category, one bar per run.
pub fn memory_svg(runs: &[Summary], path: &Path) -> Result<()> {
    let top = runs.iter().map(|r| bytes(r, "total")).fold(0.0, f64::max) / MIB;
    let root = SVGBackend::new(path, (960, 540)).into_drawing_area();
    root.fill(&WHITE).map_err(plot_err)?;
    let names: Vec<String> = runs
        .iter()
        .map(|r| format!("{} {}", r.level, r.compute))
        .collect();
    let mut chart = ChartBuilder::on(&root)
        .caption("Persistent memory by category", ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(64)
        .build_cartesian_2d(
            (0..runs.len().saturating_sub(1) as i32).into_segmented(),
            0f64..(top * 1.5).max(1e-3),
        )
        .map_err(plot_err)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_label_formatter(&|v| match v {
            SegmentValue::CenterOf(i) => names.get(*i as usize).cloned().unwrap_or_default(),
            _ => String::new(),
        })
        .y_desc("MiB")
        .draw()
        .map_err(plot_err)?;
    for (c, (key, label)) in CATEGORIES.iter().enumerate() {
        let color = Palette99::pick(c).to_rgba();
        let bars = runs.iter().enumerate().map(|(i, r)| {
            let below: f64 = CATEGORIES[..c]
                .iter()
                .map(|(k, _)| bytes(r, k))
                .sum::<f64>()
                / MIB;
            let here = bytes(r, key) / MIB;
            let mut bar = Rectangle::new(
                [
                    (SegmentValue::Exact(i as i32), below),
                    (SegmentValue::Exact(i as i32 + 1), below + here),
                ],
                color.filled(),
            );
            bar.set_margin(0, 0, 30, 30);
            bar
        });
        chart
            .draw_series(bars)
            .map_err(plot_err)?
            .label(*label)
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], color.filled()));
    }
    draw_legend(&mut chart)?;
    root.present().map_err(plot_err)?;
    Ok(())
}
