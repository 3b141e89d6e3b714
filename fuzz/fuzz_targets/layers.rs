//! The layers-file reader (`gradsync::cli::read_layers`, `gradsync plan
//! --layers`) on hostile files: `Ok` or an error naming the file, never a
//! panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let path = gradsync_fuzz::scratch("layers.json");
    std::fs::write(&path, data).expect("write scratch file");
    if let Err(e) = gradsync::cli::read_layers(&path) {
        let text = e.to_string();
        assert!(
            text.contains(&*path.to_string_lossy()),
            "error does not name the file: {text}"
        );
    }
});
