//! The CUDA backend where no GPU is (CI): `--backend cuda` names what is
//! missing in one line. Built and run with `--features cuda`; the kernels'
//! compilation is tested in the library (`backend::cuda::kernels`) and their
//! numerics on a GPU machine by `scripts/gpu-check.sh`.

use common::piper;

use crate::common;

#[test]
fn backend_cuda_without_a_gpu_is_one_clear_line() {
    // SAFETY: probing for the driver library, as the backend does.
    if unsafe { cudarc_probe() } {
        piper::test_support::not_run(
            "cuda without a GPU",
            "this machine has a CUDA driver (scripts/gpu-check.sh checks the backend there)",
        );
        return;
    }
    let h = std::env::temp_dir().join(format!("piper-cuda-{}", std::process::id()));
    for args in [
        &["train", "--backend", "cuda", "--steps", "1"][..],
        &[
            "backend",
            "check",
            "--backend",
            "cuda",
            "--out",
            "/tmp/piper-cuda-check",
        ][..],
        &["backend", "info", "--backend", "cuda"][..],
    ] {
        let (ok, out, err) = piper(&h, args);
        assert!(!ok, "{args:?} ran without a GPU: {out}");
        assert!(
            err.contains("no CUDA driver: libcuda.so.1 cannot be loaded"),
            "{args:?}: {err}"
        );
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{args:?}: one line: {err}");
    }
}

/// Is libcuda.so.1 loadable here?
unsafe fn cudarc_probe() -> bool {
    ["libcuda.so.1", "libcuda.so"].iter().any(|name| {
        let c = std::ffi::CString::new(*name).unwrap();
        // SAFETY: dlopen/dlclose of a library name; nothing is called.
        let h = unsafe { dlopen(c.as_ptr(), 1) };
        if h.is_null() {
            return false;
        }
        unsafe { dlclose(h) };
        true
    })
}

extern "C" {
    fn dlopen(filename: *const std::ffi::c_char, flag: std::ffi::c_int) -> *mut std::ffi::c_void;
    fn dlclose(handle: *mut std::ffi::c_void) -> std::ffi::c_int;
}
