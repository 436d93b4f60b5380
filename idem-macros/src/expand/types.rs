//! The assertions on the user's type tokens, so that a type that cannot be
//! cached or stored is reported once, there.

use proc_macro2::TokenStream;
use quote::{quote, quote_spanned};
use syn::spanned::Spanned;
use syn::{Expr, ItemFn, Path};

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
    final_err: Option<&Expr>,
) -> TokenStream {
    let (first_half, result, ok_span, err_span) = match (ok, err) {
        (Some(ok), Some(err)) => {
            let (ok_span, err_span) = (ok.span(), err.span());
            let (ko, ke) = (respan(krate, ok_span), respan(krate, err_span));
            let checks = quote! {
                // `_`: the stored form's marker (serde, or axum's `Json`), inferred.
                #ko::__private::assert_serializable::<#ok, _>();
                #ke::__private::assert_error_type::<#err>();
            };
            let result = quote!(::core::result::Result<#ok, #err>);
            (checks, result, ok_span, err_span)
        }
        _ => {
            let ret = return_type(func);
            let span = ret.span();
            let k = respan(krate, span);
            let checks = quote_spanned!(span=> #k::__private::assert_result::<#ret, _>(););
            (checks, ret, span, span)
        }
    };
    // The rest of `Serialize + DeserializeOwned`, only where `Serialize` holds:
    // one error for a type that derives neither serde trait, not two.
    let ko = respan(krate, ok_span);
    let cacheable = quote_spanned! {ok_span=>
        (&#ko::__private::OkProbe::<#result>::new()).assert_cacheable();
    };
    let final_checks = final_err.map(|pred| final_err_checks(krate, err, &result, err_span, pred));
    quote! {
        #first_half
        {
            #[allow(unused_imports)]
            use #krate::__private::{SerializeHolds as _, SerializeMissing as _};
            #cacheable
        }
        #final_checks
    }
}

/// `E` as the expansion names it: the written type, or the alias's `Err`.
pub(super) fn err_type(krate: &Path, err: Option<&syn::Type>, result: &TokenStream) -> TokenStream {
    match err {
        Some(err) => quote!(#err),
        None => {
            let k = respan(krate, result.span());
            quote_spanned!(result.span()=> <#result as #k::__private::IdemResult>::Err)
        }
    }
}

/// With `final_err = f`: `f` bound to `__idem_final`, its shape checked on its
/// tokens; then what it stores, by what it returns: for `bool` the error
/// itself, on `E`'s token; for `Option<S>` the form `S` and `E: From<S>`, on
/// `f`'s tokens (see the runtime's `final_err.rs`).
fn final_err_checks(
    krate: &Path,
    err: Option<&syn::Type>,
    result: &TokenStream,
    err_span: proc_macro2::Span,
    pred: &Expr,
) -> TokenStream {
    let e = err_type(krate, err, result);
    let pred_span = pred.span();
    let kp = respan(krate, pred_span);
    let on_err = quote_spanned! {err_span=>
        __idem_probe.assert_error_serializable();
        __idem_probe.assert_error_storable();
    };
    let on_pred = quote_spanned! {pred_span=>
        __idem_probe.assert_form_serializable();
        __idem_probe.assert_form_storable();
        __idem_probe.assert_form_replays();
    };
    // On `f`'s tokens, so a function of the wrong shape is reported there.
    let bind = quote_spanned!(pred_span=> #kp::__private::final_err::<#e, _, _>(#pred));
    quote! {
        let __idem_final = #bind;
        {
            #[allow(unused_imports)]
            use #krate::__private::{
                NoFinalCheck as _, StoresAForm as _, StoresAFormRest as _, StoresTheError as _,
                StoresTheErrorRest as _,
            };
            let __idem_probe = &#krate::__private::FinalProbe::<#e, _>::of(&__idem_final);
            #on_err
            #on_pred
        }
    }
}
