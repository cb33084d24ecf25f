//! Whether `libcuda` and `libnccl` can be opened, checked before cudarc is ever called (cudarc
//! panics when it cannot open them).
use crate::error::{CudaError, Library};
use std::sync::OnceLock;

/// The environment variable that makes this crate act as if CUDA were absent.
pub(crate) const DISABLE_ENV: &str = "ADAG_CUDA_DISABLE";

/// A library that opened, kept open for the life of the process.
struct Opened {
    /// The name it opened under.
    name: String,
    /// Where it lives, when the loader says.
    path: Option<String>,
    _lib: libloading::Library,
}

static CUDA: OnceLock<Result<Opened, CudaError>> = OnceLock::new();
static NCCL: OnceLock<Result<Opened, CudaError>> = OnceLock::new();

fn disabled() -> bool {
    std::env::var_os(DISABLE_ENV).is_some_and(|v| !v.is_empty() && v != "0")
}

/// The names cudarc tries, in its order (it opens the first that loads).
fn cudarc_candidates(library: Library) -> Vec<String> {
    let stems: &[&str] = match library {
        Library::Cuda => &["cuda", "nvcuda"],
        Library::Nccl => &["nccl"],
    };
    stems
        .iter()
        .flat_map(|s| cudarc::get_lib_name_candidates(s))
        .collect()
}

/// A symbol of the library, to ask the loader where it lives.
fn probe_symbol(library: Library) -> &'static [u8] {
    match library {
        Library::Cuda => b"cuInit\0",
        Library::Nccl => b"ncclGetVersion\0",
    }
}

/// The file a loaded library was mapped from (`dladdr` on one of its symbols).
fn library_path(lib: &libloading::Library, library: Library) -> Option<String> {
    // SAFETY: the symbol is only used for its address, never called.
    let sym = unsafe { lib.get::<unsafe extern "C" fn()>(probe_symbol(library)) }.ok()?;
    let addr = *sym as *const libc::c_void;
    let mut info = std::mem::MaybeUninit::<libc::Dl_info>::zeroed();
    // SAFETY: dladdr writes into `info`; a zero return means it found nothing.
    let found = unsafe { libc::dladdr(addr, info.as_mut_ptr()) };
    if found == 0 {
        return None;
    }
    // SAFETY: dladdr succeeded, so `info` is initialized.
    let info = unsafe { info.assume_init() };
    if info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: dli_fname is a NUL-terminated string owned by the loader.
    let name = unsafe { std::ffi::CStr::from_ptr(info.dli_fname) };
    Some(name.to_string_lossy().into_owned())
}

/// The first names of a list and how many more.
fn short_list(names: &[String]) -> String {
    let mut seen: Vec<&str> = Vec::new();
    for n in names {
        if !seen.contains(&n.as_str()) {
            seen.push(n);
        }
    }
    let shown: Vec<&str> = seen
        .iter()
        .copied()
        .filter(|n| !n.contains("64"))
        .take(6)
        .collect();
    format!("{} and {} more", shown.join(", "), seen.len() - shown.len())
}

/// The loader's message (libloading's own Display is only "dlopen failed").
fn dlopen_error(e: &libloading::Error) -> String {
    match std::error::Error::source(e) {
        Some(s) => s.to_string(),
        None => e.to_string(),
    }
}

fn open(library: Library) -> Result<Opened, CudaError> {
    let candidates = cudarc_candidates(library);
    let mut first_error = None;
    for name in &candidates {
        // SAFETY: opening a CUDA library runs its initializers, which is what cudarc will do
        // when it opens the same name.
        match unsafe { libloading::Library::new(name) } {
            Ok(lib) => {
                let path = library_path(&lib, library);
                return Ok(Opened {
                    name: name.clone(),
                    path,
                    _lib: lib,
                });
            }
            Err(e) => {
                if first_error.is_none() {
                    first_error = Some(dlopen_error(&e));
                }
            }
        }
    }
    // None of cudarc's names opened. The runtime packages of NCCL install only libnccl.so.2:
    // find it to say what to do.
    let extra: &[&str] = match library {
        Library::Cuda => &[],
        Library::Nccl => &["libnccl.so.2"],
    };
    for name in extra {
        // SAFETY: as above.
        if let Ok(lib) = unsafe { libloading::Library::new(*name) } {
            let path = library_path(&lib, library).unwrap_or_else(|| (*name).to_string());
            let dir = std::path::Path::new(&path)
                .parent()
                .map(|d| d.display().to_string())
                .unwrap_or_else(|| "its directory".into());
            return Err(CudaError::NotAvailable {
                library,
                detail: format!(
                    "{path} ({name}) opens, but cudarc only looks for {}",
                    short_list(&candidates)
                ),
                hint: format!(
                    "make a symlink named libnccl.so to it in a directory on LD_LIBRARY_PATH before the process starts (mkdir -p /tmp/nccl-shim && ln -sf {path} /tmp/nccl-shim/libnccl.so && export LD_LIBRARY_PATH=/tmp/nccl-shim:{dir}:$LD_LIBRARY_PATH), or install the libnccl-dev package; scripts/gpu/run.sh does this"
                ),
            });
        }
    }
    let hint = match library {
        Library::Cuda => {
            "this machine has no NVIDIA driver; use a machine with a GPU and its driver, or the CPU communicator (transport \"cpu\")"
        }
        Library::Nccl => {
            "install NCCL (the libnccl2 and libnccl-dev packages, or `pip install nvidia-nccl-cu12` and a symlink libnccl.so -> <site-packages>/nvidia/nccl/lib/libnccl.so.2 on LD_LIBRARY_PATH), or use the CPU communicator (transport \"cpu\")"
        }
    };
    Err(CudaError::NotAvailable {
        library,
        detail: format!(
            "none of the names that cudarc tries opens ({}): {}",
            short_list(&candidates),
            first_error.unwrap_or_default()
        ),
        hint: hint.into(),
    })
}

fn check(library: Library) -> Result<&'static Opened, CudaError> {
    if disabled() {
        return Err(CudaError::NotAvailable {
            library,
            detail: format!("{DISABLE_ENV} is set"),
            hint: format!("unset {DISABLE_ENV} to use CUDA"),
        });
    }
    let cell = match library {
        Library::Cuda => &CUDA,
        Library::Nccl => &NCCL,
    };
    cell.get_or_init(|| open(library))
        .as_ref()
        .map_err(Clone::clone)
}

/// Checks that the CUDA driver library opens, under one of the names cudarc tries. Every
/// entry point of this crate that reaches the driver calls it first.
///
/// `Ok` says only that the library opens: a machine may still have no device (then
/// [`crate::device_count`] is 0 or a [`CudaError::Driver`]).
pub fn check_cuda() -> Result<(), CudaError> {
    check(Library::Cuda).map(|_| ())
}

/// Checks that the NCCL library opens under one of the names cudarc tries (and the driver
/// too: NCCL needs it). Where only `libnccl.so.2` opens, the error says how to make it
/// visible to cudarc.
pub fn check_nccl() -> Result<(), CudaError> {
    check(Library::Cuda)?;
    check(Library::Nccl).map(|_| ())
}

/// The name a library opened under and, where the loader says, its path: `Some` after a
/// successful [`check_cuda`] / [`check_nccl`].
pub fn loaded_library(library: Library) -> Option<(String, Option<String>)> {
    let cell = match library {
        Library::Cuda => &CUDA,
        Library::Nccl => &NCCL,
    };
    cell.get()?
        .as_ref()
        .ok()
        .map(|o| (o.name.clone(), o.path.clone()))
}
