use idem_runtime::step;

#[derive(Debug)]
struct AppError;

impl From<idem_runtime::Error> for AppError {
    fn from(_: idem_runtime::Error) -> Self {
        AppError
    }
}

pub struct Ticket {
    pub id: u64,
}

#[step("reserve")]
async fn reserve(sku: u64) -> Result<Ticket, AppError> {
    Ok(Ticket { id: sku })
}

fn main() {}
