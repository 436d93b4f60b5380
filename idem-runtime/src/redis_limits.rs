//! The largest argument a Redis (or Valkey) server reads, for the store and
//! the Redis Streams sink to check before sending.
//!
//! An argument over `proto-max-bulk-len` is not refused like a command: the
//! server answers `Protocol error: invalid bulk length` and closes the
//! connection, and every command queued on that connection fails with it
//! (the rest of a pipeline, other calls sharing a multiplexed connection).

use std::collections::HashMap;

use redis::RedisError;
use redis::aio::ConnectionLike;

/// `proto-max-bulk-len` unless the server was set otherwise (Redis and
/// Valkey): 512 MiB.
pub(crate) const DEFAULT_PROTO_MAX_BULK_LEN: usize = 512 * 1024 * 1024;

/// The server's `proto-max-bulk-len`, or the default where the server does
/// not say (`CONFIG` renamed, or refused by an ACL, as managed services do).
/// Only a connection that fails is an error.
pub(crate) async fn proto_max_bulk_len<C>(conn: &mut C) -> Result<usize, RedisError>
where
    C: ConnectionLike + Send,
{
    let config: Result<HashMap<String, String>, RedisError> = redis::cmd("CONFIG")
        .arg("GET")
        .arg("proto-max-bulk-len")
        .query_async(conn)
        .await;
    match config {
        Ok(config) => Ok(config
            .get("proto-max-bulk-len")
            .and_then(|v| v.parse().ok())
            .unwrap_or(DEFAULT_PROTO_MAX_BULK_LEN)),
        Err(e) if e.code().is_some() => Ok(DEFAULT_PROTO_MAX_BULK_LEN),
        Err(e) => Err(e),
    }
}
