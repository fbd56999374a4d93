//! The `sluice` binary: parse the command line and run the chosen command.

use std::process::ExitCode;

use clap::Parser;
use sluice::cli::Cli;

// The allocator, chosen by measurement (docs/BENCHMARKS.md, "Idle streams"):
// jemalloc, whose background thread gives the memory of
// finished streams back to the system. The features are in Cargo.toml, its
// run-time options in .cargo/config.toml.
#[cfg(feature = "jemalloc")]
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

#[cfg(all(feature = "mimalloc", not(feature = "jemalloc")))]
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let cli = Cli::parse();
    sluice::telemetry::init_logging();
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(sluice::run(cli.command)) {
        Ok(()) => ExitCode::SUCCESS,
        // `sluice diagnose` found something critical (the report is out).
        Err(e) if e.is::<sluice::doctor::report::Critical>() => ExitCode::from(2),
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
