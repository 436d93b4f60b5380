use idem_runtime::step;

#[derive(Debug)]
struct AppError;

impl From<idem_runtime::Error> for AppError {
    fn from(_: idem_runtime::Error) -> Self {
        AppError
    }
}

#[derive(Clone)]
struct Shop;

impl Shop {
    #[step("deduct_stock", compensate = "restore_stok")]
    async fn deduct_stock(&self, sku: u64) -> Result<String, AppError> {
        Ok(format!("ticket-{sku}"))
    }

    async fn restore_stock(&self, _ticket: String) -> Result<(), AppError> {
        Ok(())
    }
}

fn main() {}
