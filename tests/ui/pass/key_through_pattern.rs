//! A key segment may start from a binding inside a parameter pattern.
use idem_runtime::{KeyEncoder, KeyPart, idempotent, step};
use serde::{Deserialize, Serialize};

#[derive(Debug)]
pub struct AppError;

impl From<idem_runtime::Error> for AppError {
    fn from(_: idem_runtime::Error) -> Self {
        AppError
    }
}

pub struct Json<T>(pub T);

pub struct Sku(pub u64);

impl KeyPart for Sku {
    fn encode_key(&self, enc: &mut KeyEncoder) {
        self.0.encode_key(enc);
    }
}

pub struct CreateOrder {
    pub user_id: u64,
    pub sku: Sku,
    pub client_order_no: String,
}

#[derive(Serialize, Deserialize)]
pub struct Order {
    pub id: u64,
}

#[idempotent(
    key = "req.user_id|req.sku|req.client_order_no",
    ttl = "24h",
    lease = "10s"
)]
pub async fn create_order(Json(req): Json<CreateOrder>) -> Result<Order, AppError> {
    let ticket = reserve(req.sku.0).await?;
    Ok(Order { id: ticket })
}

#[step("reserve")]
pub async fn reserve(sku: u64) -> Result<u64, AppError> {
    Ok(sku)
}

fn main() {}
