//! The names a function's parameters bind, with their declared types where the
//! binding is the whole parameter.

use syn::{FnArg, Pat, Signature, Type};

pub(crate) struct Binding<'a> {
    pub name: String,
    /// `Some` when the binding is the whole parameter (`at: SystemTime`), `None`
    /// inside a pattern (`Json(req): Json<T>` binds `req` of an unwritten type).
    pub ty: Option<&'a Type>,
}

pub(crate) fn bindings(sig: &Signature) -> Vec<Binding<'_>> {
    let mut out = Vec::new();
    for arg in &sig.inputs {
        match arg {
            FnArg::Receiver(_) => out.push(Binding {
                name: "self".into(),
                ty: None,
            }),
            FnArg::Typed(pt) => match &*pt.pat {
                Pat::Ident(pi) if pi.subpat.is_none() => out.push(Binding {
                    name: pi.ident.to_string(),
                    ty: Some(&pt.ty),
                }),
                pat => collect(pat, &mut out),
            },
        }
    }
    out
}

fn collect<'a>(pat: &Pat, out: &mut Vec<Binding<'a>>) {
    match pat {
        Pat::Ident(pi) => {
            out.push(Binding {
                name: pi.ident.to_string(),
                ty: None,
            });
            if let Some((_, sub)) = &pi.subpat {
                collect(sub, out);
            }
        }
        Pat::Tuple(t) => t.elems.iter().for_each(|p| collect(p, out)),
        Pat::TupleStruct(t) => t.elems.iter().for_each(|p| collect(p, out)),
        Pat::Struct(s) => s.fields.iter().for_each(|f| collect(&f.pat, out)),
        Pat::Reference(r) => collect(&r.pat, out),
        Pat::Slice(s) => s.elems.iter().for_each(|p| collect(p, out)),
        Pat::Type(t) => collect(&t.pat, out),
        Pat::Paren(p) => collect(&p.pat, out),
        Pat::Or(o) => {
            if let Some(first) = o.cases.first() {
                collect(first, out);
            }
        }
        _ => {}
    }
}
