//! The behaviour suite of adag: graph building, typed and by-name binding, compile options and
//! validation, execution, errors, teardown, one-off calls and many executions, run against
//! every placement that works (see `common::placements`). Every test body runs under a
//! watchdog, so a hang is a failure that names the test.

mod common;

use adag::{
    Capacity, CompileOptions, CompiledRef, Dag, ErasedArg, Error, MultiOutput, Node, Placement,
    RefSet, Runtime, get_all,
};
use common::*;
use std::collections::VecDeque;
use std::time::{Duration, Instant};

fn opts() -> CompileOptions {
    CompileOptions::default()
}

/// `Error::Compile`'s node and message, or a failure.
#[track_caller]
fn compile_error(e: Error, p: Placement) -> (String, String) {
    match e {
        Error::Compile { node, message, .. } => (node, message),
        other => panic!("[{p:?}] expected Error::Compile, got {other:?}"),
    }
}

// =======================================================================================
// Graph building
// =======================================================================================

#[test]
fn input_node_used_directly() {
    each_placement("input_node_used_directly", |p| {
        let rt = Runtime::new().unwrap();
        let a = worker(&rt, p, 7);
        let dag = Dag::<u64>::new();
        let x = dag.input();
        let g = dag.compile(a.echo(&x), opts()).unwrap();
        for i in [0u64, 1, 41, 1 << 40] {
            assert_eq!(
                g.execute(i).unwrap().get().unwrap(),
                i + 7,
                "[{p:?}] echo({i})"
            );
        }
        g.teardown().unwrap();

        // `dag.input()` twice is the same node: bound twice to one method it feeds both args.
        let dag = Dag::<u64>::new();
        let y = a.add(dag.input(), dag.input());
        let g = dag.compile(y, opts()).unwrap();
        assert_eq!(
            g.execute(20).unwrap().get().unwrap(),
            20 + 20 + 7,
            "[{p:?}]"
        );
    });
}

#[test]
fn positional_input_parts() {
    each_placement("positional_input_parts", |p| {
        let rt = Runtime::new().unwrap();
        let a = worker(&rt, p, 0);
        let dag = Dag::<(u64, u64)>::new();
        let input = dag.input();
        let first = input.arg::<0>();
        let second = input.arg::<1>();
        assert_eq!(first.describe(), "input[0]");
        assert_eq!(second.describe(), "input[1]");
        assert_eq!(
            input.arg::<1>().describe(),
            "input[1]",
            "the same part twice"
        );
        // combine is order-sensitive: 1000 a + b.
        let y = a.combine(&second, &first);
        let g = dag.compile(y, opts()).unwrap();
        assert_eq!(g.execute((3, 4)).unwrap().get().unwrap(), 4003, "[{p:?}]");
        assert_eq!(g.execute((9, 1)).unwrap().get().unwrap(), 1009, "[{p:?}]");
    });
}

#[test]
fn named_input_parts() {
    each_placement("named_input_parts", |p| {
        let rt = Runtime::new().unwrap();
        let a = worker(&rt, p, 0);
        let b = worker(&rt, p, 100);
        let c = worker(&rt, p, 0);
        let dag = Dag::<Req>::new();
        let input = dag.input();
        let k = input.field("k", |r: &Req| r.k.clone());
        let v = input.field("v", |r: &Req| r.v);
        assert_eq!(k.describe(), "input.k");
        assert_eq!(v.describe(), "input.v");
        let outs = (a.strlen(&k), b.echo(&v), c.shout(&k));
        let g = dag.compile(outs, opts()).unwrap();
        let req = Req {
            k: "hello".into(),
            v: 5,
        };
        let (len, v1, s) = g.execute(req).unwrap().get().unwrap();
        assert_eq!((len, v1, s.as_str()), (5, 105, "hello!"), "[{p:?}]");
        let (len, v1, s) = g
            .execute(Req {
                k: String::new(),
                v: 0,
            })
            .unwrap()
            .get()
            .unwrap();
        assert_eq!((len, v1, s.as_str()), (0, 100, "!"), "[{p:?}]");
    });
}

#[test]
fn tuple_input_with_several_args() {
    each_placement("tuple_input_with_several_args", |p| {
        let rt = Runtime::new().unwrap();
        let a = worker(&rt, p, 1000);
        let dag = Dag::<(u64, u64, u64)>::new();
        let input = dag.input();
        let y = a.add3(input.arg::<0>(), input.arg::<1>(), input.arg::<2>());
        let g = dag.compile(y, opts()).unwrap();
        assert_eq!(
            g.execute((1, 2, 3)).unwrap().get().unwrap(),
            1123,
            "[{p:?}]"
        );
        assert_eq!(
            g.execute((3, 2, 1)).unwrap().get().unwrap(),
            1321,
            "[{p:?}]"
        );
    });
}

#[test]
fn constants_mixed_with_node_args() {
    each_placement("constants_mixed_with_node_args", |p| {
        let rt = Runtime::new().unwrap();
        let a = worker(&rt, p, 0);
        let b = worker(&rt, p, 0);
        let dag = Dag::<(u64, u64)>::new();
        let input = dag.input();
        let x = input.arg::<0>();
        let y = input.arg::<1>();
        let out1 = a.add3(&x, 5u64, &y);
        let out2 = b.add3(7u64, &y, 9u64);
        let g = dag.compile((out1, out2), opts()).unwrap();
        let (r1, r2) = g.execute((1, 2)).unwrap().get().unwrap();
        assert_eq!(r1, 152, "[{p:?}] add3(x=1, 5, y=2)");
        assert_eq!(r2, 729, "[{p:?}] add3(7, y=2, 9)");
    });
}

#[test]
fn methods_with_one_two_three_args() {
    each_placement("methods_with_one_two_three_args", |p| {
        let rt = Runtime::new().unwrap();
        let a = worker(&rt, p, 1);
        let b = worker(&rt, p, 2);
        let c = worker(&rt, p, 3);
        let dag = Dag::<u64>::new();
        let x = dag.input();
        let one = a.echo(&x);
        let two = b.add(&x, &one);
        let three = c.add3(&x, &one, &two);
        let g = dag.compile((one, two, three), opts()).unwrap();
        for i in 0..5u64 {
            let (o, t, th) = g.execute(i).unwrap().get().unwrap();
            assert_eq!(o, i + 1, "[{p:?}] one-arg");
            assert_eq!(t, i + (i + 1) + 2, "[{p:?}] two-arg");
            assert_eq!(th, 100 * i + 10 * o + t + 3, "[{p:?}] three-arg");
        }
    });
}

#[test]
fn zero_arg_method_in_graph_is_compile_error() {
    each_placement("zero_arg_method_in_graph_is_compile_error", |p| {
        let rt = Runtime::new().unwrap();
        let a = worker(&rt, p, 0);
        let dag = Dag::<u64>::new();
        let x = dag.input();
        let y = a.echo(&x);
        let z = a.calls();
        let e = expect_err(dag.compile((y.clone(), z.clone()), opts()), "0-arg task");
        let (node, message) = compile_error(e, p);
        assert_eq!(node, z.describe(), "[{p:?}] the error names the 0-arg task");
        assert!(node.contains("calls"), "[{p:?}] {node}");
        assert!(message.contains("input"), "[{p:?}] {message}");
        drop(z);
        // Without it, the same graph compiles and the actor is free.
        let g = dag.compile(y, opts()).unwrap();
        assert_eq!(g.execute(4).unwrap().get().unwrap(), 4, "[{p:?}]");
    });
}

#[test]
fn same_actor_several_times_runs_in_bind_order() {
    each_placement("same_actor_several_times_runs_in_bind_order", |p| {
        let rt = Runtime::new().unwrap();
        let a = worker(&rt, p, 0);
        {
            let dag = Dag::<u64>::new();
            let x = dag.input();
            let f = a.note_f(&x); // bound first: runs first
            let g_ = a.note_g(&x);
            // Outputs in the other order: the schedule follows bind order, not output order.
            let g = dag.compile((g_, f), opts()).unwrap();
            for i in 0..3u64 {
                let (gl, fl) = g.execute(i).unwrap().get().unwrap();
                assert_eq!(fl, 2 * i + 1, "[{p:?}] f is the {}th entry", 2 * i + 1);
                assert_eq!(gl, 2 * i + 2, "[{p:?}] g follows f");
            }
            g.teardown().unwrap();
        }
        let log = a.call().log().unwrap();
        assert_eq!(log, ["f0", "g0", "f1", "g1", "f2", "g2"], "[{p:?}]");
        {
            // Now g bound before f.
            let dag = Dag::<u64>::new();
            let x = dag.input();
            let g_ = a.note_g(&x);
            let f = a.note_f(&x);
            let g = dag.compile((f, g_), opts()).unwrap();
            let (fl, gl) = g.execute(9).unwrap().get().unwrap();
            assert_eq!((gl, fl), (7, 8), "[{p:?}] g runs first now");
        }
        let log = a.call().log().unwrap();
        assert_eq!(&log[6..], ["g9", "f9"], "[{p:?}]");
        // A chain through one actor: f feeds g on the same actor.
        let dag = Dag::<u64>::new();
        let x = dag.input();
        let y = a.echo(a.echo(a.echo(&x)));
        let g = dag.compile(y, opts()).unwrap();
        assert_eq!(g.execute(1).unwrap().get().unwrap(), 1, "[{p:?}] k = 0");
    });
}

#[test]
fn chain_of_three() {
    each_placement("chain_of_three", |p| {
        let rt = Runtime::new().unwrap();
        let a = worker(&rt, p, 1);
        let b = worker(&rt, p, 10);
        let c = worker(&rt, p, 100);
        let dag = Dag::<u64>::new();
        let y = c.echo(b.echo(a.echo(dag.input())));
        let g = dag.compile(y, opts()).unwrap();
        for i in 0..50u64 {
            assert_eq!(g.execute(i).unwrap().get().unwrap(), i + 111, "[{p:?}]");
        }
    });
}

#[test]
fn fan_out_one_node_to_three_actors() {
    each_placement("fan_out_one_node_to_three_actors", |p| {
        let rt = Runtime::new().unwrap();
        let a = worker(&rt, p, 1);
        let b = worker(&rt, p, 10);
        let c = worker(&rt, p, 20);
        let d = worker(&rt, p, 30);
        let dag = Dag::<u64>::new();
        let y = a.echo(dag.input());
        let g = dag
            .compile((b.echo(&y), c.echo(&y), d.echo(&y)), opts())
            .unwrap();
        for i in 0..20u64 {
            let got = g.execute(i).unwrap().get().unwrap();
            assert_eq!(got, (i + 11, i + 21, i + 31), "[{p:?}]");
        }
        g.teardown().unwrap();
        // a ran once per execution although three actors read its result.
        assert_eq!(a.call().calls().unwrap(), 20, "[{p:?}]");
    });
}

#[test]
fn fan_in_and_diamond() {
    each_placement("fan_in_and_diamond", |p| {
        let rt = Runtime::new().unwrap();
        let a = worker(&rt, p, 1);
        let b = worker(&rt, p, 10);
        let c = worker(&rt, p, 20);
        let d = worker(&rt, p, 0);
        // Fan-in: two input parts into one method.
        {
            let dag = Dag::<(u64, u64)>::new();
            let input = dag.input();
            let y = d.combine(b.echo(input.arg::<0>()), c.echo(input.arg::<1>()));
            let g = dag.compile(y, opts()).unwrap();
            assert_eq!(g.execute((1, 2)).unwrap().get().unwrap(), 11_022, "[{p:?}]");
        }
        // Diamond: x -> a -> (b, c) -> d.
        let dag = Dag::<u64>::new();
        let top = a.echo(dag.input());
        let y = d.combine(b.echo(&top), c.echo(&top));
        let g = dag.compile(y, opts()).unwrap();
        for i in 0..20u64 {
            let want = 1000 * (i + 11) + (i + 21);
            assert_eq!(g.execute(i).unwrap().get().unwrap(), want, "[{p:?}]");
        }
    });
}

#[test]
fn multi_output_tuple_vec_and_multioutput() {
    each_placement("multi_output_tuple_vec_and_multioutput", |p| {
        let rt = Runtime::new().unwrap();
        let a = worker(&rt, p, 1);
        let b = worker(&rt, p, 2);
        let c = worker(&rt, p, 3);
        {
            // A tuple of nodes of different types, one of them itself a tuple.
            let dag = Dag::<u64>::new();
            let x = dag.input();
            let g = dag.compile((a.echo(&x), b.pair(&x)), opts()).unwrap();
            let (r1, r2): (CompiledRef<u64>, CompiledRef<(u64, String)>) = g.execute(5).unwrap();
            assert_eq!(r2.get().unwrap(), (7, "v5".to_string()), "[{p:?}]");
            assert_eq!(r1.get().unwrap(), 6, "[{p:?}]");
        }
        {
            // A Vec of nodes.
            let dag = Dag::<u64>::new();
            let x = dag.input();
            let outs: Vec<Node<u64>> = vec![a.echo(&x), b.echo(&x), c.echo(&x)];
            let g = dag.compile(outs, opts()).unwrap();
            let refs = g.execute(10).unwrap();
            assert_eq!(refs.len(), 3);
            assert_eq!(get_all(refs).unwrap(), vec![11, 12, 13], "[{p:?}]");
        }
        {
            // adag::MultiOutput.
            let dag = Dag::<u64>::new();
            let x = dag.input();
            let outs = MultiOutput(vec![c.echo(&x), a.echo(&x)]);
            let g = dag.compile(outs, opts()).unwrap();
            for i in 0..5 {
                let refs = g.execute(i).unwrap();
                assert_eq!(refs.get().unwrap(), vec![i + 3, i + 1], "[{p:?}]");
            }
        }
    });
}

#[test]
fn same_node_twice_in_outputs() {
    each_placement("same_node_twice_in_outputs", |p| {
        let rt = Runtime::new().unwrap();
        let a = worker(&rt, p, 1);
        let b = worker(&rt, p, 2);
        {
            let dag = Dag::<u64>::new();
            let y = a.echo(dag.input());
            let g = dag.compile((y.clone(), y), opts()).unwrap();
            for i in 0..5 {
                assert_eq!(
                    g.execute(i).unwrap().get().unwrap(),
                    (i + 1, i + 1),
                    "[{p:?}]"
                );
            }
            // Claimed in the other order.
            let (r1, r2) = g.execute(9).unwrap();
            assert_eq!(r2.get().unwrap(), 10, "[{p:?}]");
            assert_eq!(r1.get().unwrap(), 10, "[{p:?}]");
            g.teardown().unwrap();
            assert_eq!(
                a.call().calls().unwrap(),
                6,
                "[{p:?}] computed once per execution"
            );
        }
        let dag = Dag::<u64>::new();
        let x = dag.input();
        let y = a.echo(&x);
        let z = b.echo(&x);
        let g = dag.compile(vec![y.clone(), z, y], opts()).unwrap();
        assert_eq!(
            g.execute(1).unwrap().get().unwrap(),
            vec![2, 3, 2],
            "[{p:?}]"
        );
    });
}

#[test]
fn split_tuple_result_into_nodes() {
    each_placement("split_tuple_result_into_nodes", |p| {
        let rt = Runtime::new().unwrap();
        let a = worker(&rt, p, 1);
        let b = worker(&rt, p, 10);
        let c = worker(&rt, p, 0);
        let dag = Dag::<u64>::new();
        let (n, s) = a.pair(dag.input()).split();
        let outs = (b.echo(&n), c.strlen(&s), s);
        let g = dag.compile(outs, opts()).unwrap();
        for i in [0u64, 42, 12345] {
            let (bn, len, s) = g.execute(i).unwrap().get().unwrap();
            assert_eq!(bn, i + 11, "[{p:?}] first element");
            assert_eq!(s, format!("v{i}"), "[{p:?}] second element to the driver");
            assert_eq!(len, s.len() as u64, "[{p:?}] second element to c");
        }
    });
}

// =======================================================================================
// Binding by name
// =======================================================================================

#[test]
fn by_name_binding_works() {
    each_placement("by_name_binding_works", |p| {
        let rt = Runtime::new().unwrap();
        let a = worker(&rt, p, 100);
        let dag = Dag::<u64>::new();
        let x = dag.input();
        let any = a
            .method("add")
            .unwrap()
            .bind([x.erase().into(), ErasedArg::constant(5u64)]);
        assert!(any.type_name().contains("u64"), "{}", any.type_name());
        assert!(
            any.typed::<String>().is_none(),
            "[{p:?}] wrong type recovered"
        );
        let y = any.typed::<u64>().expect("add returns u64");
        let g = dag.compile(y, opts()).unwrap();
        assert_eq!(g.execute(10).unwrap().get().unwrap(), 115, "[{p:?}]");
        assert_eq!(g.execute(0).unwrap().get().unwrap(), 105, "[{p:?}]");
    });
}

#[test]
fn by_name_unknown_method_is_an_error_naming_it() {
    each_placement("by_name_unknown_method_is_an_error_naming_it", |p| {
        let rt = Runtime::new().unwrap();
        let a = worker(&rt, p, 0);
        let Err(e) = a.method("nope") else {
            panic!("[{p:?}] a method that does not exist was found");
        };
        let Error::Compile { node, message, .. } = e else {
            panic!("[{p:?}] expected Error::Compile, got {e:?}");
        };
        assert_eq!(node, format!("{}.nope", a.name()), "[{p:?}] {message}");
        assert!(
            message.contains("nope"),
            "[{p:?}] names the method: {message}"
        );
        for m in ["echo", "add", "add3", "checked", "pair", "log"] {
            assert!(message.contains(m), "[{p:?}] lists `{m}`: {message}");
        }
        // Nothing was claimed.
        assert_eq!(a.call().echo(1).unwrap(), 1, "[{p:?}]");
    });
}

#[test]
fn by_name_wrong_argument_type_is_compile_error() {
    each_placement("by_name_wrong_argument_type_is_compile_error", |p| {
        let rt = Runtime::new().unwrap();
        let a = worker(&rt, p, 0);
        {
            let dag = Dag::<String>::new();
            let x = dag.input();
            let y = a
                .method("echo")
                .unwrap()
                .bind([x.erase().into()])
                .typed::<u64>()
                .unwrap();
            let e = expect_err(dag.compile(y.clone(), opts()), "String into u64");
            let (node, message) = compile_error(e, p);
            assert_eq!(node, y.describe(), "[{p:?}]");
            assert!(
                message.contains("u64"),
                "[{p:?}] names the wanted type: {message}"
            );
            assert!(
                message.contains("String"),
                "[{p:?}] names the given type: {message}"
            );
            assert!(
                message.contains("input"),
                "[{p:?}] names the argument's node: {message}"
            );
        }
        {
            // A constant of the wrong type.
            let dag = Dag::<u64>::new();
            let x = dag.input();
            let y = a
                .method("add")
                .unwrap()
                .bind([x.erase().into(), ErasedArg::constant("five".to_string())])
                .typed::<u64>()
                .unwrap();
            let e = expect_err(dag.compile(y.clone(), opts()), "String constant");
            let (node, message) = compile_error(e, p);
            assert_eq!(node, y.describe(), "[{p:?}]");
            assert!(
                message.contains("String") && message.contains("u64"),
                "[{p:?}] {message}"
            );
        }
        {
            // The wrong number of arguments.
            let dag = Dag::<u64>::new();
            let x = dag.input();
            let y = a
                .method("add")
                .unwrap()
                .bind([x.erase().into()])
                .typed::<u64>()
                .unwrap();
            let e = expect_err(dag.compile(y.clone(), opts()), "arity");
            let (node, message) = compile_error(e, p);
            assert_eq!(node, y.describe(), "[{p:?}]");
            assert!(
                message.contains('2') && message.contains('1'),
                "[{p:?}] {message}"
            );
        }
    });
}

// =======================================================================================
// Compile options and validation
// =======================================================================================

#[test]
fn compile_option_defaults() {
    let o = CompileOptions::default();
    assert_eq!(o.submit_timeout, Duration::from_secs(10));
    assert_eq!(o.get_timeout, Duration::from_secs(10));
    assert_eq!(o.buffer_size_bytes, 1_000_000);
    assert_eq!(o.max_inflight_executions, 10);
    assert_eq!(o.max_buffered_results, 1000);
    assert!(!o.enable_asyncio);
    assert!(!o.overlap_gpu_communication);
    assert!(matches!(
        o.default_communicator,
        adag::DefaultCommunicator::Create
    ));
    each_placement("compile_option_defaults", |p| {
        let rt = Runtime::new().unwrap();
        let a = worker(&rt, p, 0);
        let dag = Dag::<u64>::new();
        let o = CompileOptions::default()
            .max_inflight_executions(3)
            .max_buffered_results(4)
            .get_timeout(Duration::from_secs(7));
        let g = dag.compile(a.echo(dag.input()), o).unwrap();
        assert_eq!(g.options().max_inflight_executions, 3, "[{p:?}]");
        assert_eq!(g.options().max_buffered_results, 4, "[{p:?}]");
        assert_eq!(g.options().get_timeout, Duration::from_secs(7), "[{p:?}]");
        assert_eq!(
            g.options().submit_timeout,
            Duration::from_secs(10),
            "[{p:?}]"
        );
    });
}

#[test]
fn validation_no_input_used() {
    each_placement("validation_no_input_used", |p| {
        let rt = Runtime::new().unwrap();
        let a = worker(&rt, p, 0);
        {
            // dag.input() never called.
            let dag = Dag::<u64>::new();
            let y = a.echo(5u64);
            let (node, message) =
                compile_error(expect_err(dag.compile(y.clone(), opts()), "no input"), p);
            assert_eq!(node, y.describe(), "[{p:?}] {message}");
            assert!(message.contains("input"), "[{p:?}] {message}");
        }
        {
            // dag.input() called but never bound.
            let dag = Dag::<u64>::new();
            let _x = dag.input();
            let y = a.echo(5u64);
            let e = expect_err(dag.compile(y.clone(), opts()), "input unbound");
            let (node, message) = compile_error(e, p);
            assert!(
                node == y.describe() || node == "input",
                "[{p:?}] {node}: {message}"
            );
            assert!(message.contains("input"), "[{p:?}] {message}");
        }
        {
            // The output is the input itself.
            let dag = Dag::<u64>::new();
            let x = dag.input();
            let whole: Node<u64> = (*x).clone();
            let e = expect_err(dag.compile(whole, opts()), "output is the input");
            let (node, _message) = compile_error(e, p);
            assert_eq!(node, "input", "[{p:?}]");
        }
        assert_eq!(a.call().echo(3).unwrap(), 3, "[{p:?}] the actor stays free");
    });
}

#[test]
fn validation_output_not_depending_on_input() {
    each_placement("validation_output_not_depending_on_input", |p| {
        let rt = Runtime::new().unwrap();
        let a = worker(&rt, p, 0);
        let b = worker(&rt, p, 0);
        let c = worker(&rt, p, 0);
        let dag = Dag::<u64>::new();
        let x = dag.input();
        let y = a.echo(&x);
        let z = c.echo(b.echo(7u64));
        let e = expect_err(dag.compile((y, z), opts()), "constant-only output");
        let (node, message) = compile_error(e, p);
        assert!(node.contains(".echo#"), "[{p:?}] names a task: {node}");
        assert!(
            node.starts_with(b.name()),
            "[{p:?}] the constant-only task of b: {node}"
        );
        assert!(message.contains("input"), "[{p:?}] {message}");
    });
}

#[test]
fn validation_node_from_another_dag() {
    each_placement("validation_node_from_another_dag", |p| {
        let rt = Runtime::new().unwrap();
        let a = worker(&rt, p, 0);
        let b = worker(&rt, p, 0);
        let d1 = Dag::<u64>::new();
        let d2 = Dag::<u64>::new();
        let y1 = a.echo(d1.input());
        {
            let e = expect_err(d2.compile(y1.clone(), opts()), "node of d1 in d2");
            let (node, message) = compile_error(e, p);
            assert!(!node.is_empty(), "[{p:?}]");
            assert!(node == y1.describe() || node == "input", "[{p:?}] {node}");
            assert!(
                message.contains(&format!("#{}", d1.id())),
                "[{p:?}] {message}"
            );
        }
        {
            // A node mixing both graphs.
            let mixed = b.add(d1.input(), d2.input());
            let e = expect_err(d1.compile((y1.clone(), mixed.clone()), opts()), "mixed");
            let (node, message) = compile_error(e, p);
            assert!(
                node == mixed.describe() || node == "input",
                "[{p:?}] {node}"
            );
            assert!(
                message.contains(&format!("#{}", d2.id())),
                "[{p:?}] {message}"
            );
        }
        // Built properly, d1 compiles.
        let g = d1.compile(y1, opts()).unwrap();
        assert_eq!(g.execute(2).unwrap().get().unwrap(), 2, "[{p:?}]");
    });
}

#[test]
fn validation_actor_already_in_live_graph() {
    each_placement("validation_actor_already_in_live_graph", |p| {
        let rt = Runtime::new().unwrap();
        let a = worker(&rt, p, 1);
        let b = worker(&rt, p, 2);
        let d1 = Dag::<u64>::new();
        let g1 = d1.compile(a.echo(d1.input()), opts()).unwrap();
        let d2 = Dag::<u64>::new();
        let y2 = a.echo(b.echo(d2.input()));
        let e = expect_err(d2.compile(y2.clone(), opts()), "actor in a live graph");
        let (node, message) = compile_error(e, p);
        assert_eq!(node, y2.describe(), "[{p:?}]");
        assert!(
            message.contains(a.name()),
            "[{p:?}] names the actor: {message}"
        );
        assert!(
            message.contains(&format!("#{}", g1.id())),
            "[{p:?}] names the graph: {message}"
        );
        // The failed compile released b.
        assert_eq!(b.call().echo(0).unwrap(), 2, "[{p:?}] b is free");
        // g1 still works.
        assert_eq!(g1.execute(5).unwrap().get().unwrap(), 6, "[{p:?}]");
        g1.teardown().unwrap();
        let g2 = d2.compile(y2, opts()).unwrap();
        assert_eq!(g2.execute(5).unwrap().get().unwrap(), 8, "[{p:?}]");
    });
}

#[test]
fn validation_leaf_node() {
    each_placement("validation_leaf_node", |p| {
        let rt = Runtime::new().unwrap();
        let a = worker(&rt, p, 1);
        let b = worker(&rt, p, 2);
        let dag = Dag::<u64>::new();
        let x = dag.input();
        let y = a.echo(&x);
        let leaf = b.echo(&x);
        let e = expect_err(dag.compile(y.clone(), opts()), "leaf");
        let (node, message) = compile_error(e, p);
        assert_eq!(node, leaf.describe(), "[{p:?}] {message}");
        // Dropped, it no longer counts.
        drop(leaf);
        let g = dag.compile(y, opts()).unwrap();
        assert_eq!(g.execute(1).unwrap().get().unwrap(), 2, "[{p:?}]");
    });
}

#[test]
fn validation_unused_input_part() {
    each_placement("validation_unused_input_part", |p| {
        let rt = Runtime::new().unwrap();
        let a = worker(&rt, p, 1);
        let dag = Dag::<(u64, u64)>::new();
        let input = dag.input();
        let first = input.arg::<0>();
        let _second = input.arg::<1>();
        let y = a.echo(&first);
        let e = expect_err(dag.compile(y.clone(), opts()), "unused part");
        let (node, message) = compile_error(e, p);
        assert_eq!(node, "input[1]", "[{p:?}] {message}");
        drop(_second);
        let g = dag.compile(y, opts()).unwrap();
        assert_eq!(g.execute((4, 9)).unwrap().get().unwrap(), 5, "[{p:?}]");
    });
}

#[test]
fn validation_zero_inflight_rejected() {
    each_placement("validation_zero_inflight_rejected", |p| {
        let rt = Runtime::new().unwrap();
        let a = worker(&rt, p, 1);
        let dag = Dag::<u64>::new();
        let y = a.echo(dag.input());
        let e = expect_err(
            dag.compile(y.clone(), opts().max_inflight_executions(0)),
            "max_inflight 0",
        );
        // A typed configuration error naming the option (it was a compile error on node
        // "options").
        let message = e.to_string();
        assert!(
            matches!(
                e,
                Error::Config {
                    option: "max_inflight_executions",
                    ..
                }
            ),
            "[{p:?}] {e:?}"
        );
        assert!(
            message.contains("max_inflight_executions"),
            "[{p:?}] {message}"
        );
        let g = dag.compile(y, opts()).unwrap();
        assert_eq!(g.execute(1).unwrap().get().unwrap(), 2, "[{p:?}]");
    });
}

// =======================================================================================
// Execution
// =======================================================================================

#[test]
fn execute_get_and_get_timeout() {
    each_placement("execute_get_and_get_timeout", |p| {
        let rt = Runtime::new().unwrap();
        let a = worker(&rt, p, 3);
        let dag = Dag::<u64>::new();
        let g = dag.compile(a.echo(dag.input()), opts()).unwrap();
        let r0 = g.execute(1).unwrap();
        let r1 = g.execute(2).unwrap();
        assert_eq!((r0.execution(), r1.execution()), (0, 1), "[{p:?}]");
        assert_eq!(r0.get().unwrap(), 4, "[{p:?}]");
        assert_eq!(
            r1.get_timeout(Duration::from_secs(5)).unwrap(),
            5,
            "[{p:?}]"
        );
        // get_timeout claims the value: the ref yields it once.
        let e = expect_err(r1.get_timeout(Duration::from_secs(5)), "second get_timeout");
        assert!(
            matches!(
                e,
                Error::AlreadyClaimed {
                    execution: 1,
                    output: 0
                }
            ),
            "[{p:?}] {e:?}"
        );
    });
}

#[test]
fn get_all_and_tuple_refs() {
    each_placement("get_all_and_tuple_refs", |p| {
        let rt = Runtime::new().unwrap();
        let a = worker(&rt, p, 1);
        let b = worker(&rt, p, 2);
        {
            let dag = Dag::<u64>::new();
            let g = dag.compile(a.echo(dag.input()), opts()).unwrap();
            let refs: Vec<_> = (0..6).map(|i| g.execute(i).unwrap()).collect();
            assert_eq!(get_all(refs).unwrap(), vec![1, 2, 3, 4, 5, 6], "[{p:?}]");
            // A tuple of refs of different executions.
            let r0 = g.execute(10).unwrap();
            let r1 = g.execute(20).unwrap();
            assert_eq!(get_all((r1, r0)).unwrap(), (21, 11), "[{p:?}]");
        }
        let dag = Dag::<u64>::new();
        let x = dag.input();
        let g = dag.compile((a.echo(&x), b.pair(&x)), opts()).unwrap();
        let refs = g.execute(3).unwrap();
        let (v, (n, s)) = RefSet::get(refs).unwrap();
        assert_eq!((v, n, s.as_str()), (4, 5, "v3"), "[{p:?}]");
        let many: Vec<_> = (0..4).map(|i| g.execute(i).unwrap()).collect();
        let got = get_all(many).unwrap();
        for (i, (v, (n, s))) in got.into_iter().enumerate() {
            let i = i as u64;
            assert_eq!((v, n, s), (i + 1, i + 2, format!("v{i}")), "[{p:?}]");
        }
    });
}

#[test]
fn refs_claimed_out_of_order() {
    each_placement("refs_claimed_out_of_order", |p| {
        let rt = Runtime::new().unwrap();
        let a = worker(&rt, p, 1);
        let b = worker(&rt, p, 10);
        let dag = Dag::<u64>::new();
        let g = dag.compile(b.echo(a.echo(dag.input())), opts()).unwrap();
        let mut refs: Vec<Option<CompiledRef<u64>>> =
            (0..6).map(|i| Some(g.execute(i * 100).unwrap())).collect();
        for i in [3usize, 0, 5, 2, 1, 4] {
            let r = refs[i].take().unwrap();
            assert_eq!(r.get().unwrap(), i as u64 * 100 + 11, "[{p:?}] ref {i}");
        }
        // And the graph continues in order afterwards.
        for i in 0..5 {
            assert_eq!(g.execute(i).unwrap().get().unwrap(), i + 11, "[{p:?}]");
        }
    });
}

#[test]
fn max_buffered_results_exceeded() {
    each_placement("max_buffered_results_exceeded", |p| {
        let rt = Runtime::new().unwrap();
        let a = worker(&rt, p, 1);
        let dag = Dag::<u64>::new();
        let o = opts().max_buffered_results(2).max_inflight_executions(10);
        let g = dag.compile(a.echo(dag.input()), o).unwrap();
        let refs: Vec<_> = (0..5).map(|i| g.execute(i).unwrap()).collect();
        // Claiming ref 3 first must buffer results 0, 1, 2: one more than allowed.
        let e = expect_err(refs[3].get_timeout(Duration::from_secs(10)), "buffer full");
        assert!(
            matches!(
                e,
                Error::CapacityExceeded {
                    capacity: Capacity::BufferedResults,
                    limit: 2
                }
            ),
            "[{p:?}] {e:?}"
        );
        let mut refs = refs.into_iter();
        let (r0, r1, r2, r3, r4) = (
            refs.next().unwrap(),
            refs.next().unwrap(),
            refs.next().unwrap(),
            refs.next().unwrap(),
            refs.next().unwrap(),
        );
        // Claiming the buffered ones makes room; the refused ref is still valid.
        assert_eq!(r0.get().unwrap(), 1, "[{p:?}]");
        assert_eq!(r1.get().unwrap(), 2, "[{p:?}]");
        assert_eq!(r3.get().unwrap(), 4, "[{p:?}] the refused ref, again");
        assert_eq!(r2.get().unwrap(), 3, "[{p:?}]");
        assert_eq!(r4.get().unwrap(), 5, "[{p:?}]");
        for i in 10..15 {
            assert_eq!(g.execute(i).unwrap().get().unwrap(), i + 1, "[{p:?}]");
        }
    });
}

#[test]
fn max_inflight_exceeded_fails_at_once() {
    each_placement("max_inflight_exceeded_fails_at_once", |p| {
        let rt = Runtime::new().unwrap();
        let a = worker(&rt, p, 1);
        let dag = Dag::<u64>::new();
        let y = a.slow(dag.input(), 200u64);
        let g = dag.compile(y, opts().max_inflight_executions(2)).unwrap();
        let r0 = g.execute(0).unwrap();
        let r1 = g.execute(1).unwrap();
        let t = Instant::now();
        let e = expect_err(g.execute(2), "third execution");
        assert!(
            t.elapsed() < Duration::from_secs(1),
            "[{p:?}] refused at once, took {:?}",
            t.elapsed()
        );
        assert!(
            matches!(
                e,
                Error::CapacityExceeded {
                    capacity: Capacity::InflightExecutions,
                    limit: 2
                }
            ),
            "[{p:?}] {e:?}"
        );
        // Still refused while nothing was read.
        assert!(
            matches!(g.execute(2), Err(Error::CapacityExceeded { .. })),
            "[{p:?}]"
        );
        assert_eq!(r0.get().unwrap(), 1, "[{p:?}]");
        let r2 = g.execute(2).unwrap();
        assert_eq!(r1.get().unwrap(), 2, "[{p:?}]");
        assert_eq!(r2.get().unwrap(), 3, "[{p:?}]");
    });
}

#[test]
fn get_timeout_then_get_same_ref() {
    each_placement("get_timeout_then_get_same_ref", |p| {
        let rt = Runtime::new().unwrap();
        let a = worker(&rt, p, 1);
        let dag = Dag::<u64>::new();
        let g = dag.compile(a.slow(dag.input(), 1500u64), opts()).unwrap();
        let r = g.execute(41).unwrap();
        let t = Instant::now();
        let e = expect_err(r.get_timeout(Duration::from_millis(50)), "slow get_timeout");
        let waited = t.elapsed();
        assert!(matches!(e, Error::Timeout { .. }), "[{p:?}] {e:?}");
        assert!(
            waited >= Duration::from_millis(50),
            "[{p:?}] returned early: {waited:?}"
        );
        assert!(
            waited < Duration::from_millis(1200),
            "[{p:?}] returned late: {waited:?}"
        );
        assert_eq!(r.get().unwrap(), 42, "[{p:?}] the value after the timeout");
        // A later execution is not shifted by the timed-out one.
        assert_eq!(g.execute(1).unwrap().get().unwrap(), 2, "[{p:?}]");
    });
}

#[test]
fn clone_of_ref_claimed_twice() {
    each_placement("clone_of_ref_claimed_twice", |p| {
        let rt = Runtime::new().unwrap();
        let a = worker(&rt, p, 1);
        let dag = Dag::<u64>::new();
        let g = dag.compile(a.echo(dag.input()), opts()).unwrap();
        let _ = g.execute(0).unwrap().get().unwrap();
        let r = g.execute(5).unwrap();
        let r2 = r.clone();
        assert_eq!(r.get().unwrap(), 6, "[{p:?}]");
        let e = expect_err(r2.get(), "clone claimed twice");
        assert!(
            matches!(
                e,
                Error::AlreadyClaimed {
                    execution: 1,
                    output: 0
                }
            ),
            "[{p:?}] {e:?}"
        );
        // Clone claimed first, original second.
        let r = g.execute(7).unwrap();
        let r2 = r.clone();
        assert_eq!(r2.get().unwrap(), 8, "[{p:?}]");
        assert!(
            matches!(r.get(), Err(Error::AlreadyClaimed { execution: 2, .. })),
            "[{p:?}]"
        );
    });
}

#[test]
fn dropped_refs_free_their_slots() {
    each_placement("dropped_refs_free_their_slots", |p| {
        let rt = Runtime::new().unwrap();
        let a = worker(&rt, p, 1);
        let dag = Dag::<u64>::new();
        let g = dag
            .compile(a.echo(dag.input()), opts().max_inflight_executions(2))
            .unwrap();
        drop(g.execute(0).unwrap());
        drop(g.execute(1).unwrap());
        let r = g.execute(2).expect("a dropped ref frees its slot");
        assert_eq!(r.get().unwrap(), 3, "[{p:?}]");
        // Many rounds: the accounting does not drift.
        for round in 0..50u64 {
            drop(g.execute(round).unwrap());
            drop(g.execute(round + 1).unwrap());
            assert_eq!(
                g.execute(round * 7).unwrap().get().unwrap(),
                round * 7 + 1,
                "[{p:?}] round {round}"
            );
        }
        // Dropped after being read (buffered): its place is freed too.
        let r0 = g.execute(100).unwrap();
        let r1 = g.execute(101).unwrap();
        assert_eq!(r1.get().unwrap(), 102, "[{p:?}]");
        drop(r0);
        assert_eq!(g.execute(103).unwrap().get().unwrap(), 104, "[{p:?}]");
    });
}

#[test]
fn dropped_ref_of_multi_output_keeps_the_others() {
    each_placement("dropped_ref_of_multi_output_keeps_the_others", |p| {
        let rt = Runtime::new().unwrap();
        let a = worker(&rt, p, 1);
        let b = worker(&rt, p, 2);
        let dag = Dag::<u64>::new();
        let x = dag.input();
        let g = dag
            .compile((a.echo(&x), b.echo(&x)), opts().max_inflight_executions(2))
            .unwrap();
        for i in 0..20 {
            let (ra, rb) = g.execute(i).unwrap();
            if i % 2 == 0 {
                drop(ra);
                assert_eq!(rb.get().unwrap(), i + 2, "[{p:?}]");
            } else {
                drop(rb);
                assert_eq!(ra.get().unwrap(), i + 1, "[{p:?}]");
            }
        }
    });
}

#[test]
fn task_error_reported_and_downstream_skipped() {
    each_placement("task_error_reported_and_downstream_skipped", |p| {
        let rt = Runtime::new().unwrap();
        let w = named_worker(&rt, p, "checker", 0);
        let c = counter(&rt, p);
        let dag = Dag::<u64>::new();
        let checked = w.checked(dag.input());
        let g = dag
            .compile((checked.clone(), c.bump(&checked)), opts())
            .unwrap();
        assert_eq!(g.execute(1).unwrap().get().unwrap(), (1, 1), "[{p:?}]");
        let (r_checked, r_bump) = g.execute(3).unwrap();
        for (which, e) in [("checked", r_checked.get()), ("bump", r_bump.get())] {
            match e {
                Err(Error::Task {
                    actor,
                    method,
                    message,
                    ..
                }) => {
                    assert_eq!(actor, "checker", "[{p:?}] {which}");
                    assert_eq!(method, "checked", "[{p:?}] {which}");
                    assert!(
                        message.contains("bad input 3"),
                        "[{p:?}] {which}: {message}"
                    );
                }
                other => panic!("[{p:?}] {which}: expected Error::Task, got {other:?}"),
            }
        }
        // The downstream counter did not run for the failed execution.
        assert_eq!(g.execute(4).unwrap().get().unwrap(), (4, 2), "[{p:?}]");
        // Pipelined: an error between good executions.
        let refs: Vec<_> = [5u64, 13, 6]
            .iter()
            .map(|i| g.execute(*i).unwrap())
            .collect();
        let mut refs = refs.into_iter();
        assert_eq!(refs.next().unwrap().get().unwrap(), (5, 3), "[{p:?}]");
        assert!(
            matches!(RefSet::get(refs.next().unwrap()), Err(Error::Task { .. })),
            "[{p:?}]"
        );
        assert_eq!(refs.next().unwrap().get().unwrap(), (6, 4), "[{p:?}]");
        g.teardown().unwrap();
        assert_eq!(c.call().count().unwrap(), 4, "[{p:?}] bump skipped twice");
    });
}

#[test]
fn panic_reported_and_graph_continues() {
    each_placement("panic_reported_and_graph_continues", |p| {
        let rt = Runtime::new().unwrap();
        let w = named_worker(&rt, p, "bomber", 0);
        let c = counter(&rt, p);
        let dag = Dag::<u64>::new();
        let g = dag.compile(c.bump(w.boom(dag.input())), opts()).unwrap();
        assert_eq!(g.execute(1).unwrap().get().unwrap(), 1, "[{p:?}]");
        match g.execute(13).unwrap().get() {
            Err(Error::Task {
                actor,
                method,
                message,
                ..
            }) => {
                assert_eq!(actor, "bomber", "[{p:?}]");
                assert_eq!(method, "boom", "[{p:?}]");
                assert!(message.contains("boom at 13"), "[{p:?}] {message}");
            }
            other => panic!("[{p:?}] expected Error::Task, got {other:?}"),
        }
        assert_eq!(
            g.execute(2).unwrap().get().unwrap(),
            2,
            "[{p:?}] the actor survived"
        );
        g.teardown().unwrap();
        assert_eq!(c.call().count().unwrap(), 2, "[{p:?}]");
        assert_eq!(
            w.call().boom(5).unwrap(),
            5,
            "[{p:?}] the actor still answers"
        );
        // A panic in a one-off call is an error too, not a crash.
        assert!(
            matches!(w.call().boom(13), Err(Error::Task { .. })),
            "[{p:?}]"
        );
    });
}

#[test]
fn one_off_call_err_is_task_error() {
    each_placement("one_off_call_err_is_task_error", |p| {
        let rt = Runtime::new().unwrap();
        let w = named_worker(&rt, p, "solo", 0);
        assert_eq!(w.call().checked(4).unwrap(), 4, "[{p:?}]");
        match w.call().checked(23) {
            Err(Error::Task {
                actor,
                method,
                message,
                ..
            }) => {
                assert_eq!(
                    (actor.as_str(), method.as_str()),
                    ("solo", "checked"),
                    "[{p:?}]"
                );
                assert!(message.contains("bad input 23"), "[{p:?}] {message}");
            }
            other => panic!("[{p:?}] expected Error::Task, got {other:?}"),
        }
    });
}

// =======================================================================================
// Teardown
// =======================================================================================

#[test]
fn teardown_explicit_and_idempotent() {
    each_placement("teardown_explicit_and_idempotent", |p| {
        let rt = Runtime::new().unwrap();
        let a = worker(&rt, p, 1);
        let dag = Dag::<u64>::new();
        let g = dag.compile(a.echo(dag.input()), opts()).unwrap();
        assert_eq!(g.execute(1).unwrap().get().unwrap(), 2, "[{p:?}]");
        g.teardown().unwrap();
        g.teardown().expect("a second teardown is Ok");
        let e = expect_err(g.execute(2), "execute after teardown");
        assert!(matches!(e, Error::TornDown { .. }), "[{p:?}] {e:?}");
        // The actor is free again.
        assert_eq!(a.call().echo(5).unwrap(), 6, "[{p:?}]");
        drop(g); // and dropping it after teardown is harmless
        assert_eq!(a.call().calls().unwrap(), 2, "[{p:?}]");
    });
}

#[test]
fn teardown_on_drop_frees_actors() {
    each_placement("teardown_on_drop_frees_actors", |p| {
        let rt = Runtime::new().unwrap();
        let a = worker(&rt, p, 1);
        let b = worker(&rt, p, 10);
        {
            let dag = Dag::<u64>::new();
            let g = dag.compile(b.echo(a.echo(dag.input())), opts()).unwrap();
            assert_eq!(g.execute(1).unwrap().get().unwrap(), 12, "[{p:?}]");
            // Dropped with a result unclaimed.
            let _pending = g.execute(2).unwrap();
        }
        assert_eq!(
            a.call().echo(0).unwrap(),
            1,
            "[{p:?}] one-off call after drop"
        );
        // Both actors in a new graph, in the other order.
        let dag = Dag::<u64>::new();
        let g = dag.compile(a.echo(b.echo(dag.input())), opts()).unwrap();
        assert_eq!(g.execute(100).unwrap().get().unwrap(), 111, "[{p:?}]");
    });
}

#[test]
fn pending_get_after_teardown_is_an_error() {
    each_placement("pending_get_after_teardown_is_an_error", |p| {
        let rt = Runtime::new().unwrap();
        let a = worker(&rt, p, 1);
        let dag = Dag::<u64>::new();
        let g = dag.compile(a.slow(dag.input(), 300u64), opts()).unwrap();
        let r = g.execute(1).unwrap();
        g.teardown().unwrap();
        let e = expect_err(r.get(), "pending get after teardown");
        assert!(matches!(e, Error::TornDown { .. }), "[{p:?}] {e:?}");
    });
}

#[test]
fn teardown_wakes_a_blocked_get() {
    each_placement("teardown_wakes_a_blocked_get", |p| {
        let rt = Runtime::new().unwrap();
        let a = worker(&rt, p, 1);
        let dag = Dag::<u64>::new();
        let g = dag.compile(a.slow(dag.input(), 3000u64), opts()).unwrap();
        let r = g.execute(1).unwrap();
        let getter = std::thread::spawn(move || {
            let res = r.get_timeout(Duration::from_secs(30));
            (res, Instant::now())
        });
        std::thread::sleep(Duration::from_millis(200));
        let start = Instant::now();
        let _ = g.teardown(); // waits for the slow method; the getter must not
        let (res, woke) = getter.join().unwrap();
        let e = expect_err(res, "blocked get at teardown");
        assert!(matches!(e, Error::TornDown { .. }), "[{p:?}] {e:?}");
        let after = woke.saturating_duration_since(start);
        assert!(
            after < Duration::from_millis(1500),
            "[{p:?}] woken {after:?} after teardown began"
        );
    });
}

// =======================================================================================
// Observability
// =======================================================================================

#[test]
fn visualize_names_every_node() {
    each_placement("visualize_names_every_node", |p| {
        let rt = Runtime::new().unwrap();
        let a = worker(&rt, p, 1);
        let b = worker(&rt, p, 2);
        let c = worker(&rt, p, 3);
        let dag = Dag::<(u64, u64)>::new();
        let input = dag.input();
        let x0 = input.arg::<0>();
        let x1 = input.arg::<1>();
        let pair = a.pair(&x0);
        let (n, s) = pair.split();
        let sum = b.add(&n, &x1);
        let len = c.strlen(&s);
        let g = dag.compile((sum.clone(), len.clone()), opts()).unwrap();
        let dot = g.visualize();
        assert!(dot.contains("digraph"), "[{p:?}] {dot}");
        for name in [
            x0.describe(),
            x1.describe(),
            pair.describe(),
            n.describe(),
            s.describe(),
            sum.describe(),
            len.describe(),
        ] {
            assert!(dot.contains(&name), "[{p:?}] DOT lacks {name}:\n{dot}");
        }
        assert_eq!(
            g.execute((5, 100)).unwrap().get().unwrap(),
            (108, 2),
            "[{p:?}]"
        );
    });
}

// =======================================================================================
// One-off calls
// =======================================================================================

#[test]
fn one_off_calls_before_during_after_graph() {
    each_placement("one_off_calls_before_during_after_graph", |p| {
        let rt = Runtime::new().unwrap();
        let a = worker(&rt, p, 1);
        let c = counter(&rt, p);
        assert_eq!(a.call().add(1, 2).unwrap(), 4, "[{p:?}] before");
        assert_eq!(c.call().count().unwrap(), 0, "[{p:?}]");
        let dag = Dag::<u64>::new();
        let g = dag.compile(c.bump(a.echo(dag.input())), opts()).unwrap();
        for i in 0..5 {
            assert_eq!(g.execute(i).unwrap().get().unwrap(), i + 1, "[{p:?}]");
        }
        // Served between two executions (Ray serves them too: its graph loop runs in a
        // concurrency group of its own).
        assert_eq!(a.call().add(1, 2).unwrap(), 4, "[{p:?}] during the graph");
        assert_eq!(c.call().count().unwrap(), 5, "[{p:?}] during the graph");
        // The graph is unharmed by the calls.
        assert_eq!(g.execute(9).unwrap().get().unwrap(), 6, "[{p:?}]");
        g.teardown().unwrap();
        assert_eq!(a.call().add(1, 2).unwrap(), 4, "[{p:?}] after");
        assert_eq!(
            a.call().calls().unwrap(),
            1 + 5 + 1 + 1 + 1,
            "[{p:?}] state kept across the graph"
        );
        assert_eq!(c.call().count().unwrap(), 6, "[{p:?}]");
    });
}

// =======================================================================================
// Many executions
// =======================================================================================

#[test]
fn ten_thousand_pipelined_executions() {
    each_placement("ten_thousand_pipelined_executions", |p| {
        const N: u64 = 10_000;
        const INFLIGHT: usize = 8;
        let rt = Runtime::new().unwrap();
        let a = worker(&rt, p, 1);
        let b = worker(&rt, p, 10);
        let c = worker(&rt, p, 100);
        let dag = Dag::<u64>::new();
        let g = dag
            .compile(
                c.echo(b.echo(a.echo(dag.input()))),
                opts().max_inflight_executions(INFLIGHT),
            )
            .unwrap();
        let mut pending: VecDeque<(u64, CompiledRef<u64>)> = VecDeque::new();
        let mut next = 0u64;
        let mut checked = 0u64;
        while checked < N {
            if next < N {
                match g.execute(next * 3) {
                    Ok(r) => {
                        pending.push_back((next, r));
                        next += 1;
                        continue;
                    }
                    Err(Error::CapacityExceeded {
                        capacity: Capacity::InflightExecutions,
                        ..
                    }) => {
                        assert_eq!(
                            pending.len(),
                            INFLIGHT,
                            "[{p:?}] full at exactly max_inflight"
                        );
                    }
                    Err(e) => panic!("[{p:?}] execute {next}: {e}"),
                }
            }
            let (i, r) = pending.pop_front().unwrap();
            assert_eq!(r.execution(), i, "[{p:?}]");
            assert_eq!(r.get().unwrap(), i * 3 + 111, "[{p:?}] execution {i}");
            checked += 1;
        }
        assert!(pending.is_empty());
        g.teardown().unwrap();
        assert_eq!(
            b.call().calls().unwrap(),
            N,
            "[{p:?}] every execution ran once"
        );
    });
}

// =======================================================================================
// More shapes and edge cases
// =======================================================================================

#[test]
fn same_actor_reads_one_node_twice_and_outputs_its_own_intermediates() {
    each_placement(
        "same_actor_reads_one_node_twice_and_outputs_its_own_intermediates",
        |p| {
            let rt = Runtime::new().unwrap();
            let a = worker(&rt, p, 1);
            let b = worker(&rt, p, 10);
            let dag = Dag::<u64>::new();
            let x = dag.input();
            let y = b.echo(&x);
            let e1 = a.echo(&y); // y read by two tasks of a, and twice by one
            let e2 = a.add(&y, &y);
            let inner = a.echo(&x);
            let outer = a.echo(&inner); // a's own result, also an output
            let (n, s) = a.pair(&x).split();
            let n2 = a.echo(&n); // a split element consumed by its own actor
            let g = dag.compile((e1, e2, inner, outer, n2, s), opts()).unwrap();
            for i in 0..10u64 {
                let got = g.execute(i).unwrap().get().unwrap();
                let want = (
                    i + 11,
                    2 * (i + 10) + 1,
                    i + 1,
                    i + 2,
                    i + 2,
                    format!("v{i}"),
                );
                assert_eq!(got, want, "[{p:?}] execution {i}");
            }
        },
    );
}

#[test]
fn error_propagates_through_chain_and_fan_in() {
    each_placement("error_propagates_through_chain_and_fan_in", |p| {
        let rt = Runtime::new().unwrap();
        let w = named_worker(&rt, p, "check", 0);
        let b = named_worker(&rt, p, "side", 5);
        let mid = named_worker(&rt, p, "mid", 100);
        let c = counter(&rt, p);
        let dag = Dag::<u64>::new();
        let x = dag.input();
        // fan-in of a failing and a good branch, then a chain of two more tasks.
        let joined = mid.combine(w.checked(&x), b.echo(&x));
        let out = c.bump(mid.echo(&joined));
        let g = dag.compile((joined, out), opts()).unwrap();
        assert_eq!(g.execute(1).unwrap().get().unwrap(), (1006, 1), "[{p:?}]");
        let (rj, ro) = g.execute(33).unwrap();
        for (which, r) in [("joined", rj.get()), ("out", ro.get())] {
            match r {
                Err(Error::Task {
                    actor,
                    method,
                    message,
                    ..
                }) => {
                    assert_eq!(
                        (actor.as_str(), method.as_str()),
                        ("check", "checked"),
                        "[{p:?}] {which}"
                    );
                    assert!(
                        message.contains("bad input 33"),
                        "[{p:?}] {which}: {message}"
                    );
                }
                other => panic!(
                    "[{p:?}] {which}: expected the task error of check.checked, got {other:?}"
                ),
            }
        }
        assert_eq!(g.execute(2).unwrap().get().unwrap(), (2007, 2), "[{p:?}]");
        g.teardown().unwrap();
        // mid.combine and mid.echo were skipped for the failed execution: 2 + 2 calls.
        assert_eq!(mid.call().calls().unwrap(), 4, "[{p:?}]");
        assert_eq!(
            b.call().calls().unwrap(),
            3,
            "[{p:?}] the good branch ran every time"
        );
    });
}

#[test]
fn get_past_default_timeout_then_next_execution() {
    each_placement("get_past_default_timeout_then_next_execution", |p| {
        let rt = Runtime::new().unwrap();
        let a = worker(&rt, p, 1);
        let dag = Dag::<u64>::new();
        let x = dag.input();
        let g = dag
            .compile(
                a.slow(&x, 1200u64),
                opts().get_timeout(Duration::from_millis(50)),
            )
            .unwrap();
        let t = Instant::now();
        let e = expect_err(g.execute(1).unwrap().get(), "get past get_timeout");
        assert!(matches!(e, Error::Timeout { .. }), "[{p:?}] {e:?}");
        assert!(
            t.elapsed() < Duration::from_millis(1000),
            "[{p:?}] {:?}",
            t.elapsed()
        );
        // The abandoned result must not be handed to the next execution's ref.
        let r = g.execute(2).unwrap();
        assert_eq!(
            r.get_timeout(Duration::from_secs(10)).unwrap(),
            3,
            "[{p:?}]"
        );
    });
}

#[test]
fn get_timeout_zero_and_unbounded() {
    each_placement("get_timeout_zero_and_unbounded", |p| {
        let rt = Runtime::new().unwrap();
        let a = worker(&rt, p, 1);
        let dag = Dag::<u64>::new();
        let g = dag.compile(a.echo(dag.input()), opts()).unwrap();
        let r = g.execute(1).unwrap();
        assert_eq!(
            r.get_timeout(Duration::MAX).unwrap(),
            2,
            "[{p:?}] no deadline"
        );
        let r = g.execute(2).unwrap();
        std::thread::sleep(Duration::from_millis(200));
        // The result is ready: a zero timeout returns it rather than timing out.
        assert_eq!(
            r.get_timeout(Duration::ZERO).unwrap(),
            3,
            "[{p:?}] zero timeout on a ready value"
        );
    });
}

#[test]
fn timeout_part_way_through_a_multi_output_execution() {
    each_placement("timeout_part_way_through_a_multi_output_execution", |p| {
        let rt = Runtime::new().unwrap();
        let a = worker(&rt, p, 1);
        let b = worker(&rt, p, 2);
        let dag = Dag::<u64>::new();
        let x = dag.input();
        let g = dag
            .compile((a.echo(&x), b.slow(&x, 400u64), a.echo(&x)), opts())
            .unwrap();
        let (fast, slow, fast2) = g.execute(10).unwrap();
        let e = expect_err(slow.get_timeout(Duration::from_millis(50)), "slow output");
        assert!(matches!(e, Error::Timeout { .. }), "[{p:?}] {e:?}");
        assert_eq!(
            fast.get().unwrap(),
            11,
            "[{p:?}] output read before the timeout"
        );
        assert_eq!(slow.get().unwrap(), 12, "[{p:?}]");
        assert_eq!(fast2.get().unwrap(), 11, "[{p:?}]");
        let (f, s, f2) = g.execute(20).unwrap().get().unwrap();
        assert_eq!((f, s, f2), (21, 22, 21), "[{p:?}] next execution in step");
    });
}

#[test]
fn dag_compiled_again_after_teardown() {
    each_placement("dag_compiled_again_after_teardown", |p| {
        let rt = Runtime::new().unwrap();
        let a = worker(&rt, p, 1);
        let b = worker(&rt, p, 2);
        let dag = Dag::<u64>::new();
        let y = b.echo(a.echo(dag.input()));
        for round in 0..3u64 {
            let g = dag.compile(y.clone(), opts()).unwrap();
            // Every compile starts again at execution 0 and with the actors' state kept.
            let r = g.execute(round).unwrap();
            assert_eq!(r.execution(), 0, "[{p:?}]");
            assert_eq!(r.get().unwrap(), round + 3, "[{p:?}] round {round}");
            let e = expect_err(dag.compile(y.clone(), opts()), "second live compile");
            assert!(matches!(e, Error::Compile { .. }), "[{p:?}] {e:?}");
            g.teardown().unwrap();
        }
        assert_eq!(a.call().calls().unwrap(), 3, "[{p:?}]");
    });
}

#[test]
fn failing_constructor_is_spawn_error() {
    each_placement("failing_constructor_is_spawn_error", |p| {
        let rt = Runtime::new().unwrap();
        match rt.spawn_named::<Picky>(p, "picky", 0) {
            Err(Error::Spawn { actor, message }) => {
                assert_eq!(actor, "picky", "[{p:?}]");
                assert!(!message.is_empty(), "[{p:?}]");
            }
            Err(other) => panic!("[{p:?}] expected Error::Spawn, got {other:?}"),
            Ok(_) => panic!("[{p:?}] expected Error::Spawn, got an actor"),
        }
        let ok = rt.spawn::<Picky>(p, 4).unwrap();
        assert_eq!(ok.call().value().unwrap(), 4, "[{p:?}]");
    });
}

#[test]

fn failing_constructor_message_reaches_the_driver() {
    each_placement("failing_constructor_message_reaches_the_driver", |p| {
        let rt = Runtime::new().unwrap();
        // Repeated: the process race loses the message in a few percent of spawns.
        for round in 0..40 {
            match rt.spawn_named::<Picky>(p, "picky", 0) {
                Err(Error::Spawn { actor, message }) => {
                    assert_eq!(actor, "picky", "[{p:?}]");
                    assert!(
                        message.contains("zero is not allowed"),
                        "[{p:?}] round {round}: the constructor's error is lost: {message}"
                    );
                }
                Err(other) => panic!("[{p:?}] expected Error::Spawn, got {other:?}"),
                Ok(_) => panic!("[{p:?}] expected Error::Spawn, got an actor"),
            }
        }
    });
}

#[test]
fn killed_worker_fails_pending_and_later_calls() {
    each_placement("killed_worker_fails_pending_and_later_calls", |p| {
        let rt = Runtime::new().unwrap();
        let a = named_worker(&rt, p, "victim", 1);
        let b = worker(&rt, p, 10);
        if p == Placement::Thread {
            assert!(a.kill().is_err(), "[{p:?}] a thread actor cannot be killed");
            assert_eq!(a.pid(), None, "[{p:?}]");
            return;
        }
        let pid = a.pid().expect("a process actor has a pid");
        let dag = Dag::<u64>::new();
        let g = dag
            .compile(b.echo(a.slow(dag.input(), 3000u64)), opts())
            .unwrap();
        let r = g.execute(1).unwrap();
        std::thread::sleep(Duration::from_millis(100));
        let t = Instant::now();
        a.kill().unwrap();
        let e = expect_err(r.get(), "pending get of a killed actor");
        assert!(
            t.elapsed() < Duration::from_secs(1),
            "[{p:?}] detected after {:?}",
            t.elapsed()
        );
        match &e {
            Error::ActorDied { actor, .. } => assert_eq!(actor, "victim", "[{p:?}]"),
            other => panic!("[{p:?}] expected ActorDied, got {other:?}"),
        }
        let e = expect_err(g.execute(2), "execute after the death");
        assert!(matches!(e, Error::ActorDied { .. }), "[{p:?}] {e:?}");
        assert!(
            a.call().echo(1).is_err(),
            "[{p:?}] a dead actor answers no call"
        );
        // Reaped at once: no zombie left.
        let stat = format!("/proc/{pid}/stat");
        let deadline = Instant::now() + Duration::from_secs(2);
        loop {
            match std::fs::read_to_string(&stat) {
                Err(_) => break,
                Ok(s) if Instant::now() > deadline => {
                    panic!("[{p:?}] worker {pid} not reaped: {s}")
                }
                Ok(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        }
        g.teardown().expect("teardown after a death is Ok");
        // The surviving actor is released by the teardown the death started: soon, if not at
        // once (that teardown() does not wait for it is the ignored
        // `teardown_after_death_waits_for_the_release`).
        let t = Instant::now();
        while matches!(b.call().echo(1), Err(Error::ActorBusy { .. }))
            && t.elapsed() < Duration::from_secs(5)
        {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(
            b.call().echo(1).unwrap(),
            11,
            "[{p:?}] the other actor is free"
        );
    });
}

#[test]

fn teardown_after_death_waits_for_the_release() {
    each_placement("teardown_after_death_waits_for_the_release", |p| {
        if p != Placement::Process {
            return; // only worker processes die
        }
        let rt = Runtime::new().unwrap();
        for round in 0..5 {
            let a = named_worker(&rt, p, "victim", 1);
            let b = named_worker(&rt, p, "survivor", 10);
            let dag = Dag::<u64>::new();
            let g = dag
                .compile(b.echo(a.slow(dag.input(), 3000u64)), opts())
                .unwrap();
            let r = g.execute(1).unwrap();
            a.kill().unwrap();
            assert!(matches!(r.get(), Err(Error::ActorDied { .. })), "[{p:?}]");
            g.teardown().unwrap();
            // teardown() has returned: the graph's actors must be free now.
            match b.call().echo(1) {
                Ok(v) => assert_eq!(v, 11, "[{p:?}]"),
                Err(e) => panic!("[{p:?}] round {round}: after teardown() returned Ok: {e}"),
            }
        }
    });
}

#[test]
fn sync_execute_on_async_graph_is_wrong_mode() {
    each_placement("sync_execute_on_async_graph_is_wrong_mode", |p| {
        let rt = Runtime::new().unwrap();
        let a = worker(&rt, p, 1);
        let dag = Dag::<u64>::new();
        let g = dag
            .compile(a.echo(dag.input()), opts().enable_asyncio(true))
            .unwrap();
        let e = expect_err(g.execute(1), "execute on an async graph");
        assert!(matches!(e, Error::WrongMode { .. }), "[{p:?}] {e:?}");
    });
}

type DigestRefs = (CompiledRef<(u64, u64)>, CompiledRef<Vec<u8>>);

#[test]
fn messages_larger_than_a_slot_grow_the_channel() {
    each_placement("messages_larger_than_a_slot_grow_the_channel", |p| {
        let rt = Runtime::new().unwrap();
        let a = worker(&rt, p, 3);
        let b = worker(&rt, p, 0);
        let dag = Dag::<u64>::new();
        let bytes = a.fill(dag.input());
        let g = dag
            .compile(
                (b.digest(&bytes), bytes),
                opts().buffer_size_bytes(1024).max_inflight_executions(4),
            )
            .unwrap();
        // Growing sizes, pipelined: nothing lost or reordered across the growth.
        let sizes = [10u64, 1000, 1024, 5000, 100_000, 7, 300_000, 2000];
        let mut pending = VecDeque::new();
        for n in sizes {
            if pending.len() == 4 {
                let (n, r): (u64, DigestRefs) = pending.pop_front().unwrap();
                let (d, v) = r.get().unwrap();
                assert_eq!(d, fill_digest(n, 3), "[{p:?}] size {n}");
                assert_eq!(v.len() as u64, n, "[{p:?}] size {n}");
            }
            pending.push_back((n, g.execute(n).unwrap()));
        }
        for (n, r) in pending {
            let (d, v) = r.get().unwrap();
            assert_eq!(d, fill_digest(n, 3), "[{p:?}] size {n}");
            assert_eq!(
                v.iter().map(|b| *b as u64).sum::<u64>(),
                d.1,
                "[{p:?}] size {n}"
            );
        }
    });
}

#[test]
fn message_over_the_ceiling_is_a_clear_error() {
    each_placement("message_over_the_ceiling_is_a_clear_error", |p| {
        if p == Placement::Thread {
            return; // values move between threads without encoding: no ceiling applies
        }
        let rt = Runtime::new().unwrap();
        let a = worker(&rt, p, 0);
        let b = worker(&rt, p, 0);
        let dag = Dag::<u64>::new();
        let g = dag
            .compile(
                b.digest(a.fill(dag.input())),
                opts().buffer_size_bytes(1024).max_message_bytes(64 * 1024),
            )
            .unwrap();
        assert_eq!(
            g.execute(1000).unwrap().get().unwrap(),
            fill_digest(1000, 0),
            "[{p:?}]"
        );
        let e = expect_err(g.execute(200_000).and_then(|r| r.get()), "over the ceiling");
        // Either the typed error or the producing task's error naming the ceiling.
        match &e {
            Error::MessageTooLarge { size, limit, .. } => {
                assert_eq!(*limit, 64 * 1024, "[{p:?}]");
                assert!(*size > 200_000, "[{p:?}] {size}");
            }
            Error::Task {
                method, message, ..
            } => {
                assert_eq!(method, "fill", "[{p:?}]");
                assert!(
                    message.contains("ceiling") && message.contains("65536"),
                    "[{p:?}] {message}"
                );
            }
            other => panic!("[{p:?}] expected MessageTooLarge, got {other:?}"),
        }
        // The graph keeps working for messages under the ceiling.
        assert_eq!(
            g.execute(2000).unwrap().get().unwrap(),
            fill_digest(2000, 0),
            "[{p:?}]"
        );
    });
}

#[test]
fn mixed_placements_in_one_graph() {
    with_watchdog("mixed_placements_in_one_graph", WATCHDOG_SECS, || {
        if !placements().contains(&Placement::Process) {
            return;
        }
        let rt = Runtime::new().unwrap();
        let t1 = worker(&rt, Placement::Thread, 1);
        let p1 = worker(&rt, Placement::Process, 10);
        let t2 = worker(&rt, Placement::Thread, 100);
        let p2 = worker(&rt, Placement::Process, 1000);
        let dag = Dag::<u64>::new();
        let x = dag.input();
        let a = t1.echo(&x);
        let b = p1.echo(&a); // thread -> process
        // Fan-out of a process node to a thread, another process and the driver.
        let c = t2.echo(&b);
        let d = p2.echo(&b);
        let e = t1.combine(&c, &d); // fan-in back on the first thread actor
        let g = dag.compile((b, e), opts()).unwrap();
        for i in 0..200u64 {
            let (b, e) = g.execute(i).unwrap().get().unwrap();
            assert_eq!(b, i + 11, "process node read by the driver");
            assert_eq!(e, 1000 * (i + 111) + (i + 1011), "mixed diamond");
        }
    });
}

#[test]
fn error_of_a_split_source_reaches_every_element() {
    each_placement("error_of_a_split_source_reaches_every_element", |p| {
        let rt = Runtime::new().unwrap();
        let w = named_worker(&rt, p, "splitter", 1);
        let b = worker(&rt, p, 10);
        let c = worker(&rt, p, 0);
        let dag = Dag::<u64>::new();
        let (n, s) = w.try_pair(dag.input()).split();
        let g = dag.compile((b.echo(&n), c.strlen(&s)), opts()).unwrap();
        assert_eq!(g.execute(5).unwrap().get().unwrap(), (16, 2), "[{p:?}]");
        let (rn, rs) = g.execute(23).unwrap();
        for (which, r) in [("n", rn.get()), ("s", rs.get())] {
            match r {
                Err(Error::Task {
                    actor,
                    method,
                    message,
                    ..
                }) => {
                    assert_eq!(
                        (actor.as_str(), method.as_str()),
                        ("splitter", "try_pair"),
                        "[{p:?}] {which}"
                    );
                    assert!(
                        message.contains("bad pair 23"),
                        "[{p:?}] {which}: {message}"
                    );
                }
                other => panic!("[{p:?}] {which}: expected Error::Task, got {other:?}"),
            }
        }
        assert_eq!(g.execute(100).unwrap().get().unwrap(), (111, 4), "[{p:?}]");
    });
}

#[test]
fn ref_outliving_its_dropped_graph() {
    each_placement("ref_outliving_its_dropped_graph", |p| {
        let rt = Runtime::new().unwrap();
        let a = worker(&rt, p, 1);
        let dag = Dag::<u64>::new();
        let g = dag.compile(a.echo(dag.input()), opts()).unwrap();
        let r = g.execute(1).unwrap();
        drop(g);
        let e = expect_err(r.get(), "ref of a dropped graph");
        assert!(matches!(e, Error::TornDown { .. }), "[{p:?}] {e:?}");
        assert_eq!(a.call().echo(1).unwrap(), 2, "[{p:?}]");
    });
}

#[test]
fn timeout_on_a_later_ref_while_an_earlier_one_is_slow() {
    each_placement("timeout_on_a_later_ref_while_an_earlier_one_is_slow", |p| {
        let rt = Runtime::new().unwrap();
        let a = worker(&rt, p, 1);
        let dag = Dag::<(u64, u64)>::new();
        let input = dag.input();
        let g = dag
            .compile(a.slow(input.arg::<0>(), input.arg::<1>()), opts())
            .unwrap();
        let r0 = g.execute((0, 400)).unwrap();
        let r1 = g.execute((1, 0)).unwrap();
        let e = expect_err(r1.get_timeout(Duration::from_millis(50)), "later ref");
        assert!(matches!(e, Error::Timeout { .. }), "[{p:?}] {e:?}");
        assert_eq!(r1.get().unwrap(), 2, "[{p:?}]");
        assert_eq!(r0.get().unwrap(), 1, "[{p:?}]");
        assert_eq!(g.execute((5, 0)).unwrap().get().unwrap(), 6, "[{p:?}]");
    });
}

#[test]
fn execute_and_get_from_several_threads() {
    each_placement("execute_and_get_from_several_threads", |p| {
        let rt = Runtime::new().unwrap();
        let a = worker(&rt, p, 1);
        let b = worker(&rt, p, 10);
        let dag = Dag::<u64>::new();
        let g = std::sync::Arc::new(dag.compile(b.echo(a.echo(dag.input())), opts()).unwrap());
        let threads: Vec<_> = (0..4u64)
            .map(|t| {
                let g = g.clone();
                std::thread::spawn(move || {
                    for i in 0..300u64 {
                        let x = t * 1_000_000 + i;
                        let v = g.execute(x).unwrap().get().unwrap();
                        assert_eq!(v, x + 11, "thread {t} execution {i}");
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap_or_else(|e| std::panic::resume_unwind(e));
        }
        assert_eq!(g.execute(7).unwrap().get().unwrap(), 18, "[{p:?}]");
    });
}

#[test]

fn execute_is_not_blocked_by_a_get_on_another_thread() {
    each_placement("execute_is_not_blocked_by_a_get_on_another_thread", |p| {
        let rt = Runtime::new().unwrap();
        let a = worker(&rt, p, 1);
        let dag = Dag::<(u64, u64)>::new();
        let input = dag.input();
        let g = std::sync::Arc::new(
            dag.compile(
                a.slow(input.arg::<0>(), input.arg::<1>()),
                opts().submit_timeout(Duration::from_millis(100)),
            )
            .unwrap(),
        );
        let r0 = g.execute((0, 1500)).unwrap();
        let getter = std::thread::spawn(move || r0.get());
        std::thread::sleep(Duration::from_millis(100));
        let t = Instant::now();
        let r1 = g.execute((1, 0));
        let took = t.elapsed();
        assert!(
            took < Duration::from_millis(600),
            "[{p:?}] execute took {took:?} with submit_timeout 100 ms, while another thread waited in get"
        );
        assert_eq!(getter.join().unwrap().unwrap(), 1, "[{p:?}]");
        assert_eq!(r1.unwrap().get().unwrap(), 2, "[{p:?}]");
    });
}

// =======================================================================================
// Issue 12: options, compile errors, small ones, error fidelity
// =======================================================================================

fn tokio_rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime")
}

/// Every option out of its documented range is an `Error::Config` naming the option, the
/// value and the range, in sync and async graphs; nothing is claimed, so the actor stays free.
/// The edge values that have a meaning are accepted and the graph works with them (an async
/// graph with one buffered result delivers every result).
#[test]
fn compile_options_out_of_range_are_config_errors() {
    each_placement("compile_options_out_of_range_are_config_errors", |p| {
        let rt = Runtime::new().unwrap();
        let a = worker(&rt, p, 1);
        let bad: Vec<(CompileOptions, &str, &str)> = vec![
            (opts().buffer_size_bytes(0), "buffer_size_bytes", "0"),
            (opts().max_buffered_results(0), "max_buffered_results", "0"),
            (
                opts().max_inflight_executions(0),
                "max_inflight_executions",
                "0",
            ),
            (
                opts().max_inflight_executions(1 << 20),
                "max_inflight_executions",
                "1048576",
            ),
            (opts().max_message_bytes(0), "max_message_bytes", "0"),
            (
                opts().buffer_size_bytes(4096).max_message_bytes(1024),
                "buffer_size_bytes",
                "4096",
            ),
            (opts().spin(Duration::from_secs(5)), "spin", "5s"),
            (
                opts().teardown_timeout(Duration::MAX),
                "teardown_timeout",
                "teardown_timeout",
            ),
        ];
        for asyncio in [false, true] {
            for (o, option, value) in &bad {
                let dag = Dag::<u64>::new();
                let y = a.echo(dag.input());
                let e = expect_err(
                    dag.compile(y, o.clone().enable_asyncio(asyncio)),
                    &format!("[{p:?}] {option} out of range (async {asyncio})"),
                );
                let text = e.to_string();
                match &e {
                    Error::Config {
                        option: got,
                        value: v,
                        allowed,
                    } => {
                        assert_eq!(got, option, "[{p:?}] {text}");
                        assert!(
                            text.contains(option) && text.contains(value),
                            "[{p:?}] names the option and the value: {text}"
                        );
                        assert!(
                            !allowed.is_empty() && text.contains(allowed.as_str()),
                            "{v}"
                        );
                        assert!(
                            text.contains(&format!("CompileOptions::{option}(")),
                            "[{p:?}] says how to fix it: {text}"
                        );
                    }
                    other => panic!("[{p:?}] expected Error::Config for {option}, got {other:?}"),
                }
            }
        }
        assert_eq!(a.call().echo(3).unwrap(), 4, "[{p:?}] the actor stays free");

        // Edge values with a meaning are accepted.
        let edge = opts()
            .buffer_size_bytes(1)
            .max_buffered_results(1)
            .max_inflight_executions(1)
            .submit_timeout(Duration::ZERO)
            .get_timeout(Duration::MAX)
            .spin(Duration::ZERO);
        // A zero teardown timeout is accepted (teardown then waits for no loop: it may report
        // a loop that had not stopped yet, and kill a worker still running, so its result is
        // not asserted, and an actor of its own is used).
        let z = worker(&rt, p, 1);
        let dag = Dag::<u64>::new();
        let zero = dag
            .compile(
                z.echo(dag.input()),
                edge.clone().teardown_timeout(Duration::ZERO),
            )
            .unwrap();
        assert_eq!(zero.execute(1).unwrap().get().unwrap(), 2, "[{p:?}]");
        let _ = zero.teardown();
        drop(zero);
        let dag = Dag::<u64>::new();
        let g = dag.compile(a.echo(dag.input()), edge.clone()).unwrap();
        for i in 0..5u64 {
            assert_eq!(g.execute(i).unwrap().get().unwrap(), i + 1, "[{p:?}]");
        }
        g.teardown().unwrap();
        // Async with one buffered result: every result is delivered (it used to hang with 0).
        let dag = Dag::<u64>::new();
        let g = dag
            .compile(
                a.echo(dag.input()),
                edge.max_inflight_executions(4).enable_asyncio(true),
            )
            .unwrap();
        let got = tokio_rt().block_on(async {
            let mut futs = Vec::new();
            for i in 0..4u64 {
                futs.push(g.execute_async(i).await.unwrap());
            }
            let mut got = Vec::new();
            for f in futs {
                got.push(f.await.unwrap());
            }
            got
        });
        assert_eq!(got, vec![1, 2, 3, 4], "[{p:?}]");
    });
}

/// A graph with several problems reports all of them in one error, each with the node's
/// full label; the Display lists each.
#[test]
fn compile_error_lists_every_problem() {
    each_placement("compile_error_lists_every_problem", |p| {
        let rt = Runtime::new().unwrap();
        let a = worker(&rt, p, 1);
        let b = worker(&rt, p, 2);
        let c = worker(&rt, p, 3);
        let dag = Dag::<(u64, u64)>::new();
        let input = dag.input();
        let first = input.arg::<0>();
        let second = input.arg::<1>();
        let y = a.echo(&first);
        let leaf1 = b.echo(&first);
        let leaf2 = c.echo(&first);
        let e = expect_err(dag.compile(y.clone(), opts()), "three problems");
        let text = e.to_string();
        let problems = e.compile_problems().to_vec();
        let nodes: Vec<&str> = problems.iter().map(|q| q.node.as_str()).collect();
        assert_eq!(
            nodes,
            vec![
                second.describe().as_str(),
                leaf1.describe().as_str(),
                leaf2.describe().as_str()
            ],
            "[{p:?}] {text}"
        );
        assert!(leaf1.describe().contains(&format!("{}.echo#", b.name())));
        assert!(text.contains("3 problems"), "[{p:?}] {text}");
        for q in &problems {
            assert!(text.contains(&q.to_string()), "[{p:?}] lists {q}: {text}");
        }
        // The first problem is still in `node` and `message`.
        let (node, message) = compile_error(e, p);
        assert_eq!(
            (node.as_str(), message.as_str()),
            (nodes[0], problems[0].message.as_str())
        );
        drop((leaf1, leaf2, second));
        let g = dag.compile(y, opts()).unwrap();
        assert_eq!(g.execute((4, 9)).unwrap().get().unwrap(), 5, "[{p:?}]");
    });
}

/// A node of another graph is reported at the task that uses it, and the other graph's input
/// by its graph, not only as "input".
#[test]
fn compile_error_names_the_graph_of_a_foreign_input() {
    each_placement("compile_error_names_the_graph_of_a_foreign_input", |p| {
        let rt = Runtime::new().unwrap();
        let a = worker(&rt, p, 0);
        let d1 = Dag::<u64>::new();
        let d2 = Dag::<u64>::new();
        let y1 = a.echo(d1.input());
        let e = expect_err(d2.compile(y1.clone(), opts()), "node of d1 in d2");
        let text = e.to_string();
        let nodes: Vec<String> = e
            .compile_problems()
            .iter()
            .map(|q| q.node.clone())
            .collect();
        assert_eq!(nodes[0], y1.describe(), "[{p:?}] {text}");
        let foreign_input = format!("input of graph #{}", d1.id());
        assert!(nodes.contains(&foreign_input), "[{p:?}] {nodes:?}: {text}");
        assert!(
            nodes.contains(&"input".to_string()),
            "[{p:?}] d2 has no input: {text}"
        );
    });
}

/// Compiling a second output set from a `Dag` whose compiled graph is live says that the Dag
/// is already compiled, and as which graph; after teardown it compiles again.
#[test]
fn compiling_a_live_dag_again_says_it_is_compiled() {
    each_placement("compiling_a_live_dag_again_says_it_is_compiled", |p| {
        let rt = Runtime::new().unwrap();
        let a = worker(&rt, p, 1);
        let b = worker(&rt, p, 2);
        let dag = Dag::<u64>::new();
        let x = dag.input();
        let y = a.echo(&x);
        let g1 = dag.compile(y.clone(), opts()).unwrap();
        let z = b.echo(&x);
        for outputs in [vec![z.clone()], vec![y.clone()]] {
            let e = expect_err(dag.compile(outputs, opts()), "second compile");
            let (node, message) = compile_error(e, p);
            assert_eq!(node, "outputs", "[{p:?}] {message}");
            assert!(message.contains("already compiled"), "[{p:?}] {message}");
            assert!(
                message.contains(&format!("#{}", g1.id())),
                "[{p:?}] {message}"
            );
            assert!(
                message.contains(&format!("#{}", dag.id())),
                "[{p:?}] {message}"
            );
        }
        assert_eq!(
            g1.execute(1).unwrap().get().unwrap(),
            2,
            "[{p:?}] g1 unharmed"
        );
        g1.teardown().unwrap();
        let g2 = dag.compile((y, z), opts()).unwrap();
        assert_eq!(g2.execute(1).unwrap().get().unwrap(), (2, 3), "[{p:?}]");
    });
}

/// A collective of no input is refused where it is bound, naming the collective.
#[test]
fn empty_collective_is_refused_at_bind() {
    use adag::ReduceOp;
    use adag::collective::{allgather, allreduce, reducescatter};
    type Bind = fn() -> Vec<Node<adag::Tensor>>;
    let cases: [(Bind, &str); 3] = [
        (|| allreduce(&[], ReduceOp::Sum), "allreduce.sum"),
        (|| allgather(&[]), "allgather"),
        (|| reducescatter(&[], ReduceOp::Max), "reducescatter.max"),
    ];
    for (bind, name) in cases {
        let payload = std::panic::catch_unwind(bind).expect_err(name);
        let text = payload
            .downcast_ref::<String>()
            .cloned()
            .unwrap_or_default();
        assert!(
            text.contains(name) && text.contains("no input nodes"),
            "{name}: {text}"
        );
    }
}

/// A device tensor written to a shared-memory edge fails naming the device and the fix; in
/// one process it moves without encoding and arrives as it was.
#[test]
fn device_tensor_on_a_shared_memory_edge_names_device_and_fix() {
    each_placement(
        "device_tensor_on_a_shared_memory_edge_names_device_and_fix",
        |p| {
            let rt = Runtime::new().unwrap();
            let a = named_worker(&rt, p, "gpu0", 0);
            let dag = Dag::<u64>::new();
            let g = dag.compile(a.on_device(dag.input()), opts()).unwrap();
            match (p, g.execute(1).unwrap().get()) {
                (Placement::Thread, Ok(t)) => assert_eq!(t.device(), adag::Device::Cuda(0)),
                (
                    Placement::Process,
                    Err(Error::Task {
                        actor,
                        method,
                        message,
                        ..
                    }),
                ) => {
                    assert_eq!((actor.as_str(), method.as_str()), ("gpu0", "on_device"));
                    for needle in ["cuda:0", "Transport::communicator()", "CPU"] {
                        assert!(message.contains(needle), "names {needle}: {message}");
                    }
                    assert!(!message.contains("Serde Serialization Error"), "{message}");
                }
                (p, other) => panic!("[{p:?}] unexpected {other:?}"),
            }
            // The graph goes on.
            assert!(matches!(p, Placement::Thread) || g.execute(2).unwrap().get().is_err());
        },
    );
}

/// A value whose `Serialize` always fails.
#[derive(Clone, Debug)]
struct NoWire;

impl serde::Serialize for NoWire {
    fn serialize<S: serde::Serializer>(&self, _: S) -> Result<S::Ok, S::Error> {
        Err(serde::ser::Error::custom("NoWire refuses"))
    }
}

impl<'de> serde::Deserialize<'de> for NoWire {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        <()>::deserialize(d).map(|()| NoWire)
    }
}

/// An actor taking a value that cannot be encoded.
#[derive(Default)]
struct Sink;

#[adag::actor]
impl Sink {
    fn take(&mut self, _v: NoWire) -> u64 {
        0
    }
}

/// Input errors name the input part (`input[1]`, `input.k`), not a timeout label; an input
/// that cannot be encoded is an encode error naming its type, at once (no channel growth).
#[test]
fn input_errors_name_the_input_part() {
    each_placement("input_errors_name_the_input_part", |p| {
        if p == Placement::Thread {
            return; // in-process inputs move without encoding: no ceiling, no encoder
        }
        let rt = Runtime::new().unwrap();
        let a = worker(&rt, p, 0);
        let b = worker(&rt, p, 0);
        let small = opts().buffer_size_bytes(1024).max_message_bytes(64 * 1024);
        let dag = Dag::<(u64, Vec<u8>)>::new();
        let input = dag.input();
        let g = dag
            .compile(
                (a.echo(input.arg::<0>()), b.digest(input.arg::<1>())),
                small.clone(),
            )
            .unwrap();
        match g.execute((1, vec![7; 200_000])) {
            Err(Error::MessageTooLarge { edge, limit, .. }) => {
                assert_eq!((edge.as_str(), limit), ("input[1]", 64 * 1024))
            }
            other => panic!(
                "[{p:?}] expected MessageTooLarge, got {:?}",
                other.map(|_| ())
            ),
        }
        g.teardown().unwrap();
        let dag = Dag::<Req>::new();
        let k = dag.input().field("k", |r: &Req| r.k.clone());
        let g = dag.compile(a.strlen(&k), small.clone()).unwrap();
        let big = Req {
            k: "x".repeat(100_000),
            v: 0,
        };
        match g.execute(big) {
            Err(Error::MessageTooLarge { edge, .. }) => assert_eq!(edge, "input.k"),
            other => panic!(
                "[{p:?}] expected MessageTooLarge, got {:?}",
                other.map(|_| ())
            ),
        }
        assert_eq!(
            g.execute(Req {
                k: "abc".into(),
                v: 0
            })
            .unwrap()
            .get()
            .unwrap(),
            3,
            "[{p:?}] the graph goes on"
        );
        g.teardown().unwrap();
        let sink = rt
            .spawn::<Sink>(p, ())
            .unwrap_or_else(|e| panic!("[{p:?}] spawn Sink: {e}"));
        let dag = Dag::<NoWire>::new();
        let g = dag.compile(sink.take(dag.input()), small).unwrap();
        match g.execute(NoWire) {
            Err(Error::Codec { op, ty, place, .. }) => {
                assert_eq!(op, "encode", "[{p:?}]");
                assert!(ty.contains("NoWire"), "[{p:?}] {ty}");
                assert!(place.starts_with("input"), "[{p:?}] {place}");
            }
            other => panic!("[{p:?}] expected Error::Codec, got {:?}", other.map(|_| ())),
        }
    });
}

/// A method's `Err` keeps its whole chain (anyhow contexts, `source()`s) and its type name,
/// in graphs (sync and async) and one-off calls; a plain `String` error keeps working.
#[test]
fn method_errors_keep_their_chain_and_type() {
    each_placement("method_errors_keep_their_chain_and_type", |p| {
        let rt = Runtime::new().unwrap();
        let w = named_worker(&rt, p, "chain", 0);
        #[track_caller]
        fn check(e: Error, chain: &[&str], ty: &str, p: Placement) {
            let text = e.to_string();
            match e {
                Error::Task {
                    actor,
                    message,
                    chain: got,
                    error_type,
                    backtrace,
                    ..
                } => {
                    assert_eq!(actor, "chain", "[{p:?}]");
                    assert_eq!(&*got, chain, "[{p:?}] {text}");
                    assert_eq!(message, chain.join(": "), "[{p:?}]");
                    let error_type = error_type.unwrap_or_default();
                    let error_type = &*error_type;
                    assert!(error_type.contains(ty), "[{p:?}] {error_type}");
                    assert!(backtrace.is_none(), "[{p:?}] no backtrace for an Err");
                    for c in chain {
                        assert!(text.contains(c), "[{p:?}] Display shows {c}: {text}");
                    }
                }
                other => panic!("[{p:?}] expected Error::Task, got {other:?}"),
            }
        }
        let anyhow_chain = ["step failed", "loading shard 3", "file 3.bin is missing"];
        let std_chain = ["shard 13 unreadable", "disk says no"];
        // One-off calls.
        check(
            w.call().layered(3).unwrap_err(),
            &anyhow_chain,
            "anyhow::Error",
            p,
        );
        check(w.call().shard(13).unwrap_err(), &std_chain, "ShardError", p);
        check(
            w.call().checked(3).unwrap_err(),
            &["bad input 3"],
            "String",
            p,
        );
        assert_eq!(w.call().layered(4).unwrap(), 4, "[{p:?}]");
        // A graph, sync: each method in a graph of its own, since a failed execution fails
        // as a whole (every ref of it carries the first error read).
        let dag = Dag::<u64>::new();
        let g = dag.compile(w.layered(dag.input()), opts()).unwrap();
        check(
            g.execute(3).unwrap().get().unwrap_err(),
            &anyhow_chain,
            "anyhow::Error",
            p,
        );
        assert_eq!(g.execute(4).unwrap().get().unwrap(), 4, "[{p:?}]");
        check(
            g.execute(13).unwrap().get().unwrap_err(),
            &["step failed", "loading shard 13", "file 13.bin is missing"],
            "anyhow::Error",
            p,
        );
        g.teardown().unwrap();
        let dag = Dag::<u64>::new();
        let g = dag.compile(w.shard(dag.input()), opts()).unwrap();
        assert_eq!(g.execute(3).unwrap().get().unwrap(), 3, "[{p:?}]");
        check(
            g.execute(13).unwrap().get().unwrap_err(),
            &std_chain,
            "ShardError",
            p,
        );
        g.teardown().unwrap();
        // A graph, async.
        let dag = Dag::<u64>::new();
        let g = dag
            .compile(w.layered(dag.input()), opts().enable_asyncio(true))
            .unwrap();
        let e = tokio_rt()
            .block_on(async { g.execute_async(3).await.unwrap().await })
            .unwrap_err();
        check(e, &anyhow_chain, "anyhow::Error", p);
    });
}

/// A panic's backtrace comes back with the error exactly when the user's `RUST_BACKTRACE`
/// asks for one: this test runs itself again as a child process with `RUST_BACKTRACE=1`
/// (workers inherit the value instead of being forced to 0).
#[test]
fn panic_backtrace_follows_rust_backtrace() {
    const CHILD: &str = "ADAG_BEHAVIOUR_BACKTRACE_CHILD";
    let wants = |v: Option<String>| v.is_some_and(|v| v != "0");
    let asked = wants(std::env::var("RUST_LIB_BACKTRACE").ok())
        || (std::env::var("RUST_LIB_BACKTRACE").is_err()
            && wants(std::env::var("RUST_BACKTRACE").ok()));
    each_placement("panic_backtrace_follows_rust_backtrace", move |p| {
        let rt = Runtime::new().unwrap();
        let w = worker(&rt, p, 0);
        let one_off = w.call().boom(13).unwrap_err();
        let dag = Dag::<u64>::new();
        let g = dag.compile(w.boom(dag.input()), opts()).unwrap();
        for e in [one_off, g.execute(13).unwrap().get().unwrap_err()] {
            match &e {
                Error::Task {
                    message,
                    error_type,
                    backtrace,
                    ..
                } => {
                    assert!(message.contains("boom at 13"), "[{p:?}] {message}");
                    assert!(error_type.is_none(), "[{p:?}] a panic has no error type");
                    if asked {
                        let bt = backtrace.as_deref().unwrap_or_default();
                        assert!(bt.contains("panic"), "[{p:?}] a backtrace: {bt}");
                        assert!(e.to_string().contains(bt), "[{p:?}] shown");
                    } else {
                        assert!(backtrace.is_none(), "[{p:?}] none unless asked");
                    }
                }
                other => panic!("[{p:?}] expected Error::Task, got {other:?}"),
            }
        }
    });
    if std::env::var(CHILD).is_err() && !asked {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "panic_backtrace_follows_rust_backtrace",
                "--test-threads=1",
            ])
            .env(CHILD, "1")
            .env("RUST_BACKTRACE", "1")
            .env_remove("RUST_LIB_BACKTRACE")
            .output()
            .expect("run the test again as a child");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && text.contains("1 passed"),
            "the child with RUST_BACKTRACE=1 failed:\n{text}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

// =======================================================================================
// Fast fail, recovery after a death, refs (issue 12)
// =======================================================================================

/// The task error of `checked` for input `x`, or a failure.
#[track_caller]
fn assert_checked_failed(r: adag::Result<u64>, x: u64, what: &str, p: Placement) {
    match r {
        Err(Error::Task {
            method, message, ..
        }) => {
            assert_eq!(method, "checked", "[{p:?}] {what}");
            assert!(
                message.contains(&format!("bad input {x}")),
                "[{p:?}] {what}: {message}"
            );
        }
        other => panic!("[{p:?}] {what}: expected the task error of checked({x}), got {other:?}"),
    }
}

/// Outputs `[a method that waits, a method that fails at once]`: the error reaches every ref of
/// the execution (`get`, `get_all`) while the slow method is still running (it finishes only
/// when the test says so, after the error arrived); a later execution queued behind that work
/// times out instead of returning a stale value, and then returns its own values.
#[test]
fn fast_fail_reaches_every_ref_before_the_slow_output_finishes() {
    each_placement(
        "fast_fail_reaches_every_ref_before_the_slow_output_finishes",
        |p| {
            let rt = Runtime::new().unwrap();
            let a = worker(&rt, p, 100);
            let b = worker(&rt, p, 0);
            let dir = scratch_dir("fastfail");
            let dag = Dag::<u64>::new();
            let x = dag.input();
            let dir_s = dir.to_string_lossy().into_owned();
            let g = dag
                .compile((a.wait_file(&x, dir_s), b.checked(&x)), opts())
                .unwrap();
            let long = Duration::from_secs(20);
            // get on the failing output, then on the slow one: both fail at once.
            let (slow, fail) = g.execute(3).unwrap();
            assert_checked_failed(fail.get_timeout(long), 3, "failing output", p);
            assert!(
                !done(&dir, 3),
                "[{p:?}] the error waited for the slow method"
            );
            assert_checked_failed(
                slow.get_timeout(long),
                3,
                "slow output of a failed execution",
                p,
            );
            assert!(!done(&dir, 3), "[{p:?}] the slow ref waited for its method");
            // A later execution is queued behind the unfinished method: a timeout, not a
            // stale value.
            let (slow5, fast5) = g.execute(5).unwrap();
            let e = expect_err(fast5.get_timeout(Duration::from_millis(100)), "queued get");
            assert!(matches!(e, Error::Timeout { .. }), "[{p:?}] {e:?}");
            go(&dir, 3);
            go(&dir, 5);
            assert_eq!(fast5.get_timeout(long).unwrap(), 5, "[{p:?}]");
            assert_eq!(slow5.get_timeout(long).unwrap(), 105, "[{p:?}]");
            // get_all, asking for the slow output first.
            let refs = g.execute(13).unwrap();
            assert_checked_failed(get_all(refs).map(|(s, _)| s), 13, "get_all", p);
            assert!(
                !done(&dir, 13),
                "[{p:?}] get_all waited for the slow method"
            );
            go(&dir, 13);
            // Later executions return their own values, again and again.
            for i in [4u64, 6, 7] {
                go(&dir, i);
                assert_eq!(
                    g.execute(i).unwrap().get().unwrap(),
                    (i + 100, i),
                    "[{p:?}]"
                );
            }
            // The leftover of execution 13 was read and dropped on the way: nothing is stale.
            assert!(done(&dir, 13), "[{p:?}]");
            g.teardown().unwrap();
            let _ = std::fs::remove_dir_all(&dir);
        },
    );
}

/// With `max_inflight_executions(1)`, the leftovers of a failed execution hold the one place
/// until the slow method ends; `execute` waits for them (up to `submit_timeout`) instead of
/// refusing, and the next result is the next execution's own.
#[test]
fn execute_waits_for_the_leftovers_of_a_failed_execution() {
    each_placement(
        "execute_waits_for_the_leftovers_of_a_failed_execution",
        |p| {
            let rt = Runtime::new().unwrap();
            let a = worker(&rt, p, 100);
            let b = worker(&rt, p, 0);
            let dir = scratch_dir("leftover");
            let dag = Dag::<u64>::new();
            let x = dag.input();
            let g = dag
                .compile(
                    (
                        a.wait_file(&x, dir.to_string_lossy().into_owned()),
                        b.checked(&x),
                    ),
                    opts().max_inflight_executions(1),
                )
                .unwrap();
            let (_slow, fail) = g.execute(3).unwrap();
            assert_checked_failed(fail.get(), 3, "failing output", p);
            assert!(!done(&dir, 3), "[{p:?}]");
            let releaser = {
                let dir = dir.clone();
                std::thread::spawn(move || {
                    std::thread::sleep(Duration::from_millis(50));
                    go(&dir, 3);
                    go(&dir, 4);
                })
            };
            assert_eq!(g.execute(4).unwrap().get().unwrap(), (104, 4), "[{p:?}]");
            releaser.join().unwrap();
            let _ = std::fs::remove_dir_all(&dir);
        },
    );
}

/// After a get returned `ActorDied`, at once and every time: the survivors answer one-off
/// calls, they compile into a new graph that runs, and the dead actor answers `ActorDied`
/// (never `ActorBusy`, never a broken pipe). The survivors live in `p`; the victim is a worker
/// process (only those die).
#[test]
fn recovery_after_a_death_never_depends_on_timing() {
    each_placement("recovery_after_a_death_never_depends_on_timing", |p| {
        if !process_actors_available() {
            return;
        }
        let rt = Runtime::new().unwrap();
        let s1 = worker(&rt, p, 10);
        let s2 = worker(&rt, p, 20);
        for round in 0..5 {
            let victim = named_worker(&rt, Placement::Process, &format!("victim{round}"), 1);
            let dag = Dag::<u64>::new();
            let g = dag
                .compile(s2.echo(s1.echo(victim.slow(dag.input(), 3000u64))), opts())
                .unwrap();
            let r = g.execute(1).unwrap();
            if round % 2 == 0 {
                victim.kill().unwrap();
            } else {
                // Killed behind adag's back: only the monitor learns of it.
                let pid = victim.pid().unwrap() as i32;
                // SAFETY: kill(2) on our own child, alive until this signal.
                assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
            }
            let e = expect_err(r.get(), "get after the kill");
            assert!(
                matches!(e, Error::ActorDied { .. }),
                "[{p:?}] round {round}: {e:?}"
            );
            // No retry, no sleep.
            assert_eq!(
                s1.call().echo(1).unwrap(),
                11,
                "[{p:?}] round {round}: survivor 1"
            );
            assert_eq!(
                s2.call().echo(1).unwrap(),
                21,
                "[{p:?}] round {round}: survivor 2"
            );
            for _ in 0..3 {
                let e = expect_err(victim.call().echo(1), "call to the dead actor");
                assert!(
                    matches!(&e, Error::ActorDied { actor, .. } if *actor == format!("victim{round}")),
                    "[{p:?}] round {round}: {e:?}"
                );
            }
            let dag = Dag::<u64>::new();
            let g2 = dag
                .compile(s2.echo(s1.echo(dag.input())), opts())
                .unwrap_or_else(|e| panic!("[{p:?}] round {round}: rebuild: {e}"));
            assert_eq!(g2.execute(5).unwrap().get().unwrap(), 35, "[{p:?}]");
            g2.teardown().unwrap();
            drop(g);
        }
    });
}

/// A ref's `Debug` and `Display` name its graph and its execution: refs of two graphs differ;
/// a single-output graph shows no output index, a multi-output one does.
#[test]
fn refs_name_their_graph_and_execution() {
    each_placement("refs_name_their_graph_and_execution", |p| {
        let rt = Runtime::new().unwrap();
        let a = worker(&rt, p, 1);
        let b = worker(&rt, p, 2);
        let dag1 = Dag::<u64>::new();
        let g1 = dag1.compile(a.echo(dag1.input()), opts()).unwrap();
        let dag2 = Dag::<u64>::new();
        let x = dag2.input();
        let g2 = dag2.compile((b.echo(&x), b.add(&x, &x)), opts()).unwrap();
        let r1 = g1.execute(1).unwrap();
        let (r2a, r2b) = g2.execute(1).unwrap();
        let (d1, s1) = (format!("{r1:?}"), r1.to_string());
        assert!(d1.starts_with("CompiledRef("), "[{p:?}] {d1}");
        assert!(
            s1.contains(&format!("graph #{}", g1.id())) && s1.contains("execution 0"),
            "[{p:?}] {s1}"
        );
        assert!(!s1.contains("output"), "[{p:?}] single output: {s1}");
        assert!(s1.contains("echo"), "[{p:?}] {s1}");
        let s2b = r2b.to_string();
        assert!(
            s2b.contains(&format!("graph #{}", g2.id())) && s2b.contains("output 1"),
            "[{p:?}] {s2b}"
        );
        assert_ne!(s1, r2a.to_string(), "[{p:?}] two graphs' refs look alike");
        assert_eq!((r1.graph(), r2b.graph()), (g1.id(), g2.id()), "[{p:?}]");
        assert_eq!((r2b.execution(), r2b.output()), (0, 1), "[{p:?}]");
        assert_eq!(r1.get().unwrap(), 2, "[{p:?}]");
        assert_eq!((r2a.get().unwrap(), r2b.get().unwrap()), (3, 4), "[{p:?}]");
    });
}

/// `get_all_timeout`: one deadline for the whole list; on a timeout nothing is claimed and the
/// same refs give every value afterwards.
#[test]
fn get_all_with_one_deadline_claims_nothing_on_timeout() {
    each_placement("get_all_with_one_deadline_claims_nothing_on_timeout", |p| {
        let rt = Runtime::new().unwrap();
        let a = worker(&rt, p, 100);
        let dir = scratch_dir("getall");
        let dag = Dag::<u64>::new();
        let g = dag
            .compile(
                a.wait_file(dag.input(), dir.to_string_lossy().into_owned()),
                opts(),
            )
            .unwrap();
        go(&dir, 1);
        let refs: Vec<_> = (1..=3).map(|i| g.execute(i).unwrap()).collect();
        let e = expect_err(
            adag::get_all_timeout(&refs, Duration::from_millis(100)),
            "execution 2 waits",
        );
        assert!(matches!(e, Error::Timeout { .. }), "[{p:?}] {e:?}");
        go(&dir, 2);
        go(&dir, 3);
        assert_eq!(
            adag::get_all_timeout(&refs, Duration::from_secs(20)).unwrap(),
            vec![101, 102, 103],
            "[{p:?}] nothing was lost to the timeout"
        );
        let _ = std::fs::remove_dir_all(&dir);
    });
}

/// `wait_first`: the first ready result of a list, claimed, the others left; a failed
/// execution is ready at once although its slow output is still running; a timeout when
/// none is ready claims nothing.
#[test]
fn wait_first_returns_the_first_ready_result_or_error() {
    each_placement("wait_first_returns_the_first_ready_result_or_error", |p| {
        let rt = Runtime::new().unwrap();
        let a = worker(&rt, p, 100);
        let b = worker(&rt, p, 0);
        let dir = scratch_dir("waitfirst");
        let dag = Dag::<u64>::new();
        let x = dag.input();
        let g = dag
            .compile(
                (
                    a.wait_file(&x, dir.to_string_lossy().into_owned()),
                    b.checked(&x),
                ),
                opts(),
            )
            .unwrap();
        let (slow, fail) = g.execute(3).unwrap();
        let first = adag::wait_first(vec![slow, fail], Duration::from_secs(20)).unwrap();
        // Either ref may be the one found first: the error fails both at once.
        assert!(first.index <= 1, "[{p:?}] index {}", first.index);
        assert_checked_failed(first.result, 3, "wait_first", p);
        assert!(!done(&dir, 3), "[{p:?}] waited for the slow method");
        assert_checked_failed(first.rest.into_iter().next().unwrap().get(), 3, "rest", p);
        go(&dir, 3);
        // Values: the first ready is the first execution; nothing ready is a timeout.
        go(&dir, 4);
        let r4 = g.execute(4).unwrap().0;
        let r5 = g.execute(5).unwrap().0;
        let first = adag::wait_first(vec![r5, r4], Duration::from_secs(20)).unwrap();
        assert_eq!((first.index, first.result.unwrap()), (1, 104), "[{p:?}]");
        let e = expect_err(
            adag::wait_first(first.rest, Duration::from_millis(100)).map(|f| f.index),
            "nothing ready",
        );
        assert!(matches!(e, Error::Timeout { .. }), "[{p:?}] {e:?}");
        go(&dir, 5);
        g.teardown().unwrap();
        let _ = std::fs::remove_dir_all(&dir);
    });
}

/// One-off calls while a graph is live run on the actor's own thread between two executions
/// of its schedule, never inside one: with `note_f` then `note_g` on the same actor in every
/// execution, a call reading the log while executions stream in always finds whole pairs
/// (`f`, `g`, `f`, `g`, ...), never an `f` without its `g`. An idle actor (waiting for the next
/// execution) serves calls too.
#[test]
fn one_off_calls_run_between_executions_never_inside_one() {
    each_placement(
        "one_off_calls_run_between_executions_never_inside_one",
        |p| {
            let rt = Runtime::new().unwrap();
            let a = worker(&rt, p, 0);
            let dag = Dag::<u64>::new();
            let g = std::sync::Arc::new(
                dag.compile(
                    a.note_g(a.note_f(dag.input())),
                    opts().max_inflight_executions(4),
                )
                .unwrap(),
            );
            // Idle: the actor waits for an execution.
            assert_eq!(a.call().log().unwrap(), Vec::<String>::new(), "[{p:?}]");
            let runs = 300u64;
            let driver = {
                let g = g.clone();
                std::thread::spawn(move || {
                    let mut refs = VecDeque::new();
                    for i in 0..runs {
                        if refs.len() == 4 {
                            let r: CompiledRef<u64> = refs.pop_front().unwrap();
                            r.get().unwrap();
                        }
                        refs.push_back(g.execute(i).unwrap());
                    }
                    for r in refs {
                        r.get().unwrap();
                    }
                })
            };
            let check = |log: &[String], when: &str| {
                assert_eq!(
                    log.len() % 2,
                    0,
                    "[{p:?}] {when}: a call inside an execution: {log:?}"
                );
                for (i, e) in log.iter().enumerate() {
                    let want = if i % 2 == 0 { 'f' } else { 'g' };
                    assert!(e.starts_with(want), "[{p:?}] {when}: entry {i} is {e}");
                }
            };
            let mut seen = Vec::new();
            while !driver.is_finished() {
                let log = a
                    .call()
                    .log()
                    .unwrap_or_else(|e| panic!("[{p:?}] call during executions: {e}"));
                check(&log, "during");
                seen.push(log.len());
            }
            driver.join().unwrap();
            let log = a.call().log().unwrap();
            check(&log, "after");
            assert_eq!(log.len() as u64, 2 * runs, "[{p:?}]");
            assert!(!seen.is_empty(), "[{p:?}]");
            assert!(seen.windows(2).all(|w| w[0] <= w[1]), "[{p:?}] {seen:?}");
            g.teardown().unwrap();
        },
    );
}

/// `ActorBusy` is left only for an actor stuck inside a method: a call to it is withdrawn
/// (it never runs) and answers `ActorBusy` naming the graph, while the graph's other, idle
/// actor serves its call; once the method ends, calls run again.
#[test]
fn one_off_call_to_an_actor_stuck_in_a_method_is_busy_and_never_runs() {
    each_placement(
        "one_off_call_to_an_actor_stuck_in_a_method_is_busy_and_never_runs",
        |p| {
            let rt = Runtime::new().unwrap();
            let a = worker(&rt, p, 100);
            let b = worker(&rt, p, 0);
            let dir = scratch_dir("busy");
            let dag = Dag::<u64>::new();
            let g = dag
                .compile(
                    b.echo(a.wait_file(dag.input(), dir.to_string_lossy().into_owned())),
                    opts(),
                )
                .unwrap();
            let r = g.execute(1).unwrap();
            // b waits for a's result: idle between executions, it serves calls.
            assert_eq!(b.call().echo(5).unwrap(), 5, "[{p:?}]");
            let e = expect_err(a.call().echo(5), "call to a stuck actor");
            match e {
                Error::ActorBusy { actor, graph } => {
                    assert_eq!((actor.as_str(), graph), (a.name(), g.id()), "[{p:?}]")
                }
                other => panic!("[{p:?}] expected ActorBusy, got {other:?}"),
            }
            assert!(!done(&dir, 1), "[{p:?}]");
            go(&dir, 1);
            assert_eq!(r.get().unwrap(), 101, "[{p:?}]");
            // The withdrawn call never ran: `calls` counts echo, add, ... but not wait_file.
            assert_eq!(
                a.call().calls().unwrap(),
                0,
                "[{p:?}] the withdrawn call ran"
            );
            g.teardown().unwrap();
            let _ = std::fs::remove_dir_all(&dir);
        },
    );
}

/// Refs got in every order, some dropped unread, some got at once: the next execution's ref
/// reads its channel directly while earlier refs' results were filed, and no result lands in
/// another execution's ref.
#[test]
fn gets_in_any_order_with_dropped_refs_never_swap_results() {
    each_placement(
        "gets_in_any_order_with_dropped_refs_never_swap_results",
        |p| {
            let rt = Runtime::new().unwrap();
            let a = worker(&rt, p, 5);
            let dag = Dag::<u64>::new();
            let g = dag
                .compile(a.echo(dag.input()), opts().max_inflight_executions(6))
                .unwrap();
            let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
            let mut x = 0u64;
            for round in 0..300 {
                let n = 1 + rng.below(5) as usize;
                let mut refs: Vec<_> = (0..n)
                    .map(|_| {
                        x += 1;
                        (x, Some(g.execute(x).unwrap()))
                    })
                    .collect();
                // A permutation of the refs; each is got or, one time in four, dropped unread.
                for i in (1..n).rev() {
                    refs.swap(i, rng.below(i as u64 + 1) as usize);
                }
                for (input, r) in &mut refs {
                    let r = r.take().unwrap();
                    if rng.below(4) == 0 {
                        drop(r);
                    } else {
                        assert_eq!(r.get().unwrap(), *input + 5, "[{p:?}] round {round}");
                    }
                }
            }
            assert_eq!(g.execute(1).unwrap().get().unwrap(), 6, "[{p:?}]");
        },
    );
}
