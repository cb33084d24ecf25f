//! By-name binding as outputs: an `AnyNode` (or a `Vec` of them) is an output whose ref
//! yields an `AnyValue`; `AnyNode::split` splits a by-name tuple result. Thread and process
//! actors, sync and async.
mod common;
use adag::{AnyNode, AnyValue, CompileOptions, Dag, ErasedArg, Error, Runtime};
use common::{each_placement, worker};

fn input_arg(dag: &Dag<u64>) -> ErasedArg {
    ErasedArg::from(dag.input().erase())
}

#[test]
fn by_name_output_yields_an_any_value() {
    each_placement("by_name_output_yields_an_any_value", |p| {
        let rt = Runtime::new().unwrap();
        let a = worker(&rt, p, 7);
        let dag = Dag::<u64>::new();
        let y = a.method("echo").unwrap().bind([input_arg(&dag)]);
        let g = dag.compile(y, CompileOptions::default()).unwrap();
        for i in 0..5 {
            let v: AnyValue = g.execute(i).unwrap().get().unwrap();
            assert_eq!(v.type_name(), "u64");
            assert_eq!(v.downcast_ref::<u64>(), Some(&(i + 7)));
            // The wrong type gives the value back, unchanged.
            let v = v.downcast::<String>().unwrap_err();
            assert_eq!(v.downcast::<u64>().unwrap(), i + 7);
        }
    });
}

#[test]
fn vec_of_by_name_outputs_of_several_types() {
    each_placement("vec_of_by_name_outputs_of_several_types", |p| {
        let rt = Runtime::new().unwrap();
        let a = worker(&rt, p, 1);
        let b = worker(&rt, p, 0);
        let dag = Dag::<String>::new();
        let s = ErasedArg::from(dag.input().erase());
        let len = a.method("strlen").unwrap().bind([s.clone()]);
        let loud = b.method("shout").unwrap().bind([s]);
        // The same node twice: each output gets its own copy.
        let outputs: Vec<AnyNode> = vec![len, loud.clone(), loud];
        let g = dag.compile(outputs, CompileOptions::default()).unwrap();
        let vals = adag::get_all(g.execute("hey".to_string()).unwrap()).unwrap();
        assert_eq!(vals.len(), 3);
        assert_eq!(vals[0].downcast_ref::<u64>(), Some(&3));
        assert_eq!(
            vals[1].downcast_ref::<String>().map(String::as_str),
            Some("hey!")
        );
        assert_eq!(vals[2].type_name(), "alloc::string::String");
        assert_eq!(
            vals[2].downcast_ref::<String>().map(String::as_str),
            Some("hey!")
        );
    });
}

#[test]
fn by_name_split_gives_the_elements() {
    each_placement("by_name_split_gives_the_elements", |p| {
        let rt = Runtime::new().unwrap();
        let a = worker(&rt, p, 10);
        let b = worker(&rt, p, 0);
        let dag = Dag::<u64>::new();
        let pair = a.method("pair").unwrap().bind([input_arg(&dag)]);
        let parts = pair.split().unwrap();
        assert_eq!(parts.len(), 2);
        assert_eq!(parts[0].type_name(), "u64");
        assert_eq!(parts[1].type_name(), "alloc::string::String");
        // An element feeds a typed method and is an output by name itself.
        let label = parts[1].typed::<String>().expect("the element is a String");
        let len = b.strlen(&label);
        let g = dag
            .compile(
                (parts[0].clone(), parts[1].clone(), len),
                CompileOptions::default(),
            )
            .unwrap();
        for i in [1u64, 42, 1234] {
            let (n, s, l) = adag::get_all(g.execute(i).unwrap()).unwrap();
            assert_eq!(n.downcast::<u64>().unwrap(), i + 10);
            assert_eq!(s.downcast::<String>().unwrap(), format!("v{i}"));
            assert_eq!(l, format!("v{i}").len() as u64);
        }
    });
}

#[test]
fn by_name_outputs_in_async_graphs_and_task_errors() {
    each_placement("by_name_outputs_in_async_graphs_and_task_errors", |p| {
        let rt = Runtime::new().unwrap();
        let a = worker(&rt, p, 0);
        let dag = Dag::<u64>::new();
        let pair = a.method("try_pair").unwrap().bind([input_arg(&dag)]);
        let g = dag
            .compile(
                pair.split().unwrap(),
                CompileOptions::default().enable_asyncio(true),
            )
            .unwrap();
        let tokio = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        tokio.block_on(async {
            let refs = g.execute_async(5).await.unwrap();
            let mut it = refs.into_iter();
            let n = it.next().unwrap().await.unwrap();
            let s = it.next().unwrap().await.unwrap();
            assert_eq!(n.downcast::<u64>().unwrap(), 5);
            assert_eq!(s.downcast::<String>().unwrap(), "v5");
            // A failed method is the task's error on every element.
            for r in g.execute_async(3).await.unwrap() {
                match r.await {
                    Err(Error::Task {
                        method, message, ..
                    }) => {
                        assert_eq!(method, "try_pair");
                        assert!(message.contains("bad pair 3"), "{message}");
                    }
                    other => panic!("expected a task error, got {other:?}"),
                }
            }
            // Pipelining works with by-name outputs too.
            let mut pipe = g.pipeline_async(20..23, 2).unwrap();
            let mut i = 20;
            while let Some(item) = pipe.next().await {
                let item = item.unwrap();
                assert_eq!(item[0].downcast_ref::<u64>(), Some(&i));
                assert_eq!(item[1].downcast_ref::<String>(), Some(&format!("v{i}")));
                i += 1;
            }
            assert_eq!(i, 23);
        });
    });
}

#[test]
fn splitting_a_non_tuple_names_the_method() {
    let rt = Runtime::new().unwrap();
    let a = worker(&rt, adag::Placement::Thread, 0);
    let dag = Dag::<u64>::new();
    let y = a.method("echo").unwrap().bind([input_arg(&dag)]);
    match y.split() {
        Err(e @ Error::Compile { .. }) => {
            let text = e.to_string();
            assert!(text.contains("`echo`"), "{text}");
            assert!(text.contains("u64, not a tuple"), "{text}");
        }
        other => panic!("expected a compile error, got {other:?}"),
    }
    // The input is not a method call.
    let err = dag.input().erase().split().unwrap_err().to_string();
    assert!(err.contains("only the result of a method"), "{err}");
    // A tuple element is not a tuple again.
    let pair = a.method("pair").unwrap().bind([input_arg(&dag)]);
    let parts = pair.split().unwrap();
    assert!(parts[0].split().is_err());
}
