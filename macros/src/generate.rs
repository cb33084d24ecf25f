//! From [`ActorModel`] to code: the impl block itself, then the binder and caller handle types,
//! the `adag::Actor` impl with the method table, and the registration in `ACTOR_TYPES`.

use proc_macro2::{Ident, Span, TokenStream};
use quote::{format_ident, quote};
use syn::{Attribute, LitStr, Type};

use crate::model::{ActorModel, Arg, Constructor, Method};

/// All the code for one actor.
pub(crate) fn generate(model: &ActorModel) -> TokenStream {
    let item = &model.item;
    let names = Names::of(&model.ident);
    let handles = handle_types(&names);
    let binder = binder_impl(model, &names);
    let caller = caller_impl(model, &names);
    let actor = actor_impl(model, &names);
    let register = registration(model, &names);
    quote! {
        #item
        #handles
        #binder
        #caller
        #actor
        #register
    }
}

/// The names derived from the actor's identifier.
struct Names {
    /// `"Stage"`.
    actor: String,
    /// `__AdagStageBinder`.
    binder: Ident,
    /// `__AdagStageCaller`.
    caller: Ident,
    /// `__ADAG_REGISTER_STAGE`.
    register: Ident,
}

impl Names {
    fn of(ident: &Ident) -> Self {
        let actor = syn::ext::IdentExt::unraw(ident).to_string();
        Names {
            binder: format_ident!("__Adag{}Binder", actor),
            caller: format_ident!("__Adag{}Caller", actor),
            register: format_ident!("__ADAG_REGISTER_{}", actor.to_uppercase()),
            actor,
        }
    }
}

/// `__AdagStageBinder` and `__AdagStageCaller`, thin wrappers of the library's `HandleCore`.
fn handle_types(names: &Names) -> TokenStream {
    let Names { binder, caller, .. } = names;
    let one = |ty: &Ident| {
        quote! {
            #[doc(hidden)]
            #[derive(Clone)]
            #[allow(non_camel_case_types, dead_code)]
            pub struct #ty(::adag::__private::HandleCore);

            impl ::adag::__private::FromHandleCore for #ty {
                fn from_core(core: ::adag::__private::HandleCore) -> Self {
                    Self(core)
                }
            }
        }
    };
    let binder = one(binder);
    let caller = one(caller);
    quote! { #binder #caller }
}

/// The attributes on everything generated for an impl of handle methods.
fn handle_impl_attrs() -> TokenStream {
    quote! {
        #[allow(dead_code, deprecated, private_interfaces, private_bounds)]
        #[allow(clippy::too_many_arguments, clippy::type_complexity)]
    }
}

/// `impl __AdagStageBinder { pub fn forward(&self, x: impl Into<Arg<T>>) -> Node<R> }`.
fn binder_impl(model: &ActorModel, names: &Names) -> TokenStream {
    let binder = &names.binder;
    let methods = model.methods.iter().map(|m| {
        let Method {
            ident,
            name,
            args,
            output,
            ..
        } = m;
        let r = &output.ty;
        let doc = doc_line(
            &m.docs,
            &format!(
                " Binds `{}::{}` into a graph: returns the node of its result.",
                names.actor, name
            ),
        );
        let attrs = pass_through(m);
        let params = args.iter().map(|Arg { ident, ty, .. }| {
            quote! { #ident: impl ::core::convert::Into<::adag::Arg<#ty>> }
        });
        let erased = args.iter().map(|Arg { ident, ty, .. }| {
            quote! { ::adag::Arg::<#ty>::erase(#ident.into()) }
        });
        let name = lit(name);
        quote! {
            #doc
            #attrs
            #[must_use = "a bound node does nothing unless it is used by a task or is an output of the graph"]
            pub fn #ident(&self #(, #params)*) -> ::adag::Node<#r> {
                self.0.bind::<#r>(#name, ::std::vec![#(#erased),*])
            }
        }
    });
    let allow = handle_impl_attrs();
    quote! {
        #allow
        impl #binder {
            #(#methods)*
        }
    }
}

/// `impl __AdagStageCaller { pub fn forward(&self, x: T) -> Result<R, adag::Error> }`.
fn caller_impl(model: &ActorModel, names: &Names) -> TokenStream {
    let caller = &names.caller;
    let methods = model.methods.iter().map(|m| {
        let Method {
            ident,
            name,
            args,
            output,
            ..
        } = m;
        let r = &output.ty;
        let doc = doc_line(
            &m.docs,
            &format!(
                " One-off call of `{}::{}` outside any graph (the slow path).",
                names.actor, name
            ),
        );
        let attrs = pass_through(m);
        let params = args
            .iter()
            .map(|Arg { ident, ty, .. }| quote! { #ident: #ty });
        let args_ty = args_tuple_type(args);
        let args_val = args_tuple_pattern(args);
        let name = lit(name);
        quote! {
            #doc
            #attrs
            pub fn #ident(&self #(, #params)*) -> ::core::result::Result<#r, ::adag::Error> {
                self.0.call::<#args_ty, #r>(#name, #args_val)
            }
        }
    });
    let allow = handle_impl_attrs();
    quote! {
        #allow
        impl #caller {
            #(#methods)*
        }
    }
}

/// `impl adag::Actor for Stage`.
fn actor_impl(model: &ActorModel, names: &Names) -> TokenStream {
    let self_ty = &model.self_ty;
    let Names {
        actor,
        binder,
        caller,
        ..
    } = names;
    let (init_ty, construct) = constructor(model);
    let entries = model.methods.iter().map(|m| method_entry(self_ty, m));
    quote! {
        #[allow(deprecated)]
        #[allow(clippy::type_complexity)]
        impl ::adag::Actor for #self_ty {
            type Init = #init_ty;
            type Binder = #binder;
            type Caller = #caller;

            fn type_name() -> &'static str {
                ::core::concat!(::core::module_path!(), "::", #actor)
            }

            #construct

            fn methods() -> &'static [::adag::__private::MethodEntry<Self>] {
                static METHODS: ::std::sync::OnceLock<
                    ::std::vec::Vec<::adag::__private::MethodEntry<#self_ty>>,
                > = ::std::sync::OnceLock::new();
                METHODS
                    .get_or_init(|| ::std::vec![#(#entries),*])
                    .as_slice()
            }
        }
    }
}

/// `Init` and `fn construct`.
fn constructor(model: &ActorModel) -> (TokenStream, TokenStream) {
    let self_ty = &model.self_ty;
    let signature = |param: TokenStream, body: TokenStream| {
        quote! {
            fn construct(#param: Self::Init) -> ::core::result::Result<Self, ::std::string::String> {
                #body
            }
        }
    };
    match &model.ctor {
        Constructor::Default => (
            quote! { () },
            signature(
                quote! { _init },
                quote! {
                    ::core::result::Result::Ok(<#self_ty as ::core::default::Default>::default())
                },
            ),
        ),
        Constructor::New {
            args,
            fallible,
            is_async,
        } => {
            let idents: Vec<&Ident> = args.iter().map(|a| &a.ident).collect();
            let (init_ty, param, unpack) = match args.as_slice() {
                [] => (quote! { () }, quote! { _init }, quote! {}),
                [one] => {
                    let ty = &one.ty;
                    (quote! { #ty }, quote! { init }, quote! {})
                }
                _ => {
                    let tys = args.iter().map(|a| &a.ty);
                    (
                        quote! { (#(#tys),*) },
                        quote! { init },
                        quote! { let (#(#idents),*) = init; },
                    )
                }
            };
            let call_args = match args.as_slice() {
                [_] => quote! { init },
                _ => quote! { #(#idents),* },
            };
            let mut call = quote! { #self_ty::new(#call_args) };
            if *is_async {
                call = quote! { ::adag::__private::block_on(#call) };
            }
            let value = if *fallible {
                let to_error = method_error();
                quote! { #call.map_err(#to_error).map_err(|e| e.text()) }
            } else {
                quote! { ::core::result::Result::Ok(#call) }
            };
            let body = quote! { #unpack #value };
            (init_ty, signature(param, body))
        }
    }
}

/// The closure that turns a method's `Err(e)` into `adag::__private::MethodError`: the whole
/// chain when `e` is an error (or holds one, like `anyhow::Error`), else its text; always its
/// type name (see `adag::error::error_kind`).
pub(crate) fn method_error() -> TokenStream {
    quote! {
        |__adag_e| {
            #[allow(unused_imports)]
            use ::adag::__private::error_kind::{
                ViaDisplay as _, ViaDynError as _, ViaDynSendError as _, ViaStdError as _,
            };
            (&&&&::adag::__private::error_kind::Wrap(&__adag_e)).__adag_method_error()
        }
    }
}

/// One `MethodEntry` of the method table.
fn method_entry(self_ty: &Type, m: &Method) -> TokenStream {
    let Method {
        ident,
        name,
        args,
        output,
        is_async,
        cfgs,
        ..
    } = m;
    let r = &output.ty;
    let args_ty = args_tuple_type(args);
    let pattern = args_tuple_pattern(args);
    let arg_names = args.iter().map(|a| lit(&a.name));
    let idents = args.iter().map(|a| &a.ident);
    let this = Ident::new("__adag_this", Span::call_site());
    let mut call = quote! { #this.#ident(#(#idents),*) };
    if *is_async {
        call = quote! { ::adag::__private::block_on(#call) };
    }
    let body = if output.fallible {
        let to_error = method_error();
        quote! { #call.map_err(#to_error) }
    } else if output.unit {
        quote! { { #call; ::core::result::Result::Ok(()) } }
    } else {
        quote! { ::core::result::Result::Ok(#call) }
    };
    let constructor = if output.split {
        quote! { method_split }
    } else {
        quote! { method }
    };
    let name = lit(name);
    quote! {
        #(#cfgs)*
        ::adag::__private::#constructor::<#self_ty, #args_ty, #r>(
            #name,
            &[#(#arg_names),*],
            |#this: &mut #self_ty, #pattern: #args_ty| #body,
        )
    }
}

/// `registration in ACTOR_TYPES`, so that worker processes can build the actor by name.
fn registration(model: &ActorModel, names: &Names) -> TokenStream {
    let self_ty = &model.self_ty;
    let register = &names.register;
    quote! {
        #[::adag::__private::linkme::distributed_slice(::adag::__private::ACTOR_TYPES)]
        #[linkme(crate = ::adag::__private::linkme)]
        #[doc(hidden)]
        #[allow(non_upper_case_globals)]
        static #register: ::adag::__private::ActorTypeEntry =
            ::adag::__private::ActorTypeEntry::of::<#self_ty>();
    }
}

/// `()`, `(A,)`, `(A, B)`, ...
fn args_tuple_type(args: &[Arg]) -> TokenStream {
    let tys = args.iter().map(|a| &a.ty);
    if args.len() == 1 {
        quote! { (#(#tys,)*) }
    } else {
        quote! { (#(#tys),*) }
    }
}

/// `()`, `(a,)`, `(a, b)`, ... (a pattern, or an expression of the same shape).
fn args_tuple_pattern(args: &[Arg]) -> TokenStream {
    let idents = args.iter().map(|a| &a.ident);
    if args.len() == 1 {
        quote! { (#(#idents,)*) }
    } else {
        quote! { (#(#idents),*) }
    }
}

/// The user's docs (if any), a blank line, and `line`.
fn doc_line(docs: &[Attribute], line: &str) -> TokenStream {
    if docs.is_empty() {
        quote! { #[doc = #line] }
    } else {
        quote! {
            #(#docs)*
            #[doc = ""]
            #[doc = #line]
        }
    }
}

/// The method's `#[cfg]` and `#[deprecated]` attributes, for the binder and caller methods.
fn pass_through(m: &Method) -> TokenStream {
    let cfgs = &m.cfgs;
    let deprecated = &m.deprecated;
    quote! { #(#cfgs)* #(#deprecated)* }
}

fn lit(s: &str) -> LitStr {
    LitStr::new(s, Span::call_site())
}
