//! `gpufrac slurm-task-prolog`: a Slurm TaskProlog that turns a job's
//! `gres/shard` allocation into the shim's environment.

use clap::Args;

#[derive(Args, Debug)]
pub struct PrologArgs {}

pub fn main(_args: PrologArgs) -> u8 {
    0
}
