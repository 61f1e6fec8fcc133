//! Drawing a frame: the header, a strip per GPU, the process pane (a tree
//! of users, jobs and processes, or a flat table), the queue, the keys;
//! and over them help or a detail. Everything fits the frame it is given,
//! down to a few lines and columns: columns of less use go first, then
//! the GPUs' history lines, then the queue.

use gpufrac_common::status::{GpuStatus, ProcStatus, Status};
use ratatui::Frame;
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::{Modifier, Style, Stylize};
use ratatui::text::{Line, Span, Text};
use ratatui::widgets::{Block, Borders, Cell, Clear, Paragraph, Row as TableRow, Table, Wrap};

use super::app::{App, Detail, Pane, Popup};
use super::model::{Model, Row, Unit, job_label};
use crate::names;
use crate::status::{clean, command, percent, seconds};

const SPARKS: [char; 8] = ['▁', '▂', '▃', '▄', '▅', '▆', '▇', '█'];

/// The whole frame.
pub fn draw(f: &mut Frame, model: &Model, app: &mut App) {
    let area = f.area();
    let st = &model.status;
    let queue = model.queue_rows(&app.opts);
    // What each part takes, as the height allows: the header and the keys
    // a line each, GPUs two lines each (one when short of room), the queue
    // its requests, the processes the rest.
    let h = area.height;
    let gpu_lines: u16 = if h >= 16 { 2 } else { 1 };
    let gpus_h = if h >= 8 {
        (st.gpus.len().max(1) as u16 * gpu_lines).min((h / 3).max(1))
    } else {
        0
    };
    let queue_h = if h < 10 {
        0
    } else if queue.is_empty() {
        1
    } else {
        (2 * queue.len() as u16 + 2).min((h / 4).max(4))
    };
    let [header, gpus, procs, queue_area, keys] = Layout::vertical([
        Constraint::Length(1.min(h)),
        Constraint::Length(gpus_h),
        Constraint::Min(0),
        Constraint::Length(queue_h),
        Constraint::Length(u16::from(h >= 3)),
    ])
    .areas(area);
    // The broker stopped answering: the last frame stays, dimmed, with
    // its age, so that nobody reads it as now.
    let stale = app
        .message
        .as_deref()
        .is_some_and(|m| m.starts_with("broker: "))
        .then(|| model.received.map(|t| t.elapsed()))
        .flatten();
    f.render_widget(Paragraph::new(header_line(st, app, stale)), header);
    if gpus.height > 0 {
        draw_gpus(f, gpus, model, app, gpu_lines);
    }
    draw_procs(f, procs, model, app);
    if queue_area.height > 0 {
        draw_queue(f, queue_area, model, app, &queue);
    }
    if stale.is_some() {
        let body = Rect {
            y: area.y + header.height,
            height: area.height.saturating_sub(header.height + keys.height),
            ..area
        };
        f.buffer_mut()
            .set_style(body, Style::new().add_modifier(Modifier::DIM));
    }
    if keys.height > 0 {
        f.render_widget(Paragraph::new(keys_line(app)), keys);
    }
    match app.popup.clone() {
        Some(Popup::Help) => draw_popup(f, area, "Keys", help_text()),
        Some(Popup::Detail(d)) => {
            let (title, lines) = detail(model, &d, area.width.saturating_sub(4).into());
            draw_popup(f, area, &title, lines);
        }
        Some(Popup::Filter(_)) | None => {}
    }
}

/// Broker, mode, and how much of everything there is; how old the frame
/// is once the broker stopped answering.
fn header_line(st: &Status, app: &App, stale: Option<std::time::Duration>) -> Line<'static> {
    let mode = if st.gpus.iter().any(|g| g.mode.starts_with("mig")) {
        "MIG"
    } else if st.gpus.iter().any(|g| g.mode == "mps") {
        "MPS"
    } else {
        "plain"
    };
    let physical = st.gpus.iter().filter(|g| g.mig_instance.is_none()).count();
    let procs: usize = st.gpus.iter().map(|g| g.processes.len()).sum();
    let mut spans = vec![
        Span::styled("gpufrac top", Style::new().bold()),
        Span::raw(format!(
            "  broker {}  mode {mode}  {}  {}  queue {}  {}",
            if st.version.is_empty() {
                "-"
            } else {
                &st.version
            },
            plural(physical, "GPU", "GPUs"),
            plural(procs, "process", "processes"),
            st.queue.len(),
            plural(st.leases.len(), "lease", "leases"),
        )),
    ];
    if let Some(age) = stale {
        spans.push(Span::styled(
            format!("  STALE {} old", seconds(age.as_secs_f64().floor())),
            Style::new().red().bold(),
        ));
    }
    if st.recovery.is_some() {
        spans.push(Span::styled("  RECOVERING", Style::new().red().bold()));
    }
    if app.frozen {
        spans.push(Span::styled("  FROZEN", Style::new().reversed()));
    }
    if app.opts.mine {
        spans.push(Span::styled(
            format!("  only {}", names::user(app.opts.me)),
            Style::new().yellow(),
        ));
    }
    if !app.opts.filter.is_empty() {
        spans.push(Span::styled(
            format!("  filter: {}", app.opts.filter.text()),
            Style::new().yellow(),
        ));
    }
    spans.push(Span::raw(format!("  {}", st.socket)).dim());
    Line::from(spans)
}

fn plural(n: usize, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
}

/// A strip per GPU: memory (allocated, committed with each lease's cap
/// marked, free), then utilisation with its history.
fn draw_gpus(f: &mut Frame, area: Rect, model: &Model, app: &mut App, per_gpu: u16) {
    let st = &model.status;
    let width = usize::from(area.width);
    let mut lines = Vec::new();
    let rows_fit = usize::from(area.height / per_gpu).max(1);
    let first = match app.selected(st.gpus.len(), Pane::Gpus) {
        Some(sel) if app.pane == Pane::Gpus => sel.saturating_sub(rows_fit - 1),
        _ => 0,
    };
    if st.gpus.is_empty() {
        lines.push(Line::from("no GPUs").dim());
    }
    for (i, g) in st.gpus.iter().enumerate().skip(first).take(rows_fit) {
        let focused = app.pane == Pane::Gpus && app.selected(st.gpus.len(), Pane::Gpus) == Some(i);
        let mut l1 = gpu_memory_line(st, g, width);
        if focused {
            l1 = l1.reversed();
        }
        lines.push(l1);
        if per_gpu > 1 {
            lines.push(gpu_util_line(model, g, width));
        }
    }
    let hidden = st.gpus.len().saturating_sub(first + rows_fit);
    if hidden > 0
        && let Some(last) = lines.last_mut()
    {
        *last = Line::from(format!(
            "… {} more (Tab to the GPUs, then ↓)",
            plural(hidden, "GPU", "GPUs")
        ))
        .dim();
    }
    f.render_widget(Paragraph::new(lines), area);
}

fn gpu_name(g: &GpuStatus) -> String {
    match (g.mig_instance, g.index) {
        (Some(_), _) => g.name.clone(),
        (None, Some(i)) => format!("GPU {i} {}", g.name),
        (None, None) => format!("GPU ? {}", g.name),
    }
}

fn gpu_memory_line(st: &Status, g: &GpuStatus, width: usize) -> Line<'static> {
    let name = gpu_name(g);
    if let Some(m) = &g.mig {
        let in_use = m.instances.iter().filter(|i| i.state == "in-use").count();
        return Line::from(format!(
            "{name}  MIG: {} instances, {in_use} in use, committed {}/{}",
            m.instances.len(),
            short_size(g.committed_mem),
            short_size(g.total_mem)
        ));
    }
    let allocated: u64 = g.processes.iter().map(|p| p.mem_used).sum();
    let other = if g.unmanaged_mem > 0 {
        format!(" other {}", short_size(g.unmanaged_mem))
    } else {
        String::new()
    };
    let text = format!(
        " alloc {} commit {}{other} free {} of {}",
        short_size(allocated),
        short_size(g.committed_mem),
        short_size(g.free_mem),
        short_size(g.total_mem)
    );
    let name = truncate(&name, 24.min(width / 3).max(5));
    // The bar takes what the name and figures leave, if that is enough to
    // show anything.
    let room = width.saturating_sub(name.chars().count() + text.chars().count() + 3);
    let mut spans = vec![Span::styled(name, Style::new().bold())];
    if room >= 8 {
        spans.push(Span::raw(" ["));
        spans.extend(memory_bar(st, g, allocated, room.min(60)));
        spans.push(Span::raw("]"));
    }
    spans.push(Span::raw(text));
    Line::from(spans)
}

/// `width` cells of a GPU's memory: allocated `█`, committed beyond it
/// `▒`, held by processes outside the shim `▓`, free `·`, and `┃` where
/// each lease's cap ends within the committed part.
fn memory_bar(st: &Status, g: &GpuStatus, allocated: u64, width: usize) -> Vec<Span<'static>> {
    let total = g.total_mem.max(1) as f64;
    let cell = |b: u64| ((b as f64 / total) * width as f64).round() as usize;
    let alloc = cell(allocated).min(width);
    let committed = cell(g.committed_mem).min(width);
    let other = cell(
        g.committed_mem
            .max(allocated)
            .saturating_add(g.unmanaged_mem),
    )
    .min(width);
    let mut marks = Vec::new();
    let mut sum = 0u64;
    if let Some(index) = g.index.filter(|_| g.mig_instance.is_none()) {
        let mut caps: Vec<(u32, u64)> = st
            .leases
            .iter()
            .filter(|l| l.gpus.contains(&index))
            .filter_map(|l| l.mem_cap.map(|c| (l.pid, c)))
            .collect();
        caps.sort_unstable();
        for (_, c) in caps {
            sum = sum.saturating_add(c);
            let at = cell(sum);
            if at > 0 && at <= width {
                marks.push(at - 1);
            }
        }
    }
    let mut spans = Vec::new();
    let mut run = String::new();
    let mut style = Style::new();
    for i in 0..width {
        let (ch, s) = if marks.contains(&i) {
            ('┃', Style::new().yellow())
        } else if i < alloc {
            ('█', Style::new().green())
        } else if i < committed {
            ('▒', Style::new().cyan())
        } else if i < other {
            ('▓', Style::new().magenta())
        } else {
            ('·', Style::new().dim())
        };
        if s != style && !run.is_empty() {
            spans.push(Span::styled(std::mem::take(&mut run), style));
        }
        style = s;
        run.push(ch);
    }
    if !run.is_empty() {
        spans.push(Span::styled(run, style));
    }
    spans
}

fn gpu_util_line(model: &Model, g: &GpuStatus, width: usize) -> Line<'static> {
    if let Some(m) = &g.mig {
        let parts: Vec<String> = m
            .instances
            .iter()
            .map(|i| match i.job {
                Some(j) => format!("{} {} (job {j})", i.profile, i.state),
                None => format!("{} {}", i.profile, i.state),
            })
            .collect();
        return Line::from(truncate(
            &format!("  instances: {}", parts.join(", ")),
            width,
        ))
        .dim();
    }
    let util = g.utilization.map_or("-".to_owned(), |u| format!("{u}%"));
    let holder = g
        .holder
        .map_or_else(|| "nobody holds it".to_owned(), |p| format!("held by {p}"));
    let head = format!("  util {util:>4} ");
    let tail = format!(
        " {} {holder}",
        plural(g.processes.len(), "process", "processes")
    );
    let (health, alarm) = health_text(g);
    let room = width.saturating_sub(
        head.chars().count()
            + tail.chars().count()
            + health.chars().count()
            + alarm.chars().count(),
    );
    let history: Vec<Option<f32>> = model
        .gpu_history(&g.uuid)
        .map(|h| {
            h.utilization
                .iter()
                .map(|u| u.map(|u| u as f32 / 100.0))
                .collect()
        })
        .unwrap_or_default();
    Line::from(vec![
        Span::raw(head),
        Span::styled(spark(&history, room.min(60), 1.0), Style::new().cyan()),
        Span::raw(tail).dim(),
        Span::raw(health).dim(),
        Span::styled(alarm, Style::new().red().bold()),
    ])
}

/// A GPU's health in a few words (temperature, power against its limit,
/// SM clock), and what is wrong with it (ECC errors the GPU could not
/// correct, XID events), red.
fn health_text(g: &GpuStatus) -> (String, String) {
    let Some(h) = g.health else {
        return (String::new(), String::new());
    };
    let mut parts = Vec::new();
    if let Some(t) = h.temperature_c {
        parts.push(format!("{t}°C"));
    }
    match (h.power_w, h.power_limit_w) {
        (Some(p), Some(l)) => parts.push(format!("{p:.0}/{l:.0}W")),
        (Some(p), None) => parts.push(format!("{p:.0}W")),
        _ => {}
    }
    if let Some(c) = h.sm_clock_mhz {
        parts.push(format!("{c}MHz"));
    }
    let mut alarm = Vec::new();
    if let Some(n) = h.ecc_uncorrected.filter(|&n| n > 0) {
        alarm.push(format!("ECC {n}"));
    }
    if h.xid_errors > 0 {
        alarm.push(format!(
            "XID {}×{}",
            h.last_xid.map_or("?".into(), |x| x.to_string()),
            h.xid_errors
        ));
    }
    let text = |v: Vec<String>| {
        if v.is_empty() {
            String::new()
        } else {
            format!("  {}", v.join(" "))
        }
    };
    (text(parts), text(alarm))
}

/// A column of the process pane: its heading, width and how much it is
/// worth (lower first) when the width does not hold them all.
#[derive(Clone, Copy)]
struct Col {
    title: &'static str,
    width: u16,
    rank: u8,
}

const fn col(title: &'static str, width: u16, rank: u8) -> Col {
    Col { title, width, rank }
}

/// The flat table's columns; the last (the command) takes what is left.
/// CLASS goes after JOB and before CONTAINER when the width is short: it
/// says how a process is scheduled, a container only where it runs.
const FLAT: [Col; 14] = [
    col("PID", 7, 0),
    col("USER", 8, 1),
    col("JOB", 8, 5),
    col("CONTAINER", 12, 8),
    col("GPU", 3, 9),
    col("CLASS", 6, 4),
    col("USED/CAP", 11, 2),
    col("PEAK", 6, 10),
    col("REF", 4, 11),
    col("SHARE", 9, 3),
    col("ASKED", 9, 7),
    col("HISTORY", 10, 12),
    col("STATE", 8, 6),
    col("COMMAND", 8, 0),
];

/// The tree's columns; the first (users, jobs, processes) takes what is
/// left.
const TREE: [Col; 10] = [
    col("USER / JOB / PROCESS", 30, 0),
    col("CLASS", 6, 4),
    col("USED/CAP", 11, 1),
    col("PEAK", 6, 6),
    col("REF", 4, 7),
    col("SHARE", 9, 0),
    col("ASKED", 9, 3),
    col("HISTORY", 10, 5),
    col("STATE", 8, 2),
    col("GPU TIME", 8, 8),
];

/// Which of `cols` fit in `width`, in their order, with the width of the
/// one that takes the rest (`fill`).
fn fit(cols: &[Col], fill: usize, width: u16) -> (Vec<usize>, u16) {
    let mut by_rank: Vec<usize> = (0..cols.len()).filter(|&i| i != fill).collect();
    by_rank.sort_by_key(|&i| (cols[i].rank, i));
    let mut used = cols[fill].width;
    let mut shown = vec![fill];
    for i in by_rank {
        let w = cols[i].width + 1;
        if used + w <= width {
            used += w;
            shown.push(i);
        }
    }
    shown.sort_unstable();
    (shown, cols[fill].width + (width - used.min(width)))
}

fn draw_procs(f: &mut Frame, area: Rect, model: &Model, app: &mut App) {
    if area.height == 0 {
        return;
    }
    let rows = model.rows(&app.opts);
    let st = &model.status;
    let several = st.gpus.iter().filter(|g| !g.processes.is_empty()).count() > 1;
    // One GPU: its column says nothing; nor does a column of containers
    // none of the processes has.
    let contained = st
        .gpus
        .iter()
        .flat_map(|g| &g.processes)
        .any(|p| model.container(p).is_some());
    let owned: Vec<Col> = if app.opts.tree { &TREE[..] } else { &FLAT[..] }
        .iter()
        .copied()
        .filter(|c| several || c.title != "GPU")
        .filter(|c| contained || c.title != "CONTAINER")
        .collect();
    let fill = if app.opts.tree { 0 } else { owned.len() - 1 };
    let (shown, fill_w) = fit(&owned, fill, area.width);
    let widths: Vec<Constraint> = shown
        .iter()
        .map(|&i| Constraint::Length(if i == fill { fill_w } else { owned[i].width }))
        .collect();
    let header = TableRow::new(shown.iter().map(|&i| {
        let mut t = owned[i].title.to_owned();
        if sort_column(app) == owned[i].title {
            t.push(if app.opts.reverse { '▲' } else { '▼' });
        }
        Cell::from(t)
    }))
    .style(Style::new().bold().reversed());
    let body: Vec<TableRow> = rows
        .iter()
        .map(|r| {
            let cells = cells(model, r, app.opts.tree);
            TableRow::new(shown.iter().map(|&i| {
                let (text, style) = cells
                    .iter()
                    .find(|(t, _, _)| *t == owned[i].title)
                    .map(|(_, s, st)| (s.clone(), *st))
                    .unwrap_or_default();
                let w = if i == fill { fill_w } else { owned[i].width };
                Cell::from(Span::styled(truncate(&text, w.into()), style))
            }))
        })
        .collect();
    let title = format!(
        " {} ({}) ",
        if app.opts.tree {
            "Shares: users → jobs → processes"
        } else {
            "Processes"
        },
        rows.iter()
            .filter(|r| matches!(r, Row::Proc { .. } | Row::Other { .. }))
            .count()
    );
    if rows.is_empty() {
        let why = if model.samples == 0 {
            "waiting for the broker…"
        } else if app.opts.filter.is_empty() && !app.opts.mine {
            "no processes under the shim"
        } else {
            "no process matches the filter"
        };
        let lines = vec![
            Line::from(title).bold(),
            Line::from(format!(" {why}")).dim(),
        ];
        f.render_widget(Paragraph::new(lines), area);
        return;
    }
    let focused = app.pane == Pane::Procs;
    // Short of room, the column headings are title enough.
    let block = if area.height >= 6 {
        Block::new().title(Line::from(title).bold())
    } else {
        Block::new()
    };
    let table = Table::new(body, widths)
        .header(header)
        .column_spacing(1)
        .block(block.borders(Borders::NONE))
        .row_highlight_style(if focused {
            Style::new().add_modifier(Modifier::REVERSED)
        } else {
            Style::new()
        });
    let sel = app.selected(rows.len(), Pane::Procs);
    app.procs.select(sel);
    // Rows past the bottom (or above the top, once scrolled) are said in
    // a last line of their own, so that a cut tree never reads as whole.
    let chrome = 1 + u16::from(area.height >= 6);
    let fits = usize::from(area.height.saturating_sub(chrome));
    if rows.len() > fits && area.height > chrome + 1 {
        let [table_area, mark] =
            Layout::vertical([Constraint::Min(0), Constraint::Length(1)]).areas(area);
        f.render_stateful_widget(table, table_area, &mut app.procs);
        let shown = usize::from(table_area.height.saturating_sub(chrome));
        let above = app.procs.offset();
        let below = rows.len().saturating_sub(above + shown);
        let mut parts = Vec::new();
        if above > 0 {
            parts.push(format!("{above} above"));
        }
        if below > 0 {
            parts.push(format!("{below} more below"));
        }
        let text = format!("… {} (Tab to this pane, then ↑↓)", parts.join(", "));
        f.render_widget(Paragraph::new(Line::from(text).dim()), mark);
    } else {
        f.render_stateful_widget(table, area, &mut app.procs);
    }
}

fn sort_column(app: &App) -> &'static str {
    use super::model::Sort;
    match (app.opts.sort, app.opts.tree) {
        (Sort::Pid, false) => "PID",
        (Sort::User, false) => "USER",
        (Sort::Memory, _) => "USED/CAP",
        (Sort::Peak, _) => "PEAK",
        (Sort::Share, _) => "SHARE",
        (Sort::State, _) => "STATE",
        _ => "USER / JOB / PROCESS",
    }
}

type Cells = Vec<(&'static str, String, Style)>;

/// A user's or a job's share, its history and its GPU time: the cells
/// after its memory (`!` where it got less than it was owed, `high` in
/// place of a target where it is above the shares).
fn share_cells(
    (target, now): (f64, f64),
    achieved: &[Option<f32>],
    gpu_time_s: f64,
    (is_off, high): (bool, bool),
    off: Style,
) -> [(&'static str, String, Style); 3] {
    [
        (
            "SHARE",
            share_text(target, now, is_off, high),
            if is_off { off } else { Style::new() },
        ),
        ("HISTORY", spark(achieved, 10, 1.0), Style::new().cyan()),
        (
            "GPU TIME",
            crate::status::gpu_seconds(gpu_time_s),
            Style::new(),
        ),
    ]
}

/// The cells of one row of the process pane, by column heading.
fn cells(model: &Model, row: &Row, tree: bool) -> Cells {
    let st = &model.status;
    let off = Style::new().red().bold();
    match *row {
        Row::Gpu { gpu } => {
            let g = &st.gpus[gpu];
            vec![(TREE[0].title, gpu_name(g), Style::new().bold().underlined())]
        }
        Row::User { gpu, user } => {
            let g = &st.gpus[gpu];
            let u = &g.users[user];
            let hist = model.share_history(&g.uuid, u.uid, None);
            let achieved = hist.map(|h| h.achieved.clone()).unwrap_or_default();
            let members: Vec<&ProcStatus> = g
                .processes
                .iter()
                .filter(|p| model.unit_of(g, p).is_some_and(|(ui, _)| ui == user))
                .collect();
            let used: u64 = members.iter().map(|p| p.mem_used).sum();
            let unit = Unit::Share {
                gpu: g.uuid.clone(),
                uid: u.uid,
                job: None,
            };
            vec![
                (
                    TREE[0].title,
                    format!("▾ {}", names::user(u.uid)),
                    Style::new().bold(),
                ),
                ("USED/CAP", short_size(used), Style::new()),
                refusals(&members),
                (
                    "ASKED",
                    format!("w{}", crate::status::weight(u.weight)),
                    Style::new().dim(),
                ),
            ]
            .into_iter()
            .chain(share_cells(
                (u.share_target, u.share_achieved),
                &achieved,
                u.gpu_time_s,
                (model.short(&unit), all_high(&members)),
                off,
            ))
            .collect()
        }
        Row::Job { gpu, user, job } => {
            let g = &st.gpus[gpu];
            let u = &g.users[user];
            let j = &u.jobs[job];
            let hist = model.share_history(&g.uuid, u.uid, Some(j.job));
            let achieved = hist.map(|h| h.achieved.clone()).unwrap_or_default();
            let members: Vec<&ProcStatus> = g
                .processes
                .iter()
                .filter(|p| model.unit_of(g, p) == Some((user, job)))
                .collect();
            let used: u64 = members.iter().map(|p| p.mem_used).sum();
            let lease = j
                .job
                .and_then(|pid| st.leases.iter().find(|l| l.pid == pid && l.pod == j.pod));
            let cap = lease.and_then(|l| l.mem_cap);
            let asked = asked_text(
                lease.and_then(|l| l.compute),
                j.weight,
                lease.and_then(|l| l.limit),
            );
            let unit = Unit::Share {
                gpu: g.uuid.clone(),
                uid: u.uid,
                job: Some(j.job),
            };
            let mut name = match job_label(j.job, &j.pod) {
                Some(l) if j.pod.is_some() => format!("  ▾ {l}"),
                Some(l) => format!("  ▾ job {l}"),
                None => "  ▾ no job".to_owned(),
            };
            // A job's container is its processes', when they agree.
            let mut containers: Vec<Option<String>> =
                members.iter().map(|p| model.container(p)).collect();
            containers.dedup();
            if let [Some(c)] = containers.as_slice()
                && j.pod.is_none()
            {
                name.push_str(&format!(" [{c}]"));
            }
            vec![
                (TREE[0].title, name, Style::new().bold()),
                ("USED/CAP", used_cap(used, cap), Style::new()),
                refusals(&members),
                ("ASKED", asked, Style::new().dim()),
            ]
            .into_iter()
            .chain(share_cells(
                (j.share_target, j.share_achieved),
                &achieved,
                j.gpu_time_s,
                (model.short(&unit), all_high(&members)),
                off,
            ))
            .collect()
        }
        Row::Other { gpu, other } => {
            let g = &st.gpus[gpu];
            let o = &g.unmanaged[other];
            let dim = Style::new().magenta();
            let mut out: Cells = vec![
                ("PID", o.pid.to_string(), Style::new()),
                ("USER", "-".into(), Style::new()),
                ("JOB", "-".into(), Style::new()),
                ("CONTAINER", "-".into(), Style::new()),
                (
                    "GPU",
                    g.index.map_or("?".into(), |i| i.to_string()),
                    Style::new(),
                ),
                ("USED/CAP", used_cap(o.mem, None), Style::new()),
                ("STATE", "other".into(), dim),
                ("COMMAND", OTHER.into(), dim),
            ];
            if tree {
                out.push((TREE[0].title, format!("{} {OTHER}", o.pid), dim));
            }
            out
        }
        Row::Proc { gpu, proc, depth } => {
            let g = &st.gpus[gpu];
            let p = &g.processes[proc];
            let achieved: Vec<Option<f32>> = model
                .proc_history(&g.uuid, p.pid)
                .map(|h| h.achieved.iter().copied().collect())
                .unwrap_or_default();
            let is_off = model.short(&Unit::Proc {
                gpu: g.uuid.clone(),
                pid: p.pid,
            });
            let high = p.priority == "high";
            let container = model.container(p);
            let state = if p.draining {
                format!("{}*", p.state)
            } else {
                p.state.clone()
            };
            let state_style = match p.state.as_str() {
                "holding" => Style::new().green(),
                "waiting" => Style::new().yellow(),
                "hung" | "revoking" => Style::new().red(),
                _ => Style::new().dim(),
            };
            let mut out: Cells = vec![
                ("PID", p.pid.to_string(), Style::new()),
                ("USER", names::user(p.uid), Style::new()),
                (
                    "JOB",
                    job_label(p.job, &p.pod).unwrap_or_else(|| "-".into()),
                    Style::new(),
                ),
                (
                    "CONTAINER",
                    container.clone().unwrap_or_else(|| "-".into()),
                    Style::new(),
                ),
                (
                    "GPU",
                    g.index.map_or("?".into(), |i| i.to_string()),
                    Style::new(),
                ),
                (
                    "CLASS",
                    p.priority.clone(),
                    if p.priority == "high" {
                        Style::new().magenta()
                    } else {
                        Style::new()
                    },
                ),
                ("USED/CAP", used_cap(p.mem_used, p.mem_cap), Style::new()),
                ("PEAK", short_size(p.mem_peak), Style::new()),
                (
                    "REF",
                    p.ooms.to_string(),
                    if p.ooms > 0 {
                        Style::new().red()
                    } else {
                        Style::new()
                    },
                ),
                (
                    "SHARE",
                    // Under MPS: the SMs it may use, side by side.
                    match p.sm_percent {
                        Some(sm) => format!("{sm:.0}% SMs"),
                        None => share_text(p.share_target, p.share_achieved, is_off, high),
                    },
                    if is_off { off } else { Style::new() },
                ),
                (
                    "ASKED",
                    match (high, p.limit) {
                        (true, _) => "high".into(),
                        (false, Some(l)) => format!("≤{}", percent(l)),
                        (false, None) => "-".into(),
                    },
                    Style::new().dim(),
                ),
                ("HISTORY", spark(&achieved, 10, 1.0), Style::new().cyan()),
                ("STATE", state, state_style),
                (
                    "GPU TIME",
                    crate::status::gpu_seconds(p.gpu_time_s),
                    Style::new(),
                ),
                ("COMMAND", command(&p.command), Style::new()),
            ];
            if tree {
                let mut name = format!(
                    "{}{} {}",
                    " ".repeat(usize::from(depth) * 2),
                    p.pid,
                    command(&p.command)
                );
                // Beside a job that names its container, the process need
                // not say it again.
                if let Some(c) = container.filter(|_| p.job.is_none() || depth == 0) {
                    name.push_str(&format!(" [{c}]"));
                }
                out.push((TREE[0].title, name, Style::new()));
            }
            out
        }
    }
}

/// What a process outside the shim is, in its row.
const OTHER: &str = "other: not under the shim (driver's figure)";

/// A user's or job's refusals: its processes' together.
fn refusals(members: &[&ProcStatus]) -> (&'static str, String, Style) {
    let n: u64 = members.iter().map(|p| p.ooms).sum();
    (
        "REF",
        n.to_string(),
        if n > 0 {
            Style::new().red()
        } else {
            Style::new()
        },
    )
}

/// Whether every process of a unit is `high`: the unit is above the
/// shares, and its target is no share of them.
fn all_high(members: &[&ProcStatus]) -> bool {
    !members.is_empty() && members.iter().all(|p| p.priority == "high")
}

/// What a job asked: its `--gpu-compute` (else the weight of its
/// processes, `w50`) and its `--gpu-limit`.
fn asked_text(compute: Option<f64>, weight: f64, limit: Option<f64>) -> String {
    let share = match compute {
        Some(c) => format!("{c:.0}%"),
        None => format!("w{}", crate::status::weight(weight)),
    };
    match limit {
        Some(l) => format!("{share} ≤{}", percent(l)),
        None => share,
    }
}

/// "30/28%": the share it should get against the share it got; `!` when
/// it got less than it was owed; "high/13%" for what is above the shares.
fn share_text(target: f64, achieved: f64, off: bool, high: bool) -> String {
    let pct = |f: f64| {
        if f.is_finite() {
            format!("{:.0}", (f * 100.0).clamp(0.0, 999.0))
        } else {
            "-".into()
        }
    };
    format!(
        "{}/{}%{}",
        if high { "high".to_owned() } else { pct(target) },
        pct(achieved),
        if off { "!" } else { "" }
    )
}

fn used_cap(used: u64, cap: Option<u64>) -> String {
    match cap {
        Some(c) => format!("{}/{}", short_size(used), short_size(c)),
        None => format!("{}/-", short_size(used)),
    }
}

fn draw_queue(f: &mut Frame, area: Rect, model: &Model, app: &mut App, rows: &[usize]) {
    let st = &model.status;
    if rows.is_empty() {
        let text = if st.queue.is_empty() {
            "queue: empty".to_owned()
        } else {
            format!("queue: {} waiting, none matching", st.queue.len())
        };
        f.render_widget(Paragraph::new(Line::from(text).dim()), area);
        return;
    }
    const FIXED: [u16; 5] = [3, 8, 8, 6, 6];
    let mut widths: Vec<Constraint> = FIXED.iter().map(|&w| Constraint::Length(w)).collect();
    widths.push(Constraint::Fill(1));
    let why_w = usize::from(area.width.saturating_sub(FIXED.iter().sum::<u16>() + 5)).max(10);
    // Why a request waits is what matters most here: two lines of it when
    // one is not enough and the pane has room for them.
    let tall = usize::from(area.height.saturating_sub(2)) >= 2 * rows.len().min(2);
    let body: Vec<TableRow> = rows
        .iter()
        .map(|&i| {
            let e = &st.queue[i];
            let mut why = wrap(&clean(&e.why), why_w, if tall { 2 } else { 1 });
            let height = why.len().max(1) as u16;
            let why = Text::from(why.drain(..).map(Line::from).collect::<Vec<_>>());
            TableRow::new(vec![
                Cell::from(e.position.to_string()),
                Cell::from(truncate(&names::user(e.uid), 8)),
                Cell::from(truncate(
                    &job_label(Some(e.pid), &e.pod).unwrap_or_default(),
                    8,
                )),
                Cell::from(wants(e)),
                Cell::from(Span::styled(
                    seconds(e.waiting_s),
                    if e.escalated {
                        Style::new().red()
                    } else {
                        Style::new()
                    },
                )),
                Cell::from(why),
            ])
            .height(height)
        })
        .collect();
    let header = TableRow::new(["POS", "USER", "JOB", "WANTS", "WAITED", "WHY IT WAITS"])
        .style(Style::new().bold().reversed());
    let focused = app.pane == Pane::Queue;
    let table = Table::new(body, widths)
        .header(header)
        .column_spacing(1)
        .block(Block::new().title(Line::from(format!(" Queue ({}) ", rows.len())).bold()))
        .row_highlight_style(if focused {
            Style::new().add_modifier(Modifier::REVERSED)
        } else {
            Style::new()
        });
    let sel = app.selected(rows.len(), Pane::Queue);
    app.queue.select(sel);
    f.render_stateful_widget(table, area, &mut app.queue);
}

/// What a request wants, short: `2 GPUs`, `8G`.
fn wants(e: &gpufrac_common::status::QueueEntry) -> String {
    match (e.want_gpus, e.want_mem) {
        (Some(n), _) => plural(n as usize, "GPU", "GPUs"),
        (None, Some(b)) => short_size(b),
        (None, None) => truncate(&e.wants, 6),
    }
}

/// `text` in at most `lines` lines of `width`, broken at spaces; the last
/// ends in an ellipsis if there was more.
fn wrap(text: &str, width: usize, lines: usize) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    let mut line = String::new();
    let words: Vec<&str> = text.split(' ').filter(|w| !w.is_empty()).collect();
    for (i, word) in words.iter().enumerate() {
        let len = line.chars().count();
        if len > 0 && len + 1 + word.chars().count() > width {
            if out.len() + 1 == lines {
                line.push(' ');
                line.push_str(&words[i..].join(" "));
                break;
            }
            out.push(std::mem::take(&mut line));
        }
        if !line.is_empty() {
            line.push(' ');
        }
        line.push_str(word);
    }
    if !line.is_empty() {
        out.push(truncate(&line, width));
    }
    out
}

/// The last line: the keys, or the filter being typed, or a message.
fn keys_line(app: &App) -> Line<'static> {
    if let Some(Popup::Filter(text)) = &app.popup {
        let mut spans = vec![
            Span::styled("filter: ", Style::new().bold()),
            Span::raw(format!("{text}█")),
            Span::raw("  user:NAME job:PID gpu:N class:high|normal|low or words; Enter applies, Esc cancels").dim(),
        ];
        if let Some(m) = &app.message {
            spans.insert(0, Span::styled(format!("{m}  "), Style::new().red()));
        }
        return Line::from(spans);
    }
    if let Some(m) = &app.message {
        return Line::from(Span::styled(m.clone(), Style::new().red()));
    }
    let pane = match app.pane {
        Pane::Procs => "processes",
        Pane::Queue => "queue",
        Pane::Gpus => "GPUs",
    };
    let key = |k: &'static str| Span::styled(k, Style::new().bold());
    Line::from(vec![
        key("q"),
        Span::raw(" quit "),
        key("?"),
        Span::raw(" help "),
        key("Tab"),
        Span::raw(format!(" {pane} ")),
        key("↵"),
        Span::raw(" detail "),
        key("t"),
        Span::raw(if app.opts.tree { " flat " } else { " tree " }),
        key("s"),
        Span::raw(format!(" {} ", app.opts.sort.name())),
        key("/"),
        Span::raw(" filter "),
        key("f"),
        Span::raw(if app.frozen { " thaw " } else { " freeze " }),
        key("u"),
        Span::raw(if app.opts.mine { " all" } else { " mine" }),
    ])
}

fn help_text() -> Vec<Line<'static>> {
    let keys = [
        ("q, Esc", "quit (Esc first closes what is open)"),
        ("?", "this help"),
        ("↑ ↓, j k", "move in the pane; PgUp PgDn, g G: further"),
        ("Tab", "next pane: processes, queue, GPUs (Shift-Tab back)"),
        (
            "Enter",
            "detail of the selected process, job, user, request or GPU, with its history",
        ),
        ("t", "tree (users → jobs → processes) or flat table"),
        (
            "s / S",
            "sort by pid, user, mem, peak, share, state / reverse",
        ),
        (
            "/",
            "filter: user:NAME job:PID gpu:N class:high|normal|low, or words",
        ),
        ("f", "freeze the view (top keeps sampling)"),
        ("u", "only your processes and requests"),
    ];
    let mut lines: Vec<Line> = keys
        .iter()
        .map(|(k, what)| {
            Line::from(vec![
                Span::styled(format!("{k:<10}"), Style::new().bold()),
                Span::raw(*what),
            ])
        })
        .collect();
    lines.push(Line::from(""));
    lines.push(Line::from("SHARE is target/achieved: the share of GPU time due while busy and contended, against the share held over the last second; ! marks one off its target over the last 10 s. USED/CAP is memory allocated through the shim against the cap; HISTORY the achieved share, a value a second. Memory bars: █ allocated, ▒ committed to leases, ┃ where each lease's cap ends, · free.").dim());
    lines
}

/// The title and lines of a detail.
fn detail(model: &Model, d: &Detail, width: usize) -> (String, Vec<Line<'static>>) {
    let st = &model.status;
    let spark_w = width.saturating_sub(14).clamp(10, 120);
    let series = |label: &str, values: &[Option<f32>], max: f32| -> Line<'static> {
        Line::from(vec![
            Span::styled(format!("{label:<12} "), Style::new().bold()),
            Span::styled(spark(values, spark_w, max), Style::new().cyan()),
        ])
    };
    let kv = |k: &str, v: String| -> Line<'static> {
        Line::from(vec![
            Span::styled(format!("{k:<12} "), Style::new().bold()),
            Span::raw(v),
        ])
    };
    match d {
        Detail::Proc { gpu, pid } => {
            let Some((g, p)) = st
                .gpus
                .iter()
                .find(|g| g.uuid == *gpu)
                .and_then(|g| g.processes.iter().find(|p| p.pid == *pid).map(|p| (g, p)))
            else {
                return (format!("process {pid}"), vec![Line::from("gone")]);
            };
            let h = model.proc_history(gpu, *pid);
            let achieved: Vec<Option<f32>> = h
                .map(|h| h.achieved.iter().copied().collect())
                .unwrap_or_default();
            let used: Vec<Option<f32>> = h
                .map(|h| h.used.iter().map(|u| u.map(|u| u as f32)).collect())
                .unwrap_or_default();
            let cap = p.mem_cap.unwrap_or(g.total_mem).max(1) as f32;
            let mut lines = vec![
                kv("command", clean(&p.command)),
                kv("user", format!("{} (uid {})", names::user(p.uid), p.uid)),
                kv(
                    "job",
                    job_label(p.job, &p.pod).map_or("- (none: its user is its unit)".into(), |j| {
                        match p.job_mem_used {
                            Some(m) => format!("{j}, its processes holding {} here", short_size(m)),
                            None => j,
                        }
                    }),
                ),
                kv(
                    "container",
                    model.container(p).unwrap_or_else(|| "-".into()),
                ),
                kv(
                    "GPU",
                    format!("{} (its CUDA device {})", gpu_name(g), p.ordinal),
                ),
                kv("class", p.priority.clone()),
                kv(
                    "state",
                    if p.draining {
                        format!("{} (draining)", p.state)
                    } else {
                        p.state.clone()
                    },
                ),
                kv(
                    "memory",
                    format!(
                        "{} used, cap {}, peak {}, driver {}",
                        short_size(p.mem_used),
                        p.mem_cap.map_or("-".into(), short_size),
                        short_size(p.mem_peak),
                        p.driver_mem.map_or("-".into(), short_size)
                    ),
                ),
                kv("refusals", p.ooms.to_string()),
                kv(
                    "share",
                    format!(
                        "target {}, achieved {}, limit {}",
                        percent(p.share_target),
                        percent(p.share_achieved),
                        p.limit.map_or("-".into(), percent)
                    ),
                ),
                kv("GPU time", crate::status::gpu_seconds(p.gpu_time_s)),
                Line::from(""),
                series("achieved", &achieved, 1.0),
                series("memory", &used, cap),
            ];
            if let Some((ui, ji)) = model.unit_of(g, p) {
                let u = &g.users[ui];
                if let Some(h) = model.share_history(gpu, u.uid, Some(u.jobs[ji].job)) {
                    lines.push(series("its job", &h.achieved, 1.0));
                }
                if let Some(h) = model.share_history(gpu, u.uid, None) {
                    lines.push(series("its user", &h.achieved, 1.0));
                }
            }
            lines.push(Line::from(format!(
                "a value a second: this process's since top opened ({}), its job's and user's from the broker's last {}",
                plural(achieved.len(), "sample", "samples"),
                seconds(st.history.as_ref().map_or(0.0, |h| f64::from(h.samples) * h.every_s))
            )).dim());
            (format!("process {pid}"), lines)
        }
        Detail::Share { gpu, uid, job } => {
            let h = model.share_history(gpu, *uid, *job);
            let name = match job {
                None => format!("user {}", names::user(*uid)),
                Some(Some(j)) => format!("job {j} of {}", names::user(*uid)),
                Some(None) => format!("{}'s processes outside any job", names::user(*uid)),
            };
            let mut lines = Vec::new();
            match h {
                Some(h) => {
                    lines.push(series("achieved", &h.achieved, 1.0));
                    lines.push(series("target", &h.target, 1.0));
                }
                None => lines.push(Line::from("no history yet")),
            }
            // Now, as the status has it: the same figures as its row.
            let unit = st.gpus.iter().find(|g| g.uuid == *gpu).and_then(|g| {
                let u = g.users.iter().find(|u| u.uid == *uid)?;
                Some(match job {
                    None => (u.share_target, u.share_achieved, u.entitled_s, u.gpu_time_s),
                    Some(j) => {
                        let j = u.jobs.iter().find(|x| x.job == *j)?;
                        (j.share_target, j.share_achieved, j.entitled_s, j.gpu_time_s)
                    }
                })
            });
            if let Some((target, achieved, owed, got)) = unit {
                lines.push(kv(
                    "now",
                    format!(
                        "target {}, achieved {} (target: its share among the shares while busy)",
                        percent(target),
                        percent(achieved)
                    ),
                ));
                lines.push(kv(
                    "so far",
                    format!(
                        "owed {} of GPU time, got {} (owed: its target while busy, net of high)",
                        crate::status::gpu_seconds(owed),
                        crate::status::gpu_seconds(got)
                    ),
                ));
            }
            (name, lines)
        }
        Detail::Queued { pid } => {
            let Some(e) = st.queue.iter().find(|e| e.pid == *pid) else {
                return (
                    format!("request of {pid}"),
                    vec![Line::from("no longer queued")],
                );
            };
            let lines = vec![
                kv("position", e.position.to_string()),
                kv("job", job_label(Some(e.pid), &e.pod).unwrap_or_default()),
                kv("user", names::user(e.uid)),
                kv("wants", e.wants.clone()),
                kv(
                    "waited",
                    format!(
                        "{}{}",
                        seconds(e.waiting_s),
                        if e.escalated {
                            " (escalated: placed before younger requests)"
                        } else {
                            ""
                        }
                    ),
                ),
                kv("command", clean(&e.command)),
                kv("why", clean(&e.why)),
            ];
            (format!("queued request of {pid}"), lines)
        }
        Detail::Gpu { uuid } => {
            let Some(g) = st.gpus.iter().find(|g| g.uuid == *uuid) else {
                return (uuid.clone(), vec![Line::from("gone")]);
            };
            let h = model.gpu_history(uuid);
            let util: Vec<Option<f32>> = h
                .map(|h| {
                    h.utilization
                        .iter()
                        .map(|u| u.map(|u| u as f32 / 100.0))
                        .collect()
                })
                .unwrap_or_default();
            let alloc: Vec<Option<f32>> = h
                .map(|h| h.allocated.iter().map(|u| u.map(|u| u as f32)).collect())
                .unwrap_or_default();
            let committed: Vec<Option<f32>> = h
                .map(|h| h.committed.iter().map(|u| u.map(|u| u as f32)).collect())
                .unwrap_or_default();
            let total = g.total_mem.max(1) as f32;
            let lines = vec![
                kv("UUID", g.uuid.clone()),
                kv("mode", g.mode.clone()),
                kv(
                    "memory",
                    format!(
                        "{} total, {} committed, slots {}/{}",
                        short_size(g.total_mem),
                        short_size(g.committed_mem),
                        g.slots_used,
                        g.slots_total
                    ),
                ),
                kv(
                    "free",
                    format!(
                        "{} for a new lease (total less committed less other)",
                        short_size(g.free_mem)
                    ),
                ),
                kv(
                    "driver",
                    g.driver.map_or("- (NVML not asked)".into(), |d| {
                        format!(
                            "{} used, {} free (NVML: every process, the shim's or not)",
                            short_size(d.used),
                            short_size(d.free)
                        )
                    }),
                ),
                kv(
                    "other",
                    if g.unmanaged_processes == 0 {
                        "none: every process on it is under the shim".into()
                    } else {
                        let pids: Vec<String> = g
                            .unmanaged
                            .iter()
                            .map(|o| format!("{} ({})", o.pid, short_size(o.mem)))
                            .collect();
                        format!(
                            "{} not under the shim hold {}: {}",
                            plural(g.unmanaged_processes as usize, "process", "processes"),
                            short_size(g.unmanaged_mem),
                            pids.join(", ")
                        )
                    },
                ),
                kv("holder", g.holder.map_or("-".into(), |p| p.to_string())),
                kv(
                    "health",
                    g.health.map_or("- (NVML not asked)".into(), |h| {
                        let opt = |v: Option<String>| v.unwrap_or_else(|| "-".into());
                        format!(
                            "{} °C, {} W of {} W, SM {} MHz, ECC {} corrected {} not, XIDs {} (last {})",
                            opt(h.temperature_c.map(|t| t.to_string())),
                            opt(h.power_w.map(|p| format!("{p:.0}"))),
                            opt(h.power_limit_w.map(|p| format!("{p:.0}"))),
                            opt(h.sm_clock_mhz.map(|c| c.to_string())),
                            opt(h.ecc_corrected.map(|n| n.to_string())),
                            opt(h.ecc_uncorrected.map(|n| n.to_string())),
                            h.xid_errors,
                            opt(h.last_xid.map(|x| x.to_string()))
                        )
                    }),
                ),
                Line::from(""),
                series("utilisation", &util, 1.0),
                series("allocated", &alloc, total),
                series("committed", &committed, total),
            ];
            (gpu_name(g), lines)
        }
    }
}

fn draw_popup(f: &mut Frame, area: Rect, title: &str, lines: Vec<Line<'static>>) {
    let w = area.width.saturating_sub(4).min(110);
    // Lines as wrapped inside the borders.
    let inner = usize::from(w.saturating_sub(2)).max(1);
    let wrapped: usize = lines.iter().map(|l| l.width().max(1).div_ceil(inner)).sum();
    let h = (wrapped as u16 + 2)
        .min(area.height.saturating_sub(2))
        .max(3.min(area.height));
    let [_, mid, _] = Layout::vertical([
        Constraint::Fill(1),
        Constraint::Length(h),
        Constraint::Fill(1),
    ])
    .areas(area);
    let [_, rect, _] = Layout::horizontal([
        Constraint::Fill(1),
        Constraint::Length(w),
        Constraint::Fill(1),
    ])
    .areas(mid);
    f.render_widget(Clear, rect);
    let block = Block::bordered().title(Line::from(format!(" {title} ")).bold());
    f.render_widget(
        Paragraph::new(lines)
            .block(block)
            .wrap(Wrap { trim: false }),
        rect,
    );
}

/// The last `width` of `values` as a sparkline: a value of `max` or more
/// is a full block, a gap a space.
pub fn spark(values: &[Option<f32>], width: usize, max: f32) -> String {
    let from = values.len().saturating_sub(width);
    values[from..]
        .iter()
        .map(|v| match v {
            None => ' ',
            Some(v) => {
                let f = if max > 0.0 {
                    (v / max).clamp(0.0, 1.0)
                } else {
                    0.0
                };
                SPARKS[((f * 7.0).round() as usize).min(7)]
            }
        })
        .collect()
}

/// Bytes in four or five characters: `512B`, `12K`, `3.5G`, `80G`, `1.2T`.
pub fn short_size(b: u64) -> String {
    const UNITS: [(u64, char); 4] = [
        (1 << 40, 'T'),
        (1 << 30, 'G'),
        (1 << 20, 'M'),
        (1 << 10, 'K'),
    ];
    for (size, unit) in UNITS {
        if b >= size {
            let v = b as f64 / size as f64;
            return if v < 10.0 && (v * 10.0).round() % 10.0 != 0.0 {
                format!("{v:.1}{unit}")
            } else {
                format!("{:.0}{unit}", v.round())
            };
        }
    }
    format!("{b}B")
}

/// At most `max` characters, the last an ellipsis when cut.
fn truncate(s: &str, max: usize) -> String {
    crate::status::truncate(s, max)
}
