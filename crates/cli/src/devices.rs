//! `pagewire devices`: RDMA devices, GPUs, and the GPU path per pair.
//!
//! Every section answers, even on a machine with neither: "none found (why)" or
//! "unavailable (why)", and the command exits 0.

use clap::Args;
use serde_json::{Value, json};

use pagewire_gpudirect::{GpuPath, PathDecision, probe};

use crate::devices_topo::TopoReport;

const EXAMPLES: &str = "\
Examples:
  pagewire devices                  # RDMA devices, GPUs and GPU paths, or why there are none
  pagewire devices --json           # the same as one JSON object
  pagewire devices --no-pair-test   # do not open the devices to test GPU registration
  pagewire devices --sysfs-root crates/transport/tests/data/sysfs-2node
                                    # the rail choice on a recorded two-socket tree
  pagewire devices --rail-priority 'cpu:0=mlx5_0;cuda:0=mlx5_1'
                                    # the rail choice with a priority list";

#[derive(Debug, Args)]
#[command(after_help = EXAMPLES)]
pub struct DevicesArgs {
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
    /// Skip the per-pair registration test (it opens each RDMA device and
    /// registers 2 MiB of device memory).
    #[arg(long)]
    pub no_pair_test: bool,
    /// Read the PCIe/NUMA topology under DIR instead of /sys (a recorded tree);
    /// default: PAGEWIRE_SYSFS_ROOT, else /sys.
    #[arg(long, value_name = "DIR")]
    pub sysfs_root: Option<std::path::PathBuf>,
    /// Rail priority list to show instead of the rule's choice (syntax as
    /// PAGEWIRE_RAIL_PRIORITY, which is the default).
    #[arg(long, value_name = "LIST")]
    pub rail_priority: Option<String>,
}

/// One RDMA device, reduced to what we print.
struct Rdma {
    name: String,
    active: bool,
    json: Value,
    text: Vec<String>,
}

/// Why there is no RDMA device: a stable code and the sentence.
struct NoRdma {
    code: &'static str,
    reason: String,
}

/// The devices, or why this host has none.
#[cfg(feature = "verbs")]
fn rdma_devices() -> Result<Vec<Rdma>, NoRdma> {
    use pagewire_transport::verbs;
    let list = verbs::list_devices().map_err(|e| NoRdma {
        code: "error",
        reason: e.to_string(),
    })?;
    if list.is_empty() {
        let why = verbs::host_rdma_missing().unwrap_or(verbs::NoRdma::NoDevice);
        return Err(NoRdma {
            code: why.code(),
            reason: why.to_string(),
        });
    }
    Ok(list
        .into_iter()
        .map(|d| {
            let mut text = vec![format!(
                "{}: max_mr_size {} B, max_qp_wr {}, max_sge {}, chosen GID index {}",
                d.name,
                d.max_mr_size,
                d.max_qp_wr,
                d.max_sge,
                d.chosen_gid.map_or("none".to_string(), |g| g.to_string())
            )];
            for p in &d.ports {
                text.push(format!(
                    "  port {}: {} mtu {} lid {} link {}",
                    p.port, p.state, p.active_mtu, p.lid, p.link_layer
                ));
            }
            for g in &d.gids {
                text.push(format!(
                    "  gid port {} index {:>2}: {} {}{}",
                    g.port,
                    g.index,
                    g.kind,
                    g.addr,
                    g.netdev
                        .as_deref()
                        .map_or(String::new(), |n| format!(" ({n})"))
                ));
            }
            let json = json!({
                "name": d.name,
                "max_mr_size": d.max_mr_size,
                "max_qp_wr": d.max_qp_wr,
                "max_sge": d.max_sge,
                "chosen_gid": d.chosen_gid,
                "ports": d.ports.iter().map(|p| json!({
                    "port": p.port, "state": p.state, "active_mtu": p.active_mtu,
                    "lid": p.lid, "link_layer": p.link_layer,
                })).collect::<Vec<_>>(),
                "gids": d.gids.iter().map(|g| json!({
                    "port": g.port, "index": g.index, "type": g.kind.to_string(),
                    "gid": g.addr.to_string(), "netdev": g.netdev,
                })).collect::<Vec<_>>(),
            });
            Rdma {
                active: d.ports.iter().any(|p| p.state == "ACTIVE"),
                name: d.name,
                json,
                text,
            }
        })
        .collect())
}

#[cfg(not(feature = "verbs"))]
fn rdma_devices() -> Result<Vec<Rdma>, NoRdma> {
    Err(NoRdma {
        code: "not_built",
        reason: "built without the `verbs` feature".into(),
    })
}

/// The path GPU `ordinal` would take through RDMA device `dev`.
#[cfg(feature = "verbs")]
fn pair_path(dev: &str, ordinal: u32) -> PathDecision {
    use pagewire_transport::{BackendKind, Engine, EngineConfig};
    let engine = EngineConfig::builder()
        .backend(BackendKind::Verbs)
        .rdma_device(dev)
        .listen("127.0.0.1:0".parse().expect("literal address"))
        .build()
        .and_then(Engine::new);
    match engine {
        Ok(e) => {
            let d = pagewire_gpudirect::detect_path(&e, ordinal);
            e.shutdown();
            d
        }
        Err(err) => PathDecision {
            path: GpuPath::Staged,
            reason: format!("cannot open {dev}: {err}"),
        },
    }
}

#[cfg(not(feature = "verbs"))]
fn pair_path(_dev: &str, _ordinal: u32) -> PathDecision {
    PathDecision {
        path: GpuPath::Staged,
        reason: "built without the `verbs` feature".into(),
    }
}

pub fn run(args: DevicesArgs) -> anyhow::Result<()> {
    let rdma = rdma_devices();
    let cuda = probe::cuda();
    let root = args
        .sysfs_root
        .clone()
        .or_else(|| std::env::var_os("PAGEWIRE_SYSFS_ROOT").map(Into::into))
        .unwrap_or_else(|| pagewire_transport::topology::DEFAULT_SYSFS_ROOT.into());
    let topo = TopoReport::read(&root, args.rail_priority.as_deref());

    // Pairs: every GPU with every RDMA device (TCP/loopback always stage).
    let mut pairs = Vec::new();
    if let (Ok(devs), Ok(info)) = (&rdma, &cuda) {
        for g in &info.gpus {
            for d in devs {
                let decision = if !d.active {
                    PathDecision {
                        path: GpuPath::Staged,
                        reason: format!("{} has no ACTIVE port", d.name),
                    }
                } else if args.no_pair_test {
                    PathDecision {
                        path: GpuPath::Staged,
                        reason: "not tested (--no-pair-test)".into(),
                    }
                } else {
                    pair_path(&d.name, g.ordinal)
                };
                pairs.push((g.ordinal, d.name.clone(), decision));
            }
        }
    }

    if args.json {
        let out = json!({
            // `available`: at least one device is listed; `usable`: one has an ACTIVE
            // port. Without a device, `reason` says why (`reason_code` for scripts).
            "rdma": match &rdma {
                Ok(devs) => json!({
                    "available": true,
                    "usable": devs.iter().any(|d| d.active),
                    "reason": devs.iter().all(|d| !d.active).then_some("no device has an ACTIVE port"),
                    "reason_code": devs.iter().all(|d| !d.active).then_some("no_active_port"),
                    "devices": devs.iter().map(|d| d.json.clone()).collect::<Vec<_>>(),
                }),
                Err(e) => json!({
                    "available": false,
                    "usable": false,
                    "reason": e.reason,
                    "reason_code": e.code,
                    "devices": [],
                }),
            },
            "cuda": match &cuda {
                Ok(info) => json!({
                    "available": true,
                    "driver_version": info.driver_version_string(),
                    "dmabuf_export_symbol": info.dmabuf_export_symbol,
                    "gpus": info.gpus.iter().map(|g| json!({
                        "ordinal": g.ordinal, "name": g.name, "pci_bus_id": g.pci_bus_id,
                        "total_mem": g.total_mem,
                        "compute_capability": format!("{}.{}", g.compute_capability.0, g.compute_capability.1),
                        "gpudirect_rdma": g.gpudirect_rdma, "dma_buf": g.dma_buf, "notes": g.notes,
                    })).collect::<Vec<_>>(),
                }),
                Err(e) => json!({"available": false, "reason": e.to_string()}),
            },
            "paths": pairs.iter().map(|(g, d, p)| json!({
                "gpu": g, "rdma_device": d, "path": p.path.as_str(), "reason": p.reason,
            })).collect::<Vec<_>>(),
            "tcp_and_loopback_path": "staged",
            "topology": topo.json(),
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }

    println!("RDMA devices:");
    match &rdma {
        Ok(devs) => {
            for d in devs {
                for line in &d.text {
                    println!("  {line}");
                }
            }
            if devs.iter().all(|d| !d.active) {
                println!("  none usable: no device has an ACTIVE port");
            }
        }
        Err(e) => println!("  none: {}", e.reason),
    }
    println!("GPUs:");
    match &cuda {
        Ok(info) => {
            println!(
                "  CUDA driver {} (dma-buf export {})",
                info.driver_version_string(),
                if info.dmabuf_export_symbol {
                    "available"
                } else {
                    "missing"
                }
            );
            for g in &info.gpus {
                println!(
                    "  GPU {}: {} bus {} {} MiB cc {}.{} gpudirect_rdma={} dma_buf={}{}",
                    g.ordinal,
                    g.name,
                    g.pci_bus_id,
                    g.total_mem >> 20,
                    g.compute_capability.0,
                    g.compute_capability.1,
                    g.gpudirect_rdma,
                    g.dma_buf,
                    if g.notes.is_empty() {
                        String::new()
                    } else {
                        format!(" notes: {}", g.notes.join("; "))
                    }
                );
            }
        }
        Err(e) => println!("  none found ({e})"),
    }
    println!("GPU paths:");
    match (&rdma, &cuda) {
        (_, Err(e)) => println!("  none (no GPU: {e})"),
        (Err(e), Ok(_)) => println!("  every GPU: staged (no RDMA device: {})", e.reason),
        _ => {
            for (g, d, p) in &pairs {
                println!("  GPU {g} <-> {d}: {} ({})", p.path, p.reason);
            }
        }
    }
    println!("  over TCP or loopback: staged (those transports read host memory only)");
    topo.print();
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Text and JSON say the same thing: devices listed, or none and why (never
    /// `available: true` with an empty list).
    #[test]
    fn text_and_json_agree() {
        let rdma = rdma_devices();
        match &rdma {
            Ok(devs) => assert!(!devs.is_empty(), "an empty list is reported as a reason"),
            Err(e) => {
                assert!(!e.reason.is_empty() && !e.code.is_empty());
            }
        }
    }

    #[test]
    fn answers_without_devices_and_exits_ok() {
        // Whatever this machine has (CI: neither RDMA nor CUDA), both forms succeed.
        for json in [false, true] {
            run(DevicesArgs {
                json,
                no_pair_test: true,
                sysfs_root: None,
                rail_priority: None,
            })
            .unwrap();
        }
    }
}
