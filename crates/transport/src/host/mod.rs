//! What the host itself says, read from files and the kernel: the PCIe and NUMA topology
//! under a sysfs root (`sysfs`), and the NUMA node of a page (`numa`). I/O, so outside
//! `core`, which turns the snapshot into rail preferences.

mod numa;
mod sysfs;

#[cfg_attr(not(feature = "verbs"), allow(unused_imports))]
pub(crate) use numa::node_of;
pub use sysfs::{DEFAULT_SYSFS_ROOT, read_sysfs};
