//! From tokens to [`ActorModel`]: parse the `impl` block, strip the `#[adag(..)]` helper
//! attributes, and check every rule, collecting all errors rather than stopping at the first.

use proc_macro2::TokenStream;
use quote::{ToTokens, format_ident};
use syn::ext::IdentExt;
use syn::{
    Attribute, Error, FnArg, GenericArgument, ImplItem, ImplItemFn, Item, ItemImpl, Meta, Pat,
    PathArguments, Receiver, ReturnType, Signature, Type, TypePath, parse_quote,
};

use crate::model::{ActorModel, Arg, Constructor, Method, Output};

/// The bounds of `adag::Value`, quoted in error messages.
const VALUE_BOUNDS: &str = "Serialize + DeserializeOwned + Clone + Send + Sync + 'static";

/// Method names that `ActorHandle` uses itself (its inherent methods, and `Clone::clone`),
/// which would shadow the binder's method of the same name behind `ActorHandle`'s `Deref`.
const RESERVED: &[&str] = &[
    "call", "id", "name", "method", "kill", "core", "pid", "clone",
];

/// The largest tuple that `method_split` accepts (and the smallest is 2).
const MAX_SPLIT: usize = 8;

/// Why the attribute could not produce an actor.
pub(crate) struct Failure {
    /// The item to emit anyway (so that one mistake does not cascade into "method not
    /// found" errors everywhere the type is used); `None` when it did not even parse.
    pub item: Option<TokenStream>,
    /// All the errors, combined.
    pub error: Error,
}

/// The errors found so far.
#[derive(Default)]
struct Errors(Option<Error>);

impl Errors {
    fn push(&mut self, error: Error) {
        match &mut self.0 {
            Some(all) => all.combine(error),
            None => self.0 = Some(error),
        }
    }

    fn spanned(&mut self, tokens: impl ToTokens, message: impl std::fmt::Display) {
        self.push(Error::new_spanned(tokens, message));
    }
}

/// Parse and check `#[actor(<attr>)] <item>`.
pub(crate) fn analyze(attr: TokenStream, item: TokenStream) -> Result<ActorModel, Failure> {
    let mut errors = Errors::default();
    if !attr.is_empty() {
        errors.spanned(&attr, "#[adag::actor] takes no arguments");
    }
    let item = match syn::parse2::<Item>(item) {
        Ok(item) => item,
        Err(error) => {
            errors.push(error);
            return Err(Failure {
                item: None,
                error: errors.0.expect("an error was pushed"),
            });
        }
    };
    let mut imp = match item {
        Item::Impl(imp) => imp,
        other => {
            errors.spanned(
                &other,
                "#[adag::actor] must be placed on an inherent `impl` block of a struct, \
                 e.g. `#[adag::actor] impl MyActor { ... }`",
            );
            return Err(Failure {
                item: Some(other.into_token_stream()),
                error: errors.0.expect("an error was pushed"),
            });
        }
    };

    let ident = check_header(&imp, &mut errors);
    let mut ctor = Constructor::Default;
    let mut methods = Vec::new();
    for item in &mut imp.items {
        match item {
            ImplItem::Fn(f) => {
                // Methods are only checked in a valid header, to report its error alone.
                if take_adag_attrs(&mut f.attrs, &mut errors) || ident.is_none() {
                    continue;
                }
                if f.sig.receiver().is_some() {
                    methods.extend(analyze_method(f, &mut errors));
                } else if f.sig.ident == "new" {
                    ctor = analyze_constructor(&f.sig, ident.as_ref(), &mut errors)
                        .unwrap_or(Constructor::Default);
                }
            }
            ImplItem::Const(c) => reject_adag_attrs(&mut c.attrs, &mut errors),
            ImplItem::Type(t) => reject_adag_attrs(&mut t.attrs, &mut errors),
            ImplItem::Macro(m) => reject_adag_attrs(&mut m.attrs, &mut errors),
            _ => {}
        }
    }

    match (errors.0, ident) {
        (None, Some(ident)) => Ok(ActorModel {
            self_ty: (*imp.self_ty).clone(),
            item: imp,
            ident,
            ctor,
            methods,
        }),
        (error, _) => Err(Failure {
            item: Some(imp.into_token_stream()),
            error: error.expect("a header without identifier reports an error"),
        }),
    }
}

/// Check `impl Type` (inherent, non-generic) and return the type's identifier.
fn check_header(imp: &ItemImpl, errors: &mut Errors) -> Option<proc_macro2::Ident> {
    let mut ok = true;
    if let Some((bang, path, for_token)) = &imp.trait_ {
        let mut tokens = TokenStream::new();
        imp.impl_token.to_tokens(&mut tokens);
        bang.to_tokens(&mut tokens);
        path.to_tokens(&mut tokens);
        for_token.to_tokens(&mut tokens);
        imp.self_ty.to_tokens(&mut tokens);
        errors.spanned(
            tokens,
            "#[adag::actor] must be placed on an inherent `impl` block, not a trait impl: \
             write `#[adag::actor] impl MyActor { ... }` with the methods to export",
        );
        ok = false;
    }
    if !imp.generics.params.is_empty() {
        errors.spanned(
            &imp.generics,
            "#[adag::actor] does not support generic impl blocks: an actor type is registered \
             by name and must be a concrete, non-generic struct",
        );
        ok = false;
    } else if let Some(wc) = &imp.generics.where_clause {
        errors.spanned(
            wc,
            "#[adag::actor] does not support `where` clauses on the impl block: an actor type \
             must be a concrete, non-generic struct",
        );
        ok = false;
    }
    let ident = match &*imp.self_ty {
        Type::Path(TypePath { qself: None, path }) => match path.segments.last() {
            Some(seg) if seg.arguments.is_none() => Some(seg.ident.clone()),
            Some(seg) => {
                if ok {
                    errors.spanned(
                        &seg.arguments,
                        "#[adag::actor] does not support generic actor types: an actor type is \
                     registered by name and must be a concrete, non-generic struct",
                    );
                }
                ok = false;
                None
            }
            None => None,
        },
        _ => None,
    };
    if ident.is_none() && ok {
        errors.spanned(
            &imp.self_ty,
            "#[adag::actor] must be placed on an `impl` block of a named struct, e.g. \
             `#[adag::actor] impl MyActor { ... }`",
        );
    }
    if ok { ident } else { None }
}

/// Remove the `#[adag(..)]` attributes; returns whether one of them said `skip`.
fn take_adag_attrs(attrs: &mut Vec<Attribute>, errors: &mut Errors) -> bool {
    let mut skip = false;
    attrs.retain(|attr| {
        if !attr.path().is_ident("adag") {
            return true;
        }
        match &attr.meta {
            Meta::List(_) => {
                let parsed = attr.parse_nested_meta(|meta| {
                    if meta.path.is_ident("skip") {
                        skip = true;
                        Ok(())
                    } else {
                        Err(meta.error("unknown #[adag(..)] option: the only one is `skip`"))
                    }
                });
                if let Err(error) = parsed {
                    errors.push(error);
                }
            }
            _ => errors.spanned(attr, "expected `#[adag(skip)]`"),
        }
        false
    });
    skip
}

/// Remove `#[adag(..)]` attributes from an item other than a method, with an error.
fn reject_adag_attrs(attrs: &mut Vec<Attribute>, errors: &mut Errors) {
    attrs.retain(|attr| {
        if attr.path().is_ident("adag") {
            errors.spanned(attr, "#[adag(..)] attributes are only allowed on methods");
            false
        } else {
            true
        }
    });
}

/// Check an exported method (a fn with a receiver, not skipped) and model it.
fn analyze_method(f: &ImplItemFn, errors: &mut Errors) -> Option<Method> {
    let sig = &f.sig;
    let name = sig.ident.unraw().to_string();
    let mut ok = true;
    let mut fail = |tokens: &dyn ToTokens, message: String| {
        errors.spanned(tokens, message);
        ok = false;
    };
    let skip_hint = "or mark it #[adag(skip)] to keep it out of the actor";

    if name == "new" {
        fail(
            &sig.ident,
            format!(
                "an actor method named `new` must not take `self`: `new` is reserved for the \
                 constructor (an associated `fn new(..) -> Self`); rename it {skip_hint}"
            ),
        );
    } else if RESERVED.contains(&name.as_str()) {
        fail(
            &sig.ident,
            format!(
                "an actor cannot export a method named `{name}`: `ActorHandle::{name}` uses that \
                 name itself; rename it {skip_hint}"
            ),
        );
    }
    if let Some((receiver, Err(message))) = sig.receiver().map(|r| (r, check_receiver(r))) {
        fail(receiver, format!("`{name}`: {message}; {skip_hint}"));
    }
    if !sig.generics.params.is_empty() {
        fail(
            &sig.generics,
            format!(
                "`{name}`: generic methods cannot be exported: graph arguments are passed by \
                 value and must be `Value`s ({VALUE_BOUNDS}), so every argument needs a concrete \
                 type; use concrete types {skip_hint}"
            ),
        );
    }
    if let Some(unsafety) = &sig.unsafety {
        fail(
            unsafety,
            format!("`{name}`: `unsafe` methods cannot be exported; {skip_hint}"),
        );
    }

    let args = collect_args(sig, &mut |ty, forbidden| {
        let message = forbidden.message(&name, Position::Argument);
        fail(ty, format!("{message}; {skip_hint}"));
    });
    let output = match &sig.output {
        ReturnType::Default => Some(unit_output()),
        ReturnType::Type(_, ty) => {
            let (inner, fallible) = match result_ok_type(ty) {
                Some(t) => (t, true),
                None => (&**ty, false),
            };
            match find_forbidden(inner) {
                Some((at, forbidden)) => {
                    let message = forbidden.message(&name, Position::Return);
                    fail(at, format!("{message}; {skip_hint}"));
                    None
                }
                None if is_unit(inner) => Some(Output {
                    fallible,
                    ..unit_output()
                }),
                None => Some(Output {
                    ty: inner.clone(),
                    unit: false,
                    fallible,
                    split: tuple_len(inner).is_some_and(|n| (2..=MAX_SPLIT).contains(&n)),
                }),
            }
        }
    };
    if !ok {
        return None;
    }

    let attrs_named = |name: &str| -> Vec<Attribute> {
        f.attrs
            .iter()
            .filter(|a| a.path().is_ident(name))
            .cloned()
            .collect()
    };
    Some(Method {
        ident: sig.ident.clone(),
        name,
        args,
        output: output?,
        is_async: sig.asyncness.is_some(),
        docs: attrs_named("doc"),
        cfgs: attrs_named("cfg"),
        deprecated: attrs_named("deprecated"),
    })
}

/// Check the associated `fn new` and model it as the constructor.
fn analyze_constructor(
    sig: &Signature,
    self_ident: Option<&proc_macro2::Ident>,
    errors: &mut Errors,
) -> Option<Constructor> {
    let mut ok = true;
    let mut fail = |tokens: &dyn ToTokens, message: String| {
        errors.spanned(tokens, message);
        ok = false;
    };
    let hint = "or mark `new` #[adag(skip)] and implement `Default` for the actor";

    if !sig.generics.params.is_empty() {
        fail(
            &sig.generics,
            format!(
                "the actor constructor `new` cannot be generic: its arguments make up \
                 `Actor::Init`, which is passed by value and must be a `Value` \
                 ({VALUE_BOUNDS}); use concrete types {hint}"
            ),
        );
    }
    if let Some(unsafety) = &sig.unsafety {
        fail(
            unsafety,
            format!("the actor constructor `new` cannot be `unsafe`; {hint}"),
        );
    }
    let args = collect_args(sig, &mut |ty, forbidden| {
        let message = forbidden.message("new", Position::Init);
        fail(ty, format!("{message}; {hint}"));
    });
    let returns_self = |ty: &Type| is_self_type(ty, self_ident);
    let fallible = match &sig.output {
        ReturnType::Type(_, ty) if returns_self(ty) => Some(false),
        ReturnType::Type(_, ty) if result_ok_type(ty).is_some_and(returns_self) => Some(true),
        _ => None,
    };
    if fallible.is_none() {
        let message = format!(
            "the actor constructor `new` must return `Self` or `Result<Self, E>` (with \
             `E: Display`); rename it {hint}"
        );
        match &sig.output {
            ReturnType::Default => fail(&sig.ident, message),
            ReturnType::Type(_, ty) => fail(ty, message),
        }
    }
    if !ok {
        return None;
    }
    Some(Constructor::New {
        args,
        fallible: fallible?,
        is_async: sig.asyncness.is_some(),
    })
}

/// `&self` and `&mut self` (also spelled `self: &Self`) are fine; the rest is an error message.
fn check_receiver(receiver: &Receiver) -> Result<(), &'static str> {
    match unparen(&receiver.ty) {
        Type::Reference(r) if is_self_type(&r.elem, None) => Ok(()),
        ty if is_self_type(ty, None) => Err(
            "exported methods must take `&self` or `&mut self`: a by-value `self` would consume \
             the actor, which keeps serving calls; take `&self` or `&mut self`",
        ),
        _ => Err("exported methods must take `&self` or `&mut self`"),
    }
}

/// Model the arguments after the receiver, reporting each forbidden type through `fail`.
fn collect_args(sig: &Signature, fail: &mut dyn FnMut(&dyn ToTokens, Forbidden)) -> Vec<Arg> {
    let typed = sig.inputs.iter().filter_map(|input| match input {
        FnArg::Typed(pt) => Some(pt),
        FnArg::Receiver(_) => None,
    });
    typed
        .enumerate()
        .map(|(i, pt)| {
            if let Some((at, forbidden)) = find_forbidden(&pt.ty) {
                fail(at, forbidden);
            }
            let (ident, name) = match &*pt.pat {
                Pat::Ident(p) if p.by_ref.is_none() && p.subpat.is_none() => {
                    (p.ident.clone(), p.ident.unraw().to_string())
                }
                _ => (format_ident!("__adag_arg{}", i), format!("arg{i}")),
            };
            Arg {
                ident,
                name,
                ty: (*pt.ty).clone(),
            }
        })
        .collect()
}

/// Where a type appears, for error messages.
#[derive(Clone, Copy)]
enum Position {
    Argument,
    Return,
    Init,
}

/// A type that cannot be a graph value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Forbidden {
    /// `&T`, or a borrowed lifetime such as `Cow<'a, str>`.
    Borrowed,
    /// `impl Trait`.
    ImplTrait,
    /// `Self`, which means something else in the generated code.
    SelfType,
    /// `!`.
    Never,
}

impl Forbidden {
    fn message(self, method: &str, position: Position) -> String {
        let (prefix, by_value) = match position {
            Position::Argument => (
                format!("`{method}`: "),
                format!(
                    "graph arguments are passed by value and must be `Value`s ({VALUE_BOUNDS})"
                ),
            ),
            Position::Return => (
                format!("`{method}`: "),
                format!("graph results are passed by value and must be `Value`s ({VALUE_BOUNDS})"),
            ),
            Position::Init => (
                String::new(),
                format!(
                    "the arguments of the actor constructor `new` make up `Actor::Init`, which \
                     is passed by value and must be a `Value` ({VALUE_BOUNDS})"
                ),
            ),
        };
        let detail = match (self, position) {
            (Forbidden::Borrowed, Position::Return) => {
                format!("{by_value}: return an owned type instead of a borrow")
            }
            (Forbidden::Borrowed, _) => format!(
                "{by_value}: take an owned type instead of a reference or borrow (e.g. `String` \
                 for `&str`, `Vec<T>` for `&[T]`)"
            ),
            (Forbidden::ImplTrait, _) => {
                format!("{by_value}: `impl Trait` is not supported, use a concrete type")
            }
            (Forbidden::SelfType, Position::Return) => {
                format!("exported methods cannot return `Self`: {by_value}")
            }
            (Forbidden::SelfType, _) => {
                format!("{by_value}: `Self` is not allowed here, spell out the type name instead")
            }
            (Forbidden::Never, _) => format!("{by_value}: `!` is not a value"),
        };
        format!("{prefix}{detail}")
    }
}

/// The first part of `ty` that cannot be a graph value, if any. Function-pointer, trait-object
/// and `Fn(..)`-sugar types are not looked into (their own lifetimes are fine); whatever they
/// lack is left to the `Value` bound.
fn find_forbidden(ty: &Type) -> Option<(&dyn ToTokens, Forbidden)> {
    match ty {
        Type::Reference(_) => Some((ty, Forbidden::Borrowed)),
        Type::ImplTrait(_) => Some((ty, Forbidden::ImplTrait)),
        Type::Never(_) => Some((ty, Forbidden::Never)),
        Type::Array(a) => find_forbidden(&a.elem),
        Type::Group(g) => find_forbidden(&g.elem),
        Type::Paren(p) => find_forbidden(&p.elem),
        Type::Slice(s) => find_forbidden(&s.elem),
        Type::Ptr(p) => find_forbidden(&p.elem),
        Type::Tuple(t) => t.elems.iter().find_map(find_forbidden),
        Type::Path(p) => {
            if let Some(found) = p.qself.as_ref().and_then(|q| find_forbidden(&q.ty)) {
                return Some(found);
            }
            if p.qself.is_none() && p.path.segments.first().is_some_and(|s| s.ident == "Self") {
                return Some((ty, Forbidden::SelfType));
            }
            p.path.segments.iter().find_map(|seg| match &seg.arguments {
                PathArguments::AngleBracketed(args) => args.args.iter().find_map(|arg| match arg {
                    GenericArgument::Type(t) => find_forbidden(t),
                    GenericArgument::AssocType(a) => find_forbidden(&a.ty),
                    GenericArgument::Lifetime(l) if l.ident != "static" => {
                        Some((l as &dyn ToTokens, Forbidden::Borrowed))
                    }
                    _ => None,
                }),
                _ => None,
            })
        }
        _ => None,
    }
}

/// `T` if `ty` is `Result<T, E>` or a one-argument `Result<T>` alias (by its last segment).
fn result_ok_type(ty: &Type) -> Option<&Type> {
    let Type::Path(TypePath { qself: None, path }) = unparen(ty) else {
        return None;
    };
    let last = path.segments.last()?;
    if last.ident != "Result" {
        return None;
    }
    let PathArguments::AngleBracketed(args) = &last.arguments else {
        return None;
    };
    let types: Vec<&Type> = args
        .args
        .iter()
        .filter_map(|arg| match arg {
            GenericArgument::Type(t) => Some(t),
            _ => None,
        })
        .collect();
    match types.as_slice() {
        [t] | [t, _] if types.len() == args.args.len() => Some(t),
        _ => None,
    }
}

/// `Self`, or the actor's own name when `self_ident` is given.
fn is_self_type(ty: &Type, self_ident: Option<&proc_macro2::Ident>) -> bool {
    let Type::Path(TypePath { qself: None, path }) = unparen(ty) else {
        return false;
    };
    if path.is_ident("Self") {
        return true;
    }
    match (path.segments.last(), self_ident) {
        (Some(last), Some(ident)) => last.ident == *ident && last.arguments.is_none(),
        _ => false,
    }
}

fn is_unit(ty: &Type) -> bool {
    tuple_len(ty) == Some(0)
}

fn tuple_len(ty: &Type) -> Option<usize> {
    match unparen(ty) {
        Type::Tuple(t) => Some(t.elems.len()),
        _ => None,
    }
}

/// Look through `( .. )` and invisible groups.
fn unparen(ty: &Type) -> &Type {
    match ty {
        Type::Paren(p) => unparen(&p.elem),
        Type::Group(g) => unparen(&g.elem),
        _ => ty,
    }
}

fn unit_output() -> Output {
    Output {
        ty: parse_quote!(()),
        unit: true,
        fallible: false,
        split: false,
    }
}
