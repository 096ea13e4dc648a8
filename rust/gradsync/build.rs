// SPDX-License-Identifier: Apache-2.0
//! Puts the directory that gradsync-sys linked libgradsync from (DEP_GRADSYNC_LIB_DIR) into the
//! rpath of this crate's tests and examples, so `cargo test` runs without LD_LIBRARY_PATH.
//! Crates that depend on `gradsync` link the same library; where it is not installed system-wide
//! they set their own rpath or LD_LIBRARY_PATH (see README.md, "Rust").
use std::env;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=DEP_GRADSYNC_LIB_DIR");
    let unix = env::var("CARGO_CFG_TARGET_FAMILY").map(|f| f == "unix").unwrap_or(false);
    if let (true, Some(dir)) = (unix, env::var_os("DEP_GRADSYNC_LIB_DIR")) {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{}", dir.to_string_lossy());
    }
}
