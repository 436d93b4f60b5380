use idem_runtime::step;

#[derive(Debug)]
struct AppError;

impl From<idem_runtime::Error> for AppError {
    fn from(_: idem_runtime::Error) -> Self {
        AppError
    }
}

struct Price(f64);

// A segment must be a key part (an id, a string, a #[derive(KeyPart)] type):
// the error lands on the segment.
#[step("charge_item", key = "price")]
async fn charge_item(price: Price) -> Result<u64, AppError> {
    Ok(price.0 as u64)
}

fn main() {}
