//! The topology snapshot from a sysfs tree: RDMA devices
//! (`class/infiniband/<dev>`: the PCI device behind it, its `numa_node`, each port's
//! `state` and `rate`), NVIDIA GPUs (`bus/pci/devices/*` with vendor `0x10de` and a
//! display or 3D controller class) and NUMA nodes (`devices/system/node/node<N>`).
//!
//! A device's PCI path is where its sysfs directory really is: the symlink resolved, the
//! part under `devices/` kept from the host bridge (`pci0000:00`) down to the device.
//! The root is a parameter so that tests read a recorded tree; links in such a tree are
//! relative, as the kernel's are. Whatever is missing or unreadable is left unknown.

use std::fs;
use std::path::{Path, PathBuf};

use crate::core::topology::{Gpu, Nic, NicPort, Topology};
use crate::error::Error;
use crate::util;

/// Where the kernel mounts sysfs.
pub const DEFAULT_SYSFS_ROOT: &str = "/sys";

const NVIDIA: u32 = 0x10de;
/// PCI base class 03 (display): subclass 00 (VGA) and 02 (3D controller, data-centre GPUs).
const GPU_CLASSES: [u32; 2] = [0x0300, 0x0302];

fn read_trim(p: &Path) -> Option<String> {
    fs::read_to_string(p).ok().map(|s| s.trim().to_string())
}

fn read_hex(p: &Path) -> Option<u32> {
    let s = read_trim(p)?;
    u32::from_str_radix(s.trim_start_matches("0x"), 16).ok()
}

/// `numa_node`: -1 (or anything unreadable) is unknown.
fn numa_node(dev: &Path) -> Option<u32> {
    read_trim(&dev.join("numa_node"))?
        .parse::<i64>()
        .ok()
        .and_then(|n| u32::try_from(n).ok())
}

/// `100 Gb/sec (4X EDR)` -> 100; `2.5 Gb/sec (1X SDR)` -> 2 (whole Gb/s); 0 if unknown.
fn rate_gbps(s: &str) -> u32 {
    s.split_whitespace()
        .next()
        .and_then(|n| n.parse::<f64>().ok())
        .filter(|g| g.is_finite() && *g >= 0.0)
        .map_or(0, |g| g.min(f64::from(u32::MAX)) as u32)
}

/// `4: ACTIVE` -> `ACTIVE`.
fn port_state(s: &str) -> String {
    s.split_once(':')
        .map_or(s, |(_, name)| name)
        .trim()
        .to_string()
}

fn is_host_bridge(c: &str) -> bool {
    // `pci0000:00`: domain and bus of the root complex.
    c.strip_prefix("pci").is_some_and(|r| {
        r.split_once(':').is_some_and(|(d, b)| {
            !d.is_empty()
                && !b.is_empty()
                && d.chars().chain(b.chars()).all(|c| c.is_ascii_hexdigit())
        })
    })
}

/// The PCI path of the device whose (resolved) sysfs directory is `real`, given the
/// resolved `devices` directory of the tree: host bridge first, the device last. Empty
/// when it is not under a host bridge (a virtual device).
fn pci_path(devices: &Path, real: &Path) -> Vec<String> {
    let Ok(rel) = real.strip_prefix(devices) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for (i, c) in rel.iter().enumerate() {
        let c = c.to_string_lossy();
        let ok = if i == 0 {
            is_host_bridge(&c)
        } else {
            util::pci_address(&c).as_deref() == Some(&*c)
        };
        if !ok {
            break;
        }
        out.push(c.into_owned());
    }
    if out.len() < 2 {
        out.clear();
    }
    out
}

fn dir_entries(p: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = fs::read_dir(p)
        .map(|it| it.filter_map(|e| e.ok().map(|e| e.path())).collect())
        .unwrap_or_default();
    v.sort();
    v
}

fn name_of(p: &Path) -> String {
    p.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// The PCI device under an RDMA device: its `device` link, or for a software device
/// (rxe, siw) the `device` link of the network interface named in `parent`.
fn nic_pci_dir(root: &Path, dev: &Path) -> Option<PathBuf> {
    let direct = dev.join("device");
    if direct.exists() {
        return Some(direct);
    }
    let parent = read_trim(&dev.join("parent"))?;
    let via_net = root.join("class/net").join(parent).join("device");
    via_net.exists().then_some(via_net)
}

fn read_nic(root: &Path, devices: &Path, dev: &Path) -> Nic {
    let mut nic = Nic {
        name: name_of(dev),
        ..Nic::default()
    };
    if let Some(pci) = nic_pci_dir(root, dev) {
        if let Ok(real) = pci.canonicalize() {
            nic.pci_path = pci_path(devices, &real);
            nic.pci = nic
                .pci_path
                .last()
                .filter(|_| !nic.pci_path.is_empty())
                .cloned();
        }
        nic.numa_node = numa_node(&pci);
    }
    for p in dir_entries(&dev.join("ports")) {
        let Ok(port) = name_of(&p).parse::<u8>() else {
            continue;
        };
        nic.ports.push(NicPort {
            port,
            state: read_trim(&p.join("state"))
                .map(|s| port_state(&s))
                .unwrap_or_default(),
            gbps: read_trim(&p.join("rate")).map_or(0, |s| rate_gbps(&s)),
        });
    }
    nic.ports.sort_by_key(|p| p.port);
    nic
}

fn read_gpu(devices: &Path, dev: &Path) -> Option<Gpu> {
    if read_hex(&dev.join("vendor"))? != NVIDIA {
        return None;
    }
    let class = read_hex(&dev.join("class"))?;
    if !GPU_CLASSES.contains(&(class >> 8)) {
        return None;
    }
    let pci = util::pci_address(&name_of(dev))?;
    let pci_path = dev
        .canonicalize()
        .map(|real| pci_path(devices, &real))
        .unwrap_or_default();
    Some(Gpu {
        pci,
        pci_path,
        numa_node: numa_node(dev),
    })
}

/// Reads the topology under `root` (normally [`DEFAULT_SYSFS_ROOT`]). Fails only when
/// `root` is not a readable directory; a tree without RDMA devices, GPUs or NUMA nodes
/// gives empty lists.
pub fn read_sysfs(root: &Path) -> Result<Topology, Error> {
    let root = root
        .canonicalize()
        .map_err(|e| Error::config("sysfs_root", root.display(), format!("cannot be read: {e}")))?;
    if !root.is_dir() {
        return Err(Error::config(
            "sysfs_root",
            root.display(),
            "not a directory",
        ));
    }
    let devices = root.join("devices");
    let nics = dir_entries(&root.join("class/infiniband"))
        .iter()
        .map(|d| read_nic(&root, &devices, d))
        .collect();
    let gpus = dir_entries(&root.join("bus/pci/devices"))
        .iter()
        .filter_map(|d| read_gpu(&devices, d))
        .collect();
    let nodes = dir_entries(&devices.join("system/node"))
        .iter()
        .filter_map(|p| name_of(p).strip_prefix("node")?.parse::<u32>().ok())
        .collect();
    Ok(Topology::new(nics, gpus, nodes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_parse() {
        assert_eq!(rate_gbps("100 Gb/sec (4X EDR)"), 100);
        assert_eq!(rate_gbps("2.5 Gb/sec (1X SDR)"), 2);
        assert_eq!(rate_gbps("garbage"), 0);
        assert_eq!(rate_gbps(""), 0);
        assert_eq!(port_state("4: ACTIVE"), "ACTIVE");
        assert_eq!(port_state("1: DOWN\n"), "DOWN");
        assert!(is_host_bridge("pci0000:00"));
        assert!(is_host_bridge("pci0001:80"));
        assert!(!is_host_bridge("pci"));
        assert!(!is_host_bridge("platform"));
        let devs = Path::new("/s/devices");
        assert_eq!(
            pci_path(
                devs,
                Path::new("/s/devices/pci0000:00/0000:00:01.0/0000:01:00.0/infiniband/mlx5_0")
            ),
            ["pci0000:00", "0000:00:01.0", "0000:01:00.0"]
        );
        assert!(pci_path(devs, Path::new("/s/devices/virtual/infiniband/rxe0")).is_empty());
        assert!(pci_path(devs, Path::new("/elsewhere/pci0000:00/0000:00:01.0")).is_empty());
    }

    #[test]
    fn a_missing_root_is_an_error_and_an_empty_tree_is_empty() {
        assert!(read_sysfs(Path::new("/nonexistent/pagewire-sysfs")).is_err());
        let t = read_sysfs(Path::new(env!("CARGO_MANIFEST_DIR"))).unwrap();
        assert!(t.nics.is_empty() && t.gpus.is_empty() && t.numa_nodes.is_empty());
    }

    /// Whatever this host has, reading the real sysfs works.
    #[test]
    fn reads_this_host() {
        if Path::new(DEFAULT_SYSFS_ROOT).join("devices").is_dir() {
            read_sysfs(Path::new(DEFAULT_SYSFS_ROOT)).unwrap();
        }
    }
}
