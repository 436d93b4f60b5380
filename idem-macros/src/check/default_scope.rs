//! The default scope (module path + function name) cannot tell apart two
//! methods of one name in one module: `impl Handler for A` and
//! `impl Handler for B` would share every key, and one type's call would replay
//! the other's result. An attribute on a method never sees its impl, so the
//! self type cannot be folded in (and `type_name` is not stable across
//! compilers, which keys must be). A method therefore names its scope.

use proc_macro2::{TokenStream, TokenTree};
use quote::ToTokens;
use syn::{FnArg, Signature};

use crate::errors::Errors;

pub(crate) fn check(sig: &Signature, has_scope: bool, errors: &mut Errors) {
    if has_scope {
        return;
    }
    let receiver = sig.inputs.iter().find_map(|arg| match arg {
        FnArg::Receiver(r) => Some(r.to_token_stream()),
        FnArg::Typed(_) => None,
    });
    let Some(at) = receiver.or_else(|| mentions_self_type(sig)) else {
        return;
    };
    errors.error(
        at,
        format!(
            "#[idempotent] on a method needs `scope = \"…\"`: the default scope is the module path and the function name, \
             which the `{name}` of every impl in this module shares, so two types' calls would share keys and replay each other's results\n\
             help: name the scope, e.g. scope = \"orders.{name}\" (a stable name also keeps the keys when the code moves)",
            name = sig.ident
        ),
    );
}

/// The first `Self` in the signature: a function that names it sits in an impl
/// or a trait even without a receiver.
fn mentions_self_type(sig: &Signature) -> Option<TokenStream> {
    fn find(tokens: TokenStream) -> Option<TokenStream> {
        tokens.into_iter().find_map(|tt| match tt {
            TokenTree::Ident(ident) if ident == "Self" => Some(ident.into_token_stream()),
            TokenTree::Group(g) => find(g.stream()),
            _ => None,
        })
    }
    find(sig.inputs.to_token_stream()).or_else(|| find(sig.output.to_token_stream()))
}
