//! Plugin authoring: `piper plugin new | build | check`. Beside the flow —
//! it makes the components `plugin/` loads. Skeletons for Rust, Python,
//! JavaScript and C; one build per language with the WIT and the language
//! SDKs embedded in this binary (so the SDK always matches the host's WIT);
//! an inspection of a built component that runs `info()` but never `apply`.
//!
//! Decisions (docs/plugins.md): a Rust skeleton *vendors* the Rust SDK
//! (`piper-sdk/` inside the skeleton, wit-bindgen from crates.io), so it builds
//! on a machine without this repository. Python, JavaScript and C folders hold
//! only the author's code: `piper plugin build` writes the SDK and the WIT
//! bindings into `DIR/build/` and the component to `DIR/build/NAME.wasm`,
//! NAME being the folder's name.

mod build;
mod check;
mod new;

pub use build::{build, next_steps, Built};
pub use check::{check, Inspection};
pub use new::new_plugin;

use std::path::PathBuf;

/// A language a strategy can be written in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Lang {
    Rust,
    Python,
    Js,
    C,
}

impl Lang {
    pub fn title(self) -> &'static str {
        match self {
            Lang::Rust => "Rust",
            Lang::Python => "Python",
            Lang::Js => "JavaScript",
            Lang::C => "C",
        }
    }
}

/// The sources every build takes from this binary.
pub(crate) mod embedded {
    /// The WIT package this host speaks.
    pub const WIT: &str = include_str!("../../../../wit/strategy.wit");
    pub const PYTHON_SDK: &str = include_str!("../../../../sdk/python/piper_strategy.py");
    pub const JS_SDK: &str = include_str!("../../../../sdk/js/piper_strategy.js");
    pub const C_SDK_H: &str = include_str!("../../../../sdk/c/piper_strategy.h");
    pub const C_SDK_C: &str = include_str!("../../../../sdk/c/piper_strategy.c");
    /// The Rust SDK's sources, as vendored into a Rust skeleton.
    pub const RUST_SDK: &[(&str, &str)] = &[
        ("src/lib.rs", include_str!("../../../../sdk/src/lib.rs")),
        ("src/dag.rs", include_str!("../../../../sdk/src/dag.rs")),
        (
            "src/dualpipe.rs",
            include_str!("../../../../sdk/src/dualpipe.rs"),
        ),
        (
            "src/filter.rs",
            include_str!("../../../../sdk/src/filter.rs"),
        ),
        ("src/info.rs", include_str!("../../../../sdk/src/info.rs")),
        ("src/mesh.rs", include_str!("../../../../sdk/src/mesh.rs")),
        (
            "src/recompute.rs",
            include_str!("../../../../sdk/src/recompute.rs"),
        ),
        (
            "src/options.rs",
            include_str!("../../../../sdk/src/options.rs"),
        ),
        (
            "src/pipeline.rs",
            include_str!("../../../../sdk/src/pipeline.rs"),
        ),
    ];
    /// The wit-bindgen version the Rust SDK is written against.
    pub const WIT_BINDGEN: &str = "0.63";
    /// The guest toolchains builds were tested with (pinned in `.ci/run`).
    pub const COMPONENTIZE_PY: &str = "0.25.1";
    pub const COMPONENTIZE_JS: &str = "0.23.0";
    /// componentize-js imports it without declaring it; installed beside it.
    pub const PREVIEW2_SHIM: &str = "0.25.0";
}

/// Why authoring failed. Every case says what to do next.
#[derive(Debug, thiserror::Error)]
pub enum AuthorError {
    #[error("{tool} is needed to build {lang} plugins and was not found; install it with:\n    {install}")]
    MissingTool {
        lang: &'static str,
        tool: String,
        install: String,
    },
    #[error("cannot tell the language of the plugin in {dir}: expected Cargo.toml (Rust), app.py (Python), app.js (JavaScript) or a .c file (C)")]
    UnknownLang { dir: PathBuf },
    #[error("{what} {path}")]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("`{cmd}` failed ({status}):\n{output}")]
    Failed {
        cmd: String,
        status: String,
        output: String,
    },
    #[error("{0}")]
    Invalid(String),
    #[error("generating the C bindings or encoding the component: {0}")]
    Encode(String),
}

pub(crate) fn io(
    what: &'static str,
    path: impl Into<PathBuf>,
) -> impl FnOnce(std::io::Error) -> AuthorError {
    let path = path.into();
    move |source| AuthorError::Io { what, path, source }
}

/// Write `contents` to `path`, creating its folder.
pub(crate) fn write(path: &std::path::Path, contents: &[u8]) -> Result<(), AuthorError> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(io("cannot create", dir))?;
    }
    std::fs::write(path, contents).map_err(io("cannot write", path))
}

#[cfg(test)]
mod tests {
    /// A Rust skeleton vendors every source file of the SDK: one missing
    /// from the list leaves `piper plugin new --lang rust` unbuildable.
    #[test]
    fn the_vendored_rust_sdk_is_every_sdk_source_file() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../sdk/src");
        let mut on_disk: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".rs"))
            .map(|n| format!("src/{n}"))
            .collect();
        on_disk.sort();
        let mut vendored: Vec<String> = super::embedded::RUST_SDK
            .iter()
            .map(|(n, _)| n.to_string())
            .collect();
        vendored.sort();
        assert_eq!(vendored, on_disk);
        for (name, text) in super::embedded::RUST_SDK {
            assert_eq!(
                *text,
                std::fs::read_to_string(dir.join(&name[4..])).unwrap()
            );
        }
    }
}
