//! Which rails (RDMA NICs) are nearest to a piece of memory, from a snapshot of the
//! host's PCIe tree and NUMA nodes. Pure data: the snapshot is read elsewhere (`host`),
//! the engine's verbs backend applies the result per registration.
//!
//! The rule, nearest first: a NIC under the same PCIe switch as the GPU (sharing its root
//! port; fewer bridges between them first), then one under the same host bridge (root
//! complex), then one on the same NUMA node, then one whose node is unknown, then one on
//! another node. Host memory on node `n` only has the NUMA steps. Rails equally near form
//! one tier; a batch uses the first tier that has a usable rail and stripes over all of
//! it. Inside a tier rails are listed by link speed, then in configuration order. A
//! priority list ([`RailPriority`]) replaces the rule for the memory it names.

use std::fmt;

use crate::config::{MemoryKey, RailPriority};
use crate::error::Error;
use crate::util;

/// What the host's sysfs says about its RDMA NICs, NVIDIA GPUs and NUMA nodes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Topology {
    /// RDMA devices by name.
    pub nics: Vec<Nic>,
    /// NVIDIA GPUs by PCI address (so `cuda:N` is the N-th in PCI bus order).
    pub gpus: Vec<Gpu>,
    /// NUMA node numbers (empty when the host exposes none).
    pub numa_nodes: Vec<u32>,
}

/// One RDMA device.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Nic {
    pub name: String,
    /// PCI address (`0000:3b:00.0`); `None` for a software device (rxe, siw).
    pub pci: Option<String>,
    /// Host bridge, then every PCI bridge and port down to the device itself
    /// (`pci0000:00`, `0000:00:01.0`, ..., the device); empty when unknown.
    pub pci_path: Vec<String>,
    /// `None` when unknown (sysfs says -1, or no PCI device).
    pub numa_node: Option<u32>,
    pub ports: Vec<NicPort>,
}

/// One port of an RDMA device.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct NicPort {
    pub port: u8,
    /// `ACTIVE`, `DOWN`, ... (empty if unreadable).
    pub state: String,
    /// Link rate in Gb/s (0 if unknown).
    pub gbps: u32,
}

/// One NVIDIA GPU.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Gpu {
    /// PCI address (`0000:3b:00.0`).
    pub pci: String,
    /// As [`Nic::pci_path`].
    pub pci_path: Vec<String>,
    pub numa_node: Option<u32>,
}

impl Nic {
    /// A NIC with these fields (tests and tools; the engine reads sysfs).
    pub fn new(name: &str, pci_path: &[&str], numa_node: Option<u32>, gbps: u32) -> Self {
        Nic {
            name: name.into(),
            pci: pci_path.last().and_then(|p| util::pci_address(p)),
            pci_path: pci_path.iter().map(|s| s.to_string()).collect(),
            numa_node,
            ports: vec![NicPort {
                port: 1,
                state: "ACTIVE".into(),
                gbps,
            }],
        }
    }

    /// The fastest ACTIVE port's rate, else the fastest port's (0: unknown).
    pub fn gbps(&self) -> u32 {
        let best = |active: bool| {
            self.ports
                .iter()
                .filter(|p| !active || p.state == "ACTIVE")
                .map(|p| p.gbps)
                .max()
        };
        best(true).or_else(|| best(false)).unwrap_or(0)
    }
}

impl Gpu {
    /// A GPU with these fields (its PCI address is the path's last element).
    pub fn new(pci_path: &[&str], numa_node: Option<u32>) -> Self {
        Gpu {
            pci: pci_path
                .last()
                .and_then(|p| util::pci_address(p))
                .unwrap_or_default(),
            pci_path: pci_path.iter().map(|s| s.to_string()).collect(),
            numa_node,
        }
    }
}

impl Topology {
    /// A snapshot from parts (sorted as the reader sorts them).
    pub fn new(mut nics: Vec<Nic>, mut gpus: Vec<Gpu>, mut numa_nodes: Vec<u32>) -> Self {
        nics.sort_by(|a, b| a.name.cmp(&b.name));
        gpus.sort_by(|a, b| a.pci.cmp(&b.pci));
        numa_nodes.sort_unstable();
        numa_nodes.dedup();
        Topology {
            nics,
            gpus,
            numa_nodes,
        }
    }

    pub fn nic(&self, name: &str) -> Option<&Nic> {
        self.nics.iter().find(|n| n.name == name)
    }

    pub fn gpu(&self, pci: &str) -> Option<&Gpu> {
        self.gpus.iter().find(|g| g.pci == pci)
    }
}

/// Where a registration's memory is.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum MemoryLocation {
    /// Not known: every rail is as near as any other.
    Any,
    /// Host memory on this NUMA node.
    HostNode(u32),
    /// Memory of the GPU at this PCI address (`dddd:bb:dd.f`, see [`MemoryLocation::gpu`]).
    Gpu(String),
}

impl MemoryLocation {
    /// GPU memory, from a PCI address in any usual spelling (CUDA's `00000000:3B:00.0`
    /// too); `None` if `pci` is not one.
    pub fn gpu(pci: &str) -> Option<Self> {
        util::pci_address(pci).map(MemoryLocation::Gpu)
    }
}

impl fmt::Display for MemoryLocation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MemoryLocation::Any => f.write_str("any"),
            MemoryLocation::HostNode(n) => write!(f, "cpu:{n}"),
            MemoryLocation::Gpu(p) => write!(f, "gpu:{p}"),
        }
    }
}

/// How near a rail is to some memory; smaller is nearer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Nearness {
    /// Under the GPU's PCIe switch (same root port), `hops` links apart.
    Switch { hops: u32 },
    /// Under the same host bridge (root complex), through it.
    HostBridge,
    /// On the memory's NUMA node.
    NumaNode,
    /// The NIC's or the memory's NUMA node is not known.
    Unknown,
    /// On another NUMA node.
    Remote,
}

impl fmt::Display for Nearness {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Nearness::Switch { hops } => write!(f, "same PCIe switch ({hops} hops)"),
            Nearness::HostBridge => f.write_str("same host bridge"),
            Nearness::NumaNode => f.write_str("same NUMA node"),
            Nearness::Unknown => f.write_str("unknown"),
            Nearness::Remote => f.write_str("other NUMA node"),
        }
    }
}

/// Where a rail preference came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// The topology rule.
    Rule,
    /// This entry of the priority list.
    Override(MemoryKey),
}

/// Rails for some memory: indices into the engine's rails, in tiers, nearest first.
/// Every rail is in exactly one tier.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Choice {
    pub tiers: Vec<Vec<usize>>,
    pub source: Source,
}

impl Choice {
    /// Whether the choice prefers some rails over others (more than one tier).
    pub fn is_selective(&self) -> bool {
        self.tiers.len() > 1
    }
}

/// One rail as the engine opened it: device name and link speed (0 = unknown).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RailRef {
    pub name: String,
    pub gbps: u32,
}

/// The topology, the engine's rails and the priority list: answers which rails serve
/// which memory.
#[derive(Debug, Clone)]
pub struct Placement {
    topo: Topology,
    rails: Vec<RailRef>,
    priority: Option<RailPriority>,
}

/// Number of leading elements two paths share.
fn common_prefix(a: &[String], b: &[String]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

fn by_node(a: Option<u32>, b: Option<u32>) -> Nearness {
    match (a, b) {
        (Some(x), Some(y)) if x == y => Nearness::NumaNode,
        (Some(_), Some(_)) => Nearness::Remote,
        _ => Nearness::Unknown,
    }
}

/// How near `nic` (`None`: not in the snapshot) is to memory of `gpu`.
fn gpu_nearness(nic: Option<&Nic>, gpu: &Gpu) -> Nearness {
    let Some(nic) = nic else {
        return Nearness::Unknown;
    };
    let (a, b) = (&nic.pci_path, &gpu.pci_path);
    if !a.is_empty() && !b.is_empty() {
        match common_prefix(a, b) {
            // Host bridge and root port shared: one switch tree (nvidia-smi's PIX/PXB).
            c if c >= 2 => {
                return Nearness::Switch {
                    hops: (a.len() - c + b.len() - c) as u32,
                };
            }
            1 => return Nearness::HostBridge,
            _ => {}
        }
    }
    by_node(nic.numa_node, gpu.numa_node)
}

impl Placement {
    /// Checks that every rail the priority list names is one of `rails`.
    pub fn new(
        topo: Topology,
        rails: Vec<RailRef>,
        priority: Option<RailPriority>,
    ) -> Result<Self, Error> {
        if let Some(p) = &priority {
            for name in p.rail_names() {
                if !rails.iter().any(|r| r.name == name) {
                    let have: Vec<&str> = rails.iter().map(|r| r.name.as_str()).collect();
                    return Err(Error::config(
                        "rail_priority",
                        p,
                        format!("{name} is not one of the rails ({})", have.join(", ")),
                    ));
                }
            }
        }
        Ok(Placement {
            topo,
            rails,
            priority,
        })
    }

    pub fn topology(&self) -> &Topology {
        &self.topo
    }

    pub fn rails(&self) -> &[RailRef] {
        &self.rails
    }

    pub fn priority(&self) -> Option<&RailPriority> {
        self.priority.as_ref()
    }

    /// How near rail `r` is to `loc`.
    pub fn nearness(&self, r: usize, loc: &MemoryLocation) -> Nearness {
        let nic = self.topo.nic(&self.rails[r].name);
        match loc {
            MemoryLocation::Any => Nearness::Unknown,
            MemoryLocation::HostNode(n) => by_node(nic.and_then(|x| x.numa_node), Some(*n)),
            MemoryLocation::Gpu(pci) => match self.topo.gpu(pci) {
                Some(g) => gpu_nearness(nic, g),
                None => Nearness::Unknown,
            },
        }
    }

    /// The rule's tiers for `loc`: rails grouped by nearness, nearest group first; in a
    /// group, faster links first, then configuration order.
    pub fn rule(&self, loc: &MemoryLocation) -> Vec<Vec<usize>> {
        let mut order: Vec<(Nearness, std::cmp::Reverse<u32>, usize)> = (0..self.rails.len())
            .map(|r| {
                (
                    self.nearness(r, loc),
                    std::cmp::Reverse(self.rails[r].gbps),
                    r,
                )
            })
            .collect();
        order.sort_unstable();
        let mut tiers: Vec<Vec<usize>> = Vec::new();
        let mut last = None;
        for (n, _, r) in order {
            if last == Some(n) {
                tiers.last_mut().expect("a tier was started").push(r);
            } else {
                tiers.push(vec![r]);
                last = Some(n);
            }
        }
        tiers
    }

    /// The priority list's key for `loc`, if it has an entry for it.
    fn override_for(&self, loc: &MemoryLocation) -> Option<(MemoryKey, &[Vec<String>])> {
        let p = self.priority.as_ref()?;
        let keys = match loc {
            MemoryLocation::Any => vec![],
            MemoryLocation::HostNode(n) => vec![MemoryKey::Cpu(*n)],
            MemoryLocation::Gpu(pci) => {
                let mut k = vec![MemoryKey::Gpu(pci.clone())];
                if let Some(i) = self.topo.gpus.iter().position(|g| g.pci == *pci) {
                    k.push(MemoryKey::Cuda(i as u32));
                }
                k
            }
        };
        keys.into_iter().find_map(|k| p.get(&k).map(|t| (k, t)))
    }

    /// The rails for `loc`: the priority list's entry for it (rails it does not name in a
    /// last tier), else the rule.
    pub fn choice(&self, loc: &MemoryLocation) -> Choice {
        let Some((key, named)) = self.override_for(loc) else {
            return Choice {
                tiers: self.rule(loc),
                source: Source::Rule,
            };
        };
        let index = |n: &String| self.rails.iter().position(|r| r.name == *n);
        let mut tiers: Vec<Vec<usize>> = named
            .iter()
            .map(|t| t.iter().filter_map(index).collect::<Vec<_>>())
            .filter(|t| !t.is_empty())
            .collect();
        let rest: Vec<usize> = (0..self.rails.len())
            .filter(|r| !tiers.iter().flatten().any(|x| x == r))
            .collect();
        if !rest.is_empty() {
            tiers.push(rest);
        }
        Choice {
            tiers,
            source: Source::Override(key),
        }
    }

    /// Every memory the snapshot knows (each NUMA node, each GPU) with its rails.
    pub fn table(&self) -> Vec<(MemoryLocation, Choice)> {
        self.topo
            .numa_nodes
            .iter()
            .map(|&n| MemoryLocation::HostNode(n))
            .chain(
                self.topo
                    .gpus
                    .iter()
                    .map(|g| MemoryLocation::Gpu(g.pci.clone())),
            )
            .map(|loc| {
                let c = self.choice(&loc);
                (loc, c)
            })
            .collect()
    }

    /// Priority-list entries that name no memory of this snapshot (a GPU or node it
    /// does not have): they never apply.
    pub fn unmatched(&self) -> Vec<MemoryKey> {
        let Some(p) = &self.priority else {
            return Vec::new();
        };
        p.entries()
            .iter()
            .map(|(k, _)| k)
            .filter(|k| match k {
                MemoryKey::Cpu(n) => !self.topo.numa_nodes.contains(n),
                MemoryKey::Cuda(i) => *i as usize >= self.topo.gpus.len(),
                MemoryKey::Gpu(pci) => self.topo.gpu(pci).is_none(),
            })
            .cloned()
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn rails(names: &[(&str, u32)]) -> Vec<RailRef> {
        names
            .iter()
            .map(|&(n, g)| RailRef {
                name: n.into(),
                gbps: g,
            })
            .collect()
    }

    /// Two nodes; node 0: root port 01.0 -> switch with gpu0 and mlx5_0, root port 02.0
    /// -> mlx5_1 alone; node 1 (host bridge pci0000:80): switch with gpu1 and mlx5_2.
    fn two_sockets() -> Topology {
        let sw0 = ["pci0000:00", "0000:00:01.0", "0000:01:00.0"];
        let sw1 = ["pci0000:80", "0000:80:01.0", "0000:81:00.0"];
        let at = |base: &[&'static str], tail: &[&'static str]| -> Vec<&'static str> {
            base.iter().chain(tail).copied().collect()
        };
        Topology::new(
            vec![
                Nic::new(
                    "mlx5_0",
                    &at(&sw0, &["0000:02:01.0", "0000:04:00.0"]),
                    Some(0),
                    200,
                ),
                Nic::new(
                    "mlx5_1",
                    &["pci0000:00", "0000:00:02.0", "0000:10:00.0"],
                    Some(0),
                    200,
                ),
                Nic::new(
                    "mlx5_2",
                    &at(&sw1, &["0000:82:01.0", "0000:84:00.0"]),
                    Some(1),
                    200,
                ),
            ],
            vec![
                Gpu::new(&at(&sw0, &["0000:02:00.0", "0000:03:00.0"]), Some(0)),
                Gpu::new(&at(&sw1, &["0000:82:00.0", "0000:83:00.0"]), Some(1)),
            ],
            vec![1, 0],
        )
    }

    fn placement(p: Option<&str>) -> Placement {
        Placement::new(
            two_sockets(),
            rails(&[("mlx5_0", 200), ("mlx5_1", 200), ("mlx5_2", 200)]),
            p.map(|s| s.parse().unwrap()),
        )
        .unwrap()
    }

    #[test]
    fn nearest_first() {
        let p = placement(None);
        let gpu0 = MemoryLocation::gpu("0000:03:00.0").unwrap();
        let gpu1 = MemoryLocation::gpu("0000:83:00.0").unwrap();
        assert_eq!(p.nearness(0, &gpu0), Nearness::Switch { hops: 4 });
        assert_eq!(p.nearness(1, &gpu0), Nearness::HostBridge);
        assert_eq!(p.nearness(2, &gpu0), Nearness::Remote);
        assert_eq!(p.rule(&gpu0), [vec![0], vec![1], vec![2]]);
        assert_eq!(p.rule(&gpu1), [vec![2], vec![0, 1]]);
        assert_eq!(p.rule(&MemoryLocation::HostNode(0)), [vec![0, 1], vec![2]]);
        assert_eq!(p.rule(&MemoryLocation::HostNode(1)), [vec![2], vec![0, 1]]);
        // Unknown memory: one tier, every rail (striping as without topology).
        assert_eq!(p.rule(&MemoryLocation::Any), [vec![0, 1, 2]]);
        assert_eq!(
            p.rule(&MemoryLocation::gpu("0000:ff:00.0").unwrap()),
            [vec![0, 1, 2]]
        );
        let t = p.table();
        assert_eq!(t.len(), 4);
        assert_eq!(t[0].0, MemoryLocation::HostNode(0));
        assert!(t.iter().all(|(_, c)| c.source == Source::Rule));
    }

    #[test]
    fn faster_links_first_within_a_tier() {
        let p = Placement::new(
            two_sockets(),
            rails(&[("mlx5_0", 100), ("mlx5_1", 400), ("mlx5_2", 200)]),
            None,
        )
        .unwrap();
        assert_eq!(p.rule(&MemoryLocation::HostNode(0)), [vec![1, 0], vec![2]]);
    }

    #[test]
    fn unknown_nodes_rank_between_local_and_remote() {
        let mut t = two_sockets();
        t.nics[1].numa_node = None;
        t.nics[1].pci_path.clear();
        let p = Placement::new(
            t,
            rails(&[
                ("mlx5_0", 200),
                ("mlx5_1", 200),
                ("mlx5_2", 200),
                ("rxe0", 10),
            ]),
            None,
        )
        .unwrap();
        // rxe0 is not in the snapshot at all: unknown too.
        assert_eq!(
            p.rule(&MemoryLocation::HostNode(1)),
            [vec![2], vec![1, 3], vec![0]]
        );
    }

    #[test]
    fn the_priority_list_replaces_the_rule_for_what_it_names() {
        let p = placement(Some(
            "cpu:0=mlx5_2;cuda:1=mlx5_1/mlx5_0;gpu:0000:03:00.0=mlx5_1,mlx5_2",
        ));
        let c = p.choice(&MemoryLocation::HostNode(0));
        assert_eq!(c.tiers, [vec![2], vec![0, 1]]);
        assert_eq!(c.source, Source::Override(MemoryKey::Cpu(0)));
        let c = p.choice(&MemoryLocation::gpu("0000:83:00.0").unwrap());
        assert_eq!(c.tiers, [vec![1], vec![0], vec![2]]);
        assert_eq!(c.source, Source::Override(MemoryKey::Cuda(1)));
        let c = p.choice(&MemoryLocation::gpu("0000:03:00.0").unwrap());
        assert_eq!(c.tiers, [vec![1, 2], vec![0]]);
        // Not named: the rule.
        assert_eq!(p.choice(&MemoryLocation::HostNode(1)).source, Source::Rule);
        assert!(p.unmatched().is_empty());
        let p = placement(Some("cpu:7=mlx5_0;cuda:2=mlx5_0"));
        assert_eq!(p.unmatched(), [MemoryKey::Cpu(7), MemoryKey::Cuda(2)]);
        let e = Placement::new(
            two_sockets(),
            rails(&[("mlx5_0", 0)]),
            Some("cpu:0=mlx5_9".parse().unwrap()),
        )
        .unwrap_err();
        assert!(matches!(e, Error::Config { .. }), "{e}");
    }

    /// A random tree: `paths[i]` for device i, built from choices of host bridge, root
    /// port and switch port.
    fn path(hb: u8, rp: u8, sw: Option<u8>, leaf: u8) -> Vec<String> {
        let mut p = vec![
            format!("pci0000:{hb:02x}"),
            format!("0000:{hb:02x}:{rp:02x}.0"),
        ];
        if let Some(s) = sw {
            p.push(format!("0000:{:02x}:00.0", rp + 1));
            p.push(format!("0000:{:02x}:{s:02x}.0", rp + 2));
        }
        p.push(format!("0000:{:02x}:{leaf:02x}.0", rp + 3));
        p
    }

    fn arb_dev() -> impl Strategy<Value = (Vec<String>, Option<u32>, u32)> {
        (
            0u8..2,
            0u8..3,
            proptest::option::of(0u8..2),
            0u8..4,
            proptest::option::of(0u32..2),
            prop::sample::select(vec![0u32, 100, 200]),
        )
            .prop_map(|(hb, rp, sw, leaf, node, g)| (path(hb, rp, sw, leaf), node, g))
    }

    proptest! {
        /// The tiers partition the rails; a rail is in an earlier tier than another exactly
        /// when it is nearer (brute force over every pair); inside a tier, faster first,
        /// then configuration order.
        #[test]
        fn tiers_follow_nearness(
            nics in prop::collection::vec(arb_dev(), 1..6),
            gpu in arb_dev(),
            node in 0u32..2,
        ) {
            let names: Vec<String> = (0..nics.len()).map(|i| format!("nic{i}")).collect();
            let topo = Topology::new(
                nics.iter().zip(&names).map(|((p, n, g), name)| {
                    let p: Vec<&str> = p.iter().map(String::as_str).collect();
                    Nic::new(name, &p, *n, *g)
                }).collect(),
                vec![{
                    let p: Vec<&str> = gpu.0.iter().map(String::as_str).collect();
                    Gpu::new(&p, gpu.1)
                }],
                vec![0, 1],
            );
            let gpu_loc = MemoryLocation::Gpu(topo.gpus[0].pci.clone());
            let rr: Vec<RailRef> = nics.iter().zip(&names)
                .map(|((_, _, g), n)| RailRef { name: n.clone(), gbps: *g }).collect();
            let p = Placement::new(topo, rr.clone(), None).unwrap();
            for loc in [gpu_loc, MemoryLocation::HostNode(node), MemoryLocation::Any] {
                let tiers = p.rule(&loc);
                let mut all: Vec<usize> = tiers.iter().flatten().copied().collect();
                all.sort_unstable();
                prop_assert_eq!(all, (0..rr.len()).collect::<Vec<_>>());
                let tier_of = |r: usize| tiers.iter().position(|t| t.contains(&r)).unwrap();
                for a in 0..rr.len() {
                    for b in 0..rr.len() {
                        let (na, nb) = (p.nearness(a, &loc), p.nearness(b, &loc));
                        prop_assert_eq!(tier_of(a) < tier_of(b), na < nb);
                        prop_assert_eq!(tier_of(a) == tier_of(b), na == nb);
                    }
                }
                for t in &tiers {
                    for w in t.windows(2) {
                        let (x, y) = (&rr[w[0]], &rr[w[1]]);
                        prop_assert!(x.gbps > y.gbps || (x.gbps == y.gbps && w[0] < w[1]));
                    }
                }
            }
        }
    }
}
