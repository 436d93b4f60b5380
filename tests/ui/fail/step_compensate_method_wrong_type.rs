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
    #[step("deduct_stock", compensate = "restore_stock")]
    async fn deduct_stock(&self, sku: u64) -> Result<String, AppError> {
        Ok(format!("ticket-{sku}"))
    }

    // Takes the sku again, not the step's output (the ticket).
    async fn restore_stock(&self, _sku: u64) -> Result<(), AppError> {
        Ok(())
    }
}

fn main() {}
