//! The rail-choice rule on a recorded sysfs tree (`tests/data/sysfs-2node`, drawn in its
//! README): two NUMA nodes, GPUs and NICs under different PCIe switches and root ports, a
//! soft-RoCE device with no PCI device. Expected preferences are written by hand.

use std::path::PathBuf;

use pagewire_transport::Error;
use pagewire_transport::topology::{
    MemoryKey, MemoryLocation, Nearness, Placement, RailRef, Source, read_sysfs,
};

fn tree() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/sysfs-2node")
}

/// The rails as `rdma_device=all` would open them (sorted by name), at sysfs's rates.
fn placement(priority: Option<&str>) -> Placement {
    let topo = read_sysfs(&tree()).unwrap();
    let rails = topo
        .nics
        .iter()
        .map(|n| RailRef {
            name: n.name.clone(),
            gbps: n.gbps(),
        })
        .collect();
    Placement::new(topo, rails, priority.map(|p| p.parse().unwrap())).unwrap()
}

/// Tiers as device names.
fn names(p: &Placement, loc: &MemoryLocation) -> Vec<Vec<&'static str>> {
    let all = ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3", "rxe0"];
    assert_eq!(
        p.rails()
            .iter()
            .map(|r| r.name.as_str())
            .collect::<Vec<_>>(),
        all
    );
    p.choice(loc)
        .tiers
        .iter()
        .map(|t| t.iter().map(|&r| all[r]).collect())
        .collect()
}

#[test]
fn the_snapshot_matches_the_tree() {
    let t = read_sysfs(&tree()).unwrap();
    assert_eq!(t.numa_nodes, [0, 1]);
    let nics: Vec<(&str, Option<&str>, Option<u32>, u32)> = t
        .nics
        .iter()
        .map(|n| (n.name.as_str(), n.pci.as_deref(), n.numa_node, n.gbps()))
        .collect();
    assert_eq!(
        nics,
        [
            ("mlx5_0", Some("0000:04:00.0"), Some(0), 200),
            ("mlx5_1", Some("0000:10:00.0"), Some(0), 100),
            ("mlx5_2", Some("0000:84:00.0"), Some(1), 200),
            ("mlx5_3", Some("0000:90:00.0"), Some(1), 400),
            ("rxe0", None, None, 10),
        ]
    );
    assert_eq!(
        t.nic("mlx5_0").unwrap().pci_path,
        [
            "pci0000:00",
            "0000:00:01.0",
            "0000:01:00.0",
            "0000:02:01.0",
            "0000:04:00.0"
        ]
    );
    assert_eq!(
        t.nic("mlx5_3").unwrap().pci_path,
        ["pci0000:80", "0000:80:02.0", "0000:90:00.0"]
    );
    assert!(t.nic("rxe0").unwrap().pci_path.is_empty());
    assert_eq!(t.nic("rxe0").unwrap().ports[0].state, "ACTIVE");
    // NVIDIA display/3D controllers only: not the GPU's audio function, not the BMC's VGA.
    let gpus: Vec<(&str, Option<u32>, usize)> = t
        .gpus
        .iter()
        .map(|g| (g.pci.as_str(), g.numa_node, g.pci_path.len()))
        .collect();
    assert_eq!(
        gpus,
        [
            ("0000:03:00.0", Some(0), 5),
            ("0000:83:00.0", Some(1), 5),
            ("0000:a3:00.0", Some(1), 5),
        ]
    );
}

#[test]
fn host_memory_prefers_its_node() {
    let p = placement(None);
    assert_eq!(
        names(&p, &MemoryLocation::HostNode(0)),
        [
            vec!["mlx5_0", "mlx5_1"],
            vec!["rxe0"],
            vec!["mlx5_3", "mlx5_2"]
        ]
    );
    assert_eq!(
        names(&p, &MemoryLocation::HostNode(1)),
        [
            vec!["mlx5_3", "mlx5_2"],
            vec!["rxe0"],
            vec!["mlx5_0", "mlx5_1"]
        ]
    );
    // Unknown memory: every rail in one tier (fastest first), as without topology.
    assert_eq!(
        names(&p, &MemoryLocation::Any),
        [vec!["mlx5_3", "mlx5_0", "mlx5_2", "mlx5_1", "rxe0"]]
    );
}

#[test]
fn gpu_memory_prefers_its_switch_then_host_bridge_then_node() {
    let p = placement(None);
    let gpu = |a: &str| MemoryLocation::gpu(a).unwrap();
    assert_eq!(
        names(&p, &gpu("0000:03:00.0")),
        [
            vec!["mlx5_0"],
            vec!["mlx5_1"],
            vec!["rxe0"],
            vec!["mlx5_3", "mlx5_2"]
        ]
    );
    // CUDA's spelling of the same address.
    assert_eq!(
        names(&p, &gpu("00000000:83:00.0")),
        [
            vec!["mlx5_2"],
            vec!["mlx5_3"],
            vec!["rxe0"],
            vec!["mlx5_0", "mlx5_1"]
        ]
    );
    // No NIC under its switch or host bridge: the node's NICs, fastest first.
    assert_eq!(
        names(&p, &gpu("0000:a3:00.0")),
        [
            vec!["mlx5_3", "mlx5_2"],
            vec!["rxe0"],
            vec!["mlx5_0", "mlx5_1"]
        ]
    );
    assert_eq!(
        p.nearness(0, &gpu("0000:03:00.0")),
        Nearness::Switch { hops: 4 }
    );
    assert_eq!(p.nearness(1, &gpu("0000:03:00.0")), Nearness::HostBridge);
    assert_eq!(p.nearness(3, &gpu("0000:a3:00.0")), Nearness::NumaNode);
    assert_eq!(p.nearness(4, &gpu("0000:a3:00.0")), Nearness::Unknown);
    assert_eq!(p.nearness(0, &gpu("0000:a3:00.0")), Nearness::Remote);
    // The table: each node, then each GPU, all from the rule.
    let t = p.table();
    let locs: Vec<String> = t.iter().map(|(l, _)| l.to_string()).collect();
    assert_eq!(
        locs,
        [
            "cpu:0",
            "cpu:1",
            "gpu:0000:03:00.0",
            "gpu:0000:83:00.0",
            "gpu:0000:a3:00.0"
        ]
    );
    assert!(t.iter().all(|(_, c)| c.source == Source::Rule));
}

#[test]
fn the_priority_list_overrides_what_it_names() {
    let p = placement(Some("cpu:0=mlx5_1/mlx5_0;cuda:2=mlx5_2"));
    let c = p.choice(&MemoryLocation::HostNode(0));
    assert_eq!(c.source, Source::Override(MemoryKey::Cpu(0)));
    assert_eq!(
        names(&p, &MemoryLocation::HostNode(0)),
        [
            vec!["mlx5_1"],
            vec!["mlx5_0"],
            vec!["mlx5_2", "mlx5_3", "rxe0"]
        ]
    );
    // cuda:2 is the third GPU in PCI order.
    let g = MemoryLocation::gpu("0000:a3:00.0").unwrap();
    assert_eq!(p.choice(&g).source, Source::Override(MemoryKey::Cuda(2)));
    assert_eq!(
        names(&p, &g),
        [vec!["mlx5_2"], vec!["mlx5_0", "mlx5_1", "mlx5_3", "rxe0"]]
    );
    assert_eq!(p.choice(&MemoryLocation::HostNode(1)).source, Source::Rule);
    // A rail that is not open is a config error.
    let topo = read_sysfs(&tree()).unwrap();
    let e = Placement::new(
        topo,
        vec![RailRef {
            name: "mlx5_0".into(),
            gbps: 200,
        }],
        Some("cpu:0=mlx5_1".parse().unwrap()),
    )
    .unwrap_err();
    assert!(matches!(e, Error::Config { .. }), "{e}");
}
