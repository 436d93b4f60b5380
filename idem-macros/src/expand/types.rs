//! The assertions on the user's type tokens, so that a type that cannot be
//! cached or stored is reported once, there.

use proc_macro2::TokenStream;
use quote::{quote, quote_spanned};
use syn::spanned::Spanned;
use syn::{ItemFn, Path};

use super::{respan, return_type};

/// Assertions on the user's own type tokens, so a type that cannot be cached
/// (or, with `final_err`, stored) is reported once, there. With `T` and `E`
/// written out each gets its own check; otherwise (an alias like
/// `io::Result<T>`) the checks take the whole return type and point at it. The
/// protocol call is dispatched (see the runtime's `dispatch` module) so it
/// repeats none of these errors, which is sound only because these assertions
/// are always emitted.
pub(super) fn type_checks(
    krate: &Path,
    func: &ItemFn,
    ok: Option<&syn::Type>,
    err: Option<&syn::Type>,
    keeps_final: bool,
) -> TokenStream {
    let (first_half, result, ok_span, err_span) = match (ok, err) {
        (Some(ok), Some(err)) => {
            let (ok_span, err_span) = (ok.span(), err.span());
            let (ko, ke) = (respan(krate, ok_span), respan(krate, err_span));
            let storable = keeps_final.then(
                || quote_spanned!(err_span=> #ke::__private::assert_storable_error::<#err>();),
            );
            let checks = quote! {
                // `_`: the stored form's marker (serde, or axum's `Json`), inferred.
                #ko::__private::assert_serializable::<#ok, _>();
                #ke::__private::assert_error_type::<#err>();
                #storable
            };
            let result = quote!(::core::result::Result<#ok, #err>);
            (checks, result, ok_span, err_span)
        }
        _ => {
            let ret = return_type(func);
            let span = ret.span();
            let k = respan(krate, span);
            let assert = if keeps_final {
                quote_spanned!(span=> assert_result_keeping_final)
            } else {
                quote_spanned!(span=> assert_result)
            };
            let checks = quote_spanned!(span=> #k::__private::#assert::<#ret, _>(););
            (checks, ret, span, span)
        }
    };
    // The rest of `Serialize + DeserializeOwned`, only where `Serialize` holds:
    // one error for a type that derives neither serde trait, not two.
    let ko = respan(krate, ok_span);
    let ke = respan(krate, err_span);
    let cacheable = quote_spanned! {ok_span=>
        (&#ko::__private::OkProbe::<#result>::new()).assert_cacheable();
    };
    let storable = keeps_final.then(|| {
        quote_spanned! {err_span=>
            (&#ke::__private::ErrProbe::<#result>::new()).assert_storable_error();
        }
    });
    quote! {
        #first_half
        {
            #[allow(unused_imports)]
            use #krate::__private::{SerializeHolds as _, SerializeMissing as _};
            #cacheable
            #storable
        }
    }
}

