fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/pulsar.proto");
    prost_build::Config::new().compile_protos(&["proto/pulsar.proto"], &["proto"])?;
    Ok(())
}
