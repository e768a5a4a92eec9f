//! The `specula` command line.
fn main() {}
