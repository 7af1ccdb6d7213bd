// The eBPF object is linked by bpf-linker. Fail early with a clear message if it is missing,
// and rebuild when it changes (a new linker can change the object).
fn main() {
    match which::which("bpf-linker") {
        Ok(path) => println!("cargo:rerun-if-changed={}", path.display()),
        Err(err) => panic!(
            "bpf-linker not found ({err}); run `cargo xtask setup` (or `cargo xtask test`), \
             which installs it against LLVM 22"
        ),
    }
}
