//! Rejects key parameters declared with a clock type (`SystemTime`, `Instant`,
//! chrono and time types). Fields reached through a struct are caught by the
//! type system instead: clock types do not implement `KeyPart`.

use syn::{GenericArgument, PathArguments, Type};

use super::Role;

const CLOCK_TYPES: &[&str] = &[
    "SystemTime",
    "Instant",
    "DateTime",
    "NaiveDateTime",
    "NaiveTime",
    "OffsetDateTime",
    "PrimitiveDateTime",
    "UtcDateTime",
    "Timestamp",
    "Zoned",
];

/// The clock type named anywhere in `ty` (`Option<DateTime<Utc>>` included).
pub(crate) fn find(ty: &Type) -> Option<&syn::Ident> {
    match ty {
        Type::Reference(r) => find(&r.elem),
        Type::Paren(p) => find(&p.elem),
        Type::Group(g) => find(&g.elem),
        Type::Slice(s) => find(&s.elem),
        Type::Array(a) => find(&a.elem),
        Type::Tuple(t) => t.elems.iter().find_map(find),
        Type::Path(p) => {
            let last = p.path.segments.last()?;
            if CLOCK_TYPES.iter().any(|c| last.ident == c) {
                return Some(&last.ident);
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

pub(crate) fn message(role: Role, param: &str, clock: &syn::Ident) -> String {
    format!(
        "{option} parameter `{param}` has a clock type (`{clock}`): its value is different on every retry, {harm}\n\
         help: use business fields ({fields}); a date that is fixed per intent can be passed as a string or number and named in `allow`",
        option = role.option(),
        harm = role.harm(),
        fields = role.fields(),
    )
}

/// The same judgement on a field of a `#[derive(KeyPart)]` type.
pub(crate) fn field_message(ty: &str, field: &str, clock: &syn::Ident) -> String {
    format!(
        "field `{field}` of `{ty}` has a clock type (`{clock}`): `#[derive(KeyPart)]` puts every field into the key, and its value is different on every retry, {harm}\n\
         help: leave clock values out of key types; a date that is fixed per intent can be kept as a string or number and the field marked `#[key_part(allow)]`",
        harm = Role::Key.harm(),
    )
}
