// SPDX-License-Identifier: Apache-2.0
//! Links libgradsync: nothing is compiled here (no cc, no bindgen), the library is built by CMake.
//!
//! The directory holding `libgradsync.so` is `GRADSYNC_LIB_DIR` (a relative value is taken from this
//! crate's directory), by default `../../build` from this crate, i.e. the checkout's CMake build.
//! That directory is also written into the rpath of this package's tests, and handed to direct
//! dependents as `DEP_GRADSYNC_LIB_DIR` (this package `links = "gradsync"`), so that the `gradsync`
//! crate's tests find the library without LD_LIBRARY_PATH.
use std::env;
use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=GRADSYNC_LIB_DIR");

    let manifest = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let dir = match env::var_os("GRADSYNC_LIB_DIR") {
        Some(value) if !value.is_empty() => {
            let given = PathBuf::from(value);
            if given.is_absolute() {
                given
            } else {
                manifest.join(given)
            }
        }
        _ => manifest.join("..").join("..").join("build"),
    };
    // Absolute and without `..`, for the rpath; left as it is when it does not exist (yet).
    let dir = dir.canonicalize().unwrap_or(dir);
    if !dir.join("libgradsync.so").exists() {
        println!(
            "cargo:warning=libgradsync.so is not in {} (build the library with CMake, or set GRADSYNC_LIB_DIR)",
            dir.display()
        );
    }

    println!("cargo:rustc-link-search=native={}", dir.display());
    println!("cargo:rustc-link-lib=dylib=gradsync");
    if env::var("CARGO_CFG_TARGET_FAMILY").map(|f| f == "unix").unwrap_or(false) {
        // Only this package's own tests, examples and binaries get link args; dependents read
        // DEP_GRADSYNC_LIB_DIR and add their own (the gradsync crate's build.rs does).
        println!("cargo:rustc-link-arg=-Wl,-rpath,{}", dir.display());
    }
    println!("cargo:lib_dir={}", dir.display());
    // tests/mirrors.rs compiles a C program against the headers: the checkout's, and the build's
    // generated version.h.
    println!("cargo:rustc-env=GRADSYNC_BUILD_INCLUDE_DIR={}", dir.join("include").display());
}
