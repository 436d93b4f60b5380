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

