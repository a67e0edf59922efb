//! Release builds of the `shoal` binary ask the linker to place the functions a transaction and
//! a login run next to each other, in the order of `link-order.txt` (written by
//! `bench/instructions --link-order`). Without it they are spread over ~8 MB of code, and a
//! login, which runs each of them once between system calls, pays for the instruction-cache
//! and TLB misses: measured, up to a fifth of a `-C` connection's user time, though some
//! A/B runs showed no gain (docs/benchmarks.md).
//!
//! Only LLD understands the option, so it is given only where LLD is known to be the linker:
//! Rust 1.90 or newer on x86_64 Linux with its default (bundled LLD) linker, nothing in the
//! flags or Cargo's configuration choosing another. `SHOAL_LINK_ORDER=0` turns it off and
//! `=1` forces it on. Names in the file that the build does not have are skipped, so an old
//! file costs only the benefit, never the build.

use std::env;
use std::path::Path;
use std::process::Command;

const ORDER_FILE: &str = "link-order.txt";

fn main() {
    println!("cargo:rerun-if-changed={ORDER_FILE}");
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=SHOAL_LINK_ORDER");
    let manifest_dir = env::var("CARGO_MANIFEST_DIR").unwrap_or_default();
    let file = Path::new(&manifest_dir).join(ORDER_FILE);
    if file.is_file() && wanted() {
        println!(
            "cargo:rustc-link-arg-bins=-Wl,--symbol-ordering-file={}",
            file.display()
        );
        println!("cargo:rustc-link-arg-bins=-Wl,--no-warn-symbol-ordering");
    }
}

fn wanted() -> bool {
    match env::var("SHOAL_LINK_ORDER").as_deref() {
        Ok("0") => return false,
        Ok("1") => return true,
        _ => {}
    }
    let var = |name: &str| env::var(name).unwrap_or_default();
    let flags = var("CARGO_ENCODED_RUSTFLAGS");
    var("PROFILE") == "release"
        && var("TARGET") == "x86_64-unknown-linux-gnu"
        && env::var_os("RUSTC_LINKER").is_none()
        && !["linker", "link-self-contained", "fuse-ld"]
            .iter()
            .any(|choice| flags.contains(choice))
        && rustc_minor().is_some_and(|minor| minor >= 90)
}

/// The minor version of the compiler Cargo runs (`rustc 1.95.0 (...)` gives 95).
fn rustc_minor() -> Option<u32> {
    let rustc = env::var_os("RUSTC")?;
    let out = Command::new(rustc).arg("--version").output().ok()?;
    let text = String::from_utf8(out.stdout).ok()?;
    let version = text.split_whitespace().nth(1)?;
    let mut parts = version.split('.');
    (parts.next()? == "1").then_some(())?;
    parts.next()?.parse().ok()
}
