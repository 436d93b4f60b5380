//! [`Store`] behind a pointer of unknown type: what [`super::StoreRef`]
//! holds. `Store`'s methods return `impl Future`, which a trait object
//! cannot; this companion returns each future boxed, and every store is one.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use super::{
    Abandoned, Claim, ClaimRequest, Completion, RecordInfo, RecordStats, RecoveryArgs,
    RecoveryInfo, RecoveryTurn, Store, Token, Turn,
};
use crate::error::StoreError;
use crate::key::Key;

type Boxed<'a, T> = Pin<Box<dyn Future<Output = Result<T, StoreError>> + Send + 'a>>;

pub(crate) trait DynStore: Send + Sync + 'static {
    fn backend(&self) -> &'static str;
    fn max_result_bytes(&self) -> usize;
    fn claim<'a>(&'a self, req: ClaimRequest<'a>) -> Boxed<'a, Claim>;
    fn complete<'a>(
        &'a self,
        key: &'a Key,
        token: Token,
        completion: Completion<'a>,
    ) -> Boxed<'a, bool>;
    fn release<'a>(&'a self, key: &'a Key, token: Token) -> Boxed<'a, bool>;
    fn renew<'a>(&'a self, key: &'a Key, token: Token, lease: Duration) -> Boxed<'a, bool>;
    fn inspect<'a>(&'a self, key: &'a Key) -> Boxed<'a, Option<RecordInfo>>;
    fn evict<'a>(&'a self, key: &'a Key) -> Boxed<'a, bool>;
    fn purge_expired(&self, limit: usize) -> Boxed<'_, u64>;
    fn stats(&self) -> Boxed<'_, RecordStats>;
    fn claim_recoverable<'a>(
        &'a self,
        req: ClaimRequest<'a>,
        recovery: RecoveryArgs<'a>,
    ) -> Boxed<'a, Claim>;
    fn recovery_scopes(&self) -> Boxed<'_, Vec<String>>;
    fn abandoned<'a>(&'a self, scope: &'a str, limit: usize) -> Boxed<'a, Vec<Abandoned>>;
    fn take_recovery<'a>(&'a self, key: &'a Key, turn: RecoveryTurn<'a>) -> Boxed<'a, Turn>;
    fn recovery_info<'a>(&'a self, key: &'a Key) -> Boxed<'a, Option<RecoveryInfo>>;
    fn retry_recovery<'a>(&'a self, key: &'a Key) -> Boxed<'a, bool>;
}

impl<S: Store> DynStore for S {
    fn backend(&self) -> &'static str {
        Store::backend(self)
    }
    fn max_result_bytes(&self) -> usize {
        Store::max_result_bytes(self)
    }
    fn claim<'a>(&'a self, req: ClaimRequest<'a>) -> Boxed<'a, Claim> {
        Box::pin(Store::claim(self, req))
    }
    fn complete<'a>(
        &'a self,
        key: &'a Key,
        token: Token,
        completion: Completion<'a>,
    ) -> Boxed<'a, bool> {
        Box::pin(Store::complete(self, key, token, completion))
    }
    fn release<'a>(&'a self, key: &'a Key, token: Token) -> Boxed<'a, bool> {
        Box::pin(Store::release(self, key, token))
    }
    fn renew<'a>(&'a self, key: &'a Key, token: Token, lease: Duration) -> Boxed<'a, bool> {
        Box::pin(Store::renew(self, key, token, lease))
    }
    fn inspect<'a>(&'a self, key: &'a Key) -> Boxed<'a, Option<RecordInfo>> {
        Box::pin(Store::inspect(self, key))
    }
    fn evict<'a>(&'a self, key: &'a Key) -> Boxed<'a, bool> {
        Box::pin(Store::evict(self, key))
    }
    fn purge_expired(&self, limit: usize) -> Boxed<'_, u64> {
        Box::pin(Store::purge_expired(self, limit))
    }
    fn stats(&self) -> Boxed<'_, RecordStats> {
        Box::pin(Store::stats(self))
    }
    fn claim_recoverable<'a>(
        &'a self,
        req: ClaimRequest<'a>,
        recovery: RecoveryArgs<'a>,
    ) -> Boxed<'a, Claim> {
        Box::pin(Store::claim_recoverable(self, req, recovery))
    }
    fn recovery_scopes(&self) -> Boxed<'_, Vec<String>> {
        Box::pin(Store::recovery_scopes(self))
    }
    fn abandoned<'a>(&'a self, scope: &'a str, limit: usize) -> Boxed<'a, Vec<Abandoned>> {
        Box::pin(Store::abandoned(self, scope, limit))
    }
    fn take_recovery<'a>(&'a self, key: &'a Key, turn: RecoveryTurn<'a>) -> Boxed<'a, Turn> {
        Box::pin(Store::take_recovery(self, key, turn))
    }
    fn recovery_info<'a>(&'a self, key: &'a Key) -> Boxed<'a, Option<RecoveryInfo>> {
        Box::pin(Store::recovery_info(self, key))
    }
    fn retry_recovery<'a>(&'a self, key: &'a Key) -> Boxed<'a, bool> {
        Box::pin(Store::retry_recovery(self, key))
    }
}
