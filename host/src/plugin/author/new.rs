//! `piper plugin new NAME --lang L`: a working skeleton in a new folder,
//! anywhere — a strategy that replicates the model over every device (data
//! parallelism, so it plans on any device count), the WIT it builds
//! against, and a README with the one-line try command.

use super::{embedded, write, AuthorError, Lang};
use std::path::{Path, PathBuf};

const README: &str = include_str!("templates/README.md");

/// Create `parent/NAME` holding a `lang` skeleton; returns the folder.
pub fn new_plugin(name: &str, lang: Lang, parent: &Path) -> Result<PathBuf, AuthorError> {
    check_name(name)?;
    let dir = parent.join(name);
    if dir.exists() {
        return Err(AuthorError::Invalid(format!(
            "{} already exists; choose another name or remove it",
            dir.display()
        )));
    }
    let fill = |t: &str| t.replace("{{name}}", name);
    let mut files: Vec<(PathBuf, String)> = Vec::new();
    let (wit_at, setup) = match lang {
        Lang::Rust => {
            files.push((
                "Cargo.toml".into(),
                fill(include_str!("templates/rust_Cargo.toml")),
            ));
            files.push((
                "src/lib.rs".into(),
                fill(include_str!("templates/rust_lib.rs")),
            ));
            files.extend(vendored_rust_sdk());
            (
                "piper-sdk/wit/strategy.wit",
                "Needs `rustup target add wasm32-wasip2` (the build names it if missing). "
                    .to_string(),
            )
        }
        Lang::Python => {
            files.push(("app.py".into(), fill(include_str!("templates/app.py"))));
            files.push(("wit/strategy.wit".into(), embedded::WIT.into()));
            (
                "wit/strategy.wit",
                format!(
                    "Needs `pip install componentize-py=={}`. ",
                    embedded::COMPONENTIZE_PY
                ),
            )
        }
        Lang::Js => {
            files.push(("app.js".into(), fill(include_str!("templates/app.js"))));
            files.push((
                "package.json".into(),
                fill(include_str!("templates/package.json"))
                    .replace("{{componentize_js}}", embedded::COMPONENTIZE_JS)
                    .replace("{{preview2_shim}}", embedded::PREVIEW2_SHIM),
            ));
            files.push(("wit/strategy.wit".into(), embedded::WIT.into()));
            (
                "wit/strategy.wit",
                "Run `npm install` in this folder first (it installs componentize-js). "
                    .to_string(),
            )
        }
        Lang::C => {
            files.push(("app.c".into(), fill(include_str!("templates/app.c"))));
            files.push(("wit/strategy.wit".into(), embedded::WIT.into()));
            (
                "wit/strategy.wit",
                "Needs clang with wasi-libc (Debian: `apt-get install clang-19 lld-19 libclang-rt-19-dev-wasm32 wasi-libc`). ".to_string(),
            )
        }
    };
    let shown = if parent == Path::new(".") {
        name.to_string()
    } else {
        dir.display().to_string()
    };
    files.push((
        "README.md".into(),
        README
            .replace("{{name}}", name)
            .replace("{{lang}}", lang.title())
            .replace("{{dir}}", &shown)
            .replace("{{setup}}", &setup)
            .replace("{{wit}}", wit_at),
    ));
    std::fs::create_dir_all(parent).map_err(super::io("cannot create", parent))?;
    std::fs::create_dir(&dir).map_err(super::io("cannot create", &dir))?;
    for (rel, text) in files {
        write(&dir.join(rel), text.as_bytes())?;
    }
    Ok(dir)
}

/// Plugin names: what Cargo, Python and npm all accept as a folder and a
/// package name, and what `info().name` will say.
fn check_name(name: &str) -> Result<(), AuthorError> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name.starts_with(|c: char| c.is_ascii_lowercase())
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        && !name.ends_with('-');
    if ok {
        Ok(())
    } else {
        Err(AuthorError::Invalid(format!(
            "plugin name {name:?}: use 1 to 64 lowercase letters, digits and '-', starting with a letter (e.g. `my-pipeline`)"
        )))
    }
}

/// The Rust SDK as a crate of the skeleton's own: its sources, the WIT next
/// to them (`generate!` reads `wit/`), and no `native` feature (that one
/// links the host and exists only for Piper's own benchmarks).
fn vendored_rust_sdk() -> Vec<(PathBuf, String)> {
    let mut files = vec![
        (
            PathBuf::from("piper-sdk/Cargo.toml"),
            format!(
                "[package]\nname = \"piper-sdk\"\nversion = \"{}\"\nedition = \"2021\"\ndescription = \"Piper's Rust SDK, vendored by `piper plugin new`\"\n\n[dependencies]\nwit-bindgen = {{ version = \"{}\", default-features = false, features = [\"macros\", \"realloc\", \"std\", \"bitflags\"] }}\n",
                env!("CARGO_PKG_VERSION"),
                embedded::WIT_BINDGEN
            ),
        ),
        (PathBuf::from("piper-sdk/wit/strategy.wit"), embedded::WIT.to_string()),
    ];
    for (rel, text) in embedded::RUST_SDK {
        let mut text = text.replace("path: \"../wit\"", "path: \"wit\"");
        if let Some(cut) = text.find("#[cfg(feature = \"native\")]") {
            text.truncate(cut);
        }
        files.push((Path::new("piper-sdk").join(rel), text));
    }
    files
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_checked() {
        for bad in ["", "My", "1x", "a_b", "a-", "a b", "../x", &"a".repeat(65)] {
            assert!(check_name(bad).is_err(), "{bad:?}");
        }
        for good in ["a", "my-pipeline", "zb2"] {
            assert!(check_name(good).is_ok(), "{good:?}");
        }
    }

    #[test]
    fn the_vendored_sdk_reads_its_own_wit_and_drops_the_native_feature() {
        let files = vendored_rust_sdk();
        let lib = &files
            .iter()
            .find(|(p, _)| p.ends_with("src/lib.rs"))
            .unwrap()
            .1;
        assert!(lib.contains("path: \"wit\""));
        assert!(!lib.contains("../wit"));
        for (p, text) in &files {
            assert!(!text.contains("feature = \"native\""), "{}", p.display());
        }
    }
}
