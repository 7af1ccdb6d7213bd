//! The `lbproxy` binary: parses the command line and hands it to the library ([`lbproxy::cli`]).

use clap::Parser as _;

fn main() -> std::process::ExitCode {
    lbproxy::cli::main(lbproxy::cli::Cli::parse())
}
