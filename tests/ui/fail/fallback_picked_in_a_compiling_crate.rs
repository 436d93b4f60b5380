// The protocol call's fallback is only meant to be picked after a type error.
// Forced in a crate that type-checks (here by naming the hidden API directly),
// it must fail the build rather than become a runtime panic.
use idem_runtime::__private::{AfterTypeError as _, Dispatch, Kind, None, Spec, StoreRef};

const SPEC: Spec = Spec::new("ui.fallback", Kind::Call);

fn main() {
    let key = idem_runtime::Key::builder("ui.fallback").finish();
    let dispatch = &Dispatch::<u32>::new();
    let _never_polled = dispatch.execute(&SPEC, None::<StoreRef>, key, None, async { 1u32 });
}
