//! Reaching the servers the server-store tests need.
//!
//! Each server's URL comes from an environment variable with a localhost
//! default. When a server cannot be reached the test says so loudly and
//! returns; with `IDEM_REQUIRE_SERVICES=1` (what `.ci/run` sets) it fails
//! instead, so CI can never pass by skipping.

use std::fmt::Display;

/// The PostgreSQL URL (`IDEM_POSTGRES_URL`).
pub fn postgres_url() -> String {
    var(
        "IDEM_POSTGRES_URL",
        "postgres://postgres@127.0.0.1:5432/test",
    )
}

/// The MariaDB/MySQL URL (`IDEM_MYSQL_URL`).
pub fn mysql_url() -> String {
    var("IDEM_MYSQL_URL", "mysql://root@127.0.0.1:3306/test")
}

/// The single-node Redis URL (`IDEM_REDIS_URL`).
pub fn redis_url() -> String {
    var("IDEM_REDIS_URL", "redis://127.0.0.1:6379")
}

/// The RabbitMQ URL (`IDEM_RABBITMQ_URL`).
pub fn rabbitmq_url() -> String {
    var("IDEM_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/%2f")
}

/// The Kafka-protocol brokers (`IDEM_KAFKA_BROKERS`, `host:port[,…]`;
/// `scripts/test` starts Tansu there).
pub fn kafka_brokers() -> String {
    var("IDEM_KAFKA_BROKERS", "127.0.0.1:9092")
}

/// The NATS server with JetStream (`IDEM_NATS_URL`).
pub fn nats_url() -> String {
    var("IDEM_NATS_URL", "nats://127.0.0.1:4222")
}

/// The Redis Cluster's node URLs (`IDEM_REDIS_CLUSTER_URLS`, comma-separated),
/// as `scripts/test` starts it.
pub fn redis_cluster_urls() -> Vec<String> {
    var(
        "IDEM_REDIS_CLUSTER_URLS",
        "redis://127.0.0.1:7101,redis://127.0.0.1:7102,redis://127.0.0.1:7103",
    )
    .split(',')
    .map(|s| s.trim().to_owned())
    .filter(|s| !s.is_empty())
    .collect()
}

fn var(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_owned())
}

/// Whether an unreachable server fails the run (`IDEM_REQUIRE_SERVICES=1`).
pub fn required() -> bool {
    std::env::var("IDEM_REQUIRE_SERVICES").is_ok_and(|v| v == "1")
}

/// The value, or — when the server is unreachable — a loud skip (`None`), or a
/// panic when services are required.
pub fn reachable<T, E: Display>(service: &str, at: &str, result: Result<T, E>) -> Option<T> {
    let at = redact(at);
    match result {
        Ok(v) => Some(v),
        Err(e) if required() => {
            panic!("{service} at {at} is unreachable and IDEM_REQUIRE_SERVICES=1: {e}")
        }
        Err(e) => {
            eprintln!(
                "SKIPPED: {service} at {at} is unreachable ({e}); set IDEM_REQUIRE_SERVICES=1 to fail instead"
            );
            None
        }
    }
}

/// The URL with any password replaced, fit for a log line.
pub fn redact(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    match rest.split_once('@') {
        Some((userinfo, host)) => match userinfo.split_once(':') {
            Some((user, _password)) => format!("{scheme}://{user}:***@{host}"),
            None => url.to_owned(),
        },
        None => url.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn redact_hides_the_password_only() {
        assert_eq!(
            super::redact("mysql://app:s3cret@db:3306/x"),
            "mysql://app:***@db:3306/x"
        );
        assert_eq!(super::redact("redis://:s3cret@h:1"), "redis://:***@h:1");
        assert_eq!(super::redact("postgres://u@h/x"), "postgres://u@h/x");
    }
}
