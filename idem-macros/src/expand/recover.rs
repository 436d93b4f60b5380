//! `recover`'s expansion: the arguments encoded with the claim, and the
//! hidden registration item `recoverable!` names.

use proc_macro2::{Span, TokenStream};
use quote::{quote, quote_spanned};
use syn::spanned::Spanned;
use syn::{ItemFn, Path};

use super::respan;
use crate::check::recover::Recover;

/// With `recover`: each argument's type checked on its own token, then the
/// arguments encoded (before the body takes them) as a JSON array in
/// parameter order.
pub(super) fn encode_args(recover: &Recover<'_>, krate: &Path) -> TokenStream {
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
pub(super) fn recovery_item(
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
        return quote! {
            #[doc = #doc]
            #[doc(hidden)]
            #[allow(non_snake_case, clippy::all)]
            #vis fn #item(
                service: impl #krate::__private::RecoveryService<Self>,
            ) -> #krate::__private::Recoverable {
                let __idem_service: #krate::__private::Arc<Self> = service.into_service();
                #krate::__private::Recoverable::new(#scope, move |__idem_json: &[u8]| {
                    #decode
                    let __idem_this = #krate::__private::Arc::clone(&__idem_service);
                    let __idem_call: #krate::__private::Prepared = #krate::__private::Box::pin(async move {
                        #krate::__private::recovery_end(__idem_this.#name(#(#call_args),*).await)
                    });
                    #krate::__private::Ok(__idem_call)
                })
            }
        };
    }
    // A free function: the hidden fn, for `recoverable!(module::f)`, and a
    // trait of the same name implemented for `()`, for `recoverable!(f)`:
    // a method of a trait in scope, where `f` is (see `recoverable`).
    quote! {
        #[doc = #doc]
        #[doc(hidden)]
        #[allow(non_snake_case, clippy::all)]
        #vis fn #item(no_service: ()) -> #krate::__private::Recoverable {
            let () = no_service;
            #krate::__private::Recoverable::new(#scope, |__idem_json: &[u8]| {
                #decode
                let __idem_call: #krate::__private::Prepared = #krate::__private::Box::pin(async move {
                    #krate::__private::recovery_end(#name(#(#call_args),*).await)
                });
                #krate::__private::Ok(__idem_call)
            })
        }

        #[doc = #doc]
        #[doc(hidden)]
        #[allow(non_camel_case_types, non_snake_case, clippy::all)]
        #vis trait #item {
            fn #item(self, no_service: ()) -> #krate::__private::Recoverable;
        }

        #[allow(non_snake_case, clippy::all)]
        impl #item for () {
            fn #item(self, no_service: ()) -> #krate::__private::Recoverable {
                #item(no_service)
            }
        }
    }
}

/// `recoverable!(create_order)` or `recoverable!(Service::create_order,
/// service)`: the hidden item beside the function, called.
///
/// A function without `recover` has no such item, and a call of a missing
/// item is a resolution error rustc words as "cannot find function": so the
/// expansion brings a fallback of the same name, found only when the real
/// one is not, whose bound fails with a message that says to add `recover`.
/// For `recoverable!(f)` the real item is a method of a trait implemented
/// for `()` (found where `f` is defined, in a module or a block) and the
/// fallback a method on `&T`, which method resolution reaches one autoref
/// later; for `Type::method` the real item is inherent and the fallback a
/// trait's, which resolution reaches after the inherent ones. (For
/// `module::f` the hidden fn is named by its path, and a missing one is
/// rustc's "cannot find function": modules have no fallback.)
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
    let text = quote::ToTokens::to_token_stream(&path)
        .to_string()
        .replace(' ', "");
    let unqualified = path.segments.len() == 1 && path.leading_colon.is_none();
    let last = path.segments.last_mut().ok_or_else(|| {
        syn::Error::new(
            Span::call_site(),
            "name the function: recoverable!(create_order)",
        )
    })?;
    // On the user's token: a function without `recover` is reported there.
    let span = last.ident.span();
    let hidden = syn::Ident::new(&format!("__idem_recover_{}", last.ident), span);
    last.ident = hidden.clone();
    let arg = match &service {
        Some(service) => quote!(#service),
        // On the function's name too: an error about the missing service
        // (or `recover`) points there.
        None => quote_spanned!(span=> ()),
    };
    let message = format!("`{text}` has no `recover`: there is no recovery to register");
    // Where a function that has `recover` may still not be found.
    let where_note = match (&service, unqualified) {
        (Some(_), _) => None,
        (None, true) => Some(format!(
            "a function with `recover` that is defined in another module is named by its path: `recoverable!(module::{text})`"
        )),
        (None, false) => Some(
            "a `&self` method is registered with the service it runs on: `recoverable!(Service::method, service)`"
                .to_owned(),
        ),
    };
    let where_note = where_note.map(|note| quote!(, note = #note));
    let (fallback, call) = if unqualified {
        (
            quote! {
                #[allow(non_camel_case_types, dead_code)]
                trait __idem_fallback: ::core::marker::Sized {
                    fn #hidden<__M: __idem_no_recover, __R>(self, _: __M) -> __R {
                        ::core::unreachable!()
                    }
                }
                impl<__T: ?::core::marker::Sized> __idem_fallback for &__T {}
            },
            quote_spanned!(span=> ().#hidden(#arg)),
        )
    } else {
        (
            quote! {
                // The bound on `Self`, the type named before the function:
                // the error is drawn on that path, not on the service.
                #[allow(non_camel_case_types, dead_code)]
                trait __idem_fallback {
                    fn #hidden<__S, __R>(_: __S) -> __R
                    where
                        Self: __idem_no_recover,
                    {
                        ::core::unreachable!()
                    }
                }
                impl<__T: ?::core::marker::Sized> __idem_fallback for __T {}
            },
            quote_spanned!(span=> #path(#arg)),
        )
    };
    Ok(quote! {{
        #[allow(non_camel_case_types, dead_code)]
        #[diagnostic::on_unimplemented(
            message = #message,
            label = "registered here",
            note = "add `recover` to its attribute, `#[idempotent(…, recover)]`: the call's arguments are then stored with its claim, and a worker finishes the call when its caller never comes back"
            #where_note
        )]
        trait __idem_no_recover {}
        #[allow(dead_code)]
        enum __IdemNever {}
        #[diagnostic::do_not_recommend]
        impl __idem_no_recover for __IdemNever {}
        #fallback
        #call
    }})
}
