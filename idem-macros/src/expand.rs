//! Stage 3: generate code. Expansions stay thin: they build the key, name the
//! store and hand the body to the runtime, which does the real work.
//!
//! The body is moved, token for token, into an `async move` block, so errors
//! inside it keep pointing at the user's lines.

use proc_macro2::{Group, Span, TokenStream, TokenTree};
use quote::{ToTokens, quote, quote_spanned};
use syn::spanned::Spanned;
use syn::{AttrStyle, Attribute, ItemFn, LitStr, Path, ReturnType};

use crate::check::recover::Recover;
use crate::check::{Compensation, Plan, StepPlan};
use crate::segments::Segment;

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
fn key_parts(segments: &[Segment], krate: &Path) -> TokenStream {
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
fn body_block(func: &ItemFn) -> TokenStream {
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

/// Assertions on the user's own type tokens, so a type that cannot be cached
/// (or, with `final_err`, stored) is reported once, there. With `T` and `E`
/// written out each gets its own check; otherwise (an alias like
/// `io::Result<T>`) the checks take the whole return type and point at it. The
/// protocol call is dispatched (see the runtime's `dispatch` module) so it
/// repeats none of these errors, which is sound only because these assertions
/// are always emitted.
fn type_checks(
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

/// The runtime's path with every token on `span`, so an error in a call through
/// it is drawn on the user's token alone rather than stretched to the attribute.
fn respan(krate: &Path, span: Span) -> TokenStream {
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

fn return_type(func: &ItemFn) -> TokenStream {
    match &func.sig.output {
        ReturnType::Type(_, ty) => quote!(#ty),
        ReturnType::Default => quote!(()),
    }
}

/// `(&Dispatch::<Ret>::new())`: method calls on it pick the checked protocol
/// when the types allow and the silent fallback otherwise.
fn dispatch(krate: &Path, func: &ItemFn) -> TokenStream {
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
fn split_attrs(func: &ItemFn) -> (Vec<&Attribute>, Vec<&Attribute>) {
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
        plan.final_err.is_some(),
    );
    let dispatch = dispatch(krate, func);
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
        (None, Some(pred), None) => quote! {
            __idem_dispatch.execute_keeping_final(
                &__IDEM_SPEC, __idem_store, __idem_key, __idem_fp, #pred, __idem_body,
            )
        },
        (None, None, Some(_)) => quote! {
            __idem_dispatch.execute_recoverable(
                &__IDEM_SPEC, __idem_store, __idem_key, __idem_fp, __idem_args, __idem_body,
            )
        },
        (None, Some(pred), Some(_)) => quote! {
            __idem_dispatch.execute_keeping_final_recoverable(
                &__IDEM_SPEC, __idem_store, __idem_key, __idem_fp, #pred, __idem_args, __idem_body,
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

/// With `recover`: each argument's type checked on its own token, then the
/// arguments encoded (before the body takes them) as a JSON array in
/// parameter order.
fn encode_args(recover: &Recover<'_>, krate: &Path) -> TokenStream {
    let pushes = recover.params.iter().map(|p| {
        let span = p.ty.span();
        let k = respan(krate, span);
        let stored = &p.stored;
        let name = &p.name;
        let value = if p.by_ref {
            quote!(#name)
        } else {
            quote!(&#name)
        };
        quote_spanned! {span=>
            #k::__private::assert_recoverable_arg::<#stored>();
            (&#k::__private::ArgProbe::<#stored>::new()).push(&mut __idem_w, #value);
        }
    });
    quote! {
        let __idem_args = {
            #[allow(unused_imports)]
            use #krate::__private::{ArgSerializeHolds as _, ArgSerializeMissing as _};
            let mut __idem_w = #krate::__private::ArgsWriter::new();
            #(#pushes)*
            __idem_w.finish()
        };
    }
}

/// With `recover`: the hidden item `recoverable!` names, beside the function
/// (in its impl, for a method). It decodes stored arguments into the
/// parameters and calls the function exactly as a caller would.
fn recovery_item(
    recover: &Recover<'_>,
    func: &ItemFn,
    scope: &TokenStream,
    krate: &Path,
) -> TokenStream {
    let name = &func.sig.ident;
    let vis = &func.vis;
    let item = syn::Ident::new(&format!("__idem_recover_{name}"), recover.flag.span());
    let names: Vec<&syn::Ident> = recover.params.iter().map(|p| &p.name).collect();
    let stored = recover.params.iter().map(|p| &p.stored);
    let stored2 = recover.params.iter().map(|p| &p.stored);
    let call_args = recover.params.iter().map(|p| {
        let n = &p.name;
        if p.by_ref { quote!(&#n) } else { quote!(#n) }
    });
    let decode = if names.is_empty() {
        quote!(let _ = __idem_json;)
    } else {
        quote! {
            #[allow(unused_imports)]
            use #krate::__private::{DecodeHolds as _, DecodeMissing as _};
            let (#(#names,)*): (#(#stored,)*) =
                (&#krate::__private::DecodeProbe::<(#(#stored2,)*)>::new()).decode(__idem_json)?;
        }
    };
    let doc = format!(
        "The recovery of [`{name}`] (`#[idempotent(…, recover)]`): what `idem_runtime::recoverable!({name})` registers."
    );
    if recover.method {
        quote! {
            #[doc = #doc]
            #[doc(hidden)]
            #[allow(non_snake_case, clippy::all)]
            #vis fn #item(
                service: impl ::core::convert::Into<#krate::__private::Arc<Self>>,
            ) -> #krate::__private::Recoverable {
                let __idem_service: #krate::__private::Arc<Self> = service.into();
                #krate::__private::Recoverable::new(#scope, move |__idem_json: &[u8]| {
                    #decode
                    let __idem_this = #krate::__private::Arc::clone(&__idem_service);
                    let __idem_call: #krate::__private::Prepared = #krate::__private::Box::pin(async move {
                        #krate::__private::recovery_end(__idem_this.#name(#(#call_args),*).await)
                    });
                    #krate::__private::Ok(__idem_call)
                })
            }
        }
    } else {
        quote! {
            #[doc = #doc]
            #[doc(hidden)]
            #[allow(non_snake_case, clippy::all)]
            #vis fn #item() -> #krate::__private::Recoverable {
                #krate::__private::Recoverable::new(#scope, |__idem_json: &[u8]| {
                    #decode
                    let __idem_call: #krate::__private::Prepared = #krate::__private::Box::pin(async move {
                        #krate::__private::recovery_end(#name(#(#call_args),*).await)
                    });
                    #krate::__private::Ok(__idem_call)
                })
            }
        }
    }
}

/// `recoverable!(create_order)` or `recoverable!(Service::create_order,
/// service)`: the hidden item beside the function, called.
pub(crate) fn recoverable(input: TokenStream) -> syn::Result<TokenStream> {
    let parser = |stream: syn::parse::ParseStream| -> syn::Result<(Path, Option<syn::Expr>)> {
        let path: Path = stream.parse()?;
        let service = if stream.is_empty() {
            None
        } else {
            stream.parse::<syn::Token![,]>()?;
            let service = (!stream.is_empty()).then(|| stream.parse()).transpose()?;
            if !stream.is_empty() {
                stream.parse::<syn::Token![,]>()?;
            }
            service
        };
        Ok((path, service))
    };
    let (mut path, service) = syn::parse::Parser::parse2(parser, input)?;
    let last = path.segments.last_mut().ok_or_else(|| {
        syn::Error::new(
            Span::call_site(),
            "name the function: recoverable!(create_order)",
        )
    })?;
    // On the user's token: a function without `recover` is reported there.
    last.ident = syn::Ident::new(&format!("__idem_recover_{}", last.ident), last.ident.span());
    Ok(match service {
        Some(service) => quote!(#path(#service)),
        None => quote!(#path()),
    })
}

pub(crate) fn step(plan: &StepPlan<'_>, func: &ItemFn, krate: &Path) -> TokenStream {
    let ItemFn { vis, sig, .. } = func;
    let (attrs, inner_attrs) = split_attrs(func);
    let checks = type_checks(krate, func, plan.ok_type, plan.err_type, false);
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
/// string's span so rustc's "no function named …" and "expected `u64`, found
/// `String`" land there. A method's compensation gets a clone of `self`: it
/// runs after the flow's body, when the step's borrow has ended.
fn compensated_call(comp: &Compensation, body: TokenStream, krate: &Path) -> TokenStream {
    let (lit, receiver, call) = match comp {
        Compensation::Method(lit, ident) => {
            let span = lit.span();
            let k = respan(krate, span);
            let receiver = quote_spanned! {span=>
                let __idem_this = #k::__private::compensation_receiver::<Self>(&self);
            };
            let call = quote_spanned!(span=> Self::#ident(&__idem_this, __idem_output));
            (lit, receiver, call)
        }
        Compensation::Free(lit, path) => {
            let span = lit.span();
            (
                lit,
                TokenStream::new(),
                quote_spanned!(span=> #path(__idem_output)),
            )
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

/// `::idem_runtime`, or the path given with `crate = "…"`.
pub(crate) fn runtime_path(custom: Option<Path>) -> Path {
    custom.unwrap_or_else(|| {
        let ident = syn::Ident::new("idem_runtime", Span::call_site());
        syn::parse_quote!(::#ident)
    })
}
