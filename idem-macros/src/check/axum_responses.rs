//! Rejects a result tuple that reads as an axum response but is not one of
//! the shapes idem can store and replay. Left to the type system, such a
//! tuple gets one "`Serialize` is not satisfied" error per element (the
//! status, the header pairs, the `Json`), none of which says what to write
//! instead.

use syn::{GenericArgument, PathArguments, Type};

use crate::errors::Errors;

/// Element types that only an HTTP response puts in a tuple.
const RESPONSE_PARTS: &[&str] = &[
    "StatusCode",
    "HeaderMap",
    "Json",
    "Html",
    "AppendHeaders",
    "Response",
    "Redirect",
    "Extension",
    "Form",
];

fn last_ident(ty: &Type) -> Option<&syn::Ident> {
    match ty {
        Type::Path(p) if p.qself.is_none() => p.path.segments.last().map(|s| &s.ident),
        Type::Paren(p) => last_ident(&p.elem),
        Type::Group(g) => last_ident(&g.elem),
        _ => None,
    }
}

fn is(ty: &Type, name: &str) -> bool {
    last_ident(ty).is_some_and(|i| i == name)
}

/// `Json<T>` with its one type argument written out.
fn is_json(ty: &Type) -> bool {
    let Type::Path(p) = ty else { return false };
    p.path.segments.last().is_some_and(|s| {
        s.ident == "Json"
            && matches!(&s.arguments, PathArguments::AngleBracketed(a)
                if a.args.len() == 1 && matches!(a.args[0], GenericArgument::Type(_)))
    })
}

fn looks_like_a_response(elems: &[&Type]) -> bool {
    elems.iter().any(|t| {
        matches!(t, Type::Array(_))
            || last_ident(t).is_some_and(|i| RESPONSE_PARTS.iter().any(|p| i == p))
    })
}

fn supported(elems: &[&Type]) -> bool {
    match elems {
        [status, body] => (is(status, "StatusCode") || is(status, "HeaderMap")) && is_json(body),
        [status, headers, body] => {
            is(status, "StatusCode") && is(headers, "HeaderMap") && is_json(body)
        }
        _ => false,
    }
}

/// `ok` is the `T` of the function's `Result<T, E>`.
pub(crate) fn check(ok: &Type, errors: &mut Errors) {
    let Type::Tuple(tuple) = ok else { return };
    let elems: Vec<&Type> = tuple.elems.iter().collect();
    if looks_like_a_response(&elems) && !supported(&elems) {
        errors.error(
            ok,
            "this response cannot be stored and replayed to duplicates\n\
             help: an idempotent axum handler returns `Json<T>`, `(StatusCode, Json<T>)`, `(HeaderMap, Json<T>)` \
             or `(StatusCode, HeaderMap, Json<T>)` (feature `axum`), with `T: Serialize + Deserialize`; \
             set a header such as `Location` by putting it in the `HeaderMap`",
        );
    }
}
