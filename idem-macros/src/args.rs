//! Stage 1: parse the attribute's options. Only syntax here; what the options
//! mean together is checked in `check`.

use proc_macro2::TokenStream;
use syn::ext::IdentExt;
use syn::parse::{Parse, ParseStream, Parser};
use syn::{Expr, Ident, LitStr, Token};

use crate::errors::Errors;

/// The options of `#[idempotent(…)]`, as written.
#[derive(Default)]
pub(crate) struct IdempotentArgs {
    pub key: Option<LitStr>,
    pub ttl: Option<LitStr>,
    pub lease: Option<LitStr>,
    pub scope: Option<LitStr>,
    pub store: Option<Expr>,
    pub consumer: Option<Ident>,
    pub event: Option<LitStr>,
    pub fingerprint: Option<LitStr>,
    pub wait: Option<LitStr>,
    pub allow: Option<LitStr>,
    pub final_err: Option<Expr>,
    pub tx: Option<Expr>,
    /// `recover`: store the arguments with the claim for a recovery worker.
    pub recover: Option<Ident>,
    pub krate: Option<syn::Path>,
}

pub(crate) const IDEMPOTENT_OPTIONS: &[&str] = &[
    "key",
    "ttl",
    "lease",
    "scope",
    "store",
    "consumer",
    "event",
    "fingerprint",
    "wait",
    "allow",
    "final_err",
    "tx",
    "recover",
    "crate",
];

/// One `name`, `name = value` item of an attribute.
struct Item {
    name: Ident,
    value: Option<Expr>,
}

impl Parse for Item {
    fn parse(input: ParseStream) -> syn::Result<Self> {
        // `crate` is a keyword; accept it as an option name like serde does.
        let name = input.call(Ident::parse_any)?;
        let value = if input.peek(Token![=]) {
            input.parse::<Token![=]>()?;
            Some(input.parse()?)
        } else {
            None
        };
        Ok(Item { name, value })
    }
}

fn items(tokens: TokenStream) -> syn::Result<Vec<Item>> {
    let parser = syn::punctuated::Punctuated::<Item, Token![,]>::parse_terminated;
    Ok(parser.parse2(tokens)?.into_iter().collect())
}

fn lit_str(item: &Item, errors: &mut Errors) -> Option<LitStr> {
    match &item.value {
        Some(Expr::Lit(syn::ExprLit {
            lit: syn::Lit::Str(s),
            ..
        })) => Some(s.clone()),
        Some(other) => {
            errors.error(
                other,
                format!(
                    "`{}` takes a string, e.g. {}",
                    item.name,
                    example(&item.name)
                ),
            );
            None
        }
        None => {
            errors.error(
                &item.name,
                format!(
                    "`{}` needs a value, e.g. {}",
                    item.name,
                    example(&item.name)
                ),
            );
            None
        }
    }
}

/// An expression option may also be written as a string, serde style.
fn expr(item: &Item, errors: &mut Errors) -> Option<Expr> {
    match &item.value {
        Some(Expr::Lit(syn::ExprLit {
            lit: syn::Lit::Str(s),
            ..
        })) => match s.parse::<Expr>() {
            Ok(e) => Some(e),
            Err(e) => {
                errors.error(s, format!("`{}` is not an expression: {e}", item.name));
                None
            }
        },
        Some(e) => Some(e.clone()),
        None => {
            errors.error(
                &item.name,
                format!(
                    "`{}` needs a value, e.g. {}",
                    item.name,
                    example(&item.name)
                ),
            );
            None
        }
    }
}

fn example(name: &Ident) -> &'static str {
    match name.to_string().as_str() {
        "key" => "key = \"req.user_id|req.client_order_no\"",
        "ttl" => "ttl = \"24h\"",
        "lease" => "lease = \"30s\"",
        "wait" => "wait = \"2s\"",
        "scope" => "scope = \"orders.create\"",
        "event" => "event = \"SETTLE\"",
        "fingerprint" => "fingerprint = \"req.amount|req.currency\"",
        "allow" => "allow = \"settle_date\"",
        "store" => "store = self.idem_store.clone()",
        "final_err" => "final_err = AppError::is_final",
        "tx" => "tx = tx (a `&mut sqlx::Transaction` parameter)",
        "crate" => "crate = \"my_reexport::idem_runtime\"",
        "compensate" => "compensate = \"restore_stock\"",
        _ => "name = value",
    }
}

/// `crate = "…"`: a string that must hold a path. Shared by both attributes so
/// neither falls back to `::idem_runtime` on a typo.
fn crate_path(item: &Item, errors: &mut Errors) -> Option<syn::Path> {
    let s = lit_str(item, errors)?;
    match s.parse::<syn::Path>() {
        Ok(p) => Some(p),
        Err(_) => {
            errors.error(
                &s,
                "`crate` takes a path, e.g. crate = \"my_reexport::idem_runtime\"",
            );
            None
        }
    }
}

/// Sets an option once; a repeat is an error on the repeated name.
fn set_once<T>(slot: &mut Option<T>, value: Option<T>, name: &Ident, errors: &mut Errors) {
    if slot.is_some() {
        errors.error(name, format!("`{name}` is given twice; keep one"));
    } else {
        *slot = value;
    }
}

pub(crate) fn parse_idempotent(tokens: TokenStream, errors: &mut Errors) -> IdempotentArgs {
    let mut args = IdempotentArgs::default();
    let items = match items(tokens) {
        Ok(items) => items,
        Err(e) => {
            errors.push(e);
            return args;
        }
    };
    for item in items {
        let name = item.name.to_string();
        match name.as_str() {
            "key" => set_once(&mut args.key, lit_str(&item, errors), &item.name, errors),
            "ttl" => set_once(&mut args.ttl, lit_str(&item, errors), &item.name, errors),
            "lease" => set_once(&mut args.lease, lit_str(&item, errors), &item.name, errors),
            "scope" => set_once(&mut args.scope, lit_str(&item, errors), &item.name, errors),
            "event" => set_once(&mut args.event, lit_str(&item, errors), &item.name, errors),
            "wait" => set_once(&mut args.wait, lit_str(&item, errors), &item.name, errors),
            "allow" => set_once(&mut args.allow, lit_str(&item, errors), &item.name, errors),
            "fingerprint" => set_once(
                &mut args.fingerprint,
                lit_str(&item, errors),
                &item.name,
                errors,
            ),
            "store" => set_once(&mut args.store, expr(&item, errors), &item.name, errors),
            "final_err" => set_once(&mut args.final_err, expr(&item, errors), &item.name, errors),
            "tx" => set_once(&mut args.tx, expr(&item, errors), &item.name, errors),
            "crate" => set_once(
                &mut args.krate,
                crate_path(&item, errors),
                &item.name,
                errors,
            ),
            "consumer" | "recover" => {
                if let Some(v) = &item.value {
                    errors.error(
                        v,
                        format!("`{name}` is a flag and takes no value: write `{name}`"),
                    );
                }
                let slot = if name == "consumer" {
                    &mut args.consumer
                } else {
                    &mut args.recover
                };
                set_once(slot, Some(item.name.clone()), &item.name, errors);
            }
            _ => errors.error(&item.name, unknown(&name, IDEMPOTENT_OPTIONS)),
        }
    }
    args
}

fn unknown(name: &str, known: &[&str]) -> String {
    let mut msg = format!("unknown option `{name}`");
    if let Some(best) = crate::suggest::closest(name, known.iter().copied()) {
        msg.push_str(&format!("; did you mean `{best}`?"));
    }
    msg.push_str(&format!("\nhelp: the options are: {}", known.join(", ")));
    msg
}

/// The options of `#[step(…)]`.
pub(crate) struct StepArgs {
    pub name: Option<LitStr>,
    /// `compensate = "restore_stock"`: what undoes the step when its flow gives up.
    pub compensate: Option<LitStr>,
    /// `key = "item.sku"`: the arguments that tell one call of the step in a
    /// loop from the next (see `check::step`).
    pub key: Option<LitStr>,
    /// `allow = "…"`: exempts key segments from the misuse checks.
    pub allow: Option<LitStr>,
    pub krate: Option<syn::Path>,
}

pub(crate) fn parse_step(tokens: TokenStream, errors: &mut Errors) -> StepArgs {
    let mut args = StepArgs {
        name: None,
        compensate: None,
        key: None,
        allow: None,
        krate: None,
    };
    let parser = |input: ParseStream| -> syn::Result<()> {
        if input.peek(LitStr) {
            args.name = Some(input.parse()?);
            if input.is_empty() {
                return Ok(());
            }
            input.parse::<Token![,]>()?;
        }
        for item in syn::punctuated::Punctuated::<Item, Token![,]>::parse_terminated(input)? {
            match item.name.to_string().as_str() {
                "crate" => set_once(
                    &mut args.krate,
                    crate_path(&item, errors),
                    &item.name,
                    errors,
                ),
                "name" => {
                    let name = lit_str(&item, errors);
                    set_once(&mut args.name, name, &item.name, errors);
                }
                "compensate" => {
                    let compensation = lit_str(&item, errors);
                    set_once(&mut args.compensate, compensation, &item.name, errors);
                }
                "key" => {
                    let key = lit_str(&item, errors);
                    set_once(&mut args.key, key, &item.name, errors);
                }
                "allow" => {
                    let allow = lit_str(&item, errors);
                    set_once(&mut args.allow, allow, &item.name, errors);
                }
                other => errors.error(
                    &item.name,
                    unknown(other, &["name", "key", "allow", "compensate", "crate"]),
                ),
            }
        }
        Ok(())
    };
    if let Err(e) = parser.parse2(tokens) {
        errors.push(e);
    }
    args
}
