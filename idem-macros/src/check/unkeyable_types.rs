//! Rejects the field types of a `#[derive(KeyPart)]` type that can never make
//! a stable key: floats and maps. Neither implements `KeyPart`, so rustc would
//! refuse them anyway; this says why, on the field.

use syn::{GenericArgument, PathArguments, Type};

/// Why a type cannot be part of a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Unkeyable {
    Float,
    /// `HashMap`, `HashSet` and their look-alikes: iteration order is per process.
    HashedCollection,
    /// `BTreeMap`, `BTreeSet`: ordered, but a whole collection is no business key.
    OrderedCollection,
}

const FLOATS: &[&str] = &["f32", "f64"];
const HASHED: &[&str] = &[
    "HashMap",
    "HashSet",
    "IndexMap",
    "IndexSet",
    "DashMap",
    "DashSet",
    "AHashMap",
    "AHashSet",
    "FxHashMap",
    "FxHashSet",
];
const ORDERED: &[&str] = &["BTreeMap", "BTreeSet"];

/// The first float or map type named anywhere in `ty` (`Option<f64>`,
/// `Vec<HashMap<…>>` included).
pub(crate) fn find(ty: &Type) -> Option<(&syn::Ident, Unkeyable)> {
    match ty {
        Type::Reference(r) => find(&r.elem),
        Type::Paren(p) => find(&p.elem),
        Type::Group(g) => find(&g.elem),
        Type::Slice(s) => find(&s.elem),
        Type::Array(a) => find(&a.elem),
        Type::Tuple(t) => t.elems.iter().find_map(find),
        Type::Path(p) => {
            let last = p.path.segments.last()?;
            let named = |set: &[&str]| set.iter().any(|n| last.ident == n);
            if named(FLOATS) {
                return Some((&last.ident, Unkeyable::Float));
            }
            if named(HASHED) {
                return Some((&last.ident, Unkeyable::HashedCollection));
            }
            if named(ORDERED) {
                return Some((&last.ident, Unkeyable::OrderedCollection));
            }
            match &last.arguments {
                PathArguments::AngleBracketed(args) => args.args.iter().find_map(|a| match a {
                    GenericArgument::Type(t) => find(t),
                    _ => None,
                }),
                _ => None,
            }
        }
        _ => None,
    }
}

pub(crate) fn message(ty: &str, field: &str, found: &syn::Ident, why: Unkeyable) -> String {
    match why {
        Unkeyable::Float => format!(
            "field {field} of `{ty}` has a floating-point type (`{found}`), which cannot be part of an idempotency key: \
             equal amounts can differ in their last bits (0.1 + 0.2 is not 0.3), NaN never equals itself and 0.0 and -0.0 \
             are different bits, so two retries of one intent could get different keys\n\
             help: key on an integer in the smallest unit (cents, grams) or on the decimal's canonical string"
        ),
        Unkeyable::HashedCollection => format!(
            "field {field} of `{ty}` is a map or set (`{found}`), which cannot be part of an idempotency key: \
             its iteration order comes from a per-process random seed, so the same entries would give another key \
             in every process and on every retry\n\
             help: key on the fields that identify the intent; if the whole collection really is the intent, \
             convert it to a sorted `Vec` and key on that"
        ),
        Unkeyable::OrderedCollection => format!(
            "field {field} of `{ty}` is a map or set (`{found}`), which cannot be part of an idempotency key: \
             the key would depend on every entry, and one entry added on a retry (a header, a metadata field) \
             would make it another key\n\
             help: key on the fields that identify the intent; if the whole collection really is the intent, \
             convert it to a sorted `Vec` and key on that"
        ),
    }
}
