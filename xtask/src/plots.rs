//! `cargo xtask plots`: the benchmarks' figures as SVG, drawn from the JSON
//! the bench writes beside its report (docs/benchmarks.json), into the
//! files its sections name (docs/plots/). plotters draws them with its SVG
//! backend and no font library (text is `<text>`, sized by estimate), so
//! the same JSON gives the same bytes on every machine.
//!
//! Each section's `plots` name a kind; the drawing of each kind reads that
//! section's `data`:
//!
//! - `shares-over-time`: each job's share of the pair's GPU time since the
//!   window opened, every round, against the targets, per kernel length;
//! - `share-error`: the split's error per round against kernel length;
//! - `latency-ccdf`: the interactive process's request latency as a CCDF
//!   (P(latency > x), log scale), per neighbour, one line per setting;
//! - `broker-scale`: grant latency p99 and broker CPU per grant against the
//!   clients connected, for 1 and 8 GPUs.

use std::path::{Path, PathBuf};

use plotters::coord::Shift;
use plotters::coord::ranged1d::{AsRangedCoord, ValueFormatter};
use plotters::prelude::*;
use serde_json::Value;

/// Colours by role, the same in every plot.
const FIRST: RGBColor = RGBColor(31, 119, 180);
const SECOND: RGBColor = RGBColor(255, 127, 14);
const TARGET: RGBColor = RGBColor(110, 110, 110);
const ALONE: RGBColor = RGBColor(120, 120, 120);
const NATIVE: RGBColor = RGBColor(214, 39, 40);
const DEFAULT: RGBColor = RGBColor(31, 119, 180);
const HIGH: RGBColor = RGBColor(44, 160, 44);
const MPS: RGBColor = RGBColor(148, 103, 189);
const GRID: RGBColor = RGBColor(228, 228, 228);
const FONT: &str = "sans-serif";

type Area<'a> = DrawingArea<SVGBackend<'a>, Shift>;

/// Reads the bench's JSON at `json` and writes every plot its sections
/// name under `out_dir`; returns the files written.
pub fn plots(json: &Path, out_dir: &Path) -> Result<Vec<PathBuf>, String> {
    let text = std::fs::read_to_string(json).map_err(|e| {
        format!(
            "cannot read {}: {e}; the bench writes it (cargo run --release -p gpufrac-bench)",
            json.display()
        )
    })?;
    let doc: Value = serde_json::from_str(&text)
        .map_err(|e| format!("{} is not the bench's JSON: {e}", json.display()))?;
    let mut written = Vec::new();
    for (file, svg) in draw(&doc)? {
        let path = out_dir.join(&file);
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)
                .map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
        }
        std::fs::write(&path, svg).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
        written.push(path);
    }
    if written.is_empty() {
        return Err(format!(
            "{} names no plot: it is from a bench run without the sections that have them \
             (latency, accuracy, scale)",
            json.display()
        ));
    }
    Ok(written)
}

/// Every plot the document's sections name: (file, SVG).
pub fn draw(doc: &Value) -> Result<Vec<(String, String)>, String> {
    let footer = footer(doc);
    let mut out = Vec::new();
    for s in doc["sections"].as_array().into_iter().flatten() {
        for p in s["plots"].as_array().into_iter().flatten() {
            let (Some(kind), Some(file)) = (p["kind"].as_str(), p["file"].as_str()) else {
                return Err(format!(
                    "a plot of section {} lacks its kind or file",
                    s["key"]
                ));
            };
            let file = safe_file(file)?;
            let data = &s["data"];
            let title = p["title"].as_str().unwrap_or(kind);
            let svg = match kind {
                "shares-over-time" => svg((1080, 400), title, &footer, |a| shares(a, data)),
                "share-error" => svg((720, 420), title, &footer, |a| share_error(a, data)),
                "latency-ccdf" => svg((1080, 440), title, &footer, |a| ccdf(a, data)),
                "broker-scale" => svg((1080, 420), title, &footer, |a| scale(a, data)),
                other => return Err(format!("unknown plot kind {other:?} in {file}")),
            }
            .map_err(|e| format!("drawing {file}: {e}"))?;
            out.push((file, svg));
        }
    }
    Ok(out)
}

/// A section's file, relative and inside the output directory.
fn safe_file(file: &str) -> Result<String, String> {
    let p = Path::new(file);
    let ok = p.extension().is_some_and(|e| e == "svg")
        && p.components()
            .all(|c| matches!(c, std::path::Component::Normal(_)));
    if ok {
        Ok(file.to_owned())
    } else {
        Err(format!(
            "plot file {file:?}: expected a relative path ending in .svg, such as plots/x.svg"
        ))
    }
}

/// Where the figures come from, under every plot: the simulated driver,
/// the machine and how loaded it was.
fn footer(doc: &Value) -> String {
    let m = &doc["machine"];
    let nproc = m["nproc"].as_u64().unwrap_or(0);
    let load: f64 = doc["load"][0]
        .as_str()
        .and_then(|l| l.split_whitespace().next())
        .and_then(|l| l.parse().ok())
        .unwrap_or(0.0);
    let busy = if nproc > 0 && load > nproc as f64 {
        format!(", shared and loaded (load average {load:.1} at the start)")
    } else {
        String::new()
    };
    format!(
        "simulated driver; {} CPUs ({}){busy}; {} build; {}",
        nproc,
        m["cpu"].as_str().unwrap_or("unknown CPU"),
        doc["profile"].as_str().unwrap_or("?"),
        doc["date"].as_str().unwrap_or("")
    )
}

/// An SVG of `size` with a title and a footer around what `body` draws.
fn svg(
    size: (u32, u32),
    title: &str,
    footer: &str,
    body: impl FnOnce(&Area) -> Result<(), String>,
) -> Result<String, String> {
    let mut out = String::new();
    {
        let root = SVGBackend::with_string(&mut out, size).into_drawing_area();
        root.fill(&WHITE).map_err(|e| e.to_string())?;
        let (top, rest) = root.split_vertically(34);
        let (middle, bottom) = rest.split_vertically(size.1 - 34 - 22);
        top.draw_text(title, &(FONT, 15).into_text_style(&top), (10, 10))
            .map_err(|e| e.to_string())?;
        bottom
            .draw_text(
                footer,
                &(FONT, 11).into_text_style(&bottom).color(&TARGET),
                (10, 4),
            )
            .map_err(|e| e.to_string())?;
        body(&middle)?;
        root.present().map_err(|e| e.to_string())?;
    }
    Ok(out)
}

fn num(v: &Value, what: &str) -> Result<f64, String> {
    v.as_f64()
        .ok_or_else(|| format!("expected a number for {what}, found {v}"))
}

fn list<'a>(v: &'a Value, what: &str) -> Result<&'a Vec<Value>, String> {
    v.as_array()
        .ok_or_else(|| format!("expected a list for {what}, found {v}"))
}

fn nums(v: &Value, what: &str) -> Result<Vec<f64>, String> {
    list(v, what)?.iter().map(|x| num(x, what)).collect()
}

fn e2s<E: std::fmt::Display>(e: E) -> String {
    e.to_string()
}

/// `50 us`, `6 ms`: a time in us as an axis labels it.
fn us_label(v: &f64) -> String {
    if *v >= 1000.0 {
        format!("{} ms", trim(v / 1000.0))
    } else {
        format!("{} us", trim(*v))
    }
}

/// A number without a needless fraction: `10`, `0.5`, `0.01`, `1.5`,
/// `2.25`. Two decimals past the first significant digit at most, so that
/// ticks a half or a quarter apart keep their fraction (1.5 is not 2).
fn trim(v: f64) -> String {
    let digits = if v == 0.0 || v.abs() >= 1.0 {
        2
    } else {
        (-v.abs().log10()).ceil() as usize + 2
    };
    let s = format!("{v:.digits$}");
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_owned()
    } else {
        s
    }
}

/// Ticks for a log axis from `lo` to `hi`: 1, 2 and 5 of each decade
/// within it, or every digit of it where that gives fewer than four, so
/// that an axis spanning less than a decade has ticks to read (plotters
/// marks the powers of ten alone: one tick, or none).
fn log_ticks(lo: f64, hi: f64) -> Vec<f64> {
    let pick = |steps: &[f64]| -> Vec<f64> {
        let mut out = Vec::new();
        let mut e = lo.log10().floor() as i32;
        // Divided by a power of ten below 1, not multiplied by a fraction:
        // 3 / 10 is the 0.3 a label says, 3 * 0.1 is not.
        let at = |m: f64, e: i32| {
            if e >= 0 {
                m * 10f64.powi(e)
            } else {
                m / 10f64.powi(-e)
            }
        };
        while at(1.0, e) <= hi {
            for &m in steps {
                let t = at(m, e);
                if t >= lo && t <= hi {
                    out.push(t);
                }
            }
            e += 1;
        }
        out
    };
    let coarse = pick(&[1.0, 2.0, 5.0]);
    if coarse.len() >= 4 {
        coarse
    } else {
        pick(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0])
    }
}

/// A legend entry's mark: a short line in `color`.
fn mark(color: RGBColor) -> impl Fn((i32, i32)) -> PathElement<(i32, i32)> {
    move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
}

/// A panel's chart on `area`: its caption, room for the axes' labels,
/// and its coordinates.
fn chart<'a, 'b, X: AsRangedCoord, Y: AsRangedCoord>(
    area: &'a Area<'b>,
    caption: Option<&str>,
    x: X,
    y: Y,
) -> Result<Chart<'a, 'b, X::CoordDescType, Y::CoordDescType>, String> {
    let mut b = ChartBuilder::on(area);
    b.margin(8).x_label_area_size(36).y_label_area_size(64);
    if let Some(c) = caption {
        b.caption(c, (FONT, 13));
    }
    b.build_cartesian_2d(x, y).map_err(e2s)
}

type Chart<'a, 'b, X, Y> = ChartContext<'a, SVGBackend<'b>, Cartesian2d<X, Y>>;
type Fmt<'f> = &'f dyn Fn(&f64) -> String;

/// The axes: what they measure, their labels as `xf` and `yf` write
/// them, and a light grid at the labels only.
fn axes<X, Y>(
    c: &mut Chart<'_, '_, X, Y>,
    (x_desc, xf): (&str, Fmt),
    (y_desc, yf): (&str, Fmt),
) -> Result<(), String>
where
    X: Ranged<ValueType = f64> + ValueFormatter<f64>,
    Y: Ranged<ValueType = f64> + ValueFormatter<f64>,
{
    c.configure_mesh()
        .x_desc(x_desc)
        .y_desc(y_desc)
        .x_label_formatter(xf)
        .y_label_formatter(yf)
        .x_labels(8)
        .max_light_lines(0)
        .bold_line_style(GRID)
        .draw()
        .map_err(e2s)
}

/// A dashed level across the chart from `x.0` to `x.1` at `y` (a target),
/// named in the legend when `label` is.
fn level<X, Y>(
    c: &mut Chart<'_, '_, X, Y>,
    x: (f64, f64),
    y: f64,
    color: RGBAColor,
    label: Option<(String, RGBColor)>,
) -> Result<(), String>
where
    X: Ranged<ValueType = f64>,
    Y: Ranged<ValueType = f64>,
{
    let s = c
        .draw_series(DashedLineSeries::new(
            [(x.0, y), (x.1, y)],
            6,
            4,
            color.stroke_width(1),
        ))
        .map_err(e2s)?;
    if let Some((l, mark_color)) = label {
        s.label(l).legend(mark(mark_color));
    }
    Ok(())
}

/// A solid line of `points`, named in the legend when `label` is.
fn line<X, Y>(
    c: &mut Chart<'_, '_, X, Y>,
    points: Vec<(f64, f64)>,
    color: RGBColor,
    width: u32,
    label: Option<String>,
) -> Result<(), String>
where
    X: Ranged<ValueType = f64>,
    Y: Ranged<ValueType = f64>,
{
    let s = c
        .draw_series(LineSeries::new(points, color.stroke_width(width)))
        .map_err(e2s)?;
    if let Some(l) = label {
        s.label(l).legend(mark(color));
    }
    Ok(())
}

/// The legend, boxed, at `at`.
fn legend<'a, 'b: 'a, X, Y>(
    c: &mut Chart<'a, 'b, X, Y>,
    at: SeriesLabelPosition,
) -> Result<(), String>
where
    X: Ranged<ValueType = f64>,
    Y: Ranged<ValueType = f64>,
{
    c.configure_series_labels()
        .position(at)
        .label_font((FONT, 11))
        .background_style(WHITE.mix(0.85))
        .border_style(TARGET)
        .draw()
        .map_err(e2s)
}

fn plain(v: &f64) -> String {
    trim(*v)
}

fn shares(area: &Area, data: &Value) -> Result<(), String> {
    let targets = nums(&data["targets"], "targets")?;
    let kernels = list(&data["kernels"], "kernels")?;
    let panels = area.split_evenly((1, kernels.len().max(1)));
    for (k, panel) in kernels.iter().zip(&panels) {
        let window = num(&k["window_s"], "window_s")?;
        let label = k["label"].as_str().unwrap_or("?");
        let caption = format!("{label} kernels");
        let mut c = chart(panel, Some(&caption), 0f64..window, 0f64..1f64)?;
        axes(
            &mut c,
            ("time since the window opened (s)", &plain),
            ("share of the pair's GPU time", &plain),
        )?;
        for (i, &t) in targets.iter().enumerate() {
            let color = if i == 0 { FIRST } else { SECOND };
            let label = (i == 0).then(|| ("targets (dashed)".to_owned(), TARGET));
            level(&mut c, (0.0, window), t, color.mix(0.6), label)?;
        }
        for (r, round) in list(&k["rounds"], "rounds")?.iter().enumerate() {
            let step = num(&round["trace_step_ms"], "trace_step_ms")? / 1e3;
            let ns = list(&round["executed_ns"], "executed_ns")?;
            let (a, b) = (
                nums(&ns[0], "executed_ns")?,
                nums(ns.get(1).unwrap_or(&Value::Null), "executed_ns")?,
            );
            // Cumulative: where each job stands since the window opened.
            let points = |mine: &[f64]| -> Vec<(f64, f64)> {
                mine.iter()
                    .zip(a.iter().zip(&b))
                    .enumerate()
                    .filter(|(_, (_, (x, y)))| *x + *y > 0.0)
                    .map(|(i, (m, (x, y)))| ((i + 1) as f64 * step, m / (x + y)))
                    .collect()
            };
            for (mine, color, name) in [(&a, FIRST, "70% job"), (&b, SECOND, "30% job")] {
                let label = (r == 0).then(|| format!("{name}, each round"));
                line(&mut c, points(mine), color, 1, label)?;
            }
        }
        legend(&mut c, SeriesLabelPosition::MiddleRight)?;
    }
    Ok(())
}

fn share_error(area: &Area, data: &Value) -> Result<(), String> {
    let target = num(&data["error_target_pp"], "error_target_pp")?;
    let kernels = list(&data["kernels"], "kernels")?;
    let mut rounds = Vec::new();
    let mut pooled = Vec::new();
    for k in kernels {
        let us = num(&k["kernel_us"], "kernel_us")?;
        pooled.push((us, num(&k["error_pp"], "error_pp")?));
        for r in list(&k["rounds"], "rounds")? {
            rounds.push((us, num(&r["error_pp"], "error_pp")?));
        }
    }
    let top = rounds
        .iter()
        .chain(&pooled)
        .map(|p| p.1)
        .fold(target, f64::max)
        * 1.25;
    let xs = (20.0, 300_000.0);
    let mut c = chart(area, None, (xs.0..xs.1).log_scale(), 0f64..top)?;
    axes(
        &mut c,
        ("kernel length (log scale)", &us_label),
        ("split error (percentage points)", &plain),
    )?;
    let label = Some((format!("target: {target} pp"), NATIVE));
    level(&mut c, xs, target, NATIVE.mix(0.7), label)?;
    line(&mut c, pooled, FIRST, 2, Some("rounds pooled".into()))?;
    c.draw_series(rounds.iter().map(|&p| Circle::new(p, 3, SECOND.filled())))
        .map_err(e2s)?
        .label("each round")
        .legend(mark(SECOND));
    legend(&mut c, SeriesLabelPosition::UpperLeft)
}

/// The colour of a latency series by its setting.
fn setting_color(setting: &str) -> RGBColor {
    match setting {
        "alone" => ALONE,
        "native" => NATIVE,
        "default" => DEFAULT,
        "high" => HIGH,
        _ => MPS,
    }
}

/// The CCDF of sorted samples as a step line: P(X ≥ x), which holds at
/// each distinct value and drops just past it, so that the line ends at
/// the largest sample at 1/n (a log axis has no 0).
fn ccdf_points(sorted: &[f64]) -> Vec<(f64, f64)> {
    let n = sorted.len() as f64;
    let mut out: Vec<(f64, f64)> = Vec::new();
    for (i, &x) in sorted.iter().enumerate() {
        if i > 0 && sorted[i - 1] == x {
            continue;
        }
        let p = (n - i as f64) / n;
        if let Some(&(_, before)) = out.last() {
            out.push((x, before));
        }
        out.push((x, p));
    }
    out
}

fn ccdf(area: &Area, data: &Value) -> Result<(), String> {
    let series = list(&data["series"], "series")?;
    // The neighbours, in the order the bench measured them.
    let mut neighbours: Vec<u64> = Vec::new();
    for s in series {
        if let Some(n) = s["neighbour_us"].as_u64()
            && !neighbours.contains(&n)
        {
            neighbours.push(n);
        }
    }
    let alone = series
        .iter()
        .find(|s| s["neighbour_us"].is_null())
        .map(|s| nums(&s["latencies_us"], "latencies_us"))
        .transpose()?;
    let (body, note) = area.split_vertically(area.dim_in_pixel().1 - 18);
    if let Some(why) = data["mps"].as_str()
        && !series.iter().any(|s| s["setting"] == "mps")
    {
        note.draw_text(
            &format!("--mps: {why}"),
            &(FONT, 11).into_text_style(&note).color(&MPS),
            (10, 2),
        )
        .map_err(e2s)?;
    }
    let panels = body.split_evenly((1, neighbours.len().max(1)));
    for (&n, panel) in neighbours.iter().zip(&panels) {
        let mut lines: Vec<(String, RGBColor, Vec<f64>)> = Vec::new();
        if let Some(a) = &alone {
            lines.push(("alone".into(), ALONE, a.clone()));
        }
        for s in series
            .iter()
            .filter(|s| s["neighbour_us"].as_u64() == Some(n))
        {
            let setting = s["setting"].as_str().unwrap_or("?");
            let label = s["label"].as_str().unwrap_or(setting).to_owned();
            lines.push((
                label,
                setting_color(setting),
                nums(&s["latencies_us"], "latencies_us")?,
            ));
        }
        let n_max = lines.iter().map(|l| l.2.len()).max().unwrap_or(1).max(1);
        let all = || lines.iter().flat_map(|l| l.2.iter().copied());
        let x_max = all().fold(1.0f64, f64::max) / 1e3 * 1.3;
        let x_min = all().fold(f64::INFINITY, f64::min).min(x_max * 1e3 / 2.0) / 1e3 / 1.3;
        let y_min = 1.0 / n_max as f64 / 2.0;
        // The target the text states for this panel's high series: its
        // p99 within it (P(latency >= x) at most 1% from there on).
        let target = data["targets"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|t| t["neighbour_us"].as_u64() == Some(n))
            .and_then(|t| t["high_p99_us"].as_f64())
            .map(|us| us / 1e3);
        let x_max = x_max.max(target.map_or(0.0, |t| t * 1.3));
        let caption = format!("beside {} kernels", us_label(&(n as f64)));
        let mut c = chart(
            panel,
            Some(&caption),
            (x_min..x_max)
                .log_scale()
                .with_key_points(log_ticks(x_min, x_max)),
            (y_min..1f64).log_scale(),
        )?;
        axes(
            &mut c,
            ("request latency (ms, log scale)", &plain),
            ("P(latency >= x)", &plain),
        )?;
        if let Some(t) = target {
            let label = format!("high p99 target: {}", us_label(&(t * 1e3)));
            c.draw_series(DashedLineSeries::new(
                [(t, y_min), (t, 0.01)],
                6,
                4,
                HIGH.mix(0.8).stroke_width(1),
            ))
            .map_err(e2s)?;
            let s = c
                .draw_series(DashedLineSeries::new(
                    [(x_min, 0.01), (t, 0.01)],
                    6,
                    4,
                    HIGH.mix(0.8).stroke_width(1),
                ))
                .map_err(e2s)?;
            s.label(label).legend(|(x, y)| {
                PathElement::new(vec![(x, y), (x + 18, y)], HIGH.mix(0.8).stroke_width(1))
            });
        }
        for (label, color, v) in lines {
            let mut sorted = v;
            sorted.sort_by(f64::total_cmp);
            let pts = ccdf_points(&sorted)
                .into_iter()
                .map(|(x, p)| (x / 1e3, p))
                .collect();
            line(&mut c, pts, color, 2, Some(label))?;
        }
        legend(&mut c, SeriesLabelPosition::LowerLeft)?;
    }
    Ok(())
}

fn scale(area: &Area, data: &Value) -> Result<(), String> {
    let target = num(&data["p99_target_us"], "p99_target_us")?;
    let rows = list(&data["rows"], "rows")?;
    // (gpus) -> [(clients, p99, p99 free, cpu per grant)], rows without a
    // deep queue only.
    let mut by_gpus: Vec<(u64, Vec<[f64; 4]>)> = Vec::new();
    for r in rows {
        if r["queued"].as_u64().unwrap_or(0) > 0 {
            continue;
        }
        let g = r["gpus"].as_u64().unwrap_or(0);
        let p = [
            num(&r["clients"], "clients")?,
            num(&r["grant_p99_us"], "grant_p99_us")?,
            num(&r["grant_p99_free_us"], "grant_p99_free_us")?,
            num(&r["cpu_per_grant_us"], "cpu_per_grant_us")?,
        ];
        match by_gpus.iter_mut().find(|(x, _)| *x == g) {
            Some((_, v)) => v.push(p),
            None => by_gpus.push((g, vec![p])),
        }
    }
    let points = || by_gpus.iter().flat_map(|(_, v)| v.iter());
    let xs = (0.8, points().map(|p| p[0]).fold(2.0f64, f64::max) * 1.5);
    let panels = area.split_evenly((1, 2));
    let colors = [FIRST, SECOND, HIGH, MPS];
    // Left: grant p99 (solid) and its GPU-free p99 (dashed).
    let p99_max = points().map(|p| p[1].max(p[2])).fold(target, f64::max) * 2.0;
    let p99_min = points().map(|p| p[1].min(p[2])).fold(target, f64::min) / 2.0;
    let mut c = chart(
        &panels[0],
        Some("grant latency p99"),
        (xs.0..xs.1).log_scale(),
        (p99_min..p99_max).log_scale(),
    )?;
    axes(
        &mut c,
        ("clients connected (log scale)", &plain),
        ("grant latency p99 (log scale)", &us_label),
    )?;
    let label = Some((format!("target: {target:.0} us"), NATIVE));
    level(&mut c, xs, target, NATIVE.mix(0.7), label)?;
    for (i, (g, v)) in by_gpus.iter().enumerate() {
        let color = colors[i % colors.len()];
        let p99 = v.iter().map(|p| (p[0], p[1])).collect();
        line(&mut c, p99, color, 2, Some(format!("{g} GPU(s)")))?;
        c.draw_series(DashedLineSeries::new(
            v.iter().map(|p| (p[0], p[2])),
            5,
            3,
            color.stroke_width(1),
        ))
        .map_err(e2s)?
        .label(format!("{g} GPU(s), GPU free"))
        .legend(mark(color));
    }
    legend(&mut c, SeriesLabelPosition::UpperLeft)?;
    // Right: broker CPU per grant.
    let cpu_max = points().map(|p| p[3]).fold(1.0f64, f64::max) * 1.15;
    let mut c = chart(
        &panels[1],
        Some("broker CPU per grant"),
        (xs.0..xs.1).log_scale(),
        0f64..cpu_max,
    )?;
    axes(
        &mut c,
        ("clients connected (log scale)", &plain),
        ("broker CPU per grant (us)", &plain),
    )?;
    for (i, (g, v)) in by_gpus.iter().enumerate() {
        let cpu = v.iter().map(|p| (p[0], p[3])).collect();
        line(
            &mut c,
            cpu,
            colors[i % colors.len()],
            2,
            Some(format!("{g} GPU(s)")),
        )?;
    }
    legend(&mut c, SeriesLabelPosition::UpperRight)
}

#[cfg(test)]
mod tests {
    use super::*;

    const FIXTURE: &str = include_str!("../tests/plots-fixture.json");

    fn fixture() -> Value {
        serde_json::from_str(FIXTURE).unwrap()
    }

    /// `#RRGGBB` of a colour, as the SVG writes it.
    fn hex(c: RGBColor) -> String {
        format!("#{:02X}{:02X}{:02X}", c.0, c.1, c.2)
    }

    /// The point counts of the solid polylines drawn in `color` and
    /// `width`, in order (dashed lines are many short ones, or faded).
    fn lines(doc: &roxmltree::Document, color: RGBColor, width: u32) -> Vec<usize> {
        doc.descendants()
            .filter(|n| {
                n.has_tag_name("polyline")
                    && n.attribute("stroke") == Some(&hex(color))
                    && n.attribute("opacity") == Some("1")
                    && n.attribute("stroke-width") == Some(&width.to_string())
            })
            .map(|n| {
                n.attribute("points")
                    .unwrap_or("")
                    .split_whitespace()
                    .count()
            })
            .collect()
    }

    fn texts(doc: &roxmltree::Document) -> Vec<String> {
        doc.descendants()
            .filter(|n| n.has_tag_name("text"))
            .filter_map(|n| n.text())
            .map(|t| t.trim().to_owned())
            .collect()
    }

    fn drawn() -> Vec<(String, String)> {
        draw(&fixture()).unwrap()
    }

    fn parsed<'a>(all: &'a [(String, String)], file: &str) -> roxmltree::Document<'a> {
        let svg = &all.iter().find(|(f, _)| f == file).unwrap().1;
        let doc = roxmltree::Document::parse(svg).unwrap_or_else(|e| panic!("{file}: {e}"));
        let root = doc.root_element();
        assert_eq!(root.tag_name().name(), "svg", "{file}");
        assert_eq!(
            root.tag_name().namespace(),
            Some("http://www.w3.org/2000/svg"),
            "{file}"
        );
        doc
    }

    #[test]
    fn every_plot_the_sections_name_is_drawn_as_svg() {
        let all = drawn();
        let files: Vec<&str> = all.iter().map(|(f, _)| f.as_str()).collect();
        assert_eq!(
            files,
            [
                "plots/broker-scale.svg",
                "plots/latency-ccdf.svg",
                "plots/shares-over-time.svg",
                "plots/share-error.svg"
            ]
        );
        for (f, _) in &all {
            let doc = parsed(&all, f);
            let t = texts(&doc);
            // Where the figures come from, and that the machine was loaded.
            assert!(
                t.iter().any(|x| x.starts_with(
                    "simulated driver; 2 CPUs (Test CPU), shared \
                                                 and loaded (load average 3.5 at the start)"
                )),
                "{f}: {t:?}"
            );
        }
    }

    /// Each latency series is its CCDF as a step line: the alone series
    /// (400, 500, 500, 900 us) has three distinct values, so five points,
    /// once per panel; every setting is in the legend, and the missing MPS
    /// series is said.
    #[test]
    fn the_latency_ccdf_holds_each_setting_as_a_step_line() {
        let all = drawn();
        let doc = parsed(&all, "plots/latency-ccdf.svg");
        let alone = lines(&doc, ALONE, 2);
        // Two panels: the series, then its legend mark (two points).
        assert_eq!(alone, [5, 2, 5, 2], "{alone:?}");
        // 1100..1750: five distinct values, nine points; then 1600, 2600.
        assert_eq!(lines(&doc, NATIVE, 2), [9, 2, 3, 2]);
        assert_eq!(lines(&doc, HIGH, 2), [5, 2, 3, 2]);
        let t = texts(&doc);
        for label in [
            "beside 50 us kernels",
            "beside 6 ms kernels",
            "alone",
            "without gpufrac",
            "gpufrac, default",
            "gpufrac, interactive high",
            "--mps: not measured in the fixture",
        ] {
            assert!(t.iter().any(|x| x == label), "{label:?} not in {t:?}");
        }
        assert_eq!(
            ccdf_points(&[400.0, 500.0, 500.0, 900.0]),
            [
                (400.0, 1.0),
                (500.0, 1.0),
                (500.0, 0.75),
                (900.0, 0.75),
                (900.0, 0.25)
            ]
        );
    }

    /// Shares over time: each round of each job a line with a point per
    /// trace step (a step before either job ran is left out), the targets
    /// dashed; share error: a dot per round.
    #[test]
    fn shares_hold_every_round_and_errors_every_dot() {
        let all = drawn();
        let doc = parsed(&all, "plots/shares-over-time.svg");
        // Per panel, each round; the 120 ms panel's first round has a step
        // with no GPU time yet.
        assert_eq!(lines(&doc, FIRST, 1), [4, 4, 3, 4]);
        assert_eq!(lines(&doc, SECOND, 1), [4, 4, 3, 4]);
        let t = texts(&doc);
        for label in ["50 us kernels", "120 ms kernels", "targets (dashed)"] {
            assert!(t.iter().any(|x| x == label), "{label:?} not in {t:?}");
        }

        let doc = parsed(&all, "plots/share-error.svg");
        let dots = doc
            .descendants()
            .filter(|n| n.has_tag_name("circle") && n.attribute("fill") == Some(&hex(SECOND)))
            .count();
        assert_eq!(dots, 4, "two rounds of two kernel lengths");
        assert_eq!(
            lines(&doc, FIRST, 2),
            [2, 2],
            "the pooled line and its mark"
        );
        assert!(texts(&doc).iter().any(|x| x == "target: 2 pp"));
    }

    /// Axis labels each say a different number: the share-error plot's
    /// y axis once read 0, 0.5, 1, 2, 2, 2 (1.5 and 2.5 rounded to 2).
    #[test]
    fn axis_labels_keep_their_fractions() {
        assert_eq!(trim(1.5), "1.5");
        assert_eq!(trim(2.25), "2.25");
        assert_eq!(trim(0.05), "0.05");
        assert_eq!(trim(10.0), "10");
        for file in ["plots/share-error.svg", "plots/shares-over-time.svg"] {
            let all = drawn();
            let doc = parsed(&all, file);
            let mut numbers: Vec<String> = texts(&doc)
                .into_iter()
                .filter(|t| t.parse::<f64>().is_ok())
                .collect();
            let n = numbers.len();
            numbers.sort();
            numbers.dedup();
            assert!(n > 3, "{file}: {numbers:?}");
            // Per panel the y labels repeat; never within one axis.
            let doc_texts = texts(&doc);
            let first_axis: Vec<&String> = doc_texts
                .iter()
                .filter(|t| t.parse::<f64>().is_ok())
                .take(4)
                .collect();
            let mut seen = first_axis.clone();
            seen.dedup();
            assert_eq!(seen, first_axis, "{file}");
        }
    }

    /// A log axis spanning less than a decade still has ticks to read, and
    /// each latency panel draws the target its text states for the high
    /// series (its p99 within it).
    #[test]
    fn latency_panels_have_ticks_and_their_targets() {
        assert_eq!(
            log_ticks(0.3, 2.6),
            [0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 2.0]
        );
        assert_eq!(
            log_ticks(0.1, 60.0),
            [0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0]
        );
        let all = drawn();
        let doc = parsed(&all, "plots/latency-ccdf.svg");
        let t = texts(&doc);
        for label in ["high p99 target: 1.85 ms", "high p99 target: 3.4 ms"] {
            assert!(t.iter().any(|x| x == label), "{label:?} not in {t:?}");
        }
        // Two panels, each with at least four x ticks (and the y axis's).
        let ticks = t.iter().filter(|x| x.parse::<f64>().is_ok()).count();
        assert!(ticks >= 2 * (4 + 2), "{t:?}");
    }

    /// Broker scale: per GPU count, a p99 line (and its GPU-free one) and a
    /// CPU-per-grant line of three client counts; the deep-queue row is
    /// not one of them.
    #[test]
    fn broker_scale_holds_a_line_per_gpu_count() {
        let all = drawn();
        let doc = parsed(&all, "plots/broker-scale.svg");
        // The p99 line and its mark, the dashed GPU-free line's mark; then
        // the CPU panel's line and its mark.
        assert_eq!(lines(&doc, FIRST, 2), [3, 2, 2, 3, 2]);
        assert_eq!(lines(&doc, SECOND, 2), [3, 2, 2, 3, 2]);
        let t = texts(&doc);
        for label in [
            "1 GPU(s)",
            "8 GPU(s)",
            "target: 1000 us",
            "broker CPU per grant",
        ] {
            assert!(t.iter().any(|x| x == label), "{label:?} not in {t:?}");
        }
    }

    #[test]
    fn the_same_json_draws_the_same_bytes() {
        assert_eq!(drawn(), drawn());
    }

    /// docs/plots/ is what `cargo xtask plots` draws from
    /// docs/benchmarks.json: regenerated, byte for byte.
    #[test]
    fn the_committed_plots_are_drawn_from_the_committed_json() {
        let docs = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs");
        let doc: Value =
            serde_json::from_str(&std::fs::read_to_string(docs.join("benchmarks.json")).unwrap())
                .unwrap();
        let all = draw(&doc).unwrap();
        assert_eq!(all.len(), 4);
        for (file, svg) in all {
            let committed = std::fs::read_to_string(docs.join(&file))
                .unwrap_or_else(|e| panic!("docs/{file}: {e}; run cargo xtask plots"));
            assert!(
                committed == svg,
                "docs/{file} is not what docs/benchmarks.json draws; run cargo xtask plots"
            );
        }
    }

    #[test]
    fn bad_plots_are_refused_saying_why() {
        let mut doc = fixture();
        doc["sections"][0]["plots"][0]["kind"] = "pie".into();
        let e = draw(&doc).unwrap_err();
        assert!(e.contains("unknown plot kind \"pie\""), "{e}");
        let mut doc = fixture();
        doc["sections"][0]["plots"][0]["file"] = "../../etc/x.svg".into();
        let e = draw(&doc).unwrap_err();
        assert!(e.contains("expected a relative path ending in .svg"), "{e}");
        let mut doc = fixture();
        doc["sections"][1]["data"]["series"][0]["latencies_us"] = "many".into();
        let e = draw(&doc).unwrap_err();
        assert!(e.contains("expected a list for latencies_us"), "{e}");
    }
}
