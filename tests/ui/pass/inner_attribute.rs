//! Inner attributes in the body (`#![allow(…)]`) keep working under both
//! attributes, and still apply to the body: the crate denies unused variables,
//! and the bodies' unused ones compile only because their `allow` reached them.
#![deny(unused_variables)]

use idem_runtime::{idempotent, step};

#[derive(Debug)]
pub struct AppError;

impl From<idem_runtime::Error> for AppError {
    fn from(_: idem_runtime::Error) -> Self {
        AppError
    }
}

#[idempotent(key = "order_id")]
pub async fn ship(order_id: u64) -> Result<u64, AppError> {
    #![allow(unused_variables)]
    #![allow(clippy::needless_return)]
    let unused = 1;
    let label = pack(order_id).await?;
    return Ok(label);
}

#[step("pack")]
pub async fn pack(order_id: u64) -> Result<u64, AppError> {
    #![allow(unused_variables, clippy::needless_return)]
    let unused = 2;
    return Ok(order_id);
}

pub struct Warehouse;

impl Warehouse {
    #[idempotent(key = "order_id", scope = "warehouse.ship", tx = tx)]
    pub async fn ship_in_tx(
        &self,
        tx: &mut sqlx::Transaction<'_, sqlx::Sqlite>,
        order_id: u64,
    ) -> Result<u64, AppError> {
        #![allow(unused_variables)]
        let unused = 3;
        Ok(order_id)
    }
}

fn main() {}
