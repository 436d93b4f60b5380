//! The rules for `recover`: the call's arguments are stored with its claim,
//! and a worker calls the function again with them. So every parameter must
//! be a value the expansion can encode before the body takes it, and that a
//! worker can decode and hand back: a plain `name: Type`, owned or behind a
//! shared reference, of a concrete type (whether the type itself is
//! `Serialize + DeserializeOwned` the type system says, on the type).

use syn::{FnArg, GenericParam, Ident, ItemFn, Pat, Type};

use crate::args::IdempotentArgs;
use crate::errors::Errors;

/// One parameter as it is stored and handed back.
pub(crate) struct Param<'a> {
    pub name: Ident,
    /// The declared type.
    pub ty: &'a Type,
    /// What is stored: the type itself, or for `&T` the `T` (`String` for
    /// `&str`, `Vec<T>` for `&[T]`), handed back by reference.
    pub stored: Type,
    pub by_ref: bool,
}

/// Everything the expansion of `recover` needs.
pub(crate) struct Recover<'a> {
    pub flag: Ident,
    pub params: Vec<Param<'a>>,
    /// A `&self` method: the service value comes from the registration.
    pub method: bool,
}

/// serde implements its traits for tuples up to this size, and the stored
/// arguments decode as one tuple.
const MAX_PARAMS: usize = 16;

pub(crate) fn check<'a>(
    args: &IdempotentArgs,
    func: &'a ItemFn,
    errors: &mut Errors,
) -> Option<Recover<'a>> {
    let flag = args.recover.clone()?;
    let before = errors.len();
    if let Some(tx) = &args.tx {
        errors.error(
            tx,
            "`recover` and `tx` exclude each other: with `tx` the claim commits or rolls back with the caller's transaction, so a crash leaves no claim behind to recover",
        );
        // The transaction parameter itself could never be stored: that is
        // the same mistake, said once.
        return None;
    }
    if let Some(consumer) = &args.consumer {
        errors.error(
            consumer,
            "`recover` does not apply to consumers: the broker redelivers a message whose handler died, and the redelivery resumes the flow",
        );
    }
    for param in &func.sig.generics.params {
        if !matches!(param, GenericParam::Lifetime(_)) {
            errors.error(
                param,
                "`recover` needs a function without type or const parameters: the worker registers one concrete function per scope\n\
                 help: call a generic function from a concrete one and put `recover` on that",
            );
        }
    }
    if let Some(extractor) = first_extractor(func) {
        errors.error(extractor, on_a_handler(extractor, func));
        // The handler's other parameters are extractors too: said once.
        return None;
    }
    let mut method = false;
    let mut params = Vec::new();
    for input in &func.sig.inputs {
        match input {
            FnArg::Receiver(r) if r.reference.is_some() && r.mutability.is_none() => method = true,
            FnArg::Receiver(r) => errors.error(
                r,
                "`recover` works on free functions and `&self` methods: the worker calls the method on a shared service value given at registration (`recoverable!(Service::method, service)`)",
            ),
            FnArg::Typed(pt) => {
                let Pat::Ident(pi) = &*pt.pat else {
                    errors.error(
                        &pt.pat,
                        "`recover` stores each argument to call the function again: name the parameter (`req: CreateOrder`) and destructure it inside the body",
                    );
                    continue;
                };
                if pi.subpat.is_some() || pi.by_ref.is_some() {
                    errors.error(&pt.pat, "`recover` needs a plain parameter name here");
                    continue;
                }
                if let Some(p) = stored(&pi.ident, &pt.ty, errors) {
                    params.push(p);
                }
            }
        }
    }
    if params.len() > MAX_PARAMS {
        errors.error(
            &func.sig.inputs,
            format!("`recover` stores at most {MAX_PARAMS} arguments: gather them in a struct"),
        );
    }
    (errors.len() == before).then_some(Recover {
        flag,
        params,
        method,
    })
}

fn stored<'a>(name: &Ident, ty: &'a Type, errors: &mut Errors) -> Option<Param<'a>> {
    let param = |stored: Type, by_ref: bool| Param {
        name: name.clone(),
        ty,
        stored,
        by_ref,
    };
    match ty {
        Type::Reference(r) if r.mutability.is_some() => {
            errors.error(
                ty,
                "`recover` cannot store a `&mut` argument: the worker would hand back a copy, and the caller's changes to it would be lost\n\
                 help: pass the value, or return what the caller needs in the result",
            );
            None
        }
        Type::Reference(r) => match &*r.elem {
            Type::Path(p) if p.qself.is_none() && p.path.is_ident("str") => {
                Some(param(syn::parse_quote!(::std::string::String), true))
            }
            Type::Slice(s) => {
                let elem = &s.elem;
                Some(param(syn::parse_quote!(::std::vec::Vec<#elem>), true))
            }
            Type::ImplTrait(_) | Type::TraitObject(_) => {
                errors.error(ty, impl_trait());
                None
            }
            elem => Some(param(elem.clone(), true)),
        },
        Type::ImplTrait(_) => {
            errors.error(ty, impl_trait());
            None
        }
        _ => Some(param(ty.clone(), false)),
    }
}

fn impl_trait() -> &'static str {
    "`recover` stores each argument and decodes it again: it needs a concrete type here, not `impl Trait` or `dyn Trait`"
}

/// axum's extractors (and idem's `IdempotencyKey`), by the last segment of
/// their path: these need type arguments, so a plain type of the same name
/// is not taken for one.
const GENERIC_EXTRACTORS: &[&str] = &[
    "State",
    "Path",
    "Query",
    "Form",
    "Extension",
    "TypedHeader",
    "ConnectInfo",
    "WithRejection",
];

/// Extractors without type arguments, and `IdempotencyKey` with or without.
const PLAIN_EXTRACTORS: &[&str] = &[
    "IdempotencyKey",
    "HeaderMap",
    "Method",
    "Uri",
    "OriginalUri",
    "MatchedPath",
    "RawQuery",
    "RawForm",
    "Multipart",
    "CookieJar",
    "SignedCookieJar",
    "PrivateCookieJar",
    "WebSocketUpgrade",
];

/// The first parameter of an axum handler's kind: an extractor's type, or a
/// `Json(req)` pattern (`Json` alone is also sqlx's serde wrapper, so only
/// its destructuring pattern, written for axum's, tells a handler).
fn first_extractor(func: &ItemFn) -> Option<&Type> {
    func.sig.inputs.iter().find_map(|input| {
        let FnArg::Typed(pt) = input else { return None };
        let Type::Path(tp) = &*pt.ty else { return None };
        let last = tp.path.segments.last()?;
        let name = last.ident.to_string();
        let generic = matches!(last.arguments, syn::PathArguments::AngleBracketed(_));
        let destructured = matches!(&*pt.pat, Pat::TupleStruct(_));
        let is_extractor = (generic && GENERIC_EXTRACTORS.contains(&name.as_str()))
            || PLAIN_EXTRACTORS.contains(&name.as_str())
            || (generic && destructured && name == "Json");
        is_extractor.then_some(&*pt.ty)
    })
}

/// What to do instead of `recover` on a handler: the idiom of the guide's
/// recovery page.
fn on_a_handler(extractor: &Type, func: &ItemFn) -> String {
    let ty = quote::ToTokens::to_token_stream(extractor)
        .to_string()
        .replace(' ', "");
    let name = &func.sig.ident;
    format!(
        "`recover` cannot go on an axum handler: `{ty}` is taken from the request, and a recovery worker calls the function again without a request\n\
         help: keep `{name}` a handler without `recover`, and move its work into a method of your service that takes the request's data (the caller and key as strings, the body's type), with `#[idempotent(…, recover)]` on that method: the handler calls it, and `recoverable!(Service::method, service)` registers it (idem_runtime::guide::recovery, \"On an axum handler\")"
    )
}
