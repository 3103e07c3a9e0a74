//! Numerical ops the tensor library lacks, each as a plain reference built from tensor ops (the
//! "slow twin", which runs on any device) plus a fast path, and tests comparing the two.
//!
//! - [`gated_delta`]: the Gated DeltaNet recurrence with its gating and q/k normalisation fused.
//! - [`conv1d`]: depthwise causal conv1d + SiLU over a window, carrying the conv state.
//! - [`attention`]: causal softmax attention with GQA over a row's KV history.
//! - [`norm`]: RMSNorm (alone, after a residual add, gated per DeltaNet head) and SwiGLU's product.
//! - [`experts`]: a mixture of experts' routes, gathered per-expert matmuls and weighted sums,
//!   all on the device on a GPU.
//! - [`matmul`]: weight-streaming `x W^T` for decode-sized inputs against bf16 weights on CPU.
//! - [`rows`]: row copies between a batch and a pool's slots.
//! - [`sampling`]: each row's next token (argmax or seeded draw after logit adjustments, within a
//!   mask) where the logits are.
//! - [`kv_quant`]: codecs for quantized KV (affine groups, TurboQuant), vector by vector.
//! - [`quant`]: `x W^T` against GGUF block-quantized weights (Q8_0, Q5_0, Q4_K, Q6_K) on CPU,
//!   packed as in the file, llama.cpp's arithmetic.
//!
//! With the `cuda` feature, the recurrent ops and the norms run as strata's own CUDA kernels
//! (`cuda/*.cu`, built to fat binaries by build.rs), each tested on the GPU against the CPU path.

pub mod attention;
pub mod conv1d;
#[cfg(feature = "cuda")]
mod cuda;
pub mod experts;
pub mod gated_delta;
pub mod kv_quant;
pub mod matmul;
pub mod norm;
pub mod quant;
pub mod rows;
pub mod sampling;

pub use candle_core::{Error, Result};
#[cfg(feature = "cuda")]
pub use cuda::{address as device_address, prepare_device, upload, GpuSpan, StepGraph};

static DEVICE_USE: std::sync::RwLock<()> = std::sync::RwLock::new(());

/// Taken by a thread other than the one running the model before it queues work on `device` —
/// copies, launches, or dropping device tensors (a free is queued too) — and held until done:
/// - a decode step being recorded as a CUDA graph holds it exclusively, since anything queued on
///   the device's stream meanwhile would land in the recording;
/// - it makes the device's context current on this thread (cudarc frees a tensor without doing
///   so, and a free on a thread without it leaves an error for the device's next call).
pub fn device_use(device: &candle_core::Device) -> std::sync::RwLockReadGuard<'static, ()> {
    let guard = DEVICE_USE.read().unwrap_or_else(std::sync::PoisonError::into_inner);
    #[cfg(feature = "cuda")]
    if let candle_core::Device::Cuda(dev) = device {
        // A failure here is the device's own, and its next call reports it.
        let _ = dev.cuda_stream().context().bind_to_thread();
    }
    #[cfg(not(feature = "cuda"))]
    let _ = device;
    guard
}

/// A GPU's free and total memory in bytes; `None` for the CPU (and for devices this build has no
/// backend for).
pub fn device_memory(device: &candle_core::Device) -> Result<Option<(usize, usize)>> {
    #[cfg(feature = "cuda")]
    if let candle_core::Device::Cuda(dev) = device {
        return cuda::memory(dev).map(Some);
    }
    let _ = device;
    Ok(None)
}

/// Borrow a contiguous CPU tensor's f32 data.
fn cpu_f32(t: &candle_core::Tensor) -> Result<Vec<f32>> {
    t.to_dtype(candle_core::DType::F32)?.flatten_all()?.to_vec1::<f32>()
}
