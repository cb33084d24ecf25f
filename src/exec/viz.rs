//! `visualize()`: the graph, its channels and every actor's schedule as Graphviz DOT.
use crate::compile::loc_of;
use crate::compile::plan::{ChannelKind, EdgePlan, GraphPlan, Loc, OpSpec};
use crate::dag::NodeInner;
use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Arc;

fn esc(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"")
}

/// How `reader` gets the value of edge `e`, as the picture labels it.
fn kind_text(e: &EdgePlan, reader: Loc) -> &'static str {
    if e.writer == reader {
        return "slot";
    }
    match e.read_by(reader).map(|(c, _)| c.kind) {
        Some(ChannelKind::InProcess) => "in-memory",
        Some(ChannelKind::SharedMemory) | None => "shared memory",
        Some(ChannelKind::Network) => "network",
    }
}

fn stage_text(stage: crate::compile::plan::Stage) -> &'static str {
    match stage {
        crate::compile::plan::Stage::Inline => "",
        crate::compile::plan::Stage::Issue => ", issue",
        crate::compile::plan::Stage::Wait => ", wait",
    }
}

pub(crate) fn dot(plan: &GraphPlan, nodes: &BTreeMap<u64, Arc<NodeInner>>) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "digraph \"adag graph #{}\" {{", plan.graph);
    let _ = writeln!(out, "  rankdir=LR;");
    let _ = writeln!(out, "  driver_out [label=\"output\", shape=doublecircle];");
    for n in nodes.values() {
        let shape = if n.actor().is_some() {
            "box"
        } else {
            "ellipse"
        };
        let _ = writeln!(
            out,
            "  n{} [label=\"{}\\n{}\", shape={shape}];",
            n.id,
            esc(&n.describe()),
            esc(n.ty.name())
        );
    }
    for n in nodes.values() {
        let me = loc_of(n);
        for up in n.upstream() {
            let kind = kind_text(&plan.edges[&up.id], me);
            let _ = writeln!(out, "  n{} -> n{} [label=\"{kind}\"];", up.id, n.id);
        }
    }
    for (i, o) in plan.outputs.iter().enumerate() {
        let kind = kind_text(&plan.edges[o], Loc::Driver);
        let _ = writeln!(out, "  n{o} -> driver_out [label=\"output {i} ({kind})\"];");
    }
    for a in &plan.actors {
        let steps: Vec<String> = a
            .ops
            .iter()
            .map(|op| match op {
                OpSpec::Read { edge } => format!("read {}", plan.edges[edge].label),
                OpSpec::Compute { node, .. } | OpSpec::Split { node, .. } => {
                    format!("compute {}", plan.edges[node].label)
                }
                OpSpec::Write { edge } => format!("write {}", plan.edges[edge].label),
                OpSpec::Recv { edge, stage, .. } => format!(
                    "recv {} (communicator{})",
                    plan.edges[edge].label,
                    stage_text(*stage)
                ),
                OpSpec::Send { edge, stage, .. } => format!(
                    "send {} (communicator{})",
                    plan.edges[edge].label,
                    stage_text(*stage)
                ),
                OpSpec::Collective { node, stage, .. } => {
                    format!("{}{}", plan.edges[node].label, stage_text(*stage))
                }
            })
            .collect();
        let _ = writeln!(
            out,
            "  schedule_{} [shape=note, label=\"schedule of {}\\l{}\\l\"];",
            a.actor,
            esc(&a.name),
            steps
                .iter()
                .enumerate()
                .map(|(i, s)| format!("{}. {}", i + 1, esc(s)))
                .collect::<Vec<_>>()
                .join("\\l")
        );
    }
    out.push_str("}\n");
    out
}
