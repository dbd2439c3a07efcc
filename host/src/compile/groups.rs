//! Device groups interned once per compile: each node's device list as a
//! small id, so "runs on exactly the same devices" is an integer compare and
//! a neighbour's devices are read from a small table instead of its node.

use crate::dag::{DeviceId, NodeKind, TrainingDag};
use foldhash::{HashMap, HashMapExt};
use petgraph::visit::NodeIndexable;

/// The bit of a node's group id that marks an order marker.
pub(super) const MARKER: u32 = 1 << 31;

pub(super) struct Groups<'a> {
    /// Per node index: its group's id, with [`MARKER`] set for markers.
    pub gid: Vec<u32>,
    /// The distinct device lists.
    pub lists: Vec<&'a [DeviceId]>,
}

impl<'a> Groups<'a> {
    pub fn of(dag: &'a TrainingDag) -> Self {
        let g = &dag.graph;
        let mut gid = vec![0u32; g.node_bound()];
        let mut lists: Vec<&[DeviceId]> = Vec::new();
        let mut ix: HashMap<&[DeviceId], u32> = HashMap::new();
        // Neighbouring nodes (a split's copies, a group's derived nodes)
        // mostly share their group: the last one is checked first.
        let mut last: Option<(&[DeviceId], u32)> = None;
        for i in g.node_indices() {
            let n = &g[i];
            let id = match last {
                Some((devs, id)) if devs == &n.devices[..] => id,
                _ => {
                    let next = lists.len() as u32;
                    let id = *ix.entry(&n.devices).or_insert(next);
                    if id == next {
                        lists.push(&n.devices);
                    }
                    last = Some((&n.devices, id));
                    id
                }
            };
            gid[i.index()] = id
                | if matches!(n.kind, NodeKind::Marker) {
                    MARKER
                } else {
                    0
                };
        }
        Groups { gid, lists }
    }

    /// The group id of node index `n` (without the marker bit).
    pub fn of_node(&self, n: usize) -> u32 {
        self.gid[n] & !MARKER
    }

    pub fn is_marker(&self, n: usize) -> bool {
        self.gid[n] & MARKER != 0
    }

    /// The devices of node index `n`.
    pub fn devices(&self, n: usize) -> &'a [DeviceId] {
        self.lists[self.of_node(n) as usize]
    }
}
