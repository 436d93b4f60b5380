//! A bench's figures as rows of `benchmarks/data/<bench>.csv`, the data the
//! charts of BENCHMARKS.md are drawn from (`cargo run -p idem-benches --bin
//! charts`). Included with `#[path]` by each bench and by the charts
//! program; standard library only.

#![allow(dead_code)] // each includer uses what it needs

use std::path::Path;

/// A run's figures, merged into `benchmarks/data/<bench>.csv` by
/// [`Csv::write`].
///
/// Columns: `table,series,x,value,low,high,unit,rounds,date`: one figure
/// (`value`, a median) of one series of one table at one point `x` (a
/// concurrency, a broker, a batch), with the spread of its rounds (`low`,
/// `high`, empty where there is none), its unit (`ratio`, `msg/s`, `ns`, …)
/// and the UTC date of the run. Writing replaces the rows of every table
/// this run measured and keeps the others, so a run of one part
/// (`IDEM_BENCH_ONLY=…`) leaves the other parts' figures as they were.
/// `IDEM_BENCH_CSV=off` writes nothing (quick runs); `IDEM_BENCH_CSV_DIR`
/// puts the file elsewhere.
pub struct Csv {
    bench: &'static str,
    rows: Vec<[String; 9]>,
}

/// The header line of every bench's CSV.
pub const CSV_HEADER: &str = "table,series,x,value,low,high,unit,rounds,date";

impl Csv {
    pub fn new(bench: &'static str) -> Csv {
        Csv {
            bench,
            rows: Vec::new(),
        }
    }

    /// One figure: `value` with the spread `(low, high)` of its `rounds`.
    #[allow(clippy::too_many_arguments)]
    pub fn row(
        &mut self,
        table: &str,
        series: &str,
        x: &str,
        value: f64,
        spread: Option<(f64, f64)>,
        unit: &str,
        rounds: usize,
    ) {
        let num = |v: f64| {
            if v.is_finite() {
                format!("{v:.4}")
            } else {
                String::new()
            }
        };
        let (low, high) = spread.map_or((String::new(), String::new()), |(l, h)| (num(l), num(h)));
        self.rows.push([
            table.to_owned(),
            series.to_owned(),
            x.to_owned(),
            num(value),
            low,
            high,
            unit.to_owned(),
            rounds.to_string(),
            today(),
        ]);
    }

    /// Forgets the rows of `table` recorded so far (a later run of it
    /// replaces them).
    pub fn drop_table(&mut self, table: &str) {
        self.rows.retain(|r| r[0] != table);
    }

    /// The `x` of the last row of `table` recorded so far.
    pub fn last_x(&self, table: &str) -> Option<String> {
        self.rows
            .iter()
            .rev()
            .find(|r| r[0] == table)
            .map(|r| r[2].clone())
    }

    /// Merges this run's rows into the bench's file (see [`Csv`]).
    pub fn write(self) {
        if self.rows.is_empty() || std::env::var("IDEM_BENCH_CSV").is_ok_and(|v| v == "off") {
            return;
        }
        let path = data_dir().join(format!("{}.csv", self.bench));
        match merge_csv(&path, self.rows) {
            Ok(n) => println!("{n} figures in {}", path.display()),
            Err(e) => eprintln!("could not write {}: {e}", path.display()),
        }
    }
}

/// `IDEM_BENCH_CSV_DIR`, else `benchmarks/data` in the workspace's root (the
/// nearest directory above the including package that holds `Cargo.lock`).
pub fn data_dir() -> std::path::PathBuf {
    if let Some(dir) = std::env::var_os("IDEM_BENCH_CSV_DIR") {
        return dir.into();
    }
    let package = Path::new(env!("CARGO_MANIFEST_DIR"));
    let root = package
        .ancestors()
        .find(|d| d.join("Cargo.lock").is_file())
        .unwrap_or(package);
    root.join("benchmarks/data")
}

/// Writes `rows` into the CSV at `path`, replacing the rows of every table
/// they name; returns how many rows the file holds.
pub fn merge_csv(path: &Path, rows: Vec<[String; 9]>) -> std::io::Result<usize> {
    let measured: std::collections::BTreeSet<&str> = rows.iter().map(|r| r[0].as_str()).collect();
    let old = std::fs::read_to_string(path).unwrap_or_default();
    let mut out = String::from(CSV_HEADER);
    out.push('\n');
    let mut n = 0;
    for line in old.lines().skip(1).filter(|l| !l.trim().is_empty()) {
        let table = csv_fields(line).into_iter().next().unwrap_or_default();
        if !measured.contains(table.as_str()) {
            out.push_str(line);
            out.push('\n');
            n += 1;
        }
    }
    for row in &rows {
        let fields: Vec<String> = row.iter().map(|f| csv_quote(f)).collect();
        out.push_str(&fields.join(","));
        out.push('\n');
        n += 1;
    }
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)?;
    }
    std::fs::write(path, out)?;
    Ok(n)
}

/// A field quoted when it holds a comma or a quote (RFC 4180).
pub fn csv_quote(field: &str) -> String {
    if field.contains([',', '"', '\n']) {
        format!("\"{}\"", field.replace('"', "\"\""))
    } else {
        field.to_owned()
    }
}

/// The fields of one CSV line (RFC 4180 quoting, no line breaks in fields).
pub fn csv_fields(line: &str) -> Vec<String> {
    let (mut fields, mut field, mut quoted) = (Vec::new(), String::new(), false);
    let mut chars = line.chars().peekable();
    while let Some(ch) = chars.next() {
        match (ch, quoted) {
            ('"', true) if chars.peek() == Some(&'"') => {
                field.push('"');
                chars.next();
            }
            ('"', _) => quoted = !quoted,
            (',', false) => fields.push(std::mem::take(&mut field)),
            _ => field.push(ch),
        }
    }
    fields.push(field);
    fields
}

/// Today's UTC date, `YYYY-MM-DD` (the civil-from-days algorithm).
pub fn today() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let z = (secs / 86_400) as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}")
}
