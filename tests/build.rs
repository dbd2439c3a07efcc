//! Points the benchmarks at the plugins `host/build.rs` built.
fn main() {
    let root = std::path::PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap());
    let dir = root
        .parent()
        .unwrap()
        .join("target/plugins/wasm32-wasip2/release");
    println!("cargo:rustc-env=PIPER_E2E_WASM_DIR={}", dir.display());
}
