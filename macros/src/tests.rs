//! Expansion tests: the generated code must parse as a `syn::File` and contain the expected
//! pieces (compared with all whitespace removed), and every rejected form must say why.

use proc_macro2::TokenStream;
use quote::{ToTokens, quote};
use syn::{ImplItem, Item, ItemImpl};

use crate::expand;
use crate::parse::analyze;

/// `s` without any whitespace, so that fragments compare independently of token spacing.
fn squash(s: &str) -> String {
    s.chars().filter(|c| !c.is_whitespace()).collect()
}

/// Expand `item` (which must succeed) and return the parsed output.
fn expand_file(item: TokenStream) -> syn::File {
    if let Err(failure) = analyze(TokenStream::new(), item.clone()) {
        let messages: Vec<String> = failure.error.into_iter().map(|e| e.to_string()).collect();
        panic!("unexpected errors: {messages:#?}");
    }
    let out = expand(TokenStream::new(), item);
    syn::parse2::<syn::File>(out.clone())
        .unwrap_or_else(|e| panic!("generated code does not parse: {e}\n{out}"))
}

/// Expand `item` (which must succeed) and return the output, squashed.
fn expand_ok(item: TokenStream) -> String {
    squash(&expand_file(item).to_token_stream().to_string())
}

/// The closure `#[actor]` puts in `map_err` for a fallible method, as text.
fn method_error() -> String {
    crate::generate::method_error().to_string()
}

#[track_caller]
fn assert_has(out: &str, fragment: &str) {
    let fragment = squash(fragment);
    assert!(
        out.contains(&fragment),
        "missing `{fragment}` in generated code:\n{out}"
    );
}

#[track_caller]
fn assert_lacks(out: &str, fragment: &str) {
    let fragment = squash(fragment);
    assert!(
        !out.contains(&fragment),
        "unexpected `{fragment}` in generated code:\n{out}"
    );
}

/// The error messages of a rejected expansion.
fn errors_with_attr(attr: TokenStream, item: TokenStream) -> Vec<String> {
    match analyze(attr, item) {
        Ok(_) => panic!("expected the expansion to fail"),
        Err(failure) => failure.error.into_iter().map(|e| e.to_string()).collect(),
    }
}

fn errors(item: TokenStream) -> Vec<String> {
    errors_with_attr(TokenStream::new(), item)
}

/// Exactly one error, containing all of `parts`.
#[track_caller]
fn assert_error(item: TokenStream, parts: &[&str]) {
    let errors = errors(item);
    assert_eq!(errors.len(), 1, "expected one error, got {errors:#?}");
    for part in parts {
        assert!(
            errors[0].contains(part),
            "error `{}` does not mention `{part}`",
            errors[0]
        );
    }
}

/// The `impl ::adag::Actor for ..` block of a generated file.
fn actor_impl(file: &syn::File) -> &ItemImpl {
    file.items
        .iter()
        .find_map(|item| match item {
            Item::Impl(imp)
                if imp.trait_.as_ref().is_some_and(|(_, path, _)| {
                    squash(&path.to_token_stream().to_string()) == "::adag::Actor"
                }) =>
            {
                Some(imp)
            }
            _ => None,
        })
        .expect("no Actor impl")
}

fn assoc_type(imp: &ItemImpl, name: &str) -> String {
    imp.items
        .iter()
        .find_map(|item| match item {
            ImplItem::Type(t) if t.ident == name => {
                Some(squash(&t.ty.to_token_stream().to_string()))
            }
            _ => None,
        })
        .unwrap_or_else(|| panic!("no `type {name}`"))
}

// ----------------------------------------------------------------------------------------
// The whole expansion

#[test]
fn golden_stage() {
    let file = expand_file(quote! {
        impl Stage {
            pub fn new(cfg: Cfg) -> Self { Stage { cfg } }
            /// Scales the input.
            pub fn forward(&mut self, x: Vec<f32>) -> Vec<f32> { x }
            pub fn pair(&mut self, a: u32, b: String) -> (u32, String) { (a, b) }
            pub fn check(&self, v: u64) -> Result<u64, MyErr> { Ok(v) }
            pub fn ping(&mut self) {}
            pub async fn fetch(&mut self, k: u32) -> u32 { k }
            #[adag(skip)] fn helper(&self) -> usize { 0 }
        }
    });
    // The impl, 2 structs + 2 FromHandleCore impls, binder and caller impls, the Actor impl
    // and the registration static.
    assert_eq!(file.items.len(), 9);
    let first = match &file.items[0] {
        Item::Impl(imp) => imp,
        _ => panic!("the impl block should come first"),
    };
    assert!(first.trait_.is_none());
    assert_eq!(first.items.len(), 7, "the impl block keeps all its items");

    let out = squash(&file.to_token_stream().to_string());
    for fragment in [
        // handles
        "#[doc(hidden)] #[derive(Clone)]",
        "pub struct __AdagStageBinder(::adag::__private::HandleCore);",
        "pub struct __AdagStageCaller(::adag::__private::HandleCore);",
        "impl ::adag::__private::FromHandleCore for __AdagStageBinder {
            fn from_core(core: ::adag::__private::HandleCore) -> Self { Self(core) } }",
        "impl ::adag::__private::FromHandleCore for __AdagStageCaller {",
        // binder
        "impl __AdagStageBinder {",
        "#[doc = r\" Scales the input.\"] #[doc = \"\"]
         #[doc = \" Binds `Stage::forward` into a graph: returns the node of its result.\"]",
        "pub fn forward(&self, x: impl ::core::convert::Into<::adag::Arg<Vec<f32>>>)
            -> ::adag::Node<Vec<f32>> {
            self.0.bind::<Vec<f32>>(\"forward\", ::std::vec![::adag::Arg::<Vec<f32>>::erase(x.into())])
        }",
        "pub fn ping(&self) -> ::adag::Node<()> { self.0.bind::<()>(\"ping\", ::std::vec![]) }",
        "pub fn check(&self, v: impl ::core::convert::Into<::adag::Arg<u64>>) -> ::adag::Node<u64>",
        "pub fn pair(&self, a: impl ::core::convert::Into<::adag::Arg<u32>>,
            b: impl ::core::convert::Into<::adag::Arg<String>>) -> ::adag::Node<(u32, String)> {
            self.0.bind::<(u32, String)>(\"pair\", ::std::vec![
                ::adag::Arg::<u32>::erase(a.into()), ::adag::Arg::<String>::erase(b.into())])",
        "pub fn fetch(&self, k: impl ::core::convert::Into<::adag::Arg<u32>>) -> ::adag::Node<u32>",
        // caller
        "impl __AdagStageCaller {",
        "#[doc = \" One-off call of `Stage::forward` outside any graph (the slow path).\"]",
        "pub fn forward(&self, x: Vec<f32>) -> ::core::result::Result<Vec<f32>, ::adag::Error> {
            self.0.call::<(Vec<f32>,), Vec<f32>>(\"forward\", (x,)) }",
        "pub fn ping(&self) -> ::core::result::Result<(), ::adag::Error> {
            self.0.call::<(), ()>(\"ping\", ()) }",
        "pub fn pair(&self, a: u32, b: String)
            -> ::core::result::Result<(u32, String), ::adag::Error> {
            self.0.call::<(u32, String), (u32, String)>(\"pair\", (a, b)) }",
        // Actor
        "impl ::adag::Actor for Stage {",
        "type Init = Cfg; type Binder = __AdagStageBinder; type Caller = __AdagStageCaller;",
        "fn type_name() -> &'static str { ::core::concat!(::core::module_path!(), \"::\", \"Stage\") }",
        "fn construct(init: Self::Init) -> ::core::result::Result<Self, ::std::string::String> {
            ::core::result::Result::Ok(Stage::new(init)) }",
        "fn methods() -> &'static [::adag::__private::MethodEntry<Self>] {
            static METHODS: ::std::sync::OnceLock<::std::vec::Vec<::adag::__private::MethodEntry<Stage>>,>
                = ::std::sync::OnceLock::new();
            METHODS.get_or_init(|| ::std::vec![",
        "::adag::__private::method::<Stage, (Vec<f32>,), Vec<f32>>(\"forward\", &[\"x\"],
            |__adag_this: &mut Stage, (x,): (Vec<f32>,)|
                ::core::result::Result::Ok(__adag_this.forward(x)),)",
        "::adag::__private::method_split::<Stage, (u32, String), (u32, String)>(\"pair\", &[\"a\", \"b\"],
            |__adag_this: &mut Stage, (a, b): (u32, String)|
                ::core::result::Result::Ok(__adag_this.pair(a, b)),)",
        "::adag::__private::method::<Stage, (u64,), u64>(\"check\", &[\"v\"],
            |__adag_this: &mut Stage, (v,): (u64,)|
                __adag_this.check(v).map_err(|__adag_e| {",
        "(&&&&::adag::__private::error_kind::Wrap(&__adag_e)).__adag_method_error() }),)",
        "::adag::__private::method::<Stage, (), ()>(\"ping\", &[],
            |__adag_this: &mut Stage, (): ()| { __adag_this.ping(); ::core::result::Result::Ok(()) },)",
        "::adag::__private::method::<Stage, (u32,), u32>(\"fetch\", &[\"k\"],
            |__adag_this: &mut Stage, (k,): (u32,)|
                ::core::result::Result::Ok(::adag::__private::block_on(__adag_this.fetch(k))),)",
        "]).as_slice()",
        // registration
        "#[::adag::__private::linkme::distributed_slice(::adag::__private::ACTOR_TYPES)]
         #[linkme(crate = ::adag::__private::linkme)] #[doc(hidden)]",
        "static __ADAG_REGISTER_STAGE: ::adag::__private::ActorTypeEntry =
            ::adag::__private::ActorTypeEntry::of::<Stage>();",
    ] {
        assert_has(&out, fragment);
    }
    // The skipped helper is kept, without its attribute, and not exported.
    assert_lacks(&out, "adag(skip)");
    assert_has(&out, "fn helper(&self) -> usize { 0 }");
    assert_lacks(&out, "\"helper\"");
    assert_lacks(&out, "pub fn helper");
    // The constructor is not a method.
    assert_lacks(&out, "\"new\"");
}

#[test]
fn the_impl_block_is_emitted_unchanged() {
    let item: ItemImpl = syn::parse_quote! {
        impl Stage {
            /// Docs stay.
            #[inline]
            pub fn forward(&mut self, mut x: Vec<f32>) -> Vec<f32> { x.push(1.0); x }
            const K: u32 = 3;
            fn assoc() -> u32 { 1 }
        }
    };
    let file = expand_file(item.to_token_stream());
    assert_eq!(
        file.items[0].to_token_stream().to_string(),
        item.to_token_stream().to_string()
    );
    let out = squash(&file.to_token_stream().to_string());
    // `mut` stays on the user's method only; associated fns other than `new` are not exported.
    assert_has(&out, "pub fn forward(&self, x: impl");
    assert_has(
        &out,
        "(x,): (Vec<f32>,)| ::core::result::Result::Ok(__adag_this.forward(x))",
    );
    assert_lacks(&out, "\"assoc\"");
}

#[test]
fn an_actor_without_methods() {
    let out = expand_ok(quote! { impl Empty {} });
    assert_has(&out, "METHODS.get_or_init(|| ::std::vec![]).as_slice()");
    assert_has(&out, "impl __AdagEmptyBinder {}");
    assert_has(&out, "impl __AdagEmptyCaller {}");
    assert_has(&out, "static __ADAG_REGISTER_EMPTY:");
}

#[test]
fn generated_names_follow_the_type_name() {
    let out = expand_ok(quote! { impl MyStage2 { fn f(&self) {} } });
    assert_has(&out, "pub struct __AdagMyStage2Binder(");
    assert_has(&out, "pub struct __AdagMyStage2Caller(");
    assert_has(&out, "static __ADAG_REGISTER_MYSTAGE2:");
    assert_has(
        &out,
        "::core::concat!(::core::module_path!(), \"::\", \"MyStage2\")",
    );
}

#[test]
fn a_path_to_the_type_is_kept_in_generated_code() {
    let out = expand_ok(quote! { impl crate::stages::Stage { fn f(&self) -> u8 { 0 } } });
    assert_has(&out, "impl ::adag::Actor for crate::stages::Stage {");
    assert_has(&out, "pub struct __AdagStageBinder(");
    assert_has(
        &out,
        "::adag::__private::method::<crate::stages::Stage, (), u8>(\"f\", &[],
            |__adag_this: &mut crate::stages::Stage, (): ()|",
    );
    assert_has(&out, "ActorTypeEntry::of::<crate::stages::Stage>()");
    assert_has(
        &out,
        "<crate::stages::Stage as ::core::default::Default>::default()",
    );
}

// ----------------------------------------------------------------------------------------
// Return kinds

/// The method-table entry generated for `method`, squashed, from `impl A { #method }`.
fn entry_of(method: TokenStream) -> String {
    let out = expand_ok(quote! { impl A { #method } });
    let start = out
        .find("::adag::__private::method")
        .expect("no method entry");
    let end = out[start..].find("]).as_slice()").expect("no end of table") + start;
    out[start..end].to_string()
}

#[test]
fn unit_returns() {
    let expected = "::adag::__private::method::<A, (u8,), ()>(\"f\", &[\"x\"],
        |__adag_this: &mut A, (x,): (u8,)| { __adag_this.f(x); ::core::result::Result::Ok(()) },)";
    assert_eq!(
        entry_of(quote! { fn f(&mut self, x: u8) {} }),
        squash(expected)
    );
    assert_eq!(
        entry_of(quote! { fn f(&mut self, x: u8) -> () {} }),
        squash(expected)
    );
    let out = expand_ok(quote! { impl A { fn f(&self) {} } });
    assert_has(
        &out,
        "pub fn f(&self) -> ::adag::Node<()> { self.0.bind::<()>(\"f\", ::std::vec![]) }",
    );
}

#[test]
fn plain_returns() {
    assert_eq!(
        entry_of(quote! { fn f(&self) -> Vec<String> { vec![] } }),
        squash(
            "::adag::__private::method::<A, (), Vec<String>>(\"f\", &[],
                |__adag_this: &mut A, (): ()| ::core::result::Result::Ok(__adag_this.f()),)"
        )
    );
    // A 1-tuple and a 9-tuple are plain values, not split.
    let one = entry_of(quote! { fn f(&self) -> (u8,) { (0,) } });
    assert_has(&one, "::adag::__private::method::<A, (), (u8,)>(");
    let nine = entry_of(quote! {
        fn f(&self) -> (u8, u8, u8, u8, u8, u8, u8, u8, u8) { todo!() }
    });
    assert_has(
        &nine,
        "::adag::__private::method::<A, (), (u8, u8, u8, u8, u8, u8, u8, u8, u8)>(",
    );
    // A type merely containing `Result` is plain.
    let opt = entry_of(quote! { fn f(&self) -> Option<Result<u8, String>> { None } });
    assert_has(
        &opt,
        "::adag::__private::method::<A, (), Option<Result<u8, String>>>(",
    );
    assert_has(&opt, "::core::result::Result::Ok(__adag_this.f())");
}

#[test]
fn result_returns() {
    let fallible = |ok: &str| {
        squash(&format!(
            "::adag::__private::method::<A, (u32,), {ok}>(\"f\", &[\"v\"],
                |__adag_this: &mut A, (v,): (u32,)|
                    __adag_this.f(v).map_err({}),)",
            method_error()
        ))
    };
    assert_eq!(
        entry_of(quote! { fn f(&self, v: u32) -> Result<u64, MyErr> { todo!() } }),
        fallible("u64")
    );
    assert_eq!(
        entry_of(
            quote! { fn f(&self, v: u32) -> std::result::Result<Vec<u8>, String> { todo!() } }
        ),
        fallible("Vec<u8>")
    );
    // One-argument aliases.
    assert_eq!(
        entry_of(quote! { fn f(&self, v: u32) -> anyhow::Result<String> { todo!() } }),
        fallible("String")
    );
    assert_eq!(
        entry_of(quote! { fn f(&self, v: u32) -> io::Result<u8> { todo!() } }),
        fallible("u8")
    );
    // `Result<(), E>` gives `R = ()`.
    assert_eq!(
        entry_of(quote! { fn f(&self, v: u32) -> Result<(), E> { todo!() } }),
        fallible("()")
    );
    // Binder and caller use `R = T`.
    let out = expand_ok(quote! { impl A { fn f(&self, v: u32) -> Result<u64, E> { todo!() } } });
    assert_has(&out, "-> ::adag::Node<u64> { self.0.bind::<u64>(\"f\",");
    assert_has(
        &out,
        "-> ::core::result::Result<u64, ::adag::Error> { self.0.call::<(u32,), u64>(\"f\", (v,)) }",
    );
}

#[test]
fn tuple_returns_are_split() {
    assert_eq!(
        entry_of(quote! { fn f(&mut self, a: u32, b: String) -> (u32, String) { (a, b) } }),
        squash(
            "::adag::__private::method_split::<A, (u32, String), (u32, String)>(\"f\", &[\"a\", \"b\"],
                |__adag_this: &mut A, (a, b): (u32, String)|
                    ::core::result::Result::Ok(__adag_this.f(a, b)),)"
        )
    );
    let eight = entry_of(quote! { fn f(&self) -> (u8, u8, u8, u8, u8, u8, u8, u8) { todo!() } });
    assert_has(
        &eight,
        "::adag::__private::method_split::<A, (), (u8, u8, u8, u8, u8, u8, u8, u8)>(",
    );
    // The `Ok` value of a `Result` is split too.
    let res = entry_of(quote! { fn f(&self) -> Result<(u8, Vec<u8>), E> { todo!() } });
    assert_has(
        &res,
        "::adag::__private::method_split::<A, (), (u8, Vec<u8>)>(",
    );
    assert_has(&res, "__adag_this.f().map_err(");
    // The binder still returns one node of the tuple.
    let out = expand_ok(quote! { impl A { fn f(&self) -> (u8, u16) { (0, 0) } } });
    assert_has(
        &out,
        "-> ::adag::Node<(u8, u16)> { self.0.bind::<(u8, u16)>(\"f\", ::std::vec![]) }",
    );
}

#[test]
fn async_methods() {
    assert_eq!(
        entry_of(quote! { async fn f(&mut self, k: u32) -> u32 { k } }),
        squash(
            "::adag::__private::method::<A, (u32,), u32>(\"f\", &[\"k\"],
                |__adag_this: &mut A, (k,): (u32,)|
                    ::core::result::Result::Ok(::adag::__private::block_on(__adag_this.f(k))),)"
        )
    );
    assert_has(
        &entry_of(quote! { async fn f(&self, k: u32) -> Result<u32, E> { Ok(k) } }),
        &format!(
            "|__adag_this: &mut A, (k,): (u32,)| ::adag::__private::block_on(__adag_this.f(k))
            .map_err({}),",
            method_error()
        ),
    );
    assert_has(
        &entry_of(quote! { async fn f(&self) {} }),
        "{ ::adag::__private::block_on(__adag_this.f()); ::core::result::Result::Ok(()) }",
    );
    // Binder and caller are synchronous.
    let out = expand_ok(quote! { impl A { async fn f(&self, k: u32) -> u32 { k } } });
    assert_has(
        &out,
        "pub fn f(&self, k: impl ::core::convert::Into<::adag::Arg<u32>>) -> ::adag::Node<u32>",
    );
    assert_has(
        &out,
        "pub fn f(&self, k: u32) -> ::core::result::Result<u32, ::adag::Error>",
    );
}

// ----------------------------------------------------------------------------------------
// Arguments and attributes

#[test]
fn argument_patterns_are_renamed() {
    let entry = entry_of(quote! {
        fn f(&self, (a, b): (u32, u32), _: String, ref c: u8, mut d: u8) -> u32 { a + b }
    });
    assert_eq!(
        entry,
        squash(
            "::adag::__private::method::<A, ((u32, u32), String, u8, u8), u32>(\"f\",
                &[\"arg0\", \"arg1\", \"arg2\", \"d\"],
                |__adag_this: &mut A, (__adag_arg0, __adag_arg1, __adag_arg2, d):
                    ((u32, u32), String, u8, u8)|
                    ::core::result::Result::Ok(__adag_this.f(__adag_arg0, __adag_arg1, __adag_arg2, d)),)"
        )
    );
    let out = expand_ok(quote! { impl A { fn f(&self, (a, b): (u32, u32)) -> u32 { a + b } } });
    assert_has(
        &out,
        "pub fn f(&self, __adag_arg0: impl ::core::convert::Into<::adag::Arg<(u32, u32)>>)",
    );
    assert_has(&out, "pub fn f(&self, __adag_arg0: (u32, u32))");
    assert_has(
        &out,
        "self.0.call::<((u32, u32),), u32>(\"f\", (__adag_arg0,))",
    );
}

#[test]
fn raw_identifiers_are_reported_without_prefix() {
    let out = expand_ok(quote! { impl A { fn r#match(&self, r#type: u8) -> u8 { r#type } } });
    assert_has(&out, "pub fn r#match(&self, r#type: impl");
    assert_has(&out, "self.0.bind::<u8>(\"match\",");
    assert_has(
        &out,
        "(\"match\", &[\"type\"], |__adag_this: &mut A, (r#type,): (u8,)|",
    );
}

#[test]
fn receivers_of_both_kinds() {
    let out = expand_ok(quote! {
        impl A {
            fn a(&self) -> u8 { 0 }
            fn b(&mut self) -> u8 { 0 }
            fn c(self: &Self) -> u8 { 0 }
            fn d(self: &mut Self) -> u8 { 0 }
        }
    });
    for name in ["a", "b", "c", "d"] {
        assert_has(
            &out,
            &format!(
                "::adag::__private::method::<A, (), u8>(\"{name}\", &[],
                    |__adag_this: &mut A, (): ()| ::core::result::Result::Ok(__adag_this.{name}()),)"
            ),
        );
        assert_has(&out, &format!("pub fn {name}(&self) -> ::adag::Node<u8>"));
    }
}

#[test]
fn skip() {
    let out = expand_ok(quote! {
        impl A {
            #[adag(skip)]
            fn consume(self) -> Self { self }
            #[adag(skip)]
            fn generic<T: Clone>(&self, t: &T) -> T { t.clone() }
            #[adag(skip)]
            pub fn kill(&mut self) {}
            #[adag(skip)]
            fn borrowed(&self) -> &str { "" }
            fn kept(&self) {}
        }
    });
    assert_lacks(&out, "adag(");
    assert_has(&out, "fn consume(self) -> Self { self }");
    for name in ["consume", "generic", "kill", "borrowed"] {
        assert_lacks(&out, &format!("\"{name}\""));
    }
    assert_has(&out, "\"kept\"");
}

#[test]
fn docs_cfg_and_deprecated_are_carried_over() {
    let out = expand_ok(quote! {
        impl A {
            /// Line one.
            /// Line two.
            #[cfg(feature = "x")]
            #[deprecated(note = "use g")]
            #[inline]
            fn f(&self) -> u8 { 0 }
        }
    });
    assert_has(
        &out,
        "#[doc = r\" Line one.\"] #[doc = r\" Line two.\"] #[doc = \"\"]
         #[doc = \" Binds `A::f` into a graph: returns the node of its result.\"]
         #[cfg(feature = \"x\")] #[deprecated(note = \"use g\")]
         #[must_use = \"a bound node does nothing unless it is used by a task or is an output of the graph\"]
         pub fn f(&self) -> ::adag::Node<u8>",
    );
    assert_has(
        &out,
        "#[doc = \" One-off call of `A::f` outside any graph (the slow path).\"]
         #[cfg(feature = \"x\")] #[deprecated(note = \"use g\")]
         pub fn f(&self) -> ::core::result::Result<u8, ::adag::Error>",
    );
    assert_has(
        &out,
        "::std::vec![#[cfg(feature = \"x\")] ::adag::__private::method::<A, (), u8>(",
    );
    assert_has(&out, "#[allow(deprecated)]");
    // `#[inline]` stays on the user's method only.
    assert_eq!(out.matches("#[inline]").count(), 1);
}

// ----------------------------------------------------------------------------------------
// Constructors

fn construct_of(item: TokenStream) -> (String, String) {
    let file = expand_file(item);
    let imp = actor_impl(&file);
    let construct = imp
        .items
        .iter()
        .find_map(|item| match item {
            ImplItem::Fn(f) if f.sig.ident == "construct" => {
                Some(squash(&f.to_token_stream().to_string()))
            }
            _ => None,
        })
        .expect("no construct");
    (assoc_type(imp, "Init"), construct)
}

#[test]
fn constructor_none_uses_default() {
    let (init, construct) = construct_of(quote! { impl A { fn f(&self) {} } });
    assert_eq!(init, "()");
    assert_eq!(
        construct,
        squash(
            "fn construct(_init: Self::Init) -> ::core::result::Result<Self, ::std::string::String> {
                ::core::result::Result::Ok(<A as ::core::default::Default>::default()) }"
        )
    );
}

#[test]
fn constructor_without_arguments() {
    let (init, construct) = construct_of(quote! { impl A { pub fn new() -> Self { A } } });
    assert_eq!(init, "()");
    assert_has(&construct, "fn construct(_init: Self::Init)");
    assert_has(&construct, "{ ::core::result::Result::Ok(A::new()) }");
}

#[test]
fn constructor_with_one_argument() {
    let (init, construct) = construct_of(quote! { impl A { pub fn new(cfg: Cfg) -> A { A } } });
    assert_eq!(init, "Cfg");
    assert_has(&construct, "fn construct(init: Self::Init)");
    assert_has(&construct, "{ ::core::result::Result::Ok(A::new(init)) }");
}

#[test]
fn constructor_with_several_arguments() {
    let (init, construct) = construct_of(quote! {
        impl A { pub fn new(a: u32, (b, c): (u8, u8), name: String) -> Self { todo!() } }
    });
    assert_eq!(init, squash("(u32, (u8, u8), String)"));
    assert_has(
        &construct,
        "{ let (a, __adag_arg1, name) = init;
           ::core::result::Result::Ok(A::new(a, __adag_arg1, name)) }",
    );
}

#[test]
fn fallible_constructors() {
    let (init, construct) = construct_of(quote! {
        impl A { pub fn new(cfg: Cfg) -> Result<Self, MyErr> { todo!() } }
    });
    assert_eq!(init, "Cfg");
    assert_has(
        &construct,
        &format!(
            "{{ A::new(init).map_err({}).map_err(|e| e.text()) }}",
            method_error()
        ),
    );
    let (init, construct) = construct_of(quote! {
        impl A { pub fn new() -> anyhow::Result<A> { todo!() } }
    });
    assert_eq!(init, "()");
    assert_has(
        &construct,
        &format!(
            "{{ A::new().map_err({}).map_err(|e| e.text()) }}",
            method_error()
        ),
    );
}

#[test]
fn async_constructor() {
    let (_, construct) = construct_of(quote! {
        impl A { pub async fn new(a: u8, b: u8) -> Result<Self, E> { todo!() } }
    });
    assert_has(
        &construct,
        &format!(
            "{{ let (a, b) = init; ::adag::__private::block_on(A::new(a, b))
            .map_err({}).map_err(|e| e.text()) }}",
            method_error()
        ),
    );
}

#[test]
fn skipped_constructor_falls_back_to_default() {
    let (init, construct) = construct_of(quote! {
        impl A { #[adag(skip)] pub fn new(x: &str) -> Self { todo!() } }
    });
    assert_eq!(init, "()");
    assert_has(&construct, "<A as ::core::default::Default>::default()");
}

// ----------------------------------------------------------------------------------------
// Rejected forms

#[test]
fn rejects_attribute_arguments() {
    let errors = errors_with_attr(quote! { foo }, quote! { impl A {} });
    assert_eq!(errors, ["#[adag::actor] takes no arguments"]);
}

#[test]
fn rejects_items_other_than_impl_blocks() {
    assert_error(
        quote! { struct A; },
        &["must be placed on an inherent `impl` block of a struct"],
    );
    assert_error(
        quote! { fn f() {} },
        &["must be placed on an inherent `impl` block"],
    );
}

#[test]
fn rejects_trait_impls() {
    assert_error(
        quote! { impl Clone for A { fn clone(&self) -> Self { A } } },
        &["not a trait impl"],
    );
}

#[test]
fn rejects_generic_impls() {
    assert_error(
        quote! { impl<T> A<T> { fn f(&self) {} } },
        &["does not support generic impl blocks"],
    );
    assert_error(
        quote! { impl<'a> A<'a> { fn f(&self) {} } },
        &["does not support generic impl blocks"],
    );
    assert_error(
        quote! { impl A<u8> { fn f(&self) {} } },
        &["does not support generic actor types"],
    );
    assert_error(
        quote! { impl A where u8: Clone { fn f(&self) {} } },
        &["does not support `where` clauses"],
    );
    assert_error(quote! { impl (u8, u8) {} }, &["of a named struct"]);
}

#[test]
fn rejects_by_value_self() {
    assert_error(
        quote! { impl A { fn f(self) {} } },
        &[
            "`f`",
            "must take `&self` or `&mut self`",
            "by-value `self`",
            "#[adag(skip)]",
        ],
    );
    assert_error(
        quote! { impl A { fn f(mut self: Self) {} } },
        &["by-value `self`"],
    );
    assert_error(
        quote! { impl A { fn f(self: Box<Self>) {} } },
        &["must take `&self` or `&mut self`"],
    );
}

#[test]
fn rejects_reference_arguments() {
    let value = "graph arguments are passed by value and must be `Value`s \
                 (Serialize + DeserializeOwned + Clone + Send + Sync + 'static)";
    assert_error(
        quote! { impl A { fn f(&self, s: &str) {} } },
        &["`f`", value, "owned type", "#[adag(skip)]"],
    );
    assert_error(
        quote! { impl A { fn f(&self, s: Vec<&'static mut u8>) {} } },
        &[value],
    );
    assert_error(
        quote! { impl A { fn f(&self, s: std::borrow::Cow<'_, str>) {} } },
        &[value, "reference or borrow"],
    );
}

#[test]
fn rejects_impl_trait_arguments() {
    assert_error(
        quote! { impl A { fn f(&self, s: impl Into<String>) {} } },
        &[
            "graph arguments are passed by value and must be `Value`s",
            "`impl Trait`",
        ],
    );
}

#[test]
fn rejects_generic_methods() {
    assert_error(
        quote! { impl A { fn f<T: Clone>(&self, t: T) -> T { t } } },
        &[
            "`f`: generic methods cannot be exported",
            "graph arguments are passed by value and must be `Value`s",
            "#[adag(skip)]",
        ],
    );
    assert_error(
        quote! { impl A { fn f<'a>(&'a self) -> u8 { 0 } } },
        &["generic methods cannot be exported"],
    );
}

#[test]
fn rejects_self_in_signatures() {
    assert_eq!(
        errors(quote! { impl A { fn f(&self) -> Self { todo!() } } }),
        [
            "`f`: exported methods cannot return `Self`: graph results are passed by value and \
          must be `Value`s (Serialize + DeserializeOwned + Clone + Send + Sync + 'static); \
          or mark it #[adag(skip)] to keep it out of the actor"
        ]
    );
    assert_error(
        quote! { impl A { fn f(&self) -> Result<Vec<Self>, E> { todo!() } } },
        &["exported methods cannot return `Self`"],
    );
    assert_error(
        quote! { impl A { fn f(&self, other: Self) {} } },
        &["`Self` is not allowed here"],
    );
}

#[test]
fn rejects_unsupported_returns() {
    assert_error(
        quote! { impl A { fn f(&self) -> &str { "" } } },
        &["graph results are passed by value", "owned type"],
    );
    assert_error(
        quote! { impl A { fn f(&self) -> Result<&[u8], E> { todo!() } } },
        &["graph results are passed by value"],
    );
    assert_error(
        quote! { impl A { fn f(&self) -> impl Iterator<Item = u8> { todo!() } } },
        &["graph results are passed by value", "`impl Trait`"],
    );
    assert_error(
        quote! { impl A { fn f(&self) -> ! { todo!() } } },
        &["`!` is not a value"],
    );
}

#[test]
fn rejects_unsafe_methods() {
    assert_error(
        quote! { impl A { unsafe fn f(&self) {} } },
        &["`unsafe` methods cannot be exported"],
    );
}

#[test]
fn rejects_new_with_a_receiver() {
    assert_error(
        quote! { impl A { fn new(&self) -> u8 { 0 } } },
        &[
            "named `new` must not take `self`",
            "rename it",
            "#[adag(skip)]",
        ],
    );
}

#[test]
fn rejects_reserved_names() {
    for name in [
        "call", "id", "name", "method", "kill", "core", "pid", "clone",
    ] {
        let ident = syn::Ident::new(name, proc_macro2::Span::call_site());
        assert_error(
            quote! { impl A { pub fn #ident(&self) -> u8 { 0 } } },
            &[
                &format!("cannot export a method named `{name}`"),
                &format!("`ActorHandle::{name}`"),
                "rename it or mark it #[adag(skip)]",
            ],
        );
    }
}

#[test]
fn rejects_bad_constructors() {
    assert_error(
        quote! { impl A { pub fn new() -> u8 { 0 } } },
        &["constructor `new` must return `Self` or `Result<Self, E>`"],
    );
    assert_error(
        quote! { impl A { pub fn new() {} } },
        &["constructor `new` must return `Self` or `Result<Self, E>`"],
    );
    assert_error(
        quote! { impl A { pub fn new() -> Result<u8, E> { todo!() } } },
        &["must return `Self` or `Result<Self, E>`"],
    );
    assert_error(
        quote! { impl A { pub fn new<T>(t: T) -> Self { todo!() } } },
        &["constructor `new` cannot be generic"],
    );
    assert_error(
        quote! { impl A { pub fn new(name: &str) -> Self { todo!() } } },
        &["make up `Actor::Init`", "must be a `Value`", "owned type"],
    );
    assert_error(
        quote! { impl A { pub unsafe fn new() -> Self { todo!() } } },
        &["cannot be `unsafe`"],
    );
}

#[test]
fn rejects_unknown_helper_attributes() {
    assert_error(
        quote! { impl A { #[adag(skip, other)] fn f(&self) {} } },
        &["unknown #[adag(..)] option"],
    );
    assert_error(
        quote! { impl A { #[adag] fn f(&self) {} } },
        &["expected `#[adag(skip)]`"],
    );
    assert_error(
        quote! { impl A { #[adag(skip)] const K: u8 = 0; } },
        &["only allowed on methods"],
    );
}

#[test]
fn reports_every_error_at_once() {
    let errors = errors(quote! {
        impl A {
            fn f(self, s: &str) -> &str { s }
            fn kill(&self) {}
            fn g<T>(&self, t: impl Clone) {}
        }
    });
    assert_eq!(errors.len(), 6, "{errors:#?}");
}

#[test]
fn failed_expansion_still_emits_the_impl_block() {
    let out = expand(
        TokenStream::new(),
        quote! { impl A { #[adag(skip)] fn ok(&self) {} fn f(self) {} } },
    );
    let file = syn::parse2::<syn::File>(out).expect("output parses");
    assert!(matches!(&file.items[0], Item::Impl(_)));
    let out = squash(&file.to_token_stream().to_string());
    assert_has(&out, "::core::compile_error!{");
    assert_has(&out, "impl A { fn ok(&self) {} fn f(self) {} }");
    assert_lacks(&out, "::adag::Actor");
    // An item that does not parse gives only the error.
    let out = expand(TokenStream::new(), quote! { impl A { fn } });
    assert!(squash(&out.to_string()).starts_with("::core::compile_error!"));
}

#[test]
fn error_spans_point_at_the_offending_tokens() {
    let failure = match analyze(
        TokenStream::new(),
        quote! { impl A { fn f(&self, s: Vec<&str>) {} } },
    ) {
        Err(failure) => failure,
        Ok(_) => panic!("expected an error"),
    };
    // With `quote!`, spans carry no positions; check the error's tokens instead.
    let tokens = squash(&failure.error.to_compile_error().to_string());
    assert!(tokens.contains("compile_error"), "{tokens}");
    assert_eq!(failure.error.into_iter().count(), 1);
}
