//! The `key` and `fingerprint` strings: `|`-separated segments, each a
//! parameter name followed by field accesses (`req.user.id`, `pair.0`).

use proc_macro2::Span;
use syn::LitStr;

use crate::errors::Errors;

/// One segment: the parameter it starts from and the fields it walks.
pub(crate) struct Segment {
    /// The whole segment as written, for messages.
    pub text: String,
    /// The parameter name (or `self`).
    pub root: String,
    /// Field names or tuple indices after the root.
    pub fields: Vec<String>,
    /// The literal's span: proc macros cannot point inside a string on stable.
    pub span: Span,
}

impl Segment {
    /// Every name along the path, root first.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        std::iter::once(self.root.as_str()).chain(self.fields.iter().map(String::as_str))
    }
}

fn is_ident(s: &str) -> bool {
    let mut chars = s.chars();
    matches!(chars.next(), Some(c) if c == '_' || c.is_alphabetic())
        && chars.all(|c| c == '_' || c.is_alphanumeric())
}

/// Splits `lit` (the value of `option`) into segments; errors point at it.
pub(crate) fn parse(lit: &LitStr, option: &str, errors: &mut Errors) -> Vec<Segment> {
    let value = lit.value();
    if value.trim().is_empty() {
        let what = match option {
            "fingerprint" => {
                "name the payload fields a replay must match, e.g. fingerprint = \"req.amount|req.currency\", or drop `fingerprint`"
            }
            _ => {
                "name the business fields that identify one intent, e.g. key = \"req.user_id|req.client_order_no\""
            }
        };
        errors.error(lit, format!("`{option}` is empty: {what}"));
        return Vec::new();
    }
    let mut out = Vec::new();
    for (i, raw) in value.split('|').enumerate() {
        let text = raw.trim();
        if text.is_empty() {
            errors.error(
                lit,
                format!(
                    "`{option}` has an empty segment (number {}): remove the stray `|`",
                    i + 1
                ),
            );
            continue;
        }
        let mut parts = text.split('.').map(str::trim);
        let root = parts.next().unwrap_or_default();
        let fields: Vec<&str> = parts.collect();
        let root_ok = is_ident(root);
        let fields_ok = fields
            .iter()
            .all(|f| is_ident(f) || (!f.is_empty() && f.chars().all(|c| c.is_ascii_digit())));
        if !root_ok || !fields_ok {
            errors.error(
                lit,
                format!(
                    "`{text}` is not a key segment: write a parameter name, optionally followed by fields, like `req.user_id` or `pair.0`"
                ),
            );
            continue;
        }
        out.push(Segment {
            text: text.to_owned(),
            root: root.to_owned(),
            fields: fields.into_iter().map(str::to_owned).collect(),
            span: lit.span(),
        });
    }
    out
}
