//! The C header's drift check (`tests/header.rs`): `include/gradsync.h`
//! regenerated from `capi/src` with cbindgen and compared with the
//! checked-in file. Nothing here is linked into the C library.
