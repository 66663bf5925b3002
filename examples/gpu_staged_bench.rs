//! Staged-mode GPU benchmark: plain copies (the cudaMemcpy reference), staged
//! copies through the pinned ring, and staged transfers end to end over the
//! loopback or TCP transport, bytes verified.
//!
//! `cargo run --release -p pagewire-examples --no-default-features --features cuda \
//!   --example gpu_staged_bench -- --bytes 256M --chunk 2M --depth 4 --iters 5 [--require-gpu]`

use pagewire_examples::staged_bench::{StagedBenchOptions, run_staged_bench};

fn main() {
    let opts = match StagedBenchOptions::from_args(std::env::args().skip(1)) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("gpu_staged_bench: {e}");
            std::process::exit(2);
        }
    };
    match run_staged_bench(&opts) {
        Ok(report) => {
            println!("{report}");
            if !report.verified {
                eprintln!("gpu_staged_bench: bytes differ at the far end");
                std::process::exit(1);
            }
        }
        Err(e) => {
            eprintln!("gpu_staged_bench: {e}");
            std::process::exit(1);
        }
    }
}
