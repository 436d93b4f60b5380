//! The charts of BENCHMARKS.md, drawn as SVG from the figures the benches
//! left in `benchmarks/data/*.csv` (see `figures.rs` for the columns).
//!
//! ```sh
//! cargo run -p idem-benches --bin charts
//! # examples/overhead prints its tables: turn a run's output into
//! # benchmarks/data/overhead.csv first (one or more logs; each table a log
//! # holds replaces the same table's rows, a later log's an earlier's), then draw:
//! cargo run -p idem-benches --bin charts -- overhead overhead-redis.log overhead-sql.log
//! # IDEM_BENCH_CSV_DIR (benchmarks/data) IDEM_BENCH_CHARTS_DIR (benchmarks)
//! ```
//!
//! Every chart is bars of medians with the spread of their rounds as error
//! bars (where the bench measured one), and the goal or bound a figure is
//! read against as a dashed mark over its group. Text is written as SVG
//! `<text>` and laid out by plotters' own size estimate: no font is read,
//! so the program needs no system library.

use std::collections::BTreeSet;
use std::error::Error;
use std::path::{Path, PathBuf};

use plotters::element::DashedPathElement;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

#[path = "figures.rs"]
mod figures;
use figures::{Csv, csv_fields};

type BoxError = Box<dyn Error>;

// ---------------------------------------------------------------------------
// The data
// ---------------------------------------------------------------------------

struct Row {
    bench: String,
    table: String,
    series: String,
    x: String,
    value: f64,
    low: Option<f64>,
    high: Option<f64>,
}

struct Data {
    rows: Vec<Row>,
}

impl Data {
    fn load(dir: &Path) -> Result<Data, BoxError> {
        let mut rows = Vec::new();
        let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(|e| format!("{}: {e}", dir.display()))?
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|x| x == "csv"))
            .collect();
        files.sort();
        for file in files {
            let bench = file
                .file_stem()
                .and_then(|s| s.to_str())
                .unwrap_or_default()
                .to_owned();
            let text = std::fs::read_to_string(&file)?;
            for line in text.lines().skip(1).filter(|l| !l.trim().is_empty()) {
                let f = csv_fields(line);
                if f.len() < 6 {
                    return Err(format!("{}: a short line: {line}", file.display()).into());
                }
                let num = |s: &str| s.parse::<f64>().ok();
                let Some(value) = num(&f[3]) else { continue };
                rows.push(Row {
                    bench: bench.clone(),
                    table: f[0].clone(),
                    series: f[1].clone(),
                    x: f[2].clone(),
                    value,
                    low: num(&f[4]),
                    high: num(&f[5]),
                });
            }
        }
        Ok(Data { rows })
    }

    fn point(&self, bench: &str, table: &str, series: &str, x: &str) -> Option<Point> {
        self.rows
            .iter()
            .find(|r| r.bench == bench && r.table == table && r.series == series && r.x == x)
            .map(|r| Point {
                value: r.value,
                spread: r.low.zip(r.high),
            })
    }

    /// The first table of `bench` whose name starts with `prefix` and ends
    /// with `suffix`.
    fn table(&self, bench: &str, prefix: &str, suffix: &str) -> Option<String> {
        self.rows
            .iter()
            .find(|r| r.bench == bench && r.table.starts_with(prefix) && r.table.ends_with(suffix))
            .map(|r| r.table.clone())
    }

    /// The series of one table, in the order the file holds them.
    fn series_of(&self, bench: &str, table: &str) -> Vec<String> {
        let mut seen = BTreeSet::new();
        self.rows
            .iter()
            .filter(|r| r.bench == bench && r.table == table && seen.insert(r.series.clone()))
            .map(|r| r.series.clone())
            .collect()
    }
}

// ---------------------------------------------------------------------------
// A chart: groups of bars, error bars, dashed marks
// ---------------------------------------------------------------------------

#[derive(Clone, Copy)]
struct Point {
    value: f64,
    spread: Option<(f64, f64)>,
}

struct Series {
    name: String,
    points: Vec<Option<Point>>,
}

/// A goal or a bound, drawn dashed over the groups it applies to: across
/// the whole group, or over one series' bar (`over`).
struct Mark {
    name: String,
    values: Vec<Option<f64>>,
    color: RGBColor,
    over: Option<usize>,
}

#[derive(Clone, Copy, PartialEq)]
enum Unit {
    Ratio,
    Rate,
    Nanos,
}

struct Chart {
    file: &'static str,
    title: String,
    y_desc: &'static str,
    unit: Unit,
    groups: Vec<String>,
    series: Vec<Series>,
    marks: Vec<Mark>,
}

const COLORS: [RGBColor; 4] = [
    RGBColor(0x2b, 0x6c, 0xb0),
    RGBColor(0xe0, 0x8a, 0x1e),
    RGBColor(0x5a, 0xa0, 0x4a),
    RGBColor(0x8e, 0x5c, 0xb4),
];
const GOAL: RGBColor = RGBColor(0xc0, 0x25, 0x25);
const BOUND: RGBColor = RGBColor(0x55, 0x55, 0x55);

fn label(unit: Unit, v: f64) -> String {
    match unit {
        Unit::Ratio => format!("{v:.2}"),
        Unit::Rate if v >= 10_000.0 => format!("{:.1}k", v / 1000.0),
        Unit::Rate | Unit::Nanos => format!("{v:.0}"),
    }
}

fn render(chart: &Chart, dir: &Path) -> Result<bool, BoxError> {
    let has_data = chart
        .series
        .iter()
        .any(|s| s.points.iter().any(Option::is_some));
    if !has_data {
        eprintln!("{}: no figures for it in the CSVs, not drawn", chart.file);
        return Ok(false);
    }
    let n = chart.groups.len();
    let per_group = chart.series.len().max(1);
    // The axis follows the medians and the marks, not the spreads: one wild
    // round would flatten every bar. A whisker that goes past the top is cut
    // there, with where it went written at the cut.
    let top = chart
        .series
        .iter()
        .flat_map(|s| s.points.iter().flatten())
        .map(|p| p.value)
        .chain(
            chart
                .marks
                .iter()
                .flat_map(|m| m.values.iter().flatten().copied()),
        )
        .fold(0.0, f64::max);
    let y_max = top * 1.3;
    let cut = y_max * 0.94;
    let widest = chart
        .groups
        .iter()
        .map(|g| g.chars().count())
        .max()
        .unwrap_or(0);
    let group_width = (7 * widest as u32 + 12).max(120);
    let width = (group_width * n as u32 + 140).max(720);

    // The legend goes under the chart, in rows as wide as the picture.
    let mut entries: Vec<(&str, Option<RGBColor>, RGBColor)> = chart
        .series
        .iter()
        .enumerate()
        .map(|(s, series)| (series.name.as_str(), None, COLORS[s % COLORS.len()]))
        .collect();
    entries.extend(
        chart
            .marks
            .iter()
            .map(|m| (m.name.as_str(), Some(m.color), m.color)),
    );
    let entry_width = |name: &str| 34 + 7 * name.chars().count() as i32;
    let mut rows: Vec<Vec<usize>> = vec![Vec::new()];
    let mut used = 0;
    for (i, (name, _, _)) in entries.iter().enumerate() {
        let w = entry_width(name);
        if used + w > width as i32 - 80 && !rows.last().is_some_and(Vec::is_empty) {
            rows.push(Vec::new());
            used = 0;
        }
        rows.last_mut().expect("a row").push(i);
        used += w;
    }
    let legend_h = 22 * rows.len() as u32 + 10;
    let height = 420 + legend_h;

    let path = dir.join(chart.file);
    let root = SVGBackend::new(&path, (width, height)).into_drawing_area();
    root.fill(&WHITE)?;
    let (upper, lower) = root.split_vertically(height - legend_h);

    // x in thousandths of a group (integer coordinates label their key
    // points; a group's label sits at its center).
    let at = |x: f64| (x * 1000.0).round() as i32;
    let centers: Vec<i32> = (0..n).map(|g| at(g as f64 + 0.5)).collect();
    let mut c = ChartBuilder::on(&upper)
        .caption(&chart.title, ("sans-serif", 20))
        .margin(14)
        .x_label_area_size(36)
        .y_label_area_size(80)
        .build_cartesian_2d((0..at(n as f64)).with_key_points(centers), 0f64..y_max)?;
    let groups = chart.groups.clone();
    let group_label = move |x: &i32| {
        let g = (*x / 1000) as usize;
        groups.get(g).cloned().unwrap_or_default()
    };
    let unit = chart.unit;
    c.configure_mesh()
        .disable_x_mesh()
        .x_labels(n)
        .x_label_formatter(&group_label)
        .y_desc(chart.y_desc)
        .y_label_formatter(&|v| match unit {
            Unit::Ratio => format!("{v:.1}"),
            _ => format!("{v:.0}"),
        })
        .label_style(("sans-serif", 14))
        .axis_desc_style(("sans-serif", 14))
        .light_line_style(WHITE.mix(0.0))
        .bold_line_style(BLACK.mix(0.12))
        .draw()?;

    let slot = 0.8 / per_group as f64;
    for (s, series) in chart.series.iter().enumerate() {
        let color = COLORS[s % COLORS.len()];
        let bar = |g: usize| {
            let x0 = g as f64 + 0.1 + s as f64 * slot;
            (x0 + slot * 0.06, x0 + slot * 0.94)
        };
        let points = || series.points.iter().enumerate();
        c.draw_series(points().filter_map(|(g, p)| {
            let (x0, x1) = bar(g);
            p.map(|p| Rectangle::new([(at(x0), 0.0), (at(x1), p.value)], color.filled()))
        }))?;
        c.draw_series(points().filter_map(|(g, p)| {
            let (x0, x1) = bar(g);
            let p = (*p)?;
            let (lo, hi) = p.spread?;
            Some(ErrorBar::new_vertical(
                at((x0 + x1) / 2.0),
                lo,
                p.value,
                hi.min(cut),
                BLACK.stroke_width(1),
                6,
            ))
        }))?;
        // The median inside its bar's top (above it, for a bar too short to
        // hold it); where a whisker was cut, its end at the cut.
        c.draw_series(points().filter_map(|(g, p)| {
            let (x0, x1) = bar(g);
            let p = (*p)?;
            let x = at((x0 + x1) / 2.0);
            let inside = p.value > y_max * 0.09;
            let style = ("sans-serif", 12)
                .into_font()
                .color(if inside { &WHITE } else { &BLACK });
            let (y, v) = if inside {
                (p.value - y_max * 0.03, VPos::Top)
            } else {
                (p.value + y_max * 0.012, VPos::Bottom)
            };
            let style = style.pos(Pos::new(HPos::Center, v));
            Some(Text::new(label(chart.unit, p.value), (x, y), style))
        }))?;
        c.draw_series(points().filter_map(|(g, p)| {
            let (x0, x1) = bar(g);
            let hi = p.as_ref()?.spread?.1;
            let style = ("sans-serif", 10)
                .into_font()
                .color(&BLACK)
                .pos(Pos::new(HPos::Center, VPos::Bottom));
            (hi > cut).then(|| {
                let text = format!("↑{}", label(chart.unit, hi));
                Text::new(text, (at((x0 + x1) / 2.0), cut + y_max * 0.01), style)
            })
        }))?;
    }
    for mark in &chart.marks {
        let color = mark.color;
        c.draw_series(mark.values.iter().enumerate().filter_map(|(g, v)| {
            let v = (*v)?;
            let (x0, x1) = match mark.over {
                Some(s) => {
                    let x0 = g as f64 + 0.1 + s as f64 * slot;
                    (x0 - slot * 0.08, x0 + slot * 1.08)
                }
                None => (g as f64 + 0.04, g as f64 + 0.96),
            };
            Some(DashedPathElement::new(
                vec![(at(x0), v), (at(x1), v)],
                6,
                4,
                color.stroke_width(2),
            ))
        }))?;
    }

    let text = ("sans-serif", 13)
        .into_font()
        .color(&BLACK)
        .pos(Pos::new(HPos::Left, VPos::Center));
    for (r, row) in rows.iter().enumerate() {
        let y = 10 + 22 * r as i32;
        let mut x = 78;
        for &i in row {
            let (name, dashed, color) = entries[i];
            if dashed.is_some() {
                lower.draw(&DashedPathElement::new(
                    vec![(x, y + 8), (x + 22, y + 8)],
                    6,
                    4,
                    color.stroke_width(2),
                ))?;
            } else {
                lower.draw(&Rectangle::new(
                    [(x + 4, y + 2), (x + 18, y + 14)],
                    color.filled(),
                ))?;
            }
            lower.draw(&Text::new(name, (x + 28, y + 8), text.clone()))?;
            x += entry_width(name);
        }
    }
    root.present()?;
    Ok(true)
}

// ---------------------------------------------------------------------------
// The charts BENCHMARKS.md embeds
// ---------------------------------------------------------------------------

fn cs() -> [&'static str; 3] {
    ["1", "16", "64"]
}

/// `#[idempotent]` and the design's floor against the reference notes' Redis
/// flow, both bodies, c = 1 / 16 / 64, on the server whose tables start with
/// `server`.
fn overhead_redis(
    d: &Data,
    file: &'static str,
    server: &str,
    goals: Option<[f64; 3]>,
) -> Option<Chart> {
    let pure = d.table("overhead", server, " · pure");
    let incr = d.table("overhead", server, " · incr");
    let version = pure
        .as_ref()
        .or(incr.as_ref())
        .and_then(|t| t.split(" · ").next())
        .unwrap_or(server)
        .to_owned();
    let mut cells = Vec::new();
    for (body, table) in [("pure", pure), ("incr", incr)] {
        let Some(table) = table else { continue };
        for c in cs() {
            cells.push((format!("{body} c={c}"), table.clone(), c, body));
        }
    }
    let series = |name: &str, key: &str| Series {
        name: name.to_owned(),
        points: cells
            .iter()
            .map(|(_, t, c, _)| d.point("overhead", t, key, c))
            .collect(),
    };
    let mut marks = vec![Mark {
        name: "the reference flow (1.0)".into(),
        values: cells.iter().map(|_| Some(1.0)).collect(),
        color: BOUND,
        over: None,
    }];
    if let Some(goals) = goals {
        marks.push(Mark {
            name: "issue 35's goal (body incr)".into(),
            values: cells
                .iter()
                .map(|(_, _, c, body)| {
                    let i = cs().iter().position(|x| x == c)?;
                    (*body == "incr").then_some(goals[i])
                })
                .collect(),
            color: GOAL,
            over: Some(0),
        });
    }
    Some(Chart {
        file,
        title: format!("{version}: first calls ÷ the reference notes' Redis flow"),
        y_desc: "throughput ÷ reference",
        unit: Unit::Ratio,
        groups: cells.iter().map(|c| c.0.clone()).collect(),
        series: vec![
            series("#[idempotent] ÷ reference", "idem ÷ reference"),
            series(
                "floor (the store's 2 commands) ÷ reference",
                "floor ÷ reference",
            ),
        ],
        marks,
    })
}

fn overhead_sql(d: &Data) -> Option<Chart> {
    let mut cells = Vec::new();
    for (db, short) in [("PostgreSQL", "PostgreSQL"), ("MariaDB", "MariaDB")] {
        if let Some(table) = d.table("overhead", db, "") {
            for c in cs() {
                cells.push((format!("{short} c={c}"), table.clone(), c, db));
            }
        }
    }
    let series = |name: &str, key: &str| Series {
        name: name.to_owned(),
        points: cells
            .iter()
            .map(|(_, t, c, _)| d.point("overhead", t, key, c))
            .collect(),
    };
    Some(Chart {
        file: "overhead-sql.svg",
        title: "SQL: first calls ÷ the reference notes' flows, one order per call".into(),
        y_desc: "throughput ÷ reference",
        unit: Unit::Ratio,
        groups: cells.iter().map(|c| c.0.clone()).collect(),
        series: vec![
            series(
                "tx = tx ÷ same-transaction reference",
                "tx = tx ÷ same-tx reference",
            ),
            series(
                "#[idempotent] on the store ÷ separate-table reference",
                "#[idempotent] ÷ separate-table reference",
            ),
        ],
        marks: vec![
            Mark {
                name: "tx = tx: statement ceiling (4/5 PostgreSQL, 4/6 MariaDB)".into(),
                values: cells
                    .iter()
                    .map(|(_, _, _, db)| Some(if *db == "PostgreSQL" { 0.8 } else { 4.0 / 6.0 }))
                    .collect(),
                color: BOUND,
                over: Some(0),
            },
            Mark {
                name: "issue 35's goal for tx = tx on PostgreSQL (0.75)".into(),
                values: cells
                    .iter()
                    .map(|(_, _, _, db)| (*db == "PostgreSQL").then_some(0.75))
                    .collect(),
                color: GOAL,
                over: Some(0),
            },
        ],
    })
}

fn http(d: &Data) -> Option<Chart> {
    let sides = [
        ("(b) layer, memory, first", "first execution (memory store)"),
        ("(c) layer, memory, replay", "replay (memory store)"),
        ("(d) layer, Redis, first", "first execution (Redis 7.0)"),
    ];
    let groups = ["1", "16"];
    Some(Chart {
        file: "http.svg",
        title: "HTTP: the Idempotency-Key layer ÷ the bare axum route (loopback)".into(),
        y_desc: "requests/s ÷ bare route",
        unit: Unit::Ratio,
        groups: groups.iter().map(|c| format!("c={c}")).collect(),
        series: sides
            .iter()
            .map(|(key, name)| Series {
                name: (*name).to_owned(),
                points: groups
                    .iter()
                    .map(|c| d.point("http", "sockets", &format!("{key} ÷ (a)"), c))
                    .collect(),
            })
            .collect(),
        marks: vec![Mark {
            name: "issue 35's goal, first execution on memory (0.9)".into(),
            values: groups.iter().map(|_| Some(0.9)).collect(),
            color: GOAL,
            over: Some(0),
        }],
    })
}

fn consumers(d: &Data) -> Option<Chart> {
    let brokers = [
        ("redis", "Redis Streams"),
        ("rabbitmq", "RabbitMQ"),
        ("nats", "JetStream"),
        ("kafka", "Kafka"),
    ];
    let mut cells = Vec::new();
    for (key, name) in brokers {
        if let Some(table) = d.table("consumers", &format!("{key} ("), "") {
            for c in ["1", "16"] {
                cells.push((format!("{name} c={c}"), table.clone(), c));
            }
        }
    }
    let series = |name: &str, key: &str| Series {
        name: name.to_owned(),
        points: cells
            .iter()
            .map(|(_, t, c)| d.point("consumers", t, key, c))
            .collect(),
    };
    Some(Chart {
        file: "consumers.svg",
        title: "Consumers: messages/s ÷ a hand-written consumer (one PostgreSQL tx each)".into(),
        y_desc: "messages/s ÷ hand-written",
        unit: Unit::Ratio,
        groups: cells.iter().map(|c| c.0.clone()).collect(),
        series: vec![
            series(
                "idem (Runner + #[idempotent(consumer, tx = tx)])",
                "idem ÷ hand-written",
            ),
            series(
                "runner alone (hand-written transaction)",
                "runner ÷ hand-written",
            ),
        ],
        marks: vec![Mark {
            name: "goal (0.8)".into(),
            values: cells.iter().map(|_| Some(0.8)).collect(),
            color: GOAL,
            over: Some(0),
        }],
    })
}

fn outbox_write(d: &Data) -> Option<Chart> {
    let series = |name: &str, key: &str| Series {
        name: name.to_owned(),
        points: cs()
            .iter()
            .map(|c| d.point("outbox", "write", key, c))
            .collect(),
    };
    Some(Chart {
        file: "outbox-write.svg",
        title: "Outbox write: transactions/s ÷ the business INSERT alone (PostgreSQL)".into(),
        y_desc: "transactions/s ÷ INSERT alone",
        unit: Unit::Ratio,
        groups: cs().iter().map(|c| format!("c={c}")).collect(),
        series: vec![
            series("INSERT + put (1 message)", "INSERT + put ÷ INSERT alone"),
            series(
                "INSERT + put_all (3 messages)",
                "INSERT + put_all of 3 ÷ INSERT alone",
            ),
        ],
        marks: vec![Mark {
            name: "issue 35's goal for put (0.8)".into(),
            values: cs().iter().map(|_| Some(0.8)).collect(),
            color: GOAL,
            over: Some(0),
        }],
    })
}

fn outbox_relay(d: &Data) -> Option<Chart> {
    let series: Vec<String> = d
        .series_of("outbox", "relay")
        .into_iter()
        .filter(|s| d.point("outbox", "relay", s, "drained").is_some())
        .collect();
    Some(Chart {
        file: "outbox-relay.svg",
        title: "Outbox relay: committed messages drained per second, one relay".into(),
        y_desc: "messages/s",
        unit: Unit::Rate,
        groups: series.clone(),
        series: vec![Series {
            name: "drained/s".into(),
            points: series
                .iter()
                .map(|s| d.point("outbox", "relay", s, "drained"))
                .collect(),
        }],
        marks: vec![Mark {
            name: "issue 31's floor for Kafka (10 000/s)".into(),
            values: series
                .iter()
                .map(|s| s.starts_with("Kafka").then_some(10_000.0))
                .collect(),
            color: GOAL,
            over: Some(0),
        }],
    })
}

fn hot_path(d: &Data) -> Option<Chart> {
    let benches = [
        ("key/3 fields", "key, 3 fields"),
        ("memory store/claim+complete", "memory claim+complete"),
        ("call/bare async fn", "bare async fn"),
        ("call/#[idempotent] on memory", "#[idempotent], memory"),
        (
            "call/#[idempotent] on memory, through a StoreRef",
            "same, via StoreRef",
        ),
        ("call/bare async fn, yields once", "bare, yields once"),
        (
            "call/#[idempotent] on memory, yields once",
            "#[idempotent], yields once",
        ),
    ];
    Some(Chart {
        file: "hot-path.svg",
        title: "Hot path: CPU time per operation, one thread, no server".into(),
        y_desc: "ns per operation",
        unit: Unit::Nanos,
        groups: benches.iter().map(|b| b.1.to_owned()).collect(),
        series: vec![Series {
            name: "ns per operation (criterion)".into(),
            points: benches
                .iter()
                .map(|b| d.point("hot_path", "ns per operation", b.0, ""))
                .collect(),
        }],
        marks: vec![
            Mark {
                name: "goal: key derivation ≤ 300 ns".into(),
                values: benches
                    .iter()
                    .map(|b| (b.0 == "key/3 fields").then_some(300.0))
                    .collect(),
                color: GOAL,
                over: Some(0),
            },
            Mark {
                name: "goal: #[idempotent] ≤ 700 ns over the bare call".into(),
                values: benches
                    .iter()
                    .map(|b| {
                        let bare =
                            d.point("hot_path", "ns per operation", "call/bare async fn", "")?;
                        (b.0 == "call/#[idempotent] on memory").then_some(bare.value + 700.0)
                    })
                    .collect(),
                color: GOAL,
                over: Some(0),
            },
        ],
    })
}

// ---------------------------------------------------------------------------
// examples/overhead's printed tables into benchmarks/data/overhead.csv
// ---------------------------------------------------------------------------

/// One row of an overhead table: the side's letter and its columns.
struct OverheadRow {
    side: char,
    c: String,
    calls: f64,
    vs_base: f64,
    vs_ref: Option<(f64, (f64, f64))>,
    client_us: f64,
    server_us: Option<f64>,
    per_call: f64,
}

/// `1.35 [1.32-1.49]` as the ratio and its spread.
fn ratio_and_spread(value: &str, spread: &str) -> Option<(f64, (f64, f64))> {
    let (lo, hi) = spread.trim_matches(['[', ']']).split_once('-')?;
    Some((value.parse().ok()?, (lo.parse().ok()?, hi.parse().ok()?)))
}

fn overhead_row(line: &str) -> Option<OverheadRow> {
    // `{name:<30} {c:>3} {calls/s} {p50} {p99} {vs (a)} {vs ref [spread] or -} {cli} {srv} {RT}`
    let side = line.strip_prefix('(')?.chars().next()?;
    let rest = line.get(30..)?;
    let t: Vec<&str> = rest.split_whitespace().collect();
    let (vs_ref, tail) = if t.get(5) == Some(&"-") {
        (None, t.get(6..)?)
    } else {
        (ratio_and_spread(t.get(5)?, t.get(6)?), t.get(7..)?)
    };
    Some(OverheadRow {
        side,
        c: t.first()?.to_string(),
        calls: t.get(1)?.parse().ok()?,
        vs_base: t.get(4)?.parse().ok()?,
        vs_ref,
        client_us: tail.first()?.parse().ok()?,
        server_us: tail.get(1)?.parse().ok(),
        per_call: tail.get(2)?.parse().ok()?,
    })
}

fn rounds_of(header: &str) -> usize {
    // `… x 3 rounds`
    header
        .split_whitespace()
        .collect::<Vec<_>>()
        .windows(2)
        .find(|w| w[1] == "rounds")
        .and_then(|w| w[0].parse().ok())
        .unwrap_or(0)
}

fn ingest_overhead(logs: &[String]) -> Result<(), BoxError> {
    let mut csv = Csv::new("overhead");
    for log in logs {
        let text = std::fs::read_to_string(log).map_err(|e| format!("{log}: {e}"))?;
        let (mut table, mut rounds, mut sql) = (None::<String>, 0, false);
        for line in text.lines() {
            if line.contains("(loopback)") {
                let server = line.split(" (loopback)").next().unwrap_or_default();
                sql = !line.contains(", body `");
                table = Some(if sql {
                    server.trim_start_matches("MySQL/").to_owned()
                } else {
                    let body = line
                        .split('`')
                        .nth(1)
                        .ok_or_else(|| format!("{log}: no body in {line}"))?;
                    format!("{server} · {body}")
                });
                rounds = rounds_of(line);
                // A later log's table replaces an earlier one's.
                if let Some(t) = table.as_deref() {
                    csv.drop_table(t);
                }
                continue;
            }
            let Some(t) = table.as_deref() else { continue };
            if let Some(rest) = line.trim_start().strip_prefix("(b) / (f) = ") {
                // `1.03 [0.99-1.31] (median of rounds 1.03); (f) / (c) …`
                let mut w = rest.split_whitespace();
                let (Some(v), Some(s)) = (w.next(), w.next()) else {
                    continue;
                };
                if let Some((r, sp)) = ratio_and_spread(v, s) {
                    // The c of the row just above: the last `(f)` row's.
                    let c = last_c(&csv, t);
                    csv.row(t, "idem ÷ floor", &c, r, Some(sp), "ratio", rounds);
                }
                continue;
            }
            let Some(row) = overhead_row(line) else {
                continue;
            };
            let c = row.c.as_str();
            let name = match (sql, row.side) {
                (false, 'a') => "body alone",
                (false, 'b') => "idem",
                (false, 'c') => "reference",
                (false, 'f') => "floor",
                (true, 'a') => "bare tx",
                (true, 'r') => "same-tx reference",
                (true, 'b') => "tx = tx",
                (true, 's') => "separate-table reference",
                (true, 'p') => "#[idempotent]",
                _ => continue,
            };
            csv.row(
                t,
                &format!("{name} calls/s"),
                c,
                row.calls,
                None,
                "calls/s",
                rounds,
            );
            csv.row(
                t,
                &format!("{name} client CPU"),
                c,
                row.client_us,
                None,
                "µs/call",
                rounds,
            );
            if let Some(us) = row.server_us {
                csv.row(
                    t,
                    &format!("{name} server CPU"),
                    c,
                    us,
                    None,
                    "µs/call",
                    rounds,
                );
            }
            let per_call = if sql { "statements" } else { "round trips" };
            csv.row(
                t,
                &format!("{name} {per_call}"),
                c,
                row.per_call,
                None,
                per_call,
                rounds,
            );
            if row.side != 'a' {
                let series = format!("{name} ÷ {}", if sql { "bare tx" } else { "body alone" });
                csv.row(t, &series, c, row.vs_base, None, "ratio", rounds);
            }
            if let Some((r, sp)) = row.vs_ref {
                let series = match (sql, row.side) {
                    (false, 'b') => "idem ÷ reference",
                    (false, _) => "floor ÷ reference",
                    (true, 'b') => "tx = tx ÷ same-tx reference",
                    (true, _) => "#[idempotent] ÷ separate-table reference",
                };
                csv.row(t, series, c, r, Some(sp), "ratio", rounds);
            }
        }
    }
    csv.write();
    Ok(())
}

/// The concurrency of the last row recorded for `table`.
fn last_c(csv: &Csv, table: &str) -> String {
    csv.last_x(table).unwrap_or_default()
}

fn main() -> Result<(), BoxError> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("overhead") => ingest_overhead(&args[1..])?,
        Some(other) => {
            return Err(format!(
                "unknown argument {other:?}: none (draw the charts) or `overhead LOG…`"
            )
            .into());
        }
        None => {}
    }
    let data_dir = figures::data_dir();
    let out = std::env::var_os("IDEM_BENCH_CHARTS_DIR").map_or_else(
        || data_dir.parent().unwrap_or(&data_dir).to_path_buf(),
        PathBuf::from,
    );
    let data = Data::load(&data_dir)?;
    let charts = [
        overhead_redis(&data, "overhead-redis.svg", "Redis", None),
        overhead_redis(
            &data,
            "overhead-valkey.svg",
            "Valkey",
            Some([1.3, 1.3, 1.2]),
        ),
        overhead_sql(&data),
        http(&data),
        consumers(&data),
        outbox_write(&data),
        outbox_relay(&data),
        hot_path(&data),
    ];
    for chart in charts.into_iter().flatten() {
        if render(&chart, &out)? {
            println!("{}", out.join(chart.file).display());
        }
    }
    Ok(())
}
