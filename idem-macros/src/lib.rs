//! The attribute macros of idem. Depend on `idem-runtime`, which re-exports
//! them; the generated code needs it.
//!
//! Each macro is three stages, in three modules: `args` parses the options,
//! `check` applies the misuse catalog, `expand` generates code. Problems from
//! the first two are collected and reported together, and the original function
//! is emitted beside them, so the user sees those errors and not a cascade of
//! "cannot find function" errors at every call site.

mod args;
mod check;
mod duration_literal;
mod errors;
mod expand;
mod param_bindings;
mod segments;
mod suggest;

use proc_macro::TokenStream;
use proc_macro2::TokenStream as TokenStream2;
use quote::quote;
use syn::ItemFn;

use errors::Errors;

/// Makes an async fn returning `Result<T, E>` idempotent. See `idem_runtime`.
#[proc_macro_attribute]
pub fn idempotent(attr: TokenStream, item: TokenStream) -> TokenStream {
    let item2 = TokenStream2::from(item.clone());
    let func: ItemFn = match syn::parse(item) {
        Ok(f) => f,
        Err(e) => return with_errors(item2, e.to_compile_error()),
    };
    let mut errors = Errors::default();
    let mut args = args::parse_idempotent(attr.into(), &mut errors);
    let krate = expand::runtime_path(args.krate.take());
    let plan = check::idempotent(args, &func, &mut errors);
    if !errors.is_empty() {
        return with_errors(item2, errors.into_compile_errors());
    }
    expand::idempotent(&plan, &func, &krate).into()
}

/// Marks an async fn as a named step of an idempotent flow. See `idem_runtime`.
#[proc_macro_attribute]
pub fn step(attr: TokenStream, item: TokenStream) -> TokenStream {
    let item2 = TokenStream2::from(item.clone());
    let func: ItemFn = match syn::parse(item) {
        Ok(f) => f,
        Err(e) => return with_errors(item2, e.to_compile_error()),
    };
    let mut errors = Errors::default();
    let mut args = args::parse_step(attr.into(), &mut errors);
    let krate = expand::runtime_path(args.krate.take());
    let (ok, err) = check::step(&args, &func, &mut errors);
    match args.name {
        Some(name) if errors.is_empty() => expand::step(&name, ok, err, &func, &krate).into(),
        _ => with_errors(item2, errors.into_compile_errors()),
    }
}

/// The item unchanged, plus the errors: one clear report instead of fifty.
fn with_errors(item: TokenStream2, errors: TokenStream2) -> TokenStream {
    quote!(#item #errors).into()
}
