//! Device discovery and opening: device list, capabilities, active port, GID table.

use std::io;
use std::sync::Arc;

use sideway::ibverbs::address::GidType;
use sideway::ibverbs::device::{DeviceInfo as _, DeviceList};
use sideway::ibverbs::device_context::{DeviceContext, LinkLayer, Mtu, PortState};

use super::gid::{GidChoiceError, GidInfo, GidKind, choose_gid};
use crate::config::BackendKind;
use crate::error::Error;

/// Port state and addressing, as `pagewire devices` shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct RdmaPortInfo {
    /// Port number (1-based).
    pub port: u8,
    /// `ACTIVE`, `DOWN`, ...
    pub state: String,
    /// Active path MTU in bytes (256..4096).
    pub active_mtu: u32,
    /// LID (0 on RoCE).
    pub lid: u16,
    /// `Ethernet` (RoCE) or `InfiniBand`.
    pub link_layer: String,
}

/// One RDMA device with its ports, GIDs and the limits the verbs backend cares about.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct RdmaDeviceInfo {
    /// Device name, e.g. `rxe0` or `mlx5_0`.
    pub name: String,
    pub ports: Vec<RdmaPortInfo>,
    pub gids: Vec<GidInfo>,
    /// Largest single memory registration (bigger regions are split).
    pub max_mr_size: u64,
    /// Largest send queue per QP.
    pub max_qp_wr: u32,
    /// Most scatter-gather entries per WR.
    pub max_sge: u32,
    /// The GID index the backend would choose on the first active port (perftest rules,
    /// `PAGEWIRE_GID_INDEX` honoured), if any.
    pub chosen_gid: Option<u32>,
}

/// Device limits used when sizing QPs, CQs and MR chunks.
#[derive(Clone, Copy, Debug)]
pub(crate) struct DeviceCaps {
    pub max_mr_size: u64,
    pub max_qp_wr: u32,
    pub max_sge: u32,
    /// SGEs per RDMA READ (may be below `max_sge`, e.g. on iWARP).
    pub max_sge_rd: u32,
    pub max_cqe: u32,
    /// min(max_qp_rd_atom, max_qp_init_rd_atom), at least 1.
    pub max_rd_atomic: u8,
}

/// An opened device with its chosen port and GID.
pub(crate) struct OpenDevice {
    pub ctx: Arc<DeviceContext>,
    pub name: String,
    pub port: u8,
    pub lid: u16,
    /// Active MTU in bytes.
    pub mtu: u32,
    pub caps: DeviceCaps,
    pub gid: GidInfo,
    /// Link speed in Gb/s (0: not reported), what a multi-rail stripe is weighted by.
    pub gbps: u32,
}

/// A port's link speed in Gb/s from the raw `active_width` and `active_speed(_ex)` of
/// `ibv_port_attr` (lanes x lane rate); 0 for values this table does not know (read raw:
/// sideway's conversions panic on unknown values).
pub(crate) fn link_gbps(width: u8, speed: u32) -> u32 {
    let lanes = match width {
        1 => 1,
        16 => 2,
        2 => 4,
        4 => 8,
        8 => 12,
        _ => return 0,
    };
    // Per-lane data rates: SDR, DDR, QDR, FDR10, FDR, EDR, HDR, NDR, XDR.
    let lane = match speed {
        1 => 2,
        2 => 4,
        4 => 8,
        8 => 10,
        16 => 14,
        32 => 25,
        64 => 50,
        128 => 100,
        256 => 200,
        _ => return 0,
    };
    lanes * lane
}

impl std::fmt::Debug for OpenDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpenDevice")
            .field("name", &self.name)
            .field("port", &self.port)
            .field("mtu", &self.mtu)
            .field("gid", &self.gid)
            .finish_non_exhaustive()
    }
}

pub(crate) fn mtu_bytes(m: Mtu) -> u32 {
    match m {
        Mtu::Mtu256 => 256,
        Mtu::Mtu512 => 512,
        Mtu::Mtu1024 => 1024,
        Mtu::Mtu2048 => 2048,
        Mtu::Mtu4096 => 4096,
    }
}

/// Bytes to the largest verbs MTU not above it (at least 256).
pub(crate) fn mtu_from_bytes(b: u32) -> Mtu {
    match b {
        4096.. => Mtu::Mtu4096,
        2048.. => Mtu::Mtu2048,
        1024.. => Mtu::Mtu1024,
        512.. => Mtu::Mtu512,
        _ => Mtu::Mtu256,
    }
}

fn port_state_name(s: PortState) -> &'static str {
    match s {
        PortState::Nop => "NOP",
        PortState::Down => "DOWN",
        PortState::Initializing => "INIT",
        PortState::Armed => "ARMED",
        PortState::Active => "ACTIVE",
        PortState::ActiveDefer => "ACTIVE_DEFER",
    }
}

fn link_layer_name(l: LinkLayer) -> &'static str {
    match l {
        LinkLayer::Unspecified => "Unspecified",
        LinkLayer::InfiniBand => "InfiniBand",
        LinkLayer::Ethernet => "Ethernet",
    }
}

/// Why no RDMA device can be used on this host, or why the one asked for cannot: the
/// reason inside [`Error::BackendUnavailable`] for the verbs backend, typed for callers
/// that report it (`pagewire devices`).
#[non_exhaustive]
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NoRdma {
    /// `libibverbs.so.1` could not be loaded (rdma-core's user space is not installed).
    NoLibibverbs,
    /// libibverbs is there, but the kernel has no RDMA stack (`ibv_get_device_list`
    /// fails: no `/sys/class/infiniband_verbs`, `ib_uverbs` not loaded).
    NoKernelStack {
        /// The errno `ibv_get_device_list` set.
        errno: i32,
    },
    /// The RDMA stack is there but lists no device.
    NoDevice,
    /// The device asked for is not in the list.
    NotFound {
        /// The name asked for.
        name: String,
        /// The devices the host has.
        devices: Vec<String>,
        /// Why the host has none, when it has none.
        host: Option<Box<NoRdma>>,
    },
    /// The device's port is not ACTIVE (link down, cable, or the netdev of a soft-RoCE
    /// device is down).
    PortDown {
        /// Device name.
        device: String,
        /// Port number.
        port: u8,
        /// Its state (`DOWN`, `INIT`, ...), or `absent` when the device has no such port.
        state: String,
    },
    /// No device has the port ACTIVE.
    NoActivePort {
        /// Port number.
        port: u8,
        /// The devices the host has.
        devices: Vec<String>,
    },
}

impl NoRdma {
    /// A stable, machine-readable name of the reason.
    pub fn code(&self) -> &'static str {
        match self {
            NoRdma::NoLibibverbs => "no_libibverbs",
            NoRdma::NoKernelStack { .. } => "no_kernel_rdma_stack",
            NoRdma::NoDevice => "no_device",
            NoRdma::NotFound { .. } => "device_not_found",
            NoRdma::PortDown { .. } => "port_down",
            NoRdma::NoActivePort { .. } => "no_active_port",
        }
    }
}

impl std::fmt::Display for NoRdma {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NoRdma::NoLibibverbs => f.write_str(
                "libibverbs is not installed (libibverbs.so.1 could not be loaded; \
                 Debian: apt-get install ibverbs-providers)",
            ),
            NoRdma::NoKernelStack { errno } => write!(
                f,
                "the kernel has no RDMA stack (ibv_get_device_list: {}; \
                 no /sys/class/infiniband_verbs: load ib_uverbs and a device driver, \
                 e.g. rdma_rxe for soft-RoCE)",
                io::Error::from_raw_os_error(*errno)
            ),
            NoRdma::NoDevice => f.write_str(
                "the RDMA stack lists no device (no RDMA NIC; a soft-RoCE device is made \
                 with `rdma link add rxe0 type rxe netdev IFACE`)",
            ),
            NoRdma::NotFound {
                name,
                devices,
                host,
            } => match host {
                Some(why) => write!(f, "RDMA device {name:?} not found: {why}"),
                None => write!(
                    f,
                    "RDMA device {name:?} not found (devices here: {})",
                    devices.join(", ")
                ),
            },
            NoRdma::PortDown {
                device,
                port,
                state,
            } => write!(
                f,
                "{device} port {port} is {state}, not ACTIVE (is the link, or the network \
                 interface under it, up?)"
            ),
            NoRdma::NoActivePort { port, devices } => write!(
                f,
                "no RDMA device has port {port} ACTIVE (devices here: {})",
                devices.join(", ")
            ),
        }
    }
}

impl std::error::Error for NoRdma {}

/// EOPNOTSUPP: the loader shim found no libibverbs. ENOSYS (and ENODEV, ENOENT): no
/// kernel RDMA stack.
fn no_rdma_of(e: &io::Error) -> Option<NoRdma> {
    match e.raw_os_error() {
        Some(libc::EOPNOTSUPP) => Some(NoRdma::NoLibibverbs),
        Some(errno @ (libc::ENOSYS | libc::ENODEV | libc::ENOENT)) => {
            Some(NoRdma::NoKernelStack { errno })
        }
        _ => None,
    }
}

/// The device list, or why the host has none (`Ok(Err(..))`).
fn device_list() -> Result<Result<DeviceList, NoRdma>, Error> {
    match DeviceList::new() {
        Ok(l) => Ok(Ok(l)),
        Err(e) => match e.0 {
            sideway::ibverbs::device::GetDeviceListErrorKind::Ibverbs(io) => {
                match no_rdma_of(&io) {
                    Some(why) => Ok(Err(why)),
                    None => Err(verbs_err("ibv_get_device_list", io)),
                }
            }
            other => Err(verbs_err("ibv_get_device_list", other)),
        },
    }
}

/// Why this host has no RDMA device at all (no libibverbs, no kernel RDMA stack, an
/// empty device list), or `None` when it lists at least one device.
pub fn host_rdma_missing() -> Option<NoRdma> {
    match device_list() {
        Ok(Ok(list)) if (&list).into_iter().next().is_some() => None,
        Ok(Ok(_)) => Some(NoRdma::NoDevice),
        Ok(Err(why)) => Some(why),
        // The list call failed for another reason: not "missing", the caller's list
        // call reports the error.
        Err(_) => None,
    }
}

pub(crate) fn verbs_err(
    call: &'static str,
    e: impl std::error::Error + Send + Sync + 'static,
) -> Error {
    Error::verbs(call, e)
}

/// [`verbs_err`] about one named object (a device).
pub(crate) fn verbs_err_on(
    call: &'static str,
    what: &str,
    e: impl std::error::Error + Send + Sync + 'static,
) -> Error {
    match Error::verbs(call, e) {
        Error::Verbs {
            call,
            reason,
            source,
        } => Error::Verbs {
            call,
            reason: format!("{what}: {reason}"),
            source,
        },
        other => other,
    }
}

pub(crate) fn no_device(reason: impl std::fmt::Display) -> Error {
    Error::BackendUnavailable {
        backend: BackendKind::Verbs,
        reason: reason.to_string(),
    }
}

/// `PAGEWIRE_GID_INDEX`, if set to a number (for `list_devices`; engines get it from
/// their config).
fn gid_index_override() -> Option<u32> {
    std::env::var("PAGEWIRE_GID_INDEX")
        .ok()?
        .trim()
        .parse()
        .ok()
}

fn gid_table(ctx: &DeviceContext) -> Vec<GidInfo> {
    let Ok(entries) = ctx.query_gid_table() else {
        return Vec::new();
    };
    entries
        .iter()
        .map(|e| {
            let kind = match e.gid_type() {
                GidType::InfiniBand => GidKind::Ib,
                GidType::RoceV1 => GidKind::RoceV1,
                GidType::RoceV2 => GidKind::RoceV2,
            };
            GidInfo::new(
                e.port_num() as u8,
                e.gid_index(),
                kind,
                e.netdev_name().ok(),
                e.gid().raw,
            )
        })
        .collect()
}

fn caps_of(ctx: &DeviceContext) -> Result<(DeviceCaps, u8), Error> {
    let attr = ctx
        .query_device()
        .map_err(|e| verbs_err("ibv_query_device_ex", e))?;
    let rd = attr
        .max_qp_rd_atom()
        .min(attr.max_qp_init_rd_atom())
        .clamp(1, 255) as u8;
    Ok((
        DeviceCaps {
            max_mr_size: attr.max_mr_size().max(4096),
            max_qp_wr: attr.max_qp_wr().max(1) as u32,
            max_sge: attr.max_sge().max(1) as u32,
            max_sge_rd: attr.max_sge_rd().max(1) as u32,
            max_cqe: attr.max_cqe().max(1) as u32,
            max_rd_atomic: rd,
        },
        attr.phys_port_cnt(),
    ))
}

/// Lists every RDMA device with ports and GIDs. "No RDMA here" (no kernel support, no
/// libibverbs) is an empty list, not an error; [`host_rdma_missing`] says which.
pub fn list_devices() -> Result<Vec<RdmaDeviceInfo>, Error> {
    let Ok(list) = device_list()? else {
        return Ok(Vec::new());
    };
    let over = gid_index_override();
    let mut out = Vec::new();
    for dev in &list {
        let name = dev.name();
        let ctx = dev
            .open()
            .map_err(|e| verbs_err_on("ibv_open_device", &name, e))?;
        let (caps, nports) = caps_of(&ctx)?;
        let mut ports = Vec::new();
        for p in 1..=nports {
            let Ok(pa) = ctx.query_port(p) else { continue };
            ports.push(RdmaPortInfo {
                port: p,
                state: port_state_name(pa.port_state()).to_string(),
                active_mtu: mtu_bytes(pa.active_mtu()),
                lid: pa.lid(),
                link_layer: link_layer_name(pa.link_layer()).to_string(),
            });
        }
        let gids = gid_table(&ctx);
        let chosen_gid = ports
            .iter()
            .find(|p| p.state == "ACTIVE")
            .and_then(|p| choose_gid(&gids, p.port, over).ok())
            .map(|g| g.index);
        out.push(RdmaDeviceInfo {
            name,
            ports,
            gids,
            max_mr_size: caps.max_mr_size,
            max_qp_wr: caps.max_qp_wr,
            max_sge: caps.max_sge,
            chosen_gid,
        });
    }
    Ok(out)
}

/// Opens `name` (or, with `None`, the first device whose port `port` is ACTIVE) and picks
/// the GID (`gid_override` or perftest's rules).
pub(crate) fn open(
    name: Option<&str>,
    port: u8,
    gid_override: Option<u32>,
) -> Result<OpenDevice, Error> {
    let list = match device_list()? {
        Ok(list) => list,
        Err(why) => {
            return Err(no_device(match name {
                Some(n) => NoRdma::NotFound {
                    name: n.to_string(),
                    devices: Vec::new(),
                    host: Some(Box::new(why)),
                },
                None => why,
            }));
        }
    };
    let mut seen = Vec::new();
    for dev in &list {
        let dev_name = dev.name();
        seen.push(dev_name.clone());
        if name.is_some_and(|n| n != dev_name) {
            continue;
        }
        let ctx = dev
            .open()
            .map_err(|e| verbs_err_on("ibv_open_device", &dev_name, e))?;
        let (caps, nports) = caps_of(&ctx)?;
        let attr = (port <= nports)
            .then(|| ctx.query_port(port).ok())
            .flatten();
        let active = attr
            .as_ref()
            .filter(|a| a.port_state() == PortState::Active)
            .map(|a| {
                let speed = if a.attr.active_speed_ex != 0 {
                    a.attr.active_speed_ex
                } else {
                    u32::from(a.attr.active_speed)
                };
                (
                    a.lid(),
                    mtu_bytes(a.active_mtu()),
                    link_gbps(a.attr.active_width, speed),
                )
            });
        let Some((lid, mtu, gbps)) = active else {
            if name.is_some() {
                return Err(no_device(NoRdma::PortDown {
                    device: dev_name,
                    port,
                    state: attr
                        .map_or("absent", |a| port_state_name(a.port_state()))
                        .into(),
                }));
            }
            continue;
        };
        let table = gid_table(&ctx);
        let gid = choose_gid(&table, port, gid_override).map_err(|e| match e {
            GidChoiceError::Empty => no_device(format!("{dev_name} port {port}: empty GID table")),
            GidChoiceError::NoSuchIndex(i) => Error::config(
                "gid_index",
                i,
                format!(
                    "{dev_name} port {port} has no such GID (valid: {:?})",
                    table
                        .iter()
                        .filter(|g| g.port == port)
                        .map(|g| g.index)
                        .collect::<Vec<_>>()
                ),
            ),
        })?;
        return Ok(OpenDevice {
            ctx,
            name: dev_name,
            port,
            lid,
            mtu,
            caps,
            gid,
            gbps,
        });
    }
    Err(no_device(match name {
        Some(n) => NoRdma::NotFound {
            name: n.to_string(),
            devices: seen,
            host: None,
        },
        None if seen.is_empty() => NoRdma::NoDevice,
        None => NoRdma::NoActivePort {
            port,
            devices: seen,
        },
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mtu_conversions() {
        for m in [
            Mtu::Mtu256,
            Mtu::Mtu512,
            Mtu::Mtu1024,
            Mtu::Mtu2048,
            Mtu::Mtu4096,
        ] {
            assert_eq!(mtu_from_bytes(mtu_bytes(m)), m);
        }
        assert_eq!(mtu_from_bytes(9000), Mtu::Mtu4096);
        assert_eq!(mtu_from_bytes(1500), Mtu::Mtu1024);
        assert_eq!(mtu_from_bytes(0), Mtu::Mtu256);
    }

    #[test]
    fn link_speeds() {
        // 4x EDR = 100 Gb/s, 1x HDR = 50, 4x NDR = 400; unknown values are 0.
        assert_eq!(link_gbps(2, 32), 100);
        assert_eq!(link_gbps(1, 64), 50);
        assert_eq!(link_gbps(2, 128), 400);
        assert_eq!(link_gbps(3, 32), 0);
        assert_eq!(link_gbps(1, 3), 0);
    }

    #[test]
    fn no_rdma_errnos() {
        let of = |e| no_rdma_of(&io::Error::from_raw_os_error(e));
        assert_eq!(
            of(libc::ENOSYS),
            Some(NoRdma::NoKernelStack {
                errno: libc::ENOSYS
            })
        );
        assert_eq!(of(libc::EOPNOTSUPP), Some(NoRdma::NoLibibverbs));
        assert_eq!(of(libc::EACCES), None);
    }

    #[test]
    fn reasons_name_the_cause() {
        let nf = NoRdma::NotFound {
            name: "mlx5_0".into(),
            devices: vec![],
            host: Some(Box::new(NoRdma::NoLibibverbs)),
        };
        let t = nf.to_string();
        assert!(
            t.contains("\"mlx5_0\" not found") && t.contains("libibverbs"),
            "{t}"
        );
        assert_eq!(nf.code(), "device_not_found");
        let t = NoRdma::NoKernelStack {
            errno: libc::ENOSYS,
        }
        .to_string();
        assert!(t.contains("no RDMA stack"), "{t}");
        let t = NoRdma::PortDown {
            device: "rxe0".into(),
            port: 1,
            state: "DOWN".into(),
        }
        .to_string();
        assert!(t.contains("rxe0 port 1 is DOWN"), "{t}");
    }
}
