//! Header values on one line: NATS ends a header value at CR or LF, and a
//! parked copy's reason is often a multi-line `Debug` or panic message.

/// What ends a cut reason.
const CUT: &str = "\u{2026}";

/// `text` fit for a header value, which ends at CR or LF, in at most `room`
/// bytes: `\`, CR, LF, tab and other control characters written as Rust
/// escapes (`\\`, `\r`, `\n`, `\t`, `\u{7f}`), which [`unescaped`] reverses.
/// Over `room` it is cut between two characters and ends with `…`.
pub(super) fn escaped(text: &str, room: usize) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        escape_into(&mut out, c);
    }
    if out.len() <= room {
        return out;
    }
    out.clear();
    let Some(room) = room.checked_sub(CUT.len()) else {
        return out;
    };
    let mut one = String::new();
    for c in text.chars() {
        one.clear();
        escape_into(&mut one, c);
        if out.len() + one.len() > room {
            break;
        }
        out.push_str(&one);
    }
    out.push_str(CUT);
    out
}

fn escape_into(out: &mut String, c: char) {
    match c {
        '\\' => out.push_str("\\\\"),
        '\r' => out.push_str("\\r"),
        '\n' => out.push_str("\\n"),
        '\t' => out.push_str("\\t"),
        c if c.is_control() => {
            use std::fmt::Write;
            let _ = write!(out, "\\u{{{:x}}}", u32::from(c));
        }
        c => out.push(c),
    }
}

/// A header value written by [`escaped`], as it was; an escape it does not
/// write is kept as it is.
pub(super) fn unescaped(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    let mut rest = value;
    while let Some(at) = rest.find('\\') {
        out.push_str(&rest[..at]);
        rest = &rest[at..];
        let (c, len) = match rest.as_bytes().get(1) {
            Some(b'\\') => (Some('\\'), 2),
            Some(b'r') => (Some('\r'), 2),
            Some(b'n') => (Some('\n'), 2),
            Some(b't') => (Some('\t'), 2),
            Some(b'u') => match rest[2..].strip_prefix('{').and_then(|r| r.split_once('}')) {
                Some((hex, _)) => (
                    u32::from_str_radix(hex, 16).ok().and_then(char::from_u32),
                    hex.len() + 4,
                ),
                None => (None, 1),
            },
            _ => (None, 1),
        };
        match c {
            Some(c) => out.push(c),
            None => out.push_str(&rest[..len]),
        }
        rest = &rest[len..];
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const AWKWARD: &str = "a\nCaused by:\r\n\tb \\n \\u{41} \\ \u{7}\u{7f}\u{85} \u{e9}t\u{e9}";

    #[test]
    fn a_header_value_is_one_line_and_reads_back_as_written() {
        let value = escaped(AWKWARD, usize::MAX);
        assert!(!value.chars().any(char::is_control), "{value}");
        assert_eq!(unescaped(&value), AWKWARD);
        assert_eq!(unescaped("a \\q \\u{zz} \\"), "a \\q \\u{zz} \\");
    }

    #[test]
    fn a_cut_value_fits_and_ends_between_two_escapes() {
        let full = escaped(AWKWARD, usize::MAX);
        assert_eq!(escaped(AWKWARD, full.len()), full);
        for room in 0..full.len() {
            let cut = escaped(AWKWARD, room);
            assert!(cut.len() <= room, "{room}: {cut}");
            if room >= CUT.len() {
                let kept = cut.strip_suffix(CUT).expect("marked as cut");
                assert!(AWKWARD.starts_with(&unescaped(kept)), "{room}: {cut}");
                // No more left out than the next escape, the longest 6 bytes.
                assert!(
                    kept.len() + CUT.len() + "\\u{7f}".len() > room,
                    "{room}: {cut}"
                );
            } else {
                assert_eq!(cut, "");
            }
        }
    }
}
