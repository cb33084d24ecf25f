//! The crate's API as a user meets it (issue 16): wide inputs, indexed parts of `Vec` and
//! array inputs, by-name binding errors. Every test runs for thread and process placement.
mod common;

use adag::{CompileOptions, Dag, Error, Placement, Runtime};
use common::*;
use std::time::Duration;

fn opts() -> CompileOptions {
    CompileOptions::default()
        .get_timeout(Duration::from_secs(20))
        .submit_timeout(Duration::from_secs(20))
}

type Wide = (u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64);

/// A 12-part tuple input: every part reaches its own task, in its own position.
#[test]
fn twelve_positional_input_parts() {
    each_placement("twelve_positional_input_parts", |p| {
        let rt = Runtime::new().unwrap();
        let a = worker(&rt, p, 0);
        let dag = Dag::<Wide>::new();
        let i = dag.input();
        // 100 a + 10 b + c over three parts at a time, then summed: order-sensitive.
        let x = a.add3(i.arg::<0>(), i.arg::<1>(), i.arg::<2>());
        let y = a.add3(i.arg::<3>(), i.arg::<4>(), i.arg::<5>());
        let z = a.add3(i.arg::<6>(), i.arg::<7>(), i.arg::<8>());
        let w = a.add3(i.arg::<9>(), i.arg::<10>(), i.arg::<11>());
        let g = dag
            .compile((x, y, z, w), opts())
            .unwrap_or_else(|e| panic!("[{p:?}] {e}"));
        for k in 0..3u64 {
            let input: Wide = (1 + k, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3 + k);
            let got = adag::get_all(g.execute(input).unwrap()).unwrap();
            assert_eq!(got, (123 + 100 * k, 456, 789, 123 + k), "[{p:?}]");
        }
    });
}

/// Parts of a `Vec` input by index: each reader gets its element; an input too short for
/// the graph is refused before anything is sent, and the graph goes on.
#[test]
fn indexed_parts_of_a_vec_input() {
    each_placement("indexed_parts_of_a_vec_input", |p| {
        let rt = Runtime::new().unwrap();
        let a = worker(&rt, p, 0);
        let b = worker(&rt, p, 0);
        let dag = Dag::<Vec<u64>>::new();
        let i = dag.input();
        let g = dag
            .compile(
                (a.combine(i.index(0), i.index(7)), b.echo(i.index(3))),
                opts(),
            )
            .unwrap();
        let input: Vec<u64> = (10..20).collect();
        assert_eq!(
            adag::get_all(g.execute(input.clone()).unwrap()).unwrap(),
            (10_017, 13),
            "[{p:?}]"
        );
        let e = expect_err(g.execute(vec![1, 2, 3, 4]), "too short");
        let Error::Input { part, message } = e else {
            panic!("[{p:?}] expected Error::Input, got {e:?}");
        };
        assert_eq!(part, "input[7]", "[{p:?}] {message}");
        assert!(
            message.contains('7') && message.contains('4') && message.contains('8'),
            "[{p:?}] says which element, how many there are and how many to pass: {message}"
        );
        // Nothing of the refused input went out: the next execution gets its own values.
        assert_eq!(
            adag::get_all(g.execute(input).unwrap()).unwrap(),
            (10_017, 13),
            "[{p:?}]"
        );
    });
}

/// Parts of an array input by index.
#[test]
fn indexed_parts_of_an_array_input() {
    each_placement("indexed_parts_of_an_array_input", |p| {
        let rt = Runtime::new().unwrap();
        let a = worker(&rt, p, 5);
        let dag = Dag::<[u64; 4]>::new();
        let i = dag.input();
        let g = dag.compile(a.add(i.index(1), i.index(3)), opts()).unwrap();
        assert_eq!(
            g.execute([1, 2, 3, 4]).unwrap().get().unwrap(),
            11,
            "[{p:?}]"
        );
    });
}

/// A misspelled by-name method is an error at once, naming it and the actor's methods; a
/// correct one binds and runs.
#[test]
fn by_name_typo_is_named_at_once() {
    each_placement("by_name_typo_is_named_at_once", |p| {
        let rt = Runtime::new().unwrap();
        let a = worker(&rt, p, 1);
        let e = match a.method("ecoh") {
            Err(e) => e.to_string(),
            Ok(_) => panic!("[{p:?}] a misspelled method was found"),
        };
        assert!(e.contains("ecoh") && e.contains("echo"), "[{p:?}] {e}");
        let dag = Dag::<u64>::new();
        let y = a
            .method("echo")
            .unwrap()
            .bind([dag.input().erase().into()])
            .typed::<u64>()
            .unwrap();
        let g = dag.compile(y, opts()).unwrap();
        assert_eq!(g.execute(41).unwrap().get().unwrap(), 42, "[{p:?}]");
    });
}

/// The suite above runs each body for both placements here (processes can be started).
#[test]
fn placements_cover_threads_and_processes() {
    assert_eq!(placements(), [Placement::Thread, Placement::Process]);
}
