//! Which path GPU memory takes to the wire, and why.
//!
//! Detection gathers evidence (attributes, and whether registrations actually
//! succeeded) and [`decide`] turns it into a [`PathDecision`]. Deciding is pure, so
//! every combination is tested without a GPU.

use std::fmt;

/// How a GPU region reaches the NIC.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GpuPath {
    /// Registered through a dma-buf fd (`cuMemGetHandleForAddressRange` + `ibv_reg_dmabuf_mr`).
    DirectDmabuf,
    /// Registered by `ibv_reg_mr` on the device pointer (needs `nvidia-peermem`).
    DirectPeermem,
    /// Copied through a ring of pinned host buffers.
    Staged,
}

impl GpuPath {
    /// Short name as printed by `pagewire devices`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::DirectDmabuf => "direct-dmabuf",
            Self::DirectPeermem => "direct-peermem",
            Self::Staged => "staged",
        }
    }

    /// Whether the NIC touches device memory itself.
    pub fn is_direct(self) -> bool {
        !matches!(self, Self::Staged)
    }
}

impl fmt::Display for GpuPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The caller's wish for a region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GpuMode {
    /// Direct if possible (dma-buf, then peermem), else staged.
    #[default]
    Auto,
    /// Direct or fail.
    Direct,
    /// Always staged.
    Staged,
}

impl std::str::FromStr for GpuMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Self::Auto),
            "direct" => Ok(Self::Direct),
            "staged" => Ok(Self::Staged),
            other => Err(format!("unknown GPU mode {other:?} (auto, direct, staged)")),
        }
    }
}

/// Outcome of one detection step: not attempted (with why), succeeded, or failed (with the error).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Not attempted.
    NotTried(String),
    /// Succeeded.
    Ok,
    /// Failed with this error.
    Failed(String),
}

impl Step {
    fn ok(&self) -> bool {
        matches!(self, Self::Ok)
    }
    fn why(&self) -> &str {
        match self {
            Self::NotTried(w) | Self::Failed(w) => w,
            Self::Ok => "ok",
        }
    }
}

/// Everything detection learned for one (GPU, transport) pair.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PathEvidence {
    /// The transport is verbs on an RDMA device (TCP and loopback move host memory only).
    pub rdma_device: Option<String>,
    /// `CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED`.
    pub dmabuf_attr: bool,
    /// `cuMemGetHandleForAddressRange` on a test allocation.
    pub dmabuf_export: Step,
    /// `ibv_reg_dmabuf_mr` with that fd.
    pub reg_dmabuf_mr: Step,
    /// `ibv_reg_mr` on a device pointer (works only with nvidia-peermem).
    pub reg_mr_peermem: Step,
}

impl PathEvidence {
    /// Evidence for a transport with no RDMA device: nothing can be direct.
    pub fn no_rdma(dmabuf_attr: bool, why: &str) -> Self {
        Self {
            rdma_device: None,
            dmabuf_attr,
            dmabuf_export: Step::NotTried(why.into()),
            reg_dmabuf_mr: Step::NotTried(why.into()),
            reg_mr_peermem: Step::NotTried(why.into()),
        }
    }
}

/// A path and the sentence that explains it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PathDecision {
    /// The chosen path.
    pub path: GpuPath,
    /// Why, in one line.
    pub reason: String,
}

/// Decide the path for `mode` from `ev`. `Err` only when `mode` is `Direct` and
/// no direct path works; the string says why.
pub fn decide(ev: &PathEvidence, mode: GpuMode) -> Result<PathDecision, String> {
    if mode == GpuMode::Staged {
        return Ok(PathDecision {
            path: GpuPath::Staged,
            reason: "staged mode forced by the caller".into(),
        });
    }
    let Some(dev) = &ev.rdma_device else {
        let reason = "no RDMA device: TCP/loopback transports read host memory only".to_string();
        return if mode == GpuMode::Direct {
            Err(reason)
        } else {
            Ok(PathDecision {
                path: GpuPath::Staged,
                reason,
            })
        };
    };
    let dmabuf_why = if !ev.dmabuf_attr {
        "GPU reports DMA_BUF_SUPPORTED=0".to_string()
    } else if !ev.dmabuf_export.ok() {
        format!("dma-buf export: {}", ev.dmabuf_export.why())
    } else if !ev.reg_dmabuf_mr.ok() {
        format!("reg_dmabuf_mr on {dev}: {}", ev.reg_dmabuf_mr.why())
    } else {
        return Ok(PathDecision {
            path: GpuPath::DirectDmabuf,
            reason: format!("dma-buf export and reg_dmabuf_mr on {dev} succeeded"),
        });
    };
    if ev.reg_mr_peermem.ok() {
        return Ok(PathDecision {
            path: GpuPath::DirectPeermem,
            reason: format!("{dmabuf_why}; reg_mr on a device pointer succeeded (peermem)"),
        });
    }
    let reason = format!("{dmabuf_why}; peermem reg_mr: {}", ev.reg_mr_peermem.why());
    if mode == GpuMode::Direct {
        Err(reason)
    } else {
        Ok(PathDecision {
            path: GpuPath::Staged,
            reason,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            Just(Step::Ok),
            Just(Step::Failed("EINVAL".into())),
            Just(Step::NotTried("n/a".into())),
        ]
    }

    prop_compose! {
        fn evidence()(rdma in proptest::option::of(Just("mlx5_0".to_string())),
                      attr in any::<bool>(), e in step(), r in step(), p in step()) -> PathEvidence {
            PathEvidence { rdma_device: rdma, dmabuf_attr: attr, dmabuf_export: e, reg_dmabuf_mr: r, reg_mr_peermem: p }
        }
    }

    proptest! {
        #[test]
        fn decision_matches_reference(ev in evidence(), mode in prop_oneof![Just(GpuMode::Auto), Just(GpuMode::Direct), Just(GpuMode::Staged)]) {
            let dmabuf = ev.rdma_device.is_some() && ev.dmabuf_attr && ev.dmabuf_export == Step::Ok && ev.reg_dmabuf_mr == Step::Ok;
            let peermem = ev.rdma_device.is_some() && ev.reg_mr_peermem == Step::Ok;
            let expected = match mode {
                GpuMode::Staged => Some(GpuPath::Staged),
                _ if dmabuf => Some(GpuPath::DirectDmabuf),
                _ if peermem => Some(GpuPath::DirectPeermem),
                GpuMode::Direct => None,
                GpuMode::Auto => Some(GpuPath::Staged),
            };
            let got = decide(&ev, mode);
            prop_assert_eq!(got.as_ref().ok().map(|d| d.path), expected);
            // Every answer carries a reason.
            match got { Ok(d) => prop_assert!(!d.reason.is_empty()), Err(r) => prop_assert!(!r.is_empty()) }
        }
    }

    #[test]
    fn no_rdma_is_staged_with_reason() {
        let d = decide(&PathEvidence::no_rdma(true, "tcp"), GpuMode::Auto).unwrap();
        assert_eq!(d.path, GpuPath::Staged);
        assert!(d.reason.contains("no RDMA device"));
        assert!(decide(&PathEvidence::no_rdma(true, "tcp"), GpuMode::Direct).is_err());
    }

    #[test]
    fn dmabuf_failure_reason_falls_through_to_peermem() {
        let ev = PathEvidence {
            rdma_device: Some("rxe0".into()),
            dmabuf_attr: true,
            dmabuf_export: Step::Ok,
            reg_dmabuf_mr: Step::Failed("EOPNOTSUPP".into()),
            reg_mr_peermem: Step::Ok,
        };
        let d = decide(&ev, GpuMode::Auto).unwrap();
        assert_eq!(d.path, GpuPath::DirectPeermem);
        assert!(d.reason.contains("EOPNOTSUPP"), "{}", d.reason);
    }

    #[test]
    fn mode_parses() {
        assert_eq!("staged".parse::<GpuMode>().unwrap(), GpuMode::Staged);
        assert!("fast".parse::<GpuMode>().is_err());
    }
}
