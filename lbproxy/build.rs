//! Builds the eBPF object (lbproxy-ebpf) with aya-build, the aya template's way: it runs
//! `rustup run nightly cargo build -Z build-std=core --target bpfel-unknown-none --release`
//! with `-C link-arg=--btf`, so the maps carry BTF and `bpftool map dump` prints field names.
//!
//! Also sets `LBPROXY_GIT_COMMIT` (for `--version` and `lbproxy_build_info`): the
//! environment's `LBPROXY_GIT_COMMIT` when given (an image build without `.git`), else
//! `git rev-parse --short=12 HEAD`, else `unknown`.
use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git")
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .ok()?;
    let s = String::from_utf8(out.stdout).ok()?.trim().to_string();
    (out.status.success() && !s.is_empty()).then_some(s)
}

fn commit() -> String {
    println!("cargo:rerun-if-env-changed=LBPROXY_GIT_COMMIT");
    if let Ok(c) = std::env::var("LBPROXY_GIT_COMMIT")
        && !c.is_empty()
    {
        return c;
    }
    // Rebuilt when HEAD moves: a commit, a checkout. In a linked worktree, HEAD is in the
    // worktree's git dir and the branches are in the common one: both are watched.
    let dirs = [
        git(&["rev-parse", "--absolute-git-dir"]),
        git(&["rev-parse", "--path-format=absolute", "--git-common-dir"]),
    ];
    for dir in dirs.into_iter().flatten() {
        for p in ["HEAD", "refs/heads", "packed-refs"] {
            let path = std::path::Path::new(&dir).join(p);
            if path.exists() {
                println!("cargo:rerun-if-changed={}", path.display());
            }
        }
    }
    git(&["rev-parse", "--short=12", "HEAD"]).unwrap_or_else(|| "unknown".into())
}

fn main() -> anyhow::Result<()> {
    println!("cargo:rustc-env=LBPROXY_GIT_COMMIT={}", commit());
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
