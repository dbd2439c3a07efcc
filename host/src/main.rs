//! The `piper` command.

fn main() -> std::process::ExitCode {
    piper::cli::main()
}
