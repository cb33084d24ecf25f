//! `visualize()`: the graph, its channels and every actor's schedule as Graphviz DOT.
use crate::compile::loc_of;
use crate::compile::plan::{GraphPlan, Loc, OpSpec};
use crate::dag::NodeInner;
use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Arc;

fn esc(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"")
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
            let e = &plan.edges[&up.id];
            let kind = if e.writer == me {
                "slot"
            } else if e.local_readers.contains(&me) {
                "in-memory"
            } else {
                "shared memory"
            };
            let _ = writeln!(out, "  n{} -> n{} [label=\"{kind}\"];", up.id, n.id);
        }
    }
    for (i, o) in plan.outputs.iter().enumerate() {
        let e = &plan.edges[o];
        let kind = if e.local_readers.contains(&Loc::Driver) {
            "in-memory"
        } else {
            "shared memory"
        };
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
