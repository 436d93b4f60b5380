//! `#[derive(KeyPart)]`, in the crate's three stages: `parse` reads the
//! `#[key_part]` attributes, `check` holds every field against the misuse
//! catalog (the names of `check::time_like_names`, clock types, floats and
//! maps) and returns the `Plan`, `expand` generates an injective `encode_key`.
//!
//! The encoding, for a fixed type:
//! - a one-field tuple struct (a newtype, `Sku(u64)`) encodes as its field, so
//!   wrapping an id in a newtype keeps its keys;
//! - any other struct writes its field count, then each field in declaration
//!   order;
//! - an enum writes the variant's name, then its field count and fields.
//!
//! Every field's own encoding is prefix-free, and the count (or the name,
//! which fixes the shape) says how many follow, so two different values of
//! one type never share an encoding.

use proc_macro2::{Span, TokenStream};
use quote::{format_ident, quote, quote_spanned};
use syn::ext::IdentExt;
use syn::punctuated::Punctuated;
use syn::spanned::Spanned;
use syn::{Data, DeriveInput, Fields, Generics, Ident, LitStr, Path, Token, Type, Variant};

use crate::check::{clock_types, time_like_names, unkeyable_types};
use crate::errors::Errors;

/// The `#[key_part]` attributes, as written.
pub(crate) struct Args {
    /// `#[key_part(crate = "…")]` on the type.
    pub krate: Option<Path>,
    /// One per field, in declaration order (variant by variant in an enum).
    fields: Vec<FieldArgs>,
}

struct FieldArgs {
    /// Where `#[key_part(allow)]` is, if it is there.
    allow: Option<Span>,
    /// Problems in the field's own attributes. Reported with the field's
    /// checks, so each field's problems read together, in field order.
    errors: Errors,
}

/// Stage 1: the attributes. `allow` is only valid on a field, `crate` only on
/// the type.
pub(crate) fn parse(input: &DeriveInput, errors: &mut Errors) -> Args {
    let mut args = Args {
        krate: None,
        fields: Vec::new(),
    };
    for attr in input.attrs.iter().filter(|a| a.path().is_ident("key_part")) {
        let parsed = attr.parse_nested_meta(|meta| {
            if meta.path.is_ident("crate") {
                let lit: LitStr = meta.value()?.parse()?;
                match lit.parse::<Path>() {
                    Ok(path) if args.krate.is_none() => args.krate = Some(path),
                    Ok(_) => errors.error(&meta.path, "`crate` is given twice; keep one"),
                    Err(_) => errors.error(
                        &lit,
                        "`crate` takes a path, e.g. #[key_part(crate = \"my_reexport::idem_runtime\")]",
                    ),
                }
                Ok(())
            } else if meta.path.is_ident("allow") {
                errors.error(
                    &meta.path,
                    "`allow` goes on the field the misuse check rejected, not on the type: #[key_part(allow)] field: Type",
                );
                Ok(())
            } else {
                Err(meta.error("unknown `key_part` option on a type; the option here is `crate = \"path\"`"))
            }
        });
        if let Err(e) = parsed {
            errors.push(e);
        }
    }
    args.fields = all_fields(input).map(field_args).collect();
    args
}

/// Every field of a struct, or of each variant of an enum in turn.
fn all_fields(input: &DeriveInput) -> impl Iterator<Item = &syn::Field> {
    let (fields, variants) = match &input.data {
        Data::Struct(s) => (Some(&s.fields), None),
        Data::Enum(e) => (None, Some(&e.variants)),
        Data::Union(_) => (None, None),
    };
    fields
        .into_iter()
        .flatten()
        .chain(variants.into_iter().flatten().flat_map(|v| &v.fields))
}

fn field_args(field: &syn::Field) -> FieldArgs {
    let mut errors = Errors::default();
    let mut allow = None;
    for attr in field.attrs.iter().filter(|a| a.path().is_ident("key_part")) {
        let parsed = attr.parse_nested_meta(|meta| {
            if meta.path.is_ident("allow") {
                if allow.is_some() {
                    errors.error(&meta.path, "`allow` is given twice; keep one");
                }
                allow = Some(meta.path.span());
                Ok(())
            } else {
                Err(meta.error(
                    "unknown `key_part` option on a field; the option here is `allow`, which exempts the field's name from the misuse check",
                ))
            }
        });
        if let Err(e) = parsed {
            errors.push(e);
        }
    }
    FieldArgs { allow, errors }
}

/// Everything expansion needs, validated.
pub(crate) struct Plan<'a> {
    ident: &'a Ident,
    generics: &'a Generics,
    shape: Shape<'a>,
}

/// What `encode_key` writes, by the kind of type.
enum Shape<'a> {
    /// A one-field tuple struct: the field alone.
    Newtype(&'a Type),
    /// The field count, then each field.
    Struct(&'a Fields),
    /// The variant's name, then its field count and fields.
    Enum(&'a Punctuated<Variant, Token![,]>),
}

/// Stage 2: every field against the misuse catalog. `None` for a union,
/// which has no encoding to generate.
pub(crate) fn check<'a>(
    args: Args,
    input: &'a DeriveInput,
    errors: &mut Errors,
) -> Option<Plan<'a>> {
    let ty_name = input.ident.to_string();
    let mut fields = args.fields.into_iter();
    let shape = match &input.data {
        Data::Struct(s) => {
            for ((i, f), a) in s.fields.iter().enumerate().zip(&mut fields) {
                check_field(&ty_name, i, f, a, errors);
            }
            match &s.fields {
                // A newtype is its field: `Sku(u64)` keys like the `u64` it wraps.
                Fields::Unnamed(u) if u.unnamed.len() == 1 => {
                    Shape::Newtype(&u.unnamed.first().expect("one field").ty)
                }
                other => Shape::Struct(other),
            }
        }
        Data::Enum(e) => {
            for v in &e.variants {
                for ((i, f), a) in v.fields.iter().enumerate().zip(&mut fields) {
                    let name = format!("{ty_name}::{}", v.ident);
                    check_field(&name, i, f, a, errors);
                }
            }
            Shape::Enum(&e.variants)
        }
        Data::Union(u) => {
            errors.error(
                u.union_token,
                "`KeyPart` cannot be derived for a union: which field holds the value is not known, so it has no stable encoding",
            );
            return None;
        }
    };
    Some(Plan {
        ident: &input.ident,
        generics: &input.generics,
        shape,
    })
}

/// One field against the misuse catalog, after the problems of its attributes.
fn check_field(
    ty_name: &str,
    index: usize,
    field: &syn::Field,
    args: FieldArgs,
    errors: &mut Errors,
) {
    errors.append(args.errors);
    let allow = args.allow;
    let label = match &field.ident {
        Some(ident) => format!("`{}`", ident.unraw()),
        None => format!("{index}"),
    };
    if let Some((found, why)) = unkeyable_types::find(&field.ty) {
        errors.error(
            &field.ty,
            unkeyable_types::message(ty_name, &label, found, why),
        );
    }
    let name = field.ident.as_ref().map(|i| i.unraw().to_string());
    let suspicion = name.as_deref().and_then(time_like_names::judge_value_name);
    let clock = clock_types::find(&field.ty);
    match (allow, &field.ident, name.as_deref()) {
        (None, Some(ident), Some(name)) => {
            if let Some(suspicion) = suspicion {
                errors.error(
                    ident,
                    time_like_names::field_message(ty_name, name, suspicion),
                );
            } else if let Some(clock) = clock {
                errors.error(&field.ty, clock_types::field_message(ty_name, name, clock));
            }
        }
        (None, _, _) => {
            if let Some(clock) = clock {
                errors.error(&field.ty, clock_types::field_message(ty_name, &label, clock));
            }
        }
        // An exemption that exempts nothing is a typo or a leftover, and would
        // silently exempt a name given to the field later.
        (Some(span), _, _) if suspicion.is_none() => errors.at(
            span,
            format!(
                "`#[key_part(allow)]` on field {label} of `{ty_name}` exempts nothing: its name passes the misuse check\n\
                 help: remove it; it is only for a field whose name the check rejects but whose value is fixed per intent"
            ),
        ),
        (Some(_), _, _) => {}
    }
}

/// `field` or `field_0`: the binding a field gets in the generated `match`.
fn binding(index: usize, field: &syn::Field) -> Ident {
    match &field.ident {
        Some(ident) => format_ident!("__idem_{}", ident.unraw()),
        None => format_ident!("__idem_{}", index),
    }
}

/// One set of fields: the count, then each field, each call spanned
/// on the field's type so an unsupported type is reported there.
fn encode_fields(krate: &Path, fields: &Fields) -> TokenStream {
    let count = fields.len();
    let each = fields.iter().enumerate().map(|(i, f)| {
        let b = binding(i, f);
        let ty = &f.ty;
        quote_spanned!(ty.span()=> <#ty as #krate::KeyPart>::encode_key(#b, __idem_enc);)
    });
    quote! {
        __idem_enc.write_seq_len(#count);
        #(#each)*
    }
}

fn pattern(path: TokenStream, fields: &Fields) -> TokenStream {
    let bindings = fields.iter().enumerate().map(|(i, f)| binding(i, f));
    match fields {
        Fields::Named(named) => {
            let names = named.named.iter().map(|f| &f.ident);
            quote!(#path { #(#names: #bindings),* })
        }
        Fields::Unnamed(_) => quote!(#path ( #(#bindings),* )),
        Fields::Unit => path,
    }
}

/// Stage 3: the `KeyPart` impl.
pub(crate) fn expand(plan: &Plan<'_>, krate: &Path) -> TokenStream {
    let body = match &plan.shape {
        Shape::Newtype(ty) => {
            quote_spanned!(ty.span()=> <#ty as #krate::KeyPart>::encode_key(&self.0, __idem_enc);)
        }
        Shape::Struct(fields) => {
            let pat = pattern(quote!(Self), fields);
            let fields = encode_fields(krate, fields);
            quote! {
                let #pat = self;
                #fields
            }
        }
        Shape::Enum(variants) if variants.is_empty() => quote!(match *self {}),
        Shape::Enum(variants) => {
            let arms = variants.iter().map(|v| {
                let ident = &v.ident;
                let name = ident.unraw().to_string();
                let pat = pattern(quote!(Self::#ident), &v.fields);
                let fields = encode_fields(krate, &v.fields);
                quote! {
                    #pat => {
                        __idem_enc.write_str(#name);
                        #fields
                    }
                }
            });
            quote! {
                match self {
                    #(#arms)*
                }
            }
        }
    };
    let ident = plan.ident;
    let mut generics = plan.generics.clone();
    for param in generics.type_params_mut() {
        param.bounds.push(syn::parse_quote!(#krate::KeyPart));
    }
    let (impl_generics, ty_generics, where_clause) = generics.split_for_impl();
    quote! {
        #[automatically_derived]
        impl #impl_generics #krate::KeyPart for #ident #ty_generics #where_clause {
            #[allow(unused_variables, clippy::unit_arg)]
            fn encode_key(&self, __idem_enc: &mut #krate::KeyEncoder) {
                #body
            }
        }
    }
}
