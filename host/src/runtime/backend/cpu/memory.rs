//! What the machine can give CPU devices: the memory available to this
//! process now (the kernel's `MemAvailable`, lowered to what the process's
//! cgroup still allows), shared evenly among the devices of the process and
//! the ranks on the machine. A run without `--device-memory` takes that share
//! as each device's cap, and a plan whose predicted peak passes it is
//! refused before anything is allocated: a model that cannot fit fails in
//! milliseconds with both figures instead of initialising until the
//! out-of-memory killer ends it.

use crate::compile::human_bytes;
use crate::runtime::backend::{BackendError, Placement};

/// Bytes this process may still take from the machine, when it can tell.
pub fn available_bytes() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let mut avail = meminfo_kib(&meminfo, "MemAvailable:")?.checked_mul(1024)?;
    if let Some(left) = cgroup_left() {
        avail = avail.min(left);
    }
    Some(avail)
}

/// A `/proc/meminfo` field in KiB.
fn meminfo_kib(meminfo: &str, field: &str) -> Option<u64> {
    meminfo
        .lines()
        .find_map(|l| l.strip_prefix(field))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// What this process's cgroup (v2) still allows: `memory.max` less
/// `memory.current`, or `None` without a limit.
fn cgroup_left() -> Option<u64> {
    let own = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let path = own.lines().find_map(|l| l.strip_prefix("0::"))?;
    let dir = std::path::Path::new("/sys/fs/cgroup").join(path.trim_start_matches('/'));
    let read = |f: &str| std::fs::read_to_string(dir.join(f)).ok();
    let max: u64 = read("memory.max")?.trim().parse().ok()?; // "max": no limit
    let current: u64 = read("memory.current")?.trim().parse().ok()?;
    Some(max.saturating_sub(current))
}

/// Each CPU device's cap when none is given: `available` shared among the
/// placement's devices and the `ranks` on this machine. A device whose
/// predicted peak passes it is refused, naming both figures and the flag.
pub fn default_cap(
    place: &Placement<'_>,
    available: u64,
    ranks: usize,
) -> Result<u64, BackendError> {
    let sharers = (place.devices.len().max(1) as u64).saturating_mul(ranks.max(1) as u64);
    let share = available / sharers;
    let worst = (place.devices.iter().zip(place.peaks))
        .max_by_key(|(_, peak)| **peak)
        .filter(|(_, peak)| **peak > share);
    if let Some((device, peak)) = worst {
        let among = match (place.devices.len(), ranks) {
            (1, 1) => String::new(),
            (d, 1) => format!(
                ", {} for each of this process's {d} devices",
                human_bytes(share)
            ),
            (d, r) => format!(
                ", {} for each of the {d} devices of each of the {r} ranks on this machine",
                human_bytes(share)
            ),
        };
        return Err(BackendError::Device(format!(
            "device {device} needs {} at its predicted peak, but this machine has {} available{among}: \
             use a strategy that holds less per device (ZeRO, more pipeline stages), more devices or \
             machines, or a smaller model or batch; --device-memory SIZE sets the cap yourself",
            human_bytes(*peak),
            human_bytes(available),
        )));
    }
    Ok(share)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meminfo_fields_are_read_in_kib() {
        let m = "MemTotal:       24576000 kB\nMemFree:  100 kB\nMemAvailable:   20000000 kB\n";
        assert_eq!(meminfo_kib(m, "MemAvailable:"), Some(20_000_000));
        assert_eq!(meminfo_kib(m, "SwapTotal:"), None);
        assert!(available_bytes().is_some_and(|b| b > 0));
    }

    #[test]
    fn the_share_is_even_and_a_peak_past_it_is_refused_with_both_figures() {
        let devices = [0, 1, 2, 3];
        let place = |peaks: &'static [u64]| Placement {
            devices: &devices,
            peaks,
            threads: 1,
        };
        assert_eq!(
            default_cap(&place(&[1, 2, 3, 4]), 16 << 30, 2).unwrap(),
            2 << 30
        );
        let err = default_cap(&place(&[1, 3 << 30, 1, 1]), 16 << 30, 2)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("device 1 needs 3.00 GiB at its predicted peak")
                && err.contains("16.00 GiB available, 2.00 GiB for each of the 4 devices of each of the 2 ranks")
                && err.contains("--device-memory"),
            "{err}"
        );
    }
}
