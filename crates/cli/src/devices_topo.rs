//! The topology part of `pagewire devices`: NUMA nodes, RDMA NICs and NVIDIA GPUs as
//! sysfs places them, and which rails an engine would prefer for host memory on each
//! node and for each GPU's memory (the rule, or the `rail_priority` list).

use std::path::{Path, PathBuf};

use serde_json::{Value, json};

use pagewire_transport::topology::{
    Choice, MemoryLocation, Placement, RailPriority, RailRef, Source, Topology, read_sysfs,
};

/// The rule in one line, for the header.
const RULE: &str = "same PCIe switch, then same host bridge, then same NUMA node, then \
                    unknown, then another node; faster links first within a tier";

/// Everything the section prints.
pub struct TopoReport {
    root: PathBuf,
    result: Result<Placement, String>,
    /// Where the priority list came from, when there is one.
    priority_from: Option<&'static str>,
}

/// Rail names `rdma_device` would open, when it names a list (`all` or unset: every
/// device sysfs shows).
fn configured_rails(spec: Option<&str>) -> Option<Vec<String>> {
    let spec = spec.map(str::trim).filter(|s| !s.is_empty())?;
    if spec.eq_ignore_ascii_case("all") {
        return None;
    }
    Some(
        spec.split(',')
            .filter_map(|r| r.split(':').next())
            .map(|n| n.trim().to_string())
            .filter(|n| !n.is_empty())
            .collect(),
    )
}

impl TopoReport {
    /// Reads the tree under `root`; the priority list from `priority` (the flag) or the
    /// environment.
    pub fn read(root: &Path, priority: Option<&str>) -> Self {
        let env = std::env::var("PAGEWIRE_RAIL_PRIORITY").ok();
        let (text, priority_from) = match (priority, env.as_deref()) {
            (Some(p), _) => (Some(p), Some("--rail-priority")),
            (None, Some(e)) => (Some(e), Some("PAGEWIRE_RAIL_PRIORITY")),
            (None, None) => (None, None),
        };
        let result = (|| {
            let prio: Option<RailPriority> = text
                .map(str::parse::<RailPriority>)
                .transpose()
                .map_err(|e| e.to_string())?;
            let topo = read_sysfs(root).map_err(|e| e.to_string())?;
            let rails = rails_of(&topo);
            Placement::new(topo, rails, prio).map_err(|e| e.to_string())
        })();
        TopoReport {
            root: root.to_path_buf(),
            result,
            priority_from,
        }
    }

    pub fn json(&self) -> Value {
        let p = match &self.result {
            Ok(p) => p,
            Err(e) => return json!({"sysfs_root": self.root, "error": e}),
        };
        let t = p.topology();
        let names = |tiers: &[Vec<usize>]| -> Vec<Vec<&str>> {
            tiers
                .iter()
                .map(|x| x.iter().map(|&r| p.rails()[r].name.as_str()).collect())
                .collect()
        };
        json!({
            "sysfs_root": self.root,
            "rule": RULE,
            "numa_nodes": t.numa_nodes,
            "nics": t.nics.iter().map(|n| json!({
                "name": n.name, "pci": n.pci, "pci_path": n.pci_path, "numa_node": n.numa_node,
                "gbps": n.gbps(),
                "ports": n.ports.iter().map(|p| json!({"port": p.port, "state": p.state, "gbps": p.gbps})).collect::<Vec<_>>(),
            })).collect::<Vec<_>>(),
            "gpus": t.gpus.iter().enumerate().map(|(i, g)| json!({
                "cuda_pci_order": i, "pci": g.pci, "pci_path": g.pci_path, "numa_node": g.numa_node,
            })).collect::<Vec<_>>(),
            "rails": p.rails().iter().map(|r| r.name.as_str()).collect::<Vec<_>>(),
            "priority": p.priority().map(|x| x.to_string()),
            "priority_from": self.priority_from,
            "preference": p.table().iter().map(|(loc, c)| json!({
                "memory": loc.to_string(),
                "tiers": names(&c.tiers),
                "source": source(c),
            })).collect::<Vec<_>>(),
            "unmatched_priority_entries": p.unmatched().iter().map(|k| k.to_string()).collect::<Vec<_>>(),
        })
    }

    pub fn print(&self) {
        println!("Topology (sysfs at {}):", self.root.display());
        let p = match &self.result {
            Ok(p) => p,
            Err(e) => {
                println!("  unavailable: {e}");
                return;
            }
        };
        let t = p.topology();
        if t.numa_nodes.is_empty() {
            println!("  NUMA nodes: none exposed (memory placement unknown)");
        } else {
            let n: Vec<String> = t.numa_nodes.iter().map(u32::to_string).collect();
            println!("  NUMA nodes: {}", n.join(", "));
        }
        if t.nics.is_empty() {
            println!("  RDMA NICs: none in class/infiniband (no rail to choose)");
        } else {
            println!("  RDMA NICs:");
            for n in &t.nics {
                let node = n.numa_node.map_or("?".to_string(), |x| x.to_string());
                let speed = match n.gbps() {
                    0 => "speed unknown".to_string(),
                    g => format!("{g} Gb/s"),
                };
                let place = match &n.pci {
                    Some(pci) => format!("pci {pci}  via {}", path_text(&n.pci_path)),
                    None => "no PCI device (software device)".to_string(),
                };
                println!("    {:<8} node {node}  {speed:<13} {place}", n.name);
            }
        }
        if t.gpus.is_empty() {
            println!("  NVIDIA GPUs: none on the PCI bus");
        } else {
            println!("  NVIDIA GPUs (cuda:N in PCI order):");
            for (i, g) in t.gpus.iter().enumerate() {
                let node = g.numa_node.map_or("?".to_string(), |x| x.to_string());
                println!(
                    "    cuda:{i} pci {}  node {node}  via {}",
                    g.pci,
                    path_text(&g.pci_path)
                );
            }
        }
        if p.rails().len() < 2 {
            println!(
                "  Rail preference: {} (nothing to choose between)",
                if p.rails().is_empty() {
                    "no rail"
                } else {
                    "one rail"
                }
            );
            return;
        }
        println!("  Rail preference, nearest tier first (rule: {RULE}):");
        let table = p.table();
        let label = |loc: &MemoryLocation| match loc {
            MemoryLocation::Gpu(pci) => match t.gpus.iter().position(|g| g.pci == *pci) {
                Some(i) => format!("cuda:{i} {loc}"),
                None => loc.to_string(),
            },
            _ => loc.to_string(),
        };
        let width = table.iter().map(|(l, _)| label(l).len()).max().unwrap_or(0);
        for (loc, c) in &table {
            println!(
                "    {:<width$}  {}  ({})",
                label(loc),
                tiers_text(p, c),
                source(c)
            );
            if c.source == Source::Rule && c.is_selective() {
                println!(
                    "    {:<width$}  first tier: {}",
                    "",
                    p.nearness(c.tiers[0][0], loc)
                );
            }
        }
        if let (Some(list), Some(from)) = (p.priority(), self.priority_from) {
            println!("  Priority list ({from}): {list}");
        }
        for k in p.unmatched() {
            println!("  note: priority entry {k} matches no memory of this host");
        }
    }
}

/// Every NIC as a rail, or the ones `PAGEWIRE_RDMA_DEVICE` lists (in its order).
fn rails_of(t: &Topology) -> Vec<RailRef> {
    let configured = configured_rails(std::env::var("PAGEWIRE_RDMA_DEVICE").ok().as_deref());
    let names: Vec<String> =
        configured.unwrap_or_else(|| t.nics.iter().map(|n| n.name.clone()).collect());
    names
        .into_iter()
        .map(|name| RailRef {
            gbps: t.nic(&name).map_or(0, |n| n.gbps()),
            name,
        })
        .collect()
}

fn path_text(path: &[String]) -> String {
    if path.is_empty() {
        return "?".into();
    }
    path.join(" > ")
}

fn tiers_text(p: &Placement, c: &Choice) -> String {
    c.tiers
        .iter()
        .map(|t| {
            t.iter()
                .map(|&r| p.rails()[r].name.as_str())
                .collect::<Vec<_>>()
                .join(",")
        })
        .collect::<Vec<_>>()
        .join(" / ")
}

fn source(c: &Choice) -> String {
    match &c.source {
        Source::Rule if !c.is_selective() => "rule: all alike".into(),
        Source::Rule => "rule".into(),
        Source::Override(k) => format!("priority list: {k}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rail_lists_name_rails() {
        assert_eq!(configured_rails(None), None);
        assert_eq!(configured_rails(Some("all")), None);
        assert_eq!(
            configured_rails(Some("mlx5_0:1:3, mlx5_1")).unwrap(),
            ["mlx5_0", "mlx5_1"]
        );
    }
}
