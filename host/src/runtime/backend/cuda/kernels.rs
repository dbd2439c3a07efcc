//! The CUDA backend's kernels: CUDA C sources, one file per op family
//! (`kernels/*.cu`, mirroring `backend/cpu/`), compiled with NVRTC when a
//! device starts straight to a device binary for its compute capability
//! (PTX through the driver's JIT as the fallback), and kept for the process
//! (the same images for every virtual device of a GPU). NVRTC needs no GPU, so the
//! sources' compilation is tested on machines without one.

use cudarc::driver::{CudaContext, CudaFunction, CudaModule};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions, Ptx};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// What every source is compiled after (types, block reductions, the
/// CPU backend's `exp_small` and tanh).
pub const PRELUDE: &str = include_str!("kernels/prelude.cuh");

/// The kernel sources by op family.
pub const SOURCES: [(&str, &str); 8] = [
    ("elementwise", include_str!("kernels/elementwise.cu")),
    ("layernorm", include_str!("kernels/layernorm.cu")),
    ("rmsnorm", include_str!("kernels/rmsnorm.cu")),
    ("rope", include_str!("kernels/rope.cu")),
    ("embedding", include_str!("kernels/embedding.cu")),
    ("loss", include_str!("kernels/loss.cu")),
    ("attention", include_str!("kernels/attention.cu")),
    ("moe", include_str!("kernels/moe.cu")),
];

/// The architectures the sources are checked to compile for (Ampere,
/// Hopper); a device compiles for its own.
pub const CHECKED_ARCHS: [&str; 2] = ["compute_80", "compute_90"];

/// NVRTC's options: fp32 arithmetic as written (no fused multiply-adds,
/// IEEE division and square root), so a kernel computes what its CPU
/// counterpart does operation for operation where their formulas agree.
fn options(name: &str, arch: &'static str) -> CompileOptions {
    CompileOptions {
        arch: Some(arch),
        options: FP32_FLAGS.iter().map(|f| f.to_string()).collect(),
        name: Some(format!("{name}.cu")),
        ..Default::default()
    }
}

/// NVRTC's flags for fp32 as written, for PTX and device binaries alike.
const FP32_FLAGS: [&str; 3] = ["--fmad=false", "--prec-div=true", "--prec-sqrt=true"];

/// Compile one source (`name` from [`SOURCES`]) for `arch` (`compute_90`);
/// the compiler's log on failure.
pub fn compile(name: &str, src: &str, arch: &'static str) -> Result<Ptx, String> {
    // SAFETY: loading NVRTC runs its initialisers, as compiling would.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(format!(
            "{name}.cu: NVRTC (libnvrtc.so.13) cannot be loaded: put its directory on LD_LIBRARY_PATH"
        ));
    }
    let full = format!("{PRELUDE}\n{src}");
    compile_ptx_with_opts(full, options(name, arch)).map_err(|e| match e {
        cudarc::nvrtc::CompileError::CompileError { log, .. } => {
            format!("{name}.cu for {arch}: {}", log.to_string_lossy())
        }
        other => format!("{name}.cu for {arch}: {other}"),
    })
}

/// Compile one source straight to a device binary for `sm` (`sm_90`): no
/// driver JIT between NVRTC and the GPU, so an NVRTC newer than the driver
/// cannot fail at load with `UNSUPPORTED_PTX_VERSION`. The same options as
/// [`compile`]; the compiler's log on failure.
pub fn compile_cubin(name: &str, src: &str, sm: &str) -> Result<Vec<u8>, String> {
    use cudarc::nvrtc::{result, sys};
    // SAFETY: loading NVRTC runs its initialisers, as compiling would.
    if !unsafe { sys::is_culib_present() } {
        return Err(format!(
            "{name}.cu: NVRTC (libnvrtc.so.13) cannot be loaded: put its directory on LD_LIBRARY_PATH"
        ));
    }
    let full = std::ffi::CString::new(format!("{PRELUDE}\n{src}"))
        .map_err(|_| format!("{name}.cu holds a NUL byte"))?;
    let file = std::ffi::CString::new(format!("{name}.cu")).expect("no NUL in a source name");
    let mut opts: Vec<String> = FP32_FLAGS.iter().map(|f| f.to_string()).collect();
    opts.push(format!("--gpu-architecture={sm}"));
    let prog = result::create_program(&full, Some(&file)).map_err(|e| format!("{name}.cu: {e}"))?;
    // SAFETY: `prog` is a live program until destroyed below; the buffers
    // are sized by NVRTC's own size calls.
    let out = unsafe {
        match result::compile_program(prog, &opts) {
            Err(e) => {
                let log = result::get_program_log(prog).unwrap_or_default();
                let log: Vec<u8> = log
                    .iter()
                    .map(|c| *c as u8)
                    .take_while(|c| *c != 0)
                    .collect();
                Err(format!(
                    "{name}.cu for {sm}: {e}: {}",
                    String::from_utf8_lossy(&log)
                ))
            }
            Ok(()) => {
                let mut size = 0usize;
                sys::nvrtcGetCUBINSize(prog, &mut size)
                    .result()
                    .map_err(|e| format!("{name}.cu for {sm}: its binary's size: {e}"))
                    .and_then(|()| {
                        let mut bin = vec![0u8; size];
                        sys::nvrtcGetCUBIN(prog, bin.as_mut_ptr().cast())
                            .result()
                            .map_err(|e| format!("{name}.cu for {sm}: its binary: {e}"))
                            .map(|()| bin)
                    })
            }
        }
    };
    // SAFETY: destroyed once, after its last use.
    let _ = unsafe { result::destroy_program(prog) };
    out
}

/// `compute_90` for a device of compute capability 9.0.
pub fn arch_of(major: i32, minor: i32) -> Result<&'static str, String> {
    const KNOWN: [(i32, i32, &str); 8] = [
        (7, 0, "compute_70"),
        (7, 5, "compute_75"),
        (8, 0, "compute_80"),
        (8, 6, "compute_86"),
        (8, 9, "compute_89"),
        (9, 0, "compute_90"),
        (10, 0, "compute_100"),
        (12, 0, "compute_120"),
    ];
    KNOWN
        .iter()
        .find(|(a, b, _)| (*a, *b) == (major, minor))
        .map(|k| k.2)
        .ok_or_else(|| format!("compute capability {major}.{minor} has no kernel target here"))
}

/// Every source's image for one architecture (a device binary, or PTX for
/// the driver to JIT), by source name.
type Compiled = Arc<Vec<(&'static str, Ptx)>>;

/// Every source for one architecture, compiled once a process: device
/// binaries (`cubin`), or PTX (`!cubin`, the fallback).
fn images_for(arch: &'static str, cubin: bool) -> Result<Compiled, String> {
    static CACHE: OnceLock<Mutex<HashMap<(&'static str, bool), Compiled>>> = OnceLock::new();
    let cache = CACHE.get_or_init(|| Mutex::new(HashMap::new()));
    if let Some(p) = cache.lock().unwrap().get(&(arch, cubin)) {
        return Ok(p.clone());
    }
    let sm = arch.replace("compute_", "sm_");
    let compiled = SOURCES
        .iter()
        .map(|(name, src)| {
            let image = match cubin {
                true => Ptx::from_binary(compile_cubin(name, src, &sm)?),
                false => compile(name, src, arch)?,
            };
            Ok((*name, image))
        })
        .collect::<Result<Vec<_>, String>>()?;
    let compiled = Arc::new(compiled);
    cache
        .lock()
        .unwrap()
        .insert((arch, cubin), compiled.clone());
    Ok(compiled)
}

/// Every source loaded on `ctx`: device binaries first; PTX through the
/// driver's JIT when those fail, both errors named when that fails too.
fn load_modules(
    ctx: &Arc<CudaContext>,
    arch: &'static str,
) -> Result<HashMap<&'static str, Arc<CudaModule>>, String> {
    let load = |cubin: bool| -> Result<HashMap<&'static str, Arc<CudaModule>>, String> {
        let what = if cubin { "device binary" } else { "PTX" };
        images_for(arch, cubin)?
            .iter()
            .map(|(name, image)| {
                let m = ctx
                    .load_module(image.clone())
                    .map_err(|e| format!("loading {name}.cu's {what} for {arch}: {e}"))?;
                Ok((*name, m))
            })
            .collect()
    };
    load(true).or_else(|binary| load(false).map_err(|ptx| format!("{binary}; then as PTX: {ptx}")))
}

/// Every kernel of the backend, loaded on one GPU.
pub struct Kernels {
    pub residual_forward: CudaFunction,
    pub add_into: CudaFunction,
    pub add_bias_rows: CudaFunction,
    pub residual_bias: CudaFunction,
    pub gelu_forward: CudaFunction,
    pub bias_gelu_forward: CudaFunction,
    pub gelu_backward: CudaFunction,
    pub bias_backward: CudaFunction,
    pub adamw: CudaFunction,
    pub sum_squares: CudaFunction,
    pub layernorm_forward: CudaFunction,
    pub layernorm_backward_input: CudaFunction,
    pub layernorm_backward_weight: CudaFunction,
    pub embedding_forward: CudaFunction,
    pub embedding_backward_tokens: CudaFunction,
    pub embedding_backward_positions: CudaFunction,
    pub crossentropy_forward: CudaFunction,
    pub crossentropy_backward: CudaFunction,
    pub attention_split: CudaFunction,
    pub attention_merge: CudaFunction,
    pub attention_merge_backward: CudaFunction,
    pub attention_split_backward: CudaFunction,
    pub causal_softmax: CudaFunction,
    pub causal_softmax_backward: CudaFunction,
    pub flash_forward: CudaFunction,
    pub flash_backward_dq: CudaFunction,
    pub flash_backward_dkv: CudaFunction,
    pub moe_softmax_rows: CudaFunction,
    pub moe_gather_rows: CudaFunction,
    pub moe_scatter_add_rows: CudaFunction,
    pub moe_scatter_add_distinct: CudaFunction,
    pub moe_combine: CudaFunction,
    pub moe_combine_dweight: CudaFunction,
    pub moe_combine_dy: CudaFunction,
    pub moe_router_backward: CudaFunction,
    pub rmsnorm_forward: CudaFunction,
    pub rmsnorm_backward_input: CudaFunction,
    pub rmsnorm_backward_weight: CudaFunction,
    pub rope: CudaFunction,
    pub swiglu_forward: CudaFunction,
    pub swiglu_backward: CudaFunction,
    pub qkv_pack: CudaFunction,
    pub qkv_unpack_backward: CudaFunction,
    pub token_embedding_forward: CudaFunction,
    pub col_finish: CudaFunction,
    pub ring_forward: CudaFunction,
    pub ring_backward_dq: CudaFunction,
    pub ring_backward_dkv: CudaFunction,
    pub bf16_widen: CudaFunction,
    pub bf16_narrow: CudaFunction,
}

impl Kernels {
    /// Compile (once a process) and load every kernel on `ctx`'s GPU.
    pub fn load(ctx: &Arc<CudaContext>) -> Result<Self, String> {
        let (major, minor) = ctx
            .compute_capability()
            .map_err(|e| format!("reading the compute capability: {e}"))?;
        let arch = arch_of(major, minor)?;
        let modules = load_modules(ctx, arch)?;
        let f = |module: &str, name: &str| -> Result<CudaFunction, String> {
            modules[module]
                .load_function(name)
                .map_err(|e| format!("{module}.cu has no kernel `{name}`: {e}"))
        };
        Ok(Kernels {
            residual_forward: f("elementwise", "residual_forward")?,
            add_into: f("elementwise", "add_into")?,
            add_bias_rows: f("elementwise", "add_bias_rows")?,
            residual_bias: f("elementwise", "residual_bias")?,
            gelu_forward: f("elementwise", "gelu_forward")?,
            bias_gelu_forward: f("elementwise", "bias_gelu_forward")?,
            gelu_backward: f("elementwise", "gelu_backward")?,
            bias_backward: f("elementwise", "bias_backward")?,
            adamw: f("elementwise", "adamw")?,
            sum_squares: f("elementwise", "sum_squares")?,
            layernorm_forward: f("layernorm", "layernorm_forward")?,
            layernorm_backward_input: f("layernorm", "layernorm_backward_input")?,
            layernorm_backward_weight: f("layernorm", "layernorm_backward_weight")?,
            embedding_forward: f("embedding", "embedding_forward")?,
            embedding_backward_tokens: f("embedding", "embedding_backward_tokens")?,
            embedding_backward_positions: f("embedding", "embedding_backward_positions")?,
            crossentropy_forward: f("loss", "crossentropy_forward")?,
            crossentropy_backward: f("loss", "crossentropy_backward")?,
            attention_split: f("attention", "attention_split")?,
            attention_merge: f("attention", "attention_merge")?,
            attention_merge_backward: f("attention", "attention_merge_backward")?,
            attention_split_backward: f("attention", "attention_split_backward")?,
            causal_softmax: f("attention", "causal_softmax")?,
            causal_softmax_backward: f("attention", "causal_softmax_backward")?,
            flash_forward: f("attention", "flash_forward")?,
            flash_backward_dq: f("attention", "flash_backward_dq")?,
            flash_backward_dkv: f("attention", "flash_backward_dkv")?,
            moe_softmax_rows: f("moe", "moe_softmax_rows")?,
            moe_gather_rows: f("moe", "moe_gather_rows")?,
            moe_scatter_add_rows: f("moe", "moe_scatter_add_rows")?,
            moe_scatter_add_distinct: f("moe", "moe_scatter_add_distinct")?,
            moe_combine: f("moe", "moe_combine")?,
            moe_combine_dweight: f("moe", "moe_combine_dweight")?,
            moe_combine_dy: f("moe", "moe_combine_dy")?,
            moe_router_backward: f("moe", "moe_router_backward")?,
            rmsnorm_forward: f("rmsnorm", "rmsnorm_forward")?,
            rmsnorm_backward_input: f("rmsnorm", "rmsnorm_backward_input")?,
            rmsnorm_backward_weight: f("rmsnorm", "rmsnorm_backward_weight")?,
            rope: f("rope", "rope")?,
            swiglu_forward: f("elementwise", "swiglu_forward")?,
            swiglu_backward: f("elementwise", "swiglu_backward")?,
            qkv_pack: f("attention", "qkv_pack")?,
            qkv_unpack_backward: f("attention", "qkv_unpack_backward")?,
            token_embedding_forward: f("embedding", "token_embedding_forward")?,
            col_finish: f("elementwise", "col_finish")?,
            ring_forward: f("attention", "ring_forward")?,
            ring_backward_dq: f("attention", "ring_backward_dq")?,
            ring_backward_dkv: f("attention", "ring_backward_dkv")?,
            bf16_widen: f("elementwise", "bf16_widen")?,
            bf16_narrow: f("elementwise", "bf16_narrow")?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kernel names a source defines (`extern "C" __global__ void name(`).
    fn kernel_names(src: &str) -> Vec<&str> {
        src.split("extern \"C\" __global__ void ")
            .skip(1)
            .filter_map(|rest| rest.split('(').next())
            .collect()
    }

    /// Every source compiles to PTX for Ampere and Hopper with NVRTC (which
    /// needs no GPU: PyPI's `nvidia-cuda-nvrtc` ships it), and the PTX
    /// holds every kernel the backend loads. Reported as not run where
    /// NVRTC cannot be loaded (`scripts/test.sh` lists it; CI fails on it).
    #[test]
    fn every_kernel_source_compiles_for_ampere_and_hopper() {
        // SAFETY: loading NVRTC runs its initialisers, as compiling would.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            crate::test_support::not_run(
                "cuda kernels (NVRTC)",
                "libnvrtc.so.13 is not on LD_LIBRARY_PATH (scripts/nvrtc.sh installs it)",
            );
            return;
        }
        let mut kernels = 0;
        for arch in CHECKED_ARCHS {
            for (name, src) in SOURCES {
                let ptx = compile(name, src, arch).unwrap_or_else(|e| panic!("{e}"));
                let text = ptx.to_src();
                let names = kernel_names(src);
                assert!(!names.is_empty(), "{name}.cu defines no kernel");
                for k in names {
                    assert!(
                        text.contains(&format!(".entry {k}(")),
                        "{name}.cu for {arch}: no entry `{k}` in the PTX"
                    );
                    kernels += 1;
                }
                let target = arch.replace("compute_", "sm_");
                assert!(
                    text.contains(&format!(".target {target}")),
                    "{name}.cu: not built for {target}"
                );
            }
        }
        // Every kernel `Kernels` loads, for both architectures.
        assert_eq!(kernels, 2 * 50);
    }

    /// One kernel as ptxas assembled it.
    #[derive(Debug, Default)]
    struct Assembled {
        name: String,
        registers: u32,
        spill_stores: u32,
        spill_loads: u32,
    }

    /// `ptxas -v`'s report: per entry, its registers (`Used N registers`)
    /// and spills (`S bytes spill stores, L bytes spill loads`).
    fn assembled(report: &str) -> Vec<Assembled> {
        let number = |line: &str, before: &str| -> Option<u32> {
            let at = line.find(before)?;
            line[..at].split_whitespace().last()?.parse().ok()
        };
        let mut out: Vec<Assembled> = Vec::new();
        for line in report.lines() {
            if let Some(rest) = line.split("Compiling entry function '").nth(1) {
                let name = rest.split('\'').next().unwrap_or_default();
                out.push(Assembled {
                    name: name.to_string(),
                    ..Default::default()
                });
            } else if let Some(k) = out.last_mut() {
                if let Some(n) = number(line, " bytes spill stores") {
                    k.spill_stores = n;
                    k.spill_loads = number(line, " bytes spill loads").unwrap_or(u32::MAX);
                }
                if let Some(n) = number(line, " registers") {
                    k.registers = n;
                }
            }
        }
        out
    }

    /// Every kernel assembled by ptxas (PyPI's `nvidia-cuda-nvcc`,
    /// `scripts/ptxas.sh`, named by `PIPER_PTXAS`) for sm_80 and sm_90
    /// from NVRTC's PTX: none spills registers to local memory; each one's
    /// registers printed. Reported as not run without ptxas or NVRTC.
    #[test]
    fn every_kernel_assembles_without_spills_for_ampere_and_hopper() {
        let ptxas = std::env::var_os("PIPER_PTXAS").filter(|p| !p.is_empty());
        // SAFETY: loading NVRTC runs its initialisers, as compiling would.
        let nvrtc = unsafe { cudarc::nvrtc::sys::is_culib_present() };
        let Some(ptxas) = ptxas.filter(|_| nvrtc) else {
            crate::test_support::not_run(
                "cuda kernels (ptxas)",
                "PIPER_PTXAS names no ptxas or NVRTC is missing (scripts/ptxas.sh, scripts/nvrtc.sh)",
            );
            return;
        };
        let dir = std::env::temp_dir().join(format!("piper-ptxas-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut kernels = 0;
        for arch in CHECKED_ARCHS {
            let sm = arch.replace("compute_", "sm_");
            for (name, src) in SOURCES {
                let ptx = compile(name, src, arch).unwrap_or_else(|e| panic!("{e}"));
                let file = dir.join(format!("{name}-{sm}.ptx"));
                std::fs::write(&file, ptx.to_src()).unwrap();
                let out = std::process::Command::new(&ptxas)
                    .args(["-v", "--gpu-name", &sm, "-o", "/dev/null"])
                    .arg(&file)
                    .output()
                    .unwrap_or_else(|e| panic!("running {}: {e}", ptxas.to_string_lossy()));
                let report = String::from_utf8_lossy(&out.stderr);
                assert!(out.status.success(), "ptxas {name}.cu for {sm}: {report}");
                let found = assembled(&report);
                assert_eq!(
                    found.len(),
                    kernel_names(src).len(),
                    "{name}.cu for {sm}: {report}"
                );
                for k in found {
                    println!("{sm} {name}.cu {}: {} registers", k.name, k.registers);
                    assert!(
                        k.registers > 0 && k.spill_stores == 0 && k.spill_loads == 0,
                        "{sm} {name}.cu {}: {} registers, spills {} bytes stored, {} loaded",
                        k.name,
                        k.registers,
                        k.spill_stores,
                        k.spill_loads
                    );
                    kernels += 1;
                }
            }
        }
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(kernels, 2 * 50);
    }

    /// The report's parser reads registers and spills per entry.
    #[test]
    fn a_ptxas_report_is_read_entry_by_entry() {
        let report = "ptxas info    : 0 bytes gmem\n\
ptxas info    : Compiling entry function 'a' for 'sm_90'\n\
ptxas info    : Function properties for a\n\
    8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads\n\
ptxas info    : Used 40 registers, used 0 barriers, 8 bytes cumulative stack size\n\
ptxas info    : Compiling entry function 'b' for 'sm_90'\n\
ptxas info    : Function properties for b\n\
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n\
ptxas info    : Used 18 registers, used 1 barriers\n";
        let k = assembled(report);
        assert_eq!(k.len(), 2);
        assert_eq!((k[0].name.as_str(), k[0].registers), ("a", 40));
        assert_eq!((k[0].spill_stores, k[0].spill_loads), (4, 12));
        assert_eq!(
            (k[1].name.as_str(), k[1].registers, k[1].spill_stores),
            ("b", 18, 0)
        );
    }

    /// Straight to device binaries, as a GPU loads them: ELF images for
    /// sm_80 and sm_90 holding every kernel `Kernels` loads.
    #[test]
    fn every_kernel_source_compiles_to_a_device_binary_for_ampere_and_hopper() {
        // SAFETY: as above.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            crate::test_support::not_run(
                "cuda kernels (NVRTC)",
                "libnvrtc.so.13 is not on LD_LIBRARY_PATH (scripts/nvrtc.sh installs it)",
            );
            return;
        }
        let mut kernels = 0;
        for sm in ["sm_80", "sm_90"] {
            for (name, src) in SOURCES {
                let bin = compile_cubin(name, src, sm).unwrap_or_else(|e| panic!("{e}"));
                assert_eq!(
                    &bin[..4],
                    b"\x7fELF",
                    "{name}.cu for {sm}: not an ELF image"
                );
                for k in kernel_names(src) {
                    assert!(
                        bin.windows(k.len() + 1)
                            .any(|w| w[..k.len()] == *k.as_bytes() && w[k.len()] == 0),
                        "{name}.cu for {sm}: no symbol `{k}`"
                    );
                    kernels += 1;
                }
            }
        }
        assert_eq!(kernels, 2 * 50);
        let e = compile_cubin(
            "broken",
            "extern \"C\" __global__ void f(float* x) { x[0] = y; }",
            "sm_90",
        )
        .unwrap_err();
        assert!(
            e.contains("broken.cu for sm_90") && e.contains("identifier \"y\" is undefined"),
            "{e}"
        );
    }

    #[test]
    fn a_kernel_that_does_not_compile_is_an_error_with_the_compilers_log() {
        // SAFETY: as above.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            crate::test_support::not_run(
                "cuda kernels (NVRTC)",
                "libnvrtc.so.13 is not on LD_LIBRARY_PATH (scripts/nvrtc.sh installs it)",
            );
            return;
        }
        let e = compile(
            "broken",
            "extern \"C\" __global__ void f(float* x) { x[0] = y; }",
            "compute_90",
        )
        .unwrap_err();
        assert!(e.starts_with("broken.cu for compute_90:"), "{e}");
        assert!(e.contains("identifier \"y\" is undefined"), "{e}");
    }

    #[test]
    fn compute_capabilities_map_to_their_targets() {
        assert_eq!(arch_of(9, 0), Ok("compute_90"));
        assert_eq!(arch_of(8, 0), Ok("compute_80"));
        assert!(arch_of(6, 1).unwrap_err().contains("6.1"));
    }
}
