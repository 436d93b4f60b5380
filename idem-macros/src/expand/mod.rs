//! Stage 3: generate code. Expansions stay thin: they build the key, name the
//! store and hand the body to the runtime, which does the real work.
//!
//! The body is moved, token for token, into an `async move` block, so errors
//! inside it keep pointing at the user's lines.

use proc_macro2::{Group, Span, TokenStream, TokenTree};
use quote::{ToTokens, quote, quote_spanned};
use syn::spanned::Spanned;
use syn::{AttrStyle, Attribute, ItemFn, LitStr, Path, ReturnType};

mod recover;
mod step;
mod types;

pub(crate) use recover::recoverable;
pub(crate) use step::step;

use crate::check::Plan;
use crate::segments::Segment;
use recover::{encode_args, recovery_item};
use types::type_checks;

/// `req.user.id` as an expression, spanned on the attribute's string.
///
/// The field names are marked as coming from this macro (located on the string
/// all the same): for an unknown field rustc then reports "no field `usr_id` on
/// type `Buy`" without its fix-it, which would replace the whole string with the
/// field name. Field access ignores that hygiene; the root keeps the string's
/// own span, since it must resolve to the user's parameter.
/// Pushes each key segment into `__idem_key`, on the segment's own span so a
/// type that is no `KeyPart` is reported there (`#[idempotent]`'s key and a
/// step's `key` alike).
pub(super) fn key_parts(segments: &[Segment], krate: &Path) -> TokenStream {
    segments
        .iter()
        .map(|seg| {
            let expr = segment_expr(seg);
            let k = respan(krate, seg.span);
            quote_spanned!(seg.span=> #k::__private::key_part(&mut __idem_key, &#expr);)
        })
        .collect()
}

fn segment_expr(seg: &Segment) -> TokenStream {
    let root = syn::Ident::new(&seg.root, seg.span);
    let field_span = Span::mixed_site().located_at(seg.span);
    let fields = seg.fields.iter().map(|f| match f.parse::<u32>() {
        Ok(index) => {
            let index = syn::Index {
                index,
                span: field_span,
            };
            quote!(.#index)
        }
        Err(_) => {
            let ident = syn::Ident::new(f, field_span);
            quote!(.#ident)
        }
    });
    quote!(#root #(#fields)*)
}

/// Wraps the body in an `async move` block whose output type is the function's
/// return type, so `?` and `return` inside it mean what they meant before.
pub(super) fn body_block(func: &ItemFn) -> TokenStream {
    let block = &func.block;
    let stmts = &block.stmts;
    let fake_return = match &func.sig.output {
        ReturnType::Type(_, ty) => quote! {
            // Never runs: it only tells inference the block's output type.
            #[allow(
                unknown_lints,
                unreachable_code,
                clippy::diverging_sub_expression,
                clippy::empty_loop,
                clippy::let_unit_value,
                clippy::let_with_type_underscore,
                clippy::needless_return,
                clippy::unreachable
            )]
            if false {
                let __idem_type_hint: #ty = loop {};
                return __idem_type_hint;
            }
        },
        ReturnType::Default => TokenStream::new(),
    };
    quote_spanned! {block.span()=>
        async move {
            #fake_return
            #(#stmts)*
        }
    }
}

/// With `tx = …`, the body becomes an async closure that gets the transaction
/// back from the runtime, which claims before and records after on that same
/// transaction. The closure's parameter reuses the user's name, so the body's
/// uses of it are untouched; its type is inferred from the runtime's bound.
fn tx_body(func: &ItemFn, tx: &syn::Ident) -> TokenStream {
    let block = &func.block;
    let stmts = &block.stmts;
    let ret = return_type(func);
    // The parameter's declared type, so the body type-checks before the runtime's
    // bound is known (check/transaction.rs guarantees it is a `&mut` parameter).
    let ty = func.sig.inputs.iter().find_map(|arg| match arg {
        syn::FnArg::Typed(pt) => match &*pt.pat {
            syn::Pat::Ident(pi) if pi.ident == *tx => Some(&pt.ty),
            _ => None,
        },
        syn::FnArg::Receiver(_) => None,
    });
    quote_spanned! {block.span()=>
        async move |#tx: #ty| -> #ret {
            #(#stmts)*
        }
    }
}

/// The runtime's path with every token on `span`, so an error in a call through
/// it is drawn on the user's token alone rather than stretched to the attribute.
pub(super) fn respan(krate: &Path, span: Span) -> TokenStream {
    fn go(tokens: TokenStream, span: Span) -> TokenStream {
        tokens
            .into_iter()
            .map(|tt| match tt {
                TokenTree::Group(g) => {
                    let mut group = Group::new(g.delimiter(), go(g.stream(), span));
                    group.set_span(span);
                    TokenTree::Group(group)
                }
                mut other => {
                    other.set_span(span);
                    other
                }
            })
            .collect()
    }
    go(krate.to_token_stream(), span)
}

pub(super) fn return_type(func: &ItemFn) -> TokenStream {
    match &func.sig.output {
        ReturnType::Type(_, ty) => quote!(#ty),
        ReturnType::Default => quote!(()),
    }
}

/// `(&Dispatch::<Ret>::new())`: method calls on it pick the checked protocol
/// when the types allow and the silent fallback otherwise.
pub(super) fn dispatch(krate: &Path, func: &ItemFn) -> TokenStream {
    let ret = return_type(func);
    quote! {
        #[allow(unused_imports)]
        use #krate::__private::{AfterTypeError as _, WhenTypesHold as _, WhenTypesHoldKeepingFinal as _};
        let __idem_dispatch = &#krate::__private::Dispatch::<#ret>::new();
    }
}

/// The function's outer attributes, and the inner ones (`#![allow(…)]`) that
/// syn parsed out of its body. An inner attribute is valid only at the top of
/// a block, so it goes back to the top of the generated body, where it applies
/// to the whole function as it did before, generated code included.
pub(super) fn split_attrs(func: &ItemFn) -> (Vec<&Attribute>, Vec<&Attribute>) {
    func.attrs
        .iter()
        .partition(|a| matches!(a.style, AttrStyle::Outer))
}

pub(crate) fn idempotent(plan: &Plan<'_>, func: &ItemFn, krate: &Path) -> TokenStream {
    let ItemFn { vis, sig, .. } = func;
    let (attrs, inner_attrs) = split_attrs(func);
    let fn_name = sig.ident.to_string();
    let scope = match &plan.scope {
        Some(lit) => quote!(#lit),
        None => quote!(::core::concat!(::core::module_path!(), "::", #fn_name)),
    };
    let kind = if plan.consumer {
        quote!(#krate::__private::Kind::Consumer)
    } else {
        quote!(#krate::__private::Kind::Call)
    };
    let (ttl, lease) = (plan.ttl_ms, plan.lease_ms);
    let wait = plan
        .wait_ms
        .map(|ms| quote!(.wait(#krate::__private::Duration::from_millis(#ms))));

    let event = plan
        .event
        .as_ref()
        .map(|e: &LitStr| quote!(#krate::__private::key_part(&mut __idem_key, #e);));
    let event_label = plan.event.as_ref().map(|e: &LitStr| quote!(.event(#e)));
    let key_parts = key_parts(&plan.key, krate);
    let fingerprint = if plan.fingerprint.is_empty() {
        quote!(#krate::__private::None)
    } else {
        let parts = plan.fingerprint.iter().map(|seg| {
            let expr = segment_expr(seg);
            let k = respan(krate, seg.span);
            quote_spanned!(seg.span=> #k::__private::fingerprint_part(&mut __idem_fp, &#expr);)
        });
        quote!({
            let mut __idem_fp = #krate::__private::fingerprint_builder();
            #(#parts)*
            #krate::__private::Some(__idem_fp.finish())
        })
    };
    // With `tx` the record goes on the caller's transaction: there is no store.
    let store = match (&plan.store, &plan.tx) {
        (_, Some(_)) => TokenStream::new(),
        (Some(expr), None) => {
            let store = quote_spanned!(expr.span()=> #krate::__private::Some(#krate::__private::store_of(&(#expr))));
            quote!(let __idem_store = #store;)
        }
        (None, None) => {
            quote!(let __idem_store = #krate::__private::None::<#krate::__private::StoreRef>;)
        }
    };
    let checks = type_checks(
        krate,
        func,
        plan.ok_type,
        plan.err_type,
        plan.final_err.as_ref(),
    );
    let mut dispatch = dispatch(krate, func);
    if plan.final_err.is_some() {
        // `final_err`'s function type beside the return type: the fallback is
        // chosen on the receiver alone.
        dispatch.extend(quote! {
            let __idem_dispatch_final = &__idem_dispatch.keeping_final(&__idem_final);
        });
    }
    let body = match &plan.tx {
        None => body_block(func),
        Some(tx) => tx_body(func, tx),
    };
    // A `()` result is known before the body runs: the claim writes the
    // record DONE at once, on the caller's transaction (`TxConnection::claim_done`).
    let known = match plan.ok_type {
        Some(syn::Type::Tuple(unit)) if unit.elems.is_empty() => {
            quote!(#krate::__private::Some(()))
        }
        _ => quote!(#krate::__private::None),
    };
    let call = match (&plan.tx, &plan.final_err, &plan.recover) {
        (Some(tx), _, _) => quote! {
            __idem_dispatch.execute_in_tx(
                &__IDEM_SPEC, &mut *#tx, __idem_key, __idem_fp, #known, __idem_body,
            )
        },
        (None, None, None) => quote! {
            __idem_dispatch.execute(&__IDEM_SPEC, __idem_store, __idem_key, __idem_fp, __idem_body)
        },
        (None, Some(_), None) => quote! {
            __idem_dispatch_final.execute_keeping_final(
                &__IDEM_SPEC, __idem_store, __idem_key, __idem_fp, __idem_final, __idem_body,
            )
        },
        (None, None, Some(_)) => quote! {
            __idem_dispatch.execute_recoverable(
                &__IDEM_SPEC, __idem_store, __idem_key, __idem_fp, __idem_args, __idem_body,
            )
        },
        (None, Some(_), Some(_)) => quote! {
            __idem_dispatch_final.execute_keeping_final_recoverable(
                &__IDEM_SPEC, __idem_store, __idem_key, __idem_fp, __idem_final, __idem_args, __idem_body,
            )
        },
    };
    let args = plan.recover.as_ref().map(|r| encode_args(r, krate));
    let recovery_item = plan
        .recover
        .as_ref()
        .map(|r| recovery_item(r, func, &scope, krate));

    quote! {
        #(#attrs)*
        #vis #sig {
            #(#inner_attrs)*
            static __IDEM_SITE: #krate::__private::CallSite = #krate::__private::CallSite::new();
            // A `static`, not a `const`: it points at the site's `static`,
            // which has interior mutability (a `const` may not before Rust 1.90).
            static __IDEM_SPEC: #krate::__private::Spec = #krate::__private::Spec::new(#scope, #kind)
                .site(&__IDEM_SITE)
                .ttl(#krate::__private::Duration::from_millis(#ttl))
                .lease(#krate::__private::Duration::from_millis(#lease))
                #wait
                #event_label;
            #checks
            #dispatch
            let __idem_key = {
                let mut __idem_key = #krate::__private::key_builder(__IDEM_SPEC.scope);
                #event
                #key_parts
                __idem_key.finish()
            };
            let __idem_fp = #fingerprint;
            #store
            #args
            let __idem_body = #body;
            #call.await
        }
        #recovery_item
    }
}

/// `::idem_runtime`, or the path given with `crate = "…"`.
pub(crate) fn runtime_path(custom: Option<Path>) -> Path {
    custom.unwrap_or_else(|| {
        let ident = syn::Ident::new("idem_runtime", Span::call_site());
        syn::parse_quote!(::#ident)
    })
}
