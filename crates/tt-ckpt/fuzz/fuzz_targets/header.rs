//! Any bytes given to the checkpoint reader: an error or a checkpoint, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let path = std::path::PathBuf::from("fuzz.safetensors");
    if let Ok(file) = tt_ckpt::TensorFile::from_bytes(path.clone(), data.to_vec()) {
        for name in file.names() {
            let _ = file.tensor(&name);
        }
    }
    if let Ok(ckpt) = tt_ckpt::LoadedCheckpoint::from_bytes(path, data.to_vec()) {
        let _ = ckpt.value::<serde_json::Value>("x");
        let _ = ckpt.step();
    }
});
