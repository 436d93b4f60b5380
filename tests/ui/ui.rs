//! The misuse catalog (the guide's keys page, "Misuse caught at compile time") as
//! compile-fail cases, and the keys that look suspicious but are fine as pass
//! cases. Each `.stderr` is reviewed: the
//! message names the problem and the fix, and the span sits on the offending
//! token.
//!
//! Compiler output changes between releases, so the suite runs on stable only.
//! Regenerate with `TRYBUILD=overwrite cargo test -p idem-ui --test ui` and
//! read every diff.

#[rustversion::attr(not(stable), ignore)]
#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.compile_fail("fail/*.rs");
    t.pass("pass/*.rs");
}
