//! Compile's validation of DAGs the directives cannot produce (a strategy
//! only reaches the graph through them): edges between device groups
//! written straight into the graph, refused with the edge named.

use super::*;
use crate::dag::{Cluster, Filter};
use crate::model::ModelConfig;
use petgraph::visit::{EdgeRef, IntoEdgeReferences};

fn tiny_on_0() -> TrainingDag {
    let mut dag = TrainingDag::build(&ModelConfig::tiny(), Cluster::new(2)).unwrap();
    dag.place(&Filter::all(), &[0], "pp").unwrap();
    dag
}

fn ids_of(dag: &mut TrainingDag, filter: &str) -> Vec<NodeId> {
    dag.query_ids(&filter.parse().unwrap()).unwrap()
}

#[test]
fn a_data_edge_between_disjoint_groups_is_refused_naming_the_first_in_edge_order() {
    let mut dag = tiny_on_0();
    // Segments 3 and 5 moved to device 1 without send/recv: every data
    // edge into and out of them crosses.
    for id in ids_of(&mut dag, "{PP:3}")
        .into_iter()
        .chain(ids_of(&mut dag, "{PP:5}"))
    {
        dag.graph[id.ix()].devices = vec![DeviceId(1)];
    }
    let g = &dag.graph;
    let disjoint = |a: NodeIndex, b: NodeIndex| {
        let (a, b) = (&g[a], &g[b]);
        !matches!(a.kind, NodeKind::Marker)
            && !matches!(b.kind, NodeKind::Marker)
            && !a.devices.iter().any(|d| b.devices.contains(d))
    };
    let first = g
        .edge_references()
        .find(|e| matches!(e.weight(), EdgeKind::Data { .. }) && disjoint(e.source(), e.target()))
        .expect("the moved segments have crossing data edges");
    let (from, to) = (
        dag.label(NodeId::of(first.source())),
        dag.label(NodeId::of(first.target())),
    );
    match compile(&dag) {
        Err(CompileError::CrossingEdge {
            from: f,
            to: t,
            from_devices,
            to_devices,
        }) => {
            assert_eq!((f, t), (from, to));
            let mut pair = [from_devices, to_devices];
            pair.sort();
            assert_eq!(pair, [vec![0], vec![1]]);
        }
        other => panic!("expected a crossing data edge, got {other:?}"),
    }
}

#[test]
fn a_temporal_edge_between_disjoint_groups_is_refused_naming_it() {
    let mut dag = tiny_on_0();
    // A valid plan first: segment 3 on device 1 with its send/recv.
    dag.place(&"{PP:3}".parse().unwrap(), &[1], "pp").unwrap();
    assert!(compile(&dag).is_ok());
    // An order edge from device 0's first forward to device 1's: a
    // temporal edge needs a device both ends run on.
    let a = ids_of(&mut dag, "{PP:0,PASS:F}")[0];
    let b = ids_of(&mut dag, "{PP:3,PASS:F}")[0];
    dag.graph.add_edge(a.ix(), b.ix(), EdgeKind::Temporal);
    match compile(&dag) {
        Err(CompileError::CrossingOrder {
            from,
            to,
            from_devices,
            to_devices,
        }) => {
            assert_eq!((from, to), (dag.label(a), dag.label(b)));
            assert_eq!((from_devices, to_devices), (vec![0], vec![1]));
        }
        other => panic!("expected a crossing order edge, got {other:?}"),
    }
}
