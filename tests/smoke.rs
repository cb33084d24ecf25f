use adag::{CompileOptions, Dag, Placement, Runtime};

pub struct Adder {
    k: u64,
}

#[adag::actor]
impl Adder {
    pub fn new(k: u64) -> Self {
        Adder { k }
    }
    pub fn add(&mut self, x: u64) -> u64 {
        x + self.k
    }
    pub fn pair(&mut self, x: u64) -> (u64, String) {
        (x, format!("v{x}"))
    }
}

#[test]
fn chain_of_two() {
    let rt = Runtime::new().unwrap();
    let a = rt.spawn::<Adder>(Placement::Thread, 1).unwrap();
    let b = rt.spawn::<Adder>(Placement::Thread, 10).unwrap();
    assert_eq!(a.call().add(1).unwrap(), 2);
    let dag = Dag::<u64>::new();
    let out = b.add(a.add(dag.input()));
    let g = dag.compile(out, CompileOptions::default()).unwrap();
    for i in 0..100 {
        assert_eq!(g.execute(i).unwrap().get().unwrap(), i + 11);
    }
    println!("{}", g.visualize());
    g.teardown().unwrap();
}

#[test]
fn process_chain() {
    let rt = Runtime::new().unwrap();
    let a = rt.spawn::<Adder>(Placement::Process, 1).unwrap();
    let b = rt.spawn::<Adder>(Placement::Process, 10).unwrap();
    let c = rt.spawn::<Adder>(Placement::Thread, 100).unwrap();
    assert_eq!(a.call().add(1).unwrap(), 2);
    let dag = Dag::<u64>::new();
    let out = c.add(b.add(a.add(dag.input())));
    let g = dag.compile(out.clone(), CompileOptions::default()).unwrap();
    let t = std::time::Instant::now();
    for i in 0..10000 {
        assert_eq!(g.execute(i).unwrap().get().unwrap(), i + 111);
    }
    println!("10000 in {:?}", t.elapsed());
    g.teardown().unwrap();
    assert_eq!(a.call().add(1).unwrap(), 2);
    let pid = a.pid().unwrap();
    drop((g, out, dag, a, b, c));
    std::thread::sleep(std::time::Duration::from_millis(100));
    assert!(!std::path::Path::new(&format!("/proc/{pid}")).exists());
}

#[test]
fn process_death() {
    let rt = Runtime::new().unwrap();
    let a = rt.spawn::<Adder>(Placement::Process, 1).unwrap();
    let dag = Dag::<u64>::new();
    let out = a.add(dag.input());
    let g = dag.compile(out, CompileOptions::default()).unwrap();
    assert_eq!(g.execute(1).unwrap().get().unwrap(), 2);
    a.kill().unwrap();
    let t = std::time::Instant::now();
    let e = g.execute(1).and_then(|r| r.get());
    println!("{e:?} after {:?}", t.elapsed());
    assert!(matches!(e, Err(adag::Error::ActorDied { .. })));
}

#[test]
fn async_graph() {
    let rt = Runtime::new().unwrap();
    let a = rt.spawn::<Adder>(Placement::Process, 1).unwrap();
    let dag = Dag::<u64>::new();
    let out = a.add(dag.input());
    // Compiled outside any runtime.
    let g = dag
        .compile(out, CompileOptions::default().enable_asyncio(true))
        .unwrap();
    assert!(matches!(g.execute(1), Err(adag::Error::WrongMode { .. })));
    let tokio_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    tokio_rt.block_on(async {
        let r = g.execute_async(1).await.unwrap();
        assert_eq!(r.await.unwrap(), 2);
        let mut refs = Vec::new();
        for i in 0..8 {
            refs.push(g.execute_async(i).await.unwrap());
        }
        for (i, r) in refs.into_iter().enumerate() {
            assert_eq!(r.await.unwrap(), i as u64 + 1);
        }
    });
}
