use idem_runtime::idempotent;

#[derive(Debug)]
struct AppError;

impl From<idem_runtime::Error> for AppError {
    fn from(_: idem_runtime::Error) -> Self {
        AppError
    }
}

trait Settle {
    async fn settle(&self, order_id: u64) -> Result<u64, AppError>;
}

struct Card;
struct Wallet;

// Both would default to `<module>::settle`: a card settlement would replay a
// wallet settlement's result for the same order.
impl Settle for Card {
    #[idempotent(key = "order_id")]
    async fn settle(&self, order_id: u64) -> Result<u64, AppError> {
        Ok(order_id)
    }
}

impl Settle for Wallet {
    #[idempotent(key = "order_id")]
    async fn settle(&self, order_id: u64) -> Result<u64, AppError> {
        Ok(order_id + 1)
    }
}

struct Order(u64);

impl Order {
    // No receiver, but `Self` says it sits in an impl all the same.
    #[idempotent(key = "id")]
    async fn open(id: u64) -> Result<Self, AppError> {
        Ok(Order(id))
    }
}

fn main() {}
