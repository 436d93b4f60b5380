//! The rules for `ttl`, `lease` and `wait`: a record must outlive every retry
//! and redelivery, and a claim must outlive nothing but a live owner.

use syn::LitStr;

use crate::duration_literal::{self, HELP};
use crate::errors::Errors;

const MINUTE: u64 = 60_000;
const DAY: u64 = 24 * 60 * MINUTE;
pub(crate) const DEFAULT_TTL: u64 = DAY;
pub(crate) const DEFAULT_CONSUMER_TTL: u64 = 7 * DAY;
pub(crate) const DEFAULT_LEASE: u64 = 30_000;

pub(crate) struct Durations {
    pub ttl: u64,
    pub lease: u64,
    pub wait: Option<u64>,
}

fn parse(lit: &LitStr, option: &str, errors: &mut Errors) -> Option<u64> {
    match duration_literal::parse_millis(&lit.value()) {
        None => {
            errors.error(
                lit,
                format!("cannot parse `{option} = {:?}`: {HELP}", lit.value()),
            );
            None
        }
        Some(0) => {
            let example = match option {
                "ttl" => "`24h`",
                "lease" => "`30s`",
                _ => "`2s`",
            };
            errors.error(
                lit,
                format!("`{option}` is zero: write a positive duration, e.g. {example}"),
            );
            None
        }
        Some(ms) => Some(ms),
    }
}

pub(crate) fn check(
    ttl: Option<&LitStr>,
    lease: Option<&LitStr>,
    wait: Option<&LitStr>,
    consumer: bool,
    short_ttl_allowed: bool,
    errors: &mut Errors,
) -> Durations {
    let default_ttl = if consumer {
        DEFAULT_CONSUMER_TTL
    } else {
        DEFAULT_TTL
    };
    let ttl_ms = ttl.map(|l| parse(l, "ttl", errors));
    let lease_ms = lease.map(|l| parse(l, "lease", errors));
    let wait_ms = wait.and_then(|l| parse(l, "wait", errors));
    let lease_val = lease_ms.flatten().unwrap_or(DEFAULT_LEASE);

    if let (Some(lit), Some(Some(ttl))) = (ttl, ttl_ms) {
        let shown = duration_literal::display(ttl);
        if ttl < MINUTE {
            errors.error(
                lit,
                format!(
                    "`ttl = \"{shown}\"` is too short to be more than a lock: a duplicate that arrives after it runs again\n\
                     help: the ttl must cover the longest retry window (client retries, gateway retries, manual replays); use at least minutes, usually `24h`"
                ),
            );
        } else if consumer && ttl < DAY && !short_ttl_allowed {
            errors.error(
                lit,
                format!(
                    "`ttl = \"{shown}\"` is too short for a consumer: redelivery and offset rewinds come hours to days later\n\
                     help: use at least `24h` (the default is `7d`), or add `allow = \"ttl\"` if your broker provably redelivers within {shown}"
                ),
            );
        }
    }
    let ttl_val = ttl_ms.flatten().unwrap_or(default_ttl);
    if let (Some(lit), Some(Some(lease))) = (lease, lease_ms) {
        if lease > ttl_val {
            errors.error(
                lit,
                format!(
                    "`lease = \"{}\"` is longer than the ttl ({}): the record would expire while its owner still holds it\n\
                     help: shorten the lease or raise the ttl: the lease covers one execution (seconds to minutes); the ttl covers every retry (hours to days)",
                    duration_literal::display(lease),
                    duration_literal::display(ttl_val)
                ),
            );
        }
    }
    Durations {
        ttl: ttl_val,
        lease: lease_val,
        wait: wait_ms,
    }
}
