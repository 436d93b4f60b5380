use idem_runtime::KeyPart;

#[derive(KeyPart)]
struct Payment {
    order_id: u64,
    amount: f64,
}

#[derive(KeyPart)]
struct Reading(String, Option<f32>);

fn main() {}
