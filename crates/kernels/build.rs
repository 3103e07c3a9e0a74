//! With the `cuda` feature, compiles the CUDA kernels in `cuda/` with the toolkit's `nvcc` (on
//! PATH, as scripts/cuda/env.sh sets it up) into fat binaries for `CUDA_COMPUTE_CAP` (default
//! 90): machine code for that GPU generation, so nothing is compiled at run time, plus PTX the
//! driver can compile for newer ones. They are embedded in the library. Line information is kept
//! (it leaves the code as it is) so profilers can place time at source lines.

use std::path::PathBuf;
use std::process::Command;

const KERNELS: &[&str] = &["recurrent", "norm", "attention", "flash", "sampling", "matmul", "experts"];

fn main() {
    println!("cargo::rerun-if-changed=cuda");
    println!("cargo::rerun-if-env-changed=CUDA_COMPUTE_CAP");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "90".into());
    // The kernels wait for the kernel before them only when built for 9.0 and up (cuda.rs
    // launches them as programmatic dependents only then). The number's leading digits: a
    // capability may carry a suffix (`90a`).
    let major_minor: u32 = cap.chars().take_while(char::is_ascii_digit).collect::<String>().parse().unwrap_or(0);
    println!("cargo::rustc-env=STRATA_KERNELS_AWAIT_PREVIOUS={}", major_minor >= 90);
    // One nvcc per kernel file, all at once: each is single-threaded and they are independent.
    let builds: Vec<_> = KERNELS
        .iter()
        .map(|name| {
            let child = Command::new("nvcc")
                .args([
                    "--fatbin",
                    "-O3",
                    "-lineinfo",
                    "-std=c++17",
                    "-gencode",
                    &format!("arch=compute_{cap},code=[sm_{cap},compute_{cap}]"),
                ])
                .arg("-o")
                .arg(out.join(format!("{name}.fatbin")))
                .arg(format!("cuda/{name}.cu"))
                .spawn()
                .unwrap_or_else(|e| panic!("cannot run nvcc ({e}): source scripts/cuda/env.sh or put the CUDA toolkit on PATH"));
            (name, child)
        })
        .collect();
    for (name, mut child) in builds {
        let status = child.wait().expect("waiting for nvcc");
        assert!(status.success(), "nvcc failed on cuda/{name}.cu");
    }
}
