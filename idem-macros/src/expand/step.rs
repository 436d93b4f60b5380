//! `#[step]`'s expansion.

use proc_macro2::{Span, TokenStream};
use quote::{quote, quote_spanned};
use syn::{ItemFn, Path};

use super::types::type_checks;
use super::{body_block, dispatch, key_parts, respan, split_attrs};
use crate::check::{Compensation, StepPlan};

pub(crate) fn step(plan: &StepPlan<'_>, func: &ItemFn, krate: &Path) -> TokenStream {
    let ItemFn { vis, sig, .. } = func;
    let (attrs, inner_attrs) = split_attrs(func);
    let checks = type_checks(krate, func, plan.ok_type, plan.err_type, None);
    let dispatch = dispatch(krate, func);
    let body = body_block(func);
    let name = &plan.name;
    let call = match &plan.compensation {
        None => quote!(__idem_dispatch.run_step(__idem_step, #body).await),
        Some(comp) => compensated_call(comp, body, krate),
    };
    // The item key is built before the body's `async move` takes the arguments.
    let step = if plan.key.is_empty() {
        quote!(let __idem_step = #krate::__private::StepCall::new(#name);)
    } else {
        let parts = key_parts(&plan.key, krate);
        quote! {
            let __idem_step = {
                let mut __idem_key = #krate::__private::key_builder(#name);
                #parts
                #krate::__private::StepCall::new(#name).item(__idem_key.finish())
            };
        }
    };
    quote! {
        #(#attrs)*
        #vis #sig {
            #(#inner_attrs)*
            #checks
            #dispatch
            #step
            #call
        }
    }
}

/// The step's call with its compensation: a closure that gets the step's
/// output and calls the compensation on it, written on the `compensate`
/// string's span so rustc's "no function named …" and a compensation taking
/// another type than the step's output land there. A method's compensation gets a clone of `self`: it
/// runs after the flow's body, when the step's borrow has ended.
fn compensated_call(comp: &Compensation, body: TokenStream, krate: &Path) -> TokenStream {
    let (lit, receiver, call) = match comp {
        Compensation::Method(lit, ident) => {
            let span = lit.span();
            let k = respan(krate, span);
            let receiver = quote_spanned! {span=>
                let __idem_this = #k::__private::compensation_receiver::<Self>(&self);
            };
            let arg = compensation_arg(lit, krate);
            let call = quote_spanned!(span=> Self::#ident(&__idem_this, #arg));
            (lit, receiver, call)
        }
        Compensation::Free(lit, path) => {
            let span = lit.span();
            let arg = compensation_arg(lit, krate);
            (lit, TokenStream::new(), quote_spanned!(span=> #path(#arg)))
        }
    };
    let span = lit.span();
    let k = respan(krate, span);
    let awaited = quote_spanned!(span=> #k::__private::compensation_result(#call.await));
    quote! {
        #receiver
        #[allow(unused_imports)]
        use #krate::__private::{AfterTypeErrorCompensated as _, WhenTypesHoldCompensated as _};
        __idem_dispatch
            .run_step_compensated(
                __idem_step,
                #lit,
                move |__idem_output| async move { #awaited },
                #body,
            )
            .await
    }
}

/// The step's output as the compensation's argument, through the runtime's
/// `compensation_arg`, whose bound reports a compensation that takes another
/// type in words that say what to write. Located on the `compensate` string
/// but marked as generated, so rustc offers no fix-it there (it suggested
/// `compensate = &"undo"` for a compensation taking a reference).
fn compensation_arg(lit: &syn::LitStr, krate: &Path) -> TokenStream {
    let span = Span::call_site().located_at(lit.span());
    let k = respan(krate, span);
    let output = syn::Ident::new("__idem_output", span);
    quote_spanned!(span=> #k::__private::compensation_arg(#output))
}
