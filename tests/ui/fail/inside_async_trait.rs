use idem_runtime::idempotent;
use idem_runtime::store::async_trait;

#[derive(Debug)]
struct AppError;

impl From<idem_runtime::Error> for AppError {
    fn from(_: idem_runtime::Error) -> Self {
        AppError
    }
}

#[async_trait]
trait Orders {
    async fn create(&self, order_no: String) -> Result<u64, AppError>;
}

struct Service;

// #[async_trait] expands first and hands #[idempotent] a plain fn returning a
// boxed future: the error must say so, not "needs an async fn".
#[async_trait]
impl Orders for Service {
    #[idempotent(scope = "orders.create", key = "order_no")]
    async fn create(&self, order_no: String) -> Result<u64, AppError> {
        Ok(order_no.len() as u64)
    }
}

fn main() {}
