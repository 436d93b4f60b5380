//! Stage 2: the misuse catalog. Every rule here is a compile error with its
//! span on the offending token and a message that says what to do instead
//! (each has a trybuild case under `tests/ui`).

mod axum_responses;
pub(crate) mod clock_types;
mod default_scope;
pub(crate) mod recover;
mod signature;
pub(crate) mod time_like_names;
mod transaction;
mod ttl_lease_wait;
pub(crate) mod unkeyable_types;

use std::collections::HashSet;

use syn::{Expr, ItemFn, LitStr, Type};

use crate::args::{IdempotentArgs, StepArgs};
use crate::errors::Errors;
use crate::param_bindings;
use crate::segments::{self, Segment};

/// Everything expansion needs, validated.
pub(crate) struct Plan<'a> {
    pub key: Vec<Segment>,
    pub fingerprint: Vec<Segment>,
    pub scope: Option<LitStr>,
    pub consumer: bool,
    pub event: Option<LitStr>,
    pub ttl_ms: u64,
    pub lease_ms: u64,
    pub wait_ms: Option<u64>,
    pub store: Option<Expr>,
    pub final_err: Option<Expr>,
    /// The transaction parameter of `tx = …`.
    pub tx: Option<syn::Ident>,
    pub ok_type: Option<&'a Type>,
    pub err_type: Option<&'a Type>,
    /// `recover`: the arguments to store, and how to call the function again.
    pub recover: Option<recover::Recover<'a>>,
}

pub(crate) fn idempotent<'a>(
    args: IdempotentArgs,
    func: &'a ItemFn,
    errors: &mut Errors,
) -> Plan<'a> {
    let result = signature::check(&func.sig, "idempotent", errors);
    let allow = allowed(args.allow.as_ref());
    let consumer = args.consumer.is_some();

    if let (Some(event), false) = (&args.event, consumer) {
        errors.error(
            event,
            "`event` only applies to consumers: add `consumer` (the event type then goes into the key), or drop `event`",
        );
    }
    if let Some(event) = &args.event {
        if event.value().trim().is_empty() {
            errors.error(
                event,
                "`event` is empty: name the event type, e.g. event = \"SETTLE\"",
            );
        }
    }
    default_scope::check(&func.sig, args.scope.is_some(), errors);
    if let Some(scope) = &args.scope {
        if scope.value().trim().is_empty() {
            errors.error(scope, "`scope` is empty: name the namespace of these keys, e.g. scope = \"orders.create\"");
        }
    }

    let key = match &args.key {
        Some(lit) => segments::parse(lit, "key", errors),
        None => {
            errors.at(
                proc_macro2::Span::call_site(),
                "#[idempotent] needs a `key`: name the business fields that identify one intent, e.g. key = \"req.user_id|req.client_order_no\"",
            );
            Vec::new()
        }
    };
    let fingerprint = args
        .fingerprint
        .as_ref()
        .map(|lit| segments::parse(lit, "fingerprint", errors))
        .unwrap_or_default();

    let bindings = param_bindings::bindings(&func.sig);
    for seg in &key {
        check_segment(seg, Role::Key, &bindings, &allow, errors);
    }
    for seg in &fingerprint {
        check_segment(seg, Role::Fingerprint, &bindings, &allow, errors);
    }

    if let Some(lit) = &args.allow {
        check_allow_used(lit, &allow, key.iter().chain(&fingerprint), errors);
    }

    let tx = transaction::check(&args, &bindings, errors);
    let recover = recover::check(&args, func, errors);
    if let Some(r) = &result {
        axum_responses::check(r.ok, errors);
    }

    let durations = ttl_lease_wait::check(
        args.ttl.as_ref(),
        args.lease.as_ref(),
        args.wait.as_ref(),
        consumer,
        allow.contains("ttl"),
        errors,
    );

    Plan {
        key,
        fingerprint,
        scope: args.scope,
        consumer,
        event: args.event,
        ttl_ms: durations.ttl,
        lease_ms: durations.lease,
        wait_ms: durations.wait,
        store: args.store,
        final_err: args.final_err,
        tx,
        ok_type: result.as_ref().map(|r| r.ok),
        err_type: result.and_then(|r| r.err),
        recover,
    }
}

/// The names an `allow = "a|b"` exempts.
fn allowed(allow: Option<&LitStr>) -> HashSet<String> {
    allow
        .map(|l| l.value().split('|').map(|s| s.trim().to_owned()).collect())
        .unwrap_or_default()
}

/// An `allow` entry that exempts nothing is a typo or a leftover, and would
/// silently exempt a segment added later under that name.
fn check_allow_used<'s>(
    lit: &LitStr,
    allow: &HashSet<String>,
    segments: impl Iterator<Item = &'s Segment>,
    errors: &mut Errors,
) {
    let names: HashSet<&str> = segments.flat_map(Segment::names).collect();
    let mut unused: Vec<&str> = allow
        .iter()
        .map(String::as_str)
        .filter(|a| *a != "ttl" && !names.contains(a))
        .collect();
    unused.sort_unstable();
    for name in unused {
        errors.error(
            lit,
            format!(
                "`allow` names `{name}`, but no key or fingerprint segment is named `{name}`: it exempts nothing\n\
                 help: list the exact field or parameter name the misuse check rejected, or remove it"
            ),
        );
    }
}

/// Which option a segment comes from: the same misuse does different harm.
#[derive(Clone, Copy)]
pub(crate) enum Role {
    Key,
    Fingerprint,
}

impl Role {
    pub(crate) fn option(self) -> &'static str {
        match self {
            Role::Key => "key",
            Role::Fingerprint => "fingerprint",
        }
    }

    /// The fields this option is usually built from, for messages.
    pub(crate) fn fields(self) -> &'static str {
        match self {
            Role::Key => "user id, sku, client order number",
            Role::Fingerprint => "amount, currency, items",
        }
    }

    /// What a value that changes on every retry does in this role.
    pub(crate) fn harm(self) -> &'static str {
        match self {
            Role::Key => "so the key never repeats and nothing is deduplicated",
            Role::Fingerprint => {
                "so every retry looks like another payload and is refused as a key reuse"
            }
        }
    }
}

fn check_segment(
    seg: &Segment,
    role: Role,
    bindings: &[param_bindings::Binding<'_>],
    allow: &HashSet<String>,
    errors: &mut Errors,
) {
    let Some(binding) = bindings.iter().find(|b| b.name == seg.root) else {
        let mut msg = format!(
            "{} segment `{}` names no parameter of this function",
            role.option(),
            seg.text
        );
        let names = bindings.iter().map(|b| b.name.as_str());
        if let Some(best) = crate::suggest::closest(&seg.root, names) {
            msg.push_str(&format!("; did you mean `{best}`?"));
        }
        let all: Vec<&str> = bindings.iter().map(|b| b.name.as_str()).collect();
        if all.is_empty() {
            msg.push_str("\nhelp: the function has no parameters to build a key from");
        } else {
            msg.push_str(&format!("\nhelp: the parameters are: {}", all.join(", ")));
        }
        errors.at(seg.span, msg);
        return;
    };
    let leaf = seg.names().last().unwrap_or(&seg.root);
    for name in seg.names() {
        if allow.contains(name) {
            continue;
        }
        let suspicion = time_like_names::judge(name).or_else(|| {
            (name == leaf)
                .then(|| time_like_names::judge_leaf(name))
                .flatten()
        });
        if let Some(suspicion) = suspicion {
            errors.at(
                seg.span,
                time_like_names::message(role, &seg.text, name, suspicion),
            );
            return;
        }
    }
    if let (Some(ty), true) = (binding.ty, seg.fields.is_empty()) {
        if let Some(clock) = clock_types::find(ty) {
            if !allow.contains(&seg.root) {
                errors.error(ty, clock_types::message(role, &seg.root, clock));
            }
        }
    }
}

/// Everything the expansion of `#[step]` needs, validated.
pub(crate) struct StepPlan<'a> {
    pub name: LitStr,
    /// `key = …`: each call's item key is built from these.
    pub key: Vec<Segment>,
    pub ok_type: Option<&'a Type>,
    pub err_type: Option<&'a Type>,
    pub compensation: Option<Compensation>,
}

/// A step's compensation, validated.
pub(crate) enum Compensation {
    /// On a method: `Self::name(&self_clone, output)`.
    Method(LitStr, syn::Ident),
    /// On a free fn: `path(output)`.
    Free(LitStr, syn::Path),
}

/// `None` without a usable name: there is nothing to expand, and the error
/// says so.
pub(crate) fn step<'a>(
    args: StepArgs,
    func: &'a ItemFn,
    errors: &mut Errors,
) -> Option<StepPlan<'a>> {
    let result = signature::check(&func.sig, "step", errors);
    match &args.name {
        None => errors.at(
            proc_macro2::Span::call_site(),
            format!(
                "#[step] needs an explicit name: #[step(\"{}\")]\n\
                 help: a step's name is its identity in the step records; it must survive renaming the function",
                func.sig.ident
            ),
        ),
        Some(name) if name.value().trim().is_empty() => {
            errors.error(name, "the step name is empty: name the step, e.g. #[step(\"deduct_stock\")]")
        }
        Some(_) => {}
    }
    if let Some(r) = &result {
        axum_responses::check(r.ok, errors);
    }
    let compensation = args
        .compensate
        .as_ref()
        .and_then(|lit| compensation(lit, func, errors));
    let key = step_key(&args, func, errors);
    Some(StepPlan {
        name: args.name?,
        key,
        ok_type: result.as_ref().map(|r| r.ok),
        err_type: result.and_then(|r| r.err),
        compensation,
    })
}

/// A step's `key`: the same segments, and the same misuse checks, as an
/// idempotent call's, since they decide whether a retry finds the call's
/// record. `allow` exempts segments from the checks as it does there.
fn step_key(args: &StepArgs, func: &ItemFn, errors: &mut Errors) -> Vec<Segment> {
    let allow = allowed(args.allow.as_ref());
    let key = match &args.key {
        Some(lit) => segments::parse(lit, "key", errors),
        None => Vec::new(),
    };
    let bindings = param_bindings::bindings(&func.sig);
    for seg in &key {
        check_segment(seg, Role::Key, &bindings, &allow, errors);
    }
    if let Some(lit) = &args.allow {
        if args.key.is_none() {
            errors.error(
                lit,
                "`allow` exempts key segments, and this step has no `key`",
            );
        } else {
            check_allow_used(lit, &allow, key.iter(), errors);
        }
    }
    key
}

fn compensation(lit: &LitStr, func: &ItemFn, errors: &mut Errors) -> Option<Compensation> {
    let method = func.sig.receiver().is_some();
    let Ok(mut path) = lit.parse::<syn::Path>() else {
        errors.error(
            lit,
            format!(
                "`compensate` names the async fn that undoes this step, e.g. compensate = \"restore_stock\"; `{}` is not a name",
                lit.value()
            ),
        );
        return None;
    };
    // Spans on the string, so "no function named …" and a mismatched output
    // type are reported on the user's token.
    for seg in &mut path.segments {
        seg.ident.set_span(lit.span());
    }
    if method {
        match path.get_ident() {
            Some(ident) => Some(Compensation::Method(lit.clone(), ident.clone())),
            None => {
                errors.error(
                    lit,
                    "on a method, `compensate` names another method of the same impl, taking `&self` and the step's output: compensate = \"restore_stock\"",
                );
                None
            }
        }
    } else {
        Some(Compensation::Free(lit.clone(), path))
    }
}
