//! "Did you mean …?" for misspelt options and key segments.

/// The candidate `name` was most likely meant to be. Jaro-Winkler alone
/// misses one-letter slips in short names (`tll` for `ttl` scores exactly
/// 0.8), so a single edit or transposition also counts as close.
pub(crate) fn closest<'a>(
    name: &str,
    candidates: impl IntoIterator<Item = &'a str>,
) -> Option<&'a str> {
    candidates
        .into_iter()
        .filter(|c| !c.is_empty() && *c != name)
        .map(|c| {
            (
                strsim::jaro_winkler(name, c),
                strsim::osa_distance(name, c),
                c,
            )
        })
        .filter(|(score, edits, c)| *score > 0.8 || (*edits == 1 && c.chars().count() > 1))
        .min_by(|a, b| a.1.cmp(&b.1).then(b.0.total_cmp(&a.0)))
        .map(|(_, _, c)| c)
}

#[cfg(test)]
mod tests {
    use super::closest;

    #[test]
    fn one_slip_in_a_short_name_is_close() {
        assert_eq!(closest("tll", ["key", "ttl", "lease"]), Some("ttl"));
        assert_eq!(closest("ky", ["key", "ttl"]), Some("key"));
        assert_eq!(closest("reqest", ["request", "store"]), Some("request"));
    }

    #[test]
    fn unrelated_names_get_no_suggestion() {
        assert_eq!(closest("currency", ["req"]), None);
        assert_eq!(closest("ts", ["id"]), None);
    }
}
