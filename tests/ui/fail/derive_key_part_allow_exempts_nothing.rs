use idem_runtime::KeyPart;

#[derive(KeyPart)]
struct Settlement {
    #[key_part(allow)]
    batch_no: u64,
    #[key_part(alow)]
    merchant_id: u64,
}

fn main() {}
