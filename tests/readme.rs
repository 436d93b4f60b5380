//! Every ```rust block of the Markdown files at the root (README.md,
//! ARCHITECTURE.md, BENCHMARKS.md, CHANGELOG.md) is code CI compiles, and
//! every page of the guide (`idem-runtime/guide/*.md`) is a module doc that
//! rustdoc compiles.
//!
//! A block passes when its lines appear, in order and contiguous, in one
//! compiled place:
//!
//! - a rustdoc code block in `idem-runtime/src` or `idem-macros/src` that
//!   rustdoc compiles (a bare fence, or only `rust`, `no_run`,
//!   `should_panic`, `test_harness`, `editionNNNN`; not `ignore`, `text`,
//!   `compile_fail`), read without its `///` / `//!` and one following
//!   space. Its hidden lines (`# …`) may sit between the block's lines and
//!   are skipped;
//! - any run of lines in `examples/`, `tests/` (not this file, not
//!   `tests/ui/fail/`, which must not compile) or `idem-cli/src`.
//!
//! Lines are compared with leading and trailing whitespace trimmed, and blank
//! lines are ignored on both sides. A block that cannot be compiled is kept
//! only under `<!-- not compiled: <reason> -->` on the line before its fence;
//! the test lists those blocks on stderr.

use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};

/// The Markdown files at the root whose ```rust blocks must be compiled code.
const MARKDOWN: [&str; 4] = [
    "README.md",
    "ARCHITECTURE.md",
    "BENCHMARKS.md",
    "CHANGELOG.md",
];

/// A ```rust block of a Markdown file.
struct Block {
    /// The file it is in, relative to the root.
    file: &'static str,
    /// 1-based line of the opening fence.
    fence_line: usize,
    /// The block's non-blank lines, trimmed, with their README line numbers.
    lines: Vec<(usize, String)>,
    /// `Some(reason)` under a `not compiled` marker.
    not_compiled: Option<String>,
}

/// A non-blank line of a source, trimmed: (file line, text, hidden).
type Line = (usize, String, bool);

/// A sequence of lines a block may match: one rustdoc code block, or a whole
/// source file.
struct Unit {
    file: PathBuf,
    lines: Vec<Line>,
}

const MARKER: &str = "<!-- not compiled";

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent")
        .to_path_buf()
}

fn is_fence(line: &str) -> Option<&str> {
    line.trim_start().strip_prefix("```")
}

/// A Markdown file's ```rust blocks, and the errors of its markers.
fn markdown_blocks(file: &'static str, text: &str) -> (Vec<Block>, Vec<String>) {
    let mut blocks = Vec::new();
    let mut errors = Vec::new();
    let lines: Vec<&str> = text.lines().collect();
    let mut i = 0;
    while i < lines.len() {
        let Some(info) = is_fence(lines[i]) else {
            if lines[i].trim_start().starts_with(MARKER)
                && !lines
                    .get(i + 1)
                    .and_then(|l| is_fence(l))
                    .is_some_and(is_rust)
            {
                errors.push(format!(
                    "{file}:{}: a `not compiled` marker must sit on the line right before a ```rust fence",
                    i + 1
                ));
            }
            i += 1;
            continue;
        };
        let fence_line = i + 1;
        let rust = is_rust(info);
        let mut body = Vec::new();
        i += 1;
        while i < lines.len() && is_fence(lines[i]).is_none_or(|rest| !rest.trim().is_empty()) {
            let t = lines[i].trim();
            if !t.is_empty() {
                body.push((i + 1, t.to_owned()));
            }
            i += 1;
        }
        i += 1; // the closing fence
        if !rust {
            continue;
        }
        let not_compiled = match fence_line.checked_sub(2).map(|p| lines[p].trim()) {
            Some(prev) if prev.starts_with(MARKER) => match parse_marker(prev) {
                Some(reason) => Some(reason),
                None => {
                    errors.push(format!(
                        "{file}:{}: write the marker as `<!-- not compiled: <reason> -->`, with a reason",
                        fence_line - 1
                    ));
                    Some(String::new())
                }
            },
            _ => None,
        };
        blocks.push(Block {
            file,
            fence_line,
            lines: body,
            not_compiled,
        });
    }
    (blocks, errors)
}

fn is_rust(info: &str) -> bool {
    info.split([',', ' ', '\t']).next() == Some("rust")
}

/// The reason of `<!-- not compiled: <reason> -->`, if it has one.
fn parse_marker(line: &str) -> Option<String> {
    let rest = line.strip_prefix(MARKER)?.strip_prefix(':')?;
    let reason = rest.trim_end().strip_suffix("-->")?.trim();
    (!reason.is_empty()).then(|| reason.to_owned())
}

/// Whether rustdoc compiles a doc code block with this info string.
fn rustdoc_compiles(info: &str) -> bool {
    info.split([',', ' ', '\t'])
        .filter(|t| !t.is_empty())
        .all(|t| {
            matches!(t, "rust" | "no_run" | "should_panic" | "test_harness")
                || t.starts_with("edition")
        })
}

fn rs_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    let mut entries: Vec<_> = entries.map(|e| e.expect("read_dir").path()).collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            if path.file_name().is_some_and(|n| n == "target") {
                continue;
            }
            rs_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The compiled rustdoc code blocks of one file.
fn rustdoc_units(file: &Path, text: &str) -> Vec<Unit> {
    let mut units = Vec::new();
    // Some(compiled) while inside a doc code block.
    let mut open: Option<(bool, Vec<Line>)> = None;
    for (n, raw) in text.lines().enumerate() {
        let t = raw.trim_start();
        let doc = if t.starts_with("///") && !t.starts_with("////") {
            Some(&t[3..])
        } else {
            t.strip_prefix("//!")
        };
        let Some(doc) = doc else {
            // The doc comment ended: an unclosed block ends with it.
            if let Some((true, lines)) = open.take() {
                units.push(Unit {
                    file: file.to_path_buf(),
                    lines,
                });
            }
            continue;
        };
        let doc = doc.strip_prefix(' ').unwrap_or(doc);
        if let Some(info) = is_fence(doc) {
            match open.take() {
                Some((compiled, lines)) => {
                    if compiled {
                        units.push(Unit {
                            file: file.to_path_buf(),
                            lines,
                        });
                    }
                }
                None => open = Some((rustdoc_compiles(info.trim()), Vec::new())),
            }
            continue;
        }
        if let Some((_, lines)) = open.as_mut() {
            let code = doc.trim();
            if code.is_empty() {
                continue;
            }
            let hidden = code == "#" || code.starts_with("# ");
            lines.push((n + 1, code.to_owned(), hidden));
        }
    }
    if let Some((true, lines)) = open {
        units.push(Unit {
            file: file.to_path_buf(),
            lines,
        });
    }
    units
}

fn source_unit(file: &Path, text: &str) -> Unit {
    Unit {
        file: file.to_path_buf(),
        lines: text
            .lines()
            .enumerate()
            .filter(|(_, l)| !l.trim().is_empty())
            .map(|(n, l)| (n + 1, l.trim().to_owned(), false))
            .collect(),
    }
}

fn units(root: &Path) -> Vec<Unit> {
    let mut units = Vec::new();
    for dir in ["idem-runtime/src", "idem-macros/src"] {
        let mut files = Vec::new();
        rs_files(&root.join(dir), &mut files);
        for f in files {
            let text = fs::read_to_string(&f).expect("read a source file");
            units.extend(rustdoc_units(&f, &text));
        }
    }
    // The guide's pages are module docs (the test below checks that each is
    // included): rustdoc compiles their blocks as it does `//!` ones.
    if let Ok(pages) = fs::read_dir(root.join("idem-runtime/guide")) {
        let mut pages: Vec<PathBuf> = pages.map(|e| e.expect("read_dir").path()).collect();
        pages.sort();
        for page in pages
            .into_iter()
            .filter(|p| p.extension().is_some_and(|e| e == "md"))
        {
            let text = fs::read_to_string(&page).expect("read a guide page");
            let as_doc: String = text.lines().map(|l| format!("//! {l}\n")).collect();
            units.extend(rustdoc_units(&page, &as_doc));
        }
    }
    let this = root.join("tests/readme.rs");
    let must_not_compile = root.join("tests/ui/fail");
    for dir in ["examples", "tests", "idem-cli/src"] {
        let mut files = Vec::new();
        rs_files(&root.join(dir), &mut files);
        for f in files {
            if f == this || f.starts_with(&must_not_compile) {
                continue;
            }
            let text = fs::read_to_string(&f).expect("read a source file");
            units.push(source_unit(&f, &text));
        }
    }
    units
}

/// How many of `want`'s lines match from `unit.lines[start]` on, and the
/// index in the unit where matching stopped.
fn match_len(want: &[(usize, String)], unit: &Unit, start: usize) -> (usize, usize) {
    let mut u = start;
    let mut matched = 0;
    for (k, (_, line)) in want.iter().enumerate() {
        // Hidden lines may sit between the block's lines, not before its first.
        if k > 0 {
            while u < unit.lines.len() && unit.lines[u].2 {
                u += 1;
            }
        }
        match unit.lines.get(u) {
            Some((_, text, false)) if text == line => {
                matched += 1;
                u += 1;
            }
            _ => break,
        }
    }
    (matched, u)
}

struct Best<'a> {
    unit: &'a Unit,
    start: usize,
    stop: usize,
    len: usize,
}

/// The longest run of `want` (from its start) found anywhere.
fn best_match<'a>(want: &[(usize, String)], units: &'a [Unit]) -> Option<Best<'a>> {
    let mut best: Option<Best> = None;
    for unit in units {
        for start in 0..unit.lines.len() {
            let (len, stop) = match_len(want, unit, start);
            if len > 0 && best.as_ref().is_none_or(|b| len > b.len) {
                best = Some(Best {
                    unit,
                    start,
                    stop,
                    len,
                });
                if len == want.len() {
                    return best;
                }
            }
        }
    }
    best
}

fn rel<'a>(root: &Path, p: &'a Path) -> std::borrow::Cow<'a, str> {
    p.strip_prefix(root).unwrap_or(p).to_string_lossy()
}

/// Why a block matches nowhere, or `None` when it matches.
fn check(root: &Path, block: &Block, units: &[Unit]) -> Option<String> {
    let want = &block.lines;
    let file = block.file;
    if want.is_empty() {
        return Some(format!(
            "{file}:{}: an empty ```rust block",
            block.fence_line
        ));
    }
    let best = best_match(want, units);
    if best.as_ref().is_some_and(|b| b.len == want.len()) {
        return None;
    }
    let mut msg = format!(
        "{file}:{}: the ```rust block is in no compiled place.\n",
        block.fence_line
    );
    match best {
        None => {
            let (n, line) = &want[0];
            let _ = writeln!(msg, "  its first line matches nowhere: {file}:{n}: {line}");
            // Where does the longest run of its later lines sit?
            // Runs of one line (a lone `}`) say nothing.
            if let Some((from, b)) = (1..want.len())
                .filter_map(|k| best_match(&want[k..], units).map(|b| (k, b)))
                .filter(|(_, b)| b.len > 1)
                .max_by_key(|(_, b)| b.len)
            {
                let (n, _) = want[from];
                let at = b.unit.lines[b.start].0;
                let _ = writeln!(
                    msg,
                    "  the longest run of its lines ({file}:{n}, {} lines) is at {}:{at}",
                    b.len,
                    rel(root, &b.unit.file),
                );
            }
        }
        Some(b) => {
            let (n, line) = &want[b.len];
            let at = b.unit.lines[b.start].0;
            let _ = writeln!(
                msg,
                "  first line not matched: {file}:{n}: {line}\n  closest: {} lines match at {}:{at}",
                b.len,
                rel(root, &b.unit.file),
            );
            match b.unit.lines.get(b.stop) {
                Some((m, text, _)) => {
                    let _ = writeln!(msg, "  where {}:{m} has: {text}", rel(root, &b.unit.file));
                }
                None => {
                    let _ = writeln!(msg, "  where that code block ends");
                }
            }
        }
    }
    Some(msg)
}

#[test]
fn every_rust_block_of_the_markdown_files_is_compiled() {
    let root = root();
    let units = units(&root);
    assert!(
        units
            .iter()
            .any(|u| u.file.starts_with(root.join("idem-runtime"))),
        "no rustdoc code block found under idem-runtime/src"
    );
    let mut errors = Vec::new();
    let mut readme_blocks = 0;
    for file in MARKDOWN {
        let text =
            fs::read_to_string(root.join(file)).unwrap_or_else(|e| panic!("read {file}: {e}"));
        let (blocks, marker_errors) = markdown_blocks(file, &text);
        errors.extend(marker_errors);
        if file == "README.md" {
            readme_blocks = blocks.len();
        }
        let mut skipped = Vec::new();
        for block in &blocks {
            match &block.not_compiled {
                Some(reason) => skipped.push((block.fence_line, reason.clone())),
                None => errors.extend(check(&root, block, &units)),
            }
        }
        eprintln!(
            "{file}: {} ```rust blocks, {} compiled, {} marked not compiled",
            blocks.len(),
            blocks.len() - skipped.len(),
            skipped.len()
        );
        for (line, reason) in &skipped {
            let reason = if reason.is_empty() {
                "(no reason)"
            } else {
                reason
            };
            eprintln!("  not compiled: {file}:{line}: {reason}");
        }
    }
    assert!(readme_blocks > 0, "README.md has no ```rust block");
    assert!(errors.is_empty(), "\n{}", errors.join("\n"));
}

/// The code blocks of a guide page: (line of the fence, its info string).
fn guide_fences(text: &str) -> Vec<(usize, String)> {
    let mut fences = Vec::new();
    let mut open = false;
    for (n, line) in text.lines().enumerate() {
        if let Some(info) = is_fence(line) {
            if !open {
                fences.push((n + 1, info.trim().to_owned()));
            }
            open = !open;
        }
    }
    fences
}

/// Whether rustdoc treats a block with this info string as Rust.
fn rustdoc_reads_as_rust(info: &str) -> bool {
    info.split([',', ' ', '\t'])
        .filter(|t| !t.is_empty())
        .all(|t| {
            matches!(
                t,
                "rust" | "no_run" | "should_panic" | "test_harness" | "ignore" | "compile_fail"
            ) || t.starts_with("edition")
        })
}

#[test]
fn every_guide_page_is_a_module_doc_whose_examples_rustdoc_compiles() {
    let root = root();
    let mut sources = String::new();
    let mut files = Vec::new();
    rs_files(&root.join("idem-runtime/src"), &mut files);
    for f in files {
        sources.push_str(&fs::read_to_string(&f).expect("read a source file"));
    }
    let mut pages: Vec<PathBuf> = fs::read_dir(root.join("idem-runtime/guide"))
        .expect("idem-runtime/guide")
        .map(|e| e.expect("read_dir").path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    pages.sort();
    assert!(!pages.is_empty(), "idem-runtime/guide has no page");
    let mut errors = Vec::new();
    for page in &pages {
        let name = page.file_name().expect("a file name").to_string_lossy();
        let shown = rel(&root, page);
        if !sources.contains(&format!("include_str!(\"../guide/{name}\")")) {
            errors.push(format!(
                "{shown}: no `include_str!(\"../guide/{name}\")` in idem-runtime/src: rustdoc never sees it"
            ));
        }
        let text = fs::read_to_string(page).expect("read a guide page");
        let fences = guide_fences(&text);
        let mut compiled = 0;
        for (line, info) in &fences {
            if !rustdoc_reads_as_rust(info) {
                continue;
            }
            if rustdoc_compiles(info) {
                compiled += 1;
            } else {
                errors.push(format!(
                    "{shown}:{line}: a ```{info} block: rustdoc does not compile it; make it compile, or make it `text`"
                ));
            }
        }
        if compiled == 0 {
            errors.push(format!("{shown}: no compiled example"));
        }
    }
    eprintln!("idem-runtime/guide: {} pages", pages.len());
    assert!(errors.is_empty(), "\n{}", errors.join("\n"));
}

#[test]
fn the_checker_sees_hidden_lines_and_refuses_ignored_blocks() {
    let doc = "\
/// ```
/// let a = 1;
/// # let hidden = 2;
///
/// let b = a;
/// ```
/// ```ignore
/// let c = 3;
/// ```
/// ```text
/// let d = 4;
/// ```
/// ```no_run
/// let e = 5;
/// ```
fn f() {}
";
    let units = rustdoc_units(Path::new("x.rs"), doc);
    assert_eq!(units.len(), 2, "the ignore and text blocks do not count");
    let block = |lines: &[&str]| Block {
        file: "README.md",
        fence_line: 1,
        lines: lines
            .iter()
            .enumerate()
            .map(|(n, l)| (n + 1, (*l).to_owned()))
            .collect(),
        not_compiled: None,
    };
    let root = Path::new("");
    assert!(check(root, &block(&["let a = 1;", "let b = a;"]), &units).is_none());
    assert!(check(root, &block(&["let e = 5;"]), &units).is_none());
    let err = check(root, &block(&["let a = 1;", "let c = 3;"]), &units).unwrap();
    assert!(err.contains("README.md:2: let c = 3;"), "{err}");
    assert!(err.contains("x.rs:2"), "{err}");
    assert!(check(root, &block(&["let c = 3;"]), &units).is_some());
    assert!(check(root, &block(&["let hidden = 2;"]), &units).is_some());

    let (blocks, errors) = markdown_blocks(
        "README.md",
        "<!-- not compiled: a sketch -->\n```rust\nx\n```\n<!-- not compiled -->\n```rust\ny\n```\n",
    );
    assert_eq!(blocks.len(), 2);
    assert_eq!(blocks[0].not_compiled.as_deref(), Some("a sketch"));
    assert_eq!(errors.len(), 1, "{errors:?}");
}
