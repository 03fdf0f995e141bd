//! `--telemetry N`: every N steps (and the first and last), each Linear's
//! FP8 casts of that step (`amp::nn::set_telemetry`) and its weight's new
//! Adam moments where they are low-bit (`exp_avg`, `exp_avg_sq`:
//! `LowBitAdamW::take_moment_telemetry`) as rows of
//! `telemetry-{level}-{compute}.jsonl` in `--out` (step, layer, role,
//! amax, scale, saturated, flushed, elements, relative error), and the
//! `.svg` beside it: per role a heat map of
//! the relative error (layers by steps) above one of the share of elements
//! saturated or flushed to zero. Where precision is lost, by layer and
//! step.

use crate::model::Model;
use amp::levels::AmpOptimizer;
use amp::nn::{CastRecord, TELEMETRY_ROLES};
use anyhow::{anyhow, Context, Result};
use plotters::prelude::*;
use std::io::Write;
use std::path::Path;

/// One cast of one layer at one step.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Row {
    pub step: u64,
    pub layer: String,
    pub role: &'static str,
    #[serde(flatten)]
    pub cast: CastRecord,
}

/// Whether step `done` (1-based) of a run from `start` to `end` records.
pub fn records(every: u64, start: u64, done: u64, end: u64) -> bool {
    done == start + 1 || done == end || done % every.max(1) == 0
}

/// The records the model's layers kept during step `done`, taken (every
/// rank takes its own; rank 0's are written).
pub fn collect(model: &Model, done: u64) -> Result<Vec<Row>> {
    let mut rows = Vec::new();
    for (name, layer) in model.linears() {
        for (role, rec) in TELEMETRY_ROLES.iter().zip(layer.take_telemetry()?) {
            if let Some(cast) = rec {
                rows.push(Row {
                    step: done,
                    layer: name.clone(),
                    role,
                    cast,
                });
            }
        }
    }
    Ok(rows)
}

/// The roles of the optimizer's records: a Linear weight's two moments.
pub const MOMENT_ROLES: [&str; 2] = ["exp_avg", "exp_avg_sq"];

/// Every role a row can have, in the plot's column order.
fn roles() -> Vec<&'static str> {
    TELEMETRY_ROLES
        .iter()
        .chain(&MOMENT_ROLES)
        .copied()
        .collect()
}

/// The moments' records the optimizer kept during step `done`, of the
/// model's Linear weights (`{layer}.weight`, or for a layer in `tied`, the
/// weight it shares: a tied head's rows are the embedding's moments),
/// taken.
pub fn collect_moments(
    model: &Model,
    opt: &mut AmpOptimizer,
    tied: &[(String, String)],
    done: u64,
) -> Vec<Row> {
    let records = opt.inner_mut().take_moment_telemetry();
    let mut rows = Vec::new();
    for (name, _) in model.linears() {
        let layer_weight = format!("{name}.weight");
        let weight = tied
            .iter()
            .find(|(l, _)| *l == layer_weight)
            .map_or(layer_weight.clone(), |(_, w)| w.clone());
        for r in records.iter().filter(|r| r.name == weight) {
            for (role, cast) in MOMENT_ROLES.iter().zip([r.exp_avg, r.exp_avg_sq]) {
                rows.push(Row {
                    step: done,
                    layer: name.clone(),
                    role,
                    cast,
                });
            }
        }
    }
    rows
}

/// `{stem}.jsonl` and `{stem}.svg` in `dir`; returns the first's path.
pub fn write(rows: &[Row], dir: &Path, stem: &str) -> Result<std::path::PathBuf> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let path = dir.join(format!("{stem}.jsonl"));
    let mut f = std::io::BufWriter::new(
        std::fs::File::create(&path).with_context(|| format!("writing {}", path.display()))?,
    );
    for r in rows {
        writeln!(f, "{}", serde_json::to_string(r)?)?;
    }
    f.flush()?;
    heat_maps(rows, &dir.join(format!("{stem}.svg")))?;
    Ok(path)
}

fn plot_err<E: std::fmt::Debug>(e: E) -> anyhow::Error {
    anyhow!("plotting telemetry: {e:?}")
}

/// A color for `v` in `lo..hi` (log10 units): blue (low) to red (high);
/// white where there is nothing (a zero share).
fn color(v: Option<f64>, lo: f64, hi: f64) -> RGBColor {
    match v {
        None => WHITE,
        Some(v) => {
            let t = ((v - lo) / (hi - lo)).clamp(0.0, 1.0);
            let (r, g, b) = hsl_to_rgb(0.66 * (1.0 - t), 0.85, 0.5);
            RGBColor(r, g, b)
        }
    }
}

fn hsl_to_rgb(h: f64, s: f64, l: f64) -> (u8, u8, u8) {
    let c = (1.0 - (2.0 * l - 1.0).abs()) * s;
    let hp = h * 6.0;
    let x = c * (1.0 - (hp % 2.0 - 1.0).abs());
    let (r, g, b) = match hp as u32 {
        0 => (c, x, 0.0),
        1 => (x, c, 0.0),
        2 => (0.0, c, x),
        3 => (0.0, x, c),
        4 => (x, 0.0, c),
        _ => (c, 0.0, x),
    };
    let m = l - c / 2.0;
    let u = |v: f64| ((v + m) * 255.0).round().clamp(0.0, 255.0) as u8;
    (u(r), u(g), u(b))
}

/// Per role, a column of two heat maps (layers by recorded steps):
/// log10 of the relative error (-4 .. 0) and of the share saturated or
/// flushed (-6 .. 0).
fn heat_maps(rows: &[Row], path: &Path) -> Result<()> {
    let mut steps: Vec<u64> = rows.iter().map(|r| r.step).collect();
    steps.sort_unstable();
    steps.dedup();
    let mut layers: Vec<&str> = Vec::new();
    for r in rows {
        if !layers.contains(&r.layer.as_str()) {
            layers.push(&r.layer);
        }
    }
    let root = SVGBackend::new(path, (2100, 900)).into_drawing_area();
    root.fill(&WHITE).map_err(plot_err)?;
    let root = root
        .titled(
            "FP8 casts and Adam moments per Linear (rows, forward order) and step (columns): \
             log10 relative error (top, -4 blue .. 0 red), log10 share saturated or \
             flushed (bottom, -6 .. 0; white: none)",
            ("sans-serif", 16),
        )
        .map_err(plot_err)?;
    let roles = roles();
    let columns = root.split_evenly((2, roles.len()));
    for (i, role) in roles.iter().enumerate() {
        for (row, (area, lo, hi)) in [
            (&columns[i], -4.0, 0.0),
            (&columns[roles.len() + i], -6.0, 0.0),
        ]
        .into_iter()
        .enumerate()
        {
            let caption = if row == 0 {
                format!("{role}: relative error")
            } else {
                format!("{role}: saturated + flushed")
            };
            let mut chart = ChartBuilder::on(area)
                .caption(caption, ("sans-serif", 14))
                .margin(8)
                .x_label_area_size(28)
                .y_label_area_size(40)
                .build_cartesian_2d(0..steps.len().max(1), 0..layers.len().max(1))
                .map_err(plot_err)?;
            chart
                .configure_mesh()
                .disable_mesh()
                .x_desc("step")
                .y_desc("layer")
                .x_label_formatter(&|x| steps.get(*x).map_or(String::new(), u64::to_string))
                .draw()
                .map_err(plot_err)?;
            let cells = rows.iter().filter(|r| r.role == *role).filter_map(|r| {
                let x = steps.iter().position(|s| *s == r.step)?;
                let y = layers.iter().position(|l| *l == r.layer)?;
                let v = if row == 0 {
                    (r.cast.rel_err > 0.0).then(|| r.cast.rel_err.log10())
                } else {
                    let lost = (r.cast.saturated + r.cast.flushed) as f64;
                    (lost > 0.0).then(|| (lost / r.cast.total.max(1) as f64).log10())
                };
                Some(Rectangle::new(
                    [(x, y), (x + 1, y + 1)],
                    color(v, lo, hi).filled(),
                ))
            });
            chart.draw_series(cells).map_err(plot_err)?;
        }
    }
    root.present().map_err(plot_err)?;
    Ok(())
}
