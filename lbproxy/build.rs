//! Builds the eBPF object (lbproxy-ebpf) with aya-build, the aya template's way: it runs
//! `rustup run nightly cargo build -Z build-std=core --target bpfel-unknown-none --release`
//! with `-C link-arg=--btf`, so the maps carry BTF and `bpftool map dump` prints field names.
fn main() -> anyhow::Result<()> {
    let root_dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../lbproxy-ebpf");
    aya_build::build_ebpf(
        [aya_build::Package {
            name: "lbproxy-ebpf",
            root_dir,
            ..Default::default()
        }],
        aya_build::Toolchain::default(),
    )
}
