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
