//! Finding the devices: PCI functions under a sysfs root (`<root>/bus/pci/devices/<address>`)
//! whose `vendor` and `device` files match the configured ids, with their NUMA node and IOMMU
//! group — or `N` emulated devices for clusters without DPUs. A scan is a snapshot: a device
//! that was found once and is missing from a later scan is unhealthy (a function that fell off
//! the bus, a DPU reset), and healthy again when it comes back.
//!
//! The parsers take whatever a file holds and answer a typed error, never a panic (a property
//! test feeds them arbitrary text).

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

/// A PCI vendor:device pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PciId {
    /// Vendor id (`0x15b3`: Mellanox/NVIDIA networking).
    pub vendor: u16,
    /// Device id.
    pub device: u16,
}

/// The default ids: NVIDIA (Mellanox) BlueField DPUs — BlueField (`15b3:a2d2`), BlueField-2
/// (`15b3:a2d6`) and BlueField-3 (`15b3:a2dc`) integrated ConnectX network functions, as named
/// in the PCI ID database.
pub const BLUEFIELD: [PciId; 3] = [
    PciId { vendor: 0x15b3, device: 0xa2d2 },
    PciId { vendor: 0x15b3, device: 0xa2d6 },
    PciId { vendor: 0x15b3, device: 0xa2dc },
];

/// What a sysfs file or a flag held that could not be read as expected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParseError {
    /// Not a `0x`-prefixed (or bare) hexadecimal 16-bit number.
    #[error("not a 16-bit hexadecimal id: {0:?}")]
    BadHex(String),
    /// Not `vendor:device`.
    #[error("not a vendor:device pair: {0:?}")]
    BadPair(String),
    /// Not a NUMA node number (or -1).
    #[error("not a NUMA node: {0:?}")]
    BadNuma(String),
}

/// Reads a 16-bit id as sysfs writes it (`0x15b3\n`); a bare hex number too.
pub fn parse_hex16(s: &str) -> Result<u16, ParseError> {
    let t = s.trim();
    let digits = t.strip_prefix("0x").or_else(|| t.strip_prefix("0X")).unwrap_or(t);
    if digits.is_empty() || digits.len() > 4 || !digits.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(ParseError::BadHex(s.to_string()));
    }
    u16::from_str_radix(digits, 16).map_err(|_| ParseError::BadHex(s.to_string()))
}

/// Reads a `numa_node` file: a node number, or `-1` (none: a machine without NUMA).
pub fn parse_numa(s: &str) -> Result<Option<u32>, ParseError> {
    let t = s.trim();
    match t {
        "-1" => Ok(None),
        _ if !t.is_empty() && t.len() <= 5 && t.bytes().all(|b| b.is_ascii_digit()) => {
            t.parse().map(Some).map_err(|_| ParseError::BadNuma(s.to_string()))
        }
        _ => Err(ParseError::BadNuma(s.to_string())),
    }
}

impl FromStr for PciId {
    type Err = ParseError;

    /// `15b3:a2d6` (each side with or without `0x`).
    fn from_str(s: &str) -> Result<PciId, ParseError> {
        let (v, d) = s.split_once(':').ok_or_else(|| ParseError::BadPair(s.to_string()))?;
        Ok(PciId { vendor: parse_hex16(v)?, device: parse_hex16(d)? })
    }
}

impl fmt::Display for PciId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:04x}:{:04x}", self.vendor, self.device)
    }
}

/// One PCI function of a device (a port of a card).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Function {
    /// Its PCI address (`0000:03:00.1`).
    pub address: String,
    /// Its IOMMU group (`/dev/vfio/<group>` gives user space the function, once it is bound to
    /// `vfio-pci`), if any.
    pub iommu_group: Option<String>,
    /// The driver bound to it (`mlx5_core`, `vfio-pci`, ...): None when unbound.
    pub driver: Option<String>,
    /// Its sysfs directory.
    pub sysfs: PathBuf,
    /// Its network interfaces (a function a kernel driver runs) and whether each link is up
    /// (`net/<name>/operstate`).
    pub links: Vec<(String, bool)>,
}

/// The driver through which user space owns a function: only then are its VFIO nodes of use.
pub const VFIO_DRIVER: &str = "vfio-pci";

/// One device the plugin offers: a card, with all its functions (a dual-port DPU is one DPU, not
/// two), or an emulated one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FoundDevice {
    /// Its id towards the kubelet: the card's PCI slot (`0000:03:00`, its functions `.0`, `.1`
    /// ...) or `emulated-N`.
    pub id: String,
    /// NUMA node, when the machine has several.
    pub numa: Option<u32>,
    /// Its functions, by address (none for an emulated device).
    pub functions: Vec<Function>,
}

impl FoundDevice {
    /// Whether it can serve, or why not: every function has a driver bound (an unbound function
    /// is a card being reset or reconfigured), and of the functions with network interfaces at
    /// least one link is up (a DPU whose ports are all down serves no one). Emulated: always.
    pub fn probe(&self) -> Result<(), String> {
        if let Some(f) = self.functions.iter().find(|f| f.driver.is_none()) {
            return Err(format!("function {} has no driver bound", f.address));
        }
        let links: Vec<&(String, bool)> = self.functions.iter().flat_map(|f| &f.links).collect();
        if !links.is_empty() && !links.iter().any(|(_, up)| *up) {
            let names: Vec<&str> = links.iter().map(|(n, _)| n.as_str()).collect();
            return Err(format!("every link is down ({})", names.join(", ")));
        }
        Ok(())
    }
}

/// A card's slot: a function's address without its function number (`0000:03:00.1` -> `0000:03:00`).
pub fn slot_of(address: &str) -> &str {
    address.rsplit_once('.').map_or(address, |(slot, _)| slot)
}

/// Where devices come from.
#[derive(Debug, Clone)]
pub enum Source {
    /// PCI functions under a sysfs root (normally `/sys`) matching these ids.
    Pci {
        /// The sysfs root.
        root: PathBuf,
        /// The ids to offer.
        ids: Vec<PciId>,
    },
    /// This many virtual devices (always present).
    Emulated(usize),
}

/// The directory holding one entry per PCI function.
pub fn pci_devices(root: &Path) -> PathBuf {
    root.join("bus/pci/devices")
}

impl Source {
    /// The devices present now, by id (ascending).
    pub fn scan(&self) -> std::io::Result<BTreeMap<String, FoundDevice>> {
        let mut out = BTreeMap::new();
        match self {
            Source::Emulated(n) => {
                for i in 0..*n {
                    let id = format!("emulated-{i}");
                    out.insert(id.clone(), FoundDevice { id, numa: None, functions: Vec::new() });
                }
            }
            Source::Pci { root, ids } => {
                let dir = pci_devices(root);
                let entries = match std::fs::read_dir(&dir) {
                    Ok(e) => e,
                    // No PCI bus at all (a container without /sys/bus/pci): no devices.
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
                    Err(e) => return Err(e),
                };
                for entry in entries {
                    let entry = entry?;
                    let path = entry.path();
                    let Some((f, numa)) = read_function(&path, ids) else { continue };
                    let slot = slot_of(&f.address).to_string();
                    let d = out.entry(slot.clone()).or_insert_with(|| FoundDevice {
                        id: slot,
                        numa,
                        functions: Vec::new(),
                    });
                    d.numa = d.numa.or(numa);
                    d.functions.push(f);
                }
                for d in out.values_mut() {
                    d.functions.sort_by(|a, b| a.address.cmp(&b.address));
                }
            }
        }
        Ok(out)
    }
}

/// The function at `path` and its NUMA node, if it is one of `ids` (unreadable or malformed
/// files: not ours — a function being removed while it is read looks like that).
fn read_function(path: &Path, ids: &[PciId]) -> Option<(Function, Option<u32>)> {
    let address = path.file_name()?.to_str()?.to_string();
    let vendor = parse_hex16(&std::fs::read_to_string(path.join("vendor")).ok()?).ok()?;
    let device = parse_hex16(&std::fs::read_to_string(path.join("device")).ok()?).ok()?;
    if !ids.contains(&PciId { vendor, device }) {
        return None;
    }
    let numa = std::fs::read_to_string(path.join("numa_node")).ok().and_then(|s| parse_numa(&s).ok()).flatten();
    let link_name = |p: PathBuf| std::fs::read_link(p).ok()?.file_name()?.to_str().map(str::to_string);
    let iommu_group = link_name(path.join("iommu_group"));
    let driver = link_name(path.join("driver"));
    let mut links = Vec::new();
    if let Ok(nets) = std::fs::read_dir(path.join("net")) {
        for n in nets.flatten() {
            let Some(name) = n.file_name().to_str().map(str::to_string) else { continue };
            let state = std::fs::read_to_string(n.path().join("operstate")).unwrap_or_default();
            // `unknown` is what many drivers report for a working link; the others are down.
            let up = !matches!(state.trim(), "down" | "lowerlayerdown" | "notpresent" | "dormant" | "");
            links.push((name, up));
        }
        links.sort();
    }
    Some((Function { address, iommu_group, driver, sysfs: path.to_path_buf(), links }, numa))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn ids_read_as_sysfs_writes_them() {
        assert_eq!(parse_hex16("0x15b3\n"), Ok(0x15b3));
        assert_eq!(parse_hex16("a2d6"), Ok(0xa2d6));
        assert!(parse_hex16("0x").is_err());
        assert!(parse_hex16("0x15b3a").is_err());
        assert!(parse_hex16("-0x1").is_err());
        assert!(parse_hex16("+15").is_err(), "from_str_radix would take a sign");
        assert_eq!(parse_numa("1\n"), Ok(Some(1)));
        assert_eq!(parse_numa("-1\n"), Ok(None));
        assert!(parse_numa("").is_err());
        assert_eq!("15b3:a2dc".parse::<PciId>(), Ok(BLUEFIELD[2]));
        assert_eq!("0x15b3:0xa2d6".parse::<PciId>().map(|p| p.to_string()), Ok("15b3:a2d6".into()));
        assert!("15b3".parse::<PciId>().is_err());
    }

    #[test]
    fn a_fake_sysfs_tree_is_scanned_for_matching_functions() {
        let root = tempfile::tempdir().expect("tempdir");
        let fake = |addr: &str, vendor: &str, device: &str, numa: &str| {
            let d = pci_devices(root.path()).join(addr);
            std::fs::create_dir_all(&d).expect("dir");
            std::fs::write(d.join("vendor"), vendor).expect("vendor");
            std::fs::write(d.join("device"), device).expect("device");
            std::fs::write(d.join("numa_node"), numa).expect("numa");
        };
        fake("0000:03:00.0", "0x15b3\n", "0xa2d6\n", "0\n");
        fake("0000:03:00.1", "0x15b3\n", "0xa2d6\n", "0\n"); // the same card's second port
        fake("0000:81:00.0", "0x15b3\n", "0xa2dc\n", "1\n");
        fake("0000:00:1f.0", "0x8086\n", "0xa2d6\n", "-1\n"); // another vendor
        fake("0000:04:00.0", "garbage", "0xa2d6\n", "0\n"); // unreadable
        let src = Source::Pci { root: root.path().to_path_buf(), ids: BLUEFIELD.to_vec() };
        let found = src.scan().expect("scan");
        assert_eq!(found.keys().collect::<Vec<_>>(), ["0000:03:00", "0000:81:00"], "one device per card");
        let ports: Vec<&str> = found["0000:03:00"].functions.iter().map(|f| f.address.as_str()).collect();
        assert_eq!(ports, ["0000:03:00.0", "0000:03:00.1"]);
        assert_eq!(found["0000:81:00"].numa, Some(1));
        // No driver bound: not healthy; bound, its links say.
        assert!(found["0000:81:00"].probe().is_err_and(|e| e.contains("no driver")));
        let d = pci_devices(root.path()).join("0000:81:00.0");
        std::os::unix::fs::symlink("../../../bus/pci/drivers/mlx5_core", d.join("driver")).expect("driver");
        std::fs::create_dir_all(d.join("net/p0")).expect("net");
        std::fs::write(d.join("net/p0/operstate"), "down\n").expect("operstate");
        let card = src.scan().expect("scan").remove("0000:81:00").expect("card");
        assert_eq!(card.functions[0].driver.as_deref(), Some("mlx5_core"));
        assert!(card.probe().is_err_and(|e| e.contains("every link is down")), "{:?}", card.probe());
        std::fs::write(d.join("net/p0/operstate"), "up\n").expect("operstate");
        assert_eq!(src.scan().expect("scan")["0000:81:00"].probe(), Ok(()));
        let none = Source::Pci { root: root.path().join("nothing"), ids: BLUEFIELD.to_vec() };
        assert!(none.scan().expect("no bus").is_empty());
        assert_eq!(Source::Emulated(2).scan().expect("emulated").len(), 2);
    }

    proptest! {
        #[test]
        fn parsers_never_panic_and_read_back_what_they_print(s in ".{0,16}", v in any::<u16>(), d in any::<u16>()) {
            let _ = parse_hex16(&s);
            let _ = parse_numa(&s);
            let _ = s.parse::<PciId>();
            let id = PciId { vendor: v, device: d };
            prop_assert_eq!(id.to_string().parse::<PciId>(), Ok(id));
            prop_assert_eq!(parse_hex16(&format!("0x{v:04x}\n")), Ok(v));
        }
    }
}
