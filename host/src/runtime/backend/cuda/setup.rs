//! Starting the CUDA backend on this machine: the libraries it loads (each
//! missing one named with where to get it), the GPUs it deals plan devices
//! to (contiguous blocks), and whether the plan's predicted peaks fit each
//! GPU's free memory — all before anything is allocated.

use super::Gpu;
use crate::compile::human_bytes;
use crate::runtime::backend::{BackendError, Placement};
use std::sync::Arc;

/// Where the libraries a user may lack come from.
const WHERE: &str = "PyTorch's CUDA 13 wheels ship them under site-packages/nvidia/cu13/lib (or \
    `pip install nvidia-cuda-nvrtc nvidia-cublas`): put that directory on LD_LIBRARY_PATH";

/// The CUDA libraries the backend loads, or what is missing.
pub fn libraries() -> Result<(), String> {
    // SAFETY: loading a shared library runs its initialisers; these are the
    // NVIDIA libraries cudarc would load anyway.
    let (driver, nvrtc, cublas) = unsafe {
        (
            cudarc::driver::sys::is_culib_present(),
            cudarc::nvrtc::sys::is_culib_present(),
            cudarc::cublas::sys::is_culib_present(),
        )
    };
    if !driver {
        return Err(
            "no CUDA driver: libcuda.so.1 cannot be loaded (this machine has no NVIDIA \
                    driver, or its directory is not on LD_LIBRARY_PATH)"
                .into(),
        );
    }
    if !nvrtc {
        return Err(format!("NVRTC (libnvrtc.so.13) cannot be loaded: {WHERE}"));
    }
    if !cublas {
        return Err(format!(
            "cuBLAS (libcublas.so.13) cannot be loaded: {WHERE}"
        ));
    }
    Ok(())
}

/// What this machine's CUDA stack is, as `name: value` lines: the driver's,
/// NVRTC's and cuBLAS's versions, the library files this process loaded
/// (from `/proc/self/maps`: a system library paired with a wheel's shows
/// here), and each GPU's name, compute capability, memory and SMs.
pub fn info() -> Result<Vec<(String, String)>, String> {
    use cudarc::driver::{sys as drv, CudaContext};
    libraries()?;
    let mut out = Vec::new();
    let (mut driver, mut major, mut minor) = (0, 0, 0);
    // SAFETY: out-pointers to live integers; the libraries are loaded.
    unsafe {
        drv::cuDriverGetVersion(&mut driver)
            .result()
            .map_err(|e| format!("the driver's version: {e}"))?;
        cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor);
    }
    out.push((
        "driver (CUDA version it supports)".into(),
        format!("{}.{}", driver / 1000, driver % 1000 / 10),
    ));
    out.push(("NVRTC".into(), format!("{major}.{minor}")));
    let mut v = [0i32; 3];
    for (i, t) in [
        cudarc::cublas::sys::libraryPropertyType::MAJOR_VERSION,
        cudarc::cublas::sys::libraryPropertyType::MINOR_VERSION,
        cudarc::cublas::sys::libraryPropertyType::PATCH_LEVEL,
    ]
    .into_iter()
    .enumerate()
    {
        // SAFETY: an out-pointer to a live integer.
        unsafe { cudarc::cublas::sys::cublasGetProperty(t, &mut v[i]) };
    }
    out.push(("cuBLAS".into(), format!("{}.{}.{}", v[0], v[1], v[2])));
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    let mut files: Vec<&str> = maps
        .lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .filter(|f| {
            ["libcuda", "libnvrtc", "libcublas"]
                .iter()
                .any(|n| f.contains(n))
        })
        .collect();
    files.sort();
    files.dedup();
    for f in files {
        out.push(("loaded".into(), f.to_string()));
    }
    let count = CudaContext::device_count().map_err(|e| format!("counting GPUs: {e}"))?;
    out.push(("GPUs".into(), count.to_string()));
    for g in 0..count.max(0) as usize {
        let ctx = CudaContext::new(g).map_err(|e| format!("GPU {g}: {e}"))?;
        let (cc_major, cc_minor) = ctx
            .compute_capability()
            .map_err(|e| format!("GPU {g}: {e}"))?;
        let sms = ctx
            .attribute(drv::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| format!("GPU {g}: {e}"))?;
        let total = ctx.total_mem().map_err(|e| format!("GPU {g}: {e}"))?;
        out.push((
            format!("GPU {g}"),
            format!(
                "{}, sm_{cc_major}{cc_minor}, {} SMs, {}",
                ctx.name().unwrap_or_else(|_| "unknown".into()),
                sms,
                human_bytes(total as u64)
            ),
        ));
    }
    Ok(out)
}

/// The high-water mark of memory in use from each of the first `gpus`
/// GPUs' default pools (where every tensor comes from), bytes; with
/// `reset`, set back to what is in use now first (so it covers what runs
/// next). What the GPU held at its busiest, beside the plan's peaks.
pub fn pool_high_water(gpus: u32, reset: bool) -> Result<Vec<u64>, String> {
    use cudarc::driver::sys;
    libraries()?;
    let mut out = Vec::new();
    for g in 0..gpus as usize {
        let ctx = cudarc::driver::CudaContext::new(g).map_err(|e| format!("GPU {g}: {e}"))?;
        ctx.bind_to_thread().map_err(|e| format!("GPU {g}: {e}"))?;
        let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
        let mut high: u64 = 0;
        // SAFETY: the device handle is the context's; the out-pointers are
        // valid; the attributes take a u64 (a reset writes zero).
        unsafe {
            sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device())
                .result()
                .map_err(|e| format!("GPU {g}: its default memory pool: {e}"))?;
            let attr = sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH;
            if reset {
                let mut zero: u64 = 0;
                sys::cuMemPoolSetAttribute(
                    pool,
                    attr,
                    &mut zero as *mut u64 as *mut std::ffi::c_void,
                )
                .result()
                .map_err(|e| format!("GPU {g}: resetting its pool's high-water mark: {e}"))?;
            }
            sys::cuMemPoolGetAttribute(pool, attr, &mut high as *mut u64 as *mut std::ffi::c_void)
                .result()
                .map_err(|e| format!("GPU {g}: its pool's high-water mark: {e}"))?;
        }
        out.push(high);
    }
    Ok(out)
}

/// The GPU (of `gpus`) each of `n` devices goes to: contiguous blocks of
/// `ceil(n / gpus)`.
pub fn deal(n: usize, gpus: usize) -> Vec<usize> {
    let per = n.div_ceil(gpus.max(1)).max(1);
    (0..n).map(|i| i / per).collect()
}

/// Open the GPUs the placement's devices go to, one `Gpu` per device (shared
/// by the devices of one GPU), refusing a plan whose predicted peaks pass a
/// GPU's free memory.
pub fn open(gpus: u32, place: &Placement<'_>) -> Result<Vec<Arc<Gpu>>, BackendError> {
    libraries().map_err(BackendError::Device)?;
    let count = cudarc::driver::CudaContext::device_count()
        .map_err(|e| BackendError::Device(format!("the CUDA driver cannot count GPUs: {e}")))?;
    let count = count.max(0) as usize;
    if count == 0 {
        return Err(BackendError::Device(
            "the CUDA driver sees no GPU on this machine".into(),
        ));
    }
    let gpus = gpus as usize;
    if gpus > count {
        return Err(BackendError::Device(format!(
            "--gpus {gpus}, but this machine has {count} GPU(s)"
        )));
    }
    let of = deal(place.devices.len(), gpus);
    let mut opened: Vec<Option<Arc<Gpu>>> = vec![None; gpus];
    for &g in &of {
        if opened[g].is_none() {
            opened[g] = Some(Gpu::open(g).map_err(BackendError::Device)?);
        }
    }
    for (g, gpu) in opened.iter().enumerate() {
        let Some(gpu) = gpu else { continue };
        let mine: Vec<usize> = (0..of.len()).filter(|i| of[*i] == g).collect();
        let need: u64 = mine.iter().map(|i| place.peaks[*i]).sum();
        let (free, total) = gpu.memory().map_err(BackendError::Device)?;
        if need > free {
            let devices: Vec<u32> = mine.iter().map(|i| place.devices[*i]).collect();
            return Err(BackendError::Device(format!(
                "plan device(s) {devices:?} on GPU {g} ({}) need {} at their predicted peaks; it has {} free of {}: \
                 use more GPUs (--gpus), a strategy that holds less per device (ZeRO, more pipeline stages), or a smaller batch",
                gpu.name(),
                human_bytes(need),
                human_bytes(free),
                human_bytes(total)
            )));
        }
    }
    Ok(of
        .iter()
        .map(|g| opened[*g].clone().expect("opened above"))
        .collect())
}

#[cfg(test)]
mod tests {
    #[test]
    fn devices_go_to_gpus_in_contiguous_blocks() {
        assert_eq!(super::deal(4, 1), [0, 0, 0, 0]);
        assert_eq!(super::deal(4, 2), [0, 0, 1, 1]);
        assert_eq!(super::deal(5, 2), [0, 0, 0, 1, 1]);
        assert_eq!(super::deal(2, 4), [0, 1]);
        assert_eq!(super::deal(8, 3), [0, 0, 0, 1, 1, 1, 2, 2]);
    }
}
