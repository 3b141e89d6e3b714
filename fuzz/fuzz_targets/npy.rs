//! The `.npy` reader (`gradsync::cli::read_npy`, used by `gradsync codecs
//! --input`) on hostile files: `Ok` with as many values as the shape
//! says, or an error naming the file, never a panic or a huge allocation.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let path = gradsync_fuzz::scratch("in.npy");
    std::fs::write(&path, data).expect("write scratch file");
    match gradsync::cli::read_npy(&path) {
        Ok((shape, values)) => {
            assert_eq!(shape.iter().product::<usize>(), values.len());
        }
        Err(e) => {
            let text = e.to_string();
            assert!(
                text.contains(&*path.to_string_lossy()),
                "error does not name the file: {text}"
            );
        }
    }
});
