//! The `gradsync` command; see `gradsync --help`.
fn main() {
    std::process::exit(gradsync::cli::main());
}
