//! `gpufrac k8s-device-plugin`: a kubelet device plugin (API v1beta1) that
//! advertises gpufrac slots or memory units.

use clap::Args;

#[derive(Args, Debug)]
pub struct PluginArgs {}

pub fn main(_args: PluginArgs) -> u8 {
    eprintln!("gpufrac k8s-device-plugin: not yet implemented");
    1
}
