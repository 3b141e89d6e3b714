//! Python bindings (issue #12). Filled in next.
