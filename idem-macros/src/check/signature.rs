//! What the annotated function must look like: async, returning `Result`.

use syn::{GenericArgument, PathArguments, ReturnType, Signature, Type};

use crate::errors::Errors;

/// The `T` and `E` of a `Result<T, E>` return type, when written out.
pub(crate) struct ResultTypes<'a> {
    pub ok: &'a Type,
    pub err: Option<&'a Type>,
}

const RESULT_HELP: &str = "help: return `Result<T, E>` (or an alias of it, like `io::Result<T>` or `AppResult<T>`) with `T: Serialize + DeserializeOwned` and `E: From<idem_runtime::Error>`";

pub(crate) fn check<'a>(
    sig: &'a Signature,
    attr: &str,
    errors: &mut Errors,
) -> Option<ResultTypes<'a>> {
    if sig.asyncness.is_none() && returns_boxed_future(sig) {
        // `#[async_trait]` on the impl expands first and leaves us a plain fn
        // returning `Pin<Box<dyn Future>>`: "needs an async fn" would puzzle a user
        // who wrote `async fn`.
        errors.error(
            sig.fn_token,
            format!(
                "#[{attr}] cannot wrap a method rewritten by #[async_trait]\n\
                 help: use a native `async fn` in the trait (Rust 1.75+) and drop #[async_trait], \
                 or put #[{attr}] on an inherent `async fn` that the trait method calls"
            ),
        );
        return None;
    }
    if sig.asyncness.is_none() {
        let why = if attr == "step" {
            "looking up and recording a step's output are async store round trips"
        } else {
            "claiming and completing the key are async store round trips"
        };
        errors.error(
            sig.fn_token,
            format!(
                "#[{attr}] needs an `async fn`: {why}\n\
                 help: write `async fn {}(…)`",
                sig.ident
            ),
        );
    }
    let ReturnType::Type(_, ty) = &sig.output else {
        errors.error(
            &sig.ident,
            format!(
                "#[{attr}] needs a function returning `Result<T, E>`: `Ok` is stored and replayed, `Err` releases the key for a retry\n{RESULT_HELP}"
            ),
        );
        return None;
    };
    let not_result = || {
        format!(
            "#[{attr}] needs a function returning `Result<T, E>`, found `{}`: `Ok` is stored and replayed, `Err` releases the key for a retry\n{RESULT_HELP}",
            quote::quote!(#ty)
                .to_string()
                .replace(" < ", "<")
                .replace(" >", ">")
                .replace(" ,", ",")
        )
    };
    let Type::Path(path) = &**ty else {
        errors.error(ty, not_result());
        return None;
    };
    let last = path.path.segments.last()?;
    if last.ident != "Result" {
        // `AppResult<T>`, `ServiceResult<T, E>`: by convention an alias of
        // `Result`, whose `T` and `E` only the type system knows; the expansion
        // checks them there (a name that lies gets "`…` is not a `Result<T, E>`").
        if !last.ident.to_string().ends_with("Result") {
            errors.error(ty, not_result());
        }
        return None;
    }
    let PathArguments::AngleBracketed(args) = &last.arguments else {
        return None;
    };
    let mut types = args.args.iter().filter_map(|a| match a {
        GenericArgument::Type(t) => Some(t),
        _ => None,
    });
    let ok = types.next()?;
    Some(ResultTypes {
        ok,
        err: types.next(),
    })
}

/// `Pin<Box<dyn Future<…> + …>>`, the shape `#[async_trait]` gives its methods.
fn returns_boxed_future(sig: &Signature) -> bool {
    let ReturnType::Type(_, ty) = &sig.output else {
        return false;
    };
    let text = quote::quote!(#ty).to_string();
    text.contains("Pin") && text.contains("Future")
}
