//! The rules for `tx = …`: claim inside the caller's database transaction.
//!
//! The option names a parameter passed as `&mut` (the caller commits or rolls
//! back; the body keeps using it), and excludes the options that make no sense
//! once the record lives in that transaction.

use syn::{Expr, Ident, Type};

use crate::args::IdempotentArgs;
use crate::errors::Errors;
use crate::param_bindings::Binding;

pub(crate) fn check(
    args: &IdempotentArgs,
    bindings: &[Binding<'_>],
    errors: &mut Errors,
) -> Option<Ident> {
    let expr = args.tx.as_ref()?;
    let Expr::Path(path) = expr else {
        errors.error(expr, "`tx` names the transaction parameter, e.g. `tx = tx`");
        return None;
    };
    let Some(ident) = path.path.get_ident() else {
        errors.error(expr, "`tx` names the transaction parameter, e.g. `tx = tx`");
        return None;
    };
    let name = ident.to_string();
    let Some(binding) = bindings.iter().find(|b| b.name == name) else {
        let mut msg = format!("`tx = {name}` names no parameter of this function");
        if let Some(best) = crate::suggest::closest(&name, bindings.iter().map(|b| b.name.as_str()))
        {
            msg.push_str(&format!("; did you mean `{best}`?"));
        }
        errors.error(ident, msg);
        return None;
    };
    match binding.ty {
        Some(Type::Reference(r)) if r.mutability.is_some() => {}
        Some(ty) => errors.error(
            ty,
            format!(
                "`tx = {name}` needs the transaction as `&mut`: the body keeps writing on it and the caller commits it\n\
                 help: declare `{name}: &mut sqlx::Transaction<'_, Postgres>` (or `&mut PgConnection`, MySQL and SQLite alike)"
            ),
        ),
        None => errors.error(ident, format!("`tx = {name}` must name a plain parameter, not a binding inside a pattern")),
    }
    if let Some(store) = &args.store {
        errors.error(
            store,
            "`store` and `tx` exclude each other: with `tx` the record is written on the transaction, in the `idem_records` table of that database",
        );
    }
    if let Some(wait) = &args.wait {
        errors.error(
            wait,
            "`wait` has no effect with `tx`: a concurrent duplicate already waits on the record's row lock until this transaction ends, then replays",
        );
    }
    if let Some(final_err) = &args.final_err {
        errors.error(
            final_err,
            "`final_err` is not supported with `tx` yet: in a transaction, return the final outcome as `Ok` (it commits with the business writes)",
        );
    }
    Some(ident.clone())
}
