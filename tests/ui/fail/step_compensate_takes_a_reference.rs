use idem_runtime::step;

#[derive(Debug)]
struct AppError;

impl From<idem_runtime::Error> for AppError {
    fn from(_: idem_runtime::Error) -> Self {
        AppError
    }
}

#[step("deduct_stock", compensate = "restore_stock")]
async fn deduct_stock(sku: u64) -> Result<String, AppError> {
    Ok(format!("ticket-{sku}"))
}

// Borrows the ticket: a compensation gets the step's output by value.
async fn restore_stock(_ticket: &String) -> Result<(), AppError> {
    Ok(())
}

fn main() {}
