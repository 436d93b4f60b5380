use idem_runtime::step;

#[derive(Debug)]
struct AppError;

impl From<idem_runtime::Error> for AppError {
    fn from(_: idem_runtime::Error) -> Self {
        AppError
    }
}

#[step("deduct_stock")]
fn deduct_stock(sku: u64) -> Result<u64, AppError> {
    Ok(sku)
}

fn main() {}
