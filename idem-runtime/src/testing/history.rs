//! Step history snapshots: a flow in flight resumes by its steps' names and
//! order, so a deploy that renames, reorders or removes a step makes the
//! flows in flight across it run a step twice or skip one. The clean run's
//! steps, in order, go to a file the user commits; a later build whose
//! sequence differs fails, naming the change, until the file is accepted on
//! purpose.

use std::path::Path;

/// The environment variable that accepts a changed history (any value but
/// `0`), as `TRYBUILD=overwrite` and `INSTA_UPDATE` do.
pub const ACCEPT_ENV: &str = "IDEM_ACCEPT_STEPS";

/// The steps of the clean run, in the order they were first claimed, from
/// the first caller's store operations ("claim step `name`"). A step run
/// again in a loop is listed again with its occurrence (`name #2`).
pub(super) fn of(ops: &[String]) -> Vec<String> {
    let mut seen: Vec<(String, usize)> = Vec::new();
    let mut steps = Vec::new();
    for op in ops {
        let Some(rest) = op.strip_prefix("claim step `") else {
            continue;
        };
        let Some(end) = rest.find('`') else { continue };
        let name = &rest[..end];
        let n = match seen.iter_mut().find(|(s, _)| s == name) {
            Some((_, n)) => {
                *n += 1;
                *n
            }
            None => {
                seen.push((name.to_owned(), 1));
                1
            }
        };
        steps.push(if n == 1 {
            name.to_owned()
        } else {
            format!("{name} #{n}")
        });
    }
    steps
}

/// Compares `now` with the history in `path`: `Ok(note)` when they agree
/// (or the file was written: a first run, or `accept`), `Err(problem)`
/// naming what changed otherwise.
pub(super) fn check(
    path: &Path,
    scope: &str,
    now: &[String],
    accept: bool,
) -> Result<String, String> {
    let text = render(scope, now);
    let old = match std::fs::read_to_string(path) {
        Ok(old) => old,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            if std::env::var_os("CI").is_some() && !accept {
                return Err(format!(
                    "no step history at {}: run the test once outside CI (or with {ACCEPT_ENV}=1) and commit the file",
                    path.display()
                ));
            }
            write(path, &text)?;
            return Ok(format!("wrote the step history to {}", path.display()));
        }
        Err(e) => return Err(format!("reading {}: {e}", path.display())),
    };
    let before = parse(&old);
    if before == now {
        return Ok(format!("the step history in {} holds", path.display()));
    }
    if accept {
        write(path, &text)?;
        return Ok(format!(
            "accepted the new step history in {}",
            path.display()
        ));
    }
    Err(format!(
        "the steps changed since {} was written: {}. A flow in flight across this deploy resumes by step names and order: {}. If that is safe (no flow of the old build can be in flight, or the change was made to be resumable), accept it with {ACCEPT_ENV}=1 and commit the file.\n  before: {}\n  now:    {}",
        path.display(),
        change(&before, now),
        consequence(&before, now),
        before.join(", "),
        now.join(", ")
    ))
}

fn render(scope: &str, steps: &[String]) -> String {
    let mut text = format!(
        "# The steps of `{scope}` in the order a flow runs them (idem_runtime::testing).\n\
         # A flow in flight resumes by these names: change them with care, and accept\n\
         # a new order with {ACCEPT_ENV}=1.\n"
    );
    for step in steps {
        text.push_str(step);
        text.push('\n');
    }
    text
}

fn parse(text: &str) -> Vec<String> {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(str::to_owned)
        .collect()
}

fn write(path: &Path, text: &str) -> Result<(), String> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    }
    std::fs::write(path, text).map_err(|e| format!("writing {}: {e}", path.display()))
}

/// What changed, naming the steps.
fn change(before: &[String], now: &[String]) -> String {
    let gone: Vec<&String> = before.iter().filter(|s| !now.contains(s)).collect();
    let new: Vec<&String> = now.iter().filter(|s| !before.contains(s)).collect();
    let names = |v: &[&String]| {
        v.iter()
            .map(|s| format!("`{s}`"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    match (gone.as_slice(), new.as_slice()) {
        ([], []) => {
            let moved: Vec<&String> = before
                .iter()
                .zip(now)
                .filter(|(a, b)| a != b)
                .map(|(a, _)| a)
                .collect();
            format!("the steps {} run in another order", names(&moved))
        }
        ([old], [renamed]) if before.len() == now.len() => {
            format!("step `{old}` is now `{renamed}` (renamed)")
        }
        (gone, []) => format!("step {} removed", names(gone)),
        ([], new) => format!("step {} added", names(new)),
        (gone, new) => format!("step {} removed and {} added", names(gone), names(new)),
    }
}

fn consequence(before: &[String], now: &[String]) -> &'static str {
    let gone = before.iter().any(|s| !now.contains(s));
    let new = now.iter().any(|s| !before.contains(s));
    match (gone, new) {
        (false, false) => {
            "a flow that finished a step moved later runs it again, or skips one moved earlier"
        }
        (true, true) => {
            "a flow that finished the old step runs the new one as well (a renamed step runs twice)"
        }
        (true, false) => {
            "a flow that finished a removed step keeps its effect, and nothing undoes it"
        }
        (false, true) => "a flow that had passed the new step's place finishes without running it",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(s: &[&str]) -> Vec<String> {
        s.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn the_steps_come_from_the_claims_in_order_with_repeats_numbered() {
        let ops = v(&[
            "claim call `orders.create`",
            "claim step `reserve`",
            "record the outcome of step `reserve`",
            "claim step `line`",
            "claim step `line`",
            "record the outcome of call `orders.create`",
        ]);
        assert_eq!(of(&ops), v(&["reserve", "line", "line #2"]));
    }

    #[test]
    fn each_change_is_named() {
        let before = v(&["reserve", "pay", "ship"]);
        assert_eq!(
            change(&before, &v(&["reserve", "charge", "ship"])),
            "step `pay` is now `charge` (renamed)"
        );
        assert_eq!(
            change(&before, &v(&["pay", "reserve", "ship"])),
            "the steps `reserve`, `pay` run in another order"
        );
        assert_eq!(
            change(&before, &v(&["reserve", "ship"])),
            "step `pay` removed"
        );
        assert_eq!(
            change(&before, &v(&["reserve", "pay", "ship", "notify"])),
            "step `notify` added"
        );
    }
}
