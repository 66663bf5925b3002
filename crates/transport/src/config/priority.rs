//! `rail_priority` / `PAGEWIRE_RAIL_PRIORITY`: which rails serve which memory, written by
//! hand instead of derived from the PCIe and NUMA topology.
//!
//! ```text
//! cpu:0=mlx5_0,mlx5_1/mlx5_2;cpu:1=mlx5_2;cuda:0=mlx5_0;gpu:0000:3b:00.0=mlx5_1
//! ```
//!
//! Entries are separated by `;`. Each is `memory=rails`: the memory is `cpu:N` (host
//! memory on NUMA node N), `cuda:N` (the N-th NVIDIA GPU in PCI address order) or
//! `gpu:ADDR` (the GPU at that PCI address); the rails are tiers separated by `/`, each a
//! comma-separated list of device names, nearest tier first. Rails an entry does not name
//! form one last tier, used only when every named one is out.

use std::fmt;
use std::str::FromStr;

use crate::error::{Error, Result};
use crate::util;

/// Which memory an entry of the priority list is about.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum MemoryKey {
    /// Host memory on this NUMA node (`cpu:N`).
    Cpu(u32),
    /// The N-th NVIDIA GPU in PCI address order (`cuda:N`).
    Cuda(u32),
    /// The GPU at this PCI address (`gpu:dddd:bb:dd.f`).
    Gpu(String),
}

impl fmt::Display for MemoryKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MemoryKey::Cpu(n) => write!(f, "cpu:{n}"),
            MemoryKey::Cuda(n) => write!(f, "cuda:{n}"),
            MemoryKey::Gpu(a) => write!(f, "gpu:{a}"),
        }
    }
}

/// A parsed rail priority list: for each memory key, rail names in tiers (nearest first).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RailPriority {
    entries: Vec<(MemoryKey, Vec<Vec<String>>)>,
}

impl RailPriority {
    /// The entries in the order written.
    pub fn entries(&self) -> &[(MemoryKey, Vec<Vec<String>>)] {
        &self.entries
    }

    /// The tiers written for `key`.
    pub fn get(&self, key: &MemoryKey) -> Option<&[Vec<String>]> {
        self.entries
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, t)| t.as_slice())
    }

    /// Every rail name the list mentions (each once, in order of appearance).
    pub fn rail_names(&self) -> Vec<&str> {
        let mut out: Vec<&str> = Vec::new();
        for name in self.entries.iter().flat_map(|(_, t)| t.iter().flatten()) {
            if !out.contains(&name.as_str()) {
                out.push(name);
            }
        }
        out
    }
}

impl fmt::Display for RailPriority {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, (k, tiers)) in self.entries.iter().enumerate() {
            if i > 0 {
                f.write_str(";")?;
            }
            write!(f, "{k}=")?;
            for (j, t) in tiers.iter().enumerate() {
                if j > 0 {
                    f.write_str("/")?;
                }
                f.write_str(&t.join(","))?;
            }
        }
        Ok(())
    }
}

fn parse_key(k: &str) -> std::result::Result<MemoryKey, String> {
    let (kind, arg) = k
        .split_once(':')
        .ok_or_else(|| format!("{k:?}: expected cpu:N, cuda:N or gpu:PCI_ADDRESS"))?;
    let num = |a: &str| {
        a.parse::<u32>()
            .map_err(|_| format!("{k:?}: {a:?} is not a number"))
    };
    match kind.trim().to_ascii_lowercase().as_str() {
        "cpu" => Ok(MemoryKey::Cpu(num(arg.trim())?)),
        "cuda" => Ok(MemoryKey::Cuda(num(arg.trim())?)),
        "gpu" => util::pci_address(arg)
            .map(MemoryKey::Gpu)
            .ok_or_else(|| format!("{k:?}: {arg:?} is not a PCI address (dddd:bb:dd.f)")),
        other => Err(format!(
            "{k:?}: unknown memory kind {other:?} (expected cpu, cuda or gpu)"
        )),
    }
}

fn parse_tiers(k: &str, v: &str) -> std::result::Result<Vec<Vec<String>>, String> {
    let mut seen: Vec<&str> = Vec::new();
    let mut tiers = Vec::new();
    for tier in v.split('/') {
        let mut names = Vec::new();
        for name in tier.split(',').map(str::trim) {
            if name.is_empty() {
                return Err(format!("{k}: empty rail name in {v:?}"));
            }
            if name.contains(|c: char| c.is_whitespace() || c == '=' || c == ':') {
                return Err(format!("{k}: {name:?} is not a device name"));
            }
            if seen.contains(&name) {
                return Err(format!("{k}: rail {name} listed twice"));
            }
            seen.push(name);
            names.push(name.to_string());
        }
        tiers.push(names);
    }
    Ok(tiers)
}

impl FromStr for RailPriority {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        let bad = |why: String| Error::config("rail_priority", s, why);
        let mut entries: Vec<(MemoryKey, Vec<Vec<String>>)> = Vec::new();
        let trimmed = s.trim();
        if trimmed.is_empty() {
            return Err(bad(
                "empty list: expected memory=rails[;memory=rails...]".into()
            ));
        }
        for entry in trimmed.split(';').map(str::trim) {
            if entry.is_empty() {
                return Err(bad("empty entry (two `;` in a row?)".into()));
            }
            let (k, v) = entry
                .split_once('=')
                .ok_or_else(|| bad(format!("{entry:?}: expected memory=rails")))?;
            let key = parse_key(k.trim()).map_err(bad)?;
            if entries.iter().any(|(e, _)| *e == key) {
                return Err(bad(format!("{key} given twice")));
            }
            let tiers = parse_tiers(&key.to_string(), v.trim()).map_err(bad)?;
            entries.push((key, tiers));
        }
        Ok(RailPriority { entries })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(t: &[&[&str]]) -> Vec<Vec<String>> {
        t.iter()
            .map(|x| x.iter().map(|s| s.to_string()).collect())
            .collect()
    }

    #[test]
    fn parses_every_kind() {
        let p: RailPriority =
            "cpu:0=rxe0,rxe1; cpu:1 = rxe1/rxe0 ;cuda:0=mlx5_0;gpu:00000000:3B:00.0=mlx5_1"
                .parse()
                .unwrap();
        assert_eq!(p.entries().len(), 4);
        assert_eq!(
            p.get(&MemoryKey::Cpu(0)).unwrap(),
            names(&[&["rxe0", "rxe1"]])
        );
        assert_eq!(
            p.get(&MemoryKey::Cpu(1)).unwrap(),
            names(&[&["rxe1"], &["rxe0"]])
        );
        assert_eq!(p.get(&MemoryKey::Cuda(0)).unwrap(), names(&[&["mlx5_0"]]));
        assert_eq!(
            p.get(&MemoryKey::Gpu("0000:3b:00.0".into())).unwrap(),
            names(&[&["mlx5_1"]])
        );
        assert_eq!(p.rail_names(), ["rxe0", "rxe1", "mlx5_0", "mlx5_1"]);
        // Display writes what parses back to the same list.
        let again: RailPriority = p.to_string().parse().unwrap();
        assert_eq!(again, p);
    }

    #[test]
    fn rejects_with_a_config_error() {
        for bad in [
            "",
            "  ",
            "cpu:0",
            "cpu:0=",
            "cpu:0=rxe0,",
            "cpu:0=rxe0//rxe1",
            "cpu:0=rxe0;;cpu:1=rxe1",
            "cpu:0=rxe0;",
            "cpu:x=rxe0",
            "cpu:-1=rxe0",
            "cpu=rxe0",
            "npu:0=rxe0",
            "gpu:3b=rxe0",
            "cuda:0=rxe0,rxe0",
            "cuda:0=rxe0/rxe0",
            "cpu:0=rxe0;cpu:0=rxe1",
            "gpu:0000:3b:00.0=a;gpu:3b:00.0=b",
            "cpu:0=rx e0",
            "cpu:0=rxe0:1",
        ] {
            match bad.parse::<RailPriority>() {
                Err(Error::Config { key, reason, .. }) => {
                    assert_eq!(key, "rail_priority", "{bad}");
                    assert!(!reason.is_empty());
                }
                other => panic!("{bad:?}: {other:?}"),
            }
        }
    }
}
