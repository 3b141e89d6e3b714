//! C ABI of gradsync (issue #12). Filled in next.
