//! `gpufrac cdi generate`: a Container Device Interface spec that puts
//! containers started by Podman (or Docker ≥ 25) under gpufrac.

use clap::{Args, Subcommand};

#[derive(Args, Debug)]
pub struct CdiArgs {
    #[command(subcommand)]
    pub cmd: CdiCmd,
}

#[derive(Subcommand, Debug)]
pub enum CdiCmd {
    /// Write a CDI spec of kind gpufrac.dev/gpu.
    Generate(GenerateArgs),
}

#[derive(Args, Debug)]
pub struct GenerateArgs {}

pub fn main(_args: CdiArgs) -> u8 {
    eprintln!("gpufrac cdi: not yet implemented");
    1
}
