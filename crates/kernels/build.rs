//! With the `cuda` feature, compiles the CUDA kernels in `cuda/` to PTX with the toolkit's
//! `nvcc` (on PATH, as scripts/cuda/env.sh sets it up), for `CUDA_COMPUTE_CAP` (default 90).
//! The PTX is embedded in the library and loaded by the driver on first use.

use std::path::PathBuf;
use std::process::Command;

const KERNELS: &[&str] = &["recurrent", "norm", "attention", "sampling"];

fn main() {
    println!("cargo::rerun-if-changed=cuda");
    println!("cargo::rerun-if-env-changed=CUDA_COMPUTE_CAP");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "90".into());
    for name in KERNELS {
        let status = Command::new("nvcc")
            .args(["--ptx", "-O3", "-std=c++17", &format!("-arch=sm_{cap}"), "-o"])
            .arg(out.join(format!("{name}.ptx")))
            .arg(format!("cuda/{name}.cu"))
            .status()
            .unwrap_or_else(|e| panic!("cannot run nvcc ({e}): source scripts/cuda/env.sh or put the CUDA toolkit on PATH"));
        assert!(status.success(), "nvcc failed on cuda/{name}.cu");
    }
}
