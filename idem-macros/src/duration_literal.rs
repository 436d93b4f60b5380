//! Duration literals of the DSL: `500ms`, `30s`, `15m`, `24h`, `7d`.

pub(crate) const HELP: &str =
    "write a whole number and one unit: `500ms`, `30s`, `15m`, `24h` or `7d`";

/// Milliseconds, or `None` when the text is not a duration of the DSL.
pub(crate) fn parse_millis(text: &str) -> Option<u64> {
    let text = text.trim();
    let split = text.find(|c: char| !c.is_ascii_digit())?;
    let (digits, unit) = text.split_at(split);
    if digits.is_empty() {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    let scale: u64 = match unit.trim() {
        "ms" => 1,
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        _ => return None,
    };
    n.checked_mul(scale)
}

/// A duration as the user would write it, for messages.
pub(crate) fn display(ms: u64) -> String {
    const UNITS: [(u64, &str); 5] = [
        (86_400_000, "d"),
        (3_600_000, "h"),
        (60_000, "m"),
        (1_000, "s"),
        (1, "ms"),
    ];
    if ms == 0 {
        return "0s".into();
    }
    let (scale, unit) = UNITS
        .iter()
        .find(|(s, _)| ms % s == 0)
        .copied()
        .unwrap_or((1, "ms"));
    format!("{}{unit}", ms / scale)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_unit() {
        assert_eq!(parse_millis("500ms"), Some(500));
        assert_eq!(parse_millis("30s"), Some(30_000));
        assert_eq!(parse_millis("15m"), Some(900_000));
        assert_eq!(parse_millis("24h"), Some(86_400_000));
        assert_eq!(parse_millis("7d"), Some(604_800_000));
    }

    #[test]
    fn rejects_garbage() {
        for bad in [
            "",
            "h",
            "24",
            "24x",
            "-1s",
            "1.5h",
            "1h30m",
            "99999999999999999999d",
        ] {
            assert_eq!(parse_millis(bad), None, "{bad}");
        }
    }

    #[test]
    fn displays_in_the_largest_exact_unit() {
        assert_eq!(display(86_400_000), "1d");
        assert_eq!(display(90_000), "90s");
        assert_eq!(display(1_500), "1500ms");
    }
}
