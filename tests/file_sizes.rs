//! The size rule for library files (issue 33): a file of `idem-runtime/src`,
//! `idem-macros/src` or `idem-cli/src` is one concern, found by its name.
//!
//! - No file is over 800 lines.
//! - No file is over 600 lines unless its first lines, a plain `//` comment
//!   above everything else, say why it is long: a line starting with
//!   `// Over 600 lines:` and the reason after the colon.
//!
//! A file's length is its lines before the first line that starts with
//! `#[cfg(test)]` (unit tests at the bottom of a file do not count).

use std::path::{Path, PathBuf};

/// The library sources the rule covers, from the workspace's root.
const SOURCES: [&str; 3] = ["idem-runtime/src", "idem-macros/src", "idem-cli/src"];
/// Over this, a file must be split.
const MAX_LINES: usize = 800;
/// Over this, a file says at its top why it is long.
const EXPLAINED_OVER: usize = 600;
/// How the line that says why starts.
const WHY: &str = "// Over 600 lines:";

/// The lines the rule counts: those before the first `#[cfg(test)]` line.
fn counted_lines(text: &str) -> usize {
    text.lines()
        .take_while(|line| !line.starts_with("#[cfg(test)]"))
        .count()
}

/// Whether the file's leading plain comments say why it is long.
fn says_why(text: &str) -> bool {
    text.lines()
        .take_while(|line| {
            line.starts_with("//") && !line.starts_with("//!") && !line.starts_with("///")
        })
        .any(|line| {
            line.strip_prefix(WHY)
                .is_some_and(|why| !why.trim().is_empty())
        })
}

/// What is wrong with a file of this text, if anything.
fn problem(text: &str) -> Option<String> {
    let lines = counted_lines(text);
    if lines > MAX_LINES {
        Some(format!(
            "{lines} lines, over {MAX_LINES}: split it along its concerns"
        ))
    } else if lines > EXPLAINED_OVER && !says_why(text) {
        Some(format!(
            "{lines} lines, over {EXPLAINED_OVER} with no `{WHY} <why>` line at its top: \
             split it, or say why it is one concern"
        ))
    } else {
        None
    }
}

fn rust_files(dir: &Path, found: &mut Vec<PathBuf>) {
    let entries = std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    for entry in entries {
        let path = entry.expect("a directory entry").path();
        if path.is_dir() {
            rust_files(&path, found);
        } else if path.extension().is_some_and(|ext| ext == "rs") {
            found.push(path);
        }
    }
}

#[test]
fn library_files_stay_within_the_size_rule() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the tests crate is in the workspace");
    let mut files = Vec::new();
    for dir in SOURCES {
        rust_files(&root.join(dir), &mut files);
    }
    files.sort();
    assert!(files.len() > 100, "only {} files found", files.len());
    let wrong: Vec<String> = files
        .iter()
        .filter_map(|path| {
            let text =
                std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            let why = problem(&text)?;
            let name = path.strip_prefix(root).unwrap_or(path);
            Some(format!("{}: {why}", name.display()))
        })
        .collect();
    assert!(
        wrong.is_empty(),
        "library files over the size rule:\n{}",
        wrong.join("\n")
    );
}

#[test]
fn the_rule_counts_up_to_the_tests_and_reads_the_why_line() {
    let body = |n: usize| "fn f() {}\n".repeat(n);
    assert_eq!(problem(&body(600)), None);
    assert!(problem(&body(601)).is_some_and(|p| p.starts_with("601 lines, over 600")));
    // Unit tests at the bottom do not count.
    assert_eq!(
        problem(&format!("{}#[cfg(test)]\n{}", body(600), body(500))),
        None
    );
    // Indented, it is not the tests module of the file.
    assert!(problem(&format!("{}    #[cfg(test)]\n{}", body(600), body(1))).is_some());
    let why = "// Over 600 lines: one state machine, read top to bottom.\n";
    assert_eq!(problem(&format!("{why}//! Docs.\n{}", body(700))), None);
    // Below the module docs, or saying nothing, it is no why-line.
    assert!(problem(&format!("//! Docs.\n{why}{}", body(700))).is_some());
    assert!(problem(&format!("// Over 600 lines:\n{}", body(700))).is_some());
    // Past 800 no line excuses it.
    assert!(problem(&format!("{why}{}", body(801))).is_some_and(|p| p.contains("over 800")));
}
