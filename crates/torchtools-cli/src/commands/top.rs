//! `torchtools top`: who holds each GPU, who waits for it, and what runs on it, live.
//!
//! One [`Snapshot`] (locks, queue, NVML) is taken about once a second and drawn with
//! ratatui; `--once` draws the same frame into a buffer and prints it as text, `--json`
//! prints the snapshot itself.

use std::io::IsTerminal;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use ratatui::buffer::Buffer;
use ratatui::crossterm::event::{self, Event, KeyCode, KeyEventKind, KeyModifiers};
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::{Color, Modifier, Style};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, Borders, Paragraph, Row, Table, Widget};
use ratatui::Frame;
use tt_device::{Bytes, NvmlStatus};
use tt_lock::{utc, GpuKey, Holder, LockDir};

use crate::commands::queue::{age, wants_text};
use crate::snapshot::{GpuView, Gpus, Snapshot};

/// Watch the GPUs live, refreshed every second.
///
/// A live view of the GPUs, refreshed every second: memory used, free and fenced,
/// use, the lock's holder and the requests waiting, and the processes on each GPU
/// (marked when they run outside the holder's reservation).
///
/// Keys: q quits, the arrow keys select a GPU, c toggles a compact view for narrow
/// terminals. Without NVML it shows the locks and the queue and says why the GPU
/// columns are empty.
#[derive(clap::Args)]
pub(crate) struct Args {
    /// Print one frame as text and exit (for scripts; width from COLUMNS).
    #[arg(long, conflicts_with = "json")]
    pub(crate) once: bool,
    /// Print one snapshot as JSON and exit.
    #[arg(long)]
    pub(crate) json: bool,
    /// Start in the compact view.
    #[arg(long)]
    pub(crate) compact: bool,
}

/// `torchtools top [--once | --json]`.
pub(crate) fn run(args: &Args) -> Result<ExitCode> {
    let dir = LockDir::from_env()?;
    let gpus = Gpus::open();
    let snapshot = Snapshot::take(&dir, &gpus)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&snapshot)?);
        return Ok(ExitCode::SUCCESS);
    }
    let mut view = View {
        selected: 0,
        compact: args.compact,
    };
    if args.once {
        let width = terminal_width();
        print!("{}", render_text(&snapshot, &view, width));
        return Ok(ExitCode::SUCCESS);
    }
    if !std::io::stdout().is_terminal() {
        bail!(
            "torchtools top needs a terminal: stdout is not one; use `torchtools top --once` \
             for one frame as text, or --json for a snapshot"
        );
    }
    let mut terminal = ratatui::init();
    let result = live(&mut terminal, &dir, &gpus, snapshot, &mut view);
    ratatui::restore();
    result.map(|()| ExitCode::SUCCESS)
}

/// How often the view refreshes.
const FRAME_EVERY: Duration = Duration::from_secs(1);

/// What the user changed with keys.
#[derive(Debug, Default)]
struct View {
    selected: usize,
    compact: bool,
}

fn live(
    terminal: &mut ratatui::DefaultTerminal,
    dir: &LockDir,
    gpus: &Gpus,
    mut snapshot: Snapshot,
    view: &mut View,
) -> Result<()> {
    loop {
        terminal
            .draw(|frame| draw(frame, &snapshot, view))
            .context("drawing the view")?;
        let next = Instant::now() + FRAME_EVERY;
        loop {
            let left = next.saturating_duration_since(Instant::now());
            if left.is_zero() || !event::poll(left).context("reading the terminal")? {
                break;
            }
            match event::read().context("reading the terminal")? {
                Event::Key(key) if key.kind == KeyEventKind::Press => match key.code {
                    KeyCode::Char('q') | KeyCode::Esc => return Ok(()),
                    KeyCode::Char('c') if key.modifiers.contains(KeyModifiers::CONTROL) => {
                        return Ok(())
                    }
                    KeyCode::Up | KeyCode::Char('k') => {
                        view.selected = view.selected.saturating_sub(1);
                    }
                    KeyCode::Down | KeyCode::Char('j') => {
                        view.selected =
                            (view.selected + 1).min(snapshot.gpus.len().saturating_sub(1));
                    }
                    KeyCode::Char('c') => view.compact = !view.compact,
                    _ => continue,
                },
                Event::Resize(..) => {}
                _ => continue,
            }
            terminal
                .draw(|frame| draw(frame, &snapshot, view))
                .context("drawing the view")?;
        }
        snapshot = Snapshot::take(dir, gpus)?;
    }
}

/// `COLUMNS`, else the terminal's width, else 120.
fn terminal_width() -> u16 {
    std::env::var("COLUMNS")
        .ok()
        .and_then(|c| c.parse().ok())
        .filter(|&c| c >= 20)
        .or_else(|| ratatui::crossterm::terminal::size().ok().map(|(w, _)| w))
        .unwrap_or(120)
}

/// One frame as text, tall enough for everything in it.
fn render_text(snapshot: &Snapshot, view: &View, width: u16) -> String {
    let height =
        heights(snapshot, view).iter().sum::<u16>() + note_lines(&note_text(snapshot), width) + 2;
    let area = Rect::new(0, 0, width, height);
    let mut buffer = Buffer::empty(area);
    render(snapshot, view, area, &mut buffer);
    let mut out = String::new();
    for y in 0..area.height {
        let mut line = String::new();
        for x in 0..area.width {
            line.push_str(buffer[(x, y)].symbol());
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

fn draw(frame: &mut Frame, snapshot: &Snapshot, view: &View) {
    render(snapshot, view, frame.area(), frame.buffer_mut());
}

/// The heights of the GPU table, the selected GPU's panel and the queue table.
fn heights(snapshot: &Snapshot, view: &View) -> [u16; 4] {
    let n = |k: usize| u16::try_from(k).unwrap_or(u16::MAX);
    let gpus = n(snapshot.gpus.len().max(1)) + 3;
    let selected = snapshot.gpus.get(view.selected);
    let detail = n(selected.map_or(0, |g| g.waiting.len())) + 4;
    let queue = n(snapshot.queue.len().max(1)) + 3;
    let processes = n(snapshot
        .gpus
        .iter()
        .map(|g| g.processes.len())
        .sum::<usize>()
        .max(1))
        + 3;
    [gpus, detail, queue, processes]
}

/// The line under the title: the driver, or why there is no GPU data.
fn note_text(snapshot: &Snapshot) -> String {
    let ignored = match snapshot.ignored.len() {
        0 => String::new(),
        n => format!(
            "; {n} record(s) ignored, written by another user than they name \
             (`torchtools locks` lists them)"
        ),
    };
    let note = match &snapshot.nvml {
        NvmlStatus::Available { driver_version } => format!(
            "NVIDIA driver {driver_version}; {} GPU(s); {} request(s) waiting",
            snapshot.gpus.iter().filter(|g| g.index.is_some()).count(),
            snapshot.queue.len()
        ),
        NvmlStatus::Unavailable { reason } => format!(
            "NVML unavailable ({reason}): no GPU memory, use or processes to show; locks \
             and the queue are below"
        ),
    };
    let policy = match snapshot.policy_ignored {
        true => format!("; {}", tt_device::printable(&snapshot.policy)),
        false => String::new(),
    };
    let over: String = snapshot
        .over_limits()
        .iter()
        .map(|line| format!("; {line}"))
        .collect();
    note + &ignored + &policy + &over
}

/// How many lines `text` takes wrapped at `width` (at most 4).
fn note_lines(text: &str, width: u16) -> u16 {
    let chars = text.chars().count();
    let width = usize::from(width.max(1));
    u16::try_from(chars.div_ceil(width).clamp(1, 4)).unwrap_or(4)
}

fn render(snapshot: &Snapshot, view: &View, area: Rect, buf: &mut Buffer) {
    let [gpus_h, detail_h, queue_h, _] = heights(snapshot, view);
    let note_text = note_text(snapshot);
    let [title, note, gpus, detail, queue, processes, footer] = Layout::vertical([
        Constraint::Length(1),
        Constraint::Length(note_lines(&note_text, area.width)),
        Constraint::Length(gpus_h),
        Constraint::Length(detail_h),
        Constraint::Length(queue_h),
        Constraint::Min(3),
        Constraint::Length(1),
    ])
    .areas(area);
    let bold = Style::default().add_modifier(Modifier::BOLD);
    Paragraph::new(Line::from(vec![
        Span::styled("torchtools top", bold),
        Span::raw(format!(
            "  {}  {}",
            snapshot.lock_dir.display(),
            utc(snapshot.time_unix)
        )),
    ]))
    .render(title, buf);
    Paragraph::new(note_text)
        .wrap(ratatui::widgets::Wrap { trim: true })
        .render(note, buf);
    render_gpus(snapshot, view, gpus, buf);
    render_detail(snapshot, view, detail, buf);
    render_queue(snapshot, view, queue, buf);
    render_processes(snapshot, view, processes, buf);
    let keys = if view.compact {
        "q quit  ↑↓ GPU  c full"
    } else {
        "q quit  ↑/↓ select a GPU  c compact view  refreshes every second"
    };
    Paragraph::new(keys)
        .style(Style::default().add_modifier(Modifier::DIM))
        .render(footer, buf);
}

fn gib(b: Bytes) -> String {
    format!("{:.1}", b.0 as f64 / (1u64 << 30) as f64)
}

fn gpu_name(g: &GpuView) -> String {
    match (g.index, &g.key) {
        (Some(i), _) => i.to_string(),
        (None, GpuKey::Index(i)) => format!("{i}*"),
        (None, GpuKey::Uuid(u)) => u.chars().take(12).collect(),
    }
}

fn holder_cell(h: &Holder, compact: bool) -> String {
    let command = crate::args::shown(&h.who.command);
    let user = tt_device::printable(&h.who.user);
    if compact {
        format!("{user} {}", h.who.pid)
    } else {
        format!("{user} pid {}: {command}", h.who.pid)
    }
}

fn block(title: String) -> Block<'static> {
    Block::default().borders(Borders::TOP).title(title)
}

/// One GPU's cells in the GPU table (the compact view's, or the full one's).
fn gpu_cells(snapshot: &Snapshot, g: &GpuView, compact: bool) -> Vec<String> {
    let dash = || "-".to_owned();
    let memory = match (g.used, g.total) {
        (Some(u), Some(t)) => format!("{}/{} GiB", gib(u), gib(t)),
        _ => dash(),
    };
    let fenced = g
        .holder
        .as_ref()
        .and_then(|h| h.fenced)
        .filter(|b| b.0 > 0)
        .map_or_else(dash, |b| format!("{} GiB", gib(b)));
    let holder = match (&g.holder, g.shares.as_slice()) {
        (Some(h), _) => holder_cell(h, compact),
        (None, []) => match g.unrecorded.first() {
            None => "free".to_owned(),
            Some(l) => format!("locked by {l}, no record"),
        },
        (None, shares) => format!("shared by {} job(s)", shares.len()),
    };
    let since = g.holder.as_ref().map_or_else(dash, |h| {
        age(snapshot.time_unix.saturating_sub(h.who.since_unix))
    });
    let budgets: u64 = g.shares.iter().filter_map(|h| h.share).map(|b| b.0).sum();
    let reserving = match (&g.holder, budgets) {
        (None, b) if b > 0 => format!("{} GiB shared", gib(Bytes(b))),
        _ => g
            .holder
            .as_ref()
            .and_then(|h| h.who.reserved)
            .map_or_else(dash, |b| format!("{} GiB", gib(b))),
    };
    if compact {
        vec![
            gpu_name(g),
            memory,
            g.utilization.map_or_else(dash, |u| format!("{u}%")),
            g.waiting.len().to_string(),
            holder,
        ]
    } else {
        vec![
            gpu_name(g),
            g.name.clone().unwrap_or_else(|| match &g.key {
                GpuKey::Index(_) => "by index (no NVML)".to_owned(),
                GpuKey::Uuid(u) => u.clone(),
            }),
            memory,
            g.free.map_or_else(dash, |b| format!("{} GiB", gib(b))),
            fenced,
            g.utilization.map_or_else(dash, |u| format!("{u}%")),
            g.waiting.len().to_string(),
            since,
            reserving,
            holder,
        ]
    }
}

fn render_gpus(snapshot: &Snapshot, view: &View, area: Rect, buf: &mut Buffer) {
    // The longest GPU name whole ("NVIDIA H100 80GB HBM3"), within bounds.
    let name_width = snapshot
        .gpus
        .iter()
        .filter_map(|g| g.name.as_ref())
        .map(|n| n.chars().count())
        .max()
        .unwrap_or(18)
        .clamp(18, 32) as u16;
    let rows: Vec<Row> = snapshot
        .gpus
        .iter()
        .enumerate()
        .map(|(i, g)| {
            let cells = gpu_cells(snapshot, g, view.compact);
            let style = if i == view.selected {
                Style::default().add_modifier(Modifier::REVERSED)
            } else {
                Style::default()
            };
            Row::new(cells).style(style)
        })
        .collect();
    let (header, widths): (Vec<&str>, Vec<Constraint>) = if view.compact {
        (
            vec!["GPU", "used GiB", "use", "wait", "holder"],
            vec![
                Constraint::Length(4),
                Constraint::Length(13),
                Constraint::Length(4),
                Constraint::Length(4),
                Constraint::Fill(1),
            ],
        )
    } else {
        (
            vec![
                "GPU",
                "name",
                "memory",
                "free",
                "fenced",
                "use",
                "waiting",
                "held for",
                "reserving",
                "holder",
            ],
            vec![
                Constraint::Length(4),
                Constraint::Length(name_width),
                Constraint::Length(13),
                Constraint::Length(8),
                Constraint::Length(8),
                Constraint::Length(4),
                Constraint::Length(7),
                Constraint::Length(8),
                Constraint::Length(9),
                Constraint::Fill(1),
            ],
        )
    };
    let empty = rows.is_empty();
    Table::new(rows, widths)
        .header(Row::new(header).style(Style::default().add_modifier(Modifier::BOLD)))
        .block(block(if empty {
            "GPUs: none (no NVML GPU and no lock file)".to_owned()
        } else {
            "GPUs".to_owned()
        }))
        .render(area, buf);
}

fn render_detail(snapshot: &Snapshot, view: &View, area: Rect, buf: &mut Buffer) {
    let Some(g) = snapshot.gpus.get(view.selected) else {
        block("no GPU selected".to_owned()).render(area, buf);
        return;
    };
    let title = match (&g.index, &g.key) {
        (Some(i), GpuKey::Uuid(u)) => format!("GPU {i} ({u})"),
        (_, key) => key.to_string(),
    };
    let mut lines = vec![Line::from(match (&g.holder, g.shares.len()) {
        (Some(h), _) => format!("held by {h}"),
        (None, 0) if g.unrecorded.is_empty() => "free".to_owned(),
        (None, 0) => "not free:".to_owned(),
        (None, n) => format!("shared by {n} job(s) by memory budget:"),
    })];
    for h in &g.shares {
        lines.push(Line::from(format!("  {h}")));
    }
    for l in &g.unrecorded {
        lines.push(Line::from(format!(
            "  locked by {l} with no reservation record: no request for the whole GPU \
             is granted until it lets go"
        )));
    }
    if g.waiting.is_empty() {
        lines.push(Line::from("nobody waits for it"));
    } else {
        lines.push(Line::from(format!("{} waiting:", g.waiting.len())));
    }
    for position in &g.waiting {
        if let Some(w) = snapshot.queue.iter().find(|w| w.position == *position) {
            lines.push(Line::from(format!(
                "  #{} {} pid {} for {}: {}",
                w.position,
                tt_device::printable(&w.who.user),
                w.who.pid,
                age(snapshot.time_unix.saturating_sub(w.who.since_unix)),
                crate::args::shown(&w.who.command)
            )));
        }
    }
    Paragraph::new(lines)
        .block(block(format!("selected: {title}")))
        .render(area, buf);
}

fn render_queue(snapshot: &Snapshot, view: &View, area: Rect, buf: &mut Buffer) {
    let nvml_index = |key: &GpuKey| {
        snapshot
            .gpus
            .iter()
            .find(|g| &g.key == key)
            .and_then(|g| g.index)
    };
    let rows: Vec<Row> = snapshot
        .queue
        .iter()
        .map(|w| {
            let mut cells = vec![
                w.position.to_string(),
                tt_device::printable(&w.who.user).into_owned(),
                w.who.pid.to_string(),
                age(snapshot.time_unix.saturating_sub(w.who.since_unix)),
                wants_text(&w.wants, nvml_index),
            ];
            if !view.compact {
                cells.push(w.who.reserved.map_or("-".into(), |b| b.to_string()));
                cells.push(crate::args::shown(&w.who.command));
            }
            Row::new(cells)
        })
        .collect();
    let mut widths = vec![
        Constraint::Length(3),
        Constraint::Length(10),
        Constraint::Length(8),
        Constraint::Length(8),
        Constraint::Length(24),
    ];
    let mut header = vec!["#", "user", "pid", "waiting", "wants"];
    if !view.compact {
        widths.extend([Constraint::Length(11), Constraint::Fill(1)]);
        header.extend(["bytes", "command"]);
    }
    Table::new(rows, widths)
        .header(Row::new(header).style(Style::default().add_modifier(Modifier::BOLD)))
        .block(block(format!(
            "queue: {} waiting, {}",
            snapshot.queue.len(),
            queue_order(snapshot)
        )))
        .render(area, buf);
}

/// How the queue is served, for the queue's title: first come, first served, or by
/// fair share with each user's recent use.
fn queue_order(snapshot: &Snapshot) -> String {
    if !snapshot.policy_orders {
        return "served first come, first served".to_owned();
    }
    let users: Vec<String> = snapshot
        .users
        .iter()
        .map(|u| {
            format!(
                "{}: {:.1} GPU-h",
                tt_device::printable(&u.user),
                u.use_gpu_s / 3600.0
            )
        })
        .collect();
    format!("served by the machine's policy ({})", users.join(", "))
}

fn render_processes(snapshot: &Snapshot, view: &View, area: Rect, buf: &mut Buffer) {
    let mut rows = Vec::new();
    for g in &snapshot.gpus {
        for p in &g.processes {
            let mark = match (p.in_reservation, p.share, p.over_share) {
                (_, Some(_), true) => "OVER SHARE",
                (_, Some(_), false) => "share",
                (true, None, _) => "reserved",
                (false, None, _) => "OUTSIDE",
            };
            let style = if p.in_reservation && !p.over_share {
                Style::default()
            } else {
                Style::default().fg(Color::Red)
            };
            let mut cells = vec![
                gpu_name(g),
                p.pid.to_string(),
                p.user.clone(),
                p.used.map_or("?".into(), |b| format!("{} GiB", gib(b))),
                mark.to_owned(),
            ];
            if !view.compact {
                cells.push(p.command.clone());
            }
            rows.push(Row::new(cells).style(style));
        }
    }
    let title = match &snapshot.nvml {
        NvmlStatus::Available { .. } => {
            "processes on the GPUs (OUTSIDE: not under the GPU's lock holder or a sharer; \
             OVER SHARE: a sharer using more than its budget)"
                .to_owned()
        }
        NvmlStatus::Unavailable { .. } => "processes on the GPUs: unknown without NVML".into(),
    };
    let mut widths = vec![
        Constraint::Length(4),
        Constraint::Length(8),
        Constraint::Length(10),
        Constraint::Length(10),
        Constraint::Length(10),
    ];
    let mut header = vec!["GPU", "pid", "user", "memory", "lock"];
    if !view.compact {
        widths.push(Constraint::Fill(1));
        header.push("command");
    }
    Table::new(rows, widths)
        .header(Row::new(header).style(Style::default().add_modifier(Modifier::BOLD)))
        .block(block(title))
        .render(area, buf);
}

#[cfg(test)]
mod tests {
    use super::*;
    use tt_device::parent_of;

    #[test]
    fn commands_and_users_are_read_from_proc() {
        let me = std::process::id();
        assert!(!crate::process::command_of(me).is_empty());
        assert_ne!(crate::process::user_of(me), "?");
    }

    /// The view of a machine given as an inventory (two GPUs, one held by this
    /// process, which also runs on it): memory, use and processes from the inventory,
    /// holders from the lock directory, merged as `locks` merges them.
    #[test]
    fn a_frame_merges_the_inventory_with_the_locks() {
        use tt_device::{GpuInfo, GpuProcess, Inventory};
        use tt_lock::{Holder, Wait};
        let uuid = |i: u32| format!("GPU-0000000{i}-1111-2222-3333-444444444444");
        let gpu = |i: u32, pid: u32| GpuInfo {
            nvml_index: i,
            uuid: uuid(i),
            name: format!("Test GPU {i}"),
            total: Bytes::gib(80),
            free: Bytes::gib(60 - u64::from(i)),
            used: Bytes::gib(20 + u64::from(i)),
            utilization: Some(40 + i),
            processes: vec![GpuProcess {
                pid,
                used: Some(Bytes::gib(2)),
            }],
            mig: Vec::new(),
        };
        let me = std::process::id();
        let parent = parent_of(me).unwrap_or(1);
        let inventory = Inventory {
            nvml: NvmlStatus::Available {
                driver_version: "test".into(),
            },
            gpus: vec![gpu(0, me), gpu(1, parent)],
            errors: Vec::new(),
        };
        let tmp = tempfile::tempdir().unwrap();
        let dir = LockDir::open(tmp.path().join("locks")).unwrap();
        let _held = dir
            .lock(&GpuKey::of_uuid(&uuid(0)), Wait::Try, Holder::current())
            .unwrap();
        let gpus = Gpus::with_backend(Box::new(inventory));
        let frame = Snapshot::take(&dir, &gpus).unwrap();
        assert_eq!(frame.gpus.len(), 2);
        let (a, b) = (&frame.gpus[0], &frame.gpus[1]);
        assert_eq!((a.index, b.index), (Some(0), Some(1)));
        assert_eq!(a.name.as_deref(), Some("Test GPU 0"));
        assert_eq!(a.free, Some(Bytes::gib(60)));
        assert_eq!(a.utilization, Some(40));
        assert_eq!(a.holder.as_ref().map(|h| h.who.pid), Some(me));
        assert!(b.holder.is_none());
        // This process runs on the GPU it holds; the other GPU's process is outside.
        assert!(a.processes[0].in_reservation);
        assert!(!b.processes[0].in_reservation);
        let text = render_text(&frame, &View::default(), 120);
        assert!(text.contains("Test GPU 0"), "{text}");
    }

    /// A GPU shared by memory budget (this process, 1 GiB, using 2 GiB per the
    /// inventory): shown shared, its process flagged over its share; within budget it
    /// is a plain share.
    #[test]
    fn a_sharer_over_its_budget_is_flagged() {
        use tt_device::{GpuInfo, GpuProcess, Inventory};
        use tt_lock::{Holder, Wait};
        let uuid = "GPU-00000000-1111-2222-3333-444444444444";
        let inventory = Inventory {
            nvml: NvmlStatus::Available {
                driver_version: "test".into(),
            },
            gpus: vec![GpuInfo {
                nvml_index: 0,
                uuid: uuid.into(),
                name: "Test GPU".into(),
                total: Bytes::gib(80),
                free: Bytes::gib(78),
                used: Bytes::gib(2),
                utilization: None,
                processes: vec![GpuProcess {
                    pid: std::process::id(),
                    used: Some(Bytes::gib(2)),
                }],
                mig: Vec::new(),
            }],
            errors: Vec::new(),
        };
        let gpus = Gpus::with_backend(Box::new(inventory));
        let tmp = tempfile::tempdir().unwrap();
        let dir = LockDir::open(tmp.path().join("locks")).unwrap();
        let key = GpuKey::of_uuid(uuid);
        for (budget, mark) in [(1, "OVER SHARE"), (4, "share")] {
            let lock = dir
                .lock_shared(
                    &key,
                    Bytes::gib(budget),
                    Bytes::gib(80),
                    Wait::Try,
                    Holder::current(),
                )
                .unwrap();
            let frame = Snapshot::take(&dir, &gpus).unwrap();
            let g = &frame.gpus[0];
            assert!(g.holder.is_none());
            assert_eq!(g.shares.len(), 1);
            assert_eq!(g.processes[0].share, Some(Bytes::gib(budget)));
            assert_eq!(g.processes[0].over_share, budget == 1);
            let text = render_text(&frame, &View::default(), 160);
            assert!(text.contains("shared by 1 job(s)"), "{text}");
            assert!(text.contains(mark), "{text}");
            drop(lock);
        }
    }
}
