//! Which RDMA device is nearest a GPU, from the PCI topology in sysfs: the
//! one under the same PCIe switch (the longest shared path of bridges below
//! the root complex), else on the same NUMA node, else none preferred.
//!
//! The choice is pure ([`nearest_all`]); [`read_topology`] reads a sysfs tree
//! (the real `/sys`, or a test's).

#![forbid(unsafe_code)]

use std::path::{Path, PathBuf};

/// Where a PCI device sits: its sysfs device path (resolved, e.g.
/// `/sys/devices/pci0000:00/0000:00:01.0/0000:03:00.0`) and NUMA node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Place {
    pub(crate) path: PathBuf,
    pub(crate) numa: Option<u32>,
}

/// How many PCI bridges two devices share below their root complex (0:
/// only the root complex, or none).
fn shared_bridges(a: &Path, b: &Path) -> usize {
    let common: Vec<_> = a
        .components()
        .zip(b.components())
        .take_while(|(x, y)| x == y)
        .map(|(x, _)| x.as_os_str().to_string_lossy().into_owned())
        .collect();
    // Components after the root complex (`pci0000:00`) that are PCI
    // addresses, i.e. bridges both devices sit below.
    match common.iter().position(|c| c.starts_with("pci")) {
        Some(root) => common.len() - root - 1,
        None => 0,
    }
}

/// The NICs of `nics` (`(name, place)`) nearest `gpu`, in `nics`' order:
/// those sharing the most bridges with it (its PCIe switch: an EFA host's
/// several NICs per GPU), else the first on its NUMA node alone; empty
/// when no NIC is nearer than another (the caller keeps its default). The
/// first is the nearest NIC.
pub(crate) fn nearest_all<'a>(gpu: &Place, nics: &'a [(String, Place)]) -> Vec<&'a str> {
    let score = |p: &Place| {
        (
            shared_bridges(&gpu.path, &p.path),
            u8::from(gpu.numa.is_some() && gpu.numa == p.numa),
        )
    };
    let Some(best) = nics.iter().map(|(_, p)| score(p)).max() else {
        return Vec::new();
    };
    let tied = nics.iter().filter(|(_, p)| score(p) == best).count();
    if best == (0, 0) || (nics.len() > 1 && tied == nics.len()) {
        return Vec::new();
    }
    let mut near: Vec<&str> = nics
        .iter()
        .filter(|(_, p)| score(p) == best)
        .map(|(n, _)| n.as_str())
        .collect();
    if best.0 == 0 {
        near.truncate(1);
    }
    near
}

/// The place of the PCI device `bdf` (`0000:3b:00.0`) and of every RDMA
/// device, read under `sys` (normally `/sys`).
pub(crate) fn read_topology(sys: &Path, bdf: &str) -> Option<(Place, Vec<(String, Place)>)> {
    let place = |dev: PathBuf| -> Option<Place> {
        let path = std::fs::canonicalize(&dev).ok()?;
        let numa = std::fs::read_to_string(dev.join("numa_node"))
            .ok()
            .and_then(|s| s.trim().parse::<i64>().ok())
            .and_then(|n| u32::try_from(n).ok());
        Some(Place { path, numa })
    };
    let gpu = place(sys.join("bus/pci/devices").join(bdf))?;
    let mut nics = Vec::new();
    for e in std::fs::read_dir(sys.join("class/infiniband"))
        .ok()?
        .flatten()
    {
        let name = e.file_name().to_string_lossy().into_owned();
        if let Some(p) = place(e.path().join("device")) {
            nics.push((name, p));
        }
    }
    nics.sort_by(|a, b| a.0.cmp(&b.0));
    Some((gpu, nics))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(path: &str, numa: Option<u32>) -> Place {
        Place {
            path: PathBuf::from(path),
            numa,
        }
    }

    fn nearest<'a>(gpu: &Place, nics: &'a [(String, Place)]) -> Option<&'a str> {
        nearest_all(gpu, nics).first().copied()
    }

    #[test]
    fn same_switch_then_same_node() {
        let gpu = at(
            "/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:08.0/0000:03:00.0",
            Some(0),
        );
        let nics = vec![
            (
                "mlx5_0".to_string(),
                at("/sys/devices/pci0000:80/0000:80:01.0/0000:81:00.0", Some(1)),
            ),
            (
                "mlx5_1".to_string(),
                at("/sys/devices/pci0000:00/0000:00:02.0/0000:05:00.0", Some(0)),
            ),
            (
                "mlx5_2".to_string(),
                at(
                    "/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:10.0/0000:04:00.0",
                    Some(0),
                ),
            ),
        ];
        // Under the same switch.
        assert_eq!(nearest(&gpu, &nics), Some("mlx5_2"));
        // Without it: same NUMA node (same root complex, no shared bridge).
        assert_eq!(nearest(&gpu, &nics[..2]), Some("mlx5_1"));
        // Nothing shared with the only one left: no preference.
        assert_eq!(nearest(&gpu, &nics[..1]), None);
        // All alike: no preference.
        let twins = vec![
            (
                "a".to_string(),
                at("/sys/devices/pci0000:80/0000:80:01.0", Some(1)),
            ),
            (
                "b".to_string(),
                at("/sys/devices/pci0000:80/0000:80:02.0", Some(1)),
            ),
        ];
        assert_eq!(nearest(&gpu, &twins), None);
        assert!(nearest_all(&gpu, &twins).is_empty());
    }

    #[test]
    fn every_nic_under_the_gpus_switch_and_one_by_node() {
        // A p5-like switch: the GPU and two NICs below 0000:10:01.0, a third
        // NIC below another switch of the same root complex, a fourth on
        // another node.
        let sw = "/sys/devices/pci0000:00/0000:00:01.0/0000:10:00.0/0000:11:01.0";
        let gpu = at(&format!("{sw}/0000:12:00.0"), Some(0));
        let nics = vec![
            (
                "efa_a".to_string(),
                at(&format!("{sw}/0000:13:00.0"), Some(0)),
            ),
            (
                "efa_b".to_string(),
                at("/sys/devices/pci0000:00/0000:00:02.0/0000:20:00.0", Some(0)),
            ),
            (
                "efa_c".to_string(),
                at(&format!("{sw}/0000:14:00.0"), Some(0)),
            ),
            (
                "efa_d".to_string(),
                at("/sys/devices/pci0000:80/0000:80:01.0/0000:81:00.0", Some(1)),
            ),
        ];
        assert_eq!(nearest_all(&gpu, &nics), vec!["efa_a", "efa_c"]);
        assert_eq!(nearest(&gpu, &nics), Some("efa_a"));
        // No shared switch: the node's first NIC only.
        let by_node: Vec<_> = nics
            .iter()
            .filter(|(n, _)| n != "efa_a" && n != "efa_c")
            .cloned()
            .collect();
        assert_eq!(nearest_all(&gpu, &by_node), vec!["efa_b"]);
    }

    #[test]
    fn reads_a_sysfs_tree() {
        let root = std::env::temp_dir().join(format!("kvxfer-sysfs-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let devices = root.join("devices/pci0000:00/0000:00:01.0");
        let gpu = devices.join("0000:03:00.0");
        let near = devices.join("0000:04:00.0");
        let far = root.join("devices/pci0000:80/0000:80:01.0/0000:81:00.0");
        for (d, numa) in [(&gpu, "0"), (&near, "0"), (&far, "-1")] {
            std::fs::create_dir_all(d).unwrap();
            std::fs::write(d.join("numa_node"), numa).unwrap();
        }
        std::fs::create_dir_all(root.join("bus/pci/devices")).unwrap();
        std::os::unix::fs::symlink(&gpu, root.join("bus/pci/devices/0000:03:00.0")).unwrap();
        for (name, d) in [("mlx5_0", &far), ("mlx5_1", &near)] {
            let c = root.join("class/infiniband").join(name);
            std::fs::create_dir_all(&c).unwrap();
            std::os::unix::fs::symlink(d, c.join("device")).unwrap();
        }
        let (g, nics) = read_topology(&root, "0000:03:00.0").unwrap();
        assert_eq!(g.numa, Some(0));
        assert_eq!(nics.len(), 2);
        assert_eq!(nics[0].1.numa, None);
        assert_eq!(nearest(&g, &nics), Some("mlx5_1"));
        assert!(read_topology(&root, "0000:09:00.0").is_none());
        std::fs::remove_dir_all(&root).unwrap();
    }
}
