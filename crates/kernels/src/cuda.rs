//! Launching strata's own CUDA kernels (`cuda/*.cu`, compiled to fat binaries by build.rs) on
//! candle tensors, on the device's stream. Outputs are fresh tensors; inputs are read where they
//! lie (callers check layouts).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use candle_core::cuda_backend::cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
use candle_core::cuda_backend::cudarc::driver::{CudaFunction, CudaModule, DevicePtr, LaunchConfig};
use candle_core::cuda_backend::cudarc::nvrtc::Ptx;
use candle_core::cuda_backend::{CudaDType, CudaDevice, CudaStorage, DeviceId};
use candle_core::{bail, DType, Device, Shape, Storage, Tensor};

use crate::Result;

/// One compiled module: its name and image.
pub(crate) struct Module {
    name: &'static str,
    image: &'static [u8],
}

macro_rules! module {
    ($name:literal) => {
        Module { name: $name, image: include_bytes!(concat!(env!("OUT_DIR"), "/", $name, ".fatbin")) }
    };
}

pub(crate) const RECURRENT: Module = module!("recurrent");
pub(crate) const ATTENTION: Module = module!("attention");
pub(crate) const FLASH: Module = module!("flash");
pub(crate) const SAMPLING: Module = module!("sampling");
pub(crate) const NORM: Module = module!("norm");
pub(crate) const MATMUL: Module = module!("matmul");
pub(crate) const EXPERTS: Module = module!("experts");

/// What is loaded, per device: modules, and kernels by (module, kernel, dtype instance).
#[derive(Default)]
struct Loaded {
    modules: HashMap<(DeviceId, &'static str), Arc<CudaModule>>,
    kernels: HashMap<(DeviceId, &'static str, &'static str, DType), Kernel>,
}

/// A loaded kernel, the dynamic shared memory a block of it may have (what the GPU grants a
/// block beyond the kernel's static arrays, opted into once, at load), and whether its GPU runs
/// programmatic dependent launches ([`launch`]).
#[derive(Clone)]
struct Kernel {
    function: CudaFunction,
    max_dynamic_shared: u32,
    dependent_launch: bool,
}

fn loaded() -> std::sync::MutexGuard<'static, Loaded> {
    static LOADED: OnceLock<Mutex<Loaded>> = OnceLock::new();
    LOADED.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner())
}

/// `module`'s kernel `name` for `dtype` on `dev`, loading the module on first use.
fn kernel(dev: &CudaDevice, module: &Module, name: &'static str, dtype: DType) -> Result<Kernel> {
    let mut loaded = loaded();
    let key = (dev.id(), module.name, name, dtype);
    if let Some(k) = loaded.kernels.get(&key) {
        return Ok(k.clone());
    }
    let suffix = match dtype {
        DType::F32 => "f32",
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        other => bail!("strata's CUDA kernels have no {other:?} instance"),
    };
    let image = match loaded.modules.get(&(dev.id(), module.name)) {
        Some(image) => image.clone(),
        None => {
            let image = dev
                .cuda_stream()
                .context()
                .load_module(Ptx::from_binary(module.image.to_vec()))
                .map_err(candle_core::Error::wrap)?;
            loaded.modules.insert((dev.id(), module.name), image.clone());
            image
        }
    };
    let function = image.load_function(&format!("{name}_{suffix}")).map_err(candle_core::Error::wrap)?;
    // Static and dynamic shared memory beyond 48 KiB together is an opt-in per kernel.
    let static_shared = function.get_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES);
    let limit = dev.cuda_stream().context().attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN);
    let max_dynamic_shared = (limit.map_err(candle_core::Error::wrap)? - static_shared.map_err(candle_core::Error::wrap)?).max(0);
    function
        .set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, max_dynamic_shared)
        .map_err(candle_core::Error::wrap)?;
    let major = dev.cuda_stream().context().attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR);
    let dependent_launch = major.map_err(candle_core::Error::wrap)? >= 9 && BUILT_TO_AWAIT_PREVIOUS;
    let kernel = Kernel { function, max_dynamic_shared: max_dynamic_shared as u32, dependent_launch };
    loaded.kernels.insert(key, kernel.clone());
    Ok(kernel)
}

/// Whether the kernels were compiled for compute capability 9.0 or newer, where they wait for
/// the kernel before them (`await_previous_kernel`; build.rs decides); code for older GPUs does
/// not, so a GPU running it must not start them early.
const BUILT_TO_AWAIT_PREVIOUS: bool = matches!(env!("STRATA_KERNELS_AWAIT_PREVIOUS").as_bytes(), b"true");

/// Readies a freshly opened GPU for inference, removing host-side work from the ops of a forward:
/// - cudarc's per-buffer events (for cross-stream safety) are off: candle runs every op of a
///   device on that device's one stream, so ordering is the stream's;
/// - the device's default memory pool keeps freed memory instead of handing it back to the
///   driver at every synchronisation (its release threshold is 0 by default, and each decode
///   step syncs to read the sampled tokens). On an H200 this measured no faster (4B-shape decode
///   127 against 125 tok/s); it keeps the driver's unmapping out of the step regardless.
pub fn prepare_device(dev: &CudaDevice) -> Result<()> {
    use candle_core::cuda_backend::cudarc::driver::sys;
    // SAFETY: no tensor of this device exists yet, so none was created with event tracking.
    unsafe { dev.disable_event_tracking() };
    let cu_device = dev.cuda_stream().context().cu_device();
    let mut keep_all = u64::MAX;
    // SAFETY: `cu_device` is a live device handle; the attribute takes a u64 by pointer.
    unsafe {
        let mut pool = std::ptr::null_mut();
        sys::cuDeviceGetDefaultMemPool(&mut pool, cu_device).result().map_err(candle_core::Error::wrap)?;
        sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut keep_all as *mut u64).cast(),
        )
        .result()
        .map_err(candle_core::Error::wrap)?;
    }
    Ok(())
}

/// The device's free and total memory in bytes.
pub fn memory(dev: &CudaDevice) -> Result<(usize, usize)> {
    dev.cuda_stream().context().bind_to_thread().map_err(candle_core::Error::wrap)?;
    candle_core::cuda_backend::cudarc::driver::result::mem_get_info().map_err(candle_core::Error::wrap)
}

/// The device's streaming multiprocessors (132 on an H200), as many as the blocks of a kernel
/// that fits one block per multiprocessor run at once.
pub(crate) fn multiprocessors(device: &Device) -> Result<usize> {
    let Device::Cuda(dev) = device else { bail!("{device:?} is not a CUDA device") };
    let count = dev.cuda_stream().context().attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT);
    Ok(count.map_err(candle_core::Error::wrap)?.max(1) as usize)
}

/// Whether the kernels have an instance for `dtype` (the float dtypes a model computes in).
pub(crate) fn supports(dtype: DType) -> bool {
    matches!(dtype, DType::F32 | DType::BF16 | DType::F16)
}

/// A kernel argument: a device address or a scalar.
pub(crate) enum Arg {
    Ptr(u64),
    I32(i32),
    I64(i64),
    F32(f32),
}

impl Arg {
    /// A dimension or count as the kernels' `int`.
    pub(crate) fn dim(n: usize) -> Result<Self> {
        Ok(Arg::I32(i32::try_from(n).map_err(|_| candle_core::Error::Msg(format!("{n} does not fit a CUDA int")))?))
    }

    /// The device address of `t`'s first element (its layout's start offset included).
    pub(crate) fn at(t: &Tensor) -> Result<Self> {
        Ok(Arg::Ptr(address(t)?))
    }

    /// [`Arg::at`], or a null address for an absent optional input.
    pub(crate) fn at_or_null(t: Option<&Tensor>) -> Result<Self> {
        t.map_or(Ok(Arg::Ptr(0)), Arg::at)
    }
}

/// The device address of `t`'s first element (its layout's start offset included).
pub fn address(t: &Tensor) -> Result<u64> {
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cuda(cs) = &*storage else { bail!("{:?} is not on a CUDA device", t.device()) };
    let base = match t.dtype() {
        DType::F32 => slice_address::<f32>(cs)?,
        DType::BF16 => slice_address::<half::bf16>(cs)?,
        DType::F16 => slice_address::<half::f16>(cs)?,
        DType::U8 => slice_address::<u8>(cs)?,
        DType::U32 => slice_address::<u32>(cs)?,
        DType::I32 => slice_address::<i32>(cs)?,
        DType::I64 => slice_address::<i64>(cs)?,
        other => bail!("strata's CUDA kernels take no {other:?} tensors"),
    };
    Ok(base + (layout.start_offset() * t.dtype().size_in_bytes()) as u64)
}

fn slice_address<T: CudaDType>(cs: &CudaStorage) -> Result<u64> {
    let stream = cs.device.cuda_stream();
    let (ptr, _recorded) = cs.as_cuda_slice::<T>()?.device_ptr(&stream);
    Ok(ptr)
}

/// `x` as `[rows, last dim]`: itself with the distance between its rows when its last dim is
/// contiguous and its leading dims collapse into one (a narrow of a wider output's last dim,
/// say), otherwise a contiguous copy.
pub(crate) fn row_strided(x: &Tensor) -> Result<(Tensor, usize)> {
    let (dims, strides) = (x.dims(), x.stride());
    let cols = dims.last().copied().unwrap_or(1);
    let lead: Vec<(usize, usize)> =
        dims.iter().zip(strides).take(dims.len().saturating_sub(1)).filter(|(&d, _)| d > 1).map(|(&d, &s)| (d, s)).collect();
    let collapses = lead.windows(2).all(|w| w[0].1 == w[1].0 * w[1].1);
    if (strides.last() == Some(&1) || cols <= 1) && collapses {
        return Ok((x.clone(), lead.last().map_or(cols, |&(_, s)| s)));
    }
    Ok((x.contiguous()?, cols))
}

/// An uninitialised output the kernel fills completely.
pub(crate) fn output(shape: impl Into<Shape>, dtype: DType, device: &Device) -> Result<Tensor> {
    // SAFETY: every caller launches a kernel that writes each element before anyone reads it.
    unsafe { Tensor::empty(shape, dtype, device) }
}

/// Whether `module`'s kernel `name` for `dtype` exists on `device` (kernels that need a newer GPU
/// generation than the build's are compiled out) and fits its blocks' shared memory — its own
/// static arrays and `dynamic` bytes — in what the GPU grants a block.
pub(crate) fn fits(device: &Device, module: &Module, name: &'static str, dtype: DType, dynamic: u32) -> bool {
    let Device::Cuda(dev) = device else { return false };
    fitting_kernel(dev, module, name, dtype, dynamic).is_some()
}

/// The kernel, where it [`fits`].
fn fitting_kernel(dev: &CudaDevice, module: &Module, name: &'static str, dtype: DType, dynamic: u32) -> Option<Kernel> {
    kernel(dev, module, name, dtype).ok().filter(|k| dynamic <= k.max_dynamic_shared)
}

/// Launches `module`'s kernel `name` instantiated for `dtype` (`name_f32`, `name_bf16`, …).
///
/// On GPUs of compute capability 9.0 and up, as a programmatic dependent of the launch before it
/// on the stream: its blocks may start while that kernel runs and wait for it inside
/// (`await_previous_kernel` in cuda/common.cuh), so a kernel's start-up — launch, block
/// scheduling, a matmul's first weight loads — overlaps the end of the one before: a decode step
/// is a few hundred dependent launches (on an H200, 1–2% more batch-1 decode tokens/s than
/// plain launches of the same kernels; figures in commit 590ec36's message). A launch of
/// candle's, made without the attribute, still waits for everything before it.
pub(crate) fn launch(
    device: &Device,
    module: &Module,
    name: &'static str,
    dtype: DType,
    cfg: LaunchConfig,
    args: &[Arg],
) -> Result<()> {
    use candle_core::cuda_backend::cudarc::driver::sys;
    use std::ffi::c_void;
    let Device::Cuda(dev) = device else { bail!("{device:?} is not a CUDA device") };
    let kernel = kernel(dev, module, name, dtype)?;
    let stream = dev.cuda_stream();
    stream.context().bind_to_thread().map_err(candle_core::Error::wrap)?;
    let mut params: Vec<*mut c_void> = args
        .iter()
        .map(|arg| match arg {
            Arg::Ptr(p) => p as *const u64 as *mut c_void,
            Arg::I32(v) => v as *const i32 as *mut c_void,
            Arg::I64(v) => v as *const i64 as *mut c_void,
            Arg::F32(v) => v as *const f32 as *mut c_void,
        })
        .collect();
    let mut dependent = sys::CUlaunchAttribute {
        id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
        pad: [0; 4],
        value: sys::CUlaunchAttributeValue { programmaticStreamSerializationAllowed: 1 },
    };
    let config = sys::CUlaunchConfig {
        gridDimX: cfg.grid_dim.0,
        gridDimY: cfg.grid_dim.1,
        gridDimZ: cfg.grid_dim.2,
        blockDimX: cfg.block_dim.0,
        blockDimY: cfg.block_dim.1,
        blockDimZ: cfg.block_dim.2,
        sharedMemBytes: cfg.shared_mem_bytes,
        hStream: stream.cu_stream(),
        attrs: &mut dependent,
        numAttrs: u32::from(kernel.dependent_launch),
    };
    // SAFETY: each caller passes the arguments its kernel's signature declares, in order, and
    // addresses of tensors it keeps alive across the call; `params` points at `args`' values,
    // which outlive the call (the driver copies them at launch).
    unsafe { sys::cuLaunchKernelEx(&config, kernel.function.cu_function(), params.as_mut_ptr(), std::ptr::null_mut()) }
        .result()
        .map_err(candle_core::Error::wrap)?;
    Ok(())
}

/// Whether `t`, as rows `stride` elements apart from its first element, can be read in 16-byte
/// pieces: its first element 16-byte aligned and the stride a whole number of pieces.
pub(crate) fn in_pieces(t: &Tensor, stride: usize) -> Result<bool> {
    Ok(address(t)? % 16 == 0 && (stride * t.dtype().size_in_bytes()) % 16 == 0)
}

/// A grid with one block per row along x (`rows`) and `cols` threads in blocks of `block` along y.
pub(crate) fn grid_rows(rows: usize, cols: usize, block: u32) -> Result<LaunchConfig> {
    let too_big = || candle_core::Error::Msg(format!("{rows} x {cols} threads exceed a CUDA grid"));
    let x = u32::try_from(rows.max(1)).ok().filter(|&x| x <= i32::MAX as u32).ok_or_else(too_big)?;
    let y = u32::try_from(cols.div_ceil(block as usize).max(1)).ok().filter(|&y| y <= 65535).ok_or_else(too_big)?;
    Ok(LaunchConfig { grid_dim: (x, y, 1), block_dim: (block, 1, 1), shared_mem_bytes: 0 })
}

/// `n` threads in blocks of `block`.
pub(crate) fn grid_for(n: usize, block: u32) -> Result<LaunchConfig> {
    let blocks = n.div_ceil(block as usize).max(1);
    let blocks = u32::try_from(blocks).map_err(|_| candle_core::Error::Msg(format!("{n} threads exceed a CUDA grid")))?;
    Ok(LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (block, 1, 1), shared_mem_bytes: 0 })
}

/// Copies `data` from the host into `dst` in place (contiguous, `data.len()` elements of its
/// dtype), in order on its device's stream: how a captured step's inputs change between replays.
pub fn upload<T: candle_core::WithDType>(dst: &Tensor, data: &[T]) -> Result<()> {
    let Device::Cuda(dev) = dst.device() else { bail!("{:?} is not a CUDA device", dst.device()) };
    if dst.dtype() != T::DTYPE || !dst.is_contiguous() || dst.elem_count() != data.len() {
        bail!("upload: {} {:?} values into a {:?} {:?} tensor", data.len(), T::DTYPE, dst.dtype(), dst.shape());
    }
    let stream = dev.cuda_stream();
    stream.context().bind_to_thread().map_err(candle_core::Error::wrap)?;
    // SAFETY: `dst` holds `data.len()` elements of T at its address and stays alive (the caller
    // holds it); a copy from pageable memory is staged before the call returns.
    unsafe { candle_core::cuda_backend::cudarc::driver::result::memcpy_htod_async(address(dst)?, data, stream.cu_stream()) }
        .map_err(candle_core::Error::wrap)
}

/// Launches recorded once on a device's stream and replayed with one call: what a decode step
/// costs the host becomes one launch instead of hundreds. The recording bakes in every address
/// and scalar argument, so a replay computes on exactly the tensors the recording used.
pub struct StepGraph {
    graph: candle_core::cuda_backend::cudarc::driver::CudaGraph,
    context: Arc<candle_core::cuda_backend::cudarc::driver::CudaContext>,
}

impl Drop for StepGraph {
    /// cudarc destroys a graph without making its context current, so a graph dropped on a
    /// thread that never used the device (the model outliving the engine thread) would leave
    /// an invalid-context error for the device's next call to report.
    fn drop(&mut self) {
        let _ = self.context.bind_to_thread();
    }
}

// SAFETY: the graph handles are used by one thread at a time (the owner serialises access, as
// CUDA requires of graph objects); nothing in them is tied to the creating thread.
unsafe impl Send for StepGraph {}

impl StepGraph {
    /// Whether launches on `device` can be recorded: a CUDA device readied by [`prepare_device`]
    /// (cudarc's per-buffer events, which a recording could not wait on, are off) whose driver
    /// allocates in stream order (allocations inside a recording become the graph's own).
    pub fn can_capture(device: &Device) -> bool {
        let Device::Cuda(dev) = device else { return false };
        let pools = dev.cuda_stream().context().attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED);
        !dev.is_event_tracking() && pools.is_ok_and(|supported| supported > 0)
    }

    /// Runs `step` (its launches execute), then records a second call of it as the graph (those
    /// launches do not execute). The outer error is the executed call's; the inner one says the
    /// recording failed after the step itself ran. Memory the recorded call allocates and frees
    /// becomes the graph's own; what it reads or writes that outlives it must exist before.
    /// `step` must not read device memory back or free a tensor made before it. Candle's ops
    /// upload small layout descriptions (dims and strides) as they launch, and a recording
    /// cannot copy from the host: the first call leaves them in candle's upload caches, where the
    /// recorded one finds them (one it misses fails the recording with an error). Other threads'
    /// device work waits meanwhile ([`crate::device_use`]).
    pub fn run_and_record<E: From<candle_core::Error> + std::fmt::Display>(
        device: &Device,
        step: impl Fn() -> std::result::Result<(), E>,
    ) -> std::result::Result<Result<Self>, E> {
        use candle_core::cuda_backend::cudarc::driver::sys;
        let wrap = candle_core::Error::wrap;
        let Device::Cuda(dev) = device else {
            return Err(candle_core::Error::Msg(format!("{device:?} is not a CUDA device")).into());
        };
        let _cached_uploads = dev.enable_cuda_graph_htod_cache();
        step()?;
        let _alone = crate::DEVICE_USE.write().unwrap_or_else(std::sync::PoisonError::into_inner);
        let stream = dev.cuda_stream();
        // Relaxed: a kernel module loaded on first use during the recording is allowed.
        if let Err(e) = stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED) {
            return Ok(Err(wrap(e)));
        }
        let recorded = step();
        // The capture ends whatever happened, so the stream runs launches again.
        let graph = stream.end_capture(sys::CUgraphInstantiate_flags(0)).map_err(wrap);
        if let Err(e) = recorded {
            return Ok(Err(candle_core::Error::Msg(format!("an op of the step could not be recorded: {e}"))));
        }
        let graph = match graph {
            Ok(Some(graph)) => graph,
            Ok(None) => return Ok(Err(candle_core::Error::Msg("the recorded step launched nothing".into()))),
            Err(e) => return Ok(Err(e)),
        };
        Ok(graph.upload().map_err(wrap).map(|()| Self { graph, context: stream.context().clone() }))
    }

    /// Runs the recorded launches once more, in order on the stream they were recorded on.
    pub fn replay(&self) -> Result<()> {
        self.graph.launch().map_err(candle_core::Error::wrap)
    }
}

/// The GPU time of work queued on a device's stream between [`GpuSpan::start`] and
/// [`GpuSpan::end`], read once that work is done (a step's time on the device, beside the wall
/// time its caller sees: the difference is the host's).
pub struct GpuSpan {
    start: candle_core::cuda_backend::cudarc::driver::CudaEvent,
    end: candle_core::cuda_backend::cudarc::driver::CudaEvent,
    stream: Arc<candle_core::cuda_backend::cudarc::driver::CudaStream>,
}

impl GpuSpan {
    pub fn new(device: &Device) -> Result<Self> {
        use candle_core::cuda_backend::cudarc::driver::sys::CUevent_flags;
        let Device::Cuda(dev) = device else { bail!("{device:?} is not a CUDA device") };
        let stream = dev.cuda_stream();
        let event = || stream.context().new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(candle_core::Error::wrap);
        Ok(Self { start: event()?, end: event()?, stream })
    }

    pub fn start(&self) -> Result<()> {
        self.start.record(&self.stream).map_err(candle_core::Error::wrap)
    }

    pub fn end(&self) -> Result<()> {
        self.end.record(&self.stream).map_err(candle_core::Error::wrap)
    }

    /// Nanoseconds from start to end; waits for the end to be reached.
    pub fn elapsed_ns(&self) -> Result<u64> {
        let ms = self.start.elapsed_ms(&self.end).map_err(candle_core::Error::wrap)?;
        Ok((f64::from(ms) * 1e6) as u64)
    }
}
