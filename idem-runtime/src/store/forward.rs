//! `forward_store!`: `impl Store` for a handle by forwarding every method to
//! the store it holds. Declared first in `store/mod.rs` (`#[macro_use]`), so
//! every store module after it can use it.

/// `impl Store` by forwarding every method to another store: for a handle
/// type whose state is an `Arc` of a store (`forward_store!(MemoryStore =>
/// inner)`, with `AsStore`), and for `Arc<S>` itself. [`Store::share`]
/// hands out the `Arc` that is already there instead of wrapping a clone in
/// a new one, so a call on the handle allocates nothing to make its steps'
/// [`StoreRef`].
macro_rules! forward_store {
    ($handle:ty => $field:ident) => {
        forward_store!(
            @impl [] $handle, this => &*this.$field,
            share: $crate::store::StoreRef::from_arc(::std::sync::Arc::clone(&this.$field))
        );

        impl $crate::store::AsStore for $handle {
            type Store = $handle;

            fn as_store(&self) -> $handle {
                self.clone()
            }
        }
    };
    (@impl [$($g:tt)*] $ty:ty, $this:ident => $target:expr, share: $share:expr) => {
        impl<$($g)*> $crate::store::Store for $ty {
            fn backend(&self) -> &'static str {
                let $this = self;
                $crate::store::Store::backend($target)
            }

            fn max_result_bytes(&self) -> usize {
                let $this = self;
                $crate::store::Store::max_result_bytes($target)
            }

            fn share(&self) -> $crate::store::StoreRef {
                let $this = self;
                $share
            }

            fn claim(
                &self,
                req: $crate::store::ClaimRequest<'_>,
            ) -> impl ::std::future::Future<Output = Result<$crate::store::Claim, $crate::StoreError>>
            + Send {
                let $this = self;
                $crate::store::Store::claim($target, req)
            }

            fn complete(
                &self,
                key: &$crate::Key,
                token: $crate::store::Token,
                completion: $crate::store::Completion<'_>,
            ) -> impl ::std::future::Future<Output = Result<bool, $crate::StoreError>> + Send {
                let $this = self;
                $crate::store::Store::complete($target, key, token, completion)
            }

            fn release(
                &self,
                key: &$crate::Key,
                token: $crate::store::Token,
            ) -> impl ::std::future::Future<Output = Result<bool, $crate::StoreError>> + Send {
                let $this = self;
                $crate::store::Store::release($target, key, token)
            }

            fn renew(
                &self,
                key: &$crate::Key,
                token: $crate::store::Token,
                lease: ::std::time::Duration,
            ) -> impl ::std::future::Future<Output = Result<bool, $crate::StoreError>> + Send {
                let $this = self;
                $crate::store::Store::renew($target, key, token, lease)
            }

            fn inspect(
                &self,
                key: &$crate::Key,
            ) -> impl ::std::future::Future<
                Output = Result<Option<$crate::store::RecordInfo>, $crate::StoreError>,
            > + Send {
                let $this = self;
                $crate::store::Store::inspect($target, key)
            }

            fn evict(
                &self,
                key: &$crate::Key,
            ) -> impl ::std::future::Future<Output = Result<bool, $crate::StoreError>> + Send {
                let $this = self;
                $crate::store::Store::evict($target, key)
            }

            fn purge_expired(
                &self,
                limit: usize,
            ) -> impl ::std::future::Future<Output = Result<u64, $crate::StoreError>> + Send {
                let $this = self;
                $crate::store::Store::purge_expired($target, limit)
            }

            fn stats(
                &self,
            ) -> impl ::std::future::Future<
                Output = Result<$crate::store::RecordStats, $crate::StoreError>,
            > + Send {
                let $this = self;
                $crate::store::Store::stats($target)
            }

            fn claim_recoverable(
                &self,
                req: $crate::store::ClaimRequest<'_>,
                recovery: $crate::store::RecoveryArgs<'_>,
            ) -> impl ::std::future::Future<Output = Result<$crate::store::Claim, $crate::StoreError>>
            + Send {
                let $this = self;
                $crate::store::Store::claim_recoverable($target, req, recovery)
            }

            fn recovery_scopes(
                &self,
            ) -> impl ::std::future::Future<Output = Result<Vec<String>, $crate::StoreError>> + Send
            {
                let $this = self;
                $crate::store::Store::recovery_scopes($target)
            }

            fn abandoned(
                &self,
                scope: &str,
                limit: usize,
            ) -> impl ::std::future::Future<
                Output = Result<Vec<$crate::store::Abandoned>, $crate::StoreError>,
            > + Send {
                let $this = self;
                $crate::store::Store::abandoned($target, scope, limit)
            }

            fn take_recovery(
                &self,
                key: &$crate::Key,
                turn: $crate::store::RecoveryTurn<'_>,
            ) -> impl ::std::future::Future<Output = Result<$crate::store::Turn, $crate::StoreError>>
            + Send {
                let $this = self;
                $crate::store::Store::take_recovery($target, key, turn)
            }

            fn recovery_info(
                &self,
                key: &$crate::Key,
            ) -> impl ::std::future::Future<
                Output = Result<Option<$crate::store::RecoveryInfo>, $crate::StoreError>,
            > + Send {
                let $this = self;
                $crate::store::Store::recovery_info($target, key)
            }

            fn retry_recovery(
                &self,
                key: &$crate::Key,
            ) -> impl ::std::future::Future<Output = Result<bool, $crate::StoreError>> + Send {
                let $this = self;
                $crate::store::Store::retry_recovery($target, key)
            }
        }

    };
}
