//! The DAG builder: model config → initial global training DAG. One `F` and one `B`
//! node per segment, tagged with the segment's annotations (`PP`, and `EP` for
//! expert segments); data edges in segment order for forward and reversed for
//! backward; an `F`→`B` edge per segment for the tensors saved for backward;
//! one `update` node that every `B` feeds its parameter gradients into.

use super::{Cluster, EdgeKind, Node, NodeId, NodeKind, Pass, Tags, TensorKind, TrainingDag};
use crate::model::{ModelConfig, ModelError};

/// Build the initial DAG. Nodes are unplaced; strategies place them.
pub fn build(cfg: &ModelConfig, cluster: Cluster) -> Result<TrainingDag, ModelError> {
    cfg.validate()?;
    if cluster.devices == 0 {
        return Err(ModelError::Invalid {
            name: cfg.name.clone(),
            message: "the cluster has no devices".into(),
        });
    }
    let segments = cfg.segments();
    let mut dag = TrainingDag::empty(cfg.clone(), segments.clone(), cluster);
    let pp = dag.tag_key("PP");
    let mut fwd: Vec<NodeId> = Vec::new();
    let mut bwd: Vec<NodeId> = Vec::new();
    for seg in &segments {
        let mut tags = Tags::default();
        tags.set(pp, seg.region);
        if let Some(e) = seg.expert_block {
            let ep = dag.tag_key("EP");
            tags.set(ep, e);
        }
        let mk = |pass| {
            let kind = NodeKind::Compute {
                pass,
                segment: seg.index,
                phase: None,
            };
            Node::new(kind, tags.clone(), Vec::new(), crate::dag::COMPUTE, 1)
        };
        fwd.push(NodeId::of(dag.graph.add_node(mk(Pass::F))));
        bwd.push(NodeId::of(dag.graph.add_node(mk(Pass::B))));
    }
    for (i, seg) in segments.iter().enumerate() {
        // Saved activations: F(s) → B(s).
        dag.graph.add_edge(
            fwd[i].ix(),
            bwd[i].ix(),
            EdgeKind::Data {
                tensor: TensorKind::Saved,
                bytes: seg.cost.saved_bytes,
            },
        );
        if i + 1 < segments.len() {
            let act = seg.cost.act_out_bytes;
            dag.graph.add_edge(
                fwd[i].ix(),
                fwd[i + 1].ix(),
                EdgeKind::Data {
                    tensor: TensorKind::Activation,
                    bytes: act,
                },
            );
            dag.graph.add_edge(
                bwd[i + 1].ix(),
                bwd[i].ix(),
                EdgeKind::Data {
                    tensor: TensorKind::ActGrad,
                    bytes: act,
                },
            );
        }
    }
    // The update node and (later) the gradient collectives are derived.
    dag.rebuild_derived();
    Ok(dag)
}

#[cfg(test)]
mod tests {
    use crate::dag::{Cluster, Filter, Label, TrainingDag};
    use crate::model::ModelConfig;

    #[test]
    fn tiny_dag_has_f_b_per_segment_and_one_update() {
        let mut dag = TrainingDag::build(&ModelConfig::tiny(), Cluster::new(1)).unwrap();
        assert_eq!(dag.query(&Filter::all().pass(Label::F)).unwrap().len(), 8);
        assert_eq!(dag.query(&Filter::all().pass(Label::B)).unwrap().len(), 8);
        assert_eq!(
            dag.query(&Filter::all().pass(Label::Update)).unwrap().len(),
            1
        );
        // 8 saved + 7 forward + 7 backward + 8 gradient edges.
        assert_eq!(dag.edge_count(), 30);
        let f3 = &dag.query(&Filter::tag("PP", 3).pass(Label::F)).unwrap()[0];
        assert!(f3.cost.flops > 0.0 && f3.cost.param_bytes > 0 && f3.cost.saved_bytes > 0);
        assert_eq!(f3.cost.act_in_bytes, f3.cost.act_out_bytes);
        // Backward costs twice the forward.
        let b3 = &dag.query(&Filter::tag("PP", 3).pass(Label::B)).unwrap()[0];
        assert_eq!(b3.cost.flops, 2.0 * f3.cost.flops);
    }
}
